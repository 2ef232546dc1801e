package hang

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestParseFaulthandler(t *testing.T) {
	threading := func(fn string, line int) Frame { return Frame{Func: fn, File: "threading.py", Line: line} }
	want := []Thread{
		{Kind: KindPython, ID: 0x00007f969ffbd6c0, Frames: []Frame{
			{Func: "worker", File: "/job/train.py", Line: 5},
			threading("run", 975), threading("_bootstrap_inner", 1038), threading("_bootstrap", 995),
		}},
		{Kind: KindPython, ID: 0x00007f96a02782c0, State: "signalled", Frames: []Frame{
			{Func: "get_batch", File: "/job/train.py", Line: 8},
			{Func: "main", File: "/job/train.py", Line: 10},
			{Func: "<module>", File: "/job/train.py", Line: 12},
		}},
		{Kind: KindPython, ID: 0x00007f96a1000000, Frames: []Frame{
			{Func: "all_reduce", File: "torch/distributed/distributed_c10d.py", Line: 1536},
			{Func: "step", File: "/job/train.py"},
		}},
	}
	if diff := cmp.Diff(want, ParseFaulthandler(readTool(t, "faulthandler.txt"))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// TestFaulthandlerLive has a real interpreter dump its stacks on a
// signal while its main thread sleeps in C, and merges what it wrote.
func TestFaulthandlerLive(t *testing.T) {
	py := "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		t.Skip("needs /usr/bin/python3 (Debian package python3)")
	}
	out := filepath.Join(t.TempDir(), "stacks.txt")
	script := `
import faulthandler, signal, sys, time
f = open(sys.argv[1], "a")
faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
def get_batch():
    print("ready", flush=True)
    time.sleep(60)
get_batch()
`
	cmd := exec.Command(py, "-c", script, out)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("child said %q, %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	var threads []Thread
	for deadline := time.Now().Add(10 * time.Second); len(threads) == 0 || len(threads[0].Frames) < 2; {
		if time.Now().After(deadline) {
			t.Fatalf("no stacks dumped in 10s: %+v", threads)
		}
		time.Sleep(10 * time.Millisecond)
		b, _ := os.ReadFile(out)
		threads = ParseFaulthandler(b)
	}
	if !slices.ContainsFunc(threads[0].Frames, func(f Frame) bool { return f.Func == "get_batch" && f.File == "<string>" }) {
		t.Fatalf("the dump lacks get_batch: %+v", threads)
	}
	m, err := Merge([]*Dump{{Rank: 0, World: 1, Threads: threads}}, MergeConfig{})
	if err != nil || len(m.Trees[KindPython].Children) == 0 {
		t.Fatalf("Merge = %+v, %v", m, err)
	}
}

// FuzzParseFaulthandler: the parser never panics, and what it returns
// marshals into a stack file that parses again.
func FuzzParseFaulthandler(f *testing.F) {
	f.Add(readTool(f, "faulthandler.txt"))
	f.Add([]byte("Thread 0xzz (most recent call first):\n  File \"\", line ??? in \n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		d := &Dump{World: 1, Threads: ParseFaulthandler(data)}
		b, err := d.Marshal()
		if err != nil {
			t.Fatalf("parsed threads do not marshal: %v", err)
		}
		if _, err := ParseDump(b); err != nil {
			t.Fatalf("marshalled threads do not parse: %v", err)
		}
	})
}
