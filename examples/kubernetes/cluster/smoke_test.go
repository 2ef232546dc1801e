package cluster_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// waitFor polls cond until it holds, failing t past timeout with what
// was awaited.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := cond()
		if ok {
			return
		}
		if err != nil {
			last = err
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v (last error: %v)", what, timeout, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// jobDone reports whether the Job has the condition (Complete or
// Failed).
func jobDone(j *batchv1.Job, c batchv1.JobConditionType) bool {
	for _, cond := range j.Status.Conditions {
		if cond.Type == c && cond.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// TestKubeletRunsIndexedJob: the Job controller makes an Indexed Job's
// pods, the scheduler binds them, the kubelet runs them as processes
// with the downward API's completion index, a Secret as files and an
// emptyDir, each in its own network namespace at its own address, and
// the Job completes.
func TestKubeletRunsIndexedJob(t *testing.T) {
	cp := StartControlPlane(t)
	k := StartKubelet(t, cp, map[string]string{"shell": t.TempDir()}, "node-0", "node-1")
	ctx := t.Context()
	ns := "smoke"
	if _, err := cp.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Admin.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}, StringData: map[string]string{"token": "sekrit"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	script := `set -e
echo "rank=$NODE_RANK arg=$0 token=$(cat /etc/s/token) host=$(hostname) uid=$(id -u) groups=$(id -G)"
ip -4 -o addr show eth0
echo hi > /work-dir/x && cat /work-dir/x
test ! -e /work-dir/../h-k8s
ls /dev/shm | wc -l`
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: "smoke"},
		Spec: batchv1.JobSpec{
			CompletionMode: ptr.To(batchv1.IndexedCompletion), Completions: ptr.To[int32](2), Parallelism: ptr.To[int32](2),
			Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				RestartPolicy:   corev1.RestartPolicyNever,
				SecurityContext: &corev1.PodSecurityContext{RunAsUser: ptr.To[int64](65532), RunAsGroup: ptr.To[int64](65532), FSGroup: ptr.To[int64](65532)},
				Containers: []corev1.Container{{
					Name: "c", Image: "shell", Command: []string{"sh", "-c", script, "$(NODE_RANK)"},
					Env:          []corev1.EnvVar{{Name: "NODE_RANK", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}},
					VolumeMounts: []corev1.VolumeMount{{Name: "s", MountPath: "/etc/s", ReadOnly: true}, {Name: "w", MountPath: "/work-dir"}, {Name: "shm", MountPath: "/dev/shm"}},
				}},
				Volumes: []corev1.Volume{
					{Name: "s", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "s", DefaultMode: ptr.To[int32](0o440)}}},
					{Name: "w", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
					{Name: "shm", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory}}},
				},
			}},
		},
	}
	start := time.Now()
	if _, err := cp.Admin.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the Job complete", func() (bool, error) {
		j, err := cp.Admin.BatchV1().Jobs(ns).Get(ctx, "smoke", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if jobDone(j, batchv1.JobFailed) {
			t.Fatalf("the Job failed:\n%s", k.Logs())
		}
		return jobDone(j, batchv1.JobComplete), nil
	})
	t.Logf("the Job completed %v after its creation", time.Since(start).Round(time.Millisecond))
	logs := k.Logs()
	for i := range 2 {
		if want := fmt.Sprintf("rank=%d arg=%d token=sekrit host=smoke-%d ", i, i, i); !strings.Contains(logs, want) {
			t.Errorf("no pod says %q:\n%s", want, logs)
		}
	}
	if !strings.Contains(logs, "uid=65532 groups=65532") || !strings.Contains(logs, "\nhi\n") {
		t.Errorf("the pods ran as someone else, or without their emptyDir:\n%s", logs)
	}
	_ = os.Stdout
	_ = context.Background
}
