/*
 * seq_persist.cuh: the persistent, reset-aware time loops of the sequence forward and backward
 * (one launch per layer), templated over the cell (GRU r,z,n / LSTM i,f,g,o), the matmul mode
 * (TF32 m16n8k8 or BF16 m16n8k16 tensor-core MMA, fp32 accumulation) and HP, the hidden width
 * rounded up to a multiple of 32 (units past H are zero weights and zero state, so they stay 0).
 *
 * Parallel mapping (both directions). A block owns 16 batch rows for all T steps; rows are
 * independent, so blocks never talk to each other. It has HP/16 warps; warp w owns hidden units
 * [16w, 16w+16) for every gate, and lane (g = lane/4, tg = lane%4) owns rows {g, g+8} and the four
 * consecutive units u0 = 16w + 4tg .. u0+3: eight (row, unit) elements whose gates, state and
 * gradients live in its registers for the whole loop. The column order of each warp's n-tiles is
 * permuted so that an MMA accumulator fragment lands exactly on those elements (the C fragment
 * of n-tile `half` holds columns 2tg, 2tg+1, which we map to units u0 + 2*half + {0,1}), so the
 * cell math needs no shared-memory round trip and global accesses are 16-byte vectors.
 *
 * Forward, per step (one __syncthreads, h double-buffered in shared memory):
 *   acc (16 x G*16 per warp) = h_tile (16 x HP) . W_hh[warp's gate rows]^T   (MMA, W on chip)
 *   gates from acc + b_hh and the precomputed x W_ih^T + b_ih; h' (c'); stores of y, tape;
 *   the state of the next step, after the reset rule (a per-row select), into the other tile.
 * Backward, per step in reverse (two __syncthreads):
 *   gate gradients from the tape (stored activated gates) and dL/dh' -> D (global, for the
 *   weight and input GEMMs) and the dh-gate tile (16 x G*HP) in shared memory;
 *   dh (16 x 16 per warp) = tile . W_hh[:, warp's units]   (MMA) + the direct term; routing of
 *   the gradient at resets (DESIGN.md §2) and at t = 0.
 * W_hh is loaded once per launch, pre-arranged as per-lane MMA fragments: the first KREG k-steps
 * in registers, the rest in shared memory (LSTM H=128 in TF32 needs both: 256 KB).
 *
 * Bench versions: v1 (this file), see kernels/bench/NOTES.md.
 */
#ifndef RNND_CUDA_SEQ_PERSIST_CUH
#define RNND_CUDA_SEQ_PERSIST_CUH

#include "common.cuh"
#include "seq_persist.h"

// Shared memory a block may use on sm_90 (227 KB); sm_80 gets less and falls back at run time.
#define RNND_PERSIST_SMEM_BUDGET 232448

// ---------------------------------------------------------------------------------------------
// Matmul modes: fragment building, A-tile element type, the MMA itself.

struct mode_tf32 {
    static constexpr int KSTEP = 8;
    static constexpr int APAD = 4; // floats of padding per A-tile row: conflict-free fragments
    using elem = float;            // tf32 values kept in fp32 bit patterns
    static __device__ __forceinline__ void put(elem *p, float v) {
        *p = __uint_as_float(f32_to_tf32(v));
    }
    static __device__ __forceinline__ void put4(elem *p, const float v[4]) {
        *reinterpret_cast<float4 *>(p) =
            make_float4(__uint_as_float(f32_to_tf32(v[0])), __uint_as_float(f32_to_tf32(v[1])),
                        __uint_as_float(f32_to_tf32(v[2])), __uint_as_float(f32_to_tf32(v[3])));
    }
    // B fragment of k-step ks for lane (g, tg): b0 = B[8ks+tg][g], b1 = B[8ks+tg+4][g].
    template <class F>
    static __device__ __forceinline__ uint2 bfrag(F B, int ks, int g, int tg) {
        int k = ks * 8 + tg;
        return make_uint2(f32_to_tf32(B(k, g)), f32_to_tf32(B(k + 4, g)));
    }
    // A fragment: a0 = A[g][8ks+tg], a1 = A[g+8][..], a2 = A[g][8ks+tg+4], a3 = A[g+8][..+4].
    static __device__ __forceinline__ void afrag(uint32_t a[4], const elem *tile, int ld, int ks,
                                                 int g, int tg) {
        const elem *p = tile + g * ld + ks * 8 + tg;
        a[0] = __float_as_uint(p[0]);
        a[1] = __float_as_uint(p[8 * ld]);
        a[2] = __float_as_uint(p[4]);
        a[3] = __float_as_uint(p[8 * ld + 4]);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint2 b) {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
    }
};

struct mode_bf16 {
    static constexpr int KSTEP = 16;
    static constexpr int APAD = 8;
    using elem = __nv_bfloat16;
    static __device__ __forceinline__ void put(elem *p, float v) {
        *p = __float2bfloat16_rn(v);
    }
    static __device__ __forceinline__ void put4(elem *p, const float v[4]) {
        *reinterpret_cast<uint2 *>(p) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
    }
    // b0 = {B[16ks+2tg][g], B[16ks+2tg+1][g]}, b1 = the same 8 rows further (low half first).
    template <class F>
    static __device__ __forceinline__ uint2 bfrag(F B, int ks, int g, int tg) {
        int k = ks * 16 + 2 * tg;
        return make_uint2(pack_bf16(B(k, g), B(k + 1, g)), pack_bf16(B(k + 8, g), B(k + 9, g)));
    }
    static __device__ __forceinline__ void afrag(uint32_t a[4], const elem *tile, int ld, int ks,
                                                 int g, int tg) {
        const elem *p = tile + g * ld + ks * 16 + 2 * tg;
        a[0] = *reinterpret_cast<const uint32_t *>(p);
        a[1] = *reinterpret_cast<const uint32_t *>(p + 8 * ld);
        a[2] = *reinterpret_cast<const uint32_t *>(p + 8);
        a[3] = *reinterpret_cast<const uint32_t *>(p + 8 * ld + 8);
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint2 b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
    }
};

// ---------------------------------------------------------------------------------------------
// Cells: pointwise math for one (row, unit) element, the same formulas and association as the
// CPU reference (kernels/cpu/gru.c, lstm.c). s[] is the element's tape record (SW planes).

struct cell_gru {
    static constexpr int G = 3;
    static constexpr int SW = 4; // r, z, n, hn
    // xq[q] = x W_ih^T + b_ih, hq[q] = h W_hh^T + b_hh for gate q.
    template <bool FAST>
    static __device__ __forceinline__ void forward(const float xq[3], const float hq[3], float h,
                                                   float c, float &h_new, float &c_new,
                                                   float s[SW]) {
        (void)c;
        float r = act_sigmoid<FAST>(xq[0] + hq[0]);
        float z = act_sigmoid<FAST>(xq[1] + hq[1]);
        float n = act_tanh<FAST>(xq[2] + r * hq[2]);
        h_new = (1.0f - z) * n + z * h;
        c_new = 0.0f;
        s[0] = r, s[1] = z, s[2] = n, s[3] = hq[2];
    }
    // dh' = dy + dh_carry. Out: d[4] (D row planes: da_r, da_z, da_n, da_n r), tile[3] (the
    // gradient of W_hh h + b_hh: da_r, da_z, da_n r), the direct dL/dh term and dL/dc (unused).
    template <bool FAST>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[3],
                                                    float &dh_direct, float &dc_prev) {
        (void)dc_in;
        float r = s[0], z = s[1], n = s[2], hn = s[3];
        float da_n = dhj * (1.0f - z) * (1.0f - n * n);
        float da_z = dhj * (hprev - n) * z * (1.0f - z);
        float da_r = da_n * hn * r * (1.0f - r);
        d[0] = da_r, d[1] = da_z, d[2] = da_n, d[3] = da_n * r;
        tile[0] = da_r, tile[1] = da_z, tile[2] = da_n * r;
        dh_direct = dhj * z;
        dc_prev = 0.0f;
    }
};

struct cell_lstm {
    static constexpr int G = 4;
    static constexpr int SW = 5; // i, f, g, o, cprev
    template <bool FAST>
    static __device__ __forceinline__ void forward(const float xq[4], const float hq[4], float h,
                                                   float c, float &h_new, float &c_new,
                                                   float s[SW]) {
        (void)h;
        float i = act_sigmoid<FAST>(xq[0] + hq[0]);
        float f = act_sigmoid<FAST>(xq[1] + hq[1]);
        float g = act_tanh<FAST>(xq[2] + hq[2]);
        float o = act_sigmoid<FAST>(xq[3] + hq[3]);
        c_new = f * c + i * g;
        h_new = o * act_tanh<FAST>(c_new);
        s[0] = i, s[1] = f, s[2] = g, s[3] = o, s[4] = c;
    }
    template <bool FAST>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[4],
                                                    float &dh_direct, float &dc_prev) {
        (void)hprev;
        float i = s[0], f = s[1], g = s[2], o = s[3], c = s[4];
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

// ---------------------------------------------------------------------------------------------
// Geometry: warps, k-steps, how much of W_hh stays in registers, shared memory.

// Fewest k-steps to keep in registers so that the rest of W plus `other` bytes fit the budget.
constexpr int persist_kreg(int ks, long ks_bytes, long other) {
    int k = 0;
    while (k < ks && (long)(ks - k) * ks_bytes + other > RNND_PERSIST_SMEM_BUDGET)
        k++;
    return k;
}

template <class Cell, class Mode, int HP>
struct persist_geom {
    static constexpr int G = Cell::G;
    static constexpr int NW = HP / 16;
    static constexpr int THREADS = NW * 32;
    using elem = typename Mode::elem;
    // Forward: K = HP (h), N = 2G n-tiles a warp (its 16 units of each gate).
    static constexpr int F_NT = 2 * G;
    static constexpr int F_KS = HP / Mode::KSTEP;
    static constexpr int F_LDA = HP + Mode::APAD;
    static constexpr long F_TILE_BYTES = 16L * F_LDA * (long)sizeof(elem);
    static constexpr long F_KS_BYTES = (long)F_NT * 32 * 8 * NW;
    static constexpr int F_KREG = persist_kreg(F_KS, F_KS_BYTES, 2 * F_TILE_BYTES);
    static constexpr long F_SMEM = (F_KS - F_KREG) * F_KS_BYTES + 2 * F_TILE_BYTES;
    // Backward: K = G*HP (gate rows), N = 2 n-tiles a warp (its 16 units).
    static constexpr int B_NT = 2;
    static constexpr int B_KS = G * HP / Mode::KSTEP;
    static constexpr int B_LDA = G * HP + Mode::APAD;
    static constexpr long B_TILE_BYTES = 16L * B_LDA * (long)sizeof(elem);
    static constexpr long B_KS_BYTES = (long)B_NT * 32 * 8 * NW;
    static constexpr int B_KREG = persist_kreg(B_KS, B_KS_BYTES, B_TILE_BYTES);
    static constexpr long B_SMEM = (B_KS - B_KREG) * B_KS_BYTES + B_TILE_BYTES;
    static constexpr int B_SPLIT = 4; // independent accumulator chains over k in backward
    static_assert(F_SMEM <= RNND_PERSIST_SMEM_BUDGET, "forward does not fit");
    static_assert(B_SMEM <= RNND_PERSIST_SMEM_BUDGET, "backward does not fit");
};

// ---------------------------------------------------------------------------------------------
// Element access: four consecutive units u0..u0+3 of one row (16-byte vectors when vec).

static __device__ __forceinline__ void ld4(float v[4], const float *p, int u0, int H, bool vec) {
    if (vec) {
        if (u0 < H) {
            float4 q = __ldg(reinterpret_cast<const float4 *>(p + u0));
            v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
        } else {
            v[0] = v[1] = v[2] = v[3] = 0.0f;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            v[j] = u0 + j < H ? __ldg(p + u0 + j) : 0.0f;
    }
}

static __device__ __forceinline__ void st4(float *p, const float v[4], int u0, int H, bool vec) {
    if (vec) {
        if (u0 < H)
            *reinterpret_cast<float4 *>(p + u0) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (u0 + j < H)
                p[u0 + j] = v[j];
    }
}

static __device__ __forceinline__ void zero4(float v[4]) {
    v[0] = v[1] = v[2] = v[3] = 0.0f;
}

// Unit of column n of a warp's n-tile `half` (the permutation in the header comment).
static __device__ __forceinline__ int persist_unit(int w, int half, int n) {
    return w * 16 + 4 * (n >> 1) + 2 * half + (n & 1);
}

// ---------------------------------------------------------------------------------------------
// Forward kernel

// V (bench variants, tried at H=128 TF32 before one becomes the default): bit 0 splits each
// accumulator's k chain in two (more independent MMAs in flight); bit 1 loads the next step's
// x W_ih^T at the top of the step into a second register set (a whole step of latency cover).
template <class Cell, class Mode, int HP, int V = 0>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_forward_kernel(const struct persist_fwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using E = typename Mode::elem;
    constexpr int G = Gm::G, NT = Gm::F_NT, KS = Gm::F_KS, KREG = Gm::F_KREG, NW = Gm::NW;
    constexpr int LDA = Gm::F_LDA, SW = Cell::SW;
    constexpr int FSPLIT = (V & 1) ? 2 : 1;
    constexpr bool EARLY = (V & 2) != 0;

    extern __shared__ __align__(16) unsigned char smem[];
    uint2 *wsm = reinterpret_cast<uint2 *>(smem);
    E *tiles = reinterpret_cast<E *>(smem + (KS - KREG) * Gm::F_KS_BYTES);

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l;
    const int u0 = w * 16 + 4 * tg;
    const bool vec = a.vec;

    // W_hh as B fragments: B[k][n] = W_hh[q*H + unit(n)][k], q the gate of n-tile nt = 2q+half.
    auto wfrag = [&](int ks, int nt) -> uint2 {
        const int q = nt >> 1, half = nt & 1;
        auto Bf = [&](int k, int n) -> float {
            int unit = persist_unit(w, half, n);
            return unit < H && k < H ? __ldg(a.w_hh + (size_t)(q * H + unit) * H + k) : 0.0f;
        };
        return Mode::bfrag(Bf, ks, g, tg);
    };
    uint2 wreg[KREG > 0 ? KREG : 1][NT];
#pragma unroll
    for (int ks = 0; ks < KREG; ks++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            wreg[ks][nt] = wfrag(ks, nt);
#pragma unroll 1
    for (int ks = KREG; ks < KS; ks++)
#pragma unroll 1
        for (int nt = 0; nt < NT; nt++)
            wsm[(((ks - KREG) * NW + w) * NT + nt) * 32 + lane] = wfrag(ks, nt);

    // Biases of this thread's elements.
    float bi[G][4], bh[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        ld4(bi[q], a.b_ih + q * H, u0, H, false);
        ld4(bh[q], a.b_hh + q * H, u0, H, false);
    }

    int brow[2];
    bool rv[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        brow[i] = blockIdx.x * 16 + g + 8 * i;
        rv[i] = brow[i] < a.B;
    }

    // The state entering step 0 (reset rule): hidden[b, 0] when stored states are given, else
    // zero where is_init[b, 0], else h0 (c0) or zero.
    float h[2][4], c[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(h[i]);
        zero4(c[i]);
        if (!rv[i])
            continue;
        size_t b = brow[i];
        const float *hs = nullptr, *cs = nullptr;
        if (a.hidden) {
            hs = a.hidden + ((b * T) * L + l) * H;
            cs = a.cell ? a.cell + ((b * T) * L + l) * H : nullptr;
        } else if (!a.is_init[b * T] && a.h0) {
            hs = a.h0 + (b * L + l) * H;
            cs = a.c0 ? a.c0 + (b * L + l) * H : nullptr;
        }
        if (hs)
            ld4(h[i], hs, u0, H, vec);
        if (cs)
            ld4(c[i], cs, u0, H, vec);
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
        Mode::put4(tiles + (g + 8 * i) * LDA + u0, h[i]);

    // x W_ih^T of step 0, and the reset flags and stored values of step 1.
    float xg[2][G][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int q = 0; q < G; q++) {
            zero4(xg[i][q]);
            if (rv[i])
                ld4(xg[i][q], a.xg + ((size_t)brow[i] * T) * (G * H) + q * H, u0, H, vec);
        }
    bool nreset[2] = {false, false};
    float nh[2][4], nc[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(nh[i]);
        zero4(nc[i]);
        if (rv[i] && T > 1) {
            size_t r = (size_t)brow[i] * T + 1;
            nreset[i] = a.is_init[r] != 0;
            if (a.hidden) {
                ld4(nh[i], a.hidden + (r * L + l) * H, u0, H, vec);
                if (a.cell)
                    ld4(nc[i], a.cell + (r * L + l) * H, u0, H, vec);
            }
        }
    }
    __syncthreads();

    for (int t = 0; t < T; t++) {
        const E *cur = tiles + (t & 1) * (16 * LDA);
        E *nxt = tiles + ((t + 1) & 1) * (16 * LDA);

        float xgn[EARLY ? 2 : 1][G][4];
        if constexpr (EARLY) {
            if (t + 1 < T) {
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int q = 0; q < G; q++)
                        if (rv[i])
                            ld4(xgn[i][q], a.xg + ((size_t)brow[i] * T + t + 1) * (G * H) + q * H,
                                u0, H, vec);
            }
        }

        // gh = h W_hh^T for the warp's 2G n-tiles.
        float acc[NT][4];
        float acc2[FSPLIT > 1 ? NT : 1][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            zero4(acc[nt]);
            if constexpr (FSPLIT > 1)
                zero4(acc2[nt]);
        }
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t af[4];
            Mode::afrag(af, cur, LDA, ks, g, tg);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint2 b = ks < KREG ? wreg[ks < KREG ? ks : 0][nt]
                                    : wsm[(((ks - KREG) * NW + w) * NT + nt) * 32 + lane];
                if (FSPLIT > 1 && (ks & 1))
                    Mode::mma(acc2[FSPLIT > 1 ? nt : 0], af, b);
                else
                    Mode::mma(acc[nt], af, b);
            }
        }
        if constexpr (FSPLIT > 1) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    acc[nt][k] += acc2[nt][k];
        }

        // The cell, element by element.
        float hn[2][4], cn[2][4], sv[SW][2][4];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float xq[G], hq[G], s[SW];
#pragma unroll
                for (int q = 0; q < G; q++) {
                    xq[q] = xg[i][q][j] + bi[q][j];
                    hq[q] = acc[2 * q + (j >> 1)][2 * i + (j & 1)] + bh[q][j];
                }
                Cell::template forward<true>(xq, hq, h[i][j], c[i][j], hn[i][j], cn[i][j], s);
#pragma unroll
                for (int p = 0; p < SW; p++)
                    sv[p][i][j] = s[p];
            }

        // Next step's x W_ih^T: in flight during the next MMA.
        if constexpr (EARLY) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int q = 0; q < G; q++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        xg[i][q][j] = xgn[i][q][j];
        } else if (t + 1 < T) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int q = 0; q < G; q++)
                    if (rv[i])
                        ld4(xg[i][q], a.xg + ((size_t)brow[i] * T + t + 1) * (G * H) + q * H, u0,
                            H, vec);
        }

        // Outputs and tape.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!rv[i])
                continue;
            size_t r = (size_t)brow[i] * T + t;
            st4(a.y + r * a.ldy, hn[i], u0, H, vec);
            if (a.z) {
                float *zr = a.z + r * a.ldz;
                st4(zr, h[i], u0, H, vec);
                if (u0 == 0) {
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
                    st4(a.s + r * (SW * H) + p * H, sv[p][i], u0, H, vec);
            }
        }

        if (t + 1 < T) {
            // The state entering step t+1: the reset value where is_init[b, t+1], else h'.
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    h[i][j] = nreset[i] ? nh[i][j] : hn[i][j];
                    c[i][j] = nreset[i] ? nc[i][j] : cn[i][j];
                }
#pragma unroll
            for (int i = 0; i < 2; i++)
                Mode::put4(nxt + (g + 8 * i) * LDA + u0, h[i]);
            if (t + 2 < T) {
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    if (!rv[i])
                        continue;
                    size_t r = (size_t)brow[i] * T + t + 2;
                    nreset[i] = a.is_init[r] != 0;
                    if (a.hidden) {
                        ld4(nh[i], a.hidden + (r * L + l) * H, u0, H, vec);
                        if (a.cell)
                            ld4(nc[i], a.cell + (r * L + l) * H, u0, H, vec);
                    }
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                if (!rv[i])
                    continue;
                size_t at = ((size_t)brow[i] * L + l) * H;
                if (a.h_n)
                    st4(a.h_n + at, hn[i], u0, H, vec);
                if (a.c_n)
                    st4(a.c_n + at, cn[i], u0, H, vec);
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// Backward kernel

template <class Cell, class Mode, int HP>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_backward_kernel(const struct persist_bwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using E = typename Mode::elem;
    constexpr int G = Gm::G, NT = Gm::B_NT, KS = Gm::B_KS, KREG = Gm::B_KREG, NW = Gm::NW;
    constexpr int LDA = Gm::B_LDA, SW = Cell::SW, SPLIT = Gm::B_SPLIT;
    constexpr bool LSTM = G == 4;

    extern __shared__ __align__(16) unsigned char smem[];
    uint2 *wsm = reinterpret_cast<uint2 *>(smem);
    E *tile = reinterpret_cast<E *>(smem + (KS - KREG) * Gm::B_KS_BYTES);

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l;
    const int u0 = w * 16 + 4 * tg;
    const bool vec = a.vec;

    // W_hh as B fragments: B[k][n] = W_hh[q*H + uu][unit(n)] for k = q*HP + uu.
    auto wfrag = [&](int ks, int nt) -> uint2 {
        auto Bf = [&](int k, int n) -> float {
            int unit = persist_unit(w, nt, n);
            int q = k / HP, uu = k - q * HP;
            return unit < H && uu < H ? __ldg(a.w_hh + (size_t)(q * H + uu) * H + unit) : 0.0f;
        };
        return Mode::bfrag(Bf, ks, g, tg);
    };
    uint2 wreg[KREG > 0 ? KREG : 1][NT];
#pragma unroll
    for (int ks = 0; ks < KREG; ks++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            wreg[ks][nt] = wfrag(ks, nt);
#pragma unroll 1
    for (int ks = KREG; ks < KS; ks++)
#pragma unroll 1
        for (int nt = 0; nt < NT; nt++)
            wsm[(((ks - KREG) * NW + w) * NT + nt) * 32 + lane] = wfrag(ks, nt);

    int brow[2];
    bool rv[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        brow[i] = blockIdx.x * 16 + g + 8 * i;
        rv[i] = brow[i] < a.B;
    }

    // Carried gradients: dL/dh' (and dL/dc') of the state leaving step t.
    float dh[2][4], dc[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        zero4(dh[i]);
        zero4(dc[i]);
        if (!rv[i])
            continue;
        size_t at = ((size_t)brow[i] * L + l) * H;
        if (a.gh_n)
            ld4(dh[i], a.gh_n + at, u0, H, vec);
        if (a.gc_n)
            ld4(dc[i], a.gc_n + at, u0, H, vec);
    }

    // Step T-1's tape record, output gradient, h entering the step and reset flag.
    float sv[SW][2][4], gy[2][4], hp[2][4];
    bool reset[2] = {false, false};
    auto load_step = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!rv[i])
                continue;
            size_t r = (size_t)brow[i] * T + t;
#pragma unroll
            for (int p = 0; p < SW; p++)
                ld4(sv[p][i], a.s + r * (SW * H) + p * H, u0, H, vec);
            ld4(gy[i], a.gy + r * a.ldgy, u0, H, vec);
            if (!LSTM)
                ld4(hp[i], a.z + r * a.ldz, u0, H, vec);
            reset[i] = a.is_init[r] != 0;
        }
    };
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int p = 0; p < SW; p++)
            zero4(sv[p][i]);
        zero4(gy[i]);
        zero4(hp[i]);
    }
    load_step(T - 1);

    for (int t = T - 1; t >= 0; t--) {
        // Gate gradients of step t.
        float ddir[2][4], dcp[2][4], tv[G][2][4], dv[4][2][4];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float s[SW], d[4], tl[G];
#pragma unroll
                for (int p = 0; p < SW; p++)
                    s[p] = sv[p][i][j];
                float dhj = gy[i][j] + dh[i][j];
                Cell::template backward<true>(s, hp[i][j], dhj, dc[i][j], d, tl, ddir[i][j], dcp[i][j]);
                // Units past H and rows past B must feed zeros into the MMA.
                bool live = rv[i] && u0 + j < H;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    dv[p][i][j] = d[p];
#pragma unroll
                for (int q = 0; q < G; q++)
                    tv[q][i][j] = live ? tl[q] : 0.0f;
            }
        bool rst[2] = {reset[0], reset[1]};

#pragma unroll
        for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int q = 0; q < G; q++)
                Mode::put4(tile + (g + 8 * i) * LDA + q * HP + u0, tv[q][i]);
            if (!rv[i])
                continue;
            size_t r = (size_t)brow[i] * T + t;
#pragma unroll
            for (int p = 0; p < 4; p++)
                st4(a.d + r * (4 * H) + p * H, dv[p][i], u0, H, vec);
        }
        if (t > 0)
            load_step(t - 1); // in flight during the MMA
        __syncthreads();

        // dL/dh of the state entering step t: tile . W_hh (+ the direct term).
        float acc[SPLIT][NT][4];
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                zero4(acc[sp][nt]);
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t af[4];
            Mode::afrag(af, tile, LDA, ks, g, tg);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint2 b = ks < KREG ? wreg[ks < KREG ? ks : 0][nt]
                                    : wsm[(((ks - KREG) * NW + w) * NT + nt) * 32 + lane];
                Mode::mma(acc[ks % SPLIT][nt], af, b);
            }
        }

        // Route it (DESIGN.md §2): carried to step t-1, or into the gradient of the value the
        // state was reset to (stored states, or h0 at t = 0), or dropped (a zero reset).
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float dhp[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float s = ddir[i][j];
#pragma unroll
                for (int sp = 0; sp < SPLIT; sp++)
                    s += acc[sp][j >> 1][2 * i + (j & 1)];
                dhp[j] = s;
            }
            if (!rv[i])
                continue;
            bool carry = t > 0 && !rst[i];
            if (carry) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    dh[i][j] = dhp[j];
                    dc[i][j] = dcp[i][j];
                }
                continue;
            }
            size_t b = brow[i];
            if (a.stored) {
                size_t at = ((b * T + t) * L + l) * H;
                if (a.g_hidden)
                    st4(a.g_hidden + at, dhp, u0, H, vec);
                if (a.g_cell)
                    st4(a.g_cell + at, dcp[i], u0, H, vec);
            } else if (!rst[i]) { // t == 0: the initial state
                size_t at = (b * L + l) * H;
                if (a.g_h0)
                    st4(a.g_h0 + at, dhp, u0, H, vec);
                if (a.g_c0)
                    st4(a.g_c0 + at, dcp[i], u0, H, vec);
            }
            zero4(dh[i]);
            zero4(dc[i]);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// Launchers, one per (cell, mode, HP): raise the shared-memory limit, launch, check.

template <class Cell, class Mode, int HP, int V = 0>
static int persist_launch_forward(const struct persist_fwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    RNND_CUDA_TRY(cudaFuncSetAttribute(seq_forward_kernel<Cell, Mode, HP, V>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)Gm::F_SMEM));
    seq_forward_kernel<Cell, Mode, HP, V>
        <<<CEIL_DIV(a.B, 16), Gm::THREADS, Gm::F_SMEM, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <class Cell, class Mode, int HP>
static int persist_launch_backward(const struct persist_bwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    RNND_CUDA_TRY(cudaFuncSetAttribute(seq_backward_kernel<Cell, Mode, HP>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)Gm::B_SMEM));
    seq_backward_kernel<Cell, Mode, HP>
        <<<CEIL_DIV(a.B, 16), Gm::THREADS, Gm::B_SMEM, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <class Cell, class Mode, int HP>
static long persist_smem(bool backward) {
    using Gm = persist_geom<Cell, Mode, HP>;
    return backward ? Gm::B_SMEM : Gm::F_SMEM;
}

#endif // RNND_CUDA_SEQ_PERSIST_CUH
