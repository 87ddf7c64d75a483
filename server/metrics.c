/*
 * metrics.c: bucket layouts, recording and the Prometheus text renderer (see metrics.h). Values
 * kept as integers (nanoseconds, bytes, rows) are printed exactly, as decimals, never through a
 * float: bucket bounds read as written (le="0.000025", le="1048576").
 */
#include "metrics.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>
#include <unistd.h>

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
static const char *const drop_names[RNND_DROP_COUNT] = {"policy_lag", "overwritten"};
static const char *const phase_names[RNND_PHASE_COUNT] = {"gather", "update", "reply", "admit"};
static const char *const http_drop_names[RNND_HTTP_DROP_COUNT] = {"evicted", "header_timeout",
                                                                  "accept_failed"};
static const char *const limit_names[RNND_LIMIT_COUNT] = {
    "envs",        "step_queue_rows", "tape_bytes",     "message_bytes", "streams",
    "reply_bytes", "connections",     "health_watches", "shm_regions",   "socket_region_bytes"};
// Which bounds are in bytes (rnnd_limit_bytes); the others count items (rnnd_limit_items).
static const bool limit_in_bytes[RNND_LIMIT_COUNT] = {[RNND_LIMIT_TAPE_BYTES] = true,
                                                      [RNND_LIMIT_MESSAGE] = true,
                                                      [RNND_LIMIT_REPLY_BYTES] = true,
                                                      [RNND_LIMIT_SOCKET_BYTES] = true};

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

// v / 10^decimals as an exact decimal without trailing zeros, into out: 25000 ns with 9 decimals
// is "0.000025" seconds, 1048576 with none "1048576".
static const char *fixed(char out[32], uint64_t v, int decimals) {
    uint64_t p = 1;
    for (int i = 0; i < decimals; i++)
        p *= 10;
    int n = snprintf(out, 32, "%llu", (unsigned long long)(v / p));
    if (v % p) {
        n += snprintf(out + n, (size_t)(32 - n), ".%0*llu", decimals, (unsigned long long)(v % p));
        while (out[n - 1] == '0')
            out[--n] = '\0';
    }
    return out;
}

// decimals: 9 for histograms kept in ns and printed in seconds, 0 for counts and bytes.
static void put_hist(struct buf *b, const char *name, const char *labels, struct rnnd_histogram *h,
                     int decimals) {
    uint64_t cum = 0;
    const char *sep = labels[0] ? "," : "";
    char num[32];
    for (int i = 0; i <= h->n; i++) {
        cum += ld(&h->counts[i]);
        if (i < h->n)
            put(b, "%s_bucket{%s%sle=\"%s\"} %llu\n", name, labels, sep,
                fixed(num, h->bounds[i], decimals), (unsigned long long)cum);
        else
            put(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, (unsigned long long)cum);
    }
    fixed(num, ld(&h->sum), decimals);
    if (labels[0]) {
        put(b, "%s_sum{%s} %s\n", name, labels, num);
        put(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)cum);
    } else {
        put(b, "%s_sum %s\n", name, num);
        put(b, "%s_count %llu\n", name, (unsigned long long)cum);
    }
}

// Prometheus' standard process metrics (the names its client libraries export, so the usual
// dashboards and alerts work), read from /proc at scrape time. A family that cannot be read is
// left out rather than shown as 0.
static void put_process(struct buf *b) {
    char num[32];
    uint64_t tck = (uint64_t)sysconf(_SC_CLK_TCK), page = (uint64_t)sysconf(_SC_PAGESIZE);
    char stat[1024] = "";
    FILE *f = fopen("/proc/self/stat", "r");
    if (f) {
        stat[fread(stat, 1, sizeof(stat) - 1, f)] = '\0';
        fclose(f);
    }
    // The fields after the command name, which is in parentheses and may itself hold spaces or
    // parentheses: state (3), then ..., utime (14), stime (15), ..., starttime (22), vsize (23),
    // rss (24), in clock ticks, bytes and pages (proc(5)).
    const char *p = strrchr(stat, ')');
    unsigned long long utime, stime, start, vsize;
    long long rss;
    bool have_stat = p && sscanf(p + 2,
                                 "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d "
                                 "%*d %*d %*d %*d %llu %llu %lld",
                                 &utime, &stime, &start, &vsize, &rss) == 5;
    // Boot time (the "btime" line of /proc/stat), to turn starttime into a Unix time.
    unsigned long long btime = 0;
    f = fopen("/proc/stat", "r");
    if (f) {
        char line[256];
        bool at_start = true; // the "intr" line is longer than line: read it in pieces
        while (fgets(line, sizeof(line), f)) {
            if (at_start && sscanf(line, "btime %llu", &btime) == 1)
                break;
            at_start = strchr(line, '\n') != NULL;
        }
        fclose(f);
    }
    if (have_stat) {
        put(b,
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
            "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total %s\n",
            fixed(num, (utime + stime) * (1000000000ull / tck), 9));
        put(b,
            "# HELP process_virtual_memory_bytes Virtual memory size in bytes.\n"
            "# TYPE process_virtual_memory_bytes gauge\nprocess_virtual_memory_bytes %llu\n",
            vsize);
        put(b,
            "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
            "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes %llu\n",
            (unsigned long long)rss * (unsigned long long)page);
    }
    if (have_stat && btime)
        put(b,
            "# HELP process_start_time_seconds Start time of the process since unix epoch in "
            "seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %s\n",
            fixed(num, btime * 1000000000ull + start * (1000000000ull / tck), 9));
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        long long n = 0;
        for (struct dirent *e; (e = readdir(d));)
            n += e->d_name[0] != '.' && atoi(e->d_name) != dirfd(d);
        closedir(d);
        put(b,
            "# HELP process_open_fds Number of open file descriptors.\n"
            "# TYPE process_open_fds gauge\nprocess_open_fds %lld\n",
            n);
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        put(b,
            "# HELP process_max_fds Maximum number of open file descriptors.\n"
            "# TYPE process_max_fds gauge\nprocess_max_fds %llu\n",
            (unsigned long long)rl.rlim_cur);
}

int rnnd_metrics_render(char **out, size_t *len) {
    struct buf b = {malloc(16384), 0, 16384, 0};
    if (b.p == NULL)
        return RNND_ENOMEM;
    struct rnnd_metrics *m = &rnnd_metrics;
    char num[32];

    put(&b, "# HELP rnnd_up 1 while the process runs.\n# TYPE rnnd_up gauge\nrnnd_up 1\n");
    const char *backend = atomic_load(&m->backend);
    if (backend)
        put(&b,
            "# HELP rnnd_build_info 1, labelled with the version, the git commit built, the "
            "backend serving (shown once the engine runs) and the CUDA runtime linked (none: "
            "built without CUDA).\n# TYPE rnnd_build_info gauge\n"
            "rnnd_build_info{version=\"%s\",commit=\"%s\",backend=\"%s\",cuda=\"%s\"} 1\n",
            RNND_VERSION, RNND_GIT_COMMIT, backend, RNND_CUDA_RUNTIME_VERSION);
    put_process(&b);
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
        put_hist(&b, "rnnd_request_duration_seconds", labels, &m->duration[i], 9);
    }

    put(&b, "# HELP rnnd_step_queue_delay_seconds Time a Step waits from arrival to its batch.\n"
            "# TYPE rnnd_step_queue_delay_seconds histogram\n");
    put_hist(&b, "rnnd_step_queue_delay_seconds", "", &m->queue_delay, 9);

    put(&b, "# HELP rnnd_batch_rows Rows (env steps) per backend step call.\n"
            "# TYPE rnnd_batch_rows histogram\n");
    put_hist(&b, "rnnd_batch_rows", "", &m->batch_rows, 0);

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
    put(&b, "# HELP rnnd_recorded_steps_dropped_total Recorded steps that cursor windows skipped "
            "without handing them out, by reason.\n"
            "# TYPE rnnd_recorded_steps_dropped_total counter\n");
    for (int i = 0; i < RNND_DROP_COUNT; i++)
        put(&b, "rnnd_recorded_steps_dropped_total{reason=\"%s\"} %llu\n", drop_names[i],
            (unsigned long long)ld(&m->recorded_dropped[i]));
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
        put(&b, "rnnd_backend_kernel_seconds_total{op=\"%s\"} %s\n", op_names[i],
            fixed(num, ld(&m->kernel_ns[i]), 9));
    put(&b, "# HELP rnnd_engine_seconds_total Engine time around Step batches, by phase.\n"
            "# TYPE rnnd_engine_seconds_total counter\n");
    for (int i = 0; i < RNND_PHASE_COUNT; i++)
        put(&b, "rnnd_engine_seconds_total{phase=\"%s\"} %s\n", phase_names[i],
            fixed(num, ld(&m->engine_ns[i]), 9));
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
    put(&b, "# HELP rnnd_limit Deprecated: mixes units; use rnnd_limit_bytes and rnnd_limit_items. "
            "The configured bound of each resource (rows, bytes, envs, calls).\n"
            "# TYPE rnnd_limit gauge\n");
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        put(&b, "rnnd_limit{resource=\"%s\"} %lld\n", limit_names[i], (long long)lds(&m->limit[i]));
    put(&b, "# HELP rnnd_limit_bytes The configured bound of each resource measured in bytes.\n"
            "# TYPE rnnd_limit_bytes gauge\n");
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        if (limit_in_bytes[i])
            put(&b, "rnnd_limit_bytes{resource=\"%s\"} %lld\n", limit_names[i],
                (long long)lds(&m->limit[i]));
    put(&b, "# HELP rnnd_limit_items The configured bound of each resource counted in items "
            "(envs, queued rows, calls, connections, watch streams).\n"
            "# TYPE rnnd_limit_items gauge\n");
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        if (!limit_in_bytes[i])
            put(&b, "rnnd_limit_items{resource=\"%s\"} %lld\n", limit_names[i],
                (long long)lds(&m->limit[i]));
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
    put_hist(&b, "rnnd_request_message_bytes", "", &m->request_size, 0);
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
        "# HELP rnnd_trajectory_store_bytes Backend memory of the trajectory store (every env "
        "slot's recorded steps: --max-envs x --trajectory-steps rows, on each device).\n"
        "# TYPE rnnd_trajectory_store_bytes gauge\nrnnd_trajectory_store_bytes %lld\n",
        (long long)lds(&m->traj_store_bytes));
    put(&b,
        "# HELP rnnd_shm_regions Shared-memory regions registered by clients on this host.\n"
        "# TYPE rnnd_shm_regions gauge\nrnnd_shm_regions %lld\n",
        (long long)lds(&m->shm_regions));
    put(&b,
        "# HELP rnnd_socket_region_bytes The daemon's memory in the socket regions registered.\n"
        "# TYPE rnnd_socket_region_bytes gauge\nrnnd_socket_region_bytes %lld\n",
        (long long)lds(&m->socket_bytes));
    put(&b,
        "# HELP rnnd_data_bytes_total Bytes the socket regions' data connections received (in) "
        "and sent (out).\n"
        "# TYPE rnnd_data_bytes_total counter\n"
        "rnnd_data_bytes_total{direction=\"in\"} %llu\n"
        "rnnd_data_bytes_total{direction=\"out\"} %llu\n",
        (unsigned long long)ld(&m->data_in), (unsigned long long)ld(&m->data_out));
    if (b.err) {
        free(b.p);
        return b.err;
    }
    *out = b.p;
    *len = b.len;
    return 0;
}
