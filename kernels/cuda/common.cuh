/*
 * common.cuh: what every file of the CUDA backend (kernels/cuda/) shares: the backend context,
 * error and launch checks, small device helpers (activations, tf32/bf16 rounding, the tensor-core
 * fragment types and MMA wrappers) and the sequence layout (tape, scratch) that the forward and
 * backward drivers agree on.
 *
 * Conventions: device pointers that sit next to host pointers carry a d_ prefix; every launch is
 * followed by CUDA_LAUNCH_CHECK(); fallible host functions return 0 or a negative RNND_E*.
 * Kernels never log (docs/style.md §3): a failed CUDA call becomes RNND_EDEVICE for the caller.
 */
#ifndef RNND_CUDA_COMMON_CUH
#define RNND_CUDA_COMMON_CUH

#include "rnnd_kernels.h"
#include "seq_plan.h"
#include "tuning.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CEIL_DIV(a, b) (((a) + (b)-1) / (b))
#define ROUND_UP(a, b) (CEIL_DIV(a, b) * (b))

// A failed CUDA runtime call: return RNND_EDEVICE from the enclosing function (which returns int).
#define RNND_CUDA_TRY(expr)                                                                        \
    do {                                                                                           \
        cudaError_t rnnd__e = (expr);                                                              \
        if (rnnd__e != cudaSuccess)                                                                \
            return rnnd__e == cudaErrorMemoryAllocation ? RNND_ENOMEM : RNND_EDEVICE;              \
    } while (0)

#define RNND_CUBLAS_TRY(expr)                                                                      \
    do {                                                                                           \
        cublasStatus_t rnnd__s = (expr);                                                           \
        if (rnnd__s != CUBLAS_STATUS_SUCCESS)                                                      \
            return rnnd__s == CUBLAS_STATUS_ALLOC_FAILED ? RNND_ENOMEM : RNND_EDEVICE;             \
    } while (0)

// After every launch (llm.c's cudaCheck(cudaGetLastError())).
#define CUDA_LAUNCH_CHECK() RNND_CUDA_TRY(cudaGetLastError())

#define RNND_TRY(expr)                                                                             \
    do {                                                                                           \
        int rnnd__r = (expr);                                                                      \
        if (rnnd__r != 0)                                                                          \
            return rnnd__r;                                                                        \
    } while (0)

// Launches kernel on stream; pdl (compute 9.0): as a programmatic dependent of the kernel before
// it on the stream, whose blocks may become resident while that kernel runs (a captured launch
// becomes a programmatic graph edge). Such a kernel must wait for the one before (pdl_wait)
// before it reads anything that kernel may write.
template <class Kernel, class... Args>
static int cuda_launch(cudaStream_t stream, bool pdl, Kernel kernel, dim3 grid, dim3 block,
                       size_t smem, const Args &...args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    RNND_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, args...));
    return 0;
}
// The wait of a cuda_launch(pdl) kernel for the kernel before it: that kernel has completed and
// its writes are visible. A no-op before compute 9.0 and in a grid launched without pdl.
static __device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// The backend context (one per rnnd_backend; one thread at a time).

#define SEQ_GRAPHS          8   // a forward and a backward for each of up to four layers
#define SEQ_GRAPH_KEY_BYTES 320 // seq.cu's struct stepwise_key fits (static_assert there)

struct seq_graph {
    cudaGraphExec_t exec;
    unsigned long long used; // cuda_ctx.seq_graph_calls when it last ran
    unsigned char key[SEQ_GRAPH_KEY_BYTES];
};

struct cuda_ctx {
    int device;
    struct seq_device dev; // what the plans read of the device (compute capability, SMs, ...)
    cudaStream_t stream;
    cublasHandle_t blas;
    void *d_blas_ws; // cuBLAS workspace, set explicitly so results do not depend on the stream
    void *d_scratch; // per-op buffers, grown on demand (synchronises before it grows)
    size_t scratch_bytes;
    double *d_partials; // optimizer: per-block sums of squares (RNND_OPTIM_BLOCKS)
    float *d_norm;      // optimizer: the gradient norm, then the clip coefficient
    float *h_norm;      // pinned host copy of the norm
    unsigned long long *d_first, *h_first; // nonfinite: the first index found, pinned copy
    unsigned *d_step_bar; // step.cu's grid barrier: arrivals, generation (zeroed once)
    // The event a CUDA region's client waits for after an early reply (ipc_event), or NULL
    // where the driver cannot share one.
    cudaEvent_t ipc_ev;
    cudaIpcEventHandle_t ipc_handle;
    cudaEvent_t mark_ev;     // mark, sync_mark
    struct cuda_tuning tune; // the bench's and the tests' overrides (tuning.h); zero otherwise
    long long *d_dbg;        // phase clocks (RNND_CUDA_PHASE_CLOCKS): [2][1024][8] fwd, bwd
    // The last work enqueued on the stream is rnn_step's (which writes no weights), so the next
    // step's kernels may read the weights before their programmatic wait (step_kargs.pre). Every
    // other op that enqueues work clears it (backend.cu).
    bool step_tail;
    // What that step wrote outside the state tables (out, h_before, c_before; n = 0: nothing): a
    // step whose inputs overlap none of it may read them before its wait (step_kargs.early_x).
    struct dev_span {
        const void *p;
        size_t n;
    } step_wrote[3];
    // Held from record_begin to record_end: host_free (any thread) synchronises the stream, which
    // would break a recording on it.
    pthread_mutex_t record_lock;
    // host_alloc's allocations with their device addresses, which small copies read or write
    // by a kernel (backend.cu), under pinned_lock: host_alloc and host_free run on any thread.
    struct pinned_range {
        char *host, *dev;
        size_t bytes;
    } * pinned;
    int npinned, pinned_cap;
    pthread_mutex_t pinned_lock;
    // The per-step path's loops recorded (seq.cu, stepwise_graph), each under the bytes of its
    // call's arguments, replayed while a call's are the same; the least recently used one gives
    // way.
    struct seq_graph seq_graphs[SEQ_GRAPHS];
    unsigned long long seq_graph_calls;
};

// The power of two 2^(top - e) for a maximum m = f 2^e (f in [0.5, 1)): it puts m in
// [2^(top-1), 2^top) (1 for m zero or not finite). e is taken as at least -100, so that the
// power stays finite: a maximum below 2^-100 is scaled by 2^(top+100), less than the others.
// From the bits (a subnormal m reads as e = -126): the TF32 dw16 loops call it every step, where
// frexpf and ldexpf cost the LSTM's 0.13 ms (docs/kernels.md).
static __device__ __forceinline__ float persist_pow2_for(float m, int top) {
    if (!(m > 0.0f) || !(m <= 3.0e38f))
        return 1.0f;
    int e = (int)((__float_as_uint(m) >> 23) & 255) - 126;
    e = e < -100 ? -100 : e;
    return __uint_as_float((uint32_t)(127 + top - e) << 23);
}

// 1 / p for a power of two p that persist_pow2_for returns: exact, from the bits (a division
// took two of the routing's ~500 cycles a step in the backward loops).
static __device__ __forceinline__ float pow2_inv(float p) {
    return __uint_as_float(0x7f000000u - __float_as_uint(p));
}

// Whether p allows 16-byte accesses.
static inline bool aligned16(const void *p) {
    return ((uintptr_t)p & 15) == 0;
}

// Makes ctx->d_scratch at least bytes long.
int rnnd__cuda_reserve(struct cuda_ctx *c, size_t bytes);

// A recording of the work enqueued on ctx's stream between the two (a CUDA graph: *unit, an
// instantiated cudaGraphExec_t), holding record_lock meanwhile; RNND_EDEVICE where it fails.
int rnnd__cuda_record_begin(void *ctx);
int rnnd__cuda_record_end(void *ctx, void **unit);

// A bump allocator over the scratch (or a tape): measure with base NULL, then carve for real.
// The sizes asked must not depend on the pointers returned (null while measuring): over the
// scratch, cuda_carve_scratch and cuda_carve_fits check it.
struct cuda_carve {
    char *base;
    size_t used;
    size_t cap; // what the measure found (over the scratch)
};
static inline void *cuda_carve(struct cuda_carve *cv, size_t bytes) {
    size_t at = ROUND_UP(cv->used, (size_t)256);
    cv->used = at + bytes;
    return cv->base ? cv->base + at : nullptr;
}

// After the measure: the scratch made that large, and cv carving it from its start.
static inline int cuda_carve_scratch(struct cuda_ctx *c, struct cuda_carve *cv) {
    RNND_TRY(rnnd__cuda_reserve(c, cv->used));
    *cv = (struct cuda_carve){(char *)c->d_scratch, 0, cv->used};
    return 0;
}
// After carving for real: RNND_EINVAL where it took more than the measure (a size that depended
// on a pointer), before anything is written past the scratch.
static inline int cuda_carve_fits(const struct cuda_carve *cv) {
    return cv->used <= cv->cap ? 0 : RNND_EINVAL;
}

// ---------------------------------------------------------------------------------------------
// Sequence layout shared by forward and backward (and both paths).
//
// Tape, per layer l, B*T rows in (b, t) order (row r = b*T + t):
//   z (ldz floats a row): [ hprev (H) | 1 | pad | x_l (I_l) | pad ]
//        hprev is the state entering the step (after the reset rule), x_l the layer's input.
//        The constant 1 makes one GEMM D^T z produce the weight and the bias gradients at once.
//        Where the plan says so (seq_plan.h, zfwd and cz) a layer holds z's dw16 chunk parts
//        and x exponents (at zc_off; above layer 0 after its x rows, I_l floats a row at x_off,
//        where the layer below writes its output), or layer 0 its dw256 chunk parts and aux
//        records, in that space instead (seq_chunks.h).
//   s (tape_rec::floats a row): GRU [a_r, a_z, a_n, hn], the gates' pre-activations and
//        hn = W_hn h + b_hn; LSTM [a_i, a_f, a_g, a_o | cprev], the gates' pre-activations and
//        the cell state entering the step (H fp32). The 4H pre-activation planes (and hn) are
//        fp16 where the backward runs in the persistent or cluster loops, else fp32 (the plan's
//        tape_half); for the cluster loops in blocks of 8 rows instead of rows (tape_b8 in
//        seq_tape.cuh). The layout holds fp32 rows.
// The top layer's output goes to `out`; layer l < L-1 writes its output straight into z of
// layer l+1 (the x_l part), which is what that layer reads as input.

struct seq_layer_layout {
    int Il;       // input width
    int xoff;     // offset of x_l in a z row
    int ldz;      // floats per z row
    int sw;       // floats per s row
    int ldx;      // floats per row of x_l (l > 0) at x_off: ldz, or I_l beside chunk parts
    size_t z_off; // float offsets into the tape
    size_t s_off;
    size_t x_off;  // x_l's rows (l > 0): z_off + xoff, or z_off beside chunk parts
    size_t zc_off; // the dw16 chunk parts (zfwd)
};

struct seq_layout {
    struct seq_layer_layout layer[RNND_MAX_LAYERS];
    size_t tape_floats;
};

// p: the plan of a call over B rows of model m, whose tape fields size the layers' z spaces and
// whose zfwd places x_l and the chunk parts in them.
void rnnd__cuda_seq_layout(const struct cuda_ctx *c, const struct seq_plan *p,
                           const struct rnnd_model *m, int B, int T, struct seq_layout *lay);

// Pointers into the flat parameter array (or its gradient) for layer l.
struct layer_params {
    const float *w_ih, *w_hh, *b_ih, *b_hh;
};
struct layer_params rnnd__cuda_layer_params(const struct rnnd_model *m, int l, const float *p);

// ---------------------------------------------------------------------------------------------
// Device helpers

// Activations. FAST (the tensor-core modes): the SFU's tanh, one instruction (tanh.approx.f32),
// and sigmoid(x) = (1 + tanh(x / 2)) / 2 built on it. An SM's 16 SFU lanes a clock bound the
// time loops' cells: this is 3 SFU operations a GRU element and 5 an LSTM one, where an ex2 and a
// reciprocal a gate were 5 and 7 with shared reciprocals (docs/kernels.md). PTX
// promises a relative error of 2^-11; an H100 measured 2^-16.6 at most over [-12, 12]
// (docs/kernels.md), far below TF32's rounding, and test_seq_cuda holds every FAST path to the CPU reference
// on the device it runs on. NaN stays NaN, +-inf gives +-1. Otherwise (ieee, the per-step path):
// expf and tanhf from libdevice with IEEE division.
template <bool FAST>
static __device__ __forceinline__ float act_tanh(float x) {
    if (!FAST)
        return tanhf(x);
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <bool FAST>
static __device__ __forceinline__ float act_sigmoid(float x) {
    return FAST ? fmaf(0.5f, act_tanh<true>(0.5f * x), 0.5f) : 1.0f / (1.0f + expf(-x));
}

static __device__ __forceinline__ uint32_t f32_to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ float round_bf16(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x = lo (low 16 bits), .y = hi
    return *reinterpret_cast<uint32_t *>(&v);
}

// Warp-wide sum (every lane gets it).
static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#endif // RNND_CUDA_COMMON_CUH
