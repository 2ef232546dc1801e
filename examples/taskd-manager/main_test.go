package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/faultline-ml/faultline/internal/freeport"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/lease"
)

// TestTokenFiles: a token file that holds nothing but white space (a
// secret never filled in) stops the manager, and overrides no variable;
// a token too short to be a secret stops it too.
func TestTokenFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	t.Setenv("TASKD_TOKEN", "from-the-environment-0123456789")
	if _, err := security("", write("blank", " \n\t\n"), true); err == nil || !strings.Contains(err.Error(), "--token-file") || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("a blank token file: %v", err)
	}
	sec, err := security("", write("good", "from-the-file-0123456789\n"), true)
	if err != nil || sec.Token != "from-the-file-0123456789" {
		t.Fatalf("a token file: %q %v", sec.Token, err)
	}
	if sec, err := security("", "", true); err != nil || sec.Token != "from-the-environment-0123456789" {
		t.Fatalf("the environment: %q %v", sec.Token, err)
	}
	if _, err := readToken("--admin-token-file", write("blank2", "\n"), "TASKD_ADMIN_TOKEN"); err == nil || !strings.Contains(err.Error(), "--admin-token-file") {
		t.Fatalf("a blank admin token file: %v", err)
	}
	t.Setenv("TASKD_TOKEN", "short")
	sec, err = security("", "", true)
	if err != nil {
		t.Fatal(err)
	}
	if err := (taskd.ManagerConfig{Job: "j", Security: sec}).Validate(); err == nil || !strings.Contains(err.Error(), "Security.Token") {
		t.Fatalf("a short token: %v", err)
	}
}

// TestMain runs the command itself when the test starts it as a process.
func TestMain(m *testing.M) {
	if testkit.Role() == "taskd-manager" {
		os.Args = append([]string{"taskd-manager"}, strings.Fields(os.Getenv("TASKD_MANAGER_ARGS"))...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestLeaseFlags: a lease asked for wrongly is refused at start, and the
// error names the flag.
func TestLeaseFlags(t *testing.T) {
	c := lease.Candidate{Job: "llm", Config: "abc"}
	for _, tc := range []struct{ kind, file, name, want string }{
		{"nfs", "", "", `--lease "nfs"`},
		{"file", "", "", "--lease-file"},
		{"", "/tmp/x", "", "need --lease"},
		{"kubernetes", "", "", "--lease-name"},
		{"kubernetes", "", "llm-manager", "not in a pod"},
		{"file", filepath.Join(t.TempDir(), "no", "such", "dir", "lease"), "", "--lease-file"},
	} {
		t.Setenv("KUBERNETES_SERVICE_HOST", "")
		if _, err := newLease(tc.kind, tc.file, tc.name, c, slog.New(slog.DiscardHandler), inCluster); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("--lease %q --lease-file %q --lease-name %q: %v, want %q", tc.kind, tc.file, tc.name, err, tc.want)
		}
	}
}

// manager is a taskd-manager process.
type manager struct {
	cmd    *exec.Cmd
	stderr *testkit.Output
	done   chan struct{}
}

func startManager(t *testing.T, podName, args string) *manager {
	t.Helper()
	return startManagerEnv(t, args, "POD_NAME="+podName)
}

// startManagerEnv starts a taskd-manager process with args and, beside
// no token, the environment env.
func startManagerEnv(t *testing.T, args string, env ...string) *manager {
	t.Helper()
	env = append([]string{"TASKD_MANAGER_ARGS=" + args, "TASKD_TOKEN=", "TASKD_ADMIN_TOKEN=", "TASKD_PROXY_TOKEN="}, env...)
	cmd := testkit.Command(t, "taskd-manager", env...)
	m := &manager{cmd: cmd, stderr: testkit.NewOutput("taskd-manager", false), done: make(chan struct{})}
	cmd.Stderr = m.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { cmd.Wait(); close(m.done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-m.done })
	return m
}

func listening(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

func freeAddr(t *testing.T) string {
	p, err := freeport.Find(1)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
}

// TestStandbyManagers runs two taskd-manager processes that share a lease
// file: the first leads and listens, named by POD_NAME; the second stands
// by without listening. SIGTERM makes the leader resign, and the other
// leads at once. A third started with another job shape is refused while
// a manager of this one leads.
func TestStandbyManagers(t *testing.T) {
	dir := t.TempDir()
	leaseFile := filepath.Join(dir, "manager.lease")
	args := func(listen, nodes string) string {
		return fmt.Sprintf("--insecure --job llm --nodes %s --procs-per-node 2 --listen %s --state-dir %s --lease file --lease-file %s", nodes, listen, filepath.Join(dir, "state"), leaseFile)
	}
	addrA, addrB := freeAddr(t), freeAddr(t)
	a := startManager(t, "llm-manager-a", args(addrA, "2"))
	testkit.WaitFor(t, "the first manager listening", func() bool { return listening(addrA) })
	b := startManager(t, "llm-manager-b", args(addrB, "2"))
	testkit.WaitFor(t, "the second manager standing by", func() bool { return strings.Contains(b.stderr.String(), "standing by") })
	if listening(addrB) {
		t.Fatal("the standby listens")
	}
	data, err := os.ReadFile(leaseFile)
	if err != nil {
		t.Fatal(err)
	}
	if rec, err := lease.ParseRecord(data); err != nil || rec.Holder != "llm-manager-a" || rec.Token != 1 {
		t.Fatalf("lease file: %+v %v", rec, err)
	}

	other := startManager(t, "llm-manager-c", args(freeAddr(t), "3"))
	select {
	case <-other.done:
	case <-time.After(30 * time.Second):
		t.Fatal("a manager of another configuration was not refused")
	}
	if code := other.cmd.ProcessState.ExitCode(); code == 0 || !strings.Contains(other.stderr.String(), "led by llm-manager-a with configuration") {
		t.Fatalf("another configuration: exit %d, %s", code, other.stderr.String())
	}

	resigned := time.Now()
	a.cmd.Process.Signal(syscall.SIGTERM)
	testkit.WaitFor(t, "the standby leading", func() bool { return listening(addrB) })
	if d := time.Since(resigned); d > 5*time.Second {
		t.Errorf("the lease took %v to change hands after SIGTERM", d)
	}
	select {
	case <-a.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the manager given SIGTERM did not exit")
	}
	if code := a.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("the manager given SIGTERM exited %d: %s", code, a.stderr.String())
	}
	data, _ = os.ReadFile(leaseFile)
	if rec, err := lease.ParseRecord(data); err != nil || rec.Holder != "llm-manager-b" || rec.Token != 2 {
		t.Fatalf("lease file: %+v %v", rec, err)
	}
}

// TestKubernetesLease: with --lease kubernetes, the manager campaigns for
// the Lease --lease-name in the namespace $POD_NAMESPACE, as $POD_NAME,
// and serves only once it holds it.
func TestKubernetesLease(t *testing.T) {
	t.Setenv("POD_NAMESPACE", "training")
	t.Setenv("POD_NAME", "llm-manager-7d9f5c-kx2lq")
	client := fake.NewClientset()
	c := lease.Candidate{Job: "llm", Config: lease.ConfigHash(nil), Name: os.Getenv("POD_NAME")}
	l, err := newLease("kubernetes", "", "llm-manager", c, slog.New(slog.DiscardHandler), func() (kubernetes.Interface, error) { return client, nil })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- taskd.Lead(ctx, l, taskd.ManagerConfig{Job: "llm", Listen: "127.0.0.1:0", Security: taskd.Security{Insecure: true}},
			func(m *taskd.Manager) { served <- m.Addr().String() })
	}()
	select {
	case addr := <-served:
		if !listening(addr) {
			t.Fatal("the leader does not listen")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no term within 30 s")
	}
	got, err := client.CoordinationV1().Leases("training").Get(context.Background(), "llm-manager", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := got.Spec.HolderIdentity; h == nil || !strings.HasPrefix(*h, "llm-manager-7d9f5c-kx2lq/") {
		t.Fatalf("holder %v", h)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAgentsNeedNodes: --agents without the job's number of nodes is
// refused at start, naming the flag.
func TestAgentsNeedNodes(t *testing.T) {
	m := startManager(t, "llm-manager-a", "--insecure --job llm --agents --listen "+freeAddr(t))
	select {
	case <-m.done:
	case <-time.After(30 * time.Second):
		t.Fatal("taskd-manager --agents without --nodes was not refused")
	}
	if code := m.cmd.ProcessState.ExitCode(); code == 0 || !strings.Contains(m.stderr.String(), "--agents: give the job's number of nodes with --nodes") {
		t.Fatalf("exit %d: %s", code, m.stderr.String())
	}
}

// TestFlagsThatNeedOthers: flags that mean nothing, or harm, without
// others are refused at start, and the error names them.
func TestFlagsThatNeedOthers(t *testing.T) {
	for _, tc := range []struct {
		orchestrates, pauseGiven bool
		lease, stateDir, want    string
	}{
		{orchestrates: true, lease: "file", want: "--lease file with --orchestrate or --agents needs --state-dir"},
		{orchestrates: true, lease: "kubernetes", want: "--lease kubernetes with --orchestrate or --agents needs --state-dir"},
		{pauseGiven: true, want: "--pause-timeout needs --orchestrate or --agents"},
		{pauseGiven: true, lease: "file", stateDir: "/s", want: "--pause-timeout needs --orchestrate or --agents"},
		{orchestrates: true, pauseGiven: true, lease: "file", stateDir: "/s"},
		{orchestrates: true},
		{lease: "file"},
	} {
		err := checkFlags(tc.orchestrates, tc.pauseGiven, tc.lease, tc.stateDir)
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want %q", tc, err, tc.want)
		}
	}
	// The whole command.
	m := startManager(t, "llm-manager-a", "--insecure --job llm --nodes 2 --agents --lease file --lease-file "+filepath.Join(t.TempDir(), "lease")+" --listen "+freeAddr(t))
	select {
	case <-m.done:
	case <-time.After(30 * time.Second):
		t.Fatal("taskd-manager --agents --lease without --state-dir was not refused")
	}
	if code := m.cmd.ProcessState.ExitCode(); code == 0 || !strings.Contains(m.stderr.String(), "needs --state-dir") {
		t.Fatalf("exit %d: %s", code, m.stderr.String())
	}
}

// TestLeaseConfigPauseDefault: managers given --pause-timeout 0 and 30s
// wait as long, and so agree on the configuration; a manager given
// another timeout does not.
func TestLeaseConfigPauseDefault(t *testing.T) {
	hash := func(pause time.Duration) string {
		return leaseConfig("llm", 2, 2, time.Second, 5*time.Second, true, false, pause)
	}
	if hash(0) != hash(30*time.Second) {
		t.Error("--pause-timeout 0 and 30s give different configurations")
	}
	if hash(0) == hash(20*time.Second) {
		t.Error("--pause-timeout 0 and 20s give the same configuration")
	}
}

// TestProxyRoleClosedByDefault: started without --proxy-token-file, the
// manager takes no proxy, so that a worker's token cannot register as a
// node's proxy (which reports that node's ranks' faults and, with
// --orchestrate, has the others stopped); its start line says which
// roles are open. With the flag, a proxy holding that token registers.
func TestProxyRoleClosedByDefault(t *testing.T) {
	const member, proxies = "member-token-0123456789", "proxies-token-0123456789"
	dir := t.TempDir()
	proxyFile := filepath.Join(dir, "proxy-token")
	if err := os.WriteFile(proxyFile, []byte(proxies+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	register := func(addr, token string) error {
		conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token), 20*time.Second)
		defer cancel()
		_, err = pb.NewControlClient(conn).Register(ctx, &pb.RegisterRequest{Job: "j", Member: &pb.Member{
			Role: pb.Role_ROLE_PROXY, Position: &pb.Position{Node: 0, Rank: -1}, Instance: fmt.Sprint("proxy-", time.Now().UnixNano())}})
		return err
	}
	for _, tc := range []struct {
		flags, roles string
		member       codes.Code
	}{
		{"", `proxies="closed (no ProxyToken)"`, codes.PermissionDenied},
		{"--proxy-token-file " + proxyFile, `proxies="the proxies' token"`, codes.PermissionDenied},
	} {
		addr := freeAddr(t)
		m := startManagerEnv(t, "--insecure --job j --listen "+addr+" "+tc.flags, "TASKD_TOKEN="+member)
		testkit.WaitFor(t, "the manager listening", func() bool { return listening(addr) })
		// The start line may come after the listener: wait for it.
		testkit.WaitFor(t, fmt.Sprintf("%q: the start line saying which roles are open", tc.flags), func() bool {
			out := m.stderr.String()
			return strings.Contains(out, tc.roles) && strings.Contains(out, `workers="the members' token"`)
		})
		if err := register(addr, member); status.Code(err) != tc.member {
			t.Fatalf("%q: a proxy registering with the members' token: %v", tc.flags, err)
		}
		if tc.flags != "" {
			if err := register(addr, proxies); err != nil {
				t.Fatalf("a proxy registering with the proxies' token: %v", err)
			}
		}
	}
}
