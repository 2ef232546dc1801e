package trace

import "slices"

// encoder writes records as Record.AppendJSON does, byte for byte, with a
// memory of the last object id and names: the records of one writer
// mostly repeat them, and copying is cheaper than formatting and escaping
// again.
type encoder struct {
	obj     [4]uint32 // ProcessID, ThreadID, DeviceID, StreamID of objJSON
	objJSON []byte    // `,"MsptiObjectId":{...}},"Name":`

	name     string // the last long literal name, escaped in nameJSON
	nameJSON []byte

	op        CommOp // the last communication op, as an escaped name in opJSON
	opJSON    []byte
	opScratch []byte
}

// memoMinName is the length from which a literal name is memoised; shorter
// ones escape about as fast as they compare.
const memoMinName = 32

// appendRecord appends r's JSON form. form says where the name comes
// from: r.Name, "step <step>" or *op as JSON.
func (e *encoder) appendRecord(dst []byte, r *Record, form uint8, step uint64, op *CommOp) []byte {
	dst = slices.Grow(dst, 320)
	dst = append(dst, `{"Kind":`...)
	dst = appendUint(dst, uint64(r.Kind))
	dst = append(dst, `,"Flag":`...)
	dst = appendUint(dst, uint64(r.Flag))
	dst = append(dst, `,"SourceKind":`...)
	dst = appendUint(dst, uint64(r.SourceKind))
	dst = append(dst, `,"Timestamp":`...)
	dst = appendUint(dst, r.Timestamp)
	dst = append(dst, `,"Id":`...)
	dst = appendUint(dst, r.ID)
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
			e.opJSON = appendJSONStringBytes(e.opJSON[:0], e.opScratch)
		}
		dst = append(dst, e.opJSON...)
	default:
		if len(r.Name) < memoMinName {
			dst = AppendJSONString(dst, r.Name)
			break
		}
		if r.Name != e.name || e.nameJSON == nil {
			e.name = r.Name
			e.nameJSON = AppendJSONString(e.nameJSON[:0], r.Name)
		}
		dst = append(dst, e.nameJSON...)
	}
	return r.appendTail(dst)
}
