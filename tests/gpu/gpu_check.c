/*
 * gpu_check.c: the GPU tests' shared harness (gpu_check.h).
 */
#include "gpu_check.h"

#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int gpu_checks, gpu_failures, gpu_base_variant;
bool gpu_sm90, misalign;

// ---------------------------------------------------------------------------------------------
// Backends

void gpu_check_open(struct rnnd_backend *gpu, struct rnnd_backend *cpu) {
    int err = rnnd_backend_cuda_init(gpu, 0);
    if (err) {
        printf("no usable CUDA device (%s): skipped\n", rnnd_strerror(err));
        exit(77);
    }
    if (rnnd_backend_cpu_init(cpu) != 0) {
        fprintf(stderr, "cpu backend init failed\n");
        exit(1);
    }
    // RNND_CUDA_VARIANT: every case under variant bits that force other kernels (as the bench
    // takes them; kernels/cuda/tuning.h), e.g. 1024 for the 80-row LSTM H=256 clusters.
    const char *variant = getenv("RNND_CUDA_VARIANT");
    if (variant && *variant) {
        if (rnnd_cuda_set_variant(gpu, atoi(variant)) != 0) {
            fprintf(stderr, "RNND_CUDA_VARIANT=%s: not accepted\n", variant);
            exit(1);
        }
        gpu_base_variant = atoi(variant);
        printf("variant: %d\n", gpu_base_variant);
    }
    printf("device: %s\n", gpu->device);
    struct cudaDeviceProp prop;
    gpu_sm90 = cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9;
}

int gpu_check_close(struct rnnd_backend *gpu, struct rnnd_backend *cpu) {
    printf("%d checks, %d failed\n", gpu_checks, gpu_failures);
    rnnd_backend_free(gpu);
    rnnd_backend_free(cpu);
    return gpu_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// Random numbers and host helpers

static uint64_t rng_state = 0x1234abcdull;

void gpu_seed(const char *tag) { // FNV-1a
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)tag; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    rng_state = h;
}

uint64_t rng_next(void) { // splitmix64
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double rng_uniform(void) {
    return (double)(rng_next() >> 11) * 0x1.0p-53;
}

float *host_uniform(size_t n, float scale) {
    float *p = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        p[i] = (float)((2.0 * rng_uniform() - 1.0) * scale);
    return p;
}

void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    return p;
}

const char *compute_name(enum rnnd_compute c) {
    return c == RNND_COMPUTE_IEEE ? "ieee" : c == RNND_COMPUTE_BF16 ? "bf16" : "fp32";
}

double tolerance(enum rnnd_compute c) {
    return c == RNND_COMPUTE_IEEE ? 1e-5 : c == RNND_COMPUTE_BF16 ? 2e-2 : 1e-3;
}

// ---------------------------------------------------------------------------------------------
// Checks

void compare(const char *what, const char *tag, const float *a, const float *ref, const float *base,
             size_t n, double tol) {
    double num = 0.0, den = 0.0;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double x = a[i], y = ref[i];
        if (base) {
            x -= base[i];
            y -= base[i];
        }
        if (!isfinite(x)) {
            bad++;
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    double err = den > 0.0 ? sqrt(num / den) : sqrt(num);
    bool ok = bad == 0 && err <= tol;
    gpu_checks++;
    if (ok) {
        printf("  ok   %-34s %-12s rel %.2e (tol %.0e, n %zu)\n", tag, what, err, tol, n);
        return;
    }
    gpu_failures++;
    printf("  FAIL %-34s %-12s rel %.2e (tol %.0e, n %zu, %zu non-finite)\n", tag, what, err, tol,
           n, bad);
    double rms = sqrt(den / (n ? n : 1));
    int shown = 0;
    for (size_t i = 0; i < n && shown < 8; i++) {
        double x = a[i], y = ref[i];
        if (base) {
            x -= base[i];
            y -= base[i];
        }
        if (!isfinite(x) || fabs(x - y) > 10.0 * tol * (rms > 0 ? rms : 1.0)) {
            printf("       [%zu] gpu %.7g cpu %.7g\n", i, x, y);
            shown++;
        }
    }
}

void check(bool ok, const char *fmt, ...) {
    gpu_checks++;
    gpu_failures += !ok;
    printf("  %s ", ok ? "ok  " : "FAIL");
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

void fail(const char *fmt, ...) {
    gpu_failures++;
    printf("  FAIL ");
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

// ---------------------------------------------------------------------------------------------
// Device buffers through the vtable

void *dev(struct bufs *b, const void *host, size_t bytes) {
    void *d = NULL;
    if (b->n == (int)(sizeof(b->p) / sizeof(b->p[0])) ||
        b->be->ops->alloc(b->be->ctx, bytes, &d) != 0) {
        fprintf(stderr, "device alloc of %zu bytes failed\n", bytes);
        exit(1);
    }
    if (host && bytes)
        b->be->ops->copy_in(b->be->ctx, d, host, bytes);
    b->p[b->n++] = d;
    return d;
}

float *dev_poison(struct bufs *b, size_t n, bool nan_fill) {
    const size_t off = misalign ? 1 : 0;
    float *h = xmalloc((n + off) * sizeof(float));
    for (size_t i = 0; i < n + off; i++)
        h[i] = nan_fill ? NAN : 0.0f;
    float *d = dev(b, h, (n + off) * sizeof(float));
    free(h);
    return d + off;
}

float *dev_in(struct bufs *b, const float *host, size_t n) {
    if (!misalign)
        return dev(b, host, n * sizeof(float));
    float *d = dev(b, NULL, (n + 1) * sizeof(float));
    b->be->ops->copy_in(b->be->ctx, d + 1, host, n * sizeof(float));
    return d + 1;
}

void bufs_free(struct bufs *b) {
    for (int i = 0; i < b->n; i++)
        b->be->ops->free(b->be->ctx, b->p[i]);
    b->n = 0;
}

void to_host(struct rnnd_backend *be, float *h, const void *d, size_t n) {
    int err = be->ops->copy_out(be->ctx, h, d, n * sizeof(float));
    if (err) {
        fprintf(stderr, "copy_out failed: %s\n", rnnd_strerror(err));
        exit(1);
    }
}
