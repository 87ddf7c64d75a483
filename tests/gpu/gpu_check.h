/*
 * gpu_check.h: what the GPU tests share (tests/gpu/test_<op>_cuda.c, docs/style.md section 8): both
 * backends opened through the same vtable, inputs drawn from a generator seeded per case (so a
 * case draws the same inputs wherever it stands in its table), device buffers poisoned with NaN
 * before an op (an element the op forgot to write fails), and the norm-wise comparison
 * ||gpu - cpu|| / ||cpu|| against docs/design.md "Math"'s bound for the compute mode (ieee 1e-5,
 * fp32/TF32 1e-3, bf16 2e-2), which prints the first mismatching indices on failure. Each
 * comparison is one check; a test binary ends with "N checks, M failed" and exits 1 on a failure,
 * 77 (CTest: skipped) when no CUDA device is usable.
 */
#ifndef RNND_TESTS_GPU_CHECK_H
#define RNND_TESTS_GPU_CHECK_H

#include "rnnd_kernels.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Checks run and failed so far (gpu_check_close prints them).
extern int gpu_checks, gpu_failures;
// RNND_CUDA_VARIANT, the variant bits every case runs under (kernels/cuda/tuning.h); a test that
// sets others adds them to these and restores these after.
extern int gpu_base_variant;
// The device is compute capability 9.0.
extern bool gpu_sm90;

// Opens the CUDA backend on device 0 and the CPU backend, applies RNND_CUDA_VARIANT and prints
// the device. Exits 77 without a usable CUDA device, 1 when the CPU backend or the variant fails.
void gpu_check_open(struct rnnd_backend *gpu, struct rnnd_backend *cpu);
// Prints "N checks, M failed", frees both backends; the exit status: 1 on a failure, else 0.
int gpu_check_close(struct rnnd_backend *gpu, struct rnnd_backend *cpu);

// Seeds the input generator from a case's tag.
void gpu_seed(const char *tag);
uint64_t rng_next(void);
double rng_uniform(void); // [0, 1)
// n floats uniform in +-scale (malloc'ed; free with free).
float *host_uniform(size_t n, float scale);
// malloc that exits on failure.
void *xmalloc(size_t n);

const char *compute_name(enum rnnd_compute c);
// docs/design.md "Math"'s bound for the mode.
double tolerance(enum rnnd_compute c);

// One check: a (gpu) against ref (cpu), both minus base where given (+= outputs), norm-wise
// within tol; non-finite values in a fail.
void compare(const char *what, const char *tag, const float *a, const float *ref, const float *base,
             size_t n, double tol);
// One check with an outcome of the test's own: "ok" or "FAIL", then the line fmt prints.
void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// A failure that is no check of its own (an op that returned an error): "FAIL", then fmt.
void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// Device buffers of one backend, freed together.
struct bufs {
    struct rnnd_backend *be;
    void *p[32];
    int n;
};
// bytes of device memory, filled from host when not NULL.
void *dev(struct bufs *b, const void *host, size_t bytes);
// Where set, dev_poison and dev_in return buffers one float past 16-byte alignment.
extern bool misalign;
// n floats filled with NaN (nan_fill) or zero.
float *dev_poison(struct bufs *b, size_t n, bool nan_fill);
// A device copy of n host floats.
float *dev_in(struct bufs *b, const float *host, size_t n);
void bufs_free(struct bufs *b);
// n floats from device d to host h (exits on failure).
void to_host(struct rnnd_backend *be, float *h, const void *d, size_t n);

#endif // RNND_TESTS_GPU_CHECK_H
