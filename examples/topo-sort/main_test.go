package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/topology"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestText(t *testing.T) {
	code, out, errOut := runCLI(t, "--config", "testdata/topology_config", "--ips", "10.0.1.1,10.0.0.1,10.9.9.9,10.0.0.3,10.0.1.2,10.0.0.4")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	want := `0 10.0.1.1 asw-03 psw-2
1 10.0.1.2 asw-03 psw-2
2 10.0.0.1 asw-01 psw-1
3 10.0.0.4 asw-01 psw-1
4 10.0.0.3 asw-02 psw-1
5 10.9.9.9 - -
`
	if out != want {
		t.Fatalf("got:\n%s\nwant:\n%s", out, want)
	}
}

func TestJSONAndFit(t *testing.T) {
	// Every node of the config, TP across 2 nodes of 8 devices.
	code, out, errOut := runCLI(t, "--config", "testdata/topology_config", "--format", "json", "--tp", "16")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var doc struct {
		Order []string `json:"order"`
		Nodes []struct {
			Rank int    `json:"rank"`
			IP   string `json:"ip"`
			ASW  string `json:"asw"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	// asw-01's three nodes give one whole TP group and one loose node.
	want := []string{"10.0.0.1", "10.0.0.2", "10.0.1.1", "10.0.1.2", "10.0.0.4", "10.0.0.3"}
	if strings.Join(doc.Order, " ") != strings.Join(want, " ") {
		t.Fatalf("order %v, want %v", doc.Order, want)
	}
	if doc.Nodes[2].Rank != 2 || doc.Nodes[2].ASW != "asw-03" {
		t.Fatalf("nodes[2] = %+v", doc.Nodes[2])
	}
}

func TestHCCLAndHostMapping(t *testing.T) {
	mapping := filepath.Join(t.TempDir(), "host_ips_mapping.txt")
	code, out, errOut := runCLI(t, "--config", "testdata/topology_config", "--rank-table", "testdata/hccl.json",
		"--format", "hccl", "--host-mapping", mapping)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	rt, err := topology.ParseRankTable([]byte(out))
	if err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	if got := strings.Join(rt.ServerIDs(), " "); got != "10.0.1.1 10.0.1.2 10.0.0.3" {
		t.Fatalf("servers %s", got)
	}
	if d := rt.Servers[1].Devices[0]; d.IP != "192.168.3.1" || d.Rank != 2 {
		t.Fatalf("server 1 device 0 = %+v", d)
	}
	data, err := os.ReadFile(mapping)
	if err != nil {
		t.Fatal(err)
	}
	if string(data) != "10.0.1.1 1\n10.0.1.2 2\n10.0.0.3 3\n" {
		t.Fatalf("host mapping:\n%s", data)
	}
}

func TestErrors(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad")
	os.WriteFile(bad, []byte("a p 10.0.0.1\na p\n"), 0o644)
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{}, 2, "--config is required"},
		{[]string{"--config", "x", "--format", "yaml"}, 2, "--format"},
		{[]string{"--config", "x", "--format", "hccl"}, 2, "--rank-table"},
		{[]string{"--config", "x", "extra"}, 2, "unexpected"},
		{[]string{"--config", bad}, 1, bad + ":2: want 3 fields"},
		{[]string{"--config", "testdata/topology_config", "--tp", "3"}, 1, "TP = 3"},
		{[]string{"--config", "testdata/topology_config", "--rank-table", bad}, 1, "malformed JSON"},
	} {
		code, _, errOut := runCLI(t, tc.args...)
		if code != tc.code || !strings.Contains(errOut, tc.msg) {
			t.Errorf("%v: exit %d, stderr %q; want %d and %q", tc.args, code, errOut, tc.code, tc.msg)
		}
	}
}

func TestWatch(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "topology_config")
	if err := os.WriteFile(config, []byte("a p 10.0.0.2\nb p 10.0.0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"--config", config, "--watch", "--ips", "10.0.0.1,10.0.0.2,10.0.0.3"}, pw, io.Discard)
		pw.Close()
	}()
	lines := bufio.NewScanner(pr)
	readLine := func() string {
		got := make(chan string, 1)
		go func() {
			lines.Scan()
			got <- lines.Text()
		}()
		select {
		case l := <-got:
			return l
		case <-time.After(20 * time.Second):
			t.Fatal("no output within 20 s")
			return ""
		}
	}
	if l := readLine(); l != "0 10.0.0.1 b p" {
		t.Fatalf("first line %q", l)
	}
	readLine()
	readLine() // 10.0.0.3 is unknown
	// Replace the file atomically, as a deployment tool would.
	tmp := filepath.Join(dir, ".tmp")
	os.WriteFile(tmp, []byte("a p 10.0.0.1\na p 10.0.0.2\na p 10.0.0.3\n"), 0o644)
	if err := os.Rename(tmp, config); err != nil {
		t.Fatal(err)
	}
	if l := readLine(); l != "0 10.0.0.1 a p" {
		t.Fatalf("after the change: %q", l)
	}
	readLine()
	if l := readLine(); l != "2 10.0.0.3 a p" {
		t.Fatalf("after the change, rank 2: %q", l)
	}
	cancel()
	go io.Copy(io.Discard, pr)
	if code := <-done; code != 0 {
		t.Fatalf("exit %d", code)
	}
}
