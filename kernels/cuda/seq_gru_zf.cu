/*
 * seq_gru_zf.cu: the GRU's backward loop that reads the forward's gate planes (ZF in
 * seq_persist.cuh), TF32 or bf16 mode, built for sm_90a alone like the wgmma forwards, because
 * its dh runs on warpgroup MMAs (NOTES v31, v40). seq_gru.cu's launcher calls it where the
 * forward wrote the planes.
 */
#include "seq_persist.cuh"

namespace {

template <class Mode> int zf_launch(const struct persist_bwd_args *a, cudaStream_t stream) {
    constexpr int HP = 128;
    constexpr bool XH = Mode::hmode::SCALED;
    auto kernel = a->vec ? seq_backward_rc_kernel<Mode, HP, true, XH, 0, true, true>
                         : seq_backward_rc_kernel<Mode, HP, false, XH, 0, true, true>;
    if (a->vec && (a->variant & 8)) // bench variant bit 8: phase clocks
        kernel = seq_backward_rc_kernel<Mode, HP, true, XH, 8, true, true>;
    const long smem = persist_rc_smem<Mode, HP>();
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a->B, 16), persist_rc_geom<Mode, HP>::THREADS, smem, stream>>>(*a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

} // namespace

int rnnd__wg_gru_backward_zf(const struct persist_bwd_args *a, bool bf16, cudaStream_t stream) {
    return bf16 ? zf_launch<mode_bf16>(a, stream) : zf_launch<mode_tf32>(a, stream);
}
