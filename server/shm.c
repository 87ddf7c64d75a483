/*
 * shm.c: shared-memory regions (see shm.h): the registry, RegisterRegion's checks, and the walk
 * over a message's tensors that resolves request spans and places reply tensors.
 *
 * A region is reference counted under the registry lock: one reference for the registry (dropped
 * by ReleaseRegion or housekeeping) and one per span of a request being served, so memory a call
 * still reads or writes is never unmapped under it.
 *
 * The walk is generic over protobuf-c descriptors: every Tensor field of any request or reply,
 * nested (Trajectories) or repeated (NamedTensor lists), is found without per-method code, so a
 * method that gains tensors gains shared memory with them.
 */
#include "shm.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include "log.h"
#include "metrics.h"
#include "net.h"
#include "request.h"
#include "rnnd_kernels.h"

typedef Rnnd__V1__Tensor Tensor;
typedef Rnnd__V1__RegionSpan Span;

struct region {
    uint64_t id;
    uint8_t *base; // the mapping; device memory for a CUDA region; our own for a socket region
    size_t size;
    int fd; // our own open of the memfd (its flock tells whether the client still holds one),
            // or a CUDA region's pidfd of its client (readable once the client exited)
    const struct rnnd_backend *be; // a CUDA region's backend (ipc_close), else NULL
    bool async;                    // a CUDA region's replies may go before their work is done
    int refs;                      // under the registry lock
    unsigned pid;
    bool sock;                       // a socket region
    const struct rnnd_backend *hbe;  // the backend that page-locked it: a socket region's
                                     // host_alloc, a memfd's host_register; NULL: pageable
    uint64_t born_ns;                // a socket region's registration (unbound: it expires)
    uint8_t key[RNND_SHM_KEY_BYTES]; // a socket region's: its data connections' hello
    int cfd[RNND_SHM_SOCKET_CONNS];  // a socket region's data connections (their threads close
    int nconn;                       // them), and how many are bound
};

// A data connection (socket regions) and the thread serving it.
struct conn {
    int fd;
    pthread_t thread;
    bool done; // its thread has finished (under the registry lock): join it
    struct rnnd_shm *shm;
};

struct rnnd_shm {
    pthread_mutex_t lock;
    int max;
    int n;
    struct region **v; // (max)
    // Socket regions: the data listener (-1: off), its thread and its connections.
    int lfd, port;
    uint64_t sock_bytes, sock_max; // socket regions' bytes registered, and their bound
    bool stopping;
    pthread_t acceptor;
    struct conn **conns; // (max * RNND_SHM_SOCKET_CONNS + RNND_SHM_PENDING)
    int nconns;
};

// A request tensor pointed into a region, with what it held before.
struct fix {
    Tensor *t;
    ProtobufCBinaryData data;
    struct region *r;
};

// A reply tensor moved into the reply_region.
struct placed {
    Tensor *t;
    ProtobufCBinaryData data;
    Span span;
};

struct rnnd_shm_use {
    struct rnnd_shm *shm;
    struct fix *fixes;
    int nfixes, capfixes;
    int dev_fixes;     // of them in CUDA regions
    int bytes_tensors; // request tensors with their bytes in the message
    unsigned dev_ok;
    struct region *reply; // the reply_region's region (pinned), or NULL
    uint64_t reply_off, reply_len;
    struct placed *placed;
    int nplaced;
};

static int errf(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int errf(char *err, size_t errlen, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return code;
}

// ---------------------------------------------------------------------------------------------
// The registry

int rnnd_shm_init(int max_regions, struct rnnd_shm **out) {
    struct rnnd_shm *s = calloc(1, sizeof(*s));
    if (s == NULL || (s->v = calloc((size_t)max_regions + 1, sizeof(*s->v))) == NULL) {
        free(s);
        return RNND_ENOMEM;
    }
    pthread_mutex_init(&s->lock, NULL);
    s->max = max_regions;
    s->lfd = -1;
    *out = s;
    return 0;
}

static void region_unmap(struct region *r) {
    if (r->sock) {
        if (r->hbe)
            r->hbe->ops->host_free(r->hbe->ctx, r->base);
        else
            free(r->base);
    } else if (r->be) {
        r->be->ops->ipc_close(r->be->ctx, r->base);
    } else {
        if (r->hbe)
            r->hbe->ops->host_unregister(r->hbe->ctx, r->base);
        munmap(r->base, r->size);
    }
    if (!r->sock)
        close(r->fd);
    free(r);
}

// Drops a reference; the last one unmaps. s->lock held.
static void region_unref_locked(struct region *r) {
    if (--r->refs == 0)
        region_unmap(r);
}

// Takes region k out of the registry (its reference dropped). s->lock held. A socket region's
// data connections are shut down: their threads then drop their references.
static void region_remove_locked(struct rnnd_shm *s, int k) {
    struct region *r = s->v[k];
    if (r->sock) {
        for (int i = 0; i < r->nconn; i++)
            shutdown(r->cfd[i], SHUT_RDWR);
        s->sock_bytes -= r->size;
        atomic_store_explicit(&rnnd_metrics.socket_bytes, (int64_t)s->sock_bytes,
                              memory_order_relaxed);
    }
    s->v[k] = s->v[--s->n];
    atomic_store_explicit(&rnnd_metrics.shm_regions, s->n, memory_order_relaxed);
    region_unref_locked(r);
}

static struct region *region_find_locked(struct rnnd_shm *s, uint64_t id) {
    for (int k = 0; k < s->n; k++)
        if (s->v[k]->id == id)
            return s->v[k];
    return NULL;
}

static void data_stop(struct rnnd_shm *s);

void rnnd_shm_free(struct rnnd_shm *s) {
    if (s == NULL)
        return;
    data_stop(s);
    while (s->n > 0)
        region_remove_locked(s, 0);
    pthread_mutex_destroy(&s->lock);
    free(s->conns);
    free(s->v);
    free(s);
}

bool rnnd_shm_peer_local(const char *peer) {
    if (peer == NULL)
        return false;
    if (strncmp(peer, "unix:", 5) == 0)
        return true;
    if (strncmp(peer, "ipv4:127.", 9) == 0)
        return true;
    // IPv6 loopback, and IPv4 loopback mapped into IPv6 (a dual-stack listener).
    return strncmp(peer, "ipv6:[::1]:", 11) == 0 || strncmp(peer, "ipv6:[::ffff:127.", 17) == 0;
}

static const char *remote_msg =
    "shared memory needs a client on the daemon's host: connect through a unix: --listen "
    "address or loopback, or send tensors as bytes";

// Constant-time comparison: how long it takes says nothing about where the key differs.
static bool key_equal(const uint8_t *a, const uint8_t *b) {
    unsigned diff = 0;
    for (int i = 0; i < RNND_SHM_KEY_BYTES; i++)
        diff |= (unsigned)(a[i] ^ b[i]);
    return diff == 0;
}

static int full_msg(struct rnnd_shm *s, int n, char *err, size_t errlen) {
    rnnd_metrics_limit_hit(RNND_LIMIT_SHM_REGIONS);
    return errf(err, errlen, RNND_EFULL,
                "%d shared-memory regions are registered (--max-shm-regions %d); release "
                "unused ones (ReleaseRegion), or raise --max-shm-regions",
                n, s->max);
}

// What both kinds of region check first: the key's length and the size (kind: "memfd" or
// "cuda", the field's name in the message). 0, or RNND_EINVAL with err written.
static int check_key_size(const char *kind, const ProtobufCBinaryData *key, uint64_t size,
                          char *err, size_t errlen) {
    if (key->len != RNND_SHM_KEY_BYTES)
        return errf(err, errlen, RNND_EINVAL,
                    "%s.key has %zu bytes; send the %d random bytes written at the region's "
                    "start",
                    kind, key->len, RNND_SHM_KEY_BYTES);
    if (size < RNND_SHM_ALIGN || size > ((uint64_t)1 << 40))
        return errf(err, errlen, RNND_EINVAL,
                    "%s.size %" PRIu64 " is not between %d bytes and 1 TiB", kind, size,
                    RNND_SHM_ALIGN);
    return 0;
}

// Opens a memfd region of req into *r (base, size, fd, pid), page-locked through hbe when it can
// (so that the engine copies straight between it and the device, as for a socket region's
// memory), else pageable. 0, or an error with err written.
static int memfd_open(const Rnnd__V1__MemfdRegion *m, const struct rnnd_backend *hbe,
                      struct region *r, char *err, size_t errlen) {
    int rc = check_key_size("memfd", &m->key, m->size, err, errlen);
    if (rc)
        return rc;
    if (m->pid == 0 || m->fd < 0)
        return errf(err, errlen, RNND_EINVAL,
                    "memfd.pid and memfd.fd name no descriptor; send the client's pid and the "
                    "memfd's descriptor number");
    // The kernel lets us open another process's descriptor only when we may trace it: the same
    // user (or a root daemon).
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u/fd/%d", m->pid, m->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT)
            return errf(err, errlen, RNND_EPRECOND,
                        "process %u has no descriptor %d here: send your pid as the daemon's "
                        "host sees it (client and daemon in one pid namespace) and the memfd's "
                        "descriptor",
                        m->pid, m->fd);
        return errf(err, errlen, RNND_EPRECOND,
                    "cannot open descriptor %d of process %u (%s): the client must run as rnnd's "
                    "user (uid %u) and be traceable (not PR_SET_DUMPABLE 0)",
                    m->fd, m->pid, strerror(e), (unsigned)geteuid());
    }
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    rc = 0;
    uint8_t *base = MAP_FAILED;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || seals < 0) {
        rc = errf(err, errlen, RNND_EPRECOND,
                  "descriptor %d of process %u is not a memfd; create the region with "
                  "memfd_create(MFD_ALLOW_SEALING)",
                  m->fd, m->pid);
    } else if (st.st_uid != geteuid()) {
        rc = errf(err, errlen, RNND_EPRECOND,
                  "the region belongs to uid %u but rnnd runs as uid %u: shared memory is for "
                  "clients of rnnd's own user; send tensors as bytes",
                  (unsigned)st.st_uid, (unsigned)geteuid());
    } else if ((uint64_t)st.st_size != m->size) {
        rc =
            errf(err, errlen, RNND_EINVAL, "memfd.size is %" PRIu64 " but the memfd has %lld bytes",
                 m->size, (long long)st.st_size);
    } else if (!(seals & F_SEAL_SHRINK)) {
        // Unsealed, the client could shrink the file under the daemon's mapping, and the
        // daemon's next access would fault.
        rc = errf(err, errlen, RNND_EPRECOND,
                  "the memfd is not sealed against shrinking; add F_SEAL_SHRINK (fcntl "
                  "F_ADD_SEALS) before registering");
    } else if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
        rc = errf(err, errlen, RNND_EPRECOND,
                  "no process holds flock(LOCK_SH) on the memfd; hold it for as long as the "
                  "region is in use (the daemon releases a region once nobody holds its lock)");
    } else if ((base = mmap(NULL, m->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
               MAP_FAILED) {
        rc = errf(err, errlen, RNND_ENOMEM, "cannot map the region's %" PRIu64 " bytes: %s",
                  m->size, strerror(errno));
    } else if (!key_equal(base, m->key.data)) {
        rc = errf(err, errlen, RNND_EPRECOND,
                  "the region does not start with memfd.key; write the key at offset 0 before "
                  "registering");
    }
    if (rc) {
        if (base != MAP_FAILED)
            munmap(base, m->size);
        close(fd);
        return rc;
    }
    // Page-locking makes every page of the region resident; without it (no memory the kernel
    // lets be locked) its copies go through the driver's bounce buffer, as before.
    if (hbe && (hbe->ops->host_register == NULL ||
                hbe->ops->host_register(hbe->ctx, base, (size_t)m->size) != 0))
        hbe = NULL;
    *r = (struct region){.base = base, .size = m->size, .fd = fd, .pid = m->pid, .hbe = hbe};
    return 0;
}

// Opens a CUDA region of req through be into *r. 0, or an error with err written.
static int cuda_open(const Rnnd__V1__CudaRegion *m, const struct rnnd_backend *be, struct region *r,
                     char *err, size_t errlen) {
    if (be == NULL || be->ops->ipc_open == NULL)
        return errf(err, errlen, RNND_EPRECOND,
                    "CUDA regions need a daemon on one CUDA device (--backend cuda, one entry in "
                    "--devices); register a memfd region, or send tensors as bytes");
    int rc = check_key_size("cuda", &m->key, m->size, err, errlen);
    if (rc)
        return rc;
    if (m->ipc_handle.len != 64)
        return errf(err, errlen, RNND_EINVAL,
                    "cuda.ipc_handle has %zu bytes; send the 64 bytes of cudaIpcGetMemHandle's "
                    "cudaIpcMemHandle_t",
                    m->ipc_handle.len);
    if (m->offset % RNND_SHM_ALIGN != 0)
        return errf(err, errlen, RNND_EINVAL, "cuda.offset %" PRIu64 " is not a multiple of %d",
                    m->offset, RNND_SHM_ALIGN);
    if (m->pid == 0)
        return errf(err, errlen, RNND_EINVAL, "cuda.pid is 0; send the client's process id");
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)m->pid, 0);
    if (pidfd < 0)
        return errf(err, errlen, RNND_EPRECOND,
                    "process %u is not running here (%s): send your pid as the daemon's host sees "
                    "it",
                    m->pid, strerror(errno));
    uint8_t head[RNND_SHM_KEY_BYTES];
    void *base = NULL;
    rc = be->ops->ipc_open(be->ctx, m->ipc_handle.data, m->ipc_handle.len, m->offset, m->size, head,
                           sizeof(head), &base);
    if (rc == RNND_EINVAL)
        rc = errf(err, errlen, RNND_EINVAL,
                  "[cuda.offset, + cuda.size) = [%" PRIu64 ", %" PRIu64
                  ") is not inside the exported allocation",
                  m->offset, m->offset + m->size);
    else if (rc)
        rc = errf(err, errlen, RNND_EPRECOND,
                  "the CUDA driver did not open cuda.ipc_handle: export memory of the daemon's "
                  "GPU (%s) from a live process of this host",
                  be->device);
    else if (!key_equal(head, m->key.data))
        rc = errf(err, errlen, RNND_EPRECOND,
                  "the region does not start with cuda.key; write the key at its first byte "
                  "before registering");
    if (rc) {
        if (base)
            be->ops->ipc_close(be->ctx, base);
        close(pidfd);
        return rc;
    }
    *r = (struct region){.base = base, .size = m->size, .fd = pidfd, .be = be, .pid = m->pid};
    return 0;
}

// Async replies for CUDA region r when its client asked for them and the backend can share an
// event (its handle into out); otherwise replies wait for the work, as for a client that did not
// ask.
static void cuda_async(const Rnnd__V1__CudaRegion *m, struct region *r,
                       struct rnnd_shm_registered *out) {
    const struct rnnd_backend_ops *ops = r->be->ops;
    r->async = m->async_replies && ops->ipc_event && ops->ipc_record &&
               ops->ipc_event(r->be->ctx, out->event, sizeof(out->event)) == 0;
    out->async = r->async;
}

// A socket region of req into *r: our own memory (be's host_alloc when be is given, so that the
// engine copies straight between it and the device), bound later by its data connection. 0, or
// an error with err written.
static int socket_open(const struct rnnd_shm *s, const Rnnd__V1__SocketRegion *m,
                       const struct rnnd_backend *be, struct region *r, char *err, size_t errlen) {
    if (s->lfd < 0)
        return errf(err, errlen, RNND_EPRECOND,
                    "socket regions are off on this daemon (--data-listen off, a TLS or unix: "
                    "--listen); send tensors as bytes");
    int rc = check_key_size("socket", &m->key, m->size, err, errlen);
    if (rc)
        return rc;
    if (m->size > RNND_SHM_SOCKET_MAX)
        return errf(err, errlen, RNND_EINVAL,
                    "socket.size %" PRIu64 " is over %llu bytes; register a smaller region",
                    m->size, (unsigned long long)RNND_SHM_SOCKET_MAX);
    void *base = NULL;
    if (be && be->ops->host_alloc(be->ctx, (size_t)m->size, &base) != 0)
        base = NULL, be = NULL;
    if (base == NULL) // plain memory, whose pages are touched only as data arrives
        base = aligned_alloc(RNND_SHM_ALIGN, (size_t)m->size);
    if (base == NULL)
        return errf(err, errlen, RNND_ENOMEM, "cannot allocate the region's %" PRIu64 " bytes",
                    m->size);
    *r = (struct region){
        .base = base, .size = m->size, .fd = -1, .sock = true, .hbe = be, .born_ns = rnnd_now_ns()};
    memcpy(r->key, m->key.data, RNND_SHM_KEY_BYTES);
    return 0;
}

int rnnd_shm_register(struct rnnd_shm *s, const Rnnd__V1__RegisterRegionRequest *req, bool local,
                      const struct rnnd_backend *be, const struct rnnd_backend *host_be,
                      struct rnnd_shm_registered *out, char *err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    if (s->max == 0)
        return errf(err, errlen, RNND_EPRECOND,
                    "shared memory is off on this daemon (--max-shm-regions 0); send tensors as "
                    "bytes");
    bool memfd = req->kind_case == RNND__V1__REGISTER_REGION_REQUEST__KIND_MEMFD && req->memfd;
    bool cuda = req->kind_case == RNND__V1__REGISTER_REGION_REQUEST__KIND_CUDA && req->cuda;
    bool sock = req->kind_case == RNND__V1__REGISTER_REGION_REQUEST__KIND_SOCKET && req->socket;
    if (!local && !sock)
        return errf(err, errlen, RNND_EPRECOND, "%s", remote_msg);
    if (!memfd && !cuda && !sock)
        return errf(err, errlen, RNND_EINVAL,
                    "RegisterRegionRequest names no region; set memfd, cuda or socket");
    pthread_mutex_lock(&s->lock);
    int n = s->n;
    pthread_mutex_unlock(&s->lock);
    if (n >= s->max)
        return full_msg(s, n, err, errlen);
    struct region *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return errf(err, errlen, RNND_ENOMEM, "out of memory");
    int rc = memfd  ? memfd_open(req->memfd, host_be, r, err, errlen)
             : cuda ? cuda_open(req->cuda, be, r, err, errlen)
                    : socket_open(s, req->socket, host_be, r, err, errlen);
    if (rc) {
        free(r);
        return rc;
    }
    if (cuda)
        cuda_async(req->cuda, r, out);
    r->refs = 1;
    pthread_mutex_lock(&s->lock);
    if (s->n >= s->max) {
        pthread_mutex_unlock(&s->lock);
        region_unmap(r);
        return full_msg(s, s->max, err, errlen);
    }
    if (r->sock && r->size > s->sock_max - s->sock_bytes) {
        uint64_t held = s->sock_bytes;
        size_t need = r->size;
        pthread_mutex_unlock(&s->lock);
        region_unmap(r);
        rnnd_metrics_limit_hit(RNND_LIMIT_SOCKET_BYTES);
        return errf(err, errlen, RNND_EFULL,
                    "socket regions hold %" PRIu64 " MiB of --max-socket-region-mb %" PRIu64
                    " and this one needs %zu more; release unused ones (ReleaseRegion), "
                    "register a smaller one, or raise the flag",
                    held >> 20, s->sock_max >> 20, (need + (1u << 20) - 1) >> 20);
    }
    if (r->sock) {
        s->sock_bytes += r->size;
        atomic_store_explicit(&rnnd_metrics.socket_bytes, (int64_t)s->sock_bytes,
                              memory_order_relaxed);
    }
    // Random ids: a region can be named only by the client that registered it.
    do {
        if (getrandom(&r->id, sizeof(r->id), 0) != (ssize_t)sizeof(r->id))
            r->id = ((uint64_t)rnnd_now_ns() * 0x9e3779b97f4a7c15ull) ^ (uintptr_t)r;
    } while (r->id == 0 || region_find_locked(s, r->id));
    s->v[s->n++] = r;
    atomic_store_explicit(&rnnd_metrics.shm_regions, s->n, memory_order_relaxed);
    out->id = r->id;
    out->size = r->size;
    pthread_mutex_unlock(&s->lock);
    rnnd_log(RNND_LOG_DEBUG, "shared memory: %s region of %zu bytes from pid %u registered",
             r->sock ? "socket"
             : r->be ? "CUDA"
                     : "memfd",
             r->size, r->pid);
    return 0;
}

int rnnd_shm_data_port(const struct rnnd_shm *s) {
    return s->lfd >= 0 ? s->port : 0;
}

int rnnd_shm_release(struct rnnd_shm *s, uint64_t id, bool local, char *err, size_t errlen) {
    pthread_mutex_lock(&s->lock);
    int rc = RNND_EPRECOND;
    for (int k = 0; k < s->n; k++) {
        if (s->v[k]->id == id && (local || s->v[k]->sock)) {
            region_remove_locked(s, k);
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (rc && !local)
        return errf(err, errlen, rc, "region %" PRIu64 " is not a socket region of this daemon; %s",
                    id, remote_msg);
    if (rc)
        errf(err, errlen, rc,
             "region %" PRIu64 " is not registered (already released, or its client exited)", id);
    return rc;
}

int rnnd_shm_housekeeping(struct rnnd_shm *s) {
    pthread_mutex_lock(&s->lock);
    for (int k = 0; k < s->n;) {
        struct region *r = s->v[k];
        // The lock is ours only once every process of the client has closed the memfd; a
        // pidfd is readable once its process exited. A socket region goes with its data
        // connections (data_conn_main), or when none came within RNND_SHM_SOCKET_BIND_S.
        struct pollfd pfd = {.fd = r->fd, .events = POLLIN};
        bool gone = r->sock ? r->nconn == 0 && rnnd_now_ns() - r->born_ns >
                                                   (uint64_t)RNND_SHM_SOCKET_BIND_S * 1000000000u
                    : r->be ? poll(&pfd, 1, 0) > 0
                            : flock(r->fd, LOCK_EX | LOCK_NB) == 0;
        if (gone) {
            rnnd_log(RNND_LOG_DEBUG, "shared memory: the client (pid %u) of a region exited",
                     r->pid);
            region_remove_locked(s, k);
        } else {
            k++;
        }
    }
    int n = s->n;
    pthread_mutex_unlock(&s->lock);
    return n;
}

// ---------------------------------------------------------------------------------------------
// Walking a message's tensors

// Called for each Tensor (span NULL) or RegionSpan field (t NULL) of a message; name is the
// field's path ("trajectories.obs", "grads[2].tensor").
typedef int (*visit_fn)(void *ctx, const char *name, Tensor *t, Span *span);

static int walk(ProtobufCMessage *m, const char *prefix, int depth, visit_fn fn, void *ctx) {
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        char *at = (char *)m;
        // A oneof member's storage holds whichever member is set.
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(at + f->quantifier_offset) != f->id)
            continue;
        ProtobufCMessage **v;
        size_t n = 1;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)(at + f->quantifier_offset);
            v = *(ProtobufCMessage ***)(at + f->offset);
        } else {
            v = (ProtobufCMessage **)(at + f->offset);
        }
        for (size_t k = 0; k < n; k++) {
            ProtobufCMessage *sub = v[k];
            if (sub == NULL)
                continue;
            char name[192];
            if (f->label == PROTOBUF_C_LABEL_REPEATED)
                snprintf(name, sizeof(name), "%.90s%s%.40s[%zu]", prefix, *prefix ? "." : "",
                         f->name, k);
            else
                snprintf(name, sizeof(name), "%.90s%s%.40s", prefix, *prefix ? "." : "", f->name);
            int rc = 0;
            if (f->descriptor == &rnnd__v1__tensor__descriptor)
                rc = fn(ctx, name, (Tensor *)sub, NULL);
            else if (f->descriptor == &rnnd__v1__region_span__descriptor)
                rc = fn(ctx, name, NULL, (Span *)sub);
            else if (depth < 4)
                rc = walk(sub, name, depth + 1, fn, ctx);
            if (rc)
                return rc;
        }
    }
    return 0;
}

static int wanted_visit(void *ctx, const char *name, Tensor *t, Span *span) {
    (void)ctx;
    (void)name;
    return span != NULL || t->region != NULL;
}

bool rnnd_shm_wanted(const ProtobufCMessage *msg) {
    return walk((ProtobufCMessage *)msg, "", 0, wanted_visit, NULL) != 0;
}

// ---------------------------------------------------------------------------------------------
// Resolving a request

struct resolve {
    struct rnnd_shm_use *u;
    bool local; // the peer is on this host: every kind of region, else socket regions only
    char *err;
    size_t errlen;
};

// The region of span, checked to hold [offset, offset + nbytes) with offset a multiple of align,
// and pinned. s->lock held.
static int span_take_locked(struct resolve *rs, const char *name, const Span *span, size_t align,
                            struct region **out) {
    struct region *r = region_find_locked(rs->u->shm, span->region);
    if (r == NULL)
        return errf(rs->err, rs->errlen, RNND_EPRECOND,
                    "%s: region %" PRIu64 " is not registered (released, or its client exited); "
                    "register a region (RegisterRegion) and send spans into it",
                    name, span->region);
    if (!rs->local && !r->sock)
        return errf(rs->err, rs->errlen, RNND_EPRECOND, "%s: %s", name, remote_msg);
    if (span->offset > r->size || span->nbytes > r->size - span->offset)
        return errf(rs->err, rs->errlen, RNND_EINVAL,
                    "%s: span [%" PRIu64 ", %" PRIu64 ") is outside region %" PRIu64
                    " of %zu bytes; keep spans inside the region",
                    name, span->offset, span->offset + span->nbytes, span->region, r->size);
    if (align > 1 && span->offset % align != 0)
        return errf(rs->err, rs->errlen, RNND_EINVAL,
                    "%s: offset %" PRIu64 " is not a multiple of %zu; align it", name, span->offset,
                    align);
    r->refs++;
    *out = r;
    return 0;
}

static const char *dev_msg = "%s: a CUDA region carries Backward's gradients and the replies of "
                             "Forward and Backward; send this as bytes or in a memfd region";

static int resolve_visit(void *ctx, const char *name, Tensor *t, Span *span) {
    struct resolve *rs = ctx;
    struct rnnd_shm_use *u = rs->u;
    if (span) {
        if (u->reply)
            return errf(rs->err, rs->errlen, RNND_EINVAL, "%s: a second reply_region", name);
        int rc = span_take_locked(rs, name, span, RNND_SHM_ALIGN, &u->reply);
        u->reply_off = span->offset;
        u->reply_len = span->nbytes;
        if (rc == 0 && u->reply->be && !(u->dev_ok & RNND_SHM_DEV_REPLY))
            return errf(rs->err, rs->errlen, RNND_EINVAL, dev_msg, name);
        return rc;
    }
    if (t->region == NULL) {
        u->bytes_tensors += t->data.len > 0;
        return 0;
    }
    if (t->data.len != 0)
        return errf(rs->err, rs->errlen, RNND_EINVAL,
                    "%s: both data and region are set; send the bytes in one of them", name);
    size_t es = rnnd_request_dtype_size(t->dtype);
    // The byte count of the shape, when the shape is sane; request.c explains other shapes.
    uint64_t count = 1;
    bool sane = es != 0;
    for (size_t d = 0; d < t->n_shape && sane; d++) {
        sane = t->shape[d] >= 0 && t->shape[d] <= ((int64_t)1 << 40) &&
               (t->shape[d] == 0 || count <= ((uint64_t)1 << 40) / (uint64_t)t->shape[d]);
        count *= sane ? (uint64_t)t->shape[d] : 1;
    }
    if (sane && t->region->nbytes != count * es)
        return errf(rs->err, rs->errlen, RNND_EINVAL,
                    "%s: region span has %" PRIu64 " bytes but the shape's %" PRIu64
                    " elements of %zu bytes need %" PRIu64,
                    name, t->region->nbytes, count, es, count * es);
    if (u->nfixes == u->capfixes) {
        int cap = u->capfixes ? 2 * u->capfixes : 8;
        struct fix *v = realloc(u->fixes, (size_t)cap * sizeof(*v));
        if (v == NULL)
            return errf(rs->err, rs->errlen, RNND_ENOMEM, "out of memory");
        u->fixes = v;
        u->capfixes = cap;
    }
    struct region *r;
    int rc = span_take_locked(rs, name, t->region, es ? es : 1, &r);
    if (rc)
        return rc;
    u->fixes[u->nfixes++] = (struct fix){t, t->data, r};
    u->dev_fixes += r->be != NULL;
    if (r->be && !(u->dev_ok & RNND_SHM_DEV_TENSORS))
        return errf(rs->err, rs->errlen, RNND_EINVAL, dev_msg, name);
    if (u->dev_fixes && u->dev_fixes < u->nfixes)
        return errf(rs->err, rs->errlen, RNND_EINVAL,
                    "%s: the request's tensors are in both a CUDA and a memfd region; send "
                    "every tensor of one request through one kind",
                    name);
    t->data.data = r->base + t->region->offset;
    t->data.len = (size_t)t->region->nbytes;
    return 0;
}

int rnnd_shm_resolve(struct rnnd_shm *s, ProtobufCMessage *msg, bool local, unsigned dev_ok,
                     struct rnnd_shm_use **out, char *err, size_t errlen) {
    *out = NULL;
    struct rnnd_shm_use *u = calloc(1, sizeof(*u));
    if (u == NULL)
        return errf(err, errlen, RNND_ENOMEM, "out of memory");
    u->shm = s;
    u->dev_ok = dev_ok;
    struct resolve rs = {u, local, err, errlen};
    pthread_mutex_lock(&s->lock);
    int rc = walk(msg, "", 0, resolve_visit, &rs);
    pthread_mutex_unlock(&s->lock);
    if (rc) {
        rnnd_shm_use_free(u);
        return rc;
    }
    *out = u;
    return 0;
}

void rnnd_shm_use_free(struct rnnd_shm_use *u) {
    if (u == NULL)
        return;
    struct rnnd_shm *s = u->shm;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < u->nfixes; i++) {
        u->fixes[i].t->data = u->fixes[i].data;
        region_unref_locked(u->fixes[i].r);
    }
    if (u->reply)
        region_unref_locked(u->reply);
    pthread_mutex_unlock(&s->lock);
    free(u->fixes);
    free(u->placed);
    free(u);
}

bool rnnd_shm_use_device_in(const struct rnnd_shm_use *u) {
    return u && u->dev_fixes > 0;
}

bool rnnd_shm_use_host_in(const struct rnnd_shm_use *u) {
    if (u == NULL || u->nfixes == 0 || u->bytes_tensors > 0)
        return false;
    for (int i = 0; i < u->nfixes; i++)
        if (u->fixes[i].r->hbe == NULL)
            return false;
    return true;
}

char *rnnd_shm_use_host_reply(const struct rnnd_shm_use *u, size_t *len, bool *pinned) {
    if (u == NULL || u->reply == NULL || u->reply->be)
        return NULL;
    *len = (size_t)u->reply_len;
    *pinned = u->reply->hbe != NULL;
    return (char *)u->reply->base + u->reply_off;
}

char *rnnd_shm_use_device_reply(const struct rnnd_shm_use *u, size_t *len) {
    if (u == NULL || u->reply == NULL || u->reply->be == NULL)
        return NULL;
    *len = (size_t)u->reply_len;
    return (char *)u->reply->base + u->reply_off;
}

bool rnnd_shm_use_async(const struct rnnd_shm_use *u) {
    return u && u->reply && u->reply->async;
}

// ---------------------------------------------------------------------------------------------
// Placing a reply

struct place {
    struct rnnd_shm_use *u;
    uint64_t at; // next free byte of the reply_region, from the region's start
    int n;       // tensors seen (counting pass) or placed
    bool count;
};

// Whether t's data already lies inside u's reply_region (the engine wrote it there).
static bool place_inside(const struct rnnd_shm_use *u, const Tensor *t) {
    const uint8_t *lo = u->reply->base + u->reply_off, *hi = lo + u->reply_len;
    return t->data.data >= lo && t->data.data < hi && t->data.len <= (size_t)(hi - t->data.data);
}

static int place_visit(void *ctx, const char *name, Tensor *t, Span *span) {
    (void)name;
    struct place *p = ctx;
    struct rnnd_shm_use *u = p->u;
    if (t == NULL || span || t->data.len == 0 || t->region)
        return 0;
    // Already in the reply_region (the engine wrote it there): placed where it is, and the
    // others after the last of them.
    uint64_t end = u->reply_off + u->reply_len;
    bool inside = place_inside(u, t);
    if (p->count) {
        p->n++;
        uint64_t tend = inside ? (uint64_t)(t->data.data - u->reply->base) + t->data.len : 0;
        p->at = tend > p->at ? tend : p->at;
        return 0;
    }
    uint64_t at = inside ? (uint64_t)(t->data.data - u->reply->base)
                         : (p->at + RNND_SHM_ALIGN - 1) / RNND_SHM_ALIGN * RNND_SHM_ALIGN;
    if (!inside && (u->reply->be || at > end || t->data.len > end - at))
        return 0; // travels as bytes
    if (!inside)
        memcpy(u->reply->base + at, t->data.data, t->data.len);
    struct placed *pl = &u->placed[u->nplaced++];
    pl->t = t;
    pl->data = t->data;
    rnnd__v1__region_span__init(&pl->span);
    pl->span.region = u->reply->id;
    pl->span.offset = at;
    pl->span.nbytes = t->data.len;
    t->region = &pl->span;
    t->data.data = NULL;
    t->data.len = 0;
    if (!inside)
        p->at = at + pl->span.nbytes;
    return 0;
}

bool rnnd_shm_place(struct rnnd_shm_use *u, ProtobufCMessage *reply) {
    if (u->reply == NULL)
        return false;
    struct place p = {.u = u, .at = u->reply_off, .count = true};
    walk(reply, "", 0, place_visit, &p);
    free(u->placed);
    u->nplaced = 0;
    u->placed = calloc((size_t)p.n + 1, sizeof(*u->placed));
    if (u->placed == NULL)
        return false; // every tensor travels as bytes
    p.count = false;  // p.at: past the tensors already inside
    walk(reply, "", 0, place_visit, &p);
    return true;
}

void rnnd_shm_unplace(struct rnnd_shm_use *u) {
    for (int i = 0; i < u->nplaced; i++) {
        u->placed[i].t->data = u->placed[i].data;
        u->placed[i].t->region = NULL;
    }
    u->nplaced = 0;
}

// ---------------------------------------------------------------------------------------------
// Socket regions: the data connections
//
// The client connects, sends RNND_SHM_HELLO and its region's key within RNND_SHM_HELLO_S
// seconds, and reads back the region's size (8 bytes). Then frames of three little-endian u64,
// (op, offset, nbytes): RNND_SHM_OP_WRITE writes the nbytes that follow into the region at
// offset, RNND_SHM_OP_READ sends nbytes of the region from offset, RNND_SHM_OP_SYNC sends offset
// back (8 bytes), so the client knows that everything it wrote before on that connection is in
// the region. A region takes up to RNND_SHM_SOCKET_CONNS connections with its key, whose frames
// run side by side. A frame outside the region, an unknown op or a wrong hello closes the
// connection, and the region with it. One thread a connection: a frame blocks only its own
// client.

static bool io_full(int fd, void *buf, size_t n, bool rd) {
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = rd ? recv(fd, p, n, 0) : send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return false;
        p += k;
        n -= (size_t)k;
    }
    return true;
}

// The socket region whose key a hello carried, bound to connection fd and referenced; NULL
// when no region with room for another connection has it.
static struct region *data_bind(struct rnnd_shm *s, const uint8_t *key, int fd) {
    struct region *found = NULL;
    pthread_mutex_lock(&s->lock);
    for (int k = 0; k < s->n; k++) {
        struct region *r = s->v[k];
        // Every key is compared, in constant time: the time says nothing about any of them.
        if (r->sock && r->nconn < RNND_SHM_SOCKET_CONNS && key_equal(r->key, key))
            found = r;
    }
    if (found) {
        found->cfd[found->nconn++] = fd;
        found->refs++;
    }
    pthread_mutex_unlock(&s->lock);
    return found;
}

// Connection fd of r ended: r leaves the registry (if ReleaseRegion or another of its
// connections has not taken it out), which shuts its other connections down.
static void data_unbind(struct rnnd_shm *s, struct region *r, int fd) {
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < r->nconn; i++)
        if (r->cfd[i] == fd) {
            r->cfd[i] = r->cfd[--r->nconn];
            break;
        }
    for (int k = 0; k < s->n; k++)
        if (s->v[k] == r) {
            region_remove_locked(s, k);
            break;
        }
    region_unref_locked(r);
    pthread_mutex_unlock(&s->lock);
}

static void data_serve(int fd, struct region *r) {
    for (;;) {
        uint64_t h[3];
        if (!io_full(fd, h, sizeof(h), true))
            return;
        uint64_t op = le64toh(h[0]), off = le64toh(h[1]), n = le64toh(h[2]);
        if (off > r->size || n > r->size - off)
            return;
        bool ok;
        if (op == RNND_SHM_OP_WRITE) {
            ok = io_full(fd, r->base + off, (size_t)n, true);
            atomic_fetch_add_explicit(&rnnd_metrics.data_in, n, memory_order_relaxed);
        } else if (op == RNND_SHM_OP_READ) {
            ok = io_full(fd, r->base + off, (size_t)n, false);
            atomic_fetch_add_explicit(&rnnd_metrics.data_out, n, memory_order_relaxed);
        } else if (op == RNND_SHM_OP_SYNC) {
            uint64_t echo = htole64(off);
            ok = io_full(fd, &echo, sizeof(echo), false);
        } else {
            ok = false;
        }
        if (!ok)
            return;
    }
}

static void *data_conn_main(void *arg) {
    struct conn *c = arg;
    struct rnnd_shm *s = c->shm;
    struct timeval tv = {.tv_sec = RNND_SHM_HELLO_S};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    // A client host that vanished without closing the connection (power, network) is noticed,
    // and its region goes with the connection.
    rnnd_net_tune(c->fd, RNND_SHM_KEEPALIVE_S);
    uint8_t hello[8 + RNND_SHM_KEY_BYTES];
    struct region *r = NULL;
    if (io_full(c->fd, hello, sizeof(hello), true) && memcmp(hello, RNND_SHM_HELLO, 8) == 0)
        r = data_bind(s, hello + 8, c->fd);
    if (r) {
        tv.tv_sec = 0; // bound: a client may stay idle between calls
        setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        uint64_t size = htole64(r->size);
        if (io_full(c->fd, &size, sizeof(size), false))
            data_serve(c->fd, r);
        rnnd_log(RNND_LOG_DEBUG, "shared memory: a socket region's data connection closed");
        data_unbind(s, r, c->fd);
    }
    pthread_mutex_lock(&s->lock);
    int fd = c->fd;
    c->fd = -1; // data_stop shuts down only open descriptors
    c->done = true;
    pthread_mutex_unlock(&s->lock);
    close(fd);
    return NULL;
}

// Joins the connections whose threads have finished, and takes them out. Not under the lock.
static void data_reap(struct rnnd_shm *s, bool all) {
    pthread_mutex_lock(&s->lock);
    struct conn *done[64];
    int nd = 0;
    for (int k = 0; k < s->nconns && nd < 64;) {
        struct conn *c = s->conns[k];
        if (c->done || all) {
            done[nd++] = c;
            s->conns[k] = s->conns[--s->nconns];
        } else {
            k++;
        }
    }
    pthread_mutex_unlock(&s->lock);
    for (int k = 0; k < nd; k++) {
        pthread_join(done[k]->thread, NULL);
        free(done[k]);
    }
}

static void *data_accept_main(void *arg) {
    struct rnnd_shm *s = arg;
    for (;;) {
        int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
        pthread_mutex_lock(&s->lock);
        bool stopping = s->stopping;
        pthread_mutex_unlock(&s->lock);
        if (stopping) {
            if (fd >= 0)
                close(fd);
            return NULL;
        }
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                usleep(10000); // out of descriptors or memory for now
            continue;
        }
        data_reap(s, false);
        struct conn *c = calloc(1, sizeof(*c));
        pthread_mutex_lock(&s->lock);
        bool room =
            c && !s->stopping && s->nconns < s->max * RNND_SHM_SOCKET_CONNS + RNND_SHM_PENDING;
        if (room) {
            *c = (struct conn){.fd = fd, .shm = s};
            s->conns[s->nconns++] = c;
            if (pthread_create(&c->thread, NULL, data_conn_main, c) != 0) {
                s->nconns--;
                room = false;
            }
        }
        pthread_mutex_unlock(&s->lock);
        if (!room) {
            free(c);
            close(fd);
            continue;
        }
        pthread_setname_np(c->thread, "rnnd-data");
    }
}

int rnnd_shm_listen(struct rnnd_shm *s, const char *addr, uint64_t max_bytes, char *err,
                    size_t errlen) {
    char host[256], port[16];
    if (s->max == 0 || rnnd_net_split(addr, host, sizeof(host), port, sizeof(port)) != 0)
        return errf(err, errlen, RNND_EINVAL,
                    "--data-listen %s: give HOST:PORT (and --max-shm-regions above 0)", addr);
    int fd = rnnd_net_listen(host, port, 64);
    if (fd < 0)
        return errf(err, errlen, RNND_EIO, "--data-listen %s: %s", addr, strerror(errno));
    struct sockaddr_storage sa;
    socklen_t len = sizeof(sa);
    getsockname(fd, (struct sockaddr *)&sa, &len);
    s->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                             : ((struct sockaddr_in *)&sa)->sin_port);
    s->conns = calloc((size_t)s->max * RNND_SHM_SOCKET_CONNS + RNND_SHM_PENDING, sizeof(*s->conns));
    s->sock_max = max_bytes;
    s->lfd = fd;
    if (s->conns == NULL || pthread_create(&s->acceptor, NULL, data_accept_main, s) != 0) {
        close(fd);
        s->lfd = -1;
        return errf(err, errlen, RNND_ENOMEM, "cannot start the data connections' thread");
    }
    pthread_setname_np(s->acceptor, "rnnd-data");
    return 0;
}

static void data_stop(struct rnnd_shm *s) {
    if (s->lfd < 0)
        return;
    pthread_mutex_lock(&s->lock);
    s->stopping = true;
    for (int k = 0; k < s->nconns; k++)
        if (s->conns[k]->fd >= 0)
            shutdown(s->conns[k]->fd, SHUT_RDWR);
    pthread_mutex_unlock(&s->lock);
    shutdown(s->lfd, SHUT_RDWR); // wakes accept4
    pthread_join(s->acceptor, NULL);
    close(s->lfd);
    s->lfd = -1;
    while (s->nconns > 0)
        data_reap(s, true);
}
