package cluster_test

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/faultline-ml/faultline/rescheduling"
	reschedk8s "github.com/faultline-ml/faultline/rescheduling/kubernetes"
)

// sleeper is a pod spec whose container waits to be stopped.
func sleeper() corev1.PodSpec {
	return corev1.PodSpec{
		RestartPolicy:                 corev1.RestartPolicyNever,
		TerminationGracePeriodSeconds: ptr.To[int64](1),
		Containers: []corev1.Container{{Name: "c", Image: "shell",
			Command: []string{"sleep", "600"}}},
	}
}

// running returns the namespace's running pods matching selector, by
// completion index ("" for pods of no Indexed Job).
func running(t *testing.T, c kubernetes.Interface, ns, selector string) map[string]corev1.Pod {
	t.Helper()
	l, err := c.CoreV1().Pods(ns).List(t.Context(), metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]corev1.Pod{}
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
			out[p.Annotations[batchv1.JobCompletionIndexAnnotation]] = p
		}
	}
	return out
}

// TestExecutorOnRealCluster (2e): rescheduling/kubernetes against the
// real API server, Job controller and scheduler. Pod-level rescheduling
// replaces the one pod (the Job controller recreates its index), the
// pods of one node, or, job-level, every pod; a pod without the
// pod-rescheduling label escalates; a suspect node is tainted through
// 409 conflicts (retried), or the executor fails cleanly when the
// conflicts do not stop; a pod no controller owns is recreated by the
// executor off the suspect node.
func TestExecutorOnRealCluster(t *testing.T) {
	cp := StartControlPlane(t)
	k := StartKubelet(t, cp, map[string]string{"shell": t.TempDir()}, "node-0", "node-1")
	ctx := t.Context()
	const ns = "work"
	for _, err := range []error{
		create(cp.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})),
		create(cp.Admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	newJob := func(name string, podLevel bool) {
		t.Helper()
		tpl := corev1.PodTemplateSpec{Spec: sleeper()}
		if podLevel {
			tpl.Labels = map[string]string{reschedk8s.PodReschedulingLabel: reschedk8s.PodReschedulingOn}
		}
		_, err := cp.Admin.BatchV1().Jobs(ns).Create(ctx, &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: batchv1.JobSpec{CompletionMode: ptr.To(batchv1.IndexedCompletion), Completions: ptr.To[int32](2), Parallelism: ptr.To[int32](2),
				BackoffLimit: ptr.To[int32](10), Template: tpl}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	newJob("llm", true)
	newJob("plain", false)
	sel := batchv1.JobNameLabel + "=llm"
	var before map[string]corev1.Pod
	waitFor(t, time.Minute, "the Jobs' pods running", func() (bool, error) {
		before = running(t, cp.Admin, ns, sel)
		return len(before) == 2 && len(running(t, cp.Admin, ns, batchv1.JobNameLabel+"=plain")) == 2, nil
	})
	e, err := reschedk8s.New(reschedk8s.Config{Client: cp.Admin, Namespace: ns, Job: "llm", JobLabel: batchv1.JobNameLabel})
	if err != nil {
		t.Fatal(err)
	}
	// replaced waits until the pods of the indexes are new and running,
	// the others' untouched.
	replaced := func(what string, indexes ...string) {
		t.Helper()
		start := time.Now()
		var now map[string]corev1.Pod
		waitFor(t, time.Minute, what, func() (bool, error) {
			now = running(t, cp.Admin, ns, sel)
			if len(now) != 2 {
				return false, nil
			}
			for i, p := range now {
				if slices.Contains(indexes, i) == (p.UID == before[i].UID) {
					return false, nil
				}
			}
			return true, nil
		})
		t.Logf("%s: the Job's pods of indexes %v running again %v later", what, indexes, time.Since(start).Round(time.Millisecond))
		before = now
	}

	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: before["1"].Name, Node: before["1"].Spec.NodeName}); err != nil {
		t.Fatal(err)
	}
	replaced("pod-level, one pod", "1")

	node := before["0"].Spec.NodeName
	var on []string
	for i, p := range before {
		if p.Spec.NodeName == node {
			on = append(on, i)
		}
	}
	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Node: node}); err != nil {
		t.Fatal(err)
	}
	replaced("pod-level, the pods of "+node, on...)

	if err := e.RestartJob(ctx, rescheduling.Decision{Action: rescheduling.RestartJob}); err != nil {
		t.Fatal(err)
	}
	replaced("job-level", "0", "1")

	plain, err := reschedk8s.New(reschedk8s.Config{Client: cp.Admin, Namespace: ns, Job: "plain", JobLabel: batchv1.JobNameLabel})
	if err != nil {
		t.Fatal(err)
	}
	if err := plain.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: running(t, cp.Admin, ns, batchv1.JobNameLabel+"=plain")["0"].Name}); !errors.Is(err, reschedk8s.ErrPodReschedulingOff) {
		t.Errorf("pod-level rescheduling of a pod without %s=on: %v, want ErrPodReschedulingOff", reschedk8s.PodReschedulingLabel, err)
	}

	// Conflicts: whoever else writes the Node between the executor's read
	// and its update (here, on the executor's first read; then on every
	// read) makes the real server answer 409.
	var conflicts atomic.Int32
	bumping := func(every bool) kubernetes.Interface {
		var reads atomic.Int32
		c := rest.CopyConfig(cp.Config)
		c.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
			return roundTripper(func(r *http.Request) (*http.Response, error) {
				resp, err := rt.RoundTrip(r)
				if err == nil && resp.StatusCode == http.StatusConflict {
					conflicts.Add(1)
				}
				if err == nil && r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/nodes/") && (every || reads.Add(1) == 1) {
					n, err := cp.Admin.CoreV1().Nodes().Get(r.Context(), "node-1", metav1.GetOptions{})
					if err == nil {
						n.Annotations = map[string]string{"bump": fmt.Sprint(time.Now().UnixNano())}
						cp.Admin.CoreV1().Nodes().Update(r.Context(), n, metav1.UpdateOptions{})
					}
				}
				return resp, err
			})
		}
		return kubernetes.NewForConfigOrDie(c)
	}
	retried, err := reschedk8s.New(reschedk8s.Config{Client: bumping(false), Namespace: ns, Job: "llm", JobLabel: batchv1.JobNameLabel})
	if err != nil {
		t.Fatal(err)
	}
	if err := retried.AvoidNode(ctx, rescheduling.Decision{AvoidNode: "node-1", Reason: "slow"}); err != nil {
		t.Fatalf("AvoidNode through one conflict: %v", err)
	}
	if conflicts.Load() < 1 || !tainted(t, cp, "node-1", reschedk8s.DefaultSuspectKey) {
		t.Errorf("after one conflict: %d conflicts seen, node-1 tainted %v; want at least 1, true", conflicts.Load(), tainted(t, cp, "node-1", reschedk8s.DefaultSuspectKey))
	}
	conflicts.Store(0)
	failing, err := reschedk8s.New(reschedk8s.Config{Client: bumping(true), Namespace: ns, Job: "llm", JobLabel: batchv1.JobNameLabel, SuspectKey: "example.com/other"})
	if err != nil {
		t.Fatal(err)
	}
	err = failing.AvoidNode(ctx, rescheduling.Decision{AvoidNode: "node-1", Reason: "slow"})
	if !apierrors.IsConflict(err) || tainted(t, cp, "node-1", "example.com/other") {
		t.Errorf("AvoidNode through endless conflicts: %v, tainted %v; want a conflict, and no taint", err, tainted(t, cp, "node-1", "example.com/other"))
	}
	t.Logf("endless conflicts: %d answered 409, then: %v", conflicts.Load(), err)

	// A pod of no controller, recreated by the executor off the suspect
	// node, where the real scheduler honours the anti-affinity and the
	// taint.
	solo := sleeper()
	solo.NodeName = "node-1" // bound before the taint
	if _, err := cp.Admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "solo", Labels: map[string]string{"app": "solo", reschedk8s.PodReschedulingLabel: reschedk8s.PodReschedulingOn}}, Spec: solo}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var old types.UID
	waitFor(t, time.Minute, "the solo pod running", func() (bool, error) {
		p, ok := running(t, cp.Admin, ns, "app=solo")[""]
		old = p.UID
		return ok, nil
	})
	re, err := reschedk8s.New(reschedk8s.Config{Client: cp.Admin, Namespace: ns, Job: "solo", JobLabel: "app", Recreate: true, PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := re.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: "solo", Node: "node-1", AvoidNode: "node-1"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the solo pod recreated, running", func() (bool, error) {
		p, ok := running(t, cp.Admin, ns, "app=solo")[""]
		return ok && p.UID != old, nil
	})
	if p := running(t, cp.Admin, ns, "app=solo")[""]; p.Spec.NodeName != "node-0" {
		t.Errorf("the recreated pod runs on %s, want node-0, off the suspect node-1", p.Spec.NodeName)
	}
	_ = k
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func create[T any](_ T, err error) error { return err }

func tainted(t *testing.T, cp *ControlPlane, node, key string) bool {
	t.Helper()
	n, err := cp.Admin.CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == key })
}
