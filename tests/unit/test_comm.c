/*
 * test_comm.c: the cpu backend's in-process communicator (rnnd_comm.h): ranks are threads; the
 * sum and the broadcast give every rank the same bits, in rank order; a rank that never comes
 * makes the others fail after the timeout instead of hanging; cross-process use is refused.
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
    assert_int_equal(rnnd_comm_supported(&r[0].be, false, NULL, 0), 0);
    char why[256];
    assert_int_equal(rnnd_comm_supported(&r[0].be, true, why, sizeof(why)), RNND_ENOTSUP);
    assert_non_null(strstr(why, "one process"));
    assert_int_equal(rnnd_comm_id_new(&r[0].be, N, &id), 0);
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
    assert_int_equal(rnnd_comm_id_new(&r[0].be, N, &id), 0);
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_comm),
        cmocka_unit_test(test_cpu_comm_timeout),
    };
    return cmocka_run_group_tests_name("comm", tests, NULL, NULL);
}
