package taskd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/trace"
)

// managerTraceAPI serves TrainingDataTrace, with the meaning of ClusterD's
// service of that name.
type managerTraceAPI struct {
	pb.UnimplementedTrainingDataTraceServer
	m *Manager
}

func switchToPB(sw trace.Switch) *pb.ProfilingSwitch {
	onOff := func(on bool) string {
		if on {
			return "on"
		}
		return "off"
	}
	return &pb.ProfilingSwitch{
		CommunicationOperator: onOff(sw.CommunicationOperator),
		Step:                  onOff(sw.Step),
		SaveCheckpoint:        onOff(sw.SaveCheckpoint),
		FP:                    onOff(sw.FP),
		DataLoader:            onOff(sw.DataLoader),
	}
}

// switchFromPB builds the profilingSwitch document of p and parses it as
// trace.ParseSwitch does; an empty field is absent (off).
func switchFromPB(p *pb.ProfilingSwitch) (trace.Switch, error) {
	if p == nil {
		return trace.Switch{}, errors.New("profilingSwitch: missing")
	}
	var b bytes.Buffer
	b.WriteByte('{')
	for _, f := range []struct{ name, v string }{
		{"CommunicationOperator", p.GetCommunicationOperator()}, {"Step", p.GetStep()},
		{"SaveCheckpoint", p.GetSaveCheckpoint()}, {"FP", p.GetFP()}, {"DataLoader", p.GetDataLoader()},
	} {
		if f.v == "" {
			continue
		}
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		b.WriteString(`"` + f.name + `":`)
		q, _ := jsonString(f.v)
		b.Write(q)
	}
	b.WriteByte('}')
	return trace.ParseSwitch(b.Bytes())
}

func (s *managerTraceAPI) ModifyTrainingDataTraceSwitch(_ context.Context, req *pb.DataTypeReq) (*pb.DataTypeRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.DataTypeRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	sw, err := switchFromPB(req.GetProfilingSwitch())
	if err != nil {
		return &pb.DataTypeRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: err.Error()}, nil
	}
	if _, err := s.m.SetSwitch(sw); err != nil {
		return &pb.DataTypeRes{Code: pb.Code_CODE_INTERNAL, Message: err.Error()}, nil
	}
	return &pb.DataTypeRes{Code: pb.Code_CODE_OK, Message: "ok"}, nil
}

func (s *managerTraceAPI) GetTrainingDataTraceSwitch(_ context.Context, req *pb.DataStatusReq) (*pb.DataStatusRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.DataStatusRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	st := s.m.SwitchStatus()
	return &pb.DataStatusRes{Code: pb.Code_CODE_OK, Message: "ok", ProfilingSwitch: switchToPB(st.Switch)}, nil
}

func (s *managerTraceAPI) SubscribeDataTraceSwitch(req *pb.DataStatusReq, stream grpc.ServerStreamingServer[pb.DataStatusRes]) error {
	if req.GetJobNsName() != s.m.cfg.Job {
		return stream.Send(&pb.DataStatusRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())})
	}
	ch, cancel := s.m.subscribeSwitch()
	defer cancel()
	if err := stream.Send(&pb.DataStatusRes{Code: pb.Code_CODE_OK, Message: "ok", ProfilingSwitch: switchToPB(s.m.SwitchStatus().Switch)}); err != nil {
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case <-s.m.closed:
			return nil
		case sw := <-ch:
			if err := stream.Send(&pb.DataStatusRes{Code: pb.Code_CODE_OK, Message: "ok", ProfilingSwitch: switchToPB(sw)}); err != nil {
				return err
			}
		}
	}
}

// maxFaultsPerList bounds the faults one ListFaults call returns.
const maxFaultsPerList = 1000

// managerAdmin serves the Admin service.
type managerAdmin struct {
	pb.UnimplementedAdminServer
	m *Manager
}

func (s *managerAdmin) GetSwitchStatus(_ context.Context, req *pb.DataStatusReq) (*pb.SwitchStatusRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.SwitchStatusRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	st := s.m.SwitchStatus()
	res := &pb.SwitchStatusRes{Code: pb.Code_CODE_OK, Message: "ok", Version: st.Version}
	// The answer stays under half the message size cap: the workers past
	// it are left out, and the message says so.
	budget := s.m.cfg.MaxMessageBytes / 2
	for _, w := range st.Workers {
		ws := &pb.WorkerSwitchStatus{Position: &pb.Position{Node: int32(w.Position.Node), Rank: int32(w.Position.Rank)}, Error: w.Error}
		for d := range Domains() {
			ws.Domains = append(ws.Domains, &pb.DomainStatus{Domain: d, Status: string(w.Domains[d])})
		}
		if budget -= proto.Size(ws) + 8; budget < 0 {
			res.Message = fmt.Sprintf("ok: the first %d of %d workers; the answer is capped at half of %d bytes", len(res.Workers), len(st.Workers), s.m.cfg.MaxMessageBytes)
			break
		}
		res.Workers = append(res.Workers, ws)
	}
	return res, nil
}

func (s *managerAdmin) ListFaults(_ context.Context, req *pb.ListFaultsReq) (*pb.ListFaultsRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.ListFaultsRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	res := &pb.ListFaultsRes{Code: pb.Code_CODE_OK, Message: "ok"}
	// One answer stays under half the message size cap, and holds at
	// least one fault; callers page on with after set to the last seq.
	budget := s.m.cfg.MaxMessageBytes / 2
	for _, f := range s.m.faults.page(req.GetAfter(), maxFaultsPerList) {
		pf := faultToPB(f)
		if budget -= proto.Size(pf) + 8; budget < 0 && len(res.Faults) > 0 {
			break
		}
		res.Faults = append(res.Faults, pf)
	}
	return res, nil
}

func (s *managerAdmin) Collect(ctx context.Context, req *pb.CollectReq) (*pb.CollectRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.CollectRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	if req.GetTimeoutMs() < 0 {
		return &pb.CollectRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: "timeout_ms: negative"}, nil
	}
	if t := req.GetTimeoutMs(); t > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(t)*time.Millisecond)
		defer cancel()
	}
	maxNodes := s.m.cfg.Nodes
	if maxNodes == 0 {
		maxNodes = s.m.cfg.MaxWorkers
	}
	if len(req.GetNodes()) > maxNodes {
		return &pb.CollectRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: fmt.Sprintf("nodes: %d, the job has at most %d", len(req.GetNodes()), maxNodes)}, nil
	}
	opts := CollectOptions{Dotting: req.GetDotting(), Stacks: req.GetStacks()}
	for _, n := range req.GetNodes() {
		if n < 0 || int(n) >= maxNodes {
			return &pb.CollectRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: fmt.Sprintf("nodes: %d out of range [0,%d)", n, maxNodes)}, nil
		}
		opts.Nodes = append(opts.Nodes, int(n))
	}
	results, err := s.m.Collect(ctx, opts)
	res := &pb.CollectRes{Code: pb.Code_CODE_OK, Message: "ok"}
	if err != nil {
		res.Code, res.Message = pb.Code_CODE_INTERNAL, err.Error()
		if errors.Is(err, ErrBadCollect) {
			res.Code = pb.Code_CODE_BAD_PARAMETER
		}
	}
	for _, r := range results {
		res.Results = append(res.Results, &pb.CollectResult{Job: s.m.cfg.Job, Collection: r.Collection, Node: int32(r.Node), Files: int32(r.Files), Bytes: r.Bytes, Errors: r.Errors})
	}
	return res, nil
}

func (s *managerAdmin) ListMembers(_ context.Context, req *pb.ListMembersReq) (*pb.ListMembersRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.ListMembersRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	members := s.m.Members()
	res := &pb.ListMembersRes{Code: pb.Code_CODE_OK, Message: "ok", Total: int32(len(members))}
	if req.GetOffset() < 0 {
		return &pb.ListMembersRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: "offset: negative"}, nil
	}
	// One answer stays under half the message size cap, and holds at
	// least one member.
	budget := s.m.cfg.MaxMessageBytes / 2
	for _, mi := range members[min(int(req.GetOffset()), len(members)):] {
		ms := &pb.MemberStatus{
			Member: memberPB(mi.Role, mi.Position, mi.Instance), Via: int32(mi.Via), Hostname: mi.Hostname, Pid: int64(mi.PID), LastSeenUnixNano: mi.LastSeen.UnixNano(),
		}
		if budget -= proto.Size(ms) + 8; budget < 0 && len(res.Members) > 0 {
			break
		}
		res.Members = append(res.Members, ms)
	}
	return res, nil
}
