package agent

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// JobFile, in Config.Out, names the job whose results the folder holds.
// The agent that runs there holds a lock on it.
const JobFile = "job"

// PreviousDir, in Config.Out, keeps the results of the jobs that ran there
// before, each in a folder named by its id.
const PreviousDir = "previous"

// errOutInUse: another agent runs with the same Config.Out.
var errOutInUse = errors.New("agent: the output folder is in use")

// results are the names in Out of what an agent writes for its job: they
// are moved aside when a job of another id starts there.
func results(out string) []string {
	var names []string
	for _, n := range []string{IncidentsFile, "slownode.json", "slownode.txt", "slownode.html", "manager"} {
		if _, err := os.Lstat(filepath.Join(out, n)); err == nil {
			names = append(names, n)
		}
	}
	dirs, _ := filepath.Glob(filepath.Join(out, "incident-*"))
	for _, d := range dirs {
		names = append(names, filepath.Base(d))
	}
	return names
}

// claimOut locks Out for the agent's job and, when it holds the results
// of another job, moves them to Out/previous/<that job>, saying so: a job
// started again with its own id goes on where it was, a new one starts
// afresh. It returns what releases the lock.
func (a *Agent) claimOut() (release func(), err error) {
	out := a.cfg.Out
	path := filepath.Join(out, JobFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o644)
	if err != nil {
		return nil, fmt.Errorf("agent: Out: %w", err)
	}
	prev, rerr := readJobFile(f)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is used by another agent now (job %q): give each its own Out (--out)", errOutInUse, out, prev)
		}
		return nil, fmt.Errorf("agent: Out: lock %s: %w", path, err)
	}
	prev, rerr = readJobFile(f) // as the last holder left it
	if rerr != nil {
		f.Close()
		return nil, fmt.Errorf("agent: Out: %s: %w", path, rerr)
	}
	if names := results(out); prev != a.cfg.Job && len(names) > 0 {
		if err := a.moveAside(prev, names); err != nil {
			f.Close()
			return nil, err
		}
	}
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteAt([]byte(a.cfg.Job+"\n"), 0)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("agent: Out: %s: %w", path, err)
	}
	return func() { f.Close() }, nil
}

// readJobFile returns the job the open job file names, "" when empty.
func readJobFile(f *os.File) (string, error) {
	b := make([]byte, 4096)
	n, err := f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", err
	}
	return strings.TrimSpace(string(b[:n])), nil
}

// moveAside moves names, the results of job prev ("" when unknown: an
// earlier version's), from Out to Out/previous/<prev>.
func (a *Agent) moveAside(prev string, names []string) error {
	out := a.cfg.Out
	base := prev
	if base == "" {
		base = "unknown"
	}
	dest := filepath.Join(out, PreviousDir, base)
	for i := 2; ; i++ {
		if _, err := os.Lstat(dest); errors.Is(err, os.ErrNotExist) {
			break
		}
		dest = filepath.Join(out, PreviousDir, base+"."+strconv.Itoa(i))
	}
	if err := os.MkdirAll(dest, 0o750); err != nil {
		return fmt.Errorf("agent: Out: %w", err)
	}
	for _, n := range names {
		if err := os.Rename(filepath.Join(out, n), filepath.Join(dest, n)); err != nil {
			return fmt.Errorf("agent: Out: move the previous job's %s aside: %w", n, err)
		}
	}
	what := fmt.Sprintf("job %q", prev)
	if prev == "" {
		what = "an earlier job"
	}
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s held the results of %s; moved them to %s\n", out, what, dest)
	return nil
}

// lastIncident returns the highest incident number that Out holds (a
// line of incidents.jsonl, or an incident folder), 0 when none: a job
// started again numbers its incidents on from it.
func lastIncident(out string) int {
	n := 0
	dirs, _ := filepath.Glob(filepath.Join(out, "incident-*"))
	for _, d := range dirs {
		if k, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "incident-")); err == nil {
			n = max(n, k)
		}
	}
	f, err := os.Open(filepath.Join(out, IncidentsFile))
	if err != nil {
		return n
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var c struct {
			ID int `json:"id"`
		}
		if json.Unmarshal(sc.Bytes(), &c) == nil {
			n = max(n, c.ID)
		}
	}
	return n
}
