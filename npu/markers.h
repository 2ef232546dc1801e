//go:build cgo

// markers.h: the C side of MarkerSource (markers_cgo.go), which walks
// mspti-style activity buffers and forwards the library's buffer callbacks
// to Go.

#ifndef FAULTLINE_NPU_MARKERS_H
#define FAULTLINE_NPU_MARKERS_H

#include <stddef.h>
#include <stdint.h>

// Kept out of the dynamic symbol table of a shared library built with them.
#define FL_HIDDEN __attribute__((visibility("hidden")))

enum {
	FL_MSPTI_SUCCESS = 0,
	FL_MSPTI_ERROR_MULTIPLE_SUBSCRIBERS = 2,
	FL_MSPTI_ERROR_MAX_LIMIT_REACHED = 3,
	FL_MSPTI_KIND_MARKER = 1,
	FL_BATCH = 256,
	FL_MAX_STR = 65536,
};

// Reader states.
enum { FL_MORE = 0, FL_END = 1, FL_ERROR = 2, FL_MALFORMED = 3 };

// fl_marker is one marker record copied out of a buffer.
typedef struct {
	uint64_t timestamp, id;
	uint32_t flag, source_kind, object0, object1;
	const char *name, *domain;
	uint32_t name_len, domain_len;
} fl_marker;

// fl_reader walks one completed buffer in batches, so that Go makes one C
// call per FL_BATCH records rather than one per record.
typedef struct {
	void *getnext;
	uint8_t *buf;
	size_t valid;
	void *cursor;
	int state, code, n;
	uint64_t skipped;
	fl_marker out[FL_BATCH];
} fl_reader;

FL_HIDDEN void fl_reader_reset(fl_reader *r, uint8_t *buf, size_t valid);

// fl_read fills r->out with the next marker records of the buffer. Records
// of other kinds are counted and skipped; a record the library places
// outside the valid bytes ends the walk as malformed.
FL_HIDDEN void fl_read(fl_reader *r);

// The one MarkerSource of the process: fl_marker_claim makes the cgo.Handle
// h the owner of the library's buffer callbacks, if there is none;
// fl_marker_release gives them up and waits for those in flight.
FL_HIDDEN int fl_marker_claim(uintptr_t h);
FL_HIDDEN void fl_marker_release(void);

// Calls of the library's functions, whose addresses dlsym gave.
FL_HIDDEN int fl_mspti_subscribe(void *fn, void **sub);
FL_HIDDEN int fl_mspti_register(void *fn);
FL_HIDDEN int fl_call_ptr(void *fn, void *p);
FL_HIDDEN int fl_call_u32(void *fn, uint32_t v);
FL_HIDDEN int fl_call_str(void *fn, const char *s);

#endif
