package hang

import (
	"fmt"
	"io"
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

// WriteFiles writes the flame graphs and folded stacks of every kind, and
// the pprof profile, atomically into dir (created if needed). Python and
// native files are always written, empty graphs included, so that tools
// find them. It returns the paths written.
func (m *Merged) WriteFiles(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("hang: %w", err)
	}
	kinds := []Kind{KindPython, KindNative}
	for _, k := range m.Kinds() {
		if k != KindPython && k != KindNative {
			kinds = append(kinds, k)
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
		svg, folded := string(k)+"_stack.svg", string(k)+"_stack.folded"
		switch k {
		case KindPython:
			svg, folded = PythonSVGFile, PythonFoldedFile
		case KindNative:
			svg, folded = NativeSVGFile, NativeFoldedFile
		}
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
