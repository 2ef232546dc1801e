package trace

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func rec(flag Flag, src uint32, id, ts uint64, name, dom string) *Record {
	return &Record{Kind: 1, Flag: flag, SourceKind: src, ID: id, Timestamp: ts, Name: name, Domain: dom}
}

// footprint returns the names a Pairer keeps and the most entries any of
// its tables and slabs has room for.
func footprint(p *Pairer) (names, held int) {
	return p.names.n, max(cap(p.starts), len(p.open.slots)/2, len(p.names.ents), len(p.names.index.slots)/2)
}

func TestPairerBasics(t *testing.T) {
	var p Pairer
	add := func(r *Record) (Range, bool) { return p.Add(r) }
	if _, ok := add(rec(FlagHostEnd, 0, 9, 5, "", "")); ok {
		t.Fatal("an end without a start made a range")
	}
	add(rec(FlagDeviceStart, 0, 1, 10, "forward", DomainDefault))
	add(rec(FlagDeviceStart, 0, 2, 11, "step 3", DomainDefault))
	r, ok := add(rec(FlagDeviceEnd, 0, 1, 20, "", ""))
	if !ok || r.Name != "forward" || r.Start != 10 || r.End != 20 || r.Duration() != 10 {
		t.Fatalf("range %+v, %v", r, ok)
	}
	r, ok = add(rec(FlagInstant, 0, 3, 15, "save_checkpoint", DomainDefault))
	if !ok || r.Start != r.End || r.Name != "save_checkpoint" {
		t.Fatalf("instant %+v, %v", r, ok)
	}
	if _, ok := add(rec(0, 0, 4, 1, "", "")); ok {
		t.Fatal("a record without flags made a range")
	}
	want := PairerStats{Ranges: 1, Instants: 1, UnmatchedEnds: 1, Ignored: 1, Open: 1}
	if diff := cmp.Diff(want, p.Stats()); diff != "" {
		t.Fatalf("stats (-want +got):\n%s", diff)
	}
}

func TestPairerBounded(t *testing.T) {
	p := Pairer{MaxOpen: 100}
	for i := range uint64(1000) {
		p.Add(rec(FlagHostStart, 0, i, i, "x", DomainDefault))
	}
	s := p.Stats()
	if s.Open != 100 || s.Evicted != 900 {
		t.Fatalf("stats %+v", s)
	}
	// The newest 100 are still open.
	if _, ok := p.Add(rec(FlagHostEnd, 0, 999, 2000, "", "")); !ok {
		t.Fatal("newest start was evicted")
	}
	if _, ok := p.Add(rec(FlagHostEnd, 0, 0, 2000, "", "")); ok {
		t.Fatal("oldest start was kept")
	}
	if names, held := footprint(&p); names > 100 || held > 2*p.Stats().Open+1024 {
		t.Fatalf("memory not bounded: %d names, %d entries held", names, held)
	}
	// A long stream of starts whose ends never come: what the pairer
	// holds, consumed queue heads included, stays bounded.
	for i := range uint64(200000) {
		p.Add(rec(FlagHostStart, 0, 10000+i, i, "x", DomainDefault))
	}
	if _, held := footprint(&p); held > 8*100+4096 {
		t.Fatalf("memory not bounded: %d entries held for %d open starts", held, p.Stats().Open)
	}
}

// TestPairerProperty interleaves many nested ranges at random, some with
// their ends lost, against a model of the pairer: ranges come back once
// with their bounds, the oldest starts beyond MaxOpen are evicted, and
// memory stays bounded.
// TestPairerAddTo checks that AddTo gives what Add returns, and leaves
// *r as it was where it reports false.
func TestPairerAddTo(t *testing.T) {
	recs := []*Record{
		rec(FlagHostEnd, SourceKindHost, 9, 5, "", ""),
		rec(FlagHostStart, SourceKindHost, 1, 10, "forward", DomainDefault),
		rec(FlagDeviceStart, SourceKindDevice, 1, 11, "", ""),
		rec(FlagHostEnd, SourceKindHost, 1, 20, "", ""),
		rec(FlagDeviceEnd, SourceKindDevice, 1, 21, "", ""),
		rec(FlagInstant, SourceKindHost, 3, 15, "save_checkpoint", DomainDefault),
		rec(0, 0, 4, 1, "", ""),
	}
	var a, b Pairer
	stale := Range{Name: "stale", Domain: "stale", ID: 77, Start: 1, End: 2, ProcessID: 3, SourceKind: 1}
	for i, rc := range recs {
		want, wantOK := a.Add(rc)
		got := stale
		ok := b.AddTo(rc, &got)
		if !wantOK {
			want = stale
		}
		if ok != wantOK || got != want {
			t.Errorf("record %d: AddTo gave %+v, %v; Add %+v, %v", i, got, ok, want, wantOK)
		}
	}
	if diff := cmp.Diff(a.Stats(), b.Stats()); diff != "" {
		t.Errorf("stats (-Add +AddTo):\n%s", diff)
	}
}

func TestPairerProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 60 {
		// Bounds below, at and above smallOpen: starts found by walking
		// them and by the table, evicted from either.
		maxOpen := []int{3, smallOpen, 64}[trial%3]
		p := Pairer{MaxOpen: maxOpen}
		type span struct{ Start, End uint64 }
		want, got := map[uint64]span{}, map[uint64]span{}
		starts := map[uint64]uint64{}
		var live []uint64       // started, end still to come (or lost)
		var pairerOpen []uint64 // what the pairer holds, oldest first
		var ts, next, evicted, unmatched uint64
		for range 3000 {
			ts++
			if len(live) > 0 && rng.IntN(2) == 0 {
				i := rng.IntN(len(live))
				id := live[i]
				live = append(live[:i], live[i+1:]...)
				if rng.IntN(10) == 0 {
					continue // the end is lost
				}
				if j := slices.Index(pairerOpen, id); j >= 0 {
					pairerOpen = append(pairerOpen[:j], pairerOpen[j+1:]...)
					want[id] = span{starts[id], ts}
				} else {
					unmatched++
				}
				if r, ok := p.Add(rec(FlagDeviceEnd, 0, id, ts, "", "")); ok {
					if _, dup := got[id]; dup {
						t.Fatalf("trial %d: id %d returned twice", trial, id)
					}
					got[id] = span{r.Start, r.End}
				}
				continue
			}
			next++
			live = append(live, next)
			starts[next] = ts
			pairerOpen = append(pairerOpen, next)
			if len(pairerOpen) > maxOpen {
				pairerOpen = pairerOpen[1:]
				evicted++
			}
			p.Add(rec(FlagDeviceStart, 0, next, ts, "r", DomainDefault))
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("trial %d: ranges (-want +got):\n%s", trial, diff)
		}
		st := p.Stats()
		if st.Evicted != evicted || st.UnmatchedEnds != unmatched || st.Open != len(pairerOpen) {
			t.Fatalf("trial %d: stats %+v, model: %d evicted, %d unmatched, %d open", trial, st, evicted, unmatched, len(pairerOpen))
		}
		if names, held := footprint(&p); held > 2*st.Open+1024 || names > maxOpen {
			t.Fatalf("trial %d: %d entries held, %d names", trial, held, names)
		}
	}
}

func TestKindOf(t *testing.T) {
	for _, tt := range []struct {
		name, dom string
		k         Kind
		ok        bool
	}{
		{"step 7", DomainDefault, Step, true},
		{MarkerForward, DomainDefault, FP, true},
		{MarkerDataLoader, DomainDefault, DataLoader, true},
		{MarkerSaveCheckpoint, DomainDefault, SaveCheckpoint, true},
		{`{"opName":"HcclSend"}`, DomainCommunication, CommunicationOperator, true},
		{"backward", DomainDefault, 0, false},
	} {
		if k, ok := KindOf(tt.name, tt.dom); k != tt.k || ok != tt.ok {
			t.Errorf("KindOf(%q, %q) = %v, %v", tt.name, tt.dom, k, ok)
		}
	}
	if _, ok := (Range{Name: "step x"}).Step(); ok {
		t.Error(`Step() of "step x"`)
	}
}

// TestPairerNamesProperty pairs host ranges, named, with device twins,
// unnamed, that come before, during or long after them, against a model:
// a twin takes the name of its Id while that name is among the MaxOpen
// latest ones.
func TestPairerNamesProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 60 {
		maxOpen := [...]int{16, 36, nameRingMinSize + 40}[trial%3] // some rings grow after they are indexed
		p := Pairer{MaxOpen: maxOpen}
		var named []uint64 // the model: named Ids, oldest first, at most maxOpen
		lookup := func(id uint64) string {
			if slices.Contains(named, id) {
				return fmt.Sprint("n", id)
			}
			return ""
		}
		name := func(id uint64) {
			p.Add(rec(FlagHostStart, SourceKindHost, id, id, fmt.Sprint("n", id), DomainDefault))
			if named = append(named, id); len(named) > maxOpen {
				named = named[1:]
			}
			if r, ok := p.Add(rec(FlagHostEnd, SourceKindHost, id, id+1, "", "")); !ok || r.Name != fmt.Sprint("n", id) {
				t.Fatalf("trial %d: host range %d: %+v, %v", trial, id, r, ok)
			}
		}
		var twins []uint64 // named Ids whose device twin is still to come
		var next uint64
		for step := range 2000 {
			next++
			k := rng.IntN(4)
			if trial%2 == 1 && step < 3*maxOpen {
				k = 2 // the ring fills, and wraps, before any name is asked for
			}
			switch {
			case k == 0 && len(twins) > 0:
				// A twin after its host range, maybe long after.
				i := rng.IntN(len(twins))
				id := twins[i]
				twins = append(twins[:i], twins[i+1:]...)
				want := lookup(id)
				p.Add(rec(FlagDeviceStart, SourceKindDevice, id, id, "", ""))
				if r, ok := p.Add(rec(FlagDeviceEnd, SourceKindDevice, id, id+2, "", "")); !ok || r.Name != want {
					t.Fatalf("trial %d step %d: twin %d named %q, want %q", trial, step, id, r.Name, want)
				}
			case k == 1:
				// A twin that starts before its host range and ends after it.
				p.Add(rec(FlagDeviceStart, SourceKindDevice, next, next, "", ""))
				name(next)
				if r, ok := p.Add(rec(FlagDeviceEnd, SourceKindDevice, next, next+2, "", "")); !ok || r.Name != lookup(next) {
					t.Fatalf("trial %d step %d: early twin %d named %q", trial, step, next, r.Name)
				}
			default:
				name(next)
				if rng.IntN(2) == 0 {
					twins = append(twins, next)
				}
			}
		}
		if names, held := footprint(&p); names > maxOpen || held > 4*maxOpen {
			t.Fatalf("trial %d: %d names, %d entries held", trial, names, held)
		}
	}
}
