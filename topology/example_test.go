package topology_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/topology"
)

const config = `# asw psw ip
asw-01 psw-1 10.0.0.1
asw-01 psw-1 10.0.0.2
asw-02 psw-1 10.0.0.3
asw-03 psw-2 10.0.1.1
asw-03 psw-2 10.0.1.2
`

func ExampleTopology_Order() {
	topo, err := topology.Parse([]byte(config))
	if err != nil {
		log.Fatal(err)
	}
	// The world in its current rank order: rank 0 is 10.0.0.3.
	world := []string{"10.0.0.3", "10.0.1.1", "10.0.0.1", "192.168.9.9", "10.0.1.2", "10.0.0.2"}
	fmt.Println(topo.Order(world))
	// Output:
	// [10.0.0.3 10.0.0.1 10.0.0.2 10.0.1.1 10.0.1.2 192.168.9.9]
}

func ExampleTopology_FitParallel() {
	topo, err := topology.Parse([]byte(config))
	if err != nil {
		log.Fatal(err)
	}
	world := []string{"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.1.1", "10.0.1.2", "10.0.0.4"}
	// Tensor parallel over 16 ranks = 2 nodes of 8 devices: each pair of
	// nodes shares an ASW where it can; 10.0.0.3 and the unknown 10.0.0.4
	// form the one group that cannot.
	order, err := topo.FitParallel(world, topology.Parallel{DevicesPerNode: 8, TP: 16})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(order)
	// Output:
	// [10.0.0.1 10.0.0.2 10.0.1.1 10.0.1.2 10.0.0.3 10.0.0.4]
}

func ExampleParse_error() {
	_, err := topology.Parse([]byte("asw-01 psw-1 10.0.0.1\nasw-01 psw-1 10.0.0.1\n"))
	fmt.Println(err)
	// Output:
	// topology: node-topology-config: line 2: field ip: value "10.0.0.1": listed twice (first on line 1)
}

func ExampleNewRankTable() {
	topo, err := topology.Parse([]byte(config))
	if err != nil {
		log.Fatal(err)
	}
	hosts := topo.Order([]string{"10.0.1.1", "10.0.0.1"})
	var servers []topology.Server
	for i, h := range hosts {
		servers = append(servers, topology.Server{ID: h, Devices: []topology.Device{
			{ID: 0, IP: fmt.Sprintf("192.168.%d.1", i)},
			{ID: 1, IP: fmt.Sprintf("192.168.%d.2", i)},
		}})
	}
	rt, err := topology.NewRankTable(servers)
	if err != nil {
		log.Fatal(err)
	}
	m, err := rt.HostMapping()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(string(m.Marshal()))
	fmt.Println(rt.Servers[1].Devices[1].Rank)
	// Output:
	// 10.0.1.1 1
	// 10.0.0.1 2
	// 3
}

func ExampleWatcher() {
	dir, _ := os.MkdirTemp("", "topology")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "topology_config") // in production, a mounted ConfigMap key
	os.WriteFile(path, []byte(config), 0o644)

	changed := make(chan *topology.Topology, 1)
	w, err := topology.NewWatcher(topology.WatcherConfig{Path: path, OnChange: func(t *topology.Topology) { changed <- t }})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	go w.Run(context.Background())
	fmt.Println((<-changed).Len(), "nodes")

	// A node under asw-02 joins: the file is replaced, as the kubelet
	// updates a ConfigMap, and the watcher sees it.
	os.WriteFile(path+".new", []byte(config+"asw-02 psw-1 10.0.0.4\n"), 0o644)
	os.Rename(path+".new", path)
	fmt.Println((<-changed).Len(), "nodes")
	// Elsewhere: order the world with the topology in force.
	fmt.Println(w.Topology().Order([]string{"10.0.1.1", "10.0.0.4", "10.0.0.1"}))
	// Output:
	// 5 nodes
	// 6 nodes
	// [10.0.1.1 10.0.0.4 10.0.0.1]
}
