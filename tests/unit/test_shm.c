/*
 * test_shm.c: shared-memory regions (server/shm.c) without a daemon: this process plays the
 * client (a sealed, locked memfd with its key) and the daemon (the registry opens it through
 * /proc/self/fd). Covers who may register (peer on this host, the daemon's uid, the key, the
 * seal, the lock), how request spans resolve and what each bad one gets, how a reply is laid out
 * in a reply_region, and a region dropped once its client's lock is gone.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rnnd_kernels.h"
#include "shm.h"

#define SIZE 65536

// A client's region: a memfd of SIZE bytes, its key at offset 0, sealed and locked as asked.
struct creg {
    int fd;
    uint8_t *base;
    uint8_t key[RNND_SHM_KEY_BYTES];
};

static void creg_make(struct creg *r, bool seal, bool lock) {
    r->fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(r->fd >= 0);
    assert_int_equal(ftruncate(r->fd, SIZE), 0);
    if (seal)
        assert_int_equal(fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    if (lock)
        assert_int_equal(flock(r->fd, LOCK_SH), 0);
    r->base = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
    assert_true(r->base != MAP_FAILED);
    for (int i = 0; i < RNND_SHM_KEY_BYTES; i++)
        r->key[i] = (uint8_t)(i * 37 + 11);
    memcpy(r->base, r->key, sizeof r->key);
}

static void creg_free(struct creg *r) {
    munmap(r->base, SIZE);
    close(r->fd);
}

struct regreq {
    Rnnd__V1__RegisterRegionRequest req;
    Rnnd__V1__MemfdRegion m;
};

static Rnnd__V1__RegisterRegionRequest *regreq(struct regreq *q, unsigned pid, int fd,
                                               uint64_t size, uint8_t *key) {
    rnnd__v1__register_region_request__init(&q->req);
    rnnd__v1__memfd_region__init(&q->m);
    q->m.pid = pid;
    q->m.fd = fd;
    q->m.size = size;
    q->m.key.len = RNND_SHM_KEY_BYTES;
    q->m.key.data = key;
    q->req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_MEMFD;
    q->req.memfd = &q->m;
    return &q->req;
}

// Registers r; asserts success and returns the id.
static uint64_t reg_ok(struct rnnd_shm *s, struct creg *r) {
    struct regreq q;
    struct rnnd_shm_registered out;
    char err[512] = "";
    int rc = rnnd_shm_register(s, regreq(&q, (unsigned)getpid(), r->fd, SIZE, r->key), true, NULL,
                               NULL, &out, err, sizeof err);
    if (rc)
        fail_msg("register: %s", err);
    assert_int_equal(out.size, SIZE);
    assert_true(out.id != 0);
    assert_false(out.async);
    return out.id;
}

// Asserts that registering gives code and a message containing says.
static void reg_refused_be(struct rnnd_shm *s, Rnnd__V1__RegisterRegionRequest *req, bool local,
                           const struct rnnd_backend *be, int code, const char *says) {
    struct rnnd_shm_registered out;
    char err[512] = "";
    int rc = rnnd_shm_register(s, req, local, be, be, &out, err, sizeof err);
    if (rc != code || strstr(err, says) == NULL)
        fail_msg("want %d \"%s\", got %d \"%s\"", code, says, rc, err);
}

static void reg_refused(struct rnnd_shm *s, Rnnd__V1__RegisterRegionRequest *req, bool local,
                        int code, const char *says) {
    reg_refused_be(s, req, local, NULL, code, says);
}

static void test_peer_local(void **state) {
    (void)state;
    const char *local[] = {"unix:/run/rnnd.sock",
                           "unix:",
                           "ipv4:127.0.0.1:5000",
                           "ipv4:127.9.9.9:1",
                           "ipv6:[::1]:5000",
                           "ipv6:[::ffff:127.0.0.1]:80",
                           NULL};
    const char *remote[] = {"ipv4:10.0.0.5:5000",
                            "ipv4:192.0.2.2:1",
                            "ipv6:[fd00::2]:5000",
                            "ipv6:[::ffff:10.1.2.3]:80",
                            "ipv4:1.127.0.0:1",
                            "",
                            "unknown",
                            NULL};
    for (int i = 0; local[i]; i++)
        if (!rnnd_shm_peer_local(local[i]))
            fail_msg("%s is local", local[i]);
    for (int i = 0; remote[i]; i++)
        if (rnnd_shm_peer_local(remote[i]))
            fail_msg("%s is not local", remote[i]);
    assert_false(rnnd_shm_peer_local(NULL));
}

static void test_register_refusals(void **state) {
    (void)state;
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(2, &s), 0);
    struct creg r, unsealed, unlocked;
    creg_make(&r, true, true);
    creg_make(&unsealed, false, true);
    creg_make(&unlocked, true, false);
    struct regreq q;
    unsigned me = (unsigned)getpid();
    uint8_t wrong[RNND_SHM_KEY_BYTES];
    memcpy(wrong, r.key, sizeof wrong);
    wrong[RNND_SHM_KEY_BYTES - 1] ^= 1;

    reg_refused(s, regreq(&q, me, r.fd, SIZE, r.key), false, RNND_EPRECOND, "daemon's host");
    reg_refused(s, regreq(&q, me, r.fd, SIZE, wrong), true, RNND_EPRECOND, "key");
    reg_refused(s, regreq(&q, me, r.fd, SIZE / 2, r.key), true, RNND_EINVAL, "memfd.size");
    reg_refused(s, regreq(&q, me, unsealed.fd, SIZE, unsealed.key), true, RNND_EPRECOND,
                "F_SEAL_SHRINK");
    reg_refused(s, regreq(&q, me, unlocked.fd, SIZE, unlocked.key), true, RNND_EPRECOND, "LOCK_SH");
    reg_refused(s, regreq(&q, me, 9999, SIZE, r.key), true, RNND_EPRECOND, "no descriptor");
    int file = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    reg_refused(s, regreq(&q, me, file, SIZE, r.key), true, RNND_EPRECOND, "");
    close(file);
    q.m.key.len = 5;
    reg_refused(s, &q.req, true, RNND_EINVAL, "32");
    q.req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND__NOT_SET;
    reg_refused(s, &q.req, true, RNND_EINVAL, "memfd");

    // Two fit (--max-shm-regions 2); a third is refused until one is released.
    uint64_t a = reg_ok(s, &r), b = reg_ok(s, &r);
    assert_true(a != b);
    reg_refused(s, regreq(&q, me, r.fd, SIZE, r.key), true, RNND_EFULL, "--max-shm-regions");
    char err[512];
    assert_int_equal(rnnd_shm_release(s, a, true, err, sizeof err), 0);
    assert_int_equal(rnnd_shm_release(s, a, true, err, sizeof err), RNND_EPRECOND);
    reg_ok(s, &r);
    rnnd_shm_free(s);

    // Off.
    assert_int_equal(rnnd_shm_init(0, &s), 0);
    reg_refused(s, regreq(&q, me, r.fd, SIZE, r.key), true, RNND_EPRECOND, "--max-shm-regions 0");
    rnnd_shm_free(s);
    creg_free(&r);
    creg_free(&unsealed);
    creg_free(&unlocked);
}

// A region made by a process of another user, with its key in hand: refused all the same.
static void test_register_other_uid(void **state) {
    (void)state;
    if (geteuid() != 0)
        skip(); // only root can make a process of another user here
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        if (setgid(65534) != 0 || setuid(65534) != 0)
            _exit(1);
        struct creg r;
        creg_make(&r, true, true);
        int fd = r.fd;
        if (write(p[1], &fd, sizeof fd) != sizeof fd || write(p[1], r.key, sizeof r.key) < 0)
            _exit(1);
        pause(); // holds the region until killed
        _exit(0);
    }
    int fd;
    uint8_t key[RNND_SHM_KEY_BYTES];
    assert_int_equal(read(p[0], &fd, sizeof fd), sizeof fd);
    assert_int_equal(read(p[0], key, sizeof key), sizeof key);
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(4, &s), 0);
    struct regreq q;
    reg_refused(s, regreq(&q, (unsigned)child, fd, SIZE, key), true, RNND_EPRECOND,
                "belongs to uid 65534");
    rnnd_shm_free(s);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    close(p[0]);
    close(p[1]);
}

// A StepRequest whose obs [2, 4] FLOAT32 lies in region id at offset off.
struct stepreq {
    Rnnd__V1__StepRequest req;
    Rnnd__V1__Tensor obs;
    Rnnd__V1__RegionSpan span, reply;
    int64_t shape[2];
    uint64_t ids[2];
};

static struct stepreq *stepreq(struct stepreq *q, uint64_t id, uint64_t off) {
    rnnd__v1__step_request__init(&q->req);
    rnnd__v1__tensor__init(&q->obs);
    rnnd__v1__region_span__init(&q->span);
    rnnd__v1__region_span__init(&q->reply);
    q->ids[0] = 1;
    q->ids[1] = 2;
    q->req.n_env_ids = 2;
    q->req.env_ids = q->ids;
    q->shape[0] = 2;
    q->shape[1] = 4;
    q->obs.n_shape = 2;
    q->obs.shape = q->shape;
    q->obs.dtype = RNND__V1__DTYPE__FLOAT32;
    q->obs.region = &q->span;
    q->span.region = id;
    q->span.offset = off;
    q->span.nbytes = 32;
    q->req.obs = &q->obs;
    return q;
}

// Asserts resolving gives code with says in the message, and leaves the request as it was.
static void resolve_refused_dev(struct rnnd_shm *s, struct stepreq *q, bool local, unsigned dev_ok,
                                int code, const char *says) {
    uint8_t *data = q->obs.data.data;
    size_t len = q->obs.data.len;
    struct rnnd_shm_use *u = (void *)1;
    char err[512] = "";
    int rc = rnnd_shm_resolve(s, &q->req.base, local, dev_ok, &u, err, sizeof err);
    if (rc != code || strstr(err, says) == NULL)
        fail_msg("want %d \"%s\", got %d \"%s\"", code, says, rc, err);
    assert_null(u);
    assert_ptr_equal(q->obs.data.data, data);
    assert_int_equal(q->obs.data.len, len);
}

static void resolve_refused(struct rnnd_shm *s, struct stepreq *q, bool local, int code,
                            const char *says) {
    resolve_refused_dev(s, q, local, 0, code, says);
}

static void test_resolve(void **state) {
    (void)state;
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(4, &s), 0);
    struct creg r;
    creg_make(&r, true, true);
    uint64_t id = reg_ok(s, &r);
    struct stepreq q;

    // Not asked for: nothing to do.
    stepreq(&q, id, 128);
    assert_true(rnnd_shm_wanted(&q.req.base));
    q.obs.region = NULL;
    assert_false(rnnd_shm_wanted(&q.req.base));

    // Resolved: the tensor's data is the region's bytes, in place (the daemon's own mapping of
    // them: what the client writes there is what it reads); freed: as it was.
    stepreq(&q, id, 128);
    struct rnnd_shm_use *u;
    char err[512];
    assert_int_equal(rnnd_shm_resolve(s, &q.req.base, true, 0, &u, err, sizeof err), 0);
    assert_int_equal(q.obs.data.len, 32);
    r.base[128] = 7;
    assert_int_equal(((const uint8_t *)q.obs.data.data)[0], 7);
    r.base[128 + 31] = 9;
    assert_int_equal(((const uint8_t *)q.obs.data.data)[31], 9);
    rnnd_shm_use_free(u);
    assert_null(q.obs.data.data);
    assert_int_equal(q.obs.data.len, 0);

    resolve_refused(s, stepreq(&q, id, 128), false, RNND_EPRECOND, "daemon's host");
    resolve_refused(s, stepreq(&q, id ^ 1, 128), true, RNND_EPRECOND, "not registered");
    resolve_refused(s, stepreq(&q, id, SIZE - 16), true, RNND_EINVAL, "outside region");
    resolve_refused(s, stepreq(&q, id, UINT64_MAX - 8), true, RNND_EINVAL, "outside region");
    resolve_refused(s, stepreq(&q, id, 130), true, RNND_EINVAL, "multiple of 4");
    stepreq(&q, id, 128);
    q.span.nbytes = 28;
    resolve_refused(s, &q, true, RNND_EINVAL, "need 32");
    stepreq(&q, id, 128);
    uint8_t bytes[32] = {0};
    q.obs.data.data = bytes;
    q.obs.data.len = sizeof bytes;
    resolve_refused(s, &q, true, RNND_EINVAL, "both data and region");
    // The reply_region: inside the region, at a multiple of 64; an unknown one, like any span.
    stepreq(&q, id, 128);
    q.req.reply_region = &q.reply;
    q.reply.region = id;
    q.reply.offset = 192;
    q.reply.nbytes = SIZE;
    resolve_refused(s, &q, true, RNND_EINVAL, "reply_region: span");
    q.reply.nbytes = 64;
    q.reply.offset = 200;
    resolve_refused(s, &q, true, RNND_EINVAL, "multiple of 64");
    q.reply.offset = 192;
    q.reply.region = id + 1;
    resolve_refused(s, &q, true, RNND_EPRECOND, "reply_region: region");

    // Nested and repeated tensors are found too (Forward's trajectories, NamedTensor lists).
    Rnnd__V1__ForwardRequest fw = RNND__V1__FORWARD_REQUEST__INIT;
    Rnnd__V1__Trajectories tr = RNND__V1__TRAJECTORIES__INIT;
    stepreq(&q, id, 256);
    tr.obs = &q.obs;
    fw.source_case = RNND__V1__FORWARD_REQUEST__SOURCE_TRAJECTORIES;
    fw.trajectories = &tr;
    assert_int_equal(rnnd_shm_resolve(s, &fw.base, true, 0, &u, err, sizeof err), 0);
    r.base[256] = 3;
    assert_int_equal(((const uint8_t *)q.obs.data.data)[0], 3);
    rnnd_shm_use_free(u);
    Rnnd__V1__SetWeightsRequest sw = RNND__V1__SET_WEIGHTS_REQUEST__INIT;
    Rnnd__V1__NamedTensor nt = RNND__V1__NAMED_TENSOR__INIT, *ntp = &nt;
    nt.tensor = &q.obs;
    sw.n_tensors = 1;
    sw.tensors = &ntp;
    q.span.region = id ^ 1;
    assert_int_equal(rnnd_shm_resolve(s, &sw.base, true, 0, &u, err, sizeof err), RNND_EPRECOND);
    assert_non_null(strstr(err, "tensors[0].tensor"));

    // Released while a call still reads it: the mapping stays until the call lets go.
    stepreq(&q, id, 128);
    memset(r.base + 128, 0x5a, 32);
    assert_int_equal(rnnd_shm_resolve(s, &q.req.base, true, 0, &u, err, sizeof err), 0);
    assert_int_equal(rnnd_shm_release(s, id, true, err, sizeof err), 0);
    assert_int_equal(((const uint8_t *)q.obs.data.data)[31], 0x5a);
    rnnd_shm_use_free(u);
    resolve_refused(s, stepreq(&q, id, 128), true, RNND_EPRECOND, "not registered");

    rnnd_shm_free(s);
    creg_free(&r);
}

static void test_place(void **state) {
    (void)state;
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(4, &s), 0);
    struct creg r;
    creg_make(&r, true, true);
    uint64_t id = reg_ok(s, &r);
    struct stepreq q;
    stepreq(&q, id, 128);
    q.req.reply_region = &q.reply;
    q.reply.region = id;
    q.reply.offset = 1024;
    q.reply.nbytes = 192; // room for 100 bytes at 1024, then 64 more at 1152
    struct rnnd_shm_use *u;
    char err[512];
    assert_int_equal(rnnd_shm_resolve(s, &q.req.base, true, 0, &u, err, sizeof err), 0);

    // A reply of three tensors: 100 bytes, 64 bytes, 8 bytes. The third finds no room left.
    uint8_t a[100], b[64], c[8];
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    memset(c, 3, sizeof c);
    Rnnd__V1__StepReply rep = RNND__V1__STEP_REPLY__INIT;
    Rnnd__V1__Tensor ta = RNND__V1__TENSOR__INIT, tb = RNND__V1__TENSOR__INIT,
                     tc = RNND__V1__TENSOR__INIT;
    ta.data = (ProtobufCBinaryData){sizeof a, a};
    tb.data = (ProtobufCBinaryData){sizeof b, b};
    tc.data = (ProtobufCBinaryData){sizeof c, c};
    rep.output = &ta;
    rep.h = &tb;
    rep.c = &tc;
    assert_true(rnnd_shm_place(u, &rep.base));
    assert_null(ta.data.data);
    assert_non_null(ta.region);
    assert_int_equal(ta.region->region, id);
    assert_int_equal(ta.region->offset, 1024);
    assert_int_equal(ta.region->nbytes, 100);
    assert_int_equal(tb.region->offset, 1152);
    assert_null(tc.region);
    assert_ptr_equal(tc.data.data, c);
    assert_memory_equal(r.base + 1024, a, sizeof a);
    assert_memory_equal(r.base + 1152, b, sizeof b);
    rnnd_shm_unplace(u);
    assert_ptr_equal(ta.data.data, a);
    assert_ptr_equal(tb.data.data, b);
    assert_null(ta.region);
    assert_null(tb.region);
    rnnd_shm_use_free(u);

    // Without a reply_region nothing moves.
    stepreq(&q, id, 128);
    assert_int_equal(rnnd_shm_resolve(s, &q.req.base, true, 0, &u, err, sizeof err), 0);
    assert_false(rnnd_shm_place(u, &rep.base));
    assert_ptr_equal(ta.data.data, a);
    rnnd_shm_use_free(u);
    rnnd_shm_free(s);
    creg_free(&r);
}

// Once no process holds the memfd's lock, housekeeping drops the region.
static void test_client_gone(void **state) {
    (void)state;
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(4, &s), 0);
    struct creg r;
    creg_make(&r, true, true);
    uint64_t id = reg_ok(s, &r);
    assert_int_equal(rnnd_shm_housekeeping(s), 1);
    creg_free(&r); // the client's descriptor closes: its lock is gone
    assert_int_equal(rnnd_shm_housekeeping(s), 0);
    struct stepreq q;
    resolve_refused(s, stepreq(&q, id, 128), true, RNND_EPRECOND, "not registered");
    rnnd_shm_free(s);
}

// ---------------------------------------------------------------------------------------------
// CUDA regions, with a backend whose ipc_open maps host memory in place of the driver's: the
// "handle" carries the address and size of a buffer of this process. What is tested is the
// registry's side (checks, what a request may keep there, placing, closing), not CUDA IPC.

struct fake_ipc {
    int rc;       // what ipc_open answers when not 0
    int closed;   // ipc_close calls
    int event_rc; // what ipc_event answers
};

static struct fake_ipc fake;

static int fake_open(void *ctx, const void *handle, size_t handle_len, uint64_t offset,
                     uint64_t size, void *head, size_t head_len, void **base) {
    (void)ctx;
    if (fake.rc)
        return fake.rc;
    uint8_t *buf;
    uint64_t bytes;
    assert_int_equal(handle_len, 64);
    memcpy(&buf, handle, sizeof buf);
    memcpy(&bytes, (const uint8_t *)handle + 8, sizeof bytes);
    if (offset > bytes || size > bytes - offset)
        return RNND_EINVAL;
    memcpy(head, buf + offset, head_len);
    *base = buf + offset;
    return 0;
}

static void fake_close(void *ctx, void *base) {
    (void)ctx;
    (void)base;
    fake.closed++;
}

static int fake_event(void *ctx, void *handle, size_t handle_len) {
    (void)ctx;
    memset(handle, 0xe7, handle_len);
    return fake.event_rc;
}

static int fake_record(void *ctx) {
    (void)ctx;
    return 0;
}

static const struct rnnd_backend_ops fake_ops = {.name = "fake",
                                                 .ipc_open = fake_open,
                                                 .ipc_close = fake_close,
                                                 .ipc_event = fake_event,
                                                 .ipc_record = fake_record};
static const struct rnnd_backend fake_be = {.ops = &fake_ops, .device = "fake GPU"};
// A backend whose regions cannot answer early (the CPU backend has no CUDA regions at all).
static const struct rnnd_backend_ops fake_ops_sync = {
    .name = "fake", .ipc_open = fake_open, .ipc_close = fake_close};
static const struct rnnd_backend fake_be_sync = {.ops = &fake_ops_sync, .device = "fake GPU"};

struct cudareq {
    Rnnd__V1__RegisterRegionRequest req;
    Rnnd__V1__CudaRegion m;
    uint8_t handle[64];
};

static Rnnd__V1__RegisterRegionRequest *cudareq(struct cudareq *q, uint8_t *buf, uint64_t bytes,
                                                uint64_t offset, uint64_t size, uint8_t *key,
                                                unsigned pid) {
    rnnd__v1__register_region_request__init(&q->req);
    rnnd__v1__cuda_region__init(&q->m);
    memset(q->handle, 0, sizeof q->handle);
    memcpy(q->handle, &buf, sizeof buf);
    memcpy(q->handle + 8, &bytes, sizeof bytes);
    q->m.ipc_handle = (ProtobufCBinaryData){sizeof q->handle, q->handle};
    q->m.offset = offset;
    q->m.size = size;
    q->m.key = (ProtobufCBinaryData){RNND_SHM_KEY_BYTES, key};
    q->m.pid = pid;
    q->req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_CUDA;
    q->req.cuda = &q->m;
    return &q->req;
}

static void test_cuda_regions(void **state) {
    (void)state;
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(4, &s), 0);
    static uint8_t gpu[SIZE]; // the "device memory": the region starts at 4096
    uint8_t key[RNND_SHM_KEY_BYTES];
    for (int i = 0; i < RNND_SHM_KEY_BYTES; i++)
        key[i] = (uint8_t)(i * 13 + 5);
    memcpy(gpu + 4096, key, sizeof key);
    unsigned me = (unsigned)getpid();
    struct cudareq c;
    fake = (struct fake_ipc){0};

    // Refusals, each with what to do instead; nothing is opened.
    reg_refused(s, cudareq(&c, gpu, SIZE, 4096, 8192, key, me), true, RNND_EPRECOND,
                "one CUDA device");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4096, 8192, key, me), false, &fake_be, RNND_EPRECOND,
                   "daemon's host");
    cudareq(&c, gpu, SIZE, 4096, 8192, key, me);
    c.m.ipc_handle.len = 63;
    reg_refused_be(s, &c.req, true, &fake_be, RNND_EINVAL, "64 bytes");
    cudareq(&c, gpu, SIZE, 4096, 8192, key, me);
    c.m.key.len = 31;
    reg_refused_be(s, &c.req, true, &fake_be, RNND_EINVAL, "cuda.key has 31 bytes");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4096, 32, key, me), true, &fake_be, RNND_EINVAL,
                   "cuda.size 32 is not between");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4100, 8192, key, me), true, &fake_be, RNND_EINVAL,
                   "multiple of 64");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4096, SIZE, key, me), true, &fake_be, RNND_EINVAL,
                   "inside the exported allocation");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 0, 8192, key, me), true, &fake_be, RNND_EPRECOND,
                   "start with cuda.key");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4096, 8192, key, 0), true, &fake_be, RNND_EINVAL,
                   "cuda.pid");
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4096, 8192, key, 0x3fffffff), true, &fake_be,
                   RNND_EPRECOND, "not running here");
    fake.rc = RNND_EDEVICE;
    reg_refused_be(s, cudareq(&c, gpu, SIZE, 4096, 8192, key, me), true, &fake_be, RNND_EPRECOND,
                   "did not open");
    fake.rc = 0;
    assert_int_equal(fake.closed, 1); // the one opened with the wrong key

    // A child plays the client, so that its exit can be watched.
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        pause();
        _exit(0);
    }
    struct rnnd_shm_registered out;
    char err[512] = "";
    int rc = rnnd_shm_register(s, cudareq(&c, gpu, SIZE, 4096, 8192, key, (unsigned)child), true,
                               &fake_be, &fake_be, &out, err, sizeof err);
    if (rc)
        fail_msg("register: %s", err);
    assert_int_equal(out.size, 8192);
    assert_false(out.async); // not asked for
    uint64_t cid = out.id;

    // Only where dev_ok allows, never mixed with a memfd region.
    struct stepreq q;
    resolve_refused(s, stepreq(&q, cid, 128), true, RNND_EINVAL, "CUDA region carries");
    struct rnnd_shm_use *u;
    stepreq(&q, cid, 128);
    assert_int_equal(
        rnnd_shm_resolve(s, &q.req.base, true, RNND_SHM_DEV_TENSORS, &u, err, sizeof err), 0);
    assert_true(rnnd_shm_use_device_in(u));
    assert_ptr_equal(q.obs.data.data, gpu + 4096 + 128);
    size_t len = 0;
    assert_null(rnnd_shm_use_device_reply(u, &len));
    rnnd_shm_use_free(u);
    struct creg r;
    creg_make(&r, true, true);
    uint64_t mid = reg_ok(s, &r);
    Rnnd__V1__BackwardRequest bw = RNND__V1__BACKWARD_REQUEST__INIT;
    struct stepreq q2;
    stepreq(&q, cid, 128);
    stepreq(&q2, mid, 128);
    bw.grad_output = &q.obs;
    bw.grad_h_n = &q2.obs;
    assert_int_equal(rnnd_shm_resolve(s, &bw.base, true, RNND_SHM_DEV_TENSORS, &u, err, sizeof err),
                     RNND_EINVAL);
    assert_non_null(strstr(err, "both a CUDA and a memfd region"));
    assert_ptr_equal(q.obs.data.data, NULL);

    // A CUDA reply_region: the engine's outputs inside it are placed where they are; anything
    // else travels as bytes (the daemon does not copy host memory into the GPU's).
    stepreq(&q, mid, 128);
    q.req.reply_region = &q.reply;
    q.reply.region = cid;
    q.reply.offset = 1024;
    q.reply.nbytes = 1024;
    resolve_refused_dev(s, &q, true, RNND_SHM_DEV_TENSORS, RNND_EINVAL, "CUDA region carries");
    assert_int_equal(
        rnnd_shm_resolve(s, &q.req.base, true, RNND_SHM_DEV_REPLY, &u, err, sizeof err), 0);
    assert_false(rnnd_shm_use_device_in(u));
    char *dev = rnnd_shm_use_device_reply(u, &len);
    assert_ptr_equal(dev, gpu + 4096 + 1024);
    assert_int_equal(len, 1024);
    assert_false(rnnd_shm_use_async(u));
    uint8_t host[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    Rnnd__V1__StepReply rep = RNND__V1__STEP_REPLY__INIT;
    Rnnd__V1__Tensor ta = RNND__V1__TENSOR__INIT, tb = RNND__V1__TENSOR__INIT;
    ta.data = (ProtobufCBinaryData){256, (uint8_t *)dev + 192};
    tb.data = (ProtobufCBinaryData){sizeof host, host};
    rep.output = &ta;
    rep.h = &tb;
    memset(gpu + 4096 + 1024, 0, 1024);
    assert_true(rnnd_shm_place(u, &rep.base));
    assert_non_null(ta.region);
    assert_int_equal(ta.region->region, cid);
    assert_int_equal(ta.region->offset, 1024 + 192);
    assert_int_equal(ta.region->nbytes, 256);
    assert_null(tb.region);
    assert_ptr_equal(tb.data.data, host);
    for (int i = 0; i < 1024; i++)
        assert_int_equal(gpu[4096 + 1024 + i], 0); // nothing was written by placing
    rnnd_shm_unplace(u);
    assert_ptr_equal(ta.data.data, dev + 192);
    rnnd_shm_use_free(u);

    // The client exits: housekeeping closes its region.
    assert_int_equal(rnnd_shm_housekeeping(s), 2);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    assert_int_equal(rnnd_shm_housekeeping(s), 1);
    assert_int_equal(fake.closed, 2);
    resolve_refused(s, stepreq(&q, cid, 128), true, RNND_EPRECOND, "not registered");
    rnnd_shm_free(s);
    creg_free(&r);
}

// Async replies (CudaRegion.async_replies): granted with the backend's event handle where the
// backend can share one, else the region answers once the work is done, as without them; only a
// reply_region in a granted region says so.
static void test_cuda_async_replies(void **state) {
    (void)state;
    struct rnnd_shm *s;
    assert_int_equal(rnnd_shm_init(4, &s), 0);
    static uint8_t gpu[SIZE];
    uint8_t key[RNND_SHM_KEY_BYTES];
    memset(key, 0x5a, sizeof key);
    memcpy(gpu, key, sizeof key);
    unsigned me = (unsigned)getpid();
    fake = (struct fake_ipc){0};
    struct cudareq c;
    struct rnnd_shm_registered out;
    char err[512] = "";
    const struct rnnd_backend *bes[3] = {&fake_be, &fake_be, &fake_be_sync};
    const int event_rc[3] = {0, RNND_ENOTSUP, 0};
    uint64_t ids[3];
    for (int k = 0; k < 3; k++) {
        fake.event_rc = event_rc[k];
        cudareq(&c, gpu, SIZE, 0, 4096, key, me);
        c.m.async_replies = true;
        if (rnnd_shm_register(s, &c.req, true, bes[k], bes[k], &out, err, sizeof err) != 0)
            fail_msg("register: %s", err);
        ids[k] = out.id;
        assert_int_equal(out.async, k == 0);
        if (k == 0)
            for (int i = 0; i < RNND_SHM_EVENT_BYTES; i++)
                assert_int_equal(out.event[i], 0xe7);
    }
    struct creg r;
    creg_make(&r, true, true);
    uint64_t mid = reg_ok(s, &r);
    for (int k = 0; k < 3; k++) {
        struct stepreq q;
        struct rnnd_shm_use *u;
        stepreq(&q, mid, 128);
        q.req.reply_region = &q.reply;
        q.reply.region = ids[k];
        q.reply.offset = 1024;
        q.reply.nbytes = 1024;
        assert_int_equal(
            rnnd_shm_resolve(s, &q.req.base, true, RNND_SHM_DEV_REPLY, &u, err, sizeof err), 0);
        assert_int_equal(rnnd_shm_use_async(u), k == 0);
        rnnd_shm_use_free(u);
    }
    assert_false(rnnd_shm_use_async(NULL));
    rnnd_shm_free(s);
    creg_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_local),
        cmocka_unit_test(test_register_refusals),
        cmocka_unit_test(test_register_other_uid),
        cmocka_unit_test(test_resolve),
        cmocka_unit_test(test_place),
        cmocka_unit_test(test_client_gone),
        cmocka_unit_test(test_cuda_regions),
        cmocka_unit_test(test_cuda_async_replies),
    };
    return cmocka_run_group_tests_name("shm", tests, NULL, NULL);
}
