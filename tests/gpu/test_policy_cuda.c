/*
 * test_policy_cuda.c: the CUDA backend's policy ops (kernels/cuda/policy.cu: encoder_forward,
 * encoder_backward, heads_forward, heads_backward, policy_sample, policy_logp) against the CPU
 * reference, one case of the table at a time (gpu_check.h has the method): every output and
 * every gradient (the parameter gradients as += onto a random base) within the 1e-4;
 * sampled actions equal to the CPU's for the same seed, env and step (discrete: every index but
 * where the uniform lies within 1e-6 of a category boundary, counted; Gaussian: within 1e-5, the
 * bits differing only where the two libraries round a function value apart), greedy rows exactly;
 * the same call twice gives the same bits; bad arguments refused with RNND_EINVAL as on the CPU.
 * Then K = 2 .. 18 and A = 1 .. 6 at 1024 rows.
 *
 *   test_policy_cuda [--quick]    --quick: the first cases only (for compute-sanitizer runs)
 */
#include "gpu_check.h"

#include "rnnd_philox.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-4

struct pol_case {
    int I, H;
    int enc_layers, w0, w1;
    enum rnnd_act act;
    int K, A;
    bool value;
    int N;
    bool misalign; // every device buffer one float past 16-byte alignment
    bool quick;    // also in --quick
};

static const char *act_name(enum rnnd_act a) {
    return a == RNND_ACT_ELU ? "elu" : a == RNND_ACT_RELU ? "relu" : "tanh";
}

static size_t tensor_offset(const struct rnnd_model *m, const char *name) {
    struct rnnd_param_tensor t;
    rnnd_model_param_tensor(m, rnnd_model_param_find(m, name), &t);
    return t.offset;
}

// The CUDA backend first (k = 0: outputs poisoned with NaN), then the CPU.
static struct rnnd_backend *bes[2];

// ---------------------------------------------------------------------------------------------
// Encoder

static void test_encoder(const struct rnnd_model *m, const float *params, const char *tag, int N) {
    const int EA = rnnd_model_encoder_acts(m), wl = m->policy.enc_width[m->policy.enc_layers - 1];
    const size_t P = rnnd_model_param_count(m), NI = (size_t)N * m->I, NE = (size_t)N * EA;
    float *obs = host_uniform(NI, 1.0f), *gout = host_uniform((size_t)N * wl, 1.0f);
    float *base = host_uniform(P, 0.1f);
    // The backward reads the CPU's activations on both backends, so that it is compared alone.
    float *ref_acts = xmalloc(NE * 4);
    int ref_err = bes[1]->ops->encoder_forward(bes[1]->ctx, ref_acts, obs, N, params, m);
    float *acts[2], *gp[2], *gobs[2], *gp_noobs[2];
    int err[2] = {ref_err, ref_err};
    for (int k = 0; k < 2; k++) {
        struct rnnd_backend *be = bes[k];
        struct bufs b = {.be = be};
        acts[k] = xmalloc(NE * 4), gp[k] = xmalloc(P * 4), gobs[k] = xmalloc(NI * 4);
        gp_noobs[k] = xmalloc(P * 4);
        float *d_params = dev_in(&b, params, P), *d_obs = dev_in(&b, obs, NI);
        float *d_acts = dev_poison(&b, NE, k == 0);
        if (!err[k])
            err[k] = be->ops->encoder_forward(be->ctx, d_acts, d_obs, N, d_params, m);
        if (!err[k])
            to_host(be, acts[k], d_acts, NE);
        float *d_ref = dev_in(&b, ref_acts, NE);
        float *d_gout = dev_in(&b, gout, (size_t)N * wl), *d_gp = dev_in(&b, base, P);
        float *d_gobs = dev_poison(&b, NI, k == 0);
        if (!err[k])
            err[k] = be->ops->encoder_backward(be->ctx, d_gp, d_gobs, d_gout, d_ref, d_obs, N,
                                               d_params, m);
        if (!err[k]) {
            to_host(be, gp[k], d_gp, P);
            to_host(be, gobs[k], d_gobs, NI);
        }
        // Without dL/d obs: the same parameter gradient.
        float *d_gp2 = dev_in(&b, base, P);
        if (!err[k])
            err[k] = be->ops->encoder_backward(be->ctx, d_gp2, NULL, d_gout, d_ref, d_obs, N,
                                               d_params, m);
        if (!err[k])
            to_host(be, gp_noobs[k], d_gp2, P);
        bufs_free(&b);
    }
    if (err[0] || err[1]) {
        fail("%s encoder: cuda %s, cpu %s", tag, rnnd_err_name(err[0]), rnnd_err_name(err[1]));
    } else {
        compare("acts", tag, acts[0], acts[1], NULL, NE, TOL);
        compare("enc dparams", tag, gp[0], gp[1], base, P, TOL);
        compare("enc dobs", tag, gobs[0], gobs[1], NULL, NI, TOL);
        check(memcmp(gp[0], gp_noobs[0], P * 4) == 0, "%-34s enc dparams the same without dobs",
              tag);
    }
    for (int k = 0; k < 2; k++)
        free(acts[k]), free(gp[k]), free(gobs[k]), free(gp_noobs[k]);
    free(obs), free(gout), free(base), free(ref_acts);
}

// ---------------------------------------------------------------------------------------------
// Heads

static void test_heads(const struct rnnd_model *m, const float *params, const char *tag, int N) {
    const struct rnnd_policy *p = &m->policy;
    const size_t P = rnnd_model_param_count(m), NH = (size_t)N * m->H;
    const size_t NK = (size_t)N * p->K, NA = (size_t)N * p->A;
    float *h = host_uniform(NH, 1.0f), *base = host_uniform(P, 0.1f);
    float *hbase = host_uniform(NH, 0.1f); // dh accumulates onto it
    float *gl = host_uniform(NK, 1.0f), *gm = host_uniform(NA, 1.0f);
    float *gls = host_uniform(NA, 1.0f), *gv = host_uniform(N, 1.0f);
    float *out[2][4], *gp[2], *gh[2], *gh_none[2], *gp_val[2], *gh_val[2];
    int err[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        struct rnnd_backend *be = bes[k];
        struct bufs b = {.be = be};
        size_t n[4] = {NK, NA, NA, (size_t)N};
        for (int i = 0; i < 4; i++)
            out[k][i] = xmalloc(n[i] * 4);
        gp[k] = xmalloc(P * 4), gh[k] = xmalloc(NH * 4), gh_none[k] = xmalloc(NH * 4);
        gp_val[k] = xmalloc(P * 4), gh_val[k] = xmalloc(NH * 4);
        float *d_params = dev_in(&b, params, P), *d_h = dev_in(&b, h, NH);
        struct rnnd_heads hd = {
            .logits = p->K ? dev_poison(&b, NK, k == 0) : NULL,
            .mean = p->A ? dev_poison(&b, NA, k == 0) : NULL,
            .log_std = p->A ? dev_poison(&b, NA, k == 0) : NULL,
            .value = p->value ? dev_poison(&b, N, k == 0) : NULL,
        };
        err[k] = be->ops->heads_forward(be->ctx, &hd, d_h, N, d_params, m);
        float *got[4] = {hd.logits, hd.mean, hd.log_std, hd.value};
        for (int i = 0; i < 4 && !err[k]; i++)
            if (got[i])
                to_host(be, out[k][i], got[i], n[i]);
        // Every head's gradient at once, onto a random base.
        struct rnnd_heads g = {
            .logits = p->K ? dev_in(&b, gl, NK) : NULL,
            .mean = p->A ? dev_in(&b, gm, NA) : NULL,
            .log_std = p->A ? dev_in(&b, gls, NA) : NULL,
            .value = p->value ? dev_in(&b, gv, N) : NULL,
        };
        float *d_gp = dev_in(&b, base, P), *d_gh = dev_in(&b, hbase, NH);
        if (!err[k])
            err[k] = be->ops->heads_backward(be->ctx, d_gp, d_gh, &g, d_h, N, d_params, m);
        if (!err[k]) {
            to_host(be, gp[k], d_gp, P);
            to_host(be, gh[k], d_gh, NH);
        }
        // No gradient at all: dh as it was.
        struct rnnd_heads none = {0};
        if (!err[k])
            err[k] = be->ops->heads_backward(be->ctx, d_gp, d_gh, &none, d_h, N, d_params, m);
        if (!err[k])
            to_host(be, gh_none[k], d_gh, NH);
        // The value's alone (or the action head's alone without one).
        struct rnnd_heads one = {.value = g.value};
        if (!p->value)
            one = (struct rnnd_heads){.logits = g.logits, .mean = g.mean};
        float *d_gp1 = dev_in(&b, base, P);
        if (!err[k])
            err[k] = be->ops->heads_backward(be->ctx, d_gp1, d_gh, &one, d_h, N, d_params, m);
        if (!err[k]) {
            to_host(be, gp_val[k], d_gp1, P);
            to_host(be, gh_val[k], d_gh, NH);
        }
        bufs_free(&b);
    }
    if (err[0] || err[1]) {
        fail("%s heads: cuda %s, cpu %s", tag, rnnd_err_name(err[0]), rnnd_err_name(err[1]));
    } else {
        if (p->K)
            compare("logits", tag, out[0][0], out[1][0], NULL, NK, TOL);
        if (p->A) {
            compare("mean", tag, out[0][1], out[1][1], NULL, NA, TOL);
            check(memcmp(out[0][2], out[1][2], NA * 4) == 0, "%-34s log_std rows exact", tag);
        }
        if (p->value)
            compare("value", tag, out[0][3], out[1][3], NULL, N, TOL);
        compare("heads dparams", tag, gp[0], gp[1], base, P, TOL);
        compare("heads dh", tag, gh[0], gh[1], hbase, NH, TOL);
        check(memcmp(gh_none[0], gh[0], NH * 4) == 0, "%-34s dh unchanged without gradients", tag);
        compare("one head dparams", tag, gp_val[0], gp_val[1], base, P, TOL);
        compare("one head dh", tag, gh_val[0], gh_val[1], hbase, NH, TOL);
    }
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 4; i++)
            free(out[k][i]);
        free(gp[k]), free(gh[k]), free(gh_none[k]), free(gp_val[k]), free(gh_val[k]);
    }
    free(h), free(base), free(hbase), free(gl), free(gm), free(gls), free(gv);
}

// ---------------------------------------------------------------------------------------------
// Actions

// The number of i < n where a and b differ in their bits.
static size_t bits_differ(const void *a, const void *b, size_t n, size_t size) {
    size_t d = 0;
    for (size_t i = 0; i < n; i++)
        d += memcmp((const char *)a + i * size, (const char *)b + i * size, size) != 0;
    return d;
}

// Whether draws a and b of a row with logits l (K) may both stand: every category boundary
// between them lies within 1e-6 of the row's uniform (rnnd_philox.h: the two backends round
// an exp apart and u S falls within that rounding of the boundary).
static bool boundary_tie(const float *l, int K, uint64_t seed, uint64_t env, uint64_t step,
                         int64_t a, int64_t b) {
    uint32_t key[2], w[4];
    rnnd_philox_env_key(seed, env, key);
    rnnd_philox_step_words(key, step, 0, w);
    double u = rnnd_philox_u01(w[0]), mx = l[0], S = 0.0, C = 0.0;
    for (int k = 1; k < K; k++)
        mx = l[k] > mx ? l[k] : mx;
    for (int k = 0; k < K; k++)
        S += exp(l[k] - mx);
    for (int64_t k = 0; k < (a > b ? a : b); k++) {
        C += exp(l[k] - mx) / S;
        if (k >= (a < b ? a : b) && fabs(C - u) > 1e-6)
            return false;
    }
    return true;
}

static void test_actions(const struct rnnd_model *m, const float *params, const char *tag, int N) {
    const struct rnnd_policy *p = &m->policy;
    const size_t P = rnnd_model_param_count(m), W = p->K ? (size_t)p->K : (size_t)p->A;
    const size_t NW = (size_t)N * W, act_bytes = p->K ? 8 : W * 4;
    // The head's outputs: logits from a wide range (peaked and flat rows), means in +-2.
    float *dist = host_uniform(NW, p->K ? 4.0f : 2.0f);
    for (int r = 0; r < N && p->K; r++) // a few rows with ties, which both break alike
        if (r % 5 == 3)
            for (int k = 0; k < p->K; k++)
                dist[(size_t)r * W + k] = (float)(k % 2);
    uint64_t *env_ids = xmalloc((size_t)N * 8), *steps = xmalloc((size_t)N * 8);
    uint8_t *greedy = xmalloc((size_t)N);
    for (int r = 0; r < N; r++) {
        env_ids[r] = r % 3 ? rng_next() : (uint64_t)r;
        steps[r] = r % 4 ? rng_next() >> (rng_next() % 64) : (uint64_t)(r / 4);
        greedy[r] = rng_uniform() < 0.25;
    }
    const uint64_t seed = rng_next();
    // Actions for policy_logp: indices in 0 .. K-1, or Gaussian actions near the means.
    void *given = xmalloc((size_t)N * act_bytes);
    for (size_t i = 0; i < (p->K ? (size_t)N : NW); i++)
        if (p->K)
            ((int64_t *)given)[i] = (int64_t)(rng_next() % (uint64_t)p->K);
        else
            ((float *)given)[i] = dist[i] + (float)(rng_uniform() * 4.0 - 2.0);
    void *acts[2][2]; // [backend][greedy NULL, greedy given]
    float *lp[2][2], *ent[2][2], *lp2[2], *ent2[2];
    void *again = xmalloc((size_t)N * act_bytes);
    int err[2] = {0, 0}, bad_index[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        struct rnnd_backend *be = bes[k];
        struct bufs b = {.be = be};
        float *d_params = dev_in(&b, params, P), *d_dist = dev_in(&b, dist, NW);
        const uint64_t *d_env = dev(&b, env_ids, (size_t)N * 8);
        const uint64_t *d_steps = dev(&b, steps, (size_t)N * 8);
        const uint8_t *d_greedy = dev(&b, greedy, (size_t)N);
        void *d_act = p->K ? dev(&b, NULL, (size_t)N * 8) : (void *)dev_poison(&b, NW, k == 0);
        float *d_lp = dev_poison(&b, N, k == 0), *d_ent = dev_poison(&b, N, k == 0);
        struct rnnd_actions a = {
            .N = N,
            .logits = p->K ? d_dist : NULL,
            .mean = p->A ? d_dist : NULL,
            .index = p->K ? d_act : NULL,
            .action = p->A ? d_act : NULL,
            .logp = d_lp,
            .entropy = d_ent,
            .seed = seed,
            .env_ids = d_env,
            .steps = d_steps,
        };
        for (int g = 0; g < 2; g++) {
            a.greedy = g ? d_greedy : NULL;
            acts[k][g] = xmalloc((size_t)N * act_bytes);
            lp[k][g] = xmalloc((size_t)N * 4), ent[k][g] = xmalloc((size_t)N * 4);
            if (!err[k])
                err[k] = be->ops->policy_sample(be->ctx, &a, d_params, m);
            if (!err[k]) {
                be->ops->copy_out(be->ctx, acts[k][g], d_act, (size_t)N * act_bytes);
                to_host(be, lp[k][g], d_lp, N);
                to_host(be, ent[k][g], d_ent, N);
            }
        }
        // The same call again: the same actions (a retried step).
        if (!err[k] && k == 0) {
            err[k] = be->ops->policy_sample(be->ctx, &a, d_params, m);
            if (!err[k])
                be->ops->copy_out(be->ctx, again, d_act, (size_t)N * act_bytes);
        }
        // logp and entropy of given actions.
        be->ops->copy_in(be->ctx, d_act, given, (size_t)N * act_bytes);
        lp2[k] = xmalloc((size_t)N * 4), ent2[k] = xmalloc((size_t)N * 4);
        struct rnnd_actions q = a;
        q.env_ids = NULL, q.steps = NULL, q.greedy = NULL;
        if (!err[k])
            err[k] = be->ops->policy_logp(be->ctx, &q, d_params, m);
        if (!err[k]) {
            to_host(be, lp2[k], d_lp, N);
            to_host(be, ent2[k], d_ent, N);
        }
        if (p->K && !err[k]) { // an index out of range anywhere is refused
            int64_t badi = (N / 2) % 2 ? -1 : p->K;
            be->ops->copy_in(be->ctx, (int64_t *)d_act + N / 2, &badi, 8);
            bad_index[k] = be->ops->policy_logp(be->ctx, &q, d_params, m);
        }
        bufs_free(&b);
    }
    if (err[0] || err[1]) {
        fail("%s actions: cuda %s, cpu %s", tag, rnnd_err_name(err[0]), rnnd_err_name(err[1]));
    } else {
        for (int g = 0; g < 2; g++) {
            const char *gs = g ? "greedy mixed" : "greedy NULL";
            size_t nd;
            if (p->K) {
                // Every index equal, but where a drawn row's uniform sits on a category
                // boundary (then its logp is the CPU's for the comparison below).
                const int64_t *x = acts[0][g], *y = acts[1][g];
                size_t ties = 0;
                nd = 0;
                for (int r = 0; r < N; r++) {
                    if (x[r] == y[r])
                        continue;
                    bool drawn = !(g && greedy[r]);
                    if (drawn && x[r] >= 0 && x[r] < p->K &&
                        boundary_tie(dist + (size_t)r * W, p->K, seed, env_ids[r], steps[r], x[r],
                                     y[r])) {
                        ties++;
                        lp[0][g][r] = lp[1][g][r];
                    } else {
                        nd++;
                    }
                }
                check(nd == 0, "%-34s %s: %zu of %d indices differ (%zu on a boundary)", tag, gs,
                      nd, N, ties);
            } else {
                // Gaussian: every dim within 1e-5 relative; the bits differ only where the two
                // libraries round a function value apart (counted, not held to a bound).
                size_t far = 0;
                const float *x = acts[0][g], *y = acts[1][g];
                for (size_t i = 0; i < NW; i++)
                    far += !(fabsf(x[i] - y[i]) <= 1e-5f * (1.0f + fabsf(y[i])));
                nd = bits_differ(x, y, NW, 4);
                check(far == 0, "%-34s %s: %zu beyond 1e-5 (%zu of %zu dims differ in bits)", tag,
                      gs, far, nd, NW);
            }
            compare(g ? "logp greedy" : "logp", tag, lp[0][g], lp[1][g], NULL, N, 1e-5);
            compare(g ? "entropy greedy" : "entropy", tag, ent[0][g], ent[1][g], NULL, N, 1e-5);
        }
        check(memcmp(again, acts[0][1], (size_t)N * act_bytes) == 0,
              "%-34s the same key draws the same bits again", tag);
        compare("logp of given", tag, lp2[0], lp2[1], NULL, N, 1e-5);
        compare("entropy of given", tag, ent2[0], ent2[1], NULL, N, 1e-5);
        if (p->K)
            check(bad_index[0] == RNND_EINVAL && bad_index[1] == RNND_EINVAL,
                  "%-34s an index out of range: cuda %s, cpu %s", tag, rnnd_err_name(bad_index[0]),
                  rnnd_err_name(bad_index[1]));
    }
    for (int k = 0; k < 2; k++) {
        for (int g = 0; g < 2; g++)
            free(acts[k][g]), free(lp[k][g]), free(ent[k][g]);
        free(lp2[k]), free(ent2[k]);
    }
    free(dist), free(env_ids), free(steps), free(greedy), free(again), free(given);
}

// ---------------------------------------------------------------------------------------------
// Cases

static void test_case(const struct pol_case *pc) {
    struct rnnd_model m = {
        .cell = RNND_CELL_GRU, .compute = RNND_COMPUTE_FP32, .I = pc->I, .H = pc->H, .L = 1};
    m.policy = (struct rnnd_policy){.enc_layers = pc->enc_layers,
                                    .enc_width = {pc->w0, pc->w1},
                                    .enc_act = pc->act,
                                    .K = pc->K,
                                    .A = pc->A,
                                    .value = pc->value};
    char tag[96];
    snprintf(tag, sizeof(tag), "I%d H%d enc", pc->I, pc->H);
    for (int j = 0; j < pc->enc_layers; j++)
        snprintf(tag + strlen(tag), sizeof(tag) - strlen(tag), "%s%d", j ? "," : " ",
                 j ? pc->w1 : pc->w0);
    snprintf(tag + strlen(tag), sizeof(tag) - strlen(tag), "%s%s K%d A%d%s N%d%s",
             pc->enc_layers ? " " : " none", pc->enc_layers ? act_name(pc->act) : "", pc->K, pc->A,
             pc->value ? " v" : "", pc->N, pc->misalign ? " misaligned" : "");
    printf("%s\n", tag);
    if (rnnd_model_check(&m) != 0) {
        fail("%s: not a valid model", tag);
        return;
    }
    gpu_seed(tag);
    misalign = pc->misalign;
    size_t P = rnnd_model_param_count(&m);
    float *params = xmalloc(P * 4);
    rnnd_model_init_params(&m, rng_next(), params);
    if (pc->A) { // a learned log-std away from 0
        float *ls = params + tensor_offset(&m, "action_log_std");
        for (int j = 0; j < pc->A; j++)
            ls[j] = (float)(rng_uniform() * 1.5 - 1.0);
    }
    if (pc->enc_layers)
        test_encoder(&m, params, tag, pc->N);
    test_heads(&m, params, tag, pc->N);
    if (pc->K || pc->A)
        test_actions(&m, params, tag, pc->N);
    misalign = false;
    free(params);
}

// Every policy op refuses what the CPU refuses, with RNND_EINVAL on both.
static void test_bad_arguments(void) {
    printf("bad arguments\n");
    struct rnnd_model disc = {.cell = RNND_CELL_GRU, .I = 6, .H = 8, .L = 1};
    disc.policy = (struct rnnd_policy){.enc_layers = 1, .enc_width = {5}, .K = 3, .value = true};
    struct rnnd_model gauss = disc, bare = disc, vonly = disc;
    gauss.policy.K = 0, gauss.policy.A = 2, gauss.policy.value = false;
    bare.policy.enc_layers = 0; // heads without an encoder
    vonly.policy.K = 0;         // a value head and no action head
    const int N = 4;
    for (int k = 0; k < 2; k++) {
        struct rnnd_backend *be = bes[k];
        const struct rnnd_backend_ops *o = be->ops;
        struct bufs b = {.be = be};
        float *f = dev_poison(&b, 4096, false), *pp = dev_poison(&b, 4096, false);
        int64_t *ix = dev(&b, NULL, N * 8);
        be->ops->zero(be->ctx, ix, N * 8);
        uint64_t *keys = dev(&b, NULL, N * 8);
        struct rnnd_heads hl = {.logits = f}, hm = {.mean = f}, hv = {.value = f};
        struct rnnd_actions ad = {.N = N, .logits = f, .index = ix, .env_ids = keys, .steps = keys};
        struct rnnd_actions ag = {
            .N = N, .mean = f, .action = f + 64, .env_ids = keys, .steps = keys};
        struct rnnd_actions a0 = ad, anoix = ad, anokey = ad, ag_nomean = ag;
        a0.N = 0, anoix.index = NULL, anokey.steps = NULL, ag_nomean.mean = NULL;
        struct {
            const char *what;
            int rc;
        } calls[] = {
            {"encoder_forward N 0", o->encoder_forward(be->ctx, f, f, 0, pp, &disc)},
            {"encoder_forward acts NULL", o->encoder_forward(be->ctx, NULL, f, N, pp, &disc)},
            {"encoder_forward obs NULL", o->encoder_forward(be->ctx, f, NULL, N, pp, &disc)},
            {"encoder_forward params NULL", o->encoder_forward(be->ctx, f, f, N, NULL, &disc)},
            {"encoder_forward no encoder", o->encoder_forward(be->ctx, f, f, N, pp, &bare)},
            {"encoder_backward grad_out NULL",
             o->encoder_backward(be->ctx, pp, f, NULL, f, f, N, pp, &disc)},
            {"encoder_backward grad_params NULL",
             o->encoder_backward(be->ctx, NULL, f, f, f, f, N, pp, &disc)},
            {"encoder_backward no encoder",
             o->encoder_backward(be->ctx, pp, f, f, f, f, N, pp, &bare)},
            {"heads_forward mean on K", o->heads_forward(be->ctx, &hm, f, N, pp, &disc)},
            {"heads_forward logits on A", o->heads_forward(be->ctx, &hl, f, N, pp, &gauss)},
            {"heads_forward value without", o->heads_forward(be->ctx, &hv, f, N, pp, &gauss)},
            {"heads_forward h NULL", o->heads_forward(be->ctx, &hl, NULL, N, pp, &disc)},
            {"heads_forward N 0", o->heads_forward(be->ctx, &hl, f, 0, pp, &disc)},
            {"heads_forward params NULL", o->heads_forward(be->ctx, &hl, f, N, NULL, &disc)},
            {"heads_backward grad_h NULL",
             o->heads_backward(be->ctx, pp, NULL, &hl, f, N, pp, &disc)},
            {"heads_backward grad_params NULL",
             o->heads_backward(be->ctx, NULL, f, &hl, f, N, pp, &disc)},
            {"heads_backward mean on K", o->heads_backward(be->ctx, pp, f, &hm, f, N, pp, &disc)},
            {"policy_sample N 0", o->policy_sample(be->ctx, &a0, pp, &disc)},
            {"policy_sample index NULL", o->policy_sample(be->ctx, &anoix, pp, &disc)},
            {"policy_sample steps NULL", o->policy_sample(be->ctx, &anokey, pp, &disc)},
            {"policy_sample params NULL", o->policy_sample(be->ctx, &ad, NULL, &disc)},
            {"policy_sample no action head", o->policy_sample(be->ctx, &ad, pp, &vonly)},
            {"policy_sample mean NULL", o->policy_sample(be->ctx, &ag_nomean, pp, &gauss)},
            {"policy_sample logits on A", o->policy_sample(be->ctx, &ad, pp, &gauss)},
            {"policy_logp N 0", o->policy_logp(be->ctx, &a0, pp, &disc)},
            {"policy_logp index NULL", o->policy_logp(be->ctx, &anoix, pp, &disc)},
            {"policy_logp no action head", o->policy_logp(be->ctx, &ad, pp, &vonly)},
        };
        for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++)
            check(calls[i].rc == RNND_EINVAL, "%s %-34s %s", be->ops->name, calls[i].what,
                  rnnd_err_name(calls[i].rc));
        // And the valid calls next to them run (the refusals are about the arguments).
        check(o->policy_logp(be->ctx, &ad, pp, &disc) == 0, "%s policy_logp valid", be->ops->name);
        bufs_free(&b);
    }
}

static const enum rnnd_act ELU = RNND_ACT_ELU, RELU = RNND_ACT_RELU, TANH = RNND_ACT_TANH;

// I, H, enc_layers, w0, w1, act, K, A, value, N, misalign, quick.
static const struct pol_case pol_cases[] = {
    // The daemon's shapes: encoder 64,64 or 64, discrete or Gaussian head and a value head,
    // at one row, a few, a step of 1024 envs and a learner's B*T = 131072 (the 64 x 64 tiles).
    {32, 64, 2, 64, 64, ELU, 6, 0, true, 1, false, true},
    {32, 64, 2, 64, 64, RELU, 18, 0, true, 7, false, true},
    {48, 128, 1, 64, 0, TANH, 2, 0, true, 1024, false, true},
    {64, 128, 2, 64, 64, ELU, 6, 0, true, 131072, false, false},
    {17, 50, 2, 33, 70, TANH, 0, 3, true, 7, false, true},
    {32, 64, 1, 64, 0, RELU, 0, 6, false, 1024, false, false},
    {24, 128, 2, 64, 64, TANH, 0, 2, true, 131072, false, false},
    // No encoder; widths that are no multiple of any tile; a value head alone; misaligned.
    {9, 64, 0, 0, 0, ELU, 4, 0, false, 1, false, false},
    {9, 64, 0, 0, 0, ELU, 0, 1, true, 1024, false, false},
    {300, 257, 2, 200, 130, ELU, 18, 0, true, 1024, false, false},
    {13, 31, 2, 7, 5, RELU, 0, 5, true, 3001, false, false},
    {16, 64, 1, 32, 0, RELU, 0, 0, true, 7, false, false},
    {32, 64, 2, 64, 64, RELU, 18, 0, true, 7, true, false},
    {17, 50, 2, 33, 70, TANH, 0, 3, true, 1030, true, false},
};

int main(int argc, char **argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    struct rnnd_backend gpu = {0}, cpu = {0};
    gpu_check_open(&gpu, &cpu);
    bes[0] = &gpu, bes[1] = &cpu;
    for (size_t i = 0; i < sizeof(pol_cases) / sizeof(pol_cases[0]); i++)
        if (!quick || pol_cases[i].quick)
            test_case(&pol_cases[i]);
    // Every discrete width from 2 to 18 and Gaussian from 1 to 6, at a step's 1024 rows.
    for (int K = 2; K <= 18 && !quick; K++)
        test_case(&(struct pol_case){8, 64, 0, 0, 0, ELU, K, 0, true, 1024, false, false});
    for (int A = 1; A <= 6 && !quick; A++)
        test_case(&(struct pol_case){8, 64, 1, 16, 0, TANH, 0, A, true, 1024, false, false});
    test_bad_arguments();
    return gpu_check_close(&gpu, &cpu);
}
