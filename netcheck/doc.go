// Package netcheck finds the node whose network is broken or slow: it
// probes nodes in pairs, localises faults from the results, and reports
// each node healthy, faulty, straggler or unknown, with the evidence.
//
// A node runs an Agent, a TCP endpoint. A Checker, anywhere that reaches
// the agents, runs rounds of probes: for each pair it asks one node's agent
// to measure round trips and a bounded transfer each way to the other's
// (TCPProber); every probe has a deadline. The Prober interface lets a
// vendor add device probes (a matrix multiply and an all-gather on real
// accelerators) in place of TCP.
//
// Which pairs to probe is decided by a Planner, pure logic with no I/O, no
// clock and no goroutines, driven one round at a time (Next, Record,
// Report), so that it is tested deterministically over many simulated
// fault sets. Round 0 pairs neighbours in the order given (pass the order
// that package topology makes, so neighbours share a switch); round 1
// pairs the slowest with the fastest, as DLRover does; later rounds test
// each remaining suspect against known-good peers only, so that k bad nodes
// among N cost O(k) probes beyond round 0 (at most 3k+2 in the property
// tests). A failed probe counts as the probe timeout; a node is blamed only
// when it failed, or was slow, against two healthy peers (ConfirmPeers),
// and a healthy node is never blamed while probes are consistent.
//
// A probe is slow when it took more than StragglerRatio (2) times the
// median of the nodes' best times, or falls below an absolute floor
// (MinBandwidth, MaxRTT). A node that is only ever slow is a straggler; one
// whose probes with healthy peers fail is faulty. A probe that its deadline
// cuts short is judged by the rate of what it moved, so a link too slow to
// finish is a straggler with its figure; only one that moves nothing fails.
//
// Speeds are relative, so they need a baseline: probes that show what a
// healthy link does. While every completed probe involves one participant
// (two nodes alone, or a star around one), that one may be slow and drag
// every probe down alike; no node is then called healthy, only unknown,
// and the report's notes say why. A bandwidth floor is a baseline of its
// own. The checker itself takes part as a reference, which settles the two-
// and three-node cases where DLRover fails every node: a reference needs a
// link at least as fast as the nodes', off every node's host. On a node's
// host its probes would only measure that node's link again, and its probe
// to the agent beside it, over loopback, would be a baseline that no real
// link meets; so a checker that finds a node's agent address among its
// host's own takes no part, and says so. Slow and failed probes that no
// verdict explains (a bad link between healthy nodes, or links below a
// floor that every link misses) are listed in Report.Links.
//
// Switchbox checks the device links inside one node as mxDlrover's
// --switchbox-check does: pairs "0:1 2:4 3:5 6:7", a pair passes above
// 10000 MB/s, the node passes with two passing pairs, all within 10 s; the
// pair probe is the DeviceProber interface.
//
// Results are a Report (JSON with Marshal and ParseReport, text with
// WriteText); metrics go to an injected prometheus.Registerer (a Checker,
// Agent or Switchbox registers its own until Close, and a Registerer that
// another one uses is a constructor error) and traces to an injected
// TracerProvider. This package imports no other faultline package.
//
// The tests build hosts as network namespaces on a bridge, degrade links
// with tc (tbf, netem) and cut them; they need root and iproute2 and skip
// otherwise. FAULTLINE_NETCHECK_HEAVY=1 adds bigger clusters.
//
// Example:
//
//	// On every node:
//	agent, err := netcheck.NewAgent(netcheck.AgentConfig{Listen: ":9700"})
//	...
//	go agent.Run(ctx)
//
//	// Anywhere that reaches the agents; off their hosts, the checker is
//	// also the reference:
//	c, err := netcheck.NewChecker(netcheck.Config{})
//	...
//	defer c.Close()
//	report, err := c.Check(ctx, []netcheck.Node{{Name: "node-0", Addr: "10.0.0.1:9700"}, ...})
//	fmt.Println(report.Bad())   // the faulty and straggling nodes
//	fmt.Println(report.Notes)   // what limited the check, if anything
package netcheck
