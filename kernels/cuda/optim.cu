/*
 * optim.cu: one optimizer update over the flat parameter array, matching kernels/cpu/optim.c
 * (PyTorch's clip_grad_norm_ then Adam without amsgrad, or SGD without momentum):
 *   norm = ||g||_2: per-thread sums of squares in double over a fixed grid-stride pattern, a
 *          fixed-order block reduction to RNND_OPTIM_BLOCKS partials, then one block adds those
 *          in a fixed order: the same bits on every run (no atomics);
 *   coef = max_norm / (norm + 1e-6), applied (g *= coef, written back) only where coef < 1;
 *   SGD:  p -= lr (g + wd p);
 *   Adam: d = g + wd p; m = b1 m + (1 - b1) d; v = b2 v + (1 - b2) d^2;
 *         p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)  (scalars in double on the host).
 * Three launches; the norm is copied back to the host (the op synchronises the stream).
 */
#include "optim.cuh"

#include <math.h>

#define OPTIM_THREADS 256

static __device__ double block_sum_d(double v, double *shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_d(v);
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)(blockDim.x >> 5); w++)
            s += shared[w];
    return s; // valid in thread 0
}

static __global__ void sumsq_kernel(const float *g, size_t n, double *partials) {
    __shared__ double shared[OPTIM_THREADS / 32];
    double s = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        s += (double)g[i] * g[i];
    s = block_sum_d(s, shared);
    if (threadIdx.x == 0)
        partials[blockIdx.x] = s;
}

// out[0] = norm, out[1] = the factor to scale gradients by (1 when not clipping).
static __global__ void norm_kernel(const double *partials, float max_norm, bool clip, float *out) {
    __shared__ double shared[OPTIM_THREADS / 32];
    double s = threadIdx.x < RNND_OPTIM_BLOCKS ? partials[threadIdx.x] : 0.0;
    s = block_sum_d(s, shared);
    if (threadIdx.x == 0) {
        float norm = (float)sqrt(s);
        float coef = clip ? max_norm / (norm + 1e-6f) : 1.0f;
        out[0] = norm;
        out[1] = coef < 1.0f ? coef : 1.0f;
    }
}

static __global__ void sgd_kernel(float *p, float *g, size_t n, const float *coef, float neg_lr,
                                  float wd) {
    float k = coef[1];
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i];
        if (k < 1.0f) {
            gi *= k;
            g[i] = gi;
        }
        float d = wd != 0.0f ? gi + wd * p[i] : gi;
        p[i] += neg_lr * d;
    }
}

static __global__ void adam_kernel(float *p, float *g, float *m, float *v, size_t n,
                                   const float *coef, float wd, float b1, float b2, float a1,
                                   float a2, float eps, float neg_step, float bc2_sqrt) {
    float k = coef[1];
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i];
        if (k < 1.0f) {
            gi *= k;
            g[i] = gi;
        }
        float d = wd != 0.0f ? gi + wd * p[i] : gi;
        float mi = m[i] * b1 + d * a1;
        float vi = v[i] * b2 + a2 * d * d;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] += neg_step * (mi / denom);
    }
}

int rnnd__cuda_optim_step(struct cuda_ctx *c, float *params, float *grads, float *m, float *v,
                          size_t n, const struct rnnd_optim *o, int64_t t, float *grad_norm) {
    if (c == NULL || params == NULL || grads == NULL || n == 0 || t < 1 || rnnd_optim_check(o) != 0)
        return RNND_EINVAL;
    if (o->kind == RNND_OPTIM_ADAM && (m == NULL || v == NULL))
        return RNND_EINVAL;
    bool clip = o->max_grad_norm > 0.0f && isfinite(o->max_grad_norm);

    sumsq_kernel<<<RNND_OPTIM_BLOCKS, OPTIM_THREADS, 0, c->stream>>>(grads, n, c->d_partials);
    CUDA_LAUNCH_CHECK();
    norm_kernel<<<1, OPTIM_THREADS, 0, c->stream>>>(c->d_partials, o->max_grad_norm, clip,
                                                    c->d_norm);
    CUDA_LAUNCH_CHECK();

    size_t want = CEIL_DIV(n, (size_t)OPTIM_THREADS);
    int grid = (int)(want < (size_t)c->dev.num_sms * 8 ? want : (size_t)c->dev.num_sms * 8);
    if (o->kind == RNND_OPTIM_SGD) {
        sgd_kernel<<<grid, OPTIM_THREADS, 0, c->stream>>>(params, grads, n, c->d_norm, -o->lr,
                                                          o->weight_decay);
    } else {
        double beta1 = o->beta1, beta2 = o->beta2;
        double bc1 = 1.0 - pow(beta1, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
        float neg_step = (float)(-(double)o->lr / bc1);
        float bc2_sqrt = (float)sqrt(bc2);
        adam_kernel<<<grid, OPTIM_THREADS, 0, c->stream>>>(
            params, grads, m, v, n, c->d_norm, o->weight_decay, o->beta1, o->beta2,
            (float)(1.0 - beta1), (float)(1.0 - beta2), o->eps, neg_step, bc2_sqrt);
    }
    CUDA_LAUNCH_CHECK();
    if (grad_norm == NULL)
        return 0;
    RNND_CUDA_TRY(
        cudaMemcpyAsync(c->h_norm, c->d_norm, sizeof(float), cudaMemcpyDeviceToHost, c->stream));
    RNND_CUDA_TRY(cudaStreamSynchronize(c->stream));
    *grad_norm = c->h_norm[0];
    return 0;
}
