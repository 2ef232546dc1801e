package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/taskd"
)

// nodeCheckpoints is the job's checkpoint store as recovery sees it, over
// the checkpoint owners of its nodes: it picks the newest step that every
// node holds intact, then has each node's owner ready that step of each of
// its shards (taskd.Checkpoints' advice for a job spread over nodes).
type nodeCheckpoints struct {
	owners []*ckpt.Owner
	shards [][]int // by node

	mu   sync.Mutex
	last checkpointLoad
}

// checkpointLoad is what the last LoadNewest readied.
type checkpointLoad struct {
	Time    time.Time
	Step    int64
	Reports []ckpt.LoadReport // one per shard, in node and shard order
}

var _ taskd.Checkpoints = (*nodeCheckpoints)(nil)

// LoadNewest implements taskd.Checkpoints.
func (c *nodeCheckpoints) LoadNewest(ctx context.Context) (int64, error) {
	step := int64(-1)
	for n, o := range c.owners {
		_, rep, err := o.Load(ctx, c.shards[n][0])
		if err != nil {
			return -1, fmt.Errorf("node %d: %w", n, err)
		}
		if step < 0 || rep.Step < step {
			step = rep.Step
		}
	}
	var reports []ckpt.LoadReport
	for n, o := range c.owners {
		for _, s := range c.shards[n] {
			_, rep, err := o.LoadStep(ctx, s, step)
			if err != nil {
				return -1, fmt.Errorf("node %d: %w", n, err)
			}
			reports = append(reports, rep)
		}
	}
	c.mu.Lock()
	c.last = checkpointLoad{Time: time.Now(), Step: step, Reports: reports}
	c.mu.Unlock()
	return step, nil
}

// PersistNewest implements taskd.Checkpoints: every node persists its
// newest intact step; the oldest of them is the one every shard has.
func (c *nodeCheckpoints) PersistNewest(ctx context.Context) (int64, error) {
	step := int64(-1)
	for n, o := range c.owners {
		s, err := o.PersistNewest(ctx)
		if err != nil {
			return -1, fmt.Errorf("node %d: %w", n, err)
		}
		if step < 0 || s < step {
			step = s
		}
	}
	return step, nil
}

// lastLoad returns what the last LoadNewest readied.
func (c *nodeCheckpoints) lastLoad() checkpointLoad {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}
