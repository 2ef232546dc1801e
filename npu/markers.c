//go:build cgo

// markers.c: see markers.h.

#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "markers.h"

// msptiActivityMarker as mspti_activity.h lays it out: packed, 8-byte
// aligned, enums as 32-bit integers, objectId a union of {processId,
// threadId} and {deviceId, streamId}.
typedef struct __attribute__((__packed__)) __attribute__((aligned(8))) {
	uint32_t kind;
	uint32_t flag;
	uint32_t sourceKind;
	uint64_t timestamp;
	uint64_t id;
	uint32_t object[2];
	const char *name;
	const char *domain;
} fl_mspti_marker;

typedef int (*fl_getnext_fn)(uint8_t *, size_t, void **);

void fl_reader_reset(fl_reader *r, uint8_t *buf, size_t valid) {
	r->buf = buf;
	r->valid = valid;
	r->cursor = NULL;
	r->state = FL_MORE;
	r->code = 0;
	r->n = 0;
}

static uint32_t fl_strlen(const char *s) {
	return s == NULL ? 0 : (uint32_t)strnlen(s, FL_MAX_STR);
}

void fl_read(fl_reader *r) {
	r->n = 0;
	if (r->state != FL_MORE)
		return;
	uint8_t *end = r->buf + r->valid;
	while (r->n < FL_BATCH) {
		void *rec = r->cursor;
		int rc = ((fl_getnext_fn)r->getnext)(r->buf, r->valid, &rec);
		if (rc == FL_MSPTI_ERROR_MAX_LIMIT_REACHED) {
			r->state = FL_END;
			return;
		}
		if (rc != FL_MSPTI_SUCCESS) {
			r->state = FL_ERROR;
			r->code = rc;
			return;
		}
		uint8_t *p = rec;
		if (p == NULL || p < r->buf || p + sizeof(uint32_t) > end ||
		    (r->cursor != NULL && p <= (uint8_t *)r->cursor)) {
			r->state = FL_MALFORMED;
			return;
		}
		r->cursor = rec;
		uint32_t kind;
		memcpy(&kind, p, sizeof kind);
		if (kind != FL_MSPTI_KIND_MARKER) {
			r->skipped++;
			continue;
		}
		if (p + sizeof(fl_mspti_marker) > end) {
			r->state = FL_MALFORMED;
			return;
		}
		const fl_mspti_marker *m = rec;
		fl_marker *o = &r->out[r->n++];
		o->timestamp = m->timestamp;
		o->id = m->id;
		o->flag = m->flag;
		o->source_kind = m->sourceKind;
		o->object0 = m->object[0];
		o->object1 = m->object[1];
		o->name = m->name;
		o->domain = m->domain;
		o->name_len = fl_strlen(m->name);
		o->domain_len = fl_strlen(m->domain);
	}
}

// mspti's buffer callbacks carry no user data, so the source they belong
// to is found through this process-wide slot: the cgo.Handle of the one
// open MarkerSource, or 0. mspti allows one subscriber per process anyway.
// inflight counts callbacks running, so that Close can wait them out
// before it deletes the handle.
static _Atomic uintptr_t fl_marker_owner;
static _Atomic int fl_marker_inflight;

extern void flMarkerRequested(uintptr_t, uint8_t **, size_t *, size_t *);
extern void flMarkerCompleted(uintptr_t, uint8_t *, size_t, size_t);

static void fl_marker_requested(uint8_t **buf, size_t *size, size_t *max) {
	if (buf == NULL || size == NULL || max == NULL)
		return;
	atomic_fetch_add(&fl_marker_inflight, 1);
	uintptr_t h = atomic_load(&fl_marker_owner);
	if (h != 0) {
		flMarkerRequested(h, buf, size, max);
	} else {
		*buf = NULL;
		*size = 0;
		*max = 0;
	}
	atomic_fetch_sub(&fl_marker_inflight, 1);
}

// A buffer completed with no owner is leaked, not freed: it may be one the
// library is handing back twice, or still writing.
static void fl_marker_completed(uint8_t *buf, size_t size, size_t valid) {
	atomic_fetch_add(&fl_marker_inflight, 1);
	uintptr_t h = atomic_load(&fl_marker_owner);
	if (h != 0 && buf != NULL)
		flMarkerCompleted(h, buf, size, valid);
	atomic_fetch_sub(&fl_marker_inflight, 1);
}

int fl_marker_claim(uintptr_t h) {
	uintptr_t none = 0;
	return atomic_compare_exchange_strong(&fl_marker_owner, &none, h);
}

void fl_marker_release(void) {
	atomic_store(&fl_marker_owner, 0);
	while (atomic_load(&fl_marker_inflight) != 0)
		sched_yield();
}

static void fl_mspti_noop(void *userdata, int domain, uint32_t cbid, const void *data) {
	(void)userdata; (void)domain; (void)cbid; (void)data;
}

typedef void (*fl_callback_fn)(void *, int, uint32_t, const void *);
typedef void (*fl_request_fn)(uint8_t **, size_t *, size_t *);
typedef void (*fl_complete_fn)(uint8_t *, size_t, size_t);

int fl_mspti_subscribe(void *fn, void **sub) {
	return ((int (*)(void **, fl_callback_fn, void *))fn)(sub, fl_mspti_noop, NULL);
}

int fl_mspti_register(void *fn) {
	return ((int (*)(fl_request_fn, fl_complete_fn))fn)(fl_marker_requested, fl_marker_completed);
}

int fl_call_ptr(void *fn, void *p) { return ((int (*)(void *))fn)(p); }
int fl_call_u32(void *fn, uint32_t v) { return ((int (*)(uint32_t))fn)(v); }
int fl_call_str(void *fn, const char *s) { return ((int (*)(const char *))fn)(s); }
