package lease_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/taskd/lease"
)

// Two managers of one job on one machine: the first leads; the second
// waits, and leads once the first resigns, with the next token. A worker's
// fence then refuses what the first still sends.
func ExampleFile() {
	dir, _ := os.MkdirTemp("", "lease-example-")
	defer os.RemoveAll(dir)
	newManager := func(name string) *lease.File {
		l, err := lease.NewFile(lease.FileConfig{
			Path:      filepath.Join(dir, "manager.lease"),
			Candidate: lease.Candidate{Job: "llm", Config: lease.ConfigHash([]byte("nodes=2")), Name: name},
		})
		if err != nil {
			panic(err)
		}
		return l
	}
	ctx := context.Background()
	a, b := newManager("mgr-a"), newManager("mgr-b")

	first, err := a.Campaign(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("mgr-a leads with token", first.Token())
	standby := make(chan lease.Term)
	go func() {
		t, err := b.Campaign(ctx)
		if err != nil {
			panic(err)
		}
		standby <- t
	}()

	var worker lease.Fence
	fmt.Println("worker admits token 1:", worker.Admit(first.Token()) == nil)
	first.Resign()
	second := <-standby
	defer second.Resign()
	fmt.Println("mgr-b leads with token", second.Token())
	fmt.Println("worker admits token 2:", worker.Admit(second.Token()) == nil)
	err = worker.Admit(first.Token())
	fmt.Println("worker refuses token 1:", errors.Is(err, lease.ErrStale))
	fmt.Println("mgr-a's term is over:", errors.Is(first.Check(ctx), lease.ErrLost))
	// Output:
	// mgr-a leads with token 1
	// worker admits token 1: true
	// mgr-b leads with token 2
	// worker admits token 2: true
	// worker refuses token 1: true
	// mgr-a's term is over: true
}

// A second manager started with another configuration of the job is
// refused while the first leads, and the error names both.
func ExampleConfigError() {
	dir, _ := os.MkdirTemp("", "lease-example-")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "manager.lease")
	a, _ := lease.NewFile(lease.FileConfig{Path: path, Candidate: lease.Candidate{Job: "llm", Config: "aaaa", Name: "mgr-a"}})
	b, _ := lease.NewFile(lease.FileConfig{Path: path, Candidate: lease.Candidate{Job: "llm", Config: "bbbb", Name: "mgr-b"}})
	term, err := a.Campaign(context.Background())
	if err != nil {
		panic(err)
	}
	defer term.Resign()
	_, err = b.Campaign(context.Background())
	var ce *lease.ConfigError
	if errors.As(err, &ce) {
		fmt.Printf("refused: %s leads with %s, this manager has %s\n", ce.Holder, ce.HolderConfig, ce.Config)
	}
	// Output:
	// refused: mgr-a leads with aaaa, this manager has bbbb
}
