/*
 * comm.c (cpu): the cpu backend's communicators (rnnd_comm.h), of two kinds.
 *
 *   in-process  (rnnd_comm_id_new with no host: the engines of one daemon) ranks are threads of
 *               one process, so a collective is a barrier and plain loads and stores: every rank
 *               posts its buffer, each rank sums one chunk of the vector over all ranks in rank
 *               order and writes the chunk into every rank's buffer, and a second barrier ends
 *               the call.
 *   sockets     (with a host: the rnnd instances of a group, or anything spread over processes)
 *               the maker listens on that host, on a port the system picks, and the id carries
 *               the address; rank 0, which lives in the maker's process, accepts one TCP
 *               connection from every other rank. A collective is a star around rank 0:
 *               all_reduce sends every buffer to rank 0, which adds them in rank order and sends
 *               the sum back; broadcast sends the root's buffer to rank 0 (unless it is the root)
 *               and rank 0 sends it on. Every frame says which collective it belongs to (kind,
 *               root, count and a sequence number), so ranks that disagree on the order fail
 *               instead of mixing buffers.
 * Either way the sum of each element is computed once, so all ranks get the same bits, as with
 * NCCL. The in-process kind stays as it is, not a special case of sockets: it copies nothing
 * through the kernel and runs under every multi-device test and daemon on the cpu backend; the
 * socket kind exists so that the multi-host paths (server/cluster.c, group.c) run without NCCL.
 * It is the one place in kernels/ that does I/O: it stands in for NCCL's own network transport.
 *
 * Hangs are what a communicator must not do: every wait has the deadline given at init (per
 * call), a closed connection fails at once, and either breaks the communicator for good
 * (RNND_EUNAVAIL from then on; its sockets are shut down so the peers fail at once too).
 *
 * The id holds the maker's pid and a pointer to a group in the maker's process (the barrier
 * state, or the listening socket), plus the address. The group is reference-counted: its
 * maker and every in-process rank that joined hold one reference; rank 0 of a socket
 * communicator holds one while it accepts. Frames and floats travel in the host's byte order:
 * the ranks run one build on one architecture.
 */
#include "rnnd_comm.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CPU_COMM_MAGIC 0x726e6e64637075ull // "rnndcpu"
#define NET_MAGIC      0x58434e52u         // "RNCX"
// A connection to rank 0 has this long to say which rank it is (a stray one is then dropped).
#define HELLO_MS 5000
// Floats added per read while rank 0 sums (a buffer on its stack).
#define SUM_CHUNK 4096

struct cpu_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int nranks, refs, joined;
    bool broken; // a rank timed out: every later call fails
    int timeout_ms;
    uint64_t gen; // barrier generation
    int arrived;
    float **bufs;  // (nranks) the buffers posted for the collective in progress
    int listen_fd; // sockets: where the other ranks connect; -1 in-process
};

struct id_layout {
    uint64_t magic;
    uint64_t pid; // the maker's process, where g points
    struct cpu_group *g;
    uint64_t nonce; // sockets: tells this communicator's connections from others
    int32_t nranks;
    uint16_t port;               // sockets: where the maker listens; 0 in-process
    char host[INET6_ADDRSTRLEN]; // sockets: the maker's address, numeric
};

_Static_assert(sizeof(struct id_layout) <= RNND_COMM_ID_BYTES, "the cpu id fits an NCCL id");

static void id_read(const struct rnnd_comm_id *id, struct id_layout *l) {
    memcpy(l, id->bytes, sizeof(*l));
    l->host[sizeof(l->host) - 1] = '\0';
}

// The group the id names, when it was made in this process.
static struct cpu_group *group_of(const struct id_layout *l) {
    return l->magic == CPU_COMM_MAGIC && l->pid == (uint64_t)getpid() ? l->g : NULL;
}

static void group_unref_locked(struct cpu_group *g) {
    if (--g->refs > 0) {
        pthread_mutex_unlock(&g->mu);
        return;
    }
    pthread_mutex_unlock(&g->mu);
    if (g->listen_fd >= 0)
        close(g->listen_fd);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g->bufs);
    free(g);
}

static void deadline_in(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

// Listens on host (a name or address of this machine; when it is not one, on every interface
// of its family, as behind NAT) at a port the system picks; the socket, with the numeric
// address and the port in l. RNND_EINVAL when host does not resolve, RNND_EDEVICE when no
// socket can be opened.
static int listen_on(const char *host, struct id_layout *l) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, "0", &hints, &res) != 0)
        return RNND_EINVAL;
    int rc = RNND_EDEVICE;
    for (struct addrinfo *ai = res; ai && rc < 0; ai = ai->ai_next) {
        if (getnameinfo(ai->ai_addr, ai->ai_addrlen, l->host, sizeof(l->host), NULL, 0,
                        NI_NUMERICHOST) != 0)
            continue;
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        struct sockaddr_storage a;
        memcpy(&a, ai->ai_addr, ai->ai_addrlen);
        int ok = bind(fd, (struct sockaddr *)&a, ai->ai_addrlen) == 0;
        if (!ok && errno == EADDRNOTAVAIL) {
            // Not an address of this machine: the peers still reach it there.
            if (a.ss_family == AF_INET)
                ((struct sockaddr_in *)&a)->sin_addr.s_addr = htonl(INADDR_ANY);
            else
                ((struct sockaddr_in6 *)&a)->sin6_addr = in6addr_any;
            ok = bind(fd, (struct sockaddr *)&a, ai->ai_addrlen) == 0;
        }
        socklen_t len = sizeof(a);
        if (ok && listen(fd, 64) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0) {
            l->port = ntohs(a.ss_family == AF_INET ? ((struct sockaddr_in *)&a)->sin_port
                                                   : ((struct sockaddr_in6 *)&a)->sin6_port);
            rc = fd;
        } else {
            close(fd);
        }
    }
    freeaddrinfo(res);
    return rc;
}

int rnnd__cpu_comm_id_new(int nranks, const char *host, struct rnnd_comm_id *id) {
    if (nranks < 1 || id == NULL)
        return RNND_EINVAL;
    struct id_layout l = {.magic = CPU_COMM_MAGIC, .pid = (uint64_t)getpid(), .nranks = nranks};
    int fd = -1;
    if (host) {
        if ((fd = listen_on(host, &l)) < 0)
            return fd;
        if (getrandom(&l.nonce, sizeof(l.nonce), 0) != sizeof(l.nonce))
            l.nonce = (uint64_t)now_ms() ^ (l.pid << 32);
    }
    struct cpu_group *g = calloc(1, sizeof(*g));
    float **bufs = calloc((size_t)nranks, sizeof(*bufs));
    if (g == NULL || bufs == NULL) {
        free(g);
        free(bufs);
        if (fd >= 0)
            close(fd);
        return RNND_ENOMEM;
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->nranks = nranks;
    g->refs = 1;
    g->bufs = bufs;
    g->listen_fd = fd;
    l.g = g;
    memset(id, 0, sizeof(*id));
    memcpy(id->bytes, &l, sizeof(l));
    return 0;
}

void rnnd__cpu_comm_id_release(const struct rnnd_comm_id *id) {
    struct id_layout l;
    id_read(id, &l);
    struct cpu_group *g = group_of(&l);
    if (g == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    group_unref_locked(g);
}

// ---------------------------------------------------------------------------------------------
// In-process

struct cpu_comm {
    struct rnnd_comm base;
    struct cpu_group *g;
};

// Waits until every rank has arrived (under g->mu). 0, or RNND_EUNAVAIL when one did not come
// within the timeout (the group is then broken for good).
static int barrier_locked(struct cpu_group *g) {
    if (g->broken)
        return RNND_EUNAVAIL;
    uint64_t gen = g->gen;
    if (++g->arrived == g->nranks) {
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
        return 0;
    }
    struct timespec dl;
    deadline_in(&dl, g->timeout_ms);
    while (g->gen == gen && !g->broken) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && g->gen == gen) {
            g->broken = true;
            pthread_cond_broadcast(&g->cv);
        }
    }
    return g->gen != gen ? 0 : RNND_EUNAVAIL;
}

static int barrier(struct cpu_group *g) {
    pthread_mutex_lock(&g->mu);
    int rc = barrier_locked(g);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

static int cpu_all_reduce(struct rnnd_comm *c, float *buf, size_t n) {
    struct cpu_group *g = ((struct cpu_comm *)c)->g;
    int N = g->nranks, r = c->rank;
    size_t lo = n * (size_t)r / (size_t)N, hi = n * (size_t)(r + 1) / (size_t)N;
    float *sum = malloc((hi - lo + 1) * sizeof(float));
    pthread_mutex_lock(&g->mu);
    g->bufs[r] = buf;
    int rc = barrier_locked(g);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0 && sum == NULL) {
        // Out of memory: still pass the barriers so the others are not left waiting.
        rc = barrier(g);
        if (rc == 0)
            rc = barrier(g);
        return rc ? rc : RNND_ENOMEM;
    }
    if (rc == 0) {
        for (size_t i = lo; i < hi; i++) {
            float s = 0.0f;
            for (int k = 0; k < N; k++)
                s += g->bufs[k][i];
            sum[i - lo] = s;
        }
        rc = barrier(g); // every rank has read every buffer
    }
    if (rc == 0) {
        for (int k = 0; k < N; k++)
            memcpy(g->bufs[k] + lo, sum, (hi - lo) * sizeof(float));
        rc = barrier(g); // every chunk is written everywhere
    }
    free(sum);
    return rc;
}

static int cpu_broadcast(struct rnnd_comm *c, float *buf, size_t n, int root) {
    struct cpu_group *g = ((struct cpu_comm *)c)->g;
    pthread_mutex_lock(&g->mu);
    g->bufs[c->rank] = buf;
    int rc = barrier_locked(g);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0 && c->rank != root)
        memcpy(buf, g->bufs[root], n * sizeof(float));
    if (rc == 0)
        rc = barrier(g); // the root's buffer is read by all before it may change
    return rc;
}

static void cpu_comm_free(struct rnnd_comm *c) {
    struct cpu_group *g = ((struct cpu_comm *)c)->g;
    free(c);
    pthread_mutex_lock(&g->mu);
    group_unref_locked(g);
}

static const struct rnnd_comm_ops cpu_comm_ops = {
    .all_reduce = cpu_all_reduce,
    .broadcast = cpu_broadcast,
    .free = cpu_comm_free,
};

static int local_init(struct cpu_group *g, int nranks, int rank, int timeout_ms,
                      struct rnnd_comm **out) {
    struct cpu_comm *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return RNND_ENOMEM;
    c->base = (struct rnnd_comm){.ops = &cpu_comm_ops, .rank = rank, .nranks = nranks};
    c->g = g;
    pthread_mutex_lock(&g->mu);
    g->refs++;
    g->timeout_ms = timeout_ms;
    if (++g->joined == nranks)
        pthread_cond_broadcast(&g->cv);
    struct timespec dl;
    deadline_in(&dl, timeout_ms);
    while (g->joined < nranks && !g->broken) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && g->joined < nranks) {
            g->broken = true;
            pthread_cond_broadcast(&g->cv);
        }
    }
    if (g->joined < nranks) {
        group_unref_locked(g);
        free(c);
        return RNND_EUNAVAIL;
    }
    pthread_mutex_unlock(&g->mu);
    *out = &c->base;
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Sockets

enum net_kind { NET_HELLO = 1, NET_WELCOME, NET_ALL_REDUCE, NET_BROADCAST };

// Every message: this header, then count floats. kind is enum net_kind | root << 8; seq numbers
// the collectives from 1 (HELLO and WELCOME carry the id's nonce instead; HELLO's count is the
// rank, plus nranks << 32).
struct net_header {
    uint32_t magic, kind;
    uint64_t seq, count;
};

struct net_comm {
    struct rnnd_comm base;
    int *fds; // rank 0: (nranks) each other rank's connection, fds[0] unused; others: fds[0]
    int timeout_ms;
    uint64_t seq; // collectives so far
    bool broken;
};

// Moves exactly n bytes to (send) or from fd before deadline (now_ms's clock). 0, or
// RNND_EUNAVAIL: the peer closed, an error, or the deadline passed.
static int net_io(int fd, void *buf, size_t n, bool send_it, double deadline) {
    char *p = buf;
    while (n > 0) {
        ssize_t k =
            send_it ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return RNND_EUNAVAIL;
        double left = deadline - now_ms();
        if (left <= 0)
            return RNND_EUNAVAIL;
        struct pollfd pf = {.fd = fd, .events = send_it ? POLLOUT : POLLIN};
        poll(&pf, 1, (int)left + 1);
    }
    return 0;
}

static int net_send(int fd, uint32_t kind, uint64_t seq, const float *buf, uint64_t count,
                    double deadline) {
    struct net_header h = {NET_MAGIC, kind, seq, count};
    int rc = net_io(fd, &h, sizeof(h), true, deadline);
    if (rc == 0 && buf)
        rc = net_io(fd, (void *)buf, count * sizeof(float), true, deadline);
    return rc;
}

// Receives the header that must come next (kind, seq and count as given: else the peer is in
// another collective), then its floats into buf (unless buf is NULL: the caller reads them).
static int net_expect(int fd, uint32_t kind, uint64_t seq, float *buf, uint64_t count,
                      double deadline) {
    struct net_header h;
    int rc = net_io(fd, &h, sizeof(h), false, deadline);
    if (rc == 0 && (h.magic != NET_MAGIC || h.kind != kind || h.seq != seq || h.count != count))
        rc = RNND_EUNAVAIL;
    if (rc == 0 && buf)
        rc = net_io(fd, buf, count * sizeof(float), false, deadline);
    return rc;
}

// A failed collective: the communicator is unusable, and the peers learn it at once.
static int net_broken(struct net_comm *c) {
    c->broken = true;
    for (int k = 0; k < c->base.nranks; k++)
        if (c->fds[k] >= 0)
            shutdown(c->fds[k], SHUT_RDWR);
    return RNND_EUNAVAIL;
}

static int net_all_reduce(struct rnnd_comm *rc_, float *buf, size_t n) {
    struct net_comm *c = (struct net_comm *)rc_;
    if (c->broken)
        return RNND_EUNAVAIL;
    double dl = now_ms() + c->timeout_ms;
    uint64_t seq = ++c->seq;
    int N = c->base.nranks, rc = 0;
    if (c->base.rank != 0) {
        rc = net_send(c->fds[0], NET_ALL_REDUCE, seq, buf, n, dl);
        if (rc == 0)
            rc = net_expect(c->fds[0], NET_ALL_REDUCE, seq, buf, n, dl);
        return rc ? net_broken(c) : 0;
    }
    // Rank 0: buf += rank k's buffer for k = 1, 2, ... in turn (each element in rank order).
    float part[SUM_CHUNK];
    for (int k = 1; rc == 0 && k < N; k++) {
        rc = net_expect(c->fds[k], NET_ALL_REDUCE, seq, NULL, n, dl);
        for (size_t at = 0; rc == 0 && at < n; at += SUM_CHUNK) {
            size_t m = n - at < SUM_CHUNK ? n - at : SUM_CHUNK;
            rc = net_io(c->fds[k], part, m * sizeof(float), false, dl);
            for (size_t i = 0; rc == 0 && i < m; i++)
                buf[at + i] += part[i];
        }
    }
    for (int k = 1; rc == 0 && k < N; k++)
        rc = net_send(c->fds[k], NET_ALL_REDUCE, seq, buf, n, dl);
    return rc ? net_broken(c) : 0;
}

static int net_broadcast(struct rnnd_comm *rc_, float *buf, size_t n, int root) {
    struct net_comm *c = (struct net_comm *)rc_;
    if (c->broken)
        return RNND_EUNAVAIL;
    double dl = now_ms() + c->timeout_ms;
    uint64_t seq = ++c->seq;
    uint32_t kind = NET_BROADCAST | (uint32_t)root << 8;
    int rank = c->base.rank, rc = 0;
    if (rank == 0) {
        if (root != 0)
            rc = net_expect(c->fds[root], kind, seq, buf, n, dl);
        for (int k = 1; rc == 0 && k < c->base.nranks; k++)
            if (k != root)
                rc = net_send(c->fds[k], kind, seq, buf, n, dl);
    } else if (rank == root) {
        rc = net_send(c->fds[0], kind, seq, buf, n, dl);
    } else {
        rc = net_expect(c->fds[0], kind, seq, buf, n, dl);
    }
    return rc ? net_broken(c) : 0;
}

static void net_comm_free(struct rnnd_comm *rc_) {
    struct net_comm *c = (struct net_comm *)rc_;
    for (int k = 0; k < c->base.nranks; k++)
        if (c->fds[k] >= 0)
            close(c->fds[k]);
    free(c->fds);
    free(c);
}

static const struct rnnd_comm_ops net_comm_ops = {
    .all_reduce = net_all_reduce,
    .broadcast = net_broadcast,
    .free = net_comm_free,
};

static void net_tune(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Rank 0: takes one connection from every other rank (checking who it is), then welcomes all.
static int net_accept_all(struct net_comm *c, const struct id_layout *l, double dl) {
    struct cpu_group *g = group_of(l);
    if (g == NULL)
        return RNND_EINVAL; // rank 0 lives where the id was made
    pthread_mutex_lock(&g->mu);
    g->refs++; // the listening socket stays open while we accept
    pthread_mutex_unlock(&g->mu);
    int N = c->base.nranks, joined = 0, rc = 0;
    while (rc == 0 && joined < N - 1) {
        double left = dl - now_ms();
        struct pollfd pf = {.fd = g->listen_fd, .events = POLLIN};
        if (left <= 0) {
            rc = RNND_EUNAVAIL;
            break;
        }
        if (poll(&pf, 1, (int)left + 1) <= 0)
            continue;
        int fd = accept4(g->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        net_tune(fd);
        struct net_header h;
        double hello_dl = now_ms() + HELLO_MS < dl ? now_ms() + HELLO_MS : dl;
        int r = -1;
        if (net_io(fd, &h, sizeof(h), false, hello_dl) == 0 && h.magic == NET_MAGIC &&
            h.kind == NET_HELLO && h.seq == l->nonce && (int)(h.count >> 32) == N) {
            r = (int)(uint32_t)h.count;
            if (r < 1 || r >= N || c->fds[r] >= 0)
                r = -1;
        }
        if (r < 0) { // a stray connection, or a rank that came twice
            close(fd);
            continue;
        }
        c->fds[r] = fd;
        joined++;
    }
    for (int r = 1; rc == 0 && r < N; r++)
        rc = net_send(c->fds[r], NET_WELCOME, l->nonce, NULL, 0, dl);
    pthread_mutex_lock(&g->mu);
    group_unref_locked(g);
    return rc;
}

// Rank r > 0: connects to the maker's address (retrying: its process may be slow to get there,
// though it listens from the id's making), says who it is, and waits for rank 0's welcome.
static int net_connect(struct net_comm *c, const struct id_layout *l, double dl) {
    char port[8];
    snprintf(port, sizeof(port), "%u", (unsigned)l->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(l->host, port, &hints, &res) != 0)
        return RNND_EINVAL;
    int fd = -1;
    while (fd < 0 && now_ms() < dl) {
        fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
        if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0)
            break;
        if (fd >= 0)
            close(fd);
        fd = -1;
        usleep(50000);
    }
    freeaddrinfo(res);
    if (fd < 0)
        return RNND_EUNAVAIL;
    net_tune(fd);
    c->fds[0] = fd;
    uint64_t who = (uint64_t)(uint32_t)c->base.rank | (uint64_t)c->base.nranks << 32;
    int rc = net_send(fd, NET_HELLO, l->nonce, NULL, who, dl);
    if (rc == 0)
        rc = net_expect(fd, NET_WELCOME, l->nonce, NULL, 0, dl);
    return rc;
}

static int net_init(const struct id_layout *l, int nranks, int rank, int timeout_ms,
                    struct rnnd_comm **out) {
    struct net_comm *c = calloc(1, sizeof(*c));
    int *fds = malloc((size_t)nranks * sizeof(int));
    if (c == NULL || fds == NULL) {
        free(c);
        free(fds);
        return RNND_ENOMEM;
    }
    for (int k = 0; k < nranks; k++)
        fds[k] = -1;
    c->base = (struct rnnd_comm){.ops = &net_comm_ops, .rank = rank, .nranks = nranks};
    c->fds = fds;
    c->timeout_ms = timeout_ms;
    double dl = now_ms() + timeout_ms;
    int rc = rank == 0 ? net_accept_all(c, l, dl) : net_connect(c, l, dl);
    if (rc != 0) {
        net_comm_free(&c->base); // closing tells the ranks that did connect
        return rc;
    }
    *out = &c->base;
    return 0;
}

int rnnd__cpu_comm_init(const struct rnnd_comm_id *id, int nranks, int rank, int timeout_ms,
                        struct rnnd_comm **out) {
    struct id_layout l;
    id_read(id, &l);
    *out = NULL;
    if (l.magic != CPU_COMM_MAGIC || nranks != l.nranks || rank < 0 || rank >= nranks ||
        timeout_ms < 1)
        return RNND_EINVAL;
    if (l.port)
        return net_init(&l, nranks, rank, timeout_ms, out);
    struct cpu_group *g = group_of(&l);
    if (g == NULL)
        return RNND_EINVAL; // an in-process id used in another process
    return local_init(g, nranks, rank, timeout_ms, out);
}
