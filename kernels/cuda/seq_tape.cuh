/*
 * seq_tape.cuh: how the time loops write and read the tape (the layout is common.cuh's): the s
 * records of the gate planes (tape_rec: in rows; tape_b8: in blocks of 8 rows for the LSTM's
 * cluster loops), and the 16-bit chunks of D and z that the backward loops write for the
 * weight-gradient products (seq_chunks.h has their format): the puts, the power-of-two scales
 * and the exponent records of TF32 mode.
 */
#ifndef RNND_CUDA_SEQ_TAPE_CUH
#define RNND_CUDA_SEQ_TAPE_CUH

#include "seq_cells.cuh"

// A tape s row (common.cuh): Cell::SW planes of H values, the first SH of them fp16 where HALF
// (the plan's tape_half, seq_plan.h), the others fp32. Accessors for plane p of a row at
// one unit u, at two (u even: get2 / put2) and at four (ld4 / st4's u0, H and ok).
template <class Cell, bool HALF>
struct tape_rec {
    static constexpr int SH = HALF ? Cell::SH : 0;
    static __device__ __forceinline__ size_t floats(int H) { // a row's, SH even
        return (size_t)(Cell::SW - SH) * H + (size_t)(SH / 2) * H;
    }
    static __device__ __forceinline__ __half *hp(const float *row, int p, int H) {
        return reinterpret_cast<__half *>(const_cast<float *>(row)) + (size_t)p * H;
    }
    static __device__ __forceinline__ float *fp(const float *row, int p, int H) {
        return const_cast<float *>(row) + (size_t)(SH / 2) * H + (size_t)(p - SH) * H;
    }
    static __device__ __forceinline__ float get(const float *row, int p, int H, int u) {
        return p < SH ? __half2float(hp(row, p, H)[u]) : fp(row, p, H)[u];
    }
    static __device__ __forceinline__ void put(float *row, int p, int H, int u, float v) {
        if (p < SH)
            hp(row, p, H)[u] = __float2half_rn(v);
        else
            fp(row, p, H)[u] = v;
    }
    // Units u, u+1 of 16-bit plane p packed, and their values (see ld4_packed).
    static __device__ __forceinline__ uint32_t ld2_packed(const float *row, int p, int H, int u) {
        return __ldg(reinterpret_cast<const uint32_t *>(hp(row, p, H) + u));
    }
    static __device__ __forceinline__ float2 unpack2(uint32_t q) {
        return __half22float2(*reinterpret_cast<const __half2 *>(&q));
    }
    static __device__ __forceinline__ float2 get2(const float *row, int p, int H, int u) {
        if (p < SH)
            return unpack2(ld2_packed(row, p, H, u));
        return __ldg(reinterpret_cast<const float2 *>(fp(row, p, H) + u));
    }
    static __device__ __forceinline__ void put2(float *row, int p, int H, int u, float2 v) {
        if (p < SH)
            *reinterpret_cast<__half2 *>(hp(row, p, H) + u) = __float22half2_rn(v);
        else
            *reinterpret_cast<float2 *>(fp(row, p, H) + u) = v;
    }
    // Units u0..u0+3 of 16-bit plane p (u0 % 4 == 0, vector access) packed, zeros where !ok or
    // past H, and their values: a loop that loads a step ahead keeps them packed until it uses
    // them (docs/kernels.md).
    static __device__ __forceinline__ uint2 ld4_packed(const float *row, int p, int u0, int H,
                                                       bool ok) {
        return ok && u0 < H ? __ldg(reinterpret_cast<const uint2 *>(hp(row, p, H) + u0))
                            : make_uint2(0u, 0u);
    }
    static __device__ __forceinline__ void unpack4(float v[4], uint2 q) {
        float2 lo = __half22float2(*reinterpret_cast<const __half2 *>(&q.x));
        float2 hi = __half22float2(*reinterpret_cast<const __half2 *>(&q.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    }
    template <bool VEC>
    static __device__ __forceinline__ void ld4(float v[4], const float *row, int p, int u0, int H,
                                               bool ok) {
        if (p >= SH)
            return ::ld4<VEC>(v, fp(row, p, H) + u0, u0, H, ok);
        if (VEC) {
            unpack4(v, ld4_packed(row, p, u0, H, ok));
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[j] = ok && u0 + j < H ? get(row, p, H, u0 + j) : 0.0f;
        }
    }
    template <bool VEC>
    static __device__ __forceinline__ void st4(float *row, int p, const float v[4], int u0, int H,
                                               bool ok) {
        if (p >= SH)
            return ::st4<VEC>(fp(row, p, H) + u0, v, u0, H, ok);
        if (VEC) {
            alignas(8)
                __half2 q[2] = {__floats2half2_rn(v[0], v[1]), __floats2half2_rn(v[2], v[3])};
            if (ok && u0 < H)
                *reinterpret_cast<uint2 *>(hp(row, p, H) + u0) = *reinterpret_cast<uint2 *>(q);
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (ok && u0 + j < H)
                    put(row, p, H, u0 + j, v[j]);
        }
    }
};

// The LSTM's fp16 tape where its backward runs in clusters (the plan's tape_blocked; H = 256,
// seq_cluster.cu): blocks of 8 rows x 8 units, [b / 8][t][u / 8], 768 bytes each. Lane
// l = 4 (b % 8) + (u % 8) / 2 holds units u, u + 1 (u even) of row b: the four fp16 planes in
// 16 bytes at 16 l (plane p's pair at 4 p), cprev in 8 bytes at 512 + 8 l. A cluster warp's
// lane (g, tg) owns exactly that lane's elements (rows 8 i + g of 8-aligned groups, units 8 w +
// 2 tg + j), so a step's record takes it one 16-byte and one 8-byte access a row, each warp
// access 768 contiguous bytes; in rows of tape_rec each of five accesses touched 8 rows' lines
// (docs/kernels.md). The blocks of a partial last group run to a multiple of 8 rows.
struct tape_b8 {
    static constexpr int FLOATS = 192; // a block
    // The block of row group b8 (rows [8 b8, 8 b8 + 8)), step t, unit u; of row b.
    static __device__ __forceinline__ size_t block8(size_t b8, int t, int u, int T, int H) {
        return ((b8 * T + t) * (size_t)(H / 8) + u / 8) * FLOATS;
    }
    static __device__ __forceinline__ size_t block(size_t b, int t, int u, int T, int H) {
        return block8(b / 8, t, u, T, H);
    }
    static __device__ __forceinline__ int lane(size_t b, int u) {
        return 4 * (int)(b % 8) + (u % 8) / 2;
    }
    // Plane p (< 4: fp16; 4: cprev) of unit u at row b, step t.
    static __device__ __forceinline__ float get(const float *s, size_t b, int t, int p, int u,
                                                int T, int H) {
        const float *k = s + block(b, t, u, T, H);
        const int l = lane(b, u);
        return p < 4 ? __half2float(reinterpret_cast<const __half *>(k)[8 * l + 2 * p + (u & 1)])
                     : k[128 + 2 * l + (u & 1)];
    }
    static __device__ __forceinline__ void put(float *s, size_t b, int t, int p, int u, int T,
                                               int H, float v) {
        float *k = s + block(b, t, u, T, H);
        const int l = lane(b, u);
        if (p < 4)
            reinterpret_cast<__half *>(k)[8 * l + 2 * p + (u & 1)] = __float2half_rn(v);
        else
            k[128 + 2 * l + (u & 1)] = v;
    }
};


// ---------------------------------------------------------------------------------------------
// Backward kernel

// dw16 chunks (seq_chunks.h): the warp's 8 x 16 block of one row half (lane: row g, its units
// 4tg..4tg+3 as 16-bit pairs lo, hi: bf16, or F16 fp16) into the two core matrices at cm and
// cm + 256. KM (K-major): movmatrix transposes each 8 x 8 matrix of pairs, after which lane l
// holds rows 2(l%4) and 2(l%4)+1 of column l/4: one 4-byte store a lane writes a whole core
// matrix. Without KM (TF32 mode's D) lane l's pair is already row l/4's columns 2(l%4), +1 of a
// row-major core matrix: no movmatrix (its readers load it with ldmatrix transposed the other
// way). The columns come out in the order seq_chunks.h gives (4tg, 4tg+1 in the first matrix,
// 4tg+2, 4tg+3 in the second).
template <bool F16 = false, bool KM = true>
static __device__ __forceinline__ void dw16_put(unsigned char *cm, const float v[4], int lane) {
    uint32_t a, b;
    if constexpr (F16) {
        __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
        a = *reinterpret_cast<uint32_t *>(&lo), b = *reinterpret_cast<uint32_t *>(&hi);
    } else {
        __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]);
        __nv_bfloat162 hi = __floats2bfloat162_rn(v[2], v[3]);
        a = *reinterpret_cast<uint32_t *>(&lo), b = *reinterpret_cast<uint32_t *>(&hi);
    }
    if constexpr (KM) {
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(a));
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(b));
    }
    *reinterpret_cast<uint32_t *>(cm + 4 * lane) = a;
    *reinterpret_cast<uint32_t *>(cm + 256 + 4 * lane) = b;
}
// A backward loop's row half i of chunk c into the dw16 chunks: D's 4 planes (plane(p): this
// thread's 4 units of plane p) times ds and (ZH) z's h part (h) times hs, warp w's 16 units being
// core-matrix groups 2w and 2w + 1; zeros where live is false (rows past B). Returns chunk c's z
// part (x XK wide) at row half i.
template <int XK, bool F16 = false, bool ZH = true, class P>
static __device__ __forceinline__ unsigned char *dw16_put_dh(void *dw16, size_t pitch, size_t c,
                                                             int w, int i, int lane, bool live,
                                                             P plane, const float h[4],
                                                             float ds = 1.0f, float hs = 1.0f) {
    unsigned char *base = static_cast<unsigned char *>(dw16) + i * 128;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const float *d = plane(p);
        const float v[4] = {live ? d[0] * ds : 0.0f, live ? d[1] * ds : 0.0f,
                            live ? d[2] * ds : 0.0f, live ? d[3] * ds : 0.0f};
        dw16_put<F16, !F16>(base + (p * pitch + c) * RNND_DW16_D + 2 * w * 256, v, lane);
    }
    unsigned char *zc = base + 4 * pitch * RNND_DW16_D + c * RNND_DW16_Z(XK);
    if constexpr (ZH) {
        const float hv[4] = {h[0] * hs, h[1] * hs, h[2] * hs, h[3] * hs};
        dw16_put<F16>(zc + 2 * w * 256, hv, lane);
    }
    return zc;
}
// The core matrix of z's constant column (128 + x's width) at cm: the constant (one, a pair of
// 16-bit ones: bf16 1.0, or TF32 mode's fp16 h scale) in both rows a lane holds, column 0 (lanes
// 0-3), and zeros.
static __device__ __forceinline__ void dw16_put_one(unsigned char *cm, int lane,
                                                    uint32_t one = 0x3F803F80u) {
    *reinterpret_cast<uint32_t *>(cm + 4 * lane) = lane < 4 ? one : 0u;
}
// log2 of a power of two p (a normal float).
static __device__ __forceinline__ int pow2_log(float p) {
    return (int)((__float_as_uint(p) >> 23) & 255) - 127;
}
// TF32 mode: a group's scale sc = persist_pow2_for(m, 14) for its largest |value| m (into
// [2^13, 2^14)), and its exponent ed (D = D' 2^ed for D' = D sc), or RNND_DW16_EZERO for m = 0.
static __device__ __forceinline__ float dw16_scale(float m, int &ed) {
    const float sc = persist_pow2_for(m, 14);
    ed = m > 0.0f ? -pow2_log(sc) : RNND_DW16_EZERO;
    return sc;
}
// TF32 mode: a step's exponent record (seq_chunks.h) at rec, from warp w's group exponents ed
// of its rows g and g + 8 and their x exponents ex, and the block's eh: eD by the rows' lanes
// tg = 0 (one 32-byte run a warp), the warp's maxima by lane 0 (one redux each), eh and every
// row's ex (exr: row lane - 16's) by warp 4. The maxima are kept within int16 (zero groups).
static __device__ __forceinline__ void dw16_record(int16_t *rec, int w, int lane, const int ed[2],
                                                   const int ex[2], int eh, int exr) {
    const int g = lane >> 2, lo = RNND_DW16_EZERO - 128;
    if ((lane & 3) == 0) {
        rec[w * 16 + g] = (int16_t)ed[0];
        rec[w * 16 + g + 8] = (int16_t)ed[1];
    }
    const int mh = __reduce_max_sync(0xffffffffu, max(ed[0], ed[1])) + eh;
    const int mx = __reduce_max_sync(0xffffffffu, max(ed[0] + ex[0], ed[1] + ex[1]));
    if (lane == 0) {
        rec[160 + w] = (int16_t)max(mh, lo);
        rec[168 + w] = (int16_t)max(mx, lo);
    }
    if (w == 4)
        rec[128 + lane] = (int16_t)(lane < 16 ? eh : exr);
}
// TF32 mode: D's group scale of one row half (this thread's 4 units of the 4 planes, the row's
// 4 lanes together; zero for a row past B) and its exponent ed.
static __device__ __forceinline__ float dw16_dscale(const float *const dv[4], bool live, int &ed) {
    float m = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; p++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            m = fmaxf(m, fabsf(dv[p][j]));
    m = live ? m : 0.0f;
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    return dw16_scale(m, ed);
}

#endif // RNND_CUDA_SEQ_TAPE_CUH
