package ckpt

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// node is an owner of n shards with a writer on each.
type node struct {
	o  *Owner
	ws []*Writer
}

func newNode(t *testing.T, cfg OwnerConfig, n int) *node {
	t.Helper()
	if cfg.ShmDir == "" {
		cfg.ShmDir = shmDir(t)
	}
	if cfg.Shards == nil {
		for s := range n {
			cfg.Shards = append(cfg.Shards, s)
		}
	}
	if cfg.Capacity == 0 {
		cfg.Capacity = 1 << 20
	}
	o, err := NewOwner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Remove() })
	nd := &node{o: o}
	for _, s := range cfg.Shards {
		w, err := NewWriter(WriterConfig{Path: o.SegmentPath(s)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		nd.ws = append(nd.ws, w)
	}
	return nd
}

// shardBlobs are the blobs of shard s at step.
func shardBlobs(s int, step int64) []Blob {
	return []Blob{
		{Name: "model", Data: bytes.Repeat([]byte{byte(s), byte(step)}, 4000+int(step))},
		{Name: "optimizer", Data: bytes.Repeat([]byte{byte(step), byte(s), 1}, 2000)},
	}
}

// saveAll saves step in every shard.
func (nd *node) saveAll(t *testing.T, step int64) {
	t.Helper()
	for s, w := range nd.ws {
		if err := w.Save(context.Background(), step, shardBlobs(s, step)...); err != nil {
			t.Fatal(err)
		}
	}
}

// persistAll saves step in every shard and persists it.
func (nd *node) persistAll(t *testing.T, step int64) {
	t.Helper()
	nd.saveAll(t, step)
	got, err := nd.o.PersistNewest(context.Background())
	if err != nil || got != step {
		t.Fatalf("PersistNewest = %d, %v; want %d", got, err, step)
	}
}

func checkShard(t *testing.T, ck *Checkpoint, s int, step int64) {
	t.Helper()
	want := shardBlobs(s, step)
	if ck.Step != step || !bytes.Equal(ck.Blob("model"), want[0].Data) || !bytes.Equal(ck.Blob("optimizer"), want[1].Data) {
		t.Fatalf("shard %d: got step %d (%d model bytes), want step %d", s, ck.Step, len(ck.Blob("model")), step)
	}
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestCommitOnlyWhenEveryShardIsDurable(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 2)
	nd.saveAll(t, 10)
	if _, err := nd.o.Persist(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, layout.TrackerFile)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("tracker written with one shard of two durable: %v", err)
	}
	if _, err := nd.o.Persist(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, layout.DLRoverTrackerFile)); got != "10" {
		t.Fatalf("%s = %q", layout.DLRoverTrackerFile, got)
	}
	if got := readFile(t, filepath.Join(dir, layout.MegatronTrackerFile)); got != "10" {
		t.Fatalf("%s = %q", layout.MegatronTrackerFile, got)
	}
	tr, err := readTracker(dir)
	if err != nil || tr.Step != 10 || len(tr.Shards) != 2 {
		t.Fatalf("tracker = %+v, %v", tr, err)
	}
	var names []string
	ents, _ := os.ReadDir(layout.StepDir(dir, 10))
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := []string{layout.CommitFile, "shard-00000.bin", "shard-00000.json", "shard-00001.bin", "shard-00001.json"}; !slices.Equal(names, want) {
		t.Fatalf("step directory holds %v, want %v", names, want)
	}
	for s := range 2 {
		ck, why, err := LoadDisk(dir, s)
		if err != nil || len(why) != 0 {
			t.Fatalf("LoadDisk(%d) = %v, %v", s, why, err)
		}
		checkShard(t, ck, s, 10)
	}
	if err := Verify(dir); err != nil {
		t.Fatal(err)
	}
}

func TestRunPersistsWhatWritersAsk(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := t.TempDir()
	commits := make(chan layout.StepManifest, 4)
	nd := newNode(t, OwnerConfig{Dir: dir, PollInterval: 5 * time.Millisecond,
		OnCommit: func(m layout.StepManifest) { commits <- m }}, 2)
	done := make(chan error)
	go func() { done <- nd.o.Run(ctx) }()

	nd.saveAll(t, 7)
	for _, w := range nd.ws {
		if err := w.Persist(ctx, 7); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case m := <-commits:
		if m.Step != 7 {
			t.Fatalf("committed step %d, want 7", m.Step)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no commit within 30s")
	}
	if err := nd.ws[0].Persist(ctx, 6); err == nil {
		t.Fatal("Persist of a step that is not the newest succeeded")
	}
	nd.o.Close()
	if err := <-done; err != nil {
		t.Fatalf("Run after Close = %v, want nil", err)
	}
}

// TestRunPersistsTheStepAsked: a writer that asks for step 4 and saves 5,
// 6 and 7 before its owner looks keeps step 4 in memory (saves go over the
// newest instead), and the owner persists and commits step 4, not the
// newest; requests made while the owner is busy wait for it, and every
// step asked for is committed. Before the fix, the owner persisted whatever was newest
// when it looked, and 4 was overwritten by the second save after it.
func TestRunPersistsTheStepAsked(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := t.TempDir()
	commits := make(chan int64, 8)
	nd := newNode(t, OwnerConfig{Dir: dir, PollInterval: 5 * time.Millisecond,
		OnCommit: func(m layout.StepManifest) { commits <- m.Step }}, 2)
	persist := func(step int64) {
		t.Helper()
		for _, w := range nd.ws {
			if err := w.Persist(ctx, step); err != nil {
				t.Fatal(err)
			}
		}
	}
	nd.saveAll(t, 4)
	persist(4)
	for step := int64(5); step <= 7; step++ {
		nd.saveAll(t, step)
	}
	for s, w := range nd.ws {
		if got := memorySteps(w.seg); !slices.Equal(got, []int64{7, 4}) {
			t.Fatalf("shard %d holds %v in memory, want [7 4]: the step asked for was written over", s, got)
		}
	}
	done := make(chan error)
	go func() { done <- nd.o.Run(ctx) }()
	next := func() int64 {
		t.Helper()
		select {
		case st := <-commits:
			return st
		case <-time.After(30 * time.Second):
			t.Fatal("no commit within 30s")
			return -1
		}
	}
	if got := next(); got != 4 {
		t.Fatalf("committed step %d, want 4, the step asked for", got)
	}
	testkit.WaitFor(t, "the owner to clear the request", func() bool {
		return nd.o.segs[0].persistSeq() == 0 && nd.o.segs[1].persistSeq() == 0
	})
	// A request while the owner is busy with the last one waits for it:
	// none is lost.
	for _, s := range []int64{10, 11, 12} {
		nd.saveAll(t, s)
		persist(s)
	}
	for _, want := range []int64{10, 11, 12} {
		if got := next(); got != want {
			t.Fatalf("committed step %d, want %d", got, want)
		}
	}
	nd.o.Close()
	if err := <-done; err != nil {
		t.Fatalf("Run after Close = %v, want nil", err)
	}
}

// TestFlush: the persists writers asked for are done when Flush returns,
// whether Run took them up or not.
func TestFlush(t *testing.T) {
	for _, running := range []bool{false, true} {
		t.Run(fmt.Sprintf("run=%v", running), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			dir := t.TempDir()
			nd := newNode(t, OwnerConfig{Dir: dir, PollInterval: 5 * time.Millisecond}, 2)
			nd.saveAll(t, 3)
			for _, w := range nd.ws {
				if err := w.Persist(ctx, 3); err != nil {
					t.Fatal(err)
				}
			}
			nd.saveAll(t, 4)
			done := make(chan error, 1)
			if running {
				go func() { done <- nd.o.Run(ctx) }()
			}
			if err := nd.o.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, filepath.Join(dir, layout.DLRoverTrackerFile)); got != "3" {
				t.Fatalf("%s = %q after Flush, want 3", layout.DLRoverTrackerFile, got)
			}
			if err := nd.o.Flush(ctx); err != nil {
				t.Fatalf("a second Flush: %v", err)
			}
			nd.o.Close()
			if running {
				<-done
			}
		})
	}
	t.Run("deadline", func(t *testing.T) {
		nd := newNode(t, OwnerConfig{Dir: t.TempDir()}, 1)
		nd.saveAll(t, 3)
		if err := nd.ws[0].Persist(context.Background(), 3); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := nd.o.Flush(ctx); !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "[0]") {
			t.Fatalf("Flush with its context done = %v", err)
		}
	})
}

// TestPersistFailure: a persist that fails (the folder is a file) is
// told by PersistFailure, naming the shard and the cause, until a later
// persist of the shard succeeds.
func TestPersistFailure(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	persist := func(step int64) {
		t.Helper()
		nd.saveAll(t, step)
		if err := nd.ws[0].Persist(ctx, step); err != nil {
			t.Fatal(err)
		}
		if err := nd.o.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := nd.o.PersistFailure(0); err != nil {
		t.Fatalf("PersistFailure before any persist: %v", err)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	persist(3)
	if err := nd.o.PersistFailure(0); err == nil || !strings.Contains(err.Error(), "shard 0") || !strings.Contains(err.Error(), dir) {
		t.Fatalf("PersistFailure after a persist into a file = %v, want shard 0 and %s named", err, dir)
	}
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	persist(4)
	if err := nd.o.PersistFailure(0); err != nil {
		t.Fatalf("PersistFailure after a persist that succeeded: %v", err)
	}
}

func TestLoadPreference(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 2)
	nd.persistAll(t, 10)
	nd.saveAll(t, 12) // in memory only

	ck, rep, err := nd.o.Load(ctx, 1)
	if err != nil || rep.Tier != TierMemory || !rep.SealedOnLoad || !ck.Unverified {
		t.Fatalf("Load = %s, %v; want memory, the unsealed step sealed on load", rep, err)
	}
	checkShard(t, ck, 1, 12)

	// Shard 0 loses step 12, once sealed, to a flipped bit, and shard 1
	// step 10 is overwritten by 13: no step is intact in both, so disk
	// serves.
	if err := nd.o.Seal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	seg := nd.o.segs[0]
	i := seg.newest()[0]
	m, _ := seg.metaOK(i)
	flipBit(t, seg.path, seg.halfBase(i)+m.Blobs[0].Offset)
	if err := nd.ws[1].Save(ctx, 13, shardBlobs(1, 13)...); err != nil {
		t.Fatal(err)
	}
	for s := range 2 {
		ck, rep, err := nd.o.Load(ctx, s)
		if err != nil || rep.Tier != TierDisk {
			t.Fatalf("shard %d: Load = %s, %v; want disk", s, rep, err)
		}
		checkShard(t, ck, s, 10)
		if len(rep.Refused) != 2 || rep.Refused[0].Tier != TierMemory || rep.Refused[1].Tier != TierReplica ||
			!strings.Contains(rep.Refused[0].Error(), "no intact step in every local shard") {
			t.Fatalf("shard %d: report %s", s, rep)
		}
		t.Logf("%s", rep)
	}

	// A given step: shard 0 still holds 10 in memory, shard 1 not.
	ck, rep, err = nd.o.LoadStep(ctx, 0, 10)
	if err != nil || rep.Tier != TierMemory {
		t.Fatalf("LoadStep(0, 10) = %s, %v", rep, err)
	}
	checkShard(t, ck, 0, 10)
	ck, rep, err = nd.o.LoadStep(ctx, 1, 10)
	if err != nil || rep.Tier != TierDisk {
		t.Fatalf("LoadStep(1, 10) = %s, %v", rep, err)
	}
	checkShard(t, ck, 1, 10)
	if _, rep, err := nd.o.LoadStep(ctx, 0, 11); !errors.Is(err, ErrNoStep) || len(rep.Refused) != 3 {
		t.Fatalf("LoadStep(11) = %s, %v; want ErrNoStep with three reasons", rep, err)
	}
}

func TestTrackerNamesMissingStep(t *testing.T) {
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	nd.persistAll(t, 10)
	nd.persistAll(t, 20)
	if err := os.RemoveAll(layout.StepDir(dir, 20)); err != nil {
		t.Fatal(err)
	}
	ck, why, err := LoadDisk(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	checkShard(t, ck, 0, 10)
	if len(why) != 1 || !strings.Contains(why[0].Error(), "names step 20") {
		t.Fatalf("reasons = %v", why)
	}
	err = Verify(dir)
	if err == nil || !strings.Contains(err.Error(), layout.DLRoverTrackerFile) || !strings.Contains(err.Error(), layout.MegatronTrackerFile) {
		t.Fatalf("Verify = %v, want every tracker reported", err)
	}
}

func TestDamagedShardFiles(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, data string)
		want   string
	}{
		{"truncated", func(t *testing.T, data string) { os.Truncate(data, 100) }, "truncated"},
		{"bit flip", func(t *testing.T, data string) { flipBit(t, data, 5000) }, "crc32c"},
		{"manifest edited", func(t *testing.T, data string) {
			m := strings.TrimSuffix(data, ".bin") + ".json"
			b, _ := os.ReadFile(m)
			os.WriteFile(m, bytes.Replace(b, []byte(`"step": 20`), []byte(`"step": 21`), 1), 0o640)
		}, "says"},
		{"manifest missing", func(t *testing.T, data string) { os.Remove(strings.TrimSuffix(data, ".bin") + ".json") }, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			nd := newNode(t, OwnerConfig{Dir: dir}, 1)
			nd.persistAll(t, 10)
			nd.persistAll(t, 20)
			tc.damage(t, filepath.Join(layout.StepDir(dir, 20), layout.ShardFile(0)))
			ck, why, err := LoadDisk(dir, 0)
			if err != nil {
				t.Fatal(err)
			}
			checkShard(t, ck, 0, 10)
			if len(why) != 1 || !strings.Contains(why[0].Error(), tc.want) {
				t.Fatalf("reasons = %v, want one naming %q", why, tc.want)
			}
			if err := Verify(dir); err == nil || !strings.Contains(err.Error(), "step 20 shard 0") {
				t.Fatalf("Verify = %v", err)
			}
		})
	}
}

// TestDiskFull persists into a 1 MiB tmpfs (root only).
func TestDiskFull(t *testing.T) {
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs (not root?): %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", dir).Run() })
	nd := newNode(t, OwnerConfig{Dir: dir, Capacity: 4 << 20}, 1)
	nd.persistAll(t, 1)
	if err := nd.ws[0].Save(context.Background(), 2, Blob{Name: "model", Data: make([]byte, 2<<20)}); err != nil {
		t.Fatal(err)
	}
	_, err := nd.o.Persist(context.Background(), 0)
	if !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Persist into a full disk = %v, want ErrNoSpace", err)
	}
	t.Logf("error as the operator sees it: %v", err)
	if tr, err := readTracker(dir); err != nil || tr.Step != 1 {
		t.Fatalf("tracker = %+v, %v; want step 1", tr, err)
	}
	ents, _ := os.ReadDir(layout.StepDir(dir, 2))
	if len(ents) != 0 {
		t.Fatalf("step 2 holds %d files after a failed persist", len(ents))
	}
	ck, _, err := LoadDisk(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	checkShard(t, ck, 0, 1)
}

func TestRetention(t *testing.T) {
	dir := t.TempDir()
	var removedAll []int64
	lc := &LocalCommitter{Dir: dir, Retention: Retention{KeepLatest: 2, KeepEvery: 4},
		OnCommit: func(_ layout.StepManifest, removed []int64) {
			removedAll = append(removedAll, removed...)
			// The directory's lock is free: a callback may prune too.
			if _, err := ApplyRetention(dir, Retention{KeepLatest: 2, KeepEvery: 4}); err != nil {
				t.Error(err)
			}
		}}
	nd := newNode(t, OwnerConfig{Dir: dir, Committer: lc}, 1)
	for step := int64(1); step <= 6; step++ {
		nd.persistAll(t, step)
	}
	// Leftovers of persists cut short: one older and one newer than the
	// newest commit.
	os.Mkdir(layout.StepDir(dir, 3), 0o750)
	os.Mkdir(layout.StepDir(dir, 99), 0o750)
	os.WriteFile(filepath.Join(dir, "notes.txt"), nil, 0o640)
	for step := int64(7); step <= 10; step++ {
		nd.persistAll(t, step)
	}
	steps, committed, err := stepDirs(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int64{99, 10, 9, 8, 4}; !slices.Equal(steps, want) {
		t.Fatalf("steps kept %v, want %v", steps, want)
	}
	if committed[99] {
		t.Fatal("leftover 99 became committed")
	}
	if _, err := os.Stat(filepath.Join(dir, "notes.txt")); err != nil {
		t.Fatal("retention removed a file that is not a step")
	}
	if !slices.Contains(removedAll, 3) {
		t.Fatalf("removed %v", removedAll)
	}
}

func TestCommitNeverMovesBack(t *testing.T) {
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	nd.persistAll(t, 5)
	nd.persistAll(t, 6)
	err := CommitStep(dir, layout.StepManifest{Step: 5, Shards: []layout.ShardRef{{Shard: 0, Size: 1, ManifestCRC32C: 1}}})
	if !errors.Is(err, ErrStale) {
		t.Fatalf("CommitStep of an older step = %v, want ErrStale", err)
	}
	if got := readFile(t, filepath.Join(dir, layout.DLRoverTrackerFile)); got != "6" {
		t.Fatalf("tracker moved to %q", got)
	}
}

func TestPersistNewestNeedsAgreement(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 2)
	nd.saveAll(t, 5)
	// The trainer died between its shards: shard 0 holds 6, shard 1 not.
	if err := nd.ws[0].Save(ctx, 6, shardBlobs(0, 6)...); err != nil {
		t.Fatal(err)
	}
	step, err := nd.o.PersistNewest(ctx)
	if err != nil || step != 5 {
		t.Fatalf("PersistNewest = %d, %v; want 5", step, err)
	}
	// Now shard 0 holds 6 and 7, shard 1 only 5: no common step.
	if err := nd.ws[0].Save(ctx, 7, shardBlobs(0, 7)...); err != nil {
		t.Fatal(err)
	}
	if _, err := nd.o.PersistNewest(ctx); !errors.Is(err, ErrNoStep) {
		t.Fatalf("PersistNewest without agreement = %v, want ErrNoStep", err)
	}
	if tr, err := readTracker(dir); err != nil || tr.Step != 5 {
		t.Fatalf("tracker = %+v, %v", tr, err)
	}
}

func TestLoadDiskBadShard(t *testing.T) {
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	nd.persistAll(t, 1)
	for _, shard := range []int{-1, 1} {
		if _, err := LoadDiskStep(dir, 1, shard); err == nil || !strings.Contains(err.Error(), "shard") {
			t.Errorf("LoadDiskStep(shard %d) = %v, want an error naming the shard", shard, err)
		}
		if _, _, err := LoadDisk(dir, shard); !errors.Is(err, ErrNoStep) {
			t.Errorf("LoadDisk(shard %d) = %v, want ErrNoStep", shard, err)
		}
	}
}

func TestPersistRefusesSymlinkedStepDir(t *testing.T) {
	dir, elsewhere := t.TempDir(), t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	nd.saveAll(t, 7)
	if err := os.Symlink(elsewhere, layout.StepDir(dir, 7)); err != nil {
		t.Fatal(err)
	}
	if _, err := nd.o.Persist(context.Background(), 0); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("Persist through a symlinked step directory = %v, want an error", err)
	}
	if ents, _ := os.ReadDir(elsewhere); len(ents) != 0 {
		t.Fatalf("persist wrote %d files through the symlink", len(ents))
	}
}

// controlPlane is a Committer across nodes that share no filesystem: it
// gathers every shard's ShardDurable and then commits the step on each
// node, as the control plane does.
type controlPlane struct {
	mu        sync.Mutex
	numShards int
	dirs      []string
	refs      map[int64][]*layout.ShardRef
}

func (c *controlPlane) ShardDurable(ctx context.Context, m layout.ShardManifest) error {
	ref, err := m.Ref()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.refs[m.Step] == nil {
		c.refs[m.Step] = make([]*layout.ShardRef, c.numShards)
	}
	c.refs[m.Step][m.Shard] = &ref
	sm := layout.StepManifest{Step: m.Step}
	for _, r := range c.refs[m.Step] {
		if r == nil {
			return nil // not yet
		}
		sm.Shards = append(sm.Shards, *r)
	}
	for _, d := range c.dirs {
		if err := CommitStep(d, sm); err != nil {
			return err
		}
	}
	return nil
}

// TestCommitAcrossNodes persists a step's two shards on two nodes with
// disks of their own: the step commits on both only once both shards are
// durable, each node loads its shard, and neither calls the other's
// absent shard a problem.
func TestCommitAcrossNodes(t *testing.T) {
	ctx := context.Background()
	dirs := []string{t.TempDir(), t.TempDir()}
	cp := &controlPlane{numShards: 2, dirs: dirs, refs: map[int64][]*layout.ShardRef{}}
	var nodes []*node
	for s, d := range dirs {
		nd := newNode(t, OwnerConfig{Shards: []int{s}, NumShards: 2, Dir: d, Committer: cp}, 1)
		if err := nd.ws[0].Save(ctx, 7, shardBlobs(s, 7)...); err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, nd)
	}
	if _, err := nodes[0].o.Persist(ctx, 0); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, layout.TrackerFile)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s: tracker written with one shard of two durable: %v", d, err)
		}
	}
	if _, err := nodes[1].o.Persist(ctx, 1); err != nil {
		t.Fatal(err)
	}
	for s, d := range dirs {
		if got := readFile(t, filepath.Join(d, layout.DLRoverTrackerFile)); got != "7" {
			t.Fatalf("%s: %s = %q", d, layout.DLRoverTrackerFile, got)
		}
		ck, why, err := LoadDisk(d, s)
		if err != nil || len(why) != 0 {
			t.Fatalf("LoadDisk(%s, %d) = %v, %v", d, s, why, err)
		}
		checkShard(t, ck, s, 7)
		if _, _, err := LoadDisk(d, 1-s); !errors.Is(err, ErrNoStep) {
			t.Fatalf("LoadDisk(%s, %d) of the other node's shard = %v, want ErrNoStep", d, 1-s, err)
		}
		if err := Verify(d); err != nil {
			t.Fatalf("Verify(%s) = %v", d, err)
		}
		rep, err := InspectDir(d)
		if err != nil {
			t.Fatal(err)
		}
		if sh := rep.Steps[0].Shards; len(sh) != 2 || sh[s].Absent || !sh[1-s].Absent {
			t.Fatalf("InspectDir(%s) shards %+v, want %d here and %d absent", d, sh, s, 1-s)
		}
	}
}

// TestPersistWritesBack persists a step of several writeback windows, in
// blobs that end inside windows, and reads it back from disk. The pages of
// all windows but the last two have left the page cache.
func TestPersistWritesBack(t *testing.T) {
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir, Capacity: 64 << 20}, 1)
	var blobs []Blob
	for i, n := range []int{writebackWindow + 12345, 3, 2*writebackWindow - 7, writebackWindow / 2} {
		d := make([]byte, n)
		for j := range d {
			d[j] = byte(j*7 + i)
		}
		blobs = append(blobs, Blob{Name: fmt.Sprintf("b%d", i), Data: d})
	}
	if err := nd.ws[0].Save(context.Background(), 5, blobs...); err != nil {
		t.Fatal(err)
	}
	if _, err := nd.o.Persist(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	name := filepath.Join(layout.StepDir(dir, 5), layout.ShardFile(0))
	var total int64
	for _, b := range blobs {
		total += int64(len(b.Data))
	}
	// Disk filesystems drop clean pages when asked; tmpfs and others keep
	// them, so the check is made where the kernel is known to honour it.
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err == nil && (st.Type == unix.EXT4_SUPER_MAGIC || st.Type == unix.XFS_SUPER_MAGIC || st.Type == unix.BTRFS_SUPER_MAGIC) {
		if res := residentPages(t, name); res > total/2 {
			t.Errorf("%d of %d bytes of %s still in the page cache after persist", res, total, name)
		}
	}
	ck, _, err := LoadDisk(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range blobs {
		if !bytes.Equal(ck.Blob(b.Name), b.Data) {
			t.Fatalf("blob %s differs after persist", b.Name)
		}
	}
}

// residentPages returns how many bytes of the file are in the page cache.
func residentPages(t *testing.T, name string) int64 {
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	m, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	page := os.Getpagesize()
	vec := make([]byte, (len(m)+page-1)/page)
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatal(e)
	}
	var n int64
	for _, v := range vec {
		if v&1 != 0 {
			n += int64(page)
		}
	}
	return n
}

// TestWritebackUnsupported: a file that cannot be written back early (a
// pipe here) is written the plain way, without an error.
func TestWritebackUnsupported(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	wb := newWriteback(w)
	for range 3 {
		if err := wb.wrote(writebackWindow); err != nil {
			t.Fatal(err)
		}
	}
	if !wb.unsupported {
		t.Fatal("writeback on a pipe is not marked unsupported")
	}
}

// TestCommitAcrossProcesses runs the agents of a two-shard job as two
// processes on one disk tier and has them persist each step at the same
// moment, so that both see the step complete and commit it, and both
// apply the retention: each persist succeeds, and the tier ends with the
// last step committed and nothing else.
func TestCommitAcrossProcesses(t *testing.T) {
	const steps = 60
	shm, dir := shmDir(t), t.TempDir()
	type agent struct {
		in  io.WriteCloser
		out *bufio.Scanner
	}
	var agents []agent
	for shard := range 2 {
		cmd := testkit.Command(t, "shard", fmt.Sprint("FAULTLINE_CKPT_SHARD=", shard),
			"FAULTLINE_CKPT_SHM="+shm, "FAULTLINE_CKPT_DIR="+dir)
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			in.Close()
			cmd.Process.Kill()
			cmd.Wait()
		})
		a := agent{in, bufio.NewScanner(out)}
		if !a.out.Scan() || a.out.Text() != "ready" {
			t.Fatalf("agent of shard %d did not start: %q", shard, a.out.Text())
		}
		agents = append(agents, a)
	}
	var failed []string
	for step := 1; step <= steps; step++ {
		for _, a := range agents {
			fmt.Fprintln(a.in, step)
		}
		for shard, a := range agents {
			if !a.out.Scan() {
				t.Fatalf("agent of shard %d died at step %d", shard, step)
			}
			if got := a.out.Text(); got != "persisted" {
				failed = append(failed, fmt.Sprintf("step %d shard %d: %s", step, shard, got))
			}
		}
	}
	if len(failed) > 0 {
		t.Errorf("%d of %d persists failed:\n%s", len(failed), 2*steps, strings.Join(failed, "\n"))
	}
	rep, err := InspectDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Problems) > 0 {
		t.Fatal(errors.Join(rep.Problems...))
	}
	var left []int64
	for _, s := range rep.Steps {
		left = append(left, s.Step)
	}
	if tr, err := readTracker(dir); err != nil || tr.Step != steps || !slices.Equal(left, []int64{steps}) {
		t.Fatalf("tracker %+v, %v; steps left %v; want step %d alone", tr, err, left, steps)
	}
}

// TestResaveCommittedStep persists a step that is committed already:
// with its disk copy damaged, the copy is written again from memory; with
// it intact, it is kept, and the log says which; a different step under
// the same number is refused, and the committed one kept.
func TestResaveCommittedStep(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	logs := &syncBuffer{}
	nd := newNode(t, OwnerConfig{Dir: dir, Logger: slog.New(slog.NewTextHandler(logs, nil))}, 1)
	nd.persistAll(t, 1)
	data := filepath.Join(layout.StepDir(dir, 1), layout.ShardFile(0))
	flipBit(t, data, 100)
	if _, err := LoadDiskStep(dir, 1, 0); !errors.Is(err, layout.ErrCorrupt) {
		t.Fatalf("LoadDiskStep of the damaged copy = %v", err)
	}

	nd.persistAll(t, 1) // the same step again
	if !strings.Contains(logs.String(), "damaged disk copy: wrote it again") {
		t.Fatalf("the log does not say the damaged copy was written again:\n%s", logs)
	}
	ck, err := LoadDiskStep(dir, 1, 0)
	if err != nil {
		t.Fatalf("the rewritten copy: %v", err)
	}
	checkShard(t, ck, 0, 1)

	ino := func() uint64 {
		var st unix.Stat_t
		if err := unix.Stat(data, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	before := ino()
	nd.persistAll(t, 1)
	if !strings.Contains(logs.String(), "intact disk copy: kept it") || ino() != before {
		t.Fatalf("an intact committed copy was not kept:\n%s", logs)
	}

	if err := nd.ws[0].Save(ctx, 1, shardBlobs(0, 2)...); err != nil {
		t.Fatal(err)
	}
	_, err = nd.o.Persist(ctx, 0)
	if err == nil || !strings.Contains(err.Error(), "kept the committed step") {
		t.Fatalf("Persist of other content under a committed step = %v", err)
	}
	if ck, err := LoadDiskStep(dir, 1, 0); err != nil || ino() != before {
		t.Fatalf("the committed copy after a refused persist: %v", err)
	} else {
		checkShard(t, ck, 0, 1)
	}
}
