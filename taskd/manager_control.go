package taskd

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// managerControl serves the tree's Control service.
type managerControl struct {
	pb.UnimplementedControlServer
	m *Manager
}

func (s *managerControl) checkJob(job string) error {
	if job != s.m.cfg.Job {
		return unknownJob(job, "manager", s.m.cfg.Job)
	}
	return nil
}

// maxHostnameBytes bounds a member's hostname (DNS allows 253).
const maxHostnameBytes = 255

// checkMember validates a member's identity and position: its node below
// nodes, its rank below nodes×procsPerNode, or both below maxWorkers when
// the shape is unset.
func checkMember(mem *pb.Member, nodes, procsPerNode, maxWorkers int) error {
	if mem == nil || mem.GetPosition() == nil {
		return status.Error(codes.InvalidArgument, "taskd: member: missing")
	}
	if n := len(mem.GetInstance()); n == 0 || n > 128 {
		return status.Errorf(codes.InvalidArgument, "taskd: member.instance: length %d, want 1 to 128", n)
	}
	maxNodes, maxRanks := nodes, nodes*procsPerNode
	if nodes <= 0 || procsPerNode <= 0 {
		maxNodes, maxRanks = maxWorkers, maxWorkers
	}
	node, rank := int(mem.GetPosition().GetNode()), int(mem.GetPosition().GetRank())
	if node < 0 || node >= maxNodes {
		return status.Errorf(codes.InvalidArgument, "taskd: member.position.node: %d out of range [0,%d)", node, maxNodes)
	}
	switch roleFromPB(mem.GetRole()) {
	case RoleProxy:
	case RoleWorker:
		if rank < 0 || rank >= maxRanks {
			return status.Errorf(codes.InvalidArgument, "taskd: member.position.rank: %d out of range [0,%d)", rank, maxRanks)
		}
		// With the shape known, a node's ranks are node×procsPerNode on:
		// one elsewhere was started with another shape than the job's.
		if nodes > 0 && procsPerNode > 0 && rank/procsPerNode != node {
			return status.Errorf(codes.InvalidArgument, "taskd: member.position: rank %d is not of node %d, whose ranks are %d to %d with %d a node",
				rank, node, node*procsPerNode, (node+1)*procsPerNode-1, procsPerNode)
		}
	default:
		return status.Errorf(codes.InvalidArgument, "taskd: member.role: %v cannot register", mem.GetRole())
	}
	return nil
}

func (s *managerControl) Register(ctx context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	m := s.m
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	if err := m.newerSeen(req.GetFence()); err != nil {
		return nil, err
	}
	mem := req.GetMember()
	if err := checkMember(mem, m.cfg.Nodes+m.cfg.SpareNodes, m.cfg.ProcsPerNode, m.cfg.MaxWorkers); err != nil {
		return nil, err
	}
	if n := len(req.GetHostname()); n > maxHostnameBytes {
		return nil, status.Errorf(codes.InvalidArgument, "taskd: hostname: %d bytes, at most %d", n, maxHostnameBytes)
	}
	key := keyOf(mem)
	nm := member{key: key, pos: positionOf(mem), instance: mem.GetInstance(), via: -1, hostname: req.GetHostname(), pid: int(req.GetPid()), conn: connOf(ctx)}
	if p, ok := peer.FromContext(ctx); ok {
		nm.addr = p.Addr.String()
	}
	caller := callerOf(ctx)
	if key.role == RoleProxy && callCredential(ctx) != credProxy {
		if m.cfg.ProxyToken == "" {
			return nil, permission("%s: the proxy role is closed: this manager was given no proxies' token (ManagerConfig.ProxyToken)", key)
		}
		return nil, permission("%s: a proxy registers with the proxies' token (ManagerConfig.ProxyToken)", key)
	}
	now := time.Now()
	m.mu.Lock()
	if m.evicted.has(nm.instance) {
		m.mu.Unlock()
		m.met.refused.Inc()
		return nil, status.Errorf(codes.FailedPrecondition, "taskd: %s: %v", key, ErrEvicted)
	}
	if via := req.GetVia(); via != nil {
		if key.role != RoleWorker || roleFromPB(via.GetRole()) != RoleProxy {
			m.mu.Unlock()
			return nil, status.Error(codes.InvalidArgument, "taskd: via: only a worker registers through a proxy")
		}
		if !caller.is(via) {
			m.mu.Unlock()
			return nil, permission("%s: only the proxy of node %d registers workers through it", key, via.GetPosition().GetNode())
		}
		pm := m.reg.get(keyOf(via))
		if pm == nil || pm.instance != via.GetInstance() {
			m.mu.Unlock()
			return nil, status.Errorf(codes.Unavailable, "taskd: proxy of node %d is not registered", via.GetPosition().GetNode())
		}
		if nm.pos.Node != pm.pos.Node {
			m.mu.Unlock()
			return nil, permission("%s of node %d: the proxy of node %d registers only its own node's workers", key, nm.pos.Node, pm.pos.Node)
		}
		nm.via = pm.pos.Node
	}
	old := m.reg.get(key)
	if old != nil && old.instance == nm.instance && (old.via != nm.via || (nm.via < 0 && !caller.is(mem) && !old.sameConn(nm))) {
		// The instance is live: registering it again takes its secret, or
		// its proxy's, or the connection that registered it, on which a
		// member whose answer came past its deadline asks again without
		// the secret it never got.
		m.mu.Unlock()
		return nil, permission("%s: instance %s is live; registering it again takes its credential", key, nm.instance)
	}
	if m.members != nil && key.role == RoleWorker {
		m.completeMembersLocked(now)
		if err := m.members.admit(now, nm.pos.Rank); err != nil {
			m.mu.Unlock()
			m.met.refused.Inc()
			m.log.Warn("taskd: registration refused: not of the job", "member", key.String(), "addr", nm.addr, "err", err)
			return nil, status.Errorf(codes.FailedPrecondition, "taskd: %s: %v", key, err)
		}
	}
	oldInstance := ""
	if old != nil {
		oldInstance = old.instance
	}
	fresh, err := m.reg.register(nm, now)
	if err != nil {
		holder := m.reg.get(key)
		m.mu.Unlock()
		m.met.refused.Inc()
		m.log.Warn("taskd: registration refused: position held by a live instance", "member", key.String(), "addr", nm.addr, "holder_addr", holder.addr)
		return nil, status.Errorf(codes.AlreadyExists, "taskd: %s: %v", key, ErrRankTaken)
	}
	if oldInstance != "" && oldInstance != nm.instance {
		m.ids.revoke(key, oldInstance)
	}
	secret := ""
	if nm.via < 0 {
		secret = m.ids.issue(identity{key: key, instance: nm.instance, node: nm.pos.Node})
	} else {
		m.ids.revoke(key, nm.instance) // reached through its proxy now
	}
	if dl := m.downlinks[key]; dl != nil && (dl.instance != nm.instance || nm.via >= 0) {
		dl.detach()
		delete(m.downlinks, key)
	}
	if m.downlinks[key] == nil && nm.via < 0 {
		size := workerQueue
		if key.role == RoleProxy {
			size = proxyQueue
		}
		m.downlinks[key] = newDownlink(nm.instance, size)
	}
	switch key.role {
	case RoleWorker:
		if fresh {
			m.returnedLocked(key.id)
		}
		m.sw.registered(key.id, nm.pos.Node, req.GetSwitchBits(), req.GetHasSwitch())
	case RoleProxy:
		m.proxyHosts[nm.pos.Node] = peerHost(nm.addr)
	}
	m.updateMemberGaugesLocked()
	m.mu.Unlock()
	if fresh {
		m.log.Info("taskd: member registered", "member", key.String(), "addr", nm.addr, "via", nm.via)
		m.events.push(Event{Kind: EventRegistered, Time: now, Role: key.role, Position: nm.pos, instance: nm.instance})
	}
	m.wake()
	return &pb.RegisterResponse{
		HeartbeatIntervalMs: m.cfg.HeartbeatInterval.Milliseconds(),
		HeartbeatDeadlineMs: m.cfg.HeartbeatDeadline.Milliseconds(),
		ManagerInstance:     m.instance,
		Secret:              secret,
		Fence:               m.token(),
		// Checked after registering: a worker held here registered before
		// the resume picked its targets, so the resume reaches it.
		Held: key.role == RoleWorker && m.orch != nil && m.orch.holding(nm.pos.Rank),
	}, nil
}

// actsForLocked returns the live member mem names when caller may act for
// it: it is mem, or mem is a worker registered through caller, its proxy.
// The error says why not: the caller is someone else (PermissionDenied),
// or mem is not live (FailedPrecondition: it registers again first).
func (m *Manager) actsForLocked(caller *identity, mem *pb.Member) (*member, error) {
	if mem.GetPosition() == nil {
		return nil, status.Error(codes.InvalidArgument, "taskd: member: missing")
	}
	key := keyOf(mem)
	mm := m.reg.get(key)
	live := mm != nil && mm.instance == mem.GetInstance()
	switch {
	case caller == nil:
		return nil, errUnknownMember
	case caller.is(mem) && live:
		return mm, nil
	case caller.is(mem):
		return nil, errUnknownMember // dropped since the call was admitted
	case caller.key.role != RoleProxy || key.role != RoleWorker:
	case !live:
		return nil, status.Errorf(codes.FailedPrecondition, "taskd: %s is not registered", key)
	case mm.via == caller.node:
		return mm, nil
	}
	return nil, permission("%s may not act for %s", caller.key, key)
}

// knownOnNodeLocked reports whether rank is a worker of node: live there,
// gone from there, or there by the job's shape.
func (m *Manager) knownOnNodeLocked(rank, node int) bool {
	if n, ppn := m.cfg.Nodes, m.cfg.ProcsPerNode; n > 0 && ppn > 0 && rank < n*ppn {
		return rank/ppn == node
	}
	if mm := m.reg.get(workerKey(rank)); mm != nil {
		return mm.pos.Node == node
	}
	d, gone := m.gone.byRank[rank]
	return gone && d.Position.Node == node
}

func (s *managerControl) Heartbeat(ctx context.Context, req *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	m := s.m
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	if err := m.newerSeen(req.GetFence()); err != nil {
		return nil, err
	}
	caller := callerOf(ctx)
	now := time.Now()
	resp := &pb.HeartbeatResponse{ManagerInstance: m.instance, Fence: m.token()}
	m.mu.Lock()
	for _, b := range req.GetBeats() {
		// Clamped before it becomes a Duration, which an age of 2^63 ns
		// or more would overflow.
		age := time.Duration(min(max(b.GetAgeMs(), 0), m.cfg.HeartbeatDeadline.Milliseconds())) * time.Millisecond
		if _, err := m.actsForLocked(caller, b.GetMember()); err != nil || !m.reg.beat(keyOf(b.GetMember()), b.GetMember().GetInstance(), now.Add(-age), now) {
			resp.Unknown = append(resp.Unknown, b.GetMember())
		}
	}
	m.mu.Unlock()
	return resp, nil
}

func (s *managerControl) Send(ctx context.Context, req *pb.SendRequest) (*pb.SendResponse, error) {
	m := s.m
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	if len(req.GetReports()) > 4096 {
		return nil, status.Errorf(codes.InvalidArgument, "taskd: reports: %d in one call, at most 4096", len(req.GetReports()))
	}
	for i, r := range req.GetReports() {
		if r.GetId() == "" || len(r.GetId()) > 256 {
			return nil, status.Errorf(codes.InvalidArgument, "taskd: reports[%d].id: length %d, want 1 to 256", i, len(r.GetId()))
		}
		switch body := r.GetBody().(type) {
		case *pb.Report_Fault:
			if err := checkKind(FaultKind(body.Fault.GetKind())); err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "taskd: reports[%d].fault.kind: %v", i, err)
			}
		case *pb.Report_Message:
		default:
			return nil, status.Errorf(codes.InvalidArgument, "taskd: reports[%d]: no body", i)
		}
	}
	if err := m.authorizeReports(callerOf(ctx), req.GetReports()); err != nil {
		return nil, err
	}
	now := time.Now()
	resp := &pb.SendResponse{}
	var evs []Event
	var last uint64 // the newest fault of the call, to wait for on disk
	for _, r := range req.GetReports() {
		from := r.GetFrom()
		switch body := r.GetBody().(type) {
		case *pb.Report_Fault:
			stored, isNew := m.faults.add(faultFromPB(r.GetId(), from, r.GetTimeUnixNano(), body.Fault), now)
			last = max(last, stored.Seq)
			if isNew {
				m.met.faults.WithLabelValues(kindLabel(stored.Kind)).Inc()
				m.log.Warn("taskd: fault", "seq", stored.Seq, "kind", stored.Kind, "position", stored.Position.String(), "code", stored.Code, "message", stored.Message)
				evs = append(evs, Event{Kind: EventFault, Time: now, Role: roleFromPB(from.GetRole()), Position: positionOf(from), Fault: stored})
			} else {
				m.met.faultDups.Inc()
			}
			m.met.messages.WithLabelValues("up", "fault").Inc()
		case *pb.Report_Message:
			m.mu.Lock()
			fresh := m.recentMsgs.add(r.GetId())
			m.mu.Unlock()
			if fresh {
				evs = append(evs, Event{Kind: EventMessage, Time: now, Role: roleFromPB(from.GetRole()), Position: positionOf(from),
					Message: Message{ID: r.GetId(), Kind: body.Message.GetKind(), Payload: body.Message.GetPayload(), From: positionOf(from)}})
			}
			m.met.messages.WithLabelValues("up", "message").Inc()
		}
		resp.Accepted = append(resp.Accepted, r.GetId())
	}
	m.events.push(evs...)
	// Acknowledged once on disk, off every lock: a heartbeat never waits
	// for this fsync.
	if err := m.faults.wait(ctx, last); err != nil {
		return nil, status.Errorf(codes.Unavailable, "taskd: faults not saved: %v", err)
	}
	return resp, nil
}

// authorizeReports checks that caller may send each report: it comes from
// the caller or a worker behind it, and a fault is about its reporter: a
// worker's own rank, or a proxy's node and a worker of that node.
func (m *Manager) authorizeReports(caller *identity, reports []*pb.Report) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, r := range reports {
		from, err := m.actsForLocked(caller, r.GetFrom())
		if err != nil {
			return status.Errorf(status.Code(err), "taskd: reports[%d].from: %s", i, status.Convert(err).Message())
		}
		f := r.GetFault()
		if f == nil {
			continue
		}
		pos := Position{Node: int(f.GetNode()), Rank: int(f.GetRank())}
		switch {
		case from.key.role == RoleWorker && pos != from.pos:
			return permission("reports[%d].fault: about %s, but %s reports only its own faults", i, pos, from.key)
		case from.key.role == RoleProxy && pos.Node != from.pos.Node:
			return permission("reports[%d].fault: about %s, but the proxy of node %d reports only its node's", i, pos, from.pos.Node)
		case from.key.role == RoleProxy && pos.Rank >= 0 && !m.knownOnNodeLocked(pos.Rank, pos.Node):
			return permission("reports[%d].fault: rank %d is not a worker of node %d", i, pos.Rank, pos.Node)
		}
	}
	return nil
}

// Bounds of a reporter's time: one further off the manager's clock is not
// kept (the fault's time is then when the manager took it in).
const (
	maxFaultAhead  = time.Minute
	maxFaultBehind = 7 * 24 * time.Hour
)

func faultFromPB(id string, from *pb.Member, t int64, f *pb.FaultReport) Fault {
	out := Fault{
		ID:           id,
		Kind:         FaultKind(f.GetKind()),
		Position:     Position{Node: int(f.GetNode()), Rank: int(f.GetRank())},
		Code:         int(f.GetCode()),
		Message:      f.GetMessage(),
		Reporter:     positionOf(from),
		ReporterRole: roleFromPB(from.GetRole()),
	}
	if len(f.GetAttrs()) > 0 {
		out.Attrs = f.GetAttrs()
	}
	if at := time.Unix(0, t); t != 0 && at.Before(time.Now().Add(maxFaultAhead)) && at.After(time.Now().Add(-maxFaultBehind)) {
		out.Time = at.UTC()
	}
	return out
}

func faultToPB(f Fault) *pb.Fault {
	out := &pb.Fault{
		Seq: f.Seq, Id: f.ID, Kind: string(f.Kind), Node: int32(f.Position.Node), Rank: int32(f.Position.Rank),
		Code: int32(f.Code), Message: f.Message, Attrs: f.Attrs, ReceivedUnixNano: f.Received.UnixNano(),
		Reporter: memberPB(f.ReporterRole, f.Reporter, ""),
	}
	if !f.Time.IsZero() {
		out.TimeUnixNano = f.Time.UnixNano()
	}
	return out
}

func (s *managerControl) Stream(req *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.Envelope]) error {
	m := s.m
	if err := s.checkJob(req.GetJob()); err != nil {
		return err
	}
	key := keyOf(req.GetMember())
	if !callerOf(stream.Context()).is(req.GetMember()) {
		return permission("%s: a member opens only its own stream", key)
	}
	m.mu.Lock()
	mm := m.reg.get(key)
	if mm == nil || mm.instance != req.GetMember().GetInstance() {
		m.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "taskd: %s: register before opening the stream", key)
	}
	dl := m.downlinks[key]
	if dl == nil || dl.instance != mm.instance {
		m.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "taskd: %s: no route; register directly before opening the stream", key)
	}
	stop := dl.attach()
	m.mu.Unlock()
	m.wake()
	return serveDownlink(stream.Context(), stop, dl, stream.Send)
}

func (s *managerControl) Acknowledge(ctx context.Context, req *pb.AckRequest) (*pb.AckResponse, error) {
	m := s.m
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	caller := callerOf(ctx)
	now := time.Now()
	m.mu.Lock()
	for _, a := range req.GetAcks() {
		// An acknowledgement counts only from the worker it names, as it
		// is live now, or through its proxy.
		if _, err := m.actsForLocked(caller, a.GetFrom()); err == nil {
			m.ackLocked(a, now)
		}
	}
	m.checkFanoutLocked(now)
	m.mu.Unlock()
	return &pb.AckResponse{}, nil
}

// nodeProxy checks that the caller is the proxy of node: collection is
// its alone.
func nodeProxy(ctx context.Context, node int32) error {
	if c := callerOf(ctx); c == nil || c.key.role != RoleProxy || c.node != int(node) {
		return permission("node %d: only its proxy ships its files", node)
	}
	return nil
}

func (s *managerControl) UploadOffsets(ctx context.Context, req *pb.UploadOffsetRequest) (*pb.UploadOffsetResponse, error) {
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	if err := nodeProxy(ctx, req.GetNode()); err != nil {
		return nil, err
	}
	return s.m.uploadOffsets(req)
}

func (s *managerControl) Upload(stream grpc.ClientStreamingServer[pb.UploadChunk, pb.UploadResponse]) error {
	return s.m.receiveUpload(stream)
}

func (s *managerControl) CollectDone(ctx context.Context, req *pb.CollectResult) (*pb.CollectResultResponse, error) {
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	if err := nodeProxy(ctx, req.GetNode()); err != nil {
		return nil, err
	}
	s.m.collectDone(req)
	return &pb.CollectResultResponse{}, nil
}

func (s *managerControl) Leave(ctx context.Context, req *pb.LeaveRequest) (*pb.LeaveResponse, error) {
	m := s.m
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	mem := req.GetMember()
	if err := checkMember(mem, m.cfg.Nodes+m.cfg.SpareNodes, m.cfg.ProcsPerNode, m.cfg.MaxWorkers); err != nil {
		return nil, err
	}
	m.mu.Lock()
	_, err := m.actsForLocked(callerOf(ctx), mem)
	m.mu.Unlock()
	switch status.Code(err) {
	case codes.OK:
	case codes.PermissionDenied:
		return nil, err
	default:
		return &pb.LeaveResponse{}, nil // gone already: nothing to do
	}
	m.leave(keyOf(mem), mem.GetInstance(), req.GetFinished(), time.Now())
	return &pb.LeaveResponse{}, nil
}

// statusMessage returns the message of a gRPC error, or its text.
func statusMessage(err error) string {
	if st, ok := status.FromError(err); ok {
		return st.Message()
	}
	return fmt.Sprint(err)
}
