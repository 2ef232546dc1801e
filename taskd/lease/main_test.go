package lease

import (
	"os"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// The process tests run this binary again as a candidate that they
	// SIGKILL.
	if testkit.Role() != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m)
}
