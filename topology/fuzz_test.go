package topology

import (
	"bytes"
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// The fuzz targets check that bad input never panics and that whatever
// parses survives Marshal and Parse unchanged, with Marshal canonical.

func FuzzParse(f *testing.F) {
	f.Add([]byte(sampleConfig))
	f.Add([]byte("a p 10.0.0.1\na p 10.0.0.1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		topo, err := Parse(data)
		if err != nil {
			return
		}
		out := topo.Marshal()
		again, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(Marshal) failed: %v\n%q", err, out)
		}
		if diff := cmp.Diff(topo.Nodes(), again.Nodes()); diff != "" {
			t.Fatalf("round trip (-want +got):\n%s", diff)
		}
		if !bytes.Equal(out, again.Marshal()) {
			t.Fatalf("Marshal is not canonical:\n%q\n%q", out, again.Marshal())
		}
		world := make([]string, 0, topo.Len())
		for _, n := range topo.Nodes() {
			world = append(world, n.IP)
		}
		if got := topo.Order(world); len(got) != len(world) {
			t.Fatalf("Order lost nodes: %v", got)
		}
	})
}

func FuzzParseRankTable(f *testing.F) {
	data, err := os.ReadFile("testdata/hccl.json")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data)
	f.Add([]byte(`{"version":"1.0","server_count":"0","server_list":[],"status":"initializing"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		rt, err := ParseRankTable(data)
		if err != nil {
			return
		}
		out, err := rt.Marshal()
		if err != nil {
			t.Fatalf("Marshal of a parsed table failed: %v", err)
		}
		again, err := ParseRankTable(out)
		if err != nil {
			t.Fatalf("ParseRankTable(Marshal) failed: %v\n%s", err, out)
		}
		if diff := cmp.Diff(rt, again); diff != "" {
			t.Fatalf("round trip (-want +got):\n%s", diff)
		}
		if out2, _ := again.Marshal(); !bytes.Equal(out, out2) {
			t.Fatalf("Marshal is not canonical:\n%s\n%s", out, out2)
		}
	})
}

func FuzzParseHostMapping(f *testing.F) {
	f.Add([]byte("10.0.0.1 1\n10.0.0.2 2\n"))
	f.Add([]byte("a 1\n\nb 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := ParseHostMapping(data)
		if err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("Validate of a parsed mapping: %v", err)
		}
		out := m.Marshal()
		again, err := ParseHostMapping(out)
		if err != nil {
			t.Fatalf("ParseHostMapping(Marshal) failed: %v\n%q", err, out)
		}
		if !cmp.Equal(m, again) {
			t.Fatalf("round trip: %v != %v", m, again)
		}
	})
}
