/*
 * gemm_h256.cu (probe, issue 8 v34): the LSTM H = 256 weight-gradient product [dW | db] = z^T D
 * and dL/dx = D W_ih in TF32 on cuBLAS, as seq.cu runs them today (B = 2048, T = 256, I = 64:
 * M = 4H = 1024 columns of D, N = ldz = 324 columns of z, K = B T = 524288 rows) against the
 * same products on D and z stored transposed (K contiguous: TF32 MMAs take K-major operands
 * only), and against cublasLt's other algorithms on today's layout. Today's layout gives cuBLAS
 * an M-major D and an N-major z; its 1.57 ms (journal v33) is 1.8 TB/s on the 2.8 GB read.
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o gemm_h256 gemm_h256.cu \
 *       -lcublas -lcublasLt
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#include "probe.cuh"

constexpr int B = 2048, T = 256, H = 256, I = 64, M = 4 * H, LDZ = 324;
constexpr long K = (long)B * T;

// Deterministic values in [-1, 1): element e of a matrix seeded s.
__global__ void fill(float *p, long n, uint32_t s) {
    for (long e = blockIdx.x * (long)blockDim.x + threadIdx.x; e < n;
         e += (long)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)e * 2654435761u ^ s * 40503u;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[e] = (float)(h & 0xffffff) / 8388608.0f - 1.0f;
    }
}
// out (cols x rows) = in (rows x cols)^T, row-major both.
__global__ void transpose(const float *in, float *out, long rows, int cols) {
    __shared__ float t[32][33];
    long r0 = (long)blockIdx.x * 32;
    int c0 = blockIdx.y * 32;
    for (int k = threadIdx.y; k < 32; k += 8)
        if (r0 + k < rows && c0 + threadIdx.x < cols)
            t[k][threadIdx.x] = in[(r0 + k) * cols + c0 + threadIdx.x];
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += 8)
        if (c0 + k < cols && r0 + threadIdx.x < rows)
            out[(long)(c0 + k) * rows + r0 + threadIdx.x] = t[threadIdx.x][k];
}


static double max_rel(const float *a, const float *b, long n) {
    std::vector<float> x(n), y(n);
    CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost));
    double m = 0, s = 0;
    for (long i = 0; i < n; i++)
        m = std::max(m, (double)fabsf(x[i] - y[i])), s = std::max(s, (double)fabsf(y[i]));
    return m / s;
}

int main() {
    float *d, *dt, *z, *zt, *w, *c0, *c1, *x0, *x1;
    CK(cudaMalloc(&d, K * M * 4));
    CK(cudaMalloc(&dt, K * M * 4));
    CK(cudaMalloc(&z, K * LDZ * 4));
    CK(cudaMalloc(&zt, K * LDZ * 4));
    CK(cudaMalloc(&w, (long)M * I * 4));
    CK(cudaMalloc(&c0, (long)M * LDZ * 4));
    CK(cudaMalloc(&c1, (long)M * LDZ * 4));
    CK(cudaMalloc(&x0, K * I * 4));
    CK(cudaMalloc(&x1, K * I * 4));
    fill<<<1024, 256>>>(d, K * M, 1);
    fill<<<1024, 256>>>(z, K * LDZ, 2);
    fill<<<1024, 256>>>(w, (long)M * I, 3);
    // Transposed copies, K in time-major order (k' = t B + b) as a loop writing a step at a time
    // would lay them out: row k = b T + t of D goes to column t B + b of D^T.
    {
        float *tmp;
        CK(cudaMalloc(&tmp, K * M * 4));
        auto tm = [&](const float *src, float *dst, int cols) {
            // tmp = src with rows reordered to time-major, then transposed into dst.
            for (int t = 0; t < T; t++)
                CK(cudaMemcpy2D(tmp + (long)t * B * cols, cols * 4, src + (long)t * cols,
                                (size_t)T * cols * 4, cols * 4, B, cudaMemcpyDeviceToDevice));
            transpose<<<dim3((unsigned)(K / 32), (cols + 31) / 32), dim3(32, 8)>>>(tmp, dst, K,
                                                                                   cols);
        };
        tm(d, dt, M);
        tm(z, zt, LDZ);
        CK(cudaDeviceSynchronize());
        CK(cudaFree(tmp));
    }
    cublasHandle_t h;
    CB(cublasCreate(&h));
    const float one = 1.0f, zero = 0.0f;
    const cublasComputeType_t ct = CUBLAS_COMPUTE_32F_FAST_TF32;
    const double gb = (double)K * (M + LDZ) * 4 / 1e9;

    // Today: C (M x LDZ) = D (M x K, lda M) z^T (op T, ldb LDZ).
    auto nt = [&] {
        CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, M, LDZ, (int)K, &one, d, CUDA_R_32F, M, z,
                        CUDA_R_32F, LDZ, &zero, c0, CUDA_R_32F, M, ct, CUBLAS_GEMM_DEFAULT));
    };
    // Transposed: D^T (M rows of K) as op T with lda K, z^T (LDZ rows of K) op N with ldb K.
    auto tn = [&] {
        CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, M, LDZ, (int)K, &one, dt, CUDA_R_32F, (int)K,
                        zt, CUDA_R_32F, (int)K, &zero, c1, CUDA_R_32F, M, ct, CUBLAS_GEMM_DEFAULT));
    };
    float ms = median_ms(nt);
    printf("{\"probe\":\"gemm_h256\",\"what\":\"dw nt (today)\",\"ms\":%.4f,\"GBps\":%.0f}\n", ms,
           gb / ms * 1e3);
    ms = median_ms(tn);
    printf("{\"probe\":\"gemm_h256\",\"what\":\"dw tn (transposed, time-major K)\",\"ms\":%.4f,"
           "\"GBps\":%.0f,\"rel_diff\":%.3g}\n",
           ms, gb / ms * 1e3, max_rel(c1, c0, (long)M * LDZ));

    // cublasLt's algorithms on today's layout.
    {
        cublasLtHandle_t lt;
        CB(cublasLtCreate(&lt));
        cublasLtMatmulDesc_t op;
        CB(cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F));
        cublasOperation_t tA = CUBLAS_OP_N, tB = CUBLAS_OP_T;
        CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA)));
        CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB)));
        cublasLtMatrixLayout_t la, lb, lc;
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, M, K, M));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, LDZ, K, LDZ));
        CB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, M, LDZ, M));
        size_t wsz = 256u << 20;
        void *ws;
        CK(cudaMalloc(&ws, wsz));
        cublasLtMatmulPreference_t pref;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &wsz, sizeof(wsz)));
        cublasLtMatmulHeuristicResult_t res[16];
        int n = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 16, res, &n));
        for (int i = 0; i < n; i++) {
            ms = median_ms([&] {
                CB(cublasLtMatmul(lt, op, &one, d, la, z, lb, &zero, c1, lc, c1, lc, &res[i].algo,
                                  ws, res[i].workspaceSize, 0));
            });
            printf("{\"probe\":\"gemm_h256\",\"what\":\"dw nt cublasLt algo %d\",\"ms\":%.4f,"
                   "\"GBps\":%.0f,\"ws\":%zu,\"rel_diff\":%.3g}\n",
                   i, ms, gb / ms * 1e3, res[i].workspaceSize, max_rel(c1, c0, (long)M * LDZ));
        }
    }

    // dL/dx today: C (I x K) = W_ih (I x M, lda I) D (M x K, ldb M).
    ms = median_ms([&] {
        CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, I, (int)K, M, &one, w, CUDA_R_32F, I, d,
                        CUDA_R_32F, M, &zero, x0, CUDA_R_32F, I, ct, CUBLAS_GEMM_DEFAULT));
    });
    printf("{\"probe\":\"gemm_h256\",\"what\":\"dx (today)\",\"ms\":%.4f}\n", ms);
    // From D^T: step t's B rows (columns [t B, t B + B) of D^T) into dx rows b T + t: T
    // products, C_t (I x B, ldc T I, offset t I) = W_ih (I x M) D_t (op T of D^T's block).
    ms = median_ms([&] {
        CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, I, B, M, &one, w, CUDA_R_32F, I,
                                      0, dt, CUDA_R_32F, (int)K, B, &zero, x1, CUDA_R_32F, T * I, I,
                                      T, ct, CUBLAS_GEMM_DEFAULT));
    });
    printf("{\"probe\":\"gemm_h256\",\"what\":\"dx from D^T (strided batched over t)\","
           "\"ms\":%.4f,\"rel_diff\":%.3g}\n",
           ms, max_rel(x1, x0, K * I));

    // The read floor: the same bytes summed by a plain kernel is not measured here; DRAM's
    // 3.35 TB/s puts the 2.81 GB at 0.84 ms.
    return 0;
}
