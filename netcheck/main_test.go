package netcheck

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// The network tests run this binary as the agent of each host.
	if addr := os.Getenv(agentEnv); addr != "" {
		os.Exit(runTestAgent(addr))
	}
	if req := os.Getenv(checkerEnv); req != "" {
		os.Exit(runTestChecker(req))
	}
	goleak.VerifyTestMain(m)
}
