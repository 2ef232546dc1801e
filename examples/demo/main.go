// Command demo runs a small training job on one machine and shows where
// its dotting lands.
//
//	go run ./examples/demo [-workers 4] [-phase 1.5s] [-out DIR]
//
// The parent process plays a launcher and an operator: it starts worker
// processes (this program again, one per rank) that run a synthetic
// training loop dotting step, dataloader, forward, save_checkpoint and an
// all-reduce, and it flips the profiling switch a few times by updating a
// switch file the way the kubelet updates a mounted ConfigMap. When the
// workers have stopped it reads every rank's files back and prints, per
// rank, the files and the ranges of each kind recorded while each switch
// was in force.
//
// The workers are given no MINDX_TASK_ID, so they agree on a
// default_task_id_<seconds> job folder through their common parent.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/faultline-ml/faultline/trace"
)

// Environment of a worker process.
const (
	envWorker = "FAULTLINE_DEMO_WORKER" // the rank
	envWorld  = "FAULTLINE_DEMO_WORLD"
	envRoot   = "FAULTLINE_DEMO_ROOT"
	envSwitch = "FAULTLINE_DEMO_SWITCH"
)

// config is what a run needs.
type config struct {
	Workers int
	Phase   time.Duration // how long each switch stays in force
	Out     string        // "" for a new temporary folder
}

// phases are the switches the demo puts in force, in order.
var phases = []trace.Switch{
	trace.AllOn(),
	trace.AllOn().With(trace.CommunicationOperator, false),
	{},
	{Step: true, CommunicationOperator: true},
}

func main() {
	if rank := os.Getenv(envWorker); rank != "" {
		os.Exit(worker(rank))
	}
	var cfg config
	flag.IntVar(&cfg.Workers, "workers", 4, "worker processes (ranks)")
	flag.DurationVar(&cfg.Phase, "phase", 1500*time.Millisecond, "time each switch stays in force")
	flag.StringVar(&cfg.Out, "out", "", "output folder (default: a new temporary folder)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// run starts the workers, flips the switch through the phases, stops the
// workers and reports.
func run(ctx context.Context, cfg config, out io.Writer) error {
	if cfg.Workers < 1 || cfg.Phase <= 0 {
		return fmt.Errorf("need at least one worker and a positive phase, got %d and %v", cfg.Workers, cfg.Phase)
	}
	dir := cfg.Out
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "faultline-demo-"); err != nil {
			return err
		}
	}
	root := filepath.Join(dir, "profiling")
	mount := filepath.Join(dir, "datatrace-config")
	switchPath := filepath.Join(mount, "profilingSwitch")
	fmt.Fprintf(out, "faultline demo: %d workers, %d switch phases of %v, output under %s\n\n", cfg.Workers, len(phases), cfg.Phase, dir)

	cm := configMap{dir: mount, key: "profilingSwitch"}
	if err := cm.update(phases[0]); err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, trace.EnvTaskID+"=") { // let the workers agree on a default job
			env = append(env, kv)
		}
	}
	var cmds []*exec.Cmd
	stopWorkers := func() {
		for _, cmd := range cmds {
			cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	defer func() { // on an early return
		for _, cmd := range cmds {
			if cmd.ProcessState == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
		}
	}()
	var ready []chan struct{}
	for rank := range cfg.Workers {
		cmd := exec.Command(exe)
		cmd.Env = append(slices.Clip(env), envWorker+"="+strconv.Itoa(rank), envWorld+"="+strconv.Itoa(cfg.Workers),
			envRoot+"="+root, envSwitch+"="+switchPath)
		r := make(chan struct{})
		cmd.Stdout, cmd.Stderr = &readyWriter{ready: r}, os.Stderr
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("start worker %d: %w", rank, err)
		}
		cmds, ready = append(cmds, cmd), append(ready, r)
	}
	// The first phase starts once every worker trains with its switch, so
	// that a slow start on a loaded machine does not eat into it.
	deadline := time.After(time.Minute)
	for rank, r := range ready {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return fmt.Errorf("worker %d not ready after a minute", rank)
		case <-r:
		}
	}

	changed := make([]time.Time, len(phases))
	changed[0] = time.Now()
	for i := 1; i < len(phases); i++ {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(cfg.Phase):
		}
		changed[i] = time.Now() // before the update: no worker can see it earlier
		if err := cm.update(phases[i]); err != nil {
			return err
		}
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(cfg.Phase):
	}
	end := time.Now()
	stopWorkers()
	var failed []error
	for rank, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			failed = append(failed, fmt.Errorf("worker %d: %w", rank, err))
		}
	}
	if err := errors.Join(failed...); err != nil {
		return err
	}
	return report(out, root, changed, end)
}

// configMap updates a folder the way the kubelet updates a ConfigMap
// volume: a new timestamped folder, a ..data_tmp symlink to it renamed
// over ..data, and the key as a symlink into ..data.
type configMap struct {
	dir, key string
	seq      int
}

func (c *configMap) update(s trace.Switch) error {
	c.seq++
	ts := fmt.Sprintf("..%s.%d", time.Now().Format("2006_01_02_15_04_05"), c.seq)
	if err := os.MkdirAll(filepath.Join(c.dir, ts), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(c.dir, ts, c.key), []byte(s.String()), 0o644); err != nil {
		return err
	}
	old, _ := os.Readlink(filepath.Join(c.dir, "..data"))
	tmp := filepath.Join(c.dir, "..data_tmp")
	if err := os.Symlink(ts, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(c.dir, "..data")); err != nil {
		return err
	}
	if _, err := os.Lstat(filepath.Join(c.dir, c.key)); errors.Is(err, os.ErrNotExist) {
		if err := os.Symlink(filepath.Join("..data", c.key), filepath.Join(c.dir, c.key)); err != nil {
			return err
		}
	}
	if old != "" {
		return os.RemoveAll(filepath.Join(c.dir, old))
	}
	return nil
}

// readyWriter is a worker's standard output, where it says "ready" once
// its switch is in force.
type readyWriter struct {
	ready chan struct{}
	seen  bool
}

func (w *readyWriter) Write(p []byte) (int, error) {
	if !w.seen && bytes.Contains(p, []byte("ready")) {
		w.seen = true
		close(w.ready)
	}
	return len(p), nil
}

// worker is one rank of the synthetic job.
func worker(rankEnv string) int {
	rank, _ := strconv.Atoi(rankEnv)
	world, _ := strconv.Atoi(os.Getenv(envWorld))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "worker %d: %v\n", rank, err)
		return 1
	}
	rec, err := trace.NewRecorder(context.Background(), trace.RecorderConfig{
		Root: os.Getenv(envRoot), Rank: rank, MaxFileBytes: 256 << 10,
	})
	if err != nil {
		return fail(err)
	}
	switched := make(chan struct{}, 1)
	w, err := trace.NewSwitchWatcher(trace.SwitchWatcherConfig{Path: os.Getenv(envSwitch), OnChange: func(s trace.Switch) {
		rec.SetSwitch(s)
		select {
		case switched <- struct{}{}:
		default:
		}
	}})
	if err != nil {
		return fail(err)
	}
	watched := make(chan error, 1)
	go func() { watched <- w.Run(ctx) }()
	select {
	case <-switched:
		fmt.Println("ready")
	case <-ctx.Done():
	}

	// Tensor parallelism over pairs of ranks, data parallelism across them.
	tp := rank / 2 * 2
	tpRanks := []int{tp}
	if tp+1 < world {
		tpRanks = append(tpRanks, tp+1)
	}
	var dpRanks []int
	for r := rank % 2; r < world; r += 2 {
		dpRanks = append(dpRanks, r)
	}
	tpName, dpName := fmt.Sprintf("tp-%d", tp/2), fmt.Sprintf("dp-%d", rank%2)
	if err := rec.WriteParallelGroups(trace.ParallelGroups{
		tpName: {GroupName: "tp", GroupRank: slices.Index(tpRanks, rank), GlobalRanks: tpRanks},
		dpName: {GroupName: "dp", GroupRank: slices.Index(dpRanks, rank), GlobalRanks: dpRanks},
	}); err != nil {
		return fail(err)
	}
	allReduce := trace.CommOp{OpName: "HcclAllReduce", GroupName: dpName, Count: 1 << 22, DataType: "bf16", StreamID: 1}
	gather := trace.CommOp{OpName: "HcclAllGather", GroupName: tpName, Count: 1 << 20, DataType: "bf16", StreamID: 1}
	work := func(d time.Duration) { time.Sleep(d) }
	for step := uint64(1); ctx.Err() == nil; step++ {
		s := rec.StartStep(step, uint32(rank), 0)
		dl := rec.Start(trace.DataLoader, trace.MarkerDataLoader, uint32(rank), 0)
		work(time.Millisecond)
		dl.End()
		fp := rec.Start(trace.FP, trace.MarkerForward, uint32(rank), 0)
		work(3 * time.Millisecond)
		c := rec.StartComm(&gather, uint32(rank), 1)
		work(time.Millisecond)
		c.End()
		fp.End()
		c = rec.StartComm(&allReduce, uint32(rank), 1)
		work(2 * time.Millisecond)
		c.End()
		if step%20 == 0 {
			ck := rec.Start(trace.SaveCheckpoint, trace.MarkerSaveCheckpoint, uint32(rank), 0)
			work(5 * time.Millisecond)
			ck.End()
		}
		s.End()
	}
	w.Close()
	if err := <-watched; err != nil {
		return fail(err)
	}
	if err := rec.Close(); err != nil {
		return fail(err)
	}
	if d := rec.Stats().Dropped; d != (trace.DomainCounts{}) {
		fmt.Fprintf(os.Stderr, "worker %d: dropped %+v\n", rank, d)
	}
	return 0
}

// report reads every rank's files and prints what landed where, and under
// which switch.
func report(out io.Writer, root string, changed []time.Time, end time.Time) error {
	jobs, err := trace.ListJobs(root)
	if err != nil {
		return err
	}
	if len(jobs) != 1 {
		return fmt.Errorf("want one job folder under %s, found %v", root, jobs)
	}
	jobDir := filepath.Join(root, jobs[0])
	fmt.Fprintf(out, "job folder %s (the workers agreed on it through their parent)\n\n", jobDir)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "phase\tfrom\tswitch: kinds on")
	for i, s := range phases {
		fmt.Fprintf(tw, "%d\t%.1fs\t%s\n", i+1, changed[i].Sub(changed[0]).Seconds(), kindsOn(s))
	}
	tw.Flush()

	ranks, err := trace.ListRanks(jobDir)
	if err != nil {
		return err
	}
	phaseOf := func(ns uint64) int {
		t := time.Unix(0, int64(ns))
		for i := len(changed) - 1; i >= 0; i-- {
			if !t.Before(changed[i]) {
				return i
			}
		}
		return 0
	}
	late := 0
	for _, rank := range ranks {
		dir := filepath.Join(jobDir, strconv.Itoa(rank))
		ents, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		var files []string
		for _, e := range ents {
			fi, err := e.Info()
			if err != nil {
				return err
			}
			files = append(files, fmt.Sprintf("%s (%.1f KiB)", e.Name(), float64(fi.Size())/1024))
		}
		fmt.Fprintf(out, "\nrank %d: %s\n  %s\n", rank, dir, strings.Join(files, ", "))
		if g, err := trace.ReadParallelGroups(dir); err == nil {
			var names []string
			for name, p := range g {
				names = append(names, fmt.Sprintf("%s=%s%v", name, p.GroupName, p.GlobalRanks))
			}
			slices.Sort(names)
			fmt.Fprintf(out, "  parallel groups: %s\n", strings.Join(names, " "))
		}

		rr, err := trace.OpenRankReader(dir, trace.ReaderConfig{})
		if err != nil {
			return err
		}
		var p trace.Pairer
		counts := make([][len(trace.Kinds)]int, len(phases))
		err = rr.Read(func(r *trace.Record) error {
			rg, ok := p.Add(r)
			if !ok {
				return nil
			}
			k, ok := rg.Kind()
			if !ok {
				return nil
			}
			ph := phaseOf(rg.Start)
			counts[ph][k]++
			// The switch applies within a second; a range of a kind that was
			// off, started later than that, would be a bug.
			if !phases[ph].Enabled(k) && time.Unix(0, int64(rg.Start)).Sub(changed[ph]) > time.Second {
				late++
			}
			return nil
		})
		st := rr.Stats()
		rr.Close()
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprint(tw, "  ranges\t")
		for _, k := range trace.Kinds {
			fmt.Fprintf(tw, "%s\t", k)
		}
		fmt.Fprintln(tw)
		for i := range phases {
			fmt.Fprintf(tw, "  phase %d\t", i+1)
			for _, k := range trace.Kinds {
				fmt.Fprintf(tw, "%d\t", counts[i][k])
			}
			fmt.Fprintln(tw)
		}
		tw.Flush()
		fmt.Fprintf(out, "  %d records in %d files, %d damaged lines, %d unmatched ends\n",
			st.Records, st.Files, st.GarbageLines, p.Stats().UnmatchedEnds)
	}
	fmt.Fprintf(out, "\nranges of a kind switched off, started more than 1 s after the switch: %d\n", late)
	if late > 0 {
		return fmt.Errorf("%d ranges recorded while their kind was off", late)
	}
	a, err := trace.NewAger(trace.AgerConfig{Root: root})
	if err != nil {
		return err
	}
	rep, err := a.Check()
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "ager: %d record files, %.1f MiB under %s; budget %d MiB, %d files deleted\n",
		rep.Files, float64(rep.Bytes)/(1<<20), root, trace.DefaultBudgetBytes>>20, rep.DeletedFiles)
	return nil
}

func kindsOn(s trace.Switch) string {
	var on []string
	for _, k := range trace.Kinds {
		if s.Enabled(k) {
			on = append(on, k.String())
		}
	}
	if len(on) == 0 {
		return "(all off)"
	}
	return strings.Join(on, " ")
}
