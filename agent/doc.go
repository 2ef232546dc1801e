// Package agent is the node agent of a training job: the side of
// Faultline that runs next to a node's ranks, as torchrun's agent does, and
// keeps them training. examples/faultline-run is its command.
//
// An Agent starts the node's ranks (Python scripts, or any program) with
// torchrun's environment, and then:
//
//   - runs each rank from a warm spare interpreter that has imported torch
//     already (faultline.spare), from the node's start on, so that a start
//     or a restart skips seconds of imports;
//     on node 0 it also hosts the job's c10d store, as torchrun's agent
//     does, so that restarted ranks rendezvous at once;
//   - drains each rank's dotting ring (Ring, written by the faultline Python
//     package) into the rank's trace files, and its collectives into a
//     hang watchdog per rank;
//   - owns the ranks' checkpoint segments (a ckpt.Owner per rank, made when
//     the rank first asks for one over the agent's socket), so that what a
//     rank saved outlives it, and tells a restarted rank which step to load;
//   - registers a taskd worker per rank with the job's manager (node 0's
//     agent runs it unless one runs apart) and implements the recovery's
//     Trainer calls: a rank is paused by taking its stacks and ending its
//     process, and resumed by a new process that loads the step the job
//     agreed on, since a torch.distributed process group cannot lose a
//     member and carry on;
//   - when a rank exits non-zero, a collective fails or runs past its
//     timeout, it takes every local rank's Python stacks (faulthandler, on a
//     signal), stops the node's ranks, merges the stacks of a hang into
//     flame graphs and a verdict naming the rank that is not where the
//     others are, and reports the fault; the manager's recovery then
//     restarts every rank of the job, within the restart budget;
//   - watches the live dotting files with trace/slownode and writes each
//     new verdict to Config.Out;
//   - writes one record per incident to Config.Out/incidents.jsonl: the
//     fault, and when it was detected, the ranks stopped, restarted, told
//     what to load (which step, which tier), and back at the step where
//     they were;
//   - in an elastic job (Config.MinNodes below Nodes), starts with the
//     nodes there once MinNodes are, and goes on with the nodes left when
//     nodes are lost and not replaced: Run returns a *Resized, and the
//     caller runs the node's agent again with Resized.Next; a node that
//     comes to the job after it went on without it (lost and back, or
//     new) finds it by the manager's answer, waits to join it, and is
//     taken in at the job's next restart point, up to its MAX, again
//     through a *Resized on every node;
//   - on a spare node (Config.SpareNodes), runs no rank but keeps warm
//     interpreters and the replicas the job's nodes send it, and takes a
//     lost node's place once node 0's manager declares it lost: Run
//     returns a *Resized naming that node, and the next run starts the
//     node's ranks from the interpreters this one kept warm.
//
// The job's decisions are kept pure, time and events in and actions out,
// with processes, sockets and segments at their edges: who is lost and
// whom the job waits for are taskd's orchestration core (the manager's
// side) and nodeWatch (a node's side: when it is apart from the manager,
// gives up on it, or was replaced); which step every rank resumes from
// and which node holds which replica are jobCore's; how the job goes on
// with fewer nodes is shrink's, and when it takes in nodes growCore's.
//
// The protocol between a rank and its agent: the agent's unix socket
// (FAULTLINE_AGENT, JSON lines: hello, groups, segment, saved, wait,
// load, admin, spare), the rank's dotting ring (FAULTLINE_RING, see Ring)
// and its stack file (FAULTLINE_STACK_FILE, dumped on
// FAULTLINE_STACK_SIGNAL). The python package documents the rank's side.
//
// A node agent in a program of one's own:
//
//	dir, err := python.Extract(cacheDir) // the faultline package, for the ranks' PYTHONPATH
//	if err != nil {
//		return err
//	}
//	a, err := agent.New(agent.Config{Job: "job-1", Nodes: 2, NodeRank: node, ProcsPerNode: 8,
//		MasterAddr: "node-0", Command: []string{"train.py"}, PythonPath: dir, MaxRestarts: 3,
//		Security: taskd.Security{Token: token, Insecure: true}})
//	if err != nil {
//		return err
//	}
//	defer a.Close()
//	return a.Run(ctx) // nil once every rank finished; ErrStopped when recovery gave up; *Resized: run again
package agent
