package trace

import "github.com/faultline-ml/faultline/internal/parseerr"

// ParseError says what is wrong with a record, a line of a record file or
// a profiling switch document, and where. It has the shape of every parse
// error of this module: what was parsed, where, the field and value at
// fault, and what is wrong.
type ParseError struct {
	Format string // "record" or "profiling switch"
	File   string // the file; "" when parsing bytes
	Line   int    // 1-based line of File; 0 when parsing bytes
	Field  string // the offending field; "" when the input as a whole is malformed
	Value  string // the offending value, if any
	Msg    string // what is wrong
	Err    error  // ErrRecord, ErrSwitch, ErrLineTooLong or ErrTruncatedLine
}

// Error returns "trace: <format>: <file>:<line>: field <f>: value <v>:
// <msg>", leaving out what is unknown.
func (e *ParseError) Error() string {
	return parseerr.Text{Pkg: "trace", Format: e.Format, File: e.File, Line: e.Line,
		Field: e.Field, Value: e.Value, Msg: e.Msg}.String()
}

// Unwrap returns Err: errors.Is(err, ErrRecord) holds of a record's error.
func (e *ParseError) Unwrap() error { return e.Err }
