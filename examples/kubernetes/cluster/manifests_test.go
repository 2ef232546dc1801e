package cluster_test

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// Manifests returns the example's objects as kustomize builds them from
// examples/kubernetes, as written.
func Manifests(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), "..")
	if err != nil {
		t.Fatalf("kustomize build examples/kubernetes: %v", err)
	}
	var objs []*unstructured.Unstructured
	for _, r := range m.Resources() {
		b, err := r.MarshalJSON()
		if err != nil {
			t.Fatalf("%s: %v", r.CurId(), err)
		}
		obj := &unstructured.Unstructured{}
		if err := obj.UnmarshalJSON(b); err != nil {
			t.Fatalf("%s: %v", r.CurId(), err)
		}
		objs = append(objs, obj)
	}
	return objs
}

// Apply creates objs on the API server, as kubectl apply does (server-
// side apply), those of the kinds given or, with none given, all.
func Apply(t *testing.T, cp *ControlPlane, objs []*unstructured.Unstructured, kinds ...string) {
	t.Helper()
	dc := discovery.NewDiscoveryClientForConfigOrDie(cp.Config)
	groups, err := restmapper.GetAPIGroupResources(dc)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDiscoveryRESTMapper(groups)
	dyn := dynamic.NewForConfigOrDie(cp.Config)
	want := map[string]bool{}
	for _, k := range kinds {
		want[k] = true
	}
	for _, o := range objs {
		if len(kinds) > 0 && !want[o.GetKind()] {
			continue
		}
		gvk := o.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("%s %s: %v", gvk, o.GetName(), err)
		}
		var r dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if o.GetNamespace() != "" {
			r = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		if _, err := r.Apply(t.Context(), o.GetName(), o, metav1.ApplyOptions{FieldManager: "kubectl", Force: true}); err != nil {
			t.Fatalf("apply %s %s/%s: %v", o.GetKind(), o.GetNamespace(), o.GetName(), err)
		}
	}
}

// TestManifestsTrain (2a): the manifests as written (kustomize), on the
// real control plane: the Job controller starts the two pods, whose
// faultline-run takes its node rank from the completion index; the two
// managers campaign on the Lease and the leader serves; the job trains
// with real PyTorch and the Job is Complete. Its final weights are the
// baseline of the runs with faults.
//
// It is in this file, before TestRecovery's, so that it runs first and
// TestRecovery finds its baseline.
func TestManifestsTrain(t *testing.T) {
	ran := false
	baselineOnce.Do(func() { baseline, ran = train(t), true })
	if !ran {
		t.Log("ran as the baseline of an earlier test")
	}
}
