/*
 * seq_prims.cuh: the building blocks of the persistent time loops (seq_forward.cuh,
 * seq_backward.cuh, seq_gru_backward.cuh, seq_wg.cu, seq_cluster.cu) and of the step kernels:
 * the matmul modes (TF32 m16n8k8 or bf16 m16n8k16 tensor-core MMAs with fp32 accumulation, and
 * the fp16 h part of TF32 mode), the loops' geometry (warps, k-steps, shared memory), weight
 * fragments in shared memory, the power-of-two scales that put fp32 values into fp16 without
 * losing TF32's bits, 16-byte element access, and the phase clocks of profiling builds.
 *
 * Parallel mapping of the mma.sync loops (both directions). A block owns 16 batch rows for all
 * T steps; rows are independent, so blocks never talk to each other. It has HP/16 warps (HP: H
 * rounded up to a multiple of 32; units past H are zero weights and zero state, so they stay
 * 0); warp w owns hidden units [16w, 16w+16) for every gate, and lane (g = lane/4, tg = lane%4)
 * owns rows {g, g+8} and the four consecutive units u0 = 16w + 4tg .. u0+3: eight (row, unit)
 * elements whose gates, state and gradients live in its registers for the whole loop. The column
 * order of each warp's n-tiles is permuted so that an MMA accumulator fragment lands exactly on
 * those elements (the C fragment of n-tile `half` holds columns 2tg, 2tg+1, which we map to
 * units u0 + 2*half + {0,1}), so the cell math needs no shared-memory round trip and global
 * accesses are 16-byte vectors.
 *
 * Weights are loaded once per launch into shared memory, pre-arranged as per-lane MMA B
 * fragments. In TF32 mode they are stored as fp16 scaled by a power of two (the largest |w| of
 * the launch lands in [2^14, 2^15)) and widened to fp32 when a fragment is read: fp16 keeps the
 * 10 mantissa bits TF32 keeps, so the products are TF32 products (for every weight within 2^28
 * of the largest; smaller ones are rounded to that absolute grid), and the weights take half the
 * space and half the shared-memory bandwidth. The accumulators are scaled back exactly.
 */
#ifndef RNND_CUDA_SEQ_PRIMS_CUH
#define RNND_CUDA_SEQ_PRIMS_CUH

#include "common.cuh"
#include "seq_chunks.h"
#include "seq_loops.h"
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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(g), "r"(ok ? 16 : 0)
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
    using elem = float;     // tf32 values kept in fp32 bit patterns
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
    static constexpr int F_HWPL = F_NT * HM::WPF;      // weight words a lane reads per k-step
    static constexpr int F_XWPL = F_NT * Mode::WPF;
    static constexpr long F_HKS_BYTES = (long)F_HWPL * 4 * 32 * NW;
    static constexpr long F_XKS_BYTES = (long)F_XWPL * 4 * 32 * NW;
    static constexpr int F_HLD = HP + HM::APAD;
    static constexpr int f_xld(int xks) {
        return xks * Mode::KSTEP + Mode::APAD;
    }
    static constexpr long f_wbytes(int xks) {
        return F_KS * F_HKS_BYTES + xks * F_XKS_BYTES;
    }
    static constexpr long F_HTILES_BYTES = 2L * 16 * F_HLD * (long)sizeof(helem);
    static constexpr long f_smem(int xks) {
        return f_wbytes(xks) + F_HTILES_BYTES +
               (xks ? 2L * 16 * f_xld(xks) * (long)sizeof(elem) : 0);
    }
    // The forward with K split over warp pairs (KP): the GRU's fused TF32 loop at HP = 128
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
    // Behind those (the x part a step ahead): the x partial sums of the h-warps' rows in
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
    // The dh MMAs run in HM, 16-bit: TF32 mode's tile is fp16 with a scale a row (docs/kernels.md).
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

// The backward loops' 16-row dh tiles in fp16, a scale a row (docs/kernels.md): each warp puts its
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

// A row of 64 N fp32 values held by a half-warp (N runs of 4 consecutive values a lane) into
// 16-bit HM values at dst[k] (this lane's run k), the row scaled by the power of two that puts its
// largest |value| in [2^13, 2^14): as exact as TF32 for every value within 2^27 of the largest.
// Returns 1/scale, or 0 for a row of zeros (whose products are 0 either way; the dw16 records
// tell it by that). In bf16 (HM unscaled, fp32's range) the row goes as it is and 1 comes back.
template <class HM, int N>
static __device__ __forceinline__ float persist_row16(const float4 (&v)[N], void *const (&dst)[N]) {
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < N; k++)
        m = fmaxf(m,
                  fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w))));
    if constexpr (HM::SCALED)
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float sc = HM::SCALED ? persist_pow2_for(m, 14) : 1.0f;
#pragma unroll
    for (int k = 0; k < N; k++)
        *reinterpret_cast<uint2 *>(dst[k]) =
            make_uint2(HM::pack2(v[k].x * sc, v[k].y * sc), HM::pack2(v[k].z * sc, v[k].w * sc));
    return !HM::SCALED ? 1.0f : m != 0.0f ? 1.0f / sc : 0.0f;
}
template <class HM>
static __device__ __forceinline__ float persist_row16(float4 v, void *dst) {
    const float4 vs[1] = {v};
    void *const ds[1] = {dst};
    return persist_row16<HM, 1>(vs, ds);
}

// max |p[i]| over this thread's share of p[0..n) (the block's threads stride it; 0 for n = 0):
// 16-byte loads where p is 16-byte aligned, then single floats for the rest, four loads in flight.
// Every block reads its weights so at its start; with single floats, and one load in flight for
// W_ih, that took ~5% of a 0.8 ms loop (docs/kernels.md).
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
static __device__ float persist_wscale(const float *a, int na, const float *b, int nb, float *red) {
    return persist_pow2_scale(fmaxf(persist_absmax(a, na), persist_absmax(b, nb)), 15, red);
}

// The scale of h in the forward's fp16 A tile: every h the block's rows can hold is at most
// max(1, |h0|, |stored states|) (a GRU's h' is a convex combination of h and n in [-1, 1], an
// LSTM's h' = o tanh(c')), which this puts in [2^13, 2^14), far from fp16's overflow at 65504.
// Only the stored states and h0 of layer l of the block's own rows are read (none when absent).
// The GRU backward that recomputes its gates uses the same bound for the hprev it recomputes
// from; the backward loops of a layer above 0 for its x (layer l - 1's h).
template <class A>
static __device__ float persist_hscale(const A &a, int l, float *red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int steps = a.hidden ? a.T : a.h0 ? 1 : 0;
    float m = 1.0f;
    for (int rt = w; rt < 16 * steps; rt += nw) { // a warp per (row, step)
        int row = rt / steps, t = rt - row * steps, b = blockIdx.x * 16 + row;
        if (b >= a.B)
            break;
        for (int u = lane; u < a.H; u += 32) {
            if (a.hidden)
                m = fmaxf(m, fabsf(__ldg(a.hidden + (((size_t)b * a.T + t) * a.L + l) * a.H + u)));
            if (t == 0 && a.h0)
                m = fmaxf(m, fabsf(__ldg(a.h0 + ((size_t)b * a.L + l) * a.H + u)));
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
// Phase clocks, in profiling builds alone (CMake option RNND_CUDA_PHASE_CLOCKS; the bench's
// variant bit RNND_TUNE_PHASE_CLOCKS asks for them): the loops' instances with V = SEQ_CLOCKS
// add warp 0's clock cycles per phase of each step into a.dbg (docs/kernels.md lists the
// phases). Other instances (V = 0) count nothing, and other builds have no such instance.
#ifdef RNND_CUDA_PHASE_CLOCKS
#define SEQ_CLOCKS 8
#endif
template <int V>
struct persist_clock {
#ifdef RNND_CUDA_PHASE_CLOCKS
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
#else
    static_assert(V == 0, "phase clocks are built with RNND_CUDA_PHASE_CLOCKS only");
    __device__ __forceinline__ void start() {}
    __device__ __forceinline__ void mark(int) {}
    __device__ __forceinline__ void flush(long long *) {}
#endif
};

// Makes warp 0 wait for v (so that a phase clock includes the latency that produced it).
static __device__ __forceinline__ void persist_wait_for(float v, long long *dbg) {
    if (__float_as_uint(v) == 0x7fc0dead && dbg)
        dbg[0] = 0;
}

#endif // RNND_CUDA_SEQ_PRIMS_CUH
