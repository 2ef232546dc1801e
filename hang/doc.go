// Package hang detects hung and failed kernels and collectives early,
// captures the stacks of every rank, and merges them into one picture of
// which ranks are stuck where and which are missing.
//
// # Timers and the watchdog
//
// A Watchdog watches one rank. Get an Op once per kind of op (name and
// group), then time each run of it on the hot path:
//
//	w, _ := hang.New(hang.Config{Rank: 3, World: 8, DumpDir: "/stacks", LearnTimeouts: true})
//	go w.Run(ctx)
//	defer w.Close()
//	allreduce := w.Op("HcclAllReduce", "dp")
//	t := allreduce.Start(stream)
//	... // launch, wait
//	t.End() // or t.Fail(err)
//
// Start and End take a mutex and do a constant work, whatever is in
// flight, with no allocation (BenchmarkTimerStartEnd reports its time as
// a multiple of the two clock reads every timer needs, x-nowpair). An op hangs when it runs past its
// timeout: fixed (Config.Timeout, 300 s as xpu_timer) or, with
// LearnTimeouts, the p99 of the op's last LearnWindow durations times
// LearnFactor, at least LearnFloor. An op that fails (Timing.Fail) or a
// Heartbeat that stays silent past HeartbeatTimeout is a fault reported
// within 1 s; Config.StopOn then stops the process (SIGKILL unless
// StopSignal or Stop says otherwise) so that it is restarted at once.
//
// All detection is in Watchdog.Check, which reads Config.Now: tests
// drive it with a fake clock, without sleeping. Run calls Check every Tick
// and does the slow work (stack capture, stop) on its own goroutine.
//
// # Metrics
//
// With Config.Registerer set, each watchdog registers, with the constant
// label rank:
//
//	faultline_hang_hung                     1 while an op is past its timeout (XPU_TIMER_COMMON_HANG)
//	faultline_hang_dump_started             1 once a stack dump started for the latest fault (XPU_TIMER_COMMON_START_DUMP)
//	faultline_hang_dump_ended               1 once it ended, written or failed (XPU_TIMER_COMMON_END_DUMP)
//	faultline_hang_faults_total{kind}       faults by kind: hang, op_error, heartbeat
//	faultline_hang_dump_duration_seconds    time to capture and write a stack file
//	faultline_hang_op_timeout_seconds{op,group} timeout applied to new ops, fixed or learned
//	faultline_hang_ops_in_flight            ops started and not ended
//
// A second live watchdog of one rank on the same Registerer is an error of
// New, not a panic; Close unregisters them, so that a restarted worker's
// new watchdog can register its own.
//
// xpu_timer's gauges carry ip, job_name, pod_name, local_rank and rank
// labels; ours carry rank, and the others come from the scrape target's
// labels. A rule written for XPU_TIMER_COMMON_HANG == 1 reads
// faultline_hang_hung == 1. Unlike xpu_timer's, ours falls back to 0 when
// the hung op ends.
//
// # Stack capture
//
// Capture takes the stacks of a process: the goroutines of this one, or
// for another pid its Python stacks (py-spy dump --json, when installed)
// and native stacks (eu-stack, else gdb in batch mode), within a deadline
// and never leaving the target stopped. Watchdog.Dump writes them to
// <rank:05d>-<world:05d>.stacktrace.
//
// # Stack file format, version 1
//
// A stack file is UTF-8 text, one item per line, written by Dump.Marshal
// and read by ParseDump:
//
//	faultline-stacktrace 1
//	rank 3
//	world 8
//	pid 4242
//	host "node-7"
//	time 2026-01-02T03:04:05.123456789Z
//	state "S (sleeping)"
//	reason "rank 3: hang: op HcclAllReduce (group dp, stream 0) running 12s, timeout 10s"
//	note "native: eu-stack"
//	thread python 4242 "MainThread" "active+gil"
//	frame "all_reduce" "torch/distributed/distributed_c10d.py" 2050
//	frame "train_step" "train.py" 42
//	thread native 4243 "python3" ""
//	frame "__futex_abstimed_wait_common" "/lib/x86_64-linux-gnu/libc.so.6" 0
//	end 2 3
//
// The first line names the format and its version; a reader refuses a
// version newer than it knows. rank and world are required; pid, host,
// time (RFC 3339, UTC), state (as /proc/<pid>/status says it), reason and
// any number of note lines are optional. Each thread line (kind, id,
// name, state) is followed by its frame lines (function, file, line;
// line 0 when unknown), innermost frame first as debuggers print them.
// Kinds are python, native and go; a kind is lower-case letters, digits
// or _. Strings are Go-quoted, so any byte, even one that is not UTF-8,
// round-trips. The last line, "end <threads> <frames>", marks a complete
// file: a file without it, or whose counts disagree, is truncated
// (ErrTruncated). Readers skip lines whose keyword they do not know, so
// later version-1 writers may add lines.
//
// MergeDir also reads py-spy's own `dump --json` files named by rank
// ("3.json", "rank-3.json", "00003-00008.json"; see ParsePySpyFileName).
//
// # Merging
//
// Merge and MergeDir fold the stacks of all ranks into one tree per kind.
// The root's children are process states ("State@S (sleeping)"); every
// frame holds the ranks whose stacks pass through it (stuck) and, by
// difference with the world, those that do not (leak), labelled as
// xpu_timer's viewer does:
//
//	func@file:line@<stuck>|<leak>     e.g. all_reduce@c10d.py:2050@0-5/7|6
//
// with runs of ranks folded ("0-3/9/11-15"). Rank sets are sorted runs, a
// few words for any contiguous set. A frame's weight is the number of
// ranks per distinct stack through it, not one per file. A bad file (cut
// short, garbage, a world that disagrees, a rank out of range, a stack of
// 100,000 frames) is named in Merged.Problems and the rest still merges.
//
// Outputs: WriteFolded (Brendan Gregg's folded stacks), WritePprof (a
// gzipped pprof profile with rank, node, kind and state labels, which
// `go tool pprof -top` opens), WriteSVG (a self-contained flame graph
// drawn here: frames labelled ranks first, then package.Func and the
// file's base name, the full label in the <title> tooltip; the frames
// where ranks split outlined in red, the smaller groups there in thick red
// and drawn wide enough for their label however few ranks they hold; a
// small inline script to zoom into a frame and search by name), Splits
// and Verdict (the frames where ranks part ways, the smallest groups
// first, which is where the culprit usually is), and WriteFiles, which
// writes them all, for the kinds that have stacks, as examples/hang-viewer
// does.
//
// # Tests
//
// The tests run real hanging processes: a Go program blocked on a channel
// and a Python program in a sleep loop (python3 on PATH), captured with
// eu-stack and gdb when installed (Debian packages elfutils and gdb).
// Tests that need py-spy skip when it is absent; Debian does not package
// it. A test merges 10,000 rank files written to disk.
package hang
