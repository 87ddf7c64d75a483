/*
 * seq_lstm.cu: the LSTM's persistent time loops on mma.sync for every padded width and matmul
 * mode (seq_forward.cuh, seq_backward.cuh). One file per cell so the two compile in parallel.
 */
#include "seq_backward.cuh"
#include "seq_forward.cuh"

// The cases in rows, as clang-format 14 cannot keep them.
// clang-format off
#define PERSIST_CASES(X)                                                                           \
    X(mode_tf32, 32) X(mode_tf32, 64) X(mode_tf32, 96) X(mode_tf32, 128)                          \
    X(mode_bf16, 32) X(mode_bf16, 64) X(mode_bf16, 96) X(mode_bf16, 128)
// clang-format on

int rnnd__persist_lstm_forward(const struct persist_fwd_args *a, bool bf16, int HP, bool clocks,
                               cudaStream_t stream) {
    if (a->s && !a->shalf)
        return RNND_EINVAL;
#ifdef RNND_CUDA_PHASE_CLOCKS
    if (clocks && !bf16 && HP == 128 && a->vec)
        return persist_launch_forward<cell_lstm, mode_tf32, 128, SEQ_CLOCKS>(*a, stream);
#else
    (void)clocks;
#endif
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_launch_forward<cell_lstm, MODE, W>(*a, stream);
    PERSIST_CASES(X)
#undef X
    return RNND_EINVAL;
}

int rnnd__persist_lstm_backward(const struct persist_bwd_args *a, bool bf16, int HP, bool clocks,
                                cudaStream_t stream) {
    if (!a->shalf)
        return RNND_EINVAL;
#ifdef RNND_CUDA_PHASE_CLOCKS
    // The clock-counting instance writes D's chunks only on the forward's z (a.zc).
    if (clocks && !bf16 && HP == 128 && a->vec && (!a->dw16 || a->zc))
        return persist_launch_backward<cell_lstm, mode_tf32, 128, SEQ_CLOCKS>(*a, stream);
#else
    (void)clocks;
#endif
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_launch_backward<cell_lstm, MODE, W>(*a, stream);
    PERSIST_CASES(X)
#undef X
    return RNND_EINVAL;
}

long rnnd__persist_lstm_smem(bool backward, bool bf16, int HP, int xks) {
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_smem<cell_lstm, MODE, W>(backward, xks);
    PERSIST_CASES(X)
#undef X
    return -1;
}
