package slownode

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
)

// ErrRankTable is wrapped by the errors of ParseRankTable.
var ErrRankTable = errors.New("slownode: invalid rank table")

// maxRankTableBytes bounds a rank table ParseRankTable accepts.
const maxRankTableBytes = 64 << 20

// RankTable maps global ranks to the host that runs them.
type RankTable map[int]string

// rankTableDoc is the part of an hccl.json (version 1.0, server_list and
// device) that names hosts and ranks. Ids are strings there; numbers are
// accepted too.
type rankTableDoc struct {
	Version    string `json:"version,omitempty"`
	ServerList []struct {
		ServerID string `json:"server_id"`
		HostIP   string `json:"host_ip,omitempty"`
		Device   []struct {
			DeviceID json.RawMessage `json:"device_id,omitempty"`
			RankID   json.RawMessage `json:"rank_id"`
		} `json:"device"`
	} `json:"server_list"`
}

// ParseRankTable reads the rank-to-host mapping of a rank table
// (hccl.json: server_list[].server_id and device[].rank_id). Unknown
// fields are ignored. A rank listed twice, a negative or malformed
// rank_id or a server without an id is an error naming the field.
func ParseRankTable(data []byte) (RankTable, error) {
	if len(data) > maxRankTableBytes {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrRankTable, maxRankTableBytes)
	}
	var doc rankTableDoc
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrRankTable, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: data after the object", ErrRankTable)
	}
	if doc.ServerList == nil {
		return nil, fmt.Errorf("%w: field \"server_list\" missing", ErrRankTable)
	}
	t := RankTable{}
	for i, s := range doc.ServerList {
		host := s.ServerID
		if host == "" {
			host = s.HostIP
		}
		if host == "" {
			return nil, fmt.Errorf("%w: server_list[%d]: field \"server_id\" missing", ErrRankTable, i)
		}
		for j, dev := range s.Device {
			field := fmt.Sprintf("server_list[%d].device[%d].rank_id", i, j)
			r, err := parseID(dev.RankID)
			if err != nil {
				return nil, fmt.Errorf("%w: %s: %v", ErrRankTable, field, err)
			}
			if prev, ok := t[r]; ok {
				return nil, fmt.Errorf("%w: %s: rank %d is on %s already", ErrRankTable, field, r, prev)
			}
			t[r] = host
		}
	}
	return t, nil
}

// parseID reads an id written as a string ("3") or a number (3).
func parseID(raw json.RawMessage) (int, error) {
	if len(raw) == 0 {
		return 0, errors.New("missing")
	}
	s := string(raw)
	if raw[0] == '"' {
		if err := json.Unmarshal(raw, &s); err != nil {
			return 0, err
		}
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n > 1<<30 {
		return 0, fmt.Errorf("%s is not a rank", raw)
	}
	return n, nil
}

// Marshal returns t as a version 1.0 rank table, servers in name order
// and devices in rank order, with rank_id and device_id (the rank's index
// on its host) as strings.
func (t RankTable) Marshal() ([]byte, error) {
	type dev struct {
		DeviceID string `json:"device_id"`
		RankID   string `json:"rank_id"`
	}
	type server struct {
		ServerID string `json:"server_id"`
		Device   []dev  `json:"device"`
	}
	byHost := map[string][]int{}
	for r, h := range t {
		byHost[h] = append(byHost[h], r)
	}
	doc := struct {
		Version     string   `json:"version"`
		ServerCount string   `json:"server_count"`
		ServerList  []server `json:"server_list"`
		Status      string   `json:"status"`
	}{Version: "1.0", ServerCount: strconv.Itoa(len(byHost)), ServerList: []server{}, Status: "completed"}
	for _, h := range slices.Sorted(maps.Keys(byHost)) {
		ranks := byHost[h]
		slices.Sort(ranks)
		s := server{ServerID: h}
		for i, r := range ranks {
			s.Device = append(s.Device, dev{DeviceID: strconv.Itoa(i), RankID: strconv.Itoa(r)})
		}
		doc.ServerList = append(doc.ServerList, s)
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
