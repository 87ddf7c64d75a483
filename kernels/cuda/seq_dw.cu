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
 * columns over its chunks (K = 16 rows each, one k-step). Two consumer warpgroups, m64 each,
 * hold 100 fp32 accumulators a thread (m64n200k16); one producer lane brings RNND_DW16_CH chunks
 * a stage by two bulk copies (three with the records) into DW_NST stages (mbarriers full /
 * empty). Each CTA writes its partial product; a second kernel sums the ks partials in a fixed
 * order (runs repeat bitwise) and adds each sum into the parameter gradient it belongs to,
 * undoing the chunks' column order.
 */
#include "common.cuh"
#include "seq_chunks.h"
#include "wg.cuh"

#include <cuda_bf16.h>

namespace {

constexpr int DW_NST = 4;           // stages
constexpr int DW_MP = RNND_DW16_MP; // D's columns a plane
constexpr long DW_STAGE = RNND_DW16_CH * (RNND_DW16_D + RNND_DW16_Z);
constexpr long DW_SMEM = DW_NST * DW_STAGE + 2 * DW_NST * 8;
constexpr int DW_THREADS = 288; // 8 consumer warps, 1 producer warp

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
// d += A B, m64 nN k16, fp16, A from registers (this warp's 16 rows), B in shared memory:
// K-major, or N-major where TB (dw256's z pieces).
template <bool TB = false>
__device__ __forceinline__ void mma_f16_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RNND_P64
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, %69;\n"
                 : RNND_D32(0), RNND_D32(32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB ? 1 : 0));
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
template <bool F16>
__global__ void __launch_bounds__(DW_THREADS, 1)
    dw16_kernel(const uint8_t *__restrict__ chunks, const uint8_t *__restrict__ zch,
                const int16_t *__restrict__ exp, int pitch, int ks, float *__restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr long STAGE = DW_STAGE + (F16 ? RNND_DW16_CH * RNND_DW16_E : 0);
    extern __shared__ __align__(1024) uint8_t sm[];
    uint64_t *full = reinterpret_cast<uint64_t *>(sm + DW_NST * STAGE), *empty = full + DW_NST;
    const int p = blockIdx.x % 4, s = blockIdx.x / 4, warp = threadIdx.x / 32;
    const int per = pitch / ks, c0 = s * per, nst = per / RNND_DW16_CH;
    const uint8_t *A = chunks + ((size_t)p * pitch + c0) * RNND_DW16_D;
    const uint8_t *B = zch + (size_t)c0 * RNND_DW16_Z;
    if (threadIdx.x == 0)
        mbar_ring_init(full, empty, DW_NST, 1, 8); // empty: lane 0 of each consumer warp
    __syncthreads();
    if (warp == 8) {
        if (threadIdx.x % 32 == 0)
            for (int i = 0; i < nst; i++) {
                const int st = mbar_ring_fill(full, empty, i, DW_NST, (uint32_t)STAGE);
                uint8_t *dst = sm + st * STAGE;
                bulk_g2s(dst, A + (size_t)i * RNND_DW16_CH * RNND_DW16_D,
                         RNND_DW16_CH * RNND_DW16_D, full + st);
                bulk_g2s(dst + RNND_DW16_CH * RNND_DW16_D,
                         B + (size_t)i * RNND_DW16_CH * RNND_DW16_Z, RNND_DW16_CH * RNND_DW16_Z,
                         full + st);
                if constexpr (F16)
                    bulk_g2s(dst + DW_STAGE,
                             reinterpret_cast<const uint8_t *>(exp) +
                                 (size_t)(c0 + i * RNND_DW16_CH) * RNND_DW16_E,
                             RNND_DW16_CH * RNND_DW16_E, full + st);
            }
        return;
    }
    const int wg = warp / 4, lane = threadIdx.x % 32;
    float d[100];
#pragma unroll
    for (int i = 0; i < 100; i++)
        d[i] = 0.0f;
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
        // The n200 order of the accumulators (n8 group j at d[4j..]): h, x, the constant.
        float(&dh)[64] = *reinterpret_cast<float(*)[64]>(d);
        float(&dx)[32] = *reinterpret_cast<float(*)[32]>(d + 64);
        float(&dc)[4] = *reinterpret_cast<float(*)[4]>(d + 96);
        const int q = lane >> 3;
        for (int i = 0; i < nst; i++) {
            const int st = i % DW_NST;
            mbar_wait(full + st, (i / DW_NST) & 1);
            const uint8_t *a = sm + st * STAGE, *b = a + RNND_DW16_CH * RNND_DW16_D;
            const int16_t *recs = reinterpret_cast<const int16_t *>(a + DW_STAGE);
            uint32_t ah[RNND_DW16_CH][4], ax[RNND_DW16_CH][4];
#pragma unroll
            for (int c = 0; c < RNND_DW16_CH; c++) {
                // Matrix q: D columns 16w + 8 (q & 1).., K rows 8 (q >> 1)..; lane (g, tg)
                // gets column g (+8) and rows 2tg, 2tg+1 (+8): m16k16's A fragment (the
                // core matrices are row-major in TF32 mode: transposed).
                uint32_t r[4];
                ldmatrix_x4_at<true>(r, a + c * RNND_DW16_D + w * 512 + (q & 1) * 256 +
                                            (q >> 1) * 128 + (lane & 7) * 16);
                const int16_t *rec = recs + c * (RNND_DW16_E / 2);
                dw_scale_rows(r, rec + w * 16, rec + 128, rec + 144, lane, ch, cx, ah[c], ax[c]);
            }
            wg_fence();
#pragma unroll
            for (int c = 0; c < RNND_DW16_CH; c++) {
                const uint8_t *z = b + c * RNND_DW16_Z;
                mma_f16_n128(dh, ah[c], wg_desc(z, 256));
                mma_f16_n8(dc, ah[c], wg_desc(z + 24 * 256, 256));
                mma_n64_rs<true>(dx, ax[c], wg_desc(z + 16 * 256, 256));
            }
            wg_commit();
            // Drained at once: the next stage's A registers are written next, and the stage's
            // bytes take far longer to arrive than its MMAs take.
            wg_wait<0>();
            if (lane == 0)
                mbar_arrive(empty + st);
        }
        // Back to true values: h's columns and the constant's by 2^ch, x's by 2^cx.
#pragma unroll
        for (int k = 0; k < 100; k++)
            d[k] = ldexpf(d[k], k < 64 || k >= 96 ? ch : cx);
    } else {
        // Whole stages only: ptxas serialises an MMA under a run-time condition (the caller pads
        // the chunks with zeros to a multiple of ks stages).
        for (int i = 0; i < nst; i++) {
            const int st = i % DW_NST;
            mbar_wait(full + st, (i / DW_NST) & 1);
            const uint8_t *a = sm + st * DW_STAGE, *b = a + RNND_DW16_CH * RNND_DW16_D;
            wg_fence();
#pragma unroll
            for (int c = 0; c < RNND_DW16_CH; c++)
                mma_n200(d, wg_desc(a + c * RNND_DW16_D + wg * 2048, 256),
                         wg_desc(b + c * RNND_DW16_Z, 256));
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
    float *o = part + (size_t)s * 4 * DW_MP * RNND_DW16_NZ;
#pragma unroll
    for (int c = 0; c < RNND_DW16_NZ / 8; c++) {
        const int col = c * 8 + 2 * (lane % 4);
        *reinterpret_cast<float2 *>(o + (size_t)row * RNND_DW16_NZ + col) =
            make_float2(d[4 * c], d[4 * c + 1]);
        *reinterpret_cast<float2 *>(o + (size_t)(row + 8) * RNND_DW16_NZ + col) =
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
// z's h columns go to W_hh, its x columns to W_ih, the constant to both biases. The GRU's planes
// 2 and 3 are n's hidden and input sides: W_hh and b_hh take plane 2, W_ih and b_ih plane 3.
// Units from H on (a layer of H < 128 in the loops of 128) belong to no gradient.
__global__ void dw16_sum_kernel(const float *__restrict__ part, int ks, int H, int Il, bool gru,
                                float *gw_ih, float *gw_hh, float *gb_ih, float *gb_hh) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 4 * DW_MP * RNND_DW16_NZ)
        return;
    const int m = i / RNND_DW16_NZ, n = i % RNND_DW16_NZ, p = m / DW_MP, um = dw16_unit(m % DW_MP);
    const bool hs = !gru || p != 3, xs = !gru || p != 2; // the plane feeds h's, x's side
    const int row = (gru && p == 3 ? 2 : p) * H + um;
    float *to = nullptr, *to2 = nullptr;
    if (um >= H)
        return;
    if (n < DW_MP)
        to = hs && dw16_unit(n) < H ? gw_hh + (size_t)row * H + dw16_unit(n) : nullptr;
    else if (n < DW_MP + 64)
        to = xs && n - DW_MP < Il ? gw_ih + (size_t)row * Il + n - DW_MP : nullptr;
    else if (n == DW_MP + 64)
        to = xs ? gb_ih + row : nullptr, to2 = hs ? gb_hh + row : nullptr;
    if (!to && !to2)
        return;
    float acc = 0.0f;
    for (int s = 0; s < ks; s++)
        acc += part[(size_t)s * 4 * DW_MP * RNND_DW16_NZ + i];
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
            mma_f16_n128<true>(dh0, ah[c], wg_desc_mn_sw128(z, 2048));
            mma_f16_n128<true>(dh1, ah[c], wg_desc_mn_sw128(z + 2 * 2048, 2048));
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
// directly) and B is W_ih^T, K-major bf16, resident in shared memory. m64n64k16, 32 accumulators a
// thread. One producer lane brings the 4 chunks' planes a stage (one bulk copy a plane).

constexpr int DX_NST = 2;
constexpr int DX_KMAX = 4 * DW_MP;              // the LSTM's 4 planes
constexpr long DX_WT = 64L * DX_KMAX * 2;       // W_ih^T: 64 inputs x K, bf16
constexpr long DX_STAGE = 4L * 4 * RNND_DW16_D; // 4 chunks x up to 4 planes
constexpr long DX_SMEM = DX_WT + DX_NST * DX_STAGE + 2 * DX_NST * 8;
constexpr int DX_THREADS = 160; // 4 consumer warps, 1 producer warp


// CTA: groups of 4 chunks [g0, g1). planes: the chunk planes of K's 128-column slots (GRU r, z
// and the input side of n: 0, 1, 3; LSTM 0-3), npl of them.
// F16 (TF32 mode): W_ih^T in fp16, scaled by the power of two that puts its largest |value| in
// [2^13, 2^14); each row's A (this warp's chunk row) scaled by 2^(eD - E) in k-step group w, E
// being the row's largest eD, so the factors are at most 1; the row's sums times 2^E / scale.
template <bool F16>
__global__ void __launch_bounds__(DX_THREADS, 1)
    dx16_kernel(const uint8_t *__restrict__ chunks, const int16_t *__restrict__ exp, int pitch,
                int nch, int npl, int plane2, const float *__restrict__ w_ih, int H, int Il, int B,
                int T, float *__restrict__ dx) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr long STAGE = DX_STAGE + (F16 ? 4 * RNND_DW16_E : 0);
    extern __shared__ __align__(1024) uint8_t sm[];
    uint8_t *wt = sm, *stages = sm + DX_WT;
    uint64_t *full = reinterpret_cast<uint64_t *>(stages + DX_NST * STAGE), *empty = full + DX_NST;
    const int K = npl * DW_MP, kg = K / 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ngroups = CEIL_DIV(nch, 4), per = CEIL_DIV(ngroups, (int)gridDim.x);
    const int g0 = blockIdx.x * per, g1 = min(g0 + per, ngroups);
    if (threadIdx.x == 0)
        mbar_ring_init(full, empty, DX_NST, 1, 4); // empty: lane 0 of each consumer warp
    __syncthreads();
    if (warp == 4) {
        if (lane == 0)
            for (int g = g0; g < g1; g++) {
                const int st =
                    mbar_ring_fill(full, empty, g - g0, DX_NST,
                                   (uint32_t)(npl * 4 * RNND_DW16_D + (F16 ? 4 * RNND_DW16_E : 0)));
                for (int s = 0; s < npl; s++) {
                    const int p = s < 2 ? s : s == 2 ? plane2 : 3;
                    bulk_g2s(stages + st * STAGE + s * 4 * RNND_DW16_D,
                             chunks + ((size_t)p * pitch + 4 * (size_t)g) * RNND_DW16_D,
                             4 * RNND_DW16_D, full + st);
                }
                if constexpr (F16)
                    bulk_g2s(stages + st * STAGE + DX_STAGE,
                             reinterpret_cast<const uint8_t *>(exp) + 4 * (size_t)g * RNND_DW16_E,
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
        for (int e = threadIdx.x; e < npl * H * Il; e += 128)
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
    for (int e = threadIdx.x; e < 64 * K; e += 128) {
        const int i = e / K, k = e % K, unit = dw16_unit(k % DW_MP);
        const float v = i < Il && unit < H ? w_ih[(size_t)((k / DW_MP) * H + unit) * Il + i] : 0.0f;
        if constexpr (F16)
            *reinterpret_cast<__half *>(wt + km_off(i, k, kg)) = __float2half_rn(v * wsc);
        else
            *reinterpret_cast<__nv_bfloat16 *>(wt + km_off(i, k, kg)) = __float2bfloat16_rn(v);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // for the MMAs' reads
    consumers_sync();
    const int q = lane >> 3; // the matrix whose row address this lane gives (ldmatrix.x4)
    for (int g = g0; g < g1; g++) {
        const int i = g - g0, st = i % DX_NST;
        mbar_wait(full + st, (i / DX_NST) & 1);
        // This warp's chunk; matrix q of a k-step: rows 8 (q & 1).., columns 8 (q >> 1)..
        const uint8_t *ch = stages + st * STAGE + warp * RNND_DW16_D + (q & 1) * 128 +
                            (q >> 1) * 256 + (lane & 7) * 16;
        // k-step ks: slot ks / 8 (4 chunks a slot), columns 16 (ks % 8).. of the chunk. Core
        // matrices K-major (bf16): transposed; row-major (TF32 mode's fp16): as they are.
        auto frag = [&](uint32_t(&a)[4], int ks) {
            ldmatrix_x4_at<!F16>(a, ch + (ks / 8) * 4 * RNND_DW16_D + (ks % 8) * 512);
        };
        float d[32];
        int erow[2] = {0, 0}; // F16: rows lane / 4 and + 8's largest eD
        if constexpr (F16) {
            const int16_t *rec = reinterpret_cast<const int16_t *>(stages + st * STAGE + DX_STAGE +
                                                                   warp * RNND_DW16_E);
            uint32_t f[2][8];
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
            // A slot's 8 fragments loaded and scaled before its MMAs: the loads in flight
            // together, one fence for the registers the MMAs read.
#pragma unroll
            for (int k = 0; k < 32; k++)
                d[k] = 0.0f;
            for (int slot = 0; slot < npl; slot++) {
                uint32_t as[8][4];
#pragma unroll
                for (int w = 0; w < 8; w++) {
                    frag(as[w], slot * 8 + w);
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        as[w][j] = hmul2(as[w][j], f[j & 1][w]);
                }
                wg_fence();
#pragma unroll
                for (int w = 0; w < 8; w++)
                    mma_n64_rs<true>(d, as[w], wg_desc(wt + (slot * 8 + w) * 256, kg * 128));
            }
        } else {
            uint32_t a[4];
            frag(a, 0);
            wg_fence(); // the MMA reads registers just written
            mma_n64_rs<false, false>(d, a, wg_desc(wt, kg * 128));
            for (int ks = 1; ks < K / 16; ks++) {
                frag(a, ks);
                wg_fence();
                mma_n64_rs<false>(d, a, wg_desc(wt + ks * 256, kg * 128));
            }
        }
        wg_commit();
        wg_wait<0>();
        if (lane == 0)
            mbar_arrive(empty + st);
        // Rows g, g + 8 of this warp's chunk c = 4 g + warp (block c / T, step c % T).
        const int c = 4 * g + warp, blk = c / T, t = c % T;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int b = blk * 16 + (lane >> 2) + 8 * h;
            if (c >= nch || b >= B)
                continue;
            float *row = dx + ((size_t)b * T + t) * Il;
            // 2^E is a normal float (E >= -126), or 0 for a zero row; both factors are 1 in
            // bf16 mode.
            const float e2 = ldexpf(1.0f, erow[h]), winv = 1.0f / wsc;
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const int col = 8 * n + 2 * (lane & 3);
                if (col < Il)
                    row[col] = d[4 * n + 2 * h] * e2 * winv;
                if (col + 1 < Il)
                    row[col + 1] = d[4 * n + 2 * h + 1] * e2 * winv;
            }
        }
    }
#else
    (void)chunks, (void)exp, (void)pitch, (void)nch, (void)npl, (void)plane2, (void)w_ih;
    (void)H, (void)Il;
    (void)B, (void)T, (void)dx;
#endif
}

} // namespace

int rnnd__dw16_product(const struct dw16_args *a, cudaStream_t stream) {
    if (a->H > DW_MP || a->H % 4 != 0 || a->Il < 1 || a->Il > 64 || a->ks < 1 || !a->z ||
        a->pitch % (a->ks * RNND_DW16_CH) != 0)
        return RNND_EINVAL;
    auto kernel = a->exp ? dw16_kernel<true> : dw16_kernel<false>;
    const long smem = DW_SMEM + (a->exp ? DW_NST * RNND_DW16_CH * RNND_DW16_E : 0);
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<4 * a->ks, DW_THREADS, smem, stream>>>(static_cast<const uint8_t *>(a->chunks),
                                                    static_cast<const uint8_t *>(a->z), a->exp,
                                                    a->pitch, a->ks, a->part);
    CUDA_LAUNCH_CHECK();
    const int n = 4 * DW_MP * RNND_DW16_NZ;
    dw16_sum_kernel<<<CEIL_DIV(n, 256), 256, 0, stream>>>(a->part, a->ks, a->H, a->Il, a->gru,
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
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(8 * a->ks), 1, 1);
    cfg.blockDim = dim3(D2_THREADS, 1, 1);
    cfg.dynamicSmemBytes = (size_t)D2_SMEM;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    RNND_CUDA_TRY(cudaLaunchKernelEx(&cfg, dw256_kernel, static_cast<const uint8_t *>(a->chunks),
                                     static_cast<const uint8_t *>(a->z),
                                     static_cast<const uint8_t *>(aux), a->exp, a->pitch, a->ks,
                                     a->part, *sy));
    const int n = 4 * 256 * RNND_DW256_NZ;
    dw256_sum_kernel<<<CEIL_DIV(n, 256), 256, 0, stream>>>(a->part, a->ks, a->Il, a->gru, a->gw_ih,
                                                           a->gw_hh, a->gb_ih, a->gb_hh);
    CUDA_LAUNCH_CHECK();
    return 0;
}

int rnnd__dx16_product(const struct dx16_args *a, cudaStream_t stream) {
    if (a->H > DW_MP || a->H % 4 != 0 || a->Il < 1 || a->Il > 64 || (a->npl != 3 && a->npl != 4) ||
        a->pitch < a->nch || a->sms < 1)
        return RNND_EINVAL;
    auto kernel = a->exp ? dx16_kernel<true> : dx16_kernel<false>;
    const long smem = DX_SMEM + (a->exp ? DX_NST * 4 * RNND_DW16_E : 0);
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<a->sms, DX_THREADS, smem, stream>>>(static_cast<const uint8_t *>(a->chunks), a->exp,
                                                 a->pitch, a->nch, a->npl, a->npl == 3 ? 3 : 2,
                                                 a->w_ih, a->H, a->Il, a->B, a->T, a->dx);
    CUDA_LAUNCH_CHECK();
    return 0;
}
