/*
 * seq_gru_zf.cu: the GRU's TF32 backward loop that reads the forward's gate planes (ZF in
 * seq_persist.cuh), built for sm_90a alone like the wgmma forwards, because its dh runs on
 * warpgroup MMAs (NOTES v31). seq_gru.cu's launcher calls it where the forward wrote the planes.
 */
#include "seq_persist.cuh"

int rnnd__wg_gru_backward_zf(const struct persist_bwd_args *a, cudaStream_t stream) {
    using Mode = mode_tf32;
    constexpr int HP = 128;
    auto kernel = a->vec ? seq_backward_rc_kernel<Mode, HP, true, true, 0, true, true>
                         : seq_backward_rc_kernel<Mode, HP, false, true, 0, true, true>;
    if (a->vec && (a->variant & 8)) // bench variant bit 8: phase clocks
        kernel = seq_backward_rc_kernel<Mode, HP, true, true, 8, true, true>;
    const long smem = persist_rc_smem<Mode, HP>();
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a->B, 16), persist_rc_geom<Mode, HP>::THREADS, smem, stream>>>(*a);
    CUDA_LAUNCH_CHECK();
    return 0;
}
