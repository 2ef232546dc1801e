// Package slownode finds what makes a training job slow — ranks slow to
// compute, slow hosts, slow communicators, slow data loading and slow
// pipeline links — from the dotting files package trace writes (and
// MindCluster writes: same layout, same records), while the job runs.
//
// # Design
//
// A Detector is a pure streaming core: it takes each rank's ranges
// (Add) or whole steps (AddStep), does no I/O, starts no goroutine and
// reads no clock, and keeps a bounded amount of state per rank and per
// communicator however long the job runs. Analyze and Watch are a thin
// shell around it that tails a job folder with trace.RankReader and
// trace.Pairer:
//
//	d, _ := slownode.New(slownode.Config{})
//	d.AddGroups(groups)      // parallel_group.json of each rank
//	d.Add(rank, rng)         // each trace.Range, in file order
//	r := d.Result()          // the verdict so far
//
// Config.Readers goroutines (twice GOMAXPROCS by default) read, parse and
// pair the records of the ranks next in turn while the Detector takes the
// ranges of one rank after another, each rank's in file order, as if one
// goroutine read them all; the goroutines live as long as a reading pass.
//
// # Per step and rank
//
// The ranges a rank recorded since its previous step make up a Step:
// step time, forward, dataloader and checkpoint-save time, communication
// time per communicator and op, and the iteration trajectory of cluster
// profiling: the gap before the first forward (data wait), forward plus
// backward, and the trailing run of collectives. Compute is forward plus
// backward less the communication inside it. Missing markers leave their
// figures out, and Result.Unavailable says which.
//
// # Decisions
//
// Steps are compared across ranks by their number, never by timestamp:
// host clocks are not comparable, and nothing here subtracts one rank's
// timestamp from another's. A step is evaluated once every live rank has
// reported it or a later one (a rank's steps come in order, so one that
// skipped a step, its dotting off, never reports it); ranks that stop
// writing become silent after Config.SilentSteps steps and are listed as
// such, never as fast.
//
// Within each pipeline stage (ranks that do the same work), the healthy
// ranks are found by splitting the stage's figures in clusters (1-D
// 2-means, peeling off upper clusters while at least a third, and at
// least three ranks, remain), so that a slow host holding half a stage,
// or an outlier step beside it, does not hide in the median. A rank whose
// compute, dataloader or send time exceeds the healthy median by
// RelativeThreshold, by MinEffect of the step, and by NSigma of the
// ranks' noise is anomalous for the step. That noise is the larger of the
// healthy ranks' spread in the step and how far the stage's ranks moved
// from one step to the next over the last Window steps (the median over
// ranks of each one's move): a few ranks show no spread in one step, but
// ranks that share their cores with other work jump by whole time slices
// from step to step, and a slow rank's figure stays high where noise
// comes and goes. Inside each communicator, MindCluster's homogenisation
// splits the members' communication times in two: when those who wait
// more (a majority) wait ClusterMeanDistance times longer, the others are
// late, which their compute confirms (above the healthy median by half
// the margins of the peer test). A communicator that waits
// ClusterMeanDistance times longer than the healthy ones of its kind in
// its stage, with no member to blame, is slow; a host is slow when all
// its ranks are. Lateness that a slow communicator, link or data loading
// explains is not blamed on compute. Consecutive anomalous steps make a
// finding (one outlier step does not) and as many normal ones clear it:
// back within half the margin while the finding was flagged in the last
// Window-Consecutive steps (a rank 20% slow whose noise dips under the
// threshold for a step or two keeps its finding), within the margin
// after that (a subject that recovered partway clears). A step counts
// neither way where most of a stage stood apart from the rest (no
// healthy ranks to compare with) and the subject is above the stage's
// median, or where the subject is still above its peers by that margin
// though not by NSigma of the noise (which, where ranks share their cores
// with other work, is as large as a slowdown); but a run of anomalous
// steps must fit in twice Consecutive steps.
//
// MindCluster's time detector runs on the job's step time: a baseline of
// the first NormalSteps steps (their median, and σ from their median
// absolute deviation, where MindCluster trims the mean), a bound of
// +DegradationPercentage and NSigma σ, Consecutive anomalies in a row. It
// gives the degradation level and the onset. Ranks are judged at every
// step whatever it says; Config.JobGate judges them, as MindCluster does,
// only at steps the time detector finds anomalous, which misses a rank
// 10 or 20% slower that the job's step time hides (TestSensitivity
// prints both side by side). A shift no finding explains
// after Consecutive more steps hit every rank alike (a learning-rate
// phase, a longer sequence): it is reported as a PhaseChange, the baseline
// moves to the new level, and no rank is blamed. Each finding carries
// NVIDIA-style scores: relative (the best rank of the stage over this
// one) and individual (the rank's own best over its recent time).
//
// # Output
//
// Result carries MindCluster's ClusterJobResult fields under their JSON
// names (isSlow, degradationLevel, slowCalculateRanks,
// slowCommunicationDomains, slowHostNodes, slowIORanks,
// slowCommunicationRanks) plus per-finding evidence (peer baseline,
// recent value, ratio, method), the onset step, a confidence, per-rank
// figures and input counters. A figure no marker gave (a switch off, or
// communication covering all of forward and backward, which leaves no
// compute to tell) is named in Result.Unavailable with the reason, and
// left out of the reports. WriteText, WriteJSON and WriteHTML render it;
// the HTML page is self-contained.
//
// Hosts come from Config.Nodes (see ParseRankTable for hccl.json), from
// a <job>/<host>/<rank>/ layout, or from Config.RanksPerNode.
//
// # Metrics
//
// Analyze and Watch register on Config.Registerer while they run (another
// Analyze or Watch running on the same Registerer makes that their
// error):
// faultline_slownode_records_total, faultline_slownode_read_bytes_total,
// faultline_slownode_garbage_lines_total,
// faultline_slownode_verdict_changes_total,
// faultline_slownode_steps_evaluated_total (counters), and
// faultline_slownode_slow and faultline_slownode_slow_ranks (gauges).
// They trace each pass (slownode.Analyze, slownode.pass) with
// Config.TracerProvider.
//
// # Tests
//
// The tests generate jobs with internal/gen through the real record
// format and reader: TP, PP and DP layouts of 8 to 64 ranks, with noise
// and outlier steps, healthy or with one injected slowdown each, and
// assert precision, recall and a detection latency of at most 3 steps.
// FAULTLINE_SLOWNODE_LARGE=1 adds 128- and 512-rank layouts and ten more
// seeds (about a minute). Where python3 has torch (Debian's
// python3-torch), TestRealDDPJob runs testdata/ddp.py, a 4-rank
// data-parallel PyTorch job on gloo that writes its dotting in this
// format, healthy and with a slow rank and a slow data loader;
// TestSensitivity prints how soon a slow rank is found (-v), on generated
// jobs and on real ones computing on the shared cores or on a device
// modelled as a wait (ddp.py --device-ms), with and without JobGate.
// FAULTLINE_SLOWNODE_CALIBRATE=1 prints how each threshold trades false
// findings for missed ones on both kinds of job (see Config's defaults).
// The benchmarks (go test -bench .) generate a 1024-rank, 200-step job.
package slownode
