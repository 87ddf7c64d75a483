/*
 * soak.c: many clients against one real daemon for N seconds, then a reckoning.
 *
 * Each worker thread owns K envs and keeps an in-process CPU reference of them (the harness's
 * struct ref, with the daemon's weights), and loops over random operations: unary Steps on
 * random subsets with random resets; StepStream sessions that end cleanly or are dropped with a
 * step in flight; Steps on an impatient connection (1 ms deadline) that may or may not reach
 * the engine; EndEpisodes; Forward over the last recorded step; reconnects; and bad requests
 * (wrong shape, duplicate ids, NaN, unknown env, skipped step_index, unknown tape, undecodable
 * bytes, unknown method) that must be refused with their docs/design.md code and change nothing.
 * Every step carries a step_index, so a step whose reply was lost is resent with the same index
 * and applied exactly once; only then does the reference take it. Every output the daemon
 * returns is compared with the reference's.
 *
 * Meanwhile a chaos thread scrapes /metrics, checks health, writes checkpoints, opens raw TCP
 * connections that send garbage to the gRPC port, takes socket regions through their whole
 * life (and sends garbage to their data port), and holds one HTTP request open until the
 * daemon times it out (408).
 *
 * Afterwards: every env's state (h, and the cached output) equals the reference replay (read
 * back by resending each env's last step_index with return_state: a repeat, so nothing
 * advances); envs_active equals the envs the workers hold; no socket region stays registered;
 * no call went unanswered (no deadline
 * passed on a patient connection, nothing unexpected); the daemon's open descriptors are back to
 * where they started and its RSS did not grow beyond a small allowance between the end of the
 * warm-up and the end of the run. Figures go to stderr.
 *
 *   soak [--seconds N] [--workers N] [--envs K] [--seed S] [--rss-allowance-mb M]
 * (defaults 10 s, 8 workers, 8 envs, seed 1; RSS may grow by M MiB plus 10% after the warm-up,
 * default 16: sanitizer builds, whose allocator keeps freed memory in quarantine, pass more).
 * CTest runs a short version (label integration); a long one is run on demand, e.g.
 *   build/tests/soak/soak --seconds 120 --workers 16
 */
#include "harness.h"

#include <errno.h>
#include <grpc/status.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "rnnd/v1/rnnd.pb-c.h"

#define I_        8
#define H_        16
#define L_        2
#define TRAJ      16
#define MAX_K     32
#define ATOL      1e-4f
#define RTOL      1e-3f
#define N_CODES   17
#define FOREIGN   (1ull << 40) // env ids no worker owns: never hold state
#define MAX_NOTES 8

static struct {
    int seconds, workers, envs;
    uint64_t seed;
    long rss_allowance_mb;
} opt = {10, 8, 8, 1, 16};

static struct daemon d;
static atomic_bool stop_flag;

// ---------------------------------------------------------------------------------------------
// Worker state

struct env_st {
    uint64_t id;
    bool alive;          // holds state on the daemon (as far as confirmed replies say)
    uint64_t last_index; // step_index of its latest applied step
    int recorded;        // steps in its trajectory ring
    float last_out[H_];  // the daemon's output of its latest step
    double quiet_until;  // not ended before this (a lost request of it may still arrive)
};

// A step whose fate is unknown (reply lost): resent with the same step_index until answered.
struct pending {
    bool used;
    int B;
    int rows[MAX_K];
    uint64_t ids[MAX_K], index[MAX_K];
    bool init[MAX_K];
    float x[MAX_K * I_];
};

struct worker {
    int idx;
    pthread_t tid;
    struct rng g;
    struct ref r; // slots 0..K-1 = this worker's envs
    struct env_st env[MAX_K];
    struct rnnd_client *patient, *impatient;
    uint64_t calls[N_CODES + 1]; // by grpc code; [N_CODES]: local failures (no status)
    uint64_t steps_ok, resent, mismatches, unexpected, unanswered, streams, dropped;
    uint64_t connect_failures;
    char notes[MAX_NOTES][300];
    int n_notes;
};

static void note(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct worker *w, const char *fmt, ...) {
    if (w->n_notes >= MAX_NOTES)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->notes[w->n_notes++], sizeof w->notes[0], fmt, ap);
    va_end(ap);
}

static int last_code(void) {
    return rnnd_client_last_error()->grpc_status;
}

// gRPC 1.51's client can report a connect that was merely in progress as failed, with an errno
// clobbered by calls made in between ("failed to connect to all addresses; ... No such file or
// directory"; later gRPC keeps connect()'s errno). Such a call never left the client: it
// changed nothing and is retried (or skipped), and counted apart. A daemon that really stopped
// accepting would keep failing the retries and show up as unanswered.
static bool connect_failure(int err) {
    return err != 0 && last_code() == GRPC_STATUS_UNAVAILABLE &&
           strstr(rnnd_client_last_error()->message, "failed to connect") != NULL;
}

static void count(struct worker *w, int err) {
    int code = err == 0 ? 0 : last_code();
    w->calls[code >= 0 && code < N_CODES ? code : N_CODES]++;
}

// Counts the call and checks its code against want (a grpc code); false when it differs.
static bool expect_code(struct worker *w, int err, int want, const char *what) {
    count(w, err);
    int code = err == 0 ? 0 : last_code();
    if (code == want)
        return true;
    if (connect_failure(err)) {
        w->connect_failures++;
        return false;
    }
    w->unexpected++;
    note(w, "%s: %s, wanted %s: %s", what, rnnd_grpc_status_name(code), rnnd_grpc_status_name(want),
         err ? rnnd_client_last_error()->message : "");
    return false;
}

static struct rnnd_client *connect_client(int64_t timeout_ms) {
    struct rnnd_client_opts o = {.target = d.grpc, .timeout_ms = timeout_ms};
    struct rnnd_client *c = NULL;
    return rnnd_client_init(&o, &c) == 0 ? c : NULL;
}

// ---------------------------------------------------------------------------------------------
// Steps

// A new step over a random subset of the worker's envs: resets where the env holds no state and
// at random elsewhere.
static void step_make(struct worker *w, struct pending *p) {
    memset(p, 0, sizeof *p);
    int K = opt.envs, B = 1 + (int)rng_u(&w->g, (uint32_t)K);
    int perm[MAX_K];
    for (int k = 0; k < K; k++)
        perm[k] = k;
    for (int k = 0; k < B; k++) {
        int j = k + (int)rng_u(&w->g, (uint32_t)(K - k));
        int t = perm[k];
        perm[k] = perm[j];
        perm[j] = t;
        struct env_st *e = &w->env[perm[k]];
        p->rows[k] = perm[k];
        p->ids[k] = e->id;
        p->index[k] = e->last_index + 1;
        p->init[k] = !e->alive || rng_u(&w->g, 100) < 7;
    }
    p->B = B;
    rng_fill(&w->g, p->x, (size_t)B * I_);
    p->used = true;
}

static struct rnnd_step_req step_req(const struct pending *p, bool return_state) {
    return (struct rnnd_step_req){.n_env_ids = (size_t)p->B,
                                  .env_ids = p->ids,
                                  .obs = rnnd_tensor_f32((void *)p->x, 2, p->B, I_, 0, 0),
                                  .n_is_init = (size_t)p->B,
                                  .is_init = p->init,
                                  .n_step_index = (size_t)p->B,
                                  .step_index = p->index,
                                  .return_state = return_state};
}

// The step was applied (exactly once): the reference takes it and the outputs must agree.
static void step_applied(struct worker *w, struct pending *p, const float *out) {
    int32_t slots[MAX_K];
    float ref[MAX_K * H_];
    for (int k = 0; k < p->B; k++)
        slots[k] = p->rows[k];
    ref_step(&w->r, p->B, slots, p->x, p->init, ref);
    for (int k = 0; k < p->B; k++) {
        struct env_st *e = &w->env[p->rows[k]];
        const float *o = out + (size_t)k * H_;
        for (int j = 0; j < H_; j++) {
            float a = o[j], b = ref[k * H_ + j];
            if (!(fabsf(a - b) <= ATOL + RTOL * fabsf(b))) {
                if (w->mismatches++ == 0)
                    note(w, "env %llu step %llu: output[%d] %g, reference %g",
                         (unsigned long long)e->id, (unsigned long long)p->index[k], j, a, b);
                break;
            }
        }
        e->alive = true;
        e->last_index = p->index[k];
        e->recorded = e->recorded < TRAJ ? e->recorded + 1 : TRAJ;
        memcpy(e->last_out, o, sizeof e->last_out);
    }
    w->steps_ok++;
    p->used = false;
}

// Resends p on the patient connection until it is answered (a repeat when it had been applied).
// The lost request itself may still reach the engine later: harmless for an env that holds
// state (an old step_index is a repeat or refused), but it would bring back an env ended in the
// meantime, so these envs are not ended for a while.
static void step_resolve(struct worker *w, struct pending *p) {
    for (int k = 0; k < p->B; k++)
        w->env[p->rows[k]].quiet_until = now_seconds() + 2.0;
    double give_up = now_seconds() + 10.0;
    while (p->used) {
        struct rnnd_step_req req = step_req(p, false);
        struct rnnd_step_reply r;
        int err = rnnd_client_step(w->patient, &req, &r);
        count(w, err);
        w->resent++;
        if (err == 0) {
            step_applied(w, p, r.output.data);
        } else if (last_code() == GRPC_STATUS_RESOURCE_EXHAUSTED) {
            sleep_ms(2); // a bound: refused whole, nothing changed; try again
        } else if (connect_failure(err) && now_seconds() < give_up) {
            w->connect_failures++;
            sleep_ms(20); // the channel backs off, then connects again
        } else {
            w->unexpected++;
            if (last_code() == GRPC_STATUS_DEADLINE_EXCEEDED)
                w->unanswered++;
            note(w, "resent step: %s: %s", rnnd_grpc_status_name(last_code()),
                 rnnd_client_last_error()->message);
            p->used = false; // give up on these envs: mark them unknown
            for (int k = 0; k < p->B; k++)
                w->env[p->rows[k]].alive = false;
        }
        rnnd_step_reply_free(&r);
    }
}

static void op_step(struct worker *w, bool impatient) {
    struct pending p;
    step_make(w, &p);
    struct rnnd_step_req req = step_req(&p, false);
    struct rnnd_step_reply r;
    int err = rnnd_client_step(impatient ? w->impatient : w->patient, &req, &r);
    count(w, err);
    if (err == 0) {
        step_applied(w, &p, r.output.data);
    } else if (last_code() == GRPC_STATUS_RESOURCE_EXHAUSTED) {
        // Refused whole by a bound: nothing changed.
    } else if (impatient) {
        step_resolve(w, &p); // the reply was lost, the step may have run
    } else if (connect_failure(err)) {
        w->connect_failures++;
        step_resolve(w, &p); // never sent: the resend is its first delivery
    } else {
        w->unexpected++;
        if (last_code() == GRPC_STATUS_DEADLINE_EXCEEDED)
            w->unanswered++;
        note(w, "step: %s: %s", rnnd_grpc_status_name(last_code()),
             rnnd_client_last_error()->message);
        step_resolve(w, &p);
    }
    rnnd_step_reply_free(&r);
}

static void op_stream(struct worker *w) {
    struct rnnd_client_stream *s;
    int err = rnnd_client_stream_init(w->patient, &s);
    if (!expect_code(w, err, 0, "StepStream open"))
        return;
    w->streams++;
    int n = 1 + (int)rng_u(&w->g, 12);
    struct pending p = {0};
    for (int k = 0; k < n; k++) {
        step_make(w, &p);
        struct rnnd_step_req req = step_req(&p, false);
        struct rnnd_step_reply r;
        err = rnnd_client_stream_step(s, &req, &r);
        count(w, err);
        if (err == 0) {
            step_applied(w, &p, r.output.data);
        } else {
            if (connect_failure(err)) {
                w->connect_failures++;
            } else if (last_code() != GRPC_STATUS_RESOURCE_EXHAUSTED) {
                w->unexpected++;
                note(w, "stream step: %s: %s", rnnd_grpc_status_name(last_code()),
                     rnnd_client_last_error()->message);
            }
            step_resolve(w, &p);
            rnnd_step_reply_free(&r);
            rnnd_client_stream_free(s);
            return;
        }
        rnnd_step_reply_free(&r);
    }
    switch (rng_u(&w->g, 3)) {
        case 0: // a clean end
            expect_code(w, rnnd_client_stream_close(s), 0, "StepStream close");
            break;
        case 1: // the client goes away with a step in flight
            step_make(w, &p);
            struct rnnd_step_req req = step_req(&p, false);
            rnnd_client_stream_send(s, &req);
            w->dropped++;
            break;
        default: // the client goes away between steps
            w->dropped++;
            break;
    }
    rnnd_client_stream_free(s);
    if (p.used)
        step_resolve(w, &p);
}

static void op_end(struct worker *w) {
    uint64_t ids[MAX_K];
    int rows[MAX_K], n = 0;
    uint64_t alive = 0;
    double now = now_seconds();
    for (int k = 0; k < opt.envs; k++) {
        if (rng_u(&w->g, 4) == 0 && w->env[k].quiet_until < now) {
            rows[n] = k;
            ids[n++] = w->env[k].id;
            alive += w->env[k].alive;
        }
    }
    uint64_t released = 0;
    int err = rnnd_client_end_episodes(w->patient, ids, (size_t)n, &released);
    if (!expect_code(w, err, 0, "EndEpisodes"))
        return;
    if (released != alive) {
        w->mismatches++;
        note(w, "EndEpisodes released %llu, %llu held state", (unsigned long long)released,
             (unsigned long long)alive);
    }
    for (int k = 0; k < n; k++) {
        struct env_st *e = &w->env[rows[k]];
        e->alive = false;
        e->recorded = 0;
    }
}

static void op_forward_recorded(struct worker *w) {
    int k = (int)rng_u(&w->g, (uint32_t)opt.envs);
    struct env_st *e = &w->env[k];
    if (!e->alive || e->recorded < 1)
        return;
    struct rnnd_forward_req req = {.recorded = true, .n_env_ids = 1, .env_ids = &e->id, .steps = 1};
    struct rnnd_forward_reply r;
    int err = rnnd_client_forward(w->patient, &req, &r);
    if (expect_code(w, err, 0, "Forward recorded")) {
        // The last recorded step replays to the output Step returned for it.
        const float *o = r.output.data;
        for (int j = 0; j < H_; j++)
            if (!(fabsf(o[j] - e->last_out[j]) <= ATOL + RTOL * fabsf(e->last_out[j]))) {
                if (w->mismatches++ == 0)
                    note(w, "env %llu: recorded replay %g, Step returned %g",
                         (unsigned long long)e->id, o[j], e->last_out[j]);
                break;
            }
    }
    rnnd_forward_reply_free(&r);
}

// Requests the daemon must refuse with their code, changing nothing.
static void op_bad(struct worker *w) {
    struct pending p;
    step_make(w, &p);
    p.used = false;
    struct rnnd_step_req req = step_req(&p, false);
    struct rnnd_step_reply r = {0};
    int err;
    switch (rng_u(&w->g, 8)) {
        case 0: // obs of the wrong width
            req.obs = rnnd_tensor_f32(p.x, 2, 1, I_ - 1, 0, 0);
            req.n_env_ids = req.n_is_init = req.n_step_index = 1;
            err = rnnd_client_step(w->patient, &req, &r);
            expect_code(w, err, GRPC_STATUS_INVALID_ARGUMENT, "bad: obs shape");
            break;
        case 1: // one env twice
            if (p.B < 2)
                return;
            p.ids[1] = p.ids[0];
            err = rnnd_client_step(w->patient, &req, &r);
            expect_code(w, err, GRPC_STATUS_INVALID_ARGUMENT, "bad: duplicate env");
            break;
        case 2: // a NaN
            p.x[rng_u(&w->g, (uint32_t)(p.B * I_))] = NAN;
            err = rnnd_client_step(w->patient, &req, &r);
            expect_code(w, err, GRPC_STATUS_INVALID_ARGUMENT, "bad: NaN obs");
            break;
        case 3: { // an env that holds no state, without is_init
            uint64_t id = FOREIGN + (uint64_t)w->idx;
            bool no = false;
            req.n_env_ids = req.n_is_init = req.n_step_index = 1;
            req.env_ids = &id;
            req.is_init = &no;
            req.obs = rnnd_tensor_f32(p.x, 2, 1, I_, 0, 0);
            err = rnnd_client_step(w->patient, &req, &r);
            expect_code(w, err, GRPC_STATUS_FAILED_PRECONDITION, "bad: unknown env");
            break;
        }
        case 4: { // a step_index that skips ahead
            int k = (int)rng_u(&w->g, (uint32_t)opt.envs);
            struct env_st *e = &w->env[k];
            if (!e->alive)
                return;
            uint64_t idx = e->last_index + 2;
            bool no = false;
            req.n_env_ids = req.n_is_init = req.n_step_index = 1;
            req.env_ids = &e->id;
            req.is_init = &no;
            req.step_index = &idx;
            req.obs = rnnd_tensor_f32(p.x, 2, 1, I_, 0, 0);
            err = rnnd_client_step(w->patient, &req, &r);
            expect_code(w, err, GRPC_STATUS_FAILED_PRECONDITION, "bad: skipped step_index");
            break;
        }
        case 5: { // a tape that does not exist
            float g[H_] = {0};
            struct rnnd_backward_req b = {.tape_id = (1ull << 50) + rng_u(&w->g, 1000),
                                          .grad_output = rnnd_tensor_f32(g, 3, 1, 1, H_, 0)};
            struct rnnd_backward_reply br;
            err = rnnd_client_backward(w->patient, &b, &br);
            expect_code(w, err, GRPC_STATUS_NOT_FOUND, "bad: unknown tape");
            rnnd_backward_reply_free(&br);
            break;
        }
        case 6: { // bytes that do not decode
            static const unsigned char junk[] = {0xff, 0xff, 0xff, 0xff, 0x0f};
            void *reply = NULL;
            size_t len;
            err = rnnd_client_call_raw(w->patient, "/rnnd.v1.Rnn/Step", junk, sizeof junk, &reply,
                                       &len);
            expect_code(w, err, GRPC_STATUS_INVALID_ARGUMENT, "bad: undecodable Step");
            free(reply);
            break;
        }
        default: { // a method that does not exist
            void *reply = NULL;
            size_t len;
            err = rnnd_client_call_raw(w->patient, "/rnnd.v1.Rnn/Frobnicate", "", 0, &reply, &len);
            expect_code(w, err, GRPC_STATUS_UNIMPLEMENTED, "bad: unknown method");
            free(reply);
            break;
        }
    }
    rnnd_step_reply_free(&r);
}

static void op_reconnect(struct worker *w) {
    rnnd_client_free(w->patient);
    rnnd_client_free(w->impatient);
    w->patient = connect_client(30000);
    w->impatient = connect_client(1);
    if (!w->patient || !w->impatient) {
        w->unexpected++;
        note(w, "reconnect failed");
    }
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    while (!atomic_load(&stop_flag) && w->patient && w->impatient) {
        uint32_t dice = rng_u(&w->g, 100);
        if (dice < 50)
            op_step(w, false);
        else if (dice < 62)
            op_stream(w);
        else if (dice < 68)
            op_step(w, true);
        else if (dice < 74)
            op_end(w);
        else if (dice < 80)
            op_forward_recorded(w);
        else if (dice < 98)
            op_bad(w);
        else
            op_reconnect(w);
    }
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// The daemon's process

static long rss_kib(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld", &v) == 1)
            break;
    if (f)
        fclose(f);
    return v;
}

// ---------------------------------------------------------------------------------------------
// Chaos: operators, garbage, a slow HTTP client.

struct chaos {
    pthread_t tid;
    int scrapes, scrape_fail, checkpoints, checkpoint_fail, garbage, health_fail;
    int slow_status;          // what the slow HTTP request got (408 expected)
    int regions, region_fail; // socket regions through their whole life, and those that failed
};

static void *slow_http_main(void *arg) {
    struct chaos *ch = arg;
    // A request that never finishes its head: the daemon must answer 408 and close.
    const char *part = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
    char *body = NULL;
    http_raw(d.http, part, strlen(part), 15000, &ch->slow_status, NULL, &body);
    free(body);
    return NULL;
}

// Sends msg to method and unpacks the reply as rd (NULL on failure).
static ProtobufCMessage *raw_call(struct rnnd_client *c, const char *method,
                                  const ProtobufCMessage *msg,
                                  const ProtobufCMessageDescriptor *rd) {
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n + 1);
    protobuf_c_message_pack(msg, buf);
    void *rep = NULL;
    size_t rlen = 0;
    ProtobufCMessage *out = NULL;
    if (rnnd_client_call_raw(c, method, buf, n, &rep, &rlen) == 0)
        out = protobuf_c_message_unpack(rd, NULL, rlen, rep);
    free(buf);
    free(rep);
    return out;
}

static bool io_all(int fd, void *p, size_t n, bool rd) {
    for (uint8_t *b = p; n > 0;) {
        ssize_t k = rd ? recv(fd, b, n, 0) : send(fd, b, n, MSG_NOSIGNAL);
        if (k <= 0)
            return false;
        b += k;
        n -= (size_t)k;
    }
    return true;
}

// True once the daemon closed fd within 5 s: end of file, or a reset where it closed with our
// bytes unread.
static bool daemon_closed(int fd) {
    char b;
    ssize_t k = recv(fd, &b, 1, 0);
    return k == 0 || (k < 0 && errno == ECONNRESET);
}

// A socket region's whole life (docs/design.md "Socket regions"): registered, its data
// connection opened with the key, a frame each way, then ended one of three ways by turn: the
// client closes the connection, ReleaseRegion, or a frame outside the region. Then a connection
// to the data port that sends garbage instead of a hello. Counts a failure where anything
// differs from the protocol; the reckoning checks that no region, descriptor or thread stays.
static void socket_region_life(struct rnnd_client *c, struct chaos *ch) {
    enum { SIZE = 4096 };
    uint8_t key[32], data[256], back[256];
    if (getrandom(key, sizeof key, 0) != (ssize_t)sizeof key ||
        getrandom(data, sizeof data, 0) != (ssize_t)sizeof data)
        return;
    Rnnd__V1__SocketRegion m = RNND__V1__SOCKET_REGION__INIT;
    m.size = SIZE;
    m.key = (ProtobufCBinaryData){sizeof key, key};
    Rnnd__V1__RegisterRegionRequest req = RNND__V1__REGISTER_REGION_REQUEST__INIT;
    req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_SOCKET;
    req.socket = &m;
    Rnnd__V1__RegisterRegionReply *r = (Rnnd__V1__RegisterRegionReply *)raw_call(
        c, "/rnnd.v1.Rnn/RegisterRegion", &req.base, &rnnd__v1__register_region_reply__descriptor);
    if (r == NULL) {
        ch->region_fail++;
        return;
    }
    uint64_t id = r->region;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", r->data_port);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    struct timeval tv = {.tv_sec = 5};
    int fd = tcp_connect(addr);
    bool ok = fd >= 0;
    if (ok) {
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        uint8_t hello[40];
        memcpy(hello, "RNNDSOCK", 8);
        memcpy(hello + 8, key, 32);
        uint64_t size = 0, echo = 0;
        uint64_t wr[3] = {1, 512, sizeof data}, sy[3] = {3, 9, 0}, rd[3] = {2, 512, sizeof back};
        ok = io_all(fd, hello, sizeof hello, false) && io_all(fd, &size, 8, true) && size == SIZE &&
             io_all(fd, wr, sizeof wr, false) && io_all(fd, data, sizeof data, false) &&
             io_all(fd, sy, sizeof sy, false) && io_all(fd, &echo, 8, true) && echo == 9 &&
             io_all(fd, rd, sizeof rd, false) && io_all(fd, back, sizeof back, true) &&
             memcmp(back, data, sizeof data) == 0;
    }
    if (ok && ch->regions % 3 == 1) {
        Rnnd__V1__ReleaseRegionRequest rel = RNND__V1__RELEASE_REGION_REQUEST__INIT;
        rel.region = id;
        ProtobufCMessage *out = raw_call(c, "/rnnd.v1.Rnn/ReleaseRegion", &rel.base,
                                         &rnnd__v1__release_region_reply__descriptor);
        ok = out != NULL && daemon_closed(fd);
        if (out)
            protobuf_c_message_free_unpacked(out, NULL);
    } else if (ok && ch->regions % 3 == 2) {
        uint64_t bad[3] = {2, SIZE - 4, 8};
        ok = io_all(fd, bad, sizeof bad, false) && daemon_closed(fd);
    }
    if (fd >= 0)
        close(fd);
    int g = tcp_connect(addr);
    if (g >= 0) {
        setsockopt(g, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        // Longer than a hello, so the daemon reads all of it and answers by closing.
        static const char junk[] = "GET / HTTP/1.0\r\n\r\n\x00\x01\x02garbage where a hello goes";
        ok = ok && io_all(g, (void *)junk, sizeof junk, false) && daemon_closed(g);
        close(g);
    }
    if (ok)
        ch->regions++;
    else
        ch->region_fail++;
}

static void *chaos_main(void *arg) {
    struct chaos *ch = arg;
    pthread_t slow;
    pthread_create(&slow, NULL, slow_http_main, ch);
    struct rnnd_client *c = connect_client(30000);
    double last_ckpt = now_seconds();
    while (!atomic_load(&stop_flag)) {
        int status;
        char *body = NULL;
        ch->scrapes++;
        if (http_get(d.http, "/metrics", &status, NULL, &body) != 0 || status != 200)
            ch->scrape_fail++;
        free(body);
        int hs = 0;
        if (rnnd_client_health(c, "rnnd.v1.Rnn", &hs) != 0 || hs != 1)
            ch->health_fail++;
        // Not HTTP/2 at all, on the gRPC port.
        int fd = tcp_connect(d.grpc);
        if (fd >= 0) {
            static const char junk[] = "GET / HTTP/1.0\r\n\r\n\x00\x01\x02garbage";
            if (write(fd, junk, sizeof junk) > 0)
                ch->garbage++;
            close(fd);
        }
        socket_region_life(c, ch);
        if (now_seconds() - last_ckpt > 3.0) {
            char *path = NULL;
            if (rnnd_client_save_checkpoint(c, NULL, &path, NULL) == 0)
                ch->checkpoints++;
            else
                ch->checkpoint_fail++;
            free(path);
            last_ckpt = now_seconds();
        }
        sleep_ms(100);
    }
    rnnd_client_free(c);
    pthread_join(slow, NULL);
    return NULL;
}

// ---------------------------------------------------------------------------------------------

static struct worker *workers;

static int setup(void **state) {
    (void)state;
    const char *args[] = {"--cell",
                          "gru",
                          "--input-size",
                          "8",
                          "--hidden-size",
                          "16",
                          "--layers",
                          "2",
                          "--trajectory-steps",
                          "16",
                          "--max-batch",
                          "256",
                          "--seed",
                          "5",
                          "--log-level",
                          "warn",
                          NULL};
    return daemon_start(&d, args);
}

static int teardown(void **state) {
    (void)state;
    if (d.pid && !daemon_alive(&d)) {
        fprintf(stderr, "rnnd died during the soak (status 0x%x)\n", d.exit_status);
        daemon_dump_log(&d, 4000);
    }
    daemon_free(&d);
    return 0;
}

static void test_soak(void **state) {
    (void)state;
    struct rnnd_client *main_c = daemon_client(&d, NULL);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(main_c, &info));
    int fd_before = daemon_fd_count(&d, false);
    assert_true(fd_before > 0); // /proc/PID/fd readable: else the leak check below could not fail
    long rss_start = rss_kib(d.pid);

    workers = calloc((size_t)opt.workers, sizeof *workers);
    for (int i = 0; i < opt.workers; i++) {
        struct worker *w = &workers[i];
        w->idx = i;
        w->g.s = opt.seed * 7919 + (uint64_t)i * 104729 + 1;
        ref_init(&w->r, main_c, opt.envs);
        for (int k = 0; k < opt.envs; k++)
            w->env[k].id = (uint64_t)i * 1000 + (uint64_t)k + 1;
        w->patient = connect_client(30000);
        w->impatient = connect_client(1);
        assert_non_null(w->patient);
        assert_non_null(w->impatient);
    }
    struct chaos ch = {0};
    double t0 = now_seconds();
    for (int i = 0; i < opt.workers; i++)
        pthread_create(&workers[i].tid, NULL, worker_main, &workers[i]);
    pthread_create(&ch.tid, NULL, chaos_main, &ch);

    // RSS once the warm-up is over (allocator arenas, gRPC buffers and env slots in use), then
    // every second to the end.
    double warm = opt.seconds * 0.3 < 2.0 ? 2.0 : opt.seconds * 0.3;
    long rss_warm = -1, rss_peak = 0, rss_end = 0;
    while (now_seconds() - t0 < opt.seconds) {
        sleep_ms(250);
        long v = rss_kib(d.pid);
        if (v > rss_peak)
            rss_peak = v;
        if (rss_warm < 0 && now_seconds() - t0 >= warm)
            rss_warm = v;
        rss_end = v;
        if (!daemon_alive(&d))
            break;
    }
    atomic_store(&stop_flag, true);
    for (int i = 0; i < opt.workers; i++)
        pthread_join(workers[i].tid, NULL);
    pthread_join(ch.tid, NULL);
    double elapsed = now_seconds() - t0;
    assert_true(daemon_alive(&d));
    // Requests lost on their way (dropped streams, passed deadlines) have arrived or been
    // cancelled by now.
    sleep_ms(2000);

    // The reckoning: each env's state, read back by repeating its last step (nothing advances).
    uint64_t held = 0, checked = 0, state_mismatch = 0;
    for (int i = 0; i < opt.workers; i++) {
        struct worker *w = &workers[i];
        struct pending p = {0};
        for (int k = 0; k < opt.envs; k++) {
            if (!w->env[k].alive)
                continue;
            p.rows[p.B] = k;
            p.ids[p.B] = w->env[k].id;
            p.index[p.B] = w->env[k].last_index;
            p.B++;
        }
        held += (uint64_t)p.B;
        if (p.B == 0)
            continue;
        struct rnnd_step_req req = step_req(&p, true);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(main_c, &req, &r));
        assert_tensor_f32(&r.h, 3, p.B, L_, H_, 0);
        for (int b = 0; b < p.B; b++) {
            const float *h = (const float *)r.h.data + (size_t)b * L_ * H_;
            const float *want = w->r.state_h + (size_t)p.rows[b] * L_ * H_;
            const float *out = (const float *)r.output.data + (size_t)b * H_;
            char what[96];
            snprintf(what, sizeof what, "env %llu state", (unsigned long long)p.ids[b]);
            bool ok = close_f32(what, h, want, L_ * H_, ATOL, RTOL);
            snprintf(what, sizeof what, "env %llu cached output", (unsigned long long)p.ids[b]);
            ok = close_f32(what, out, w->env[p.rows[b]].last_out, H_, 0, 0) && ok;
            state_mismatch += !ok;
            checked++;
        }
        rnnd_step_reply_free(&r);
    }
    EXPECT_OK(rnnd_client_info(main_c, &info));

    // Descriptors: every worker connection closed, the daemon back to where it started.
    for (int i = 0; i < opt.workers; i++) {
        rnnd_client_free(workers[i].patient);
        rnnd_client_free(workers[i].impatient);
        ref_free(&workers[i].r);
    }
    int fd_after = daemon_fds_settle(&d, fd_before);

    // Figures.
    uint64_t calls[N_CODES + 1] = {0}, steps = 0, resent = 0, mism = 0, unexp = 0, unans = 0,
                             streams = 0, dropped = 0, connect_failures = 0;
    for (int i = 0; i < opt.workers; i++) {
        struct worker *w = &workers[i];
        for (int c = 0; c <= N_CODES; c++)
            calls[c] += w->calls[c];
        steps += w->steps_ok;
        resent += w->resent;
        mism += w->mismatches;
        unexp += w->unexpected;
        unans += w->unanswered;
        streams += w->streams;
        dropped += w->dropped;
        connect_failures += w->connect_failures;
        for (int n = 0; n < w->n_notes; n++)
            fprintf(stderr, "  worker %d: %s\n", i, w->notes[n]);
    }
    uint64_t total = 0;
    for (int c = 0; c <= N_CODES; c++)
        total += calls[c];
    fprintf(stderr,
            "soak: %.1f s, %d workers x %d envs: %llu calls (%.0f/s), %llu steps applied, %llu "
            "resent after a lost reply, %llu StepStreams (%llu dropped by the client)\n",
            elapsed, opt.workers, opt.envs, (unsigned long long)total, (double)total / elapsed,
            (unsigned long long)steps, (unsigned long long)resent, (unsigned long long)streams,
            (unsigned long long)dropped);
    fprintf(stderr, "soak: calls by code:");
    for (int c = 0; c <= N_CODES; c++)
        if (calls[c])
            fprintf(stderr, " %s=%llu", c < N_CODES ? rnnd_grpc_status_name(c) : "local",
                    (unsigned long long)calls[c]);
    fprintf(stderr, "\n");
    fprintf(stderr,
            "soak: chaos: %d scrapes (%d failed), %d health failures, %d checkpoints (%d "
            "failed), %d garbage connections, slow HTTP request answered %d, %d socket regions "
            "through their life (%d failed)\n",
            ch.scrapes, ch.scrape_fail, ch.health_fail, ch.checkpoints, ch.checkpoint_fail,
            ch.garbage, ch.slow_status, ch.regions, ch.region_fail);
    fprintf(stderr,
            "soak: reckoning: %llu envs hold state (daemon says %llu), %llu checked, %llu state "
            "mismatches, %llu output mismatches, %llu unexpected, %llu unanswered, %llu client "
            "connect failures (retried)\n",
            (unsigned long long)held, (unsigned long long)info.envs_active,
            (unsigned long long)checked, (unsigned long long)state_mismatch,
            (unsigned long long)mism, (unsigned long long)unexp, (unsigned long long)unans,
            (unsigned long long)connect_failures);
    fprintf(stderr,
            "soak: daemon RSS %ld KiB at start, %ld after warm-up (%.1f s), %ld at the end, peak "
            "%ld; fds %d before, %d after\n",
            rss_start, rss_warm, warm, rss_end, rss_peak, fd_before, fd_after);

    assert_int_equal(unans, 0);
    assert_int_equal(unexp, 0);
    assert_int_equal(mism, 0);
    assert_int_equal(state_mismatch, 0);
    assert_int_equal(info.envs_active, held);
    assert_true(steps > 0 && checked > 0);
    assert_int_equal(ch.scrape_fail, 0);
    assert_int_equal(ch.health_fail, 0);
    assert_int_equal(ch.checkpoint_fail, 0);
    assert_int_equal(ch.slow_status, 408);
    assert_true(ch.regions > 0);
    assert_int_equal(ch.region_fail, 0);
    // Every socket region ended with its connection: none stays registered (their descriptors
    // and threads are in the count below).
    int status;
    char *body = NULL;
    assert_int_equal(http_get(d.http, "/metrics", &status, NULL, &body), 0);
    assert_non_null(strstr(body, "\nrnnd_shm_regions 0\n"));
    free(body);
    assert_true(fd_after <= fd_before);
    // Flat: after the warm-up the daemon may settle a little, not grow with the calls served.
    long allowance = opt.rss_allowance_mb * 1024 + rss_warm / 10;
    if (rss_end - rss_warm > allowance)
        fail_msg("daemon RSS grew by %ld KiB after the warm-up (allowed %ld)", rss_end - rss_warm,
                 allowance);
    rnnd_client_free(main_c);
    free(workers);
}

int main(int argc, char **argv) {
    const char *env = getenv("RNND_SOAK_SECONDS");
    if (env)
        opt.seconds = atoi(env);
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--seconds") == 0)
            opt.seconds = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--workers") == 0)
            opt.workers = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--envs") == 0)
            opt.envs = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--seed") == 0)
            opt.seed = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--rss-allowance-mb") == 0)
            opt.rss_allowance_mb = atol(argv[i + 1]);
        else {
            fprintf(stderr, "usage: soak [--seconds N] [--workers N] [--envs K] [--seed S] "
                            "[--rss-allowance-mb M]\n");
            return 2;
        }
    }
    if (opt.seconds < 1 || opt.workers < 1 || opt.envs < 2 || opt.envs > MAX_K) {
        fprintf(stderr, "soak: --seconds >= 1, --workers >= 1, 2 <= --envs <= %d\n", MAX_K);
        return 2;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_soak)};
    return cmocka_run_group_tests_name("soak", tests, setup, teardown) ? 1 : 0;
}
