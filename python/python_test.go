package python_test

import (
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/python"
)

// pythonBin is the interpreter the tests use: Debian's, which has torch
// (python3-torch); the python3 first on PATH may be another without it.
const pythonBin = "/usr/bin/python3"

// requirePython skips the test unless pythonBin exists and, with torch,
// can import torch; it returns pythonBin.
func requirePython(t testing.TB, torch bool) string {
	t.Helper()
	if _, err := os.Stat(pythonBin); err != nil {
		t.Skipf("%s not found: install the Debian package python3-torch (it brings python3 and torch)", pythonBin)
	}
	if torch {
		check := exec.Command(pythonBin, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)")
		if err := check.Run(); err != nil {
			t.Skipf("%s cannot import torch: install the Debian package python3-torch", pythonBin)
		}
	}
	return pythonBin
}

// extracted extracts the package for a test and returns its folder.
func extracted(t testing.TB) string {
	t.Helper()
	dir, err := python.Extract(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// pyEnv is the environment of a Python process that imports the package
// from dir.
func pyEnv(dir string, extra ...string) []string {
	env := []string{"PYTHONPATH=" + dir, "PYTHONDONTWRITEBYTECODE=1"}
	for _, kv := range os.Environ() {
		switch {
		case len(kv) > 10 && kv[:10] == "PYTHONPATH", len(kv) > 10 && kv[:10] == "FAULTLINE_":
		default:
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}

// track reads the files under dir (or the file dir) that a Python child
// will read, so that go test's cache knows them: it records the files the
// test process itself opens, not its children's.
func track(t testing.TB, dir string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			_, err = os.ReadFile(p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestPythonUnitTests runs python/tests against the extracted package, in
// one interpreter (importing torch costs seconds per process).
func TestPythonUnitTests(t *testing.T) {
	py := requirePython(t, true)
	tests, err := filepath.Abs("tests")
	if err != nil {
		t.Fatal(err)
	}
	track(t, tests)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "-m", "unittest", "discover", "-s", tests, "-t", tests)
	cmd.Dir = tests
	cmd.Env = pyEnv(extracted(t))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python unit tests: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}
