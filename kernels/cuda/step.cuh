/*
 * step.cuh: the single-step op of the CUDA backend (step.cu): one kernel per layer that gathers
 * each row's state from its table row, runs the layer's matmuls and cell and writes the new
 * state to the row's new table row. It only launches kernels on the context's stream (the
 * kernels' attributes are set once, by rnnd__cuda_step_prepare), so it can be captured in a CUDA
 * graph.
 */
#ifndef RNND_CUDA_STEP_CUH
#define RNND_CUDA_STEP_CUH

#include "common.cuh"

// Raises the kernels' shared-memory limits; once per context, before any rnn_step.
int rnnd__cuda_step_prepare(struct cuda_ctx *c);
int rnnd__cuda_rnn_step(struct cuda_ctx *c, const struct rnnd_step *step, const float *params,
                        const struct rnnd_model *m);

// The derived copy of the weights (struct rnnd_step.derived) for step16.cu's path: its bytes for
// m (0 where m's steps never take it), and made from params on the context's stream.
size_t rnnd__cuda_step16_bytes(const struct rnnd_model *m);
int rnnd__cuda_step16_derive(struct cuda_ctx *c, void *derived, const float *params,
                             const struct rnnd_model *m);

#endif // RNND_CUDA_STEP_CUH
