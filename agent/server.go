package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/trace"
)

// maxRequest bounds one request line of a rank.
const maxRequest = 4 << 20

// server is the agent's unix socket, on which the ranks' faultline
// package asks for their checkpoint segment, says what they saved, and
// learns what to load; spares wait there for a rank to run.
type server struct {
	a  *Agent
	ln *net.UnixListener

	mu    sync.Mutex
	conns map[net.Conn]bool
	wg    sync.WaitGroup
}

// request is one line from a rank (see the package doc for the protocol).
type request struct {
	Op        string          `json:"op"`
	Rank      *int            `json:"rank"`
	Pid       int             `json:"pid"`
	LocalRank *int            `json:"local_rank"`
	Dir       string          `json:"dir"`
	Bytes     int64           `json:"bytes"`
	Step      *int64          `json:"step"`
	Persist   bool            `json:"persist"`
	TimeoutS  float64         `json:"timeout_s"`
	What      string          `json:"what"`
	Groups    json.RawMessage `json:"groups"`
}

func listen(a *Agent) (*server, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: a.sock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("agent: socket %s: %w", a.sock, err)
	}
	if err := os.Chmod(a.sock, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("agent: socket %s: %w", a.sock, err)
	}
	return &server{a: a, ln: ln, conns: map[net.Conn]bool{}}, nil
}

// serve accepts connections until ctx ends.
func (srv *server) serve(ctx context.Context) {
	stop := context.AfterFunc(ctx, func() { srv.ln.Close() })
	defer stop()
	srv.a.ckpts.run(ctx)
	for {
		c, err := srv.ln.AcceptUnix()
		if err != nil {
			break
		}
		srv.mu.Lock()
		srv.conns[c] = true
		srv.mu.Unlock()
		srv.wg.Go(func() { srv.handle(ctx, c) })
	}
	srv.mu.Lock()
	for c := range srv.conns {
		c.Close()
	}
	srv.mu.Unlock()
	srv.wg.Wait()
}

func (srv *server) close() { srv.ln.Close() }

// peerPid is the pid of the process at the other end of c.
func peerPid(c *net.UnixConn) int {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	pid := 0
	raw.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			pid = int(cred.Pid)
		}
	})
	return pid
}

// handle serves one connection: one response per request line, in order.
func (srv *server) handle(ctx context.Context, c *net.UnixConn) {
	kept := false // handed to a spare's launch
	defer func() {
		srv.mu.Lock()
		delete(srv.conns, c)
		srv.mu.Unlock()
		if !kept {
			c.Close()
		}
	}()
	pid := peerPid(c)
	sc := bufio.NewScanner(c)
	sc.Buffer(make([]byte, 64<<10), maxRequest)
	enc := json.NewEncoder(c)
	for sc.Scan() {
		var req request
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			enc.Encode(map[string]any{"ok": false, "error": fmt.Sprintf("agent: a request that is not a JSON object: %v", err)})
			continue
		}
		if req.Op == "spare" {
			if s := srv.slotOfPid(pid); s != nil && s.offer(pid, c) {
				kept = true
				return // the launch answers
			}
			enc.Encode(map[string]any{"ok": false, "error": fmt.Sprintf("agent: pid %d is no spare of this agent", pid)})
			continue
		}
		resp, err := srv.do(ctx, pid, &req)
		if err != nil {
			resp = map[string]any{"ok": false, "error": err.Error()}
		} else {
			resp["ok"] = true
		}
		if err := enc.Encode(resp); err != nil {
			return
		}
	}
}

// slotOfPid returns the slot whose process or spare pid is.
func (srv *server) slotOfPid(pid int) *slot {
	for _, s := range srv.a.slots {
		s.mu.Lock()
		ok := s.proc != nil && s.proc.pid == pid || s.spare != nil && s.spare.p.pid == pid
		s.mu.Unlock()
		if ok {
			return s
		}
	}
	return nil
}

// errUnknownRank: a request from a process that is no rank of this agent.
var errUnknownRank = errors.New("agent: the requesting process is no rank of this agent")

// do carries out one request of a rank.
func (srv *server) do(ctx context.Context, pid int, req *request) (map[string]any, error) {
	a := srv.a
	s := srv.slotOfPid(pid)
	if s == nil && req.Rank != nil {
		s = a.slotOf(*req.Rank)
	}
	if s == nil && req.Op != "admin" {
		return nil, fmt.Errorf("%w (pid %d, op %q): start it with faultline-run", errUnknownRank, pid, req.Op)
	}
	switch req.Op {
	case "hello":
		s.mu.Lock()
		resume, restart := s.resume, s.starts-1
		if s.proc != nil && s.proc.pid == pid {
			s.proc.hello = true
		}
		s.mu.Unlock()
		return map[string]any{"job": a.cfg.Job, "world": a.world, "resume_step": resume, "restart_count": restart,
			"collective_timeout_s": a.cfg.CollectiveTimeout.Seconds(), "stack_signal": int(stackSignal)}, nil
	case "groups":
		g, err := trace.ParseParallelGroups(req.Groups)
		if err != nil {
			return nil, fmt.Errorf("agent: groups of rank %d: %w", s.rank, err)
		}
		if err := s.rec.WriteParallelGroups(g); err != nil {
			return nil, fmt.Errorf("agent: groups of rank %d: %w", s.rank, err)
		}
		return map[string]any{}, nil
	case "segment":
		if req.Bytes <= 0 {
			return nil, fmt.Errorf("agent: segment: bytes = %d: give the size of the state to save", req.Bytes)
		}
		path, half, err := a.ckpts.segment(s.rank, req.Dir, req.Bytes)
		if err != nil {
			return nil, fmt.Errorf("agent: segment: %w", err)
		}
		return map[string]any{"path": path, "half_size": half}, nil
	case "saved", "abandoned", "wait":
		if req.Step == nil {
			return nil, fmt.Errorf("agent: %s: give the step", req.Op)
		}
		step := *req.Step
		switch req.Op {
		case "saved":
			a.incident.saved(s.rank, step)
			s.mu.Lock()
			s.saved = max(s.saved, step)
			s.mu.Unlock()
		case "abandoned":
			a.ckpts.abandon(s, step, req.What)
		case "wait":
			timeout := time.Duration(req.TimeoutS * float64(time.Second))
			if timeout <= 0 {
				timeout = 10 * time.Minute
			}
			got, err := a.ckpts.wait(ctx, step, timeout)
			if err != nil {
				return nil, fmt.Errorf("agent: wait: %w", err)
			}
			return map[string]any{"step": got}, nil
		}
		return map[string]any{}, nil
	case "held":
		c := a.ckpts
		c.mu.Lock()
		err := c.setDirLocked(req.Dir)
		c.mu.Unlock()
		if err != nil {
			return nil, fmt.Errorf("agent: held: %w", err)
		}
		steps, disk, committed := c.heldSteps(s.rank)
		return map[string]any{"steps": steps, "disk": disk, "committed": committed}, nil
	case "load":
		ans, err := a.ckpts.load(ctx, s, pid, req.Dir, req.Step)
		if err != nil {
			return nil, fmt.Errorf("agent: load: %w", err)
		}
		a.incident.loaded(s.rank, ans.Step, ans.Tier)
		return map[string]any{"step": ans.Step, "tier": ans.Tier, "path": ans.Path, "half": ans.Half, "reasons": ans.Reasons}, nil
	case "admin":
		res, err := a.admin(req.What)
		if err != nil {
			return nil, err
		}
		return map[string]any{"result": res}, nil
	}
	return nil, fmt.Errorf("agent: unknown op %q (hello, groups, segment, saved, abandoned, wait, held, load, admin, spare)", req.Op)
}

// admin answers what the manager's Admin API serves, from node 0's
// manager.
func (a *Agent) admin(what string) (any, error) {
	m := a.mgr
	if m == nil {
		return nil, fmt.Errorf("agent: admin: this node's agent runs no manager; ask node 0's (or the manager at %s)", a.mgrAddr)
	}
	switch what {
	case "members":
		var out []map[string]any
		for _, mi := range m.Members() {
			out = append(out, map[string]any{"role": mi.Role.String(), "node": mi.Position.Node, "rank": mi.Position.Rank,
				"via": mi.Via, "host": mi.Hostname, "pid": mi.PID, "since": mi.Since, "last_seen": mi.LastSeen})
		}
		return out, nil
	case "switch":
		return m.SwitchStatus(), nil
	case "faults":
		return m.Faults(0), nil
	case "orchestrations":
		return m.Orchestrations(0), nil
	}
	return nil, fmt.Errorf("agent: admin: what = %q: one of members, switch, faults, orchestrations", what)
}
