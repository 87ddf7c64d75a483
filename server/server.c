/*
 * server.c: lifecycle and the loop thread (see server.h).
 *
 *   start:  block signals (gRPC's threads inherit the mask) -> grpc_init -> bind gRPC and HTTP
 *           (health answers NOT_SERVING, rnnd.v1 calls UNAVAILABLE) -> engine thread loads the
 *           model -> ready: serving, the ready line, the cron timer.
 *   drain:  SIGTERM/SIGINT -> not ready (/readyz 503, health NOT_SERVING) -> rpc drain (no new
 *           calls; the calls and StepStreams already open go on, replies delivered) -> at
 *           --drain-timeout-s the StepStreams still open end with a clean status, and 1 s later
 *           whatever still runs is cancelled; once no call is left, the connections close 200 ms
 *           later (time for the last statuses to be read) -> when the gRPC threads have stopped:
 *           engine stop (it finishes what is queued and writes a final checkpoint; HTTP still
 *           answers, /readyz 503) -> join -> close HTTP and the other handles -> exit 0.
 * A second signal during the drain cancels the calls still running at once; during the final
 * checkpoint it changes nothing. When the group of
 * rnnd instances breaks (a peer is gone: group.h), the same drain runs and rnnd exits with
 * status 3, so that its supervisor restarts it and the group forms again.
 *
 * Other threads talk to the loop through one uv_async_t and a bit set under a mutex: libuv
 * merges async sends, so the callback handles every pending event.
 */
#include "server.h"

#include <grpc/grpc.h>
#include <pthread.h>
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdbool.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <uv.h>

#include "group.h"
#include "grpc_start.h"
#include "http.h"
#include "log.h"
#include "metrics.h"
#include "rpc.h"
#include "service.h"
#include "shm.h"

enum {
    EV_ENGINE_READY = 1,
    EV_ENGINE_FAILED = 2,
    EV_RPC_STOPPED = 4,
    EV_GROUP_LOST = 8,
    EV_RPC_DRAINED = 16,
};

// Exit status after the group of instances broke (see above).
#define EXIT_GROUP_LOST 3

struct rnnd_server {
    struct rnnd_config cfg;
    uv_loop_t loop;
    uv_signal_t sigterm, sigint;
    uv_timer_t cron, drain_timer;
    uv_async_t async;
    uv_work_t join; // the engine's join, off the loop (see shutdown_finish)
    pthread_mutex_t lock;
    int events; // EV_* bits, under lock
    char engine_msg[512];
    char lost_msg[512];
    struct rnnd_group *group;
    struct rnnd_rpc *rpc;
    struct rnnd_http *http;
    struct rnnd_service svc;
    struct rnnd_shm *shm;
    int http_port;
    int exit_code;
    bool draining;
    bool drained; // every gRPC call finished: the connections close after DRAIN_LINGER_MS
    bool stopped; // gRPC has stopped: the engine finishes its queue and the final checkpoint
    bool ready;
};

static void post_event(struct rnnd_server *s, int ev) {
    pthread_mutex_lock(&s->lock);
    s->events |= ev;
    pthread_mutex_unlock(&s->lock);
    uv_async_send(&s->async);
}

// Engine thread.
static void on_engine_ready(void *ctx, int err, const char *msg) {
    struct rnnd_server *s = ctx;
    if (err) {
        pthread_mutex_lock(&s->lock);
        snprintf(s->engine_msg, sizeof(s->engine_msg), "%s", msg);
        pthread_mutex_unlock(&s->lock);
    }
    post_event(s, err ? EV_ENGINE_FAILED : EV_ENGINE_READY);
}

// The group's channel thread.
static void on_group_lost(void *ctx, const char *why) {
    struct rnnd_server *s = ctx;
    pthread_mutex_lock(&s->lock);
    snprintf(s->lost_msg, sizeof(s->lost_msg), "%s", why);
    pthread_mutex_unlock(&s->lock);
    post_event(s, EV_GROUP_LOST);
}

// The last gRPC thread, as it exits.
static void on_rpc_stopped(void *ctx) {
    post_event(ctx, EV_RPC_STOPPED);
}

// Any thread: the drain has no call left.
static void on_rpc_drained(void *ctx) {
    post_event(ctx, EV_RPC_DRAINED);
}

static void on_cron(uv_timer_t *t) {
    struct rnnd_server *s = t->data;
    if (s->ready && !s->draining) {
        rnnd_group_housekeeping(s->group);
        rnnd_rpc_housekeeping(s->rpc);
        rnnd_shm_housekeeping(s->shm);
    }
}

// Time the StepStreams ended at --drain-timeout-s get for their status (and a reply in flight)
// to reach their clients before the rest is cancelled.
#define DRAIN_LAST_CALL_MS 1000
// Time the last statuses get to be read before the connections close: a client still writing on
// its stream would otherwise see its connection break instead of the status.
#define DRAIN_LINGER_MS 200

static void on_drain_cancel(uv_timer_t *t) {
    struct rnnd_server *s = t->data;
    if (!s->drained)
        rnnd_log(RNND_LOG_WARN, "calls still running after the drain: cancelling them");
    rnnd_rpc_cancel_all(s->rpc);
}

static void on_drain_timeout(uv_timer_t *t) {
    struct rnnd_server *s = t->data;
    rnnd_log(RNND_LOG_INFO,
             "--drain-timeout-s %d s passed: ending the StepStreams still open; calls still "
             "running in %d ms are cancelled",
             s->cfg.drain_timeout_s, DRAIN_LAST_CALL_MS);
    rnnd_rpc_drain_end(s->rpc);
    uv_timer_start(&s->drain_timer, on_drain_cancel, DRAIN_LAST_CALL_MS, 0);
}

static void drain_begin(struct rnnd_server *s, const char *why) {
    if (s->stopped) {
        // No call is left to cancel; cutting the final checkpoint short would lose state.
        rnnd_log(RNND_LOG_WARN, "%s during the final checkpoint: waiting for it to be written",
                 why);
        return;
    }
    if (s->draining) {
        rnnd_log(RNND_LOG_WARN, "%s again during the drain: cancelling calls still running", why);
        rnnd_rpc_cancel_all(s->rpc);
        return;
    }
    s->draining = true;
    rnnd_log(RNND_LOG_INFO, "%s: draining", why);
    atomic_store(&rnnd_metrics.ready, 0);
    uv_timer_stop(&s->cron);
    rnnd_rpc_drain(s->rpc);
    uv_timer_start(&s->drain_timer, on_drain_timeout, (uint64_t)s->cfg.drain_timeout_s * 1000, 0);
}

static void on_signal(uv_signal_t *h, int signum) {
    drain_begin(h->data, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void close_handle(uv_handle_t *h) {
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

// A libuv threadpool thread: the join waits for the engine's final checkpoint, which can take
// seconds, while the loop goes on answering HTTP (/readyz 503, /healthz 200).
static void join_work(uv_work_t *w) {
    struct rnnd_server *s = w->data;
    rnnd_group_join(s->group);
}

static void after_join(uv_work_t *w, int status) {
    struct rnnd_server *s = w->data;
    (void)status; // the work is never cancelled
    // A supervisor restarts on a non-zero status: a stop that lost state must not look clean.
    if (rnnd_group_final_checkpoint_failed(s->group) && s->exit_code == 0) {
        rnnd_log(RNND_LOG_ERROR, "the final checkpoint failed (see above): what changed since "
                                 "the last checkpoint is lost; exiting with status 1");
        s->exit_code = 1;
    }
    rnnd_http_close(s->http, NULL, NULL);
    s->http = NULL;
    close_handle((uv_handle_t *)&s->sigterm);
    close_handle((uv_handle_t *)&s->sigint);
    close_handle((uv_handle_t *)&s->cron);
    close_handle((uv_handle_t *)&s->drain_timer);
    close_handle((uv_handle_t *)&s->async);
}

static void shutdown_finish(struct rnnd_server *s) {
    // Every gRPC call is done: the engine may stop once it has finished its queue.
    s->stopped = true;
    uv_timer_stop(&s->drain_timer);
    rnnd_group_stop(s->group);
    s->join.data = s;
    int rc = uv_queue_work(&s->loop, &s->join, join_work, after_join);
    if (rc != 0) // only for a NULL work callback
        rnnd_panic(__FILE__, __LINE__, "uv_queue_work: %s", uv_strerror(rc));
}

static void on_async(uv_async_t *a) {
    struct rnnd_server *s = a->data;
    pthread_mutex_lock(&s->lock);
    int ev = s->events;
    s->events = 0;
    pthread_mutex_unlock(&s->lock);
    if ((ev & EV_GROUP_LOST) && !s->draining) {
        rnnd_log(RNND_LOG_ERROR,
                 "the group of rnnd instances broke (%s): stopping with status %d so that the "
                 "supervisor restarts this instance and the group forms again",
                 s->lost_msg, EXIT_GROUP_LOST);
        s->exit_code = EXIT_GROUP_LOST;
        drain_begin(s, "group lost");
    }
    if (ev & EV_ENGINE_FAILED) {
        rnnd_log(RNND_LOG_ERROR, "start-up failed: %s", s->engine_msg);
        s->exit_code = 1;
        drain_begin(s, "start-up failure");
    }
    if ((ev & EV_ENGINE_READY) && !s->draining) {
        s->ready = true;
        rnnd_rpc_set_serving(s->rpc, true);
        atomic_store(&rnnd_metrics.backend, rnnd_group_backend_name(s->group));
        atomic_store(&rnnd_metrics.ready, 1);
        // grpc= is the first address (what clients and scripts have always read), listen=
        // every one.
        const char *addrs = rnnd_rpc_addresses(s->rpc);
        char http_addr[RNND_CONFIG_ADDR_MAX + 16];
        if (s->http) {
            char host[RNND_CONFIG_ADDR_MAX];
            snprintf(host, sizeof(host), "%s", s->cfg.http);
            *strrchr(host, ':') = '\0';
            snprintf(http_addr, sizeof(http_addr), "%s:%d", host, s->http_port);
        } else {
            snprintf(http_addr, sizeof(http_addr), "off");
        }
        rnnd_log_banner("rnnd ready grpc=%.*s http=%s backend=%s listen=%s",
                        (int)strcspn(addrs, ","), addrs, http_addr,
                        rnnd_group_backend_name(s->group), addrs);
        if (rnnd_group_devices(s->group) > 1 || s->cfg.world_size > 1)
            rnnd_log(RNND_LOG_INFO, "serving on %s%s", rnnd_group_device_name(s->group),
                     s->cfg.world_size > 1 ? ", weights shared with the other instances" : "");
        uint64_t period = 1000 / (uint64_t)s->cfg.hz;
        uv_timer_start(&s->cron, on_cron, period ? period : 1, period ? period : 1);
    }
    if ((ev & EV_RPC_DRAINED) && !s->drained) {
        s->drained = true;
        uv_timer_start(&s->drain_timer, on_drain_cancel, DRAIN_LINGER_MS, 0);
    }
    if (ev & EV_RPC_STOPPED) {
        rnnd_log(RNND_LOG_INFO, "gRPC stopped; finishing the engine's queue");
        shutdown_finish(s);
    }
}

// Reads a small file (PEM, token) into a new NUL-terminated string, or NULL with err set.
static char *read_secret(const char *path, const char *flag, char *err) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        snprintf(err, 512, "%s %s: cannot open: %s", flag, path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap + 1);
    if (buf)
        n = fread(buf, 1, cap, f);
    bool too_big = buf && n == cap && fgetc(f) != EOF;
    fclose(f);
    if (buf == NULL || too_big) {
        snprintf(err, 512, "%s %s: %s", flag, path, buf ? "larger than 1 MiB" : "out of memory");
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    return buf;
}

// Warns when the secret in path (a key or token) can be read by users other than rnnd's.
static void secret_mode_check(const char *path, const char *flag) {
    struct stat st;
    if (path[0] && stat(path, &st) == 0 && (st.st_mode & (S_IRGRP | S_IROTH)))
        rnnd_log(RNND_LOG_WARN,
                 "%s %s can be read by its group or by others (mode %03o): chmod 600 it so that "
                 "only rnnd's user can read the secret",
                 flag, path, (unsigned)(st.st_mode & 0777));
}

// Each gRPC connection is a descriptor: raises the soft limit towards what --max-connections
// needs, with room for the daemon's own (HTTP, files, devices), and warns when that is not allowed.
static void fd_limit_raise(int max_connections) {
    struct rlimit rl;
    rlim_t need = (rlim_t)max_connections + 256;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= need)
        return;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < need)
        rnnd_log(RNND_LOG_WARN,
                 "--max-connections %d needs about %llu descriptors but the limit is %llu "
                 "(ulimit -n, LimitNOFILE): connections will fail before the bound; raise the "
                 "limit or lower --max-connections",
                 max_connections, (unsigned long long)need, (unsigned long long)rl.rlim_cur);
}

int rnnd_server_run(const struct rnnd_config *cfg) {
    rnnd_metrics_init();
    rnnd_log_set_level((enum rnnd_log_level)cfg->log_level);
    rnnd_log_set_format((enum rnnd_log_format)cfg->log_format);

    // Security material is read now: a flag that cannot be honoured stops the start.
    char err[512];
    char *tls_cert = NULL, *tls_key = NULL, *tls_ca = NULL, *token = NULL;
    if ((cfg->tls_cert[0] && !(tls_cert = read_secret(cfg->tls_cert, "--tls-cert", err))) ||
        (cfg->tls_key[0] && !(tls_key = read_secret(cfg->tls_key, "--tls-key", err))) ||
        (cfg->tls_client_ca[0] &&
         !(tls_ca = read_secret(cfg->tls_client_ca, "--tls-client-ca", err))) ||
        (cfg->auth_token_file[0] &&
         !(token = read_secret(cfg->auth_token_file, "--auth-token-file", err)))) {
        rnnd_log(RNND_LOG_ERROR, "%s", err);
        free(tls_cert);
        free(tls_key);
        free(tls_ca);
        free(token);
        return 1;
    }
    if (token) { // the token is the file's first line
        token[strcspn(token, "\r\n")] = '\0';
        if (token[0] == '\0') {
            rnnd_log(RNND_LOG_ERROR,
                     "--auth-token-file %s: the file is empty; put the token on "
                     "its first line",
                     cfg->auth_token_file);
            free(tls_cert);
            free(tls_key);
            free(tls_ca);
            free(token);
            return 1;
        }
    }

    secret_mode_check(cfg->tls_key, "--tls-key");
    secret_mode_check(cfg->auth_token_file, "--auth-token-file");

    const char *exposure = rnnd_config_exposure(cfg);
    if (exposure)
        rnnd_log(RNND_LOG_WARN, "--listen %s %s", cfg->listen, exposure);

    struct rnnd_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return 1;
    s->cfg = *cfg;
    pthread_mutex_init(&s->lock, NULL);

    // Block the signals before any thread starts, so they all inherit the mask; the loop
    // thread (this one) unblocks them once the others run.
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    signal(SIGPIPE, SIG_IGN);
    rnnd_grpc_init();

    uv_loop_init(&s->loop);
    uv_async_init(&s->loop, &s->async, on_async);
    s->async.data = s;
    uv_signal_init(&s->loop, &s->sigterm);
    uv_signal_init(&s->loop, &s->sigint);
    s->sigterm.data = s->sigint.data = s;
    uv_timer_init(&s->loop, &s->cron);
    uv_timer_init(&s->loop, &s->drain_timer);
    s->cron.data = s->drain_timer.data = s;

    int rc = 0;
    if (s->cfg.reply_threads < 0) {
        // A quarter of each engine's share of the CPUs, from 8 on: at 32 streams x 1024 envs on
        // a 16-CPU H200 host, 4 gave 7.3M env-steps/s with bf16 where 2, 6 and 8 gave 6.2M,
        // 6.9M and 7.0M; on two GPUs of a 32-CPU host, 4 a device gave 7-9% more than 8.
        int ids[RNND_MAX_DEVICES];
        long cpus = sysconf(_SC_NPROCESSORS_ONLN) / rnnd_config_devices(&s->cfg, ids);
        s->cfg.reply_threads = cpus < 8 ? 0 : cpus / 4 > 8 ? 8 : (int)(cpus / 4);
    }
    s->group = rnnd_group_init(&s->cfg);
    if (s->group == NULL) {
        rnnd_log(RNND_LOG_ERROR, "out of memory");
        rc = 1;
        goto fail_loop;
    }
    if (rnnd_shm_init(cfg->max_shm_regions, &s->shm) != 0) {
        rnnd_log(RNND_LOG_ERROR, "out of memory");
        rc = 1;
        goto fail_loop;
    }
    s->svc = (struct rnnd_service){.cfg = &s->cfg, .group = s->group, .shm = s->shm};
    rnnd_request_limits_init(&s->svc.limits, &s->cfg);
    // A new id at every start: a learner's cursor from another daemon, or from before a restart,
    // is refused rather than silently continued (docs/design.md "Cursor").
    while (s->svc.limits.cursor_id == 0)
        if (getrandom(&s->svc.limits.cursor_id, sizeof(uint64_t), 0) != (ssize_t)sizeof(uint64_t))
            rnnd_panic(__FILE__, __LINE__, "getrandom failed: %s", strerror(errno));
    int64_t bounds[RNND_LIMIT_COUNT] = {
        [RNND_LIMIT_ENVS] = (int64_t)cfg->max_envs * rnnd_group_devices(s->group),
        [RNND_LIMIT_QUEUE_ROWS] = rnnd_config_queue_rows(cfg),
        [RNND_LIMIT_TAPE_BYTES] = (int64_t)cfg->tape_memory_mb << 20,
        [RNND_LIMIT_MESSAGE] = (int64_t)s->svc.limits.max_message_bytes,
        [RNND_LIMIT_STREAMS] = cfg->max_streams,
        [RNND_LIMIT_REPLY_BYTES] = (int64_t)cfg->max_reply_mb << 20,
        [RNND_LIMIT_CONNECTIONS] = cfg->max_connections,
        [RNND_LIMIT_HEALTH_WATCHES] = cfg->max_health_watches,
        [RNND_LIMIT_SHM_REGIONS] = cfg->max_shm_regions,
        [RNND_LIMIT_SOCKET_BYTES] = (int64_t)cfg->max_socket_region_mb << 20,
    };
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        atomic_store(&rnnd_metrics.limit[i], bounds[i]);
    if (strcmp(cfg->http, "off") != 0 &&
        rnnd_http_start(&s->loop, cfg->http, &s->http, &s->http_port, err, sizeof(err)) != 0) {
        rnnd_log(RNND_LOG_ERROR, "%s", err);
        rc = 1;
        goto fail_loop;
    }
    char data_addr[RNND_CONFIG_ADDR_MAX];
    rnnd_config_data_listen(cfg, data_addr);
    if (data_addr[0] &&
        rnnd_shm_listen(s->shm, data_addr, (uint64_t)cfg->max_socket_region_mb << 20, err,
                        sizeof(err)) != 0) {
        rnnd_log(RNND_LOG_ERROR, "%s", err);
        rc = 1;
        goto fail_loop;
    }
    fd_limit_raise(cfg->max_connections);
    int threads = cfg->grpc_threads;
    if (threads == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cpus >= 16 ? 4 : cpus >= 4 ? (int)(cpus / 4) : 1;
    }
    char addrs[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX];
    const char *listen[RNND_CONFIG_LISTEN_MAX];
    int nlisten = rnnd_config_listen(cfg->listen, addrs);
    for (int i = 0; i < nlisten; i++)
        listen[i] = addrs[i];
    struct rnnd_rpc_options ro = {.listen = listen,
                                  .nlisten = nlisten,
                                  .unix_mode = cfg->listen_unix_mode,
                                  .shm = s->shm,
                                  .threads = threads,
                                  .max_message_bytes = s->svc.limits.max_message_bytes,
                                  .max_streams = cfg->max_streams,
                                  .max_reply_bytes = (size_t)cfg->max_reply_mb << 20,
                                  .max_connections = cfg->max_connections,
                                  .max_health_watches = cfg->max_health_watches,
                                  .stream_idle_timeout_s = cfg->stream_idle_timeout_s,
                                  .service = &s->svc,
                                  .stopped = on_rpc_stopped,
                                  .drained = on_rpc_drained,
                                  .stopped_ctx = s,
                                  .tls_cert_pem = tls_cert,
                                  .tls_key_pem = tls_key,
                                  .tls_client_ca_pem = tls_ca,
                                  .auth_token = token};
    if (rnnd_rpc_start(&ro, &s->rpc, err, sizeof(err)) != 0) {
        rnnd_log(RNND_LOG_ERROR, "%s", err);
        rc = 1;
        goto fail_loop;
    }
    if (rnnd_group_start(s->group, on_engine_ready, on_group_lost, s) != 0) {
        rnnd_log(RNND_LOG_ERROR, "cannot start the engine thread");
        s->exit_code = 1;
        drain_begin(s, "start-up failure");
    }
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    rnnd_log(RNND_LOG_INFO,
             "rnnd starting: grpc %s (%d threads), http port %d, data port %d, pid %d",
             rnnd_rpc_addresses(s->rpc), threads, s->http_port, rnnd_shm_data_port(s->shm),
             (int)getpid());

    uv_run(&s->loop, UV_RUN_DEFAULT);

    rnnd_rpc_free(s->rpc);
    rc = s->exit_code;
    rnnd_log(RNND_LOG_INFO, "rnnd stopped (exit %d)", rc);
    goto out;

fail_loop:
    if (s->http)
        rnnd_http_close(s->http, NULL, NULL);
    close_handle((uv_handle_t *)&s->sigterm);
    close_handle((uv_handle_t *)&s->sigint);
    close_handle((uv_handle_t *)&s->cron);
    close_handle((uv_handle_t *)&s->drain_timer);
    close_handle((uv_handle_t *)&s->async);
    uv_run(&s->loop, UV_RUN_DEFAULT);
out:
    free(tls_cert);
    free(tls_key);
    free(tls_ca);
    if (token) {
        memset(token, 0, strlen(token));
        free(token);
    }
    uv_loop_close(&s->loop);
    rnnd_shm_free(s->shm); // after the gRPC calls, which pin regions
    rnnd_group_free(s->group);
    grpc_shutdown();
    pthread_mutex_destroy(&s->lock);
    free(s);
    return rc;
}
