/*
 * backend.cu: the CUDA backend's vtable (struct rnnd_backend_ops), its context (a stream, a cuBLAS
 * handle with its own workspace, a scratch arena grown on demand) and rnnd_backend_cuda_init.
 * The ops live in seq.cu (sequence forward/backward, on the kernels seq_plan.cu chooses), step.cu
 * (single step with slot gather/scatter; step16.cu its fp16 GEMM path and the weights' derived
 * copy), traj.cu (the trajectory store's row moves), cast.cu (wire dtypes), optim.cu (Adam/SGD
 * with clipping) and policy.cu (the encoder, heads and actions around the core).
 * Every op is asynchronous on the context's stream; copy_in, copy_out and sync synchronise.
 */
#include "common.cuh"
#include "cuda_backend.h"
#include "optim.cuh"
#include "policy.cuh"
#include "seq.cuh"
#include "seq_loops.h"
#include "seq_plan.h"
#include "step.cuh"
#include "cast.cuh"
#include "traj.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RNND_CUBLAS_WORKSPACE (32u << 20)

// ---------------------------------------------------------------------------------------------
// Scratch

int rnnd__cuda_reserve(struct cuda_ctx *c, size_t bytes) {
    if (bytes <= c->scratch_bytes)
        return 0;
    // Grow by at least half again; earlier work on the stream may still use the old buffer.
    size_t want = bytes > c->scratch_bytes / 2 * 3 ? bytes : c->scratch_bytes / 2 * 3;
    RNND_CUDA_TRY(cudaStreamSynchronize(c->stream));
    if (c->d_scratch) {
        RNND_CUDA_TRY(cudaFree(c->d_scratch));
        c->d_scratch = NULL;
        c->scratch_bytes = 0;
    }
    RNND_CUDA_TRY(cudaMalloc(&c->d_scratch, want));
    c->scratch_bytes = want;
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Vtable entries

static void cuda_destroy(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (c == NULL)
        return;
    cudaSetDevice(c->device);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    for (auto &g : c->seq_graphs)
        if (g.exec)
            cudaGraphExecDestroy(g.exec);
    if (c->blas)
        cublasDestroy(c->blas);
    cudaFree(c->d_blas_ws);
    cudaFree(c->d_scratch);
    cudaFree(c->d_partials);
    cudaFree(c->d_norm);
    cudaFree(c->d_dbg);
    cudaFree(c->d_first);
    cudaFree(c->d_step_bar);
    if (c->ipc_ev)
        cudaEventDestroy(c->ipc_ev);
    if (c->mark_ev)
        cudaEventDestroy(c->mark_ev);
    if (c->h_norm)
        cudaFreeHost(c->h_norm);
    if (c->h_first)
        cudaFreeHost(c->h_first);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    pthread_mutex_destroy(&c->record_lock);
    pthread_mutex_destroy(&c->pinned_lock);
    free(c->pinned);
    free(c);
}

static int cuda_alloc(void *ctx, size_t bytes, void **out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (out == NULL)
        return RNND_EINVAL;
    *out = NULL;
    RNND_CUDA_TRY(cudaSetDevice(c->device));
    RNND_CUDA_TRY(cudaMalloc(out, bytes ? bytes : 256));
    return 0;
}

static void cuda_free(void *ctx, void *ptr) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (ptr == NULL)
        return;
    // The stream may still use ptr: finish it first (cudaFree alone does not wait for it).
    cudaStreamSynchronize(c->stream);
    cudaFree(ptr);
}

// Device memory has no pages to map lazily: the store is allocated whole.
static int cuda_alloc_lazy(void *ctx, size_t bytes, void **out) {
    return cuda_alloc(ctx, bytes, out);
}

static void cuda_free_lazy(void *ctx, void *ptr, size_t bytes) {
    (void)bytes;
    cuda_free(ctx, ptr);
}

// Notes page-locked [host, host + bytes) with its device address, for small copies (without it,
// or without room to note it, they DMA).
static void pinned_note(struct cuda_ctx *c, void *host, size_t bytes) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, host) != cudaSuccess || a.devicePointer == NULL) {
        cudaGetLastError();
        return;
    }
    pthread_mutex_lock(&c->pinned_lock);
    if (c->npinned == c->pinned_cap) {
        int cap = c->pinned_cap ? 2 * c->pinned_cap : 16;
        void *p = realloc(c->pinned, (size_t)cap * sizeof(*c->pinned));
        if (p) {
            c->pinned = (struct cuda_ctx::pinned_range *)p;
            c->pinned_cap = cap;
        }
    }
    if (c->npinned < c->pinned_cap)
        c->pinned[c->npinned++] = {(char *)host, (char *)a.devicePointer, bytes};
    pthread_mutex_unlock(&c->pinned_lock);
}

// Forgets host's range, then waits for the stream (a copy on it may still read or write there)
// before unpin(host). Any thread, but not while the engine records.
static void pinned_release(struct cuda_ctx *c, void *host, cudaError_t (*unpin)(void *)) {
    pthread_mutex_lock(&c->pinned_lock);
    for (int i = 0; i < c->npinned; i++)
        if (c->pinned[i].host == host) {
            c->pinned[i] = c->pinned[--c->npinned];
            break;
        }
    pthread_mutex_unlock(&c->pinned_lock);
    pthread_mutex_lock(&c->record_lock);
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->stream);
    unpin(host);
    pthread_mutex_unlock(&c->record_lock);
}

static int cuda_host_alloc(void *ctx, size_t bytes, void **out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (out == NULL)
        return RNND_EINVAL;
    *out = NULL;
    RNND_CUDA_TRY(cudaSetDevice(c->device));
    // Page-locked: copies need no bounce through a driver buffer and run asynchronously; portable:
    // so for every device's context (a socket region of a daemon on several devices is device
    // 0's).
    if (cudaHostAlloc(out, bytes ? bytes : 256, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return RNND_ENOMEM;
    }
    pinned_note(c, *out, bytes);
    return 0;
}

static void cuda_host_free(void *ctx, void *ptr) {
    if (ptr != NULL)
        pinned_release((struct cuda_ctx *)ctx, ptr, cudaFreeHost);
}

// A memfd region's pages, page-locked for every device's context (as host_alloc's), so that a
// 33.5 MB reply is one DMA instead of the driver's copies through a pageable bounce buffer.
static int cuda_host_register(void *ctx, void *ptr, size_t bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (ptr == NULL || bytes == 0)
        return RNND_EINVAL;
    RNND_CUDA_TRY(cudaSetDevice(c->device));
    if (cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) !=
        cudaSuccess) {
        cudaGetLastError();
        return RNND_ENOMEM;
    }
    pinned_note(c, ptr, bytes);
    return 0;
}

static void cuda_host_unregister(void *ctx, void *ptr) {
    if (ptr != NULL)
        pinned_release((struct cuda_ctx *)ctx, ptr, cudaHostUnregister);
}

// A copy of at most this many bytes between page-locked host memory and the device runs as a
// kernel that reads or writes the host memory over the bus: a copy engine's DMA adds its start to
// the chain each way, and a 1-row Step's backend work is mostly that chain (docs/benchmarks.md).
#define SMALL_COPY_BYTES 16384

static __global__ void small_copy_kernel(char *dst, const char *src, size_t bytes) {
    size_t i = threadIdx.x;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
        size_t n16 = bytes / 16;
        for (; i < n16; i += blockDim.x)
            ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
        i = n16 * 16 + threadIdx.x;
    }
    for (; i < bytes; i += blockDim.x)
        dst[i] = src[i];
}

// The device's address of [p, p + bytes) in host_alloc's memory, or NULL where it is not there
// (a kernel may not read pageable memory) or the copy is not small. host_alloc notes each
// allocation, so that a copy makes no driver call to ask.
static void *small_copy_host(struct cuda_ctx *c, const void *p, size_t bytes) {
    if (bytes > SMALL_COPY_BYTES)
        return NULL;
    const char *q = (const char *)p;
    void *dev = NULL;
    pthread_mutex_lock(&c->pinned_lock);
    for (int i = 0; i < c->npinned && dev == NULL; i++) {
        const struct cuda_ctx::pinned_range *r = &c->pinned[i];
        if (q >= r->host && bytes <= r->bytes && (size_t)(q - r->host) <= r->bytes - bytes)
            dev = r->dev + (q - r->host);
    }
    pthread_mutex_unlock(&c->pinned_lock);
    return dev;
}

static int small_copy(struct cuda_ctx *c, void *dst, const void *src, size_t bytes) {
    small_copy_kernel<<<1, 256, 0, c->stream>>>((char *)dst, (const char *)src, bytes);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// No synchronisation: from pageable memory cudaMemcpyAsync returns only once the source has
// been staged, and page-locked sources (host_alloc) stay untouched until the next sync by the
// contract in rnnd_kernels.h. A step then costs one synchronisation, in copy_out.
static int cuda_copy_in(void *ctx, void *dst, const void *host_src, size_t bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    c->step_tail = false;
    if (bytes == 0)
        return 0;
    if (dst == NULL || host_src == NULL)
        return RNND_EINVAL;
    const void *dev_src = small_copy_host(c, host_src, bytes);
    if (dev_src)
        return small_copy(c, dst, dev_src, bytes);
    RNND_CUDA_TRY(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, c->stream));
    return 0;
}

static int cuda_copy_out_async(void *ctx, void *host_dst, const void *src, size_t bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    c->step_tail = false;
    if (bytes == 0)
        return 0;
    if (host_dst == NULL || src == NULL)
        return RNND_EINVAL;
    void *dev_dst = small_copy_host(c, host_dst, bytes);
    if (dev_dst)
        return small_copy(c, dev_dst, src, bytes);
    RNND_CUDA_TRY(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    return 0;
}

static int cuda_copy_out(void *ctx, void *host_dst, const void *src, size_t bytes) {
    int rc = cuda_copy_out_async(ctx, host_dst, src, bytes);
    if (rc == 0 && bytes > 0)
        RNND_CUDA_TRY(cudaStreamSynchronize(((struct cuda_ctx *)ctx)->stream));
    return rc;
}

static int cuda_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    c->step_tail = false;
    if (bytes == 0)
        return 0;
    if (dst == NULL || src == NULL)
        return RNND_EINVAL;
    RNND_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
    return 0;
}

static int cuda_zero(void *ctx, void *dst, size_t bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    c->step_tail = false;
    if (bytes == 0)
        return 0;
    if (dst == NULL)
        return RNND_EINVAL;
    RNND_CUDA_TRY(cudaMemsetAsync(dst, 0, bytes, c->stream));
    return 0;
}

static int cuda_sync(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    RNND_CUDA_TRY(cudaStreamSynchronize(c->stream));
    return 0;
}

static int cuda_mark(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    cudaStreamCaptureStatus cs;
    RNND_CUDA_TRY(cudaStreamIsCapturing(c->stream, &cs));
    // In a recording, a node of its own (External: the flag is refused outside one), which
    // each replay records.
    RNND_CUDA_TRY(cs == cudaStreamCaptureStatusActive
                      ? cudaEventRecordWithFlags(c->mark_ev, c->stream, cudaEventRecordExternal)
                      : cudaEventRecord(c->mark_ev, c->stream));
    return 0;
}

static int cuda_sync_mark(void *ctx) {
    RNND_CUDA_TRY(cudaEventSynchronize(((struct cuda_ctx *)ctx)->mark_ev));
    return 0;
}

// Recordings are CUDA graphs captured from the stream (thread-local mode: other threads' CUDA
// calls go on as usual meanwhile): the daemon's step recordings and seq.cu's per-step loops.
int rnnd__cuda_record_begin(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    pthread_mutex_lock(&c->record_lock);
    if (cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        cudaGetLastError();
        pthread_mutex_unlock(&c->record_lock);
        return RNND_EDEVICE;
    }
    c->step_tail = false; // the recording's first step may not assume what ran before it
    return 0;
}

int rnnd__cuda_record_end(void *ctx, void **unit) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    *unit = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    pthread_mutex_unlock(&c->record_lock);
    if (e == cudaSuccess)
        e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph)
        cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return RNND_EDEVICE;
    }
    *unit = exec;
    return 0;
}

static int cuda_replay(void *ctx, void *unit) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    c->step_tail = false; // what the unit ends with is not known here
    RNND_CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)unit, c->stream));
    return 0;
}

static void cuda_free_unit(void *ctx, void *unit) {
    (void)ctx;
    if (unit)
        cudaGraphExecDestroy((cudaGraphExec_t)unit);
}

// The smallest index of a NaN or infinity, by atomicMin into *first (ULLONG_MAX: none).
static __global__ void nonfinite_kernel(const float *x, size_t n, unsigned long long *first) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        if (!isfinite(x[i])) {
            atomicMin(first, (unsigned long long)i);
            return; // later indices of this thread are larger
        }
    }
}

static int cuda_nonfinite(void *ctx, const float *x, size_t n, int64_t *first) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    c->step_tail = false;
    if (x == NULL && n > 0)
        return RNND_EINVAL;
    *first = -1;
    if (n == 0)
        return 0;
    RNND_CUDA_TRY(cudaMemsetAsync(c->d_first, 0xff, sizeof(*c->d_first), c->stream));
    unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    nonfinite_kernel<<<blocks, 256, 0, c->stream>>>(x, n, c->d_first);
    CUDA_LAUNCH_CHECK();
    RNND_CUDA_TRY(cudaMemcpyAsync(c->h_first, c->d_first, sizeof(*c->h_first),
                                  cudaMemcpyDeviceToHost, c->stream));
    RNND_CUDA_TRY(cudaStreamSynchronize(c->stream));
    if (*c->h_first != ~0ull)
        *first = (int64_t)*c->h_first;
    return 0;
}

// The driver's cuMemGetAddressRange (the allocation holding a pointer), taken from the runtime
// so that rnnd does not link libcuda: a build with CUDA still starts on a host without a driver.
typedef int (*addr_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);

static int alloc_range(void *p, unsigned long long *base, size_t *size) {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || fn == NULL)
        return RNND_EDEVICE;
    return ((addr_range_fn)fn)(base, size, (unsigned long long)(uintptr_t)p) == 0 ? 0 : RNND_EINVAL;
}

// Touches only c->device: it runs on the server's threads, beside the engine's use of c.
static int cuda_ipc_open(void *ctx, const void *handle, size_t handle_len, uint64_t offset,
                         uint64_t size, void *head, size_t head_len, void **base) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    cudaIpcMemHandle_t h;
    if (handle == NULL || handle_len != sizeof(h) || base == NULL || head_len > size)
        return RNND_EINVAL;
    memcpy(&h, handle, sizeof(h));
    RNND_CUDA_TRY(cudaSetDevice(c->device));
    void *p = NULL;
    if (cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        cudaGetLastError(); // not sticky: clear it
        return RNND_EDEVICE;
    }
    // The allocation must hold the whole range.
    unsigned long long ab = 0;
    size_t as = 0;
    int rc = alloc_range(p, &ab, &as);
    if (rc == 0 && (offset > as || size > as - offset))
        rc = RNND_EINVAL;
    if (rc == 0 && head_len &&
        cudaMemcpy(head, (char *)p + offset, head_len, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = RNND_EDEVICE;
    if (rc) {
        cudaIpcCloseMemHandle(p);
        return rc;
    }
    *base = (char *)p + offset;
    return 0;
}

static void cuda_ipc_close(void *ctx, void *base) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    unsigned long long ab = 0;
    size_t as = 0;
    if (base == NULL || cudaSetDevice(c->device) != cudaSuccess || alloc_range(base, &ab, &as))
        return;
    if (c->ipc_ev) // work answered early may still write the memory
        cudaEventSynchronize(c->ipc_ev);
    cudaIpcCloseMemHandle((void *)(uintptr_t)ab);
}

static int cuda_ipc_event(void *ctx, void *handle, size_t handle_len) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (handle == NULL || handle_len != sizeof(c->ipc_handle))
        return RNND_EINVAL;
    if (c->ipc_ev == NULL)
        return RNND_ENOTSUP;
    memcpy(handle, &c->ipc_handle, sizeof(c->ipc_handle));
    return 0;
}

static int cuda_ipc_record(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (c->ipc_ev == NULL)
        return RNND_ENOTSUP;
    RNND_CUDA_TRY(cudaEventRecord(c->ipc_ev, c->stream));
    return 0;
}

// Every valid model runs: the plan (seq_plan.h) has the per-step path for every core no other
// kernel runs; the single-step kernel takes any width; the policy's kernels (policy.cu) any
// encoder and heads.
static int cuda_supports(void *ctx, const struct rnnd_model *m) {
    (void)ctx;
    return rnnd_model_check(m);
}

static size_t cuda_tape_bytes(void *ctx, const struct rnnd_model *m, int B, int T) {
    return rnnd__cuda_tape_bytes((const struct cuda_ctx *)ctx, m, B, T);
}

static int cuda_plan_name(void *ctx, const struct rnnd_model *m, int B, char *buf, size_t len) {
    const struct cuda_ctx *c = (const struct cuda_ctx *)ctx;
    if (rnnd_model_check(m) != 0 || B < 1 || buf == NULL || len == 0)
        return RNND_EINVAL;
    rnnd__seq_plan_name(&c->dev, &c->tune, m, B, buf, len);
    return 0;
}

static int cuda_rnn_forward(void *ctx, float *out, float *h_n, float *c_n, void *tape,
                            const struct rnnd_seq *seq, const float *params,
                            const struct rnnd_model *m) {
    ((struct cuda_ctx *)ctx)->step_tail = false;
    return rnnd__cuda_rnn_forward((struct cuda_ctx *)ctx, out, h_n, c_n, tape, seq, params, m);
}

static int cuda_rnn_backward(void *ctx, const struct rnnd_seq_grads *grads, const float *grad_out,
                             const float *grad_h_n, const float *grad_c_n, const void *tape,
                             const struct rnnd_seq *seq, const float *params,
                             const struct rnnd_model *m) {
    ((struct cuda_ctx *)ctx)->step_tail = false;
    return rnnd__cuda_rnn_backward((struct cuda_ctx *)ctx, grads, grad_out, grad_h_n, grad_c_n,
                                   tape, seq, params, m);
}

static int cuda_rnn_step(void *ctx, const struct rnnd_step *step, const float *params,
                         const struct rnnd_model *m) {
    return rnnd__cuda_rnn_step((struct cuda_ctx *)ctx, step, params, m);
}

static size_t cuda_derived_bytes(void *ctx, const struct rnnd_model *m) {
    (void)ctx;
    return rnnd_model_check(m) == 0 ? rnnd__cuda_step16_bytes(m) : 0;
}

static int cuda_derive(void *ctx, void *derived, const float *params, const struct rnnd_model *m) {
    ((struct cuda_ctx *)ctx)->step_tail = false;
    return rnnd__cuda_step16_derive((struct cuda_ctx *)ctx, derived, params, m);
}

static int cuda_traj_write(void *ctx, const struct rnnd_traj_store *st,
                           const struct rnnd_traj_rows *r, const struct rnnd_model *m) {
    return rnnd__cuda_traj_write((struct cuda_ctx *)ctx, st, r, m);
}

static int cuda_traj_read(void *ctx, const struct rnnd_traj_rows *r,
                          const struct rnnd_traj_store *st, const struct rnnd_model *m) {
    return rnnd__cuda_traj_read((struct cuda_ctx *)ctx, r, st, m);
}

static int cuda_cast(void *ctx, void *dst, enum rnnd_ftype dst_dtype, const void *src,
                     enum rnnd_ftype src_dtype, size_t n) {
    return rnnd__cuda_cast((struct cuda_ctx *)ctx, dst, dst_dtype, src, src_dtype, n);
}

static int cuda_optim_step(void *ctx, float *params, float *grads, float *m, float *v, size_t n,
                           const struct rnnd_optim *o, int64_t t, float *grad_norm) {
    ((struct cuda_ctx *)ctx)->step_tail = false;
    return rnnd__cuda_optim_step((struct cuda_ctx *)ctx, params, grads, m, v, n, o, t, grad_norm);
}

static int cuda_encoder_forward(void *ctx, float *acts, const float *obs, int N,
                                const float *params, const struct rnnd_model *m) {
    return rnnd__cuda_encoder_forward((struct cuda_ctx *)ctx, acts, obs, N, params, m);
}

static int cuda_encoder_backward(void *ctx, float *grad_params, float *grad_obs,
                                 const float *grad_out, const float *acts, const float *obs, int N,
                                 const float *params, const struct rnnd_model *m) {
    return rnnd__cuda_encoder_backward((struct cuda_ctx *)ctx, grad_params, grad_obs, grad_out,
                                       acts, obs, N, params, m);
}

static int cuda_heads_forward(void *ctx, const struct rnnd_heads *out, const float *h, int N,
                              const float *params, const struct rnnd_model *m) {
    return rnnd__cuda_heads_forward((struct cuda_ctx *)ctx, out, h, N, params, m);
}

static int cuda_heads_backward(void *ctx, float *grad_params, float *grad_h,
                               const struct rnnd_heads *grad, const float *h, int N,
                               const float *params, const struct rnnd_model *m) {
    return rnnd__cuda_heads_backward((struct cuda_ctx *)ctx, grad_params, grad_h, grad, h, N,
                                     params, m);
}

static int cuda_policy_sample(void *ctx, const struct rnnd_actions *a, const float *params,
                              const struct rnnd_model *m) {
    return rnnd__cuda_policy_sample((struct cuda_ctx *)ctx, a, params, m);
}

static int cuda_policy_logp(void *ctx, const struct rnnd_actions *a, const float *params,
                            const struct rnnd_model *m) {
    return rnnd__cuda_policy_logp((struct cuda_ctx *)ctx, a, params, m);
}

static int cuda_bind(void *ctx) {
    RNND_CUDA_TRY(cudaSetDevice(((struct cuda_ctx *)ctx)->device));
    return 0;
}

static const struct rnnd_backend_ops cuda_ops = {
    /* .name = */ "cuda",
    /* .caps = */ 0,
    /* .destroy = */ cuda_destroy,
    /* .alloc = */ cuda_alloc,
    /* .free = */ cuda_free,
    /* .alloc_lazy = */ cuda_alloc_lazy,
    /* .free_lazy = */ cuda_free_lazy,
    /* .host_alloc = */ cuda_host_alloc,
    /* .host_free = */ cuda_host_free,
    /* .host_register = */ cuda_host_register,
    /* .host_unregister = */ cuda_host_unregister,
    /* .copy_in = */ cuda_copy_in,
    /* .copy_out = */ cuda_copy_out,
    /* .copy_out_async = */ cuda_copy_out_async,
    /* .copy = */ cuda_copy,
    /* .zero = */ cuda_zero,
    /* .sync = */ cuda_sync,
    /* .mark = */ cuda_mark,
    /* .sync_mark = */ cuda_sync_mark,
    /* .nonfinite = */ cuda_nonfinite,
    /* .ipc_open = */ cuda_ipc_open,
    /* .ipc_close = */ cuda_ipc_close,
    /* .ipc_event = */ cuda_ipc_event,
    /* .ipc_record = */ cuda_ipc_record,
    /* .supports = */ cuda_supports,
    /* .tape_bytes = */ cuda_tape_bytes,
    /* .rnn_forward = */ cuda_rnn_forward,
    /* .rnn_backward = */ cuda_rnn_backward,
    /* .rnn_step = */ cuda_rnn_step,
    /* .derived_bytes = */ cuda_derived_bytes,
    /* .derive = */ cuda_derive,
    /* .traj_write = */ cuda_traj_write,
    /* .traj_read = */ cuda_traj_read,
    /* .cast = */ cuda_cast,
    /* .optim_step = */ cuda_optim_step,
    /* .plan_name = */ cuda_plan_name,
    /* .encoder_forward = */ cuda_encoder_forward,
    /* .encoder_backward = */ cuda_encoder_backward,
    /* .heads_forward = */ cuda_heads_forward,
    /* .heads_backward = */ cuda_heads_backward,
    /* .policy_sample = */ cuda_policy_sample,
    /* .policy_logp = */ cuda_policy_logp,
    /* .record_begin = */ rnnd__cuda_record_begin,
    /* .record_end = */ rnnd__cuda_record_end,
    /* .replay = */ cuda_replay,
    /* .free_unit = */ cuda_free_unit,
    /* .bind = */ cuda_bind,
};

// ---------------------------------------------------------------------------------------------
// Init

static int ctx_init(struct cuda_ctx *c, int device, char *name, size_t name_len) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count)
        return RNND_EDEVICE;
    c->device = device;
    RNND_CUDA_TRY(cudaSetDevice(device));
    cudaDeviceProp prop;
    RNND_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    c->dev.num_sms = prop.multiProcessorCount;
    c->dev.cc_major = prop.major;
    c->dev.smem_optin = prop.sharedMemPerBlockOptin;
#ifdef RNND_HAVE_WG
    c->dev.wg = prop.major == 9;
#endif
    // The cluster loops' capacity, for the plans (seq_plan.h): run on sm_90 and later only.
    for (int r = 0; prop.major >= 9 && r < 2; r++)
        for (int bwd = 0; bwd < 2; bwd++)
            c->dev.cluster_active[r][bwd] = rnnd__cluster_active(r ? 80 : 64, bwd);
    snprintf(name, name_len, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount);
    RNND_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    RNND_CUBLAS_TRY(cublasCreate(&c->blas));
    RNND_CUBLAS_TRY(cublasSetStream(c->blas, c->stream));
    RNND_CUDA_TRY(cudaMalloc(&c->d_blas_ws, RNND_CUBLAS_WORKSPACE));
    RNND_CUBLAS_TRY(cublasSetWorkspace(c->blas, c->d_blas_ws, RNND_CUBLAS_WORKSPACE));
    RNND_CUDA_TRY(cudaMalloc(&c->d_partials, RNND_OPTIM_BLOCKS * sizeof(double)));
    RNND_CUDA_TRY(cudaMalloc(&c->d_norm, 2 * sizeof(float)));
    RNND_CUDA_TRY(cudaMallocHost(&c->h_norm, 2 * sizeof(float)));
    RNND_CUDA_TRY(cudaMalloc(&c->d_first, sizeof(*c->d_first)));
    RNND_CUDA_TRY(cudaMallocHost(&c->h_first, sizeof(*c->h_first)));
    RNND_CUDA_TRY(cudaMalloc(&c->d_step_bar, 2 * sizeof(unsigned)));
    RNND_CUDA_TRY(cudaMemset(c->d_step_bar, 0, 2 * sizeof(unsigned)));
    RNND_CUDA_TRY(cudaEventCreateWithFlags(&c->mark_ev, cudaEventDisableTiming));
    // Where the driver cannot share an event, CUDA regions get no early replies.
    if (cudaEventCreateWithFlags(&c->ipc_ev, cudaEventInterprocess | cudaEventDisableTiming) !=
            cudaSuccess ||
        cudaIpcGetEventHandle(&c->ipc_handle, c->ipc_ev) != cudaSuccess) {
        cudaGetLastError(); // not sticky: clear it
        if (c->ipc_ev)
            cudaEventDestroy(c->ipc_ev);
        c->ipc_ev = NULL;
    }
    RNND_TRY(rnnd__cuda_step_prepare(c));
    return 0;
}

extern "C" int rnnd_backend_cuda_init(struct rnnd_backend *b, int device) {
    if (b == NULL)
        return RNND_EINVAL;
    memset(b, 0, sizeof(*b));
    struct cuda_ctx *c = (struct cuda_ctx *)calloc(1, sizeof(*c));
    if (c == NULL)
        return RNND_ENOMEM;
    pthread_mutex_init(&c->record_lock, NULL);
    pthread_mutex_init(&c->pinned_lock, NULL);
    int err = ctx_init(c, device, b->device, sizeof(b->device));
    if (err) {
        cuda_destroy(c);
        memset(b, 0, sizeof(*b));
        return err == RNND_ENOMEM ? err : RNND_EDEVICE;
    }
    b->ops = &cuda_ops;
    b->ctx = c;
    return 0;
}

extern "C" int rnnd_cuda_set_path(struct rnnd_backend *b, int path) {
    if (b == NULL || b->ops != &cuda_ops || path < RNND_CUDA_PATH_AUTO ||
        path > RNND_CUDA_PATH_STEPWISE)
        return RNND_EINVAL;
    ((struct cuda_ctx *)b->ctx)->tune.stepwise = path == RNND_CUDA_PATH_STEPWISE;
    return 0;
}

extern "C" int rnnd_cuda_set_variant(struct rnnd_backend *b, int variant) {
    if (b == NULL || b->ops != &cuda_ops || variant < 0)
        return RNND_EINVAL;
    struct cuda_ctx *c = (struct cuda_ctx *)b->ctx;
#ifdef RNND_CUDA_PHASE_CLOCKS
    if ((variant & RNND_TUNE_PHASE_CLOCKS) && c->d_dbg == NULL) {
        RNND_CUDA_TRY(cudaMalloc(&c->d_dbg, 2 * 1024 * 8 * sizeof(long long)));
        RNND_CUDA_TRY(cudaMemset(c->d_dbg, 0, 2 * 1024 * 8 * sizeof(long long)));
    }
#else
    if (variant & RNND_TUNE_PHASE_CLOCKS)
        return RNND_ENOTSUP; // a build without RNND_CUDA_PHASE_CLOCKS counts no clocks
#endif
    const bool stepwise = c->tune.stepwise;
    c->tune = rnnd__cuda_tuning_of(variant);
    c->tune.stepwise = stepwise;
    return 0;
}

extern "C" int rnnd_cuda_phase_clocks(struct rnnd_backend *b, int B, int T, double fwd[8],
                                      double bwd[8]) {
    if (b == NULL || b->ops != &cuda_ops || B < 1 || T < 1)
        return RNND_EINVAL;
    struct cuda_ctx *c = (struct cuda_ctx *)b->ctx;
    if (c->d_dbg == NULL)
        return RNND_ENOTFOUND;
    static long long h[2 * 1024 * 8];
    RNND_CUDA_TRY(cudaStreamSynchronize(c->stream));
    RNND_CUDA_TRY(cudaMemcpy(h, c->d_dbg, sizeof(h), cudaMemcpyDeviceToHost));
    int blocks = CEIL_DIV(B, 16) < 1024 ? CEIL_DIV(B, 16) : 1024;
    for (int k = 0; k < 8; k++) {
        double sf = 0.0, sb = 0.0;
        for (int blk = 0; blk < blocks; blk++) {
            sf += (double)h[blk * 8 + k];
            sb += (double)h[1024 * 8 + blk * 8 + k];
        }
        fwd[k] = sf / blocks / T;
        bwd[k] = sb / blocks / T;
    }
    return 0;
}

extern "C" int rnnd_cuda_path_of(const struct rnnd_backend *b, const struct rnnd_model *m) {
    if (b == NULL || b->ops != &cuda_ops || rnnd_model_check(m) != 0)
        return RNND_EINVAL;
    return rnnd__cuda_seq_persistent((const struct cuda_ctx *)b->ctx, m) ? RNND_CUDA_PATH_PERSISTENT
                                                                         : RNND_CUDA_PATH_STEPWISE;
}

extern "C" int rnnd_cuda_cluster_active(const struct rnnd_backend *b, int rows, bool backward) {
    if (b == NULL || b->ops != &cuda_ops || (rows != 64 && rows != 80))
        return RNND_EINVAL;
    return ((const struct cuda_ctx *)b->ctx)->dev.cluster_active[rows == 80][backward];
}

extern "C" void *rnnd_cuda_stream(const struct rnnd_backend *b) {
    if (b == NULL || b->ops != &cuda_ops)
        return NULL;
    return ((struct cuda_ctx *)b->ctx)->stream;
}
