package topology

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParseRankTable(t *testing.T) {
	data, err := os.ReadFile("testdata/hccl.json")
	if err != nil {
		t.Fatal(err)
	}
	rt, err := ParseRankTable(data)
	if err != nil {
		t.Fatal(err)
	}
	want := &RankTable{Status: StatusCompleted, Servers: []Server{
		{ID: "10.0.0.1", HostNICIP: "reserve", Devices: []Device{{0, "192.168.1.8", 0}, {1, "192.168.1.9", 1}}},
		{ID: "10.0.1.1", Devices: []Device{{0, "192.168.2.8", 2}, {1, "192.168.2.9", 3}}},
	}}
	if diff := cmp.Diff(want, rt); diff != "" {
		t.Fatalf("ParseRankTable (-want +got):\n%s", diff)
	}
	out, err := rt.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	again, err := ParseRankTable(out)
	if err != nil {
		t.Fatalf("reading back %s: %v", out, err)
	}
	if diff := cmp.Diff(rt, again); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
	for _, s := range []string{`"version": "1.0"`, `"server_count": "2"`, `"rank_id": "3"`, `"status": "completed"`} {
		if !strings.Contains(string(out), s) {
			t.Errorf("Marshal output lacks %s:\n%s", s, out)
		}
	}
}

func TestParseRankTableErrors(t *testing.T) {
	const dev = `{"device_id": "0", "device_ip": "192.168.1.8", "rank_id": "0"}`
	table := func(servers string, count int) string {
		return `{"version": "1.0", "server_count": "` + strconv.Itoa(count) + `", "status": "completed", "server_list": [` + servers + `]}`
	}
	for _, tc := range []struct {
		name, in string
		field    string
		line     int
		msg      string
	}{
		{"not JSON", "{\n\n  oops", "", 3, "malformed JSON"},
		{"number instead of string", "{\n\"version\": 1.0}", "version", 2, "want a JSON string"},
		{"version", `{"version": "1.2", "server_count": "0", "status": "completed", "server_list": []}`, "version", 0, `want "1.0"`},
		{"server count", table(`{"server_id": "a", "device": [`+dev+`]}`, 2), "server_count", 0, "want 1"},
		{"status", strings.Replace(table(`{"server_id": "a", "device": [`+dev+`]}`, 1), "completed", "done", 1), "status", 0, "completed"},
		{"no servers", table(``, 0), "server_list", 0, "at least one server"},
		{"empty server id", table(`{"server_id": "", "device": [`+dev+`]}`, 1), "server_list[0].server_id", 0, "empty"},
		{"duplicate server", table(`{"server_id": "a", "device": [`+dev+`]}, {"server_id": "a", "device": [`+strings.Replace(dev, `"rank_id": "0"`, `"rank_id": "1"`, 1)+`]}`, 2), "server_list[1].server_id", 0, "also server_list[0]"},
		{"no devices", table(`{"server_id": "a", "device": []}`, 1), "server_list[0].device", 0, "at least one device"},
		{"device id", table(`{"server_id": "a", "device": [{"device_id": "x", "device_ip": "1.2.3.4", "rank_id": "0"}]}`, 1), "server_list[0].device[0].device_id", 0, "non-negative"},
		{"negative rank", table(`{"server_id": "a", "device": [{"device_id": "0", "device_ip": "1.2.3.4", "rank_id": "-1"}]}`, 1), "server_list[0].device[0].rank_id", 0, "non-negative"},
		{"duplicate device", table(`{"server_id": "a", "device": [`+dev+`, `+strings.Replace(dev, `"rank_id": "0"`, `"rank_id": "1"`, 1)+`]}`, 1), "server_list[0].device[1].device_id", 0, "also server_list[0].device[0]"},
		{"device ip", table(`{"server_id": "a", "device": [{"device_id": "0", "device_ip": "x", "rank_id": "0"}]}`, 1), "server_list[0].device[0].device_ip", 0, "not an IP"},
		{"duplicate rank", table(`{"server_id": "a", "device": [`+dev+`, `+strings.Replace(dev, `"device_id": "0"`, `"device_id": "1"`, 1)+`]}`, 1), "server_list[0].device[1].rank_id", 0, "also server_list[0].device[0].rank_id"},
		{"rank gap", table(`{"server_id": "a", "device": [`+strings.Replace(dev, `"rank_id": "0"`, `"rank_id": "5"`, 1)+`]}`, 1), "server_list[0].device[0].rank_id", 0, "0..0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseRankTable([]byte(tc.in))
			var pe *ParseError
			if !errors.As(err, &pe) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want a *ParseError", err)
			}
			if pe.Field != tc.field || pe.Line != tc.line || !strings.Contains(pe.Msg, tc.msg) {
				t.Fatalf("err = %q (%#v), want field %q line %d msg ~%q", err, pe, tc.field, tc.line, tc.msg)
			}
		})
	}
}

func TestNewRankTableAndReorder(t *testing.T) {
	servers := []Server{
		{ID: "10.0.0.1", Devices: []Device{{ID: 0, IP: "192.168.1.1"}, {ID: 1, IP: "192.168.1.2"}}},
		{ID: "10.0.1.1", Devices: []Device{{ID: 0, IP: "192.168.2.1"}, {ID: 1, IP: "192.168.2.2"}}},
		{ID: "10.0.0.2", Devices: []Device{{ID: 0, IP: "192.168.3.1"}, {ID: 1, IP: "192.168.3.2"}}},
	}
	rt, err := NewRankTable(servers)
	if err != nil {
		t.Fatal(err)
	}
	if servers[2].Devices[1].Rank != 0 {
		t.Fatal("NewRankTable changed its argument")
	}
	if got := rt.Servers[2].Devices[1].Rank; got != 5 {
		t.Fatalf("last rank = %d, want 5", got)
	}
	topo := mustParse(t, "a1 p 10.0.0.1\na1 p 10.0.0.2\na2 p 10.0.1.1\n")
	re, err := rt.Reorder(topo.Order(rt.ServerIDs()))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"10.0.0.1", "10.0.0.2", "10.0.1.1"}, re.ServerIDs()); diff != "" {
		t.Fatalf("Reorder (-want +got):\n%s", diff)
	}
	if d := re.Servers[1].Devices[0]; d.IP != "192.168.3.1" || d.Rank != 2 {
		t.Fatalf("reordered server 1 device 0 = %+v, want 192.168.3.1 rank 2", d)
	}
	for _, bad := range [][]string{{"10.0.0.1"}, {"10.0.0.1", "10.0.0.1", "10.0.1.1"}, {"10.0.0.1", "x", "10.0.1.1"}} {
		if _, err := rt.Reorder(bad); err == nil {
			t.Errorf("Reorder(%v) succeeded", bad)
		}
	}
	if _, err := NewRankTable([]Server{{ID: "a", Devices: []Device{{ID: 0, IP: "bad"}}}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NewRankTable with a bad device IP: err = %v", err)
	}

	m, err := re.HostMapping()
	if err != nil {
		t.Fatal(err)
	}
	if got := string(m.Marshal()); got != "10.0.0.1 1\n10.0.0.2 2\n10.0.1.1 3\n" {
		t.Fatalf("host mapping:\n%s", got)
	}
}

func TestHostMapping(t *testing.T) {
	m, err := ParseHostMapping([]byte("10.0.0.1 1\n\n  10.0.0.2\t7 \r\n"))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(HostMapping{{"10.0.0.1", 1}, {"10.0.0.2", 7}}, m); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
	if id, ok := m.ID("10.0.0.2"); !ok || id != 7 {
		t.Fatalf("ID = %d, %v", id, ok)
	}
	again, err := ParseHostMapping(m.Marshal())
	if err != nil || !cmp.Equal(m, again) {
		t.Fatalf("round trip = %v, %v", again, err)
	}
	for _, tc := range []struct {
		in   string
		line int
	}{
		{"a 1\nb\n", 2},
		{"a 1 x\n", 1},
		{"a 0\n", 1},
		{"a +1\n", 1},
		{"a 1\nb x\n", 2},
		{"a 1\na 2\n", 2},
		{"a 1\nb 1\n", 2},
	} {
		_, err := ParseHostMapping([]byte(tc.in))
		var pe *ParseError
		if !errors.As(err, &pe) || pe.Line != tc.line {
			t.Errorf("ParseHostMapping(%q) err = %v, want an error on line %d", tc.in, err, tc.line)
		}
	}
	if _, err := NewHostMapping([]string{"a", "b c"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NewHostMapping with a blank in a host: err = %v", err)
	}
	if _, err := NewHostMapping([]string{"a", "a"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NewHostMapping with a repeated host: err = %v", err)
	}
}
