package ckpt_test

import (
	"context"
	"fmt"
	"os"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
)

// A node agent owns the shared memory and the disk tier; the trainer saves
// into the memory; when the trainer dies, the agent persists what it saved.
func Example() {
	shm, _ := os.MkdirTemp("", "shm") // /dev/shm in production
	dir, _ := os.MkdirTemp("", "ckpt")
	defer os.RemoveAll(shm)
	defer os.RemoveAll(dir)
	ctx := context.Background()

	o, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: 1 << 20, Dir: dir})
	if err != nil {
		panic(err)
	}
	defer o.Remove()

	// In the trainer, a process of its own.
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		panic(err)
	}
	if err := w.Save(ctx, 100, ckpt.Blob{Name: "model", Data: []byte("weights")}); err != nil {
		panic(err)
	}
	w.Close() // the trainer dies

	step, err := o.PersistNewest(ctx)
	fmt.Println("persisted step", step, err)
	ck, rep, err := o.Load(ctx, 0)
	fmt.Println(rep.Tier, ck.Step, string(ck.Blob("model")), err)
	// Output:
	// persisted step 100 <nil>
	// memory 100 weights <nil>
}

// LoadDisk reads the newest committed step, checking every CRC; the
// trackers DLRover and Megatron-LM read name the same step.
func ExampleLoadDisk() {
	shm, _ := os.MkdirTemp("", "shm")
	dir, _ := os.MkdirTemp("", "ckpt")
	defer os.RemoveAll(shm)
	defer os.RemoveAll(dir)
	ctx := context.Background()
	o, _ := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: 1 << 20, Dir: dir})
	defer o.Remove()
	w, _ := ckpt.NewWriter(ckpt.WriterConfig{Path: o.SegmentPath(0)})
	defer w.Close()
	w.Save(ctx, 7, ckpt.Blob{Name: "model", Data: []byte("w7")})
	o.Persist(ctx, 0)

	ck, _, err := ckpt.LoadDisk(dir, 0)
	fmt.Println(ck.Step, string(ck.Blob("model")), err)
	b, _ := os.ReadFile(dir + "/" + layout.DLRoverTrackerFile)
	fmt.Println(string(b))
	// Output:
	// 7 w7 <nil>
	// 7
}

// A tool with no owner at hand finds the step every shard of a job holds
// intact (here shard 1 never saved step 2) and loads each shard at it,
// read-only.
func ExampleCommonStep() {
	shm, _ := os.MkdirTemp("", "shm")
	dir, _ := os.MkdirTemp("", "ckpt")
	defer os.RemoveAll(shm)
	defer os.RemoveAll(dir)
	ctx := context.Background()
	o, _ := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: shm, Shards: []int{0, 1}, Capacity: 1 << 20, Dir: dir})
	defer o.Remove()
	segs := map[int]string{}
	for s := range 2 {
		segs[s] = o.SegmentPath(s)
		w, _ := ckpt.NewWriter(ckpt.WriterConfig{Path: segs[s]})
		defer w.Close()
		w.Save(ctx, 1, ckpt.Blob{Name: "model", Data: []byte{byte(s)}})
		if s == 0 {
			w.Save(ctx, 2, ckpt.Blob{Name: "model", Data: []byte{2}})
		}
	}

	step, why, err := ckpt.CommonStep(dir, segs)
	fmt.Println(step, why, err)
	ck, rep, err := ckpt.LoadShard(segs[0], dir, 0, step)
	fmt.Println(rep.Tier, ck.Step, ck.Blob("model"), err)
	// Output:
	// 1 [step 2: shard 1 holds it in no tier] <nil>
	// memory 1 [0] <nil>
}

// PickPeers sends a node's replicas under another switch.
func ExamplePickPeers() {
	nodes := []string{"node-0", "node-1", "node-2", "node-3"}
	asw := map[string]string{"node-0": "asw-a", "node-1": "asw-a", "node-2": "asw-b", "node-3": "asw-b"}
	fmt.Println(ckpt.PickPeers("node-0", nodes, asw, 1))
	fmt.Println(ckpt.PickPeers("node-3", nodes, asw, 2))
	// Output:
	// [node-2]
	// [node-0 node-1]
}
