/*
 * seq.cu: the sequence forward and backward of the CUDA backend, layer by layer. Which kernel
 * runs each step below is the plan's choice (seq_plan.h, rnnd__seq_plan); this file executes it.
 *
 * Forward, layer l (input x_l: x, or the output of layer l-1 as stored in this layer's tape):
 *   1. xg (B*T, G*H) = x_l W_ih^T: one cuBLAS GEMM (TF32 in fp32 mode, bf16 operands in bf16
 *      mode, strict fp32 in ieee mode), unless the time loop fuses it (the plan's xks: it then
 *      reads x_l itself);
 *   2. the time loop (seq_loops.h): a persistent loop (mma.sync, or warpgroup MMAs), the
 *      H = 256 loop in thread-block clusters, or per step one GEMM gh = h W_hh^T over the B rows
 *      plus one fused cell kernel (the per-step path, below); each writes y (to `out`, or into
 *      the next layer's tape), the tape (z: hprev | 1 | x_l; s: the gates' pre-activations, GRU
 *      hn, LSTM cprev; no s where the backward recomputes the gates) and h_n, c_n.
 * Backward, layer l from the top:
 *   1. the reverse time loop writes D (B*T, 4H), the gradient of the gate pre-activations (GRU:
 *      r, z, n on the input side, n on the hidden side; LSTM: i, f, g, o), and routes the state
 *      gradient at resets and at t = 0;
 *   2. [dW_ih | dW_hh | db] from one GEMM D^T z over all B*T rows (z carries x_l, hprev and a
 *      constant 1 column; after the per-step backward, D and z in scaled fp16), scattered into
 *      the gradient array with += (deterministic: cuBLAS without atomics, then one thread per
 *      element); or, where the loops write D and z as 16-bit chunks (seq_chunks.h), seq_dw.cu's
 *      products on them;
 *   3. dx_l = D W_ih (after the per-step backward, on D's fp16 rows): the layer below's output
 *      gradient, or grads->x.
 */
#include "seq.cuh"

#include "seq_cells.cuh"
#include "seq_chunks.h"
#include "seq_loops.h"
#include "seq_plan.h"
#include "seq_tape.cuh"

#include <cuda_fp16.h>
#include <limits.h>
#include <string.h>

#define SEQ_BLOCK 256

// ---------------------------------------------------------------------------------------------
// Layout

// The dw16 product's chunks a plane: the loop's (blocks x T), whole stages for each of its CTAs.
static int seq_dw16_pitch(const struct cuda_ctx *c, int B, int T) {
    const int step = c->dev.num_sms / 4 * RNND_DW16_CH;
    return CEIL_DIV(CEIL_DIV(B, 16) * T, step) * step;
}

// The dw256 product's K ranges a plane: four for each of its CTA slots (num_sms / 8 a plane),
// so that most start beside the backward loop as their steps are written, and the last ones
// take a quarter of the product's time.
static int seq_dw256_ks(const struct cuda_ctx *c) {
    return c->dev.num_sms / 8 * 4;
}
// Its chunks a plane: whole stages for each K range.
static int seq_dw256_pitch(const struct cuda_ctx *c, int B, int T) {
    const int step = seq_dw256_ks(c) * RNND_DW256_CH;
    return CEIL_DIV(CEIL_DIV(B, 16) * T, step) * step;
}

// The layout holds s rows of fp32 planes; a tape whose gate planes are fp16 (tape_half) packs
// its shorter rows into the same space. A layer's z space also holds the z chunk parts and (TF32
// mode) x exponents (z_dw16; above layer 0 beside x's rows, which the layer below writes and
// the forward reads), or layer 0's the dw256 chunk parts (z_dw256), where the plan may write
// them.
void rnnd__cuda_seq_layout(const struct cuda_ctx *c, const struct seq_plan *p,
                           const struct rnnd_model *m, int B, int T, struct seq_layout *lay) {
    size_t BT = (size_t)B * T, at = 0;
    int H = m->H, sw = (m->cell == RNND_CELL_LSTM ? 5 : 4) * H;
    memset(lay, 0, sizeof(*lay));
    for (int l = 0; l < m->L; l++) {
        struct seq_layer_layout *y = &lay->layer[l];
        y->Il = rnnd_model_layer_input(m, l);
        y->xoff = ROUND_UP(H + 1, 4);
        y->ldz = ROUND_UP(y->xoff + y->Il, 4);
        y->sw = sw;
        y->z_off = y->zc_off = at;
        y->x_off = at + y->xoff, y->ldx = y->ldz;
        size_t zf = BT * y->ldz;
        if (p->z_dw16[l]) {
            const size_t ex = m->compute == RNND_COMPUTE_FP32
                                  ? (size_t)CEIL_DIV(B, 16) * T * 16 * sizeof(int16_t)
                                  : 0;
            const size_t xr = l > 0 ? ROUND_UP(BT * y->Il, (size_t)64) : 0;
            const size_t zc =
                (size_t)seq_dw16_pitch(c, B, T) * RNND_DW16_Z(RNND_DW16_XK(y->Il)) + ex;
            zf = zf > xr + zc / sizeof(float) ? zf : xr + zc / sizeof(float);
            if (p->zfwd[l]) {
                y->zc_off = at + xr;
                if (l > 0)
                    y->x_off = at, y->ldx = y->Il;
            }
        } else if (l == 0 && p->z_dw256) {
            const size_t zc = (size_t)seq_dw256_pitch(c, B, T) * (RNND_DW256_Z + RNND_DW256_A);
            zf = zf > zc / sizeof(float) ? zf : zc / sizeof(float);
        }
        at += ROUND_UP(zf, (size_t)64);
        y->s_off = at;
        at += ROUND_UP(BT * sw, (size_t)64);
    }
    lay->tape_floats = at;
}

struct layer_params rnnd__cuda_layer_params(const struct rnnd_model *m, int l, const float *p) {
    struct rnnd_param_tensor t[4];
    for (int k = 0; k < 4; k++)
        rnnd_model_param_tensor(m, 4 * l + k, &t[k]);
    return (struct layer_params){p + t[0].offset, p + t[1].offset, p + t[2].offset,
                                 p + t[3].offset};
}

// The call facts of seq (the plan's input) with outs_aligned.
static struct seq_call seq_call_of(const struct rnnd_seq *seq, bool backward, bool tape,
                                   bool outs_aligned) {
    struct seq_call call = {};
    call.B = seq->B, call.backward = backward, call.tape = tape;
    call.x_aligned = aligned16(seq->x);
    call.states_aligned =
        aligned16(seq->h0) && aligned16(seq->c0) && aligned16(seq->hidden) && aligned16(seq->cell);
    call.outs_aligned = outs_aligned;
    return call;
}

size_t rnnd__cuda_tape_bytes(const struct cuda_ctx *c, const struct rnnd_model *m, int B, int T) {
    if (rnnd_model_check(m) != 0 || B < 1 || T < 1)
        return 0;
    // The tape's size depends on the model, the device and B alone.
    const struct seq_call call = {B, false, true, true, true, true};
    struct seq_plan p;
    rnnd__seq_plan(&c->dev, &c->tune, m, &call, &p);
    struct seq_layout lay;
    rnnd__cuda_seq_layout(c, &p, m, B, T, &lay);
    return lay.tape_floats * sizeof(float);
}

bool rnnd__cuda_seq_persistent(const struct cuda_ctx *c, const struct rnnd_model *m) {
    return !c->tune.stepwise && rnnd__seq_persist_hp(m, c->dev.smem_optin) > 0;
}

// Strides handed to cuBLAS and index arithmetic in int must fit.
static bool dims_fit(const struct rnnd_model *m, int B, int T) {
    int64_t w = 5 * (int64_t)m->H + m->I + 8;
    return (int64_t)T * w <= INT_MAX && (int64_t)B * T <= INT_MAX / 4;
}

// ---------------------------------------------------------------------------------------------
// GEMM (column-major cuBLAS view of our row-major arrays)

static cublasComputeType_t compute_type(enum rnnd_compute mode) {
    switch (mode) {
        case RNND_COMPUTE_BF16:
            return CUBLAS_COMPUTE_32F_FAST_16BF;
        case RNND_COMPUTE_IEEE:
            return CUBLAS_COMPUTE_32F_PEDANTIC;
        default:
            return CUBLAS_COMPUTE_32F_FAST_TF32;
    }
}

static int gemm(struct cuda_ctx *c, enum rnnd_compute mode, cublasOperation_t ta,
                cublasOperation_t tb, int M, int N, int K, const float *A, int lda, const float *B,
                int ldb, float beta, float *C, int ldc) {
    const float one = 1.0f;
    RNND_CUBLAS_TRY(cublasGemmEx(c->blas, ta, tb, M, N, K, &one, A, CUDA_R_32F, lda, B, CUDA_R_32F,
                                 ldb, &beta, C, CUDA_R_32F, ldc, compute_type(mode),
                                 CUBLAS_GEMM_DEFAULT));
    return 0;
}

// C_i = op(A_i) op(B_i) + beta C_i for count sets sa, sb and sc elements apart: A and B fp16, C
// fp32, accumulated in fp32.
static int gemm16(struct cuda_ctx *c, cublasOperation_t ta, cublasOperation_t tb, int M, int N,
                  int K, const __half *A, int lda, long long sa, const __half *B, int ldb,
                  long long sb, float *C, int ldc, long long sc, int count, float beta = 0.0f) {
    const float one = 1.0f;
    RNND_CUBLAS_TRY(cublasGemmStridedBatchedEx(
        c->blas, ta, tb, M, N, K, &one, A, CUDA_R_16F, lda, sa, B, CUDA_R_16F, ldb, sb, &beta, C,
        CUDA_R_32F, ldc, sc, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return 0;
}

// gemm()'s product, beta 0, for count operand sets sa, sb and sc floats apart: C_i = A_i B_i.
static int gemm_strided(struct cuda_ctx *c, enum rnnd_compute mode, cublasOperation_t ta,
                        cublasOperation_t tb, int M, int N, int K, const float *A, int lda,
                        long long sa, const float *B, int ldb, long long sb, float *C, int ldc,
                        long long sc, int count) {
    const float one = 1.0f, zero = 0.0f;
    RNND_CUBLAS_TRY(cublasGemmStridedBatchedEx(
        c->blas, ta, tb, M, N, K, &one, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb, sb, &zero, C,
        CUDA_R_32F, ldc, sc, count, compute_type(mode), CUBLAS_GEMM_DEFAULT));
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Per-step path kernels: a block a row (its cell kernels), or a thread an element.

// The per-step GEMMs' fp16 operands (TF32 and bf16 modes; ieee mode multiplies fp32): W_hh times
// a power of two of its own, and each step's rows (forward h, backward D_h) each times one of
// theirs, so that each one's largest |value| lies in [2^14, 2^15). fp16 keeps TF32's 10 mantissa
// bits, and cuBLAS multiplies it twice as fast as TF32 at issue 45's per-step rows (journal
// seq-09). The cell kernel that writes a step's rows also scales them (a block holds a row). The
// backward keeps every step's D rows (all four planes) for the weight gradients and dL/dx too.
#define STEP16_TOP 15
struct step16 {
    __half *w;      // W_hh (G H, H) times *wpow
    __half *v;      // rows, row r times pow[r]: the step's h (B, H) forward, D (B T, 4H) backward
    float *pow;     // (rows)
    float *wpow;    // W_hh's power
    unsigned *wmax; // |W_hh|'s largest, as bits
};

// Whether some layer runs the per-step loops in TF32 or bf16 mode, on the fp16 operands.
static bool step16_used(const struct seq_plan &p, const struct rnnd_model *m) {
    return !p.persistent && m->compute != RNND_COMPUTE_IEEE;
}

// The per-step loops' fp16 operands where step16_used: W_hh's copy (G H, H), rows of n halves and
// their powers; all null otherwise.
static step16 step16_carve(struct cuda_carve *cv, const struct seq_plan &p,
                           const struct rnnd_model *m, size_t rows, int n) {
    step16 q = {};
    if (!step16_used(p, m))
        return q;
    q.w = (__half *)cuda_carve(cv, (size_t)rnnd_model_gates(m) * m->H * m->H * sizeof(__half));
    q.v = (__half *)cuda_carve(cv, rows * n * sizeof(__half));
    q.pow = (float *)cuda_carve(cv, rows * sizeof(float));
    q.wpow = (float *)cuda_carve(cv, sizeof(float));
    q.wmax = (unsigned *)cuda_carve(cv, sizeof(unsigned));
    return q;
}

struct stepwise_args {
    int B, T, H, L, l;
    const uint8_t *is_init;
    const float *h0, *c0, *hidden, *cell;
    float *z; // tape z (hprev at 0)
    int ldz, xoff, Il;
    float *s;  // tape s
    bool sblk; // s in tape_b8's blocks (tape_blocked; HALF)
    const float *b_ih, *b_hh;
    step16 q; // q.w null: fp32 GEMMs
};

// Plane p of unit u at row b, step t of a layer's s: in rows of tape_rec or (sblk) in tape_b8's
// blocks.
template <class Cell, bool HALF, class A>
static __device__ float tape_get(const A &a, size_t b, int t, int p, int u) {
    using TR = tape_rec<Cell, HALF>;
    if (HALF && a.sblk)
        return tape_b8::get(a.s, b, t, p, u, a.T, a.H);
    return TR::get(a.s + (b * a.T + t) * TR::floats(a.H), p, a.H, u);
}
template <class Cell, bool HALF>
static __device__ void tape_put(const stepwise_args &a, size_t b, int t, int p, int u, float v) {
    using TR = tape_rec<Cell, HALF>;
    if (HALF && a.sblk)
        tape_b8::put(a.s, b, t, p, u, a.T, a.H, v);
    else
        TR::put(a.s + (b * a.T + t) * TR::floats(a.H), p, a.H, u, v);
}

// z row (b, t): hprev = h, the constant 1 and zero pads; the LSTM's cprev; in tape_b8's blocks
// the GRU's hprev too (plane 4, which the cluster backward reads).
template <class Cell, bool HALF>
static __device__ void stepwise_put_state(const stepwise_args &a, size_t b, int t, int u, float h,
                                          float c) {
    float *zr = a.z + (b * a.T + t) * a.ldz;
    zr[u] = h;
    if (Cell::G == 4)
        tape_put<Cell, HALF>(a, b, t, 4, u, c);
    else if (HALF && a.sblk)
        tape_put<Cell, HALF>(a, b, t, 4, u, h);
    if (u == 0) {
        zr[a.H] = 1.0f;
        for (int k = a.H + 1; k < a.xoff; k++)
            zr[k] = 0.0f;
        for (int k = a.xoff + a.Il; k < a.ldz; k++)
            zr[k] = 0.0f;
    }
}

// The per-step loops' cell and routing kernels follow a cuBLAS GEMM on the stream, whose
// programmatic dependents they are (Hopper): their blocks become resident while it finishes and
// wait for it (pdl_wait) before they read anything.
template <class Kernel, class... Args>
static int stepwise_launch(struct cuda_ctx *c, Kernel kernel, int grid, int block,
                           const Args &...args) {
    return cuda_launch(c->stream, c->dev.cc_major >= 9, kernel, dim3((unsigned)grid),
                       dim3((unsigned)block), 0, args...);
}

// The cell kernels' blocks: a row each, a thread for every unit up to 1024 (more loop).
#define STEP_ROW_THREADS 1024
static int stepwise_row_threads(int H) {
    return H < STEP_ROW_THREADS ? ROUND_UP(H, 32) : STEP_ROW_THREADS;
}

// q.wmax = the bits of |w|'s largest (n floats; zeroed before): non-negative floats order as
// their bits, so one atomicMax a block on them. A NaN weight does not set the power; the
// products it enters are NaN all the same. Each thread takes STEP16_SPAN elements, loaded at
// once: a grid-stride loop over 2 x 132 blocks waited on one load after another (29 us for LSTM
// H = 1024's 16 MB).
#define STEP16_SPAN 8
static __global__ void step16_absmax_kernel(const float *w, size_t n, unsigned *wmax) {
    __shared__ float red[32];
    const size_t at = blockIdx.x * (size_t)blockDim.x * STEP16_SPAN + threadIdx.x;
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < STEP16_SPAN; k++)
        if (at + (size_t)k * blockDim.x < n)
            m = fmaxf(m, fabsf(w[at + (size_t)k * blockDim.x]));
    m = persist_block_max(m, red);
    if (threadIdx.x == 0)
        atomicMax(wmax, __float_as_uint(m));
}

static __global__ void step16_weights_kernel(const float *w, size_t n, step16 q) {
    const float p = persist_pow2_for(__uint_as_float(*q.wmax), STEP16_TOP);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *q.wpow = p;
    const size_t at = blockIdx.x * (size_t)blockDim.x * STEP16_SPAN + threadIdx.x;
#pragma unroll
    for (int k = 0; k < STEP16_SPAN; k++)
        if (at + (size_t)k * blockDim.x < n)
            q.w[at + (size_t)k * blockDim.x] = __float2half_rn(w[at + (size_t)k * blockDim.x] * p);
}

// q.w = W_hh (n floats) in fp16 times its power.
static int step16_weights(struct cuda_ctx *c, const float *w, size_t n, const step16 &q) {
    const unsigned grid = (unsigned)CEIL_DIV(n, (size_t)SEQ_BLOCK * STEP16_SPAN);
    RNND_CUDA_TRY(cudaMemsetAsync(q.wmax, 0, sizeof(unsigned), c->stream));
    step16_absmax_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(w, n, q.wmax);
    CUDA_LAUNCH_CHECK();
    step16_weights_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(w, n, q);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// The block's threads ask L2 for the bytes at p, a 128-byte line each: the next step's rows, so
// that the kernel of that step finds them there rather than in DRAM (its first loads wait on them).
static __device__ __forceinline__ void stepwise_prefetch(const void *p, size_t bytes) {
    for (size_t o = threadIdx.x * (size_t)128; o < bytes; o += blockDim.x * (size_t)128)
        prefetch_l2((const char *)p + o);
}

// Row b's N H values into q.v times the row's power, q.pow[b] (a kernel that reads q.pow[b]
// too must have read it in every thread before): m, the largest |value| each thread wrote. Where
// H <= blockDim.x each thread holds its values (own[k], element k H + threadIdx.x) and writes
// them from registers; else the row is read back from v, where the block's threads wrote it (the
// block maximum's barriers make every thread's writes visible to all).
template <int N>
static __device__ void step16_put_row(const step16 &q, size_t b, const float *v, int H,
                                      const float (&own)[N], float m, float *red) {
    const float p = persist_pow2_for(persist_block_max(m, red), STEP16_TOP);
    __half *o = q.v + b * N * H;
    if (H <= (int)blockDim.x) {
        for (int k = 0; k < N && (int)threadIdx.x < H; k++)
            o[k * H + threadIdx.x] = __float2half_rn(own[k] * p);
    } else {
        for (int i = threadIdx.x; i < N * H; i += blockDim.x)
            o[i] = __float2half_rn(v[i] * p);
    }
    if (threadIdx.x == 0)
        q.pow[b] = p;
}

template <class Cell, bool HALF>
static __global__ void __launch_bounds__(STEP_ROW_THREADS)
    stepwise_init_kernel(const stepwise_args a) {
    __shared__ float red[32];
    const size_t b = blockIdx.x, r = b * a.T;
    const int H = a.H;
    float m = 0.0f, own[1] = {0.0f};
    for (int u = threadIdx.x; u < H; u += blockDim.x) {
        float h = 0.0f, c = 0.0f;
        if (a.hidden) {
            h = a.hidden[(r * a.L + a.l) * H + u];
            if (a.cell)
                c = a.cell[(r * a.L + a.l) * H + u];
        } else if (!a.is_init[r] && a.h0) {
            h = a.h0[(b * a.L + a.l) * H + u];
            if (a.c0)
                c = a.c0[(b * a.L + a.l) * H + u];
        }
        stepwise_put_state<Cell, HALF>(a, b, 0, u, h, c);
        m = fmaxf(m, fabsf(h)), own[0] = h;
    }
    if (a.q.w)
        step16_put_row(a.q, b, a.z + r * a.ldz, H, own, m, red);
}

// Step t of row b (the block's): hg's row is h(t) W_hh^T, times the row's and W_hh's powers where
// the GEMM took the fp16 operands.
template <class Cell, bool HALF>
static __global__ void __launch_bounds__(STEP_ROW_THREADS)
    stepwise_cell_kernel(const stepwise_args a, int t, const float *xg, const float *hg, float *y,
                         int ldy, float *h_n, float *c_n) {
    constexpr int G = Cell::G, SW = Cell::SW;
    constexpr bool LSTM = G == 4;
    __shared__ float red[32];
    pdl_wait();
    const int H = a.H, T = a.T;
    const size_t b = blockIdx.x, r = b * T + t;
    const float ir = a.q.w ? pow2_inv(a.q.pow[b]) : 1.0f, iw = a.q.w ? pow2_inv(*a.q.wpow) : 1.0f;
    if (t + 1 < T) // x W_ih^T of step t + 1
        stepwise_prefetch(xg + (r + 1) * (G * H), (size_t)G * H * sizeof(float));
    float m = 0.0f, own[1] = {0.0f};
    for (int u = threadIdx.x; u < H; u += blockDim.x) {
        float xq[G], hq[G], s[SW];
        for (int q = 0; q < G; q++) {
            xq[q] = xg[r * (G * H) + q * H + u] + a.b_ih[q * H + u];
            hq[q] = hg[b * (G * H) + q * H + u] * ir * iw + a.b_hh[q * H + u];
        }
        float h = a.z[r * a.ldz + u];
        float c = LSTM ? tape_get<Cell, HALF>(a, b, t, 4, u) : 0.0f;
        float hn, cn;
        Cell::template forward<false>(xq, hq, h, c, hn, cn, s);
        y[r * ldy + u] = hn;
        for (int p = 0; p < 4; p++)
            tape_put<Cell, HALF>(a, b, t, p, u, s[p]);
        if (t + 1 < T) {
            size_t r1 = r + 1;
            if (a.is_init[r1]) {
                hn = a.hidden ? a.hidden[(r1 * a.L + a.l) * H + u] : 0.0f;
                cn = a.cell ? a.cell[(r1 * a.L + a.l) * H + u] : 0.0f;
            }
            stepwise_put_state<Cell, HALF>(a, b, t + 1, u, hn, cn);
            m = fmaxf(m, fabsf(hn)), own[0] = hn;
        } else {
            if (h_n)
                h_n[(b * a.L + a.l) * H + u] = hn;
            if (c_n)
                c_n[(b * a.L + a.l) * H + u] = cn;
        }
    }
    if (a.q.w && t + 1 < T)
        step16_put_row(a.q, b, a.z + (r + 1) * a.ldz, H, own, m, red);
}

struct stepwise_bwd_args {
    int B, T, H, L, l;
    bool stored;
    const uint8_t *is_init;
    const float *z;
    int ldz;
    const float *s;
    bool sblk; // as stepwise_args
    const float *gy;
    int ldgy;
    const float *gh_n, *gc_n;
    float *d;         // D in fp32 (B T, 4H): null where only its fp16 copy (q) is read
    float *dhp, *dcp; // (B, H) gradient of the state entering step t (before routing): the
                      // cell's direct part, to which dhp's D_h W_hh adds as parts shares
    float *part;      // (parts, B, H) of the product's K slices
    int parts;
    float *g_h0, *g_c0, *g_hidden, *g_cell;
    step16 q; // as stepwise_args
};

// 1 / the powers of the shares of row r = b T + t (D_h's row and W_hh's) where the GEMM took fp16.
static __device__ __forceinline__ void stepwise_share_inv(const stepwise_bwd_args &a, size_t r,
                                                          float &ir, float &iw) {
    ir = a.q.w ? pow2_inv(a.q.pow[r]) : 1.0f;
    iw = a.q.w ? pow2_inv(*a.q.wpow) : 1.0f;
}

// The gradient of the state entering step t (dhp, dcp: the cell's direct part plus the shares of
// D W_hh, times ir and iw) of element (b, u): carried into step t - 1 (dh, dc), or at t = 0 or a
// reset to the state it came from (the stored state, h0, or none) with nothing carried.
static __device__ __forceinline__ void stepwise_route(const stepwise_bwd_args &a, size_t b, int u,
                                                      int t, float ir, float iw, float &dh,
                                                      float &dc) {
    const size_t idx = b * a.H + u, r = b * a.T + t, BH = (size_t)a.B * a.H;
    const bool reset = a.is_init[r] != 0;
    float sh = 0.0f;
    for (int k = 0; k < a.parts; k++)
        sh += a.part[k * BH + idx];
    const float dhp = a.dhp[idx] + sh * ir * iw, dcp = a.dcp[idx];
    dh = 0.0f, dc = 0.0f;
    if (t > 0 && !reset) {
        dh = dhp, dc = dcp;
    } else if (a.stored) {
        size_t at = (r * a.L + a.l) * a.H + u;
        if (a.g_hidden)
            a.g_hidden[at] = dhp;
        if (a.g_cell)
            a.g_cell[at] = dcp;
    } else if (!reset) {
        size_t at = (b * a.L + a.l) * a.H + u;
        if (a.g_h0)
            a.g_h0[at] = dhp;
        if (a.g_c0)
            a.g_c0[at] = dcp;
    }
}

// Step t's cell backward of row b (the block's), after routing step t + 1's state gradient
// (t < T - 1: one kernel a step instead of two; step T - 1 starts from h_n's and c_n's
// gradients). With fp16 GEMMs it writes D's row in fp16 for the next one and the weight
// gradients (the max over all four planes, the GRU's input-side n too).
template <class Cell, bool HALF>
static __global__ void __launch_bounds__(STEP_ROW_THREADS)
    stepwise_cell_backward_kernel(const stepwise_bwd_args a, int t) {
    constexpr int G = Cell::G, SW = Cell::SW;
    __shared__ float red[32];
    pdl_wait();
    const int H = a.H, T = a.T;
    const size_t b = blockIdx.x, r = b * T + t;
    float ir = 1.0f, iw = 1.0f, m = 0.0f, own[4] = {};
    if (t + 1 < T)
        stepwise_share_inv(a, r + 1, ir, iw);
    if (t > 0) { // step t - 1's tape, hprev and output gradient
        using TR = tape_rec<Cell, HALF>;
        if (!(HALF && a.sblk))
            stepwise_prefetch(a.s + (r - 1) * TR::floats(H), TR::floats(H) * sizeof(float));
        stepwise_prefetch(a.z + (r - 1) * a.ldz, H * sizeof(float));
        stepwise_prefetch(a.gy + (r - 1) * a.ldgy, H * sizeof(float));
    }
    for (int u = threadIdx.x; u < H; u += blockDim.x) {
        float dh_in, dc_in;
        if (t == T - 1) {
            dh_in = a.gh_n ? a.gh_n[(b * a.L + a.l) * H + u] : 0.0f;
            dc_in = a.gc_n ? a.gc_n[(b * a.L + a.l) * H + u] : 0.0f;
        } else {
            stepwise_route(a, b, u, t + 1, ir, iw, dh_in, dc_in);
        }
        float s[SW], d[4], tile[G], ddir, dcp;
        for (int p = 0; p < SW; p++)
            s[p] = tape_get<Cell, HALF>(a, b, t, p, u);
        float hprev = a.z[r * a.ldz + u];
        Cell::template backward<false>(s, hprev, a.gy[r * a.ldgy + u] + dh_in, dc_in, d, tile, ddir,
                                       dcp);
        for (int p = 0; a.d && p < 4; p++)
            a.d[r * (4 * H) + p * H + u] = d[p];
        for (int p = 0; p < 4; p++)
            m = fmaxf(m, fabsf(d[p])), own[p] = d[p];
        a.dhp[b * H + u] = ddir;
        a.dcp[b * H + u] = dcp;
    }
    if (a.q.w) // read back from a.d where H > blockDim.x (stepwise_backward keeps it there)
        step16_put_row(a.q, r, a.d + r * (4 * H), H, own, m, red);
}

// Step 0's routing, after the last GEMM: a thread an element.
static __global__ void stepwise_route0_kernel(const stepwise_bwd_args a) {
    pdl_wait();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= a.B * a.H)
        return;
    const size_t b = idx / a.H;
    float ir, iw, dh, dc;
    stepwise_share_inv(a, b * a.T, ir, iw);
    stepwise_route(a, b, idx % a.H, 0, ir, iw, dh, dc);
}

// grads of layer l += the GEMM result tmp (D row q, z column k at q * sq + k * sk: dw_gemm's
// order), times zinv[k] where the product took z16 (dw16_operands): the x_l part to W_ih, the
// hprev part to W_hh, the constant column to the biases. D row of gate q: the same for the hidden
// side; for the GRU's input side n is the fourth plane (da_n; the third is da_n r).
static __global__ void dw_scatter_kernel(float *gw_ih, float *gw_hh, float *gb_ih, float *gb_hh,
                                         const float *tmp, const float *zinv, size_t sq, size_t sk,
                                         int G, int H, int Il, int xoff, bool gru) {
    int cols = Il + H + 1;
    size_t n = (size_t)G * H * cols;
    auto at = [&](int q, int k) { return tmp[k * sk + q * sq] * (zinv ? zinv[k] : 1.0f); };
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int row = (int)(idx / cols), col = (int)(idx % cols);
        int hh = row, ih = gru && row >= 2 * H ? row + H : row;
        if (col < Il)
            gw_ih[(size_t)row * Il + col] += at(ih, xoff + col);
        else if (col < Il + H)
            gw_hh[(size_t)row * H + col - Il] += at(hh, col - Il);
        else {
            gb_ih[row] += at(ih, H);
            gb_hh[row] += at(hh, H);
        }
    }
}

// The weight gradients' product on fp16 operands after the per-step backward (TF32 and bf16
// modes), at the per-step GEMMs' speed-up: D's rows as that backward wrote them (q.v, row r times
// its power P_r), and z16 = z's rows over P_r, each column k times a power F_k of its own that
// puts its largest |value| in [2^14, 2^15). The rows' powers cancel in the product, and column k
// of z16^T D16 is that of z^T D times F_k (zinv[k] = 1 / F_k). So a vanishing D row and an x
// column of its own magnitude each keep their 10 bits, as in TF32; what fp16 loses is a value
// 2^-24 or more below its row's largest (D) or its column's (z), whose terms are that much
// below the sum's largest.
#define DW16_ROWS 32 // z rows a block of the two kernels below
static __global__ void dw16_zmax_kernel(const float *z, int ldz, size_t K, const float *pow,
                                        unsigned *zmax) {
    const size_t r0 = blockIdx.x * (size_t)DW16_ROWS, r1 = r0 + DW16_ROWS < K ? r0 + DW16_ROWS : K;
    for (int k = threadIdx.x; k < ldz; k += blockDim.x) {
        float m = 0.0f;
        for (size_t r = r0; r < r1; r++)
            m = fmaxf(m, fabsf(z[r * ldz + k] * pow2_inv(pow[r])));
        if (m > 0.0f) // non-negative floats order as their bits
            atomicMax(zmax + k, __float_as_uint(m));
    }
}
static __global__ void dw16_z_kernel(const float *z, int ldz, size_t K, const float *pow,
                                     const unsigned *zmax, __half *z16, int ldz16, float *zinv) {
    const size_t r0 = blockIdx.x * (size_t)DW16_ROWS, r1 = r0 + DW16_ROWS < K ? r0 + DW16_ROWS : K;
    for (int k = threadIdx.x; k < ldz; k += blockDim.x) {
        const float f = persist_pow2_for(__uint_as_float(zmax[k]), STEP16_TOP);
        if (blockIdx.x == 0)
            zinv[k] = pow2_inv(f);
        for (size_t r = r0; r < r1; r++) // as dw16_zmax_kernel's, then F_k: at most 2^15
            z16[r * ldz16 + k] = __float2half_rn(z[r * ldz + k] * pow2_inv(pow[r]) * f);
    }
}

// The fp16 operands of dw_gemm: D's rows (4H halves each) and z16 (ldz16 halves a row).
struct dw_f16 {
    const __half *d, *z;
    int ldz16;
};

// z16 and zinv for z (K rows of ldz floats) and D's row powers (dw16_z_kernel), zmax scratch.
static int dw16_operands(struct cuda_ctx *c, const float *z, int ldz, size_t K, const float *pow,
                         unsigned *zmax, __half *z16, int ldz16, float *zinv) {
    const unsigned grid = (unsigned)CEIL_DIV(K, (size_t)DW16_ROWS);
    RNND_CUDA_TRY(cudaMemsetAsync(zmax, 0, (size_t)ldz * sizeof(unsigned), c->stream));
    dw16_zmax_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(z, ldz, K, pow, zmax);
    CUDA_LAUNCH_CHECK();
    dw16_z_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(z, ldz, K, pow, zmax, z16, ldz16, zinv);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// dL/dx from D's fp16 rows: dx (K rows of n floats) came from D16 W16_ih, row r times its power
// P_r and the weights' copy times *wpow; divided by both here.
static __global__ void dx16_scale_kernel(float *dx, int n, size_t K, const float *pow,
                                         const float *wpow) {
    const float iw = pow2_inv(*wpow);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < K * n;
         i += (size_t)gridDim.x * blockDim.x)
        dx[i] *= pow2_inv(pow[i / n]) * iw;
}

// tmp = z^T D over K rows (D: 4H columns, z: ldz), in one of three ways (dw_how): D's 4H columns
// as cuBLAS's M (D column q with z column k at k * 4H + q); z's ldz columns as M (at q * ldz + k);
// or the same in two products, z's first ldz rounded down to 128 columns and the rest (a few
// columns past a multiple of cuBLAS's tiles cost a second wave of them: ldz = 1028 at H = 512
// I = 512 is 144 tiles of 128 x 128 for 132 SMs). The way follows from the shape alone, so that
// every process computes the same bits: one timed per context made two daemons' weights differ
// in their last bits after the same update (journal service-02 s37). On the H200 the split is
// the fastest or level with the fastest from ldz = 512 (the per-step rows, LSTM H = 384 to 2048),
// and below that the three are within 1-3% of one another, where D's columns as M stays.
enum dw_how { DW_M4, DW_MLDZ, DW_MSPLIT };
static int dw_gemm(struct cuda_ctx *c, enum rnnd_compute mode, int M4, int ldz, int K,
                   const float *d, const float *z, const dw_f16 *h, float *tmp, bool *ldz_m) {
    const int m0 = ldz / 128 * 128; // DW_MSPLIT's first part
    const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
    auto part = [&](int m, int n, int k0, bool zm) -> int { // z's columns [k0, k0 + m or n)
        if (h)
            return zm ? gemm16(c, N, T, m, n, K, h->z + k0, h->ldz16, 0, h->d, M4, 0, tmp + k0, ldz,
                               0, 1)
                      : gemm16(c, N, T, m, n, K, h->d, M4, 0, h->z, h->ldz16, 0, tmp, M4, 0, 1);
        return zm ? gemm(c, mode, N, T, m, n, K, z + k0, ldz, d, M4, 0.0f, tmp + k0, ldz)
                  : gemm(c, mode, N, T, m, n, K, d, M4, z, ldz, 0.0f, tmp, M4);
    };
    const enum dw_how how = c->tune.dw_m4       ? DW_M4 // the tests' and the bench's choice
                            : c->tune.dw_mldz   ? DW_MLDZ
                            : c->tune.dw_msplit ? DW_MSPLIT
                            : ldz >= 512        ? DW_MSPLIT
                                                : DW_M4;
    *ldz_m = how != DW_M4;
    if (how == DW_M4)
        return part(M4, ldz, 0, false);
    const int m = how == DW_MSPLIT && m0 > 0 ? m0 : ldz;
    RNND_TRY(part(m, M4, 0, true));
    return m < ldz ? part(ldz - m, M4, m, true) : 0;
}

// ---------------------------------------------------------------------------------------------
// The per-step loops as CUDA graphs. Issued one launch at a time, a loop runs at the host's pace:
// 17-28 us a step at issue 45's per-step rows, where the same GEMM and cell replayed from a graph
// take 9.5-19 (journal seq-08). So each loop is recorded once and replayed while its arguments
// stay the same (the bench's and a learner's buffers do): a key holds every value the loop's
// launches take, pointers included; the kernels read the data behind them when they run.

// Every argument of a per-step loop, padding zeroed (the key is compared byte for byte).
struct stepwise_key {
    bool fwd, half, lstm;
    int mode, ld;
    const void *p[6];
    union {
        stepwise_args a;     // fwd
        stepwise_bwd_args b; // !fwd
    };
};
static_assert(sizeof(stepwise_key) <= SEQ_GRAPH_KEY_BYTES, "the key fits a seq_graph");

// Enqueues launch()'s loop: the graph recorded under key k, recorded first (rnnd__cuda_record_*)
// into the least recently used slot where no slot holds it. On a stream already being recorded
// (the daemon's recordings), with the no_graph variant, or where the recording fails, launched
// as is.
template <class F>
static int stepwise_graph(struct cuda_ctx *c, const stepwise_key &k, F launch) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (c->tune.no_graph || cudaStreamIsCapturing(c->stream, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone)
        return launch();
    struct seq_graph *g = nullptr, *lru = &c->seq_graphs[0];
    for (auto &s : c->seq_graphs) {
        if (s.exec && memcmp(s.key, &k, sizeof(k)) == 0) {
            g = &s;
            break;
        }
        if (s.used < lru->used)
            lru = &s;
    }
    if (g == nullptr) {
        g = lru;
        if (g->exec)
            cudaGraphExecDestroy(g->exec);
        g->exec = nullptr;
        void *unit = nullptr;
        int rc = rnnd__cuda_record_begin(c);
        if (rc == 0) {
            rc = launch();
            const int end = rnnd__cuda_record_end(c, &unit);
            rc = rc ? rc : end;
        }
        if (rc != 0 || unit == nullptr) {
            if (unit) // a recording cut short by a failed launch
                cudaGraphExecDestroy((cudaGraphExec_t)unit);
            return launch(); // as is: its own error, if it has one
        }
        g->exec = (cudaGraphExec_t)unit;
        memcpy(g->key, &k, sizeof(k));
    }
    g->used = ++c->seq_graph_calls;
    RNND_CUDA_TRY(cudaGraphLaunch(g->exec, c->stream));
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Forward

static int stepwise_forward(struct cuda_ctx *c, const struct rnnd_model *m, const stepwise_args &a,
                            bool half, const struct layer_params &lp, const float *xg, float *hg,
                            float *y, int ldy, float *h_n, float *c_n) {
    bool lstm = m->cell == RNND_CELL_LSTM;
    const int GH = rnnd_model_gates(m) * a.H, rows = stepwise_row_threads(a.H);
    auto init = lstm ? (half ? &stepwise_init_kernel<cell_lstm, true>
                             : &stepwise_init_kernel<cell_lstm, false>)
                     : (half ? &stepwise_init_kernel<cell_gru, true>
                             : &stepwise_init_kernel<cell_gru, false>);
    auto cell = lstm ? (half ? &stepwise_cell_kernel<cell_lstm, true>
                             : &stepwise_cell_kernel<cell_lstm, false>)
                     : (half ? &stepwise_cell_kernel<cell_gru, true>
                             : &stepwise_cell_kernel<cell_gru, false>);
    stepwise_key k;
    memset(&k, 0, sizeof(k));
    k.fwd = true, k.half = half, k.lstm = lstm, k.mode = m->compute, k.ld = ldy;
    memcpy(&k.a, &a, sizeof(a));
    const void *p[] = {lp.w_hh, xg, hg, y, h_n, c_n};
    memcpy(k.p, p, sizeof(p));
    return stepwise_graph(c, k, [&]() -> int {
        if (a.q.w)
            RNND_TRY(step16_weights(c, lp.w_hh, (size_t)GH * a.H, a.q));
        init<<<a.B, rows, 0, c->stream>>>(a);
        CUDA_LAUNCH_CHECK();
        for (int t = 0; t < a.T; t++) {
            // hg (B, G*H) = hprev(t) W_hh^T: from the fp16 copies, or hprev rows T*ldz floats
            // apart in z.
            if (a.q.w)
                RNND_TRY(gemm16(c, CUBLAS_OP_T, CUBLAS_OP_N, GH, a.B, a.H, a.q.w, a.H, 0, a.q.v,
                                a.H, 0, hg, GH, 0, 1));
            else
                RNND_TRY(gemm(c, m->compute, CUBLAS_OP_T, CUBLAS_OP_N, GH, a.B, a.H, lp.w_hh, a.H,
                              a.z + (size_t)t * a.ldz, a.T * a.ldz, 0.0f, hg, GH));
            RNND_TRY(
                stepwise_launch(c, cell, a.B, rows, a, t, xg, (const float *)hg, y, ldy, h_n, c_n));
        }
        return 0;
    });
}

// Layer l's persistent forward as y names it.
static int persist_forward(struct cuda_ctx *c, const struct rnnd_model *m, const struct seq_plan &p,
                           const struct seq_layer_plan &y, const struct persist_fwd_args &a) {
    const bool bf16 = m->compute == RNND_COMPUTE_BF16, lstm = m->cell == RNND_CELL_LSTM;
    if (y.fwd == SEQ_FWD_WGMMA) {
#ifdef RNND_HAVE_WG
        return lstm ? rnnd__wg_lstm_forward(&a, bf16, p.phase_clocks, c->stream)
                    : rnnd__wg_gru_forward(&a, bf16, p.phase_clocks, c->stream);
#else
        return RNND_EINVAL;     // never planned: the device has no sm_90a kernels here
#endif
    }
    return lstm ? rnnd__persist_lstm_forward(&a, bf16, p.HP, p.phase_clocks, c->stream)
                : rnnd__persist_gru_forward(&a, bf16, p.HP, y.fwd == SEQ_FWD_MMA_KP, p.phase_clocks,
                                            c->stream);
}

int rnnd__cuda_rnn_forward(struct cuda_ctx *c, float *out, float *h_n, float *c_n, void *tape,
                           const struct rnnd_seq *seq, const float *params,
                           const struct rnnd_model *m) {
    if (c == NULL || rnnd_seq_check(seq, m) != 0 || out == NULL || params == NULL ||
        !aligned16(tape)) // the loops copy it in bulk
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if ((c_n && !lstm) || !dims_fit(m, seq->B, seq->T))
        return RNND_EINVAL;
    int B = seq->B, T = seq->T, H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t BT = (size_t)B * T;
    const struct seq_call call =
        seq_call_of(seq, false, tape != NULL, aligned16(out) && aligned16(h_n) && aligned16(c_n));
    struct seq_plan p;
    rnnd__seq_plan(&c->dev, &c->tune, m, &call, &p);
    struct seq_layout lay;
    rnnd__cuda_seq_layout(c, &p, m, B, T, &lay);

    bool need_xg = false; // x W_ih^T from a GEMM for some layer
    for (int l = 0; l < L; l++)
        need_xg = need_xg || (p.layer[l].xks == 0 && p.layer[l].fwd != SEQ_FWD_CLUSTER);
    // Misaligned outputs of a forward that writes layer 0's z as chunk parts go through aligned
    // scratch, copied out at the end (plan.stage).
    float *xg, *hg, *own, *ys, *hs, *cs;
    step16 q16;
    struct cuda_carve cv = {0};
    const size_t blh = (size_t)B * L * H * sizeof(float);
    for (int pass = 0; pass < 2; pass++) {
        xg = (float *)cuda_carve(&cv, need_xg ? BT * GH * sizeof(float) : 0);
        hg = (float *)cuda_carve(&cv, p.persistent ? 0 : (size_t)B * GH * sizeof(float));
        q16 = step16_carve(&cv, p, m, B, H);
        own = (float *)cuda_carve(&cv, tape ? 0 : lay.tape_floats * sizeof(float));
        ys = (float *)cuda_carve(&cv, p.stage ? BT * H * sizeof(float) : 0);
        hs = (float *)cuda_carve(&cv, p.stage && h_n ? blh : 0);
        cs = (float *)cuda_carve(&cv, p.stage && c_n ? blh : 0);
        if (pass == 0)
            RNND_TRY(cuda_carve_scratch(c, &cv));
    }
    RNND_TRY(cuda_carve_fits(&cv));
    float *tp = tape ? (float *)tape : own;
    float *const out_to = out, *const h_n_to = h_n, *const c_n_to = c_n;
    if (p.stage)
        out = ys, h_n = h_n ? hs : nullptr, c_n = c_n ? cs : nullptr;
    const bool vec = p.vec;
    const int dw_pitch = seq_dw16_pitch(c, B, T);

    for (int l = 0; l < L; l++) {
        const struct seq_layer_plan &y = p.layer[l];
        const struct seq_layer_layout *ly = &lay.layer[l];
        struct layer_params lp = rnnd__cuda_layer_params(m, l, params);
        float *z = tp + ly->z_off, *s = tp + ly->s_off;
        const float *x = l == 0 ? seq->x : tp + ly->x_off;
        int ldx = l == 0 ? m->I : ly->ldx;
        // A loop that reads the layer input (y.xloop) also copies x into the tape (layer 0,
        // where z is rows); otherwise a 2D copy does, and a GEMM gives x W_ih^T where the loop
        // does not fuse it.
        const bool clus = y.fwd == SEQ_FWD_CLUSTER;
        const bool zc = y.z_chunks && !clus, cz = y.z_chunks && clus; // dw16 or dw256 parts
        bool xcopy = y.xloop && tape && l == 0 && !y.z_chunks;
        if (tape && l == 0 && !xcopy && !y.z_chunks)
            RNND_CUDA_TRY(cudaMemcpy2DAsync(z + ly->xoff, ly->ldz * sizeof(float), seq->x,
                                            m->I * sizeof(float), m->I * sizeof(float), BT,
                                            cudaMemcpyDeviceToDevice, c->stream));
        if (y.xks == 0 && !clus)
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_T, CUBLAS_OP_N, GH, (int)BT, ly->Il, lp.w_ih,
                          ly->Il, x, ldx, 0.0f, xg, GH));
        float *yo = l < L - 1 ? tp + lay.layer[l + 1].x_off : out;
        int ldy = l < L - 1 ? lay.layer[l + 1].ldx : H;

        if (clus) {
            struct persist_fwd_args a = {};
            a.B = B, a.T = T, a.H = H, a.L = L, a.l = l, a.vec = vec;
            a.w_ih = lp.w_ih, a.w_hh = lp.w_hh, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.is_init = seq->is_init, a.h0 = seq->h0, a.c0 = seq->c0;
            a.hidden = seq->hidden, a.cell = seq->cell;
            a.y = yo, a.ldy = ldy;
            a.z = tape ? z : nullptr, a.ldz = ly->ldz, a.xoff = ly->xoff, a.Il = ly->Il;
            a.s = tape ? s : nullptr, a.shalf = p.tape_half;
            a.h_n = h_n, a.c_n = c_n;
            a.x = x, a.ldx = ldx, a.xvec = ldx % 4 == 0, a.xcopy = xcopy;
            if (cz) { // the chunks past the loop's (whole stages for the product) hold zeros
                const int pitch = seq_dw256_pitch(c, B, T);
                const size_t nch = (size_t)CEIL_DIV(B, 16) * T;
                char *zch = (char *)z, *aux = zch + (size_t)pitch * RNND_DW256_Z;
                RNND_CUDA_TRY(cudaMemsetAsync(zch + nch * RNND_DW256_Z, 0,
                                              (pitch - nch) * RNND_DW256_Z, c->stream));
                RNND_CUDA_TRY(cudaMemsetAsync(aux + nch * RNND_DW256_A, 0,
                                              (pitch - nch) * RNND_DW256_A, c->stream));
                a.z = nullptr, a.zc = zch, a.zc_aux = aux;
            }
            RNND_TRY(rnnd__cluster_forward(&a, lstm, p.rows, c->stream));
        } else if (y.fwd != SEQ_FWD_STEPWISE) {
            struct persist_fwd_args a = {};
            a.B = B, a.T = T, a.H = H, a.L = L, a.l = l, a.vec = vec;
            a.xks = y.xks, a.xg = y.xks ? nullptr : xg, a.w_ih = lp.w_ih;
            a.w_hh = lp.w_hh, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.is_init = seq->is_init, a.h0 = seq->h0, a.c0 = seq->c0;
            a.hidden = seq->hidden, a.cell = seq->cell;
            a.y = yo, a.ldy = ldy;
            a.z = tape ? z : nullptr, a.ldz = ly->ldz, a.xoff = ly->xoff, a.Il = ly->Il;
            a.s = y.gates ? s : nullptr, a.shalf = p.tape_half;
            a.h_n = h_n, a.c_n = c_n;
            a.x = y.xks || xcopy || zc ? x : nullptr, a.ldx = ldx;
            a.xvec = ly->Il % 4 == 0 && ldx % 4 == 0 && aligned16(x);
            a.xcopy = xcopy;
            a.dbg = c->d_dbg;
            if (zc) { // the chunks past the loop's (whole stages for the product) hold zeros
                const size_t nch = (size_t)CEIL_DIV(B, 16) * T;
                const long zb = RNND_DW16_Z(RNND_DW16_XK(ly->Il));
                char *zch = (char *)(tp + ly->zc_off);
                RNND_CUDA_TRY(cudaMemsetAsync(zch + nch * zb, 0, (dw_pitch - nch) * zb, c->stream));
                a.z = nullptr, a.zc = zch;
                if (m->compute == RNND_COMPUTE_FP32) // x's exponents
                    a.zc_ex = (int16_t *)(zch + (size_t)dw_pitch * zb);
            }
            RNND_TRY(persist_forward(c, m, p, y, a));
        } else {
            stepwise_args a;
            memset(&a, 0, sizeof(a)); // padding too: the graphs' keys (stepwise_key) hold it
            a.B = B, a.T = T, a.H = H, a.L = L, a.l = l;
            a.is_init = seq->is_init, a.h0 = seq->h0, a.c0 = seq->c0;
            a.hidden = seq->hidden, a.cell = seq->cell;
            a.z = z, a.ldz = ly->ldz, a.xoff = ly->xoff, a.Il = ly->Il, a.s = s;
            a.sblk = p.tape_blocked;
            a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.q = q16;
            RNND_TRY(stepwise_forward(c, m, a, p.tape_half, lp, xg, hg, yo, ldy, h_n, c_n));
        }
    }
    if (p.stage) {
        RNND_CUDA_TRY(cudaMemcpyAsync(out_to, out, BT * H * sizeof(float), cudaMemcpyDeviceToDevice,
                                      c->stream));
        if (h_n)
            RNND_CUDA_TRY(cudaMemcpyAsync(h_n_to, h_n, blh, cudaMemcpyDeviceToDevice, c->stream));
        if (c_n)
            RNND_CUDA_TRY(cudaMemcpyAsync(c_n_to, c_n, blh, cudaMemcpyDeviceToDevice, c->stream));
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Backward

// The K slices of the per-step backward's D_h W_hh (M = H, N = B, K = G H): doubled while the
// product's 64 x 128 tiles times them stay within the SMs and G H splits evenly, at most
// SEQ_STEP_PARTS: with fp16 operands 4 slices multiply as fast as 8 at issue 45's per-step rows,
// and the next kernel reads half the shares (journal seq-09).
#define SEQ_STEP_PARTS 4
static int stepwise_parts(const struct cuda_ctx *c, int B, int H, int G) {
    const int tiles = CEIL_DIV(H, 64) * CEIL_DIV(B, 128);
    int n = 1;
    while (2 * n <= SEQ_STEP_PARTS && 2 * n * tiles <= c->dev.num_sms && (G * H) % (2 * n) == 0)
        n *= 2;
    return n;
}

static int stepwise_backward(struct cuda_ctx *c, const struct rnnd_model *m,
                             const stepwise_bwd_args &a, bool half, const float *w_hh) {
    bool lstm = m->cell == RNND_CELL_LSTM;
    const int H = a.H, grid = CEIL_DIV(a.B * H, SEQ_BLOCK), ldd = a.T * 4 * H;
    const int K = (lstm ? 4 : 3) * H, Ks = K / a.parts, rows = stepwise_row_threads(H);
    auto cell = lstm ? (half ? &stepwise_cell_backward_kernel<cell_lstm, true>
                             : &stepwise_cell_backward_kernel<cell_lstm, false>)
                     : (half ? &stepwise_cell_backward_kernel<cell_gru, true>
                             : &stepwise_cell_backward_kernel<cell_gru, false>);
    stepwise_key k;
    memset(&k, 0, sizeof(k));
    k.fwd = false, k.half = half, k.lstm = lstm, k.mode = m->compute;
    memcpy(&k.b, &a, sizeof(a));
    k.p[0] = w_hh;
    return stepwise_graph(c, k, [&]() -> int {
        if (a.q.w)
            RNND_TRY(step16_weights(c, w_hh, (size_t)K * H, a.q));
        for (int t = a.T - 1; t >= 0; t--) {
            RNND_TRY(stepwise_launch(c, cell, a.B, rows, a, t));
            // D_h(t) W_hh (B, H), D's first G planes being the hidden side's gradient (or their
            // fp16 copy), in a.parts K slices, each into its share, which the next kernel adds
            // to dhp: at H = 512 with B = 256 cuBLAS split K itself and reduced the slices in a
            // kernel of its own, one launch more a step (journal seq-08).
            if (a.q.w)
                RNND_TRY(gemm16(c, CUBLAS_OP_N, CUBLAS_OP_N, H, a.B, Ks, a.q.w, H,
                                (long long)Ks * H, a.q.v + (size_t)t * 4 * H, ldd, Ks, a.part, H,
                                (long long)a.B * H, a.parts));
            else
                RNND_TRY(gemm_strided(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, H, a.B, Ks, w_hh, H,
                                      (long long)Ks * H, a.d + (size_t)t * 4 * H, ldd, Ks, a.part,
                                      H, (long long)a.B * H, a.parts));
        }
        return stepwise_launch(c, stepwise_route0_kernel, grid, SEQ_BLOCK, a);
    });
}

// Layer l's persistent backward as y names it.
static int persist_backward(struct cuda_ctx *c, const struct rnnd_model *m,
                            const struct seq_plan &p, const struct seq_layer_plan &y,
                            const struct persist_bwd_args &a) {
    const bool bf16 = m->compute == RNND_COMPUTE_BF16;
    switch (y.bwd) {
        case SEQ_BWD_GRU_RECOMPUTE:
            return rnnd__gru_h128_backward(&a, bf16, p.phase_clocks, c->stream);
        case SEQ_BWD_GRU_GATE_TAPE:
#ifdef RNND_HAVE_WG
            return rnnd__gru_h128_gate_tape_backward(&a, bf16, p.phase_clocks, c->stream);
#else
            return RNND_EINVAL; // never planned: the build has no sm_90a kernels
#endif
        default:
            return m->cell == RNND_CELL_LSTM
                       ? rnnd__persist_lstm_backward(&a, bf16, p.HP, p.phase_clocks, c->stream)
                       : rnnd__persist_gru_backward(&a, bf16, p.HP, p.phase_clocks, c->stream);
    }
}

int rnnd__cuda_rnn_backward(struct cuda_ctx *c, const struct rnnd_seq_grads *grads,
                            const float *grad_out, const float *grad_h_n, const float *grad_c_n,
                            const void *tape, const struct rnnd_seq *seq, const float *params,
                            const struct rnnd_model *m) {
    if (c == NULL || rnnd_seq_check(seq, m) != 0 || grads == NULL || grads->params == NULL ||
        grad_out == NULL || tape == NULL || !aligned16(tape) || params == NULL)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (!lstm && (grad_c_n || grads->c0 || grads->cell))
        return RNND_EINVAL;
    if ((grads->hidden && !seq->hidden) || (grads->cell && !seq->cell))
        return RNND_EINVAL;
    if (!dims_fit(m, seq->B, seq->T))
        return RNND_EINVAL;
    int B = seq->B, T = seq->T, H = m->H, L = m->L, G = rnnd_model_gates(m), GH = G * H;
    size_t BT = (size_t)B * T;
    const struct seq_call call = seq_call_of(
        seq, true, true,
        aligned16(grad_out) && aligned16(grad_h_n) && aligned16(grad_c_n) && aligned16(grads->h0) &&
            aligned16(grads->c0) && aligned16(grads->hidden) && aligned16(grads->cell));
    struct seq_plan p;
    rnnd__seq_plan(&c->dev, &c->tune, m, &call, &p);
    struct seq_layout lay;
    rnnd__cuda_seq_layout(c, &p, m, B, T, &lay);
    int max_ldz = 0;
    for (int l = 0; l < L; l++)
        max_ldz = lay.layer[l].ldz > max_ldz ? lay.layer[l].ldz : max_ldz;
    // The layers on the dw16 chunks share one space, in turn: D's four planes and z's parts (x
    // as wide as the layer's I_l needs), but z in the tape as chunk parts where the forward wrote
    // them (plan.zfwd), whatever the gradients' alignment.
    bool dw16 = false;
    long dw_z = 0, dw_nz = 0; // the largest z part in the space, z's columns
    for (int l = 0; l < L; l++)
        if (p.layer[l].dw == SEQ_DW_DW16) {
            const int xk = RNND_DW16_XK(lay.layer[l].Il);
            dw16 = true;
            dw_nz = RNND_DW16_NZ(xk) > dw_nz ? RNND_DW16_NZ(xk) : dw_nz;
            if (!p.zfwd[l])
                dw_z = RNND_DW16_Z(xk) > dw_z ? RNND_DW16_Z(xk) : dw_z;
        }
    const bool dw_exp = dw16 && m->compute == RNND_COMPUTE_FP32; // fp16 chunks, their records
    const int dw_ks = c->dev.num_sms / 4, dw_pitch = seq_dw16_pitch(c, B, T);
    const size_t dw_bytes = (size_t)dw_pitch * (4 * RNND_DW16_D + dw_z);
    size_t d_bytes = BT * 4 * H * sizeof(float);
    if (dw16 && dw_bytes > d_bytes)
        d_bytes = dw_bytes;
    // Layer 0's dw256 chunks (plan.cz) are read by the cluster loop alone: misaligned gradients go
    // through aligned scratch (gs: the gradients the loops write; copied out at the end).
    const bool cz = p.cz, gstage = p.stage;
    const int cz_ks = seq_dw256_ks(c), cz_pitch = cz ? seq_dw256_pitch(c, B, T) : 0;
    const size_t blh = (size_t)B * L * H * sizeof(float);
    struct rnnd_seq_grads gs = *grads;
    float *d, *gyb, *tmp, *dhp, *dcp, *step_part, *dw_part, *cz_part, *sgo, *shn, *scn, *zinv;
    step16 q16, qx; // qx: dL/dx's operands (W_ih's copy; D's rows as q16's)
    __half *z16;
    unsigned *zmax;
    const int ldz16 = ROUND_UP(max_ldz, 8); // 16-byte rows for cuBLAS
    const int step_parts = stepwise_parts(c, B, H, rnnd_model_gates(m));
    int16_t *dw_rec, *cz_rec;
    char *cz_d;
    unsigned *cz_ready;
    struct cuda_carve cv = {0};
    size_t bh = p.persistent ? 0 : (size_t)B * H * sizeof(float);
    for (int pass = 0; pass < 2; pass++) {
        auto staged = [&](const void *src, size_t n) { // a scratch copy of src where staged
            float *q = (float *)cuda_carve(&cv, gstage && src ? n : 0);
            return gstage && src ? q : nullptr;
        };
        sgo = staged(grad_out, BT * H * sizeof(float));
        shn = staged(grad_h_n, blh);
        scn = staged(grad_c_n, blh);
        gs.h0 = staged(grads->h0, blh);
        gs.c0 = staged(grads->c0, blh);
        gs.hidden = staged(grads->hidden, blh * T);
        gs.cell = staged(grads->cell, blh * T);
        d = (float *)cuda_carve(&cv, d_bytes);
        dw_part =
            (float *)cuda_carve(&cv, (size_t)dw_ks * 4 * RNND_DW16_MP * dw_nz * sizeof(float));
        dw_rec = (int16_t *)cuda_carve(&cv, dw_exp ? (size_t)dw_pitch * RNND_DW16_E : 0);
        cz_d = (char *)cuda_carve(&cv, (size_t)cz_pitch * 8 * RNND_DW16_D);
        cz_rec = (int16_t *)cuda_carve(&cv, (size_t)cz_pitch * 4 * 16 * sizeof(int16_t));
        cz_part = (float *)cuda_carve(
            &cv, cz ? (size_t)cz_ks * 4 * H * RNND_DW256_NZ * sizeof(float) : 0);
        cz_ready = (unsigned *)cuda_carve(&cv, cz ? (size_t)T * sizeof(unsigned) : 0);
        gyb = (float *)cuda_carve(&cv, L > 1 ? BT * H * sizeof(float) : 0);
        tmp = (float *)cuda_carve(&cv, (size_t)4 * H * max_ldz * sizeof(float));
        dhp = (float *)cuda_carve(&cv, bh);
        dcp = (float *)cuda_carve(&cv, bh);
        step_part = (float *)cuda_carve(&cv, step_parts * bh);
        q16 = step16_carve(&cv, p, m, BT, 4 * H);
        qx = q16;
        const size_t wi = step16_used(p, m) ? (size_t)GH * (m->I > H ? m->I : H) : 0;
        qx.w = (__half *)cuda_carve(&cv, wi * sizeof(__half));
        qx.wpow = (float *)cuda_carve(&cv, wi ? sizeof(float) : 0);
        qx.wmax = (unsigned *)cuda_carve(&cv, wi ? sizeof(unsigned) : 0);
        const size_t zn = step16_used(p, m) ? (size_t)max_ldz : 0; // dw16_operands'
        z16 = (__half *)cuda_carve(&cv, zn ? BT * ldz16 * sizeof(__half) : 0);
        zmax = (unsigned *)cuda_carve(&cv, zn * sizeof(unsigned));
        zinv = (float *)cuda_carve(&cv, zn * sizeof(float));
        if (pass == 0)
            RNND_TRY(cuda_carve_scratch(c, &cv));
    }
    RNND_TRY(cuda_carve_fits(&cv));
    if (gstage) {
        const float **in[3] = {&grad_out, &grad_h_n, &grad_c_n};
        float *to[3] = {sgo, shn, scn};
        for (int k = 0; k < 3; k++)
            if (*in[k]) {
                RNND_CUDA_TRY(cudaMemcpyAsync(to[k], *in[k], k ? blh : BT * H * sizeof(float),
                                              cudaMemcpyDeviceToDevice, c->stream));
                *in[k] = to[k];
            }
    } else {
        gs = *grads;
    }
    const bool vec = p.vec;

    // Outputs written only where a value was used start at zero.
    if (gs.h0)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.h0, 0, blh, c->stream));
    if (gs.c0)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.c0, 0, blh, c->stream));
    if (gs.hidden)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.hidden, 0, blh * T, c->stream));
    if (gs.cell)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.cell, 0, blh * T, c->stream));

    const float *tp = (const float *)tape;
    const bool shalf = p.tape_half; // as the forward

    for (int l = L - 1; l >= 0; l--) {
        const struct seq_layer_plan &y = p.layer[l];
        const struct seq_layer_layout *ly = &lay.layer[l];
        struct layer_params lp = rnnd__cuda_layer_params(m, l, params);
        const float *z = tp + ly->z_off, *s = tp + ly->s_off;
        const float *gy = l == L - 1 ? grad_out : gyb;

        // The time loop's arguments (the persistent loops and the clusters).
        struct persist_bwd_args a = {};
        a.B = B, a.T = T, a.H = H, a.L = L, a.l = l, a.vec = vec;
        a.stored = seq->hidden != NULL;
        a.w_hh = lp.w_hh, a.is_init = seq->is_init;
        a.z = z, a.ldz = ly->ldz, a.s = s, a.shalf = shalf;
        a.gy = gy, a.ldgy = H;
        a.gh_n = grad_h_n, a.gc_n = grad_c_n, a.d = d;
        a.g_h0 = gs.h0, a.g_c0 = gs.c0;
        a.g_hidden = gs.hidden, a.g_cell = gs.cell;
        float *dx = l > 0 ? gyb : grads->x;     // dL/dx_l: the layer below's gy, or grads->x
        const bool c256 = y.dw == SEQ_DW_DW256; // (the loop runs in clusters)
        if (c256) {
            // The chunks past the loop's (whole stages for the product): zeros, records
            // RNND_DW16_EZERO; D in fp32 only for dL/dx.
            size_t nch = (size_t)CEIL_DIV(B, 16) * T, pad = cz_pitch - nch;
            RNND_CUDA_TRY(cudaMemset2DAsync(cz_d + nch * RNND_DW16_D, cz_pitch * RNND_DW16_D, 0,
                                            pad * RNND_DW16_D, 8, c->stream));
            RNND_CUDA_TRY(
                cudaMemset2DAsync(cz_rec + nch * 16, cz_pitch * 32, 0x80, pad * 32, 4, c->stream));
            RNND_CUDA_TRY(cudaMemsetAsync(cz_ready, 0, (size_t)T * sizeof(unsigned), c->stream));
            a.dw16 = cz_d, a.dw16_pitch = cz_pitch, a.dw16_exp = cz_rec, a.dw16_ready = cz_ready;
            a.d = dx ? d : nullptr;
        }
        if (y.bwd == SEQ_BWD_CLUSTER) {
            RNND_TRY(rnnd__cluster_backward(&a, m->cell == RNND_CELL_LSTM, p.rows, c->stream));
        } else if (y.bwd != SEQ_BWD_STEPWISE) {
            if (y.d_chunks) {
                // The chunks past the loop's (whole stages for the product) hold zeros.
                size_t nch = (size_t)CEIL_DIV(B, 16) * T, pad = dw_pitch - nch;
                const long zb = RNND_DW16_Z(RNND_DW16_XK(ly->Il));
                char *base = (char *)d;
                if (pad > 0) // D's four planes at once
                    RNND_CUDA_TRY(cudaMemset2DAsync(base + nch * RNND_DW16_D,
                                                    dw_pitch * RNND_DW16_D, 0, pad * RNND_DW16_D, 4,
                                                    c->stream));
                if (p.zfwd[l]) { // the forward's, and its padding
                    a.zc = tp + ly->zc_off;
                    if (dw_exp) // x's exponents
                        a.zc_ex = (const int16_t *)((const char *)a.zc + (size_t)dw_pitch * zb);
                } else
                    RNND_CUDA_TRY(cudaMemsetAsync(base + 4 * dw_pitch * RNND_DW16_D + nch * zb, 0,
                                                  pad * zb, c->stream));
                if (dw_exp) // RNND_DW16_EZERO and less in every field
                    RNND_CUDA_TRY(cudaMemsetAsync((char *)dw_rec + nch * RNND_DW16_E, 0x80,
                                                  pad * RNND_DW16_E, c->stream));
                a.dw16 = d, a.dw16_pitch = dw_pitch, a.dw16_exp = dw_exp ? dw_rec : nullptr;
            }
            a.w_ih = lp.w_ih, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.h0 = seq->h0, a.hidden = seq->hidden;
            a.xoff = ly->xoff, a.Il = ly->Il;
            a.dbg = c->d_dbg ? c->d_dbg + 1024 * 8 : nullptr;
            RNND_TRY(persist_backward(c, m, p, y, a));
        } else {
            stepwise_bwd_args sw;
            memset(&sw, 0, sizeof(sw)); // as stepwise_args a (forward)
            sw.B = B, sw.T = T, sw.H = H, sw.L = L, sw.l = l;
            sw.stored = a.stored, sw.is_init = a.is_init;
            sw.z = z, sw.ldz = ly->ldz, sw.s = s, sw.sblk = p.tape_blocked;
            sw.gy = gy, sw.ldgy = H;
            // D in fp32 for the fp32 products (ieee mode), or where the fp16 rows are written
            // from it (step16_put_row).
            const bool dfp32 = !q16.w || stepwise_row_threads(H) < H;
            sw.gh_n = grad_h_n, sw.gc_n = grad_c_n, sw.d = dfp32 ? d : nullptr;
            sw.dhp = dhp, sw.dcp = dcp, sw.part = step_part, sw.parts = step_parts;
            sw.g_h0 = gs.h0, sw.g_c0 = gs.c0;
            sw.g_hidden = gs.hidden, sw.g_cell = gs.cell;
            sw.q = q16;
            RNND_TRY(stepwise_backward(c, m, sw, shalf, lp.w_hh));
        }

        // [dW_ih | dW_hh | db] (ldz rows of 4H) = z^T D over every row and step, added into
        // the gradients, by cuBLAS in the way dw_gemm takes for the shape, after the per-step
        // backward on fp16 operands (dw16_operands). Where the loop wrote dw16 chunks, our
        // product on them, which adds its sums in place (docs/kernels.md).
        struct layer_params gp = rnnd__cuda_layer_params(m, l, grads->params);
        float *gw_ih = (float *)gp.w_ih, *gw_hh = (float *)gp.w_hh;
        float *gb_ih = (float *)gp.b_ih, *gb_hh = (float *)gp.b_hh;
        if (y.dw != SEQ_DW_CUBLAS) {
#ifdef RNND_HAVE_WG
            if (c256) {
                const char *zch = (const char *)z;
                struct dw16_args dw = {cz_d,    zch,    cz_pitch, cz_ks, H,     ly->Il, !lstm,
                                       cz_part, cz_rec, gw_ih,    gw_hh, gb_ih, gb_hh};
                // Right after the loop, beside it (seq_chunks.h, dw256_sync).
                const struct dw256_sync sy = {cz_ready, CEIL_DIV(B, 16), T,
                                              (unsigned)(CEIL_DIV(B, p.rows) * 4)};
                RNND_TRY(rnnd__dw256_product(&dw, zch + (size_t)cz_pitch * RNND_DW256_Z, &sy,
                                             c->stream));
            } else {
                const char *dloop = (const char *)d + 4 * (size_t)dw_pitch * RNND_DW16_D;
                const void *dz = p.zfwd[l] ? a.zc : (const void *)dloop; // z's parts
                struct dw16_args dw = {d,       dz,         dw_pitch, dw_ks, H,     ly->Il, !lstm,
                                       dw_part, a.dw16_exp, gw_ih,    gw_hh, gb_ih, gb_hh};
                RNND_TRY(rnnd__dw16_product(&dw, c->stream));
            }
#else
            return RNND_EINVAL; // never planned: the build has no sm_90a kernels
#endif
        } else {
            bool ldz_m;
            const bool f16 = y.bwd == SEQ_BWD_STEPWISE && q16.w;
            const dw_f16 h16 = {q16.v, z16, ldz16};
            if (f16)
                RNND_TRY(dw16_operands(c, z, ly->ldz, BT, q16.pow, zmax, z16, ldz16, zinv));
            RNND_TRY(dw_gemm(c, m->compute, 4 * H, ly->ldz, (int)BT, d, z, f16 ? &h16 : nullptr,
                             tmp, &ldz_m));
            size_t n = (size_t)GH * (ly->Il + H + 1);
            int grid = (int)(CEIL_DIV(n, (size_t)SEQ_BLOCK) < 4096 ? CEIL_DIV(n, (size_t)SEQ_BLOCK)
                                                                   : 4096);
            const size_t sq = ldz_m ? ly->ldz : 1, sk = ldz_m ? 1 : 4 * (size_t)H;
            dw_scatter_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(gw_ih, gw_hh, gb_ih, gb_hh, tmp,
                                                                 f16 ? zinv : nullptr, sq, sk, G, H,
                                                                 ly->Il, ly->xoff, !lstm);
            CUDA_LAUNCH_CHECK();
        }

        // dx_l (B*T, I_l) = D_x W_ih: the layer below's output gradient, or grads->x. The GRU's
        // input-side planes are r, z (D's first two) and n (D's fourth).
        if (dx && y.dx16) { // from the loop's dw16 chunks
#ifdef RNND_HAVE_WG
            struct dx16_args dxa = {d,
                                    dw_pitch,
                                    CEIL_DIV(B, 16) * T,
                                    lstm ? 4 : 3,
                                    c->dev.num_sms,
                                    H,
                                    ly->Il,
                                    B,
                                    T,
                                    lp.w_ih,
                                    dx,
                                    a.dw16_exp};
            RNND_TRY(rnnd__dx16_product(&dxa, c->stream));
#else
            return RNND_EINVAL; // never planned: the build has no sm_90a kernels
#endif
        } else if (dx && y.bwd == SEQ_BWD_STEPWISE && q16.w) { // from D's fp16 rows
            const int Il = ly->Il, gi = lstm ? GH : 2 * H;     // the planes the GRU's n leaves out
            const cublasOperation_t N = CUBLAS_OP_N;
            RNND_TRY(step16_weights(c, lp.w_ih, (size_t)GH * Il, qx));
            RNND_TRY(gemm16(c, N, N, Il, (int)BT, gi, qx.w, Il, 0, q16.v, 4 * H, 0, dx, Il, 0, 1));
            if (!lstm)
                RNND_TRY(gemm16(c, N, N, Il, (int)BT, H, qx.w + (size_t)2 * H * Il, Il, 0,
                                q16.v + 3 * H, 4 * H, 0, dx, Il, 0, 1, 1.0f));
            const size_t n = BT * Il;
            const int grid =
                (int)(CEIL_DIV(n, (size_t)SEQ_BLOCK) < 4096 ? CEIL_DIV(n, (size_t)SEQ_BLOCK)
                                                            : 4096);
            dx16_scale_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(dx, Il, BT, q16.pow, qx.wpow);
            CUDA_LAUNCH_CHECK();
        } else if (dx && lstm) {
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, ly->Il, (int)BT, GH, lp.w_ih,
                          ly->Il, d, 4 * H, 0.0f, dx, ly->Il));
        } else if (dx) {
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, ly->Il, (int)BT, 2 * H, lp.w_ih,
                          ly->Il, d, 4 * H, 0.0f, dx, ly->Il));
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, ly->Il, (int)BT, H,
                          lp.w_ih + (size_t)2 * H * ly->Il, ly->Il, d + 3 * H, 4 * H, 1.0f, dx,
                          ly->Il));
        }
    }
    if (gstage) {
        float *out[4] = {grads->h0, grads->c0, grads->hidden, grads->cell};
        const float *from[4] = {gs.h0, gs.c0, gs.hidden, gs.cell};
        for (int k = 0; k < 4; k++)
            if (out[k])
                RNND_CUDA_TRY(cudaMemcpyAsync(out[k], from[k], k < 2 ? blh : blh * T,
                                              cudaMemcpyDeviceToDevice, c->stream));
    }
    return 0;
}
