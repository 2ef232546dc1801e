// Package kubernetes is a lease.Lease kept in a coordination.k8s.io Lease,
// for the managers of a job that runs on Kubernetes. It is built on
// client-go's leader election (resourcelock.LeaseLock) and lives apart
// from package lease so that the control plane's core does not compile
// client-go.
//
// Each campaign is a new holder identity, so that every term adds one to
// the Lease's spec.leaseTransitions: a term's fencing token is that count,
// plus one. A holder's term ends RenewDeadline after the start of its last
// successful renewal, whether or not the election has given up yet, so
// that it is over before any other candidate may take the Lease
// (LeaseDuration after it last saw a renewal); Term.Check reads the Lease
// from the API server before an act. A term that ends stops renewing, and
// only Term.Resign, called once the holder's work has stopped, releases
// the Lease at once.
//
// The managers' ServiceAccount needs get, create and update on leases in
// the Lease's namespace, and nothing else:
//
//	rules:
//	- apiGroups: ["coordination.k8s.io"]
//	  resources: ["leases"]
//	  verbs: ["create"]
//	- apiGroups: ["coordination.k8s.io"]
//	  resources: ["leases"]
//	  resourceNames: ["llm-manager"]
//	  verbs: ["get", "update"]
//
// A manager's campaign:
//
//	l, err := kubernetes.New(kubernetes.Config{
//		Client: clientset, Namespace: "training", Name: "llm-manager",
//		Candidate: lease.Candidate{Job: "llm", Config: lease.ConfigHash(jobConfig), Name: os.Getenv("POD_NAME")},
//	})
//	...
//	term, err := l.Campaign(ctx)
package kubernetes
