package trainertest_test

import (
	"os"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if role := testkit.Role(); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// heavy reports whether the heavier variants run (TASKD_HEAVY=1).
func heavy() bool { return os.Getenv("TASKD_HEAVY") != "" }
