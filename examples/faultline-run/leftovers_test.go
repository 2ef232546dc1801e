package main

import (
	"os"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestMain fails the package's tests when a job they ran left its
// checkpoint segments or dotting rings in /dev/shm: a job that ends gives
// them back, unless it keeps them for a resume on purpose, which a test
// then removes.
func TestMain(m *testing.M) { os.Exit(testkit.RunNoShmLeftovers(m, "faultline-")) }
