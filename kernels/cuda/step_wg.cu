/*
 * step_wg.cu: step.cu's tile kernel (many rows, TF32 mode) on warpgroup MMAs (wgmma, sm_90a only:
 * built for that target alone, asked for on a compute 9.0 device only). Same arguments, tiles
 * and outputs as step_kernel's 64 x 32 tiles (step.cu's header), which it replaces there for
 * rows and weights that allow 16-byte copies.
 *
 * Why (docs/kernels.md): at B = 1024, H = I = 256 the mma.sync kernel is
 * bound by its instruction chains (5.8M instructions a step: fragments, 3072 MMAs a block, copy
 * arithmetic), not by bytes. Here one warpgroup's MMA instruction does a 64 x N x 8 product
 * straight from shared memory, and the copies are what is left: 40 MB through L2 a step at that
 * shape, which a copy-only loop of the same tiles streams in ~9 us.
 *
 * Block (unit slice s, row tile t): 64 rows x 32 units with all their gates, two warpgroups;
 * warpgroup q computes units [16q, 16q + 16) of every gate plane. The rows [x | h] are the MMA's
 * A (M = 64 rows, shared by both), the gate rows of [W_ih | W_hh] its B (N = G * 16 a warpgroup:
 * plane p's units at rows 16p.. of the warpgroup's half of the weight tile), both K-major fp32 in
 * 128-byte swizzled rows in shared memory, fed through the tensor cores' tf32 (their operands'
 * low mantissa bits are ignored, as in step.cu's mma.sync). K runs in chunks of 32 columns (x
 * chunks, then h chunks) through a 4-stage pipeline 3 chunks ahead of the MMAs: the h rows (and
 * the x part of layers above 0) by every thread's cp.async, gathered by slot; the weight tile and
 * layer 0's x rows by tensor-map copies (TMA) of thread 0 (docs/kernels.md: 0.5
 * and 1.2 us less than by cp.async for GRU and LSTM), handed over by mbarriers (a chunk's copies
 * and bytes: s_full; every thread done with a stage: s_empty), with no block barrier in the loop.
 * Accumulators: GRU dx (the x part: r, z, n_x) and dh (the h part: r, z, n_h), 24 registers
 * each; LSTM one, 32 registers. D fragment: warp w,
 * lane (g, tg) holds rows 16w + g + 8h (h = 0, 1) and units 16q + 8j + 2tg + e (j, e = 0, 1) of
 * every plane p at d[4 (2p + j) + 2h + e], so the cell runs in registers. The old h comes from
 * the block's own h chunk while it is resident, the old c (LSTM) lands in shared memory during
 * the loop; biases are read from shared memory in the cell. The new h and c go straight to their
 * table rows (step_kargs).
 *
 * Two blocks an SM (docs/kernels.md): with 4 stages a block takes ~90 KB (GRU)
 * or ~100 KB (LSTM) of shared memory and at most 128 registers a thread, so the next kernel's
 * blocks are resident while this one runs (its programmatic launch comes after this grid's
 * wait) and grids of up to twice the SMs run in one wave. Fewer chunks in flight (2 instead of
 * 6) cost 0.3-0.6 us where a step starts cold (after a copy); back to back and in graphs the
 * overlap gains 1.6-1.8 us at B = 1024, I = H = 256.
 *
 * The chain before the first MMA (docs/kernels.md): with a.pre, thread 0 sets up
 * the mbarriers and issues the first chunks' weight boxes, and the block loads its biases, before
 * griddepcontrol.wait, so that on back-to-back steps and between layers the first weights come
 * while the previous kernel completes; at layer 0 the x chunks need no slot, so their MMAs start
 * while the slots and the gathered rows load. With a.early_x (layer 0 after a step that wrote
 * none of this step's inputs) the wait moves to the first h chunk: the x chunks' copies and MMAs
 * and the slot reads all overlap the previous step (the lead "overlap the next step's
 * independent MMA" of issue 8).
 */
#include "seq_cells.cuh"
#include "step_impl.cuh"
#include "wg.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

namespace {

constexpr int SW_MT = RNND_STEP_WG_MT, SW_UT = RNND_STEP_WG_UT; // rows, units a block
constexpr int SW_NT = 256; // two warpgroups: units [0, 16) and [16, 32) of every gate
constexpr int SW_KC = 32;  // columns a chunk: one 128-byte row, 4 k-steps
constexpr int NS = 4;      // stages, all filled before the first MMA
constexpr int SW_ATILE = SW_MT * SW_KC * 4; // bytes of a stage's row tile

constexpr int SW_CLD = SW_UT + 8; // row pitch (floats) of the old-c tile

// Shared memory (bytes) for G gate planes: stages (row tile, then weight tile), old c (LSTM),
// biases [b_ih | b_hh] of the block's N gate rows.
template <int G>
struct sw_layout {
    static constexpr int N = G * SW_UT;
    static constexpr int STAGE = SW_ATILE + N * SW_KC * 4;
    static constexpr int OFF_C = NS * STAGE;
    static constexpr int OFF_B = OFF_C + (G == 4 ? SW_MT * SW_CLD * 4 : 0);
    static constexpr int SMEM = OFF_B + 2 * N * 4 + 1024; // + the stages' 1024-byte alignment
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d = A B^T (ACC: d += A B^T): m64 nN k8, tf32 operands (fp32 bit patterns) from shared memory
// (descriptors). The first k-step writes d without reading it: no instruction outside the MMAs
// defines the accumulators (ptxas would serialize the MMAs, C7515).
#define SW_D8(c, i)                                                                                \
    c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]),         \
        c(d[i + 7])
#define SW_MMA(N, LAST)                                                                            \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #LAST ", 0;\n"                                            \
    "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 "
#define SW_N48                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
    "%16, %17, %18, %19, %20, %21, %22, %23}, "                                                    \
    "%24, %25, p, 1, 1;\n}\n"
#define SW_N64                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "            \
    "%32, %33, p, 1, 1;\n}\n"
template <bool ACC>
__device__ __forceinline__ void sw_mma(float (&d)[24], uint64_t a, uint64_t b) {
    if constexpr (ACC)
        asm volatile(SW_MMA(48, 26) SW_N48
                     : SW_D8("+f", 0), SW_D8("+f", 8), SW_D8("+f", 16)
                     : "l"(a), "l"(b), "n"(1));
    else
        asm volatile(SW_MMA(48, 26) SW_N48
                     : SW_D8("=f", 0), SW_D8("=f", 8), SW_D8("=f", 16)
                     : "l"(a), "l"(b), "n"(0));
}
template <bool ACC>
__device__ __forceinline__ void sw_mma(float (&d)[32], uint64_t a, uint64_t b) {
    if constexpr (ACC)
        asm volatile(SW_MMA(64, 34) SW_N64
                     : SW_D8("+f", 0), SW_D8("+f", 8), SW_D8("+f", 16), SW_D8("+f", 24)
                     : "l"(a), "l"(b), "n"(1));
    else
        asm volatile(SW_MMA(64, 34) SW_N64
                     : SW_D8("=f", 0), SW_D8("=f", 8), SW_D8("=f", 16), SW_D8("=f", 24)
                     : "l"(a), "l"(b), "n"(0));
}
#undef SW_D8
#undef SW_MMA
#undef SW_N48
#undef SW_N64
#endif

template <class Cell>
__global__ void __launch_bounds__(SW_NT, 2)
    step_wg_kernel(const step_kargs a, const __grid_constant__ CUtensorMap tw_ih,
                   const __grid_constant__ CUtensorMap tw_hh,
                   const __grid_constant__ CUtensorMap tx, const bool xt) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int G = Cell::G, N = G * SW_UT, ND = N / 4; // a warpgroup's N / 2 columns
    constexpr bool GRU = G == 3;
    using LY = sw_layout<G>;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ const float *s_xrow[SW_MT], *s_hrow[SW_MT]; // row sources, NULL: zeros
    __shared__ int s_slot[SW_MT], s_slot_new[SW_MT];       // table rows: old state, new state
    __shared__ uint64_t s_full[NS], s_empty[NS];           // a stage's copies landed; released

    const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 7, w = (tid >> 5) & 3;
    const int g = lane >> 2, tg = lane & 3;
    const int H = a.H, L = a.L, l = a.l, Il = l == 0 ? a.I : H;
    const int row0 = blockIdx.y * SW_MT, u0 = blockIdx.x * SW_UT;
    const int cx = CEIL_DIV(Il, SW_KC), nc = cx + CEIL_DIV(H, SW_KC);
    unsigned char *sm = smem + (-smem_u32(smem) & 1023); // the stages' atoms: 1024-byte aligned
    const uint32_t sbase = smem_u32(sm);
    // Chunk c's stage and the parity of its use of it: in unsigned arithmetic (NS is a power of
    // two), where signed division and remainder cost the K loop instructions every chunk.
    auto stg = [](int c) { return (unsigned)c % NS; };
    auto par = [](int c) { return (int)((unsigned)c / NS & 1); };

    // Chunk c (x columns for c < cx, h columns after) into stage c % NS, in 128-byte swizzled
    // rows (wg.cuh). By thread 0, tensor-map boxes whose bytes s_full expects: load_w the weight
    // tile in two (warpgroup q's rows: units u0 + 16q.. of every gate plane, zeros past K and
    // H), load_x at layer 0 (xt) the x rows of x chunks (dense rows: zeros past K and B).
    auto load_w = [&](int c) {
        const bool hp = c >= cx;
        const uint32_t dst = sbase + stg(c) * LY::STAGE + SW_ATILE;
        mbar_expect_tx(s_full + stg(c), N * SW_KC * 4);
#pragma unroll
        for (int q = 0; q < 2; q++)
            tma_load_3d(dst + q * N / 2 * 128, hp ? &tw_hh : &tw_ih, (hp ? c - cx : c) * SW_KC,
                        u0 + 16 * q, 0, smem_u32(s_full + stg(c)));
    };
    auto load_x = [&](int c) {
        if (!xt || c >= cx)
            return;
        mbar_expect_tx(s_full + stg(c), SW_ATILE);
        tma_load_2d(sbase + stg(c) * LY::STAGE, &tx, c * SW_KC, row0, smem_u32(s_full + stg(c)));
    };
    float *bias = reinterpret_cast<float *>(sm + LY::OFF_B);
    // Weights that need no slot: the first chunks' boxes (thread 0, after the mbarriers' set-up)
    // and the biases, before the wait where a.pre allows.
    auto load_weights = [&] {
        if (tid == 0) {
            tma_prefetch_desc(&tw_ih);
            tma_prefetch_desc(&tw_hh);
            if (xt)
                tma_prefetch_desc(&tx);
            // full: every thread's copies and the boxes' bytes; empty: every thread done with
            // the stage (MMAs, read_h).
            mbar_ring_init(s_full, s_empty, NS, SW_NT, SW_NT);
            for (int c = 0; c < NS && c < nc; c++)
                load_w(c);
        }
        for (int e = tid; e < 2 * N; e += SW_NT) {
            const int n = e % N, u = u0 + n % SW_UT;
            bias[e] = u < H ? __ldcg((e < N ? a.b_ih : a.b_hh) + (n / SW_UT) * H + u) : 0.0f;
        }
    };
    // With a.early_x (which implies a.pre) the wait comes later, before the first h chunk.
    if (a.early_x)
        load_weights();
    else
        step_wait(a, load_weights);
    __syncthreads(); // the mbarriers are set up before anyone arrives on them

    // The start of the reads of what the previous step wrote (the state table), in the prologue,
    // or with a.early_x before the first h chunk's copies, where the programmatic wait comes
    // first: everything before it read only weights and this step's inputs, which the previous
    // kernel did not write, so the x chunks' copies and MMAs overlap it. Then, for the LSTM, the
    // old c of the tile's (row, unit) elements, zero where the row resets; it lands before the
    // next chunk the thread arrives on (cp_async_mbar_arrive waits for all its copies), long
    // before the cell.
    float *cs = reinterpret_cast<float *>(sm + LY::OFF_C);
    auto start_h = [&] {
        if (a.early_x)
            grid_wait_then_release();
        if constexpr (!GRU) {
#pragma unroll
            for (int i = 0; i < SW_MT * SW_UT / 4 / SW_NT; i++) {
                const int m = (tid >> 3) + 32 * i, k = 4 * (tid & 7);
                const bool ok = s_hrow[m] && u0 + k < H;
                const size_t at = ((size_t)s_slot[m] * L + l) * H + u0 + k;
                cp_async16(cs + m * SW_CLD + k, ok ? a.state_c + at : a.w_ih, ok);
            }
        }
    };

    // The row tile's gathered rows (the h chunks; x chunks above layer 0): thread t copies
    // 16-byte unit t % 8 of row (t / 8) % 8 of the 8-row atoms t / 64 + 4i: 8 consecutive lanes
    // read one row's 128 contiguous bytes and write one 128-byte line. Past K and in absent or
    // resetting rows the copies write zeros.
    const int kq = tid & 7, r8 = (tid >> 3) & 7, jp = tid >> 6;
    uint32_t a_base = sbase + jp * 1024 + r8 * 128 + ((kq ^ r8) << 4);
    asm("" : "+r"(a_base)); // kept, not rebuilt from the thread index every chunk
    // The thread's rows' sources, read from the row table once, not every chunk (with the
    // unsigned stage arithmetic above: 3-6% off the B = 1024 steps).
    const float *my_x[SW_MT / 32], *my_h[SW_MT / 32];
    auto load_a = [&](int c) {
        const bool hp = c >= cx;
        if (a.early_x && c == cx)
            start_h();
        if (xt && !hp)
            return;
        const int K = hp ? H : Il, k = (hp ? c - cx : c) * SW_KC + 4 * kq;
        const uint32_t dst = a_base + stg(c) * LY::STAGE;
#pragma unroll
        for (int i = 0; i < SW_MT / 32; i++) {
            const float *src = hp ? my_h[i] : my_x[i];
            const bool ok = k < K && src;
            cp_async16(dst + 4096 * i, ok ? src + k : a.w_ih, ok);
        }
    };

    // Layer 0's x chunks come by tensor map alone: the threads' arrivals on those in the prologue
    // go out before the slots are read, so their MMAs need not wait for the slots.
    const int pro = min(NS, nc), own = xt ? min(cx, pro) : 0;
    if (tid == 0)
        for (int c = 0; c < pro; c++)
            load_x(c);
    for (int c = 0; c < own; c++)
        mbar_arrive(s_full + c);
    if (tid < SW_MT) {
        const step_row r = step_row_at(a, row0 + tid);
        s_slot[tid] = r.slot, s_slot_new[tid] = r.slot_new, s_xrow[tid] = r.x, s_hrow[tid] = r.h;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < SW_MT / 32; i++)
        my_x[i] = s_xrow[32 * i + 8 * jp + r8], my_h[i] = s_hrow[32 * i + 8 * jp + r8];
    if (!a.early_x)
        start_h();
    for (int c = own; c < pro; c++) {
        load_a(c);
        cp_async_mbar_arrive(s_full + c);
    }

    // The old h of the thread's cell elements (rows 16w + g + 8h, units 16q + 8j + 2tg + e, as
    // the D fragment's) is in the block's own h chunk, which holds the row tile's h columns
    // [u0, u0 + 32) (zeros where a row resets or is absent, or past H): read while it is resident.
    const int hc = cx + blockIdx.x;
    float2 hp[2][2];
    auto read_h = [&](const unsigned char *st) {
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = 16 * w + g + 8 * h, uu = 16 * wq + 8 * j + 2 * tg;
                const int at = (m >> 3) * 1024 + (m & 7) * 128 + (((uu >> 2) ^ (m & 7)) << 4);
                hp[j][h] = *reinterpret_cast<const float2 *>(st + at + (uu & 3) * 4);
            }
    };
    // Chunk c's MMAs into d (acc false: the first chunk of d, which it writes), after its wait on
    // s_full. While they run, the copies of chunk c - 1 + NS go out into the stage of chunk c - 1
    // once every thread has released it (s_empty). Then the thread waits for its warpgroup's MMAs
    // on chunk c and releases its stage (and its own reads of it, read_h: a release of every
    // thread rather than one a warp). No barrier of the block. So NS - 1 chunks are in flight
    // beside the one in the MMAs, where letting the MMAs of two chunks overlap (waiting for the
    // one before only) would leave NS - 2: the deeper copies took 3-5% off the B = 1024 steps.
    float dx[ND], dh[GRU ? ND : 1];
    auto chunk = [&](int c, float(&d)[ND], bool acc) {
        mbar_wait(s_full + stg(c), par(c));
        const unsigned char *st = sm + stg(c) * LY::STAGE;
        if (c == hc)
            read_h(st);
        const uint64_t ad = wg_desc_sw128(st), bd = wg_desc_sw128(st + SW_ATILE + wq * N / 2 * 128);
        wg_fence();
        if (acc) // a constant where the lambda is inlined: no MMA under a run-time condition
            sw_mma<true>(d, ad, bd);
        else
            sw_mma<false>(d, ad, bd);
#pragma unroll
        for (int ks = 1; ks < SW_KC / 8; ks++)
            sw_mma<true>(d, ad + 2 * ks, bd + 2 * ks); // 32 bytes a k-step
        wg_commit();
        const int f = c - 1 + NS;
        if (c >= 1 && f < nc) {
            mbar_wait(s_empty + stg(f), par(c - 1));
            if (tid == 0) {
                load_w(f);
                load_x(f);
            }
            load_a(f);
            cp_async_mbar_arrive(s_full + stg(f));
        }
        wg_wait<0>();
        mbar_arrive(s_empty + stg(c));
    };
    chunk(0, dx, false);
    for (int c = 1; c < cx; c++)
        chunk(c, dx, true);
    if constexpr (GRU) {
        chunk(cx, dh, false);
        for (int c = cx + 1; c < nc; c++)
            chunk(c, dh, true);
    } else {
        for (int c = cx; c < nc; c++)
            chunk(c, dx, true);
    }
    wg_wait<0>();

    // The cell on the thread's (row, unit) elements; the top layer's new h to out, the new
    // states to their table rows (8-byte stores: the table's rows and H allow them).
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = 16 * w + g + 8 * h, b = row0 + m, uu = 16 * wq + 8 * j + 2 * tg;
            const int u = u0 + uu;
            if (b >= a.B || u >= H) // H % 4 == 0: units u and u + 1 both exist or neither
                continue;
            const float2 ho = hp[j][h];
            const float2 co = GRU ? make_float2(0.0f, 0.0f)
                                  : *reinterpret_cast<const float2 *>(cs + m * SW_CLD + uu);
            float hn[2], cn[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float xq[G], hq[G], s[Cell::SW];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const int di = 4 * (2 * q + j) + 2 * h + e;
                    xq[q] = dx[di] + bias[q * SW_UT + uu + e];
                    hq[q] = bias[N + q * SW_UT + uu + e];
                    if constexpr (GRU) {
                        if (q < 2)
                            xq[q] += dh[di];
                        else
                            hq[q] += dh[di];
                    }
                }
                Cell::template forward<true>(xq, hq, e ? ho.y : ho.x, e ? co.y : co.x, hn[e], cn[e],
                                             s);
            }
            // Scalar stores: the callers' outputs need only 4-byte alignment.
            const size_t bl = ((size_t)b * L + l) * H + u;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (a.out)
                    a.out[(size_t)b * H + u + e] = hn[e];
                if (a.h_before)
                    a.h_before[bl + e] = e ? ho.y : ho.x;
                if (a.c_before)
                    a.c_before[bl + e] = e ? co.y : co.x;
            }
            const size_t at = ((size_t)s_slot_new[m] * L + l) * H + u;
            *reinterpret_cast<float2 *>(a.state_h + at) = make_float2(hn[0], hn[1]);
            if (!GRU)
                *reinterpret_cast<float2 *>(a.state_c + at) = make_float2(cn[0], cn[1]);
        }
#else
    (void)a, (void)tw_ih, (void)tw_hh, (void)tx, (void)xt;
    __trap(); // never launched: the host asks for this kernel on sm_90 only
#endif
}

// cuTensorMapEncodeTiled from the driver (the runtime has no wrapper), looked up once; NULL
// where the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            p = nullptr;
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }();
    return fn;
}

// A K-major fp32 tensor (rank 2 or 3: {K, rows, planes}) as a tensor map of the given boxes in
// 128-byte swizzled rows, zeros outside it.
int fp32_map(CUtensorMap *m, int rank, const float *p, const cuuint64_t *dims,
             const cuuint32_t *box) {
    const cuuint64_t strides[2] = {dims[0] * 4, dims[0] * dims[1] * 4}; // bytes
    const cuuint32_t step[3] = {1, 1, 1};
    return encode_tiled()(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, rank, const_cast<float *>(p), dims,
                          strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : RNND_EDEVICE;
}

template <class Cell>
int wg_attr() {
    RNND_CUDA_TRY(cudaFuncSetAttribute(step_wg_kernel<Cell>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       sw_layout<Cell::G>::SMEM));
    return 0;
}

// The weights (G gate planes of H rows x K) as load_w's boxes: 32 columns x 16 units x G planes;
// layer 0's x (B rows x I) as row tiles of 32 columns x 64 rows.
template <class Cell>
int wg_launch(struct cuda_ctx *c, const step_kargs &a) {
    constexpr int G = Cell::G;
    const int Il = a.l == 0 ? a.I : a.H;
    const bool xt = a.l == 0;
    CUtensorMap ih, hh, tx = {};
    const cuuint64_t dih[3] = {(cuuint64_t)Il, (cuuint64_t)a.H, G};
    const cuuint64_t dhh[3] = {(cuuint64_t)a.H, (cuuint64_t)a.H, G};
    const cuuint32_t bw[3] = {SW_KC, 16, G}, bx[2] = {SW_KC, SW_MT};
    RNND_TRY(fp32_map(&ih, 3, a.w_ih, dih, bw));
    RNND_TRY(fp32_map(&hh, 3, a.w_hh, dhh, bw));
    if (xt) {
        const cuuint64_t dx[2] = {(cuuint64_t)a.I, (cuuint64_t)a.B};
        RNND_TRY(fp32_map(&tx, 2, a.x, dx, bx));
    }
    const dim3 grid(CEIL_DIV(a.H, SW_UT), CEIL_DIV(a.B, SW_MT)), block(SW_NT);
    return step_kernel_launch(c, step_wg_kernel<Cell>, grid, block, sw_layout<G>::SMEM, true, a, ih,
                              hh, tx, xt);
}

} // namespace

int rnnd__wg_step_prepare(void) {
    if (encode_tiled() == nullptr)
        return RNND_EDEVICE;
    RNND_TRY(wg_attr<cell_gru>());
    return wg_attr<cell_lstm>();
}

int rnnd__wg_step_launch(struct cuda_ctx *c, const step_kargs &a, bool lstm) {
    if (!a.vec_x || !a.vec_h) // 16-byte copies only: step.cu's kernel takes the others
        return RNND_EINVAL;
    return lstm ? wg_launch<cell_lstm>(c, a) : wg_launch<cell_gru>(c, a);
}
