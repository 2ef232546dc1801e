//go:build cgo

package main

/*
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The last error of each thread, as errno: set by a failing call, read by
// taskd_last_error on the same thread, overwritten by the next failure.
static __thread char taskd_err[1024];

static void taskd_set_error(_GoString_ s) {
	size_t n = _GoStringLen(s);
	if (n >= sizeof taskd_err)
		n = sizeof taskd_err - 1;
	memcpy(taskd_err, _GoStringPtr(s), n);
	taskd_err[n] = 0;
}

static const char *taskd_get_error(void) { return taskd_err; }

// The trampoline through which Go calls a trainer's callback: Go keeps the
// function and user pointers as integers and never dereferences them.
typedef int (*taskd_callback_fn)(void *user, const char *arg, char *out, size_t outlen);

static int taskd_call(uintptr_t fn, uintptr_t user, const char *arg, char *out, size_t outlen) {
	return ((taskd_callback_fn)fn)((void *)user, arg, out, outlen);
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// setError makes msg this thread's last error.
func setError(msg string) { C.taskd_set_error(msg) }

// lastError returns this thread's last error, owned by the library.
func lastError() *C.char { return C.taskd_get_error() }

// taskdEUnsupported is TASKD_EUNSUPPORTED of the header, which this
// file's C cannot see.
const taskdEUnsupported = -7

// replyLen is the room a callback has for its reply or error message.
const replyLen = 64 << 10

// cCallback wraps a C function pointer and its user pointer, both C
// memory that Go only passes back to C.
func cCallback(fn, user uintptr) callback {
	return func(arg string) (string, error) {
		carg := C.CString(arg)
		defer C.free(unsafe.Pointer(carg))
		buf := (*C.char)(C.calloc(replyLen, 1))
		defer C.free(unsafe.Pointer(buf))
		rc := C.taskd_call(C.uintptr_t(fn), C.uintptr_t(user), carg, buf, replyLen)
		*(*C.char)(unsafe.Add(unsafe.Pointer(buf), replyLen-1)) = 0
		out := C.GoString(buf)
		switch rc {
		case 0:
			return out, nil
		case taskdEUnsupported:
			if out == "" {
				return "", errUnsupported
			}
			return "", fmt.Errorf("%w: %s", errUnsupported, out)
		}
		if out == "" {
			return "", fmt.Errorf("callback failed (%d)", int(rc))
		}
		return "", fmt.Errorf("callback failed (%d): %s", int(rc), out)
	}
}

// goString views the C string p as a Go string without copying: it is
// valid only while the caller's call lasts, so nothing may keep it.
func goString(p *C.char) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return unsafe.String((*byte)(unsafe.Pointer(p)), n)
}
