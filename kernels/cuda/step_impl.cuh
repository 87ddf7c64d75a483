/*
 * step_impl.cuh: what the step kernels of step.cu and step_wg.cu (the tile kernel on warpgroup
 * MMAs, sm_90a) share: their arguments, the programmatic-launch controls, the row tiles'
 * barrier of the in-place scheme, and the launcher.
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
    float *out;                 // (B, H) the top layer's new h (NULL below it)
    float *h_before, *c_before; // (B, L, H) or NULL
    const float *w_ih, *w_hh, *b_ih, *b_hh;
    int *count;        // the row tiles' barriers (tile_barrier): arrivals, then done
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

// In place: every block of a row tile reads the tile's old h of layer l over all units, so no
// block may write its new states into the slot table while another may still read them. The
// blocks of a row tile meet at a barrier once each has read them, then each writes its own.
// Why no block waits forever: blocks start in index order and a row tile's blocks are
// consecutive, so every tile before the last started one has all its blocks running, finishes
// and frees SMs for the rest, whatever the grid's size and however few SMs are free (other
// streams' kernels, MPS); a cooperative launch, the formal guarantee, cost 0.8 us a step
// (bench/NOTES.md "single step" v10).
//
// The barrier, one thread a block, on two counters of the tile that only grow (unsigned,
// wrapping): arrivals count[0] and done count[RNND_STEP_TILES], the arrivals when the previous
// launch on the tile completed. A block reads done at its start (no block of this launch writes
// it before every block has arrived), arrives with a release add (its reads of the old states
// before it; no value to wait for), waits until the arrivals reach done + blocks (acquire: every
// block's reads before), then records that as done for the next launch (every block writes the
// same value). No reset, no last arriver: the waiters see the last add itself (v17).
static __device__ __forceinline__ unsigned tile_done(const int *count) {
    return __ldcg(reinterpret_cast<const unsigned *>(count) + RNND_STEP_TILES);
}
static __device__ __forceinline__ void tile_barrier_arrive(int *count) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
}
static __device__ __forceinline__ void tile_barrier_wait(int *count, unsigned done, int blocks) {
    const unsigned target = done + (unsigned)blocks;
    unsigned n;
    do
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(count) : "memory");
    while ((int)(n - target) < 0);
    reinterpret_cast<unsigned *>(count)[RNND_STEP_TILES] = target;
}
// The whole barrier for a block whose threads have all read (and used) the old states: thread 0
// (which read done at the start) arrives and waits; the block's stores may follow.
static __device__ __forceinline__ void tile_barrier(int *count, unsigned done) {
    __syncthreads();
    if (threadIdx.x == 0) {
        tile_barrier_arrive(count);
        tile_barrier_wait(count, done, gridDim.x);
    }
    __syncthreads();
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
