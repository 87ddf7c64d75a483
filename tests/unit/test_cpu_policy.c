/*
 * test_cpu_policy.c: the policy model (struct rnnd_policy) and the CPU backend's policy ops.
 *
 *   - layout: a zero policy is the core exactly as before (count, names, offsets, init); a
 *     policy's tensors follow the core with rnnd.torch.Policy's names and shapes, and its core
 *     parameters are initialised as the core-only model's; bad configs are refused with a reason;
 *   - the whole training chain (encoder_forward -> rnn_forward with resets -> heads_forward,
 *     then heads_backward -> rnn_backward -> encoder_backward) against central finite
 *     differences of an fp32 forward summed in double, for every parameter and the observations,
 *     with discrete and Gaussian heads, GRU and LSTM, elu and tanh encoders;
 *   - log-probabilities and entropies on hand-computed cases;
 *   - Philox4x32-10 against Random123's known-answer vectors; sampling: the same key gives the
 *     same action, category frequencies and Gaussian moments within 5 sigma over many draws,
 *     greedy rows take the mode, logp is that of the action drawn;
 *   - bad arguments are refused with RNND_EINVAL.
 * (client/python/tests/test_policy.py compares the same ops with rnnd.torch.Policy in float64.)
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "rnnd_kernels.h"
#include "rnnd_philox.h"

static struct rnnd_backend cpu;

#define PI 3.14159265358979323846

static float *zalloc(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}

static uint64_t rng_state = 7;

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

// ---------------------------------------------------------------------------------------------
// Layout

static void test_zero_policy_is_the_core(void **state) {
    (void)state;
    struct rnnd_model core = {.cell = RNND_CELL_LSTM, .I = 5, .H = 7, .L = 2};
    // The figures of test_model's nn.LSTM(5, 7, 2): a zero policy changes none of them.
    assert_false(rnnd_model_has_policy(&core));
    assert_int_equal(rnnd_model_param_tensors(&core), 8);
    assert_int_equal(rnnd_model_param_count(&core), 28 * 14 + 28 * 16);
    struct rnnd_model same = rnnd_model_core(&core);
    assert_memory_equal(&same, &core, sizeof(core));

    // With a policy, the core is a prefix: same tensors, offsets and initial values.
    struct rnnd_model m = core;
    m.policy = (struct rnnd_policy){.enc_layers = 2, .enc_width = {6, 5}, .A = 3, .value = true};
    assert_int_equal(rnnd_model_check(&m), 0);
    assert_true(rnnd_model_has_policy(&m));
    struct rnnd_model cm = rnnd_model_core(&m);
    assert_int_equal(cm.I, 5); // the last encoder width: here equal to I, by choice of sizes
    assert_false(rnnd_model_has_policy(&cm));
    size_t Pc = rnnd_model_param_count(&cm), P = rnnd_model_param_count(&m);
    for (int k = 0; k < 8; k++) {
        struct rnnd_param_tensor a, b;
        rnnd_model_param_tensor(&core, k, &a);
        rnnd_model_param_tensor(&m, k, &b);
        assert_memory_equal(&a, &b, sizeof(a));
    }
    float *pc = zalloc(Pc), *pm = zalloc(P);
    rnnd_model_init_params(&cm, 9, pc);
    rnnd_model_init_params(&m, 9, pm);
    assert_memory_equal(pc, pm, Pc * sizeof(float));
    free(pc);
    free(pm);
}

static void test_policy_layout(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 6, .H = 4, .L = 1};
    m.policy = (struct rnnd_policy){.enc_layers = 2, .enc_width = {8, 5}, .A = 2, .value = true};
    static const struct {
        const char *name;
        int ndim;
        int64_t rows, cols;
    } want[] = {
        {"weight_ih_l0", 2, 12, 5},    {"weight_hh_l0", 2, 12, 4},
        {"bias_ih_l0", 1, 12, 0},      {"bias_hh_l0", 1, 12, 0},
        {"action_log_std", 1, 2, 0},   {"encoder.0.weight", 2, 8, 6},
        {"encoder.0.bias", 1, 8, 0},   {"encoder.1.weight", 2, 5, 8},
        {"encoder.1.bias", 1, 5, 0},   {"action_mean.weight", 2, 2, 4},
        {"action_mean.bias", 1, 2, 0}, {"value.weight", 2, 1, 4},
        {"value.bias", 1, 1, 0},
    };
    int n = (int)(sizeof(want) / sizeof(want[0]));
    assert_int_equal(rnnd_model_param_tensors(&m), n);
    size_t offset = 0;
    for (int k = 0; k < n; k++) {
        struct rnnd_param_tensor t;
        rnnd_model_param_tensor(&m, k, &t);
        assert_string_equal(t.name, want[k].name);
        assert_int_equal(t.ndim, want[k].ndim);
        assert_int_equal(t.shape[0], want[k].rows);
        if (t.ndim == 2)
            assert_int_equal(t.shape[1], want[k].cols);
        assert_int_equal(t.offset, offset);
        offset += t.count;
        assert_int_equal(rnnd_model_param_find(&m, want[k].name), k);
    }
    assert_int_equal(offset, rnnd_model_param_count(&m));
    assert_int_equal(rnnd_model_encoder_acts(&m), 13);
    assert_int_equal(rnnd_model_layer_input(&m, 0), 5);

    // nn.Linear's init: |w| <= 1/sqrt(fan_in) per tensor, log-std zero.
    float *p = zalloc(offset);
    rnnd_model_init_params(&m, 3, p);
    for (int k = 4; k < n; k++) {
        struct rnnd_param_tensor t;
        rnnd_model_param_tensor(&m, k, &t);
        double fan = strncmp(t.name, "encoder.0", 9) == 0   ? 6
                     : strncmp(t.name, "encoder.1", 9) == 0 ? 8
                                                            : 4;
        float mx = 0.0f;
        for (size_t i = 0; i < t.count; i++)
            mx = fmaxf(mx, fabsf(p[t.offset + i]));
        if (k == 4)
            assert_true(mx == 0.0f);
        else
            assert_true(mx > 0.0f && mx <= 1.0 / sqrt(fan));
    }
    free(p);

    // The discrete head.
    m.policy = (struct rnnd_policy){.K = 3};
    assert_int_equal(rnnd_model_param_tensors(&m), 6);
    struct rnnd_param_tensor t;
    rnnd_model_param_tensor(&m, 4, &t);
    assert_string_equal(t.name, "policy_logits.weight");
    assert_int_equal(t.shape[0], 3);
    assert_int_equal(t.shape[1], 4);
    assert_int_equal(rnnd_model_layer_input(&m, 0), 6); // no encoder: the core reads obs
}

static void expect_invalid(const struct rnnd_model *m, const char *says) {
    char err[160];
    assert_int_equal(rnnd_model_validate(m, err, sizeof(err)), RNND_EINVAL);
    assert_int_equal(rnnd_model_check(m), RNND_EINVAL);
    if (strstr(err, says) == NULL)
        fail_msg("reason \"%s\" does not say \"%s\"", err, says);
}

static void test_validate(void **state) {
    (void)state;
    struct rnnd_model ok = {.cell = RNND_CELL_GRU, .I = 3, .H = 4, .L = 1};
    ok.policy = (struct rnnd_policy){.enc_layers = 1, .enc_width = {8}, .K = 2, .value = true};
    char err[160] = "x";
    assert_int_equal(rnnd_model_validate(&ok, err, sizeof(err)), 0);
    assert_string_equal(err, "");
    struct rnnd_model m = ok;
    m.policy.K = 1;
    expect_invalid(&m, "discrete actions 1: 0 (no discrete head) or 2 ..");
    m = ok, m.policy.A = 2;
    expect_invalid(&m, "one action head");
    m = ok, m.policy.A = -1, m.policy.K = 0;
    expect_invalid(&m, "Gaussian action dims -1");
    m = ok, m.policy.enc_width[0] = 0;
    expect_invalid(&m, "encoder layer 0 width 0");
    m = ok, m.policy.enc_layers = RNND_MAX_ENCODER_LAYERS + 1;
    expect_invalid(&m, "encoder layers 5: 0 .. 4");
    m = ok, m.policy.enc_act = (enum rnnd_act)9;
    expect_invalid(&m, "elu, relu or tanh");
    m = ok, m.H = 0;
    expect_invalid(&m, "hidden size 0");

    // The core ops take the core view only.
    float x[3] = {0}, out[4];
    uint8_t init = 1;
    struct rnnd_seq s = {.B = 1, .T = 1, .x = x, .is_init = &init};
    float *params = zalloc(rnnd_model_param_count(&ok));
    assert_int_equal(cpu.ops->rnn_forward(cpu.ctx, out, NULL, NULL, NULL, &s, params, &ok),
                     RNND_EINVAL);
    struct rnnd_model core = rnnd_model_core(&ok);
    float x8[8] = {0};
    s.x = x8;
    assert_int_equal(cpu.ops->rnn_forward(cpu.ctx, out, NULL, NULL, NULL, &s, params, &core), 0);
    free(params);
}

// ---------------------------------------------------------------------------------------------
// The training chain against finite differences

struct chain {
    struct rnnd_model m, core;
    int B, T, N;
    size_t P;
    float *params, *obs, *acts, *out, *grad_params, *grad_obs;
    uint8_t *is_init;
    float *logits, *mean, *log_std, *value;         // forward outputs
    float *g_logits, *g_mean, *g_log_std, *g_value; // the loss's weights on them
    void *tape;
};

static void chain_forward(struct chain *c) {
    const float *x = c->obs;
    if (c->m.policy.enc_layers) {
        assert_int_equal(cpu.ops->encoder_forward(cpu.ctx, c->acts, c->obs, c->N, c->params, &c->m),
                         0);
        x = c->acts + (size_t)c->N * (rnnd_model_encoder_acts(&c->m) - c->core.I);
    }
    struct rnnd_seq s = {.B = c->B, .T = c->T, .x = x, .is_init = c->is_init};
    assert_int_equal(
        cpu.ops->rnn_forward(cpu.ctx, c->out, NULL, NULL, c->tape, &s, c->params, &c->core), 0);
    struct rnnd_heads hd = {
        .logits = c->logits, .mean = c->mean, .log_std = c->log_std, .value = c->value};
    assert_int_equal(cpu.ops->heads_forward(cpu.ctx, &hd, c->out, c->N, c->params, &c->m), 0);
}

// sum(logits g_logits) + sum(mean g_mean) + sum(log_std g_log_std) + sum(value g_value), from
// an fp32 forward, summed in double.
static double chain_loss(struct chain *c) {
    chain_forward(c);
    const struct rnnd_policy *p = &c->m.policy;
    double s = 0.0;
    for (size_t i = 0; i < (size_t)c->N * p->K; i++)
        s += (double)c->logits[i] * c->g_logits[i];
    for (size_t i = 0; i < (size_t)c->N * p->A; i++)
        s += (double)c->mean[i] * c->g_mean[i] + (double)c->log_std[i] * c->g_log_std[i];
    for (size_t i = 0; p->value && i < (size_t)c->N; i++)
        s += (double)c->value[i] * c->g_value[i];
    return s;
}

static void chain_backward(struct chain *c) {
    chain_forward(c);
    size_t H = (size_t)c->m.H, W = (size_t)c->core.I;
    float *grad_h = zalloc((size_t)c->N * H), *grad_x = zalloc((size_t)c->N * W);
    struct rnnd_heads g = {
        .logits = c->g_logits, .mean = c->g_mean, .log_std = c->g_log_std, .value = c->g_value};
    memset(c->grad_params, 0, c->P * sizeof(float));
    assert_int_equal(cpu.ops->heads_backward(cpu.ctx, c->grad_params, grad_h, &g, c->out, c->N,
                                             c->params, &c->m),
                     0);
    const float *x = c->m.policy.enc_layers
                         ? c->acts + (size_t)c->N * (rnnd_model_encoder_acts(&c->m) - W)
                         : c->obs;
    struct rnnd_seq s = {.B = c->B, .T = c->T, .x = x, .is_init = c->is_init};
    struct rnnd_seq_grads sg = {.params = c->grad_params,
                                .x = c->m.policy.enc_layers ? grad_x : c->grad_obs};
    assert_int_equal(
        cpu.ops->rnn_backward(cpu.ctx, &sg, grad_h, NULL, NULL, c->tape, &s, c->params, &c->core),
        0);
    if (c->m.policy.enc_layers)
        assert_int_equal(cpu.ops->encoder_backward(cpu.ctx, c->grad_params, c->grad_obs, grad_x,
                                                   c->acts, c->obs, c->N, c->params, &c->m),
                         0);
    free(grad_h);
    free(grad_x);
}

static void chain_init(struct chain *c, const struct rnnd_model *m, int B, int T) {
    memset(c, 0, sizeof(*c));
    c->m = *m;
    c->core = rnnd_model_core(m);
    c->B = B, c->T = T, c->N = B * T;
    c->P = rnnd_model_param_count(m);
    const struct rnnd_policy *p = &m->policy;
    size_t N = (size_t)c->N;
    // Weights a little above PyTorch's init, so activations are neither flat nor saturated.
    c->params = rand_floats(c->P, 0.6);
    c->obs = rand_floats(N * m->I, 1.0);
    c->acts = zalloc(N * (size_t)rnnd_model_encoder_acts(m));
    c->out = zalloc(N * m->H);
    c->is_init = malloc(N);
    for (size_t i = 0; i < N; i++)
        c->is_init[i] = i % (size_t)T == 0 || rng_uniform() < 0.3;
    c->tape = malloc(cpu.ops->tape_bytes(cpu.ctx, &c->core, B, T));
    c->grad_params = zalloc(c->P);
    c->grad_obs = zalloc(N * m->I);
    if (p->K) {
        c->logits = zalloc(N * p->K);
        c->g_logits = rand_floats(N * p->K, 1.0);
    }
    if (p->A) {
        c->mean = zalloc(N * p->A);
        c->log_std = zalloc(N * p->A);
        c->g_mean = rand_floats(N * p->A, 1.0);
        c->g_log_std = rand_floats(N * p->A, 1.0);
    }
    if (p->value) {
        c->value = zalloc(N);
        c->g_value = rand_floats(N, 1.0);
    }
}

static void chain_free(struct chain *c) {
    void *p[] = {c->params,  c->obs,       c->acts,    c->out,     c->grad_params, c->grad_obs,
                 c->is_init, c->logits,    c->mean,    c->log_std, c->value,       c->g_logits,
                 c->g_mean,  c->g_log_std, c->g_value, c->tape};
    for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
        free(p[i]);
}

// Central differences with step FD_EPS of an fp32 forward summed in double, as test_cpu_rnn.c
// does (its comment explains the figures); correct gradients stay within 4% of the bound.
#define FD_EPS  1e-2f
#define FD_ATOL 5e-4
#define FD_RTOL 2e-3

static double fd_worst; // the largest |fd - g| / bound seen on a correct gradient

static int fd_compare(struct chain *c, float *v, const float *g, size_t n, const char *what,
                      bool verbose) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        float keep = v[i], up = keep + FD_EPS, down = keep - FD_EPS;
        v[i] = up;
        double lp = chain_loss(c);
        v[i] = down;
        double lm = chain_loss(c);
        v[i] = keep;
        double fd = (lp - lm) / ((double)up - (double)down);
        double ratio = fabs(fd - g[i]) / (FD_ATOL + FD_RTOL * fabs(g[i]));
        if (verbose && ratio > fd_worst)
            fd_worst = ratio;
        if (!(ratio <= 1.0)) {
            if (verbose && bad < 5)
                print_error("%s[%zu]: finite difference %.6f, backward %.6f\n", what, i, fd, g[i]);
            bad++;
        }
    }
    return bad;
}

static void test_chain_finite_differences(void **state) {
    (void)state;
    static const struct {
        enum rnnd_cell cell;
        int L;
        struct rnnd_policy p;
    } cases[] = {
        {RNND_CELL_GRU, 1, {.enc_layers = 2, .enc_width = {5, 4}, .K = 3, .value = true}},
        {RNND_CELL_LSTM,
         2,
         {.enc_layers = 1, .enc_width = {4}, .enc_act = RNND_ACT_TANH, .A = 2, .value = true}},
        {RNND_CELL_GRU, 1, {.A = 3}}, // no encoder, no value
        {RNND_CELL_LSTM, 1, {.enc_layers = 1, .enc_width = {3}, .K = 4}},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        struct rnnd_model m = {
            .cell = cases[k].cell, .I = 3, .H = 4, .L = cases[k].L, .policy = cases[k].p};
        struct chain c;
        chain_init(&c, &m, 2, 3);
        chain_backward(&c);
        float *g = zalloc(c.P), *gobs = zalloc((size_t)c.N * m.I);
        memcpy(g, c.grad_params, c.P * sizeof(float));
        memcpy(gobs, c.grad_obs, (size_t)c.N * m.I * sizeof(float));
        int bad = 0;
        for (int t = 0; t < rnnd_model_param_tensors(&m); t++) {
            struct rnnd_param_tensor pt;
            rnnd_model_param_tensor(&m, t, &pt);
            bad += fd_compare(&c, c.params + pt.offset, g + pt.offset, pt.count, pt.name, true);
        }
        bad += fd_compare(&c, c.obs, gobs, (size_t)c.N * m.I, "obs", true);
        if (bad)
            fail_msg("case %zu: %d gradient elements off", k, bad);
        // A wrong gradient is caught: one element of the first encoder (or head) tensor.
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(&m, 4 * m.L, &pt);
        g[pt.offset] += 3e-3f + 0.02f * fabsf(g[pt.offset]);
        assert_int_equal(fd_compare(&c, c.params + pt.offset, g + pt.offset, 1, "planted", false),
                         1);
        free(g);
        free(gobs);
        chain_free(&c);
    }
    print_message("worst |fd - backward| on correct gradients: %.2f of the bound\n", fd_worst);
}

// ---------------------------------------------------------------------------------------------
// Log-probabilities and entropies

static void test_logp_entropy(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 1, .H = 1, .L = 1};
    m.policy.K = 2;
    float *params = zalloc(rnnd_model_param_count(&m));
    // p = (1/4, 3/4).
    float logits[4] = {0.0f, logf(3.0f), 5.0f, 5.0f};
    int64_t index[2] = {1, 0};
    float logp[2], ent[2];
    struct rnnd_actions a = {
        .N = 2, .logits = logits, .index = index, .logp = logp, .entropy = ent};
    assert_int_equal(cpu.ops->policy_logp(cpu.ctx, &a, params, &m), 0);
    assert_float_equal(logp[0], log(0.75), 1e-6);
    assert_float_equal(ent[0], -(0.25 * log(0.25) + 0.75 * log(0.75)), 1e-6);
    assert_float_equal(logp[1], log(0.5), 1e-6);
    assert_float_equal(ent[1], log(2.0), 1e-6);
    index[1] = 2; // out of range
    assert_int_equal(cpu.ops->policy_logp(cpu.ctx, &a, params, &m), RNND_EINVAL);
    free(params);

    m.policy = (struct rnnd_policy){.A = 2};
    params = zalloc(rnnd_model_param_count(&m));
    struct rnnd_model core = rnnd_model_core(&m);
    params[rnnd_model_param_count(&core) + 1] = logf(2.0f); // log_std (0, ln 2)
    float mean[2] = {1.0f, -1.0f}, x[2] = {0.0f, 1.0f};
    a = (struct rnnd_actions){.N = 1, .mean = mean, .action = x, .logp = logp, .entropy = ent};
    assert_int_equal(cpu.ops->policy_logp(cpu.ctx, &a, params, &m), 0);
    double half_ln_2pi = 0.5 * log(2.0 * PI);
    // z = (-1, 1): -1/2 - 0 - c  +  -1/2 - ln 2 - c
    assert_float_equal(logp[0], -1.0 - log(2.0) - 2.0 * half_ln_2pi, 1e-6);
    assert_float_equal(ent[0], 2.0 * (0.5 + half_ln_2pi) + log(2.0), 1e-6);
    free(params);
}

// ---------------------------------------------------------------------------------------------
// Philox and sampling

static void test_philox_known_answers(void **state) {
    (void)state;
    // Random123's kat_vectors for philox4x32_10.
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int k = 0; k < 3; k++) {
        uint32_t out[4];
        rnnd_philox4x32_10(kat[k], kat[k] + 4, out);
        assert_memory_equal(out, kat[k] + 6, sizeof(out));
    }
}

#define DRAWS 200000

// Draws DRAWS actions of one distribution: row r is env r % 1000 at step r / 1000.
static void draw_many(const struct rnnd_model *m, const float *params, const float *row_in,
                      int width, int64_t *index, float *action, float *logp, uint64_t seed) {
    float *in = zalloc((size_t)DRAWS * width);
    uint64_t *env = malloc(DRAWS * sizeof(uint64_t)), *step = malloc(DRAWS * sizeof(uint64_t));
    for (int r = 0; r < DRAWS; r++) {
        memcpy(in + (size_t)r * width, row_in, (size_t)width * sizeof(float));
        env[r] = 1000003ull * (uint64_t)(r % 1000); // ids far apart, as hashes are
        step[r] = (uint64_t)(r / 1000);
    }
    struct rnnd_actions a = {.N = DRAWS,
                             .index = index,
                             .action = action,
                             .logp = logp,
                             .seed = seed,
                             .env_ids = env,
                             .steps = step};
    if (m->policy.K)
        a.logits = in;
    else
        a.mean = in;
    assert_int_equal(cpu.ops->policy_sample(cpu.ctx, &a, params, m), 0);
    free(in);
    free(env);
    free(step);
}

static void test_sample_categorical(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 1, .H = 1, .L = 1};
    m.policy.K = 5;
    float *params = zalloc(rnnd_model_param_count(&m));
    float logits[5] = {0.3f, -1.0f, 1.2f, -30.0f, 0.0f};
    double p[5], S = 0.0;
    for (int k = 0; k < 5; k++)
        S += p[k] = exp(logits[k]);
    int64_t *index = malloc(DRAWS * sizeof(int64_t));
    float *logp = zalloc(DRAWS);
    draw_many(&m, params, logits, 5, index, NULL, logp, 11);
    long count[5] = {0};
    for (int r = 0; r < DRAWS; r++) {
        assert_true(index[r] >= 0 && index[r] < 5);
        count[index[r]]++;
        assert_float_equal(logp[r], log(p[index[r]] / S), 1e-5);
    }
    for (int k = 0; k < 5; k++) {
        double pk = p[k] / S, f = (double)count[k] / DRAWS;
        double sigma = sqrt(pk * (1.0 - pk) / DRAWS);
        print_message("category %d: p %.5f, frequency %.5f (%.1f sigma)\n", k, pk, f,
                      sigma > 0 ? (f - pk) / sigma : 0.0);
        assert_true(fabs(f - pk) <= 5.0 * sigma + 1e-9);
    }
    assert_int_equal(count[3], 0); // p = 1e-13
    free(index);
    free(logp);
    free(params);
}

static void test_sample_gaussian(void **state) {
    (void)state;
    enum { A = 5 };
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 1, .H = 1, .L = 1};
    m.policy.A = A;
    float *params = zalloc(rnnd_model_param_count(&m));
    float mean[A] = {0.5f, -2.0f, 0.0f, 3.0f, 1.0f}, log_std[A] = {0.0f, -1.0f, 0.7f, 0.2f, -0.3f};
    struct rnnd_model core = rnnd_model_core(&m);
    memcpy(params + rnnd_model_param_count(&core), log_std, sizeof(log_std));
    float *x = zalloc((size_t)DRAWS * A), *logp = zalloc(DRAWS);
    draw_many(&m, params, mean, A, NULL, x, logp, 5);
    double s1[A] = {0}, s2[A] = {0}, within[A] = {0}, cross = 0.0;
    for (int r = 0; r < DRAWS; r++) {
        double lp = 0.0, zz[A];
        for (int j = 0; j < A; j++) {
            double sd = exp(log_std[j]), z = (x[(size_t)r * A + j] - mean[j]) / sd;
            zz[j] = z;
            s1[j] += z;
            s2[j] += z * z;
            within[j] += fabs(z) < 1.0;
            lp += -0.5 * z * z - log_std[j] - 0.5 * log(2.0 * PI);
        }
        cross += zz[0] * zz[1]; // the cos and sin of one Box-Muller pair are independent
        assert_float_equal(logp[r], lp, 1e-4);
    }
    for (int j = 0; j < A; j++) {
        double mu = s1[j] / DRAWS, var = s2[j] / DRAWS - mu * mu, in1 = within[j] / DRAWS;
        print_message("dim %d: z mean %+.4f, var %.4f, P(|z| < 1) %.4f\n", j, mu, var, in1);
        assert_true(fabs(mu) <= 5.0 / sqrt(DRAWS));
        assert_true(fabs(var - 1.0) <= 5.0 * sqrt(2.0 / DRAWS));
        assert_true(fabs(in1 - 0.682689) <= 5.0 * sqrt(0.682689 * 0.317311 / DRAWS));
    }
    assert_true(fabs(cross / DRAWS) <= 5.0 / sqrt(DRAWS));
    free(x);
    free(logp);
    free(params);
}

static void test_sample_deterministic_and_greedy(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 1, .H = 1, .L = 1};
    m.policy.K = 6;
    float *params = zalloc(rnnd_model_param_count(&m));
    float logits[4 * 6];
    for (int i = 0; i < 4 * 6; i++)
        logits[i] = 0.1f * (float)(i % 6); // row mode: 5
    uint64_t env[4] = {7, 7, 8, 7}, step[4] = {3, 3, 3, 4};
    int64_t a1[4], a2[4];
    float lp1[4], lp2[4];
    struct rnnd_actions a = {.N = 4,
                             .logits = logits,
                             .index = a1,
                             .logp = lp1,
                             .seed = 1,
                             .env_ids = env,
                             .steps = step};
    assert_int_equal(cpu.ops->policy_sample(cpu.ctx, &a, params, &m), 0);
    a.index = a2, a.logp = lp2;
    assert_int_equal(cpu.ops->policy_sample(cpu.ctx, &a, params, &m), 0);
    assert_memory_equal(a1, a2, sizeof(a1)); // same keys, same actions
    assert_memory_equal(lp1, lp2, sizeof(lp1));
    assert_true(a1[0] == a1[1]); // rows 0 and 1 share (seed, env, step)
    // The words behind the draws differ with env, step and seed.
    uint32_t k7[2], k8[2], k7s2[2], w[3][4];
    rnnd_philox_env_key(1, 7, k7);
    rnnd_philox_env_key(1, 8, k8);
    rnnd_philox_env_key(2, 7, k7s2);
    rnnd_philox_step_words(k7, 3, 0, w[0]);
    rnnd_philox_step_words(k8, 3, 0, w[1]);
    rnnd_philox_step_words(k7, 4, 0, w[2]);
    assert_true(w[0][0] != w[1][0] && w[0][0] != w[2][0] && k7[0] != k7s2[0]);
    assert_int_equal(a1[0], rnnd_sample_categorical(logits, 6, rnnd_philox_u01(w[0][0])));

    uint8_t greedy[4] = {1, 1, 1, 1};
    a.greedy = greedy;
    assert_int_equal(cpu.ops->policy_sample(cpu.ctx, &a, params, &m), 0);
    for (int r = 0; r < 4; r++)
        assert_int_equal(a2[r], 5);
    free(params);

    m.policy = (struct rnnd_policy){.A = 2};
    params = zalloc(rnnd_model_param_count(&m));
    float mean[2] = {0.25f, -4.0f}, x[2];
    a = (struct rnnd_actions){.N = 1,
                              .mean = mean,
                              .action = x,
                              .seed = 1,
                              .env_ids = env,
                              .steps = step,
                              .greedy = greedy};
    assert_int_equal(cpu.ops->policy_sample(cpu.ctx, &a, params, &m), 0);
    assert_memory_equal(x, mean, sizeof(x));
    free(params);
}

// ---------------------------------------------------------------------------------------------
// Bad arguments

static void test_bad_arguments(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 2, .H = 3, .L = 1};
    m.policy.K = 2;
    float *params = zalloc(rnnd_model_param_count(&m));
    float h[3] = {0}, buf[8] = {0};
    struct rnnd_heads hd = {.mean = buf}; // the model has no Gaussian head
    assert_int_equal(cpu.ops->heads_forward(cpu.ctx, &hd, h, 1, params, &m), RNND_EINVAL);
    hd = (struct rnnd_heads){.logits = buf};
    assert_int_equal(cpu.ops->heads_forward(cpu.ctx, &hd, h, 0, params, &m), RNND_EINVAL);
    assert_int_equal(cpu.ops->heads_forward(cpu.ctx, &hd, h, 1, params, &m), 0);
    // No encoder.
    assert_int_equal(cpu.ops->encoder_forward(cpu.ctx, buf, h, 1, params, &m), RNND_EINVAL);
    // Sampling needs the key.
    int64_t idx;
    struct rnnd_actions a = {.N = 1, .logits = buf, .index = &idx};
    assert_int_equal(cpu.ops->policy_sample(cpu.ctx, &a, params, &m), RNND_EINVAL);
    // A model without an action head has nothing to sample.
    m.policy = (struct rnnd_policy){.value = true};
    assert_int_equal(cpu.ops->policy_logp(cpu.ctx, &a, params, &m), RNND_EINVAL);
    free(params);
}

static int setup(void **state) {
    (void)state;
    return rnnd_backend_cpu_init(&cpu);
}

static int teardown(void **state) {
    (void)state;
    rnnd_backend_free(&cpu);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zero_policy_is_the_core),
        cmocka_unit_test(test_policy_layout),
        cmocka_unit_test(test_validate),
        cmocka_unit_test(test_chain_finite_differences),
        cmocka_unit_test(test_logp_entropy),
        cmocka_unit_test(test_philox_known_answers),
        cmocka_unit_test(test_sample_categorical),
        cmocka_unit_test(test_sample_gaussian),
        cmocka_unit_test(test_sample_deterministic_and_greedy),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
