package python_test

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/faultline-ml/faultline/python"
)

func TestPackageHoldsEveryModule(t *testing.T) {
	want := map[string]bool{}
	src, err := filepath.Glob("faultline/*.py")
	if err != nil || len(src) == 0 {
		t.Fatalf("glob faultline/*.py: %v, %v", src, err)
	}
	for _, p := range src {
		want[filepath.ToSlash(p)] = true
	}
	got := map[string]bool{}
	fs.WalkDir(python.Package, ".", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			got[p] = true
		}
		return err
	})
	for p := range want {
		if !got[p] {
			t.Errorf("%s is not embedded", p)
		}
	}
	for p := range got {
		if !want[p] {
			t.Errorf("%s is embedded but not a module of the package", p)
		}
	}
	if !got["faultline/__init__.py"] || !got["faultline/_ring.py"] {
		t.Errorf("embedded: %v", got)
	}
}

func TestExtractIsIdempotentAndKeyedByContent(t *testing.T) {
	dir := t.TempDir()
	a, err := python.Extract(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(filepath.Base(a), "faultline-python-") || filepath.Dir(a) != dir {
		t.Fatalf("extracted into %s", a)
	}
	st, err := os.Stat(filepath.Join(a, "faultline", "torch.py"))
	if err != nil || st.Mode().Perm() != 0o644 {
		t.Fatalf("torch.py: %v, %v", st, err)
	}
	b, err := python.Extract(dir)
	if err != nil || b != a {
		t.Fatalf("second Extract = %q, %v; want %q", b, err, a)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("%d entries in %s, want the package folder only", len(entries), dir)
	}

	// A folder that does not hold the package is named, and left alone.
	if err := os.WriteFile(filepath.Join(a, "faultline", "_ring.py"), []byte("# edited\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := python.Extract(dir); err == nil || !strings.Contains(err.Error(), "_ring.py") {
		t.Fatalf("Extract over an edited package = %v, want an error naming _ring.py", err)
	}
}

// Launchers extracting at once, in goroutines and in processes, all get
// the same complete folder and leave no temporary folder behind.
func TestExtractConcurrently(t *testing.T) {
	dir := t.TempDir()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	got := make([]string, 8)
	errs := make([]error, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				got[i], errs[i] = python.Extract(dir)
				return
			}
			cmd := exec.Command(exe, "-test.run=^TestExtractChild$")
			cmd.Env = append(os.Environ(), "FAULTLINE_PY_EXTRACT_DIR="+dir)
			out, err := cmd.Output()
			got[i], _, _ = strings.Cut(string(out), "\n")
			errs[i] = err
		}()
	}
	wg.Wait()
	for i := range got {
		if errs[i] != nil || got[i] != got[0] {
			t.Fatalf("extraction %d: %q, %v; extraction 0: %q", i, got[i], errs[i], got[0])
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("%d entries in %s, want the package folder only", len(entries), dir)
	}
	if _, err := os.Stat(filepath.Join(got[0], "faultline", "__init__.py")); err != nil {
		t.Fatal(err)
	}
}

func TestExtractChild(t *testing.T) {
	dir := os.Getenv("FAULTLINE_PY_EXTRACT_DIR")
	if dir == "" {
		t.Skip("run by TestExtractConcurrently")
	}
	p, err := python.Extract(dir)
	if err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString(p + "\n")
}
