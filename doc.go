// Package faultline keeps large AI training jobs running and says exactly
// what is slow or broken.
//
// Faultline is a set of packages that an embedder takes one at a time or
// together:
//
//   - trace: lightweight dotting of training phases (Step, FP, DataLoader,
//     SaveCheckpoint, CommunicationOperator), switched on and off while
//     training runs and persisted per rank in rotating files under a disk
//     budget. Its sub-package trace/slownode finds slow ranks, nodes, links
//     and IO from those files.
//   - ckpt: flash checkpoint, a shared-memory tier that outlives a crashed
//     trainer, asynchronous persistence to disk and replicas on peers.
//   - netcheck: pairwise node probes that locate faulty nodes and
//     stragglers, and device-link (switchbox) checks.
//   - hang: per-kernel and per-collective timers with timeouts, stack capture
//     and stacks merged across ranks into one flame graph.
//   - topology: switch-aware (ASW/PSW) rank ordering and rank tables.
//   - rescheduling: process, pod and job level restart policy with budgets,
//     driving the vendor's scheduler through an executor interface.
//   - taskd: the Manager / Proxy / Worker control plane over gRPC that
//     composes the packages above into recovery orchestration.
//   - npu: accelerator libraries loaded at run time (the one cgo package).
//
// The leaf packages (trace, ckpt, topology, netcheck, hang, rescheduling)
// import none of each other, so a vendor can embed one alone. Every
// long-lived object is built from a Config struct whose zero value holds
// documented defaults, takes a context.Context, and stops the goroutines it
// owns in Close. Observability is injected: a prometheus.Registerer, an
// OpenTelemetry TracerProvider and a *slog.Logger, each off when nil.
//
// The programs under examples/ are thin mains to copy; examples/demo runs a
// whole small job on one machine with injected faults.
package faultline
