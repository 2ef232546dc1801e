package topology

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const sampleConfig = `# asw psw ip
asw-1 psw-1 10.0.0.1
asw-1 psw-1 10.0.0.2   # trailing comment

asw-2 psw-1 10.0.0.3
asw-3 psw-2 10.0.1.1
	asw-3	psw-2	10.0.1.2` + "\r\n" + `asw-4 psw-2 fd00::0:1
`

func TestParse(t *testing.T) {
	topo, err := Parse([]byte(sampleConfig))
	if err != nil {
		t.Fatal(err)
	}
	want := []Node{
		{IP: "10.0.0.1", ASW: "asw-1", PSW: "psw-1"},
		{IP: "10.0.0.2", ASW: "asw-1", PSW: "psw-1"},
		{IP: "10.0.0.3", ASW: "asw-2", PSW: "psw-1"},
		{IP: "10.0.1.1", ASW: "asw-3", PSW: "psw-2"},
		{IP: "10.0.1.2", ASW: "asw-3", PSW: "psw-2"},
		{IP: "fd00::1", ASW: "asw-4", PSW: "psw-2"},
	}
	if diff := cmp.Diff(want, topo.Nodes()); diff != "" {
		t.Fatalf("Nodes (-want +got):\n%s", diff)
	}
	// Lookup accepts any spelling of an address.
	if n, ok := topo.Lookup("fd00:0::1"); !ok || n.ASW != "asw-4" {
		t.Fatalf("Lookup(fd00:0::1) = %+v, %v", n, ok)
	}
	if _, ok := topo.Lookup("10.9.9.9"); ok {
		t.Fatal("Lookup of an unknown IP succeeded")
	}
	again, err := Parse(topo.Marshal())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(topo.Nodes(), again.Nodes()); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		name, in     string
		line         int
		field, value string
		msg          string
	}{
		{"two fields", "a p 10.0.0.1\n\na p\n", 3, "", "", "want 3 fields"},
		{"four fields", "a p 10.0.0.1 extra\n", 1, "", "", "got 4"},
		{"bad ip", "# c\na p 10.0.0.300\n", 2, "ip", "10.0.0.300", "not an IP"},
		{"hostname", "a p node-1\n", 1, "ip", "node-1", "not an IP"},
		{"duplicate ip", "a p 10.0.0.1\nb p 10.0.0.2\nb p 10.0.0.1\n", 3, "ip", "10.0.0.1", "first on line 1"},
		{"duplicate spelling", "a p fd00::1\na p fd00:0::1\n", 2, "ip", "fd00:0::1", "first on line 1"},
		{"asw under two psws", "a p1 10.0.0.1\na p2 10.0.0.2\n", 2, "psw", "p2", "under psw p1 on line 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.in))
			var pe *ParseError
			if !errors.As(err, &pe) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want a *ParseError wrapping ErrInvalid", err)
			}
			if pe.Line != tc.line || pe.Field != tc.field || pe.Value != tc.value || !strings.Contains(pe.Msg, tc.msg) {
				t.Fatalf("err = %#v, want line %d field %q value %q msg ~%q", pe, tc.line, tc.field, tc.value, tc.msg)
			}
			if want := "line " + strconv.Itoa(tc.line); !strings.Contains(err.Error(), want) {
				t.Fatalf("message %q does not name %q", err, want)
			}
		})
	}
}

func TestReadFileNamesFileAndLine(t *testing.T) {
	name := filepath.Join(t.TempDir(), "topology_config")
	if err := os.WriteFile(name, []byte("a p 10.0.0.1\na p bad\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := ReadFile(name)
	if err == nil || !strings.Contains(err.Error(), name+":2:") {
		t.Fatalf("err = %v, want it to name %s:2", err, name)
	}
	if _, err := ReadFile(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: err = %v", err)
	}
	// A file past the bound is refused before it is parsed (sparse: no
	// disk is used).
	huge := filepath.Join(t.TempDir(), "huge")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(maxConfigBytes + 1); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := ReadFile(huge); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), huge+": larger than") {
		t.Fatalf("huge file: err = %v", err)
	}
}

func TestNew(t *testing.T) {
	topo, err := New([]Node{{IP: "10.0.0.1", ASW: "a", PSW: "p"}, {IP: "10.0.0.2", ASW: "b", PSW: "p"}})
	if err != nil || topo.Len() != 2 {
		t.Fatalf("New = %v, %v", topo, err)
	}
	for _, bad := range []Node{
		{IP: "10.0.0.1", ASW: "", PSW: "p"},
		{IP: "10.0.0.1", ASW: "a b", PSW: "p"},
		{IP: "10.0.0.1", ASW: "a", PSW: "p#1"},
		{IP: "10.0.0.1", ASW: "a", PSW: "p\u00a0q"},
		{IP: "nope", ASW: "a", PSW: "p"},
	} {
		if _, err := New([]Node{{IP: "10.0.0.9", ASW: "x", PSW: "y"}, bad}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "line 2") {
			t.Errorf("New(%+v) err = %v, want ErrInvalid at line 2", bad, err)
		}
	}
}
