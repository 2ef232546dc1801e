package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
)

// jobCommitter commits the DISK steps of a job of several nodes: a shard
// durable on its node's disk is told to the job's manager, which has
// every node commit the step once all its shards are (kindCommit), so
// that steps commit with a folder per node, where no node sees the
// others' shards. In a folder the nodes share, the node that persists a
// step's last shard commits it at once, as one node does.
type jobCommitter struct {
	c     *checkpoints
	local *ckpt.LocalCommitter
}

// ShardDurable commits m.Step where the folder holds every shard, and
// tells the manager that m's shard is durable.
func (j *jobCommitter) ShardDurable(ctx context.Context, m layout.ShardManifest) error {
	err := j.local.ShardDurable(ctx, m)
	name := filepath.Join(layout.StepDir(j.local.Dir, m.Step), layout.ShardManifestFile(m.Shard))
	b, rerr := os.ReadFile(name)
	if rerr != nil {
		return errors.Join(err, fmt.Errorf("agent: tell the job that step %d shard %d is durable: %w", m.Step, m.Shard, rerr))
	}
	d := durableShard{Node: j.c.a.cfg.NodeRank, Step: m.Step, NumShards: m.NumShards,
		Ref: layout.ShardRef{Shard: m.Shard, Size: m.Size, ManifestCRC32C: layout.CRC32C(b)}}
	msg, _ := json.Marshal(d)
	if !j.c.a.send(kindDurable, msg) {
		return errors.Join(err, fmt.Errorf("agent: tell the job that step %d shard %d is durable: no worker of the node is connected", m.Step, m.Shard))
	}
	return err
}

// commit commits sm in the node's folder, where its shards of the step
// lie: every shard of it is durable, on this node or another.
func (c *checkpoints) commit(sm layout.StepManifest) {
	c.mu.Lock()
	dir := c.dir
	c.mu.Unlock()
	if dir == "" {
		return
	}
	if _, err := os.Stat(layout.StepDir(dir, sm.Step)); err != nil {
		c.a.log.Info("agent: a step committed by the job has no folder here", "step", sm.Step, "dir", dir)
		return
	}
	switch err := ckpt.CommitStep(dir, sm); {
	case errors.Is(err, ckpt.ErrStale):
		c.a.log.Info("agent: a newer step is committed already", "step", sm.Step, "err", err)
	case err != nil:
		c.a.log.Warn("agent: the job's step not committed here", "step", sm.Step, "dir", dir, "err", err)
	default:
		c.a.log.Info("agent: step committed", "step", sm.Step, "dir", dir)
	}
}
