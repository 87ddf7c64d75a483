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
 * in registers, the rest in shared memory (LSTM H=128 in TF32 needs both: 256 KB). A fragments
 * come from the shared tile with ldmatrix; on sm_90 in TF32 mode the backward's D planes are
 * written from the dh-gate tile by the bulk-copy engine.
 *
 * Bench versions v1..v5 (this file is v5, with the variants still under trial behind template
 * bits): kernels/bench/NOTES.md has each version's prediction and measured result.
 */
#ifndef RNND_CUDA_SEQ_PERSIST_CUH
#define RNND_CUDA_SEQ_PERSIST_CUH

#include "common.cuh"
#include "seq_persist.h"

// Shared memory a block may use on sm_90 (227 KB); sm_80 gets less and falls back at run time.
#define RNND_PERSIST_SMEM_BUDGET 232448

// ---------------------------------------------------------------------------------------------
// Matmul modes: fragment building, A-tile element type, the MMA itself.

// The A fragment of one k-step with one ldmatrix.x4: four 8x8 matrices of 16-bit pairs, i.e.
// rows 0-7 and 8-15 of the 16-row tile, at columns k0 and k0 + half (half = 4 floats for tf32,
// 8 bf16): exactly a0..a3 of m16n8k8.tf32 and m16n8k16.bf16. Lane L gives the address of row
// L%8 of matrix L/8. Rows are 16-byte aligned (the tile's row pitch is a multiple of 16 bytes).
template <class T>
static __device__ __forceinline__ void ldmatrix_x4(uint32_t a[4], const T *tile, int ld, int k0,
                                                   int half, int lane) {
    int m = lane >> 3, row = (lane & 7) + 8 * (m & 1), col = k0 + (m >> 1) * half;
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(tile + row * ld + col);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}

// Hopper bulk copies (the TMA engine) from shared to global memory: issue, commit, wait until
// the engine has read the source (so it may be overwritten), wait for completion. Shared memory
// written by ordinary stores needs fence_proxy_async() in the writing threads before the
// barrier that precedes the copy. sm_80 builds never take these paths (checked at launch).
static __device__ __forceinline__ void bulk_s2g(void *gdst, const void *ssrc, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t s = (uint32_t)__cvta_generic_to_shared(ssrc);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst),
                 "r"(s), "r"(bytes)
                 : "memory");
#else
    __trap();
#endif
}
static __device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}
static __device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}
static __device__ __forceinline__ void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}
static __device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

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
                                                 int lane) {
        ldmatrix_x4(a, tile, ld, ks * 8, 4, lane);
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
    // a0 = A[g][16ks+2tg, +1], a1 = rows + 8, a2 = columns + 8, a3 = both.
    static __device__ __forceinline__ void afrag(uint32_t a[4], const elem *tile, int ld, int ks,
                                                 int lane) {
        ldmatrix_x4(a, tile, ld, ks * 16, 8, lane);
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
    // dh' = dy + dh_carry. Out: d[4] (D row planes: da_r, da_z, da_n r, da_n: the hidden side's
    // three first, so they equal the tile and are contiguous), tile[3] (the gradient of
    // W_hh h + b_hh: da_r, da_z, da_n r), the direct dL/dh term and dL/dc (unused).
    template <bool FAST>
    static __device__ __forceinline__ void backward(const float s[SW], float hprev, float dhj,
                                                    float dc_in, float d[4], float tile[3],
                                                    float &dh_direct, float &dc_prev) {
        (void)dc_in;
        float r = s[0], z = s[1], n = s[2], hn = s[3];
        float da_n = dhj * (1.0f - z) * (1.0f - n * n);
        float da_z = dhj * (hprev - n) * z * (1.0f - z);
        float da_r = da_n * hn * r * (1.0f - r);
        d[0] = da_r, d[1] = da_z, d[2] = da_n * r, d[3] = da_n;
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
    // GRU forward staging for bulk stores (fp32): S records, y and z rows of the step. Row
    // strides are 16 floats past a multiple of 32 (conflict-free 16-byte stores from 2 rows).
    // Off: measured slower (kernels/bench/NOTES.md v5): the issuing warp blocks on the copy
    // engine under write back-pressure, and one stage leaves nothing to overlap.
    static constexpr bool F_STAGE = false;
    static constexpr int S_STR = (Cell::SW * HP + 31) / 32 * 32 + 16;
    static constexpr int Y_STR = (HP + 31) / 32 * 32 + 16;
    static constexpr int Z_MAX = HP + 4 + HP / 2; // [hprev | 1 | pad | x (I <= HP/2)]
    static constexpr int Z_STR = (Z_MAX + 15) / 32 * 32 + 16 >= Z_MAX ? (Z_MAX + 15) / 32 * 32 + 16
                                                                    : (Z_MAX + 31) / 32 * 32 + 16;
    static constexpr long F_STAGE_BYTES = F_STAGE ? 16L * (S_STR + Y_STR + Z_STR) * 4 : 0;
    static constexpr int F_KREG = persist_kreg(F_KS, F_KS_BYTES, 2 * F_TILE_BYTES + F_STAGE_BYTES);
    static constexpr long F_SMEM = (F_KS - F_KREG) * F_KS_BYTES + 2 * F_TILE_BYTES + F_STAGE_BYTES;
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
// Element access: four consecutive units u0..u0+3 of one row, p already offset by u0. VEC (H a
// multiple of 4, 16-byte aligned rows) makes each a single 16-byte access; ok says the row exists.

template <bool VEC>
static __device__ __forceinline__ void ld4(float v[4], const float *p, int u0, int H, bool ok) {
    if (VEC) {
        float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ok && u0 < H)
            q = __ldg(reinterpret_cast<const float4 *>(p));
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            v[j] = ok && u0 + j < H ? __ldg(p + j) : 0.0f;
    }
}

template <bool VEC>
static __device__ __forceinline__ void st4(float *p, const float v[4], int u0, int H, bool ok) {
    if (VEC) {
        if (ok && u0 < H)
            *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (ok && u0 + j < H)
                p[j] = v[j];
    }
}

static __device__ __forceinline__ void zero4(float v[4]) {
    v[0] = v[1] = v[2] = v[3] = 0.0f;
}

// A reset flag, kept as a plain int until it is used: a bool would be normalised (compared)
// right after the load, and the warp would wait for the load there.
static __device__ __forceinline__ int ld_flag(const uint8_t *p, bool ok) {
    return ok ? (int)__ldg(p) : 0;
}

// Unit of column n of a warp's n-tile `half` (the permutation in the header comment).
static __device__ __forceinline__ int persist_unit(int w, int half, int n) {
    return w * 16 + 4 * (n >> 1) + 2 * half + (n & 1);
}

// ---------------------------------------------------------------------------------------------
// Forward kernel

// V (bench variants, tried at H=128 TF32 before one becomes the default; kernels/bench/NOTES.md):
// bit 0 splits each accumulator's k chain in two (forward) or software-pipelines the fragment
// loads (backward); bit 1 loads the next step's x W_ih^T at the top of the step into a second
// register set; bit 2 defers the step's global stores to the top of the next step (they drain
// during its MMA); bit 3 records per-phase clocks of warp 0 into a.dbg; bit 4 starts odd blocks
// half a step late, so that blocks' memory bursts interleave.
template <int V>
struct persist_clock {
    long long t = 0, sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    __device__ __forceinline__ void start() {
        if (V & 8)
            t = clock64();
    }
    __device__ __forceinline__ void mark(int k) {
        if (V & 8) {
            long long n = clock64();
            sum[k] += n - t;
            t = n;
        }
    }
    __device__ __forceinline__ void flush(long long *dbg) {
        if ((V & 8) && dbg && threadIdx.x == 0 && blockIdx.x < 1024)
            for (int k = 0; k < 8; k++)
                dbg[blockIdx.x * 8 + k] = sum[k];
    }
};

// Makes warp 0 wait for v (so that a phase clock includes the latency that produced it).
static __device__ __forceinline__ void persist_wait_for(float v, long long *dbg) {
    if (__float_as_uint(v) == 0x7fc0dead && dbg)
        dbg[0] = 0;
}

static __device__ __forceinline__ void persist_stagger() {
    if (blockIdx.x & 1)
        for (int k = 0; k < 2; k++)
            __nanosleep(1000);
}

// TMA (GRU, sm_90, vector access): the step's y, z and s rows are staged in shared memory and
// written by the bulk-copy engine at the top of the next step, so the warps never stall on
// store back-pressure.
template <class Cell, class Mode, int HP, bool VEC, int V = 0, bool TMA = false>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_forward_kernel(const struct persist_fwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using E = typename Mode::elem;
    constexpr int G = Gm::G, NT = Gm::F_NT, KS = Gm::F_KS, KREG = Gm::F_KREG, NW = Gm::NW;
    constexpr int LDA = Gm::F_LDA, SW = Cell::SW;
    constexpr int FSPLIT = (V & 1) ? 2 : 1;
    constexpr bool EARLY = (V & 2) != 0;
    constexpr bool DEFER = (V & 4) != 0;

    extern __shared__ __align__(16) unsigned char smem[];
    uint4 *wsm = reinterpret_cast<uint4 *>(smem); // two n-tiles' B fragments per 16 bytes
    E *tiles = reinterpret_cast<E *>(smem + (KS - KREG) * Gm::F_KS_BYTES);
    float *stage_s = reinterpret_cast<float *>(smem + (KS - KREG) * Gm::F_KS_BYTES +
                                               2 * Gm::F_TILE_BYTES);
    float *stage_y = stage_s + 16 * Gm::S_STR;
    float *stage_z = stage_y + 16 * Gm::Y_STR;
    static_assert(!TMA || Gm::F_STAGE, "staging is laid out for the GRU only (and off)");

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l, GH = G * H;
    // Bulk copies of the staged row threadIdx.x (< 16) of step ts to y, z and s.
    const int zcopy = a.x ? a.ldz : a.xoff; // floats of a z row the stage owns
    auto bulk_step = [&](int ts) {
        if (TMA && threadIdx.x < 16 && blockIdx.x * 16 + threadIdx.x < a.B) {
            size_t r = (size_t)(blockIdx.x * 16 + threadIdx.x) * T + ts;
            bulk_s2g(a.y + r * a.ldy, stage_y + threadIdx.x * Gm::Y_STR, H * sizeof(float));
            if (a.z)
                bulk_s2g(a.z + r * a.ldz, stage_z + threadIdx.x * Gm::Z_STR,
                         zcopy * sizeof(float));
            if (a.s)
                bulk_s2g(a.s + r * (SW * H), stage_s + threadIdx.x * Gm::S_STR,
                         SW * H * sizeof(float));
            bulk_commit();
        }
    };
    const int u0 = w * 16 + 4 * tg;

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
        for (int np = 0; np < NT / 2; np++) {
            uint2 f0 = wfrag(ks, 2 * np), f1 = wfrag(ks, 2 * np + 1);
            wsm[(((ks - KREG) * NW + w) * (NT / 2) + np) * 32 + lane] =
                make_uint4(f0.x, f0.y, f1.x, f1.y);
        }

    // Biases of this thread's elements.
    float bi[G][4], bh[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        ld4<false>(bi[q], a.b_ih + q * H + u0, u0, H, true);
        ld4<false>(bh[q], a.b_hh + q * H + u0, u0, H, true);
    }

    // Per-row base pointers at step 0 (rows past B point at row 0 and are never accessed).
    bool rv[2];
    size_t rbase[2];
    const float *xgp[2];
    float *yp[2];
    const uint8_t *initp[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int b = blockIdx.x * 16 + g + 8 * i;
        rv[i] = b < a.B;
        rbase[i] = (size_t)(rv[i] ? b : 0) * T;
        xgp[i] = a.xg + rbase[i] * GH + u0;
        yp[i] = a.y + rbase[i] * a.ldy + u0;
        initp[i] = a.is_init + rbase[i];
    }
    const size_t hid_step = (size_t)L * H; // stride of one step in hidden/cell

    // The state entering step 0 (reset rule): hidden[b, 0] when stored states are given, else
    // zero where is_init[b, 0], else h0 (c0) or zero.
    float h[2][4], c[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
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
#pragma unroll
    for (int i = 0; i < 2; i++)
        Mode::put4(tiles + (g + 8 * i) * LDA + u0, h[i]);

    // x W_ih^T of step 0, and the reset flags and stored values of step 1.
    float xg[2][G][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int q = 0; q < G; q++)
            ld4<VEC>(xg[i][q], xgp[i] + q * H, u0, H, rv[i]);
    int nreset[2];
    float nh[2][4], nc[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
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
    // The layer input copied into the tape's z rows (x_l at xoff), one float4 a thread a step.
    const int xe = threadIdx.x * 4, xrow = a.Il > 0 ? xe / a.Il : 0, xcol = xe - xrow * a.Il;
    const bool xcp = a.x != nullptr && xe < 16 * a.Il && blockIdx.x * 16 + xrow < a.B;
    const float *xsrc = xcp ? a.x + (size_t)(blockIdx.x * 16 + xrow) * T * a.ldx + xcol : nullptr;
    float *xdst = xcp ? a.z + (size_t)(blockIdx.x * 16 + xrow) * T * a.ldz + a.xoff + xcol : nullptr;

    // Deferred stores (variant bit 2): the step's outputs, written at the top of the next step.
    float dz[DEFER ? 2 : 1][4];
    float dhn[DEFER ? 2 : 1][4], dsv[DEFER ? SW : 1][DEFER ? 2 : 1][4];
    persist_clock<V> clk;
    if constexpr ((V & 16) != 0)
        persist_stagger();
    __syncthreads();

    for (int t = 0; t < T; t++) {
        const E *cur = tiles + (t & 1) * (16 * LDA);
        E *nxt = tiles + ((t + 1) & 1) * (16 * LDA);
        clk.start();
        float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (xcp)
            xv = __ldg(reinterpret_cast<const float4 *>(xsrc + (size_t)t * a.ldx));
        auto store_step = [&](int ts, const float (*hs)[4], const float (*hns)[4],
                              const float (*svs)[2][4]) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                size_t r = rbase[i] + ts;
                st4<VEC>(yp[i] + (size_t)ts * a.ldy, hns[i], u0, H, rv[i]);
                if (a.z) {
                    float *zr = a.z + r * a.ldz;
                    st4<VEC>(zr + u0, hs[i], u0, H, rv[i]);
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
                        st4<VEC>(a.s + r * (SW * H) + p * H + u0, svs[p][i], u0, H, rv[i]);
                }
            }
        };
        if constexpr (DEFER) {
            if (t > 0)
                store_step(t - 1, dz, dhn, dsv);
        }
        if constexpr (TMA) {
            if (t > 0)
                bulk_step(t - 1);
        }

        float xgn[EARLY ? 2 : 1][G][4];
        if constexpr (EARLY) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int q = 0; q < G; q++)
                    ld4<VEC>(xgn[i][q], xgp[i] + (size_t)(t + 1) * GH + q * H, u0, H,
                             rv[i] && t + 1 < T);
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
            Mode::afrag(af, cur, LDA, ks, lane);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint2 b;
                if (ks < KREG) {
                    b = wreg[ks < KREG ? ks : 0][nt];
                } else {
                    uint4 q = wsm[(((ks - KREG) * NW + w) * (NT / 2) + (nt >> 1)) * 32 + lane];
                    b = nt & 1 ? make_uint2(q.z, q.w) : make_uint2(q.x, q.y);
                }
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
        if constexpr ((V & 8) != 0) {
            persist_wait_for(acc[0][0] + acc[NT - 1][3], a.dbg);
            clk.mark(0);
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

        if constexpr ((V & 8) != 0) {
            persist_wait_for(hn[0][0] + hn[1][3], a.dbg);
            clk.mark(1);
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
        } else {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int q = 0; q < G; q++)
                    ld4<VEC>(xg[i][q], xgp[i] + (size_t)(t + 1) * GH + q * H, u0, H,
                             rv[i] && t + 1 < T);
        }

        // Outputs and tape (deferred: kept for the top of the next step; TMA: staged for the
        // copy engine once it has read the previous step's stage).
        if constexpr (TMA) {
            if (threadIdx.x < 16)
                bulk_wait_read();
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int row = g + 8 * i;
                if (u0 < H) {
                    *reinterpret_cast<float4 *>(stage_y + row * Gm::Y_STR + u0) =
                        make_float4(hn[i][0], hn[i][1], hn[i][2], hn[i][3]);
                    *reinterpret_cast<float4 *>(stage_z + row * Gm::Z_STR + u0) =
                        make_float4(h[i][0], h[i][1], h[i][2], h[i][3]);
#pragma unroll
                    for (int p = 0; p < SW; p++)
                        *reinterpret_cast<float4 *>(stage_s + row * Gm::S_STR + p * H + u0) =
                            make_float4(sv[p][i][0], sv[p][i][1], sv[p][i][2], sv[p][i][3]);
                }
                if (u0 == 0) {
                    float *zr = stage_z + row * Gm::Z_STR;
                    zr[H] = 1.0f;
                    for (int k = H + 1; k < a.xoff; k++)
                        zr[k] = 0.0f;
                    for (int k = a.xoff + a.Il; k < zcopy; k++)
                        zr[k] = 0.0f;
                }
            }
            if (xcp)
                *reinterpret_cast<float4 *>(stage_z + xrow * Gm::Z_STR + a.xoff + xcol) = xv;
            fence_proxy_async();
        } else if constexpr (DEFER) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    dz[i][j] = h[i][j];
                    dhn[i][j] = hn[i][j];
#pragma unroll
                    for (int p = 0; p < SW; p++)
                        dsv[p][i][j] = sv[p][i][j];
                }
            if (t == T - 1)
                store_step(t, dz, dhn, dsv);
        } else {
            store_step(t, h, hn, sv);
        }
        if (xcp && !TMA)
            *reinterpret_cast<float4 *>(xdst + (size_t)t * a.ldz) = xv;

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
            // Flags and stored values of step t+2, used at the end of the next step.
#pragma unroll
            for (int i = 0; i < 2; i++) {
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
            for (int i = 0; i < 2; i++) {
                size_t at = (rbase[i] / T * L + l) * H + u0;
                if (a.h_n)
                    st4<VEC>(a.h_n + at, hn[i], u0, H, rv[i]);
                if (a.c_n)
                    st4<VEC>(a.c_n + at, cn[i], u0, H, rv[i]);
            }
        }
        clk.mark(2);
        __syncthreads();
        clk.mark(3);
    }
    if constexpr (TMA) {
        bulk_step(T - 1); // its stage was written before the last barrier
        if (threadIdx.x < 16)
            bulk_wait_all();
    }
    clk.flush(a.dbg);
}

// ---------------------------------------------------------------------------------------------
// Backward kernel

// TMA (TF32 mode, H == HP, sm_90): D's hidden-side planes are the shared-memory tile itself, so
// the copy engine writes them to D while the warps run the MMA; only the GRU's fourth plane is
// stored by the threads.
template <class Cell, class Mode, int HP, bool VEC, int V = 0, bool TMA = false>
static __global__ void __launch_bounds__(HP / 16 * 32, 1)
    seq_backward_kernel(const struct persist_bwd_args a) {
    using Gm = persist_geom<Cell, Mode, HP>;
    using E = typename Mode::elem;
    constexpr int G = Gm::G, NT = Gm::B_NT, KS = Gm::B_KS, KREG = Gm::B_KREG, NW = Gm::NW;
    constexpr int LDA = Gm::B_LDA, SW = Cell::SW, SPLIT = Gm::B_SPLIT;
    constexpr bool LSTM = G == 4;

    extern __shared__ __align__(16) unsigned char smem[];
    uint4 *wsm = reinterpret_cast<uint4 *>(smem); // two n-tiles' B fragments per 16 bytes
    E *tile = reinterpret_cast<E *>(smem + (KS - KREG) * Gm::B_KS_BYTES);

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int H = a.H, T = a.T, L = a.L, l = a.l;
    const int u0 = w * 16 + 4 * tg;

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
        for (int np = 0; np < NT / 2; np++) {
            uint2 f0 = wfrag(ks, 2 * np), f1 = wfrag(ks, 2 * np + 1);
            wsm[(((ks - KREG) * NW + w) * (NT / 2) + np) * 32 + lane] =
                make_uint4(f0.x, f0.y, f1.x, f1.y);
        }

    bool rv[2];
    size_t rbase[2], bidx[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int b = blockIdx.x * 16 + g + 8 * i;
        rv[i] = b < a.B;
        bidx[i] = rv[i] ? b : 0;
        rbase[i] = bidx[i] * T;
    }

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

    // Step t's tape record, output gradient, h entering the step and reset flag.
    float sv[SW][2][4], gy[2][4], hp[2][4];
    int reset[2];
    auto load_step = [&](int t) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            size_t r = rbase[i] + t;
#pragma unroll
            for (int p = 0; p < SW; p++)
                ld4<VEC>(sv[p][i], a.s + r * (SW * H) + p * H + u0, u0, H, rv[i]);
            ld4<VEC>(gy[i], a.gy + r * a.ldgy + u0, u0, H, rv[i]);
            if (LSTM)
                zero4(hp[i]);
            else
                ld4<VEC>(hp[i], a.z + r * a.ldz + u0, u0, H, rv[i]);
            reset[i] = ld_flag(a.is_init + r, rv[i]);
        }
    };
    load_step(T - 1);
    persist_clock<V> clk;
    if constexpr ((V & 16) != 0)
        persist_stagger();

    for (int t = T - 1; t >= 0; t--) {
        clk.start();
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
#pragma unroll
            for (int q = 0; q < G; q++)
                Mode::put4(tile + (g + 8 * i) * LDA + q * HP + u0, tv[q][i]);
            size_t r = rbase[i] + t;
#pragma unroll
            for (int p = TMA ? G : 0; p < 4; p++)
                st4<VEC>(a.d + r * (4 * H) + p * H + u0, dv[p][i], u0, H, rv[i]);
        }
        if constexpr (TMA)
            fence_proxy_async();
        if (t > 0)
            load_step(t - 1); // in flight during the MMA
        clk.mark(1);
        __syncthreads();
        clk.mark(2);
        if constexpr (TMA) {
            // Row threadIdx.x of the tile -> D row (b, t), planes 0..G-1.
            if (threadIdx.x < 16 && blockIdx.x * 16 + threadIdx.x < a.B) {
                size_t r = (size_t)(blockIdx.x * 16 + threadIdx.x) * T + t;
                bulk_s2g(a.d + r * (4 * H), tile + threadIdx.x * LDA, G * H * sizeof(float));
                bulk_commit();
            }
        }

        // dL/dh of the state entering step t: tile . W_hh (+ the direct term).
        float acc[SPLIT][NT][4];
#pragma unroll
        for (int sp = 0; sp < SPLIT; sp++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                zero4(acc[sp][nt]);
        auto bfrag_at = [&](int ks, int nt) -> uint2 {
            if (ks < KREG)
                return wreg[ks < KREG ? ks : 0][nt];
            uint4 q = wsm[(((ks - KREG) * NW + w) * (NT / 2) + (nt >> 1)) * 32 + lane];
            return nt & 1 ? make_uint2(q.z, q.w) : make_uint2(q.x, q.y);
        };
        if constexpr ((V & 1) != 0) {
            // Software-pipelined: fragments of k-step ks+1 are loaded before the MMAs of ks.
            uint32_t af[2][4];
            uint2 bf[2][NT];
            Mode::afrag(af[0], tile, LDA, 0, lane);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                bf[0][nt] = bfrag_at(0, nt);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                if (ks + 1 < KS) {
                    Mode::afrag(af[(ks + 1) & 1], tile, LDA, ks + 1, lane);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
                        bf[(ks + 1) & 1][nt] = bfrag_at(ks + 1, nt);
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    Mode::mma(acc[ks % SPLIT][nt], af[ks & 1], bf[ks & 1][nt]);
            }
        } else {
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t af[4];
                Mode::afrag(af, tile, LDA, ks, lane);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    Mode::mma(acc[ks % SPLIT][nt], af, bfrag_at(ks, nt));
            }
        }
        if constexpr ((V & 8) != 0) {
            persist_wait_for(acc[0][0][0] + acc[SPLIT - 1][NT - 1][3], a.dbg);
            clk.mark(3);
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
        if constexpr (TMA) {
            if (threadIdx.x < 16)
                bulk_wait_read(); // the tile is rewritten after the barrier
        }
        __syncthreads();
        clk.mark(5);
    }
    if constexpr (TMA) {
        if (threadIdx.x < 16)
            bulk_wait_all();
    }
    clk.flush(a.dbg);
}

// ---------------------------------------------------------------------------------------------
// Launchers, one per (cell, mode, HP): raise the shared-memory limit, launch, check.

template <class Cell, class Mode, int HP, int V = 0>
static int persist_launch_forward(const struct persist_fwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    // Variants exist with vector access only (the dispatcher asks for them only then).
    auto kernel = seq_forward_kernel<Cell, Mode, HP, true, V>;
    if constexpr (Gm::F_STAGE)
        if (a.tma)
            kernel = seq_forward_kernel<Cell, Mode, HP, true, V, Gm::F_STAGE>;
    if constexpr (V == 0)
        if (!a.vec)
            kernel = seq_forward_kernel<Cell, Mode, HP, false, 0>;
    RNND_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)Gm::F_SMEM));
    kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, Gm::F_SMEM, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <class Cell, class Mode, int HP, int V = 0>
static int persist_launch_backward(const struct persist_bwd_args &a, cudaStream_t stream) {
    using Gm = persist_geom<Cell, Mode, HP>;
    auto kernel = seq_backward_kernel<Cell, Mode, HP, true, V>;
    if constexpr (sizeof(typename Mode::elem) == 4)
        if (a.tma && a.H == HP)
            kernel = seq_backward_kernel<Cell, Mode, HP, true, V, true>;
    if constexpr (V == 0)
        if (!a.vec)
            kernel = seq_backward_kernel<Cell, Mode, HP, false, 0>;
    RNND_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)Gm::B_SMEM));
    kernel<<<CEIL_DIV(a.B, 16), Gm::THREADS, Gm::B_SMEM, stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

template <class Cell, class Mode, int HP>
static long persist_smem(bool backward) {
    using Gm = persist_geom<Cell, Mode, HP>;
    return backward ? Gm::B_SMEM : Gm::F_SMEM;
}

#endif // RNND_CUDA_SEQ_PERSIST_CUH
