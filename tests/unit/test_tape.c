/*
 * test_tape.c: the Forward tape store (server/tape.c): ids, lookup, one-shot removal, the
 * memory budget (refused before anything is kept) and expiry after the time-to-live, with every
 * dropped tape released exactly once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "rnnd_kernels.h"
#include "tape.h"

static int released[16];

static void release(void *ctx, void *tape) {
    (void)ctx;
    released[*(int *)tape]++;
}

static int vals[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static void test_add_get_remove(void **state) {
    (void)state;
    memset(released, 0, sizeof(released));
    struct rnnd_tapes *ts = rnnd_tapes_init(1000, 5000, release, NULL);
    uint64_t a, b;
    assert_int_equal(rnnd_tapes_add(ts, &vals[1], 100, 0, &a), 0);
    assert_int_equal(rnnd_tapes_add(ts, &vals[2], 200, 0, &b), 0);
    assert_true(a != 0 && b != 0 && a != b);
    assert_int_equal(rnnd_tapes_count(ts), 2);
    assert_int_equal(rnnd_tapes_bytes(ts), 300);
    void *p;
    assert_int_equal(rnnd_tapes_get(ts, a, 10, &p), 0);
    assert_ptr_equal(p, &vals[1]);
    assert_int_equal(rnnd_tapes_get(ts, 0, 10, &p), RNND_ENOTFOUND);
    assert_int_equal(rnnd_tapes_get(ts, 12345, 10, &p), RNND_ENOTFOUND);
    assert_int_equal(rnnd_tapes_remove(ts, a), 0);
    assert_int_equal(released[1], 1);
    assert_int_equal(rnnd_tapes_get(ts, a, 10, &p), RNND_ENOTFOUND); // used once
    assert_int_equal(rnnd_tapes_remove(ts, a), RNND_ENOTFOUND);
    assert_int_equal(rnnd_tapes_bytes(ts), 200);
    // Ids are never reused.
    uint64_t c;
    assert_int_equal(rnnd_tapes_add(ts, &vals[3], 1, 0, &c), 0);
    assert_true(c != a && c != b);
    rnnd_tapes_free(ts); // releases what is left
    assert_int_equal(released[2], 1);
    assert_int_equal(released[3], 1);
    assert_int_equal(released[1], 1);
}

static void test_budget(void **state) {
    (void)state;
    memset(released, 0, sizeof(released));
    struct rnnd_tapes *ts = rnnd_tapes_init(1000, 5000, release, NULL);
    uint64_t id;
    assert_int_equal(rnnd_tapes_fits(ts, 1000, 0), 0);
    assert_int_equal(rnnd_tapes_fits(ts, 1001, 0), RNND_EFULL);
    assert_int_equal(rnnd_tapes_add(ts, &vals[1], 600, 0, &id), 0);
    assert_int_equal(rnnd_tapes_fits(ts, 401, 0), RNND_EFULL);
    assert_int_equal(rnnd_tapes_add(ts, &vals[2], 401, 0, &id), RNND_EFULL);
    assert_int_equal(released[2], 0); // refused: the caller still owns it
    assert_int_equal(rnnd_tapes_count(ts), 1);
    assert_int_equal(rnnd_tapes_add(ts, &vals[2], 400, 0, &id), 0);
    assert_int_equal(rnnd_tapes_bytes(ts), 1000);
    assert_int_equal(rnnd_tapes_budget(ts), 1000);
    rnnd_tapes_free(ts);
}

static void test_expiry(void **state) {
    (void)state;
    memset(released, 0, sizeof(released));
    struct rnnd_tapes *ts = rnnd_tapes_init(1000, 5000, release, NULL);
    uint64_t a, b;
    rnnd_tapes_add(ts, &vals[1], 600, 1000, &a);
    rnnd_tapes_add(ts, &vals[2], 300, 3000, &b);
    void *p;
    assert_int_equal(rnnd_tapes_get(ts, a, 5999, &p), 0);
    assert_int_equal(rnnd_tapes_expire(ts, 5999), 0);
    assert_int_equal(rnnd_tapes_get(ts, a, 6000, &p), RNND_ENOTFOUND); // expired at 1000 + 5000
    assert_int_equal(released[1], 1);
    assert_int_equal(rnnd_tapes_get(ts, b, 6000, &p), 0);
    // Expired tapes free the budget for a new one.
    assert_int_equal(rnnd_tapes_fits(ts, 700, 6000), 0);
    assert_int_equal(rnnd_tapes_fits(ts, 701, 6000), RNND_EFULL);
    assert_int_equal(rnnd_tapes_fits(ts, 1000, 8000), 0); // b expired too
    assert_int_equal(released[2], 1);
    assert_int_equal(rnnd_tapes_count(ts), 0);
    assert_int_equal(rnnd_tapes_bytes(ts), 0);
    rnnd_tapes_free(ts);
    assert_int_equal(released[1], 1);
    assert_int_equal(released[2], 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add_get_remove),
        cmocka_unit_test(test_budget),
        cmocka_unit_test(test_expiry),
    };
    return cmocka_run_group_tests_name("tape", tests, NULL, NULL);
}
