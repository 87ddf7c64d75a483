/*
 * optim.cuh: the optimizer update on the device (optim.cu): clip_grad_norm_ with a deterministic
 * norm, then torch.optim.Adam or SGD over the flat parameter array (contract in rnnd_kernels.h).
 */
#ifndef RNND_CUDA_OPTIM_CUH
#define RNND_CUDA_OPTIM_CUH

#include "common.cuh"

// Fixed grid of the norm reduction, so the sum's order (and bits) never change.
#define RNND_OPTIM_BLOCKS 256

int rnnd__cuda_optim_step(struct cuda_ctx *c, float *params, float *grads, float *m, float *v,
                          size_t n, const struct rnnd_optim *o, int64_t t, float *grad_norm);

#endif // RNND_CUDA_OPTIM_CUH
