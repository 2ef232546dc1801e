package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"unicode/utf8"
)

// Flag is the mspti marker flag of a record.
type Flag uint32

// Flag bits, as mspti defines them.
const (
	FlagInstant       Flag = 1
	FlagHostStart     Flag = 2
	FlagHostEnd       Flag = 4
	FlagDeviceInstant Flag = 8
	FlagDeviceStart   Flag = 16
	FlagDeviceEnd     Flag = 32
)

// IsStart reports whether f marks the start of a range.
func (f Flag) IsStart() bool { return f&(FlagHostStart|FlagDeviceStart) != 0 }

// IsEnd reports whether f marks the end of a range.
func (f Flag) IsEnd() bool { return f&(FlagHostEnd|FlagDeviceEnd) != 0 }

// IsInstant reports whether f marks an instant.
func (f Flag) IsInstant() bool { return f&(FlagInstant|FlagDeviceInstant) != 0 }

// Activity and source kinds of the mspti marker shape.
const (
	ActivityKindMarker = 1 // Record.Kind of every marker record
	SourceKindHost     = 0
	SourceKindDevice   = 1
)

// MaxLineBytes bounds one record line. Longer lines are rejected, so a
// corrupt or hostile file cannot make a reader hold it whole.
const MaxLineBytes = 64 << 10

// Record is one dotting record, a line of a record file. Its JSON form is
// the mspti marker shape, with fields in this order:
//
//	{"Kind":1,"Flag":16,"SourceKind":1,"Timestamp":<ns>,"Id":<u64>,
//	 "MsptiObjectId":{"Pt":{"ProcessId":p,"ThreadId":t},"Ds":{"DeviceId":d,"StreamId":s}},
//	 "Name":"step 12","Domain":"default"}
//
// A range is a start and an end record sharing one Id. In mspti the object
// id is a union, so other writers may put -1 or host ids in the Ds fields;
// a -1 reads as 0xFFFFFFFF.
type Record struct {
	Kind       uint32 // ActivityKindMarker
	Flag       Flag
	SourceKind uint32
	Timestamp  uint64 // nanoseconds; clocks of different hosts are not comparable
	ID         uint64
	ProcessID  uint32
	ThreadID   uint32
	DeviceID   uint32
	StreamID   uint32
	Name       string // "step 12", "forward", or a CommOp as JSON; end records may leave it empty
	Domain     string
}

// AppendJSON appends the record's JSON form, without a newline, to dst. It
// does not allocate when dst has room.
func (r *Record) AppendJSON(dst []byte) []byte {
	dst = r.appendHead(dst)
	dst = AppendJSONString(dst, r.Name)
	return r.appendTail(dst)
}

// appendHead appends the JSON form up to the Name's value.
func (r *Record) appendHead(dst []byte) []byte {
	dst = append(dst, `{"Kind":`...)
	dst = strconv.AppendUint(dst, uint64(r.Kind), 10)
	dst = append(dst, `,"Flag":`...)
	dst = strconv.AppendUint(dst, uint64(r.Flag), 10)
	dst = append(dst, `,"SourceKind":`...)
	dst = strconv.AppendUint(dst, uint64(r.SourceKind), 10)
	dst = append(dst, `,"Timestamp":`...)
	dst = strconv.AppendUint(dst, r.Timestamp, 10)
	dst = append(dst, `,"Id":`...)
	dst = strconv.AppendUint(dst, r.ID, 10)
	dst = append(dst, `,"MsptiObjectId":{"Pt":{"ProcessId":`...)
	dst = strconv.AppendUint(dst, uint64(r.ProcessID), 10)
	dst = append(dst, `,"ThreadId":`...)
	dst = strconv.AppendUint(dst, uint64(r.ThreadID), 10)
	dst = append(dst, `},"Ds":{"DeviceId":`...)
	dst = strconv.AppendUint(dst, uint64(r.DeviceID), 10)
	dst = append(dst, `,"StreamId":`...)
	dst = strconv.AppendUint(dst, uint64(r.StreamID), 10)
	return append(dst, `}},"Name":`...)
}

// appendTail appends the JSON form after the Name's value.
func (r *Record) appendTail(dst []byte) []byte {
	dst = append(dst, `,"Domain":`...)
	dst = AppendJSONString(dst, r.Domain)
	return append(dst, '}')
}

// MarshalJSON returns AppendJSON(nil).
func (r Record) MarshalJSON() ([]byte, error) { return r.AppendJSON(nil), nil }

// UnmarshalJSON parses a record as ParseRecord does.
func (r *Record) UnmarshalJSON(data []byte) error {
	v, err := ParseRecord(data)
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// ErrRecord is wrapped by every error ParseRecord returns.
var ErrRecord = errors.New("invalid record")

// RecordError says what is wrong with a record line.
type RecordError struct {
	Field string // "" when the line is not a JSON object of the right shape
	Msg   string
}

func (e *RecordError) Error() string {
	if e.Field == "" {
		return "record: " + e.Msg
	}
	return fmt.Sprintf("record: field %q: %s", e.Field, e.Msg)
}

// Unwrap lets errors.Is(err, ErrRecord) hold.
func (e *RecordError) Unwrap() error { return ErrRecord }

// ParseRecord parses one record line (without its newline). The canonical
// field order takes a fast path; any other valid JSON object of the marker
// shape is accepted too, with unknown fields ignored. Kind, Flag, Timestamp
// and Id are required. Errors are *RecordError and wrap ErrRecord.
func ParseRecord(line []byte) (Record, error) {
	var r Record
	err := parseRecordInto(line, &r)
	return r, err
}

// parseRecordInto is ParseRecord into *r, which is undefined on error.
func parseRecordInto(line []byte, r *Record) error {
	line = bytes.TrimSpace(line)
	if len(line) > MaxLineBytes {
		return &RecordError{Msg: fmt.Sprintf("line of %d bytes exceeds %d", len(line), MaxLineBytes)}
	}
	if parseCanonical(line, r) {
		return nil
	}
	v, err := parseGeneric(line)
	*r = v
	return err
}

// wireRecord is the generic (slow path) decoding target. Integers are
// json.Number so that -1 in a union field and out-of-range values can be
// told apart from absent ones.
type wireRecord struct {
	Kind          *json.Number
	Flag          *json.Number
	SourceKind    *json.Number
	Timestamp     *json.Number
	ID            *json.Number `json:"Id"`
	MsptiObjectID struct {
		Pt struct{ ProcessID, ThreadID *json.Number }
		Ds struct{ DeviceID, StreamID *json.Number }
	} `json:"MsptiObjectId"`
	Name   *string
	Domain *string
}

func parseGeneric(line []byte) (Record, error) {
	var w wireRecord
	if len(line) == 0 || line[0] != '{' {
		return Record{}, &RecordError{Msg: "not a JSON object"}
	}
	if err := json.Unmarshal(line, &w); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return Record{}, &RecordError{Field: te.Field, Msg: "wrong type: " + te.Value}
		}
		return Record{}, &RecordError{Msg: "malformed JSON: " + err.Error()}
	}
	var r Record
	var err error
	num := func(field string, n *json.Number, bits int, required bool) uint64 {
		if err != nil {
			return 0
		}
		if n == nil {
			if required {
				err = &RecordError{Field: field, Msg: "missing"}
			}
			return 0
		}
		if u, perr := strconv.ParseUint(string(*n), 10, bits); perr == nil {
			return u
		}
		// mspti writes -1 into the union half that does not apply.
		if string(*n) == "-1" && bits == 32 {
			return 1<<32 - 1
		}
		err = &RecordError{Field: field, Msg: fmt.Sprintf("value %s is not an unsigned %d-bit integer", *n, bits)}
		return 0
	}
	r.Kind = uint32(num("Kind", w.Kind, 32, true))
	r.Flag = Flag(num("Flag", w.Flag, 32, true))
	r.SourceKind = uint32(num("SourceKind", w.SourceKind, 32, false))
	r.Timestamp = num("Timestamp", w.Timestamp, 64, true)
	r.ID = num("Id", w.ID, 64, true)
	r.ProcessID = uint32(num("ProcessId", w.MsptiObjectID.Pt.ProcessID, 32, false))
	r.ThreadID = uint32(num("ThreadId", w.MsptiObjectID.Pt.ThreadID, 32, false))
	r.DeviceID = uint32(num("DeviceId", w.MsptiObjectID.Ds.DeviceID, 32, false))
	r.StreamID = uint32(num("StreamId", w.MsptiObjectID.Ds.StreamID, 32, false))
	if err != nil {
		return Record{}, err
	}
	if w.Name != nil {
		r.Name = *w.Name
	}
	if w.Domain != nil {
		r.Domain = *w.Domain
	}
	return r, nil
}

// parseCanonical parses the exact shape AppendJSON writes (and MindCluster's
// writer, which uses the same order) without reflection. It reports false
// for anything else, leaving the generic path to decide.
func parseCanonical(b []byte, r *Record) bool {
	p := canonParser{b: b}
	var v uint64
	if !p.lit(`{"Kind":`) || !p.uint(&v, 32) {
		return false
	}
	r.Kind = uint32(v)
	if !p.lit(`,"Flag":`) || !p.uint(&v, 32) {
		return false
	}
	r.Flag = Flag(v)
	if !p.lit(`,"SourceKind":`) || !p.uint(&v, 32) {
		return false
	}
	r.SourceKind = uint32(v)
	if !p.lit(`,"Timestamp":`) || !p.uint(&r.Timestamp, 64) {
		return false
	}
	if !p.lit(`,"Id":`) || !p.uint(&r.ID, 64) {
		return false
	}
	if !p.lit(`,"MsptiObjectId":{"Pt":{"ProcessId":`) || !p.uint(&v, 32) {
		return false
	}
	r.ProcessID = uint32(v)
	if !p.lit(`,"ThreadId":`) || !p.uint(&v, 32) {
		return false
	}
	r.ThreadID = uint32(v)
	if !p.lit(`},"Ds":{"DeviceId":`) || !p.uint(&v, 32) {
		return false
	}
	r.DeviceID = uint32(v)
	if !p.lit(`,"StreamId":`) || !p.uint(&v, 32) {
		return false
	}
	r.StreamID = uint32(v)
	if !p.lit(`}},"Name":`) || !p.str(&r.Name) {
		return false
	}
	if !p.lit(`,"Domain":`) || !p.str(&r.Domain) {
		return false
	}
	return p.lit("}") && p.i == len(p.b)
}

type canonParser struct {
	b []byte
	i int
}

func (p *canonParser) lit(s string) bool {
	if len(p.b)-p.i < len(s) || string(p.b[p.i:p.i+len(s)]) != s {
		return false
	}
	p.i += len(s)
	return true
}

func (p *canonParser) uint(v *uint64, bits int) bool {
	j := p.i
	var u uint64
	for j < len(p.b) && p.b[j] >= '0' && p.b[j] <= '9' {
		d := uint64(p.b[j] - '0')
		if u > (math.MaxUint64-d)/10 {
			return false
		}
		u = u*10 + d
		j++
	}
	if j == p.i || (p.b[p.i] == '0' && j-p.i > 1) || (bits < 64 && u >= 1<<bits) {
		return false
	}
	*v = u
	p.i = j
	return true
}

// str reads a JSON string with no escapes and only printable UTF-8; others
// go to the generic path.
func (p *canonParser) str(s *string) bool {
	if p.i >= len(p.b) || p.b[p.i] != '"' {
		return false
	}
	j := p.i + 1
	for j < len(p.b) && p.b[j] != '"' {
		if c := p.b[j]; c == '\\' || c < 0x20 {
			return false
		}
		j++
	}
	if j >= len(p.b) || !utf8.Valid(p.b[p.i+1:j]) {
		return false
	}
	*s = intern(p.b[p.i+1 : j])
	p.i = j + 1
	return true
}

const hexDigits = "0123456789abcdef"

// AppendJSONString appends s as a JSON string literal. Invalid UTF-8 is
// replaced by U+FFFD, control characters are escaped, and so are <, > and &
// so that the output is safe to embed in HTML as encoding/json does.
func AppendJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// intern returns the common names and domains without allocating.
func intern(b []byte) string {
	switch string(b) { // compared in place, not converted
	case "":
		return ""
	case DomainDefault:
		return DomainDefault
	case DomainCommunication:
		return DomainCommunication
	case MarkerForward:
		return MarkerForward
	case MarkerDataLoader:
		return MarkerDataLoader
	case MarkerSaveCheckpoint:
		return MarkerSaveCheckpoint
	}
	return string(b)
}
