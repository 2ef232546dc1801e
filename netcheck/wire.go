package netcheck

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// The agent protocol, one operation per TCP connection, big-endian:
//
//	request:  "FLNC" version(1) op(1) ...
//	op 'T', transfer:  pings(u16) repeats(u16) up(u64) down(u64)
//	   agent:  status(1); if not 0, a message (u16 length + bytes), close
//	   pings × (client 8 bytes → agent echoes 8 bytes)
//	   repeats × (client sends up bytes → agent answers 1 byte once all
//	              are in → agent sends down bytes); the client may close
//	              after any of them, having moved enough
//	op 'P', probe a peer:  request JSON (u32 length + bytes)
//	   agent:  Measurement JSON (u32 length + bytes)
const (
	wireMagic   = "FLNC"
	wireVersion = 1
	opTransfer  = 'T'
	opProbe     = 'P'
	headerLen   = 6
	transferLen = 2 + 2 + 8 + 8
	maxJSON     = 1 << 20 // no request or answer is near this
	chunk       = 256 << 10
)

type transferHeader struct {
	pings, repeats uint16
	up, down       uint64
}

func appendHeader(b []byte, op byte) []byte {
	b = append(b, wireMagic...)
	return append(b, wireVersion, op)
}

func (h transferHeader) append(b []byte) []byte {
	b = binary.BigEndian.AppendUint16(b, h.pings)
	b = binary.BigEndian.AppendUint16(b, h.repeats)
	b = binary.BigEndian.AppendUint64(b, h.up)
	return binary.BigEndian.AppendUint64(b, h.down)
}

func parseTransferHeader(b []byte) transferHeader {
	return transferHeader{
		pings:   binary.BigEndian.Uint16(b),
		repeats: binary.BigEndian.Uint16(b[2:]),
		up:      binary.BigEndian.Uint64(b[4:]),
		down:    binary.BigEndian.Uint64(b[12:]),
	}
}

// readOp reads and checks a request header.
func readOp(r io.Reader) (byte, error) {
	var h [headerLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, fmt.Errorf("read request header: %w", err)
	}
	if string(h[:4]) != wireMagic {
		return 0, fmt.Errorf("not a netcheck request (magic %q)", h[:4])
	}
	if h[4] != wireVersion {
		return 0, fmt.Errorf("protocol version %d, want %d", h[4], wireVersion)
	}
	return h[5], nil
}

// probeRequest asks an agent to probe a peer.
type probeRequest struct {
	Peer    string        `json:"peer"`
	Bytes   int64         `json:"bytes"`
	Pings   int           `json:"pings"`
	Repeats int           `json:"repeats"`
	Timeout time.Duration `json:"timeout_ns"`
}

func writeJSON(w io.Writer, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	b := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(body)), uint32(len(body)))
	_, err = w.Write(append(b, body...))
	return err
}

func readJSON(r io.Reader, v any) error {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > maxJSON {
		return fmt.Errorf("message of %d bytes exceeds %d", size, maxJSON)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(r, body); err != nil {
		return err
	}
	return json.Unmarshal(body, v)
}

// refuse writes a non-zero status and a message.
func refuse(w io.Writer, msg string) {
	msg = msg[:min(len(msg), 1<<15)]
	b := binary.BigEndian.AppendUint16([]byte{1}, uint16(len(msg)))
	w.Write(append(b, msg...))
}

// readStatus reads the agent's answer to a transfer header.
func readStatus(r io.Reader) error {
	var s [1]byte
	if _, err := io.ReadFull(r, s[:]); err != nil {
		return fmt.Errorf("read status: %w", err)
	}
	if s[0] == 0 {
		return nil
	}
	var n [2]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return fmt.Errorf("agent refused the transfer")
	}
	msg := make([]byte, binary.BigEndian.Uint16(n[:]))
	if k, err := io.ReadFull(r, msg); err != nil {
		return fmt.Errorf("agent refused the transfer: %s (message cut short: %v)", msg[:k], err)
	}
	return fmt.Errorf("agent refused the transfer: %s", msg)
}
