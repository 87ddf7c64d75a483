/*
 * test_cpu_rnn.c: the CPU reference backend's sequence forward/backward and single step.
 *
 *   - against PyTorch float64 fixtures (tests/fixtures/gen_fixtures.py): forward norm-wise
 *     relative error <= 1e-5, every gradient <= 1e-4 (fp32); ieee gives the same bits as fp32;
 *     bf16 stays within 2e-2;
 *   - finite differences on tiny cases, fp32 kernels with the loss summed in double, for every
 *     gradient the backward returns (weights, x, h0/c0, stored states), plus a check that the
 *     comparison rejects a gradient with one wrong element;
 *   - rnn_step called T times reproduces rnn_forward bit for bit (states in a slot table);
 *   - forward with and without a tape agree bitwise; backward accumulates the parameter grads;
 *   - bad arguments return RNND_EINVAL and write nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "rnnd_kernels.h"
#include "kernel_fixture.h"

static struct fx_file rnn_fx;
static struct rnnd_backend cpu;

// ---------------------------------------------------------------------------------------------
// One case's host buffers

struct run {
    struct rnnd_model m;
    int B, T;
    size_t P, nx, nout, nblh, nbtlh;
    uint8_t *is_init;                            // (B, T)
    float *x, *h0, *c0, *hidden, *cell, *params; // inputs
    float *grad_out, *grad_h_n, *grad_c_n;       // upstream gradients
    float *out, *h_n, *c_n;                      // forward outputs
    void *tape;
    float *gp, *gx, *gh0, *gc0, *ghidden, *gcell; // backward outputs
};

static float *zalloc(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}

// Sizes and output buffers for m, B, T; the inputs are set by the caller.
static void run_alloc(struct run *r, const struct rnnd_model *m, int B, int T) {
    memset(r, 0, sizeof(*r));
    r->m = *m;
    r->B = B;
    r->T = T;
    r->P = rnnd_model_param_count(m);
    r->nx = (size_t)B * T * m->I;
    r->nout = (size_t)B * T * m->H;
    r->nblh = (size_t)B * m->L * m->H;
    r->nbtlh = r->nblh * T;
    bool lstm = m->cell == RNND_CELL_LSTM;
    r->out = zalloc(r->nout);
    r->h_n = zalloc(r->nblh);
    r->c_n = lstm ? zalloc(r->nblh) : NULL;
    r->tape = malloc(cpu.ops->tape_bytes(cpu.ctx, m, B, T));
    assert_non_null(r->tape);
    r->gp = zalloc(r->P);
    r->gx = zalloc(r->nx);
    r->gh0 = zalloc(r->nblh);
    r->gc0 = lstm ? zalloc(r->nblh) : NULL;
}

static void run_free(struct run *r) {
    void *p[] = {r->is_init,  r->x,        r->h0,       r->c0,  r->hidden,  r->cell, r->params,
                 r->grad_out, r->grad_h_n, r->grad_c_n, r->out, r->h_n,     r->c_n,  r->tape,
                 r->gp,       r->gx,       r->gh0,      r->gc0, r->ghidden, r->gcell};
    for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
        free(p[i]);
    memset(r, 0, sizeof(*r));
}

// Loads fixture case fc with the given compute mode.
static void run_from_fixture(struct run *r, const struct fx_case *fc, enum rnnd_compute compute) {
    struct rnnd_model m = {
        .cell = fc->meta[0] ? RNND_CELL_LSTM : RNND_CELL_GRU,
        .compute = compute,
        .I = fc->meta[1],
        .H = fc->meta[2],
        .L = fc->meta[3],
    };
    run_alloc(r, &m, fc->meta[4], fc->meta[5]);
    const struct fx_tensor *ii = fx_get(fc, "is_init");
    r->is_init = malloc((size_t)ii->count);
    for (int i = 0; i < ii->count; i++)
        r->is_init[i] = ii->data[i] != 0.0;
    r->x = fx_floats(fc, "x");
    r->params = fx_floats(fc, "params");
    r->h0 = fx_floats(fc, "h0");
    r->c0 = fx_floats(fc, "c0");
    r->hidden = fx_floats(fc, "hidden");
    r->cell = fx_floats(fc, "cell");
    r->grad_out = fx_floats(fc, "grad_out");
    r->grad_h_n = fx_floats(fc, "grad_h_n");
    r->grad_c_n = fx_floats(fc, "grad_c_n");
    assert_int_equal(fx_get(fc, "params")->count, (int)r->P);
    if (r->hidden) {
        r->ghidden = zalloc(r->nbtlh);
        r->gcell = r->cell ? zalloc(r->nbtlh) : NULL;
    }
}

static struct rnnd_seq run_seq(const struct run *r) {
    return (struct rnnd_seq){
        .B = r->B,
        .T = r->T,
        .x = r->x,
        .is_init = r->is_init,
        .h0 = r->h0,
        .c0 = r->c0,
        .hidden = r->hidden,
        .cell = r->cell,
    };
}

// grads->h0 is asked for only when the initial state is not a stored one.
static struct rnnd_seq_grads run_grads(const struct run *r) {
    return (struct rnnd_seq_grads){
        .params = r->gp,
        .x = r->gx,
        .h0 = r->hidden ? NULL : r->gh0,
        .c0 = r->hidden ? NULL : r->gc0,
        .hidden = r->ghidden,
        .cell = r->gcell,
    };
}

static void run_forward(struct run *r, bool with_tape) {
    struct rnnd_seq seq = run_seq(r);
    assert_int_equal(cpu.ops->rnn_forward(cpu.ctx, r->out, r->h_n, r->c_n,
                                          with_tape ? r->tape : NULL, &seq, r->params, &r->m),
                     0);
}

static void run_backward(struct run *r) {
    struct rnnd_seq seq = run_seq(r);
    struct rnnd_seq_grads g = run_grads(r);
    assert_int_equal(cpu.ops->rnn_backward(cpu.ctx, &g, r->grad_out, r->grad_h_n, r->grad_c_n,
                                           r->tape, &seq, r->params, &r->m),
                     0);
}

// Compares a with the fixture tensor name; returns the error, fails the test above tol.
static double check(int ci, const float *a, const struct fx_case *fc, const char *name,
                    size_t offset, size_t n, double tol, const char *label) {
    const struct fx_tensor *t = fx_get(fc, name);
    assert_non_null(t);
    assert_true(offset + n <= (size_t)t->count);
    double e = fx_rel_err(a, t->data + offset, n);
    if (!(e <= tol)) {
        print_error("case %d (%s L=%d I=%d H=%d T=%d reset=%.1f stored=%d h0=%d): %s error %.3e > "
                    "%.0e\n",
                    ci, fc->meta[0] ? "lstm" : "gru", fc->meta[3], fc->meta[1], fc->meta[2],
                    fc->meta[5], fc->meta[10] / 1000.0, fc->meta[7], fc->meta[6],
                    label ? label : name, e, tol);
        fail();
    }
    return e;
}

// Every output of a forward+backward against the fixture; returns the largest errors.
static void check_case(int ci, const struct run *r, const struct fx_case *fc, double tol_fwd,
                       double tol_grad, double *max_fwd, double *max_grad) {
    double ef = check(ci, r->out, fc, "out", 0, r->nout, tol_fwd, NULL);
    ef = fmax(ef, check(ci, r->h_n, fc, "h_n", 0, r->nblh, tol_fwd, NULL));
    if (r->c_n)
        ef = fmax(ef, check(ci, r->c_n, fc, "c_n", 0, r->nblh, tol_fwd, NULL));
    double eg = 0.0;
    for (int k = 0; k < rnnd_model_param_tensors(&r->m); k++) {
        struct rnnd_param_tensor t;
        rnnd_model_param_tensor(&r->m, k, &t);
        eg = fmax(eg, check(ci, r->gp + t.offset, fc, "grad_params", t.offset, t.count, tol_grad,
                            t.name));
    }
    eg = fmax(eg, check(ci, r->gx, fc, "grad_x", 0, r->nx, tol_grad, NULL));
    if (!r->hidden) {
        eg = fmax(eg, check(ci, r->gh0, fc, "grad_h0", 0, r->nblh, tol_grad, NULL));
        if (r->gc0)
            eg = fmax(eg, check(ci, r->gc0, fc, "grad_c0", 0, r->nblh, tol_grad, NULL));
    } else {
        eg = fmax(eg, check(ci, r->ghidden, fc, "grad_hidden", 0, r->nbtlh, tol_grad, NULL));
        if (r->gcell)
            eg = fmax(eg, check(ci, r->gcell, fc, "grad_cell", 0, r->nbtlh, tol_grad, NULL));
    }
    *max_fwd = fmax(*max_fwd, ef);
    *max_grad = fmax(*max_grad, eg);
}

// ---------------------------------------------------------------------------------------------
// Fixtures

static void fixtures_in_mode(enum rnnd_compute compute, double tol_fwd, double tol_grad) {
    double max_fwd = 0.0, max_grad = 0.0;
    for (int ci = 0; ci < rnn_fx.ncases; ci++) {
        struct run r;
        run_from_fixture(&r, &rnn_fx.cases[ci], compute);
        run_forward(&r, true);
        run_backward(&r);
        check_case(ci, &r, &rnn_fx.cases[ci], tol_fwd, tol_grad, &max_fwd, &max_grad);
        run_free(&r);
    }
    print_message("%d cases: largest forward error %.2e, gradient error %.2e\n", rnn_fx.ncases,
                  max_fwd, max_grad);
}

static void test_fixtures_fp32(void **state) {
    (void)state;
    fixtures_in_mode(RNND_COMPUTE_FP32, 1e-5, 1e-4);
}

static void test_fixtures_bf16(void **state) {
    (void)state;
    fixtures_in_mode(RNND_COMPUTE_BF16, 2e-2, 2e-2);
}

// On the CPU "ieee" and "fp32" are one and the same arithmetic: the same bits.
static void test_ieee_equals_fp32(void **state) {
    (void)state;
    for (int ci = 0; ci < rnn_fx.ncases; ci += 5) {
        struct run a, b;
        run_from_fixture(&a, &rnn_fx.cases[ci], RNND_COMPUTE_FP32);
        run_from_fixture(&b, &rnn_fx.cases[ci], RNND_COMPUTE_IEEE);
        run_forward(&a, true);
        run_backward(&a);
        run_forward(&b, true);
        run_backward(&b);
        assert_memory_equal(a.out, b.out, a.nout * sizeof(float));
        assert_memory_equal(a.gp, b.gp, a.P * sizeof(float));
        assert_memory_equal(a.gx, b.gx, a.nx * sizeof(float));
        run_free(&a);
        run_free(&b);
    }
}

// Forward with no tape runs on a scratch tape: the same bits as with one.
static void test_forward_without_tape(void **state) {
    (void)state;
    for (int ci = 0; ci < rnn_fx.ncases; ci += 3) {
        struct run r;
        run_from_fixture(&r, &rnn_fx.cases[ci], RNND_COMPUTE_FP32);
        run_forward(&r, true);
        float *out = zalloc(r.nout), *h_n = zalloc(r.nblh);
        memcpy(out, r.out, r.nout * sizeof(float));
        memcpy(h_n, r.h_n, r.nblh * sizeof(float));
        memset(r.out, 0, r.nout * sizeof(float));
        run_forward(&r, false);
        assert_memory_equal(out, r.out, r.nout * sizeof(float));
        assert_memory_equal(h_n, r.h_n, r.nblh * sizeof(float));
        free(out);
        free(h_n);
        run_free(&r);
    }
}

// Parameter gradients are accumulated (+=), the others overwritten (=): a second backward
// doubles grads->params and leaves grads->x as it was.
static void test_backward_accumulates(void **state) {
    (void)state;
    for (int ci = 0; ci < rnn_fx.ncases; ci += 7) {
        struct run r;
        run_from_fixture(&r, &rnn_fx.cases[ci], RNND_COMPUTE_FP32);
        run_forward(&r, true);
        run_backward(&r);
        float *gp = zalloc(r.P), *gx = zalloc(r.nx);
        memcpy(gp, r.gp, r.P * sizeof(float));
        memcpy(gx, r.gx, r.nx * sizeof(float));
        run_backward(&r);
        // Not bit-exact: sgemm adds its K blocks into C one by one (g + p1 + p2 ...).
        for (size_t i = 0; i < r.P; i++)
            assert_true(fabsf(r.gp[i] - 2.0f * gp[i]) <= 1e-6f * (1.0f + fabsf(gp[i])));
        assert_memory_equal(gx, r.gx, r.nx * sizeof(float));
        free(gp);
        free(gx);
        run_free(&r);
    }
}

// ---------------------------------------------------------------------------------------------
// Random cases (finite differences, single step)

static uint64_t rng_state = 42;

static double rng_uniform(void) { // [0, 1), splitmix64
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

static float *rand_floats(size_t n, double scale) {
    float *p = zalloc(n);
    for (size_t i = 0; i < n; i++)
        p[i] = (float)((2.0 * rng_uniform() - 1.0) * scale);
    return p;
}

struct rand_spec {
    enum rnnd_cell cell;
    int L, I, H, B, T;
    double reset_prob;
    bool stored, h0;
};

static void run_random(struct run *r, const struct rand_spec *s) {
    struct rnnd_model m = {
        .cell = s->cell, .compute = RNND_COMPUTE_FP32, .I = s->I, .H = s->H, .L = s->L};
    run_alloc(r, &m, s->B, s->T);
    bool lstm = s->cell == RNND_CELL_LSTM;
    // Weights a little above PyTorch's 1/sqrt(H) init, so gates are neither flat nor saturated.
    r->params = rand_floats(r->P, fmin(0.6, 2.0 / sqrt((double)s->H)));
    r->x = rand_floats(r->nx, 1.0);
    r->is_init = malloc((size_t)s->B * s->T);
    for (int i = 0; i < s->B * s->T; i++)
        r->is_init[i] = rng_uniform() < s->reset_prob;
    if (s->h0) {
        r->h0 = rand_floats(r->nblh, 0.8);
        r->c0 = lstm ? rand_floats(r->nblh, 0.8) : NULL;
    }
    if (s->stored) {
        r->hidden = rand_floats(r->nbtlh, 0.8);
        r->cell = lstm ? rand_floats(r->nbtlh, 0.8) : NULL;
        r->ghidden = zalloc(r->nbtlh);
        r->gcell = lstm ? zalloc(r->nbtlh) : NULL;
    }
    r->grad_out = rand_floats(r->nout, 1.0);
    r->grad_h_n = rand_floats(r->nblh, 1.0);
    r->grad_c_n = lstm ? rand_floats(r->nblh, 1.0) : NULL;
}

// The loss the backward differentiates: sum(out grad_out) + sum(h_n grad_h_n) + sum(c_n
// grad_c_n), from an fp32 forward, summed in double.
static double fd_loss(struct run *r) {
    run_forward(r, false);
    double s = 0.0;
    for (size_t i = 0; i < r->nout; i++)
        s += (double)r->out[i] * r->grad_out[i];
    for (size_t i = 0; i < r->nblh; i++) {
        s += (double)r->h_n[i] * r->grad_h_n[i];
        if (r->c_n)
            s += (double)r->c_n[i] * r->grad_c_n[i];
    }
    return s;
}

// Central differences of the loss in every element of v (n floats), against the analytic
// gradient g. Each element must satisfy |fd - g| <= FD_ATOL + FD_RTOL |g|.
//
// Tolerances, by measurement: with step FD_EPS = 1e-2, the fp32 forward's rounding noise in the
// loss and the O(eps^2) truncation error leave |fd - g| <= 1e-4 on correct gradients (at most
// 4% of the bound below, i.e. a 20x margin). A gradient that drops or misroutes a term is off
// by far more: each of these deliberate breakages was verified to fail this test (and the
// fixture test): GRU d(W_hn h) without the factor r; GRU direct dh with (1 - z) for z; LSTM df
// with tanh(c) for c; a zero reset that does not cut the carried gradient; the stored-cell
// gradient at t = 0 dropped; one row missing from the bias gradient's sum.
// test_fd_detects_wrong_gradient keeps checking that one element off by 2e-3 + 1% is caught.
#define FD_EPS  1e-2f
#define FD_ATOL 5e-4
#define FD_RTOL 2e-3

static int fd_compare(struct run *r, float *v, const float *g, size_t n, const char *what,
                      bool verbose) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        float keep = v[i];
        float up = keep + FD_EPS, down = keep - FD_EPS;
        v[i] = up;
        double lp = fd_loss(r);
        v[i] = down;
        double lm = fd_loss(r);
        v[i] = keep;
        double fd = (lp - lm) / ((double)up - (double)down);
        if (!(fabs(fd - g[i]) <= FD_ATOL + FD_RTOL * fabs(g[i]))) {
            if (verbose && bad < 5)
                print_error("%s[%zu]: finite difference %.6f, backward %.6f\n", what, i, fd, g[i]);
            bad++;
        }
    }
    return bad;
}

static const struct rand_spec fd_specs[] = {
    // cell, L, I, H, B, T, reset probability, stored states, h0
    {RNND_CELL_GRU, 1, 3, 4, 2, 5, 0.0, false, true},
    {RNND_CELL_GRU, 2, 3, 4, 2, 6, 0.3, false, true},
    {RNND_CELL_GRU, 2, 3, 4, 2, 6, 0.3, true, false},
    {RNND_CELL_GRU, 1, 2, 3, 3, 4, 0.5, false, false},
    {RNND_CELL_LSTM, 1, 3, 4, 2, 5, 0.0, false, true},
    {RNND_CELL_LSTM, 2, 3, 4, 2, 6, 0.3, false, true},
    {RNND_CELL_LSTM, 2, 3, 4, 2, 6, 0.3, true, false},
    {RNND_CELL_LSTM, 1, 2, 3, 3, 4, 0.5, false, false},
};

static void test_fd_gradients(void **state) {
    (void)state;
    for (size_t s = 0; s < sizeof(fd_specs) / sizeof(fd_specs[0]); s++) {
        struct run r;
        run_random(&r, &fd_specs[s]);
        run_forward(&r, true);
        run_backward(&r);
        int bad = fd_compare(&r, r.params, r.gp, r.P, "params", true);
        bad += fd_compare(&r, r.x, r.gx, r.nx, "x", true);
        if (r.h0)
            bad += fd_compare(&r, r.h0, r.gh0, r.nblh, "h0", true);
        if (r.c0)
            bad += fd_compare(&r, r.c0, r.gc0, r.nblh, "c0", true);
        if (r.hidden)
            bad += fd_compare(&r, r.hidden, r.ghidden, r.nbtlh, "hidden", true);
        if (r.cell)
            bad += fd_compare(&r, r.cell, r.gcell, r.nbtlh, "cell", true);
        if (bad)
            print_error("finite-difference spec %zu: %d elements off\n", s, bad);
        assert_int_equal(bad, 0);
        run_free(&r);
    }
}

// The comparison is sharp enough to see one element off by 2e-3 + 1%.
static void test_fd_detects_wrong_gradient(void **state) {
    (void)state;
    for (size_t s = 0; s < sizeof(fd_specs) / sizeof(fd_specs[0]); s++) {
        struct run r;
        run_random(&r, &fd_specs[s]);
        run_forward(&r, true);
        run_backward(&r);
        size_t i = (size_t)(rng_uniform() * (double)r.P);
        r.gp[i] += 2e-3f + 0.01f * fabsf(r.gp[i]);
        assert_int_equal(fd_compare(&r, r.params, r.gp, r.P, "params", false), 1);
        run_free(&r);
    }
}

// rnn_step over t = 0 .. T-1, with the rows' states in a larger slot table (permuted slots),
// gives rnn_forward's outputs and final states.
//
// Not bit for bit, because OpenBLAS does not allow it: rnn_forward computes the input projection
// with sgemms over blocks of the T*B rows and rnn_step with sgemms over the B rows, and OpenBLAS
// gives a row different last bits depending on M (rows in a partial M block of its micro-kernel
// are summed in another order; measured with OpenBLAS 0.3.21 on one thread: M = 64 and M = 8192
// agree, M = 1, 3, 17 do not). Everything else is the same code on both paths (the recurrent
// sgemm over a step's rows, the pointwise cell), so the two differ by the rounding of the input
// projection only: every element must be within STEP_ATOL of the forward and the whole output
// within STEP_RTOL norm-wise (the largest difference seen is ~3e-7); the test reports how many
// steps matched bit for bit.
#define STEP_ATOL 2e-6f
#define STEP_RTOL 1e-6

static float step_max_diff;

static bool close_to(const float *a, const float *b, size_t n, double *num, double *den) {
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        *num += d * d;
        *den += (double)b[i] * b[i];
        ok = ok && fabsf(a[i] - b[i]) <= STEP_ATOL;
        if (fabsf(a[i] - b[i]) > step_max_diff)
            step_max_diff = fabsf(a[i] - b[i]);
    }
    return ok;
}

static void test_step_matches_forward(void **state) {
    (void)state;
    int exact = 0, total = 0;
    static const struct rand_spec specs[] = {
        {RNND_CELL_GRU, 1, 5, 7, 3, 9, 0.2, false, true},
        {RNND_CELL_GRU, 2, 16, 32, 17, 12, 0.1, false, false},
        {RNND_CELL_GRU, 3, 64, 128, 64, 6, 0.1, false, true},
        {RNND_CELL_LSTM, 1, 5, 7, 3, 9, 0.2, false, true},
        {RNND_CELL_LSTM, 2, 16, 32, 17, 12, 0.1, false, false},
        {RNND_CELL_LSTM, 2, 64, 128, 64, 6, 0.1, false, true},
    };
    for (size_t s = 0; s < sizeof(specs) / sizeof(specs[0]); s++) {
        struct run r;
        run_random(&r, &specs[s]);
        run_forward(&r, true);
        const struct rnnd_model *m = &r.m;
        int B = r.B, T = r.T, H = m->H, S = B + 5;
        size_t row = (size_t)m->L * H;
        bool lstm = m->cell == RNND_CELL_LSTM;
        // Two rows per env, b's at slots[b] and slots[b] + S: the steps alternate between them.
        float *state_h = rand_floats(2 * (size_t)S * row, 1.0), *state_c = NULL;
        if (lstm)
            state_c = rand_floats(2 * (size_t)S * row, 1.0);
        int32_t *slots = malloc(sizeof(int32_t) * B), *other = malloc(sizeof(int32_t) * B);
        for (int b = 0; b < B; b++) {
            slots[b] = (int32_t)((b * 7 + 3) % S); // distinct: 7 and S share no factor here
            other[b] = slots[b] + S;
            float *dh = state_h + (size_t)slots[b] * row;
            if (r.h0)
                memcpy(dh, r.h0 + (size_t)b * row, row * sizeof(float));
            else
                memset(dh, 0, row * sizeof(float));
            if (lstm) {
                float *dc = state_c + (size_t)slots[b] * row;
                if (r.c0)
                    memcpy(dc, r.c0 + (size_t)b * row, row * sizeof(float));
                else
                    memset(dc, 0, row * sizeof(float));
            }
        }
        float *x = zalloc((size_t)B * m->I), *out = zalloc((size_t)B * H);
        float *hb = zalloc((size_t)B * row), *cb = lstm ? zalloc((size_t)B * row) : NULL;
        uint8_t *ii = malloc((size_t)B);
        for (int t = 0; t < T; t++) {
            for (int b = 0; b < B; b++) {
                memcpy(x + (size_t)b * m->I, r.x + ((size_t)b * T + t) * m->I,
                       sizeof(float) * m->I);
                ii[b] = r.is_init[(size_t)b * T + t];
            }
            struct rnnd_step st = {.B = B,
                                   .x = x,
                                   .is_init = ii,
                                   .slots = t % 2 ? other : slots,
                                   .slots_new = t % 2 ? slots : other,
                                   .state_h = state_h,
                                   .state_c = state_c,
                                   .out = out,
                                   .h_before = hb,
                                   .c_before = cb};
            assert_int_equal(cpu.ops->rnn_step(cpu.ctx, &st, r.params, m), 0);
            double num = 0.0, den = 0.0;
            bool same = true;
            for (int b = 0; b < B; b++) {
                const float *ref = r.out + ((size_t)b * T + t) * H;
                assert_true(close_to(out + (size_t)b * H, ref, (size_t)H, &num, &den));
                same = same && memcmp(out + (size_t)b * H, ref, sizeof(float) * H) == 0;
                if (ii[b]) // a reset row starts from zero
                    for (size_t j = 0; j < row; j++)
                        assert_true(hb[(size_t)b * row + j] == 0.0f);
            }
            assert_true(sqrt(num / den) <= STEP_RTOL);
            exact += same;
            total++;
        }
        double num = 0.0, den = 0.0;
        const int32_t *last = T % 2 ? other : slots; // where the last step wrote
        for (int b = 0; b < B; b++) {
            assert_true(close_to(state_h + (size_t)last[b] * row, r.h_n + (size_t)b * row, row,
                                 &num, &den));
            if (lstm)
                assert_true(close_to(state_c + (size_t)last[b] * row, r.c_n + (size_t)b * row, row,
                                     &num, &den));
        }
        assert_true(sqrt(num / den) <= STEP_RTOL);
        free(state_h);
        free(state_c);
        free(slots);
        free(other);
        free(x);
        free(out);
        free(hb);
        free(cb);
        free(ii);
        run_free(&r);
    }
    print_message("%d of %d steps bit-identical to rnn_forward, largest difference %.1e\n", exact,
                  total, (double)step_max_diff);
}

// is_init NULL means no row resets; a bf16 step equals the bf16 forward too.
static void test_step_defaults_and_bf16(void **state) {
    (void)state;
    struct rand_spec spec = {RNND_CELL_GRU, 2, 6, 10, 4, 1, 0.0, false, true};
    struct run r;
    run_random(&r, &spec);
    r.m.compute = RNND_COMPUTE_BF16;
    run_forward(&r, true);
    size_t row = (size_t)r.m.L * r.m.H;
    float *state_h = zalloc(8 * row), *out = zalloc(4 * (size_t)r.m.H);
    memcpy(state_h, r.h0, 4 * row * sizeof(float));
    int32_t slots[4] = {0, 1, 2, 3}, slots_new[4] = {4, 5, 6, 7};
    struct rnnd_step st = {
        .B = 4, .x = r.x, .slots = slots, .slots_new = slots_new, .state_h = state_h, .out = out};
    assert_int_equal(cpu.ops->rnn_step(cpu.ctx, &st, r.params, &r.m), 0);
    assert_memory_equal(out, r.out, 4 * (size_t)r.m.H * sizeof(float));
    assert_memory_equal(state_h + 4 * row, r.h_n, 4 * row * sizeof(float));
    free(state_h);
    free(out);
    run_free(&r);
}

// The thread count changes nothing but sgemm's blocking: 1 and 3 threads agree to rounding, and
// one backend gives the same bits every time.
static void test_thread_count_invariance(void **state) {
    (void)state;
    static const struct rand_spec specs[] = {
        {RNND_CELL_GRU, 2, 32, 64, 37, 25, 0.1, true, false},
        {RNND_CELL_LSTM, 2, 32, 64, 37, 25, 0.1, false, true},
    };
    setenv("RNND_CPU_THREADS", "1", 1);
    struct rnnd_backend one;
    assert_int_equal(rnnd_backend_cpu_init(&one), 0);
    setenv("RNND_CPU_THREADS", "3", 1);
    assert_non_null(strstr(cpu.device, "3 threads"));
    for (size_t s = 0; s < sizeof(specs) / sizeof(specs[0]); s++) {
        struct run a, b;
        uint64_t seed = rng_state;
        run_random(&a, &specs[s]);
        rng_state = seed;
        run_random(&b, &specs[s]);
        run_forward(&a, true);
        run_backward(&a);
        // b on one thread
        struct rnnd_backend keep = cpu;
        cpu = one;
        run_forward(&b, true);
        run_backward(&b);
        cpu = keep;
        double e_out = 0, e_gp = 0, e_gx = 0, num, den;
        num = den = 0;
        for (size_t i = 0; i < a.nout; i++) {
            num += ((double)a.out[i] - b.out[i]) * ((double)a.out[i] - b.out[i]);
            den += (double)b.out[i] * b.out[i];
        }
        e_out = sqrt(num / den);
        num = den = 0;
        for (size_t i = 0; i < a.P; i++) {
            num += ((double)a.gp[i] - b.gp[i]) * ((double)a.gp[i] - b.gp[i]);
            den += (double)b.gp[i] * b.gp[i];
        }
        e_gp = sqrt(num / den);
        num = den = 0;
        for (size_t i = 0; i < a.nx; i++) {
            num += ((double)a.gx[i] - b.gx[i]) * ((double)a.gx[i] - b.gx[i]);
            den += (double)b.gx[i] * b.gx[i];
        }
        e_gx = sqrt(num / den);
        print_message("1 vs 3 threads: out %.1e, grad params %.1e, grad x %.1e\n", e_out, e_gp,
                      e_gx);
        assert_true(e_out <= 1e-6 && e_gp <= 1e-6 && e_gx <= 1e-6);
        // Deterministic: the 3-thread run again gives the same bits.
        float *out = zalloc(a.nout), *gp = zalloc(a.P);
        memcpy(out, a.out, a.nout * sizeof(float));
        memcpy(gp, a.gp, a.P * sizeof(float));
        memset(a.gp, 0, a.P * sizeof(float));
        run_forward(&a, true);
        run_backward(&a);
        assert_memory_equal(out, a.out, a.nout * sizeof(float));
        assert_memory_equal(gp, a.gp, a.P * sizeof(float));
        free(out);
        free(gp);
        run_free(&a);
        run_free(&b);
    }
    rnnd_backend_free(&one);
}

// ---------------------------------------------------------------------------------------------
// Bad arguments: RNND_EINVAL, nothing written.

static bool all_equal(const float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return false;
    return true;
}

// The CPU backend names its one implementation for every model and refuses what it would refuse
// to run, writing nothing past len.
static void test_plan_name(void **state) {
    (void)state;
    const struct rnnd_backend_ops *ops = cpu.ops;
    const struct rnnd_model m = {
        .cell = RNND_CELL_GRU, .compute = RNND_COMPUTE_FP32, .I = 64, .H = 128, .L = 2};
    char buf[32];
    assert_int_equal(ops->plan_name(cpu.ctx, &m, 2048, buf, sizeof(buf)), 0);
    assert_string_equal(buf, "cpu_reference");
    char small[5] = "xxxx";
    assert_int_equal(ops->plan_name(cpu.ctx, &m, 1, small, 4), 0);
    assert_string_equal(small, "cpu");
    struct rnnd_model bad = m;
    bad.H = 0;
    assert_int_equal(ops->plan_name(cpu.ctx, &bad, 1, buf, sizeof(buf)), RNND_EINVAL);
    assert_int_equal(ops->plan_name(cpu.ctx, &m, 0, buf, sizeof(buf)), RNND_EINVAL);
    assert_int_equal(ops->plan_name(cpu.ctx, &m, 1, NULL, 8), RNND_EINVAL);
}

static void test_bad_arguments(void **state) {
    (void)state;
    struct rand_spec spec = {RNND_CELL_LSTM, 2, 3, 4, 2, 3, 0.3, false, true};
    struct run r;
    run_random(&r, &spec);
    const struct rnnd_backend_ops *ops = cpu.ops;
    const float S = -7.0f; // sentinel
    for (size_t i = 0; i < r.nout; i++)
        r.out[i] = S;
    for (size_t i = 0; i < r.nblh; i++)
        r.h_n[i] = r.c_n[i] = S;

    struct rnnd_seq good = run_seq(&r);
    struct rnnd_model m = r.m;
#define FWD(seqp, modelp, outp, cnp, paramsp)                                                      \
    assert_int_equal(ops->rnn_forward(cpu.ctx, outp, r.h_n, cnp, r.tape, seqp, paramsp, modelp),   \
                     RNND_EINVAL)
    FWD(NULL, &m, r.out, r.c_n, r.params);
    FWD(&good, NULL, r.out, r.c_n, r.params);
    FWD(&good, &m, NULL, r.c_n, r.params);
    FWD(&good, &m, r.out, r.c_n, NULL);
    struct rnnd_seq s;
    s = good, s.B = 0;
    FWD(&s, &m, r.out, r.c_n, r.params);
    s = good, s.T = 0;
    FWD(&s, &m, r.out, r.c_n, r.params);
    s = good, s.B = -3;
    FWD(&s, &m, r.out, r.c_n, r.params);
    s = good, s.x = NULL;
    FWD(&s, &m, r.out, r.c_n, r.params);
    s = good, s.is_init = NULL;
    FWD(&s, &m, r.out, r.c_n, r.params);
    s = good, s.c0 = NULL; // LSTM: h0 without c0
    FWD(&s, &m, r.out, r.c_n, r.params);
    s = good, s.hidden = r.x; // h0 and hidden together
    s.cell = r.x;
    FWD(&s, &m, r.out, r.c_n, r.params);
    struct rnnd_model bad;
    bad = m, bad.L = 0;
    FWD(&good, &bad, r.out, r.c_n, r.params);
    bad = m, bad.L = RNND_MAX_LAYERS + 1;
    FWD(&good, &bad, r.out, r.c_n, r.params);
    bad = m, bad.H = 0;
    FWD(&good, &bad, r.out, r.c_n, r.params);
    bad = m, bad.I = -1;
    FWD(&good, &bad, r.out, r.c_n, r.params);
    bad = m, bad.cell = (enum rnnd_cell)7;
    FWD(&good, &bad, r.out, r.c_n, r.params);
    bad = m, bad.compute = (enum rnnd_compute)9;
    FWD(&good, &bad, r.out, r.c_n, r.params);
    // GRU given LSTM-only buffers.
    bad = m, bad.cell = RNND_CELL_GRU;
    s = good, s.c0 = NULL;
    FWD(&s, &bad, r.out, r.c_n, r.params);   // c_n for a GRU
    FWD(&good, &bad, r.out, NULL, r.params); // c0 for a GRU
    assert_true(all_equal(r.out, r.nout, S));
    assert_true(all_equal(r.h_n, r.nblh, S));
    assert_true(all_equal(r.c_n, r.nblh, S));
#undef FWD

    // Backward
    run_forward(&r, true);
    for (size_t i = 0; i < r.P; i++)
        r.gp[i] = S;
    for (size_t i = 0; i < r.nx; i++)
        r.gx[i] = S;
    struct rnnd_seq_grads g = run_grads(&r), gb;
#define BWD(gp_, gout, gcn, tapep, seqp, modelp)                                                   \
    assert_int_equal(                                                                              \
        ops->rnn_backward(cpu.ctx, gp_, gout, r.grad_h_n, gcn, tapep, seqp, r.params, modelp),     \
        RNND_EINVAL)
    BWD(NULL, r.grad_out, r.grad_c_n, r.tape, &good, &m);
    BWD(&g, NULL, r.grad_c_n, r.tape, &good, &m);
    BWD(&g, r.grad_out, r.grad_c_n, NULL, &good, &m);
    BWD(&g, r.grad_out, r.grad_c_n, r.tape, NULL, &m);
    BWD(&g, r.grad_out, r.grad_c_n, r.tape, &good, NULL);
    gb = g, gb.params = NULL;
    BWD(&gb, r.grad_out, r.grad_c_n, r.tape, &good, &m);
    gb = g, gb.hidden = r.gx; // a stored-state gradient without stored states
    BWD(&gb, r.grad_out, r.grad_c_n, r.tape, &good, &m);
    s = good, s.T = 0;
    BWD(&g, r.grad_out, r.grad_c_n, r.tape, &s, &m);
    bad = m, bad.cell = RNND_CELL_GRU;
    s = good, s.c0 = NULL;
    gb = g, gb.c0 = NULL;
    BWD(&gb, r.grad_out, r.grad_c_n, r.tape, &s, &bad); // grad_c_n for a GRU
    assert_true(all_equal(r.gp, r.P, S));
    assert_true(all_equal(r.gx, r.nx, S));
#undef BWD

    // Single step
    size_t row = (size_t)m.L * m.H;
    float *state_h = rand_floats(4 * row, 1.0), *state_c = rand_floats(4 * row, 1.0);
    float *keep_h = zalloc(4 * row), *keep_c = zalloc(4 * row), *out = zalloc(2 * (size_t)m.H);
    memcpy(keep_h, state_h, 4 * row * sizeof(float));
    memcpy(keep_c, state_c, 4 * row * sizeof(float));
    for (int i = 0; i < 2 * m.H; i++)
        out[i] = S;
    int32_t slots[2] = {1, 3}, slots_new[2] = {0, 2}, neg[2] = {1, -1}, twice[2] = {0, 0};
    struct rnnd_step st = {.B = 2,
                           .x = r.x,
                           .slots = slots,
                           .slots_new = slots_new,
                           .state_h = state_h,
                           .state_c = state_c,
                           .out = out},
                     sb;
    assert_int_equal(ops->rnn_step(cpu.ctx, NULL, r.params, &m), RNND_EINVAL);
    assert_int_equal(ops->rnn_step(cpu.ctx, &st, NULL, &m), RNND_EINVAL);
    assert_int_equal(ops->rnn_step(cpu.ctx, &st, r.params, NULL), RNND_EINVAL);
    sb = st, sb.B = 0;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.x = NULL;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.slots = NULL;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.slots = neg;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.slots_new = NULL;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.slots_new = neg;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.slots_new = slots; // a row both read and written
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.slots_new = twice; // two new states to one row
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    slots_new[1] = 1; // row 1 is read by row 0 and written by row 1
    assert_int_equal(ops->rnn_step(cpu.ctx, &st, r.params, &m), RNND_EINVAL);
    slots_new[1] = 2;
    sb = st, sb.state_c = NULL; // LSTM without c
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    sb = st, sb.out = NULL;
    assert_int_equal(ops->rnn_step(cpu.ctx, &sb, r.params, &m), RNND_EINVAL);
    bad = m, bad.cell = RNND_CELL_GRU; // GRU with c
    assert_int_equal(ops->rnn_step(cpu.ctx, &st, r.params, &bad), RNND_EINVAL);
    assert_memory_equal(state_h, keep_h, 4 * row * sizeof(float));
    assert_memory_equal(state_c, keep_c, 4 * row * sizeof(float));
    assert_true(all_equal(out, 2 * (size_t)m.H, S));
    // The good call does run.
    assert_int_equal(ops->rnn_step(cpu.ctx, &st, r.params, &m), 0);

    // Backend-level odds and ends.
    bad = m, bad.L = 0;
    assert_int_equal(ops->tape_bytes(cpu.ctx, &bad, 2, 3), 0);
    assert_int_equal(ops->tape_bytes(cpu.ctx, &m, 0, 3), 0);
    assert_int_equal(ops->supports(cpu.ctx, &bad), RNND_EINVAL);
    assert_int_equal(ops->supports(cpu.ctx, &m), 0);
    assert_int_equal(ops->alloc(cpu.ctx, 16, NULL), RNND_EINVAL);
    assert_int_equal(ops->copy(cpu.ctx, NULL, out, 4), RNND_EINVAL);
    assert_int_equal(ops->zero(cpu.ctx, NULL, 4), RNND_EINVAL);
    assert_int_equal(rnnd_backend_cpu_init(NULL), RNND_EINVAL);
    ops->free(cpu.ctx, NULL);

    free(state_h);
    free(state_c);
    free(keep_h);
    free(keep_c);
    free(out);
    run_free(&r);
}

// ---------------------------------------------------------------------------------------------

static int group_setup(void **state) {
    (void)state;
    // Three threads whatever the machine, so the split paths (uneven ones too) are exercised;
    // ops smaller than the threading threshold still run on one.
    setenv("RNND_CPU_THREADS", "3", 1);
    if (rnnd_backend_cpu_init(&cpu) != 0)
        return -1;
    return fx_load("rnn_cases.bin", 1, &rnn_fx);
}

static int group_teardown(void **state) {
    (void)state;
    fx_free(&rnn_fx);
    rnnd_backend_free(&cpu);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixtures_fp32),
        cmocka_unit_test(test_fixtures_bf16),
        cmocka_unit_test(test_ieee_equals_fp32),
        cmocka_unit_test(test_forward_without_tape),
        cmocka_unit_test(test_backward_accumulates),
        cmocka_unit_test(test_fd_gradients),
        cmocka_unit_test(test_fd_detects_wrong_gradient),
        cmocka_unit_test(test_step_matches_forward),
        cmocka_unit_test(test_step_defaults_and_bf16),
        cmocka_unit_test(test_thread_count_invariance),
        cmocka_unit_test(test_plan_name),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
