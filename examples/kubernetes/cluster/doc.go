// Package cluster tests the project's Kubernetes side against a real
// control plane run in the test's process: etcd, the API server with RBAC
// authorisation and the default admission plugins, the Job controller,
// the scheduler, the node lifecycle and taint eviction controllers, and
// a kubelet of the tests' own that runs each pod bound to its node as
// local processes. It is a module of its own so that no user of the
// library inherits k8s.io/kubernetes.
//
//	cd examples/kubernetes/cluster && go test -count=1 -timeout 15m .
//
// as root: the kubelet makes network and mount namespaces. The tests are
// described in examples/kubernetes/README.md.
package cluster
