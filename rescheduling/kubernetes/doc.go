// Package kubernetes is the rescheduling.Executor of a training job on
// Kubernetes, built on client-go. It lives apart from package
// rescheduling so that an embedder of the policy alone does not compile
// client-go.
//
// The job's pods are those labelled JobLabel=Job (volcano.sh/job-name for
// Volcano, training.kubeflow.org/job-name for Kubeflow and the Ascend
// operator), narrowed by an optional Selector. As MindCluster does it:
//
//   - pod-level rescheduling (RecreatePods) deletes only the failed pods:
//     the pod named, or every pod of the job on the node named. It needs
//     the pods to carry pod-rescheduling: "on"; without it the executor
//     refuses with ErrPodReschedulingOff, which wraps
//     rescheduling.ErrUnsupported, so the watchdog escalates to a job
//     restart;
//   - job-level rescheduling (RestartJob) deletes every pod of the job;
//   - a suspect node is tainted NoSchedule (default), cordoned or
//     labelled, and annotated with the decision's reason.
//
// The job's controller recreates the deleted pods. For pods that no
// controller owns, Config.Recreate makes the executor create each
// replacement itself, unbound and with a required node anti-affinity for
// every node it was told to avoid. Deletes carry a UID precondition, so a
// replacement that already took a pod's name is never deleted by mistake;
// a pod that no longer exists is reported as rescheduling.ErrTargetGone.
// Restarting a process in place is not possible through the API server
// (rescheduling.ErrUnsupported): the agent in the pod does that.
//
//	e, err := kubernetes.New(kubernetes.Config{
//		Client: clientset, Namespace: "train", Job: "llm-pretrain",
//	})
//	...
//	w, err := rescheduling.NewWatchdog(rescheduling.WatchdogConfig{
//		Policy: policy, Executor: e, Faults: faults,
//	})
package kubernetes
