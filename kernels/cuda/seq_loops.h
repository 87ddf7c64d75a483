/*
 * seq_loops.h: the time loops of the sequence forward and backward (one launch a layer): their
 * arguments and one entry point per kernel that the plan (seq_plan.h) names. Each entry point
 * launches the kernel it names on stream, or returns RNND_EINVAL where the arguments break its
 * contract (a plan that names it never passes such arguments); none falls back to another.
 *   seq_gru.cu, seq_lstm.cu      the persistent loops on mma.sync (seq_forward.cuh,
 *                                seq_backward.cuh) and the GRU's H = 128 backward
 *                                (seq_gru_backward.cuh)
 *   seq_gru_gate_tape.cu         that backward on the forward's gate tape (sm_90a)
 *   seq_wg.cu                    the forwards on warpgroup MMAs (sm_90a)
 *   seq_cluster.cu               the H = 256 loops in thread-block clusters (sm_90)
 * The sm_90a files are built when the architectures include 90 (RNND_HAVE_WG). clocks asks for
 * a loop's phase-clock instance where it has one (builds with RNND_CUDA_PHASE_CLOCKS; elsewhere
 * the plan never asks). Internal to kernels/cuda/.
 */
#ifndef RNND_CUDA_SEQ_LOOPS_H
#define RNND_CUDA_SEQ_LOOPS_H

#include "rnnd_kernels.h"

#include <cuda_runtime.h>

// One layer's forward time loop. Pointers are device memory; strides in floats.
struct persist_fwd_args {
    int B, T, H, L, l;
    bool vec;                   // 16-byte vector access is safe (H % 4 == 0, aligned strides)
    int xks;                    // > 0: the loop computes x W_ih^T itself (xks k-steps of x)
    const float *xg;            // (B*T, G*H) x_l W_ih^T, no bias (xks == 0)
    const float *w_ih;          // (G*H, Il) (xks > 0)
    const float *w_hh;          // (G*H, H)
    const float *b_ih, *b_hh;   // (G*H)
    const uint8_t *is_init;     // (B, T)
    const float *h0, *c0;       // (B, L, H) or NULL
    const float *hidden, *cell; // (B, T, L, H) or NULL
    float *y;                   // (B*T rows, ldy): the layer's output h
    int ldy;
    float *z; // tape z rows (ldz) or NULL: hprev at 0, 1 at H, x_l at xoff
    int ldz, xoff, Il;
    float *s;         // tape s rows or NULL
    bool shalf;       // s's gate planes are fp16 (tape_rec; the cluster loops:
                      // tape_b8's blocks); only the cluster loop writes either, the
                      // persistent ones take fp16 only
    float *h_n, *c_n; // (B, L, H) or NULL
    const float *x;   // (B*T rows, ldx) the layer input, read by the loop when xks > 0,
    int ldx;          // xcopy (then Il <= HP/2) or zc, else NULL
    bool xvec;        // x rows may be read as float4 (Il % 4 == 0, aligned)
    bool xcopy;       // copy x into z at xoff
    // Or, instead of z (HP = 128: the wgmma forwards, and the LSTM's mma.sync forward above layer
    // 0 in TF32 mode; docs/kernels.md): z's parts of the dw16 chunks (seq_chunks.h's layout,
    // chunk c at zc + c RNND_DW16_Z(RNND_DW16_XK(Il))) and, in TF32 mode at layer 0, each chunk's
    // 16 x exponents (its record's ex, at zc_ex + 16 c), as the backward would have written them.
    void *zc;
    int16_t *zc_ex;
    // Or, the H = 256 cluster forward (layer 0; docs/kernels.md), besides z: z's parts of the dw256
    // chunks at zc (RNND_DW256_Z a chunk) and their aux records at zc_aux (RNND_DW256_A).
    void *zc_aux;
    long long *dbg; // phase clocks (RNND_CUDA_PHASE_CLOCKS): 8 per block
};

// One layer's backward time loop.
struct persist_bwd_args {
    int B, T, H, L, l;
    bool vec;
    bool stored;            // the forward had stored states (hidden/cell)
    const float *w_hh;      // (G*H, H)
    const uint8_t *is_init; // (B, T)
    const float *z;         // tape z rows (ldz): hprev
    int ldz;
    const float *s;  // tape s rows
    bool shalf;      // s's gate planes are fp16 (the only tape these loops read;
                     // the cluster loop's in tape_b8's blocks)
    const float *gy; // (B*T rows, ldgy): dL/d(layer output)
    int ldgy;
    const float *gh_n, *gc_n; // (B, L, H) or NULL
    float *d;                 // (B*T, 4H) out: gate gradients (GRU r,z,nx,nh; LSTM i,f,g,o)
    void *dw16;               // or, instead of d: D and z in dw16 chunks (bf16, or TF32
                              // mode's fp16 with dw16_exp)
    int dw16_pitch;           // chunks a plane of dw16 (RNND_DW16_*, seq_chunks.h)
    int16_t *dw16_exp;        // TF32 mode: the chunks' exponent records (RNND_DW16_E)
    const void *zc;           // or NULL: the forward wrote z's chunk parts (persist_fwd_args
                              // zc), the loop writes D's alone and reads them
    const int16_t *zc_ex;     // with them in TF32 mode: x's exponents
                              // The H = 256 cluster backward: D's dw256 planes at dw16 and
                              // their exponents at dw16_exp (RNND_DW256_*), d NULL or D too;
                              // each CTA adds 1 to dw16_ready[k] once its chunks of its k-th
                              // step are written (T counters, zero before).
    unsigned *dw16_ready;
    float *g_h0, *g_c0;       // (B, L, H) or NULL: written where the initial state was used
    float *g_hidden, *g_cell; // (B, T, L, H) or NULL: written where a stored value was used
    // The GRU H = 128 backward (seq_gru_backward.cuh) recomputes the gates of each step from
    // hprev and x_l (the z rows: x_l at xoff, Il <= HP/2, Il % 4 == 0) with W_ih, W_hh and the
    // biases, or (zc) reads them from s.
    const float *w_ih;        // (G*H, Il)
    const float *b_ih, *b_hh; // (G*H)
    const float *h0, *hidden; // the forward's, for the bounds of h (this layer's; the layer
                              // below's for x above layer 0) (or NULL)
    int xoff, Il;             // x_l in the z rows (also where the loop writes z's chunks)
    long long *dbg;           // phase clocks (RNND_CUDA_PHASE_CLOCKS): 8 per block
};

// The mma.sync loops of one cell (seq_gru.cu, seq_lstm.cu) at padded width HP (32, 64, 96 or
// 128; seq_plan.h rnnd__seq_persist_hp) in bf16 or TF32 mode. kp: the GRU's forward with K split
// over warp pairs (TF32, HP = 128, fused x, a.vec). The forward takes the gate tape (a.s) in
// fp16 only (a.shalf), and the backward only that.
int rnnd__persist_gru_forward(const struct persist_fwd_args *a, bool bf16, int HP, bool kp,
                              bool clocks, cudaStream_t stream);
int rnnd__persist_gru_backward(const struct persist_bwd_args *a, bool bf16, int HP, bool clocks,
                               cudaStream_t stream);
int rnnd__persist_lstm_forward(const struct persist_fwd_args *a, bool bf16, int HP, bool clocks,
                               cudaStream_t stream);
int rnnd__persist_lstm_backward(const struct persist_bwd_args *a, bool bf16, int HP, bool clocks,
                                cudaStream_t stream);
// Shared memory of one launch (forward: with xks fused x k-steps), -1 where there is none.
long rnnd__persist_gru_smem(bool backward, bool bf16, int HP, int xks);
long rnnd__persist_lstm_smem(bool backward, bool bf16, int HP, int xks);

// The GRU's backward at H = 128 recomputing its gates (seq_gru.cu): x_l in the z rows (Il <= 64,
// Il % 4 == 0, a.w_ih, a.b_ih, a.b_hh); with a.dw16 (vector access) D and z leave as dw16
// chunks (seq_chunks.h). Its shared memory (-1 where it has no instance: HP != 128).
int rnnd__gru_h128_backward(const struct persist_bwd_args *a, bool bf16, bool clocks,
                            cudaStream_t stream);
long rnnd__gru_h128_backward_smem(bool bf16, int HP);
// The same loop on the wgmma forward's gate planes (a.s) and z chunk parts (a.zc; TF32 mode:
// a.zc_ex; I_l <= 128), writing D's chunks (a.dw16): gates read, not recomputed
// (seq_gru_gate_tape.cu).
int rnnd__gru_h128_gate_tape_backward(const struct persist_bwd_args *a, bool bf16, bool clocks,
                                      cudaStream_t stream);

// The GRU and LSTM forwards on warpgroup MMAs (seq_wg.cu): TF32 mode (the GRU's also bf16, the
// LSTM's at H <= 64), 96 < H <= 128 (or 64 <= H <= 96 padded to 128) with H % 4 == 0, fused x
// with 1 <= I_l <= 64 (the GRU's 128), a.vec and a.xvec,
// z rows in seq.cu's layout; the LSTM with its fp16 gate tape (a.shalf) exactly when z rows or
// (H = 128) z chunk parts (a.zc) are written, the GRU with it only with the chunk parts; x's
// exponents (a.zc_ex) with the chunk parts in TF32 mode alone.
int rnnd__wg_gru_forward(const struct persist_fwd_args *a, bool bf16, bool clocks,
                         cudaStream_t stream);
int rnnd__wg_lstm_forward(const struct persist_fwd_args *a, bool bf16, bool clocks,
                          cudaStream_t stream);

// The LSTM and GRU loops at H = 256 in 4-CTA clusters of `rows` (64 or 80) batch rows
// (seq_cluster.cu, sm_90): the forward (I_l <= 64 with I_l % 4 == 0, a.x set, a.vec and a.xvec;
// the tape in rows, or (a.shalf) in tape_b8's blocks), the backward (any layer input: it reads
// the tape in blocks, not x; a.vec; the GRU's writes D in rows), same cluster shape; the
// clusters of the LSTM's forward (backward) loop the device runs at once (0 where it cannot
// launch them; the GRU's loops, like the LSTM's, run one CTA an SM, so as many fit).
int rnnd__cluster_forward(const struct persist_fwd_args *a, bool lstm, int rows,
                          cudaStream_t stream);
int rnnd__cluster_backward(const struct persist_bwd_args *a, bool lstm, int rows,
                           cudaStream_t stream);
int rnnd__cluster_active(int rows, bool backward);

#endif // RNND_CUDA_SEQ_LOOPS_H
