/*
 * test_seq_plan.c: the sequence plan (kernels/cuda/seq_plan.h) on described devices, with no GPU:
 * which kernels a model runs on an H100-class device, on one without the sm_90a kernels and on
 * an A100-class one, under the bench's overrides, and what a call's buffers change (staging,
 * the per-step path). Built with the CUDA backend; runs on any host.
 */
#include "seq_plan.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

// Compute 9.0, 132 SMs, 227 KB of shared memory a block, 30 clusters of the H = 256 loops
// of either shape at once (an H100's figures).
static const struct seq_device h100 = {9, 132, 232448, true, {{30, 30}, {30, 30}}};
// The same device in a build without the sm_90a kernels.
static const struct seq_device h100_no_wg = {9, 132, 232448, false, {{30, 30}, {30, 30}}};
// Compute 8.0, 108 SMs, 163 KB (an A100's): no clusters, no sm_90a kernels.
static const struct seq_device a100 = {8, 108, 166912, false, {{0, 0}, {0, 0}}};

static const char *name_of(const struct seq_device *dev, int tune_bits, enum rnnd_cell cell,
                           enum rnnd_compute compute, int I, int H, int L, int B) {
    static char buf[256];
    const struct rnnd_model m = {.cell = cell, .compute = compute, .I = I, .H = H, .L = L};
    const struct cuda_tuning t = rnnd__cuda_tuning_of(tune_bits);
    rnnd__seq_plan_name(dev, &t, &m, B, buf, sizeof(buf));
    return buf;
}

static const enum rnnd_cell GRU = RNND_CELL_GRU, LSTM = RNND_CELL_LSTM;
static const enum rnnd_compute F32 = RNND_COMPUTE_FP32, IEEE = RNND_COMPUTE_IEEE,
                               BF16 = RNND_COMPUTE_BF16;

// The headline shapes (the bench's B = 2048, I = 64) on an H100.
static void test_h100(void **state) {
    (void)state;
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 128, 1, 2048),
                        "gru_h128_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 128, 1, 2048),
                        "lstm_h128_fp32: wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, BF16, 64, 128, 1, 2048),
                        "gru_h128_bf16: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, BF16, 64, 128, 1, 2048),
                        "lstm_h128_bf16: mma_fused_fwd mma_dw16_bwd dw16_product");
    // B = 2048 is one wave of 80-row clusters, two of 64-row ones; B = 384 one of 64.
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 256, 1, 2048),
                        "lstm_h256_fp32: cluster80_fwd cluster80_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 256, 1, 384),
                        "lstm_h256_fp32: cluster64_fwd cluster64_bwd dw256_product");
    // Both loops from 21 rows, where the blocked tape fits; below, the backward runs per step
    // and the tape keeps z rows.
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 256, 1, 64),
                        "lstm_h256_fp32: cluster64_fwd cluster64_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 256, 1, 21),
                        "lstm_h256_fp32: cluster64_fwd cluster64_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 256, 1, 20),
                        "lstm_h256_fp32: cluster64_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, LSTM, BF16, 64, 256, 1, 2048),
                        "lstm_h256_bf16: cluster80_fwd cluster80_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, LSTM, IEEE, 64, 256, 1, 2048),
                        "lstm_h256_ieee: stepwise_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 256, 2, 2048),
                        "lstm_h256_fp32_l2: [0] cluster80_fwd cluster80_bwd dw256_product"
                        " [1] stepwise_fwd cluster80_bwd cublas_dw");
    // The GRU at H = 256 in the same clusters, TF32 and bf16 modes (the forward at layer 0 with
    // I <= 64, the backward from 21 rows, the dw256 product where both run).
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 256, 1, 2048),
                        "gru_h256_fp32: cluster80_fwd cluster80_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, GRU, BF16, 64, 256, 1, 384),
                        "gru_h256_bf16: cluster64_fwd cluster64_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 256, 2, 2048),
                        "gru_h256_fp32_l2: [0] cluster80_fwd cluster80_bwd dw256_product"
                        " [1] stepwise_fwd cluster80_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 256, 1, 64),
                        "gru_h256_fp32: cluster64_fwd cluster64_bwd dw256_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 256, 1, 20),
                        "gru_h256_fp32: cluster64_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 72, 256, 1, 2048),
                        "gru_h256_fp32: stepwise_fwd cluster80_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, IEEE, 64, 256, 1, 2048),
                        "gru_h256_ieee: stepwise_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, IEEE, 64, 128, 1, 2048),
                        "gru_h128_ieee: stepwise_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 1024, 1, 8),
                        "gru_h1024_fp32: stepwise_fwd stepwise_bwd cublas_dw");
    // Below H = 128 the GRU's own backward does not run (H = 7 takes HP = 32), so a taped
    // forward writes the gate planes, which the GRU's wgmma forward writes only beside z's
    // chunk parts: the mma.sync loops.
    assert_string_equal(name_of(&h100, 0, GRU, F32, 5, 7, 1, 33),
                        "gru_h7_fp32: mma_fused_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 36, 124, 1, 17),
                        "gru_h124_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
    // A layer of 64 <= H < 128 runs the loops of H = 128 from 1024 rows (GRU) or 1536 (LSTM), H =
    // 64 from 512 or 1024, its units from H on zero; a second layer (I_l = H <= 64) too, with
    // cuBLAS's weight gradients (the GRU's recomputing its gates). Below those the loops of its
    // own width.
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 64, 1, 2048),
                        "gru_h64_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, BF16, 64, 96, 1, 2048),
                        "gru_h96_bf16: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 64, 2, 2048),
                        "gru_h64_fp32_l2: [0] wgmma_fwd gru_gate_tape_bwd dw16_product [1] "
                        "wgmma_fwd gru_recompute_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 64, 1, 512),
                        "gru_h64_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 64, 1, 511),
                        "gru_h64_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 96, 1, 1024),
                        "gru_h96_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 96, 1, 1023),
                        "gru_h96_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 64, 1, 2048),
                        "lstm_h64_fp32: wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, BF16, 64, 96, 1, 2048),
                        "lstm_h96_bf16: mma_fused_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, BF16, 64, 64, 1, 2048),
                        "lstm_h64_bf16: wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, BF16, 64, 128, 1, 2048),
                        "lstm_h128_bf16: mma_fused_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 64, 2, 2048),
                        "lstm_h64_fp32_l2: [0] wgmma_fwd mma_dw16_bwd dw16_product [1] "
                        "wgmma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 36, 124, 1, 17),
                        "lstm_h124_fp32: wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 64, 1, 1024),
                        "lstm_h64_fp32: wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 64, 1, 1023),
                        "lstm_h64_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 96, 1, 1536),
                        "lstm_h96_fp32: wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 96, 1, 1535),
                        "lstm_h96_fp32: mma_fwd mma_bwd cublas_dw");
    // The GRU's wgmma forward fuses x up to 128 wide from 512 rows (layer 1 at H = 128, or a
    // wide x) and writes z's dw16 chunk parts there, which the gate-tape loop reads; not the
    // LSTM's. At H = 128 the mma.sync loop writes the chunks with x 128 wide (I_l <= 128) itself
    // from 1536 rows (GRU, where the forward writes none) or 2048 (LSTM), cuBLAS's products
    // below.
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 128, 2, 2048),
                        "gru_h128_fp32_l2: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 128, 2, 512),
                        "gru_h128_fp32_l2: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 128, 2, 511),
                        "gru_h128_fp32_l2: [0] wgmma_fwd gru_gate_tape_bwd dw16_product [1] "
                        "mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_ZFWD, GRU, F32, 64, 128, 2, 2048),
                        "gru_h128_fp32_l2: [0] wgmma_fwd gru_recompute_dw16_bwd dw16_product [1] "
                        "wgmma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_ZFWD, GRU, F32, 64, 128, 2, 1535),
                        "gru_h128_fp32_l2: [0] wgmma_fwd gru_recompute_dw16_bwd dw16_product [1] "
                        "wgmma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 128, 128, 1, 512),
                        "gru_h128_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, BF16, 64, 128, 2, 2047),
                        "lstm_h128_bf16_l2: [0] mma_fused_fwd mma_dw16_bwd dw16_product [1] "
                        "mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 128, 100, 1, 2048),
                        "gru_h100_fp32: wgmma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 128, 100, 1, 511),
                        "gru_h100_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 132, 128, 1, 2048),
                        "gru_h128_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_FUSED_X, GRU, F32, 64, 128, 2, 2048),
                        "gru_h128_fp32_l2: [0] mma_fwd gru_recompute_dw16_bwd dw16_product [1] "
                        "mma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 64, 128, 2, 2048),
                        "lstm_h128_fp32_l2: [0] wgmma_fwd mma_dw16_bwd dw16_product [1] "
                        "mma_fwd mma_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, 0, GRU, BF16, 64, 128, 2, 2048),
                        "gru_h128_bf16_l2: wgmma_fwd gru_gate_tape_bwd dw16_product");
    // Not below 64 units, nor with an input the loops do not fuse (I % 4 != 0).
    assert_string_equal(name_of(&h100, 0, GRU, F32, 64, 60, 1, 2048),
                        "gru_h60_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, GRU, F32, 17, 96, 1, 2048),
                        "gru_h96_fp32: mma_fused_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, 0, LSTM, F32, 17, 96, 1, 2048),
                        "lstm_h96_fp32: mma_fused_fwd mma_bwd cublas_dw");
}

// The bench's overrides (tuning.h) reach the kernels they name, and nothing else.
static void test_overrides(void **state) {
    (void)state;
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_WG, GRU, F32, 64, 128, 1, 2048),
                        "gru_h128_fp32: mma_kp_fwd gru_recompute_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_ZFWD, GRU, F32, 64, 128, 1, 2048),
                        "gru_h128_fp32: wgmma_fwd gru_recompute_dw16_bwd dw16_product");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_RECOMPUTE, GRU, F32, 64, 128, 1, 2048),
                        "gru_h128_fp32: mma_kp_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_DW16, LSTM, F32, 64, 128, 1, 2048),
                        "lstm_h128_fp32: wgmma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_CLUSTER80, LSTM, F32, 64, 256, 1, 384),
                        "lstm_h256_fp32: cluster80_fwd cluster80_bwd dw256_product");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_CLUSTER_BWD, LSTM, F32, 64, 256, 1, 2048),
                        "lstm_h256_fp32: cluster80_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_CLUSTER, LSTM, F32, 64, 256, 1, 2048),
                        "lstm_h256_fp32: stepwise_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_CLUSTER, GRU, F32, 64, 256, 1, 2048),
                        "gru_h256_fp32: stepwise_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_CLUSTER_BWD, GRU, F32, 64, 256, 1, 2048),
                        "gru_h256_fp32: cluster80_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_PAD128, GRU, F32, 64, 64, 1, 2048),
                        "gru_h64_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_NO_PAD128, LSTM, F32, 64, 64, 1, 2048),
                        "lstm_h64_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100, RNND_TUNE_STEP_NO_PDL, GRU, F32, 64, 128, 1, 2048),
                        "gru_h128_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product");
}

// Devices without the sm_90a kernels run the mma.sync loops and cuBLAS's products.
static void test_other_devices(void **state) {
    (void)state;
    assert_string_equal(name_of(&h100_no_wg, 0, GRU, F32, 64, 128, 1, 2048),
                        "gru_h128_fp32: mma_kp_fwd gru_recompute_bwd cublas_dw");
    assert_string_equal(name_of(&h100_no_wg, 0, GRU, F32, 64, 64, 1, 2048),
                        "gru_h64_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&h100_no_wg, 0, LSTM, F32, 64, 256, 1, 2048),
                        "lstm_h256_fp32: cluster80_fwd cluster80_bwd cublas_dw");
    assert_string_equal(name_of(&h100_no_wg, 0, GRU, F32, 64, 256, 1, 2048),
                        "gru_h256_fp32: cluster80_fwd cluster80_bwd cublas_dw");
    // 163 KB: the LSTM's loops fit, not with the fused input projection beside them.
    assert_string_equal(name_of(&a100, 0, LSTM, F32, 64, 128, 1, 2048),
                        "lstm_h128_fp32: mma_fwd mma_bwd cublas_dw");
    assert_string_equal(name_of(&a100, 0, LSTM, F32, 64, 256, 1, 2048),
                        "lstm_h256_fp32: stepwise_fwd stepwise_bwd cublas_dw");
    assert_string_equal(name_of(&a100, 0, GRU, F32, 64, 256, 1, 2048),
                        "gru_h256_fp32: stepwise_fwd stepwise_bwd cublas_dw");
}

// What a call brings: misaligned outputs of a chunk-writing forward are staged (the loop stays);
// the forced per-step path; the tape's format does not depend on the call's buffers.
static void test_calls(void **state) {
    (void)state;
    const struct rnnd_model m = {.cell = GRU, .compute = F32, .I = 64, .H = 128, .L = 1};
    const struct cuda_tuning t = {0};
    struct seq_call call = {2048, false, true, true, true, false};
    struct seq_plan p, q;
    rnnd__seq_plan(&h100, &t, &m, &call, &p);
    assert_true(p.stage && p.vec && p.zfwd[0] && p.z_dw16[0]);
    assert_int_equal(p.layer[0].fwd, SEQ_FWD_WGMMA);
    assert_true(p.layer[0].z_chunks && p.layer[0].gates);
    call.x_aligned = false; // no chunk parts, z rows: the forward's gates are not written
    rnnd__seq_plan(&h100, &t, &m, &call, &q);
    assert_true(!q.zfwd[0] && q.z_dw16[0] && !q.stage && !q.vec);
    assert_int_equal(q.layer[0].fwd, SEQ_FWD_MMA);
    assert_false(q.layer[0].gates);
    call.backward = true, call.outs_aligned = true;
    rnnd__seq_plan(&h100, &t, &m, &call, &q);
    assert_int_equal(q.layer[0].bwd, SEQ_BWD_GRU_RECOMPUTE);
    assert_int_equal(q.layer[0].dw, SEQ_DW_DW16);
    assert_true(q.tape_half == p.tape_half && q.z_dw16[0] == p.z_dw16[0]);
    const struct cuda_tuning stepwise = {.stepwise = true};
    rnnd__seq_plan(&h100, &stepwise, &m, &call, &q);
    assert_true(!q.persistent && !q.tape_half && !q.z_dw16[0]);
    assert_int_equal(q.layer[0].bwd, SEQ_BWD_STEPWISE);
    // Misaligned gradients: the dw16 chunks only where the forward wrote z's parts (layer 0;
    // the LSTM's layer 1 from 2048 rows in TF32 mode), cuBLAS's products elsewhere.
    const struct rnnd_model m2 = {.cell = LSTM, .compute = F32, .I = 64, .H = 128, .L = 2};
    call = (struct seq_call){2047, true, true, true, true, false};
    rnnd__seq_plan(&h100, &t, &m2, &call, &q);
    assert_true(q.zfwd[0] && q.layer[0].d_chunks && q.layer[0].dw == SEQ_DW_DW16);
    assert_true(!q.zfwd[1] && !q.layer[1].d_chunks && q.layer[1].dw == SEQ_DW_CUBLAS);
    call.B = 2048;
    rnnd__seq_plan(&h100, &t, &m2, &call, &q);
    assert_true(q.zfwd[1] && q.layer[1].d_chunks && q.layer[1].dw == SEQ_DW_DW16);
    assert_int_equal(q.layer[1].bwd, SEQ_BWD_MMA);
    call.outs_aligned = true;
    rnnd__seq_plan(&h100, &t, &m2, &call, &q);
    assert_true(q.layer[1].d_chunks && q.layer[1].dw == SEQ_DW_DW16 && q.layer[1].dx16);
    call.backward = false; // its mma.sync forward writes them, x 128 wide
    rnnd__seq_plan(&h100, &t, &m2, &call, &q);
    assert_true(q.layer[1].z_chunks && q.layer[1].gates && q.layer[1].xks == 0);
    assert_int_equal(q.layer[1].fwd, SEQ_FWD_MMA);
    const struct cuda_tuning nozf = {.no_zfwd = true}; // z rows: the backward loop writes them
    rnnd__seq_plan(&h100, &nozf, &m2, &call, &q);
    assert_true(!q.zfwd[1] && !q.layer[1].z_chunks);
    call.backward = true;
    rnnd__seq_plan(&h100, &nozf, &m2, &call, &q);
    assert_true(!q.zfwd[1] && q.layer[1].d_chunks);
    const struct rnnd_model b2 = {.cell = LSTM, .compute = BF16, .I = 64, .H = 128, .L = 2};
    rnnd__seq_plan(&h100, &t, &b2, &call, &q); // bf16: the loop writes them
    assert_true(!q.zfwd[1] && q.layer[1].d_chunks);
    // The GRU's layer 1 with its forward's chunk parts: both passes see the inputs' alignment
    // alone; misaligned outputs are staged, misaligned gradients keep the chunks.
    const struct rnnd_model g2 = {.cell = GRU, .compute = F32, .I = 64, .H = 128, .L = 2};
    call = (struct seq_call){2048, false, true, true, true, false};
    rnnd__seq_plan(&h100, &t, &g2, &call, &q);
    assert_true(q.zfwd[1] && q.z_dw16[1] && q.stage && q.layer[1].z_chunks && q.layer[1].gates);
    assert_int_equal(q.layer[1].fwd, SEQ_FWD_WGMMA);
    call.backward = true;
    rnnd__seq_plan(&h100, &t, &g2, &call, &q);
    assert_true(q.layer[1].d_chunks && q.layer[1].dx16);
    assert_int_equal(q.layer[1].bwd, SEQ_BWD_GRU_GATE_TAPE);
    call.states_aligned = false; // z rows in both passes: the mma.sync loop writes the chunks
    rnnd__seq_plan(&h100, &t, &g2, &call, &q);
    assert_true(!q.zfwd[1] && q.z_dw16[1] && !q.layer[1].d_chunks);
    call.outs_aligned = true;
    rnnd__seq_plan(&h100, &t, &g2, &call, &q);
    assert_true(q.layer[1].d_chunks);
    assert_int_equal(q.layer[1].bwd, SEQ_BWD_MMA);
    // Truncated names stay NUL-terminated.
    char small[8];
    rnnd__seq_plan_name(&h100, &t, &m, 2048, small, sizeof(small));
    assert_string_equal(small, "gru_h12");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_h100),
        cmocka_unit_test(test_overrides),
        cmocka_unit_test(test_other_devices),
        cmocka_unit_test(test_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
