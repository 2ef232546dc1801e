package python_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
)

// stubAgent answers a rank's requests on a unix socket from a real
// ckpt.Owner of one shard: what the node agent of faultline-run does for
// checkpoints, and no more (hello, segment, saved, load, wait). A segment
// asked for larger halves grows (Owner.Grow).
type stubAgent struct {
	sock  string
	owner *ckpt.Owner
	dir   string // the disk tier
	// seal makes "saved" seal the step before it answers; otherwise the
	// owner's Run loop, if any, does it later.
	seal bool
	// quickLoad answers load from InspectSegment alone, which checks no
	// blob of a step not sealed yet: for benchmarks of the rank's side of
	// a load.
	quickLoad bool

	ln    net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]bool
	ops   []string
}

func startAgent(t testing.TB, owner *ckpt.Owner, dir string, seal bool) *stubAgent {
	t.Helper()
	sockDir, err := os.MkdirTemp("", "fl-agent-") // short: sun_path holds 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	a := &stubAgent{sock: filepath.Join(sockDir, "s"), owner: owner, dir: dir, seal: seal, conns: map[net.Conn]bool{}}
	if a.ln, err = net.Listen("unix", a.sock); err != nil {
		t.Fatal(err)
	}
	a.wg.Add(1)
	go a.serve()
	t.Cleanup(func() {
		a.ln.Close()
		a.mu.Lock()
		for c := range a.conns {
			c.Close()
		}
		a.mu.Unlock()
		a.wg.Wait()
		os.RemoveAll(sockDir)
	})
	return a
}

func (a *stubAgent) serve() {
	defer a.wg.Done()
	for {
		c, err := a.ln.Accept()
		if err != nil {
			return
		}
		a.mu.Lock()
		a.conns[c] = true
		a.mu.Unlock()
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			defer c.Close()
			sc := bufio.NewScanner(c)
			sc.Buffer(nil, 1<<20)
			for sc.Scan() {
				resp := a.answer(sc.Bytes())
				b, _ := json.Marshal(resp)
				if _, err := c.Write(append(b, '\n')); err != nil {
					return
				}
			}
		}()
	}
}

func (a *stubAgent) answer(line []byte) map[string]any {
	var req struct {
		Op      string  `json:"op"`
		Step    int64   `json:"step"`
		Persist bool    `json:"persist"`
		Bytes   int64   `json:"bytes"`
		Timeout float64 `json:"timeout_s"`
	}
	if err := json.Unmarshal(line, &req); err != nil {
		return map[string]any{"ok": false, "error": err.Error()}
	}
	a.mu.Lock()
	a.ops = append(a.ops, req.Op)
	a.mu.Unlock()
	resp, err := a.handle(req.Op, req.Step, req.Persist, req.Bytes)
	if err != nil {
		return map[string]any{"ok": false, "error": fmt.Sprintf("op %s: %v", req.Op, err)}
	}
	resp["ok"] = true
	return resp
}

func (a *stubAgent) handle(op string, step int64, persist bool, need int64) (map[string]any, error) {
	ctx := context.Background()
	path := a.owner.SegmentPath(0)
	switch op {
	case "hello":
		return map[string]any{"job": "xlang", "world": 1, "resume_step": -1, "restart_count": 0, "collective_timeout_s": 0}, nil
	case "groups":
		return map[string]any{}, nil
	case "segment":
		rep, err := ckpt.InspectSegment(path)
		if err != nil {
			return nil, err
		}
		half := rep.Header.HalfSize
		if need > half {
			if half, err = a.owner.Grow(0, need); err != nil {
				return nil, err
			}
		}
		return map[string]any{"path": path, "half_size": half}, nil
	case "saved":
		var err error
		switch {
		case persist:
			_, err = a.owner.Persist(ctx, 0)
		case a.seal:
			err = a.owner.Seal(ctx, 0)
		}
		return map[string]any{}, err
	case "load":
		if a.quickLoad {
			seg, err := ckpt.InspectSegment(path)
			if err != nil || seg.NewestHalf < 0 {
				return nil, fmt.Errorf("no step in %s: %v", path, err)
			}
			return map[string]any{"step": seg.Halves[seg.NewestHalf].Meta.Step, "tier": "memory", "path": path, "half": seg.NewestHalf}, nil
		}
		_, rep, err := a.owner.Load(ctx, 0)
		if errors.Is(err, ckpt.ErrNoStep) {
			return map[string]any{"step": -1, "tier": "none", "reasons": []string{rep.String()}}, nil
		}
		if err != nil {
			return nil, err
		}
		seg, err := ckpt.InspectSegment(path)
		if err != nil {
			return nil, err
		}
		h := seg.NewestHalf
		if h < 0 || seg.Halves[h].Meta.Step != rep.Step {
			return nil, fmt.Errorf("loaded step %d, but the newest half of %s is %d", rep.Step, path, h)
		}
		return map[string]any{"step": rep.Step, "tier": string(rep.Tier), "path": path, "half": h}, nil
	case "wait":
		b, err := os.ReadFile(filepath.Join(a.dir, layout.DLRoverTrackerFile))
		if err != nil {
			return nil, err
		}
		got, err := layout.ParseStepText(b)
		if err != nil || got < step {
			return nil, fmt.Errorf("step %d not committed (tracker: %d, %v)", step, got, err)
		}
		return map[string]any{"step": got}, nil
	}
	return nil, errors.New("unknown op")
}
