package cluster_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/events"
	kubeapiservertesting "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
	"k8s.io/kubernetes/pkg/controller/deployment"
	"k8s.io/kubernetes/pkg/controller/job"
	"k8s.io/kubernetes/pkg/controller/nodelifecycle"
	"k8s.io/kubernetes/pkg/controller/replicaset"
	"k8s.io/kubernetes/pkg/controller/tainteviction"
	"k8s.io/kubernetes/pkg/scheduler"
	"k8s.io/kubernetes/pkg/scheduler/profile"
)

// ControlPlane is a real cluster's control plane, in this process: etcd,
// the API server (RBAC authorisation, the default admission plugins),
// the Job, Deployment and ReplicaSet controllers, the scheduler, the node
// lifecycle and taint eviction controllers, and a binder that gives each
// claim a hostPath volume of its own.
type ControlPlane struct {
	// Admin is a client of the API server as system:masters.
	Admin *kubernetes.Clientset
	// Config is Admin's configuration.
	Config *rest.Config
	// CertFile is the file of the API server's serving certificate and
	// its issuer, the ca.crt that pods trust.
	CertFile string
	// Port is the API server's, on 127.0.0.1.
	Port int
}

// NodeGrace is the node lifecycle controller's node monitor grace
// period: a node whose kubelet is silent this long is not ready.
const NodeGrace = 4 * time.Second

// JobBackoff is the Job controller's delay before it recreates a failed
// pod, doubled at each failure: 10 s on a cluster by default, 1 s here
// to keep the tests short, as Kubernetes' own integration tests do.
const JobBackoff = time.Second

// StartControlPlane starts a control plane that stops when t ends.
func StartControlPlane(t *testing.T) *ControlPlane {
	t.Helper()
	job.DefaultJobPodFailureBackOff = JobBackoff
	etcdURL := startEtcd(t)
	storage := storagebackend.NewDefaultConfig("/"+t.Name()+"/registry", nil)
	storage.Transport.ServerList = []string{etcdURL}
	srv, err := kubeapiservertesting.StartTestServer(t, nil, []string{
		"--authorization-mode=RBAC",
		// Pods reach the server at this name (their /etc/hosts says
		// where), which its certificate names.
		"--advertise-address=127.0.0.1",
	}, storage)
	if err != nil {
		t.Fatalf("the API server did not start: %v", err)
	}
	t.Cleanup(srv.TearDownFn)
	cp := &ControlPlane{Config: srv.ClientConfig, CertFile: filepath.Join(srv.TmpDir, "apiserver.crt")}
	if _, err := os.Stat(cp.CertFile); err != nil {
		t.Fatalf("the API server's certificate: %v", err)
	}
	u, err := url.Parse(srv.ClientConfig.Host)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Sscan(u.Port(), &cp.Port)
	cp.Admin = kubernetes.NewForConfigOrDie(srv.ClientConfig)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	f := informers.NewSharedInformerFactory(kubernetes.NewForConfigOrDie(rest.AddUserAgent(cp.Config, "controllers")), 0)
	client := func(name string) kubernetes.Interface {
		return kubernetes.NewForConfigOrDie(rest.AddUserAgent(cp.Config, name))
	}
	jc, err := job.NewController(ctx, f.Core().V1().Pods(), f.Batch().V1().Jobs(), client("job-controller"))
	if err != nil {
		t.Fatalf("the Job controller: %v", err)
	}
	nlc, err := nodelifecycle.NewNodeLifecycleController(ctx, f.Coordination().V1().Leases(), f.Core().V1().Pods(), f.Core().V1().Nodes(), f.Apps().V1().DaemonSets(), client("node-lifecycle-controller"),
		time.Second, 10*time.Second, NodeGrace, 100, 100, 50, 0.55)
	if err != nil {
		t.Fatalf("the node lifecycle controller: %v", err)
	}
	tec, err := tainteviction.New(ctx, client("taint-eviction-controller"), f.Core().V1().Pods(), f.Core().V1().Nodes(), "taint-eviction-controller")
	if err != nil {
		t.Fatalf("the taint eviction controller: %v", err)
	}
	dc, err := deployment.NewDeploymentController(ctx, f.Apps().V1().Deployments(), f.Apps().V1().ReplicaSets(), f.Core().V1().Pods(), client("deployment-controller"))
	if err != nil {
		t.Fatalf("the Deployment controller: %v", err)
	}
	rsc := replicaset.NewReplicaSetController(ctx, f.Apps().V1().ReplicaSets(), f.Core().V1().Pods(), client("replicaset-controller"), replicaset.BurstReplicas)
	sf := scheduler.NewInformerFactory(client("scheduler"), 0)
	broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: client("scheduler").EventsV1()})
	sched, err := scheduler.New(ctx, client("scheduler"), sf, nil, profile.NewRecorderFactory(broadcaster), scheduler.WithKubeConfig(cp.Config))
	if err != nil {
		t.Fatalf("the scheduler: %v", err)
	}
	f.Start(ctx.Done())
	sf.Start(ctx.Done())
	f.WaitForCacheSync(ctx.Done())
	sf.WaitForCacheSync(ctx.Done())
	runs := []func(){
		func() { jc.Run(ctx, 2) },
		func() { nlc.Run(ctx) },
		func() { tec.Run(ctx) },
		func() { sched.Run(ctx) },
		func() { dc.Run(ctx, 1) },
		func() { rsc.Run(ctx, 1) },
		func() { bindClaims(ctx, client("claim-binder"), t.TempDir()) },
	}
	stopped := make(chan struct{}, len(runs))
	for _, run := range runs {
		go func() { run(); stopped <- struct{}{} }()
	}
	go func() {
		for range runs {
			<-stopped
		}
		f.Shutdown()
		sf.Shutdown()
		broadcaster.Shutdown()
		close(done)
	}()
	return cp
}

// startEtcd starts an etcd of one member, on loopback, in t's temporary
// folder, and returns its client URL.
func startEtcd(t *testing.T) string {
	t.Helper()
	cfg := embed.NewConfig()
	cfg.Dir = filepath.Join(t.TempDir(), "etcd")
	cfg.LogLevel = "error"
	client, peer := freeURL(t), freeURL(t)
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatalf("etcd: %v", err)
	}
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		t.Fatalf("etcd: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("etcd was not ready within a minute")
	}
	return client.String()
}

// freeURL returns an http URL on a loopback port that was free a moment
// ago.
func freeURL(t *testing.T) url.URL {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return url.URL{Scheme: "http", Host: l.Addr().String()}
}

// bindClaims binds each claim, as it comes, to a hostPath volume of its
// own under dir: the PersistentVolume controller and a provisioner in
// one, for claims of any access mode. It returns when ctx ends.
func bindClaims(ctx context.Context, c kubernetes.Interface, dir string) {
	os.Chmod(dir, 0o755)
	for {
		claims, err := c.CoreV1().PersistentVolumeClaims("").List(ctx, metav1.ListOptions{})
		if err == nil {
			for _, pvc := range claims.Items {
				if pvc.Spec.VolumeName == "" {
					bindClaim(ctx, c, &pvc, dir)
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func bindClaim(ctx context.Context, c kubernetes.Interface, pvc *corev1.PersistentVolumeClaim, dir string) {
	name := "pv-" + string(pvc.UID)
	path := filepath.Join(dir, name)
	if err := os.MkdirAll(path, 0o755); err != nil {
		return
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{"pv.kubernetes.io/bound-by-controller": "yes"}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      pvc.Spec.Resources.Requests,
			AccessModes:                   pvc.Spec.AccessModes,
			PersistentVolumeSource:        corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path}},
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
		},
	}
	pv, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return
	}
	if err == nil {
		pv.Status.Phase = corev1.VolumeBound
		c.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{})
	}
	pvc.Spec.VolumeName = name
	metav1.SetMetaDataAnnotation(&pvc.ObjectMeta, "pv.kubernetes.io/bind-completed", "yes")
	got, err := c.CoreV1().PersistentVolumeClaims(pvc.Namespace).Update(ctx, pvc, metav1.UpdateOptions{})
	if err != nil {
		return
	}
	got.Status.Phase = corev1.ClaimBound
	got.Status.AccessModes = pvc.Spec.AccessModes
	got.Status.Capacity = pvc.Spec.Resources.Requests
	c.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, got, metav1.UpdateOptions{})
}
