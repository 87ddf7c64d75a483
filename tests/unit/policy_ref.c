/*
 * policy_ref.c: runs the CPU backend's policy training chain on tensors from files, so that
 * client/python/tests/test_policy.py can compare it with rnnd.torch.Policy. Not a test by itself.
 *
 * Usage: policy_ref DIR. Reads DIR/weights.safetensors (the policy's parameters, by name:
 * what rnnd.save_safetensors(path, Policy.weights()) writes) and DIR/inputs.safetensors, whose
 * metadata is the model: cell, I, H, L, encoder ("8,6" or ""), activation, K, A, value (0|1),
 * seed; and whose tensors are obs [B, T, I] F32, is_init [B, T] U8, optional h0/c0 [B, L, H] or
 * hidden/cell [B, T, L, H], the loss's gradients grad_logits [B, T, K], grad_mean and
 * grad_log_std [B, T, A], grad_value [B, T], the actions to score (index I64 [B, T] or action
 * [B, T, A] F32) and env_ids I64 [B] (sampling keys: env_ids[b], step t).
 * Runs encoder_forward -> rnn_forward -> heads_forward, policy_logp and policy_sample, then
 * heads_backward -> rnn_backward -> encoder_backward, and writes DIR/outputs.safetensors (logits,
 * mean, log_std, value, output, h_n, c_n, logp, entropy, sample_index or sample_action,
 * sample_logp, grad_obs, grad_h0, grad_c0, grad_hidden, grad_cell: those that apply),
 * DIR/grads.safetensors (parameter gradients, by parameter name) and DIR/weights_out.safetensors
 * (the parameters as read, written back; metadata "names": every name in the model's order).
 * Exits 1 with the reason on stderr when a file does not fit the model.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rnnd_kernels.h"
#include "rnnd_safetensors.h"

// Every buffer this tool allocates, freed together at the end (so sanitizer builds see no leak).
static void *owned[64];
static int nowned;

static void *alloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (p == NULL || nowned == (int)(sizeof(owned) / sizeof(owned[0]))) {
        fprintf(stderr, "policy_ref: out of memory\n");
        exit(1);
    }
    return owned[nowned++] = p;
}

static void die(const char *what, const char *why) {
    fprintf(stderr, "policy_ref: %s: %s\n", what, why);
    exit(1);
}

static void *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        die(path, "cannot open");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = alloc(n > 0 ? (size_t)n : 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n)
        die(path, "cannot read");
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void write_all(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(buf, 1, len, f) != len || fclose(f) != 0)
        die(path, "cannot write");
}

static int meta_int(const struct rnnd_st_file *f, const char *key) {
    const char *v = rnnd_st_meta(f, key);
    if (v == NULL)
        die("inputs.safetensors", key);
    return atoi(v);
}

// A float copy of the F32 tensor name with count floats, or NULL when absent.
static float *floats(const struct rnnd_st_file *f, const char *name, size_t count) {
    const struct rnnd_st_tensor *t = rnnd_st_find(f, name);
    if (t == NULL)
        return NULL;
    if (t->dtype != RNND_ST_F32 || t->bytes != count * sizeof(float))
        die(name, "wrong dtype or size");
    float *p = alloc(t->bytes);
    memcpy(p, t->data, t->bytes);
    return p;
}

static float *zeros(size_t n) {
    return alloc(n * sizeof(float));
}

struct outs {
    struct rnnd_st_tensor t[24];
    int n;
};

static void out_add(struct outs *o, const char *name, enum rnnd_st_dtype dt, const void *data,
                    int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    if (data == NULL)
        return;
    struct rnnd_st_tensor *t = &o->t[o->n++];
    *t = (struct rnnd_st_tensor){
        .name = name, .dtype = dt, .ndim = ndim, .shape = {d0, d1, d2, d3}, .data = data};
    size_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= (size_t)t->shape[d];
    t->bytes = n * rnnd_st_dtype_size(dt);
}

int main(int argc, char **argv) {
    if (argc != 2)
        die("usage", "policy_ref DIR");
    char path[4096], err[256];
    size_t len;

    // The model, from the inputs' metadata.
    snprintf(path, sizeof(path), "%s/inputs.safetensors", argv[1]);
    void *ibuf = read_all(path, &len);
    struct rnnd_st_file in;
    if (rnnd_st_decode(ibuf, len, &in, err, sizeof(err)) != 0)
        die(path, err);
    struct rnnd_model m = {.cell = strcmp(rnnd_st_meta(&in, "cell"), "lstm") == 0 ? RNND_CELL_LSTM
                                                                                  : RNND_CELL_GRU,
                           .I = meta_int(&in, "I"),
                           .H = meta_int(&in, "H"),
                           .L = meta_int(&in, "L")};
    struct rnnd_policy *p = &m.policy;
    const char *enc = rnnd_st_meta(&in, "encoder");
    while (enc && *enc && p->enc_layers < RNND_MAX_ENCODER_LAYERS) {
        p->enc_width[p->enc_layers++] = atoi(enc);
        enc = strchr(enc, ',') ? strchr(enc, ',') + 1 : "";
    }
    const char *act = rnnd_st_meta(&in, "activation");
    p->enc_act = strcmp(act, "relu") == 0   ? RNND_ACT_RELU
                 : strcmp(act, "tanh") == 0 ? RNND_ACT_TANH
                                            : RNND_ACT_ELU;
    p->K = meta_int(&in, "K");
    p->A = meta_int(&in, "A");
    p->value = meta_int(&in, "value") != 0;
    if (rnnd_model_validate(&m, err, sizeof(err)) != 0)
        die("model", err);
    struct rnnd_model core = rnnd_model_core(&m);
    bool lstm = m.cell == RNND_CELL_LSTM;

    // The weights, by name.
    snprintf(path, sizeof(path), "%s/weights.safetensors", argv[1]);
    void *wbuf = read_all(path, &len);
    struct rnnd_st_file wf;
    if (rnnd_st_decode(wbuf, len, &wf, err, sizeof(err)) != 0)
        die(path, err);
    size_t P = rnnd_model_param_count(&m);
    float *params = zeros(P), *grads = zeros(P);
    if (rnnd_st_decode_params(&m, &wf, params, err, sizeof(err)) != 0)
        die(path, err);

    const struct rnnd_st_tensor *obs_t = rnnd_st_find(&in, "obs");
    if (obs_t == NULL || obs_t->ndim != 3)
        die("obs", "missing or not [B, T, I]");
    int B = (int)obs_t->shape[0], T = (int)obs_t->shape[1], N = B * T;
    size_t NH = (size_t)N * m.H, BLH = (size_t)B * m.L * m.H, K = (size_t)p->K, A = (size_t)p->A;
    float *obs = floats(&in, "obs", (size_t)N * m.I);
    const struct rnnd_st_tensor *ii = rnnd_st_find(&in, "is_init");
    if (ii == NULL || ii->bytes != (size_t)N)
        die("is_init", "missing or not [B, T] U8");
    struct rnnd_seq seq = {.B = B,
                           .T = T,
                           .is_init = ii->data,
                           .h0 = floats(&in, "h0", BLH),
                           .c0 = floats(&in, "c0", BLH),
                           .hidden = floats(&in, "hidden", BLH * T),
                           .cell = floats(&in, "cell", BLH * T)};

    struct rnnd_backend be;
    if (rnnd_backend_cpu_init(&be) != 0)
        die("backend", "cannot start");
    const struct rnnd_backend_ops *ops = be.ops;

    // Forward.
    int W = rnnd_model_encoder_acts(&m);
    float *acts = zeros((size_t)N * W), *out = zeros(NH), *h_n = zeros(BLH);
    float *c_n = lstm ? zeros(BLH) : NULL;
    seq.x = p->enc_layers ? acts + (size_t)N * (W - core.I) : obs;
    if (p->enc_layers && ops->encoder_forward(be.ctx, acts, obs, N, params, &m) != 0)
        die("encoder_forward", "failed");
    void *tape = alloc(ops->tape_bytes(be.ctx, &core, B, T));
    if (ops->rnn_forward(be.ctx, out, h_n, c_n, tape, &seq, params, &core) != 0)
        die("rnn_forward", "failed");
    struct rnnd_heads hd = {.logits = K ? zeros(N * K) : NULL,
                            .mean = A ? zeros(N * A) : NULL,
                            .log_std = A ? zeros(N * A) : NULL,
                            .value = p->value ? zeros(N) : NULL};
    if (ops->heads_forward(be.ctx, &hd, out, N, params, &m) != 0)
        die("heads_forward", "failed");

    // Actions: log-probabilities of the given ones, and draws keyed by (seed, env, step).
    float *logp = NULL, *entropy = NULL, *s_logp = NULL, *s_action = NULL;
    int64_t *s_index = NULL;
    uint64_t *env = NULL, *step = NULL;
    if (K || A) {
        logp = zeros(N), entropy = zeros(N), s_logp = zeros(N);
        const struct rnnd_st_tensor *ix = rnnd_st_find(&in, "index");
        const struct rnnd_st_tensor *ids = rnnd_st_find(&in, "env_ids");
        if (ids == NULL || ids->bytes != (size_t)B * 8)
            die("env_ids", "missing or not [B] I64");
        struct rnnd_actions a = {
            .N = N, .logits = hd.logits, .mean = hd.mean, .logp = logp, .entropy = entropy};
        if (K) {
            if (ix == NULL || ix->bytes != (size_t)N * 8)
                die("index", "missing or not [B, T] I64");
            a.index = alloc((size_t)N * 8);
            memcpy(a.index, ix->data, (size_t)N * 8);
        } else {
            a.action = floats(&in, "action", N * A);
            if (a.action == NULL)
                die("action", "missing");
        }
        if (ops->policy_logp(be.ctx, &a, params, &m) != 0)
            die("policy_logp", "failed");
        env = alloc((size_t)N * 8), step = alloc((size_t)N * 8);
        for (int r = 0; r < N; r++) {
            memcpy(&env[r], (const char *)ids->data + (size_t)(r / T) * 8, 8);
            step[r] = (uint64_t)(r % T);
        }
        s_index = K ? alloc((size_t)N * 8) : NULL;
        s_action = A ? zeros(N * A) : NULL;
        struct rnnd_actions s = {.N = N,
                                 .logits = hd.logits,
                                 .mean = hd.mean,
                                 .index = s_index,
                                 .action = s_action,
                                 .logp = s_logp,
                                 .seed = (uint64_t)meta_int(&in, "seed"),
                                 .env_ids = env,
                                 .steps = step};
        if (ops->policy_sample(be.ctx, &s, params, &m) != 0)
            die("policy_sample", "failed");
    }

    // Backward.
    struct rnnd_heads g = {.logits = floats(&in, "grad_logits", N * K),
                           .mean = floats(&in, "grad_mean", N * A),
                           .log_std = floats(&in, "grad_log_std", N * A),
                           .value = floats(&in, "grad_value", N)};
    float *grad_h = zeros(NH), *grad_x = zeros((size_t)N * core.I);
    float *grad_obs = zeros((size_t)N * m.I);
    if (ops->heads_backward(be.ctx, grads, grad_h, &g, out, N, params, &m) != 0)
        die("heads_backward", "failed");
    struct rnnd_seq_grads sg = {.params = grads,
                                .x = p->enc_layers ? grad_x : grad_obs,
                                .h0 = zeros(BLH),
                                .c0 = lstm ? zeros(BLH) : NULL,
                                .hidden = seq.hidden ? zeros(BLH * T) : NULL,
                                .cell = seq.cell ? zeros(BLH * T) : NULL};
    if (ops->rnn_backward(be.ctx, &sg, grad_h, NULL, NULL, tape, &seq, params, &core) != 0)
        die("rnn_backward", "failed");
    if (p->enc_layers &&
        ops->encoder_backward(be.ctx, grads, grad_obs, grad_x, acts, obs, N, params, &m) != 0)
        die("encoder_backward", "failed");

    // Outputs.
    struct outs o = {.n = 0};
    enum rnnd_st_dtype F = RNND_ST_F32;
    out_add(&o, "logits", F, hd.logits, 3, B, T, (int64_t)K, 0);
    out_add(&o, "mean", F, hd.mean, 3, B, T, (int64_t)A, 0);
    out_add(&o, "log_std", F, hd.log_std, 3, B, T, (int64_t)A, 0);
    out_add(&o, "value", F, hd.value, 2, B, T, 0, 0);
    out_add(&o, "output", F, out, 3, B, T, m.H, 0);
    out_add(&o, "h_n", F, h_n, 3, B, m.L, m.H, 0);
    out_add(&o, "c_n", F, c_n, 3, B, m.L, m.H, 0);
    out_add(&o, "logp", F, logp, 2, B, T, 0, 0);
    out_add(&o, "entropy", F, entropy, 2, B, T, 0, 0);
    out_add(&o, "sample_index", RNND_ST_I64, s_index, 2, B, T, 0, 0);
    out_add(&o, "sample_action", F, s_action, 3, B, T, (int64_t)A, 0);
    out_add(&o, "sample_logp", F, s_logp, 2, B, T, 0, 0);
    out_add(&o, "grad_obs", F, grad_obs, 3, B, T, m.I, 0);
    if (!seq.hidden) { // the initial state's gradient (of h0, or of the implied zero state)
        out_add(&o, "grad_h0", F, sg.h0, 3, B, m.L, m.H, 0);
        out_add(&o, "grad_c0", F, sg.c0, 3, B, m.L, m.H, 0);
    }
    out_add(&o, "grad_hidden", F, sg.hidden, 4, B, T, m.L, m.H);
    out_add(&o, "grad_cell", F, sg.cell, 4, B, T, m.L, m.H);
    void *buf;
    if (rnnd_st_encode(o.t, o.n, NULL, 0, &buf, &len) != 0)
        die("outputs", "cannot encode");
    snprintf(path, sizeof(path), "%s/outputs.safetensors", argv[1]);
    write_all(path, buf, len);
    free(buf);

    if (rnnd_st_encode_params(&m, grads, NULL, 0, &buf, &len) != 0)
        die("grads", "cannot encode");
    snprintf(path, sizeof(path), "%s/grads.safetensors", argv[1]);
    write_all(path, buf, len);
    free(buf);

    char names[4096] = "";
    for (int k = 0; k < rnnd_model_param_tensors(&m); k++) {
        struct rnnd_param_tensor t;
        rnnd_model_param_tensor(&m, k, &t);
        strncat(names, k ? "," : "", sizeof(names) - strlen(names) - 1);
        strncat(names, t.name, sizeof(names) - strlen(names) - 1);
    }
    const char *meta[] = {"format", "pt", "names", names};
    if (rnnd_st_encode_params(&m, params, meta, 2, &buf, &len) != 0)
        die("weights_out", "cannot encode");
    snprintf(path, sizeof(path), "%s/weights_out.safetensors", argv[1]);
    write_all(path, buf, len);
    free(buf);
    rnnd_backend_free(&be);
    rnnd_st_file_free(&wf);
    rnnd_st_file_free(&in);
    while (nowned > 0)
        free(owned[--nowned]);
    return 0;
}
