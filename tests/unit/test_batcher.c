/*
 * test_batcher.c: dynamic batching rules (server/batcher.c), driven with explicit clocks through
 * rnnd_batcher_poll: flush on --max-batch rows, on --max-delay-us, and early when every active
 * source has a step waiting; never two steps of one env in one batch, with the later one and
 * everything behind it on the same env held back in arrival order; the queue bound; rejection by
 * the admit callback, and items it holds (they keep their place and their envs); control jobs
 * first, alone in their poll.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "batcher.h"
#include "rnnd_kernels.h"

#define MS 1000000ull
#define US 1000ull

struct item {
    struct rnnd_batch_item it; // first
    uint64_t ids[8];
    int tag;
    bool reject;
    int hold; // offers to hold before admitting
};

static struct item *mk(int tag, uint64_t source, int B, ...) {
    struct item *x = calloc(1, sizeof(*x));
    va_list ap;
    va_start(ap, B);
    for (int i = 0; i < B; i++)
        x->ids[i] = va_arg(ap, uint64_t);
    va_end(ap);
    x->it.B = B;
    x->it.env_ids = x->ids;
    x->it.source = source;
    x->tag = tag;
    return x;
}

static int admitted_count;

static enum rnnd_batch_admit admit(void *ctx, struct rnnd_batch_item *item) {
    (void)ctx;
    struct item *x = (struct item *)item;
    if (x->reject)
        return RNND_BATCH_REJECT;
    if (x->hold > 0) {
        x->hold--;
        return RNND_BATCH_HOLD;
    }
    admitted_count++;
    return RNND_BATCH_ADMIT;
}

// Tags of a list, in order, into out (returns the count).
static int tags(const struct rnnd_batch_item *l, int *out) {
    int n = 0;
    for (; l; l = l->next)
        out[n++] = ((const struct item *)l)->tag;
    return n;
}

static void free_list(struct rnnd_batch_item *l) {
    while (l) {
        struct rnnd_batch_item *n = l->next;
        free(l);
        l = n;
    }
}

static struct rnnd_batcher *mkb(int max_batch, uint64_t delay_ns, int queue_rows) {
    struct rnnd_batcher_config c = {
        .max_batch = max_batch, .max_delay_ns = delay_ns, .max_queue_rows = queue_rows};
    struct rnnd_batcher *b = rnnd_batcher_init(&c);
    assert_non_null(b);
    return b;
}

static void test_first_item_runs_at_once(void **state) {
    (void)state;
    struct rnnd_batcher *b = mkb(8, 200 * US, 64);
    struct rnnd_batch out;
    uint64_t wait;
    assert_false(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    assert_true(wait == UINT64_MAX); // nothing queued: sleep until a push
    assert_int_equal(rnnd_batcher_push(b, &mk(1, 7, 1, 10ull)->it, 1000), 0);
    // No previous batch: nobody to wait for, so it goes now (a lone actor's latency).
    assert_true(rnnd_batcher_poll(b, 1000, admit, NULL, &out, &wait));
    int t[8];
    assert_int_equal(tags(out.items, t), 1);
    assert_int_equal(out.rows, 1);
    free_list(out.items);
    assert_int_equal(rnnd_batcher_rows(b), 0);
    rnnd_batcher_free(b);
}

static void test_waits_for_active_sources_then_delay(void **state) {
    (void)state;
    // max_delay 200 us: a source is active for 20 * 200 us = 4 ms after its last step.
    struct rnnd_batcher *b = mkb(64, 200 * US, 1024);
    struct rnnd_batch out;
    uint64_t wait;
    int t[8];
    // Sources 1 and 2 both step: one batch.
    rnnd_batcher_push(b, &mk(1, 1, 1, 10ull)->it, 0);
    rnnd_batcher_push(b, &mk(2, 2, 1, 20ull)->it, 0);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 2);
    free_list(out.items);
    // Source 1 is back, source 2 (active) not yet: wait, at most max_delay.
    rnnd_batcher_push(b, &mk(3, 1, 1, 11ull)->it, 10 * US);
    assert_false(rnnd_batcher_poll(b, 50 * US, admit, NULL, &out, &wait));
    assert_int_equal(wait, 160 * US);
    // Source 2 arrives: every active source is waiting, go early.
    rnnd_batcher_push(b, &mk(4, 2, 1, 21ull)->it, 60 * US);
    assert_true(rnnd_batcher_poll(b, 60 * US, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 2);
    assert_int_equal(t[0], 3);
    assert_int_equal(t[1], 4);
    free_list(out.items);
    // Only source 1 comes back: the batch goes max_delay after its arrival.
    rnnd_batcher_push(b, &mk(5, 1, 1, 12ull)->it, 100 * US);
    assert_false(rnnd_batcher_poll(b, 299 * US, admit, NULL, &out, &wait));
    assert_int_equal(wait, 1 * US);
    assert_true(rnnd_batcher_poll(b, 300 * US, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 1);
    free_list(out.items);
    // Source 2 has been silent for longer than the window: source 1 no longer waits for it.
    rnnd_batcher_push(b, &mk(6, 1, 1, 13ull)->it, 5 * MS);
    assert_true(rnnd_batcher_poll(b, 5 * MS, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 1);
    assert_int_equal(t[0], 6);
    free_list(out.items);
    rnnd_batcher_free(b);
}

static void test_max_batch_rows(void **state) {
    (void)state;
    struct rnnd_batcher *b = mkb(4, 1000 * MS, 64);
    struct rnnd_batch out;
    uint64_t wait;
    int t[8];
    // Prime "previous sources" with 1, 2 and 3 so the batcher would otherwise wait.
    rnnd_batcher_push(b, &mk(0, 1, 1, 1ull)->it, 0);
    rnnd_batcher_push(b, &mk(0, 2, 1, 2ull)->it, 0);
    rnnd_batcher_push(b, &mk(0, 3, 1, 3ull)->it, 0);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    free_list(out.items);
    rnnd_batcher_push(b, &mk(1, 1, 3, 10ull, 11ull, 12ull)->it, 0);
    assert_false(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait)); // 3 rows < 4, 2 and 3 away
    rnnd_batcher_push(b, &mk(2, 2, 2, 20ull, 21ull)->it, 0);
    // 5 rows queued >= max_batch: due now, but only item 1 fits (items are never split).
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 1);
    assert_int_equal(out.rows, 3);
    free_list(out.items);
    // Item 2 was held back: it goes at the next poll without waiting.
    assert_true(rnnd_batcher_poll(b, 1, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 1);
    assert_int_equal(t[0], 2);
    free_list(out.items);
    rnnd_batcher_free(b);
}

static void test_same_env_never_twice_order_kept(void **state) {
    (void)state;
    struct rnnd_batcher *b = mkb(64, 0, 1024);
    struct rnnd_batch out;
    uint64_t wait;
    int t[8];
    rnnd_batcher_push(b, &mk(1, 1, 2, 100ull, 101ull)->it, 0);
    rnnd_batcher_push(b, &mk(2, 2, 1, 100ull)->it, 0);         // env 100 again: waits
    rnnd_batcher_push(b, &mk(3, 3, 1, 200ull)->it, 0);         // independent: joins
    rnnd_batcher_push(b, &mk(4, 4, 2, 300ull, 100ull)->it, 0); // behind item 2 on env 100: waits
    rnnd_batcher_push(b, &mk(5, 5, 1, 300ull)->it, 0);         // behind item 4 on env 300: waits
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    int n = tags(out.items, t);
    assert_int_equal(n, 2);
    assert_int_equal(t[0], 1);
    assert_int_equal(t[1], 3);
    free_list(out.items);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    n = tags(out.items, t);
    assert_int_equal(n, 1);
    assert_int_equal(t[0], 2);
    free_list(out.items);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    n = tags(out.items, t);
    assert_int_equal(n, 1);
    assert_int_equal(t[0], 4);
    free_list(out.items);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    n = tags(out.items, t);
    assert_int_equal(n, 1);
    assert_int_equal(t[0], 5);
    free_list(out.items);
    assert_true(rnnd_batcher_empty(b));
    rnnd_batcher_free(b);
}

static void test_queue_bound_and_bad_sizes(void **state) {
    (void)state;
    struct rnnd_batcher *b = mkb(4, 1000 * MS, 6);
    struct item *a = mk(1, 1, 4, 1ull, 2ull, 3ull, 4ull), *c = mk(2, 1, 2, 5ull, 6ull),
                *d = mk(3, 1, 1, 7ull), *big = mk(4, 1, 5, 8ull, 9ull, 10ull, 11ull, 12ull);
    struct item *zero = mk(5, 1, 0);
    assert_int_equal(rnnd_batcher_push(b, &a->it, 0), 0);
    assert_int_equal(rnnd_batcher_push(b, &c->it, 0), 0);
    assert_int_equal(rnnd_batcher_rows(b), 6);
    assert_int_equal(rnnd_batcher_push(b, &d->it, 0), RNND_EFULL);    // 7 > 6 rows
    assert_int_equal(rnnd_batcher_push(b, &big->it, 0), RNND_EINVAL); // B > max_batch
    assert_int_equal(rnnd_batcher_push(b, &zero->it, 0), RNND_EINVAL);
    assert_int_equal(rnnd_batcher_rows(b), 6); // refused pushes left no trace
    struct rnnd_batch out;
    uint64_t wait;
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    free_list(out.items);
    assert_int_equal(rnnd_batcher_rows(b), 2);
    assert_int_equal(rnnd_batcher_push(b, &d->it, 0), 0); // room again
    rnnd_batcher_close(b);
    assert_int_equal(rnnd_batcher_push(b, &big->it, 0), RNND_EINVAL);
    struct item *late = mk(6, 1, 1, 99ull);
    assert_int_equal(rnnd_batcher_push(b, &late->it, 0), RNND_EUNAVAIL);
    // Closed: what is queued flushes without waiting.
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    int t[8];
    assert_int_equal(tags(out.items, t), 2);
    free_list(out.items);
    assert_true(rnnd_batcher_empty(b));
    free(big);
    free(zero);
    free(late);
    rnnd_batcher_free(b);
}

static void test_reject_and_controls(void **state) {
    (void)state;
    struct rnnd_batcher *b = mkb(8, 0, 64);
    struct item *x = mk(1, 1, 1, 5ull), *y = mk(2, 1, 1, 5ull), *z = mk(3, 1, 1, 6ull);
    x->reject = true;
    rnnd_batcher_push(b, &x->it, 0);
    rnnd_batcher_push(b, &y->it, 0);
    rnnd_batcher_push(b, &z->it, 0);
    struct item *ctl1 = mk(10, 0, 0), *ctl2 = mk(11, 0, 0);
    rnnd_batcher_push_control(b, &ctl1->it);
    rnnd_batcher_push_control(b, &ctl2->it);
    struct rnnd_batch out;
    uint64_t wait;
    admitted_count = 0;
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    int t[8];
    assert_int_equal(tags(out.controls, t), 2);
    assert_int_equal(t[0], 10);
    assert_int_equal(t[1], 11);
    // The controls come alone: Steps are admitted only once they have run.
    assert_null(out.items);
    assert_null(out.rejected);
    assert_int_equal(admitted_count, 0);
    free_list(out.controls);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    assert_null(out.controls);
    // A rejected item holds nobody back: env 5's next step joins the same batch.
    assert_int_equal(tags(out.rejected, t), 1);
    assert_int_equal(t[0], 1);
    assert_int_equal(tags(out.items, t), 2);
    assert_int_equal(t[0], 2);
    assert_int_equal(t[1], 3);
    assert_int_equal(out.rows, 2);
    assert_int_equal(rnnd_batcher_rows(b), 0);
    free_list(out.rejected);
    free_list(out.items);
    rnnd_batcher_free(b);
}

// A held item stays queued in its place with its envs: a later step of one of them waits behind
// it, other envs go ahead; once admitted it runs, and the one behind it follows.
static void test_hold(void **state) {
    (void)state;
    struct rnnd_batcher *b = mkb(8, 0, 64);
    struct item *x = mk(1, 1, 2, 5ull, 6ull), *y = mk(2, 2, 1, 6ull), *z = mk(3, 3, 1, 7ull);
    x->hold = 2;
    rnnd_batcher_push(b, &x->it, 0);
    rnnd_batcher_push(b, &y->it, 0);
    rnnd_batcher_push(b, &z->it, 0);
    struct rnnd_batch out;
    uint64_t wait;
    int t[8];
    for (int round = 0; round < 2; round++) {
        assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait) == (round == 0));
        assert_int_equal(tags(out.items, t), round == 0 ? 1 : 0);
        if (round == 0)
            assert_int_equal(t[0], 3);
        assert_null(out.rejected);
        free_list(out.items);
        // Nothing to run but the held item (and what waits behind it): sleep until a wake.
        assert_int_equal(wait, UINT64_MAX);
        assert_int_equal(rnnd_batcher_rows(b), 3);
        assert_false(rnnd_batcher_empty(b));
    }
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 1);
    assert_int_equal(t[0], 1);
    free_list(out.items);
    assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
    assert_int_equal(tags(out.items, t), 1);
    assert_int_equal(t[0], 2);
    free_list(out.items);
    assert_true(rnnd_batcher_empty(b));
    rnnd_batcher_free(b);
}

static void test_many_sources_large_queue(void **state) {
    (void)state;
    // 300 single-row items over 10 envs, max_batch 64: every env's steps come out in order and
    // no batch holds an env twice.
    struct rnnd_batcher *b = mkb(64, 0, 100000);
    enum { N = 300 };
    for (int i = 0; i < N; i++)
        assert_int_equal(
            rnnd_batcher_push(b, &mk(i, (uint64_t)i % 7, 1, (uint64_t)(i % 10))->it, 0), 0);
    int last[100];
    for (int e = 0; e < 100; e++)
        last[e] = -1;
    int seen = 0;
    while (!rnnd_batcher_empty(b)) {
        struct rnnd_batch out;
        uint64_t wait;
        assert_true(rnnd_batcher_poll(b, 0, admit, NULL, &out, &wait));
        assert_true(out.rows <= 64);
        int inbatch[100] = {0};
        for (struct rnnd_batch_item *it = out.items; it; it = it->next) {
            int tag = ((struct item *)it)->tag, env = tag % 10;
            assert_int_equal(inbatch[env]++, 0);
            assert_true(tag > last[env]);
            last[env] = tag;
            seen++;
        }
        free_list(out.items);
    }
    assert_int_equal(seen, N);
    rnnd_batcher_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_item_runs_at_once),
        cmocka_unit_test(test_waits_for_active_sources_then_delay),
        cmocka_unit_test(test_max_batch_rows),
        cmocka_unit_test(test_same_env_never_twice_order_kept),
        cmocka_unit_test(test_queue_bound_and_bad_sizes),
        cmocka_unit_test(test_reject_and_controls),
        cmocka_unit_test(test_hold),
        cmocka_unit_test(test_many_sources_large_queue),
    };
    return cmocka_run_group_tests_name("batcher", tests, NULL, NULL);
}
