/*
 * step.cu: one recurrent step for a batch of rows whose states live in a slot table (the
 * inference path; struct rnnd_step). Per layer l (gate order GRU r,z,n; LSTM i,f,g,o):
 *   gx = W_ih x_l, gh = W_hh h_l (no biases), then the cell exactly as in the sequence kernels
 *   (cell_gru / cell_lstm: GRU n = tanh(gx_n + b_in + r (gh_n + b_hn)), LSTM c' = f c + i g).
 * Mapping: a block of RNND_STEP_BLOCK threads owns R rows (R <= 8, set by the shared memory the
 * widths need). Shared memory holds the rows' layer input, state and gate sums. For the two
 * matvecs, warp w takes gate rows j = w, w + 8, ...; its lanes stride along the row of W (so the
 * weight reads are coalesced) with R partial sums each, then a warp reduction. The cell then runs
 * one thread per (row, unit). Products are fp32 FMAs (bf16 mode rounds both operands to bf16
 * first, as a bf16 tensor-core product would).
 */
#include "step.cuh"

#include "seq_persist.cuh"

#define RNND_STEP_BLOCK 256
#define RNND_STEP_MAX_ROWS 8

struct step_kargs {
    int B, I, H, L, R;
    bool lstm, bf16;
    const float *x;
    const uint8_t *is_init;
    const int32_t *slots;
    float *state_h, *state_c, *out, *h_before, *c_before;
    const float *w_ih[RNND_MAX_LAYERS], *w_hh[RNND_MAX_LAYERS];
    const float *b_ih[RNND_MAX_LAYERS], *b_hh[RNND_MAX_LAYERS];
};

// Floats of shared memory per row: layer input, h, c, gx, gh.
static size_t step_row_floats(const struct rnnd_model *m) {
    size_t G = (size_t)rnnd_model_gates(m), H = (size_t)m->H;
    size_t in = (size_t)(m->I > m->H ? m->I : m->H);
    return in + 2 * H + 2 * G * H;
}

int rnnd__cuda_step_rows(const struct rnnd_model *m, size_t smem_optin) {
    size_t row = step_row_floats(m) * sizeof(float);
    for (int R = RNND_STEP_MAX_ROWS; R >= 1; R /= 2)
        if (R * row <= smem_optin)
            return R;
    return 0;
}

template <class Cell, bool FAST>
static __global__ void __launch_bounds__(RNND_STEP_BLOCK)
    step_kernel(const step_kargs a, int in_stride) {
    constexpr int G = Cell::G, SW = Cell::SW;
    extern __shared__ float sm[];
    const int R = a.R, H = a.H, L = a.L, GH = G * H;
    float *xs = sm;                       // (R, in_stride) layer input
    float *hs = xs + R * in_stride;       // (R, H) state entering the step
    float *cs = hs + R * H;               // (R, H)
    float *gx = cs + R * H;               // (R, G*H)
    float *gh = gx + R * GH;              // (R, G*H)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = RNND_STEP_BLOCK / 32;
    const int row0 = blockIdx.x * R;
    const int nrows = min(R, a.B - row0);

    for (int idx = tid; idx < nrows * a.I; idx += RNND_STEP_BLOCK) {
        int r = idx / a.I, k = idx % a.I;
        xs[r * in_stride + k] = a.x[(size_t)(row0 + r) * a.I + k];
    }
    for (int l = 0; l < L; l++) {
        const int Il = l == 0 ? a.I : H;
        // Gather the state (zero on reset) and report it.
        for (int idx = tid; idx < nrows * H; idx += RNND_STEP_BLOCK) {
            int r = idx / H, u = idx % H, b = row0 + r;
            bool reset = a.is_init && a.is_init[b];
            size_t at = ((size_t)a.slots[b] * L + l) * H + u;
            float h = reset ? 0.0f : a.state_h[at];
            float c = a.lstm && !reset ? a.state_c[at] : 0.0f;
            hs[r * H + u] = h;
            cs[r * H + u] = c;
            if (a.h_before)
                a.h_before[((size_t)b * L + l) * H + u] = h;
            if (a.c_before)
                a.c_before[((size_t)b * L + l) * H + u] = c;
        }
        __syncthreads();

        const float *wih = a.w_ih[l], *whh = a.w_hh[l];
        for (int j = warp; j < GH; j += nwarps) {
            float ax[RNND_STEP_MAX_ROWS], ah[RNND_STEP_MAX_ROWS];
#pragma unroll
            for (int r = 0; r < RNND_STEP_MAX_ROWS; r++)
                ax[r] = ah[r] = 0.0f;
            for (int k = lane; k < Il; k += 32) {
                float wv = __ldg(wih + (size_t)j * Il + k);
                if (a.bf16)
                    wv = round_bf16(wv);
#pragma unroll
                for (int r = 0; r < RNND_STEP_MAX_ROWS; r++)
                    if (r < nrows) {
                        float xv = xs[r * in_stride + k];
                        ax[r] = fmaf(wv, a.bf16 ? round_bf16(xv) : xv, ax[r]);
                    }
            }
            for (int k = lane; k < H; k += 32) {
                float wv = __ldg(whh + (size_t)j * H + k);
                if (a.bf16)
                    wv = round_bf16(wv);
#pragma unroll
                for (int r = 0; r < RNND_STEP_MAX_ROWS; r++)
                    if (r < nrows) {
                        float hv = hs[r * H + k];
                        ah[r] = fmaf(wv, a.bf16 ? round_bf16(hv) : hv, ah[r]);
                    }
            }
#pragma unroll
            for (int r = 0; r < RNND_STEP_MAX_ROWS; r++)
                if (r < nrows) {
                    float sx = warp_sum(ax[r]), sh = warp_sum(ah[r]);
                    if (lane == 0) {
                        gx[r * GH + j] = sx;
                        gh[r * GH + j] = sh;
                    }
                }
        }
        __syncthreads();

        // The cell; the new h becomes the next layer's input.
        const float *bih = a.b_ih[l], *bhh = a.b_hh[l];
        for (int idx = tid; idx < nrows * H; idx += RNND_STEP_BLOCK) {
            int r = idx / H, u = idx % H, b = row0 + r;
            float xq[G], hq[G], s[SW], hn, cn;
#pragma unroll
            for (int q = 0; q < G; q++) {
                xq[q] = gx[r * GH + q * H + u] + bih[q * H + u];
                hq[q] = gh[r * GH + q * H + u] + bhh[q * H + u];
            }
            Cell::template forward<FAST>(xq, hq, hs[r * H + u], cs[r * H + u], hn, cn, s);
            xs[r * in_stride + u] = hn;
            size_t at = ((size_t)a.slots[b] * L + l) * H + u;
            a.state_h[at] = hn;
            if (a.lstm)
                a.state_c[at] = cn;
            if (l == L - 1)
                a.out[(size_t)b * H + u] = hn;
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// Launcher

int rnnd__cuda_rnn_step(struct cuda_ctx *c, const struct rnnd_step *step, const float *params,
                        const struct rnnd_model *m) {
    if (c == NULL || rnnd_step_check(step, m) != 0 || params == NULL)
        return RNND_EINVAL;
    int R = rnnd__cuda_step_rows(m, c->smem_optin);
    if (R == 0)
        return RNND_ENOTSUP;
    step_kargs a = {};
    a.B = step->B, a.I = m->I, a.H = m->H, a.L = m->L, a.R = R;
    a.lstm = m->cell == RNND_CELL_LSTM, a.bf16 = m->compute == RNND_COMPUTE_BF16;
    a.x = step->x, a.is_init = step->is_init, a.slots = step->slots;
    a.state_h = step->state_h, a.state_c = step->state_c, a.out = step->out;
    a.h_before = step->h_before, a.c_before = step->c_before;
    for (int l = 0; l < m->L; l++) {
        struct layer_params lp = rnnd__cuda_layer_params(m, l, params);
        a.w_ih[l] = lp.w_ih, a.w_hh[l] = lp.w_hh, a.b_ih[l] = lp.b_ih, a.b_hh[l] = lp.b_hh;
    }
    int in_stride = m->I > m->H ? m->I : m->H;
    size_t smem = (size_t)R * step_row_floats(m) * sizeof(float);
    int grid = CEIL_DIV(step->B, R);
    // Fast activations in the tensor-core modes, libdevice ones for ieee (as the sequence paths).
    bool fast = m->compute != RNND_COMPUTE_IEEE;
    if (a.lstm && fast)
        step_kernel<cell_lstm, true><<<grid, RNND_STEP_BLOCK, smem, c->stream>>>(a, in_stride);
    else if (a.lstm)
        step_kernel<cell_lstm, false><<<grid, RNND_STEP_BLOCK, smem, c->stream>>>(a, in_stride);
    else if (fast)
        step_kernel<cell_gru, true><<<grid, RNND_STEP_BLOCK, smem, c->stream>>>(a, in_stride);
    else
        step_kernel<cell_gru, false><<<grid, RNND_STEP_BLOCK, smem, c->stream>>>(a, in_stride);
    CUDA_LAUNCH_CHECK();
    return 0;
}

int rnnd__cuda_step_prepare(struct cuda_ctx *c) {
    // Once per context, so that rnn_step itself only launches (safe inside graph capture).
    const void *kernels[4] = {(const void *)step_kernel<cell_lstm, true>,
                              (const void *)step_kernel<cell_lstm, false>,
                              (const void *)step_kernel<cell_gru, true>,
                              (const void *)step_kernel<cell_gru, false>};
    for (int k = 0; k < 4; k++)
        RNND_CUDA_TRY(cudaFuncSetAttribute(kernels[k], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)c->smem_optin));
    return 0;
}
