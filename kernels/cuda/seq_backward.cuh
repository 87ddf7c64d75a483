/*
 * seq_backward.cuh: the persistent, reset-aware backward time loop on mma.sync (one launch per
 * layer, steps in reverse) on the gate tape, templated over the cell, the matmul mode and HP, and
 * its launcher; instantiated per cell in seq_gru.cu and seq_lstm.cu. The mapping is
 * seq_prims.cuh's.
 *
 * Per step in reverse (two __syncthreads and a barrier per warp pair): gate gradients from the
 * tape (the GRU's gates, the LSTM's pre-activations) and dL/dh' -> D (global, for the weight and
 * input GEMMs) and the dh-gate tile (16 x G*HP) in shared memory; dh = tile . W_hh + the direct
 * term, K split over warp pairs (persist_geom); routing of the gradient at resets (docs/design.md,
 * section 2) and at t = 0. On sm_90 in TF32 mode D's planes are written from the dh-gate tile by
 * the bulk-copy engine.
 */
#ifndef RNND_CUDA_SEQ_BACKWARD_CUH
#define RNND_CUDA_SEQ_BACKWARD_CUH

#include "seq_tape.cuh"

// dh = tile . W_hh runs on 16-bit MMAs (HM: m16n8k16, half the k-steps of TF32's m16n8k8): TF32
// mode's tile is fp16, each row scaled by the power of two that puts its largest |value| in
// [2^13, 2^14) (the row scales: as exact as TF32 for values within 2^27 of it); the warps' row
// maxima meet in shared memory across the step's first barrier, the tile is written after it,
// and a second barrier precedes the MMAs (docs/kernels.md).
// DW (HP = 128): D and z leave as dw16 chunks (seq_chunks.h) instead of D in fp32, z's x part XK
// columns wide (RNND_DW16_XK(I_l)); the loop then loads each row's hprev and (warps 0 to XK/16 - 1,
// 16 columns each) x, which z holds. bf16 mode: bf16. TF32 mode: fp16 with exponent records, D
// scaled by (row, warp) group, h by the block's bound (persist_hscale) and x by its row's largest
// |x| (the x warps' group maxima exchanged in shared memory, xm, across the step's first barrier),
// or (XB, a layer above 0, whose x is the layer below's h) by the layer below's bound, as h is.
// ZF (TF32 mode, with DW; the LSTM's): the forward wrote z's chunk parts and (layer 0) x's
// exponents (a.zc_ex; above it, XB, every row's is the layer below's bound); the loop writes D's
// parts and the records alone, and reads no z rows (docs/kernels.md).
template <class Cell, class Mode, int HP, bool VEC, int V = 0, bool DW = false, bool ZF = false,
          int XK = 64, bool XB = false>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_backward_kernel(const struct persist_bwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using HM = typename Gm::HM; // the dh MMAs' mode
    using E = typename Gm::helem;
    using WL = persist_wlayout<Gm::B_WPL>;
    constexpr int G = Gm::G, NT = Gm::B_NT, KSW = Gm::B_KSW, NW = Gm::NW, WPF = HM::WPF;
    constexpr int LDA = Gm::B_LDA, SW = Cell::SW, SPLIT = Gm::B_SPLIT;
    using TR = tape_rec<Cell, true>; // as the forward
    constexpr bool LSTM = G == 4;

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *wsm = smem;
    E *tile = reinterpret_cast<E *>(smem + KSW * Gm::B_KS_BYTES);
    float4 *xch = reinterpret_cast<float4 *>(smem + KSW * Gm::B_KS_BYTES + Gm::B_TILE_BYTES);
    float *rmax = reinterpret_cast<float *>(xch + Gm::B_XCH_BYTES / 16); // [warp][row]

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l;
    const int u0 = w * 16 + 4 * tg;
    // The K half this warp takes (its own units are n-tiles 2kh, 2kh+1 of the pair's 4).
    const int kh = w & 1, k0 = kh * KSW;

    // W_hh as B fragments: B[k][n] = W_hh[q*H + uu][unit(n)] for k = q*HP + uu, n-tile nt of
    // the pair's warp 2p + nt/2.
    float wscale = 1.0f;
    if constexpr (Mode::SCALED)
        wscale = persist_wscale(a.w_hh, G * H * H, nullptr, 0, reinterpret_cast<float *>(tile));
    const float winv = 1.0f / wscale;
    constexpr bool DWF = DW && Mode::SCALED;
    static_assert(!ZF || (DWF && XK == (XB ? 128 : 64)), "z from the forward: TF32 mode's chunks");
    static_assert(!XB || DWF, "x by a bound: TF32 mode's");
    static_assert(!DW || (HP == 128 && (XK == 64 || XK == 128)), "the dw16 chunks' widths");
    // The warps that hold x's columns (16 each), and the one that writes the constant.
    constexpr int XW = XK / 16, CW = XW < NW ? XW : 0;
    constexpr bool XF = DWF && !ZF && !XB; // x's scales from the loop's own x, across the barrier
    float hscale = 1.0f, xscale = 1.0f;
    if constexpr (DWF)
        hscale = persist_hscale(a, a.l, reinterpret_cast<float *>(tile));
    if constexpr (XB)
        xscale = persist_hscale(a, a.l - 1, reinterpret_cast<float *>(tile));
    const int xexp = -pow2_log(xscale); // XB: every row's x exponent
    float *xm = rmax + NW * 16;         // DWF: [XW][16]
#pragma unroll 4
    for (int ks = 0; ks < KSW; ks++) {
        uint32_t o[Gm::B_WPL];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            auto Bf = [&](int k, int n) -> float {
                int unit = persist_unit((w & ~1) + (nt >> 1), nt & 1, n);
                int q = k / HP, uu = k - q * HP;
                return unit < H && uu < H ? __ldg(a.w_hh + (size_t)(q * H + uu) * H + unit) : 0.0f;
            };
            HM::wpack(o + nt * WPF, Bf, k0 + ks, g, tg, wscale);
        }
        WL::store(wsm, ks, NW, w, lane, o);
    }

    bool rv[2];
    size_t rbase[2], bidx[2];
    persist_rows2(rv, bidx, rbase, a.B, T, g);

    // Carried gradients: dL/dh' (and dL/dc') of the state leaving step t.
    float dh[2][4], dc[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(dh[i]);
        zero4(dc[i]);
        size_t at = (bidx[i] * L + l) * H + u0;
        if (a.gh_n)
            ld4<VEC>(dh[i], a.gh_n + at, u0, H, rv[i]);
        if (a.gc_n)
            ld4<VEC>(dc[i], a.gc_n + at, u0, H, rv[i]);
    }

    // Step t's tape record, output gradient, h entering the step and reset flag. With vector
    // access the record's 16-bit planes stay packed (svh) until the step's top: converted at
    // the load, a step ahead, ptxas waited for the load there (12% of the LSTM loop's stall
    // samples). Since then the loads have a step to land, and a fetch of the step after
    // into L2 only cost time (its instructions waited on the memory queue; docs/kernels.md).
    constexpr int SHP = VEC ? TR::SH : 0;
    float sv[SW][2][4], gy[2][4], hp[2][4], xv[2][4];
    uint2 svh[SHP > 0 ? SHP : 1][2];
    int reset[2];
    int zex[2], zexr; // ZF: x's exponents of rows g, g + 8 and (warp 4's record) of row lane % 16
    // DW: x columns 16w + 2tg, +1, +8, +9 (warps below XW), so that dw16_put leaves them in order.
    const int xc = 16 * w + 2 * tg;
    auto load_step = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            size_t r = rbase[i] + t;
#pragma unroll
            for (int p = 0; p < SW; p++) {
                if (p < SHP)
                    svh[p][i] = TR::ld4_packed(a.s + r * TR::floats(H), p, u0, H, rv[i]);
                else
                    TR::template ld4<VEC>(sv[p][i], a.s + r * TR::floats(H), p, u0, H, rv[i]);
            }
            ld4<VEC>(gy[i], a.gy + r * a.ldgy + u0, u0, H, rv[i]);
            if constexpr (ZF) {
                if constexpr (!XB) {
                    zex[i] = rv[i] ? a.zc_ex[((size_t)blockIdx.x * T + t) * 16 + g + 8 * i]
                                   : RNND_DW16_EZERO;
                    if (i == 0)
                        zexr = a.zc_ex[((size_t)blockIdx.x * T + t) * 16 + (lane & 15)];
                }
            } else if (LSTM && !DW) {
                zero4(hp[i]);
            } else {
                ld4<VEC>(hp[i], a.z + r * a.ldz + u0, u0, H, rv[i]);
            }
            if constexpr (DW && !ZF) {
                const float *x = a.z + r * a.ldz + a.xoff;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int col = xc + (j & 1) + 8 * (j >> 1);
                    xv[i][j] = rv[i] && w < XW && col < a.Il ? __ldg(x + col) : 0.0f;
                }
            }
            reset[i] = ld_flag(a.is_init + r, rv[i]);
        }
    };
    // DWF: the scale of row r's x (its largest |x| into [2^13, 2^14)) and its exponent ex.
    auto x_scale = [&](int r, int &ex) {
        float m = xm[r];
#pragma unroll
        for (int k = 1; k < XW; k++)
            m = fmaxf(m, xm[16 * k + r]);
        return dw16_scale(m, ex);
    };
    load_step(T - 1);
    // The warp's first k-steps of weights, 48 words a lane, stay in registers (12 of 24 GRU
    // and 32 LSTM k-steps at HP = 128 in TF32 mode); 64 (16 k-steps) where the loop reads no z
    // rows (ZF), in the registers hprev and x took (backward loop 1.01 -> 0.98 ms; 72 spill;
    // docs/kernels.md); not in the scalar-access loops, which would spill.
    constexpr int BW = ZF ? 64 : 48;
    constexpr int BREG = !VEC ? 0 : KSW < BW / Gm::B_WPL ? KSW : BW / Gm::B_WPL;
    uint32_t wreg[BREG > 0 ? BREG : 1][Gm::B_WPL];
#pragma unroll
    for (int ks = 0; ks < BREG; ks++)
        WL::load(wreg[ks], wsm, ks, NW, w, lane);
    persist_clock<V> clk;
    __syncthreads(); // the weights are in place

    for (int t = T - 1; t >= 0; t--) {
        clk.start();
#pragma unroll
        for (int p = 0; p < SHP; p++)
#pragma unroll
            for (int i = 0; i < 2; i++)
                TR::unpack4(sv[p][i], svh[p][i]);
        // Gate gradients of step t.
        float ddir[2][4], dcp[2][4], tv[G][2][4], dv[4][2][4];
        int ed[2], ex[2]; // DWF: the row halves' D group and x exponents
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float s[SW], d[4], tl[G];
#pragma unroll
                for (int p = 0; p < SW; p++)
                    s[p] = sv[p][i][j];
                float dhj = gy[i][j] + dh[i][j];
                Cell::template backward<true>(s, hp[i][j], dhj, dc[i][j], d, tl, ddir[i][j],
                                              dcp[i][j]);
                // Units past H and rows past B must feed zeros into the MMA.
                bool live = rv[i] && u0 + j < H;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    dv[p][i][j] = d[p];
#pragma unroll
                for (int q = 0; q < G; q++)
                    tv[q][i][j] = live ? tl[q] : 0.0f;
            }
        int rst[2] = {reset[0], reset[1]};
        if constexpr ((V & 8) != 0) {
            persist_wait_for(tv[0][0][0] + tv[G - 1][1][3] + dv[3][1][3], a.dbg);
            clk.mark(0);
        }

#pragma unroll
        for (int i = 0; i < 2; i++) {
            if constexpr (HM::SCALED) {
                float m = 0.0f;
#pragma unroll
                for (int q = 0; q < G; q++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        m = fmaxf(m, fabsf(tv[q][i][j]));
                tile_rowmax_put(rmax, m, w, lane, i);
            } else {
#pragma unroll
                for (int q = 0; q < G; q++)
                    HM::put4(tile + (g + 8 * i) * LDA + q * HP + u0, tv[q][i]);
            }
            if constexpr (DW) {
                // D's 4 planes and z's h part of this row half (rows past B: zeros); x's by the
                // warps below XW, the constant (z's column 128 + XK: 1, or TF32 mode's h scale)
                // by warp CW. TF32 mode (DWF): D scaled by group, h by the block's bound, x by
                // the layer below's (XB); else (XF) x's group maxima into xm, x and the constant
                // after the barrier (below).
                float ds = 1.0f;
                if constexpr (DWF) {
                    const float *const pl[4] = {dv[0][i], dv[1][i], dv[2][i], dv[3][i]};
                    ds = dw16_dscale(pl, rv[i], ed[i]);
                }
                unsigned char *zc = dw16_put_dh<XK, DWF, !ZF>(
                    a.dw16, a.dw16_pitch, (size_t)blockIdx.x * T + t, w, i, lane, rv[i],
                    [&](int p) -> const float * { return dv[p][i]; }, hp[i], ds, hscale);
                if constexpr (ZF) {
                    (void)zc;
                } else if constexpr (XF) {
                    if (w < XW) {
                        float m = fmaxf(fmaxf(fabsf(xv[i][0]), fabsf(xv[i][1])),
                                        fmaxf(fabsf(xv[i][2]), fabsf(xv[i][3])));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                        if (tg == 0)
                            xm[w * 16 + g + 8 * i] = m;
                    }
                } else {
                    const float v[4] = {xv[i][0] * xscale, xv[i][1] * xscale, xv[i][2] * xscale,
                                        xv[i][3] * xscale};
                    if (w < XW)
                        dw16_put<DWF>(zc + (16 + 2 * w) * 256, v, lane);
                    if (w == CW) // the h scale: 1 in bf16 mode
                        dw16_put_one(zc + (16 + XK / 8) * 256, lane, HM::pack2(hscale, hscale));
                }
            } else {
                size_t r = rbase[i] + t;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    st4<VEC>(a.d + r * (4 * H) + p * H + u0, dv[p][i], u0, H, rv[i]);
            }
        }
        if constexpr (ZF && !XB)
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane, ed,
                        zex, -pow2_log(hscale), zexr);
        if constexpr (XB) {
            const int xe[2] = {xexp, xexp};
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane, ed,
                        xe, -pow2_log(hscale), xexp);
        }
        if (t > 0 && !XF && !HM::SCALED)
            load_step(t - 1); // in flight during the MMA
        clk.mark(1);
        __syncthreads();
        if constexpr (XF) {
            // x's rows scaled by their largest |x| (xm: every group's, before the barrier), the
            // constant (the h scale) and the record; then the next step's loads.
            unsigned char *zc = static_cast<unsigned char *>(a.dw16) +
                                4 * (size_t)a.dw16_pitch * RNND_DW16_D +
                                ((size_t)blockIdx.x * T + t) * RNND_DW16_Z(XK);
            int exr;
            x_scale(lane & 15, exr);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float xs = x_scale(g + 8 * i, ex[i]);
                if (w < XW) {
                    const float v[4] = {xv[i][0] * xs, xv[i][1] * xs, xv[i][2] * xs, xv[i][3] * xs};
                    dw16_put<true>(zc + i * 128 + (16 + 2 * w) * 256, v, lane);
                }
                if (w == CW)
                    dw16_put_one(zc + i * 128 + (16 + XK / 8) * 256, lane,
                                 HM::pack2(hscale, hscale));
            }
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane, ed,
                        ex, -pow2_log(hscale), exr);
            if (t > 0)
                load_step(t - 1); // in flight during the MMA
        }
        // The rows' scales (1 for bf16) and the 16-bit tile.
        float rsc[2] = {1.0f, 1.0f};
        if constexpr (HM::SCALED) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                rsc[i] = tile_row_scale<NW>(rmax, g + 8 * i);
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const float v[4] = {tv[q][i][0] * rsc[i], tv[q][i][1] * rsc[i],
                                        tv[q][i][2] * rsc[i], tv[q][i][3] * rsc[i]};
                    HM::put4(tile + (g + 8 * i) * LDA + q * HP + u0, v);
                }
            }
            if (t > 0 && !XF)
                load_step(t - 1); // in flight during the MMA
            __syncthreads();
        }
        clk.mark(2);

        // dL/dh of the state entering step t: tile . W_hh (+ the direct term), this warp's
        // K half for the pair's 4 n-tiles, then the partner's half of this warp's 2 added.
        float acc[SPLIT][NT][4];
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                zero4(acc[sp][nt]);
#pragma unroll
        for (int ks = 0; ks < KSW; ks++) {
            uint32_t af[4], wv[Gm::B_WPL];
            HM::afrag(af, tile, LDA, k0 + ks, lane);
            if (ks >= BREG)
                WL::load(wv, wsm, ks, NW, w, lane);
            const uint32_t *wp = ks < BREG ? wreg[ks < BREG ? ks : 0] : wv;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                HM::mma(acc[ks % SPLIT][nt], af, HM::wunpack(wp + nt * WPF));
        }
        // mine: the n-tiles of this warp's units (selected, not indexed: kh is not constant).
        float mine[2][4], theirs[2][4];
#pragma unroll
        for (int hf = 0; hf < 2; hf++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float lo = 0.0f, hi = 0.0f;
#pragma unroll
                for (int sp = 0; sp < SPLIT; sp++)
                    lo += acc[sp][hf][e], hi += acc[sp][2 + hf][e];
                mine[hf][e] = kh ? hi : lo;
                theirs[hf][e] = kh ? lo : hi;
            }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(mine[0][0] + theirs[1][3], a.dbg);
            clk.mark(3);
        }
#pragma unroll
        for (int hf = 0; hf < 2; hf++)
            xch[(w * 2 + hf) * 32 + lane] =
                make_float4(theirs[hf][0], theirs[hf][1], theirs[hf][2], theirs[hf][3]);
        asm volatile("bar.sync %0, 64;" ::"r"(1 + (w >> 1)) : "memory"); // the pair only
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float4 v = xch[((w ^ 1) * 2 + hf) * 32 + lane];
            mine[hf][0] += v.x, mine[hf][1] += v.y, mine[hf][2] += v.z, mine[hf][3] += v.w;
        }

        // Route it (docs/design.md, "Math"): carried to step t-1, or into the gradient of the value the
        // state was reset to (stored states, or h0 at t = 0), or dropped (a zero reset).
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float inv = winv * pow2_inv(rsc[i]);
            float dhp[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                dhp[j] = ddir[i][j] + mine[j >> 1][2 * i + (j & 1)] * inv;
            bool carry = t > 0 && !rst[i];
            if (carry) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    dh[i][j] = dhp[j];
                    dc[i][j] = dcp[i][j];
                }
                continue;
            }
            if (a.stored) {
                size_t at = ((rbase[i] + t) * L + l) * H + u0;
                if (a.g_hidden)
                    st4<VEC>(a.g_hidden + at, dhp, u0, H, rv[i]);
                if (a.g_cell)
                    st4<VEC>(a.g_cell + at, dcp[i], u0, H, rv[i]);
            } else if (!rst[i]) { // t == 0: the initial state
                size_t at = (bidx[i] * L + l) * H + u0;
                if (a.g_h0)
                    st4<VEC>(a.g_h0 + at, dhp, u0, H, rv[i]);
                if (a.g_c0)
                    st4<VEC>(a.g_c0 + at, dcp[i], u0, H, rv[i]);
            }
            zero4(dh[i]);
            zero4(dc[i]);
        }
        clk.mark(4);
        __syncthreads();
        clk.mark(5);
    }
    clk.flush(a.dbg);
}

template <class Cell, class Mode, int HP, int V = 0>
static int persist_launch_backward(const struct persist_bwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    auto kernel = seq_backward_kernel<Cell, Mode, HP, true, V>;
    if constexpr (V == 0)
        if (!a.vec)
            kernel = seq_backward_kernel<Cell, Mode, HP, false, 0>;
    long smem = Gm::B_SMEM;
    if (a.dw16) { // HP = 128, vector access or (ZF) any; TF32 with records
        if constexpr (HP != 128) {
            return RNND_EINVAL;
        } else {
            const int xk = RNND_DW16_XK(a.Il);
            if (a.H % 4 != 0 || a.Il < 1 || a.Il > 128 || (a.dw16_exp != nullptr) != Mode::SCALED)
                return RNND_EINVAL;
            if (a.zc) { // the LSTM on the forward's z: any gradients' alignment
                if constexpr (!Mode::SCALED || Gm::G != 4)
                    return RNND_EINVAL;
                else if (V != 0 && !a.vec)
                    return RNND_EINVAL;
                else if (a.l == 0 && a.zc_ex && xk == 64)
                    kernel = a.vec ? seq_backward_kernel<Cell, Mode, HP, true, V, true, true>
                                   : seq_backward_kernel<Cell, Mode, HP, false, 0, true, true>;
                else if (a.l > 0 && xk == 128) // x by the layer below's bound (XB)
                    kernel =
                        a.vec
                            ? seq_backward_kernel<Cell, Mode, HP, true, V, true, true, 128, true>
                            : seq_backward_kernel<Cell, Mode, HP, false, 0, true, true, 128, true>;
                else
                    return RNND_EINVAL;
            } else if (!a.vec) {
                return RNND_EINVAL;
            } else { // phase clocks (V) in the loop on the forward's z alone
                // TF32 mode above layer 0: x is the layer below's h, scaled by its bound (XB).
                const bool xb = Mode::SCALED && a.l > 0;
                kernel = xk == 64
                             ? (xb ? seq_backward_kernel<Cell, Mode, HP, true, 0, true, false, 64,
                                                         Mode::SCALED>
                                   : seq_backward_kernel<Cell, Mode, HP, true, 0, true, false, 64>)
                         : xb ? seq_backward_kernel<Cell, Mode, HP, true, 0, true, false, 128,
                                                    Mode::SCALED>
                              : seq_backward_kernel<Cell, Mode, HP, true, 0, true, false, 128>;
                smem += Mode::SCALED && !xb ? xk * sizeof(float) : 0; // xm
            }
        }
    }
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, smem, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

#endif // RNND_CUDA_SEQ_BACKWARD_CUH
