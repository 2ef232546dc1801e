package ckpt

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

func FuzzParseRequest(f *testing.F) {
	f.Add(replicaReq{op: opPut, shard: 3, step: 7}.marshal())
	f.Add(replicaReq{op: opGet, flags: flagKey, shard: 0, step: -1}.marshal())
	f.Add(append([]byte("FLRP\x02\x01"), make([]byte, 18)...)) // version 2
	f.Add([]byte("FLRP"))
	f.Fuzz(func(t *testing.T, b []byte) {
		q, err := parseRequest(b)
		if err != nil {
			var ve *versionError
			var pe *layout.ParseError
			if !errors.As(err, &ve) && !errors.As(err, &pe) {
				t.Fatalf("parseRequest(% x): %v is neither a version nor a parse error", b, err)
			}
			return
		}
		if got := q.marshal(); !bytes.Equal(got, b) {
			t.Fatalf("parseRequest(% x) = %+v, which marshals to % x", b, q, got)
		}
		if q.shard < 0 || q.shard >= layout.MaxShards || q.step < -1 || (q.op == opPut && q.step < 0) {
			t.Fatalf("parseRequest(% x) accepted %+v", b, q)
		}
	})
}

func FuzzReadMsg(f *testing.F) {
	msg := func(status byte, body string) []byte {
		var b bytes.Buffer
		writeMsg(&b, status, []byte(body))
		return b.Bytes()
	}
	f.Add(msg(statusOK, ""), 0)
	f.Add(msg(statusOK, strings.Repeat("n", nonceSize+proofSize)), nonceSize+proofSize)
	f.Add(msg(statusError, "no intact replica"), 0)
	f.Add(msg(statusRefused, "another key"), 0)
	f.Add([]byte{9, 0, 0, 0, 1, 0, 0, 0, 'x'}, 0)
	f.Add([]byte{0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, 64)
	f.Fuzz(func(t *testing.T, b []byte, max int) {
		max = min(max&0xffff, 1<<16)
		body, err := readMsg(bytes.NewReader(b), max)
		var pe *peerError
		switch {
		case err == nil:
			if len(body) > max || len(b) < msgSize || b[0] != statusOK || !bytes.Equal(body, b[msgSize:msgSize+len(body)]) {
				t.Fatalf("readMsg(% x, %d) = % x", b, max, body)
			}
			if again := msg(statusOK, string(body)); !bytes.Equal(again, b[:len(again)]) {
				t.Fatalf("readMsg(% x) = % x, which writes as % x", b, body, again)
			}
		case errors.As(err, &pe):
			if errors.Is(err, ErrRefused) != (b[0] == statusRefused) || len(pe.msg) > maxErrLen {
				t.Fatalf("readMsg(% x): %v (refused %v)", b, err, errors.Is(err, ErrRefused))
			}
		default:
			var fe *layout.ParseError
			if !errors.As(err, &fe) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("readMsg(% x): unexpected error %v", b, err)
			}
		}
	})
}

// TestRequestRoundTrip checks that parseRequest undoes marshal and names
// the field of a bad request.
func TestRequestRoundTrip(t *testing.T) {
	for _, q := range []replicaReq{{op: opPut, shard: 0, step: 0}, {op: opGet, flags: flagKey, shard: layout.MaxShards - 1, step: -1}} {
		got, err := parseRequest(q.marshal())
		if err != nil || got != q {
			t.Fatalf("parseRequest(marshal(%+v)) = %+v, %v", q, got, err)
		}
	}
	bad := func(edit func(b []byte)) []byte {
		b := replicaReq{op: opPut, shard: 1, step: 2}.marshal()
		edit(b)
		return b
	}
	for _, tc := range []struct {
		b    []byte
		want string
	}{
		{bad(func(b []byte) { b[0] = 'G' }), "magic"},
		{bad(func(b []byte) { b[4] = 2 }), "version 2 is not spoken here"},
		{bad(func(b []byte) { b[5] = 3 }), "op"},
		{bad(func(b []byte) { b[7] = 1 }), "flags"},
		{bad(func(b []byte) { binary.LittleEndian.PutUint32(b[8:], layout.MaxShards) }), "shard"},
		{bad(func(b []byte) { b[12] = 1 }), "reserved"},
		{bad(func(b []byte) { binary.LittleEndian.PutUint64(b[16:], ^uint64(0)) }), "step"},
		{[]byte("FLRP"), "4 bytes"},
	} {
		if _, err := parseRequest(tc.b); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseRequest(% x) = %v, want an error about %s", tc.b, err, tc.want)
		}
	}
}

// TestReplicaKeyRefused runs transfers between owners that do not hold
// the same replica key: each is refused before a shard byte moves, and
// both sides say why.
func TestReplicaKeyRefused(t *testing.T) {
	ctx := context.Background()
	k1, k2 := []byte("job-7-replica-key-one"), []byte("job-7-replica-key-two")
	for _, tc := range []struct {
		name           string
		server, client []byte
		sender, logged string
	}{
		{"another key", k1, k2, "did not prove that it holds this owner's replica key", "holds another replica key"},
		{"client without", k1, nil, "the client holds no replica key, and this owner requires one", "the client holds no replica key"},
		{"server without", nil, k1, "the client holds a replica key, and this owner none", "the client holds a replica key, and this owner none"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logs := &syncBuffer{}
			b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0", ReplicaKey: tc.server,
				Logger: slog.New(slog.NewTextHandler(logs, nil))}, 1)
			running(t, b.o)
			peers := map[string]string{"a": "", "b": b.o.Addr().String()}
			a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers, ReplicaKey: tc.client}, 1)
			if err := a.ws[0].Save(ctx, 3, blobs(3)...); err != nil {
				t.Fatal(err)
			}
			err := a.o.Replicate(ctx, 0)
			if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), tc.sender) {
				t.Fatalf("Replicate = %v, want ErrRefused saying %q", err, tc.sender)
			}
			t.Logf("sender: %v", err)
			// A fetch is refused alike, and the report says so.
			a.ws[0].Close()
			a.o.Remove()
			a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers, ReplicaKey: tc.client}, 1)
			rep, err := a2.o.Restore(ctx, 0, 3)
			if !errors.Is(err, ErrNoStep) || len(rep.Refused) != 3 || !errors.Is(rep.Refused[1], ErrRefused) {
				t.Fatalf("Restore = %s, %v; want the replica tier refused", rep, err)
			}
			// The server logged each refusal it saw, and held nothing.
			b.o.Close()
			if !strings.Contains(logs.String(), "replica transfer refused") || !strings.Contains(logs.String(), tc.logged) {
				t.Fatalf("the server logged:\n%s\nwant a refusal saying %q", logs, tc.logged)
			}
			if n := strings.Count(logs.String(), `msg="ckpt: replica transfer refused"`); n != 2 {
				t.Fatalf("the server logged %d refusals, want 2:\n%s", n, logs)
			}
			held, _, err := (newNode(t, OwnerConfig{ShmDir: b.o.cfg.ShmDir, Name: b.o.cfg.Name, Shards: []int{1}}, 1)).o.Replicas()
			if err != nil || len(held) != 0 {
				t.Fatalf("Replicas after refused transfers = %v, %v", held, err)
			}
		})
	}
}

// TestReplicaKeyAccepted checks that owners holding the same key move a
// step both ways.
func TestReplicaKeyAccepted(t *testing.T) {
	ctx := context.Background()
	key := []byte("a key of thirty-two bytes, shared")
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0", ReplicaKey: key}, 1)
	running(t, b.o)
	peers := map[string]string{"a": "", "b": b.o.Addr().String()}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers, ReplicaKey: key}, 1)
	if err := a.ws[0].Save(ctx, 3, blobs(3)...); err != nil {
		t.Fatal(err)
	}
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}
	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers, ReplicaKey: key}, 1)
	if rep, err := a2.o.Restore(ctx, 0, 3); err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore = %s, %v", rep, err)
	}
	if _, err := NewOwner(OwnerConfig{ShmDir: shmDir(t), Shards: []int{0}, Capacity: 4096, ReplicaKey: []byte("short")}); err == nil || !strings.Contains(err.Error(), "ReplicaKey has 5 bytes") {
		t.Fatalf("NewOwner with a 5-byte key = %v", err)
	}
}
