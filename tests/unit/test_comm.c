/*
 * test_comm.c: the cpu backend's communicators (rnnd_comm.h). In-process (ranks are threads) and
 * over sockets (ranks are processes: rank 0 here, the others forked): the sum and the broadcast
 * give every rank the same bits, in rank order; a rank that never comes, or stops taking part,
 * makes the others fail after the timeout instead of hanging; a rank that is gone makes them
 * fail at once, and every later call too.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rnnd_comm.h"

#define N     3
#define COUNT 1001 // not a multiple of N: uneven chunks

struct rank {
    struct rnnd_backend be;
    const struct rnnd_comm_id *id;
    int rank, timeout_ms;
    float buf[COUNT], bc[COUNT];
    int rc_init, rc_sum, rc_bcast;
};

static float value(int rank, int i) {
    return (float)(rank + 1) * 0.1f + (float)i * 1e-3f;
}

static void *rank_main(void *p) {
    struct rank *r = p;
    struct rnnd_comm *c;
    r->rc_init = rnnd_comm_init(&r->be, r->id, N, r->rank, r->timeout_ms, &c);
    if (r->rc_init)
        return NULL;
    for (int i = 0; i < COUNT; i++) {
        r->buf[i] = value(r->rank, i);
        r->bc[i] = r->rank == 1 ? (float)i : -1.0f;
    }
    r->rc_sum = rnnd_comm_all_reduce(c, r->buf, COUNT);
    r->rc_bcast = rnnd_comm_broadcast(c, r->bc, COUNT, 1);
    rnnd_comm_free(c);
    return NULL;
}

static void test_cpu_comm(void **state) {
    (void)state;
    struct rank *r = calloc(N, sizeof(*r));
    struct rnnd_comm_id id;
    assert_int_equal(rnnd_backend_cpu_init(&r[0].be), 0);
    assert_int_equal(rnnd_comm_supported(&r[0].be, NULL, 0), 0);
    assert_int_equal(rnnd_comm_id_new(&r[0].be, N, NULL, &id), 0);
    pthread_t t[N];
    for (int k = 0; k < N; k++) {
        if (k)
            assert_int_equal(rnnd_backend_cpu_init(&r[k].be), 0);
        r[k].id = &id;
        r[k].rank = k;
        r[k].timeout_ms = 10000;
        pthread_create(&t[k], NULL, rank_main, &r[k]);
    }
    for (int k = 0; k < N; k++)
        pthread_join(t[k], NULL);
    rnnd_comm_id_release(&r[0].be, &id);
    for (int k = 0; k < N; k++) {
        assert_int_equal(r[k].rc_init, 0);
        assert_int_equal(r[k].rc_sum, 0);
        assert_int_equal(r[k].rc_bcast, 0);
        assert_memory_equal(r[k].buf, r[0].buf, sizeof(r[0].buf));
        for (int i = 0; i < COUNT; i++) {
            float want = 0.0f;
            for (int j = 0; j < N; j++)
                want += value(j, i); // rank order, in float: the same bits
            assert_true(r[k].buf[i] == want);
            assert_true(r[k].bc[i] == (float)i);
        }
        rnnd_backend_free(&r[k].be);
    }
    free(r);
}

static void test_cpu_comm_timeout(void **state) {
    (void)state;
    struct rank *r = calloc(N, sizeof(*r));
    struct rnnd_comm_id id;
    assert_int_equal(rnnd_backend_cpu_init(&r[0].be), 0);
    assert_int_equal(rnnd_comm_id_new(&r[0].be, N, NULL, &id), 0);
    // Only two of three ranks come.
    pthread_t t[2];
    assert_int_equal(rnnd_backend_cpu_init(&r[1].be), 0);
    for (int k = 0; k < 2; k++) {
        r[k].id = &id;
        r[k].rank = k;
        r[k].timeout_ms = 300;
        pthread_create(&t[k], NULL, rank_main, &r[k]);
    }
    for (int k = 0; k < 2; k++)
        pthread_join(t[k], NULL);
    rnnd_comm_id_release(&r[0].be, &id);
    assert_int_equal(r[0].rc_init, RNND_EUNAVAIL);
    assert_int_equal(r[1].rc_init, RNND_EUNAVAIL);
    rnnd_backend_free(&r[0].be);
    rnnd_backend_free(&r[1].be);
    free(r);
}

// ---------------------------------------------------------------------------------------------
// Over sockets: rank 0 in this process, the others forked.

#define BIG 10007 // more than the chunk rank 0 adds at a time, and odd

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// What every rank does: an all-reduce, a broadcast from rank 1, one from rank 0. 0 when each
// gave the expected bits (the float sum in rank order; the root's values).
static int net_round(struct rnnd_comm *c, int nranks) {
    static float buf[BIG], bc[BIG];
    int rank = rnnd_comm_rank(c);
    for (int i = 0; i < BIG; i++) {
        buf[i] = value(rank, i);
        bc[i] = rank == 1 ? (float)i : -1.0f;
    }
    if (rnnd_comm_all_reduce(c, buf, BIG) != 0 || rnnd_comm_broadcast(c, bc, BIG, 1) != 0)
        return 1;
    for (int i = 0; i < BIG; i++) {
        float want = value(0, i);
        for (int j = 1; j < nranks; j++)
            want += value(j, i);
        if (buf[i] != want || bc[i] != (float)i)
            return 2;
        bc[i] = rank == 0 ? 2.0f * (float)i : 0.0f;
    }
    if (rnnd_comm_broadcast(c, bc, BIG, 0) != 0)
        return 3;
    for (int i = 0; i < BIG; i++)
        if (bc[i] != 2.0f * (float)i)
            return 4;
    return 0;
}

// Forks a process that joins id as rank and runs body; its exit status says how it went.
static pid_t fork_rank(struct rnnd_backend *be, const struct rnnd_comm_id *id, int nranks, int rank,
                       int timeout_ms, int (*body)(struct rnnd_comm *c, int nranks)) {
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    struct rnnd_comm *c;
    int rc = rnnd_comm_init(be, id, nranks, rank, timeout_ms, &c);
    if (rc != 0)
        _exit(10);
    rc = body(c, nranks);
    rnnd_comm_free(c);
    _exit(rc);
}

static int exit_status(pid_t pid) {
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
}

static void test_net_comm(void **state) {
    (void)state;
    struct rnnd_backend be;
    struct rnnd_comm_id id;
    assert_int_equal(rnnd_backend_cpu_init(&be), 0);
    assert_int_equal(rnnd_comm_id_new(&be, N, "127.0.0.1", &id), 0);
    pid_t kids[N - 1];
    for (int k = 1; k < N; k++)
        kids[k - 1] = fork_rank(&be, &id, N, k, 10000, net_round);
    struct rnnd_comm *c;
    assert_int_equal(rnnd_comm_init(&be, &id, N, 0, 10000, &c), 0);
    rnnd_comm_id_release(&be, &id);
    assert_int_equal(net_round(c, N), 0);
    rnnd_comm_free(c);
    for (int k = 1; k < N; k++)
        assert_int_equal(exit_status(kids[k - 1]), 0);
    rnnd_backend_free(&be);
}

// Joins, takes part in one all-reduce, then is gone (as a killed process).
static int net_leave(struct rnnd_comm *c, int nranks) {
    (void)nranks;
    float x = 1.0f;
    if (rnnd_comm_all_reduce(c, &x, 1) != 0 || x != 2.0f)
        return 1;
    _exit(0); // no rnnd_comm_free: the kernel closes the connection
}

// Joins, then takes part in nothing for a while.
static int net_idle(struct rnnd_comm *c, int nranks) {
    (void)c;
    (void)nranks;
    sleep(5);
    return 0;
}

static void test_net_comm_failures(void **state) {
    (void)state;
    struct rnnd_backend be;
    struct rnnd_comm_id id;
    struct rnnd_comm *c;
    assert_int_equal(rnnd_backend_cpu_init(&be), 0);

    // A peer gone fails the collective at once, not after the timeout, and every later one.
    assert_int_equal(rnnd_comm_id_new(&be, 2, "127.0.0.1", &id), 0);
    pid_t kid = fork_rank(&be, &id, 2, 1, 10000, net_leave);
    assert_int_equal(rnnd_comm_init(&be, &id, 2, 0, 10000, &c), 0);
    rnnd_comm_id_release(&be, &id);
    float x = 1.0f;
    assert_int_equal(rnnd_comm_all_reduce(c, &x, 1), 0);
    assert_true(x == 2.0f);
    assert_int_equal(exit_status(kid), 0);
    double t0 = now_s();
    assert_int_equal(rnnd_comm_all_reduce(c, &x, 1), RNND_EUNAVAIL);
    assert_true(now_s() - t0 < 5.0);
    assert_int_equal(rnnd_comm_broadcast(c, &x, 1, 0), RNND_EUNAVAIL);
    rnnd_comm_free(c);

    // A peer that does not take part fails the collective after the timeout.
    assert_int_equal(rnnd_comm_id_new(&be, 2, "127.0.0.1", &id), 0);
    kid = fork_rank(&be, &id, 2, 1, 10000, net_idle);
    assert_int_equal(rnnd_comm_init(&be, &id, 2, 0, 300, &c), 0);
    rnnd_comm_id_release(&be, &id);
    t0 = now_s();
    assert_int_equal(rnnd_comm_broadcast(c, &x, 1, 1), RNND_EUNAVAIL);
    double took = now_s() - t0;
    assert_true(took >= 0.25 && took < 4.0);
    rnnd_comm_free(c);
    kill(kid, SIGKILL);
    exit_status(kid);

    // A rank that never comes fails the join after the timeout; rank 0 must be the maker's.
    assert_int_equal(rnnd_comm_id_new(&be, 2, "127.0.0.1", &id), 0);
    t0 = now_s();
    assert_int_equal(rnnd_comm_init(&be, &id, 2, 0, 300, &c), RNND_EUNAVAIL);
    assert_true(now_s() - t0 >= 0.25);
    kid = fork();
    if (kid == 0)
        _exit(rnnd_comm_init(&be, &id, 2, 0, 300, &c) == RNND_EINVAL ? 0 : 1);
    assert_int_equal(exit_status(kid), 0);
    rnnd_comm_id_release(&be, &id);

    // A host that does not resolve.
    assert_int_equal(rnnd_comm_id_new(&be, 2, "no-such-host.invalid", &id), RNND_EINVAL);
    rnnd_backend_free(&be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_comm),
        cmocka_unit_test(test_cpu_comm_timeout),
        cmocka_unit_test(test_net_comm),
        cmocka_unit_test(test_net_comm_failures),
    };
    return cmocka_run_group_tests_name("comm", tests, NULL, NULL);
}
