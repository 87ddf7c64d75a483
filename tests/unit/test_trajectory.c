/*
 * test_trajectory.c: the per-env ring of recorded steps (server/trajectory.c): what a window
 * returns (obs, is_init, extras, versions, and the state before its first step), growth, wrap
 * around at --trajectory-steps, the bounds, and the export that checkpoints use (pushing the
 * exported rows into a new ring rebuilds the same windows).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "rnnd_kernels.h"
#include "trajectory.h"

// Step k of the fake trajectory: obs = k + i/10, extras = -k, h = 100k + j, c = -100k - j.
static void push_step(struct rnnd_traj *tr, const struct rnnd_traj_dims *d, int k) {
    float obs[8], ex[4], h[16], c[16];
    for (int i = 0; i < d->I; i++)
        obs[i] = (float)k + (float)i / 10.0f;
    for (int i = 0; i < d->E; i++)
        ex[i] = -(float)k;
    for (int j = 0; j < d->L * d->H; j++) {
        h[j] = 100.0f * (float)k + (float)j;
        c[j] = -h[j];
    }
    assert_int_equal(rnnd_traj_push(tr, d, obs, k % 3 == 0, d->E ? ex : NULL, h, d->lstm ? c : NULL,
                                    (uint64_t)k / 4),
                     0);
}

static void check_window(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d, int T,
                         int first) {
    float obs[64 * 8], ex[64 * 4], h0[16], c0[16];
    uint8_t init[64];
    int64_t ver[64];
    assert_int_equal(rnnd_traj_window(tr, d, T, obs, init, ex, ver, h0, c0), 0);
    for (int t = 0; t < T; t++) {
        int k = first + t;
        for (int i = 0; i < d->I; i++)
            assert_true(obs[t * d->I + i] == (float)k + (float)i / 10.0f);
        for (int i = 0; i < d->E; i++)
            assert_true(ex[t * d->E + i] == -(float)k);
        assert_int_equal(init[t], k % 3 == 0);
        assert_int_equal(ver[t], k / 4);
    }
    for (int j = 0; j < d->L * d->H; j++) {
        assert_true(h0[j] == 100.0f * (float)first + (float)j);
        if (d->lstm)
            assert_true(c0[j] == -(100.0f * (float)first + (float)j));
    }
}

static void test_window_before_wrap(void **state) {
    (void)state;
    struct rnnd_traj_dims d = {.I = 3, .E = 2, .L = 2, .H = 2, .lstm = true, .cap = 40};
    struct rnnd_traj *tr = rnnd_traj_init(&d);
    assert_non_null(tr);
    assert_int_equal(rnnd_traj_count(tr), 0);
    for (int k = 0; k < 25; k++) // grows past its first allocation
        push_step(tr, &d, k);
    assert_int_equal(rnnd_traj_count(tr), 25);
    check_window(tr, &d, 25, 0);
    check_window(tr, &d, 5, 20);
    check_window(tr, &d, 1, 24);
    rnnd_traj_free(tr);
}

static void test_wraps_keeping_last_cap(void **state) {
    (void)state;
    struct rnnd_traj_dims d = {.I = 2, .E = 0, .L = 1, .H = 3, .lstm = false, .cap = 20};
    struct rnnd_traj *tr = rnnd_traj_init(&d);
    for (int k = 0; k < 57; k++)
        push_step(tr, &d, k);
    assert_int_equal(rnnd_traj_count(tr), 20);
    check_window(tr, &d, 20, 37); // the oldest kept is step 37
    check_window(tr, &d, 3, 54);
    rnnd_traj_free(tr);
}

static void test_bounds_and_missing_extras(void **state) {
    (void)state;
    struct rnnd_traj_dims d = {.I = 1, .E = 2, .L = 1, .H = 1, .lstm = false, .cap = 4};
    struct rnnd_traj *tr = rnnd_traj_init(&d);
    float obs = 1, h = 2, ex[2];
    assert_int_equal(rnnd_traj_push(tr, &d, &obs, true, NULL, &h, NULL, 9), 0);
    assert_int_equal(rnnd_traj_window(tr, &d, 0, NULL, NULL, NULL, NULL, NULL, NULL), RNND_EINVAL);
    assert_int_equal(rnnd_traj_window(tr, &d, 2, NULL, NULL, NULL, NULL, NULL, NULL), RNND_EINVAL);
    // A step recorded without extras reads back as zeros.
    ex[0] = ex[1] = 5;
    assert_int_equal(rnnd_traj_window(tr, &d, 1, NULL, NULL, ex, NULL, NULL, NULL), 0);
    assert_true(ex[0] == 0.0f && ex[1] == 0.0f);
    assert_int_equal(rnnd_traj_count(NULL), 0);
    assert_true(rnnd_traj_bytes(tr, &d) > 0);
    rnnd_traj_free(tr);
    rnnd_traj_free(NULL);
}

static void test_export_rebuilds(void **state) {
    (void)state;
    struct rnnd_traj_dims d = {.I = 3, .E = 2, .L = 2, .H = 2, .lstm = true, .cap = 20};
    struct rnnd_traj *tr = rnnd_traj_init(&d);
    for (int k = 0; k < 33; k++) // wrapped: steps 13..32 are held
        push_step(tr, &d, k);
    enum { N = 20 };
    float obs[N * 3], ex[N * 2], h[N * 4], c[N * 4];
    uint8_t init[N];
    uint64_t ver[N];
    rnnd_traj_export(tr, &d, obs, init, ex, ver, h, c);
    for (int t = 0; t < N; t++) { // every step's own state, not only the first
        assert_true(h[t * 4 + 1] == 100.0f * (float)(13 + t) + 1.0f);
        assert_true(c[t * 4 + 3] == -(100.0f * (float)(13 + t) + 3.0f));
    }
    // A shorter ring rebuilt from the rows keeps the newest ones, as a lower
    // --trajectory-steps does on restore.
    struct rnnd_traj_dims d2 = d;
    d2.cap = 8;
    struct rnnd_traj *tr2 = rnnd_traj_init(&d2);
    for (int t = 0; t < N; t++)
        assert_int_equal(rnnd_traj_push(tr2, &d2, obs + t * 3, init[t], ex + t * 2, h + t * 4,
                                        c + t * 4, ver[t]),
                         0);
    assert_int_equal(rnnd_traj_count(tr2), 8);
    check_window(tr2, &d2, 8, 25);
    check_window(tr, &d, 8, 25);
    rnnd_traj_export(NULL, &d, obs, init, ex, ver, h, c); // an env that recorded nothing
    rnnd_traj_free(tr);
    rnnd_traj_free(tr2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_before_wrap),
        cmocka_unit_test(test_wraps_keeping_last_cap),
        cmocka_unit_test(test_bounds_and_missing_extras),
        cmocka_unit_test(test_export_rebuilds),
    };
    return cmocka_run_group_tests_name("trajectory", tests, NULL, NULL);
}
