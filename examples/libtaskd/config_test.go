package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

func env(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

func TestResolveWorkerDefaults(t *testing.T) {
	got, err := resolveWorker(12, 300, "", nil, env(map[string]string{
		"MINDX_TASK_ID": "job-7", "NODE_RANK": "1", "LOCAL_RANK": "4", "TASKD_INSECURE": "1",
	}))
	if err != nil {
		t.Fatal(err)
	}
	want := workerSettings{
		Job: "job-7", Node: 1, Rank: 12, LocalRank: 4, Device: 4,
		Upstream: taskd.DefaultProxyAddr, Security: taskd.Security{Insecure: true},
		Root: trace.DefaultRoot, BudgetBytes: 300 << 20, Framework: "pt",
		MarkerLibrary: defaultMarkerLibrary, LogLevel: slog.LevelWarn,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("settings (-want +got):\n%s", diff)
	}
	if got.RunAger {
		t.Error("the ager runs on local rank 4")
	}
}

func TestResolveWorkerOptions(t *testing.T) {
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	opts := `{"job":"j","node":2,"local_rank":0,"device":6,"upstream":"10.0.0.1:9602","token_file":"` + tokenFile + `","insecure":true,
		"root":"/data/prof","ager":"auto","marker_library":"off","flush_interval":"250ms","log_level":"debug",
		"switch":{"Step":"on"}}`
	got, err := resolveWorker(3, 5000, "ms", []byte(opts), env(map[string]string{"MINDX_TASK_ID": "ignored", "GROUP_RANK": "9"}))
	if err != nil {
		t.Fatal(err)
	}
	want := workerSettings{
		Job: "j", Node: 2, Rank: 3, LocalRank: 0, Device: 6, Upstream: "10.0.0.1:9602",
		Security: taskd.Security{Token: "s3cret", Insecure: true}, Root: "/data/prof", BudgetBytes: 5000 << 20,
		Framework: "ms", RunAger: true, FlushInterval: 250 * time.Millisecond, LogLevel: slog.LevelDebug,
		Switch: trace.Switch{Step: true},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("settings (-want +got):\n%s", diff)
	}
}

func TestResolveWorkerErrors(t *testing.T) {
	base := map[string]string{"MINDX_TASK_ID": "job", "TASKD_INSECURE": "true"}
	blank := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(blank, []byte(" \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	defer func(f func(string) (string, error)) { resolveJob = f }(resolveJob)
	resolveJob = func(root string) (string, error) { return "", errors.New("no launcher to claim for") }
	for _, tc := range []struct {
		name      string
		rank, mb  int
		framework string
		opts      string
		env       map[string]string
		field     string
	}{
		{name: "negative rank", rank: -1, mb: 1, field: "rank_id"},
		{name: "no disk", mb: 0, field: "upper_limit_of_disk_in_mb"},
		{name: "framework", mb: 1, framework: "PyTorch 2", field: "framework"},
		{name: "no job", mb: 1, env: map[string]string{"TASKD_INSECURE": "1"}, field: "job"},
		{name: "bad run id", mb: 1, env: map[string]string{"TORCHELASTIC_RUN_ID": "a/b", "TASKD_INSECURE": "1"}, field: "job"},
		{name: "traversal", mb: 1, opts: `{"job":"../../etc"}`, field: "job"},
		{name: "node env", mb: 1, env: map[string]string{"MINDX_TASK_ID": "j", "NODE_RANK": "x", "TASKD_INSECURE": "1"}, field: "node"},
		{name: "negative node", mb: 1, opts: `{"node":-2}`, field: "node"},
		{name: "negative local rank", mb: 1, opts: `{"local_rank":-1}`, field: "local_rank"},
		{name: "device", mb: 1, opts: `{"device":-3}`, field: "device"},
		{name: "upstream", mb: 1, opts: `{"upstream":"no-port"}`, field: "upstream"},
		{name: "no security", mb: 1, env: map[string]string{"MINDX_TASK_ID": "j", "TASKD_UPSTREAM": "127.0.0.1:9602"}, field: "tls_dir"},
		{name: "blank token file", mb: 1, opts: `{"token_file":"` + blank + `"}`, field: "token_file"},
		{name: "insecure env", mb: 1, env: map[string]string{"MINDX_TASK_ID": "j", "TASKD_INSECURE": "maybe"}, field: "insecure"},
		{name: "token file", mb: 1, opts: `{"token_file":"/no/such/file"}`, field: "token_file"},
		{name: "ager", mb: 1, opts: `{"ager":"sometimes"}`, field: "ager"},
		{name: "unknown", mb: 1, opts: `{"rank":3}`, field: "rank"},
		{name: "type", mb: 1, opts: `{"node":"two"}`, field: "node"},
		{name: "duration", mb: 1, opts: `{"flush_interval":"soon"}`, field: "flush_interval"},
		{name: "negative duration", mb: 1, opts: `{"flush_interval":"-1s"}`, field: "flush_interval"},
		{name: "switch", mb: 1, opts: `{"switch":{"Step":"yes"}}`, field: "switch"},
		{name: "log level", mb: 1, opts: `{"log_level":"loud"}`, field: "log_level"},
		{name: "not an object", mb: 1, opts: `[1]`},
		{name: "trailing", mb: 1, opts: `{} {}`},
		{name: "malformed", mb: 1, opts: `{"node":`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := base
			if tc.env != nil {
				e = tc.env
			}
			_, err := resolveWorker(tc.rank, tc.mb, tc.framework, []byte(tc.opts), env(e))
			var ce *configError
			if !errors.As(err, &ce) {
				t.Fatalf("error %v, want a *configError", err)
			}
			if ce.Field != tc.field || ce.Config != "worker" {
				t.Errorf("error %q names config %q field %q, want worker %q", err, ce.Config, ce.Field, tc.field)
			}
		})
	}
}

// TestResolveWorkerUnderTorchrun: under plain torchrun (no MINDX_TASK_ID,
// no control plane named) a worker takes torchrun's run id, or one job
// claimed per launcher, and dots into files without a control plane.
func TestResolveWorkerUnderTorchrun(t *testing.T) {
	defer func(f func(string) (string, error)) { resolveJob = f }(resolveJob)
	resolveJob = func(root string) (string, error) { return "default_task_id_1700000000", nil }
	got, err := resolveWorker(1, 100, "pt", nil, env(map[string]string{"TORCHELASTIC_RUN_ID": "d1f2-run", "LOCAL_RANK": "1"}))
	if err != nil || got.Job != "d1f2-run" || got.Upstream != "" || got.Security != (taskd.Security{}) {
		t.Fatalf("resolveWorker = %+v, %v; want job d1f2-run and no control plane", got, err)
	}
	got, err = resolveWorker(1, 100, "pt", nil, env(nil))
	if err != nil || got.Job != "default_task_id_1700000000" {
		t.Fatalf("resolveWorker = %+v, %v; want the claimed job", got, err)
	}
}

func TestResolveManager(t *testing.T) {
	got, err := resolveManager([]byte(`{"job_id":"j","node_nums":2,"proc_per_node":8,"listen":"127.0.0.1:0",
		"insecure":true,"heartbeat_interval":"500ms","switch_file":"/cfg/profilingSwitch"}`), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	want := taskd.ManagerConfig{Job: "j", Nodes: 2, ProcsPerNode: 8, Listen: "127.0.0.1:0",
		Security: taskd.Security{Insecure: true}, HeartbeatInterval: 500 * time.Millisecond}
	if diff := cmp.Diff(want, got.Config, cmpopts.IgnoreUnexported(taskd.ManagerConfig{})); diff != "" {
		t.Errorf("config (-want +got):\n%s", diff)
	}
	if got.SwitchFile != "/cfg/profilingSwitch" {
		t.Errorf("switch file %q", got.SwitchFile)
	}
	// Ours and MindCluster's names agree, or the document is refused.
	if _, err := resolveManager([]byte(`{"job":"j","job_id":"j","nodes":2,"node_nums":2,"insecure":true}`), env(nil)); err != nil {
		t.Errorf("agreeing aliases: %v", err)
	}
	for doc, field := range map[string]string{
		`{"job":"a","job_id":"b","insecure":true}`:                         "job_id",
		`{"nodes":1,"node_nums":2,"job":"j","insecure":true}`:              "node_nums",
		`{"proc_per_node":1,"procs_per_node":2,"job":"j","insecure":true}`: "proc_per_node",
		`{"insecure":true}`: "job_id",
		`{"job":"j"}`:       "tls_dir",
		`{"job":"j","insecure":true,"heartbeat_deadline":5}`: "heartbeat_deadline",
		`{"job":"j","insecure":true,"plugin_dir":"/x"}`:      "plugin_dir",
	} {
		_, err := resolveManager([]byte(doc), env(nil))
		var ce *configError
		if !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: %v, want an error naming %q", doc, err, field)
		}
	}
	if _, err := resolveManager([]byte(`{"job":"j","insecure":true,"nodes":-1}`), env(nil)); err == nil || !strings.Contains(err.Error(), "Nodes") {
		t.Errorf("negative nodes: %v", err)
	}
}

func TestResolveProxy(t *testing.T) {
	for _, tc := range []struct {
		env      map[string]string
		doc      string
		upstream string
		node     int
	}{
		{env: map[string]string{"MASTER_ADDR": "10.1.1.1", "NODE_RANK": "3"}, upstream: "10.1.1.1:9601", node: 3},
		{env: map[string]string{"MASTER_ADDR": "fe80::1", "TASKD_MANAGER_ADDR": "mgr:7000"}, upstream: "mgr:7000"},
		{env: map[string]string{"MASTER_ADDR": "fe80::1"}, upstream: "[fe80::1]:9601"},
		{doc: `{"upstream":"m:1","node":5}`, env: map[string]string{"NODE_RANK": "3"}, upstream: "m:1", node: 5},
	} {
		e := map[string]string{"MINDX_TASK_ID": "j", "TASKD_INSECURE": "1"}
		for k, v := range tc.env {
			e[k] = v
		}
		got, err := resolveProxy([]byte(tc.doc), env(e))
		if err != nil {
			t.Errorf("%v %s: %v", tc.env, tc.doc, err)
			continue
		}
		if got.Config.Upstream != tc.upstream || got.Config.Node != tc.node {
			t.Errorf("%v %s: upstream %q node %d, want %q %d", tc.env, tc.doc, got.Config.Upstream, got.Config.Node, tc.upstream, tc.node)
		}
	}
	_, err := resolveProxy(nil, env(map[string]string{"MINDX_TASK_ID": "j", "TASKD_INSECURE": "1"}))
	var ce *configError
	if !errors.As(err, &ce) || ce.Field != "upstream" {
		t.Errorf("no manager address: %v", err)
	}
}

// FuzzResolveConfigs feeds the three configurations arbitrary documents:
// each is taken or refused with an error naming its configuration, and
// never panics.
func FuzzResolveConfigs(f *testing.F) {
	for _, s := range []string{
		``, `{}`, `{"job":"j","insecure":true}`, `{"job_id":"j","node_nums":2,"proc_per_node":8,"insecure":true}`,
		`{"upstream":"127.0.0.1:1","switch":{"Step":"on"},"flush_interval":"1s","node":1}`, `{"node":1e40}`,
		`{"job":"../x"}`, `[]`, `{"a":1} x`, `{"device":4294967296}`, `{"insecure":"yes"}`,
	} {
		f.Add([]byte(s))
	}
	getenv := env(map[string]string{"MINDX_TASK_ID": "job", "TASKD_INSECURE": "1", "MASTER_ADDR": "h"})
	f.Fuzz(func(t *testing.T, doc []byte) {
		check := func(config string, err error) {
			var ce *configError
			if err != nil && (!errors.As(err, &ce) || ce.Config != config) {
				t.Fatalf("%s config %q: error %v is not its *configError", config, doc, err)
			}
		}
		s, err := resolveWorker(0, 1, "pt", doc, getenv)
		check("worker", err)
		if err == nil && (s.Job == "" || s.Upstream == "" || s.Root == "") {
			t.Fatalf("worker config %q: incomplete settings %+v", doc, s)
		}
		_, err = resolveManager(doc, getenv)
		check("manager", err)
		_, err = resolveProxy(doc, getenv)
		check("proxy", err)
	})
}

// TestRoleTokens: the manager takes the operators' and the proxies'
// tokens, and a proxy the token it presents upstream, each by option, by
// file or from the environment; a blank file is refused, naming the key.
func TestRoleTokens(t *testing.T) {
	dir := t.TempDir()
	admin, proxy, blank := filepath.Join(dir, "admin"), filepath.Join(dir, "proxy"), filepath.Join(dir, "blank")
	for f, v := range map[string]string{admin: "admin-0123456789abcdef\n", proxy: "proxy-0123456789abcdef\n", blank: " \n"} {
		if err := os.WriteFile(f, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	m, err := resolveManager(fmt.Appendf(nil, `{"job":"j","insecure":true,"admin_token_file":%q,"proxy_token":"proxy-option-0123456789"}`, admin), env(nil))
	if err != nil || m.Config.AdminToken != "admin-0123456789abcdef" || m.Config.ProxyToken != "proxy-option-0123456789" {
		t.Errorf("manager: admin %q proxy %q, %v", m.Config.AdminToken, m.Config.ProxyToken, err)
	}
	m, err = resolveManager([]byte(`{"job":"j","insecure":true}`), env(map[string]string{
		"TASKD_ADMIN_TOKEN": "admin-env-0123456789ab", "TASKD_PROXY_TOKEN": "proxy-env-0123456789ab"}))
	if err != nil || m.Config.AdminToken != "admin-env-0123456789ab" || m.Config.ProxyToken != "proxy-env-0123456789ab" {
		t.Errorf("manager from the environment: admin %q proxy %q, %v", m.Config.AdminToken, m.Config.ProxyToken, err)
	}
	p, err := resolveProxy(fmt.Appendf(nil, `{"job":"j","insecure":true,"upstream":"m:1","upstream_token_file":%q}`, proxy), env(nil))
	if err != nil || p.Config.UpstreamToken != "proxy-0123456789abcdef" {
		t.Errorf("proxy: upstream token %q, %v", p.Config.UpstreamToken, err)
	}
	for doc, field := range map[string]string{
		fmt.Sprintf(`{"job":"j","insecure":true,"admin_token_file":%q}`, blank):                    "admin_token_file",
		fmt.Sprintf(`{"job":"j","insecure":true,"proxy_token_file":%q}`, filepath.Join(dir, "no")): "proxy_token_file",
		`{"job":"j","insecure":true,"admin_token":"short"}`:                                        "",
	} {
		_, err := resolveManager([]byte(doc), env(nil))
		var ce *configError
		if !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: %v, want an error naming %q", doc, err, field)
		}
	}
	if _, err := resolveProxy(fmt.Appendf(nil, `{"job":"j","insecure":true,"upstream":"m:1","upstream_token_file":%q}`, blank), env(nil)); err == nil ||
		!strings.Contains(err.Error(), "upstream_token_file") {
		t.Errorf("a blank upstream token file: %v", err)
	}
}
