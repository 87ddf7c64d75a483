/*
 * seq.cuh: the sequence forward and backward of the CUDA backend (seq.cu): the layer driver that
 * executes the plan (seq_plan.h), the cuBLAS GEMMs around the time loops (input projection,
 * weight and input gradients), and the per-step path (one cuBLAS GEMM plus one fused cell kernel
 * per step) for models no time loop runs (compute ieee, H > 128 but the LSTM's H = 256 loops).
 * Contracts as in rnnd_kernels.h.
 */
#ifndef RNND_CUDA_SEQ_CUH
#define RNND_CUDA_SEQ_CUH

#include "common.cuh"

size_t rnnd__cuda_tape_bytes(const struct cuda_ctx *c, const struct rnnd_model *m, int B, int T);
int rnnd__cuda_rnn_forward(struct cuda_ctx *c, float *out, float *h_n, float *c_n, void *tape,
                           const struct rnnd_seq *seq, const float *params,
                           const struct rnnd_model *m);
int rnnd__cuda_rnn_backward(struct cuda_ctx *c, const struct rnnd_seq_grads *grads,
                            const float *grad_out, const float *grad_h_n, const float *grad_c_n,
                            const void *tape, const struct rnnd_seq *seq, const float *params,
                            const struct rnnd_model *m);

// Whether rnn_forward/rnn_backward of m take the persistent kernels on this context.
bool rnnd__cuda_seq_persistent(const struct cuda_ctx *c, const struct rnnd_model *m);

#endif // RNND_CUDA_SEQ_CUH
