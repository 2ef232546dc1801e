package cluster_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// Kubelet runs the pods bound to its nodes as processes of this machine:
// each pod in a network namespace of its own, on an address of a bridge,
// with a root of its own (the machine's, the image's files over it, the
// pod's volumes at their mount paths), as the pod's user. It reports the
// pods' phases, readiness and exit codes, and kills a deleted pod's
// processes after its grace period. A Service's name resolves, through
// the pods' /etc/hosts, to its ready pods (every pod, for a headless
// Service that publishes addresses not ready); a pod's hostname and
// subdomain to its address.
type Kubelet struct {
	t      *testing.T
	cp     *ControlPlane
	client kubernetes.Interface
	dir    string
	id     string
	bridge string
	subnet string // "10.215.X."
	// Images maps an image's name to the folder of its files.
	images map[string]string

	mu     sync.Mutex
	nodes  map[string]*node
	pods   map[types.UID]*pod
	nextIP int

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	pods_  informers.SharedInformerFactory
	kick   chan struct{}
}

type node struct {
	name string
	down bool // its kubelet silent, its pods' processes dead
}

type pod struct {
	uid      types.UID
	ns, name string
	node     string
	ip       string
	netns    string
	veth     string
	dir      string
	cmd      *exec.Cmd
	exited   chan struct{}
	exitCode int
	ready    bool
	killing  bool
	deleted  bool
}

// StartKubelet starts a kubelet of the given nodes, which it registers;
// images maps each image name the pods use to the folder of its files.
// Everything it made goes when t ends.
func StartKubelet(t *testing.T, cp *ControlPlane, images map[string]string, nodes ...string) *Kubelet {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the kubelet needs root: network and mount namespaces for its pods")
	}
	k := &Kubelet{t: t, cp: cp, client: kubernetes.NewForConfigOrDie(cp.Config), dir: t.TempDir(), images: images,
		nodes: map[string]*node{}, pods: map[types.UID]*pod{}, kick: make(chan struct{}, 1)}
	k.id = strconv.FormatInt(int64(os.Getpid()%46656), 36)
	k.bridge = "flk" + k.id
	k.subnet = freeSubnet(t, os.Getpid())
	os.Chmod(k.dir, 0o755)
	t.Cleanup(func() { exec.Command("ip", "link", "del", k.bridge).Run() })
	k.must("ip", "link", "add", k.bridge, "type", "bridge")
	k.must("ip", "addr", "add", k.subnet+"254/24", "dev", k.bridge)
	k.must("ip", "link", "set", k.bridge, "up")
	k.ctx, k.cancel = context.WithCancel(context.Background())
	t.Cleanup(k.close)
	k.forwardAPI()
	for _, n := range nodes {
		k.register(n)
	}
	k.pods_ = informers.NewSharedInformerFactory(k.client, 0)
	pi := k.pods_.Core().V1().Pods().Informer()
	si := k.pods_.Core().V1().Services().Informer()
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { k.poke() },
		UpdateFunc: func(any, any) { k.poke() },
		DeleteFunc: func(any) { k.poke() },
	}
	pi.AddEventHandler(h)
	si.AddEventHandler(h)
	k.pods_.Start(k.ctx.Done())
	k.pods_.WaitForCacheSync(k.ctx.Done())
	k.wg.Add(2)
	go k.loop()
	go k.heartbeat()
	return k
}

func (k *Kubelet) must(args ...string) {
	k.t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		k.t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func (k *Kubelet) poke() {
	select {
	case k.kick <- struct{}{}:
	default:
	}
}

// forwardAPI serves the API server on the bridge's address, port 443,
// where the pods reach it as kubernetes.default.svc.
func (k *Kubelet) forwardAPI() {
	l, err := net.Listen("tcp", k.subnet+"254:443")
	if err != nil {
		k.t.Fatal(err)
	}
	k.wg.Add(1)
	go func() {
		defer k.wg.Done()
		var conns sync.WaitGroup
		go func() { <-k.ctx.Done(); l.Close() }()
		for {
			c, err := l.Accept()
			if err != nil {
				break
			}
			conns.Add(1)
			go func() {
				defer conns.Done()
				defer c.Close()
				s, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", k.cp.Port))
				if err != nil {
					return
				}
				defer s.Close()
				stop := context.AfterFunc(k.ctx, func() { c.Close(); s.Close() })
				defer stop()
				go func() { io.Copy(s, c); s.Close() }()
				io.Copy(c, s)
			}()
		}
		conns.Wait()
	}()
}

// register creates the Node, ready, with room for the example's pods.
func (k *Kubelet) register(name string) {
	k.t.Helper()
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
		Status: corev1.NodeStatus{
			Capacity: corev1.ResourceList{
				corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("32Gi"), corev1.ResourcePods: resource.MustParse("20"),
			},
			Conditions: []corev1.NodeCondition{readyCondition(true)},
			Addresses:  []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: k.subnet + "254"}},
		},
	}
	n.Status.Allocatable = n.Status.Capacity
	if _, err := k.client.CoreV1().Nodes().Create(k.ctx, n, metav1.CreateOptions{}); err != nil {
		k.t.Fatalf("node %s: %v", name, err)
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		got, err := k.client.CoreV1().Nodes().Get(k.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		got.Status = n.Status
		_, err = k.client.CoreV1().Nodes().UpdateStatus(k.ctx, got, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		k.t.Fatalf("node %s status: %v", name, err)
	}
	k.mu.Lock()
	k.nodes[name] = &node{name: name}
	k.mu.Unlock()
	k.renew(name)
}

func readyCondition(ready bool) corev1.NodeCondition {
	s := corev1.ConditionTrue
	if !ready {
		s = corev1.ConditionUnknown
	}
	now := metav1.Now()
	return corev1.NodeCondition{Type: corev1.NodeReady, Status: s, Reason: "KubeletReady", LastHeartbeatTime: now, LastTransitionTime: now}
}

// renew renews the node's Lease, its heartbeat.
func (k *Kubelet) renew(name string) {
	leases := k.client.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	l, err := leases.Get(k.ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(k.ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To(name), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &now},
		}, metav1.CreateOptions{})
		return
	}
	if err != nil {
		return
	}
	l.Spec.RenewTime = &now
	leases.Update(k.ctx, l, metav1.UpdateOptions{})
}

// heartbeat renews the live nodes' Leases and ready conditions.
func (k *Kubelet) heartbeat() {
	defer k.wg.Done()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-k.ctx.Done():
			return
		case <-tick.C:
		}
		k.mu.Lock()
		var live []string
		for _, n := range k.nodes {
			if !n.down {
				live = append(live, n.name)
			}
		}
		k.mu.Unlock()
		for _, name := range live {
			k.renew(name)
			if i%2 == 0 {
				retry.RetryOnConflict(retry.DefaultRetry, func() error {
					n, err := k.client.CoreV1().Nodes().Get(k.ctx, name, metav1.GetOptions{})
					if err != nil {
						return err
					}
					n.Status.Conditions = []corev1.NodeCondition{readyCondition(true)}
					_, err = k.client.CoreV1().Nodes().UpdateStatus(k.ctx, n, metav1.UpdateOptions{})
					return err
				})
			}
		}
	}
}

// KillContainer SIGKILLs the pod's first process, as the kernel's OOM
// killer or a crash would end it.
func (k *Kubelet) KillContainer(uid types.UID) {
	k.mu.Lock()
	p := k.pods[uid]
	k.mu.Unlock()
	if p != nil && p.cmd != nil && p.cmd.Process != nil {
		p.cmd.Process.Kill()
	}
}

// NodeDown kills the node's pods' processes and silences its kubelet,
// as a machine that dies.
func (k *Kubelet) NodeDown(name string) {
	k.mu.Lock()
	k.nodes[name].down = true
	var gone []*pod
	for _, p := range k.pods {
		if p.node == name {
			gone = append(gone, p)
		}
	}
	k.mu.Unlock()
	for _, p := range gone {
		k.killAll(p)
	}
}

func (k *Kubelet) nodeDown(name string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.nodes[name].down
}

// loop starts the pods bound to its nodes, and ends the deleted ones.
func (k *Kubelet) loop() {
	defer k.wg.Done()
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-k.ctx.Done():
			return
		case <-k.kick:
		case <-tick.C:
		}
		k.sync()
	}
}

func (k *Kubelet) sync() {
	all, _ := k.pods_.Core().V1().Pods().Lister().List(labels.Everything())
	k.writeHosts(all)
	for _, obj := range all {
		k.mu.Lock()
		n := k.nodes[obj.Spec.NodeName]
		p := k.pods[obj.UID]
		k.mu.Unlock()
		if n == nil || n.down {
			continue
		}
		switch {
		case p == nil && obj.DeletionTimestamp == nil && obj.Status.Phase == corev1.PodPending:
			k.start(obj)
		case p == nil && obj.DeletionTimestamp != nil:
			// Never started: nothing to stop.
			k.client.CoreV1().Pods(obj.Namespace).Delete(k.ctx, obj.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &obj.UID}})
		case p != nil && obj.DeletionTimestamp != nil && !p.killing:
			p.killing = true
			grace := time.Duration(ptr.Deref(obj.DeletionGracePeriodSeconds, 30)) * time.Second
			k.wg.Add(1)
			go k.terminate(p, obj, grace)
		}
	}
}

// terminate sends the pod's process SIGTERM, and SIGKILLs all of the
// pod's processes past the grace period; then the pod is gone.
func (k *Kubelet) terminate(p *pod, obj *corev1.Pod, grace time.Duration) {
	defer k.wg.Done()
	if p.cmd.Process != nil {
		p.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-p.exited:
	case <-time.After(grace):
	case <-k.ctx.Done():
	}
	k.killAll(p)
	k.client.CoreV1().Pods(obj.Namespace).Delete(context.Background(), obj.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &obj.UID}})
}

// killAll SIGKILLs every process in the pod's network namespace, and
// removes the namespace once they are gone.
func (k *Kubelet) killAll(p *pod) {
	k.mu.Lock()
	if p.deleted {
		k.mu.Unlock()
		return
	}
	p.deleted = true
	k.mu.Unlock()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		out, _ := exec.Command("ip", "netns", "pids", p.netns).Output()
		pids := strings.Fields(string(out))
		if len(pids) == 0 {
			break
		}
		for _, s := range pids {
			if pid, err := strconv.Atoi(s); err == nil {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	<-p.exited
	exec.Command("ip", "netns", "del", p.netns).Run()
	// The link goes with the namespace, but the kernel destroys a
	// namespace in its own time.
	exec.Command("ip", "link", "del", p.veth).Run()
}

func (k *Kubelet) close() {
	k.cancel()
	k.mu.Lock()
	ps := slices.Collect(maps.Values(k.pods))
	k.mu.Unlock()
	for _, p := range ps {
		k.killAll(p)
	}
	k.wg.Wait()
	k.pods_.Shutdown()
}

// start starts the pod's one container.
func (k *Kubelet) start(obj *corev1.Pod) {
	k.mu.Lock()
	k.nextIP++
	ipn := k.nextIP
	k.mu.Unlock()
	p := &pod{uid: obj.UID, ns: obj.Namespace, name: obj.Name, node: obj.Spec.NodeName, exited: make(chan struct{}),
		ip: fmt.Sprintf("%s%d", k.subnet, ipn), netns: fmt.Sprintf("flk%s-%d", k.id, ipn),
		dir: filepath.Join(k.dir, fmt.Sprintf("pod-%d", ipn))}
	k.mu.Lock()
	k.pods[p.uid] = p
	k.mu.Unlock()
	err := k.run(p, obj)
	if err != nil {
		k.t.Logf("pod %s/%s: %v", obj.Namespace, obj.Name, err)
		close(p.exited)
		p.deleted = true
		k.status(p, func(s *corev1.PodStatus) {
			s.Phase = corev1.PodFailed
			s.Message = err.Error()
		})
		return
	}
	c := obj.Spec.Containers[0]
	started := metav1.Now()
	k.status(p, func(s *corev1.PodStatus) {
		s.Phase = corev1.PodRunning
		s.PodIP, s.PodIPs = p.ip, []corev1.PodIP{{IP: p.ip}}
		s.HostIP, s.HostIPs = k.subnet+"254", []corev1.HostIP{{IP: k.subnet + "254"}}
		s.StartTime = &started
		s.ContainerStatuses = []corev1.ContainerStatus{{Name: c.Name, Image: c.Image, Started: ptr.To(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: started}}}}
		setCondition(s, corev1.PodScheduled, true)
		setCondition(s, corev1.PodInitialized, true)
		setCondition(s, corev1.PodReady, c.ReadinessProbe == nil)
		setCondition(s, corev1.ContainersReady, c.ReadinessProbe == nil)
	})
	k.wg.Add(1)
	go k.watch(p, obj)
}

// watch reports the container's readiness while it runs, and its exit.
func (k *Kubelet) watch(p *pod, obj *corev1.Pod) {
	defer k.wg.Done()
	c := obj.Spec.Containers[0]
	var probe <-chan time.Time
	if c.ReadinessProbe != nil {
		t := time.NewTicker(time.Duration(max(c.ReadinessProbe.PeriodSeconds, 1)) * time.Second)
		defer t.Stop()
		probe = t.C
	}
	for {
		select {
		case <-p.exited:
			if k.nodeDown(p.node) {
				return // a dead node's kubelet says nothing
			}
			// The container ends with its first process: the runtime
			// kills what it leaves behind.
			k.killAll(p)
			code := p.exitCode
			k.status(p, func(s *corev1.PodStatus) {
				s.Phase = corev1.PodSucceeded
				if code != 0 {
					s.Phase = corev1.PodFailed
				}
				setCondition(s, corev1.PodReady, false)
				setCondition(s, corev1.ContainersReady, false)
				if len(s.ContainerStatuses) == 1 {
					run := s.ContainerStatuses[0].State.Running
					s.ContainerStatuses[0].Started = ptr.To(false)
					s.ContainerStatuses[0].State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
						ExitCode: int32(code), Reason: map[bool]string{true: "Completed", false: "Error"}[code == 0],
						StartedAt: ptr.Deref(run, corev1.ContainerStateRunning{}).StartedAt, FinishedAt: metav1.Now()}}
				}
			})
			return
		case <-probe:
			ready := k.probe(p, c)
			if ready != p.ready {
				p.ready = ready
				k.status(p, func(s *corev1.PodStatus) {
					setCondition(s, corev1.PodReady, ready)
					setCondition(s, corev1.ContainersReady, ready)
					if len(s.ContainerStatuses) == 1 {
						s.ContainerStatuses[0].Ready = ready
					}
				})
			}
		}
	}
}

// probe runs the container's TCP readiness probe.
func (k *Kubelet) probe(p *pod, c corev1.Container) bool {
	tcp := c.ReadinessProbe.TCPSocket
	if tcp == nil {
		return true
	}
	port := tcp.Port.IntValue()
	for _, cp := range c.Ports {
		if cp.Name == tcp.Port.StrVal {
			port = int(cp.ContainerPort)
		}
	}
	conn, err := net.DialTimeout("tcp", net.JoinHostPort(p.ip, strconv.Itoa(port)), time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

func setCondition(s *corev1.PodStatus, t corev1.PodConditionType, ok bool) {
	st := corev1.ConditionFalse
	if ok {
		st = corev1.ConditionTrue
	}
	for i := range s.Conditions {
		if s.Conditions[i].Type == t {
			if s.Conditions[i].Status != st {
				s.Conditions[i].Status, s.Conditions[i].LastTransitionTime = st, metav1.Now()
			}
			return
		}
	}
	s.Conditions = append(s.Conditions, corev1.PodCondition{Type: t, Status: st, LastTransitionTime: metav1.Now()})
}

// status updates the pod's status with edit, retrying on conflicts; a
// pod that is gone has none.
func (k *Kubelet) status(p *pod, edit func(*corev1.PodStatus)) {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		obj, err := k.client.CoreV1().Pods(p.ns).Get(context.Background(), p.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if obj.UID != p.uid {
			return nil
		}
		edit(&obj.Status)
		_, err = k.client.CoreV1().Pods(p.ns).UpdateStatus(context.Background(), obj, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		k.t.Logf("pod %s/%s status: %v", p.ns, p.name, err)
	}
}

// run sets up the pod's network and volumes, and starts its container.
func (k *Kubelet) run(p *pod, obj *corev1.Pod) error {
	if len(obj.Spec.Containers) != 1 || len(obj.Spec.InitContainers) != 0 {
		return errors.New("this kubelet runs pods of one container and no init container")
	}
	c := obj.Spec.Containers[0]
	if err := os.MkdirAll(filepath.Join(p.dir, "root"), 0o755); err != nil {
		return err
	}
	veth := fmt.Sprintf("flk%sv%s", k.id, k.nextIPOf(p))
	p.veth = veth
	for _, args := range [][]string{
		{"ip", "netns", "add", p.netns},
		{"ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", p.netns},
		{"ip", "link", "set", veth, "master", k.bridge, "up"},
		{"ip", "-n", p.netns, "addr", "add", p.ip + "/24", "dev", "eth0"},
		{"ip", "-n", p.netns, "link", "set", "eth0", "up"},
		{"ip", "-n", p.netns, "link", "set", "lo", "up"},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	sc := obj.Spec.SecurityContext
	if sc == nil {
		sc = &corev1.PodSecurityContext{}
	}
	fsGroup := int(ptr.Deref(sc.FSGroup, -1))
	vols, err := k.volumes(p, obj, fsGroup)
	if err != nil {
		return err
	}
	init := podInit{
		Root: filepath.Join(p.dir, "root"), Work: filepath.Join(p.dir, "overlay"),
		Hosts: k.hostsFile(obj.Namespace), Resolv: fmt.Sprintf("search %s.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n", obj.Namespace),
		Hostname: cmp.Or(obj.Spec.Hostname, obj.Name), Dir: cmp.Or(c.WorkingDir, "/"),
		UID: int(ptr.Deref(sc.RunAsUser, -1)), GID: int(ptr.Deref(sc.RunAsGroup, -1)),
	}
	if cs := c.SecurityContext; cs != nil {
		init.UID = int(ptr.Deref(cs.RunAsUser, int64(init.UID)))
		init.GID = int(ptr.Deref(cs.RunAsGroup, int64(init.GID)))
	}
	if fsGroup >= 0 {
		init.Groups = []int{fsGroup}
	}
	if c.Image != "" {
		img, ok := k.images[c.Image]
		if !ok {
			return fmt.Errorf("image %q: this kubelet knows %v", c.Image, slices.Collect(maps.Keys(k.images)))
		}
		init.Image = img
	}
	for _, m := range c.VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			return fmt.Errorf("volume mount %s: no such volume", m.Name)
		}
		v.Target, v.ReadOnly = m.MountPath, m.ReadOnly || v.ReadOnly
		init.Mounts = append(init.Mounts, v)
	}
	env, err := k.env(obj, c, p)
	if err != nil {
		return err
	}
	init.Env = env
	lookup := map[string]string{}
	for _, kv := range env {
		name, value, _ := strings.Cut(kv, "=")
		lookup[name] = value
	}
	for _, a := range append(slices.Clone(c.Command), c.Args...) {
		init.Argv = append(init.Argv, expand(a, lookup))
	}
	if len(init.Argv) == 0 {
		return errors.New("this kubelet needs the container's command")
	}
	b, err := json.Marshal(init)
	if err != nil {
		return err
	}
	spec := filepath.Join(p.dir, "init.json")
	if err := os.WriteFile(spec, b, 0o600); err != nil {
		return err
	}
	all, _ := k.pods_.Core().V1().Pods().Lister().List(labels.Everything())
	k.writeHosts(all)
	self, err := os.Executable()
	if err != nil {
		return err
	}
	log, err := os.Create(filepath.Join(p.dir, "log"))
	if err != nil {
		return err
	}
	p.cmd = exec.Command("ip", "netns", "exec", p.netns, self)
	p.cmd.Env = append(os.Environ(), podInitEnv+"="+spec)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Unshareflags: syscall.CLONE_NEWUTS, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		log.Close()
		return err
	}
	go func() {
		err := p.cmd.Wait()
		log.Close()
		p.exitCode = p.cmd.ProcessState.ExitCode()
		if p.exitCode < 0 {
			p.exitCode = 128 + int(p.cmd.ProcessState.Sys().(syscall.WaitStatus).Signal())
		}
		_ = err
		close(p.exited)
	}()
	return nil
}

func (k *Kubelet) nextIPOf(p *pod) string { return p.ip[strings.LastIndex(p.ip, ".")+1:] }

// Log returns what the pod's container has written so far.
func (k *Kubelet) Log(uid types.UID) string {
	k.mu.Lock()
	p := k.pods[uid]
	k.mu.Unlock()
	if p == nil {
		return ""
	}
	b, _ := os.ReadFile(filepath.Join(p.dir, "log"))
	return string(b)
}

// Logs returns every container's output, pod by pod, for a failed
// test's log.
func (k *Kubelet) Logs() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var b strings.Builder
	for _, p := range k.pods {
		out, _ := os.ReadFile(filepath.Join(p.dir, "log"))
		fmt.Fprintf(&b, "=== pod %s/%s (%s, %s)\n%s\n", p.ns, p.name, p.uid, p.node, out)
	}
	return b.String()
}

// expand expands $(NAME) in s from env, as the kubelet does in a
// container's command and args; $$ is $.
func expand(s string, env map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '$' && i+1 < len(s) {
			if s[i+1] == '$' {
				b.WriteByte('$')
				i++
				continue
			}
			if s[i+1] == '(' {
				if j := strings.IndexByte(s[i:], ')'); j > 0 {
					if v, ok := env[s[i+2:i+j]]; ok {
						b.WriteString(v)
						i += j
						continue
					}
				}
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// env is the container's environment: the image's PATH, the API
// server's address, then the container's variables, downward API
// included.
func (k *Kubelet) env(obj *corev1.Pod, c corev1.Container, p *pod) ([]string, error) {
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/",
		"HOSTNAME=" + cmp.Or(obj.Spec.Hostname, obj.Name),
		"KUBERNETES_SERVICE_HOST=kubernetes.default.svc",
		"KUBERNETES_SERVICE_PORT=443",
	}
	vars := map[string]string{}
	for _, e := range c.Env {
		v := expand(e.Value, vars)
		if f := e.ValueFrom; f != nil {
			switch {
			case f.FieldRef != nil:
				var err error
				if v, err = fieldRef(obj, p, f.FieldRef.FieldPath); err != nil {
					return nil, fmt.Errorf("env %s: %w", e.Name, err)
				}
			case f.SecretKeyRef != nil:
				s, err := k.client.CoreV1().Secrets(obj.Namespace).Get(k.ctx, f.SecretKeyRef.Name, metav1.GetOptions{})
				if err != nil {
					return nil, fmt.Errorf("env %s: %w", e.Name, err)
				}
				v = string(s.Data[f.SecretKeyRef.Key])
			case f.ConfigMapKeyRef != nil:
				cm, err := k.client.CoreV1().ConfigMaps(obj.Namespace).Get(k.ctx, f.ConfigMapKeyRef.Name, metav1.GetOptions{})
				if err != nil {
					return nil, fmt.Errorf("env %s: %w", e.Name, err)
				}
				v = cm.Data[f.ConfigMapKeyRef.Key]
			default:
				return nil, fmt.Errorf("env %s: this kubelet serves fieldRef, secretKeyRef and configMapKeyRef", e.Name)
			}
		}
		vars[e.Name] = v
		env = append(env, e.Name+"="+v)
	}
	return env, nil
}

// fieldRef resolves a downward API field.
func fieldRef(obj *corev1.Pod, p *pod, path string) (string, error) {
	switch path {
	case "metadata.name":
		return obj.Name, nil
	case "metadata.namespace":
		return obj.Namespace, nil
	case "metadata.uid":
		return string(obj.UID), nil
	case "spec.nodeName":
		return obj.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return obj.Spec.ServiceAccountName, nil
	case "status.podIP":
		return p.ip, nil
	}
	for prefix, m := range map[string]map[string]string{"metadata.annotations": obj.Annotations, "metadata.labels": obj.Labels} {
		if key, ok := strings.CutPrefix(path, prefix+"['"); ok {
			if key, ok = strings.CutSuffix(key, "']"); ok {
				return m[key], nil
			}
		}
	}
	return "", fmt.Errorf("field %q: this kubelet does not serve it", path)
}

// volumes makes the pod's volumes: Secrets and ConfigMaps as files (laid
// out as the kubelet's atomic writer does, ..data a link to the current
// version), emptyDirs as folders (tmpfs for medium Memory), claims as
// their PersistentVolume's hostPath, and the projected ServiceAccount
// token with the API server's certificate.
func (k *Kubelet) volumes(p *pod, obj *corev1.Pod, fsGroup int) (map[string]podMount, error) {
	vols := map[string]podMount{}
	for _, v := range obj.Spec.Volumes {
		dir := filepath.Join(p.dir, "volumes", v.Name)
		switch {
		case v.EmptyDir != nil:
			if v.EmptyDir.Medium == corev1.StorageMediumMemory {
				size := "64m"
				if v.EmptyDir.SizeLimit != nil {
					size = strconv.FormatInt(v.EmptyDir.SizeLimit.Value(), 10)
				}
				vols[v.Name] = podMount{Size: size}
				continue
			}
			if err := os.MkdirAll(dir, 0o777); err != nil {
				return nil, err
			}
			if err := own(dir, fsGroup, 0o2775); err != nil {
				return nil, err
			}
		case v.Secret != nil:
			s, err := k.client.CoreV1().Secrets(obj.Namespace).Get(k.ctx, v.Secret.SecretName, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			files := map[string][]byte{}
			for key, val := range s.Data {
				files[key] = val
			}
			if err := writeAtomic(dir, files, os.FileMode(ptr.Deref(v.Secret.DefaultMode, 0o644)), fsGroup); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
		case v.ConfigMap != nil:
			cm, err := k.client.CoreV1().ConfigMaps(obj.Namespace).Get(k.ctx, v.ConfigMap.Name, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			files := map[string][]byte{}
			for key, val := range cm.Data {
				files[key] = []byte(val)
			}
			if err := writeAtomic(dir, files, os.FileMode(ptr.Deref(v.ConfigMap.DefaultMode, 0o644)), fsGroup); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
		case v.PersistentVolumeClaim != nil:
			claim, err := k.client.CoreV1().PersistentVolumeClaims(obj.Namespace).Get(k.ctx, v.PersistentVolumeClaim.ClaimName, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			pv, err := k.client.CoreV1().PersistentVolumes().Get(k.ctx, claim.Spec.VolumeName, metav1.GetOptions{})
			if err != nil || pv.Spec.HostPath == nil {
				return nil, fmt.Errorf("volume %s: claim %s is bound to no hostPath volume: %v", v.Name, claim.Name, err)
			}
			if err := own(pv.Spec.HostPath.Path, fsGroup, 0o2775); err != nil {
				return nil, err
			}
			vols[v.Name] = podMount{Source: pv.Spec.HostPath.Path, ReadOnly: v.PersistentVolumeClaim.ReadOnly}
			continue
		case v.Projected != nil:
			files := map[string][]byte{}
			for _, src := range v.Projected.Sources {
				switch {
				case src.ServiceAccountToken != nil:
					tr, err := k.client.CoreV1().ServiceAccounts(obj.Namespace).CreateToken(k.ctx, obj.Spec.ServiceAccountName, &authenticationv1.TokenRequest{
						Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: src.ServiceAccountToken.ExpirationSeconds,
							BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: obj.Name, UID: obj.UID}},
					}, metav1.CreateOptions{})
					if err != nil {
						return nil, fmt.Errorf("volume %s: the ServiceAccount's token: %w", v.Name, err)
					}
					files[src.ServiceAccountToken.Path] = []byte(tr.Status.Token)
				case src.ConfigMap != nil && src.ConfigMap.Name == "kube-root-ca.crt":
					// No controller publishes it here: the API server's
					// certificate is the cluster's root.
					ca, err := os.ReadFile(k.cp.CertFile)
					if err != nil {
						return nil, err
					}
					files["ca.crt"] = ca
				case src.DownwardAPI != nil:
					for _, it := range src.DownwardAPI.Items {
						if it.FieldRef == nil {
							continue
						}
						val, err := fieldRef(obj, p, it.FieldRef.FieldPath)
						if err != nil {
							return nil, fmt.Errorf("volume %s: %w", v.Name, err)
						}
						files[it.Path] = []byte(val)
					}
				default:
					return nil, fmt.Errorf("volume %s: this kubelet projects tokens, kube-root-ca.crt and the downward API", v.Name)
				}
			}
			if err := writeAtomic(dir, files, os.FileMode(ptr.Deref(v.Projected.DefaultMode, 0o644)), fsGroup); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
		default:
			return nil, fmt.Errorf("volume %s: this kubelet serves emptyDir, secret, configMap, persistentVolumeClaim and projected volumes", v.Name)
		}
		vols[v.Name] = podMount{Source: dir}
	}
	return vols, nil
}

// own gives a volume's folder to the pod's fsGroup, as the kubelet does.
func own(dir string, gid int, mode os.FileMode) error {
	if gid < 0 {
		return nil
	}
	if err := os.Chown(dir, 0, gid); err != nil {
		return err
	}
	return os.Chmod(dir, mode|os.ModeSetgid)
}

// writeAtomic lays files out as the kubelet's atomic writer does: in a
// timestamped folder, linked from ..data, each file a link through it.
func writeAtomic(dir string, files map[string][]byte, mode os.FileMode, gid int) error {
	ts := "..2026_01_01_00_00_00.0"
	if err := os.MkdirAll(filepath.Join(dir, ts), 0o755); err != nil {
		return err
	}
	for name, data := range files {
		f := filepath.Join(dir, ts, name)
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(f, data, mode); err != nil {
			return err
		}
		if gid >= 0 {
			os.Chown(f, 0, gid)
		}
		os.Chmod(f, mode)
		top := strings.Split(name, "/")[0]
		os.Symlink(filepath.Join("..data", top), filepath.Join(dir, top))
	}
	return os.Symlink(ts, filepath.Join(dir, "..data"))
}

// hostsFile returns the namespace's /etc/hosts, which writeHosts keeps
// current.
func (k *Kubelet) hostsFile(ns string) string {
	f := filepath.Join(k.dir, "hosts-"+ns)
	if _, err := os.Stat(f); err != nil {
		os.WriteFile(f, []byte("127.0.0.1 localhost\n"), 0o644)
	}
	return f
}

// writeHosts writes each namespace's /etc/hosts: the API server, each
// running pod by its hostname (and subdomain), each Service by its name
// to its first ready pod (any pod, for a Service that publishes those
// not ready). It writes in place: the pods' /etc/hosts are binds of it.
func (k *Kubelet) writeHosts(all []*corev1.Pod) {
	services, _ := k.pods_.Core().V1().Services().Lister().List(labels.Everything())
	byNS := map[string][]string{}
	k.mu.Lock()
	ips := map[types.UID]string{}
	for uid, p := range k.pods {
		if !p.deleted {
			ips[uid] = p.ip
		}
	}
	k.mu.Unlock()
	live := slices.DeleteFunc(slices.Clone(all), func(p *corev1.Pod) bool {
		return p.DeletionTimestamp != nil || ips[p.UID] == ""
	})
	slices.SortFunc(live, func(a, b *corev1.Pod) int { return a.CreationTimestamp.Compare(b.CreationTimestamp.Time) })
	for _, p := range live {
		ns := p.Namespace
		names := []string{cmp.Or(p.Spec.Hostname, p.Name)}
		if sd := p.Spec.Subdomain; sd != "" {
			names = append(names, names[0]+"."+sd, fmt.Sprintf("%s.%s.%s.svc.cluster.local", names[0], sd, ns))
		}
		byNS[ns] = append(byNS[ns], ips[p.UID]+" "+strings.Join(names, " "))
	}
	for _, s := range services {
		if len(s.Spec.Selector) == 0 {
			continue
		}
		sel := labels.SelectorFromSet(s.Spec.Selector)
		for _, p := range live {
			if p.Namespace != s.Namespace || !sel.Matches(labels.Set(p.Labels)) {
				continue
			}
			if !s.Spec.PublishNotReadyAddresses && !podReady(p) {
				continue
			}
			byNS[s.Namespace] = append(byNS[s.Namespace], fmt.Sprintf("%s %s %s.%s %s.%s.svc %s.%s.svc.cluster.local", ips[p.UID], s.Name, s.Name, s.Namespace, s.Name, s.Namespace, s.Name, s.Namespace))
			break
		}
	}
	es, _ := os.ReadDir(k.dir)
	for _, e := range es {
		ns, ok := strings.CutPrefix(e.Name(), "hosts-")
		if !ok {
			continue
		}
		text := "127.0.0.1 localhost\n" + k.subnet + "254 kubernetes kubernetes.default kubernetes.default.svc kubernetes.default.svc.cluster.local\n"
		// Later lines lose to earlier ones: the newest pod of a name first.
		lines := byNS[ns]
		slices.Reverse(lines)
		text += strings.Join(lines, "\n") + "\n"
		f := filepath.Join(k.dir, e.Name())
		if old, _ := os.ReadFile(f); string(old) != text {
			os.WriteFile(f, []byte(text), 0o644)
		}
	}
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// freeSubnet picks a 10.215.X.0/24 that no interface here uses.
func freeSubnet(t *testing.T, seed int) string {
	out, err := exec.Command("ip", "-4", "-o", "addr").Output()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 250 {
		s := fmt.Sprintf("10.215.%d.", (seed+i)%250)
		if !strings.Contains(string(out), " "+s) {
			return s
		}
	}
	t.Fatal("no free 10.215.X.0/24 subnet")
	return ""
}
