/*
 * seq_gru_gate_tape.cu: the GRU's H = 128 backward loop on the gate planes and z chunk parts the
 * wgmma forward wrote (seq_gru_h128_backward_kernel's ZF instances, seq_gru_backward.cuh), TF32
 * or bf16 mode, x up to 128 wide (the chunks' XK; the loop reads no x): it reads the gates and
 * recomputes nothing, and its dh runs on warpgroup MMAs, so it is sm_90a code, built like the
 * wgmma forwards (RNND_HAVE_WG).
 */
#include "seq_gru_backward.cuh"

namespace {

template <class Mode>
int gate_tape_launch(const struct persist_bwd_args *a, bool clocks, cudaStream_t stream) {
    constexpr int HP = 128;
    constexpr bool XH = Mode::hmode::SCALED;
    if (a->Il > HP || a->Il % 4 != 0 || a->w_ih == nullptr || !a->dw16 || !a->zc || !a->s ||
        a->H > HP || a->H % 4 != 0 || (a->dw16_exp != nullptr) != XH || (a->zc_ex != nullptr) != XH)
        return RNND_EINVAL;
    auto kernel = a->vec ? seq_gru_h128_backward_kernel<Mode, HP, true, XH, 0, true, true>
                         : seq_gru_h128_backward_kernel<Mode, HP, false, XH, 0, true, true>;
    if (a->H <= 64) // the units past 64 are the padding's zeros
        kernel = a->vec ? seq_gru_h128_backward_kernel<Mode, HP, true, XH, 0, true, true, 64>
                        : seq_gru_h128_backward_kernel<Mode, HP, false, XH, 0, true, true, 64>;
#ifdef RNND_CUDA_PHASE_CLOCKS
    if (a->vec && clocks)
        kernel = a->H <= 64
                     ? seq_gru_h128_backward_kernel<Mode, HP, true, XH, SEQ_CLOCKS, true, true, 64>
                     : seq_gru_h128_backward_kernel<Mode, HP, true, XH, SEQ_CLOCKS, true, true>;
#else
    (void)clocks;
#endif
    return gru_h128_launch<Mode>(kernel, *a, stream);
}

} // namespace

int rnnd__gru_h128_gate_tape_backward(const struct persist_bwd_args *a, bool bf16, bool clocks,
                                      cudaStream_t stream) {
    return bf16 ? gate_tape_launch<mode_bf16>(a, clocks, stream)
                : gate_tape_launch<mode_tf32>(a, clocks, stream);
}
