/*
 * linear.c: the one matmul of the CPU backend, C = op(A) op(B) + beta C, row-major, on CBLAS
 * sgemm (OpenBLAS). Compute modes: fp32 and ieee are the same thing on a CPU (plain fp32
 * products and sums); bf16 rounds each operand element to bf16 (round to nearest even,
 * rnnd_round_bf16) and multiplies the rounded values in fp32, which is what a bf16 tensor-core
 * matmul with fp32 accumulation computes.
 */
#include "cpu.h"

#include <string.h>

#include <cblas.h>

RNND_CPU_SIMD void rnnd__cpu_round_bf16(float *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = rnnd_round_bf16(src[i]);
}

// Copies the rows x cols matrix at src (leading dimension ld) into dst, packed, rounded to bf16.
static void round_matrix(float *dst, const float *src, int rows, int cols, int ld) {
    for (int r = 0; r < rows; r++)
        rnnd__cpu_round_bf16(dst + (size_t)r * cols, src + (size_t)r * ld, (size_t)cols);
}

void rnnd__cpu_gemm(struct cpu_ctx *c, bool bf16, bool ta, bool tb, int M, int N, int K,
                    const float *A, int lda, bool round_a, const float *B, int ldb, bool round_b,
                    float beta, float *C, int ldc) {
    if (bf16) {
        float *next = c->round;
        if (round_a) {
            int rows = ta ? K : M, cols = ta ? M : K;
            round_matrix(next, A, rows, cols, lda);
            A = next;
            lda = cols;
            next += (size_t)rows * cols;
        }
        if (round_b) {
            int rows = tb ? N : K, cols = tb ? K : N;
            round_matrix(next, B, rows, cols, ldb);
            B = next;
            ldb = cols;
        }
    }
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M,
                N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

// Rows are summed in float over blocks of COLSUM_BLOCK (cheap, vectorised, cache-hot), and the
// block sums in double: the float part of the error stays that of a 64-term sum however many rows
// there are.
#define COLSUM_BLOCK 64

RNND_CPU_SIMD void rnnd__cpu_add_colsum(float *dst, const float *src, size_t rows, int cols,
                                        double *acc, float *part) {
    for (int j = 0; j < cols; j++)
        acc[j] = 0.0;
    for (size_t r0 = 0; r0 < rows; r0 += COLSUM_BLOCK) {
        size_t r1 = r0 + COLSUM_BLOCK < rows ? r0 + COLSUM_BLOCK : rows;
        for (int j = 0; j < cols; j++)
            part[j] = 0.0f;
        for (size_t r = r0; r < r1; r++) {
            const float *row = src + r * (size_t)cols;
            for (int j = 0; j < cols; j++)
                part[j] += row[j];
        }
        for (int j = 0; j < cols; j++)
            acc[j] += part[j];
    }
    for (int j = 0; j < cols; j++)
        dst[j] += (float)acc[j];
}
