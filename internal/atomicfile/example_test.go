package atomicfile_test

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/internal/atomicfile"
)

func ExampleCreate() {
	dir, _ := os.MkdirTemp("", "atomicfile")
	defer os.RemoveAll(dir)
	name := filepath.Join(dir, "shard-0.bin")

	f, err := atomicfile.Create(name, 0o640)
	if err != nil {
		panic(err)
	}
	defer f.Abort() // no-op once committed
	fmt.Fprint(f, "payload")
	if err := f.Commit(); err != nil {
		panic(err)
	}
	b, _ := os.ReadFile(name)
	fmt.Println(string(b))
	// Output: payload
}
