package slownode

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	oteltrace "go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/errgroup"

	"github.com/faultline-ml/faultline/internal/promreg"
	"github.com/faultline-ml/faultline/trace"
)

// ErrNoRanks is returned by Analyze for a job folder with no rank folder.
var ErrNoRanks = errors.New("slownode: no rank folders")

// chunkSteps is how far one rank is read ahead of the slowest before the
// others get their turn, so that a finished job's files, read one after
// the other, meet in the detector a few steps apart (well within
// DefaultHorizon). Longer turns keep a rank's reading state in the cache
// for more of its records: a thousand ranks' worth does not fit.
const chunkSteps = 32

// Per-rank reading state stays open while a job is tailed, so it is kept
// small: a thousand ranks with trace's defaults (a 256 KiB buffer, 8192
// open ranges and names) would hold over 300 MiB.
const (
	// maxOpenRanges bounds the ranges a rank may have started and not
	// ended, and the names the pairer keeps for a marker's other source; a
	// rank has a few nested ranges open at a time.
	maxOpenRanges = 256
	// readBufferBytes is the size of the buffers the rank readers
	// borrow from their source's pool while they read.
	readBufferBytes = 32 << 10
	// readAhead is how many ranks the workers may read ahead of the one
	// whose ranges the detector takes: enough to keep them busy while the
	// detector evaluates a round's steps. maxQueued is how many ranges one
	// rank may have read ahead, a round's worth (chunkSteps steps) or more.
	readAhead  = 256
	maxQueued  = 4096
	queueStart = 8 * chunkSteps // a queue's first room: a round of a few ranges a step
	// sendBatch is how many ranks the pass hands the workers at a time.
	sendBatch = 16
)

// Analyze reads every rank folder of jobDir to its end, as the files
// stand, and returns the verdict. jobDir holds <rank>/ folders, or
// <node>/<rank>/ folders gathered from several hosts (the node's folder
// name then names the rank's host).
func Analyze(ctx context.Context, jobDir string, cfg Config) (*Result, error) {
	s, err := newSource(jobDir, cfg)
	if err != nil {
		return nil, err
	}
	defer s.close()
	ctx, span := s.tracer.Start(ctx, "slownode.Analyze", oteltrace.WithAttributes(attribute.String("job.dir", jobDir)))
	defer span.End()
	if err := s.pass(ctx); err != nil {
		return nil, err
	}
	if len(s.ranks) == 0 {
		return nil, fmt.Errorf("%w in %s", ErrNoRanks, jobDir)
	}
	s.d.Flush()
	r := s.result()
	span.SetAttributes(attribute.Int("slownode.is_slow", r.IsSlow), attribute.Int64("slownode.last_step", r.LastStep))
	return r, nil
}

// Watch tails the rank folders of jobDir every cfg.PollInterval until ctx
// is done, and calls onChange with the verdict whenever it changes: slow
// or not, the slow ranks, hosts, communicators or silent ranks. The first
// verdict is passed once the first steps have been evaluated. A changed
// verdict is the one of the step that changed it (its LastStep), passed
// as soon as that step is evaluated, not once the files have been read
// to their end: a catch-up read passes on every change it comes across.
// Rank folders that appear later join. Watch returns nil when ctx is
// done, or the error that stopped it.
func Watch(ctx context.Context, jobDir string, cfg Config, onChange func(*Result)) error {
	s, err := newSource(jobDir, cfg)
	if err != nil {
		return err
	}
	defer s.close()
	tick := time.NewTicker(s.d.cfg.PollInterval)
	defer tick.Stop()
	last := ""
	report := func() {
		r := s.result()
		if k := verdictKey(r, s.d.job.nPhases); k != last {
			last = k
			s.metrics.changes.Add(1)
			onChange(r)
		}
	}
	var seen uint64
	s.d.afterStep = func() {
		if s.d.changes != seen {
			seen = s.d.changes
			report()
		}
	}
	for {
		pctx, span := s.tracer.Start(ctx, "slownode.pass")
		err := s.pass(pctx)
		span.End()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if s.d.evaluated >= 0 {
			report()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// verdictKey is what makes two verdicts different for Watch: r's lists
// and how many phase changes there were (r lists the latest maxPhases).
func verdictKey(r *Result, phases uint64) string {
	return fmt.Sprint(r.IsSlow, r.SlowCalculateRanks, r.SlowCommunicationDomains, r.SlowHostNodes,
		r.SlowIORanks, r.SlowCommunicationRanks, r.SilentRanks, phases)
}

type rankSource struct {
	rank    int
	dir     string
	node    string // from a <node>/<rank> layout, "" otherwise
	rd      *trace.RankReader
	pair    trace.Pairer
	groups  bool   // parallel_group.json loaded
	garbage uint64 // garbage lines already logged
	err     error  // why the folder cannot be read, logged once

	// Read ahead by a worker, handed to the detector by the pass.
	queue    []marker                  // ranges read, from head on not yet given to the detector
	paired   trace.Range               // where the pairer puts the range it completes
	reached  bool                      // a range of a step at or past target is queued
	take     func(*trace.Record) error // takeRecord, made once for ReadSome
	head     int
	target   int64             // the step the current round reads to
	eof      bool              // the latest fill caught up with the files
	readErr  error             // why the latest fill stopped, when not caught up or paused
	ready    chan struct{}     // a worker finished a fill
	inFlight bool              // sent to the workers, ready not yet received
	counted  trace.ReaderStats // the reader's counters already added to the pass's
	unpaired uint64            // the pairer's unmatched ends, as of counted

	// What load found, for open.
	openErr error
	loaded  trace.ParallelGroups
	loadErr error
}

type source struct {
	dir                 string
	d                   *Detector
	ranks               []*rankSource
	byRank              map[int]*rankSource
	log                 *slog.Logger
	tracer              oteltrace.Tracer
	metrics             *metrics
	reg                 *promreg.Registrar
	prog                func(Progress)
	readers             int // workers that read ahead
	bufs                *trace.BufferPool
	bytes               uint64
	records             uint64
	passStart, lastProg time.Time
	progressed          bool // progress reported during this pass
}

func newSource(jobDir string, cfg Config) (*source, error) {
	cfg.JobID = cmp.Or(cfg.JobID, filepath.Base(filepath.Clean(jobDir)))
	d, err := New(cfg)
	if err != nil {
		return nil, err
	}
	fi, err := os.Stat(jobDir)
	if err != nil {
		return nil, fmt.Errorf("slownode: job folder: %w", err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("slownode: job folder %s is not a folder", jobDir)
	}
	s := &source{dir: jobDir, d: d, byRank: map[int]*rankSource{}, log: cfg.Logger, prog: cfg.Progress,
		metrics: newMetrics(), reg: promreg.New(cfg.Registerer, "slownode: Config.Registerer"), readers: d.cfg.Readers, bufs: trace.NewBufferPool(readBufferBytes)}
	s.log = cmp.Or(s.log, slog.New(slog.DiscardHandler))
	tp := cmp.Or(cfg.TracerProvider, oteltrace.TracerProvider(noop.NewTracerProvider()))
	s.tracer = tp.Tracer("github.com/faultline-ml/faultline/trace/slownode")
	s.reg.MustRegister(s.metrics)
	if err := s.reg.Err(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *source) close() {
	for _, rs := range s.ranks {
		if rs.rd != nil {
			rs.rd.Close()
		}
	}
	s.reg.UnregisterAll()
}

// discover opens the rank folders that appeared since the last pass.
func (s *source) discover() error {
	ranks, err := trace.ListRanks(s.dir)
	if err != nil {
		return fmt.Errorf("slownode: %w", err)
	}
	type found struct {
		rank      int
		dir, node string
	}
	var all []found
	for _, r := range ranks {
		all = append(all, found{r, filepath.Join(s.dir, strconv.Itoa(r)), ""})
	}
	if len(ranks) == 0 {
		// <job>/<node>/<rank>: folders gathered from several hosts.
		ents, err := os.ReadDir(s.dir)
		if err != nil {
			return fmt.Errorf("slownode: %w", err)
		}
		for _, e := range ents {
			if !e.IsDir() || trace.ValidateJob(e.Name()) != nil {
				continue
			}
			sub := filepath.Join(s.dir, e.Name())
			rs, err := trace.ListRanks(sub)
			if err != nil {
				continue
			}
			for _, r := range rs {
				all = append(all, found{r, filepath.Join(sub, strconv.Itoa(r)), e.Name()})
			}
		}
	}
	for _, f := range all {
		if prev, ok := s.byRank[f.rank]; ok {
			if prev.dir != f.dir && prev.err == nil {
				prev.err = fmt.Errorf("rank %d has two folders, %s and %s: the second is ignored", f.rank, prev.dir, f.dir)
				s.log.Warn("slownode: duplicate rank folder", "rank", f.rank, "kept", prev.dir, "ignored", f.dir)
			}
			continue
		}
		rs := &rankSource{rank: f.rank, dir: f.dir, node: f.node, pair: trace.Pairer{MaxOpen: maxOpenRanges},
			ready: make(chan struct{}, 1)}
		rs.take = rs.takeRecord
		if f.node != "" {
			if _, ok := s.d.cfg.Nodes[f.rank]; !ok {
				s.d.setNode(f.rank, f.node)
			}
		}
		s.byRank[f.rank] = rs
		s.ranks = append(s.ranks, rs)
		s.d.AddRank(f.rank)
	}
	slices.SortFunc(s.ranks, func(a, b *rankSource) int { return a.rank - b.rank })
	return nil
}

// pass discovers rank folders and reads every rank to where its files
// end, in rounds that keep the ranks within a few steps of each other.
//
// Workers read, parse and pair the records of the ranks next in turn
// while the pass hands the ranges of the current one to the detector (a
// Detector is not safe for concurrent use): each rank's ranges reach the
// detector in file order, and a rank stops at the same range, as if the
// pass read them itself.
func (s *source) pass(ctx context.Context) error {
	s.passStart = time.Now()
	defer s.progress(true)
	if err := s.discover(); err != nil {
		return err
	}
	var loads errgroup.Group
	loads.SetLimit(s.readers)
	for _, rs := range s.ranks {
		if rs.rd == nil || !rs.groups {
			loads.Go(func() error { rs.load(s.bufs); return nil })
		}
	}
	loads.Wait()
	for _, rs := range s.ranks {
		s.open(rs)
	}
	work := make(chan *rankSource, readAhead)
	var wg sync.WaitGroup
	for range s.readers {
		wg.Go(func() {
			for rs := range work {
				rs.fill()
				rs.ready <- struct{}{}
			}
		})
	}
	defer func() {
		close(work)
		wg.Wait()
		for _, rs := range s.ranks { // fills a failed pass did not wait for
			select {
			case <-rs.ready:
			default:
			}
			rs.inFlight = false
		}
	}()
	caught := make([]bool, len(s.ranks))
	var (
		target   int64
		todo     []int // indexes in s.ranks of the ranks the round reads
		sent     int   // todo[:sent] went to the workers
		next     []int // the ranks of the next round so far: those this one left short of their files' end
		nextSent int   // next[:nextSent] went to the workers
		free     [][]marker
	)
	// plan starts a round: every rank not caught up is read until it has
	// finished chunkSteps steps past the one furthest behind. It reports
	// false once every rank has caught up.
	plan := func() bool {
		first := true
		for i, rs := range s.ranks {
			if caught[i] || rs.rd == nil {
				continue
			}
			if l := s.d.rankLast(rs.rank); first || l < target {
				target, first = l, false
			}
		}
		target += chunkSteps
		todo, sent, next, nextSent = todo[:0], 0, next[:0], 0
		for i, rs := range s.ranks {
			if caught[i] || rs.rd == nil {
				caught[i] = true
				continue
			}
			todo = append(todo, i)
		}
		return !first
	}
	dispatch := func(rs *rankSource, target int64) {
		rs.target, rs.inFlight = target, true
		if rs.queue == nil && len(free) > 0 {
			rs.queue, free = free[len(free)-1], free[:len(free)-1]
		}
		work <- rs
	}
	// send hands the workers the ranks up to position upto of the round,
	// and past its end the next round's first ones, to the step that
	// round will most likely read to: the ranks then meet at this round's
	// target. At most readAhead ranks are sent and not yet taken, so that
	// sending never blocks and the ranges read ahead stay few.
	send := func(upto int) {
		for ; sent < len(todo) && sent < upto; sent++ {
			if rs := s.ranks[todo[sent]]; !rs.inFlight {
				dispatch(rs, target)
			}
		}
		for ; sent+nextSent < upto && nextSent < len(next); nextSent++ {
			dispatch(s.ranks[next[nextSent]], target+chunkSteps)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	more := plan()
	send(readAhead)
	for more {
		s.d.holdEvaluation()
		for k, i := range todo {
			if k%sendBatch == 0 {
				// A batch at a time: a worker woken for each rank would
				// read one and sleep again, and waking costs more than
				// reading a rank's round.
				send(k + readAhead)
			}
			rs := s.ranks[i]
			<-rs.ready
			rs.inFlight = false
			done, err := s.feed(rs, target)
			if err != nil {
				s.d.release()
				return err
			}
			if rs.head == len(rs.queue) && rs.queue != nil {
				free = append(free, rs.queue[:0])
				rs.queue, rs.head = nil, 0
			}
			caught[i] = done
			if !done {
				next = append(next, i)
			}
		}
		// The workers read on into the next round while this round's
		// steps are evaluated: the evaluation changes none of what plan
		// looks at.
		err := ctx.Err()
		if err == nil {
			more = plan()
			send(readAhead)
		}
		s.d.release()
		s.progress(false)
		if err != nil {
			return err
		}
	}
	for _, rs := range s.ranks {
		if rs.rd == nil {
			continue
		}
		st := rs.rd.Stats()
		if st.GarbageLines > rs.garbage {
			s.log.Warn("slownode: skipped lines that are not records", "rank", rs.rank,
				"lines", st.GarbageLines-rs.garbage, "last", st.LastGarbage)
			s.metrics.garbage.Add(st.GarbageLines - rs.garbage)
			rs.garbage = st.GarbageLines
		}
	}
	return nil
}

// load opens the rank's reader and reads its parallel_group.json where
// that is not done yet; open then takes the outcome in. Workers load the
// ranks side by side, and the pass opens them in rank order, as one.
func (rs *rankSource) load(bufs *trace.BufferPool) {
	rs.openErr, rs.loaded, rs.loadErr = nil, nil, nil
	if rs.rd == nil {
		rd, err := trace.OpenRankReader(rs.dir, trace.ReaderConfig{Buffers: bufs})
		if err != nil {
			rs.openErr = err
			return
		}
		rs.rd = rd
	}
	if !rs.groups {
		rs.loaded, rs.loadErr = rs.rd.ParallelGroups()
	}
}

// open takes in what load found: the reader of a rank folder and its
// parallel_group.json, retried on later passes until both work.
func (s *source) open(rs *rankSource) {
	if err := rs.openErr; err != nil {
		if rs.err == nil {
			s.log.Warn("slownode: cannot read rank folder", "rank", rs.rank, "err", err)
		}
		rs.err, rs.openErr = err, nil
		return
	}
	if !rs.groups {
		switch err := rs.loadErr; {
		case err == nil:
			s.d.AddGroups(rs.loaded)
			rs.groups = true
		case errors.Is(err, os.ErrNotExist):
			// Not written yet, or a job without one: communicators are
			// then learnt from the ops' group names.
		default:
			s.log.Warn("slownode: ignoring parallel groups", "rank", rs.rank, "err", err)
			rs.groups = true
		}
	}
	rs.loaded, rs.loadErr = nil, nil
}

// fill reads the rank's records ahead into its queue, paired, a buffer
// at a time, until a range of a step at or past target is queued,
// maxQueued ranges are, or the files end. Where it stops matters only for
// how much is queued: feed decides where the rank stops, and fills again
// when the queue runs out short of that. What a buffer held past target
// stays queued for the next round, so that no byte is read twice.
func (rs *rankSource) fill() {
	rs.eof = false
	if rs.readErr != nil {
		return // feed reports it once the queue before it is taken
	}
	if rs.head > 0 {
		rs.queue = rs.queue[:copy(rs.queue, rs.queue[rs.head:])]
		rs.head = 0
	}
	rs.reached = false
	for i := range rs.queue {
		if n, ok := markerStep(&rs.queue[i]); ok && n >= rs.target {
			return
		}
	}
	for !rs.reached && len(rs.queue) < maxQueued {
		more, err := rs.rd.ReadSome(1, rs.take)
		if err != nil {
			rs.readErr = err
			return
		}
		if !more {
			rs.eof = true
			return
		}
	}
}

// takeRecord pairs a record of the rank and queues the range it ends.
func (rs *rankSource) takeRecord(rec *trace.Record) error {
	if !rs.pair.AddTo(rec, &rs.paired) {
		return nil
	}
	if n := len(rs.queue); n == cap(rs.queue) {
		// A round's worth at once, not doubling up to it.
		rs.queue = slices.Grow(rs.queue, max(n, queueStart))
	}
	rs.queue = append(rs.queue, markerOf(&rs.paired))
	if s, ok := markerStep(&rs.queue[len(rs.queue)-1]); ok && s >= rs.target {
		rs.reached = true
	}
	return nil
}

// markerStep returns n for a range named "step <n>".
func markerStep(r *marker) (int64, bool) {
	if !strings.HasPrefix(r.name, trace.StepMarkerPrefix) {
		return 0, false
	}
	return parseStepNumber(r.name)
}

// feed hands the rank's queued ranges to the detector until the rank has
// finished step target, filling the queue again where it runs out first;
// it reports whether the rank caught up instead.
func (s *source) feed(rs *rankSource, target int64) (bool, error) {
	var st *rankState // nil for a rank the detector refused, which never pauses
	i, ok := s.d.index[rs.rank]
	if ok {
		st = s.d.ranks[i]
	}
	for {
		s.count(rs)
		for rs.head < len(rs.queue) {
			r := &rs.queue[rs.head]
			rs.head++
			if ok {
				s.d.addAt(i, r)
			} else {
				s.d.add(rs.rank, r)
			}
			if st != nil && st.asm.last >= target {
				return false, nil
			}
		}
		switch {
		case rs.readErr != nil:
			err := rs.readErr
			rs.readErr = nil
			return false, fmt.Errorf("slownode: rank %d: %w", rs.rank, err)
		case rs.eof:
			return true, nil
		}
		rs.target = target
		rs.fill()
	}
}

// count adds what the rank's reader read since the last count to the
// pass's counters and metrics. The pass counts a rank while no worker
// reads it: a result taken during the pass reads the counts, not the
// reader.
func (s *source) count(rs *rankSource) {
	after := rs.rd.Stats()
	bytes, records := after.Bytes-rs.counted.Bytes, after.Records-rs.counted.Records
	rs.counted, rs.unpaired = after, rs.pair.Stats().UnmatchedEnds
	s.bytes += bytes
	s.records += records
	s.metrics.records.Add(records)
	s.metrics.bytes.Add(bytes)
}

// progress reports to Config.Progress about once a second during a pass
// that lasts longer than a second, and once when such a pass ends.
func (s *source) progress(done bool) {
	if s.prog == nil {
		return
	}
	now := time.Now()
	if !done && (now.Sub(s.passStart) < time.Second || now.Sub(s.lastProg) < time.Second) {
		return
	}
	if done && !s.progressed {
		return
	}
	s.lastProg, s.progressed = now, !done
	s.prog(Progress{Ranks: len(s.ranks), Bytes: s.bytes, Records: s.records, LastStep: s.d.evaluated, Done: done})
}

func (s *source) result() *Result {
	r := s.d.Result()
	r.Input.Bytes, r.Input.Records = s.bytes, s.records
	for _, rs := range s.ranks {
		r.Input.GarbageLines += rs.counted.GarbageLines
		r.Input.UnmatchedEnds += rs.unpaired
		if rs.err != nil {
			r.Input.Warnings = append(r.Input.Warnings, rs.err.Error())
		}
	}
	if r.Input.GarbageLines > 0 {
		r.Input.Warnings = append(r.Input.Warnings, fmt.Sprintf("%d lines were not records and were skipped", r.Input.GarbageLines))
	}
	s.metrics.set(r, s.d.stats.Evaluated)
	return r
}

// metrics are the collectors Analyze and Watch register.
type metrics struct {
	records, bytes, garbage, changes atomic.Uint64
	evaluated                        atomic.Uint64
	slow, slowRanks                  atomic.Int64
	descs                            [7]*prometheus.Desc
}

func newMetrics() *metrics {
	m := &metrics{}
	names := [...][2]string{
		{"faultline_slownode_records_total", "Dotting records read."},
		{"faultline_slownode_read_bytes_total", "Bytes of dotting records read."},
		{"faultline_slownode_garbage_lines_total", "Lines skipped because they are not records."},
		{"faultline_slownode_verdict_changes_total", "Times the verdict changed."},
		{"faultline_slownode_steps_evaluated_total", "Job steps evaluated."},
		{"faultline_slownode_slow", "1 when the job has a slow rank, host, communicator or link."},
		{"faultline_slownode_slow_ranks", "Ranks blamed by the current verdict."},
	}
	for i, n := range names {
		m.descs[i] = prometheus.NewDesc(n[0], n[1], nil, nil)
	}
	return m
}

func (m *metrics) set(r *Result, evaluated uint64) {
	m.evaluated.Store(evaluated)
	m.slow.Store(int64(r.IsSlow))
	n := 0
	for _, rk := range r.Ranks {
		if rk.Status == "slow" {
			n++
		}
	}
	m.slowRanks.Store(int64(n))
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range m.descs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	counters := []uint64{m.records.Load(), m.bytes.Load(), m.garbage.Load(), m.changes.Load(), m.evaluated.Load()}
	for i, v := range counters {
		ch <- prometheus.MustNewConstMetric(m.descs[i], prometheus.CounterValue, float64(v))
	}
	ch <- prometheus.MustNewConstMetric(m.descs[5], prometheus.GaugeValue, float64(m.slow.Load()))
	ch <- prometheus.MustNewConstMetric(m.descs[6], prometheus.GaugeValue, float64(m.slowRanks.Load()))
}
