/*
 * config.c: the flag/key table and its parser (see config.h). One static table describes every
 * option (name, type, limits, default, help), as redis keeps its config table: the parser, the
 * usage text and rnnd.conf.example are all derived from the same rows.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

enum opt_type {
    OPT_INT,
    OPT_U64,
    OPT_FLOAT,
    OPT_PATH,
    OPT_ADDR,
    OPT_LISTEN, // a list of addresses: comma-separated, and a flag repeated on the command line adds
    OPT_MODE,   // a file mode in octal
    OPT_ENUM,
    OPT_DEVICES,
    OPT_RANK,
    OPT_WIDTHS, // the encoder's widths: a comma-separated list into model.policy
    OPT_BOOL    // 0 or 1 into a bool
};

struct opt {
    const char *name; // flag without dashes
    enum opt_type type;
    size_t offset;
    size_t size;              // for strings
    long long min, max;       // OPT_INT
    double fmin, fmax;        // OPT_FLOAT, inclusive
    const char *const *names; // OPT_ENUM: NULL-terminated, index = value
    const char *arg;          // metavariable in the usage text
    const char *help;
};

static const char *const cell_names[] = {"gru", "lstm", NULL};
static const char *const compute_names[] = {"fp32", "ieee", "bf16", NULL};
static const char *const backend_names[] = {"auto", "cpu", "cuda", NULL};
static const char *const optim_names[] = {"adam", "sgd", NULL};
static const char *const level_names[] = {"debug", "info", "warn", "error", NULL};
static const char *const log_format_names[] = {"text", "json", NULL};
static const char *const act_names[] = {"elu", "relu", "tanh", NULL};

#define OFF(f)         offsetof(struct rnnd_config, f)
#define INT(f, lo, hi) OPT_INT, OFF(f), sizeof(int), lo, hi, 0, 0, NULL
#define U64(f)         OPT_U64, OFF(f), sizeof(uint64_t), 0, 0, 0, 0, NULL
#define FLT(f, lo, hi) OPT_FLOAT, OFF(f), sizeof(float), 0, 0, lo, hi, NULL
#define PATH(f)        OPT_PATH, OFF(f), sizeof(((struct rnnd_config *)0)->f), 0, 0, 0, 0, NULL
#define ADDR(f)        OPT_ADDR, OFF(f), sizeof(((struct rnnd_config *)0)->f), 0, 0, 0, 0, NULL
#define ENUM(f, n)     OPT_ENUM, OFF(f), sizeof(int), 0, 0, 0, 0, n
#define DEVICES(f)     OPT_DEVICES, OFF(f), sizeof(((struct rnnd_config *)0)->f), 0, 0, 0, 0, NULL
#define RANK(f)        OPT_RANK, OFF(f), sizeof(int), 0, 65535, 0, 0, NULL
#define LISTEN(f)      OPT_LISTEN, OFF(f), sizeof(((struct rnnd_config *)0)->f), 0, 0, 0, 0, NULL
#define MODE(f)        OPT_MODE, OFF(f), sizeof(int), 0, 0777, 0, 0, NULL
#define WIDTHS(f)      OPT_WIDTHS, OFF(f), sizeof(struct rnnd_policy), 0, 0, 0, 0, NULL
#define BOOL(f)        OPT_BOOL, OFF(f), sizeof(bool), 0, 1, 0, 0, NULL

static const struct opt opts[] = {
    {"config", PATH(config_file), "FILE",
     "read options from FILE (\"key value\" lines); flags win"},
    {"cell", ENUM(model.cell, cell_names), "gru|lstm", "recurrent cell"},
    {"input-size", INT(model.I, 1, RNND_MAX_WIDTH), "N", "observation width I"},
    {"hidden-size", INT(model.H, 1, RNND_MAX_WIDTH), "N", "hidden width H"},
    {"layers", INT(model.L, 1, RNND_MAX_LAYERS), "N", "stacked layers L"},
    {"compute", ENUM(model.compute, compute_names), "fp32|ieee|bf16",
     "matmul precision (fp32 allows TF32 on GPUs)"},
    {"encoder-widths", WIDTHS(model.policy), "N,N,...",
     "policy: an MLP encoder before the core, one Linear and activation per width (at most 4; "
     "empty: none, the core reads the observation)"},
    {"encoder-activation", ENUM(model.policy.enc_act, act_names), "elu|relu|tanh",
     "policy: the encoder's activation"},
    {"discrete-actions", INT(model.policy.K, 0, RNND_MAX_WIDTH), "K",
     "policy: a discrete action head of K logits (0: none; Step returns actions)"},
    {"gaussian-actions", INT(model.policy.A, 0, RNND_MAX_WIDTH), "A",
     "policy: a diagonal Gaussian action head of A dims with a learned log-std (0: none)"},
    {"value-head", BOOL(model.policy.value), "0|1", "policy: a value head (Step returns values)"},
    {"backend", ENUM(backend, backend_names), "auto|cpu|cuda",
     "auto: cuda when a device is usable, else cpu"},
    {"device", INT(device, 0, 1023), "N", "CUDA device index"},
    {"devices", DEVICES(devices), "N,N,...",
     "one engine per device (CUDA indices; with --backend cpu, that many CPU engines): envs are "
     "placed by a hash of their id or --place-block, batches split, gradients summed over NCCL "
     "(none: --device)"},
    {"place-block", INT(place_block, 1, 1 << 30), "N",
     "with --devices: the envs of each aligned block of N ids live on one device, the blocks "
     "taken in turn (1: each env placed by a hash of its id)"},
    {"rank", RANK(rank), "N|auto",
     "this rnnd's rank among --world-size (auto: $RNND_RANK, else the number ending the host "
     "name, as in a StatefulSet's rnnd-0, rnnd-1)"},
    {"world-size", INT(world_size, 1, 65536), "N",
     "rnnd instances (hosts) that keep one set of weights in sync over NCCL (--backend cpu: "
     "over TCP through rank 0)"},
    {"rendezvous", ADDR(rendezvous), "HOST:PORT",
     "where rank 0 listens and the other ranks connect to form the group (needs --world-size)"},
    {"rendezvous-timeout-s", INT(rendezvous_timeout_s, 1, 86400), "N",
     "how long the ranks wait for each other at start"},
    {"comm-timeout-s", INT(comm_timeout_s, 1, 3600), "N",
     "a collective (gradient sum, weight broadcast) that a device or host has not joined by then "
     "fails with UNAVAILABLE"},
    {"listen", LISTEN(listen), "HOST:PORT|unix:PATH",
     "gRPC address (port 0: any free port; unix:PATH a Unix socket for clients on this host); "
     "several: comma-separated, or the flag repeated"},
    {"listen-unix-mode", MODE(listen_unix_mode), "MODE",
     "file mode (octal) of the unix: sockets: who on this host may connect (tokens are still "
     "checked)"},
    {"http", ADDR(http), "HOST:PORT", "HTTP /healthz /readyz /metrics address, or \"off\""},
    {"data-listen", ADDR(data_listen), "HOST:PORT",
     "where socket regions' data connections listen (tensors as raw TCP bytes for clients on "
     "other hosts; plaintext): \"auto\" (the first TCP --listen host, any free port; off "
     "with TLS) or \"off\""},
    {"state-dir", PATH(state_dir), "DIR", "directory for checkpoints (none: no checkpoints)"},
    {"restore", PATH(restore), "DIR", "start from this checkpoint directory"},
    {"weights", PATH(weights), "FILE",
     "start from these weights (safetensors, PyTorch nn.GRU/nn.LSTM names) unless a "
     "checkpoint in --state-dir is newer state"},
    {"checkpoint-interval-s", INT(checkpoint_interval_s, 0, INT_MAX), "N",
     "seconds between periodic checkpoints into --state-dir (0: only on SIGTERM)"},
    {"fresh-start", INT(fresh_start, 0, 1), "0|1",
     "1: start from --seed (or --weights) even when no automatic checkpoint in --state-dir "
     "loads, which otherwise stops the start (they are kept; 0 protects against a config slip)"},
    {"max-batch", INT(max_batch, 0, 1 << 20), "N",
     "most Step rows in one backend call (0: 4096, fewer where the model's rows would not fit "
     "--max-message-mb)"},
    {"max-delay-us", INT(max_delay_us, -1, 10000000), "N",
     "longest a Step waits for others to join its batch (-1: 0 where the step look-ahead is "
     "on, else 200)"},
    {"max-envs", INT(max_envs, 1, 1 << 26), "N", "most environments holding state at once"},
    {"env-idle-timeout-s", INT(env_idle_timeout_s, 0, INT_MAX), "N",
     "drop an env's state after this many idle seconds (0: never)"},
    {"trajectory-steps", INT(trajectory_steps, 0, 1 << 20), "N",
     "steps recorded per env for Forward over recorded trajectories (0: none)"},
    {"extras-size", INT(extras_size, 0, 1 << 20), "E", "width of the per-step extras vector"},
    {"max-policy-lag", INT(max_policy_lag, 0, INT_MAX), "N",
     "cursor windows (Forward recorded.cursor) skip steps computed by weights more than N "
     "versions older than the current ones (0: off)"},
    {"tape-ttl-s", INT(tape_ttl_s, 1, INT_MAX), "N", "seconds a Forward tape waits for Backward"},
    {"tape-memory-mb", INT(tape_memory_mb, 1, INT_MAX), "N", "memory all tapes may hold"},
    {"optimizer", ENUM(optimizer, optim_names), "adam|sgd", "ApplyGradients optimizer"},
    {"lr", FLT(lr, 1e-30, 1e30), "X", "learning rate"},
    {"max-grad-norm", FLT(max_grad_norm, 0, INFINITY), "X",
     "clip the gradient's total norm to X (0: no clipping)"},
    {"seed", U64(seed), "N", "seed of the initial weights"},
    {"tls-cert", PATH(tls_cert), "F", "TLS certificate chain (PEM)"},
    {"tls-key", PATH(tls_key), "F", "TLS private key (PEM)"},
    {"tls-client-ca", PATH(tls_client_ca), "F", "CA bundle (PEM) that client certificates need"},
    {"auth-token-file", PATH(auth_token_file), "F", "file holding the bearer token clients send"},
    {"max-message-mb", INT(max_message_mb, 1, 2047), "N", "largest gRPC message either way"},
    {"max-streams", INT(max_streams, 1, 1 << 20), "N",
     "rnnd.v1 calls (unary and StepStream) in progress at once; more get RESOURCE_EXHAUSTED"},
    {"max-reply-mb", INT(max_reply_mb, 1, 1 << 20), "N",
     "memory for replies their clients have not read yet (reserved before the work); a call "
     "whose reply does not fit gets RESOURCE_EXHAUSTED"},
    {"max-connections", INT(max_connections, 1, 1 << 20), "N",
     "gRPC connections open at once; more are closed as they arrive"},
    {"max-health-watches", INT(max_health_watches, 1, 1 << 20), "N",
     "grpc.health.v1 Watch streams open at once; more get RESOURCE_EXHAUSTED"},
    {"stream-idle-timeout-s", INT(stream_idle_timeout_s, 0, INT_MAX), "N",
     "end a StepStream that sent no message for N s (UNAVAILABLE), and cancel a call whose "
     "reply its client has not read for N s (0: never)"},
    {"max-shm-regions", INT(max_shm_regions, 0, 65536), "N",
     "shared-memory regions (RegisterRegion) that same-host clients may hold at once; 0 turns "
     "shared memory off"},
    {"max-socket-region-mb", INT(max_socket_region_mb, 1, 1 << 24), "N",
     "memory of the daemon's own that socket regions may hold together (touched as data "
     "arrives); a RegisterRegion beyond it gets RESOURCE_EXHAUSTED"},
    {"log-level", ENUM(log_level, level_names), "debug|info|warn|error", "log threshold"},
    {"log-format", ENUM(log_format, log_format_names), "text|json",
     "stderr lines as text, or one JSON object per line (ts, level, msg) for log collectors"},
    {"hz", INT(hz, 1, 1000), "N", "housekeeping timer frequency"},
    {"max-queue-rows", INT(max_queue_rows, 0, INT_MAX), "N",
     "Step rows queued before RESOURCE_EXHAUSTED (0: 64 * max-batch)"},
    {"drain-timeout-s", INT(drain_timeout_s, 0, 3600), "N",
     "on SIGTERM, cancel calls still running after N seconds"},
    {"grpc-threads", INT(grpc_threads, 0, 16), "N",
     "threads serving gRPC completions (0: one per 4 CPUs, 1 to 4)"},
    {"reply-threads", INT(reply_threads, -1, 8), "N",
     "threads per device that send a batch's Step replies (-1: a quarter of the device's share "
     "of the CPUs, none under 8; 0: the engine)"},
    {"inline-steps", INT(inline_steps, 0, 1), "0|1",
     "run a Step that finds the engine idle on the gRPC thread that received it (a device "
     "backend's only up to 64 rows)"},
    {"step-lookahead", INT(step_lookahead, -1, 1), "-1|0|1",
     "gather the next Step batch while one runs on the backend (-1: with backend memory of its "
     "own, as CUDA's)"},
    {"engine-spin-us", INT(engine_spin_us, 0, 1000000), "N",
     "after each batch the engine polls N us for the next step before sleeping, and its row "
     "workers watch as long for their next rows (0: sleep)"},
};
#define NOPTS (sizeof(opts) / sizeof(opts[0]))

void rnnd_config_defaults(struct rnnd_config *c) {
    memset(c, 0, sizeof(*c));
    c->model = (struct rnnd_model){
        .cell = RNND_CELL_GRU, .compute = RNND_COMPUTE_FP32, .I = 64, .H = 128, .L = 1};
    c->backend = RNND_BACKEND_AUTO;
    snprintf(c->listen, sizeof(c->listen), "127.0.0.1:50051");
    c->listen_unix_mode = 0600;
    snprintf(c->http, sizeof(c->http), "127.0.0.1:9090");
    snprintf(c->data_listen, sizeof(c->data_listen), "auto");
    c->checkpoint_interval_s = 0;
    c->max_batch = 0; // rnnd_config_parse sets it (max_batch_auto)
    c->max_delay_us = -1;
    c->max_envs = 65536;
    c->env_idle_timeout_s = 3600;
    c->trajectory_steps = 256;
    c->extras_size = 0;
    c->tape_ttl_s = 300;
    c->tape_memory_mb = 1024;
    c->optimizer = RNND_OPTIM_ADAM;
    c->lr = 1e-3f;
    c->max_grad_norm = 0.0f;
    c->seed = 0;
    c->max_message_mb = 128;
    c->max_streams = 1024;
    c->max_reply_mb = 1024;
    c->max_connections = 1024;
    c->max_health_watches = 256;
    c->stream_idle_timeout_s = 300;
    c->max_shm_regions = 64;
    c->max_socket_region_mb = 8192;
    c->log_level = RNND_LOG_INFO;
    c->log_format = RNND_LOG_FORMAT_TEXT;
    c->hz = 10;
    c->max_queue_rows = 0;
    c->drain_timeout_s = 10;
    c->engine_spin_us = 0;
    c->reply_threads = -1;
    c->inline_steps = 1;
    c->step_lookahead = -1;
    c->rank = 0;
    c->place_block = 1;
    c->world_size = 1;
    c->rendezvous_timeout_s = 600;
    c->comm_timeout_s = 60;
}

static int fail(char *err, size_t errlen, const char *fmt, ...) {
    if (errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return RNND_EINVAL;
}

// "hidden-size", "hidden_size", "--hidden-size" and "hiddensize" name the same option.
static void key_normalize(const char *key, char *out, size_t cap) {
    size_t n = 0;
    for (; *key && n + 1 < cap; key++) {
        if (*key == '-' || *key == '_')
            continue;
        out[n++] = (char)tolower((unsigned char)*key);
    }
    out[n] = '\0';
}

static const struct opt *opt_find(const char *key) {
    char want[64], have[64];
    key_normalize(key, want, sizeof(want));
    for (size_t i = 0; i < NOPTS; i++) {
        key_normalize(opts[i].name, have, sizeof(have));
        if (strcmp(want, have) == 0)
            return &opts[i];
    }
    return NULL;
}

// HOST:PORT with HOST a name, an IPv4 address or a bracketed IPv6 address; port 0..65535.
static bool addr_valid(const char *s) {
    const char *colon = strrchr(s, ':');
    if (colon == NULL || colon == s || colon[1] == '\0')
        return false;
    if (s[0] == '[' && colon[-1] != ']')
        return false;
    char *end;
    errno = 0;
    long port = strtol(colon + 1, &end, 10);
    if (errno || *end || port < 0 || port > 65535)
        return false;
    for (const char *p = colon + 1; *p; p++)
        if (!isdigit((unsigned char)*p))
            return false;
    for (const char *p = s; p < colon; p++)
        if (isspace((unsigned char)*p))
            return false;
    return true;
}

// Checks one --listen entry: HOST:PORT, or unix: and an absolute path that fits a socket address.
static int listen_entry_check(const char *a, size_t n, char *err, size_t errlen) {
    char one[RNND_CONFIG_ADDR_MAX];
    if (n == 0)
        return fail(err, errlen,
                    "--listen: an empty address in the list; separate addresses with "
                    "single commas");
    if (n >= sizeof(one))
        return fail(err, errlen, "--listen: address '%.40s...' is longer than %zu bytes", a,
                    sizeof(one) - 1);
    memcpy(one, a, n);
    one[n] = '\0';
    if (strncmp(one, "unix:", 5) == 0) {
        // sockaddr_un.sun_path holds 108 bytes with the NUL.
        if (one[5] != '/' || n - 5 > 107)
            return fail(err, errlen,
                        "--listen: '%s' is not unix: followed by an absolute path of at most 107 "
                        "bytes (e.g. unix:/run/rnnd/rnnd.sock)",
                        one);
        return 0;
    }
    if (!addr_valid(one))
        return fail(err, errlen,
                    "--listen: '%s' is neither HOST:PORT (e.g. 127.0.0.1:50051) nor unix:PATH",
                    one);
    return 0;
}

int rnnd_config_listen(const char *list, char out[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX]) {
    int n = 0;
    for (const char *p = list; *p && n < RNND_CONFIG_LISTEN_MAX;) {
        size_t k = strcspn(p, ",");
        snprintf(out[n++], RNND_CONFIG_ADDR_MAX, "%.*s", (int)k, p);
        p += k + (p[k] == ',');
    }
    return n;
}

int rnnd_config_set(struct rnnd_config *c, const char *key, const char *value, char *err,
                    size_t errlen) {
    const struct opt *o = opt_find(key);
    if (o == NULL)
        return fail(err, errlen, "unknown option '%s' (rnnd --help lists them)", key);
    char *field = (char *)c + o->offset;
    char *end;
    switch (o->type) {
        case OPT_INT: {
            errno = 0;
            long long v = strtoll(value, &end, 10);
            if (errno || end == value || *end || v < o->min || v > o->max)
                return fail(err, errlen, "--%s: '%s' is not an integer in [%lld, %lld]", o->name,
                            value, o->min, o->max);
            *(int *)field = (int)v;
            return 0;
        }
        case OPT_U64: {
            errno = 0;
            if (value[0] == '-')
                return fail(err, errlen, "--%s: '%s' is not a non-negative integer", o->name,
                            value);
            unsigned long long v = strtoull(value, &end, 0);
            if (errno || end == value || *end)
                return fail(err, errlen, "--%s: '%s' is not a non-negative integer", o->name,
                            value);
            *(uint64_t *)field = (uint64_t)v;
            return 0;
        }
        case OPT_FLOAT: {
            errno = 0;
            double v = strtod(value, &end);
            if (errno || end == value || *end || isnan(v) || v < o->fmin || v > o->fmax ||
                (isinf(v) && !isinf(o->fmax)))
                return fail(err, errlen, "--%s: '%s' is not a number in [%g, %g]", o->name, value,
                            o->fmin, o->fmax);
            *(float *)field = (float)v;
            return 0;
        }
        case OPT_PATH:
            if (strlen(value) >= o->size)
                return fail(err, errlen, "--%s: path longer than %zu bytes", o->name, o->size - 1);
            snprintf(field, o->size, "%s", value);
            return 0;
        case OPT_ADDR:
            if (strlen(value) >= o->size)
                return fail(err, errlen, "--%s: address longer than %zu bytes", o->name,
                            o->size - 1);
            // --http takes "off", --data-listen "off" and "auto".
            bool data = strcmp(o->name, "data-listen") == 0;
            if (!(strcmp(value, "off") == 0 && (data || strcmp(o->name, "http") == 0)) &&
                !(strcmp(value, "auto") == 0 && data) && !addr_valid(value))
                return fail(err, errlen, "--%s: '%s' is not HOST:PORT (e.g. 127.0.0.1:50051)",
                            o->name, value);
            snprintf(field, o->size, "%s", value);
            return 0;
        case OPT_LISTEN: {
            if (strlen(value) >= o->size)
                return fail(err, errlen, "--%s: list longer than %zu bytes", o->name, o->size - 1);
            int n = 0;
            for (const char *p = value;; n++) {
                size_t k = strcspn(p, ",");
                if (n == RNND_CONFIG_LISTEN_MAX)
                    return fail(err, errlen, "--%s: more than %d addresses", o->name,
                                RNND_CONFIG_LISTEN_MAX);
                int rc = listen_entry_check(p, k, err, errlen);
                if (rc)
                    return rc;
                if (p[k] == '\0')
                    break;
                p += k + 1;
            }
            snprintf(field, o->size, "%s", value);
            return 0;
        }
        case OPT_MODE: {
            errno = 0;
            long v = strtol(value, &end, 8);
            if (errno || end == value || *end || v < o->min || v > o->max)
                return fail(err, errlen, "--%s: '%s' is not an octal file mode in 0000..0777",
                            o->name, value);
            *(int *)field = (int)v;
            return 0;
        }
        case OPT_DEVICES: {
            // Checked here, parsed again by rnnd_config_devices.
            if (strlen(value) >= o->size)
                return fail(err, errlen, "--%s: list longer than %zu bytes", o->name, o->size - 1);
            int seen[RNND_MAX_DEVICES], n = 0;
            const char *p = value;
            while (*p) {
                errno = 0;
                long v = strtol(p, &end, 10);
                if (end == p || errno || v < 0 || v > 1023 || (*end != ',' && *end != '\0'))
                    return fail(err, errlen,
                                "--%s: '%s' is not a comma-separated list of device indices "
                                "(e.g. 0,1)",
                                o->name, value);
                for (int k = 0; k < n; k++)
                    if (seen[k] == v)
                        return fail(err, errlen, "--%s: device %ld is listed twice", o->name, v);
                if (n == RNND_MAX_DEVICES)
                    return fail(err, errlen, "--%s: more than %d devices", o->name,
                                RNND_MAX_DEVICES);
                seen[n++] = (int)v;
                p = *end ? end + 1 : end;
                if (*end && *p == '\0')
                    return fail(err, errlen, "--%s: '%s' ends with a comma", o->name, value);
            }
            snprintf(field, o->size, "%s", value);
            return 0;
        }
        case OPT_RANK: {
            if (strcmp(value, "auto") == 0) {
                *(int *)field = RNND_RANK_AUTO;
                return 0;
            }
            errno = 0;
            long long v = strtoll(value, &end, 10);
            if (errno || end == value || *end || v < o->min || v > o->max)
                return fail(err, errlen,
                            "--%s: '%s' is neither auto nor an integer in [%lld, %lld]", o->name,
                            value, o->min, o->max);
            *(int *)field = (int)v;
            return 0;
        }
        case OPT_WIDTHS: {
            struct rnnd_policy *p = (struct rnnd_policy *)field;
            int n = 0, w[RNND_MAX_ENCODER_LAYERS];
            for (const char *q = value; *q;) {
                errno = 0;
                long v = strtol(q, &end, 10);
                if (end == q || errno || v < 1 || v > RNND_MAX_WIDTH ||
                    (*end != ',' && *end != '\0') || (*end == ',' && end[1] == '\0'))
                    return fail(err, errlen,
                                "--%s: '%s' is not a comma-separated list of widths in [1, %d] "
                                "(e.g. 64,64; empty for no encoder)",
                                o->name, value, RNND_MAX_WIDTH);
                if (n == RNND_MAX_ENCODER_LAYERS)
                    return fail(err, errlen, "--%s: '%s' has more than %d encoder layers", o->name,
                                value, RNND_MAX_ENCODER_LAYERS);
                w[n++] = (int)v;
                q = *end ? end + 1 : end;
            }
            p->enc_layers = n;
            memset(p->enc_width, 0, sizeof(p->enc_width));
            memcpy(p->enc_width, w, (size_t)n * sizeof(int));
            return 0;
        }
        case OPT_BOOL:
            if (strcmp(value, "0") != 0 && strcmp(value, "1") != 0)
                return fail(err, errlen, "--%s: '%s' is not 0 or 1", o->name, value);
            *(bool *)field = value[0] == '1';
            return 0;
        case OPT_ENUM:
            for (int i = 0; o->names[i]; i++) {
                if (strcmp(value, o->names[i]) == 0) {
                    *(int *)field = i;
                    return 0;
                }
            }
            return fail(err, errlen, "--%s: '%s' is not one of %s", o->name, value, o->arg);
    }
    return fail(err, errlen, "--%s: bad option type", o->name);
}

static char *trim(char *s) {
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

int rnnd_config_load_file(struct rnnd_config *c, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        if (errlen)
            snprintf(err, errlen, "--config: cannot open '%s': %s", path, strerror(errno));
        return RNND_EIO;
    }
    char line[4096];
    int lineno = 0;
    int rc = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        if (strchr(line, '\n') == NULL && !feof(f)) {
            rc = fail(err, errlen, "%s:%d: line too long", path, lineno);
            break;
        }
        char *s = trim(line);
        if (*s == '\0' || *s == '#')
            continue;
        char *key = s;
        while (*s && !isspace((unsigned char)*s))
            s++;
        if (*s)
            *s++ = '\0';
        char *value = trim(s);
        // Allow "key value # comment" and quoted values ("key \"\"" for an empty string).
        char *hash = strstr(value, " #");
        if (hash)
            *hash = '\0';
        value = trim(value);
        size_t vn = strlen(value);
        if (vn >= 2 && value[0] == '"' && value[vn - 1] == '"') {
            value[vn - 1] = '\0';
            value++;
        }
        if (strcmp(key, "config") == 0) {
            rc = fail(err, errlen, "%s:%d: 'config' cannot appear in a config file", path, lineno);
            break;
        }
        char msg[512];
        if (rnnd_config_set(c, key, value, msg, sizeof(msg)) != 0) {
            rc = fail(err, errlen, "%s:%d: %s", path, lineno, msg);
            break;
        }
    }
    if (rc == 0 && ferror(f))
        rc = fail(err, errlen, "--config: error reading '%s'", path);
    fclose(f);
    return rc;
}

// Each env's reply and request rows must fit into one message with room to spare.
// A policy adds its logits or mean, action, log-prob, value and the reward sent back.
static size_t row_bytes(const struct rnnd_config *c) {
    const struct rnnd_policy *p = &c->model.policy;
    size_t pol = rnnd_model_has_policy(&c->model) ? (size_t)p->K + 2 * (size_t)p->A + 4 : 0;
    return ((size_t)c->model.I + (size_t)c->extras_size +
            2 * (size_t)c->model.L * (size_t)c->model.H + (size_t)c->model.H + pol) *
           sizeof(float);
}

// --max-batch 0: 4096 rows, or as many as fit --max-message-mb. Batches of one 1024-row request
// each left the engine's per-batch work (a kernel launch and its copies, the update) to every
// request: 32 streams x 1024 envs ran at 4.1-4.5M env-steps/s with 1024 rows a batch and at
// 5.5M with 4096 (H200 host, fp32, docs/benchmarks.md).
static int max_batch_auto(const struct rnnd_config *c) {
    size_t fit = ((size_t)c->max_message_mb << 20) / row_bytes(c);
    return fit >= 4096 ? 4096 : fit > 0 ? (int)fit : 1;
}

int rnnd_config_check(const struct rnnd_config *c, char *err, size_t errlen) {
    char why[256];
    if (rnnd_model_validate(&c->model, why, sizeof(why)) != 0)
        return fail(err, errlen, "the model: %s", why);
    if (c->tls_key[0] && !c->tls_cert[0])
        return fail(err, errlen, "--tls-key needs --tls-cert");
    if (c->tls_cert[0] && !c->tls_key[0])
        return fail(err, errlen, "--tls-cert needs --tls-key");
    if (c->tls_client_ca[0] && !c->tls_cert[0])
        return fail(err, errlen, "--tls-client-ca needs --tls-cert and --tls-key");
    bool data_addr = strcmp(c->data_listen, "auto") != 0 && strcmp(c->data_listen, "off") != 0;
    if (data_addr && c->max_shm_regions == 0)
        return fail(err, errlen,
                    "--data-listen %s needs --max-shm-regions above 0 (socket regions count "
                    "among them)",
                    c->data_listen);
    if (c->tls_cert[0] && data_addr)
        return fail(err, errlen,
                    "--data-listen %s with --tls-cert: data connections are plaintext; pass "
                    "--data-listen off (or auto) so that tensors cross inside TLS",
                    c->data_listen);
    if (c->weights[0] && c->restore[0])
        return fail(err, errlen,
                    "--weights and --restore both name starting weights; pass one of them");
    if (c->world_size > 1 && c->rendezvous[0] == '\0')
        return fail(err, errlen,
                    "--world-size %d needs --rendezvous HOST:PORT (where rank 0 listens)",
                    c->world_size);
    if (c->world_size == 1 && c->rendezvous[0])
        return fail(err, errlen, "--rendezvous needs --world-size of 2 or more");
    if (c->world_size == 1 && c->rank > 0)
        return fail(err, errlen, "--rank %d needs --world-size of at least %d", c->rank,
                    c->rank + 1);
    if (c->rank >= c->world_size)
        return fail(err, errlen, "--rank %d is not below --world-size %d", c->rank, c->world_size);
    char addrs[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX];
    int n = rnnd_config_listen(c->listen, addrs);
    for (int i = 0; i < n; i++) {
        if (strcmp(addrs[i], c->http) == 0 && strstr(addrs[i], ":0") == NULL)
            return fail(err, errlen, "--listen and --http are both %s", addrs[i]);
        for (int k = 0; k < i; k++)
            if (strcmp(addrs[i], addrs[k]) == 0 && strstr(addrs[i], ":0") == NULL)
                return fail(err, errlen, "--listen names %s twice", addrs[i]);
    }
    if ((size_t)c->max_batch * row_bytes(c) > (size_t)c->max_message_mb << 20)
        return fail(err, errlen,
                    "--max-batch %d rows of this model do not fit into --max-message-mb %d; "
                    "lower the first or raise the second",
                    c->max_batch, c->max_message_mb);
    if (c->max_reply_mb < c->max_message_mb)
        return fail(err, errlen,
                    "--max-reply-mb %d cannot hold one reply of --max-message-mb %d; raise the "
                    "first or lower the second",
                    c->max_reply_mb, c->max_message_mb);
    return 0;
}

static bool listen_local(const char *listen);

void rnnd_config_data_listen(const struct rnnd_config *c, char out[RNND_CONFIG_ADDR_MAX]) {
    out[0] = '\0';
    if (strcmp(c->data_listen, "off") == 0)
        return;
    if (strcmp(c->data_listen, "auto") != 0) {
        snprintf(out, RNND_CONFIG_ADDR_MAX, "%s", c->data_listen);
        return;
    }
    if (c->tls_cert[0] || c->max_shm_regions == 0)
        return;
    // The first address other hosts reach (socket regions are for them), else the first TCP one.
    char addrs[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX];
    int n = rnnd_config_listen(c->listen, addrs), pick = -1;
    for (int i = 0; i < n; i++) {
        if (strncmp(addrs[i], "unix:", 5) == 0 || strrchr(addrs[i], ':') == NULL)
            continue;
        if (pick < 0 || (listen_local(addrs[pick]) && !listen_local(addrs[i])))
            pick = i;
    }
    if (pick >= 0)
        snprintf(out, RNND_CONFIG_ADDR_MAX, "%.*s:0",
                 (int)(strrchr(addrs[pick], ':') - addrs[pick]), addrs[pick]);
}

// True for a --listen address that only this host can reach.
static bool listen_local(const char *listen) {
    if (strncmp(listen, "unix:", 5) == 0)
        return true;
    char host[RNND_CONFIG_ADDR_MAX];
    snprintf(host, sizeof(host), "%.*s", (int)sizeof(host) - 1, listen);
    char *colon = strrchr(host, ':');
    if (colon)
        *colon = '\0';
    const char *h = host;
    size_t n = strlen(h);
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
        host[n - 1] = '\0';
        h++;
    }
    return strncmp(h, "127.", 4) == 0 || strcmp(h, "localhost") == 0 || strcmp(h, "::1") == 0 ||
           strcmp(h, "0:0:0:0:0:0:0:1") == 0;
}

const char *rnnd_config_exposure(const struct rnnd_config *c) {
    char addrs[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX];
    int n = rnnd_config_listen(c->listen, addrs);
    bool local = true;
    for (int i = 0; i < n; i++)
        local = local && listen_local(addrs[i]);
    if (local)
        return NULL;
    bool tls = c->tls_cert[0] != '\0', token = c->auth_token_file[0] != '\0';
    bool client_certs = tls && c->tls_client_ca[0] != '\0';
    if (!tls && !token)
        return "is reachable from other hosts with neither TLS nor a token: anyone who can "
               "connect can step envs and read or replace the model; set --auth-token-file "
               "and --tls-cert/--tls-key, or listen on 127.0.0.1";
    if (!tls)
        return "is reachable from other hosts without TLS: the bearer token and the model cross "
               "the network in clear text; set --tls-cert/--tls-key";
    if (!token && !client_certs)
        return "is reachable from other hosts with TLS but no client authentication: anyone who "
               "can connect can use it; set --auth-token-file or --tls-client-ca";
    return NULL;
}

void rnnd_config_usage(FILE *f) {
    struct rnnd_config d;
    rnnd_config_defaults(&d);
    fprintf(f, "usage: rnnd [--config FILE] [--FLAG VALUE | --FLAG=VALUE]...\n\n"
               "rnnd serves a recurrent RL policy (GRU/LSTM) over gRPC (rnnd.v1.Rnn), keeping\n"
               "per-environment state. Every flag is also a config-file key without the dashes\n"
               "(\"hidden-size 128\"); flags win over the file.\n\n");
    for (size_t i = 0; i < NOPTS; i++) {
        const struct opt *o = &opts[i];
        char def[96] = "";
        const char *field = (const char *)&d + o->offset;
        switch (o->type) {
            case OPT_INT:
                snprintf(def, sizeof(def), "%d", *(const int *)field);
                break;
            case OPT_U64:
                snprintf(def, sizeof(def), "%llu", (unsigned long long)*(const uint64_t *)field);
                break;
            case OPT_FLOAT:
                snprintf(def, sizeof(def), "%g", (double)*(const float *)field);
                break;
            case OPT_PATH:
            case OPT_ADDR:
            case OPT_LISTEN:
            case OPT_DEVICES:
                snprintf(def, sizeof(def), "%s", *field ? field : "none");
                break;
            case OPT_MODE:
                snprintf(def, sizeof(def), "%04o", (unsigned)*(const int *)field);
                break;
            case OPT_RANK:
                snprintf(def, sizeof(def), "%d", *(const int *)field);
                break;
            case OPT_ENUM:
                snprintf(def, sizeof(def), "%s", o->names[*(const int *)field]);
                break;
            case OPT_WIDTHS:
                snprintf(def, sizeof(def), "none");
                break;
            case OPT_BOOL:
                snprintf(def, sizeof(def), "%d", *(const bool *)field);
                break;
        }
        char head[96];
        snprintf(head, sizeof(head), "--%s %s", o->name, o->arg);
        fprintf(f, "  %-40s %s (default %s)\n", head, o->help, def);
    }
    fprintf(f, "  %-40s %s\n  %-40s %s\n", "--help", "print this text and exit", "--version",
            "print the version and exit");
}

int rnnd_config_queue_rows(const struct rnnd_config *c) {
    if (c->max_queue_rows > 0)
        return c->max_queue_rows;
    long long v = 64LL * c->max_batch;
    return v > INT_MAX ? INT_MAX : (int)v;
}

int rnnd_config_devices(const struct rnnd_config *c, int out[RNND_MAX_DEVICES]) {
    if (c->devices[0] == '\0') {
        out[0] = c->device;
        return 1;
    }
    int n = 0;
    for (const char *p = c->devices; *p && n < RNND_MAX_DEVICES;) {
        char *end;
        out[n++] = (int)strtol(p, &end, 10);
        p = *end ? end + 1 : end;
    }
    return n;
}

int rnnd_config_rank(const struct rnnd_config *c, int *rank, char *err, size_t errlen) {
    if (c->rank != RNND_RANK_AUTO) {
        *rank = c->rank;
        return 0;
    }
    const char *env = getenv("RNND_RANK");
    char host[256] = "";
    const char *from = env && env[0] ? "$RNND_RANK" : "the host name";
    const char *text = env && env[0] ? env : host;
    if (text == host && gethostname(host, sizeof(host) - 1) != 0)
        return fail(err, errlen, "--rank auto: cannot read the host name: %s; set --rank",
                    strerror(errno));
    const char *digits = text == host ? strrchr(host, '-') : NULL;
    digits = digits ? digits + 1 : text;
    char *end;
    errno = 0;
    long v = strtol(digits, &end, 10);
    if (*digits == '\0' || !isdigit((unsigned char)*digits) || *end || errno || v < 0 ||
        v >= c->world_size)
        return fail(err, errlen,
                    "--rank auto: %s is '%s', which does not give a rank below --world-size %d "
                    "(a StatefulSet's pods are NAME-0, NAME-1, ...); set --rank",
                    from, text, c->world_size);
    *rank = (int)v;
    return 0;
}

const char *rnnd_config_cell_name(enum rnnd_cell cell) {
    return (unsigned)cell < 2 ? cell_names[cell] : "?";
}

const char *rnnd_config_compute_name(enum rnnd_compute compute) {
    return (unsigned)compute < 3 ? compute_names[compute] : "?";
}

const char *rnnd_config_act_name(enum rnnd_act act) {
    return (unsigned)act < 3 ? act_names[act] : "?";
}

#ifndef RNND_VERSION
#define RNND_VERSION "0.1.0"
#endif

enum rnnd_config_result rnnd_config_parse(struct rnnd_config *c, int argc, char **argv, FILE *out,
                                          char *err, size_t errlen) {
    // Pass 1: --help, --version and --config, so the file is read before the flags that win.
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            rnnd_config_usage(out);
            return RNND_CONFIG_EXIT;
        }
        if (strcmp(a, "--version") == 0) {
            fprintf(out, "rnnd %s\n", RNND_VERSION);
            return RNND_CONFIG_EXIT;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = NULL;
        if (strcmp(a, "--config") == 0) {
            if (i + 1 >= argc) {
                fail(err, errlen, "--config needs a value (FILE)");
                return RNND_CONFIG_ERROR;
            }
            v = argv[i + 1];
        } else if (strncmp(a, "--config=", 9) == 0) {
            v = a + 9;
        }
        if (v) {
            if (rnnd_config_set(c, "config", v, err, errlen) != 0 ||
                rnnd_config_load_file(c, v, err, errlen) != 0)
                return RNND_CONFIG_ERROR;
        }
    }
    // Pass 2: every flag, in order. A list flag given again adds to what the command line
    // gave before (and the first one replaces the file's list).
    bool listed[NOPTS] = {false};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            fail(err, errlen, "unexpected argument '%s' (flags are --name value)", a);
            return RNND_CONFIG_ERROR;
        }
        char key[64];
        const char *eq = strchr(a, '=');
        const char *value;
        size_t klen = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (klen >= sizeof(key)) {
            fail(err, errlen, "unknown flag '%s' (rnnd --help lists them)", a);
            return RNND_CONFIG_ERROR;
        }
        memcpy(key, a + 2, klen);
        key[klen] = '\0';
        const struct opt *o = opt_find(key);
        if (o == NULL || strcmp(o->name, key) != 0) {
            fail(err, errlen, "unknown flag '--%s' (rnnd --help lists them)", key);
            return RNND_CONFIG_ERROR;
        }
        if (eq) {
            value = eq + 1;
        } else {
            if (i + 1 >= argc) {
                fail(err, errlen, "--%s needs a value (%s)", key, o->arg);
                return RNND_CONFIG_ERROR;
            }
            value = argv[++i];
        }
        if (strcmp(key, "config") == 0)
            continue; // read in pass 1
        size_t at = (size_t)(o - opts);
        if (o->type == OPT_LISTEN && listed[at]) {
            const char *have = (const char *)c + o->offset;
            char joined[sizeof(c->listen) + 1];
            if ((size_t)snprintf(joined, sizeof(joined), "%s,%s", have, value) >= sizeof(joined)) {
                fail(err, errlen, "--%s: list longer than %zu bytes", o->name, o->size - 1);
                return RNND_CONFIG_ERROR;
            }
            if (rnnd_config_set(c, key, joined, err, errlen) != 0)
                return RNND_CONFIG_ERROR;
            continue;
        }
        listed[at] = true;
        if (rnnd_config_set(c, key, value, err, errlen) != 0)
            return RNND_CONFIG_ERROR;
    }
    if (c->max_batch == 0)
        c->max_batch = max_batch_auto(c);
    if (rnnd_config_check(c, err, errlen) != 0)
        return RNND_CONFIG_ERROR;
    return RNND_CONFIG_RUN;
}
