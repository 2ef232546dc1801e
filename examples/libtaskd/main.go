//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>

// libtaskd's C ABI. Every function is safe to call from any thread.
// Functions returning int return TASKD_OK or a negative TASKD_E* code;
// taskd_last_error then says why, for the calling thread. Strings passed in
// are read during the call and copied if kept; the library keeps no
// pointer of the caller's except the callback and user pointers it is
// given, and hands out none into Go memory.

#define TASKD_OK 0
#define TASKD_ERR (-1)          // failed; see taskd_last_error
#define TASKD_EINVAL (-2)       // bad argument or configuration
#define TASKD_EHANDLE (-3)      // not a live handle of the right kind
#define TASKD_ESTATE (-4)       // already started, or destroyed
#define TASKD_ENOENT (-5)       // no open range with this id
#define TASKD_EFULL (-6)        // too many ranges open
#define TASKD_EUNSUPPORTED (-7) // returned by a callback: the trainer cannot do this

// Events a worker's callbacks are registered for. The first seven are the
// trainer's side of the manager's orchestration (recovery, link switch,
// stress test); register them before taskd_start_worker. A worker started
// with any of them is a trainer: it begins paused and is resumed (step -1)
// once registered with the manager. The argument is a JSON object, with
// "timeout_ms", the time the manager allows, added.
#define TASKD_EVENT_PAUSE 1            // stop at the next step boundary; reply {"step": last completed}
#define TASKD_EVENT_RESUME 2           // {"step": checkpoint to load or -1, "strategy", "restarted": [ranks]}
#define TASKD_EVENT_STOP 3             // {"reason": ...}: end training for good
#define TASKD_EVENT_SWITCH_LINK 4      // {"node", "devices": [...], "target": "standby"|"primary", "ranks"}
#define TASKD_EVENT_STRATEGIES 5       // {"faults": [...]}; reply ["retry", "recover-in-place", ...]
#define TASKD_EVENT_RETRY_STEP 6       // redo the interrupted step from memory
#define TASKD_EVENT_STRESS_TEST 7      // {"nodes", "ranks", "test"}
#define TASKD_EVENT_PROFILING_SWITCH 8 // the profilingSwitch document, as applied

// taskd_callback is a trainer's handler of an event. arg lives for the
// call. Return TASKD_OK, optionally writing a NUL-terminated JSON reply of
// at most outlen bytes into out; TASKD_EUNSUPPORTED when the trainer
// cannot do this; anything else for a failure, with its reason in out. It
// runs on a thread of the library's, never twice at once for one event.
typedef int (*taskd_callback)(void *user, const char *arg, char *out, size_t outlen);
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime/cgo"
	"unsafe"

	"github.com/faultline-ml/faultline/trace"
)

func main() {}

// codeOf maps an error to its TASKD_E* code.
func codeOf(err error) C.int {
	var ce *configError
	switch {
	case errors.As(err, &ce), errors.Is(err, errBadMarker), errors.Is(err, errBadArgument):
		return C.TASKD_EINVAL
	case errors.Is(err, errBadHandle):
		return C.TASKD_EHANDLE
	case errors.Is(err, errStarted), errors.Is(err, errClosed):
		return C.TASKD_ESTATE
	case errors.Is(err, errUnknownRange):
		return C.TASKD_ENOENT
	case errors.Is(err, errTooManyOpen):
		return C.TASKD_EFULL
	}
	return C.TASKD_ERR
}

// fail records err as the thread's last error and returns its code.
func fail(fn string, err error) C.int {
	setError(fn + ": " + err.Error())
	return codeOf(err)
}

// lookup returns the object handle h stands for. cgo.Handle panics on a
// handle it does not hold (never issued, or destroyed); that is the
// caller's mistake, not a reason to crash its process.
func lookup[T any](h C.uintptr_t) (v T, err error) {
	defer func() {
		if recover() != nil {
			err = fmt.Errorf("%w: %d", errBadHandle, uint64(h))
		}
	}()
	if h == 0 {
		return v, fmt.Errorf("%w: 0", errBadHandle)
	}
	v, ok := cgo.Handle(h).Value().(T)
	if !ok {
		return v, fmt.Errorf("%w of this kind: %d", errBadHandle, uint64(h))
	}
	return v, nil
}

// release deletes handle h; of two concurrent calls one succeeds.
func release(h C.uintptr_t) (err error) {
	defer func() {
		if recover() != nil {
			err = fmt.Errorf("%w: %d", errBadHandle, uint64(h))
		}
	}()
	cgo.Handle(h).Delete()
	return nil
}

// putHandle stores a handle for v in *out.
func putHandle(out *C.uintptr_t, v any) {
	*out = C.uintptr_t(cgo.NewHandle(v))
}

//export taskd_init_worker
func taskd_init_worker(rank, diskLimitMB C.int, framework, options *C.char, out *C.uintptr_t) C.int {
	const fn = "taskd_init_worker"
	if out == nil {
		return fail(fn, fmt.Errorf("%w: handle pointer is NULL", errBadArgument))
	}
	set, err := resolveWorker(int(rank), int(diskLimitMB), C.GoString(framework), []byte(goString(options)), os.Getenv)
	if err != nil {
		return fail(fn, err)
	}
	w, err := newWorker(set)
	if err != nil {
		return fail(fn, err)
	}
	putHandle(out, w)
	return C.TASKD_OK
}

//export taskd_start_worker
func taskd_start_worker(h C.uintptr_t) C.int {
	const fn = "taskd_start_worker"
	w, err := lookup[*worker](h)
	if err == nil {
		err = w.start()
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_range_start
func taskd_range_start(h C.uintptr_t, name, domain *C.char) C.int64_t {
	const fn = "taskd_range_start"
	w, err := lookup[*worker](h)
	if err != nil {
		return C.int64_t(fail(fn, err))
	}
	id, err := w.ranges.start(goString(name), goString(domain))
	if err != nil {
		return C.int64_t(fail(fn, err))
	}
	return C.int64_t(id) // ids are below 2^63 (nanoseconds since 1970 plus a count)
}

//export taskd_range_end
func taskd_range_end(h C.uintptr_t, id C.int64_t) C.int {
	const fn = "taskd_range_end"
	w, err := lookup[*worker](h)
	if err == nil {
		if id < 0 {
			err = fmt.Errorf("%w: range id %d", errBadArgument, int64(id))
		} else {
			err = w.ranges.end(uint64(id))
		}
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_mark
func taskd_mark(h C.uintptr_t, name, domain *C.char) C.int {
	const fn = "taskd_mark"
	w, err := lookup[*worker](h)
	if err == nil {
		err = w.ranges.mark(goString(name), goString(domain))
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_flush
func taskd_flush(h C.uintptr_t) C.int {
	const fn = "taskd_flush"
	w, err := lookup[*worker](h)
	if err == nil {
		err = w.flush()
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_register_callback
func taskd_register_callback(h C.uintptr_t, ev C.int, cb C.taskd_callback, user unsafe.Pointer) C.int {
	const fn = "taskd_register_callback"
	w, err := lookup[*worker](h)
	if err != nil {
		return fail(fn, err)
	}
	var f callback
	if cb != nil {
		f = cCallback(uintptr(unsafe.Pointer(cb)), uintptr(user))
	}
	if err := w.register(event(ev), f); err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_init_manager
func taskd_init_manager(config *C.char, out *C.uintptr_t) C.int {
	const fn = "taskd_init_manager"
	if out == nil {
		return fail(fn, fmt.Errorf("%w: handle pointer is NULL", errBadArgument))
	}
	set, err := resolveManager([]byte(goString(config)), os.Getenv)
	if err != nil {
		return fail(fn, err)
	}
	m, err := newManager(set)
	if err != nil {
		return fail(fn, err)
	}
	putHandle(out, m)
	return C.TASKD_OK
}

//export taskd_start_manager
func taskd_start_manager(h C.uintptr_t) C.int {
	const fn = "taskd_start_manager"
	m, err := lookup[*manager](h)
	if err == nil {
		err = m.start()
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_set_switch
func taskd_set_switch(h C.uintptr_t, doc *C.char) C.int {
	const fn = "taskd_set_switch"
	m, err := lookup[*manager](h)
	if err == nil {
		_, err = m.m.SetSwitchDocument([]byte(goString(doc)))
		if errors.Is(err, trace.ErrSwitch) {
			err = fmt.Errorf("%w: %w", errBadArgument, err)
		}
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_init_proxy
func taskd_init_proxy(config *C.char, out *C.uintptr_t) C.int {
	const fn = "taskd_init_proxy"
	if out == nil {
		return fail(fn, fmt.Errorf("%w: handle pointer is NULL", errBadArgument))
	}
	set, err := resolveProxy([]byte(goString(config)), os.Getenv)
	if err != nil {
		return fail(fn, err)
	}
	p, err := newProxy(set)
	if err != nil {
		return fail(fn, err)
	}
	putHandle(out, p)
	return C.TASKD_OK
}

//export taskd_start_proxy
func taskd_start_proxy(h C.uintptr_t) C.int {
	const fn = "taskd_start_proxy"
	p, err := lookup[*proxy](h)
	if err == nil {
		err = p.start()
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

// addresser is a manager or a proxy.
type addresser interface{ address() string }

func (s *service) address() string { return s.addr }

//export taskd_addr
func taskd_addr(h C.uintptr_t, buf *C.char, size C.size_t) C.int {
	const fn = "taskd_addr"
	s, err := lookup[addresser](h)
	if err != nil {
		return fail(fn, err)
	}
	addr := s.address()
	if buf == nil || int(size) <= len(addr) {
		return fail(fn, fmt.Errorf("%w: buffer of %d bytes for %d", errBadArgument, int(size), len(addr)+1))
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(addr)+1)
	copy(dst, addr)
	dst[len(addr)] = 0
	return C.int(len(addr))
}

// closer is anything a handle stands for.
type closer interface{ close() error }

//export taskd_destroy
func taskd_destroy(h C.uintptr_t) C.int {
	const fn = "taskd_destroy"
	c, err := lookup[closer](h)
	if err == nil {
		err = release(h)
	}
	if err == nil {
		err = c.close()
	}
	if err != nil {
		return fail(fn, err)
	}
	return C.TASKD_OK
}

//export taskd_last_error
func taskd_last_error() *C.char {
	return lastError()
}
