package trace

import (
	"encoding/binary"
	"hash/maphash"
	"math"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// The canonical form, as Record.AppendJSON writes it (and MindCluster's
// writer, which uses the same order), is a fixed skeleton of literals
// around nine numbers and two strings. The fast path below compares the
// literals in place, reads each digit once (and the leading digits of a
// timestamp, or the whole object id, not at all when the previous line had
// the same text), and finds the strings by their raw bytes among the last
// few or in a table of those seen before, so a line costs little more than
// one pass over it. Anything else goes to encoding/json, which decides.

// The literals of the canonical form, each before the value it names.
// The longer ones are split in parts of at most 16 bytes: a comparison
// with a constant that short compiles to a few word compares in place.
const (
	litKind   = `{"Kind":`
	litFlag   = `,"Flag":`
	litSource = `,"SourceKind":`
	litTime   = `,"Timestamp":`
	litID     = `,"Id":`
	litPid    = litPidA + litPidB + litPidC
	litPidA   = `,"MsptiObjectId"`
	litPidB   = `:{"Pt":{"Process`
	litPidC   = `Id":`
	litTid    = `,"ThreadId":`
	litDev    = litDevA + litDevB
	litDevA   = `},"Ds":{"DeviceI`
	litDevB   = `d":`
	litStream = `,"StreamId":`
	litName   = `}},"Name":"`  // up to the name's opening quote
	litDomain = `","Domain":"` // from the name's closing quote to the domain's opening one
)

// The ends of lines of the usual domains, from the name's closing quote.
// A line that ends so has its name between litName and the tail, which
// spares a scan for the closing quote (escaped quotes and all, in the JSON
// of a communication op) whenever the name is one seen before.
const (
	tailDefault = `","Domain":"default"}`
	tailComm    = `","Domain":"communication"}`
	tailNone    = `","Domain":""}`
)

// The numbers of the object id, in order.
const (
	fPid = iota
	fTid
	fDev
	fStream
	numIDFields
)

// parseCanonical parses the canonical form into *r. It reports false for
// anything else, leaving the generic path to decide; where it answers, the
// generic path gives the same record (FuzzParseRecord checks it). It reads
// the fields in a straight line: a loop over them, switching on each,
// cost a fifth again as much.
func parseCanonical(b []byte, r *Record, in *interner) bool {
	var kind, flag, source uint32
	var ts, id uint64
	var ok bool
	i := len(litKind)
	if len(b) < i || string(b[:i]) != litKind {
		return false
	}
	if kind, i, ok = u32At(b, i); !ok ||
		len(b)-i < len(litFlag) || string(b[i:i+len(litFlag)]) != litFlag {
		return false
	}
	if flag, i, ok = u32At(b, i+len(litFlag)); !ok ||
		len(b)-i < len(litSource) || string(b[i:i+len(litSource)]) != litSource {
		return false
	}
	if source, i, ok = u32At(b, i+len(litSource)); !ok ||
		len(b)-i < len(litTime) || string(b[i:i+len(litTime)]) != litTime {
		return false
	}
	if ts, i, ok = in.leadingAt(b, i+len(litTime), 0); !ok ||
		len(b)-i < len(litID) || string(b[i:i+len(litID)]) != litID {
		return false
	}
	if id, i, ok = in.leadingAt(b, i+len(litID), 1); !ok {
		return false
	}
	var v [numIDFields]uint32
	if m := in.sameObjectID(b, i); m != nil {
		// The object id is the previous line's, bytes and all, on nearly
		// every line of a thread: compared whole, not read. Its text ends
		// with the Name's key.
		v = m.vals
		i += m.n - len(litName)
	} else {
		mid := i
		if len(b)-i < len(litPid) || string(b[i:i+16]) != litPidA || string(b[i+16:i+32]) != litPidB ||
			string(b[i+32:i+len(litPid)]) != litPidC {
			return false
		}
		if v[fPid], i, ok = u32At(b, i+len(litPid)); !ok ||
			len(b)-i < len(litTid) || string(b[i:i+len(litTid)]) != litTid {
			return false
		}
		if v[fTid], i, ok = u32At(b, i+len(litTid)); !ok {
			return false
		}
		if len(b)-i < len(litDev) || string(b[i:i+16]) != litDevA || string(b[i+16:i+len(litDev)]) != litDevB {
			return false
		}
		if v[fDev], i, ok = u32At(b, i+len(litDev)); !ok ||
			len(b)-i < len(litStream) || string(b[i:i+len(litStream)]) != litStream {
			return false
		}
		if v[fStream], i, ok = u32At(b, i+len(litStream)); !ok {
			return false
		}
		if len(b)-i < len(litName) || string(b[i:i+len(litName)]) != litName {
			return false
		}
		if in != nil && i+len(litName)-mid <= len(in.objectID.raw) {
			m := &in.objectID
			m.n = copy(m.raw[:], b[mid:i+len(litName)])
			m.vals = v
		}
	}
	r.Kind, r.Flag, r.SourceKind = kind, Flag(flag), source
	r.Timestamp, r.ID = ts, id
	r.ProcessID, r.ThreadID, r.DeviceID, r.StreamID = v[fPid], v[fTid], v[fDev], v[fStream]
	return parseStrings(b, i+len(litName), r, in)
}

// digitsAt continues the decimal number u at b[j:], a digit at a time,
// and returns it and the index after it. Digit by digit: the loop runs
// ahead on the branch predictor, which measured faster than reading
// eight digits at a time, whose every step waits on the one before.
func digitsAt(b []byte, j int, u uint64) (uint64, int) {
	for ; j < len(b); j++ {
		c := b[j] - '0'
		if c > 9 {
			break
		}
		u = u*10 + uint64(c)
	}
	return u, j
}

// uintAt reads the unsigned number at b[i:] and returns it and the index
// after it. It reports false for no number, one JSON refuses (a leading
// zero), or one of 20 digits, which may overflow: the generic path
// decides those.
func uintAt(b []byte, i int) (uint64, int, bool) {
	u, j := digitsAt(b, i, 0)
	d := j - i
	return u, j, d > 0 && d <= 19 && (d == 1 || b[i] != '0')
}

// u32At is uintAt for a 32-bit field, which may also hold -1: mspti
// writes it in the half of its object id union that does not apply, and
// the generic path reads it as 1<<32-1 too.
func u32At(b []byte, i int) (uint32, int, bool) {
	u, j, ok := uintAt(b, i)
	if j == i && minusOne(b, i) {
		return math.MaxUint32, i + 2, true
	}
	return uint32(u), j, ok && u <= math.MaxUint32
}

// leadingAt is uintAt for the timestamp (k 0) or the id (k 1), whose
// leading digits the interner remembers from the previous line: they are
// not read again. Timestamps, and ids that count from one, share them
// with the previous line's.
func (in *interner) leadingAt(b []byte, i, k int) (uint64, int, bool) {
	if in == nil {
		return uintAt(b, i)
	}
	m := &in.leading[k]
	if m.digits != 0 && len(b)-i >= 8 && binary.LittleEndian.Uint64(b[i:]) == m.digits {
		// The remembered digits start with no zero.
		u, j := digitsAt(b, i+8, m.value)
		return u, j, j-i <= 19
	}
	u, j, ok := uintAt(b, i)
	if ok && j-i > 8 {
		m.digits, m.value = binary.LittleEndian.Uint64(b[i:]), u/pow10[j-i-8]
	}
	return u, j, ok
}

// sameObjectID returns the remembered object id if b holds its text at i.
func (in *interner) sameObjectID(b []byte, i int) *objectID {
	if in == nil {
		return nil
	}
	m := &in.objectID
	if m.n > 0 && len(b)-i >= m.n && string(b[i:i+m.n]) == string(m.raw[:m.n]) {
		return m
	}
	return nil
}

// parseStrings reads the Name from b[i:], just after its opening quote,
// and the Domain after it, to the end of the line.
func parseStrings(b []byte, i int, r *Record, in *interner) bool {
	end, dom := -1, ""
	if len(b) >= len(tailComm) {
		switch b[len(b)-3] { // tells the tails apart before they are compared
		case 't':
			if string(b[len(b)-len(tailDefault):]) == tailDefault {
				end, dom = len(b)-len(tailDefault), DomainDefault
			}
		case 'n':
			if string(b[len(b)-len(tailComm):]) == tailComm {
				end, dom = len(b)-len(tailComm), DomainCommunication
			}
		case '"':
			if string(b[len(b)-len(tailNone):]) == tailNone {
				end = len(b) - len(tailNone)
			}
		}
	}
	if end >= i {
		// The name is valid only if no unescaped quote ends it earlier:
		// in.get checks that, and finds a name seen before at the cost of a
		// hash of its bytes.
		if name, ok := in.get(b[i:end]); ok {
			r.Name, r.Domain = name, dom
			return true
		}
	}
	// Another domain, or a line that only looks like it ends with one.
	j := closingQuote(b, i)
	if j < 0 || len(b)-j < len(litDomain) || string(b[j:j+len(litDomain)]) != litDomain {
		return false
	}
	k := closingQuote(b, j+len(litDomain))
	if k != len(b)-2 || b[k+1] != '}' {
		return false
	}
	name, ok := in.get(b[i:j])
	if !ok {
		return false
	}
	domain, ok := in.get(b[j+len(litDomain) : k])
	if !ok {
		return false
	}
	r.Name, r.Domain = name, domain
	return true
}

// closingQuote returns the index of the quote that ends the JSON string
// whose content starts at b[i], or -1.
func closingQuote(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case '"':
			return i
		case '\\':
			i += 2
		default:
			i++
		}
	}
	return -1
}

// minusOne reports whether b holds the number -1 at i.
func minusOne(b []byte, i int) bool {
	return len(b)-i >= 2 && b[i] == '-' && b[i+1] == '1' && (len(b)-i == 2 || b[i+2]-'0' > 9)
}

// interner is what a reader remembers of the lines it has read. It hands
// out one string per distinct short name, so that a reader allocates
// neither the names it has seen before nor, for those, decodes and
// validates them again: its table is keyed by the raw bytes of the JSON
// string, escapes and all, and holds only strings that decoded without
// fault, so a hit is as good as a full decode. It also keeps the leading
// digits of the last timestamp and id, and the text of the last object id
// with its numbers. A nil interner decodes every time.
type interner struct {
	leading  [2]leading // of the last Timestamp and Id of more than eight digits
	objectID objectID   // of the last line parsed in full
	seed     maphash.Seed
	slots    []internSlot // open addressing, linear probing; len a power of two
	n        int

	// The names found last, tried before the table: a thread repeats a
	// few names, and comparing one costs less than hashing it.
	recent     [4]internSlot
	nextRecent int

	steps stepNames
}

// stepNames hands out the names "step <n>" of the steps a reader meets,
// carved from a string made for stepBatch steps at once: every step has a
// name of its own, and a string apiece was two thirds of what a reader
// allocated. A batch is made again once the last one served half its
// steps, or half as many steps since went without: steps out of order
// then cost no more than twice a string each.
type stepNames struct {
	batch  string            // "step n", "step n+1", ... run together
	first  uint64            // n
	ends   [stepBatch]uint16 // where each name ends in batch
	used   int               // the most steps of batch handed out in order
	missed int               // steps since the batch was made that it did not serve
}

const stepBatch = 64

// get returns the name raw holds, the content of a JSON string that
// starts "step ", when it is a plain "step <n>" that a batch serves.
func (sn *stepNames) get(raw []byte) (string, bool) {
	n, j, ok := uintAt(raw, len(StepMarkerPrefix))
	if !ok || j != len(raw) || j-len(StepMarkerPrefix) > 18 {
		return "", false
	}
	if sn.batch != "" && n >= sn.first && n-sn.first < stepBatch {
		k := int(n - sn.first)
		start := 0
		if k > 0 {
			start = int(sn.ends[k-1])
		}
		sn.used = max(sn.used, k+1)
		return sn.batch[start:sn.ends[k]], true
	}
	if sn.batch != "" && sn.used < stepBatch/2 && sn.missed < stepBatch/2 {
		sn.missed++
		return "", false
	}
	b := make([]byte, 0, stepBatch*(len(raw)+1))
	for i := range sn.ends {
		b = strconv.AppendUint(append(b, StepMarkerPrefix...), n+uint64(i), 10)
		sn.ends[i] = uint16(len(b))
	}
	sn.batch, sn.first, sn.used, sn.missed = string(b), n, 1, 0
	return sn.batch[:sn.ends[0]], true
}

// leading is the first eight digits of a number, as the bytes of the line
// read little-endian, and their value.
type leading struct {
	digits uint64 // 0: none yet
	value  uint64
}

// objectID is the text of a line's MsptiObjectId, from its key to the
// Name's opening quote, and the four numbers it holds. A line with the
// same text holds the same numbers.
type objectID struct {
	raw  [160]byte
	n    int // bytes of raw in use; 0: none yet
	vals [numIDFields]uint32
}

// pow10 holds the powers of ten that leave the first eight of 8 to 19
// digits.
var pow10 = [12]uint64{1, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11}

type internSlot struct {
	hash uint64
	raw  string // the key: the JSON string's content as in the line; "" when the slot is free
	s    string // raw decoded
}

const (
	internMaxEntries = 1024
	internMaxLen     = 256
	internMinSlots   = 16
)

// get decodes the content of a JSON string (what lies between its
// quotes). It reports false for what is left to encoding/json: an
// unescaped quote or control character, a bad escape, an escaped UTF-16
// surrogate, or invalid UTF-8 (which encoding/json replaces by U+FFFD).
func (in *interner) get(raw []byte) (string, bool) {
	if len(raw) == 0 {
		return "", true
	}
	if in == nil || len(raw) > internMaxLen {
		return decodeString(raw)
	}
	// Step names are used twice at most; they would only churn the table.
	if len(raw) > len(StepMarkerPrefix) && string(raw[:len(StepMarkerPrefix)]) == StepMarkerPrefix {
		if s, ok := in.steps.get(raw); ok {
			return s, true
		}
		return decodeString(raw)
	}
	for i := range in.recent {
		if e := &in.recent[i]; len(e.raw) == len(raw) && e.raw == string(raw) {
			return e.s, true
		}
	}
	if in.slots == nil {
		in.seed = maphash.MakeSeed()
		in.slots = make([]internSlot, internMinSlots)
	}
	h := maphash.Bytes(in.seed, raw)
	mask := len(in.slots) - 1
	k := int(h) & mask
	for ; in.slots[k].raw != ""; k = (k + 1) & mask {
		if e := &in.slots[k]; e.hash == h && e.raw == string(raw) {
			in.remember(*e)
			return e.s, true
		}
	}
	s, ok := decodeString(raw)
	if !ok {
		return "", false
	}
	key := s
	if len(s) != len(raw) || s != string(raw) {
		key = string(raw)
	}
	if 2*(in.n+1) > len(in.slots) {
		in.grow()
		mask = len(in.slots) - 1
		for k = int(h) & mask; in.slots[k].raw != ""; k = (k + 1) & mask {
		}
	}
	in.slots[k] = internSlot{hash: h, raw: key, s: s}
	in.n++
	in.remember(in.slots[k])
	return s, true
}

// remember makes e one of the recent names, in place of the oldest.
func (in *interner) remember(e internSlot) {
	in.recent[in.nextRecent] = e
	in.nextRecent = (in.nextRecent + 1) % len(in.recent)
}

// grow doubles the table, or empties it once it holds internMaxEntries:
// a reader of hostile input keeps a bounded table.
func (in *interner) grow() {
	if in.n >= internMaxEntries {
		clear(in.slots)
		in.n = 0
		return
	}
	old := in.slots
	in.slots = make([]internSlot, 2*len(old))
	mask := len(in.slots) - 1
	for _, e := range old {
		if e.raw == "" {
			continue
		}
		k := int(e.hash) & mask
		for in.slots[k].raw != "" {
			k = (k + 1) & mask
		}
		in.slots[k] = e
	}
}

// decodeString is interner.get without the table.
func decodeString(raw []byte) (string, bool) {
	escaped := false
	for j := 0; j < len(raw); j++ {
		switch c := raw[j]; {
		case c == '\\':
			escaped = true
			j++ // unescape checks the escape
		case c == '"' || c < 0x20:
			return "", false
		}
	}
	if escaped {
		v, ok := unescape(raw)
		if !ok {
			return "", false
		}
		raw = v
	}
	if !utf8.Valid(raw) {
		return "", false
	}
	switch string(raw) { // compared in place, not converted
	case DomainDefault:
		return DomainDefault, true
	case DomainCommunication:
		return DomainCommunication, true
	case MarkerForward:
		return MarkerForward, true
	case MarkerDataLoader:
		return MarkerDataLoader, true
	case MarkerSaveCheckpoint:
		return MarkerSaveCheckpoint, true
	}
	return string(raw), true
}

// unescape decodes the escapes of a JSON string's content. It reports
// false for an invalid escape or a \u escape of a surrogate.
func unescape(raw []byte) ([]byte, bool) {
	out := make([]byte, 0, len(raw))
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		if c != '\\' {
			out = append(out, c)
			continue
		}
		if i+1 >= len(raw) {
			return nil, false
		}
		i++
		switch raw[i] {
		case '"', '\\', '/':
			out = append(out, raw[i])
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			if i+5 > len(raw) {
				return nil, false
			}
			var r rune
			for _, h := range raw[i+1 : i+5] {
				switch {
				case h >= '0' && h <= '9':
					r = r<<4 | rune(h-'0')
				case h >= 'a' && h <= 'f':
					r = r<<4 | rune(h-'a'+10)
				case h >= 'A' && h <= 'F':
					r = r<<4 | rune(h-'A'+10)
				default:
					return nil, false
				}
			}
			if utf16.IsSurrogate(r) {
				return nil, false
			}
			out = utf8.AppendRune(out, r)
			i += 4
		default:
			return nil, false
		}
	}
	return out, true
}
