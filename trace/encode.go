package trace

import (
	"math/bits"
	"slices"
)

// encoder writes records as Record.AppendJSON does, byte for byte, with a
// memory of the last object id and names: the records of one writer
// mostly repeat them, and copying is cheaper than formatting and escaping
// again.
type encoder struct {
	heads [7]head // by flag bit: a writer's records mostly alternate between a few flags

	obj     [4]uint32 // ProcessID, ThreadID, DeviceID, StreamID of objJSON
	objJSON []byte    // `,"MsptiObjectId":{...}},"Name":`

	name     string // the last long literal name, escaped in nameJSON
	nameJSON []byte

	op        CommOp // the last communication op, as an escaped name in opJSON
	opJSON    []byte
	opScratch []byte

	ts, id bigMemo
}

// head is the JSON form of a record up to the Timestamp's value.
type head struct {
	key  [3]uint32 // Kind, Flag, SourceKind
	json []byte    // `{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":`
}

// bigMemo remembers the decimal digits of a large number but its last six:
// successive timestamps and ids share them, so only six digits are new.
type bigMemo struct {
	hi     uint64
	digits []byte
}

// append appends v in decimal, as appendUint does.
func (m *bigMemo) append(dst []byte, v uint64) []byte {
	if v < 1e12 {
		return appendUint(dst, v)
	}
	hi := v / 1e6
	lo := uint32(v - hi*1e6) // six digits, in cheaper 32-bit arithmetic
	if hi != m.hi || m.digits == nil {
		m.hi = hi
		m.digits = appendUint(m.digits[:0], hi)
	}
	dst = append(dst, m.digits...)
	a, b, c := lo/10000*2, lo/100%100*2, lo%100*2
	return append(dst, digitPairs[a], digitPairs[a+1], digitPairs[b], digitPairs[b+1], digitPairs[c], digitPairs[c+1])
}

// memoMinName is the length from which a literal name is memoised; shorter
// ones escape about as fast as they compare.
const memoMinName = 32

// appendRecord appends r's JSON form. form says where the name comes
// from: r.Name, "step <step>" or *op as JSON.
func (e *encoder) appendRecord(dst []byte, r *Record, form uint8, step uint64, op *CommOp) []byte {
	dst = slices.Grow(dst, 320)
	h := &e.heads[bits.TrailingZeros32(uint32(r.Flag)|1<<6)] // one per flag bit, one for none
	if key := [3]uint32{r.Kind, uint32(r.Flag), r.SourceKind}; key != h.key || h.json == nil {
		h.key = key
		b := append(h.json[:0], `{"Kind":`...)
		b = appendUint(b, uint64(r.Kind))
		b = append(b, `,"Flag":`...)
		b = appendUint(b, uint64(r.Flag))
		b = append(b, `,"SourceKind":`...)
		b = appendUint(b, uint64(r.SourceKind))
		h.json = append(b, `,"Timestamp":`...)
	}
	dst = append(dst, h.json...)
	dst = e.ts.append(dst, r.Timestamp)
	dst = append(dst, `,"Id":`...)
	dst = e.id.append(dst, r.ID)
	if key := [4]uint32{r.ProcessID, r.ThreadID, r.DeviceID, r.StreamID}; key != e.obj || e.objJSON == nil {
		e.obj = key
		e.objJSON = r.appendObject(e.objJSON[:0])
	}
	dst = append(dst, e.objJSON...)
	switch form {
	case nameStep:
		dst = append(dst, `"step `...)
		dst = appendUint(dst, step)
		dst = append(dst, '"')
	case nameComm:
		if *op != e.op || e.opJSON == nil {
			e.op = *op
			e.opScratch = op.AppendJSON(e.opScratch[:0])
			e.opJSON = appendJSONString(e.opJSON[:0], e.opScratch)
		}
		dst = append(dst, e.opJSON...)
	default:
		if len(r.Name) < memoMinName {
			dst = appendShortName(dst, r.Name)
			break
		}
		if r.Name != e.name || e.nameJSON == nil {
			e.name = r.Name
			e.nameJSON = appendJSONString(e.nameJSON[:0], r.Name)
		}
		dst = append(dst, e.nameJSON...)
	}
	return r.appendTail(dst)
}

// appendShortName appends a short name as appendJSONString does, the
// markers' names without escaping them again.
func appendShortName(dst []byte, name string) []byte {
	switch name {
	case "":
		return append(dst, `""`...)
	case MarkerForward:
		return append(dst, `"`+MarkerForward+`"`...)
	case MarkerDataLoader:
		return append(dst, `"`+MarkerDataLoader+`"`...)
	case MarkerSaveCheckpoint:
		return append(dst, `"`+MarkerSaveCheckpoint+`"`...)
	}
	return appendJSONString(dst, name)
}
