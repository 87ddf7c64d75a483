/*
 * lstm.c: the LSTM cell, pointwise, for one batch row and one step (PyTorch nn.LSTM, gate order
 * i, f, g, o). rnn.c runs the matmuls (gx = W_ih x, gh = W_hh h, both without bias) and the time
 * loop; this file adds the biases and applies the gates:
 *
 *   a  = (gx + b_ih) + (gh + b_hh)
 *   i = sigmoid(a_i)   f = sigmoid(a_f)   g = tanh(a_g)   o = sigmoid(a_o)
 *   c' = f * c + i * g
 *   h' = o * tanh(c')                        (tanh(c') is kept: backward needs it)
 *
 * Backward, from dh' (output gradient plus the one carried from step t+1) and the carried dc':
 *
 *   dc' += dh' o (1 - tanh(c')^2)
 *   da_o = dh' tanh(c') o (1 - o)     da_i = dc' g i (1 - i)
 *   da_f = dc' c f (1 - f)            da_g = dc' i (1 - g^2)
 *   dc   = dc' f
 *   dh   = da W_hh                               (rnn.c's matmul; h' has no direct path to h)
 * da is the gradient of both W_ih x + b_ih and W_hh h + b_hh.
 */
// Lets GCC if-convert the activations' clamps and selects, so the loops vectorise (cpu.h); only
// floating-point exception flags are affected, never values. Clang vectorises them as they are.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu.h"

RNND_CPU_SIMD void rnnd__lstm_row_forward(int H, float *restrict gates, float *restrict c_new,
                                          float *restrict tc, float *restrict h_new,
                                          const float *restrict gx, const float *restrict gh,
                                          const float *restrict c, const float *restrict b_ih,
                                          const float *restrict b_hh) {
    // i and f are sigmoids, g a tanh, o a sigmoid: three loops so each vectorises.
    for (int j = 0; j < 2 * H; j++)
        gates[j] = rnnd__cpu_sigmoidf((gx[j] + b_ih[j]) + (gh[j] + b_hh[j]));
    for (int j = 2 * H; j < 3 * H; j++)
        gates[j] = rnnd__cpu_tanhf((gx[j] + b_ih[j]) + (gh[j] + b_hh[j]));
    for (int j = 3 * H; j < 4 * H; j++)
        gates[j] = rnnd__cpu_sigmoidf((gx[j] + b_ih[j]) + (gh[j] + b_hh[j]));
    const float *i = gates, *f = gates + H, *g = gates + 2 * H, *o = gates + 3 * H;
    for (int j = 0; j < H; j++) {
        c_new[j] = f[j] * c[j] + i[j] * g[j];
        tc[j] = rnnd__cpu_tanhf(c_new[j]);
        h_new[j] = o[j] * tc[j];
    }
}

RNND_CPU_SIMD void rnnd__lstm_row_backward(int H, float *restrict da, float *restrict dc,
                                           const float *restrict dy, const float *restrict dh_carry,
                                           const float *restrict gates, const float *restrict tc,
                                           const float *restrict c) {
    const float *i = gates, *f = gates + H, *g = gates + 2 * H, *o = gates + 3 * H;
    for (int j = 0; j < H; j++) {
        float dhj = dy[j] + dh_carry[j];
        float dcj = dc[j] + dhj * o[j] * (1.0f - tc[j] * tc[j]);
        da[j] = dcj * g[j] * i[j] * (1.0f - i[j]);
        da[H + j] = dcj * c[j] * f[j] * (1.0f - f[j]);
        da[2 * H + j] = dcj * i[j] * (1.0f - g[j] * g[j]);
        da[3 * H + j] = dhj * tc[j] * o[j] * (1.0f - o[j]);
        dc[j] = dcj * f[j];
    }
}
