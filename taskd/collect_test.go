package taskd

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
)

func writeFile(t testing.TB, name string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCollect(t *testing.T) {
	collectDir := t.TempDir()
	c := newCluster(t, insecureSec(), ManagerConfig{CollectDir: collectDir})
	dotting, stacks, outside := t.TempDir(), t.TempDir(), t.TempDir()
	job := c.job
	big := bytes.Repeat([]byte("0123456789abcdef"), 40000) // 640 KB: several chunks
	writeFile(t, filepath.Join(dotting, job, "0", "1700000000"), big)
	writeFile(t, filepath.Join(dotting, job, "1", "1700000001"), []byte("rank1\n"))
	writeFile(t, filepath.Join(dotting, job, "parallel_group.json"), []byte("{}"))
	writeFile(t, filepath.Join(dotting, "other-job", "0", "1700000000"), []byte("not ours"))
	writeFile(t, filepath.Join(stacks, job, "00000-00002.stacktrace"), []byte("main@x.go@1\n"))
	writeFile(t, filepath.Join(outside, "secret"), []byte("do not ship"))
	if err := os.Symlink(filepath.Join(outside, "secret"), filepath.Join(dotting, job, "1", "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dotting, job, "dirlink")); err != nil {
		t.Fatal(err)
	}

	p, err := NewProxy(ProxyConfig{Job: job, Node: 0, Upstream: c.m.Addr().String(), Listen: "127.0.0.1:0", Security: insecureSec(), UpstreamToken: testProxyToken, DottingRoot: dotting, StackRoot: stacks})
	if err != nil {
		t.Fatal(err)
	}
	c.proxies[0] = p
	c.run(p, p.Run)
	testkit.WaitFor(t, "the proxy", func() bool { return len(c.m.Members()) == 1 })

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := c.m.Collect(ctx, CollectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 1 || res[0].Files != 4 || len(res[0].Errors) != 0 {
		t.Fatalf("results: %+v", res)
	}
	got := map[string]string{}
	root := filepath.Join(collectDir, job)
	filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			b, _ := os.ReadFile(path)
			rel, _ := filepath.Rel(root, path)
			got[rel] = string(b)
		}
		return nil
	})
	want := map[string]string{
		"node-0/dotting/0/1700000000":          string(big),
		"node-0/dotting/1/1700000001":          "rank1\n",
		"node-0/dotting/parallel_group.json":   "{}",
		"node-0/stacks/00000-00002.stacktrace": "main@x.go@1\n",
		HostMappingFile:                        "127.0.0.1 1\n",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %d bytes, want %d", k, len(got[k]), len(v))
		}
	}
	for k, v := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected file %s (%q)", k, v[:min(len(v), 20)])
		}
		if strings.Contains(v, "do not ship") || strings.Contains(v, "not ours") {
			t.Errorf("%s: content from outside the job", k)
		}
	}

	// A file that grew is continued, not sent again; an interrupted
	// transfer resumes from its partial copy.
	f, _ := os.OpenFile(filepath.Join(dotting, job, "1", "1700000001"), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("more\n")
	f.Close()
	writeFile(t, filepath.Join(dotting, job, "1", "1700000099"), []byte("abcdefghij"))
	writeFile(t, filepath.Join(root, "node-0/dotting/1/1700000099.partial"), []byte("abcd"))
	res, err = c.m.Collect(ctx, CollectOptions{Dotting: true})
	if err != nil || len(res[0].Errors) != 0 {
		t.Fatalf("second collect: %+v %v", res, err)
	}
	if res[0].Bytes != int64(len("more\n")+len("efghij")) {
		t.Errorf("second collect shipped %d bytes, want only what is new", res[0].Bytes)
	}
	for name, want := range map[string]string{"node-0/dotting/1/1700000001": "rank1\nmore\n", "node-0/dotting/1/1700000099": "abcdefghij"} {
		if b, _ := os.ReadFile(filepath.Join(root, name)); string(b) != want {
			t.Errorf("%s = %q, want %q", name, b, want)
		}
	}
}

func TestCollectSizeCap(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{CollectDir: t.TempDir(), MaxCollectBytes: 1000})
	dotting := t.TempDir()
	writeFile(t, filepath.Join(dotting, c.job, "0", "1700000000"), bytes.Repeat([]byte("x"), 5000))
	p, err := NewProxy(ProxyConfig{Job: c.job, Node: 0, Upstream: c.m.Addr().String(), Listen: "127.0.0.1:0", Security: insecureSec(), UpstreamToken: testProxyToken, DottingRoot: dotting})
	if err != nil {
		t.Fatal(err)
	}
	c.proxies[0] = p
	c.run(p, p.Run)
	testkit.WaitFor(t, "the proxy", func() bool { return len(c.m.Members()) == 1 })
	res, err := c.m.Collect(context.Background(), CollectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 1 || len(res[0].Errors) != 1 || !strings.Contains(res[0].Errors[0], "exceeds") {
		t.Fatalf("results: %+v", res)
	}
	if _, err := (&Manager{}).Collect(context.Background(), CollectOptions{}); err == nil {
		t.Fatal("Collect without CollectDir succeeded")
	}
}

func TestCleanCollectPath(t *testing.T) {
	for _, p := range []string{"dotting/0/1700000000", "stacks/a.stacktrace", "dotting/parallel_group.json"} {
		if err := cleanCollectPath(p); err != nil {
			t.Errorf("%q: %v", p, err)
		}
	}
	for _, p := range []string{"", "/etc/passwd", "dotting/../../etc/passwd", "dotting/./x", "../x", "dotting//x", "other/x", "dotting", `dotting\..\x`, "dotting/x\x00", "dotting/x.partial", strings.Repeat("a/", 600)} {
		if err := cleanCollectPath(p); err == nil {
			t.Errorf("%q accepted", p)
		}
	}
}

func TestHostMappingMerge(t *testing.T) {
	m := &Manager{cfg: ManagerConfig{Job: "j", CollectDir: t.TempDir()}, log: discardIfNil(nil)}
	name := filepath.Join(m.cfg.CollectDir, "j", HostMappingFile)
	os.MkdirAll(filepath.Dir(name), 0o755)
	for _, step := range []struct {
		hosts map[int]string
		want  string
	}{
		// Nodes sharing a host share its line.
		{map[int]string{0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.3"}, "10.0.0.1 1\n10.0.0.3 3\n"},
		// A node that moved gets its number on the new host.
		{map[int]string{2: "10.0.0.9", 4: "10.0.0.5"}, "10.0.0.1 1\n10.0.0.9 3\n10.0.0.5 5\n"},
	} {
		if err := m.writeHostMapping(step.hosts); err != nil {
			t.Fatal(err)
		}
		if got, _ := os.ReadFile(name); string(got) != step.want {
			t.Fatalf("got %q, want %q", got, step.want)
		}
	}
}

// emptyOffsets is a buggy manager: it answers UploadOffsets with no
// offsets.
type emptyOffsets struct{ pb.UnimplementedControlServer }

func (emptyOffsets) UploadOffsets(context.Context, *pb.UploadOffsetRequest) (*pb.UploadOffsetResponse, error) {
	return &pb.UploadOffsetResponse{}, nil
}

// TestCollectBadOffsets: a proxy told no offsets for its file reports the
// file as failed; it does not panic.
func TestCollectBadOffsets(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterControlServer(srv, emptyOffsets{})
	go srv.Serve(lis)
	defer srv.Stop()
	dotting := t.TempDir()
	writeFile(t, filepath.Join(dotting, "job-1", "0", "1700000000"), []byte("x"))
	p, err := NewProxy(ProxyConfig{Job: "job-1", Node: 0, Upstream: lis.Addr().String(), Listen: "127.0.0.1:0", Security: insecureSec(), UpstreamToken: testProxyToken, DottingRoot: dotting})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	res := p.collectFiles(context.Background(), p.up, &pb.CollectRequest{Collection: 1, Dotting: true})
	if res.GetFiles() != 0 || len(res.GetErrors()) != 1 || !strings.Contains(res.GetErrors()[0], "offsets") {
		t.Fatalf("result %v", res)
	}
}

// uploadJob is a manager collecting from node 0, whose proxy is a bare
// member that uploads what a test makes it.
func uploadJob(t *testing.T) (*cluster, *rawMember, context.CancelFunc, <-chan []CollectResult) {
	t.Helper()
	c := newCluster(t, insecureSec(), ManagerConfig{CollectDir: t.TempDir()})
	p := newRawMember(t, c.m.Addr().String(), c.job, proxySec(), RoleProxy, Position{Node: 0, Rank: -1})
	if err := p.register(); err != nil {
		t.Fatal(err)
	}
	st, err := p.client.Stream(p.ctx(), &pb.StreamRequest{Job: c.job, Member: p.self})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan []CollectResult, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		res, _ := c.m.Collect(ctx, CollectOptions{Nodes: []int{0}})
		done <- res
	}()
	t.Cleanup(func() { cancel(); <-finished })
	if env, err := st.Recv(); err != nil || env.GetCollect() == nil {
		t.Fatalf("no collection request: %v %v", env, err)
	}
	return c, p, cancel, done
}

// TestUploadOneWriterPerPath: while one upload of a path runs, another is
// refused with Aborted, and the file holds the first one's data.
func TestUploadOneWriterPerPath(t *testing.T) {
	c, p, _, _ := uploadJob(t)
	chunk := func(off int64, data string, last bool) *pb.UploadChunk {
		return &pb.UploadChunk{Job: c.job, Node: 0, Path: "dotting/0/1700000000", Offset: off, Data: []byte(data), Last: last}
	}
	first, err := p.client.Upload(p.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Send(chunk(0, "first ", false)); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "the first upload under way", func() bool {
		c.m.mu.Lock()
		defer c.m.mu.Unlock()
		return c.m.uploading["node-0/dotting/0/1700000000"]
	})
	second, err := p.client.Upload(p.ctx())
	if err != nil {
		t.Fatal(err)
	}
	second.Send(chunk(0, "second", true))
	if _, err := second.CloseAndRecv(); status.Code(err) != codes.Aborted {
		t.Fatalf("a second writer of the path: %v", err)
	}
	if err := first.Send(chunk(6, "writer", true)); err != nil {
		t.Fatal(err)
	}
	if res, err := first.CloseAndRecv(); err != nil || res.GetSize() != 12 {
		t.Fatalf("the first writer: %v %v", res, err)
	}
	got, err := os.ReadFile(filepath.Join(c.mcfg.CollectDir, c.job, "node-0", "dotting", "0", "1700000000"))
	if err != nil || string(got) != "first writer" {
		t.Fatalf("the file holds %q, %v", got, err)
	}
}

// TestUploadEnds: an upload that goes silent is ended after the idle
// timeout, and one that goes on after its collection ended is refused.
func TestUploadEnds(t *testing.T) {
	c, p, cancel, done := uploadJob(t)
	c.m.mu.Lock()
	c.m.uploadIdle = 200 * time.Millisecond
	c.m.mu.Unlock()
	chunk := func(path string, off int64, last bool) *pb.UploadChunk {
		return &pb.UploadChunk{Job: c.job, Node: 0, Path: path, Offset: off, Data: []byte("x"), Last: last}
	}
	silent, err := p.client.Upload(p.ctx())
	if err != nil {
		t.Fatal(err)
	}
	silent.Send(chunk("dotting/0/a", 0, false))
	// Waits for the answer, the stream left open.
	if err := silent.RecvMsg(new(pb.UploadResponse)); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a silent upload: %v", err)
	}
	// The late upload must not go idle while the collection ends, however
	// slow the machine.
	c.m.mu.Lock()
	c.m.uploadIdle = time.Minute
	c.m.mu.Unlock()
	late, err := p.client.Upload(p.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if err := late.Send(chunk("dotting/0/b", 0, false)); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "the upload under way", func() bool {
		c.m.mu.Lock()
		defer c.m.mu.Unlock()
		return c.m.uploading["node-0/dotting/0/b"]
	})
	cancel() // the collection ends
	<-done
	late.Send(chunk("dotting/0/b", 1, true))
	if _, err := late.CloseAndRecv(); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("data after the collection ended: %v", err)
	}
}
