// Package freeport finds TCP ports that a program may bind a moment
// later: a run of ports, free on every address, taken at random from
// outside the kernel's ephemeral range and its reserved ports. A port the kernel hands out for ":0" is one it
// may give to any outgoing connection of any process as soon as the
// listener closes, so a program that checks it and binds it later (a
// launcher that passes a port to its children, a test that starts a
// server in another process) loses it now and then; outside that range
// only another program that binds ports by number can take it.
//
//	port, err := freeport.Find(2) // the ranks' store and the manager
//	if err != nil {
//		return err
//	}
//	cmd := exec.Command("faultline-run", "--master-port", strconv.Itoa(port), ...)
package freeport
