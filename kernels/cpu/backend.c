/*
 * backend.c: the CPU reference backend's vtable (struct rnnd_backend_ops), its memory ops (host
 * memory: alloc is aligned_alloc, alloc_lazy an mmap, copies are memcpy, sync does nothing) and its context: the
 * scratch arena that ops grow on demand, and the thread pool (rnnd_threadpool.h) that runs their
 * phases. The math lives in rnn.c, gru.c, lstm.c, linear.c, policy.c, traj.c and optim.c (see
 * cpu.h for the tour).
 *
 * Threads. The backend runs on RNND_CPU_THREADS threads (else OPENBLAS_NUM_THREADS, else the CPUs
 * this process may run on), the calling thread included; the workers sleep on a condition
 * variable between phases, so an idle backend costs nothing. OpenBLAS itself is set to one
 * thread (openblas_set_num_threads(1), process-wide): its own threads would otherwise be woken
 * for every small per-step sgemm and spin between calls, which on a loaded machine (a daemon
 * shares its cores with gRPC and the rest) turns each step into a wait for a time slice.
 * rnn.c instead splits work so that no thread waits inside a time loop.
 */
#include "cpu.h"

#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cblas.h>

#define CPU_ALIGN 64

// ---------------------------------------------------------------------------------------------
// Scratch

static void *aligned_bytes(size_t bytes) {
    size_t rounded = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    return aligned_alloc(CPU_ALIGN, rounded ? rounded : CPU_ALIGN);
}

int rnnd__cpu_reserve(struct cpu_ctx *c, size_t work_bytes) {
    if (work_bytes <= c->work_bytes)
        return 0;
    // Grow by at least half again, so a slowly growing T does not reallocate every call.
    size_t want = work_bytes > c->work_bytes / 2 * 3 ? work_bytes : c->work_bytes / 2 * 3;
    void *p = aligned_bytes(want);
    if (p == NULL)
        return RNND_ENOMEM;
    free(c->work);
    c->work = p;
    c->work_bytes = want;
    return 0;
}

void *rnnd__cpu_carve(struct cpu_carve *cv, size_t bytes) {
    size_t at = (cv->used + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    cv->used = at + bytes;
    return cv->base ? cv->base + at : NULL;
}

// ---------------------------------------------------------------------------------------------
// Threads

void rnnd__cpu_parallel(struct cpu_ctx *c, int n, rnnd_threadpool_fn fn, void *arg) {
    rnnd_threadpool_run(c->pool, n, fn, arg);
}

// RNND_CPU_THREADS, else OPENBLAS_NUM_THREADS, else the CPUs this process may run on.
static int cpu_thread_count(void) {
    const char *env = getenv("RNND_CPU_THREADS");
    if (env == NULL || *env == '\0')
        env = getenv("OPENBLAS_NUM_THREADS");
    int n = env ? atoi(env) : 0;
    if (n < 1) {
        cpu_set_t set;
        n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                         : (int)sysconf(_SC_NPROCESSORS_ONLN);
    }
    return n < 1 ? 1 : n > RNND_CPU_MAX_THREADS ? RNND_CPU_MAX_THREADS : n;
}

// ---------------------------------------------------------------------------------------------
// Vtable entries

static void cpu_destroy(void *ctx) {
    struct cpu_ctx *c = ctx;
    if (c == NULL)
        return;
    rnnd_threadpool_free(c->pool);
    free(c->work);
    free(c);
}

static int cpu_alloc(void *ctx, size_t bytes, void **out) {
    (void)ctx;
    if (out == NULL)
        return RNND_EINVAL;
    *out = aligned_bytes(bytes);
    return *out ? 0 : RNND_ENOMEM;
}

static void cpu_free(void *ctx, void *ptr) {
    (void)ctx;
    free(ptr);
}

// Pages come on first touch and nothing is reserved for them up front (MAP_NORESERVE), as the
// old per-env rings grew: a store for --max-envs envs costs the memory of the envs that record.
static int cpu_alloc_lazy(void *ctx, size_t bytes, void **out) {
    (void)ctx;
    if (out == NULL)
        return RNND_EINVAL;
    void *p = mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    *out = p == MAP_FAILED ? NULL : p;
    return *out ? 0 : RNND_ENOMEM;
}

static void cpu_free_lazy(void *ctx, void *ptr, size_t bytes) {
    (void)ctx;
    if (ptr)
        munmap(ptr, bytes ? bytes : 1);
}

// Host and backend memory are one on the CPU: staging buffers are ordinary allocations.
static int cpu_host_alloc(void *ctx, size_t bytes, void **out) {
    return cpu_alloc(ctx, bytes, out);
}

static int cpu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    if (bytes == 0)
        return 0;
    if (dst == NULL || src == NULL)
        return RNND_EINVAL;
    memmove(dst, src, bytes);
    return 0;
}

static int cpu_zero(void *ctx, void *dst, size_t bytes) {
    (void)ctx;
    if (bytes == 0)
        return 0;
    if (dst == NULL)
        return RNND_EINVAL;
    memset(dst, 0, bytes);
    return 0;
}

static int cpu_sync(void *ctx) {
    (void)ctx;
    return 0;
}

static int cpu_nonfinite(void *ctx, const float *x, size_t n, int64_t *first) {
    (void)ctx;
    if (x == NULL && n > 0)
        return RNND_EINVAL;
    size_t i = rnnd_first_nonfinite(x, RNND_FTYPE_F32, n);
    *first = i < n ? (int64_t)i : -1;
    return 0;
}

static int cpu_supports(void *ctx, const struct rnnd_model *m) {
    (void)ctx;
    return rnnd_model_check(m);
}

static size_t cpu_tape_bytes(void *ctx, const struct rnnd_model *m, int B, int T) {
    (void)ctx;
    return rnnd__cpu_tape_bytes(m, B, T);
}

static int cpu_rnn_forward(void *ctx, float *out, float *h_n, float *c_n, void *tape,
                           const struct rnnd_seq *seq, const float *params,
                           const struct rnnd_model *m) {
    return rnnd__cpu_rnn_forward(ctx, out, h_n, c_n, tape, seq, params, m);
}

static int cpu_rnn_backward(void *ctx, const struct rnnd_seq_grads *grads, const float *grad_out,
                            const float *grad_h_n, const float *grad_c_n, const void *tape,
                            const struct rnnd_seq *seq, const float *params,
                            const struct rnnd_model *m) {
    return rnnd__cpu_rnn_backward(ctx, grads, grad_out, grad_h_n, grad_c_n, tape, seq, params, m);
}

static int cpu_rnn_step(void *ctx, const struct rnnd_step *step, const float *params,
                        const struct rnnd_model *m) {
    return rnnd__cpu_rnn_step(ctx, step, params, m);
}

static int cpu_traj_write(void *ctx, const struct rnnd_traj_store *st,
                          const struct rnnd_traj_rows *r, const struct rnnd_model *m) {
    return rnnd__cpu_traj_write(ctx, st, r, m);
}

static int cpu_traj_read(void *ctx, const struct rnnd_traj_rows *r,
                         const struct rnnd_traj_store *st, const struct rnnd_model *m) {
    return rnnd__cpu_traj_read(ctx, r, st, m);
}

static int cpu_cast(void *ctx, void *dst, enum rnnd_ftype dst_dtype, const void *src,
                    enum rnnd_ftype src_dtype, size_t n) {
    (void)ctx;
    if (n == 0)
        return 0;
    if (dst == NULL || src == NULL || (dst_dtype != RNND_FTYPE_F32 && src_dtype != RNND_FTYPE_F32))
        return RNND_EINVAL;
    rnnd_cast_host(dst, dst_dtype, src, src_dtype, n);
    return 0;
}

static int cpu_optim_step(void *ctx, float *params, float *grads, float *m, float *v, size_t n,
                          const struct rnnd_optim *o, int64_t t, float *grad_norm) {
    (void)ctx;
    return rnnd__cpu_optim_step(params, grads, m, v, n, o, t, grad_norm);
}

static int cpu_encoder_forward(void *ctx, float *acts, const float *obs, int N, const float *params,
                               const struct rnnd_model *m) {
    return rnnd__cpu_encoder_forward(ctx, acts, obs, N, params, m);
}

static int cpu_encoder_backward(void *ctx, float *grad_params, float *grad_obs,
                                const float *grad_out, const float *acts, const float *obs, int N,
                                const float *params, const struct rnnd_model *m) {
    return rnnd__cpu_encoder_backward(ctx, grad_params, grad_obs, grad_out, acts, obs, N, params,
                                      m);
}

static int cpu_heads_forward(void *ctx, const struct rnnd_heads *out, const float *h, int N,
                             const float *params, const struct rnnd_model *m) {
    return rnnd__cpu_heads_forward(ctx, out, h, N, params, m);
}

static int cpu_heads_backward(void *ctx, float *grad_params, float *grad_h,
                              const struct rnnd_heads *grad, const float *h, int N,
                              const float *params, const struct rnnd_model *m) {
    return rnnd__cpu_heads_backward(ctx, grad_params, grad_h, grad, h, N, params, m);
}

static int cpu_policy_sample(void *ctx, const struct rnnd_actions *a, const float *params,
                             const struct rnnd_model *m) {
    return rnnd__cpu_policy_sample(ctx, a, params, m);
}

static int cpu_policy_logp(void *ctx, const struct rnnd_actions *a, const float *params,
                           const struct rnnd_model *m) {
    return rnnd__cpu_policy_logp(ctx, a, params, m);
}

// One reference implementation for every model.
static int cpu_plan_name(void *ctx, const struct rnnd_model *m, int B, char *buf, size_t len) {
    (void)ctx;
    if (rnnd_model_check(m) != 0 || B < 1 || buf == NULL || len == 0)
        return RNND_EINVAL;
    snprintf(buf, len, "cpu_reference");
    return 0;
}

static const struct rnnd_backend_ops cpu_ops = {
    .name = "cpu",
    .caps = RNND_BACKEND_CAP_HOST_MEMORY,
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .alloc_lazy = cpu_alloc_lazy,
    .free_lazy = cpu_free_lazy,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .copy_out_async = cpu_copy,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .sync = cpu_sync,
    .nonfinite = cpu_nonfinite,
    .supports = cpu_supports,
    .tape_bytes = cpu_tape_bytes,
    .rnn_forward = cpu_rnn_forward,
    .rnn_backward = cpu_rnn_backward,
    .rnn_step = cpu_rnn_step,
    .traj_write = cpu_traj_write,
    .traj_read = cpu_traj_read,
    .cast = cpu_cast,
    .optim_step = cpu_optim_step,
    .plan_name = cpu_plan_name,
    .encoder_forward = cpu_encoder_forward,
    .encoder_backward = cpu_encoder_backward,
    .heads_forward = cpu_heads_forward,
    .heads_backward = cpu_heads_backward,
    .policy_sample = cpu_policy_sample,
    .policy_logp = cpu_policy_logp,
};

int rnnd_backend_cpu_init(struct rnnd_backend *b) {
    if (b == NULL)
        return RNND_EINVAL;
    memset(b, 0, sizeof(*b));
    struct cpu_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return RNND_ENOMEM;

    openblas_set_num_threads(1);
    // The workers; if the system refuses some, the backend runs with those that started.
    c->pool = rnnd_threadpool_init(cpu_thread_count() - 1, "rnnd-cpu");
    if (c->pool == NULL) {
        free(c);
        return RNND_ENOMEM;
    }
    c->nthreads = 1 + rnnd_threadpool_workers(c->pool);
    b->ops = &cpu_ops;
    b->ctx = c;
    snprintf(b->device, sizeof(b->device), "cpu (OpenBLAS %s, %d threads)", openblas_get_corename(),
             c->nthreads);
    return 0;
}
