/*
 * step_impl.cuh: what the step kernels of step.cu and step_wg.cu (the tile kernel on warpgroup
 * MMAs, sm_90a) share: their arguments, the programmatic-launch controls, the row-tile counter
 * and scatter of the in-place scheme (step.cu's header says why), and the launcher.
 */
#ifndef RNND_CUDA_STEP_IMPL_CUH
#define RNND_CUDA_STEP_IMPL_CUH

#include "common.cuh"
#include "step.cuh"

// Bench variant (cuda_ctx.variant, RNND_CUDA_VARIANT): every launch without PDL (bench/NOTES.md
// "single step" v6).
#define RNND_STEP_VARIANT_NO_PDL 512

static __device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Programmatic dependent launch (Hopper; no-ops before sm_90 and in a grid launched without it):
// every step kernel waits for the previous kernel on the stream to complete (its writes visible)
// before its first load, then lets the next one start its blocks.
static __device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel on the stream (when launched programmatically) start its blocks; they
// still wait for this grid's completion before they read anything.
static __device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

struct step_kargs {
    int B, I, H, L, l;      // B: rows of this launch (a chunk of the call's rows)
    const float *x;         // (B, I) layer 0's input; layers above read the slot table
    const uint8_t *is_init; // (B) or NULL
    const int32_t *slots;   // (B)
    float *state_h, *state_c;
    float *h_new;               // (B, H) the layer's new h: out for the top layer, else a stage
    float *c_new;               // (B, H) the layer's new c (LSTM), a stage
    float *h_before, *c_before; // (B, L, H) or NULL
    const float *w_ih, *w_hh, *b_ih, *b_hh;
    int *count;        // (row tiles) zero between launches; then step_wg.cu's barriers (below)
    bool vec_x, vec_h; // 16-byte copies possible for the x part, the h part
};

// Where row b (< a.B) of a launch reads layer a.l: its slot, its x part (layer 0: x, above:
// layer l-1 of its state) and its h part (NULL where it resets: zeros). Absent rows: {0, NULL,
// NULL}.
struct step_row {
    int slot;
    const float *x, *h;
};
static __device__ __forceinline__ step_row step_row_at(const step_kargs &a, int b) {
    if (b >= a.B)
        return {0, nullptr, nullptr};
    const bool reset = a.is_init && __ldcg(a.is_init + b);
    const int slot = __ldcg(a.slots + b);
    const float *state = a.state_h + (size_t)slot * a.L * a.H;
    return {slot, a.l == 0 ? a.x + (size_t)b * a.I : state + (size_t)(a.l - 1) * a.H,
            reset ? nullptr : state + (size_t)a.l * a.H};
}

// Counts the calling block on its row tile's counter; true in the block that arrives last (every
// thread of the block gets the answer). Every block's stores before the call are visible to the
// last one: they are ordered before the barrier, and thread 0's acq_rel add releases them at gpu
// scope (cumulatively) and acquires the others' (the pattern of CUTLASS's semaphore).
static __device__ __forceinline__ bool tile_arrive(int *count, bool *s_last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;"
                     : "=r"(old)
                     : "l"(count)
                     : "memory");
        *s_last = old == (int)(gridDim.x - 1);
        if (*s_last)
            *count = 0; // for the next launch (kernel boundaries order it)
    }
    __syncthreads();
    return *s_last;
}

// A barrier of the blocks of a row tile (step_wg.cu; why no block waits forever: its
// wg_launch), one thread a block, on two counters of the tile that only grow (unsigned,
// wrapping): arrivals count[RNND_STEP_TILES] and done count[2 RNND_STEP_TILES], the arrivals when
// the previous launch on the tile completed. A block reads done at its start (no block of this
// launch writes it before every block has arrived), arrives with a release add (its reads of the
// old states before it; no value to wait for), waits until the arrivals reach done + blocks
// (acquire: every block's reads before), then records that as done for the next launch (every
// block writes the same value). No reset, no last arriver: the waiters see the last add itself.
static __device__ __forceinline__ unsigned tile_done(const int *count) {
    return __ldcg(reinterpret_cast<const unsigned *>(count) + 2 * RNND_STEP_TILES);
}
static __device__ __forceinline__ void tile_barrier_arrive(int *count) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count + RNND_STEP_TILES)
                 : "memory");
}
static __device__ __forceinline__ void tile_barrier_wait(int *count, unsigned done, int blocks) {
    const unsigned target = done + (unsigned)blocks;
    unsigned n;
    do
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                     : "=r"(n)
                     : "l"(count + RNND_STEP_TILES)
                     : "memory");
    while ((int)(n - target) < 0);
    reinterpret_cast<unsigned *>(count)[2 * RNND_STEP_TILES] = target;
}

// The n elements T of the dense rows hs (cs) into rows s_slot[i / W] of the slot table hd (cd,
// when not NULL), layer l of L, W elements a row. Each thread issues a batch of loads before its
// stores, so the tail costs about one L2 round trip per batch rather than one per element.
template <class T>
static __device__ void tile_scatter_rows(const T *hs, const T *cs, T *hd, T *cd, int n, int W,
                                         int L, int l, const int *s_slot) {
    constexpr int NB = 8;
    const int nt = blockDim.x;
    for (int i0 = threadIdx.x; i0 < n; i0 += NB * nt) {
        T vh[NB], vc[NB];
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const int i = i0 + j * nt;
            if (i < n) {
                vh[j] = __ldcg(hs + i);
                if (cd)
                    vc[j] = __ldcg(cs + i);
            }
        }
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const int i = i0 + j * nt;
            if (i < n) {
                const size_t at = ((size_t)s_slot[i / W] * L + l) * W + i % W;
                hd[at] = vh[j];
                if (cd)
                    cd[at] = vc[j];
            }
        }
    }
}

// The last block of a row tile: the tile's new h (and c) from the dense outputs into the slot
// table, layer a.l, in 16-byte elements where the widths and pointers allow. Loads go through L2
// (__ldcg): other SMs wrote them during this launch.
static __device__ void tile_scatter(const step_kargs &a, int row0, int nrows, const int *s_slot) {
    const int H = a.H;
    if (a.vec_h && ((uintptr_t)a.h_new & 15) == 0 && ((uintptr_t)a.c_new & 15) == 0) {
        const int H4 = H / 4;
        tile_scatter_rows(reinterpret_cast<const float4 *>(a.h_new) + (size_t)row0 * H4,
                          reinterpret_cast<const float4 *>(a.c_new) + (size_t)row0 * H4,
                          reinterpret_cast<float4 *>(a.state_h),
                          reinterpret_cast<float4 *>(a.state_c), nrows * H4, H4, a.L, a.l, s_slot);
    } else {
        tile_scatter_rows(a.h_new + (size_t)row0 * H, a.c_new + (size_t)row0 * H, a.state_h,
                          a.state_c, nrows * H, H, a.L, a.l, s_slot);
    }
}

// Launches one layer's kernel. On Hopper with programmatic stream serialization (PDL): its
// blocks may become resident while the previous kernel on the stream runs and wait for it in
// griddepcontrol.wait, which hides the launch gap between back-to-back steps and between layers
// (a captured launch becomes a programmatic graph edge). Only where the kernel reads nothing
// through L1 before or after that wait (16-byte cp.async.cg copies, __ldcg loads): the 4-byte
// copies of odd widths (cp.async.ca) launch plainly. Bench variant bit RNND_STEP_VARIANT_NO_PDL
// turns it off.
template <class Kernel, class... Args>
static int step_kernel_launch(struct cuda_ctx *c, Kernel kernel, dim3 grid, dim3 block, size_t smem,
                              bool l1_free, const Args &...args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = attr;
    cfg.numAttrs = c->cc_major >= 9 && l1_free && !(c->variant & RNND_STEP_VARIANT_NO_PDL) ? 1 : 0;
    RNND_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, args...));
    return 0;
}

// The tile kernel on warpgroup MMAs (step_wg.cu; built when the architectures include 90, as
// RNND_HAVE_WG says), for TF32 mode on a compute 9.0 device: tiles of 64 rows x 32 units. The
// launch takes layers whose copies are all 16 bytes (a.vec_x, a.vec_h) and returns RNND_ENOTSUP
// for others; prepare raises its shared-memory limits, once per context.
#define RNND_STEP_WG_MT 64
#define RNND_STEP_WG_UT 32
int rnnd__wg_step_prepare(void);
int rnnd__wg_step_launch(struct cuda_ctx *c, const step_kargs &a, bool lstm);

#endif // RNND_CUDA_STEP_IMPL_CUH
