package netcheck

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// devices stands in for an accelerator backend, which this machine lacks:
// a bandwidth per pair, an error for a missing device, or a hang.
type devices struct {
	bw      map[DevicePair]float64
	missing map[int]bool
	hang    map[DevicePair]chan struct{} // blocks until closed, ignoring ctx
	panics  map[DevicePair]bool
}

func (d *devices) ProbeDevices(ctx context.Context, a, b int) (float64, error) {
	p := DevicePair{a, b}
	if d.missing[a] || d.missing[b] {
		return 0, fmt.Errorf("device %d or %d not found", a, b)
	}
	if ch, ok := d.hang[p]; ok {
		<-ch
	}
	if d.panics[p] {
		panic("driver fault")
	}
	return d.bw[p], nil
}

func TestSwitchbox(t *testing.T) {
	fast := 20000e6
	for _, tc := range []struct {
		name   string
		dev    *devices
		pass   bool
		passed int
	}{
		{"all pass", &devices{bw: map[DevicePair]float64{{0, 1}: fast, {2, 4}: fast, {3, 5}: fast, {6, 7}: fast}}, true, 4},
		{"two pass", &devices{bw: map[DevicePair]float64{{0, 1}: fast, {2, 4}: 9000e6, {3, 5}: fast, {6, 7}: 10000e6}}, true, 2},
		{"one pass", &devices{bw: map[DevicePair]float64{{0, 1}: fast, {2, 4}: 100e6}}, false, 1},
		{"missing devices", &devices{bw: map[DevicePair]float64{{0, 1}: fast, {2, 4}: fast}, missing: map[int]bool{5: true, 6: true}}, true, 2},
		{"panicking driver", &devices{bw: map[DevicePair]float64{{0, 1}: fast, {2, 4}: fast}, panics: map[DevicePair]bool{{3, 5}: true}}, true, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			s, err := NewSwitchbox(SwitchboxConfig{Prober: tc.dev, Registerer: reg})
			if err != nil {
				t.Fatal(err)
			}
			res := s.Check(context.Background())
			if res.Pass != tc.pass || res.Passed != tc.passed || len(res.Pairs) != 4 {
				t.Fatalf("result %+v, want pass=%v passed=%d", res, tc.pass, tc.passed)
			}
			for _, p := range res.Pairs {
				if !p.Pass && p.Error == "" {
					t.Fatalf("failed pair %v without a reason", p.Pair)
				}
			}
			want := "fail"
			if tc.pass {
				want = "pass"
			}
			if got := metric(t, reg, "faultline_netcheck_switchbox_checks_total", want); got != 1 {
				t.Fatalf("checks_total{%s} = %v", want, got)
			}
			if got := metric(t, reg, "faultline_netcheck_switchbox_pair_bandwidth_bytes_per_second", "0:1"); got != tc.dev.bw[DevicePair{0, 1}] {
				t.Fatalf("bandwidth gauge of 0:1 = %v", got)
			}
			var b strings.Builder
			res.WriteText(&b)
			if !strings.Contains(b.String(), strings.ToUpper(want)) {
				t.Fatalf("text:\n%s", b.String())
			}
		})
	}
}

func TestSwitchboxDeadline(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	dev := &devices{
		bw:   map[DevicePair]float64{{0, 1}: 20000e6, {2, 4}: 20000e6},
		hang: map[DevicePair]chan struct{}{{2, 4}: release},
	}
	s, err := NewSwitchbox(SwitchboxConfig{Prober: dev, Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	res := s.Check(context.Background())
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("check took %v past its 200ms deadline", took)
	}
	if res.Pass || res.Passed != 1 {
		t.Fatalf("result %+v", res)
	}
	if e := res.Pairs[1].Error; !strings.Contains(e, "no answer") {
		t.Fatalf("hung pair: %q", e)
	}
	if e := res.Pairs[3].Error; !strings.Contains(e, "not measured") {
		t.Fatalf("pair after the deadline: %q", e)
	}
}

func TestSwitchboxConfig(t *testing.T) {
	dev := &devices{}
	for _, cfg := range []SwitchboxConfig{
		{},
		{Prober: dev, MinChannels: -1},
		{Prober: dev, MinBandwidth: -5},
		{Prober: dev, Timeout: -time.Second},
		{Prober: dev, MinChannels: 5},
		{Prober: dev, Pairs: DevicePairs{{0, 1}}, MinChannels: 2},
	} {
		if _, err := NewSwitchbox(cfg); err == nil {
			t.Errorf("NewSwitchbox(%+v) succeeded", cfg)
		}
	}
}

func TestParseDevicePairs(t *testing.T) {
	got, err := ParseDevicePairs(DefaultDevicePairs)
	if err != nil {
		t.Fatal(err)
	}
	if want := (DevicePairs{{0, 1}, {2, 4}, {3, 5}, {6, 7}}); !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if got.String() != DefaultDevicePairs {
		t.Fatalf("String = %q", got.String())
	}
	if got, err := ParseDevicePairs(" 0:1,2:3\t"); err != nil || len(got) != 2 {
		t.Fatalf("commas and blanks: %v, %v", got, err)
	}
	for _, bad := range []string{"0-1", "0:", ":1", "0:0", "0:1 1:0", "a:b", "-1:2", "+1:2", "0:1:2", "0:99999999999"} {
		if _, err := ParseDevicePairs(bad); err == nil {
			t.Errorf("ParseDevicePairs(%q) succeeded", bad)
		}
	}
	var p DevicePair
	if err := p.UnmarshalText([]byte("3:5")); err != nil || p != (DevicePair{3, 5}) {
		t.Fatalf("UnmarshalText = %v, %v", p, err)
	}
	if err := p.UnmarshalText([]byte("3:5 6:7")); err == nil {
		t.Fatal("two pairs read as one")
	}
}
