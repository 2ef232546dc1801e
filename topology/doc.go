// Package topology orders a training job's ranks by the switches its nodes
// hang from, and reads and writes the rank tables that collective
// communication libraries start from.
//
// A cluster's wiring comes as DLRover's node-topology-config: one line per
// node naming its access switch (ASW), the pod switch above it (PSW) and its
// IP, usually a ConfigMap mounted into the job's pods:
//
//	# asw    psw    ip
//	asw-01 psw-1 10.0.0.1
//	asw-01 psw-1 10.0.0.2
//	asw-02 psw-1 10.0.0.3
//
// Parse and ReadFile read it, with errors naming the line; a Watcher keeps
// it loaded as it changes (inotify on the directory, so that the kubelet's
// "..data" symlink swap is seen, with polling as a fallback) and keeps the
// last good version in force when a bad one arrives.
//
// Topology.Order reorders a world (node addresses in rank order) so that
// the nodes under one ASW are contiguous, rank 0's ASW first, and the ASWs
// under one PSW adjacent: ring and tree collectives between neighbouring
// ranks then cross as few switches as possible. It is pure, stable and keeps
// node identity: it permutes the world and never renames a node.
// Topology.FitParallel does the same and also fits tensor-parallel groups,
// then pipeline stages, under single ASWs wherever the ASW sizes allow.
//
// RankTable is hccl.json, version 1.0 (server_list, device, rank_id): it is
// generated from an ordering (NewRankTable, RankTable.Reorder), validated,
// and parsed and marshalled symmetrically. HostMapping is the
// host_ips_mapping.txt that anonymises hosts in cluster profiling data.
//
// This package imports no other faultline package; netcheck takes the order
// it makes as a plain []string.
//
// Example:
//
//	topo, err := topology.ReadFile("/etc/topology/topology_config")
//	if err != nil {
//		return err
//	}
//	world := []string{"10.0.0.3", "10.0.0.1", "10.0.0.2"} // rank order
//	world = topo.Order(world) // 10.0.0.3 keeps rank 0; asw-01 follows
package topology
