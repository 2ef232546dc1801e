package ckpt

import (
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// backgroundNice is the CPU priority of the threads that copy replicas in
// the background: the lowest, so that a trainer's save, its data loader
// and its interpreter get the CPU first and a transfer takes what they
// leave. A replica fetched for a recovery is not: the job waits for it.
const backgroundNice = 19

// background locks the calling goroutine to its thread and lowers the
// thread's priority (Linux's nice is a thread's). The goroutine must end
// without unlocking: its thread then ends with it, so that no other
// goroutine ever runs at that priority. The main thread is left alone: it
// is never ended, and its priority is the one ps shows for the process.
// Failing to lower it is harmless.
func background() {
	for range 20 {
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), backgroundNice)
			return
		}
		runtime.UnlockOSThread()
		time.Sleep(50 * time.Microsecond) // woken, likely, by another thread
	}
}
