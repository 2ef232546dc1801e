package trace

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParseSwitch(t *testing.T) {
	tests := []struct {
		in   string
		want Switch
	}{
		{`{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}`,
			Switch{Step: true, FP: true, DataLoader: true, SaveCheckpoint: true}},
		{`{"CommunicationOperator":"on","Step":"off","SaveCheckpoint":"off","FP":"off","DataLoader":"off"}`,
			Switch{CommunicationOperator: true}},
		{` { "Step" : "on" } `, Switch{Step: true}},
		{`{}`, Switch{}},
	}
	for _, tt := range tests {
		got, err := ParseSwitch([]byte(tt.in))
		if err != nil {
			t.Errorf("ParseSwitch(%s): %v", tt.in, err)
			continue
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("ParseSwitch(%s) (-want +got):\n%s", tt.in, diff)
		}
	}
}

func TestParseSwitchErrors(t *testing.T) {
	tests := []struct {
		in, field, value string
	}{
		{`{"Step":"yes"}`, "Step", "yes"},
		{`{"Step":true}`, "Step", "true"},
		{`{"Step":1}`, "Step", "1"},
		{`{"Step":{"on":1}}`, "Step", "{"},
		{`{"Step":"ON"}`, "Step", "ON"},
		{`{"Stepp":"on"}`, "Stepp", ""},
		{`{"Step":"on","Step":"off"}`, "Step", ""},
		{`{"Step":"on"`, "", ""},
		{`{"Step":"on"} {}`, "", ""},
		{`["Step"]`, "", ""},
		{``, "", ""},
		{`null`, "", ""},
		{"\xff", "", ""},
	}
	for _, tt := range tests {
		_, err := ParseSwitch([]byte(tt.in))
		var se *ParseError
		if !errors.As(err, &se) || !errors.Is(err, ErrSwitch) {
			t.Errorf("ParseSwitch(%q) = %v, want a *ParseError", tt.in, err)
			continue
		}
		if se.Field != tt.field || se.Value != tt.value {
			t.Errorf("ParseSwitch(%q): field %q value %q, want %q %q (%v)", tt.in, se.Field, se.Value, tt.field, tt.value, err)
		}
	}
}

func TestSwitchRoundTrip(t *testing.T) {
	for b := uint32(0); b < 1<<numKinds; b++ {
		s := SwitchFromBits(b)
		if s.Bits() != b {
			t.Fatalf("SwitchFromBits(%b).Bits() = %b", b, s.Bits())
		}
		data, _ := s.MarshalJSON()
		got, err := ParseSwitch(data)
		if err != nil || got != s {
			t.Fatalf("round trip of %s: %v, %v", data, got, err)
		}
	}
	want := `{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}`
	if got := AllOn().With(CommunicationOperator, false).String(); got != want {
		t.Fatalf("String() = %s, want %s", got, want)
	}
}

func TestDomainRule(t *testing.T) {
	tests := []struct {
		s         Switch
		def, comm bool
	}{
		{Switch{}, false, false},
		{Switch{Step: true}, true, false},
		{Switch{DataLoader: true}, true, false},
		{Switch{CommunicationOperator: true}, true, true},
		{AllOn(), true, true},
	}
	for _, tt := range tests {
		if got := tt.s.DomainEnabled(DomainDefault); got != tt.def {
			t.Errorf("%v default domain = %v, want %v", tt.s, got, tt.def)
		}
		if got := tt.s.DomainEnabled(DomainCommunication); got != tt.comm {
			t.Errorf("%v communication domain = %v, want %v", tt.s, got, tt.comm)
		}
	}
}

func TestUnmarshalKeepsOldOnError(t *testing.T) {
	s := AllOn()
	if err := s.UnmarshalJSON([]byte(`{"FP":"maybe"}`)); err == nil {
		t.Fatal("no error")
	}
	if s != AllOn() {
		t.Fatalf("switch changed to %v on error", s)
	}
}

func FuzzParseSwitch(f *testing.F) {
	f.Add([]byte(`{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}`))
	f.Add([]byte(`{"Step":"on"}`))
	f.Add([]byte(`{"Step":"x"}`))
	f.Add([]byte(`{`))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseSwitch(data)
		if err != nil {
			if !errors.Is(err, ErrSwitch) {
				t.Fatalf("error %v does not wrap ErrSwitch", err)
			}
			return
		}
		out, _ := s.MarshalJSON()
		again, err := ParseSwitch(out)
		if err != nil || again != s {
			t.Fatalf("re-parse of %s: %v %v", out, again, err)
		}
	})
}
