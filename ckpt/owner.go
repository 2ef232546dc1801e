package ckpt

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// OwnerConfig configures an Owner. The zero value of each field is a
// documented default, except Shards and Capacity, which are required.
type OwnerConfig struct {
	// ShmDir holds the segments; default /dev/shm.
	ShmDir string
	// Name prefixes the segment files (SegmentPath); default
	// "faultline-ckpt". Give each job on a node its own.
	Name string
	// Shards are the shards this node holds, one segment each (say, one per
	// local rank).
	Shards []int
	// NumShards is the number of shards of the job; default the largest of
	// Shards plus one.
	NumShards int
	// Capacity is the size of a half in bytes: the largest step of one
	// shard, its blob table included. layout.StepSize computes it. A segment
	// takes 2*Capacity + 4 KiB of shared memory. An existing segment with
	// smaller halves is grown to it, keeping its steps; a larger one is
	// kept. A save of a larger step grows the segment (Writer.Save).
	Capacity int64

	// Dir is the disk tier; "" leaves steps in memory only.
	Dir string
	// Retention applies after each commit by the default committer.
	Retention Retention
	// Committer learns of durable shards; default a LocalCommitter on Dir.
	Committer Committer
	// OnCommit, if set, is called after the default committer commits.
	OnCommit func(layout.StepManifest)
	// PollInterval is how often Run looks for new saves to seal and
	// replicate and for persist requests; default 100ms. A save stays
	// unsealed (its CRCs unknown) for up to about this long.
	PollInterval time.Duration
	// Workers is the number of goroutines that seal a step and copy a
	// load; default GOMAXPROCS.
	Workers int

	// Node names this node among Peers.
	Node string
	// ListenAddr is the TCP address on which Run serves peers' replicas;
	// "" serves none.
	ListenAddr string
	// Peers maps each node of the job to the address of its replica
	// server (its ListenAddr as the others reach it); Owner.SetPeers
	// replaces it while the owner runs. Empty: no replicas.
	Peers map[string]string
	// Domains maps nodes to failure domains (the ASW above them) so that
	// replicas go to another domain; nil: any peer.
	Domains map[string]string
	// Replicas is the number of peers that receive each shard; default 1,
	// negative for none.
	Replicas int
	// IOTimeout bounds a stalled replica transfer; default 30s.
	IOTimeout time.Duration
	// ReplicaKey is the secret that replica transfers prove they hold,
	// both ways, before any shard byte moves (HMAC-SHA256 over each side's
	// fresh nonce, version 3 of the protocol in replicawire.go): give every
	// node of a job the same one, such as a key derived from the control
	// plane's token, and no one without it reads or writes a shard through
	// ListenAddr, nor plays a recorded transfer again. A peer that holds
	// another key, or none, is refused (ErrRefused) and counted. nil:
	// none, and anyone who reaches ListenAddr may put or get a shard.
	// Keys shorter than 16 bytes are refused.
	ReplicaKey []byte

	Registerer     prometheus.Registerer // nil: metrics off
	TracerProvider trace.TracerProvider  // nil: no spans
	Logger         *slog.Logger          // nil: silent
}

// Validate reports the first invalid field.
func (c OwnerConfig) Validate() error {
	switch {
	case len(c.Shards) == 0:
		return errors.New("ckpt: OwnerConfig.Shards is empty")
	case c.Capacity <= 0 || c.Capacity > layout.MaxHalfSize:
		return fmt.Errorf("ckpt: OwnerConfig.Capacity is %d, want 1..%d", c.Capacity, int64(layout.MaxHalfSize))
	case c.NumShards < 0 || c.NumShards > layout.MaxShards:
		return fmt.Errorf("ckpt: OwnerConfig.NumShards is %d, want 0..%d", c.NumShards, layout.MaxShards)
	case strings.ContainsRune(c.Name, '/'):
		return fmt.Errorf("ckpt: OwnerConfig.Name %q holds a slash", c.Name)
	case c.PollInterval < 0:
		return fmt.Errorf("ckpt: OwnerConfig.PollInterval is %v, want >= 0", c.PollInterval)
	case c.Workers < 0:
		return fmt.Errorf("ckpt: OwnerConfig.Workers is %d, want >= 0", c.Workers)
	case c.IOTimeout < 0:
		return fmt.Errorf("ckpt: OwnerConfig.IOTimeout is %v, want >= 0", c.IOTimeout)
	case len(c.Peers) > 0 && c.Node == "":
		return errors.New("ckpt: OwnerConfig.Node is empty but Peers is set")
	case len(c.ReplicaKey) > 0 && len(c.ReplicaKey) < minKeySize:
		return fmt.Errorf("ckpt: OwnerConfig.ReplicaKey has %d bytes, want none or at least %d", len(c.ReplicaKey), minKeySize)
	}
	seen := map[int]bool{}
	for i, s := range c.Shards {
		if s < 0 || s >= layout.MaxShards || (c.NumShards > 0 && s >= c.NumShards) {
			return fmt.Errorf("ckpt: OwnerConfig.Shards[%d] is %d, want 0..%d", i, s, max(c.NumShards, layout.MaxShards)-1)
		}
		if seen[s] {
			return fmt.Errorf("ckpt: OwnerConfig.Shards[%d]: shard %d listed twice", i, s)
		}
		seen[s] = true
	}
	return nil
}

func (c OwnerConfig) withDefaults() OwnerConfig {
	c.ShmDir = cmp.Or(c.ShmDir, "/dev/shm")
	c.Name = cmp.Or(c.Name, "faultline-ckpt")
	if c.NumShards == 0 {
		c.NumShards = slices.Max(c.Shards) + 1
	}
	c.PollInterval = cmp.Or(c.PollInterval, 100*time.Millisecond)
	c.Replicas = cmp.Or(c.Replicas, 1)
	c.IOTimeout = cmp.Or(c.IOTimeout, 30*time.Second)
	c.ReplicaKey = bytes.Clone(c.ReplicaKey)
	return c
}

// minKeySize is the shortest OwnerConfig.ReplicaKey.
const minKeySize = 16

// Owner is the node agent's side of the memory tier. It creates and keeps
// one segment per local shard (so that a trainer's death loses nothing it
// saved), seals each new save (computes the CRCs of its blobs), persists
// steps to disk when writers ask or when the trainer dies, copies them to
// peers, holds peers' copies, and loads by preference: memory, then
// replica, then disk.
type Owner struct {
	cfg       OwnerConfig
	segs      map[int]*segment
	committer Committer
	m         *ownerMetrics
	tracer    trace.Tracer
	log       *slog.Logger
	ln        net.Listener
	peers     atomic.Pointer[peerSet] // OwnerConfig.Peers, then SetPeers's

	// ops is held for reading by every operation that touches a segment,
	// and for writing by Close, which unmaps them.
	ops     sync.RWMutex
	closed  bool
	closing chan struct{}
	running sync.Mutex // held by Run until it returns

	mu       sync.Mutex
	replicas map[int]*replicaSlot // peers' shards held here
	conns    map[net.Conn]bool

	persisting sync.Map // shard -> *sync.Mutex: one persist per shard at a time
	sealing    sync.Map // shard -> *sync.Mutex: one sealer per shard at a time
	verified   sync.Map // halfKey -> halfVersion: the version of a half whose CRCs held
	sent       sync.Map // shard -> sentSeqs: the saves peers took last
	lagging    sync.Map // shard -> true: its replicas do not keep up with its saves (noteLag)
	failed     sync.Map // shard -> error: the persist Run took up last failed (PersistFailure)
}

// NewOwner creates (or reopens, keeping their steps) the segments of
// cfg.Shards and, if cfg.ListenAddr is set, listens for peers.
func NewOwner(cfg OwnerConfig) (*Owner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	m, err := newOwnerMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	o := &Owner{
		cfg:      cfg,
		segs:     map[int]*segment{},
		m:        m,
		tracer:   tracerOf(cfg.TracerProvider),
		log:      loggerOf(cfg.Logger),
		closing:  make(chan struct{}),
		replicas: map[int]*replicaSlot{},
		conns:    map[net.Conn]bool{},
	}
	o.peers.Store(newPeerSet(cfg.Node, cfg.Peers, cfg.Domains, 0))
	o.committer = cfg.Committer
	if o.committer == nil && cfg.Dir != "" {
		o.committer = &LocalCommitter{Dir: cfg.Dir, Retention: cfg.Retention, OnCommit: o.onCommit}
	}
	if cfg.Dir != "" {
		if err := os.MkdirAll(cfg.Dir, 0o750); err != nil {
			o.m.reg.UnregisterAll()
			return nil, fmt.Errorf("ckpt: disk tier: %w", err)
		}
	}
	o.sweep()
	for _, s := range cfg.Shards {
		seg, err := createSegment(SegmentPath(cfg.ShmDir, cfg.Name, s), s, 0, cfg.Capacity)
		if err != nil {
			o.m.reg.UnregisterAll()
			o.unmapAll()
			return nil, err
		}
		o.segs[s] = seg
	}
	if cfg.ListenAddr != "" {
		ln, err := net.Listen("tcp", cfg.ListenAddr)
		if err != nil {
			o.m.reg.UnregisterAll()
			o.unmapAll()
			return nil, fmt.Errorf("ckpt: replica server: %w", err)
		}
		o.ln = ln
	}
	return o, nil
}

// sweep removes what a killed predecessor left half made for this node's
// shards: temporary segment files and, if it serves replicas, the larger
// replica segments of cut transfers in ShmDir, and temporary shard files
// in the step directories. Other nodes' files, on a shared disk, are left
// alone, and so are the replicas that another owner of the node (one per
// local shard, say) may be receiving.
func (o *Owner) sweep() {
	var globs []string
	if o.cfg.ListenAddr != "" {
		globs = append(globs, filepath.Join(o.cfg.ShmDir, o.cfg.Name+"-replica-*.next"))
	}
	for _, s := range o.cfg.Shards {
		globs = append(globs, filepath.Join(o.cfg.ShmDir, "."+filepath.Base(o.SegmentPath(s))+".tmp-*"))
		if o.cfg.Dir != "" {
			globs = append(globs,
				filepath.Join(o.cfg.Dir, "*", "."+layout.ShardFile(s)+".tmp-*"),
				filepath.Join(o.cfg.Dir, "*", "."+layout.ShardManifestFile(s)+".tmp-*"))
		}
	}
	for _, g := range globs {
		names, _ := filepath.Glob(g)
		for _, n := range names {
			if err := os.Remove(n); err == nil {
				o.log.Info("ckpt: removed a leftover temporary file", "path", n)
			}
		}
	}
}

func (o *Owner) onCommit(m layout.StepManifest, removed []int64) {
	o.m.commits.Inc()
	o.log.Info("ckpt: step committed", "step", m.Step, "shards", len(m.Shards), "dir", o.cfg.Dir, "retention_removed", removed)
	if o.cfg.OnCommit != nil {
		o.cfg.OnCommit(m)
	}
}

// SegmentPath is the segment of a local shard, for its writer.
func (o *Owner) SegmentPath(shard int) string { return SegmentPath(o.cfg.ShmDir, o.cfg.Name, shard) }

// Addr is the address the replica server listens on, or nil.
func (o *Owner) Addr() net.Addr {
	if o.ln == nil {
		return nil
	}
	return o.ln.Addr()
}

// acquire guards an operation against Close, having first mapped anew
// the segments that a writer grew (replaced under their names).
func (o *Owner) acquire() error {
	o.ops.RLock()
	if o.closed {
		o.ops.RUnlock()
		return fmt.Errorf("ckpt: owner: %w", errClosed)
	}
	if !slices.ContainsFunc(o.cfg.Shards, func(s int) bool { return o.segs[s].replaced() }) {
		return nil
	}
	o.ops.RUnlock()
	o.ops.Lock()
	err := o.remap()
	o.ops.Unlock()
	if err != nil {
		return err
	}
	return o.acquire()
}

// remap maps anew the segments whose paths name other files now. The
// caller holds ops for writing.
func (o *Owner) remap() error {
	if o.closed {
		return nil // acquire says so
	}
	for _, shard := range o.cfg.Shards {
		old := o.segs[shard]
		if !old.replaced() {
			continue
		}
		seg, err := openSegment(old.path, false)
		if err == nil && (seg.hdr.Shard != shard || seg.hdr.Flags != 0 || seg.writable() != nil) {
			seg.close()
			err = fmt.Errorf("ckpt: segment %s now holds shard %d with flags %d, layout version %d: remove it, and restart the owner to create it again",
				old.path, seg.hdr.Shard, seg.hdr.Flags, seg.hdr.Version)
		}
		if err != nil {
			return fmt.Errorf("ckpt: map the grown segment of shard %d: %w", shard, err)
		}
		// Pins belong to this owner, which holds none on the new file.
		o.log.Info("ckpt: segment grown", "shard", shard, "half_size", seg.hdr.HalfSize, "was", old.hdr.HalfSize)
		old.close()
		o.segs[shard] = seg
		o.forget(shard)
	}
	return nil
}

func (o *Owner) seg(shard int) (*segment, error) {
	s, ok := o.segs[shard]
	if !ok {
		return nil, fmt.Errorf("ckpt: shard %d is %w (local: %v)", shard, errNotLocal, o.cfg.Shards)
	}
	return s, nil
}

// Run serves until ctx is done or Close is called: it seals new saves,
// persists the steps writers ask for, copies new saves to peers, and
// serves peers' replica transfers. It returns nil after a Close, else
// ctx's error.
func (o *Owner) Run(ctx context.Context) error {
	if !o.running.TryLock() {
		return errors.New("ckpt: Owner.Run called twice")
	}
	defer o.running.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel() // first, so that a connection accepted from now on is dropped
		if o.ln != nil {
			o.ln.Close()
			o.closeConns()
		}
		wg.Wait()
	}()
	if o.ln != nil {
		wg.Go(func() { o.serve(ctx, &wg) })
	}

	lastPersist := map[int]uint64{}
	type tried struct{ seq, peers uint64 } // a save, sent to the peers of a SetPeers
	lastReplica := map[int]tried{}
	var busy sync.Map // "p3", "r3": a goroutine works on it
	start := func(key string, f func()) {
		if _, running := busy.LoadOrStore(key, true); running {
			return
		}
		wg.Go(func() { defer busy.Delete(key); f() })
	}
	// poll reads the segments' header words, which fault if a segment
	// file was cut short under its mapping: that is logged, once, and
	// polling goes on.
	lastFault := ""
	// A sealed save is replicated at once, not a poll later: the replica
	// then lags the save by its transfer alone.
	sealed := make(chan struct{}, 1)
	poll := func() (err error) {
		defer recoverFault(&err, debug.SetPanicOnFault(true))
		for _, shard := range o.cfg.Shards {
			seg := o.segs[shard]
			if seg.unsealed() {
				start(fmt.Sprint("s", shard), func() {
					if err := o.Seal(ctx, shard); err != nil {
						o.log.Error("ckpt: seal failed", "shard", shard, "err", err)
						return
					}
					select {
					case sealed <- struct{}{}:
					default:
					}
				})
			}
			if req := seg.persistSeq(); req != 0 && req != lastPersist[shard] && o.cfg.Dir != "" {
				if _, running := busy.Load(fmt.Sprint("p", shard)); !running {
					lastPersist[shard] = req
					start(fmt.Sprint("p", shard), func() { o.persistRequest(ctx, shard, req) })
				}
			}
			if ps := o.peers.Load(); len(ps.targets(o.cfg.Replicas)) > 0 {
				if i := o.replicaHalf(seg); i >= 0 {
					if t := (tried{seg.seq(i), ps.gen}); t != lastReplica[shard] {
						if _, running := busy.Load(fmt.Sprint("r", shard)); !running {
							lastReplica[shard] = t
							start(fmt.Sprint("r", shard), func() {
								err := o.Replicate(ctx, shard)
								switch {
								case errors.Is(err, ErrSuperseded):
									o.log.Info("ckpt: replication given up for a newer save", "shard", shard, "err", err)
								case err != nil:
									o.log.Warn("ckpt: replication incomplete", "shard", shard, "err", err)
								}
							})
						}
					}
				}
			}
		}
		return nil
	}
	t := time.NewTicker(o.cfg.PollInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-o.closing:
			return nil
		case <-t.C:
		case <-sealed:
		}
		if o.acquire() != nil {
			return nil
		}
		err := poll()
		o.ops.RUnlock()
		switch {
		case err == nil:
			lastFault = ""
		case err.Error() != lastFault:
			lastFault = err.Error()
			o.log.Error("ckpt: cannot read a segment", "err", err)
		}
	}
}

// Grow gives shard's segment halves of at least halfSize bytes, keeping
// its steps: a smaller segment is replaced by a larger one (growing, in
// the FORMAT section), which writers map on their next save. It returns
// the half size. A node agent calls it when a writer that does not grow
// segments itself (one outside Go) asks for room for a larger step.
func (o *Owner) Grow(shard int, halfSize int64) (int64, error) {
	if halfSize <= 0 || halfSize > layout.MaxHalfSize {
		return 0, fmt.Errorf("ckpt: grow shard %d: half size %d, want 1..%d", shard, halfSize, int64(layout.MaxHalfSize))
	}
	o.ops.Lock()
	defer o.ops.Unlock()
	if o.closed {
		return 0, fmt.Errorf("ckpt: owner: %w", errClosed)
	}
	if _, err := o.seg(shard); err != nil {
		return 0, err
	}
	for {
		if err := o.remap(); err != nil {
			return 0, err
		}
		seg := o.segs[shard]
		if seg.hdr.HalfSize >= halfSize {
			return seg.hdr.HalfSize, nil
		}
		g, err := seg.grow(halfSize, 2)
		if errors.Is(err, errReplaced) {
			continue
		}
		if err != nil {
			return 0, err
		}
		o.log.Info("ckpt: segment grown", "shard", shard, "half_size", g.hdr.HalfSize, "was", seg.hdr.HalfSize)
		seg.close()
		o.segs[shard] = g
		o.forget(shard)
	}
}

// Persist writes shard's newest intact step in memory to disk, sealing it
// first if its owner has not yet, and tells the committer. It returns the
// shard's manifest. A step committed already is read back from disk and
// kept if intact, or written again from memory if damaged (the Logger
// says which); one committed with other content than memory's is an
// error that keeps the committed one. It is what Run does when a writer
// asks; call it directly to persist on a control-plane command.
func (o *Owner) Persist(ctx context.Context, shard int) (layout.ShardManifest, error) {
	return o.persist(ctx, shard, -1)
}

// persistRequest persists the save with seq req that a writer asked for
// (persist_seq), and clears the request once done with it: persisted, or
// failed, or gone (a newer request superseded it, so that the writer was
// free to write over it). The step persisted is the one asked for, never
// a newer one: a job commits the steps its ranks asked for.
func (o *Owner) persistRequest(ctx context.Context, shard int, req uint64) {
	o.failed.Delete(shard)
	_, err := o.persistHalf(ctx, shard, func(m layout.StepMeta) bool { return m.Seq == req }, fmt.Sprintf("of save %d (the one asked for)", req))
	if ctx.Err() != nil {
		return // the next owner finds the request and persists it
	}
	if err != nil {
		o.log.Error("ckpt: persist failed", "shard", shard, "seq", req, "err", err)
		o.failed.Store(shard, fmt.Errorf("ckpt: the persist of shard %d's save %d: %w", shard, req, err))
	}
	if err := o.acquire(); err == nil {
		o.segs[shard].donePersist(req)
		o.ops.RUnlock()
	}
}

// PersistFailure returns why the newest persist of shard that its writer
// asked for and the owner took up failed, nil when it succeeded or is
// under way: a caller waiting for the step to commit need not wait on.
func (o *Owner) PersistFailure(shard int) error {
	if err, ok := o.failed.Load(shard); ok {
		return err.(error)
	}
	return nil
}

// Flush returns once the owner is done with every persist its writers
// asked for (persist_seq): those Run took up, and those it has not yet
// (Flush persists them itself when Run is not running). A node agent
// calls it before it lets its trainers' job end, so that the last step
// asked for reaches the disk. It returns ctx's error if ctx ends first,
// naming the shards still waiting.
func (o *Owner) Flush(ctx context.Context) error {
	if o.cfg.Dir == "" {
		return nil
	}
	pending := func() (shards []int, reqs []uint64, err error) {
		if err := o.acquire(); err != nil {
			return nil, nil, err
		}
		defer o.ops.RUnlock()
		defer recoverFault(&err, debug.SetPanicOnFault(true))
		for _, s := range o.cfg.Shards {
			if req := o.segs[s].persistSeq(); req != 0 {
				shards, reqs = append(shards, s), append(reqs, req)
			}
		}
		return shards, reqs, nil
	}
	t := time.NewTicker(o.cfg.PollInterval)
	defer t.Stop()
	for {
		shards, reqs, err := pending()
		if err != nil || len(shards) == 0 {
			return err
		}
		if o.running.TryLock() {
			// No Run to take them up: persist them here, shards in parallel.
			var wg sync.WaitGroup
			for i, s := range shards {
				wg.Go(func() { o.persistRequest(ctx, s, reqs[i]) })
			}
			wg.Wait()
			o.running.Unlock()
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("ckpt: flush: shards %v still wait for their persist: %w", shards, err)
			}
			continue
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("ckpt: flush: shards %v still wait for their persist: %w", shards, ctx.Err())
		case <-t.C:
		}
	}
}

// PersistStep is Persist of a given step of shard, from the half that
// holds it: what a node agent calls to persist the newest step that every
// rank of the node holds, when each rank has an owner of its own.
func (o *Owner) PersistStep(ctx context.Context, shard int, step int64) (layout.ShardManifest, error) {
	if step < 0 {
		return layout.ShardManifest{}, fmt.Errorf("ckpt: persist shard %d: step %d is negative", shard, step)
	}
	return o.persist(ctx, shard, step)
}

func (o *Owner) persist(ctx context.Context, shard int, step int64) (layout.ShardManifest, error) {
	return o.persistHalf(ctx, shard, func(m layout.StepMeta) bool { return step < 0 || m.Step == step }, stepDesc(step))
}

// persistHalf persists the newest intact half of shard whose meta want
// accepts; what names such a step in errors.
func (o *Owner) persistHalf(ctx context.Context, shard int, want func(layout.StepMeta) bool, what string) (man layout.ShardManifest, err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if o.cfg.Dir == "" {
		return layout.ShardManifest{}, errors.New("ckpt: persist: OwnerConfig.Dir is empty")
	}
	if err := o.acquire(); err != nil {
		return layout.ShardManifest{}, err
	}
	defer o.ops.RUnlock()
	seg, err := o.seg(shard)
	if err != nil {
		return layout.ShardManifest{}, err
	}
	mu, _ := o.persisting.LoadOrStore(shard, &sync.Mutex{})
	mu.(*sync.Mutex).Lock()
	defer mu.(*sync.Mutex).Unlock()

	ctx, span := o.tracer.Start(ctx, "ckpt.Persist", trace.WithAttributes(attribute.Int("ckpt.shard", shard)))
	defer func() {
		if err != nil {
			o.m.persistFailures.Inc()
			if errors.Is(err, layout.ErrCorrupt) {
				o.m.crcFailures.Inc()
			}
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	start := time.Now()
	var why []error
	done := false
	for _, i := range seg.newest() {
		if m, ok := seg.metaOK(i); !ok || !want(m) {
			continue
		}
		var did persisted
		if err = o.sealHalf(ctx, seg, i, nil); err == nil {
			man, did, err = persistHalf(ctx, seg, i, o.cfg.Dir, o.cfg.NumShards)
		}
		switch {
		case err != nil:
		case did == kept:
			o.log.Info("ckpt: step committed already, with an intact disk copy: kept it", "shard", shard, "step", man.Step)
		case did == rewritten:
			o.log.Warn("ckpt: step committed already, with a damaged disk copy: wrote it again from memory", "shard", shard, "step", man.Step, "dir", layout.StepDir(o.cfg.Dir, man.Step))
		}
		if err == nil {
			done = true
			break
		}
		why = append(why, err)
		if ctx.Err() != nil || errors.Is(err, ErrNoSpace) || errors.Is(err, errOtherContent) {
			break
		}
	}
	if !done {
		if len(why) == 0 {
			why = append(why, fmt.Errorf("no complete step %s", what))
		}
		return layout.ShardManifest{}, fmt.Errorf("ckpt: persist shard %d: %w", shard, errors.Join(why...))
	}
	span.SetAttributes(attribute.Int64("ckpt.step", man.Step), attribute.Int64("ckpt.bytes", man.Size))
	o.m.persistSeconds.Observe(time.Since(start).Seconds())
	o.m.persistBytes.Add(float64(man.Size))
	o.log.Info("ckpt: shard persisted", "shard", shard, "step", man.Step, "bytes", man.Size, "took", time.Since(start))
	if o.committer != nil {
		if err := o.committer.ShardDurable(ctx, man); err != nil {
			return man, fmt.Errorf("ckpt: commit step %d: %w", man.Step, err)
		}
	}
	return man, nil
}

func stepDesc(step int64) string {
	if step < 0 {
		return "in memory"
	}
	return fmt.Sprintf("at step %d in memory", step)
}

// PersistNewest persists the newest step that every local shard holds
// intact in memory (every CRC verified, or complete and then sealed), all
// shards in parallel, and returns it: what a node agent calls when its
// trainer dies (save on failure). It returns an error wrapping ErrNoStep
// when the shards agree on no step.
func (o *Owner) PersistNewest(ctx context.Context) (int64, error) {
	if err := o.acquire(); err != nil {
		return -1, err
	}
	steps, err := func() (steps []int64, err error) {
		defer recoverFault(&err, debug.SetPanicOnFault(true))
		steps, _, err = o.intactSteps()
		return steps, err
	}()
	o.ops.RUnlock()
	if err != nil {
		return -1, err
	}
	step := steps[0]
	g, ctx := errgroup.WithContext(ctx)
	for _, s := range o.cfg.Shards {
		g.Go(func() error {
			_, err := o.persist(ctx, s, step)
			return err
		})
	}
	return step, g.Wait()
}

// memorySteps returns the steps shard's segment holds with a valid table,
// newest save first.
func memorySteps(seg *segment) []int64 {
	var steps []int64
	for _, i := range seg.newest() {
		if m, ok := seg.metaOK(i); ok {
			steps = append(steps, m.Step)
		}
	}
	return steps
}

// HeldStep is a step a shard holds intact in memory, and the half of its
// segment that holds it.
type HeldStep struct {
	Step int64
	Half int
}

// Held returns the steps shard holds intact in memory, newest save first,
// and why each other half holds none (nil for an empty half or one being
// written). A sealed step is intact when every CRC holds, and its halves
// are checked once per save: a half that verified is not read again until
// a writer writes it. An unsealed step counts as complete, with nothing
// to check it against. It is what a node agent asks of each local shard,
// all shards in parallel, when the job chooses a step to resume from.
func (o *Owner) Held(shard int) (held []HeldStep, why []error, err error) {
	if err := o.acquire(); err != nil {
		return nil, nil, err
	}
	defer o.ops.RUnlock()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if _, err := o.seg(shard); err != nil {
		return nil, nil, err
	}
	held, why = o.intactHalves(shard)
	return held, why, nil
}

// intactHalves is Held for a caller that holds ops.
func (o *Owner) intactHalves(shard int) (held []HeldStep, why []error) {
	seg := o.segs[shard]
	for _, i := range []int{0, 1} {
		m, ok := seg.metaOK(i)
		if !ok {
			if st := seg.state(i); st != layout.StateEmpty && st != layout.StateWriting {
				if err := seg.whyNot(i); err != nil {
					why = append(why, fmt.Errorf("memory shard %d: %w", shard, err))
				}
			}
			continue
		}
		key, version := halfKey{shard, i, false}, halfVersion{seg.gen(i), m.Seq, seg.ino}
		if v, ok := o.verified.Load(key); m.Sealed && (!ok || v != version) {
			if err := verifyHalf(seg, i); err != nil {
				if errors.Is(err, layout.ErrCorrupt) {
					o.m.crcFailures.Inc()
				}
				why = append(why, fmt.Errorf("step %d: memory shard %d: %w", m.Step, shard, err))
				continue
			}
			o.verified.Store(key, version)
		}
		held = append(held, HeldStep{Step: m.Step, Half: i})
	}
	if len(held) == 2 && seg.seq(held[1].Half) > seg.seq(held[0].Half) {
		held[0], held[1] = held[1], held[0]
	}
	return held, why
}

// intactSteps returns the steps every local shard holds intact in memory,
// newest first, or an error that says why there is none, and why each
// newer step was passed over (a half that fails its checks, a step some
// shards lack). See Held for what intact means; loading each of n shards
// does not read every shard n times.
func (o *Owner) intactSteps() (steps []int64, passed []error, err error) {
	var common, some []int64
	var held []string
	for k, shard := range o.cfg.Shards {
		h, why := o.intactHalves(shard)
		passed = append(passed, why...)
		var steps []int64
		for _, hs := range h {
			steps = append(steps, hs.Step)
		}
		slices.Sort(steps)
		held = append(held, fmt.Sprintf("shard %d holds %v", shard, steps))
		some = append(some, steps...)
		if k == 0 {
			common = steps
			continue
		}
		common = slices.DeleteFunc(common, func(x int64) bool { return !slices.Contains(steps, x) })
	}
	// Steps some local shards hold and others lack: each is passed over.
	slices.Sort(some)
	slices.Reverse(some)
	for _, s := range slices.Compact(some) {
		if len(common) > 0 && s <= slices.Max(common) {
			break
		}
		passed = append(passed, fmt.Errorf("step %d: memory: not every local shard holds it intact (%s)", s, strings.Join(held, "; ")))
	}
	if len(common) == 0 {
		return nil, passed, fmt.Errorf("%w in every local shard: %s", ErrNoStep, strings.Join(held, "; "))
	}
	slices.Sort(common)
	slices.Reverse(common)
	return slices.Compact(common), passed, nil
}

// forget drops what is remembered of shard's verified halves.
func (o *Owner) forget(shard int) {
	for i := range 2 {
		o.verified.Delete(halfKey{shard, i, false})
	}
}

// halfKey names a half of a local shard's segment, or of a replica's.
type halfKey struct {
	shard, half int
	replica     bool
}

// halfVersion is what a half held when it was verified: a writer changes
// gen before it touches the half, and seq with each save; a segment
// replaced by a larger one is another file.
type halfVersion struct{ gen, seq, ino uint64 }

// Close stops Run and waits for it to return, waits for the operations in
// flight, unregisters the metrics and unmaps the segments. The steps stay in shared memory for the next owner; Remove
// deletes them. Close is idempotent.
func (o *Owner) Close() error {
	o.mu.Lock()
	select {
	case <-o.closing:
	default:
		close(o.closing)
	}
	o.mu.Unlock()
	if o.ln != nil {
		o.ln.Close()
	}
	o.closeConns()
	o.running.Lock() // held by Run until it returns
	o.running.Unlock()
	o.ops.Lock()
	defer o.ops.Unlock()
	if o.closed {
		return nil
	}
	o.closed = true
	o.m.reg.UnregisterAll()
	return o.unmapAll()
}

func (o *Owner) unmapAll() error {
	var errs []error
	for _, s := range o.segs {
		errs = append(errs, s.close())
	}
	o.mu.Lock()
	for _, r := range o.replicas {
		r.mu.Lock()
		if r.seg != nil {
			errs = append(errs, r.seg.close())
		}
		r.mu.Unlock()
	}
	o.mu.Unlock()
	return errors.Join(errs...)
}

// Remove closes the owner and deletes its segments and the replicas it
// holds from shared memory: what a node agent does when the job ends.
func (o *Owner) Remove() error {
	err := o.Close()
	var errs []error
	for _, s := range o.cfg.Shards {
		if e := os.Remove(o.SegmentPath(s)); e != nil && !errors.Is(e, os.ErrNotExist) {
			errs = append(errs, e)
		}
	}
	// Replicas held for peers, by this owner or an earlier one.
	held, _ := filepath.Glob(filepath.Join(o.cfg.ShmDir, o.cfg.Name+"-replica-*"))
	for _, p := range held {
		if e := os.Remove(p); e != nil && !errors.Is(e, os.ErrNotExist) {
			errs = append(errs, e)
		}
	}
	return errors.Join(append([]error{err}, errs...)...)
}
