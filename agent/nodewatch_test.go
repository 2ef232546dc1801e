package agent

import (
	"strings"
	"testing"
	"time"
)

// TestNodeWatch feeds the node's watch what its workers see, second by
// second, and checks what it decides: time comes in, nothing sleeps.
func TestNodeWatch(t *testing.T) {
	const (
		nodeTimeout = 30 * time.Second
		heartbeat   = 10 * time.Second
	)
	type seen struct {
		at        time.Duration // since the start
		connected bool
		taken     bool
		helloOK   bool   // what sending the hello gives, when asked
		want      string // the actions, by kind, "" for none
		why       string // a part of the last action's why
	}
	names := map[nodeActionKind]string{nodeHelloAction: "hello", nodeWarnAction: "warn", nodeGiveUpAction: "give up", nodeFencedAction: "fenced"}
	for _, tc := range []struct {
		name  string
		ticks []seen
	}{
		{"joins and says hello once", []seen{
			{at: 0},
			{at: time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 2 * time.Second, connected: true},
			{at: 60 * time.Second, connected: true},
		}},
		{"a hello that did not go is sent again", []seen{
			{at: time.Second, connected: true, helloOK: false, want: "hello"},
			{at: 2 * time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 3 * time.Second, connected: true},
		}},
		{"a manager that took over hears the hello again", []seen{
			{at: time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 2 * time.Second},
			{at: 3 * time.Second, connected: true, helloOK: true, want: "hello"},
		}},
		{"not yet joined, it waits as long as for the store", []seen{
			{at: 11 * time.Second, want: "warn", why: "waits up to 2m0s, as long as node 0's store may take to start (--node-timeout 30s)"},
			{at: 31 * time.Second},
			{at: storeTimeout},
			{at: storeTimeout + time.Second, want: "fenced", why: "node 1 has not reached the job's manager for 2m1s (--node-timeout 30s)"},
		}},
		{"joined, then apart past --node-timeout: it gives up", []seen{
			{at: time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 5 * time.Second, connected: true},
			{at: 6 * time.Second},
			{at: 15 * time.Second},
			{at: 16 * time.Second, want: "warn", why: "for 11s; it waits up to 30s"},
			{at: 20 * time.Second},
			{at: 35 * time.Second},
			{at: 36 * time.Second, want: "give up", why: "for 31s (--node-timeout 30s): node 0, which runs it, is lost"},
		}},
		{"apart for less than the timeout, it goes on and is warned about again later", []seen{
			{at: time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 12 * time.Second, want: "warn"},
			{at: 13 * time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 40 * time.Second, connected: true},
			{at: 51 * time.Second, want: "warn"},
		}},
		{"its ranks held by another agent past a heartbeat deadline: fenced", []seen{
			{at: time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 2 * time.Second, connected: true, taken: true},
			{at: 12 * time.Second, connected: true, taken: true},
			{at: 13 * time.Second, connected: true, taken: true, want: "fenced", why: "node 1 was replaced: another agent's workers have held its ranks for 11s"},
		}},
		{"a replacement come before the node it replaces was declared lost waits for that", []seen{
			{at: time.Second, taken: true},
			{at: 12 * time.Second, taken: true, want: "warn"},
			{at: 60 * time.Second, taken: true},
			{at: 61 * time.Second, connected: true, helloOK: true, want: "hello"},
		}},
		{"a live node's duplicate ends, touching nothing", []seen{
			{at: time.Second, taken: true},
			{at: 12 * time.Second, taken: true, want: "warn", why: "another node's workers hold its ranks"},
			{at: storeTimeout + time.Second, taken: true, want: "fenced", why: "node 1 has not joined the job for 2m1s (--node-timeout 30s): another live node's workers hold its ranks"},
		}},
		{"a registration racing its reconnection is not a fence", []seen{
			{at: time.Second, connected: true, helloOK: true, want: "hello"},
			{at: 2 * time.Second, connected: true, taken: true},
			{at: 3 * time.Second, connected: true},
			{at: 4 * time.Second, connected: true, taken: true},
			{at: 13 * time.Second, connected: true, taken: true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Unix(1_000_000, 0)
			w := newNodeWatch("node 1", nodeTimeout, heartbeat, start)
			for _, s := range tc.ticks {
				acts := w.tick(start.Add(s.at), s.connected, s.taken)
				var got []string
				for _, a := range acts {
					got = append(got, names[a.kind])
					if a.kind == nodeHelloAction {
						w.helloSent(s.helloOK)
					}
				}
				if g := strings.Join(got, ", "); g != s.want {
					t.Fatalf("at %v (connected %v, taken %v): actions %q, want %q", s.at, s.connected, s.taken, g, s.want)
				}
				if s.why != "" && !strings.Contains(acts[len(acts)-1].why, s.why) {
					t.Fatalf("at %v: %q, want it to say %q", s.at, acts[len(acts)-1].why, s.why)
				}
			}
		})
	}
}
