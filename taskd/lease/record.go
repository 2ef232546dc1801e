package lease

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"strconv"
	"time"

	"github.com/faultline-ml/faultline/internal/parseerr"
)

// RecordVersion is the version of the lease file format that this
// package writes and reads.
const RecordVersion = 1

// maxRecordBytes bounds a lease file.
const maxRecordBytes = 64 << 10

// Record is the content of a lease file: the job, and the newest term of
// its lease: who took it, with which configuration, and its fencing
// token. A holder writes it once, atomically, when it takes the lease; it
// stays after the holder is gone, so that the next term's token follows.
//
// On disk it is one JSON object:
//
//	{"version":1,"job":"llm","config":"3f2a9c1e0b7d4a65","token":7,
//	 "holder":"mgr-a-1234","term":"9b1f03c2e4d5a6b7","acquired":"2026-11-25T19:43:59.5Z",
//	 "crc32c":"1c291ca3"}
//
// crc32c is the CRC-32C (Castagnoli) of the object's compact JSON without
// the crc32c member, in that member order, as 8 hexadecimal digits.
type Record struct {
	Job      string
	Config   string
	Token    uint64
	Holder   string    // the holder's Candidate.Name
	Term     string    // the term's random identifier: two terms of one holder differ
	Acquired time.Time // when the term began, UTC
}

// recordJSON is Record on disk. The order of the fields is that of the
// checksummed encoding.
type recordJSON struct {
	Version  int       `json:"version"`
	Job      string    `json:"job"`
	Config   string    `json:"config"`
	Token    uint64    `json:"token"`
	Holder   string    `json:"holder"`
	Term     string    `json:"term"`
	Acquired time.Time `json:"acquired"`
	CRC      string    `json:"crc32c,omitempty"`
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// checksum returns the crc32c member that j should carry.
func (j recordJSON) checksum() string {
	j.CRC = ""
	b, err := json.Marshal(j)
	if err != nil { // a time outside years 0-9999
		return ""
	}
	return fmt.Sprintf("%08x", crc32.Checksum(b, castagnoli))
}

// ParseError says what is wrong with a lease file. It has the shape of
// every parse error of this module (the file, the field and value at
// fault, and what is wrong) and wraps ErrInvalid.
type ParseError struct {
	File  string // the lease file; "" when parsed from memory
	Field string // the JSON member at fault; "" for the whole document
	Value string // the value at fault, when there is one
	Msg   string // what is wrong
}

// Error returns "lease: lease file: <file>: field <f>: value <v>: <msg>",
// leaving out what is unknown.
func (e *ParseError) Error() string {
	return parseerr.Text{Pkg: "lease", Format: "lease file", File: e.File, Field: e.Field, Value: e.Value, Msg: e.Msg}.String()
}

// Unwrap lets errors.Is(err, ErrInvalid) hold.
func (e *ParseError) Unwrap() error { return ErrInvalid }

// Marshal encodes r as the lease file's JSON, with its checksum. It
// refuses a record that ParseRecord would refuse.
func (r Record) Marshal() ([]byte, error) {
	j := recordJSON{Version: RecordVersion, Job: r.Job, Config: r.Config, Token: r.Token,
		Holder: r.Holder, Term: r.Term, Acquired: r.Acquired.UTC()}
	if err := j.check(); err != nil {
		return nil, err
	}
	j.CRC = j.checksum()
	b, err := json.Marshal(j)
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// ParseRecord decodes a lease file. Anything but one JSON object, a file
// of another version, a member missing, unknown or out of range, or a
// checksum that does not match is an error (*ParseError).
func ParseRecord(data []byte) (Record, error) {
	if len(data) > maxRecordBytes {
		return Record{}, &ParseError{Msg: fmt.Sprintf("is %d bytes, more than %d", len(data), maxRecordBytes)}
	}
	// The version first: a newer format may differ in every other member.
	var v struct {
		Version *json.RawMessage `json:"version"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return Record{}, &ParseError{Msg: "is not a JSON object: " + err.Error()}
	}
	if v.Version == nil {
		return Record{}, &ParseError{Field: "version", Msg: "is missing"}
	}
	if n, err := strconv.Atoi(string(*v.Version)); err != nil || n != RecordVersion {
		return Record{}, &ParseError{Field: "version", Value: string(*v.Version),
			Msg: fmt.Sprintf("is unknown: this program reads version %d; the file was written by another release", RecordVersion)}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var j recordJSON
	if err := dec.Decode(&j); err != nil {
		return Record{}, &ParseError{Msg: err.Error()}
	}
	if err := j.check(); err != nil {
		return Record{}, err
	}
	if want := j.checksum(); j.CRC != want {
		return Record{}, &ParseError{Field: "crc32c", Value: j.CRC,
			Msg: fmt.Sprintf("does not match the content (%s): the file was damaged or edited", want)}
	}
	return Record{Job: j.Job, Config: j.Config, Token: j.Token, Holder: j.Holder, Term: j.Term, Acquired: j.Acquired}, nil
}

// check reports the first member of j that is wrong.
func (j recordJSON) check() error {
	bad := func(field, value, msg string) error {
		return &ParseError{Field: field, Value: value, Msg: msg}
	}
	if msg := jobProblem(j.Job); msg != "" {
		return bad("job", j.Job, msg)
	}
	if !isToken(j.Config, configExtra, configMax) {
		return bad("config", j.Config, configWant)
	}
	if !isToken(j.Holder, nameExtra, nameMax) {
		return bad("holder", j.Holder, nameWant)
	}
	switch {
	case j.Token == 0:
		return bad("token", "0", "must be at least 1")
	case !isHex(j.Term, 16):
		return bad("term", j.Term, "want 16 hexadecimal digits")
	case j.Acquired.IsZero():
		return bad("acquired", "", "is missing")
	case j.Acquired.Location() != time.UTC:
		return bad("acquired", j.Acquired.String(), "want a UTC time")
	}
	return nil
}

// isHex reports whether s is n lower-case hexadecimal digits.
func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
