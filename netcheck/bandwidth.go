package netcheck

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// bandwidthUnits are the units ParseBandwidth reads, in bytes per second.
// Bit units match in any case, as tc writes them ("mbit") and iperf3
// ("Mbits"); byte units need the capital B.
var bandwidthUnits = map[string]float64{
	"bit": 1.0 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
	"bits": 1.0 / 8, "kbits": 1e3 / 8, "mbits": 1e6 / 8, "gbits": 1e9 / 8, "tbits": 1e12 / 8,
	"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
	"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
}

// ParseBandwidth reads a bandwidth as tc and iperf3 write one and returns
// it in bytes per second: a number and a unit of bits ("400Mbit",
// "10gbit", "100Mbits/s") or of bytes ("50MB", "1.5GB/s", "512KiB"). The
// prefixes k, M, G and T are decimal, as in tc and iperf3; KiB, MiB, GiB
// and TiB are binary. "0" needs no unit. A number without a unit is
// refused, and so are "Mbps" and "mb", which tc reads as bytes and most
// people as bits.
func ParseBandwidth(s string) (float64, error) {
	t := strings.TrimSuffix(strings.TrimSpace(s), "/s")
	i := strings.IndexFunc(t, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	if i < 0 {
		i = len(t)
	}
	num, unit := t[:i], strings.TrimSpace(t[i:])
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || num == "" {
		return 0, fmt.Errorf("netcheck: bandwidth %q: want a number and a unit, as 400Mbit or 50MB", s)
	}
	if unit == "" {
		if v == 0 {
			return 0, nil
		}
		return 0, fmt.Errorf("netcheck: bandwidth %q has no unit: write %sMbit for megabits or %sMB for megabytes per second", s, num, num)
	}
	l := strings.ToLower(unit)
	scale, ok := bandwidthUnits[unit]
	if !ok && (strings.HasSuffix(l, "bit") || strings.HasSuffix(l, "bits")) {
		scale, ok = bandwidthUnits[l]
	}
	switch {
	case !ok && (strings.HasSuffix(l, "bps") || strings.HasSuffix(unit, "b") && len(unit) <= 2):
		return 0, fmt.Errorf("netcheck: bandwidth %q: %q is bits to some and bytes to tc: write %sMbit for megabits or %sMB for megabytes per second", s, unit, num, num)
	case !ok:
		return 0, fmt.Errorf("netcheck: bandwidth %q: unknown unit %q: want bit, kbit, Mbit, Gbit, Tbit, B, kB, MB, GB, TB, KiB, MiB, GiB or TiB", s, unit)
	case math.IsInf(v*scale, 0):
		return 0, fmt.Errorf("netcheck: bandwidth %q is too large", s)
	}
	return v * scale, nil
}
