package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// storeBoot is what the store process runs (faultline.store).
const storeBoot = "import faultline.store as s; s.main()"

// runStore keeps the job's c10d store running on MasterAddr:MasterPort
// until ctx ends, as torchrun's agent does: the ranks connect to it as
// clients (TORCHELASTIC_USE_AGENT_STORE) and key their rendezvous by their
// restart count, so that restarted ranks find a live store at once rather
// than wait for a new rank 0 to bind the port. ready is closed once it
// serves; a store that dies is started again.
func (a *Agent) runStore(ctx context.Context, ready chan<- struct{}) error {
	c := &a.cfg
	once := false
	for ctx.Err() == nil {
		cmd := exec.CommandContext(ctx, c.Python, "-c", storeBoot)
		cmd.Env = append(append([]string(nil), c.Env...), "MASTER_ADDR="+c.MasterAddr, "MASTER_PORT="+strconv.Itoa(c.MasterPort),
			"WORLD_SIZE="+strconv.Itoa(a.world), "PYTHONPATH="+c.PythonPath, "PYTHONUNBUFFERED=1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		cmd.Stderr = newLineWriter(c.Stderr, "[store]: ")
		out, err := cmd.StdoutPipe()
		if err != nil {
			return err
		}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("agent: the job's store (%s -c %q): %w", c.Python, storeBoot, err)
		}
		sc := bufio.NewScanner(out)
		served := false
		for sc.Scan() {
			if strings.TrimSpace(sc.Text()) == "ready" && !served {
				served = true
				if !once {
					once = true
					close(ready)
				}
			}
		}
		err = cmd.Wait()
		if ctx.Err() != nil {
			return nil
		}
		if !served {
			return fmt.Errorf("agent: the job's store on %s did not start (is port %d free? it is --master-port): %v",
				net.JoinHostPort(c.MasterAddr, strconv.Itoa(c.MasterPort)), c.MasterPort, err)
		}
		a.log.Error("agent: the job's store died; starting it again", "err", err)
		fmt.Fprintf(c.Stderr, "faultline-run: the job's store died (%v); starting it again\n", err)
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// storeTimeout bounds the wait for node 0's store, and for the job's
// manager by a node that has not reached it yet.
const storeTimeout = 2 * time.Minute

// errNoStore is returned by Run when the job's store did not start.
var errNoStore = errors.New("agent: the job's store did not start")

// awaitStore waits for the store of node 0 to serve.
func (a *Agent) awaitStore(ctx context.Context, ready <-chan struct{}, failed <-chan error) error {
	t := time.NewTimer(storeTimeout)
	defer t.Stop()
	select {
	case <-ready:
		return nil
	case err := <-failed:
		return err
	case <-t.C:
		return fmt.Errorf("%w within %v", errNoStore, storeTimeout)
	case <-a.term:
		return fmt.Errorf("%w by %s before the store served", ErrTerminated, unix.SignalName(a.terminating()))
	case <-ctx.Done():
		return ctx.Err()
	}
}
