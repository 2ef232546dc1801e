package netcheck

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// DevicePair is two accelerators of one node whose direct link the
// switchbox check measures.
type DevicePair struct {
	A, B int
}

// String returns "a:b", as ParseDevicePairs reads it.
func (p DevicePair) String() string { return strconv.Itoa(p.A) + ":" + strconv.Itoa(p.B) }

// MarshalText writes the pair as "a:b".
func (p DevicePair) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// UnmarshalText reads "a:b".
func (p *DevicePair) UnmarshalText(b []byte) error {
	pairs, err := ParseDevicePairs(string(b))
	if err != nil {
		return err
	}
	if len(pairs) != 1 {
		return fmt.Errorf("netcheck: device pair %q: want one a:b", b)
	}
	*p = pairs[0]
	return nil
}

// DevicePairs is a list of pairs as mxDlrover's --switchbox-check takes
// it: "0:1 2:4 3:5 6:7".
type DevicePairs []DevicePair

// DefaultDevicePairs are the pairs checked unless told otherwise.
const DefaultDevicePairs = "0:1 2:4 3:5 6:7"

// ParseDevicePairs reads pairs "a:b" separated by blanks or commas. Device
// numbers are decimal and non-negative, the two ends of a pair differ, and
// no pair is listed twice.
func ParseDevicePairs(s string) (DevicePairs, error) {
	var out DevicePairs
	seen := map[DevicePair]bool{}
	fields := strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r' })
	for i, f := range fields {
		a, b, ok := strings.Cut(f, ":")
		x, errA := device(a)
		y, errB := device(b)
		switch {
		case !ok || errA != nil || errB != nil:
			return nil, fmt.Errorf("netcheck: device pair %d %q: want a:b with device numbers", i+1, f)
		case x == y:
			return nil, fmt.Errorf("netcheck: device pair %d %q: a device paired with itself", i+1, f)
		}
		p := DevicePair{x, y}
		if seen[p] || seen[DevicePair{y, x}] {
			return nil, fmt.Errorf("netcheck: device pair %d %q: listed twice", i+1, f)
		}
		seen[p] = true
		out = append(out, p)
	}
	return out, nil
}

func device(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || s[0] == '+' || n > math.MaxInt32 {
		return 0, errors.New("bad device number")
	}
	return n, nil
}

// String writes the pairs as ParseDevicePairs reads them.
func (ps DevicePairs) String() string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, " ")
}

// DeviceProber measures the direct link between two accelerators of this
// node: a copy between their memories through the switch or the device
// interconnect. The accelerator backend (package npu) implements it.
type DeviceProber interface {
	// ProbeDevices returns the bandwidth in bytes per second from device a
	// to device b, by ctx's deadline. A missing device is an error.
	ProbeDevices(ctx context.Context, a, b int) (float64, error)
}

// SwitchboxConfig configures a Switchbox. The zero value of every field but
// Prober is a documented default, mxDlrover's.
type SwitchboxConfig struct {
	// Pairs to check. Default DefaultDevicePairs.
	Pairs DevicePairs
	// MinBandwidth in bytes per second a pair must exceed to pass.
	// Default 10000 MB/s.
	MinBandwidth float64
	// MinChannels is how many pairs must pass for the node to pass.
	// Default 2.
	MinChannels int
	// Timeout bounds the whole check; pairs not measured by then fail.
	// Default 10 s.
	Timeout time.Duration
	// Prober measures one pair. Required.
	Prober DeviceProber
	// Logger receives failed pairs; nil discards them.
	Logger *slog.Logger
	// Registerer receives the check's metrics; nil means none.
	Registerer prometheus.Registerer
}

// Validate reports a field that cannot work.
func (c SwitchboxConfig) Validate() error {
	var errs []error
	if c.Prober == nil {
		errs = append(errs, errors.New("SwitchboxConfig.Prober is required"))
	}
	if c.MinBandwidth < 0 || math.IsNaN(c.MinBandwidth) || math.IsInf(c.MinBandwidth, 0) {
		errs = append(errs, fmt.Errorf("SwitchboxConfig.MinBandwidth = %v: want a finite value ≥ 0", c.MinBandwidth))
	}
	if c.MinChannels < 0 {
		errs = append(errs, fmt.Errorf("SwitchboxConfig.MinChannels = %d: must not be negative", c.MinChannels))
	}
	if c.Timeout < 0 {
		errs = append(errs, fmt.Errorf("SwitchboxConfig.Timeout = %v: must not be negative", c.Timeout))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("netcheck: %w", err)
	}
	return nil
}

// Switchbox checks the device links of one node, as mxDlrover's
// --switchbox-check does.
type Switchbox struct {
	cfg       SwitchboxConfig
	log       *slog.Logger
	reg       *promreg.Registrar
	checks    *prometheus.CounterVec
	bandwidth *prometheus.GaugeVec
}

// NewSwitchbox returns a switchbox check for cfg. Its metrics are
// registered on cfg.Registerer until Close.
func NewSwitchbox(cfg SwitchboxConfig) (*Switchbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Pairs == nil {
		cfg.Pairs, _ = ParseDevicePairs(DefaultDevicePairs)
	}
	cfg.MinBandwidth = cmp.Or(cfg.MinBandwidth, 10000e6)
	cfg.MinChannels = cmp.Or(cfg.MinChannels, 2)
	cfg.Timeout = cmp.Or(cfg.Timeout, 10*time.Second)
	if cfg.MinChannels > len(cfg.Pairs) {
		return nil, fmt.Errorf("netcheck: SwitchboxConfig.MinChannels = %d: more than the %d pairs", cfg.MinChannels, len(cfg.Pairs))
	}
	log := cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	r := promreg.New(cfg.Registerer, "netcheck: SwitchboxConfig.Registerer")
	f := promauto.With(r)
	s := &Switchbox{
		cfg: cfg,
		log: log,
		reg: r,
		checks: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_netcheck_switchbox_checks_total",
			Help: "Switchbox checks, by result (pass, fail).",
		}, []string{"result"}),
		bandwidth: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "faultline_netcheck_switchbox_pair_bandwidth_bytes_per_second",
			Help: "Bandwidth of each device pair at the last switchbox check; 0 when it failed.",
		}, []string{"pair"}),
	}
	if err := r.Err(); err != nil {
		return nil, err
	}
	return s, nil
}

// Close unregisters the switchbox's metrics, so that another may use the
// Registerer. It is idempotent.
func (s *Switchbox) Close() error {
	s.reg.UnregisterAll()
	return nil
}

// SwitchboxResult is the outcome of a switchbox check.
type SwitchboxResult struct {
	Pass         bool         `json:"pass"`
	Passed       int          `json:"passed"`
	MinChannels  int          `json:"min_channels"`
	MinBandwidth float64      `json:"min_bandwidth_bytes_per_second"`
	Pairs        []PairResult `json:"pairs"`
}

// PairResult is the measurement of one device pair.
type PairResult struct {
	Pair      DevicePair `json:"pair"`
	Bandwidth float64    `json:"bandwidth_bytes_per_second"`
	Pass      bool       `json:"pass"`
	Error     string     `json:"error,omitempty"`
}

// Check measures the pairs one after another within the timeout: a pair
// passes above MinBandwidth, the node passes when at least MinChannels
// pairs pass. A pair whose probe fails, or is not reached in time, fails;
// a prober that ignores ctx is left to finish in the background and its
// late answer is dropped.
func (s *Switchbox) Check(ctx context.Context) *SwitchboxResult {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	res := &SwitchboxResult{MinChannels: s.cfg.MinChannels, MinBandwidth: s.cfg.MinBandwidth}
	for _, p := range s.cfg.Pairs {
		pr := PairResult{Pair: p}
		bw, err := s.probe(ctx, p)
		switch {
		case err != nil:
			pr.Error = err.Error()
		case !(bw > s.cfg.MinBandwidth):
			pr.Bandwidth = bw
			pr.Error = fmt.Sprintf("%.0f MB/s, not above %.0f MB/s", bw/1e6, s.cfg.MinBandwidth/1e6)
		default:
			pr.Bandwidth, pr.Pass = bw, true
			res.Passed++
		}
		if !pr.Pass {
			s.log.Warn("netcheck: switchbox pair failed", "pair", p.String(), "err", pr.Error)
		}
		s.bandwidth.WithLabelValues(p.String()).Set(pr.Bandwidth)
		res.Pairs = append(res.Pairs, pr)
	}
	res.Pass = res.Passed >= s.cfg.MinChannels
	result := "fail"
	if res.Pass {
		result = "pass"
	}
	s.checks.WithLabelValues(result).Inc()
	return res
}

// probe runs one pair, returning by ctx's deadline whatever the prober
// does, and turning a panic in it into a failed pair.
func (s *Switchbox) probe(ctx context.Context, p DevicePair) (float64, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("not measured: %w", err)
	}
	type answer struct {
		bw  float64
		err error
	}
	done := make(chan answer, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- answer{err: fmt.Errorf("device prober panicked: %v", r)}
			}
		}()
		bw, err := s.cfg.Prober.ProbeDevices(ctx, p.A, p.B)
		done <- answer{bw, err}
	}()
	select {
	case a := <-done:
		if a.err == nil && (math.IsNaN(a.bw) || math.IsInf(a.bw, 0)) {
			a.err = fmt.Errorf("device prober returned %v", a.bw)
		}
		return a.bw, a.err
	case <-ctx.Done():
		return 0, fmt.Errorf("no answer: %w", ctx.Err())
	}
}

// WriteText writes the result for people.
func (r *SwitchboxResult) WriteText(w io.Writer) error {
	verdict := "FAIL"
	if r.Pass {
		verdict = "PASS"
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "switchbox: %s, %d of %d pairs above %.0f MB/s (need %d)\n",
		verdict, r.Passed, len(r.Pairs), r.MinBandwidth/1e6, r.MinChannels)
	for _, p := range r.Pairs {
		status := "pass"
		if !p.Pass {
			status = "fail"
		}
		fmt.Fprintf(tw, "%s\t%s\t%.0f MB/s\t%s\n", p.Pair, status, p.Bandwidth/1e6, p.Error)
	}
	return tw.Flush()
}
