/*
 * test_envtable.c: env id -> state slot (server/envtable.c): lookups (also from a slot hint),
 * slot reuse, the capacity bound, use order for idle eviction, and each env's cached output row.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "envtable.h"
#include "rnnd_kernels.h"

static void test_add_find_remove(void **state) {
    (void)state;
    struct rnnd_envtable *t = rnnd_envtable_init(4, 3);
    assert_non_null(t);
    struct rnnd_env *a, *b;
    assert_null(rnnd_envtable_find(t, 42));
    assert_int_equal(rnnd_envtable_add(t, 42, 100, &a), 0);
    assert_int_equal(rnnd_envtable_add(t, UINT64_MAX, 100, &b), 0);
    assert_ptr_equal(rnnd_envtable_find(t, 42), a);
    assert_ptr_equal(rnnd_envtable_find(t, UINT64_MAX), b);
    assert_int_equal(a->id, 42);
    assert_true(a->slot != b->slot);
    assert_true(a->slot >= 0 && a->slot < 4 && b->slot >= 0 && b->slot < 4);
    assert_int_equal(rnnd_envtable_count(t), 2);
    assert_false(a->has_index);
    assert_int_equal(a->traj.count, 0);
    int32_t slot = a->slot;
    rnnd_envtable_remove(t, a);
    assert_null(rnnd_envtable_find(t, 42));
    assert_ptr_equal(rnnd_envtable_find(t, UINT64_MAX), b);
    assert_int_equal(rnnd_envtable_count(t), 1);
    // The freed slot is handed out again.
    struct rnnd_env *c;
    assert_int_equal(rnnd_envtable_add(t, 7, 200, &c), 0);
    assert_int_equal(c->slot, slot);
    assert_false(c->has_index); // nothing left over from env 42
    rnnd_envtable_free(t);
}

// A hint is only a place to look first: a stale, foreign or out-of-range one finds the same env.
static void test_find_hint(void **state) {
    (void)state;
    struct rnnd_envtable *t = rnnd_envtable_init(8, 2);
    assert_non_null(t);
    struct rnnd_env *a, *b, *c;
    assert_int_equal(rnnd_envtable_add(t, 100, 0, &a), 0);
    assert_int_equal(rnnd_envtable_add(t, 200, 0, &b), 0);
    int32_t hints[] = {a->slot, b->slot, a->slot, -1, 8, 1 << 30};
    uint64_t ids[] = {100, 200, 200, 100, 200, 100};
    rnnd_envtable_prefetch_hints(t, ids, hints, 6);
    assert_ptr_equal(rnnd_envtable_find_hint(t, 100, a->slot), a); // right
    assert_ptr_equal(rnnd_envtable_find_hint(t, 200, a->slot), b); // another id's slot
    assert_ptr_equal(rnnd_envtable_find_hint(t, 100, -1), a);      // none
    assert_ptr_equal(rnnd_envtable_find_hint(t, 200, 8), b);       // out of range
    assert_null(rnnd_envtable_find_hint(t, 300, a->slot));         // unknown id
    int32_t old = a->slot;
    rnnd_envtable_remove(t, a);
    assert_null(rnnd_envtable_find_hint(t, 100, old)); // removed: its slot is free
    assert_int_equal(rnnd_envtable_add(t, 300, 0, &c), 0);
    assert_int_equal(c->slot, old); // the freed slot, now another id's
    assert_null(rnnd_envtable_find_hint(t, 100, old));
    assert_ptr_equal(rnnd_envtable_find_hint(t, 300, old), c);
    rnnd_envtable_free(t);
}

static void test_full(void **state) {
    (void)state;
    struct rnnd_envtable *t = rnnd_envtable_init(3, 2);
    struct rnnd_env *e;
    for (uint64_t id = 0; id < 3; id++)
        assert_int_equal(rnnd_envtable_add(t, id * 1000003, 0, &e), 0);
    assert_int_equal(rnnd_envtable_add(t, 99, 0, &e), RNND_EFULL);
    assert_int_equal(rnnd_envtable_count(t), 3);
    assert_int_equal(rnnd_envtable_capacity(t), 3);
    rnnd_envtable_remove(t, rnnd_envtable_find(t, 1000003));
    assert_int_equal(rnnd_envtable_add(t, 99, 0, &e), 0);
    rnnd_envtable_free(t);
}

static void test_use_order(void **state) {
    (void)state;
    struct rnnd_envtable *t = rnnd_envtable_init(8, 2);
    struct rnnd_env *e[4];
    const uint64_t S = RNND_ENV_TOUCH_SLACK_NS;
    for (int i = 0; i < 4; i++)
        rnnd_envtable_add(t, (uint64_t)i, (uint64_t)i, &e[i]);
    assert_ptr_equal(rnnd_envtable_oldest(t), e[0]);
    rnnd_envtable_touch(t, e[0], 10 + S);
    rnnd_envtable_touch(t, e[2], 11 + S);
    // Oldest first: 1, 3, 0, 2.
    uint64_t want[4] = {1, 3, 0, 2};
    int n = 0;
    for (struct rnnd_env *x = rnnd_envtable_oldest(t); x; x = rnnd_envtable_newer(t, x))
        assert_int_equal(x->id, want[n++]);
    assert_int_equal(n, 4);
    assert_int_equal(e[2]->last_used_ns, 11 + S);
    // Within the slack of its last move an entry keeps its place but takes the time.
    rnnd_envtable_touch(t, e[0], 12 + S);
    assert_int_equal(e[0]->last_used_ns, 12 + S);
    n = 0;
    for (struct rnnd_env *x = rnnd_envtable_oldest(t); x; x = rnnd_envtable_newer(t, x))
        assert_int_equal(x->id, want[n++]);
    rnnd_envtable_touch(t, e[0], 10 + 2 * S);
    assert_int_equal(rnnd_envtable_newer(t, e[2]), e[0]);
    rnnd_envtable_remove(t, e[3]);
    rnnd_envtable_remove(t, e[1]);
    assert_ptr_equal(rnnd_envtable_oldest(t), e[2]);
    rnnd_envtable_remove(t, e[0]);
    rnnd_envtable_remove(t, e[2]);
    assert_null(rnnd_envtable_oldest(t));
    assert_int_equal(rnnd_envtable_count(t), 0);
    rnnd_envtable_free(t);
}

static void test_many_with_collisions(void **state) {
    (void)state;
    enum { N = 5000 };
    struct rnnd_envtable *t = rnnd_envtable_init(N, 1);
    struct rnnd_env *e;
    for (uint64_t i = 0; i < N; i++) // ids that share low bits
        assert_int_equal(rnnd_envtable_add(t, i << 32, 0, &e), 0);
    for (uint64_t i = 0; i < N; i += 2)
        rnnd_envtable_remove(t, rnnd_envtable_find(t, i << 32));
    // Prefetching ids present, removed and never added (and none) changes nothing.
    uint64_t ids[N + 2];
    for (uint64_t i = 0; i < N; i++)
        ids[i] = i << 32;
    ids[N] = 12345, ids[N + 1] = ~0ull;
    rnnd_envtable_prefetch(t, ids, N + 2);
    rnnd_envtable_prefetch(t, ids, 0);
    for (uint64_t i = 0; i < N; i++) {
        e = rnnd_envtable_find(t, i << 32);
        if (i % 2)
            assert_true(e != NULL && e->id == i << 32);
        else
            assert_null(e);
    }
    assert_int_equal(rnnd_envtable_count(t), N / 2);
    rnnd_envtable_free(t);
}

static void test_output_rows(void **state) {
    (void)state;
    struct rnnd_envtable *t = rnnd_envtable_init(4, 3);
    struct rnnd_env *a, *b;
    rnnd_envtable_add(t, 1, 0, &a);
    rnnd_envtable_add(t, 2, 0, &b);
    float *oa = rnnd_envtable_output(t, a), *ob = rnnd_envtable_output(t, b);
    assert_true(oa != ob);
    for (int i = 0; i < 3; i++) {
        oa[i] = 1.0f + (float)i;
        ob[i] = -1.0f;
    }
    assert_true(rnnd_envtable_output(t, a)[2] == 3.0f);
    assert_true(rnnd_envtable_output(t, b)[0] == -1.0f);
    rnnd_envtable_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add_find_remove), cmocka_unit_test(test_full),
        cmocka_unit_test(test_use_order),       cmocka_unit_test(test_many_with_collisions),
        cmocka_unit_test(test_output_rows),     cmocka_unit_test(test_find_hint),
    };
    return cmocka_run_group_tests_name("envtable", tests, NULL, NULL);
}
