package python_test

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/python"
)

// A launcher extracts the package once and gives each rank the folder on
// PYTHONPATH.
func ExampleExtract() {
	cache, err := os.MkdirTemp("", "faultline-example-")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(cache)
	dir, err := python.Extract(cache)
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = os.Stat(filepath.Join(dir, "faultline", "__init__.py"))
	fmt.Println("PYTHONPATH holds faultline:", err == nil)
	// Output: PYTHONPATH holds faultline: true
}
