/*
 * step_gemm16.cu (probe, issue 45's B = 1024 steps; journal step-02): the one GEMM a Step of many
 * rows would take through the per-step path's numerics, gates [B, N] = [x | h] [B, K] times the
 * weights [N, K]^T, on fp16 operands with fp32 accumulation and output, against the same on TF32.
 * N and K per row of the issue: LSTM I = H = 512 (N = 4H = 2048, K = I + H = 1024), GRU I = H =
 * 512 (r and z over [x | h], n's x and h parts as column blocks with zeros: the same 2048 x 1024),
 * LSTM I = 512 H = 1024 (N = 4096, K = 1536). The tile kernel's whole step takes 19.9-20.5,
 * 17.3-17.8 and 67.5-67.9 us at B = 1024 (PyTorch in a graph: 61.5, 47.5, 101.7).
 *
 *   kernels/bench/probes/run.sh step_gemm16
 */
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <stdio.h>

#include "probe.cuh"

#define SEQ 20 // GEMMs back to back a timed sequence

// Values in [-0.5, 0.5): zeros would let the tensor cores idle at lower power than real weights.
__global__ void fill(float *f32, __half *f16, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float v = (float)((i * 2654435761u) & 0xffff) / 65536.0f - 0.5f;
        f32[i] = v;
        f16[i] = __float2half(v);
    }
}

int main() {
    struct {
        const char *row;
        int N, K;
    } rows[] = {{"lstm_i512_h512", 2048, 1024},
                {"gru_i512_h512", 2048, 1024},
                {"lstm_i512_h1024", 4096, 1536}};
    const int Bs[] = {256, 512, 1024};
    cublasHandle_t h;
    CB(cublasCreate(&h));
    const size_t most = (size_t)4096 * 1536 + (size_t)1024 * 1536 + (size_t)1024 * 4096;
    float *f32;
    __half *f16;
    CK(cudaMalloc(&f32, most * sizeof(float)));
    CK(cudaMalloc(&f16, most * sizeof(__half)));
    fill<<<1024, 256>>>(f32, f16, most);
    CK(cudaGetLastError());
    const float one = 1.0f, zero = 0.0f;
    for (const auto &r : rows) {
        for (int B : Bs) {
            const size_t nw = (size_t)r.N * r.K, nx = (size_t)B * r.K;
            float *c = f32 + nw + nx; // gates [B, N] in fp32 either way
            // column-major: gates^T (N x B) = W (row-major N x K, read transposed) x^T (K x B)
            auto half = [&] {
                for (int i = 0; i < SEQ; i++)
                    CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, r.N, B, r.K, &one, f16, CUDA_R_16F,
                                    r.K, f16 + nw, CUDA_R_16F, r.K, &zero, c, CUDA_R_32F, r.N,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            };
            auto tf32 = [&] {
                for (int i = 0; i < SEQ; i++)
                    CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, r.N, B, r.K, &one, f32, CUDA_R_32F,
                                    r.K, f32 + nw, CUDA_R_32F, r.K, &zero, c, CUDA_R_32F, r.N,
                                    CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
            };
            const double us16 = 1e3 * median_ms(half) / SEQ, us32 = 1e3 * median_ms(tf32) / SEQ;
            const double gflop = 2.0 * B * r.N * r.K * 1e-9;
            printf("{\"probe\":\"step_gemm16\",\"row\":\"%s\",\"B\":%d,\"N\":%d,\"K\":%d,"
                   "\"fp16_us\":%.2f,\"tf32_us\":%.2f,\"fp16_tflops\":%.0f,\"tf32_tflops\":%.0f}\n",
                   r.row, B, r.N, r.K, us16, us32, gflop / us16 * 1e3, gflop / us32 * 1e3);
        }
    }
    CK(cudaFree(f32));
    CK(cudaFree(f16));
    CB(cublasDestroy(h));
    return 0;
}
