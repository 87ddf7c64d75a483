/*
 * cluster.c: the rendezvous and control channel of several rnnd instances (see cluster.h).
 *
 * Protocol (TCP, one connection from every rank r > 0 to rank 0; little-endian frames of a 12-byte
 * header {magic "RNDC", u16 type, u16 version 1, u32 payload length} and a payload):
 *
 *   start    rank r > 0 connects to --rendezvous (retrying every 0.5 s: rank 0 may start later)
 *            and sends HELLO {rank, world, fingerprint}. Rank 0 refuses (REFUSE {text}, then
 *            closes) a HELLO with another world size or fingerprint (model, compute, devices) or
 *            a rank already joined, and keeps waiting. Once all world - 1 ranks have joined it
 *            sends WELCOME {NCCL id} to each. Every rank then creates its NCCL communicator
 *            from the id (NCCL's own bootstrap, not this channel) and takes rank 0's weights.
 *            (The cpu backend's id names a TCP port that rank 0 opened instead: its collectives
 *            run through rank 0, kernels/cpu/comm.c.)
 *   updates  an ApplyGradients or SetWeights received by rank r becomes PROPOSE {kind, origin,
 *            token, lr} to rank 0 (rank 0's own calls go to its channel thread directly). Rank 0
 *            numbers proposals in arrival order and sends COMMIT {the same, seq} to every
 *            follower, then hands it to its own engines; a follower hands each COMMIT to its
 *            engines as it arrives. So every rank queues the same collectives in the same order,
 *            and the origin answers its client when its own collective is done. Gradients and
 *            weights travel over NCCL inside those collectives (broadcast from the origin).
 *   failure  a closed connection, a read error or a malformed frame breaks the group: the lost
 *            callback runs once (rnnd then drains, checkpoints and exits with status 3 so the
 *            supervisor restarts it and the group forms anew: an NCCL communicator cannot take
 *            a rank back). TCP keepalive notices a silent host within about 25 s; a collective
 *            waiting for a rank that is gone fails after --comm-timeout-s.
 *
 * The channel carries no secret and no tensor, but a peer may trigger updates: keep the
 * rendezvous port inside the cluster (as NCCL's own ports must be).
 *
 * Threads: start runs on the caller's thread; then one channel thread per rank reads the
 * connections (rank 0: every follower's, with poll, plus a pipe that wakes it for its own
 * proposals). Followers send PROPOSE from the caller's thread under a write lock.
 */
#include "cluster.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "net.h"

#define MAGIC       0x43444e52u // "RNDC"
#define VERSION     1
#define HEADER      12
#define MAX_PAYLOAD 512
// A peer that opened a connection has this long to send its whole HELLO (or a frame it began).
#define HELLO_MS              5000
#define RNND_CLUSTER_HOST_MAX 256

enum msg_type { MSG_HELLO = 1, MSG_WELCOME, MSG_REFUSE, MSG_PROPOSE, MSG_COMMIT };

struct pending_op {
    struct rnnd_cluster_op op;
    struct pending_op *next;
};

struct rnnd_cluster {
    int rank, world;
    rnnd_cluster_commit_cb commit;
    rnnd_cluster_lost_cb lost;
    void *ctx;
    int *fds;    // rank 0: (world) follower connections, fds[0] unused; follower: fds[0]
    int wake[2]; // rank 0: its own proposals wake the channel thread
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t lock;           // guards below, and (followers) serialises writes to fds[0]
    struct pending_op *head, *tail; // rank 0: its own proposals not yet numbered
    uint64_t seq;
    bool broken, stopping;
};

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *err, size_t errlen, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return rc;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

// ---------------------------------------------------------------------------------------------
// Frames

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

// Reads n bytes, waiting at most until deadline (ms on now_ms's clock; 0: no limit).
// 0, -1 (closed or error), -2 (deadline).
static int read_all(int fd, void *buf, size_t n, double deadline) {
    char *p = buf;
    while (n > 0) {
        if (deadline > 0) {
            double left = deadline - now_ms();
            if (left <= 0)
                return -2;
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            int pr = poll(&pf, 1, (int)left + 1);
            if (pr < 0 && errno == EINTR)
                continue;
            if (pr == 0)
                continue; // the deadline check above ends it
            if (pr < 0)
                return -1;
        }
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int send_msg(int fd, int type, const void *payload, size_t len) {
    uint8_t buf[HEADER + MAX_PAYLOAD];
    put32(buf, MAGIC);
    buf[4] = (uint8_t)type;
    buf[5] = 0;
    buf[6] = VERSION;
    buf[7] = 0;
    put32(buf + 8, (uint32_t)len);
    memcpy(buf + HEADER, payload, len);
    return write_all(fd, buf, HEADER + len);
}

// Reads one frame: 0 with *type and payload (*len bytes), -1 closed or malformed, -2 deadline.
static int recv_msg(int fd, int *type, uint8_t *payload, size_t *len, double deadline) {
    uint8_t h[HEADER];
    int rc = read_all(fd, h, HEADER, deadline);
    if (rc != 0)
        return rc;
    uint32_t n = get32(h + 8);
    if (get32(h) != MAGIC || h[6] != VERSION || n > MAX_PAYLOAD)
        return -1;
    rc = read_all(fd, payload, n, deadline);
    if (rc != 0)
        return rc;
    *type = h[4];
    *len = n;
    return 0;
}

#define OP_BYTES 32

static void op_put(uint8_t *p, const struct rnnd_cluster_op *op) {
    uint32_t lr;
    memcpy(&lr, &op->lr, sizeof(lr));
    put32(p, op->kind);
    put32(p + 4, op->origin);
    put64(p + 8, op->token);
    put64(p + 16, op->seq);
    put32(p + 24, op->has_lr);
    put32(p + 28, lr);
}

static int op_get(const uint8_t *p, size_t len, int world, struct rnnd_cluster_op *op) {
    if (len != OP_BYTES)
        return -1;
    uint32_t lr = get32(p + 28);
    op->kind = get32(p);
    op->origin = get32(p + 4);
    op->token = get64(p + 8);
    op->seq = get64(p + 16);
    op->has_lr = get32(p + 24) != 0;
    memcpy(&op->lr, &lr, sizeof(lr));
    bool known = op->kind == RNND_CLUSTER_APPLY_ACCUMULATED ||
                 op->kind == RNND_CLUSTER_APPLY_SENT || op->kind == RNND_CLUSTER_SET_WEIGHTS;
    return known && op->origin < (uint32_t)world ? 0 : -1;
}

// ---------------------------------------------------------------------------------------------
// Sockets

// Rank 0's listening socket: on the rendezvous address when it is one of this host's (a pod's
// own DNS name, 127.0.0.1 in tests), else on every interface with the same port.
static int listen_on(const char *addr, char *err, size_t errlen) {
    char host[RNND_CLUSTER_HOST_MAX], port[16];
    if (rnnd_net_split(addr, host, sizeof(host), port, sizeof(port)) != 0)
        return fail(err, errlen, RNND_EINVAL, "--rendezvous '%s' is not HOST:PORT", addr);
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = rnnd_net_listen(attempt == 0 ? host : NULL, port, 64);
        if (fd >= 0)
            return fd;
        if (errno == EADDRINUSE)
            return fail(err, errlen, RNND_EUNAVAIL,
                        "--rendezvous %s: port %s is in use on this host (is another rank 0 "
                        "running?)",
                        addr, port);
    }
    return fail(err, errlen, RNND_EUNAVAIL, "--rendezvous %s: cannot listen on port %s: %s", addr,
                port, strerror(errno));
}

// One connection attempt; the socket or -1 (errno-like reason in why).
static int connect_once(const char *addr, char *why, size_t whylen) {
    char host[RNND_CLUSTER_HOST_MAX], port[16];
    if (rnnd_net_split(addr, host, sizeof(host), port, sizeof(port)) != 0) {
        snprintf(why, whylen, "not HOST:PORT");
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int gr = getaddrinfo(host, port, &hints, &res);
    if (gr != 0) {
        snprintf(why, whylen, "%s", gai_strerror(gr));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
            snprintf(why, whylen, "%s", strerror(errno));
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    return fd;
}

// ---------------------------------------------------------------------------------------------
// The channel thread

static void broken(struct rnnd_cluster *cl, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void broken(struct rnnd_cluster *cl, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&cl->lock);
    bool report = !cl->broken && !cl->stopping;
    cl->broken = true;
    pthread_mutex_unlock(&cl->lock);
    if (report)
        cl->lost(cl->ctx, why);
}

// Rank 0: numbers op and sends it to every follower, then to its own engines.
static int leader_commit(struct rnnd_cluster *cl, struct rnnd_cluster_op *op) {
    op->seq = ++cl->seq;
    uint8_t p[OP_BYTES];
    op_put(p, op);
    for (int r = 1; r < cl->world; r++) {
        if (send_msg(cl->fds[r], MSG_COMMIT, p, sizeof(p)) != 0) {
            broken(cl, "rank %d cannot be reached (%s); the group of %d rnnd instances is broken",
                   r, strerror(errno), cl->world);
            return -1;
        }
    }
    cl->commit(cl->ctx, op);
    return 0;
}

static void *leader_main(void *arg) {
    struct rnnd_cluster *cl = arg;
    int n = cl->world;
    struct pollfd *pf = calloc((size_t)n, sizeof(*pf));
    if (pf == NULL) {
        broken(cl, "rank 0 is out of memory");
        return NULL;
    }
    pf[0] = (struct pollfd){.fd = cl->wake[0], .events = POLLIN};
    for (int r = 1; r < n; r++)
        pf[r] = (struct pollfd){.fd = cl->fds[r], .events = POLLIN};
    for (;;) {
        int pr = poll(pf, (nfds_t)n, -1);
        if (pr < 0 && errno == EINTR)
            continue;
        pthread_mutex_lock(&cl->lock);
        bool stop = cl->stopping || cl->broken;
        pthread_mutex_unlock(&cl->lock);
        if (stop || pr < 0)
            break;
        if (pf[0].revents) {
            char drain[64];
            while (read(cl->wake[0], drain, sizeof(drain)) > 0) {
            }
            for (;;) {
                pthread_mutex_lock(&cl->lock);
                struct pending_op *p = cl->head;
                if (p) {
                    cl->head = p->next;
                    if (cl->head == NULL)
                        cl->tail = NULL;
                }
                pthread_mutex_unlock(&cl->lock);
                if (p == NULL)
                    break;
                int rc = leader_commit(cl, &p->op);
                free(p);
                if (rc != 0)
                    goto out;
            }
        }
        for (int r = 1; r < n; r++) {
            if (pf[r].revents == 0)
                continue;
            int type;
            uint8_t payload[MAX_PAYLOAD];
            size_t len;
            struct rnnd_cluster_op op;
            int rc = recv_msg(pf[r].fd, &type, payload, &len, now_ms() + HELLO_MS);
            if (rc == 0 && type == MSG_PROPOSE && op_get(payload, len, n, &op) == 0 &&
                op.origin == (uint32_t)r) {
                if (leader_commit(cl, &op) != 0)
                    goto out;
                continue;
            }
            broken(cl,
                   rc != 0 ? "rank %d closed its connection to rank 0 (it stopped or crashed); "
                             "the group is broken"
                           : "rank %d sent rank 0 something that is not a proposal; the group "
                             "is broken",
                   r);
            goto out;
        }
    }
out:
    free(pf);
    return NULL;
}

static void *follower_main(void *arg) {
    struct rnnd_cluster *cl = arg;
    for (;;) {
        int type;
        uint8_t payload[MAX_PAYLOAD];
        size_t len;
        struct rnnd_cluster_op op;
        int rc = recv_msg(cl->fds[0], &type, payload, &len, 0);
        if (rc == 0 && type == MSG_COMMIT && op_get(payload, len, cl->world, &op) == 0) {
            pthread_mutex_lock(&cl->lock);
            bool stop = cl->stopping;
            pthread_mutex_unlock(&cl->lock);
            if (stop)
                break;
            cl->commit(cl->ctx, &op);
            continue;
        }
        broken(cl,
               rc != 0 ? "rank 0 closed the connection to rank %d (it stopped or crashed); the "
                         "group is broken"
                       : "rank 0 sent rank %d something that is not a commit; the group is broken",
               cl->rank);
        break;
    }
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Start

static void hello_put(uint8_t *p, const struct rnnd_cluster_config *cfg) {
    put32(p, (uint32_t)cfg->rank);
    put32(p + 4, (uint32_t)cfg->world);
    put64(p + 8, cfg->fingerprint);
}

static bool aborted(const struct rnnd_cluster_config *cfg) {
    return cfg->abort && atomic_load(cfg->abort);
}

static void refuse(int fd, const char *why) {
    send_msg(fd, MSG_REFUSE, why, strlen(why));
    close(fd);
}

// Rank 0: waits for every follower's HELLO, then sends each the id.
static int leader_start(struct rnnd_cluster *cl, const struct rnnd_cluster_config *cfg,
                        const struct rnnd_comm_id *id, char *err, size_t errlen) {
    int lfd = listen_on(cfg->rendezvous, err, errlen);
    if (lfd < 0)
        return lfd;
    rnnd_log(RNND_LOG_INFO, "rank 0 of %d: waiting for the other ranks on %s", cfg->world,
             cfg->rendezvous);
    double deadline = now_ms() + cfg->timeout_ms, next_note = now_ms() + 10000;
    int joined = 0, rc = 0;
    while (joined < cfg->world - 1) {
        if (aborted(cfg)) {
            rc = fail(err, errlen, RNND_EUNAVAIL, "stopped while waiting for the other ranks");
            break;
        }
        double t = now_ms();
        if (t >= deadline || t >= next_note) {
            char missing[256] = "";
            size_t at = 0;
            for (int r = 1; r < cfg->world && at + 16 < sizeof(missing); r++)
                if (cl->fds[r] < 0)
                    at += (size_t)snprintf(missing + at, sizeof(missing) - at, "%s%d",
                                           at ? ", " : "", r);
            if (t >= deadline) {
                rc = fail(err, errlen, RNND_EUNAVAIL,
                          "rank(s) %s did not join within --rendezvous-timeout-s %d (rank 0 "
                          "listens on %s)",
                          missing, cfg->timeout_ms / 1000, cfg->rendezvous);
                break;
            }
            rnnd_log(RNND_LOG_INFO, "rank 0: still waiting for rank(s) %s", missing);
            next_note = t + 10000;
        }
        struct pollfd pf = {.fd = lfd, .events = POLLIN};
        if (poll(&pf, 1, 200) <= 0)
            continue;
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        rnnd_net_tune(fd, 10);
        int type;
        uint8_t p[MAX_PAYLOAD];
        size_t len;
        if (recv_msg(fd, &type, p, &len, now_ms() + HELLO_MS) != 0 || type != MSG_HELLO ||
            len != 16) {
            rnnd_log(RNND_LOG_WARN, "rendezvous: a connection that is not an rnnd rank; closed");
            close(fd);
            continue;
        }
        int r = (int)get32(p), world = (int)get32(p + 4);
        uint64_t fp = get64(p + 8);
        char why[256] = "";
        if (world != cfg->world)
            snprintf(why, sizeof(why), "rank %d has --world-size %d, rank 0 has %d", r, world,
                     cfg->world);
        else if (r < 1 || r >= cfg->world)
            snprintf(why, sizeof(why), "rank %d is not in 1..%d", r, cfg->world - 1);
        else if (fp != cfg->fingerprint)
            snprintf(why, sizeof(why),
                     "rank %d serves another model or number of devices than rank 0 (cell, "
                     "sizes, compute, optimizer, backend and --devices must match)",
                     r);
        else if (cl->fds[r] >= 0)
            snprintf(why, sizeof(why), "rank %d has already joined (two instances with one rank?)",
                     r);
        if (why[0]) {
            rnnd_log(RNND_LOG_WARN, "rendezvous: refused: %s", why);
            refuse(fd, why);
            continue;
        }
        cl->fds[r] = fd;
        joined++;
        rnnd_log(RNND_LOG_INFO, "rank 0: rank %d joined (%d of %d)", r, joined + 1, cfg->world);
    }
    close(lfd);
    for (int r = 1; rc == 0 && r < cfg->world; r++)
        if (send_msg(cl->fds[r], MSG_WELCOME, id->bytes, sizeof(id->bytes)) != 0)
            rc = fail(err, errlen, RNND_EUNAVAIL, "rank %d left before the group formed", r);
    return rc;
}

// Rank r > 0: connects (retrying), says HELLO, waits for WELCOME.
static int follower_start(struct rnnd_cluster *cl, const struct rnnd_cluster_config *cfg,
                          struct rnnd_comm_id *id, char *err, size_t errlen) {
    double deadline = now_ms() + cfg->timeout_ms, next_note = now_ms() + 10000;
    char why[256] = "";
    int fd = -1;
    while (fd < 0) {
        if (aborted(cfg))
            return fail(err, errlen, RNND_EUNAVAIL, "stopped while connecting to rank 0");
        fd = connect_once(cfg->rendezvous, why, sizeof(why));
        if (fd >= 0)
            break;
        double t = now_ms();
        if (t >= deadline)
            return fail(err, errlen, RNND_EUNAVAIL,
                        "rank 0 at --rendezvous %s did not answer within --rendezvous-timeout-s "
                        "%d (last: %s)",
                        cfg->rendezvous, cfg->timeout_ms / 1000, why);
        if (t >= next_note) {
            rnnd_log(RNND_LOG_INFO, "rank %d: rank 0 at %s not reachable yet (%s); retrying",
                     cfg->rank, cfg->rendezvous, why);
            next_note = t + 10000;
        }
        usleep(500000);
    }
    rnnd_net_tune(fd, 10);
    uint8_t p[MAX_PAYLOAD];
    hello_put(p, cfg);
    if (send_msg(fd, MSG_HELLO, p, 16) != 0) {
        close(fd);
        return fail(err, errlen, RNND_EUNAVAIL, "rank 0 at %s closed the connection",
                    cfg->rendezvous);
    }
    rnnd_log(RNND_LOG_INFO, "rank %d of %d: connected to rank 0 at %s; waiting for the others",
             cfg->rank, cfg->world, cfg->rendezvous);
    int type, rc;
    size_t len;
    // Rank 0 answers once every rank is there: wait in short steps to notice an abort.
    do {
        if (aborted(cfg)) {
            close(fd);
            return fail(err, errlen, RNND_EUNAVAIL, "stopped while waiting for the group");
        }
        double step = now_ms() + 200;
        rc = recv_msg(fd, &type, p, &len, step < deadline ? step : deadline);
    } while (rc == -2 && now_ms() < deadline);
    if (rc == 0 && type == MSG_REFUSE) {
        close(fd);
        return fail(err, errlen, RNND_EUNAVAIL, "rank 0 refused rank %d: %.*s", cfg->rank, (int)len,
                    (const char *)p);
    }
    if (rc != 0 || type != MSG_WELCOME || len != sizeof(id->bytes)) {
        close(fd);
        if (rc == -2)
            return fail(err, errlen, RNND_EUNAVAIL,
                        "the group did not form within --rendezvous-timeout-s %d",
                        cfg->timeout_ms / 1000);
        return fail(err, errlen, RNND_EUNAVAIL,
                    "rank 0 closed the connection before the group "
                    "formed");
    }
    memcpy(id->bytes, p, sizeof(id->bytes));
    cl->fds[0] = fd;
    return 0;
}

int rnnd_cluster_start(const struct rnnd_cluster_config *cfg, struct rnnd_comm_id *id,
                       rnnd_cluster_commit_cb commit, rnnd_cluster_lost_cb lost, void *ctx,
                       struct rnnd_cluster **out, char *err, size_t errlen) {
    *out = NULL;
    if (cfg->world < 2 || cfg->rank < 0 || cfg->rank >= cfg->world || cfg->timeout_ms < 1)
        return fail(err, errlen, RNND_EINVAL, "rank %d of world %d is not a group", cfg->rank,
                    cfg->world);
    struct rnnd_cluster *cl = calloc(1, sizeof(*cl));
    int *fds = calloc((size_t)cfg->world, sizeof(int));
    if (cl == NULL || fds == NULL) {
        free(cl);
        free(fds);
        return fail(err, errlen, RNND_ENOMEM, "out of memory");
    }
    for (int r = 0; r < cfg->world; r++)
        fds[r] = -1;
    cl->fds = fds;
    cl->wake[0] = cl->wake[1] = -1;
    cl->rank = cfg->rank;
    cl->world = cfg->world;
    cl->commit = commit;
    cl->lost = lost;
    cl->ctx = ctx;
    pthread_mutex_init(&cl->lock, NULL);
    int rc;
    if (cfg->rank == 0) {
        rc = pipe2(cl->wake, O_CLOEXEC | O_NONBLOCK);
        if (rc != 0)
            rc = fail(err, errlen, RNND_ENOMEM, "pipe: %s", strerror(errno));
        else
            rc = leader_start(cl, cfg, id, err, errlen);
    } else {
        rc = follower_start(cl, cfg, id, err, errlen);
    }
    if (rc == 0 &&
        pthread_create(&cl->thread, NULL, cfg->rank == 0 ? leader_main : follower_main, cl) != 0)
        rc = fail(err, errlen, RNND_ENOMEM, "cannot start the channel thread");
    if (rc != 0) {
        rnnd_cluster_free(cl);
        return rc;
    }
    cl->thread_started = true;
    *out = cl;
    return 0;
}

int rnnd_cluster_propose(struct rnnd_cluster *cl, struct rnnd_cluster_op *op) {
    op->origin = (uint32_t)cl->rank;
    op->seq = 0;
    pthread_mutex_lock(&cl->lock);
    if (cl->broken || cl->stopping) {
        pthread_mutex_unlock(&cl->lock);
        return RNND_EUNAVAIL;
    }
    int rc = 0;
    if (cl->rank == 0) {
        struct pending_op *p = malloc(sizeof(*p));
        if (p == NULL) {
            pthread_mutex_unlock(&cl->lock);
            return RNND_ENOMEM;
        }
        p->op = *op;
        p->next = NULL;
        if (cl->tail)
            cl->tail->next = p;
        else
            cl->head = p;
        cl->tail = p;
        char one = 1;
        if (write(cl->wake[1], &one, 1) < 0 && errno != EAGAIN)
            rc = RNND_EUNAVAIL;
    } else {
        uint8_t p[OP_BYTES];
        op_put(p, op);
        if (send_msg(cl->fds[0], MSG_PROPOSE, p, sizeof(p)) != 0)
            rc = RNND_EUNAVAIL;
    }
    pthread_mutex_unlock(&cl->lock);
    return rc;
}

int rnnd_cluster_host(const char *addr, char *host, size_t len) {
    char port[16];
    return rnnd_net_split(addr, host, len, port, sizeof(port)) == 0 ? 0 : RNND_EINVAL;
}

void rnnd_cluster_free(struct rnnd_cluster *cl) {
    if (cl == NULL)
        return;
    pthread_mutex_lock(&cl->lock);
    cl->stopping = true;
    pthread_mutex_unlock(&cl->lock);
    // Wake the channel thread: the leader through its pipe, a follower by ending its reads.
    if (cl->wake[1] >= 0) {
        char one = 1;
        if (write(cl->wake[1], &one, 1) < 0) {
            // Full pipe: the thread is awake anyway.
        }
    }
    for (int r = 0; r < cl->world; r++)
        if (cl->fds[r] >= 0)
            shutdown(cl->fds[r], SHUT_RDWR);
    if (cl->thread_started)
        pthread_join(cl->thread, NULL);
    for (int r = 0; r < cl->world; r++)
        if (cl->fds[r] >= 0)
            close(cl->fds[r]);
    if (cl->wake[0] >= 0)
        close(cl->wake[0]);
    if (cl->wake[1] >= 0)
        close(cl->wake[1]);
    while (cl->head) {
        struct pending_op *p = cl->head;
        cl->head = p->next;
        free(p);
    }
    pthread_mutex_destroy(&cl->lock);
    free(cl->fds);
    free(cl);
}
