/*
 * test_shm.c: same-host paths. --listen with several addresses (TCP and unix: sockets, the
 * socket's file mode, tokens checked on it, a socket another daemon holds), and shared memory:
 * Step, StepStream, Forward (explicit and recorded) and Backward through a region give the bytes
 * path's results bit for bit, replies really land in the region, every descriptor that does not
 * resolve is refused with nothing changed, and a region goes with its client. Socket regions:
 * Step through one from loopback and from a remote peer, its four data connections (a fifth
 * refused, one closing ending the region), the refusals (a wrong key, a frame outside the
 * region), ReleaseRegion closing the connection, --max-socket-region-mb and --data-listen off.
 *
 * One daemon (LSTM L=2 with extras, a token) listening on loopback and on a unix socket; others
 * started by single tests. Regions for the raw-message cases are made here (a sealed, locked
 * memfd with its key), as a client would.
 */
#include "harness.h"
#include "place.h"

#include <errno.h>
#include <fcntl.h>
#include <grpc/status.h>
#include <ifaddrs.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "rnnd/v1/rnnd.pb-c.h"

#define I_    8
#define H_    16
#define L_    2
#define E_    3
#define TOKEN "shm-test-token"

static struct daemon d;
static char sock_dir[64], sock_path[128], token_file[128];

static int setup(void **state) {
    (void)state;
    snprintf(sock_dir, sizeof sock_dir, "/tmp/rnnd-sock-XXXXXX");
    if (!mkdtemp(sock_dir))
        return -1;
    snprintf(sock_path, sizeof sock_path, "%s/rnnd.sock", sock_dir);
    snprintf(token_file, sizeof token_file, "%s/token", sock_dir);
    FILE *f = fopen(token_file, "w");
    if (!f)
        return -1;
    fprintf(f, "%s\n", TOKEN);
    fclose(f);
    chmod(token_file, 0600);
    char listen[160];
    snprintf(listen, sizeof listen, "unix:%s", sock_path);
    const char *args[] = {"--listen",
                          listen,
                          "--auth-token-file",
                          token_file,
                          "--cell",
                          "lstm",
                          "--input-size",
                          "8",
                          "--hidden-size",
                          "16",
                          "--layers",
                          "2",
                          "--extras-size",
                          "3",
                          "--seed",
                          "5",
                          NULL};
    return daemon_start(&d, args);
}

static int teardown(void **state) {
    (void)state;
    daemon_free(&d);
    unlink(token_file);
    unlink(sock_path);
    rmdir(sock_dir);
    return 0;
}

static struct rnnd_client *client_to(const char *target, const char *token) {
    struct rnnd_client_opts o = {.target = target, .token = token, .timeout_ms = 20000};
    struct rnnd_client *c = NULL;
    assert_int_equal(rnnd_client_init(&o, &c), 0);
    return c;
}

// A unix-socket client whose messages may not exceed max_bytes either way.
static struct rnnd_client *unix_client_small(const char *token, int64_t max_bytes) {
    char target[160];
    snprintf(target, sizeof target, "unix:%s", sock_path);
    struct rnnd_client_opts o = {
        .target = target, .token = token, .timeout_ms = 20000, .max_message_bytes = max_bytes};
    struct rnnd_client *c = NULL;
    assert_int_equal(rnnd_client_init(&o, &c), 0);
    return c;
}

static struct rnnd_client *unix_client(const char *token) {
    char target[160];
    snprintf(target, sizeof target, "unix:%s", sock_path);
    return client_to(target, token);
}

static bool bits_equal(const char *what, const struct rnnd_tensor *a, const struct rnnd_tensor *b) {
    if (a->present != b->present || a->nbytes != b->nbytes || a->dtype != b->dtype ||
        a->ndim != b->ndim || (a->nbytes && memcmp(a->data, b->data, a->nbytes) != 0)) {
        fprintf(stderr, "%s differs (present %d/%d, %zu/%zu bytes)\n", what, a->present, b->present,
                a->nbytes, b->nbytes);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Listening.

static void test_unix_socket_and_token(void **state) {
    (void)state;
    // The ready line names every address; grpc= stays the first.
    char want[200];
    snprintf(want, sizeof want, ",unix:%s", sock_path);
    if (!strstr(d.ready_line, want) || !strstr(d.ready_line, "listen=127.0.0.1:"))
        fail_msg("ready line: %s", d.ready_line);
    assert_non_null(strstr(d.ready_line, "rnnd ready grpc=127.0.0.1:"));
    struct stat st;
    assert_int_equal(lstat(sock_path, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0600);

    // The token is checked on the socket as on TCP; health needs none.
    struct rnnd_client *anon = unix_client(NULL);
    struct rnnd_model_info info;
    EXPECT_STATUS(rnnd_client_info(anon, &info), GRPC_STATUS_UNAUTHENTICATED);
    int hs = 0;
    EXPECT_OK(rnnd_client_health(anon, "", &hs));
    assert_int_equal(hs, 1);
    rnnd_client_free(anon);
    struct rnnd_client *wrong = unix_client("not-the-token");
    EXPECT_STATUS(rnnd_client_info(wrong, &info), GRPC_STATUS_UNAUTHENTICATED);
    rnnd_client_free(wrong);

    // One daemon behind both: an env stepped over TCP goes on over the socket.
    struct rnnd_client *u = unix_client(TOKEN), *t = daemon_client(&d, TOKEN);
    EXPECT_OK(rnnd_client_info(u, &info));
    assert_int_equal(info.hidden_size, H_);
    uint64_t id = 77;
    float x[I_] = {0.5f};
    bool init = true;
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &id,
                                .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &init};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(t, &req, &r));
    rnnd_step_reply_free(&r);
    init = false; // needs the state the TCP step left
    EXPECT_OK(rnnd_client_step(u, &req, &r));
    rnnd_step_reply_free(&r);
    rnnd_client_free(u);
    rnnd_client_free(t);

    // A second daemon on the same socket is refused (the first keeps it), as on a TCP port.
    char listen[160];
    snprintf(listen, sizeof listen, "unix:%s", sock_path);
    const char *argv[] = {rnnd_bin(), "--backend",    "cpu", "--listen",      listen, "--http",
                          "off",      "--input-size", "8",   "--hidden-size", "16",   NULL};
    char *out = NULL;
    int status = run_capture(argv, 20000, &out);
    if (status == 0 || !out || !strstr(out, "another process listens there"))
        fail_msg("second daemon: status %d: %s", status, out ? out : "");
    free(out);
    assert_int_equal(lstat(sock_path, &st), 0);
}

static void test_several_addresses(void **state) {
    (void)state;
    char a[160], b[160], list[340];
    snprintf(a, sizeof a, "%s/a.sock", sock_dir);
    snprintf(b, sizeof b, "%s/b.sock", sock_dir);
    // A stale socket file (its daemon gone) is replaced.
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%.100s", b);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    close(fd);
    snprintf(list, sizeof list, "127.0.0.1:0,unix:%s", a);
    char lb[170];
    snprintf(lb, sizeof lb, "unix:%s", b);
    const char *args[] = {
        "--listen",      list, "--listen", lb, "--listen-unix-mode", "0660", "--input-size", "8",
        "--hidden-size", "16", NULL};
    struct daemon d2;
    assert_int_equal(daemon_start(&d2, args), 0);
    // Harness's 127.0.0.1:0 first, then the list, then the repeated flag's address.
    char listen[256] = "";
    const char *p = strstr(d2.ready_line, "listen=");
    assert_non_null(p);
    sscanf(p + 7, "%255s", listen);
    char *addr[8];
    int n = 0;
    for (char *tok = strtok(listen, ","); tok && n < 8; tok = strtok(NULL, ","))
        addr[n++] = tok;
    assert_int_equal(n, 4);
    assert_string_equal(addr[0], d2.grpc);
    assert_true(strncmp(addr[1], "127.0.0.1:", 10) == 0);
    assert_string_not_equal(addr[1], addr[0]); // two free ports
    assert_string_equal(addr[2] + 5, a);
    assert_string_equal(addr[3] + 5, b);
    struct stat st;
    assert_int_equal(lstat(a, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0660);
    // Every address serves.
    for (int i = 0; i < n; i++) {
        struct rnnd_client *c = client_to(addr[i], NULL);
        struct rnnd_model_info info;
        EXPECT_OK(rnnd_client_info(c, &info));
        assert_int_equal(info.input_size, I_);
        rnnd_client_free(c);
    }
    // A clean stop removes the socket files.
    assert_int_equal(daemon_signal_wait(&d2, SIGTERM, 20000), 0);
    assert_true(lstat(a, &st) != 0 && lstat(b, &st) != 0);
    daemon_free(&d2);
}

// ---------------------------------------------------------------------------------------------
// Shared memory through the C client: the same bits as bytes.

static void fill(struct rng *g, float *v, size_t n) {
    rng_fill(g, v, n);
}

static void test_shm_equals_bytes(void **state) {
    (void)state;
    // The shared-memory client's messages are capped at 2 KiB: the tensors below (a Backward's
    // gradients alone are 20 KiB) get through only outside the messages.
    struct rnnd_client *s = unix_client_small(TOKEN, 2048), *b = daemon_client(&d, TOKEN);
    assert_string_equal(rnnd_client_transport(s), "grpc");
    EXPECT_OK(rnnd_client_shm_start(s, 1 << 20));
    assert_string_equal(rnnd_client_transport(s), "shm");
    assert_string_equal(rnnd_client_transport(b), "grpc");
    struct rng g = {91};

    // Step (with state and extras), three steps of 5 envs each way: envs 1000+ over shared
    // memory, 2000+ as bytes, each on the device (engine) of its counterpart, so that on
    // several a Forward runs the same rows on each both ways (BLAS may round a product of
    // another number of rows otherwise).
    enum { B = 5 };
    uint64_t ids_s[B], ids_b[B], next = 2000;
    int ndev = 1;
    for (const char *p = harness_devices(); p && *p; p++)
        ndev += *p == ',';
    for (int k = 0; k < B; k++) {
        ids_s[k] = 1000 + (uint64_t)k;
        while (rnnd_place(next, ndev, 1) != rnnd_place(ids_s[k], ndev, 1))
            next++;
        ids_b[k] = next++;
    }
    for (int t = 0; t < 3; t++) {
        float x[B * I_], e[B * E_];
        bool init[B];
        fill(&g, x, B * I_);
        fill(&g, e, B * E_);
        for (int k = 0; k < B; k++)
            init[k] = t == 0 || k == t;
        struct rnnd_step_req req = {.n_env_ids = B,
                                    .obs = rnnd_tensor_f32(x, 2, B, I_, 0, 0),
                                    .n_is_init = B,
                                    .is_init = init,
                                    .extras = rnnd_tensor_f32(e, 2, B, E_, 0, 0),
                                    .return_state = true};
        struct rnnd_step_reply rs, rb;
        req.env_ids = ids_s;
        EXPECT_OK(rnnd_client_step(s, &req, &rs));
        req.env_ids = ids_b;
        EXPECT_OK(rnnd_client_step(b, &req, &rb));
        assert_true(bits_equal("step output", &rs.output, &rb.output));
        assert_true(bits_equal("step h", &rs.h, &rb.h));
        assert_true(bits_equal("step c", &rs.c, &rb.c));
        assert_tensor_f32(&rs.output, 2, B, H_, 0, 0);
        rnnd_step_reply_free(&rs);
        rnnd_step_reply_free(&rb);
    }

    // StepStream with two requests in flight, one stream each way, one after the other (a
    // batch's rows must be the same both ways for the same bits).
    float x2[2][B * I_];
    fill(&g, x2[0], B * I_);
    fill(&g, x2[1], B * I_);
    struct rnnd_step_reply sr[2][2];
    for (int way = 0; way < 2; way++) {
        struct rnnd_client_stream *st;
        EXPECT_OK(rnnd_client_stream_init(way ? b : s, &st));
        for (int k = 0; k < 2; k++) {
            struct rnnd_step_req req = {.n_env_ids = B,
                                        .env_ids = way ? ids_b : ids_s,
                                        .obs = rnnd_tensor_f32(x2[k], 2, B, I_, 0, 0)};
            EXPECT_OK(rnnd_client_stream_send(st, &req));
        }
        for (int k = 0; k < 2; k++)
            EXPECT_OK(rnnd_client_stream_recv(st, &sr[way][k]));
        EXPECT_OK(rnnd_client_stream_close(st));
        rnnd_client_stream_free(st);
    }
    for (int k = 0; k < 2; k++) {
        assert_true(bits_equal("stream output", &sr[0][k].output, &sr[1][k].output));
        rnnd_step_reply_free(&sr[0][k]);
        rnnd_step_reply_free(&sr[1][k]);
    }

    // Forward over the recorded steps: obs, is_init, extras and versions come back too.
    struct rnnd_forward_req fr = {.recorded = true, .n_env_ids = B, .steps = 4};
    struct rnnd_forward_reply fs, fb;
    fr.env_ids = ids_s;
    EXPECT_OK(rnnd_client_forward(s, &fr, &fs));
    fr.env_ids = ids_b;
    EXPECT_OK(rnnd_client_forward(b, &fr, &fb));
    assert_true(bits_equal("recorded output", &fs.output, &fb.output));
    assert_true(bits_equal("recorded h_n", &fs.h_n, &fb.h_n));
    assert_true(bits_equal("recorded c_n", &fs.c_n, &fb.c_n));
    assert_true(bits_equal("recorded obs", &fs.obs, &fb.obs));
    assert_true(bits_equal("recorded is_init", &fs.is_init, &fb.is_init));
    assert_true(bits_equal("recorded extras", &fs.extras, &fb.extras));
    assert_true(bits_equal("recorded versions", &fs.step_model_version, &fb.step_model_version));
    rnnd_forward_reply_free(&fs);
    rnnd_forward_reply_free(&fb);

    // Forward over explicit trajectories with h0/c0 and resets, kept for Backward.
    enum { FB = 3, T = 6 };
    float obs[FB * T * I_], h0[FB * L_ * H_], c0[FB * L_ * H_];
    bool ini[FB * T] = {false};
    ini[1 * T + 3] = true;
    fill(&g, obs, sizeof obs / 4);
    fill(&g, h0, sizeof h0 / 4);
    fill(&g, c0, sizeof c0 / 4);
    int64_t bt[2] = {FB, T};
    struct rnnd_forward_req tr = {.obs = rnnd_tensor_f32(obs, 3, FB, T, I_, 0),
                                  .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, ini, 2, bt),
                                  .h0 = rnnd_tensor_f32(h0, 3, FB, L_, H_, 0),
                                  .c0 = rnnd_tensor_f32(c0, 3, FB, L_, H_, 0),
                                  .keep_tape = true};
    EXPECT_OK(rnnd_client_forward(s, &tr, &fs));
    EXPECT_OK(rnnd_client_forward(b, &tr, &fb));
    assert_true(bits_equal("forward output", &fs.output, &fb.output));
    assert_true(bits_equal("forward h_n", &fs.h_n, &fb.h_n));
    assert_true(bits_equal("forward c_n", &fs.c_n, &fb.c_n));

    // Backward on each tape: weight gradients by name, grad_obs, grad_h0, grad_c0.
    float go[FB * T * H_], gh[FB * L_ * H_];
    fill(&g, go, sizeof go / 4);
    fill(&g, gh, sizeof gh / 4);
    struct rnnd_backward_req br = {.grad_output = rnnd_tensor_f32(go, 3, FB, T, H_, 0),
                                   .grad_h_n = rnnd_tensor_f32(gh, 3, FB, L_, H_, 0)};
    struct rnnd_backward_reply bs, bb;
    br.tape_id = fs.tape_id;
    EXPECT_OK(rnnd_client_backward(s, &br, &bs));
    br.tape_id = fb.tape_id;
    EXPECT_OK(rnnd_client_backward(b, &br, &bb));
    assert_int_equal(bs.grads.n, 4 * L_);
    assert_int_equal(bs.grads.n, bb.grads.n);
    for (size_t k = 0; k < bs.grads.n; k++) {
        assert_string_equal(bs.grads.v[k].name, bb.grads.v[k].name);
        assert_true(bits_equal(bs.grads.v[k].name, &bs.grads.v[k].tensor, &bb.grads.v[k].tensor));
    }
    assert_true(bits_equal("grad_obs", &bs.grad_obs, &bb.grad_obs));
    assert_true(bits_equal("grad_h0", &bs.grad_h0, &bb.grad_h0));
    assert_true(bits_equal("grad_c0", &bs.grad_c0, &bb.grad_c0));
    rnnd_backward_reply_free(&bs);
    rnnd_backward_reply_free(&bb);
    rnnd_forward_reply_free(&fs);
    rnnd_forward_reply_free(&fb);
    rnnd_client_free(s);
    rnnd_client_free(b);
}

// rnndctl bench --shm: each connection through its own region.
// In float32 and bfloat16: the bench counts a reply in another dtype as an error.
static void test_rnndctl_bench_shm(void **state) {
    (void)state;
    char target[160];
    snprintf(target, sizeof target, "unix:%s", sock_path);
    const char *dtypes[] = {"float32", "bfloat16"};
    for (int k = 0; k < 2; k++) {
        const char *argv[] = {rnndctl_bin(), "-t",       target,  "--token-file",
                              token_file,    "bench",    "--shm", "--connections",
                              "2",           "--envs",   "8",     "--duration",
                              "0.3",         "--warmup", "0",     "--no-floor",
                              "--dtype",     dtypes[k],  NULL};
        char *out = NULL;
        int status = run_capture(argv, 30000, &out);
        if (status != 0 || !out || !strstr(out, "through shared memory") ||
            !strstr(out, dtypes[k]) || !strstr(out, "errors 0"))
            fail_msg("rnndctl bench --shm --dtype %s: status %d: %s", dtypes[k], status,
                     out ? out : "");
        free(out);
    }
}

// ---------------------------------------------------------------------------------------------
// Raw messages: regions made here, requests built by hand.

#define RSIZE (1 << 16)

struct region {
    int fd;
    uint8_t *base;
    uint64_t id;
    uint8_t key[32];
};

// Sends msg to method and unpacks the reply as rd into *out (NULL on failure): 0 or the code.
static int raw(struct rnnd_client *c, const char *method, const ProtobufCMessage *msg,
               const ProtobufCMessageDescriptor *rd, ProtobufCMessage **out) {
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n + 1);
    protobuf_c_message_pack(msg, buf);
    void *rep = NULL;
    size_t rlen = 0;
    int err = rnnd_client_call_raw(c, method, buf, n, &rep, &rlen);
    free(buf);
    *out = NULL;
    if (err == 0) {
        *out = protobuf_c_message_unpack(rd, NULL, rlen, rep);
        assert_non_null(*out);
    }
    free(rep);
    return err;
}

// A client's region: made, then registered through c (0 or the code).
static int region_open(struct rnnd_client *c, struct region *r) {
    r->fd = memfd_create("test-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(r->fd >= 0);
    assert_int_equal(ftruncate(r->fd, RSIZE), 0);
    assert_int_equal(fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    assert_int_equal(flock(r->fd, LOCK_SH), 0);
    r->base = mmap(NULL, RSIZE, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
    assert_true(r->base != MAP_FAILED);
    assert_int_equal(getrandom(r->key, 32, 0), 32);
    memcpy(r->base, r->key, 32);
    Rnnd__V1__MemfdRegion m = RNND__V1__MEMFD_REGION__INIT;
    m.pid = (uint32_t)getpid();
    m.fd = r->fd;
    m.size = RSIZE;
    m.key = (ProtobufCBinaryData){32, r->key};
    Rnnd__V1__RegisterRegionRequest req = RNND__V1__REGISTER_REGION_REQUEST__INIT;
    req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_MEMFD;
    req.memfd = &m;
    ProtobufCMessage *out;
    int err = raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                  &rnnd__v1__register_region_reply__descriptor, &out);
    r->id = err ? 0 : ((Rnnd__V1__RegisterRegionReply *)out)->region;
    if (out)
        protobuf_c_message_free_unpacked(out, NULL);
    return err;
}

static void region_close(struct region *r) {
    munmap(r->base, RSIZE);
    close(r->fd);
}

// A Step of one env with obs [1, I] at `off` of region id (written there from x), is_init.
struct step_msg {
    Rnnd__V1__StepRequest req;
    Rnnd__V1__Tensor obs;
    Rnnd__V1__RegionSpan span, reply;
    int64_t shape[2];
    uint64_t id;
    protobuf_c_boolean init;
};

static Rnnd__V1__StepRequest *step_msg(struct step_msg *m, uint64_t env, bool init,
                                       struct region *r, uint64_t off, const float *x) {
    rnnd__v1__step_request__init(&m->req);
    rnnd__v1__tensor__init(&m->obs);
    rnnd__v1__region_span__init(&m->span);
    rnnd__v1__region_span__init(&m->reply);
    m->id = env;
    m->init = init;
    m->req.n_env_ids = 1;
    m->req.env_ids = &m->id;
    m->req.n_is_init = 1;
    m->req.is_init = &m->init;
    m->shape[0] = 1;
    m->shape[1] = I_;
    m->obs.n_shape = 2;
    m->obs.shape = m->shape;
    m->obs.dtype = RNND__V1__DTYPE__FLOAT32;
    m->obs.region = &m->span;
    m->span.region = r->id;
    m->span.offset = off;
    m->span.nbytes = I_ * 4;
    if (off + I_ * 4 <= RSIZE)
        memcpy(r->base + off, x, I_ * 4);
    m->req.obs = &m->obs;
    m->req.reply_region = &m->reply;
    m->reply.region = r->id;
    m->reply.offset = 4096;
    m->reply.nbytes = 4096;
    return &m->req;
}

// A Step of one env as bytes; its output in out (H floats) unless NULL; 0 or the code.
static int step_bytes(struct rnnd_client *c, uint64_t env, bool init, const float *x, float *out) {
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &env,
                                .obs = rnnd_tensor_f32((float *)x, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &init};
    struct rnnd_step_reply r;
    int err = rnnd_client_step(c, &req, &r);
    if (err == 0 && out)
        memcpy(out, r.output.data, H_ * 4);
    rnnd_step_reply_free(&r);
    return err;
}

static int step_raw(struct rnnd_client *c, struct step_msg *m, Rnnd__V1__StepReply **out) {
    return raw(c, "/rnnd.v1.Rnn/Step", &m->req.base, &rnnd__v1__step_reply__descriptor,
               (ProtobufCMessage **)out);
}

static void test_reply_in_region(void **state) {
    (void)state;
    struct rnnd_client *c = unix_client(TOKEN);
    struct region r;
    EXPECT_OK(region_open(c, &r));
    float x[I_], want[H_];
    struct rng g = {17};
    fill(&g, x, I_);
    EXPECT_OK(step_bytes(c, 3001, true, x, want));
    struct step_msg m;
    step_msg(&m, 3002, true, &r, 128, x);
    Rnnd__V1__StepReply *rep;
    EXPECT_OK(step_raw(c, &m, &rep));
    // The output came back as a span into the reply_region, not as bytes.
    assert_non_null(rep->output);
    assert_int_equal(rep->output->data.len, 0);
    assert_non_null(rep->output->region);
    assert_int_equal(rep->output->region->region, r.id);
    assert_int_equal(rep->output->region->offset, 4096);
    assert_int_equal(rep->output->region->nbytes, H_ * 4);
    assert_memory_equal(r.base + 4096, want, H_ * 4);
    protobuf_c_message_free_unpacked(&rep->base, NULL);
    // A reply_region too small for the output: it comes back as bytes.
    step_msg(&m, 3003, true, &r, 128, x);
    m.reply.nbytes = 32;
    EXPECT_OK(step_raw(c, &m, &rep));
    assert_null(rep->output->region);
    assert_int_equal(rep->output->data.len, H_ * 4);
    assert_memory_equal(rep->output->data.data, want, H_ * 4);
    protobuf_c_message_free_unpacked(&rep->base, NULL);
    region_close(&r);
    rnnd_client_free(c);
}

// Each descriptor that does not resolve is refused, and the env it named is as it was: an env
// never stepped still has no state, one stepped before goes on as a twin that saw no refusal.
static void test_bad_descriptors(void **state) {
    (void)state;
    struct rnnd_client *c = unix_client(TOKEN);
    struct region r, gone;
    EXPECT_OK(region_open(c, &r));
    EXPECT_OK(region_open(c, &gone));
    float x[I_], o1[H_], o2[H_];
    struct rng g = {23};
    fill(&g, x, I_);
    // The twins: 4001 sees the refusals, 4002 does not.
    EXPECT_OK(step_bytes(c, 4001, true, x, NULL));
    EXPECT_OK(step_bytes(c, 4002, true, x, NULL));
    {
        Rnnd__V1__ReleaseRegionRequest rr = RNND__V1__RELEASE_REGION_REQUEST__INIT;
        rr.region = gone.id;
        ProtobufCMessage *out;
        EXPECT_OK(raw(c, "/rnnd.v1.Rnn/ReleaseRegion", &rr.base,
                      &rnnd__v1__release_region_reply__descriptor, &out));
        protobuf_c_message_free_unpacked(out, NULL);
        // Released twice: it is no longer there.
        EXPECT_STATUS(raw(c, "/rnnd.v1.Rnn/ReleaseRegion", &rr.base,
                          &rnnd__v1__release_region_reply__descriptor, &out),
                      GRPC_STATUS_FAILED_PRECONDITION);
    }
    struct {
        const char *what;
        int status;
        const char *says;
    } cases[] = {
        {"unknown region", GRPC_STATUS_FAILED_PRECONDITION, "not registered"},
        {"released region", GRPC_STATUS_FAILED_PRECONDITION, "not registered"},
        {"past the end", GRPC_STATUS_INVALID_ARGUMENT, "outside region"},
        {"offset overflows", GRPC_STATUS_INVALID_ARGUMENT, "outside region"},
        {"byte count", GRPC_STATUS_INVALID_ARGUMENT, "need 32"},
        {"misaligned", GRPC_STATUS_INVALID_ARGUMENT, "multiple of 4"},
        {"data and region", GRPC_STATUS_INVALID_ARGUMENT, "both data and region"},
        {"reply_region past the end", GRPC_STATUS_INVALID_ARGUMENT, "reply_region: span"},
        {"reply_region unknown", GRPC_STATUS_FAILED_PRECONDITION, "reply_region: region"},
        {"reply_region misaligned", GRPC_STATUS_INVALID_ARGUMENT, "multiple of 64"},
    };
    uint8_t inline_bytes[I_ * 4] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int env = 0; env < 2; env++) {
            struct step_msg m;
            // 4900+i: never stepped (is_init: would create it); 4001: stepped before.
            uint64_t id = env == 0 ? 4900 + i : 4001;
            step_msg(&m, id, env == 0, &r, 128, x);
            switch (i) {
                case 0:
                    m.span.region = r.id ^ 0x5555;
                    break;
                case 1:
                    m.span.region = gone.id;
                    break;
                case 2:
                    m.span.offset = RSIZE - 16;
                    break;
                case 3:
                    m.span.offset = UINT64_MAX - 16;
                    break;
                case 4:
                    m.span.nbytes = I_ * 4 - 4;
                    break;
                case 5:
                    m.span.offset = 130;
                    break;
                case 6:
                    m.obs.data = (ProtobufCBinaryData){sizeof inline_bytes, inline_bytes};
                    break;
                case 7:
                    m.reply.offset = RSIZE - 64;
                    m.reply.nbytes = 128;
                    break;
                case 8:
                    m.reply.region = r.id + 1;
                    break;
                case 9:
                    m.reply.offset = 4100;
                    break;
            }
            Rnnd__V1__StepReply *rep;
            int err = step_raw(c, &m, &rep);
            if (err == 0 || rnnd_client_last_error()->grpc_status != cases[i].status ||
                !strstr(rnnd_client_last_error()->message, cases[i].says))
                fail_msg("%s: got %d (%s): %s", cases[i].what, err,
                         rnnd_grpc_status_name(rnnd_client_last_error()->grpc_status),
                         rnnd_client_last_error()->message);
            if (env == 0) // the env was not created
                EXPECT_STATUS(step_bytes(c, id, false, x, NULL), GRPC_STATUS_FAILED_PRECONDITION);
        }
    }
    EXPECT_OK(step_bytes(c, 4001, false, x, o1));
    EXPECT_OK(step_bytes(c, 4002, false, x, o2));
    assert_memory_equal(o1, o2, sizeof o1);

    // A Backward refused for its descriptor leaves its tape for the good one.
    enum { T = 4 };
    float obs[T * I_], go[T * H_];
    fill(&g, obs, T * I_);
    fill(&g, go, T * H_);
    struct rnnd_forward_req fr = {.obs = rnnd_tensor_f32(obs, 3, 1, T, I_, 0), .keep_tape = true};
    struct rnnd_forward_reply f;
    EXPECT_OK(rnnd_client_forward(c, &fr, &f));
    Rnnd__V1__BackwardRequest bw = RNND__V1__BACKWARD_REQUEST__INIT;
    Rnnd__V1__Tensor gt = RNND__V1__TENSOR__INIT;
    Rnnd__V1__RegionSpan gs = RNND__V1__REGION_SPAN__INIT;
    int64_t shape[3] = {1, T, H_};
    memcpy(r.base + 8192, go, sizeof go);
    gt.n_shape = 3;
    gt.shape = shape;
    gt.dtype = RNND__V1__DTYPE__FLOAT32;
    gt.region = &gs;
    gs.region = r.id;
    gs.offset = 8192;
    gs.nbytes = sizeof go + 4;
    bw.tape_id = f.tape_id;
    bw.grad_output = &gt;
    ProtobufCMessage *out;
    EXPECT_STATUS(
        raw(c, "/rnnd.v1.Rnn/Backward", &bw.base, &rnnd__v1__backward_reply__descriptor, &out),
        GRPC_STATUS_INVALID_ARGUMENT);
    gs.nbytes = sizeof go;
    EXPECT_OK(
        raw(c, "/rnnd.v1.Rnn/Backward", &bw.base, &rnnd__v1__backward_reply__descriptor, &out));
    Rnnd__V1__BackwardReply *brep = (Rnnd__V1__BackwardReply *)out;
    assert_int_equal(brep->n_grads, 4 * L_);
    protobuf_c_message_free_unpacked(out, NULL);
    rnnd_forward_reply_free(&f);

    region_close(&r);
    region_close(&gone);
    rnnd_client_free(c);
}

// Who may register: a bad key, an unsealed or unlocked memfd, a descriptor that is not one.
static void test_register_refusals(void **state) {
    (void)state;
    struct rnnd_client *c = unix_client(TOKEN);
    struct region r;
    EXPECT_OK(region_open(c, &r));
    Rnnd__V1__MemfdRegion m = RNND__V1__MEMFD_REGION__INIT;
    m.pid = (uint32_t)getpid();
    m.fd = r.fd;
    m.size = RSIZE;
    uint8_t key[32];
    memcpy(key, r.key, 32);
    key[0] ^= 0x80;
    m.key = (ProtobufCBinaryData){32, key};
    Rnnd__V1__RegisterRegionRequest req = RNND__V1__REGISTER_REGION_REQUEST__INIT;
    req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_MEMFD;
    req.memfd = &m;
    ProtobufCMessage *out;
    EXPECT_STATUS(raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                      &rnnd__v1__register_region_reply__descriptor, &out),
                  GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "key"));
    m.key.data = r.key;
    int file = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    m.fd = file;
    EXPECT_STATUS(raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                      &rnnd__v1__register_region_reply__descriptor, &out),
                  GRPC_STATUS_FAILED_PRECONDITION);
    close(file);
    // The lock gone (the client's descriptor closed): refused at registration.
    struct region u;
    EXPECT_OK(region_open(c, &u));
    flock(u.fd, LOCK_UN);
    m.fd = u.fd;
    m.key.data = u.key;
    EXPECT_STATUS(raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                      &rnnd__v1__register_region_reply__descriptor, &out),
                  GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "LOCK_SH"));
    region_close(&u);
    region_close(&r);
    rnnd_client_free(c);
}

// A client that exits (its descriptors close, so its lock goes) loses its region.
static void test_region_goes_with_client(void **state) {
    (void)state;
    struct rnnd_client *c = unix_client(TOKEN);
    struct region r;
    EXPECT_OK(region_open(c, &r));
    float x[I_] = {0};
    struct step_msg m;
    Rnnd__V1__StepReply *rep;
    step_msg(&m, 5001, true, &r, 128, x);
    EXPECT_OK(step_raw(c, &m, &rep));
    protobuf_c_message_free_unpacked(&rep->base, NULL);
    uint64_t id = r.id;
    // Its mapping holds the open file (and so the lock) as much as its descriptor does.
    munmap(r.base, RSIZE);
    close(r.fd);
    r.base = malloc(RSIZE);
    // The daemon checks on its housekeeping timer (--hz 10).
    int err = 0;
    for (double t0 = now_seconds(); now_seconds() - t0 < 5;) {
        step_msg(&m, 5001, true, &r, 128, x);
        m.span.region = m.reply.region = id;
        err = step_raw(c, &m, &rep);
        if (err)
            break;
        protobuf_c_message_free_unpacked(&rep->base, NULL);
        sleep_ms(50);
    }
    assert_int_equal(rnnd_client_last_error()->grpc_status, GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "not registered"));
    free(r.base);
    rnnd_client_free(c);
}

// ---------------------------------------------------------------------------------------------
// Socket regions: the daemon's memory, written and read through a data connection.

struct sockreg {
    struct region r; // r.base: this side's copy of what the frames carry
    int fd;          // the data connection
};

// Registers a socket region of RSIZE bytes through c; 0 or the code. *port: its data port.
static int sockreg_register(struct rnnd_client *c, struct sockreg *s, int *port) {
    memset(s, 0, sizeof(*s));
    s->fd = -1;
    s->r.fd = -1;
    s->r.base = calloc(1, RSIZE);
    assert_int_equal(getrandom(s->r.key, 32, 0), 32);
    Rnnd__V1__SocketRegion m = RNND__V1__SOCKET_REGION__INIT;
    m.size = RSIZE;
    m.key = (ProtobufCBinaryData){32, s->r.key};
    Rnnd__V1__RegisterRegionRequest req = RNND__V1__REGISTER_REGION_REQUEST__INIT;
    req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_SOCKET;
    req.socket = &m;
    ProtobufCMessage *out;
    int err = raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                  &rnnd__v1__register_region_reply__descriptor, &out);
    if (out) {
        s->r.id = ((Rnnd__V1__RegisterRegionReply *)out)->region;
        *port = (int)((Rnnd__V1__RegisterRegionReply *)out)->data_port;
        protobuf_c_message_free_unpacked(out, NULL);
    }
    return err;
}

// A TCP connection to 127.0.0.1:port that sent the hello with key.
static int data_connect(int port, const uint8_t *key) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t hello[40];
    memcpy(hello, "RNNDSOCK", 8);
    memcpy(hello + 8, key, 32);
    assert_int_equal(send(fd, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
    return fd;
}

// The registered region and its data connection (the hello answered with the size).
static void sockreg_open(struct rnnd_client *c, struct sockreg *s) {
    int port = 0;
    EXPECT_OK(sockreg_register(c, s, &port));
    assert_true(port > 0);
    s->fd = data_connect(port, s->r.key);
    uint64_t size = 0;
    assert_int_equal(recv(s->fd, &size, 8, MSG_WAITALL), 8);
    assert_int_equal(size, RSIZE);
}

static void sockreg_close(struct sockreg *s) {
    if (s->fd >= 0)
        close(s->fd);
    free(s->r.base);
}

static void frame(int fd, uint64_t op, uint64_t off, uint64_t n) {
    uint64_t h[3] = {op, off, n};
    assert_int_equal(send(fd, h, sizeof h, MSG_NOSIGNAL), (ssize_t)sizeof h);
}

// Sends [off, off + n) of this side's copy, then waits for the daemon to hold it.
static void sockreg_write(struct sockreg *s, uint64_t off, uint64_t n) {
    frame(s->fd, 1, off, n);
    assert_int_equal(send(s->fd, s->r.base + off, n, MSG_NOSIGNAL), (ssize_t)n);
    frame(s->fd, 3, 77, 0);
    uint64_t echo = 0;
    assert_int_equal(recv(s->fd, &echo, 8, MSG_WAITALL), 8);
    assert_int_equal(echo, 77);
}

// Reads [off, off + n) of the daemon's region into this side's copy.
static void sockreg_read(struct sockreg *s, uint64_t off, uint64_t n) {
    frame(s->fd, 2, off, n);
    assert_int_equal(recv(s->fd, s->r.base + off, n, MSG_WAITALL), (ssize_t)n);
}

// True once the daemon closed fd within 5 s: end of file, or a reset where it closed with our
// bytes unread.
static bool closed_by_daemon(int fd) {
    char b;
    ssize_t k = recv(fd, &b, 1, 0);
    return k == 0 || (k < 0 && errno == ECONNRESET);
}

// Step through a socket region gives the bytes path's output; the reply lands in the region.
static void step_via_sockreg(struct rnnd_client *c, struct sockreg *s, uint64_t env) {
    float x[I_], want[H_];
    struct rng g = {env};
    fill(&g, x, I_);
    EXPECT_OK(step_bytes(c, env, true, x, want));
    struct step_msg m;
    step_msg(&m, env + 1, true, &s->r, 128, x);
    sockreg_write(s, 128, I_ * 4);
    Rnnd__V1__StepReply *rep;
    EXPECT_OK(step_raw(c, &m, &rep));
    assert_non_null(rep->output->region);
    assert_int_equal(rep->output->region->offset, 4096);
    assert_int_equal(rep->output->data.len, 0);
    sockreg_read(s, 4096, H_ * 4);
    assert_memory_equal(s->r.base + 4096, want, H_ * 4);
    protobuf_c_message_free_unpacked(&rep->base, NULL);
}

static void test_socket_region(void **state) {
    (void)state;
    struct rnnd_client *c = client_to(d.grpc, TOKEN);
    struct sockreg s;
    sockreg_open(c, &s);
    step_via_sockreg(c, &s, 7001);

    // A hello with a key no region has: closed. A region takes 4 connections (each told the
    // size), a fifth is closed; writes on one are read back on another.
    uint8_t key[32];
    memcpy(key, s.r.key, 32);
    key[5] ^= 1;
    int port = 0;
    struct sockreg t;
    EXPECT_OK(sockreg_register(c, &t, &port));
    int bad = data_connect(port, key);
    assert_true(closed_by_daemon(bad));
    close(bad);
    int more[3];
    for (int i = 0; i < 3; i++) {
        more[i] = data_connect(port, s.r.key);
        uint64_t size = 0;
        assert_int_equal(recv(more[i], &size, 8, MSG_WAITALL), 8);
        assert_int_equal(size, RSIZE);
    }
    bad = data_connect(port, s.r.key);
    assert_true(closed_by_daemon(bad));
    close(bad);
    for (int i = 0; i < 64; i++)
        s.r.base[20000 + i] = (uint8_t)(3 * i + 1);
    sockreg_write(&s, 20000, 64);
    int keep = s.fd;
    s.fd = more[2];
    memset(s.r.base + 20000, 0, 64);
    sockreg_read(&s, 20000, 64);
    for (int i = 0; i < 64; i++)
        assert_int_equal(s.r.base[20000 + i], (uint8_t)(3 * i + 1));
    s.fd = keep;
    // One of them closing ends the region: the daemon closes the others.
    close(more[1]);
    assert_true(closed_by_daemon(s.fd));
    assert_true(closed_by_daemon(more[0]));
    assert_true(closed_by_daemon(more[2]));
    close(more[0]);
    close(more[2]);
    sockreg_close(&s);
    sockreg_open(c, &s);

    // ReleaseRegion closes the region's connection.
    t.fd = data_connect(port, t.r.key);
    uint64_t size = 0;
    assert_int_equal(recv(t.fd, &size, 8, MSG_WAITALL), 8);
    Rnnd__V1__ReleaseRegionRequest rel = RNND__V1__RELEASE_REGION_REQUEST__INIT;
    rel.region = t.r.id;
    ProtobufCMessage *out;
    EXPECT_OK(raw(c, "/rnnd.v1.Rnn/ReleaseRegion", &rel.base,
                  &rnnd__v1__release_region_reply__descriptor, &out));
    protobuf_c_message_free_unpacked(out, NULL);
    assert_true(closed_by_daemon(t.fd));
    sockreg_close(&t);

    // A frame outside the region closes the connection, and the region goes with it.
    frame(s.fd, 2, RSIZE - 4, 8);
    assert_true(closed_by_daemon(s.fd));
    float x[I_] = {0};
    struct step_msg m;
    Rnnd__V1__StepReply *rep;
    step_msg(&m, 7003, true, &s.r, 128, x);
    int err = GRPC_STATUS_OK;
    for (double t0 = now_seconds(); now_seconds() - t0 < 5 && err == GRPC_STATUS_OK;) {
        err = step_raw(c, &m, &rep);
        if (err == 0) {
            protobuf_c_message_free_unpacked(&rep->base, NULL);
            sleep_ms(20);
        }
    }
    assert_int_equal(rnnd_client_last_error()->grpc_status, GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "not registered"));
    sockreg_close(&s);

    // Bad registrations: a short key, a size over the limit.
    Rnnd__V1__SocketRegion sm = RNND__V1__SOCKET_REGION__INIT;
    sm.size = RSIZE;
    sm.key = (ProtobufCBinaryData){16, key};
    Rnnd__V1__RegisterRegionRequest req = RNND__V1__REGISTER_REGION_REQUEST__INIT;
    req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_SOCKET;
    req.socket = &sm;
    EXPECT_STATUS(raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                      &rnnd__v1__register_region_reply__descriptor, &out),
                  GRPC_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(rnnd_client_last_error()->message, "socket.key"));
    sm.key.len = 32;
    sm.size = (uint64_t)1 << 36;
    EXPECT_STATUS(raw(c, "/rnnd.v1.Rnn/RegisterRegion", &req.base,
                      &rnnd__v1__register_region_reply__descriptor, &out),
                  GRPC_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(rnnd_client_last_error()->message, "socket.size"));
    rnnd_client_free(c);

    // --max-socket-region-mb: a region beyond what is left is refused (RESOURCE_EXHAUSTED), and
    // one that fits after the first is released goes through.
    const char *capped[] = {
        "--max-socket-region-mb", "1", "--input-size", "8", "--hidden-size", "16", NULL};
    struct daemon d3;
    assert_int_equal(daemon_start(&d3, capped), 0);
    c = client_to(d3.grpc, NULL);
    struct sockreg held[16];
    for (int i = 0; i < 16; i++)
        EXPECT_OK(sockreg_register(c, &held[i], &port));
    EXPECT_STATUS(sockreg_register(c, &t, &port), GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(rnnd_client_last_error()->message, "--max-socket-region-mb"));
    sockreg_close(&t);
    rel.region = held[0].r.id;
    EXPECT_OK(raw(c, "/rnnd.v1.Rnn/ReleaseRegion", &rel.base,
                  &rnnd__v1__release_region_reply__descriptor, &out));
    protobuf_c_message_free_unpacked(out, NULL);
    EXPECT_OK(sockreg_register(c, &t, &port));
    sockreg_close(&t);
    for (int i = 0; i < 16; i++)
        sockreg_close(&held[i]);
    rnnd_client_free(c);
    daemon_free(&d3);

    // --data-listen off: socket regions are refused, with the flag named.
    const char *args[] = {"--data-listen", "off", "--input-size", "8", "--hidden-size", "16", NULL};
    struct daemon d2;
    assert_int_equal(daemon_start(&d2, args), 0);
    c = client_to(d2.grpc, NULL);
    EXPECT_STATUS(sockreg_register(c, &t, &port), GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "--data-listen"));
    sockreg_close(&t);
    rnnd_client_free(c);
    daemon_free(&d2);
}

// A peer that is not on this host (here: this host's own non-loopback address, which the
// daemon cannot tell from another host's) may neither register a region nor use one, but for a
// socket region.
static void test_remote_peer(void **state) {
    (void)state;
    char ip[INET_ADDRSTRLEN] = "";
    struct ifaddrs *ifs;
    if (getifaddrs(&ifs) == 0) {
        for (struct ifaddrs *i = ifs; i && !ip[0]; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET)
                continue;
            struct in_addr a = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
            if ((ntohl(a.s_addr) >> 24) != 127)
                inet_ntop(AF_INET, &a, ip, sizeof ip);
        }
        freeifaddrs(ifs);
    }
    if (!ip[0])
        skip(); // no address but loopback here
    const char *args[] = {"--listen", "0.0.0.0:0", "--input-size", "8", "--hidden-size",
                          "16",       NULL};
    struct daemon d2;
    assert_int_equal(daemon_start(&d2, args), 0);
    const char *p = strstr(d2.ready_line, ",0.0.0.0:");
    assert_non_null(p);
    char target[64];
    snprintf(target, sizeof target, "%s:%d", ip, atoi(p + 9));
    struct rnnd_client *local = client_to(d2.grpc, NULL), *remote = client_to(target, NULL);
    struct region r;
    EXPECT_STATUS(region_open(remote, &r), GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "daemon's host"));
    region_close(&r);
    EXPECT_STATUS(rnnd_client_shm_start(remote, 0), GRPC_STATUS_FAILED_PRECONDITION);
    assert_string_equal(rnnd_client_transport(remote), "grpc");
    // A region registered from loopback, named by the remote peer.
    EXPECT_OK(region_open(local, &r));
    float x[I_] = {0};
    struct step_msg m;
    Rnnd__V1__StepReply *rep;
    step_msg(&m, 6001, true, &r, 128, x);
    EXPECT_STATUS(step_raw(remote, &m, &rep), GRPC_STATUS_FAILED_PRECONDITION);
    EXPECT_OK(step_raw(local, &m, &rep));
    protobuf_c_message_free_unpacked(&rep->base, NULL);
    region_close(&r);
    // A socket region: the remote peer registers it and steps through it.
    struct sockreg s;
    sockreg_open(remote, &s);
    step_via_sockreg(remote, &s, 6101);
    sockreg_close(&s);
    rnnd_client_free(local);
    rnnd_client_free(remote);
    daemon_free(&d2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unix_socket_and_token),
        cmocka_unit_test(test_several_addresses),
        cmocka_unit_test(test_shm_equals_bytes),
        cmocka_unit_test(test_rnndctl_bench_shm),
        cmocka_unit_test(test_reply_in_region),
        cmocka_unit_test(test_bad_descriptors),
        cmocka_unit_test(test_register_refusals),
        cmocka_unit_test(test_region_goes_with_client),
        cmocka_unit_test(test_socket_region),
        cmocka_unit_test(test_remote_peer),
    };
    return cmocka_run_group_tests_name("shm", tests, setup, teardown);
}
