/*
 * cuda_bench.cu: the --backend cuda case of rnnd-kernel-bench (bench.h's rnnd_bench_cuda).
 *
 * For one case (cell, compute, B, T, I, H, L, reset probability):
 *   1. our kernels through rnnd_bench_backend() with a CUDA-event timer on the backend's stream:
 *      validation against the CPU reference, warm-up, medians of forward (with tape) and
 *      forward+backward;
 *   2. our forward without a tape (inference: no gradient will follow) and forward+backward with
 *      the input gradient, timed here the same way;
 *   3. cuDNN in the same process on the same stream (cudnnRNNForward, cudnnRNNBackwardData_v8,
 *      cudnnRNNBackwardWeights_v8; fp32 storage, TF32 allowed as PyTorch allows it, FMA-only for
 *      ieee; no cuDNN row for bf16, which would need bf16 storage):
 *        "whole": B rows of T steps, resets ignored (the fastest cuDNN can be; wrong results
 *                 whenever a reset occurs);
 *        "split": every row cut at its resets into variable-length sequences, sorted by length,
 *                 packed (CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_PACKED, what pack_padded_sequence
 *                 gives cuDNN): correct results. Only the cuDNN calls are timed, not the
 *                 re-layout a user must also do, so this is cuDNN's best case with resets.
 *      Forward-only uses CUDNN_FWD_MODE_INFERENCE, forward+backward TRAINING + data + weights.
 * Results go to res (ours) and res->extra (the rest, as JSON members).
 */
#include "bench.h"
#include "cuda_backend.h"
#include "tuning.h"

#include <cuda_runtime.h>
#ifdef RNND_HAVE_CUDNN
#include <cudnn.h>
#endif

#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define BENCH_CUDA_TRY(expr)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "cuda_bench: %s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(e_),  \
                    __FILE__, __LINE__);                                                           \
            return RNND_EDEVICE;                                                                   \
        }                                                                                          \
    } while (0)

// ---------------------------------------------------------------------------------------------
// CUDA-event timer

struct event_timer {
    cudaStream_t stream;
    cudaEvent_t start, stop;
};

static void timer_start(void *ctx) {
    struct event_timer *t = (struct event_timer *)ctx;
    cudaEventRecord(t->start, t->stream);
}

static double timer_stop(void *ctx) {
    struct event_timer *t = (struct event_timer *)ctx;
    cudaEventRecord(t->stop, t->stream);
    cudaEventSynchronize(t->stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, t->start, t->stop);
    return ms;
}

static double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times fn() (which enqueues work on t's stream and returns 0) warmup + repeat times.
template <class F>
static int time_median(struct event_timer *t, int warmup, int repeat, F fn, double *ms) {
    std::vector<double> v;
    for (int i = -warmup; i < repeat; i++) {
        timer_start(t);
        int err = fn();
        double e = timer_stop(t);
        if (err)
            return err;
        if (i >= 0)
            v.push_back(e);
    }
    *ms = median_of(v);
    return 0;
}

static uint64_t rng_next(uint64_t *s) { // splitmix64
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rng_uniform(uint64_t *s) {
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}
static std::vector<float> uniform(size_t n, float scale, uint64_t *s) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++)
        v[i] = (float)((2.0 * rng_uniform(s) - 1.0) * scale);
    return v;
}

// A device copy of host data; freed by the owner with cudaFree.
template <class T>
static T *to_device(const std::vector<T> &h) {
    T *d = NULL;
    if (cudaMalloc(&d, h.size() * sizeof(T) + 16) != cudaSuccess)
        return NULL;
    cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
    return d;
}

// ---------------------------------------------------------------------------------------------
// Our forward without tape, and forward+backward with the input gradient

static int bench_ours_extra(struct rnnd_backend *be, const struct bench_case *bc,
                            struct event_timer *t, double *fwd_notape_ms, double *fwdbwd_gx_ms,
                            double *notape_phases) {
    double pb[8];
    const struct rnnd_model *m = &bc->model;
    const struct rnnd_backend_ops *ops = be->ops;
    size_t BT = (size_t)bc->B * bc->T, P = rnnd_model_param_count(m);
    uint64_t s = bc->seed ^ 0x5eedull;
    std::vector<float> params(P);
    rnnd_model_init_params(m, bc->seed, params.data());
    std::vector<float> x = uniform(BT * m->I, 1.0f, &s), gout = uniform(BT * m->H, 1.0f, &s);
    std::vector<uint8_t> init(BT);
    for (size_t i = 0; i < BT; i++)
        init[i] = rng_uniform(&s) < bc->reset_prob;
    float *d_params = to_device(params), *d_x = to_device(x), *d_gout = to_device(gout);
    uint8_t *d_init = to_device(init);
    float *d_out = NULL, *d_gp = NULL, *d_gx = NULL;
    void *d_tape = NULL;
    BENCH_CUDA_TRY(cudaMalloc(&d_out, BT * m->H * sizeof(float)));
    BENCH_CUDA_TRY(cudaMalloc(&d_gp, P * sizeof(float)));
    BENCH_CUDA_TRY(cudaMalloc(&d_gx, BT * m->I * sizeof(float)));
    BENCH_CUDA_TRY(cudaMalloc(&d_tape, ops->tape_bytes(be->ctx, m, bc->B, bc->T)));
    BENCH_CUDA_TRY(cudaMemset(d_gp, 0, P * sizeof(float)));
    struct rnnd_seq seq = {};
    seq.B = bc->B, seq.T = bc->T, seq.x = d_x, seq.is_init = d_init;
    int err = time_median(
        t, bc->warmup, bc->repeat,
        [&] { return ops->rnn_forward(be->ctx, d_out, NULL, NULL, NULL, &seq, d_params, m); },
        fwd_notape_ms);
    // Phase clocks (RNND_TUNE_PHASE_CLOCKS) of the forward without a tape, which may run another loop.
    if (!err && notape_phases && rnnd_cuda_phase_clocks(be, bc->B, bc->T, notape_phases, pb) != 0)
        notape_phases[0] = -1;
    if (!err)
        err = time_median(
            t, bc->warmup, bc->repeat,
            [&] {
                int e = ops->rnn_forward(be->ctx, d_out, NULL, NULL, d_tape, &seq, d_params, m);
                if (e)
                    return e;
                struct rnnd_seq_grads g = {};
                g.params = d_gp, g.x = d_gx;
                return ops->rnn_backward(be->ctx, &g, d_gout, NULL, NULL, d_tape, &seq, d_params,
                                         m);
            },
            fwdbwd_gx_ms);
    cudaFree(d_params), cudaFree(d_x), cudaFree(d_gout), cudaFree(d_init);
    cudaFree(d_out), cudaFree(d_gp), cudaFree(d_gx), cudaFree(d_tape);
    return err;
}

// ---------------------------------------------------------------------------------------------
// cuDNN

#ifdef RNND_HAVE_CUDNN
#define CUDNN_TRY(expr)                                                                            \
    do {                                                                                           \
        cudnnStatus_t s_ = (expr);                                                                 \
        if (s_ != CUDNN_STATUS_SUCCESS) {                                                          \
            fprintf(stderr, "cuda_bench: %s failed: %s (%s:%d)\n", #expr, cudnnGetErrorString(s_), \
                    __FILE__, __LINE__);                                                           \
            err = RNND_EDEVICE;                                                                    \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

// Times cuDNN over `nseq` sequences of lengths lens (sorted descending when packed) holding BT
// steps in all. fwd_ms: inference forward; all_ms: training forward + backward data + weights.
static int bench_cudnn_one(cudnnHandle_t h, const struct bench_case *bc, struct event_timer *t,
                           const std::vector<int> &lens, bool packed, double *fwd_ms,
                           double *all_ms) {
    const struct rnnd_model *m = &bc->model;
    int nseq = (int)lens.size(), maxlen = 0;
    size_t rows = 0;
    for (int v : lens) {
        maxlen = v > maxlen ? v : maxlen;
        rows += (size_t)v;
    }
    size_t xrows = packed ? rows : (size_t)nseq * maxlen;
    int err = 0;
    cudnnDropoutDescriptor_t drop = NULL;
    cudnnRNNDescriptor_t rnn = NULL;
    cudnnRNNDataDescriptor_t xd = NULL, yd = NULL;
    cudnnTensorDescriptor_t hd = NULL;
    void *states = NULL, *w = NULL, *dw = NULL, *work = NULL, *reserve = NULL;
    float *x = NULL, *y = NULL, *dy = NULL, *dx = NULL;
    int *dlens = NULL;
    size_t states_bytes = 0, wbytes = 0, work_bytes = 0, reserve_bytes = 0, iwork = 0, ires = 0;
    uint64_t s = bc->seed ^ 0xcd11ull;
    float pad = 0.0f;
    int dims[3] = {m->L, nseq, m->H}, strides[3] = {nseq * m->H, m->H, 1};
    cudnnRNNDataLayout_t layout = packed ? CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_PACKED
                                         : CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED;
    cudnnMathType_t math = m->compute == RNND_COMPUTE_IEEE ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH;

    CUDNN_TRY(cudnnCreateDropoutDescriptor(&drop));
    CUDNN_TRY(cudnnDropoutGetStatesSize(h, &states_bytes));
    if (cudaMalloc(&states, states_bytes) != cudaSuccess) {
        err = RNND_ENOMEM;
        goto done;
    }
    CUDNN_TRY(cudnnSetDropoutDescriptor(drop, h, 0.0f, states, states_bytes, 1));
    CUDNN_TRY(cudnnCreateRNNDescriptor(&rnn));
    CUDNN_TRY(cudnnSetRNNDescriptor_v8(
        rnn, CUDNN_RNN_ALGO_STANDARD, m->cell == RNND_CELL_LSTM ? CUDNN_LSTM : CUDNN_GRU,
        CUDNN_RNN_DOUBLE_BIAS, CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT, CUDNN_DATA_FLOAT,
        CUDNN_DATA_FLOAT, math, m->I, m->H, m->H, m->L, drop, CUDNN_RNN_PADDED_IO_ENABLED));
    CUDNN_TRY(cudnnCreateRNNDataDescriptor(&xd));
    CUDNN_TRY(cudnnCreateRNNDataDescriptor(&yd));
    CUDNN_TRY(cudnnSetRNNDataDescriptor(xd, CUDNN_DATA_FLOAT, layout, maxlen, nseq, m->I,
                                        lens.data(), &pad));
    CUDNN_TRY(cudnnSetRNNDataDescriptor(yd, CUDNN_DATA_FLOAT, layout, maxlen, nseq, m->H,
                                        lens.data(), &pad));
    CUDNN_TRY(cudnnCreateTensorDescriptor(&hd));
    CUDNN_TRY(cudnnSetTensorNdDescriptor(hd, CUDNN_DATA_FLOAT, 3, dims, strides));
    CUDNN_TRY(cudnnGetRNNWeightSpaceSize(h, rnn, &wbytes));
    CUDNN_TRY(cudnnGetRNNTempSpaceSizes(h, rnn, CUDNN_FWD_MODE_TRAINING, xd, &work_bytes,
                                        &reserve_bytes));
    CUDNN_TRY(cudnnGetRNNTempSpaceSizes(h, rnn, CUDNN_FWD_MODE_INFERENCE, xd, &iwork, &ires));
    work_bytes = std::max(work_bytes, iwork);
    {
        std::vector<float> wv = uniform(wbytes / sizeof(float), 1.0f / sqrtf((float)m->H), &s);
        w = to_device(wv);
        std::vector<float> xv = uniform(xrows * m->I, 1.0f, &s),
                           gv = uniform(xrows * m->H, 1.0f, &s);
        x = to_device(xv);
        dy = to_device(gv);
        dlens = to_device(lens);
    }
    if (!w || !x || !dy || !dlens || cudaMalloc(&dw, wbytes) != cudaSuccess ||
        cudaMalloc(&y, xrows * m->H * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&dx, xrows * m->I * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&work, work_bytes + 16) != cudaSuccess ||
        cudaMalloc(&reserve, reserve_bytes + 16) != cudaSuccess) {
        err = RNND_ENOMEM;
        goto done;
    }
    cudaMemset(dw, 0, wbytes);
    err = time_median(
        t, bc->warmup, bc->repeat,
        [&] {
            cudnnStatus_t st =
                cudnnRNNForward(h, rnn, CUDNN_FWD_MODE_INFERENCE, dlens, xd, x, yd, y, hd, NULL,
                                NULL, hd, NULL, NULL, wbytes, w, work_bytes, work, 0, NULL);
            return st == CUDNN_STATUS_SUCCESS ? 0 : RNND_EDEVICE;
        },
        fwd_ms);
    if (!err)
        err = time_median(
            t, bc->warmup, bc->repeat,
            [&] {
                cudnnStatus_t st = cudnnRNNForward(h, rnn, CUDNN_FWD_MODE_TRAINING, dlens, xd, x,
                                                   yd, y, hd, NULL, NULL, hd, NULL, NULL, wbytes, w,
                                                   work_bytes, work, reserve_bytes, reserve);
                if (st == CUDNN_STATUS_SUCCESS)
                    st = cudnnRNNBackwardData_v8(h, rnn, dlens, yd, y, dy, xd, dx, hd, NULL, NULL,
                                                 NULL, hd, NULL, NULL, NULL, wbytes, w, work_bytes,
                                                 work, reserve_bytes, reserve);
                if (st == CUDNN_STATUS_SUCCESS)
                    st = cudnnRNNBackwardWeights_v8(h, rnn, CUDNN_WGRAD_MODE_ADD, dlens, xd, x, hd,
                                                    NULL, yd, y, wbytes, dw, work_bytes, work,
                                                    reserve_bytes, reserve);
                return st == CUDNN_STATUS_SUCCESS ? 0 : RNND_EDEVICE;
            },
            all_ms);
    if (err)
        fprintf(stderr, "cuda_bench: a cuDNN RNN call failed\n");
done:
    cudaDeviceSynchronize();
    cudaFree(states), cudaFree(w), cudaFree(dw), cudaFree(work), cudaFree(reserve);
    cudaFree(x), cudaFree(y), cudaFree(dy), cudaFree(dx), cudaFree(dlens);
    if (hd)
        cudnnDestroyTensorDescriptor(hd);
    if (xd)
        cudnnDestroyRNNDataDescriptor(xd);
    if (yd)
        cudnnDestroyRNNDataDescriptor(yd);
    if (rnn)
        cudnnDestroyRNNDescriptor(rnn);
    if (drop)
        cudnnDestroyDropoutDescriptor(drop);
    return err;
}

static void bench_cudnn(const struct bench_case *bc, struct event_timer *t, char *extra,
                        size_t cap) {
    size_t at = strlen(extra);
    if (bc->model.compute == RNND_COMPUTE_BF16) {
        snprintf(extra + at, cap - at, ",\"cudnn\":\"skipped: bf16 storage only\"");
        return;
    }
    cudnnHandle_t h;
    if (cudnnCreate(&h) != CUDNN_STATUS_SUCCESS) {
        snprintf(extra + at, cap - at, ",\"cudnn\":\"unavailable\"");
        return;
    }
    cudnnSetStream(h, t->stream);
    snprintf(extra + at, cap - at, ",\"cudnn_version\":%zu", (size_t)cudnnGetVersion());
    at = strlen(extra);

    // Whole rows: B sequences of T steps.
    std::vector<int> whole((size_t)bc->B, bc->T);
    double f = -1, a = -1;
    if (bench_cudnn_one(h, bc, t, whole, false, &f, &a) == 0)
        snprintf(extra + at, cap - at, ",\"cudnn_fwd_ms\":%.4f,\"cudnn_fwdbwd_ms\":%.4f", f, a);
    at = strlen(extra);

    // Rows cut at resets (drawn with the case's probability), sorted by length, packed.
    if (bc->reset_prob > 0.0) {
        uint64_t s = bc->seed ^ 0x5171ull;
        std::vector<int> lens;
        for (int b = 0; b < bc->B; b++) {
            int start = 0;
            for (int tt = 1; tt < bc->T; tt++)
                if (rng_uniform(&s) < bc->reset_prob) {
                    lens.push_back(tt - start);
                    start = tt;
                }
            lens.push_back(bc->T - start);
        }
        std::sort(lens.begin(), lens.end(), [](int x, int y) { return x > y; });
        f = a = -1;
        if (bench_cudnn_one(h, bc, t, lens, true, &f, &a) == 0)
            snprintf(extra + at, cap - at,
                     ",\"cudnn_split_fwd_ms\":%.4f,\"cudnn_split_fwdbwd_ms\":%.4f,"
                     "\"cudnn_split_seqs\":%zu,\"cudnn_split_maxlen\":%d",
                     f, a, lens.size(), lens[0]);
    }
    cudnnDestroy(h);
}
#endif

// ---------------------------------------------------------------------------------------------

extern "C" int rnnd_bench_cuda(const struct bench_case *bc, struct bench_result *res) {
    struct rnnd_backend be;
    int err = rnnd_backend_cuda_init(&be, bc->device);
    if (err) {
        fprintf(stderr, "cuda_bench: no CUDA backend on device %d: %s\n", bc->device,
                rnnd_strerror(err));
        return err;
    }
    // RNND_CUDA_VARIANT (bench only): variant bits that force kernels the plan would not choose
    // (kernels/cuda/tuning.h).
    const char *variant = getenv("RNND_CUDA_VARIANT");
    if (variant && *variant && (err = rnnd_cuda_set_variant(&be, atoi(variant))) != 0) {
        fprintf(stderr, "cuda_bench: RNND_CUDA_VARIANT=%s: %s\n", variant, rnnd_strerror(err));
        rnnd_backend_free(&be);
        return err;
    }
    struct event_timer t;
    t.stream = (cudaStream_t)rnnd_cuda_stream(&be);
    cudaEventCreate(&t.start);
    cudaEventCreate(&t.stop);
    struct bench_timer timer = {&t, timer_start, timer_stop};

    err = rnnd_bench_backend(&be, bc, &timer, res);
    size_t cap = sizeof(res->extra), at = strlen(res->extra);
    int path = rnnd_cuda_path_of(&be, &bc->model);
    snprintf(res->extra + at, cap - at, ",\"path\":\"%s\",\"variant\":%d",
             path == RNND_CUDA_PATH_PERSISTENT ? "persistent" : "stepwise",
             variant && *variant ? atoi(variant) : 0);
    if (bc->model.cell == RNND_CELL_LSTM && bc->model.H == 256) { // clusters at once
        at = strlen(res->extra);
        snprintf(res->extra + at, cap - at,
                 ",\"clusters\":%d,\"clusters_bwd\":%d,\"clusters80\":%d,\"clusters80_bwd\":%d",
                 rnnd_cuda_cluster_active(&be, 64, false), rnnd_cuda_cluster_active(&be, 64, true),
                 rnnd_cuda_cluster_active(&be, 80, false), rnnd_cuda_cluster_active(&be, 80, true));
    }
    if (!err) {
        double f = -1, a = -1, pn[8] = {-1};
        bool clocks = variant && (atoi(variant) & RNND_TUNE_PHASE_CLOCKS);
        if (bench_ours_extra(&be, bc, &t, &f, &a, clocks ? pn : NULL) == 0) {
            at = strlen(res->extra);
            snprintf(res->extra + at, cap - at, ",\"fwd_notape_ms\":%.4f,\"fwdbwd_gradx_ms\":%.4f",
                     f, a);
            if (clocks && pn[0] >= 0) {
                at = strlen(res->extra);
                snprintf(res->extra + at, cap - at,
                         ",\"fwd_notape_phase_cycles\":[%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f]",
                         pn[0], pn[1], pn[2], pn[3], pn[4], pn[5], pn[6], pn[7]);
            }
        }
        double pf[8], pb[8];
        if (clocks && rnnd_cuda_phase_clocks(&be, bc->B, bc->T, pf, pb) == 0) {
            at = strlen(res->extra);
            snprintf(res->extra + at, cap - at,
                     ",\"fwd_phase_cycles\":[%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f],"
                     "\"bwd_phase_cycles\":[%.0f,%.0f,%.0f,%.0f,%.0f,%.0f]",
                     pf[0], pf[1], pf[2], pf[3], pf[4], pf[5], pf[6], pf[7], pb[0], pb[1], pb[2],
                     pb[3], pb[4], pb[5]);
        }
    }
#ifdef RNND_HAVE_CUDNN
    // On the backend's stream, which lives until rnnd_backend_free. RNND_BENCH_NO_CUDNN=1 skips
    // it (variant sweeps).
    const char *no_cudnn = getenv("RNND_BENCH_NO_CUDNN");
    if (!err && !(no_cudnn && atoi(no_cudnn)))
        bench_cudnn(bc, &t, res->extra, cap);
#endif
    rnnd_backend_free(&be);
    cudaEventDestroy(t.start);
    cudaEventDestroy(t.stop);
    return err;
}
