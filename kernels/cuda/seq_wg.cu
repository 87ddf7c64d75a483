/*
 * seq_wg.cu: the GRU and LSTM forward time loops at H <= 128 in TF32 mode (and, where it writes
 * z's chunk parts, the GRU's in bf16 mode: docs/kernels.md) with warpgroup MMAs (wgmma, sm_90a only: this
 * file is built for that target alone and the host asks for it only on a compute-capability 9.0
 * device). Same arguments and outputs as the persistent forwards they replace there
 * (seq_forward.cuh's loops), fused input projection only (x at most 64 wide; the GRU's 128, a
 * deeper layer's at H = 128); with a tape the GRU writes the z rows alone where its
 * backward recomputes its gates, else also its fp16 gate tape, as the LSTM always does; at
 * H = 128 both write z's dw16 chunk parts in place of the z rows where seq.cu asks (a.zc,
 * docs/kernels.md), and the GRU then its fp16 gate tape too (its backward reads it).
 *
 * Why: the mma.sync loops read every fp16 weight from shared memory each step (144 KB a step
 * and SM at H = 128, I = 64), the phase that sets their step. A warpgroup MMA takes its A operand
 * from registers, so W_hh stays in registers for the whole sequence.
 *
 * Shape: 16 batch rows a block, three warpgroups. The gate rows are the MMA's M (the weights are
 * A), the batch rows its N = 16: D[gate unit][row] = W[gate unit][:] . h[row][:]. Consumer
 * warpgroup q (0, 1) owns units [64q, 64q + 64) of every gate (one m64 tile a gate), so every
 * thread holds the gate sums of its own elements and runs their cell with no exchange. M
 * row m of a tile (warp w = m / 16, g = m % 8, i = (m / 8) % 2) is unit 64q + 16w + 2g + i: a
 * thread's two units are adjacent (8-byte stores), its rows are 2tg + e + 8j (D's n8 chunks j).
 * Warpgroup 2, the producer, computes the x part x W_ih^T + b_ih, which does not depend on h, up
 * to two steps ahead, and hands it over in shared memory in the consumers' accumulator layout
 * (docs/kernels.md: it took ~1000 of ~3000 cycles a step in the consumers' own chain). setmaxnreg
 * gives the consumers 200 registers (W_hh alone takes 96) and the producer 104. The LSTM's
 * fourth gate (o), and with a tape and stored states its third (g) too, take W_hh from shared
 * memory (wg_gr).
 *
 * Operands in shared memory (B: h and x tiles; A: W_ih, the W_hh of gates not in registers) are
 * K-major fp16 in 8 x 8 core matrices (8 rows of 16 bytes, 128 contiguous bytes), no swizzle:
 * core matrices adjacent in K
 * 128 bytes apart (the descriptor's leading byte offset), adjacent 8-row groups K/8 * 128
 * apart (its stride byte offset). Scales as in the mma.sync loops: weights and h by powers of
 * two (persist_wscale, persist_hscale), each x row by its own (persist_row16).
 *
 * Per step t, consumers: the h part (G gates x 8 k-steps) is issued asynchronously; while it
 * runs they store step t-1's outputs (and, with a tape, the z rows' hprev of step t, or its
 * chunk's h part, and the LSTM's cprev); then the x part of step t from its slot (t % 2), the
 * cell, h into the other h tile, one barrier of the consumers. Producer: x(t+1) (cp.async three
 * steps ahead, three fp32 stages) into the other fp16 x tile (with a tape, also into the z rows
 * with their 1; or x tile t into its chunk's x part) while step t's x-part MMAs run (A = W_ih
 * from shared memory), then their sums, scaled and biased, into
 * slot t % 2 once the consumers have read step t-2's. mbarriers hand the slots back and forth
 * (full: producer arrives, consumers wait; empty: the reverse).
 */
#include "seq_tape.cuh"
#include "wg.cuh"

namespace {

constexpr int WG_CONS = 256;                  // warpgroups 0, 1: h part, cell
constexpr int WG_THREADS = WG_CONS + 128;     // warpgroup 2: x part (producer)
constexpr int WG_CREGS = 200, WG_PREGS = 104; // setmaxnreg: 256 x 200 + 128 x 104 = 384 x 168
constexpr int WG_HP = 128;                    // units (padded)
constexpr int WG_XK = 64;                     // x columns (padded): I_l <= 64 (the GRU's 128)
constexpr long WG_WHS_TILE = 64L * WG_HP * 2; // one m64 tile of W_hh: 16 KB
constexpr long WG_HTILE = 16L * WG_HP * 2;    // 16 rows of h, fp16: 4 KB
constexpr int WG_NSTAGE = 3;                  // x stages (x arrives 3 steps ahead)

// Shared memory of the G-gate loop with the W_hh of GR gates in the consumers' registers and x
// XK columns wide: W_ih (2 unit halves x G gates), W_hh of the other gates, h and x tiles, x
// stages, the rows' 1/x scales, biases (b_ih, b_hh: 2G x WG_HP), reduction scratch, 4 mbarriers
// (full[2], empty[2]), the x part's two slots (fp32), which first hold the consumers' W_hh
// fragments on their way into registers and, being larger than the slots, set the size: GRU 171
// KB, LSTM 220 KB (GR 2 or 3). At XK = 128 (the GRU's: 203 KB) the x tiles and stages go after
// the slots, in the fragments' space too (UNION: the producer waits for the fragments to be read
// before its first x).
template <int G, int GR, int XK = WG_XK>
struct wg_geom {
    static constexpr int GS = G - GR;
    static constexpr bool UNION = XK > WG_XK;
    static constexpr long WIH_TILE = 64L * XK * 2; // one m64 tile of W_ih
    static constexpr long XTILE = 16L * XK * 2;    // 16 rows of x, fp16
    static constexpr long STAGE = 16L * XK * 4;    // 16 rows of x, fp32
    static constexpr long XS = 2 * XTILE + WG_NSTAGE * STAGE;
    static constexpr long XP = 2L * G * 8 * 128 * 4; // a step's x part
    static constexpr long OFF_WHS = 2L * G * WIH_TILE;
    static constexpr long OFF_H = OFF_WHS + 2L * GS * WG_WHS_TILE;
    static constexpr long OFF_XINV = OFF_H + 2 * WG_HTILE + (UNION ? 0 : XS);
    static constexpr long OFF_BIAS = OFF_XINV + 2 * 16 * 4;
    static constexpr long OFF_RED = OFF_BIAS + 2L * G * WG_HP * 4;
    static constexpr long OFF_MBAR = OFF_RED + 32 * 4;
    static constexpr long OFF_XP = OFF_MBAR + 4 * 8;
    static constexpr long OFF_X = UNION ? OFF_XP + 2 * XP : OFF_H + 2 * WG_HTILE;
    static constexpr long OFF_STAGE = OFF_X + 2 * XTILE;
    static constexpr long WFRAG = GR * 8L * WG_CONS * 16;
    static constexpr long AFTER = 2 * XP + (UNION ? XS : 0); // what follows OFF_XP
    static constexpr long SMEM = OFF_XP + (AFTER > WFRAG ? AFTER : WFRAG);
    static_assert(SMEM <= RNND_PERSIST_SMEM_BUDGET, "wgmma loop does not fit");
};

// Named barriers (0 is __syncthreads): the consumers' step barrier, the producer's own, and
// the consumers' W_hh fragments read (the producer then writes the x part over them).
constexpr int WG_BAR_CONS = 1, WG_BAR_PROD = 2, WG_BAR_WFRAG = 3;
__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// Two adjacent units of one row (u0 even, H even: both or neither exist).
__device__ __forceinline__ float2 ld2(const float *p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const float2 *>(p)) : make_float2(0.0f, 0.0f);
}
__device__ __forceinline__ void st2(float *p, float a, float b, bool ok) {
    if (ok)
        *reinterpret_cast<float2 *>(p) = make_float2(a, b);
}

// z's parts of a dw16 chunk (seq_chunks.h) from the forward (persist_fwd_args zc): what the
// backward loops would write from the z rows, bitwise, without the z rows' 784 bytes a row and
// step in fp32 going to memory and back (docs/kernels.md).
// HM: the h part's mode, fp16 (TF32 mode: values scaled, x's exponents recorded) or bf16.
// h: the state entering the step, rows 8j + 2tg (h0) and + 1 (h1) of units u0, u0 + 1, scaled by
// the h scale; a unit's column in its group of 16 is the loop's movmatrix order (the inverse of
// dw16_unit in seq_dw.cu); rows past B are zeros, as the backward's.
template <class HM>
__device__ __forceinline__ void zc_put_h(unsigned char *zc, int u0, int g, int tg, int j,
                                         const float h0[2], const float h1[2], bool ok0, bool ok1,
                                         float hs) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int n = (u0 & ~15) + 8 * (g & 1) + 2 * (g >> 1) + i;
        *reinterpret_cast<uint32_t *>(zc + (n >> 3) * 256 + j * 128 + (n & 7) * 16 + 4 * tg) =
            HM::pack2(ok0 ? h0[i] * hs : 0.0f, ok1 ? h1[i] * hs : 0.0f);
    }
}
// x: the producer's 16-bit x tile (K-major, XK columns, fp16 row-scaled; zeros past I_l and B)
// transposed by ldmatrix, warp w (0-3) its column groups 8k + 2w, 8k + 2w + 1 (k < XK / 64);
// warp 0 the constant (the h scale, as z's h part) and its zeros; in fp16, warp 1 the rows'
// exponents from their inverse scales xinv (0: a row of zeros).
template <class HM, int XK>
__device__ __forceinline__ void zc_put_x(unsigned char *zc, const unsigned char *xt,
                                         const float *xinv, int16_t *ex, int w, int lane,
                                         float hs) {
    const int mi = lane >> 3, rh = mi >> 1;
#pragma unroll
    for (int k = 0; k < XK / 64; k++) {
        const int cg = 8 * k + 2 * w + (mi & 1);
        uint32_t m4[4];
        ldmatrix_x4_at<true>(m4, xt + km_off(8 * rh + (lane & 7), 8 * cg, XK / 8));
#pragma unroll
        for (int q = 0; q < 4; q++)
            *reinterpret_cast<uint32_t *>(zc + (16 + 8 * k + 2 * w + (q & 1)) * 256 +
                                          (q >> 1) * 128 + 4 * lane) = m4[q];
    }
    if (w == 0) {
        dw16_put_one(zc + (16 + XK / 8) * 256, lane, HM::pack2(hs, hs));
        dw16_put_one(zc + (16 + XK / 8) * 256 + 128, lane, HM::pack2(hs, hs));
    } else if (HM::SCALED && w == 1 && lane < 16) {
        const float v = xinv[lane];
        ex[lane] = (int16_t)(v > 0.0f ? pow2_log(v) : RNND_DW16_EZERO);
    }
}

// Gates whose W_hh a consumer holds in registers (the others' come from shared memory): all
// three of the GRU's; three of the LSTM's four (128 registers of weights would leave too few for
// the rest), two where it writes a tape with stored states (HID: its deferred stores and the
// next step's stored values need the registers; docs/kernels.md).
template <class Cell, bool Z, bool HID>
constexpr int wg_gr() {
    return Cell::G == 4 && Z && HID ? 2 : 3;
}

// Cell: cell_gru or cell_lstm. V: SEQ_CLOCKS in profiling builds, phase clocks of warp 0 (8 phases,
// persist_clock). Z: the tape is written for the backward: the z rows (hprev, the 1, x) or z's
// chunk parts, and the s rows (the gates' pre-activations in fp16; the LSTM's cprev; the GRU's
// hn) for the LSTM, and for the GRU with the chunk parts (else its backward recomputes its
// gates from the z rows).
// HID: a.hidden may be set (stored states); else a reset's state is zero.
// HM: the MMAs' mode, mode_f16 (TF32 mode: weights, h and x rows scaled) or mode_bf16.
// HU: the units the loop computes, WG_HP, or 64 for a layer of H <= 64 (padded to WG_HP: the
// plan's rule), whose units past 64 hold only zeros: consumer warpgroup 1 writes their z chunk
// parts and leaves, the producer computes one unit half, and the h part stops at K = 64.
template <class Cell, class HM, int V, bool Z, bool HID, int XK, int HU = WG_HP>
__global__ void __launch_bounds__(WG_THREADS, 1) seq_wg_forward(const persist_fwd_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool BF = !HM::SCALED;
    using Gm = wg_geom<Cell::G, wg_gr<Cell, Z, HID>(), XK>;
    using TR = tape_rec<Cell, true>;
    constexpr int G = Cell::G, GR = wg_gr<Cell, Z, HID>(), GS = Gm::GS, SW = Cell::SW;
    constexpr bool LSTM = G == 4;
    constexpr int NH = HU / 64, KH = HU / 16; // unit halves computed, the h part's k-steps
    static_assert(HU == WG_HP || HU == 64, "a half or all of the units");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = warp >> 2, w = warp & 3;
    const int g = lane >> 2, tg = lane & 3, x = threadIdx.x & 127;
    const int H = a.H, T = a.T, L = a.L, l = a.l, GH = G * H, Il = a.Il;

    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *wih = smem, *whs = smem + Gm::OFF_WHS;
    unsigned char *htile = smem + Gm::OFF_H, *xtile = smem + Gm::OFF_X;
    float *stage = reinterpret_cast<float *>(smem + Gm::OFF_STAGE);
    float *xinv = reinterpret_cast<float *>(smem + Gm::OFF_XINV);
    float *bias = reinterpret_cast<float *>(smem + Gm::OFF_BIAS);
    float *red = reinterpret_cast<float *>(smem + Gm::OFF_RED);
    float4 *xpart = reinterpret_cast<float4 *>(smem + Gm::OFF_XP);

    const float wscale = BF ? 1.0f : persist_wscale(a.w_hh, GH * H, a.w_ih, GH * Il, red);
    const float hscale = BF ? 1.0f : persist_hscale(a, a.l, red);
    const float winv = 1.0f / wscale, hinv = winv * (1.0f / hscale);

    // Row m of an m64 A tile of unit half hf (W_ih's, W_hh's in shared memory and in registers)
    // is unit 64 hf + 16 (m / 16) + 2 (m % 8) + (m / 8) % 2: a consumer's two units are adjacent.
    auto tile_unit = [](int hf, int m) {
        return 64 * hf + 16 * (m >> 4) + 2 * (m & 7) + ((m >> 3) & 1);
    };
    // Element (row qq H + u, column k) of weight wt (kw columns), scaled; zero past H and kw.
    auto wval = [&](const float *wt, int kw, int qq, int u, int k) {
        return u < H && k < kw ? __ldg(wt + (size_t)(qq * H + u) * kw + k) * wscale : 0.0f;
    };
    // Gates [q0, q0 + nq) of weight wt (G H rows of kw columns) as m64 A tiles of KP columns in
    // shared memory at dst (tile nq half + gate - q0), zero past H and kw: W_ih's, and W_hh's of
    // the gates past GR. Unrolled, for loads in flight: one at a time, these fills took ~5% of a
    // 0.8 ms loop (docs/kernels.md).
    auto fill_tiles = [&](unsigned char *dst, const float *wt, int kw, int q0, int nq, auto kp) {
        constexpr int KP = decltype(kp)::value;
#pragma unroll 8
        for (int e = threadIdx.x; e < 2 * nq * 64 * KP; e += WG_THREADS) {
            const int tile = e / (64 * KP), m = (e / KP) % 64, k = e % KP;
            const int qq = q0 + tile % nq, u = tile_unit(tile / nq, m);
            HM::put(reinterpret_cast<typename HM::elem *>(dst + tile * (64L * KP * 2) +
                                                          km_off(m, k, KP / 8)),
                    wval(wt, kw, qq, u, k));
        }
    };
    fill_tiles(wih, a.w_ih, Il, 0, G, std::integral_constant<int, XK>());
    if constexpr (GS > 0)
        fill_tiles(whs, a.w_hh, H, GR, GS, std::integral_constant<int, WG_HP>());
    // W_hh of the first GR gates as the consumers' A fragments: a0 = {W[u0][k], W[u0][k+1]},
    // a1 = unit u0+1, a2, a3 = the same at k + 8; k = 16 ks + 2 tg. Staged in shared memory
    // (fragment f = 8 gate + ks of consumer c at f * 256 + c): read straight from global memory
    // into registers they made ptxas spill the loop (160 bytes).
    uint4 *wfrag = reinterpret_cast<uint4 *>(smem + Gm::OFF_XP);
    for (int e = threadIdx.x; e < 8 * GR * WG_CONS; e += WG_THREADS) {
        const int f = e / WG_CONS, c = e % WG_CONS, qq = f / 8, k = 16 * (f % 8) + 2 * (c & 3);
        const int u = 64 * (c >> 7) + 16 * ((c >> 5) & 3) + 2 * ((c & 31) >> 2);
        auto whh = [&](int uu, int kk) { return wval(a.w_hh, H, qq, uu, kk); };
        wfrag[e] = make_uint4(HM::pack2(whh(u, k), whh(u, k + 1)),
                              HM::pack2(whh(u + 1, k), whh(u + 1, k + 1)),
                              HM::pack2(whh(u, k + 8), whh(u, k + 9)),
                              HM::pack2(whh(u + 1, k + 8), whh(u + 1, k + 9)));
    }
    // The x tile's padding, the x stages (UNION: the producer's, below) and the h tiles start at
    // zero.
    for (long e = threadIdx.x; e < (Gm::OFF_XINV - Gm::OFF_H) / 4; e += WG_THREADS)
        reinterpret_cast<float *>(smem + Gm::OFF_H)[e] = 0.0f;
    // Biases (zero past H), read each step: registers go to W_hh.
    for (int e = threadIdx.x; e < 2 * G * WG_HP; e += WG_THREADS) {
        const int qq = (e / WG_HP) % G, u = e % WG_HP;
        const float *b = e < G * WG_HP ? a.b_ih : a.b_hh;
        bias[e] = u < H ? __ldg(b + qq * H + u) : 0.0f;
    }
    // The x part's slots change hands through mbarriers: full[p] (each producer thread arrives
    // after its writes, release), empty[p] (each consumer thread after its reads); the waiting
    // side acquires. The k-th use of a slot completes phase k, so a wait is on parity k % 2.
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + Gm::OFF_MBAR), *empty = full + 2;
    if (threadIdx.x == 0) {
        mbar_init(full, 128), mbar_init(full + 1, 128);
        mbar_init(empty, NH * 128), mbar_init(empty + 1, NH * 128);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    fence_proxy_async(); // the weight and zeroed tiles, for the MMAs
    __syncthreads();

    // A thread's accumulator rows: r = 2j + e is row 8j + 2tg + e of the block (D's column);
    // element (r, unit u0 + i) of an m64 tile is D[4j + 2i + e] = D[dix(r, i)].
    auto rowb = [&](int r) { return blockIdx.x * 16 + 8 * (r >> 1) + 2 * tg + (r & 1); };
    auto rvalid = [&](int r) { return rowb(r) < a.B; };
    auto rb = [&](int r) { return (size_t)rowb(r) * T; };
    auto dix = [](int r, int i) { return 4 * (r >> 1) + 2 * i + (r & 1); };
    // The x part of step t for consumer c of warpgroups 0, 1: slot t % 2, gate qq, float4 j of
    // the 8 accumulator values (conflict-free: a warp reads 512 contiguous bytes).
    auto xp_at = [&](int t, int c, int qq, int j) {
        return xpart + ((((t & 1) * 2 + (c >> 7)) * G + qq) * 2 + j) * 128 + (c & 127);
    };

    if (q == 2) {
        // The producer: for every step, x(t) (cp.async three steps ahead) into 16-bit x tile
        // t % 2, row-scaled in fp16 (persist_row16); x(t) W_ih^T for all 2G tiles, scaled and with
        // b_ih, into slot t % 2 for the consumers. x(t+1)'s tile is made while step t's MMAs run.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WG_PREGS));
        if constexpr (Gm::UNION) {
            // The x tiles and stages lie in the fragments' space: once the consumers hold their
            // fragments, the stages start at zero (past I_l and B they stay so).
            bar_sync(WG_BAR_WFRAG, WG_THREADS);
            for (int e = x; e < Gm::XS / 4; e += 128)
                reinterpret_cast<float *>(smem + Gm::OFF_X)[e] = 0.0f;
            bar_sync(WG_BAR_PROD, 128);
        }
        // A thread moves columns [cx + 64 k, cx + 64 k + 4) (k < XK / 64) of rows 8j + x / 16
        // (j = 0, 1) of x: it fetches and converts the same values, so no barrier comes between
        // (docs/kernels.md).
        constexpr int NX = XK / 64;
        const int cx = 4 * (x & 15);
        auto fetch_x = [&](int t) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int row = 8 * j + (x >> 4), b = blockIdx.x * 16 + row;
                const bool ok = b < a.B; // else zeros
#pragma unroll
                for (int k = 0; k < NX; k++)
                    if (t < T && cx + 64 * k < Il)
                        cp_async16(stage + (t % WG_NSTAGE) * 16 * XK + row * XK + cx + 64 * k,
                                   ok ? a.x + ((size_t)b * T + t) * a.ldx + cx + 64 * k : a.x, ok);
            }
            asm volatile("cp.async.commit_group;" ::: "memory"); // one group a step, maybe empty
        };
        // x(t), landed in its stage, into x tile t % 2 and its rows' inverse scales.
        auto convert_x = [&](int t) {
            asm volatile("cp.async.wait_group 2;" ::: "memory"); // x(t) is in (t+1, t+2 may not be)
#pragma unroll
            for (int j = 0; j < 2; j++) { // a half-warp a row
                const int row = 8 * j + (x >> 4);
                float4 v[NX];
                void *dst[NX];
#pragma unroll
                for (int k = 0; k < NX; k++) {
                    v[k] = *reinterpret_cast<const float4 *>(stage + (t % WG_NSTAGE) * 16 * XK +
                                                             row * XK + cx + 64 * k);
                    dst[k] = xtile + (t & 1) * Gm::XTILE + km_off(row, cx + 64 * k, XK / 8);
                }
                const float inv = persist_row16<HM, NX>(v, dst);
                if ((x & 15) == 0)
                    xinv[(t & 1) * 16 + row] = inv;
                // The tape's z row of (row, t): x at xoff (a copy of the layer input), and the
                // 1 and its padding at H (xoff = H + 4: the launcher checks).
                const int b = blockIdx.x * 16 + row;
                if (Z && a.z && b < a.B) {
                    float *zr = a.z + ((size_t)b * T + t) * a.ldz;
#pragma unroll
                    for (int k = 0; k < NX; k++)
                        if (a.xcopy && cx + 64 * k < Il)
                            *reinterpret_cast<float4 *>(zr + a.xoff + cx + 64 * k) = v[k];
                    if ((x & 15) == 0)
                        *reinterpret_cast<float4 *>(zr + H) = make_float4(1.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            fence_proxy_async(); // for the MMAs
        };
        fetch_x(0);
        fetch_x(1);
        fetch_x(2);
        convert_x(0);
        bar_sync(WG_BAR_PROD, 128); // x tile 0 complete, stage 0 free
        fetch_x(3);
        const uint64_t wd = wg_desc(wih, XK / 8 * 128);
        for (int t = 0; t < T; t++) {
            const uint64_t xd = wg_desc(xtile + (t & 1) * Gm::XTILE, XK / 8 * 128);
            float dx[2][G][8];
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < XK / 16; ks++) // past I_l both operands are zero
#pragma unroll
                for (int tile = 0; tile < NH * G; tile++) {
                    const uint64_t ad = wd + (tile * Gm::WIH_TILE >> 4) + 16 * ks;
                    if (ks == 0)
                        wg_mma_ss<false, BF>(dx[tile / G][tile % G], ad, xd + 16 * ks);
                    else
                        wg_mma_ss<true, BF>(dx[tile / G][tile % G], ad, xd + 16 * ks);
                }
            wg_commit();
            // x tile t (complete since the last barrier) into chunk (block, t).
            if (Z && a.zc) {
                unsigned char *zc = static_cast<unsigned char *>(a.zc) +
                                    ((size_t)blockIdx.x * T + t) * RNND_DW16_Z(XK);
                zc_put_x<HM, XK>(zc, xtile + (t & 1) * Gm::XTILE, xinv + (t & 1) * 16,
                                 BF ? nullptr : a.zc_ex + ((size_t)blockIdx.x * T + t) * 16, w,
                                 lane, hscale);
            }
            if (t + 1 < T)
                convert_x(t + 1);
            float xs[4];
#pragma unroll
            for (int r = 0; r < 4; r++)
                xs[r] = winv * xinv[(t & 1) * 16 + 8 * (r >> 1) + 2 * tg + (r & 1)];
            wg_wait<0>();
            if (t >= 2)
                mbar_wait(empty + (t & 1), ((t >> 1) & 1) ^ 1); // the consumers read step t-2's
            else if (t == 0 && !Gm::UNION)
                bar_sync(WG_BAR_WFRAG, WG_THREADS); // and their W_hh fragments
#pragma unroll
            for (int half = 0; half < NH; half++)
#pragma unroll
                for (int qq = 0; qq < G; qq++) {
                    wg_pin(dx[half][qq]);
                    const int u0 = 64 * half + 16 * w + 2 * g;
                    float v[8];
#pragma unroll
                    for (int r = 0; r < 4; r++)
#pragma unroll
                        for (int i = 0; i < 2; i++)
                            v[dix(r, i)] =
                                dx[half][qq][dix(r, i)] * xs[r] + bias[qq * WG_HP + u0 + i];
                    *xp_at(t, 128 * half + x, qq, 0) = make_float4(v[0], v[1], v[2], v[3]);
                    *xp_at(t, 128 * half + x, qq, 1) = make_float4(v[4], v[5], v[6], v[7]);
                }
            mbar_arrive(full + (t & 1));
            bar_sync(WG_BAR_PROD, 128); // x tile t+1 complete; its stage free; xinv t read
            fetch_x(t + 4);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }

    // The consumers: warpgroup q owns units [64q, 64q + 64) of every gate.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WG_CREGS));
    const int u0 = 64 * q + 16 * w + 2 * g; // this thread's units: u0, u0 + 1
    const bool uok = u0 < H;
    uint32_t wa[GR][8][4];
#pragma unroll
    for (int f = 0; f < 8 * GR; f++) {
        const uint4 v = wfrag[f * WG_CONS + threadIdx.x];
        wa[f / 8][f % 8][0] = v.x, wa[f / 8][f % 8][1] = v.y;
        wa[f / 8][f % 8][2] = v.z, wa[f / 8][f % 8][3] = v.w;
    }
    asm volatile("bar.arrive %0, %1;" ::"n"(WG_BAR_WFRAG), "n"(WG_THREADS) : "memory");
    if (NH < 2 && q >= NH) { // units past HU: zeros, of which z's chunk parts alone are written
        const float zero[2] = {0.0f, 0.0f};
        if constexpr (Z)
            if (a.zc)
                for (int t = 0; t < T; t++)
#pragma unroll
                    for (int j = 0; j < 2; j++)
                        zc_put_h<HM>(static_cast<unsigned char *>(a.zc) +
                                         ((size_t)blockIdx.x * T + t) * RNND_DW16_Z(XK),
                                     u0, g, tg, j, zero, zero, false, false, hscale);
        return;
    }
    const size_t hid_step = (size_t)L * H;

    // The state entering step 0 (reset rule as the other loops): hidden[b, 0] (cell[b, 0]) when
    // stored states are given, else zero where is_init[b, 0], else h0 (c0) or zero.
    float h[4][2], c[4][2];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        float2 v = make_float2(0.0f, 0.0f), vc = v;
        const size_t b = rowb(r);
        if (a.hidden) {
            v = ld2(a.hidden + rb(r) * hid_step + (size_t)l * H + u0, rvalid(r) && uok);
            if (LSTM && a.cell)
                vc = ld2(a.cell + rb(r) * hid_step + (size_t)l * H + u0, rvalid(r) && uok);
        } else if (a.h0 && rvalid(r) && !a.is_init[rb(r)]) {
            v = ld2(a.h0 + (b * L + l) * H + u0, uok);
            if (LSTM && a.c0)
                vc = ld2(a.c0 + (b * L + l) * H + u0, uok);
        }
        h[r][0] = v.x, h[r][1] = v.y, c[r][0] = vc.x, c[r][1] = vc.y;
    }
    // h (scaled) into h tile p: row 8j + 2tg + e, units u0, u0 + 1 (K).
    auto put_h = [&](int p) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = 8 * (r >> 1) + 2 * tg + (r & 1);
            *reinterpret_cast<uint32_t *>(htile + p * WG_HTILE + km_off(row, u0, WG_HP / 8)) =
                HM::pack2(h[r][0] * hscale, h[r][1] * hscale);
        }
    };
    // Reset flags and stored values of step t.
    int nreset[4];
    float nh[4][2], nc[4][2];
    auto load_next = [&](int t) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const bool ok = rvalid(r) && t < T;
            nreset[r] = ld_flag(a.is_init + rb(r) + t, ok);
            float2 v = make_float2(0.0f, 0.0f), vc = v;
            if (HID && a.hidden) {
                const size_t at = (rb(r) + t) * hid_step + (size_t)l * H + u0;
                v = ld2(a.hidden + at, ok && uok);
                if (LSTM && a.cell)
                    vc = ld2(a.cell + at, ok && uok);
            }
            nh[r][0] = v.x, nh[r][1] = v.y, nc[r][0] = vc.x, nc[r][1] = vc.y;
        }
    };
    put_h(0);
    load_next(1);
    fence_proxy_async();
    bar_sync(WG_BAR_CONS, NH * 128);

    // Step t's outputs, stored while the MMAs of step t+1 run (right after the cell, every
    // block's stores meet at once and wait for memory; docs/kernels.md).
    // The tape's planes (the gates' pre-activations; the GRU's hn), fp16 pairs in both modes,
    // likewise.
    constexpr int SH = TR::SH;
    const bool sp = Z && (LSTM || a.s); // the LSTM's tape always has them
    float yv[4][2];
    uint32_t sv[SH][4];
    auto out_put = [&](int t) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            st2(a.y + (rb(r) + t) * a.ldy + u0, yv[r][0], yv[r][1], rvalid(r) && uok);
            if (sp) {
                const float *row = a.s + (rb(r) + t) * TR::floats(H);
#pragma unroll
                for (int p = 0; p < SH; p++)
                    if (rvalid(r) && uok)
                        *reinterpret_cast<uint32_t *>(TR::hp(row, p, H) + u0) = sv[p][r];
            }
        }
    };
    const uint64_t whd = wg_desc(whs + q * GS * WG_WHS_TILE, 2048);
    persist_clock<V> clk;
    for (int t = 0; t < T; t++) {
        const int p = t & 1;
        clk.start();
        // The h part, asynchronous, k-step by k-step with the gates' chains interleaved (gate by
        // gate was 3-5% slower); a k-step is 256 bytes further (16 in address units).
        float dh[G][8];
        const uint64_t hd = wg_desc(htile + p * WG_HTILE, 2048);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KH; ks++) {
#pragma unroll
            for (int qq = 0; qq < GR; qq++) {
                if (ks == 0)
                    wg_mma_rs<false, BF>(dh[qq], wa[qq][ks], hd + 16 * ks);
                else
                    wg_mma_rs<true, BF>(dh[qq], wa[qq][ks], hd + 16 * ks);
            }
#pragma unroll
            for (int qq = GR; qq < G; qq++) {
                const uint64_t ad = whd + ((qq - GR) * WG_WHS_TILE >> 4) + 16 * ks;
                if (ks == 0)
                    wg_mma_ss<false, BF>(dh[qq], ad, hd + 16 * ks);
                else
                    wg_mma_ss<true, BF>(dh[qq], ad, hd + 16 * ks);
            }
        }
        wg_commit();
        if (t > 0)
            out_put(t - 1);
        if constexpr (Z) // the tape's hprev (and the LSTM's cprev): the state entering step t
#pragma unroll
            for (int r = 0; r < 4; r++) {
                if (a.zc) { // rows 2tg + 8j, +1 (r = 2j, 2j + 1) of units u0 + i, 4 bytes a pair
                    if ((r & 1) == 0)
                        zc_put_h<HM>(static_cast<unsigned char *>(a.zc) +
                                         ((size_t)blockIdx.x * T + t) * RNND_DW16_Z(XK),
                                     u0, g, tg, r >> 1, h[r], h[r + 1], rvalid(r), rvalid(r + 1),
                                     hscale);
                } else {
                    st2(a.z + (rb(r) + t) * a.ldz + u0, h[r][0], h[r][1], rvalid(r) && uok);
                }
                if constexpr (LSTM)
                    if (rvalid(r) && uok)
                        TR::put2(a.s + (rb(r) + t) * TR::floats(H), SW - 1, H, u0,
                                 make_float2(c[r][0], c[r][1]));
            }
        clk.mark(0);
        wg_wait<0>();
#pragma unroll
        for (int qq = 0; qq < G; qq++)
            wg_pin(dh[qq]);
        clk.mark(1);
        // The producer's x part of this step (it runs ahead: the wait is short).
        mbar_wait(full + p, (t >> 1) & 1);
        float xq[G][8];
#pragma unroll
        for (int qq = 0; qq < G; qq++) {
            const float4 lo = *xp_at(t, threadIdx.x, qq, 0), hi = *xp_at(t, threadIdx.x, qq, 1);
            xq[qq][0] = lo.x, xq[qq][1] = lo.y, xq[qq][2] = lo.z, xq[qq][3] = lo.w;
            xq[qq][4] = hi.x, xq[qq][5] = hi.y, xq[qq][6] = hi.z, xq[qq][7] = hi.w;
        }
        mbar_arrive(empty + p);
        clk.mark(2);

        float hn[4][2], cn[4][2];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            float s[2][SW];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int d = dix(r, i);
                float xc[G], hq[G];
#pragma unroll
                for (int qq = 0; qq < G; qq++) {
                    xc[qq] = xq[qq][d];
                    hq[qq] = dh[qq][d] * hinv + bias[(G + qq) * WG_HP + u0 + i];
                }
                Cell::template forward<true>(xc, hq, h[r][i], c[r][i], hn[r][i], cn[r][i], s[i]);
            }
            if (sp)
#pragma unroll
                for (int p = 0; p < SH; p++)
                    sv[p][r] = mode_f16::pack2(s[0][p], s[1][p]);
        }
        if constexpr ((V & 8) != 0)
            persist_wait_for(hn[0][0] + hn[3][1], a.dbg);
        clk.mark(3);

#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int i = 0; i < 2; i++)
                yv[r][i] = hn[r][i];
        clk.mark(4);
        if (t + 1 < T) {
            // The state entering step t+1: the reset value where is_init[b, t+1], else h'.
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    h[r][i] = !uok ? 0.0f : nreset[r] ? nh[r][i] : hn[r][i];
                    c[r][i] = !uok ? 0.0f : nreset[r] ? nc[r][i] : cn[r][i];
                }
            put_h(p ^ 1);
            load_next(t + 2);
        } else {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const size_t at = ((size_t)rowb(r) * L + l) * H + u0;
                if (a.h_n)
                    st2(a.h_n + at, hn[r][0], hn[r][1], rvalid(r) && uok);
                if (LSTM && a.c_n)
                    st2(a.c_n + at, cn[r][0], cn[r][1], rvalid(r) && uok);
            }
        }
        clk.mark(5);
        fence_proxy_async(); // this thread's h tile writes, visible to the next step's MMAs
        clk.mark(6);
        bar_sync(WG_BAR_CONS, NH * 128);
        clk.mark(7);
    }
    if (T > 0)
        out_put(T - 1);
    clk.flush(a.dbg);
#else
    (void)a;
    __trap(); // never launched: the host asks for this kernel on sm_90 only
#endif
}

// The loop for stored states (HID) or none; the GRU's instance, and the LSTM's without a tape,
// take either.
template <class Cell, class HM, int V, bool Z, int XK, int HU>
auto wg_kernel(bool hid) {
    if constexpr (Cell::G == 4 && Z)
        if (!hid)
            return seq_wg_forward<Cell, HM, V, Z, false, XK, HU>;
    return seq_wg_forward<Cell, HM, V, Z, true, XK, HU>;
}

template <class Cell, class HM, int V, int XK, int HU = WG_HP>
auto wg_kernel(bool tape, bool hid) {
    return tape ? wg_kernel<Cell, HM, V, true, XK, HU>(hid)
                : wg_kernel<Cell, HM, V, false, XK, HU>(hid);
}

template <class Cell, int XK>
int wg_smem(bool tape, bool hid) {
    return (int)(tape ? (hid ? wg_geom<Cell::G, wg_gr<Cell, true, true>(), XK>::SMEM
                             : wg_geom<Cell::G, wg_gr<Cell, true, false>(), XK>::SMEM)
                      : wg_geom<Cell::G, wg_gr<Cell, false, true>(), XK>::SMEM);
}

template <class Cell, class HM>
int wg_launch(const struct persist_fwd_args *a, bool clocks, cudaStream_t stream) {
    constexpr bool LSTM = Cell::G == 4;
    // Its case: fused x, vector access, z rows laid out as seq.cu does for H % 4 == 0,
    // I_l % 4 == 0, I_l <= 64 (the GRU's 128); the fp16 gate
    // tape exactly when z rows or (H = 128) z chunk parts are written, but the GRU's only with
    // a tape (with x at most 64 wide its backward may recompute the gates instead).
    // The LSTM's bf16 loop runs at H <= 64 alone: at H = 128 its mma.sync loop is the faster
    // (seq_plan.cu), so there is no full-width instance.
    constexpr bool HALF_ONLY = LSTM && !HM::SCALED;
    constexpr int XMAX = LSTM ? WG_XK : 2 * WG_XK;
    const bool tape = a->z || a->zc, wide = a->Il > WG_XK;
    if (a->H > (HALF_ONLY ? 64 : WG_HP) || a->H % 4 || a->xks <= 0 || a->Il > XMAX || a->Il < 1 ||
        !a->x || !a->vec || !a->xvec ||
        (a->z && (a->xoff != a->H + 4 || a->ldz != a->xoff + a->Il)) ||
        (a->zc && (a->z || !a->zc_ex != !HM::SCALED)) || (a->s && !a->shalf) ||
        (LSTM ? !tape != !a->s : (a->s && !tape) || a->c0 || a->cell))
        return RNND_EINVAL;
    const bool hid = a->hidden != nullptr, half = a->H <= 64;
    auto kernel = wg_kernel<Cell, HM, 0, WG_XK, 64>(tape, hid);
    if constexpr (!HALF_ONLY)
        if (!half)
            kernel = wg_kernel<Cell, HM, 0, WG_XK>(tape, hid);
    int smem = wg_smem<Cell, WG_XK>(tape, hid);
    if constexpr (XMAX > WG_XK)
        if (wide)
            kernel = wg_kernel<Cell, HM, 0, XMAX>(tape, hid), smem = wg_smem<Cell, XMAX>(tape, hid);
#ifdef RNND_CUDA_PHASE_CLOCKS
    if (clocks && !wide) {
        kernel = wg_kernel<Cell, HM, SEQ_CLOCKS, WG_XK, 64>(tape, hid);
        if constexpr (!HALF_ONLY)
            if (!half)
                kernel = wg_kernel<Cell, HM, SEQ_CLOCKS, WG_XK>(tape, hid);
    }
#else
    (void)clocks;
#endif
    RNND_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<CEIL_DIV(a->B, 16), WG_THREADS, smem, stream>>>(*a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

} // namespace

int rnnd__wg_gru_forward(const struct persist_fwd_args *a, bool bf16, bool clocks,
                         cudaStream_t stream) {
    return bf16 ? wg_launch<cell_gru, mode_bf16>(a, clocks, stream)
                : wg_launch<cell_gru, mode_f16>(a, clocks, stream);
}

int rnnd__wg_lstm_forward(const struct persist_fwd_args *a, bool bf16, bool clocks,
                          cudaStream_t stream) {
    return bf16 ? wg_launch<cell_lstm, mode_bf16>(a, clocks, stream)
                : wg_launch<cell_lstm, mode_f16>(a, clocks, stream);
}
