/*
 * seq.cu: the sequence forward and backward of the CUDA backend, layer by layer.
 *
 * Forward, layer l (input x_l: x, or the output of layer l-1 as stored in this layer's tape):
 *   1. xg (B*T, G*H) = x_l W_ih^T: one cuBLAS GEMM (TF32 in fp32 mode, bf16 operands in bf16
 *      mode, strict fp32 in ieee mode), unless the persistent loop fuses it (I_l <= HP/2 and
 *      the weights fit in shared memory: it then reads x_l itself);
 *   2. the time loop: the persistent kernel (seq_persist.cuh), the LSTM H = 256 kernel in
 *      thread-block clusters (seq_cluster.cu, sm_90; layer input <= 64 wide), or per step one GEMM
 *      gh = h W_hh^T over the B rows plus one fused cell kernel (the per-step path);
 *      both write y (to `out`, or into the next layer's tape), the tape (z: hprev | 1 | x_l;
 *      s: the gates' pre-activations, GRU hn, LSTM cprev; no s where the backward recomputes
 *      the gates, seq_recompute) and h_n, c_n.
 * Backward, layer l from the top:
 *   1. the reverse time loop (persistent or per step) writes D (B*T, 4H), the gradient of the
 *      gate pre-activations (GRU: r, z, n on the input side, n on the hidden side;
 *      LSTM: i, f, g, o), and routes the state gradient at resets and at t = 0;
 *   2. [dW_ih | dW_hh | db] from one GEMM D^T z over all B*T rows (z carries x_l, hprev and a
 *      constant 1 column), scattered into the gradient array with += (deterministic: cuBLAS
 *      without atomics, then one thread per element); or, for layer 0 where the loops write D
 *      and z as 16-bit chunks (seq_dw16 and seq_zfwd at H = 128, seq_cz at H = 256), seq_dw.cu's
 *      products on them;
 *   3. dx_l = D W_ih: the layer below's output gradient, or grads->x.
 */
#include "seq.cuh"

#include "seq_persist.cuh"

#include <limits.h>
#include <string.h>

#define SEQ_BLOCK 256

// ---------------------------------------------------------------------------------------------
// Layout

static bool seq_zfwd_model(const struct cuda_ctx *c, const struct rnnd_model *m);
static int seq_dw16_pitch(const struct cuda_ctx *c, int B, int T);
static bool seq_cz_model(const struct cuda_ctx *c, const struct rnnd_model *m, int B);
static int seq_dw256_pitch(const struct cuda_ctx *c, int B, int T);

// The layout holds s rows of fp32 planes; a tape whose gate planes are fp16 (tape_half) packs
// its shorter rows into the same space. Layer 0's z space also holds the z chunk parts and (TF32
// mode) x exponents (seq_zfwd) or the dw256 chunk parts (seq_cz) where the device and model may
// write them.
void rnnd__cuda_seq_layout(const struct cuda_ctx *c, const struct rnnd_model *m, int B, int T,
                           struct seq_layout *lay) {
    size_t BT = (size_t)B * T, at = 0;
    int H = m->H, sw = (m->cell == RNND_CELL_LSTM ? 5 : 4) * H;
    memset(lay, 0, sizeof(*lay));
    for (int l = 0; l < m->L; l++) {
        struct seq_layer_layout *y = &lay->layer[l];
        y->Il = rnnd_model_layer_input(m, l);
        y->xoff = ROUND_UP(H + 1, 4);
        y->ldz = ROUND_UP(y->xoff + y->Il, 4);
        y->sw = sw;
        y->z_off = at;
        size_t zf = BT * y->ldz;
        const bool zfwd = l == 0 && seq_zfwd_model(c, m);
        if (zfwd || (l == 0 && seq_cz_model(c, m, B))) {
            const size_t ex = m->compute == RNND_COMPUTE_FP32
                                  ? (size_t)CEIL_DIV(B, 16) * T * 16 * sizeof(int16_t)
                                  : 0;
            size_t zc = zfwd ? (size_t)seq_dw16_pitch(c, B, T) * RNND_DW16_Z + ex
                            : (size_t)seq_dw256_pitch(c, B, T) * (RNND_DW256_Z + RNND_DW256_A);
            zf = zf > zc / sizeof(float) ? zf : zc / sizeof(float);
        }
        at += ROUND_UP(zf, (size_t)64);
        y->s_off = at;
        at += ROUND_UP(BT * sw, (size_t)64);
    }
    lay->tape_floats = at;
}

struct layer_params rnnd__cuda_layer_params(const struct rnnd_model *m, int l, const float *p) {
    struct rnnd_param_tensor t[4];
    for (int k = 0; k < 4; k++)
        rnnd_model_param_tensor(m, 4 * l + k, &t[k]);
    return (struct layer_params){p + t[0].offset, p + t[1].offset, p + t[2].offset,
                                 p + t[3].offset};
}

size_t rnnd__cuda_tape_bytes(const struct cuda_ctx *c, const struct rnnd_model *m, int B, int T) {
    if (rnnd_model_check(m) != 0 || B < 1 || T < 1)
        return 0;
    struct seq_layout lay;
    rnnd__cuda_seq_layout(c, m, B, T, &lay);
    return lay.tape_floats * sizeof(float);
}

// Strides handed to cuBLAS and index arithmetic in int must fit.
static bool dims_fit(const struct rnnd_model *m, int B, int T) {
    int64_t w = 5 * (int64_t)m->H + m->I + 8;
    return (int64_t)T * w <= INT_MAX && (int64_t)B * T <= INT_MAX / 4;
}

static bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

bool rnnd__cuda_seq_persistent(const struct cuda_ctx *c, const struct rnnd_model *m) {
    if (c->path == CUDA_PATH_STEPWISE)
        return false;
    return rnnd__persist_hp(m, c->smem_optin) > 0;
}

// Layer l's backward recomputes its gates instead of reading them from the tape (v10,
// docs/journal): GRU at HP = 128 with H = 128 and a layer input the loop can read
// (I_l <= 64, I_l % 4 == 0); the forward then writes no s rows, except where it writes z's chunk
// parts (seq_zfwd: then the loop reads the gates, NOTES v29). The forward and the backward of
// one tape must agree, so this depends on the model, the context and l only. Bench variant bit
// 64 turns it off.
static bool seq_recompute(const struct cuda_ctx *c, const struct rnnd_model *m, int l) {
    if (!rnnd__cuda_seq_persistent(c, m) || (c->variant & 64) || m->cell != RNND_CELL_GRU ||
        m->H != 128 || rnnd__persist_hp(m, c->smem_optin) != 128)
        return false;
    int Il = rnnd_model_layer_input(m, l);
    long need = rnnd__persist_gru_rc_smem(m->compute == RNND_COMPUTE_BF16, 128);
    return Il <= 64 && Il % 4 == 0 && need > 0 && (size_t)need <= c->smem_optin;
}

// Layer l's weight gradients and dL/dx come from seq_dw.cu's products on dw16 chunks (NOTES
// v25d-f, v26) instead of cuBLAS on D in fp32: compute 9.0, bf16 or TF32 mode (fp16 chunks with
// exponent records), vector access, the persistent loops at H = 128 with I_l <= 64 (the GRU's
// recomputing one, the LSTM's). Bench variant bit 16384 turns it off.
#define RNND_SEQ_VARIANT_NO_DW16 16384
static bool seq_dw16(const struct cuda_ctx *c, const struct rnnd_model *m, int l, bool vec) {
    if (!cuda_has_wg(c) || (c->variant & RNND_SEQ_VARIANT_NO_DW16) ||
        m->compute == RNND_COMPUTE_IEEE || !vec)
        return false;
    if (m->cell == RNND_CELL_GRU)
        return seq_recompute(c, m, l);
    return rnnd__cuda_seq_persistent(c, m) && m->H == 128 &&
           rnnd__persist_hp(m, c->smem_optin) == 128 && rnnd_model_layer_input(m, l) <= 64;
}

// The product's chunks a plane: the loop's (blocks x T), whole stages for each of its CTAs.
static int seq_dw16_pitch(const struct cuda_ctx *c, int B, int T) {
    const int step = c->num_sms / 4 * RNND_DW16_CH;
    return CEIL_DIV(CEIL_DIV(B, 16) * T, step) * step;
}

// Layer 0 keeps no z rows in its tape where the wgmma forward writes z's dw16 chunk parts
// instead (NOTES v27, the LSTM; v28, the GRU; v40, the GRU in bf16 mode): TF32 mode (or the
// GRU's bf16), H = 128, fused x with I % 4 == 0, and the chunks' backward. The LSTM's bf16
// backward reads z rows.
// The model and the device set the tape's size (seq_zfwd_model); the inputs both passes see
// decide the format (seq_zfwd: the forward stages misaligned outputs, the backward's loop takes
// any gradients). Bench variant bit 32768 turns it off.
#define RNND_SEQ_VARIANT_NO_ZFWD 32768
static bool seq_zfwd_model(const struct cuda_ctx *c, const struct rnnd_model *m) {
    const bool mode = m->compute == RNND_COMPUTE_FP32 ||
                      (m->compute == RNND_COMPUTE_BF16 && m->cell == RNND_CELL_GRU);
    return mode && m->H == 128 && cuda_wg(c) &&
           !(c->variant & (32 | RNND_SEQ_VARIANT_NO_ZFWD)) && m->I % 4 == 0 &&
           seq_dw16(c, m, 0, true) &&
           rnnd__persist_xks(m, 0, c->smem_optin) > 0;
}
static bool seq_zfwd(const struct cuda_ctx *c, const struct rnnd_model *m,
                     const struct rnnd_seq *seq) {
    return seq_zfwd_model(c, m) && aligned16(seq->x) && aligned16(seq->h0) &&
           aligned16(seq->c0) && aligned16(seq->hidden) && aligned16(seq->cell);
}

// The LSTM H = 256 loops may run in thread-block clusters (seq_cluster.cu, v11 and v11b in
// docs/journal): TF32 mode, sm_90. Bench variant bit 128 turns them off (the per-step
// path).
static bool seq_cluster_model(const struct cuda_ctx *c, const struct rnnd_model *m) {
    return c->path != CUDA_PATH_STEPWISE && !(c->variant & 128) && c->cc_major >= 9 &&
           m->cell == RNND_CELL_LSTM && m->compute == RNND_COMPUTE_FP32 && m->H == 256;
}

// Layer l's forward in clusters reads its input itself (I_l <= 64, I_l % 4 == 0); the caller
// adds the run-time alignment and asks seq_cluster_rows for the shape.
static bool seq_cluster(const struct cuda_ctx *c, const struct rnnd_model *m, int l) {
    int Il = rnnd_model_layer_input(m, l);
    return seq_cluster_model(c, m) && Il <= 64 && Il % 4 == 0;
}

// Rows a cluster of a B-row LSTM H = 256 loop (0: the device cannot run either shape): 64, or
// 80 where that takes fewer waves (an H100 runs 30 clusters of either: B = 2048 is two waves of
// 64-row clusters, one of 80-row ones; a wave costs a whole loop). At equal waves 64, whose
// steps are faster (the 80-row loops single-buffer their tiles: a second cluster barrier a
// step; NOTES v11b). Bench variant bit 1024 asks for 80 rows wherever they run.
#define RNND_SEQ_VARIANT_CLUSTER80 1024
static int seq_cluster_rows(const struct cuda_ctx *c, int B, bool backward) {
    int a64 = rnnd__cluster_lstm_active(backward), a80 = rnnd__cluster80_lstm_active(backward);
    if (a80 > 0 && (c->variant & RNND_SEQ_VARIANT_CLUSTER80))
        return 80;
    if (a64 <= 0 || a80 <= 0)
        return a64 > 0 ? 64 : a80 > 0 ? 80 : 0;
    return CEIL_DIV(CEIL_DIV(B, 80), a80) < CEIL_DIV(CEIL_DIV(B, 64), a64) ? 80 : 64;
}

// The backward loop of an LSTM H = 256 layer in clusters (any layer input: it reads the tape,
// which both forward shapes and the per-step path write alike): rows a cluster, or 0 for the
// per-step backward. Clusters win (NOTES v11, v11b) when the batch runs in one wave and has at
// least RNND_CLUSTER_BWD_MIN_ROWS rows (one cluster's step, ~15.5 us, is slower than the
// per-step path's at B = 64, ~13.6 us; the per-step path's grows ~2.4 times faster with B).
// Bench variant bit 256 turns them off.
#define RNND_CLUSTER_BWD_MIN_ROWS 320
static int seq_cluster_bwd(const struct cuda_ctx *c, const struct rnnd_model *m, int B) {
    if (!seq_cluster_model(c, m) || (c->variant & 256) || B < RNND_CLUSTER_BWD_MIN_ROWS)
        return 0;
    int rows = seq_cluster_rows(c, B, true);
    int active = rows == 80 ? rnnd__cluster80_lstm_active(true) : rnnd__cluster_lstm_active(true);
    return rows > 0 && CEIL_DIV(B, rows) <= active ? rows : 0;
}

// A tape of B rows holds its gate planes in fp16 (common.cuh, tape_rec; cell_lstm says why
// pre-activations) where its backward runs in the persistent loops or (LSTM) the cluster loops,
// which take nothing else: the LSTM's 12 bytes an element instead of 20 each way (NOTES v20),
// the GRU's 8 instead of 16 (v29). Per step, fp32: that path's TF32 GEMMs leave no room under
// the 1e-3 bound for one more rounding (an LSTM H = 256, B = 33 case measured 9.6e-4 with fp32
// and 1.0e-3 with fp16 planes). Forward and backward of one tape agree: this depends on the
// context, the model and B only.
static bool tape_blocked(const struct cuda_ctx *c, const struct rnnd_model *m, int B);
static bool tape_half(const struct cuda_ctx *c, const struct rnnd_model *m, int B) {
    return rnnd__cuda_seq_persistent(c, m) || tape_blocked(c, m, B);
}
// The LSTM's tape for the cluster backward holds its record in tape_b8's blocks of 8 rows, one
// 16-byte and one 8-byte access a row for the cluster loops (NOTES v34). The layout's fp32 rows
// hold them: B rounded up to 8 rows of 3H floats is less than B rows of 5H (B >= 320).
static bool tape_blocked(const struct cuda_ctx *c, const struct rnnd_model *m, int B) {
    return m->cell == RNND_CELL_LSTM && seq_cluster_bwd(c, m, B) > 0;
}
static_assert(RNND_CLUSTER_BWD_MIN_ROWS >= 11, "B + 7 rows of 3H floats within B rows of 5H");

// Layer 0 of an LSTM H = 256 whose loops both run in clusters keeps z as dw256 chunk parts in its
// tape instead of z rows, and its backward writes D's (besides D in fp32 where dL/dx needs it),
// for seq_dw.cu's product instead of cuBLAS's (NOTES v35): compute 9.0 (the product's wgmma).
// The model, the device and B set the tape's size (seq_cz_model); the inputs both passes see add
// the alignments the cluster forward needs (seq_cz). Misaligned outputs of the forward and
// gradients of the backward go through aligned scratch (as for seq_zfwd), so that both loops
// run in clusters. Bench variant bit 16384 (RNND_SEQ_VARIANT_NO_DW16) turns it off.
static bool seq_cz_model(const struct cuda_ctx *c, const struct rnnd_model *m, int B) {
    return cuda_has_wg(c) && !(c->variant & RNND_SEQ_VARIANT_NO_DW16) && seq_cluster(c, m, 0) &&
           tape_blocked(c, m, B) && seq_cluster_rows(c, B, false) > 0;
}
static bool seq_cz(const struct cuda_ctx *c, const struct rnnd_model *m,
                   const struct rnnd_seq *seq) {
    return seq_cz_model(c, m, seq->B) && aligned16(seq->x) && aligned16(seq->h0) &&
           aligned16(seq->c0) && aligned16(seq->hidden) && aligned16(seq->cell);
}
// The dw256 product's K ranges a plane: four for each of its CTA slots (num_sms / 8 a plane),
// so that most start beside the backward loop as their steps are written, and the last ones
// take a quarter of the product's time (NOTES v35l).
static int seq_dw256_ks(const struct cuda_ctx *c) {
    return c->num_sms / 8 * 4;
}
// Its chunks a plane: whole stages for each K range.
static int seq_dw256_pitch(const struct cuda_ctx *c, int B, int T) {
    const int step = seq_dw256_ks(c) * RNND_DW256_CH;
    return CEIL_DIV(CEIL_DIV(B, 16) * T, step) * step;
}

// ---------------------------------------------------------------------------------------------
// GEMM (column-major cuBLAS view of our row-major arrays)

static cublasComputeType_t compute_type(enum rnnd_compute mode) {
    switch (mode) {
        case RNND_COMPUTE_BF16:
            return CUBLAS_COMPUTE_32F_FAST_16BF;
        case RNND_COMPUTE_IEEE:
            return CUBLAS_COMPUTE_32F_PEDANTIC;
        default:
            return CUBLAS_COMPUTE_32F_FAST_TF32;
    }
}

static int gemm(struct cuda_ctx *c, enum rnnd_compute mode, cublasOperation_t ta,
                cublasOperation_t tb, int M, int N, int K, const float *A, int lda, const float *B,
                int ldb, float beta, float *C, int ldc) {
    const float one = 1.0f;
    RNND_CUBLAS_TRY(cublasGemmEx(c->blas, ta, tb, M, N, K, &one, A, CUDA_R_32F, lda, B, CUDA_R_32F,
                                 ldb, &beta, C, CUDA_R_32F, ldc, compute_type(mode),
                                 CUBLAS_GEMM_DEFAULT));
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Per-step path kernels: one thread per (row, unit).

struct stepwise_args {
    int B, T, H, L, l;
    const uint8_t *is_init;
    const float *h0, *c0, *hidden, *cell;
    float *z; // tape z (hprev at 0)
    int ldz, xoff, Il;
    float *s;  // tape s
    bool sblk; // s in tape_b8's blocks (tape_blocked; HALF)
    const float *b_ih, *b_hh;
};

// Plane p of unit u at row b, step t of a layer's s: in rows of tape_rec or (sblk) in tape_b8's
// blocks.
template <class Cell, bool HALF, class A>
static __device__ float tape_get(const A &a, size_t b, int t, int p, int u) {
    using TR = tape_rec<Cell, HALF>;
    if (HALF && a.sblk)
        return tape_b8::get(a.s, b, t, p, u, a.T, a.H);
    return TR::get(a.s + (b * a.T + t) * TR::floats(a.H), p, a.H, u);
}
template <class Cell, bool HALF>
static __device__ void tape_put(const stepwise_args &a, size_t b, int t, int p, int u, float v) {
    using TR = tape_rec<Cell, HALF>;
    if (HALF && a.sblk)
        tape_b8::put(a.s, b, t, p, u, a.T, a.H, v);
    else
        TR::put(a.s + (b * a.T + t) * TR::floats(a.H), p, a.H, u, v);
}

// z row (b, t): hprev = h, the constant 1 and zero pads; the LSTM's cprev.
template <class Cell, bool HALF>
static __device__ void stepwise_put_state(const stepwise_args &a, size_t b, int t, int u, float h,
                                          float c) {
    float *zr = a.z + (b * a.T + t) * a.ldz;
    zr[u] = h;
    if (Cell::G == 4)
        tape_put<Cell, HALF>(a, b, t, 4, u, c);
    if (u == 0) {
        zr[a.H] = 1.0f;
        for (int k = a.H + 1; k < a.xoff; k++)
            zr[k] = 0.0f;
        for (int k = a.xoff + a.Il; k < a.ldz; k++)
            zr[k] = 0.0f;
    }
}

template <class Cell, bool HALF>
static __global__ void stepwise_init_kernel(const stepwise_args a) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= a.B * a.H)
        return;
    size_t b = idx / a.H;
    int u = idx % a.H, H = a.H;
    size_t r = b * a.T;
    float h = 0.0f, c = 0.0f;
    if (a.hidden) {
        h = a.hidden[(r * a.L + a.l) * H + u];
        if (a.cell)
            c = a.cell[(r * a.L + a.l) * H + u];
    } else if (!a.is_init[r] && a.h0) {
        h = a.h0[(b * a.L + a.l) * H + u];
        if (a.c0)
            c = a.c0[(b * a.L + a.l) * H + u];
    }
    stepwise_put_state<Cell, HALF>(a, b, 0, u, h, c);
}

template <class Cell, bool HALF>
static __global__ void stepwise_cell_kernel(const stepwise_args a, int t, const float *xg,
                                            const float *hg, float *y, int ldy, float *h_n,
                                            float *c_n) {
    constexpr int G = Cell::G, SW = Cell::SW;
    constexpr bool LSTM = G == 4;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= a.B * a.H)
        return;
    int H = a.H, T = a.T;
    size_t b = idx / H;
    int u = idx % H;
    size_t r = b * T + t;
    float xq[G], hq[G], s[SW];
    for (int q = 0; q < G; q++) {
        xq[q] = xg[r * (G * H) + q * H + u] + a.b_ih[q * H + u];
        hq[q] = hg[b * (G * H) + q * H + u] + a.b_hh[q * H + u];
    }
    float h = a.z[r * a.ldz + u];
    float c = LSTM ? tape_get<Cell, HALF>(a, b, t, 4, u) : 0.0f;
    float hn, cn;
    Cell::template forward<false>(xq, hq, h, c, hn, cn, s);
    y[r * ldy + u] = hn;
    for (int p = 0; p < 4; p++)
        tape_put<Cell, HALF>(a, b, t, p, u, s[p]);
    if (t + 1 < T) {
        size_t r1 = r + 1;
        if (a.is_init[r1]) {
            hn = a.hidden ? a.hidden[(r1 * a.L + a.l) * H + u] : 0.0f;
            cn = a.cell ? a.cell[(r1 * a.L + a.l) * H + u] : 0.0f;
        }
        stepwise_put_state<Cell, HALF>(a, b, t + 1, u, hn, cn);
    } else {
        if (h_n)
            h_n[(b * a.L + a.l) * H + u] = hn;
        if (c_n)
            c_n[(b * a.L + a.l) * H + u] = cn;
    }
}

struct stepwise_bwd_args {
    int B, T, H, L, l;
    bool stored;
    const uint8_t *is_init;
    const float *z;
    int ldz;
    const float *s;
    bool sblk; // as stepwise_args
    const float *gy;
    int ldgy;
    const float *gh_n, *gc_n;
    float *d;
    float *dh, *dc;   // (B, H) carried into step t (routed)
    float *dhp, *dcp; // (B, H) gradient of the state entering step t (before routing)
    float *g_h0, *g_c0, *g_hidden, *g_cell;
};

template <class Cell, bool HALF>
static __global__ void stepwise_cell_backward_kernel(const stepwise_bwd_args a, int t) {
    constexpr int G = Cell::G, SW = Cell::SW;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= a.B * a.H)
        return;
    int H = a.H, T = a.T;
    size_t b = idx / H;
    int u = idx % H;
    size_t r = b * T + t;
    float dh_in, dc_in;
    if (t == T - 1) {
        dh_in = a.gh_n ? a.gh_n[(b * a.L + a.l) * H + u] : 0.0f;
        dc_in = a.gc_n ? a.gc_n[(b * a.L + a.l) * H + u] : 0.0f;
    } else {
        dh_in = a.dh[idx];
        dc_in = a.dc[idx];
    }
    float s[SW], d[4], tile[G], ddir, dcp;
    for (int p = 0; p < SW; p++)
        s[p] = tape_get<Cell, HALF>(a, b, t, p, u);
    float hprev = a.z[r * a.ldz + u];
    Cell::template backward<false>(s, hprev, a.gy[r * a.ldgy + u] + dh_in, dc_in, d, tile, ddir,
                                     dcp);
    for (int p = 0; p < 4; p++)
        a.d[r * (4 * H) + p * H + u] = d[p];
    a.dhp[idx] = ddir;
    a.dcp[idx] = dcp;
}

static __global__ void stepwise_route_kernel(const stepwise_bwd_args a, int t) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= a.B * a.H)
        return;
    int H = a.H, T = a.T;
    size_t b = idx / H;
    int u = idx % H;
    size_t r = b * T + t;
    bool reset = a.is_init[r] != 0;
    float dhp = a.dhp[idx], dcp = a.dcp[idx];
    if (t > 0 && !reset) {
        a.dh[idx] = dhp;
        a.dc[idx] = dcp;
        return;
    }
    if (a.stored) {
        size_t at = (r * a.L + a.l) * H + u;
        if (a.g_hidden)
            a.g_hidden[at] = dhp;
        if (a.g_cell)
            a.g_cell[at] = dcp;
    } else if (!reset) {
        size_t at = (b * a.L + a.l) * H + u;
        if (a.g_h0)
            a.g_h0[at] = dhp;
        if (a.g_c0)
            a.g_c0[at] = dcp;
    }
    a.dh[idx] = 0.0f;
    a.dc[idx] = 0.0f;
}

// grads of layer l += the GEMM result tmp (ldz rows of 4H): the x_l part to W_ih, the hprev part
// to W_hh, the constant column to the biases. D row of gate q: the same for the hidden side; for
// the GRU's input side n is the fourth plane (da_n; the third is da_n r).
static __global__ void dw_scatter_kernel(float *gw_ih, float *gw_hh, float *gb_ih, float *gb_hh,
                                         const float *tmp, int G, int H, int Il, int xoff,
                                         bool gru) {
    int cols = Il + H + 1;
    size_t n = (size_t)G * H * cols, ldt = 4 * (size_t)H;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int row = (int)(idx / cols), col = (int)(idx % cols);
        int hh = row, ih = gru && row >= 2 * H ? row + H : row;
        if (col < Il)
            gw_ih[(size_t)row * Il + col] += tmp[(size_t)(xoff + col) * ldt + ih];
        else if (col < Il + H)
            gw_hh[(size_t)row * H + col - Il] += tmp[(size_t)(col - Il) * ldt + hh];
        else {
            gb_ih[row] += tmp[(size_t)H * ldt + ih];
            gb_hh[row] += tmp[(size_t)H * ldt + hh];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward

static int stepwise_forward(struct cuda_ctx *c, const struct rnnd_model *m, const stepwise_args &a,
                            bool half, const struct layer_params &lp, const float *xg, float *hg,
                            float *y, int ldy, float *h_n, float *c_n) {
    bool lstm = m->cell == RNND_CELL_LSTM;
    int GH = rnnd_model_gates(m) * a.H, grid = CEIL_DIV(a.B * a.H, SEQ_BLOCK);
    auto init = !lstm ? &stepwise_init_kernel<cell_gru, false>
                : half ? &stepwise_init_kernel<cell_lstm, true>
                       : &stepwise_init_kernel<cell_lstm, false>;
    auto cell = !lstm ? &stepwise_cell_kernel<cell_gru, false>
                : half ? &stepwise_cell_kernel<cell_lstm, true>
                       : &stepwise_cell_kernel<cell_lstm, false>;
    init<<<grid, SEQ_BLOCK, 0, c->stream>>>(a);
    CUDA_LAUNCH_CHECK();
    for (int t = 0; t < a.T; t++) {
        // hg (B, G*H) = hprev(t) W_hh^T, hprev rows T*ldz floats apart in z.
        RNND_TRY(gemm(c, m->compute, CUBLAS_OP_T, CUBLAS_OP_N, GH, a.B, a.H, lp.w_hh, a.H,
                      a.z + (size_t)t * a.ldz, a.T * a.ldz, 0.0f, hg, GH));
        cell<<<grid, SEQ_BLOCK, 0, c->stream>>>(a, t, xg, hg, y, ldy, h_n, c_n);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

int rnnd__cuda_rnn_forward(struct cuda_ctx *c, float *out, float *h_n, float *c_n, void *tape,
                           const struct rnnd_seq *seq, const float *params,
                           const struct rnnd_model *m) {
    if (c == NULL || rnnd_seq_check(seq, m) != 0 || out == NULL || params == NULL ||
        !aligned16(tape)) // the loops copy it in bulk
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if ((c_n && !lstm) || !dims_fit(m, seq->B, seq->T))
        return RNND_EINVAL;
    int B = seq->B, T = seq->T, H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t BT = (size_t)B * T;
    bool persistent = rnnd__cuda_seq_persistent(c, m);
    const bool shalf = tape_half(c, m, B); // the tape's gate planes in fp16

    struct seq_layout lay;
    rnnd__cuda_seq_layout(c, m, B, T, &lay);
    // Per layer: the x k-steps the persistent loop fuses (0: x W_ih^T from a GEMM into xg).
    // Bench variant bit 32 turns the fusion off (docs/journal v6).
    int hp = persistent ? rnnd__persist_hp(m, c->smem_optin) : 0, xks[RNND_MAX_LAYERS];
    auto vec_of = [&](const float *o, const float *hn, const float *cn) {
        return H % 4 == 0 && aligned16(o) && aligned16(hn) && aligned16(cn) &&
               aligned16(seq->h0) && aligned16(seq->c0) && aligned16(seq->hidden) &&
               aligned16(seq->cell);
    };
    bool need_xg = false, vec = vec_of(out, h_n, c_n);
    // Layer 0's z as chunk parts (seq_zfwd, seq_cz): the backward cannot see out, h_n and c_n,
    // so where they are not aligned they go through aligned scratch, copied out at the end (with
    // a tape or without: the same loop, the same outputs).
    const bool zfwd = seq_zfwd(c, m, seq), zc0 = tape && zfwd;
    const bool czm = seq_cz(c, m, seq), cz = tape && czm, stage = (zfwd || czm) && !vec;
    // Clusters read layer 0's input only (a deeper layer's is H = 256 wide).
    // (Staged outputs are aligned.)
    int crows = seq_cluster(c, m, 0) && (vec || stage) && aligned16(seq->x)
                    ? seq_cluster_rows(c, B, false)
                    : 0;
    bool clus0 = crows > 0;
    for (int l = 0; l < L; l++) {
        xks[l] = persistent && !(c->variant & 32) ? rnnd__persist_xks(m, l, c->smem_optin) : 0;
        need_xg = need_xg || (xks[l] == 0 && !(l == 0 && clus0));
    }
    float *xg, *hg, *own, *ys, *hs, *cs;
    struct cuda_carve cv = {0};
    const size_t blh = (size_t)B * L * H * sizeof(float);
    for (int pass = 0; pass < 2; pass++) {
        xg = (float *)cuda_carve(&cv, need_xg ? BT * GH * sizeof(float) : 0);
        hg = (float *)cuda_carve(&cv, persistent ? 0 : (size_t)B * GH * sizeof(float));
        own = (float *)cuda_carve(&cv, tape ? 0 : lay.tape_floats * sizeof(float));
        ys = (float *)cuda_carve(&cv, stage ? BT * H * sizeof(float) : 0);
        hs = (float *)cuda_carve(&cv, stage && h_n ? blh : 0);
        cs = (float *)cuda_carve(&cv, stage && c_n ? blh : 0);
        if (pass == 0) {
            RNND_TRY(rnnd__cuda_reserve(c, cv.used));
            cv = (struct cuda_carve){(char *)c->d_scratch, 0};
        }
    }
    float *tp = tape ? (float *)tape : own;
    float *const out_to = out, *const h_n_to = h_n, *const c_n_to = c_n;
    if (stage) {
        out = ys, h_n = h_n ? hs : nullptr, c_n = c_n ? cs : nullptr;
        vec = vec_of(out, h_n, c_n);
    }
    const int dw_pitch = zc0 ? seq_dw16_pitch(c, B, T) : 0;

    for (int l = 0; l < L; l++) {
        const struct seq_layer_layout *ly = &lay.layer[l];
        struct layer_params lp = rnnd__cuda_layer_params(m, l, params);
        float *z = tp + ly->z_off, *s = tp + ly->s_off;
        const float *x = l == 0 ? seq->x : z + ly->xoff;
        int ldx = l == 0 ? m->I : ly->ldz;
        // The persistent loop reads the layer input itself when a thread's share of a step is
        // at most 4 values (I_l <= HP/2): for the fused projection, and to copy x into the
        // tape (layer 0); otherwise a 2D copy and a GEMM do it here.
        bool clus = l == 0 && clus0;
        bool xloop = (persistent && ly->Il <= hp / 2) || clus;
        const bool zc = l == 0 && zc0;
        bool xcopy = xloop && tape && l == 0 && !zc && !cz;
        if (tape && l == 0 && !xcopy && !zc && !cz)
            RNND_CUDA_TRY(cudaMemcpy2DAsync(z + ly->xoff, ly->ldz * sizeof(float), seq->x,
                                            m->I * sizeof(float), m->I * sizeof(float), BT,
                                            cudaMemcpyDeviceToDevice, c->stream));
        if (xks[l] == 0 && !clus)
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_T, CUBLAS_OP_N, GH, (int)BT, ly->Il, lp.w_ih,
                          ly->Il, x, ldx, 0.0f, xg, GH));
        float *y = l < L - 1 ? tp + lay.layer[l + 1].z_off + lay.layer[l + 1].xoff : out;
        int ldy = l < L - 1 ? lay.layer[l + 1].ldz : H;

        if (clus) {
            struct persist_fwd_args a = {};
            a.B = B, a.T = T, a.H = H, a.L = L, a.l = l, a.vec = vec;
            a.w_ih = lp.w_ih, a.w_hh = lp.w_hh, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.is_init = seq->is_init, a.h0 = seq->h0, a.c0 = seq->c0;
            a.hidden = seq->hidden, a.cell = seq->cell;
            a.y = y, a.ldy = ldy;
            a.z = tape ? z : nullptr, a.ldz = ly->ldz, a.xoff = ly->xoff, a.Il = ly->Il;
            a.s = tape ? s : nullptr, a.shalf = shalf;
            a.h_n = h_n, a.c_n = c_n;
            a.x = x, a.ldx = ldx, a.xvec = ldx % 4 == 0, a.xcopy = xcopy;
            if (cz) { // the chunks past the loop's (whole stages for the product) hold zeros
                const int pitch = seq_dw256_pitch(c, B, T);
                const size_t nch = (size_t)CEIL_DIV(B, 16) * T;
                char *zc = (char *)z, *aux = zc + (size_t)pitch * RNND_DW256_Z;
                RNND_CUDA_TRY(cudaMemsetAsync(zc + nch * RNND_DW256_Z, 0,
                                              (pitch - nch) * RNND_DW256_Z, c->stream));
                RNND_CUDA_TRY(cudaMemsetAsync(aux + nch * RNND_DW256_A, 0,
                                              (pitch - nch) * RNND_DW256_A, c->stream));
                a.z = nullptr, a.zc = zc, a.zc_aux = aux;
            }
            RNND_TRY(crows == 80 ? rnnd__cluster80_lstm_forward(&a, c->stream)
                                 : rnnd__cluster_lstm_forward(&a, c->stream));
        } else if (persistent) {
            struct persist_fwd_args a = {};
            a.B = B, a.T = T, a.H = H, a.L = L, a.l = l, a.vec = vec;
            a.xks = xks[l], a.xg = xks[l] ? nullptr : xg, a.w_ih = lp.w_ih;
            a.w_hh = lp.w_hh, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.is_init = seq->is_init, a.h0 = seq->h0, a.c0 = seq->c0;
            a.hidden = seq->hidden, a.cell = seq->cell;
            a.y = y, a.ldy = ldy;
            a.z = tape ? z : nullptr, a.ldz = ly->ldz, a.xoff = ly->xoff, a.Il = ly->Il;
            // The GRU's gates come from the tape where z's chunk parts do (NOTES v29).
            a.s = tape && (!seq_recompute(c, m, l) || zc) ? s : nullptr, a.shalf = shalf;
            a.h_n = h_n, a.c_n = c_n;
            a.x = xks[l] || xcopy ? x : nullptr, a.ldx = ldx;
            a.xvec = ly->Il % 4 == 0 && ldx % 4 == 0 && aligned16(x);
            a.xcopy = xcopy;
            a.variant = c->variant, a.dbg = c->d_dbg;
            // bf16: the wgmma forward for the GRU's layer 0 where it writes the chunks and planes
            // its backward reads, taped or not (zfwd does not depend on the tape: the same loop);
            // the LSTM's was slower than its mma.sync loop (NOTES v40).
            a.wg = cuda_wg(c) && (m->compute != RNND_COMPUTE_BF16 || (l == 0 && zfwd));
            if (zc) { // the chunks past the loop's (whole stages for the product) hold zeros
                const size_t nch = (size_t)CEIL_DIV(B, 16) * T;
                RNND_CUDA_TRY(cudaMemsetAsync((char *)z + nch * RNND_DW16_Z, 0,
                                              (dw_pitch - nch) * RNND_DW16_Z, c->stream));
                a.z = nullptr, a.zc = z;
                if (m->compute == RNND_COMPUTE_FP32) // x's exponents
                    a.zc_ex = (int16_t *)((char *)z + (size_t)dw_pitch * RNND_DW16_Z);
            }
            RNND_TRY(rnnd__persist_forward(m, &a, c->stream));
        } else {
            stepwise_args a = {};
            a.B = B, a.T = T, a.H = H, a.L = L, a.l = l;
            a.is_init = seq->is_init, a.h0 = seq->h0, a.c0 = seq->c0;
            a.hidden = seq->hidden, a.cell = seq->cell;
            a.z = z, a.ldz = ly->ldz, a.xoff = ly->xoff, a.Il = ly->Il, a.s = s;
            a.sblk = tape_blocked(c, m, B);
            a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            RNND_TRY(stepwise_forward(c, m, a, shalf, lp, xg, hg, y, ldy, h_n, c_n));
        }
    }
    if (stage) {
        RNND_CUDA_TRY(cudaMemcpyAsync(out_to, out, BT * H * sizeof(float),
                                      cudaMemcpyDeviceToDevice, c->stream));
        if (h_n)
            RNND_CUDA_TRY(
                cudaMemcpyAsync(h_n_to, h_n, blh, cudaMemcpyDeviceToDevice, c->stream));
        if (c_n)
            RNND_CUDA_TRY(
                cudaMemcpyAsync(c_n_to, c_n, blh, cudaMemcpyDeviceToDevice, c->stream));
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Backward

static int stepwise_backward(struct cuda_ctx *c, const struct rnnd_model *m,
                             const stepwise_bwd_args &a, bool half, const float *w_hh) {
    bool lstm = m->cell == RNND_CELL_LSTM;
    int H = a.H, grid = CEIL_DIV(a.B * H, SEQ_BLOCK), ldd = a.T * 4 * H;
    auto cell = !lstm  ? &stepwise_cell_backward_kernel<cell_gru, false>
                : half ? &stepwise_cell_backward_kernel<cell_lstm, true>
                       : &stepwise_cell_backward_kernel<cell_lstm, false>;
    for (int t = a.T - 1; t >= 0; t--) {
        cell<<<grid, SEQ_BLOCK, 0, c->stream>>>(a, t);
        CUDA_LAUNCH_CHECK();
        // dhp (B, H) += D_h(t) W_hh: D's first G planes are the hidden side's gradient.
        const float *dt = a.d + (size_t)t * 4 * H;
        RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, H, a.B, (lstm ? 4 : 3) * H, w_hh, H,
                      dt, ldd, 1.0f, a.dhp, H));
        stepwise_route_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(a, t);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

int rnnd__cuda_rnn_backward(struct cuda_ctx *c, const struct rnnd_seq_grads *grads,
                            const float *grad_out, const float *grad_h_n, const float *grad_c_n,
                            const void *tape, const struct rnnd_seq *seq, const float *params,
                            const struct rnnd_model *m) {
    if (c == NULL || rnnd_seq_check(seq, m) != 0 || grads == NULL || grads->params == NULL ||
        grad_out == NULL || tape == NULL || !aligned16(tape) || params == NULL)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (!lstm && (grad_c_n || grads->c0 || grads->cell))
        return RNND_EINVAL;
    if ((grads->hidden && !seq->hidden) || (grads->cell && !seq->cell))
        return RNND_EINVAL;
    if (!dims_fit(m, seq->B, seq->T))
        return RNND_EINVAL;
    int B = seq->B, T = seq->T, H = m->H, L = m->L, G = rnnd_model_gates(m), GH = G * H;
    size_t BT = (size_t)B * T;
    bool persistent = rnnd__cuda_seq_persistent(c, m);

    struct seq_layout lay;
    rnnd__cuda_seq_layout(c, m, B, T, &lay);
    int max_ldz = 0;
    for (int l = 0; l < L; l++)
        max_ldz = lay.layer[l].ldz > max_ldz ? lay.layer[l].ldz : max_ldz;
    bool vec = H % 4 == 0 && aligned16(grad_out) && aligned16(grad_h_n) &&
               aligned16(grad_c_n) && aligned16(grads->h0) && aligned16(grads->c0) &&
               aligned16(grads->hidden) && aligned16(grads->cell);
    // Layer 0 alone: the layers above have I_l = H, more than the chunks hold.
    // With layer 0's z in the tape as chunk parts (seq_zfwd), whatever the gradients' alignment.
    const bool zc = seq_zfwd(c, m, seq);
    const bool dw16 = zc || seq_dw16(c, m, 0, vec);
    const bool dw_exp = dw16 && m->compute == RNND_COMPUTE_FP32; // fp16 chunks, their records
    const int dw_ks = c->num_sms / 4, dw_pitch = seq_dw16_pitch(c, B, T);
    const size_t dw_bytes = (size_t)dw_pitch * (4 * RNND_DW16_D + (zc ? 0 : RNND_DW16_Z));
    size_t d_bytes = BT * 4 * H * sizeof(float);
    if (dw16 && dw_bytes > d_bytes)
        d_bytes = dw_bytes;
    // Layer 0's dw256 chunks (seq_cz) are read by the cluster loop alone: misaligned gradients go
    // through aligned scratch (gs: the gradients the loops write; copied out at the end).
    const bool cz = seq_cz(c, m, seq), gstage = cz && !vec;
    const int cz_ks = seq_dw256_ks(c), cz_pitch = cz ? seq_dw256_pitch(c, B, T) : 0;
    const size_t blh = (size_t)B * L * H * sizeof(float);
    struct rnnd_seq_grads gs = *grads;
    float *d, *gyb, *tmp, *dh, *dc, *dhp, *dcp, *dw_part, *cz_part, *sgo, *shn, *scn;
    int16_t *dw_rec, *cz_rec;
    char *cz_d;
    unsigned *cz_ready;
    struct cuda_carve cv = {0};
    size_t bh = persistent ? 0 : (size_t)B * H * sizeof(float);
    for (int pass = 0; pass < 2; pass++) {
        auto staged = [&](const void *p, size_t n) { // a scratch copy of p where staged
            float *q = (float *)cuda_carve(&cv, gstage && p ? n : 0);
            return gstage && p ? q : nullptr;
        };
        sgo = staged(grad_out, BT * H * sizeof(float));
        shn = staged(grad_h_n, blh);
        scn = staged(grad_c_n, blh);
        gs.h0 = staged(grads->h0, blh);
        gs.c0 = staged(grads->c0, blh);
        gs.hidden = staged(grads->hidden, blh * T);
        gs.cell = staged(grads->cell, blh * T);
        d = (float *)cuda_carve(&cv, d_bytes);
        dw_part = (float *)cuda_carve(
            &cv, dw16 ? (size_t)dw_ks * 4 * H * RNND_DW16_NZ * sizeof(float) : 0);
        dw_rec = (int16_t *)cuda_carve(&cv, dw_exp ? (size_t)dw_pitch * RNND_DW16_E : 0);
        cz_d = (char *)cuda_carve(&cv, (size_t)cz_pitch * 8 * RNND_DW16_D);
        cz_rec = (int16_t *)cuda_carve(&cv, (size_t)cz_pitch * 4 * 16 * sizeof(int16_t));
        cz_part = (float *)cuda_carve(
            &cv, cz ? (size_t)cz_ks * 4 * H * RNND_DW256_NZ * sizeof(float) : 0);
        cz_ready = (unsigned *)cuda_carve(&cv, cz ? (size_t)T * sizeof(unsigned) : 0);
        gyb = (float *)cuda_carve(&cv, L > 1 ? BT * H * sizeof(float) : 0);
        tmp = (float *)cuda_carve(&cv, (size_t)4 * H * max_ldz * sizeof(float));
        dh = (float *)cuda_carve(&cv, bh);
        dc = (float *)cuda_carve(&cv, bh);
        dhp = (float *)cuda_carve(&cv, bh);
        dcp = (float *)cuda_carve(&cv, bh);
        if (pass == 0) {
            RNND_TRY(rnnd__cuda_reserve(c, cv.used));
            cv = (struct cuda_carve){(char *)c->d_scratch, 0};
        }
    }
    if (gstage) {
        const float **in[3] = {&grad_out, &grad_h_n, &grad_c_n};
        float *to[3] = {sgo, shn, scn};
        for (int k = 0; k < 3; k++)
            if (*in[k]) {
                RNND_CUDA_TRY(cudaMemcpyAsync(to[k], *in[k], k ? blh : BT * H * sizeof(float),
                                              cudaMemcpyDeviceToDevice, c->stream));
                *in[k] = to[k];
            }
        vec = H % 4 == 0;
    } else {
        gs = *grads;
    }
    const int brows = vec ? seq_cluster_bwd(c, m, B) : 0; // rows a cluster of the backward, or 0

    // Outputs written only where a value was used start at zero.
    if (gs.h0)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.h0, 0, blh, c->stream));
    if (gs.c0)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.c0, 0, blh, c->stream));
    if (gs.hidden)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.hidden, 0, blh * T, c->stream));
    if (gs.cell)
        RNND_CUDA_TRY(cudaMemsetAsync(gs.cell, 0, blh * T, c->stream));

    const float *tp = (const float *)tape;
    const bool shalf = tape_half(c, m, B); // as the forward

    for (int l = L - 1; l >= 0; l--) {
        const struct seq_layer_layout *ly = &lay.layer[l];
        struct layer_params lp = rnnd__cuda_layer_params(m, l, params);
        const float *z = tp + ly->z_off, *s = tp + ly->s_off;
        const float *gy = l == L - 1 ? grad_out : gyb;

        // The time loop's arguments (the persistent loops and the clusters).
        struct persist_bwd_args a = {};
        a.B = B, a.T = T, a.H = H, a.L = L, a.l = l, a.vec = vec;
        a.stored = seq->hidden != NULL;
        a.w_hh = lp.w_hh, a.is_init = seq->is_init;
        a.z = z, a.ldz = ly->ldz, a.s = s, a.shalf = shalf;
        a.gy = gy, a.ldgy = H;
        a.gh_n = grad_h_n, a.gc_n = grad_c_n, a.d = d;
        a.g_h0 = gs.h0, a.g_c0 = gs.c0;
        a.g_hidden = gs.hidden, a.g_cell = gs.cell;
        float *dx = l > 0 ? gyb : grads->x; // dL/dx_l: the layer below's gy, or grads->x
        const bool c256 = cz && l == 0; // (the loop runs in clusters: brows > 0)
        if (c256) {
            // The chunks past the loop's (whole stages for the product): zeros, records
            // RNND_DW16_EZERO; D in fp32 only for dL/dx.
            size_t nch = (size_t)CEIL_DIV(B, 16) * T, pad = cz_pitch - nch;
            RNND_CUDA_TRY(cudaMemset2DAsync(cz_d + nch * RNND_DW16_D, cz_pitch * RNND_DW16_D, 0,
                                            pad * RNND_DW16_D, 8, c->stream));
            RNND_CUDA_TRY(cudaMemset2DAsync(cz_rec + nch * 16, cz_pitch * 32, 0x80, pad * 32, 4,
                                            c->stream));
            RNND_CUDA_TRY(cudaMemsetAsync(cz_ready, 0, (size_t)T * sizeof(unsigned), c->stream));
            a.dw16 = cz_d, a.dw16_pitch = cz_pitch, a.dw16_exp = cz_rec, a.dw16_ready = cz_ready;
            a.d = dx ? d : nullptr;
        }
        if (brows > 0) {
            RNND_TRY(brows == 80 ? rnnd__cluster80_lstm_backward(&a, c->stream)
                                 : rnnd__cluster_lstm_backward(&a, c->stream));
        } else if (persistent) {
            a.rc = seq_recompute(c, m, l);
            if (dw16 && l == 0) {
                // The chunks past the loop's (whole stages for the product) hold zeros.
                size_t nch = (size_t)CEIL_DIV(B, 16) * T, pad = dw_pitch - nch;
                char *base = (char *)d;
                if (pad > 0) // D's four planes at once
                    RNND_CUDA_TRY(cudaMemset2DAsync(base + nch * RNND_DW16_D,
                                                    dw_pitch * RNND_DW16_D, 0, pad * RNND_DW16_D,
                                                    4, c->stream));
                if (zc) { // the forward's, and its padding
                    a.zc = z;
                    if (dw_exp) // x's exponents
                        a.zc_ex = (const int16_t *)((const char *)z +
                                                    (size_t)dw_pitch * RNND_DW16_Z);
                } else
                    RNND_CUDA_TRY(cudaMemsetAsync(base + 4 * dw_pitch * RNND_DW16_D +
                                                      nch * RNND_DW16_Z,
                                                  0, pad * RNND_DW16_Z, c->stream));
                if (dw_exp) // RNND_DW16_EZERO and less in every field
                    RNND_CUDA_TRY(cudaMemsetAsync((char *)dw_rec + nch * RNND_DW16_E, 0x80,
                                                  pad * RNND_DW16_E, c->stream));
                a.dw16 = d, a.dw16_pitch = dw_pitch, a.dw16_exp = dw_exp ? dw_rec : nullptr;
            }
            a.w_ih = lp.w_ih, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
            a.h0 = seq->h0, a.hidden = seq->hidden;
            a.xoff = ly->xoff, a.Il = ly->Il;
            a.variant = c->variant, a.dbg = c->d_dbg ? c->d_dbg + 1024 * 8 : nullptr;
            RNND_TRY(rnnd__persist_backward(m, &a, c->stream));
        } else {
            stepwise_bwd_args sw = {};
            sw.B = B, sw.T = T, sw.H = H, sw.L = L, sw.l = l;
            sw.stored = a.stored, sw.is_init = a.is_init;
            sw.z = z, sw.ldz = ly->ldz, sw.s = s, sw.sblk = tape_blocked(c, m, B);
            sw.gy = gy, sw.ldgy = H;
            sw.gh_n = grad_h_n, sw.gc_n = grad_c_n, sw.d = d;
            sw.dh = dh, sw.dc = dc, sw.dhp = dhp, sw.dcp = dcp;
            sw.g_h0 = gs.h0, sw.g_c0 = gs.c0;
            sw.g_hidden = gs.hidden, sw.g_cell = gs.cell;
            RNND_TRY(stepwise_backward(c, m, sw, shalf, lp.w_hh));
        }

        // [dW_ih | dW_hh | db] (ldz rows of 4H) = z^T D over every row and step, added into
        // the gradients. With D's 4H columns as cuBLAS's M, fwd+bwd is 0.6 ms faster at H = 256
        // (0.02-0.03 ms at H = 128) than with z's ldz columns as M (NOTES v20). Where the loop
        // wrote dw16 chunks, our product on them, which adds its sums in place (NOTES v25, v27).
        struct layer_params gp = rnnd__cuda_layer_params(m, l, grads->params);
        float *gw_ih = (float *)gp.w_ih, *gw_hh = (float *)gp.w_hh;
        float *gb_ih = (float *)gp.b_ih, *gb_hh = (float *)gp.b_hh;
#ifdef RNND_HAVE_WG
        if (c256) {
            const char *zc = (const char *)z;
            struct dw16_args dw = {cz_d,   zc,    cz_pitch, cz_ks, H,     ly->Il, false,
                                   cz_part, cz_rec, gw_ih, gw_hh, gb_ih, gb_hh};
            // Right after the loop, beside it (seq_persist.h, dw256_sync).
            const struct dw256_sync sy = {cz_ready, CEIL_DIV(B, 16), T,
                                          (unsigned)(CEIL_DIV(B, brows) * 4)};
            RNND_TRY(
                rnnd__dw256_product(&dw, zc + (size_t)cz_pitch * RNND_DW256_Z, &sy, c->stream));
        } else if (a.dw16) {
            const char *dloop = (const char *)d + 4 * (size_t)dw_pitch * RNND_DW16_D;
            const void *dz = zc ? (const void *)z : (const void *)dloop; // z's parts
            struct dw16_args dw = {d,      dz,    dw_pitch, dw_ks, H,     ly->Il, !lstm,
                                   dw_part, a.dw16_exp, gw_ih, gw_hh, gb_ih, gb_hh};
            RNND_TRY(rnnd__dw16_product(&dw, c->stream));
        } else
#endif
        {
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_T, 4 * H, ly->ldz, (int)BT, d,
                          4 * H, z, ly->ldz, 0.0f, tmp, 4 * H));
            size_t n = (size_t)GH * (ly->Il + H + 1);
            int grid = (int)(CEIL_DIV(n, (size_t)SEQ_BLOCK) < 4096 ? CEIL_DIV(n, (size_t)SEQ_BLOCK)
                                                                    : 4096);
            dw_scatter_kernel<<<grid, SEQ_BLOCK, 0, c->stream>>>(gw_ih, gw_hh, gb_ih, gb_hh, tmp,
                                                                 G, H, ly->Il, ly->xoff, !lstm);
            CUDA_LAUNCH_CHECK();
        }

        // dx_l (B*T, I_l) = D_x W_ih: the layer below's output gradient, or grads->x. The GRU's
        // input-side planes are r, z (D's first two) and n (D's fourth).
#ifdef RNND_HAVE_WG
        if (dx && a.dw16 && !c256) { // from the loop's dw16 chunks (NOTES v25f)
            struct dx16_args dxa = {d,      dw_pitch, CEIL_DIV(B, 16) * T, lstm ? 4 : 3,
                                    c->num_sms, H,  ly->Il, B, T, lp.w_ih, dx, a.dw16_exp};
            RNND_TRY(rnnd__dx16_product(&dxa, c->stream));
        } else
#endif
        if (dx && lstm) {
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, ly->Il, (int)BT, GH, lp.w_ih,
                          ly->Il, d, 4 * H, 0.0f, dx, ly->Il));
        } else if (dx) {
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, ly->Il, (int)BT, 2 * H, lp.w_ih,
                          ly->Il, d, 4 * H, 0.0f, dx, ly->Il));
            RNND_TRY(gemm(c, m->compute, CUBLAS_OP_N, CUBLAS_OP_N, ly->Il, (int)BT, H,
                          lp.w_ih + (size_t)2 * H * ly->Il, ly->Il, d + 3 * H, 4 * H, 1.0f, dx,
                          ly->Il));
        }
    }
    if (gstage) {
        float *out[4] = {grads->h0, grads->c0, grads->hidden, grads->cell};
        const float *from[4] = {gs.h0, gs.c0, gs.hidden, gs.cell};
        for (int k = 0; k < 4; k++)
            if (out[k])
                RNND_CUDA_TRY(cudaMemcpyAsync(out[k], from[k], k < 2 ? blh : blh * T,
                                              cudaMemcpyDeviceToDevice, c->stream));
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Dispatch to the persistent kernels

static long persist_smem_of(const struct rnnd_model *m, bool backward, int HP, int xks) {
    bool bf16 = m->compute == RNND_COMPUTE_BF16;
    return m->cell == RNND_CELL_LSTM ? rnnd__persist_lstm_smem(backward, bf16, HP, xks)
                                     : rnnd__persist_gru_smem(backward, bf16, HP, xks);
}

int rnnd__persist_hp(const struct rnnd_model *m, size_t smem_optin) {
    if (m->compute == RNND_COMPUTE_IEEE || m->H > 128)
        return 0;
    int HP = m->H <= 32 ? 32 : m->H <= 64 ? 64 : m->H <= 96 ? 96 : 128;
    for (int bwd = 0; bwd < 2; bwd++) {
        long need = persist_smem_of(m, bwd, HP, 0);
        if (need < 0 || (size_t)need > smem_optin)
            return 0;
    }
    return HP;
}

int rnnd__persist_xks(const struct rnnd_model *m, int l, size_t smem_optin) {
    int HP = rnnd__persist_hp(m, smem_optin), Il = rnnd_model_layer_input(m, l);
    if (HP == 0 || Il > HP / 2)
        return 0;
    int xks = CEIL_DIV(Il, m->compute == RNND_COMPUTE_BF16 ? 16 : 8);
    long need = persist_smem_of(m, false, HP, xks);
    return need > 0 && (size_t)need <= smem_optin ? xks : 0;
}

static int persist_dispatch(const struct rnnd_model *m, bool backward, const void *a,
                            cudaStream_t stream) {
    int HP = m->H <= 32 ? 32 : m->H <= 64 ? 64 : m->H <= 96 ? 96 : 128;
    bool bf16 = m->compute == RNND_COMPUTE_BF16;
    return m->cell == RNND_CELL_LSTM ? rnnd__persist_lstm(backward, bf16, HP, a, stream)
                                     : rnnd__persist_gru(backward, bf16, HP, a, stream);
}

int rnnd__persist_forward(const struct rnnd_model *m, const struct persist_fwd_args *a,
                          cudaStream_t stream) {
    if (a->s && !a->shalf)
        return RNND_EINVAL;
#ifdef RNND_HAVE_WG
    if (a->wg && m->H > 96) {
        // The wgmma loops (seq_wg.cu) where their arguments allow it, else the persistent ones
        // (which write no z chunk parts).
        const bool bf16 = m->compute == RNND_COMPUTE_BF16;
        int err = m->cell == RNND_CELL_GRU ? rnnd__wg_gru_forward(a, bf16, stream)
                  : bf16                   ? RNND_ENOTSUP // no bf16 LSTM loop there (NOTES v40)
                                           : rnnd__wg_lstm_forward(a, stream);
        if (err != RNND_ENOTSUP || a->zc)
            return err;
    }
#endif
    if (a->zc)
        return RNND_EINVAL;
    return persist_dispatch(m, false, a, stream);
}

int rnnd__persist_backward(const struct rnnd_model *m, const struct persist_bwd_args *a,
                           cudaStream_t stream) {
    if (!a->shalf)
        return RNND_EINVAL;
    return persist_dispatch(m, true, a, stream);
}
