/*
 * seq_chunks.h: the 16-bit chunk formats in which the H = 128 and H = 256 backward loops (and, for
 * z, the forwards) hand D and z to the weight-gradient products of seq_dw.cu instead of D in
 * fp32, and those products' entry points (built for sm_90a when the architectures include 90,
 * RNND_HAVE_WG). Internal to kernels/cuda/.
 */
#ifndef RNND_CUDA_SEQ_CHUNKS_H
#define RNND_CUDA_SEQ_CHUNKS_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>

// The weight gradients' product z^T D on warpgroup MMAs (seq_dw.cu, sm_90a, docs/kernels.md) from
// 16-bit chunks a backward loop writes instead of D in fp32: chunk c = block x T + t holds the
// block's 16 rows of step t, K-major in 8 x 8 core matrices (element (column n, row r) at
// (n / 8) 256 + (r / 8) 128 + (n % 8) 16 + (r % 8) 2 bytes; TF32 mode's D row-major within
// its core matrices: (r % 8) 16 + (n % 8) 2, which the loops store without a transpose). D: 4
// planes of H = 128 columns, plane p of chunk c at (p pitch + c) RNND_DW16_D bytes; z:
// RNND_DW16_NZ(xk) columns (h's 128, x's xk = RNND_DW16_XK(I_l) padded with zeros, the constant
// 1, zeros), chunk c at 4 pitch RNND_DW16_D + c RNND_DW16_Z(xk) (or, written by the forward, in
// its tape: dw16_args.z; layer 0, xk = 64).
// Within each 16 columns of D and of z's h, the order is the loop's (movmatrix):
// 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15. Chunks from the loop's last to pitch
// (a multiple of the product's stage, RNND_DW16_CH, times its CTAs a plane) must be zeros.
#define RNND_DW16_MP     128 // D's columns a plane, whatever the layer's H (<= 128)
#define RNND_DW16_D      4096L
#define RNND_DW16_XK(il) ((il) <= 64 ? 64 : 128) // z's x columns for a layer input I_l <= 128
#define RNND_DW16_NZ(xk) (136 + (xk))            // 200 or 264
#define RNND_DW16_Z(xk)  (RNND_DW16_NZ(xk) * 32L)
#define RNND_DW16_CH     4
// In TF32 mode the loops write the chunks in fp16, every value scaled by a power of two, and
// chunk c's exponents as a record of int16 at exp + c RNND_DW16_E bytes:
//   [0, 128)   eD[w][r]: D = D' 2^eD in row r's group w (warp w's 16 units of all 4 planes),
//              whose largest |D'| is in [2^13, 2^14); RNND_DW16_EZERO where the group is zero;
//   [128, 144) eh[r]: z's h part and its constant = z' 2^eh (the loop block's h scale);
//   [144, 160) ex[r]: z's x part = z' 2^ex (its row's largest |x'| in [2^13, 2^14);
//              RNND_DW16_EZERO for a row of zeros);
//   [160, 168) mh[w], [168, 176) mx[w]: the largest eD + eh and eD + ex over the chunk's rows.
// So each value keeps TF32's 10 mantissa bits, and the product sums each of its K ranges relative
// to the range's largest exponents (docs/kernels.md). Records past the loop's last are 0x80 bytes
// (RNND_DW16_EZERO and less everywhere).
#define RNND_DW16_E     352L
#define RNND_DW16_EZERO (-32640)
struct dw16_args {
    const void *chunks; // as above, bf16, or fp16 with exp
    const void *z;      // z's parts: chunks + 4 pitch RNND_DW16_D, or the forward's (zc)
    int pitch;          // chunks a plane
    int ks;             // CTAs a plane (pitch is a multiple of ks x RNND_DW16_CH)
    int H, Il;          // the layer: H % 4 == 0, H <= 128 (zeros past H), I_l <= 128
    bool gru;           // D's planes are the GRU's (r, z, n's hidden side, n's input side)
    float *part;        // ks x 4 RNND_DW16_MP x RNND_DW16_NZ(xk) floats of scratch
    const int16_t *exp; // TF32 mode: the chunks' exponent records, or NULL (bf16)
    float *gw_ih, *gw_hh, *gb_ih, *gb_hh; // out, +=: the layer's parameter gradients
};
// Built when the architectures include 90 (RNND_HAVE_WG); RNND_EINVAL for other shapes.
int rnnd__dw16_product(const struct dw16_args *a, cudaStream_t stream);
// dL/dx of the layer from the same chunks: dx = D_x W_ih over the input-side planes (GRU: r, z
// and n's input side, planes 0, 1, 3; LSTM: all 4). Same build and shapes.
struct dx16_args {
    const void *chunks; // as above
    int pitch, nch;     // chunks a plane; the loop's chunks (blocks x T)
    int npl;            // input-side planes: 3 (GRU) or 4 (LSTM)
    int sms;            // CTAs (one an SM)
    int H, Il, B, T;
    const float *w_ih;  // (npl H, Il)
    float *dx;          // out: (B T, Il)
    const int16_t *exp; // as dw16_args
};
int rnnd__dx16_product(const struct dx16_args *a, cudaStream_t stream);

// The same product at H = 256 (TF32 and bf16 modes, layer 0, I_l <= 64; docs/kernels.md; the
// GRU's gates 2 and 3 as dw16_args says), from chunks the cluster loops write: 16-bit pieces of
// 16 rows x 64 columns in 128-byte rows, unit (16 bytes) j of row r at j ^ (r % 8) (wgmma's
// 128-byte swizzle, N-major for z; D's read by ldmatrix.trans). Chunk c = (T - 1 - t) x blocks + block: the backward loop's order.
//   z (the forward's): chunk c at z + c RNND_DW256_Z: 4 pieces of h (units 64 s + [0, 64), h
//     times the loop's h scale, a power of two), then x's piece (x' = x 2^-ex, zeros past I_l).
//   aux (the forward's): chunk c at aux + c RNND_DW256_A: the constant column (256 bytes,
//     K-major core matrices: column 0 the h scale in rows below B, else zeros), then eh[16]
//     (h = h' 2^eh) and ex[16] (RNND_DW16_EZERO for a row of zeros) as int16.
//   D (the backward's): plane p = 2 r + hp of chunk c at chunks + (p pitch + c) RNND_DW16_D:
//     the pieces of gates 2 hp and 2 hp + 1 of units 64 r + [0, 64) (cluster CTA r's), each
//     row scaled as CTA r's tile (the largest of its 256 columns, the GRU's da_n with them, in
//     [2^13, 2^14));
//     exp + 16 (r pitch + c): that row exponent eD per row (RNND_DW16_EZERO for a zero row).
// Chunks from the loops' last to pitch (a multiple of RNND_DW256_CH times the CTAs a plane) must
// be zeros, their records RNND_DW16_EZERO.
#define RNND_DW256_Z  10240L
#define RNND_DW256_A  320L
#define RNND_DW256_CH 2
#define RNND_DW256_NZ 328 // h 256, x 64, the constant, 7 zero columns
// The product is launched right after the backward loop on its stream, as a programmatic
// dependent: its CTAs take the SMs the loop leaves, and each starts on its K range once the loop
// has written it (ready[k] == ctas for the range's last step k < T; persist_bwd_args).
struct dw256_sync {
    const unsigned *ready; // T counters
    int nblk, T;           // blocks of 16 rows, steps
    unsigned ctas;         // the loop's CTAs
};
int rnnd__dw256_product(const struct dw16_args *a, const void *aux, const struct dw256_sync *sy,
                        cudaStream_t stream);

#endif // RNND_CUDA_SEQ_CHUNKS_H
