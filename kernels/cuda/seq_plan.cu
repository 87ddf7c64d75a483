/*
 * seq_plan.cu: rnnd__seq_plan, the one chooser of the sequence kernels (seq_plan.h), and the
 * plan's name. Host code only. Every rule says why it holds; docs/kernels.md has the measurements
 * behind them and the table of what runs where.
 */
#include "seq_plan.h"

#include "common.cuh"
#include "seq_loops.h"

#include <stdio.h>
#include <string.h>

// The H = 256 backward in clusters from this many rows: the blocked tape (tape_b8) of B rows,
// rounded up to 8 rows of 3H floats, fits the layout's B rows of 4H (the GRU's; the LSTM's 5H;
// seq.cu, rnnd__cuda_seq_layout) from 21 rows on. It is faster than the per-step backward from
// there (H200, T = 256: at B = 32 fwd+bwd 2.92 ms against 4.03 for the GRU, 3.16 against 4.49
// for the LSTM; docs/benchmarks.md).
#define SEQ_CLUSTER_BWD_MIN_ROWS 21
static_assert((SEQ_CLUSTER_BWD_MIN_ROWS + 7) * 3 <= SEQ_CLUSTER_BWD_MIN_ROWS * 4,
              "B + 7 rows of 3H floats within B rows of 4H");

// A layer of 64 <= H <= 96 runs the loops of H = 128 from this many rows (GRU, LSTM). H200,
// T = 256, H = 64, fp32 fwd+bwd ms in H = 128's loops against its own width's: GRU 1.20 / 1.12 at
// B = 512, 1.19 / 1.19-1.21 at 768, 1.22 / 1.28 at 1024, 1.30 / 1.67 at 2048; LSTM 1.46 / 1.20
// at 512, 1.49 / 1.37 at 1024, 1.51 / 1.57 at 1536, 1.56 / 1.81 at 2048. The wider loops' step
// is longer, and only a large batch gains more from the fused input projection and the dw16
// products than it loses there. H <= 64 leaves the padding's half out of the loops (HU = 64) and
// pays from fewer rows (H200, 60c2265, T = 256, against its own width in one call: GRU 0.99 / 1.02
// at B = 256, 1.00 / 1.12 at 512, 1.02 / 1.28 at 1024; LSTM 1.26 / 1.20 at 512, 1.27 / 1.28 at
// 768, 1.28 / 1.37 at 1024; at T = 64 B = 256 both lose, 0.30 / 0.28 and 0.36 / 0.30).
#define SEQ_PAD128_GRU_ROWS     1024
#define SEQ_PAD128_LSTM_ROWS    1536
#define SEQ_PAD128_GRU_ROWS_64  512
#define SEQ_PAD128_LSTM_ROWS_64 1024

// A layer whose backward loop writes the dw16 chunks' z parts itself, x 128 wide (above layer
// 0, or layer 0 with 64 < I <= 128; H = 128), takes them from this many rows (GRU, LSTM). H200,
// two layers, fp32 fwd+bwd ms at T = 64 / 256 against cuBLAS's products on D in fp32: GRU 1.02-1.04
// / 3.36 against 1.02 / 3.43 at B = 1024, 1.08 / 3.52 against 1.12-1.13 / 3.76 at 1536, 1.13 /
// 3.71-3.73 against 1.27 / 4.13-4.17 at 2048; LSTM 1.23-1.24 / 4.10 against 1.18 / 4.07 at 1024,
// 1.30-1.32 / 4.40 against 1.28-1.29 / 4.47 at 1536, 1.41 / 4.80 against 1.44 / 5.00-5.04 at 2048.
// The loop moves more bytes a step (z's rows in, its chunks out), which costs a small batch's
// latency-bound steps more than the products save (docs/kernels.md). The GRU's loop writes them
// only where its forward could not (inputs off 16-byte alignment).
#define SEQ_DW16_LOOP_Z_GRU_ROWS  1536
#define SEQ_DW16_LOOP_Z_LSTM_ROWS 2048

// The GRU's wgmma forward fuses x 64 < I_l <= 128 wide from this many rows. H200, H = 128, two
// layers (layer 1's I_l = 128), fp32 fwd+bwd ms against the mma.sync forward on cuBLAS's x W_ih^T:
// 0.875-0.879 / 0.855-0.857 at B = 256 (T = 64), 3.23-3.24 / 3.24-3.25 at 512, 3.41-3.45 /
// 3.54-3.57 at 1024, 4.10-4.13 / 4.52-4.55 at 2048 (T = 256): the fused x part's producer, twice
// as long, costs the small batch more than the product through memory does.
#define SEQ_WIDE_X_MIN_ROWS 512

static int hp_of(int H) {
    return H <= 32 ? 32 : H <= 64 ? 64 : H <= 96 ? 96 : 128;
}

static long persist_smem_of(const struct rnnd_model *m, bool backward, int HP, int xks) {
    bool bf16 = m->compute == RNND_COMPUTE_BF16;
    return m->cell == RNND_CELL_LSTM ? rnnd__persist_lstm_smem(backward, bf16, HP, xks)
                                     : rnnd__persist_gru_smem(backward, bf16, HP, xks);
}

// Whether both directions' loops at width HP fit smem_optin bytes.
static bool persist_fits(const struct rnnd_model *m, int HP, size_t smem_optin) {
    for (int bwd = 0; bwd < 2; bwd++) {
        long need = persist_smem_of(m, bwd, HP, 0);
        if (need < 0 || (size_t)need > smem_optin)
            return false;
    }
    return true;
}

int rnnd__seq_persist_hp(const struct rnnd_model *m, size_t smem_optin) {
    if (m->compute == RNND_COMPUTE_IEEE || m->H > 128)
        return 0;
    int HP = hp_of(m->H);
    return persist_fits(m, HP, smem_optin) ? HP : 0;
}

// x k-steps the persistent forward of layer l fuses: its input projection runs in the loop where
// a thread's share of a step's x is at most 4 values (I_l <= HP/2) and the weights fit.
static int persist_xks(const struct rnnd_model *m, int l, int HP, size_t smem_optin) {
    int Il = rnnd_model_layer_input(m, l);
    if (HP == 0 || Il > HP / 2)
        return 0;
    int xks = CEIL_DIV(Il, m->compute == RNND_COMPUTE_BF16 ? 16 : 8);
    long need = persist_smem_of(m, false, HP, xks);
    return need > 0 && (size_t)need <= smem_optin ? xks : 0;
}

void rnnd__seq_plan(const struct seq_device *dev, const struct cuda_tuning *tune,
                    const struct rnnd_model *m, const struct seq_call *call, struct seq_plan *p) {
    memset(p, 0, sizeof(*p));
    const bool gru = m->cell == RNND_CELL_GRU, lstm = !gru;
    const bool fp32 = m->compute == RNND_COMPUTE_FP32, bf16 = m->compute == RNND_COMPUTE_BF16;
    const int H = m->H, I = m->I, L = m->L, B = call->B;

    // The persistent loops: the tensor-core modes at H <= 128, where both directions fit the
    // device's shared memory. Elsewhere the per-step path (and the clusters, below).
    p->HP = tune->stepwise ? 0 : rnnd__seq_persist_hp(m, dev->smem_optin);
    // A layer of 64 <= H <= 96 (H % 4 == 0, layer 0's I <= 64) runs the loops of H = 128 on the
    // warpgroup MMAs and the dw16 products from SEQ_PAD128_*_ROWS rows, its units from H on
    // zero: their weights, biases and states are read as zeros, so are their outputs, and every
    // write is bounded by H. Its own width's mma.sync loops take x W_ih^T and the weight
    // gradients from cuBLAS, and at B = 2048 ran slower than H = 128 itself.
    const int pad_rows = H <= 64 ? (gru ? SEQ_PAD128_GRU_ROWS_64 : SEQ_PAD128_LSTM_ROWS_64)
                                 : (gru ? SEQ_PAD128_GRU_ROWS : SEQ_PAD128_LSTM_ROWS);
    if (p->HP > 0 && p->HP < 128 && H >= 64 && H % 4 == 0 && I <= 64 && I % 4 == 0 &&
        B >= pad_rows && dev->wg && !tune->no_wg && !tune->no_pad128 &&
        persist_fits(m, 128, dev->smem_optin))
        p->HP = 128;
    p->persistent = p->HP > 0;
    const int HP = p->HP;

    // The H = 256 loops in thread-block clusters (sm_90) in TF32 and bf16 modes (the loops' scaled
    // fp16 operands are as exact as TF32: bf16 mode gets more than it asks for, and the per-step
    // path's bf16 GEMMs were 1.6x slower at B = 256). The forward's clusters read the layer input
    // themselves: layer 0 with I <= 64, I % 4 == 0 (a deeper layer's is 256).
    const bool cl_model = !tune->stepwise && !tune->no_cluster && dev->cc_major >= 9 && H == 256 &&
                          m->compute != RNND_COMPUTE_IEEE;
    const bool cl0 = cl_model && I <= 64 && I % 4 == 0;
    // Rows a cluster: 64, or 80 where that takes fewer waves (an H100 runs 30 clusters of either:
    // B = 2048 is two waves of 64-row clusters, one of 80-row ones; a wave costs a whole loop).
    // At equal waves 64, whose steps are faster (the 80-row loops single-buffer their tiles).
    auto cluster_rows = [&](bool backward) {
        const int a64 = dev->cluster_active[0][backward], a80 = dev->cluster_active[1][backward];
        if (a80 > 0 && tune->cluster80)
            return 80;
        if (a64 <= 0 || a80 <= 0)
            return a64 > 0 ? 64 : a80 > 0 ? 80 : 0;
        return CEIL_DIV(CEIL_DIV(B, 80), a80) < CEIL_DIV(CEIL_DIV(B, 64), a64) ? 80 : 64;
    };
    // The backward in clusters (any layer: it reads the tape) where the batch runs in one wave
    // and has SEQ_CLUSTER_BWD_MIN_ROWS rows or more; 0: the per-step backward.
    int brows = 0;
    if (cl_model && !tune->no_cluster_bwd && B >= SEQ_CLUSTER_BWD_MIN_ROWS) {
        const int rows = cluster_rows(true);
        const int active = dev->cluster_active[rows == 80][1];
        brows = rows > 0 && CEIL_DIV(B, rows) <= active ? rows : 0;
    }

    // The tape. Its gate planes are fp16 where the backward runs in the persistent or the cluster
    // loops, which take nothing else: the LSTM's 12 bytes an element instead of 20 each way, the
    // GRU's 8 instead of 16. The per-step path keeps fp32: its TF32 GEMMs leave no room under the
    // 1e-3 bound for one more rounding (an LSTM H = 256, B = 33 case measured 9.6e-4 with fp32
    // planes and 1.0e-3 with fp16 ones). The cluster backward reads its record in tape_b8's
    // blocks of 8 rows (one 16-byte and one 8-byte access a row for the cluster loops; the GRU's
    // fp32 plane holds hprev).
    p->tape_blocked = brows > 0;
    p->tape_half = p->persistent || p->tape_blocked;

    // The GRU at HP = 128 has its own backward loop (one 16-bit W_hh for both directions) that
    // recomputes each step's gates from hprev and x_l (the z rows, x_l at most 64 wide, I_l % 4
    // == 0) instead of reading them from the tape; the forward then writes no gate planes.
    auto recompute = [&](int l) {
        const int Il = rnnd_model_layer_input(m, l);
        if (!p->persistent || tune->no_recompute || !gru || HP != 128 || H % 4 != 0)
            return false;
        long need = rnnd__gru_h128_backward_smem(bf16, 128);
        return Il <= 64 && Il % 4 == 0 && need > 0 && (size_t)need <= dev->smem_optin;
    };
    // A layer's weight gradients and dL/dx from seq_dw.cu's products on 16-bit chunks instead
    // of D in fp32 (compute 9.0, bf16 or TF32 mode, vector access, the persistent loops at
    // HP = 128): layer 0 with I <= 64 (the GRU's own backward, the LSTM's), and H = 128 with
    // I_l <= 128 (x 128 wide) from `rows` rows.
    auto dw16 = [&](int l, bool vec, int rows) {
        const int Il = rnnd_model_layer_input(m, l);
        if (!dev->wg || tune->no_dw16 || m->compute == RNND_COMPUTE_IEEE || !vec ||
            !p->persistent || HP != 128 || H % 4 != 0)
            return false;
        if (l == 0 && Il <= 64)
            return lstm || recompute(0);
        return H == 128 && Il <= 128 && B >= rows;
    };
    // Where the mma.sync backward writes z's chunk parts itself (x 128 wide): from
    // SEQ_DW16_LOOP_Z_*_ROWS rows.
    const int loop_z_rows = gru ? SEQ_DW16_LOOP_Z_GRU_ROWS : SEQ_DW16_LOOP_Z_LSTM_ROWS;
    // A layer's z leaves the wgmma forward as the dw16 chunks' z parts (TF32 mode, or the GRU's
    // bf16) instead of z rows: x at most 64 wide (layer 0), or the GRU's x fused up to 128 wide
    // (H = 128, I_l <= 128: layers above 0) wherever that forward runs (SEQ_WIDE_X_MIN_ROWS);
    // the LSTM's above layer 0 leaves its mma.sync forward so in TF32 mode (x, the layer below's
    // h, scaled by its bound), where the chunks run (SEQ_DW16_LOOP_Z_LSTM_ROWS).
    // The backward then reads them (the GRU: also the gate planes, and recomputes nothing). The
    // loop writing z's parts itself read z's rows and ran 1.03 ms a layer at B = 2048 T = 256
    // against the gate planes' 0.62; on the forward's parts the chunks gain at every batch the
    // wide forward runs (H200, two layers, T = 256, fp32 fwd+bwd ms against cuBLAS's products on
    // D in fp32: 2.84-2.86 / 3.23-3.25 at B = 512, 2.91-2.92 / 3.43 at 1024). Sized by the model
    // and the device; the format also needs aligned inputs, which both passes see.
    const bool inputs = call->x_aligned && call->states_aligned;
    for (int l = 0; l < L; l++) {
        const int Il = rnnd_model_layer_input(m, l);
        p->z_dw16[l] = (fp32 || (bf16 && gru)) && HP == 128 && dev->wg && !tune->no_wg &&
                       !tune->no_fused_x && !tune->no_zfwd && Il % 4 == 0 &&
                       dw16(l, true, SEQ_WIDE_X_MIN_ROWS) &&
                       (Il <= 64 ? persist_xks(m, l, HP, dev->smem_optin) > 0
                                 : gru || (l > 0 && B >= SEQ_DW16_LOOP_Z_LSTM_ROWS));
        p->zfwd[l] = p->z_dw16[l] && inputs;
    }
    // Layer 0 of an LSTM H = 256 whose loops both run in clusters keeps z as dw256 chunk parts,
    // for seq_dw.cu's product instead of cuBLAS's (compute 9.0).
    p->z_dw256 = dev->wg && !tune->no_dw16 && cl0 && p->tape_blocked && cluster_rows(false) > 0;
    p->cz = p->z_dw256 && inputs;
    p->phase_clocks = tune->phase_clocks;

    if (!call->backward) {
        // Misaligned outputs of a chunk-writing forward go through aligned scratch (the backward
        // cannot see them), with a tape or without: the same loop, the same outputs.
        p->vec = H % 4 == 0 && call->outs_aligned && call->states_aligned;
        bool zfwd = p->cz;
        for (int l = 0; l < L; l++)
            zfwd = zfwd || p->zfwd[l];
        p->stage = zfwd && !p->vec;
        if (p->stage)
            p->vec = H % 4 == 0 && call->states_aligned;
        p->rows = cl0 && p->vec && call->x_aligned ? cluster_rows(false) : 0;
        for (int l = 0; l < L; l++) {
            struct seq_layer_plan *y = &p->layer[l];
            const int Il = rnnd_model_layer_input(m, l);
            // The layer input's rows as 16-byte vectors: x (l = 0), or the tape's z rows.
            const bool xvec = l == 0 ? I % 4 == 0 && call->x_aligned : Il % 4 == 0;
            if (l == 0 && p->rows > 0) {
                y->fwd = SEQ_FWD_CLUSTER;
                y->xloop = true;
                y->z_chunks = call->tape && p->cz;
                continue;
            }
            if (!p->persistent) {
                y->fwd = SEQ_FWD_STEPWISE;
                continue;
            }
            y->xks = tune->no_fused_x ? 0 : persist_xks(m, l, HP, dev->smem_optin);
            y->xloop = Il <= HP / 2;
            y->z_chunks = p->zfwd[l] && call->tape;
            // Where the backward recomputes the gates the forward writes none, unless they go
            // with z's chunk parts.
            y->gates = call->tape && (!recompute(l) || y->z_chunks);
            // The wgmma forward (HP = 128, H % 4 == 0, fused x at most 64 wide, vector access)
            // in TF32 mode; in bf16 the GRU's layer 0 only where it writes the chunks and planes
            // its backward reads (zfwd does not depend on the tape: the same loop), and the
            // LSTM's at H <= 64, where it leaves the padding's half out (at H = 128 the LSTM's
            // bf16 mma.sync loop is the faster). The GRU's writes its gate planes only with the
            // chunk parts.
            const bool wg = dev->wg && !tune->no_wg && (!bf16 || p->zfwd[l] || (lstm && H <= 64));
            if (wg && HP == 128 && H % 4 == 0 && y->xks > 0 && p->vec && xvec &&
                (lstm || !y->gates || y->z_chunks)) {
                y->fwd = SEQ_FWD_WGMMA;
                continue;
            }
            // The GRU's x part is fused up to 128 columns wide (seq_wg.cu's W_ih tiles fit beside
            // its three gates' W_hh in registers, not the LSTM's) from SEQ_WIDE_X_MIN_ROWS rows,
            // in either mode: a deeper layer at H = 128, whose backward reads the gate planes
            // this loop then writes.
            if (dev->wg && !tune->no_wg && gru && HP == 128 && H % 4 == 0 && Il > HP / 2 &&
                Il <= HP && B >= SEQ_WIDE_X_MIN_ROWS && !tune->no_fused_x && p->vec && xvec) {
                y->xks = CEIL_DIV(Il, 8);
                y->xloop = true;
                y->fwd = SEQ_FWD_WGMMA;
                continue;
            }
            // The GRU's fused TF32 loop at HP = 128 with vector access: K split over warp pairs.
            y->fwd =
                gru && fp32 && HP == 128 && p->vec && y->xks > 0 ? SEQ_FWD_MMA_KP : SEQ_FWD_MMA;
        }
        return;
    }

    // Backward. Misaligned gradients of layer 0's dw256 chunks go through aligned scratch, so
    // that the loop runs in clusters.
    const bool vec = H % 4 == 0 && call->outs_aligned;
    p->stage = p->cz && !vec;
    p->vec = p->stage ? H % 4 == 0 : vec;
    p->rows = p->vec ? brows : 0;
    for (int l = 0; l < L; l++) {
        struct seq_layer_plan *y = &p->layer[l];
        const bool c256 = p->cz && l == 0;
        if (p->rows > 0) {
            y->bwd = SEQ_BWD_CLUSTER;
            y->d_chunks = c256;
        } else if (p->persistent) {
            y->d_chunks = p->zfwd[l] || dw16(l, vec, loop_z_rows);
            if (gru && p->zfwd[l])
                y->bwd = SEQ_BWD_GRU_GATE_TAPE;
            else
                y->bwd = recompute(l) ? SEQ_BWD_GRU_RECOMPUTE : SEQ_BWD_MMA;
        } else {
            y->bwd = SEQ_BWD_STEPWISE;
        }
        y->dw = c256 ? SEQ_DW_DW256 : y->d_chunks ? SEQ_DW_DW16 : SEQ_DW_CUBLAS;
        y->dx16 = y->d_chunks && !c256;
    }
}

// ---------------------------------------------------------------------------------------------
// Names

static const char *fwd_name(const struct seq_plan *p, const struct seq_layer_plan *y) {
    switch (y->fwd) {
        case SEQ_FWD_MMA:
            return y->xks > 0 ? "mma_fused_fwd" : "mma_fwd";
        case SEQ_FWD_MMA_KP:
            return "mma_kp_fwd";
        case SEQ_FWD_WGMMA:
            return "wgmma_fwd";
        case SEQ_FWD_CLUSTER:
            return p->rows == 80 ? "cluster80_fwd" : "cluster64_fwd";
        default:
            return "stepwise_fwd";
    }
}

static const char *bwd_name(const struct seq_plan *p, const struct seq_layer_plan *y) {
    switch (y->bwd) {
        case SEQ_BWD_MMA:
            return y->d_chunks ? "mma_dw16_bwd" : "mma_bwd";
        case SEQ_BWD_GRU_RECOMPUTE:
            return y->d_chunks ? "gru_recompute_dw16_bwd" : "gru_recompute_bwd";
        case SEQ_BWD_GRU_GATE_TAPE:
            return "gru_gate_tape_bwd";
        case SEQ_BWD_CLUSTER:
            return p->rows == 80 ? "cluster80_bwd" : "cluster64_bwd";
        default:
            return "stepwise_bwd";
    }
}

static const char *dw_name(const struct seq_layer_plan *y) {
    return y->dw == SEQ_DW_DW256  ? "dw256_product"
           : y->dw == SEQ_DW_DW16 ? "dw16_product"
                                  : "cublas_dw";
}

static const char *compute_name(enum rnnd_compute c) {
    return c == RNND_COMPUTE_IEEE ? "ieee" : c == RNND_COMPUTE_BF16 ? "bf16" : "fp32";
}

void rnnd__seq_plan_name(const struct seq_device *dev, const struct cuda_tuning *tune,
                         const struct rnnd_model *m, int B, char *buf, size_t len) {
    struct seq_call call = {B, false, true, true, true, true};
    struct seq_plan f, b;
    rnnd__seq_plan(dev, tune, m, &call, &f);
    call.backward = true;
    rnnd__seq_plan(dev, tune, m, &call, &b);
    size_t at = 0;
    auto put = [&](const char *fmt, auto... v) {
        if (at < len) {
            int n = snprintf(buf + at, len - at, fmt, v...);
            at += n > 0 ? (size_t)n : 0;
        }
    };
    put("%s_h%d_%s", m->cell == RNND_CELL_LSTM ? "lstm" : "gru", m->H, compute_name(m->compute));
    if (m->L > 1)
        put("_l%d", m->L);
    put(":");
    auto same = [&](int l) {
        return strcmp(fwd_name(&f, &f.layer[l]), fwd_name(&f, &f.layer[0])) == 0 &&
               strcmp(bwd_name(&b, &b.layer[l]), bwd_name(&b, &b.layer[0])) == 0 &&
               b.layer[l].dw == b.layer[0].dw;
    };
    bool uniform = true;
    for (int l = 1; l < m->L; l++)
        uniform = uniform && same(l);
    for (int l = 0; l < (uniform ? 1 : m->L); l++) {
        if (!uniform)
            put(" [%d]", l);
        put(" %s %s %s", fwd_name(&f, &f.layer[l]), bwd_name(&b, &b.layer[l]),
            dw_name(&b.layer[l]));
    }
}
