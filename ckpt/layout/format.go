package layout

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/faultline-ml/faultline/internal/parseerr"
)

// Constants of the shared-memory layout. See the package documentation.
const (
	// Magic opens every segment.
	Magic = "FLTCKPT\x00"
	// Version is the layout version this package writes. It also reads
	// version 1 (see the package documentation).
	Version = 2
	// HeaderSize is the size of the segment header; half 0 starts here.
	HeaderSize = 4096
	// StepHeaderSize is the size of the fixed part of a half, before its
	// blob table.
	StepHeaderSize = 64
	// EntrySize is the size of the fixed part of a blob table entry, before
	// its name.
	EntrySize = 24
	// DataAlign is the alignment of blob data inside a half, as this
	// package lays it out. Parsers accept any offset.
	DataAlign = 64
	// PageSize is the granularity of half sizes.
	PageSize = 4096
	// MaxNameLen bounds a blob name, in bytes.
	MaxNameLen = 1024
	// MaxBlobs bounds the blobs of one step.
	MaxBlobs = 1 << 16
)

// Half states, the first word of each half.
const (
	StateEmpty    = 0 // never written
	StateWriting  = 1 // a save is in progress or died; the half holds no step
	StateComplete = 2 // the half holds the step its table describes
)

// FlagReplica marks a segment that holds a copy of a peer's shard.
const FlagReplica = 1

// Seal words, at offset 48 of each half.
const (
	Unsealed = 0 // the blob CRCs are not computed yet
	Sealed   = 1 // the CRC array holds every blob's CRC32C
)

// Offsets of the live words that writers and readers touch with atomic
// loads and stores. They are outside every checksum.
const (
	OffActive     = 36 // segment header: u32
	OffPersistSeq = 40 // segment header: u64
	OffState      = 0  // half: u32
	OffPin        = 4  // half: u32
	OffGen        = 8  // half: u64
	OffSeal       = 48 // half: u32, written last by the sealer
	OffSealCRC    = 52 // half: u32, written by the sealer before the seal
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC32C returns the CRC-32 of b with the Castagnoli polynomial, the
// checksum used everywhere in the format.
func CRC32C(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// ErrCorrupt is wrapped by every error that reports bytes failing a check:
// a bad magic, a field out of range, a checksum mismatch.
var ErrCorrupt = errors.New("layout: corrupt checkpoint data")

// ParseError says which field of which file is wrong. It has the shape
// of every parse error of this module, with a byte offset in place of a
// line: what was parsed, where, the field at fault, and what is wrong.
type ParseError struct {
	Format string // what was parsed, "" when the field says it
	File   string // the file, "" when parsing bytes of unknown origin
	Offset int64  // byte offset of the field, -1 for JSON documents
	Field  string // the field, such as "half_size" or "blobs[2].crc32c"
	Msg    string // what is wrong, with the value
}

// Error returns "layout: <file>: offset <n>: field <f>: <msg>", leaving
// out what is unknown.
func (e *ParseError) Error() string {
	t := parseerr.Text{Pkg: "layout", Format: e.Format, File: e.File, Field: e.Field, Msg: e.Msg}
	if e.Offset >= 0 {
		t.At = "offset " + strconv.FormatInt(e.Offset, 10)
	}
	return t.String()
}

// Unwrap lets errors.Is(err, ErrCorrupt) hold.
func (e *ParseError) Unwrap() error { return ErrCorrupt }

func formatErr(off int64, field, format string, args ...any) *ParseError {
	return &ParseError{Offset: off, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// SegmentHeader is the first 64 bytes of a segment.
type SegmentHeader struct {
	// Version is the layout version: 1 or 2. Zero marshals as Version.
	Version  uint32
	HalfSize int64  // bytes per half, a multiple of PageSize
	Shard    int    // the shard the segment holds
	Flags    uint32 // FlagReplica
	// Live words, outside the checksum.
	Active     uint32 // half of the newest completed save, 0 or 1
	PersistSeq uint64 // seq of the save the writer asks the owner to persist, 0 for none
}

// Size is the size of the whole segment file.
func (h SegmentHeader) Size() int64 { return HeaderSize + 2*h.HalfSize }

// MarshalBinary encodes h in its 64-byte form.
func (h SegmentHeader) MarshalBinary() ([]byte, error) {
	if err := h.check(); err != nil {
		return nil, err
	}
	b := make([]byte, 64)
	copy(b, Magic)
	le := binary.LittleEndian
	le.PutUint32(b[8:], cmp.Or(h.Version, Version))
	le.PutUint32(b[12:], HeaderSize)
	le.PutUint64(b[16:], uint64(h.HalfSize))
	le.PutUint32(b[24:], uint32(h.Shard))
	le.PutUint32(b[28:], h.Flags)
	le.PutUint32(b[32:], CRC32C(b[:32]))
	le.PutUint32(b[OffActive:], h.Active)
	le.PutUint64(b[OffPersistSeq:], h.PersistSeq)
	return b, nil
}

// MaxHalfSize bounds a half so that HeaderSize+2*HalfSize stays inside an
// int64 and a mapping.
const MaxHalfSize = 1 << 46

func (h SegmentHeader) check() error {
	switch {
	case h.Version > Version:
		return formatErr(8, "version", "value %d, want 1 or %d", h.Version, Version)
	case h.HalfSize < PageSize || h.HalfSize > MaxHalfSize || h.HalfSize%PageSize != 0:
		return formatErr(16, "half_size", "value %d is not a multiple of %d between %d and %d", h.HalfSize, PageSize, PageSize, int64(MaxHalfSize))
	case h.Shard < 0 || h.Shard > math.MaxInt32:
		return formatErr(24, "shard", "value %d out of range", h.Shard)
	case h.Flags&^FlagReplica != 0:
		return formatErr(28, "flags", "unknown bits in %#x", h.Flags)
	case h.Active > 1:
		return formatErr(OffActive, "active", "value %d is neither 0 nor 1", h.Active)
	}
	return nil
}

// ParseSegmentHeader decodes the first 64 bytes of b. Errors are
// *ParseError and wrap ErrCorrupt.
func ParseSegmentHeader(b []byte) (SegmentHeader, error) {
	if len(b) < 64 {
		return SegmentHeader{}, formatErr(0, "", "header of %d bytes, want 64", len(b))
	}
	if string(b[:8]) != Magic {
		return SegmentHeader{}, formatErr(0, "magic", "value %q, want %q", b[:8], Magic)
	}
	le := binary.LittleEndian
	v := le.Uint32(b[8:])
	if v != 1 && v != Version {
		return SegmentHeader{}, formatErr(8, "version", "value %d, want 1 or %d", v, Version)
	}
	if v := le.Uint32(b[12:]); v != HeaderSize {
		return SegmentHeader{}, formatErr(12, "header_size", "value %d, want %d", v, HeaderSize)
	}
	if got, want := le.Uint32(b[32:]), CRC32C(b[:32]); got != want {
		return SegmentHeader{}, formatErr(32, "header_crc32c", "value %#08x, computed %#08x", got, want)
	}
	for i := 48; i < 64; i++ {
		if b[i] != 0 {
			return SegmentHeader{}, formatErr(int64(i), "reserved", "byte %#02x is not zero", b[i])
		}
	}
	hs := le.Uint64(b[16:])
	h := SegmentHeader{
		Version:    v,
		HalfSize:   int64(min(hs, math.MaxInt64)),
		Shard:      int(le.Uint32(b[24:])),
		Flags:      le.Uint32(b[28:]),
		Active:     le.Uint32(b[OffActive:]),
		PersistSeq: le.Uint64(b[OffPersistSeq:]),
	}
	if err := h.check(); err != nil {
		return SegmentHeader{}, err
	}
	return h, nil
}

// BlobEntry describes one named blob: where its bytes are, how many, and
// their CRC32C. In a half, Offset counts from the start of the half; in a
// shard file, from the start of the file.
type BlobEntry struct {
	Name   string `json:"name"`
	Offset int64  `json:"offset"`
	Size   int64  `json:"size"`
	CRC32C uint32 `json:"crc32c"`
}

// StepMeta is the checksummed part of a half: the step it holds, the blob
// table and, once the step is sealed, the blob CRCs. The live words
// (state, pin, gen) are not part of it.
type StepMeta struct {
	Seq   uint64    // save sequence number inside the segment
	Step  int64     // training step
	Time  time.Time // when the save began
	Blobs []BlobEntry
	// Sealed says that the CRC32C of every blob is known: the owner
	// computed it after the save (or, in a version 1 segment, the writer
	// during it). Unsealed, every CRC32C is zero.
	Sealed bool
}

// TableSize is the size in bytes of the blob table of m.
func (m StepMeta) TableSize() int64 {
	var n int64
	for _, b := range m.Blobs {
		n += entryLen(len(b.Name))
	}
	return n
}

// MetaSize is the size of the header, the table and the CRC array: the
// bytes MarshalBinary returns.
func (m StepMeta) MetaSize() int64 { return m.metaEnd(Version) }

// metaEnd is where the meta of a layout version ends and blob data may
// begin: version 1 has no CRC array.
func (m StepMeta) metaEnd(version uint32) int64 {
	n := StepHeaderSize + m.TableSize()
	if version >= 2 {
		n += 4 * int64(len(m.Blobs))
	}
	return n
}

// DataStart is the first offset in a half at which this package places
// blob data: after the header, table and CRC array, aligned to DataAlign.
func (m StepMeta) DataStart() int64 { return alignUp(m.MetaSize(), DataAlign) }

// End is the offset just past the last blob, or DataStart when there is
// none: the bytes of a half that the step occupies.
func (m StepMeta) End() int64 {
	end := m.DataStart()
	for _, b := range m.Blobs {
		end = max(end, b.Offset+b.Size)
	}
	return end
}

// DataSize is the sum of the blob sizes.
func (m StepMeta) DataSize() int64 {
	var n int64
	for _, b := range m.Blobs {
		n += b.Size
	}
	return n
}

// Blob returns the entry named name.
func (m StepMeta) Blob(name string) (BlobEntry, bool) {
	for _, b := range m.Blobs {
		if b.Name == name {
			return b, true
		}
	}
	return BlobEntry{}, false
}

func entryLen(nameLen int) int64 { return EntrySize + alignUp(int64(nameLen), 8) }

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// PlaceBlobs returns the unsealed meta of a step made of blobs with these
// names and sizes, each placed at the next DataAlign boundary, as ckpt
// lays out a save.
func PlaceBlobs(step int64, names []string, sizes []int64) StepMeta {
	m := StepMeta{Step: step, Blobs: make([]BlobEntry, len(names))}
	for i := range names {
		m.Blobs[i] = BlobEntry{Name: names[i], Size: sizes[i]}
	}
	off := m.DataStart()
	for i := range m.Blobs {
		m.Blobs[i].Offset = off
		off = alignUp(off+sizes[i], DataAlign)
	}
	return m
}

// MarshalBinary encodes m as the bytes of a half from its start through
// the CRC array (MetaSize bytes), with the live words state, pin and gen
// zero. A sealed m has its seal word, seal_crc and CRC array set; an
// unsealed one has them zero. It fails if m would not parse back.
func (m StepMeta) MarshalBinary() ([]byte, error) {
	if err := m.check(math.MaxInt64, Version); err != nil {
		return nil, err
	}
	ts := m.TableSize()
	b := make([]byte, m.MetaSize())
	le := binary.LittleEndian
	le.PutUint64(b[16:], m.Seq)
	le.PutUint64(b[24:], uint64(m.Step))
	le.PutUint64(b[32:], uint64(unixNano(m.Time)))
	le.PutUint32(b[40:], uint32(len(m.Blobs)))
	le.PutUint32(b[44:], uint32(ts))
	p := b[StepHeaderSize:]
	for _, e := range m.Blobs {
		le.PutUint64(p[0:], uint64(e.Offset))
		le.PutUint64(p[8:], uint64(e.Size))
		le.PutUint16(p[20:], uint16(len(e.Name)))
		copy(p[EntrySize:], e.Name)
		p = p[entryLen(len(e.Name)):]
	}
	le.PutUint32(b[60:], metaCRC(b, ts))
	if m.Sealed {
		for k, e := range m.Blobs {
			le.PutUint32(p[4*k:], e.CRC32C)
		}
		le.PutUint32(b[OffSealCRC:], SealCRC(b))
		le.PutUint32(b[OffSeal:], Sealed)
	}
	return b, nil
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// metaCRC is meta_crc: the CRC32C of bytes [16,48) of a half followed by
// its table of ts bytes.
func metaCRC(b []byte, ts int64) uint32 {
	c := crc32.Update(0, castagnoli, b[16:OffSeal])
	return crc32.Update(c, castagnoli, b[StepHeaderSize:StepHeaderSize+ts])
}

// SealCRC is seal_crc: the CRC32C of bytes [16,48) of a half followed by
// its table and CRC array, which b, the half's meta, ends with.
func SealCRC(b []byte) uint32 {
	c := crc32.Update(0, castagnoli, b[16:OffSeal])
	return crc32.Update(c, castagnoli, b[StepHeaderSize:])
}

// metaCRCv1 is the meta_crc of layout version 1: bytes [16,60) and the
// table.
func metaCRCv1(b []byte, ts int64) uint32 {
	c := crc32.Update(0, castagnoli, b[16:60])
	return crc32.Update(c, castagnoli, b[StepHeaderSize:StepHeaderSize+ts])
}

// Check reports what keeps m from fitting a half of halfSize bytes in the
// layout this package writes. Errors are *ParseError and wrap ErrCorrupt.
func (m StepMeta) Check(halfSize int64) error { return m.check(halfSize, Version) }

// check validates m against a half of halfSize bytes in a layout version.
func (m StepMeta) check(halfSize int64, version uint32) error {
	if m.Step < 0 {
		return formatErr(24, "step", "value %d is negative", m.Step)
	}
	if len(m.Blobs) > MaxBlobs {
		return formatErr(40, "nblobs", "value %d exceeds %d", len(m.Blobs), MaxBlobs)
	}
	if ts := m.TableSize(); ts > math.MaxUint32-StepHeaderSize {
		return formatErr(44, "table_size", "value %d too large", ts)
	}
	end := m.metaEnd(version)
	if end > halfSize {
		return formatErr(44, "table_size", "the table and CRC array of %d blobs end at %d, past the half of %d bytes", len(m.Blobs), end, halfSize)
	}
	seen := make(map[string]bool, len(m.Blobs))
	for i, e := range m.Blobs {
		if err := checkName(e.Name); err != nil {
			return formatErr(-1, blobField(i, ".name"), "%v", err)
		}
		if seen[e.Name] {
			return formatErr(-1, blobField(i, ".name"), "duplicate name %q", e.Name)
		}
		seen[e.Name] = true
		switch {
		case e.Size < 0 || e.Size > halfSize:
			return formatErr(-1, blobField(i, ".size"), "value %d out of range [0,%d]", e.Size, halfSize)
		case e.Offset < end:
			return formatErr(-1, blobField(i, ".offset"), "value %d overlaps the meta or the previous blob ending at %d", e.Offset, end)
		case e.Offset > halfSize-e.Size:
			return formatErr(-1, blobField(i, ".offset"), "blob [%d,+%d) runs past the half of %d bytes", e.Offset, e.Size, halfSize)
		case !m.Sealed && e.CRC32C != 0:
			return formatErr(-1, blobField(i, ".crc32c"), "value %#08x in an unsealed step, whose CRCs are not known", e.CRC32C)
		}
		end = e.Offset + e.Size
	}
	return nil
}

// blobField names field f of blob table entry i, for an error: built only
// on the error path, as a parse runs on every load.
func blobField(i int, f string) string { return "blobs[" + strconv.Itoa(i) + "]" + f }

func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("empty")
	case len(name) > MaxNameLen:
		return fmt.Errorf("%d bytes exceed %d", len(name), MaxNameLen)
	case !utf8.ValidString(name):
		return fmt.Errorf("%q is not UTF-8", name)
	case bytes.IndexByte([]byte(name), 0) >= 0:
		return fmt.Errorf("%q holds a NUL byte", name)
	}
	return nil
}

// ParseStepMeta decodes the header, blob table and CRC array of a half
// from b, which starts at the half and holds at least MetaSize bytes.
// halfSize bounds the blob offsets. The live words state, pin and gen are
// ignored; the seal word says whether the CRC array counts. meta_crc, and
// seal_crc of a sealed step, are verified. Errors are *ParseError and
// wrap ErrCorrupt.
func ParseStepMeta(b []byte, halfSize int64) (StepMeta, error) {
	if len(b) < StepHeaderSize {
		return StepMeta{}, formatErr(0, "", "half of %d bytes, want at least %d", len(b), StepHeaderSize)
	}
	return ParseHalfMeta(b, halfSize, Version, binary.LittleEndian.Uint32(b[OffSeal:]))
}

// ParseHalfMeta is ParseStepMeta for a segment of layout version 1 or 2,
// with the seal word given: the reader of a live half loads it
// atomically, before it reads the CRC array that the seal covers.
func ParseHalfMeta(b []byte, halfSize int64, version, seal uint32) (StepMeta, error) {
	if len(b) < StepHeaderSize {
		return StepMeta{}, formatErr(0, "", "half of %d bytes, want at least %d", len(b), StepHeaderSize)
	}
	le := binary.LittleEndian
	nblobs := int64(le.Uint32(b[40:]))
	tableSize := int64(le.Uint32(b[44:]))
	if tableSize > int64(len(b))-StepHeaderSize || tableSize > halfSize-StepHeaderSize {
		return StepMeta{}, formatErr(44, "table_size", "value %d runs past the half", tableSize)
	}
	if nblobs > MaxBlobs || nblobs*EntrySize > tableSize {
		return StepMeta{}, formatErr(40, "nblobs", "value %d does not fit a table of %d bytes", nblobs, tableSize)
	}
	tableEnd := StepHeaderSize + tableSize
	metaEnd, reserved, crc := tableEnd, OffSeal, metaCRCv1(b, tableSize)
	if version >= 2 {
		metaEnd, reserved, crc = tableEnd+4*nblobs, 56, metaCRC(b, tableSize)
		if metaEnd > int64(len(b)) || metaEnd > halfSize {
			return StepMeta{}, formatErr(40, "nblobs", "the CRC array of %d blobs runs past the half", nblobs)
		}
	}
	for i := reserved; i < 60; i++ {
		if b[i] != 0 {
			return StepMeta{}, formatErr(int64(i), "reserved", "byte %#02x is not zero", b[i])
		}
	}
	if got := le.Uint32(b[60:]); got != crc {
		return StepMeta{}, formatErr(60, "meta_crc32c", "value %#08x, computed %#08x", got, crc)
	}
	m := StepMeta{
		Seq:    le.Uint64(b[16:]),
		Step:   int64(le.Uint64(b[24:])),
		Blobs:  make([]BlobEntry, 0, nblobs),
		Sealed: version < 2,
	}
	if version >= 2 {
		switch seal {
		case Unsealed:
		case Sealed:
			if got, want := le.Uint32(b[OffSealCRC:]), SealCRC(b[:metaEnd]); got != want {
				return StepMeta{}, formatErr(OffSealCRC, "seal_crc32c", "value %#08x, computed %#08x", got, want)
			}
			m.Sealed = true
		default:
			return StepMeta{}, formatErr(OffSeal, "seal", "value %d is neither %d nor %d", seal, Unsealed, Sealed)
		}
	}
	if ns := int64(le.Uint64(b[32:])); ns != 0 {
		m.Time = time.Unix(0, ns)
	}
	p := b[StepHeaderSize:tableEnd]
	crcs := b[tableEnd:metaEnd]
	off := int64(StepHeaderSize)
	for i := range nblobs {
		if len(p) < EntrySize {
			return StepMeta{}, formatErr(off, blobField(int(i), ""), "entry runs past the table")
		}
		nameLen := int(le.Uint16(p[20:]))
		if r := le.Uint16(p[22:]); r != 0 {
			return StepMeta{}, formatErr(off+22, blobField(int(i), ".reserved"), "value %d is not zero", r)
		}
		n := entryLen(nameLen)
		if n > int64(len(p)) {
			return StepMeta{}, formatErr(off+20, blobField(int(i), ".name_len"), "value %d runs past the table", nameLen)
		}
		for _, c := range p[EntrySize+nameLen : n] {
			if c != 0 {
				return StepMeta{}, formatErr(off+EntrySize+int64(nameLen), blobField(int(i), ".name"), "padding is not zero")
			}
		}
		e := BlobEntry{
			Offset: int64(min(le.Uint64(p[0:]), math.MaxInt64)),
			Size:   int64(min(le.Uint64(p[8:]), math.MaxInt64)),
			Name:   string(p[EntrySize : EntrySize+nameLen]),
		}
		switch {
		case version < 2:
			e.CRC32C = le.Uint32(p[16:])
		case le.Uint32(p[16:]) != 0:
			return StepMeta{}, formatErr(off+16, blobField(int(i), ".reserved"), "value %d is not zero", le.Uint32(p[16:]))
		case m.Sealed:
			e.CRC32C = le.Uint32(crcs[4*i:])
		}
		m.Blobs = append(m.Blobs, e)
		p = p[n:]
		off += n
	}
	if len(p) != 0 {
		return StepMeta{}, formatErr(off, "table_size", "%d bytes left after %d entries", len(p), nblobs)
	}
	if err := m.check(halfSize, version); err != nil {
		return StepMeta{}, err
	}
	return m, nil
}

// StepSize is the half size (ckpt.OwnerConfig.Capacity) that holds a step
// of blobs with these names and sizes, rounded up to whole pages.
func StepSize(names []string, sizes []int64) int64 {
	return alignUp(PlaceBlobs(0, names, sizes).End(), PageSize)
}
