/* A C caller of libtaskd: compiled against the generated header by the
 * tests, it checks that the header is valid C and that the ABI's codes,
 * handles and last-error string behave as documented. argv[1] is a
 * folder for the records. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "libtaskd.h"

static int on_pause(void *user, const char *arg, char *out, size_t outlen) {
	(void)user;
	(void)arg;
	snprintf(out, outlen, "{\"step\":%d}", 3);
	return TASKD_OK;
}

#define CHECK(cond, what)                                                     \
	do {                                                                  \
		if (!(cond)) {                                                \
			fprintf(stderr, "FAIL %s: %s\n", what, taskd_last_error()); \
			return 1;                                             \
		}                                                             \
	} while (0)

int main(int argc, char **argv) {
	char opts[4096];
	uintptr_t h = 0;
	if (argc != 2)
		return 2;
	CHECK(taskd_init_worker(-1, 10, "pt", "", &h) == TASKD_EINVAL, "negative rank accepted");
	CHECK(strstr(taskd_last_error(), "rank_id") != NULL, "error does not name rank_id");
	CHECK(taskd_init_worker(0, 10, "pt", "", NULL) == TASKD_EINVAL, "NULL handle pointer accepted");
	snprintf(opts, sizeof opts,
	         "{\"job\":\"c-abi\",\"insecure\":true,\"root\":\"%s\",\"marker_library\":\"off\","
	         "\"switch\":{\"FP\":\"on\"}}",
	         argv[1]);
	CHECK(taskd_init_worker(0, 10, NULL, opts, &h) == TASKD_OK, "init");
	int64_t id = taskd_range_start(h, "forward", "default");
	CHECK(id > 0, "forward not recorded");
	CHECK(taskd_range_start(h, "dataloader", NULL) == 0, "dataloader recorded while off");
	CHECK(taskd_range_start(h, "backward", NULL) == TASKD_EINVAL, "bad name accepted");
	CHECK(taskd_range_end(h, id) == TASKD_OK, "end");
	CHECK(taskd_range_end(h, id) == TASKD_ENOENT, "second end");
	CHECK(taskd_mark(h, "forward", "") == TASKD_OK, "mark");
	CHECK(taskd_register_callback(h, TASKD_EVENT_PAUSE, on_pause, NULL) == TASKD_OK, "register");
	CHECK(taskd_register_callback(h, 99, on_pause, NULL) == TASKD_EINVAL, "event 99 accepted");
	CHECK(taskd_start_manager(h) == TASKD_EHANDLE, "a worker handle taken as a manager's");
	CHECK(taskd_flush(h) == TASKD_OK, "flush");
	CHECK(taskd_destroy(h) == TASKD_OK, "destroy");
	CHECK(taskd_destroy(h) == TASKD_EHANDLE, "second destroy");
	CHECK(taskd_range_start(h, "forward", "default") == TASKD_EHANDLE, "range after destroy");
	puts("ok");
	return 0;
}
