package testkit_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestFabric: two hosts reach each other by their addresses, each has a
// /dev/shm of its own, and a host killed, cut off or replaced behaves as
// a machine would.
func TestFabric(t *testing.T) {
	f := testkit.NewFabric(t, 2)
	a, b := f.Hosts[0], f.Hosts[1]
	out, err := a.Command("sh", "-c", "echo mine > /dev/shm/seg && ls /dev/shm").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "seg" {
		t.Fatalf("host a's /dev/shm: %v %q", err, out)
	}
	if _, err := os.Stat(filepath.Join(a.Shm, "seg")); err != nil {
		t.Fatalf("host a's /dev/shm is not %s: %v", a.Shm, err)
	}
	if out, err := b.Command("ls", "/dev/shm").CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "" {
		t.Fatalf("host b sees %q in its /dev/shm (%v)", out, err)
	}
	if out, err := b.Command("ping", "-c", "1", "-W", "5", a.IP).CombinedOutput(); err != nil {
		t.Fatalf("b cannot reach a at %s: %v\n%s", a.IP, err, out)
	}
	a.LinkDown()
	if err := b.Command("ping", "-c", "1", "-W", "1", a.IP).Run(); err == nil {
		t.Fatal("b reaches a cut off")
	}
	a.LinkUp()
	sleeper := a.Command("sleep", "300")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "the sleeper on a", func() bool { return len(a.Pids()) > 0 })
	a.Kill()
	sleeper.Wait()
	if _, err := os.Stat(filepath.Join(a.Shm, "seg")); err == nil {
		t.Fatal("a killed host's /dev/shm outlived it")
	}
	c := f.AddHost()
	if c.IP == a.IP {
		t.Fatalf("the new host took the old address %s", c.IP)
	}
	if out, err := c.Command("ping", "-c", "1", "-W", "5", b.IP).CombinedOutput(); err != nil {
		t.Fatalf("the new host cannot reach b: %v\n%s", err, out)
	}
}
