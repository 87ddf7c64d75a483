/*
 * test_threadpool.c: the worker-thread pool (kernels/threadpool.c): a run calls every part once
 * and only once, part 0 on the calling thread, and returns only when every part has returned;
 * parts claimed by number or chunks claimed inside a part (the engine's row copies) are all done
 * exactly once, over many runs back to back, also when a run is started and joined later; posted tasks each run once, on a worker, and
 * freeing the pool runs every task still queued. Workers that spin before sleeping do the same,
 * with pauses shorter and longer than the spin between pieces of work. Each check counts per item, so a lost part or
 * task (0) and a duplicated one (2) both fail.
 */
#include <dirent.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "rnnd_threadpool.h"

#define MAX_PARTS 16

struct parts {
    _Atomic int calls[MAX_PARTS]; // per part k
    _Atomic int finished;         // parts that returned
    _Atomic int bad_n;            // calls whose n differs from the run's
    int n;                        // the m the run must use
    pthread_t caller;
    _Atomic int part0_elsewhere; // part 0 ran off the calling thread
};

static void part_fn(void *arg, int k, int n) {
    struct parts *p = arg;
    if (n != p->n)
        atomic_fetch_add(&p->bad_n, 1);
    if (k == 0 && !pthread_equal(pthread_self(), p->caller))
        atomic_fetch_add(&p->part0_elsewhere, 1);
    // A little work, so that workers and the caller overlap.
    volatile uint64_t x = 0;
    for (int i = 0; i < 2000 * (k + 1); i++)
        x += (uint64_t)i;
    atomic_fetch_add(&p->calls[k], 1);
    atomic_fetch_add(&p->finished, 1);
}

static void parts_reset(struct parts *p, int m) {
    memset(p, 0, sizeof(*p));
    p->n = m;
    p->caller = pthread_self();
}

// Every one of the run's m parts has returned, each called once with the run's m.
static void parts_check(struct parts *p, int m) {
    assert_int_equal(atomic_load(&p->finished), m);
    for (int k = 0; k < MAX_PARTS; k++)
        assert_int_equal(atomic_load(&p->calls[k]), k < m ? 1 : 0);
    assert_int_equal(atomic_load(&p->bad_n), 0);
}

// Runs `runs` runs of n parts on a pool of `workers` (spinning spin_us, with pause_us between
// runs) and checks every one.
static void check_runs_spin(int workers, int n, int runs, int spin_us, int pause_us) {
    struct rnnd_threadpool *pool = rnnd_threadpool_init(workers, NULL);
    assert_non_null(pool);
    rnnd_threadpool_spin(pool, spin_us);
    assert_int_equal(rnnd_threadpool_workers(pool), workers);
    int m = n < workers + 1 ? n : workers + 1;
    if (m < 1)
        m = 1;
    for (int r = 0; r < runs; r++) {
        struct parts p;
        parts_reset(&p, m);
        rnnd_threadpool_run(pool, n, part_fn, &p);
        // Every part returned before the run did: nothing may still be running.
        parts_check(&p, m);
        assert_int_equal(atomic_load(&p.part0_elsewhere), 0);
        if (pause_us)
            usleep((useconds_t)(pause_us * (r % 3)));
    }
    rnnd_threadpool_free(pool);
}

static void check_runs(int workers, int n, int runs) {
    check_runs_spin(workers, n, runs, 0, 0);
}

// A run in two halves: the parts run while this thread does other work, and the join returns
// only once each has run once (here or on a worker).
static void check_start_join(int workers, int n, int runs) {
    struct rnnd_threadpool *pool = rnnd_threadpool_init(workers, NULL);
    assert_non_null(pool);
    int m = n < workers + 1 ? n : workers + 1;
    struct parts p;
    for (int r = 0; r < runs; r++) {
        parts_reset(&p, m);
        rnnd_threadpool_start(pool, n, part_fn, &p);
        volatile uint64_t x = 0;
        for (int i = 0; i < 500 * (r % 7); i++)
            x += (uint64_t)i;
        rnnd_threadpool_join(pool);
        parts_check(&p, m);
    }
    // A whole run on the same pool after the halves: part 0 on the caller again.
    parts_reset(&p, m);
    rnnd_threadpool_run(pool, n, part_fn, &p);
    parts_check(&p, m);
    assert_int_equal(atomic_load(&p.part0_elsewhere), 0);
    rnnd_threadpool_free(pool);
}

static void test_start_join(void **state) {
    (void)state;
    check_start_join(1, 2, 500);
    check_start_join(3, 4, 500);
    check_start_join(3, 9, 300); // clamped to workers + 1
}

static void test_run_parts(void **state) {
    (void)state;
    check_runs(0, 4, 50);   // no workers: one part, on the caller
    check_runs(1, 2, 500);  // the CPU backend on two threads
    check_runs(3, 4, 500);  // as many parts as threads
    check_runs(3, 2, 500);  // fewer parts than threads: idle workers must not run one
    check_runs(7, 12, 300); // more parts than threads: clamped to workers + 1
    check_runs(2, 1, 50);   // one part: the caller alone
}

// The engine's row copies: every part takes chunks of items until none is left.
struct chunks {
    int n;
    _Atomic int next;
    _Atomic uint8_t *seen; // (n)
};

static void chunk_fn(void *arg, int k, int n) {
    (void)k;
    (void)n;
    struct chunks *c = arg;
    for (;;) {
        int first = atomic_fetch_add(&c->next, 7);
        if (first >= c->n)
            return;
        for (int i = first; i < first + 7 && i < c->n; i++)
            atomic_fetch_add(&c->seen[i], 1);
    }
}

static void test_run_chunks(void **state) {
    (void)state;
    enum { N = 4099 };
    static _Atomic uint8_t seen[N];
    struct rnnd_threadpool *pool = rnnd_threadpool_init(3, NULL);
    assert_non_null(pool);
    for (int r = 0; r < 300; r++) {
        for (int i = 0; i < N; i++)
            atomic_store(&seen[i], 0);
        struct chunks c = {.n = N, .seen = seen};
        rnnd_threadpool_run(pool, rnnd_threadpool_workers(pool) + 1, chunk_fn, &c);
        for (int i = 0; i < N; i++)
            if (atomic_load(&seen[i]) != 1)
                fail_msg("run %d: item %d done %d times", r, i, (int)atomic_load(&seen[i]));
    }
    rnnd_threadpool_free(pool);
}

static void test_null_pool(void **state) {
    (void)state;
    struct parts p;
    memset(&p, 0, sizeof(p));
    p.n = 1;
    p.caller = pthread_self();
    assert_int_equal(rnnd_threadpool_workers(NULL), 0);
    rnnd_threadpool_run(NULL, 8, part_fn, &p);
    assert_int_equal(atomic_load(&p.calls[0]), 1);
    assert_int_equal(atomic_load(&p.finished), 1);
    rnnd_threadpool_free(NULL);
}

struct item {
    struct rnnd_threadpool_task task; // first: the task is the item
    _Atomic int *runs;
    pthread_t caller;
    _Atomic int *on_caller;
};

static void item_fn(struct rnnd_threadpool_task *t) {
    struct item *it = (struct item *)t;
    if (pthread_equal(pthread_self(), it->caller))
        atomic_fetch_add(it->on_caller, 1);
    atomic_fetch_add(it->runs, 1);
}

static struct item item_make(_Atomic int *runs, _Atomic int *on_caller) {
    atomic_store(runs, 0);
    return (struct item){
        .task = {.fn = item_fn}, .runs = runs, .caller = pthread_self(), .on_caller = on_caller};
}

// Posted in chains of different lengths; freeing the pool right after runs what is queued.
static void test_post(void **state) {
    (void)state;
    enum { N = 3000 };
    static struct item items[N];
    static _Atomic int runs[N];
    _Atomic int on_caller = 0;
    for (int round = 0; round < 20; round++) {
        struct rnnd_threadpool *pool = rnnd_threadpool_init(1 + round % 3, NULL);
        assert_non_null(pool);
        for (int i = 0; i < N; i++)
            items[i] = item_make(&runs[i], &on_caller);
        for (int i = 0; i < N;) {
            int len = 1 + (i + round) % 9;
            if (i + len > N)
                len = N - i;
            for (int j = i; j < i + len - 1; j++)
                items[j].task.next = &items[j + 1].task;
            rnnd_threadpool_post(pool, &items[i].task, &items[i + len - 1].task);
            i += len;
        }
        rnnd_threadpool_free(pool);
        for (int i = 0; i < N; i++)
            if (atomic_load(&runs[i]) != 1)
                fail_msg("round %d: task %d ran %d times", round, i, atomic_load(&runs[i]));
    }
    assert_int_equal(atomic_load(&on_caller), 0);
}

// Posts of fewer tasks than workers wake as many workers as tasks: each post of one or two tasks
// to four sleeping workers runs, with nothing else to wake them (a lost wake-up fails here
// after 2 s instead of hanging until the pool is freed).
static void test_post_wakes(void **state) {
    (void)state;
    struct rnnd_threadpool *pool = rnnd_threadpool_init(4, NULL);
    assert_non_null(pool);
    static struct item items[2];
    static _Atomic int runs[2];
    _Atomic int on_caller = 0;
    for (int round = 0; round < 200; round++) {
        const int len = 1 + round % 2;
        for (int j = 0; j < len; j++)
            items[j] = item_make(&runs[j], &on_caller);
        if (len == 2)
            items[0].task.next = &items[1].task;
        if (round % 10 == 0)
            usleep(2000); // the workers asleep, not between tasks
        rnnd_threadpool_post(pool, &items[0].task, &items[len - 1].task);
        int waited_us = 0;
        while ((atomic_load(&runs[0]) != 1 || atomic_load(&runs[len - 1]) != 1) &&
               waited_us < 2000000) {
            usleep(50);
            waited_us += 50;
        }
        if (atomic_load(&runs[0]) != 1 || atomic_load(&runs[len - 1]) != 1)
            fail_msg("round %d: %d posted tasks did not all run within 2 s", round, len);
    }
    rnnd_threadpool_free(pool);
    assert_int_equal(atomic_load(&on_caller), 0);
}

// Spinning workers: runs back to back, after pauses within the spin and past it; posted tasks
// run while the pool lives (a worker that missed the hand-over and slept would leave them
// queued until the pool is freed); freeing a pool whose workers spin ends them.
static void test_spin(void **state) {
    (void)state;
    check_runs_spin(3, 4, 300, 500, 0);
    check_runs_spin(3, 4, 60, 500, 400); // pauses 0, 400 and 800 us
    check_runs_spin(2, 3, 60, 50, 100);
    enum { N = 200 };
    static struct item items[N];
    static _Atomic int runs[N];
    _Atomic int on_caller = 0;
    struct rnnd_threadpool *pool = rnnd_threadpool_init(2, NULL);
    assert_non_null(pool);
    rnnd_threadpool_spin(pool, 200);
    for (int i = 0; i < N; i++) {
        items[i] = item_make(&runs[i], &on_caller);
        rnnd_threadpool_post(pool, &items[i].task, &items[i].task);
        int waited = 0;
        while (atomic_load(&runs[i]) == 0 && waited++ < 2000)
            usleep(500);
        if (atomic_load(&runs[i]) != 1)
            fail_msg("task %d ran %d times while the pool lived", i, atomic_load(&runs[i]));
        usleep((useconds_t)(i % 4) * 100); // 0 to 300 us: within the spin and past it
    }
    rnnd_threadpool_free(pool);
    assert_int_equal(atomic_load(&on_caller), 0);
}

// The workers carry the pool's name (what top -H shows an operator).
static void test_names(void **state) {
    (void)state;
    struct rnnd_threadpool *pool = rnnd_threadpool_init(2, "rnnd-test");
    assert_int_equal(rnnd_threadpool_workers(pool), 2);
    int named = 0;
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    for (struct dirent *t; (t = readdir(d)) != NULL;) {
        char path[300], comm[32] = "";
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", t->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        if (fgets(comm, sizeof(comm), f) && strcmp(comm, "rnnd-test\n") == 0)
            named++;
        fclose(f);
    }
    closedir(d);
    assert_int_equal(named, 2);
    rnnd_threadpool_free(pool);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_run_parts),  cmocka_unit_test(test_run_chunks),
        cmocka_unit_test(test_null_pool),  cmocka_unit_test(test_post),
        cmocka_unit_test(test_post_wakes), cmocka_unit_test(test_names),
        cmocka_unit_test(test_spin),       cmocka_unit_test(test_start_join),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
