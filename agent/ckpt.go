package agent

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/promreg"
)

// checkpoints is the memory tier of the node's ranks: one ckpt.Owner per
// local rank (its shard), made when the rank first asks for its segment
// or when a segment of the job is found in ShmDir, and the job's choice
// of the step to resume from.
type checkpoints struct {
	a         *Agent
	reg       *promreg.Registrar
	abandoned *prometheus.CounterVec

	mu  sync.Mutex
	ctx context.Context // the owners run on it
	dir string          // the job's checkpoint folder; "" until a rank names one
	// adopted: dir is the folder the other nodes name, taken before the
	// node's ranks named one.
	adopted bool
	shards  map[int]*shard // by rank
	starts  map[int]int64  // the step of each start with none agreed, by start count
	loaded  map[int]loader // by rank: its process that loaded once
	peers   map[int]string // every node's replica address, by node
	known   chan struct{}  // closed once peers names another node than this one
	// domains is each node's access switch, where Config.Topology names
	// its host (by node, as the owners key their peers).
	domains map[string]string
	wg      sync.WaitGroup

	hostOnce sync.Once
	hostAddr string

	verified map[diskShard]error // committed shards checked, and what was wrong
}

// loader is a rank's process: its pid and its start (a pid may come again).
type loader struct{ pid, start int }

// shard is the segment of one rank and its owner. Its own lock, not the
// node's, is held while the owner is made or grows the segment, so that
// ranks' segments are made at once, not one after another.
type shard struct {
	mu     sync.Mutex
	owner  *ckpt.Owner
	dir    string // the owner's disk tier
	half   int64
	cancel context.CancelFunc
	done   chan struct{} // closed when the owner's Run returned
}

func newCheckpoints(a *Agent) (*checkpoints, error) {
	c := &checkpoints{a: a, ctx: context.Background(), shards: map[int]*shard{}, starts: map[int]int64{}, loaded: map[int]loader{},
		known: make(chan struct{})}
	// The folder the last run of the node knew, until a rank names one.
	c.dir, c.adopted = a.cfg.ckptDir, a.cfg.ckptDir != ""
	c.reg = promreg.New(a.cfg.Registerer, "agent: Config.Registerer")
	c.abandoned = promauto.With(c.reg).NewCounterVec(prometheus.CounterOpts{
		Name: "faultline_agent_async_saves_abandoned_total",
		Help: "Saves with blocking=False that a rank abandoned because a tensor of the state changed before its copy was done, or the copy failed.",
	}, []string{"rank"})
	if err := c.reg.Err(); err != nil {
		return nil, err
	}
	return c, nil
}

// run sets the context the owners run on.
func (c *checkpoints) run(ctx context.Context) {
	c.mu.Lock()
	c.ctx = ctx
	c.mu.Unlock()
}

// segmentName is the ckpt.OwnerConfig.Name of the job's segments.
func (c *checkpoints) segmentName() string { return "faultline-" + c.a.cfg.Job }

// segmentPath is the path of rank's segment.
func (c *checkpoints) segmentPath(rank int) string {
	return ckpt.SegmentPath(c.a.cfg.ShmDir, c.segmentName(), rank)
}

// setDirLocked fixes the job's checkpoint folder: the first rank to name
// one names it for all.
func (c *checkpoints) setDirLocked(dir string) error {
	if dir == "" {
		return nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("checkpoint dir %q: %w", dir, err)
	}
	switch {
	case c.dir == "" || c.adopted && c.dir != abs:
		// A folder adopted from the other nodes gives way to the one the
		// node's own ranks name: each node may have a folder of its own.
		c.dir, c.adopted = abs, false
	case c.dir == abs:
		c.adopted = false
	default:
		return fmt.Errorf("checkpoint dir %q: the job's ranks already save to %q: one checkpoint folder per job", dir, c.dir)
	}
	return nil
}

// shardOf returns rank's shard, locked, after noting dir as the job's
// checkpoint folder; the caller unlocks it.
func (c *checkpoints) shardOf(rank int, dir string) (*shard, string, error) {
	c.mu.Lock()
	if err := c.setDirLocked(dir); err != nil {
		c.mu.Unlock()
		return nil, "", err
	}
	sh := c.shards[rank]
	if sh == nil {
		sh = &shard{}
		c.shards[rank] = sh
	}
	dir = c.dir
	c.mu.Unlock()
	sh.mu.Lock()
	return sh, dir, nil
}

// segment returns rank's segment for dir, with halves of at least bytes
// bytes, making its owner on first use.
func (c *checkpoints) segment(rank int, dir string, bytes int64) (string, int64, error) {
	sh, dir, err := c.shardOf(rank, dir)
	if err != nil {
		return "", 0, err
	}
	defer sh.mu.Unlock()
	if err := c.openLocked(sh, rank, dir, bytes); err != nil {
		return "", 0, err
	}
	if sh.half < bytes {
		half, err := sh.owner.Grow(rank, roundPage(bytes))
		if err != nil {
			return "", 0, fmt.Errorf("rank %d's segment cannot grow to halves of %d bytes: %w", rank, roundPage(bytes), err)
		}
		c.a.log.Info("agent: checkpoint segment grown", "rank", rank, "half_size", half)
		sh.half = half
	}
	return sh.owner.SegmentPath(rank), sh.half, nil
}

// openLocked gives sh an owner whose disk tier is dir, with halves of at
// least bytes, keeping an existing segment (an earlier agent's, or the
// owner's before the job named its folder) and what it holds.
func (c *checkpoints) openLocked(sh *shard, rank int, dir string, bytes int64) error {
	if sh.owner != nil && sh.dir == dir {
		return nil
	}
	c.stopLocked(sh)
	a := c.a
	half := roundPage(max(bytes, 1))
	if h, err := readSegmentHeader(c.segmentPath(rank)); err == nil {
		half = max(half, h.HalfSize)
	}
	numShards := a.world
	if a.cfg.spare() {
		numShards = (a.cfg.Nodes + a.cfg.SpareNodes) * a.cfg.ProcsPerNode // its own ranks follow the job's
	}
	cfg := ckpt.OwnerConfig{ShmDir: a.cfg.ShmDir, Name: c.segmentName(), Shards: []int{rank}, NumShards: numShards,
		Capacity: half, Dir: dir, PollInterval: 20 * time.Millisecond, Workers: 1,
		Registerer: wrapRank(a.cfg.Registerer, rank), Logger: a.log.With("rank", rank)}
	if c.serving() {
		cfg.Node, cfg.Replicas, cfg.ReplicaKey = strconv.Itoa(a.cfg.NodeRank), a.cfg.Replicas, c.replicaKey()
		cfg.ListenAddr = net.JoinHostPort(c.host(), strconv.Itoa(a.cfg.ReplicaPort+c.local(rank)))
		cfg.Peers = c.peersOf(rank)
		c.mu.Lock()
		cfg.Domains = maps.Clone(c.domains)
		c.mu.Unlock()
	}
	if a.cfg.Nodes > 1 && dir != "" {
		cfg.Committer = &jobCommitter{c: c, local: &ckpt.LocalCommitter{Dir: dir}}
	}
	o, err := ckpt.NewOwner(cfg)
	if err != nil {
		return fmt.Errorf("rank %d's checkpoint segment: %w", rank, err)
	}
	c.mu.Lock()
	ctx, cancel := context.WithCancel(c.ctx)
	c.mu.Unlock()
	sh.owner, sh.dir, sh.half, sh.cancel, sh.done = o, dir, half, cancel, make(chan struct{})
	done := sh.done
	c.wg.Go(func() {
		defer close(done)
		if err := o.Run(ctx); err != nil && ctx.Err() == nil {
			a.log.Error("agent: checkpoint owner stopped", "rank", rank, "err", err)
		}
	})
	return nil
}

// stopLocked stops sh's owner and closes it; its segment stays.
func (c *checkpoints) stopLocked(sh *shard) {
	if sh.owner == nil {
		return
	}
	sh.cancel()
	<-sh.done
	sh.owner.Close()
	sh.owner = nil
}

// owner returns rank's owner, making one when the job's segment for rank
// exists (an earlier agent's or process's); nil when rank has none.
func (c *checkpoints) owner(rank int) (*ckpt.Owner, error) {
	sh, dir, err := c.shardOf(rank, "")
	if err != nil {
		return nil, err
	}
	defer sh.mu.Unlock()
	if sh.owner == nil {
		if _, err := os.Stat(c.segmentPath(rank)); err != nil {
			return nil, nil
		}
	}
	if err := c.openLocked(sh, rank, dir, 0); err != nil {
		return nil, err
	}
	return sh.owner, nil
}

// roundPage rounds n up to ckpt's page size.
func roundPage(n int64) int64 { return (n + 4095) &^ 4095 }

// readSegmentHeader reads the header of the segment at path.
func readSegmentHeader(path string) (layout.SegmentHeader, error) {
	f, err := os.Open(path)
	if err != nil {
		return layout.SegmentHeader{}, err
	}
	defer f.Close()
	b := make([]byte, 64)
	if _, err := io.ReadFull(f, b); err != nil {
		return layout.SegmentHeader{}, err
	}
	return layout.ParseSegmentHeader(b)
}

// held returns what each local rank holds intact in memory, by local
// rank, every rank's segment checked at once (each half's CRCs once per
// save: the owners remember what verified).
func (c *checkpoints) held() [][]ckpt.HeldStep {
	out := make([][]ckpt.HeldStep, len(c.a.slots))
	var wg sync.WaitGroup
	for i, s := range c.a.slots {
		wg.Go(func() {
			o, err := c.owner(s.rank)
			if o == nil || err != nil {
				c.a.log.Info("agent: no checkpoint in memory", "rank", s.rank, "err", err)
				return
			}
			h, why, err := o.Held(s.rank)
			if err != nil {
				c.a.log.Info("agent: no checkpoint in memory", "rank", s.rank, "err", err)
				return
			}
			for _, e := range why {
				c.a.log.Info("agent: a half holds no intact step", "rank", s.rank, "err", e)
			}
			out[i] = h
		})
	}
	wg.Wait()
	return out
}

// localSteps returns the steps every local rank holds intact in memory,
// newest first; nil when some rank holds none.
func (c *checkpoints) localSteps() []int64 {
	var common []int64
	for i, h := range c.held() {
		var steps []int64
		for _, hs := range h {
			steps = append(steps, hs.Step)
		}
		if i == 0 {
			common = steps
			continue
		}
		common = slices.DeleteFunc(common, func(st int64) bool { return !slices.Contains(steps, st) })
	}
	slices.Sort(common)
	slices.Reverse(common)
	return slices.Compact(common)
}

// holdings returns what the node holds to resume from: each local rank's
// steps intact in memory, newest first, and the steps committed on disk.
func (c *checkpoints) holdings() (map[int][]int64, []int64) {
	memory := map[int][]int64{}
	for i, h := range c.held() {
		steps := []int64{}
		for _, hs := range h {
			steps = append(steps, hs.Step)
		}
		memory[c.a.slots[i].rank] = steps
	}
	return memory, c.diskSteps()
}

// diskSteps returns the steps committed on disk that every local rank can
// load, newest first.
func (c *checkpoints) diskSteps() []int64 {
	c.mu.Lock()
	dir := c.dir
	c.mu.Unlock()
	if dir == "" {
		return nil
	}
	steps, err := ckpt.CommittedSteps(dir)
	if err != nil {
		c.a.log.Warn("agent: the disk tier's steps are unknown", "dir", dir, "err", err)
	}
	return c.loadable(dir, steps)
}

// loadable returns the steps of steps (committed in dir) whose shards of
// every local rank are intact, and says which are not and why: a step one
// rank cannot load would split the job, that rank starting over while the
// others resume. Each shard of a step is checked once, every CRC: a
// committed step does not change.
func (c *checkpoints) loadable(dir string, steps []int64) []int64 {
	var ok []int64
	for _, st := range steps {
		whole := true
		for _, s := range c.a.slots {
			key := diskShard{dir, st, s.rank}
			c.mu.Lock()
			err, seen := c.verified[key]
			c.mu.Unlock()
			if !seen {
				err = ckpt.VerifyDiskStep(dir, st, s.rank)
				c.mu.Lock()
				if c.verified == nil {
					c.verified = map[diskShard]error{}
				}
				c.verified[key] = err
				c.mu.Unlock()
				switch {
				case errors.Is(err, fs.ErrNotExist):
					// Not on this node's disk (a folder per node, the
					// others' adopted): nothing is wrong.
					c.a.log.Info("agent: a committed step has no shard here", "step", st, "rank", s.rank, "err", err)
				case err != nil:
					c.a.log.Warn("agent: a committed step cannot be loaded", "step", st, "rank", s.rank, "err", err)
					fmt.Fprintf(c.a.cfg.Stderr, "faultline-run: step %d on disk cannot be loaded by rank %d, so no rank resumes from it: %v\n", st, s.rank, err)
				}
			}
			whole = whole && err == nil
		}
		if whole {
			ok = append(ok, st)
		}
	}
	return ok
}

// diskShard names a shard of a committed step.
type diskShard struct {
	dir  string
	step int64
	rank int
}

// adoptDir takes dir, the job's checkpoint folder as the other nodes name
// it, as the node's, unless a rank named one: a node that replaced another
// reads its disk tier there before its ranks start.
func (c *checkpoints) adoptDir(dir string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dir == "" && dir != "" {
		c.dir, c.adopted = dir, true
	}
}

// setPeers takes in the replica address of every node of the job and
// hands each local rank's owner the peers it sends its replicas to.
func (c *checkpoints) setPeers(peers map[int]string) {
	// Every local rank's worker hands the same peers on: the switches are
	// looked up (and said) once for each change.
	c.mu.Lock()
	domains, same := c.domains, c.domains != nil && maps.Equal(peers, c.peers)
	c.mu.Unlock()
	if !same {
		domains = c.domainsOf(peers)
	}
	c.mu.Lock()
	c.peers, c.domains = peers, domains
	shards := maps.Clone(c.shards)
	if len(peers) > 1 || len(peers) == 1 && peers[c.a.cfg.NodeRank] == "" {
		select {
		case <-c.known:
		default:
			close(c.known)
		}
	}
	c.mu.Unlock()
	for rank, sh := range shards {
		sh.mu.Lock()
		if sh.owner != nil {
			if err := sh.owner.SetPeers(c.peersOf(rank), domains); err != nil {
				c.a.log.Warn("agent: replica peers not set", "rank", rank, "err", err)
			}
		}
		sh.mu.Unlock()
	}
}

// domainsOf returns the access switch of each node whose replica
// address is a host Config.Topology lists; nil without a topology. The
// addresses are the IPs the agents reach each other at, so the topology
// must list those (hosts' IPs on bare metal or with host networking).
func (c *checkpoints) domainsOf(peers map[int]string) map[string]string {
	t := c.a.cfg.Topology
	if t == nil {
		return nil
	}
	out := make(map[string]string, len(peers))
	var unknown []string
	for node, addr := range peers {
		host, _, _ := net.SplitHostPort(addr)
		if n, ok := t.Lookup(host); ok {
			out[strconv.Itoa(node)] = n.ASW
		} else {
			unknown = append(unknown, addr)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		c.a.log.Warn("agent: nodes whose address the topology does not list: their switch is unknown, and replicas go to them after the nodes under other switches", "addrs", unknown)
	}
	return out
}

// holdReplicas, on a spare node, starts the owners of its local ranks,
// which run no rank, so that they serve the replicas the job's nodes
// send them.
func (c *checkpoints) holdReplicas(ctx context.Context) {
	if !c.replicating() {
		return
	}
	c.run(ctx)
	for _, s := range c.a.slots {
		if _, _, err := c.segment(s.rank, "", 1); err != nil {
			c.a.log.Warn("agent: a spare holds no replicas", "rank", s.rank, "err", err)
		}
	}
}

// replicating reports whether the node's ranks send replicas to other
// nodes and keep theirs: a node waiting to join the job holds none.
func (c *checkpoints) replicating() bool {
	return c.a.cfg.Nodes > 1 && c.a.cfg.Replicas > 0 && !c.a.cfg.joining
}

// serving reports whether the node's owners serve peers: the replicas,
// and in an elastic job the ranks' own steps, which the ranks of a node
// that joins the job take their state from (Config.Replicas negative
// sends no replica even so).
func (c *checkpoints) serving() bool {
	return c.replicating() || c.a.cfg.Nodes > 1 && c.a.cfg.growable() && !c.a.cfg.joining
}

// local is rank's index among the node's ranks.
func (c *checkpoints) local(rank int) int { return rank - c.a.cfg.NodeRank*c.a.cfg.ProcsPerNode }

// peersOf returns, for rank's owner, the replica server of the rank in
// the same local place on every other node: a node's k-th rank keeps the
// replicas of the other nodes' k-th ranks, so that the owners of a node
// share its replicas' load.
func (c *checkpoints) peersOf(rank int) map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]string{}
	for node, addr := range c.peers {
		host, port, err := net.SplitHostPort(addr)
		p, perr := strconv.Atoi(port)
		if err != nil || perr != nil {
			c.a.log.Warn("agent: a node's replica address is malformed", "node", node, "addr", addr)
			continue
		}
		out[strconv.Itoa(node)] = net.JoinHostPort(host, strconv.Itoa(p+c.local(rank)))
	}
	return out
}

// replicaHoldings returns the steps the node holds intact as replicas of
// other nodes' ranks, by rank.
func (c *checkpoints) replicaHoldings() map[int][]int64 {
	if !c.replicating() {
		return nil
	}
	// A node that took a lost node's place holds replicas before its ranks
	// have segments: its first rank's owner, made now, reads them.
	if held, _ := filepath.Glob(filepath.Join(c.a.cfg.ShmDir, c.segmentName()+"-replica-*")); len(held) > 0 {
		if o, err := c.owner(c.a.slots[0].rank); o == nil && err == nil {
			if _, _, err := c.segment(c.a.slots[0].rank, "", 1); err != nil {
				c.a.log.Warn("agent: the replicas held here are not read", "err", err)
			}
		}
	}
	out := map[int][]int64{}
	for _, s := range c.a.slots {
		o, err := c.owner(s.rank)
		if o == nil || err != nil {
			continue
		}
		held, why, err := o.Replicas()
		if err != nil {
			c.a.log.Info("agent: replicas unknown", "rank", s.rank, "err", err)
			continue
		}
		for _, e := range why {
			c.a.log.Info("agent: a replica holds no intact step", "rank", s.rank, "err", e)
		}
		for r, steps := range held {
			out[r] = append(out[r], steps...)
		}
	}
	// Every owner of the node sees the node's replicas.
	for r, steps := range out {
		slices.Sort(steps)
		slices.Reverse(steps)
		out[r] = slices.Compact(steps)
	}
	return out
}

// replicaAddr is the address of the node's first replica server (its
// k-th rank's owner listens k ports above), "" when it serves none.
func (c *checkpoints) replicaAddr() string {
	if !c.serving() {
		return ""
	}
	return net.JoinHostPort(c.host(), strconv.Itoa(c.a.cfg.ReplicaPort))
}

// host is the node's address as its peers reach it: the one its packets
// to the master leave from.
func (c *checkpoints) host() string {
	c.hostOnce.Do(func() {
		c.hostAddr = "127.0.0.1"
		conn, err := net.Dial("udp", net.JoinHostPort(c.a.cfg.MasterAddr, strconv.Itoa(c.a.cfg.MasterPort)))
		if err != nil {
			c.a.log.Warn("agent: the node's address is unknown; replicas are served on loopback", "err", err)
			return
		}
		defer conn.Close()
		c.hostAddr = conn.LocalAddr().(*net.UDPAddr).IP.String()
	})
	return c.hostAddr
}

// replicaKey is the key the replicas' transfers prove they hold: drawn
// from the control plane's token, for this job; none without a token.
func (c *checkpoints) replicaKey() []byte {
	if c.a.cfg.Security.Token == "" {
		return nil
	}
	m := hmac.New(sha256.New, []byte(c.a.cfg.Security.Token))
	m.Write([]byte("faultline replica key\x00" + c.a.cfg.Job))
	return m.Sum(nil)
}

// stateBytes is the shared memory the node's segments take.
func (c *checkpoints) stateBytes() int64 {
	var n int64
	for _, s := range c.a.slots {
		if h, err := readSegmentHeader(c.segmentPath(s.rank)); err == nil {
			n += h.Size()
		}
	}
	return n
}

// diskStep returns the newest step committed on disk, -1 when none.
func (c *checkpoints) diskStep() int64 {
	c.mu.Lock()
	dir := c.dir
	c.mu.Unlock()
	if dir == "" {
		return -1
	}
	b, err := os.ReadFile(filepath.Join(dir, layout.DLRoverTrackerFile))
	if err != nil {
		return -1
	}
	step, err := layout.ParseStepText(b)
	if err != nil {
		return -1
	}
	return step
}

// owners returns the owners made so far.
func (c *checkpoints) owners() []*ckpt.Owner {
	c.mu.Lock()
	shards := make([]*shard, 0, len(c.shards))
	for _, sh := range c.shards {
		shards = append(shards, sh)
	}
	c.mu.Unlock()
	var out []*ckpt.Owner
	for _, sh := range shards {
		sh.mu.Lock()
		if sh.owner != nil {
			out = append(out, sh.owner)
		}
		sh.mu.Unlock()
	}
	return out
}

// ownerOf returns rank's owner, or an error when it has none.
func (c *checkpoints) ownerOf(rank int) (*ckpt.Owner, error) {
	o, err := c.owner(rank)
	if err == nil && o == nil {
		err = fmt.Errorf("rank %d has no segment", rank)
	}
	return o, err
}

// persistLocal persists the newest step every local rank holds intact in
// memory, every rank's shard at once, and returns it.
func (c *checkpoints) persistLocal(ctx context.Context) (int64, error) {
	steps := c.localSteps()
	if len(steps) == 0 {
		return -1, errors.New("no step that every rank of this node holds intact in memory")
	}
	var wg sync.WaitGroup
	errs := make([]error, len(c.a.slots))
	for i, s := range c.a.slots {
		wg.Go(func() {
			o, err := c.ownerOf(s.rank)
			if err == nil {
				_, err = o.PersistStep(ctx, s.rank, steps[0])
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return steps[0], errors.Join(errs...)
}

// persistWithReplicas persists, besides the node's own shards, the
// replicas it holds of the ranks of the lost nodes, all at the newest step
// that every local rank holds in memory and every one of those ranks as a
// replica here: so that the step commits with the lost nodes' shards too,
// and the next run resumes from it. Without such a step (replicas off, or
// one step behind, or covering other nodes than those lost) it persists
// the node's own newest. It says what it did, and returns an error unless
// that step is committed.
func (c *checkpoints) persistWithReplicas(ctx context.Context, lost []int) (string, error) {
	var others []int
	for _, node := range lost {
		for r := node * c.a.cfg.ProcsPerNode; r < (node+1)*c.a.cfg.ProcsPerNode && r < c.a.world; r++ {
			if l := c.local(r); l < 0 || l >= len(c.a.slots) {
				others = append(others, r)
			}
		}
	}
	replicas := c.replicaHoldings()
	var local []int64
	step := int64(-1)
	if len(others) > 0 {
		local = c.localSteps()
		for _, st := range local {
			if !slices.ContainsFunc(others, func(r int) bool { return !slices.Contains(replicas[r], st) }) {
				step = st
				break
			}
		}
	}
	if step < 0 {
		// The other nodes, if alive, persist their own: the step commits
		// when the last has.
		own, err := c.persistLocal(ctx)
		what := fmt.Sprintf("step %d, the newest every rank here holds in memory, is persisted", own)
		switch {
		case own < 0:
			what = fmt.Sprintf("nothing to persist: %v", err)
		case err != nil:
			what = fmt.Sprintf("step %d, the newest every rank here holds in memory, was not persisted: %v", own, err)
		}
		if len(others) > 0 {
			why := "replicas are off (--replicas -1)"
			if c.replicating() {
				mem, _ := c.holdings()
				var held []string
				for _, s := range c.a.slots {
					held = append(held, fmt.Sprintf("rank %d %v", s.rank, mem[s.rank]))
				}
				for _, r := range others {
					held = append(held, fmt.Sprintf("rank %d's replica %v", r, replicas[r]))
				}
				why = "no step is held both by every rank here and by the replicas held here: " + strings.Join(held, ", ")
			}
			what += fmt.Sprintf("; the shards of ranks %v, of nodes %v, are not: %s", others, lost, why)
		}
		return what, err
	}
	var wg sync.WaitGroup
	errs := make([]error, len(c.a.slots)+len(others))
	for i, s := range c.a.slots {
		wg.Go(func() {
			o, err := c.ownerOf(s.rank)
			if err == nil {
				_, err = o.PersistStep(ctx, s.rank, step)
			}
			errs[i] = err
		})
	}
	for i, r := range others {
		wg.Go(func() {
			// The owner of the local place that r's node sends r's
			// replica to: its lock keeps a transfer from tearing it.
			s := c.a.slots[r%c.a.cfg.ProcsPerNode]
			o, err := c.ownerOf(s.rank)
			if err == nil {
				_, err = o.PersistReplica(ctx, r, step)
			}
			errs[len(c.a.slots)+i] = err
		})
	}
	wg.Wait()
	committed, err := slices.Contains(c.diskSteps(), step), errors.Join(errs...)
	if committed {
		return fmt.Sprintf("step %d, the newest that every rank here holds in memory and the replicas held here hold, is committed with every rank's shard, those of ranks %v from the replicas", step, others), nil
	}
	if err == nil {
		// Every shard here is on disk: another node persisted another
		// step (its newest), or has not said that its shards are.
		err = errors.New("its shards here are persisted, but not every other node's shards of it are")
	}
	return fmt.Sprintf("step %d, the newest that every rank here holds in memory and the replicas held here hold, is not committed on disk (the newest step there is %d): %v", step, c.diskStep(), err),
		fmt.Errorf("step %d not committed: %w", step, err)
}

// flush waits until every persist the ranks asked for (a save with
// StorageType.DISK) is done, as the job ends, and says on the agent's
// output what it waits for and what is committed after.
func (c *checkpoints) flush(ctx context.Context) {
	owners := c.owners()
	if len(owners) == 0 {
		return
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		var wg sync.WaitGroup
		errs := make([]error, len(owners))
		for i, o := range owners {
			wg.Go(func() { errs[i] = o.Flush(ctx) })
		}
		wg.Wait()
		done <- errors.Join(errs...)
	}()
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Second):
		fmt.Fprintf(c.a.cfg.Stderr, "faultline-run: waiting for the checkpoints the ranks asked to persist (StorageType.DISK) to reach %s\n", c.dir)
		err = <-done
	}
	switch {
	case err != nil:
		fmt.Fprintf(c.a.cfg.Stderr, "faultline-run: not every checkpoint asked for reached the disk: %v; newest committed step: %d\n", err, c.diskStep())
	case time.Since(start) > time.Second:
		fmt.Fprintf(c.a.cfg.Stderr, "faultline-run: checkpoints persisted in %v; newest committed step: %d\n", time.Since(start).Round(time.Millisecond), c.diskStep())
	}
}

// persistTimeout bounds the wait, as a job ends, for the persists its
// ranks asked for.
const persistTimeout = 10 * time.Minute

// release gives the node's shared memory back as the job ends, once the
// persists the ranks asked for are done (within ctx and persistTimeout):
// always when it finished, and when it was stopped once the newest step in
// memory is on disk too. Otherwise the segments stay for an agent started
// again with the same job id, which resumes from them, and the last line
// says so.
func (c *checkpoints) release(ctx context.Context, finished bool) {
	ctx, cancel := context.WithTimeout(ctx, persistTimeout)
	c.flush(ctx)
	cancel()
	if !finished {
		steps := c.localSteps()
		if len(steps) > 0 && c.diskStep() < steps[0] {
			glob := filepath.Join(c.a.cfg.ShmDir, c.segmentName()+"-*")
			c.a.log.Info("agent: checkpoint segments kept: their newest step is not on disk", "step", steps[0])
			if c.a.cfg.Nodes > 1 {
				// A new run of several nodes starts from disk, where
				// every node sees the same steps; a node taking its own
				// place in a job still running resumes from memory.
				from := "its start: no step is committed on disk"
				if d := c.diskStep(); d >= 0 {
					from = fmt.Sprintf("step %d, committed on disk", d)
				}
				fmt.Fprintf(c.a.cfg.Stderr, "faultline-run: kept the checkpoint segments %s: they hold step %d; should the job's other nodes run on, a faultline-run started again here as node %d resumes from them; a new run of the job starts from %s; remove them once neither is wanted (rm %s)\n",
					glob, steps[0], c.a.cfg.NodeRank, from, glob)
			} else {
				fmt.Fprintf(c.a.cfg.Stderr, "faultline-run: kept the checkpoint segments %s: they hold step %d, which is not on disk; run the job again with --rdzv-id %s to resume from it, or remove them (rm %s)\n",
					glob, steps[0], c.a.cfg.Job, glob)
			}
			c.close()
			return
		}
	}
	c.mu.Lock()
	shards := c.shards
	c.shards = map[int]*shard{}
	c.mu.Unlock()
	for r, sh := range shards {
		sh.mu.Lock()
		c.stopLocked(sh)
		sh.mu.Unlock()
		if err := os.Remove(c.segmentPath(r)); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.a.log.Warn("agent: checkpoint segment not removed", "rank", r, "err", err)
		}
	}
	// A rank that never asked for a segment in this agent may have one
	// from an earlier one.
	for _, s := range c.a.slots {
		if err := os.Remove(c.segmentPath(s.rank)); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.a.log.Warn("agent: checkpoint segment not removed", "rank", s.rank, "err", err)
		}
	}
	// The replicas the node kept of other nodes' ranks, and copies of them
	// being received when the owners stopped.
	replicas, _ := filepath.Glob(filepath.Join(c.a.cfg.ShmDir, c.segmentName()+"-replica-*"))
	for _, name := range replicas {
		if err := os.Remove(name); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.a.log.Warn("agent: replica not removed", "path", name, "err", err)
		}
	}
}

// close stops the owners; the segments stay for the next agent.
func (c *checkpoints) close() {
	c.mu.Lock()
	shards := c.shards
	c.shards = map[int]*shard{}
	c.mu.Unlock()
	for _, sh := range shards {
		sh.mu.Lock()
		c.stopLocked(sh)
		sh.mu.Unlock()
	}
	c.wg.Wait()
	c.reg.UnregisterAll()
}

// abandon records a save with blocking=False that rank s abandoned.
func (c *checkpoints) abandon(s *slot, step int64, why string) {
	c.abandoned.WithLabelValues(fmt.Sprint(s.rank)).Inc()
	c.a.log.Warn("agent: a rank abandoned a save", "rank", s.rank, "step", step, "why", why)
}

// loadAnswer tells a rank which step to load and where it lies.
type loadAnswer struct {
	Step    int64    `json:"step"`
	Tier    string   `json:"tier"` // memory, disk (copied into the segment first) or none
	Path    string   `json:"path,omitempty"`
	Half    int      `json:"half"`
	Reasons []string `json:"reasons,omitempty"`
}

// load finds the step rank s is to load: at the first load of its
// process, the step the job agreed on when it was started or, at a start
// with none agreed, the newest step every rank holds (on one node, in
// memory; else on disk); at a later load, at, when the rank names the step
// its peers agreed on, else the newest step every local rank holds (a
// rollback without a restart). Memory serves it when a half holds it
// intact; else disk, copied into the segment first, so that the rank
// always reads its segment.
func (c *checkpoints) load(ctx context.Context, s *slot, pid int, dir string, at *int64) (loadAnswer, error) {
	s.mu.Lock()
	resume, gen := s.resume, s.starts
	s.mu.Unlock()
	c.mu.Lock()
	err := c.setDirLocked(dir)
	me := loader{pid, gen}
	again := c.loaded[s.rank] == me && pid != 0
	c.loaded[s.rank] = me
	c.mu.Unlock()
	if err != nil {
		return loadAnswer{}, err
	}
	ans := loadAnswer{Step: -1, Tier: "none", Half: -1}
	want := resume
	switch {
	case at != nil:
		want = *at
	case again:
		want = c.diskStep()
		if steps := c.localSteps(); len(steps) > 0 {
			want = max(want, steps[0])
		}
	case want < 0:
		want = c.startStep(gen)
	}
	if want < 0 {
		ans.Reasons = append(ans.Reasons, "no step in memory that every rank holds, and none committed on disk")
		return ans, nil
	}
	path := c.segmentPath(s.rank)
	h, why := c.findHalf(s.rank, want)
	if h >= 0 {
		return loadAnswer{Step: want, Tier: string(ckpt.TierMemory), Path: path, Half: h}, nil
	}
	ans.Reasons = append(ans.Reasons, "memory: "+why)
	// The owner fetches the step into the segment: from a replica in
	// another node's memory, else from disk; the rank reads its segment.
	if _, _, err := c.segment(s.rank, dir, 1); err != nil {
		return ans, err
	}
	o, err := c.owner(s.rank)
	if err != nil {
		return ans, err
	}
	// A node that replaces a lost one, or joins, fetches from the peers it
	// learns of once it said hello: not before.
	c.awaitPeers(ctx)
	rep, err := o.Restore(ctx, s.rank, want)
	for _, e := range rep.Refused {
		if e.Tier != ckpt.TierMemory {
			ans.Reasons = append(ans.Reasons, e.Error())
		}
	}
	if g := c.a.cfg.grown; errors.Is(err, ckpt.ErrNoStep) && g != nil && g.from >= 0 {
		// A rank of a node that joined the job, with no copy of its own
		// of the step: the state of the rank of its local rank on node
		// from, a data-parallel job's every rank's. A rank that cannot
		// have it fails, saying why, rather than start the job over.
		from := g.from*c.a.cfg.ProcsPerNode + s.local
		if err := c.adopt(ctx, o, s.rank, from, want); err != nil {
			return ans, err
		}
		rep.Tier, err = ckpt.TierReplica, nil
	}
	if err != nil {
		if errors.Is(err, ckpt.ErrNoStep) {
			return ans, nil
		}
		return ans, fmt.Errorf("restore step %d into %s: %w", want, path, err)
	}
	h, why = c.findHalf(s.rank, want)
	if h < 0 {
		return ans, fmt.Errorf("step %d restored into %s from %s, then not found there: %s", want, path, rep.Tier, why)
	}
	return loadAnswer{Step: want, Tier: string(rep.Tier), Path: path, Half: h, Reasons: ans.Reasons}, nil
}

// peersWait bounds how long a rank waits, before it fetches a step from
// the other nodes, for its node to learn their replica servers (node 0
// sends them once the node said hello).
const peersWait = 30 * time.Second

// awaitPeers waits until the node knows another node's replica server,
// in a job that has them, for up to peersWait.
func (c *checkpoints) awaitPeers(ctx context.Context) {
	if !c.serving() {
		return
	}
	t := time.NewTimer(peersWait)
	defer t.Stop()
	select {
	case <-c.known:
	case <-t.C:
		c.a.log.Warn("agent: no other node's replica server known; fetching from none", "waited", peersWait)
	case <-ctx.Done():
	}
}

// adoptWait bounds how long a rank of a node that joined the job waits
// for a peer to serve the state it takes: the peers' owners open as their
// node's run starts, and a rank whose step is on disk only restores it
// first.
const adoptWait = 2 * time.Minute

// adopt makes rank's segment hold step of rank from, fetched from the
// peers, trying again until one serves it or adoptWait has passed.
func (c *checkpoints) adopt(ctx context.Context, o *ckpt.Owner, rank, from int, step int64) error {
	ctx, cancel := context.WithTimeout(ctx, adoptWait)
	defer cancel()
	for {
		err := o.Adopt(ctx, rank, from, step)
		if err == nil {
			c.a.log.Info("agent: a rank of a node that joined took its state from another", "rank", rank, "from", from, "step", step)
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("rank %d of a node that joined the job takes the state of rank %d, whose step %d no node served within %v (check that this node reaches the other nodes' replica servers, --replica-port): %w", rank, from, step, adoptWait, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// heldSteps returns the steps rank holds intact in memory, newest first,
// the newest step committed on disk, and every committed step the node's
// ranks can load: what the rank's peers agree on for a load after the
// first, or a first load the nodes disagreed on (their folders may have
// committed different newest steps, and share an older one).
func (c *checkpoints) heldSteps(rank int) ([]int64, int64, []int64) {
	var steps []int64
	if o, err := c.owner(rank); o != nil && err == nil {
		h, _, _ := o.Held(rank)
		for _, hs := range h {
			steps = append(steps, hs.Step)
		}
	}
	return steps, c.diskStep(), c.diskSteps()
}

// findHalf returns the half of rank's segment that holds step intact, or
// -1 and why none does.
func (c *checkpoints) findHalf(rank int, step int64) (int, string) {
	o, err := c.owner(rank)
	if err != nil {
		return -1, err.Error()
	}
	if o == nil {
		return -1, fmt.Sprintf("rank %d has no segment", rank)
	}
	held, why, err := o.Held(rank)
	if err != nil {
		return -1, err.Error()
	}
	var in []string
	for _, h := range held {
		if h.Step == step {
			return h.Half, ""
		}
		in = append(in, fmt.Sprintf("half %d holds step %d", h.Half, h.Step))
	}
	for _, e := range why {
		in = append(in, e.Error())
	}
	if len(in) == 0 {
		return -1, fmt.Sprintf("step %d is in neither half", step)
	}
	return -1, fmt.Sprintf("step %d is not held intact (%s)", step, strings.Join(in, "; "))
}

// startStep is the step every rank loads at a start with none agreed,
// the same for every rank of that start (gen counts the starts).
func (c *checkpoints) startStep(gen int) int64 {
	c.mu.Lock()
	if st, ok := c.starts[gen]; ok {
		c.mu.Unlock()
		return st
	}
	c.mu.Unlock()
	// The newest step every local rank can load, from memory (on one
	// node: the others' ranks are elsewhere) or disk.
	memory, disk := c.holdings()
	if c.a.cfg.Nodes > 1 && c.a.cfg.Restarts == 0 {
		// A new run of several nodes starts from disk, where every node
		// sees the same steps; one that goes on resized, from the steps
		// its ranks hold in memory (renumbered with them).
		memory = nil
	}
	h := holdings{memory: memory, disk: map[int][]int64{c.a.cfg.NodeRank: disk}, nodeOf: func(int) int { return c.a.cfg.NodeRank }}
	ranks := make([]int, len(c.a.slots))
	for i, s := range c.a.slots {
		ranks[i] = s.rank
	}
	plan, _ := h.choose(ranks)
	st := plan.step
	c.mu.Lock()
	defer c.mu.Unlock()
	if prev, ok := c.starts[gen]; ok {
		return prev
	}
	c.starts[gen] = st
	return st
}

// persistFailure returns why the newest persist a local rank asked for
// failed, nil when none did.
func (c *checkpoints) persistFailure() error {
	c.mu.Lock()
	shards := maps.Clone(c.shards)
	c.mu.Unlock()
	for rank, sh := range shards {
		sh.mu.Lock()
		o := sh.owner
		sh.mu.Unlock()
		if o == nil {
			continue
		}
		if err := o.PersistFailure(rank); err != nil {
			return fmt.Errorf("rank %d's persist here failed: %w", rank, err)
		}
	}
	return nil
}

// wait waits until step (or a newer one) is committed on disk, or a
// local rank's persist fails.
func (c *checkpoints) wait(ctx context.Context, step int64, timeout time.Duration) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if got := c.diskStep(); got >= step {
			return got, nil
		}
		if err := c.persistFailure(); err != nil {
			return c.diskStep(), fmt.Errorf("step %d cannot commit: %w", step, err)
		}
		select {
		case <-ctx.Done():
			return c.diskStep(), fmt.Errorf("step %d not committed on disk within %v (newest committed: %d)", step, timeout, c.diskStep())
		case <-t.C:
		}
	}
}
