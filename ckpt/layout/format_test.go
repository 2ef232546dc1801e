package layout

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestSegmentHeaderRoundTrip(t *testing.T) {
	h := SegmentHeader{Version: Version, HalfSize: 1 << 30, Shard: 7, Flags: FlagReplica, Active: 1, PersistSeq: 42}
	b, err := h.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	// The layout is a contract: spot-check the documented offsets.
	le := binary.LittleEndian
	if string(b[:8]) != Magic || le.Uint32(b[8:]) != 2 || le.Uint32(b[12:]) != 4096 ||
		le.Uint64(b[16:]) != 1<<30 || le.Uint32(b[24:]) != 7 || le.Uint32(b[28:]) != 1 ||
		le.Uint32(b[32:]) != crc32.Checksum(b[:32], crc32.MakeTable(crc32.Castagnoli)) ||
		le.Uint32(b[36:]) != 1 || le.Uint64(b[40:]) != 42 {
		t.Fatalf("header bytes do not follow the documented layout: % x", b)
	}
	got, err := ParseSegmentHeader(b)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(h, got); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
	if h.Size() != 4096+2<<30 {
		t.Fatalf("Size = %d", h.Size())
	}
}

func TestParseSegmentHeaderRejects(t *testing.T) {
	good, _ := SegmentHeader{HalfSize: 8192}.MarshalBinary()
	mutate := func(f func(b []byte)) []byte {
		b := bytes.Clone(good)
		f(b)
		return b
	}
	fixCRC := func(b []byte) { binary.LittleEndian.PutUint32(b[32:], CRC32C(b[:32])) }
	for _, tc := range []struct {
		name, field string
		b           []byte
	}{
		{"short", "", good[:63]},
		{"magic", "magic", mutate(func(b []byte) { b[0] = 'X' })},
		{"version", "version", mutate(func(b []byte) { b[8] = 3; fixCRC(b) })},
		{"header size", "header_size", mutate(func(b []byte) { b[13] = 0; fixCRC(b) })},
		{"flipped bit", "header_crc32c", mutate(func(b []byte) { b[17] ^= 1 })},
		{"half size", "half_size", mutate(func(b []byte) { b[16] = 1; fixCRC(b) })},
		{"flags", "flags", mutate(func(b []byte) { b[28] = 4; fixCRC(b) })},
		{"active", "active", mutate(func(b []byte) { b[36] = 2 })},
		{"reserved", "reserved", mutate(func(b []byte) { b[50] = 1 })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSegmentHeader(tc.b)
			var fe *ParseError
			if !errors.As(err, &fe) || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("err = %v, want a *ParseError wrapping ErrCorrupt", err)
			}
			if fe.Field != tc.field {
				t.Fatalf("field = %q, want %q (%v)", fe.Field, tc.field, err)
			}
		})
	}
}

func sampleMeta() StepMeta {
	m := PlaceBlobs(1200, []string{"model", "optimizer.state", "ünïcode"}, []int64{1000, 0, 77})
	m.Seq = 9
	m.Time = time.Unix(1731000000, 123456789)
	m.Sealed = true
	for i := range m.Blobs {
		m.Blobs[i].CRC32C = uint32(0x1234567 * (i + 1))
	}
	return m
}

func unsealed(m StepMeta) StepMeta {
	m.Blobs = slices.Clone(m.Blobs)
	for i := range m.Blobs {
		m.Blobs[i].CRC32C = 0
	}
	m.Sealed = false
	return m
}

func TestStepMetaRoundTrip(t *testing.T) {
	m := sampleMeta()
	b, err := m.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	ts := m.TableSize()
	if int64(len(b)) != StepHeaderSize+ts+12 || m.MetaSize() != int64(len(b)) {
		t.Fatalf("len = %d, want %d", len(b), StepHeaderSize+ts+12)
	}
	// The layout is a contract: spot-check the documented offsets.
	le := binary.LittleEndian
	arr := b[StepHeaderSize+ts:]
	if le.Uint64(b[16:]) != 9 || le.Uint64(b[24:]) != 1200 || le.Uint32(b[40:]) != 3 ||
		le.Uint32(b[44:]) != uint32(ts) || le.Uint32(b[48:]) != 1 ||
		le.Uint32(b[52:]) != CRC32C(append(bytes.Clone(b[16:48]), b[64:]...)) ||
		le.Uint32(b[60:]) != CRC32C(append(bytes.Clone(b[16:48]), b[64:64+ts]...)) ||
		le.Uint64(b[64:]) != uint64(m.Blobs[0].Offset) || le.Uint64(b[72:]) != 1000 || le.Uint32(b[80:]) != 0 ||
		le.Uint16(b[84:]) != 5 || string(b[88:93]) != "model" ||
		le.Uint32(arr[0:]) != 0x1234567 || le.Uint32(arr[8:]) != 3*0x1234567 {
		t.Fatalf("meta bytes do not follow the documented layout: % x", b)
	}
	if m.Blobs[0].Offset%DataAlign != 0 || m.Blobs[0].Offset < m.MetaSize() {
		t.Fatalf("first blob at %d", m.Blobs[0].Offset)
	}
	got, err := ParseStepMeta(b, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(m, got); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}

	// Unsealed, as a writer leaves it: seal word, seal_crc and CRC array
	// zero, and meta_crc the same as sealed.
	u := unsealed(m)
	ub, err := u.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ub[60:64+ts], b[60:64+ts]) || !bytes.Equal(ub[48:56], make([]byte, 8)) || !bytes.Equal(ub[64+ts:], make([]byte, 12)) {
		t.Fatalf("unsealed meta bytes: % x", ub)
	}
	got, err = ParseStepMeta(ub, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(u, got); diff != "" {
		t.Fatalf("unsealed round trip (-want +got):\n%s", diff)
	}
	// A seal an owner died in the middle of: the CRC array half written,
	// the seal word still 0. Readers take the step as unsealed.
	torn := bytes.Clone(b)
	le.PutUint32(torn[48:], 0)
	if got, err := ParseStepMeta(torn, 1<<20); err != nil || got.Sealed || got.Blobs[0].CRC32C != 0 {
		t.Fatalf("torn seal parsed as %+v, %v; want unsealed", got, err)
	}
	if _, err := (StepMeta{Step: 1, Blobs: []BlobEntry{{Name: "a", Offset: 128, CRC32C: 7}}}).MarshalBinary(); err == nil {
		t.Fatal("MarshalBinary accepted a CRC in an unsealed meta")
	}
}

// fixMetaCRCs sets meta_crc and, for a sealed meta, seal_crc of b to what
// its bytes give, as far as its sizes let them be computed.
func fixMetaCRCs(b []byte) []byte {
	if len(b) < StepHeaderSize {
		return b
	}
	b = bytes.Clone(b)
	le := binary.LittleEndian
	ts, n := int64(le.Uint32(b[44:])), int64(le.Uint32(b[40:]))
	if ts > int64(len(b))-StepHeaderSize {
		return b
	}
	le.PutUint32(b[60:], metaCRC(b, ts))
	if end := StepHeaderSize + ts + 4*n; le.Uint32(b[48:]) == Sealed && end <= int64(len(b)) {
		le.PutUint32(b[52:], SealCRC(b[:end]))
	}
	return b
}

func TestParseStepMetaRejects(t *testing.T) {
	good, _ := sampleMeta().MarshalBinary()
	mutate := func(f func(b []byte)) []byte {
		b := bytes.Clone(good)
		f(b)
		return fixMetaCRCs(b)
	}
	dup := sampleMeta()
	dup.Blobs[1].Name = "model"
	crcAt := len(good) - 12 // the CRC array
	for _, tc := range []struct {
		name, field string
		b           []byte
		half        int64
	}{
		{"short", "", good[:60], 1 << 20},
		{"flipped bit", "meta_crc32c", func() []byte { b := bytes.Clone(good); b[70] ^= 4; return b }(), 1 << 20},
		{"flipped bit in the CRC array", "seal_crc32c", func() []byte { b := bytes.Clone(good); b[crcAt+5] ^= 4; return b }(), 1 << 20},
		{"flipped seal word", "seal", func() []byte { b := bytes.Clone(good); b[48] ^= 2; return b }(), 1 << 20},
		{"table past half", "table_size", mutate(func(b []byte) { binary.LittleEndian.PutUint32(b[44:], 1<<30) }), 1 << 20},
		{"too many blobs", "nblobs", mutate(func(b []byte) { binary.LittleEndian.PutUint32(b[40:], 100) }), 1 << 20},
		{"CRC array past the meta", "nblobs", mutate(func(b []byte) { binary.LittleEndian.PutUint32(b[40:], 4) }), 1 << 20},
		{"negative step", "step", mutate(func(b []byte) { b[31] = 0x80 }), 1 << 20},
		{"blob past half", "blobs[0].offset", good, 1024},
		{"overlap", "blobs[0].offset", mutate(func(b []byte) { binary.LittleEndian.PutUint64(b[64:], 8) }), 1 << 20},
		{"name len", "blobs[0].name_len", mutate(func(b []byte) { binary.LittleEndian.PutUint16(b[84:], 999) }), 1 << 20},
		{"reserved", "reserved", mutate(func(b []byte) { b[57] = 1 }), 1 << 20},
		{"entry reserved", "blobs[0].reserved", mutate(func(b []byte) { b[86] = 1 }), 1 << 20},
		{"entry CRC field", "blobs[0].reserved", mutate(func(b []byte) { b[80] = 1 }), 1 << 20},
		{"padding", "blobs[0].name", mutate(func(b []byte) { b[93] = 'x' }), 1 << 20},
		{"duplicate", "blobs[1].name", marshalUnchecked(dup), 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseStepMeta(tc.b, tc.half)
			var fe *ParseError
			if !errors.As(err, &fe) || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("err = %v, want a *ParseError wrapping ErrCorrupt", err)
			}
			if fe.Field != tc.field {
				t.Fatalf("field = %q, want %q (%v)", fe.Field, tc.field, err)
			}
		})
	}
	if _, err := dup.MarshalBinary(); err == nil {
		t.Fatal("MarshalBinary accepted duplicate names")
	}
}

// marshalUnchecked encodes m without validating it, as a foreign writer
// might: in layout version 2, or with v1 in version 1, where the writer
// put each blob's CRC in its table entry and meta_crc covers it.
func marshalUnchecked(m StepMeta, v1 ...bool) []byte {
	ts := m.TableSize()
	size := m.MetaSize()
	if len(v1) > 0 {
		size = StepHeaderSize + ts
	}
	b := make([]byte, size)
	le := binary.LittleEndian
	le.PutUint64(b[16:], m.Seq)
	le.PutUint64(b[24:], uint64(m.Step))
	le.PutUint64(b[32:], uint64(unixNano(m.Time)))
	le.PutUint32(b[40:], uint32(len(m.Blobs)))
	le.PutUint32(b[44:], uint32(ts))
	p := b[StepHeaderSize:]
	for k, e := range m.Blobs {
		le.PutUint64(p[0:], uint64(e.Offset))
		le.PutUint64(p[8:], uint64(e.Size))
		if len(v1) > 0 {
			le.PutUint32(p[16:], e.CRC32C)
		} else if m.Sealed {
			le.PutUint32(b[StepHeaderSize+ts+4*int64(k):], e.CRC32C)
		}
		le.PutUint16(p[20:], uint16(len(e.Name)))
		copy(p[EntrySize:], e.Name)
		p = p[entryLen(len(e.Name)):]
	}
	if len(v1) > 0 {
		le.PutUint32(b[60:], metaCRCv1(b, ts))
		return b
	}
	le.PutUint32(b[60:], metaCRC(b, ts))
	if m.Sealed {
		le.PutUint32(b[52:], SealCRC(b))
		le.PutUint32(b[48:], Sealed)
	}
	return b
}

// TestParseStepMetaVersion1 reads the meta of the earlier layout, in which
// the writer computed every CRC: the step counts as sealed.
func TestParseStepMetaVersion1(t *testing.T) {
	m := sampleMeta()
	// Version 1 had no CRC array: its blobs could start right after the table.
	m.Blobs[0].Offset = StepHeaderSize + m.TableSize()
	b := marshalUnchecked(m, true)
	got, err := ParseHalfMeta(b, 1<<20, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(m, got); diff != "" {
		t.Fatalf("version 1 (-want +got):\n%s", diff)
	}
	b[83] ^= 1 // a flipped bit in the first CRC, which meta_crc covers
	if _, err := ParseHalfMeta(b, 1<<20, 1, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a flipped CRC in a version 1 table: %v", err)
	}
	// Read as version 2, the same bytes are no valid meta.
	if _, err := ParseStepMeta(marshalUnchecked(m, true), 1<<20); err == nil {
		t.Fatal("a version 1 meta parsed as version 2")
	}
}

func TestShardManifestRoundTrip(t *testing.T) {
	m := ShardManifest{Step: 100, Shard: 2, NumShards: 4, Size: 30, Blobs: []BlobEntry{
		{Name: "model", Offset: 0, Size: 10, CRC32C: 1}, {Name: "optimizer", Offset: 10, Size: 20, CRC32C: 2}}}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"file": "shard-00002.bin"`) {
		t.Fatalf("manifest does not name its data file:\n%s", b)
	}
	got, err := ParseShardManifest(b)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(m, got); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
	for _, tc := range []struct{ name, doc, field string }{
		{"unknown field", `{"version":1,"step":1,"shard":0,"num_shards":1,"file":"shard-00000.bin","size":0,"blobs":[],"x":1}`, ""},
		{"version", `{"version":2,"step":1,"shard":0,"num_shards":1,"file":"shard-00000.bin","size":0,"blobs":[]}`, "version"},
		{"path traversal", `{"version":1,"step":1,"shard":0,"num_shards":1,"file":"../../etc/passwd","size":0,"blobs":[]}`, "file"},
		{"shard range", `{"version":1,"step":1,"shard":3,"num_shards":2,"file":"shard-00003.bin","size":0,"blobs":[]}`, "shard"},
		{"gap", `{"version":1,"step":1,"shard":0,"num_shards":1,"file":"shard-00000.bin","size":9,"blobs":[{"name":"a","offset":1,"size":8,"crc32c":0}]}`, "blobs[0].offset"},
		{"size", `{"version":1,"step":1,"shard":0,"num_shards":1,"file":"shard-00000.bin","size":9,"blobs":[{"name":"a","offset":0,"size":8,"crc32c":0}]}`, "size"},
		{"wrong type", `{"version":1,"step":"1"}`, "step"},
		{"trailing", `{"version":1,"step":1,"shard":0,"num_shards":1,"file":"shard-00000.bin","size":0,"blobs":[]} {}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseShardManifest([]byte(tc.doc))
			var fe *ParseError
			if !errors.As(err, &fe) || fe.Field != tc.field {
				t.Fatalf("err = %v, want a *ParseError on field %q", err, tc.field)
			}
		})
	}
}

func TestStepManifestRoundTrip(t *testing.T) {
	m := StepManifest{Step: 5, Shards: []ShardRef{{0, 10, 0xdeadbeef}, {1, 0, 7}}}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseStepManifest(b)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(m, got); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
	for _, doc := range []string{
		`{"version":1,"step":5,"num_shards":3,"shards":[{"shard":0,"size":1,"manifest_crc32c":1}]}`,
		`{"version":1,"step":5,"num_shards":1,"shards":[{"shard":1,"size":1,"manifest_crc32c":1}]}`,
		`{"version":1,"step":5,"num_shards":0,"shards":[]}`,
		`{"version":1,"step":-5,"num_shards":1,"shards":[{"shard":0,"size":1,"manifest_crc32c":1}]}`,
	} {
		if _, err := ParseStepManifest([]byte(doc)); !errors.Is(err, ErrCorrupt) {
			t.Errorf("ParseStepManifest(%s) = %v, want ErrCorrupt", doc, err)
		}
	}
}

func TestStepText(t *testing.T) {
	for _, in := range []string{"100", "100\n", " 7 "} {
		n, err := ParseStepText([]byte(in))
		if err != nil {
			t.Fatalf("ParseStepText(%q): %v", in, err)
		}
		if m, _ := ParseStepText(MarshalStepText(n)); m != n {
			t.Fatalf("round trip of %d gave %d", n, m)
		}
	}
	for _, in := range []string{"", "-1", "release", "1e3"} {
		if _, err := ParseStepText([]byte(in)); err == nil {
			t.Errorf("ParseStepText(%q) succeeded", in)
		}
	}
}

// fixCRC returns a copy of b with the checksum at off set to what sum
// computes, or b itself when b is too short to hold it.
func fixCRC(b []byte, off int, sum func([]byte) uint32) []byte {
	if len(b) < 64 {
		return b
	}
	c := bytes.Clone(b)
	binary.LittleEndian.PutUint32(c[off:], sum(c))
	return c
}

func FuzzParseSegmentHeader(f *testing.F) {
	good, _ := SegmentHeader{HalfSize: 1 << 20, Shard: 3, Active: 1, PersistSeq: 5}.MarshalBinary()
	f.Add(good)
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, b []byte) {
		// As given, and with the checksum made right, so that the fuzzer
		// reaches the fields behind it.
		for _, in := range [][]byte{b, fixCRC(b, 32, func(b []byte) uint32 { return CRC32C(b[:32]) })} {
			h, err := ParseSegmentHeader(in)
			if err != nil {
				continue
			}
			out, err := h.MarshalBinary()
			if err != nil {
				t.Fatalf("parsed header does not marshal: %v", err)
			}
			if !bytes.Equal(out, in[:64]) {
				t.Fatalf("round trip changed the bytes:\n% x\n% x", in[:64], out)
			}
		}
	})
}

// FuzzParseStepMeta parses bytes as the meta of a half in layout version 2
// or, with v1, version 1.
func FuzzParseStepMeta(f *testing.F) {
	good, _ := sampleMeta().MarshalBinary()
	f.Add(good, int64(1<<20), false)
	open, _ := unsealed(sampleMeta()).MarshalBinary()
	f.Add(open, int64(1<<20), false)
	empty, _ := StepMeta{Step: 1}.MarshalBinary()
	f.Add(empty, int64(4096), false)
	old := sampleMeta()
	old.Blobs[0].Offset = StepHeaderSize + old.TableSize()
	f.Add(marshalUnchecked(old, true), int64(1<<20), true)
	f.Fuzz(func(t *testing.T, b []byte, half int64, v1 bool) {
		version := uint32(Version)
		fix := fixMetaCRCs
		if v1 {
			version = 1
			fix = func(b []byte) []byte {
				return fixCRC(b, 60, func(b []byte) uint32 {
					n := int64(binary.LittleEndian.Uint32(b[44:]))
					if n > int64(len(b))-StepHeaderSize {
						return 0
					}
					return metaCRCv1(b, n)
				})
			}
		}
		// As given, and with the checksums made right, so that the fuzzer
		// reaches the fields behind them.
		for _, in := range [][]byte{b, fix(b)} {
			if len(in) < StepHeaderSize {
				continue
			}
			m, err := ParseHalfMeta(in, half, version, binary.LittleEndian.Uint32(in[OffSeal:]))
			if err != nil {
				continue
			}
			if m.End() > half {
				t.Fatalf("blobs end at %d past the half of %d", m.End(), half)
			}
			if v1 {
				continue // written by earlier releases only
			}
			out, err := m.MarshalBinary()
			if err != nil {
				t.Fatalf("parsed meta does not marshal: %v", err)
			}
			m2, err := ParseStepMeta(out, half)
			if err != nil {
				t.Fatalf("marshalled meta does not parse: %v", err)
			}
			if diff := cmp.Diff(m, m2); diff != "" {
				t.Fatalf("round trip (-first +second):\n%s", diff)
			}
			// Byte for byte but for what an unsealed step leaves undefined:
			// seal_crc and the CRC array.
			want := bytes.Clone(in[:len(out)])
			if !m.Sealed {
				copy(want[OffSealCRC:OffSealCRC+4], make([]byte, 4))
				clear(want[StepHeaderSize+m.TableSize():])
			}
			if !bytes.Equal(out[16:], want[16:]) {
				t.Fatalf("round trip changed the bytes:\n% x\n% x", want, out)
			}
		}
	})
}

func FuzzParseShardManifest(f *testing.F) {
	b, _ := ShardManifest{Step: 1, Shard: 0, NumShards: 2, Size: 3, Blobs: []BlobEntry{{Name: "m", Size: 3, CRC32C: 9}}}.Marshal()
	f.Add(b)
	f.Add([]byte(`{"version":1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseShardManifest(b)
		if err != nil {
			return
		}
		out, err := m.Marshal()
		if err != nil {
			t.Fatalf("parsed manifest does not marshal: %v", err)
		}
		m2, err := ParseShardManifest(out)
		if err != nil {
			t.Fatalf("marshalled manifest does not parse: %v\n%s", err, out)
		}
		if diff := cmp.Diff(m, m2); diff != "" {
			t.Fatalf("round trip (-first +second):\n%s", diff)
		}
	})
}

func FuzzParseStepManifest(f *testing.F) {
	b, _ := StepManifest{Step: 4, Shards: []ShardRef{{0, 1, 2}}}.Marshal()
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseStepManifest(b)
		if err != nil {
			return
		}
		out, err := m.Marshal()
		if err != nil {
			t.Fatalf("parsed manifest does not marshal: %v", err)
		}
		m2, err := ParseStepManifest(out)
		if err != nil {
			t.Fatalf("marshalled manifest does not parse: %v\n%s", err, out)
		}
		if diff := cmp.Diff(m, m2); diff != "" {
			t.Fatalf("round trip (-first +second):\n%s", diff)
		}
	})
}

func FuzzParseStepText(f *testing.F) {
	f.Add([]byte("100"))
	f.Add([]byte("7\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := ParseStepText(b)
		if err != nil {
			return
		}
		if m, err := ParseStepText(MarshalStepText(n)); err != nil || m != n {
			t.Fatalf("round trip of %d: %d, %v", n, m, err)
		}
	})
}

func TestCRC32CCheckValue(t *testing.T) {
	// The documented check value, so that other languages can test theirs.
	if got := CRC32C([]byte("123456789")); got != 0xe3069283 {
		t.Fatalf("CRC32C(123456789) = %#x", got)
	}
}
