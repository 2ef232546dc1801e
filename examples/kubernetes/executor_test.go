package kubernetes

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/faultline-ml/faultline/rescheduling"
	reschedk8s "github.com/faultline-ml/faultline/rescheduling/kubernetes"
	"github.com/faultline-ml/faultline/taskd/lease"
	leasek8s "github.com/faultline-ml/faultline/taskd/lease/kubernetes"
)

// jobPod is the pod that the Job controller makes of the Job's template
// for completion index i: the template's labels and annotations with the
// Job's name and the index, the index's hostname under the Job's
// subdomain, owned by the Job; bound to node.
func jobPod(job *batchv1.Job, i int, suffix, node string) *corev1.Pod {
	tpl := job.Spec.Template.DeepCopy()
	index := fmt.Sprint(i)
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("%s-%d-%s", job.Name, i, suffix),
			Namespace: job.Namespace,
			UID:       types.UID(fmt.Sprintf("%s-%d-%s-uid", job.Name, i, suffix)),
			Labels: merge(tpl.Labels, map[string]string{
				batchv1.JobNameLabel: job.Name, "job-name": job.Name,
				batchv1.ControllerUidLabel: "job-uid", "controller-uid": "job-uid",
				batchv1.JobCompletionIndexAnnotation: index,
			}),
			Annotations: merge(tpl.Annotations, map[string]string{batchv1.JobCompletionIndexAnnotation: index}),
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "batch/v1", Kind: "Job", Name: job.Name, UID: "job-uid",
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}},
		},
		Spec: tpl.Spec,
	}
	p.Spec.Hostname = fmt.Sprintf("%s-%d", job.Name, i)
	p.Spec.NodeName = node
	return p
}

// managerPod is a pod of the managers' Deployment on node.
func managerPod(d *appsv1.Deployment, suffix, node string) *corev1.Pod {
	tpl := d.Spec.Template.DeepCopy()
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: d.Name + "-7d9f5c-" + suffix, Namespace: d.Namespace,
			UID: types.UID(d.Name + suffix), Labels: merge(tpl.Labels, map[string]string{"pod-template-hash": "7d9f5c"})},
		Spec: tpl.Spec,
	}
}

func merge(a, b map[string]string) map[string]string {
	out := maps.Clone(a)
	if out == nil {
		out = map[string]string{}
	}
	maps.Copy(out, b)
	return out
}

// cluster is the job running: its two pods on node-0 and node-1, and the
// two managers, one of them on node-1 beside a trainer.
func cluster(m *manifests) (*fake.Clientset, []*corev1.Pod) {
	pods := []*corev1.Pod{
		jobPod(m.job, 0, "abcde", "node-0"), jobPod(m.job, 1, "fghij", "node-1"),
		managerPod(m.deployment, "kx2lq", "node-1"), managerPod(m.deployment, "p9s4t", "node-2"),
	}
	objs := []runtime.Object{m.job.DeepCopy()}
	for _, p := range pods {
		objs = append(objs, p)
	}
	return fake.NewClientset(objs...), pods
}

// managerExecutor is the executor as the leading manager makes it for
// this job: the Job's pods by the Job controller's label, in the
// managers' namespace; no node is marked, for the Role grants nothing on
// nodes.
func managerExecutor(t *testing.T, m *manifests, client *fake.Clientset) *reschedk8s.Executor {
	t.Helper()
	e, err := reschedk8s.New(reschedk8s.Config{Client: client, Namespace: m.deployment.Namespace, Job: m.job.Name,
		JobLabel: batchv1.JobNameLabel, Avoid: reschedk8s.AvoidNone})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func podNames(t *testing.T, client *fake.Clientset, ns string) []string {
	t.Helper()
	l, err := client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range l.Items {
		names = append(names, p.Name)
	}
	slices.Sort(names)
	return names
}

// deletes returns "name uid" for each pod deleted, with the UID of its
// precondition.
func deletes(client *fake.Clientset) []string {
	var out []string
	for _, a := range client.Actions() {
		if d, ok := a.(k8stesting.DeleteAction); ok && a.GetResource().Resource == "pods" {
			uid := ""
			if pc := d.GetDeleteOptions().Preconditions; pc != nil && pc.UID != nil {
				uid = string(*pc.UID)
			}
			out = append(out, d.GetName()+" "+uid)
		}
	}
	slices.Sort(out)
	return out
}

// TestExecutorRecreatesAPodOfTheJob: a fault of trainer 1 has the
// executor delete that pod alone, and never a manager, for the Job
// controller to recreate it with its index; the replacement is node 1
// again, under the same name in the headless Service.
func TestExecutorRecreatesAPodOfTheJob(t *testing.T) {
	m := load(t)
	client, pods := cluster(m)
	e := managerExecutor(t, m, client)
	ctx := context.Background()
	failed := pods[1]
	d := rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: failed.Name, Node: failed.Spec.NodeName}
	if err := e.RecreatePods(ctx, d); err != nil {
		t.Fatalf("RecreatePods: %v (does the Job's template carry %s=%s?)", err, reschedk8s.PodReschedulingLabel, reschedk8s.PodReschedulingOn)
	}
	if diff := cmp.Diff([]string{failed.Name + " " + string(failed.UID)}, deletes(client)); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
	want := []string{pods[0].Name, pods[2].Name, pods[3].Name}
	if diff := cmp.Diff(want, podNames(t, client, m.job.Namespace)); diff != "" {
		t.Errorf("pods left (-want +got):\n%s", diff)
	}

	// The Job controller's replacement: index 1 on another node.
	repl := jobPod(m.job, 1, "vwxyz", "node-3")
	if _, err := client.CoreV1().Pods(repl.Namespace).Create(ctx, repl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := repl.Annotations[batchv1.JobCompletionIndexAnnotation]; got != "1" {
		t.Errorf("the replacement's NODE_RANK would be %q, want 1", got)
	}
	if host := repl.Spec.Hostname + "." + repl.Spec.Subdomain; host != failed.Spec.Hostname+"."+failed.Spec.Subdomain {
		t.Errorf("the replacement is %s, the failed pod was %s.%s", host, failed.Spec.Hostname, failed.Spec.Subdomain)
	}
	if svc := m.services[repl.Spec.Subdomain]; !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(repl.Labels)) {
		t.Errorf("Service %s does not select the replacement", svc.Name)
	}
	// A fault of the replacement's node recreates it, not a manager.
	client.ClearActions()
	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Node: "node-3"}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{repl.Name + " " + string(repl.UID)}, deletes(client)); diff != "" {
		t.Errorf("deleted (-want +got):\n%s", diff)
	}
	// The failed pod is gone: a late decision about it changes nothing.
	if err := e.RecreatePods(ctx, d); err == nil {
		t.Errorf("RecreatePods of a deleted pod succeeded")
	}
}

// TestExecutorNodeAndJobRestart: a node's fault deletes the job's pods on
// it and not the manager beside them; a job restart deletes every pod of
// the Job and no manager.
func TestExecutorNodeAndJobRestart(t *testing.T) {
	m := load(t)
	client, pods := cluster(m)
	e := managerExecutor(t, m, client)
	ctx := context.Background()
	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Node: "node-1", AvoidNode: "node-1"}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{pods[1].Name + " " + string(pods[1].UID)}, deletes(client)); diff != "" {
		t.Errorf("node-1's fault deleted (-want +got):\n%s", diff)
	}

	client, pods = cluster(m)
	e = managerExecutor(t, m, client)
	if err := e.RestartJob(ctx, rescheduling.Decision{Action: rescheduling.RestartJob}); err != nil {
		t.Fatal(err)
	}
	want := []string{pods[0].Name + " " + string(pods[0].UID), pods[1].Name + " " + string(pods[1].UID)}
	if diff := cmp.Diff(want, deletes(client)); diff != "" {
		t.Errorf("a job restart deleted (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{pods[2].Name, pods[3].Name}, podNames(t, client, m.job.Namespace)); diff != "" {
		t.Errorf("pods left (-want +got):\n%s", diff)
	}
}

// request is what RBAC authorises of an API call.
type request struct {
	namespace, group, resource, verb, name string
}

func (r request) String() string {
	res := r.resource
	if r.group != "" {
		res += "." + r.group
	}
	return fmt.Sprintf("%s %s %q in namespace %s", r.verb, res, r.name, r.namespace)
}

func requestOf(a k8stesting.Action) request {
	r := request{namespace: a.GetNamespace(), group: a.GetResource().Group, resource: a.GetResource().Resource, verb: a.GetVerb()}
	switch a := a.(type) {
	case k8stesting.GetAction:
		r.name = a.GetName()
	case k8stesting.DeleteAction:
		r.name = a.GetName()
	case k8stesting.UpdateAction:
		r.name = name(a.GetObject())
	}
	return r
}

// allows reports which rule of role allows r, -1 if none.
func allows(role []rbacRule, r request) int {
	for i, rule := range role {
		if rule.namespace == r.namespace && slices.Contains(rule.APIGroups, r.group) && slices.Contains(rule.Resources, r.resource) &&
			slices.Contains(rule.Verbs, r.verb) && (len(rule.ResourceNames) == 0 || slices.Contains(rule.ResourceNames, r.name)) {
			return i
		}
	}
	return -1
}

type rbacRule struct {
	namespace                                  string
	APIGroups, Resources, Verbs, ResourceNames []string
}

// managerRules are the rules of every Role bound to the managers'
// ServiceAccount.
func managerRules(m *manifests) []rbacRule {
	sa := m.deployment.Spec.Template.Spec.ServiceAccountName
	var rules []rbacRule
	for _, b := range m.bindings {
		for _, s := range b.Subjects {
			if s.Name != sa {
				continue
			}
			for _, rule := range m.roles[b.RoleRef.Name].Rules {
				rules = append(rules, rbacRule{namespace: b.Namespace, APIGroups: rule.APIGroups, Resources: rule.Resources,
					Verbs: rule.Verbs, ResourceNames: rule.ResourceNames})
			}
		}
	}
	return rules
}

// TestRoleGrantsWhatIsUsed runs what the managers do against the API
// server: the executor's pod-level and job-level rescheduling, and a term
// of the Lease that --lease-name names in the managers' namespace (as
// POD_NAMESPACE gives it). Every call must be allowed by the Role bound to
// the managers, and every verb the Role grants must be used by some call:
// least privilege.
func TestRoleGrantsWhatIsUsed(t *testing.T) {
	m := load(t)
	rules := managerRules(m)
	var calls []request
	ctx := context.Background()

	client, pods := cluster(m)
	e := managerExecutor(t, m, client)
	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Pod: pods[0].Name, Node: "node-0"}); err != nil {
		t.Fatal(err)
	}
	if err := e.RecreatePods(ctx, rescheduling.Decision{Action: rescheduling.RecreatePods, Node: "node-1"}); err != nil {
		t.Fatal(err)
	}
	if err := e.RestartJob(ctx, rescheduling.Decision{Action: rescheduling.RestartJob}); err == nil {
		t.Fatal("RestartJob of a job without pods succeeded")
	}
	for _, a := range client.Actions() {
		calls = append(calls, requestOf(a))
	}

	client = fake.NewClientset()
	l, err := leasek8s.New(leasek8s.Config{Client: client, Namespace: m.deployment.Namespace, Name: managerFlag(t, m, "lease-name"),
		Candidate: lease.Candidate{Job: managerFlag(t, m, "job"), Config: lease.ConfigHash(nil), Name: "llm-manager-7d9f5c-kx2lq"}})
	if err != nil {
		t.Fatal(err)
	}
	term, err := l.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := term.Check(ctx); err != nil {
		t.Fatal(err)
	}
	term.Resign()
	for _, a := range client.Actions() {
		calls = append(calls, requestOf(a))
	}

	used := map[string]bool{}
	names := map[int]map[string]bool{} // by rule, the objects named
	for _, c := range calls {
		i := allows(rules, c)
		if i < 0 {
			t.Errorf("the managers' Role does not allow %s", c)
			continue
		}
		used[fmt.Sprint(i, c.verb)] = true
		if names[i] == nil {
			names[i] = map[string]bool{}
		}
		names[i][c.name] = true
	}
	for i, rule := range rules {
		for _, v := range rule.Verbs {
			if !used[fmt.Sprint(i, v)] {
				t.Errorf("the managers' Role grants %s on %v %v, which no call uses", v, rule.Resources, rule.ResourceNames)
			}
		}
	}
	// A rule of get, update and delete only, used on one object, should
	// name it (create and list cannot be limited by name).
	for i, rule := range rules {
		if len(rule.ResourceNames) == 0 && len(names[i]) == 1 && !slices.Contains(rule.Verbs, "create") && !slices.Contains(rule.Verbs, "list") {
			t.Errorf("the managers' Role grants %v on every %v, and only %v is used", rule.Verbs, rule.Resources, slices.Collect(maps.Keys(names[i])))
		}
	}
	t.Logf("%d calls, all allowed", len(calls))
}

// managerFlag returns the value of taskd-manager's flag name in the
// Deployment.
func managerFlag(t *testing.T, m *manifests, name string) string {
	t.Helper()
	args := m.deployment.Spec.Template.Spec.Containers[0].Args
	for i, a := range args {
		if a == "--"+name && i+1 < len(args) {
			return args[i+1]
		}
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	t.Fatalf("taskd-manager has no --%s", name)
	return ""
}
