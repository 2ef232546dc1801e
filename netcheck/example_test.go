package netcheck_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/faultline-ml/faultline/netcheck"
)

func ExampleChecker() {
	ctx := context.Background()
	// Three nodes, each with an agent; here all on loopback, and node-2's
	// agent is down.
	var nodes []netcheck.Node
	for _, name := range []string{"node-0", "node-1", "node-2"} {
		agent, err := netcheck.NewAgent(netcheck.AgentConfig{Listen: "127.0.0.1:0"})
		if err != nil {
			log.Fatal(err)
		}
		defer agent.Close()
		if name != "node-2" {
			go agent.Run(ctx)
		} else {
			agent.Close()
		}
		nodes = append(nodes, netcheck.Node{Name: name, Addr: agent.Addr().String()})
	}

	c, err := netcheck.NewChecker(netcheck.Config{Prober: &netcheck.TCPProber{Bytes: 1 << 20}})
	if err != nil {
		log.Fatal(err)
	}
	report, err := c.Check(ctx, nodes)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("faulty:", report.Names(netcheck.Faulty))
	// Output: faulty: [node-2]
}

func ExamplePlanner() {
	// n2 cannot be reached, n1 is slow: the probes here are made up, as a
	// test or a simulator would make them. Round 1 tests the suspects of
	// round 0 against known-good peers; round 2 confirms with a second.
	probe := func(p netcheck.Pair) netcheck.Measurement {
		m := netcheck.Measurement{From: p.From, To: p.To, Elapsed: 10 * time.Millisecond}
		switch {
		case p.From == "n2" || p.To == "n2":
			m.Error = "connect: no route to host"
		case p.From == "n1" || p.To == "n1":
			m.Elapsed = 80 * time.Millisecond
		}
		return m
	}
	p, err := netcheck.NewPlanner([]string{"n0", "n1", "n2", "n3", "n4", "n5"}, "", netcheck.Policy{})
	if err != nil {
		log.Fatal(err)
	}
	for round := p.Next(); round != nil; round = p.Next() {
		fmt.Println(round)
		for _, pair := range round {
			p.Record(probe(pair))
		}
	}
	r := p.Report()
	fmt.Println("faulty:", r.Names(netcheck.Faulty), "stragglers:", r.Names(netcheck.Straggler))
	// Output:
	// [n0→n1 n2→n3 n4→n5]
	// [n4→n3 n5→n2]
	// [n3→n1 n4→n0]
	// faulty: [n2] stragglers: [n1]
}

// gpus stands in for an accelerator backend.
type gpus map[netcheck.DevicePair]float64

func (g gpus) ProbeDevices(_ context.Context, a, b int) (float64, error) {
	bw, ok := g[netcheck.DevicePair{A: a, B: b}]
	if !ok {
		return 0, fmt.Errorf("device %d or %d not found", a, b)
	}
	return bw, nil
}

func ExampleSwitchbox() {
	s, err := netcheck.NewSwitchbox(netcheck.SwitchboxConfig{
		Prober: gpus{{A: 0, B: 1}: 24000e6, {A: 2, B: 4}: 23000e6, {A: 3, B: 5}: 800e6},
	})
	if err != nil {
		log.Fatal(err)
	}
	res := s.Check(context.Background())
	fmt.Println(res.Pass, res.Passed)
	for _, p := range res.Pairs {
		if p.Pass {
			fmt.Println(p.Pair, "pass")
		} else {
			fmt.Println(p.Pair, "fail:", p.Error)
		}
	}
	// Output:
	// true 2
	// 0:1 pass
	// 2:4 pass
	// 3:5 fail: 800 MB/s, not above 10000 MB/s
	// 6:7 fail: device 6 or 7 not found
}

func ExampleParseBandwidth() {
	for _, s := range []string{"400Mbit", "50MB", "100mbps"} {
		bps, err := netcheck.ParseBandwidth(s)
		fmt.Println(bps, err)
	}
	// Output:
	// 5e+07 <nil>
	// 5e+07 <nil>
	// 0 netcheck: bandwidth "100mbps": "mbps" is bits to some and bytes to tc: write 100Mbit for megabits or 100MB for megabytes per second
}
