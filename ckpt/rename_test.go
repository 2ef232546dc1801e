package ckpt

import (
	"context"
	"os"
	"strings"
	"testing"
)

// TestRenameShard: a shard's segment becomes another shard's with the
// steps it holds, and an owner of the new shard loads them from memory;
// a replica, a segment of another shard and a missing one are refused,
// each left as it was.
func TestRenameShard(t *testing.T) {
	ctx := context.Background()
	shm := shmDir(t)
	o, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{4}, NumShards: 6, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(4)})
	if err != nil {
		t.Fatal(err)
	}
	for step := int64(6); step <= 7; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatal(err)
		}
	}
	w.Close()
	o.Close()
	// A stale segment of the new number (a lost node's, on a shared
	// /dev/shm) is replaced.
	if err := os.WriteFile(SegmentPath(shm, "faultline-ckpt", 2), []byte("stale"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := RenameShard(shm, "faultline-ckpt", 4, 2); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(SegmentPath(shm, "faultline-ckpt", 4)); !os.IsNotExist(err) {
		t.Fatalf("shard 4's segment is still there: %v", err)
	}
	o2, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{2}, NumShards: 4, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	ck, rep, err := o2.Load(ctx, 2)
	if err != nil || ck.Step != 7 || rep.Tier != TierMemory {
		t.Fatalf("Load of shard 2 after the rename = %v, %v, %v; want step 7 from memory", ck, rep, err)
	}
	held, _, err := o2.Held(2)
	if err != nil || len(held) != 2 {
		t.Fatalf("shard 2 holds %v (%v), want steps 7 and 6", held, err)
	}

	for _, c := range []struct {
		name     string
		from, to int
		want     string
	}{
		{"another shard's", 3, 1, "holds shard 2, not 3"},
		{"missing", 5, 1, "no such file"},
		{"out of range", 2, -1, "shard -1"},
	} {
		if c.name == "another shard's" {
			// Shard 2's segment under shard 3's name.
			if err := os.Link(SegmentPath(shm, "faultline-ckpt", 2), SegmentPath(shm, "faultline-ckpt", 3)); err != nil {
				t.Fatal(err)
			}
		}
		err := RenameShard(shm, "faultline-ckpt", c.from, c.to)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: RenameShard(%d, %d) = %v, want an error saying %q", c.name, c.from, c.to, err, c.want)
		}
	}
	if _, err := os.Stat(SegmentPath(shm, "faultline-ckpt", 3)); err != nil {
		t.Errorf("a refused rename removed its segment: %v", err)
	}
	os.Remove(SegmentPath(shm, "faultline-ckpt", 3))
	if ck, _, err := o2.Load(ctx, 2); err != nil || ck.Step != 7 {
		t.Fatalf("shard 2 after the refused renames: %v, %v", ck, err)
	}
}

// TestRenameShardRefusesReplica: a replica is a copy of a peer's shard,
// not a rank's own state; it is not renumbered.
func TestRenameShardRefusesReplica(t *testing.T) {
	shm := shmDir(t)
	s, err := createSegment(ReplicaPath(shm, "faultline-ckpt", 1), 1, 1, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	s.close()
	if err := os.Rename(ReplicaPath(shm, "faultline-ckpt", 1), SegmentPath(shm, "faultline-ckpt", 1)); err != nil {
		t.Fatal(err)
	}
	if err := RenameShard(shm, "faultline-ckpt", 1, 0); err == nil || !strings.Contains(err.Error(), "replica") {
		t.Fatalf("RenameShard of a replica = %v, want refused", err)
	}
}
