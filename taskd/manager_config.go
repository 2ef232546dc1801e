package taskd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/taskd/lease"
	"github.com/faultline-ml/faultline/trace"
	"github.com/prometheus/client_golang/prometheus"
	oteltrace "go.opentelemetry.io/otel/trace"
)

// SwitchSource feeds the manager profiling switches from outside the
// control plane, such as a mounted ConfigMap file. Watch calls set with the
// source's switch at once and after each change until ctx ends; a document
// that does not parse is the source's to report, and the switch in force
// stays.
type SwitchSource interface {
	Watch(ctx context.Context, set func(trace.Switch)) error
}

// ManagerConfig configures a Manager. The zero value of each field but Job
// means its documented default.
type ManagerConfig struct {
	// Job is the job's identifier (MINDX_TASK_ID); required. Members of
	// another job are refused.
	Job string
	// Listen is the address to serve on; default ":9601".
	Listen string
	// Nodes and ProcsPerNode give the job's shape, so that ranks that never
	// registered show as waiting in the switch status, and positions
	// outside it are refused. Zero: unknown, and nodes and ranks must be
	// below MaxWorkers (default 16384); with Orchestration set, the job's
	// ranks are then those of its first complete rendezvous (ranks 0 to
	// n-1 registered, none missing, and that run not grown for twice
	// HeartbeatDeadline), and a rank beyond them is refused, saying why,
	// or dropped when it joined past a gap, so that a member that joins
	// as a rank of its own cannot start a recovery of the others. A job
	// whose ranks may join past a missing one gives its shape.
	Nodes, ProcsPerNode int
	MaxWorkers          int
	// SpareNodes are nodes beyond the shape, Nodes to Nodes+SpareNodes-1
	// (their ranks following the job's), whose workers are spares: they
	// register, beat and exchange messages as the job's workers do, but
	// are no ranks of the job. AllWorkers leaves them out (NodeWorkers
	// reaches them), so orchestration neither targets nor waits for them;
	// their loss is no fault (handlers see an EventLeft whose
	// Departure.Left is unset), and the job completes without them. It
	// needs the shape.
	SpareNodes int
	// Security: mutual TLS, token, or plaintext when asked; required.
	Security Security
	// AdminToken is the operators' credential: the Admin and
	// TrainingDataTrace services take a call only with it, and it serves
	// nothing else. Empty: with Security.Token set, those services refuse
	// every call; without any token they take whoever the transport
	// admits (logged at start).
	AdminToken string
	// ProxyToken is the proxies' credential: only a call with it
	// registers as a proxy, so that a worker's token cannot. Proxies
	// present it as ProxyConfig.UpstreamToken. Empty: the proxy role is
	// closed, and workers attach to the manager directly; whatever starts
	// the manager and its proxies makes one and hands it to both.
	ProxyToken string
	// HeartbeatInterval is how often members send heartbeats (default 1 s);
	// a member not heard from within HeartbeatDeadline (default 5 s) is
	// declared lost and a FaultLost is raised.
	HeartbeatInterval, HeartbeatDeadline time.Duration
	// AckTimeout is how long a downward message waits for its
	// acknowledgement before it is sent again (default 3 s, backing off to
	// 30 s). DeliveryTimeout bounds Broadcast (default 30 s).
	AckTimeout, DeliveryTimeout time.Duration
	// MaxMessageBytes caps every message received or sent (default 4 MiB).
	MaxMessageBytes int
	// RateLimit is calls per second allowed on each connection (default
	// 2000, burst RateBurst default twice that); negative means unlimited.
	RateLimit float64
	RateBurst int
	// MaxConnections bounds the connections open at once (default half
	// the process's open-file limit, at most 16384), and
	// MaxConnectionsPerPeer those from one peer address that
	// authenticated (default 256), and apart from them those that have
	// not yet: a new one past that closes the oldest pending. More are
	// refused, counted and logged.
	MaxConnections, MaxConnectionsPerPeer int
	// StateDir, when set, keeps the fault log (faults.jsonl), the switch
	// (switch.json) and the orchestration state (orchestration.json and
	// orchestration-history.json) across restarts, so that a manager that
	// restarts, or a standby that takes the lease over on a shared
	// filesystem, finishes the orchestration in progress. Faults are
	// acknowledged to reporters only after they are synced there, and
	// every change of an orchestration is written there before the
	// manager acts on it. manager.json names the job the folder is
	// for. A state of another job, of an unknown version or of a newer
	// lease term is refused (*StateFileError) and left as it is.
	StateDir string
	// MaxFaults bounds the fault log; the oldest go first (default 10000).
	MaxFaults int
	// CollectDir receives collected dotting and stack files as
	// <CollectDir>/<job>/node-<n>/...; empty refuses collection.
	// MaxCollectBytes caps the bytes one Collect takes in (default 1 GiB).
	CollectDir      string
	MaxCollectBytes int64
	// SwitchSource, when set, is watched for switch changes.
	SwitchSource SwitchSource
	// Handlers run on every event (see Handler).
	Handlers []Handler
	// Orchestration, when set, turns on process-level recovery from the
	// faults taken in, and link switches and stress tests on request
	// (see OrchestrationConfig); nil: off.
	Orchestration *OrchestrationConfig
	// Term, when set, is the lease term under which this manager leads the
	// job, one of several (see package lease): the manager serves until
	// the term ends, and Run then returns its cause (wrapping
	// lease.ErrLost). Every command it sends carries the term's fencing
	// token, and members refuse the commands of an older term than the
	// newest they have seen; a member that has seen a newer term than
	// this one is refused and has the manager check its term with the
	// lease. It confirms the term (Term.Check) before each
	// act of an orchestration, and writes its state in StateDir only over
	// a state of no newer term. Nil: this manager leads alone.
	Term lease.Term
	// Observability; nil means off.
	Registerer     prometheus.Registerer
	TracerProvider oteltrace.TracerProvider
	Logger         *slog.Logger
}

func (c *ManagerConfig) setDefaults() {
	c.Listen = orDefault(c.Listen, DefaultManagerAddr)
	c.HeartbeatInterval = orDefault(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.HeartbeatDeadline = orDefault(c.HeartbeatDeadline, DefaultHeartbeatDeadline)
	c.AckTimeout = orDefault(c.AckTimeout, defaultAckTimeout)
	c.DeliveryTimeout = orDefault(c.DeliveryTimeout, 30*time.Second)
	c.MaxMessageBytes = orDefault(c.MaxMessageBytes, defaultMaxMessageBytes)
	c.RateLimit = orDefault(c.RateLimit, defaultRateLimit)
	c.RateBurst = orDefault(c.RateBurst, int(2*c.RateLimit))
	c.MaxConnections = orDefault(c.MaxConnections, defaultMaxConnections())
	c.MaxConnectionsPerPeer = orDefault(c.MaxConnectionsPerPeer, defaultMaxConnectionsPerPeer)
	c.MaxFaults = orDefault(c.MaxFaults, 10000)
	c.MaxWorkers = orDefault(c.MaxWorkers, defaultMaxWorkers)
	c.MaxCollectBytes = orDefault(c.MaxCollectBytes, 1<<30)
}

// negative reports whether any of ds is negative.
func negative(ds ...time.Duration) bool {
	return slices.ContainsFunc(ds, func(d time.Duration) bool { return d < 0 })
}

// negativeDuration returns the error that names the first negative one of
// the fields of config given as name, value pairs.
func negativeDuration(config string, fields ...any) error {
	for i := 0; i+1 < len(fields); i += 2 {
		if d, _ := fields[i+1].(time.Duration); d < 0 {
			return fmt.Errorf("taskd: %s.%s: %v is negative", config, fields[i], d)
		}
	}
	return nil
}

// Validate reports the first field that is wrong.
func (c ManagerConfig) Validate() error {
	switch {
	case c.Job == "":
		return errors.New("taskd: ManagerConfig.Job: empty")
	case strings.ContainsAny(c.Job, "/\\\x00") || c.Job == "." || c.Job == "..":
		return fmt.Errorf("taskd: ManagerConfig.Job: %q is not a single path element", c.Job)
	case c.Nodes < 0:
		return fmt.Errorf("taskd: ManagerConfig.Nodes: %d is negative", c.Nodes)
	case c.ProcsPerNode < 0:
		return fmt.Errorf("taskd: ManagerConfig.ProcsPerNode: %d is negative", c.ProcsPerNode)
	case c.SpareNodes < 0:
		return fmt.Errorf("taskd: ManagerConfig.SpareNodes: %d is negative", c.SpareNodes)
	case c.SpareNodes > 0 && (c.Nodes == 0 || c.ProcsPerNode == 0):
		return fmt.Errorf("taskd: ManagerConfig.SpareNodes: %d without the job's shape (Nodes and ProcsPerNode): spares are the nodes beyond it", c.SpareNodes)
	case c.MaxWorkers < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxWorkers: %d is negative", c.MaxWorkers)
	case negative(c.HeartbeatInterval, c.HeartbeatDeadline, c.AckTimeout, c.DeliveryTimeout):
		return negativeDuration("ManagerConfig", "HeartbeatInterval", c.HeartbeatInterval, "HeartbeatDeadline", c.HeartbeatDeadline,
			"AckTimeout", c.AckTimeout, "DeliveryTimeout", c.DeliveryTimeout)
	case c.HeartbeatDeadline != 0 && c.HeartbeatDeadline <= c.HeartbeatInterval:
		return fmt.Errorf("taskd: ManagerConfig.HeartbeatDeadline: %v is not above HeartbeatInterval %v", c.HeartbeatDeadline, orDefault(c.HeartbeatInterval, DefaultHeartbeatInterval))
	case c.MaxMessageBytes < 0 || (c.MaxMessageBytes > 0 && c.MaxMessageBytes < 64<<10):
		return fmt.Errorf("taskd: ManagerConfig.MaxMessageBytes: %d is below 64 KiB", c.MaxMessageBytes)
	case c.MaxConnections < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxConnections: %d is negative", c.MaxConnections)
	case c.MaxConnectionsPerPeer < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxConnectionsPerPeer: %d is negative", c.MaxConnectionsPerPeer)
	case c.MaxFaults < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxFaults: %d is negative", c.MaxFaults)
	case c.MaxCollectBytes < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxCollectBytes: %d is negative", c.MaxCollectBytes)
	}
	for i, h := range c.Handlers {
		if h.Name == "" || h.Handle == nil {
			return fmt.Errorf("taskd: ManagerConfig.Handlers[%d]: needs a Name and a Handle func", i)
		}
	}
	tokens := []struct{ field, token string }{{"ManagerConfig.Security.Token", c.Security.Token}, {"ManagerConfig.AdminToken", c.AdminToken}, {"ManagerConfig.ProxyToken", c.ProxyToken}}
	for i, t := range tokens {
		if err := checkToken(t.field, t.token); err != nil {
			return err
		}
		for _, u := range tokens[:i] {
			if t.token != "" && t.token == u.token {
				return fmt.Errorf("taskd: %s: the same as %s; each credential needs a token of its own", t.field, u.field)
			}
		}
	}
	if c.Orchestration != nil {
		if err := c.Orchestration.validate(); err != nil {
			return err
		}
	}
	return c.Security.Validate()
}

// roles says who each role takes, as log attributes: the manager logs
// them as it starts.
func (c ManagerConfig) roles() []any {
	workers := "anyone who reaches the port (plaintext, no token)"
	switch {
	case c.Security.Token != "":
		workers = "the members' token"
	case c.Security.tls():
		workers = "a certificate of the CA (mutual TLS)"
	}
	proxies := "closed (no ProxyToken)"
	if c.ProxyToken != "" {
		proxies = "the proxies' token"
	}
	operators := "whoever the transport admits (no AdminToken)"
	switch {
	case c.AdminToken != "":
		operators = "the operators' token"
	case c.Security.Token != "":
		operators = "closed (no AdminToken)"
	}
	return []any{"workers", workers, "proxies", proxies, "operators", operators}
}
