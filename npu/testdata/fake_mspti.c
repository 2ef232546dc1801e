/*
 * A fake libmspti for the npu tests: the part of the msPTI activity API that
 * npu uses, with the real function names, types, return codes and record
 * layout (mspti_activity.h, mspti_callback.h), plus fake_control, through
 * which a test makes the "driver" emit marker records on demand.
 *
 * Records are written into the buffers that the registered buffer-requested
 * callback hands out and returned through the buffer-completed callback, as
 * the real library does. When no buffer is given, the record is dropped and
 * counted.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef enum {
	MSPTI_SUCCESS = 0,
	MSPTI_ERROR_INVALID_PARAMETER = 1,
	MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 2,
	MSPTI_ERROR_MAX_LIMIT_REACHED = 3,
	MSPTI_ERROR_INNER = 999,
} msptiResult;

typedef enum {
	MSPTI_ACTIVITY_KIND_INVALID = 0,
	MSPTI_ACTIVITY_KIND_MARKER = 1,
	MSPTI_ACTIVITY_KIND_KERNEL = 2,
	MSPTI_ACTIVITY_KIND_API = 3,
} msptiActivityKind;

#define PACKED_ALIGNMENT __attribute__((__packed__)) __attribute__((aligned(8)))

typedef struct PACKED_ALIGNMENT {
	msptiActivityKind kind;
} msptiActivity;

typedef union PACKED_ALIGNMENT {
	struct {
		uint32_t processId;
		uint32_t threadId;
	} pt;
	struct {
		uint32_t deviceId;
		uint32_t streamId;
	} ds;
} msptiObjectId;

typedef struct PACKED_ALIGNMENT {
	msptiActivityKind kind;
	uint32_t flag;       /* msptiActivityFlag */
	uint32_t sourceKind; /* msptiActivitySourceKind */
	uint64_t timestamp;
	uint64_t id;
	msptiObjectId objectId;
	const char *name;
	const char *domain;
} msptiActivityMarker;

typedef struct PACKED_ALIGNMENT {
	msptiActivityKind kind;
	uint64_t start;
	uint64_t end;
	struct {
		uint32_t processId;
		uint32_t threadId;
	} pt;
	uint64_t correlationId;
	const char *name;
} msptiActivityApi;

typedef struct msptiSubscriber_st *msptiSubscriberHandle;
typedef void (*msptiCallbackFunc)(void *userdata, int domain, uint32_t cbid, const void *cbdata);
typedef void (*msptiBuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size, size_t *maxNumRecords);
typedef void (*msptiBuffersCallbackCompleteFunc)(uint8_t *buffer, size_t size, size_t validSize);

struct msptiSubscriber_st {
	msptiCallbackFunc cb;
	void *userdata;
};

#define FLAG_DEVICE_MASK (8u | 16u | 32u)
#define MAX_DOMAINS 16

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct msptiSubscriber_st subscriber;
static int subscribed;
static msptiBuffersCallbackRequestFunc requested;
static msptiBuffersCallbackCompleteFunc completed;
static int marker_enabled;
static char *disabled_domains[MAX_DOMAINS];

static uint8_t *cur;
static size_t cur_size, cur_used, cur_max, cur_count;

static uint64_t clock_ns = 1700000000000000000ull;
static uint32_t device_id = 3, stream_id = 9;
static int64_t n_emitted, n_dropped, n_filtered, n_requests, n_completions;

static char fail_name[128];
static int fail_code;

/* Interned strings live as long as the library: records point at them. */
struct interned {
	struct interned *next;
	char s[];
};
static struct interned *strings;

static const char *intern(const char *s) {
	if (s == NULL)
		return NULL;
	for (struct interned *p = strings; p; p = p->next)
		if (strcmp(p->s, s) == 0)
			return p->s;
	size_t n = strlen(s);
	struct interned *p = malloc(sizeof *p + n + 1);
	if (p == NULL)
		return NULL;
	memcpy(p->s, s, n + 1);
	p->next = strings;
	strings = p;
	return p->s;
}

static int failing(const char *fn) {
	return fail_code != 0 && strcmp(fail_name, fn) == 0;
}

static int domain_disabled(const char *d) {
	if (d == NULL)
		d = "default";
	for (int i = 0; i < MAX_DOMAINS; i++)
		if (disabled_domains[i] && strcmp(disabled_domains[i], d) == 0)
			return 1;
	return 0;
}

/* complete_current hands the current buffer back. Called with mu held, as
 * the real library calls its callbacks from inside its own locks. */
static void complete_current(int even_empty) {
	if (cur == NULL || (cur_used == 0 && !even_empty))
		return;
	uint8_t *b = cur;
	size_t size = cur_size, used = cur_used;
	cur = NULL;
	cur_size = cur_used = cur_max = cur_count = 0;
	n_completions++;
	completed(b, size, used);
}

static void request_buffer(void) {
	uint8_t *b = NULL;
	size_t size = 0, max = 0;
	n_requests++;
	requested(&b, &size, &max);
	if (b == NULL || size < sizeof(msptiActivityMarker))
		return;
	cur = b;
	cur_size = size;
	cur_max = max;
	cur_used = cur_count = 0;
}

/* reserve returns room for a record of n bytes, or NULL (dropped). */
static uint8_t *reserve(size_t n) {
	if (requested == NULL || completed == NULL)
		return NULL;
	if (cur != NULL && (cur_used + n > cur_size || (cur_max > 0 && cur_count >= cur_max)))
		complete_current(0);
	if (cur == NULL)
		request_buffer();
	if (cur == NULL || cur_used + n > cur_size)
		return NULL;
	uint8_t *p = cur + cur_used;
	cur_used += n;
	cur_count++;
	return p;
}

static uint32_t thread_id(void) {
	return (uint32_t)syscall(SYS_gettid);
}

static void emit_markers(int64_t n, uint32_t flag, uint64_t id, const char *name, const char *domain) {
	pthread_mutex_lock(&mu);
	const char *nm = intern(name);
	const char *dm = (domain == NULL || domain[0] == 0) ? NULL : intern(domain);
	uint32_t pid = (uint32_t)getpid(), tid = thread_id();
	for (int64_t i = 0; i < n; i++) {
		if (!marker_enabled || domain_disabled(dm)) {
			n_filtered++;
			continue;
		}
		msptiActivityMarker *m = (msptiActivityMarker *)reserve(sizeof *m);
		if (m == NULL) {
			n_dropped++;
			continue;
		}
		memset(m, 0, sizeof *m);
		m->kind = MSPTI_ACTIVITY_KIND_MARKER;
		m->flag = flag;
		clock_ns += 1000;
		m->timestamp = clock_ns;
		m->id = id + (uint64_t)i;
		if (flag & FLAG_DEVICE_MASK) {
			m->sourceKind = 1;
			m->objectId.ds.deviceId = device_id;
			m->objectId.ds.streamId = stream_id;
		} else {
			m->sourceKind = 0;
			m->objectId.pt.processId = pid;
			m->objectId.pt.threadId = tid;
		}
		m->name = nm;
		m->domain = dm;
		n_emitted++;
	}
	pthread_mutex_unlock(&mu);
}

static void emit_api(int64_t n) {
	pthread_mutex_lock(&mu);
	for (int64_t i = 0; i < n; i++) {
		msptiActivityApi *a = (msptiActivityApi *)reserve(sizeof *a);
		if (a == NULL) {
			n_dropped++;
			continue;
		}
		memset(a, 0, sizeof *a);
		a->kind = MSPTI_ACTIVITY_KIND_API;
		a->start = clock_ns;
		a->end = clock_ns + 10;
		a->name = intern("aclrtSynchronizeStream");
		n_emitted++;
	}
	pthread_mutex_unlock(&mu);
}

struct emit_args {
	int64_t n;
	uint32_t flag;
	uint64_t id;
	const char *name, *domain;
};

static void *emit_thread(void *p) {
	struct emit_args *a = p;
	emit_markers(a->n, a->flag, a->id, a->name, a->domain);
	return NULL;
}

static void *flush_thread(void *p) {
	(void)p;
	pthread_mutex_lock(&mu);
	complete_current(0);
	pthread_mutex_unlock(&mu);
	return NULL;
}

/* ---- the msPTI API ---- */

msptiResult msptiSubscribe(msptiSubscriberHandle *sub, msptiCallbackFunc cb, void *userdata) {
	if (sub == NULL)
		return MSPTI_ERROR_INVALID_PARAMETER;
	pthread_mutex_lock(&mu);
	if (failing("msptiSubscribe")) {
		pthread_mutex_unlock(&mu);
		return fail_code;
	}
	if (subscribed) {
		pthread_mutex_unlock(&mu);
		return MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
	}
	subscribed = 1;
	subscriber.cb = cb;
	subscriber.userdata = userdata;
	*sub = &subscriber;
	pthread_mutex_unlock(&mu);
	return MSPTI_SUCCESS;
}

msptiResult msptiUnsubscribe(msptiSubscriberHandle sub) {
	pthread_mutex_lock(&mu);
	if (sub != &subscriber || !subscribed) {
		pthread_mutex_unlock(&mu);
		return MSPTI_ERROR_INVALID_PARAMETER;
	}
	/* Give back the buffer in hand, even an empty one, so that its owner
	 * can free it. */
	complete_current(1);
	subscribed = 0;
	marker_enabled = 0;
	pthread_mutex_unlock(&mu);
	return MSPTI_SUCCESS;
}

msptiResult msptiActivityRegisterCallbacks(msptiBuffersCallbackRequestFunc req, msptiBuffersCallbackCompleteFunc done) {
	if (req == NULL || done == NULL)
		return MSPTI_ERROR_INVALID_PARAMETER;
	pthread_mutex_lock(&mu);
	if (failing("msptiActivityRegisterCallbacks")) {
		pthread_mutex_unlock(&mu);
		return fail_code;
	}
	requested = req;
	completed = done;
	pthread_mutex_unlock(&mu);
	return MSPTI_SUCCESS;
}

msptiResult msptiActivityEnable(msptiActivityKind kind) {
	pthread_mutex_lock(&mu);
	int rc = MSPTI_SUCCESS;
	if (failing("msptiActivityEnable"))
		rc = fail_code;
	else if (kind == MSPTI_ACTIVITY_KIND_MARKER)
		marker_enabled = 1;
	pthread_mutex_unlock(&mu);
	return rc;
}

msptiResult msptiActivityDisable(msptiActivityKind kind) {
	pthread_mutex_lock(&mu);
	int rc = MSPTI_SUCCESS;
	if (failing("msptiActivityDisable"))
		rc = fail_code;
	else if (kind == MSPTI_ACTIVITY_KIND_MARKER)
		marker_enabled = 0;
	pthread_mutex_unlock(&mu);
	return rc;
}

msptiResult msptiActivityEnableMarkerDomain(const char *name) {
	if (name == NULL)
		return MSPTI_ERROR_INVALID_PARAMETER;
	pthread_mutex_lock(&mu);
	int rc = MSPTI_SUCCESS;
	if (failing("msptiActivityEnableMarkerDomain"))
		rc = fail_code;
	else
		for (int i = 0; i < MAX_DOMAINS; i++)
			if (disabled_domains[i] && strcmp(disabled_domains[i], name) == 0) {
				free(disabled_domains[i]);
				disabled_domains[i] = NULL;
			}
	pthread_mutex_unlock(&mu);
	return rc;
}

msptiResult msptiActivityDisableMarkerDomain(const char *name) {
	if (name == NULL)
		return MSPTI_ERROR_INVALID_PARAMETER;
	pthread_mutex_lock(&mu);
	int rc = MSPTI_SUCCESS;
	if (failing("msptiActivityDisableMarkerDomain"))
		rc = fail_code;
	else if (!domain_disabled(name)) {
		rc = MSPTI_ERROR_INNER;
		for (int i = 0; i < MAX_DOMAINS; i++)
			if (disabled_domains[i] == NULL) {
				disabled_domains[i] = strdup(name);
				rc = MSPTI_SUCCESS;
				break;
			}
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

static size_t record_size(const msptiActivity *r) {
	switch (r->kind) {
	case MSPTI_ACTIVITY_KIND_MARKER:
		return sizeof(msptiActivityMarker);
	case MSPTI_ACTIVITY_KIND_API:
		return sizeof(msptiActivityApi);
	default:
		return 0;
	}
}

msptiResult msptiActivityGetNextRecord(uint8_t *buffer, size_t valid, msptiActivity **record) {
	if (buffer == NULL || record == NULL)
		return MSPTI_ERROR_INVALID_PARAMETER;
	size_t off = 0;
	if (*record != NULL) {
		size_t n = record_size(*record);
		if (n == 0)
			return MSPTI_ERROR_INVALID_PARAMETER;
		off = (size_t)((uint8_t *)*record - buffer) + n;
	}
	if (off + sizeof(msptiActivity) > valid)
		return MSPTI_ERROR_MAX_LIMIT_REACHED;
	msptiActivity *next = (msptiActivity *)(buffer + off);
	size_t n = record_size(next);
	if (n == 0 || off + n > valid)
		return MSPTI_ERROR_MAX_LIMIT_REACHED;
	*record = next;
	return MSPTI_SUCCESS;
}

msptiResult msptiActivityFlushAll(uint32_t flag) {
	(void)flag;
	pthread_mutex_lock(&mu);
	int rc = MSPTI_SUCCESS;
	if (failing("msptiActivityFlushAll"))
		rc = fail_code;
	else
		complete_current(0);
	pthread_mutex_unlock(&mu);
	return rc;
}

/* ---- test control ----
 *
 * emit        a=n b=flag c=first id s1=name s2=domain: n marker records, ids c, c+1, ...
 * emit_thread same, from a new thread (callbacks run on a thread Go did not create)
 * emit_api    a=n: n records of another activity kind
 * flush_thread  hand back the current buffer from a new thread
 * complete_foreign  call the completed callback with a buffer it never handed out
 * fail        s1=function a=code: make that function return code (a=0 clears)
 * set_device  a=device b=stream for device-side records
 * force_enable  turn marker activity on behind the subscriber's back
 * emitted, dropped, filtered, requests, completions, marker_enabled,
 * subscribed: counters and state; domain_enabled s1=name
 */
int64_t fake_control(const char *op, int64_t a, int64_t b, int64_t c, const char *s1, const char *s2) {
	if (strcmp(op, "emit") == 0) {
		emit_markers(a, (uint32_t)b, (uint64_t)c, s1, s2);
		return 0;
	}
	if (strcmp(op, "emit_thread") == 0) {
		struct emit_args args = {a, (uint32_t)b, (uint64_t)c, s1, s2};
		pthread_t t;
		if (pthread_create(&t, NULL, emit_thread, &args) != 0)
			return -1;
		pthread_join(t, NULL);
		return 0;
	}
	if (strcmp(op, "emit_api") == 0) {
		emit_api(a);
		return 0;
	}
	if (strcmp(op, "flush_thread") == 0) {
		pthread_t t;
		if (pthread_create(&t, NULL, flush_thread, NULL) != 0)
			return -1;
		pthread_join(t, NULL);
		return 0;
	}
	if (strcmp(op, "complete_foreign") == 0) {
		static uint8_t foreign[64];
		pthread_mutex_lock(&mu);
		if (completed)
			completed(foreign, sizeof foreign, sizeof foreign);
		pthread_mutex_unlock(&mu);
		return 0;
	}
	int64_t v = -1;
	pthread_mutex_lock(&mu);
	if (strcmp(op, "fail") == 0) {
		fail_code = (int)a;
		strncpy(fail_name, s1 ? s1 : "", sizeof fail_name - 1);
		v = 0;
	} else if (strcmp(op, "force_enable") == 0) {
		marker_enabled = 1;
		v = 0;
	} else if (strcmp(op, "set_device") == 0) {
		device_id = (uint32_t)a;
		stream_id = (uint32_t)b;
		v = 0;
	} else if (strcmp(op, "emitted") == 0) {
		v = n_emitted;
	} else if (strcmp(op, "dropped") == 0) {
		v = n_dropped;
	} else if (strcmp(op, "filtered") == 0) {
		v = n_filtered;
	} else if (strcmp(op, "requests") == 0) {
		v = n_requests;
	} else if (strcmp(op, "completions") == 0) {
		v = n_completions;
	} else if (strcmp(op, "marker_enabled") == 0) {
		v = marker_enabled;
	} else if (strcmp(op, "subscribed") == 0) {
		v = subscribed;
	} else if (strcmp(op, "domain_enabled") == 0) {
		v = !domain_disabled(s1);
	}
	pthread_mutex_unlock(&mu);
	return v;
}
