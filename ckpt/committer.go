package ckpt

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// Committer learns that shards of a step are durable and commits the step
// once every shard is. A step is never committed on the word of some of its
// shards: that is how a trainer dying mid-save cannot get an empty step
// committed. The control plane implements Committer across nodes (it
// gathers ShardDurable from every node's owner, then has each node call
// CommitStep with a layout.StepManifest of the shards' Refs); LocalCommitter
// implements it for one node.
type Committer interface {
	// ShardDurable reports that the shard m describes is durable: its data
	// file and manifest are fsynced under their final names.
	ShardDurable(ctx context.Context, m layout.ShardManifest) error
}

// LocalCommitter commits steps whose every shard lies in one directory: a
// single node, or a filesystem every node shares. It finds the shards of a
// step by their manifests on disk, so it needs no memory of earlier calls
// and a restarted process commits a step whose last shard it persists.
// It holds the directory's layout.LockFile while it commits and applies the
// retention, so it is safe for concurrent use, by goroutines and by the
// processes that share the directory.
type LocalCommitter struct {
	Dir       string    // the disk tier
	Retention Retention // applied after each commit
	// OnCommit, if set, is called after each commit with the step manifest
	// and the steps retention removed.
	OnCommit func(m layout.StepManifest, removed []int64)
}

// ShardDurable commits m.Step if the manifests of all its m.NumShards
// shards are in the step directory and agree, and applies the retention.
// It returns nil when shards are still missing. OnCommit runs once the
// directory's lock is released, so that it may commit or prune there.
func (c *LocalCommitter) ShardDurable(ctx context.Context, m layout.ShardManifest) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sm, removed, committed, err := c.commit(m)
	if committed && c.OnCommit != nil {
		c.OnCommit(sm, removed)
	}
	return err
}

// commit is ShardDurable's work, under the directory's lock. It says
// whether it committed the step.
func (c *LocalCommitter) commit(m layout.ShardManifest) (sm layout.StepManifest, removed []int64, committed bool, err error) {
	unlock, err := lockDir(c.Dir)
	if err != nil {
		return sm, nil, false, err
	}
	defer unlock()
	stepDir := layout.StepDir(c.Dir, m.Step)
	if b, err := os.ReadFile(filepath.Join(stepDir, layout.CommitFile)); err == nil {
		// Committed already; a crash may have cut the commit short before
		// the trackers, so bring them forward.
		if t, err := readTracker(c.Dir); err == nil && t.Step >= m.Step {
			return sm, nil, false, nil
		}
		if sm, err := layout.ParseStepManifest(b); err == nil && sm.Step == m.Step {
			return sm, nil, false, commitStep(c.Dir, sm)
		}
	}
	sm = layout.StepManifest{Step: m.Step, Shards: make([]layout.ShardRef, m.NumShards)}
	for s := range m.NumShards {
		name := filepath.Join(stepDir, layout.ShardManifestFile(s))
		b, err := os.ReadFile(name)
		if errors.Is(err, os.ErrNotExist) {
			return sm, nil, false, nil // not yet
		}
		if err != nil {
			return sm, nil, false, fmt.Errorf("ckpt: commit step %d: %w", m.Step, err)
		}
		sh, err := layout.ParseShardManifest(b)
		if err != nil {
			return sm, nil, false, fmt.Errorf("ckpt: commit step %d: %w", m.Step, withFile(err, name))
		}
		if sh.Step != m.Step || sh.Shard != s || sh.NumShards != m.NumShards {
			return sm, nil, false, fmt.Errorf("ckpt: commit step %d: %s is for step %d shard %d of %d", m.Step, name, sh.Step, sh.Shard, sh.NumShards)
		}
		sm.Shards[s] = layout.ShardRef{Shard: s, Size: sh.Size, ManifestCRC32C: layout.CRC32C(b)}
	}
	if err := commitStep(c.Dir, sm); err != nil {
		return sm, nil, false, err
	}
	removed, err = applyRetention(c.Dir, c.Retention)
	return sm, removed, true, err
}
