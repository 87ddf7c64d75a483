/*
 * test_pool_daemons.c: rnnd_client_pool against real daemons on loopback. Two daemons (a, b) form
 * a pool; a third (ref) gets every request whole, as one daemon would. All start from the same
 * seed, so each env's outputs and states through the pool must equal ref's: unary Step and the
 * pool's StepStream, random subsets of envs in random order with resets, returned states, retry-
 * safe step_index. Every env's state must live on the daemon its rendezvous hash picks. Adding a
 * fourth daemon (c) moves only the envs c now wins: the others go on without a reset.
 */
#include "harness.h"

#include <grpc/status.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rnnd_client_pool.h"

#define I_   16
#define H_   32
#define L_   2
#define NENV 64
#define ATOL 1e-5f
#define RTOL 1e-5f

static const char *const daemon_args[] = {
    "--cell", "lstm", "--input-size", "16", "--hidden-size", "32", "--layers", "2", "--seed",
    "7",      NULL};

struct fixture {
    struct daemon ref, a, b;
    struct rnnd_client *c_ref;
    struct rnnd_client_pool *pool;
    uint64_t ids[NENV];
};

static struct fixture fx;

static int setup(void **state) {
    if (daemon_start(&fx.ref, daemon_args) != 0 || daemon_start(&fx.a, daemon_args) != 0 ||
        daemon_start(&fx.b, daemon_args) != 0)
        return -1;
    fx.c_ref = daemon_client(&fx.ref, NULL);
    const char *targets[2] = {fx.a.grpc, fx.b.grpc};
    struct rnnd_client_opts o = {.timeout_ms = 30000};
    if (rnnd_client_pool_init(&o, targets, 2, &fx.pool) != 0)
        return -1;
    for (int k = 0; k < NENV; k++)
        fx.ids[k] = 0x5000000000ull + (uint64_t)k * 0x100000001ull;
    *state = &fx;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    struct daemon *ds[3] = {&fx.ref, &fx.a, &fx.b};
    for (int i = 0; i < 3; i++)
        if (ds[i]->pid && !daemon_alive(ds[i])) {
            fprintf(stderr, "rnnd %s died during the tests (status 0x%x)\n", ds[i]->grpc,
                    ds[i]->exit_status);
            daemon_dump_log(ds[i], 4000);
        }
    rnnd_client_pool_free(fx.pool);
    rnnd_client_free(fx.c_ref);
    for (int i = 0; i < 3; i++)
        daemon_free(ds[i]);
    return 0;
}

// One request: a random subset of the envs in random order, with resets.
struct round {
    int B;
    uint64_t ids[NENV];
    bool init[NENV];
    uint64_t step_index[NENV];
    float obs[NENV * I_];
    struct rnnd_step_req req;
};

static void make_round(struct rng *g, bool all, bool return_state, struct round *rd) {
    int perm[NENV];
    rng_perm(g, perm, NENV);
    rd->B = all ? NENV : 2 + (int)rng_u(g, NENV - 1);
    for (int b = 0; b < rd->B; b++) {
        rd->ids[b] = fx.ids[perm[b]];
        rd->init[b] = all || rng_u(g, 8) == 0;
    }
    rng_fill(g, rd->obs, (size_t)rd->B * I_);
    rd->req = (struct rnnd_step_req){.n_env_ids = (size_t)rd->B,
                                     .env_ids = rd->ids,
                                     .obs = rnnd_tensor_f32(rd->obs, 2, rd->B, I_, 0, 0),
                                     .n_is_init = (size_t)rd->B,
                                     .is_init = rd->init,
                                     .return_state = return_state};
}

// The pool's reply must equal the single daemon's, row for row.
static void check_same(const struct rnnd_step_reply *pool, const struct rnnd_step_reply *one, int B,
                       bool state, const char *what) {
    assert_tensor_f32(&pool->output, 2, B, H_, 0, 0);
    assert_true(close_f32(what, pool->output.data, one->output.data, (size_t)B * H_, ATOL, RTOL));
    assert_true(pool->model_version == one->model_version);
    if (!state)
        return;
    assert_tensor_f32(&pool->h, 3, B, L_, H_, 0);
    assert_tensor_f32(&pool->c, 3, B, L_, H_, 0);
    assert_true(close_f32("h", pool->h.data, one->h.data, (size_t)B * L_ * H_, ATOL, RTOL));
    assert_true(close_f32("c", pool->c.data, one->c.data, (size_t)B * L_ * H_, ATOL, RTOL));
}

static void test_same_weights(void **state) {
    (void)state;
    // The comparison below is only meaningful if all daemons start from the same weights.
    struct rnnd_named_tensors w_ref, w;
    EXPECT_OK(rnnd_client_get_weights(fx.c_ref, &w_ref, NULL));
    for (size_t t = 0; t < rnnd_client_pool_size(fx.pool); t++) {
        EXPECT_OK(rnnd_client_get_weights(rnnd_client_pool_client(fx.pool, t), &w, NULL));
        assert_int_equal(w.n, w_ref.n);
        for (size_t i = 0; i < w.n; i++) {
            assert_string_equal(w.v[i].name, w_ref.v[i].name);
            assert_int_equal(w.v[i].tensor.nbytes, w_ref.v[i].tensor.nbytes);
            assert_memory_equal(w.v[i].tensor.data, w_ref.v[i].tensor.data, w.v[i].tensor.nbytes);
        }
        rnnd_named_tensors_free(&w);
    }
    rnnd_named_tensors_free(&w_ref);
    EXPECT_OK(rnnd_client_pool_wait_connected(fx.pool, 10000));
}

static void test_step_matches_one_daemon(void **state) {
    (void)state;
    struct rng g = {.s = 11};
    struct round rd;
    for (int it = 0; it < 30; it++) {
        bool st = it % 3 == 1;
        make_round(&g, it == 0, st, &rd);
        struct rnnd_step_reply rp, r1;
        EXPECT_OK(rnnd_client_pool_step(fx.pool, &rd.req, &rp));
        EXPECT_OK(rnnd_client_step(fx.c_ref, &rd.req, &r1));
        char what[32];
        snprintf(what, sizeof what, "step %d output", it);
        check_same(&rp, &r1, rd.B, st, what);
        rnnd_step_reply_free(&rp);
        rnnd_step_reply_free(&r1);
    }
    // Every env has state on exactly the daemon its hash picks: both hold some, together all.
    struct rnnd_model_info ia, ib, iref;
    EXPECT_OK(rnnd_client_info(rnnd_client_pool_client(fx.pool, 0), &ia));
    EXPECT_OK(rnnd_client_info(rnnd_client_pool_client(fx.pool, 1), &ib));
    EXPECT_OK(rnnd_client_info(fx.c_ref, &iref));
    assert_int_equal(iref.envs_active, NENV);
    assert_int_equal(ia.envs_active + ib.envs_active, NENV);
    assert_true(ia.envs_active > 0 && ib.envs_active > 0);
    size_t on[2] = {0, 0};
    for (int k = 0; k < NENV; k++) {
        size_t t = rnnd_client_pool_pick(fx.pool, fx.ids[k]);
        on[t]++;
        // A one-row step with no reset succeeds on the picked daemon only.
        float x[I_] = {0};
        struct rnnd_step_req q = {
            .n_env_ids = 1, .env_ids = &fx.ids[k], .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0)};
        struct rnnd_step_reply r;
        EXPECT_STATUS(rnnd_client_step(rnnd_client_pool_client(fx.pool, 1 - t), &q, &r),
                      GRPC_STATUS_FAILED_PRECONDITION);
    }
    assert_int_equal(on[0], ia.envs_active);
    assert_int_equal(on[1], ib.envs_active);
}

static void test_stream_matches_one_daemon(void **state) {
    (void)state;
    struct rng g = {.s = 12};
    struct rnnd_client_pool_stream *s;
    EXPECT_OK(rnnd_client_pool_stream_init(fx.pool, &s));
    // Two requests in flight at a time; replies come back in order.
    struct round rd[2];
    for (int it = 0; it < 12; it++) {
        bool st = it % 2 == 0;
        make_round(&g, it == 0, st, &rd[0]);
        make_round(&g, false, !st, &rd[1]);
        // An env in both requests steps twice, in send order, on its daemon as in ref.
        EXPECT_OK(rnnd_client_pool_stream_send(s, &rd[0].req));
        EXPECT_OK(rnnd_client_pool_stream_send(s, &rd[1].req));
        for (int j = 0; j < 2; j++) {
            struct rnnd_step_reply rp, r1;
            EXPECT_OK(rnnd_client_pool_stream_recv(s, &rp));
            EXPECT_OK(rnnd_client_step(fx.c_ref, &rd[j].req, &r1));
            char what[40];
            snprintf(what, sizeof what, "stream %d.%d output", it, j);
            check_same(&rp, &r1, rd[j].B, rd[j].req.return_state, what);
            rnnd_step_reply_free(&rp);
            rnnd_step_reply_free(&r1);
        }
    }
    EXPECT_OK(rnnd_client_pool_stream_close(s));
    rnnd_client_pool_stream_free(s);
}

static void test_step_index_retry(void **state) {
    (void)state;
    struct rng g = {.s = 13};
    struct round rd;
    make_round(&g, true, false, &rd);
    for (int b = 0; b < rd.B; b++)
        rd.step_index[b] = 1000;
    rd.req.n_step_index = (size_t)rd.B;
    rd.req.step_index = rd.step_index;
    struct rnnd_step_reply rp, rp2, r1;
    EXPECT_OK(rnnd_client_pool_step(fx.pool, &rd.req, &rp));
    EXPECT_OK(rnnd_client_step(fx.c_ref, &rd.req, &r1));
    check_same(&rp, &r1, rd.B, false, "indexed step");
    // The same request again (a lost reply): the cached outputs, nothing advances.
    EXPECT_OK(rnnd_client_pool_step(fx.pool, &rd.req, &rp2));
    assert_memory_equal(rp.output.data, rp2.output.data, rp.output.nbytes);
    rnnd_step_reply_free(&rp);
    rnnd_step_reply_free(&rp2);
    rnnd_step_reply_free(&r1);
    // Skipping ahead is refused, with the target named.
    for (int b = 0; b < rd.B; b++)
        rd.step_index[b] = 1002;
    EXPECT_STATUS(rnnd_client_pool_step(fx.pool, &rd.req, &rp), GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, "target 127.0.0.1:"));
}

static void test_grow(void **state) {
    (void)state;
    struct daemon c;
    if (daemon_start(&c, daemon_args) != 0)
        fail_msg("a fourth daemon did not start");
    const char *targets[3] = {fx.a.grpc, fx.b.grpc, c.grpc};
    struct rnnd_client_pool *p3;
    EXPECT_OK(rnnd_client_pool_init(NULL, targets, 3, &p3));
    // Only envs that c wins move.
    bool moved[NENV];
    int n_moved = 0;
    for (int k = 0; k < NENV; k++) {
        size_t before = rnnd_client_pool_pick(fx.pool, fx.ids[k]);
        size_t after = rnnd_client_pool_pick(p3, fx.ids[k]);
        moved[k] = after != before;
        if (moved[k])
            assert_int_equal(after, 2);
        n_moved += moved[k];
    }
    // About a third move; the targets' ports are the daemons' (random), so the count is a draw
    // of Binomial(NENV, 1/3): NENV / 2 is 2.8 sd above its mean (a failure in ~250 runs), 3/4 is
    // 7 sd above.
    assert_true(n_moved > 0 && n_moved < NENV * 3 / 4);
    struct rng g = {.s = 14};
    struct round rd;
    make_round(&g, true, true, &rd);
    // Without a reset, the moved envs have no state on c: a request of moved envs alone fails
    // whole (so nothing advances), naming c.
    uint64_t moved_ids[NENV];
    float x[NENV * I_] = {0};
    int m = 0;
    for (int k = 0; k < NENV; k++)
        if (moved[k])
            moved_ids[m++] = fx.ids[k];
    struct rnnd_step_req q = {
        .n_env_ids = (size_t)m, .env_ids = moved_ids, .obs = rnnd_tensor_f32(x, 2, m, I_, 0, 0)};
    struct rnnd_step_reply rp, r1;
    EXPECT_STATUS(rnnd_client_pool_step(p3, &q, &rp), GRPC_STATUS_FAILED_PRECONDITION);
    assert_non_null(strstr(rnnd_client_last_error()->message, c.grpc));
    // Reset the moved envs alone (in ref too): every env matches the single daemon, so the others
    // carried on from the state they kept on a and b.
    for (int b = 0; b < rd.B; b++) {
        int k = 0;
        while (fx.ids[k] != rd.ids[b])
            k++;
        rd.init[b] = moved[k];
    }
    for (int it = 0; it < 3; it++) {
        EXPECT_OK(rnnd_client_pool_step(p3, &rd.req, &rp));
        EXPECT_OK(rnnd_client_step(fx.c_ref, &rd.req, &r1));
        check_same(&rp, &r1, rd.B, true, "grown pool output");
        rnnd_step_reply_free(&rp);
        rnnd_step_reply_free(&r1);
        for (int b = 0; b < rd.B; b++)
            rd.init[b] = false;
        rng_fill(&g, rd.obs, (size_t)rd.B * I_);
    }
    struct rnnd_model_info ic;
    EXPECT_OK(rnnd_client_info(rnnd_client_pool_client(p3, 2), &ic));
    assert_int_equal(ic.envs_active, n_moved);
    // EndEpisodes through the grown pool releases every env exactly once.
    uint64_t released = 0;
    EXPECT_OK(rnnd_client_pool_end_episodes(p3, fx.ids, NENV, &released));
    assert_int_equal(released, NENV);
    rnnd_client_pool_free(p3);
    daemon_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_weights),
        cmocka_unit_test(test_step_matches_one_daemon),
        cmocka_unit_test(test_stream_matches_one_daemon),
        cmocka_unit_test(test_step_index_retry),
        cmocka_unit_test(test_grow),
    };
    return cmocka_run_group_tests_name("pool_daemons", tests, setup, teardown);
}
