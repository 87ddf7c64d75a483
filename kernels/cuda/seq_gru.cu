/*
 * seq_gru.cu: the GRU's persistent time loops on mma.sync for every padded width and matmul
 * mode (seq_forward.cuh, seq_backward.cuh), and its H = 128 backward recomputing the gates
 * (seq_gru_backward.cuh). One file per cell so the two compile in parallel.
 */
#include "seq_backward.cuh"
#include "seq_forward.cuh"
#include "seq_gru_backward.cuh"

// The cases in rows, as clang-format 14 cannot keep them.
// clang-format off
#define PERSIST_CASES(X)                                                                           \
    X(mode_tf32, 32) X(mode_tf32, 64) X(mode_tf32, 96) X(mode_tf32, 128)                          \
    X(mode_bf16, 32) X(mode_bf16, 64) X(mode_bf16, 96) X(mode_bf16, 128)
// clang-format on

int rnnd__persist_gru_forward(const struct persist_fwd_args *a, bool bf16, int HP, bool kp,
                              bool clocks, cudaStream_t stream) {
    if (a->s && !a->shalf)
        return RNND_EINVAL;
    if (kp) { // TF32, HP = 128, fused x, vector access (the launcher checks the last two)
        if (bf16 || HP != 128)
            return RNND_EINVAL;
#ifdef RNND_CUDA_PHASE_CLOCKS
        if (clocks)
            return persist_launch_forward<cell_gru, mode_tf32, 128, SEQ_CLOCKS, true>(*a, stream);
#endif
        return persist_launch_forward<cell_gru, mode_tf32, 128, 0, true>(*a, stream);
    }
#ifdef RNND_CUDA_PHASE_CLOCKS
    if (clocks && !bf16 && HP == 128 && a->vec)
        return persist_launch_forward<cell_gru, mode_tf32, 128, SEQ_CLOCKS>(*a, stream);
#else
    (void)clocks;
#endif
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_launch_forward<cell_gru, MODE, W>(*a, stream);
    PERSIST_CASES(X)
#undef X
    return RNND_EINVAL;
}

int rnnd__persist_gru_backward(const struct persist_bwd_args *a, bool bf16, int HP, bool clocks,
                               cudaStream_t stream) {
    if (!a->shalf)
        return RNND_EINVAL;
#ifdef RNND_CUDA_PHASE_CLOCKS
    if (clocks && !bf16 && HP == 128 && a->vec)
        return persist_launch_backward<cell_gru, mode_tf32, 128, SEQ_CLOCKS>(*a, stream);
#else
    (void)clocks;
#endif
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_launch_backward<cell_gru, MODE, W>(*a, stream);
    PERSIST_CASES(X)
#undef X
    return RNND_EINVAL;
}

long rnnd__persist_gru_smem(bool backward, bool bf16, int HP, int xks) {
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_smem<cell_gru, MODE, W>(backward, xks);
    PERSIST_CASES(X)
#undef X
    return -1;
}

int rnnd__gru_h128_backward(const struct persist_bwd_args *a, bool bf16, bool clocks,
                            cudaStream_t stream) {
    if (!a->shalf)
        return RNND_EINVAL;
    return bf16 ? gru_h128_recompute_launch<mode_bf16>(*a, clocks, stream)
                : gru_h128_recompute_launch<mode_tf32>(*a, clocks, stream);
}

long rnnd__gru_h128_backward_smem(bool bf16, int HP) {
    if (HP != 128)
        return -1;
    return bf16 ? gru_h128_smem<mode_bf16, 128>() : gru_h128_smem<mode_tf32, 128>();
}
