package agent

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/topology"
	"github.com/faultline-ml/faultline/trace"
)

// Config configures the agent of one node. The zero value of each field
// but Job, Command and Security is its documented default.
type Config struct {
	// Job is the job's identifier: the dotting folder, the checkpoint
	// segments' and the control plane's name for it; required (the
	// launcher takes MINDX_TASK_ID, --rdzv-id or a fresh one).
	Job string
	// Nodes is the number of nodes (default 1); NodeRank is this one's.
	Nodes, NodeRank int
	// MinNodes makes the job elastic (torchrun's --nnodes MIN:MAX, with
	// Nodes the MAX): it starts with the nodes there once MinNodes are,
	// after JoinTimeout more (default 30s) for the others, and goes on
	// with fewer, whole nodes, when nodes are lost and none takes their
	// place within NodeTimeout, down to MinNodes: Run then returns a
	// *Resized. A node that comes after (lost and back, or new, with any
	// NodeRank but 0) waits to join the job and is taken in at its next
	// restart point, up to Nodes: once the nodes that came bring the job to
	// Nodes, or JoinTimeout after the last came, at its ranks' next save;
	// Run returns a *Resized on every node then too. Default Nodes: the
	// membership is fixed. An elastic job's manager is node 0's.
	MinNodes    int
	JoinTimeout time.Duration
	// SpareNodes are nodes beyond the job's, node ranks Nodes to
	// Nodes+SpareNodes-1 (Nodes being the MAX of an elastic job): a spare
	// runs no rank, keeps warm interpreters and the replicas the job's
	// nodes send it, and takes a lost node's place once node 0's manager
	// declares the node lost (and a heartbeat interval more, for the nodes
	// lost with it), instead of the job waiting NodeTimeout for a
	// replacement. Its run then ends with a *Resized naming the node rank
	// it takes (the job's shape unchanged), whose Next keeps its warm
	// interpreters for the next run: run it, or they are killed when the
	// program exits. A spare needs node 0's manager.
	SpareNodes int
	// Restarts is the restart count the ranks start with: a job that goes
	// on resized counts on (Resized.Next sets it). The restart budget
	// counts the restarts after it. Generation is how many times an
	// elastic job changed its shape before this run: it names the job on
	// the control plane (Job-gN), so that no node reaches the manager of
	// the last shape.
	Restarts, Generation int
	// ProcsPerNode is the number of ranks on each node (default 1).
	ProcsPerNode int
	// MasterAddr and MasterPort are where rank 0 serves the ranks' store
	// (MASTER_ADDR, MASTER_PORT); default 127.0.0.1 and 29500.
	MasterAddr string
	MasterPort int
	// MaxRestarts is how many times the job's ranks may be restarted
	// together (torchrun's --max-restarts; default 0: none).
	MaxRestarts int
	// MonitorInterval is how often the agent looks at its ranks' rings
	// and slowness (default 20ms for the rings; slownode reads every
	// second). A rank's exit is seen at once whatever it says.
	MonitorInterval time.Duration
	// Command is what each rank runs: a script and its arguments, run by
	// Python; with NoPython, a program and its arguments; with Module, a
	// module run as python -m does. Required.
	Command  []string
	NoPython bool
	Module   bool
	// Python is the interpreter (default "python3").
	Python string
	// PythonPath is put first on each rank's PYTHONPATH, so that
	// "import faultline" works; the launcher extracts the package there.
	PythonPath string
	// NoSpares turns off the warm interpreter kept per rank, which has
	// imported torch while the node joined the job or since the rank's
	// last start, so that neither its first start nor a restart imports
	// it again (ignored with NoPython).
	NoSpares bool
	// GracePeriod bounds a termination (Agent.Terminate, on SIGTERM or
	// SIGINT): the ranks have its first three quarters to exit after the
	// signal, and the newest step in memory is persisted within the rest
	// (default 30s, torchrun's).
	GracePeriod time.Duration
	// CollectiveTimeout is how long a collective may run before it is a
	// hang; 0 learns it from the job's own collectives (hang's learned
	// timeouts, capped at 300 s).
	CollectiveTimeout time.Duration
	// Out is where every diagnosis goes: incidents.jsonl, slownode.json,
	// hang stacks and verdicts (default "faultline-out").
	Out string
	// TraceRoot is the dotting root; default Out/profiling.
	TraceRoot string
	// Switch is the profiling switch the job starts with; nil turns every
	// kind on (the slow-rank analysis and the incidents' step figures read
	// the dotting). SwitchFile, when set, is a profilingSwitch file (a
	// mounted ConfigMap) that node 0's manager follows instead; the
	// manager's TrainingDataTrace API changes it too.
	Switch     *trace.Switch
	SwitchFile string
	// ShmDir holds the checkpoint segments and rings; default /dev/shm.
	ShmDir string
	// Manager is the address of the job's taskd manager; "" runs one in
	// node 0's agent, which the nodes reach at MasterAddr, port
	// MasterPort+1. It listens on ManagerListen: default every interface
	// at that port, as the ranks' store listens, so that a MasterAddr that
	// names this host by another address (a host name that /etc/hosts maps
	// to 127.0.1.1) reaches it too.
	Manager       string
	ManagerListen string
	// HeartbeatDeadline is how long node 0's manager waits for a
	// heartbeat of a rank's worker before it declares the rank lost and
	// recovers the job (default 10s; a manager apart has its own); the
	// workers send one every sixth of it. The workers run in the agent, so
	// only a node's agent lost, or cut off, falls silent: a rank's own
	// fault is seen at once however long this is, and a loaded host's
	// late heartbeat is no loss.
	HeartbeatDeadline time.Duration
	// NodeTimeout is how long node 0's manager waits, once a node is lost
	// (its agent silent past HeartbeatDeadline), for a node of the same
	// node rank to join on any host and take its ranks, and how long a node
	// waits for the job's manager once it lost it (one not yet joined
	// waits at least 2 minutes); past it the job ends, the nodes left
	// persisting their newest step with the replicas they hold of the lost
	// nodes' ranks (default 10 minutes).
	NodeTimeout time.Duration
	// Replicas is how many other nodes hold a copy of each rank's newest
	// memory step, so that a lost node's ranks resume from their peers'
	// memory (default 1 when the job has several nodes; negative: none).
	// ReplicaPort is the first port of the node's replica servers, one
	// per local rank (default MasterPort+2 plus NodeRank*ProcsPerNode, so
	// that nodes sharing a host do not collide).
	Replicas    int
	ReplicaPort int
	// Topology is the switches the job's hosts hang from (DLRover's
	// node-topology-config): a rank's replicas go first to nodes under
	// another access switch than its own, so that losing a switch loses
	// no step. Nil: the nodes that follow in node-rank order.
	Topology *topology.Topology
	// Security of the control plane; required (Insecure for loopback).
	// Its token also keys the replicas' transfers.
	Security taskd.Security
	// Env is added to each rank's environment (default os.Environ()).
	Env []string
	// Stdout and Stderr receive the ranks' output, each line prefixed
	// with its rank (default os.Stdout, os.Stderr).
	Stdout, Stderr *os.File

	Registerer prometheus.Registerer // nil: no metrics
	Logger     *slog.Logger          // nil: silent

	warm map[int]*spareProc // the last run's warm interpreters, by local rank (Resized.Next)
	// Carried from run to run of an elastic job by Resized.Next:
	maxNodes   int     // the job's MAX: Nodes at its launch, which it grows back to
	launchRank int     // NodeRank at the launch: a node waiting to join is known by it
	joining    bool    // the node waits to join the job, running no rank (see Resized.Joining)
	grown      *growth // the first start of a run after the job took in nodes
	ckptDir    string  // the job's checkpoint folder as the last run knew it, before a rank names it
}

// errConfig is wrapped by every configuration error.
var errConfig = errors.New("agent: invalid configuration")

// Validate reports the first field that is wrong.
func (c Config) Validate() error {
	bad := func(field string, v any, why string) error {
		return fmt.Errorf("%w: %s = %v: %s", errConfig, field, v, why)
	}
	switch {
	case trace.ValidateJob(c.Job) != nil:
		return bad("Job", strconv.Quote(c.Job), trace.ValidateJob(c.Job).Error())
	case len(c.Command) == 0 || c.Command[0] == "":
		return bad("Command", c.Command, "name the script (or, with NoPython, the program) each rank runs")
	case c.Nodes < 0:
		return bad("Nodes", c.Nodes, "negative")
	case c.SpareNodes < 0:
		return bad("SpareNodes", c.SpareNodes, "negative")
	case c.SpareNodes > 0 && max(c.Nodes, c.maxNodes) < 2: // an elastic job's runs keep their spares down to 1 node
		return bad("SpareNodes", c.SpareNodes, "a spare takes a lost node's place, and a job of one node ends with its node 0: give Nodes at least 2")
	case c.SpareNodes > 0 && c.Manager != "":
		return bad("SpareNodes", c.SpareNodes, "node 0's manager hands a lost node's place to a spare: drop Manager")
	case c.NodeRank < 0 || c.NodeRank >= c.positions():
		return bad("NodeRank", c.NodeRank, fmt.Sprintf("outside [0, %d)", c.positions()))
	case c.MinNodes < 0 || c.MinNodes > max(c.Nodes, 1):
		return bad("MinNodes", c.MinNodes, fmt.Sprintf("outside [1, Nodes = %d]", max(c.Nodes, 1)))
	case c.MinNodes > 0 && c.MinNodes < c.Nodes && c.Manager != "":
		return bad("MinNodes", c.MinNodes, "an elastic job's manager is node 0's, whose shape changes with the job's: drop Manager")
	case c.JoinTimeout < 0:
		return bad("JoinTimeout", c.JoinTimeout, "negative")
	case c.Restarts < 0:
		return bad("Restarts", c.Restarts, "negative")
	case c.Generation < 0:
		return bad("Generation", c.Generation, "negative")
	case c.ProcsPerNode < 0:
		return bad("ProcsPerNode", c.ProcsPerNode, "negative")
	case c.MasterPort < 0 || c.MasterPort > 65534:
		return bad("MasterPort", c.MasterPort, "outside [0, 65534]")
	case c.MaxRestarts < 0:
		return bad("MaxRestarts", c.MaxRestarts, "negative")
	case c.MonitorInterval < 0:
		return bad("MonitorInterval", c.MonitorInterval, "negative")
	case c.HeartbeatDeadline < 0:
		return bad("HeartbeatDeadline", c.HeartbeatDeadline, "negative")
	case c.GracePeriod < 0:
		return bad("GracePeriod", c.GracePeriod, "negative")
	case c.CollectiveTimeout < 0:
		return bad("CollectiveTimeout", c.CollectiveTimeout, "negative")
	case c.NodeTimeout < 0:
		return bad("NodeTimeout", c.NodeTimeout, "negative")
	case c.ReplicaPort < 0 || c.ReplicaPort > 65535:
		return bad("ReplicaPort", c.ReplicaPort, "outside [0, 65535]")
	case c.Module && c.NoPython:
		return bad("Module", c.Module, "a module needs Python: drop NoPython")
	}
	return nil
}

func (c *Config) setDefaults() {
	c.Nodes = max(c.Nodes, 1)
	if c.maxNodes == 0 { // the job's first run
		c.maxNodes, c.launchRank = c.Nodes, c.NodeRank
	}
	c.ProcsPerNode = max(c.ProcsPerNode, 1)
	if c.MinNodes == 0 {
		c.MinNodes = c.Nodes
	}
	c.JoinTimeout = cmp.Or(c.JoinTimeout, 30*time.Second)
	c.MasterAddr = cmp.Or(c.MasterAddr, "127.0.0.1")
	c.MasterPort = cmp.Or(c.MasterPort, 29500)
	c.MonitorInterval = cmp.Or(c.MonitorInterval, 20*time.Millisecond)
	c.GracePeriod = cmp.Or(c.GracePeriod, 30*time.Second)
	c.HeartbeatDeadline = cmp.Or(c.HeartbeatDeadline, 10*time.Second)
	c.NodeTimeout = cmp.Or(c.NodeTimeout, 10*time.Minute)
	if c.Replicas == 0 && c.Nodes > 1 {
		c.Replicas = 1
	}
	c.ReplicaPort = cmp.Or(c.ReplicaPort, c.MasterPort+2+c.NodeRank*c.ProcsPerNode)
	c.Python = cmp.Or(c.Python, "python3")
	c.Out = cmp.Or(c.Out, "faultline-out")
	if abs, err := filepath.Abs(c.Out); err == nil {
		c.Out = abs
	}
	c.TraceRoot = cmp.Or(c.TraceRoot, filepath.Join(c.Out, "profiling"))
	c.ShmDir = cmp.Or(c.ShmDir, "/dev/shm")
	c.ManagerListen = cmp.Or(c.ManagerListen, ":"+strconv.Itoa(c.MasterPort+1))
	if c.Env == nil {
		c.Env = os.Environ()
	}
	c.Stdout = cmp.Or(c.Stdout, os.Stdout)
	c.Stderr = cmp.Or(c.Stderr, os.Stderr)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// heartbeats returns how often the workers send a heartbeat and how long
// the manager waits for one.
func (c *Config) heartbeats() (interval, deadline time.Duration) {
	return c.HeartbeatDeadline / 6, c.HeartbeatDeadline
}

// spare reports whether this node runs no rank: one of the job's spare
// nodes, or a node that waits to join it.
func (c *Config) spare() bool { return c.NodeRank >= c.Nodes }

// growable reports whether the job may take in nodes: an elastic one,
// up to its MAX.
func (c *Config) growable() bool { return c.MinNodes < c.maxNodes }

// joinBase is the first of the positions at which nodes wait to join an
// elastic job: past its MAX nodes and spares, so that no shape of the job
// reaches them. A node waits at joinBase plus its launch rank, which no
// other node has.
func (c *Config) joinBase() int { return c.maxNodes + c.SpareNodes }

// positions bounds the node ranks of the job's control plane: its nodes,
// its spares, and in an elastic job the nodes waiting to join it.
func (c *Config) positions() int {
	if c.joining {
		return 2 * c.joinBase()
	}
	return max(c.Nodes, 1) + c.SpareNodes
}

// world is the number of ranks of the job.
func (c *Config) world() int { return c.Nodes * c.ProcsPerNode }
