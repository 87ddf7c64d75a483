/*
 * rnndctl.c: the command-line client of rnnd: health, info, step, end, weights export|import,
 * checkpoint, and bench (a load generator that reports env-steps/s and latency percentiles next
 * to the GetModelInfo round trip, the transport floor).
 *
 * Everything goes through the C client library (rnnd_client.h). Exit status: 0 success, 1 the
 * server answered with an error (or NOT_SERVING), 2 bad usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rnnd_client.h"
#include "rnnd_kernels.h"
#include "rnnd_safetensors.h"

static const char usage[] =
    "usage: rnndctl [OPTIONS] COMMAND [ARGS]\n"
    "\n"
    "Talks to an rnnd daemon over gRPC (rnnd.v1.Rnn, grpc.health.v1.Health).\n"
    "\n"
    "Options (anywhere on the line):\n"
    "  -t, --target HOST:PORT   daemon address (default $RNND_TARGET, else 127.0.0.1:50051)\n"
    "  --tls-ca FILE            use TLS, trusting the roots in FILE (PEM)\n"
    "  --tls-cert FILE          client certificate (PEM) for mutual TLS; needs --tls-key\n"
    "  --tls-key FILE           client private key (PEM)\n"
    "  --tls-server-name NAME   name to check in the server's certificate\n"
    "  --token-file FILE        bearer token (first line of FILE); default $RNND_TOKEN\n"
    "  --timeout-ms N           per-call deadline (default 30000)\n"
    "  -h, --help               this text\n"
    "  --version                the version and the git commit it was built from\n"
    "\n"
    "Commands:\n"
    "  health [--service NAME] [--watch]\n"
    "        grpc.health.v1 Check (or the first Watch reply); prints the status, exits 0 only\n"
    "        when SERVING. NAME defaults to \"\" (the server); rnnd also knows rnnd.v1.Rnn.\n"
    "  info  GetModelInfo, one key: value per line.\n"
    "  step --env ID[,ID...] [--init] [--obs V,V,...] [--seed N] [--steps N] [--step-index K]\n"
    "       [--state] [--full]\n"
    "        Steps the envs N times (default 1) with the given obs (B*I values, row-major,\n"
    "        reused each step) or uniform random obs in [-1, 1] from --seed. --init resets the\n"
    "        envs on the first step. --step-index K sends retry-safe indices K, K+1, ...\n"
    "        Prints each env's output (first 8 values unless --full) and with --state the state.\n"
    "  end --env ID[,ID...]\n"
    "        EndEpisodes: drops the envs' state and recorded steps.\n"
    "  weights export FILE.safetensors\n"
    "        GetWeights, written as safetensors with PyTorch names (load_state_dict-ready).\n"
    "  weights import FILE.safetensors\n"
    "        Reads FILE and sends it with SetWeights (every tensor, F32, the model's shapes).\n"
    "  checkpoint [--path DIR]\n"
    "        SaveCheckpoint; prints the directory written and the model version.\n"
    "  bench [--connections N] [--envs E] [--duration S] [--warmup S] [--stream] [--shm]\n"
    "        [--dtype float32|bfloat16] [--env-base ID] [--seed N] [--no-floor | --paired]\n"
    "        N connections (default 1), each one thread stepping E envs per request (default 1)\n"
    "        back to back for S seconds (default 5) after a warm-up (default 1 s); prints\n"
    "        env-steps/s, requests/s and latency p50/p90/p99, then the same for GetModelInfo\n"
    "        over the same connections (the transport floor) unless --no-floor. --paired times\n"
    "        the floor in the same window instead: each connection follows every Step with a\n"
    "        GetModelInfo, so that the p50s' ratio compares calls made side by side.\n"
    "        --stream uses StepStream (one stream per connection) instead of unary Step. --shm\n"
    "        sends the tensors through shared memory (one region per connection; a unix: or\n"
    "        loopback target on the daemon's host, as its user). --dtype: of the obs sent\n"
    "        and the outputs asked for (default float32). Env ids are ID + c*E + j (default ID\n"
    "        2^30 = 1073741824, a multiple of any --place-block up to it); they are released\n"
    "        with EndEpisodes after.\n";

static int usage_err(const char *fmt, const char *arg) {
    fprintf(stderr, "rnndctl: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see rnndctl --help)\n");
    return 2;
}

// Prints the last client error and returns 1.
static int call_err(const char *what) {
    const struct rnnd_client_error *e = rnnd_client_last_error();
    if (e->grpc_status >= 0)
        fprintf(stderr, "rnndctl: %s: %s: %s\n", what, rnnd_grpc_status_name(e->grpc_status),
                e->message);
    else
        fprintf(stderr, "rnndctl: %s: %s: %s\n", what, rnnd_err_name(e->code), e->message);
    return 1;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n < cap)
            break;
        cap *= 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb) {
            free(buf);
            buf = NULL;
        }
        buf = nb;
    }
    fclose(f);
    if (buf)
        buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// xorshift64*: obs generation only.
static float rand_unit(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    uint64_t r = *s * 2685821657736338717ull;
    return (float)((double)(r >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

// Parses "1,2,3" into a new array.
static int parse_u64_list(const char *s, uint64_t **out, size_t *n) {
    size_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    uint64_t *v = malloc(cap * sizeof *v);
    size_t k = 0;
    const char *p = s;
    while (v && *p) {
        char *end;
        errno = 0;
        unsigned long long x = strtoull(p, &end, 0);
        if (end == p || errno || (*end && *end != ',')) {
            free(v);
            return -1;
        }
        v[k++] = x;
        p = *end ? end + 1 : end;
    }
    *out = v;
    *n = k;
    return v && k ? 0 : -1;
}

static int parse_f32_list(const char *s, float **out, size_t *n) {
    size_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    float *v = malloc(cap * sizeof *v);
    size_t k = 0;
    const char *p = s;
    while (v && *p) {
        char *end;
        float x = strtof(p, &end);
        if (end == p || (*end && *end != ',')) {
            free(v);
            return -1;
        }
        v[k++] = x;
        p = *end ? end + 1 : end;
    }
    *out = v;
    *n = k;
    return v ? 0 : -1;
}

// ---------------------------------------------------------------------------------------------
// Command-line options. All options take a value except the flags listed in `flags`.

struct args {
    const char *pos[8];
    int npos;
    const char *target, *tls_ca, *tls_cert, *tls_key, *tls_name, *token_file, *timeout;
    const char *service, *env, *obs, *seed, *steps, *step_index, *path;
    const char *connections, *envs, *duration, *warmup, *env_base, *dtype;
    bool watch, init, state, full, stream, shm, no_floor, paired, help, version;
};

static int parse_args(int argc, char **argv, struct args *a) {
    struct {
        const char *name;
        const char **val;
        bool *flag;
    } opts[] = {
        {"--target", &a->target, NULL},
        {"-t", &a->target, NULL},
        {"--tls-ca", &a->tls_ca, NULL},
        {"--tls-cert", &a->tls_cert, NULL},
        {"--tls-key", &a->tls_key, NULL},
        {"--tls-server-name", &a->tls_name, NULL},
        {"--token-file", &a->token_file, NULL},
        {"--timeout-ms", &a->timeout, NULL},
        {"--service", &a->service, NULL},
        {"--env", &a->env, NULL},
        {"--obs", &a->obs, NULL},
        {"--seed", &a->seed, NULL},
        {"--steps", &a->steps, NULL},
        {"--step-index", &a->step_index, NULL},
        {"--path", &a->path, NULL},
        {"--connections", &a->connections, NULL},
        {"-c", &a->connections, NULL},
        {"--envs", &a->envs, NULL},
        {"-e", &a->envs, NULL},
        {"--duration", &a->duration, NULL},
        {"-d", &a->duration, NULL},
        {"--warmup", &a->warmup, NULL},
        {"--env-base", &a->env_base, NULL},
        {"--dtype", &a->dtype, NULL},
        {"--watch", NULL, &a->watch},
        {"--init", NULL, &a->init},
        {"--state", NULL, &a->state},
        {"--full", NULL, &a->full},
        {"--stream", NULL, &a->stream},
        {"--shm", NULL, &a->shm},
        {"--no-floor", NULL, &a->no_floor},
        {"--paired", NULL, &a->paired},
        {"--help", NULL, &a->help},
        {"-h", NULL, &a->help},
        {"--version", NULL, &a->version},
    };
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (s[0] != '-' || s[1] == '\0') {
            if (a->npos == 8)
                return usage_err("too many arguments at \"%s\"", s);
            a->pos[a->npos++] = s;
            continue;
        }
        const char *eq = strchr(s, '=');
        size_t nlen = eq ? (size_t)(eq - s) : strlen(s);
        bool found = false;
        for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++) {
            if (strlen(opts[k].name) != nlen || strncmp(opts[k].name, s, nlen) != 0)
                continue;
            found = true;
            if (opts[k].flag) {
                if (eq)
                    return usage_err("option %s takes no value", opts[k].name);
                *opts[k].flag = true;
            } else if (eq) {
                *opts[k].val = eq + 1;
            } else if (i + 1 < argc) {
                *opts[k].val = argv[++i];
            } else {
                return usage_err("option %s needs a value", opts[k].name);
            }
            break;
        }
        if (!found)
            return usage_err("unknown option \"%s\"", s);
    }
    return 0;
}

static bool parse_num(const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi))
        return false;
    *out = v;
    return true;
}

static char *tls_files[3];

static int connect_opts(const struct args *a, struct rnnd_client_opts *o) {
    memset(o, 0, sizeof *o);
    o->target = a->target ? a->target : getenv("RNND_TARGET");
    if (!o->target || !*o->target)
        o->target = "127.0.0.1:50051";
    const char *files[3] = {a->tls_ca, a->tls_cert, a->tls_key};
    for (int k = 0; k < 3; k++) {
        if (!files[k])
            continue;
        tls_files[k] = read_file(files[k], NULL);
        if (!tls_files[k]) {
            fprintf(stderr, "rnndctl: cannot read %s: %s\n", files[k], strerror(errno));
            return 2;
        }
    }
    o->tls_root_pem = tls_files[0];
    o->tls_cert_pem = tls_files[1];
    o->tls_key_pem = tls_files[2];
    o->tls_server_name = a->tls_name;
    static char token[4096];
    if (a->token_file) {
        char *t = read_file(a->token_file, NULL);
        if (!t) {
            fprintf(stderr, "rnndctl: cannot read %s: %s\n", a->token_file, strerror(errno));
            return 2;
        }
        t[strcspn(t, "\r\n")] = '\0';
        snprintf(token, sizeof token, "%s", t);
        free(t);
        o->token = token;
    } else if (getenv("RNND_TOKEN")) {
        o->token = getenv("RNND_TOKEN");
    }
    if (a->timeout) {
        double v;
        if (!parse_num(a->timeout, 1, 1e9, &v))
            return usage_err("bad --timeout-ms \"%s\"", a->timeout);
        o->timeout_ms = (int64_t)v;
    }
    return 0;
}

static int client_connect(const struct args *a, struct rnnd_client **c) {
    struct rnnd_client_opts o;
    int rc = connect_opts(a, &o);
    if (rc)
        return rc;
    if (rnnd_client_init(&o, c))
        return call_err("connect");
    return 0;
}

// ---------------------------------------------------------------------------------------------
// health, info, step, end, checkpoint

static const char *serving_name(int s) {
    static const char *const names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
    return s >= 0 && s <= 3 ? names[s] : "?";
}

static int cmd_health(struct rnnd_client *c, const struct args *a) {
    int st = 0;
    int err = a->watch ? rnnd_client_health_watch_first(c, a->service, &st)
                       : rnnd_client_health(c, a->service, &st);
    if (err)
        return call_err("health");
    printf("%s\n", serving_name(st));
    return st == 1 ? 0 : 1;
}

static int cmd_info(struct rnnd_client *c) {
    struct rnnd_model_info i;
    if (rnnd_client_info(c, &i))
        return call_err("info");
    printf("cell: %s\ninput_size: %" PRId64 "\nhidden_size: %" PRId64 "\nnum_layers: %" PRId64
           "\ncompute: %s\nbackend: %s\ndevice: %s\nmodel_version: %" PRIu64
           "\nenvs_active: %" PRIu64 "\nmax_batch: %" PRIu64 "\nextras_size: %" PRId64
           "\nkernel_plan: %s\n",
           i.cell, i.input_size, i.hidden_size, i.num_layers, i.compute, i.backend, i.device,
           i.model_version, i.envs_active, i.max_batch, i.extras_size, i.kernel_plan);
    if (i.n_encoder_widths || i.discrete_actions || i.gaussian_actions || i.value_head) {
        printf("encoder_widths:");
        for (int j = 0; j < i.n_encoder_widths; j++)
            printf("%s%" PRId64, j ? "," : " ", i.encoder_widths[j]);
        printf("\nencoder_activation: %s\ndiscrete_actions: %" PRId64 "\ngaussian_actions: %" PRId64
               "\nvalue_head: %d\n",
               i.encoder_activation, i.discrete_actions, i.gaussian_actions, i.value_head);
    }
    return 0;
}

static void print_row(const char *label, uint64_t id, const float *v, int64_t n, bool full) {
    printf("%s %" PRIu64 ":", label, id);
    int64_t shown = full || n <= 8 ? n : 8;
    for (int64_t k = 0; k < shown; k++)
        printf(" %.6g", v[k]);
    if (shown < n)
        printf(" ... (%" PRId64 " values)", n);
    printf("\n");
}

static int cmd_step(struct rnnd_client *c, const struct args *a) {
    if (!a->env)
        return usage_err("%s needs --env ID[,ID...]", "step");
    uint64_t *ids;
    size_t B;
    if (parse_u64_list(a->env, &ids, &B))
        return usage_err("bad --env \"%s\"", a->env);
    double steps = 1, seed = 1, k0 = -1;
    if (a->steps && !parse_num(a->steps, 1, 1e9, &steps))
        return usage_err("bad --steps \"%s\"", a->steps);
    if (a->seed && !parse_num(a->seed, 0, 1.8e19, &seed))
        return usage_err("bad --seed \"%s\"", a->seed);
    if (a->step_index && !parse_num(a->step_index, 0, 1.8e19, &k0))
        return usage_err("bad --step-index \"%s\"", a->step_index);
    struct rnnd_model_info info;
    if (rnnd_client_info(c, &info))
        return call_err("info");
    size_t I = (size_t)info.input_size;
    float *obs;
    size_t nobs;
    if (a->obs) {
        if (parse_f32_list(a->obs, &obs, &nobs))
            return usage_err("bad --obs \"%s\"", a->obs);
        if (nobs != B * I) {
            fprintf(stderr, "rnndctl: --obs has %zu values; the model wants B*I = %zu*%zu = %zu\n",
                    nobs, B, I, B * I);
            return 2;
        }
    } else {
        obs = malloc(B * I * sizeof *obs);
    }
    bool *init = calloc(B, sizeof *init);
    uint64_t *sidx = calloc(B, sizeof *sidx);
    uint64_t rng = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 1;
    int rc = 0;
    for (int64_t s = 0; s < (int64_t)steps && rc == 0; s++) {
        if (!a->obs)
            for (size_t k = 0; k < B * I; k++)
                obs[k] = rand_unit(&rng);
        for (size_t b = 0; b < B; b++) {
            init[b] = a->init && s == 0;
            sidx[b] = (uint64_t)k0 + (uint64_t)s;
        }
        struct rnnd_step_req req = {
            .n_env_ids = B,
            .env_ids = ids,
            .obs = rnnd_tensor_f32(obs, 2, (int64_t)B, (int64_t)I, 0, 0),
            .n_is_init = a->init ? B : 0,
            .is_init = init,
            .n_step_index = k0 >= 0 ? B : 0,
            .step_index = sidx,
            .return_state = a->state,
        };
        struct rnnd_step_reply r;
        if (rnnd_client_step(c, &req, &r)) {
            rc = call_err("step");
            break;
        }
        int64_t H = r.output.ndim == 2 ? r.output.shape[1] : 0;
        printf("step %" PRId64 " model_version %" PRIu64 "\n", s, r.model_version);
        for (size_t b = 0; b < B && H > 0; b++)
            print_row("  env", ids[b], (const float *)r.output.data + b * (size_t)H, H, a->full);
        if (r.h.present && r.h.ndim == 3) {
            int64_t n = r.h.shape[1] * r.h.shape[2];
            for (size_t b = 0; b < B; b++)
                print_row("  h env", ids[b], (const float *)r.h.data + b * (size_t)n, n, a->full);
        }
        if (r.c.present && r.c.ndim == 3) {
            int64_t n = r.c.shape[1] * r.c.shape[2];
            for (size_t b = 0; b < B; b++)
                print_row("  c env", ids[b], (const float *)r.c.data + b * (size_t)n, n, a->full);
        }
        // A policy's action (an index, or A floats), its log-prob and the value.
        for (size_t b = 0; b < B && r.action.present; b++) {
            printf("  action env %" PRIu64 ":", ids[b]);
            if (r.action.dtype == RNND_DTYPE_INT64) {
                printf(" %" PRId64, ((const int64_t *)r.action.data)[b]);
            } else {
                int64_t A = r.action.ndim == 2 ? r.action.shape[1] : 0;
                for (int64_t k = 0; k < A; k++)
                    printf(" %.6g", ((const float *)r.action.data)[b * (size_t)A + (size_t)k]);
            }
            if (r.log_prob.present)
                printf(" log_prob %.6g", ((const float *)r.log_prob.data)[b]);
            if (r.value.present)
                printf(" value %.6g", ((const float *)r.value.data)[b]);
            printf("\n");
        }
        rnnd_step_reply_free(&r);
    }
    free(obs);
    free(init);
    free(sidx);
    free(ids);
    return rc;
}

static int cmd_end(struct rnnd_client *c, const struct args *a) {
    uint64_t *ids;
    size_t n;
    if (!a->env || parse_u64_list(a->env, &ids, &n))
        return usage_err("end needs --env ID[,ID...]%s", "");
    uint64_t released;
    int err = rnnd_client_end_episodes(c, ids, n, &released);
    free(ids);
    if (err)
        return call_err("end");
    printf("released %" PRIu64 "\n", released);
    return 0;
}

static int cmd_checkpoint(struct rnnd_client *c, const struct args *a) {
    char *path;
    uint64_t version;
    if (rnnd_client_save_checkpoint(c, a->path, &path, &version))
        return call_err("checkpoint");
    printf("path: %s\nmodel_version: %" PRIu64 "\n", path, version);
    free(path);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// weights export | import

static int cmd_weights_export(struct rnnd_client *c, const char *file) {
    struct rnnd_named_tensors w;
    uint64_t version;
    if (rnnd_client_get_weights(c, &w, &version))
        return call_err("weights export");
    struct rnnd_model_info info;
    if (rnnd_client_info(c, &info))
        return call_err("info");
    struct rnnd_st_tensor *t = calloc(w.n ? w.n : 1, sizeof *t);
    int rc = 0;
    for (size_t k = 0; k < w.n && rc == 0; k++) {
        const struct rnnd_tensor *x = &w.v[k].tensor;
        t[k].name = w.v[k].name;
        t[k].ndim = x->ndim;
        memcpy(t[k].shape, x->shape, sizeof t[k].shape);
        t[k].data = x->data;
        t[k].bytes = x->nbytes;
        if (x->dtype == RNND_DTYPE_FLOAT32)
            t[k].dtype = RNND_ST_F32;
        else if (x->dtype == RNND_DTYPE_INT64)
            t[k].dtype = RNND_ST_I64;
        else if (x->dtype == RNND_DTYPE_BOOL)
            t[k].dtype = RNND_ST_BOOL;
        else {
            fprintf(stderr, "rnndctl: tensor %s has dtype %s, which safetensors export skips\n",
                    w.v[k].name, rnnd_dtype_name(x->dtype));
            rc = 1;
        }
    }
    char ver[32], in[32], hid[32], lay[32];
    snprintf(ver, sizeof ver, "%" PRIu64, version);
    snprintf(in, sizeof in, "%" PRId64, info.input_size);
    snprintf(hid, sizeof hid, "%" PRId64, info.hidden_size);
    snprintf(lay, sizeof lay, "%" PRId64, info.num_layers);
    const char *meta[] = {"format",          "pt", "rnnd_cell",          info.cell,
                          "rnnd_input_size", in,   "rnnd_hidden_size",   hid,
                          "rnnd_num_layers", lay,  "rnnd_model_version", ver};
    void *buf = NULL;
    size_t len = 0;
    if (rc == 0) {
        int err = rnnd_st_encode(t, (int)w.n, meta, 6, &buf, &len);
        if (err) {
            fprintf(stderr, "rnndctl: cannot encode the weights: %s\n", rnnd_strerror(err));
            rc = 1;
        }
    }
    if (rc == 0) {
        FILE *f = fopen(file, "wb");
        if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
            fprintf(stderr, "rnndctl: cannot write %s: %s\n", file, strerror(errno));
            rc = 1;
        } else {
            printf("wrote %s: %zu tensors, %zu bytes, model_version %" PRIu64 "\n", file, w.n, len,
                   version);
        }
    }
    free(buf);
    free(t);
    rnnd_named_tensors_free(&w);
    return rc;
}

static int cmd_weights_import(struct rnnd_client *c, const char *file) {
    size_t len;
    char *buf = read_file(file, &len);
    if (!buf) {
        fprintf(stderr, "rnndctl: cannot read %s: %s\n", file, strerror(errno));
        return 1;
    }
    struct rnnd_st_file f;
    char why[256] = "";
    int err = rnnd_st_decode(buf, len, &f, why, sizeof why);
    if (err) {
        fprintf(stderr, "rnndctl: %s is not a usable safetensors file: %s\n", file, why);
        free(buf);
        return 1;
    }
    struct rnnd_named_tensors l = {.n = (size_t)f.n, .v = calloc(f.n ? f.n : 1, sizeof *l.v)};
    // safetensors data may be unaligned; the wire wants bytes, so each tensor is copied aligned.
    for (int k = 0; k < f.n; k++) {
        const struct rnnd_st_tensor *t = &f.tensors[k];
        enum rnnd_dtype dt = t->dtype == RNND_ST_F32    ? RNND_DTYPE_FLOAT32
                             : t->dtype == RNND_ST_I64  ? RNND_DTYPE_INT64
                             : t->dtype == RNND_ST_BOOL ? RNND_DTYPE_BOOL
                                                        : RNND_DTYPE_UNSPECIFIED;
        l.v[k].name = (char *)t->name;
        l.v[k].tensor = rnnd_tensor_view(dt, NULL, t->ndim, t->shape);
        l.v[k].tensor.nbytes = t->bytes;
        l.v[k].tensor.data = (void *)t->data;
    }
    uint64_t version;
    int rc = 0;
    if (rnnd_client_set_weights(c, &l, &version))
        rc = call_err("weights import");
    else
        printf("imported %s: %d tensors, model_version %" PRIu64 "\n", file, f.n, version);
    free(l.v);
    rnnd_st_file_free(&f);
    free(buf);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// bench

struct lat_buf {
    float *v; // microseconds
    size_t n, cap;
};

static void lat_push(struct lat_buf *b, float us) {
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 4096;
        float *v = realloc(b->v, cap * sizeof *v);
        if (!v)
            return;
        b->v = v;
        b->cap = cap;
    }
    b->v[b->n++] = us;
}

struct bench {
    struct rnnd_client_opts opts;
    int conns, envs, I;
    enum rnnd_dtype dtype; // of the obs sent and the outputs asked for: FLOAT32 or BFLOAT16
    uint64_t env_base, seed;
    bool stream, floor; // floor: GetModelInfo instead of Step
    bool paired;        // a GetModelInfo after every Step, timed apart (lat_floor)
    size_t shm;         // each connection's tensors through a region of this size; 0: bytes
    double t_measure, t_end;
    pthread_barrier_t start;
};

struct bench_thread {
    struct bench *b;
    int idx;
    pthread_t tid;
    struct lat_buf lat, lat_floor;
    uint64_t env_steps, errors, calls, calls_floor;
    char first_error[1200];
};

static int cmp_float(const void *x, const void *y) {
    float a = *(const float *)x, b = *(const float *)y;
    return (a > b) - (a < b);
}

static void note_error(struct bench_thread *t, const char *what) {
    t->errors++;
    if (!t->first_error[0]) {
        const struct rnnd_client_error *e = rnnd_client_last_error();
        snprintf(t->first_error, sizeof t->first_error, "%s: %s: %s", what,
                 e->grpc_status >= 0 ? rnnd_grpc_status_name(e->grpc_status)
                                     : rnnd_err_name(e->code),
                 e->message);
    }
}

static void *bench_main(void *arg) {
    struct bench_thread *t = arg;
    struct bench *b = t->b;
    struct rnnd_client *c = NULL;
    int E = b->envs;
    uint64_t *ids = malloc((size_t)E * sizeof *ids);
    bool *init = malloc((size_t)E * sizeof *init);
    float *obs = malloc((size_t)E * (size_t)b->I * sizeof *obs);
    uint64_t rng = b->seed * 0x9E3779B97F4A7C15ull + (uint64_t)t->idx + 1;
    for (int j = 0; j < E; j++) {
        ids[j] = b->env_base + (uint64_t)t->idx * (uint64_t)E + (uint64_t)j;
        init[j] = true;
    }
    for (size_t k = 0; k < (size_t)E * (size_t)b->I; k++)
        obs[k] = rand_unit(&rng);
    if (b->dtype == RNND_DTYPE_BFLOAT16) // in place, into the first half of the buffer
        rnnd_cast_host(obs, RNND_FTYPE_BF16, obs, RNND_FTYPE_F32, (size_t)E * (size_t)b->I);
    struct rnnd_step_req req = {
        .n_env_ids = (size_t)E,
        .env_ids = ids,
        .obs = rnnd_tensor_view(b->dtype, obs, 2, (int64_t[]){E, b->I}),
        .n_is_init = (size_t)E,
        .is_init = init,
        .reply_dtype = b->dtype,
    };
    struct rnnd_client_stream *s = NULL;
    if (rnnd_client_init(&b->opts, &c) != 0)
        note_error(t, "connect");
    else if (rnnd_client_wait_connected(c, 5000) != 0)
        note_error(t, "connect");
    else if (b->shm && !b->floor && rnnd_client_shm_start(c, b->shm) != 0)
        note_error(t, "RegisterRegion");
    else if (b->stream && !b->floor && rnnd_client_stream_init(c, &s) != 0)
        note_error(t, "StepStream");
    pthread_barrier_wait(&b->start); // connected
    pthread_barrier_wait(&b->start); // window set
    if (t->errors)
        goto out;
    for (;;) {
        double t0 = now_s();
        if (t0 >= b->t_end)
            break;
        int err;
        if (b->floor) {
            struct rnnd_model_info info;
            err = rnnd_client_info(c, &info);
        } else {
            struct rnnd_step_reply r;
            err = s ? rnnd_client_stream_step(s, &req, &r) : rnnd_client_step(c, &req, &r);
            // The core's output, or a policy's first float tensor (it sends no output).
            const struct rnnd_tensor *f = r.output.present     ? &r.output
                                          : r.log_prob.present ? &r.log_prob
                                                               : &r.value;
            if (err == 0 && (!f->present || f->dtype != b->dtype)) {
                if (!t->first_error[0])
                    snprintf(t->first_error, sizeof t->first_error,
                             "Step: the output came as %s, not the %s asked for",
                             f->present ? rnnd_dtype_name(f->dtype) : "nothing",
                             rnnd_dtype_name(b->dtype));
                t->errors++;
            }
            rnnd_step_reply_free(&r);
        }
        double t1 = now_s();
        if (err) {
            note_error(t, b->floor ? "GetModelInfo" : "Step");
            if (s)
                break; // a failed stream is over
            continue;
        }
        if (!b->floor) {
            // After the first step every env has state: later requests carry no resets, as a
            // rollout's steady state does.
            req.n_is_init = 0;
        }
        if (t0 >= b->t_measure && t1 <= b->t_end) {
            t->calls++;
            t->env_steps += b->floor ? 0 : (uint64_t)E;
            lat_push(&t->lat, (float)((t1 - t0) * 1e6));
        }
        if (b->paired) {
            struct rnnd_model_info info;
            double t2 = now_s();
            err = rnnd_client_info(c, &info);
            double t3 = now_s();
            if (err)
                note_error(t, "GetModelInfo");
            else if (t2 >= b->t_measure && t3 <= b->t_end) {
                t->calls_floor++;
                lat_push(&t->lat_floor, (float)((t3 - t2) * 1e6));
            }
        }
    }
out:
    if (s) {
        rnnd_client_stream_close(s);
        rnnd_client_stream_free(s);
    }
    if (c && !b->floor)
        rnnd_client_end_episodes(c, ids, (size_t)E, NULL);
    rnnd_client_free(c);
    free(ids);
    free(init);
    free(obs);
    return NULL;
}

struct bench_result {
    double calls_per_s, env_steps_per_s, p50, p90, p99, mean;
    uint64_t calls, errors;
};

static float pct(const float *v, size_t n, double p) {
    if (n == 0)
        return NAN;
    size_t k = (size_t)ceil(p * (double)n) - 1;
    return v[k >= n ? n - 1 : k];
}

// The calls' rates and latencies of the threads' Steps (floor: their GetModelInfo calls, paired).
static void bench_collect(struct bench_thread *t, int n, bool floor, double duration,
                          struct bench_result *res) {
    size_t total = 0;
    for (int k = 0; k < n; k++) {
        const struct lat_buf *l = floor ? &t[k].lat_floor : &t[k].lat;
        total += l->n;
        res->calls += floor ? t[k].calls_floor : t[k].calls;
        res->env_steps_per_s += floor ? 0.0 : (double)t[k].env_steps;
    }
    float *all = malloc((total ? total : 1) * sizeof *all);
    size_t m = 0;
    double sum = 0;
    for (int k = 0; k < n; k++) {
        const struct lat_buf *l = floor ? &t[k].lat_floor : &t[k].lat;
        memcpy(all + m, l->v, l->n * sizeof *all);
        m += l->n;
        for (size_t i = 0; i < l->n; i++)
            sum += l->v[i];
    }
    qsort(all, m, sizeof *all, cmp_float);
    res->calls_per_s = (double)res->calls / duration;
    res->env_steps_per_s /= duration;
    res->p50 = pct(all, m, 0.50);
    res->p90 = pct(all, m, 0.90);
    res->p99 = pct(all, m, 0.99);
    res->mean = m ? sum / (double)m : NAN;
    free(all);
}

// One run of b's load; floor (paired runs) gets the GetModelInfo calls' figures.
static int bench_run(struct bench *b, double warmup, double duration, struct bench_result *res,
                     struct bench_result *floor) {
    struct bench_thread *t = calloc((size_t)b->conns, sizeof *t);
    pthread_barrier_init(&b->start, NULL, (unsigned)b->conns + 1);
    for (int k = 0; k < b->conns; k++) {
        t[k].b = b;
        t[k].idx = k;
        pthread_create(&t[k].tid, NULL, bench_main, &t[k]);
    }
    // First barrier: every thread is connected. The window is set between the two barriers
    // (which order memory), so no thread reads it early and slow connects do not eat into it.
    pthread_barrier_wait(&b->start);
    b->t_measure = now_s() + warmup;
    b->t_end = b->t_measure + duration;
    pthread_barrier_wait(&b->start);
    memset(res, 0, sizeof *res);
    for (int k = 0; k < b->conns; k++) {
        pthread_join(t[k].tid, NULL);
        res->errors += t[k].errors;
        if (t[k].first_error[0] && t[k].errors)
            fprintf(stderr, "rnndctl bench: connection %d: %" PRIu64 " errors, first: %s\n", k,
                    t[k].errors, t[k].first_error);
    }
    bench_collect(t, b->conns, false, duration, res);
    if (floor) {
        memset(floor, 0, sizeof *floor);
        bench_collect(t, b->conns, true, duration, floor);
        floor->errors = res->errors;
    }
    for (int k = 0; k < b->conns; k++) {
        free(t[k].lat.v);
        free(t[k].lat_floor.v);
    }
    free(t);
    pthread_barrier_destroy(&b->start);
    return 0;
}

static void print_lat(const struct bench_result *r) {
    printf("latency p50 %.1f us  p90 %.1f us  p99 %.1f us  mean %.1f us  errors %" PRIu64 "\n",
           r->p50, r->p90, r->p99, r->mean, r->errors);
}

static int cmd_bench(struct rnnd_client *c, const struct args *a) {
    double conns = 1, envs = 1, duration = 5, warmup = 1, base = 1073741824, seed = 1;
    if (a->connections && !parse_num(a->connections, 1, 4096, &conns))
        return usage_err("bad --connections \"%s\" (1..4096)", a->connections);
    if (a->envs && !parse_num(a->envs, 1, 1 << 20, &envs))
        return usage_err("bad --envs \"%s\"", a->envs);
    if (a->duration && !parse_num(a->duration, 0.1, 86400, &duration))
        return usage_err("bad --duration \"%s\" (seconds)", a->duration);
    if (a->warmup && !parse_num(a->warmup, 0, 3600, &warmup))
        return usage_err("bad --warmup \"%s\" (seconds)", a->warmup);
    if (a->env_base && !parse_num(a->env_base, 0, 1.8e19, &base))
        return usage_err("bad --env-base \"%s\"", a->env_base);
    if (a->seed && !parse_num(a->seed, 0, 1.8e19, &seed))
        return usage_err("bad --seed \"%s\"", a->seed);
    if (a->paired && a->no_floor)
        return usage_err("%s: the floor is timed beside the Steps or not at all", "--paired");
    // Every call allocates and frees request and reply buffers of hundreds of KB on each
    // connection's thread; with glibc's default thresholds they go back to the kernel and are
    // faulted in again. At 32 streams x 1024 envs on a 16-CPU H200 host that cost the bench
    // 17-26 CPU-seconds of system time in 5 s, taken from the daemon it measures (5-8 s when
    // kept in the heap, with 7.1M env-steps/s in fp32 against 5.1-5.4M).
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    struct rnnd_model_info info;
    if (rnnd_client_info(c, &info))
        return call_err("info");
    enum rnnd_dtype dtype = RNND_DTYPE_FLOAT32;
    if (a->dtype && strcmp(a->dtype, "bfloat16") == 0)
        dtype = RNND_DTYPE_BFLOAT16;
    else if (a->dtype && strcmp(a->dtype, "float32") != 0)
        return usage_err("bad --dtype \"%s\" (float32 or bfloat16)", a->dtype);
    struct bench b = {.conns = (int)conns,
                      .envs = (int)envs,
                      .I = (int)info.input_size,
                      .dtype = dtype,
                      .env_base = (uint64_t)base,
                      .seed = (uint64_t)seed,
                      .stream = a->stream,
                      .paired = a->paired};
    // Room for one request and its reply (with state), twice over.
    size_t row = (size_t)(info.input_size + 3 * info.num_layers * info.hidden_size) * sizeof(float);
    if (a->shm)
        b.shm = 2 * (size_t)b.envs * row + (1 << 16);
    int rc = connect_opts(a, &b.opts);
    if (rc)
        return rc;
    printf("rnndctl bench: target %s, %s %s H=%" PRId64 " I=%" PRId64 " L=%" PRId64
           " on %s (%s), max_batch %" PRIu64 "\n",
           b.opts.target, info.cell, info.compute, info.hidden_size, info.input_size,
           info.num_layers, info.backend, info.device, info.max_batch);
    printf("  %d connection(s) x %d env(s) per request, %s%s, %s, %.1f s measured after %.1f s "
           "warm-up\n",
           b.conns, b.envs, b.stream ? "StepStream" : "unary Step",
           b.shm ? " through shared memory" : "", rnnd_dtype_name(b.dtype), duration, warmup);
    struct bench_result step, floor;
    bench_run(&b, warmup, duration, &step, b.paired ? &floor : NULL);
    printf("Step          %12.0f env-steps/s  %10.0f req/s   ", step.env_steps_per_s,
           step.calls_per_s);
    print_lat(&step);
    if (!a->no_floor) {
        if (!b.paired) {
            b.floor = true;
            bench_run(&b, warmup, duration, &floor, NULL);
        }
        printf("GetModelInfo  %12s              %10.0f req/s   ", "", floor.calls_per_s);
        print_lat(&floor);
        printf("Step p50 / GetModelInfo p50: %.2fx%s\n", step.p50 / floor.p50,
               b.paired ? " (paired: each Step followed by a GetModelInfo)" : "");
    }
    return step.errors || (!a->no_floor && floor.errors) ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------

int main(int argc, char **argv) {
    struct args a = {0};
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    if (a.version) {
        printf("rnndctl %s (commit %s)\n", RNND_VERSION, RNND_COMMIT);
        return 0;
    }
    if (a.help || a.npos == 0) {
        fputs(usage, a.help ? stdout : stderr);
        return a.help ? 0 : 2;
    }
    const char *cmd = a.pos[0];
    static const char *const known[] = {"health",  "info",       "step", "end",
                                        "weights", "checkpoint", "bench"};
    bool ok = false;
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++)
        ok = ok || strcmp(cmd, known[k]) == 0;
    if (!ok)
        return usage_err("unknown command \"%s\"", cmd);
    if (strcmp(cmd, "weights") == 0 &&
        (a.npos != 3 || (strcmp(a.pos[1], "export") != 0 && strcmp(a.pos[1], "import") != 0)))
        return usage_err("usage: weights export|import FILE.safetensors%s", "");
    if (strcmp(cmd, "weights") != 0 && a.npos != 1)
        return usage_err("unexpected argument \"%s\"", a.pos[1]);

    struct rnnd_client *c;
    rc = client_connect(&a, &c);
    if (rc)
        return rc;
    if (strcmp(cmd, "health") == 0)
        rc = cmd_health(c, &a);
    else if (strcmp(cmd, "info") == 0)
        rc = cmd_info(c);
    else if (strcmp(cmd, "step") == 0)
        rc = cmd_step(c, &a);
    else if (strcmp(cmd, "end") == 0)
        rc = cmd_end(c, &a);
    else if (strcmp(cmd, "checkpoint") == 0)
        rc = cmd_checkpoint(c, &a);
    else if (strcmp(cmd, "bench") == 0)
        rc = cmd_bench(c, &a);
    else if (strcmp(a.pos[1], "export") == 0)
        rc = cmd_weights_export(c, a.pos[2]);
    else
        rc = cmd_weights_import(c, a.pos[2]);
    rnnd_client_free(c);
    for (int k = 0; k < 3; k++)
        free(tls_files[k]);
    return rc;
}
