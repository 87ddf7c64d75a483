/*
 * seq_cluster.cu: the LSTM's and the GRU's forward and backward time loops at H = 256 in
 * thread-block clusters (sm_90; docs/kernels.md), described here for the LSTM; the GRU's
 * differences are at each kernel. W_hh at H = 256 (4H x H = 512 KB in fp16) does not fit
 * one SM, so a cluster of CL = 4 CTAs owns ROWS batch rows for all T steps and CTA r of the cluster
 * holds the gate rows of units [64r, 64r+64) (all four gates: 256 gate rows x K = 256, 128 KB of
 * fp16-scaled W_hh in shared memory). Each step every CTA computes the gates of its ROWS rows x 64
 * units, runs the cell for them and writes its slice of h' (fp16, scaled as in seq_forward.cuh's
 * forward) into its h tile, from which one bulk copy a CTA takes it into the others' tiles.
 *
 * Two cluster shapes, one template each loop (cshape below): ROWS = 64 (the default) and
 * ROWS = 80 (B = 2048 in 26 clusters, one wave on an H100; the plan, seq_plan.cu, picks it where
 * it saves a wave). 64 rows: W_ih's 256 x I_l slice in registers, h and x tiles
 * double-buffered; 80 rows (the `WIDE` branches): see the forward and backward kernels.
 *
 * The values another CTA waits for (h in the forward, dh's partials in the backward) travel by
 * bulk copies (h) or st.async (the partials) and complete on an mbarrier of the receiving CTA (one
 * phase a step), not by stores and a barrier.cluster.arrive.release: its fence waited for every
 * tape store the thread had issued (docs/kernels.md). Cluster barriers remain where a buffer is
 * rewritten only after every CTA has read it; they order reads alone, so they arrive relaxed.
 *
 * Warp w (8 a CTA) owns the CTA's units [8w, 8w+8) of every gate for all rows: MT = ROWS / 16
 * m-tiles x 4 n-tiles (n-tile q = gate q), so each A fragment (ldmatrix) serves 4 MMAs and each
 * B fragment MT. Lane (g, tg) owns rows 16 mt + g + 8 i and units 8w + 2tg + j (mt < MT, i,
 * j < 2): 4 MT (row, unit) elements whose c stays in registers. x (I_l <= 64, a multiple of 4) is
 * read by the loop into its own fp16 tile, each row scaled by the h scale where it fits fp16
 * with it, else by the power of two that puts its largest |x| in [2^13, 2^14) (either as exact
 * as TF32). The x part (m16n8k16 MMAs, as the h part) runs first, then (where a row took its
 * own scale) each row of the accumulator is brought to the h scale, so both parts share one
 * accumulator and one unscaling. Shared tiles use a 16-byte-chunk XOR swizzle instead of padding
 * (the padding would not fit): 64 rows 128 + 64 + 16 KB = 208 KB.
 *
 * The tape written is the one of the per-step path (z = [hprev | 1 | x], s = i, f, g, o, cprev;
 * the GRU's a_r, a_z, a_n, hn, and in blocks hprev), so either backward reads it: s in fp32
 * rows for the per-step backward, or (a.shalf) the fp16 planes in tape_b8's blocks
 * (seq_tape.cuh) for the backward loop in the same clusters
 * (below), which runs where it beats the per-step backward (seq_cluster_bwd in seq.cu: all the
 * batch's clusters at once, and not too few of them; docs/kernels.md). Where both
 * loops run here (the plan's cz, layer 0), z is instead written as the dw256 chunks of
 * seq_chunks.h (a.zc), and the backward writes D's chunks besides (or instead of) D, for
 * seq_dw.cu's weight-gradient product.
 */
#include "seq_tape.cuh"

namespace {

constexpr int CL = 4;        // CTAs a cluster
constexpr int HC = 256;      // hidden width
constexpr int UPC = HC / CL; // units a CTA
constexpr int NWC = 8;       // warps a CTA
constexpr int CTHREADS = NWC * 32;
constexpr int CKSH = HC / 16;  // h k-steps (fp16 m16n8k16)
constexpr int CXK = 64;        // x columns in the tile: I_l <= 64
constexpr int CXKS = CXK / 16; // x k-steps (fp16 m16n8k16)

// A cluster shape: ROWS batch rows a cluster, MT = ROWS / 16 m-tiles a warp. WIDE (80 rows): W_ih's
// fp16 fragments live in shared memory (after the x tiles) instead of registers, and dL/dh in the
// backward's receive slots; the LSTM's 80 rows do not fit the 64-row layouts besides (its
// forward's h tile single-buffered, its backward's receive slots in the A tile's memory; fshape,
// bshape; docs/kernels.md).
template <int ROWS>
struct cshape {
    static_assert(ROWS == 64 || ROWS == 80, "64 or 80 rows a cluster");
    static constexpr int MT = ROWS / 16;
    static constexpr bool WIDE = ROWS == 80;
    static constexpr long HTILE = (long)ROWS * HC * 2;
    // ROWS rows of a CTA's 64 units in fp16: the forward's h slab, a backward receive slot; the
    // forward's x tile (64 fp16 columns a row) has the same layout.
    static constexpr long PART = (long)ROWS * UPC * 2;
    static constexpr long XTILE = (long)ROWS * CXK * 2;
    // Backward: the A tile (ROWS x 256 gate columns, fp16) and 4 receive slots of ROWS x 64 fp16
    // partials, then their factors (a float a slot, row and 32 units).
    static constexpr long ATILE = (long)ROWS * HC * 2;
    static constexpr long RECV = CL * PART + (long)CL * ROWS * 2 * 4;
    static_assert(ROWS * (CXK / 4) == MT * CTHREADS, "x: MT float4 a thread, a row a half-warp");
    static_assert(ROWS % CL == 0, "x tape copy: ROWS / CL rows a CTA");
};

// The forward's shared memory for Cell: W_hh's fragments (WPL words a lane and k-step: the
// LSTM's four n-tiles, the GRU's three, mma_w), NB h tiles, two x tiles, and (WIDE) W_ih's
// fragments. The LSTM's 80 rows single-buffer the h tile to fit (128 KB of W_hh); the GRU's
// 96 KB leave room for two.
template <class Cell, int ROWS>
struct fshape {
    using S = cshape<ROWS>;
    static constexpr int WPL = Cell::G == 3 ? 6 : 8;
    static constexpr long WB = (long)CKSH * NWC * WPL * 32 * 4;
    static constexpr int NB = S::WIDE && Cell::G == 4 ? 1 : 2;
    static constexpr long XBASE = WB + NB * S::HTILE;
    static constexpr long WIHBASE = XBASE + 2 * S::XTILE;
    static constexpr long WIH = S::WIDE ? (long)CXKS * NWC * WPL * 32 * 4 : 0;
    static constexpr long SMEM = WIHBASE + WIH;
    static_assert(SMEM + 2 * ROWS * 4 + 256 <= RNND_PERSIST_SMEM_BUDGET,
                  "cluster forward does not fit");
};

// The backward's shared memory for Cell: W_hh's fragments (KS k-steps: the tile's gate columns /
// 16), the A tile, the receive slots. SHARE: the slots in the A tile's memory, where both would
// not fit (the LSTM's 80 rows: 128 KB of W_hh); the GRU's 96 KB leave room for both.
template <class Cell, int ROWS>
struct bshape {
    using S = cshape<ROWS>;
    static constexpr int KS = Cell::G * UPC / 16;
    static constexpr long WB = (long)KS * NWC * 8 * 32 * 4; // 8 words a lane and k-step
    static constexpr bool SHARE = S::WIDE && Cell::G == 4;
    static constexpr long RECVBASE = SHARE ? WB : WB + S::ATILE;
    static constexpr long SMEM =
        SHARE ? WB + (S::RECV > S::ATILE ? S::RECV : S::ATILE) : RECVBASE + S::RECV;
    static_assert(SMEM + NWC * ROWS * 4 + ROWS * 4 + 256 <= RNND_PERSIST_SMEM_BUDGET,
                  "cluster backward does not fit");
};

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
// For a barrier that only orders this thread's shared-memory reads before other CTAs' writes
// (write after read): the reads have returned (their values were used) before it, so no release,
// whose fence would also wait for every global store (the tape's) and st.async issued before.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The shared::cluster address of shared address s in CTA rank r of the cluster.
__device__ __forceinline__ uint32_t cluster_map(uint32_t s, uint32_t r) {
    uint32_t o = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(s), "r"(r));
#else
    (void)s, (void)r;
    __trap();
#endif
    return o;
}
__device__ __forceinline__ void cluster_st(uint32_t addr, uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
#else
    (void)addr, (void)v;
    __trap();
#endif
}
// st.async: a 4- or 16-byte store into shared memory at cluster address addr + OFF (any CTA of
// the cluster, this one included) whose bytes complete on the mbarrier at cluster address bar, in
// the CTA of addr. The receiver waits on that mbarrier (cluster_mbar_wait); the sender needs no
// barrier.cluster.arrive.release, which would first wait for every global store it issued before
// (the tape's; docs/kernels.md). OFF is an immediate: stores a few rows apart share one address
// register, where each address of its own took registers that the store before still had to
// read (docs/kernels.md).
template <int OFF>
__device__ __forceinline__ void cluster_st_async(uint32_t addr, uint32_t v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0+%3], %1, [%2];" ::"r"(addr),
        "r"(v), "r"(bar), "n"(OFF)
        : "memory");
#else
    (void)addr, (void)v, (void)bar;
    __trap();
#endif
}
template <int OFF>
__device__ __forceinline__ void cluster_st_async(uint32_t addr, uint4 v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0+%6], {%1, %2, "
                 "%3, %4}, [%5];" ::"r"(addr),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar), "n"(OFF)
                 : "memory");
#else
    (void)addr, (void)v, (void)bar;
    __trap();
#endif
}
// A bulk copy (the TMA engine) of `bytes` from this CTA's shared memory at src to cluster address
// dst, complete on the mbarrier at cluster address bar (in dst's CTA); commit and wait for every
// such copy of this thread to have read its source. Each writer of the source runs
// fence_proxy_async (seq_prims.cuh) before the barrier behind which one thread issues the copy.
__device__ __forceinline__ void cluster_bulk_s2s(uint32_t dst, uint32_t src, uint32_t bytes,
                                                 uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], "
                 "[%1], %2, [%3];" ::"r"(dst),
                 "r"(src), "r"(bytes), "r"(bar)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#else
    (void)dst, (void)src, (void)bytes, (void)bar;
    __trap();
#endif
}
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}
// A bulk copy of `bytes` from this CTA's shared memory at src to global dst, committed as above
// (bulk_wait_read waits for its read too).
__device__ __forceinline__ void bulk_s2g(void *dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#else
    (void)dst, (void)src, (void)bytes;
    __trap();
#endif
}
// The dw256 chunk (seq_chunks.h) of 16-row block blk (of the batch's nb) at step t: in the
// backward's order (steps from T - 1 down), so the product can take them as they are written.
__device__ __forceinline__ size_t dw256_chunk(int blk, int t, int T, int nb) {
    return (size_t)(T - 1 - t) * nb + blk;
}
// The backward's chunks of its k-th step (t = T - 1 - k) are written: after the bulk copies
// complete (wait_group N: all but the last N of this thread's groups), warp 0 (whose lanes made
// the copies and the records) tells the product (seq_dw.cu) by adding 1 to ready[k].
template <int N>
__device__ __forceinline__ void dw256_signal(unsigned *ready, int k, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if (lane == 0)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ready + k) : "memory");
#else
    (void)ready, (void)k, (void)lane;
#endif
}

// f(std::integral_constant<int, k>) for k = K .. N - 1: k is a constant expression in f (an
// immediate operand, an index).
template <int K, int N, class F>
__device__ __forceinline__ void static_for(F &&f) {
    if constexpr (K < N) {
        f(std::integral_constant<int, K>());
        static_for<K + 1, N>(f);
    }
}

// Lanes l and l ^ m (m = 1 or 2: lanes of one quad) each hold a value of two rows, r0 and r1,
// side by side in those rows (the lane with bit m clear on the left). After the swap the lane with
// bit m clear (up false) holds both lanes' r0, the other both lanes' r1, left value first: one
// store of twice the width where there were two.
template <class T>
struct pair2 {
    T lo, hi;
};
__device__ __forceinline__ uint32_t shfl_xor_u(uint32_t v, int m) {
    return __shfl_xor_sync(0xffffffffu, v, m);
}
__device__ __forceinline__ uint2 shfl_xor_u(uint2 v, int m) {
    return make_uint2(shfl_xor_u(v.x, m), shfl_xor_u(v.y, m));
}
template <class T>
__device__ __forceinline__ pair2<T> quad_swap(T r0, T r1, int m, bool up) {
    const T got = shfl_xor_u(up ? r0 : r1, m);
    return up ? pair2<T>{got, r1} : pair2<T>{r0, got};
}
__device__ __forceinline__ uint2 cat(pair2<uint32_t> p) {
    return make_uint2(p.lo, p.hi);
}
__device__ __forceinline__ uint4 cat(pair2<uint2> p) {
    return make_uint4(p.lo.x, p.lo.y, p.hi.x, p.hi.y);
}

// The mbarriers of the st.async exchanges (wg.cuh's, behind this file's sm_80 guards): each phase
// has one arrival, its CTA's own (arm: with the bytes the phase waits for), and completes when
// those bytes have landed; st.async's bytes may land before the arrival (the phase cannot
// complete without it). init: n of them at b, made visible to the cluster (one thread, before a
// cluster barrier).
__device__ __forceinline__ void cluster_mbar_init(uint64_t *b, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int k = 0; k < n; k++)
        mbar_init(b + k, 1);
    fence_mbar_init();
#else
    (void)b, (void)n;
#endif
}
__device__ __forceinline__ void cluster_mbar_arm(uint64_t *b, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mbar_arrive_expect_tx(b, bytes);
#else
    (void)b, (void)bytes;
#endif
}
__device__ __forceinline__ void cluster_mbar_wait(uint64_t *b, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mbar_wait(b, parity);
#else
    (void)b, (void)parity;
    __trap();
#endif
}
__device__ __forceinline__ void ldsm_x4(uint32_t a[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}

// Byte offsets in the swizzled tiles: row pitch P bytes, 16-byte chunk c stored at c ^ (row & 7).
// The forward's h tile in four slabs of 64 units (rank r's units in slab r, ROWS x 128 bytes,
// contiguous: one bulk copy a CTA), 128-byte rows, chunk c at c ^ (row & 7); the backward's
// tile likewise (gate q in slab q). A slab's 16-row block is a dw256 chunk piece as it stands.
template <int ROWS>
__device__ __forceinline__ uint32_t hsoff(int row, int unit) {
    return (uint32_t)((unit >> 6) * (ROWS * 128) + row * 128 +
                      ((((unit & 63) >> 3) ^ (row & 7)) << 4) + (unit & 7) * 2);
}
// Byte offset of (row, local unit) in a backward receive slot (fp16, 128-byte rows): units XOR
// 8 (row % 8), conflict-free 4-byte reads of a warp's 8 rows x 4 unit pairs.
__device__ __forceinline__ uint32_t roff(int row, int lu) {
    return (uint32_t)(row * (UPC * 2) + ((lu ^ ((row & 7) << 3)) << 1));
}

// The reset flags of a cluster's ROWS rows at a step: lane l loads those of rows l + 32 j (a byte
// each; rows past n read as 0), and at their use flag_bits gathers them by ballots. A lane's own
// 2 MT rows took a load each, as many as the tape record's, in the memory pipe that every load and
// store of a step shares (docs/kernels.md).
template <int ROWS>
struct row_flags {
    static constexpr int NW = (ROWS + 31) / 32;
    int v[NW];
    // p: row 0's flag at the step; row r's is r * stride further.
    __device__ __forceinline__ void load(const uint8_t *p, size_t stride, int n, int lane,
                                         bool on) {
#pragma unroll
        for (int j = 0; j < NW; j++)
            v[j] = ld_flag(p + (size_t)(lane + 32 * j) * stride, on && lane + 32 * j < n);
    }
};
// Lane (g, tg)'s view of a row_flags: whether its row k (row g + 8 k, k = 2 mt + i) is set.
template <int ROWS>
struct flag_bits {
    uint32_t m[row_flags<ROWS>::NW]; // word j: rows 32 j + g + 8 [0, 4) at bits 0, 8, 16, 24
    __device__ __forceinline__ flag_bits(const row_flags<ROWS> &f, int g) {
#pragma unroll
        for (int j = 0; j < row_flags<ROWS>::NW; j++)
            m[j] = __ballot_sync(0xffffffffu, f.v[j] != 0) >> g;
    }
    __device__ __forceinline__ bool operator()(int k) const {
        return (m[k >> 2] >> (8 * (k & 3))) & 1u;
    }
};

// max(m, |W|) over this CTA's gate rows q H + 64 rank + [0, 64) (q < G) of a weight of K
// columns.
__device__ __forceinline__ float gate_rows_absmax(float m, const float *W, int G, int H, int K,
                                                  int rank) {
    for (int q = 0; q < G; q++)
        m = fmaxf(m, persist_absmax(W + (size_t)(q * H + rank * UPC) * K, UPC * K));
    return m;
}

// The accumulators of a warp's MT m-tiles x 4 n-tiles, zeroed.
template <int MT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][4][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
            zero4(acc[mt][nt]);
}

// acc += A . B over KS k-steps (MMA Mode: m16n8k16 fp16 or m16n8k8 TF32, 16 or 8 k a step): A
// the warp's MT m-tiles of a swizzled tile of PITCH-byte rows (ab: the lane's ldmatrix addresses
// per ks % 4, ks / 4 adds K4 bytes; off: the tile's offset), B(ks, nt) the fragment of k-step
// ks and n-tile nt, after fetch(ks) (once a k-step, before the ldmatrix). n-tile SKIP (0..3)
// takes no MMA: the GRU's n gate keeps its x and h parts apart (the forward below).
template <class Mode, int KS, int PITCH, int K4, int SKIP = -1, int MT, class Fetch, class Bfrag>
__device__ __forceinline__ void mma_tile(float (&acc)[MT][4][4], const uint32_t (&ab)[4],
                                         uint32_t off, Fetch fetch, Bfrag B) {
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        uint32_t af[MT][4];
        fetch(ks);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            ldsm_x4(af[mt], ab[ks & 3] + off + (ks >> 2) * K4 + mt * 16 * PITCH);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
                if (nt != SKIP)
                    Mode::mma(acc[mt][nt], af[mt], B(ks, nt));
    }
}

// The fragment words o of n-tiles other than SKIP, in order: mma_w's 6-word layout.
template <int SKIP>
__device__ __forceinline__ void drop_ntile(uint32_t (&o)[8]) {
    if constexpr (SKIP >= 0)
#pragma unroll
        for (int f = SKIP; f < 3; f++)
            o[2 * f] = o[2 * f + 2], o[2 * f + 1] = o[2 * f + 3];
}

// acc += A . W over KS k-steps (fp16): A a tile as in mma_tile (the slabs of h or dh, or the x
// tile), B W's fragments in shared memory (wsm, 8 words a lane and k-step: W_hh, or WIDE's W_ih;
// 6 where n-tile SKIP is skipped, the others' in order).
template <int KS, int PITCH, int K4, int SKIP = -1, int MT>
__device__ __forceinline__ void mma_w(float (&acc)[MT][4][4], const unsigned char *wsm,
                                      const uint32_t (&ab)[4], uint32_t off, int w, int lane) {
    constexpr int WPL = SKIP < 0 ? 8 : 6;
    using WL = persist_wlayout<WPL>;
    // The fragments a k-step ahead (k-step ks in wv[ks & 1]): the MMAs do not wait for their load.
    uint32_t wv[2][WPL];
    WL::load(wv[0], wsm, 0, NWC, w, lane);
    mma_tile<mode_f16, KS, PITCH, K4, SKIP>(
        acc, ab, off,
        [&](int ks) {
            if (ks + 1 < KS)
                WL::load(wv[(ks + 1) & 1], wsm, ks + 1, NWC, w, lane);
        },
        [&](int ks, int nt) {
            const int f = SKIP >= 0 && nt > SKIP ? nt - 1 : nt; // the n-tile's fragment
            return make_uint2(wv[ks & 1][2 * f], wv[ks & 1][2 * f + 1]);
        });
}

// ---------------------------------------------------------------------------------------------
// Forward. Step t's h (this CTA's slab by its own stores before a __syncthreads, the others'
// by their bulk copies) completes A_t: phase t / NB of the mbarrier hfull[t % NB], which thread 0
// arms again for step t + NB once it has waited for step t. x_t (this CTA's own rows, in x tile
// t & 1) needs no h: its product with W_ih runs before the wait, and the tile is written
// at the end of step t - 2, after that step's __syncthreads (every warp has read the tile's
// x_{t-2}), while h_{t-1} travels: off the path from the cell to the sends.
// 64 rows: nothing else; every CTA writes h_{t+1} into tile (t + 1) & 1 after A_t, which needs
// each CTA's h_t, sent after that CTA's MMAs of step t - 1 read the same tile. 80 rows (WIDE):
// 128 KB W_hh + 2 x 40 KB h + 2 x 10 KB x = 228 KB would not fit, so the h tile is
// single-buffered and W_ih moves from registers (32 words a lane) into shared memory (32 KB):
// 128 + 40 + 20 + 32 = 220 KB; a cluster barrier B_t (arrive right after the MMAs of t, wait
// before the h stores of t + 1: every CTA has read h_t) lets the cell run while it completes.
// After A_{T-1} no CTA writes to another's shared memory.
//
// The GRU (Cell = cell_gru) runs the same loop with its n gate's two parts apart: n-tile q holds
// r (x and h parts), z (both), n's x part and n's h part for q = 0..3 (the cell needs r (W_hn h
// + b_hn)), so the x part takes no MMA for n-tile 3 and the h part none for n-tile 2 (G_H and
// G_X below), and its W_hh and (WIDE) W_ih fragments leave those n-tiles out (6 words a lane and
// k-step: 96 and 24 KB). At 80 rows that leaves room for two h tiles (96 + 80 + 20 + 24 = 220
// KB): no B_t, the 64-row protocol. Its blocked record (HALF) holds hprev where the LSTM's holds
// cprev.
template <class Cell, int ROWS, bool HALF>
__global__ void __launch_bounds__(CTHREADS, 1)
    seq_cluster_forward_kernel(const struct persist_fwd_args a) {
    using S = cshape<ROWS>;
    constexpr int MT = S::MT;
    constexpr bool WIDE = S::WIDE;
    constexpr bool GRU = Cell::G == 3;
    using FS = fshape<Cell, ROWS>;
    constexpr int NB = FS::NB;
    // The gate of W_hh (G_H) and of W_ih and b_ih (G_X) in n-tile q, -1 for none.
    auto G_H = [](int q) { return GRU && q == 2 ? -1 : GRU && q == 3 ? 2 : q; };
    auto G_X = [](int q) { return GRU && q == 3 ? -1 : q; };
    constexpr int SKIP_H = GRU ? 2 : -1, SKIP_X = GRU ? 3 : -1;
    static_assert(FS::WPL == (GRU ? 6 : 8), "mma_w's layout of the fragments");
    using TR = tape_rec<Cell, HALF>;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float red[NWC];
    __shared__ float hmax[CL];
    __shared__ uint64_t hfull[NB]; // step t's h tile landed: hfull[t % NB]
    // 1 / (x scale) of x tile t & 1's rows (0: a row of zeros), row 16 m + 8 i + r at 16 m + 2 r
    // + i so that a lane reads its rows g and g + 8 of an m-tile as one float2.
    __shared__ __align__(8) float xinv[2][ROWS];
    unsigned char *wsm = smem;
    unsigned char *wism = smem + FS::WIHBASE; // WIDE: W_ih's fragments
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t hbase = sbase + (uint32_t)FS::WB;
    const uint32_t xbase = hbase + NB * (uint32_t)S::HTILE;

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l, Il = a.Il;
    const int rank = (int)cluster_rank();
    const int row0 = (int)(blockIdx.x / CL) * ROWS;
    const int ub = rank * UPC + 8 * w + 2 * tg; // this lane's first unit (global)

    // A phase of hfull: the other CL - 1 CTAs' slabs of the h tile.
    auto arm = [&](uint64_t *b) { cluster_mbar_arm(b, (uint32_t)((CL - 1) * S::PART)); };
    if (threadIdx.x == 0) {
        cluster_mbar_init(hfull, NB);
        for (int k = 0; k < NB && k < T; k++)
            arm(&hfull[k]);
    }
    // Every CTA of the cluster has started (and its mbarriers are initialized) before any
    // distributed shared memory access.
    cluster_arrive();
    cluster_wait();

    // Weight scale over this CTA's gate rows of W_hh and W_ih (each CTA unscales its own; red:
    // persist_pow2_scale reads blockDim.x / 32 = NWC floats of it).
    const float wscale =
        persist_pow2_scale(gate_rows_absmax(gate_rows_absmax(0.0f, a.w_hh, Cell::G, H, H, rank),
                                            a.w_ih, Cell::G, H, Il, rank),
                           15, red);

    // h scale, the same in every CTA of the cluster: max(1, |h0|, |stored states|) of the
    // cluster's rows (each CTA its units, then the four maxima through distributed memory).
    float m = 1.0f;
    {
        const int steps = a.hidden ? T : a.h0 ? 1 : 0;
        for (int rt = w; rt < ROWS * steps; rt += NWC) {
            int row = rt / steps, t = rt - row * steps, b = row0 + row;
            if (b >= a.B)
                break;
            for (int u = rank * UPC + lane; u < rank * UPC + UPC; u += 32) {
                if (a.hidden)
                    m = fmaxf(m, fabsf(__ldg(a.hidden + (((size_t)b * T + t) * L + l) * H + u)));
                if (t == 0 && a.h0)
                    m = fmaxf(m, fabsf(__ldg(a.h0 + ((size_t)b * L + l) * H + u)));
            }
        }
        m = persist_block_max(m, red); // the cluster agrees on it before the power of two
        if (threadIdx.x < CL) {
            uint32_t at =
                cluster_map((uint32_t)__cvta_generic_to_shared(&hmax[rank]), (uint32_t)threadIdx.x);
            cluster_st(at, __float_as_uint(m));
        }
        cluster_arrive();
        cluster_wait();
        m = fmaxf(fmaxf(hmax[0], hmax[1]), fmaxf(hmax[2], hmax[3]));
    }
    const float hscale = persist_pow2_for(m, 14);
    const float hinv = (1.0f / wscale) * (1.0f / hscale);
    // dw256 chunks (a.zc): the cluster's blocks of 16 rows below B, the batch's.
    const int nblk = min(MT, (a.B - row0 + 15) / 16), nbB = (a.B + 15) / 16;

    // W_hh as fp16 B fragments in shared memory: B[k][n] = W_hh[G_H(q) H + unit(n)][k], n-tile
    // q, unit(n) = rank*64 + 8w + n; W_ih's likewise (G_X(q); k < I_l, zeros past it) in
    // registers (64 rows) or in shared memory (WIDE). A gate of -1 is zeros in registers (never
    // multiplied) and left out of the shared-memory layouts (drop_ntile).
#pragma unroll 2
    for (int ks = 0; ks < CKSH; ks++) {
        uint32_t o[8];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int gq = G_H(q);
            auto Bf = [&](int k, int n) -> float {
                return gq < 0 ? 0.0f
                              : __ldg(a.w_hh + (size_t)(gq * H + rank * UPC + 8 * w + n) * H + k);
            };
            mode_f16::wpack(o + 2 * q, Bf, ks, g, tg, wscale);
        }
        drop_ntile<SKIP_H>(o);
        persist_wlayout<FS::WPL>::store(wsm, ks, NWC, w, lane, o);
    }
    uint32_t wih[WIDE ? 1 : CXKS][8];
#pragma unroll
    for (int ks = 0; ks < CXKS; ks++) {
        uint32_t o[8];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int gq = G_X(q);
            auto Bf = [&](int k, int n) -> float {
                return k < Il && gq >= 0
                           ? __ldg(a.w_ih + (size_t)(gq * H + rank * UPC + 8 * w + n) * Il + k)
                           : 0.0f;
            };
            mode_f16::wpack(o + 2 * q, Bf, ks, g, tg, wscale);
        }
        if constexpr (WIDE) {
            drop_ntile<SKIP_X>(o);
            persist_wlayout<FS::WPL>::store(wism, ks, NWC, w, lane, o);
        } else
#pragma unroll
            for (int j = 0; j < 8; j++)
                wih[ks][j] = o[j];
    }

    // Biases of this lane's units: b_ih + b_hh of the n-tile's gates.
    float bias[4][2];
#pragma unroll
    for (int q = 0; q < 4; q++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            bias[q][j] = (G_X(q) < 0 ? 0.0f : __ldg(a.b_ih + G_X(q) * H + ub + j)) +
                         (G_H(q) < 0 ? 0.0f : __ldg(a.b_hh + G_H(q) * H + ub + j));

    // Rows: lane row (mt, i) = 16 mt + g + 8 i; rs its batch row, 0 where past B (int: registers
    // are short), rowT b T and rowb b.
    bool rv[MT][2];
    int rs[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int b = row0 + 16 * mt + g + 8 * i;
            rv[mt][i] = b < a.B;
            rs[mt][i] = rv[mt][i] ? b : 0;
        }
    auto rowT = [&](int mt, int i) -> size_t { return (size_t)rs[mt][i] * T; };
    auto rowb = [&](int mt, int i) -> size_t { return (size_t)rs[mt][i]; };
    const size_t hid_step = (size_t)L * H;

    // x of a step: a half-warp a row (its 16 float4 columns, zeros past I_l and B). Thread
    // (xrow, xc4) holds rows xrow + 16 k (k < MT): the batch row (-1: none), whether it copies x
    // to the tape (rank r writes rows [r ROWS / CL, (r + 1) ROWS / CL)); the swizzled tile offset
    // of row xrow (row xrow + 16 k: 2 KB further) and the row's place in xinv (16 k further).
    const int xrow = threadIdx.x >> 4, xc4 = threadIdx.x & 15;
    const uint32_t xto = (uint32_t)(xrow * 128 + (((xc4 >> 1) ^ (xrow & 7)) << 4) + (xc4 & 1) * 8);
    const int xri = 2 * (xrow & 7) + (xrow >> 3);
    int xr[MT];
    bool xd[MT];
#pragma unroll
    for (int k = 0; k < MT; k++) {
        const int row = xrow + 16 * k;
        const bool ok = 4 * xc4 < Il && row0 + row < a.B;
        xr[k] = ok ? row0 + row : -1;
        xd[k] = ok && a.xcopy && row / (ROWS / CL) == rank;
    }
    float4 xv[MT];
    auto load_x = [&](int t) {
#pragma unroll
        for (int k = 0; k < MT; k++)
            xv[k] = xr[k] >= 0 ? __ldg(reinterpret_cast<const float4 *>(
                                     a.x + ((size_t)xr[k] * T + t) * a.ldx + 4 * xc4))
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    };
    // The x tile of step t and its rows' 1 / scale (this CTA's own rows; read after a
    // __syncthreads). A row keeps the h scale where each of its 16 lanes' largest |x| is below
    // 2^14 / hscale (fp16's range) and either 0 or at least 2^3 / hscale (the row keeps 2^17 of
    // range below its largest): ballots, no reduction. Else (a warp-uniform branch) the
    // row takes the power of two that puts its largest |x| in [2^13, 2^14), from the rows'
    // maxima, reduced side by side. xneed says whether any of the thread's rows took its own, and
    // __syncthreads_or whether the x part must bring acc's rows to the h scale. (The
    // reduction for every row, one row's shuffles after the other's, took 4% of the forward.)
    // Every thread takes part.
    bool xneed = false;
    const float xhi = 16384.0f / hscale, xlo = 8.0f / hscale; // powers of two: exact
    auto put_x = [&](int t) {
        unsigned char *tile = smem + FS::XBASE + (t & 1) * S::XTILE;
        const int sh = lane & 16; // the row's half of the warp
        float m[MT];
        bool fit[MT], nz[MT];
        uint32_t all = ~0u;
#pragma unroll
        for (int k = 0; k < MT; k++) {
            m[k] =
                fmaxf(fmaxf(fabsf(xv[k].x), fabsf(xv[k].y)), fmaxf(fabsf(xv[k].z), fabsf(xv[k].w)));
            const uint32_t f =
                __ballot_sync(0xffffffffu, m[k] < xhi && (m[k] >= xlo || m[k] == 0.0f));
            fit[k] = ((f >> sh) & 0xffffu) == 0xffffu;
            nz[k] = ((__ballot_sync(0xffffffffu, m[k] > 0.0f) >> sh) & 0xffffu) != 0;
            all &= f;
        }
        if (all != ~0u)
#pragma unroll
            for (int o = 8; o > 0; o >>= 1)
#pragma unroll
                for (int k = 0; k < MT; k++)
                    m[k] = fmaxf(m[k], __shfl_xor_sync(0xffffffffu, m[k], o));
        xneed = false;
#pragma unroll
        for (int k = 0; k < MT; k++) {
            const float sc = fit[k] ? hscale : persist_pow2_for(m[k], 14);
            xneed |= !fit[k];
            const float4 v = xv[k];
            *reinterpret_cast<uint2 *>(tile + xto + k * 2048) = make_uint2(
                mode_f16::pack2(v.x * sc, v.y * sc), mode_f16::pack2(v.z * sc, v.w * sc));
            if (xc4 == 0)
                xinv[t & 1][xri + 16 * k] = nz[k] ? pow2_inv(sc) : 0.0f;
            if (xd[k])
                *reinterpret_cast<float4 *>(a.z + ((size_t)xr[k] * T + t) * a.ldz + a.xoff +
                                            4 * xc4) = v;
        }
    };

    // h entering step t (this lane's elements) into this CTA's slab of tile t & 1 (NB = 2) or of
    // the tile (NB = 1), and the tape; then (send_h) the slab goes to the other CTAs' tiles.
    auto put_h = [&](const float hv[MT][2][2], int t) {
        unsigned char *tile = smem + FS::WB + (NB == 1 ? 0 : (t & 1) * S::HTILE);
        auto send = [&](int row, int unit, auto v) {
            *reinterpret_cast<decltype(v) *>(tile + hsoff<ROWS>(row, unit)) = v;
        };
        // A lane quad holds 8 units (16 bytes) of each of its rows: two swaps (quad_swap) give
        // each lane all 8 of one row, one store a row.
        const int i1 = tg & 1, hi = tg >> 1, u8 = rank * UPC + 8 * w;
        uint2 q[MT]; // row (mt, i1), units u8 + 4 hi + [0, 4)
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            __half2 p0 = __floats2half2_rn(hv[mt][0][0] * hscale, hv[mt][0][1] * hscale);
            __half2 p1 = __floats2half2_rn(hv[mt][1][0] * hscale, hv[mt][1][1] * hscale);
            q[mt] = cat(quad_swap(*reinterpret_cast<uint32_t *>(&p0),
                                  *reinterpret_cast<uint32_t *>(&p1), 1, i1));
        }
#pragma unroll
        for (int mt = 0; mt + 1 < MT; mt += 2) // row (mt + hi, i1)
            send(16 * (mt + hi) + g + 8 * i1, u8, cat(quad_swap(q[mt], q[mt + 1], 2, hi)));
        if constexpr (MT % 2 == 1) // 80 rows: the last m-tile 8 bytes a store
            send(16 * (MT - 1) + g + 8 * i1, u8 + 4 * hi, q[MT - 1]);
        if (a.z) // one branch around the rows (none where z is the dw256 chunks)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    if (!rv[mt][i])
                        continue;
                    float *zr = a.z + (rowT(mt, i) + t) * a.ldz;
                    *reinterpret_cast<float2 *>(zr + ub) = make_float2(hv[mt][i][0], hv[mt][i][1]);
                    if (rank == 0 && w == 0 && tg == 0) {
                        zr[H] = 1.0f;
                        for (int k = H + 1; k < a.xoff; k++)
                            zr[k] = 0.0f;
                        for (int k = a.xoff + Il; k < a.ldz; k++)
                            zr[k] = 0.0f;
                    }
                }
        fence_proxy_async(); // the slab is read by send_h's bulk copies
    };
    // After put_h and a __syncthreads: thread 0 copies this CTA's slab of h_t into the other
    // CTAs' tiles by bulk copies (the TMA engine), each completing on the receiver's hfull
    // (per-lane st.async to every CTA took a third of the step; docs/kernels.md). With a.zc, lane m + 1 of
    // warp 0 copies the slab's block m (2 KB, already the chunk's layout) into z's piece `rank`
    // of its chunk, and waits for the copy's read after the next MMAs (zc_wait), before the slab
    // is written again.
    auto send_h = [&](int t) {
        if (w == 0) {
            const int nb = NB == 1 ? 0 : t & 1;
            const uint32_t src = hbase + (uint32_t)(nb * S::HTILE + rank * S::PART),
                           bar = smem_u32(hfull + nb);
            if (lane == 0)
#pragma unroll
                for (int k = 1; k < CL; k++) {
                    const uint32_t r = (uint32_t)((rank + k) % CL);
                    cluster_bulk_s2s(cluster_map(src, r), src, (uint32_t)S::PART,
                                     cluster_map(bar, r));
                }
            if (a.zc && lane >= 1 && lane <= nblk)
                bulk_s2g(static_cast<unsigned char *>(a.zc) +
                             dw256_chunk(row0 / 16 + lane - 1, t, T, nbB) * RNND_DW256_Z +
                             rank * 2048,
                         src + (uint32_t)((lane - 1) * 2048), 2048u);
        }
    };
    auto zc_wait = [&] { // lane 0's copies to the other CTAs complete on their barriers
        if (a.zc && w == 0 && lane >= 1)
            bulk_wait_read();
    };
    // The chunk's x piece, constant column and exponents (a.zc): rank r's rows [r ROWS / CL,
    // (r + 1) ROWS / CL) of step t's x tile, 16 bytes a thread (whole warps; a warp's 4 rows
    // share a block). The tile's rows are the chunk's as they stand (fp16, a scale a row, the same
    // swizzle), so the thread moves its 16 bytes to the same place in the chunk's row.
    const int zr = rank * (ROWS / CL) + (threadIdx.x >> 3), zj = threadIdx.x & 7;
    const bool zon = a.zc && threadIdx.x < (ROWS / CL) * 8 && row0 + (zr & ~15) < a.B;
    const int eh = -pow2_log(hscale);
    auto put_zx = [&](int t) {
        if (!zon)
            return;
        const int rr = zr & 15;
        const uint32_t o = (uint32_t)(rr * 128 + ((zj ^ (rr & 7)) << 4));
        const unsigned char *xt = smem + FS::XBASE + (t & 1) * S::XTILE;
        const size_t c = dw256_chunk((row0 + zr) >> 4, t, T, nbB);
        unsigned char *zc = static_cast<unsigned char *>(a.zc) + c * RNND_DW256_Z;
        *reinterpret_cast<uint4 *>(zc + 4 * 2048 + o) =
            *reinterpret_cast<const uint4 *>(xt + (zr & ~15) * 128 + o);
        unsigned char *aux = static_cast<unsigned char *>(a.zc_aux) + c * RNND_DW256_A;
        if (zj == 0) { // x = x' 2^ex: x' = x sc, ex = log2(1 / sc)
            int16_t *e = reinterpret_cast<int16_t *>(aux + 256);
            const float r = xinv[t & 1][(zr & ~15) + 2 * (zr & 7) + ((zr >> 3) & 1)];
            e[rr] = (int16_t)eh;
            e[16 + rr] = (int16_t)(r > 0.0f ? pow2_log(r) : RNND_DW16_EZERO);
        } else if (zj == 1) { // 16-byte unit rr of the constant: column 0 of K rows 8 (rr / 8)..
            uint32_t v[4] = {0u, 0u, 0u, 0u};
            if ((rr & 7) == 0) {
                const uint32_t one = __half_as_ushort(__float2half_rn(hscale));
                const int b0 = row0 + (zr & ~15) + rr;
#pragma unroll
                for (int k = 0; k < 4; k++)
                    v[k] = (b0 + 2 * k < a.B ? one : 0u) | (b0 + 2 * k + 1 < a.B ? one << 16 : 0u);
            }
            *reinterpret_cast<uint4 *>(aux + 16 * rr) = make_uint4(v[0], v[1], v[2], v[3]);
        }
    };

    // The state entering step 0 (reset rule as in seq_forward.cuh).
    float h[MT][2][2], c[MT][2][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float2 hv = make_float2(0.0f, 0.0f), cv = make_float2(0.0f, 0.0f);
            const size_t b = rowb(mt, i);
            if (rv[mt][i] && a.hidden) {
                size_t at = rowT(mt, i) * hid_step + (size_t)l * H + ub;
                hv = *reinterpret_cast<const float2 *>(a.hidden + at);
                if (a.cell)
                    cv = *reinterpret_cast<const float2 *>(a.cell + at);
            } else if (rv[mt][i] && a.h0 && !a.is_init[rowT(mt, i)]) {
                size_t at = (b * L + l) * H + ub;
                hv = *reinterpret_cast<const float2 *>(a.h0 + at);
                if (a.c0)
                    cv = *reinterpret_cast<const float2 *>(a.c0 + at);
            }
            h[mt][i][0] = hv.x, h[mt][i][1] = hv.y, c[mt][i][0] = cv.x, c[mt][i][1] = cv.y;
        }
    // ldmatrix lane addresses: matrix mi = lane / 8 is rows 8 (mi & 1) + lane % 8 of an m-tile at
    // chunk 2 ks + mi / 2; the swizzle key is lane % 8 (the row's low bits).
    const int mi = lane >> 3, lrow = (lane & 7) + 8 * (mi & 1), key = lane & 7;
    uint32_t hb[4], xb[4]; // per ks % 4 (ks / 4: the next slab of h; m-tile mt adds 16 rows)
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int ch = (2 * k + (mi >> 1)) ^ key;
        hb[k] = hbase + (uint32_t)(lrow * 128 + ch * 16);
        xb[k] = xbase + (uint32_t)(lrow * 128 + ch * 16);
    }

    // acc = x_t . W_ih at the h part's scale, so that the h part adds to it: where a row took its
    // own scale (scaled: x_t's __syncthreads_or), each row times hscale / its scale (80 multiplies
    // a lane). It needs no h: WIDE runs it at the end of step t - 1, while the other CTAs' h_t is
    // on its way. 64 rows run it after the wait: their W_ih fragments take 32 registers a
    // lane, and with acc live over the wait the loop spilled (and ran slower).
    float acc[MT][4][4];
    auto x_part = [&](int t, bool scaled) {
        zero_acc(acc);
        const int nb = t & 1;
        if constexpr (WIDE)
            mma_w<CXKS, 128, 0, SKIP_X>(acc, wism, xb, (uint32_t)(nb * S::XTILE), w, lane);
        else
            mma_tile<mode_f16, CXKS, 128, 0, SKIP_X>(
                acc, xb, (uint32_t)(nb * S::XTILE), [](int) {},
                [&](int ks, int nt) { return make_uint2(wih[ks][2 * nt], wih[ks][2 * nt + 1]); });
        if (scaled)
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const float2 r = *reinterpret_cast<const float2 *>(&xinv[nb][16 * mt + 2 * g]);
                const float f0 = r.x * hscale, f1 = r.y * hscale;
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    acc[mt][nt][0] *= f0, acc[mt][nt][1] *= f0;
                    acc[mt][nt][2] *= f1, acc[mt][nt][3] *= f1;
                }
            }
    };

    put_h(h, 0);
    load_x(0);
    put_x(0);
    bool xs = __syncthreads_or(xneed); // x_t's rows took scales of their own
    send_h(0);
    const int nrows = min(ROWS, a.B - row0);
    row_flags<ROWS> nrf; // the flags of step t + 1
    nrf.load(a.is_init + (size_t)row0 * T + 1, T, nrows, lane, T > 1);
    if constexpr (WIDE)
        x_part(0, xs);
    if (T > 1) {
        load_x(1);
        put_x(1);
    }

    for (int t = 0; t < T; t++) {
        // A_t: h of step t complete in every CTA's tile; then the phase of step t + NB is armed.
        cluster_mbar_wait(&hfull[t % NB], (t / NB) & 1);
        if (threadIdx.x == 0 && t + NB < T)
            arm(&hfull[t % NB]);
        const bool more = t + 1 < T;
        const uint32_t ho = NB == 1 ? 0u : (uint32_t)((t & 1) * S::HTILE);
        if constexpr (!WIDE) {
            if (t + 2 < T)
                load_x(t + 2); // in flight during the MMAs
            x_part(t, xs);
        }

        put_zx(t);
        mma_w<CKSH, 128, ROWS * 128, SKIP_H>(acc, wsm, hb, ho, w, lane);
        zc_wait(); // the chunk copies of h_t, issued at the end of step t - 1
        if constexpr (NB == 1)
            if (more)
                cluster_arrive_relaxed(); // B_t: this CTA has read the h tile of step t
        if constexpr (WIDE)
            if (t + 2 < T)
                load_x(t + 2); // in flight during the cell

        // The cell; outputs and tape.
        float hn[MT][2][2], cn[MT][2][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float sv[5][2]; // the record; HALF, GRU: hprev in plane 4
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float pre[4], zq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s[Cell::SW];
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        pre[q] = acc[mt][q][2 * i + j] * hinv + bias[q][j];
                    if constexpr (GRU) {
                        const float hq[3] = {0.0f, 0.0f, pre[3]}; // r, z: in pre[0..1] alone
                        Cell::template forward<true>(pre, hq, h[mt][i][j], 0.0f, hn[mt][i][j],
                                                     cn[mt][i][j], s);
                    } else {
                        Cell::template forward<true>(pre, zq, 0.0f, c[mt][i][j], hn[mt][i][j],
                                                     cn[mt][i][j], s);
                    }
#pragma unroll
                    for (int p = 0; p < Cell::SW; p++)
                        sv[p][j] = s[p];
                    if constexpr (GRU)
                        sv[4][j] = h[mt][i][j];
                }
                if constexpr (HALF) {
                    // tape_b8: this lane's 16 + 8 bytes of the block. The addresses and values
                    // outside the row's branch, which holds the stores alone.
                    // Row k = 2 mt + i is batch row row0 + g + 8 k, row group row0 / 8 + k.
                    const int rk = 2 * mt + i;
                    float2 *yp = reinterpret_cast<float2 *>(
                        a.y + ((size_t)(row0 + g) * T + t + (size_t)rk * 8 * T) * a.ldy + ub);
                    float *k = a.s + tape_b8::block8(row0 / 8, t, ub, T, HC) +
                               rk * ((size_t)T * (HC / 8) * tape_b8::FLOATS);
                    uint32_t q[4];
#pragma unroll
                    for (int p = 0; p < 4; p++) {
                        __half2 v = __floats2half2_rn(sv[p][0], sv[p][1]);
                        q[p] = *reinterpret_cast<uint32_t *>(&v);
                    }
                    if (rv[mt][i]) {
                        *yp = make_float2(hn[mt][i][0], hn[mt][i][1]);
                        if (a.s) {
                            *reinterpret_cast<uint4 *>(k + 4 * lane) =
                                make_uint4(q[0], q[1], q[2], q[3]);
                            *reinterpret_cast<float2 *>(k + 128 + 2 * lane) =
                                make_float2(sv[4][0], sv[4][1]);
                        }
                    }
                } else if (rv[mt][i]) {
                    const size_t r = rowT(mt, i) + t;
                    *reinterpret_cast<float2 *>(a.y + r * a.ldy + ub) =
                        make_float2(hn[mt][i][0], hn[mt][i][1]);
                    if (a.s)
#pragma unroll
                        for (int p = 0; p < Cell::SW; p++)
                            TR::put2(a.s + r * TR::floats(H), p, H, ub,
                                     make_float2(sv[p][0], sv[p][1]));
                }
            }

        if (more) {
            // The state entering step t+1: the reset value where is_init[b, t+1], else h'. Row
            // k = 2 mt + i is batch row row0 + g + 8 k: a base plus k strides.
            const size_t at0 = ((size_t)(row0 + g) * T + t + 1) * hid_step + (size_t)l * H + ub;
            const flag_bits<ROWS> nreset(nrf, g);
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const bool nr = nreset(2 * mt + i);
                    float2 nh = make_float2(0.0f, 0.0f), nc = make_float2(0.0f, 0.0f);
                    if (nr && a.hidden) {
                        const size_t at = at0 + (size_t)(2 * mt + i) * 8 * T * hid_step;
                        nh = *reinterpret_cast<const float2 *>(a.hidden + at);
                        if (a.cell)
                            nc = *reinterpret_cast<const float2 *>(a.cell + at);
                    }
                    h[mt][i][0] = nr ? nh.x : hn[mt][i][0];
                    h[mt][i][1] = nr ? nh.y : hn[mt][i][1];
                    c[mt][i][0] = nr ? nc.x : cn[mt][i][0];
                    c[mt][i][1] = nr ? nc.y : cn[mt][i][1];
                }
            if constexpr (NB == 1)
                cluster_wait();           // B_t: every CTA has read h_t
            put_h(h, t + 1);              // A_{t+1}
            xs = __syncthreads_or(xneed); // x_{t+1}'s (put_x at the end of step t - 1)
            send_h(t + 1);
            // WIDE: the x part before the flags' loads, which queued ahead of its first loads.
            if constexpr (WIDE)
                x_part(t + 1, xs);
            nrf.load(a.is_init + (size_t)row0 * T + t + 2, T, nrows, lane, t + 2 < T);
            if (t + 2 < T)
                put_x(t + 2); // tile t & 1: every warp has read x_t before the __syncthreads
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    if (!rv[mt][i])
                        continue;
                    size_t at = (rowb(mt, i) * L + l) * H + ub;
                    if (a.h_n)
                        *reinterpret_cast<float2 *>(a.h_n + at) =
                            make_float2(hn[mt][i][0], hn[mt][i][1]);
                    if (a.c_n)
                        *reinterpret_cast<float2 *>(a.c_n + at) =
                            make_float2(cn[mt][i][0], cn[mt][i][1]);
                }
        }
    }
    if (w == 0)
        bulk_wait_read(); // its copies have read this CTA's slabs before the CTA leaves
}

// ---------------------------------------------------------------------------------------------
// Backward: the same cluster, CTA r the gate rows of units [64r, 64r+64) of the ROWS rows. Per
// step (reverse) each lane runs the cell backward for its 4 MT elements (D out), the CTA's ROWS x
// 256 dgate columns go into an fp16 tile, each row scaled by a power of two (its largest |value|
// in [2^13, 2^14), as in the mma.sync backward: as exact as TF32), and the CTA computes its partial of dh for all 256
// units, P_r = tile . W_hh[its gate rows] (M = ROWS, N = 256, K = 256; warp w the units [32w,
// 32w+32)). The partials of units [64r', 64r'+64) go to CTA r' (warps 2r', 2r'+1) through
// distributed shared memory, slot r of its receive buffer, in fp16 with a power-of-two factor a
// row and 32 units; CTA r' sums its four slots in a fixed order (deterministic).
//
// The partials of step t complete P_t ("partials in": a phase of the mbarrier pfull, armed again
// for step t - 1 once waited for). 64 rows: a cluster barrier "sums read" (arrive right after
// the sums, wait just before the next step's partials go out); dL/dh is carried in registers and
// the next step's tape record prefetched into registers.
//
// 80 rows (WIDE), the LSTM's (SHARE): the receive slots share their memory with the A tile (laid
// out when the slots held fp32: 128 KB W_hh + 40 KB A tile + 80 KB would not fit). The fp16
// slots would fit beside the tile, but the loop ran 15% slower so (likely as its shared memory,
// 214 KB against 174, leaves the L1 cache 28 KB instead of 60). A CTA's partials may land
// only after every CTA of the cluster has finished its MMAs (which read its A tile): a cluster
// barrier M_t (arrive and wait right after the MMAs: every A tile read; also every CTA's sums of
// step t + 1 read, which came before its MMAs of t) before the sends, then P_t. The A tile of
// step t - 1 is written after this CTA's own sums of step t (the __syncthreads after the row
// maxima orders them). P_0 comes after every write to this CTA's shared memory. Registers: dL/dh
// stays in the receive slots between steps (see below). (An L2 prefetch of the step before's
// record, 20 instructions a warp, cost 0.1 ms in the memory pipe that the sends share.)
//
// The GRU (Cell = cell_gru): its record's fp32 plane holds hprev (the forward's); the MMA takes
// the tile's first three gates (da_r, da_z, da_n r: K = 192, KS k-steps), the fourth slab holds
// da_n for the chunks alone; the direct term dL/dh' z rides where the LSTM carries dL/dc: added
// to the next step's dL/dh', and to the gradient routed out. Its W_hh fragments take 96 KB, so
// at 80 rows its receive slots lie beside the A tile (bshape): no M_t, but a cluster barrier
// "slots read" (arrive once the step's cells have read the slots, wait before the sends) keeps a
// slot from being overwritten before every CTA has read it.
template <class Cell, int ROWS>
__global__ void __launch_bounds__(CTHREADS, 1)
    seq_cluster_backward_kernel(const struct persist_bwd_args a) {
    using S = cshape<ROWS>;
    constexpr int MT = S::MT;
    constexpr bool WIDE = S::WIDE;
    constexpr bool GRU = Cell::G == 3;
    using BS = bshape<Cell, ROWS>;
    constexpr int KS = BS::KS;
    constexpr bool SHARE = BS::SHARE;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float red[NWC];
    static_assert(NWC == 8, "rowmax: a row's maxima in two float4");
    __shared__ __align__(16) float rowmax[ROWS][NWC]; // [row][warp]
    __shared__ float rowinv[ROWS];
    __shared__ uint64_t pfull; // step t's partials (every CTA's) landed: P_t
    unsigned char *wsm = smem;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t abase = sbase + (uint32_t)BS::WB;
    // The receive slots (SHARE: the same memory as the A tile).
    const uint32_t rbase_s = sbase + (uint32_t)BS::RECVBASE;
    const unsigned char *recv = smem + BS::RECVBASE;
    const float *rfac =
        reinterpret_cast<const float *>(recv + CL * S::PART); // [slot][row][32 units]

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l;
    const int rank = (int)cluster_rank();
    const int row0 = (int)(blockIdx.x / CL) * ROWS;
    const int lu0 = 8 * w + 2 * tg, ub = rank * UPC + lu0; // this lane's first unit
    // dw256 chunks: the cluster's blocks below B, the batch's.
    const int nblk = min(MT, (a.B - row0 + 15) / 16), nbB = (a.B + 15) / 16;
    using WL = persist_wlayout<8>;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (a.dw16) // the product (launched after this loop) may take the SMs it leaves (seq_dw.cu)
        asm volatile("griddepcontrol.launch_dependents;");
#endif
    if (threadIdx.x == 0) { // its first phase: step T - 1's partials, all of them
        cluster_mbar_init(&pfull, 1);
        cluster_mbar_arm(&pfull, (uint32_t)S::RECV);
    }
    cluster_arrive();
    cluster_wait();

    const float wscale = persist_pow2_scale(gate_rows_absmax(0.0f, a.w_hh, Cell::G, H, H, rank), 15,
                                            red),
                winv = 1.0f / wscale;

    // B[k][n] = W_hh[q H + 64 rank + uu][32 w + 8 (n / 2) + 2 nt + n % 2] for tile column
    // k = 64 q + uu: lane tg's accumulators of a row (n-tiles nt, columns 2 tg + j) are units
    // 32 w + 8 tg + [0, 8), which leave in two 16-byte stores with no exchange in the quad.
#pragma unroll 2
    for (int ks = 0; ks < KS; ks++) {
        uint32_t o[8];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            auto Bf = [&](int k, int n) -> float {
                int q = k >> 6, uu = k & 63;
                return __ldg(a.w_hh + (size_t)(q * H + rank * UPC + uu) * H + 32 * w +
                             8 * (n >> 1) + 2 * nt + (n & 1));
            };
            mode_f16::wpack(o + 2 * nt, Bf, ks, g, tg, wscale);
        }
        WL::store(wsm, ks, NWC, w, lane, o);
    }

    // Rows: lane row (mt, i) = 16 mt + g + 8 i; rb its batch row, 0 where past B (int, as in the
    // forward: registers are short), rowb as size_t.
    bool rv[MT][2];
    int rb[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int b = row0 + 16 * mt + g + 8 * i;
            rv[mt][i] = b < a.B;
            rb[mt][i] = rv[mt][i] ? b : 0;
        }
    auto rowb = [&](int mt, int i) -> size_t { return (size_t)rb[mt][i]; };

    // Carried gradients of the state leaving step t. 64 rows: dL/dh in registers (dh). WIDE:
    // dL/dh of the state leaving a step is not held in registers across steps: it is the sum of
    // the four receive slots (row, this lane's units), read again by the cell of the next step
    // (the slots are overwritten only after the __syncthreads behind that cell, and by the other
    // CTAs only after the next M barrier). `carried` bit 2 mt + i: 1 where the sum of row
    // (mt, i) carries into the next step (else dL/dh there is 0). The step T-1 reads dL/dh_n.
    float dh[WIDE ? 1 : MT][2][2], dc[MT][2][2];
    uint32_t carried = 0;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float2 x = make_float2(0.0f, 0.0f), y = make_float2(0.0f, 0.0f);
            size_t at = (rowb(mt, i) * L + l) * H + ub;
            if (!WIDE && rv[mt][i] && a.gh_n)
                x = *reinterpret_cast<const float2 *>(a.gh_n + at);
            if (rv[mt][i] && a.gc_n)
                y = *reinterpret_cast<const float2 *>(a.gc_n + at);
            if constexpr (!WIDE)
                dh[mt][i][0] = x.x, dh[mt][i][1] = x.y;
            dc[mt][i][0] = y.x, dc[mt][i][1] = y.y;
        }
    // The sum of the four slots at (row, this lane's two units), each times its factor.
    auto slot_sum = [&](int row) -> float2 {
        float2 s = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int sl = 0; sl < CL; sl++) {
            const float2 v = tape_rec<cell_lstm, true>::unpack2(
                *reinterpret_cast<const uint32_t *>(recv + sl * S::PART + roff(row, lu0)));
            const float f = rfac[(sl * ROWS + row) * 2 + (lu0 >> 5)];
            s.x = fmaf(v.x, f, s.x), s.y = fmaf(v.y, f, s.y);
        }
        return s;
    };

    // dL/dh of the state leaving step t at (mt, i), this lane's two units.
    auto dh_in = [&](int mt, int i, int t) -> float2 {
        if constexpr (WIDE) {
            if (t == T - 1) { // dL/dh_n
                const size_t at = (rowb(mt, i) * L + l) * H + ub;
                return rv[mt][i] && a.gh_n ? *reinterpret_cast<const float2 *>(a.gh_n + at)
                                           : make_float2(0.0f, 0.0f);
            }
            // Read either way, so that no branch separates the rows (the slots hold finite
            // partials of every row from step T - 2 on).
            const float2 s = slot_sum(16 * mt + g + 8 * i);
            const bool c = (carried >> (2 * mt + i)) & 1u;
            return make_float2(c ? s.x : 0.0f, c ? s.y : 0.0f);
        } else {
            return make_float2(dh[mt][i][0], dh[mt][i][1]);
        }
    };

    // Step t's tape record, output gradient and reset flags, loaded into registers during step
    // t + 1 once its partials are packed (the accumulators are free then).
    // The record's four fp16 planes stay packed (svh) until their step uses them (docs/kernels.md).
    uint32_t svh[4][MT][2];
    float2 sv[MT][2], gy[MT][2]; // sv: cprev (GRU: hprev)
    row_flags<ROWS> reset;
    const int nrows = min(ROWS, a.B - row0);
    // Lane row (mt, i) is batch row row0 + g + 8 k, k = 2 mt + i, and row group row0 / 8 + k: its
    // addresses are a base a step plus k strides (a few adds a row where 64-bit products were;
    // docs/kernels.md). Rows past B load nothing.
    const size_t sk = (size_t)T * (HC / 8) * tape_b8::FLOATS, gk = (size_t)8 * T * a.ldgy,
                 fk = (size_t)8 * T;
    auto load_step = [&](int t) {
        const float *sb = a.s + tape_b8::block8(row0 / 8, t, ub, T, HC);
        const size_t r0 = (size_t)(row0 + g) * T + t;
        const float *gb = a.gy + r0 * a.ldgy + ub;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int k = 2 * mt + i;
                const bool ok = rv[mt][i];
                const float *blk = sb + k * sk;
                const uint4 q = ok ? __ldg(reinterpret_cast<const uint4 *>(blk + 4 * lane))
                                   : make_uint4(0u, 0u, 0u, 0u);
                svh[0][mt][i] = q.x, svh[1][mt][i] = q.y, svh[2][mt][i] = q.z, svh[3][mt][i] = q.w;
                sv[mt][i] = ok ? __ldg(reinterpret_cast<const float2 *>(blk + 128 + 2 * lane))
                               : make_float2(0.0f, 0.0f);
                gy[mt][i] = ok ? __ldg(reinterpret_cast<const float2 *>(gb + k * gk))
                               : make_float2(0.0f, 0.0f);
            }
        reset.load(a.is_init + (size_t)row0 * T + t, T, nrows, lane, true);
    };
    load_step(T - 1);

    const int mi = lane >> 3, lrow = (lane & 7) + 8 * (mi & 1), key = lane & 7;
    uint32_t ab[4];
#pragma unroll
    for (int k = 0; k < 4; k++) // the tile in the forward's slab layout (hsoff), gate q in slab q
        ab[k] = abase + (uint32_t)(lrow * 128 + (((2 * k + (mi >> 1)) ^ key) << 4));
    // Destination of this warp's partials: CTA w / 2, slot `rank`, local units 32 (w % 2) + ...
    const uint32_t dst = cluster_map(rbase_s + (uint32_t)(rank * S::PART), (uint32_t)(w >> 1));
    __syncthreads(); // the weights are in place
    if constexpr (!WIDE)
        cluster_arrive_relaxed(); // "sums read" of a step before the first

    for (int t = T - 1; t >= 0; t--) {
        // Gate gradients; D; the row maxima of the tile values. Each phase runs over all the
        // lane's rows before the next (the cells, the maxima's shuffles, the stores), with no
        // branch between rows, so the rows' latencies overlap (docs/kernels.md).
        float dv[4][MT][2][2], dcp[MT][2][2], mx[MT][2];
        float2 dhv[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++)
                dhv[mt][i] = dh_in(mt, i, t);
        if constexpr (WIDE && !SHARE)
            cluster_arrive_relaxed(); // "slots read": the last reads of step t + 1's partials
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                mx[mt][i] = 0.0f;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float s[5], d[4], tl[4], ddir;
#pragma unroll
                    for (int p = 0; p < 4; p++) {
                        const float2 v = tape_rec<cell_lstm, true>::unpack2(svh[p][mt][i]);
                        s[p] = j ? v.y : v.x;
                    }
                    s[4] = j ? sv[mt][i].y : sv[mt][i].x;
                    float dhj = (j ? gy[mt][i].y : gy[mt][i].x) + (j ? dhv[mt][i].y : dhv[mt][i].x);
                    if constexpr (GRU) {
                        Cell::template backward<true>(s, s[4], dhj + dc[mt][i][j], 0.0f, d, tl,
                                                      dcp[mt][i][j], ddir);
                    } else {
                        Cell::template backward<true>(s, 0.0f, dhj, dc[mt][i][j], d, tl, ddir,
                                                      dcp[mt][i][j]);
                    }
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        dv[q][mt][i][j] = d[q];
                        mx[mt][i] = fmaxf(mx[mt][i], fabsf(d[q]));
                    }
                }
            }
#pragma unroll
        for (int k = 1; k <= 2; k <<= 1)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++)
                    mx[mt][i] = fmaxf(mx[mt][i], __shfl_xor_sync(0xffffffffu, mx[mt][i], k));
        if (tg == 0)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++)
                    rowmax[16 * mt + g + 8 * i][w] = mx[mt][i];
        if (a.d) {
            float *db = a.d + ((size_t)(row0 + g) * T + t) * (4 * H) + ub; // row k: 8 k T rows on
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++)
                    if (rv[mt][i])
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            *reinterpret_cast<float2 *>(db + (2 * mt + i) * fk * (4 * H) + q * H) =
                                make_float2(dv[q][mt][i][0], dv[q][mt][i][1]);
        }
        const flag_bits<ROWS> rst(reset, g);
        __syncthreads(); // the row maxima; SHARE: this CTA's reads of the receive slots are done
        // The tile, each row scaled; lanes tg = 0 of warp mt keep the factors and records of
        // m-tile mt's rows (warp 0 kept them all, and the other warps waited for it at the
        // __syncthreads below: 5% of the backward, docs/kernels.md).
        float sc[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int row = 16 * mt + g + 8 * i;
                const float4 m0 = *reinterpret_cast<const float4 *>(&rowmax[row][0]),
                             m1 = *reinterpret_cast<const float4 *>(&rowmax[row][4]);
                mx[mt][i] = fmaxf(fmaxf(fmaxf(m0.x, m0.y), fmaxf(m0.z, m0.w)),
                                  fmaxf(fmaxf(m1.x, m1.y), fmaxf(m1.z, m1.w)));
                sc[mt][i] = persist_pow2_for(mx[mt][i], 14);
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    __half2 p =
                        __floats2half2_rn(dv[q][mt][i][0] * sc[mt][i], dv[q][mt][i][1] * sc[mt][i]);
                    *reinterpret_cast<__half2 *>(smem + BS::WB + hsoff<ROWS>(row, q * UPC + lu0)) =
                        p;
                }
            }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            if (w == mt && tg == 0)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int row = 16 * mt + g + 8 * i;
                    rowinv[row] = winv * pow2_inv(sc[mt][i]);
                    if (a.dw16 && mt < nblk) { // D = D' 2^eD in this CTA's columns of the row
                        const size_t c =
                            rank * (size_t)a.dw16_pitch + dw256_chunk(row0 / 16 + mt, t, T, nbB);
                        a.dw16_exp[c * 16 + g + 8 * i] =
                            (int16_t)(mx[mt][i] > 0.0f ? -pow2_log(sc[mt][i]) : RNND_DW16_EZERO);
                    }
                }
        if (a.dw16)
            fence_proxy_async(); // the tile is read by the chunk copies below
        __syncthreads();
        // a.dw16: lane 4 m + q of warp 0 copies the tile's block m of gate q (2 KB, already the
        // chunk's layout) into D's plane 2 rank + q / 2; its read is waited for after the MMAs,
        // before the tile (SHARE: the receive slots) is written again.
        if (a.dw16 && w == 0 && lane < 4 * nblk)
            bulk_s2g(static_cast<unsigned char *>(a.dw16) +
                         ((2 * rank + (lane & 3) / 2) * (size_t)a.dw16_pitch +
                          dw256_chunk(row0 / 16 + lane / 4, t, T, nbB)) *
                             RNND_DW16_D +
                         (lane & 1) * 2048,
                     abase + (uint32_t)((lane & 3) * ROWS * 128 + (lane / 4) * 2048), 2048u);

        // This CTA's partial of dh: ROWS rows x the warp's 32 units.
        float acc[MT][4][4];
        zero_acc(acc);
        mma_w<KS, 128, ROWS * 128>(acc, wsm, ab, 0u, w, lane);
        if (a.dw16 && w == 0) {
            bulk_wait_read(); // the chunk copies have read the tile
            if (t < T - 1)    // step t + 1's copies are complete
                dw256_signal<1>(a.dw16_ready, T - 2 - t, lane);
        }
        if constexpr (SHARE) // after the chunk copies' reads too: the slots are the tile's memory
            cluster_arrive_relaxed(); // M_t: this CTA's A tile is read
        float ri[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++)
                ri[mt][i] = rowinv[16 * mt + g + 8 * i];

        // Row (mt, i), units 32 (w % 2) + 8 tg + [0, 8) (n-tiles 0-3) in fp16, 16 bytes a store:
        // scaled by sc, a power of two that puts the largest of the row's 32 units (the quad's)
        // in [2^13, 2^14), so each value keeps TF32's 10 bits; the factor back, ri / sc, goes to
        // the slot's factors (lane tg those of rows 2 mt + i = tg mod 4). Half the bytes of fp32
        // partials through st.async, which bound this phase (docs/kernels.md). All rows are packed
        // before the first store: packed row by row, each store's data took the registers of the
        // one before and waited for it to leave (docs/kernels.md).
        uint4 pk[MT][2];
        float fv[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float m = 0.0f;
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    m = fmaxf(m, fmaxf(fabsf(acc[mt][nt][2 * i]), fabsf(acc[mt][nt][2 * i + 1])));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                const float sc = persist_pow2_for(m, 14);
                auto v = [&](int nt) {
                    __half2 p =
                        __floats2half2_rn(acc[mt][nt][2 * i] * sc, acc[mt][nt][2 * i + 1] * sc);
                    return *reinterpret_cast<uint32_t *>(&p);
                };
                pk[mt][i] = make_uint4(v(0), v(1), v(2), v(3));
                fv[mt][i] = ri[mt][i] * pow2_inv(sc);
            }
        // Step t - 1's record, in flight while the partials land, the sums and the routing. WIDE:
        // before the sends, whose data registers the loads took otherwise (they waited for the
        // stores to read them); at 64 rows, where they did not, the sends go first.
        if (WIDE && t > 0)
            load_step(t - 1);
        // 64 rows: every CTA has read its sums of the step before. SHARE: M_t, every A tile is
        // read, the receive slots may be written. 80 rows apart (the GRU's): "slots read", every
        // CTA has read the step before's partials (its routing's reads came before too).
        cluster_wait();
        {
            // Lane row k = 2 mt + i is row 8 k + g: its partials are 1024 k bytes (8 rows of
            // 128) past row g's, its factor 64 k bytes past row g's. Lane tg sends the factors of
            // rows k = tg + 4 j (the quad's lanes hold the same).
            const uint32_t d0 = dst + roff(g, 32 * (w & 1) + 8 * tg),
                           f0 =
                               dst + (uint32_t)((CL - rank) * S::PART +
                                                (rank * ROWS * 2 + (w & 1)) * 4 + (8 * tg + g) * 8);
            const uint32_t bar = cluster_map(smem_u32(&pfull), (uint32_t)(w >> 1));
            static_for<0, 2 * MT>(
                [&](auto k) { cluster_st_async<1024 * k>(d0, pk[k / 2][k % 2], bar); });
            static_for<0, (2 * MT + 3) / 4>([&](auto j) {
                float f = fv[2 * j][0]; // row k = 4 j + tg
                if constexpr (4 * j + 1 < 2 * MT)
                    f = tg == 1 ? fv[2 * j][1] : f;
                if constexpr (4 * j + 2 < 2 * MT)
                    f = tg == 2 ? fv[2 * j + 1][0] : f;
                if constexpr (4 * j + 3 < 2 * MT)
                    f = tg == 3 ? fv[2 * j + 1][1] : f;
                if (4 * j + tg < 2 * MT)
                    cluster_st_async<256 * j>(f0, __float_as_uint(f), bar);
            });
        }
        if (!WIDE && t > 0)
            load_step(t - 1);
        cluster_mbar_wait(&pfull, (T - 1 - t) & 1); // P_t: every partial is in
        if (threadIdx.x == 0 && t > 0)
            cluster_mbar_arm(&pfull, (uint32_t)S::RECV);

        // dL/dh of the state entering step t (the slots' sum, and the GRU's direct term), routed
        // (docs/design.md, "Math"): out where it ends here, else carried into step t - 1. 64 rows: the sums
        // into registers first, then "sums read"; WIDE: the sums are read again where needed.
        if constexpr (!WIDE) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const float2 s = slot_sum(16 * mt + g + 8 * i);
                    dh[mt][i][0] = s.x, dh[mt][i][1] = s.y;
                }
            cluster_arrive_relaxed(); // this CTA's sums are read
        } else {
            carried = 0;
        }
        // dL/dh and dL/dc out where the state is not carried: where stored, else (t == 0 and no
        // reset) into g_h0, g_c0. Only step 0 or stored states write: one branch around the rows.
        if (t == 0 || a.stored)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    if (t > 0 && !rst(2 * mt + i))
                        continue;
                    auto out = [&](float2 dho, bool initial) {
                        if constexpr (GRU)
                            dho.x += dcp[mt][i][0], dho.y += dcp[mt][i][1];
                        if (a.stored) {
                            size_t at = ((rowb(mt, i) * T + t) * L + l) * H + ub;
                            if (a.g_hidden)
                                *reinterpret_cast<float2 *>(a.g_hidden + at) = dho;
                            if (a.g_cell)
                                *reinterpret_cast<float2 *>(a.g_cell + at) =
                                    make_float2(dcp[mt][i][0], dcp[mt][i][1]);
                        } else if (initial) {
                            size_t at = (rowb(mt, i) * L + l) * H + ub;
                            if (a.g_h0)
                                *reinterpret_cast<float2 *>(a.g_h0 + at) = dho;
                            if (a.g_c0)
                                *reinterpret_cast<float2 *>(a.g_c0 + at) =
                                    make_float2(dcp[mt][i][0], dcp[mt][i][1]);
                        }
                    };
                    if constexpr (WIDE) {
                        if (rv[mt][i] && (a.stored || !rst(2 * mt + i)))
                            out(slot_sum(16 * mt + g + 8 * i), true);
                    } else {
                        if (rv[mt][i])
                            out(make_float2(dh[mt][i][0], dh[mt][i][1]), !rst(2 * mt + i));
                    }
                }
                // Carried into step t - 1, or zero where the state ends here.
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const bool carry = t > 0 && !rst(2 * mt + i);
                if constexpr (WIDE)
                    carried |= (uint32_t)carry << (2 * mt + i);
                else
#pragma unroll
                    for (int j = 0; j < 2; j++)
                        dh[mt][i][j] = carry ? dh[mt][i][j] : 0.0f;
#pragma unroll
                for (int j = 0; j < 2; j++)
                    dc[mt][i][j] = carry ? dcp[mt][i][j] : 0.0f;
            }
    }
    if (a.dw16 && w == 0)
        dw256_signal<0>(a.dw16_ready, T - 1, lane);
    // 64 rows: the last "sums read": no CTA leaves while another may still write to it. WIDE: P_0
    // was the last wait: every write to this CTA's shared memory is done (the GRU's "slots read"
    // arrivals and waits pair up within each step).
    if constexpr (!WIDE)
        cluster_wait();
}

// The launch of either loop: CL-CTA clusters, one per `rows` batch rows (not copyable: cfg points
// at attr).
struct cluster_launch {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cluster_launch(int B, long smem, cudaStream_t stream, int rows) {
        cfg.gridDim = dim3((unsigned)(CEIL_DIV(B, rows) * CL), 1, 1);
        cfg.blockDim = dim3(CTHREADS, 1, 1);
        cfg.dynamicSmemBytes = (size_t)smem;
        cfg.stream = stream;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = CL;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    cluster_launch(const cluster_launch &) = delete;
    cluster_launch &operator=(const cluster_launch &) = delete;
};

// Clusters of a loop's kernel the device runs at once (0 when it cannot launch it).
template <class Args>
int cluster_active(void (*kernel)(Args), long smem, int rows) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    cluster_launch launch(32 * rows, smem, nullptr, rows);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &launch.cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

template <int ROWS>
int cluster_active_rows(bool backward) {
    return backward ? cluster_active(seq_cluster_backward_kernel<cell_lstm, ROWS>,
                                     bshape<cell_lstm, ROWS>::SMEM, ROWS)
                    : cluster_active(seq_cluster_forward_kernel<cell_lstm, ROWS, true>,
                                     fshape<cell_lstm, ROWS>::SMEM, ROWS);
}

// Launches kernel in the clusters of `rows` rows over a's B rows with smem bytes of dynamic
// shared memory.
template <class Args>
int cluster_run(void (*kernel)(Args), const Args *a, long smem, int rows, cudaStream_t stream) {
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cluster_launch launch(a->B, smem, stream, rows);
    RNND_CUDA_TRY(cudaLaunchKernelEx(&launch.cfg, kernel, *a));
    return 0;
}

// Conditions the caller checks: H == 256, I_l <= 64 with I_l % 4 == 0 and x, z, y, the states
// 8-byte aligned with even strides (a.xvec and a.vec), sm_90.
template <int ROWS>
int cluster_forward(const struct persist_fwd_args *a, bool lstm, cudaStream_t stream) {
    if (a->H != HC || a->Il > CXK || a->Il % 4 != 0 || !a->xvec || !a->vec || !a->x)
        return RNND_EINVAL;
    if (lstm)
        return cluster_run(a->shalf ? seq_cluster_forward_kernel<cell_lstm, ROWS, true>
                                    : seq_cluster_forward_kernel<cell_lstm, ROWS, false>,
                           a, fshape<cell_lstm, ROWS>::SMEM, ROWS, stream);
    return cluster_run(a->shalf ? seq_cluster_forward_kernel<cell_gru, ROWS, true>
                                : seq_cluster_forward_kernel<cell_gru, ROWS, false>,
                       a, fshape<cell_gru, ROWS>::SMEM, ROWS, stream);
}

template <int ROWS>
int cluster_backward(const struct persist_bwd_args *a, bool lstm, cudaStream_t stream) {
    if (a->H != HC || !a->vec || !a->shalf)
        return RNND_EINVAL;
    return lstm ? cluster_run(seq_cluster_backward_kernel<cell_lstm, ROWS>, a,
                              bshape<cell_lstm, ROWS>::SMEM, ROWS, stream)
                : cluster_run(seq_cluster_backward_kernel<cell_gru, ROWS>, a,
                              bshape<cell_gru, ROWS>::SMEM, ROWS, stream);
}

} // namespace

int rnnd__cluster_forward(const struct persist_fwd_args *a, bool lstm, int rows,
                          cudaStream_t stream) {
    return rows == 80 ? cluster_forward<80>(a, lstm, stream) : cluster_forward<64>(a, lstm, stream);
}

int rnnd__cluster_backward(const struct persist_bwd_args *a, bool lstm, int rows,
                           cudaStream_t stream) {
    return rows == 80 ? cluster_backward<80>(a, lstm, stream)
                      : cluster_backward<64>(a, lstm, stream);
}

int rnnd__cluster_active(int rows, bool backward) {
    return rows == 80 ? cluster_active_rows<80>(backward) : cluster_active_rows<64>(backward);
}
