package testkit_test

import (
	"fmt"
	"os"
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
