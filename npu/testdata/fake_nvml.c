/*
 * A fake libnvidia-ml for the npu tests: the NVML functions npu calls, with
 * the real names, types and return codes (nvml.h), answering from a small
 * table of devices that fake_control edits.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
	NVML_SUCCESS = 0,
	NVML_ERROR_UNINITIALIZED = 1,
	NVML_ERROR_INVALID_ARGUMENT = 2,
	NVML_ERROR_NOT_SUPPORTED = 3,
	NVML_ERROR_DRIVER_NOT_LOADED = 9,
	NVML_ERROR_GPU_IS_LOST = 15,
};

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
	unsigned int gpu;
	unsigned int memory;
} nvmlUtilization_t;
typedef struct {
	unsigned long long total;
	unsigned long long free;
	unsigned long long used;
} nvmlMemory_t;
typedef union {
	double dVal;
	unsigned int uiVal;
	unsigned long ulVal;
	unsigned long long ullVal;
	signed long long sllVal;
	signed int siVal;
} nvmlValue_t;
typedef struct {
	unsigned int fieldId;
	unsigned int scopeId;
	long long timestamp;
	long long latencyUsec;
	int valueType;
	nvmlReturn_t nvmlReturn;
	nvmlValue_t value;
} nvmlFieldValue_t;

#define MAX_DEVICES 8
#define MAX_LINKS 18
#define FI_NVLINK_DATA_TX 138
#define FI_NVLINK_DATA_RX 139
#define VALUE_TYPE_ULL 3

struct nvmlDevice_st {
	int index;
	int lost;
	unsigned int util;
	unsigned long long used;
	unsigned long long ecc_uncorrected;
	unsigned int remap_pending, remap_failure;
	int link_down[MAX_LINKS];
	unsigned long long link_errors;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct nvmlDevice_st devices[MAX_DEVICES];
static int n_devices = 2, n_links = 4, no_driver, inits, configured;

static void configure(void) {
	if (configured)
		return;
	configured = 1;
	for (int i = 0; i < MAX_DEVICES; i++) {
		devices[i].index = i;
		devices[i].util = (unsigned)(10 * (i + 1));
		devices[i].used = (unsigned long long)(i + 1) << 30;
	}
}

static nvmlReturn_t check(nvmlDevice_t d) {
	if (inits == 0)
		return NVML_ERROR_UNINITIALIZED;
	if (d == NULL || d < devices || d >= devices + n_devices)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (d->lost)
		return NVML_ERROR_GPU_IS_LOST;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) {
	pthread_mutex_lock(&mu);
	configure();
	nvmlReturn_t rc = NVML_SUCCESS;
	if (no_driver)
		rc = NVML_ERROR_DRIVER_NOT_LOADED;
	else
		inits++;
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlShutdown(void) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = NVML_ERROR_UNINITIALIZED;
	if (inits > 0) {
		inits--;
		rc = NVML_SUCCESS;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

const char *nvmlErrorString(nvmlReturn_t r) {
	switch (r) {
	case NVML_SUCCESS:
		return "Success";
	case NVML_ERROR_UNINITIALIZED:
		return "Uninitialized";
	case NVML_ERROR_INVALID_ARGUMENT:
		return "Invalid Argument";
	case NVML_ERROR_NOT_SUPPORTED:
		return "Not Supported";
	case NVML_ERROR_DRIVER_NOT_LOADED:
		return "Driver Not Loaded";
	case NVML_ERROR_GPU_IS_LOST:
		return "GPU is lost";
	}
	return "Unknown Error";
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
	if (count == NULL)
		return NVML_ERROR_INVALID_ARGUMENT;
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = inits ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
	*count = (unsigned)n_devices;
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
	if (device == NULL || index >= (unsigned)n_devices)
		return NVML_ERROR_INVALID_ARGUMENT;
	*device = &devices[index];
	return inits ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS) {
		u->gpu = d->util;
		u->memory = d->util / 2;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS) {
		m->total = 80ull << 30;
		m->used = d->used;
		m->free = m->total - m->used;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType, unsigned long long *count) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS)
		*count = (errorType == 1 && counterType == 0) ? d->ecc_uncorrected : 0;
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                                       unsigned int *failure) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS) {
		*corr = 0;
		*unc = d->remap_pending + d->remap_failure;
		*pending = d->remap_pending;
		*failure = d->remap_failure;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *active) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS) {
		if (link >= MAX_LINKS)
			rc = NVML_ERROR_INVALID_ARGUMENT;
		else if (link >= (unsigned)n_links)
			rc = NVML_ERROR_NOT_SUPPORTED;
		else
			*active = !d->link_down[link];
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t d, unsigned int link, int counter,
                                             unsigned long long *value) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS) {
		if (link >= (unsigned)n_links)
			rc = NVML_ERROR_NOT_SUPPORTED;
		else if (counter == 4) /* DL_ECC_DATA: not on this fake part */
			rc = NVML_ERROR_NOT_SUPPORTED;
		else /* replay 0, recovery 1, CRC flit 2, CRC data 3 */
			*value = d->link_errors * (unsigned long long)(counter + 1) + link;
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
	pthread_mutex_lock(&mu);
	nvmlReturn_t rc = check(d);
	if (rc == NVML_SUCCESS) {
		for (int i = 0; i < count; i++) {
			nvmlFieldValue_t *v = &values[i];
			v->timestamp = 1;
			v->latencyUsec = 0;
			v->valueType = VALUE_TYPE_ULL;
			if (v->scopeId >= (unsigned)n_links) {
				v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
				continue;
			}
			v->nvmlReturn = NVML_SUCCESS;
			unsigned long long base = 1000ull * (unsigned long long)(d->index + 1) * (v->scopeId + 1);
			if (v->fieldId == FI_NVLINK_DATA_TX)
				v->value.ullVal = base;
			else if (v->fieldId == FI_NVLINK_DATA_RX)
				v->value.ullVal = 2 * base;
			else
				v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
		}
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

/* ---- test control ----
 * no_driver a=1|0   nvmlInit_v2 fails with NVML_ERROR_DRIVER_NOT_LOADED
 * devices a=n       number of devices (<= 8)
 * links a=n         NvLinks per device (<= 18)
 * lost a=dev        the device answers NVML_ERROR_GPU_IS_LOST
 * link_down a=dev b=link
 * ecc a=dev b=uncorrected volatile count
 * remap a=dev b=1 pending | 2 failure
 * link_errors a=dev b=base error count
 * util a=dev b=percent
 * inits             how many nvmlInit_v2 calls are not yet shut down
 */
int64_t fake_control(const char *op, int64_t a, int64_t b, int64_t c, const char *s1, const char *s2) {
	(void)c;
	(void)s1;
	(void)s2;
	int64_t v = 0;
	pthread_mutex_lock(&mu);
	configure();
	int dev = (a >= 0 && a < MAX_DEVICES) ? (int)a : 0;
	if (strcmp(op, "no_driver") == 0)
		no_driver = (int)a;
	else if (strcmp(op, "devices") == 0 && a >= 0 && a <= MAX_DEVICES)
		n_devices = (int)a;
	else if (strcmp(op, "links") == 0 && a >= 0 && a <= MAX_LINKS)
		n_links = (int)a;
	else if (strcmp(op, "lost") == 0)
		devices[dev].lost = 1;
	else if (strcmp(op, "link_down") == 0 && b >= 0 && b < MAX_LINKS)
		devices[dev].link_down[b] = 1;
	else if (strcmp(op, "ecc") == 0)
		devices[dev].ecc_uncorrected = (unsigned long long)b;
	else if (strcmp(op, "remap") == 0) {
		devices[dev].remap_pending = b == 1;
		devices[dev].remap_failure = b == 2;
	} else if (strcmp(op, "link_errors") == 0)
		devices[dev].link_errors = (unsigned long long)b;
	else if (strcmp(op, "util") == 0)
		devices[dev].util = (unsigned)b;
	else if (strcmp(op, "inits") == 0)
		v = inits;
	else
		v = -1;
	pthread_mutex_unlock(&mu);
	return v;
}
