package topology

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strconv"
	"unicode/utf8"
)

// RankTableVersion is the only hccl.json version this package reads and
// writes: the server_list / device shape.
const RankTableVersion = "1.0"

// Rank table status values.
const (
	StatusCompleted    = "completed"    // the table is ready to use
	StatusInitializing = "initializing" // the scheduler is still filling it
)

// RankTable is an hccl.json rank table, version 1.0:
//
//	{"version": "1.0", "server_count": "2", "status": "completed",
//	 "server_list": [{"server_id": "10.0.0.1", "device": [
//	   {"device_id": "0", "device_ip": "192.168.1.8", "rank_id": "0"}, ...]}, ...]}
//
// Numbers are JSON strings in the file and ints here; server_count is
// derived from Servers.
type RankTable struct {
	Status  string // StatusCompleted or StatusInitializing
	Servers []Server
}

// Server is one entry of server_list.
type Server struct {
	ID        string   // server_id, unique in the table (usually the host IP)
	HostNICIP string   // host_nic_ip, optional (often "reserve")
	Devices   []Device // device
}

// Device is one accelerator of a server.
type Device struct {
	ID   int    // device_id: the device's physical number on its server
	IP   string // device_ip: the device's own NIC address
	Rank int    // rank_id: the device's global rank
}

// The file shape: every number is a string.
type rankTableJSON struct {
	Version     string       `json:"version"`
	ServerCount string       `json:"server_count"`
	ServerList  []serverJSON `json:"server_list"`
	Status      string       `json:"status"`
}

type serverJSON struct {
	ServerID  string       `json:"server_id"`
	Device    []deviceJSON `json:"device"`
	HostNICIP string       `json:"host_nic_ip,omitempty"`
}

type deviceJSON struct {
	DeviceID string `json:"device_id"`
	DeviceIP string `json:"device_ip"`
	RankID   string `json:"rank_id"`
}

const rankTableFormat = "hccl.json"

// ParseRankTable reads an hccl.json rank table and validates it (see
// Validate). Unknown fields are ignored, as the tools that write rank tables
// add their own. Errors are *ParseError naming the line (for malformed JSON)
// or the field path and value, such as server_list[1].device[3].rank_id.
func ParseRankTable(data []byte) (*RankTable, error) {
	var raw rankTableJSON
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, jsonError(rankTableFormat, data, err)
	}
	bad := func(field, value, msg string) error {
		return &ParseError{Format: rankTableFormat, Field: field, Value: value, Msg: msg}
	}
	if raw.Version != RankTableVersion {
		return nil, bad("version", raw.Version, `want "`+RankTableVersion+`"`)
	}
	if n, err := strconv.Atoi(raw.ServerCount); err != nil || n != len(raw.ServerList) {
		return nil, bad("server_count", raw.ServerCount, fmt.Sprintf("want %d, the length of server_list", len(raw.ServerList)))
	}
	rt := &RankTable{Status: raw.Status, Servers: make([]Server, len(raw.ServerList))}
	for i, s := range raw.ServerList {
		rt.Servers[i] = Server{ID: s.ServerID, HostNICIP: s.HostNICIP, Devices: make([]Device, len(s.Device))}
		for j, d := range s.Device {
			path := fmt.Sprintf("server_list[%d].device[%d].", i, j)
			id, err := parseCount(d.DeviceID)
			if err != nil {
				return nil, bad(path+"device_id", d.DeviceID, err.Error())
			}
			rank, err := parseCount(d.RankID)
			if err != nil {
				return nil, bad(path+"rank_id", d.RankID, err.Error())
			}
			rt.Servers[i].Devices[j] = Device{ID: id, IP: d.DeviceIP, Rank: rank}
		}
	}
	if err := rt.Validate(); err != nil {
		return nil, err
	}
	return rt, nil
}

// parseCount parses a non-negative decimal written as a JSON string.
func parseCount(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || s[0] == '+' {
		return 0, errors.New("want a non-negative decimal number")
	}
	return n, nil
}

// jsonError turns an encoding/json error into a *ParseError with the line.
func jsonError(format string, data []byte, err error) error {
	pe := &ParseError{Format: format, Msg: "malformed JSON: " + err.Error()}
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		pe.Line = lineAt(data, syn.Offset)
	case errors.As(err, &typ):
		pe.Line = lineAt(data, typ.Offset)
		pe.Field = typ.Field
		want := map[reflect.Kind]string{reflect.String: "string", reflect.Slice: "array", reflect.Struct: "object"}[typ.Type.Kind()]
		pe.Msg = fmt.Sprintf("want a JSON %s, got %s", want, typ.Value)
	}
	return pe
}

func lineAt(data []byte, offset int64) int {
	offset = min(max(offset, 0), int64(len(data)))
	return bytes.Count(data[:offset], []byte{'\n'}) + 1
}

// Validate checks what ParseRankTable checks after decoding: the status is
// StatusCompleted or StatusInitializing; a completed table has at least one
// server; server IDs are non-empty, shorter than 64 bytes and unique; every
// server of a completed table has a device; device IDs are unique on their
// server; device IPs are IP addresses; and the rank IDs are exactly 0..n-1
// for n devices. Errors are *ParseError naming the field path.
func (rt *RankTable) Validate() error {
	bad := func(field, value, msg string) error {
		return &ParseError{Format: rankTableFormat, Field: field, Value: value, Msg: msg}
	}
	switch rt.Status {
	case StatusCompleted:
		if len(rt.Servers) == 0 {
			return bad("server_list", "", "a completed rank table needs at least one server")
		}
	case StatusInitializing:
	default:
		return bad("status", rt.Status, `want "completed" or "initializing"`)
	}
	servers := make(map[string]int, len(rt.Servers))
	rankAt := make(map[int]string)
	total := 0
	for i, s := range rt.Servers {
		path := fmt.Sprintf("server_list[%d].", i)
		switch {
		case s.ID == "":
			return bad(path+"server_id", "", "must not be empty")
		case len(s.ID) >= 64:
			return bad(path+"server_id", s.ID, "must be shorter than 64 bytes")
		case !utf8.ValidString(s.ID):
			return bad(path+"server_id", s.ID, "must be UTF-8")
		}
		if j, dup := servers[s.ID]; dup {
			return bad(path+"server_id", s.ID, fmt.Sprintf("also server_list[%d]", j))
		}
		servers[s.ID] = i
		if !utf8.ValidString(s.HostNICIP) {
			return bad(path+"host_nic_ip", s.HostNICIP, "must be UTF-8")
		}
		if len(s.Devices) == 0 && rt.Status == StatusCompleted {
			return bad(path+"device", "", "a server of a completed rank table needs at least one device")
		}
		devs := make(map[int]int, len(s.Devices))
		for j, d := range s.Devices {
			dpath := fmt.Sprintf("%sdevice[%d].", path, j)
			if d.ID < 0 {
				return bad(dpath+"device_id", strconv.Itoa(d.ID), "must not be negative")
			}
			if k, dup := devs[d.ID]; dup {
				return bad(dpath+"device_id", strconv.Itoa(d.ID), fmt.Sprintf("also %sdevice[%d]", path, k))
			}
			devs[d.ID] = j
			if _, err := netip.ParseAddr(d.IP); err != nil {
				return bad(dpath+"device_ip", d.IP, "not an IP address")
			}
			if prev, dup := rankAt[d.Rank]; dup {
				return bad(dpath+"rank_id", strconv.Itoa(d.Rank), "also "+prev)
			}
			rankAt[d.Rank] = dpath + "rank_id"
			total++
		}
	}
	for i, s := range rt.Servers {
		for j, d := range s.Devices {
			if d.Rank < 0 || d.Rank >= total {
				return bad(fmt.Sprintf("server_list[%d].device[%d].rank_id", i, j), strconv.Itoa(d.Rank),
					fmt.Sprintf("rank IDs must be 0..%d, one per device", total-1))
			}
		}
	}
	return nil
}

// Marshal returns the table as indented hccl.json. It validates first, so
// what it writes ParseRankTable reads back equal.
func (rt *RankTable) Marshal() ([]byte, error) {
	if err := rt.Validate(); err != nil {
		return nil, err
	}
	raw := rankTableJSON{
		Version:     RankTableVersion,
		ServerCount: strconv.Itoa(len(rt.Servers)),
		ServerList:  make([]serverJSON, len(rt.Servers)),
		Status:      rt.Status,
	}
	for i, s := range rt.Servers {
		raw.ServerList[i] = serverJSON{ServerID: s.ID, HostNICIP: s.HostNICIP, Device: make([]deviceJSON, len(s.Devices))}
		for j, d := range s.Devices {
			raw.ServerList[i].Device[j] = deviceJSON{DeviceID: strconv.Itoa(d.ID), DeviceIP: d.IP, RankID: strconv.Itoa(d.Rank)}
		}
	}
	b, err := json.MarshalIndent(raw, "", "    ")
	if err != nil {
		return nil, fmt.Errorf("topology: marshal rank table: %w", err)
	}
	return append(b, '\n'), nil
}

// NewRankTable returns a completed rank table with servers in the given
// order, numbering ranks 0, 1, ... through the servers and, within a server,
// through its devices in order; the Rank fields of servers are ignored.
// Order a world first (Order, FitParallel) to get a switch-aware table.
func NewRankTable(servers []Server) (*RankTable, error) {
	rt := &RankTable{Status: StatusCompleted, Servers: make([]Server, len(servers))}
	rank := 0
	for i, s := range servers {
		s.Devices = append([]Device(nil), s.Devices...)
		for j := range s.Devices {
			s.Devices[j].Rank = rank
			rank++
		}
		rt.Servers[i] = s
	}
	if err := rt.Validate(); err != nil {
		return nil, err
	}
	return rt, nil
}

// ServerIDs returns the server IDs in table order.
func (rt *RankTable) ServerIDs() []string {
	ids := make([]string, len(rt.Servers))
	for i, s := range rt.Servers {
		ids[i] = s.ID
	}
	return ids
}

// Reorder returns a completed copy of rt with its servers in the order of
// ids, a permutation of rt.ServerIDs(), and ranks renumbered as NewRankTable
// numbers them. Pass the result of Order or FitParallel on ServerIDs to make
// a table switch-aware.
func (rt *RankTable) Reorder(ids []string) (*RankTable, error) {
	if len(ids) != len(rt.Servers) {
		return nil, fmt.Errorf("topology: reorder: %d server IDs for %d servers", len(ids), len(rt.Servers))
	}
	at := make(map[string]int, len(rt.Servers))
	for i, s := range rt.Servers {
		at[s.ID] = i
	}
	servers := make([]Server, len(ids))
	for i, id := range ids {
		j, ok := at[id]
		if !ok {
			return nil, fmt.Errorf("topology: reorder: server %q is not in the rank table or is listed twice", id)
		}
		delete(at, id)
		servers[i] = rt.Servers[j]
	}
	return NewRankTable(servers)
}
