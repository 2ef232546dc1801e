package hang

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func readTool(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "tools", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseGDBCpp(t *testing.T) {
	libc := "/lib/x86_64-linux-gnu/libc.so.6"
	torch := "/usr/lib/python3/dist-packages/torch/lib/libtorch_cuda.so"
	want := []Thread{
		{Kind: KindNative, ID: 102, Name: "pt_nccl_watchdg", Frames: []Frame{
			{Func: "__futex_abstimed_wait_common", File: libc},
			{Func: "pthread_cond_timedwait@@GLIBC_2.3.2", File: libc},
			{Func: "c10d::ProcessGroupNCCL::ncclCommWatchdog()", File: torch},
			{Func: "std::_Function_handler<void (), c10d::Foo::bar(int)::{lambda()#1}>::_M_invoke(std::_Any_data const&)", File: torch},
			{Func: "start_thread", File: "./nptl/pthread_create.c", Line: 442},
			{Func: "clone3", File: "../sysdeps/unix/sysv/linux/x86_64/clone3.S", Line: 81},
		}},
		{Kind: KindNative, ID: 101, Name: "worker", Frames: []Frame{
			{Func: "??"},
			{Func: "operator()", File: "/src/worker.cc", Line: 12},
			{Func: "worker_main", File: "/src/worker.cc", Line: 40},
		}},
		{Kind: KindNative, ID: 100, Frames: []Frame{{Func: "main", File: "main.c", Line: 5}}},
	}
	if diff := cmp.Diff(want, parseGDB(readTool(t, "gdb_cpp.txt"))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestParseGDBPython(t *testing.T) {
	threads := parseGDB(readTool(t, "gdb_python.txt"))
	if len(threads) != 2 {
		t.Fatalf("%d threads, want 2", len(threads))
	}
	main := threads[1]
	if main.Name != "python3" || main.ID == 0 || len(main.Frames) < 10 {
		t.Errorf("main thread %+v", main)
	}
	if got := main.Frames[0]; got.Func != "__GI___clock_nanosleep" || got.File != "../sysdeps/unix/sysv/linux/clock_nanosleep.c" || got.Line != 48 {
		t.Errorf("innermost frame %+v", got)
	}
	if got := main.Frames[2]; got.Func != "time_sleep" || got.Line != 383 {
		t.Errorf("inlined frame %+v", got)
	}
}

func TestParseEUStack(t *testing.T) {
	threads := parseEUStack(readTool(t, "eustack_python.txt"))
	if len(threads) != 2 {
		t.Fatalf("%d threads, want 2", len(threads))
	}
	f := threads[0].Frames[0]
	if f.Func != "__GI___clock_nanosleep" || f.File != "../sysdeps/unix/sysv/linux/clock_nanosleep.c" || f.Line != 48 {
		t.Errorf("innermost frame %+v", f)
	}
	got := parseEUStack([]byte("TID 7:\n#0  0x0000563e1cb964af - /usr/bin/sleep\n#1  0x00007fff667495c8\n#2  0x0000000000481023 runtime.futex.abi0 - /tmp/gblock\n#3  0x0000000000481023 plain\n"))
	want := []Thread{{Kind: KindNative, ID: 7, Frames: []Frame{
		{Func: "??", File: "/usr/bin/sleep"}, {Func: "??"}, {Func: "runtime.futex.abi0", File: "/tmp/gblock"}, {Func: "plain"},
	}}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestParseGoroutines(t *testing.T) {
	want := []Thread{
		{Kind: KindGo, ID: 1, Name: "goroutine 1", State: "running", Frames: []Frame{{Func: "main.main", File: "/app/main.go", Line: 12}}},
		{Kind: KindGo, ID: 18, Name: "goroutine 18", State: "chan receive, 2 minutes", Frames: []Frame{
			{Func: "main.(*Trainer).allReduce", File: "/app/trainer.go", Line: 88},
			{Func: "main.step[...]", File: "/app/trainer.go", Line: 40},
		}},
		{Kind: KindGo, ID: 19, Name: "goroutine 19", State: "select, locked to thread", Frames: []Frame{
			{Func: "runtime.gopark", File: "/usr/local/go/src/runtime/proc.go", Line: 435},
		}},
	}
	if diff := cmp.Diff(want, parseGoroutines(readTool(t, "goroutines.txt"))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	self := CaptureGoroutines()
	if !hasFrame(self, KindGo, "TestParseGoroutines") {
		t.Error("own goroutines lack this test")
	}
}

// FuzzParseToolOutput feeds the three tool parsers anything: they must
// not panic, and what they return must marshal into a stack file.
func FuzzParseToolOutput(f *testing.F) {
	for _, name := range []string{"gdb_cpp.txt", "gdb_python.txt", "eustack_python.txt", "goroutines.txt"} {
		f.Add(readTool(f, name))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var threads []Thread
		threads = append(threads, parseGDB(data)...)
		threads = append(threads, parseEUStack(data)...)
		threads = append(threads, parseGoroutines(data)...)
		d := &Dump{World: 1, Threads: threads}
		b, err := d.Marshal()
		if err != nil {
			t.Fatalf("parsed threads do not marshal: %v", err)
		}
		if _, err := ParseDump(b); err != nil {
			t.Fatalf("marshalled threads do not parse: %v", err)
		}
	})
}
