/*
 * cpu.h: private declarations of the CPU reference backend (kernels/cpu/).
 *
 * Files, in reading order:
 *   backend.c  the vtable, memory ops, the scratch arena and rnnd_backend_cpu_init;
 *   rnn.c      the sequence driver shared by both cells: tape layout, reset rule, layers, time
 *              loops, weight gradients, and the single-step (slot gather/scatter) path;
 *   gru.c      the GRU cell's pointwise forward and backward for one row;
 *   lstm.c     the LSTM cell's pointwise forward and backward for one row;
 *   linear.c   the sgemm wrapper (bf16 operand rounding);
 *   policy.c   the policy around the core: encoder, heads, action sampling and log-probs;
 *   traj.c     the trajectory store's row moves (traj_write, traj_read);
 *   optim.c    clip_grad_norm_ + Adam / SGD.
 * Everything is fp32; long reductions (bias gradients, the gradient norm) accumulate in double.
 */
#ifndef RNND_CPU_H
#define RNND_CPU_H

#include "rnnd_kernels.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rnnd_threadpool.h"

// Most threads a CPU backend runs (the caller included).
#define RNND_CPU_MAX_THREADS 64

// The backend context: a scratch buffer that grows on demand and is reused by later calls (a
// steady stream of same-sized requests allocates nothing), and a small pool of worker threads
// that sleep between phases (rnnd_threadpool.h). One thread at a time calls into it (header rule).
struct cpu_ctx {
    void *work; // per-op buffers (gate pre-activations, gradient rows, ...)
    size_t work_bytes;

    int nthreads; // threads an op may use, the caller included (1: no workers)
    struct rnnd_threadpool *pool;
};

// Makes ctx->work at least work_bytes long. Returns 0 or RNND_ENOMEM (the old buffer stays).
int rnnd__cpu_reserve(struct cpu_ctx *c, size_t work_bytes);

// Runs a phase of an op, fn(arg, k, n) for k = 0 .. n-1 (1 <= n <= c->nthreads), on the calling
// thread and the pool's workers (rnnd_threadpool_run); returns when all have returned (so
// consecutive calls are ordered phases).
void rnnd__cpu_parallel(struct cpu_ctx *c, int n, rnnd_threadpool_fn fn, void *arg);

// A bump allocator over ctx->work: rnnd__cpu_carve hands out 64-byte aligned pieces. Ops add up
// their layout with a NULL base first (to learn the size), then carve the real buffer.
struct cpu_carve {
    char *base; // NULL while measuring
    size_t used;
};
void *rnnd__cpu_carve(struct cpu_carve *cv, size_t bytes);

// The pointwise loops (marked RNND_CPU_SIMD) are built for AVX-512, AVX2 and baseline x86-64,
// and the loader picks one for the CPU at hand (GCC function multi-versioning). FP contraction
// is off (-std=c11), and the loops only vectorise across independent elements (sums keep their
// order), so every version gives the same bits.
// (ThreadSanitizer cannot run ifunc resolvers that early: single version there.)
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) &&       \
    !defined(__SANITIZE_THREAD__)
#define RNND_CPU_SIMD __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RNND_CPU_SIMD
#endif

// ---------------------------------------------------------------------------------------------
// linear.c

// C (M, N) = op(A) (M, K) · op(B) (K, N) + beta · C with CBLAS sgemm, row-major, fp32; op(X) is
// X or X^T (ta, tb). bf16 compute mode passes operands already rounded (rnnd__cpu_round_bf16).
// Does nothing when M or N is 0.
void rnnd__cpu_gemm(bool ta, bool tb, int M, int N, int K, const float *A, int lda, const float *B,
                    int ldb, float beta, float *C, int ldc);

// dst[i] = rnnd_round_bf16(src[i]), n floats (dst may equal src).
void rnnd__cpu_round_bf16(float *dst, const float *src, size_t n);

// dst (cols) += the column sums of src (rows, cols; ld floats from one row to the next): a bias
// gradient, the sum over every step and row. Blocks of 64 rows are summed in float (in part,
// cols floats), the blocks in double (in acc, cols doubles, which keeps the sums afterwards).
void rnnd__cpu_add_colsum(float *dst, const float *src, size_t rows, int cols, int ld, double *acc,
                          float *part);

// ---------------------------------------------------------------------------------------------
// Pointwise activations. Both are plain C that GCC vectorises (no libm call in the loop body):
// a Cephes-style expf (range reduction by ln 2, degree-6 polynomial, exponent by bit shift; about
// 1 ulp on [-87, 88]) and, for tanh, the odd polynomial of Cephes tanhf below |x| = 0.625 (where
// 1 - 2/(e^2x + 1) would cancel) and that formula above. Relative error stays below ~3e-7, far
// inside the 1e-5 contract, and both saturate cleanly (no NaN) for any finite input.

static inline float rnnd__cpu_expf(float x) {
    // Clamp so the exponent stays representable: exp(-87.3) is the smallest normal, exp(88.7)
    // the largest finite value.
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    // x = k ln2 + f, |f| <= ln2/2, with ln2 split in two parts for an exact k ln2 (Cody-Waite).
    // k = round(x / ln2) by the 1.5 * 2^23 trick (exact for |k| < 2^22; plain SSE2, no libm).
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float f = x - k * 0.693359375f;
    f = f - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    // Multiply by 2^k through the exponent bits.
    union {
        float f;
        int i;
    } s;
    s.i = ((int)k + 127) << 23;
    return p * s.f;
}

static inline float rnnd__cpu_sigmoidf(float x) {
    return 1.0f / (1.0f + rnnd__cpu_expf(-x));
}

static inline float rnnd__cpu_tanhf(float x) {
    float ax = fabsf(x);
    float z = x * x;
    float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                    1.33314422036e-1f) *
                       z -
                   3.33332819422e-1f) *
                      z * x +
                  x;
    float large = 1.0f - 2.0f / (rnnd__cpu_expf(2.0f * ax) + 1.0f);
    large = copysignf(large, x);
    return ax < 0.625f ? small : large;
}

// ---------------------------------------------------------------------------------------------
// gru.c / lstm.c: one cell step for one row, pointwise (the matmuls are done by rnn.c).
// gx (G*H) = W_ih x and gh (G*H) = W_hh h without biases; gates are stored activated.

// GRU: gates (3H) = r, z, n; hn (H) = W_hn h + b_hn; h_new (H).
void rnnd__gru_row_forward(int H, float *restrict gates, float *restrict hn, float *restrict h_new,
                           const float *restrict gx, const float *restrict gh,
                           const float *restrict h, const float *restrict b_ih,
                           const float *restrict b_hh);
// From dh_new = dy + dh_carry (H, summed here), writes dgx (3H, gradient of W_ih x + b_ih),
// dgh (3H, gradient of W_hh h + b_hh) and dh (H, the direct part z * dh_new of dL/dh; rnn.c adds
// dgh W_hh).
void rnnd__gru_row_backward(int H, float *restrict dgx, float *restrict dgh, float *restrict dh,
                            const float *restrict dy, const float *restrict dh_carry,
                            const float *restrict gates, const float *restrict hn,
                            const float *restrict h);

// LSTM: gates (4H) = i, f, g, o; c_new (H); tc (H) = tanh(c_new); h_new (H).
void rnnd__lstm_row_forward(int H, float *restrict gates, float *restrict c_new, float *restrict tc,
                            float *restrict h_new, const float *restrict gx,
                            const float *restrict gh, const float *restrict c,
                            const float *restrict b_ih, const float *restrict b_hh);
// From dh_new = dy + dh_carry and dc (H; in: the carried dL/dc_new, out: dL/dc), writes da (4H,
// the gradient of both pre-activation sums; the same for W_ih x + b_ih and W_hh h + b_hh).
void rnnd__lstm_row_backward(int H, float *restrict da, float *restrict dc,
                             const float *restrict dy, const float *restrict dh_carry,
                             const float *restrict gates, const float *restrict tc,
                             const float *restrict c);

// ---------------------------------------------------------------------------------------------
// rnn.c, policy.c and optim.c: the vtable's ops (argument order and contracts as in rnnd_kernels.h).

size_t rnnd__cpu_tape_bytes(const struct rnnd_model *m, int B, int T);
int rnnd__cpu_rnn_forward(struct cpu_ctx *c, float *out, float *h_n, float *c_n, void *tape,
                          const struct rnnd_seq *seq, const float *params,
                          const struct rnnd_model *m);
int rnnd__cpu_rnn_backward(struct cpu_ctx *c, const struct rnnd_seq_grads *grads,
                           const float *grad_out, const float *grad_h_n, const float *grad_c_n,
                           const void *tape, const struct rnnd_seq *seq, const float *params,
                           const struct rnnd_model *m);
int rnnd__cpu_rnn_step(struct cpu_ctx *c, const struct rnnd_step *step, const float *params,
                       const struct rnnd_model *m);
int rnnd__cpu_encoder_forward(struct cpu_ctx *c, float *acts, const float *obs, int N,
                              const float *params, const struct rnnd_model *m);
int rnnd__cpu_encoder_backward(struct cpu_ctx *c, float *grad_params, float *grad_obs,
                               const float *grad_out, const float *acts, const float *obs, int N,
                               const float *params, const struct rnnd_model *m);
int rnnd__cpu_heads_forward(struct cpu_ctx *c, const struct rnnd_heads *out, const float *h, int N,
                            const float *params, const struct rnnd_model *m);
int rnnd__cpu_heads_backward(struct cpu_ctx *c, float *grad_params, float *grad_h,
                             const struct rnnd_heads *g, const float *h, int N, const float *params,
                             const struct rnnd_model *m);
int rnnd__cpu_policy_sample(struct cpu_ctx *c, const struct rnnd_actions *a, const float *params,
                            const struct rnnd_model *m);
int rnnd__cpu_policy_logp(struct cpu_ctx *c, const struct rnnd_actions *a, const float *params,
                          const struct rnnd_model *m);
int rnnd__cpu_traj_write(struct cpu_ctx *c, const struct rnnd_traj_store *st,
                         const struct rnnd_traj_rows *r, const struct rnnd_model *m);
int rnnd__cpu_traj_read(struct cpu_ctx *c, const struct rnnd_traj_rows *r,
                        const struct rnnd_traj_store *st, const struct rnnd_model *m);
int rnnd__cpu_optim_step(float *params, float *grads, float *m, float *v, size_t n,
                         const struct rnnd_optim *o, int64_t t, float *grad_norm);

#endif // RNND_CPU_H
