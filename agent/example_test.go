package agent_test

import (
	"context"
	"fmt"
	"os"

	"github.com/faultline-ml/faultline/agent"
	"github.com/faultline-ml/faultline/taskd"
)

// A node of one rank that runs a program (NoPython); a Python job names
// its script and puts the faultline package on PythonPath instead.
func Example() {
	out, err := os.MkdirTemp("", "agent-example-")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(out)
	a, err := agent.New(agent.Config{
		Job: "example", Command: []string{"sh", "-c", "echo hello from rank $RANK of $WORLD_SIZE"}, NoPython: true,
		Out: out, ShmDir: out, ManagerListen: "127.0.0.1:0",
		Security: taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer a.Close()
	if err := a.Run(context.Background()); err != nil {
		fmt.Println(err)
	}
	// Output: [rank0]: hello from rank 0 of 1
}
