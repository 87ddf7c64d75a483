/*
 * policy.cu: the policy around the recurrent core on the CUDA backend (policy.cuh), the math of
 * kernels/cpu/policy.c in fp32 on the device, for the step (N = B rows) and the learner
 * (N = B*T rows).
 *
 * Forward (the step's path, a launch per encoder layer and one each for the heads and the draw):
 *   linear_kernel  y = act(x W^T + b), an encoder layer with its bias and activation fused, or
 *                  both heads at once (the action head's columns, then the value's): an FFMA
 *                  tile of 16*TM rows x 16*TN columns a block, each output's dot product summed
 *                  in order of k. Plain fp32, never TF32: the policy's layers are small next to
 *                  the core and held to 1e-4 of float64.
 *   action_kernel  a thread a row: the draw of rnnd_philox.h (the CPU's code and Philox words,
 *                  fp32 with its elementary functions rounded from fp64, so the same key gives
 *                  the same action as on the CPU) or the mode, then logp and entropy summed in
 *                  fp64 as the CPU does.
 * Backward (the learner's): cuBLAS in plain fp32 for dW += dY^T X and dX = dY W, a fused
 * elementwise kernel for the activation's derivative from the saved outputs, and column sums
 * (bias gradients) in fp64 over chunks of rows then in order over the chunks, so every result is
 * deterministic.
 */
#include "policy.cuh"

#include "rnnd_philox.h"

#include <stdio.h>

#define LIN_BK        16  // k a stage of linear_kernel
#define LIN_THREADS   256 // 16 x 16
#define ROW_THREADS   128 // action_kernel, act_backward_kernel
#define COLSUM_ROWS   512 // rows a chunk of the column sums
#define COLSUM_CHUNKS 1024

// ---------------------------------------------------------------------------------------------
// Parameters

// The tensor called name in m (its part is there: the caller checked).
static const float *param(const struct rnnd_model *m, const float *params, const char *name) {
    return params + rnnd_model_param_offset(m, name);
}

static float *grad(const struct rnnd_model *m, float *grads, const char *name) {
    return grads + rnnd_model_param_offset(m, name);
}

// ---------------------------------------------------------------------------------------------
// Kernels

// One output block of linear_kernel: columns [0, n) of the concatenated outputs.
struct lin_seg {
    const float *W; // (n, K)
    const float *b; // (n)
    float *y;       // (N, n)
    int n;
};

struct lin_args {
    const float *x; // (N, K)
    int N, K;
    struct lin_seg seg[2]; // columns [0, seg[0].n), then [seg[0].n, n)
    int n;
    bool act; // apply act (an encoder layer) or not (heads)
    enum rnnd_act act_kind;
};

static __device__ __forceinline__ float act_apply(float x, enum rnnd_act act) {
    return act == RNND_ACT_RELU   ? (x > 0.0f ? x : 0.0f)
           : act == RNND_ACT_TANH ? tanhf(x)
                                  : (x > 0.0f ? x : expm1f(x));
}

// act'(x) from y = act(x) (policy.c's act_backward).
static __device__ __forceinline__ float act_grad(float y, enum rnnd_act act) {
    return act == RNND_ACT_RELU   ? (y > 0.0f ? 1.0f : 0.0f)
           : act == RNND_ACT_TANH ? 1.0f - y * y
                                  : (y > 0.0f ? 1.0f : y + 1.0f);
}

// Thread (ty, tx) owns rows ty + 16 i and columns tx + 16 j of the block's tile: the x tile is
// read as broadcasts, the W tile and the stores are 16 consecutive floats.
template <int TM, int TN>
static __global__ void __launch_bounds__(LIN_THREADS) linear_kernel(lin_args a) {
    constexpr int BM = 16 * TM, BN = 16 * TN;
    __shared__ float xs[LIN_BK][BM + 1], ws[LIN_BK][BN + 1];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int64_t row0 = (int64_t)blockIdx.x * BM;
    const int col0 = blockIdx.y * BN, n0 = a.seg[0].n;
    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < a.K; k0 += LIN_BK) {
        for (int e = tid; e < BM * LIN_BK; e += LIN_THREADS) {
            int r = e / LIN_BK, k = e % LIN_BK;
            int64_t gr = row0 + r;
            xs[k][r] = gr < a.N && k0 + k < a.K ? a.x[gr * a.K + k0 + k] : 0.0f;
        }
        for (int e = tid; e < BN * LIN_BK; e += LIN_THREADS) {
            int cc = e / LIN_BK, k = e % LIN_BK, col = col0 + cc;
            const float *W =
                col < n0 ? a.seg[0].W + (size_t)col * a.K : a.seg[1].W + (size_t)(col - n0) * a.K;
            ws[k][cc] = col < a.n && k0 + k < a.K ? W[k0 + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < LIN_BK; k++) {
            float xv[TM], wv[TN];
#pragma unroll
            for (int i = 0; i < TM; i++)
                xv[i] = xs[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < TN; j++)
                wv[j] = ws[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++)
                    acc[i][j] = fmaf(xv[i], wv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < TN; j++) {
        int col = col0 + tx + 16 * j;
        if (col >= a.n)
            continue;
        // Each field by itself: a struct picked at run time would go through local memory.
        const bool lo = col < n0;
        const int c = lo ? col : col - n0, ld = lo ? n0 : a.seg[1].n;
        float *y = lo ? a.seg[0].y : a.seg[1].y;
        const float b = lo ? a.seg[0].b[c] : a.seg[1].b[c];
#pragma unroll
        for (int i = 0; i < TM; i++) {
            int64_t r = row0 + ty + 16 * i;
            if (r < a.N) {
                float v = acc[i][j] + b;
                y[r * ld + c] = a.act ? act_apply(v, a.act_kind) : v;
            }
        }
    }
}

// dz (n) = dy * act'(y).
static __global__ void act_backward_kernel(float *dz, const float *dy, const float *y, size_t n,
                                           enum rnnd_act act) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dz[i] = dy[i] * act_grad(y[i], act);
}

// partial[chunk, j] = sum of src[r, j] (fp64) over the chunk's COLSUM_ROWS rows r; a block is
// 32 columns by 8 row lanes, summed in a fixed order.
static __global__ void colsum_partial_kernel(double *partial, const float *src, int N, int n) {
    __shared__ double s[8][33];
    const int j = blockIdx.x * 32 + (threadIdx.x & 31), lane = threadIdx.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.y * COLSUM_ROWS;
    const int64_t r1 = r0 + COLSUM_ROWS < N ? r0 + COLSUM_ROWS : N;
    double acc = 0.0;
    if (j < n)
        for (int64_t r = r0 + lane; r < r1; r += 8)
            acc += src[r * n + j];
    s[lane][threadIdx.x & 31] = acc;
    __syncthreads();
    if (lane == 0 && j < n) {
        for (int l = 1; l < 8; l++)
            acc += s[l][threadIdx.x];
        partial[(size_t)blockIdx.y * n + j] = acc;
    }
}

// dst[j] += the sum of partial[0 .. chunks-1, j], in order.
static __global__ void colsum_finish_kernel(float *dst, const double *partial, int chunks, int n) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n)
        return;
    double acc = 0.0;
    for (int k = 0; k < chunks; k++)
        acc += partial[(size_t)k * n + j];
    dst[j] += (float)acc;
}

// y (N, n) = v (n) in every row.
static __global__ void rows_fill_kernel(float *y, const float *v, int64_t N, int n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)N * n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = v[i % n];
}

struct action_args {
    int N, K, A;
    const float *logits, *mean, *log_std;
    int64_t *index;
    float *action, *logp, *entropy;
    bool sample; // draw (policy_sample) or read the actions (policy_logp)
    uint64_t seed;
    const uint64_t *env_ids, *steps;
    const uint8_t *greedy;
    int *bad; // policy_logp: set where an index is out of range
};

// Row r's action (drawn, the mode, or read), then its logp and entropy: policy.c's
// rnnd__cpu_policy_sample and action_stats for one row.
static __global__ void __launch_bounds__(ROW_THREADS) action_kernel(action_args a) {
    const int64_t r = blockIdx.x * (int64_t)ROW_THREADS + threadIdx.x;
    if (r >= a.N)
        return;
    float *lp = a.logp ? a.logp + r : NULL, *ent = a.entropy ? a.entropy + r : NULL;
    const bool greedy = a.greedy && a.greedy[r];
    if (a.K) {
        const float *l = a.logits + r * a.K;
        int64_t best = 0;
        if (!a.sample) {
            best = a.index[r];
            if (best < 0 || best >= a.K) {
                *a.bad = 1;
                return;
            }
        } else if (greedy) {
            for (int k = 1; k < a.K; k++)
                best = l[k] > l[best] ? k : best;
        } else {
            uint32_t key[2], w[4];
            rnnd_philox_env_key(a.seed, a.env_ids[r], key);
            rnnd_philox_step_words(key, a.steps[r], 0, w);
            best = rnnd_sample_categorical(l, a.K, rnnd_philox_u01(w[0]));
        }
        if (a.sample)
            a.index[r] = best;
        if (lp || ent)
            rnnd_categorical_stats(l, a.K, best, lp, ent);
        return;
    }
    const float *mu = a.mean + r * a.A;
    float *x = a.action + r * a.A;
    if (a.sample && greedy) {
        for (int j = 0; j < a.A; j++)
            x[j] = mu[j];
    } else if (a.sample) {
        uint32_t key[2];
        rnnd_philox_env_key(a.seed, a.env_ids[r], key);
        rnnd_sample_normals(key, a.steps[r], a.A, x); // z, then scaled in place
        // The CPU's mu + expf(ls) z, rounded after the product and after the sum (no FMA).
        for (int j = 0; j < a.A; j++)
            x[j] = __fadd_rn(mu[j], __fmul_rn(RNND_EXPF(a.log_std[j]), x[j]));
    }
    if (lp || ent)
        rnnd_gaussian_stats(mu, a.log_std, x, a.A, lp, ent);
}

// ---------------------------------------------------------------------------------------------
// Launchers

// Row-major C (M, N) = op(A) op(B) + beta C, as rnnd__cpu_gemm: cuBLAS's column-major view
// computes C^T = op(B)^T op(A)^T. Plain fp32 (no TF32, whatever the environment says).
static int gemm_rm(struct cuda_ctx *c, bool ta, bool tb, int M, int N, int K, const float *A,
                   int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    const float one = 1.0f;
    RNND_CUBLAS_TRY(cublasGemmEx(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_32F, ldb,
                                 A, CUDA_R_32F, lda, &beta, C, CUDA_R_32F, ldc,
                                 CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
    return 0;
}

// The largest tile that still gives every SM a block, else the smallest.
static int linear(struct cuda_ctx *c, lin_args a) {
    if (a.seg[1].W == NULL) // one block of columns: the second is never read, but well defined
        a.seg[1] = a.seg[0];
    const int64_t sms = c->dev.num_sms > 0 ? c->dev.num_sms : 1;
    dim3 grid;
    if (CEIL_DIV((int64_t)a.N, 64) * CEIL_DIV(a.n, 64) >= sms) {
        grid = dim3((unsigned)CEIL_DIV((int64_t)a.N, 64), (unsigned)CEIL_DIV(a.n, 64));
        linear_kernel<4, 4><<<grid, LIN_THREADS, 0, c->stream>>>(a);
    } else if (CEIL_DIV((int64_t)a.N, 32) * CEIL_DIV(a.n, 32) >= sms) {
        grid = dim3((unsigned)CEIL_DIV((int64_t)a.N, 32), (unsigned)CEIL_DIV(a.n, 32));
        linear_kernel<2, 2><<<grid, LIN_THREADS, 0, c->stream>>>(a);
    } else {
        grid = dim3((unsigned)CEIL_DIV((int64_t)a.N, 16), (unsigned)CEIL_DIV(a.n, 16));
        linear_kernel<1, 1><<<grid, LIN_THREADS, 0, c->stream>>>(a);
    }
    CUDA_LAUNCH_CHECK();
    return 0;
}

static unsigned elementwise_grid(const struct cuda_ctx *c, size_t n) {
    size_t want = CEIL_DIV(n, (size_t)256), cap = (size_t)c->dev.num_sms * 16;
    return (unsigned)(want < cap ? want : cap);
}

// The scratch of a column sum over N rows of n columns.
static size_t colsum_bytes(int N, int n) {
    int chunks = CEIL_DIV(N, COLSUM_ROWS);
    return (size_t)(chunks < COLSUM_CHUNKS ? chunks : COLSUM_CHUNKS) * n * sizeof(double);
}

// dst (n) += column sums of src (N, n), partial holding colsum_bytes(N, n). Chunks beyond
// COLSUM_CHUNKS go in passes, each added to dst in turn.
static int colsum(struct cuda_ctx *c, float *dst, const float *src, int N, int n, double *partial) {
    for (int64_t r0 = 0; r0 < N; r0 += (int64_t)COLSUM_ROWS * COLSUM_CHUNKS) {
        int rows = (int)(N - r0 < (int64_t)COLSUM_ROWS * COLSUM_CHUNKS
                             ? N - r0
                             : (int64_t)COLSUM_ROWS * COLSUM_CHUNKS);
        int chunks = CEIL_DIV(rows, COLSUM_ROWS);
        colsum_partial_kernel<<<dim3(CEIL_DIV(n, 32), chunks), 256, 0, c->stream>>>(
            partial, src + r0 * n, rows, n);
        CUDA_LAUNCH_CHECK();
        colsum_finish_kernel<<<CEIL_DIV(n, 256), 256, 0, c->stream>>>(dst, partial, chunks, n);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

int rnnd__cuda_encoder_forward(struct cuda_ctx *c, float *acts, const float *obs, int N,
                               const float *params, const struct rnnd_model *m) {
    if (rnnd_encoder_check(m, N, acts, obs) != 0 || params == NULL)
        return RNND_EINVAL;
    c->step_tail = false; // not a step: the next step waits before it reads (common.cuh)
    const struct rnnd_policy *p = &m->policy;
    const float *in = obs;
    float *y = acts;
    for (int j = 0; j < p->enc_layers; j++) {
        char wname[32], bname[32];
        snprintf(wname, sizeof(wname), "encoder.%d.weight", j);
        snprintf(bname, sizeof(bname), "encoder.%d.bias", j);
        lin_args a = {};
        a.x = in, a.N = N, a.K = rnnd_model_encoder_input(m, j);
        a.seg[0] = {param(m, params, wname), param(m, params, bname), y, p->enc_width[j]};
        a.n = p->enc_width[j];
        a.act = true, a.act_kind = p->enc_act;
        RNND_TRY(linear(c, a));
        in = y;
        y += (size_t)N * p->enc_width[j];
    }
    return 0;
}

int rnnd__cuda_encoder_backward(struct cuda_ctx *c, float *grad_params, float *grad_obs,
                                const float *grad_out, const float *acts, const float *obs, int N,
                                const float *params, const struct rnnd_model *m) {
    if (rnnd_encoder_check(m, N, acts, obs) != 0 || !grad_params || !grad_out || !params)
        return RNND_EINVAL;
    c->step_tail = false;
    const struct rnnd_policy *p = &m->policy;
    int maxw = rnnd_model_encoder_widest(m);
    // Two (N, maxw) buffers take turns holding dz_j and dy_{j-1} (policy.c's order).
    struct cuda_carve cv = {};
    float *d[2];
    double *partial;
    size_t rows = (size_t)N * (size_t)maxw;
    for (int pass = 0; pass < 2; pass++) {
        d[0] = (float *)cuda_carve(&cv, rows * sizeof(float));
        d[1] = (float *)cuda_carve(&cv, rows * sizeof(float));
        partial = (double *)cuda_carve(&cv, colsum_bytes(N, maxw));
        if (pass == 0)
            RNND_TRY(cuda_carve_scratch(c, &cv));
    }
    RNND_TRY(cuda_carve_fits(&cv));
    size_t at = (size_t)N * (size_t)rnnd_model_encoder_acts(m);
    const float *dy = grad_out;
    for (int j = p->enc_layers - 1, cur = 0; j >= 0; j--, cur ^= 1) {
        int w = p->enc_width[j], ni = rnnd_model_encoder_input(m, j);
        at -= (size_t)N * w;
        const float *y = acts + at, *in = j > 0 ? acts + at - (size_t)N * ni : obs;
        float *dz = d[cur];
        size_t nw = (size_t)N * w;
        act_backward_kernel<<<elementwise_grid(c, nw), 256, 0, c->stream>>>(dz, dy, y, nw,
                                                                            p->enc_act);
        CUDA_LAUNCH_CHECK();
        char name[32];
        snprintf(name, sizeof(name), "encoder.%d.weight", j);
        const float *W = param(m, params, name);
        RNND_TRY(
            gemm_rm(c, true, false, w, ni, N, dz, w, in, ni, 1.0f, grad(m, grad_params, name), ni));
        snprintf(name, sizeof(name), "encoder.%d.bias", j);
        RNND_TRY(colsum(c, grad(m, grad_params, name), dz, N, w, partial));
        float *dx = j > 0 ? d[cur ^ 1] : grad_obs;
        if (dx)
            RNND_TRY(gemm_rm(c, false, false, N, ni, w, dz, w, W, ni, 0.0f, dx, ni));
        dy = dx;
    }
    return 0;
}

int rnnd__cuda_heads_forward(struct cuda_ctx *c, const struct rnnd_heads *out, const float *h,
                             int N, const float *params, const struct rnnd_model *m) {
    if (rnnd_heads_check(out, h, N, m) != 0 || params == NULL)
        return RNND_EINVAL;
    c->step_tail = false;
    const struct rnnd_policy *p = &m->policy;
    // One launch for the action head's columns and the value's.
    lin_args a = {};
    a.x = h, a.N = N, a.K = m->H;
    int nseg = 0;
    if (out->logits)
        a.seg[nseg++] = {param(m, params, "policy_logits.weight"),
                         param(m, params, "policy_logits.bias"), out->logits, p->K};
    if (out->mean)
        a.seg[nseg++] = {param(m, params, "action_mean.weight"),
                         param(m, params, "action_mean.bias"), out->mean, p->A};
    if (out->value)
        a.seg[nseg++] = {param(m, params, "value.weight"), param(m, params, "value.bias"),
                         out->value, 1};
    if (nseg > 0) {
        a.n = a.seg[0].n + (nseg > 1 ? a.seg[1].n : 0);
        RNND_TRY(linear(c, a));
    }
    if (out->log_std) {
        size_t n = (size_t)N * p->A;
        rows_fill_kernel<<<elementwise_grid(c, n), 256, 0, c->stream>>>(
            out->log_std, param(m, params, "action_log_std"), N, p->A);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

int rnnd__cuda_heads_backward(struct cuda_ctx *c, float *grad_params, float *grad_h,
                              const struct rnnd_heads *g, const float *h, int N,
                              const float *params, const struct rnnd_model *m) {
    if (rnnd_heads_check(g, h, N, m) != 0 || !grad_params || !grad_h || !params)
        return RNND_EINVAL;
    c->step_tail = false;
    const struct rnnd_policy *p = &m->policy;
    const int H = m->H, widest = p->K > p->A ? (p->K > 1 ? p->K : 1) : (p->A > 1 ? p->A : 1);
    RNND_TRY(rnnd__cuda_reserve(c, colsum_bytes(N, widest)));
    double *partial = (double *)c->d_scratch;
    struct head {
        const float *dy;
        const char *w, *b;
        int n;
    } heads[3] = {{g->logits, "policy_logits.weight", "policy_logits.bias", p->K},
                  {g->mean, "action_mean.weight", "action_mean.bias", p->A},
                  {g->value, "value.weight", "value.bias", 1}};
    // dh += dy W, head by head.
    for (int k = 0; k < 3; k++) {
        const struct head *hd = &heads[k];
        if (hd->dy == NULL)
            continue;
        RNND_TRY(gemm_rm(c, true, false, hd->n, H, N, hd->dy, hd->n, h, H, 1.0f,
                         grad(m, grad_params, hd->w), H));
        RNND_TRY(colsum(c, grad(m, grad_params, hd->b), hd->dy, N, hd->n, partial));
        RNND_TRY(gemm_rm(c, false, false, N, H, hd->n, hd->dy, hd->n, param(m, params, hd->w), H,
                         1.0f, grad_h, H));
    }
    if (g->log_std)
        RNND_TRY(colsum(c, grad(m, grad_params, "action_log_std"), g->log_std, N, p->A, partial));
    return 0;
}

static action_args action_args_of(const struct rnnd_actions *a, const float *params,
                                  const struct rnnd_model *m, bool sample) {
    const struct rnnd_policy *p = &m->policy;
    action_args k = {};
    k.N = a->N, k.K = p->K, k.A = p->A;
    k.logits = a->logits, k.mean = a->mean;
    k.log_std = p->A ? param(m, params, "action_log_std") : NULL;
    k.index = a->index, k.action = a->action, k.logp = a->logp, k.entropy = a->entropy;
    k.sample = sample;
    k.seed = a->seed, k.env_ids = a->env_ids, k.steps = a->steps;
    k.greedy = sample ? a->greedy : NULL;
    return k;
}

int rnnd__cuda_policy_sample(struct cuda_ctx *c, const struct rnnd_actions *a, const float *params,
                             const struct rnnd_model *m) {
    if (rnnd_actions_check(a, m, true) != 0 || params == NULL)
        return RNND_EINVAL;
    c->step_tail = false;
    action_kernel<<<CEIL_DIV(a->N, ROW_THREADS), ROW_THREADS, 0, c->stream>>>(
        action_args_of(a, params, m, true));
    CUDA_LAUNCH_CHECK();
    return 0;
}

int rnnd__cuda_policy_logp(struct cuda_ctx *c, const struct rnnd_actions *a, const float *params,
                           const struct rnnd_model *m) {
    if (rnnd_actions_check(a, m, false) != 0 || params == NULL)
        return RNND_EINVAL;
    c->step_tail = false;
    action_args k = action_args_of(a, params, m, false);
    RNND_TRY(rnnd__cuda_reserve(c, sizeof(int)));
    k.bad = (int *)c->d_scratch;
    RNND_CUDA_TRY(cudaMemsetAsync(k.bad, 0, sizeof(int), c->stream));
    action_kernel<<<CEIL_DIV(a->N, ROW_THREADS), ROW_THREADS, 0, c->stream>>>(k);
    CUDA_LAUNCH_CHECK();
    // The indices are device memory: the kernel's verdict comes back, as on the CPU.
    int bad = 0;
    RNND_CUDA_TRY(cudaMemcpyAsync(&bad, k.bad, sizeof(int), cudaMemcpyDeviceToHost, c->stream));
    RNND_CUDA_TRY(cudaStreamSynchronize(c->stream));
    return bad ? RNND_EINVAL : 0;
}
