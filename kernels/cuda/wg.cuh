/*
 * wg.cuh: the Hopper primitives that seq_wg.cu, seq_dw.cu, step_wg.cu and seq_gru_backward.cuh share:
 * shared-memory matrix descriptors and the K-major operand offset, ldmatrix, mbarriers, bulk and
 * tensor-map copies (TMA), the fence / commit / wait of the asynchronous warpgroup MMAs (wgmma,
 * sm_90a), and the m64n16k16 fp16 MMAs that the GRU's loops share (the wgmma forward's, the ZF
 * backward's dh); the other shapes stay with their kernels.
 *
 * Operands in shared memory are K-major in core matrices of 8 rows x 16 bytes (128 contiguous
 * bytes), no swizzle: core matrices adjacent in K 128 bytes apart (the descriptor's leading byte
 * offset), adjacent 8-row groups `sbo` bytes apart (its stride byte offset). One k-step of an MMA
 * (16 fp16 or 8 tf32 columns) spans two core matrices: the next k-step's descriptor is 256 bytes
 * (16 in the descriptor's units) further.
 */
#ifndef RNND_CUDA_WG_CUH
#define RNND_CUDA_WG_CUH

#include <stdint.h>

static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// ldmatrix of four 8x8 matrices of 16-bit elements, lane L giving the row address of row L%8 of
// matrix L/8; TRANS hands each lane a column pair instead of a row pair.
template <bool TRANS>
static __device__ __forceinline__ void ldmatrix_x4_at(uint32_t r[4], const void *row) {
    const uint32_t addr = smem_u32(row);
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
}

// Shared-memory matrix descriptor: start address, leading byte offset 128, stride byte offset
// sbo, no swizzle; addresses in 16-byte units.
static __device__ __forceinline__ uint64_t wg_desc(const void *p, uint32_t sbo) {
    return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) |
           ((uint64_t)(sbo >> 4) << 32);
}

// The same for a K-major operand in 128-byte swizzled rows: 8-row atoms of 1024 bytes (1024-byte
// aligned), row r of an atom at 128 r with its 16-byte units permuted (unit j at j ^ (r % 8));
// the next 8 rows 1024 bytes further. A k-step inside the 128 bytes moves the start address.
static __device__ __forceinline__ uint64_t wg_desc_sw128(const void *p) {
    return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// An N-major operand (the MMA's trans-b) in the same swizzled atoms, a row holding 64 consecutive
// N (16-bit) of one K: the next 8 K rows 1024 bytes further (stride byte offset), the next 64 N
// lbo bytes (leading byte offset; CUTLASS's canonical MN-major 128-byte swizzle layout).
static __device__ __forceinline__ uint64_t wg_desc_mn_sw128(const void *p, uint32_t lbo) {
    return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// Byte offset of element (r, k) in a K-major 16-bit operand of kg groups of 8 columns.
static __device__ __forceinline__ uint32_t km_off(int r, int k, int kg) {
    return (uint32_t)((r >> 3) * (kg * 128) + (k >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2);
}

// mbarriers in shared memory: a phase completes when `count` arrivals have come; a wait is on the
// parity of the phase it waits for (the k-th phase of a barrier: parity k % 2).
static __device__ __forceinline__ void mbar_init(uint64_t *b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count)
                 : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b))
                 : "memory");
}
// Waits for the phase of parity `parity` of b to complete. Acquire at CTA scope also where the
// phase's bytes came from other CTAs of the cluster (bulk copies, st.async): they are written by
// the async proxy and counted on this CTA's mbarrier, so they have landed when the phase completes
// (as in CUTLASS's multicast pipelines). Cluster scope compiles to an L1 invalidation (CCTL.IVALL)
// that waits for the loads in flight (docs/kernels.md).
static __device__ __forceinline__ void mbar_wait(uint64_t *b, int parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(smem_u32(b)),
                 "r"(parity)
                 : "memory");
}
// An arrival on b once every cp.async this thread issued before has landed (.noinc: it counts
// toward b's arrivals like mbar_arrive).
static __device__ __forceinline__ void cp_async_mbar_arrive(uint64_t *b) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(b))
                 : "memory");
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Raises the bytes b's current phase waits for (asynchronous copies complete them).
static __device__ __forceinline__ void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)),
                 "r"(bytes)
                 : "memory");
}
// An arrival on b that also raises the bytes its current phase waits for, in one operation;
// relaxed: it orders none of this thread's earlier accesses.
static __device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile(
        "mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)),
        "r"(bytes)
        : "memory");
}
// Makes the mbarriers this thread initialized visible to the copy engine (the tensor-map copies)
// and to the other CTAs of the cluster.
static __device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// A ring of n stages: full[i] completes on nf arrivals (and the copies' bytes), empty[i] on ne;
// made visible to the copy engine. One thread calls it before the block's barrier.
static __device__ __forceinline__ void mbar_ring_init(uint64_t *full, uint64_t *empty, int n,
                                                      int nf, int ne) {
    for (int i = 0; i < n; i++) {
        mbar_init(full + i, nf);
        mbar_init(empty + i, ne);
    }
    fence_mbar_init();
}
static __device__ __forceinline__ void tma_prefetch_desc(const void *tmap) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(tmap) : "memory");
}
// bytes (a multiple of 16) from global src to shared dst, completing them on the mbarrier bar.
static __device__ __forceinline__ void bulk_g2s(void *dst, const void *src, uint32_t bytes,
                                                uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
// The producer of a ring made by mbar_ring_init, before filling stage i: waits until buffer
// i % n is free (stage i - n consumed), arms full[i % n] for `bytes` and returns i % n.
static __device__ __forceinline__ int mbar_ring_fill(uint64_t *full, uint64_t *empty, int i, int n,
                                                     uint32_t bytes) {
    const int st = i % n;
    if (i >= n)
        mbar_wait(empty + st, (i / n - 1) & 1);
    mbar_expect_tx(full + st, bytes);
    mbar_arrive(full + st);
    return st;
}
// The box at coordinates (x, y) of a 2-D tensor map into shared address dst, completing its bytes
// on the mbarrier at shared address bar.
static __device__ __forceinline__ void tma_load_2d(uint32_t dst, const void *tmap, int x, int y,
                                                   uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(tmap), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}
// The same for the box at (x, y, z) of a 3-D tensor map.
static __device__ __forceinline__ void tma_load_3d(uint32_t dst, const void *tmap, int x, int y,
                                                   int z, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"(tmap), "r"(x), "r"(y), "r"(z), "r"(bar)
                 : "memory");
}
#endif

// The warpgroup MMAs' fence, commit and wait (sm_90a).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
static __device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
static __device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most N of this warp's committed MMA groups are pending.
template <int N>
static __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous MMAs.
static __device__ __forceinline__ void wg_pin(float (&d)[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

// d = A B (ACC: d += A B), m64 n16 k16, fp16 (BF: bf16) in, fp32 accumulate; A from registers,
// B K-major (descriptor). The first k-step writes d without reading it, so that the compiler does
// not keep the accumulators live across the whole loop.
#define WG_RS(ty)                                                                                  \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                                   \
    "wgmma.mma_async.sync.aligned.m64n16k16.f32." ty "." ty " "                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
#define WG_SS(ty)                                                                                  \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                                   \
    "wgmma.mma_async.sync.aligned.m64n16k16.f32." ty "." ty " "                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
#define WG_D(c) c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7])
#define WG_A    "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
template <bool ACC, bool BF = false>
static __device__ __forceinline__ void wg_mma_rs(float (&d)[8], const uint32_t (&a)[4],
                                                 uint64_t b) {
    if constexpr (BF && ACC)
        asm volatile(WG_RS("bf16") : WG_D("+f") : WG_A, "n"(1));
    else if constexpr (BF)
        asm volatile(WG_RS("bf16") : WG_D("=f") : WG_A, "n"(0));
    else if constexpr (ACC)
        asm volatile(WG_RS("f16") : WG_D("+f") : WG_A, "n"(1));
    else
        asm volatile(WG_RS("f16") : WG_D("=f") : WG_A, "n"(0));
}
// The same with A from shared memory (K-major, descriptor).
template <bool ACC, bool BF = false>
static __device__ __forceinline__ void wg_mma_ss(float (&d)[8], uint64_t a, uint64_t b) {
    if constexpr (BF && ACC)
        asm volatile(WG_SS("bf16") : WG_D("+f") : "l"(a), "l"(b), "n"(1));
    else if constexpr (BF)
        asm volatile(WG_SS("bf16") : WG_D("=f") : "l"(a), "l"(b), "n"(0));
    else if constexpr (ACC)
        asm volatile(WG_SS("f16") : WG_D("+f") : "l"(a), "l"(b), "n"(1));
    else
        asm volatile(WG_SS("f16") : WG_D("=f") : "l"(a), "l"(b), "n"(0));
}
#undef WG_RS
#undef WG_SS
#undef WG_D
#undef WG_A
#endif

#endif // RNND_CUDA_WG_CUH
