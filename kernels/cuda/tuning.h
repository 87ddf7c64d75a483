/*
 * tuning.h: the experiment switches of the CUDA backend, in one place. The benchmark and the GPU
 * tests force a kernel that the plan (seq_plan.h, step.cu) would not choose by setting variant
 * bits (RNND_CUDA_VARIANT, rnnd_cuda_set_variant); rnnd__cuda_tuning_of turns them into a
 * struct cuda_tuning of named overrides, which is all the dispatch reads. Its zero value is the
 * production plan. A switch that names a kernel a model has no use for changes nothing.
 * Internal to kernels/cuda/ and its bench and tests.
 */
#ifndef RNND_CUDA_TUNING_H
#define RNND_CUDA_TUNING_H

#include <stdbool.h>

// Variant bits (the numbers the bench's RNND_CUDA_VARIANT and gpu_run.sh take).
// per-phase clock counts of the TF32 H = 128 loops and the wgmma forwards (builds with
// RNND_CUDA_PHASE_CLOCKS)
#define RNND_TUNE_PHASE_CLOCKS      8
#define RNND_TUNE_STEP_NO_EARLY_X   16    // step: layer 0 reads its inputs after the wait only
#define RNND_TUNE_NO_FUSED_X        32    // the persistent loops take x W_ih^T from a cuBLAS GEMM
#define RNND_TUNE_NO_RECOMPUTE      64    // the GRU H = 128 backward reads its gates from the tape
#define RNND_TUNE_NO_CLUSTER        128   // LSTM H = 256: no cluster loops (the per-step path)
#define RNND_TUNE_NO_CLUSTER_BWD    256   // LSTM H = 256: the forward in clusters only
#define RNND_TUNE_STEP_NO_PDL       512   // step: every launch without programmatic serialization
#define RNND_TUNE_CLUSTER80         1024  // LSTM H = 256: 80 rows a cluster wherever they run
#define RNND_TUNE_NO_WG             4096  // no warpgroup-MMA forwards and step tiles (mma.sync)
#define RNND_TUNE_NO_DW16           16384 // weight gradients from cuBLAS, not the chunk products
#define RNND_TUNE_NO_ZFWD           32768 // z rows in the tape, not the forward's chunks
#define RNND_TUNE_NO_GRAPH          65536 // the per-step path's loops launched, not replayed as graphs
#define RNND_TUNE_NO_PAD128         131072 // 64 <= H <= 96 at a large B: the loops at their own width
#define RNND_TUNE_DW_M4             262144 // cuBLAS's weight gradients, D's 4H columns as M
#define RNND_TUNE_DW_MLDZ           524288 // the same with z's ldz columns as M
#define RNND_TUNE_DW_MSPLIT         1048576 // the same in two products, ldz split at a multiple of 128
#define RNND_TUNE_STEP_LAYERS_APART 2097152 // step, B = 1: a launch a layer, not all in one
#define RNND_TUNE_STEP_NO_GEMM16    4194304 // step: the tile kernels, never step16.cu's GEMM
#define RNND_TUNE_STEP_GEMM16       8388608 // step: step16.cu's GEMM from 9 rows, at any B

// The overrides, each false in production.
struct cuda_tuning {
    bool stepwise;        // rnnd_cuda_set_path(STEPWISE): the per-step path for every model
    bool phase_clocks;    // RNND_TUNE_PHASE_CLOCKS
    bool step_no_early_x; // RNND_TUNE_STEP_NO_EARLY_X
    bool no_fused_x;      // RNND_TUNE_NO_FUSED_X
    bool no_recompute;    // RNND_TUNE_NO_RECOMPUTE
    bool no_cluster;      // RNND_TUNE_NO_CLUSTER
    bool no_cluster_bwd;  // RNND_TUNE_NO_CLUSTER_BWD
    bool step_no_pdl;     // RNND_TUNE_STEP_NO_PDL
    bool cluster80;       // RNND_TUNE_CLUSTER80
    bool no_wg;           // RNND_TUNE_NO_WG
    bool no_dw16;         // RNND_TUNE_NO_DW16
    bool no_zfwd;         // RNND_TUNE_NO_ZFWD
    bool no_graph;        // RNND_TUNE_NO_GRAPH
    bool no_pad128;       // RNND_TUNE_NO_PAD128
    bool dw_m4, dw_mldz, dw_msplit;   // RNND_TUNE_DW_M4, _MLDZ, _MSPLIT
    bool step_layers_apart;           // RNND_TUNE_STEP_LAYERS_APART
    bool step_no_gemm16, step_gemm16; // RNND_TUNE_STEP_NO_GEMM16, _GEMM16
};

// The overrides of variant bits v (the path override is left false).
static inline struct cuda_tuning rnnd__cuda_tuning_of(int v) {
    struct cuda_tuning t = {0};
    t.phase_clocks = (v & RNND_TUNE_PHASE_CLOCKS) != 0;
    t.step_no_early_x = (v & RNND_TUNE_STEP_NO_EARLY_X) != 0;
    t.no_fused_x = (v & RNND_TUNE_NO_FUSED_X) != 0;
    t.no_recompute = (v & RNND_TUNE_NO_RECOMPUTE) != 0;
    t.no_cluster = (v & RNND_TUNE_NO_CLUSTER) != 0;
    t.no_cluster_bwd = (v & RNND_TUNE_NO_CLUSTER_BWD) != 0;
    t.step_no_pdl = (v & RNND_TUNE_STEP_NO_PDL) != 0;
    t.cluster80 = (v & RNND_TUNE_CLUSTER80) != 0;
    t.no_wg = (v & RNND_TUNE_NO_WG) != 0;
    t.no_dw16 = (v & RNND_TUNE_NO_DW16) != 0;
    t.no_zfwd = (v & RNND_TUNE_NO_ZFWD) != 0;
    t.no_graph = (v & RNND_TUNE_NO_GRAPH) != 0;
    t.no_pad128 = (v & RNND_TUNE_NO_PAD128) != 0;
    t.dw_m4 = (v & RNND_TUNE_DW_M4) != 0;
    t.dw_mldz = (v & RNND_TUNE_DW_MLDZ) != 0;
    t.dw_msplit = (v & RNND_TUNE_DW_MSPLIT) != 0;
    t.step_layers_apart = (v & RNND_TUNE_STEP_LAYERS_APART) != 0;
    t.step_no_gemm16 = (v & RNND_TUNE_STEP_NO_GEMM16) != 0;
    t.step_gemm16 = (v & RNND_TUNE_STEP_GEMM16) != 0;
    return t;
}

#endif // RNND_CUDA_TUNING_H
