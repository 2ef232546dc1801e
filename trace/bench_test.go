package trace

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

var sinkTime time.Time

// nowPair is the baseline of the recorder's hot path: two time.Now calls,
// what any timing of a range costs at least.
func nowPair() {
	sinkTime = time.Now()
	sinkTime = time.Now()
}

// BenchmarkTimeNowPair is the baseline of BenchmarkRangeOn alone.
func BenchmarkTimeNowPair(b *testing.B) {
	for b.Loop() {
		nowPair()
	}
}

// BenchmarkRangeOn is a start and an end with the kind on, while Run
// writes the records. The ring is also drained outside the timed region
// every so often, so that the figure is the recording path and not the
// drop path.
func BenchmarkRangeOn(b *testing.B) {
	rec, err := NewRecorder(RecorderConfig{Root: b.TempDir(), Job: "bench",
		Switch: AllOn(), BufferRecords: 1 << 16, MaxFileBytes: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	go rec.Run(context.Background())
	defer rec.Close()
	b.ReportAllocs()
	v := testkit.Paired{Base: nowPair, Unit: "x-nowpair"}
	i := 0
	for b.Loop() {
		v.Tick(b)
		rec.Start(FP, MarkerForward, 0, 1).End()
		if i++; i%(1<<14) == 0 {
			b.StopTimer()
			rec.Flush()
			b.StartTimer()
		}
	}
	b.StopTimer()
	v.Report(b)
	if d := rec.Stats().Dropped; d != (DomainCounts{}) {
		b.Fatalf("dropped %+v", d)
	}
}

// BenchmarkRangeOnParallel is BenchmarkRangeOn from every P at once: the
// producers share one ring.
func BenchmarkRangeOnParallel(b *testing.B) {
	rec, err := NewRecorder(RecorderConfig{Root: b.TempDir(), Job: "bench",
		Switch: AllOn(), BufferRecords: 1 << 20, MaxFileBytes: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	go rec.Run(context.Background())
	defer rec.Close()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			rec.Start(FP, MarkerForward, 0, 1).End()
		}
	})
	b.StopTimer()
	s := rec.Stats()
	b.ReportMetric(float64(s.Dropped.Default)/float64(2*b.N), "dropped/record")
}

// BenchmarkRangeOff is a start and an end with the kind off.
func BenchmarkRangeOff(b *testing.B) {
	rec, err := NewRecorder(RecorderConfig{Root: b.TempDir(), Job: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	go rec.Run(context.Background())
	defer rec.Close()
	b.ReportAllocs()
	for b.Loop() {
		rec.Start(FP, MarkerForward, 0, 1).End()
	}
}

// benchRecords is a mix of records as a training loop writes them.
func benchRecords() []Record {
	op := CommOp{OpName: "HcclAllReduce", GroupName: "group_name_137", Count: 4194304, DataType: "bf16", StreamID: 10}
	comm := string(op.AppendJSON(nil))
	base := Record{Kind: ActivityKindMarker, SourceKind: SourceKindHost, Timestamp: 1731000000123456789,
		ID: 1731000000000000000, ProcessID: 41234, ThreadID: 41234, DeviceID: 3, StreamID: 7}
	var recs []Record
	for i, n := range []struct {
		name, dom string
		flag      Flag
	}{
		{"step 1024", DomainDefault, FlagDeviceStart},
		{MarkerDataLoader, DomainDefault, FlagHostStart},
		{"", "", FlagHostEnd},
		{MarkerForward, DomainDefault, FlagDeviceStart},
		{"", "", FlagDeviceEnd},
		{comm, DomainCommunication, FlagDeviceStart},
		{"", "", FlagDeviceEnd},
		{"", "", FlagDeviceEnd},
	} {
		r := base
		r.Name, r.Domain, r.Flag = n.name, n.dom, n.flag
		r.ID += uint64(i)
		r.Timestamp += uint64(i) * 1000
		recs = append(recs, r)
	}
	return recs
}

func benchLines() ([]byte, int) {
	var buf []byte
	recs := benchRecords()
	for i := range recs {
		buf = recs[i].AppendJSON(buf)
		buf = append(buf, '\n')
	}
	return buf, len(recs)
}

// Both throughput benchmarks write 10 MiB files and remove the finished
// ones outside the timed region, so that neither waits for the disk's
// writeback of gigabytes: the figures compare the work on the CPU.

// BenchmarkWriterThroughput writes records through a fileWriter (encoding,
// buffering, a new file every 10 MiB). Compare with BenchmarkRawFileWrite.
func BenchmarkWriterThroughput(b *testing.B) {
	recs := benchRecords()
	lines, _ := benchLines()
	root := b.TempDir()
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	dir := filepath.Join(root, "bench", "0")
	b.SetBytes(int64(len(lines)))
	b.ReportAllocs()
	files := uint64(0)
	for b.Loop() {
		for i := range recs {
			if err := w.Write(&recs[i]); err != nil {
				b.Fatal(err)
			}
		}
		if n := w.c.files.Load(); n != files { // rotated: remove the finished file, as the baseline does
			files = n
			b.StopTimer()
			removeAllButNewest(b, dir)
			b.StartTimer()
		}
	}
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
}

func removeAllButNewest(b *testing.B, dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	for _, e := range ents[:max(len(ents)-1, 0)] { // sorted by name, the newest last
		os.Remove(filepath.Join(dir, e.Name()))
	}
}

// BenchmarkRawFileWrite writes the same bytes, already encoded, with a
// plain bufio.Writer of the same buffer size, to a new file every 10 MiB:
// the baseline of BenchmarkWriterThroughput.
func BenchmarkRawFileWrite(b *testing.B) {
	lines, _ := benchLines()
	dir := b.TempDir()
	perFile := defaultMaxFileBytes / len(lines)
	create := func(n int) *os.File {
		f, err := os.Create(filepath.Join(dir, strconv.Itoa(n)))
		if err != nil {
			b.Fatal(err)
		}
		return f
	}
	f := create(0)
	bw := bufio.NewWriterSize(f, defaultBufferBytes)
	b.SetBytes(int64(len(lines)))
	n := 0
	for b.Loop() {
		bw.Write(lines)
		if n++; n%perFile == 0 {
			bw.Flush()
			f.Close()
			b.StopTimer()
			os.Remove(f.Name())
			b.StartTimer()
			f = create(n)
			bw.Reset(f)
		}
	}
	bw.Flush()
	f.Sync()
	f.Close()
}

// BenchmarkParseRecord parses canonical record lines. Compare with
// BenchmarkReadLines.
func BenchmarkParseRecord(b *testing.B) {
	lines, n := benchLines()
	split := bytes.SplitN(lines, []byte{'\n'}, n)
	b.SetBytes(int64(len(lines)))
	b.ReportAllocs()
	var r Record
	for b.Loop() {
		for _, l := range split {
			if err := parseRecordInto(l, &r, nil); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkParseRecordInterned parses the same lines as a RankReader
// does, with a table of the names it has seen.
func BenchmarkParseRecordInterned(b *testing.B) {
	lines, n := benchLines()
	split := bytes.SplitN(lines, []byte{'\n'}, n)
	b.SetBytes(int64(len(lines)))
	b.ReportAllocs()
	var r Record
	var in interner
	for b.Loop() {
		for _, l := range split {
			if err := parseRecordInto(l, &r, &in); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// benchFile writes about 32 MiB of records to a rank folder.
func benchFile(b *testing.B) (dir string, size int64) {
	dir = filepath.Join(b.TempDir(), "0")
	os.Mkdir(dir, 0o750)
	lines, _ := benchLines()
	data := bytes.Repeat(lines, (32<<20)/len(lines))
	if err := os.WriteFile(filepath.Join(dir, "1731000000"), data, 0o640); err != nil {
		b.Fatal(err)
	}
	return dir, int64(len(data))
}

// BenchmarkReadLines reads the lines of a record file with bufio.Scanner
// and parses nothing: the baseline of BenchmarkRankReader.
func BenchmarkReadLines(b *testing.B) {
	dir, size := benchFile(b)
	b.SetBytes(size)
	for b.Loop() {
		f, err := os.Open(filepath.Join(dir, "1731000000"))
		if err != nil {
			b.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 256<<10), MaxLineBytes)
		for sc.Scan() {
		}
		f.Close()
	}
}

// BenchmarkRankReader reads and parses the same file through a RankReader.
func BenchmarkRankReader(b *testing.B) {
	dir, size := benchFile(b)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		rr, err := OpenRankReader(dir, ReaderConfig{})
		if err != nil {
			b.Fatal(err)
		}
		n := 0
		rr.Read(func(*Record) error { n++; return nil })
		rr.Close()
		if n == 0 {
			b.Fatal("no records")
		}
	}
}

// BenchmarkAppendJSON encodes records without writing them, with no
// memory of earlier ones. Compare with BenchmarkCopyLines.
func BenchmarkAppendJSON(b *testing.B) {
	recs := benchRecords()
	lines, _ := benchLines()
	b.SetBytes(int64(len(lines)))
	buf := make([]byte, 0, 2*len(lines))
	for b.Loop() {
		buf = buf[:0]
		for i := range recs {
			buf = recs[i].AppendJSON(buf)
			buf = append(buf, '\n')
		}
	}
}

// BenchmarkEncoder encodes records as a fileWriter does, with its memory of
// the last heads, object ids, names and leading digits. Compare with
// BenchmarkCopyLines.
func BenchmarkEncoder(b *testing.B) {
	recs := benchRecords()
	lines, _ := benchLines()
	b.SetBytes(int64(len(lines)))
	buf := make([]byte, 0, 2*len(lines))
	var e encoder
	for b.Loop() {
		buf = buf[:0]
		for i := range recs {
			buf = e.appendRecord(buf, &recs[i], nameLiteral, 0, nil)
			buf = append(buf, '\n')
		}
	}
}

// BenchmarkCopyLines copies the encoded bytes: the memcpy baseline of
// BenchmarkAppendJSON.
func BenchmarkCopyLines(b *testing.B) {
	lines, _ := benchLines()
	b.SetBytes(int64(len(lines)))
	buf := make([]byte, 0, 2*len(lines))
	for b.Loop() {
		buf = append(buf[:0], lines...)
	}
}

// BenchmarkPairer pairs the records of a step as a rank writes them:
// nested ranges, each start named and each end not.
func BenchmarkPairer(b *testing.B) {
	recs := make([]Record, 0, 24)
	id := uint64(0)
	var open []uint64
	for i := range 24 {
		if i%2 == 0 || len(open) == 0 {
			id++
			open = append(open, id)
			recs = append(recs, Record{Flag: FlagDeviceStart, SourceKind: SourceKindDevice, ID: id, Timestamp: uint64(i),
				Name: MarkerForward, Domain: DomainDefault})
			continue
		}
		recs = append(recs, Record{Flag: FlagDeviceEnd, SourceKind: SourceKindDevice, ID: open[len(open)-1], Timestamp: uint64(i)})
		open = open[:len(open)-1]
	}
	p := Pairer{MaxOpen: 256}
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		for i := range recs {
			r := &recs[i]
			r.ID += 1000 // fresh Ids each round
			if _, ok := p.Add(r); ok {
				n++
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(recs)), "ns/record")
}
