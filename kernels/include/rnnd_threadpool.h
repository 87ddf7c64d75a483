/*
 * rnnd_threadpool.h: the pool of worker threads that every part of rnnd runs its helper threads
 * on: the CPU backend (the phases of an op, kernels/cpu) and the engine (a Step batch's per-row
 * copies, and sending its replies; server/engine_step.c).
 *
 * Two ways to hand it work:
 *   rnnd_threadpool_run   splits one task into n parts and returns when every part has: the
 *                         calling thread runs part 0, then any part no worker has taken yet, so
 *                         a run never waits for a worker that is slow to wake (only for parts
 *                         already started). Parts must not wait for one another.
 *   rnnd_threadpool_start and rnnd_threadpool_join: the same run in two halves, so that the
 *                         calling thread does other work while the workers take the parts.
 *   rnnd_threadpool_post  queues tasks that the workers run, each once, and returns at once.
 * The workers sleep on a condition variable between tasks, so an idle pool costs nothing. One
 * thread at a time runs on a pool (from rnnd_threadpool_run, or a start to its join);
 * rnnd_threadpool_post, any thread.
 */
#ifndef RNND_THREADPOOL_H
#define RNND_THREADPOOL_H

struct rnnd_threadpool;

// Part k of n of a task: fn(arg, k, n) is called once for each k = 0 .. n-1, concurrently.
typedef void (*rnnd_threadpool_fn)(void *arg, int k, int n);

// A task for rnnd_threadpool_post, embedded in whatever it works on (the caller owns its memory).
struct rnnd_threadpool_task {
    void (*fn)(struct rnnd_threadpool_task *t); // called once, on a worker
    struct rnnd_threadpool_task *next;          // the pool's while queued
};

// A new pool that starts `workers` threads, or as many as the system lets it (0: a pool whose
// runs are the caller's alone), named `name` (at most 15 bytes; what top -H and gdb show; NULL:
// the process's name). Free with rnnd_threadpool_free. NULL when out of memory.
struct rnnd_threadpool *rnnd_threadpool_init(int workers, const char *name);
// Ends the workers once every posted task has run, and frees the pool. NULL does nothing.
void rnnd_threadpool_free(struct rnnd_threadpool *p);
// The worker threads that started (0 for NULL).
int rnnd_threadpool_workers(const struct rnnd_threadpool *p);
// After its last piece of work a worker watches for the next one for spin_us microseconds before
// it sleeps (0, the default: it sleeps at once). Call before handing the pool any work.
void rnnd_threadpool_spin(struct rnnd_threadpool *p, int spin_us);
// Runs fn(arg, k, m) for k = 0 .. m-1, m = min(n, workers + 1), on the calling thread and the
// workers, and returns when all have returned: consecutive runs are ordered phases. m <= 1 (and
// a NULL pool) is fn(arg, 0, 1) on the caller.
void rnnd_threadpool_run(struct rnnd_threadpool *p, int n, rnnd_threadpool_fn fn, void *arg);
// Hands fn(arg, k, m) for k = 0 .. m-1, m = min(n, workers + 1), to the workers and returns at
// once; rnnd_threadpool_join ends the run. The pool must have workers and n >= 2.
void rnnd_threadpool_start(struct rnnd_threadpool *p, int n, rnnd_threadpool_fn fn, void *arg);
// Runs the started run's parts that no worker has taken yet on the calling thread and returns
// when every part has returned.
void rnnd_threadpool_join(struct rnnd_threadpool *p);
// Queues the tasks first .. last (linked through next; last->next is set to NULL) after those
// already queued; each runs once on whichever worker takes it. The pool must have workers.
void rnnd_threadpool_post(struct rnnd_threadpool *p, struct rnnd_threadpool_task *first,
                          struct rnnd_threadpool_task *last);

#endif // RNND_THREADPOOL_H
