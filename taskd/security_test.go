package taskd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
)

type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t testing.TB, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes tls.crt and tls.key for name, signed by ca, and trust (the
// CA a peer must be signed by) as ca.crt, into a new directory.
func (ca *testCA) issue(t testing.TB, name string, trust *testCA) string {
	t.Helper()
	dir := t.TempDir()
	ca.issueInto(t, dir, name, trust)
	return dir
}

func (ca *testCA) issueInto(t testing.TB, dir, name string, trust *testCA) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	write := func(name string, data []byte) {
		// Write beside and rename, as a Kubernetes secret update does.
		tmp := filepath.Join(dir, "."+name+".tmp")
		if err := os.WriteFile(tmp, data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	write("tls.crt", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	write("tls.key", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}))
	write("ca.crt", trust.pem)
}

// tryWorker runs a worker against addr for up to d and reports whether it
// got registered.
func tryWorker(t testing.TB, addr string, sec Security, rank int, d time.Duration) bool {
	t.Helper()
	w, err := NewWorker(WorkerConfig{Job: "job-1", Node: 0, Rank: rank, Upstream: addr, Security: sec, AckTimeout: 500 * time.Millisecond, ReconnectMax: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	defer func() { cancel(); <-done }()
	for ctx.Err() == nil {
		if w.Connected() {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}

// register makes one registration of rank at addr with sec and returns
// its error: a refusal is an outcome, with no window to wait out.
func register(t testing.TB, addr string, sec Security, rank int) error {
	t.Helper()
	conn, err := dial(addr, sec, defaultMaxMessageBytes, discardIfNil(nil))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = pb.NewControlClient(conn).Register(ctx, &pb.RegisterRequest{Job: "job-1", Member: memberPB(RoleWorker, Position{Node: 0, Rank: rank}, newInstanceID())})
	return err
}

// refused fails the test unless a registration with sec is refused with
// code.
func refused(t testing.TB, addr string, sec Security, rank int, code codes.Code, what string) {
	t.Helper()
	if err := register(t, addr, sec, rank); status.Code(err) != code {
		t.Fatalf("%s: registration: %v, want %v", what, err, code)
	}
}

func TestMutualTLS(t *testing.T) {
	ca1, ca2 := newTestCA(t, "ca1"), newTestCA(t, "ca2")
	mdir := ca1.issue(t, "manager", ca1)
	c := newCluster(t, SecurityFromDir(mdir), ManagerConfig{})
	addr := c.m.Addr().String()

	if !tryWorker(t, addr, SecurityFromDir(ca1.issue(t, "worker", ca1)), 0, 20*time.Second) {
		t.Fatal("a worker with a certificate of the job's CA was refused")
	}
	refused(t, addr, SecurityFromDir(ca2.issue(t, "intruder", ca1)), 1, codes.Unavailable, "a worker with a certificate of another CA")
	refused(t, addr, SecurityFromDir(ca1.issue(t, "worker", ca2)), 2, codes.Unavailable, "a worker that trusts another CA")
	refused(t, addr, Security{Insecure: true}, 3, codes.Unavailable, "a plaintext worker")

	// Rotate the manager to the other CA: new connections follow the files.
	ca2.issueInto(t, mdir, "manager", ca2)
	future := time.Now().Add(time.Second)
	for _, f := range []string{"tls.crt", "tls.key", "ca.crt"} {
		os.Chtimes(filepath.Join(mdir, f), future, future) // a new mtime even on a coarse clock
	}
	if !tryWorker(t, addr, SecurityFromDir(ca2.issue(t, "worker", ca2)), 4, 20*time.Second) {
		t.Fatal("after rotation, a worker of the new CA was refused")
	}
	refused(t, addr, SecurityFromDir(ca1.issue(t, "worker", ca1)), 5, codes.Unavailable, "after rotation, a worker of the old CA")

	// A broken file keeps the last good certificates in force.
	if err := os.WriteFile(filepath.Join(mdir, "tls.crt"), []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if !tryWorker(t, addr, SecurityFromDir(ca2.issue(t, "worker", ca2)), 6, 20*time.Second) {
		t.Fatal("a broken certificate file displaced the good one")
	}
}

func TestToken(t *testing.T) {
	const token = "s3cret-0123456789abcdef"
	c := newCluster(t, Security{Insecure: true, Token: token}, ManagerConfig{})
	addr := c.m.Addr().String()
	if !tryWorker(t, addr, Security{Insecure: true, Token: token}, 0, 20*time.Second) {
		t.Fatal("a worker with the token was refused")
	}
	refused(t, addr, Security{Insecure: true, Token: "guess"}, 1, codes.Unauthenticated, "a worker with a wrong token")
	refused(t, addr, Security{Insecure: true}, 2, codes.Unauthenticated, "a worker without a token")
}

func TestSecurityValidate(t *testing.T) {
	for _, tc := range []struct {
		sec  Security
		want bool
	}{
		{Security{}, false},
		{Security{Token: "x"}, false},
		{Security{Insecure: true}, true},
		{Security{Insecure: true, Token: "x"}, true},
		{Security{CertFile: "a", KeyFile: "b"}, false},
		{Security{CertFile: "a", KeyFile: "b", CAFile: "c"}, true},
		{Security{CertFile: "a", KeyFile: "b", CAFile: "c", Insecure: true}, false},
	} {
		if err := tc.sec.Validate(); (err == nil) != tc.want {
			t.Errorf("%+v: Validate() = %v, want ok=%v", tc.sec, err, tc.want)
		}
	}
}

// TestOperatorCredential: the Admin and TrainingDataTrace services take
// the operators' token alone, which serves nothing else; with a proxy
// token, a worker's token cannot register as a proxy.
func TestOperatorCredential(t *testing.T) {
	const (
		member = "member-token-0123456789"
		admin  = "admin-token-0123456789"
		proxy  = "proxy-token-0123456789"
	)
	sec := Security{Insecure: true, Token: member}
	c := newCluster(t, sec, ManagerConfig{AdminToken: admin, ProxyToken: proxy})
	addr := c.m.Addr().String()
	list := func(token string) error {
		conn, err := dial(addr, Security{Insecure: true, Token: token}, defaultMaxMessageBytes, discardIfNil(nil))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if _, err := pb.NewAdminClient(conn).ListMembers(ctx, &pb.ListMembersReq{JobNsName: c.job}); err != nil {
			return err
		}
		_, err = pb.NewTrainingDataTraceClient(conn).GetTrainingDataTraceSwitch(ctx, &pb.DataStatusReq{JobNsName: c.job})
		return err
	}
	if err := list(member); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("the Admin service with a member's token: %v", err)
	}
	if err := list(admin); err != nil {
		t.Fatalf("the Admin service with the operators' token: %v", err)
	}
	refused(t, addr, Security{Insecure: true, Token: admin}, 0, codes.PermissionDenied, "a registration with the operators' token")
	// A worker's token does not make a proxy; the proxies' token does.
	fake := newRawMember(t, addr, c.job, sec, RoleProxy, Position{Node: 0, Rank: -1})
	if err := fake.register(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a proxy registered with a member's token: %v", err)
	}
	p, err := NewProxy(ProxyConfig{Job: c.job, Node: 0, Upstream: addr, Listen: "127.0.0.1:0", Security: sec, UpstreamToken: proxy, AckTimeout: c.ack})
	if err != nil {
		t.Fatal(err)
	}
	c.proxies[0] = p
	c.run(p, p.Run)
	w := c.addWorker(0, 0)
	testkit.WaitFor(t, "a worker through the proxy", w.Connected)

	// No operators' token: the services refuse members, naming the field.
	c2 := newCluster(t, sec, ManagerConfig{})
	conn, err := dial(c2.m.Addr().String(), sec, defaultMaxMessageBytes, discardIfNil(nil))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, err = pb.NewAdminClient(conn).ListFaults(context.Background(), &pb.ListFaultsReq{JobNsName: c2.job})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "AdminToken") {
		t.Fatalf("the Admin service without an operators' token: %v", err)
	}
}

// TestProxyRoleClosedByDefault: a manager given no proxies' token takes
// no proxy, so that a worker's token cannot register as a node's proxy and
// report the faults of that node's ranks; the line it logs as it starts
// says which roles are open.
func TestProxyRoleClosedByDefault(t *testing.T) {
	const member = "member-token-0123456789"
	var logged strings.Builder
	sec := Security{Insecure: true, Token: member}
	m, err := NewManager(ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: sec, Orchestration: &OrchestrationConfig{},
		Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	if err != nil {
		t.Fatal(err)
	}
	// Read before Run, which logs on.
	if line := logged.String(); !strings.Contains(line, `proxies="closed (no ProxyToken)"`) || !strings.Contains(line, `workers="the members' token"`) {
		m.Close()
		t.Fatalf("the start line does not say which roles are open: %s", line)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	defer func() { cancel(); <-done; m.Close() }()
	fake := newRawMember(t, m.Addr().String(), "job-1", sec, RoleProxy, Position{Node: 0, Rank: -1})
	if err := fake.register(); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "ProxyToken") {
		t.Fatalf("a proxy registered with a member's token, the proxy role unset: %v", err)
	}
}
