/*
 * step.cuh: the single-step op of the CUDA backend (step.cu): one fused kernel that gathers each
 * row's state from the slot table, runs every layer's cell and scatters the new state back. It
 * launches exactly one kernel and allocates nothing, so it can be captured in a CUDA graph.
 */
#ifndef RNND_CUDA_STEP_CUH
#define RNND_CUDA_STEP_CUH

#include "common.cuh"

// Rows per block the step kernel can run model m with (0: the model is too wide for it).
int rnnd__cuda_step_rows(const struct rnnd_model *m, size_t smem_optin);
// Raises the kernels' shared-memory limit; once per context, before any rnn_step.
int rnnd__cuda_step_prepare(struct cuda_ctx *c);
int rnnd__cuda_rnn_step(struct cuda_ctx *c, const struct rnnd_step *step, const float *params,
                        const struct rnnd_model *m);

#endif // RNND_CUDA_STEP_CUH
