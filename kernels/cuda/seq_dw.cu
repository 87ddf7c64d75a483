/*
 * seq_dw.cu: the weight gradients' product out = z^T D over every row and step, on warpgroup
 * MMAs (wgmma, sm_90a only: built for that target alone, asked for only on compute 9.0), from
 * the chunks that the GRU's recomputing backward and the LSTM's backward write (seq_chunks.h,
 * dw16): bf16 in bf16 mode, fp16 with exponent records in TF32 mode (docs/kernels.md).
 *
 * Why: at B = 2048, T = 256, H = 128 cuBLAS takes 0.58 ms on the fp32 D and z (1.49 GB, at DRAM
 * speed), and 0.50 on the same values in 16 bits, row-major. Chunks laid out for the MMA and
 * fetched by bulk copies take 0.27 ms (0.747 GB at 2.76 TB/s; docs/kernels.md, probes/dw16.cu).
 *
 * Shape: CTA (plane p, K range s): D's plane p (M = 128 columns) against all of z's N = 200
 * columns (264 where x is 128 wide) over its chunks (K = 16 rows each, one k-step). Two consumer
 * warpgroups, m64 each, hold 100 (132) fp32 accumulators a thread; one producer lane brings
 * RNND_DW16_CH chunks a stage by two bulk copies (three with the records) into DW_NST stages
 * (mbarriers full / empty). Each CTA writes its partial product; a second kernel sums the ks
 * partials in a fixed order (runs repeat bitwise) and adds each sum into the parameter gradient it
 * belongs to, undoing the chunks' column order.
 */
#include "common.cuh"
#include "seq_chunks.h"
#include "wg.cuh"

#include <cuda_bf16.h>

namespace {

constexpr int DW_NST = 4;           // stages
constexpr int DW_MP = RNND_DW16_MP; // D's columns a plane
constexpr int DW_THREADS = 288;     // 8 consumer warps, 1 producer warp
// The product's sizes for z's x part XK columns wide (64: 206 KB of shared memory in TF32 mode).
template <int XK>
struct dw_geom {
    static constexpr int NZ = RNND_DW16_NZ(XK), NACC = NZ / 2;
    static constexpr long Z = RNND_DW16_Z(XK);
    static constexpr long STAGE = RNND_DW16_CH * (RNND_DW16_D + Z); // without the records
    static constexpr long SMEM = DW_NST * STAGE + 2 * DW_NST * 8;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The accumulators d[o..o+4) and d[o..o+32) as asm operands.
#define RNND_D4(o) "+f"(d[(o)]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3])
#define RNND_D32(o)                                                                                \
    RNND_D4(o), RNND_D4((o) + 4), RNND_D4((o) + 8), RNND_D4((o) + 12), RNND_D4((o) + 16),          \
        RNND_D4((o) + 20), RNND_D4((o) + 24), RNND_D4((o) + 28)
#define RNND_P32                                                                                   \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RNND_P64                                                                                   \
    RNND_P32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
             "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d += A B, m64 n200 k16, bf16 A and B K-major in shared memory (descriptors).
__device__ __forceinline__ void mma_n200(float (&d)[100], uint64_t a, uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n200k16.f32.bf16.bf16 {" RNND_P64
                 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, "
                 "%79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, "
                 "%95, %96, %97, %98, %99}, %100, %101, 1, 1, 1, 0, 0;\n"
                 : RNND_D32(0), RNND_D32(32), RNND_D32(64), RNND_D4(96)
                 : "l"(a), "l"(b));
}
// The same at n128 and n8 (z's 264 columns: past one MMA's 256).
__device__ __forceinline__ void mma_n128(float (&d)[64], uint64_t a, uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" RNND_P64
                 "}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : RNND_D32(0), RNND_D32(32)
                 : "l"(a), "l"(b));
}
__device__ __forceinline__ void mma_n8(float (&d)[4], uint64_t a, uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, "
                 "1, 1, 1, 0, 0;\n"
                 : RNND_D4(0)
                 : "l"(a), "l"(b));
}
// d += A B, m64 n128 k16, A from registers (this warp's 16 rows), fp16 (F16) or bf16, B in
// shared memory: K-major, or N-major where TB (fp16: dw256's z pieces).
template <bool F16, bool TB = false>
__device__ __forceinline__ void mma_n128_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    if constexpr (F16)
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RNND_P64
                     "}, {%64, %65, %66, %67}, %68, 1, 1, 1, %69;\n"
                     : RNND_D32(0), RNND_D32(32)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB ? 1 : 0));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" RNND_P64
                     "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
                     : RNND_D32(0), RNND_D32(32)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
__device__ __forceinline__ void mma_f16_n8(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
                 : RNND_D4(0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// m64 n64 k16 with A from registers: fp16 (F16) or bf16; ACC false writes d without reading it;
// TB (fp16): B N-major.
template <bool F16, bool ACC = true, bool TB = false>
__device__ __forceinline__ void mma_n64_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    if constexpr (F16)
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RNND_P32
                     "}, {%32, %33, %34, %35}, %36, %37, 1, 1, %38;\n"
                     : RNND_D32(0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACC ? 1 : 0),
                       "n"(TB ? 1 : 0));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" RNND_P32
                     "}, {%32, %33, %34, %35}, %36, %37, 1, 1, 0;\n"
                     : RNND_D32(0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACC ? 1 : 0));
}
#undef RNND_P64
#undef RNND_P32
#undef RNND_D32
#undef RNND_D4

// The fp16 factor 2^k for k <= 0 (0 below fp16's smallest subnormal, 2^-24), in both halves.
__device__ __forceinline__ uint32_t pow2_h2(int k) {
    const __half h = __float2half_rn(k < -24 ? 0.0f : __uint_as_float((uint32_t)(127 + k) << 23));
    const __half2 v = __halves2half2(h, h);
    return *reinterpret_cast<const uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t f) {
    __half2 r =
        __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&f));
    return *reinterpret_cast<uint32_t *>(&r);
}
// TF32 mode: a chunk's A fragment r (ldmatrix.trans: lane (g, tg) holds K rows 2tg, 2tg + 1 and
// the same + 8) scaled row by row, for z's h part and constant (ah: 2^(eD + eh - ch)) and for its
// x part (ax: 2^(eD + ex - cx)); ed, eh and ex hold the chunk's 16 rows' exponents. Lane l
// computes one pair of factors (rows 2 (l % 8) and + 1, h's for l % 16 < 8, else x's) and the
// others take theirs by shuffles: each pair is needed by 8 lanes (docs/kernels.md).
__device__ __forceinline__ void dw_scale_rows(const uint32_t (&r)[4], const int16_t *ed,
                                              const int16_t *eh, const int16_t *ex, int lane,
                                              int ch, int cx, uint32_t (&ah)[4],
                                              uint32_t (&ax)[4]) {
    const int r0 = 2 * (lane & 7), tg = lane & 3;
    const bool xs = lane & 8;
    const int16_t *es = xs ? ex : eh;
    const int c = xs ? cx : ch;
    const uint32_t f =
        __byte_perm(pow2_h2(ed[r0] + es[r0] - c), pow2_h2(ed[r0 + 1] + es[r0 + 1] - c), 0x5410);
    const uint32_t fh[2] = {__shfl_sync(0xffffffffu, f, tg), __shfl_sync(0xffffffffu, f, tg + 4)};
    const uint32_t fx[2] = {__shfl_sync(0xffffffffu, f, tg + 8),
                            __shfl_sync(0xffffffffu, f, tg + 12)};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        ah[j] = hmul2(r[j], fh[j >> 1]);
        ax[j] = hmul2(r[j], fx[j >> 1]);
    }
}
#endif

// bf16 chunks: A and B from shared memory (m64n200k16). F16 (TF32 mode): each warp's A (its 16
// D columns, one exponent group w) from registers by ldmatrix, every K row scaled by
// 2^(eD + eh - Ch) for z's h part and constant and by 2^(eD + ex - Cx) for its x part, Ch and Cx
// being the largest of those over the CTA's K range (the records' chunk maxima); both factors
// are at most 1, so the fp16 products cannot overflow, and each partial is multiplied back by
// 2^C in fp32. A row 2^24 or more below its range's largest contributes nothing (docs/kernels.md).
// HU: DW_MP, or 64 for a layer of H <= 64 in the loops of 128, whose D columns and z's h columns
// past 64 are zeros: only D's first half and z's live columns are fetched (z's others are zeros in
// shared memory), and consumer warpgroup 1, whose rows the sum never reads, leaves at once.
template <bool F16, int XK, int HU = DW_MP>
__global__ void __launch_bounds__(DW_THREADS, 1)
    dw16_kernel(const uint8_t *__restrict__ chunks, const uint8_t *__restrict__ zch,
                const int16_t *__restrict__ exp, int pitch, int ks, float *__restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Dg = dw_geom<XK>;
    constexpr int NZ = Dg::NZ, NACC = Dg::NACC, NX = XK / 2; // x's accumulators
    constexpr long ZB = Dg::Z, DW_STAGE = Dg::STAGE;
    constexpr long STAGE = DW_STAGE + (F16 ? RNND_DW16_CH * RNND_DW16_E : 0);
    extern __shared__ __align__(1024) uint8_t sm[];
    uint64_t *full = reinterpret_cast<uint64_t *>(sm + DW_NST * STAGE), *empty = full + DW_NST;
    const int p = blockIdx.x % 4, s = blockIdx.x / 4, warp = threadIdx.x / 32;
    const int per = pitch / ks, c0 = s * per, nst = per / RNND_DW16_CH;
    const uint8_t *A = chunks + ((size_t)p * pitch + c0) * RNND_DW16_D;
    const uint8_t *B = zch + (size_t)c0 * ZB;
    static_assert(HU == DW_MP || HU == 64, "a half or all of the columns");
    constexpr bool HALF = HU < DW_MP;
    constexpr long DH = HU * 32; // a chunk's live bytes of D's plane and of z's h columns
    // empty: lane 0 of each consumer warp that stays.
    if (threadIdx.x == 0)
        mbar_ring_init(full, empty, DW_NST, 1, 4 * (HU / 64));
    if constexpr (HALF) { // z's h columns past HU, never fetched, read as zeros
        constexpr int NV = (RNND_DW16_D - DH) / 16; // 16-byte vectors a chunk
        for (int e = threadIdx.x; e < DW_NST * RNND_DW16_CH * NV; e += DW_THREADS) {
            const int c = e / NV;
            uint8_t *z = sm + c / RNND_DW16_CH * STAGE + RNND_DW16_CH * RNND_DW16_D +
                         c % RNND_DW16_CH * ZB + DH;
            reinterpret_cast<uint4 *>(z)[e % NV] = make_uint4(0, 0, 0, 0);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // for the MMAs' reads
    }
    __syncthreads();
    if (warp == 8) {
        if (threadIdx.x % 32 == 0)
            for (int i = 0; i < nst; i++) {
                const uint32_t bytes =
                    (uint32_t)(STAGE - (HALF ? RNND_DW16_CH * 2 * (RNND_DW16_D - DH) : 0));
                const int st = mbar_ring_fill(full, empty, i, DW_NST, bytes);
                uint8_t *dst = sm + st * STAGE;
                const uint8_t *a = A + (size_t)i * RNND_DW16_CH * RNND_DW16_D;
                const uint8_t *b = B + (size_t)i * RNND_DW16_CH * ZB;
                if constexpr (HALF) {
#pragma unroll
                    for (int c = 0; c < RNND_DW16_CH; c++) {
                        uint8_t *z = dst + RNND_DW16_CH * RNND_DW16_D + c * ZB;
                        bulk_g2s(dst + c * RNND_DW16_D, a + c * RNND_DW16_D, DH, full + st);
                        bulk_g2s(z, b + c * ZB, DH, full + st);
                        bulk_g2s(z + RNND_DW16_D, b + c * ZB + RNND_DW16_D, ZB - RNND_DW16_D,
                                 full + st);
                    }
                } else {
                    bulk_g2s(dst, a, RNND_DW16_CH * RNND_DW16_D, full + st);
                    bulk_g2s(dst + RNND_DW16_CH * RNND_DW16_D, b, RNND_DW16_CH * ZB, full + st);
                }
                if constexpr (F16)
                    bulk_g2s(dst + DW_STAGE,
                             reinterpret_cast<const uint8_t *>(exp) +
                                 (size_t)(c0 + i * RNND_DW16_CH) * RNND_DW16_E,
                             RNND_DW16_CH * RNND_DW16_E, full + st);
            }
        return;
    }
    const int wg = warp / 4, lane = threadIdx.x % 32;
    if (HALF && wg > 0)
        return;
    float d[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++)
        d[i] = 0.0f;
    // The accumulators in z's column order (n8 group j at d[4j..]): h, x, the constant.
    float(&dh)[64] = *reinterpret_cast<float(*)[64]>(d);
    float(&dx)[NX] = *reinterpret_cast<float(*)[NX]>(d + 64);
    float(&dc)[4] = *reinterpret_cast<float(*)[4]>(d + 64 + NX);
    constexpr long ZX = 16 * 256, ZC = (16 + XK / 8) * 256; // x's and the constant's columns
    if constexpr (F16) {
        const int w = wg * 4 + warp % 4; // this warp's exponent group (D columns 16w..)
        int ch = RNND_DW16_EZERO - 256, cx = ch;
        for (int c = lane; c < per; c += 32) {
            const int16_t *rec = exp + (size_t)(c0 + c) * (RNND_DW16_E / 2);
            ch = max(ch, (int)__ldg(rec + 160 + w));
            cx = max(cx, (int)__ldg(rec + 168 + w));
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            ch = max(ch, __shfl_xor_sync(0xffffffffu, ch, o));
            cx = max(cx, __shfl_xor_sync(0xffffffffu, cx, o));
        }
        const int q = lane >> 3;
        for (int i = 0; i < nst; i++) {
            const int st = i % DW_NST;
            mbar_wait(full + st, (i / DW_NST) & 1);
            const uint8_t *a = sm + st * STAGE, *b = a + RNND_DW16_CH * RNND_DW16_D;
            const int16_t *recs = reinterpret_cast<const int16_t *>(a + DW_STAGE);
            // The stage's chunks CG at a time (XK = 128: one, so that its A fragments fit beside
            // the 132 accumulators without spills), each group drained before the next one's A
            // registers are written: the stage's bytes take far longer to arrive than its MMAs.
            constexpr int CG = XK == 64 ? RNND_DW16_CH : 1;
#pragma unroll
            for (int cb = 0; cb < RNND_DW16_CH; cb += CG) {
                uint32_t ah[CG][4], ax[CG][4];
#pragma unroll
                for (int c = 0; c < CG; c++) {
                    // Matrix q: D columns 16w + 8 (q & 1).., K rows 8 (q >> 1)..; lane (g, tg)
                    // gets column g (+8) and rows 2tg, 2tg+1 (+8): m16k16's A fragment (the
                    // core matrices are row-major in TF32 mode: transposed).
                    uint32_t r[4];
                    ldmatrix_x4_at<true>(r, a + (cb + c) * RNND_DW16_D + w * 512 + (q & 1) * 256 +
                                                (q >> 1) * 128 + (lane & 7) * 16);
                    const int16_t *rec = recs + (cb + c) * (RNND_DW16_E / 2);
                    dw_scale_rows(r, rec + w * 16, rec + 128, rec + 144, lane, ch, cx, ah[c],
                                  ax[c]);
                }
                wg_fence();
#pragma unroll
                for (int c = 0; c < CG; c++) {
                    const uint8_t *z = b + (cb + c) * ZB;
                    mma_n128_rs<true>(dh, ah[c], wg_desc(z, 256));
                    mma_f16_n8(dc, ah[c], wg_desc(z + ZC, 256));
                    if constexpr (XK == 64)
                        mma_n64_rs<true>(dx, ax[c], wg_desc(z + ZX, 256));
                    else
                        mma_n128_rs<true>(dx, ax[c], wg_desc(z + ZX, 256));
                }
                wg_commit();
                wg_wait<0>();
            }
            if (lane == 0)
                mbar_arrive(empty + st);
        }
        // Back to true values: h's columns and the constant's by 2^ch, x's by 2^cx.
#pragma unroll
        for (int k = 0; k < NACC; k++)
            d[k] = ldexpf(d[k], k < 64 || k >= 64 + NX ? ch : cx);
    } else {
        // Whole stages only: ptxas serialises an MMA under a run-time condition (the caller pads
        // the chunks with zeros to a multiple of ks stages).
        for (int i = 0; i < nst; i++) {
            const int st = i % DW_NST;
            mbar_wait(full + st, (i / DW_NST) & 1);
            const uint8_t *a = sm + st * DW_STAGE, *b = a + RNND_DW16_CH * RNND_DW16_D;
            wg_fence();
#pragma unroll
            for (int c = 0; c < RNND_DW16_CH; c++) {
                const uint64_t ad = wg_desc(a + c * RNND_DW16_D + wg * 2048, 256);
                const uint8_t *z = b + c * ZB;
                if constexpr (XK == 64) {
                    mma_n200(d, ad, wg_desc(z, 256));
                } else {
                    mma_n128(dh, ad, wg_desc(z, 256));
                    mma_n128(dx, ad, wg_desc(z + ZX, 256));
                    mma_n8(dc, ad, wg_desc(z + ZC, 256));
                }
            }
            wg_commit();
            wg_wait<1>(); // the previous stage's MMAs are done with its buffers
            if (i > 0 && threadIdx.x % 32 == 0)
                mbar_arrive(empty + (i - 1) % DW_NST);
        }
        wg_wait<0>();
    }
    // m64nN accumulators: warp (of 4) 16 rows, lane / 4 the row within 8, lane % 4 the column
    // pair within each n8 group.
    const int row = p * DW_MP + wg * 64 + (warp % 4) * 16 + lane / 4;
    float *o = part + (size_t)s * 4 * DW_MP * NZ;
#pragma unroll
    for (int c = 0; c < NZ / 8; c++) {
        const int col = c * 8 + 2 * (lane % 4);
        *reinterpret_cast<float2 *>(o + (size_t)row * NZ + col) =
            make_float2(d[4 * c], d[4 * c + 1]);
        *reinterpret_cast<float2 *>(o + (size_t)(row + 8) * NZ + col) =
            make_float2(d[4 * c + 2], d[4 * c + 3]);
    }
#else
    (void)chunks, (void)zch, (void)exp, (void)pitch, (void)ks, (void)part;
#endif
}

// The unit a chunk column holds within its group of 16 (the loop's movmatrix order).
__device__ __forceinline__ int dw16_unit(int n) {
    const int v = n & 15;
    return (n & ~15) + 4 * ((v & 7) >> 1) + 2 * (v >> 3) + (v & 1);
}

// The ks partials of chunk column (m, n) summed in a fixed order (runs repeat bitwise) and added
// into the gradient they belong to: D's column m is unit dw16_unit(m % 128) of plane m / 128;
// z's h columns go to W_hh, its x columns (xk of them) to W_ih, the constant to both biases. The
// GRU's planes 2 and 3 are n's hidden and input sides: W_hh and b_hh take plane 2, W_ih and b_ih
// plane 3. Units from H on (a layer of H < 128 in the loops of 128) belong to no gradient.
__global__ void dw16_sum_kernel(const float *__restrict__ part, int ks, int xk, int H, int Il,
                                bool gru, float *gw_ih, float *gw_hh, float *gb_ih, float *gb_hh) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, nz = RNND_DW16_NZ(xk);
    if (i >= 4 * DW_MP * nz)
        return;
    const int m = i / nz, n = i % nz, p = m / DW_MP, um = dw16_unit(m % DW_MP);
    const bool hs = !gru || p != 3, xs = !gru || p != 2; // the plane feeds h's, x's side
    const int row = (gru && p == 3 ? 2 : p) * H + um;
    float *to = nullptr, *to2 = nullptr;
    if (um >= H)
        return;
    if (n < DW_MP)
        to = hs && dw16_unit(n) < H ? gw_hh + (size_t)row * H + dw16_unit(n) : nullptr;
    else if (n < DW_MP + xk)
        to = xs && n - DW_MP < Il ? gw_ih + (size_t)row * Il + n - DW_MP : nullptr;
    else if (n == DW_MP + xk)
        to = xs ? gb_ih + row : nullptr, to2 = hs ? gb_hh + row : nullptr;
    if (!to && !to2)
        return;
    float acc = 0.0f;
    for (int s = 0; s < ks; s++)
        acc += part[(size_t)s * 4 * DW_MP * nz + i];
    if (to)
        *to += acc;
    if (to2)
        *to2 += acc;
}

// ---------------------------------------------------------------------------------------------
// The product at H = 256 from the cluster loops' dw256 chunks (seq_chunks.h; docs/kernels.md).
// CTA (plane p, K range s): D's plane p (128 columns: gates 2 (p % 2) and 2 (p % 2) + 1 of
// units 64 (p / 2)..) against all of z's RNND_DW256_NZ columns. Consumer warpgroup q takes the
// plane's gate q (m64): A from registers by ldmatrix.trans of its piece, each K row scaled by
// 2^(eD + eh - Ch) for h and the constant and 2^(eD + ex - Cx) for x (one eD a row for the whole
// plane: the cluster CTA's row scale), Ch and Cx the CTA's largest over its K range; B, z's
// pieces, N-major in shared memory (the forward's slabs as they stood). 164 accumulators a
// thread (h 2 x n128, x n64, the constant n8). Stages of RNND_DW256_CH chunks, 1024-byte aligned
// for the swizzle. The kernel runs beside the backward loop that writes D's chunks, each CTA
// from when its K range is written (seq_chunks.h, dw256_sync; docs/kernels.md).

constexpr int D2_NST = 6;
constexpr long D2_OFFZ = RNND_DW256_CH * RNND_DW16_D;
constexpr long D2_OFFA = D2_OFFZ + RNND_DW256_CH * RNND_DW256_Z;
constexpr long D2_OFFE = D2_OFFA + RNND_DW256_CH * RNND_DW256_A;
constexpr long D2_BYTES = D2_OFFE + RNND_DW256_CH * 32; // what a stage's copies bring
constexpr long D2_STAGE = (D2_BYTES + 1023) / 1024 * 1024;
constexpr long D2_SMEM = 1024 + D2_NST * D2_STAGE + 2 * D2_NST * 8;
constexpr int D2_NACC = RNND_DW256_NZ / 2; // 41 n8 groups x 4
constexpr int D2_THREADS = 256;            // 2 consumer warpgroups
static_assert(D2_OFFZ % 1024 == 0 && RNND_DW256_Z % 1024 == 0, "z pieces on swizzle atoms");

__global__ void __launch_bounds__(D2_THREADS, 1)
    dw256_kernel(const uint8_t *__restrict__ chunks, const uint8_t *__restrict__ zch,
                 const uint8_t *__restrict__ aux, const int16_t *__restrict__ exp, int pitch,
                 int ks, float *__restrict__ part, const dw256_sync sy) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t sm_raw[];
    uint8_t *sm = sm_raw + ((1024 - (smem_u32(sm_raw) & 1023)) & 1023);
    uint64_t *full = reinterpret_cast<uint64_t *>(sm + D2_NST * D2_STAGE), *empty = full + D2_NST;
    const int p = blockIdx.x % 8, s = blockIdx.x / 8, warp = threadIdx.x / 32,
              lane = threadIdx.x % 32;
    const int per = pitch / ks, c0 = s * per, nst = per / RNND_DW256_CH;
    const int16_t *E = exp + ((size_t)(p / 2) * pitch + c0) * 16; // eD of CTA p / 2's columns
    const uint8_t *X = aux + (size_t)c0 * RNND_DW256_A;
    // Thread 0 also brings the stages (a producer warp would leave the consumers 168 registers):
    // stage i into buffer i % D2_NST once every warp is done with stage i - D2_NST.
    auto produce = [&](int i) {
        constexpr int CH = RNND_DW256_CH;
        const int st = mbar_ring_fill(full, empty, i, D2_NST, (uint32_t)D2_BYTES);
        uint8_t *dst = sm + st * D2_STAGE;
        const size_t c = (size_t)c0 + (size_t)i * CH;
        bulk_g2s(dst, chunks + ((size_t)p * pitch + c) * RNND_DW16_D, CH * RNND_DW16_D, full + st);
        bulk_g2s(dst + D2_OFFZ, zch + c * RNND_DW256_Z, CH * RNND_DW256_Z, full + st);
        bulk_g2s(dst + D2_OFFA, aux + c * RNND_DW256_A, CH * RNND_DW256_A, full + st);
        bulk_g2s(dst + D2_OFFE, E + (size_t)i * CH * 16, CH * 32, full + st);
    };
    if (threadIdx.x == 0) {
        // The K range's chunks are written once the loop has done its last step k (the loop
        // runs beside: seq_chunks.h, dw256_sync). Nothing of theirs is read before (through
        // L1 neither: the records by ld.global.cg). A wait past 30 s is a fault, not a hang.
        const int k = min((c0 + per - 1) / sy.nblk, sy.T - 1);
        uint64_t t0, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        for (unsigned v = 0;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                         : "=r"(v)
                         : "l"(sy.ready + k)
                         : "memory");
            if (v >= sy.ctas)
                break;
            __nanosleep(256);
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - t0 > 30000000000ull)
                __trap();
        }
        asm volatile("fence.proxy.async.global;" ::: "memory"); // for the bulk copies' reads
        mbar_ring_init(full, empty, D2_NST, 1, 8);              // empty: lane 0 of each warp
        for (int i = 0; i < D2_NST && i < nst; i++)
            produce(i);
    }
    __syncthreads();
    // The CTA's largest eD + eh and eD + ex over its K range (rows of zeros: far below).
    __shared__ int red[2][8];
    int ch = 4 * RNND_DW16_EZERO, cx = ch;
#pragma unroll 4
    for (int k = threadIdx.x; k < per * 16; k += 256) {
        const int ed = __ldcg(E + k);
        const int16_t *e =
            reinterpret_cast<const int16_t *>(X + (size_t)(k / 16) * RNND_DW256_A + 256) + k % 16;
        ch = max(ch, ed + __ldcg(e));
        cx = max(cx, ed + __ldcg(e + 16));
    }
    ch = __reduce_max_sync(0xffffffffu, ch);
    cx = __reduce_max_sync(0xffffffffu, cx);
    if (lane == 0)
        red[0][warp] = ch, red[1][warp] = cx;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 8; k++)
        ch = max(ch, red[0][k]), cx = max(cx, red[1][k]);

    const int wg = warp / 4, q = lane >> 3;
    float d[D2_NACC];
#pragma unroll
    for (int i = 0; i < D2_NACC; i++)
        d[i] = 0.0f;
    // The n8 groups: h's units 0-127 and 128-255, x, the constant.
    float(&dh0)[64] = *reinterpret_cast<float(*)[64]>(d);
    float(&dh1)[64] = *reinterpret_cast<float(*)[64]>(d + 64);
    float(&dx)[32] = *reinterpret_cast<float(*)[32]>(d + 128);
    float(&dc)[4] = *reinterpret_cast<float(*)[4]>(d + 160);
    // ldmatrix.trans, matrix q: K rows 8 (q >> 1) + lane % 8, this warp's units 16 (warp % 4) +
    // 8 (q & 1).. of the piece: lane (g, tg) gets unit g (+8), rows 2tg, 2tg+1 (+8).
    const int krow = 8 * (q >> 1) + (lane & 7), unit16 = 2 * (warp % 4) + (q & 1);
    const int aoff = wg * 2048 + krow * 128 + ((unit16 ^ (lane & 7)) << 4);
    constexpr int CH = RNND_DW256_CH;
    using Afrag = uint32_t[CH][4];
    // Stage i's A fragments, h's and x's scaling, once its bytes are in.
    auto prep = [&](int i, Afrag &ah, Afrag &ax) {
        mbar_wait(full + i % D2_NST, (i / D2_NST) & 1);
        const uint8_t *a = sm + (i % D2_NST) * D2_STAGE;
#pragma unroll
        for (int c = 0; c < CH; c++) {
            uint32_t r[4];
            ldmatrix_x4_at<true>(r, a + c * RNND_DW16_D + aoff);
            const int16_t *ed = reinterpret_cast<const int16_t *>(a + D2_OFFE + c * 32);
            const int16_t *eh =
                reinterpret_cast<const int16_t *>(a + D2_OFFA + c * RNND_DW256_A + 256);
            dw_scale_rows(r, ed, eh, eh + 16, lane, ch, cx, ah[c], ax[c]);
        }
    };
    // Stage i's MMAs on A (prepared); once stage i - 1's are done (one group left in flight),
    // its buffer is released (and refilled with stage i - 1 + D2_NST) and stage i + 1's A is
    // prepared in the registers it used, while stage i's run.
    auto release = [&](int i) {
        __syncwarp(); // the warp's reads of the buffer (prep's) before its lane 0's arrival
        if (lane == 0)
            mbar_arrive(empty + i % D2_NST);
        if (threadIdx.x == 0 && i + D2_NST < nst)
            produce(i + D2_NST);
    };
    auto step = [&](int i, const Afrag &ah, const Afrag &ax, Afrag &nh, Afrag &nx) {
        const uint8_t *a = sm + (i % D2_NST) * D2_STAGE;
        wg_fence();
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const uint8_t *z = a + D2_OFFZ + c * RNND_DW256_Z;
            mma_n128_rs<true, true>(dh0, ah[c], wg_desc_mn_sw128(z, 2048));
            mma_n128_rs<true, true>(dh1, ah[c], wg_desc_mn_sw128(z + 2 * 2048, 2048));
            mma_n64_rs<true, true, true>(dx, ax[c], wg_desc_mn_sw128(z + 4 * 2048, 2048));
            mma_f16_n8(dc, ah[c], wg_desc(a + D2_OFFA + c * RNND_DW256_A, 256));
        }
        wg_commit();
        wg_wait<1>();
        if (i > 0)
            release(i - 1);
        if (i + 1 < nst)
            prep(i + 1, nh, nx);
    };
    Afrag ah0, ax0, ah1, ax1;
    if (nst > 0)
        prep(0, ah0, ax0);
    for (int i = 0; i < nst; i += 2) {
        step(i, ah0, ax0, ah1, ax1);
        if (i + 1 < nst)
            step(i + 1, ah1, ax1, ah0, ax0);
    }
    wg_wait<0>();
    if (nst > 0)
        release(nst - 1);
#pragma unroll
    for (int k = 0; k < D2_NACC; k++)
        d[k] = ldexpf(d[k], k >= 128 && k < 160 ? cx : ch);
    // Accumulator group j (d[4j..]) is z column 8j + 2 (lane % 4) (+1), rows lane / 4 (+8).
    const int row = p * 128 + wg * 64 + (warp % 4) * 16 + lane / 4;
    float *o = part + (size_t)s * 1024 * RNND_DW256_NZ;
#pragma unroll
    for (int j = 0; j < D2_NACC / 4; j++) {
        const int col = 8 * j + 2 * (lane % 4);
        *reinterpret_cast<float2 *>(o + (size_t)row * RNND_DW256_NZ + col) =
            make_float2(d[4 * j], d[4 * j + 1]);
        *reinterpret_cast<float2 *>(o + (size_t)(row + 8) * RNND_DW256_NZ + col) =
            make_float2(d[4 * j + 2], d[4 * j + 3]);
    }
#else
    (void)chunks, (void)zch, (void)aux, (void)exp, (void)pitch, (void)ks, (void)part;
#endif
}

// The ks partials of (m, n) summed in a fixed order and added into their gradient: D's column m
// is gate q = 2 (p % 2) + (m % 128) / 64 of unit 64 (p / 2) + m % 64 (p = m / 128); z's column n
// is unit n of W_hh, input n - 256 of W_ih, or (n = 320) the constant of both biases. The GRU's
// gates 2 and 3 are n's hidden and input sides, as in dw16_sum_kernel.
__global__ void dw256_sum_kernel(const float *__restrict__ part, int ks, int Il, bool gru,
                                 float *gw_ih, float *gw_hh, float *gb_ih, float *gb_hh) {
    constexpr int H = 256;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 4 * H * RNND_DW256_NZ)
        return;
    const int m = i / RNND_DW256_NZ, n = i % RNND_DW256_NZ, p = m / 128;
    const int q = 2 * (p % 2) + (m % 128) / 64;
    const bool hs = !gru || q != 3, xs = !gru || q != 2; // the gate feeds h's, x's side
    const int row = (gru && q == 3 ? 2 : q) * H + 64 * (p / 2) + m % 64;
    float *to = nullptr, *to2 = nullptr;
    if (n < H)
        to = hs ? gw_hh + (size_t)row * H + n : nullptr;
    else if (n < H + 64)
        to = xs && n - H < Il ? gw_ih + (size_t)row * Il + n - H : nullptr;
    else if (n == H + 64)
        to = xs ? gb_ih + row : nullptr, to2 = hs ? gb_hh + row : nullptr;
    if (!to && !to2)
        return;
    float acc = 0.0f;
    for (int s = 0; s < ks; s++)
        acc += part[(size_t)s * 4 * H * RNND_DW256_NZ + i];
    if (to)
        *to += acc;
    if (to2)
        *to2 += acc;
}

// ---------------------------------------------------------------------------------------------
// dL/dx from the same chunks (the layer's input gradient, which the daemon's Backward always
// returns): dx[row][i] = sum over the input-side gate columns j of D[row][j] W_ih[j][i]. A warp
// group takes 4 chunks at a time, one a warp: its 16 rows are the MMA's M rows of that warp, A
// comes from registers (ldmatrix.trans of the chunk's core matrices gives the m16k16 fragment
// directly) and B is W_ih^T, K-major bf16, resident in shared memory: m64nXKk16 (XK =
// RNND_DW16_XK(I_l)), XK / 2 accumulators a thread. One producer lane brings the 4 chunks' planes,
// SPL of them a stage (one bulk copy a plane): all 4 at XK = 64, 2 at XK = 128, whose W_ih^T
// takes twice the shared memory. A slot's fragments are loaded while the previous slot's MMAs run.

constexpr int DX_NST = 2;
constexpr int DX_KMAX = 4 * DW_MP; // the LSTM's 4 planes
constexpr int DX_THREADS = 160;    // 4 consumer warps, 1 producer warp
template <int XK>
struct dx_geom {
    static constexpr int SPL = XK == 64 ? 4 : 2;                       // planes a stage
    static constexpr long WT = (long)XK * DX_KMAX * 2;                 // W_ih^T: XK inputs x K
    static constexpr long STAGE = 4L * SPL * RNND_DW16_D;              // 4 chunks' planes
    static constexpr long SMEM = WT + DX_NST * STAGE + 2 * DX_NST * 8; // without the records
};

// CTA: groups of 4 chunks [g0, g1). The chunk planes of K's NPL 128-column slots: the GRU's r, z
// and the input side of n (0, 1, 3), the LSTM's 0-3.
// F16 (TF32 mode): W_ih^T in fp16, scaled by the power of two that puts its largest |value| in
// [2^13, 2^14); each row's A (this warp's chunk row) scaled by 2^(eD - E) in k-step group w, E
// being the row's largest eD, so the factors are at most 1; the row's sums times 2^E / scale.
template <bool F16, int XK, int NPL>
__global__ void __launch_bounds__(DX_THREADS, 1)
    dx16_kernel(const uint8_t *__restrict__ chunks, const int16_t *__restrict__ exp, int pitch,
                int nch, const float *__restrict__ w_ih, int H, int Il, int B, int T,
                float *__restrict__ dx) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Xg = dx_geom<XK>;
    constexpr int SPL = Xg::SPL, NSG = (NPL + SPL - 1) / SPL; // stages a group
    constexpr int K = NPL * DW_MP, KG = K / 8;
    constexpr long STAGE = Xg::STAGE + (F16 ? 4 * RNND_DW16_E : 0);
    extern __shared__ __align__(1024) uint8_t sm[];
    uint8_t *wt = sm, *stages = sm + Xg::WT;
    uint64_t *full = reinterpret_cast<uint64_t *>(stages + DX_NST * STAGE), *empty = full + DX_NST;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ngroups = CEIL_DIV(nch, 4), per = CEIL_DIV(ngroups, (int)gridDim.x);
    const int g0 = blockIdx.x * per, g1 = min(g0 + per, ngroups);
    if (threadIdx.x == 0)
        mbar_ring_init(full, empty, DX_NST, 1, 4); // empty: lane 0 of each consumer warp
    __syncthreads();
    if (warp == 4) {
        if (lane == 0)
            for (int g = g0; g < g1; g++)
#pragma unroll
                for (int j = 0; j < NSG; j++) {
                    const int n = min(SPL, NPL - j * SPL); // the stage's planes
                    const int st = mbar_ring_fill(
                        full, empty, (g - g0) * NSG + j, DX_NST,
                        (uint32_t)(n * 4 * RNND_DW16_D + (F16 ? 4 * RNND_DW16_E : 0)));
                    for (int q = 0; q < n; q++) {
                        const int s = j * SPL + q, p = NPL == 3 && s == 2 ? 3 : s;
                        bulk_g2s(stages + st * STAGE + q * 4 * RNND_DW16_D,
                                 chunks + ((size_t)p * pitch + 4 * (size_t)g) * RNND_DW16_D,
                                 4 * RNND_DW16_D, full + st);
                    }
                    if constexpr (F16)
                        bulk_g2s(stages + st * STAGE + Xg::STAGE,
                                 reinterpret_cast<const uint8_t *>(exp) +
                                     4 * (size_t)g * RNND_DW16_E,
                                 4 * RNND_DW16_E, full + st);
                }
        return;
    }
    // The consumers (warps 0-3) build W_ih^T while the producer's first copies are in flight.
    auto consumers_sync = [] { asm volatile("bar.sync 1, 128;" ::: "memory"); };
    float wsc = 1.0f;
    if constexpr (F16) {
        __shared__ float red[4];
        float m = 0.0f;
        for (int e = threadIdx.x; e < NPL * H * Il; e += 128)
            m = fmaxf(m, fabsf(__ldg(w_ih + e)));
#pragma unroll
        for (int o = 1; o < 32; o <<= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0)
            red[warp] = m;
        consumers_sync();
        for (int k = 0; k < 4; k++)
            m = fmaxf(m, red[k]);
        wsc = persist_pow2_for(m, 14);
    }
    // W_ih^T: B[k][i] = W_ih[slot H + unit(n)][i] for k = 128 slot + n (the chunks' column
    // order), zero past I_l and for units from H on; K-major core matrices (km_off).
    for (int e = threadIdx.x; e < XK * K; e += 128) {
        const int i = e / K, k = e % K, unit = dw16_unit(k % DW_MP);
        const float v = i < Il && unit < H ? w_ih[(size_t)((k / DW_MP) * H + unit) * Il + i] : 0.0f;
        if constexpr (F16)
            *reinterpret_cast<__half *>(wt + km_off(i, k, KG)) = __float2half_rn(v * wsc);
        else
            *reinterpret_cast<__nv_bfloat16 *>(wt + km_off(i, k, KG)) = __float2bfloat16_rn(v);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // for the MMAs' reads
    consumers_sync();
    const int q = lane >> 3; // the matrix whose row address this lane gives (ldmatrix.x4)
    // This warp's chunk in a stage: matrix q of a k-step, rows 8 (q & 1).., columns 8 (q >> 1)..
    const int aoff = warp * RNND_DW16_D + (q & 1) * 128 + (q >> 1) * 256 + (lane & 7) * 16;
    // dL/dx rows as 16-byte stores where they keep that alignment (with a store a value the
    // two-layer GRU row took 3.28-3.33 ms, against 3.18-3.20: docs/benchmarks.md).
    const bool quads = Il % 4 == 0 && (reinterpret_cast<uintptr_t>(dx) & 15) == 0;
    for (int g = g0; g < g1; g++) {
        float d[XK / 2];
#pragma unroll
        for (int k = 0; k < XK / 2; k++)
            d[k] = 0.0f;
        int erow[2] = {0, 0}; // F16: rows lane / 4 and + 8's largest eD
        uint32_t f[2][8];     // F16: their k-step groups' factors 2^(eD - E)
        // Slot s's 8 k-steps (columns 16 w.. of plane s % SPL of the group's stage s / SPL) into
        // as, F16 scaled. Core matrices K-major (bf16): transposed; row-major (TF32 mode's fp16):
        // as they are. A stage is released once its last slot is in registers.
        auto load = [&](uint32_t(&as)[8][4], int s) {
            const int i = (g - g0) * NSG + s / SPL, st = i % DX_NST;
            const uint8_t *stage = stages + st * STAGE;
            if (s % SPL == 0)
                mbar_wait(full + st, (i / DX_NST) & 1);
            if (F16 && s == 0) {
                const int16_t *rec =
                    reinterpret_cast<const int16_t *>(stage + Xg::STAGE + warp * RNND_DW16_E);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int16_t *e = rec + (lane >> 2) + 8 * h; // eD[w][row] at e[16 w]
                    erow[h] = RNND_DW16_EZERO;
#pragma unroll
                    for (int w = 0; w < 8; w++)
                        erow[h] = max(erow[h], (int)e[16 * w]);
#pragma unroll
                    for (int w = 0; w < 8; w++)
                        f[h][w] = pow2_h2(e[16 * w] - erow[h]);
                }
            }
#pragma unroll
            for (int w = 0; w < 8; w++) {
                ldmatrix_x4_at<!F16>(as[w], stage + aoff + (s % SPL) * 4 * RNND_DW16_D + w * 512);
                if constexpr (F16)
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        as[w][k] = hmul2(as[w][k], f[k & 1][w]);
            }
            if (s % SPL == SPL - 1 || s == NPL - 1) {
                __syncwarp(); // the warp's loads before its lane 0's arrival
                if (lane == 0)
                    mbar_arrive(empty + st);
            }
        };
        // Slot s's MMAs on as; once slot s - 1's are done (one group left in flight), its
        // registers take slot s + 1.
        uint32_t as[2][8][4];
#pragma unroll
        for (int s = 0; s < NPL; s++) {
            load(as[s & 1], s);
            wg_fence();
#pragma unroll
            for (int w = 0; w < 8; w++) {
                const uint64_t b = wg_desc(wt + (s * 8 + w) * 256, KG * 128);
                if constexpr (XK == 64)
                    mma_n64_rs<F16>(d, as[s & 1][w], b);
                else
                    mma_n128_rs<F16>(d, as[s & 1][w], b);
            }
            wg_commit();
            wg_wait<1>();
        }
        wg_wait<0>();
        // Rows g, g + 8 of this warp's chunk c = 4 g + warp (block c / T, step c % T). 2^E is
        // a normal float (E >= -126), or 0 for a zero row; both factors are 1 in bf16 mode.
        const int c = 4 * g + warp, blk = c / T, t = c % T;
        if (c >= nch)
            continue;
        const float winv = 1.0f / wsc, e2[2] = {ldexpf(1.0f, erow[0]), ldexpf(1.0f, erow[1])};
        if (quads) {
            // Lanes 2k and 2k + 1 hold columns c0.. c0 + 1 and c0 + 2.. c0 + 3 of both rows;
            // they swap halves so that the even lane stores row g's four and the odd lane row
            // g + 8's, one 16-byte store each.
            const int h = lane & 1, b = blk * 16 + (lane >> 2) + 8 * h;
            float *row = dx + ((size_t)b * T + t) * Il;
#pragma unroll
            for (int n = 0; n < XK / 8; n++) {
                const float a0 = d[4 * n] * e2[0] * winv, a1 = d[4 * n + 1] * e2[0] * winv;
                const float b0 = d[4 * n + 2] * e2[1] * winv, b1 = d[4 * n + 3] * e2[1] * winv;
                const float r0 = __shfl_xor_sync(0xffffffffu, h ? a0 : b0, 1);
                const float r1 = __shfl_xor_sync(0xffffffffu, h ? a1 : b1, 1);
                const int col = 8 * n + 2 * (lane & 3) - 2 * h;
                if (b < B && col < Il)
                    *reinterpret_cast<float4 *>(row + col) =
                        h ? make_float4(r0, r1, b0, b1) : make_float4(a0, a1, r0, r1);
            }
            continue;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int b = blk * 16 + (lane >> 2) + 8 * h;
            if (b >= B)
                continue;
            float *row = dx + ((size_t)b * T + t) * Il;
#pragma unroll
            for (int n = 0; n < XK / 8; n++) {
                const int col = 8 * n + 2 * (lane & 3);
                if (col < Il)
                    row[col] = d[4 * n + 2 * h] * e2[h] * winv;
                if (col + 1 < Il)
                    row[col + 1] = d[4 * n + 2 * h + 1] * e2[h] * winv;
            }
        }
    }
#else
    (void)chunks, (void)exp, (void)pitch, (void)nch, (void)w_ih, (void)H, (void)Il, (void)B;
    (void)T, (void)dx;
#endif
}

} // namespace

int rnnd__dw16_product(const struct dw16_args *a, cudaStream_t stream) {
    if (a->H > DW_MP || a->H % 4 != 0 || a->Il < 1 || a->Il > 128 || a->ks < 1 || !a->z ||
        a->pitch % (a->ks * RNND_DW16_CH) != 0)
        return RNND_EINVAL;
    const int xk = RNND_DW16_XK(a->Il);
    auto kernel = xk == 64 ? (a->exp ? dw16_kernel<true, 64> : dw16_kernel<false, 64>)
                           : (a->exp ? dw16_kernel<true, 128> : dw16_kernel<false, 128>);
    if (xk == 64 && a->H <= 64) // the loops of 128 with zeros past 64
        kernel = a->exp ? dw16_kernel<true, 64, 64> : dw16_kernel<false, 64, 64>;
    const long smem = (xk == 64 ? dw_geom<64>::SMEM : dw_geom<128>::SMEM) +
                      (a->exp ? DW_NST * RNND_DW16_CH * RNND_DW16_E : 0);
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<4 * a->ks, DW_THREADS, smem, stream>>>(static_cast<const uint8_t *>(a->chunks),
                                                    static_cast<const uint8_t *>(a->z), a->exp,
                                                    a->pitch, a->ks, a->part);
    CUDA_LAUNCH_CHECK();
    const int n = 4 * DW_MP * RNND_DW16_NZ(xk);
    dw16_sum_kernel<<<CEIL_DIV(n, 256), 256, 0, stream>>>(a->part, a->ks, xk, a->H, a->Il, a->gru,
                                                          a->gw_ih, a->gw_hh, a->gb_ih, a->gb_hh);
    CUDA_LAUNCH_CHECK();
    return 0;
}

int rnnd__dw256_product(const struct dw16_args *a, const void *aux, const struct dw256_sync *sy,
                        cudaStream_t stream) {
    if (a->H != 256 || a->Il < 1 || a->Il > 64 || a->ks < 1 || !a->z || !a->exp || !aux || !sy ||
        !sy->ready || sy->nblk < 1 || sy->T < 1 || a->pitch % (a->ks * RNND_DW256_CH) != 0)
        return RNND_EINVAL;
    RNND_CUDA_TRY(cudaFuncSetAttribute(dw256_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)D2_SMEM));
    // A programmatic dependent of the backward loop before it on the stream (which lets it
    // start at once): the CTAs wait for their chunks themselves.
    RNND_TRY(cuda_launch(stream, true, dw256_kernel, dim3((unsigned)(8 * a->ks)), dim3(D2_THREADS),
                         (size_t)D2_SMEM, static_cast<const uint8_t *>(a->chunks),
                         static_cast<const uint8_t *>(a->z), static_cast<const uint8_t *>(aux),
                         a->exp, a->pitch, a->ks, a->part, *sy));
    const int n = 4 * 256 * RNND_DW256_NZ;
    dw256_sum_kernel<<<CEIL_DIV(n, 256), 256, 0, stream>>>(a->part, a->ks, a->Il, a->gru, a->gw_ih,
                                                           a->gw_hh, a->gb_ih, a->gb_hh);
    CUDA_LAUNCH_CHECK();
    return 0;
}

int rnnd__dx16_product(const struct dx16_args *a, cudaStream_t stream) {
    if (a->H > DW_MP || a->H % 4 != 0 || a->Il < 1 || a->Il > 128 || (a->npl != 3 && a->npl != 4) ||
        a->pitch < a->nch || a->sms < 1)
        return RNND_EINVAL;
    const int xk = RNND_DW16_XK(a->Il);
    const bool f16 = a->exp != nullptr;
    auto pick = [&](auto k64, auto k128) { return xk == 64 ? k64 : k128; };
    auto kernel = a->npl == 3 ? (f16 ? pick(dx16_kernel<true, 64, 3>, dx16_kernel<true, 128, 3>)
                                     : pick(dx16_kernel<false, 64, 3>, dx16_kernel<false, 128, 3>))
                              : (f16 ? pick(dx16_kernel<true, 64, 4>, dx16_kernel<true, 128, 4>)
                                     : pick(dx16_kernel<false, 64, 4>, dx16_kernel<false, 128, 4>));
    const long smem =
        (xk == 64 ? dx_geom<64>::SMEM : dx_geom<128>::SMEM) + (f16 ? DX_NST * 4 * RNND_DW16_E : 0);
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<a->sms, DX_THREADS, smem, stream>>>(static_cast<const uint8_t *>(a->chunks), a->exp,
                                                 a->pitch, a->nch, a->w_ih, a->H, a->Il, a->B, a->T,
                                                 a->dx);
    CUDA_LAUNCH_CHECK();
    return 0;
}
