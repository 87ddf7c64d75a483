/*
 * gru.c: the GRU cell, pointwise, for one batch row and one step (PyTorch nn.GRU, gate order
 * r, z, n). rnn.c runs the matmuls (gx = W_ih x, gh = W_hh h, both without bias) and the time loop;
 * this file adds the biases and applies the gates:
 *
 *   r  = sigmoid(gx_r + b_ir + gh_r + b_hr)
 *   z  = sigmoid(gx_z + b_iz + gh_z + b_hz)
 *   hn = gh_n + b_hn                         (kept: backward needs it)
 *   n  = tanh(gx_n + b_in + r * hn)
 *   h' = (1 - z) * n + z * h
 *
 * Backward, from dh' (the output gradient plus the gradient carried from step t+1):
 *
 *   dn = dh' (1 - z)        da_n = dn (1 - n^2)
 *   dz = dh' (h - n)        da_z = dz z (1 - z)
 *   dr = da_n hn            da_r = dr r (1 - r)
 *   d(W_ih x + b_ih) = (da_r, da_z, da_n)      d(W_hh h + b_hh) = (da_r, da_z, da_n r)
 *   dh = dh' z + d(W_hh h + b_hh) W_hh         (the matmul part is rnn.c's)
 *
 * The loops are plain element-wise code over H that GCC vectorises (activations from cpu.h).
 */
// Lets GCC if-convert the activations' clamps and selects, so the loops vectorise (cpu.h); only
// floating-point exception flags are affected, never values. Clang vectorises them as they are.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu.h"

RNND_CPU_SIMD void rnnd__gru_row_forward(int H, float *restrict gates, float *restrict hn,
                                         float *restrict h_new, const float *restrict gx,
                                         const float *restrict gh, const float *restrict h,
                                         const float *restrict b_ih, const float *restrict b_hh) {
    float *restrict r = gates, *restrict z = gates + H, *restrict n = gates + 2 * H;
    for (int j = 0; j < 2 * H; j++) // r and z together
        gates[j] = rnnd__cpu_sigmoidf((gx[j] + b_ih[j]) + (gh[j] + b_hh[j]));
    for (int j = 0; j < H; j++) {
        hn[j] = gh[2 * H + j] + b_hh[2 * H + j];
        n[j] = rnnd__cpu_tanhf((gx[2 * H + j] + b_ih[2 * H + j]) + r[j] * hn[j]);
        h_new[j] = (1.0f - z[j]) * n[j] + z[j] * h[j];
    }
}

RNND_CPU_SIMD void rnnd__gru_row_backward(int H, float *restrict dgx, float *restrict dgh,
                                          float *restrict dh, const float *restrict dy,
                                          const float *restrict dh_carry,
                                          const float *restrict gates, const float *restrict hn,
                                          const float *restrict h) {
    const float *r = gates, *z = gates + H, *n = gates + 2 * H;
    for (int j = 0; j < H; j++) {
        float dhj = dy[j] + dh_carry[j];
        float da_n = dhj * (1.0f - z[j]) * (1.0f - n[j] * n[j]);
        float da_z = dhj * (h[j] - n[j]) * z[j] * (1.0f - z[j]);
        float da_r = da_n * hn[j] * r[j] * (1.0f - r[j]);
        dgx[j] = da_r;
        dgx[H + j] = da_z;
        dgx[2 * H + j] = da_n;
        dgh[j] = da_r;
        dgh[H + j] = da_z;
        dgh[2 * H + j] = da_n * r[j];
        dh[j] = dhj * z[j];
    }
}
