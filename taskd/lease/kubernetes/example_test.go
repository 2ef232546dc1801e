package kubernetes_test

import (
	"context"
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/faultline-ml/faultline/taskd/lease"
	"github.com/faultline-ml/faultline/taskd/lease/kubernetes"
)

// A manager takes the job's Lease, which its campaign creates, and
// resigns it on its way out, so that a standby need not wait for it to
// expire.
func ExampleLease() {
	client := fake.NewClientset() // a real clientset in a manager
	l, err := kubernetes.New(kubernetes.Config{
		Client: client, Namespace: "training", Name: "llm-manager",
		Candidate: lease.Candidate{Job: "llm", Config: lease.ConfigHash([]byte("nodes=2")), Name: "llm-manager-7d9f-xk2lq"},
	})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	term, err := l.Campaign(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("leading with token", term.Token())
	got, _ := client.CoordinationV1().Leases("training").Get(ctx, "llm-manager", metav1.GetOptions{})
	holder, _, _ := strings.Cut(*got.Spec.HolderIdentity, "/")
	fmt.Println("Lease holder:", holder, "job label:", got.Labels[kubernetes.JobLabel])
	fmt.Println("still leading:", term.Check(ctx) == nil)
	term.Resign()
	got, _ = client.CoordinationV1().Leases("training").Get(ctx, "llm-manager", metav1.GetOptions{})
	fmt.Printf("after Resign: holder %q\n", *got.Spec.HolderIdentity)
	// Output:
	// leading with token 1
	// Lease holder: llm-manager-7d9f-xk2lq job label: llm
	// still leading: true
	// after Resign: holder ""
}
