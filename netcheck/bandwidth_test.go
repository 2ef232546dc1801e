package netcheck

import (
	"strings"
	"testing"
)

func TestParseBandwidth(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want float64
		err  string
	}{
		{in: "400Mbit", want: 50e6},
		{in: "400mbit", want: 50e6},
		{in: "100Mbits/s", want: 12.5e6},
		{in: "10Gbit", want: 1.25e9},
		{in: "8kbit", want: 1e3},
		{in: "50MB", want: 50e6},
		{in: "1.5 GB/s", want: 1.5e9},
		{in: "512KiB", want: 512 << 10},
		{in: "2MiB", want: 2 << 20},
		{in: " 0 ", want: 0},
		{in: "0MB", want: 0},
		{in: "50", err: `bandwidth "50" has no unit: write 50Mbit for megabits or 50MB for megabytes per second`},
		{in: "100mbps", err: `"mbps" is bits to some and bytes to tc`},
		{in: "100Mbps", err: "bits to some"},
		{in: "7mb", err: "bits to some"},
		{in: "7Mb", err: "bits to some"},
		{in: "3furlongs", err: `unknown unit "furlongs"`},
		{in: "MB", err: "want a number and a unit"},
		{in: "-5MB", err: "want a number and a unit"},
		{in: "1.2.3MB", err: "want a number and a unit"},
		{in: "1" + strings.Repeat("0", 400) + "TB", err: "want a number"},
		{in: "1" + strings.Repeat("0", 300) + "TB", err: "too large"},
	} {
		got, err := ParseBandwidth(tc.in)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("ParseBandwidth(%q) = %v, %v; want an error with %q", tc.in, got, err, tc.err)
		case tc.err == "" && (err != nil || got != tc.want):
			t.Errorf("ParseBandwidth(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		case err != nil && strings.Count(err.Error(), "netcheck:") != 1:
			t.Errorf("ParseBandwidth(%q): %v", tc.in, err)
		}
	}
}
