package netcheck

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func TestMain(m *testing.M) {
	// The network tests run this binary as the agent of each host, and as
	// a checker beside one.
	switch testkit.Role() {
	case "agent":
		os.Exit(runTestAgent(os.Getenv(agentEnv)))
	case "checker":
		os.Exit(runTestChecker(os.Getenv(checkerEnv)))
	}
	goleak.VerifyTestMain(m)
}
