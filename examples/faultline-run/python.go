package main

import (
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/python"
)

// pythonPath extracts the faultline Python package (once per content,
// under the user's cache folder) and returns the folder to put on the
// ranks' PYTHONPATH.
func pythonPath() (string, error) {
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	return python.Extract(filepath.Join(base, "faultline", "python"))
}
