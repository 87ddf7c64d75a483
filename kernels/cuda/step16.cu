/*
 * step16.cu: the single step of many rows at a large H (step.cu's dispatch takes it where
 * rnnd__cuda_step16_takes says), on the per-step sequence path's numerics (seq.cu, "fp16 keeps
 * TF32's 10 mantissa bits"): fp16 operands, each row and each weight row times a power of two of
 * its own, products accumulated in fp32. Per layer l:
 *   1. step16_rows_kernel: row b's [x_l | h_l] (h_l zero where the row resets) into fp16 times
 *      its power p_b, so that its largest |value| lies in [2^14, 2^15); h_before too;
 *   2. one cuBLAS GEMM: gates (B, 4H) = 2^-s rows16 (B, Kp) . W16_l (4H, Kp)^T, accumulated in
 *      fp32 and stored in fp16 (half the bytes the cell reads; 2^-s keeps the largest sum the
 *      powers allow, Kp 2^30, under 2^15);
 *   3. step16_cell_kernel: gate n of row b is gates[b, n] 2^s / (p_b q_n), plus the biases, into
 *      the cell (seq_cells.cuh, as step_kernel calls it); the new h and c to their table rows.
 * W16_l, the derived copy (struct rnnd_step.derived, made by rnnd__cuda_step16_derive whenever
 * the weights change): gate row n of [W_ih | W_hh] times its own power q_n, Kp = I_l + H rounded
 * up to 8 halves (16-byte rows for the tensor cores), zeros past K. The GRU's 4H rows are r, z,
 * n_x = [W_in | 0] and n_h = [0 | W_hn], since r multiplies W_hn h + b_hn alone; the LSTM's are
 * i, f, g, o.
 * Why (docs/kernels.md, journal step-02): the tile kernels stream TF32 weights through small
 * tiles; cuBLAS's fp16 GEMM at B = 1024 multiplies LSTM I = 512 H = 1024's [x | h] in 22.4 us
 * against 39.6 on TF32, where the tile kernel's whole step took 67.5.
 */
#include "step.cuh"

#include "seq_cells.cuh"
#include "step_impl.cuh"

#include <cuda_fp16.h>

#define STEP16_TOP     15  // the powers put each row's largest |value| in [2^14, 2^15)
#define STEP16_THREADS 256 // a block: a weight row (derive), a row (cell), 8 rows (rows, V = 4)

namespace {

// Layer l's part of the derived copy: the weight rows (4H, Kp) fp16, then 1 / q_n (4H floats).
struct step16_layer {
    int K, Kp;      // I_l + H, and rounded up to 8
    size_t w, qinv; // byte offsets into derived
};

step16_layer step16_layer_of(const struct rnnd_model *m, int l, size_t *end) {
    step16_layer y;
    y.K = rnnd_model_layer_input(m, l) + m->H;
    y.Kp = ROUND_UP(y.K, 8);
    const size_t N = 4 * (size_t)m->H;
    y.w = *end;
    y.qinv = y.w + ROUND_UP(N * y.Kp * sizeof(__half), (size_t)256);
    *end = y.qinv + ROUND_UP(N * sizeof(float), (size_t)256);
    return y;
}

// Where derived row n of layer l comes from: its x part (or NULL: zeros) and its h part.
struct w_row {
    const float *x, *h;
};
__device__ w_row w_row_of(const struct layer_params &lp, int n, int H, int Il, bool gru) {
    if (!gru || n < 2 * H)
        return {lp.w_ih + (size_t)n * Il, lp.w_hh + (size_t)n * H};
    const int u = n % H; // n_x, then n_h
    return n < 3 * H ? w_row{lp.w_ih + (size_t)(2 * H + u) * Il, nullptr}
                     : w_row{nullptr, lp.w_hh + (size_t)(2 * H + u) * H};
}

// A block a weight row n: its largest |w|, then the row in fp16 times q_n, and 1 / q_n.
__global__ void __launch_bounds__(STEP16_THREADS)
    step16_derive_kernel(struct layer_params lp, int H, int Il, int Kp, bool gru, __half *w16,
                         float *qinv) {
    __shared__ float red[32];
    const int n = blockIdx.x, K = Il + H;
    const w_row r = w_row_of(lp, n, H, Il, gru);
    auto at = [&](int k) {
        const float *p = k < Il ? r.x : r.h;
        return p && k < K ? p[k < Il ? k : k - Il] : 0.0f;
    };
    float m = 0.0f;
    for (int k = threadIdx.x; k < K; k += blockDim.x)
        m = fmaxf(m, fabsf(at(k)));
    const float q = persist_pow2_for(persist_block_max(m, red), STEP16_TOP);
    for (int k = threadIdx.x; k < Kp; k += blockDim.x)
        w16[(size_t)n * Kp + k] = __float2half_rn(at(k) * q);
    if (threadIdx.x == 0)
        qinv[n] = pow2_inv(q);
}

// V consecutive floats (V = 4: one 16-byte access) and halves.
template <int V>
__device__ __forceinline__ void ld(const float *p, float (&v)[V]) {
    if constexpr (V == 4) {
        const float4 t = *reinterpret_cast<const float4 *>(p);
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
        v[0] = *p;
    }
}
template <int V>
__device__ __forceinline__ void st(float *p, const float (&v)[V]) {
    if constexpr (V == 4)
        *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    else
        *p = v[0];
}
template <int V>
__device__ __forceinline__ void ld_half(const __half *p, float (&v)[V]) {
    if constexpr (V == 4) {
        const uint2 t = *reinterpret_cast<const uint2 *>(p);
        const float2 lo = __half22float2(*reinterpret_cast<const __half2 *>(&t.x));
        const float2 hi = __half22float2(*reinterpret_cast<const __half2 *>(&t.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    } else {
        v[0] = __half2float(*p);
    }
}
template <int V>
__device__ __forceinline__ void st_half(__half *p, const float (&v)[V]) {
    if constexpr (V == 4) {
        __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
        *reinterpret_cast<uint2 *>(p) =
            make_uint2(*reinterpret_cast<uint32_t *>(&lo), *reinterpret_cast<uint32_t *>(&hi));
    } else {
        *p = __float2half_rn(v[0]);
    }
}

// Row b's [x_l | h_l] into fp16 times its power, 1 / the power into pinv[b], h_l into h_before.
// V = 4: I_l and H multiples of 4 on 16-byte rows, a warp a row, each lane holding its groups of
// 4 (at most ROWS_R: K <= 128 ROWS_R) in registers between the maximum (shuffles, no block
// barrier) and the writes; V = 1: any widths, a block a row, the row read twice.
constexpr int ROWS_R = 16;
template <int V>
__global__ void __launch_bounds__(STEP16_THREADS)
    step16_rows_kernel(const step_kargs a, int Kp, __half *rows16, float *pinv) {
    const int Il = a.l == 0 ? a.I : a.H, K = Il + a.H;
    const int b = V == 4 ? blockIdx.x * (STEP16_THREADS / 32) + threadIdx.x / 32 : blockIdx.x;
    const int lane = V == 4 ? threadIdx.x % 32 : threadIdx.x, lanes = V == 4 ? 32 : blockDim.x;
    if (b >= a.B)
        return;
    const step_row r = step_row_at(a, b);
    __half *o = rows16 + (size_t)b * Kp;
    float m = 0.0f, p;
    if constexpr (V == 4) {
        float v[ROWS_R][4];
#pragma unroll
        for (int i = 0; i < ROWS_R; i++) {
            const int k = 4 * (lane + 32 * i);
            if (k < Il)
                ld(r.x + k, v[i]);
            else if (k < K && r.h)
                ld(r.h + (k - Il), v[i]);
            else
                v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; e++)
                m = fmaxf(m, fabsf(v[i][e]));
        }
#pragma unroll
        for (int d = 16; d > 0; d >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
        p = persist_pow2_for(m, STEP16_TOP);
#pragma unroll
        for (int i = 0; i < ROWS_R; i++) {
            const int k = 4 * (lane + 32 * i);
            float w[4] = {v[i][0] * p, v[i][1] * p, v[i][2] * p, v[i][3] * p};
            if (k < Kp)
                st_half(o + k, w);
        }
    } else {
        __shared__ float red[32];
        auto at = [&](int k) { return k < Il ? r.x[k] : r.h && k < K ? r.h[k - Il] : 0.0f; };
        for (int k = lane; k < K; k += lanes)
            m = fmaxf(m, fabsf(at(k)));
        p = persist_pow2_for(persist_block_max(m, red), STEP16_TOP);
        for (int k = lane; k < Kp; k += lanes)
            o[k] = __float2half_rn(at(k) * p);
    }
    if (lane == 0)
        pinv[b] = pow2_inv(p);
    if (a.h_before)
        for (int u = V * lane; u < a.H; u += V * lanes) {
            float h[V] = {};
            if (r.h)
                ld(r.h + u, h);
            st(a.h_before + ((size_t)b * a.L + a.l) * a.H + u, h);
        }
}

// Row b's cell, V units at a time (V = 4: 16-byte accesses everywhere): gate n = gates[b, n]
// 2^s pinv[b] qinv[n] plus the biases, as step_kernel adds them (x part and b_ih, then b_hh; the
// GRU's n_h plane to hq[2]).
template <class Cell, int V>
__global__ void __launch_bounds__(STEP16_THREADS)
    step16_cell_kernel(const step_kargs a, const __half *gates, float two_s, const float *pinv,
                       const float *qinv) {
    constexpr int G = Cell::G;
    constexpr bool GRU = G == 3;
    const int b = blockIdx.x, H = a.H, L = a.L, l = a.l;
    const step_row r = step_row_at(a, b);
    const float pb = pinv[b] * two_s; // powers of two: exact
    const __half *g = gates + (size_t)b * 4 * H;
    const size_t LH = (size_t)L * H, old = r.slot * LH + (size_t)l * H;
    const size_t at = r.slot_new * LH + (size_t)l * H, before = ((size_t)b * L + l) * H;
    for (int u = V * threadIdx.x; u < H; u += V * blockDim.x) {
        float gq[4][V], qi[4][V], bx[G][V], bh[G][V], hp[V] = {}, cp[V] = {};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            ld_half(g + q * H + u, gq[q]);
            ld(qinv + q * H + u, qi[q]);
        }
#pragma unroll
        for (int q = 0; q < G; q++) {
            ld(a.b_ih + q * H + u, bx[q]);
            ld(a.b_hh + q * H + u, bh[q]);
        }
        if (r.h) {
            ld(r.h + u, hp);
            if (!GRU)
                ld(a.state_c + old + u, cp);
        }
        float hn[V], cn[V];
#pragma unroll
        for (int e = 0; e < V; e++) {
            float xq[G], hq[G], s[Cell::SW];
#pragma unroll
            for (int q = 0; q < G; q++) {
                xq[q] = gq[q][e] * pb * qi[q][e] + bx[q][e];
                hq[q] = bh[q][e];
            }
            if (GRU)
                hq[2] += gq[3][e] * pb * qi[3][e];
            Cell::template forward<true>(xq, hq, hp[e], cp[e], hn[e], cn[e], s);
        }
        if (a.out)
            st(a.out + (size_t)b * H + u, hn);
        if (a.c_before)
            st(a.c_before + before + u, cp);
        st(a.state_h + at + u, hn);
        if (!GRU)
            st(a.state_c + at + u, cn);
    }
}

} // namespace

// Models whose steps may take this path: H >= 512 in the tensor-core modes (the tile kernels
// win below, journal step-02); 0 derived bytes for the others.
static bool step16_model(const struct rnnd_model *m) {
    return m->compute != RNND_COMPUTE_IEEE && m->H >= RNND_STEP16_MIN_H;
}

size_t rnnd__cuda_step16_bytes(const struct rnnd_model *m) {
    if (!step16_model(m))
        return 0;
    size_t end = 0;
    for (int l = 0; l < m->L; l++)
        step16_layer_of(m, l, &end);
    return end;
}

int rnnd__cuda_step16_derive(struct cuda_ctx *c, void *derived, const float *params,
                             const struct rnnd_model *m) {
    if (rnnd_model_check(m) != 0 || derived == NULL || params == NULL)
        return RNND_EINVAL;
    size_t end = 0;
    for (int l = 0; l < m->L && step16_model(m); l++) {
        const step16_layer y = step16_layer_of(m, l, &end);
        step16_derive_kernel<<<4 * m->H, STEP16_THREADS, 0, c->stream>>>(
            rnnd__cuda_layer_params(m, l, params), m->H, rnnd_model_layer_input(m, l), y.Kp,
            m->cell == RNND_CELL_GRU, (__half *)((char *)derived + y.w),
            (float *)((char *)derived + y.qinv));
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

// Where the GEMM beats the tile kernels (H200, journal step-02, fp32 mode at 1% resets): from
// 2^30 multiply-adds a step (GRU I = H = 512 at B = 1024, 1.6G: 15.9 against 18.1 us; at 512
// rows, 0.8G: 10.8 against 9.3), and at H >= 1024 from 128 rows (LSTM I = 512: 11.3 against 14.1).
static bool step16_wins(const struct rnnd_model *m, int B) {
    double macs = 0.0;
    for (int l = 0; l < m->L; l++)
        macs += (double)rnnd_model_gates(m) * m->H * (rnnd_model_layer_input(m, l) + m->H);
    return B * macs >= 0x1p30 || (m->H >= 1024 && B >= 128);
}

// The scratch a step of B rows takes: the rows in fp16 (the widest layer's), their powers and
// the gates.
static size_t step16_scratch(const struct rnnd_model *m, int B, __half **rows16, float **pinv,
                             __half **gates, char *base) {
    struct cuda_carve cv = {base, 0, 0};
    const int Kp = ROUND_UP((m->I > m->H ? m->I : m->H) + m->H, 8);
    *rows16 = (__half *)cuda_carve(&cv, (size_t)B * Kp * sizeof(__half));
    *pinv = (float *)cuda_carve(&cv, (size_t)B * sizeof(float));
    *gates = (__half *)cuda_carve(&cv, (size_t)B * 4 * m->H * sizeof(__half));
    return cv.used;
}

bool rnnd__cuda_step16_takes(const struct cuda_ctx *c, const struct rnnd_step *st,
                             const struct rnnd_model *m) {
    if (st->derived == NULL || !step16_model(m) || c->tune.step_no_gemm16)
        return false;
    if (!step16_wins(m, st->B) && !c->tune.step_gemm16)
        return false;
    // The scratch cannot grow inside a recording (rnnd__cuda_reserve synchronises).
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c->stream, &cs) != cudaSuccess)
        return false;
    __half *r, *g;
    float *p;
    return cs == cudaStreamCaptureStatusNone ||
           step16_scratch(m, st->B, &r, &p, &g, nullptr) <= c->scratch_bytes;
}

int rnnd__cuda_step16(struct cuda_ctx *c, const struct rnnd_step *st, const step_kargs *args,
                      const struct rnnd_model *m) {
    __half *rows16, *gates;
    float *pinv;
    RNND_TRY(rnnd__cuda_reserve(c, step16_scratch(m, st->B, &rows16, &pinv, &gates, nullptr)));
    step16_scratch(m, st->B, &rows16, &pinv, &gates, (char *)c->d_scratch);
    const float zero = 0.0f;
    const int N = 4 * m->H;
    size_t end = 0;
    for (int l = 0; l < m->L; l++) {
        const step16_layer y = step16_layer_of(m, l, &end);
        const __half *w16 = (const __half *)((const char *)st->derived + y.w);
        const float *qinv = (const float *)((const char *)st->derived + y.qinv);
        int s = 15; // 2^-s: Kp 2^30 / 2^s <= 2^15
        while ((1 << (s - 15)) < y.Kp)
            s++;
        const float down = ldexpf(1.0f, -s), up = ldexpf(1.0f, s);
        const step_kargs &a = args[l];
        const bool rows4 = a.vec_x && a.vec_h && aligned16(a.h_before) && y.Kp <= 128 * ROWS_R;
        if (rows4)
            step16_rows_kernel<4>
                <<<CEIL_DIV(st->B, STEP16_THREADS / 32), STEP16_THREADS, 0, c->stream>>>(
                    a, y.Kp, rows16, pinv);
        else
            step16_rows_kernel<1><<<st->B, STEP16_THREADS, 0, c->stream>>>(a, y.Kp, rows16, pinv);
        CUDA_LAUNCH_CHECK();
        // Column-major: gates^T (N x B) = W16 (row-major N x Kp, read transposed) rows16^T.
        RNND_CUBLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, st->B, y.Kp, &down, w16,
                                     CUDA_R_16F, y.Kp, rows16, CUDA_R_16F, y.Kp, &zero, gates,
                                     CUDA_R_16F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        const bool cell4 = m->H % 4 == 0 && a.vec_h && aligned16(a.out) && aligned16(a.c_before) &&
                           aligned16(a.b_ih) && aligned16(a.b_hh);
        const dim3 grid(st->B), block(STEP16_THREADS);
        if (m->cell == RNND_CELL_LSTM && cell4)
            step16_cell_kernel<cell_lstm, 4>
                <<<grid, block, 0, c->stream>>>(a, gates, up, pinv, qinv);
        else if (m->cell == RNND_CELL_LSTM)
            step16_cell_kernel<cell_lstm, 1>
                <<<grid, block, 0, c->stream>>>(a, gates, up, pinv, qinv);
        else if (cell4)
            step16_cell_kernel<cell_gru, 4>
                <<<grid, block, 0, c->stream>>>(a, gates, up, pinv, qinv);
        else
            step16_cell_kernel<cell_gru, 1>
                <<<grid, block, 0, c->stream>>>(a, gates, up, pinv, qinv);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}
