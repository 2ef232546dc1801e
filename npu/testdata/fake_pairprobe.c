/*
 * A fake pair-probe library for the npu tests, implementing
 * include/faultline_pairprobe.h over a table of link rates that
 * fake_control edits. No data moves: a probe returns the table's rate.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "faultline_pairprobe.h"

#define N 8
#define EFAIL 7

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static double rate[N][N];
static int failing[N][N];
static int configured, init_fails, inits, finis, n_devices = N;
static int64_t runs;
static uint64_t last_bytes;

static void configure(void) {
	if (configured)
		return;
	configured = 1;
	for (int a = 0; a < N; a++)
		for (int b = 0; b < N; b++)
			rate[a][b] = 20e9;
}

int faultline_pairprobe_version(void) {
	return FAULTLINE_PAIRPROBE_VERSION;
}

int faultline_pairprobe_init(void) {
	pthread_mutex_lock(&mu);
	configure();
	int rc = init_fails;
	if (rc == 0)
		inits++;
	pthread_mutex_unlock(&mu);
	return rc;
}

void faultline_pairprobe_fini(void) {
	pthread_mutex_lock(&mu);
	finis++;
	pthread_mutex_unlock(&mu);
}

int faultline_pairprobe_device_count(void) {
	return n_devices;
}

int faultline_pairprobe_run(int a, int b, uint64_t bytes, double *bytes_per_second) {
	if (bytes_per_second == NULL || bytes == 0)
		return FAULTLINE_PAIRPROBE_EINVAL;
	pthread_mutex_lock(&mu);
	int rc = FAULTLINE_PAIRPROBE_OK;
	if (a < 0 || b < 0 || a >= n_devices || b >= n_devices)
		rc = FAULTLINE_PAIRPROBE_ENODEV;
	else if (failing[a][b])
		rc = EFAIL;
	else
		*bytes_per_second = rate[a][b];
	runs++;
	last_bytes = bytes;
	pthread_mutex_unlock(&mu);
	return rc;
}

const char *faultline_pairprobe_strerror(int code) {
	switch (code) {
	case FAULTLINE_PAIRPROBE_OK:
		return "ok";
	case FAULTLINE_PAIRPROBE_ENODEV:
		return "no such device";
	case FAULTLINE_PAIRPROBE_EINVAL:
		return "invalid argument";
	case EFAIL:
		return "peer copy timed out";
	}
	return "unknown error";
}

/* ---- test control ----
 * rate a b c=bytes/s   set the rate of a->b
 * fail a b             a->b fails with EFAIL
 * init_fails a=code    faultline_pairprobe_init returns code
 * devices a=n          device count
 * runs, inits, finis, last_bytes
 */
int64_t fake_control(const char *op, int64_t a, int64_t b, int64_t c, const char *s1, const char *s2) {
	(void)s1;
	(void)s2;
	int64_t v = 0;
	pthread_mutex_lock(&mu);
	configure();
	int ok = a >= 0 && a < N && b >= 0 && b < N;
	if (strcmp(op, "rate") == 0 && ok)
		rate[a][b] = (double)c;
	else if (strcmp(op, "fail") == 0 && ok)
		failing[a][b] = 1;
	else if (strcmp(op, "init_fails") == 0)
		init_fails = (int)a;
	else if (strcmp(op, "devices") == 0 && a >= 0 && a <= N)
		n_devices = (int)a;
	else if (strcmp(op, "runs") == 0)
		v = runs;
	else if (strcmp(op, "inits") == 0)
		v = inits;
	else if (strcmp(op, "finis") == 0)
		v = finis;
	else if (strcmp(op, "last_bytes") == 0)
		v = (int64_t)last_bytes;
	else
		v = -1;
	pthread_mutex_unlock(&mu);
	return v;
}
