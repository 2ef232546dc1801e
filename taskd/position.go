package taskd

import (
	"fmt"
	"slices"

	"github.com/faultline-ml/faultline/internal/taskdpb"
)

// Role is a member's place in the tree.
type Role int

// The roles.
const (
	RoleManager Role = iota + 1
	RoleProxy
	RoleWorker
)

func (r Role) String() string {
	switch r {
	case RoleManager:
		return "manager"
	case RoleProxy:
		return "proxy"
	case RoleWorker:
		return "worker"
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// Position places a member in the job: its node rank and, for a worker, its
// global process rank. A proxy's Rank is -1.
type Position struct {
	Node int
	Rank int
}

func (p Position) String() string {
	if p.Rank < 0 {
		return fmt.Sprintf("node %d", p.Node)
	}
	return fmt.Sprintf("node %d rank %d", p.Node, p.Rank)
}

// Target selects the workers a message goes to: every live worker of the
// job (no spare) when All is set, else the workers on Nodes and the
// workers with Ranks.
type Target struct {
	All   bool
	Nodes []int
	Ranks []int
}

// AllWorkers targets every live worker of the job, its spares'
// (ManagerConfig.SpareNodes) left out.
func AllWorkers() Target { return Target{All: true} }

// NodeWorkers targets the workers on the given nodes.
func NodeWorkers(nodes ...int) Target { return Target{Nodes: nodes} }

// RankList targets the given ranks.
func RankList(ranks ...int) Target { return Target{Ranks: ranks} }

// memberKey identifies a place in the tree: a worker by its rank, a proxy
// by its node.
type memberKey struct {
	role Role
	id   int
}

func (k memberKey) String() string {
	if k.role == RoleProxy {
		return fmt.Sprintf("proxy of node %d", k.id)
	}
	return fmt.Sprintf("%s rank %d", k.role, k.id)
}

func workerKey(rank int) memberKey { return memberKey{role: RoleWorker, id: rank} }
func proxyKey(node int) memberKey  { return memberKey{role: RoleProxy, id: node} }

func keyOf(m *taskdpb.Member) memberKey {
	role := roleFromPB(m.GetRole())
	if role == RoleProxy {
		return proxyKey(int(m.GetPosition().GetNode()))
	}
	return memberKey{role: role, id: int(m.GetPosition().GetRank())}
}

func positionOf(m *taskdpb.Member) Position {
	p := Position{Node: int(m.GetPosition().GetNode()), Rank: int(m.GetPosition().GetRank())}
	if roleFromPB(m.GetRole()) == RoleProxy {
		p.Rank = -1
	}
	return p
}

func roleFromPB(r taskdpb.Role) Role {
	switch r {
	case taskdpb.Role_ROLE_MANAGER:
		return RoleManager
	case taskdpb.Role_ROLE_PROXY:
		return RoleProxy
	case taskdpb.Role_ROLE_WORKER:
		return RoleWorker
	}
	return 0
}

func roleToPB(r Role) taskdpb.Role {
	switch r {
	case RoleManager:
		return taskdpb.Role_ROLE_MANAGER
	case RoleProxy:
		return taskdpb.Role_ROLE_PROXY
	case RoleWorker:
		return taskdpb.Role_ROLE_WORKER
	}
	return taskdpb.Role_ROLE_UNSPECIFIED
}

func memberPB(role Role, p Position, instance string) *taskdpb.Member {
	return &taskdpb.Member{Role: roleToPB(role), Position: &taskdpb.Position{Node: int32(p.Node), Rank: int32(p.Rank)}, Instance: instance}
}

// sortedUnique returns the sorted distinct values of v.
func sortedUnique(v []int) []int {
	out := slices.Clone(v)
	slices.Sort(out)
	return slices.Compact(out)
}
