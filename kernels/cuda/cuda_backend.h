/*
 * cuda_backend.h: extras of the CUDA backend for its own tests and the kernel benchmark (C
 * callable, no CUDA headers). The server needs none of this: it uses rnnd_kernels.h only.
 */
#ifndef RNND_CUDA_BACKEND_H
#define RNND_CUDA_BACKEND_H

#include "rnnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

// Sequence paths.
#define RNND_CUDA_PATH_AUTO       0 // the plan's kernels (seq_plan.h; default)
#define RNND_CUDA_PATH_PERSISTENT 1
#define RNND_CUDA_PATH_STEPWISE   2 // one cuBLAS GEMM plus one cell kernel per step

// Forces the path of later rnn_forward/rnn_backward calls on b (a CUDA backend): AUTO or
// STEPWISE (PERSISTENT behaves as AUTO: it cannot run models that do not fit). RNND_EINVAL for
// another backend. Both paths write and read the same tape layout.
int rnnd_cuda_set_path(struct rnnd_backend *b, int path);
// Overrides the plans of later calls on b with variant bits (tuning.h, RNND_TUNE_*) for the
// bench and the tests; 0 is the production plan. A bit that names a kernel a model has no use
// for changes nothing. RNND_ENOTSUP for RNND_TUNE_PHASE_CLOCKS in a build without
// RNND_CUDA_PHASE_CLOCKS, RNND_EINVAL for another backend or negative bits.
int rnnd_cuda_set_variant(struct rnnd_backend *b, int variant);
// RNND_TUNE_PHASE_CLOCKS: average clock cycles per step of each phase of the last persistent
// forward and backward over B rows and T steps (warp 0 of every block; docs/kernels.md lists the
// phases). RNND_ENOTFOUND where no clocks were counted.
int rnnd_cuda_phase_clocks(struct rnnd_backend *b, int B, int T, double fwd[8], double bwd[8]);
// RNND_CUDA_PATH_PERSISTENT or _STEPWISE: what rnn_forward of m runs on b now.
int rnnd_cuda_path_of(const struct rnnd_backend *b, const struct rnnd_model *m);
// LSTM H = 256 cluster loops of `rows` (64 or 80) rows b's device runs at once, forward or
// backward (0 where it cannot launch them), as the plans see it.
int rnnd_cuda_cluster_active(const struct rnnd_backend *b, int rows, bool backward);
// The backend's cudaStream_t (as void *), for timing with events on the same stream and for
// capturing ops in a CUDA graph. A kernel of the caller's own on it between two steps must not
// write the second one's weights or inputs: a step that follows a step reads them before its
// programmatic wait (step_kargs.pre, early_x). Inputs that the caller writes go through copy_in
// (or any backend op), after which the next step waits first.
void *rnnd_cuda_stream(const struct rnnd_backend *b);

#ifdef __cplusplus
}
#endif

#endif // RNND_CUDA_BACKEND_H
