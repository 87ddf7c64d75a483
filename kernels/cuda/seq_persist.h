/*
 * seq_persist.h: arguments and entry points of the persistent time-loop kernels
 * (seq_persist.cuh, instantiated in seq_gru.cu and seq_lstm.cu). Internal to kernels/cuda/.
 */
#ifndef RNND_CUDA_SEQ_PERSIST_H
#define RNND_CUDA_SEQ_PERSIST_H

#include "rnnd_kernels.h"

#include <cuda_runtime.h>

// One layer's forward time loop. Pointers are device memory; strides in floats.
struct persist_fwd_args {
    int B, T, H, L, l;
    bool vec;                    // 16-byte vector access is safe (H % 4 == 0, aligned strides)
    int xks;                     // > 0: the loop computes x W_ih^T itself (xks k-steps of x)
    const float *xg;             // (B*T, G*H) x_l W_ih^T, no bias (xks == 0)
    const float *w_ih;           // (G*H, Il) (xks > 0)
    const float *w_hh;           // (G*H, H)
    const float *b_ih, *b_hh;    // (G*H)
    const uint8_t *is_init;      // (B, T)
    const float *h0, *c0;        // (B, L, H) or NULL
    const float *hidden, *cell;  // (B, T, L, H) or NULL
    float *y;                    // (B*T rows, ldy): the layer's output h
    int ldy;
    float *z;                    // tape z rows (ldz) or NULL: hprev at 0, 1 at H, x_l at xoff
    int ldz, xoff, Il;
    float *s;                    // tape s rows or NULL
    bool shalf;                  // s's gate planes are fp16 (tape_rec; the cluster loops:
                                 // tape_b8's blocks); only the cluster loop writes either, the
                                 // persistent ones take fp16 only
    float *h_n, *c_n;            // (B, L, H) or NULL
    const float *x;              // (B*T rows, ldx) the layer input, read by the loop when xks > 0
    int ldx;                     // or xcopy (then Il <= HP/2), else NULL
    bool xvec;                   // x rows may be read as float4 (Il % 4 == 0, aligned)
    bool xcopy;                  // copy x into z at xoff
    // Or, instead of z (the wgmma forwards, layer 0, H = 128; NOTES v27, v28, v40): z's parts
    // of the dw16 chunks (seq_persist.h's layout, chunk c at zc + c RNND_DW16_Z) and, in TF32
    // mode, each chunk's 16 x exponents (its record's ex, at zc_ex + 16 c), as the backward would
    // have written them.
    void *zc;
    int16_t *zc_ex;
    // Or, the H = 256 cluster forward (layer 0; NOTES v35), besides z: z's parts of the dw256
    // chunks at zc (RNND_DW256_Z a chunk) and their aux records at zc_aux (RNND_DW256_A).
    void *zc_aux;
    int variant;                 // bench variant of the TF32 H=128 loops (0: the default)
    long long *dbg;              // variant bit 8: per-block phase clocks, 8 per block
    bool wg;                     // seq_wg.cu's sm_90a loops may run (compute 9.0; seq.cu)
};

// One layer's backward time loop.
struct persist_bwd_args {
    int B, T, H, L, l;
    bool vec;
    bool stored;                 // the forward had stored states (hidden/cell)
    const float *w_hh;           // (G*H, H)
    const uint8_t *is_init;      // (B, T)
    const float *z;              // tape z rows (ldz): hprev
    int ldz;
    const float *s;              // tape s rows
    bool shalf;                  // s's gate planes are fp16 (the only tape these loops read;
                                 // the cluster loop's in tape_b8's blocks)
    const float *gy;             // (B*T rows, ldgy): dL/d(layer output)
    int ldgy;
    const float *gh_n, *gc_n;    // (B, L, H) or NULL
    float *d;                    // (B*T, 4H) out: gate gradients (GRU r,z,nx,nh; LSTM i,f,g,o)
    void *dw16;                  // or, instead of d: D and z in dw16 chunks (bf16, or TF32
                                 // mode's fp16 with dw16_exp)
    int dw16_pitch;              // chunks a plane of dw16 (RNND_DW16_* below)
    int16_t *dw16_exp;           // TF32 mode: the chunks' exponent records (RNND_DW16_E)
    const void *zc;              // or NULL: the forward wrote z's chunk parts (persist_fwd_args
                                 // zc), the loop writes D's alone and reads them
    const int16_t *zc_ex;        // with them in TF32 mode: x's exponents
                                 // The H = 256 cluster backward: D's dw256 planes at dw16 and
                                 // their exponents at dw16_exp (RNND_DW256_*), d NULL or D too;
                                 // each CTA adds 1 to dw16_ready[k] once its chunks of its k-th
                                 // step are written (T counters, zero before).
    unsigned *dw16_ready;
    float *g_h0, *g_c0;          // (B, L, H) or NULL: written where the initial state was used
    float *g_hidden, *g_cell;    // (B, T, L, H) or NULL: written where a stored value was used
    // rc (GRU, v10): one 16-bit W_hh for both directions; the loop recomputes the gates of
    // each step from hprev and x_l (the z rows: x_l at xoff, Il <= HP/2, Il % 4 == 0) with W_ih,
    // W_hh and the biases, or (zc) reads them from s (NOTES v29).
    bool rc;
    const float *w_ih;           // (G*H, Il)
    const float *b_ih, *b_hh;    // (G*H)
    const float *h0, *hidden;    // the forward's, for the bound of h (or NULL)
    int xoff, Il;
    int variant;                 // bench variant of the TF32 H=128 loops (0: the default)
    long long *dbg;              // variant bit 8: per-block phase clocks, 8 per block
};

// HP, the padded width the persistent kernels run model m at, or 0 when they cannot (compute
// ieee, H > 128, or more shared memory than smem_optin bytes).
int rnnd__persist_hp(const struct rnnd_model *m, size_t smem_optin);

// Launch one layer's loop on stream (m must have rnnd__persist_hp(m) > 0).
int rnnd__persist_forward(const struct rnnd_model *m, const struct persist_fwd_args *a,
                          cudaStream_t stream);
int rnnd__persist_backward(const struct rnnd_model *m, const struct persist_bwd_args *a,
                           cudaStream_t stream);

// x k-steps the forward loop of layer l of m fuses (its input projection), or 0 when it takes
// x W_ih^T from a GEMM: I_l > HP/2, or the weights do not fit smem_optin bytes.
int rnnd__persist_xks(const struct rnnd_model *m, int l, size_t smem_optin);

// Per cell (seq_gru.cu, seq_lstm.cu); bf16 selects the mode; smem returns the shared memory of
// one launch (forward: with xks fused x k-steps), -1 where there is none.
int rnnd__persist_gru(bool backward, bool bf16, int HP, const void *args, cudaStream_t stream);
int rnnd__persist_lstm(bool backward, bool bf16, int HP, const void *args, cudaStream_t stream);
long rnnd__persist_gru_smem(bool backward, bool bf16, int HP, int xks);
// Shared memory of the GRU backward without the gate tape (persist_bwd_args.rc), -1 where it
// has no instance (HP != 128).
long rnnd__persist_gru_rc_smem(bool bf16, int HP);
long rnnd__persist_lstm_smem(bool backward, bool bf16, int HP, int xks);

// The LSTM forward at H = 256 in 4-CTA clusters (seq_cluster.cu, sm_90, TF32 mode, I_l <= 64
// with I_l % 4 == 0, a.x set, a.vec and a.xvec): shared memory a CTA, the launch, and the
// clusters of the forward (backward) loop the device runs at once (0 where it cannot launch them).
long rnnd__cluster_lstm_smem(void);
int rnnd__cluster_lstm_forward(const struct persist_fwd_args *a, cudaStream_t stream);
int rnnd__cluster_lstm_active(bool backward);
// Its backward (any layer input: it reads the tape, not x; a.vec), same cluster shape.
long rnnd__cluster_lstm_bwd_smem(void);
int rnnd__cluster_lstm_backward(const struct persist_bwd_args *a, cudaStream_t stream);
// The same two loops with 80 rows a cluster (v11b: B = 2048 in 26 clusters, one wave on an
// H100; bench variant bit 1024 in seq.cu), same conditions and arguments.
long rnnd__cluster80_lstm_smem(void);
long rnnd__cluster80_lstm_bwd_smem(void);
int rnnd__cluster80_lstm_active(bool backward);
int rnnd__cluster80_lstm_forward(const struct persist_fwd_args *a, cudaStream_t stream);
int rnnd__cluster80_lstm_backward(const struct persist_bwd_args *a, cudaStream_t stream);

// The GRU and LSTM forwards with warpgroup MMAs (seq_wg.cu; built when the architectures
// include 90, as RNND_HAVE_WG says): TF32 mode (the GRU's also bf16), H <= 128 with H % 4 == 0,
// fused x with 1 <= I_l <= 64, a.vec and a.xvec, z rows in seq.cu's layout; the LSTM with its fp16
// gate tape (a.shalf) exactly when z rows or (H = 128) z chunk parts (a.zc) are written, the GRU
// with it only with the chunk parts; x's exponents (a.zc_ex) with the chunk parts in TF32 mode
// alone; RNND_ENOTSUP for other arguments.
int rnnd__wg_gru_forward(const struct persist_fwd_args *a, bool bf16, cudaStream_t stream);
// The GRU's backward loop on the forward's gate planes and chunk parts (seq_persist.cuh, ZF;
// seq_gru_zf.cu), same build: dh on warpgroup MMAs.
int rnnd__wg_gru_backward_zf(const struct persist_bwd_args *a, bool bf16, cudaStream_t stream);
int rnnd__wg_lstm_forward(const struct persist_fwd_args *a, cudaStream_t stream);

// The weight gradients' product z^T D on warpgroup MMAs (seq_dw.cu, sm_90a, NOTES v25) from
// 16-bit chunks a backward loop writes instead of D in fp32: chunk c = block x T + t holds the
// block's 16 rows of step t, K-major in 8 x 8 core matrices (element (column n, row r) at
// (n / 8) 256 + (r / 8) 128 + (n % 8) 16 + (r % 8) 2 bytes; TF32 mode's D row-major within
// its core matrices: (r % 8) 16 + (n % 8) 2, which the loops store without a transpose). D: 4
// planes of H = 128 columns, plane p of chunk c at (p pitch + c) RNND_DW16_D bytes; z:
// RNND_DW16_NZ columns (h's 128, x's 64 padded with zeros, the constant 1, zeros), chunk c at
// 4 pitch RNND_DW16_D + c RNND_DW16_Z (or, written by the forward, in its tape: dw16_args.z).
// Within each 16 columns of D and of z's h, the order is the loop's (movmatrix):
// 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15. Chunks from the loop's last to pitch
// (a multiple of the product's stage, RNND_DW16_CH, times its CTAs a plane) must be zeros.
#define RNND_DW16_D 4096L
#define RNND_DW16_NZ 200
#define RNND_DW16_Z (RNND_DW16_NZ * 32L)
#define RNND_DW16_CH 4
// In TF32 mode the loops write the chunks in fp16, every value scaled by a power of two, and
// chunk c's exponents as a record of int16 at exp + c RNND_DW16_E bytes:
//   [0, 128)   eD[w][r]: D = D' 2^eD in row r's group w (warp w's 16 units of all 4 planes),
//              whose largest |D'| is in [2^13, 2^14); RNND_DW16_EZERO where the group is zero;
//   [128, 144) eh[r]: z's h part and its constant = z' 2^eh (the loop block's h scale);
//   [144, 160) ex[r]: z's x part = z' 2^ex (its row's largest |x'| in [2^13, 2^14);
//              RNND_DW16_EZERO for a row of zeros);
//   [160, 168) mh[w], [168, 176) mx[w]: the largest eD + eh and eD + ex over the chunk's rows.
// So each value keeps TF32's 10 mantissa bits, and the product sums each of its K ranges relative
// to the range's largest exponents (NOTES v26). Records past the loop's last are 0x80 bytes
// (RNND_DW16_EZERO and less everywhere).
#define RNND_DW16_E 352L
#define RNND_DW16_EZERO (-32640)
struct dw16_args {
    const void *chunks; // as above, bf16, or fp16 with exp
    const void *z;      // z's parts: chunks + 4 pitch RNND_DW16_D, or the forward's (zc)
    int pitch;          // chunks a plane
    int ks;             // CTAs a plane (pitch is a multiple of ks x RNND_DW16_CH)
    int H, Il;          // the layer: H = 128, I_l <= 64
    bool gru;           // D's planes are the GRU's (r, z, n's hidden side, n's input side)
    float *part;        // ks x 4H x RNND_DW16_NZ floats of scratch
    const int16_t *exp; // TF32 mode: the chunks' exponent records, or NULL (bf16)
    float *gw_ih, *gw_hh, *gb_ih, *gb_hh; // out, +=: the layer's parameter gradients
};
// Built when the architectures include 90 (RNND_HAVE_WG); RNND_EINVAL for other shapes.
int rnnd__dw16_product(const struct dw16_args *a, cudaStream_t stream);
// dL/dx of the layer from the same chunks: dx = D_x W_ih over the input-side planes (GRU: r, z
// and n's input side, planes 0, 1, 3; LSTM: all 4). Same build and shapes.
struct dx16_args {
    const void *chunks;    // as above
    int pitch, nch;        // chunks a plane; the loop's chunks (blocks x T)
    int npl;               // input-side planes: 3 (GRU) or 4 (LSTM)
    int sms;               // CTAs (one an SM)
    int H, Il, B, T;
    const float *w_ih;     // (npl H, Il)
    float *dx;             // out: (B T, Il)
    const int16_t *exp;    // as dw16_args
};
int rnnd__dx16_product(const struct dx16_args *a, cudaStream_t stream);

// The same product for the LSTM at H = 256 (TF32 mode, layer 0, I_l <= 64; NOTES v35), from
// chunks the cluster loops write: 16-bit pieces of 16 rows x 64 columns in 128-byte rows, unit
// (16 bytes) j of row r at j ^ (r % 8) (wgmma's 128-byte swizzle, N-major for z; D's read by
// ldmatrix.trans). Chunk c = (T - 1 - t) x blocks + block: the backward loop's order.
//   z (the forward's): chunk c at z + c RNND_DW256_Z: 4 pieces of h (units 64 s + [0, 64), h
//     times the loop's h scale, a power of two), then x's piece (x' = x 2^-ex, zeros past I_l).
//   aux (the forward's): chunk c at aux + c RNND_DW256_A: the constant column (256 bytes,
//     K-major core matrices: column 0 the h scale in rows below B, else zeros), then eh[16]
//     (h = h' 2^eh) and ex[16] (RNND_DW16_EZERO for a row of zeros) as int16.
//   D (the backward's): plane p = 2 r + hp of chunk c at chunks + (p pitch + c) RNND_DW16_D:
//     the pieces of gates 2 hp and 2 hp + 1 of units 64 r + [0, 64) (cluster CTA r's), each
//     row scaled as CTA r's tile (its 256 columns' largest in [2^13, 2^14));
//     exp + 16 (r pitch + c): that row exponent eD per row (RNND_DW16_EZERO for a zero row).
// Chunks from the loops' last to pitch (a multiple of RNND_DW256_CH times the CTAs a plane) must
// be zeros, their records RNND_DW16_EZERO.
#define RNND_DW256_Z 10240L
#define RNND_DW256_A 320L
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

#endif // RNND_CUDA_SEQ_PERSIST_H
