/*
 * seq_forward.cuh: the persistent, reset-aware forward time loop on mma.sync (one launch per
 * layer), templated over the cell, the matmul mode and HP, and its launcher; instantiated per
 * cell in seq_gru.cu and seq_lstm.cu. The mapping is seq_prims.cuh's.
 *
 * Per step (one __syncthreads, the A tiles double-buffered in shared memory):
 *   acc (16 x G*16 per warp) = h (16 x HP) . W_hh[warp's gate rows]^T and, apart,
 *   accx = x (16 x IP) . W_ih[warp's gate rows]^T (MMA, weights on chip): the input projection
 *   is fused (the loop reads x, not x W_ih^T) when I_l <= HP/2 and the weights fit; otherwise
 *   x W_ih^T comes precomputed from one cuBLAS GEMM. In TF32 mode the h part runs as fp16
 *   m16n8k16 MMAs on h scaled into fp16 (as exact as TF32, mode_f16), the x part as TF32.
 *   The GRU's fused TF32 loop at HP = 128 (KP) has twice the warps: per 16-unit group one runs
 *   the h part and one the x part (x rows scaled into fp16 per row, m16n8k16), the x part a
 *   step ahead (x staged two steps ahead through fp32 stages and one fp16 tile behind the
 *   x-warps' own barrier); they hand each other the partial sums of the other's row through
 *   shared memory (a 64-thread barrier per pair), and each runs the cell for one of the lane's
 *   two rows (see seq_forward_kernel).
 *   Then the cell from acc, accx and the biases; h' (c'); stores of y and the tape; the state
 *   of the next step, after the reset rule (a per-row select), and its x into the other tiles.
 */
#ifndef RNND_CUDA_SEQ_FORWARD_CUH
#define RNND_CUDA_SEQ_FORWARD_CUH

#include "seq_tape.cuh"

// ---------------------------------------------------------------------------------------------
// Forward kernel

// XF: the input projection is fused (a.xks x k-steps; the loop reads x, not a.xg). The layer
// input is read by the loop (a.x) when it is fused and when the tape copy of x is made here
// (a.xcopy); each thread then moves up to 4 of the 16 x I_l values of a step (I_l <= HP/2).
//
// KP (GRU, TF32, HP = 128, fused, vector access; persist_geom::F_KP): two warps per 16-unit
// group, 2*HP/16 warps a block. Of the pair (warps w16 and w16 ^ 4, so that each scheduler holds
// both kinds) the first (kh = 0) runs the h part for all 16 rows, the second (kh = 1) the x
// part on x rows scaled into fp16 (converted from an fp32 stage by the x-warps at the top of
// the step, behind their own 256-thread barrier); each hands its partner the partial sums of
// the partner's row (g + 8 for kh = 0, g for kh = 1: 2 NT floats a lane) through shared memory
// and a 64-thread barrier, and runs the cell for its own row, g + 8 kh, only: half the MMA
// chain and half the cell a warp, twice the warps to hide their latencies, no weights in
// registers (128 registers a thread at most).
//
// The x part runs a step ahead, so the h-warps do not wait for it. x is loaded two steps ahead into one of two
// fp32 stages (x(t+2) at the end of step t); at the top of step t the x-warps convert x(t+1)
// into the fp16 tile (their barrier 9) and, at the end of step t (after the cell, the stores and
// put_h, where the fewest registers are live), run the x part of step t+1, scale each row back
// by its 1/x scale and write the h-partner's row (g) into parity (t+1)&1 of the x slots and
// their own row (g+8) into their own exchange slot. The block barrier at the end of step t
// publishes both. Per step the pair then needs one direction only: the h-warp writes the h part
// of row g+8, bar.arrive; the x-warp bar.sync (64 threads, barrier 1+w) and reads it. The h-warp
// reads the x slot of parity t&1 (written before the last block barrier) without waiting; the
// two parities keep the x-warp's writes of step t+1 off the slot the h-warp may still read.
// At t = T-1 there is no step T: no conversion, no x part. Resets touch only h (the x part does
// not depend on the state); the tape's x copy is written with the stage (rows t+2, 0 and 1 in
// the prologue).
//
// ZC (TF32 mode, HP = 128, a layer above 0 on x W_ih^T: the LSTM's): z leaves as the dw16 chunks'
// z parts (a.zc, x 128 wide) instead of z rows, as the mma.sync backward (XB) would write them
// from the rows: h times hscale, x (the layer below's h, from a.x) times that layer's bound, the
// constant. Each warp loads x's columns 16 w + 2 tg, +1, +8, +9 of its rows a step ahead.
template <class Cell, class Mode, int HP, bool VEC, bool XF, int V = 0, bool KP = false,
          bool ZC = false>
static __global__ void __launch_bounds__((KP ? 2 : 1) * HP / 16 * 32, 1)
    seq_forward_kernel(const struct persist_fwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using HM = typename Gm::HM;
    using E = typename Mode::elem;
    using HE = typename Gm::helem;
    using WLH = persist_wlayout<Gm::F_HWPL>;
    using WLX = persist_wlayout<Gm::F_XWPL>;
    constexpr int G = Gm::G, NT = Gm::F_NT, KSH = Gm::F_KS, XKS = XF ? Gm::F_XKS : 0;
    constexpr int NW = Gm::NW, SW = Cell::SW, HLD = Gm::F_HLD;
    using TR = tape_rec<Cell, true>; // the persistent loops never run in ieee mode
    constexpr int THREADS = (KP ? 2 : 1) * Gm::THREADS;
    constexpr int NR = KP ? 1 : 2; // rows a thread runs the cell for
    static_assert(!KP || (XF && VEC && NW % 4 == 0 && (2 * NT) % 4 == 0), "KP instance");
    static_assert(!ZC || (!XF && !KP && HP == 128 && Mode::SCALED), "ZC instance");

    const int lane = threadIdx.x & 31, w16 = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    // The 16-unit group and, KP, the part (h 0, x 1) of this warp; its rows are g + 8 rowof(r).
    const int w = KP ? (w16 & 3) | ((w16 >> 3) << 2) : w16, kh = KP ? (w16 >> 2) & 1 : 0;
    auto rowof = [&](int r) { return KP ? kh : r; };
    const int H = a.H, T = a.T, L = a.L, l = a.l, GH = G * H, Il = a.Il;
    // KP: x goes to an fp32 stage (pitch HP/2), the x-warps convert it (convert_x).
    const int xks = XF ? a.xks : 0, xld = KP ? HP / 2 : Gm::f_xld(xks);
    const int u0 = w * 16 + 4 * tg;

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *wsm = smem, *wsmx = smem + KSH * Gm::F_HKS_BYTES;
    HE *htiles = reinterpret_cast<HE *>(smem + (KP ? Gm::F_KP_WBYTES : Gm::f_wbytes(xks)));
    E *xtiles = reinterpret_cast<E *>(smem + Gm::f_wbytes(xks) + Gm::F_HTILES_BYTES);
    // KP: the x stage (fp32), the x tile (fp16, row-scaled), 1/scale a row, the pair exchange.
    float *xstage = reinterpret_cast<float *>(smem + Gm::F_KP_STAGE);
    HE *x16 = reinterpret_cast<HE *>(smem + Gm::F_KP_XTILE);
    float *xinv = reinterpret_cast<float *>(smem + Gm::F_KP_XINV);
    float4 *xch = reinterpret_cast<float4 *>(smem + Gm::F_KP_XCH);
    if constexpr (KP)
        xtiles = reinterpret_cast<E *>(xstage);
    // KP: stage p (x of the steps of parity p), the x slots (x part of the h-warps' rows).
    float *xstage1 = reinterpret_cast<float *>(smem + Gm::F_KPXA_STAGE1);
    auto xstage_p = [&](int p) { return p ? xstage1 : xstage; };
    float4 *xslot = reinterpret_cast<float4 *>(smem + Gm::F_KPXA_XSLOT);

    // Weights as B fragments: B[k][n] = W_hh[q*H + unit(n)][k] (h k-steps) and W_ih[..][k]
    // (x k-steps), q the gate of n-tile nt = 2q + half. Scales (powers of two): wscale for
    // the weights, hscale for h in its fp16 tile; the accumulators are scaled back exactly.
    float wscale = 1.0f, hscale = 1.0f;
    if constexpr (Mode::SCALED)
        wscale = persist_wscale(a.w_hh, GH * H, XF ? a.w_ih : nullptr, XF ? GH * Il : 0,
                                reinterpret_cast<float *>(htiles));
    if constexpr (HM::SCALED)
        hscale = persist_hscale(a, a.l, reinterpret_cast<float *>(htiles));
    const float winv = 1.0f / wscale, hinv = winv * (1.0f / hscale);
    float xscale = 1.0f; // ZC: x's bound, the layer below's h scale
    if constexpr (ZC)
        xscale = persist_hscale(a, a.l - 1, reinterpret_cast<float *>(htiles));
    auto wpack_all = [&](auto mode, unsigned char *to, int ks, bool xpart) {
        using M = decltype(mode);
        uint32_t o[NT * M::WPF];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int q = nt >> 1, half = nt & 1;
            auto Bf = [&](int k, int n) -> float {
                int unit = persist_unit(w, half, n);
                if (unit >= H)
                    return 0.0f;
                if (!xpart)
                    return k < H ? __ldg(a.w_hh + (size_t)(q * H + unit) * H + k) : 0.0f;
                return k < Il ? __ldg(a.w_ih + (size_t)(q * H + unit) * Il + k) : 0.0f;
            };
            M::wpack(o + nt * M::WPF, Bf, ks, g, tg, wscale);
        }
        persist_wlayout<NT * M::WPF>::store(to, ks, NW, w, lane, o);
    };
    if (!KP || kh == 0) {
#pragma unroll 2
        for (int ks = 0; ks < KSH; ks++)
            wpack_all(HM(), wsm, ks, false);
    }
    if (!KP)
        for (int ks = 0; ks < xks; ks++)
            wpack_all(Mode(), wsmx, ks, true);
    else if (kh == 1)
        for (int ks = 0; ks < CEIL_DIV(Il, HM::KSTEP); ks++)
            wpack_all(HM(), wsmx, ks, true);

    // Biases of this thread's elements.
    float bi[G][4], bh[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        ld4<false>(bi[q], a.b_ih + q * H + u0, u0, H, true);
        ld4<false>(bh[q], a.b_hh + q * H + u0, u0, H, true);
    }

    // Per-row base pointers at step 0 (rows past B point at row 0 and are never accessed).
    bool rv[NR];
    size_t rbase[NR];
    const float *xgp[NR];
    float *yp[NR];
    const uint8_t *initp[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        int b = blockIdx.x * 16 + g + 8 * rowof(i);
        rv[i] = b < a.B;
        rbase[i] = (size_t)(rv[i] ? b : 0) * T;
        xgp[i] = XF ? nullptr : a.xg + rbase[i] * GH + u0;
        yp[i] = a.y + rbase[i] * a.ldy + u0;
        initp[i] = a.is_init + rbase[i];
    }
    const size_t hid_step = (size_t)L * H; // stride of one step in hidden/cell

    // The layer input this thread moves each step: one float4 (xv4: I_l % 4 == 0, aligned) or
    // up to 4 single values, element e of the block's 16 x I_l values of the step.
    const bool xin = a.x != nullptr && !ZC, xv4 = a.xvec;
    const float *xsrc[4];
    int xtile[4];
    float *xdst[4];
    bool xok[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int e = xv4 ? threadIdx.x * 4 + k : threadIdx.x + k * THREADS;
        int row = Il > 0 ? e / Il : 0, col = e - row * Il;
        size_t b = (size_t)blockIdx.x * 16 + row;
        xok[k] = xin && e < 16 * Il && b < (size_t)a.B;
        xsrc[k] = xok[k] ? a.x + b * T * a.ldx + col : nullptr;
        xdst[k] = xok[k] && a.xcopy ? a.z + b * T * a.ldz + a.xoff + col : nullptr;
        xtile[k] = row * xld + col;
    }
    float xv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto load_x = [&](int t) {
        if (xv4) {
            if (xok[0]) {
                float4 q = __ldg(reinterpret_cast<const float4 *>(xsrc[0] + (size_t)t * a.ldx));
                xv[0] = q.x, xv[1] = q.y, xv[2] = q.z, xv[3] = q.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (xok[k])
                    xv[k] = __ldg(xsrc[k] + (size_t)t * a.ldx);
        }
    };
    auto put_x = [&](E *tile, int t) { // into the A tile (fused) and the tape (xcopy)
        if (xv4) {
            if (xok[0]) {
                if (KP)
                    *reinterpret_cast<float4 *>(tile + xtile[0]) =
                        make_float4(xv[0], xv[1], xv[2], xv[3]);
                else if (XF)
                    Mode::put4(tile + xtile[0], xv);
                if (xdst[0])
                    *reinterpret_cast<float4 *>(xdst[0] + (size_t)t * a.ldz) =
                        make_float4(xv[0], xv[1], xv[2], xv[3]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (xok[k]) {
                    if (KP)
                        tile[xtile[k]] = xv[k];
                    else if (XF)
                        Mode::put(tile + xtile[k], xv[k]);
                    if (xdst[k])
                        xdst[k][(size_t)t * a.ldz] = xv[k];
                }
        }
    };

    // The state entering step 0 (reset rule): hidden[b, 0] when stored states are given, else
    // zero where is_init[b, 0], else h0 (c0) or zero.
    float h[NR][4], c[NR][4];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        zero4(h[i]);
        zero4(c[i]);
        size_t b = rbase[i] / (T > 0 ? T : 1);
        if (a.hidden) {
            ld4<VEC>(h[i], a.hidden + rbase[i] * hid_step + (size_t)l * H + u0, u0, H, rv[i]);
            if (a.cell)
                ld4<VEC>(c[i], a.cell + rbase[i] * hid_step + (size_t)l * H + u0, u0, H, rv[i]);
        } else if (a.h0 && rv[i] && !initp[i][0]) {
            ld4<VEC>(h[i], a.h0 + (b * L + l) * H + u0, u0, H, true);
            if (a.c0)
                ld4<VEC>(c[i], a.c0 + (b * L + l) * H + u0, u0, H, true);
        }
    }
    if constexpr (XF) {
        // Both x tiles start at zero (the padding past I_l stays so).
        for (int e = threadIdx.x; e < (KP ? 1 : 2) * 16 * xld; e += THREADS)
            Mode::put(xtiles + e, 0.0f);
        if constexpr (KP)
            for (int e = threadIdx.x; e < 16 * xld; e += THREADS)
                xstage1[e] = 0.0f;
        __syncthreads();
    }
    // KP, x-warps: an fp32 stage into the fp16 x tile, a half-warp a row (the x-warps' 256
    // threads), each row scaled by a power of two (its largest |x| in [2^13, 2^14): as exact as
    // TF32 for every x within 2^27 of it), and 1/scale a row; then the x-warps' barrier 9.
    auto convert_x = [&](const float *stage) {
        static_assert(!KP || (THREADS / 2 == 16 * 16 && HP / 2 == 64), "a half-warp a row");
        const int xt = w * 32 + lane, row = xt >> 4, cx = 4 * (xt & 15);
        float4 v = *reinterpret_cast<const float4 *>(stage + row * (HP / 2) + cx);
        const float inv = persist_row16<HM>(v, x16 + row * Gm::F_KP_XLD + cx);
        if ((lane & 15) == 0)
            xinv[row] = inv;
        asm volatile("bar.sync 9, %0;" ::"n"(THREADS / 2) : "memory"); // x-warps only
    };
    // KP, x-warps: the x part (HM's MMAs on the fp16 x tile) accumulated into cx.
    auto xmma = [&](float(&cx)[NT][4]) {
        persist_xmma<HM, WLH, Gm::F_KP_XKS>(cx, x16, Gm::F_KP_XLD, wsmx, CEIL_DIV(Il, HM::KSTEP),
                                            NW, w, lane);
    };
    // KP, x-warps: the x part of step tn from the converted tile, each row scaled back by its
    // 1/x scale (a power of two: exact), row g into parity tn&1 of the x slots (for the h-warp),
    // row g+8 into this warp's own exchange slot (for itself, next step).
    auto xahead = [&](int tn) {
        float cx[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            zero4(cx[nt]);
        xmma(cx);
        const float i0 = xinv[g], i1 = xinv[g + 8];
        float4 *xs = xslot + (size_t)(tn & 1) * (NW * (NT / 2) * 32) + w * 32 + lane;
        float4 *xo = xch + (size_t)w16 * 32 + lane;
#pragma unroll
        for (int v = 0; v < NT / 2; v++) {
            xs[v * NW * 32] = make_float4(cx[2 * v][0] * i0, cx[2 * v][1] * i0,
                                          cx[2 * v + 1][0] * i0, cx[2 * v + 1][1] * i0);
            xo[v * 16 * 32] = make_float4(cx[2 * v][2] * i1, cx[2 * v][3] * i1,
                                          cx[2 * v + 1][2] * i1, cx[2 * v + 1][3] * i1);
        }
    };
    // h (scaled) into the step's h tile.
    auto put_h = [&](HE *tile) {
#pragma unroll
        for (int i = 0; i < NR; i++) {
            float v[4] = {h[i][0] * hscale, h[i][1] * hscale, h[i][2] * hscale, h[i][3] * hscale};
            HM::put4(tile + (g + 8 * rowof(i)) * HLD + u0, v);
        }
    };
    put_h(htiles);
    if (xin) {
        load_x(0);
        put_x(xtiles, 0);
    }
    if constexpr (KP) {
        // x(0) converted and its x part run before the loop, x(1) staged (stage 1); the
        // barrier before the loop publishes the slots.
        __syncthreads();
        if (kh == 1 && T > 0) {
            convert_x(xstage_p(0));
            xahead(0);
        }
        if (xin && T > 1) {
            load_x(1);
            put_x(xstage_p(1), 1);
        }
    }

    // x W_ih^T of step 0 (not fused), and the reset flags and stored values of step 1.
    float xg[XF ? 1 : NR][G][4];
    if constexpr (!XF) {
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int q = 0; q < G; q++)
                ld4<VEC>(xg[i][q], xgp[i] + q * H, u0, H, rv[i]);
    }
    // ZC: x of rows g + 8 i, columns zcol, +1, +8, +9 (zeros past I_l and B), a step ahead.
    const int zcol = 16 * w + 2 * tg;
    float zx[ZC ? NR : 1][4];
    auto load_zx = [&](int t) {
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                const int col = zcol + 4 * j;
                float2 v = make_float2(0.0f, 0.0f);
                if (rv[i] && col < Il)
                    v = __ldg(reinterpret_cast<const float2 *>(a.x + (rbase[i] + t) * a.ldx + col));
                zx[i][j] = v.x, zx[i][j + 1] = v.y;
            }
    };
    if constexpr (ZC)
        load_zx(0);
    int nreset[NR];
    float nh[NR][4], nc[NR][4];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        zero4(nh[i]);
        zero4(nc[i]);
        bool ok = rv[i] && T > 1;
        nreset[i] = ld_flag(initp[i] + 1, ok);
        if (a.hidden) {
            size_t at = (rbase[i] + 1) * hid_step + (size_t)l * H + u0;
            ld4<VEC>(nh[i], a.hidden + at, u0, H, ok);
            if (a.cell)
                ld4<VEC>(nc[i], a.cell + at, u0, H, ok);
        }
    }
    // The first FREG h k-steps of weights stay in registers (48 GRU, 64 LSTM: less shared-memory
    // traffic a step; the thread reads back only what it stored itself). Fused loops only: the
    // others keep x W_ih^T in those registers; KP has no room for them.
    constexpr int FREG = XF && !KP ? (KSH < 4 ? KSH : 4) : 0;
    uint32_t wreg[FREG > 0 ? FREG : 1][Gm::F_HWPL];
#pragma unroll
    for (int ks = 0; ks < FREG; ks++)
        WLH::load(wreg[ks], wsm, ks, NW, w, lane);
    persist_clock<V> clk;
    __syncthreads();

    for (int t = 0; t < T; t++) {
        const HE *hcur = htiles + (t & 1) * (16 * HLD);
        HE *hnxt = htiles + ((t + 1) & 1) * (16 * HLD);
        const E *xcur = xtiles + (KP ? 0 : (t & 1) * (16 * xld));
        E *xnxt = xtiles + (KP ? 0 : ((t + 1) & 1) * (16 * xld));
        if constexpr (KP)
            xnxt = xstage_p(t & 1);     // x(t+2): (t+2)&1 == t&1
        constexpr int XAH = KP ? 2 : 1; // steps x is loaded ahead
        clk.start();
        if (xin && t + XAH < T)
            load_x(t + XAH); // in flight during the MMA
        // x two steps further into L2, a 128-byte line a lane of 8 (docs/kernels.md).
        if (xin && xv4 && t + XAH + 2 < T && xok[0] && (threadIdx.x & 7) == 0)
            prefetch_l2(xsrc[0] + (size_t)(t + XAH + 2) * a.ldx);

        // Gates for the warp's 2G n-tiles: h W_hh^T (acc) and, fused, x W_ih^T (accx) apart:
        // their scales differ, and the GRU's r multiplies the h part of n alone.
        float acc[NT][4], accx[XF ? NT : 1][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            zero4(acc[nt]);
#pragma unroll
        for (int nt = 0; nt < (XF ? NT : 1); nt++)
            zero4(accx[nt]);
        if (!KP || kh == 0) {
#pragma unroll
            for (int ks = 0; ks < KSH; ks++) {
                uint32_t af[4], wv[Gm::F_HWPL];
                HM::afrag(af, hcur, HLD, ks, lane);
                if (ks >= FREG)
                    WLH::load(wv, wsm, ks, NW, w, lane);
                const uint32_t *wp = ks < FREG ? wreg[ks < FREG ? ks : 0] : wv;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    HM::mma(acc[nt], af, HM::wunpack(wp + nt * HM::WPF));
            }
        }
        if constexpr (KP) {
            if (kh == 1 && t + 1 < T)
                convert_x(xstage_p((t + 1) & 1)); // x(t+1), for the x part at the end
        } else if constexpr (XF) {
            persist_xmma<Mode, WLX, XKS>(accx, xcur, xld, wsmx, xks, NW, w, lane);
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(acc[0][0] + acc[NT - 1][3], a.dbg);
            clk.mark(0);
        }
        // The row this thread runs the cell for: gh (h part) and gx (x part) of n-tile nt,
        // elements k = 0, 1 (units 2 half + k of its four), row g + 8 rowof(r).
        float gh[NR][NT][2], gx[XF ? NR : 1][XF ? NT : 1][2];
        if constexpr (KP) {
            // The h-warp sends the h part of row g+8 and reads the x part of row g (written
            // before the last block barrier); the x-warp waits for the h part of its row and
            // reads its own x part (its own slot).
            float4 *xo = xch + (size_t)w16 * 32 + lane;
            if (kh == 0) {
#pragma unroll
                for (int v = 0; v < NT / 2; v++)
                    xo[v * 16 * 32] = make_float4(acc[2 * v][2], acc[2 * v][3], acc[2 * v + 1][2],
                                                  acc[2 * v + 1][3]);
                asm volatile("bar.arrive %0, 64;" ::"r"(1 + w) : "memory");
                const float4 *xs = xslot + (size_t)(t & 1) * (NW * (NT / 2) * 32) + w * 32 + lane;
#pragma unroll
                for (int v = 0; v < NT / 2; v++) {
                    float4 q = xs[v * NW * 32];
                    gx[0][2 * v][0] = q.x, gx[0][2 * v][1] = q.y;
                    gx[0][2 * v + 1][0] = q.z, gx[0][2 * v + 1][1] = q.w;
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    gh[0][nt][0] = acc[nt][0], gh[0][nt][1] = acc[nt][1];
            } else {
                asm volatile("bar.sync %0, 64;" ::"r"(1 + w) : "memory");
                const float4 *xi = xch + (size_t)(w16 ^ 4) * 32 + lane;
#pragma unroll
                for (int v = 0; v < NT / 2; v++) {
                    float4 q = xi[v * 16 * 32], p = xo[v * 16 * 32];
                    gh[0][2 * v][0] = q.x, gh[0][2 * v][1] = q.y;
                    gh[0][2 * v + 1][0] = q.z, gh[0][2 * v + 1][1] = q.w;
                    gx[0][2 * v][0] = p.x, gx[0][2 * v][1] = p.y;
                    gx[0][2 * v + 1][0] = p.z, gx[0][2 * v + 1][1] = p.w;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int k = 0; k < 2; k++) {
                        gh[i][nt][k] = acc[nt][2 * i + k];
                        if constexpr (XF)
                            gx[i][nt][k] = accx[nt][2 * i + k];
                    }
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(gh[0][0][0] + gh[0][NT - 1][1], a.dbg);
            clk.mark(4);
        }

        // The cell, element by element.
        float hn[NR][4], cn[NR][4], sv[SW][NR][4];
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float xq[G], hq[G], s[SW];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const int nt = 2 * q + (j >> 1), e = j & 1;
                    float gxq;
                    if constexpr (XF)
                        gxq = gx[i][nt][e] * winv; // KP: already times the row's 1/x scale
                    else
                        gxq = xg[i][q][j];
                    xq[q] = gxq + bi[q][j];
                    hq[q] = gh[i][nt][e] * hinv + bh[q][j];
                }
                Cell::template forward<true>(xq, hq, h[i][j], c[i][j], hn[i][j], cn[i][j], s);
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = s[p];
            }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(hn[0][0] + hn[NR - 1][3], a.dbg);
            clk.mark(1);
        }

        // Next step's x W_ih^T (not fused): in flight during the next MMA.
        if constexpr (!XF) {
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int q = 0; q < G; q++)
                    ld4<VEC>(xg[i][q], xgp[i] + (size_t)(t + 1) * GH + q * H, u0, H,
                             rv[i] && t + 1 < T);
        }

        // Outputs and tape.
        if constexpr (ZC) {
            unsigned char *zc = static_cast<unsigned char *>(a.zc) +
                                ((size_t)blockIdx.x * T + t) * RNND_DW16_Z(128);
#pragma unroll
            for (int i = 0; i < NR; i++) {
                const float hv[4] = {
                    rv[i] ? h[i][0] * hscale : 0.0f, rv[i] ? h[i][1] * hscale : 0.0f,
                    rv[i] ? h[i][2] * hscale : 0.0f, rv[i] ? h[i][3] * hscale : 0.0f};
                const float xv[4] = {zx[i][0] * xscale, zx[i][1] * xscale, zx[i][2] * xscale,
                                     zx[i][3] * xscale};
                dw16_put<true>(zc + i * 128 + 2 * w * 256, hv, lane);
                dw16_put<true>(zc + i * 128 + (16 + 2 * w) * 256, xv, lane);
                if (w == 0) // the constant: the h scale
                    dw16_put_one(zc + i * 128 + (16 + 128 / 8) * 256, lane,
                                 HM::pack2(hscale, hscale));
            }
            if (t + 1 < T)
                load_zx(t + 1); // in flight during the next step's MMAs
        }
#pragma unroll
        for (int i = 0; i < NR; i++) {
            size_t r = rbase[i] + t;
            st4<VEC>(yp[i] + (size_t)t * a.ldy, hn[i], u0, H, rv[i]);
            if (a.z) {
                float *zr = a.z + r * a.ldz;
                st4<VEC>(zr + u0, h[i], u0, H, rv[i]);
                if (u0 == 0 && rv[i]) {
                    zr[H] = 1.0f;
                    for (int k = H + 1; k < a.xoff; k++)
                        zr[k] = 0.0f;
                    for (int k = a.xoff + a.Il; k < a.ldz; k++)
                        zr[k] = 0.0f;
                }
            }
            if (a.s) {
#pragma unroll
                for (int p = 0; p < SW; p++)
                    TR::template st4<VEC>(a.s + r * TR::floats(H), p, sv[p][i], u0, H, rv[i]);
            }
        }

        if (t + 1 < T) {
            // The state entering step t+1: the reset value where is_init[b, t+1], else h'.
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    h[i][j] = nreset[i] ? nh[i][j] : hn[i][j];
                    c[i][j] = nreset[i] ? nc[i][j] : cn[i][j];
                }
            put_h(hnxt);
            if (xin && (!KP || t + 2 < T))
                put_x(xnxt, t + XAH);
                // Flags and stored values of step t+2, used at the end of the next step.
#pragma unroll
            for (int i = 0; i < NR; i++) {
                bool ok = rv[i] && t + 2 < T;
                nreset[i] = ld_flag(initp[i] + t + 2, ok);
                if (a.hidden) {
                    size_t at = (rbase[i] + t + 2) * hid_step + (size_t)l * H + u0;
                    ld4<VEC>(nh[i], a.hidden + at, u0, H, ok);
                    if (a.cell)
                        ld4<VEC>(nc[i], a.cell + at, u0, H, ok);
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < NR; i++) {
                size_t at = (rbase[i] / T * L + l) * H + u0;
                if (a.h_n)
                    st4<VEC>(a.h_n + at, hn[i], u0, H, rv[i]);
                if (a.c_n)
                    st4<VEC>(a.c_n + at, cn[i], u0, H, rv[i]);
            }
        }
        if constexpr (KP)
            if (kh == 1 && t + 1 < T)
                xahead(t + 1); // the x part of step t+1 (its tile converted at the top)
        clk.mark(2);
        __syncthreads();
        clk.mark(3);
    }
    clk.flush(a.dbg);
}

// ---------------------------------------------------------------------------------------------
// Launchers, one per (cell, mode, HP): raise the shared-memory limit, launch, check.

// KP: the K split over warp pairs with the x part a step ahead (fused, vector access only; the
// caller checks).
template <class Cell, class Mode, int HP, int V = 0, bool KP = false>
static int persist_launch_forward(const struct persist_fwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    int xks = a.xks > 0 && a.xks <= Gm::F_XKS ? a.xks : 0;
    if (a.xks != xks || (xks == 0 && a.xg == nullptr))
        return RNND_EINVAL;
    if constexpr (KP) {
        if (!xks || !a.vec)
            return RNND_EINVAL;
        auto kernel = seq_forward_kernel<Cell, Mode, HP, true, true, V, true>;
        long smem = Gm::f_smem_kpxa();
        RNND_CUDA_TRY(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kernel<<<CEIL_DIV(a.B, 16), 2 * Gm::THREADS, smem, stream>>>(a);
        CUDA_LAUNCH_CHECK();
        return 0;
    }
    if (a.zc) { // ZC: the LSTM's layers above 0 in TF32 mode, vector access
        if constexpr (HP != 128 || !Mode::SCALED || Gm::G != 4) {
            return RNND_EINVAL;
        } else {
            if (xks || !a.vec || a.l < 1 || a.Il <= 64 || a.Il > 128 || a.Il % 4 != 0 ||
                a.x == nullptr || a.ldx % 2 != 0)
                return RNND_EINVAL;
            auto kernel = seq_forward_kernel<Cell, Mode, HP, true, false, V, false, true>;
            long smem = Gm::f_smem(0);
            RNND_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem));
            kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, smem, stream>>>(a);
            CUDA_LAUNCH_CHECK();
            return 0;
        }
    }
    // Variants exist with vector access only (the dispatcher asks for them only then).
    auto kernel = xks ? seq_forward_kernel<Cell, Mode, HP, true, true, V>
                      : seq_forward_kernel<Cell, Mode, HP, true, false, V>;
    if constexpr (V == 0)
        if (!a.vec)
            kernel = xks ? seq_forward_kernel<Cell, Mode, HP, false, true>
                         : seq_forward_kernel<Cell, Mode, HP, false, false>;
    long smem = Gm::f_smem(xks);
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, smem, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// Shared memory of one launch (forward with xks fused x k-steps), or -1 when xks is more than
// the loop takes.
template <class Cell, class Mode, int HP>
static long persist_smem(bool backward, int xks) {
    using Gm = persist_geom<Cell, Mode, HP>;
    if (backward)
        return Gm::B_SMEM;
    if (xks < 0 || xks > Gm::F_XKS)
        return -1;
    // KP: its own layout (the x part a step ahead needs two stages and the x slots).
    return Gm::F_KP && xks > 0 ? Gm::f_smem_kpxa() : Gm::f_smem(xks);
}

#endif // RNND_CUDA_SEQ_FORWARD_CUH
