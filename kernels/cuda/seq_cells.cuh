/*
 * seq_cells.cuh: the GRU and LSTM cells of the persistent, cluster and per-step loops: the
 * pointwise math of one (row, unit) element forward and backward, with the same formulas and
 * association as the CPU reference (kernels/cpu/gru.c, lstm.c), and the planes of the element's
 * tape record (seq_tape.cuh).
 */
#ifndef RNND_CUDA_SEQ_CELLS_CUH
#define RNND_CUDA_SEQ_CELLS_CUH

#include "seq_prims.cuh"

// ---------------------------------------------------------------------------------------------
// Cells: pointwise math for one (row, unit) element, the same formulas and association as the
// CPU reference (kernels/cpu/gru.c, lstm.c). s[] is the element's tape record (SW planes).

struct cell_gru {
    static constexpr int G = 3;
    static constexpr int SW = 4; // a_r, a_z, a_n (pre-activations), hn = W_hn h + b_hn
    static constexpr int SH = 4; // planes held in fp16 (tape_rec)
    // xq[q] = x W_ih^T + b_ih, hq[q] = h W_hh^T + b_hh for gate q. The record holds
    // pre-activations for cell_lstm's reason (a rounded z near 1 loses 1 - z, and dL/dh's product
    // over steps with it); ACT: s holds the gates r, z, n (as gate computes them) and hn instead,
    // for a backward that uses them at once (the recomputing loop). ACC: as gate says.
    template <bool FAST, bool ACT = false, bool ACC = FAST>
    static __device__ __forceinline__ void forward(const float xq[3], const float hq[3], float h,
                                                   float c, float &h_new, float &c_new,
                                                   float s[SW]) {
        (void)c;
        const float ar = xq[0] + hq[0], az = xq[1] + hq[1];
        const float r = act_sigmoid<FAST>(ar), z = act_sigmoid<FAST>(az);
        const float an = xq[2] + r * hq[2], n = act_tanh<FAST>(an);
        h_new = (1.0f - z) * n + z * h;
        c_new = 0.0f;
        if constexpr (ACT && !ACC)
            s[0] = r, s[1] = z, s[2] = n;
        else
            s[0] = ACT ? gate<FAST>(0, ar) : ar, s[1] = ACT ? gate<FAST>(1, az) : az,
            s[2] = ACT ? gate<FAST>(2, an) : an;
        s[3] = hq[2];
    }
    // Record plane p's value as the backward uses it: r, z, n from a_r, a_z, a_n; hn as it is.
    // FAST: to a few fp32 ulps near saturation, where the backward's factors 1 - z and 1 - n^2
    // live: through tanh.approx, 1 - z for z = sigma(9) came out ~1e-3 off relative, and a GRU
    // whose update gates stay near 1 had its parameter gradients 1.6e-3 off (docs/kernels.md). Two SFU
    // operations a gate (ex2, reciprocal) instead of one. The recomputing loop in bf16 mode, whose
    // operands carry 2^-9, keeps the forward's (ACC false).
    template <bool FAST>
    static __device__ __forceinline__ float gate(int p, float v) {
        if (p == 3)
            return v;
        if (!FAST)
            return p == 2 ? act_tanh<false>(v) : act_sigmoid<false>(v);
        if (p == 2) // +-1 for large |v|, NaN stays NaN
            return copysignf(1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * fabsf(v))), v);
        return __fdividef(1.0f, 1.0f + __expf(-v));
    }
    // dh' = dy + dh_carry. Out: d[4] (D row planes: da_r, da_z, da_n r, da_n: the hidden side's
    // three first, so they equal the tile and are contiguous), tile[3] (the gradient of
    // W_hh h + b_hh: da_r, da_z, da_n r), the direct dL/dh term and dL/dc (unused).
    template <bool FAST, bool ACT = false>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[3],
                                                    float &dh_direct, float &dc_prev) {
        (void)dc_in;
        const float r = ACT ? s[0] : gate<FAST>(0, s[0]), z = ACT ? s[1] : gate<FAST>(1, s[1]);
        const float n = ACT ? s[2] : gate<FAST>(2, s[2]), hn = s[3];
        float da_n = dhj * (1.0f - z) * (1.0f - n * n);
        float da_z = dhj * (hprev - n) * z * (1.0f - z);
        float da_r = da_n * hn * r * (1.0f - r);
        d[0] = da_r, d[1] = da_z, d[2] = da_n * r, d[3] = da_n;
        tile[0] = da_r, tile[1] = da_z, tile[2] = da_n * r;
        dh_direct = dhj * z;
        dc_prev = 0.0f;
    }
};

// The LSTM's record holds the gates' pre-activations, not the gates: the backward applies the
// activations again. Its four gate planes are what the tensor-core modes store in fp16 (SH),
// and a rounded pre-activation keeps sigma' = sigma (1 - sigma) and the forget gate's product
// over steps to a relative 2^-12 where a gate saturates; a rounded gate near 1 would not (f =
// 0.9999 rounds to 1 in fp16, and the product over 256 steps is then off by 2.5%).
struct cell_lstm {
    static constexpr int G = 4;
    static constexpr int SW = 5; // a_i, a_f, a_g, a_o (pre-activations), cprev
    static constexpr int SH = 4;
    template <bool FAST>
    static __device__ __forceinline__ void forward(const float xq[4], const float hq[4], float h,
                                                   float c, float &h_new, float &c_new,
                                                   float s[SW]) {
        (void)h;
#pragma unroll
        for (int q = 0; q < 4; q++)
            s[q] = xq[q] + hq[q];
        s[4] = c;
        float i = act_sigmoid<FAST>(s[0]), f = act_sigmoid<FAST>(s[1]);
        float g = act_tanh<FAST>(s[2]), o = act_sigmoid<FAST>(s[3]);
        c_new = f * c + i * g;
        h_new = o * act_tanh<FAST>(c_new);
    }
    template <bool FAST>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[4],
                                                    float &dh_direct, float &dc_prev) {
        (void)hprev;
        float i = act_sigmoid<FAST>(s[0]), f = act_sigmoid<FAST>(s[1]);
        float g = act_tanh<FAST>(s[2]), o = act_sigmoid<FAST>(s[3]), c = s[4];
        float tc = act_tanh<FAST>(f * c + i * g);
        float dcj = dc_in + dhj * o * (1.0f - tc * tc);
        d[0] = dcj * g * i * (1.0f - i);
        d[1] = dcj * c * f * (1.0f - f);
        d[2] = dcj * i * (1.0f - g * g);
        d[3] = dhj * tc * o * (1.0f - o);
        tile[0] = d[0], tile[1] = d[1], tile[2] = d[2], tile[3] = d[3];
        dh_direct = 0.0f;
        dc_prev = dcj * f;
    }
};

#endif // RNND_CUDA_SEQ_CELLS_CUH
