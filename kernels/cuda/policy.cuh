/*
 * policy.cuh: the policy around the recurrent core on the device (policy.cu; contract in
 * rnnd_kernels.h, struct rnnd_backend_ops' policy ops): the observation encoder, the heads and
 * the actions drawn from them, over N independent rows, on the context's stream.
 */
#ifndef RNND_CUDA_POLICY_CUH
#define RNND_CUDA_POLICY_CUH

#include "common.cuh"

int rnnd__cuda_encoder_forward(struct cuda_ctx *c, float *acts, const float *obs, int N,
                               const float *params, const struct rnnd_model *m);
int rnnd__cuda_encoder_backward(struct cuda_ctx *c, float *grad_params, float *grad_obs,
                                const float *grad_out, const float *acts, const float *obs, int N,
                                const float *params, const struct rnnd_model *m);
int rnnd__cuda_heads_forward(struct cuda_ctx *c, const struct rnnd_heads *out, const float *h,
                             int N, const float *params, const struct rnnd_model *m);
int rnnd__cuda_heads_backward(struct cuda_ctx *c, float *grad_params, float *grad_h,
                              const struct rnnd_heads *g, const float *h, int N,
                              const float *params, const struct rnnd_model *m);
int rnnd__cuda_policy_sample(struct cuda_ctx *c, const struct rnnd_actions *a, const float *params,
                             const struct rnnd_model *m);
// policy_logp synchronises: an index out of 0 .. K-1 is RNND_EINVAL, as on the CPU.
int rnnd__cuda_policy_logp(struct cuda_ctx *c, const struct rnnd_actions *a, const float *params,
                           const struct rnnd_model *m);

#endif // RNND_CUDA_POLICY_CUH
