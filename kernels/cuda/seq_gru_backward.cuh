/*
 * seq_gru_backward.cuh: the GRU's backward time loop at H = 128 (seq_gru_h128_backward_kernel)
 * and its launchers. One 16-bit copy of W_hh serves both directions (ldmatrix and
 * ldmatrix.trans). It either recomputes each step's gates from hprev and x (the z rows), so the
 * forward writes no gate planes (seq_gru.cu instantiates it), or (ZF) reads the gate planes and
 * z's chunk parts that the wgmma forward wrote, recomputing nothing, with dh on warpgroup MMAs
 * (sm_90a: seq_gru_gate_tape.cu instantiates it). See the kernel's comment.
 */
#ifndef RNND_CUDA_SEQ_GRU_BACKWARD_CUH
#define RNND_CUDA_SEQ_GRU_BACKWARD_CUH

#include "seq_tape.cuh"

// ---------------------------------------------------------------------------------------------
// The GRU backward at H = 128: gates recomputed, or read from the wgmma forward's tape

// The unit a storage position of a 16-unit group holds: position 8 half + n holds the unit of
// column n of n-tile `half` (persist_unit), so that 8 consecutive positions are one n-tile.
static __device__ __forceinline__ int gru_h128_unit(int pos) {
    int n = pos & 7, half = (pos >> 3) & 1;
    return (pos & ~15) + 4 * (n >> 1) + 2 * half + (n & 1);
}

// The m16k16 A fragments of a dw16 chunk's columns [c0, c0 + 16), its 16 rows: a core matrix
// holds one column's 8 rows, so ldmatrix.trans gives the row-major fragments (matrix m: column
// group c0 / 8 + m / 2, row half m % 2).
static __device__ __forceinline__ void zc_afrag(uint32_t a[4], const unsigned char *chunk, int c0,
                                                int lane) {
    const int m = lane >> 3;
    ldmatrix_x4_at<true>(a, chunk + (c0 / 8 + (m >> 1)) * 256 + (m & 1) * 128 + (lane & 7) * 16);
}

// One copy of W_hh serves both directions: stored row-major as 16-bit values (fp16 scaled as in
// the forward, or bf16), rows (gate rows) and columns (units) both in storage order
// (gru_h128_unit), pitch HP + 8 elements (16 bytes mod 128: conflict-free ldmatrix). The
// recompute (h W_hh^T) reads it with ldmatrix (rows are n), dh = tile . W_hh with ldmatrix.trans
// (rows are k); both MMAs are m16n8k16 on 16-bit operands, so the dh-gate tile is 16-bit too,
// each row scaled by a power of two (its largest |value| in [2^13, 2^14)) in fp16.
// XM: the mode of the x part: Mode's, or (XH, TF32 mode) HM's on x rows scaled into fp16 per
// row by a power of two, converted from an fp32 stage (XS) between the step's two barriers.
template <class Mode, int HP, class XM = Mode>
struct gru_h128_geom {
    using HM = typename Mode::hmode;
    static constexpr bool XH = !std::is_same<XM, Mode>::value;
    using helem = typename HM::elem;
    static constexpr int G = 3, NW = HP / 16, THREADS = NW * 32;
    static constexpr int WLD = HP + 8;
    static constexpr long W_BYTES = (long)G * HP * WLD * 2;
    static constexpr int XKS = HP / 2 / XM::KSTEP;
    static constexpr int F_NT = 2 * G;
    static constexpr int F_XWPL = F_NT * XM::WPF;
    static constexpr long X_KS_BYTES = (long)F_XWPL * 4 * 32 * NW;
    static constexpr long WX_BYTES = XKS * X_KS_BYTES;
    static constexpr int ALD = G * HP + 8;
    static constexpr long A_BYTES = 16L * ALD * 2;
    static constexpr int HLD = HP + 8;
    static constexpr long H_BYTES = 2 * 16L * HLD * 2; // two steps' tiles (by step parity)
    static constexpr int XLD = HP / 2 + XM::APAD;
    static constexpr long X_BYTES = 2 * 16L * XLD * (long)sizeof(typename XM::elem);
    static constexpr long XS_BYTES = XH ? 16L * (HP / 2) * 4 + 2 * 16 * 4 : 0; // stage, 1/scales
    static constexpr long XCH_BYTES = NW * 2L * 32 * 16;
    static constexpr long RMAX_BYTES = NW * 16L * 4;
    static constexpr long SMEM =
        W_BYTES + WX_BYTES + A_BYTES + H_BYTES + X_BYTES + XS_BYTES + XCH_BYTES + RMAX_BYTES;
    static constexpr int KS = G * HP / 16; // k16-steps of dh = tile . W_hh
    static constexpr int KSW = KS / 2;     // a warp's half (warp pairs split K, as persist_geom)
    static_assert(SMEM <= RNND_PERSIST_SMEM_BUDGET, "rc backward does not fit");
    static_assert(KS % 2 == 0 && NW % 2 == 0, "backward K split needs warp pairs");
};

// Per step in reverse: gate gradients from the recomputed gates (registers) -> D (stores) and the
// 16-bit dh-gate tile; hprev, x of step t-1 into their tiles; barrier; row scales, tile; barrier;
// dh = tile . W_hh (K split over warp pairs) interleaved with the recompute of step t-1's gates
// (h W_hh^T, x W_ih^T: independent of dh); routing; the cell of step t-1.
// Phase clocks (V = SEQ_CLOCKS): gate gradients and D stores; tile puts, loads and the first
// barrier; row scales, 16-bit tile and the second barrier; both MMAs and the pair exchange;
// routing; the recompute's cell.
// DW: D and z leave as dw16 chunks (seq_chunks.h) instead of D in fp32: bf16, or (TF32 mode)
// fp16 with exponent records.
// ZF (with DW): the forward wrote z's chunk parts, in TF32 mode x's exponents (a.zc_ex), and the
// tape's fp16 planes (a.s: the gates' pre-activations and hn), so the loop recomputes nothing
// (docs/kernels.md): each step's chunk h part and its rows' planes come by bulk copies into one of two
// slots (over W_ih's space), a step ahead; ldmatrix.trans of the h part gives each thread's
// hprev (the chunks' column order is the loop's storage order: docs/kernels.md), in 16 bits, so the
// cell's (hprev - n) carries fp16's 2^-12 (bf16's 2^-9: docs/kernels.md). Without the recompute's MMAs
// the registers hold the warp's W_hh fragments for dh. It writes D's parts and the records alone.
// Its dh runs on warpgroup MMAs with the gates beside them (docs/kernels.md), so it is sm_90a code:
// seq_gru_gate_tape.cu builds it.
// HU (ZF): HP, or 64 for a layer of H <= 64 (padded to HP): dh's MMAs leave out the k-steps over
// the gate columns of units past HU, which the tile holds as zeros.
template <class Mode, int HP, bool VEC, bool XH, int V = 0, bool DW = false, bool ZF = false,
          int HU = HP>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_gru_h128_backward_kernel(const struct persist_bwd_args a) {
    using HM = typename Mode::hmode;
    using XM = typename std::conditional<XH, HM, Mode>::type;
    using Gm = gru_h128_geom<Mode, HP, XM>;
    using HE = typename Gm::helem;
    using E = typename XM::elem;
    static_assert(!XH || (Gm::THREADS == 256 && HP / 2 == 64), "x stage: a half-warp a row");
    using WLX = persist_wlayout<Gm::F_XWPL>;
    using Cell = cell_gru;
    constexpr int G = Gm::G, NW = Gm::NW, WLD = Gm::WLD, ALD = Gm::ALD, HLD = Gm::HLD;
    constexpr int XLD = Gm::XLD, KSW = Gm::KSW, FNT = Gm::F_NT, SW = Cell::SW;
    constexpr int FKS = HP / 16, XKS = Gm::XKS;

    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *at = smem;
    HE *wsm = reinterpret_cast<HE *>(at);
    unsigned char *wsmx = (at += Gm::W_BYTES);
    HE *atile = reinterpret_cast<HE *>(at += Gm::WX_BYTES);
    HE *htile = reinterpret_cast<HE *>(at += Gm::A_BYTES);
    E *xtile = reinterpret_cast<E *>(at += Gm::H_BYTES);
    float *xstage = reinterpret_cast<float *>(at += Gm::X_BYTES);
    float *xinv = xstage + 16 * (HP / 2); // two steps' 16 row inverse scales
    float4 *xch = reinterpret_cast<float4 *>(at += Gm::XS_BYTES);
    float *rmax = reinterpret_cast<float *>(at += Gm::XCH_BYTES);
    // ZF: step s's chunk h part (core-matrix groups 0..15) and its 16 rows' planes (a row
    // ZPL bytes apart: conflict-free 8-byte reads of 8 rows; ZPR for H = HP, a row's planes H
    // wide as the tape holds them) in slot s & 1, over W_ih's space.
    static_assert(!ZF || DW, "z from the forward: the chunks' loop");
    using TR = tape_rec<Cell, true>;
    constexpr int ZCB = 16 * 256, ZPR = Cell::SW * HP * 2, ZPL = ZPR + 32, ZSL = ZCB + 16 * ZPL;
    static_assert(!ZF || 2 * ZSL + 16 <= Gm::WX_BYTES, "slots");
    static_assert(!ZF || (16L * G * HP * 2 <= Gm::A_BYTES &&
                          NW * 16L * 24 * 4 <= Gm::H_BYTES + Gm::X_BYTES + Gm::XS_BYTES),
                  "ZF: the MMAs' tile, the transposes");
    unsigned char *zslot = wsmx;
    uint64_t *zbar = reinterpret_cast<uint64_t *>(zslot + 2 * ZSL);
    (void)zbar; // sm_90 code only

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l, Il = a.Il, xks = CEIL_DIV(Il, XM::KSTEP);
    const int u0 = w * 16 + 4 * tg;
    const int kh = w & 1, pair = w >> 1;

    // Scales as the forward's: wscale over W_hh and W_ih, hscale for h in its fp16 tile.
    float wscale = 1.0f, hscale = 1.0f;
    if constexpr (Mode::SCALED)
        wscale =
            persist_wscale(a.w_hh, G * H * H, a.w_ih, G * H * Il, reinterpret_cast<float *>(htile));
    if constexpr (HM::SCALED)
        hscale = persist_hscale(a, a.l, reinterpret_cast<float *>(htile));
    const float winv = 1.0f / wscale, hsinv = 1.0f / hscale, hinv = winv * hsinv;

    // W_hh in storage order (pairs of units are adjacent in it), W_ih as the forward's x
    // fragments. Unrolled, for loads in flight (one pair at a time took ~2% of the loop).
#pragma unroll 4
    for (int e = threadIdx.x; e < G * HP * (HP / 2); e += blockDim.x) {
        int pr = e / (HP / 2), pc = 2 * (e - pr * (HP / 2));
        int q = pr / HP, row = gru_h128_unit(pr - q * HP), col = gru_h128_unit(pc);
        float lo = 0.0f, hi = 0.0f;
        if (row < H && col < H) {
            const float *src = a.w_hh + (size_t)(q * H + row) * H + col;
            lo = __ldg(src) * wscale;
            hi = col + 1 < H ? __ldg(src + 1) * wscale : 0.0f;
        }
        *reinterpret_cast<uint32_t *>(wsm + (size_t)pr * WLD + pc) = HM::pack2(lo, hi);
    }
    for (int ks = 0; ks < (ZF ? 0 : xks); ks++) {
        uint32_t o[Gm::F_XWPL];
#pragma unroll
        for (int nt = 0; nt < FNT; nt++) {
            const int q = nt >> 1, half = nt & 1;
            auto Bf = [&](int k, int n) -> float {
                int unit = persist_unit(w, half, n);
                return unit < H && k < Il ? __ldg(a.w_ih + (size_t)(q * H + unit) * Il + k) : 0.0f;
            };
            XM::wpack(o + nt * XM::WPF, Bf, ks, g, tg, wscale);
        }
        WLX::store(wsmx, ks, NW, w, lane, o);
    }
    float bi[G][4], bh[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        ld4<false>(bi[q], a.b_ih + q * H + u0, u0, H, true);
        ld4<false>(bh[q], a.b_hh + q * H + u0, u0, H, true);
    }
    const int nrows = a.B - (int)blockIdx.x * 16 < 16 ? a.B - (int)blockIdx.x * 16 : 16;
    if constexpr (ZF) { // the planes of rows past B (never copied) stay zero
        for (int e = threadIdx.x; e < 2 * 16 * ZPL / 4; e += blockDim.x) {
            const int sl = e / (16 * ZPL / 4), row = e / (ZPL / 4) % 16;
            if (row >= nrows)
                reinterpret_cast<uint32_t *>(zslot + sl * ZSL + ZCB)[e - sl * (16 * ZPL / 4)] = 0u;
        }
    } else {
        for (int e = threadIdx.x; e < 2 * 16 * XLD; e += blockDim.x)
            XM::put(xtile + e, 0.0f); // the padding past I_l stays zero
        if constexpr (XH)
            for (int e = threadIdx.x; e < 16 * (HP / 2) + 32; e += blockDim.x)
                xstage[e] = e < 16 * (HP / 2) ? 0.0f : 1.0f;
    }

    bool rv[2];
    size_t rbase[2], bidx[2];
    persist_rows2(rv, bidx, rbase, a.B, T, g);
    // The x values this thread moves each step: one float4 of the block's 16 x I_l.
    const int xe = threadIdx.x * 4, xrow = Il > 0 ? xe / Il : 0, xcol = xe - xrow * Il;
    const bool xok = xe < 16 * Il && blockIdx.x * 16 + xrow < a.B;
    const float *xsrc =
        xok ? a.z + (size_t)(blockIdx.x * 16 + xrow) * T * a.ldz + a.xoff + xcol : nullptr;

    float dh[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(dh[i]);
        if (a.gh_n)
            ld4<VEC>(dh[i], a.gh_n + (bidx[i] * L + l) * H + u0, u0, H, rv[i]);
    }

    // Step t's gates (recomputed), output gradient, hprev and flag; hprev and x of the step
    // the next recompute is for (zh, zx: loaded a step ahead).
    float sv[SW][2][4], gy[2][4], hp[2][4], zh[2][4], zx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int reset[2];
    auto load_gy = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            size_t r = rbase[i] + t;
            ld4<VEC>(gy[i], a.gy + r * a.ldgy + u0, u0, H, rv[i]);
            reset[i] = ld_flag(a.is_init + r, rv[i]);
        }
    };
    auto load_z = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++)
            ld4<VEC>(zh[i], a.z + (rbase[i] + t) * a.ldz + u0, u0, H, rv[i]);
        if (xok) {
            float4 q = __ldg(reinterpret_cast<const float4 *>(xsrc + (size_t)t * a.ldz));
            zx[0] = q.x, zx[1] = q.y, zx[2] = q.z, zx[3] = q.w;
        }
    };
    // zh, zx (of step s) into step s's h and x tiles (h scaled; units in storage order). Two
    // of each: a tile is written in the iteration that reads it, between its two barriers, and
    // the next write of the same one is two iterations later.
    auto put_z = [&](int s) {
        HE *ht = htile + (s & 1) * (16 * HLD);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint32_t *p = reinterpret_cast<uint32_t *>(ht + (g + 8 * i) * HLD + 16 * w + 2 * tg);
            p[0] = HM::pack2(zh[i][0] * hscale, zh[i][1] * hscale);
            p[4] = HM::pack2(zh[i][2] * hscale, zh[i][3] * hscale);
        }
        if (xok) {
            if constexpr (XH)
                *reinterpret_cast<float4 *>(xstage + xrow * (HP / 2) + xcol) =
                    make_float4(zx[0], zx[1], zx[2], zx[3]);
            else
                XM::put4(xtile + (s & 1) * (16 * XLD) + xrow * XLD + xcol, zx);
        }
    };
    // XH: step s's x stage into its fp16 tile, each row scaled (largest |x| in [2^13, 2^14));
    // a half-warp a row, between the step's barriers.
    auto convert_x = [&](int s) {
        if constexpr (XH) {
            const int row = threadIdx.x >> 4, c = 4 * (threadIdx.x & 15);
            float4 v = *reinterpret_cast<const float4 *>(xstage + row * (HP / 2) + c);
            const float inv = persist_row16<HM>(v, xtile + (s & 1) * (16 * XLD) + row * XLD + c);
            if ((threadIdx.x & 15) == 0)
                xinv[(s & 1) * 16 + row] = inv;
        } else {
            (void)s;
        }
    };
    // ZF: step s's chunk into its slot (one thread issues the bulk copy; it is the slot's
    // ((T - 1 - s) / 2)-th), the wait for it, and hprev from it (this thread's units of rows g,
    // g + 8: the A fragments of the warp's 16 columns). zex, zexr: step t's x exponents (rows g,
    // g + 8; warp 4's record: row lane % 16), nzex, nzexr step t - 1's.
    int zex[2] = {0, 0}, zexr = 0, nzex[2] = {0, 0}, nzexr = 0;
    auto zc_fetch = [&](int s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        unsigned char *sl = zslot + (s & 1) * ZSL;
        const long zcs = RNND_DW16_Z(RNND_DW16_XK(Il)); // a chunk's z parts, x as wide as I_l's
        const int zpr = Cell::SW * H * 2;               // the bytes of a row's planes
        if (threadIdx.x == 0) {
            mbar_expect_tx(zbar + (s & 1), ZCB + nrows * zpr);
            mbar_arrive(zbar + (s & 1));
            bulk_g2s(sl,
                     static_cast<const unsigned char *>(a.zc) + ((size_t)blockIdx.x * T + s) * zcs,
                     ZCB, zbar + (s & 1));
        }
        // Row 2w + lane's planes: two copies a warp (the 16 from warp 0 held it ~900 cycles,
        // and every warp with it at the next barrier).
        const int row = 2 * w + lane;
        if (lane < 2 && row < nrows)
            bulk_g2s(sl + ZCB + row * ZPL,
                     a.s + ((size_t)(blockIdx.x * 16 + row) * T + s) * TR::floats(H), zpr,
                     zbar + (s & 1));
#else
        (void)s;
        __trap(); // never launched: ZF needs sm_90 (the plan asks for it on compute 9.0 only)
#endif
    };
    auto zc_wait = [&](int s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        mbar_wait(zbar + (s & 1), ((T - 1 - s) >> 1) & 1);
#else
        (void)s;
#endif
    };
    auto zc_load_ex = [&](int s) {
        if constexpr (XH) {
            const int16_t *e = a.zc_ex + ((size_t)blockIdx.x * T + s) * 16;
            nzex[0] = e[g], nzex[1] = e[g + 8], nzexr = e[lane & 15];
        }
    };
    auto zc_hprev = [&](int s) {
        uint32_t f[4];
        zc_afrag(f, zslot + (s & 1) * ZSL, 16 * w, lane);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float2 lo = HM::unpack2(f[i]), up = HM::unpack2(f[2 + i]);
            hp[i][0] = lo.x * hsinv, hp[i][1] = lo.y * hsinv;
            hp[i][2] = up.x * hsinv, hp[i][3] = up.y * hsinv;
        }
    };
    // ZF: step s's gates from its planes in the slot (rows g, g + 8, units u0..u0+3; zeros
    // from H on).
    auto zc_cell = [&](int s) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const unsigned char *row = zslot + (s & 1) * ZSL + ZCB + (g + 8 * i) * ZPL;
            float v[SW][4];
#pragma unroll
            for (int p = 0; p < SW; p++)
                TR::unpack4(v[p], u0 < H ? *reinterpret_cast<const uint2 *>(row + (p * H + u0) * 2)
                                         : make_uint2(0u, 0u));
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = Cell::template gate<true>(p, v[p][j]);
        }
    };
    float acc[FNT][4], accx[FNT][4];
    // h W_hh^T and x W_ih^T of the tiles' step, as the forward's (warp w: its 16 units of each
    // gate; n-tile 2q + half).
    auto gates_mma = [&](int s) {
        const HE *ht = htile + (s & 1) * (16 * HLD);
        const E *xt = xtile + (s & 1) * (16 * XLD);
#pragma unroll
        for (int nt = 0; nt < FNT; nt++) {
            zero4(acc[nt]);
            zero4(accx[nt]);
        }
        const int m = lane >> 3, r = lane & 7;
#pragma unroll
        for (int ks = 0; ks < FKS; ks++) {
            uint32_t af[4];
            ldmatrix_x4(af, ht, HLD, ks * 16, 8, lane);
#pragma unroll
            for (int q = 0; q < G; q++) {
                uint32_t b[4];
                ldmatrix_x4_at<false>(b, wsm + (size_t)(q * HP + 16 * w + 8 * (m >> 1) + r) * WLD +
                                             ks * 16 + 8 * (m & 1));
                HM::mma(acc[2 * q], af, make_uint2(b[0], b[1]));
                HM::mma(acc[2 * q + 1], af, make_uint2(b[2], b[3]));
            }
        }
        persist_xmma<XM, WLX, XKS>(accx, xt, XLD, wsmx, xks, NW, w, lane);
    };
    // The forward's cell on those sums: the step's gates r, z, n, hn.
    auto gates_cell = [&](int st) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float xw = XH ? winv * xinv[(st & 1) * 16 + g + 8 * i] : winv;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float xq[G], hq[G], s[SW], hn, cn;
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const int nt = 2 * q + (j >> 1), e = 2 * i + (j & 1);
                    xq[q] = accx[nt][e] * xw + bi[q][j];
                    hq[q] = acc[nt][e] * hinv + bh[q][j];
                }
                Cell::template forward<true, true, XH>(xq, hq, 0.0f, 0.0f, hn, cn, s);
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = s[p];
            }
        }
    };

    // Step T-1's gates before the loop.
    __syncthreads(); // the x tiles' zeros before their first values
    load_gy(T - 1);
    if constexpr (ZF) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (threadIdx.x == 0) {
            mbar_init(zbar, 1), mbar_init(zbar + 1, 1);
            fence_mbar_init();
        }
#endif
        __syncthreads(); // weights in place, the slots' mbarriers ready
        zc_fetch(T - 1);
        if (T > 1)
            zc_fetch(T - 2);
        zc_load_ex(T - 1);
        zc_wait(T - 1);
        zc_hprev(T - 1);
        zc_cell(T - 1);
    } else {
        load_z(T - 1);
        put_z(T - 1);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                hp[i][j] = zh[i][j];
        if (T > 1)
            load_z(T - 2);
        __syncthreads(); // weights and tiles in place
        if constexpr (XH) {
            convert_x(T - 1);
            __syncthreads();
        }
        gates_mma(T - 1);
        gates_cell(T - 1);
    }
    zex[0] = nzex[0], zex[1] = nzex[1], zexr = nzexr;
    // dh's B fragments (W_hh rows kk 16.., the pair's columns), from shared memory.
    const int bm = lane >> 3, br = lane & 7;
    auto dh_b = [&](uint32_t b[4], int ks, int j) {
        const int kk = kh * KSW + ks;
        ldmatrix_x4_at<true>(b, wsm + (size_t)(kk * 16 + 8 * (bm & 1) + br) * WLD +
                                    16 * (2 * pair + j) + 8 * (bm >> 1));
    };
    // ZF: dh^T = W_hh^T tile^T on warpgroup MMAs (m64n16k16; sm_90a, docs/kernels.md). Warpgroup
    // w / 4 takes output positions [64 (w / 4), +64) as its M rows, warp w its 16 (rows g, g + 8:
    // positions 16 w + g, + 8); its A fragments, W_hh^T over all 2 KSW k-steps, stay in
    // registers (ldmatrix.trans of W_hh's rows k: a0 = positions 16 w + g at k = 16 ks + 2 tg,
    // + 1; a1 the positions + 8; a2, a3 the same at k + 8). The tile is the B operand, K-major in
    // core matrices (km_off), rows the batch rows.
    uint32_t wa[ZF ? 2 * KSW : 1][4];
    if constexpr (ZF) {
#pragma unroll
        for (int ks = 0; ks < 2 * KSW; ks++)
            ldmatrix_x4_at<true>(wa[ks], wsm + (size_t)(16 * ks + br + 8 * (bm >> 1)) * WLD +
                                             16 * w + 8 * (bm & 1));
    }
    persist_clock<V> clk;

    for (int t = T - 1; t >= 0; t--) {
        clk.start();
        // Gate gradients of step t, the row maxima of the tile part.
        float ddir[2][4], tv[G][2][4];
        float rm[2] = {0.0f, 0.0f};
        int ed[2]; // DW, TF32 mode: the exponents of this warp's groups of the two row halves
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float dv[4][4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float s[SW], d[4], tl[G], dcp;
#pragma unroll
                for (int p = 0; p < SW; p++)
                    s[p] = sv[p][i][j];
                Cell::template backward<true, true>(s, hp[i][j], gy[i][j] + dh[i][j], 0.0f, d, tl,
                                                    ddir[i][j], dcp);
                bool live = rv[i] && u0 + j < H;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    dv[p][j] = d[p];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    tv[q][i][j] = live ? tl[q] : 0.0f;
                    rm[i] = fmaxf(rm[i], fabsf(tv[q][i][j]));
                }
            }
            if constexpr (DW) {
                // D's 4 planes and z's h part of this row half (rows past B: zeros); in TF32
                // mode D scaled by its (row, warp) group's power of two (shuffles over the 4
                // lanes of the row: no barrier), h by the block's.
                float ds = 1.0f;
                if constexpr (XH) {
                    const float *const pl[4] = {dv[0], dv[1], dv[2], dv[3]};
                    ds = dw16_dscale(pl, rv[i], ed[i]);
                }
                dw16_put_dh<64, XH, !ZF>(
                    a.dw16, a.dw16_pitch, (size_t)blockIdx.x * T + t, w, i, lane, rv[i],
                    [&](int p) -> const float * { return dv[p]; }, hp[i], ds, XH ? hscale : 1.0f);
            } else {
                size_t r = rbase[i] + t;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    st4<VEC>(a.d + r * (4 * H) + p * H + u0, dv[p], u0, H, rv[i]);
            }
        }
        if constexpr (ZF && XH)
            dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane, ed,
                        zex, -pow2_log(hscale), zexr);
        if constexpr (DW && !ZF) {
            // z's x part (columns 128..191: the x tile of step t, zero past I_l and B) by warps
            // 0-3, two 8-column groups each, with ldmatrix.trans: lane l gets rows 2(l%4),
            // 2(l%4)+1 of column l/4 of each 8 x 8 matrix, as dw16_put stores them; warp 4 the
            // constant 1 (column 192) and zeros.
            unsigned char *zc = static_cast<unsigned char *>(a.dw16) +
                                4 * (size_t)a.dw16_pitch * RNND_DW16_D +
                                ((size_t)blockIdx.x * T + t) * RNND_DW16_Z(64);
            if (w < 4) {
                const int mi = lane >> 3, cg = 2 * w + (mi & 1), kh = mi >> 1;
                uint32_t m4[4];
                ldmatrix_x4_at<true>(m4, xtile + (t & 1) * (16 * XLD) +
                                             (8 * kh + (lane & 7)) * XLD + 8 * cg);
#pragma unroll
                for (int q = 0; q < 4; q++)
                    *reinterpret_cast<uint32_t *>(zc + (16 + 2 * w + (q & 1)) * 256 +
                                                  (q >> 1) * 128 + 4 * lane) = m4[q];
            } else if (w == 4) {
                uint32_t one = 0x3F803F80u;
                if constexpr (XH) {
                    __half2 v = __float2half2_rn(hscale);
                    one = *reinterpret_cast<uint32_t *>(&v);
                }
                dw16_put_one(zc + 24 * 256, lane, one);
                dw16_put_one(zc + 24 * 256 + 128, lane, one);
            }
            if constexpr (XH) { // x = x' xinv: ex is log2 of step t's xinv (0: a zero row)
                const float *xi = xinv + (t & 1) * 16;
                auto x_exp = [](float v) { return v > 0.0f ? pow2_log(v) : RNND_DW16_EZERO; };
                const int ex[2] = {x_exp(xi[g]), x_exp(xi[g + 8])};
                dw16_record(a.dw16_exp + ((size_t)blockIdx.x * T + t) * (RNND_DW16_E / 2), w, lane,
                            ed, ex, -pow2_log(hscale), x_exp(xi[lane & 15]));
            }
        }
        if constexpr (HM::SCALED) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                tile_rowmax_put(rmax, rm[i], w, lane, i);
        }
        clk.mark(0);
        int rst[2] = {reset[0], reset[1]};
        if (t > 0 && ZF) {
            load_gy(t - 1);
            zc_load_ex(t - 1);
        } else if (t > 0) {
            put_z(t - 1); // step t-1's hprev and x
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    hp[i][j] = zh[i][j];
            load_gy(t - 1);
            if (t > 1)
                load_z(t - 2);
        }
        __syncthreads();
        clk.mark(1);

        if constexpr (ZF) {
            if (t > 1) // into step t's slot, whose reads (the iteration before) are done
                zc_fetch(t - 2);
        } else if (t > 0) {
            convert_x(t - 1);
        }
        // Row scales, then the 16-bit tile (units in storage order).
        float rsc[2] = {1.0f, 1.0f};
        if constexpr (HM::SCALED) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                rsc[i] = tile_row_scale<NW>(rmax, g + 8 * i);
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int q = 0; q < G; q++) {
                const uint32_t lo = HM::pack2(tv[q][i][0] * rsc[i], tv[q][i][1] * rsc[i]);
                const uint32_t hi = HM::pack2(tv[q][i][2] * rsc[i], tv[q][i][3] * rsc[i]);
                const int row = g + 8 * i, k = q * HP + 16 * w + 2 * tg;
                if constexpr (ZF) {
                    unsigned char *tb = reinterpret_cast<unsigned char *>(atile);
                    *reinterpret_cast<uint32_t *>(tb + km_off(row, k, G * HP / 8)) = lo;
                    *reinterpret_cast<uint32_t *>(tb + km_off(row, k + 8, G * HP / 8)) = hi;
                } else {
                    uint32_t *p = reinterpret_cast<uint32_t *>(atile + row * ALD + k);
                    p[0] = lo, p[4] = hi;
                }
            }
        if constexpr (ZF)
            fence_proxy_async(); // the MMAs read the tile through the async proxy
        __syncthreads();
        clk.mark(2);

        // dL/dh of the state entering step t (tile . W_hh), this thread's rows g, g + 8 and units
        // u0..u0+3 (positions 16 w + 2 tg + (j & 1) + 8 (j >> 1)): dsum[i][j].
        float dsum[2][4];
        if constexpr (ZF) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            // Four accumulator chains (one chain waits ~65 cycles a k-step: docs/kernels.md); step
            // t-1's hprev and gates (hp of step t is used) while the MMAs run.
            static_assert(HU == HP || HU == 64, "a half or all of the units");
            float dacc[4][8];
            const uint64_t bd = wg_desc(atile, G * HP / 8 * 128);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 2 * KSW; ks++) {
                if (ks % FKS >= HU / 16) // a gate's columns of units past HU: zeros
                    continue;
                if (ks < 4)
                    wg_mma_rs<false, !HM::SCALED>(dacc[ks & 3], wa[ks], bd + 16 * ks);
                else
                    wg_mma_rs<true, !HM::SCALED>(dacc[ks & 3], wa[ks], bd + 16 * ks);
            }
            wg_commit();
            if (t > 0) {
                zc_wait(t - 1);
                zc_hprev(t - 1);
                zc_cell(t - 1);
            }
            wg_wait<0>();
#pragma unroll
            for (int c = 0; c < 4; c++)
                wg_pin(dacc[c]);
            // To the cell's layout through this warp's [position][row] block (pitch 24 floats:
            // conflict-free pairs), over the h and x tiles, which ZF does not use.
            float *tb = reinterpret_cast<float *>(htile) + w * (16 * 24);
            auto chains = [&](int e) {
                return (dacc[0][e] + dacc[1][e]) + (dacc[2][e] + dacc[3][e]);
            };
#pragma unroll
            for (int e = 0; e < 8; e += 2) { // (position g or g + 8, rows 2 tg, + 1 or + 8, + 9)
                const int pos = g + 8 * ((e >> 1) & 1), row = 2 * tg + 8 * (e >> 2);
                *reinterpret_cast<float2 *>(tb + pos * 24 + row) =
                    make_float2(chains(e), chains(e + 1));
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dsum[i][j] = tb[(2 * tg + (j & 1) + 8 * (j >> 1)) * 24 + g + 8 * i];
#else
            __trap(); // never built: seq_gru_gate_tape.cu builds the ZF loop for sm_90a alone
#endif
        } else {
            if (t > 0)
                gates_mma(t - 1); // independent of dh: more work for the tensor pipe to overlap
            // This warp's K half for the pair's 4 n-tiles (n-tile 2j + half: units of warp
            // 2 pair + j), the partner's half of its 2 added.
            float bacc[2][4][4];
#pragma unroll
            for (int sp = 0; sp < 2; sp++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    zero4(bacc[sp][nt]);
#pragma unroll
            for (int ks = 0; ks < KSW; ks++) {
                uint32_t af[4];
                ldmatrix_x4(af, atile, ALD, (kh * KSW + ks) * 16, 8, lane);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    uint32_t b[4];
                    dh_b(b, ks, j);
                    HM::mma(bacc[ks & 1][2 * j], af, make_uint2(b[0], b[1]));
                    HM::mma(bacc[ks & 1][2 * j + 1], af, make_uint2(b[2], b[3]));
                }
            }
            float mine[2][4], theirs[2][4];
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float lo = bacc[0][hf][e] + bacc[1][hf][e];
                    float hi = bacc[0][2 + hf][e] + bacc[1][2 + hf][e];
                    mine[hf][e] = kh ? hi : lo;
                    theirs[hf][e] = kh ? lo : hi;
                }
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                xch[(w * 2 + hf) * 32 + lane] =
                    make_float4(theirs[hf][0], theirs[hf][1], theirs[hf][2], theirs[hf][3]);
            asm volatile("bar.sync %0, 64;" ::"r"(1 + pair) : "memory"); // the pair only
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float4 v = xch[((w ^ 1) * 2 + hf) * 32 + lane];
                mine[hf][0] += v.x, mine[hf][1] += v.y, mine[hf][2] += v.z, mine[hf][3] += v.w;
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dsum[i][j] = mine[j >> 1][2 * i + (j & 1)];
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(dsum[0][0] + dsum[1][3] + acc[0][0] + accx[FNT - 1][3], a.dbg);
            clk.mark(3);
        }

        // Route it (docs/design.md, "Math"), as seq_backward_kernel does.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float inv = winv * pow2_inv(rsc[i]);
            float dhp[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                dhp[j] = ddir[i][j] + dsum[i][j] * inv;
            bool carry = t > 0 && !rst[i];
            if (carry) {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dh[i][j] = dhp[j];
                continue;
            }
            if (a.stored) {
                size_t at = ((rbase[i] + t) * L + l) * H + u0;
                if (a.g_hidden)
                    st4<VEC>(a.g_hidden + at, dhp, u0, H, rv[i]);
            } else if (!rst[i]) { // t == 0: the initial state
                size_t at = (bidx[i] * L + l) * H + u0;
                if (a.g_h0)
                    st4<VEC>(a.g_h0 + at, dhp, u0, H, rv[i]);
            }
            zero4(dh[i]);
        }
        clk.mark(4);
        if (!ZF && t > 0)
            gates_cell(t - 1);
        zex[0] = nzex[0], zex[1] = nzex[1], zexr = nzexr;
        if constexpr ((V & 8) != 0) {
            persist_wait_for(sv[0][0][0] + sv[SW - 1][1][3], a.dbg);
            clk.mark(5);
        }
    }
    clk.flush(a.dbg);
}

// The x part in row-scaled fp16 in TF32 mode (XH), in bf16 as it is (bf16 mode).
template <class Mode, int HP>
static long gru_h128_smem() {
    using HM = typename Mode::hmode;
    constexpr bool XH = HM::SCALED;
    return XH ? gru_h128_geom<Mode, HP, HM>::SMEM : gru_h128_geom<Mode, HP>::SMEM;
}

// Launches kernel, an instance of the loop in Mode, over a's rows.
template <class Mode, class Kernel>
static int gru_h128_launch(Kernel kernel, const struct persist_bwd_args &a, cudaStream_t stream) {
    const long smem = gru_h128_smem<Mode, 128>();
    RNND_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<CEIL_DIV(a.B, 16), gru_h128_geom<Mode, 128>::THREADS, smem, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// The loop recomputing its gates (seq_gru.cu): D in fp32, or (a.dw16, vector access; TF32 mode
// with the records) D and z as dw16 chunks.
template <class Mode>
static int gru_h128_recompute_launch(const struct persist_bwd_args &a, bool clocks,
                                     cudaStream_t stream) {
    constexpr int HP = 128;
    constexpr bool XH = Mode::hmode::SCALED;
    if (a.Il > HP / 2 || a.Il % 4 != 0 || a.w_ih == nullptr || a.zc)
        return RNND_EINVAL;
    auto kernel = a.vec ? seq_gru_h128_backward_kernel<Mode, HP, true, XH>
                        : seq_gru_h128_backward_kernel<Mode, HP, false, XH>;
    if (a.dw16) {
        if (!a.vec || a.H % 4 != 0 || (a.dw16_exp != nullptr) != XH)
            return RNND_EINVAL;
        kernel = seq_gru_h128_backward_kernel<Mode, HP, true, XH, 0, true>;
    }
#ifdef RNND_CUDA_PHASE_CLOCKS
    if constexpr (XH) // TF32, vector access, D in fp32
        if (!a.dw16 && a.vec && clocks)
            kernel = seq_gru_h128_backward_kernel<Mode, HP, true, XH, SEQ_CLOCKS>;
#else
    (void)clocks;
#endif
    return gru_h128_launch<Mode>(kernel, a, stream);
}

#endif // RNND_CUDA_SEQ_GRU_BACKWARD_CUH
