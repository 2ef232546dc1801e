package trace

import (
	"encoding/json"
	"strconv"
)

// CommOp describes a communication operator. It travels as JSON in the Name
// of a communication-domain record:
//
//	{"opName":"HcclAllReduce","groupName":"tp-0","count":"4096","dataType":"fp16","streamId":"3"}
//
// MindCluster writes count and streamId as strings; ParseCommOp accepts
// strings or numbers for them and AppendJSON writes strings.
type CommOp struct {
	OpName    string // HcclAllReduce, HcclReduceScatter, HcclAllGather, HcclSend, HcclRecv, ncclAllReduce, ...
	GroupName string // communicator name, a key of parallel_group.json
	Count     uint64 // element count
	DataType  string
	StreamID  uint64
}

// AppendJSON appends op's JSON form to dst.
func (op *CommOp) AppendJSON(dst []byte) []byte {
	dst = append(dst, `{"opName":`...)
	dst = appendJSONString(dst, op.OpName)
	dst = append(dst, `,"groupName":`...)
	dst = appendJSONString(dst, op.GroupName)
	dst = append(dst, `,"count":"`...)
	dst = appendUint(dst, op.Count)
	dst = append(dst, `","dataType":`...)
	dst = appendJSONString(dst, op.DataType)
	dst = append(dst, `,"streamId":"`...)
	dst = appendUint(dst, op.StreamID)
	return append(dst, `"}`...)
}

// flexUint decodes a JSON number or a string holding one.
type flexUint uint64

func (f *flexUint) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		b = []byte(s)
	}
	if len(b) == 0 {
		*f = 0
		return nil
	}
	u, err := strconv.ParseUint(string(b), 10, 64)
	if err != nil {
		return err
	}
	*f = flexUint(u)
	return nil
}

// ParseCommOp parses the Name of a communication record. Unknown fields
// are ignored; opName is required. Errors wrap ErrRecord.
func ParseCommOp(name string) (CommOp, error) {
	var w struct {
		OpName    *string  `json:"opName"`
		GroupName string   `json:"groupName"`
		Count     flexUint `json:"count"`
		DataType  string   `json:"dataType"`
		StreamID  flexUint `json:"streamId"`
	}
	if err := json.Unmarshal([]byte(name), &w); err != nil {
		return CommOp{}, recordErr("Name", "communication op: "+err.Error())
	}
	if w.OpName == nil || *w.OpName == "" {
		return CommOp{}, recordErr("Name", "communication op: opName missing")
	}
	return CommOp{OpName: *w.OpName, GroupName: w.GroupName, Count: uint64(w.Count), DataType: w.DataType, StreamID: uint64(w.StreamID)}, nil
}
