package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const ns = "train"

func pod(name, job, node string, podLevel bool) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ns, UID: types.UID(name + "-uid"),
			Labels: map[string]string{VolcanoJobLabel: job, "volcano.sh/task-spec": "worker"},
		},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "trainer", Image: "train:1"}}},
	}
	if podLevel {
		p.Labels[PodReschedulingLabel] = PodReschedulingOn
	}
	return p
}

func node(name string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelHostname: name}}}
}

// cluster is a fake API server with job "llm" (pods w0..w3 on n0..n3, two
// pods on n1), another job's pod on n1 and llm's namesake in another
// namespace; it records what is deleted, created and updated.
type cluster struct {
	cs *fake.Clientset
	mu sync.Mutex
	// deleted holds "name uid-precondition" per delete.
	deleted []string
	created []*corev1.Pod
	updated []*corev1.Node
}

func newCluster(t *testing.T, podLevel bool, extra ...runtime.Object) *cluster {
	t.Helper()
	objs := []runtime.Object{
		pod("llm-worker-0", "llm", "n0", podLevel),
		pod("llm-worker-1", "llm", "n1", podLevel),
		pod("llm-worker-2", "llm", "n1", podLevel),
		pod("llm-worker-3", "llm", "n3", podLevel),
		pod("other-worker-0", "other", "n1", true),
		node("n0"), node("n1"), node("n3"),
	}
	elsewhere := pod("llm-worker-0", "llm", "n0", true)
	elsewhere.Namespace = "elsewhere"
	objs = append(objs, elsewhere)
	c := &cluster{cs: fake.NewClientset(append(objs, extra...)...)}
	c.cs.PrependReactor("delete", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		d := a.(k8stesting.DeleteActionImpl)
		uid := ""
		if pc := d.DeleteOptions.Preconditions; pc != nil && pc.UID != nil {
			uid = string(*pc.UID)
		}
		c.mu.Lock()
		c.deleted = append(c.deleted, d.Namespace+"/"+d.Name+" "+uid)
		c.mu.Unlock()
		return false, nil, nil // let the tracker delete it
	})
	c.cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		c.mu.Lock()
		c.created = append(c.created, a.(k8stesting.CreateActionImpl).Object.(*corev1.Pod).DeepCopy())
		c.mu.Unlock()
		return false, nil, nil
	})
	c.cs.PrependReactor("update", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		c.mu.Lock()
		c.updated = append(c.updated, a.(k8stesting.UpdateActionImpl).Object.(*corev1.Node).DeepCopy())
		c.mu.Unlock()
		return false, nil, nil
	})
	return c
}

func (c *cluster) Deleted() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := slices.Clone(c.deleted)
	slices.Sort(out)
	return out
}

func newExecutor(t *testing.T, c *cluster, cfg Config) *Executor {
	t.Helper()
	cfg.Client, cfg.Namespace, cfg.Job = c.cs, ns, "llm"
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestRecreatePodsDeletesOnlyTheFailedPods(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		d    rescheduling.Decision
		want []string
	}{
		{"one pod", rescheduling.Decision{Action: rescheduling.RecreatePods, Node: "n1", Pod: "llm-worker-2"},
			[]string{"train/llm-worker-2 llm-worker-2-uid"}},
		{"one pod, node unknown", rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: "llm-worker-0"},
			[]string{"train/llm-worker-0 llm-worker-0-uid"}},
		{"every pod of the job on a node", rescheduling.Decision{Action: rescheduling.RecreatePods, Node: "n1"},
			[]string{"train/llm-worker-1 llm-worker-1-uid", "train/llm-worker-2 llm-worker-2-uid"}},
	}
	for _, tt := range tests {
		c := newCluster(t, true)
		e := newExecutor(t, c, Config{})
		if err := e.RecreatePods(ctx, tt.d); err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		if diff := cmp.Diff(tt.want, c.Deleted()); diff != "" {
			t.Errorf("%s: deleted (-want +got):\n%s", tt.name, diff)
		}
		if len(c.created) != 0 {
			t.Errorf("%s: created %d pods without Recreate", tt.name, len(c.created))
		}
		left, _ := c.cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if n := len(left.Items); n != 5-len(tt.want) {
			t.Errorf("%s: %d pods left", tt.name, n)
		}
	}
}

func TestRestartJobDeletesEveryPodOfTheJob(t *testing.T) {
	c := newCluster(t, false)
	e := newExecutor(t, c, Config{GracePeriod: ptr(30 * time.Second)})
	if err := e.RestartJob(context.Background(), rescheduling.Decision{Action: rescheduling.RestartJob}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"train/llm-worker-0 llm-worker-0-uid", "train/llm-worker-1 llm-worker-1-uid",
		"train/llm-worker-2 llm-worker-2-uid", "train/llm-worker-3 llm-worker-3-uid",
	}
	if diff := cmp.Diff(want, c.Deleted()); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
	for _, a := range c.cs.Actions() {
		if d, ok := a.(k8stesting.DeleteActionImpl); ok && (d.DeleteOptions.GracePeriodSeconds == nil || *d.DeleteOptions.GracePeriodSeconds != 30) {
			t.Errorf("delete %s: grace period %v", d.Name, d.DeleteOptions.GracePeriodSeconds)
		}
	}
	// Nothing left: the job is gone.
	if err := e.RestartJob(context.Background(), rescheduling.Decision{}); !errors.Is(err, rescheduling.ErrTargetGone) {
		t.Errorf("second RestartJob = %v", err)
	}
}

func TestSelector(t *testing.T) {
	c := newCluster(t, false, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: "llm-launcher", Namespace: ns, UID: "l-uid",
		Labels: map[string]string{VolcanoJobLabel: "llm", "volcano.sh/task-spec": "launcher"},
	}})
	e := newExecutor(t, c, Config{Selector: "volcano.sh/task-spec=launcher"})
	if err := e.RestartJob(context.Background(), rescheduling.Decision{}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"train/llm-launcher l-uid"}, c.Deleted()); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
}

func TestKubeflowJobLabel(t *testing.T) {
	p := pod("tf-worker-0", "", "n0", true)
	p.Labels = map[string]string{KubeflowJobLabel: "tf", PodReschedulingLabel: PodReschedulingOn}
	c := newCluster(t, true, p)
	cfg := Config{JobLabel: KubeflowJobLabel}
	cfg.Client, cfg.Namespace, cfg.Job = c.cs, ns, "tf"
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.RecreatePods(context.Background(), rescheduling.Decision{Node: "n0"}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"train/tf-worker-0 tf-worker-0-uid"}, c.Deleted()); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
}

// TestPodReschedulingLabel: without pod-rescheduling: "on" the pod-level
// decision is refused (and the watchdog escalates), unless AnyPod.
func TestPodReschedulingLabel(t *testing.T) {
	ctx := context.Background()
	d := rescheduling.Decision{Action: rescheduling.RecreatePods, Node: "n1", Pod: "llm-worker-1"}
	c := newCluster(t, false)
	err := newExecutor(t, c, Config{}).RecreatePods(ctx, d)
	if !errors.Is(err, ErrPodReschedulingOff) || !errors.Is(err, rescheduling.ErrUnsupported) || !strings.Contains(err.Error(), "train/llm-worker-1") {
		t.Errorf("RecreatePods = %v", err)
	}
	if len(c.Deleted()) != 0 {
		t.Errorf("deleted %v", c.Deleted())
	}
	if err := newExecutor(t, c, Config{AnyPod: true}).RecreatePods(ctx, d); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"train/llm-worker-1 llm-worker-1-uid"}, c.Deleted()); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
}

// TestGonePods: a fault for a pod that no longer exists, that belongs to
// another job, that was already replaced on another node, or that is
// being deleted, deletes nothing and says the target is gone.
func TestGonePods(t *testing.T) {
	deleting := pod("llm-worker-9", "llm", "n3", true)
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	deleting.Finalizers = []string{"keep"}
	c := newCluster(t, true, deleting)
	e := newExecutor(t, c, Config{})
	ctx := context.Background()
	for _, d := range []rescheduling.Decision{
		{Pod: "llm-worker-7"},
		{Pod: "other-worker-0", Node: "n1"},
		{Pod: "llm-worker-0", Node: "n5"},
		{Pod: "llm-worker-9"},
		{Node: "n9"},
	} {
		if err := e.RecreatePods(ctx, d); !errors.Is(err, rescheduling.ErrTargetGone) {
			t.Errorf("RecreatePods(%+v) = %v, want ErrTargetGone", d, err)
		}
	}
	if err := e.RecreatePods(ctx, rescheduling.Decision{}); !errors.Is(err, rescheduling.ErrUnsupported) {
		t.Errorf("no target: %v", err)
	}
	if err := e.RestartProcesses(ctx, rescheduling.Decision{Pod: "llm-worker-0"}); !errors.Is(err, rescheduling.ErrUnsupported) {
		t.Errorf("RestartProcesses = %v", err)
	}
	if len(c.Deleted()) != 0 {
		t.Errorf("deleted %v", c.Deleted())
	}
}

// TestDeleteRaces: a pod deleted or replaced between list and delete is
// not an error.
func TestDeleteRaces(t *testing.T) {
	c := newCluster(t, true)
	calls := 0
	c.cs.PrependReactor("delete", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		calls++
		gr := schema.GroupResource{Resource: "pods"}
		if calls == 1 {
			return true, nil, apierrors.NewNotFound(gr, a.(k8stesting.DeleteActionImpl).Name)
		}
		return true, nil, apierrors.NewConflict(gr, a.(k8stesting.DeleteActionImpl).Name, errors.New("uid precondition failed"))
	})
	e := newExecutor(t, c, Config{Parallel: 1})
	if err := e.RecreatePods(context.Background(), rescheduling.Decision{Node: "n1"}); err != nil {
		t.Errorf("RecreatePods = %v", err)
	}
	if calls != 2 {
		t.Errorf("%d deletes", calls)
	}
}

func TestAvoidNode(t *testing.T) {
	ctx := context.Background()
	d := rescheduling.Decision{ID: 7, AvoidNode: "n1", Reason: "exit code 201 [hardware]: recreate every pod of the job on node n1"}
	t.Run("taint", func(t *testing.T) {
		c := newCluster(t, true)
		e := newExecutor(t, c, Config{})
		for range 2 { // the second call changes nothing
			if err := e.AvoidNode(ctx, d); err != nil {
				t.Fatal(err)
			}
		}
		if len(c.updated) != 1 {
			t.Fatalf("%d updates", len(c.updated))
		}
		n := c.updated[0]
		want := []corev1.Taint{{Key: DefaultSuspectKey, Value: "true", Effect: corev1.TaintEffectNoSchedule}}
		if diff := cmp.Diff(want, n.Spec.Taints); diff != "" || n.Name != "n1" || n.Annotations[ReasonAnnotation] != d.Reason {
			t.Errorf("node %s taints (-want +got):\n%s annotations %v", n.Name, diff, n.Annotations)
		}
	})
	t.Run("cordon", func(t *testing.T) {
		c := newCluster(t, true)
		e := newExecutor(t, c, Config{Avoid: AvoidCordon})
		if err := e.AvoidNode(ctx, d); err != nil {
			t.Fatal(err)
		}
		if len(c.updated) != 1 || !c.updated[0].Spec.Unschedulable || len(c.updated[0].Spec.Taints) != 0 {
			t.Errorf("updates %+v", c.updated)
		}
	})
	t.Run("label", func(t *testing.T) {
		c := newCluster(t, true)
		e := newExecutor(t, c, Config{Avoid: AvoidLabel, SuspectKey: "example.com/bad"})
		if err := e.AvoidNode(ctx, d); err != nil {
			t.Fatal(err)
		}
		if len(c.updated) != 1 || c.updated[0].Labels["example.com/bad"] != "true" {
			t.Errorf("updates %+v", c.updated)
		}
	})
	t.Run("none", func(t *testing.T) {
		c := newCluster(t, true)
		if err := newExecutor(t, c, Config{Avoid: AvoidNone}).AvoidNode(ctx, d); err != nil || len(c.updated) != 0 {
			t.Errorf("err %v, updates %d", err, len(c.updated))
		}
	})
	t.Run("conflict is retried", func(t *testing.T) {
		c := newCluster(t, true)
		conflicts := 1
		c.cs.PrependReactor("update", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if conflicts > 0 {
				conflicts--
				return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "nodes"}, "n1", errors.New("stale"))
			}
			return false, nil, nil
		})
		if err := newExecutor(t, c, Config{}).AvoidNode(ctx, d); err != nil {
			t.Fatal(err)
		}
		n, _ := c.cs.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
		if len(n.Spec.Taints) != 1 {
			t.Errorf("taints %v", n.Spec.Taints)
		}
	})
	t.Run("missing node", func(t *testing.T) {
		c := newCluster(t, true)
		err := newExecutor(t, c, Config{}).AvoidNode(ctx, rescheduling.Decision{AvoidNode: "n9"})
		if !errors.Is(err, rescheduling.ErrTargetGone) {
			t.Errorf("AvoidNode = %v", err)
		}
	})
}

// TestRecreate: with Recreate, the executor creates each replacement
// itself, unbound, with the anti-affinity for every avoided node added to
// the pod's own affinity.
func TestRecreate(t *testing.T) {
	p := pod("llm-worker-5", "llm", "n1", true)
	p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{
			{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "accelerator", Operator: corev1.NodeSelectorOpIn, Values: []string{"h100"}}}},
			{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "accelerator", Operator: corev1.NodeSelectorOpIn, Values: []string{"h200"}}}},
		}},
	}}
	p.Annotations = map[string]string{"note": "x"}
	c := newCluster(t, true, p)
	e := newExecutor(t, c, Config{Recreate: true, PollInterval: time.Millisecond})
	ctx := context.Background()
	if err := e.AvoidNode(ctx, rescheduling.Decision{AvoidNode: "n0"}); err != nil {
		t.Fatal(err)
	}
	if err := e.RecreatePods(ctx, rescheduling.Decision{Pod: "llm-worker-5", AvoidNode: "n1"}); err != nil {
		t.Fatal(err)
	}
	if len(c.created) != 1 {
		t.Fatalf("created %d pods", len(c.created))
	}
	got := c.created[0]
	avoid := corev1.NodeSelectorRequirement{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn, Values: []string{"n0", "n1"}}
	wantTerms := []corev1.NodeSelectorTerm{
		{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "accelerator", Operator: corev1.NodeSelectorOpIn, Values: []string{"h100"}}, avoid}},
		{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "accelerator", Operator: corev1.NodeSelectorOpIn, Values: []string{"h200"}}, avoid}},
	}
	if diff := cmp.Diff(wantTerms, got.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms); diff != "" {
		t.Errorf("affinity (-want +got):\n%s", diff)
	}
	if got.Name != "llm-worker-5" || got.Spec.NodeName != "" || got.UID != "" || got.Annotations["note"] != "x" || got.Labels[VolcanoJobLabel] != "llm" {
		t.Errorf("replacement %+v", got.ObjectMeta)
	}
	if diff := cmp.Diff([]string{"train/llm-worker-5 llm-worker-5-uid"}, c.Deleted()); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
}

// TestRecreateLeavesANamesake: if another pod took the name before the
// executor could, it is left alone.
func TestRecreateLeavesANamesake(t *testing.T) {
	c := newCluster(t, true)
	c.cs.PrependReactor("delete", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		// The controller replaces it at once.
		name := a.(k8stesting.DeleteActionImpl).Name
		repl := pod(name, "llm", "n3", true)
		repl.UID = "new-uid"
		c.cs.Tracker().Delete(schema.GroupVersionResource{Version: "v1", Resource: "pods"}, ns, name)
		c.cs.Tracker().Add(repl)
		return true, nil, nil
	})
	e := newExecutor(t, c, Config{Recreate: true, PollInterval: time.Millisecond})
	if err := e.RecreatePods(context.Background(), rescheduling.Decision{Pod: "llm-worker-0"}); err != nil {
		t.Fatal(err)
	}
	if len(c.created) != 0 {
		t.Errorf("created %d pods", len(c.created))
	}
}

func TestAddAvoidAffinity(t *testing.T) {
	var spec corev1.PodSpec
	AddAvoidAffinity(&spec, DefaultSuspectKey)
	AddAvoidAffinity(&spec, DefaultSuspectKey) // once only
	want := []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: DefaultSuspectKey, Operator: corev1.NodeSelectorOpDoesNotExist}}}}
	if diff := cmp.Diff(want, spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestConfigValidate(t *testing.T) {
	cs := fake.NewClientset()
	for _, tt := range []struct {
		cfg   Config
		field string
	}{
		{Config{Job: "x"}, "Client"},
		{Config{Client: cs}, "Job"},
		{Config{Client: cs, Job: "x", Avoid: 9}, "Avoid"},
		{Config{Client: cs, Job: "x", GracePeriod: ptr(-time.Second)}, "GracePeriod"},
		{Config{Client: cs, Job: "x", PollInterval: -1}, "PollInterval"},
		{Config{Client: cs, Job: "x", RecreateTimeout: -1}, "RecreateTimeout"},
		{Config{Client: cs, Job: "x", Parallel: -1}, "Parallel"},
		{Config{Client: cs, Job: "x", Selector: "a in ("}, "Selector"},
		{Config{Client: cs, Job: "bad job name"}, `Job "bad job name"`},
	} {
		if _, err := New(tt.cfg); err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("New(%+v) = %v, want an error naming %s", tt.cfg, err, tt.field)
		}
	}
}

// TestWatchdogEscalatesToPodLevel: a process fault in a pod cannot be
// restarted in place through the API server, so the watchdog escalates
// to pod-level rescheduling, which deletes exactly the failed pod; a
// hardware fault deletes the node's pods of the job and taints the node.
func TestWatchdogEscalatesToPodLevel(t *testing.T) {
	c := newCluster(t, true)
	e := newExecutor(t, c, Config{})
	policy, err := rescheduling.NewPolicy(rescheduling.Config{})
	if err != nil {
		t.Fatal(err)
	}
	faults := make(chan rescheduling.Fault, 4)
	var outcomes []rescheduling.Outcome
	var mu sync.Mutex
	w, err := rescheduling.NewWatchdog(rescheduling.WatchdogConfig{
		Policy: policy, Executor: e, Faults: faults,
		OnOutcome: func(o rescheduling.Outcome) { mu.Lock(); outcomes = append(outcomes, o); mu.Unlock() },
	})
	if err != nil {
		t.Fatal(err)
	}
	faults <- rescheduling.Fault{Kind: rescheduling.KindExit, ExitCode: 1, Node: "n0", Pod: "llm-worker-0", Process: "rank-3", Time: time.Now()}
	faults <- rescheduling.Fault{Kind: rescheduling.KindExit, ExitCode: 201, Node: "n3", Pod: "llm-worker-3", Process: "rank-24", Time: time.Now()}
	faults <- rescheduling.Fault{Kind: rescheduling.KindExit, ExitCode: 9, Node: "n7", Pod: "llm-worker-7", Process: "rank-56", Time: time.Now()}
	close(faults)
	if err := w.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := []string{"train/llm-worker-0 llm-worker-0-uid", "train/llm-worker-3 llm-worker-3-uid"}
	if diff := cmp.Diff(want, c.Deleted()); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
	if len(c.updated) != 1 || c.updated[0].Name != "n3" || len(c.updated[0].Spec.Taints) != 1 {
		t.Errorf("updated nodes %+v", c.updated)
	}
	var results []string
	for _, o := range outcomes {
		results = append(results, fmt.Sprintf("%s %s %s", o.Decision.Pod+o.Decision.Node, o.Decision.Action, o.Result))
	}
	slices.Sort(results)
	wantResults := []string{
		"llm-worker-0n0 recreate_pods ok",
		"llm-worker-0n0 restart_processes failed",
		"llm-worker-7n7 recreate_pods gone",
		"llm-worker-7n7 restart_processes failed",
		"n3 recreate_pods ok",
	}
	if diff := cmp.Diff(wantResults, results); diff != "" {
		t.Errorf("outcomes (-want +got):\n%s", diff)
	}
}

func ptr[T any](v T) *T { return &v }
