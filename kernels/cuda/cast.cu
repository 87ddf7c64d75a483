/*
 * cast.cu: dst = src converted, n elements, one of the two fp32 (cast.cuh). A grid-stride loop,
 * one element a thread an iteration; conversions are cuda_bf16.h / cuda_fp16.h's round to
 * nearest even (__float2bfloat16_rn, __float2half_rn), bit-identical to kernels/common.c's.
 */
#include "cast.cuh"

#include <cuda_fp16.h>

#define CAST_THREADS 256

template <enum rnnd_ftype D, enum rnnd_ftype S>
static __global__ void cast_kernel(void *dst, const void *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        if (S == RNND_FTYPE_F32 && D == RNND_FTYPE_BF16)
            ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(((const float *)src)[i]);
        else if (S == RNND_FTYPE_F32 && D == RNND_FTYPE_F16)
            ((__half *)dst)[i] = __float2half_rn(((const float *)src)[i]);
        else if (S == RNND_FTYPE_BF16)
            ((float *)dst)[i] = __bfloat162float(((const __nv_bfloat16 *)src)[i]);
        else if (S == RNND_FTYPE_F16)
            ((float *)dst)[i] = __half2float(((const __half *)src)[i]);
        else
            ((float *)dst)[i] = ((const float *)src)[i];
    }
}

// ---------------------------------------------------------------------------------------------
// kernel launchers

int rnnd__cuda_cast(struct cuda_ctx *c, void *dst, enum rnnd_ftype dst_dtype, const void *src,
                    enum rnnd_ftype src_dtype, size_t n) {
    if (c == NULL)
        return RNND_EINVAL;
    if (n == 0)
        return 0;
    if (dst == NULL || src == NULL || (dst_dtype != RNND_FTYPE_F32 && src_dtype != RNND_FTYPE_F32))
        return RNND_EINVAL;
    c->step_tail = false; // not a step: the next step waits before it reads (common.cuh)
    size_t want = CEIL_DIV(n, (size_t)CAST_THREADS);
    int grid = (int)(want < (size_t)c->dev.num_sms * 16 ? want : (size_t)c->dev.num_sms * 16);
    if (src_dtype == RNND_FTYPE_F32 && dst_dtype == RNND_FTYPE_BF16)
        cast_kernel<RNND_FTYPE_BF16, RNND_FTYPE_F32>
            <<<grid, CAST_THREADS, 0, c->stream>>>(dst, src, n);
    else if (src_dtype == RNND_FTYPE_F32 && dst_dtype == RNND_FTYPE_F16)
        cast_kernel<RNND_FTYPE_F16, RNND_FTYPE_F32>
            <<<grid, CAST_THREADS, 0, c->stream>>>(dst, src, n);
    else if (src_dtype == RNND_FTYPE_BF16)
        cast_kernel<RNND_FTYPE_F32, RNND_FTYPE_BF16>
            <<<grid, CAST_THREADS, 0, c->stream>>>(dst, src, n);
    else if (src_dtype == RNND_FTYPE_F16)
        cast_kernel<RNND_FTYPE_F32, RNND_FTYPE_F16>
            <<<grid, CAST_THREADS, 0, c->stream>>>(dst, src, n);
    else
        cast_kernel<RNND_FTYPE_F32, RNND_FTYPE_F32>
            <<<grid, CAST_THREADS, 0, c->stream>>>(dst, src, n);
    CUDA_LAUNCH_CHECK();
    return 0;
}
