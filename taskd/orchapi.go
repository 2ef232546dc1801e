package taskd

import (
	"context"
	"errors"
	"time"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// Orchestrations returns the orchestration running now, the finished ones
// with an ID above after (oldest first, at most MaxHistory), and the links
// on their standby. It is empty when orchestration is off.
func (m *Manager) Orchestrations(after uint64) OrchestrationStatus {
	if m.orch == nil {
		return OrchestrationStatus{}
	}
	return m.orch.status(after)
}

// SwitchLink moves the links of l.Devices on l.Node to l.Target: the job
// pauses, the node's workers (or l.Ranks) switch, and the job continues;
// LinkPrimary switches back. It waits for the switch to end or ctx to, and
// returns its record. The error wraps ErrBusy when another orchestration
// runs, ErrOrchestrationFailed when a worker could not switch (the switch
// then hands over to a recovery, see the record's HandedOverTo), and
// ctx's error when ctx ended first (the switch goes on).
func (m *Manager) SwitchLink(ctx context.Context, l LinkRequest) (Orchestration, error) {
	if m.orch == nil {
		return Orchestration{}, ErrOrchestrationOff
	}
	if err := l.Validate(); err != nil {
		return Orchestration{}, err
	}
	l.Devices, l.Ranks = sortedUnique(l.Devices), sortedUnique(l.Ranks)
	kind := KindLinkSwitch
	if l.Target == LinkPrimary {
		kind = KindSwitchback
	}
	return m.orch.request(ctx, kind, &l, nil)
}

// StressTest runs an online stress test: the job pauses, the workers of
// s.Nodes and s.Ranks run s.Test, and the job continues. It waits as
// SwitchLink does; a failed test hands over to a recovery of the ranks
// that failed it.
func (m *Manager) StressTest(ctx context.Context, s StressRequest) (Orchestration, error) {
	if m.orch == nil {
		return Orchestration{}, ErrOrchestrationOff
	}
	if err := s.Validate(); err != nil {
		return Orchestration{}, err
	}
	s.Nodes, s.Ranks = sortedUnique(s.Nodes), sortedUnique(s.Ranks)
	return m.orch.request(ctx, KindStressTest, nil, &s)
}

func int32s(v []int) []int32 {
	out := make([]int32, len(v))
	for i, x := range v {
		out[i] = int32(x)
	}
	return out
}

func ints(v []int32) []int {
	out := make([]int, len(v))
	for i, x := range v {
		out[i] = int(x)
	}
	return out
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func orchestrationToPB(o Orchestration) *pb.Orchestration {
	out := &pb.Orchestration{
		Id: o.ID, Kind: string(o.Kind), State: string(o.State), Done: o.Done,
		StartUnixNano: unixNano(o.Start), EndUnixNano: unixNano(o.End), Round: int32(o.Round),
		Strategy: string(o.Strategy), FaultyRanks: int32s(o.FaultyRanks), ResumedStep: o.ResumedStep,
		DetectNs: int64(o.Detected), StopNs: int64(o.Stopped), ResumeNs: int64(o.Resumed),
		Outcome: o.Outcome, HandedOverTo: o.HandedOverTo, HandedOverFrom: o.HandedOverFrom,
	}
	for _, f := range o.Faults {
		out.Faults = append(out.Faults, faultToPB(f))
	}
	for _, t := range o.Transitions {
		out.Transitions = append(out.Transitions, &pb.Transition{From: string(t.From), To: string(t.To), TimeUnixNano: unixNano(t.Time), Reason: t.Reason})
	}
	if l := o.Link; l != nil {
		out.Link = &pb.LinkRequest{Node: int32(l.Node), Devices: int32s(l.Devices), Target: string(l.Target), Ranks: int32s(l.Ranks)}
	}
	if s := o.Stress; s != nil {
		out.Stress = &pb.StressRequest{Nodes: int32s(s.Nodes), Ranks: int32s(s.Ranks), Test: s.Test}
	}
	return out
}

// maxOrchestrationsPerList bounds the history one GetOrchestration call
// returns; callers page on with after.
const maxOrchestrationsPerList = 100

func (s *managerAdmin) GetOrchestration(_ context.Context, req *pb.GetOrchestrationReq) (*pb.GetOrchestrationRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.GetOrchestrationRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	if s.m.orch == nil {
		return &pb.GetOrchestrationRes{Code: pb.Code_CODE_FAILED, Message: ErrOrchestrationOff.Error()}, nil
	}
	st := s.m.Orchestrations(req.GetAfter())
	res := &pb.GetOrchestrationRes{Code: pb.Code_CODE_OK, Message: "ok"}
	if st.Current != nil {
		res.Current = orchestrationToPB(*st.Current)
	}
	if len(st.History) > maxOrchestrationsPerList {
		st.History = st.History[:maxOrchestrationsPerList]
	}
	for _, o := range st.History {
		res.History = append(res.History, orchestrationToPB(o))
	}
	for _, l := range st.Links {
		res.Links = append(res.Links, &pb.LinkState{Node: int32(l.Node), Device: int32(l.Device), Target: string(l.Target)})
	}
	return res, nil
}

// orchestrationRes turns the outcome of a request into its answer.
func orchestrationRes(o Orchestration, err error) *pb.OrchestrationRes {
	res := &pb.OrchestrationRes{Code: pb.Code_CODE_OK, Message: "ok"}
	if o.ID != 0 {
		res.Orchestration = orchestrationToPB(o)
	}
	switch {
	case err == nil:
	case errors.Is(err, ErrBusy):
		res.Code, res.Message = pb.Code_CODE_BUSY, err.Error()
	case errors.Is(err, ErrOrchestrationFailed), errors.Is(err, ErrOrchestrationOff):
		res.Code, res.Message = pb.Code_CODE_FAILED, err.Error()
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		res.Code, res.Message = pb.Code_CODE_INTERNAL, err.Error()
	default:
		res.Code, res.Message = pb.Code_CODE_BAD_PARAMETER, err.Error()
	}
	return res
}

func withTimeoutMS(ctx context.Context, ms int64) (context.Context, context.CancelFunc) {
	if ms > 0 {
		return context.WithTimeout(ctx, time.Duration(ms)*time.Millisecond)
	}
	return context.WithCancel(ctx)
}

func (s *managerAdmin) SwitchLink(ctx context.Context, req *pb.SwitchLinkReq) (*pb.OrchestrationRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.OrchestrationRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	if req.GetTimeoutMs() < 0 {
		return &pb.OrchestrationRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: "timeout_ms: negative"}, nil
	}
	l := req.GetLink()
	if l == nil {
		return &pb.OrchestrationRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: "link: missing"}, nil
	}
	ctx, cancel := withTimeoutMS(ctx, req.GetTimeoutMs())
	defer cancel()
	return orchestrationRes(s.m.SwitchLink(ctx, LinkRequest{Node: int(l.GetNode()), Devices: ints(l.GetDevices()), Target: LinkTarget(l.GetTarget()), Ranks: ints(l.GetRanks())})), nil
}

func (s *managerAdmin) StressTest(ctx context.Context, req *pb.StressTestReq) (*pb.OrchestrationRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.OrchestrationRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	if req.GetTimeoutMs() < 0 {
		return &pb.OrchestrationRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: "timeout_ms: negative"}, nil
	}
	st := req.GetStress()
	if st == nil {
		return &pb.OrchestrationRes{Code: pb.Code_CODE_BAD_PARAMETER, Message: "stress: missing"}, nil
	}
	ctx, cancel := withTimeoutMS(ctx, req.GetTimeoutMs())
	defer cancel()
	return orchestrationRes(s.m.StressTest(ctx, StressRequest{Nodes: ints(st.GetNodes()), Ranks: ints(st.GetRanks()), Test: st.GetTest()})), nil
}
