//go:build !cgo

package main

import (
	"fmt"
	"os"
)

// main explains itself: the library exists only as a cgo build.
func main() {
	fmt.Fprintln(os.Stderr, "libtaskd: build with cgo: go build -buildmode=c-shared -o libtaskd.so ./examples/libtaskd")
	os.Exit(2)
}
