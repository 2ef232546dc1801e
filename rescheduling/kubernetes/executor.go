package kubernetes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/faultline-ml/faultline/rescheduling"
)

// Labels that select a job's pods and switch pod-level rescheduling on,
// as Volcano, MindCluster and the Kubeflow training operators set them.
const (
	// VolcanoJobLabel names a Volcano job's pods (the default JobLabel).
	VolcanoJobLabel = "volcano.sh/job-name"
	// KubeflowJobLabel names the pods of a Kubeflow or Ascend operator
	// job.
	KubeflowJobLabel = "training.kubeflow.org/job-name"
	// PodReschedulingLabel, set to PodReschedulingOn on a job's pods,
	// enables MindCluster's pod-level rescheduling: only the failed pods
	// are recreated. Any other value, or none, means job-level only.
	PodReschedulingLabel = "pod-rescheduling"
	// PodReschedulingOn is PodReschedulingLabel's enabling value.
	PodReschedulingOn = "on"
	// DefaultSuspectKey is the default taint or label key of a suspect
	// node.
	DefaultSuspectKey = "faultline.io/suspect"
	// ReasonAnnotation, on a suspect node, holds the decision that marked
	// it.
	ReasonAnnotation = "faultline.io/suspect-reason"
)

// Avoid says how a suspect node is kept out of the job.
type Avoid uint8

// Ways to avoid a node.
const (
	// AvoidTaint adds a NoSchedule taint with SuspectKey to the node (the
	// default): no new pod without a toleration lands there.
	AvoidTaint Avoid = iota
	// AvoidCordon marks the node unschedulable, as kubectl cordon.
	AvoidCordon
	// AvoidLabel labels the node SuspectKey=true; pods whose template
	// carries AddAvoidAffinity's requirement stay off it.
	AvoidLabel
	// AvoidNone leaves the node alone; only pods the executor recreates
	// itself (Config.Recreate) get an anti-affinity.
	AvoidNone
)

// ErrPodReschedulingOff is wrapped by RecreatePods when a target pod lacks
// PodReschedulingLabel=on (and Config.AnyPod is false). It wraps
// rescheduling.ErrUnsupported, so the watchdog escalates to a job restart,
// as MindCluster does.
var ErrPodReschedulingOff = fmt.Errorf("kubernetes: pod-level rescheduling is off (label %s=%s missing): %w",
	PodReschedulingLabel, PodReschedulingOn, rescheduling.ErrUnsupported)

// Config configures an Executor. Client and Job are required; every other
// field's zero value is a documented default.
type Config struct {
	Client kubernetes.Interface
	// Namespace holds the job's pods; default "default".
	Namespace string
	// Job is the job's name: the value of JobLabel on its pods.
	Job string
	// JobLabel is the label naming a pod's job; default VolcanoJobLabel
	// (KubeflowJobLabel for Kubeflow and the Ascend operator).
	JobLabel string
	// Selector, a label selector, narrows the job's pods further
	// ("volcano.sh/task-spec=worker"); default none.
	Selector string
	// AnyPod allows pod-level rescheduling of pods without
	// PodReschedulingLabel=on; default false, as MindCluster.
	AnyPod bool
	// Recreate makes the executor create each replacement pod itself,
	// for pods that no controller recreates: a copy of the deleted pod,
	// unscheduled, with a required node anti-affinity for every node it
	// was told to avoid. Default false: the job's controller (Volcano,
	// the training operator) recreates deleted pods.
	Recreate bool
	// Avoid is how a suspect node is kept out of the job; default
	// AvoidTaint.
	Avoid Avoid
	// SuspectKey is the taint or label key of a suspect node; default
	// DefaultSuspectKey.
	SuspectKey string
	// GracePeriod overrides the pods' termination grace period on delete;
	// nil keeps each pod's own.
	GracePeriod *time.Duration
	// PollInterval is how often Recreate checks that a deleted pod is
	// gone; default 1 s. RecreateTimeout bounds the wait; default 5 min.
	PollInterval    time.Duration
	RecreateTimeout time.Duration
	// Parallel bounds the API calls in flight for a job restart; default
	// 16.
	Parallel int
	// Logger receives a record per pod deleted or created and node
	// marked; nil: discard.
	Logger *slog.Logger
}

// Validate reports the first field that is missing or out of range.
func (c Config) Validate() error {
	switch {
	case c.Client == nil:
		return errors.New("kubernetes: Config.Client is nil")
	case c.Job == "":
		return errors.New("kubernetes: Config.Job is empty")
	case c.Avoid > AvoidNone:
		return fmt.Errorf("kubernetes: Config.Avoid is %d, want AvoidTaint..AvoidNone", c.Avoid)
	case c.GracePeriod != nil && *c.GracePeriod < 0:
		return fmt.Errorf("kubernetes: Config.GracePeriod is %v, want >= 0", *c.GracePeriod)
	case c.PollInterval < 0:
		return fmt.Errorf("kubernetes: Config.PollInterval is %v, want >= 0", c.PollInterval)
	case c.RecreateTimeout < 0:
		return fmt.Errorf("kubernetes: Config.RecreateTimeout is %v, want >= 0", c.RecreateTimeout)
	case c.Parallel < 0:
		return fmt.Errorf("kubernetes: Config.Parallel is %d, want >= 0", c.Parallel)
	}
	if _, err := c.selector(); err != nil {
		return fmt.Errorf("kubernetes: Config.Selector %q or Job %q: %w", c.Selector, c.Job, err)
	}
	return nil
}

// selector returns the selector of the job's pods.
func (c Config) selector() (labels.Selector, error) {
	key := cmp.Or(c.JobLabel, VolcanoJobLabel)
	s := key + "=" + c.Job
	if c.Selector != "" {
		s += "," + c.Selector
	}
	return labels.Parse(s)
}

// Executor is the rescheduling.Executor of a Kubernetes job: pod-level
// rescheduling deletes only the failed pods of the job, job-level deletes
// all of them, and a suspect node is tainted, cordoned or labelled. It
// is safe for concurrent use.
type Executor struct {
	cfg      Config
	selector labels.Selector
	log      *slog.Logger

	mu      sync.Mutex
	avoided map[string]bool // nodes replacement pods must avoid
}

// New returns an executor built from cfg.
func New(cfg Config) (*Executor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	sel, _ := cfg.selector()
	cfg.Namespace = cmp.Or(cfg.Namespace, "default")
	cfg.JobLabel = cmp.Or(cfg.JobLabel, VolcanoJobLabel)
	cfg.SuspectKey = cmp.Or(cfg.SuspectKey, DefaultSuspectKey)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, time.Second)
	cfg.RecreateTimeout = cmp.Or(cfg.RecreateTimeout, 5*time.Minute)
	cfg.Parallel = cmp.Or(cfg.Parallel, 16)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	return &Executor{cfg: cfg, selector: sel, log: cfg.Logger, avoided: map[string]bool{}}, nil
}

// RestartProcesses is not supported: a process in a container is restarted
// by the agent inside the pod, not through the API server.
func (e *Executor) RestartProcesses(context.Context, rescheduling.Decision) error {
	return fmt.Errorf("kubernetes: restart a process in place: %w", rescheduling.ErrUnsupported)
}

// RecreatePods deletes d.Pod, or every pod of the job on d.Node when
// d.Pod is "" (and, with Config.Recreate, creates their replacements).
// A pod that no longer exists, belongs to another job or now runs on
// another node than d.Node is gone: the error wraps
// rescheduling.ErrTargetGone.
func (e *Executor) RecreatePods(ctx context.Context, d rescheduling.Decision) error {
	pods, err := e.targets(ctx, d)
	if err != nil {
		return err
	}
	if !e.cfg.AnyPod {
		for _, p := range pods {
			if p.Labels[PodReschedulingLabel] != PodReschedulingOn {
				return fmt.Errorf("%w: pod %s/%s", ErrPodReschedulingOff, p.Namespace, p.Name)
			}
		}
	}
	return e.replace(ctx, pods, d)
}

// RestartJob deletes every pod of the job (and, with Config.Recreate,
// creates their replacements).
func (e *Executor) RestartJob(ctx context.Context, d rescheduling.Decision) error {
	pods, err := e.list(ctx)
	if err != nil {
		return err
	}
	if len(pods) == 0 {
		return fmt.Errorf("kubernetes: job %s/%s has no pod matching %q: %w", e.cfg.Namespace, e.cfg.Job, e.selector, rescheduling.ErrTargetGone)
	}
	return e.replace(ctx, pods, d)
}

// AvoidNode keeps the job off d.AvoidNode as Config.Avoid says, notes the
// decision's reason on the node, and remembers the node for the
// anti-affinity of recreated pods.
func (e *Executor) AvoidNode(ctx context.Context, d rescheduling.Decision) error {
	name := d.AvoidNode
	if name == "" {
		return nil
	}
	e.mu.Lock()
	e.avoided[name] = true
	e.mu.Unlock()
	if e.cfg.Avoid == AvoidNone {
		return nil
	}
	nodes := e.cfg.Client.CoreV1().Nodes()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := nodes.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !e.mark(n, d) {
			return nil
		}
		_, err = nodes.Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Errorf("kubernetes: avoid node %s: %w", name, rescheduling.ErrTargetGone)
	case err != nil:
		return fmt.Errorf("kubernetes: avoid node %s: %w", name, err)
	}
	e.log.Info("node marked suspect", "node", name, "avoid", e.cfg.Avoid, "decision", d.ID)
	return nil
}

// mark changes n to keep the job off it; false if it already does.
func (e *Executor) mark(n *corev1.Node, d rescheduling.Decision) bool {
	changed := false
	switch e.cfg.Avoid {
	case AvoidTaint:
		if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == e.cfg.SuspectKey }) {
			n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{
				Key: e.cfg.SuspectKey, Value: "true", Effect: corev1.TaintEffectNoSchedule,
			})
			changed = true
		}
	case AvoidCordon:
		if !n.Spec.Unschedulable {
			n.Spec.Unschedulable, changed = true, true
		}
	case AvoidLabel:
		if n.Labels[e.cfg.SuspectKey] != "true" {
			if n.Labels == nil {
				n.Labels = map[string]string{}
			}
			n.Labels[e.cfg.SuspectKey], changed = "true", true
		}
	}
	if changed {
		if n.Annotations == nil {
			n.Annotations = map[string]string{}
		}
		n.Annotations[ReasonAnnotation] = d.Reason
	}
	return changed
}

// targets returns the pods a pod-level decision names.
func (e *Executor) targets(ctx context.Context, d rescheduling.Decision) ([]corev1.Pod, error) {
	switch {
	case d.Pod != "":
		p, err := e.cfg.Client.CoreV1().Pods(e.cfg.Namespace).Get(ctx, d.Pod, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return nil, fmt.Errorf("kubernetes: pod %s/%s: %w", e.cfg.Namespace, d.Pod, rescheduling.ErrTargetGone)
		case err != nil:
			return nil, fmt.Errorf("kubernetes: get pod %s/%s: %w", e.cfg.Namespace, d.Pod, err)
		case !e.selector.Matches(labels.Set(p.Labels)):
			return nil, fmt.Errorf("kubernetes: pod %s/%s is not one of job %s's (%s): %w", p.Namespace, p.Name, e.cfg.Job, e.selector, rescheduling.ErrTargetGone)
		case d.Node != "" && p.Spec.NodeName != "" && p.Spec.NodeName != d.Node:
			return nil, fmt.Errorf("kubernetes: pod %s/%s now runs on node %s, not %s: %w", p.Namespace, p.Name, p.Spec.NodeName, d.Node, rescheduling.ErrTargetGone)
		case p.DeletionTimestamp != nil:
			return nil, fmt.Errorf("kubernetes: pod %s/%s is being deleted: %w", p.Namespace, p.Name, rescheduling.ErrTargetGone)
		}
		return []corev1.Pod{*p}, nil
	case d.Node != "":
		all, err := e.list(ctx)
		if err != nil {
			return nil, err
		}
		var pods []corev1.Pod
		for _, p := range all {
			if p.Spec.NodeName == d.Node {
				pods = append(pods, p)
			}
		}
		if len(pods) == 0 {
			return nil, fmt.Errorf("kubernetes: job %s/%s has no pod on node %s: %w", e.cfg.Namespace, e.cfg.Job, d.Node, rescheduling.ErrTargetGone)
		}
		return pods, nil
	}
	return nil, fmt.Errorf("kubernetes: recreate pods: the decision names no pod and no node: %w", rescheduling.ErrUnsupported)
}

// list returns the job's pods that are not being deleted, by name.
func (e *Executor) list(ctx context.Context) ([]corev1.Pod, error) {
	l, err := e.cfg.Client.CoreV1().Pods(e.cfg.Namespace).List(ctx, metav1.ListOptions{LabelSelector: e.selector.String()})
	if err != nil {
		return nil, fmt.Errorf("kubernetes: list pods of job %s/%s: %w", e.cfg.Namespace, e.cfg.Job, err)
	}
	var pods []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil && e.selector.Matches(labels.Set(p.Labels)) {
			pods = append(pods, p)
		}
	}
	slices.SortFunc(pods, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return pods, nil
}

// replace deletes pods and, with Config.Recreate, creates their
// replacements.
func (e *Executor) replace(ctx context.Context, pods []corev1.Pod, d rescheduling.Decision) error {
	avoid := e.avoidList(d.AvoidNode)
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(e.cfg.Parallel)
	for _, p := range pods {
		g.Go(func() error {
			if err := e.delete(ctx, &p, d); err != nil {
				return err
			}
			if e.cfg.Recreate {
				return e.recreate(ctx, &p, avoid)
			}
			return nil
		})
	}
	return g.Wait()
}

func (e *Executor) avoidList(extra string) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if extra != "" {
		e.avoided[extra] = true
	}
	out := make([]string, 0, len(e.avoided))
	for n := range e.avoided {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// delete deletes p, only if it is still the same pod (same UID).
func (e *Executor) delete(ctx context.Context, p *corev1.Pod, d rescheduling.Decision) error {
	opts := metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &p.UID}}
	if e.cfg.GracePeriod != nil {
		secs := int64(e.cfg.GracePeriod.Seconds())
		opts.GracePeriodSeconds = &secs
	}
	err := e.cfg.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, opts)
	switch {
	case apierrors.IsNotFound(err), apierrors.IsConflict(err):
		// Deleted, or replaced, meanwhile: the goal is reached.
		e.log.Info("pod already gone", "pod", p.Name, "decision", d.ID)
		return nil
	case err != nil:
		return fmt.Errorf("kubernetes: delete pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	e.log.Info("pod deleted", "pod", p.Name, "node", p.Spec.NodeName, "decision", d.ID, "action", d.Action.String())
	return nil
}

// recreate waits until old is gone and creates its replacement, off the
// avoided nodes. If another pod took old's name meanwhile, it is left
// alone.
func (e *Executor) recreate(ctx context.Context, old *corev1.Pod, avoid []string) error {
	pods := e.cfg.Client.CoreV1().Pods(old.Namespace)
	taken := false
	err := wait.PollUntilContextTimeout(ctx, e.cfg.PollInterval, e.cfg.RecreateTimeout, true, func(ctx context.Context) (bool, error) {
		p, err := pods.Get(ctx, old.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return true, nil
		case err != nil:
			return false, nil // transient: poll again
		case p.UID != old.UID:
			taken = true
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("kubernetes: wait for pod %s/%s to go: %w", old.Namespace, old.Name, err)
	}
	if taken {
		return nil
	}
	_, err = pods.Create(ctx, Replacement(old, avoid), metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("kubernetes: create pod %s/%s: %w", old.Namespace, old.Name, err)
	}
	e.log.Info("pod recreated", "pod", old.Name, "avoid", avoid)
	return nil
}

// Replacement returns a new pod in old's image: same name, labels,
// annotations, owners and spec, not bound to a node, and required not to
// run on the nodes in avoid (matched by the kubernetes.io/hostname label,
// which equals the node name on most clusters).
func Replacement(old *corev1.Pod, avoid []string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:            old.Name,
			Namespace:       old.Namespace,
			Labels:          maps.Clone(old.Labels),
			Annotations:     maps.Clone(old.Annotations),
			OwnerReferences: slices.Clone(old.OwnerReferences),
		},
		Spec: *old.Spec.DeepCopy(),
	}
	p.Spec.NodeName = ""
	if len(avoid) > 0 {
		addNodeRequirement(&p.Spec, corev1.NodeSelectorRequirement{
			Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn, Values: slices.Clone(avoid),
		})
	}
	return p
}

// AddAvoidAffinity adds to spec a required node affinity that keeps the pod
// off nodes labelled key (AvoidLabel's mark): put it in the job's pod
// template so that recreated pods avoid suspect nodes.
func AddAvoidAffinity(spec *corev1.PodSpec, key string) {
	addNodeRequirement(spec, corev1.NodeSelectorRequirement{Key: key, Operator: corev1.NodeSelectorOpDoesNotExist})
}

// addNodeRequirement adds req to every term of spec's required node
// affinity (terms are ORed, requirements within a term ANDed), creating
// one term if there is none.
func addNodeRequirement(spec *corev1.PodSpec, req corev1.NodeSelectorRequirement) {
	if spec.Affinity == nil {
		spec.Affinity = &corev1.Affinity{}
	}
	if spec.Affinity.NodeAffinity == nil {
		spec.Affinity.NodeAffinity = &corev1.NodeAffinity{}
	}
	na := spec.Affinity.NodeAffinity
	if na.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		na.RequiredDuringSchedulingIgnoredDuringExecution = &corev1.NodeSelector{}
	}
	sel := na.RequiredDuringSchedulingIgnoredDuringExecution
	if len(sel.NodeSelectorTerms) == 0 {
		sel.NodeSelectorTerms = []corev1.NodeSelectorTerm{{}}
	}
	for i := range sel.NodeSelectorTerms {
		t := &sel.NodeSelectorTerms[i]
		if !slices.ContainsFunc(t.MatchExpressions, func(r corev1.NodeSelectorRequirement) bool {
			return r.Key == req.Key && r.Operator == req.Operator && slices.Equal(r.Values, req.Values)
		}) {
			t.MatchExpressions = append(t.MatchExpressions, req)
		}
	}
}
