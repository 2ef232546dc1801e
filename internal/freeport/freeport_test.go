package freeport

import (
	"fmt"
	"net"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestFind: the ports found are free and, where the ephemeral range
// leaves room, outside it and off the reserved ports.
func TestFind(t *testing.T) {
	lo, hi, reserved := kernelRanges()
	room := false
	for _, s := range outside(lo, hi) {
		room = room || s[1]-s[0]+1 >= 80
	}
	for range 20 {
		p, err := Find(8)
		if err != nil {
			t.Fatal(err)
		}
		if room && p+7 >= lo && p <= hi {
			t.Fatalf("ports %d to %d overlap the ephemeral range %d to %d", p, p+7, lo, hi)
		}
		if overlaps(reserved, p, p+7) {
			t.Fatalf("ports %d to %d overlap the reserved ports %v", p, p+7, reserved)
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

// TestFindSkipsTaken: a port held on one address is not free, nor is a
// run of ports that holds it.
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
	if free(p-1, 2) || free(p, 3) {
		t.Fatalf("a run holding port %d counted free", p)
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

func TestParseReserved(t *testing.T) {
	for in, want := range map[string][][2]int{
		"\n":                 nil,
		"8080\n":             {{8080, 8080}},
		"8080,20000-29999\n": {{8080, 8080}, {20000, 29999}},
		"0-65535":            {{0, 65535}},
	} {
		got, err := parseReserved(in)
		if err != nil || !cmp.Equal(got, want) {
			t.Errorf("parseReserved(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"a", "5-4", "1-70000", "1,,2", "-3", "1-2-3"} {
		if got, err := parseReserved(in); err == nil {
			t.Errorf("parseReserved(%q) = %v, no error", in, got)
		}
	}
}

// FuzzParseRange: what parseRange accepts it reads back the same from
// the form the kernel writes.
func FuzzParseRange(f *testing.F) {
	f.Add("32768\t60999\n")
	f.Add("1 1")
	f.Fuzz(func(t *testing.T, s string) {
		lo, hi, ok := parseRange(s)
		if !ok {
			return
		}
		if lo < 1 || lo > hi || hi > 65535 {
			t.Fatalf("parseRange(%q) = %d, %d", s, lo, hi)
		}
		if l, h, ok := parseRange(fmt.Sprintf("%d\t%d\n", lo, hi)); !ok || l != lo || h != hi {
			t.Fatalf("parseRange(%q) = %d, %d; its kernel form reads %d, %d, %v", s, lo, hi, l, h, ok)
		}
	})
}

// FuzzParseReserved: what parseReserved accepts it reads back the same
// from the form the kernel writes.
func FuzzParseReserved(f *testing.F) {
	f.Add("8080,20000-29999\n")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		rs, err := parseReserved(s)
		if err != nil {
			return
		}
		text := ""
		for i, r := range rs {
			if r[0] < 0 || r[0] > r[1] || r[1] > 65535 {
				t.Fatalf("parseReserved(%q) = %v", s, rs)
			}
			if i > 0 {
				text += ","
			}
			text += strconv.Itoa(r[0])
			if r[1] != r[0] {
				text += "-" + strconv.Itoa(r[1])
			}
		}
		if again, err := parseReserved(text + "\n"); err != nil || !cmp.Equal(again, rs) {
			t.Fatalf("parseReserved(%q) = %v; its kernel form %q reads %v, %v", s, rs, text, again, err)
		}
	})
}
