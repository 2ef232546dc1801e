package taskd

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode/utf8"
)

// FaultKind says what went wrong. The constants are the kinds taskd and the
// other faultline packages raise; a reporter may use others.
type FaultKind string

// Fault kinds.
const (
	FaultProcessExit FaultKind = "process_exit" // a training process exited; Code is its exit status
	FaultOpError     FaultKind = "op_error"     // an operator or device call failed; Code is its error code
	FaultHang        FaultKind = "hang"         // a kernel or collective exceeded its timeout
	FaultSlowNode    FaultKind = "slow_node"    // a slow-node verdict for the position
	FaultLink        FaultKind = "link"         // a network link or NIC is down or degraded
	FaultLost        FaultKind = "lost"         // raised by the manager: heartbeats stopped; Time is the last one
	FaultStressTest  FaultKind = "stress_test"  // an online stress test found the rank's devices failing
)

// Fault is one entry of a job's fault log. Later orchestration (process
// recovery, link failover, rescheduling) consumes it.
type Fault struct {
	// Seq orders the log: the manager assigns 1, 2, ... as it takes faults
	// in. Zero in a fault not yet taken in.
	Seq uint64 `json:"seq"`
	// ID is unique per fault; a report sent twice carries one ID and is
	// logged once. Worker.ReportFault fills it in.
	ID   string    `json:"id"`
	Kind FaultKind `json:"kind"`
	// Position is where the fault is: a rank, or a whole node when Rank is -1.
	Position Position `json:"position"`
	// Code is an exit status or error code, 0 when none applies.
	Code    int    `json:"code,omitempty"`
	Message string `json:"message,omitempty"`
	// Attrs carries what else the reporter knows. Well-known keys, which
	// recovery and rescheduling read: "signal" (the signal that ended a
	// process, e.g. "SIGKILL"), "host", "pod", "log" (a log line that
	// matched), "device" (an accelerator index), "link" (a NIC or peer).
	Attrs map[string]string `json:"attrs,omitempty"`
	// Time is when the reporter saw the fault (zero when it said a time
	// more than a minute ahead of the manager's clock or more than a week
	// behind); Received when the manager took it in.
	Time     time.Time `json:"time"`
	Received time.Time `json:"received"`
	// Reporter is who reported it (the manager itself for FaultLost).
	Reporter     Position `json:"reporter"`
	ReporterRole Role     `json:"reporter_role"`
}

// Bounds of a fault's fields: a longer message or attribute value is cut,
// attributes past the most are dropped (the first, by key, kept), and a
// longer or odd kind is refused.
const (
	MaxFaultKindBytes    = 64
	MaxFaultMessageBytes = 4 << 10
	MaxFaultAttrs        = 32
	MaxFaultAttrBytes    = 1 << 10 // a key or a value
)

// knownKinds are the kinds that are metric labels of their own; any other
// is counted as "other", so that reporters cannot make series without end.
var knownKinds = map[FaultKind]bool{FaultProcessExit: true, FaultOpError: true, FaultHang: true, FaultSlowNode: true, FaultLink: true, FaultLost: true, FaultStressTest: true}

// kindLabel is the metric label of kind k.
func kindLabel(k FaultKind) string {
	if knownKinds[k] {
		return string(k)
	}
	return "other"
}

// checkKind says what is wrong with a fault kind: empty, too long, or
// holding other than letters, digits and "_-.:/".
func checkKind(k FaultKind) error {
	if k == "" || len(k) > MaxFaultKindBytes {
		return fmt.Errorf("length %d, want 1 to %d", len(k), MaxFaultKindBytes)
	}
	for _, r := range k {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("_-.:/", r)) {
			return fmt.Errorf("%q: only letters, digits and _-.:/", k)
		}
	}
	return nil
}

// cut returns s cut to at most n bytes, on a rune boundary. A cut string
// is a copy, so that keeping it does not keep all of s.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return strings.Clone(s[:n])
}

// bounded returns f with its message and attributes cut to their bounds.
func (f Fault) bounded() Fault {
	f.Message = cut(f.Message, MaxFaultMessageBytes)
	if len(f.Attrs) == 0 {
		return f
	}
	keys := slices.Sorted(maps.Keys(f.Attrs))
	attrs := make(map[string]string, min(len(keys), MaxFaultAttrs))
	for _, k := range keys[:min(len(keys), MaxFaultAttrs)] {
		attrs[cut(k, MaxFaultAttrBytes)] = cut(f.Attrs[k], MaxFaultAttrBytes)
	}
	f.Attrs = attrs
	return f
}

func (f Fault) clone() Fault {
	f.Attrs = maps.Clone(f.Attrs)
	return f
}

// faultLog is a job's ordered, de-duplicated fault log, bounded to max
// entries (the oldest go first). It is a ring, so that taking a fault in
// costs the same however full the log is. It is pure: the caller
// serialises access.
type faultLog struct {
	max  int
	ring []Fault           // held faults, oldest at head, Seq increasing
	head int               // index of the oldest
	n    int               // faults held
	ids  map[string]uint64 // ID -> Seq of the faults held
	next uint64            // Seq of the next fault
}

func newFaultLog(max int) *faultLog {
	return &faultLog{max: max, ids: make(map[string]uint64), next: 1}
}

// at returns the i-th oldest fault held.
func (l *faultLog) at(i int) *Fault { return &l.ring[(l.head+i)%len(l.ring)] }

// push appends f, dropping the oldest when the log is full.
func (l *faultLog) push(f Fault) {
	if l.n == len(l.ring) && (l.max <= 0 || l.n < l.max) {
		// Grown by doubling up to max: a log that never fills never takes
		// its memory.
		size := max(2*l.n, 16)
		if l.max > 0 {
			size = min(size, l.max)
		}
		grown := make([]Fault, size)
		for i := range l.n {
			grown[i] = *l.at(i)
		}
		l.ring, l.head = grown, 0
	}
	if l.n < len(l.ring) {
		*l.at(l.n) = f
		l.n++
		return
	}
	old := l.at(0)
	delete(l.ids, old.ID)
	*old = f
	l.head = (l.head + 1) % len(l.ring)
}

// add takes f in, assigning its Seq and Received. It returns the stored
// fault and false when a fault with f's ID is already held.
func (l *faultLog) add(f Fault, now time.Time) (Fault, bool) {
	if seq, dup := l.ids[f.ID]; dup {
		return l.get(seq), false
	}
	f = f.bounded()
	f.Seq = l.next
	f.Received = now
	l.next++
	l.push(f)
	l.ids[f.ID] = f.Seq
	return f, true
}

// restore puts back a fault read from the state file, keeping its Seq.
func (l *faultLog) restore(f Fault) {
	if _, dup := l.ids[f.ID]; dup || f.Seq < l.next {
		return
	}
	l.push(f.bounded())
	l.ids[f.ID] = f.Seq
	l.next = f.Seq + 1
}

// search returns the index of the oldest fault held with Seq > seq, or n.
func (l *faultLog) search(seq uint64) int {
	return sort.Search(l.n, func(i int) bool { return l.at(i).Seq > seq })
}

func (l *faultLog) get(seq uint64) Fault {
	if i := l.search(seq - 1); i < l.n && l.at(i).Seq == seq {
		return l.at(i).clone()
	}
	return Fault{}
}

// after returns the faults with Seq > seq, oldest first.
func (l *faultLog) after(seq uint64) []Fault {
	return l.page(seq, l.n)
}

// page returns at most limit faults with Seq > seq, oldest first.
func (l *faultLog) page(seq uint64, limit int) []Fault {
	i := l.search(seq)
	out := make([]Fault, 0, min(l.n-i, limit))
	for ; i < l.n && len(out) < limit; i++ {
		out = append(out, l.at(i).clone())
	}
	return out
}

// len returns how many faults are held.
func (l *faultLog) len() int { return l.n }

// FaultLogError says which line of a fault log file is bad.
type FaultLogError struct {
	Line int
	Err  error
}

func (e *FaultLogError) Error() string { return fmt.Sprintf("fault log line %d: %v", e.Line, e.Err) }

// Unwrap returns the underlying error.
func (e *FaultLogError) Unwrap() error { return e.Err }

// marshalFault writes f as one JSON line of the fault log file.
func marshalFault(f Fault) ([]byte, error) {
	b, err := json.Marshal(f)
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// maxFaultLineBytes bounds a line of a fault log file: a fault cut to its
// bounds takes a few hundred KiB at most, escaped.
const maxFaultLineBytes = 1 << 20

// parseFaultLog reads a fault log file held in memory (see readFaultLog).
func parseFaultLog(data []byte) (faults []Fault, tail int, err error) {
	n, err := readFaultLog(bytes.NewReader(data), func(f Fault) { faults = append(faults, f) })
	return faults, int(n), err
}

// readFaultLog reads a fault log file from r, one line at a time, and
// gives each fault to each, oldest first, so that a caller keeps only what
// it needs: one JSON fault a line, Seq strictly increasing. A last line
// without its newline is a write torn by a crash: it is ignored (its fault
// was never acknowledged) and tail reports its offset so the caller can
// cut it off; tail is the length read when no line is torn.
func readFaultLog(r io.Reader, each func(Fault)) (tail int64, err error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var (
		line int
		last uint64
		buf  []byte // a line longer than br's buffer
	)
	for {
		raw, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) || (buf != nil && err == nil) {
			buf = append(buf, raw...)
			if len(buf) > maxFaultLineBytes {
				return 0, &FaultLogError{Line: line + 1, Err: fmt.Errorf("longer than %d bytes", maxFaultLineBytes)}
			}
			if err != nil {
				continue
			}
			raw, buf = buf, nil
		}
		if err != nil {
			if err == io.EOF {
				return tail, nil // a torn line, or none
			}
			return tail, err
		}
		line++
		tail += int64(len(raw))
		raw = raw[:len(raw)-1]
		if len(bytes.TrimSpace(raw)) == 0 {
			continue
		}
		var f Fault
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&f); err != nil {
			return 0, &FaultLogError{Line: line, Err: err}
		}
		if dec.More() {
			return 0, &FaultLogError{Line: line, Err: errors.New("data after the fault")}
		}
		switch {
		case f.ID == "":
			return 0, &FaultLogError{Line: line, Err: errors.New(`field "id": empty`)}
		case f.Kind == "":
			return 0, &FaultLogError{Line: line, Err: errors.New(`field "kind": empty`)}
		case f.Seq <= last:
			return 0, &FaultLogError{Line: line, Err: fmt.Errorf(`field "seq": %d after %d`, f.Seq, last)}
		}
		last = f.Seq
		each(f)
	}
}
