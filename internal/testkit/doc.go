// Package testkit is what the tests of several packages share: running
// the test binary again as a child process in a role, reading its output
// line by line (Output keeps it, across restarts, for waiting from a
// point on), waiting for what other processes bring about, opening a
// page in headless Chromium, comparing output with golden files (-update
// rewrites them), and checking the Registerer contract of a metered type.
// It is imported by tests only.
//
// A package whose tests run children:
//
//	func TestMain(m *testing.M) {
//		if role := testkit.Role(); role != "" {
//			os.Exit(runChild(role)) // the child's body
//		}
//		goleak.VerifyTestMain(m)
//	}
//
//	func TestKilled(t *testing.T) {
//		cmd := testkit.Command(t, "writer", "DIR="+t.TempDir())
//		lines := testkit.Start(t, cmd)
//		testkit.WaitLine(t, lines, "ready")
//		cmd.Process.Kill()
//		...
//	}
package testkit
