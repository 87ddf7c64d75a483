/*
 * seq_persist.cuh: the persistent, reset-aware time loops of the sequence forward and backward
 * (one launch per layer), templated over the cell (GRU r,z,n / LSTM i,f,g,o), the matmul mode
 * (TF32 m16n8k8 or BF16 m16n8k16 tensor-core MMA, fp32 accumulation) and HP, the hidden width
 * rounded up to a multiple of 32 (units past H are zero weights and zero state, so they stay 0).
 *
 * Parallel mapping (both directions). A block owns 16 batch rows for all T steps; rows are
 * independent, so blocks never talk to each other. It has HP/16 warps; warp w owns hidden units
 * [16w, 16w+16) for every gate, and lane (g = lane/4, tg = lane%4) owns rows {g, g+8} and the four
 * consecutive units u0 = 16w + 4tg .. u0+3: eight (row, unit) elements whose gates, state and
 * gradients live in its registers for the whole loop. The column order of each warp's n-tiles is
 * permuted so that an MMA accumulator fragment lands exactly on those elements (the C fragment
 * of n-tile `half` holds columns 2tg, 2tg+1, which we map to units u0 + 2*half + {0,1}), so the
 * cell math needs no shared-memory round trip and global accesses are 16-byte vectors.
 *
 * Forward, per step (one __syncthreads, the A tiles double-buffered in shared memory):
 *   acc (16 x G*16 per warp) = h (16 x HP) . W_hh[warp's gate rows]^T and, apart,
 *   accx = x (16 x IP) . W_ih[warp's gate rows]^T (MMA, weights on chip): the input projection
 *   is fused (the loop reads x, not x W_ih^T) when I_l <= HP/2 and the weights fit; otherwise
 *   x W_ih^T comes precomputed from one cuBLAS GEMM. In TF32 mode the h part runs as fp16
 *   m16n8k16 MMAs on h scaled into fp16 (as exact as TF32, mode_f16), the x part as TF32.
 *   The GRU's fused TF32 loop at HP = 128 (KP, v12, v13) has twice the warps: per 16-unit
 *   group one runs the h part and one the x part (x rows scaled into fp16 per row, m16n8k16),
 *   the x part a step ahead (x staged two steps ahead through fp32 stages and one fp16 tile
 *   behind the x-warps' own barrier); they hand each other the partial sums of the other's row
 *   through shared memory (a 64-thread barrier per pair), and each runs the cell for one of the
 *   lane's two rows (see seq_forward_kernel).
 *   Then the cell from acc, accx and the biases; h' (c'); stores of y and the tape; the state
 *   of the next step, after the reset rule (a per-row select), and its x into the other tiles.
 * Backward, per step in reverse (two __syncthreads and a barrier per warp pair):
 *   gate gradients from the tape (the GRU's gates, the LSTM's pre-activations) and dL/dh' -> D
 *   (global, for the weight and input GEMMs) and the dh-gate tile (16 x G*HP) in shared memory;
 *   dh = tile . W_hh + the direct term, K split over warp pairs (persist_geom); routing of
 *   the gradient at resets (docs/design.md "The math") and at t = 0.
 * Weights are loaded once per launch into shared memory, pre-arranged as per-lane MMA B
 * fragments. In TF32 mode they are stored as fp16 scaled by a power of two (the largest |w| of
 * the launch lands in [2^14, 2^15)) and widened to fp32 when a fragment is read: fp16 keeps the
 * 10 mantissa bits TF32 keeps, so the products are TF32 products (for every weight within 2^28
 * of the largest; smaller ones are rounded to that absolute grid), and the weights take half the
 * space and half the shared-memory bandwidth. The accumulators are scaled back exactly. A
 * fragments come from the shared tile with ldmatrix; on sm_90 in TF32 mode the backward's D
 * planes are written from the dh-gate tile by the bulk-copy engine.
 *
 * The GRU at HP = 128 has a second backward (seq_backward_rc_kernel, v10) with one 16-bit copy
 * of W_hh that serves both directions (ldmatrix and ldmatrix.trans): it recomputes each step's
 * gates from hprev and x (the z rows), or (v29) reads them from the fp16 gate tape the wgmma
 * forward writes with z's chunk parts; see its comment.
 *
 * Versions v1..v13: docs/journal has each one's prediction and measured result.
 */
#ifndef RNND_CUDA_SEQ_PERSIST_CUH
#define RNND_CUDA_SEQ_PERSIST_CUH

#include "common.cuh"
#include "seq_persist.h"
#include "wg.cuh"

#include <cuda_fp16.h>

#include <type_traits>

// Shared memory a block may use on sm_90 (227 KB); sm_80 gets less and falls back at run time.
#define RNND_PERSIST_SMEM_BUDGET 232448

// ---------------------------------------------------------------------------------------------
// Matmul modes: fragment building, A-tile element type, the MMA itself.

// The A fragment of one k-step with one ldmatrix.x4: four 8x8 matrices of 16-bit pairs, i.e.
// rows 0-7 and 8-15 of the 16-row tile, at columns k0 and k0 + half (half = 4 floats for tf32,
// 8 bf16): exactly a0..a3 of m16n8k8.tf32 and m16n8k16.bf16. Lane L gives the address of row
// L%8 of matrix L/8. Rows are 16-byte aligned (the tile's row pitch is a multiple of 16 bytes).
template <class T>
static __device__ __forceinline__ void ldmatrix_x4(uint32_t a[4], const T *tile, int ld, int k0,
                                                   int half, int lane) {
    int m = lane >> 3, row = (lane & 7) + 8 * (m & 1), col = k0 + (m >> 1) * half;
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(tile + row * ld + col);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}

// 16 bytes global -> shared, asynchronous; ok false writes zeros instead (src is not read).
static __device__ __forceinline__ void cp_async16(uint32_t sa, const float *g, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(g),
                 "r"(ok ? 16 : 0)
                 : "memory");
}
static __device__ __forceinline__ void cp_async16(float *s, const float *g, bool ok) {
    cp_async16((uint32_t)__cvta_generic_to_shared(s), g, ok);
}

// The line holding p into L2, asynchronously (nothing waits for it).
static __device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.L2 [%0];" ::"l"(p)); // generic address
}

static __device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// The B operand (weights) of every mode is stored in shared memory as WPF 32-bit words per
// fragment (lane, n-tile, k-step): wpack builds them from an accessor B(k, n), wunpack turns them
// into the MMA's b0, b1. A mode's hmode is the mode of the forward's h part.

// The h part of the forward in TF32 mode: h scaled by a power of two (the block's largest |h|
// lands in [2^13, 2^14)) and rounded to fp16 keeps the 10 mantissa bits TF32 keeps, for every
// |h| within 2^27 of that largest value, so m16n8k16 fp16 MMAs on the fp16 weights give TF32's
// products with half the MMAs and no conversions.
struct mode_f16 {
    static constexpr int KSTEP = 16;
    static constexpr int APAD = 8;
    static constexpr int WPF = 2;
    static constexpr bool SCALED = true;
    using elem = __half;
    static __device__ __forceinline__ void put(elem *p, float v) {
        *p = __float2half_rn(v);
    }
    static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ float2 unpack2(uint32_t v) {
        return __half22float2(*reinterpret_cast<const __half2 *>(&v));
    }
    static __device__ __forceinline__ void put4(elem *p, const float v[4]) {
        __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
        *reinterpret_cast<uint2 *>(p) =
            make_uint2(*reinterpret_cast<uint32_t *>(&lo), *reinterpret_cast<uint32_t *>(&hi));
    }
    // b0 = {B[16ks+2tg][g], B[16ks+2tg+1][g]}, b1 = the same 8 rows further, times scale.
    template <class F>
    static __device__ __forceinline__ void wpack(uint32_t *o, F B, int ks, int g, int tg,
                                                 float scale) {
        int k = ks * 16 + 2 * tg;
        __half2 lo = __floats2half2_rn(B(k, g) * scale, B(k + 1, g) * scale);
        __half2 hi = __floats2half2_rn(B(k + 8, g) * scale, B(k + 9, g) * scale);
        o[0] = *reinterpret_cast<uint32_t *>(&lo);
        o[1] = *reinterpret_cast<uint32_t *>(&hi);
    }
    static __device__ __forceinline__ uint2 wunpack(const uint32_t *o) {
        return make_uint2(o[0], o[1]);
    }
    static __device__ __forceinline__ void afrag(uint32_t a[4], const elem *tile, int ld, int ks,
                                                 int lane) {
        ldmatrix_x4(a, tile, ld, ks * 16, 8, lane);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint2 b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
    }
};

struct mode_tf32 {
    static constexpr int KSTEP = 8;
    static constexpr int APAD = 4; // floats of padding per A-tile row: conflict-free fragments
    static constexpr int WPF = 1;  // {B[k][n], B[k+4][n]} as one fp16 pair
    static constexpr bool SCALED = true;
    using elem = float; // tf32 values kept in fp32 bit patterns
    using hmode = mode_f16; // the forward's h part (h is bounded: scaled fp16)
    static __device__ __forceinline__ void put(elem *p, float v) {
        *p = __uint_as_float(f32_to_tf32(v));
    }
    static __device__ __forceinline__ void put4(elem *p, const float v[4]) {
        *reinterpret_cast<float4 *>(p) =
            make_float4(__uint_as_float(f32_to_tf32(v[0])), __uint_as_float(f32_to_tf32(v[1])),
                        __uint_as_float(f32_to_tf32(v[2])), __uint_as_float(f32_to_tf32(v[3])));
    }
    // b0 = B[8ks+tg][g], b1 = B[8ks+tg+4][g], times scale (a power of two), rounded to fp16.
    template <class F>
    static __device__ __forceinline__ void wpack(uint32_t *o, F B, int ks, int g, int tg,
                                                 float scale) {
        int k = ks * 8 + tg;
        __half2 h = __floats2half2_rn(B(k, g) * scale, B(k + 4, g) * scale);
        o[0] = *reinterpret_cast<uint32_t *>(&h);
    }
    // fp16 -> fp32 is exact and has 10 mantissa bits: a valid tf32 operand as it is.
    static __device__ __forceinline__ uint2 wunpack(const uint32_t *o) {
        uint32_t w = o[0];
        float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w));
        return make_uint2(__float_as_uint(f.x), __float_as_uint(f.y));
    }
    // A fragment: a0 = A[g][8ks+tg], a1 = A[g+8][..], a2 = A[g][8ks+tg+4], a3 = A[g+8][..+4].
    static __device__ __forceinline__ void afrag(uint32_t a[4], const elem *tile, int ld, int ks,
                                                 int lane) {
        ldmatrix_x4(a, tile, ld, ks * 8, 4, lane);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint2 b) {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
    }
};

struct mode_bf16 {
    static constexpr int KSTEP = 16;
    static constexpr int APAD = 8;
    static constexpr int WPF = 2;
    static constexpr bool SCALED = false;
    using elem = __nv_bfloat16;
    using hmode = mode_bf16;
    static __device__ __forceinline__ void put(elem *p, float v) {
        *p = __float2bfloat16_rn(v);
    }
    static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
        return pack_bf16(lo, hi);
    }
    static __device__ __forceinline__ float2 unpack2(uint32_t v) {
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&v));
    }
    static __device__ __forceinline__ void put4(elem *p, const float v[4]) {
        *reinterpret_cast<uint2 *>(p) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
    }
    // b0 = {B[16ks+2tg][g], B[16ks+2tg+1][g]}, b1 = the same 8 rows further (low half first).
    template <class F>
    static __device__ __forceinline__ void wpack(uint32_t *o, F B, int ks, int g, int tg,
                                                 float scale) {
        (void)scale;
        int k = ks * 16 + 2 * tg;
        o[0] = pack_bf16(B(k, g), B(k + 1, g));
        o[1] = pack_bf16(B(k + 8, g), B(k + 9, g));
    }
    static __device__ __forceinline__ uint2 wunpack(const uint32_t *o) {
        return make_uint2(o[0], o[1]);
    }
    // a0 = A[g][16ks+2tg, +1], a1 = rows + 8, a2 = columns + 8, a3 = both.
    static __device__ __forceinline__ void afrag(uint32_t a[4], const elem *tile, int ld, int ks,
                                                 int lane) {
        ldmatrix_x4(a, tile, ld, ks * 16, 8, lane);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint2 b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
    }
};

// ---------------------------------------------------------------------------------------------
// Cells: pointwise math for one (row, unit) element, the same formulas and association as the
// CPU reference (kernels/cpu/gru.c, lstm.c). s[] is the element's tape record (SW planes).

struct cell_gru {
    static constexpr int G = 3;
    static constexpr int SW = 4; // a_r, a_z, a_n (pre-activations), hn = W_hn h + b_hn
    static constexpr int SH = 4; // planes held in fp16 (tape_rec)
    // xq[q] = x W_ih^T + b_ih, hq[q] = h W_hh^T + b_hh for gate q. The record holds
    // pre-activations for cell_lstm's reason (a rounded z near 1 loses 1 - z, and dL/dh's product
    // over steps with it); ACT: s holds the gates r, z, n (as gate computes them) and hn instead,
    // for a backward that uses them at once (the recomputing loop). ACC: as gate says.
    template <bool FAST, bool ACT = false, bool ACC = FAST>
    static __device__ __forceinline__ void forward(const float xq[3], const float hq[3], float h,
                                                   float c, float &h_new, float &c_new,
                                                   float s[SW]) {
        (void)c;
        const float ar = xq[0] + hq[0], az = xq[1] + hq[1];
        const float r = act_sigmoid<FAST>(ar), z = act_sigmoid<FAST>(az);
        const float an = xq[2] + r * hq[2], n = act_tanh<FAST>(an);
        h_new = (1.0f - z) * n + z * h;
        c_new = 0.0f;
        if constexpr (ACT && !ACC)
            s[0] = r, s[1] = z, s[2] = n;
        else
            s[0] = ACT ? gate<FAST>(0, ar) : ar, s[1] = ACT ? gate<FAST>(1, az) : az,
            s[2] = ACT ? gate<FAST>(2, an) : an;
        s[3] = hq[2];
    }
    // Record plane p's value as the backward uses it: r, z, n from a_r, a_z, a_n; hn as it is.
    // FAST: to a few fp32 ulps near saturation, where the backward's factors 1 - z and 1 - n^2
    // live: through tanh.approx, 1 - z for z = sigma(9) came out ~1e-3 off relative, and a GRU
    // whose update gates stay near 1 had its parameter gradients 1.6e-3 off (NOTES v29). Two SFU
    // operations a gate (ex2, reciprocal) instead of one. The recomputing loop in bf16 mode, whose
    // operands carry 2^-9, keeps the forward's (ACC false).
    template <bool FAST>
    static __device__ __forceinline__ float gate(int p, float v) {
        if (p == 3)
            return v;
        if (!FAST)
            return p == 2 ? act_tanh<false>(v) : act_sigmoid<false>(v);
        if (p == 2) // +-1 for large |v|, NaN stays NaN
            return copysignf(1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * fabsf(v))), v);
        return __fdividef(1.0f, 1.0f + __expf(-v));
    }
    // dh' = dy + dh_carry. Out: d[4] (D row planes: da_r, da_z, da_n r, da_n: the hidden side's
    // three first, so they equal the tile and are contiguous), tile[3] (the gradient of
    // W_hh h + b_hh: da_r, da_z, da_n r), the direct dL/dh term and dL/dc (unused).
    template <bool FAST, bool ACT = false>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[3],
                                                    float &dh_direct, float &dc_prev) {
        (void)dc_in;
        const float r = ACT ? s[0] : gate<FAST>(0, s[0]), z = ACT ? s[1] : gate<FAST>(1, s[1]);
        const float n = ACT ? s[2] : gate<FAST>(2, s[2]), hn = s[3];
        float da_n = dhj * (1.0f - z) * (1.0f - n * n);
        float da_z = dhj * (hprev - n) * z * (1.0f - z);
        float da_r = da_n * hn * r * (1.0f - r);
        d[0] = da_r, d[1] = da_z, d[2] = da_n * r, d[3] = da_n;
        tile[0] = da_r, tile[1] = da_z, tile[2] = da_n * r;
        dh_direct = dhj * z;
        dc_prev = 0.0f;
    }
};

// The LSTM's record holds the gates' pre-activations, not the gates: the backward applies the
// activations again. Its four gate planes are what the tensor-core modes store in fp16 (SH),
// and a rounded pre-activation keeps sigma' = sigma (1 - sigma) and the forget gate's product
// over steps to a relative 2^-12 where a gate saturates; a rounded gate near 1 would not (f =
// 0.9999 rounds to 1 in fp16, and the product over 256 steps is then off by 2.5%).
struct cell_lstm {
    static constexpr int G = 4;
    static constexpr int SW = 5; // a_i, a_f, a_g, a_o (pre-activations), cprev
    static constexpr int SH = 4;
    template <bool FAST>
    static __device__ __forceinline__ void forward(const float xq[4], const float hq[4], float h,
                                                   float c, float &h_new, float &c_new,
                                                   float s[SW]) {
        (void)h;
#pragma unroll
        for (int q = 0; q < 4; q++)
            s[q] = xq[q] + hq[q];
        s[4] = c;
        float i = act_sigmoid<FAST>(s[0]), f = act_sigmoid<FAST>(s[1]);
        float g = act_tanh<FAST>(s[2]), o = act_sigmoid<FAST>(s[3]);
        c_new = f * c + i * g;
        h_new = o * act_tanh<FAST>(c_new);
    }
    template <bool FAST>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[4],
                                                    float &dh_direct, float &dc_prev) {
        (void)hprev;
        float i = act_sigmoid<FAST>(s[0]), f = act_sigmoid<FAST>(s[1]);
        float g = act_tanh<FAST>(s[2]), o = act_sigmoid<FAST>(s[3]), c = s[4];
        float tc = act_tanh<FAST>(f * c + i * g);
        float dcj = dc_in + dhj * o * (1.0f - tc * tc);
        d[0] = dcj * g * i * (1.0f - i);
        d[1] = dcj * c * f * (1.0f - f);
        d[2] = dcj * i * (1.0f - g * g);
        d[3] = dhj * tc * o * (1.0f - o);
        tile[0] = d[0], tile[1] = d[1], tile[2] = d[2], tile[3] = d[3];
        dh_direct = 0.0f;
        dc_prev = dcj * f;
    }
};


// ---------------------------------------------------------------------------------------------
// Geometry: warps, k-steps, shared memory.

template <class Cell, class Mode, int HP>
struct persist_geom {
    static constexpr int G = Cell::G;
    static constexpr int NW = HP / 16;
    static constexpr int THREADS = NW * 32;
    using elem = typename Mode::elem;
    using HM = typename Mode::hmode;
    using helem = typename HM::elem;
    // Forward: N = 2G n-tiles a warp (its 16 units of each gate); K = HP (h, in HM's k-steps),
    // plus up to HP/2 (x, in Mode's k-steps) when the input projection is fused. h and x have
    // their own A tiles (double-buffered) and weight fragments, in that order.
    static constexpr int F_NT = 2 * G;
    static constexpr int F_KS = HP / HM::KSTEP;
    static constexpr int F_XKS = HP / 2 / Mode::KSTEP; // most x k-steps a fused loop takes
    static constexpr int F_HWPL = F_NT * HM::WPF;       // weight words a lane reads per k-step
    static constexpr int F_XWPL = F_NT * Mode::WPF;
    static constexpr long F_HKS_BYTES = (long)F_HWPL * 4 * 32 * NW;
    static constexpr long F_XKS_BYTES = (long)F_XWPL * 4 * 32 * NW;
    static constexpr int F_HLD = HP + HM::APAD;
    static constexpr int f_xld(int xks) { return xks * Mode::KSTEP + Mode::APAD; }
    static constexpr long f_wbytes(int xks) { return F_KS * F_HKS_BYTES + xks * F_XKS_BYTES; }
    static constexpr long F_HTILES_BYTES = 2L * 16 * F_HLD * (long)sizeof(helem);
    static constexpr long f_smem(int xks) {
        return f_wbytes(xks) + F_HTILES_BYTES +
               (xks ? 2L * 16 * f_xld(xks) * (long)sizeof(elem) : 0);
    }
    // The forward with K split over warp pairs (KP, v12): the GRU's fused TF32 loop at HP = 128
    // (LSTM's exchange does not fit next to its weights). Its x part runs in HM's k-steps on x
    // rows scaled into fp16 per row: h weights, x weights (HM fragments), h tiles, an fp32 x
    // stage (16 x HP/2), the fp16 x tile, the rows' inverse x scales, the pair exchange (2 NT
    // floats a lane).
    static constexpr bool F_KP = G == 3 && HP == 128 && std::is_same<Mode, mode_tf32>::value;
    static constexpr int F_KP_XKS = HP / 2 / HM::KSTEP;
    static constexpr int F_KP_XLD = HP / 2 + HM::APAD;
    static constexpr long F_KP_WBYTES = (F_KS + F_KP_XKS) * F_HKS_BYTES;
    static constexpr long F_KP_STAGE = F_KP_WBYTES + F_HTILES_BYTES;
    static constexpr long F_KP_XTILE = F_KP_STAGE + 16L * (HP / 2) * 4;
    static constexpr long F_KP_XINV = F_KP_XTILE + 16L * F_KP_XLD * (long)sizeof(helem);
    static constexpr long F_KP_XCH = F_KP_XINV + 16 * 4;
    static constexpr long F_XCH_BYTES = 2L * NW * 32 * 2 * F_NT * 4;
    // Behind those (the x part a step ahead, v13): the x partial sums of the h-warps' rows in
    // two parities (NW pairs x 32 lanes x NT/2 float4 each) and a second fp32 x stage (x is
    // staged two steps ahead).
    static constexpr long F_KPXA_XSLOT = F_KP_XCH + F_XCH_BYTES;
    static constexpr long F_KPXA_SLOTP = (long)NW * 32 * (F_NT / 2) * 16;
    static constexpr long F_KPXA_STAGE1 = F_KPXA_XSLOT + 2 * F_KPXA_SLOTP;
    static constexpr long f_smem_kpxa() {
        return F_KPXA_STAGE1 + 16L * (HP / 2) * 4;
    }
    // Backward: K = G*HP (gate rows) split in two halves; warps 2p and 2p+1 share N = 4 n-tiles
    // (units [32p, 32p+32): both warps' units), warp 2p+kh takes K half kh, and each hands the
    // partner the partial sums of the partner's units through an exchange buffer (8 floats a
    // lane). Halves the A-tile reads of a warp against N = 2 n-tiles over the whole of K.
    // The dh MMAs run in HM, 16-bit: TF32 mode's tile is fp16 with a scale a row (NOTES v32).
    static constexpr int B_NT = 4;
    static constexpr int B_KS = G * HP / HM::KSTEP;
    static constexpr int B_KSW = B_KS / 2; // k-steps a warp takes
    static constexpr int B_WPL = B_NT * HM::WPF;
    static constexpr long B_KS_BYTES = (long)B_WPL * 4 * 32 * NW;
    static constexpr int B_LDA = G * HP + HM::APAD;
    static constexpr long B_TILE_BYTES = 16L * B_LDA * (long)sizeof(helem);
    static constexpr long B_XCH_BYTES = NW * 2L * 32 * 16;
    static constexpr long B_RMAX_BYTES = NW * 16L * 4; // the warps' row maxima (TF32 mode)
    static constexpr long B_SMEM = B_KSW * B_KS_BYTES + B_TILE_BYTES + B_XCH_BYTES + B_RMAX_BYTES;
    static constexpr int B_SPLIT = 2; // independent accumulator chains over k in backward
    static_assert(B_KS % 2 == 0 && NW % 2 == 0, "backward K split needs warp pairs");
    static_assert(f_smem(0) <= RNND_PERSIST_SMEM_BUDGET, "forward does not fit");
    static_assert(!F_KP || f_smem_kpxa() <= RNND_PERSIST_SMEM_BUDGET, "KP does not fit");
    static_assert(B_SMEM <= RNND_PERSIST_SMEM_BUDGET, "backward does not fit");
};

// Weight fragments in shared memory: per k-step, per warp, WPL words per lane, stored as 16-byte
// (or 8-byte) vectors with lanes adjacent, so a warp's read of one vector is conflict-free.
template <int WPL>
struct persist_wlayout {
    static constexpr int VW = WPL % 4 == 0 ? 4 : 2; // words a vector
    static constexpr int NV = WPL / VW;
    static __device__ __forceinline__ void store(unsigned char *wsm, int ks, int nw, int w,
                                                 int lane, const uint32_t *o) {
#pragma unroll
        for (int v = 0; v < NV; v++) {
            size_t at = (((size_t)ks * nw + w) * NV + v) * 32 + lane;
            if constexpr (VW == 4)
                reinterpret_cast<uint4 *>(wsm)[at] =
                    make_uint4(o[4 * v], o[4 * v + 1], o[4 * v + 2], o[4 * v + 3]);
            else
                reinterpret_cast<uint2 *>(wsm)[at] = make_uint2(o[2 * v], o[2 * v + 1]);
        }
    }
    static __device__ __forceinline__ void load(uint32_t *o, const unsigned char *wsm, int ks,
                                                int nw, int w, int lane) {
#pragma unroll
        for (int v = 0; v < NV; v++) {
            size_t at = (((size_t)ks * nw + w) * NV + v) * 32 + lane;
            if constexpr (VW == 4) {
                uint4 q = reinterpret_cast<const uint4 *>(wsm)[at];
                o[4 * v] = q.x, o[4 * v + 1] = q.y, o[4 * v + 2] = q.z, o[4 * v + 3] = q.w;
            } else {
                uint2 q = reinterpret_cast<const uint2 *>(wsm)[at];
                o[2 * v] = q.x, o[2 * v + 1] = q.y;
            }
        }
    }
};

// The block-wide maximum of the threads' v (every thread gets it). red: a float a warp of shared
// scratch, free again on return.
static __device__ float persist_block_max(float v, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = 0.0f;
    for (int k = 0; k < (int)blockDim.x / 32; k++)
        v = fmaxf(v, red[k]);
    __syncthreads();
    return v;
}

// persist_pow2_for of the block-wide maximum of the threads' values. red: 32 floats of shared
// scratch, free again on return.
static __device__ float persist_pow2_scale(float m, int top, float *red) {
    return persist_pow2_for(persist_block_max(m, red), top);
}

// The backward loops' 16-row dh tiles in fp16, a scale a row (v8, NOTES v32): each warp puts its
// largest |value| m of row g + 8 i (its lanes tg = 0..3 together) into rmax[w][row] before a
// barrier; after it, a row's scale puts the largest of the NW warps' into [2^13, 2^14).
static __device__ __forceinline__ void tile_rowmax_put(float *rmax, float m, int w, int lane,
                                                       int i) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    if ((lane & 3) == 0)
        rmax[w * 16 + (lane >> 2) + 8 * i] = m;
}
template <int NW>
static __device__ __forceinline__ float tile_row_scale(const float *rmax, int row) {
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < NW; k++)
        m = fmaxf(m, rmax[k * 16 + row]);
    return persist_pow2_for(m, 14);
}

// A row of 64 fp32 values held by a half-warp (4 consecutive values a lane) into 16-bit HM
// values at dst (this lane's 4), the row scaled by the power of two that puts its largest |value|
// in [2^13, 2^14): as exact as TF32 for every value within 2^27 of the largest. Returns 1/scale,
// or 0 for a row of zeros (whose products are 0 either way; the dw16 records tell it by that).
// In bf16 (HM unscaled, fp32's range) the row goes as it is and 1 comes back.
template <class HM>
static __device__ __forceinline__ float persist_row16(float4 v, void *dst) {
    if constexpr (!HM::SCALED) {
        *reinterpret_cast<uint2 *>(dst) = make_uint2(HM::pack2(v.x, v.y), HM::pack2(v.z, v.w));
        return 1.0f;
    }
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float sc = persist_pow2_for(m, 14);
    *reinterpret_cast<uint2 *>(dst) =
        make_uint2(HM::pack2(v.x * sc, v.y * sc), HM::pack2(v.z * sc, v.w * sc));
    return m != 0.0f ? 1.0f / sc : 0.0f;
}

// max |p[i]| over this thread's share of p[0..n) (the block's threads stride it; 0 for n = 0):
// 16-byte loads where p is 16-byte aligned, then single floats for the rest, four loads in flight.
// Every block reads its weights so at its start; with single floats, and one load in flight for
// W_ih, that took ~5% of a 0.8 ms loop (NOTES v23).
static __device__ float persist_absmax(const float *p, int n) {
    const int nt = blockDim.x;
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = threadIdx.x, done = 0;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
        const float4 *q = reinterpret_cast<const float4 *>(p);
        auto m4 = [&](int k) {
            const float4 v = __ldg(q + k);
            return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
        };
        const int n4 = n / 4;
        for (; i + 3 * nt < n4; i += 4 * nt)
#pragma unroll
            for (int j = 0; j < 4; j++)
                m[j] = fmaxf(m[j], m4(i + j * nt));
        for (; i < n4; i += nt)
            m[0] = fmaxf(m[0], m4(i));
        done = 4 * n4;
    }
    for (i = done + threadIdx.x; i + 3 * nt < n; i += 4 * nt)
#pragma unroll
        for (int j = 0; j < 4; j++)
            m[j] = fmaxf(m[j], fabsf(__ldg(p + i + j * nt)));
    for (; i < n; i += nt)
        m[0] = fmaxf(m[0], fabsf(__ldg(p + i)));
    return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
}

// The weights' scale: max |w| over a[0..na) and b[0..nb) into [2^14, 2^15), so that the scaled
// weights fit fp16 with room to spare.
static __device__ float persist_wscale(const float *a, int na, const float *b, int nb,
                                       float *red) {
    return persist_pow2_scale(fmaxf(persist_absmax(a, na), persist_absmax(b, nb)), 15, red);
}

// The scale of h in the forward's fp16 A tile: every h the block's rows can hold is at most
// max(1, |h0|, |stored states|) (a GRU's h' is a convex combination of h and n in [-1, 1], an
// LSTM's h' = o tanh(c')), which this puts in [2^13, 2^14), far from fp16's overflow at 65504.
// Only the stored states and h0 of the block's own rows are read (none when absent).
// The backward without the gate tape (v10) uses the same bound for the hprev it recomputes from.
template <class A>
static __device__ float persist_hscale(const A &a, float *red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int steps = a.hidden ? a.T : a.h0 ? 1 : 0;
    float m = 1.0f;
    for (int rt = w; rt < 16 * steps; rt += nw) { // a warp per (row, step)
        int row = rt / steps, t = rt - row * steps, b = blockIdx.x * 16 + row;
        if (b >= a.B)
            break;
        for (int u = lane; u < a.H; u += 32) {
            if (a.hidden)
                m = fmaxf(m, fabsf(__ldg(a.hidden + (((size_t)b * a.T + t) * a.L + a.l) * a.H + u)));
            if (t == 0 && a.h0)
                m = fmaxf(m, fabsf(__ldg(a.h0 + ((size_t)b * a.L + a.l) * a.H + u)));
        }
    }
    return persist_pow2_scale(m, 14, red);
}

// ---------------------------------------------------------------------------------------------
// Element access: four consecutive units u0..u0+3 of one row, p already offset by u0. VEC (H a
// multiple of 4, 16-byte aligned rows) makes each a single 16-byte access; ok says the row exists.

template <bool VEC>
static __device__ __forceinline__ void ld4(float v[4], const float *p, int u0, int H, bool ok) {
    if (VEC) {
        float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ok && u0 < H)
            q = __ldg(reinterpret_cast<const float4 *>(p));
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            v[j] = ok && u0 + j < H ? __ldg(p + j) : 0.0f;
    }
}

template <bool VEC>
static __device__ __forceinline__ void st4(float *p, const float v[4], int u0, int H, bool ok) {
    if (VEC) {
        if (ok && u0 < H)
            *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (ok && u0 + j < H)
                p[j] = v[j];
    }
}

static __device__ __forceinline__ void zero4(float v[4]) {
    v[0] = v[1] = v[2] = v[3] = 0.0f;
}

// A tape s row (common.cuh): Cell::SW planes of H values, the first SH of them fp16 where HALF
// (seq.cu's tape_half), the others fp32. Accessors for plane p of a row at
// one unit u, at two (u even: get2 / put2) and at four (ld4 / st4's u0, H and ok).
template <class Cell, bool HALF>
struct tape_rec {
    static constexpr int SH = HALF ? Cell::SH : 0;
    static __device__ __forceinline__ size_t floats(int H) { // a row's, SH even
        return (size_t)(Cell::SW - SH) * H + (size_t)(SH / 2) * H;
    }
    static __device__ __forceinline__ __half *hp(const float *row, int p, int H) {
        return reinterpret_cast<__half *>(const_cast<float *>(row)) + (size_t)p * H;
    }
    static __device__ __forceinline__ float *fp(const float *row, int p, int H) {
        return const_cast<float *>(row) + (size_t)(SH / 2) * H + (size_t)(p - SH) * H;
    }
    static __device__ __forceinline__ float get(const float *row, int p, int H, int u) {
        return p < SH ? __half2float(hp(row, p, H)[u]) : fp(row, p, H)[u];
    }
    static __device__ __forceinline__ void put(float *row, int p, int H, int u, float v) {
        if (p < SH)
            hp(row, p, H)[u] = __float2half_rn(v);
        else
            fp(row, p, H)[u] = v;
    }
    // Units u, u+1 of 16-bit plane p packed, and their values (see ld4_packed).
    static __device__ __forceinline__ uint32_t ld2_packed(const float *row, int p, int H, int u) {
        return __ldg(reinterpret_cast<const uint32_t *>(hp(row, p, H) + u));
    }
    static __device__ __forceinline__ float2 unpack2(uint32_t q) {
        return __half22float2(*reinterpret_cast<const __half2 *>(&q));
    }
    static __device__ __forceinline__ float2 get2(const float *row, int p, int H, int u) {
        if (p < SH)
            return unpack2(ld2_packed(row, p, H, u));
        return __ldg(reinterpret_cast<const float2 *>(fp(row, p, H) + u));
    }
    static __device__ __forceinline__ void put2(float *row, int p, int H, int u, float2 v) {
        if (p < SH)
            *reinterpret_cast<__half2 *>(hp(row, p, H) + u) = __float22half2_rn(v);
        else
            *reinterpret_cast<float2 *>(fp(row, p, H) + u) = v;
    }
    // Units u0..u0+3 of 16-bit plane p (u0 % 4 == 0, vector access) packed, zeros where !ok or
    // past H, and their values: a loop that loads a step ahead keeps them packed until it uses
    // them (NOTES v23).
    static __device__ __forceinline__ uint2 ld4_packed(const float *row, int p, int u0, int H,
                                                       bool ok) {
        return ok && u0 < H ? __ldg(reinterpret_cast<const uint2 *>(hp(row, p, H) + u0))
                            : make_uint2(0u, 0u);
    }
    static __device__ __forceinline__ void unpack4(float v[4], uint2 q) {
        float2 lo = __half22float2(*reinterpret_cast<const __half2 *>(&q.x));
        float2 hi = __half22float2(*reinterpret_cast<const __half2 *>(&q.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    }
    template <bool VEC>
    static __device__ __forceinline__ void ld4(float v[4], const float *row, int p, int u0, int H,
                                               bool ok) {
        if (p >= SH)
            return ::ld4<VEC>(v, fp(row, p, H) + u0, u0, H, ok);
        if (VEC) {
            unpack4(v, ld4_packed(row, p, u0, H, ok));
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[j] = ok && u0 + j < H ? get(row, p, H, u0 + j) : 0.0f;
        }
    }
    template <bool VEC>
    static __device__ __forceinline__ void st4(float *row, int p, const float v[4], int u0, int H,
                                               bool ok) {
        if (p >= SH)
            return ::st4<VEC>(fp(row, p, H) + u0, v, u0, H, ok);
        if (VEC) {
            alignas(8) __half2 q[2] = {__floats2half2_rn(v[0], v[1]),
                                       __floats2half2_rn(v[2], v[3])};
            if (ok && u0 < H)
                *reinterpret_cast<uint2 *>(hp(row, p, H) + u0) = *reinterpret_cast<uint2 *>(q);
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (ok && u0 + j < H)
                    put(row, p, H, u0 + j, v[j]);
        }
    }
};

// The LSTM's fp16 tape where its backward runs in clusters (seq.cu's tape_blocked; H = 256,
// seq_cluster.cu): blocks of 8 rows x 8 units, [b / 8][t][u / 8], 768 bytes each. Lane
// l = 4 (b % 8) + (u % 8) / 2 holds units u, u + 1 (u even) of row b: the four fp16 planes in
// 16 bytes at 16 l (plane p's pair at 4 p), cprev in 8 bytes at 512 + 8 l. A cluster warp's
// lane (g, tg) owns exactly that lane's elements (rows 8 i + g of 8-aligned groups, units 8 w +
// 2 tg + j), so a step's record takes it one 16-byte and one 8-byte access a row, each warp
// access 768 contiguous bytes; in rows of tape_rec each of five accesses touched 8 rows' lines
// (NOTES v34). The blocks of a partial last group run to a multiple of 8 rows.
struct tape_b8 {
    static constexpr int FLOATS = 192; // a block
    // The block of row group b8 (rows [8 b8, 8 b8 + 8)), step t, unit u; of row b.
    static __device__ __forceinline__ size_t block8(size_t b8, int t, int u, int T, int H) {
        return ((b8 * T + t) * (size_t)(H / 8) + u / 8) * FLOATS;
    }
    static __device__ __forceinline__ size_t block(size_t b, int t, int u, int T, int H) {
        return block8(b / 8, t, u, T, H);
    }
    static __device__ __forceinline__ int lane(size_t b, int u) {
        return 4 * (int)(b % 8) + (u % 8) / 2;
    }
    // Plane p (< 4: fp16; 4: cprev) of unit u at row b, step t.
    static __device__ __forceinline__ float get(const float *s, size_t b, int t, int p, int u,
                                                int T, int H) {
        const float *k = s + block(b, t, u, T, H);
        const int l = lane(b, u);
        return p < 4 ? __half2float(reinterpret_cast<const __half *>(k)[8 * l + 2 * p + (u & 1)])
                     : k[128 + 2 * l + (u & 1)];
    }
    static __device__ __forceinline__ void put(float *s, size_t b, int t, int p, int u, int T,
                                               int H, float v) {
        float *k = s + block(b, t, u, T, H);
        const int l = lane(b, u);
        if (p < 4)
            reinterpret_cast<__half *>(k)[8 * l + 2 * p + (u & 1)] = __float2half_rn(v);
        else
            k[128 + 2 * l + (u & 1)] = v;
    }
};

// A reset flag, kept as a plain int until it is used: a bool would be normalised (compared)
// right after the load, and the warp would wait for the load there.
static __device__ __forceinline__ int ld_flag(const uint8_t *p, bool ok) {
    return ok ? (int)__ldg(p) : 0;
}

// Unit of column n of a warp's n-tile `half` (the permutation in the header comment).
static __device__ __forceinline__ int persist_unit(int w, int half, int n) {
    return w * 16 + 4 * (n >> 1) + 2 * half + (n & 1);
}

// The x part of a step: acc[nt] += the x tile's rows (M's A fragments, pitch ld) times the
// W_ih fragments at wsmx (layout WL), over k-steps [0, nks), nks <= KS. The forward, its KP x-warps
// and the recomputing backward run it in their own modes.
// afrag(a, ks) gives k-step ks's A fragments (persist_xmma: from the tile).
template <class M, class WL, int KS, int NT, class AF>
static __device__ __forceinline__ void persist_xmma_af(float (&acc)[NT][4], AF afrag,
                                                       const unsigned char *wsmx, int nks, int nw,
                                                       int w, int lane) {
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        if (ks >= nks)
            break;
        uint32_t af[4], wv[NT * M::WPF];
        afrag(af, ks);
        WL::load(wv, wsmx, ks, nw, w, lane);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            M::mma(acc[nt], af, M::wunpack(wv + nt * M::WPF));
    }
}
template <class M, class WL, int KS, int NT>
static __device__ __forceinline__ void persist_xmma(float (&acc)[NT][4],
                                                    const typename M::elem *tile, int ld,
                                                    const unsigned char *wsmx, int nks, int nw,
                                                    int w, int lane) {
    persist_xmma_af<M, WL, KS>(
        acc, [&](uint32_t af[4], int ks) { M::afrag(af, tile, ld, ks, lane); }, wsmx, nks, nw, w,
        lane);
}

// Rows g and g + 8 of the block (the backward loops' two rows a thread): whether each exists, its
// batch index (0 past B) and its first tape row b T.
static __device__ __forceinline__ void persist_rows2(bool rv[2], size_t bidx[2], size_t rbase[2],
                                                     int B, int T, int g) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int b = blockIdx.x * 16 + g + 8 * i;
        rv[i] = b < B;
        bidx[i] = rv[i] ? b : 0;
        rbase[i] = bidx[i] * T;
    }
}

// ---------------------------------------------------------------------------------------------
// Phase clocks (bench variant bit 8, TF32 H=128 only): warp 0's clock cycles per phase of each
// step, summed into a.dbg (docs/journal v4 has the phases).
template <int V>
struct persist_clock {
    long long t = 0, sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    __device__ __forceinline__ void start() {
        if (V & 8)
            t = clock64();
    }
    __device__ __forceinline__ void mark(int k) {
        if (V & 8) {
            long long n = clock64();
            sum[k] += n - t;
            t = n;
        }
    }
    __device__ __forceinline__ void flush(long long *dbg) {
        if ((V & 8) && dbg && threadIdx.x == 0 && blockIdx.x < 1024)
            for (int k = 0; k < 8; k++)
                dbg[blockIdx.x * 8 + k] = sum[k];
    }
};

// Makes warp 0 wait for v (so that a phase clock includes the latency that produced it).
static __device__ __forceinline__ void persist_wait_for(float v, long long *dbg) {
    if (__float_as_uint(v) == 0x7fc0dead && dbg)
        dbg[0] = 0;
}

// ---------------------------------------------------------------------------------------------
// Forward kernel

// XF: the input projection is fused (a.xks x k-steps; the loop reads x, not a.xg). The layer
// input is read by the loop (a.x) when it is fused and when the tape copy of x is made here
// (a.xcopy); each thread then moves up to 4 of the 16 x I_l values of a step (I_l <= HP/2).
//
// KP (v12: GRU, TF32, HP = 128, fused, vector access; persist_geom::F_KP): two warps per 16-unit
// group, 2*HP/16 warps a block. Of the pair (warps w16 and w16 ^ 4, so that each scheduler holds
// both kinds) the first (kh = 0) runs the h part for all 16 rows, the second (kh = 1) the x
// part on x rows scaled into fp16 (converted from an fp32 stage by the x-warps at the top of
// the step, behind their own 256-thread barrier); each hands its partner the partial sums of
// the partner's row (g + 8 for kh = 0, g for kh = 1: 2 NT floats a lane) through shared memory
// and a 64-thread barrier, and runs the cell for its own row, g + 8 kh, only: half the MMA
// chain and half the cell a warp, twice the warps to hide their latencies, no weights in
// registers (128 registers a thread at most).
//
// The x part runs a step ahead (v13), so the h-warps do not wait for it. x is loaded two steps ahead into one of two
// fp32 stages (x(t+2) at the end of step t); at the top of step t the x-warps convert x(t+1)
// into the fp16 tile (their barrier 9) and, at the end of step t (after the cell, the stores and
// put_h, where the fewest registers are live), run the x part of step t+1, scale each row back
// by its 1/x scale and write the h-partner's row (g) into parity (t+1)&1 of the x slots and
// their own row (g+8) into their own exchange slot. The block barrier at the end of step t
// publishes both. Per step the pair then needs one direction only: the h-warp writes the h part
// of row g+8, bar.arrive; the x-warp bar.sync (64 threads, barrier 1+w) and reads it. The h-warp
// reads the x slot of parity t&1 (written before the last block barrier) without waiting; the
// two parities keep the x-warp's writes of step t+1 off the slot the h-warp may still read.
// At t = T-1 there is no step T: no conversion, no x part. Resets touch only h (the x part does
// not depend on the state); the tape's x copy is written with the stage (rows t+2, 0 and 1 in
// the prologue).
template <class Cell, class Mode, int HP, bool VEC, bool XF, int V = 0, bool KP = false>
static __global__ void __launch_bounds__((KP ? 2 : 1) * HP / 16 * 32, 1)
    seq_forward_kernel(const struct persist_fwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using HM = typename Gm::HM;
    using E = typename Mode::elem;
    using HE = typename Gm::helem;
    using WLH = persist_wlayout<Gm::F_HWPL>;
    using WLX = persist_wlayout<Gm::F_XWPL>;
    constexpr int G = Gm::G, NT = Gm::F_NT, KSH = Gm::F_KS, XKS = XF ? Gm::F_XKS : 0;
    constexpr int NW = Gm::NW, SW = Cell::SW, HLD = Gm::F_HLD;
    using TR = tape_rec<Cell, true>; // the persistent loops never run in ieee mode
    constexpr int THREADS = (KP ? 2 : 1) * Gm::THREADS;
    constexpr int NR = KP ? 1 : 2; // rows a thread runs the cell for
    static_assert(!KP || (XF && VEC && NW % 4 == 0 && (2 * NT) % 4 == 0), "KP instance");

    const int lane = threadIdx.x & 31, w16 = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    // The 16-unit group and, KP, the part (h 0, x 1) of this warp; its rows are g + 8 rowof(r).
    const int w = KP ? (w16 & 3) | ((w16 >> 3) << 2) : w16, kh = KP ? (w16 >> 2) & 1 : 0;
    auto rowof = [&](int r) { return KP ? kh : r; };
    const int H = a.H, T = a.T, L = a.L, l = a.l, GH = G * H, Il = a.Il;
    // KP: x goes to an fp32 stage (pitch HP/2), the x-warps convert it (convert_x).
    const int xks = XF ? a.xks : 0, xld = KP ? HP / 2 : Gm::f_xld(xks);
    const int u0 = w * 16 + 4 * tg;

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *wsm = smem, *wsmx = smem + KSH * Gm::F_HKS_BYTES;
    HE *htiles = reinterpret_cast<HE *>(smem + (KP ? Gm::F_KP_WBYTES : Gm::f_wbytes(xks)));
    E *xtiles = reinterpret_cast<E *>(smem + Gm::f_wbytes(xks) + Gm::F_HTILES_BYTES);
    // KP: the x stage (fp32), the x tile (fp16, row-scaled), 1/scale a row, the pair exchange.
    float *xstage = reinterpret_cast<float *>(smem + Gm::F_KP_STAGE);
    HE *x16 = reinterpret_cast<HE *>(smem + Gm::F_KP_XTILE);
    float *xinv = reinterpret_cast<float *>(smem + Gm::F_KP_XINV);
    float4 *xch = reinterpret_cast<float4 *>(smem + Gm::F_KP_XCH);
    if constexpr (KP)
        xtiles = reinterpret_cast<E *>(xstage);
    // KP: stage p (x of the steps of parity p), the x slots (x part of the h-warps' rows).
    float *xstage1 = reinterpret_cast<float *>(smem + Gm::F_KPXA_STAGE1);
    auto xstage_p = [&](int p) { return p ? xstage1 : xstage; };
    float4 *xslot = reinterpret_cast<float4 *>(smem + Gm::F_KPXA_XSLOT);

    // Weights as B fragments: B[k][n] = W_hh[q*H + unit(n)][k] (h k-steps) and W_ih[..][k]
    // (x k-steps), q the gate of n-tile nt = 2q + half. Scales (powers of two): wscale for
    // the weights, hscale for h in its fp16 tile; the accumulators are scaled back exactly.
    float wscale = 1.0f, hscale = 1.0f;
    if constexpr (Mode::SCALED)
        wscale = persist_wscale(a.w_hh, GH * H, XF ? a.w_ih : nullptr, XF ? GH * Il : 0,
                                reinterpret_cast<float *>(htiles));
    if constexpr (HM::SCALED)
        hscale = persist_hscale(a, reinterpret_cast<float *>(htiles));
    const float winv = 1.0f / wscale, hinv = winv * (1.0f / hscale);
    auto wpack_all = [&](auto mode, unsigned char *to, int ks, bool xpart) {
        using M = decltype(mode);
        uint32_t o[NT * M::WPF];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int q = nt >> 1, half = nt & 1;
            auto Bf = [&](int k, int n) -> float {
                int unit = persist_unit(w, half, n);
                if (unit >= H)
                    return 0.0f;
                if (!xpart)
                    return k < H ? __ldg(a.w_hh + (size_t)(q * H + unit) * H + k) : 0.0f;
                return k < Il ? __ldg(a.w_ih + (size_t)(q * H + unit) * Il + k) : 0.0f;
            };
            M::wpack(o + nt * M::WPF, Bf, ks, g, tg, wscale);
        }
        persist_wlayout<NT * M::WPF>::store(to, ks, NW, w, lane, o);
    };
    if (!KP || kh == 0) {
#pragma unroll 2
        for (int ks = 0; ks < KSH; ks++)
            wpack_all(HM(), wsm, ks, false);
    }
    if (!KP)
        for (int ks = 0; ks < xks; ks++)
            wpack_all(Mode(), wsmx, ks, true);
    else if (kh == 1)
        for (int ks = 0; ks < CEIL_DIV(Il, HM::KSTEP); ks++)
            wpack_all(HM(), wsmx, ks, true);

    // Biases of this thread's elements.
    float bi[G][4], bh[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        ld4<false>(bi[q], a.b_ih + q * H + u0, u0, H, true);
        ld4<false>(bh[q], a.b_hh + q * H + u0, u0, H, true);
    }

    // Per-row base pointers at step 0 (rows past B point at row 0 and are never accessed).
    bool rv[NR];
    size_t rbase[NR];
    const float *xgp[NR];
    float *yp[NR];
    const uint8_t *initp[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        int b = blockIdx.x * 16 + g + 8 * rowof(i);
        rv[i] = b < a.B;
        rbase[i] = (size_t)(rv[i] ? b : 0) * T;
        xgp[i] = XF ? nullptr : a.xg + rbase[i] * GH + u0;
        yp[i] = a.y + rbase[i] * a.ldy + u0;
        initp[i] = a.is_init + rbase[i];
    }
    const size_t hid_step = (size_t)L * H; // stride of one step in hidden/cell

    // The layer input this thread moves each step: one float4 (xv4: I_l % 4 == 0, aligned) or
    // up to 4 single values, element e of the block's 16 x I_l values of the step.
    const bool xin = a.x != nullptr, xv4 = a.xvec;
    const float *xsrc[4];
    int xtile[4];
    float *xdst[4];
    bool xok[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int e = xv4 ? threadIdx.x * 4 + k : threadIdx.x + k * THREADS;
        int row = Il > 0 ? e / Il : 0, col = e - row * Il;
        size_t b = (size_t)blockIdx.x * 16 + row;
        xok[k] = xin && e < 16 * Il && b < (size_t)a.B;
        xsrc[k] = xok[k] ? a.x + b * T * a.ldx + col : nullptr;
        xdst[k] = xok[k] && a.xcopy ? a.z + b * T * a.ldz + a.xoff + col : nullptr;
        xtile[k] = row * xld + col;
    }
    float xv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto load_x = [&](int t) {
        if (xv4) {
            if (xok[0]) {
                float4 q = __ldg(reinterpret_cast<const float4 *>(xsrc[0] + (size_t)t * a.ldx));
                xv[0] = q.x, xv[1] = q.y, xv[2] = q.z, xv[3] = q.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (xok[k])
                    xv[k] = __ldg(xsrc[k] + (size_t)t * a.ldx);
        }
    };
    auto put_x = [&](E *tile, int t) { // into the A tile (fused) and the tape (xcopy)
        if (xv4) {
            if (xok[0]) {
                if (KP)
                    *reinterpret_cast<float4 *>(tile + xtile[0]) =
                        make_float4(xv[0], xv[1], xv[2], xv[3]);
                else if (XF)
                    Mode::put4(tile + xtile[0], xv);
                if (xdst[0])
                    *reinterpret_cast<float4 *>(xdst[0] + (size_t)t * a.ldz) =
                        make_float4(xv[0], xv[1], xv[2], xv[3]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (xok[k]) {
                    if (KP)
                        tile[xtile[k]] = xv[k];
                    else if (XF)
                        Mode::put(tile + xtile[k], xv[k]);
                    if (xdst[k])
                        xdst[k][(size_t)t * a.ldz] = xv[k];
                }
        }
    };

    // The state entering step 0 (reset rule): hidden[b, 0] when stored states are given, else
    // zero where is_init[b, 0], else h0 (c0) or zero.
    float h[NR][4], c[NR][4];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        zero4(h[i]);
        zero4(c[i]);
        size_t b = rbase[i] / (T > 0 ? T : 1);
        if (a.hidden) {
            ld4<VEC>(h[i], a.hidden + rbase[i] * hid_step + (size_t)l * H + u0, u0, H, rv[i]);
            if (a.cell)
                ld4<VEC>(c[i], a.cell + rbase[i] * hid_step + (size_t)l * H + u0, u0, H, rv[i]);
        } else if (a.h0 && rv[i] && !initp[i][0]) {
            ld4<VEC>(h[i], a.h0 + (b * L + l) * H + u0, u0, H, true);
            if (a.c0)
                ld4<VEC>(c[i], a.c0 + (b * L + l) * H + u0, u0, H, true);
        }
    }
    if constexpr (XF) {
        // Both x tiles start at zero (the padding past I_l stays so).
        for (int e = threadIdx.x; e < (KP ? 1 : 2) * 16 * xld; e += THREADS)
            Mode::put(xtiles + e, 0.0f);
        if constexpr (KP)
            for (int e = threadIdx.x; e < 16 * xld; e += THREADS)
                xstage1[e] = 0.0f;
        __syncthreads();
    }
    // KP, x-warps: an fp32 stage into the fp16 x tile, a half-warp a row (the x-warps' 256
    // threads), each row scaled by a power of two (its largest |x| in [2^13, 2^14): as exact as
    // TF32 for every x within 2^27 of it), and 1/scale a row; then the x-warps' barrier 9.
    auto convert_x = [&](const float *stage) {
        static_assert(!KP || (THREADS / 2 == 16 * 16 && HP / 2 == 64), "a half-warp a row");
        const int xt = w * 32 + lane, row = xt >> 4, cx = 4 * (xt & 15);
        float4 v = *reinterpret_cast<const float4 *>(stage + row * (HP / 2) + cx);
        const float inv = persist_row16<HM>(v, x16 + row * Gm::F_KP_XLD + cx);
        if ((lane & 15) == 0)
            xinv[row] = inv;
        asm volatile("bar.sync 9, %0;" ::"n"(THREADS / 2) : "memory"); // x-warps only
    };
    // KP, x-warps: the x part (HM's MMAs on the fp16 x tile) accumulated into cx.
    auto xmma = [&](float(&cx)[NT][4]) {
        persist_xmma<HM, WLH, Gm::F_KP_XKS>(cx, x16, Gm::F_KP_XLD, wsmx, CEIL_DIV(Il, HM::KSTEP),
                                            NW, w, lane);
    };
    // KP, x-warps: the x part of step tn from the converted tile, each row scaled back by its
    // 1/x scale (a power of two: exact), row g into parity tn&1 of the x slots (for the h-warp),
    // row g+8 into this warp's own exchange slot (for itself, next step).
    auto xahead = [&](int tn) {
        float cx[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            zero4(cx[nt]);
        xmma(cx);
        const float i0 = xinv[g], i1 = xinv[g + 8];
        float4 *xs = xslot + (size_t)(tn & 1) * (NW * (NT / 2) * 32) + w * 32 + lane;
        float4 *xo = xch + (size_t)w16 * 32 + lane;
#pragma unroll
        for (int v = 0; v < NT / 2; v++) {
            xs[v * NW * 32] = make_float4(cx[2 * v][0] * i0, cx[2 * v][1] * i0,
                                          cx[2 * v + 1][0] * i0, cx[2 * v + 1][1] * i0);
            xo[v * 16 * 32] = make_float4(cx[2 * v][2] * i1, cx[2 * v][3] * i1,
                                          cx[2 * v + 1][2] * i1, cx[2 * v + 1][3] * i1);
        }
    };
    // h (scaled) into the step's h tile.
    auto put_h = [&](HE *tile) {
#pragma unroll
        for (int i = 0; i < NR; i++) {
            float v[4] = {h[i][0] * hscale, h[i][1] * hscale, h[i][2] * hscale, h[i][3] * hscale};
            HM::put4(tile + (g + 8 * rowof(i)) * HLD + u0, v);
        }
    };
    put_h(htiles);
    if (xin) {
        load_x(0);
        put_x(xtiles, 0);
    }
    if constexpr (KP) {
        // x(0) converted and its x part run before the loop, x(1) staged (stage 1); the
        // barrier before the loop publishes the slots.
        __syncthreads();
        if (kh == 1 && T > 0) {
            convert_x(xstage_p(0));
            xahead(0);
        }
        if (xin && T > 1) {
            load_x(1);
            put_x(xstage_p(1), 1);
        }
    }

    // x W_ih^T of step 0 (not fused), and the reset flags and stored values of step 1.
    float xg[XF ? 1 : NR][G][4];
    if constexpr (!XF) {
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int q = 0; q < G; q++)
                ld4<VEC>(xg[i][q], xgp[i] + q * H, u0, H, rv[i]);
    }
    int nreset[NR];
    float nh[NR][4], nc[NR][4];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        zero4(nh[i]);
        zero4(nc[i]);
        bool ok = rv[i] && T > 1;
        nreset[i] = ld_flag(initp[i] + 1, ok);
        if (a.hidden) {
            size_t at = (rbase[i] + 1) * hid_step + (size_t)l * H + u0;
            ld4<VEC>(nh[i], a.hidden + at, u0, H, ok);
            if (a.cell)
                ld4<VEC>(nc[i], a.cell + at, u0, H, ok);
        }
    }
    // The first FREG h k-steps of weights stay in registers (48 GRU, 64 LSTM: less shared-memory
    // traffic a step; the thread reads back only what it stored itself). Fused loops only: the
    // others keep x W_ih^T in those registers; KP has no room for them.
    constexpr int FREG = XF && !KP ? (KSH < 4 ? KSH : 4) : 0;
    uint32_t wreg[FREG > 0 ? FREG : 1][Gm::F_HWPL];
#pragma unroll
    for (int ks = 0; ks < FREG; ks++)
        WLH::load(wreg[ks], wsm, ks, NW, w, lane);
    persist_clock<V> clk;
    __syncthreads();

    for (int t = 0; t < T; t++) {
        const HE *hcur = htiles + (t & 1) * (16 * HLD);
        HE *hnxt = htiles + ((t + 1) & 1) * (16 * HLD);
        const E *xcur = xtiles + (KP ? 0 : (t & 1) * (16 * xld));
        E *xnxt = xtiles + (KP ? 0 : ((t + 1) & 1) * (16 * xld));
        if constexpr (KP)
            xnxt = xstage_p(t & 1);     // x(t+2): (t+2)&1 == t&1
        constexpr int XAH = KP ? 2 : 1; // steps x is loaded ahead
        clk.start();
        if (xin && t + XAH < T)
            load_x(t + XAH); // in flight during the MMA
        // x two steps further into L2, a 128-byte line a lane of 8 (NOTES v22).
        if (xin && xv4 && t + XAH + 2 < T && xok[0] && (threadIdx.x & 7) == 0)
            prefetch_l2(xsrc[0] + (size_t)(t + XAH + 2) * a.ldx);

        // Gates for the warp's 2G n-tiles: h W_hh^T (acc) and, fused, x W_ih^T (accx) apart:
        // their scales differ, and the GRU's r multiplies the h part of n alone.
        float acc[NT][4], accx[XF ? NT : 1][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            zero4(acc[nt]);
#pragma unroll
        for (int nt = 0; nt < (XF ? NT : 1); nt++)
            zero4(accx[nt]);
        if (!KP || kh == 0) {
#pragma unroll
            for (int ks = 0; ks < KSH; ks++) {
                uint32_t af[4], wv[Gm::F_HWPL];
                HM::afrag(af, hcur, HLD, ks, lane);
                if (ks >= FREG)
                    WLH::load(wv, wsm, ks, NW, w, lane);
                const uint32_t *wp = ks < FREG ? wreg[ks < FREG ? ks : 0] : wv;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    HM::mma(acc[nt], af, HM::wunpack(wp + nt * HM::WPF));
            }
        }
        if constexpr (KP) {
            if (kh == 1 && t + 1 < T)
                convert_x(xstage_p((t + 1) & 1)); // x(t+1), for the x part at the end
        } else if constexpr (XF) {
            persist_xmma<Mode, WLX, XKS>(accx, xcur, xld, wsmx, xks, NW, w, lane);
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(acc[0][0] + acc[NT - 1][3], a.dbg);
            clk.mark(0);
        }
        // The row this thread runs the cell for: gh (h part) and gx (x part) of n-tile nt,
        // elements k = 0, 1 (units 2 half + k of its four), row g + 8 rowof(r).
        float gh[NR][NT][2], gx[XF ? NR : 1][XF ? NT : 1][2];
        if constexpr (KP) {
            // The h-warp sends the h part of row g+8 and reads the x part of row g (written
            // before the last block barrier); the x-warp waits for the h part of its row and
            // reads its own x part (its own slot).
            float4 *xo = xch + (size_t)w16 * 32 + lane;
            if (kh == 0) {
#pragma unroll
                for (int v = 0; v < NT / 2; v++)
                    xo[v * 16 * 32] = make_float4(acc[2 * v][2], acc[2 * v][3], acc[2 * v + 1][2],
                                                  acc[2 * v + 1][3]);
                asm volatile("bar.arrive %0, 64;" ::"r"(1 + w) : "memory");
                const float4 *xs = xslot + (size_t)(t & 1) * (NW * (NT / 2) * 32) + w * 32 + lane;
#pragma unroll
                for (int v = 0; v < NT / 2; v++) {
                    float4 q = xs[v * NW * 32];
                    gx[0][2 * v][0] = q.x, gx[0][2 * v][1] = q.y;
                    gx[0][2 * v + 1][0] = q.z, gx[0][2 * v + 1][1] = q.w;
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    gh[0][nt][0] = acc[nt][0], gh[0][nt][1] = acc[nt][1];
            } else {
                asm volatile("bar.sync %0, 64;" ::"r"(1 + w) : "memory");
                const float4 *xi = xch + (size_t)(w16 ^ 4) * 32 + lane;
#pragma unroll
                for (int v = 0; v < NT / 2; v++) {
                    float4 q = xi[v * 16 * 32], p = xo[v * 16 * 32];
                    gh[0][2 * v][0] = q.x, gh[0][2 * v][1] = q.y;
                    gh[0][2 * v + 1][0] = q.z, gh[0][2 * v + 1][1] = q.w;
                    gx[0][2 * v][0] = p.x, gx[0][2 * v][1] = p.y;
                    gx[0][2 * v + 1][0] = p.z, gx[0][2 * v + 1][1] = p.w;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int k = 0; k < 2; k++) {
                        gh[i][nt][k] = acc[nt][2 * i + k];
                        if constexpr (XF)
                            gx[i][nt][k] = accx[nt][2 * i + k];
                    }
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(gh[0][0][0] + gh[0][NT - 1][1], a.dbg);
            clk.mark(4);
        }

        // The cell, element by element.
        float hn[NR][4], cn[NR][4], sv[SW][NR][4];
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float xq[G], hq[G], s[SW];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const int nt = 2 * q + (j >> 1), e = j & 1;
                    float gxq;
                    if constexpr (XF)
                        gxq = gx[i][nt][e] * winv; // KP: already times the row's 1/x scale
                    else
                        gxq = xg[i][q][j];
                    xq[q] = gxq + bi[q][j];
                    hq[q] = gh[i][nt][e] * hinv + bh[q][j];
                }
                Cell::template forward<true>(xq, hq, h[i][j], c[i][j], hn[i][j], cn[i][j], s);
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = s[p];
            }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(hn[0][0] + hn[NR - 1][3], a.dbg);
            clk.mark(1);
        }

        // Next step's x W_ih^T (not fused): in flight during the next MMA.
        if constexpr (!XF) {
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int q = 0; q < G; q++)
                    ld4<VEC>(xg[i][q], xgp[i] + (size_t)(t + 1) * GH + q * H, u0, H,
                             rv[i] && t + 1 < T);
        }

        // Outputs and tape.
#pragma unroll
        for (int i = 0; i < NR; i++) {
            size_t r = rbase[i] + t;
            st4<VEC>(yp[i] + (size_t)t * a.ldy, hn[i], u0, H, rv[i]);
            if (a.z) {
                float *zr = a.z + r * a.ldz;
                st4<VEC>(zr + u0, h[i], u0, H, rv[i]);
                if (u0 == 0 && rv[i]) {
                    zr[H] = 1.0f;
                    for (int k = H + 1; k < a.xoff; k++)
                        zr[k] = 0.0f;
                    for (int k = a.xoff + a.Il; k < a.ldz; k++)
                        zr[k] = 0.0f;
                }
            }
            if (a.s) {
#pragma unroll
                for (int p = 0; p < SW; p++)
                    TR::template st4<VEC>(a.s + r * TR::floats(H), p, sv[p][i], u0, H, rv[i]);
            }
        }

        if (t + 1 < T) {
            // The state entering step t+1: the reset value where is_init[b, t+1], else h'.
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    h[i][j] = nreset[i] ? nh[i][j] : hn[i][j];
                    c[i][j] = nreset[i] ? nc[i][j] : cn[i][j];
                }
            put_h(hnxt);
            if (xin && (!KP || t + 2 < T))
                put_x(xnxt, t + XAH);
            // Flags and stored values of step t+2, used at the end of the next step.
#pragma unroll
            for (int i = 0; i < NR; i++) {
                bool ok = rv[i] && t + 2 < T;
                nreset[i] = ld_flag(initp[i] + t + 2, ok);
                if (a.hidden) {
                    size_t at = (rbase[i] + t + 2) * hid_step + (size_t)l * H + u0;
                    ld4<VEC>(nh[i], a.hidden + at, u0, H, ok);
                    if (a.cell)
                        ld4<VEC>(nc[i], a.cell + at, u0, H, ok);
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < NR; i++) {
                size_t at = (rbase[i] / T * L + l) * H + u0;
                if (a.h_n)
                    st4<VEC>(a.h_n + at, hn[i], u0, H, rv[i]);
                if (a.c_n)
                    st4<VEC>(a.c_n + at, cn[i], u0, H, rv[i]);
            }
        }
        if constexpr (KP)
            if (kh == 1 && t + 1 < T)
                xahead(t + 1); // the x part of step t+1 (its tile converted at the top)
        clk.mark(2);
        __syncthreads();
        clk.mark(3);
    }
    clk.flush(a.dbg);
}

// ---------------------------------------------------------------------------------------------
// Backward kernel

// dw16 chunks (seq_persist.h): the warp's 8 x 16 block of one row half (lane: row g, its units
// 4tg..4tg+3 as 16-bit pairs lo, hi: bf16, or F16 fp16) into the two core matrices at cm and
// cm + 256. KM (K-major): movmatrix transposes each 8 x 8 matrix of pairs, after which lane l
// holds rows 2(l%4) and 2(l%4)+1 of column l/4: one 4-byte store a lane writes a whole core
// matrix. Without KM (TF32 mode's D) lane l's pair is already row l/4's columns 2(l%4), +1 of a
// row-major core matrix: no movmatrix (its readers load it with ldmatrix transposed the other
// way). The columns come out in the order seq_persist.h gives (4tg, 4tg+1 in the first matrix,
// 4tg+2, 4tg+3 in the second).
template <bool F16 = false, bool KM = true>
static __device__ __forceinline__ void dw16_put(unsigned char *cm, const float v[4], int lane) {
    uint32_t a, b;
    if constexpr (F16) {
        __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
        a = *reinterpret_cast<uint32_t *>(&lo), b = *reinterpret_cast<uint32_t *>(&hi);
    } else {
        __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]);
        __nv_bfloat162 hi = __floats2bfloat162_rn(v[2], v[3]);
        a = *reinterpret_cast<uint32_t *>(&lo), b = *reinterpret_cast<uint32_t *>(&hi);
    }
    if constexpr (KM) {
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(a));
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(b));
    }
    *reinterpret_cast<uint32_t *>(cm + 4 * lane) = a;
    *reinterpret_cast<uint32_t *>(cm + 256 + 4 * lane) = b;
}
// A backward loop's row half i of chunk c into the dw16 chunks: D's 4 planes (plane(p): this
// thread's 4 units of plane p) times ds and (ZH) z's h part (h) times hs, warp w's 16 units being
// core-matrix groups 2w and 2w + 1; zeros where live is false (rows past B). Returns chunk c's z
// part at row half i.
template <bool F16 = false, bool ZH = true, class P>
static __device__ __forceinline__ unsigned char *dw16_put_dh(void *dw16, size_t pitch, size_t c,
                                                             int w, int i, int lane, bool live,
                                                             P plane, const float h[4],
                                                             float ds = 1.0f, float hs = 1.0f) {
    unsigned char *base = static_cast<unsigned char *>(dw16) + i * 128;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const float *d = plane(p);
        const float v[4] = {live ? d[0] * ds : 0.0f, live ? d[1] * ds : 0.0f,
                            live ? d[2] * ds : 0.0f, live ? d[3] * ds : 0.0f};
        dw16_put<F16, !F16>(base + (p * pitch + c) * RNND_DW16_D + 2 * w * 256, v, lane);
    }
    unsigned char *zc = base + 4 * pitch * RNND_DW16_D + c * RNND_DW16_Z;
    if constexpr (ZH) {
        const float hv[4] = {h[0] * hs, h[1] * hs, h[2] * hs, h[3] * hs};
        dw16_put<F16>(zc + 2 * w * 256, hv, lane);
    }
    return zc;
}
// The core matrix of z's columns 192..199 at cm: the constant (one, a pair of 16-bit ones: bf16
// 1.0, or TF32 mode's fp16 h scale) in both rows a lane holds, column 0 (lanes 0-3), and zeros.
static __device__ __forceinline__ void dw16_put_one(unsigned char *cm, int lane,
                                                    uint32_t one = 0x3F803F80u) {
    *reinterpret_cast<uint32_t *>(cm + 4 * lane) = lane < 4 ? one : 0u;
}
// log2 of a power of two p (a normal float).
static __device__ __forceinline__ int pow2_log(float p) {
    return (int)((__float_as_uint(p) >> 23) & 255) - 127;
}
// TF32 mode: a group's scale sc = persist_pow2_for(m, 14) for its largest |value| m (into
// [2^13, 2^14)), and its exponent ed (D = D' 2^ed for D' = D sc), or RNND_DW16_EZERO for m = 0.
static __device__ __forceinline__ float dw16_scale(float m, int &ed) {
    const float sc = persist_pow2_for(m, 14);
    ed = m > 0.0f ? -pow2_log(sc) : RNND_DW16_EZERO;
    return sc;
}
// TF32 mode: a step's exponent record (seq_persist.h) at rec, from warp w's group exponents ed
// of its rows g and g + 8 and their x exponents ex, and the block's eh: eD by the rows' lanes
// tg = 0 (one 32-byte run a warp), the warp's maxima by lane 0 (one redux each), eh and every
// row's ex (exr: row lane - 16's) by warp 4. The maxima are kept within int16 (zero groups).
static __device__ __forceinline__ void dw16_record(int16_t *rec, int w, int lane, const int ed[2],
                                                   const int ex[2], int eh, int exr) {
    const int g = lane >> 2, lo = RNND_DW16_EZERO - 128;
    if ((lane & 3) == 0) {
        rec[w * 16 + g] = (int16_t)ed[0];
        rec[w * 16 + g + 8] = (int16_t)ed[1];
    }
    const int mh = __reduce_max_sync(0xffffffffu, max(ed[0], ed[1])) + eh;
    const int mx = __reduce_max_sync(0xffffffffu, max(ed[0] + ex[0], ed[1] + ex[1]));
    if (lane == 0) {
        rec[160 + w] = (int16_t)max(mh, lo);
        rec[168 + w] = (int16_t)max(mx, lo);
    }
    if (w == 4)
        rec[128 + lane] = (int16_t)(lane < 16 ? eh : exr);
}
// TF32 mode: D's group scale of one row half (this thread's 4 units of the 4 planes, the row's
// 4 lanes together; zero for a row past B) and its exponent ed.
static __device__ __forceinline__ float dw16_dscale(const float *const dv[4], bool live, int &ed) {
    float m = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; p++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            m = fmaxf(m, fabsf(dv[p][j]));
    m = live ? m : 0.0f;
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    return dw16_scale(m, ed);
}

// dh = tile . W_hh runs on 16-bit MMAs (HM: m16n8k16, half the k-steps of TF32's m16n8k8): TF32
// mode's tile is fp16, each row scaled by the power of two that puts its largest |value| in
// [2^13, 2^14) (v8's scales: as exact as TF32 for values within 2^27 of it); the warps' row
// maxima meet in shared memory across the step's first barrier, the tile is written after it,
// and a second barrier precedes the MMAs (NOTES v32).
// DW (LSTM): D and z leave as dw16 chunks (seq_persist.h) instead of D in fp32; the loop then
// loads each row's hprev and (warps 0-3) x, which z holds. bf16 mode: bf16. TF32 mode: fp16 with
// exponent records, D scaled by (row, warp) group, h by the block's bound (persist_hscale) and
// x by its row's largest |x| (warps 0-3's group maxima exchanged in shared memory, xm, across
// the step's first barrier).
// ZF (TF32 mode, with DW): the forward wrote z's chunk parts and x's exponents (a.zc_ex); the
// loop writes D's parts and the records alone, and reads no z rows (NOTES v27).
template <class Cell, class Mode, int HP, bool VEC, int V = 0, bool DW = false, bool ZF = false>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_backward_kernel(const struct persist_bwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using HM = typename Gm::HM; // the dh MMAs' mode
    using E = typename Gm::helem;
    using WL = persist_wlayout<Gm::B_WPL>;
    constexpr int G = Gm::G, NT = Gm::B_NT, KSW = Gm::B_KSW, NW = Gm::NW, WPF = HM::WPF;
    constexpr int LDA = Gm::B_LDA, SW = Cell::SW, SPLIT = Gm::B_SPLIT;
    using TR = tape_rec<Cell, true>; // as the forward
    constexpr bool LSTM = G == 4;

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *wsm = smem;
    E *tile = reinterpret_cast<E *>(smem + KSW * Gm::B_KS_BYTES);
    float4 *xch = reinterpret_cast<float4 *>(smem + KSW * Gm::B_KS_BYTES + Gm::B_TILE_BYTES);
    float *rmax = reinterpret_cast<float *>(xch + Gm::B_XCH_BYTES / 16); // [warp][row]

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l;
    const int u0 = w * 16 + 4 * tg;
    // The K half this warp takes (its own units are n-tiles 2kh, 2kh+1 of the pair's 4).
    const int kh = w & 1, k0 = kh * KSW;

    // W_hh as B fragments: B[k][n] = W_hh[q*H + uu][unit(n)] for k = q*HP + uu, n-tile nt of
    // the pair's warp 2p + nt/2.
    float wscale = 1.0f;
    if constexpr (Mode::SCALED)
        wscale = persist_wscale(a.w_hh, G * H * H, nullptr, 0, reinterpret_cast<float *>(tile));
    const float winv = 1.0f / wscale;
    constexpr bool DWF = DW && Mode::SCALED;
    static_assert(!ZF || DWF, "z from the forward: TF32 mode's chunks");
    constexpr bool XF = DWF && !ZF; // x's scales from the loop's own x, across the barrier
    float hscale = 1.0f;
    if constexpr (DWF)
        hscale = persist_hscale(a, reinterpret_cast<float *>(tile));
    float *xm = rmax + NW * 16; // DWF: [4][16]
#pragma unroll 4
    for (int ks = 0; ks < KSW; ks++) {
        uint32_t o[Gm::B_WPL];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            auto Bf = [&](int k, int n) -> float {
                int unit = persist_unit((w & ~1) + (nt >> 1), nt & 1, n);
                int q = k / HP, uu = k - q * HP;
                return unit < H && uu < H ? __ldg(a.w_hh + (size_t)(q * H + uu) * H + unit)
                                          : 0.0f;
            };
            HM::wpack(o + nt * WPF, Bf, k0 + ks, g, tg, wscale);
        }
        WL::store(wsm, ks, NW, w, lane, o);
    }

    bool rv[2];
    size_t rbase[2], bidx[2];
    persist_rows2(rv, bidx, rbase, a.B, T, g);

    // Carried gradients: dL/dh' (and dL/dc') of the state leaving step t.
    float dh[2][4], dc[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(dh[i]);
        zero4(dc[i]);
        size_t at = (bidx[i] * L + l) * H + u0;
        if (a.gh_n)
            ld4<VEC>(dh[i], a.gh_n + at, u0, H, rv[i]);
        if (a.gc_n)
            ld4<VEC>(dc[i], a.gc_n + at, u0, H, rv[i]);
    }

    // Step t's tape record, output gradient, h entering the step and reset flag. With vector
    // access the record's 16-bit planes stay packed (svh) until the step's top: converted at
    // the load, a step ahead, ptxas waited for the load there (12% of the LSTM loop's stall
    // samples). Since then the loads have a step to land, and v22's fetch of the step after
    // into L2 only cost time (its instructions waited on the memory queue; NOTES v23).
    constexpr int SHP = VEC ? TR::SH : 0;
    float sv[SW][2][4], gy[2][4], hp[2][4], xv[2][4];
    uint2 svh[SHP > 0 ? SHP : 1][2];
    int reset[2];
    int zex[2], zexr; // ZF: x's exponents of rows g, g + 8 and (warp 4's record) of row lane % 16
    // DW: x columns 16w + 2tg, +1, +8, +9 (warps 0-3), so that dw16_put leaves them in order.
    const int xc = 16 * w + 2 * tg;
    auto load_step = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            size_t r = rbase[i] + t;
#pragma unroll
            for (int p = 0; p < SW; p++) {
                if (p < SHP)
                    svh[p][i] = TR::ld4_packed(a.s + r * TR::floats(H), p, u0, H, rv[i]);
                else
                    TR::template ld4<VEC>(sv[p][i], a.s + r * TR::floats(H), p, u0, H, rv[i]);
            }
            ld4<VEC>(gy[i], a.gy + r * a.ldgy + u0, u0, H, rv[i]);
            if constexpr (ZF) {
                zex[i] = rv[i] ? a.zc_ex[((size_t)blockIdx.x * T + t) * 16 + g + 8 * i]
                               : RNND_DW16_EZERO;
                if (i == 0)
                    zexr = a.zc_ex[((size_t)blockIdx.x * T + t) * 16 + (lane & 15)];
            } else if (LSTM && !DW) {
                zero4(hp[i]);
            } else {
                ld4<VEC>(hp[i], a.z + r * a.ldz + u0, u0, H, rv[i]);
            }
            if constexpr (DW && !ZF) {
                const float *x = a.z + r * a.ldz + a.xoff;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int col = xc + (j & 1) + 8 * (j >> 1);
                    xv[i][j] = rv[i] && w < 4 && col < a.Il ? __ldg(x + col) : 0.0f;
                }
            }
            reset[i] = ld_flag(a.is_init + r, rv[i]);
        }
    };
    // DWF: the scale of row r's x (its largest |x| into [2^13, 2^14)) and its exponent ex.
    auto x_scale = [&](int r, int &ex) {
        return dw16_scale(fmaxf(fmaxf(xm[r], xm[16 + r]), fmaxf(xm[32 + r], xm[48 + r])), ex);
    };
    load_step(T - 1);
    // The warp's first k-steps of weights, 48 words a lane, stay in registers (12 of 24 GRU
    // and 32 LSTM k-steps at HP = 128 in TF32 mode); 64 (16 k-steps) where the loop reads no z
    // rows (ZF), in the registers hprev and x took (backward loop 1.01 -> 0.98 ms; 72 spill;
    // NOTES v27); not in the scalar-access loops, which would spill.
    constexpr int BW = ZF ? 64 : 48;
    constexpr int BREG = !VEC ? 0 : KSW < BW / Gm::B_WPL ? KSW : BW / Gm::B_WPL;
    uint32_t wreg[BREG > 0 ? BREG : 1][Gm::B_WPL];
#pragma unroll
    for (int ks = 0; ks < BREG; ks++)
        WL::load(wreg[ks], wsm, ks, NW, w, lane);
    persist_clock<V> clk;
    __syncthreads(); // the weights are in place

    for (int t = T - 1; t >= 0; t--) {
        clk.start();
#pragma unroll
        for (int p = 0; p < SHP; p++)
#pragma unroll
            for (int i = 0; i < 2; i++)
                TR::unpack4(sv[p][i], svh[p][i]);
        // Gate gradients of step t.
        float ddir[2][4], dcp[2][4], tv[G][2][4], dv[4][2][4];
        int ed[2], ex[2]; // DWF: the row halves' D group and x exponents
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float s[SW], d[4], tl[G];
#pragma unroll
                for (int p = 0; p < SW; p++)
                    s[p] = sv[p][i][j];
                float dhj = gy[i][j] + dh[i][j];
                Cell::template backward<true>(s, hp[i][j], dhj, dc[i][j], d, tl, ddir[i][j],
                                              dcp[i][j]);
                // Units past H and rows past B must feed zeros into the MMA.
                bool live = rv[i] && u0 + j < H;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    dv[p][i][j] = d[p];
#pragma unroll
                for (int q = 0; q < G; q++)
                    tv[q][i][j] = live ? tl[q] : 0.0f;
            }
        int rst[2] = {reset[0], reset[1]};
        if constexpr ((V & 8) != 0) {
            persist_wait_for(tv[0][0][0] + tv[G - 1][1][3] + dv[3][1][3], a.dbg);
            clk.mark(0);
        }

#pragma unroll
        for (int i = 0; i < 2; i++) {
            if constexpr (HM::SCALED) {
                float m = 0.0f;
#pragma unroll
                for (int q = 0; q < G; q++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        m = fmaxf(m, fabsf(tv[q][i][j]));
                tile_rowmax_put(rmax, m, w, lane, i);
            } else {
#pragma unroll
                for (int q = 0; q < G; q++)
                    HM::put4(tile + (g + 8 * i) * LDA + q * HP + u0, tv[q][i]);
            }
            if constexpr (DW) {
                // D's 4 planes and z's h part of this row half (rows past B: zeros); bf16
                // mode: x's by warps 0-3, the constant 1 (z's column 192) by warp 4. TF32 mode
                // (DWF): D scaled by group, h by the block's bound; x's group maxima into xm,
                // x and the constant after the barrier (below).
                float ds = 1.0f;
                if constexpr (DWF) {
                    const float *const pl[4] = {dv[0][i], dv[1][i], dv[2][i], dv[3][i]};
                    ds = dw16_dscale(pl, rv[i], ed[i]);
                }
                unsigned char *zc = dw16_put_dh<DWF, !ZF>(
                    a.dw16, a.dw16_pitch, (size_t)blockIdx.x * T + t, w, i, lane, rv[i],
                    [&](int p) -> const float * { return dv[p][i]; }, hp[i], ds, hscale);
                if constexpr (ZF) {
                    (void)zc;
                } else if constexpr (DWF) {
                    if (w < 4) {
                        float m = fmaxf(fmaxf(fabsf(xv[i][0]), fabsf(xv[i][1])),
                                        fmaxf(fabsf(xv[i][2]), fabsf(xv[i][3])));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                        if (tg == 0)
                            xm[w * 16 + g + 8 * i] = m;
                    }
                } else if (w < 4) {
                    dw16_put(zc + (16 + 2 * w) * 256, xv[i], lane);
                } else if (w == 4) {
                    dw16_put_one(zc + 24 * 256, lane);
                }
            } else {
                size_t r = rbase[i] + t;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    st4<VEC>(a.d + r * (4 * H) + p * H + u0, dv[p][i], u0, H, rv[i]);
            }
        }
        if constexpr (ZF)
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane,
                        ed, zex, -pow2_log(hscale), zexr);
        if (t > 0 && !XF && !HM::SCALED)
            load_step(t - 1); // in flight during the MMA
        clk.mark(1);
        __syncthreads();
        if constexpr (XF) {
            // x's rows scaled by their largest |x| (xm: every group's, before the barrier), the
            // constant (the h scale) and the record; then the next step's loads.
            unsigned char *zc = static_cast<unsigned char *>(a.dw16) +
                                4 * (size_t)a.dw16_pitch * RNND_DW16_D +
                                ((size_t)blockIdx.x * T + t) * RNND_DW16_Z;
            int exr;
            x_scale(lane & 15, exr);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float xs = x_scale(g + 8 * i, ex[i]);
                if (w < 4) {
                    const float v[4] = {xv[i][0] * xs, xv[i][1] * xs, xv[i][2] * xs,
                                        xv[i][3] * xs};
                    dw16_put<true>(zc + i * 128 + (16 + 2 * w) * 256, v, lane);
                } else if (w == 4) {
                    __half2 one = __float2half2_rn(hscale);
                    dw16_put_one(zc + i * 128 + 24 * 256, lane,
                                 *reinterpret_cast<uint32_t *>(&one));
                }
            }
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane,
                        ed, ex, -pow2_log(hscale), exr);
            if (t > 0)
                load_step(t - 1); // in flight during the MMA
        }
        // The rows' scales (1 for bf16) and the 16-bit tile.
        float rsc[2] = {1.0f, 1.0f};
        if constexpr (HM::SCALED) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                rsc[i] = tile_row_scale<NW>(rmax, g + 8 * i);
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const float v[4] = {tv[q][i][0] * rsc[i], tv[q][i][1] * rsc[i],
                                        tv[q][i][2] * rsc[i], tv[q][i][3] * rsc[i]};
                    HM::put4(tile + (g + 8 * i) * LDA + q * HP + u0, v);
                }
            }
            if (t > 0 && !XF)
                load_step(t - 1); // in flight during the MMA
            __syncthreads();
        }
        clk.mark(2);

        // dL/dh of the state entering step t: tile . W_hh (+ the direct term), this warp's
        // K half for the pair's 4 n-tiles, then the partner's half of this warp's 2 added.
        float acc[SPLIT][NT][4];
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                zero4(acc[sp][nt]);
#pragma unroll
        for (int ks = 0; ks < KSW; ks++) {
            uint32_t af[4], wv[Gm::B_WPL];
            HM::afrag(af, tile, LDA, k0 + ks, lane);
            if (ks >= BREG)
                WL::load(wv, wsm, ks, NW, w, lane);
            const uint32_t *wp = ks < BREG ? wreg[ks < BREG ? ks : 0] : wv;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                HM::mma(acc[ks % SPLIT][nt], af, HM::wunpack(wp + nt * WPF));
        }
        // mine: the n-tiles of this warp's units (selected, not indexed: kh is not constant).
        float mine[2][4], theirs[2][4];
#pragma unroll
        for (int hf = 0; hf < 2; hf++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float lo = 0.0f, hi = 0.0f;
#pragma unroll
                for (int sp = 0; sp < SPLIT; sp++)
                    lo += acc[sp][hf][e], hi += acc[sp][2 + hf][e];
                mine[hf][e] = kh ? hi : lo;
                theirs[hf][e] = kh ? lo : hi;
            }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(mine[0][0] + theirs[1][3], a.dbg);
            clk.mark(3);
        }
#pragma unroll
        for (int hf = 0; hf < 2; hf++)
            xch[(w * 2 + hf) * 32 + lane] =
                make_float4(theirs[hf][0], theirs[hf][1], theirs[hf][2], theirs[hf][3]);
        asm volatile("bar.sync %0, 64;" ::"r"(1 + (w >> 1)) : "memory"); // the pair only
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float4 v = xch[((w ^ 1) * 2 + hf) * 32 + lane];
            mine[hf][0] += v.x, mine[hf][1] += v.y, mine[hf][2] += v.z, mine[hf][3] += v.w;
        }

        // Route it (docs/design.md): carried to step t-1, or into the gradient of the value the
        // state was reset to (stored states, or h0 at t = 0), or dropped (a zero reset).
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float inv = winv * pow2_inv(rsc[i]);
            float dhp[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                dhp[j] = ddir[i][j] + mine[j >> 1][2 * i + (j & 1)] * inv;
            bool carry = t > 0 && !rst[i];
            if (carry) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    dh[i][j] = dhp[j];
                    dc[i][j] = dcp[i][j];
                }
                continue;
            }
            if (a.stored) {
                size_t at = ((rbase[i] + t) * L + l) * H + u0;
                if (a.g_hidden)
                    st4<VEC>(a.g_hidden + at, dhp, u0, H, rv[i]);
                if (a.g_cell)
                    st4<VEC>(a.g_cell + at, dcp[i], u0, H, rv[i]);
            } else if (!rst[i]) { // t == 0: the initial state
                size_t at = (bidx[i] * L + l) * H + u0;
                if (a.g_h0)
                    st4<VEC>(a.g_h0 + at, dhp, u0, H, rv[i]);
                if (a.g_c0)
                    st4<VEC>(a.g_c0 + at, dcp[i], u0, H, rv[i]);
            }
            zero4(dh[i]);
            zero4(dc[i]);
        }
        clk.mark(4);
        __syncthreads();
        clk.mark(5);
    }
    clk.flush(a.dbg);
}

// ---------------------------------------------------------------------------------------------
// Backward kernel without the gate tape (GRU, v10)

// The unit a storage position of a 16-unit group holds: position 8 half + n holds the unit of
// column n of n-tile `half` (persist_unit), so that 8 consecutive positions are one n-tile.
static __device__ __forceinline__ int persist_rc_unit(int pos) {
    int n = pos & 7, half = (pos >> 3) & 1;
    return (pos & ~15) + 4 * (n >> 1) + 2 * half + (n & 1);
}

// The m16k16 A fragments of a dw16 chunk's columns [c0, c0 + 16), its 16 rows: a core matrix
// holds one column's 8 rows, so ldmatrix.trans gives the row-major fragments (matrix m: column
// group c0 / 8 + m / 2, row half m % 2).
static __device__ __forceinline__ void zc_afrag(uint32_t a[4], const unsigned char *chunk, int c0,
                                                int lane) {
    const int m = lane >> 3;
    ldmatrix_x4_at<true>(a, chunk + (c0 / 8 + (m >> 1)) * 256 + (m & 1) * 128 + (lane & 7) * 16);
}

// One copy of W_hh serves both directions: stored row-major as 16-bit values (fp16 scaled as in
// the forward, or bf16), rows (gate rows) and columns (units) both in storage order
// (persist_rc_unit), pitch HP + 8 elements (16 bytes mod 128: conflict-free ldmatrix). The
// recompute (h W_hh^T) reads it with ldmatrix (rows are n), dh = tile . W_hh with ldmatrix.trans
// (rows are k); both MMAs are m16n8k16 on 16-bit operands, so the dh-gate tile is 16-bit too,
// each row scaled by a power of two (its largest |value| in [2^13, 2^14)) in fp16.
// XM: the mode of the x part: Mode's, or (XH, TF32 mode) HM's on x rows scaled into fp16 per
// row by a power of two, converted from an fp32 stage (XS) between the step's two barriers.
template <class Mode, int HP, class XM = Mode>
struct persist_rc_geom {
    using HM = typename Mode::hmode;
    static constexpr bool XH = !std::is_same<XM, Mode>::value;
    using helem = typename HM::elem;
    static constexpr int G = 3, NW = HP / 16, THREADS = NW * 32;
    static constexpr int WLD = HP + 8;
    static constexpr long W_BYTES = (long)G * HP * WLD * 2;
    static constexpr int XKS = HP / 2 / XM::KSTEP;
    static constexpr int F_NT = 2 * G;
    static constexpr int F_XWPL = F_NT * XM::WPF;
    static constexpr long X_KS_BYTES = (long)F_XWPL * 4 * 32 * NW;
    static constexpr long WX_BYTES = XKS * X_KS_BYTES;
    static constexpr int ALD = G * HP + 8;
    static constexpr long A_BYTES = 16L * ALD * 2;
    static constexpr int HLD = HP + 8;
    static constexpr long H_BYTES = 2 * 16L * HLD * 2; // two steps' tiles (by step parity)
    static constexpr int XLD = HP / 2 + XM::APAD;
    static constexpr long X_BYTES = 2 * 16L * XLD * (long)sizeof(typename XM::elem);
    static constexpr long XS_BYTES = XH ? 16L * (HP / 2) * 4 + 2 * 16 * 4 : 0; // stage, 1/scales
    static constexpr long XCH_BYTES = NW * 2L * 32 * 16;
    static constexpr long RMAX_BYTES = NW * 16L * 4;
    static constexpr long SMEM =
        W_BYTES + WX_BYTES + A_BYTES + H_BYTES + X_BYTES + XS_BYTES + XCH_BYTES + RMAX_BYTES;
    static constexpr int KS = G * HP / 16; // k16-steps of dh = tile . W_hh
    static constexpr int KSW = KS / 2;     // a warp's half (warp pairs split K, as persist_geom)
    static_assert(SMEM <= RNND_PERSIST_SMEM_BUDGET, "rc backward does not fit");
    static_assert(KS % 2 == 0 && NW % 2 == 0, "backward K split needs warp pairs");
};

// Per step in reverse: gate gradients from the recomputed gates (registers) -> D (stores) and the
// 16-bit dh-gate tile; hprev, x of step t-1 into their tiles; barrier; row scales, tile; barrier;
// dh = tile . W_hh (K split over warp pairs) interleaved with the recompute of step t-1's gates
// (h W_hh^T, x W_ih^T: independent of dh); routing; the cell of step t-1.
// Phase clocks (V bit 8, v12): gate gradients and D stores; tile puts, loads and the first
// barrier; row scales, 16-bit tile and the second barrier; both MMAs and the pair exchange;
// routing; the recompute's cell.
// DW: D and z leave as dw16 chunks (seq_persist.h) instead of D in fp32: bf16, or (TF32 mode)
// fp16 with exponent records.
// ZF (with DW): the forward wrote z's chunk parts, in TF32 mode x's exponents (a.zc_ex), and the
// tape's fp16 planes (a.s: the gates' pre-activations and hn), so the loop recomputes nothing
// (NOTES v29): each step's chunk h part and its rows' planes come by bulk copies into one of two
// slots (over W_ih's space), a step ahead; ldmatrix.trans of the h part gives each thread's
// hprev (the chunks' column order is the loop's storage order: NOTES v28), in 16 bits, so the
// cell's (hprev - n) carries fp16's 2^-12 (bf16's 2^-9: NOTES v40). Without the recompute's MMAs
// the registers hold the warp's W_hh fragments for dh. It writes D's parts and the records alone.
// Its dh runs on warpgroup MMAs with the gates beside them (NOTES v31), so it is sm_90a code:
// seq_gru_zf.cu builds it.
template <class Mode, int HP, bool VEC, bool XH, int V = 0, bool DW = false, bool ZF = false>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_backward_rc_kernel(const struct persist_bwd_args a) {
    using HM = typename Mode::hmode;
    using XM = typename std::conditional<XH, HM, Mode>::type;
    using Gm = persist_rc_geom<Mode, HP, XM>;
    using HE = typename Gm::helem;
    using E = typename XM::elem;
    static_assert(!XH || (Gm::THREADS == 256 && HP / 2 == 64), "x stage: a half-warp a row");
    using WLX = persist_wlayout<Gm::F_XWPL>;
    using Cell = cell_gru;
    constexpr int G = Gm::G, NW = Gm::NW, WLD = Gm::WLD, ALD = Gm::ALD, HLD = Gm::HLD;
    constexpr int XLD = Gm::XLD, KSW = Gm::KSW, FNT = Gm::F_NT, SW = Cell::SW;
    constexpr int FKS = HP / 16, XKS = Gm::XKS;

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *at = smem;
    HE *wsm = reinterpret_cast<HE *>(at);
    unsigned char *wsmx = (at += Gm::W_BYTES);
    HE *atile = reinterpret_cast<HE *>(at += Gm::WX_BYTES);
    HE *htile = reinterpret_cast<HE *>(at += Gm::A_BYTES);
    E *xtile = reinterpret_cast<E *>(at += Gm::H_BYTES);
    float *xstage = reinterpret_cast<float *>(at += Gm::X_BYTES);
    float *xinv = xstage + 16 * (HP / 2); // two steps' 16 row inverse scales
    float4 *xch = reinterpret_cast<float4 *>(at += Gm::XS_BYTES);
    float *rmax = reinterpret_cast<float *>(at += Gm::XCH_BYTES);
    // ZF: step s's chunk h part (core-matrix groups 0..15) and its 16 rows' planes (a row
    // ZPL bytes apart: conflict-free 8-byte reads of 8 rows) in slot s & 1, over W_ih's space.
    static_assert(!ZF || DW, "z from the forward: the chunks' loop");
    using TR = tape_rec<Cell, true>;
    constexpr int ZCB = 16 * 256, ZPR = Cell::SW * HP * 2, ZPL = ZPR + 32, ZSL = ZCB + 16 * ZPL;
    static_assert(!ZF || 2 * ZSL + 16 <= Gm::WX_BYTES, "slots");
    static_assert(!ZF || (16L * G * HP * 2 <= Gm::A_BYTES &&
                          NW * 16L * 24 * 4 <= Gm::H_BYTES + Gm::X_BYTES + Gm::XS_BYTES),
                  "ZF: the MMAs' tile, the transposes");
    unsigned char *zslot = wsmx;
    uint64_t *zbar = reinterpret_cast<uint64_t *>(zslot + 2 * ZSL);
    (void)zbar; // sm_90 code only

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l, Il = a.Il, xks = CEIL_DIV(Il, XM::KSTEP);
    const int u0 = w * 16 + 4 * tg;
    const int kh = w & 1, pair = w >> 1;

    // Scales as the forward's: wscale over W_hh and W_ih, hscale for h in its fp16 tile.
    float wscale = 1.0f, hscale = 1.0f;
    if constexpr (Mode::SCALED)
        wscale = persist_wscale(a.w_hh, G * H * H, a.w_ih, G * H * Il,
                                reinterpret_cast<float *>(htile));
    if constexpr (HM::SCALED)
        hscale = persist_hscale(a, reinterpret_cast<float *>(htile));
    const float winv = 1.0f / wscale, hsinv = 1.0f / hscale, hinv = winv * hsinv;

    // W_hh in storage order (pairs of units are adjacent in it), W_ih as the forward's x
    // fragments. Unrolled, for loads in flight (one pair at a time took ~2% of the loop).
#pragma unroll 4
    for (int e = threadIdx.x; e < G * HP * (HP / 2); e += blockDim.x) {
        int pr = e / (HP / 2), pc = 2 * (e - pr * (HP / 2));
        int q = pr / HP, row = persist_rc_unit(pr - q * HP), col = persist_rc_unit(pc);
        float lo = 0.0f, hi = 0.0f;
        if (row < H && col < H) {
            const float *src = a.w_hh + (size_t)(q * H + row) * H + col;
            lo = __ldg(src) * wscale;
            hi = col + 1 < H ? __ldg(src + 1) * wscale : 0.0f;
        }
        *reinterpret_cast<uint32_t *>(wsm + (size_t)pr * WLD + pc) = HM::pack2(lo, hi);
    }
    for (int ks = 0; ks < (ZF ? 0 : xks); ks++) {
        uint32_t o[Gm::F_XWPL];
#pragma unroll
        for (int nt = 0; nt < FNT; nt++) {
            const int q = nt >> 1, half = nt & 1;
            auto Bf = [&](int k, int n) -> float {
                int unit = persist_unit(w, half, n);
                return unit < H && k < Il ? __ldg(a.w_ih + (size_t)(q * H + unit) * Il + k)
                                          : 0.0f;
            };
            XM::wpack(o + nt * XM::WPF, Bf, ks, g, tg, wscale);
        }
        WLX::store(wsmx, ks, NW, w, lane, o);
    }
    float bi[G][4], bh[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        ld4<false>(bi[q], a.b_ih + q * H + u0, u0, H, true);
        ld4<false>(bh[q], a.b_hh + q * H + u0, u0, H, true);
    }
    const int nrows = a.B - (int)blockIdx.x * 16 < 16 ? a.B - (int)blockIdx.x * 16 : 16;
    if constexpr (ZF) { // the planes of rows past B (never copied) stay zero
        for (int e = threadIdx.x; e < 2 * 16 * ZPL / 4; e += blockDim.x) {
            const int sl = e / (16 * ZPL / 4), row = e / (ZPL / 4) % 16;
            if (row >= nrows)
                reinterpret_cast<uint32_t *>(zslot + sl * ZSL + ZCB)[e - sl * (16 * ZPL / 4)] = 0u;
        }
    } else {
        for (int e = threadIdx.x; e < 2 * 16 * XLD; e += blockDim.x)
            XM::put(xtile + e, 0.0f); // the padding past I_l stays zero
        if constexpr (XH)
            for (int e = threadIdx.x; e < 16 * (HP / 2) + 32; e += blockDim.x)
                xstage[e] = e < 16 * (HP / 2) ? 0.0f : 1.0f;
    }

    bool rv[2];
    size_t rbase[2], bidx[2];
    persist_rows2(rv, bidx, rbase, a.B, T, g);
    // The x values this thread moves each step: one float4 of the block's 16 x I_l.
    const int xe = threadIdx.x * 4, xrow = Il > 0 ? xe / Il : 0, xcol = xe - xrow * Il;
    const bool xok = xe < 16 * Il && blockIdx.x * 16 + xrow < a.B;
    const float *xsrc = xok ? a.z + (size_t)(blockIdx.x * 16 + xrow) * T * a.ldz + a.xoff + xcol
                            : nullptr;

    float dh[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(dh[i]);
        if (a.gh_n)
            ld4<VEC>(dh[i], a.gh_n + (bidx[i] * L + l) * H + u0, u0, H, rv[i]);
    }

    // Step t's gates (recomputed), output gradient, hprev and flag; hprev and x of the step
    // the next recompute is for (zh, zx: loaded a step ahead).
    float sv[SW][2][4], gy[2][4], hp[2][4], zh[2][4], zx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int reset[2];
    auto load_gy = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            size_t r = rbase[i] + t;
            ld4<VEC>(gy[i], a.gy + r * a.ldgy + u0, u0, H, rv[i]);
            reset[i] = ld_flag(a.is_init + r, rv[i]);
        }
    };
    auto load_z = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++)
            ld4<VEC>(zh[i], a.z + (rbase[i] + t) * a.ldz + u0, u0, H, rv[i]);
        if (xok) {
            float4 q = __ldg(reinterpret_cast<const float4 *>(xsrc + (size_t)t * a.ldz));
            zx[0] = q.x, zx[1] = q.y, zx[2] = q.z, zx[3] = q.w;
        }
    };
    // zh, zx (of step s) into step s's h and x tiles (h scaled; units in storage order). Two
    // of each: a tile is written in the iteration that reads it, between its two barriers, and
    // the next write of the same one is two iterations later.
    auto put_z = [&](int s) {
        HE *ht = htile + (s & 1) * (16 * HLD);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint32_t *p = reinterpret_cast<uint32_t *>(ht + (g + 8 * i) * HLD + 16 * w + 2 * tg);
            p[0] = HM::pack2(zh[i][0] * hscale, zh[i][1] * hscale);
            p[4] = HM::pack2(zh[i][2] * hscale, zh[i][3] * hscale);
        }
        if (xok) {
            if constexpr (XH)
                *reinterpret_cast<float4 *>(xstage + xrow * (HP / 2) + xcol) =
                    make_float4(zx[0], zx[1], zx[2], zx[3]);
            else
                XM::put4(xtile + (s & 1) * (16 * XLD) + xrow * XLD + xcol, zx);
        }
    };
    // XH: step s's x stage into its fp16 tile, each row scaled (largest |x| in [2^13, 2^14));
    // a half-warp a row, between the step's barriers.
    auto convert_x = [&](int s) {
        if constexpr (XH) {
            const int row = threadIdx.x >> 4, c = 4 * (threadIdx.x & 15);
            float4 v = *reinterpret_cast<const float4 *>(xstage + row * (HP / 2) + c);
            const float inv = persist_row16<HM>(v, xtile + (s & 1) * (16 * XLD) + row * XLD + c);
            if ((threadIdx.x & 15) == 0)
                xinv[(s & 1) * 16 + row] = inv;
        } else {
            (void)s;
        }
    };
    // ZF: step s's chunk into its slot (one thread issues the bulk copy; it is the slot's
    // ((T - 1 - s) / 2)-th), the wait for it, and hprev from it (this thread's units of rows g,
    // g + 8: the A fragments of the warp's 16 columns). zex, zexr: step t's x exponents (rows g,
    // g + 8; warp 4's record: row lane % 16), nzex, nzexr step t - 1's.
    int zex[2] = {0, 0}, zexr = 0, nzex[2] = {0, 0}, nzexr = 0;
    auto zc_fetch = [&](int s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        unsigned char *sl = zslot + (s & 1) * ZSL;
        if (threadIdx.x == 0) {
            mbar_expect_tx(zbar + (s & 1), ZCB + nrows * ZPR);
            mbar_arrive(zbar + (s & 1));
            bulk_g2s(sl,
                     static_cast<const unsigned char *>(a.zc) +
                         ((size_t)blockIdx.x * T + s) * RNND_DW16_Z,
                     ZCB, zbar + (s & 1));
        }
        // Row 2w + lane's planes: two copies a warp (the 16 from warp 0 held it ~900 cycles,
        // and every warp with it at the next barrier).
        const int row = 2 * w + lane;
        if (lane < 2 && row < nrows)
            bulk_g2s(sl + ZCB + row * ZPL,
                     a.s + ((size_t)(blockIdx.x * 16 + row) * T + s) * TR::floats(HP), ZPR,
                     zbar + (s & 1));
#else
        (void)s;
        __trap(); // never launched: ZF needs sm_90 (the launcher's cuda_has_wg)
#endif
    };
    auto zc_wait = [&](int s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        mbar_wait(zbar + (s & 1), ((T - 1 - s) >> 1) & 1);
#else
        (void)s;
#endif
    };
    auto zc_load_ex = [&](int s) {
        if constexpr (XH) {
            const int16_t *e = a.zc_ex + ((size_t)blockIdx.x * T + s) * 16;
            nzex[0] = e[g], nzex[1] = e[g + 8], nzexr = e[lane & 15];
        }
    };
    auto zc_hprev = [&](int s) {
        uint32_t f[4];
        zc_afrag(f, zslot + (s & 1) * ZSL, 16 * w, lane);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float2 lo = HM::unpack2(f[i]), up = HM::unpack2(f[2 + i]);
            hp[i][0] = lo.x * hsinv, hp[i][1] = lo.y * hsinv;
            hp[i][2] = up.x * hsinv, hp[i][3] = up.y * hsinv;
        }
    };
    // ZF: step s's gates from its planes in the slot (rows g, g + 8, units u0..u0+3).
    auto zc_cell = [&](int s) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const unsigned char *row = zslot + (s & 1) * ZSL + ZCB + (g + 8 * i) * ZPL;
            float v[SW][4];
#pragma unroll
            for (int p = 0; p < SW; p++)
                TR::unpack4(v[p], *reinterpret_cast<const uint2 *>(row + (p * HP + u0) * 2));
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = Cell::template gate<true>(p, v[p][j]);
        }
    };
    float acc[FNT][4], accx[FNT][4];
    // h W_hh^T and x W_ih^T of the tiles' step, as the forward's (warp w: its 16 units of each
    // gate; n-tile 2q + half).
    auto gates_mma = [&](int s) {
        const HE *ht = htile + (s & 1) * (16 * HLD);
        const E *xt = xtile + (s & 1) * (16 * XLD);
#pragma unroll
        for (int nt = 0; nt < FNT; nt++) {
            zero4(acc[nt]);
            zero4(accx[nt]);
        }
        const int m = lane >> 3, r = lane & 7;
#pragma unroll
        for (int ks = 0; ks < FKS; ks++) {
            uint32_t af[4];
            ldmatrix_x4(af, ht, HLD, ks * 16, 8, lane);
#pragma unroll
            for (int q = 0; q < G; q++) {
                uint32_t b[4];
                ldmatrix_x4_at<false>(
                    b, wsm + (size_t)(q * HP + 16 * w + 8 * (m >> 1) + r) * WLD + ks * 16 + 8 * (m & 1));
                HM::mma(acc[2 * q], af, make_uint2(b[0], b[1]));
                HM::mma(acc[2 * q + 1], af, make_uint2(b[2], b[3]));
            }
        }
        persist_xmma<XM, WLX, XKS>(accx, xt, XLD, wsmx, xks, NW, w, lane);
    };
    // The forward's cell on those sums: the step's gates r, z, n, hn.
    auto gates_cell = [&](int st) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float xw = XH ? winv * xinv[(st & 1) * 16 + g + 8 * i] : winv;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float xq[G], hq[G], s[SW], hn, cn;
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const int nt = 2 * q + (j >> 1), e = 2 * i + (j & 1);
                    xq[q] = accx[nt][e] * xw + bi[q][j];
                    hq[q] = acc[nt][e] * hinv + bh[q][j];
                }
                Cell::template forward<true, true, XH>(xq, hq, 0.0f, 0.0f, hn, cn, s);
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = s[p];
            }
        }
    };

    // Step T-1's gates before the loop.
    __syncthreads(); // the x tiles' zeros before their first values
    load_gy(T - 1);
    if constexpr (ZF) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (threadIdx.x == 0) {
            mbar_init(zbar, 1), mbar_init(zbar + 1, 1);
            fence_mbar_init();
        }
#endif
        __syncthreads(); // weights in place, the slots' mbarriers ready
        zc_fetch(T - 1);
        if (T > 1)
            zc_fetch(T - 2);
        zc_load_ex(T - 1);
        zc_wait(T - 1);
        zc_hprev(T - 1);
        zc_cell(T - 1);
    } else {
        load_z(T - 1);
        put_z(T - 1);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                hp[i][j] = zh[i][j];
        if (T > 1)
            load_z(T - 2);
        __syncthreads(); // weights and tiles in place
        if constexpr (XH) {
            convert_x(T - 1);
            __syncthreads();
        }
        gates_mma(T - 1);
        gates_cell(T - 1);
    }
    zex[0] = nzex[0], zex[1] = nzex[1], zexr = nzexr;
    // dh's B fragments (W_hh rows kk 16.., the pair's columns), from shared memory.
    const int bm = lane >> 3, br = lane & 7;
    auto dh_b = [&](uint32_t b[4], int ks, int j) {
        const int kk = kh * KSW + ks;
        ldmatrix_x4_at<true>(b, wsm + (size_t)(kk * 16 + 8 * (bm & 1) + br) * WLD +
                                    16 * (2 * pair + j) + 8 * (bm >> 1));
    };
    // ZF: dh^T = W_hh^T tile^T on warpgroup MMAs (m64n16k16; sm_90a, NOTES v31). Warpgroup
    // w / 4 takes output positions [64 (w / 4), +64) as its M rows, warp w its 16 (rows g, g + 8:
    // positions 16 w + g, + 8); its A fragments, W_hh^T over all 2 KSW k-steps, stay in
    // registers (ldmatrix.trans of W_hh's rows k: a0 = positions 16 w + g at k = 16 ks + 2 tg,
    // + 1; a1 the positions + 8; a2, a3 the same at k + 8). The tile is the B operand, K-major in
    // core matrices (km_off), rows the batch rows.
    uint32_t wa[ZF ? 2 * KSW : 1][4];
    if constexpr (ZF) {
#pragma unroll
        for (int ks = 0; ks < 2 * KSW; ks++)
            ldmatrix_x4_at<true>(wa[ks], wsm + (size_t)(16 * ks + br + 8 * (bm >> 1)) * WLD +
                                             16 * w + 8 * (bm & 1));
    }
    persist_clock<V> clk;

    for (int t = T - 1; t >= 0; t--) {
        clk.start();
        // Gate gradients of step t, the row maxima of the tile part.
        float ddir[2][4], tv[G][2][4];
        float rm[2] = {0.0f, 0.0f};
        int ed[2]; // DW, TF32 mode: the exponents of this warp's groups of the two row halves
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float dv[4][4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float s[SW], d[4], tl[G], dcp;
#pragma unroll
                for (int p = 0; p < SW; p++)
                    s[p] = sv[p][i][j];
                Cell::template backward<true, true>(s, hp[i][j], gy[i][j] + dh[i][j], 0.0f, d, tl,
                                              ddir[i][j], dcp);
                bool live = rv[i] && u0 + j < H;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    dv[p][j] = d[p];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    tv[q][i][j] = live ? tl[q] : 0.0f;
                    rm[i] = fmaxf(rm[i], fabsf(tv[q][i][j]));
                }
            }
            if constexpr (DW) {
                // D's 4 planes and z's h part of this row half (rows past B: zeros); in TF32
                // mode D scaled by its (row, warp) group's power of two (shuffles over the 4
                // lanes of the row: no barrier), h by the block's.
                float ds = 1.0f;
                if constexpr (XH) {
                    const float *const pl[4] = {dv[0], dv[1], dv[2], dv[3]};
                    ds = dw16_dscale(pl, rv[i], ed[i]);
                }
                dw16_put_dh<XH, !ZF>(a.dw16, a.dw16_pitch, (size_t)blockIdx.x * T + t, w, i,
                                     lane, rv[i], [&](int p) -> const float * { return dv[p]; },
                                     hp[i], ds, XH ? hscale : 1.0f);
            } else {
                size_t r = rbase[i] + t;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    st4<VEC>(a.d + r * (4 * H) + p * H + u0, dv[p], u0, H, rv[i]);
            }
        }
        if constexpr (ZF && XH)
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane,
                        ed, zex, -pow2_log(hscale), zexr);
        if constexpr (DW && !ZF) {
            // z's x part (columns 128..191: the x tile of step t, zero past I_l and B) by warps
            // 0-3, two 8-column groups each, with ldmatrix.trans: lane l gets rows 2(l%4),
            // 2(l%4)+1 of column l/4 of each 8 x 8 matrix, as dw16_put stores them; warp 4 the
            // constant 1 (column 192) and zeros.
            unsigned char *zc = static_cast<unsigned char *>(a.dw16) +
                                4 * (size_t)a.dw16_pitch * RNND_DW16_D +
                                ((size_t)blockIdx.x * T + t) * RNND_DW16_Z;
            if (w < 4) {
                const int mi = lane >> 3, cg = 2 * w + (mi & 1), kh = mi >> 1;
                uint32_t m4[4];
                ldmatrix_x4_at<true>(m4, xtile + (t & 1) * (16 * XLD) +
                                             (8 * kh + (lane & 7)) * XLD + 8 * cg);
#pragma unroll
                for (int q = 0; q < 4; q++)
                    *reinterpret_cast<uint32_t *>(zc + (16 + 2 * w + (q & 1)) * 256 +
                                                  (q >> 1) * 128 + 4 * lane) = m4[q];
            } else if (w == 4) {
                uint32_t one = 0x3F803F80u;
                if constexpr (XH) {
                    __half2 v = __float2half2_rn(hscale);
                    one = *reinterpret_cast<uint32_t *>(&v);
                }
                dw16_put_one(zc + 24 * 256, lane, one);
                dw16_put_one(zc + 24 * 256 + 128, lane, one);
            }
            if constexpr (XH) { // x = x' xinv: ex is log2 of step t's xinv (0: a zero row)
                const float *xi = xinv + (t & 1) * 16;
                auto x_exp = [](float v) { return v > 0.0f ? pow2_log(v) : RNND_DW16_EZERO; };
                const int ex[2] = {x_exp(xi[g]), x_exp(xi[g + 8])};
                dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w,
                            lane, ed, ex, -pow2_log(hscale), x_exp(xi[lane & 15]));
            }
        }
        if constexpr (HM::SCALED) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                tile_rowmax_put(rmax, rm[i], w, lane, i);
        }
        clk.mark(0);
        int rst[2] = {reset[0], reset[1]};
        if (t > 0 && ZF) {
            load_gy(t - 1);
            zc_load_ex(t - 1);
        } else if (t > 0) {
            put_z(t - 1); // step t-1's hprev and x
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    hp[i][j] = zh[i][j];
            load_gy(t - 1);
            if (t > 1)
                load_z(t - 2);
        }
        __syncthreads();
        clk.mark(1);

        if constexpr (ZF) {
            if (t > 1) // into step t's slot, whose reads (the iteration before) are done
                zc_fetch(t - 2);
        } else if (t > 0) {
            convert_x(t - 1);
        }
        // Row scales, then the 16-bit tile (units in storage order).
        float rsc[2] = {1.0f, 1.0f};
        if constexpr (HM::SCALED) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                rsc[i] = tile_row_scale<NW>(rmax, g + 8 * i);
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int q = 0; q < G; q++) {
                const uint32_t lo = HM::pack2(tv[q][i][0] * rsc[i], tv[q][i][1] * rsc[i]);
                const uint32_t hi = HM::pack2(tv[q][i][2] * rsc[i], tv[q][i][3] * rsc[i]);
                const int row = g + 8 * i, k = q * HP + 16 * w + 2 * tg;
                if constexpr (ZF) {
                    unsigned char *tb = reinterpret_cast<unsigned char *>(atile);
                    *reinterpret_cast<uint32_t *>(tb + km_off(row, k, G * HP / 8)) = lo;
                    *reinterpret_cast<uint32_t *>(tb + km_off(row, k + 8, G * HP / 8)) = hi;
                } else {
                    uint32_t *p = reinterpret_cast<uint32_t *>(atile + row * ALD + k);
                    p[0] = lo, p[4] = hi;
                }
            }
        if constexpr (ZF)
            fence_proxy_async(); // the MMAs read the tile through the async proxy
        __syncthreads();
        clk.mark(2);

        // dL/dh of the state entering step t (tile . W_hh), this thread's rows g, g + 8 and units
        // u0..u0+3 (positions 16 w + 2 tg + (j & 1) + 8 (j >> 1)): dsum[i][j].
        float dsum[2][4];
        if constexpr (ZF) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            // Four accumulator chains (one chain waits ~65 cycles a k-step: NOTES v19); step
            // t-1's hprev and gates (hp of step t is used) while the MMAs run.
            float dacc[4][8];
            const uint64_t bd = wg_desc(atile, G * HP / 8 * 128);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 2 * KSW; ks++) {
                if (ks < 4)
                    wg_mma_rs<false, !HM::SCALED>(dacc[ks & 3], wa[ks], bd + 16 * ks);
                else
                    wg_mma_rs<true, !HM::SCALED>(dacc[ks & 3], wa[ks], bd + 16 * ks);
            }
            wg_commit();
            if (t > 0) {
                zc_wait(t - 1);
                zc_hprev(t - 1);
                zc_cell(t - 1);
            }
            wg_wait<0>();
#pragma unroll
            for (int c = 0; c < 4; c++)
                wg_pin(dacc[c]);
            // To the cell's layout through this warp's [position][row] block (pitch 24 floats:
            // conflict-free pairs), over the h and x tiles, which ZF does not use.
            float *tb = reinterpret_cast<float *>(htile) + w * (16 * 24);
            auto chains = [&](int e) {
                return (dacc[0][e] + dacc[1][e]) + (dacc[2][e] + dacc[3][e]);
            };
#pragma unroll
            for (int e = 0; e < 8; e += 2) { // (position g or g + 8, rows 2 tg, + 1 or + 8, + 9)
                const int pos = g + 8 * ((e >> 1) & 1), row = 2 * tg + 8 * (e >> 2);
                *reinterpret_cast<float2 *>(tb + pos * 24 + row) =
                    make_float2(chains(e), chains(e + 1));
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dsum[i][j] = tb[(2 * tg + (j & 1) + 8 * (j >> 1)) * 24 + g + 8 * i];
#else
            __trap(); // never built: seq_gru_zf.cu builds the ZF loop for sm_90a alone
#endif
        } else {
            if (t > 0)
                gates_mma(t - 1); // independent of dh: more work for the tensor pipe to overlap
            // This warp's K half for the pair's 4 n-tiles (n-tile 2j + half: units of warp
            // 2 pair + j), the partner's half of its 2 added.
            float bacc[2][4][4];
#pragma unroll
            for (int sp = 0; sp < 2; sp++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    zero4(bacc[sp][nt]);
#pragma unroll
            for (int ks = 0; ks < KSW; ks++) {
                uint32_t af[4];
                ldmatrix_x4(af, atile, ALD, (kh * KSW + ks) * 16, 8, lane);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    uint32_t b[4];
                    dh_b(b, ks, j);
                    HM::mma(bacc[ks & 1][2 * j], af, make_uint2(b[0], b[1]));
                    HM::mma(bacc[ks & 1][2 * j + 1], af, make_uint2(b[2], b[3]));
                }
            }
            float mine[2][4], theirs[2][4];
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float lo = bacc[0][hf][e] + bacc[1][hf][e];
                    float hi = bacc[0][2 + hf][e] + bacc[1][2 + hf][e];
                    mine[hf][e] = kh ? hi : lo;
                    theirs[hf][e] = kh ? lo : hi;
                }
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                xch[(w * 2 + hf) * 32 + lane] =
                    make_float4(theirs[hf][0], theirs[hf][1], theirs[hf][2], theirs[hf][3]);
            asm volatile("bar.sync %0, 64;" ::"r"(1 + pair) : "memory"); // the pair only
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float4 v = xch[((w ^ 1) * 2 + hf) * 32 + lane];
                mine[hf][0] += v.x, mine[hf][1] += v.y, mine[hf][2] += v.z, mine[hf][3] += v.w;
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dsum[i][j] = mine[j >> 1][2 * i + (j & 1)];
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(dsum[0][0] + dsum[1][3] + acc[0][0] + accx[FNT - 1][3], a.dbg);
            clk.mark(3);
        }

        // Route it (docs/design.md "The math"), as seq_backward_kernel does.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float inv = winv * pow2_inv(rsc[i]);
            float dhp[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                dhp[j] = ddir[i][j] + dsum[i][j] * inv;
            bool carry = t > 0 && !rst[i];
            if (carry) {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dh[i][j] = dhp[j];
                continue;
            }
            if (a.stored) {
                size_t at = ((rbase[i] + t) * L + l) * H + u0;
                if (a.g_hidden)
                    st4<VEC>(a.g_hidden + at, dhp, u0, H, rv[i]);
            } else if (!rst[i]) { // t == 0: the initial state
                size_t at = (bidx[i] * L + l) * H + u0;
                if (a.g_h0)
                    st4<VEC>(a.g_h0 + at, dhp, u0, H, rv[i]);
            }
            zero4(dh[i]);
        }
        clk.mark(4);
        if (!ZF && t > 0)
            gates_cell(t - 1);
        zex[0] = nzex[0], zex[1] = nzex[1], zexr = nzexr;
        if constexpr ((V & 8) != 0) {
            persist_wait_for(sv[0][0][0] + sv[SW - 1][1][3], a.dbg);
            clk.mark(5);
        }
    }
    clk.flush(a.dbg);
}

// The x part in row-scaled fp16 in TF32 mode (v10b: XH), in bf16 as it is (bf16 mode).
template <class Mode, int HP>
static long persist_rc_smem() {
    using HM = typename Mode::hmode;
    constexpr bool XH = HM::SCALED;
    return XH ? persist_rc_geom<Mode, HP, HM>::SMEM : persist_rc_geom<Mode, HP>::SMEM;
}

template <class Mode, int HP>
static int persist_launch_backward_rc(const struct persist_bwd_args &a, cudaStream_t stream) {
    constexpr bool XH = Mode::hmode::SCALED;
    if (a.Il > HP / 2 || a.Il % 4 != 0 || a.w_ih == nullptr)
        return RNND_EINVAL;
    auto kernel = a.vec ? seq_backward_rc_kernel<Mode, HP, true, XH>
                        : seq_backward_rc_kernel<Mode, HP, false, XH>;
    if (a.dw16) { // vector access or (ZF) any; TF32 mode with the records
        if constexpr (HP != 128)
            return RNND_EINVAL;
        else if ((!a.vec && !a.zc) || a.H != HP || (a.dw16_exp != nullptr) != XH ||
                 (a.zc && (!a.s || (a.zc_ex != nullptr) != XH)))
            return RNND_EINVAL;
        else if (a.zc) // z from the forward (any gradients' alignment): sm_90a code
#ifdef RNND_HAVE_WG
            return rnnd__wg_gru_backward_zf(&a, !XH, stream);
#else
            return RNND_EINVAL;
#endif
        else
            kernel = seq_backward_rc_kernel<Mode, HP, true, XH, 0, true>;
    }
    if constexpr (XH) // bench variant bit 8: phase clocks (TF32, vector access)
        if (a.vec && (a.variant & 8))
            kernel = seq_backward_rc_kernel<Mode, HP, true, XH, 8>;
    long smem = persist_rc_smem<Mode, HP>();
    RNND_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem));
    kernel<<<CEIL_DIV(a.B, 16), persist_rc_geom<Mode, HP>::THREADS, smem, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Launchers, one per (cell, mode, HP): raise the shared-memory limit, launch, check.

// KP: the K split over warp pairs with the x part a step ahead (fused, vector access only; the
// caller checks).
template <class Cell, class Mode, int HP, int V = 0, bool KP = false>
static int persist_launch_forward(const struct persist_fwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    int xks = a.xks > 0 && a.xks <= Gm::F_XKS ? a.xks : 0;
    if (a.xks != xks || (xks == 0 && a.xg == nullptr))
        return RNND_EINVAL;
    if constexpr (KP) {
        if (!xks || !a.vec)
            return RNND_EINVAL;
        auto kernel = seq_forward_kernel<Cell, Mode, HP, true, true, V, true>;
        long smem = Gm::f_smem_kpxa();
        RNND_CUDA_TRY(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kernel<<<CEIL_DIV(a.B, 16), 2 * Gm::THREADS, smem, stream>>>(a);
        CUDA_LAUNCH_CHECK();
        return 0;
    }
    // Variants exist with vector access only (the dispatcher asks for them only then).
    auto kernel = xks ? seq_forward_kernel<Cell, Mode, HP, true, true, V>
                      : seq_forward_kernel<Cell, Mode, HP, true, false, V>;
    if constexpr (V == 0)
        if (!a.vec)
            kernel = xks ? seq_forward_kernel<Cell, Mode, HP, false, true>
                         : seq_forward_kernel<Cell, Mode, HP, false, false>;
    long smem = Gm::f_smem(xks);
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, smem, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <class Cell, class Mode, int HP, int V = 0>
static int persist_launch_backward(const struct persist_bwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    auto kernel = seq_backward_kernel<Cell, Mode, HP, true, V>;
    if constexpr (V == 0)
        if (!a.vec)
            kernel = seq_backward_kernel<Cell, Mode, HP, false, 0>;
    long smem = Gm::B_SMEM;
    if (a.dw16) { // the LSTM; vector access or (ZF) any; TF32 with records
        // Phase clocks (V) in the loop on the forward's z alone.
        if constexpr (Gm::G != 4 || HP != 128)
            return RNND_EINVAL;
        else if ((!a.vec && !a.zc) || a.H != HP || (a.dw16_exp != nullptr) != Mode::SCALED ||
                 (a.zc && (!Mode::SCALED || !a.zc_ex)) || (V != 0 && !(a.vec && a.zc)))
            return RNND_EINVAL;
        else if constexpr (Mode::SCALED) // z from the forward: any gradients' alignment
            kernel = !a.zc  ? seq_backward_kernel<Cell, Mode, HP, true, 0, true>
                     : a.vec  ? seq_backward_kernel<Cell, Mode, HP, true, V, true, true>
                              : seq_backward_kernel<Cell, Mode, HP, false, 0, true, true>;
        else
            kernel = seq_backward_kernel<Cell, Mode, HP, true, 0, true>;
        smem += Mode::SCALED && !a.zc ? 4 * 16 * sizeof(float) : 0; // xm
    }
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, smem, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// The TF32 H=128 loops with vector access: the fused GRU forward with K split over warp pairs
// and the x part a step ahead (v12, v13), and bench variant bit 8 (phase clocks)
// (docs/journal); RNND_ENOTSUP where neither applies.
template <class Cell>
static int persist_launch_variant(bool backward, const void *args, cudaStream_t stream) {
    if (backward) {
        const persist_bwd_args &a = *static_cast<const persist_bwd_args *>(args);
        return a.vec && (a.variant & 8) ? persist_launch_backward<Cell, mode_tf32, 128, 8>(a, stream)
                                        : RNND_ENOTSUP;
    }
    const persist_fwd_args &a = *static_cast<const persist_fwd_args *>(args);
    if (!a.vec)
        return RNND_ENOTSUP;
    if constexpr (persist_geom<Cell, mode_tf32, 128>::F_KP)
        if (a.xks > 0)
            return a.variant & 8 ? persist_launch_forward<Cell, mode_tf32, 128, 8, true>(a, stream)
                                 : persist_launch_forward<Cell, mode_tf32, 128, 0, true>(a, stream);
    return a.variant & 8 ? persist_launch_forward<Cell, mode_tf32, 128, 8>(a, stream)
                         : RNND_ENOTSUP;
}

// Shared memory of one launch (forward with xks fused x k-steps), or -1 when xks is more than
// the loop takes.
template <class Cell, class Mode, int HP>
static long persist_smem(bool backward, int xks) {
    using Gm = persist_geom<Cell, Mode, HP>;
    if (backward)
        return Gm::B_SMEM;
    if (xks < 0 || xks > Gm::F_XKS)
        return -1;
    // KP: its own layout (the x part a step ahead needs two stages and the x slots).
    return Gm::F_KP && xks > 0 ? Gm::f_smem_kpxa() : Gm::f_smem(xks);
}

#endif // RNND_CUDA_SEQ_PERSIST_CUH
