/*
 * seq_gru.cu: the persistent GRU time loops (seq_persist.cuh) for every supported padded
 * width and matmul mode. One file per cell so the two compile in parallel.
 */
#include "seq_persist.cuh"

#define PERSIST_CASES(X)                                                                           \
    X(mode_tf32, 32) X(mode_tf32, 64) X(mode_tf32, 96) X(mode_tf32, 128)                          \
    X(mode_bf16, 32) X(mode_bf16, 64) X(mode_bf16, 96) X(mode_bf16, 128)

int rnnd__persist_gru(bool backward, bool bf16, int HP, const void *args, cudaStream_t stream) {
    if (backward && static_cast<const persist_bwd_args *>(args)->rc) {
        const persist_bwd_args &a = *static_cast<const persist_bwd_args *>(args);
        if (HP != 128)
            return RNND_ENOTSUP;
        return bf16 ? persist_launch_backward_rc<mode_bf16, 128>(a, stream)
                    : persist_launch_backward_rc<mode_tf32, 128>(a, stream);
    }
    if (!bf16 && HP == 128) {
        int err = persist_launch_variant<cell_gru>(backward, args, stream);
        if (err != RNND_ENOTSUP)
            return err;
    }
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return backward ? persist_launch_backward<cell_gru, MODE, W>(                            \
                              *static_cast<const persist_bwd_args *>(args), stream)                \
                        : persist_launch_forward<cell_gru, MODE, W>(                             \
                              *static_cast<const persist_fwd_args *>(args), stream);
    PERSIST_CASES(X)
#undef X
    return RNND_ENOTSUP;
}

long rnnd__persist_gru_smem(bool backward, bool bf16, int HP, int xks) {
#define X(MODE, W)                                                                                 \
    if (bf16 == (sizeof(MODE::elem) == 2) && HP == W)                                              \
        return persist_smem<cell_gru, MODE, W>(backward, xks);
    PERSIST_CASES(X)
#undef X
    return -1;
}

long rnnd__persist_gru_rc_smem(bool bf16, int HP) {
    if (HP != 128)
        return -1;
    return bf16 ? persist_rc_smem<mode_bf16, 128>() : persist_rc_smem<mode_tf32, 128>();
}
