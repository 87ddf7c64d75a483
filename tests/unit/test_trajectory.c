/*
 * test_trajectory.c: the trajectory store (server/trajectory.c, on the CPU backend's traj_write
 * and traj_read): what a window returns (obs, is_init, extras, versions, and the state before its
 * first step), each env slot's ring wrapping at --trajectory-steps (and its steps by number, for
 * cursor windows), slots that do not disturb
 * each other, the layout's bounds, and the ops refusing bad rows (out of range, written twice,
 * missing columns) without writing anything.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "rnnd_kernels.h"
#include "trajectory.h"

struct fixture {
    struct rnnd_backend be;
    struct rnnd_model m;
    struct rnnd_traj_dims d;
    struct rnnd_traj_store st;
    void *block;
};

static void fixture_open(struct fixture *f, int I, int E, int L, int H, bool lstm, int cap,
                         int slots) {
    memset(f, 0, sizeof(*f));
    assert_int_equal(rnnd_backend_cpu_init(&f->be), 0);
    f->m = (struct rnnd_model){.cell = lstm ? RNND_CELL_LSTM : RNND_CELL_GRU,
                               .compute = RNND_COMPUTE_FP32,
                               .I = I,
                               .H = H,
                               .L = L};
    f->d = (struct rnnd_traj_dims){.I = I, .E = E, .L = L, .H = H, .lstm = lstm, .cap = cap};
    size_t bytes = rnnd_traj_layout(&f->st, &f->d, slots, NULL);
    assert_true(bytes >= rnnd_traj_row_bytes(&f->d) * (size_t)slots * (size_t)cap);
    assert_int_equal(f->be.ops->alloc(f->be.ctx, bytes, &f->block), 0);
    assert_int_equal(rnnd_traj_layout(&f->st, &f->d, slots, f->block), bytes);
    assert_int_equal(f->st.R, (int64_t)slots * cap);
}

static void fixture_close(struct fixture *f) {
    f->be.ops->free(f->be.ctx, f->block);
    rnnd_backend_free(&f->be);
}

// Step k of env `slot`'s fake trajectory: obs = 1000 slot + k + i/10, extras = -k, h = 100k + j,
// c = -h, is_init every third step, version k / 4.
static void push_step(struct fixture *f, struct rnnd_traj_ring *ring, int32_t slot, int k) {
    float obs[8], ex[4], h[16], c[16];
    for (int i = 0; i < f->d.I; i++)
        obs[i] = 1000.0f * (float)slot + (float)k + (float)i / 10.0f;
    for (int i = 0; i < f->d.E; i++)
        ex[i] = -(float)k;
    for (int j = 0; j < f->d.L * f->d.H; j++) {
        h[j] = 100.0f * (float)k + (float)j;
        c[j] = -h[j];
    }
    uint8_t init = k % 3 == 0;
    uint64_t ver = (uint64_t)k / 4;
    int32_t row = rnnd_traj_next(ring, &f->d, slot);
    struct rnnd_traj_rows r = {.n = 1,
                               .rows = &row,
                               .obs = obs,
                               .extras = f->d.E ? ex : NULL,
                               .h = h,
                               .c = f->d.lstm ? c : NULL,
                               .is_init = &init,
                               .version = &ver};
    assert_int_equal(f->be.ops->traj_write(f->be.ctx, &f->st, &r, &f->m), 0);
    rnnd_traj_push(ring, &f->d);
}

// The last T steps of the ring read back as steps first .. first + T - 1.
static void check_window(struct fixture *f, const struct rnnd_traj_ring *ring, int32_t slot, int T,
                         int first) {
    int32_t rows[64], head;
    float obs[64 * 8], ex[64 * 4], h0[16], c0[16];
    uint8_t init[64];
    uint64_t ver[64];
    for (int t = 0; t < T; t++)
        rows[t] = rnnd_traj_row(ring, &f->d, slot, T, t);
    head = rows[0];
    struct rnnd_traj_rows win = {.n = T,
                                 .rows = rows,
                                 .obs = obs,
                                 .extras = f->d.E ? ex : NULL,
                                 .is_init = init,
                                 .version = ver};
    struct rnnd_traj_rows st0 = {.n = 1, .rows = &head, .h = h0, .c = f->d.lstm ? c0 : NULL};
    assert_int_equal(f->be.ops->traj_read(f->be.ctx, &win, &f->st, &f->m), 0);
    assert_int_equal(f->be.ops->traj_read(f->be.ctx, &st0, &f->st, &f->m), 0);
    for (int t = 0; t < T; t++) {
        int k = first + t;
        for (int i = 0; i < f->d.I; i++)
            assert_true(obs[t * f->d.I + i] == 1000.0f * (float)slot + (float)k + (float)i / 10.0f);
        for (int i = 0; i < f->d.E; i++)
            assert_true(ex[t * f->d.E + i] == -(float)k);
        assert_int_equal(init[t], k % 3 == 0);
        assert_int_equal(ver[t], k / 4);
    }
    for (int j = 0; j < f->d.L * f->d.H; j++) {
        assert_true(h0[j] == 100.0f * (float)first + (float)j);
        if (f->d.lstm)
            assert_true(c0[j] == -(100.0f * (float)first + (float)j));
    }
}

static void test_window_before_wrap(void **state) {
    (void)state;
    struct fixture f;
    fixture_open(&f, 3, 2, 2, 2, true, 40, 3);
    struct rnnd_traj_ring a = {0}, b = {0};
    for (int k = 0; k < 25; k++) { // two envs, interleaved, in slots 2 and 0
        push_step(&f, &a, 2, k);
        push_step(&f, &b, 0, 100 + k);
    }
    assert_int_equal(a.count, 25);
    check_window(&f, &a, 2, 25, 0);
    check_window(&f, &a, 2, 5, 20);
    check_window(&f, &a, 2, 1, 24);
    check_window(&f, &b, 0, 7, 118);
    fixture_close(&f);
}

static void test_wraps_keeping_last_cap(void **state) {
    (void)state;
    struct fixture f;
    fixture_open(&f, 2, 0, 1, 3, false, 20, 2);
    struct rnnd_traj_ring a = {0}, b = {0};
    for (int k = 0; k < 57; k++)
        push_step(&f, &a, 1, k);
    push_step(&f, &b, 0, 5); // the slot before a's is untouched by a's wrapping
    assert_int_equal(a.count, 20);
    check_window(&f, &a, 1, 20, 37); // the oldest kept is step 37
    check_window(&f, &a, 1, 3, 54);
    check_window(&f, &b, 0, 1, 5);
    // Steps by number (cursor windows): the ring holds steps [total - count, total).
    assert_int_equal(a.total, 57);
    assert_int_equal(b.total, 1);
    for (int k = 37; k < 57; k++)
        assert_int_equal(rnnd_traj_row_at(&a, &f.d, 1, (uint64_t)k),
                         rnnd_traj_row(&a, &f.d, 1, 57 - k, 0));
    fixture_close(&f);
}

static void test_layout_bounds(void **state) {
    (void)state;
    struct rnnd_traj_dims d = {.I = 64, .E = 0, .L = 1, .H = 128, .lstm = false, .cap = 1 << 20};
    struct rnnd_traj_store st;
    // 2^26 slots x 2^20 steps: more rows than an int32 index reaches.
    assert_int_equal(rnnd_traj_layout(&st, &d, 1 << 26, NULL), 0);
    // A step of a GRU I=64 H=128 without extras: obs, h, is_init and version.
    assert_int_equal(rnnd_traj_row_bytes(&d), (64 + 128) * 4 + 8 + 1);
}

static void test_ops_refuse_bad_rows(void **state) {
    (void)state;
    struct fixture f;
    fixture_open(&f, 1, 1, 1, 1, false, 4, 2);
    struct rnnd_traj_ring a = {0};
    push_step(&f, &a, 0, 1);
    float obs[2] = {7, 7}, ex[2] = {7, 7}, h[2] = {7, 7};
    uint8_t init[2] = {1, 1};
    uint64_t ver[2] = {7, 7};
    int32_t rows[2] = {0, 0};
    struct rnnd_traj_rows r = {
        .n = 2, .rows = rows, .obs = obs, .extras = ex, .h = h, .is_init = init, .version = ver};
    // The same row twice, a row past the store, a missing column: refused, nothing written.
    assert_int_equal(f.be.ops->traj_write(f.be.ctx, &f.st, &r, &f.m), RNND_EINVAL);
    rows[1] = 8;
    assert_int_equal(f.be.ops->traj_write(f.be.ctx, &f.st, &r, &f.m), RNND_EINVAL);
    rows[1] = -1;
    assert_int_equal(f.be.ops->traj_read(f.be.ctx, &r, &f.st, &f.m), RNND_EINVAL);
    rows[1] = 1;
    r.extras = NULL;
    assert_int_equal(f.be.ops->traj_write(f.be.ctx, &f.st, &r, &f.m), RNND_EINVAL);
    check_window(&f, &a, 0, 1, 1);
    // A read fills only the columns asked for.
    r.n = 1;
    r.h = NULL;
    r.is_init = NULL;
    obs[0] = 42;
    assert_int_equal(f.be.ops->traj_read(f.be.ctx, &r, &f.st, &f.m), 0);
    assert_true(obs[0] == 1.0f && h[0] == 7.0f && init[0] == 1 && ver[0] == 0);
    fixture_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_before_wrap),
        cmocka_unit_test(test_wraps_keeping_last_cap),
        cmocka_unit_test(test_layout_bounds),
        cmocka_unit_test(test_ops_refuse_bad_rows),
    };
    return cmocka_run_group_tests_name("trajectory", tests, NULL, NULL);
}
