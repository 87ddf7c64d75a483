/*
 * threadpool.c: the worker-thread pool of rnnd_threadpool.h.
 *
 * One mutex guards everything; the workers wait on `wake` for a run's parts to take, posted
 * tasks or stop, and the thread in rnnd_threadpool_join waits on `done` for the parts that
 * workers took (rnnd_threadpool_run is a start and a join). A run's parts are handed out by
 * number under the mutex (next), so each runs exactly once whoever takes it: a worker that wakes
 * after the caller took the last part finds nothing and sleeps again, never touching the
 * caller's task. Posted tasks come first, and a stopping pool runs every one of them before its
 * workers end.
 */
#include "rnnd_threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

struct rnnd_threadpool {
    pthread_mutex_t mu;
    pthread_cond_t wake; // for the workers: parts to take, posted tasks, or stop
    pthread_cond_t done; // for the thread in rnnd_threadpool_join: a worker finished its part
    // The run in progress: parts next .. n-1 are not taken yet (none when next == n).
    rnnd_threadpool_fn fn;
    void *arg;
    int n, next;
    int running;                              // parts that workers took and have not finished
    struct rnnd_threadpool_task *head, *tail; // posted, not yet taken
    bool stop;
    int spin_us;
    // Bumped under mu whenever there is work (a run, posted tasks) or a stop: what a spinning
    // worker watches without the mutex.
    _Atomic uint32_t seq;
    int nworkers;
    pthread_t threads[]; // (nworkers)
};

static uint64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

// Called with mu held and nothing to do: watches seq for p->spin_us before sleeping on wake. A
// run's wake-up costs a futex call and the scheduler's delay, tens of microseconds on a busy
// host, while the caller runs the parts nobody has taken.
static void pool_wait(struct rnnd_threadpool *p) {
    if (p->spin_us > 0) {
        uint32_t seen = atomic_load_explicit(&p->seq, memory_order_relaxed);
        pthread_mutex_unlock(&p->mu);
        uint64_t until = mono_us() + (uint64_t)p->spin_us;
        bool changed = false;
        for (int i = 0; !changed; i++) {
            changed = atomic_load_explicit(&p->seq, memory_order_relaxed) != seen;
            if (!changed && (i & 63) == 63 && mono_us() >= until)
                break;
        }
        pthread_mutex_lock(&p->mu);
        // Work handed over between the last look and the lock bumped seq under mu: no sleep.
        if (changed || atomic_load_explicit(&p->seq, memory_order_relaxed) != seen)
            return;
    }
    pthread_cond_wait(&p->wake, &p->mu);
}

static void *pool_worker(void *arg) {
    struct rnnd_threadpool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (p->head) {
            struct rnnd_threadpool_task *t = p->head;
            p->head = t->next;
            if (p->head == NULL)
                p->tail = NULL;
            pthread_mutex_unlock(&p->mu);
            t->fn(t);
            pthread_mutex_lock(&p->mu);
        } else if (p->next < p->n) {
            int k = p->next++, n = p->n;
            rnnd_threadpool_fn fn = p->fn;
            void *fn_arg = p->arg;
            p->running++;
            pthread_mutex_unlock(&p->mu);
            fn(fn_arg, k, n);
            pthread_mutex_lock(&p->mu);
            if (--p->running == 0)
                pthread_cond_signal(&p->done);
        } else if (p->stop) {
            break;
        } else {
            pool_wait(p);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

struct rnnd_threadpool *rnnd_threadpool_init(int workers, const char *name) {
    if (workers < 0)
        workers = 0;
    struct rnnd_threadpool *p = calloc(1, sizeof(*p) + (size_t)workers * sizeof(pthread_t));
    if (p == NULL)
        return NULL;
    if (pthread_mutex_init(&p->mu, NULL) != 0)
        goto err_mutex;
    if (pthread_cond_init(&p->wake, NULL) != 0)
        goto err_wake;
    if (pthread_cond_init(&p->done, NULL) != 0)
        goto err_done;
    // Start the workers; if the system refuses some, run with those that started.
    for (int k = 0; k < workers; k++) {
        if (pthread_create(&p->threads[k], NULL, pool_worker, p) != 0)
            break;
        if (name)
            pthread_setname_np(p->threads[k], name);
        p->nworkers++;
    }
    return p;

err_done:
    pthread_cond_destroy(&p->wake);
err_wake:
    pthread_mutex_destroy(&p->mu);
err_mutex:
    free(p);
    return NULL;
}

void rnnd_threadpool_free(struct rnnd_threadpool *p) {
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    atomic_fetch_add_explicit(&p->seq, 1, memory_order_relaxed);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int k = 0; k < p->nworkers; k++)
        pthread_join(p->threads[k], NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int rnnd_threadpool_workers(const struct rnnd_threadpool *p) {
    return p ? p->nworkers : 0;
}

void rnnd_threadpool_spin(struct rnnd_threadpool *p, int spin_us) {
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->mu);
    p->spin_us = spin_us;
    pthread_mutex_unlock(&p->mu);
}

// Hands parts first .. n-1 of a run to the workers.
static void pool_start(struct rnnd_threadpool *p, int n, rnnd_threadpool_fn fn, void *arg,
                       int first) {
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    p->next = first;
    atomic_fetch_add_explicit(&p->seq, 1, memory_order_relaxed);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}

void rnnd_threadpool_start(struct rnnd_threadpool *p, int n, rnnd_threadpool_fn fn, void *arg) {
    pool_start(p, n < p->nworkers + 1 ? n : p->nworkers + 1, fn, arg, 0);
}

void rnnd_threadpool_join(struct rnnd_threadpool *p) {
    pthread_mutex_lock(&p->mu);
    // The parts no worker has taken yet, here; then the wait for those they did.
    while (p->next < p->n) {
        int k = p->next++, n = p->n;
        rnnd_threadpool_fn fn = p->fn;
        void *arg = p->arg;
        pthread_mutex_unlock(&p->mu);
        fn(arg, k, n);
        pthread_mutex_lock(&p->mu);
    }
    while (p->running > 0)
        pthread_cond_wait(&p->done, &p->mu);
    p->fn = NULL;
    p->arg = NULL;
    p->n = p->next = 0;
    pthread_mutex_unlock(&p->mu);
}

void rnnd_threadpool_run(struct rnnd_threadpool *p, int n, rnnd_threadpool_fn fn, void *arg) {
    if (n > rnnd_threadpool_workers(p) + 1)
        n = rnnd_threadpool_workers(p) + 1;
    if (n <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pool_start(p, n, fn, arg, 1);
    fn(arg, 0, n); // part 0 here
    rnnd_threadpool_join(p);
}

void rnnd_threadpool_post(struct rnnd_threadpool *p, struct rnnd_threadpool_task *first,
                          struct rnnd_threadpool_task *last) {
    last->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->tail)
        p->tail->next = first;
    else
        p->head = first;
    p->tail = last;
    atomic_fetch_add_explicit(&p->seq, 1, memory_order_relaxed);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}
