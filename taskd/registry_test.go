package taskd

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestRegistryLiveness(t *testing.T) {
	r := newRegistry(5 * time.Second)
	w := member{key: workerKey(3), pos: Position{Node: 0, Rank: 3}, instance: "a", via: 0}
	if fresh, err := r.register(w, t0); err != nil || !fresh {
		t.Fatalf("register: fresh=%v err=%v", fresh, err)
	}
	// A reconnect of the same instance is not fresh and keeps its episode.
	if fresh, err := r.register(w, t0.Add(time.Second)); err != nil || fresh {
		t.Fatalf("reconnect: fresh=%v err=%v", fresh, err)
	}
	// Another instance may not take the live rank...
	imp := w
	imp.instance = "b"
	if _, err := r.register(imp, t0.Add(2*time.Second)); !errors.Is(err, ErrRankTaken) {
		t.Fatalf("impersonation: %v, want ErrRankTaken", err)
	}
	if !r.beat(w.key, "a", t0.Add(4*time.Second), t0.Add(4*time.Second)) {
		t.Fatal("beat of the holder refused")
	}
	if r.beat(w.key, "b", t0.Add(4*time.Second), t0.Add(4*time.Second)) {
		t.Fatal("beat of a stranger accepted")
	}
	// A beat stamped in the past (relayed with its age) never moves time back.
	r.beat(w.key, "a", t0.Add(3*time.Second), t0.Add(4*time.Second))
	// Nor past now.
	r.beat(w.key, "a", t0.Add(time.Hour), t0.Add(4*time.Second))
	if lost := r.expire(t0.Add(9 * time.Second)); len(lost) != 0 {
		t.Fatalf("lost before the deadline: %v", lost)
	}
	lost := r.expire(t0.Add(9*time.Second + time.Millisecond))
	if len(lost) != 1 || lost[0].key != w.key || !lost[0].since.Equal(t0) {
		t.Fatalf("expire: %+v", lost)
	}
	// ...but takes it once the holder is lost (a restarted process).
	if fresh, err := r.register(imp, t0.Add(10*time.Second)); err != nil || !fresh {
		t.Fatalf("after loss: fresh=%v err=%v", fresh, err)
	}
	// A holder silent past the deadline but not yet expired yields too.
	if _, err := r.register(w, t0.Add(16*time.Second)); err != nil {
		t.Fatalf("takeover after silence: %v", err)
	}
}

func TestRegistryListOrder(t *testing.T) {
	r := newRegistry(time.Second)
	for _, k := range []memberKey{workerKey(2), proxyKey(1), workerKey(0), proxyKey(0)} {
		r.register(member{key: k, instance: "x"}, t0)
	}
	var got []memberKey
	for _, m := range r.list() {
		got = append(got, m.key)
	}
	want := []memberKey{proxyKey(0), proxyKey(1), workerKey(0), workerKey(2)}
	if d := cmp.Diff(want, got, cmp.AllowUnexported(memberKey{})); d != "" {
		t.Fatal(d)
	}
	if r.count(RoleWorker) != 2 || r.count(RoleProxy) != 2 {
		t.Fatal("count")
	}
}
