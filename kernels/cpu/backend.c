/*
 * backend.c: the CPU reference backend's vtable (struct rnnd_backend_ops), its memory ops (host
 * memory: alloc is aligned_alloc, copies are memcpy, sync does nothing) and its context, which
 * owns the scratch arena that the ops grow on demand. The math lives in rnn.c, gru.c, lstm.c,
 * linear.c and optim.c (see cpu.h for the tour).
 */
#include "cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#define CPU_ALIGN 64

// ---------------------------------------------------------------------------------------------
// Scratch

static void *aligned_bytes(size_t bytes) {
    size_t rounded = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    return aligned_alloc(CPU_ALIGN, rounded ? rounded : CPU_ALIGN);
}

int rnnd__cpu_reserve(struct cpu_ctx *c, size_t work_bytes, size_t round_floats) {
    if (work_bytes > c->work_bytes) {
        // Grow by at least half again, so a slowly growing T does not reallocate every call.
        size_t want = work_bytes > c->work_bytes / 2 * 3 ? work_bytes : c->work_bytes / 2 * 3;
        void *p = aligned_bytes(want);
        if (p == NULL)
            return RNND_ENOMEM;
        free(c->work);
        c->work = p;
        c->work_bytes = want;
    }
    if (round_floats > c->round_floats) {
        if (round_floats > SIZE_MAX / sizeof(float))
            return RNND_ENOMEM;
        float *p = aligned_bytes(round_floats * sizeof(float));
        if (p == NULL)
            return RNND_ENOMEM;
        free(c->round);
        c->round = p;
        c->round_floats = round_floats;
    }
    return 0;
}

void *rnnd__cpu_carve(struct cpu_carve *cv, size_t bytes) {
    size_t at = (cv->used + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    cv->used = at + bytes;
    return cv->base ? cv->base + at : NULL;
}

// ---------------------------------------------------------------------------------------------
// Vtable entries

static void cpu_destroy(void *ctx) {
    struct cpu_ctx *c = ctx;
    if (c == NULL)
        return;
    free(c->work);
    free(c->round);
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

static int cpu_optim_step(void *ctx, float *params, float *grads, float *m, float *v, size_t n,
                          const struct rnnd_optim *o, int64_t t, float *grad_norm) {
    (void)ctx;
    return rnnd__cpu_optim_step(params, grads, m, v, n, o, t, grad_norm);
}

static const struct rnnd_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .sync = cpu_sync,
    .supports = cpu_supports,
    .tape_bytes = cpu_tape_bytes,
    .rnn_forward = cpu_rnn_forward,
    .rnn_backward = cpu_rnn_backward,
    .rnn_step = cpu_rnn_step,
    .optim_step = cpu_optim_step,
};

int rnnd_backend_cpu_init(struct rnnd_backend *b) {
    if (b == NULL)
        return RNND_EINVAL;
    memset(b, 0, sizeof(*b));
    struct cpu_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return RNND_ENOMEM;
    b->ops = &cpu_ops;
    b->ctx = c;
    snprintf(b->device, sizeof(b->device), "cpu (OpenBLAS, %d threads)",
             openblas_get_num_threads());
    return 0;
}
