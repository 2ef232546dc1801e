package parseerr

import (
	"strconv"
	"strings"
)

// Text is what a parse error says; what is empty (or a Line of 0, an At
// of "") is left out of the message.
type Text struct {
	Pkg    string // the package that refused the input: "trace"
	Format string // what was parsed: "record", "stack file"
	File   string // the file, "" when parsing bytes
	Line   int    // 1-based line
	At     string // a position other than a line, such as "offset 60"
	Field  string // the offending field
	Value  string // the offending value, quoted in the message
	Msg    string // what is wrong
}

// String returns "pkg: format: file:line: at: field F: value "V": msg".
// A line without a file reads "line N".
func (t Text) String() string {
	var b strings.Builder
	b.WriteString(t.Pkg)
	b.WriteString(": ")
	if t.Format != "" {
		b.WriteString(t.Format)
		b.WriteString(": ")
	}
	switch {
	case t.File != "" && t.Line > 0:
		b.WriteString(t.File)
		b.WriteByte(':')
		b.WriteString(strconv.Itoa(t.Line))
		b.WriteString(": ")
	case t.File != "":
		b.WriteString(t.File)
		b.WriteString(": ")
	case t.Line > 0:
		b.WriteString("line ")
		b.WriteString(strconv.Itoa(t.Line))
		b.WriteString(": ")
	}
	if t.At != "" {
		b.WriteString(t.At)
		b.WriteString(": ")
	}
	if t.Field != "" {
		b.WriteString("field ")
		b.WriteString(t.Field)
		b.WriteString(": ")
	}
	if t.Value != "" {
		b.WriteString("value ")
		b.WriteString(strconv.Quote(t.Value))
		b.WriteString(": ")
	}
	b.WriteString(t.Msg)
	return b.String()
}
