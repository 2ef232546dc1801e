package hang

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// Names of the files WriteFiles writes. Python and native stacks keep
// xpu_timer's names; Go stacks, and any other kind, get
// "<kind>_stack.svg" and "<kind>_stack.folded" when present.
const (
	PythonSVGFile    = "py_stack.svg"
	PythonFoldedFile = "py_stack.folded"
	NativeSVGFile    = "cpp_stack.svg"
	NativeFoldedFile = "cpp_stack.folded"
	PprofFile        = "stacks.pb.gz"
)

// WriteFiles writes, for each kind that has stacks, its flame graph and
// folded stacks, and the pprof profile of them all, atomically into dir
// (created if needed), and returns the paths written. A kind without
// stacks gets no file (an empty picture says nothing): a file an earlier
// merge left under its name is removed, so that none is mistaken for this
// one's.
func (m *Merged) WriteFiles(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("hang: %w", err)
	}
	var kinds []Kind
	for _, k := range m.Kinds() {
		if m.HasStacks(k) {
			kinds = append(kinds, k)
		}
	}
	for _, k := range []Kind{KindPython, KindNative, KindGo} {
		if m.HasStacks(k) {
			continue
		}
		for _, name := range fileNames(k) {
			if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("hang: %w", err)
			}
		}
	}
	var paths []string
	write := func(name string, fn func(io.Writer) error) error {
		path := filepath.Join(dir, name)
		f, err := atomicfile.Create(path, 0o644)
		if err != nil {
			return fmt.Errorf("hang: %w", err)
		}
		defer f.Abort()
		if err := fn(f); err != nil {
			return fmt.Errorf("hang: write %s: %w", path, err)
		}
		if err := f.Commit(); err != nil {
			return fmt.Errorf("hang: %w", err)
		}
		paths = append(paths, path)
		return nil
	}
	for _, k := range kinds {
		names := fileNames(k)
		svg, folded := names[0], names[1]
		if err := write(svg, func(w io.Writer) error { return m.WriteSVG(w, k) }); err != nil {
			return paths, err
		}
		if err := write(folded, func(w io.Writer) error { return m.WriteFolded(w, k) }); err != nil {
			return paths, err
		}
	}
	if err := write(PprofFile, m.WritePprof); err != nil {
		return paths, err
	}
	return paths, nil
}

// HasStacks reports whether some rank gave stacks of kind k.
func (m *Merged) HasStacks(k Kind) bool {
	root := m.Trees[k]
	return root != nil && root.weight > 0
}

// fileNames returns the flame graph's and the folded stacks' file names
// of kind k: xpu_timer's for Python and native stacks, else
// "<kind>_stack.svg" and "<kind>_stack.folded".
func fileNames(k Kind) [2]string {
	switch k {
	case KindPython:
		return [2]string{PythonSVGFile, PythonFoldedFile}
	case KindNative:
		return [2]string{NativeSVGFile, NativeFoldedFile}
	}
	return [2]string{string(k) + "_stack.svg", string(k) + "_stack.folded"}
}
