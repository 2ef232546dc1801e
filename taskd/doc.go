// Package taskd is the control plane of a training job: a Manager per job,
// a Proxy per node and a Worker inside each training process, talking
// gRPC as a tree.
//
// Children register with their parent (a worker with its node's proxy, a
// proxy with the manager; a worker may also attach to the manager
// directly), send upward by unary call and receive downward on a server
// stream. Every position is claimed by one live instance: a second process
// claiming a live rank is refused (ErrRankTaken), while a process that
// restarted takes its rank back once the old one is declared lost.
//
// What the manager does:
//
//   - Liveness. Members send heartbeats (default every 1 s; a proxy sends
//     one for its node that carries how long ago it heard from each
//     worker). A member silent past the deadline (default 5 s) is declared
//     lost and a FaultLost enters the fault log. Workers and proxies
//     reconnect with backoff after a proxy or manager restart and register
//     again; their queued reports (bounded, overflow counted) are kept and
//     sent once the manager acknowledges them.
//   - Profiling switch. The job's trace.Switch comes from SetSwitch, from
//     the TrainingDataTrace gRPC service (the meaning of ClusterD's
//     ModifyTrainingDataTraceSwitch, GetTrainingDataTraceSwitch and
//     SubscribeDataTraceSwitch, with codes ok, bad parameter, unknown job
//     and internal) or from a SwitchSource such as SwitchFile. It is
//     validated by trace.ParseSwitch and travels as its JSON document; every
//     worker applies it through WorkerConfig.OnSwitch and acknowledges it.
//     SwitchStatus reports each worker's state per marker domain (opened,
//     closed, waiting, failed); laggards are sent it again with backoff,
//     and a worker that returns gets it at once.
//   - Faults. Workers and proxies report faults (process exit, op error,
//     hang, slow node, link; see FaultKind). The manager keeps one ordered,
//     de-duplicated fault log per job (Faults, the Admin service, metrics),
//     saved in StateDir before a report is acknowledged so that a manager
//     restart loses none.
//   - Messages. Broadcast sends an application message to all workers, the
//     workers of some nodes, or a rank list, and waits for their
//     acknowledgements, re-sending with backoff.
//   - Collection. Collect asks proxies to ship the job's dotting and stack
//     files: streamed in chunks, resumed where a transfer stopped, capped in
//     size, confined to the job's folders (no "..", no symlink followed),
//     filed under node-<n> folders with host_ips_mapping.txt (the format of
//     topology.HostMapping) beside them, so that the tree names no host.
//   - Handlers. Named handlers with priorities (profiling, recovery, NIC
//     switch, ...) run on every Event, so orchestration lands without
//     touching the transport.
//
// # Trainer
//
// A training process that wants online recovery, link failover and stress
// tests implements Trainer and passes it as WorkerConfig.Trainer:
//
//	Pause(ctx) (step, error)              stop at the next step boundary
//	Resume(ctx, ResumeRequest) error      start, or continue (loading Step unless -1)
//	Strategies(ctx, FaultNotice) ([]Strategy, error)
//	RetryStep(ctx) error                  redo the interrupted step from memory
//	SwitchLink(ctx, LinkRequest) error    move device links to standby or primary
//	StressTest(ctx, StressRequest) error  run a test on its devices
//	Stop(ctx, reason) error               end training for good
//
// The worker makes these calls one at a time, off its receive loop, with a
// context that ends at the manager's deadline, and acknowledges the
// manager's message when the call returns; a call the trainer cannot carry
// out returns an error wrapping ErrUnsupported. A trainer begins paused:
// the worker resumes it once registered, unless a recovery holds the job,
// in which case the recovery resumes it together with the other ranks.
// Orchestration messages travel as application messages whose kinds start
// with "taskd/"; that prefix is reserved.
//
// Security is mutual TLS with certificates read from files and read again
// when they change (SecurityFromDir takes a Kubernetes TLS secret), a
// shared token, or both; plaintext only when Security.Insecure is set, and
// logged loudly. Every server caps message size (MaxMessageBytes) and
// rate-limits calls per connection (RateLimit).
//
// Observability is injected: a prometheus.Registerer (metrics named
// faultline_taskd_*), an OpenTelemetry TracerProvider (spans on switch
// fan-out and collection) and a *slog.Logger; nil means off.
//
// The pure parts (liveness registry, switch tracker, fault log) take the
// time from their caller and are tested deterministically. The package's
// tests also run a job of real processes on loopback: a manager, 4 proxies
// and 32 workers, killing a proxy, restarting the manager, stopping a
// worker. TASKD_HEAVY=1 runs it with 64 workers.
//
// The wire protocol lives in internal/taskdpb (taskd.proto); see its
// package doc for regenerating it.
//
// A minimal job on one machine:
//
//	sec := taskd.Security{Insecure: true}
//	m, _ := taskd.NewManager(taskd.ManagerConfig{Job: "job-1", Listen: "127.0.0.1:9601", Security: sec})
//	go m.Run(ctx)
//	p, _ := taskd.NewProxy(taskd.ProxyConfig{Job: "job-1", Node: 0, Upstream: "127.0.0.1:9601", Security: sec})
//	go p.Run(ctx)
//	w, _ := taskd.NewWorker(taskd.WorkerConfig{Job: "job-1", Node: 0, Rank: 0, Security: sec,
//		OnSwitch: func(sw trace.Switch) error { recorder.SetSwitch(sw); return nil }})
//	go w.Run(ctx)
//	m.SetSwitch(trace.AllOn())
package taskd
