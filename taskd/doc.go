// Package taskd is the control plane of a training job: a Manager per job,
// a Proxy per node and a Worker inside each training process, talking
// gRPC as a tree.
//
// Children register with their parent (a worker with its node's proxy, a
// proxy with the manager; a worker may also attach to the manager
// directly), send upward by unary call and receive downward on a server
// stream. Every position is claimed by one live instance: a second process
// claiming a live rank is refused (ErrRankTaken), while a process that
// restarted takes its rank back once the old one is declared lost, or at
// once when a recovery restarted it (the old instance is evicted).
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
//   - Leaves and completion. A member that stops on purpose (Worker.Close,
//     Proxy.Close, the end of Run's context) leaves: the manager records a
//     leave (EventLeft, faultline_taskd_left_total), not a fault, and
//     stops expecting its heartbeats; one that dies without a word is
//     lost. A worker whose rank ran its last step calls Finish before it
//     stops; once every rank of the job left finished, the job is complete
//     (EventJobComplete, faultline_taskd_job_complete, JobStatus and the
//     Admin service's GetJob). A proxy is meant to outlive its workers.
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
//     bounded (MaxFaults, each fault's message and attributes cut to
//     bounds), saved in StateDir before a report is acknowledged so that a
//     manager restart loses none. The log has a lock of its own, and one
//     goroutine writes and syncs the file, batching fsyncs: a heartbeat
//     never waits for fault work.
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
//   - Orchestration (ManagerConfig.Orchestration): online recovery from
//     the faults taken in, link failover and switchback, and online stress
//     tests; see below.
//
// # Orchestration
//
// With ManagerConfig.Orchestration set, a fault of a trigger kind (process
// exit, lost heartbeat, hang verdict, op error) on a rank starts a
// recovery, which keeps the job alive instead of restarting it:
//
//	stopping    pause every live rank (the dead ones are left out)
//	notifying   tell every rank the faults; each answers the strategies it supports
//	retrying    retry: every rank runs the step again (op errors only)
//	deciding    ask the rescheduling Policy how far a repair must go
//	restarting  recover-in-place: the Executor restarts the faulty processes
//	replacing   recover: the Executor replaces the processes of their pods or nodes
//	loading     Checkpoints readies the newest intact step
//	resuming    every rank resumes, from that step
//	dumping     dump: Checkpoints persists the newest intact step
//	exiting     exit: every rank stops
//
// ending recovered or exited. Strategies are tried cheapest first (retry,
// recover-in-place, recover, dump, exit); one is skipped when it does not
// apply, a rank does not support it, the policy's decision rules it out or
// it failed. A rank that does not pause, answer or resume in time becomes
// faulty too, and one reported hung or dead while the job stops is left
// out of a second pause rather than waited for; a fault that arrives
// during a repair or a resume starts another round (at most MaxRounds).
// The policy decides on every faulty rank, and the Executor restarts each
// on its own node (the nodes at once); a restarted rank that has not
// registered again when the repair times out stays faulty, so that the
// next strategy covers it. A restarted process registers again
// while the job is held: it does not start training until the recovery
// resumes every rank together. Its predecessor is evicted first, so that
// it takes the rank at once, and a fault older than the restart is
// ignored.
//
// SwitchLink moves a node's device links to the standby ("borrowing a
// track") or back: pausing, switching (the node's workers), continuing,
// ending switched; a rank that fails to switch, a timeout or a fault
// hands over to a recovery (the switch ends failed). StressTest takes the
// same path (pausing, testing, continuing, passed). A request is refused
// (ErrBusy) while another orchestration runs: there is never more than
// one.
//
// Every state has a timeout (Timeouts). Every transition is logged,
// counted (faultline_taskd_orchestration_transitions_total), traced (one
// span per orchestration, an event per transition) and kept: Orchestrations
// and the Admin service's GetOrchestration return the one running and the
// history, each with its transitions, faults and the figures it measured:
// the time from the first fault to its detection, to training paused and
// to training resumed (faultline_taskd_orchestration_phase_seconds).
//
// The state machines are pure (no I/O, no clock; tested step by step,
// exhaustively over short input sequences and randomly over long ones);
// the manager performs what they ask over Broadcast, the rescheduling
// Executor and Checkpoints. Package trainertest has a fake Trainer and, in
// its tests, a job of real processes on loopback broken each way (SIGKILL,
// hang, op error, failed switch, faults during a recovery and a switch)
// and the recovery benchmark.
//
// # Trainer
//
// A training process that wants online recovery, link failover and stress
// tests implements Trainer and passes it as WorkerConfig.Trainer:
//
//	Pause(ctx) (step, error)              stop at the next step boundary
//	Resume(ctx, ResumeRequest) error      start, or continue (loading Step unless -1)
//	Stop(ctx, reason) error               end training for good
//
// and, where it can do more, the optional interfaces, which the worker
// discovers by type assertion as io.Copy discovers an io.WriterTo:
//
//	StrategyLister  Strategies(ctx, FaultNotice) ([]Strategy, error)
//	StepRetrier     RetryStep(ctx) error                  redo the interrupted step from memory
//	LinkSwitcher    SwitchLink(ctx, LinkRequest) error    move device links to standby or primary
//	StressTester    StressTest(ctx, StressRequest) error  run a test on its devices
//
// Without StrategyLister a trainer supports retry when it is a StepRetrier,
// and recover-in-place, recover, dump and exit; without one of the others,
// that call fails with ErrUnsupported.
//
// The worker makes these calls one at a time, off its receive loop, with a
// context that ends at the manager's deadline, and acknowledges the
// manager's message when the call returns; a call the trainer cannot carry
// out returns an error wrapping ErrUnsupported. A trainer begins paused:
// the worker resumes it once registered, unless a recovery holds the job,
// in which case the recovery resumes it together with the other ranks.
// A StepGate holds what a step loop shares with Pause, Resume and Stop:
// the loop asks it before each step, Pause waits on it for the step in
// flight to end.
// Orchestration messages travel as application messages whose kinds start
// with "taskd/"; that prefix is reserved.
//
// With a StateDir, the orchestration in progress survives its manager:
// every change of it (the state, the faults that started it, the ranks
// held and restarted, the checkpoint step chosen) is written to
// orchestration.json, atomically and with a checksum, before the manager
// acts on it, and each one that ends to orchestration-history.json; a
// writer holds a lock (orchestration.lock) from its check of the lease
// term that wrote the file to its rename. While a write fails (a full or
// broken disk), the manager holds the acts that follow from the change and
// tries the write again with backoff, logging and counting each failure
// (faultline_taskd_orchestration_state_errors_total); the orchestration's
// timeouts run on meanwhile, so that an act held past its own counts as
// one that did not complete, as when a rank does not answer. A manager
// that restarts, or a standby that takes the lease over (see below), takes
// it over: it holds every rank, waits until the job's ranks have
// registered again (at most a heartbeat deadline), records a transition
// from the state to itself (Orchestration.Restored counts them), and asks
// again for what the state needs: the pause, the notice, the policy's
// decision, the repair (unless the executor had returned, or a rank the
// repair evicted, which it writes down before it calls the executor, is
// back as another instance: then it waits for the ranks restarted), the
// checkpoint, the resume. The faults of the log that the dead manager had
// not taken in are taken in then. A worker carries a retry, resume or
// continue out once, however many managers send it (they carry a key of
// the round), so that a rank resumed before the takeover is not resumed
// again. A state of another job, of an unknown version, damaged, or
// written by a newer lease term is refused at start (*StateFileError) and
// left as it is.
//
// A manager without a StateDir that restarts has no orchestration in
// progress. A worker whose trainer an orchestration of the previous
// manager held (paused, or not yet started) learns of the new manager when
// it registers again (behind a proxy, from its heartbeats); if the new
// manager holds nothing, nothing would resume the trainer, so the worker
// resumes it itself, with ResumeRequest.Released set and Step -1: the
// trainer knows that nothing was repaired and no step agreed.
//
// # Standby managers
//
// A job may run several managers, one leading, through a lease (package
// lease: File for one machine or a shared filesystem, lease/kubernetes for
// a coordination.k8s.io Lease). Lead campaigns for it and, while this
// manager holds it, serves under the term (ManagerConfig.Term); a standby
// does not listen. Proxies and workers are given a Service that reaches
// the leader, or every manager's address separated by commas, and follow
// whichever listens: they register again, on their own or through their
// proxy, and send the reports they queued while no manager led. Every
// command carries the term's fencing token, in every envelope and answer:
// a member refuses a manager, and the messages, of an older term than the
// newest it has seen, so that a deposed leader that has not yet learnt of
// it can do no harm; a command is checked again just before it is carried
// out, or leaves a proxy's queue, against a term admitted while it waited.
// Members tell the manager the newest token they have seen when they
// register and in each heartbeat: a manager of an older term refuses them
// and checks its term with the lease, which ends it (a member that
// restarted knows only what it has seen since, and a member's word alone
// ends nothing). The leader stops serving the moment its term ends,
// confirms its term (Term.Check) before each act of an orchestration, and
// writes its state in StateDir only over a state of no newer term. With
// the managers sharing a StateDir, the standby finishes the orchestration
// in progress. BenchmarkFailover measures the pause: on loopback, with
// 1,000 workers behind 8 proxies, the standby leads with every member
// registered about 0.5 s after the leader is killed with SIGKILL, a
// quarter of the 2 s the leader takes to declare a killed member lost.
//
// Security is mutual TLS with certificates read from files and read again
// when they change (SecurityFromDir takes a Kubernetes TLS secret), a
// shared token, or both; plaintext only when Security.Insecure is set, and
// logged loudly. A call's token (exactly one authorization value) is
// checked from its headers, before its body is read; past 10 failures
// from an address (then one a second), a connection that fails is closed.
// The address itself is never shut out: the ranks of a node, or the pods
// behind one NAT, share it, and a call with valid credentials from there
// is served whatever others got wrong. A server refuses
// to start with a token shorter than 16 bytes. Every member is issued a secret by the server it registers with
// (the manager, or its node's proxy), and every later call carries it: a
// caller acts only for itself, a proxy for its node's workers, and a
// fault about a rank is taken only from that rank, its node's proxy or
// the manager's embedder (Manager.ReportFault). ListMembers shows
// instances, which prove nothing. Operators hold a credential of their
// own (ManagerConfig.AdminToken): the Admin and TrainingDataTrace services
// take nothing else, and it serves nothing else. Proxies hold one too
// (ManagerConfig.ProxyToken, ProxyConfig.UpstreamToken): only a call with
// it registers as a proxy, and without it the role is closed, so that a
// worker's token never makes a node's proxy, which reports that node's
// ranks' faults. The manager logs, as it starts, which roles are open. The metrics are served by the embedder, over
// plain HTTP in the reference binaries: keep them on loopback or a
// cluster-internal address.
//
// Every server bounds what a peer can make it hold: message size
// (MaxMessageBytes, and for the calls that carry a few hundred bytes a
// bound of their own: 16 KiB for Register, Stream and Leave, 256 KiB for
// a proxy's batch of heartbeats and for CollectDone, 1 MiB for a batch of
// acknowledgements; a call declaring more has its connection closed from
// the message's prefix, before its body arrives; Send, which carries a
// node's stack dumps, and Upload keep MaxMessageBytes), the bytes of
// messages begun and not yet whole, which gRPC holds until they are (two
// messages of MaxMessageBytes per worker, 16 per peer address: a
// connection that would hold more is closed),
// calls per second per connection (RateLimit), calls in flight per
// connection (100), per worker (32) and per proxy (1000), and apart from
// them, for the calls that name no member (a registration), per peer
// address (64), each with 2 s to send its message, so that a token
// holder's stalled registrations cannot refuse the calls of the members
// sharing its address, header lists
// (16 KiB), connections in all and per address (MaxConnections,
// MaxConnectionsPerPeer; past 10 authentication failures (then one a
// second) from an address, a connection there that has not authenticated
// waits 1 s before each token is checked, is closed on its first
// failure, and has no guess it sent ahead checked; those that have not
// yet authenticated draw on a
// budget of their own, the oldest closed for a newer one, so that silent
// connections cannot shut a member out), handshakes (5 s), idle
// connections (30 s), uploads (one writer a path, 10 s idle), hostnames,
// acknowledgements, and, without a job shape, ranks and nodes
// (MaxWorkers); with orchestration on and no shape, the job's ranks are
// those of its first complete rendezvous (0 to n-1, none missing), a rank
// that comes later is refused and one that joined past a gap dropped, so
// that a token holder joining as a rank of its own and going silent cannot
// have the others stopped, nor keep the rendezvous open. Answers that
// list (ListFaults, ListMembers, GetSwitchStatus) fit half a message.
// Refusals are counted (faultline_taskd_calls_refused_total,
// faultline_taskd_connections_refused_total) and logged at most every ten
// seconds.
//
// Observability is injected: a prometheus.Registerer (metrics named
// faultline_taskd_*), an OpenTelemetry TracerProvider (spans on switch
// fan-out, collection and orchestration) and a *slog.Logger; nil means
// off. A constructor whose metrics cannot be registered (say, a second
// manager on one Registerer) returns the error; Close unregisters them,
// so that a component can be built again on the same Registerer.
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
// TASKD_HEAVY=1 also deepens the exhaustive test of the orchestration core
// and lengthens its random one, and makes trainertest's job of real
// processes 32 workers.
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
