package agent

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

func TestShardDurable(t *testing.T) {
	c := newJobCore(2)
	ref := func(shard int) layout.ShardRef {
		return layout.ShardRef{Shard: shard, Size: int64(100 + shard), ManifestCRC32C: uint32(shard)}
	}
	steps := []struct {
		d    durableShard
		want int64 // the step committed, -1 for none
	}{
		{durableShard{Node: 0, Step: 9, NumShards: 4, Ref: ref(0)}, -1},
		{durableShard{Node: 0, Step: 9, NumShards: 4, Ref: ref(1)}, -1},
		{durableShard{Node: 1, Step: 9, NumShards: 4, Ref: ref(3)}, -1},
		{durableShard{Node: 0, Step: 19, NumShards: 4, Ref: ref(0)}, -1},
		{durableShard{Node: 1, Step: 9, NumShards: 4, Ref: ref(3)}, -1}, // said again
		{durableShard{Node: 1, Step: 9, NumShards: 4, Ref: ref(7)}, -1}, // no such shard
		{durableShard{Node: 1, Step: 9, NumShards: 4, Ref: ref(2)}, 9},
		{durableShard{Node: 1, Step: 9, NumShards: 4, Ref: ref(2)}, -1}, // committed already
		{durableShard{Node: 0, Step: 19, NumShards: 4, Ref: ref(1)}, -1},
		{durableShard{Node: 1, Step: 19, NumShards: 4, Ref: ref(2)}, -1},
		{durableShard{Node: 1, Step: 19, NumShards: 4, Ref: ref(3)}, 19},
	}
	for i, s := range steps {
		m, ok := c.shardDurable(s.d)
		switch {
		case ok != (s.want >= 0):
			t.Fatalf("%d: %+v: committed %v, want step %d", i, s.d, ok, s.want)
		case ok:
			want := layout.StepManifest{Step: s.want, Shards: []layout.ShardRef{ref(0), ref(1), ref(2), ref(3)}}
			if diff := cmp.Diff(want, m); diff != "" {
				t.Fatalf("%d: manifest (-want +got):\n%s", i, diff)
			}
		}
	}
	if len(c.durable) != 0 {
		t.Errorf("shards of committed steps kept: %v", c.durable)
	}
}
