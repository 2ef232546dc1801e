//go:build cgo

package fakedriver

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef int64_t (*fake_control_fn)(const char *, int64_t, int64_t, int64_t, const char *, const char *);

static void *fd_open(const char *path, char **err) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL)
		*err = dlerror();
	return h;
}

static void *fd_sym(void *h, const char *name) { return dlsym(h, name); }

static int64_t fd_control(void *fn, const char *op, int64_t a, int64_t b, int64_t c, const char *s1, const char *s2) {
	return ((fake_control_fn)fn)(op, a, b, c, s1, s2);
}

static void fd_close(void *h) { dlclose(h); }
*/
import "C"

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"
)

// Compiler returns the C compiler to use: $CC if set, else the first of cc,
// gcc and clang found in PATH.
func Compiler() (string, bool) {
	if cc := os.Getenv("CC"); cc != "" {
		if p, err := exec.LookPath(strings.Fields(cc)[0]); err == nil {
			return p, true
		}
	}
	for _, name := range []string{"cc", "gcc", "clang"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, true
		}
	}
	return "", false
}

// Build compiles the C file src into a shared library in a fresh temporary
// directory of tb and returns its path. Each call gives a new library, so
// that the state of one test's fake driver does not leak into another's.
// The include directory beside testdata (npu/include) is on the include
// path. Build skips the test when no C compiler is found.
func Build(tb testing.TB, src string) string {
	tb.Helper()
	cc, ok := Compiler()
	if !ok {
		tb.Skip("no C compiler found ($CC, cc, gcc, clang): the fake driver libraries are built from C sources during the test")
	}
	abs, err := filepath.Abs(src)
	if err != nil {
		tb.Fatal(err)
	}
	name := strings.TrimSuffix(filepath.Base(abs), ".c")
	out := filepath.Join(tb.TempDir(), "lib"+name+".so")
	include := filepath.Join(filepath.Dir(filepath.Dir(abs)), "include")
	cmd := exec.Command(cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wl,-Bsymbolic",
		"-I", include, "-o", out, abs, "-lpthread")
	if msg, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("%s: %v\n%s", strings.Join(cmd.Args, " "), err, msg)
	}
	return out
}

// Lib is a loaded fake driver library.
type Lib struct {
	h       unsafe.Pointer
	control unsafe.Pointer
}

// Open loads the library at path (dlopen returns the instance npu loaded,
// if it did) and closes it when the test ends.
func Open(tb testing.TB, path string) *Lib {
	tb.Helper()
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	h := C.fd_open(cpath, &cerr)
	if h == nil {
		tb.Fatalf("dlopen %s: %s", path, C.GoString(cerr))
	}
	name := C.CString("fake_control")
	defer C.free(unsafe.Pointer(name))
	fn := C.fd_sym(h, name)
	if fn == nil {
		C.fd_close(h)
		tb.Fatalf("%s: no fake_control", path)
	}
	tb.Cleanup(func() { C.fd_close(h) })
	return &Lib{h: h, control: fn}
}

// Control calls fake_control(op, a, b, c, s1, s2) in the library; an empty
// string is passed as NULL. The operations of each fake are listed in its
// source.
func (l *Lib) Control(op string, a, b, c int64, s1, s2 string) int64 {
	cop := C.CString(op)
	defer C.free(unsafe.Pointer(cop))
	cs1, cs2 := cstring(s1), cstring(s2)
	defer C.free(unsafe.Pointer(cs1))
	defer C.free(unsafe.Pointer(cs2))
	return int64(C.fd_control(l.control, cop, C.int64_t(a), C.int64_t(b), C.int64_t(c), cs1, cs2))
}

// Get calls Control(op, a, b, 0, "", "").
func (l *Lib) Get(op string, a, b int64) int64 { return l.Control(op, a, b, 0, "", "") }

func cstring(s string) *C.char {
	if s == "" {
		return nil
	}
	return C.CString(s)
}
