/*
 * test_http.c: the HTTP endpoints under attack and during a drain. 300 slowloris connections
 * (more than the server's 256), kept open, trickling header bytes and reconnecting as the server
 * closes them, while /metrics and /readyz are scraped 20 times each: every scrape answers 200
 * within a second, and the evictions show in rnnd_http_connections_dropped_total. A request head
 * trickled byte by byte is cut off with 408 at the header deadline (not kept open by its
 * progress). Request lines the parser accepts and refuses, end to end. While SIGTERM drains a
 * call in flight, /readyz answers 503 and /healthz 200 on every probe until the call is done; they
 * keep answering while the final checkpoint is written, after gRPC has stopped.
 */
#include "harness.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static struct daemon d;

static int setup(void **state) {
    (void)state;
    const char *args[] = {"--input-size", "8", "--hidden-size", "16", NULL};
    return daemon_start(&d, args) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    daemon_teardown(&d);
    return 0;
}


// ---------------------------------------------------------------------------------------------
// Slowloris: N connections that send the start of a request and then one header byte at a
// time, reconnecting whenever the server closes one, until stop.

enum { SLOW_CONNS = 300 };

struct slowloris {
    pthread_t tid;
    atomic_bool stop;
    int fd[SLOW_CONNS];
    int reconnects;
};

static int slow_open(const char *hostport) {
    int fd = tcp_connect(hostport);
    const char *start = "GET /metrics HTTP/1.1\r\nHost: rnnd\r\nX-Slow: ";
    if (fd >= 0 && write(fd, start, strlen(start)) < 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static void *slowloris_main(void *arg) {
    struct slowloris *s = arg;
    while (!atomic_load(&s->stop)) {
        for (int k = 0; k < SLOW_CONNS && !atomic_load(&s->stop); k++) {
            // Closed by the server (EOF, or a 408 to read): open another one.
            struct pollfd p = {.fd = s->fd[k], .events = POLLIN};
            if (s->fd[k] < 0 || poll(&p, 1, 0) > 0 || send(s->fd[k], "a", 1, MSG_NOSIGNAL) < 0) {
                if (s->fd[k] >= 0)
                    close(s->fd[k]);
                s->fd[k] = slow_open(d.http);
                s->reconnects++;
            }
        }
        sleep_ms(100);
    }
    return NULL;
}

static void test_slowloris(void **state) {
    (void)state;
    struct slowloris s = {0};
    for (int k = 0; k < SLOW_CONNS; k++) {
        s.fd[k] = slow_open(d.http);
        assert_true(s.fd[k] >= 0);
    }
    pthread_create(&s.tid, NULL, slowloris_main, &s);
    sleep_ms(200);
    // 20 rounds over 2.4 s, while the attacker keeps reopening what the server evicts.
    int failed = 0;
    double worst = 0;
    for (int round = 0; round < 20; round++) {
        const char *paths[] = {"/metrics", "/readyz"};
        for (int p = 0; p < 2; p++) {
            char req[128];
            int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: rnnd\r\n\r\n", paths[p]);
            int status = 0;
            char *body = NULL;
            double t0 = now_seconds();
            int rc = http_raw(d.http, req, (size_t)n, 1000, &status, NULL, &body);
            double took = now_seconds() - t0;
            worst = took > worst ? took : worst;
            if (rc != 0 || status != 200 || took > 1.0) {
                fprintf(stderr, "  round %d %s: rc %d status %d after %.3f s\n", round, paths[p],
                        rc, status, took);
                failed++;
            }
            free(body);
        }
        sleep_ms(120);
    }
    atomic_store(&s.stop, true);
    pthread_join(s.tid, NULL);
    double evicted = daemon_metric(&d, "rnnd_http_connections_dropped_total", "reason=\"evicted\"");
    double timed_out =
        daemon_metric(&d, "rnnd_http_connections_dropped_total", "reason=\"header_timeout\"");
    double open = daemon_metric(&d, "rnnd_http_connections", NULL);
    fprintf(stderr,
            "  %d slow connections (%d reopened): 40 scrapes, %d failed, slowest %.3f s; "
            "%.0f evicted, %.0f header timeouts, %.0f open\n",
            SLOW_CONNS, s.reconnects, failed, worst, evicted, timed_out, open);
    for (int k = 0; k < SLOW_CONNS; k++)
        if (s.fd[k] >= 0)
            close(s.fd[k]);
    assert_int_equal(failed, 0);
    assert_true(evicted >= SLOW_CONNS - 256);
    assert_true(open >= 1 && open <= 256);
    // Once the attacker is gone its connections close: only the scrape's own stays.
    double t0 = now_seconds();
    while (daemon_metric(&d, "rnnd_http_connections", NULL) > 1 && now_seconds() - t0 < 5)
        sleep_ms(50);
    assert_true(daemon_metric(&d, "rnnd_http_connections", NULL) == 1);
}

// A head that keeps arriving a byte at a time is still cut off at the deadline, with 408.
static void test_header_deadline(void **state) {
    (void)state;
    double before =
        daemon_metric(&d, "rnnd_http_connections_dropped_total", "reason=\"header_timeout\"");
    int fd = tcp_connect(d.http);
    assert_true(fd >= 0);
    const char *start = "GET /healthz HTTP/1.1\r\n";
    assert_true(write(fd, start, strlen(start)) > 0);
    double t0 = now_seconds();
    char resp[256] = "";
    ssize_t got = 0;
    while (now_seconds() - t0 < 6) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) > 0) {
            got = read(fd, resp, sizeof resp - 1);
            break;
        }
        send(fd, "X", 1, MSG_NOSIGNAL);
    }
    double took = now_seconds() - t0;
    close(fd);
    resp[got > 0 ? got : 0] = '\0';
    fprintf(stderr, "  a trickled head: \"%.24s\" after %.2f s\n", resp, took);
    assert_non_null(strstr(resp, "HTTP/1.1 408"));
    assert_true(took > 1.5 && took < 3.0);
    assert_true(daemon_metric(&d, "rnnd_http_connections_dropped_total",
                              "reason=\"header_timeout\"") == before + 1);
}

// What the request-line parser takes and refuses, through the daemon.
static void test_request_lines(void **state) {
    (void)state;
    const struct {
        const char *req;
        int status;
    } cases[] = {
        {"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 200},
        {"GET /readyz?verbose=1 HTTP/1.0\r\n\r\n", 200},
        {"GET /metrics\n\n", 200},                     // no version, bare newlines
        {"GET /healthz HTTP/1.1\r\n\r\nGARBAGE", 200}, // bytes after the head are ignored
        {"GET  /healthz HTTP/1.1\r\n\r\n", 400},
        {"GET healthz HTTP/1.1\r\n\r\n", 400},
        {"GET /healthz FTP/1.1\r\n\r\n", 400},
        {"GET /healthz HTTP/1.1 x\r\n\r\n", 400},
        {"\r\n\r\n", 400},
        {"GET\t/healthz HTTP/1.1\r\n\r\n", 400},
        {"GET /healthzz HTTP/1.1\r\n\r\n", 404},
        {"HEAD /healthz HTTP/1.1\r\n\r\n", 405},
        {"GETS /metrics HTTP/1.1\r\n\r\n", 405},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int status = 0;
        char *body = NULL;
        assert_int_equal(
            http_raw(d.http, cases[k].req, strlen(cases[k].req), 3000, &status, NULL, &body), 0);
        if (status != cases[k].status)
            fprintf(stderr, "  %.*s: %d, expected %d\n", (int)strcspn(cases[k].req, "\r\n"),
                    cases[k].req, status, cases[k].status);
        assert_int_equal(status, cases[k].status);
        free(body);
    }
    // A NUL in the request line is refused, not read as its end.
    const char nul[] = "GET /healthz\0 HTTP/1.1\r\n\r\n";
    int status = 0;
    char *body = NULL;
    assert_int_equal(http_raw(d.http, nul, sizeof nul - 1, 3000, &status, NULL, &body), 0);
    assert_int_equal(status, 400);
    free(body);
}

// ---------------------------------------------------------------------------------------------
// Probes during a drain.

enum { FWD_B = 2, FWD_T = 512, FWD_I = 8 };

struct forward_call {
    struct rnnd_client *cl;
    atomic_bool done;
    int err;
    char msg[1100];
};

static void *forward_main(void *arg) {
    struct forward_call *f = arg;
    static float x[FWD_B * FWD_T * FWD_I];
    for (size_t k = 0; k < sizeof x / sizeof x[0]; k++)
        x[k] = 0.001f * (float)(k % 997);
    struct rnnd_forward_req req = {.obs = rnnd_tensor_f32(x, 3, FWD_B, FWD_T, FWD_I, 0)};
    struct rnnd_forward_reply r;
    f->err = rnnd_client_forward(f->cl, &req, &r);
    if (f->err == 0)
        rnnd_forward_reply_free(&r);
    else
        snprintf(f->msg, sizeof f->msg, "%s: %s",
                 rnnd_grpc_status_name(rnnd_client_last_error()->grpc_status),
                 rnnd_client_last_error()->message);
    atomic_store(&f->done, true);
    return NULL;
}

// Request messages dd has decoded (rnnd_request_message_bytes_count).
static double daemon_requests_decoded(const struct daemon *dd) {
    double n = daemon_metric(dd, "rnnd_request_message_bytes_count", NULL);
    assert_false(isnan(n));
    return n;
}

static int probe(const struct daemon *dd, const char *path) {
    char req[64];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\n\r\n", path);
    int status = 0;
    char *body = NULL;
    if (http_raw(dd->http, req, (size_t)n, 1000, &status, NULL, &body) != 0)
        status = -1; // refused, reset or no answer in time
    free(body);
    return status;
}

static void test_readyz_while_draining(void **state) {
    (void)state;
    // A deep model on the CPU backend, so that one Forward keeps the drain busy for a while
    // (~1 s here) with a reply of 1 MB.
    struct daemon ds;
    const char *args[] = {"--backend",
                          "cpu",
                          "--input-size",
                          "8",
                          "--hidden-size",
                          "256",
                          "--layers",
                          "8",
                          "--drain-timeout-s",
                          "10",
                          NULL};
    assert_int_equal(daemon_start(&ds, args), 0);
    struct forward_call f = {.cl = daemon_client(&ds, NULL)};
    // The call is in flight once its request has been received and decoded (counted in
    // rnnd_request_message_bytes): its handler runs next, and it is no longer a new call that a
    // drain refuses.
    double decoded = daemon_requests_decoded(&ds);
    pthread_t tid;
    pthread_create(&tid, NULL, forward_main, &f);
    double t0 = now_seconds();
    while (daemon_requests_decoded(&ds) < decoded + 1) {
        assert_true(now_seconds() - t0 < 5);
        sleep_ms(2);
    }
    sleep_ms(10);
    kill(ds.pid, SIGTERM);
    // Until the drain starts (the signal is handled on the loop) /readyz may still say 200;
    // from its first 503 on, every probe must answer: /readyz 503, /healthz 200.
    int probes = 0, bad = 0;
    bool draining = false;
    t0 = now_seconds();
    while (!atomic_load(&f.done) && now_seconds() - t0 < 15) {
        int ready = probe(&ds, "/readyz");
        if (!draining && ready == 200)
            continue;
        int healthy = probe(&ds, "/healthz");
        draining = true;
        if (ready != 503 || healthy != 200) {
            // The drain ends as the call's reply leaves, a moment before this client has it:
            // HTTP closing then (no answer) is the end of the drain, not a failure.
            double t1 = now_seconds();
            while ((ready == -1 || healthy == -1) && !atomic_load(&f.done) &&
                   now_seconds() - t1 < 1)
                sleep_ms(5);
            if ((ready == -1 || healthy == -1) && atomic_load(&f.done))
                break;
            fprintf(stderr, "  during the drain: /readyz %d, /healthz %d\n", ready, healthy);
            bad++;
        }
        probes++;
        sleep_ms(20);
    }
    double drained = now_seconds() - t0;
    pthread_join(tid, NULL);
    fprintf(stderr, "  drain: %d probes while the Forward ran (%.2f s), %d wrong; Forward: %s\n",
            probes, drained, bad, f.err ? f.msg : "OK");
    rnnd_client_free(f.cl);
    t0 = now_seconds();
    while (daemon_alive(&ds) && now_seconds() - t0 < 15)
        sleep_ms(10);
    assert_false(daemon_alive(&ds));
    assert_true(WIFEXITED(ds.exit_status) && WEXITSTATUS(ds.exit_status) == 0);
    daemon_free(&ds);
    assert_true(probes >= 1); // the Forward outlasted the start of the drain
    assert_int_equal(bad, 0);
    assert_int_equal(f.err, 0);
}

static void test_http_during_final_checkpoint(void **state) {
    (void)state;
    // ~50 MB of weights: the final checkpoint (written, checksummed, fsynced) takes a while
    // after gRPC has stopped, and the probes must still be answered meanwhile.
    struct daemon ds;
    const char *args[] = {
        "--backend", "cpu", "--input-size", "1024", "--hidden-size", "1024", "--layers", "2", NULL};
    assert_int_equal(daemon_start(&ds, args), 0);
    kill(ds.pid, SIGTERM);
    int answered = 0, bad = 0;
    double t0 = now_seconds();
    while (daemon_alive(&ds) && now_seconds() - t0 < 30) {
        if (!daemon_log_contains(&ds, "gRPC stopped")) {
            sleep_ms(1);
            continue;
        }
        int ready = probe(&ds, "/readyz");
        int healthy = probe(&ds, "/healthz");
        if (ready == 503 && healthy == 200)
            answered++;
        else if (ready != -1 && healthy != -1) // -1: HTTP closed as the daemon exits
            bad++;
    }
    assert_false(daemon_alive(&ds));
    assert_true(WIFEXITED(ds.exit_status) && WEXITSTATUS(ds.exit_status) == 0);
    fprintf(stderr, "  final checkpoint: %d probe pairs answered (503, 200), %d wrong, %.2f s\n",
            answered, bad, now_seconds() - t0);
    daemon_free(&ds);
    assert_true(answered >= 1);
    assert_int_equal(bad, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slowloris),
        cmocka_unit_test(test_header_deadline),
        cmocka_unit_test(test_request_lines),
        cmocka_unit_test(test_readyz_while_draining),
        cmocka_unit_test(test_http_during_final_checkpoint),
    };
    return cmocka_run_group_tests_name("http", tests, setup, teardown) ? 1 : 0;
}
