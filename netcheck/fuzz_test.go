package netcheck

import (
	"bytes"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func FuzzParseDevicePairs(f *testing.F) {
	f.Add(DefaultDevicePairs)
	f.Add("0:1,1:0")
	f.Add("7:3 , 12:4")
	f.Fuzz(func(t *testing.T, s string) {
		ps, err := ParseDevicePairs(s)
		if err != nil {
			return
		}
		again, err := ParseDevicePairs(ps.String())
		if err != nil {
			t.Fatalf("ParseDevicePairs(%q) failed: %v", ps.String(), err)
		}
		if !cmp.Equal(ps, again) {
			t.Fatalf("round trip: %v != %v", ps, again)
		}
	})
}

func FuzzParseReport(f *testing.F) {
	p, _ := NewPlanner([]string{"a", "b", "c", "d"}, "checker", Policy{MinBandwidth: 2e8})
	for round := p.Next(); round != nil; round = p.Next() {
		for _, pr := range round {
			m := Measurement{From: pr.From, To: pr.To, Elapsed: time.Millisecond, Bandwidth: 1e9, RTT: time.Microsecond}
			switch {
			case pr.To == "c" || pr.From == "c":
				m.Error = "connection refused"
			case pr.To == "d" || pr.From == "d":
				m = Measurement{From: pr.From, To: pr.To, Elapsed: time.Second, Bandwidth: 1e8, Bytes: 1e9, Moved: 1e8, Partial: true}
			}
			p.Record(m)
		}
	}
	rep := p.Report()
	rep.Notes = append(rep.Notes, "no reference: a note")
	rep.Links = append(rep.Links, LinkResult{Outcome: Slow, Measurement: Measurement{From: "a", To: "b", Bandwidth: 1}})
	seed, _ := rep.Marshal()
	f.Add(seed)
	f.Add([]byte(`{"nodes":[{"name":"a","verdict":"bogus"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseReport(data)
		if err != nil {
			return
		}
		out, err := r.Marshal()
		if err != nil {
			t.Fatalf("Marshal of a parsed report: %v", err)
		}
		back, err := ParseReport(out)
		if err != nil {
			t.Fatalf("ParseReport(Marshal) failed: %v\n%s", err, out)
		}
		if out2, _ := back.Marshal(); !bytes.Equal(out, out2) {
			t.Fatalf("Marshal is not canonical:\n%s\n%s", out, out2)
		}
		var b bytes.Buffer
		r.WriteText(&b)
	})
}

func FuzzParseBandwidth(f *testing.F) {
	for _, s := range []string{"400Mbit", "50MB", "1.5 GB/s", "512KiB", "10gbit", "100Mbits/s", "0", "100mbps", "50", "7mb"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := ParseBandwidth(s)
		if err != nil {
			return
		}
		if !(v >= 0) || math.IsInf(v, 0) {
			t.Fatalf("ParseBandwidth(%q) = %v", s, v)
		}
		// Bytes per second written back read as the same.
		again, err := ParseBandwidth(strconv.FormatFloat(v, 'f', -1, 64) + "B/s")
		if err != nil || again != v {
			t.Fatalf("ParseBandwidth(%q) = %v, and %v, %v written back", s, v, again, err)
		}
	})
}
