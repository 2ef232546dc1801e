package cluster_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/faultline-ml/faultline/rescheduling"
	reschedk8s "github.com/faultline-ml/faultline/rescheduling/kubernetes"
	"github.com/faultline-ml/faultline/taskd/lease"
	leasek8s "github.com/faultline-ml/faultline/taskd/lease/kubernetes"
)

// serviceAccountClient returns a client of the API server that
// authenticates as the ServiceAccount, with a token the server issued.
func serviceAccountClient(t *testing.T, cp *ControlPlane, ns, name string) kubernetes.Interface {
	t.Helper()
	tr, err := cp.Admin.CoreV1().ServiceAccounts(ns).CreateToken(t.Context(), name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("a token of ServiceAccount %s/%s: %v", ns, name, err)
	}
	c := rest.AnonymousClientConfig(cp.Config)
	c.BearerToken = tr.Status.Token
	return kubernetes.NewForConfigOrDie(c)
}

// TestManagersRole (2d): the manifests' ServiceAccount llm-manager, bound
// to their Role by a real API server's RBAC, campaigns on the Lease, and
// reschedules the Job's pods at pod and job level, as the managers do;
// what the Role does not grant is refused.
func TestManagersRole(t *testing.T) {
	cp := StartControlPlane(t)
	objs := Manifests(t)
	Apply(t, cp, objs, "Namespace", "ServiceAccount", "Role", "RoleBinding", "Job")
	ctx := t.Context()
	const ns = "training"
	sa := serviceAccountClient(t, cp, ns, "llm-manager")

	var pods []corev1.Pod
	waitFor(t, 30*time.Second, "the Job controller's two pods", func() (bool, error) {
		l, err := cp.Admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=llm"})
		if err != nil {
			return false, err
		}
		pods = l.Items
		return len(pods) == 2, nil
	})

	// What the managers do, as they do it.
	l, err := leasek8s.New(leasek8s.Config{Client: sa, Namespace: ns, Name: "llm-manager",
		Candidate: lease.Candidate{Job: "llm", Config: lease.ConfigHash(nil), Name: "llm-manager-0"}})
	if err != nil {
		t.Fatal(err)
	}
	term, err := l.Campaign(ctx)
	if err != nil {
		t.Fatalf("the managers' campaign: %v", err)
	}
	if err := term.Check(ctx); err != nil {
		t.Fatalf("the term's check: %v", err)
	}
	if err := term.Resign(); err != nil {
		t.Fatalf("resign: %v", err)
	}
	e, err := reschedk8s.New(reschedk8s.Config{Client: sa, Namespace: ns, Job: "llm", JobLabel: batchv1.JobNameLabel, Avoid: reschedk8s.AvoidNone})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: pods[0].Name}); err != nil {
		t.Fatalf("pod-level rescheduling as the managers: %v", err)
	}
	if err := e.RestartJob(ctx, rescheduling.Decision{Action: rescheduling.RestartJob}); err != nil {
		t.Fatalf("job-level rescheduling as the managers: %v", err)
	}

	// What they may not do.
	refused := map[string]func() error{
		"delete the Lease": func() error {
			return sa.CoordinationV1().Leases(ns).Delete(ctx, "llm-manager", metav1.DeleteOptions{})
		},
		"get another Lease": func() error {
			_, err := sa.CoordinationV1().Leases(ns).Get(ctx, "other", metav1.GetOptions{})
			return err
		},
		"create a pod": func() error {
			p := pods[1].DeepCopy()
			p.ObjectMeta = metav1.ObjectMeta{Name: "intruder", Namespace: ns}
			p.Spec.NodeName = ""
			_, err := sa.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
			return err
		},
		"update a pod": func() error {
			p, err := cp.Admin.CoreV1().Pods(ns).Get(ctx, pods[1].Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				p = pods[1].DeepCopy()
			}
			p.Labels["x"] = "y"
			_, err = sa.CoreV1().Pods(ns).Update(ctx, p, metav1.UpdateOptions{})
			return err
		},
		"read the token Secret": func() error {
			_, err := sa.CoreV1().Secrets(ns).Get(ctx, "llm-taskd-token", metav1.GetOptions{})
			return err
		},
		"list pods of another namespace": func() error {
			_, err := sa.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
			return err
		},
		"delete the Job": func() error {
			return sa.BatchV1().Jobs(ns).Delete(ctx, "llm", metav1.DeleteOptions{})
		},
		"taint a node (AvoidNode)": func() error {
			cp.Admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-x"}}, metav1.CreateOptions{})
			e, _ := reschedk8s.New(reschedk8s.Config{Client: sa, Namespace: ns, Job: "llm", JobLabel: batchv1.JobNameLabel})
			return e.AvoidNode(ctx, rescheduling.Decision{AvoidNode: "node-x"})
		},
	}
	names := make([]string, 0, len(refused))
	for name := range refused {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		err := refused[name]()
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s as the managers: %v, want forbidden", name, err)
			continue
		}
		var status apierrors.APIStatus
		errors.As(err, &status)
		t.Logf("%s: %s", name, fmt.Sprint(status.Status().Message))
	}
}
