/*
 * faultline_pairprobe.h: the C interface of a device pair-probe library, as
 * npu.OpenPairProbe loads it (dlopen by name or path, then dlsym).
 *
 * A vendor (or a site) builds a shared library that measures the bandwidth of
 * the link between two accelerators of this host, for example by timing a
 * peer-to-peer copy, and exports the functions below. No header or library of
 * Faultline is needed to build it: the names and types are the contract.
 *
 * Version 1.
 */
#ifndef FAULTLINE_PAIRPROBE_H
#define FAULTLINE_PAIRPROBE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FAULTLINE_PAIRPROBE_VERSION 1

/* Return codes. Any other non-zero value is a library-specific failure. */
#define FAULTLINE_PAIRPROBE_OK 0
#define FAULTLINE_PAIRPROBE_ENODEV 1 /* no such device, or no driver: npu.ErrNoDevice */
#define FAULTLINE_PAIRPROBE_EINVAL 2 /* bad argument */

/* Required. Returns FAULTLINE_PAIRPROBE_VERSION. */
int faultline_pairprobe_version(void);

/* Optional. Called once when the library is opened; non-zero fails the open
 * (FAULTLINE_PAIRPROBE_ENODEV means there is no device to probe). */
int faultline_pairprobe_init(void);

/* Required. Number of devices that a and b below may name (0 .. count-1). */
int faultline_pairprobe_device_count(void);

/* Required. Moves about `bytes` bytes from device a to device b and stores
 * the measured rate in *bytes_per_second. Calls are serialised by the
 * caller; a call may take as long as the transfer takes. */
int faultline_pairprobe_run(int a, int b, uint64_t bytes, double *bytes_per_second);

/* Optional. A static, NUL-terminated description of a return code. */
const char *faultline_pairprobe_strerror(int code);

/* Optional. Called once when the library is closed. */
void faultline_pairprobe_fini(void);

#ifdef __cplusplus
}
#endif

#endif
