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
 *      dW_hh += dgh^T h), bias gradients as column sums, and the input gradient
 *      dx_l = dgx W_ih (the layer below's output gradient).
 *
 * Threads. OpenBLAS runs single-threaded (backend.c); the backend splits each phase over its own
 * threads (rnnd__cpu_parallel) so that nothing synchronises inside the time loops: batch rows
 * never interact in the recurrence, so each thread owns a block of rows [b0, b1) for all T
 * steps (its own per-step sgemm over those rows, its own pointwise work); the big sgemms split
 * by rows (gx, dx) or by gate columns (weight and bias gradients). A phase ends when every
 * thread has finished it, which orders the phases. With one thread the phases run in order on
 * the caller; results do not depend on scheduling, only (in the last bits, through sgemm's
 * blocking) on the thread count.
 *
 * Internal buffers are time-major (row r = t*B + b), unlike the batch-first API tensors: a step's
 * rows are then one contiguous block, which its sgemm reads with no stride and the pointwise
 * loops stream through (batch-first rows of one step lie T*G*H floats apart, and cost a cache
 * and TLB miss each). x is transposed into that order on entry; out, grad_out and grads->x are
 * read and written batch-first in place.
 *
 * The reset rule (docs/design.md). The state row b enters step t with is, for every layer:
 *   is_init[b, t] set:       hidden[b, t] if stored states are given, else zero;
 *   t = 0 (no reset):        hidden[b, 0] if stored states are given, else h0, else zero;
 *   otherwise:               the state that row b left step t-1 with.
 * Gradients follow the same routing: into grads->hidden[b, t] for stored values, grads->h0 for
 * the initial state (h0, or the implied zero one), nowhere for a zero reset.
 *
 * bf16 compute: every matmul operand is a bf16-rounded copy (weights once per call, activations
 * and gradients as they are produced, by the thread that owns their rows); the tape, states and
 * bias sums stay fp32.
 *
 * Tape, per layer l, each an array of T*B rows in time-major order:
 *   hprev (H) state entering the step (after the reset rule)   cprev (H) the same for c, LSTM
 *   gates (G*H) activated gates                                aux (H) GRU: W_hn h + b_hn;
 *   y (H) the layer's output h, for l < L-1 only                        LSTM: tanh(c')
 * rnn_forward without a tape uses a scratch tape of the same layout, so both give the same bits.
 */
#include "cpu.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Layout helpers

struct layer_tape { // time-major: row t*B + b
    float *hprev;   // (T, B, H)
    float *cprev;   // (T, B, H) LSTM, else NULL
    float *gates;   // (T, B, G*H)
    float *aux;     // (T, B, H)
    float *y;       // (T, B, H) l < L-1, else NULL (the last layer writes `out`)
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

static void copy_or_zero(float *dst, const float *src, int n) {
    if (src)
        memcpy(dst, src, sizeof(float) * (size_t)n);
    else
        memset(dst, 0, sizeof(float) * (size_t)n);
}

// Part k of n of [0, count): [*lo, *hi).
static void split(size_t count, int k, int n, size_t *lo, size_t *hi) {
    *lo = count * (size_t)k / (size_t)n;
    *hi = count * (size_t)(k + 1) / (size_t)n;
}

// Threads worth waking for an op of `flops` matmul work over B rows: each must get at least
// ~4 MFLOP (a few hundred microseconds) to pay for its wake-up, and a row to own.
static int threads_for(const struct cpu_ctx *c, double flops, int B) {
    int n = c->nthreads;
    while (n > 1 && flops / n < 4e6)
        n--;
    return n < B ? n : B;
}

// ---------------------------------------------------------------------------------------------
// Forward

struct fwd_job {
    const struct rnnd_model *m;
    const struct rnnd_seq *seq;
    bool lstm, bf16;
    int B, T, H, GH, l;
    struct layer_weights w;
    const struct layer_tape *tp;
    const float *xl; // (T*B, I_l) this layer's input, time-major (xt for layer 0)
    float *xt;       // (T*B, I) layer 0: x transposed here by phase 1
    float *xr;       // (T*B, I_l) bf16: the rounded input
    float *gx;       // (T*B, G*H)
    float *gh;       // (B, G*H) rows [b0, b1) belong to thread k
    float *hr;       // (B, H) bf16: the step's rounded state rows
    float *cbuf;     // (B, H) LSTM: the running c
    float *out, *h_n, *c_n;
};

// Phase 1, split by rows of T*B: (layer 0) x to time-major, (bf16) rounding, gx = x_l W_ih^T.
static void fwd_project(void *arg, int k, int n) {
    struct fwd_job *j = arg;
    size_t r0, r1;
    split((size_t)j->B * j->T, k, n, &r0, &r1);
    if (r1 == r0)
        return;
    int Il = j->w.Il;
    if (j->l == 0)
        for (size_t r = r0; r < r1; r++) {
            size_t t = r / (size_t)j->B, b = r % (size_t)j->B;
            memcpy(j->xt + r * Il, j->seq->x + (b * j->T + t) * Il, sizeof(float) * Il);
        }
    const float *a = j->xl;
    if (j->bf16) {
        rnnd__cpu_round_bf16(j->xr + r0 * Il, j->xl + r0 * Il, (r1 - r0) * Il);
        a = j->xr;
    }
    rnnd__cpu_gemm(false, true, (int)(r1 - r0), j->GH, Il, a + r0 * Il, Il, j->w.w_ih, Il, 0.0f,
                   j->gx + r0 * j->GH, j->GH);
}

// Row b's output at step t: batch-first in out for the last layer, else time-major in the tape.
static float *y_row(const struct fwd_job *j, int b, int t) {
    if (j->l == j->m->L - 1)
        return j->out + ((size_t)b * j->T + t) * j->H;
    return j->tp->y + ((size_t)t * j->B + b) * j->H;
}

// Phase 2, split by batch rows: the time loop for rows [b0, b1).
static void fwd_steps(void *arg, int k, int n) {
    struct fwd_job *j = arg;
    const struct rnnd_model *m = j->m;
    const struct rnnd_seq *seq = j->seq;
    const struct layer_tape *tp = j->tp;
    int B = j->B, T = j->T, H = j->H, GH = j->GH, l = j->l;
    bool lstm = j->lstm;
    size_t b0, b1;
    split((size_t)B, k, n, &b0, &b1);
    int nb = (int)(b1 - b0);
    if (nb == 0)
        return;

    for (int t = 0; t < T; t++) {
        size_t r0 = (size_t)t * B + b0; // this thread's first row of step t
        for (int b = (int)b0; b < (int)b1; b++) {
            size_t r = (size_t)t * B + b;
            float *hp = tp->hprev + r * H, *cp = lstm ? tp->cprev + r * H : NULL;
            switch (state_source(seq, b, t)) {
                case SRC_CARRY:
                    memcpy(hp, y_row(j, b, t - 1), sizeof(float) * H);
                    if (lstm)
                        memcpy(cp, j->cbuf + (size_t)b * H, sizeof(float) * H);
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
        // gh = h W_hh^T over this thread's rows of step t.
        const float *a = tp->hprev + r0 * H;
        if (j->bf16) {
            rnnd__cpu_round_bf16(j->hr + b0 * H, a, (size_t)nb * H);
            a = j->hr + b0 * H;
        }
        float *gh = j->gh + b0 * GH;
        rnnd__cpu_gemm(false, true, nb, GH, H, a, H, j->w.w_hh, H, 0.0f, gh, GH);
        for (int b = (int)b0; b < (int)b1; b++) {
            size_t r = (size_t)t * B + b;
            const float *ghb = j->gh + (size_t)b * GH;
            if (lstm)
                rnnd__lstm_row_forward(H, tp->gates + r * GH, j->cbuf + (size_t)b * H,
                                       tp->aux + r * H, y_row(j, b, t), j->gx + r * GH, ghb,
                                       tp->cprev + r * H, j->w.b_ih, j->w.b_hh);
            else
                rnnd__gru_row_forward(H, tp->gates + r * GH, tp->aux + r * H, y_row(j, b, t),
                                      j->gx + r * GH, ghb, tp->hprev + r * H, j->w.b_ih, j->w.b_hh);
        }
    }
    for (int b = (int)b0; b < (int)b1; b++) {
        if (j->h_n)
            memcpy(j->h_n + blh(b, l, m), y_row(j, b, T - 1), sizeof(float) * H);
        if (j->c_n)
            memcpy(j->c_n + blh(b, l, m), j->cbuf + (size_t)b * H, sizeof(float) * H);
    }
}

// Matmul flops of one forward; a backward does about twice as many.
static double forward_flops(const struct rnnd_model *m, int B, int T) {
    double f = 0.0;
    for (int l = 0; l < m->L; l++)
        f += 2.0 * B * T * rnnd_model_gates(m) * m->H * (rnnd_model_layer_input(m, l) + m->H);
    return f;
}

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
    size_t maxw = (size_t)(m->I > H ? m->I : H);

    // Scratch: rounded weights and inputs (bf16), x time-major, gx, gh, the running c (LSTM),
    // and a tape if none was given.
    float *wr, *xr, *hr, *xt, *gx, *gh, *cbuf, *own_tape;
    struct cpu_carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        wr = rnnd__cpu_carve(&cv, bf16 ? P * sizeof(float) : 0);
        xr = rnnd__cpu_carve(&cv, bf16 ? BT * maxw * sizeof(float) : 0);
        hr = rnnd__cpu_carve(&cv, bf16 ? (size_t)B * H * sizeof(float) : 0);
        xt = rnnd__cpu_carve(&cv, BT * m->I * sizeof(float));
        gx = rnnd__cpu_carve(&cv, BT * GH * sizeof(float));
        gh = rnnd__cpu_carve(&cv, (size_t)B * GH * sizeof(float));
        cbuf = rnnd__cpu_carve(&cv, lstm ? (size_t)B * H * sizeof(float) : 0);
        own_tape = rnnd__cpu_carve(&cv, tape ? 0 : rnnd__cpu_tape_bytes(m, B, T));
        if (pass == 0) {
            int err = rnnd__cpu_reserve(c, cv.used);
            if (err)
                return err;
            cv = (struct cpu_carve){.base = c->work};
        }
    }
    struct layer_tape lt[RNND_MAX_LAYERS];
    tape_layout(m, B, T, tape ? (float *)tape : own_tape, lt);
    if (bf16)
        round_weights(m, params, wr);

    int nt = threads_for(c, forward_flops(m, B, T), B);
    struct fwd_job j = {
        .m = m,
        .seq = seq,
        .lstm = lstm,
        .bf16 = bf16,
        .B = B,
        .T = T,
        .H = H,
        .GH = GH,
        .xt = xt,
        .xr = xr,
        .gx = gx,
        .gh = gh,
        .hr = hr,
        .cbuf = cbuf,
        .out = out,
        .h_n = h_n,
        .c_n = c_n,
    };
    for (int l = 0; l < L; l++) {
        j.l = l;
        j.w = layer_weights(m, l, params, bf16 ? wr : NULL);
        j.tp = &lt[l];
        j.xl = l == 0 ? xt : lt[l - 1].y;
        rnnd__cpu_parallel(c, nt, fwd_project, &j);
        rnnd__cpu_parallel(c, nt, fwd_steps, &j);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Backward

struct bwd_job {
    const struct rnnd_model *m;
    const struct rnnd_seq *seq;
    const struct rnnd_seq_grads *grads;
    const float *grad_out, *grad_h_n, *grad_c_n;
    bool lstm, bf16;
    int B, T, H, GH, l;
    struct layer_weights w;
    const struct layer_tape *tp;
    const float *xl; // (T*B, I_l) this layer's input, time-major (xt for layer 0)
    float *xt;       // (T*B, I) layer 0: x transposed by phase 1
    float *dgx;      // (T*B, G*H) gradient of W_ih x + b_ih
    float *dgh;      // (T*B, G*H) gradient of W_hh h + b_hh (the same array as dgx for LSTM)
    float *dgxr, *dghr, *xr, *hpr; // bf16: rounded dgx, dgh, x_l, hprev (same shapes)
    float *dyb;           // (T*B, H) the output gradient of a layer below the top (time-major)
    float *dxt;           // (T*B, I) layer 0's input gradient, time-major
    float *dh, *dhp, *dc; // (B, H) carried dh, the step's dL/dh, carried dc (LSTM)
    double *acc;          // (G*H) bias column sums
    float *part;          // (G*H)
};

// Row b's output gradient at step t: batch-first grad_out for the top layer, else the
// time-major gradient the layer above passed down.
static const float *dy_row(const struct bwd_job *j, int b, int t) {
    if (j->l == j->m->L - 1)
        return j->grad_out + ((size_t)b * j->T + t) * j->H;
    return j->dyb + ((size_t)t * j->B + b) * j->H;
}

// Phase 1, split by batch rows: the time loop from T-1 down to 0 for rows [b0, b1); then (bf16)
// the rounded copies of this thread's rows of the layer's input and states for phase 2.
static void bwd_steps(void *arg, int k, int n) {
    struct bwd_job *j = arg;
    const struct rnnd_model *m = j->m;
    const struct rnnd_seq *seq = j->seq;
    const struct rnnd_seq_grads *grads = j->grads;
    const struct layer_tape *tp = j->tp;
    int B = j->B, T = j->T, H = j->H, GH = j->GH, l = j->l, Il = j->w.Il;
    bool lstm = j->lstm;
    size_t b0, b1;
    split((size_t)B, k, n, &b0, &b1);
    int nb = (int)(b1 - b0);
    if (nb == 0)
        return;

    float *dh = j->dh, *dhp = j->dhp, *dc = j->dc;
    for (int b = (int)b0; b < (int)b1; b++) {
        copy_or_zero(dh + (size_t)b * H, j->grad_h_n ? j->grad_h_n + blh(b, l, m) : NULL, H);
        if (lstm)
            copy_or_zero(dc + (size_t)b * H, j->grad_c_n ? j->grad_c_n + blh(b, l, m) : NULL, H);
    }
    for (int t = T - 1; t >= 0; t--) {
        size_t r0 = (size_t)t * B + b0;
        for (int b = (int)b0; b < (int)b1; b++) {
            size_t r = (size_t)t * B + b;
            if (lstm)
                rnnd__lstm_row_backward(H, j->dgx + r * GH, dc + (size_t)b * H, dy_row(j, b, t),
                                        dh + (size_t)b * H, tp->gates + r * GH, tp->aux + r * H,
                                        tp->cprev + r * H);
            else
                rnnd__gru_row_backward(H, j->dgx + r * GH, j->dgh + r * GH, dhp + (size_t)b * H,
                                       dy_row(j, b, t), dh + (size_t)b * H, tp->gates + r * GH,
                                       tp->aux + r * H, tp->hprev + r * H);
        }
        // dL/dh of the state entering step t: (GRU: z dh' +) dgh W_hh.
        const float *a = j->dgh + r0 * GH;
        if (j->bf16) {
            rnnd__cpu_round_bf16(j->dghr + r0 * GH, a, (size_t)nb * GH);
            if (!lstm)
                rnnd__cpu_round_bf16(j->dgxr + r0 * GH, j->dgx + r0 * GH, (size_t)nb * GH);
            a = j->dghr + r0 * GH;
        }
        rnnd__cpu_gemm(false, false, nb, H, GH, a, GH, j->w.w_hh, H, lstm ? 0.0f : 1.0f,
                       dhp + b0 * H, H);
        for (int b = (int)b0; b < (int)b1; b++) {
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

    // Layer 0's input, time-major, for this thread's rows; (bf16) rounded inputs and states.
    for (int t = 0; t < T; t++) {
        size_t r0 = (size_t)t * B + b0;
        if (l == 0)
            for (int b = (int)b0; b < (int)b1; b++)
                memcpy(j->xt + ((size_t)t * B + b) * Il, seq->x + ((size_t)b * T + t) * Il,
                       sizeof(float) * Il);
        if (j->bf16) {
            rnnd__cpu_round_bf16(j->xr + r0 * Il, j->xl + r0 * Il, (size_t)nb * Il);
            rnnd__cpu_round_bf16(j->hpr + r0 * H, tp->hprev + r0 * H, (size_t)nb * H);
        }
    }
}

// Phase 2: parameter gradients for gate columns [g0, g1) over every step and row, and the
// input gradient for rows [r0, r1) of T*B.
static void bwd_params(void *arg, int k, int n) {
    struct bwd_job *j = arg;
    const struct rnnd_seq_grads *grads = j->grads;
    int B = j->B, T = j->T, H = j->H, GH = j->GH, Il = j->w.Il;
    size_t BT = (size_t)B * T, g0, g1, r0, r1;
    split((size_t)GH, k, n, &g0, &g1);
    split(BT, k, n, &r0, &r1);
    const float *dgx = j->bf16 ? j->dgxr : j->dgx, *dgh = j->bf16 ? j->dghr : j->dgh;
    const float *xl = j->bf16 ? j->xr : j->xl, *hp = j->bf16 ? j->hpr : j->tp->hprev;

    // Accumulated (+=) into grads->params: the weight rows and bias entries of columns g0..g1.
    struct layer_weights gw = layer_weights(j->m, j->l, grads->params, NULL);
    int ng = (int)(g1 - g0);
    if (ng > 0) {
        rnnd__cpu_gemm(true, false, ng, Il, (int)BT, dgx + g0, GH, xl, Il, 1.0f,
                       (float *)gw.w_ih + g0 * Il, Il);
        rnnd__cpu_gemm(true, false, ng, H, (int)BT, dgh + g0, GH, hp, H, 1.0f,
                       (float *)gw.w_hh + g0 * H, H);
        rnnd__cpu_add_colsum((float *)gw.b_ih + g0, j->dgx + g0, BT, ng, GH, j->acc + g0,
                             j->part + g0);
        if (j->lstm) // the same sums: both biases enter the same pre-activation
            for (size_t g = g0; g < g1; g++)
                ((float *)gw.b_hh)[g] += (float)j->acc[g];
        else
            rnnd__cpu_add_colsum((float *)gw.b_hh + g0, j->dgh + g0, BT, ng, GH, j->acc + g0,
                                 j->part + g0);
    }

    // The input gradient dx = dgx W_ih: the layer below's output gradient (time-major), or
    // grads->x (batch-first, through dxt).
    if (r1 == r0 || (j->l == 0 && grads->x == NULL))
        return;
    float *dx = j->l > 0 ? j->dyb : j->dxt;
    rnnd__cpu_gemm(false, false, (int)(r1 - r0), Il, GH, dgx + r0 * GH, GH, j->w.w_ih, Il, 0.0f,
                   dx + r0 * Il, Il);
    if (j->l == 0)
        for (size_t r = r0; r < r1; r++) {
            size_t t = r / (size_t)B, b = r % (size_t)B;
            memcpy(grads->x + (b * T + t) * Il, dx + r * Il, sizeof(float) * Il);
        }
}

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
    size_t maxw = (size_t)(m->I > H ? m->I : H), fsz = sizeof(float);

    // Scratch: see struct bwd_job.
    struct bwd_job j = {
        .m = m,
        .seq = seq,
        .grads = grads,
        .grad_out = grad_out,
        .grad_h_n = grad_h_n,
        .grad_c_n = grad_c_n,
        .lstm = lstm,
        .bf16 = bf16,
        .B = B,
        .T = T,
        .H = H,
        .GH = GH,
    };
    float *wr;
    struct cpu_carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        wr = rnnd__cpu_carve(&cv, bf16 ? P * fsz : 0);
        j.dgxr = rnnd__cpu_carve(&cv, bf16 ? BT * GH * fsz : 0);
        j.dghr = rnnd__cpu_carve(&cv, bf16 && !lstm ? BT * GH * fsz : 0);
        j.xr = rnnd__cpu_carve(&cv, bf16 ? BT * maxw * fsz : 0);
        j.hpr = rnnd__cpu_carve(&cv, bf16 ? BT * H * fsz : 0);
        j.xt = rnnd__cpu_carve(&cv, BT * m->I * fsz);
        j.dxt = rnnd__cpu_carve(&cv, grads->x ? BT * m->I * fsz : 0);
        j.dgx = rnnd__cpu_carve(&cv, BT * GH * fsz);
        j.dgh = rnnd__cpu_carve(&cv, lstm ? 0 : BT * GH * fsz);
        j.dyb = rnnd__cpu_carve(&cv, L > 1 ? BT * H * fsz : 0);
        j.dh = rnnd__cpu_carve(&cv, (size_t)B * H * fsz);
        j.dhp = rnnd__cpu_carve(&cv, (size_t)B * H * fsz);
        j.dc = rnnd__cpu_carve(&cv, lstm ? (size_t)B * H * fsz : 0);
        j.acc = rnnd__cpu_carve(&cv, (size_t)GH * sizeof(double));
        j.part = rnnd__cpu_carve(&cv, (size_t)GH * fsz);
        if (pass == 0) {
            int err = rnnd__cpu_reserve(c, cv.used);
            if (err)
                return err;
            cv = (struct cpu_carve){.base = c->work};
        }
    }
    if (lstm) { // one gradient serves both pre-activation sums
        j.dgh = j.dgx;
        j.dghr = j.dgxr;
    }
    struct layer_tape lt[RNND_MAX_LAYERS];
    tape_layout(m, B, T, (float *)tape, lt);
    if (bf16)
        round_weights(m, params, wr);

    // Outputs that are written only where a value was used start at zero.
    size_t blh_bytes = (size_t)B * L * H * fsz;
    if (grads->h0)
        memset(grads->h0, 0, blh_bytes);
    if (grads->c0)
        memset(grads->c0, 0, blh_bytes);
    if (grads->hidden)
        memset(grads->hidden, 0, blh_bytes * T);
    if (grads->cell)
        memset(grads->cell, 0, blh_bytes * T);

    int nt = threads_for(c, 2.0 * forward_flops(m, B, T), B);
    for (int l = L - 1; l >= 0; l--) {
        j.l = l;
        j.w = layer_weights(m, l, params, bf16 ? wr : NULL);
        j.tp = &lt[l];
        j.xl = l == 0 ? j.xt : lt[l - 1].y;
        rnnd__cpu_parallel(c, nt, bwd_steps, &j);
        rnnd__cpu_parallel(c, nt, bwd_params, &j);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Single step (the inference path)

struct step_job {
    const struct rnnd_model *m;
    const struct rnnd_step *step;
    const float *params, *wr;
    bool lstm, bf16;
    float *hb, *cb, *hnew, *cnew; // (B, L, H) states before and after
    float *gx, *gh;               // (B, G*H)
    float *xr;                    // (B, max(I, H)) bf16: rounded matmul operand
    float *gates, *aux;           // (n, G*H), (n, H): thread k's row scratch (not kept)
};

// Rows [b0, b1) through every layer.
static void step_rows(void *arg, int k, int n) {
    struct step_job *j = arg;
    const struct rnnd_model *m = j->m;
    const struct rnnd_step *st = j->step;
    int H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t b0, b1, row = (size_t)L * H;
    split((size_t)st->B, k, n, &b0, &b1);
    int nb = (int)(b1 - b0);
    if (nb == 0)
        return;
    float *gates = j->gates + (size_t)k * GH, *aux = j->aux + (size_t)k * H;
    for (int l = 0; l < L; l++) {
        struct layer_weights w = layer_weights(m, l, j->params, j->wr);
        // This layer's input rows and state rows (ld: the distance between rows).
        const float *x = l == 0 ? st->x + b0 * m->I : j->hnew + b0 * row + (size_t)(l - 1) * H;
        int ldx = l == 0 ? m->I : L * H;
        const float *h = j->hb + b0 * row + (size_t)l * H;
        int ldh = L * H;
        float *xr = j->xr + b0 * (size_t)(m->I > H ? m->I : H);
        if (j->bf16) {
            for (int b = 0; b < nb; b++)
                rnnd__cpu_round_bf16(xr + (size_t)b * w.Il, x + (size_t)b * ldx, (size_t)w.Il);
            x = xr;
            ldx = w.Il;
        }
        rnnd__cpu_gemm(false, true, nb, GH, w.Il, x, ldx, w.w_ih, w.Il, 0.0f, j->gx + b0 * GH, GH);
        if (j->bf16) {
            for (int b = 0; b < nb; b++)
                rnnd__cpu_round_bf16(xr + (size_t)b * H, h + (size_t)b * ldh, (size_t)H);
            h = xr;
            ldh = H;
        }
        rnnd__cpu_gemm(false, true, nb, GH, H, h, ldh, w.w_hh, H, 0.0f, j->gh + b0 * GH, GH);
        for (int b = (int)b0; b < (int)b1; b++) {
            size_t at = blh(b, l, m);
            const float *gxb = j->gx + (size_t)b * GH, *ghb = j->gh + (size_t)b * GH;
            if (j->lstm)
                rnnd__lstm_row_forward(H, gates, j->cnew + at, aux, j->hnew + at, gxb, ghb,
                                       j->cb + at, w.b_ih, w.b_hh);
            else
                rnnd__gru_row_forward(H, gates, aux, j->hnew + at, gxb, ghb, j->hb + at, w.b_ih,
                                      w.b_hh);
        }
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

// The step's 2B table rows (slots, then slots_new) are all >= 0 and distinct (struct rnnd_step);
// rows is scratch for 2B of them.
static bool step_rows_ok(const struct rnnd_step *step, int32_t *rows) {
    size_t n = 2 * (size_t)step->B;
    memcpy(rows, step->slots, (size_t)step->B * sizeof(int32_t));
    memcpy(rows + step->B, step->slots_new, (size_t)step->B * sizeof(int32_t));
    qsort(rows, n, sizeof(int32_t), cmp_i32);
    if (rows[0] < 0)
        return false;
    for (size_t i = 1; i < n; i++)
        if (rows[i] == rows[i - 1])
            return false;
    return true;
}

int rnnd__cpu_rnn_step(struct cpu_ctx *c, const struct rnnd_step *step, const float *params,
                       const struct rnnd_model *m) {
    if (c == NULL || rnnd_step_check(step, m) != 0 || params == NULL || !dims_fit_int(m))
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM, bf16 = m->compute == RNND_COMPUTE_BF16;
    int B = step->B, H = m->H, L = m->L, GH = rnnd_model_gates(m) * H;
    size_t P = rnnd_model_param_count(m), row = (size_t)L * H, fsz = sizeof(float);
    size_t maxw = (size_t)(m->I > H ? m->I : H);
    int nt = threads_for(c, forward_flops(m, B, 1), B);

    struct step_job j = {.m = m, .step = step, .params = params, .lstm = lstm, .bf16 = bf16};
    float *wr;
    int32_t *rows;
    struct cpu_carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        rows = rnnd__cpu_carve(&cv, 2 * (size_t)B * sizeof(int32_t));
        wr = rnnd__cpu_carve(&cv, bf16 ? P * fsz : 0);
        j.xr = rnnd__cpu_carve(&cv, bf16 ? (size_t)B * maxw * fsz : 0);
        j.hb = rnnd__cpu_carve(&cv, (size_t)B * row * fsz);
        j.cb = rnnd__cpu_carve(&cv, lstm ? (size_t)B * row * fsz : 0);
        j.hnew = rnnd__cpu_carve(&cv, (size_t)B * row * fsz);
        j.cnew = rnnd__cpu_carve(&cv, lstm ? (size_t)B * row * fsz : 0);
        j.gx = rnnd__cpu_carve(&cv, (size_t)B * GH * fsz);
        j.gh = rnnd__cpu_carve(&cv, (size_t)B * GH * fsz);
        j.gates = rnnd__cpu_carve(&cv, (size_t)nt * GH * fsz);
        j.aux = rnnd__cpu_carve(&cv, (size_t)nt * H * fsz);
        if (pass == 0) {
            int err = rnnd__cpu_reserve(c, cv.used);
            if (err)
                return err;
            cv = (struct cpu_carve){.base = c->work};
        }
    }
    if (!step_rows_ok(step, rows)) // before anything is written
        return RNND_EINVAL;
    if (bf16)
        round_weights(m, params, wr);
    j.wr = bf16 ? wr : NULL;

    // Gather every row's state (after the reset rule) for the layers and h_before.
    for (int b = 0; b < B; b++) {
        bool reset = step->is_init && step->is_init[b];
        size_t s = (size_t)step->slots[b] * row;
        copy_or_zero(j.hb + b * row, reset ? NULL : step->state_h + s, (int)row);
        if (lstm)
            copy_or_zero(j.cb + b * row, reset ? NULL : step->state_c + s, (int)row);
    }
    rnnd__cpu_parallel(c, nt, step_rows, &j);
    for (int b = 0; b < B; b++) {
        size_t s = (size_t)step->slots_new[b] * row;
        memcpy(step->out + (size_t)b * H, j.hnew + blh(b, L - 1, m), fsz * H);
        memcpy(step->state_h + s, j.hnew + b * row, fsz * row);
        if (lstm)
            memcpy(step->state_c + s, j.cnew + b * row, fsz * row);
    }
    if (step->h_before)
        memcpy(step->h_before, j.hb, (size_t)B * row * fsz);
    if (step->c_before)
        memcpy(step->c_before, j.cb, (size_t)B * row * fsz);
    return 0;
}
