/*
 * step.cu: one recurrent step for a batch of rows whose states live in a slot table (the
 * inference path; struct rnnd_step). Per layer l (gate order GRU r,z,n; LSTM i,f,g,o):
 *   gates = [x_l | h_l] . [W_ih | W_hh]^T (no biases; h_l zero where is_init), then the cell of
 *   the sequence kernels (cell_gru / cell_lstm: GRU n = tanh(gx_n + b_in + r (gh_n + b_hn)),
 *   LSTM c' = f c + i g).
 *
 * Many rows at a large H with the weights' derived copy go to step16.cu (a cuBLAS GEMM on fp16
 * operands a layer); the rest take one launch per layer (docs/kernels.md), in one of these kernels:
 * - step_kernel, for more than a few rows: block (s, t) owns a tile of MT rows (t) and UT hidden
 *   units (s) with all their gates, a GEMM tile of MT x G*UT over K = I_l + H, fed by a cp.async
 *   pipeline of NS stages of KC columns (x chunks, then h chunks; rows gathered through the slot
 *   table, zero-filled where a row resets). The block's 8 warps are WM x WU x WK: a warp owns
 *   MTW m-tiles of 16 rows times 8 units of every gate plane, and every WK-th k-step of K (the
 *   WK partial sums are added through shared memory). Its accumulator planes are r, z, n_x, n_h
 *   (GRU: r multiplies only the h part of n) or i, f, g, o (LSTM), so a lane's MMA C fragment
 *   holds every plane of its own (row, unit) elements and the cell runs in registers. Tiles are
 *   64 x 32 for many rows (B=1024, H=256: 128 blocks), 32 x 16 or 16 x 8 (K split over the
 *   warps) for fewer. Products: TF32 mma.sync m16n8k8 (fp32 mode), BF16 m16n8k16 (bf16 mode),
 *   FFMA in the same fragment layout (ieee), accumulated in fp32.
 * - step_mv_kernel, for 2 to 8 rows: a warp per unit computes its gates' dot products with
 *   FFMA from shared memory (a block: 4 units, 4 rows).
 * - step_row_kernel, for one row: the same dot products with weights and row loaded straight
 *   into registers (a block: 2 units), so that B=1 runs on H/2 blocks.
 *
 * Every block of a row tile reads the tile's old h of layer l over all units, and writes its
 * own units' new h and c: to other table rows than the ones read (struct rnnd_step), so no block
 * waits for another. Layer l+1 reads its input, layer l's new h, from the new rows (the top
 * layer's h also goes to `out`). Every launch is a kernel on the context's stream: CUDA-graph
 * safe. On Hopper the kernels are launched programmatically (PDL; the tile and few-rows kernels
 * where their copies bypass L1): their blocks may become resident while the previous kernel
 * runs, read only weights and biases before that kernel has completed (griddepcontrol.wait;
 * step_kargs.pre; step_wg.cu's kernel also layer 0's inputs, step_kargs.early_x), and read
 * through L2 only.
 */
#include "step.cuh"

#include "seq_cells.cuh"
#include "step_impl.cuh"

#include <type_traits>

// The one-row kernel (B = 1): ROW_UNITS units (a warp each) per block (H=256: 128 blocks, most
// SMs pull a share of the weights), K in passes of ROW_CHUNKS chunks of 128 columns.
#define RNND_STEP_ROW_UNITS  2
#define RNND_STEP_ROW_CHUNKS 4
// The few-rows kernel: at most MV_MAX_ROWS rows in a call, MV_ROWS rows and MV_UNITS units (a
// warp each) per block, at most MV_SMEM bytes of weights and rows in shared memory.
#define RNND_STEP_MV_MAX_ROWS 8
#define RNND_STEP_MV_ROWS     4
#define RNND_STEP_MV_UNITS    4
#define RNND_STEP_MV_SMEM     (96 << 10)

// ---------------------------------------------------------------------------------------------
// Tile shapes and matmul modes

template <int MTW_, int WM_, int WU_, int WK_, int NS_>
struct step_cfg {
    static constexpr int MTW = MTW_;                   // m-tiles (16 rows) per warp
    static constexpr int WM = WM_, WU = WU_, WK = WK_; // warps along rows, units, k-steps
    static constexpr int KC = 64, NS = NS_;            // chunk width, pipeline stages
    static constexpr int MT = 16 * MTW * WM;           // rows per block
    static constexpr int UT = 8 * WU;                  // units per block
    static constexpr int NT = 32 * WM * WU * WK;       // threads
};
using cfg_big = step_cfg<2, 2, 4, 2, 3>;   // 64 rows x 32 units, K split in 2 (16 warps)
using cfg_mid = step_cfg<2, 1, 2, 4, 4>;   // 32 x 16, K split in 4
using cfg_small = step_cfg<1, 1, 1, 8, 8>; // 16 x 8, K split in 8
static_assert(cfg_big::MT == RNND_STEP_WG_MT && cfg_big::UT == RNND_STEP_WG_UT,
              "step_wg.cu's kernel replaces cfg_big's: same tiles");

// ldmatrix of 8x8 matrices of 16-bit pairs = 8 rows of 4 floats: lane t receives row t/4,
// float t%4 of each matrix. sa is this lane's row address in shared space (lanes 8j..8j+7 give
// matrix j's rows).
static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t sa) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sa));
}
static __device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t sa) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(sa));
}

static __device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One k-step of a warp's tile: acc[mt][plane] += A[rows of m-tile mt][k0..] . W[plane's 8
// units][k0..]^T. A is the stage's (MT, ld) row tile, W its (G*UT, ld) weight rows (plane p,
// unit uu at row p*UT + uu); m0, n0 are the warp's first row and unit. Loaded plane p adds into
// accumulator plane p, except the GRU's n gate in the h part (NH), which goes to plane 3.
// C fragment of every mode (mma.sync's): c[0] (g, 2tg), c[1] (g, 2tg+1), c[2] (g+8, 2tg),
// c[3] (g+8, 2tg+1) for row g = lane/4 and unit 2tg (tg = lane%4) of the 16 x 8 tile.
//
// TF32: fragments straight from the stage with ldmatrix (A: one x4 per m-tile; W: one x4 per
// two planes), fp32 bit patterns as they are: the tensor cores read their tf32 part, i.e. the
// operands are rounded toward zero to 10 mantissa bits (a cvt.rna per element would double the
// k-step's instructions; the error stays within the tf32 bound of docs/design.md, docs/kernels.md).
struct step_tf32 {
    static constexpr int KSTEP = 8, PAD = 4; // row pitch KC+4: conflict-free ldmatrix rows
    static constexpr bool FAST = true;
    // The lane's ldmatrix row addresses (bytes from the A tile, the W tile) at k = 0:
    // A matrices rows 0-7 | 8-15 at k, then at k+4; W: plane q at k | k+4, then plane q+1.
    static __device__ __forceinline__ uint32_t a_lane(int ld, int m0, int lane) {
        return 4 * ((m0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 4 * (lane >> 4));
    }
    static __device__ __forceinline__ uint32_t w_lane(int ld, int n0, int UT, int lane) {
        return 4 * ((n0 + (lane & 7) + (lane >> 4) * UT) * ld + 4 * ((lane >> 3) & 1));
    }
    template <int MTW, int G, bool NH>
    static __device__ __forceinline__ void kstep(float (&acc)[MTW][4][4], const float *A,
                                                 const float *W, uint32_t sa, uint32_t sw, int ld,
                                                 int m0, int n0, int UT, int k0, int lane) {
        (void)A, (void)W, (void)m0, (void)n0, (void)lane;
        uint32_t a[MTW][4];
#pragma unroll
        for (int mt = 0; mt < MTW; mt++)
            ldsm_x4(a[mt], sa + 4 * (16 * mt * ld + k0));
#pragma unroll
        for (int q = 0; q < G; q += 2) {
            uint32_t b[4]; // b0, b1 of plane q, then of plane q+1
            const uint32_t p = sw + 4 * (q * UT * ld + k0);
            if (q + 1 < G) {
                ldsm_x4(b, p);
            } else {
                uint32_t b2[2];
                ldsm_x2(b2, p);
                b[0] = b2[0], b[1] = b2[1];
            }
#pragma unroll
            for (int h = 0; h < 2 && q + h < G; h++) {
                const int ap = NH && q + h == 2 ? 3 : q + h;
#pragma unroll
                for (int mt = 0; mt < MTW; mt++)
                    mma_tf32(acc[mt][ap], a[mt], b[2 * h], b[2 * h + 1]);
            }
        }
    }
};

struct step_bf16 {
    static constexpr int KSTEP = 16, PAD = 8; // row pitch KC+8: conflict-free float2 loads
    static constexpr bool FAST = true;
    static __device__ __forceinline__ uint32_t ld2(const float *p) {
        float2 v = *reinterpret_cast<const float2 *>(p);
        return pack_bf16(v.x, v.y);
    }
    static __device__ __forceinline__ uint32_t a_lane(int, int, int) {
        return 0;
    }
    static __device__ __forceinline__ uint32_t w_lane(int, int, int, int) {
        return 0;
    }
    template <int MTW, int G, bool NH>
    static __device__ __forceinline__ void kstep(float (&acc)[MTW][4][4], const float *A,
                                                 const float *W, uint32_t sa, uint32_t sw, int ld,
                                                 int m0, int n0, int UT, int k0, int lane) {
        (void)sa, (void)sw;
        const int g = lane >> 2, tg = lane & 3;
        uint32_t a[MTW][4];
#pragma unroll
        for (int mt = 0; mt < MTW; mt++) {
            const float *p = A + (m0 + 16 * mt + g) * ld + k0 + 2 * tg;
            a[mt][0] = ld2(p);
            a[mt][1] = ld2(p + 8 * ld);
            a[mt][2] = ld2(p + 8);
            a[mt][3] = ld2(p + 8 * ld + 8);
        }
#pragma unroll
        for (int q = 0; q < G; q++) {
            const float *p = W + (q * UT + n0 + g) * ld + k0 + 2 * tg;
            uint32_t b0 = ld2(p), b1 = ld2(p + 8);
            const int ap = NH && q == 2 ? 3 : q;
#pragma unroll
            for (int mt = 0; mt < MTW; mt++)
                asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                    : "+f"(acc[mt][ap][0]), "+f"(acc[mt][ap][1]), "+f"(acc[mt][ap][2]),
                      "+f"(acc[mt][ap][3])
                    : "r"(a[mt][0]), "r"(a[mt][1]), "r"(a[mt][2]), "r"(a[mt][3]), "r"(b0), "r"(b1));
        }
    }
};

// Strict fp32: each lane sums its own C fragment elements with FFMA, k in order.
struct step_ieee {
    static constexpr int KSTEP = 8, PAD = 4;
    static constexpr bool FAST = false;
    static __device__ __forceinline__ uint32_t a_lane(int, int, int) {
        return 0;
    }
    static __device__ __forceinline__ uint32_t w_lane(int, int, int, int) {
        return 0;
    }
    template <int MTW, int G, bool NH>
    static __device__ __forceinline__ void kstep(float (&acc)[MTW][4][4], const float *A,
                                                 const float *W, uint32_t sa, uint32_t sw, int ld,
                                                 int m0, int n0, int UT, int k0, int lane) {
        (void)sa, (void)sw;
        const int g = lane >> 2, tg = lane & 3;
#pragma unroll
        for (int kk = 0; kk < KSTEP; kk++) {
            float a[MTW][2];
#pragma unroll
            for (int mt = 0; mt < MTW; mt++) {
                a[mt][0] = A[(m0 + 16 * mt + g) * ld + k0 + kk];
                a[mt][1] = A[(m0 + 16 * mt + g + 8) * ld + k0 + kk];
            }
#pragma unroll
            for (int q = 0; q < G; q++) {
                const float *p = W + (q * UT + n0 + 2 * tg) * ld + k0 + kk;
                float w0 = p[0], w1 = p[ld];
                const int ap = NH && q == 2 ? 3 : q;
#pragma unroll
                for (int mt = 0; mt < MTW; mt++) {
                    acc[mt][ap][0] = fmaf(a[mt][0], w0, acc[mt][ap][0]);
                    acc[mt][ap][1] = fmaf(a[mt][0], w1, acc[mt][ap][1]);
                    acc[mt][ap][2] = fmaf(a[mt][1], w0, acc[mt][ap][2]);
                    acc[mt][ap][3] = fmaf(a[mt][1], w1, acc[mt][ap][3]);
                }
            }
        }
    }
};

// ---------------------------------------------------------------------------------------------
// Device helpers

// Asynchronous global -> shared copies (cp_async16: seq_prims.cuh); ok false writes zeros
// instead (src is not read).
static __device__ __forceinline__ void cp_async4(float *s, const float *g, bool ok) {
    uint32_t sa = (uint32_t)__cvta_generic_to_shared(s);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(sa),
                 "l"(__cvta_generic_to_global(g)), "r"(ok ? 4 : 0)
                 : "memory");
}

// ---------------------------------------------------------------------------------------------
// The kernel: one layer for a (unit slice, row tile) block.

template <class Cell, class Mode, class Cfg>
static __global__ void __launch_bounds__(Cfg::NT) step_kernel(const step_kargs a) {
    constexpr int G = Cell::G, MT = Cfg::MT, UT = Cfg::UT, KC = Cfg::KC, NS = Cfg::NS;
    constexpr int MTW = Cfg::MTW, WM = Cfg::WM, WU = Cfg::WU, WK = Cfg::WK, NT = Cfg::NT;
    constexpr int LD = KC + Mode::PAD, KSTEPS = KC / Mode::KSTEP;
    constexpr int STAGE = (MT + G * UT) * LD; // floats: A rows, then G*UT weight rows
    constexpr bool GRU = G == 3;
    extern __shared__ float4 smem4[];
    float *sm = reinterpret_cast<float *>(smem4);
    const uint32_t sm_u32 = (uint32_t)__cvta_generic_to_shared(sm);
    __shared__ const float *s_xrow[MT], *s_hrow[MT]; // row sources, NULL: zeros
    __shared__ int s_slot[MT], s_slot_new[MT];       // table rows: old state, new state

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    const int wu = warp % WU, wm = (warp / WU) % WM, wk = warp / (WU * WM);
    const int H = a.H, L = a.L, l = a.l, Il = l == 0 ? a.I : H;
    const int row0 = blockIdx.y * MT, u0 = blockIdx.x * UT;

    // Chunk c of K into stage c % NS: x columns for c < cx, h columns after. Weights and rows
    // are issued apart, so that the first chunks' weights need not wait for the slots; each
    // is called once per chunk, in order.
    // 16-byte copies: thread t copies 4 columns (kg) of rows t/KG + j*RP, whose sources it
    // keeps for the current part of K (x, then h) and moves by k0.
    const int cx = CEIL_DIV(Il, KC), nc = cx + CEIL_DIV(H, KC);
    constexpr int KG = KC / 4, RP = NT / KG;
    constexpr int NWJ = CEIL_DIV(G * UT, RP), NAJ = CEIL_DIV(MT, RP);
    const int kg = 4 * (tid % KG), r0t = tid / KG;
    const float *wsrc[NWJ], *asrc[NAJ];
    int wpart = -1, apart = -1; // which part of K the sources point into (0 x, 1 h)
    auto load_w = [&](int c) {
        const int hp = c >= cx, k0 = (hp ? c - cx : c) * KC, K = hp ? H : Il;
        const float *W = hp ? a.w_hh : a.w_ih;
        float *Ws = sm + (c % NS) * STAGE + MT * LD;
        if (hp ? a.vec_h : a.vec_x) { // K % 4 == 0: a group of 4 is all in or all out
            if (wpart != hp) {
                wpart = hp;
#pragma unroll
                for (int j = 0; j < NWJ; j++) {
                    const int r = r0t + j * RP, u = u0 + r % UT;
                    wsrc[j] =
                        r < G * UT && u < H ? W + (size_t)((r / UT) * H + u) * K + kg : nullptr;
                }
            }
            const uint32_t dst = (uint32_t)__cvta_generic_to_shared(Ws) + 4 * (r0t * LD + kg);
            const bool kin = k0 + kg < K;
#pragma unroll
            for (int j = 0; j < NWJ; j++)
                if (r0t + j * RP < G * UT)
                    cp_async16(dst + 4 * j * RP * LD, wsrc[j] && kin ? wsrc[j] + k0 : W,
                               wsrc[j] && kin);
        } else {
            for (int i = tid; i < G * UT * KC; i += NT) {
                int r = i / KC, k = k0 + i % KC, q = r / UT, u = u0 + r % UT;
                bool ok = u < H && k < K;
                cp_async4(Ws + r * LD + (k - k0), ok ? W + (size_t)(q * H + u) * K + k : W, ok);
            }
        }
    };
    auto load_a = [&](int c) {
        const int hp = c >= cx, k0 = (hp ? c - cx : c) * KC, K = hp ? H : Il;
        const float *const *rows = hp ? s_hrow : s_xrow;
        float *As = sm + (c % NS) * STAGE;
        if (hp ? a.vec_h : a.vec_x) {
            if (apart != hp) {
                apart = hp;
#pragma unroll
                for (int j = 0; j < NAJ; j++) {
                    const int m = r0t + j * RP;
                    asrc[j] = m < MT && rows[m] ? rows[m] + kg : nullptr;
                }
            }
            const uint32_t dst = (uint32_t)__cvta_generic_to_shared(As) + 4 * (r0t * LD + kg);
            const bool kin = k0 + kg < K;
#pragma unroll
            for (int j = 0; j < NAJ; j++)
                if (r0t + j * RP < MT)
                    cp_async16(dst + 4 * j * RP * LD, asrc[j] && kin ? asrc[j] + k0 : a.w_ih,
                               asrc[j] && kin);
        } else {
            for (int i = tid; i < MT * KC; i += NT) {
                int m = i / KC, k = k0 + i % KC;
                const float *src = rows[m];
                bool ok = src && k < K;
                cp_async4(As + m * LD + (k - k0), ok ? src + k : a.w_ih, ok);
            }
        }
    };
    // The first chunks' weights need no slot.
    step_wait(a, [&] {
#pragma unroll
        for (int c = 0; c < NS - 1; c++)
            if (c < nc)
                load_w(c);
    });

    for (int m = tid; m < MT; m += NT) {
        const step_row r = step_row_at(a, row0 + m);
        s_slot[m] = r.slot, s_slot_new[m] = r.slot_new, s_xrow[m] = r.x, s_hrow[m] = r.h;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NS - 1; c++) {
        if (c < nc)
            load_a(c);
        cp_commit(); // group 0 holds the prologue's weights too
    }

    // What the cell needs besides the sums, loaded now so it lands during the matmuls: per
    // element (row, unit) of the lane's C fragments the old state, per unit the biases.
    const int m0 = wm * MTW * 16, n0 = wu * 8;
    float hprev[MTW][4], cprev[MTW][4], bx[G][2], bh[G][2];
    if (wk == 0) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int u = min(u0 + n0 + 2 * tg + j, H - 1);
#pragma unroll
            for (int q = 0; q < G; q++) {
                bx[q][j] = __ldcg(a.b_ih + q * H + u);
                bh[q][j] = __ldcg(a.b_hh + q * H + u);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MTW; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + 16 * mt + g + 8 * (e >> 1);
                const int u = min(u0 + n0 + 2 * tg + (e & 1), H - 1);
                const size_t at = ((size_t)s_slot[m] * L + l) * H + u;
                const bool live = s_hrow[m] != nullptr; // present and not resetting
                hprev[mt][e] = live ? __ldcg(a.state_h + at) : 0.0f;
                cprev[mt][e] = live && !GRU ? __ldcg(a.state_c + at) : 0.0f;
            }
    }

    float acc[MTW][4][4];
#pragma unroll
    for (int mt = 0; mt < MTW; mt++)
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[mt][q][e] = 0.0f;

    const uint32_t sa_lane = Mode::a_lane(LD, m0, lane), sw_lane = Mode::w_lane(LD, n0, UT, lane);
    for (int c = 0; c < nc; c++) {
        cp_wait<NS - 2>();
        __syncthreads(); // chunk c landed for every thread; stage (c-1) % NS is free again
        if (c + NS - 1 < nc) {
            load_w(c + NS - 1);
            load_a(c + NS - 1);
        }
        cp_commit();
        const float *As = sm + (c % NS) * STAGE, *Ws = As + MT * LD;
        const uint32_t sa = sm_u32 + 4 * (c % NS) * STAGE + sa_lane;
        const uint32_t sw = sm_u32 + 4 * ((c % NS) * STAGE + MT * LD) + sw_lane;
        const bool hp = c >= cx;
        const int kend = (hp ? H : Il) - (hp ? c - cx : c) * KC; // valid columns in this chunk
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            if ((c * KSTEPS + ks) % WK != wk || ks * Mode::KSTEP >= kend)
                continue;
            if (GRU && hp)
                Mode::template kstep<MTW, G, true>(acc, As, Ws, sa, sw, LD, m0, n0, UT,
                                                   ks * Mode::KSTEP, lane);
            else
                Mode::template kstep<MTW, G, false>(acc, As, Ws, sa, sw, LD, m0, n0, UT,
                                                    ks * Mode::KSTEP, lane);
        }
    }
    cp_wait<0>();
    __syncthreads(); // every stage read: the space is the reduction buffer now

    if constexpr (WK > 1) {
        // Partial sums of warps wk > 0 to shared memory ([wk-1][warp tile][element][lane]: no
        // bank conflicts), added by the wk = 0 warps.
        constexpr int NACC = MTW * 16;
        float *red = sm + ((wk - 1) * WM * WU + wm * WU + wu) * NACC * 32 + lane;
        if (wk > 0) {
#pragma unroll
            for (int mt = 0; mt < MTW; mt++)
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        red[((mt * 4 + q) * 4 + e) * 32] = acc[mt][q][e];
        }
        __syncthreads();
        if (wk == 0) {
            for (int j = 1; j < WK; j++) {
                const float *r = sm + ((j - 1) * WM * WU + wm * WU + wu) * NACC * 32 + lane;
#pragma unroll
                for (int mt = 0; mt < MTW; mt++)
#pragma unroll
                    for (int q = 0; q < 4; q++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            acc[mt][q][e] += r[((mt * 4 + q) * 4 + e) * 32];
            }
        }
    }

    // The lane's (row, unit) elements of the C fragments (the wk = 0 warps), past B and H skipped.
    auto for_elements = [&](auto f) {
        if (wk != 0)
            return;
#pragma unroll
        for (int mt = 0; mt < MTW; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + 16 * mt + g + 8 * (e >> 1), b = row0 + m;
                const int u = u0 + n0 + 2 * tg + (e & 1);
                if (b < a.B && u < H)
                    f(mt, e, m, b, u);
            }
    };
    // The cell on them; the new states to their table rows.
    for_elements([&](int mt, int e, int m, int b, int u) {
        float xq[G], hq[G], s[Cell::SW];
#pragma unroll
        for (int q = 0; q < G; q++) {
            xq[q] = acc[mt][q][e] + bx[q][e & 1];
            hq[q] = bh[q][e & 1];
        }
        if (GRU)
            hq[2] += acc[mt][3][e];
        float hn, cn;
        Cell::template forward<Mode::FAST>(xq, hq, hprev[mt][e], cprev[mt][e], hn, cn, s);
        if (a.out)
            a.out[(size_t)b * H + u] = hn;
        if (a.h_before)
            a.h_before[((size_t)b * L + l) * H + u] = hprev[mt][e];
        if (a.c_before)
            a.c_before[((size_t)b * L + l) * H + u] = cprev[mt][e];
        const size_t at = ((size_t)s_slot_new[m] * L + l) * H + u;
        a.state_h[at] = hn;
        if (!GRU)
            a.state_c[at] = cn;
    });
}

// ---------------------------------------------------------------------------------------------
// The kernel for few rows: one layer for up to R rows (RNND_STEP_MV_ROWS) and
// RNND_STEP_MV_UNITS units per block (a warp per unit, all its gates), as plain dot products. The block copies
// its units' gate rows [W_ih | W_hh] and the rows' [x | h] (zero where is_init) to shared
// memory with cp.async (the weights first: they need no slot), then every lane sums a stride of
// K for each (gate plane, row), a warp reduction per sum, and lane r runs the cell for row r.
// FFMA in fp32 for every mode (bf16 rounds both operands to bf16 first): as exact as the tensor
// cores' products or more, and with so few rows the matmul is no cost.

template <class Cell, bool BF16, bool FAST, int R>
static __global__ void __launch_bounds__(32 * RNND_STEP_MV_UNITS)
    step_mv_kernel(const step_kargs a) {
    constexpr int G = Cell::G, U = RNND_STEP_MV_UNITS;
    constexpr int NP = 4; // accumulator planes: r, z, n_x, n_h (GRU) or i, f, g, o (LSTM)
    constexpr bool GRU = G == 3;
    extern __shared__ float4 smem4[];
    __shared__ int s_slot[R], s_slot_new[R]; // table rows: old state, new state
    __shared__ const float *s_hrow[R], *s_xrow[R];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int H = a.H, L = a.L, l = a.l, Il = l == 0 ? a.I : H, K = Il + H;
    const int row0 = blockIdx.y * R, nrows = min(R, a.B - row0), u0 = blockIdx.x * U;
    float *Ws = reinterpret_cast<float *>(smem4); // (G*U, K): [W_ih row | W_hh row], plane major
    float *Xs = Ws + G * U * K;                   // (R, K): [x | h]
    const bool vec = a.vec_x && a.vec_h;          // Il, H multiples of 4 and aligned

    // Weights of the block's units (zero past H): warp w copies rows w, w + U, ...; and warp w's
    // unit's biases for the cell. Before the wait where a.pre allows.
    const int step = vec ? 128 : 32;
    const int u = u0 + w, uc = min(u, H - 1);
    float bx[G], bh[G];
    step_wait(a, [&] {
        for (int r = w; r < G * U; r += U) {
            const int q = r / U, uw = u0 + r % U;
            const bool ok = uw < H;
            const float *wx = a.w_ih + (size_t)(q * H + uw) * Il;
            const float *wh = a.w_hh + (size_t)(q * H + uw) * H;
            for (int kk = vec ? 4 * lane : lane; kk < K; kk += step) {
                const float *src = !ok ? a.w_ih : kk < Il ? wx + kk : wh + (kk - Il);
                if (vec)
                    cp_async16(Ws + r * K + kk, src, ok);
                else
                    cp_async4(Ws + r * K + kk, src, ok);
            }
        }
        unit_biases(a, uc, bx, bh);
    });
    if (tid < R) {
        const step_row r = step_row_at(a, row0 + tid);
        s_slot[tid] = r.slot, s_slot_new[tid] = r.slot_new, s_xrow[tid] = r.x, s_hrow[tid] = r.h;
    }
    __syncthreads();
    float cprev = 0.0f;
    if (!GRU && lane < nrows && s_hrow[lane])
        cprev = __ldcg(a.state_c + ((size_t)s_slot[lane] * L + l) * H + uc);
    for (int r = w; r < R; r += U) {
        const float *xr = s_xrow[r], *hr = s_hrow[r];
        for (int kk = vec ? 4 * lane : lane; kk < K; kk += step) {
            const float *row = kk < Il ? xr : hr;
            const float *src = row ? row + (kk < Il ? kk : kk - Il) : a.w_ih;
            if (vec)
                cp_async16(Xs + r * K + kk, src, row != nullptr);
            else
                cp_async4(Xs + r * K + kk, src, row != nullptr);
        }
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();

    // acc[p][r]: lane's partial sums over its k stride, then warp sums.
    float acc[NP][R];
#pragma unroll
    for (int p = 0; p < NP; p++)
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[p][r] = 0.0f;
    const float *wr = Ws + w * K; // plane q's row at + q*U*K
    auto dot = [&](int k, bool hp) {
        float xv[R], wv[G];
#pragma unroll
        for (int r = 0; r < R; r++)
            xv[r] = BF16 ? round_bf16(Xs[r * K + k]) : Xs[r * K + k];
#pragma unroll
        for (int q = 0; q < G; q++)
            wv[q] = BF16 ? round_bf16(wr[q * U * K + k]) : wr[q * U * K + k];
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int p = GRU && hp && q == 2 ? 3 : q;
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[p][r] = fmaf(wv[q], xv[r], acc[p][r]);
        }
    };
    for (int k = lane; k < Il; k += 32)
        dot(k, false);
    for (int k = Il + lane; k < K; k += 32)
        dot(k, true);
#pragma unroll
    for (int p = 0; p < NP; p++)
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[p][r] = warp_sum(acc[p][r]);

            // Lane r: the cell of row r (every lane holds every sum; constant indices through a select)
            // and its new states to its table row.
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (lane != r || r >= nrows || u >= H)
            continue;
        const int b = row0 + r;
        const float hprev = Xs[r * K + Il + u];
        float xq[G], hq[G], sv[Cell::SW];
#pragma unroll
        for (int q = 0; q < G; q++) {
            xq[q] = acc[q][r] + bx[q];
            hq[q] = bh[q];
        }
        if (GRU)
            hq[2] += acc[3][r];
        float hn, cn;
        Cell::template forward<FAST>(xq, hq, hprev, cprev, hn, cn, sv);
        if (a.out)
            a.out[(size_t)b * H + u] = hn;
        if (a.h_before)
            a.h_before[((size_t)b * L + l) * H + u] = hprev;
        if (a.c_before)
            a.c_before[((size_t)b * L + l) * H + u] = cprev;
        const size_t at = ((size_t)s_slot_new[r] * L + l) * H + u;
        a.state_h[at] = hn;
        if (!GRU)
            a.state_c[at] = cn;
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel for one row (B = 1): one layer, RNND_STEP_ROW_UNITS units per block, a warp per unit
// (all its gates), as plain dot products straight from global memory into registers. The
// K = I_l + H columns of the unit's gate rows [W_ih | W_hh] and of the row's [x | h] (h zero
// where is_init) go in passes of RNND_STEP_ROW_CHUNKS chunks of 128 columns, lane t holding
// columns 4t..4t+3 of each chunk; a pass issues all its loads before its first product, every
// lane reads the row's slot itself (no barrier between the slot and the h loads) and nothing goes
// through shared memory, so the step is the chain slot -> h row, products, warp reductions,
// cell, stores (docs/kernels.md). Lane 0 runs the cell. FFMA in fp32 for
// every mode (bf16 rounds both operands to bf16 first), like the few-rows kernel. (The same
// scheme with 4 rows a block measured 1.5-2 us slower than the few-rows kernel at B = 4 and 8,
// so that one keeps B = 2..8.)
//
// The kernel is launched with programmatic stream serialization (step_row_launch): its blocks
// may be resident before the previous kernel on the stream has finished, and wait for it
// (griddepcontrol.wait) before their first load of the row; the first pass's weights and the
// biases go to registers before that wait where a.pre allows. Every load bypasses L1 (.cg),
// which may still hold lines the previous kernel's blocks read on the same SM before its last
// block rewrote them.

// Columns k..k+3 of the concatenation [xp (Il) | hp (K - Il)], zero past K or where the part's
// pointer is null. vec: 16-byte loads (Il and K multiples of 4, the parts aligned; k is a
// multiple of 4, so a group never straddles the parts).
static __device__ __forceinline__ float4 row_load4(const float *xp, const float *hp, int Il, int K,
                                                   int k, bool vec) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (vec) {
        const float *p = k < Il ? xp : hp;
        if (k < K && p)
            v = __ldcg(reinterpret_cast<const float4 *>(p + (k < Il ? k : k - Il)));
        return v;
    }
    float *e = &v.x;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int ki = k + i;
        const float *p = ki < Il ? xp : hp;
        if (ki < K && p)
            e[i] = __ldcg(p + (ki < Il ? ki : ki - Il));
    }
    return v;
}

// One layer of the row; wait(load) runs load (the first pass's weights, the biases) and the
// programmatic wait in the order the launch allows.
template <class Cell, bool BF16, bool FAST, class Wait>
static __device__ __forceinline__ void step_row(const step_kargs &a, Wait wait) {
    constexpr int G = Cell::G, U = RNND_STEP_ROW_UNITS, NCH = RNND_STEP_ROW_CHUNKS;
    constexpr int NP = 4; // accumulator planes: r, z, n_x, n_h (GRU) or i, f, g, o (LSTM)
    constexpr bool GRU = G == 3;
    const int lane = threadIdx.x & 31;
    const int H = a.H, L = a.L, l = a.l, Il = l == 0 ? a.I : H, K = Il + H;
    const int u = blockIdx.x * U + (threadIdx.x >> 5), uc = min(u, H - 1); // past H: no stores
    const bool vec = a.vec_x && a.vec_h;

    // The unit's gate rows, a pass of them (columns k0 + 128 j) into wv, and its biases.
    const float *wx[G], *wh[G];
#pragma unroll
    for (int q = 0; q < G; q++) {
        wx[q] = a.w_ih + (size_t)(q * H + uc) * Il;
        wh[q] = a.w_hh + (size_t)(q * H + uc) * H;
    }
    float4 wv[NCH][G];
    auto load_pass = [&](int k0) {
#pragma unroll
        for (int j = 0; j < NCH; j++)
#pragma unroll
            for (int q = 0; q < G; q++)
                wv[j][q] = row_load4(wx[q], wh[q], Il, K, k0 + 128 * j, vec);
    };
    float bx[G], bh[G];
    wait([&] {
        load_pass(4 * lane);
        unit_biases(a, uc, bx, bh);
    });

    // The row's sources (null: zeros).
    const bool reset = a.is_init && __ldcg(a.is_init);
    const int slot = __ldcg(a.slots), slot_new = __ldcg(a.slots_new);
    const float *xr = l == 0 ? a.x : a.state_h + ((size_t)slot_new * L + l - 1) * H;
    const float *hr = reset ? nullptr : a.state_h + ((size_t)slot * L + l) * H;
    // The cell's state inputs (lane 0).
    float hprev = 0.0f, cprev = 0.0f;
    if (lane == 0 && hr) {
        hprev = __ldcg(hr + uc);
        if (!GRU)
            cprev = __ldcg(a.state_c + ((size_t)slot * L + l) * H + uc);
    }

    float acc[NP] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 4 * lane; k0 < K; k0 += NCH * 128) {
        if (k0 != 4 * lane) // the first pass's weights are in already
            load_pass(k0);
        float4 xv[NCH];
#pragma unroll
        for (int j = 0; j < NCH; j++)
            xv[j] = row_load4(xr, hr, Il, K, k0 + 128 * j, vec);
#pragma unroll
        for (int j = 0; j < NCH; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const bool hpart = k0 + 128 * j + i >= Il; // GRU: n's h part goes to plane 3
                const float v = (&xv[j].x)[i], xe = BF16 ? round_bf16(v) : v;
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const float w = (&wv[j][q].x)[i], we = BF16 ? round_bf16(w) : w;
                    if (GRU && q == 2) {
                        acc[2] = fmaf(hpart ? 0.0f : we, xe, acc[2]);
                        acc[3] = fmaf(hpart ? we : 0.0f, xe, acc[3]);
                    } else {
                        acc[q] = fmaf(we, xe, acc[q]);
                    }
                }
            }
    }
#pragma unroll
    for (int p = 0; p < NP; p++)
        acc[p] = warp_sum(acc[p]);

    if (lane == 0 && u < H) {
        float xq[G], hq[G], sv[Cell::SW], hn, cn;
#pragma unroll
        for (int q = 0; q < G; q++) {
            xq[q] = acc[q] + bx[q];
            hq[q] = bh[q];
        }
        if (GRU)
            hq[2] += acc[3];
        Cell::template forward<FAST>(xq, hq, hprev, cprev, hn, cn, sv);
        if (a.out)
            a.out[u] = hn;
        if (a.h_before)
            a.h_before[(size_t)l * H + u] = hprev;
        if (a.c_before)
            a.c_before[(size_t)l * H + u] = cprev;
        const size_t at = ((size_t)slot_new * L + l) * H + u;
        a.state_h[at] = hn;
        if (!GRU)
            a.state_c[at] = cn;
    }
}

template <class Cell, bool BF16, bool FAST>
static __global__ void __launch_bounds__(32 * RNND_STEP_ROW_UNITS)
    step_row_kernel(const step_kargs a) {
    step_row<Cell, BF16, FAST>(a, [&](auto load) { step_wait(a, load); });
}

// Every layer of the row in one launch (L > 1) where the step is launched, not recorded: a launch
// costs the host more than a layer takes the device (two layers of I = 64, H = 128 back to back:
// 5.5-6.9 us against 10.3-10.9 a launch a layer). In a recording (the daemon replays its small
// batches) the launches cost nothing and a layer apart loads its weights while the layer below
// runs (PDL), which the barrier's layers cannot: 3.1 and 2.7 us on the device against 4.9 and 5.5
// (journal, "single step"). Layer l + 1 reads all of layer l's new state, so the blocks meet between layers at a grid
// barrier (bar: the arrivals, then the generation, which the last block to arrive bumps after
// zeroing the count). The barrier needs every block resident at once: the grid is at most
// RNND_STEP_ROW_RESIDENT blocks an SM (the launch bounds promise them room), and the kernel lets
// the next one on the stream start its blocks only in the last layer, after the last barrier, so
// none of them can take a place a block of this grid still waits for.
#define RNND_STEP_ROW_RESIDENT 8
#define RNND_STEP_ROW_LAYERS   4
struct step_row_layers {
    step_kargs a[RNND_STEP_ROW_LAYERS];
    unsigned *bar;
};

static __device__ void grid_barrier(unsigned *bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned *gen = bar + 1;
        const unsigned g = *gen; // before this block's arrival, so the generation it waits out
        __threadfence();         // this block's state stores before its arrival
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            bar[0] = 0;
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

template <class Cell, bool BF16, bool FAST>
static __global__ void __launch_bounds__(32 * RNND_STEP_ROW_UNITS, RNND_STEP_ROW_RESIDENT)
    step_row_layers_kernel(const step_row_layers s) {
    const int L = s.a[0].L;
    for (int l = 0; l < L; l++) {
        step_row<Cell, BF16, FAST>(s.a[l], [&](auto load) {
            if (l == 0) {
                step_wait_only(s.a[0], load);
            } else { // the weights are the step's constants: in flight across the barrier
                load();
                grid_barrier(s.bar);
            }
            if (l == L - 1)
                grid_release();
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Launchers

template <class Cfg, int G>
static constexpr size_t step_smem(int pad) {
    size_t stages = (size_t)Cfg::NS * (Cfg::MT + G * Cfg::UT) * (Cfg::KC + pad);
    size_t red = (size_t)(Cfg::WK - 1) * Cfg::WM * Cfg::WU * Cfg::MTW * 16 * 32;
    return (stages > red ? stages : red) * sizeof(float);
}

// Shared memory of the few-rows kernel (R rows a block) for layer inputs of width Il.
static size_t step_mv_smem(int G, int R, int Il, int H) {
    return (size_t)(G * RNND_STEP_MV_UNITS + R) * (Il + H) * sizeof(float);
}

static bool spans_meet(cuda_ctx::dev_span a, cuda_ctx::dev_span b) {
    const char *p = (const char *)a.p, *q = (const char *)b.p;
    return a.n && b.n && p < q + b.n && q < p + a.n;
}

// Whether the step's inputs overlap nothing the last step wrote: neither the state tables (which
// inputs never lie in: struct rnnd_step) nor its out, h_before and c_before.
static bool inputs_untouched(const struct cuda_ctx *c, const struct rnnd_step *st,
                             const struct rnnd_model *m) {
    const size_t B = st->B;
    const cuda_ctx::dev_span in[4] = {{st->x, B * m->I * sizeof(float)},
                                      {st->is_init, st->is_init ? B : 0},
                                      {st->slots, B * sizeof(int32_t)},
                                      {st->slots_new, B * sizeof(int32_t)}};
    for (const cuda_ctx::dev_span &i : in)
        for (const cuda_ctx::dev_span &w : c->step_wrote)
            if (spans_meet(i, w))
                return false;
    return true;
}

// Arguments of layer l. Its weights may be read before the wait above layer 0 (the kernel before
// it is layer l-1's) and where the stream's last work is a step (cuda_ctx.step_tail); layer 0's
// inputs too where that step wrote none of them.
static step_kargs step_args(struct cuda_ctx *c, const struct rnnd_step *st, const float *params,
                            const struct rnnd_model *m, int l) {
    const int H = m->H, L = m->L;
    step_kargs a = {};
    a.B = st->B, a.I = m->I, a.H = H, a.L = L, a.l = l;
    a.x = st->x, a.is_init = st->is_init, a.slots = st->slots, a.slots_new = st->slots_new;
    a.state_h = st->state_h, a.state_c = st->state_c;
    a.h_before = st->h_before, a.c_before = st->c_before;
    a.out = l == L - 1 ? st->out : NULL;
    a.pre = l > 0 || c->step_tail;
    a.early_x = l == 0 && c->step_tail && !c->tune.step_no_early_x && inputs_untouched(c, st, m);
    struct layer_params lp = rnnd__cuda_layer_params(m, l, params);
    a.w_ih = lp.w_ih, a.w_hh = lp.w_hh, a.b_ih = lp.b_ih, a.b_hh = lp.b_hh;
    a.vec_x = (l == 0 ? m->I % 4 == 0 && aligned16(a.x) : H % 4 == 0) && aligned16(st->state_h) &&
              aligned16(lp.w_ih);
    a.vec_h = H % 4 == 0 && aligned16(st->state_h) && aligned16(lp.w_hh) &&
              (st->state_c == NULL || aligned16(st->state_c));
    return a;
}

// wg: step_wg.cu's kernel (same tiles as cfg_big) for every layer whose arguments it takes.
template <class Cell, class Mode, class Cfg>
static int step_launch(struct cuda_ctx *c, const struct rnnd_step *st, const float *params,
                       const struct rnnd_model *m, bool wg) {
    const size_t smem = step_smem<Cfg, Cell::G>(Mode::PAD);
    const dim3 grid(CEIL_DIV(m->H, Cfg::UT), CEIL_DIV(st->B, Cfg::MT));
    for (int l = 0; l < m->L; l++) {
        step_kargs a = step_args(c, st, params, m, l);
#ifdef RNND_HAVE_WG
        if (wg && a.vec_x && a.vec_h) {
            RNND_TRY(rnnd__wg_step_launch(c, a, Cell::G == 4));
            continue;
        }
#endif
        RNND_TRY(step_kernel_launch(c, step_kernel<Cell, Mode, Cfg>, grid, dim3(Cfg::NT), smem,
                                    a.vec_x && a.vec_h, a));
    }
    return 0;
}

template <class Cell, class Mode, int R>
static int step_mv_launch(struct cuda_ctx *c, const struct rnnd_step *st, const float *params,
                          const struct rnnd_model *m) {
    constexpr bool BF16 = std::is_same<Mode, step_bf16>::value;
    const dim3 grid(CEIL_DIV(m->H, RNND_STEP_MV_UNITS), CEIL_DIV(st->B, R));
    for (int l = 0; l < m->L; l++) {
        step_kargs a = step_args(c, st, params, m, l);
        const size_t smem = step_mv_smem(Cell::G, R, rnnd_model_layer_input(m, l), m->H);
        RNND_TRY(step_kernel_launch(c, step_mv_kernel<Cell, BF16, Mode::FAST, R>, grid,
                                    dim3(32 * RNND_STEP_MV_UNITS), smem, a.vec_x && a.vec_h, a));
    }
    return 0;
}

// The one-row kernel reads everything through __ldcg: launched with PDL at any width. Its layers
// in one launch where they fit one (step_row_layers_kernel).
template <class Cell, class Mode>
static int step_row_launch(struct cuda_ctx *c, const struct rnnd_step *st, const float *params,
                           const struct rnnd_model *m) {
    constexpr bool BF16 = std::is_same<Mode, step_bf16>::value;
    const dim3 grid(CEIL_DIV(m->H, RNND_STEP_ROW_UNITS)), block(32 * RNND_STEP_ROW_UNITS);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    RNND_CUDA_TRY(cudaStreamIsCapturing(c->stream, &cs));
    if (m->L > 1 && m->L <= RNND_STEP_ROW_LAYERS && cs == cudaStreamCaptureStatusNone &&
        (int)grid.x <= RNND_STEP_ROW_RESIDENT * c->dev.num_sms && !c->tune.step_layers_apart) {
        step_row_layers s = {};
        for (int l = 0; l < m->L; l++)
            s.a[l] = step_args(c, st, params, m, l);
        s.bar = c->d_step_bar;
        return step_kernel_launch(c, step_row_layers_kernel<Cell, BF16, Mode::FAST>, grid, block, 0,
                                  true, s);
    }
    for (int l = 0; l < m->L; l++) {
        step_kargs a = step_args(c, st, params, m, l);
        RNND_TRY(step_kernel_launch(c, step_row_kernel<Cell, BF16, Mode::FAST>, grid, block, 0,
                                    true, a));
    }
    return 0;
}

// One row: dot products from registers. A few: dot products from shared memory (when the rows
// and weights fit). Many at a large H, given the derived copy: step16.cu's GEMM where it wins.
// More: in TF32 mode on a device with the warpgroup-MMA kernels (unless the bench's
// RNND_TUNE_NO_WG), the 64 x 32 tiles on warpgroup MMAs for every layer whose copies are
// all 16 bytes, wherever they make 16 blocks or each block streams at most 128 KB of weights
// (below that the smaller tiles, which spread the weights over more SMs, win: docs/kernels.md);
// else the tile shape that still gives half the SMs a block, largest first.
template <class Cell, class Mode>
static int step_dispatch(struct cuda_ctx *c, const struct rnnd_step *st, const float *params,
                         const struct rnnd_model *m) {
    if (st->B == 1)
        return step_row_launch<Cell, Mode>(c, st, params, m);
    const int in = m->I > m->H ? m->I : m->H;
    if (st->B <= RNND_STEP_MV_MAX_ROWS &&
        step_mv_smem(Cell::G, RNND_STEP_MV_ROWS, in, m->H) <= RNND_STEP_MV_SMEM)
        return step_mv_launch<Cell, Mode, RNND_STEP_MV_ROWS>(c, st, params, m);
    if (rnnd__cuda_step16_takes(c, st, m)) {
        step_kargs args[RNND_MAX_LAYERS];
        for (int l = 0; l < m->L; l++)
            args[l] = step_args(c, st, params, m, l);
        return rnnd__cuda_step16(c, st, args, m);
    }
    auto blocks = [&](int MT, int UT) { return (long)CEIL_DIV(st->B, MT) * CEIL_DIV(m->H, UT); };
    const bool wg = std::is_same<Mode, step_tf32>::value && c->dev.wg && !c->tune.no_wg;
    const long wg_wbytes = (long)Cell::G * cfg_big::UT * (in + m->H) * sizeof(float);
    const bool wg_wins = wg && m->I % 4 == 0 && m->H % 4 == 0 &&
                         (blocks(cfg_big::MT, cfg_big::UT) >= 16 || wg_wbytes <= (128 << 10));
    if (wg_wins || blocks(cfg_big::MT, cfg_big::UT) >= c->dev.num_sms / 2)
        return step_launch<Cell, Mode, cfg_big>(c, st, params, m, wg);
    if (blocks(cfg_mid::MT, cfg_mid::UT) >= c->dev.num_sms / 2)
        return step_launch<Cell, Mode, cfg_mid>(c, st, params, m, false);
    return step_launch<Cell, Mode, cfg_small>(c, st, params, m, false);
}

int rnnd__cuda_rnn_step(struct cuda_ctx *c, const struct rnnd_step *step, const float *params,
                        const struct rnnd_model *m) {
    if (c == NULL || rnnd_step_check(step, m) != 0 || params == NULL)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    int err;
    switch (m->compute) {
        case RNND_COMPUTE_BF16:
            err = lstm ? step_dispatch<cell_lstm, step_bf16>(c, step, params, m)
                       : step_dispatch<cell_gru, step_bf16>(c, step, params, m);
            break;
        case RNND_COMPUTE_IEEE:
            err = lstm ? step_dispatch<cell_lstm, step_ieee>(c, step, params, m)
                       : step_dispatch<cell_gru, step_ieee>(c, step, params, m);
            break;
        default:
            err = lstm ? step_dispatch<cell_lstm, step_tf32>(c, step, params, m)
                       : step_dispatch<cell_gru, step_tf32>(c, step, params, m);
    }
    c->step_tail = err == 0;
    if (err == 0) {
        const size_t blh = (size_t)step->B * m->L * m->H * sizeof(float);
        c->step_wrote[0] = {step->out, (size_t)step->B * m->H * sizeof(float)};
        c->step_wrote[1] = {step->h_before, step->h_before ? blh : 0};
        c->step_wrote[2] = {step->c_before, step->c_before ? blh : 0};
    }
    return err;
}

// Raises the dynamic shared-memory limit of every instance to what it may ask for.
template <class Cell, class Mode, class Cfg>
static int step_attr() {
    RNND_CUDA_TRY(cudaFuncSetAttribute(step_kernel<Cell, Mode, Cfg>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)step_smem<Cfg, Cell::G>(Mode::PAD)));
    return 0;
}
template <class Cell, class Mode>
static int step_attr_kernels() {
    RNND_TRY((step_attr<Cell, Mode, cfg_big>()));
    RNND_TRY((step_attr<Cell, Mode, cfg_mid>()));
    RNND_TRY((step_attr<Cell, Mode, cfg_small>()));
    constexpr bool BF16 = std::is_same<Mode, step_bf16>::value;
    RNND_CUDA_TRY(cudaFuncSetAttribute(step_mv_kernel<Cell, BF16, Mode::FAST, RNND_STEP_MV_ROWS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       RNND_STEP_MV_SMEM));
    return 0;
}
template <class Cell>
static int step_attr_modes() {
    RNND_TRY((step_attr_kernels<Cell, step_tf32>()));
    RNND_TRY((step_attr_kernels<Cell, step_bf16>()));
    return step_attr_kernels<Cell, step_ieee>();
}

int rnnd__cuda_step_prepare(struct cuda_ctx *c) {
    // Once per context, so that rnn_step itself only launches (safe inside graph capture).
    RNND_TRY(step_attr_modes<cell_gru>());
    RNND_TRY(step_attr_modes<cell_lstm>());
#ifdef RNND_HAVE_WG
    if (c->dev.cc_major == 9)
        RNND_TRY(rnnd__wg_step_prepare());
#endif
    return 0;
}
