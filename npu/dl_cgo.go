//go:build cgo

package npu

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

// dlerror's text is per thread: read it in the same C call as the failure.
static void *fl_dlopen(const char *path, int global, char *err, size_t n) {
	void *h = dlopen(path, RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
	if (h == NULL) {
		const char *e = dlerror();
		strncpy(err, e ? e : "unknown dlopen error", n - 1);
		err[n - 1] = 0;
	}
	return h;
}

static void *fl_dlsym(void *h, const char *name, char *err, size_t n) {
	dlerror();
	void *p = dlsym(h, name);
	if (p == NULL) {
		const char *e = dlerror();
		strncpy(err, e ? e : "symbol is NULL", n - 1);
		err[n - 1] = 0;
	}
	return p;
}

static void fl_dlclose(void *h) { dlclose(h); }
*/
import "C"

import (
	"unsafe"
)

// library is a shared library loaded at run time. The package never links
// against a vendor library: everything goes through dlopen and dlsym, so a
// binary built here runs on hosts with any driver, or none.
type library struct {
	name string
	h    unsafe.Pointer
}

const dlErrLen = 512

// openLibrary dlopens name (a file name the loader searches for, or a path)
// with RTLD_NOW, so that a library missing what it needs fails here rather
// than in the middle of a call. global makes its symbols visible to
// libraries loaded later (a profiling library's hooks need that).
func openLibrary(name string, global bool) (*library, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var buf [dlErrLen]C.char
	g := C.int(0)
	if global {
		g = 1
	}
	h := C.fl_dlopen(cname, g, &buf[0], dlErrLen)
	if h == nil {
		return nil, &LoadError{Library: name, Msg: C.GoString(&buf[0])}
	}
	return &library{name: name, h: h}, nil
}

// sym returns the address of a function the library must have.
func (l *library) sym(name string) (unsafe.Pointer, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var buf [dlErrLen]C.char
	p := C.fl_dlsym(l.h, cname, &buf[0], dlErrLen)
	if p == nil {
		return nil, &LoadError{Library: l.name, Symbol: name, Msg: C.GoString(&buf[0])}
	}
	return p, nil
}

// optional returns the address of a function the library may lack, or nil.
func (l *library) optional(name string) unsafe.Pointer {
	p, _ := l.sym(name)
	return p
}

// symbol names a function and where to store its address.
type symbol struct {
	name string
	addr *unsafe.Pointer
}

// resolve fills every symbol's address, in order; the first missing one is
// the error.
func (l *library) resolve(syms []symbol) error {
	for _, s := range syms {
		p, err := l.sym(s.name)
		if err != nil {
			return err
		}
		*s.addr = p
	}
	return nil
}

func (l *library) close() { C.fl_dlclose(l.h) }
