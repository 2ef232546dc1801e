package taskd

import (
	"bytes"
	"context"
	"errors"
	"io"
	"slices"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// The RPC fuzz targets send random messages to a live manager in this
// process, over loopback, through a worker and a proxy that registered as
// members: a handler that panics takes the test binary down, and after
// every call the manager must still serve a member's heartbeat.
//
// Each input is a flag byte and a message's wire bytes. Flag bit 0 sets
// the message's job to the manager's, bit 1 its member fields (member,
// from, via) to the caller's own, so that the fuzzer reaches past the
// first checks; the other bits are the fuzzer's to play with.

// fuzzEnv is the live manager the RPC fuzz targets call.
type fuzzEnv struct {
	c      *cluster
	worker *rawMember // a worker attached directly
	proxy  *rawMember // the proxy of node 1
	admin  *adminClient
}

func newFuzzEnv(f *testing.F) *fuzzEnv {
	f.Helper()
	c := newCluster(f, insecureSec(), ManagerConfig{
		Nodes: 2, ProcsPerNode: 2, CollectDir: f.TempDir(), StateDir: f.TempDir(), HeartbeatDeadline: time.Hour,
		Orchestration: &OrchestrationConfig{Timeouts: Timeouts{Pause: time.Second, Switch: time.Second, Stress: time.Second, Resume: time.Second}},
	})
	e := &fuzzEnv{c: c, admin: newAdminClient(f, c.m.Addr().String(), c.job)}
	e.worker = newRawMember(f, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	e.proxy = newRawMember(f, c.m.Addr().String(), c.job, proxySec(), RoleProxy, Position{Node: 1, Rank: -1})
	for _, r := range []*rawMember{e.worker, e.proxy} {
		if err := r.register(); err != nil {
			f.Fatal(err)
		}
	}
	return e
}

// prepare sets req's job and member fields as flags say, for caller.
func (e *fuzzEnv) prepare(req proto.Message, flags byte, caller *rawMember) {
	m := req.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case flags&1 != 0 && fd.Kind() == protoreflect.StringKind && (fd.Name() == "job" || fd.Name() == "jobNsName"):
			m.Set(fd, protoreflect.ValueOfString(e.c.job))
		case flags&2 != 0 && fd.Message() != nil && fd.Message().FullName() == "faultline.taskd.v1.Member" && !fd.IsList():
			m.Set(fd, protoreflect.ValueOfMessage(proto.Clone(caller.self).ProtoReflect()))
		}
	}
}

// check fails unless the manager still serves a member.
func (e *fuzzEnv) check(t *testing.T, err error) {
	t.Helper()
	if status.Code(err) == codes.Unknown {
		t.Fatalf("the call failed without a code: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := e.worker.client.Heartbeat(ctx, &pb.HeartbeatRequest{Job: e.c.job, Beats: []*pb.Beat{{Member: e.worker.self}}}); err != nil {
		t.Fatalf("the manager no longer serves a member: %v", err)
	}
}

// callCtx bounds one fuzzed call.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// fuzzRPC runs a fuzz target of one RPC: seeds are requests to start
// from, call makes the call with a request decoded from the input.
func fuzzRPC[Req proto.Message](f *testing.F, newReq func() Req, call func(t *testing.T, e *fuzzEnv, req Req, flags byte) error, seeds ...Req) {
	e := newFuzzEnv(f)
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(byte(3), b)
		f.Add(byte(0), b)
	}
	f.Fuzz(func(t *testing.T, flags byte, data []byte) {
		req := newReq()
		if err := proto.Unmarshal(data, req); err != nil {
			return
		}
		e.check(t, call(t, e, req, flags))
	})
}

func FuzzRegister(f *testing.F) {
	fuzzRPC(f, func() *pb.RegisterRequest { return new(pb.RegisterRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.RegisterRequest, flags byte) error {
			caller := e.worker
			if flags&4 != 0 {
				caller = e.proxy
			}
			e.prepare(req, flags, caller)
			if flags&8 != 0 {
				req.Member = memberPB(RoleWorker, Position{Node: 1, Rank: int(req.GetMember().GetPosition().GetRank())}, newInstanceID())
			}
			_, err := caller.client.Register(callCtx(t), req)
			return err
		},
		&pb.RegisterRequest{Job: "job-1", Member: memberPB(RoleWorker, Position{Node: 1, Rank: 3}, "i"), Hostname: "h", Pid: 1},
		&pb.RegisterRequest{Job: "job-1", Member: memberPB(RoleWorker, Position{Node: 1, Rank: 2}, "j"), Via: memberPB(RoleProxy, Position{Node: 1, Rank: -1}, "p")},
	)
}

func FuzzHeartbeat(f *testing.F) {
	fuzzRPC(f, func() *pb.HeartbeatRequest { return new(pb.HeartbeatRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.HeartbeatRequest, flags byte) error {
			e.prepare(req, flags, e.worker)
			if flags&4 != 0 {
				req.Beats = append(req.Beats, &pb.Beat{Member: e.worker.self, AgeMs: int64(flags) << 40})
			}
			_, err := e.worker.client.Heartbeat(callCtx(t), req)
			return err
		},
		&pb.HeartbeatRequest{Job: "job-1", Beats: []*pb.Beat{{Member: memberPB(RoleWorker, Position{Rank: 0}, "x"), AgeMs: 1 << 62}}},
	)
}

func FuzzSend(f *testing.F) {
	fuzzRPC(f, func() *pb.SendRequest { return new(pb.SendRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.SendRequest, flags byte) error {
			e.prepare(req, flags, e.worker)
			if flags&2 != 0 {
				for _, r := range req.GetReports() {
					r.From = e.worker.self
				}
			}
			_, err := e.worker.client.Send(callCtx(t), req)
			return err
		},
		&pb.SendRequest{Job: "job-1", Reports: []*pb.Report{{Id: "a", TimeUnixNano: -1, Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: "hang", Attrs: map[string]string{"k": "v"}}}}}},
		&pb.SendRequest{Job: "job-1", Reports: []*pb.Report{{Id: "b", Body: &pb.Report_Message{Message: &pb.UserMessage{Kind: "k", Payload: []byte("p")}}}}},
	)
}

func FuzzStream(f *testing.F) {
	fuzzRPC(f, func() *pb.StreamRequest { return new(pb.StreamRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.StreamRequest, flags byte) error {
			e.prepare(req, flags, e.proxy)
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			st, err := e.proxy.client.Stream(ctx, req)
			if err != nil {
				return err
			}
			_, err = st.Recv()
			if status.Code(err) == codes.DeadlineExceeded || errors.Is(err, io.EOF) {
				// The stream was taken: nothing to receive, or the member
				// took it back (its own stream, registered again) and
				// this one ended.
				return nil
			}
			return err
		},
		&pb.StreamRequest{Job: "job-1", Member: memberPB(RoleProxy, Position{Node: 1, Rank: -1}, "p")},
	)
}

func FuzzAcknowledge(f *testing.F) {
	fuzzRPC(f, func() *pb.AckRequest { return new(pb.AckRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.AckRequest, flags byte) error {
			e.prepare(req, flags, e.worker)
			if flags&2 != 0 {
				for _, a := range req.GetAcks() {
					a.From = e.worker.self
				}
			}
			_, err := e.worker.client.Acknowledge(callCtx(t), req)
			return err
		},
		&pb.AckRequest{Job: "job-1", Acks: []*pb.Ack{{Id: 1, Error: "e", Reply: []byte("{}")}}},
	)
}

func FuzzUploadOffsets(f *testing.F) {
	fuzzRPC(f, func() *pb.UploadOffsetRequest { return new(pb.UploadOffsetRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.UploadOffsetRequest, flags byte) error {
			e.prepare(req, flags, e.proxy)
			if flags&2 != 0 {
				req.Node = 1
			}
			_, err := e.proxy.client.UploadOffsets(callCtx(t), req)
			return err
		},
		&pb.UploadOffsetRequest{Job: "job-1", Node: 1, Paths: []string{"dotting/0/1", "../x", "stacks/a.partial"}},
	)
}

func FuzzUpload(f *testing.F) {
	fuzzRPC(f, func() *pb.UploadChunk { return new(pb.UploadChunk) },
		func(t *testing.T, e *fuzzEnv, req *pb.UploadChunk, flags byte) error {
			e.prepare(req, flags, e.proxy)
			if flags&2 != 0 {
				req.Node = 1
			}
			st, err := e.proxy.client.Upload(callCtx(t))
			if err != nil {
				return err
			}
			for range 1 + int(flags>>6) {
				if err := st.Send(req); err != nil {
					break
				}
			}
			_, err = st.CloseAndRecv()
			return err
		},
		&pb.UploadChunk{Job: "job-1", Node: 1, Path: "dotting/0/1", Data: []byte("x"), Last: true},
	)
}

func FuzzCollectDone(f *testing.F) {
	fuzzRPC(f, func() *pb.CollectResult { return new(pb.CollectResult) },
		func(t *testing.T, e *fuzzEnv, req *pb.CollectResult, flags byte) error {
			e.prepare(req, flags, e.proxy)
			if flags&2 != 0 {
				req.Node = 1
			}
			_, err := e.proxy.client.CollectDone(callCtx(t), req)
			return err
		},
		&pb.CollectResult{Job: "job-1", Collection: 1, Node: 1, Files: 3, Errors: []string{"e"}},
	)
}

func FuzzLeave(f *testing.F) {
	fuzzRPC(f, func() *pb.LeaveRequest { return new(pb.LeaveRequest) },
		func(t *testing.T, e *fuzzEnv, req *pb.LeaveRequest, flags byte) error {
			e.prepare(req, flags, e.worker)
			if flags&2 != 0 {
				// Leaving for real would end the member the check needs:
				// a leave of another instance of its rank.
				req.Member = memberPB(RoleWorker, Position{Node: 0, Rank: 0}, newInstanceID())
			}
			_, err := e.worker.client.Leave(callCtx(t), req)
			return err
		},
		&pb.LeaveRequest{Job: "job-1", Member: memberPB(RoleWorker, Position{Node: 1, Rank: 3}, "x"), Finished: true},
	)
}

func FuzzListMembers(f *testing.F) {
	fuzzRPC(f, func() *pb.ListMembersReq { return new(pb.ListMembersReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.ListMembersReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.admin.ListMembers(callCtx(t), req)
			return err
		},
		&pb.ListMembersReq{JobNsName: "job-1", Offset: 1},
	)
}

func FuzzGetSwitchStatus(f *testing.F) {
	fuzzRPC(f, func() *pb.DataStatusReq { return new(pb.DataStatusReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.DataStatusReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.admin.GetSwitchStatus(callCtx(t), req)
			return err
		},
		&pb.DataStatusReq{JobNsName: "job-1"},
	)
}

func FuzzListFaults(f *testing.F) {
	fuzzRPC(f, func() *pb.ListFaultsReq { return new(pb.ListFaultsReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.ListFaultsReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.admin.ListFaults(callCtx(t), req)
			return err
		},
		&pb.ListFaultsReq{JobNsName: "job-1", After: 1 << 63},
	)
}

func FuzzCollect(f *testing.F) {
	fuzzRPC(f, func() *pb.CollectReq { return new(pb.CollectReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.CollectReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			req.TimeoutMs = min(max(req.GetTimeoutMs(), -1), 100)
			_, err := e.admin.admin.Collect(callCtx(t), req)
			return err
		},
		&pb.CollectReq{JobNsName: "job-1", Nodes: []int32{1, -1, 7}, Dotting: true, TimeoutMs: 50},
	)
}

func FuzzGetOrchestration(f *testing.F) {
	fuzzRPC(f, func() *pb.GetOrchestrationReq { return new(pb.GetOrchestrationReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.GetOrchestrationReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.admin.GetOrchestration(callCtx(t), req)
			return err
		},
		&pb.GetOrchestrationReq{JobNsName: "job-1"},
	)
}

func FuzzSwitchLink(f *testing.F) {
	fuzzRPC(f, func() *pb.SwitchLinkReq { return new(pb.SwitchLinkReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.SwitchLinkReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			req.TimeoutMs = min(req.GetTimeoutMs(), 500)
			_, err := e.admin.admin.SwitchLink(callCtx(t), req)
			return err
		},
		&pb.SwitchLinkReq{JobNsName: "job-1", Link: &pb.LinkRequest{Node: 1, Devices: []int32{0, 1}, Target: "standby"}, TimeoutMs: 100},
	)
}

func FuzzStressTest(f *testing.F) {
	fuzzRPC(f, func() *pb.StressTestReq { return new(pb.StressTestReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.StressTestReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			req.TimeoutMs = min(req.GetTimeoutMs(), 500)
			_, err := e.admin.admin.StressTest(callCtx(t), req)
			return err
		},
		&pb.StressTestReq{JobNsName: "job-1", Stress: &pb.StressRequest{Nodes: []int32{0}, Test: "hbm"}, TimeoutMs: 100},
	)
}

func FuzzGetJob(f *testing.F) {
	fuzzRPC(f, func() *pb.GetJobReq { return new(pb.GetJobReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.GetJobReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.admin.GetJob(callCtx(t), req)
			return err
		},
		&pb.GetJobReq{JobNsName: "job-1", FromRank: -5},
	)
}

func FuzzModifyTrainingDataTraceSwitch(f *testing.F) {
	fuzzRPC(f, func() *pb.DataTypeReq { return new(pb.DataTypeReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.DataTypeReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.trace.ModifyTrainingDataTraceSwitch(callCtx(t), req)
			return err
		},
		&pb.DataTypeReq{JobNsName: "job-1", ProfilingSwitch: &pb.ProfilingSwitch{Step: "on", FP: "maybe"}},
	)
}

func FuzzGetTrainingDataTraceSwitch(f *testing.F) {
	fuzzRPC(f, func() *pb.DataStatusReq { return new(pb.DataStatusReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.DataStatusReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			_, err := e.admin.trace.GetTrainingDataTraceSwitch(callCtx(t), req)
			return err
		},
		&pb.DataStatusReq{JobNsName: "job-1"},
	)
}

func FuzzSubscribeDataTraceSwitch(f *testing.F) {
	fuzzRPC(f, func() *pb.DataStatusReq { return new(pb.DataStatusReq) },
		func(t *testing.T, e *fuzzEnv, req *pb.DataStatusReq, flags byte) error {
			e.prepare(req, flags, e.worker)
			st, err := e.admin.trace.SubscribeDataTraceSwitch(callCtx(t), req)
			if err != nil {
				return err
			}
			_, err = st.Recv()
			return err
		},
		&pb.DataStatusReq{JobNsName: "job-1"},
	)
}

// countBudget is a msgLimiter's budget of max bytes, for one connection.
type countBudget struct{ held, max int }

func (*countBudget) member(string) *identity { return nil }
func (*countBudget) exceeded(string, string) {}
func (b *countBudget) hold(_ *identity, n int) bool {
	if b.held+n > b.max {
		return false
	}
	b.held += n
	return true
}

// FuzzMsgLimiter: whatever bytes a client sends, the limiter of message
// sizes neither panics nor depends on how the reads cut them.
func FuzzMsgLimiter(f *testing.F) {
	var buf bytes.Buffer
	buf.WriteString(h2Preface)
	fr := http2.NewFramer(&buf, nil)
	fr.WriteSettings()
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, kv := range [][2]string{{":method", "POST"}, {":path", pb.Control_Register_FullMethodName}, {"content-type", "application/grpc"}} {
		enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	fr.WriteDataPadded(1, false, []byte{0, 0, 0, 0, 8, 1, 2, 3, 4}, []byte{0, 0})
	fr.WriteData(1, true, []byte{5, 6, 7, 8, 0, 0x10, 0, 0, 0})
	// A call whose HEADERS ends it across a CONTINUATION, and the same
	// again as the server's RST_STREAM.
	block := hb.Bytes()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: block[:2], EndStream: true})
	fr.WriteContinuation(3, true, block[2:])
	fr.WriteRSTStream(1, http2.ErrCodeCancel)
	f.Add(buf.Bytes(), 3)
	f.Add(buf.Bytes(), 1000)
	f.Fuzz(func(t *testing.T, data []byte, cut int) {
		whole := newMsgLimiter(nil, &countBudget{max: 64 << 10}).feed(data)
		l := newMsgLimiter(nil, &countBudget{max: 64 << 10})
		var err error
		for b := data; len(b) > 0 && err == nil; {
			k := min(len(b), 1+(cut&0xffff)%97)
			err, b = l.feed(b[:k]), b[k:]
		}
		if (err == nil) != (whole == nil) {
			t.Fatalf("in one read: %v; cut in reads of up to %d bytes: %v", whole, 1+(cut&0xffff)%97, err)
		}
		// The same bytes as the server's frames: the streams they end.
		var once, cutUp []uint32
		var f frameHeads
		f.feed(data, func(id uint32) { once = append(once, id) })
		f = frameHeads{}
		for b := data; len(b) > 0; {
			k := min(len(b), 1+(cut&0xffff)%97)
			f.feed(b[:k], func(id uint32) { cutUp = append(cutUp, id) })
			b = b[k:]
		}
		if !slices.Equal(once, cutUp) {
			t.Fatalf("streams ended, in one write: %v; cut: %v", once, cutUp)
		}
	})
}
