/*
 * rnn.c: the sequence driver of the CPU reference backend, shared by GRU and LSTM: the tape,
 * the reset rule, the stack of layers and the two time loops, plus the single-step path.
 * The cells' pointwise math is in gru.c and lstm.c; matmuls go through linear.c (CBLAS sgemm).
 *
 * Forward, layer by layer (layer l reads layer l-1's h over all T steps):
 *   1. gx (T*B, G*H) = x_l W_ih^T: one sgemm over every step and row;
 *   2. for t = 0 .. T-1: build the state each row enters step t with (the reset rule, below)
 *      straight into the tape, gh (B, G*H) = h W_hh^T (one sgemm over the B rows of step t), then
 *      the cell's pointwise step per row.
 * Backward, layer by layer from the top:
 *   1. for t = T-1 .. 0: the cell's pointwise backward per row gives the gradients of
 *      W_ih x + b_ih (dgx) and W_hh h + b_hh (dgh) for every (step, row); dL/dh of the state
 *      entering the step is dh_direct + dgh W_hh (one sgemm over B rows); then it is carried to
 *      step t-1, or, where that state was a reset value or the initial state, routed to that
 *      value's gradient and the carry is cut;
 *   2. weight gradients as one sgemm each over all T*B rows (dW_ih += dgx^T x_l,
 *      dW_hh += dgh^T h), bias gradients as column sums in double, and the input gradient
 *      dx_l = dgx W_ih (the layer below's output gradient).
 *
 * Internal buffers are time-major (row r = t*B + b), unlike the batch-first API tensors: a step's
 * B rows are then one contiguous block, which its sgemm reads with no stride and the pointwise
 * loops stream through (batch-first rows of one step lie T*G*H floats apart, and cost a cache
 * and TLB miss each). x is transposed into that order on entry; out, grad_out and grads->x are
 * read and written batch-first in place.
 *
 * The reset rule (DESIGN.md §2). The state row b enters step t with is, for every layer:
 *   is_init[b, t] set:       hidden[b, t] if stored states are given, else zero;
 *   t = 0 (no reset):        hidden[b, 0] if stored states are given, else h0, else zero;
 *   otherwise:               the state that row b left step t-1 with.
 * Gradients follow the same routing: into grads->hidden[b, t] for stored values, grads->h0 for
 * the initial state (h0, or the implied zero one), nowhere for a zero reset.
 *
 * Tape, per layer l, each an array of T*B rows in time-major order:
 *   hprev (H) state entering the step (after the reset rule)   cprev (H) the same for c, LSTM
 *   gates (G*H) activated gates                                aux (H) GRU: W_hn h + b_hn;
 *   y (H) the layer's output h, for l < L-1 only                        LSTM: tanh(c')
 * rnn_forward without a tape uses a scratch tape of the same layout, so both give the same bits.
 */
#include "cpu.h"

#include <limits.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Layout helpers

struct layer_tape { // time-major: row t*B + b
    float *hprev; // (T, B, H)
    float *cprev; // (T, B, H) LSTM, else NULL
    float *gates; // (T, B, G*H)
    float *aux;   // (T, B, H)
    float *y;     // (T, B, H) l < L-1, else NULL (the last layer writes `out`)
};

// Fills lt[0 .. L-1] with pointers into base (may be NULL to measure) and returns the float count.
static size_t tape_layout(const struct rnnd_model *m, int B, int T, float *base,
                          struct layer_tape *lt) {
    size_t BT = (size_t)B * (size_t)T, H = (size_t)m->H;
    size_t GH = (size_t)rnnd_model_gates(m) * H;
    bool lstm = m->cell == RNND_CELL_LSTM;
    size_t at = 0;
    for (int l = 0; l < m->L; l++) {
        struct layer_tape t = {0};
        t.hprev = base ? base + at : NULL, at += BT * H;
        if (lstm)
            t.cprev = base ? base + at : NULL, at += BT * H;
        t.gates = base ? base + at : NULL, at += BT * GH;
        t.aux = base ? base + at : NULL, at += BT * H;
        if (l < m->L - 1)
            t.y = base ? base + at : NULL, at += BT * H;
        if (lt)
            lt[l] = t;
    }
    return at;
}

size_t rnnd__cpu_tape_bytes(const struct rnnd_model *m, int B, int T) {
    if (rnnd_model_check(m) != 0 || B < 1 || T < 1)
        return 0;
    return tape_layout(m, B, T, NULL, NULL) * sizeof(float);
}

struct layer_weights {
    const float *w_ih; // (G*H, I_l), bf16-rounded in bf16 mode
    const float *w_hh; // (G*H, H), bf16-rounded in bf16 mode
    const float *b_ih; // (G*H)
    const float *b_hh; // (G*H)
    int Il;            // I_l
};

// Layer l's tensors in params; the weight matrices come from wr instead when it is not NULL.
static struct layer_weights layer_weights(const struct rnnd_model *m, int l, const float *params,
                                          const float *wr) {
    struct rnnd_param_tensor t[4];
    for (int k = 0; k < 4; k++)
        rnnd_model_param_tensor(m, 4 * l + k, &t[k]);
    const float *w = wr ? wr : params;
    return (struct layer_weights){
        .w_ih = w + t[RNND_PARAM_WEIGHT_IH].offset,
        .w_hh = w + t[RNND_PARAM_WEIGHT_HH].offset,
        .b_ih = params + t[RNND_PARAM_BIAS_IH].offset,
        .b_hh = params + t[RNND_PARAM_BIAS_HH].offset,
        .Il = rnnd_model_layer_input(m, l),
    };
}

// bf16 mode: wr (P floats) = params with every weight matrix rounded to bf16 (biases are no
// matmul operand; they are read from params directly).
static void round_weights(const struct rnnd_model *m, const float *params, float *wr) {
    for (int k = 0; k < rnnd_model_param_tensors(m); k++) {
        struct rnnd_param_tensor t;
        rnnd_model_param_tensor(m, k, &t);
        if (t.ndim == 2)
            rnnd__cpu_round_bf16(wr + t.offset, params + t.offset, t.count);
    }
}

// Refuses shapes whose sizes do not fit sgemm's int arguments.
static bool dims_fit_int(const struct rnnd_model *m) {
    return (int64_t)m->L * rnnd_model_gates(m) * m->H <= INT_MAX;
}

// dst (T, B, w) time-major = src (B, T, w) batch-first, and back.
static void to_time_major(float *dst, const float *src, int B, int T, int w) {
    for (int t = 0; t < T; t++)
        for (int b = 0; b < B; b++)
            memcpy(dst + ((size_t)t * B + b) * w, src + ((size_t)b * T + t) * w,
                   sizeof(float) * (size_t)w);
}
static void to_batch_first(float *dst, const float *src, int B, int T, int w) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            memcpy(dst + ((size_t)b * T + t) * w, src + ((size_t)t * B + b) * w,
                   sizeof(float) * (size_t)w);
}

// Where the state row b enters step t with comes from (the reset rule in the header comment).
enum state_src {
    SRC_CARRY,  // the state left by step t-1
    SRC_ZERO,   // a zero reset
    SRC_INIT,   // t = 0 without reset: h0 (c0), or zero when none was given
    SRC_STORED, // hidden[b, t] (cell[b, t])
};

static enum state_src state_source(const struct rnnd_seq *s, int b, int t) {
    bool reset = s->is_init[(size_t)b * s->T + t] != 0;
    if (s->hidden && (reset || t == 0))
        return SRC_STORED;
    if (reset)
        return SRC_ZERO;
    return t == 0 ? SRC_INIT : SRC_CARRY;
}

// Row (b, l) of a (B, L, H) array, and row (b, t, l) of a (B, T, L, H) array.
static size_t blh(int b, int l, const struct rnnd_model *m) {
    return ((size_t)b * m->L + l) * m->H;
}
static size_t btlh(int b, int t, int l, int T, const struct rnnd_model *m) {
    return (((size_t)b * T + t) * m->L + l) * m->H;
}

static void copy_or_zero(float *dst, const float *src, int H) {
    if (src)
        memcpy(dst, src, sizeof(float) * (size_t)H);
    else
        memset(dst, 0, sizeof(float) * (size_t)H);
}

// ---------------------------------------------------------------------------------------------
// Forward

int rnnd__cpu_rnn_forward(struct cpu_ctx *c, float *out, float *h_n, float *c_n, void *tape,
                          const struct rnnd_seq *seq, const float *params,
                          const struct rnnd_model *m) {
    if (c == NULL || rnnd_seq_check(seq, m) != 0 || out == NULL || params == NULL)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM, bf16 = m->compute == RNND_COMPUTE_BF16;
    if ((c_n && !lstm) || !dims_fit_int(m))
        return RNND_EINVAL;
    int B = seq->B, T = seq->T, H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t BT = (size_t)B * T, P = rnnd_model_param_count(m);
    int maxw = m->I > H ? m->I : H;

    // Scratch: rounded weights (bf16), x time-major, gx, gh, the running c (LSTM), and a tape if
    // none was given.
    float *wr, *xt, *gx, *gh, *cbuf, *own_tape;
    struct cpu_carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        wr = rnnd__cpu_carve(&cv, bf16 ? P * sizeof(float) : 0);
        xt = rnnd__cpu_carve(&cv, BT * m->I * sizeof(float));
        gx = rnnd__cpu_carve(&cv, BT * GH * sizeof(float));
        gh = rnnd__cpu_carve(&cv, (size_t)B * GH * sizeof(float));
        cbuf = rnnd__cpu_carve(&cv, lstm ? (size_t)B * H * sizeof(float) : 0);
        own_tape = rnnd__cpu_carve(&cv, tape ? 0 : rnnd__cpu_tape_bytes(m, B, T));
        if (pass == 0) {
            int err = rnnd__cpu_reserve(c, cv.used, bf16 ? BT * (size_t)maxw : 0);
            if (err)
                return err;
            cv = (struct cpu_carve){.base = c->work};
        }
    }
    struct layer_tape lt[RNND_MAX_LAYERS];
    tape_layout(m, B, T, tape ? (float *)tape : own_tape, lt);
    if (bf16)
        round_weights(m, params, wr);
    to_time_major(xt, seq->x, B, T, m->I);

    const float *xl = xt; // (T, B, I_l): this layer's input
    for (int l = 0; l < L; l++) {
        struct layer_weights w = layer_weights(m, l, params, bf16 ? wr : NULL);
        struct layer_tape *tp = &lt[l];
        bool last = l == L - 1;
        // Row b's output at step t: batch-first in out for the last layer, else the tape's y.
#define Y_ROW(b, t) (last ? out + ((size_t)(b) * T + (t)) * H : tp->y + ((size_t)(t) * B + (b)) * H)

        // The input projection of every step at once.
        rnnd__cpu_gemm(c, bf16, false, true, (int)BT, GH, w.Il, xl, w.Il, true, w.w_ih, w.Il,
                       false, 0.0f, gx, GH);

        for (int t = 0; t < T; t++) {
            size_t r0 = (size_t)t * B; // the step's first row
            for (int b = 0; b < B; b++) {
                float *hp = tp->hprev + (r0 + b) * H, *cp = lstm ? tp->cprev + (r0 + b) * H : NULL;
                switch (state_source(seq, b, t)) {
                    case SRC_CARRY:
                        memcpy(hp, Y_ROW(b, t - 1), sizeof(float) * H);
                        if (lstm)
                            memcpy(cp, cbuf + (size_t)b * H, sizeof(float) * H);
                        break;
                    case SRC_ZERO:
                        copy_or_zero(hp, NULL, H);
                        if (lstm)
                            copy_or_zero(cp, NULL, H);
                        break;
                    case SRC_INIT:
                        copy_or_zero(hp, seq->h0 ? seq->h0 + blh(b, l, m) : NULL, H);
                        if (lstm)
                            copy_or_zero(cp, seq->c0 ? seq->c0 + blh(b, l, m) : NULL, H);
                        break;
                    case SRC_STORED:
                        copy_or_zero(hp, seq->hidden + btlh(b, t, l, T, m), H);
                        if (lstm)
                            copy_or_zero(cp, seq->cell + btlh(b, t, l, T, m), H);
                        break;
                }
            }
            // gh = h W_hh^T over the B rows of step t.
            rnnd__cpu_gemm(c, bf16, false, true, B, GH, H, tp->hprev + r0 * H, H, true, w.w_hh, H,
                           false, 0.0f, gh, GH);
            for (int b = 0; b < B; b++) {
                size_t r = r0 + b;
                if (lstm)
                    rnnd__lstm_row_forward(H, tp->gates + r * GH, cbuf + (size_t)b * H,
                                           tp->aux + r * H, Y_ROW(b, t), gx + r * GH,
                                           gh + (size_t)b * GH, tp->cprev + r * H, w.b_ih,
                                           w.b_hh);
                else
                    rnnd__gru_row_forward(H, tp->gates + r * GH, tp->aux + r * H, Y_ROW(b, t),
                                          gx + r * GH, gh + (size_t)b * GH, tp->hprev + r * H,
                                          w.b_ih, w.b_hh);
            }
        }
        for (int b = 0; b < B; b++) {
            if (h_n)
                memcpy(h_n + blh(b, l, m), Y_ROW(b, T - 1), sizeof(float) * H);
            if (c_n)
                memcpy(c_n + blh(b, l, m), cbuf + (size_t)b * H, sizeof(float) * H);
        }
#undef Y_ROW
        xl = tp->y;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Backward

int rnnd__cpu_rnn_backward(struct cpu_ctx *c, const struct rnnd_seq_grads *grads,
                           const float *grad_out, const float *grad_h_n, const float *grad_c_n,
                           const void *tape, const struct rnnd_seq *seq, const float *params,
                           const struct rnnd_model *m) {
    if (c == NULL || rnnd_seq_check(seq, m) != 0 || grads == NULL || grads->params == NULL ||
        grad_out == NULL || tape == NULL || params == NULL)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM, bf16 = m->compute == RNND_COMPUTE_BF16;
    if (!lstm && (grad_c_n || grads->c0 || grads->cell))
        return RNND_EINVAL;
    if ((grads->hidden && !seq->hidden) || (grads->cell && !seq->cell))
        return RNND_EINVAL;
    if (!dims_fit_int(m))
        return RNND_EINVAL;
    int B = seq->B, T = seq->T, H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t BT = (size_t)B * T, P = rnnd_model_param_count(m);
    int maxw = m->I > H ? m->I : H;

    // Scratch: rounded weights (bf16); x time-major (layer 0's input, then its gradient); dgx and
    // dgh (GRU; the LSTM's are one and the same) over all steps and rows; the output gradient
    // of the layers below the top; the carried dh (dc) and the step's dL/dh; bias column sums.
    float *wr, *xt, *dgx, *dgh, *dyb, *dh, *dhp, *dc, *part;
    double *acc;
    struct cpu_carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        wr = rnnd__cpu_carve(&cv, bf16 ? P * sizeof(float) : 0);
        xt = rnnd__cpu_carve(&cv, BT * m->I * sizeof(float));
        dgx = rnnd__cpu_carve(&cv, BT * GH * sizeof(float));
        dgh = rnnd__cpu_carve(&cv, lstm ? 0 : BT * GH * sizeof(float));
        dyb = rnnd__cpu_carve(&cv, L > 1 ? BT * H * sizeof(float) : 0);
        dh = rnnd__cpu_carve(&cv, (size_t)B * H * sizeof(float));
        dhp = rnnd__cpu_carve(&cv, (size_t)B * H * sizeof(float));
        dc = rnnd__cpu_carve(&cv, lstm ? (size_t)B * H * sizeof(float) : 0);
        acc = rnnd__cpu_carve(&cv, (size_t)GH * sizeof(double));
        part = rnnd__cpu_carve(&cv, (size_t)GH * sizeof(float));
        if (pass == 0) {
            int err = rnnd__cpu_reserve(c, cv.used, bf16 ? BT * ((size_t)GH + maxw) : 0);
            if (err)
                return err;
            cv = (struct cpu_carve){.base = c->work};
        }
    }
    if (lstm)
        dgh = dgx;
    struct layer_tape lt[RNND_MAX_LAYERS];
    tape_layout(m, B, T, (float *)tape, lt);
    if (bf16)
        round_weights(m, params, wr);
    to_time_major(xt, seq->x, B, T, m->I);

    // Outputs that are written only where a value was used start at zero.
    size_t blh_bytes = (size_t)B * L * H * sizeof(float);
    if (grads->h0)
        memset(grads->h0, 0, blh_bytes);
    if (grads->c0)
        memset(grads->c0, 0, blh_bytes);
    if (grads->hidden)
        memset(grads->hidden, 0, blh_bytes * T);
    if (grads->cell)
        memset(grads->cell, 0, blh_bytes * T);

    for (int l = L - 1; l >= 0; l--) {
        struct layer_weights w = layer_weights(m, l, params, bf16 ? wr : NULL);
        struct layer_tape *tp = &lt[l];
        bool last = l == L - 1;
        // Row b's output gradient at step t: batch-first grad_out for the top layer, else the
        // time-major gradient the layer above passed down.
#define DY_ROW(b, t)                                                                               \
    (last ? grad_out + ((size_t)(b) * T + (t)) * H : dyb + ((size_t)(t) * B + (b)) * H)
        const float *xl = l == 0 ? xt : lt[l - 1].y; // (T, B, I_l)
        for (int b = 0; b < B; b++) {
            copy_or_zero(dh + (size_t)b * H, grad_h_n ? grad_h_n + blh(b, l, m) : NULL, H);
            if (lstm)
                copy_or_zero(dc + (size_t)b * H, grad_c_n ? grad_c_n + blh(b, l, m) : NULL, H);
        }

        for (int t = T - 1; t >= 0; t--) {
            size_t r0 = (size_t)t * B;
            for (int b = 0; b < B; b++) {
                size_t r = r0 + b;
                if (lstm)
                    rnnd__lstm_row_backward(H, dgx + r * GH, dc + (size_t)b * H, DY_ROW(b, t),
                                            dh + (size_t)b * H, tp->gates + r * GH,
                                            tp->aux + r * H, tp->cprev + r * H);
                else
                    rnnd__gru_row_backward(H, dgx + r * GH, dgh + r * GH, dhp + (size_t)b * H,
                                           DY_ROW(b, t), dh + (size_t)b * H, tp->gates + r * GH,
                                           tp->aux + r * H, tp->hprev + r * H);
            }
            // dL/dh of the state entering step t: (GRU: z dh' +) dgh W_hh.
            rnnd__cpu_gemm(c, bf16, false, false, B, H, GH, dgh + r0 * GH, GH, true, w.w_hh, H,
                           false, lstm ? 0.0f : 1.0f, dhp, H);
            for (int b = 0; b < B; b++) {
                float *dhb = dh + (size_t)b * H, *dhpb = dhp + (size_t)b * H;
                float *dcb = lstm ? dc + (size_t)b * H : NULL;
                switch (state_source(seq, b, t)) {
                    case SRC_CARRY:
                        memcpy(dhb, dhpb, sizeof(float) * H);
                        continue; // dc already holds dL/dc of this state
                    case SRC_ZERO:
                        break;
                    case SRC_INIT:
                        if (grads->h0)
                            memcpy(grads->h0 + blh(b, l, m), dhpb, sizeof(float) * H);
                        if (grads->c0)
                            memcpy(grads->c0 + blh(b, l, m), dcb, sizeof(float) * H);
                        break;
                    case SRC_STORED:
                        if (grads->hidden)
                            memcpy(grads->hidden + btlh(b, t, l, T, m), dhpb, sizeof(float) * H);
                        if (grads->cell)
                            memcpy(grads->cell + btlh(b, t, l, T, m), dcb, sizeof(float) * H);
                        break;
                }
                // The state was not carried from step t-1: cut the carried gradient.
                memset(dhb, 0, sizeof(float) * H);
                if (lstm)
                    memset(dcb, 0, sizeof(float) * H);
            }
        }
#undef DY_ROW

        // Parameter gradients, accumulated (+=) over every step and row at once.
        float *gp = grads->params;
        struct layer_weights gw = layer_weights(m, l, gp, NULL);
        rnnd__cpu_gemm(c, bf16, true, false, GH, w.Il, (int)BT, dgx, GH, true, xl, w.Il, true,
                       1.0f, (float *)gw.w_ih, w.Il);
        rnnd__cpu_gemm(c, bf16, true, false, GH, H, (int)BT, dgh, GH, true, tp->hprev, H, true,
                       1.0f, (float *)gw.w_hh, H);
        rnnd__cpu_add_colsum((float *)gw.b_ih, dgx, BT, GH, acc, part);
        if (lstm) // the same sums: both biases enter the same pre-activation
            for (int j = 0; j < GH; j++)
                ((float *)gw.b_hh)[j] += (float)acc[j];
        else
            rnnd__cpu_add_colsum((float *)gw.b_hh, dgh, BT, GH, acc, part);

        // The input gradient: the layer below's output gradient (time-major), or grads->x
        // (through xt, which layer 0's weight gradient no longer needs).
        if (l > 0 || grads->x) {
            float *dx = l > 0 ? dyb : xt;
            rnnd__cpu_gemm(c, bf16, false, false, (int)BT, w.Il, GH, dgx, GH, true, w.w_ih, w.Il,
                           false, 0.0f, dx, w.Il);
            if (l == 0)
                to_batch_first(grads->x, xt, B, T, m->I);
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Single step (the inference path)

int rnnd__cpu_rnn_step(struct cpu_ctx *c, const struct rnnd_step *step, const float *params,
                       const struct rnnd_model *m) {
    if (c == NULL || rnnd_step_check(step, m) != 0 || params == NULL || !dims_fit_int(m))
        return RNND_EINVAL;
    for (int b = 0; b < step->B; b++)
        if (step->slots[b] < 0)
            return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM, bf16 = m->compute == RNND_COMPUTE_BF16;
    int B = step->B, H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t P = rnnd_model_param_count(m), blh_floats = (size_t)B * L * H;
    int maxw = m->I > H ? m->I : H;

    // Scratch: rounded weights (bf16), states before and after (B, L, H), gx, gh, and one row's
    // gates and aux (not kept).
    float *wr, *hb, *cb, *hnew, *cnew, *gx, *gh, *gates, *aux;
    struct cpu_carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        wr = rnnd__cpu_carve(&cv, bf16 ? P * sizeof(float) : 0);
        hb = rnnd__cpu_carve(&cv, blh_floats * sizeof(float));
        cb = rnnd__cpu_carve(&cv, lstm ? blh_floats * sizeof(float) : 0);
        hnew = rnnd__cpu_carve(&cv, blh_floats * sizeof(float));
        cnew = rnnd__cpu_carve(&cv, lstm ? blh_floats * sizeof(float) : 0);
        gx = rnnd__cpu_carve(&cv, (size_t)B * GH * sizeof(float));
        gh = rnnd__cpu_carve(&cv, (size_t)B * GH * sizeof(float));
        gates = rnnd__cpu_carve(&cv, (size_t)GH * sizeof(float));
        aux = rnnd__cpu_carve(&cv, (size_t)H * sizeof(float));
        if (pass == 0) {
            int err = rnnd__cpu_reserve(c, cv.used, bf16 ? (size_t)B * maxw : 0);
            if (err)
                return err;
            cv = (struct cpu_carve){.base = c->work};
        }
    }
    if (bf16)
        round_weights(m, params, wr);

    // Gather every row's state first, so nothing is written before everything is read.
    size_t row = (size_t)L * H;
    for (int b = 0; b < B; b++) {
        bool reset = step->is_init && step->is_init[b];
        const float *src = step->state_h + (size_t)step->slots[b] * row;
        copy_or_zero(hb + b * row, reset ? NULL : src, (int)row);
        if (lstm)
            copy_or_zero(cb + b * row, reset ? NULL : step->state_c + (size_t)step->slots[b] * row,
                         (int)row);
    }

    for (int l = 0; l < L; l++) {
        struct layer_weights w = layer_weights(m, l, params, bf16 ? wr : NULL);
        const float *xl = l == 0 ? step->x : hnew + (size_t)(l - 1) * H;
        int ldx = l == 0 ? m->I : L * H;
        rnnd__cpu_gemm(c, bf16, false, true, B, GH, w.Il, xl, ldx, true, w.w_ih, w.Il, false,
                       0.0f, gx, GH);
        rnnd__cpu_gemm(c, bf16, false, true, B, GH, H, hb + (size_t)l * H, L * H, true, w.w_hh,
                       H, false, 0.0f, gh, GH);
        for (int b = 0; b < B; b++) {
            size_t at = blh(b, l, m);
            if (lstm)
                rnnd__lstm_row_forward(H, gates, cnew + at, aux, hnew + at, gx + (size_t)b * GH,
                                       gh + (size_t)b * GH, cb + at, w.b_ih, w.b_hh);
            else
                rnnd__gru_row_forward(H, gates, aux, hnew + at, gx + (size_t)b * GH,
                                      gh + (size_t)b * GH, hb + at, w.b_ih, w.b_hh);
        }
    }

    for (int b = 0; b < B; b++) {
        memcpy(step->out + (size_t)b * H, hnew + blh(b, L - 1, m), sizeof(float) * H);
        memcpy(step->state_h + (size_t)step->slots[b] * row, hnew + b * row, sizeof(float) * row);
        if (lstm)
            memcpy(step->state_c + (size_t)step->slots[b] * row, cnew + b * row,
                   sizeof(float) * row);
    }
    if (step->h_before)
        memcpy(step->h_before, hb, blh_floats * sizeof(float));
    if (step->c_before)
        memcpy(step->c_before, cb, blh_floats * sizeof(float));
    return 0;
}
