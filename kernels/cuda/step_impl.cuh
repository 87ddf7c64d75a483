/*
 * step_impl.cuh: what the step kernels of step.cu and step_wg.cu (the tile kernel on warpgroup
 * MMAs, sm_90a) share: their arguments, the programmatic-launch controls and the launcher.
 */
#ifndef RNND_CUDA_STEP_IMPL_CUH
#define RNND_CUDA_STEP_IMPL_CUH

#include "common.cuh"

static __device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Programmatic dependent launch (Hopper; no-ops before sm_90 and in a grid launched without it):
// every step kernel waits for the previous kernel on the stream to complete (its writes visible)
// before it reads what that kernel may have written, then lets the next one start its blocks;
// they still wait for this grid's completion before they read anything it may write. What no
// earlier kernel can be writing may be read before the wait, while the previous kernel finishes:
// the weights and biases (step_kargs.pre), and at layer 0 the step's inputs (step_kargs.early_x).
static __device__ __forceinline__ void grid_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
static __device__ __forceinline__ void grid_wait_then_release() {
    pdl_wait();
    grid_release();
}

// One layer of a step. Row b reads its old state from table row slots[b] and writes its new one
// to row slots_new[b]; no row is both (struct rnnd_step), so blocks never wait for each other:
// each writes its new states as soon as its cell has them (docs/kernels.md).
struct step_kargs {
    int B, I, H, L, l;      // B: rows of this launch
    const float *x;         // (B, I) layer 0's input; layers above read layer l-1's new state
    const uint8_t *is_init; // (B) or NULL
    const int32_t *slots, *slots_new; // (B) each
    float *state_h, *state_c;
    float *out;                 // (B, H) the top layer's new h (NULL below it)
    float *h_before, *c_before; // (B, L, H) or NULL
    const float *w_ih, *w_hh, *b_ih, *b_hh;
    bool vec_x, vec_h; // 16-byte copies possible for the x part, the h part
    // The kernel may read the weights and biases before griddepcontrol.wait: the kernel before
    // it on the stream is one of rnn_step's (which writes no weights), or there is none that
    // could still run (rnnd__cuda_rnn_step: cuda_ctx.step_tail).
    bool pre;
    // Layer 0 may also read this step's inputs (x, is_init, slots, slots_new) before the wait: it
    // follows a step that wrote none of them (implies pre). Only step_wg.cu's kernel uses it.
    bool early_x;
};

// The start of every step kernel (step_wait): load (reads of weights and biases only) before the
// programmatic wait where a.pre allows, else after it; then the next kernel may start its blocks
// (after the wait: at most this grid and the next resident). step_wait_only leaves that start to
// its caller.
template <class Load>
static __device__ __forceinline__ void step_wait_only(const step_kargs &a, Load load) {
    if (a.pre)
        load();
    pdl_wait();
    if (!a.pre)
        load();
}
template <class Load>
static __device__ __forceinline__ void step_wait(const step_kargs &a, Load load) {
    step_wait_only(a, load);
    grid_release();
}

// Unit u's biases of every gate plane, for its cell.
template <int G>
static __device__ __forceinline__ void unit_biases(const step_kargs &a, int u, float (&bx)[G],
                                                   float (&bh)[G]) {
#pragma unroll
    for (int q = 0; q < G; q++) {
        bx[q] = __ldcg(a.b_ih + q * a.H + u);
        bh[q] = __ldcg(a.b_hh + q * a.H + u);
    }
}

// Where row b (< a.B) of a launch reads layer a.l: its table rows (old state, new state), its x
// part (layer 0: x, above: layer l-1's new state) and its h part (NULL where it resets: zeros).
// Absent rows: {0, 0, NULL, NULL}.
struct step_row {
    int slot, slot_new;
    const float *x, *h;
};
static __device__ __forceinline__ step_row step_row_at(const step_kargs &a, int b) {
    if (b >= a.B)
        return {0, 0, nullptr, nullptr};
    const bool reset = a.is_init && __ldcg(a.is_init + b);
    const int slot = __ldcg(a.slots + b), slot_new = __ldcg(a.slots_new + b);
    const size_t LH = (size_t)a.L * a.H;
    return {slot, slot_new,
            a.l == 0 ? a.x + (size_t)b * a.I : a.state_h + slot_new * LH + (size_t)(a.l - 1) * a.H,
            reset ? nullptr : a.state_h + slot * LH + (size_t)a.l * a.H};
}

// Launches one layer's kernel. On Hopper with programmatic stream serialization (PDL): its
// blocks may become resident while the previous kernel on the stream runs and wait for it in
// griddepcontrol.wait, which hides the launch gap between back-to-back steps and between layers
// (a captured launch becomes a programmatic graph edge). Only where the kernel reads nothing
// through L1 before or after that wait (16-byte cp.async.cg copies, __ldcg loads): the 4-byte
// copies of odd widths (cp.async.ca) launch plainly. The bench turns it off with
// RNND_TUNE_STEP_NO_PDL (tuning.h).
template <class Kernel, class... Args>
static int step_kernel_launch(struct cuda_ctx *c, Kernel kernel, dim3 grid, dim3 block, size_t smem,
                              bool l1_free, const Args &...args) {
    return cuda_launch(c->stream, c->dev.cc_major >= 9 && l1_free && !c->tune.step_no_pdl, kernel,
                       grid, block, smem, args...);
}

// The tile kernel on warpgroup MMAs (step_wg.cu; built when the architectures include 90, as
// RNND_HAVE_WG says), for TF32 mode on a compute 9.0 device: tiles of 64 rows x 32 units. The
// launch takes layers whose copies are all 16 bytes (a.vec_x, a.vec_h) and returns RNND_EINVAL
// for others (step.cu launches its own kernel for them); prepare raises its shared-memory limits, once per context.
#define RNND_STEP_WG_MT 64
#define RNND_STEP_WG_UT 32
int rnnd__wg_step_prepare(void);
int rnnd__wg_step_launch(struct cuda_ctx *c, const step_kargs &a, bool lstm);

// step16.cu's path for many rows at a large H: fp16 rows and weights (the derived copy), one
// cuBLAS GEMM and a cell kernel a layer. takes: whether a step goes there (a derived copy, made
// for H >= RNND_STEP16_MIN_H in the tensor-core modes, and a step large enough that the GEMM wins,
// step16.cu; the variant bits force it either way; inside a recording only while the scratch
// is large enough). args: each layer's arguments (step.cu's step_args).
#define RNND_STEP16_MIN_H 512
bool rnnd__cuda_step16_takes(const struct cuda_ctx *c, const struct rnnd_step *st,
                             const struct rnnd_model *m);
int rnnd__cuda_step16(struct cuda_ctx *c, const struct rnnd_step *st, const step_kargs *args,
                      const struct rnnd_model *m);

#endif // RNND_CUDA_STEP_IMPL_CUH
