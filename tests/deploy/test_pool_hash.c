/*
 * test_pool_hash.c: rendezvous placement of envs over several rnnd instances
 * (rnnd_client_pool.h), without a daemon: fixed vectors (shared with the Python client's test, so
 * C and Python place every env alike), independence of the targets' order, balance, and that
 * adding or removing an instance moves only that instance's share of envs. Then the pool's local
 * checks: bad target lists, requests that cannot be split by rows, and a dead target named in the
 * error.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <unistd.h>

#include "rnnd_client_pool.h"
#include "loopback_port.h"

static const char *const targets[] = {"rnnd-0.rnnd:50051", "rnnd-1.rnnd:50051",
                                      "rnnd-2.rnnd:50051"};

static void hashes_of(const char *const *names, size_t n, uint64_t *out) {
    for (size_t i = 0; i < n; i++)
        out[i] = rnnd_rendezvous_target_hash(names[i]);
}

// The same numbers are in client/python/tests/test_pool.py: change both or neither.
static void test_vectors(void **state) {
    (void)state;
    assert_true(rnnd_rendezvous_target_hash("") == 0xcbf29ce484222325ull); // FNV-1a offset
    assert_true(rnnd_rendezvous_target_hash("a") == 0xaf63dc4c8601ec8cull);
    uint64_t h[3];
    hashes_of(targets, 3, h);
    assert_true(h[0] == 0x6152eb87895c0c35ull);
    assert_true(h[1] == 0xefffb51cd81c060cull);
    assert_true(h[2] == 0x32088c167fad1e5full);
    const uint64_t envs[] = {0, 1, 2, 3, 42, 1000, UINT64_MAX, 0x123456789abcdefull};
    const uint64_t w[] = {0xd6e775f7c36f7a2aull, 0xa165ae671d47f04bull, 0xd41d910913a5c4d1ull,
                          0x4ddbff778c1f194bull, 0x597a5bd7961627d8ull, 0x7aa7013aad37010dull,
                          0xe93fdac18e43d99cull, 0xafd9aa0eb06ed0eaull};
    for (size_t i = 0; i < 8; i++)
        assert_true(rnnd_rendezvous_weight(envs[i], h[0]) == w[i]);
    const int pick2[24] = {0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0};
    const int pick3[24] = {0, 1, 0, 0, 2, 1, 0, 0, 2, 0, 1, 0, 2, 1, 1, 0, 1, 1, 1, 1, 2, 2, 2, 0};
    for (uint64_t e = 0; e < 24; e++) {
        assert_int_equal(rnnd_rendezvous_pick(e, h, 2), pick2[e]);
        assert_int_equal(rnnd_rendezvous_pick(e, h, 3), pick3[e]);
        assert_int_equal(rnnd_rendezvous_pick(e, h, 1), 0);
    }
}

// The winner is a target, not a position: any order of the same targets picks the same one.
static void test_order_independent(void **state) {
    (void)state;
    const char *names[5] = {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.4:50051",
                            "10.0.0.5:50051"};
    uint64_t h[5], hr[5];
    hashes_of(names, 5, h);
    for (size_t i = 0; i < 5; i++)
        hr[i] = h[(i + 2) % 5]; // rotated
    const char *swapped[5] = {names[4], names[3], names[2], names[1], names[0]};
    uint64_t hs[5];
    hashes_of(swapped, 5, hs);
    for (uint64_t e = 0; e < 20000; e++) {
        size_t a = rnnd_rendezvous_pick(e * 7919 + 13, h, 5);
        size_t b = rnnd_rendezvous_pick(e * 7919 + 13, hr, 5);
        size_t c = rnnd_rendezvous_pick(e * 7919 + 13, hs, 5);
        assert_string_equal(names[a], names[(b + 2) % 5]);
        assert_string_equal(names[a], swapped[c]);
    }
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define N_ENVS 100000

// Every target gets close to 1/n of the envs, for sequential ids (how actors number their envs)
// and for random ones. With 1e5 envs one standard deviation is under 0.5% of a share; allow 4%.
static void test_balance(void **state) {
    (void)state;
    char names[8][32];
    const char *ptr[8];
    for (int i = 0; i < 8; i++) {
        snprintf(names[i], sizeof names[i], "rnnd-%d.rnnd.default.svc:50051", i);
        ptr[i] = names[i];
    }
    uint64_t h[8];
    hashes_of(ptr, 8, h);
    for (size_t n = 2; n <= 8; n++) {
        for (int kind = 0; kind < 2; kind++) {
            size_t count[8] = {0};
            uint64_t s = 1234;
            for (uint64_t e = 0; e < N_ENVS; e++)
                count[rnnd_rendezvous_pick(kind ? splitmix(&s) : e, h, n)]++;
            double share = (double)N_ENVS / (double)n;
            for (size_t i = 0; i < n; i++) {
                double rel = (double)count[i] / share - 1.0;
                if (rel > 0.04 || rel < -0.04)
                    fail_msg("n=%zu %s ids: target %zu got %zu envs (%.1f%% off its share)", n,
                             kind ? "random" : "sequential", i, count[i], 100.0 * rel);
            }
        }
    }
}

// Adding target n moves only envs onto it (about 1/(n+1) of them); removing a target moves only
// the envs it held.
static void test_minimal_movement(void **state) {
    (void)state;
    char names[9][32];
    const char *ptr[9];
    for (int i = 0; i < 9; i++) {
        snprintf(names[i], sizeof names[i], "10.1.0.%d:50051", i + 10);
        ptr[i] = names[i];
    }
    uint64_t h[9];
    hashes_of(ptr, 9, h);
    for (size_t n = 1; n < 9; n++) {
        size_t moved = 0;
        for (uint64_t e = 0; e < N_ENVS; e++) {
            size_t before = rnnd_rendezvous_pick(e, h, n);
            size_t after = rnnd_rendezvous_pick(e, h, n + 1);
            if (after != before) {
                assert_int_equal(after, n); // only to the new target
                moved++;
            }
        }
        double frac = (double)moved / N_ENVS, want = 1.0 / (double)(n + 1);
        if (frac < want * 0.96 || frac > want * 1.04)
            fail_msg("adding target %zu to %zu moved %.4f of the envs (want %.4f)", n, n, frac,
                     want);
    }
    // Remove target 3 of 9: the remaining targets keep their envs.
    uint64_t rest[8];
    size_t map[8];
    for (size_t i = 0, j = 0; i < 9; i++)
        if (i != 3) {
            rest[j] = h[i];
            map[j++] = i;
        }
    for (uint64_t e = 0; e < N_ENVS; e++) {
        size_t before = rnnd_rendezvous_pick(e, h, 9);
        size_t after = map[rnnd_rendezvous_pick(e, rest, 8)];
        if (before != 3)
            assert_int_equal(after, before);
    }
}

static void test_pool_init_checks(void **state) {
    (void)state;
    struct rnnd_client_pool *p = (void *)1;
    assert_int_equal(rnnd_client_pool_init(NULL, targets, 0, &p), RNND_EINVAL);
    assert_null(p);
    assert_int_equal(rnnd_client_last_error()->grpc_status, -1);
    const char *dup[3] = {"a:1", "b:2", "a:1"};
    assert_int_equal(rnnd_client_pool_init(NULL, dup, 3, &p), RNND_EINVAL);
    assert_non_null(strstr(rnnd_client_last_error()->message, "a:1"));
    const char *empty[2] = {"a:1", ""};
    assert_int_equal(rnnd_client_pool_init(NULL, empty, 2, &p), RNND_EINVAL);
    // opts->target is ignored; everything else is used.
    struct rnnd_client_opts o = {.target = "ignored:1", .timeout_ms = 1000};
    assert_int_equal(rnnd_client_pool_init(&o, targets, 3, &p), 0);
    assert_int_equal(rnnd_client_pool_size(p), 3);
    assert_string_equal(rnnd_client_pool_target(p, 2), targets[2]);
    assert_null(rnnd_client_pool_target(p, 3));
    assert_non_null(rnnd_client_pool_client(p, 0));
    uint64_t h[3];
    hashes_of(targets, 3, h);
    for (uint64_t e = 0; e < 1000; e++)
        assert_int_equal(rnnd_client_pool_pick(p, e), rnnd_rendezvous_pick(e, h, 3));
    rnnd_client_pool_free(p);
    rnnd_client_pool_free(NULL);
    rnnd_client_pool_stream_free(NULL);
}

static void test_pool_local_errors(void **state) {
    (void)state;
    char t0[32], t1[32];
    snprintf(t0, sizeof t0, "127.0.0.1:%d", loopback_free_port());
    snprintf(t1, sizeof t1, "127.0.0.1:%d", loopback_free_port());
    const char *names[2] = {t0, t1};
    struct rnnd_client_opts o = {.timeout_ms = 3000};
    struct rnnd_client_pool *p;
    assert_int_equal(rnnd_client_pool_init(&o, names, 2, &p), 0);
    // Envs on both targets. The ports are random, so the hashes are: eight ids taken in order
    // land on one target once in 128 draws, so the last one is the first id on the other.
    uint64_t ids[8];
    size_t on0 = 0;
    for (uint64_t e = 0, n = 0; n < 8; e++) {
        const bool on_t0 = rnnd_client_pool_pick(p, e) == 0;
        if (n == 7 && (on0 == 0 || on0 == 7) && on_t0 == (on0 == 7))
            continue;
        ids[n++] = e;
        on0 += on_t0;
    }
    assert_true(on0 > 0 && on0 < 8);
    float x[8 * 4] = {0};
    bool init[8] = {true, true, true, true, true, true, true, true};
    // obs that does not have one row per env cannot be split: refused before any call.
    struct rnnd_step_req req = {
        .n_env_ids = 8, .env_ids = ids, .obs = rnnd_tensor_f32(x, 2, 4, 8, 0, 0)};
    struct rnnd_step_reply r;
    assert_int_equal(rnnd_client_pool_step(p, &req, &r), RNND_EINVAL);
    assert_int_equal(rnnd_client_last_error()->grpc_status, -1);
    assert_non_null(strstr(rnnd_client_last_error()->message, "obs"));
    req.obs = rnnd_tensor_f32(x, 2, 8, 4, 0, 0);
    req.n_is_init = 3;
    req.is_init = init;
    assert_int_equal(rnnd_client_pool_step(p, &req, &r), RNND_EINVAL);
    req.n_is_init = 8;
    // Nothing listens: UNAVAILABLE, naming the first target.
    assert_int_equal(rnnd_client_pool_step(p, &req, &r), RNND_EUNAVAIL);
    assert_false(r.output.present);
    assert_int_equal(rnnd_client_last_error()->grpc_status, 14);
    assert_non_null(strstr(rnnd_client_last_error()->message, t0));
    assert_int_equal(rnnd_client_pool_wait_connected(p, 100), RNND_EUNAVAIL);
    uint64_t released = 7;
    assert_int_equal(rnnd_client_pool_end_episodes(p, ids, 8, &released), RNND_EUNAVAIL);
    assert_int_equal(released, 0);
    // A broken pool stream refuses everything after its first error.
    struct rnnd_client_pool_stream *s;
    assert_int_equal(rnnd_client_pool_stream_init(p, &s), 0);
    int err = rnnd_client_pool_stream_send(s, &req);
    if (err == 0)
        err = rnnd_client_pool_stream_recv(s, &r);
    assert_int_equal(err, RNND_EUNAVAIL);
    assert_int_equal(rnnd_client_pool_stream_send(s, &req), RNND_ECANCELED);
    rnnd_client_pool_stream_free(s);
    rnnd_client_pool_free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vectors),          cmocka_unit_test(test_order_independent),
        cmocka_unit_test(test_balance),          cmocka_unit_test(test_minimal_movement),
        cmocka_unit_test(test_pool_init_checks), cmocka_unit_test(test_pool_local_errors),
    };
    return cmocka_run_group_tests_name("pool_hash", tests, NULL, NULL);
}
