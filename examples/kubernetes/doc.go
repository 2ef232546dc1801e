// Package kubernetes holds the manifests of a PyTorch training job on
// Kubernetes whose pods run faultline-run, with two taskd managers that
// elect their leader through a Lease (README.md says how to run it), and
// the tests that check them: every manifest decodes with client-go's
// scheme, the objects refer to one another correctly, the commands' flags
// exist, the Role grants what the executor and the Lease use and nothing
// more, and rescheduling/kubernetes recreates the job's pods as the Job
// controller expects.
//
//	kubectl apply -k examples/kubernetes
package kubernetes
