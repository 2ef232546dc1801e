package taskd

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestHostMapping(t *testing.T) {
	h, err := ParseHostMapping([]byte("# alias address\nnode-1 10.0.0.2\n\nnode-0 10.0.0.1\n"))
	if err != nil {
		t.Fatal(err)
	}
	h = h.With("node-2", "fe80::1").With("node-1", "10.0.0.9").With("node-3", "not-an-ip")
	want := "# alias address\nnode-0 10.0.0.1\nnode-1 10.0.0.9\nnode-2 fe80::1\n"
	if got := string(h.Marshal()); got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	back, err := ParseHostMapping(h.Marshal())
	if err != nil || !cmp.Equal(back, h, cmp.Comparer(func(a, b HostAlias) bool { return a == b })) {
		t.Fatalf("round trip: %v %v", back, err)
	}
	for _, bad := range []string{"node-0\n", "node-0 1.2.3.4 x\n", "node/0 1.2.3.4\n", "node-0 1.2.3.4\nnode-0 1.2.3.5\n", "node-0 300.1.1.1\n"} {
		var he *HostMappingError
		if _, err := ParseHostMapping([]byte(bad)); !errors.As(err, &he) || he.Line < 1 {
			t.Errorf("%q: %v, want a *HostMappingError", bad, err)
		}
	}
}

func FuzzHostMapping(f *testing.F) {
	f.Add([]byte("node-0 10.0.0.1\nnode-1 ::1\n"))
	f.Add([]byte("# c\n\nn 1.1.1.1"))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := ParseHostMapping(data)
		if err != nil {
			return
		}
		back, err := ParseHostMapping(h.Marshal())
		if err != nil {
			t.Fatalf("re-parse %q: %v", h.Marshal(), err)
		}
		if len(back) != len(h) {
			t.Fatalf("round trip: %v != %v", back, h)
		}
		for i := range h {
			if back[i] != h[i] {
				t.Fatalf("round trip: %v != %v", back, h)
			}
		}
	})
}
