package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Switch says which kinds are dotted. Its JSON form is MindCluster's
// profilingSwitch document:
//
//	{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}
//
// The zero Switch is all off.
type Switch struct {
	Step                  bool
	FP                    bool
	DataLoader            bool
	SaveCheckpoint        bool
	CommunicationOperator bool
}

// AllOn returns a Switch with every kind on.
func AllOn() Switch {
	return Switch{Step: true, FP: true, DataLoader: true, SaveCheckpoint: true, CommunicationOperator: true}
}

// ErrSwitch is wrapped by every error ParseSwitch returns.
var ErrSwitch = errors.New("trace: invalid profiling switch")

// switchErr says what is wrong with a switch document's field ("" for
// the document as a whole) and its value.
func switchErr(field, value, msg string) *ParseError {
	return &ParseError{Format: "profiling switch", Field: field, Value: value, Msg: msg, Err: ErrSwitch}
}

// Enabled reports whether kind k is on.
func (s Switch) Enabled(k Kind) bool {
	switch k {
	case Step:
		return s.Step
	case FP:
		return s.FP
	case DataLoader:
		return s.DataLoader
	case SaveCheckpoint:
		return s.SaveCheckpoint
	case CommunicationOperator:
		return s.CommunicationOperator
	}
	return false
}

// With returns s with kind k set to on.
func (s Switch) With(k Kind, on bool) Switch {
	switch k {
	case Step:
		s.Step = on
	case FP:
		s.FP = on
	case DataLoader:
		s.DataLoader = on
	case SaveCheckpoint:
		s.SaveCheckpoint = on
	case CommunicationOperator:
		s.CommunicationOperator = on
	}
	return s
}

// DomainEnabled applies MindCluster's domain rule: the default domain is
// off only when all five fields are off; the communication domain follows
// CommunicationOperator alone. A source that can only enable whole marker
// domains (an mspti activity subscription) uses this; the recorder filters
// per kind on top of it.
func (s Switch) DomainEnabled(domain string) bool {
	switch domain {
	case DomainDefault:
		return s != Switch{}
	case DomainCommunication:
		return s.CommunicationOperator
	}
	return false
}

// Bits returns s as a bit set with bit k set when kind k is on.
func (s Switch) Bits() uint32 {
	var b uint32
	for _, k := range kinds {
		if s.Enabled(k) {
			b |= 1 << k
		}
	}
	return b
}

// SwitchFromBits is the inverse of Switch.Bits.
func SwitchFromBits(b uint32) Switch {
	var s Switch
	for _, k := range kinds {
		s = s.With(k, b&(1<<k) != 0)
	}
	return s
}

// String returns the JSON form.
func (s Switch) String() string {
	b, _ := s.MarshalJSON()
	return string(b)
}

// switchFieldOrder is the field order MindCluster writes.
var switchFieldOrder = [...]Kind{CommunicationOperator, Step, SaveCheckpoint, FP, DataLoader}

// MarshalJSON writes the profilingSwitch document with every field.
func (s Switch) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 112)
	b = append(b, '{')
	for i, k := range switchFieldOrder {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		b = append(b, k.String()...)
		b = append(b, `":"`...)
		if s.Enabled(k) {
			b = append(b, "on"...)
		} else {
			b = append(b, "off"...)
		}
		b = append(b, '"')
	}
	return append(b, '}'), nil
}

// UnmarshalJSON parses a profilingSwitch document strictly, as ParseSwitch.
// On error s is left unchanged.
func (s *Switch) UnmarshalJSON(data []byte) error {
	v, err := ParseSwitch(data)
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// ParseSwitch parses a profilingSwitch document. Unlike MindCluster it is
// strict: every value must be "on" or "off", every field must be one of the
// five kinds and appear at most once, and nothing may follow the object. A
// field that is absent is off. Errors are *ParseError and wrap ErrSwitch.
func ParseSwitch(data []byte) (Switch, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	malformed := func(err error) (Switch, error) {
		return Switch{}, switchErr("", "", "malformed JSON: "+err.Error())
	}
	tok, err := dec.Token()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return Switch{}, switchErr("", "", "empty document")
		}
		return malformed(err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return Switch{}, switchErr("", "", fmt.Sprintf("want a JSON object, got %v", tok))
	}
	var s Switch
	var seen uint32
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return malformed(err)
		}
		name, _ := tok.(string) // object keys are always strings
		k, known := ParseKind(name)
		if !known {
			return Switch{}, switchErr(name, "", "unknown field (want one of Step, FP, DataLoader, SaveCheckpoint, CommunicationOperator)")
		}
		if seen&(1<<k) != 0 {
			return Switch{}, switchErr(name, "", "field appears twice")
		}
		seen |= 1 << k
		tok, err = dec.Token()
		if err != nil {
			return malformed(err)
		}
		var val string
		switch v := tok.(type) {
		case string:
			val = v
		case json.Delim:
			return Switch{}, switchErr(name, v.String(), `want "on" or "off"`)
		default:
			return Switch{}, switchErr(name, fmt.Sprint(v), `want "on" or "off"`)
		}
		switch val {
		case "on":
			s = s.With(k, true)
		case "off":
			s = s.With(k, false)
		default:
			return Switch{}, switchErr(name, val, `want "on" or "off"`)
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return malformed(err)
	}
	if tok, err := dec.Token(); !errors.Is(err, io.EOF) {
		if err != nil {
			return malformed(err)
		}
		return Switch{}, switchErr("", "", fmt.Sprintf("unexpected %v after the object", tok))
	}
	return s, nil
}
