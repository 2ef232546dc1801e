package hang

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// Defaults of Config's fields.
const (
	DefaultTimeout          = 300 * time.Second // xpu_timer's XPU_TIMER_HANG_TIMEOUT
	DefaultLearnFactor      = 5.0
	DefaultLearnFloor       = 10 * time.Second
	DefaultLearnMinSamples  = 50
	DefaultLearnWindow      = 1024
	DefaultHeartbeatTimeout = 600 * time.Millisecond
	DefaultTick             = 100 * time.Millisecond
	DefaultCaptureTimeout   = 60 * time.Second
)

// Config configures a Watchdog. The zero value watches rank 0 of a job of
// one with the defaults below.
type Config struct {
	// Rank and World name the watched process in metrics, faults and its
	// stack file. World 0 means 1.
	Rank, World int
	// Host names the node in stack files. "" means os.Hostname().
	Host string

	// Timeout is the fixed op timeout: an op running longer is a hang.
	// 0 means DefaultTimeout (300 s, as xpu_timer). It also caps learned
	// timeouts.
	Timeout time.Duration
	// LearnTimeouts turns on learned timeouts: once an op (name and group)
	// has completed LearnMinSamples times, its timeout becomes the p99 of
	// its last LearnWindow durations times LearnFactor, at least
	// LearnFloor and at most Timeout. Ops flagged as hung are not learned
	// from. A healthy job then gets a hang verdict in seconds.
	LearnTimeouts bool
	// LearnFactor multiplies the p99. 0 means DefaultLearnFactor (5).
	LearnFactor float64
	// LearnFloor is the least learned timeout. 0 means DefaultLearnFloor
	// (10 s).
	LearnFloor time.Duration
	// LearnMinSamples is how many durations an op needs before its timeout
	// is learned. 0 means DefaultLearnMinSamples (50).
	LearnMinSamples int
	// LearnWindow is how many recent durations are kept per op (a fixed
	// ring, 8 bytes each). 0 means DefaultLearnWindow (1024).
	LearnWindow int

	// HeartbeatTimeout is how long a heartbeat may stay silent before it
	// is a fault. 0 means DefaultHeartbeatTimeout (600 ms): with beats
	// every 100 ms or more often and the default Tick, a stopped
	// heartbeat is reported within 1 s of its last beat.
	HeartbeatTimeout time.Duration
	// Tick is how often Run checks timeouts and heartbeats. 0 means
	// DefaultTick (100 ms). Op errors are reported at once, not on a tick.
	Tick time.Duration

	// DumpDir, when set, is where Run writes the watched process's stack
	// file (FileName(Rank, World)) when an op hangs or a heartbeat stops.
	DumpDir string
	// Pid is the watched process whose stacks are taken and which StopOn
	// stops. 0 means this process (its goroutine stacks).
	Pid int
	// CaptureTimeout bounds one stack capture. 0 means
	// DefaultCaptureTimeout (60 s).
	CaptureTimeout time.Duration

	// StopOn lists the fault kinds after which Run stops the watched
	// process (once its stacks are written), so that the scheduler
	// restarts it at once instead of after a 30-minute communication
	// timeout. 0: never.
	StopOn FaultKind
	// StopSignal is the signal that stops it. 0 means SIGKILL.
	StopSignal syscall.Signal
	// Stop, when set, replaces sending StopSignal to Pid. It runs on Run's
	// responding goroutine and must not call Close.
	Stop func(context.Context, Fault) error

	// OnFault is called for every fault, from the goroutine that calls
	// Check (Run's), before stacks are taken. It must not block or call
	// Check or Close.
	OnFault func(Fault)

	// Now tells the time; tests set a fake clock so that timeouts are
	// checked without sleeping. nil means time.Now.
	Now func() time.Time
	// Registerer receives the metrics (see the package documentation).
	// nil: no metrics.
	Registerer prometheus.Registerer
	// TracerProvider traces stack dumps. nil: no tracing.
	TracerProvider trace.TracerProvider
	// Logger logs faults and dumps. nil: no logs.
	Logger *slog.Logger
}

// Validate reports the first field that is out of range, by name.
func (c Config) Validate() error {
	world := cmp.Or(c.World, 1)
	switch {
	case c.World < 0 || c.World > maxRank:
		return fmt.Errorf("hang: Config.World %d: must be in [0, %d]", c.World, maxRank)
	case c.Rank < 0 || c.Rank >= world:
		return fmt.Errorf("hang: Config.Rank %d: must be in [0, World=%d)", c.Rank, world)
	case c.Timeout < 0:
		return fmt.Errorf("hang: Config.Timeout %v: must not be negative", c.Timeout)
	case c.LearnFactor < 0 || math.IsNaN(c.LearnFactor) || math.IsInf(c.LearnFactor, 0):
		return fmt.Errorf("hang: Config.LearnFactor %v: must be a finite number, 0 or more", c.LearnFactor)
	case c.LearnFactor != 0 && c.LearnFactor < 1:
		return fmt.Errorf("hang: Config.LearnFactor %v: must be at least 1 (or 0 for the default)", c.LearnFactor)
	case c.LearnFloor < 0:
		return fmt.Errorf("hang: Config.LearnFloor %v: must not be negative", c.LearnFloor)
	case c.LearnMinSamples < 0:
		return fmt.Errorf("hang: Config.LearnMinSamples %d: must not be negative", c.LearnMinSamples)
	case c.LearnWindow < 0 || c.LearnWindow > 1<<20:
		return fmt.Errorf("hang: Config.LearnWindow %d: must be in [0, %d]", c.LearnWindow, 1<<20)
	case c.HeartbeatTimeout < 0:
		return fmt.Errorf("hang: Config.HeartbeatTimeout %v: must not be negative", c.HeartbeatTimeout)
	case c.Tick < 0:
		return fmt.Errorf("hang: Config.Tick %v: must not be negative", c.Tick)
	case c.Pid < 0:
		return fmt.Errorf("hang: Config.Pid %d: must not be negative", c.Pid)
	case c.CaptureTimeout < 0:
		return fmt.Errorf("hang: Config.CaptureTimeout %v: must not be negative", c.CaptureTimeout)
	case c.StopOn&^faultKindsAll != 0:
		return fmt.Errorf("hang: Config.StopOn %#x: unknown fault kinds", uint8(c.StopOn))
	case c.StopSignal < 0:
		return fmt.Errorf("hang: Config.StopSignal %d: must not be negative", c.StopSignal)
	}
	return nil
}

// withDefaults returns c with zero fields set to their defaults.
func (c Config) withDefaults() Config {
	c.World = cmp.Or(c.World, 1)
	c.Timeout = cmp.Or(c.Timeout, DefaultTimeout)
	c.LearnFactor = cmp.Or(c.LearnFactor, DefaultLearnFactor)
	c.LearnFloor = cmp.Or(c.LearnFloor, DefaultLearnFloor)
	c.LearnMinSamples = cmp.Or(c.LearnMinSamples, DefaultLearnMinSamples)
	c.LearnWindow = cmp.Or(c.LearnWindow, DefaultLearnWindow)
	c.LearnMinSamples = min(c.LearnMinSamples, c.LearnWindow)
	c.HeartbeatTimeout = cmp.Or(c.HeartbeatTimeout, DefaultHeartbeatTimeout)
	c.Tick = cmp.Or(c.Tick, DefaultTick)
	c.CaptureTimeout = cmp.Or(c.CaptureTimeout, DefaultCaptureTimeout)
	c.StopSignal = cmp.Or(c.StopSignal, syscall.SIGKILL)
	return c
}
