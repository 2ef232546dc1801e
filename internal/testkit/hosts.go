package testkit

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// Fabric is hosts that are apart, on this machine: each Host is a network
// namespace with an address of its own on a bridge, and a /dev/shm of its
// own (a tmpfs that every process started on the host sees as /dev/shm,
// and that goes with the host), joined by the bridge. Tests use it to run
// a job's nodes as a cluster's would be: a host can be killed whole,
// replaced on a new address, cut off and shaped.
type Fabric struct {
	t      testing.TB
	id     string // unique on this machine
	bridge string
	subnet string // "10.214.X."
	dir    string
	n      int
	Hosts  []*Host
}

// Host is one host of a Fabric.
type Host struct {
	f    *Fabric
	Name string // h00, h01, ...
	NS   string // its network namespace
	IP   string // its address on the bridge
	Shm  string // its /dev/shm, as seen from outside
	// Iface is its network interface (inside NS), for GLOO_SOCKET_IFNAME.
	Iface string
	veth  string // the bridge's end of its link
	gone  bool
}

var fabrics atomic.Int32

// NeedHosts skips the test unless it can build hosts: root, and ip and tc
// from iproute2.
func NeedHosts(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("hosts apart need root: network namespaces, a tmpfs per host")
	}
	for _, tool := range []string{"ip", "tc", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("hosts apart need %s: %v", tool, err)
		}
	}
}

// NewFabric builds a bridge with n hosts; everything goes when the test
// ends, whether it passes or not.
func NewFabric(t testing.TB, n int) *Fabric {
	t.Helper()
	NeedHosts(t)
	seq := fabrics.Add(1)
	f := &Fabric{t: t, id: strconv.FormatInt(int64(os.Getpid()%46656), 36) + strconv.FormatInt(int64(seq), 36), dir: t.TempDir()}
	f.bridge = "fl" + f.id + "b"
	f.subnet = freeSubnet(t, os.Getpid()+int(seq))
	t.Cleanup(func() { exec.Command("ip", "link", "del", f.bridge).Run() })
	f.run("ip", "link", "add", f.bridge, "type", "bridge")
	f.run("ip", "addr", "add", f.subnet+"254/24", "dev", f.bridge)
	f.run("ip", "link", "set", f.bridge, "up")
	for range n {
		f.AddHost()
	}
	return f
}

func (f *Fabric) run(args ...string) {
	f.t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		f.t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// AddHost adds a host on the next address: a new machine, say one that
// replaces a lost one.
func (f *Fabric) AddHost() *Host {
	f.t.Helper()
	return f.addHost(fmt.Sprintf("%s%d", f.subnet, f.n+1))
}

// Replace adds a new host, with a /dev/shm of its own, that takes the
// address of h, which it removes first: a pod recreated under the name
// that its job reaches it by (a headless Service's), say.
func (f *Fabric) Replace(h *Host) *Host {
	f.t.Helper()
	h.remove()
	h.gone = true
	// The other hosts forget the lost one's link address, as they would
	// never have learnt it for a new pod's address.
	for _, o := range f.Hosts {
		if !o.gone {
			exec.Command("ip", "-n", o.NS, "neigh", "flush", "all").Run()
		}
	}
	return f.addHost(h.IP)
}

func (f *Fabric) addHost(ip string) *Host {
	i := f.n
	f.n++
	h := &Host{f: f,
		Name:  fmt.Sprintf("h%02d", i),
		NS:    fmt.Sprintf("faultline-%s-%d", f.id, i),
		IP:    ip,
		Shm:   filepath.Join(f.dir, fmt.Sprintf("shm-%d", i)),
		veth:  fmt.Sprintf("fl%sh%d", f.id, i),
		Iface: fmt.Sprintf("fl%sp%d", f.id, i),
	}
	f.Hosts = append(f.Hosts, h)
	if err := os.Mkdir(h.Shm, 0o1777); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(h.remove)
	f.run("mount", "-t", "tmpfs", "-o", "size=4g,mode=1777", "tmpfs", h.Shm)
	f.run("ip", "netns", "add", h.NS)
	f.run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.Iface, "netns", h.NS)
	f.run("ip", "link", "set", h.veth, "master", f.bridge, "up")
	f.run("ip", "-n", h.NS, "addr", "add", h.IP+"/24", "dev", h.Iface)
	f.run("ip", "-n", h.NS, "link", "set", h.Iface, "up")
	f.run("ip", "-n", h.NS, "link", "set", "lo", "up")
	return h
}

// Command returns cmd to run on h: in its network namespace, with its
// /dev/shm. Should the test process die, the command dies with it.
func (h *Host) Command(name string, args ...string) *exec.Cmd {
	// ip netns exec runs the command in a mount namespace of its own, in
	// which the host's tmpfs is bound over /dev/shm.
	script := `mount --bind "$0" /dev/shm && exec "$@"`
	cmd := exec.Command("ip", append([]string{"netns", "exec", h.NS, "sh", "-c", script, h.Shm, name}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// Pids returns the processes running on h.
func (h *Host) Pids() []int {
	out, _ := exec.Command("ip", "netns", "pids", h.NS).Output()
	var pids []int
	for _, f := range strings.Fields(string(out)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	return pids
}

// Kill SIGKILLs every process of h and takes its memory (/dev/shm) with
// it, as a host that dies; it returns once they are gone.
func (h *Host) Kill() {
	h.f.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		pids := h.Pids()
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			h.f.t.Fatalf("host %s: processes %v outlived SIGKILL", h.Name, pids)
		}
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
	}
	h.LinkDown()
	exec.Command("umount", "-l", h.Shm).Run()
	h.gone = true
}

// LinkDown cuts h off the bridge; LinkUp joins it again.
func (h *Host) LinkDown() { h.f.run("ip", "link", "set", h.veth, "down") }

// LinkUp joins h to the bridge again after LinkDown.
func (h *Host) LinkUp() { h.f.run("ip", "link", "set", h.veth, "up") }

// Shape limits what h sends to rate (tc's spelling: "1gbit") with a
// token bucket whose queue honors the senders' socket priorities, as
// Linux's default queueing (pfifo_fast, its queue here) and a switch's
// QoS classes do: traffic marked as bulk (SO_PRIORITY 1-3, 5) waits
// behind the rest. "" lifts the limit.
func (h *Host) Shape(rate string) { h.shape(rate, true) }

// ShapeFIFO is Shape with one queue for every sender: bulk traffic that
// fills it delays everything behind it, up to the bucket's 50 ms.
func (h *Host) ShapeFIFO(rate string) { h.shape(rate, false) }

func (h *Host) shape(rate string, prio bool) {
	h.f.t.Helper()
	exec.Command("ip", "netns", "exec", h.NS, "tc", "qdisc", "del", "dev", h.Iface, "root").Run()
	if rate == "" {
		return
	}
	h.f.run("ip", "netns", "exec", h.NS, "tc", "qdisc", "add", "dev", h.Iface, "root", "handle", "1:", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
	if prio {
		h.f.run("ip", "netns", "exec", h.NS, "tc", "qdisc", "add", "dev", h.Iface, "parent", "1:1", "handle", "10:", "pfifo_fast")
	}
}

func (h *Host) remove() {
	for _, p := range h.Pids() {
		syscall.Kill(p, syscall.SIGKILL)
	}
	exec.Command("ip", "netns", "del", h.NS).Run()
	exec.Command("umount", "-l", h.Shm).Run()
}

// freeSubnet picks a 10.214.X.0/24 that no interface here uses.
func freeSubnet(t testing.TB, seed int) string {
	out, err := exec.Command("ip", "-4", "-o", "addr").Output()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 250 {
		s := fmt.Sprintf("10.214.%d.", (seed+i)%250)
		if !strings.Contains(string(out), " "+s) {
			return s
		}
	}
	t.Fatal("no free 10.214.X.0/24 subnet")
	return ""
}

// HostAddr returns an IPv4 address of this host that is not loopback,
// for a job of several nodes on this one, and skips the test where there
// is none.
func HostAddr(t testing.TB) string {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Skipf("this host's addresses cannot be listed: %v", err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			return n.IP.String()
		}
	}
	t.Skip("a job of several nodes needs an address of this host but loopback, and it has none")
	return ""
}
