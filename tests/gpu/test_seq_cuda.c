/*
 * test_seq_cuda.c: the CUDA backend's sequence forward and backward (rnn_forward with and
 * without a tape, rnn_backward; kernels/cuda/seq.cu and the kernels its plan names) against the
 * CPU reference, through the same vtable (gpu_check.h has the method). Two case tables:
 * seq_cases, each run by test_seq (every output and gradient of a forward and a backward against
 * the reference, and the forward without a tape bitwise equal to the one with), and edge_tests,
 * each a test of its own on one case: NaN and tiny values, saturated gates over long sequences,
 * weight and x outliers, the chunk products' scales, tape formats and bitwise equality of
 * kernels that sum the same products (variant bits: kernels/cuda/tuning.h).
 *
 *   test_seq_cuda [--quick]    --quick: a few small cases (for compute-sanitizer runs)
 */
#include "gpu_check.h"

#include "cuda_backend.h"
#include "tuning.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int NO_FUSED_X = RNND_TUNE_NO_FUSED_X, NO_WG = RNND_TUNE_NO_WG,
                 NO_DW16 = RNND_TUNE_NO_DW16, NO_ZFWD = RNND_TUNE_NO_ZFWD,
                 NO_PAD128 = RNND_TUNE_NO_PAD128, DW_M4 = RNND_TUNE_DW_M4,
                 DW_MLDZ = RNND_TUNE_DW_MLDZ, DW_MSPLIT = RNND_TUNE_DW_MSPLIT;

enum state_mode { STATE_NONE, STATE_H0, STATE_HIDDEN };

struct seq_case {
    enum rnnd_cell cell;
    enum rnnd_compute compute;
    int I, H, L, B, T;
    double reset_prob;
    enum state_mode state;
    int path;     // RNND_CUDA_PATH_*
    unsigned how; // SEQ_* below (0: none)
};

// How test_seq runs a case: a repeat run must be bitwise identical; states uniform in +-12
// instead of +-0.8; biases uniform in +-40; outputs and gradients one float past 16-byte
// alignment; no dL/dx asked for.
#define SEQ_REPEAT    1u
#define SEQ_WIDE      2u
#define SEQ_SATURATED 4u
#define SEQ_MISALIGN  8u
#define SEQ_NO_GX     16u

struct seq_host {
    float *params, *x, *h0, *c0, *hidden, *cell, *gout, *ghn, *gcn, *gbase;
    uint8_t *is_init;
};

struct seq_out {
    float *out, *hn, *cn, *gp, *gx, *gh0, *gc0, *ghid, *gcell, *out_notape;
    unsigned char tape0[8192]; // the tape's first bytes (layer 0's z space) after the forward
    size_t ntape0;
};

// Element counts of case sc: parameters, x and out (B, T, I or H), a state (B, L, H), a
// sequence of states (B, T, L, H).
struct seq_sizes {
    size_t P, nx, nout, blh, btlh;
};
static struct seq_sizes seq_sizes_of(const struct seq_case *sc) {
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    size_t BT = (size_t)sc->B * sc->T, LH = (size_t)sc->L * sc->H;
    return (struct seq_sizes){rnnd_model_param_count(&m), BT * sc->I, BT * sc->H,
                              (size_t)sc->B * LH, BT * LH};
}

static void seq_out_alloc(struct seq_out *o, const struct seq_sizes *z) {
    o->out = xmalloc(z->nout * 4), o->out_notape = xmalloc(z->nout * 4);
    o->hn = xmalloc(z->blh * 4), o->cn = xmalloc(z->blh * 4);
    o->gp = xmalloc(z->P * 4), o->gx = xmalloc(z->nx * 4);
    o->gh0 = xmalloc(z->blh * 4), o->gc0 = xmalloc(z->blh * 4);
    o->ghid = xmalloc(z->btlh * 4), o->gcell = xmalloc(z->btlh * 4);
}

static void seq_out_free(struct seq_out *o) {
    free(o->out), free(o->out_notape), free(o->hn), free(o->cn), free(o->gp), free(o->gx);
    free(o->gh0), free(o->gc0), free(o->ghid), free(o->gcell);
}

// Random inputs of case sc: h0, c0, hidden and cell uniform in +-state_scale; with bias_scale > 0
// the biases are redrawn uniform in +-bias_scale.
static void seq_host_init(struct seq_host *h, const struct seq_case *sc, float bias_scale,
                          float state_scale) {
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    size_t P = rnnd_model_param_count(&m), BT = (size_t)sc->B * sc->T;
    size_t blh = (size_t)sc->B * sc->L * sc->H, btlh = BT * sc->L * sc->H;
    h->params = xmalloc(P * 4);
    rnnd_model_init_params(&m, rng_next(), h->params);
    for (int k = 0; bias_scale > 0.0f && k < rnnd_model_param_tensors(&m); k++) {
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(&m, k, &pt);
        if (k % 4 == RNND_PARAM_BIAS_IH || k % 4 == RNND_PARAM_BIAS_HH)
            for (size_t i = 0; i < pt.count; i++)
                h->params[pt.offset + i] = (float)((2.0 * rng_uniform() - 1.0) * bias_scale);
    }
    h->x = host_uniform(BT * sc->I, 1.0f);
    h->h0 = host_uniform(blh, state_scale), h->c0 = host_uniform(blh, state_scale);
    h->hidden = host_uniform(btlh, state_scale), h->cell = host_uniform(btlh, state_scale);
    h->gout = host_uniform(BT * sc->H, 1.0f), h->ghn = host_uniform(blh, 1.0f);
    h->gcn = host_uniform(blh, 1.0f), h->gbase = host_uniform(P, 1.0f);
    h->is_init = xmalloc(BT);
    for (size_t i = 0; i < BT; i++)
        h->is_init[i] = rng_uniform() < sc->reset_prob;
}

static void seq_host_free(struct seq_host *h) {
    free(h->params), free(h->x), free(h->h0), free(h->c0), free(h->hidden), free(h->cell);
    free(h->gout), free(h->ghn), free(h->gcn), free(h->gbase), free(h->is_init);
}

// Runs forward (with and without tape) and backward of case sc on be; results to o.
static int run_seq_on(struct rnnd_backend *be, const struct seq_case *sc, const struct seq_host *h,
                      struct seq_out *o, bool poison) {
    const bool no_gx = (sc->how & SEQ_NO_GX) != 0;
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    bool lstm = sc->cell == RNND_CELL_LSTM;
    size_t P = rnnd_model_param_count(&m), BT = (size_t)sc->B * sc->T;
    size_t nx = BT * sc->I, nout = BT * sc->H, blh = (size_t)sc->B * sc->L * sc->H;
    size_t btlh = BT * sc->L * sc->H;
    struct bufs b = {.be = be};
    const struct rnnd_backend_ops *ops = be->ops;

    struct rnnd_seq seq = {.B = sc->B, .T = sc->T};
    seq.x = dev(&b, h->x, nx * 4);
    seq.is_init = dev(&b, h->is_init, BT);
    if (sc->state == STATE_H0) {
        seq.h0 = dev(&b, h->h0, blh * 4);
        if (lstm)
            seq.c0 = dev(&b, h->c0, blh * 4);
    } else if (sc->state == STATE_HIDDEN) {
        seq.hidden = dev(&b, h->hidden, btlh * 4);
        if (lstm)
            seq.cell = dev(&b, h->cell, btlh * 4);
    }
    float *params = dev(&b, h->params, P * 4);
    float *out = dev_poison(&b, nout, poison), *out2 = dev_poison(&b, nout, poison);
    float *hn = dev_poison(&b, blh, poison);
    float *cn = lstm ? dev_poison(&b, blh, poison) : NULL;
    const size_t ntape = ops->tape_bytes(be->ctx, &m, sc->B, sc->T);
    void *tape = dev(&b, NULL, ntape);
    int err = ops->zero(be->ctx, tape, ntape); // bytes the forward leaves compare equal
    if (!err)
        err = ops->rnn_forward(be->ctx, out2, NULL, NULL, NULL, &seq, params, &m);
    if (!err)
        err = ops->rnn_forward(be->ctx, out, hn, cn, tape, &seq, params, &m);
    o->ntape0 = ntape < sizeof(o->tape0) ? ntape : sizeof(o->tape0);
    if (!err)
        err = ops->copy_out(be->ctx, o->tape0, tape, o->ntape0);
    if (err) {
        bufs_free(&b);
        return err;
    }

    struct rnnd_seq_grads g = {0};
    g.params = dev(&b, h->gbase, P * 4);
    g.x = no_gx ? NULL : dev_poison(&b, nx, poison);
    if (sc->state != STATE_HIDDEN) {
        g.h0 = dev_poison(&b, blh, poison);
        if (lstm)
            g.c0 = dev_poison(&b, blh, poison);
    } else {
        g.hidden = dev_poison(&b, btlh, poison);
        if (lstm)
            g.cell = dev_poison(&b, btlh, poison);
    }
    float *gout = dev_in(&b, h->gout, nout), *ghn = dev_in(&b, h->ghn, blh);
    float *gcn = lstm ? dev_in(&b, h->gcn, blh) : NULL;
    err = ops->rnn_backward(be->ctx, &g, gout, ghn, gcn, tape, &seq, params, &m);
    if (err) {
        bufs_free(&b);
        return err;
    }
    to_host(be, o->out, out, nout);
    to_host(be, o->out_notape, out2, nout);
    to_host(be, o->hn, hn, blh);
    if (lstm)
        to_host(be, o->cn, cn, blh);
    to_host(be, o->gp, g.params, P);
    if (g.x)
        to_host(be, o->gx, g.x, nx);
    if (g.h0)
        to_host(be, o->gh0, g.h0, blh);
    if (g.c0)
        to_host(be, o->gc0, g.c0, blh);
    if (g.hidden)
        to_host(be, o->ghid, g.hidden, btlh);
    if (g.cell)
        to_host(be, o->gcell, g.cell, btlh);
    bufs_free(&b);
    return 0;
}

// run_seq_on with misalign set as sc says.
static int run_seq(struct rnnd_backend *be, const struct seq_case *sc, const struct seq_host *h,
                   struct seq_out *o, bool poison) {
    misalign = (sc->how & SEQ_MISALIGN) != 0;
    int err = run_seq_on(be, sc, h, o, poison);
    misalign = false;
    return err;
}

// Case sc on gpu against cpu, on seq_host_init's inputs.
static void test_seq(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                     const struct seq_case *sc) {
    const bool check_determinism = sc->how & SEQ_REPEAT, no_gx = sc->how & SEQ_NO_GX;
    const float bias_scale = sc->how & SEQ_SATURATED ? 40.0f : 0.0f;
    const float state_scale = sc->how & SEQ_WIDE ? 12.0f : 0.8f;
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    bool lstm = sc->cell == RNND_CELL_LSTM;
    const struct seq_sizes z = seq_sizes_of(sc);
    const size_t P = z.P, nx = z.nx, nout = z.nout, blh = z.blh, btlh = z.btlh;
    char tag[96];
    snprintf(tag, sizeof(tag), "%s %s I%d H%d L%d B%d T%d p%.2g %s%s%s%s%s%s",
             lstm ? "lstm" : "gru", compute_name(sc->compute), sc->I, sc->H, sc->L, sc->B, sc->T,
             sc->reset_prob,
             sc->state == STATE_H0       ? "h0"
             : sc->state == STATE_HIDDEN ? "hid"
                                         : "-",
             sc->path == RNND_CUDA_PATH_STEPWISE ? " step" : "", sc->how & SEQ_WIDE ? " wide" : "",
             sc->how & SEQ_SATURATED ? " sat" : "", sc->how & SEQ_MISALIGN ? " misal" : "",
             sc->how & SEQ_NO_GX ? " nogx" : "");

    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, sc, bias_scale, state_scale);

    rnnd_cuda_set_path(gpu, sc->path);
    int path = rnnd_cuda_path_of(gpu, &m);
    struct seq_out og, oc;
    seq_out_alloc(&og, &z);
    seq_out_alloc(&oc, &z);
    int err = run_seq(gpu, sc, &h, &og, true);
    int err2 = run_seq(cpu, sc, &h, &oc, false);
    printf("%s [%s]\n", tag, path == RNND_CUDA_PATH_PERSISTENT ? "persistent" : "stepwise");
    if (err || err2) {
        fail("%s: cuda %s, cpu %s", tag, rnnd_err_name(err), rnnd_err_name(err2));
    } else {
        double tol = tolerance(sc->compute);
        // States at 12x (wide) saturate most gates, and TF32's rounding of their inputs alone
        // puts the gradients at 0.8-1.1e-3 of the reference, on the stepwise path's cuBLAS
        // products as on the fused loops (H200, 2026-11-28, per-case seeds): those cases are
        // held to 1.5e-3 in fp32 mode, every other bound is the contract's.
        if ((sc->how & SEQ_WIDE) && sc->compute == RNND_COMPUTE_FP32)
            tol = 1.5e-3;
        compare("out", tag, og.out, oc.out, NULL, nout, tol);
        // The forward without a tape: the same loop, or another one with the same products
        // summed in the same order (bitwise; test_wg_kp compares the two GRU loops).
        compare("out(no tape)", tag, og.out_notape, og.out, NULL, nout, 1e-7);
        compare("h_n", tag, og.hn, oc.hn, NULL, blh, tol);
        if (lstm)
            compare("c_n", tag, og.cn, oc.cn, NULL, blh, tol);
        compare("grad params", tag, og.gp, oc.gp, h.gbase, P, tol);
        if (!no_gx)
            compare("grad x", tag, og.gx, oc.gx, NULL, nx, tol);
        if (sc->state != STATE_HIDDEN) {
            compare("grad h0", tag, og.gh0, oc.gh0, NULL, blh, tol);
            if (lstm)
                compare("grad c0", tag, og.gc0, oc.gc0, NULL, blh, tol);
        } else {
            compare("grad hidden", tag, og.ghid, oc.ghid, NULL, btlh, tol);
            if (lstm)
                compare("grad cell", tag, og.gcell, oc.gcell, NULL, btlh, tol);
        }
        if (check_determinism) {
            struct seq_out o2;
            seq_out_alloc(&o2, &z);
            if (run_seq(gpu, sc, &h, &o2, true) == 0) {
                bool same = memcmp(o2.gp, og.gp, P * 4) == 0 && memcmp(o2.gx, og.gx, nx * 4) == 0 &&
                            memcmp(o2.out, og.out, nout * 4) == 0;
                check(same, "%-34s repeat run bitwise identical", tag);
            }
            seq_out_free(&o2);
        }
    }
    rnnd_cuda_set_path(gpu, RNND_CUDA_PATH_AUTO);
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
}

// A NaN in x reaches exactly the outputs that depend on it, as in the CPU reference (the FAST
// cells' SFU tanh keeps a NaN a NaN), and the other outputs match it.
static void test_nan(struct rnnd_backend *gpu, struct rnnd_backend *cpu, const struct seq_case *c,
                     int arg) {
    (void)arg;
    const struct seq_case sc = *c;
    const struct seq_sizes z = seq_sizes_of(&sc);
    const char *tag = sc.cell == RNND_CELL_LSTM ? "lstm fp32 NaN in x" : "gru fp32 NaN in x";
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, &sc, 0.0f, 0.8f);
    h.x[(3 * (size_t)sc.T + 5) * sc.I + 7] = NAN; // row 3, step 5
    struct seq_out og, oc;
    seq_out_alloc(&og, &z);
    seq_out_alloc(&oc, &z);
    int err = run_seq(gpu, &sc, &h, &og, true), err2 = run_seq(cpu, &sc, &h, &oc, false);
    size_t nans = 0, mismatched = 0;
    for (size_t i = 0; !err && !err2 && i < z.nout; i++) {
        bool want = isnan(oc.out[i]);
        mismatched += isnan(og.out[i]) != want || isnan(og.out_notape[i]) != want;
        if (want) { // compared as equal below
            nans++;
            og.out[i] = og.out_notape[i] = oc.out[i] = 0.0f;
        }
    }
    bool ok = !err && !err2 && nans > 0 && mismatched == 0;
    check(ok, "%-34s %zu NaN outputs in the reference, %zu placed otherwise (%s, %s)", tag, nans,
          mismatched, rnnd_err_name(err), rnnd_err_name(err2));
    if (!err && !err2) {
        compare("out", tag, og.out, oc.out, NULL, z.nout, tolerance(sc.compute));
        compare("out(no tape)", tag, og.out_notape, og.out, NULL, z.nout, 1e-7);
    }
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
}

// Runs case sc with inputs h on the GPU (og) and on the CPU reference (oc), allocating both;
// the run counts as a check. False, with a FAIL line, when either returned an error.
// The output and the weight and initial-state gradients of a case run from h0 (og on the GPU, oc
// on the CPU), at the case's tolerance.
static void compare_from_h0(const char *tag, const struct seq_case *sc, const struct seq_host *h,
                            const struct seq_out *og, const struct seq_out *oc) {
    const struct seq_sizes z = seq_sizes_of(sc);
    const double tol = tolerance(sc->compute);
    compare("out", tag, og->out, oc->out, NULL, z.nout, tol);
    compare("grad params", tag, og->gp, oc->gp, h->gbase, z.P, tol);
    compare("grad h0", tag, og->gh0, oc->gh0, NULL, z.blh, tol);
    if (sc->cell == RNND_CELL_LSTM)
        compare("grad c0", tag, og->gc0, oc->gc0, NULL, z.blh, tol);
}

static bool run_pair(struct rnnd_backend *gpu, struct rnnd_backend *cpu, const struct seq_case *sc,
                     const struct seq_host *h, struct seq_out *og, struct seq_out *oc,
                     const char *tag) {
    const struct seq_sizes z = seq_sizes_of(sc);
    seq_out_alloc(og, &z);
    seq_out_alloc(oc, &z);
    int err = run_seq(gpu, sc, h, og, true), err2 = run_seq(cpu, sc, h, oc, false);
    check(!err && !err2, "%s: run %s, %s", tag, rnnd_err_name(err), rnnd_err_name(err2));
    return !err && !err2;
}

// Rows of tiny values (1e-36, below 2^-100): one row's x, another row's output gradients. The
// TF32 loops scale such rows into their fp16 tiles by a power of two, which must stay finite (it
// once overflowed to inf for a row maximum below 2^-114: NaN outputs and gradients). Both rows'
// results match the CPU reference, the tiny gradients of the second row on their own scale too.
// H = 128 runs the loops on dw16 chunks, H = 64 the others (their dh tile is fp16 with a scale a
// row since journal v32: unscaled, the tiny row's tile would be zeros and its dL/dx far off).
static void test_tiny(struct rnnd_backend *gpu, struct rnnd_backend *cpu, const struct seq_case *c,
                      int arg) {
    (void)arg;
    const struct seq_case sc = *c;
    const struct seq_sizes z = seq_sizes_of(&sc);
    char tag[48];
    snprintf(tag, sizeof(tag), "%s fp32 H%d tiny rows", sc.cell == RNND_CELL_LSTM ? "lstm" : "gru",
             sc.H);
    gpu_seed(tag);
    const float tiny = 1e-36f;
    const size_t rx = 3, rg = 5; // the rows: tiny x, tiny output gradients
    struct seq_host h;
    seq_host_init(&h, &sc, 0.0f, 0.8f);
    for (size_t i = 0; i < (size_t)sc.T * sc.I; i++)
        h.x[rx * sc.T * sc.I + i] *= tiny;
    for (size_t i = 0; i < (size_t)sc.T * sc.H; i++)
        h.gout[rg * sc.T * sc.H + i] *= tiny;
    for (size_t i = 0; i < (size_t)sc.L * sc.H; i++) {
        h.ghn[rg * sc.L * sc.H + i] *= tiny;
        h.gcn[rg * sc.L * sc.H + i] *= tiny;
    }
    struct seq_out og, oc;
    if (run_pair(gpu, cpu, &sc, &h, &og, &oc, tag)) {
        const double tol = tolerance(sc.compute);
        compare("out", tag, og.out, oc.out, NULL, z.nout, tol);
        compare("out(no tape)", tag, og.out_notape, oc.out, NULL, z.nout, tol);
        compare("grad params", tag, og.gp, oc.gp, h.gbase, z.P, tol);
        compare("grad x", tag, og.gx, oc.gx, NULL, z.nx, tol);
        const size_t at = rg * sc.T * sc.I;
        compare("grad x, tiny row", tag, og.gx + at, oc.gx + at, NULL, (size_t)sc.T * sc.I, tol);
    }
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
}

// Gates just below 1 over 256 steps (the saturated cases in main test the far tails over 12),
// so that dL/dc0 (LSTM) or dL/dh0 (GRU) is a sum of products of up to 256 of them (0.97 at the
// far end). LSTM: forget gates at 1 - 1.2e-4 (bias +9), input gates at 1.2e-4 (bias -9, so c
// stays near c0 and TF32's own errors small). GRU: update gates z at 1 - 1.2e-4, so h stays
// near h0. The tapes hold the gates' pre-activations (fp16 where the persistent loops run, as
// here; the GRU's from its wgmma forward, journal v29); the gates themselves rounded to fp16 would
// each be 1 and those products off by up to 3% (journal v20: 1.9e-2 in dL/dc0 in a float64 model).
// The GRU also in bf16 mode, whose backward reads the same planes (journal v40), at its tolerance.
static void test_forget_chain(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                              const struct seq_case *c, int arg) {
    (void)arg;
    const struct seq_case sc = *c;
    const bool lstm = sc.cell == RNND_CELL_LSTM;
    const enum rnnd_compute compute = sc.compute;
    const struct rnnd_model m = {
        .cell = sc.cell, .compute = sc.compute, .I = sc.I, .H = sc.H, .L = sc.L};
    char tag[48];
    snprintf(tag, sizeof(tag), "%s %s %s gates ~1", lstm ? "lstm" : "gru", compute_name(compute),
             lstm ? "forget" : "update");
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, &sc, 0.0f, 0.8f);
    struct rnnd_param_tensor b;
    rnnd_model_param_tensor(&m, RNND_PARAM_BIAS_IH, &b);
    for (int u = 0; u < sc.H; u++) { // gate order i, f, g, o; r, z, n
        if (lstm)
            h.params[b.offset + u] -= 9.0f;
        h.params[b.offset + (size_t)sc.H + u] += 9.0f;
    }
    struct seq_out og, oc;
    if (run_pair(gpu, cpu, &sc, &h, &og, &oc, tag))
        compare_from_h0(tag, &sc, &h, &og, &oc);
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
}

// A tape one float past 16-byte alignment: the forward and the backward refuse it (the loops
// copy it in bulk) and write nothing.
static void test_tape_align(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                            const struct seq_case *c, int arg) {
    (void)cpu, (void)arg;
    const struct seq_case sc = *c;
    gpu_seed("misaligned tape");
    const struct rnnd_model m = {
        .cell = sc.cell, .compute = sc.compute, .I = sc.I, .H = sc.H, .L = sc.L};
    const struct seq_sizes z = seq_sizes_of(&sc);
    const struct rnnd_backend_ops *ops = gpu->ops;
    struct seq_host h;
    seq_host_init(&h, &sc, 0.0f, 0.8f);
    struct bufs b = {.be = gpu};
    struct rnnd_seq seq = {.B = sc.B, .T = sc.T};
    seq.x = dev(&b, h.x, z.nx * 4);
    seq.is_init = dev(&b, h.is_init, (size_t)sc.B * sc.T);
    float *params = dev(&b, h.params, z.P * 4), *out = dev_poison(&b, z.nout, true);
    float *tape = (float *)dev(&b, NULL, ops->tape_bytes(gpu->ctx, &m, sc.B, sc.T) + 16) + 1;
    const int ef = ops->rnn_forward(gpu->ctx, out, NULL, NULL, tape, &seq, params, &m);
    struct rnnd_seq_grads g = {.params = dev(&b, h.gbase, z.P * 4)};
    const int eb = ops->rnn_backward(gpu->ctx, &g, out, NULL, NULL, tape, &seq, params, &m);
    float *gp = xmalloc(z.P * sizeof(float)), *o = xmalloc(z.nout * sizeof(float));
    to_host(gpu, gp, g.params, z.P);
    to_host(gpu, o, out, z.nout);
    bool unchanged = memcmp(gp, h.gbase, z.P * sizeof(float)) == 0;
    for (size_t i = 0; i < z.nout; i++)
        unchanged = unchanged && isnan(o[i]);
    const bool ok = ef == RNND_EINVAL && eb == RNND_EINVAL && unchanged;
    check(ok, "%-34s forward %s, backward %s, outputs %s", "misaligned tape", rnnd_err_name(ef),
          rnnd_err_name(eb), unchanged ? "untouched" : "written");
    free(gp), free(o);
    bufs_free(&b);
    seq_host_free(&h);
}

// Case sc on h run with variant bits va (into oa) and with vb (into ob), both added to the base
// variant, which is restored; err[2], the runs' errors.
static void run_variants(struct rnnd_backend *gpu, const struct seq_case *sc,
                         const struct seq_host *h, int va, int vb, struct seq_out *oa,
                         struct seq_out *ob, int err[2]) {
    const struct seq_sizes z = seq_sizes_of(sc);
    seq_out_alloc(oa, &z);
    seq_out_alloc(ob, &z);
    err[0] = rnnd_cuda_set_variant(gpu, gpu_base_variant | va);
    if (!err[0])
        err[0] = run_seq(gpu, sc, h, oa, true);
    err[1] = rnnd_cuda_set_variant(gpu, gpu_base_variant | vb);
    if (!err[1])
        err[1] = run_seq(gpu, sc, h, ob, true);
    rnnd_cuda_set_variant(gpu, gpu_base_variant);
}

// Case sc run with variant bits va and with vb (both added to the base variant): forwards (with
// and without a tape), final states and gradients bitwise equal (tag names the two).
static void test_bitwise_variant(struct rnnd_backend *gpu, const struct seq_case *sc, int va,
                                 int vb, const char *tag) {
    const struct seq_sizes z = seq_sizes_of(sc);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, sc, 0.0f, 0.8f);
    struct seq_out oa, ob;
    int err[2];
    run_variants(gpu, sc, &h, va, vb, &oa, &ob, err);
    check(!err[0] && !err[1], "%s: runs %s, %s", tag, rnnd_err_name(err[0]), rnnd_err_name(err[1]));
    if (!err[0] && !err[1]) {
        compare("out", tag, oa.out, ob.out, NULL, z.nout, 1e-7);
        compare("out(no tape)", tag, oa.out_notape, ob.out_notape, NULL, z.nout, 1e-7);
        compare("h_n", tag, oa.hn, ob.hn, NULL, z.blh, 1e-7);
        if (sc->cell == RNND_CELL_LSTM)
            compare("c_n", tag, oa.cn, ob.cn, NULL, z.blh, 1e-7);
        compare("grad params", tag, oa.gp, ob.gp, h.gbase, z.P, 1e-7);
        compare("grad x", tag, oa.gx, ob.gx, NULL, z.nx, 1e-7);
    }
    seq_out_free(&oa);
    seq_out_free(&ob);
    seq_host_free(&h);
}

// The per-step path replays its loops from CUDA graphs recorded under their arguments (seq.cu,
// stepwise_graph): the same case three times, each on its own inputs, in buffers that the
// allocator mostly hands back at the same addresses (so the later runs replay the first run's
// graphs with other data behind the same pointers), each against the CPU reference; then once
// more, bitwise equal to the loops launched one by one (RNND_TUNE_NO_GRAPH). States from h0.
static void test_graph_reuse(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                             const struct seq_case *sc, int arg) {
    (void)arg;
    const struct seq_sizes z = seq_sizes_of(sc);
    const bool lstm = sc->cell == RNND_CELL_LSTM;
    const double tol = tolerance(sc->compute);
    char tag[48];
    rnnd_cuda_set_path(gpu, sc->path);
    for (int k = 0; k < 3; k++) {
        snprintf(tag, sizeof(tag), "%s H%d L%d graph replay %d", lstm ? "lstm" : "gru", sc->H,
                 sc->L, k);
        gpu_seed(tag);
        struct seq_host h;
        seq_host_init(&h, sc, 0.0f, 0.8f);
        struct seq_out og, oc;
        if (run_pair(gpu, cpu, sc, &h, &og, &oc, tag)) {
            compare_from_h0(tag, sc, &h, &og, &oc);
            compare("h_n", tag, og.hn, oc.hn, NULL, z.blh, tol);
            compare("grad x", tag, og.gx, oc.gx, NULL, z.nx, tol);
        }
        seq_out_free(&og);
        seq_out_free(&oc);
        seq_host_free(&h);
    }
    snprintf(tag, sizeof(tag), "%s H%d L%d graph vs launched", lstm ? "lstm" : "gru", sc->H, sc->L);
    test_bitwise_variant(gpu, sc, 0, RNND_TUNE_NO_GRAPH, tag);
    rnnd_cuda_set_path(gpu, RNND_CUDA_PATH_AUTO);
}

// The GRU TF32 loops at H <= 128: the wgmma loop (seq_wg.cu, on sm_90) and the mma.sync KP loop
// (variant bit 4096) sum the same products in the same order, so forwards (with and without a
// tape) and gradients are bitwise equal. Where seq_wg.cu does not run, both are KP. Both keep z
// rows in the tape (bit 32768): from the wgmma loop's chunk parts the backward takes an fp16
// hprev (test_zfwd).
static void test_wg_kp(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                       const struct seq_case *sc, int arg) {
    (void)cpu, (void)arg;
    test_bitwise_variant(gpu, sc, NO_ZFWD, NO_ZFWD | NO_WG, "gru fp32 wgmma loop against KP");
}

// The bf16 GRU's and LSTM's layer-0 gradients from seq_dw.cu's products on the loops' dw16
// chunks (compute 9.0): test_seq's checks (the mode's tolerance, a repeat run bitwise
// identical), then layer 0's parameter gradients and dL/dx against the CPU reference at
// dw16_tol. The products round D, z and W_ih to bf16 to nearest: 3e-4 to 8.1e-4 on the
// parameters of these cases and 8e-5 to 6.6e-4 on dL/dx, where cuBLAS's bf16 product on the
// fp32 D and z (variant bit 16384) gives 1.3e-3 to 2.2e-3 on the parameters (journal v25d-f). So a
// lost or misplaced chunk, row or column fails, and so does a fall-back to cuBLAS for the weight
// gradients. With a second layer, layer 0's gradients carry the error of layer 1's dL/dx
// (cuBLAS, bf16: 1.4e-3 to 2.6e-3), and other devices run cuBLAS's products: there the mode's
// tolerance. TF32 mode (fp16 chunks with exponent records, journal v26) runs the same
// checks at its own tolerance, which dw16_tol equals; test_dw16_scales adds its ranges.
// The bf16 GRU's backward on the forward's chunks (journal v40) takes hprev from them in bf16, which
// adds the product's own rounding of h to D: up to 1.03e-3 on these cases (B = T = 1 from h0;
// the loop's own chunks, hprev in fp32: 3.6e-4 to 4.8e-4). There dw16_zf_tol: no cuBLAS product
// can run on that tape (it holds no z rows), and a lost or misplaced part is off by 0.2 and more.
// va: variant bits added to the base variant for the case.
static const double dw16_tol = 1e-3, dw16_zf_tol = 2e-3;
// Whether layer 0's z chunks come from the forward (the plan's zfwd, aligned inputs) for case
// sc under variant bits v (wgmma off, x not fused, our products off, chunks from the forward off).
static bool zfwd_runs(const struct seq_case *sc, int v) {
    const bool mode = sc->compute == RNND_COMPUTE_FP32 ||
                      (sc->compute == RNND_COMPUTE_BF16 && sc->cell == RNND_CELL_GRU);
    // H = 128, or a layer in H = 128's loops (seq_plan.cu): 96 < H < 128, or 64 <= H <= 96 from
    // 1024 rows (GRU) or 1536 (LSTM), H = 64 from 512 (GRU) or 1024 (LSTM).
    const bool h4 = sc->H % 4 == 0, gru = sc->cell == RNND_CELL_GRU;
    const int pad_rows = sc->H <= 64 ? (gru ? 512 : 1024) : (gru ? 1024 : 1536);
    const bool h128 = sc->H == 128 || (h4 && sc->H > 96 && sc->H < 128) ||
                      (h4 && sc->H >= 64 && sc->H <= 96 && sc->B >= pad_rows && !(v & NO_PAD128));
    return gpu_sm90 && mode && h128 && sc->I % 4 == 0 && sc->I <= 64 &&
           !(v & (NO_WG | NO_FUSED_X | NO_DW16 | NO_ZFWD));
}
static void test_dw16(struct rnnd_backend *gpu, struct rnnd_backend *cpu, const struct seq_case *c,
                      int va) {
    struct seq_case scr = *c;
    scr.how |= SEQ_REPEAT;
    const struct seq_case *sc = &scr;
    if (rnnd_cuda_set_variant(gpu, gpu_base_variant | va) != 0) {
        fail("variant %d not accepted", gpu_base_variant | va);
        return;
    }
    const bool zf = sc->compute == RNND_COMPUTE_BF16 && zfwd_runs(sc, gpu_base_variant | va);
    test_seq(gpu, cpu, sc);
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    const struct seq_sizes z = seq_sizes_of(sc);
    char tag[80];
    snprintf(tag, sizeof(tag), "%s %s I%d H%d L%d B%d T%d dw16%s v%d",
             sc->cell == RNND_CELL_LSTM ? "lstm" : "gru", compute_name(sc->compute), sc->I, sc->H,
             sc->L, sc->B, sc->T, sc->how & SEQ_MISALIGN ? " misal" : "", va);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, sc, 0.0f, 0.8f);
    struct seq_out og, oc;
    if (run_pair(gpu, cpu, sc, &h, &og, &oc, tag)) {
        struct rnnd_param_tensor first, last; // layer 0's tensors are the first four
        rnnd_model_param_tensor(&m, 0, &first);
        rnnd_model_param_tensor(&m, 3, &last);
        size_t at = first.offset, n = last.offset + last.count - first.offset;
        const double tol = !gpu_sm90 || sc->L > 1 ? tolerance(sc->compute)
                           : zf                   ? dw16_zf_tol
                                                  : dw16_tol;
        compare("grad layer 0", tag, og.gp + at, oc.gp + at, h.gbase + at, n, tol);
        compare("grad x", tag, og.gx, oc.gx, NULL, z.nx, tol);
    }
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
    rnnd_cuda_set_variant(gpu, gpu_base_variant);
}

// Layer 0 at H = 128 in TF32 mode (the GRU also in bf16) on sm_90: the wgmma forward writes z's
// dw16 chunk parts into the tape in place of the z rows, and the backward loop reads no z rows
// (journal seq-05 and seq-08); so does the LSTM's mma.sync forward above layer 0 in TF32 mode
// from 2048 rows (journal seq-08). The LSTM's chunks hold the same bits either way, so its forwards and
// gradients are bitwise equal to the loop that writes them itself (variant bit 32768). The GRU's
// backward takes hprev (16-bit) from the chunks and its gates from the fp16 planes the forward
// writes beside them instead of recomputing them (journal seq-06): test_dw16's checks against the CPU
// reference, and the same for the recomputing loop that writes its own chunks (bit 32768; the
// path of inputs off 16-byte alignment). Then with outputs and gradients off 16-byte alignment,
// which the backward cannot see from the forward's side: the forward stages its outputs, the
// backward's loop reads the gradients a float at a time (test_dw16's checks).
static void test_zfwd(struct rnnd_backend *gpu, struct rnnd_backend *cpu, const struct seq_case *sc,
                      int arg) {
    (void)arg;
    // The format itself: on sm_90 layer 0's z space holds other bytes than with NO_ZFWD (a
    // test of the two paths that ran one would pass vacuously), elsewhere, or with a bit that
    // turns the chunk parts off (wgmma, fused x, products), the same ones.
    const char *cell = sc->cell == RNND_CELL_LSTM ? "lstm" : "gru";
    const char *mode = compute_name(sc->compute);
    char tag[80];
    snprintf(tag, sizeof(tag), "%s %s I%d L%d B%d T%d zfwd", cell, mode, sc->I, sc->L, sc->B,
             sc->T);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, sc, 0.0f, 0.8f);
    struct seq_out oa, ob;
    int err[2];
    run_variants(gpu, sc, &h, 0, NO_ZFWD, &oa, &ob, err);
    const bool differ = oa.ntape0 != ob.ntape0 || memcmp(oa.tape0, ob.tape0, oa.ntape0) != 0;
    const bool expect = zfwd_runs(sc, gpu_base_variant);
    check(!err[0] && !err[1] && differ == expect,
          "%s %s z chunks from the forward: tape formats %s (%s, %s)", cell, mode,
          differ ? "differ" : "equal", rnnd_err_name(err[0]), rnnd_err_name(err[1]));
    seq_out_free(&oa);
    seq_out_free(&ob);
    seq_host_free(&h);
    if (sc->cell == RNND_CELL_LSTM) {
        test_bitwise_variant(gpu, sc, 0, NO_ZFWD,
                             "lstm fp32 z chunks from the forward against the loop's");
    } else {
        test_dw16(gpu, cpu, sc, 0);
        printf("  (NO_ZFWD: the loop's own chunks)\n");
        test_dw16(gpu, cpu, sc, NO_ZFWD);
    }
    struct seq_case off = *sc;
    off.how |= SEQ_MISALIGN;
    test_dw16(gpu, cpu, &off, 0);
}

// TF32 mode's products (seq_dw.cu on fp16 chunks, journal v26) on values far from 1, where one
// fp16 scale for all rows would overflow or lose every bit; the same kinds (1, 2, 3, 5) for the
// per-step path's fp16 D_h rows, each scaled by its own power. Each value is kept to 10 bits by its
// (row, group) exponent; a K range is summed relative to its largest, so a row's share of dW goes
// only where it is 2^24 or more below the largest row's, and dL/dx is each row's own.
//   0: x's column 0 times 16, column 1 times 1e-5;
//   1: every output gradient times 1e-30 (all of dW near 1e-30);
//   2: batch rows 3 and 17's output gradients times 2^20 (the rest 2^-20 of them);
//   3: batch rows 3 and 17's output gradients times 2^-30: their dW shares go, their dL/dx, on
//      their own scale, must not;
//   4: batch rows 3 and 17's x all zero and their output gradients times 2^14: a zero x row must
//      not set its range's x exponent (taken as 0, it put every other row's x share 2^-27 down,
//      below fp16, and dW_ih near 0).
//   5: row 3's output gradients times 2^-30 before its reset at step 10, row 17's times 2^20 at
//      step 5 alone: a step whose gate gradients are 2^30 below, or 2^20 above, the step's after.
//      A loop that scales its dh tile by the step after's row maxima (v30a, journal v30, not kept)
//      fails it without a fall-back: row 3's early dL/dx, compared on its own, 4.8e-3 off (below
//      fp16), and non-finite gradients from row 17 (over it).
//   6: x's column 2 times 2^-40 in every row, dW_ih's column 2 compared on its own: 2^-40 of
//      the other columns' sums, below fp16 where the product's z has no column powers
//      (dw16_operands; the per-step path's only).
static void test_dw16_scales(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                             const struct seq_case *c, int kind) {
    const struct seq_case sc = *c;
    const enum rnnd_cell cell = sc.cell;
    const struct seq_sizes z = seq_sizes_of(&sc);
    static const char *const what[] = {
        "x columns x16, x1e-5", "gradients x1e-30", "two rows x2^20", "two rows x2^-30",
        "zero x rows x2^14",    "a drop, a spike",  "x column x2^-40"};
    char tag[64];
    snprintf(tag, sizeof(tag), "%s fp32 H%d %s", cell == RNND_CELL_LSTM ? "lstm" : "gru", sc.H,
             what[kind]);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, &sc, 0.0f, 0.8f);
    memset(h.gbase, 0, z.P * sizeof(float)); // gradients near 1e-30 would vanish in 1 + g
    const size_t rows[2] = {3, 17}, TH = (size_t)sc.T * sc.H;
    if (kind == 0)
        for (size_t r = 0; r < (size_t)sc.B * sc.T; r++) {
            h.x[r * sc.I] *= 16.0f;
            h.x[r * sc.I + 1] *= 1e-5f;
        }
    if (kind == 1) {
        for (size_t i = 0; i < z.nout; i++)
            h.gout[i] *= 1e-30f;
        for (size_t i = 0; i < z.blh; i++) {
            h.ghn[i] *= 1e-30f;
            h.gcn[i] *= 1e-30f;
        }
    }
    if (kind >= 2 && kind <= 4)
        for (int k = 0; k < 2; k++)
            for (size_t i = 0; i < TH; i++)
                h.gout[rows[k] * TH + i] *= kind == 2 ? 0x1p20f : kind == 3 ? 0x1p-30f : 0x1p14f;
    if (kind == 4)
        for (int k = 0; k < 2; k++)
            memset(h.x + rows[k] * sc.T * sc.I, 0, (size_t)sc.T * sc.I * sizeof(float));
    for (size_t r = 0; kind == 6 && r < (size_t)sc.B * sc.T; r++)
        h.x[r * sc.I + 2] *= 0x1p-40f;
    if (kind == 5) {
        h.is_init[rows[0] * sc.T + 10] = 1;
        for (size_t i = 0; i < 10 * (size_t)sc.H; i++)
            h.gout[rows[0] * TH + i] *= 0x1p-30f;
        for (size_t i = 0; i < (size_t)sc.H; i++)
            h.gout[rows[1] * TH + 5 * sc.H + i] *= 0x1p20f;
    }
    struct seq_out og, oc;
    if (run_pair(gpu, cpu, &sc, &h, &og, &oc, tag)) {
        const double tol = tolerance(sc.compute);
        compare("grad params", tag, og.gp, oc.gp, h.gbase, z.P, tol);
        compare("grad x", tag, og.gx, oc.gx, NULL, z.nx, tol);
        for (int k = 0; kind == 3 && k < 2; k++) {
            const size_t at = rows[k] * sc.T * sc.I;
            compare("grad x, row", tag, og.gx + at, oc.gx + at, NULL, (size_t)sc.T * sc.I, tol);
        }
        if (kind == 5) { // row 3's steps 0-9
            const size_t at = rows[0] * sc.T * sc.I;
            compare("grad x, 0-9", tag, og.gx + at, oc.gx + at, NULL, 10 * (size_t)sc.I, tol);
        }
        if (kind == 4) { // dW_ih alone: the big rows' gradients swamp it in the whole
            const struct rnnd_model m = {
                .cell = sc.cell, .compute = sc.compute, .I = sc.I, .H = sc.H, .L = sc.L};
            struct rnnd_param_tensor pt;
            rnnd_model_param_tensor(&m, RNND_PARAM_WEIGHT_IH, &pt);
            compare("grad W_ih", tag, og.gp + pt.offset, oc.gp + pt.offset, NULL, pt.count, tol);
        }
        if (kind == 6) { // dW_ih's column 2
            const struct rnnd_model m = {
                .cell = sc.cell, .compute = sc.compute, .I = sc.I, .H = sc.H, .L = sc.L};
            struct rnnd_param_tensor pt;
            rnnd_model_param_tensor(&m, RNND_PARAM_WEIGHT_IH, &pt);
            const size_t n = pt.count / sc.I;
            float *a = malloc(2 * n * sizeof(float));
            for (size_t i = 0; a && i < n; i++)
                a[i] = og.gp[pt.offset + i * sc.I + 2], a[n + i] = oc.gp[pt.offset + i * sc.I + 2];
            if (a)
                compare("grad W_ih, column 2", tag, a, a + n, NULL, n, tol);
            free(a);
        }
    }
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
}

// The TF32 loops scale their weights into fp16 by the largest |w| (persist_absmax: 16-byte
// loads where a weight is 16-byte aligned, single floats after that and where it is not). Here
// the last element of every weight_ih and weight_hh is 8 times the others' bound: missed by
// that maximum, it would overflow fp16 (the others' maximum is scaled into [2^14, 2^15); NaN
// outputs). With 60 times, H = 7's gradients missed 1e-3 by TF32's own errors (1.4e-3).
// Cases: the wgmma forwards and the recomputing and tape backwards (H = 128), H = 7 (its
// weight_hh not 16-byte aligned, its weight_ih a single-float tail), and the cluster loops
// (H = 256, whose CTAs each take the maximum of their own gate rows).
// Case sc on gpu against cpu on inputs h (freed): outputs with and without tape, gradients.
static void check_inputs(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                         const struct seq_case *sc, struct seq_host *h, const char *tag) {
    const struct seq_sizes z = seq_sizes_of(sc);
    struct seq_out og, oc;
    if (run_pair(gpu, cpu, sc, h, &og, &oc, tag)) {
        const double tol = tolerance(sc->compute);
        compare("out", tag, og.out, oc.out, NULL, z.nout, tol);
        compare("out(no tape)", tag, og.out_notape, oc.out, NULL, z.nout, tol);
        compare("grad params", tag, og.gp, oc.gp, h->gbase, z.P, tol);
        compare("grad x", tag, og.gx, oc.gx, NULL, z.nx, tol);
    }
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(h);
}

static void test_weight_outliers(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                                 const struct seq_case *sc, int arg) {
    (void)arg;
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    char tag[64];
    snprintf(tag, sizeof(tag), "%s fp32 H%d L%d weight outliers",
             sc->cell == RNND_CELL_LSTM ? "lstm" : "gru", sc->H, sc->L);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, sc, 0.0f, 0.8f);
    for (int k = 0; k < rnnd_model_param_tensors(&m); k++) {
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(&m, k, &pt);
        if (k % 4 == RNND_PARAM_WEIGHT_IH || k % 4 == RNND_PARAM_WEIGHT_HH)
            h.params[pt.offset + pt.count - 1] = (float)(8.0 / sqrt((double)sc->H));
    }
    check_inputs(gpu, cpu, sc, &h, tag);
}

// x's rows (b, t) of every third step each times 2^k, k drawn from [-10, 4]: the loops that put x
// into fp16 scale such rows by powers of two of their own (H = 256's clusters, journal v39, where
// the steps between keep the h scale and skip the rows' factors; H = 128's split forward), and
// the dw16 products read x's exponents from their records. One scale for all rows would overflow
// fp16 (above 8 with the h scale's 2^13) or lose the small rows; a row's or a step's factor
// applied to another's would miss the tolerance by orders of magnitude.
static void test_x_scales(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                          const struct seq_case *sc, int arg) {
    (void)arg;
    char tag[64];
    snprintf(tag, sizeof(tag), "%s fp32 I%d H%d B%d x rows 2^-10..2^4",
             sc->cell == RNND_CELL_LSTM ? "lstm" : "gru", sc->I, sc->H, sc->B);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, sc, 0.0f, 0.8f);
    for (size_t r = 0; r < (size_t)sc->B * sc->T; r++) {
        if (r % sc->T % 3 != 0)
            continue;
        const float f = ldexpf(1.0f, (int)(rng_uniform() * 15.0) - 10);
        for (int i = 0; i < sc->I; i++)
            h.x[r * sc->I + i] *= f;
    }
    check_inputs(gpu, cpu, sc, &h, tag);
}

// The per-step path's fp16 GEMM operands (TF32 and bf16 modes) far from 1. W_hh is scaled by its
// largest |w|, each step's h and D_h rows each by their own (tests of D_h's: test_tiny,
// test_dw16_scales). Kinds:
//   0: batch row 3's h0 (and c0) times 2^17 and every W_hh times 2^-17, so that W_hh h stays
//      near 1 (larger pre-activations would put TF32's own rounding past the tolerance): the
//      GRU's h stays near 2^17 z^t, over fp16 unless the row has a power of its own, which must
//      not put row 0's h below its 10 bits; W_hh below fp16's normal range without its power;
//   1: every W_hh times 2^-20 (dL/dh0 = D W_hh on its own scale).
static void test_step16_scales(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                               const struct seq_case *c, int kind) {
    const struct seq_case sc = *c;
    const struct rnnd_model m = {
        .cell = sc.cell, .compute = sc.compute, .I = sc.I, .H = sc.H, .L = sc.L};
    static const char *const what[] = {"h0 row x2^17, W_hh x2^-17", "W_hh x2^-20"};
    char tag[64];
    snprintf(tag, sizeof(tag), "%s %s H%d %s", sc.cell == RNND_CELL_LSTM ? "lstm" : "gru",
             compute_name(sc.compute), sc.H, what[kind]);
    gpu_seed(tag);
    struct seq_host h;
    seq_host_init(&h, &sc, 0.0f, 0.8f);
    const size_t LH = (size_t)sc.L * sc.H, TH = (size_t)sc.T * sc.H;
    for (size_t i = 0; kind == 0 && i < LH; i++)
        h.h0[3 * LH + i] *= 0x1p17f, h.c0[3 * LH + i] *= 0x1p17f;
    for (int k = 0; k < rnnd_model_param_tensors(&m); k++) {
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(&m, k, &pt);
        for (size_t i = 0; k % 4 == RNND_PARAM_WEIGHT_HH && i < pt.count; i++)
            h.params[pt.offset + i] *= kind == 0 ? 0x1p-17f : 0x1p-20f;
    }
    struct seq_out og, oc;
    if (run_pair(gpu, cpu, &sc, &h, &og, &oc, tag)) {
        compare_from_h0(tag, &sc, &h, &og, &oc);
        if (kind == 0) // row 0 on its own scale
            compare("out, row 0", tag, og.out, oc.out, NULL, TH, tolerance(sc.compute));
    }
    seq_out_free(&og);
    seq_out_free(&oc);
    seq_host_free(&h);
}

// cuBLAS's weight gradients in each of their three ways (seq.cu, dw_gemm: the shape picks one,
// so that a run alone tests one of them): case sc against the CPU reference with each forced by
// variant bits. The cases' ldz (236, 204) is no multiple of 128, so the third splits it.
static void test_dw_orders(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                           const struct seq_case *sc, int arg) {
    (void)arg;
    const int how[3] = {DW_M4, DW_MLDZ, DW_MSPLIT};
    static const char *const what[3] = {"D's 4H columns as M", "z's ldz columns as M",
                                        "z's ldz columns as M, split at 128"};
    for (int k = 0; k < 3; k++) {
        if (rnnd_cuda_set_variant(gpu, gpu_base_variant | how[k]) != 0) {
            fail("variant %d not accepted", gpu_base_variant | how[k]);
            return;
        }
        printf("  (weight gradients with %s)\n", what[k]);
        test_seq(gpu, cpu, sc);
    }
    rnnd_cuda_set_variant(gpu, gpu_base_variant);
}

// ---------------------------------------------------------------------------------------------
// The cases

static const enum rnnd_cell GRU = RNND_CELL_GRU, LSTM = RNND_CELL_LSTM;
static const enum rnnd_compute F32 = RNND_COMPUTE_FP32, IEEE = RNND_COMPUTE_IEEE,
                               BF16 = RNND_COMPUTE_BF16;
static const enum state_mode NONE = STATE_NONE, H0 = STATE_H0, HID = STATE_HIDDEN;
#define AUTO RNND_CUDA_PATH_AUTO
#define STEP RNND_CUDA_PATH_STEPWISE

// --quick: a few small cases, each kind of loop once.
static const struct seq_case quick_cases[] = {
    {GRU, F32, 64, 128, 1, 40, 9, 0.2, H0, AUTO, SEQ_REPEAT},
    {LSTM, F32, 64, 128, 1, 20, 7, 0.2, HID, AUTO, 0},
    {GRU, BF16, 5, 7, 2, 3, 5, 0.3, NONE, AUTO, 0},
    {LSTM, IEEE, 8, 20, 2, 5, 4, 0.3, H0, AUTO, 0},
    {GRU, F32, 16, 160, 1, 4, 3, 0.3, HID, AUTO, 0},
    {LSTM, F32, 64, 256, 1, 330, 3, 0.2, HID, AUTO, 0},  // both cluster loops
    {GRU, F32, 64, 256, 1, 330, 3, 0.2, H0, AUTO, 0},    // the GRU's
    {GRU, F32, 64, 64, 1, 2048, 2, 0.2, H0, AUTO, 0},    // H = 64 in H = 128's loops
    {LSTM, F32, 64, 64, 1, 2048, 2, 0.2, H0, AUTO, 0},   // the LSTM's
    {GRU, F32, 64, 128, 2, 520, 2, 0.2, H0, AUTO, 0},    // layer 1's x fused 128 wide
    {LSTM, F32, 64, 128, 2, 2048, 2, 0.2, HID, AUTO, 0}, // layer 1's dw16 chunks, x 128 wide
};

// cell, compute, I, H, L, B, T, reset probability, initial state, path, how (SEQ_*).
static const struct seq_case seq_cases[] = {
    // The bench shape's model at a small batch, every mode.
    {GRU, F32, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, SEQ_REPEAT},
    {LSTM, F32, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0},
    {GRU, BF16, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0},
    {LSTM, BF16, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0},
    {GRU, IEEE, 64, 128, 1, 16, 12, 0.1, NONE, AUTO, 0},
    {LSTM, IEEE, 64, 128, 1, 16, 12, 0.1, NONE, AUTO, 0},
    // Stored states and h0, odd widths, two and three layers.
    {GRU, F32, 64, 128, 1, 50, 40, 0.1, HID, AUTO, 0},
    {LSTM, F32, 64, 128, 2, 50, 40, 0.05, H0, AUTO, 0},
    {GRU, F32, 5, 7, 2, 33, 11, 0.2, H0, AUTO, 0},
    {LSTM, F32, 5, 7, 2, 33, 11, 0.2, HID, AUTO, 0},
    {GRU, F32, 32, 96, 2, 37, 17, 0.1, HID, AUTO, 0},
    {LSTM, F32, 32, 96, 2, 37, 17, 0.1, NONE, AUTO, 0},
    {GRU, BF16, 17, 96, 3, 19, 9, 0.15, H0, AUTO, 0},
    {LSTM, BF16, 40, 64, 2, 21, 10, 0.15, HID, AUTO, 0},
    {GRU, IEEE, 9, 7, 2, 6, 7, 0.2, HID, AUTO, 0},
    {LSTM, IEEE, 9, 33, 1, 6, 7, 0.2, H0, AUTO, 0},
    // A layer of H < 128 in the loops of H = 128 (units from H on zero): 96 < H at any batch,
    // 64 <= H <= 96 from 1024 rows (GRU) or 1536 (LSTM); both modes that take them, stored
    // states, h0, a second layer, a partial last block; H = 64 below those on its own width's
    // loops.
    {GRU, F32, 64, 64, 1, 2048, 4, 0.1, NONE, AUTO, SEQ_REPEAT},
    {GRU, BF16, 64, 64, 1, 2048, 4, 0.1, NONE, AUTO, 0},
    {GRU, F32, 64, 64, 1, 2100, 5, 0.1, HID, AUTO, 0},
    {GRU, F32, 36, 124, 1, 70, 9, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 96, 2, 2050, 3, 0.1, H0, AUTO, 0},
    {GRU, BF16, 32, 80, 1, 2048, 3, 0.2, HID, AUTO, 0},
    {GRU, F32, 64, 64, 1, 2049, 3, 0.1, NONE, AUTO, 0},
    {GRU, F32, 64, 64, 2, 2048, 3, 0.1, HID, AUTO, 0}, // two layers of the half-unit loops
    {GRU, BF16, 64, 64, 2, 2048, 3, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 64, 1, 512, 3, 0.1, H0, AUTO, 0}, // where H = 64 and H = 96 start padding
    {GRU, F32, 64, 64, 1, 511, 3, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 96, 1, 1024, 3, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 96, 1, 1023, 3, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 64, 1, 64, 33, 0.1, NONE, AUTO, 0},
    {LSTM, F32, 64, 64, 1, 2048, 4, 0.1, NONE, AUTO, SEQ_REPEAT},
    {LSTM, BF16, 64, 64, 1, 2048, 4, 0.1, NONE, AUTO, 0},
    {LSTM, F32, 64, 64, 1, 2100, 5, 0.1, HID, AUTO, 0},
    {LSTM, F32, 64, 96, 2, 2050, 3, 0.1, H0, AUTO, 0},
    {LSTM, BF16, 32, 80, 1, 2048, 3, 0.2, HID, AUTO, 0},
    {LSTM, F32, 64, 64, 1, 1024, 3, 0.1, H0, AUTO, 0},
    {LSTM, F32, 64, 64, 2, 2048, 3, 0.1, HID, AUTO, 0},
    {LSTM, BF16, 64, 64, 2, 2048, 3, 0.1, HID, AUTO, 0}, // the bf16 wgmma forward, stored states
    {LSTM, F32, 64, 64, 1, 1023, 3, 0.1, H0, AUTO, 0},
    {LSTM, F32, 64, 96, 1, 1535, 3, 0.1, H0, AUTO, 0},
    // The GRU's wgmma forward with x 64 < I_l <= 128 wide (both modes, from 512 rows), the mma.sync
    // backward on its gate planes: layer 1 at H = 128, a wide x at layer 0, H < 128 in both
    // layers, three layers with a partial last block; x past 128, fewer rows (and the LSTM) on
    // the mma.sync forward.
    {GRU, F32, 64, 128, 2, 530, 19, 0.1, H0, AUTO, SEQ_REPEAT},
    {GRU, F32, 128, 128, 1, 520, 9, 0.2, NONE, AUTO, 0},
    {GRU, F32, 100, 112, 2, 600, 8, 0.1, HID, AUTO, 0},
    {GRU, F32, 64, 128, 2, 70, 19, 0.1, H0, AUTO, 0},
    {GRU, BF16, 64, 128, 2, 530, 9, 0.1, HID, AUTO, 0},
    {GRU, BF16, 96, 128, 1, 520, 7, 0.2, H0, AUTO, 0},
    {GRU, F32, 64, 128, 3, 2049, 3, 0.1, HID, AUTO, 0},
    {GRU, F32, 132, 128, 1, 20, 5, 0.1, H0, AUTO, 0},
    {LSTM, F32, 120, 100, 1, 37, 11, 0.1, H0, AUTO, 0},
    // The dw16 chunks at H = 128 with z's x part 128 wide: the GRU's z parts from its wgmma
    // forward (from 512 rows), read by the gate-tape loop; the LSTM's from its mma.sync forward
    // in TF32 mode, written by its mma.sync backward in bf16 (from 2048 rows). Above layer 0 in
    // two and three layers of either cell in both modes, stored states, h0, partial last
    // blocks; layer 0 with I = 96 to 128; misaligned outputs and gradients (the forwards stage
    // them and the chunks stay); one row below the wide forward (511: cuBLAS's); states
    // past [-1, 1] (layer 1's x, layer 0's h, scaled by that layer's bound in the mma.sync loop,
    // by each row's own in the forward's chunks).
    {LSTM, F32, 64, 128, 2, 2048, 3, 0.1, HID, AUTO, SEQ_REPEAT},
    {LSTM, BF16, 64, 128, 2, 2050, 3, 0.1, H0, AUTO, 0},
    {LSTM, F32, 64, 128, 3, 2049, 2, 0.2, H0, AUTO, 0},
    {GRU, F32, 64, 128, 2, 1536, 4, 0.1, HID, AUTO, 0},
    {GRU, BF16, 64, 128, 3, 1600, 3, 0.1, HID, AUTO, 0},
    {GRU, F32, 100, 128, 1, 1540, 3, 0.1, H0, AUTO, 0},
    {GRU, BF16, 96, 128, 1, 1536, 3, 0.2, NONE, AUTO, 0},
    {LSTM, F32, 128, 128, 1, 2048, 3, 0.1, HID, AUTO, 0},
    {LSTM, BF16, 100, 128, 1, 2048, 3, 0.1, H0, AUTO, 0},
    {LSTM, F32, 64, 128, 2, 2048, 3, 0.1, H0, AUTO, SEQ_MISALIGN},
    {GRU, F32, 64, 128, 2, 1536, 3, 0.1, HID, AUTO, SEQ_MISALIGN},
    {GRU, F32, 64, 128, 2, 1535, 3, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 128, 2, 511, 3, 0.1, H0, AUTO, 0},
    // Layer 1's x past 1: in the GRU's forward chunks (each row's scale), the LSTM's loop's.
    {GRU, F32, 64, 128, 2, 1536, 5, 0.1, HID, AUTO, SEQ_WIDE},
    {LSTM, F32, 64, 128, 2, 2048, 3, 0.1, HID, AUTO, SEQ_WIDE},
    // Batch and time edges: B=1, T=1, B=2049 (a partial last block).
    {GRU, F32, 64, 128, 1, 1, 1, 0.0, NONE, AUTO, 0},
    {LSTM, F32, 64, 128, 1, 1, 1, 0.0, H0, AUTO, 0},
    {GRU, F32, 64, 128, 1, 1, 1, 1.0, HID, AUTO, 0},
    {GRU, F32, 64, 128, 1, 2049, 3, 0.1, NONE, AUTO, 0},
    {LSTM, F32, 64, 128, 1, 2049, 3, 0.1, HID, AUTO, 0},
    {GRU, F32, 64, 128, 1, 300, 64, 0.01, NONE, AUTO, 0},
    {LSTM, F32, 64, 128, 1, 300, 64, 0.01, NONE, AUTO, 0},
    // The per-step path for the same models, and the widths only it runs (H=1024).
    {GRU, F32, 64, 128, 1, 40, 21, 0.1, HID, STEP, 0},
    {LSTM, F32, 64, 128, 2, 40, 21, 0.1, H0, STEP, 0},
    {GRU, BF16, 64, 128, 1, 40, 21, 0.1, NONE, STEP, 0},
    {GRU, F32, 64, 1024, 1, 8, 6, 0.2, H0, AUTO, 0},
    {LSTM, F32, 64, 1024, 2, 5, 4, 0.2, HID, AUTO, 0},
    {LSTM, BF16, 64, 1024, 1, 5, 4, 0.2, NONE, AUTO, 0},
    {GRU, IEEE, 64, 1024, 1, 4, 3, 0.2, NONE, AUTO, 0},
    // LSTM H=256 in thread-block clusters (TF32, I <= 64; reported as "stepwise"): the
    // forward with the per-step backward below 21 rows (I=32 with a second layer on the per-step
    // path at B=20, B=1); both loops from 21 rows: a partial last cluster (B=70 is 64 + 6 rows,
    // B=385 7 clusters, the last partial), stored states, h0.
    {LSTM, F32, 64, 256, 1, 70, 9, 0.1, H0, AUTO, 0},
    {LSTM, F32, 64, 256, 1, 33, 12, 0.2, HID, AUTO, 0},
    {LSTM, F32, 32, 256, 2, 20, 7, 0.1, NONE, AUTO, 0},
    {LSTM, F32, 64, 256, 1, 1, 1, 0.0, H0, AUTO, 0},
    {LSTM, F32, 64, 256, 1, 129, 20, 0.01, NONE, AUTO, 0},
    {LSTM, F32, 64, 256, 1, 385, 6, 0.1, HID, AUTO, 0},
    {LSTM, F32, 32, 256, 2, 400, 5, 0.1, H0, AUTO, 0},
    // B=2000: 32 clusters of 64 rows are two waves on an H100, 25 of 80 one: the 80-row loops.
    {LSTM, F32, 64, 256, 1, 2000, 3, 0.1, HID, AUTO, 0},
    // bf16 mode runs the same loops (both, with the dw256 product; 80 rows at B=2000).
    {LSTM, BF16, 64, 256, 1, 70, 6, 0.1, H0, AUTO, 0},
    {LSTM, BF16, 64, 256, 1, 2000, 3, 0.1, HID, AUTO, 0},
    // GRU H=256 in the same clusters (n's x and h parts apart; the backward's direct term
    // carried beside the partials): below 21 rows the forward alone (a second layer per step
    // with I=32, B=1 T=1); both loops from 21 rows, with the dw256 product at layer 0 where
    // I <= 64 (stored states, h0, 64-row clusters with a partial last one, 80-row
    // ones at B=2000, D as chunks alone without dL/dx, bf16 mode, two layers whose layer 1 runs
    // its forward per step into the blocked tape, I=72 likewise at layer 0 (cuBLAS's weight
    // gradients), saturated gates, misaligned outputs and gradients through aligned scratch).
    {GRU, F32, 64, 256, 1, 70, 9, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 256, 1, 33, 12, 0.2, HID, AUTO, 0},
    {GRU, F32, 32, 256, 2, 20, 7, 0.1, NONE, AUTO, 0},
    {GRU, F32, 64, 256, 1, 1, 1, 0.0, H0, AUTO, 0},
    {GRU, F32, 64, 256, 1, 330, 9, 0.1, HID, AUTO, 0},
    {GRU, F32, 64, 256, 1, 385, 6, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 256, 1, 2000, 3, 0.1, HID, AUTO, 0},
    {GRU, F32, 64, 256, 1, 2000, 4, 0.1, NONE, AUTO, SEQ_NO_GX},
    {GRU, BF16, 64, 256, 1, 385, 5, 0.1, HID, AUTO, 0},
    {GRU, F32, 32, 256, 2, 400, 5, 0.1, H0, AUTO, 0},
    {GRU, F32, 72, 256, 1, 330, 5, 0.1, HID, AUTO, 0},
    {GRU, F32, 64, 256, 1, 330, 12, 0.1, H0, AUTO, SEQ_SATURATED},
    {GRU, F32, 64, 256, 2, 330, 5, 0.1, H0, AUTO, SEQ_MISALIGN},
    // States beyond [-1, 1]: the forward's fp16 h tile is scaled by the largest of them
    // (unscaled, 12 * 2^13 would overflow fp16); the per-step path gives the TF32 baseline.
    {GRU, F32, 64, 128, 1, 33, 20, 0.1, H0, AUTO, SEQ_WIDE},
    {GRU, F32, 64, 128, 1, 33, 20, 0.1, H0, STEP, SEQ_WIDE},
    {GRU, F32, 64, 128, 1, 33, 20, 0.05, HID, AUTO, SEQ_WIDE},
    {LSTM, F32, 64, 128, 1, 33, 20, 0.05, HID, AUTO, SEQ_WIDE},
    {LSTM, F32, 64, 256, 1, 33, 20, 0.05, HID, AUTO, SEQ_WIDE},
    {LSTM, F32, 64, 256, 1, 33, 20, 0.1, H0, AUTO, SEQ_WIDE},
    {LSTM, F32, 64, 256, 1, 330, 8, 0.1, HID, AUTO, SEQ_WIDE}, // the cluster backward
    {GRU, F32, 64, 256, 1, 33, 20, 0.05, HID, AUTO, SEQ_WIDE},
    {GRU, F32, 64, 256, 1, 330, 20, 0.1, H0, AUTO, SEQ_WIDE},
    // LSTM H=256 with no dL/dx asked for: the cluster backward writes D only as the weight
    // product's chunks (64 rows a cluster with a partial last one; 80 rows).
    {LSTM, F32, 64, 256, 1, 385, 6, 0.1, HID, AUTO, SEQ_NO_GX},
    {LSTM, F32, 48, 256, 1, 2000, 3, 0.1, H0, AUTO, SEQ_NO_GX},
    // Outputs and gradients one float past 16-byte alignment (LSTM H=256, two
    // layers). I=64: layer 0's dw256 chunks (the plan's cz) keep both loops in clusters, through
    // aligned scratch. I=72 (too wide for the cluster forward): the tape in tape_b8's blocks is
    // written and read by the per-step loops.
    {LSTM, F32, 64, 256, 2, 330, 5, 0.1, H0, AUTO, SEQ_MISALIGN},
    {LSTM, F32, 72, 256, 2, 330, 5, 0.1, HID, AUTO, SEQ_MISALIGN},
    // Issue 45's rows at small batches (resets, stored states and h0; fp32 and bf16): GRU H=64
    // with I=64, GRU H=256, two layers of GRU and LSTM at H=128, GRU and LSTM H=512 with
    // I=512, LSTM H=1024 with I=512.
    {GRU, F32, 64, 64, 1, 96, 24, 0.01, H0, AUTO, 0},
    {GRU, BF16, 64, 64, 1, 96, 24, 0.1, HID, AUTO, 0},
    {GRU, F32, 64, 256, 1, 96, 16, 0.01, HID, AUTO, 0},
    {GRU, BF16, 64, 256, 1, 40, 12, 0.1, H0, AUTO, 0},
    {GRU, F32, 64, 128, 2, 96, 24, 0.01, HID, AUTO, 0},
    {LSTM, F32, 64, 128, 2, 96, 24, 0.01, HID, AUTO, 0},
    {LSTM, BF16, 64, 128, 2, 40, 12, 0.1, H0, AUTO, 0},
    {LSTM, F32, 512, 512, 1, 24, 10, 0.01, HID, AUTO, 0},
    {GRU, F32, 512, 512, 1, 24, 10, 0.1, H0, AUTO, 0},
    {LSTM, BF16, 512, 512, 1, 16, 6, 0.1, NONE, AUTO, 0},
    {LSTM, F32, 512, 1024, 1, 8, 6, 0.01, HID, AUTO, 0},
    // The per-step cell kernels over more units than a block's 1024 threads (fp16 rows read back).
    {GRU, F32, 24, 1040, 1, 6, 4, 0.2, HID, AUTO, 0},
    {LSTM, BF16, 24, 1100, 1, 5, 3, 0.2, H0, AUTO, 0},
    // The per-step backward's dh product in one K slice (its tiles alone fill the SMs) and in two.
    {GRU, F32, 64, 512, 1, 1200, 3, 0.1, H0, AUTO, 0},
    {LSTM, F32, 64, 512, 1, 600, 3, 0.1, HID, AUTO, 0},
    // The per-step backward without dL/dx: D in fp16 alone (the weight gradients' product reads
    // it) in one layer, and in layer 0 of two (layer 1 keeps fp32 D for layer 0's gradient);
    // inputs off 16 bytes.
    {LSTM, F32, 64, 160, 1, 40, 12, 0.1, HID, AUTO, SEQ_NO_GX},
    {GRU, BF16, 48, 160, 2, 33, 9, 0.1, H0, AUTO, SEQ_NO_GX},
    {GRU, F32, 37, 160, 1, 21, 8, 0.1, NONE, AUTO, SEQ_NO_GX | SEQ_MISALIGN},
    // The wgmma GRU forward (sm_90) below its full width: H < 128, I_l < 64 (padding in both
    // operands), a second layer it does not take (I_l = H > 64).
    {GRU, F32, 20, 100, 2, 45, 13, 0.1, HID, AUTO, 0},
    {GRU, F32, 36, 124, 1, 17, 9, 0.3, H0, AUTO, 0},
    // Gates saturated far into the tails of the FAST cells' SFU tanh (biases of up to +-40:
    // exact in every mode, unlike large x, whose TF32 rounding alone would pass 1e-3).
    {GRU, F32, 64, 128, 1, 33, 12, 0.1, H0, AUTO, SEQ_SATURATED},
    {LSTM, F32, 64, 128, 1, 33, 12, 0.1, H0, AUTO, SEQ_SATURATED},
    {GRU, BF16, 64, 128, 1, 33, 12, 0.1, NONE, AUTO, SEQ_SATURATED},
    // The wgmma forward's producer and consumers with two steps (each x-part slot used once, no
    // slot waited for) and with three (the first slot reused).
    {GRU, F32, 64, 128, 1, 33, 2, 0.5, HID, AUTO, 0},
    {GRU, F32, 64, 128, 1, 18, 3, 0.0, H0, AUTO, 0},
    // The wgmma LSTM forward (sm_90) likewise: padded H and I_l with stored states (c included)
    // under a second layer it does not take, h0 and c0, two and three steps.
    {LSTM, F32, 20, 100, 2, 45, 13, 0.1, HID, AUTO, 0},
    {LSTM, F32, 36, 124, 1, 17, 9, 0.3, H0, AUTO, 0},
    {LSTM, F32, 64, 128, 1, 33, 2, 0.5, HID, AUTO, 0},
    {LSTM, F32, 64, 128, 1, 18, 3, 0.0, H0, AUTO, 0},
};

typedef void seq_test_fn(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                         const struct seq_case *sc, int arg);

struct edge_test {
    seq_test_fn *fn;
    struct seq_case sc;
    int arg;    // the test's own: variant bits (test_dw16), a kind (test_dw16_scales)
    bool quick; // also in --quick
};

// The model of the NaN and tiny-value checks: fp32, I=64, H=128 (64: the loops without dw16
// chunks), B=20 T=12, resets 0.1, h0.
#define EDGE(cell, H)                                                                              \
    { cell, F32, 64, H, 1, 20, 12, 0.1, H0, AUTO, 0 }
// 256 steps from h0, no resets.
#define CHAIN(cell, compute)                                                                       \
    { cell, compute, 64, 128, 1, 24, 256, 0.0, H0, AUTO, 0 }
#define SCALES(cell)                                                                               \
    { cell, F32, 64, 128, 1, 300, 20, 0.1, HID, AUTO, 0 }
#define STEP_SCALES(cell)                                                                          \
    { cell, F32, 64, 160, 1, 40, 20, 0.1, HID, AUTO, 0 }

static const struct edge_test edge_tests[] = {
    {test_nan, EDGE(GRU, 128), 0, false},
    {test_nan, EDGE(LSTM, 128), 0, false},
    {test_tiny, EDGE(GRU, 128), 0, false},
    {test_tiny, EDGE(LSTM, 128), 0, false},
    {test_tiny, EDGE(GRU, 64), 0, false},
    {test_tiny, EDGE(LSTM, 64), 0, false},
    {test_forget_chain, CHAIN(LSTM, F32), 0, false},
    {test_forget_chain, CHAIN(GRU, F32), 0, false},
    {test_forget_chain, CHAIN(GRU, BF16), 0, false},
    {test_wg_kp, {GRU, F32, 64, 128, 1, 37, 21, 0.2, H0, AUTO, 0}, 0, false},
    // Weight outliers: the wgmma forwards and the recomputing and tape backwards (H = 128),
    // H = 7 (its weight_hh not 16-byte aligned, its weight_ih a single-float tail), and the
    // cluster loops (H = 256, whose CTAs each take the maximum of their own gate rows).
    {test_weight_outliers, {GRU, F32, 64, 128, 1, 33, 12, 0.1, H0, AUTO, 0}, 0, false},
    {test_weight_outliers, {LSTM, F32, 64, 128, 1, 33, 12, 0.1, H0, AUTO, 0}, 0, false},
    {test_weight_outliers, {GRU, F32, 5, 7, 2, 9, 6, 0.2, H0, AUTO, 0}, 0, false},
    {test_weight_outliers, {GRU, F32, 64, 64, 1, 2048, 4, 0.1, H0, AUTO, 0}, 0, false},
    {test_weight_outliers, {LSTM, F32, 64, 64, 1, 2048, 4, 0.1, H0, AUTO, 0}, 0, false},
    {test_weight_outliers, {LSTM, F32, 64, 256, 1, 33, 8, 0.1, H0, AUTO, 0}, 0, false},
    {test_weight_outliers, {GRU, F32, 64, 256, 1, 330, 8, 0.1, H0, AUTO, 0}, 0, false},
    // x rows scaled: both cluster loops with layer 0's dw256 product, I_l below 64
    // (idle columns of the x tile) with stored states, H = 128's loops.
    {test_x_scales, {LSTM, F32, 64, 256, 1, 330, 6, 0.1, H0, AUTO, 0}, 0, false},
    {test_x_scales, {LSTM, F32, 40, 256, 1, 70, 5, 0.1, HID, AUTO, 0}, 0, false},
    {test_x_scales, {GRU, F32, 64, 256, 1, 330, 6, 0.1, H0, AUTO, 0}, 0, false},
    {test_x_scales, {GRU, F32, 40, 256, 1, 2000, 3, 0.1, HID, AUTO, 0}, 0, false},
    {test_x_scales, {LSTM, F32, 64, 128, 1, 33, 12, 0.1, H0, AUTO, 0}, 0, false},
    {test_x_scales, {GRU, F32, 64, 128, 1, 33, 12, 0.1, H0, AUTO, 0}, 0, false},
    // The weight-gradient products (seq_dw.cu; bf16, then TF32 mode): I_l = 64, 40, 8 and
    // (LSTM) 6 (x's zero columns in the chunks), a partial last block (B = 300, 2049), stored
    // states, a second layer (which gives dL/dx to layer 0, so only layer 0 takes the product),
    // B = T = 1. --quick: the first.
    {test_dw16, {GRU, BF16, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0}, 0, true},
    {test_dw16, {GRU, BF16, 40, 128, 1, 300, 20, 0.1, HID, AUTO, 0}, 0, false},
    {test_dw16, {GRU, BF16, 64, 128, 2, 37, 9, 0.2, H0, AUTO, 0}, 0, false},
    {test_dw16, {GRU, BF16, 8, 128, 1, 2049, 3, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {GRU, BF16, 64, 128, 1, 1, 1, 0.0, H0, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, BF16, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, BF16, 40, 128, 1, 300, 20, 0.1, HID, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, BF16, 64, 128, 2, 37, 9, 0.2, H0, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, BF16, 6, 128, 1, 2049, 3, 0.1, H0, AUTO, 0}, 0, false},
    {test_dw16, {GRU, F32, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {GRU, F32, 40, 128, 1, 300, 20, 0.1, HID, AUTO, 0}, 0, false},
    {test_dw16, {GRU, F32, 64, 128, 2, 37, 9, 0.2, H0, AUTO, 0}, 0, false},
    {test_dw16, {GRU, F32, 8, 128, 1, 2049, 3, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {GRU, F32, 64, 128, 1, 1, 1, 0.0, H0, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, F32, 64, 128, 1, 64, 33, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, F32, 40, 128, 1, 300, 20, 0.1, HID, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, F32, 64, 128, 2, 37, 9, 0.2, H0, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, F32, 6, 128, 1, 2049, 3, 0.1, H0, AUTO, 0}, 0, false},
    // The same products for a layer of H < 128 in H = 128's loops.
    {test_dw16, {GRU, F32, 64, 64, 1, 2100, 4, 0.1, HID, AUTO, 0}, 0, false},
    {test_dw16, {GRU, F32, 40, 100, 1, 64, 33, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {GRU, BF16, 64, 64, 1, 2048, 3, 0.1, H0, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, F32, 64, 64, 1, 2100, 4, 0.1, HID, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, F32, 40, 100, 1, 64, 33, 0.1, NONE, AUTO, 0}, 0, false},
    {test_dw16, {LSTM, BF16, 64, 64, 1, 2048, 3, 0.1, H0, AUTO, 0}, 0, false},
    // The GRU's layer 1 where its forward writes no chunks (NO_ZFWD: as with inputs off 16-byte
    // alignment): the mma.sync loop writes them from z's rows, x scaled by layer 0's bound.
    {test_dw16, {GRU, F32, 64, 128, 2, 1536, 3, 0.1, HID, AUTO, 0}, NO_ZFWD, false},
    {test_dw16, {GRU, F32, 64, 128, 2, 1536, 5, 0.1, HID, AUTO, SEQ_WIDE}, NO_ZFWD, false},
    {test_dw16, {GRU, BF16, 64, 128, 2, 1600, 3, 0.1, H0, AUTO, 0}, NO_ZFWD, false},
    // TF32 mode's products on values far from 1 (test_dw16_scales' kinds 0-5).
    {test_dw16_scales, SCALES(GRU), 0, false},
    {test_dw16_scales, SCALES(GRU), 1, false},
    {test_dw16_scales, SCALES(GRU), 2, false},
    {test_dw16_scales, SCALES(GRU), 3, false},
    {test_dw16_scales, SCALES(GRU), 4, false},
    {test_dw16_scales, SCALES(GRU), 5, false},
    {test_dw16_scales, SCALES(LSTM), 0, false},
    {test_dw16_scales, SCALES(LSTM), 1, false},
    {test_dw16_scales, SCALES(LSTM), 2, false},
    {test_dw16_scales, SCALES(LSTM), 3, false},
    {test_dw16_scales, SCALES(LSTM), 4, false},
    {test_dw16_scales, SCALES(LSTM), 5, false},
    // The per-step path's fp16 operands (H = 160, the plan's choice; two layers of H = 48 forced
    // onto it; bf16 mode): rows and weights far from 1.
    {test_tiny, {GRU, F32, 64, 160, 1, 20, 12, 0.1, H0, AUTO, 0}, 0, false},
    {test_tiny, {LSTM, F32, 64, 160, 1, 20, 12, 0.1, H0, AUTO, 0}, 0, false},
    {test_dw16_scales, STEP_SCALES(GRU), 1, false},
    {test_dw16_scales, STEP_SCALES(GRU), 2, false},
    {test_dw16_scales, STEP_SCALES(LSTM), 3, false},
    {test_dw16_scales, STEP_SCALES(LSTM), 5, false},
    {test_dw16_scales, STEP_SCALES(GRU), 6, false},
    {test_dw16_scales, STEP_SCALES(LSTM), 6, false},
    {test_weight_outliers, {LSTM, F32, 64, 160, 1, 33, 12, 0.1, H0, AUTO, 0}, 0, false},
    {test_dw_orders, {LSTM, F32, 72, 160, 2, 21, 9, 0.1, HID, AUTO, 0}, 0, true},
    {test_dw_orders, {GRU, BF16, 40, 160, 1, 17, 6, 0.1, H0, AUTO, SEQ_MISALIGN}, 0, false},
    {test_step16_scales, {GRU, F32, 64, 160, 1, 24, 12, 0.0, H0, AUTO, 0}, 0, true},
    {test_step16_scales, {LSTM, F32, 64, 160, 1, 24, 12, 0.0, H0, AUTO, 0}, 0, false},
    {test_step16_scales, {GRU, F32, 40, 48, 2, 24, 12, 0.1, H0, STEP, 0}, 1, false},
    {test_step16_scales, {LSTM, BF16, 64, 160, 1, 24, 12, 0.1, H0, AUTO, 0}, 1, false},
    // Layer 0's z chunks from the forward; B = T = 1: the tape's z space is the chunks'.
    {test_zfwd, {LSTM, F32, 64, 128, 1, 300, 20, 0.1, H0, AUTO, 0}, 0, false},
    {test_zfwd, {LSTM, F32, 40, 128, 2, 37, 9, 0.2, HID, AUTO, 0}, 0, false},
    {test_zfwd, {LSTM, F32, 64, 128, 1, 1, 1, 0.0, NONE, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, F32, 64, 128, 1, 300, 20, 0.1, H0, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, F32, 40, 128, 2, 37, 9, 0.2, HID, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, F32, 64, 128, 1, 1, 1, 0.0, NONE, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, BF16, 64, 128, 1, 300, 20, 0.1, H0, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, BF16, 40, 128, 2, 37, 9, 0.2, HID, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, BF16, 64, 128, 1, 1, 1, 0.0, NONE, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, F32, 64, 64, 1, 2048, 4, 0.1, H0, AUTO, 0}, 0, false},
    {test_zfwd, {GRU, BF16, 40, 112, 2, 37, 9, 0.2, HID, AUTO, 0}, 0, false},
    {test_zfwd, {LSTM, F32, 64, 64, 1, 2048, 4, 0.1, H0, AUTO, 0}, 0, false},
    {test_zfwd, {LSTM, F32, 40, 112, 2, 37, 9, 0.2, HID, AUTO, 0}, 0, false},
    {test_zfwd, {LSTM, F32, 64, 128, 2, 2048, 3, 0.1, HID, AUTO, 0}, 0, false},
    {test_zfwd, {LSTM, F32, 64, 128, 3, 2049, 2, 0.2, H0, AUTO, 0}, 0, false},
    {test_tape_align, {GRU, F32, 64, 128, 1, 5, 3, 0.0, NONE, AUTO, 0}, 0, true},
    // The per-step path's graphs: two layers (four loops), and H = 160 (the plan's own choice).
    {test_graph_reuse, {GRU, F32, 40, 48, 2, 37, 19, 0.1, H0, STEP, 0}, 0, true},
    {test_graph_reuse, {LSTM, F32, 64, 160, 1, 29, 23, 0.1, H0, AUTO, 0}, 0, false},
};

int main(int argc, char **argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    struct rnnd_backend gpu = {0}, cpu = {0};
    gpu_check_open(&gpu, &cpu);
    const struct seq_case *cases = quick ? quick_cases : seq_cases;
    const size_t ncases = quick ? sizeof(quick_cases) / sizeof(quick_cases[0])
                                : sizeof(seq_cases) / sizeof(seq_cases[0]);
    for (size_t i = 0; i < ncases; i++)
        test_seq(&gpu, &cpu, &cases[i]);
    for (size_t i = 0; i < sizeof(edge_tests) / sizeof(edge_tests[0]); i++)
        if (!quick || edge_tests[i].quick)
            edge_tests[i].fn(&gpu, &cpu, &edge_tests[i].sc, edge_tests[i].arg);
    return gpu_check_close(&gpu, &cpu);
}
