package trace

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// Ager defaults, as MindCluster ages its profiling folder.
const (
	DefaultBudgetBytes      = 5000 << 20 // 5000 MiB
	DefaultAgeInterval      = time.Minute
	DefaultFullScanInterval = time.Hour
	DefaultDeleteFraction   = 0.2
	DefaultKeepPerRank      = 3
)

// AgerConfig configures an Ager.
type AgerConfig struct {
	Root             string        // default DefaultRoot
	BudgetBytes      int64         // record bytes allowed under Root; default 5000 MiB
	Interval         time.Duration // between checks; default 1 min
	FullScanInterval time.Duration // between full rescans; default 1 h
	DeleteFraction   float64       // of each rank folder's files deleted per pass; default 0.2
	KeepPerRank      int           // files a rank folder always keeps; default 3
	Registerer       prometheus.Registerer
	Logger           *slog.Logger
}

// Validate reports the first field that cannot be used.
func (c AgerConfig) Validate() error {
	switch {
	case c.BudgetBytes < 0:
		return fmt.Errorf("trace: AgerConfig.BudgetBytes: %d is negative", c.BudgetBytes)
	case c.Interval < 0:
		return fmt.Errorf("trace: AgerConfig.Interval: %v is negative", c.Interval)
	case c.FullScanInterval < 0:
		return fmt.Errorf("trace: AgerConfig.FullScanInterval: %v is negative", c.FullScanInterval)
	case c.DeleteFraction < 0 || c.DeleteFraction > 1 || math.IsNaN(c.DeleteFraction):
		return fmt.Errorf("trace: AgerConfig.DeleteFraction: %v is outside [0, 1]", c.DeleteFraction)
	case c.KeepPerRank < 0:
		return fmt.Errorf("trace: AgerConfig.KeepPerRank: %d is negative", c.KeepPerRank)
	}
	return nil
}

// AgerStats reports what an Ager has done.
type AgerStats struct {
	Checks       uint64
	FullScans    uint64
	DirListings  uint64 // folders listed (a light check lists only folders that changed)
	FileStats    uint64 // files stat'ed
	Bytes        int64  // record bytes under the root at the last check
	Files        int    // record files under the root at the last check
	DeletedFiles uint64
	DeletedBytes uint64
	Errors       uint64
	LastError    error
}

type fileEntry struct {
	name  string
	size  int64
	mtime int64 // ns
	ino   uint64
}

// dirState remembers a folder's mtime when it was listed; a folder whose
// mtime is unchanged has the same entries.
type dirState struct {
	mtime    int64 // ns
	listedAt int64 // ns
}

// changed reports whether a folder must be listed again: its mtime moved,
// or it moved so close to the listing that a change in the same timestamp
// tick (a jiffy, or a second on coarse file systems) could hide.
func (d dirState) changed(st *unix.Stat_t) bool {
	m := st.Mtim.Nano()
	return m != d.mtime || d.listedAt-m < int64(time.Second)
}

type rankIndex struct {
	dirState
	files []fileEntry // sorted by name
}

type jobIndex struct {
	dirState
	ranks map[string]*rankIndex
}

// Ager keeps the record files under a root within a byte budget. One Ager
// runs per node. When the record bytes exceed the budget it deletes, in
// each rank folder, the oldest DeleteFraction (by modification time, at
// least one) of the digit-named regular files, always keeping KeepPerRank
// of them, and repeats until the root is within budget or nothing more may
// go. It deletes nothing else and follows no symlink.
//
// It does not rescan the tree each check: it keeps an index of every rank
// folder's files and, at each check, lists only folders whose mtime
// changed (a file was created or removed) and stats only the newest file
// of each rank (the one being appended to). A full rescan runs every
// FullScanInterval in case the index drifted.
type Ager struct {
	cfg     AgerConfig
	root    dirState
	jobs    map[string]*jobIndex
	check   sync.Mutex // one check at a time
	running sync.Mutex // held by Run
	closing chan struct{}
	once    sync.Once
	m       agerMetrics
	metrics *promreg.Registrar

	mu       sync.Mutex
	stats    AgerStats
	lastFull time.Time
}

type agerMetrics struct {
	bytes        prometheus.Gauge
	deletedFiles prometheus.Counter
	deletedBytes prometheus.Counter
	errors       prometheus.Counter
	scans        *prometheus.CounterVec
}

// NewAger returns an Ager; Run does the checking, Check one check.
func NewAger(cfg AgerConfig) (*Ager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Root = cmp.Or(cfg.Root, DefaultRoot)
	cfg.BudgetBytes = cmp.Or(cfg.BudgetBytes, DefaultBudgetBytes)
	cfg.Interval = cmp.Or(cfg.Interval, DefaultAgeInterval)
	cfg.FullScanInterval = cmp.Or(cfg.FullScanInterval, DefaultFullScanInterval)
	cfg.DeleteFraction = cmp.Or(cfg.DeleteFraction, DefaultDeleteFraction)
	cfg.KeepPerRank = cmp.Or(cfg.KeepPerRank, DefaultKeepPerRank)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	a := &Ager{cfg: cfg, jobs: map[string]*jobIndex{}, closing: make(chan struct{})}
	a.metrics = promreg.New(cfg.Registerer, "trace: AgerConfig.Registerer")
	f := promauto.With(a.metrics)
	a.m = agerMetrics{
		bytes: f.NewGauge(prometheus.GaugeOpts{Name: "faultline_trace_root_bytes",
			Help: "Bytes of dotting record files under the ager's root at its last check."}),
		deletedFiles: f.NewCounter(prometheus.CounterOpts{Name: "faultline_trace_aged_files_total",
			Help: "Dotting record files deleted to keep the root within its budget."}),
		deletedBytes: f.NewCounter(prometheus.CounterOpts{Name: "faultline_trace_aged_bytes_total",
			Help: "Bytes of dotting record files deleted to keep the root within its budget."}),
		errors: f.NewCounter(prometheus.CounterOpts{Name: "faultline_trace_ager_errors_total",
			Help: "Errors while checking or aging the dotting root."}),
		scans: f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_trace_ager_checks_total",
			Help: "Checks of the dotting root, by kind (light, full)."}, []string{"kind"}),
	}
	if err := a.metrics.Err(); err != nil {
		return nil, err
	}
	return a, nil
}

// Run checks at once and then every Interval until ctx is done or Close
// is called; it returns nil then. Errors of a check are logged, counted
// and retried at the next.
func (a *Ager) Run(ctx context.Context) error {
	if !a.running.TryLock() {
		return errors.New("trace: Ager.Run called twice")
	}
	defer a.running.Unlock()
	t := time.NewTicker(a.cfg.Interval)
	defer t.Stop()
	for {
		if _, err := a.Check(); err != nil {
			a.cfg.Logger.Warn("trace: ager", "root", a.cfg.Root, "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-a.closing:
			return nil
		case <-t.C:
		}
	}
}

// Close stops Run, waits for it to return and unregisters the metrics. It
// is idempotent.
func (a *Ager) Close() error {
	a.once.Do(func() {
		close(a.closing)
		a.metrics.UnregisterAll()
	})
	a.running.Lock() // held by Run until it returns
	a.running.Unlock()
	return nil
}

// Stats returns the ager's counters.
func (a *Ager) Stats() AgerStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats
}

// AgeReport says what one check found and did.
type AgeReport struct {
	Full         bool  // the check rescanned everything
	Bytes        int64 // record bytes after the check
	Files        int   // record files after the check
	DeletedFiles int
	DeletedBytes int64
}

// openRank is a rank folder held open during a check.
type openRank struct {
	idx  *rankIndex
	fd   int
	path string
}

// Check updates the index, deleting files if the root is over budget. A
// missing root is empty. Errors about single folders or files are counted
// and the check goes on; the first is returned.
func (a *Ager) Check() (AgeReport, error) {
	a.check.Lock()
	defer a.check.Unlock()
	c := &checkRun{a: a, full: a.startCheck()}
	c.rep.Full = c.full
	defer c.count()

	rootfd, err := unix.Open(a.cfg.Root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		a.jobs = map[string]*jobIndex{}
		a.publish(&c.rep)
		return c.rep, nil
	}
	if err != nil {
		err = fmt.Errorf("trace: ager: open %s: %w", a.cfg.Root, err)
		c.note(err)
		return c.rep, err
	}
	defer unix.Close(rootfd)
	if !c.indexJobs(rootfd) {
		return c.rep, c.firstErr
	}
	defer c.closeRanks()
	c.indexRanks(rootfd)
	c.age()
	a.publish(&c.rep)
	return c.rep, c.firstErr
}

// startCheck counts a check and says whether it is a full one.
func (a *Ager) startCheck() (full bool) {
	now := time.Now()
	a.mu.Lock()
	full = a.lastFull.IsZero() || now.Sub(a.lastFull) >= a.cfg.FullScanInterval
	a.stats.Checks++
	if full {
		a.stats.FullScans++
		a.lastFull = now
	}
	a.mu.Unlock()
	kind := "light"
	if full {
		kind = "full"
	}
	a.m.scans.WithLabelValues(kind).Inc()
	return full
}

// checkRun is one Check under way.
type checkRun struct {
	a        *Ager
	full     bool
	rep      AgeReport
	firstErr error
	listings uint64 // folders listed
	stats    uint64 // files stat'ed
	ranks    []openRank
}

// note counts an error and keeps the first.
func (c *checkRun) note(err error) {
	if c.firstErr == nil {
		c.firstErr = err
	}
	a := c.a
	a.mu.Lock()
	a.stats.Errors++
	a.stats.LastError = err
	a.mu.Unlock()
	a.m.errors.Inc()
}

// count adds the check's listings and stats to the ager's.
func (c *checkRun) count() {
	c.a.mu.Lock()
	c.a.stats.DirListings += c.listings
	c.a.stats.FileStats += c.stats
	c.a.mu.Unlock()
}

func (c *checkRun) closeRanks() {
	for _, r := range c.ranks {
		unix.Close(r.fd)
	}
}

// indexJobs lists the root again if it changed (or the check is full),
// adding new job folders to the index and dropping gone ones. It reports
// whether the check can go on.
func (c *checkRun) indexJobs(rootfd int) bool {
	a := c.a
	var st unix.Stat_t
	if err := unix.Fstat(rootfd, &st); err != nil {
		c.note(fmt.Errorf("trace: ager: stat %s: %w", a.cfg.Root, err))
		return false
	}
	if !c.full && !a.root.changed(&st) {
		return true
	}
	c.listings++
	ents, err := listDir(rootfd, a.cfg.Root)
	if err != nil {
		c.note(fmt.Errorf("trace: ager: %w", err))
		return false
	}
	a.root = dirState{mtime: st.Mtim.Nano(), listedAt: time.Now().UnixNano()}
	seen := map[string]bool{}
	for _, e := range ents {
		if e.IsDir() && ValidateJob(e.Name()) == nil {
			seen[e.Name()] = true
			if a.jobs[e.Name()] == nil {
				a.jobs[e.Name()] = &jobIndex{ranks: map[string]*rankIndex{}, dirState: dirState{mtime: -1}}
			}
		}
	}
	for j := range a.jobs {
		if !seen[j] {
			delete(a.jobs, j)
		}
	}
	return true
}

// indexRanks opens every job's rank folders, keeping them in c.ranks, and
// brings their file indexes up to date: a changed folder is listed again,
// an unchanged one has only its newest file stat'ed.
func (c *checkRun) indexRanks(rootfd int) {
	a := c.a
	for _, job := range slices.Sorted(maps.Keys(a.jobs)) {
		ji := a.jobs[job]
		jobPath := filepath.Join(a.cfg.Root, job)
		jobfd, err := openDirAt(rootfd, a.cfg.Root, job)
		if err != nil {
			delete(a.jobs, job) // gone, or replaced by a symlink: not ours to age
			if !errors.Is(err, unix.ENOENT) && !errors.Is(err, ErrPath) {
				c.note(fmt.Errorf("trace: ager: %w", err))
			}
			continue
		}
		c.relistJob(jobfd, jobPath, ji)
		for _, rank := range slices.Sorted(maps.Keys(ji.ranks)) {
			c.indexRank(jobfd, jobPath, ji, rank)
		}
		unix.Close(jobfd)
	}
}

// relistJob lists a job folder again if it changed (or the check is
// full), adding new rank folders to its index and dropping gone ones.
func (c *checkRun) relistJob(jobfd int, jobPath string, ji *jobIndex) {
	var st unix.Stat_t
	if err := unix.Fstat(jobfd, &st); err != nil || (!c.full && !ji.changed(&st)) {
		return
	}
	c.listings++
	ents, err := listDir(jobfd, jobPath)
	if err != nil {
		c.note(fmt.Errorf("trace: ager: %w", err))
		return
	}
	ji.dirState = dirState{mtime: st.Mtim.Nano(), listedAt: time.Now().UnixNano()}
	seen := map[string]bool{}
	for _, e := range ents {
		if _, ok := parseRankName(e.Name()); ok && e.IsDir() {
			seen[e.Name()] = true
			if ji.ranks[e.Name()] == nil {
				ji.ranks[e.Name()] = &rankIndex{dirState: dirState{mtime: -1}}
			}
		}
	}
	for r := range ji.ranks {
		if !seen[r] {
			delete(ji.ranks, r)
		}
	}
}

// indexRank opens a rank folder into c.ranks and brings its index up to
// date.
func (c *checkRun) indexRank(jobfd int, jobPath string, ji *jobIndex, rank string) {
	ri := ji.ranks[rank]
	rankPath := filepath.Join(jobPath, rank)
	fd, err := openDirAt(jobfd, jobPath, rank)
	if err != nil {
		delete(ji.ranks, rank)
		if !errors.Is(err, unix.ENOENT) && !errors.Is(err, ErrPath) {
			c.note(fmt.Errorf("trace: ager: %w", err))
		}
		return
	}
	c.ranks = append(c.ranks, openRank{idx: ri, fd: fd, path: rankPath})
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		c.note(fmt.Errorf("trace: ager: stat %s: %w", rankPath, err))
		return
	}
	if c.full || ri.changed(&st) {
		c.listings++
		n, err := ri.relist(fd, rankPath, st.Mtim.Nano())
		c.stats += n
		if err != nil {
			c.note(fmt.Errorf("trace: ager: %w", err))
		}
	} else if len(ri.files) > 0 {
		c.stats++
		ri.restatNewest(fd)
	}
}

// age deletes files, a pass of planAging at a time, until the record
// bytes are within the budget or no pass deletes anything, and sets the
// report's figures.
func (c *checkRun) age() {
	a := c.a
	total, files := int64(0), 0
	for _, r := range c.ranks {
		for _, f := range r.idx.files {
			total += f.size
			files++
		}
	}
	for total > a.cfg.BudgetBytes {
		plan := planAging(c.ranks, a.cfg.DeleteFraction, a.cfg.KeepPerRank)
		if len(plan) == 0 {
			break
		}
		for _, d := range plan {
			r := c.ranks[d.rank]
			f := r.idx.files[d.file]
			gone, err := deleteRecordFile(r.fd, f)
			if err != nil {
				c.note(fmt.Errorf("trace: ager: delete %s: %w", filepath.Join(r.path, f.name), err))
			}
			if gone {
				total -= f.size
				files--
				if err == nil {
					c.rep.DeletedFiles++
					c.rep.DeletedBytes += f.size
					a.cfg.Logger.Debug("trace: aged", "file", filepath.Join(r.path, f.name), "bytes", f.size)
				}
			}
			r.idx.files[d.file].name = "" // removed below
		}
		progress := false
		for _, r := range c.ranks {
			n := len(r.idx.files)
			r.idx.files = slices.DeleteFunc(r.idx.files, func(f fileEntry) bool { return f.name == "" })
			progress = progress || len(r.idx.files) < n
		}
		if !progress {
			break
		}
	}
	c.rep.Bytes, c.rep.Files = total, files
}

func (a *Ager) publish(rep *AgeReport) {
	a.mu.Lock()
	a.stats.Bytes, a.stats.Files = rep.Bytes, rep.Files
	a.stats.DeletedFiles += uint64(rep.DeletedFiles)
	a.stats.DeletedBytes += uint64(rep.DeletedBytes)
	a.mu.Unlock()
	a.m.bytes.Set(float64(rep.Bytes))
	a.m.deletedFiles.Add(float64(rep.DeletedFiles))
	a.m.deletedBytes.Add(float64(rep.DeletedBytes))
	if rep.DeletedFiles > 0 {
		a.cfg.Logger.Info("trace: aged record files", "root", a.cfg.Root, "files", rep.DeletedFiles,
			"bytes", rep.DeletedBytes, "left", rep.Bytes, "budget", a.cfg.BudgetBytes)
	}
}

// relist reads the rank folder's record files anew. It returns how many
// files it stat'ed.
func (ri *rankIndex) relist(fd int, path string, mtime int64) (uint64, error) {
	ents, err := listDir(fd, path)
	if err != nil {
		return 0, err
	}
	ri.dirState = dirState{mtime: mtime, listedAt: time.Now().UnixNano()}
	ri.files = ri.files[:0]
	var n uint64
	for _, e := range ents {
		if !IsRecordFileName(e.Name()) || !e.Type().IsRegular() {
			continue // symlinks, folders and foreign files are not ours
		}
		n++
		if f, ok := statRecordFile(fd, e.Name()); ok {
			ri.files = append(ri.files, f)
		}
	}
	slices.SortFunc(ri.files, func(a, b fileEntry) int { return recordNameCmp(a.name, b.name) })
	return n, nil
}

// restatNewest updates the size of the rank's newest file, the only one a
// writer appends to.
func (ri *rankIndex) restatNewest(fd int) {
	last := len(ri.files) - 1
	if f, ok := statRecordFile(fd, ri.files[last].name); ok {
		ri.files[last] = f
	} else {
		ri.files = ri.files[:last]
	}
}

func statRecordFile(dirfd int, name string) (fileEntry, bool) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fileEntry{}, false
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fileEntry{}, false
	}
	return fileEntry{name: name, size: st.Size, mtime: st.Mtim.Nano(), ino: st.Ino}, true
}

// deleteRecordFile unlinks f if it is still the regular file indexed. It
// reports whether f is gone.
func deleteRecordFile(dirfd int, f fileEntry) (bool, error) {
	cur, ok := statRecordFile(dirfd, f.name)
	if !ok || cur.ino != f.ino {
		return true, nil // gone, or replaced by something that is not ours
	}
	if err := unix.Unlinkat(dirfd, f.name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return false, err
	}
	return true, nil
}

type deletion struct{ rank, file int }

// planAging picks, in each rank folder, the oldest ceil(frac*n) files by
// modification time (name breaking ties), keeping at least keep.
func planAging(ranks []openRank, frac float64, keep int) []deletion {
	var plan []deletion
	for ri, r := range ranks {
		n := len(r.idx.files)
		k := min(int(math.Ceil(frac*float64(n))), n-keep)
		if k <= 0 {
			continue
		}
		idx := make([]int, n)
		for i := range idx {
			idx[i] = i
		}
		files := r.idx.files
		slices.SortFunc(idx, func(a, b int) int {
			if c := cmp.Compare(files[a].mtime, files[b].mtime); c != 0 {
				return c
			}
			return recordNameCmp(files[a].name, files[b].name)
		})
		for _, i := range idx[:k] {
			plan = append(plan, deletion{ri, i})
		}
	}
	return plan
}
