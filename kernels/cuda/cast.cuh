/*
 * cast.cuh: fp32 <-> bf16 / fp16 on the device (cast.cu), for tensors that travel in a 16-bit
 * wire dtype (contract in rnnd_kernels.h, enum rnnd_ftype). One launch on the context's stream.
 */
#ifndef RNND_CUDA_CAST_CUH
#define RNND_CUDA_CAST_CUH

#include "common.cuh"

int rnnd__cuda_cast(struct cuda_ctx *c, void *dst, enum rnnd_ftype dst_dtype, const void *src,
                    enum rnnd_ftype src_dtype, size_t n);

#endif // RNND_CUDA_CAST_CUH
