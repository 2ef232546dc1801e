package slownode

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/faultline-ml/faultline/trace"
)

func TestProbePause(t *testing.T) {
	dir := t.TempDir()
	var b []byte
	for i := 0; i < 5000; i++ {
		r := trace.Record{Kind: 1, Flag: 2, Timestamp: uint64(i), ID: uint64(i), Name: "x"}
		b = r.AppendJSON(b)
		b = append(b, '\n')
	}
	os.WriteFile(filepath.Join(dir, "0000000001"), b, 0o644)
	rr, err := trace.OpenRankReader(dir, trace.ReaderConfig{BufferBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	var got []uint64
	stop := errors.New("stop")
	for k := 0; k < 10000; k++ {
		n := 0
		err := rr.Read(func(r *trace.Record) error {
			got = append(got, r.ID)
			n++
			if n == 7 {
				return stop
			}
			return nil
		})
		if err == nil {
			break
		}
	}
	for i, id := range got {
		if uint64(i) != id {
			t.Fatalf("record %d has id %d", i, id)
		}
	}
	if len(got) != 5000 {
		t.Fatalf("got %d", len(got))
	}
}
