package trace

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

// TestEncoderMatchesAppendJSON feeds one encoder random records whose
// fields repeat and change as a writer's do: every line must be what
// Record.AppendJSON writes.
func TestEncoderMatchesAppendJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	names := []string{"", "step 1", MarkerForward, MarkerDataLoader, MarkerSaveCheckpoint, strings.Repeat("long name <&> ", 4), strings.Repeat("other long name \"q\" ", 3), "bad\xffutf8 " + strings.Repeat("x", 40)}
	ops := []CommOp{
		{OpName: "HcclAllReduce", GroupName: "tp<0>", Count: 4096, DataType: "fp16", StreamID: 3},
		{OpName: "HcclAllGather", GroupName: "dp", Count: 1, DataType: "bf16"},
	}
	var e encoder
	for i := range 5000 {
		ts := rng.Uint64()
		if i%3 != 0 { // mostly close to each other, as a writer's are
			ts = 1731000000000000000 + rng.Uint64N(3e6)
		}
		r := Record{Kind: 1, Flag: Flag(rng.IntN(64)), SourceKind: uint32(rng.IntN(2)), Timestamp: ts, ID: rng.Uint64() >> rng.IntN(64),
			ProcessID: uint32(rng.IntN(3)), ThreadID: 7, DeviceID: uint32(rng.IntN(2)) * (1<<32 - 1), StreamID: uint32(rng.IntN(2)),
			Name: names[rng.IntN(len(names))], Domain: []string{DomainDefault, DomainCommunication, ""}[rng.IntN(3)]}
		form := uint8(rng.IntN(3))
		step := rng.Uint64() >> rng.IntN(64)
		op := ops[rng.IntN(len(ops))]
		switch form {
		case nameStep:
			r.Name = "step " + strconv.FormatUint(step, 10)
		case nameComm:
			r.Name = string(op.AppendJSON(nil))
		}
		want := string(r.AppendJSON(nil))
		got := string(e.appendRecord([]byte("prefix"), &r, form, step, &op))
		if got != "prefix"+want {
			t.Fatalf("record %d (form %d):\n got %s\nwant prefix%s", i, form, got, want)
		}
	}
}

func TestAppendUint(t *testing.T) {
	vals := []uint64{0, 1, 9, 10, 99, 100, 12345678, 99999999, 100000000, 1<<32 - 1, 1 << 32, 1731000000123456789, 1<<64 - 1}
	rng := rand.New(rand.NewPCG(7, 8))
	for range 10000 {
		vals = append(vals, rng.Uint64()>>rng.IntN(64))
	}
	for _, v := range vals {
		if got, want := string(appendUint([]byte("x"), v)), "x"+strconv.FormatUint(v, 10); got != want {
			t.Fatalf("appendUint(%d) = %s, want %s", v, got, want)
		}
	}
}
