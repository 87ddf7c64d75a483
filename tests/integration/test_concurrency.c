/*
 * test_concurrency.c: many client threads at once, each on its own connection and its own envs,
 * half with unary Step and half with pipelined StepStream requests that name the same envs
 * back to back. Every reply is checked against a per-thread CPU reference: a lost, duplicated or
 * reordered step of any env shows up as a wrong output from then on. Retry-safe step indices ride
 * along, so the daemon's index bookkeeping is exercised under load too. At the end the daemon's
 * env count and the merged-batch metrics are checked. Last, clients that give up (a 1 ms deadline,
 * or a connection abandoned at once) and are freed must leave no connection open in the daemon.
 * The many clients run again against a daemon with reply threads and row workers (thread pools
 * that split a batch's row copies and send its replies), with batches of up to 1024 rows, and
 * then with the engine's look-ahead (the next batch gathered while one runs). Retries racing
 * their first try must each be answered with that one step's output.
 *
 * Threads never call cmocka (it is not thread-safe): they record failures, the main thread asserts.
 */
#include "harness.h"

#include <grpc/status.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define I_      16
#define H_      32
#define NTHREAD 8
#define NENV    64 // per thread: together, batches of more than 256 rows (the row workers')
#define ROUNDS  60
#define DEPTH   3 // pipelined requests per stream round
#define ATOL    2e-5f
#define RTOL    1e-4f

struct worker {
    int idx;
    struct daemon *d;
    struct rnnd_client *c;
    struct ref r;
    bool stream;
    uint64_t steps;      // env-steps acknowledged
    uint64_t last[NENV]; // last step_index per env
    int failures;
    char first_failure[1200];
    pthread_t tid;
};

static struct daemon d;

static void note_fail(struct worker *w, const char *fmt, ...) {
    if (w->failures++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->first_failure, sizeof w->first_failure, fmt, ap);
        va_end(ap);
    }
}

static uint64_t env_id(int worker, int k) {
    return 0xABC0000000ull + (uint64_t)worker * 1000 + (uint64_t)k;
}

struct req_buf {
    int B;
    uint64_t ids[NENV], idx[NENV];
    int32_t slots[NENV];
    bool init[NENV];
    float obs[NENV * I_];
};

static void make(struct worker *w, struct rng *g, int round, struct req_buf *q) {
    int perm[NENV];
    rng_perm(g, perm, NENV);
    q->B = round == 0 ? NENV : 1 + (int)rng_u(g, NENV);
    for (int b = 0; b < q->B; b++) {
        int k = perm[b];
        q->slots[b] = k;
        q->ids[b] = env_id(w->idx, k);
        q->init[b] = round == 0 || rng_u(g, 8) == 0;
        q->idx[b] = round == 0 ? 0 : ++w->last[k];
    }
    rng_fill(g, q->obs, (size_t)q->B * I_);
}

static struct rnnd_step_req as_req(struct req_buf *q) {
    return (struct rnnd_step_req){.n_env_ids = (size_t)q->B,
                                  .env_ids = q->ids,
                                  .obs = rnnd_tensor_f32(q->obs, 2, q->B, I_, 0, 0),
                                  .n_is_init = (size_t)q->B,
                                  .is_init = q->init,
                                  .n_step_index = (size_t)q->B,
                                  .step_index = q->idx};
}

static void check(struct worker *w, struct req_buf *q, const struct rnnd_step_reply *r,
                  const char *what, int round) {
    float out[NENV * H_];
    ref_step(&w->r, q->B, q->slots, q->obs, q->init, out);
    if (!r->output.present || r->output.nbytes != (size_t)q->B * H_ * sizeof(float)) {
        note_fail(w, "worker %d %s round %d: output has %zu bytes, want %zu", w->idx, what, round,
                  r->output.nbytes, (size_t)q->B * H_ * sizeof(float));
        return;
    }
    const float *got = r->output.data;
    for (int k = 0; k < q->B * H_; k++) {
        if (!(fabsf(got[k] - out[k]) <= ATOL + RTOL * fabsf(out[k]))) {
            note_fail(w, "worker %d %s round %d: env %llu value %d is %.7g, reference %.7g", w->idx,
                      what, round, (unsigned long long)q->ids[k / H_], k % H_, got[k], out[k]);
            return;
        }
    }
    w->steps += (uint64_t)q->B;
}

static void *work(void *arg) {
    struct worker *w = arg;
    struct rng g = {1000 + (uint64_t)w->idx};
    struct req_buf q[DEPTH];
    struct rnnd_client_stream *s = NULL;
    if (w->stream && rnnd_client_stream_init(w->c, &s) != 0) {
        note_fail(w, "worker %d: StepStream: %s", w->idx, rnnd_client_last_error()->message);
        return NULL;
    }
    for (int round = 0; round < ROUNDS && !w->failures; round++) {
        if (!s) {
            make(w, &g, round, &q[0]);
            struct rnnd_step_req req = as_req(&q[0]);
            struct rnnd_step_reply r;
            if (rnnd_client_step(w->c, &req, &r) != 0)
                note_fail(w, "worker %d round %d: Step: %s: %s", w->idx, round,
                          rnnd_grpc_status_name(rnnd_client_last_error()->grpc_status),
                          rnnd_client_last_error()->message);
            else
                check(w, &q[0], &r, "Step", round);
            rnnd_step_reply_free(&r);
            continue;
        }
        int depth = round == 0 ? 1 : DEPTH;
        for (int k = 0; k < depth; k++) {
            make(w, &g, round == 0 ? 0 : 1, &q[k]);
            struct rnnd_step_req req = as_req(&q[k]);
            if (rnnd_client_stream_send(s, &req) != 0) {
                note_fail(w, "worker %d round %d: send: %s", w->idx, round,
                          rnnd_client_last_error()->message);
                break;
            }
        }
        for (int k = 0; k < depth && !w->failures; k++) {
            struct rnnd_step_reply r;
            if (rnnd_client_stream_recv(s, &r) != 0)
                note_fail(w, "worker %d round %d: recv: %s: %s", w->idx, round,
                          rnnd_grpc_status_name(rnnd_client_last_error()->grpc_status),
                          rnnd_client_last_error()->message);
            else
                check(w, &q[k], &r, "StepStream", round);
            rnnd_step_reply_free(&r);
        }
    }
    if (s) {
        if (!w->failures && rnnd_client_stream_close(s) != 0)
            note_fail(w, "worker %d: stream close: %s", w->idx, rnnd_client_last_error()->message);
        rnnd_client_stream_free(s);
    }
    return NULL;
}

static int setup(void **state) {
    (void)state;
    const char *args[] = {"--cell",      "gru", "--input-size",   "16",  "--hidden-size", "32",
                          "--max-batch", "64",  "--max-delay-us", "500", "--seed",        "5",
                          NULL};
    return daemon_start(&d, args);
}

static int teardown(void **state) {
    (void)state;
    daemon_teardown(&d);
    return 0;
}

static void test_many_clients(void **state) {
    (void)state;
    struct worker *w = calloc(NTHREAD, sizeof *w);
    for (int k = 0; k < NTHREAD; k++) {
        w[k].idx = k;
        w[k].d = &d;
        w[k].c = daemon_client(&d, NULL);
        w[k].stream = k % 2 == 1;
        ref_init(&w[k].r, w[k].c, NENV);
    }
    double t0 = now_seconds();
    for (int k = 0; k < NTHREAD; k++)
        pthread_create(&w[k].tid, NULL, work, &w[k]);
    uint64_t steps = 0;
    int failures = 0;
    for (int k = 0; k < NTHREAD; k++) {
        pthread_join(w[k].tid, NULL);
        if (w[k].failures)
            fprintf(stderr, "%s (%d failures in this thread)\n", w[k].first_failure, w[k].failures);
        failures += w[k].failures;
        steps += w[k].steps;
    }
    fprintf(stderr, "  %d threads: %llu env-steps checked in %.2f s\n", NTHREAD,
            (unsigned long long)steps, now_seconds() - t0);
    assert_int_equal(failures, 0);

    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(w[0].c, &info));
    assert_int_equal(info.envs_active, NTHREAD * NENV);

    // Each env's step count is known: the next index is accepted and a resend of the last one
    // is answered from the cache, so the daemon counted exactly the steps we sent.
    for (int k = 0; k < NTHREAD; k++) {
        for (int e = 0; e < NENV; e += 5) {
            uint64_t id = env_id(k, e), idx = w[k].last[e];
            float x[I_] = {0};
            struct rnnd_step_req req = {.n_env_ids = 1,
                                        .env_ids = &id,
                                        .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                        .n_step_index = 1,
                                        .step_index = &idx};
            struct rnnd_step_reply r;
            EXPECT_OK(rnnd_client_step(w[k].c, &req, &r)); // a resend: cached
            rnnd_step_reply_free(&r);
            idx += 2;
            EXPECT_STATUS(rnnd_client_step(w[k].c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
        }
    }
    for (int k = 0; k < NTHREAD; k++) {
        ref_free(&w[k].r);
        rnnd_client_free(w[k].c);
    }
    free(w);
}

// Requests from many connections are merged into backend batches: the mean batch (rows per
// backend call) must exceed the mean request size once several clients send at once.
struct blaster {
    struct rnnd_client *c;
    int idx;
    int errors;
    pthread_t tid;
};

static void *blast(void *arg) {
    struct blaster *b = arg;
    uint64_t id = 0xBB00000000ull + (uint64_t)b->idx;
    float x[I_];
    struct rng g = {(uint64_t)b->idx + 1};
    rng_fill(&g, x, I_);
    bool init = true;
    for (int k = 0; k < 150; k++) {
        struct rnnd_step_req req = {.n_env_ids = 1,
                                    .env_ids = &id,
                                    .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                    .n_is_init = 1,
                                    .is_init = &init};
        struct rnnd_step_reply r;
        if (rnnd_client_step(b->c, &req, &r) != 0)
            b->errors++;
        rnnd_step_reply_free(&r);
        init = false;
    }
    return NULL;
}

static void test_batches_merge(void **state) {
    (void)state;
    enum { N = 16 };
    int status;
    char *before = NULL, *after = NULL;
    assert_int_equal(http_get(d.http, "/metrics", &status, NULL, &before), 0);
    assert_int_equal(status, 200);
    struct blaster b[N];
    for (int k = 0; k < N; k++) {
        b[k] = (struct blaster){.c = daemon_client(&d, NULL), .idx = k};
        rnnd_client_wait_connected(b[k].c, 5000);
    }
    for (int k = 0; k < N; k++)
        pthread_create(&b[k].tid, NULL, blast, &b[k]);
    int errors = 0;
    for (int k = 0; k < N; k++) {
        pthread_join(b[k].tid, NULL);
        errors += b[k].errors;
        rnnd_client_free(b[k].c);
    }
    assert_int_equal(errors, 0);
    assert_int_equal(http_get(d.http, "/metrics", &status, NULL, &after), 0);
    // The batch-size histogram: rows summed in _sum, backend calls in _count.
    double rows = prom_value(after, "rnnd_batch_rows_sum", NULL) -
                  prom_value(before, "rnnd_batch_rows_sum", NULL);
    double calls = prom_value(after, "rnnd_batch_rows_count", NULL) -
                   prom_value(before, "rnnd_batch_rows_count", NULL);
    if (isnan(rows) || isnan(calls))
        fprintf(stderr, "no rnnd_batch_rows histogram in /metrics:\n%s\n", after);
    assert_false(isnan(rows) || isnan(calls));
    fprintf(stderr, "  %d single-env clients: %.0f rows in %.0f backend batches (mean %.2f)\n", N,
            rows, calls, rows / calls);
    assert_true(rows >= N * 150);
    assert_true(rows / calls > 1.5);
    free(before);
    free(after);
}

// Several clients send the same retry-safe step of the same envs at once, round after round
// (an actor's retry racing its first try): each step runs once, every reply is that step's
// output, and the next round's index is accepted. A copy admitted while the first one's batch
// still runs would run the step again and answer with the step after it.
#define DUP_CLIENTS 4
#define DUP_ROUNDS  40

struct dup_sender {
    struct rnnd_client *c;
    const struct req_buf *q;
    float out[NENV * H_];
    int err;
    char msg[1100];
    pthread_barrier_t *go;
    pthread_t tid;
};

static void *dup_send(void *arg) {
    struct dup_sender *t = arg;
    struct req_buf q = *t->q;
    struct rnnd_step_req req = as_req(&q);
    struct rnnd_step_reply r;
    pthread_barrier_wait(t->go);
    t->err = rnnd_client_step(t->c, &req, &r);
    if (t->err)
        snprintf(t->msg, sizeof t->msg, "%s", rnnd_client_last_error()->message);
    else if (r.output.nbytes == sizeof t->out)
        memcpy(t->out, r.output.data, sizeof t->out);
    else
        t->err = -1;
    rnnd_step_reply_free(&r);
    return NULL;
}

static void test_duplicates_race(void **state) {
    (void)state;
    struct dup_sender t[DUP_CLIENTS];
    for (int k = 0; k < DUP_CLIENTS; k++) {
        t[k] = (struct dup_sender){.c = daemon_client(&d, NULL)};
        rnnd_client_wait_connected(t[k].c, 5000);
    }
    struct worker w = {.idx = 77};
    ref_init(&w.r, t[0].c, NENV);
    struct rng g = {4242};
    struct req_buf q;
    float want[NENV * H_];
    for (int round = 0; round < DUP_ROUNDS; round++) {
        q.B = NENV;
        for (int b = 0; b < NENV; b++) {
            q.slots[b] = b;
            q.ids[b] = env_id(w.idx, b);
            q.init[b] = round == 0;
            q.idx[b] = (uint64_t)round;
        }
        rng_fill(&g, q.obs, (size_t)NENV * I_);
        ref_step(&w.r, NENV, q.slots, q.obs, q.init, want);
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, DUP_CLIENTS);
        for (int k = 0; k < DUP_CLIENTS; k++) {
            t[k].q = &q;
            t[k].go = &go;
            pthread_create(&t[k].tid, NULL, dup_send, &t[k]);
        }
        for (int k = 0; k < DUP_CLIENTS; k++)
            pthread_join(t[k].tid, NULL);
        pthread_barrier_destroy(&go);
        for (int k = 0; k < DUP_CLIENTS; k++) {
            if (t[k].err)
                fprintf(stderr, "round %d client %d: %s\n", round, k, t[k].msg);
            assert_int_equal(t[k].err, 0);
            for (int i = 0; i < NENV * H_; i++) {
                if (!(fabsf(t[k].out[i] - want[i]) <= ATOL + RTOL * fabsf(want[i])))
                    fprintf(stderr, "round %d client %d value %d: %.7g, reference %.7g\n", round, k,
                            i, t[k].out[i], want[i]);
                assert_true(fabsf(t[k].out[i] - want[i]) <= ATOL + RTOL * fabsf(want[i]));
            }
        }
    }
    ref_free(&w.r);
    for (int k = 0; k < DUP_CLIENTS; k++)
        rnnd_client_free(t[k].c);
}

// Clients that give up while their connection is still being made, and are then freed, leave
// nothing open in the daemon. gRPC 1.51 leaks a connection that completes after its channel is
// gone (grpc/grpc#32071): before rnnd_client_free let the attempt finish, this loop left 58-61
// ESTABLISHED connections on both sides (4 runs of 4).
static void test_impatient_clients(void **state) {
    (void)state;
    struct rnnd_client *keep = daemon_client(&d, NULL); // gRPC stays initialised, as in an actor
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(keep, &info));
    int before = daemon_fd_count(&d, false);
    assert_true(before > 0); // /proc/PID/fd readable: else the check below could not fail
    int deadline_exceeded = 0, gave_up = 0;
    double t0 = now_seconds();
    for (int k = 0; k < 2000; k++) {
        struct rnnd_client_opts o = {.target = d.grpc, .timeout_ms = 1};
        struct rnnd_client *c = NULL;
        assert_int_equal(rnnd_client_init(&o, &c), 0);
        if (k % 2 == 0) // a call, usually answered in time
            deadline_exceeded +=
                rnnd_client_info(c, &info) != 0 &&
                rnnd_client_last_error()->grpc_status == GRPC_STATUS_DEADLINE_EXCEEDED;
        else // a connection asked for and (mostly) given up on at once: freed while connecting
            gave_up += rnnd_client_wait_connected(c, 0) != 0;
        rnnd_client_free(c);
    }
    int after = daemon_fds_settle(&d, before);
    fprintf(stderr,
            "  2000 impatient clients in %.2f s (%d calls past their deadline, %d connections "
            "given up on): daemon descriptors %d before, %d after\n",
            now_seconds() - t0, deadline_exceeded, gave_up, before, after);
    assert_true(after <= before);
    rnnd_client_free(keep);
}

// The same model with two reply threads and two row workers, batches of up to max_batch rows,
// and, with lookahead, the engine's look-ahead on (by default only where the backend's memory
// is its own) with the engine thread alone taking the batches, so that chains of them form.
static int start_pools(const char *max_batch, const char *max_delay_us, bool lookahead) {
    const char *args[] = {"--cell",
                          "gru",
                          "--input-size",
                          "16",
                          "--hidden-size",
                          "32",
                          "--max-batch",
                          max_batch,
                          "--max-delay-us",
                          max_delay_us,
                          "--seed",
                          "5",
                          "--reply-threads",
                          "2",
                          lookahead ? "--step-lookahead" : NULL,
                          "1",
                          "--inline-steps",
                          "0",
                          NULL};
    return daemon_start(&d, args);
}

static int setup_pools(void **state) {
    (void)state;
    return start_pools("1024", "500", false);
}

static int setup_lookahead(void **state) {
    (void)state;
    return start_pools("64", "0", true);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_clients),
        cmocka_unit_test(test_batches_merge),
        cmocka_unit_test(test_impatient_clients),
    };
    const struct CMUnitTest pools[] = {
        cmocka_unit_test(test_many_clients),
        cmocka_unit_test(test_duplicates_race),
    };
    int failed = cmocka_run_group_tests_name("concurrency", tests, setup, teardown);
    failed +=
        cmocka_run_group_tests_name("concurrency with thread pools", pools, setup_pools, teardown);
    failed += cmocka_run_group_tests_name("concurrency with the look-ahead", pools, setup_lookahead,
                                          teardown);
    return failed ? 1 : 0;
}
