package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRootCause: rank 1 ends its connections and exits 7 a moment
// later; rank 0's all-reduce fails first, naming rank 1's address: its
// end of their connection, or (when rank 1 made the connection, now and
// then) the address it listened on for it, which it no longer holds,
// and then their connection's closed end names it. The incident and the
// final message blame rank 1, and the incident says which evidence
// chose it.
func TestRootCause(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--no-spares"},
		filepath.Join("testdata", "blame.py"))
	if err := j.wait(2 * time.Minute); err == nil {
		t.Fatalf("faultline-run ended well; want the job stopped\n%s", j.errText())
	}
	in := j.incidents()
	if len(in) != 1 {
		t.Fatalf("incidents: %+v", in)
	}
	c := in[0]
	t.Logf("incident: %s: %s", c.Fault.Message, c.Evidence)
	if c.Fault.Rank != 1 || !strings.Contains(c.Evidence, "a socket of rank 1") && !strings.Contains(c.Evidence, "only rank 1's end (port ") {
		t.Errorf("the incident blames %+v, by %q; want rank 1, by the address rank 0's error names", c.Fault, c.Evidence)
	}
	if !strings.Contains(j.errText(), "incident 1: rank 1") || !strings.Contains(j.errText(), "the last fault: rank 1") {
		t.Errorf("the final message does not blame rank 1:\n%s", j.errText())
	}
}
