package testkit_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func TestMain(m *testing.M) {
	if testkit.Role() == "echo" {
		fmt.Println("ready", os.Getenv("WORD"))
		select {} // until killed
	}
	goleak.VerifyTestMain(m)
}

// TestChild runs this binary again as a child that says a word, reads the
// word, and leaves the child to be killed when the test ends.
func TestChild(t *testing.T) {
	lines := testkit.Start(t, testkit.Command(t, "echo", "WORD=hello"))
	if l := testkit.WaitLine(t, lines, "ready"); l != "ready hello" {
		t.Fatalf("line %q", l)
	}
	n := 0
	testkit.WaitFor(t, "the third poll", func() bool { n++; return n == 3 })
}

// TestOutput: a child's output, written in pieces, is waited for from a
// point on, and a line before that point does not count.
func TestOutput(t *testing.T) {
	out := testkit.NewOutput("child", false)
	cmd := testkit.Command(t, "echo", "WORD=one")
	cmd.Stdout = out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if i := out.Wait(t, 0, "ready", testkit.Deadline); out.From(i)[0] != "ready one" {
		t.Fatalf("lines %q", out.From(0))
	}
	from := out.Len()
	fmt.Fprint(out, "rea")
	fmt.Fprint(out, "dy two\nlast")
	if i := out.Wait(t, from, "ready", testkit.Deadline); i != from || out.From(i)[0] != "ready two" {
		t.Fatalf("line %d of %q, want %d", i, out.From(0), from)
	}
	if out.Len() != from+1 {
		t.Fatalf("the partial last line counted: %q", out.From(0))
	}
	if s := out.String(); !strings.HasSuffix(s, "ready two\nlast") {
		t.Fatalf("String = %q, want the lines and the partial last one", s)
	}
}
