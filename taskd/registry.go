package taskd

import (
	"errors"
	"sort"
	"time"
)

// ErrRankTaken is returned to a member that claims a position another live
// instance holds.
var ErrRankTaken = errors.New("taskd: position is held by another live instance")

// ErrEvicted ends a Worker's Run when recovery evicted its instance: the
// process it stood for was to be restarted or replaced, and a successor
// (a new Worker, with a new instance) takes the rank. An embedder that
// hosts workers for processes it restarts itself builds that successor.
var ErrEvicted = errors.New("taskd: this instance was evicted by recovery; its successor takes the rank")

// ErrPosition ends a Worker's Run when the manager refuses its position
// for good: a node or rank outside the job's shape, or a rank that is not
// of its node (the nodes were given different shapes).
var ErrPosition = errors.New("taskd: the manager refuses this position")

// member is a registered, live member of the tree.
type member struct {
	key      memberKey
	pos      Position
	instance string
	via      int // the proxy's node; -1 when attached to the manager directly
	since    time.Time
	lastSeen time.Time
	hostname string
	pid      int
	addr     string // the peer address the registration came from
	conn     uint64 // the connection it came on (connOf); 0 when unknown
}

// registry holds the live members and decides liveness from heartbeats. It
// is pure: times come from the caller and the caller serialises access.
type registry struct {
	deadline time.Duration
	members  map[memberKey]*member
	counts   map[Role]int // members by role, kept as they come and go
}

func newRegistry(deadline time.Duration) *registry {
	return &registry{deadline: deadline, members: make(map[memberKey]*member), counts: make(map[Role]int)}
}

// register records m as live at now. A different instance may not take a
// position whose holder was heard from within the deadline. It reports
// whether m is new (not a reconnect of the live holder).
func (r *registry) register(m member, now time.Time) (fresh bool, err error) {
	old := r.members[m.key]
	if old != nil && old.instance != m.instance && now.Sub(old.lastSeen) <= r.deadline {
		return false, ErrRankTaken
	}
	m.lastSeen = now
	m.since = now
	if old != nil && old.instance == m.instance {
		m.since = old.since
		if old.lastSeen.After(now) {
			m.lastSeen = old.lastSeen
		}
	}
	r.members[m.key] = &m
	if old == nil {
		r.counts[m.key.role]++
	}
	return old == nil || old.instance != m.instance, nil
}

// beat records that k (as instance) was heard from at seen, which is
// never later than now. It reports false when k is not live under that
// instance and must register again.
func (r *registry) beat(k memberKey, instance string, seen, now time.Time) bool {
	m := r.members[k]
	if m == nil || m.instance != instance {
		return false
	}
	if seen.After(now) {
		seen = now
	}
	if seen.After(m.lastSeen) {
		m.lastSeen = seen
	}
	return true
}

// get returns the live member at k, or nil.
func (r *registry) get(k memberKey) *member { return r.members[k] }

// remove drops k if instance still holds it.
func (r *registry) remove(k memberKey, instance string) {
	if m := r.members[k]; m != nil && m.instance == instance {
		delete(r.members, k)
		r.counts[k.role]--
	}
}

// expire removes and returns, in key order, the members not heard from
// within the deadline before now.
func (r *registry) expire(now time.Time) []member {
	var lost []member
	for k, m := range r.members {
		if now.Sub(m.lastSeen) > r.deadline {
			lost = append(lost, *m)
			delete(r.members, k)
			r.counts[k.role]--
		}
	}
	sortMembers(lost)
	return lost
}

// list returns the live members in key order.
func (r *registry) list() []member {
	out := make([]member, 0, len(r.members))
	for _, m := range r.members {
		out = append(out, *m)
	}
	sortMembers(out)
	return out
}

// count returns how many members of role are live, in O(1).
func (r *registry) count(role Role) int { return r.counts[role] }

func sortMembers(ms []member) {
	sort.Slice(ms, func(i, j int) bool {
		a, b := ms[i].key, ms[j].key
		if a.role != b.role {
			return a.role < b.role
		}
		return a.id < b.id
	})
}

// sameConn reports whether m and nm came on the same connection: whoever
// holds it is the member that registered on it.
func (m *member) sameConn(nm member) bool { return m.conn != 0 && m.conn == nm.conn }
