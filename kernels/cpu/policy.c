/*
 * policy.c: the policy around the recurrent core on the CPU reference backend (docs/design.md
 * "Policy"): the observation encoder, the heads, and the actions drawn from them. Every op is
 * row-wise over N independent rows (B for a step, B*T for a trajectory batch); the core in
 * between is rnn.c's.
 *
 *   encoder, layer j:  y_j = act(y_{j-1} W_j^T + b_j)     y_{-1} = obs (N, I), y_j (N, w_j)
 *     act: elu (x > 0 ? x : e^x - 1), relu, tanh; act' from y alone: elu y > 0 ? 1 : y + 1,
 *     relu y > 0 ? 1 : 0, tanh 1 - y^2 (so backward needs only the saved outputs y_j).
 *   heads:  logits = h W_pi^T + b_pi (N, K);  mean = h W_mu^T + b_mu (N, A), log_std (A);
 *           value = h w_v^T + b_v (N)
 *   backward: dh = dlogits W_pi + dmean W_mu + dvalue w_v; dW = dY^T X, db = column sums of dY
 *             (d log_std = column sums of its per-row gradient); through the encoder,
 *             dz_j = dy_j act'(y_j), dW_j += dz_j^T y_{j-1}, dy_{j-1} = dz_j W_j.
 *   log-probabilities and entropies (double sums):
 *     discrete  logp(a) = l_a - m - ln S, S = sum_k e^(l_k - m);
 *               entropy = ln S - sum_k p_k (l_k - m)
 *     Gaussian  logp(a) = sum_j -z_j^2 / 2 - log_std_j - ln(2 pi) / 2,
 *               z_j = (a_j - mean_j) / std_j;  entropy = sum_j 1/2 + ln(2 pi) / 2 + log_std_j
 * Actions come from rnnd_philox.h (shared with CUDA). Matmuls are linear.c's sgemm in fp32 in
 * every compute mode: these layers are small next to the core's recurrence.
 */
#include "cpu.h"

#include <stdio.h>
#include <string.h>

#include "rnnd_philox.h"

// ---------------------------------------------------------------------------------------------
// Parameters

// The tensor called name in m (it exists: the caller checked the part is there).
static const float *param(const struct rnnd_model *m, const float *params, const char *name) {
    return params + rnnd_model_param_offset(m, name);
}

static float *grad(const struct rnnd_model *m, float *grads, const char *name) {
    return grads + rnnd_model_param_offset(m, name);
}

// ---------------------------------------------------------------------------------------------
// Encoder

static void bias_act(float *y, const float *b, size_t N, int w, enum rnnd_act act) {
    for (size_t n = 0; n < N; n++) {
        float *row = y + n * (size_t)w;
        for (int i = 0; i < w; i++) {
            float x = row[i] + b[i];
            row[i] = act == RNND_ACT_RELU   ? (x > 0.0f ? x : 0.0f)
                     : act == RNND_ACT_TANH ? tanhf(x)
                                            : (x > 0.0f ? x : expm1f(x));
        }
    }
}

// dz = dy * act'(y), n floats (dz may equal dy).
static void act_backward(float *dz, const float *dy, const float *y, size_t n, enum rnnd_act act) {
    for (size_t i = 0; i < n; i++) {
        float d = act == RNND_ACT_RELU   ? (y[i] > 0.0f ? 1.0f : 0.0f)
                  : act == RNND_ACT_TANH ? 1.0f - y[i] * y[i]
                                         : (y[i] > 0.0f ? 1.0f : y[i] + 1.0f);
        dz[i] = dy[i] * d;
    }
}

int rnnd__cpu_encoder_forward(struct cpu_ctx *c, float *acts, const float *obs, int N,
                              const float *params, const struct rnnd_model *m) {
    (void)c;
    if (rnnd_encoder_check(m, N, acts, obs) != 0 || params == NULL)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    const float *in = obs;
    float *y = acts;
    for (int j = 0; j < p->enc_layers; j++) {
        char name[32];
        int w = p->enc_width[j], ni = rnnd_model_encoder_input(m, j);
        snprintf(name, sizeof(name), "encoder.%d.weight", j);
        const float *W = param(m, params, name);
        snprintf(name, sizeof(name), "encoder.%d.bias", j);
        rnnd__cpu_gemm(false, true, N, w, ni, in, ni, W, ni, 0.0f, y, w);
        bias_act(y, param(m, params, name), (size_t)N, w, p->enc_act);
        in = y;
        y += (size_t)N * w;
    }
    return 0;
}

int rnnd__cpu_encoder_backward(struct cpu_ctx *c, float *grad_params, float *grad_obs,
                               const float *grad_out, const float *acts, const float *obs, int N,
                               const float *params, const struct rnnd_model *m) {
    if (rnnd_encoder_check(m, N, acts, obs) != 0 || !grad_params || !grad_out || !params)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    int maxw = rnnd_model_encoder_widest(m);
    // Two (N, maxw) buffers take turns holding dy_j (turned into dz_j in place) and dy_{j-1}.
    struct cpu_carve cv = {0};
    size_t rows = (size_t)N * (size_t)maxw;
    for (int pass = 0; pass < 2; pass++) {
        float *d[2] = {rnnd__cpu_carve(&cv, rows * sizeof(float)),
                       rnnd__cpu_carve(&cv, rows * sizeof(float))};
        double *acc = rnnd__cpu_carve(&cv, (size_t)maxw * sizeof(double));
        float *part = rnnd__cpu_carve(&cv, (size_t)maxw * sizeof(float));
        if (pass == 0) {
            if (rnnd__cpu_reserve(c, cv.used) != 0)
                return RNND_ENOMEM;
            cv = (struct cpu_carve){.base = c->work};
            continue;
        }
        size_t at = (size_t)N * (size_t)rnnd_model_encoder_acts(m);
        const float *dy = grad_out;
        for (int j = p->enc_layers - 1, cur = 0; j >= 0; j--, cur ^= 1) {
            int w = p->enc_width[j], ni = rnnd_model_encoder_input(m, j);
            at -= (size_t)N * w;
            const float *y = acts + at, *in = j > 0 ? acts + at - (size_t)N * ni : obs;
            float *dz = d[cur];
            act_backward(dz, dy, y, (size_t)N * w, p->enc_act);
            char name[32];
            snprintf(name, sizeof(name), "encoder.%d.weight", j);
            const float *W = param(m, params, name);
            rnnd__cpu_gemm(true, false, w, ni, N, dz, w, in, ni, 1.0f, grad(m, grad_params, name),
                           ni);
            snprintf(name, sizeof(name), "encoder.%d.bias", j);
            rnnd__cpu_add_colsum(grad(m, grad_params, name), dz, (size_t)N, w, w, acc, part);
            float *dx = j > 0 ? d[cur ^ 1] : grad_obs;
            if (dx)
                rnnd__cpu_gemm(false, false, N, ni, w, dz, w, W, ni, 0.0f, dx, ni);
            dy = dx;
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Heads

// y (N, n) = h (N, H) W^T (n, H) + b.
static void linear_rows(float *y, const float *h, const float *W, const float *b, int N, int n,
                        int H) {
    rnnd__cpu_gemm(false, true, N, n, H, h, H, W, H, 0.0f, y, n);
    for (size_t r = 0; r < (size_t)N; r++)
        for (int i = 0; i < n; i++)
            y[r * (size_t)n + i] += b[i];
}

int rnnd__cpu_heads_forward(struct cpu_ctx *c, const struct rnnd_heads *out, const float *h, int N,
                            const float *params, const struct rnnd_model *m) {
    (void)c;
    if (rnnd_heads_check(out, h, N, m) != 0 || params == NULL)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    int H = m->H;
    if (out->logits)
        linear_rows(out->logits, h, param(m, params, "policy_logits.weight"),
                    param(m, params, "policy_logits.bias"), N, p->K, H);
    if (out->mean)
        linear_rows(out->mean, h, param(m, params, "action_mean.weight"),
                    param(m, params, "action_mean.bias"), N, p->A, H);
    if (out->log_std) {
        const float *ls = param(m, params, "action_log_std");
        for (size_t r = 0; r < (size_t)N; r++)
            memcpy(out->log_std + r * (size_t)p->A, ls, (size_t)p->A * sizeof(float));
    }
    if (out->value)
        linear_rows(out->value, h, param(m, params, "value.weight"), param(m, params, "value.bias"),
                    N, 1, H);
    return 0;
}

// The backward of one Linear head y = h W^T + b from dy (N, n): dW += dy^T h, db += column sums
// of dy, dh += dy W.
static void linear_rows_backward(float *dW, float *db, float *dh, const float *dy, const float *h,
                                 const float *W, int N, int n, int H, double *acc, float *part) {
    rnnd__cpu_gemm(true, false, n, H, N, dy, n, h, H, 1.0f, dW, H);
    rnnd__cpu_add_colsum(db, dy, (size_t)N, n, n, acc, part);
    rnnd__cpu_gemm(false, false, N, H, n, dy, n, W, H, 1.0f, dh, H);
}

int rnnd__cpu_heads_backward(struct cpu_ctx *c, float *grad_params, float *grad_h,
                             const struct rnnd_heads *g, const float *h, int N, const float *params,
                             const struct rnnd_model *m) {
    if (rnnd_heads_check(g, h, N, m) != 0 || !grad_params || !grad_h || !params)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    int H = m->H, widest = p->K > p->A ? p->K : p->A;
    widest = widest > 1 ? widest : 1;
    struct cpu_carve cv = {0};
    rnnd__cpu_carve(&cv, (size_t)widest * sizeof(double));
    rnnd__cpu_carve(&cv, (size_t)widest * sizeof(float));
    if (rnnd__cpu_reserve(c, cv.used) != 0)
        return RNND_ENOMEM;
    cv = (struct cpu_carve){.base = c->work};
    double *acc = rnnd__cpu_carve(&cv, (size_t)widest * sizeof(double));
    float *part = rnnd__cpu_carve(&cv, (size_t)widest * sizeof(float));

    if (g->logits)
        linear_rows_backward(grad(m, grad_params, "policy_logits.weight"),
                             grad(m, grad_params, "policy_logits.bias"), grad_h, g->logits, h,
                             param(m, params, "policy_logits.weight"), N, p->K, H, acc, part);
    if (g->mean)
        linear_rows_backward(grad(m, grad_params, "action_mean.weight"),
                             grad(m, grad_params, "action_mean.bias"), grad_h, g->mean, h,
                             param(m, params, "action_mean.weight"), N, p->A, H, acc, part);
    if (g->log_std)
        rnnd__cpu_add_colsum(grad(m, grad_params, "action_log_std"), g->log_std, (size_t)N, p->A,
                             p->A, acc, part);
    if (g->value)
        linear_rows_backward(grad(m, grad_params, "value.weight"),
                             grad(m, grad_params, "value.bias"), grad_h, g->value, h,
                             param(m, params, "value.weight"), N, 1, H, acc, part);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Actions

// logp and entropy of each row's action (read from a).
static void action_stats(const struct rnnd_actions *a, const float *params,
                         const struct rnnd_model *m) {
    const struct rnnd_policy *p = &m->policy;
    const float *ls = p->A ? param(m, params, "action_log_std") : NULL;
    for (size_t r = 0; r < (size_t)a->N; r++) {
        float *lp = a->logp ? a->logp + r : NULL, *ent = a->entropy ? a->entropy + r : NULL;
        if (p->K)
            rnnd_categorical_stats(a->logits + r * (size_t)p->K, p->K, a->index[r], lp, ent);
        else
            rnnd_gaussian_stats(a->mean + r * (size_t)p->A, ls, a->action + r * (size_t)p->A, p->A,
                                lp, ent);
    }
}

int rnnd__cpu_policy_sample(struct cpu_ctx *c, const struct rnnd_actions *a, const float *params,
                            const struct rnnd_model *m) {
    (void)c;
    if (rnnd_actions_check(a, m, true) != 0 || params == NULL)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    const float *ls = p->A ? param(m, params, "action_log_std") : NULL;
    for (size_t r = 0; r < (size_t)a->N; r++) {
        bool greedy = a->greedy && a->greedy[r];
        uint32_t key[2];
        rnnd_philox_env_key(a->seed, a->env_ids[r], key);
        if (p->K) {
            const float *l = a->logits + r * (size_t)p->K;
            int best = 0;
            if (greedy) {
                for (int k = 1; k < p->K; k++)
                    best = l[k] > l[best] ? k : best;
            } else {
                uint32_t w[4];
                rnnd_philox_step_words(key, a->steps[r], 0, w);
                best = rnnd_sample_categorical(l, p->K, rnnd_philox_u01(w[0]));
            }
            a->index[r] = best;
            continue;
        }
        const float *mu = a->mean + r * (size_t)p->A;
        float *x = a->action + r * (size_t)p->A;
        if (greedy) {
            memcpy(x, mu, (size_t)p->A * sizeof(float));
            continue;
        }
        rnnd_sample_normals(key, a->steps[r], p->A, x); // z, then scaled in place
        for (int j = 0; j < p->A; j++)
            x[j] = mu[j] + expf(ls[j]) * x[j];
    }
    action_stats(a, params, m);
    return 0;
}

int rnnd__cpu_policy_logp(struct cpu_ctx *c, const struct rnnd_actions *a, const float *params,
                          const struct rnnd_model *m) {
    (void)c;
    if (rnnd_actions_check(a, m, false) != 0 || params == NULL)
        return RNND_EINVAL;
    if (m->policy.K)
        for (int r = 0; r < a->N; r++)
            if (a->index[r] < 0 || a->index[r] >= m->policy.K)
                return RNND_EINVAL;
    action_stats(a, params, m);
    return 0;
}
