/*
 * metrics.c: bucket layouts, recording and the Prometheus text renderer (see metrics.h).
 */
#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rnnd_kernels.h"

struct rnnd_metrics rnnd_metrics;

static const char *const method_names[RNND_METHOD_COUNT] = {
    "GetModelInfo",
    "Step",
    "StepStream",
    "EndEpisodes",
    "Forward",
    "Backward",
    "ApplyGradients",
    "GetWeights",
    "SetWeights",
    "SaveCheckpoint",
    "RegisterRegion",
    "ReleaseRegion",
    "grpc.health.v1.Health/Check",
    "grpc.health.v1.Health/Watch",
    "unknown",
};

static const char *const code_names[RNND_GRPC_CODES] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

static const char *const op_names[RNND_OP_COUNT] = {"step", "forward", "backward", "optim"};
static const char *const evict_names[RNND_EVICT_COUNT] = {"idle", "released"};
static const char *const phase_names[RNND_PHASE_COUNT] = {"gather", "update", "reply"};
static const char *const http_drop_names[RNND_HTTP_DROP_COUNT] = {"evicted", "header_timeout",
                                                                  "accept_failed"};
static const char *const limit_names[RNND_LIMIT_COUNT] = {
    "envs",    "step_queue_rows", "tape_bytes",    "message_bytes",
    "streams", "reply_bytes",     "connections",   "health_watches", "shm_regions"};

const char *rnnd_method_name(enum rnnd_method m) {
    return (unsigned)m < RNND_METHOD_COUNT ? method_names[m] : "unknown";
}

uint64_t rnnd_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void hist_layout(struct rnnd_histogram *h, const uint64_t *bounds, int n) {
    memset(h, 0, sizeof(*h));
    h->n = n;
    memcpy(h->bounds, bounds, (size_t)n * sizeof(uint64_t));
}

void rnnd_metrics_init(void) {
    memset(&rnnd_metrics, 0, sizeof(rnnd_metrics));
    // Durations: 25 us .. 10 s, in ns.
    static const uint64_t dur[] = {25000,         50000,         100000,    200000,    400000,
                                   800000,        1600000,       3200000,   6400000,   12800000,
                                   25600000,      51200000,      102400000, 409600000, 1000000000,
                                   2500000000ull, 10000000000ull};
    static const uint64_t delay[] = {1000,   5000,   10000,   25000,   50000,    100000,   200000,
                                     400000, 800000, 1600000, 3200000, 10000000, 100000000};
    static const uint64_t rows[] = {1,   2,   4,    8,    16,   32,   64,    128,
                                    256, 512, 1024, 2048, 4096, 8192, 16384, 65536};
    for (int m = 0; m < RNND_METHOD_COUNT; m++)
        hist_layout(&rnnd_metrics.duration[m], dur, (int)(sizeof(dur) / sizeof(dur[0])));
    hist_layout(&rnnd_metrics.queue_delay, delay, (int)(sizeof(delay) / sizeof(delay[0])));
    hist_layout(&rnnd_metrics.batch_rows, rows, (int)(sizeof(rows) / sizeof(rows[0])));
    // Request sizes: 256 B .. 1 GiB by powers of 4, against --max-message-mb.
    uint64_t sizes[12];
    for (int i = 0; i < 12; i++)
        sizes[i] = 256ull << (2 * i);
    hist_layout(&rnnd_metrics.request_size, sizes, 12);
}

void rnnd_histogram_observe(struct rnnd_histogram *h, uint64_t v) {
    int i = 0;
    while (i < h->n && v > h->bounds[i])
        i++;
    atomic_fetch_add_explicit(&h->counts[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum, v, memory_order_relaxed);
}

void rnnd_metrics_request(enum rnnd_method m, int code, uint64_t duration_ns) {
    if ((unsigned)m >= RNND_METHOD_COUNT)
        m = RNND_METHOD_UNKNOWN;
    if (code < 0 || code >= RNND_GRPC_CODES)
        code = 2; // UNKNOWN
    atomic_fetch_add_explicit(&rnnd_metrics.requests[m][code], 1, memory_order_relaxed);
    rnnd_histogram_observe(&rnnd_metrics.duration[m], duration_ns);
}

void rnnd_metrics_limit_hit(enum rnnd_limit r) {
    atomic_fetch_add_explicit(&rnnd_metrics.limit_rejections[r], 1, memory_order_relaxed);
}

void rnnd_metrics_kernel(enum rnnd_backend_op op, uint64_t ns) {
    atomic_fetch_add_explicit(&rnnd_metrics.kernel_ns[op], ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&rnnd_metrics.kernel_calls[op], 1, memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Rendering

struct buf {
    char *p;
    size_t len, cap;
    int err;
};

static void put(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct buf *b, const char *fmt, ...) {
    if (b->err)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->err = RNND_EINVAL;
            return;
        }
        if (b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->err = RNND_ENOMEM;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

static uint64_t ld(_Atomic uint64_t *v) {
    return atomic_load_explicit(v, memory_order_relaxed);
}

static int64_t lds(_Atomic int64_t *v) {
    return atomic_load_explicit(v, memory_order_relaxed);
}

// scale: divide base units by this for the printed value (1e9 for ns -> s, 1 for counts).
static void put_hist(struct buf *b, const char *name, const char *labels, struct rnnd_histogram *h,
                     double scale) {
    uint64_t cum = 0;
    const char *sep = labels[0] ? "," : "";
    for (int i = 0; i <= h->n; i++) {
        cum += ld(&h->counts[i]);
        if (i < h->n)
            put(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep,
                (double)h->bounds[i] / scale, (unsigned long long)cum);
        else
            put(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, (unsigned long long)cum);
    }
    if (labels[0]) {
        put(b, "%s_sum{%s} %.9g\n", name, labels, (double)ld(&h->sum) / scale);
        put(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)cum);
    } else {
        put(b, "%s_sum %.9g\n", name, (double)ld(&h->sum) / scale);
        put(b, "%s_count %llu\n", name, (unsigned long long)cum);
    }
}

int rnnd_metrics_render(char **out, size_t *len) {
    struct buf b = {malloc(16384), 0, 16384, 0};
    if (b.p == NULL)
        return RNND_ENOMEM;
    struct rnnd_metrics *m = &rnnd_metrics;

    put(&b, "# HELP rnnd_up 1 while the process runs.\n# TYPE rnnd_up gauge\nrnnd_up 1\n");
    put(&b,
        "# HELP rnnd_ready 1 while the daemon serves (not starting, not draining).\n"
        "# TYPE rnnd_ready gauge\nrnnd_ready %d\n",
        atomic_load(&m->ready));

    put(&b, "# HELP rnnd_requests_total RPCs finished, by method and gRPC status code.\n"
            "# TYPE rnnd_requests_total counter\n");
    for (int i = 0; i < RNND_METHOD_COUNT; i++)
        for (int c = 0; c < RNND_GRPC_CODES; c++) {
            uint64_t v = ld(&m->requests[i][c]);
            if (v || (c == 0 && i != RNND_METHOD_UNKNOWN))
                put(&b, "rnnd_requests_total{method=\"%s\",code=\"%s\"} %llu\n", method_names[i],
                    code_names[c], (unsigned long long)v);
        }

    put(&b, "# HELP rnnd_request_duration_seconds Time from a call's arrival to its status.\n"
            "# TYPE rnnd_request_duration_seconds histogram\n");
    for (int i = 0; i < RNND_METHOD_COUNT; i++) {
        if (i == RNND_METHOD_UNKNOWN || i == RNND_METHOD_HEALTH_WATCH)
            continue;
        char labels[96];
        snprintf(labels, sizeof(labels), "method=\"%s\"", method_names[i]);
        put_hist(&b, "rnnd_request_duration_seconds", labels, &m->duration[i], 1e9);
    }

    put(&b, "# HELP rnnd_step_queue_delay_seconds Time a Step waits from arrival to its batch.\n"
            "# TYPE rnnd_step_queue_delay_seconds histogram\n");
    put_hist(&b, "rnnd_step_queue_delay_seconds", "", &m->queue_delay, 1e9);

    put(&b, "# HELP rnnd_batch_rows Rows (env steps) per backend step call.\n"
            "# TYPE rnnd_batch_rows histogram\n");
    put_hist(&b, "rnnd_batch_rows", "", &m->batch_rows, 1.0);

    put(&b,
        "# HELP rnnd_env_steps_total Env steps computed.\n# TYPE rnnd_env_steps_total counter\n"
        "rnnd_env_steps_total %llu\n",
        (unsigned long long)ld(&m->env_steps));
    put(&b,
        "# HELP rnnd_step_queue_rows Step rows waiting for the engine.\n"
        "# TYPE rnnd_step_queue_rows gauge\nrnnd_step_queue_rows %lld\n",
        (long long)lds(&m->queue_rows));
    put(&b,
        "# HELP rnnd_envs_active Environments holding state.\n"
        "# TYPE rnnd_envs_active gauge\nrnnd_envs_active %lld\n",
        (long long)lds(&m->envs_active));
    put(&b, "# HELP rnnd_env_evictions_total Env states dropped, by reason.\n"
            "# TYPE rnnd_env_evictions_total counter\n");
    for (int i = 0; i < RNND_EVICT_COUNT; i++)
        put(&b, "rnnd_env_evictions_total{reason=\"%s\"} %llu\n", evict_names[i],
            (unsigned long long)ld(&m->evictions[i]));
    put(&b,
        "# HELP rnnd_model_version Version of the served weights.\n"
        "# TYPE rnnd_model_version gauge\nrnnd_model_version %llu\n",
        (unsigned long long)ld(&m->model_version));
    put(&b,
        "# HELP rnnd_tapes Forward tapes kept for Backward.\n# TYPE rnnd_tapes gauge\n"
        "rnnd_tapes %lld\n",
        (long long)lds(&m->tapes));
    put(&b,
        "# HELP rnnd_tape_bytes Memory held by tapes.\n# TYPE rnnd_tape_bytes gauge\n"
        "rnnd_tape_bytes %lld\n",
        (long long)lds(&m->tape_bytes));
    put(&b, "# HELP rnnd_backend_kernel_seconds_total Time spent in backend ops, by op.\n"
            "# TYPE rnnd_backend_kernel_seconds_total counter\n");
    for (int i = 0; i < RNND_OP_COUNT; i++)
        put(&b, "rnnd_backend_kernel_seconds_total{op=\"%s\"} %.9g\n", op_names[i],
            (double)ld(&m->kernel_ns[i]) / 1e9);
    put(&b, "# HELP rnnd_engine_seconds_total Engine time around Step batches, by phase.\n"
            "# TYPE rnnd_engine_seconds_total counter\n");
    for (int i = 0; i < RNND_PHASE_COUNT; i++)
        put(&b, "rnnd_engine_seconds_total{phase=\"%s\"} %.9g\n", phase_names[i],
            (double)ld(&m->engine_ns[i]) / 1e9);
    put(&b, "# HELP rnnd_backend_calls_total Backend op calls, by op.\n"
            "# TYPE rnnd_backend_calls_total counter\n");
    for (int i = 0; i < RNND_OP_COUNT; i++)
        put(&b, "rnnd_backend_calls_total{op=\"%s\"} %llu\n", op_names[i],
            (unsigned long long)ld(&m->kernel_calls[i]));
    put(&b,
        "# HELP rnnd_checkpoints_total Checkpoints written, by result.\n"
        "# TYPE rnnd_checkpoints_total counter\n"
        "rnnd_checkpoints_total{result=\"ok\"} %llu\n"
        "rnnd_checkpoints_total{result=\"failed\"} %llu\n",
        (unsigned long long)ld(&m->checkpoints_ok), (unsigned long long)ld(&m->checkpoints_failed));
    put(&b, "# HELP rnnd_limit The configured bound of each resource (rows, bytes, envs, calls).\n"
            "# TYPE rnnd_limit gauge\n");
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        put(&b, "rnnd_limit{resource=\"%s\"} %lld\n", limit_names[i], (long long)lds(&m->limit[i]));
    put(&b, "# HELP rnnd_limit_rejections_total Requests refused with RESOURCE_EXHAUSTED because "
            "a bound was reached, by resource.\n"
            "# TYPE rnnd_limit_rejections_total counter\n");
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        put(&b, "rnnd_limit_rejections_total{resource=\"%s\"} %llu\n", limit_names[i],
            (unsigned long long)ld(&m->limit_rejections[i]));
    put(&b,
        "# HELP rnnd_streams_active rnnd.v1 calls in progress (unary calls and StepStreams).\n"
        "# TYPE rnnd_streams_active gauge\nrnnd_streams_active %lld\n",
        (long long)lds(&m->streams_active));
    put(&b, "# HELP rnnd_request_message_bytes Size of each request message received.\n"
            "# TYPE rnnd_request_message_bytes histogram\n");
    put_hist(&b, "rnnd_request_message_bytes", "", &m->request_size, 1.0);
    put(&b,
        "# HELP rnnd_http_connections HTTP connections open (/healthz, /readyz, /metrics).\n"
        "# TYPE rnnd_http_connections gauge\nrnnd_http_connections %lld\n",
        (long long)lds(&m->http_connections));
    put(&b, "# HELP rnnd_http_connections_dropped_total HTTP connections ended before a request "
            "was answered, by reason: evicted (closed for a new one at the connection cap), "
            "header_timeout (no complete request in time; answered 408), accept_failed.\n"
            "# TYPE rnnd_http_connections_dropped_total counter\n");
    for (int i = 0; i < RNND_HTTP_DROP_COUNT; i++)
        put(&b, "rnnd_http_connections_dropped_total{reason=\"%s\"} %llu\n", http_drop_names[i],
            (unsigned long long)ld(&m->http_dropped[i]));
    put(&b,
        "# HELP rnnd_reply_bytes Memory held by replies not yet read by their clients (reserved "
        "before the work, queued or being sent).\n"
        "# TYPE rnnd_reply_bytes gauge\nrnnd_reply_bytes %lld\n",
        (long long)lds(&m->reply_bytes));
    put(&b,
        "# HELP rnnd_connections gRPC connections open.\n"
        "# TYPE rnnd_connections gauge\nrnnd_connections %lld\n",
        (long long)lds(&m->connections));
    put(&b,
        "# HELP rnnd_health_watches grpc.health.v1 Watch streams open.\n"
        "# TYPE rnnd_health_watches gauge\nrnnd_health_watches %lld\n",
        (long long)lds(&m->health_watches));
    put(&b,
        "# HELP rnnd_stream_idle_timeouts_total Calls ended by --stream-idle-timeout-s: idle "
        "StepStreams, and calls whose reply their client did not read.\n"
        "# TYPE rnnd_stream_idle_timeouts_total counter\nrnnd_stream_idle_timeouts_total %llu\n",
        (unsigned long long)ld(&m->stream_idle_ends));
    put(&b,
        "# HELP rnnd_shm_regions Shared-memory regions registered by clients on this host.\n"
        "# TYPE rnnd_shm_regions gauge\nrnnd_shm_regions %lld\n",
        (long long)lds(&m->shm_regions));
    if (b.err) {
        free(b.p);
        return b.err;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}
