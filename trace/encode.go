package trace

import "slices"

// encoder writes records as Record.AppendJSON does, byte for byte, with a
// memory of the last object id and names: the records of one writer
// mostly repeat them, and copying is cheaper than formatting and escaping
// again.
type encoder struct {
	head     [3]uint32 // Kind, Flag, SourceKind of headJSON
	headJSON []byte    // `{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":`

	obj     [4]uint32 // ProcessID, ThreadID, DeviceID, StreamID of objJSON
	objJSON []byte    // `,"MsptiObjectId":{...}},"Name":`

	name     string // the last long literal name, escaped in nameJSON
	nameJSON []byte

	op        CommOp // the last communication op, as an escaped name in opJSON
	opJSON    []byte
	opScratch []byte

	ts, id bigMemo
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
	hi, lo := v/1e6, v%1e6
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
	if key := [3]uint32{r.Kind, uint32(r.Flag), r.SourceKind}; key != e.head || e.headJSON == nil {
		e.head = key
		b := append(e.headJSON[:0], `{"Kind":`...)
		b = appendUint(b, uint64(r.Kind))
		b = append(b, `,"Flag":`...)
		b = appendUint(b, uint64(r.Flag))
		b = append(b, `,"SourceKind":`...)
		b = appendUint(b, uint64(r.SourceKind))
		e.headJSON = append(b, `,"Timestamp":`...)
	}
	dst = append(dst, e.headJSON...)
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
			dst = appendJSONString(dst, r.Name)
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
