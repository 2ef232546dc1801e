package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
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
	dst = appendJSONString(dst, r.Name)
	return r.appendTail(dst)
}

// appendHead appends the JSON form up to the Name's value.
func (r *Record) appendHead(dst []byte) []byte {
	dst = slices.Grow(dst, 320) // room for every number at its longest
	dst = append(dst, `{"Kind":`...)
	dst = appendUint(dst, uint64(r.Kind))
	dst = append(dst, `,"Flag":`...)
	dst = appendUint(dst, uint64(r.Flag))
	dst = append(dst, `,"SourceKind":`...)
	dst = appendUint(dst, uint64(r.SourceKind))
	dst = append(dst, `,"Timestamp":`...)
	dst = appendUint(dst, r.Timestamp)
	dst = append(dst, `,"Id":`...)
	dst = appendUint(dst, r.ID)
	return r.appendObject(dst)
}

// appendObject appends the MsptiObjectId field and the Name key.
func (r *Record) appendObject(dst []byte) []byte {
	dst = append(dst, `,"MsptiObjectId":{"Pt":{"ProcessId":`...)
	dst = appendUint(dst, uint64(r.ProcessID))
	dst = append(dst, `,"ThreadId":`...)
	dst = appendUint(dst, uint64(r.ThreadID))
	dst = append(dst, `},"Ds":{"DeviceId":`...)
	dst = appendUint(dst, uint64(r.DeviceID))
	dst = append(dst, `,"StreamId":`...)
	dst = appendUint(dst, uint64(r.StreamID))
	return append(dst, `}},"Name":`...)
}

// appendTail appends the JSON form after the Name's value.
func (r *Record) appendTail(dst []byte) []byte {
	switch r.Domain { // the usual domains need no escaping
	case DomainDefault:
		return append(dst, `,"Domain":"default"}`...)
	case DomainCommunication:
		return append(dst, `,"Domain":"communication"}`...)
	case "":
		return append(dst, `,"Domain":""}`...)
	}
	dst = append(dst, `,"Domain":`...)
	dst = appendJSONString(dst, r.Domain)
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
var ErrRecord = errors.New("trace: invalid record")

// recordErr says what is wrong with a record's field ("" for the line as
// a whole).
func recordErr(field, msg string) *ParseError {
	return &ParseError{Format: "record", Field: field, Msg: msg, Err: ErrRecord}
}

// ParseRecord parses one record line (without its newline). The canonical
// field order takes a fast path; any other valid JSON object of the marker
// shape is accepted too, with unknown fields ignored. Kind, Flag, Timestamp
// and Id are required. Errors are *ParseError and wrap ErrRecord.
func ParseRecord(line []byte) (Record, error) {
	var r Record
	err := parseRecordInto(line, &r, nil)
	return r, err
}

// parseRecordInto is ParseRecord into *r, which is undefined on error.
// Names found in in are not allocated again; in may be nil.
func parseRecordInto(line []byte, r *Record, in *interner) error {
	if len(line) == 0 || line[0] != '{' || line[len(line)-1] != '}' {
		line = bytes.TrimSpace(line) // a record line has nothing to trim
	}
	if len(line) > MaxLineBytes {
		return recordErr("", fmt.Sprintf("line of %d bytes exceeds %d", len(line), MaxLineBytes))
	}
	if parseCanonical(line, r, in) {
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
		return Record{}, recordErr("", "not a JSON object")
	}
	if err := json.Unmarshal(line, &w); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return Record{}, recordErr(te.Field, "wrong type: "+te.Value)
		}
		return Record{}, recordErr("", "malformed JSON: "+err.Error())
	}
	var r Record
	var err error
	num := func(field string, n *json.Number, bits int, required bool) uint64 {
		if err != nil {
			return 0
		}
		if n == nil {
			if required {
				err = recordErr(field, "missing")
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
		err = recordErr(field, fmt.Sprintf("value %s is not an unsigned %d-bit integer", *n, bits))
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

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string literal, as encoding/json
// writes it: invalid UTF-8 is replaced by U+FFFD, control characters are
// escaped, and so are <, >, &, U+2028 and U+2029.
func appendJSONString[T string | []byte](dst []byte, s T) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if jsonSafe[c] {
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
		r, size := decodeRune(s[i:])
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

func decodeRune[T string | []byte](s T) (rune, int) {
	switch v := any(s).(type) {
	case string:
		return utf8.DecodeRuneInString(v)
	case []byte:
		return utf8.DecodeRune(v)
	}
	return utf8.RuneError, 1
}

// jsonSafe says which ASCII bytes a JSON string holds as they are; the
// others are escaped as encoding/json escapes them.
var jsonSafe = func() (t [utf8.RuneSelf]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\' && c != '<' && c != '>' && c != '&'
	}
	return t
}()

const digitPairs = "00010203040506070809101112131415161718192021222324252627282930313233343536373839" +
	"40414243444546474849505152535455565758596061626364656667686970717273747576777879" +
	"8081828384858687888990919293949596979899"

// appendUint appends v in decimal. It is strconv.AppendUint(dst, v, 10)
// without the generality: the record encoder spends most of its time here.
func appendUint(dst []byte, v uint64) []byte {
	if v < 10 {
		return append(dst, '0'+byte(v))
	}
	var buf [20]byte
	i := len(buf)
	// Eight digits at a time in 32-bit arithmetic, which is cheaper.
	for v >= 1e8 {
		q := v / 1e8
		lo := uint32(v - q*1e8)
		for range 4 {
			r := lo % 100 * 2
			lo /= 100
			i -= 2
			buf[i], buf[i+1] = digitPairs[r], digitPairs[r+1]
		}
		v = q
	}
	u := uint32(v)
	for u >= 100 {
		r := u % 100 * 2
		u /= 100
		i -= 2
		buf[i], buf[i+1] = digitPairs[r], digitPairs[r+1]
	}
	if u >= 10 {
		i -= 2
		buf[i], buf[i+1] = digitPairs[u*2], digitPairs[u*2+1]
	} else {
		i--
		buf[i] = '0' + byte(u)
	}
	return append(dst, buf[i:]...)
}
