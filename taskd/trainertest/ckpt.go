package trainertest

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"

	"github.com/faultline-ml/faultline/ckpt"
)

// CkptState keeps a fake trainer's state, its step counter, in a ckpt
// segment that a ckpt.Owner created, and asks the owner to persist every
// PersistEvery-th save to its disk tier. Its Save and Load are a Config's.
type CkptState struct {
	Writer *ckpt.Writer
	// Path is the segment's path (ckpt.Owner.SegmentPath); Load inspects
	// it for the step it wants.
	Path string
	// Dir is the owner's disk tier, "" when it has none; Shard is the
	// shard.
	Dir   string
	Shard int
	// PersistEvery asks for a persist every so many saves; 0 never.
	PersistEvery int

	mu    sync.Mutex
	saves int
}

const stateBlob = "state"

func encodeState(step int64) []byte {
	b := make([]byte, 64)
	binary.LittleEndian.PutUint64(b, uint64(step))
	for i := 8; i < len(b); i++ {
		b[i] = byte(step) ^ byte(i)
	}
	return b
}

func decodeState(ck *ckpt.Checkpoint) (int64, error) {
	b := ck.Blob(stateBlob)
	if len(b) != 64 {
		return -1, fmt.Errorf("trainertest: step %d: state blob of %d bytes", ck.Step, len(b))
	}
	step := int64(binary.LittleEndian.Uint64(b))
	if step != ck.Step {
		return -1, fmt.Errorf("trainertest: step %d holds the state of step %d", ck.Step, step)
	}
	return step, nil
}

// Save saves step's state into the segment.
func (c *CkptState) Save(ctx context.Context, step int64) error {
	if err := c.Writer.Save(ctx, step, ckpt.Blob{Name: stateBlob, Data: encodeState(step)}); err != nil {
		return err
	}
	c.mu.Lock()
	c.saves++
	persist := c.PersistEvery > 0 && c.saves%c.PersistEvery == 0
	c.mu.Unlock()
	if persist {
		return c.Writer.Persist(ctx, step)
	}
	return nil
}

// Load returns step when the segment holds it intact (every CRC checked)
// or the disk tier does, and for step -1 the newest step either holds, -1
// when none.
func (c *CkptState) Load(_ context.Context, step int64) (int64, error) {
	rep, err := ckpt.InspectSegment(c.Path)
	if err == nil {
		if step < 0 && rep.NewestHalf >= 0 {
			return rep.Halves[rep.NewestHalf].Meta.Step, nil
		}
		for _, h := range rep.Halves {
			if h.Err == nil && h.Meta.Step == step && step >= 0 {
				return step, nil
			}
		}
	}
	if c.Dir != "" {
		var ck *ckpt.Checkpoint
		var derr error
		if step < 0 {
			ck, _, derr = ckpt.LoadDisk(c.Dir, c.Shard)
		} else {
			ck, derr = ckpt.LoadDiskStep(c.Dir, step, c.Shard)
		}
		if derr == nil {
			return decodeState(ck)
		}
		if step >= 0 {
			return -1, fmt.Errorf("trainertest: step %d of shard %d: %w in %s (%v) nor on disk (%v)", step, c.Shard, ckpt.ErrNoStep, c.Path, err, derr)
		}
	}
	if step < 0 {
		return -1, nil
	}
	return -1, fmt.Errorf("trainertest: step %d of shard %d not in %s (%v): %w", step, c.Shard, c.Path, err, ckpt.ErrNoStep)
}
