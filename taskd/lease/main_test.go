package lease

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// The process tests run this binary again as a candidate that they
	// SIGKILL.
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m)
}
