package cluster_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"
)

var (
	imageOnce sync.Once
	imageDir  string
	imageErr  error
)

// Image returns the folder of the example's image, faultline:dev, as its
// Dockerfile makes it but from this checkout: faultline-run and
// taskd-manager in /usr/local/bin, the training script in /opt/faultline;
// Debian's Python and PyTorch are this machine's. It is built once per
// test binary.
func Image(t *testing.T) string {
	t.Helper()
	imageOnce.Do(func() {
		imageDir, imageErr = os.MkdirTemp("", "faultline-image-")
		if imageErr != nil {
			return
		}
		bin := filepath.Join(imageDir, "usr/local/bin")
		opt := filepath.Join(imageDir, "opt/faultline")
		for _, d := range []string{bin, opt} {
			if imageErr = os.MkdirAll(d, 0o755); imageErr != nil {
				return
			}
		}
		cmd := exec.Command("go", "build", "-o", bin+"/", "./examples/faultline-run", "./examples/taskd-manager")
		cmd.Dir = "../../.."
		if out, err := cmd.CombinedOutput(); err != nil {
			imageErr = &buildError{err, string(out)}
			return
		}
		script, err := os.ReadFile("../../faultline-run/train.py")
		if err != nil {
			imageErr = err
			return
		}
		imageErr = os.WriteFile(filepath.Join(opt, "train.py"), script, 0o644)
		filepath.Walk(imageDir, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.IsDir() {
				os.Chmod(p, 0o755)
			}
			return nil
		})
	})
	if imageErr != nil {
		t.Fatalf("the image faultline:dev: %v", imageErr)
	}
	return imageDir
}

type buildError struct {
	err error
	out string
}

func (e *buildError) Error() string { return "go build: " + e.err.Error() + "\n" + e.out }

// setArg sets the value following flag in the container's args of the
// object's pod template.
func setArg(t *testing.T, o *unstructured.Unstructured, flag, value string) {
	t.Helper()
	cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
	c := cs[0].(map[string]any)
	args := c["args"].([]any)
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			args[i+1] = value
			unstructured.SetNestedSlice(o.Object, cs, "spec", "template", "spec", "containers")
			return
		}
	}
	t.Fatalf("%s %s: no %s in %v", o.GetKind(), o.GetName(), flag, args)
}

func find(objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

// Steps is the training script's length in the tests: short, but long
// enough that a fault lands mid-run.
const Steps = 60

// weightsFile is where rank 0 writes the final weights' SHA-256, on the
// checkpoint claim.
const weightsFile = "/var/lib/faultline/ckpt/weights.sha256"

// trainJob applies the example's manifests, as written but for the
// training script's length (and its writing the final weights' hash),
// on a cluster of three nodes, and returns the cluster.
func trainJob(t *testing.T, stepMS string) (*ControlPlane, *Kubelet) {
	t.Helper()
	img := Image(t)
	cp := StartControlPlane(t)
	k := StartKubelet(t, cp, map[string]string{"faultline:dev": img}, "node-0", "node-1", "node-2")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the pods' output:\n%s", k.Logs())
		}
	})
	objs := Manifests(t)
	job := find(objs, "Job", "llm")
	setArg(t, job, "--steps", fmt.Sprint(Steps))
	setArg(t, job, "--step-ms", stepMS)
	cs, _, _ := unstructured.NestedSlice(job.Object, "spec", "template", "spec", "containers")
	c := cs[0].(map[string]any)
	c["args"] = append(c["args"].([]any), "--weights", weightsFile)
	unstructured.SetNestedSlice(job.Object, cs, "spec", "template", "spec", "containers")
	Apply(t, cp, objs)
	return cp, k
}

// waitComplete waits for the Job llm to complete and returns the final
// weights' hash.
func waitComplete(t *testing.T, cp *ControlPlane, timeout time.Duration) string {
	t.Helper()
	ctx := t.Context()
	waitFor(t, timeout, "the Job llm complete", func() (bool, error) {
		j, err := cp.Admin.BatchV1().Jobs("training").Get(ctx, "llm", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if jobDone(j, batchv1.JobFailed) {
			t.Fatalf("the Job failed: %+v", j.Status.Conditions)
		}
		return jobDone(j, batchv1.JobComplete), nil
	})
	pvc, err := cp.Admin.CoreV1().PersistentVolumeClaims("training").Get(ctx, "llm-checkpoints", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv, err := cp.Admin.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(pv.Spec.HostPath.Path, filepath.Base(weightsFile)))
	if err != nil {
		t.Fatalf("the final weights' hash: %v", err)
	}
	return strings.TrimSpace(string(b))
}

var (
	baselineOnce sync.Once
	baseline     string
)

func train(t *testing.T) string {
	cp, k := trainJob(t, "0")
	ctx := t.Context()
	start := time.Now()
	weights := waitComplete(t, cp, 3*time.Minute)
	t.Logf("the Job completed %v after the manifests were applied; final weights %s", time.Since(start).Round(time.Millisecond), weights)
	l, err := cp.Admin.CoordinationV1().Leases("training").Get(ctx, "llm-manager", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	holder, _, _ := strings.Cut(ptr.Deref(l.Spec.HolderIdentity, ""), "/")
	pods, err := cp.Admin.CoreV1().Pods("training").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var leader bool
	for _, p := range pods.Items {
		log := k.Log(p.UID)
		if i, ok := p.Annotations[batchv1.JobCompletionIndexAnnotation]; ok {
			n, _ := strconv.Atoi(i)
			for _, rank := range []int{2 * n, 2*n + 1} {
				if want := fmt.Sprintf("[rank%d]: step %d loss", rank, Steps-1); !strings.Contains(log, want) {
					t.Errorf("pod %s of completion index %s: no %q: its node rank is not its index", p.Name, i, want)
				}
			}
		}
		if p.Name == holder {
			leader = podReady(&p) || strings.Contains(log, "taskd-manager leading and serving")
		}
	}
	if !leader {
		t.Errorf("the Lease's holder %q is no manager that served", holder)
	}
	return weights
}

// Baseline returns the final weights of the run without faults.
func Baseline(t *testing.T) string {
	t.Helper()
	baselineOnce.Do(func() {
		t.Run("baseline", func(t *testing.T) { baseline = train(t) })
	})
	if baseline == "" {
		t.Fatal("no baseline: the run without faults failed")
	}
	return baseline
}
