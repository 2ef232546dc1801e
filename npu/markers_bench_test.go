//go:build cgo

package npu_test

import (
	"testing"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/trace"
)

// BenchmarkMarkerDelivery measures the cost per record from the profiling
// library's buffer to the sink: the buffer-completed callback, the batched
// walk with msptiActivityGetNextRecord, the conversion to trace.Record and
// the sink call. Baselines in the same run: the same record sent through a
// buffered Go channel to a goroutine that calls the sink, and the bare sink
// call.
func BenchmarkMarkerDelivery(b *testing.B) {
	b.Run("mspti", func(b *testing.B) { benchMspti(b, false) })
	b.Run("mspti+emit", func(b *testing.B) { benchMspti(b, true) })

	b.Run("baseline=chan", func(b *testing.B) {
		var n int
		sink := func(r *trace.Record) { n += int(r.ID & 1) }
		rec := trace.Record{Kind: 1, Flag: trace.FlagHostStart, Timestamp: 1, Name: "forward", Domain: "default"}
		ch := make(chan trace.Record, 1024)
		done := make(chan struct{})
		go func() {
			for r := range ch {
				sink(&r)
			}
			close(done)
		}()
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			rec.ID = uint64(i)
			ch <- rec
		}
		close(ch)
		<-done
	})

	b.Run("baseline=call", func(b *testing.B) {
		var n int
		var sink npu.Sink = func(r *trace.Record) { n += int(r.ID & 1) }
		rec := trace.Record{Kind: 1, Flag: trace.FlagHostStart, Timestamp: 1, Name: "forward", Domain: "default"}
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			rec.ID = uint64(i)
			sink(&rec)
		}
		_ = n
	})
}

// benchMspti emits b.N records through the fake library, a default-sized
// buffer at a time, and flushes each. Emitting no more than a buffer holds
// completes nothing until the flush, so with timeEmit false the timer sees
// delivery only.
func benchMspti(b *testing.B, timeEmit bool) {
	const chunk = npu.DefaultMarkerBufferBytes / markerSize
	path, fake := fakeMspti(b)
	var n int
	src := openMarkers(b, npu.MarkerConfig{Library: path, Switch: trace.AllOn(),
		Sink: func(*trace.Record) { n++ }})
	run(b, src)
	b.ReportAllocs()
	b.ResetTimer()
	for left := b.N; left > 0; left -= chunk {
		c := min(left, chunk)
		if !timeEmit {
			b.StopTimer()
		}
		fake.Control("emit", int64(c), hostStart, 0, "forward", "")
		if !timeEmit {
			b.StartTimer()
		}
		flush(b, src)
	}
	b.StopTimer()
	if n != b.N {
		b.Fatalf("sink got %d records, want %d (stats %+v)", n, b.N, src.Stats())
	}
}
