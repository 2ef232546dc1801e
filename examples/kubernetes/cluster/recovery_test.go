package cluster_test

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	leasek8s "github.com/faultline-ml/faultline/taskd/lease/kubernetes"
)

var stepLine = regexp.MustCompile(`\[rank(\d+)\]: step (\d+) loss`)

// lastSteps returns, by rank, the last step that a log shows.
func lastSteps(log string) map[int]int {
	out := map[int]int{}
	for _, m := range stepLine.FindAllStringSubmatch(log, -1) {
		r, _ := strconv.Atoi(m[1])
		s, _ := strconv.Atoi(m[2])
		out[r] = s
	}
	return out
}

// TestRecovery (2b, 2c, 2f): the manifests' job, on the real control
// plane, through three faults in one run: the leading manager's pod
// deleted (the standby leads within the Lease's duration and the job goes
// on); a training pod deleted, then another's process killed (each
// time the Job controller recreates the index, whose ranks resume from
// the other pod's replicas); a node lost (the
// node lifecycle controller finds it not ready, its pod is evicted once
// the manifests' toleration of 30 s runs out, and the job recovers
// again). The final weights are bitwise those of the run without faults.
func TestRecovery(t *testing.T) {
	want := Baseline(t)
	cp, k := trainJob(t, "200")
	ctx := t.Context()
	const ns = "training"
	// trainer returns the live pod of the completion index.
	trainer := func(index string) (corev1.Pod, bool) {
		l, err := cp.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=llm"})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range l.Items {
			if p.DeletionTimestamp == nil && p.Annotations[batchv1.JobCompletionIndexAnnotation] == index && p.Status.Phase == corev1.PodRunning {
				return p, true
			}
		}
		return corev1.Pod{}, false
	}
	// at waits until the live pods' ranks all show step s or later, and
	// returns the pod of index 1.
	at := func(what string, s int, timeout time.Duration) corev1.Pod {
		t.Helper()
		var p1 corev1.Pod
		waitFor(t, timeout, what, func() (bool, error) {
			p0, ok0 := trainer("0")
			p, ok1 := trainer("1")
			if !ok0 || !ok1 {
				return false, nil
			}
			p1 = p
			s0, s1 := lastSteps(k.Log(p0.UID)), lastSteps(k.Log(p1.UID))
			return s0[0] >= s && s0[1] >= s && s1[2] >= s && s1[3] >= s, nil
		})
		return p1
	}
	holder := func() string {
		l, err := cp.Admin.CoordinationV1().Leases(ns).Get(ctx, "llm-manager", metav1.GetOptions{})
		if err != nil {
			return ""
		}
		name, _, _ := strings.Cut(ptr.Deref(l.Spec.HolderIdentity, ""), "/")
		return name
	}
	at("the job at step 3", 3, 2*time.Minute)

	// 2b: the leader's pod deleted.
	old := holder()
	start := time.Now()
	if err := cp.Admin.CoreV1().Pods(ns).Delete(ctx, old, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	var leader string
	waitFor(t, time.Minute, "another manager leading and ready", func() (bool, error) {
		leader = holder()
		if leader == "" || leader == old {
			return false, nil
		}
		p, err := cp.Admin.CoreV1().Pods(ns).Get(ctx, leader, metav1.GetOptions{})
		return err == nil && podReady(p), err
	})
	failover := time.Since(start)
	t.Logf("2b: the leader's pod %s deleted; %s leads and is ready %v later (the Lease's duration: %v)", old, leader, failover.Round(time.Millisecond), leasek8s.DefaultLeaseDuration)
	if failover > leasek8s.DefaultLeaseDuration {
		t.Errorf("the new leader served %v after the old one's pod was deleted, past the Lease's duration %v", failover, leasek8s.DefaultLeaseDuration)
	}
	p1 := at("the job going on under the new leader", lastSteps(k.Logs())[0]+3, time.Minute)

	// 2c: a training pod deleted.
	died := lastSteps(k.Log(p1.UID))[2]
	start = time.Now()
	if err := cp.Admin.CoreV1().Pods(ns).Delete(ctx, p1.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	p1b := at("the job back at the step where the pod died", died, 2*time.Minute)
	t.Logf("2c: pod %s deleted at step %d; its index's new pod %s (node %s) back at that step %v later (--heartbeat-deadline 10s, the Job controller's backoff %v)",
		p1.Name, died, p1b.Name, p1b.Spec.NodeName, time.Since(start).Round(time.Millisecond), JobBackoff)
	if p1b.UID == p1.UID {
		t.Fatal("the deleted pod still runs")
	}

	// 2c, again: the training pod's process killed; the pod fails, and
	// the Job controller recreates its index.
	p1b = at("the job going on", lastSteps(k.Log(p1b.UID))[2]+3, time.Minute)
	died = lastSteps(k.Log(p1b.UID))[2]
	start = time.Now()
	k.KillContainer(p1b.UID)
	waitFor(t, time.Minute, "the killed pod's index recreated", func() (bool, error) {
		p, ok := trainer("1")
		return ok && p.UID != p1b.UID, nil
	})
	p1k := at("the job back at the step where the process died", died, 2*time.Minute)
	t.Logf("2c: pod %s's faultline-run killed at step %d; its index's new pod %s back at that step %v later", p1b.Name, died, p1k.Name, time.Since(start).Round(time.Millisecond))
	p1b = p1k

	// 2f: the node of index 1 lost.
	p1b = at("the job going on", lastSteps(k.Log(p1b.UID))[2]+3, time.Minute)
	node := p1b.Spec.NodeName
	died = lastSteps(k.Log(p1b.UID))[2]
	start = time.Now()
	k.NodeDown(node)
	var evicted time.Duration
	waitFor(t, 2*time.Minute, "the lost node's pod evicted", func() (bool, error) {
		p, err := cp.Admin.CoreV1().Pods(ns).Get(ctx, p1b.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return p.DeletionTimestamp != nil, nil
	})
	evicted = time.Since(start)
	p1c := at("the job back at the step where the node died", died, 2*time.Minute)
	t.Logf("2f: node %s lost at step %d; its pod evicted %v later (node monitor grace %v + the manifests' toleration 30s); index 1's new pod %s on %s back at that step %v after the loss",
		node, died, evicted.Round(time.Millisecond), NodeGrace, p1c.Name, p1c.Spec.NodeName, time.Since(start).Round(time.Millisecond))
	if p1c.Spec.NodeName == node {
		t.Errorf("index 1's new pod runs on the lost node %s", node)
	}

	// The lost node's pod stays Terminating: no kubelet confirms its end.
	// The Job is Complete only once every pod of it has ended, so the
	// operator (or the cloud's node controller, deleting the Node) ends
	// it, as Kubernetes' documentation says to for a node that is gone.
	if err := cp.Admin.CoreV1().Pods(ns).Delete(ctx, p1b.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
		t.Fatalf("force-delete the lost node's pod: %v", err)
	}
	got := waitComplete(t, cp, 3*time.Minute)
	if got != want {
		t.Errorf("final weights %s after the faults, want %s, the run without faults'", got, want)
	}
	t.Logf("final weights %s, bitwise the run without faults'", got)
	for _, line := range strings.Split(k.Logs(), "\n") {
		if strings.Contains(line, "replica") && strings.Contains(line, "resum") {
			t.Log(line)
		}
	}
}
