package taskd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// faultStore is the job's fault log and, with a StateDir, the file that
// keeps it across restarts (faults.jsonl). It has a lock of its own, so
// that heartbeats never wait behind fault work, and taking a fault in
// costs O(1) under it. One goroutine (run) writes and syncs the file off
// every lock, one fsync for whatever came in meanwhile, and rewrites it
// when it holds twice the faults kept; a caller that must not acknowledge
// a fault before it is on disk waits for it (wait).
type faultStore struct {
	log *slog.Logger
	max int

	mu       sync.Mutex
	faults   *faultLog
	pending  []byte        // lines taken in and not yet written
	last     uint64        // Seq of the newest fault taken in
	synced   uint64        // the faults up to this Seq are written
	syncedCh chan struct{} // closed, and replaced, when synced moves

	kick  chan struct{} // wakes run
	done  chan struct{} // closed once run wrote its last
	name  string        // the file; "" without a StateDir
	file  *os.File      // run's once it runs
	lines int           // lines in file; run's
}

// errStoreClosed is what a wait for a fault that will never be written
// returns: the manager stops.
var errStoreClosed = errors.New("taskd: manager stopping: fault log closed")

func newFaultStore(max int, log *slog.Logger) *faultStore {
	return &faultStore{log: log, max: max, faults: newFaultLog(max), syncedCh: make(chan struct{}), kick: make(chan struct{}, 1), done: make(chan struct{})}
}

// load reads the fault log kept in dir and opens its file for appending.
// It reads the file a line at a time and keeps the newest faults the log
// holds, so that a file of any length costs what is kept. A torn last
// line (a write a crash cut short, never acknowledged) is cut off; any
// other bad line is an error that names it, and the file is left as it
// is.
func (s *faultStore) load(dir string) error {
	name := filepath.Join(dir, "faults.jsonl")
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("taskd: state file: %w", err)
	}
	lines := 0
	tail, err := readFaultLog(f, func(flt Fault) {
		s.faults.restore(flt)
		lines++
	})
	if err != nil {
		f.Close()
		return fmt.Errorf("taskd: state file %s: %w", name, err)
	}
	if end, err := f.Seek(0, io.SeekEnd); err != nil {
		f.Close()
		return fmt.Errorf("taskd: state file %s: %w", name, err)
	} else if tail < end {
		s.log.Warn("taskd: dropping a torn last line of the fault log", "file", name, "offset", tail)
		if err := f.Truncate(tail); err != nil {
			f.Close()
			return fmt.Errorf("taskd: state file %s: %w", name, err)
		}
		if _, err := f.Seek(tail, io.SeekStart); err != nil {
			f.Close()
			return fmt.Errorf("taskd: state file %s: %w", name, err)
		}
	}
	s.name, s.file, s.lines = name, f, lines
	s.last, s.synced = s.faults.next-1, s.faults.next-1
	return nil
}

// add takes f in. It returns the fault as logged, and false when a fault
// with its ID was logged already (then the one logged).
func (s *faultStore) add(f Fault, now time.Time) (Fault, bool) {
	s.mu.Lock()
	stored, fresh := s.faults.add(f, now)
	if fresh && s.name != "" {
		b, err := marshalFault(stored)
		if err != nil {
			s.log.Error("taskd: marshal fault", "id", stored.ID, "err", err)
		}
		s.pending = append(s.pending, b...)
		s.last = stored.Seq
	}
	s.mu.Unlock()
	if fresh && s.name != "" {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
	return stored, fresh
}

// wait returns once the faults up to seq are written, or with an error
// when ctx ends or the manager stops first. Without a StateDir it returns
// at once.
func (s *faultStore) wait(ctx context.Context, seq uint64) error {
	if s.name == "" {
		return nil
	}
	for {
		s.mu.Lock()
		synced, ch := s.synced, s.syncedCh
		s.mu.Unlock()
		if synced >= seq {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.done:
			return errStoreClosed
		}
	}
}

// after returns the faults with Seq above seq, oldest first.
func (s *faultStore) after(seq uint64) []Fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faults.after(seq)
}

// newest returns the Seq of the newest fault taken in, 0 when none.
func (s *faultStore) newest() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faults.next - 1
}

// page returns at most limit faults with Seq above seq, oldest first.
func (s *faultStore) page(seq uint64, limit int) []Fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faults.page(seq, limit)
}

// run writes what is taken in until ctx ends, then what is left, and
// closes the file.
func (s *faultStore) run(ctx context.Context) {
	defer close(s.done)
	if s.name == "" {
		return
	}
	defer s.closeFile()
	for {
		select {
		case <-ctx.Done():
			s.flush()
			return
		case <-s.kick:
			s.flush()
		}
	}
}

// flush writes and syncs the pending lines, then, when the file holds
// twice the faults kept, rewrites it with those alone. A write error is
// logged: the faults stay in memory.
func (s *faultStore) flush() {
	s.mu.Lock()
	buf, last := s.pending, s.last
	s.pending = nil
	s.mu.Unlock()
	if len(buf) == 0 {
		return
	}
	if _, err := s.file.Write(buf); err != nil {
		s.log.Error("taskd: fault log not saved", "file", s.name, "err", err)
	} else if err := s.file.Sync(); err != nil {
		s.log.Error("taskd: fault log not synced", "file", s.name, "err", err)
	}
	s.lines += bytes.Count(buf, []byte{'\n'})
	s.setSynced(last)
	if s.lines > 2*s.max {
		s.compact()
	}
}

func (s *faultStore) setSynced(seq uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if seq > s.synced {
		s.synced = seq
		close(s.syncedCh)
		s.syncedCh = make(chan struct{})
	}
}

// compact rewrites the file with the faults held. It copies them under
// the lock (once per max faults taken in) and writes off it; what comes in
// meanwhile stays pending for the new file.
func (s *faultStore) compact() {
	s.mu.Lock()
	held := make([]Fault, s.faults.len())
	for i := range held {
		held[i] = *s.faults.at(i) // stored faults are never changed: no deep copy
	}
	s.pending = nil
	last := s.last
	s.mu.Unlock()
	var buf []byte
	for _, f := range held {
		b, err := marshalFault(f)
		if err != nil {
			continue
		}
		buf = append(buf, b...)
	}
	if err := atomicfile.WriteFile(s.name, buf, 0o644); err != nil {
		s.log.Error("taskd: fault log not compacted", "file", s.name, "err", err)
		s.requeue(held)
		return
	}
	f, err := os.OpenFile(s.name, os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.log.Error("taskd: fault log reopen", "file", s.name, "err", err)
		s.requeue(held)
		return
	}
	s.file.Close()
	s.file, s.lines = f, len(held)
	s.setSynced(last)
}

// requeue puts back as pending the faults a failed compaction took and
// had not written before, so that a flush appends them to the old file.
func (s *faultStore) requeue(held []Fault) {
	s.mu.Lock()
	synced := s.synced
	s.mu.Unlock()
	var buf []byte
	for _, f := range held {
		if f.Seq > synced {
			b, _ := marshalFault(f)
			buf = append(buf, b...)
		}
	}
	s.mu.Lock()
	s.pending = append(buf, s.pending...)
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// closeFile closes the file; for a manager that never ran, or at the end
// of run.
func (s *faultStore) closeFile() {
	if s.file != nil {
		s.file.Close()
		s.file = nil
	}
}
