package main

import "errors"

// pythonPath extracts the faultline Python package and returns the folder
// to put on the ranks' PYTHONPATH.
func pythonPath() (string, error) {
	return "", errors.New("the faultline Python package is not built in yet")
}
