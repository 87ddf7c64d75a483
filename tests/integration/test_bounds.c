/*
 * test_bounds.c: the drain and the bounds on what clients can hold. A drain delivers every reply
 * of a call admitted before it, however large and however slowly read, and lets open StepStreams
 * go on until --drain-timeout-s, then ends them with a clean status (not gRPC's "Cancelling all
 * calls"); replies not yet read are bounded by --max-reply-mb (reserved before any work, so a
 * flood of calls arriving together is refused too) and hold their --max-streams slot until
 * sent; gRPC connections (silent TCP ones included) by --max-connections; health Watch streams
 * by --max-health-watches; idle StepStreams and unread replies by --stream-idle-timeout-s;
 * requests over --max-message-mb are counted. Each bound shows in rnnd_limit,
 * rnnd_limit_rejections_total and its gauge.
 *
 * A client that does not read its replies is a plain gRPC core call that posts no receive: with
 * BDP probing off its connection grants the server 64 KiB, so a reply of a few MiB stays in the
 * daemon until the test reads it.
 */
#include "harness.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/status.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rnnd/v1/rnnd.pb-c.h"

#define I_ 8
#define H_ 32
// A Forward of B_ x T_ steps: a 1 MiB request and a 4 MiB reply.
#define B_ 8
#define T_ 4096

// ---------------------------------------------------------------------------------------------
// Helpers

static double limit_of(const struct daemon *d, const char *family, const char *resource) {
    char labels[64];
    snprintf(labels, sizeof labels, "resource=\"%s\"", resource);
    return daemon_metric(d, family, labels);
}

// Waits up to timeout_ms for metric name{labels} to equal want; true when it did.
static bool metric_wait(const struct daemon *d, const char *name, const char *labels, double want,
                        int timeout_ms) {
    double t0 = now_seconds();
    double v;
    while ((v = daemon_metric(d, name, labels)) != want && (now_seconds() - t0) * 1000 < timeout_ms)
        sleep_ms(20);
    if (v != want)
        fprintf(stderr, "  %s{%s} is %g, want %g\n", name, labels ? labels : "", v, want);
    return v == want;
}

// The obs of every stream step here: these tests check what is admitted, not outputs.
static float obs1[I_] = {0.25f};

static const char *last_message(void) {
    return rnnd_client_last_error()->message;
}

static bool exited_ok(struct daemon *d, int timeout_ms) {
    double t0 = now_seconds();
    while (daemon_alive(d) && (now_seconds() - t0) * 1000 < timeout_ms)
        sleep_ms(10);
    if (daemon_alive(d)) {
        fprintf(stderr, "  rnnd still running %d ms after SIGTERM\n", timeout_ms);
        daemon_dump_log(d, 3000);
        return false;
    }
    if (!WIFEXITED(d->exit_status) || WEXITSTATUS(d->exit_status) != 0) {
        daemon_dump_log(d, 3000);
        return false;
    }
    return true;
}

// The packed ForwardRequest of B_ x T_ steps of obs (new, free()).
static void *forward_request(size_t *len) {
    static float obs[B_ * T_ * I_];
    for (size_t k = 0; k < sizeof obs / sizeof obs[0]; k++)
        obs[k] = 0.001f * (float)(k % 977);
    int64_t shape[3] = {B_, T_, I_};
    Rnnd__V1__Tensor t = RNND__V1__TENSOR__INIT;
    t.n_shape = 3;
    t.shape = shape;
    t.dtype = RNND__V1__DTYPE__FLOAT32;
    t.data.len = sizeof obs;
    t.data.data = (uint8_t *)obs;
    Rnnd__V1__Trajectories tr = RNND__V1__TRAJECTORIES__INIT;
    tr.obs = &t;
    Rnnd__V1__ForwardRequest req = RNND__V1__FORWARD_REQUEST__INIT;
    req.source_case = RNND__V1__FORWARD_REQUEST__SOURCE_TRAJECTORIES;
    req.trajectories = &tr;
    *len = rnnd__v1__forward_request__get_packed_size(&req);
    void *buf = malloc(*len);
    rnnd__v1__forward_request__pack(&req, buf);
    return buf;
}

// A channel of gRPC core with BDP probing off: unread replies stay with the server.
static grpc_channel *raw_channel(const struct daemon *d) {
    grpc_arg args[3];
    memset(args, 0, sizeof args);
    const char *keys[3] = {GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                           GRPC_ARG_HTTP2_BDP_PROBE};
    int values[3] = {-1, -1, 0};
    for (int i = 0; i < 3; i++) {
        args[i].type = GRPC_ARG_INTEGER;
        args[i].key = (char *)keys[i];
        args[i].value.integer = values[i];
    }
    grpc_channel_args ca = {3, args};
    grpc_channel_credentials *cr = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(d->grpc, cr, &ca);
    grpc_channel_credentials_release(cr);
    return ch;
}

// A unary call that sends its request and reads nothing until raw_finish.
struct raw {
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_byte_buffer *send, *reply;
    grpc_metadata_array md, trailing;
    grpc_status_code status;
    grpc_slice details;
};

static gpr_timespec in_ms(int ms) {
    return gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void raw_start(struct raw *r, grpc_channel *ch, const char *method, const void *req,
                      size_t len) {
    memset(r, 0, sizeof *r);
    r->cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_slice m = grpc_slice_from_static_string(method);
    r->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, r->cq, m, NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_slice s = grpc_slice_from_copied_buffer(req, len);
    r->send = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_metadata_array_init(&r->md);
    grpc_metadata_array_init(&r->trailing);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = r->send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    assert_int_equal(grpc_call_start_batch(r->call, ops, 3, (void *)1, NULL), GRPC_CALL_OK);
    grpc_event ev = grpc_completion_queue_pluck(r->cq, (void *)1, in_ms(10000), NULL);
    assert_int_equal(ev.type, GRPC_OP_COMPLETE);
}

// Reads the reply and the status: the status code, the reply's size in *len.
static int raw_finish(struct raw *r, size_t *len) {
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[0].data.recv_initial_metadata.recv_initial_metadata = &r->md;
    ops[1].op = GRPC_OP_RECV_MESSAGE;
    ops[1].data.recv_message.recv_message = &r->reply;
    ops[2].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[2].data.recv_status_on_client.trailing_metadata = &r->trailing;
    ops[2].data.recv_status_on_client.status = &r->status;
    ops[2].data.recv_status_on_client.status_details = &r->details;
    assert_int_equal(grpc_call_start_batch(r->call, ops, 3, (void *)2, NULL), GRPC_CALL_OK);
    grpc_event ev = grpc_completion_queue_pluck(r->cq, (void *)2, in_ms(20000), NULL);
    assert_int_equal(ev.type, GRPC_OP_COMPLETE);
    *len = r->reply ? grpc_byte_buffer_length(r->reply) : 0;
    if (r->status != GRPC_STATUS_OK) {
        char *d = grpc_slice_to_c_string(r->details);
        fprintf(stderr, "  raw call: %s: %s\n", rnnd_grpc_status_name(r->status), d);
        gpr_free(d);
    }
    return r->status;
}

// True when the reply is a ForwardReply with output [B_, T_, H_].
static bool raw_forward_complete(struct raw *r) {
    grpc_byte_buffer_reader rd;
    if (r->reply == NULL || !grpc_byte_buffer_reader_init(&rd, r->reply))
        return false;
    grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    Rnnd__V1__ForwardReply *fr =
        rnnd__v1__forward_reply__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    bool ok = fr && fr->output && fr->output->n_shape == 3 && fr->output->shape[0] == B_ &&
              fr->output->shape[1] == T_ && fr->output->shape[2] == H_ &&
              fr->output->data.len == (size_t)B_ * T_ * H_ * sizeof(float);
    if (fr)
        rnnd__v1__forward_reply__free_unpacked(fr, NULL);
    return ok;
}

static void raw_free(struct raw *r) {
    if (r->call == NULL)
        return;
    grpc_call_cancel(r->call, NULL);
    grpc_call_unref(r->call);
    grpc_completion_queue_shutdown(r->cq);
    while (
        grpc_completion_queue_pluck(r->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
        GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(r->cq);
    grpc_byte_buffer_destroy(r->send);
    if (r->reply)
        grpc_byte_buffer_destroy(r->reply);
    grpc_metadata_array_destroy(&r->md);
    grpc_metadata_array_destroy(&r->trailing);
    grpc_slice_unref(r->details);
    memset(r, 0, sizeof *r);
}

static int setup(void **state) {
    (void)state;
    grpc_init();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    grpc_shutdown();
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The drain

// A 4 MiB Forward reply its client reads only after SIGTERM still arrives whole; a StepStream
// open at SIGTERM goes on stepping; the daemon exits 0 as soon as both are done.
static void test_drain_delivers_replies(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {"--input-size", "8", "--hidden-size", "32", "--drain-timeout-s",
                          "30",           NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct rnnd_client_stream *s;
    EXPECT_OK(rnnd_client_stream_init(c, &s));
    EXPECT_OK(stream_step1(s, 1, obs1, I_, true));

    grpc_channel *ch = raw_channel(&d);
    size_t len;
    void *req = forward_request(&len);
    struct raw r;
    raw_start(&r, ch, "/rnnd.v1.Rnn/Forward", req, len);
    assert_true(metric_wait(&d, "rnnd_requests_total", "method=\"Forward\",code=\"OK\"", 1, 5000));
    // The reply has been handed to gRPC and waits for its client.
    assert_true(daemon_metric(&d, "rnnd_reply_bytes", NULL) > 4e6);

    double t0 = now_seconds();
    kill(d.pid, SIGTERM);
    sleep_ms(300);
    assert_true(daemon_alive(&d));
    assert_true(daemon_metric(&d, "rnnd_ready", NULL) == 0);
    // New calls are refused; the open stream is served.
    int info_err = rnnd_client_info(c, &(struct rnnd_model_info){0});
    EXPECT_STATUS(info_err, GRPC_STATUS_UNAVAILABLE);
    EXPECT_OK(stream_step1(s, 1, obs1, I_, false));

    double read_at = now_seconds() - t0;
    size_t got;
    assert_int_equal(raw_finish(&r, &got), GRPC_STATUS_OK);
    assert_true(got > (size_t)B_ * T_ * H_ * sizeof(float));
    assert_true(raw_forward_complete(&r));
    EXPECT_OK(rnnd_client_stream_close(s));
    assert_true(exited_ok(&d, 10000));
    fprintf(stderr, "  4 MiB reply read %.2f s into the drain, whole; exit 0 after %.2f s\n",
            read_at, now_seconds() - t0);

    rnnd_client_stream_free(s);
    raw_free(&r);
    grpc_channel_destroy(ch);
    free(req);
    rnnd_client_free(c);
    daemon_free(&d);
}

// At --drain-timeout-s a StepStream still open ends with the daemon's own UNAVAILABLE status.
static void test_drain_timeout_ends_streams(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {
        "--input-size", "8", "--hidden-size", "32", "--drain-timeout-s", "1", NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct rnnd_client_stream *s;
    EXPECT_OK(rnnd_client_stream_init(c, &s));
    EXPECT_OK(stream_step1(s, 1, obs1, I_, true));
    double t0 = now_seconds();
    kill(d.pid, SIGTERM);
    int ok = 0, err;
    while ((err = stream_step1(s, 1, obs1, I_, false)) == 0 && now_seconds() - t0 < 10) {
        ok++;
        sleep_ms(50);
    }
    double ended = now_seconds() - t0;
    fprintf(stderr, "  %d steps during the drain; the stream ended after %.2f s: %s\n", ok, ended,
            last_message());
    EXPECT_STATUS(err, GRPC_STATUS_UNAVAILABLE);
    assert_non_null(strstr(last_message(), "shutting down"));
    assert_true(ok >= 5);
    assert_true(ended >= 0.9 && ended < 3);
    assert_true(exited_ok(&d, 5000));
    rnnd_client_stream_free(s);
    rnnd_client_free(c);
    daemon_free(&d);
}

// ---------------------------------------------------------------------------------------------
// Bounds

// Replies not read are bounded by --max-reply-mb, reserved before the work: of four Forwards
// sent without reading, two fit; the calls whose replies wait count as active and hold
// their --max-streams slot.
static void test_reply_budget(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {"--input-size",
                          "8",
                          "--hidden-size",
                          "32",
                          "--max-reply-mb",
                          "10",
                          "--max-message-mb",
                          "8",
                          "--max-streams",
                          "3",
                          NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    assert_true(limit_of(&d, "rnnd_limit", "reply_bytes") == 10 << 20);
    grpc_channel *ch = raw_channel(&d);
    size_t len;
    void *req = forward_request(&len);
    enum { N = 4 };
    struct raw r[N];
    raw_start(&r[0], ch, "/rnnd.v1.Rnn/Forward", req, len);
    raw_start(&r[1], ch, "/rnnd.v1.Rnn/Forward", req, len);
    assert_true(metric_wait(&d, "rnnd_requests_total", "method=\"Forward\",code=\"OK\"", 2, 5000));
    // One at a time, each once the one before has given its --max-streams slot back: sent
    // together, the last could find the slot of the one being refused still taken.
    for (int k = 2; k < N; k++) {
        raw_start(&r[k], ch, "/rnnd.v1.Rnn/Forward", req, len);
        assert_true(metric_wait(&d, "rnnd_limit_rejections_total", "resource=\"reply_bytes\"",
                                k - 1, 5000));
        assert_true(metric_wait(&d, "rnnd_streams_active", NULL, 2, 5000));
    }
    double held = daemon_metric(&d, "rnnd_reply_bytes", NULL);
    fprintf(stderr, "  two 4 MiB replies unread hold %.1f MiB\n", held / 1048576.0);
    assert_true(held > 8e6 && held <= 10 << 20);
    assert_true(daemon_metric(&d, "rnnd_streams_active", NULL) == 2);

    // Small replies still fit; the third slot goes to a stream, then every slot is taken.
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct rnnd_client_stream *s;
    EXPECT_OK(rnnd_client_stream_init(c, &s));
    EXPECT_OK(stream_step1(s, 1, obs1, I_, true));
    struct rnnd_model_info info;
    EXPECT_STATUS(rnnd_client_info(c, &info), GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(last_message(), "--max-streams"));

    int ok = 0, full = 0;
    for (int k = 0; k < N; k++) {
        size_t got;
        int st = raw_finish(&r[k], &got);
        if (st == GRPC_STATUS_OK && raw_forward_complete(&r[k]))
            ok++;
        else if (st == GRPC_STATUS_RESOURCE_EXHAUSTED &&
                 strstr((char *)GRPC_SLICE_START_PTR(r[k].details), "--max-reply-mb"))
            full++;
        raw_free(&r[k]);
    }
    assert_int_equal(ok, 2);
    assert_int_equal(full, 2);
    // Read, the replies give back their bytes and slots.
    assert_true(metric_wait(&d, "rnnd_reply_bytes", NULL, 0, 5000) ||
                daemon_metric(&d, "rnnd_reply_bytes", NULL) < 8192);
    assert_true(metric_wait(&d, "rnnd_streams_active", NULL, 1, 5000));
    EXPECT_OK(rnnd_client_info(c, &info));
    EXPECT_OK(rnnd_client_stream_close(s));
    rnnd_client_stream_free(s);
    rnnd_client_free(c);
    grpc_channel_destroy(ch);
    free(req);
    daemon_free(&d);
}

// --max-connections counts every connection, a silent TCP one too; the one over it is closed at
// once, the others keep working, and a freed place is taken again.
static void test_connection_bound(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {
        "--input-size", "8", "--hidden-size", "32", "--max-connections", "3", NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    assert_true(limit_of(&d, "rnnd_limit", "connections") == 3);
    struct rnnd_client *c1 = daemon_client(&d, NULL), *c2 = daemon_client(&d, NULL);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c1, &info));
    EXPECT_OK(rnnd_client_info(c2, &info));
    int silent = tcp_connect(d.grpc);
    assert_true(silent >= 0);
    assert_true(metric_wait(&d, "rnnd_connections", NULL, 3, 5000));

    struct rnnd_client *c3 = daemon_client(&d, NULL);
    assert_int_not_equal(rnnd_client_wait_connected(c3, 1500), 0);
    assert_true(limit_of(&d, "rnnd_limit_rejections_total", "connections") >= 1);
    assert_true(daemon_metric(&d, "rnnd_connections", NULL) == 3);
    EXPECT_OK(rnnd_client_info(c1, &info));
    assert_true(daemon_log_contains(&d, "--max-connections 3"));
    rnnd_client_free(c3);

    close(silent);
    double t0 = now_seconds();
    int err = -1;
    while (err != 0 && now_seconds() - t0 < 10) {
        struct rnnd_client *c4 = daemon_client(&d, NULL);
        err = rnnd_client_wait_connected(c4, 1000);
        if (err == 0)
            EXPECT_OK(rnnd_client_info(c4, &info));
        rnnd_client_free(c4);
    }
    assert_int_equal(err, 0);
    rnnd_client_free(c1);
    rnnd_client_free(c2);
    daemon_free(&d);
}

// --max-health-watches bounds the Watch streams, which need no token.
static void test_health_watch_bound(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {
        "--input-size", "8", "--hidden-size", "32", "--max-health-watches", "2", NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    assert_true(limit_of(&d, "rnnd_limit", "health_watches") == 2);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct rnnd_client_watch *w[3];
    int st;
    for (int k = 0; k < 2; k++) {
        EXPECT_OK(rnnd_client_watch_init(c, "", &w[k]));
        EXPECT_OK(rnnd_client_watch_next(w[k], 5000, &st));
        assert_int_equal(st, 1);
    }
    assert_true(daemon_metric(&d, "rnnd_health_watches", NULL) == 2);
    int err = rnnd_client_watch_init(c, "", &w[2]);
    if (err == 0)
        err = rnnd_client_watch_next(w[2], 5000, &st);
    EXPECT_STATUS(err, GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(last_message(), "--max-health-watches"));
    rnnd_client_watch_free(w[2]);
    assert_true(limit_of(&d, "rnnd_limit_rejections_total", "health_watches") == 1);
    EXPECT_OK(rnnd_client_health(c, "", &st));

    rnnd_client_watch_free(w[0]);
    assert_true(metric_wait(&d, "rnnd_health_watches", NULL, 1, 5000));
    EXPECT_OK(rnnd_client_watch_init(c, "", &w[0]));
    EXPECT_OK(rnnd_client_watch_next(w[0], 5000, &st));
    rnnd_client_watch_free(w[0]);
    rnnd_client_watch_free(w[1]);
    rnnd_client_free(c);
    daemon_free(&d);
}

// --stream-idle-timeout-s ends a StepStream that sends nothing (a clean UNAVAILABLE naming the
// flag) but not one that keeps stepping, and cancels a call whose reply is never read, giving
// back its slot and bytes.
static void test_stream_idle_timeout(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {
        "--input-size", "8", "--hidden-size", "32", "--stream-idle-timeout-s", "1", "--hz",
        "20",           NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct rnnd_client_stream *idle, *busy;
    EXPECT_OK(rnnd_client_stream_init(c, &idle));
    EXPECT_OK(rnnd_client_stream_init(c, &busy));
    EXPECT_OK(stream_step1(idle, 1, obs1, I_, true));
    EXPECT_OK(stream_step1(busy, 2, obs1, I_, true));
    double t0 = now_seconds();
    while (now_seconds() - t0 < 1.8) {
        EXPECT_OK(stream_step1(busy, 2, obs1, I_, false));
        sleep_ms(200);
    }
    EXPECT_STATUS(stream_step1(idle, 1, obs1, I_, false), GRPC_STATUS_UNAVAILABLE);
    assert_non_null(strstr(last_message(), "--stream-idle-timeout-s"));
    assert_true(daemon_metric(&d, "rnnd_stream_idle_timeouts_total", NULL) == 1);
    EXPECT_OK(stream_step1(busy, 2, obs1, I_, false));
    EXPECT_OK(rnnd_client_stream_close(busy));
    rnnd_client_stream_free(busy);
    rnnd_client_stream_free(idle);

    grpc_channel *ch = raw_channel(&d);
    size_t len;
    void *req = forward_request(&len);
    struct raw r;
    raw_start(&r, ch, "/rnnd.v1.Rnn/Forward", req, len);
    assert_true(metric_wait(&d, "rnnd_requests_total", "method=\"Forward\",code=\"OK\"", 1, 5000));
    assert_true(daemon_metric(&d, "rnnd_streams_active", NULL) == 1);
    assert_true(metric_wait(&d, "rnnd_streams_active", NULL, 0, 5000));
    assert_true(daemon_metric(&d, "rnnd_reply_bytes", NULL) == 0);
    assert_true(daemon_metric(&d, "rnnd_stream_idle_timeouts_total", NULL) == 2);
    size_t got;
    assert_int_not_equal(raw_finish(&r, &got), GRPC_STATUS_OK);
    raw_free(&r);
    grpc_channel_destroy(ch);
    free(req);
    rnnd_client_free(c);
    daemon_free(&d);
}

// A request over --max-message-mb is refused with a message naming the flag, and counted, both
// as a unary call and on a StepStream.
static void test_request_size_counted(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {
        "--input-size", "8", "--hidden-size", "32", "--max-message-mb", "1", "--max-batch",
        "64",           NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    assert_true(limit_of(&d, "rnnd_limit_rejections_total", "message_bytes") == 0);

    enum { T = 40000 }; // 1.2 MiB of obs
    float *x = calloc((size_t)T * I_, sizeof(float));
    struct rnnd_forward_req fr = {.obs = rnnd_tensor_f32(x, 3, 1, T, I_, 0)};
    struct rnnd_forward_reply fo;
    EXPECT_STATUS(rnnd_client_forward(c, &fr, &fo), GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(last_message(), "--max-message-mb"));
    rnnd_forward_reply_free(&fo);
    assert_true(limit_of(&d, "rnnd_limit_rejections_total", "message_bytes") == 1);

    enum { B = 40000 };
    uint64_t *ids = calloc(B, sizeof(uint64_t));
    for (int b = 0; b < B; b++)
        ids[b] = (uint64_t)b + 1;
    struct rnnd_step_req sr = {
        .n_env_ids = B, .env_ids = ids, .obs = rnnd_tensor_f32(x, 2, B, I_, 0, 0)};
    struct rnnd_client_stream *s;
    struct rnnd_step_reply so;
    EXPECT_OK(rnnd_client_stream_init(c, &s));
    EXPECT_STATUS(rnnd_client_stream_step(s, &sr, &so), GRPC_STATUS_RESOURCE_EXHAUSTED);
    rnnd_step_reply_free(&so);
    rnnd_client_stream_free(s);
    assert_true(limit_of(&d, "rnnd_limit_rejections_total", "message_bytes") == 2);
    // Nothing else changed: the daemon serves.
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    free(ids);
    free(x);
    rnnd_client_free(c);
    daemon_free(&d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_drain_delivers_replies),
        cmocka_unit_test(test_drain_timeout_ends_streams),
        cmocka_unit_test(test_reply_budget),
        cmocka_unit_test(test_connection_bound),
        cmocka_unit_test(test_health_watch_bound),
        cmocka_unit_test(test_stream_idle_timeout),
        cmocka_unit_test(test_request_size_counted),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
