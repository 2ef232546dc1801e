package freeport

import (
	"net"
	"os"
	"strconv"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestFind: the ports found are free and lie outside the ephemeral range.
func TestFind(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skipf("no ephemeral range to compare with: %v", err)
	}
	lo, hi, ok := parseRange(string(b))
	if !ok {
		t.Fatalf("ip_local_port_range %q", b)
	}
	for range 20 {
		p, err := Find(8)
		if err != nil {
			t.Fatal(err)
		}
		if p+7 >= lo && p <= hi {
			t.Fatalf("ports %d to %d overlap the ephemeral range %d to %d", p, p+7, lo, hi)
		}
		for i := range 8 {
			l, err := net.Listen("tcp", ":"+strconv.Itoa(p+i))
			if err != nil {
				t.Fatalf("port %d of %d to %d: %v", p+i, p, p+7, err)
			}
			l.Close()
		}
	}
}

// TestFindSkipsTaken: a port in use on one address is not found.
func TestFindSkipsTaken(t *testing.T) {
	p, err := Find(1)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if free(p, 1) {
		t.Fatalf("port %d held on 127.0.0.1 counted free", p)
	}
}

func TestFindRefusesCounts(t *testing.T) {
	for _, n := range []int{0, -1, 1001} {
		if _, err := Find(n); err == nil {
			t.Errorf("Find(%d): no error", n)
		}
	}
}

func TestParseRange(t *testing.T) {
	for in, want := range map[string][3]int{
		"32768\t60999\n": {32768, 60999, 1},
		"1024 65535":     {1024, 65535, 1},
		"":               {},
		"5 4":            {},
		"0 10":           {},
		"1 70000":        {},
		"a b":            {},
		"1 2 3":          {},
	} {
		lo, hi, ok := parseRange(in)
		if got := [3]int{lo, hi, map[bool]int{true: 1}[ok]}; got != want {
			t.Errorf("parseRange(%q) = %v, want %v", in, got, want)
		}
	}
}

func FuzzParseRange(f *testing.F) {
	f.Add("32768\t60999\n")
	f.Add("1 1")
	f.Fuzz(func(t *testing.T, s string) {
		lo, hi, ok := parseRange(s)
		if ok && (lo < 1 || lo > hi || hi > 65535) {
			t.Fatalf("parseRange(%q) = %d, %d, true", s, lo, hi)
		}
	})
}
