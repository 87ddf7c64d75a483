/*
 * seq_plan.h: which kernels run a sequence forward and backward (seq.cu), chosen in one place.
 *
 * rnnd__seq_plan takes the model, the device, the batch and what the call has (a tape, the
 * alignment of its buffers) and returns a struct seq_plan: per layer, the forward loop, the
 * backward loop, the weight-gradient product and dL/dx; for the whole call, the tape's format
 * and whether outputs or gradients go through aligned scratch. The drivers in seq.cu execute the
 * plan and choose nothing; a kernel that cannot run a shape is one the plan never names. The
 * tape's format depends on the model, the device and B alone (struct seq_plan's tape fields), so
 * a forward and the backward over its tape agree. rnnd__seq_plan_name names a plan for logs, the
 * bench and the ops table's plan_name. docs/kernels.md has the table of what runs where.
 * C-callable (tests/unit/test_seq_plan.c), host code only.
 */
#ifndef RNND_CUDA_SEQ_PLAN_H
#define RNND_CUDA_SEQ_PLAN_H

#include "rnnd_kernels.h"
#include "tuning.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// The device as the plan sees it (backend.cu fills it once per context).
struct seq_device {
    int cc_major;
    int num_sms;
    size_t smem_optin; // largest dynamic shared memory a block may ask for
    bool wg;           // the sm_90a kernels are built (RNND_HAVE_WG) and the device is compute 9.0
    // H = 256 cluster loops the device runs at once: [64 rows, 80 rows][forward, backward]
    // (0 where it cannot launch them; seq_loops.h rnnd__cluster_active).
    int cluster_active[2][2];
};

// What a call brings besides the model.
struct seq_call {
    int B;
    bool backward;
    bool tape;           // forward: a tape is filled for a backward
    bool x_aligned;      // seq->x is 16-byte aligned
    bool states_aligned; // seq->h0, c0, hidden and cell are NULL or 16-byte aligned
    // Forward: out, h_n, c_n; backward: grad_out, grad_h_n, grad_c_n and the state gradients
    // (grads->h0, c0, hidden, cell); each NULL or 16-byte aligned.
    bool outs_aligned;
};

// The time loop of a layer's forward.
enum seq_fwd_kernel {
    SEQ_FWD_STEPWISE, // per step one cuBLAS GEMM h W_hh^T and stepwise_cell_kernel (seq.cu)
    SEQ_FWD_MMA,      // seq_forward_kernel: the persistent loop on mma.sync (seq_forward.cuh)
    SEQ_FWD_MMA_KP,   // seq_forward_kernel with K split over warp pairs (GRU, TF32, HP = 128)
    SEQ_FWD_WGMMA,    // seq_wg_forward: the persistent loop on warpgroup MMAs (seq_wg.cu)
    SEQ_FWD_CLUSTER,  // seq_cluster_forward_kernel: H = 256 in 4-CTA clusters
};

// The reverse time loop of a layer's backward.
enum seq_bwd_kernel {
    SEQ_BWD_STEPWISE,      // per step stepwise_cell_backward_kernel, a cuBLAS GEMM, routing
    SEQ_BWD_MMA,           // seq_backward_kernel: the persistent loop on the gate tape
    SEQ_BWD_GRU_RECOMPUTE, // seq_gru_h128_backward_kernel: the gates recomputed from z
    SEQ_BWD_GRU_GATE_TAPE, // seq_gru_h128_backward_kernel on the forward's gate planes and z
                           // chunks, dh on warpgroup MMAs (seq_gru_gate_tape.cu)
    SEQ_BWD_CLUSTER,       // seq_cluster_backward_kernel: H = 256 in clusters
};

// The weight gradients [dW_ih | dW_hh | db] of a layer.
enum seq_dw_kernel {
    SEQ_DW_CUBLAS, // one cuBLAS GEMM D^T z, then dw_scatter_kernel (seq.cu)
    SEQ_DW_DW16,   // seq_dw.cu's product on the dw16 chunks (HP = 128)
    SEQ_DW_DW256,  // seq_dw.cu's product on the cluster loops' dw256 chunks (H = 256, layer 0)
};

struct seq_layer_plan {
    enum seq_fwd_kernel fwd;
    int xks;       // MMA, MMA_KP, WGMMA: x k-steps of the fused input projection (0: x W_ih^T
                   // from one cuBLAS GEMM over all steps)
    bool xloop;    // the forward loop reads the layer input itself (it may copy it to the tape)
    bool gates;    // a taped persistent forward writes the gate planes (s rows)
    bool z_chunks; // the forward writes z as chunk parts instead of z rows (zfwd, a tape)
    enum seq_bwd_kernel bwd;
    bool d_chunks; // the backward loop writes D as the product's chunks (dw16 or dw256)
    enum seq_dw_kernel dw;
    bool dx16; // dL/dx from the dw16 chunks (seq_dw.cu), not a cuBLAS GEMM on D
};

struct seq_plan {
    int HP;          // padded width of the persistent loops; 0 where they do not run
    bool persistent; // the persistent loops (HP > 0) for every layer the clusters do not run
    // The tape's format (model, device and B; both passes agree):
    bool tape_half;               // the gate planes in fp16 (tape_rec), else fp32
    bool tape_blocked;            // the record in tape_b8's blocks of 8 rows
    bool z_dw16[RNND_MAX_LAYERS]; // layer l's z space is sized for dw16 chunk parts and x
                                  // exponents (above layer 0: beside the x rows)
    bool z_dw256; // layer 0's z space is sized for dw256 chunk parts and aux records
    // The call:
    bool zfwd[RNND_MAX_LAYERS]; // layer l's z is dw16 chunk parts (z_dw16 and aligned inputs)
    bool cz;                    // layer 0's z is dw256 chunk parts (z_dw256 and aligned inputs)
    bool stage;                 // outputs (forward) or gradients (backward) through aligned scratch
    bool vec;                   // 16-byte access to outputs or gradients (after staging)
    int rows;                   // rows a cluster of the cluster loops (64 or 80), 0 where none runs
    bool phase_clocks; // the loops' clock-counting instances (RNND_CUDA_PHASE_CLOCKS builds)
    struct seq_layer_plan layer[RNND_MAX_LAYERS];
};

// The plan of a call of model m (valid) on dev under the overrides tune (zero in production).
void rnnd__seq_plan(const struct seq_device *dev, const struct cuda_tuning *tune,
                    const struct rnnd_model *m, const struct seq_call *call, struct seq_plan *p);

// The name of the plans of a taped forward of m over B rows and its backward, with aligned
// buffers (what a training step runs): the model, then each layer's forward loop, backward loop
// and weight-gradient product, e.g. "gru_h128_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product";
// layers that run the same kernels are named once, others as "[l] ..." each. Into buf (len
// bytes, NUL-terminated, truncated where it does not fit).
void rnnd__seq_plan_name(const struct seq_device *dev, const struct cuda_tuning *tune,
                         const struct rnnd_model *m, int B, char *buf, size_t len);

// HP, the padded width the persistent loops run m at, or 0 where they cannot (compute ieee,
// H > 128, or more shared memory than smem_optin bytes).
int rnnd__seq_persist_hp(const struct rnnd_model *m, size_t smem_optin);

#ifdef __cplusplus
}
#endif

#endif // RNND_CUDA_SEQ_PLAN_H
