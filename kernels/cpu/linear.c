/*
 * linear.c: the one matmul of the CPU backend, C = op(A) op(B) + beta C, row-major, on CBLAS
 * sgemm (OpenBLAS, run single-threaded: the backend splits the work itself), plus the other
 * dense helpers: bf16 rounding and bias column sums. Compute modes: fp32 and ieee are the same
 * thing on a CPU (plain fp32 products and sums); bf16 rounds each operand element to bf16 (round
 * to nearest even, rnnd_round_bf16) and multiplies the rounded values in fp32, which is what a
 * bf16 tensor-core matmul with fp32 accumulation computes; rnn.c makes the rounded copies.
 */
#include "cpu.h"

#include <string.h>

#include <cblas.h>

RNND_CPU_SIMD void rnnd__cpu_round_bf16(float *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = rnnd_round_bf16(src[i]);
}

void rnnd__cpu_gemm(bool ta, bool tb, int M, int N, int K, const float *A, int lda, const float *B,
                    int ldb, float beta, float *C, int ldc) {
    if (M == 0 || N == 0)
        return;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
                K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

// Rows are summed in float over blocks of COLSUM_BLOCK (cheap, vectorised, cache-hot), and the
// block sums in double: the float part of the error stays that of a 64-term sum however many rows
// there are.
#define COLSUM_BLOCK 64

RNND_CPU_SIMD void rnnd__cpu_add_colsum(float *dst, const float *src, size_t rows, int cols, int ld,
                                        double *acc, float *part) {
    for (int j = 0; j < cols; j++)
        acc[j] = 0.0;
    for (size_t r0 = 0; r0 < rows; r0 += COLSUM_BLOCK) {
        size_t r1 = r0 + COLSUM_BLOCK < rows ? r0 + COLSUM_BLOCK : rows;
        for (int j = 0; j < cols; j++)
            part[j] = 0.0f;
        for (size_t r = r0; r < r1; r++) {
            const float *row = src + r * (size_t)ld;
            for (int j = 0; j < cols; j++)
                part[j] += row[j];
        }
        for (int j = 0; j < cols; j++)
            acc[j] += part[j];
    }
    for (int j = 0; j < cols; j++)
        dst[j] += (float)acc[j];
}
