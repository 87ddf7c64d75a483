/*
 * bench.h: the seam between rnnd-kernel-bench's driver (bench.c) and backend-specific timing.
 *
 * bench.c parses the command line, expands it into cases and, for each case, calls
 * rnnd_bench_backend() with the backend named by --backend: random non-zero inputs, one
 * validation pass against the CPU reference (for backends other than cpu), warm-up, then timed
 * repeats of forward and forward+backward through the rnnd_backend_ops vtable.
 * For --backend cuda, bench.c calls rnnd_bench_cuda() instead, which kernels/bench/cuda_*.cu
 * provides when RNND_HAVE_CUDA is defined: it is expected to open the CUDA backend, pass a
 * CUDA-event timer to rnnd_bench_backend(), then time cuDNN at the same shape and append its
 * figures to res->extra.
 */
#ifndef RNND_BENCH_H
#define RNND_BENCH_H

#include "rnnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

struct bench_case {
    const char *backend;     // "cpu" or "cuda"
    int device;              // CUDA device index
    struct rnnd_model model; // cell, compute, I, H, L
    int B, T;
    double reset_prob; // probability of is_init at each (b, t)
    int warmup, repeat;
    uint64_t seed;
    bool grad_input; // also compute the input gradient dL/dx
    bool step;       // --op step: the single-step op (rnn_step) instead of the sequence ops
};

struct bench_result {
    char device[128]; // the backend's device name
    char plan[256];   // the kernels the case runs (rnnd_backend_ops.plan_name)
    double fwd_ms;    // median over repeats: forward with tape
    double fwdbwd_ms; // median: forward with tape, then backward
    double fwd_min_ms, fwdbwd_min_ms;
    double out_err, grad_err; // ||a - ref|| / ||ref|| against the CPU backend; -1 when not checked
    char extra[1024];         // more JSON members, each written as ,"name":value (appended as is)
    // --op step: microseconds per step of back-to-back launches, of CUDA-graph replays, of
    // steps inside one graph (the device's time), and of a whole backend call (copy in, step,
    // copy out); out_err, grad_err are then the output's and the state table's errors.
    double step_us, graph_us, gpu_us, call_us;
    double sm_mhz; // the SM clock measured right after the timed loops
};

// A timer around one timed call: start() before it, stop() after it returns the elapsed
// milliseconds, having waited for the work to finish (CUDA: event record + synchronize). NULL
// members of rnnd_bench_backend's timer mean a host clock around the call plus ops->sync.
struct bench_timer {
    void *ctx;
    void (*start)(void *ctx);
    double (*stop)(void *ctx);
};

// Runs bc on the opened backend be (validation for non-cpu backends, warm-up, timing) and fills
// res (res->device from be, res->extra left as it was). timer may be NULL. Returns 0 or a
// negative RNND_E* from the backend.
int rnnd_bench_backend(struct rnnd_backend *be, const struct bench_case *bc,
                       const struct bench_timer *timer, struct bench_result *res);

#ifdef RNND_HAVE_CUDA
// kernels/bench/cuda_*.cu: the whole --backend cuda case (see the top of this file).
int rnnd_bench_cuda(const struct bench_case *bc, struct bench_result *res);
// kernels/bench/cuda_step_bench.cu: a --op step case on the CUDA backend.
int rnnd_bench_cuda_step(const struct bench_case *bc, struct bench_result *res);
#endif

#ifdef __cplusplus
}
#endif

#endif // RNND_BENCH_H
