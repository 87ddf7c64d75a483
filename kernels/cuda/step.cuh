/*
 * step.cuh: the single-step op of the CUDA backend (step.cu): one kernel per layer that gathers
 * each row's state from the slot table, runs the layer's matmuls and cell and scatters the new
 * state back. It only launches kernels on the context's stream (its buffers are made once, by
 * rnnd__cuda_step_prepare), so it can be captured in a CUDA graph.
 */
#ifndef RNND_CUDA_STEP_CUH
#define RNND_CUDA_STEP_CUH

#include "common.cuh"

// The number of row tiles a launch may have (their barriers' counters, allocated once per
// context); larger batches run in chunks of rows.
#define RNND_STEP_TILES 4096

// Raises the kernels' shared-memory limits and allocates the row tiles' barriers
// (ctx->d_step_count); once per context, before any rnn_step.
int rnnd__cuda_step_prepare(struct cuda_ctx *c);
int rnnd__cuda_rnn_step(struct cuda_ctx *c, const struct rnnd_step *step, const float *params,
                        const struct rnnd_model *m);

#endif // RNND_CUDA_STEP_CUH
