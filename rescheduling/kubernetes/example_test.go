package kubernetes_test

import (
	"context"
	"fmt"

	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/rescheduling/kubernetes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// A device failure on node n1: the policy asks for the node's pods to be
// recreated elsewhere; the executor taints n1 and deletes only the job's
// pod there, for Volcano to recreate.
func ExampleExecutor() {
	worker := func(name, node string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "train", Labels: map[string]string{
				kubernetes.VolcanoJobLabel:      "llm",
				kubernetes.PodReschedulingLabel: kubernetes.PodReschedulingOn,
			}},
			Spec: corev1.PodSpec{NodeName: node},
		}
	}
	client := fake.NewClientset(
		worker("llm-worker-0", "n0"), worker("llm-worker-1", "n1"),
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}},
	)
	e, err := kubernetes.New(kubernetes.Config{Client: client, Namespace: "train", Job: "llm"})
	if err != nil {
		panic(err)
	}
	policy, err := rescheduling.NewPolicy(rescheduling.Config{})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	d := policy.Decide(ctx, rescheduling.Fault{Kind: rescheduling.KindExit, ExitCode: 201, Node: "n1", Pod: "llm-worker-1"})
	fmt.Println(d.Action, d.AvoidNode)
	if err := e.AvoidNode(ctx, d); err != nil {
		panic(err)
	}
	if err := e.RecreatePods(ctx, d); err != nil {
		panic(err)
	}
	pods, _ := client.CoreV1().Pods("train").List(ctx, metav1.ListOptions{})
	for _, p := range pods.Items {
		fmt.Println("left:", p.Name)
	}
	n, _ := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	fmt.Println("taint:", n.Spec.Taints[0].Key, n.Spec.Taints[0].Effect)
	// Output:
	// recreate_pods n1
	// left: llm-worker-0
	// taint: faultline.io/suspect NoSchedule
}
