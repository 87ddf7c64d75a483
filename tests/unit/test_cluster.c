/*
 * test_cluster.c: where envs live among devices (rnnd_place) and the rendezvous / ordering
 * protocol of several rnnd instances (cluster.c), with every rank a thread of this process on
 * loopback; and --rank auto.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cluster.h"
#include "config.h"
#include "group.h"
#include "loopback_port.h"

// ---------------------------------------------------------------------------------------------
// Placement

// The hash is part of the on-disk contract: a restart with the same --devices must find every
// env where its checkpoint put it. These values pin it.
static void test_place_stable(void **state) {
    (void)state;
    static const struct {
        uint64_t id;
        int n, want;
    } cases[] = {{0, 2, 1}, {1, 2, 0}, {2, 2, 0}, {3, 2, 1}, {1000, 4, 0}, {123456789, 8, 4}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int got = rnnd_place(cases[i].id, cases[i].n, 1);
        if (got != cases[i].want)
            fprintf(stderr, "rnnd_place(%llu, %d) = %d, pinned %d\n",
                    (unsigned long long)cases[i].id, cases[i].n, got, cases[i].want);
        assert_int_equal(got, cases[i].want);
    }
    for (uint64_t id = 0; id < 1000; id++)
        assert_int_equal(rnnd_place(id, 1, 1), 0);
}

static void test_place_balance(void **state) {
    (void)state;
    enum { N = 200000 };
    for (int n = 2; n <= 16; n *= 2) {
        int count[16] = {0};
        for (uint64_t id = 0; id < N; id++) { // consecutive ids, as actors number their envs
            int k = rnnd_place(id, n, 1);
            assert_true(k >= 0 && k < n);
            count[k]++;
        }
        for (int k = 0; k < n; k++) {
            double share = (double)count[k] * n / N;
            if (share < 0.97 || share > 1.03)
                fprintf(stderr, "n=%d: device %d holds %d of %d\n", n, k, count[k], N);
            assert_true(share >= 0.97 && share <= 1.03);
        }
    }
}

// Adding a device moves only the envs that go to it.
static void test_place_moves_little(void **state) {
    (void)state;
    for (int n = 1; n < 8; n++) {
        int moved = 0;
        for (uint64_t id = 0; id < 50000; id++) {
            int a = rnnd_place(id * 2654435761u, n, 1), b = rnnd_place(id * 2654435761u, n + 1, 1);
            if (a != b) {
                assert_int_equal(b, n);
                moved++;
            }
        }
        double share = moved / 50000.0;
        assert_true(share > 0.9 / (n + 1) && share < 1.1 / (n + 1));
    }
}

// --place-block N: an aligned block of N ids on one device, consecutive blocks in turn, so
// actors numbering their envs from multiples of N have every Step on one device and share the
// devices evenly (a hash of 32 blocks puts 14 and 18 on two devices).
static void test_place_blocks(void **state) {
    (void)state;
    static const struct {
        uint64_t id;
        int n, block, want;
    } cases[] = {{0, 2, 1024, 0},      {1023, 2, 1024, 0}, {1024, 2, 1024, 1},
                 {2047, 2, 1024, 1},   {2048, 2, 1024, 0}, {5 * 64 + 3, 4, 64, 1},
                 {UINT64_MAX, 2, 2, 1}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        assert_int_equal(rnnd_place(cases[i].id, cases[i].n, cases[i].block), cases[i].want);
    for (int n = 2; n <= 8; n++) {
        int count[8] = {0};
        for (uint64_t a = 0; a < 32; a++) { // 32 actors of 1024 envs from 2^30
            uint64_t base = (1ull << 30) + a * 1024;
            int k = rnnd_place(base, n, 1024);
            for (uint64_t j = 1; j < 1024; j++)
                assert_int_equal(rnnd_place(base + j, n, 1024), k);
            count[k]++;
        }
        for (int k = 0; k < n; k++)
            assert_true(count[k] == 32 / n || count[k] == 32 / n + 1);
    }
}

// ---------------------------------------------------------------------------------------------
// The cluster protocol

#define MAX_OPS 64

struct rank_state {
    int rank, world;
    char addr[64];
    uint64_t fingerprint;
    int timeout_ms;
    struct rnnd_comm_id id;
    struct rnnd_cluster *cl;
    int rc;
    char err[512];
    pthread_mutex_t mu;
    struct rnnd_cluster_op ops[MAX_OPS];
    int n_ops;
    int lost;
    char lost_why[512];
};

static void on_commit(void *ctx, const struct rnnd_cluster_op *op) {
    struct rank_state *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (s->n_ops < MAX_OPS)
        s->ops[s->n_ops++] = *op;
    pthread_mutex_unlock(&s->mu);
}

static void on_lost(void *ctx, const char *why) {
    struct rank_state *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->lost++;
    snprintf(s->lost_why, sizeof(s->lost_why), "%s", why);
    pthread_mutex_unlock(&s->mu);
}

static void *start_main(void *p) {
    struct rank_state *s = p;
    struct rnnd_cluster_config cfg = {.rank = s->rank,
                                      .world = s->world,
                                      .rendezvous = s->addr,
                                      .timeout_ms = s->timeout_ms,
                                      .fingerprint = s->fingerprint};
    s->rc = rnnd_cluster_start(&cfg, &s->id, on_commit, on_lost, s, &s->cl, s->err, sizeof(s->err));
    return NULL;
}

static void rank_init(struct rank_state *s, int rank, int world, const char *addr, uint64_t fp) {
    memset(s, 0, sizeof(*s));
    s->rank = rank;
    s->world = world;
    snprintf(s->addr, sizeof(s->addr), "%s", addr);
    s->fingerprint = fp;
    s->timeout_ms = 10000;
    pthread_mutex_init(&s->mu, NULL);
}

static int n_ops(struct rank_state *s) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_ops;
    pthread_mutex_unlock(&s->mu);
    return n;
}

static void wait_ops(struct rank_state *s, int n) {
    for (int i = 0; i < 500 && n_ops(s) < n; i++)
        usleep(10000);
    assert_int_equal(n_ops(s), n);
}

static void wait_lost(struct rank_state *s) {
    for (int i = 0; i < 500; i++) {
        pthread_mutex_lock(&s->mu);
        int lost = s->lost;
        pthread_mutex_unlock(&s->mu);
        if (lost)
            break;
        usleep(10000);
    }
    assert_int_equal(s->lost, 1);
}

static void test_cluster_forms_and_orders(void **state) {
    (void)state;
    enum { W = 3 };
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", loopback_free_port());
    struct rank_state s[W], bad_world, bad_fp, dup;
    pthread_t t[W], tb[1];
    for (int r = 0; r < W; r++)
        rank_init(&s[r], r, W, addr, 0xfeed);
    for (int i = 0; i < RNND_COMM_ID_BYTES; i++)
        s[0].id.bytes[i] = (uint8_t)(i * 7 + 1);
    // Rank 0 first, then strangers, which it refuses, then the ranks (rank 1 twice).
    pthread_create(&t[0], NULL, start_main, &s[0]);
    usleep(100000);
    rank_init(&bad_world, 1, 4, addr, 0xfeed);
    rank_init(&bad_fp, 2, W, addr, 0xbad);
    start_main(&bad_world);
    start_main(&bad_fp);
    assert_int_equal(bad_world.rc, RNND_EUNAVAIL);
    assert_non_null(strstr(bad_world.err, "rank 0 refused rank 1: rank 1 has --world-size 4"));
    assert_int_equal(bad_fp.rc, RNND_EUNAVAIL);
    assert_non_null(strstr(bad_fp.err, "serves another model"));
    pthread_create(&t[1], NULL, start_main, &s[1]);
    usleep(100000);
    rank_init(&dup, 1, W, addr, 0xfeed);
    pthread_create(&tb[0], NULL, start_main, &dup);
    pthread_join(tb[0], NULL);
    assert_int_equal(dup.rc, RNND_EUNAVAIL);
    assert_non_null(strstr(dup.err, "rank 1 has already joined"));
    pthread_create(&t[2], NULL, start_main, &s[2]);
    for (int r = 0; r < W; r++)
        pthread_join(t[r], NULL);
    for (int r = 0; r < W; r++) {
        if (s[r].rc)
            fprintf(stderr, "rank %d: %s\n", r, s[r].err);
        assert_int_equal(s[r].rc, 0);
        assert_memory_equal(s[r].id.bytes, s[0].id.bytes, RNND_COMM_ID_BYTES);
    }
    // After the group formed nobody listens any more.
    rank_init(&dup, 1, W, addr, 0xfeed);
    dup.timeout_ms = 700;
    start_main(&dup);
    assert_int_equal(dup.rc, RNND_EUNAVAIL);

    // Proposals from every rank, some at once: every rank sees the same order, numbered 1...
    enum { K = 12 };
    for (int k = 0; k < K; k++) {
        struct rnnd_cluster_op op = {.kind = (uint32_t)(1 + k % 3),
                                     .token = 100 + (uint64_t)k,
                                     .has_lr = k % 2,
                                     .lr = 0.5f * (float)k};
        assert_int_equal(rnnd_cluster_propose(s[k % W].cl, &op), 0);
        assert_int_equal(op.origin, (uint32_t)(k % W));
    }
    for (int r = 0; r < W; r++)
        wait_ops(&s[r], K);
    for (int k = 0; k < K; k++) {
        const struct rnnd_cluster_op *a = &s[0].ops[k];
        assert_int_equal(a->seq, (uint64_t)k + 1);
        for (int r = 1; r < W; r++) {
            const struct rnnd_cluster_op *o = &s[r].ops[k];
            assert_true(o->kind == a->kind && o->origin == a->origin && o->token == a->token &&
                        o->seq == a->seq && o->has_lr == a->has_lr && o->lr == a->lr);
        }
        // Every proposal arrived intact, once.
        int found = 0;
        for (int j = 0; j < K; j++) {
            const struct rnnd_cluster_op *o = &s[0].ops[j];
            if (o->token == 100 + (uint64_t)k) {
                found++;
                assert_int_equal(o->origin, (uint32_t)(k % W));
                assert_int_equal(o->kind, (uint32_t)(1 + k % 3));
                assert_int_equal(o->has_lr, k % 2);
                assert_true(o->lr == 0.5f * (float)k);
            }
        }
        assert_int_equal(found, 1);
    }

    // Rank 2 leaves: rank 0 reports it once and refuses proposals; then rank 0 leaves and rank 1
    // reports that.
    rnnd_cluster_free(s[2].cl);
    wait_lost(&s[0]);
    assert_non_null(strstr(s[0].lost_why, "rank 2 closed its connection"));
    struct rnnd_cluster_op op = {.kind = RNND_CLUSTER_APPLY_ACCUMULATED, .token = 1};
    assert_int_equal(rnnd_cluster_propose(s[0].cl, &op), RNND_EUNAVAIL);
    rnnd_cluster_free(s[0].cl);
    wait_lost(&s[1]);
    assert_non_null(strstr(s[1].lost_why, "rank 0 closed the connection"));
    rnnd_cluster_free(s[1].cl);
    assert_int_equal(s[2].lost, 0); // leaving is not losing
}

static void test_cluster_timeouts(void **state) {
    (void)state;
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", loopback_free_port());
    struct rank_state s;
    // Rank 0 alone.
    rank_init(&s, 0, 3, addr, 1);
    s.timeout_ms = 400;
    start_main(&s);
    assert_int_equal(s.rc, RNND_EUNAVAIL);
    assert_non_null(strstr(s.err, "rank(s) 1, 2 did not join within"));
    // A follower with no rank 0.
    rank_init(&s, 1, 2, addr, 1);
    s.timeout_ms = 700;
    start_main(&s);
    assert_int_equal(s.rc, RNND_EUNAVAIL);
    assert_non_null(strstr(s.err, "did not answer"));
    // Not an address.
    rank_init(&s, 0, 2, "no-port", 1);
    start_main(&s);
    assert_int_equal(s.rc, RNND_EINVAL);
}

// ---------------------------------------------------------------------------------------------
// --rank auto

static void test_rank_auto(void **state) {
    (void)state;
    struct rnnd_config c;
    rnnd_config_defaults(&c);
    char err[256];
    int rank = -1;
    c.world_size = 4;
    c.rank = 2;
    assert_int_equal(rnnd_config_rank(&c, &rank, err, sizeof(err)), 0);
    assert_int_equal(rank, 2);
    c.rank = RNND_RANK_AUTO;
    setenv("RNND_RANK", "3", 1);
    assert_int_equal(rnnd_config_rank(&c, &rank, err, sizeof(err)), 0);
    assert_int_equal(rank, 3);
    setenv("RNND_RANK", "4", 1);
    assert_int_equal(rnnd_config_rank(&c, &rank, err, sizeof(err)), RNND_EINVAL);
    setenv("RNND_RANK", "1x", 1);
    assert_int_equal(rnnd_config_rank(&c, &rank, err, sizeof(err)), RNND_EINVAL);
    unsetenv("RNND_RANK");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_place_stable),
        cmocka_unit_test(test_place_balance),
        cmocka_unit_test(test_place_moves_little),
        cmocka_unit_test(test_place_blocks),
        cmocka_unit_test(test_cluster_forms_and_orders),
        cmocka_unit_test(test_cluster_timeouts),
        cmocka_unit_test(test_rank_auto),
    };
    return cmocka_run_group_tests_name("cluster", tests, NULL, NULL);
}
