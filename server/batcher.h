/*
 * batcher.h: the engine's inbox, with dynamic batching of Step rows (docs/architecture.md).
 *
 * Any thread pushes items; the engine thread polls (or waits) and gets back the control jobs
 * (Forward, SetWeights, ...: never batched, run first) and, when one is due, a batch of Step
 * items. A batch is due when it would reach --max-batch rows, when its oldest item has waited
 * --max-delay-us, or when every active source (a connection or stream that sent a step within
 * the last 20 max-delays) has an item waiting: then nobody the batch could wait for is still on
 * the way, which keeps a lone actor's latency at the transport floor while many synchronous
 * actors still fill one batch per round.
 *
 * A batch never holds two items that share an env id: the later one waits for a later batch,
 * and so does every item after it that shares an env with it, so each env's steps run in
 * arrival order. Items are taken whole and in arrival order; each one is offered to an admit
 * callback that may reject it (its rows then leave the queue without running) or hold it (it stays queued in its place, its envs blocked, and
 * is offered again at the next batch: a part of a Step over several devices that waits for the
 * other parts, or a Step of an env whose previous step still runs, engine.h).
 *
 * A poll that hands out control jobs forms no batch: the engine runs them first, and the next
 * poll admits Step items against the state they left (an EndEpisodes never runs between the
 * admission of a step of its env and the step).
 *
 * "Engine thread" below means whoever acts as the engine: the engine serialises that role.
 *
 * The queue is bounded in rows (--max-queue-rows): a push over the bound fails at once with
 * RNND_EFULL, which the server answers as RESOURCE_EXHAUSTED.
 */
#ifndef RNND_BATCHER_H
#define RNND_BATCHER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct rnnd_batch_item {
    struct rnnd_batch_item *next; // owned by the batcher while queued
    int B;                        // rows; 0 for control jobs
    const uint64_t *env_ids;      // (B), borrowed until the item leaves the batcher
    uint64_t source;              // who sent it (a connection or stream), for the early flush
    uint64_t enqueued_ns;         // set by push
};

struct rnnd_batcher_config {
    int max_batch; // rows
    uint64_t max_delay_ns;
    int max_queue_rows; // bound on rows waiting
    uint64_t spin_ns;   // rnnd_batcher_wait polls this long before sleeping (0: never)
};

enum rnnd_batch_admit { RNND_BATCH_ADMIT, RNND_BATCH_REJECT, RNND_BATCH_HOLD };

// Called on the engine thread for each item about to join a batch, in arrival order. It may
// change engine state for an item it admits (e.g. give new envs their slots); an item it
// rejects must leave everything as it was; an item it holds is offered again later (and is
// not in the batch meanwhile).
typedef enum rnnd_batch_admit (*rnnd_batch_admit_fn)(void *ctx, struct rnnd_batch_item *item);

// What a poll hands to the engine. Lists are linked through next, in arrival order.
struct rnnd_batch {
    struct rnnd_batch_item *controls; // control jobs
    struct rnnd_batch_item *items;    // the Step batch (admitted)
    int rows;                         // rows in items
    struct rnnd_batch_item *rejected; // items the admit callback rejected
};

struct rnnd_batcher;

// A new batcher, or NULL when out of memory (or cfg is invalid). Free with rnnd_batcher_free.
struct rnnd_batcher *rnnd_batcher_init(const struct rnnd_batcher_config *cfg);
// Sets --max-delay-us (and the active-source window that follows from it), before the first
// push: for an engine that knows its delay only once its backend is open.
void rnnd_batcher_set_delay(struct rnnd_batcher *b, uint64_t max_delay_ns);
// Frees the batcher; items still queued are not touched (take them first with close + poll).
void rnnd_batcher_free(struct rnnd_batcher *b);

// Queues a Step item (any thread). 0; RNND_EINVAL when B is outside 1..max_batch; RNND_EFULL
// when the rows would exceed the queue bound; RNND_EUNAVAIL once closed. On failure the caller
// keeps the item.
int rnnd_batcher_push(struct rnnd_batcher *b, struct rnnd_batch_item *item, uint64_t now_ns);
// rnnd_batcher_push without waking a sleeping engine: for a pusher that will run the batch
// itself (or call rnnd_batcher_wake).
int rnnd_batcher_push_quiet(struct rnnd_batcher *b, struct rnnd_batch_item *item, uint64_t now_ns);
// Wakes the engine (or makes its next sleep or spin return at once). Any thread.
void rnnd_batcher_wake(struct rnnd_batcher *b);
// Queues a control job (any thread); always accepted, even when closed.
void rnnd_batcher_push_control(struct rnnd_batcher *b, struct rnnd_batch_item *item);
// Refuses further Step items; queued ones are still handed out, without waiting for more.
void rnnd_batcher_close(struct rnnd_batcher *b);

// Engine thread, non-blocking: fills *out (zeroed first) with the control jobs queued or, when
// there are none and a batch is due at now_ns, a batch. Returns true when *out holds anything.
// When no batch is due, *wait_ns says how long until one may be (UINT64_MAX: not before the next
// push or wake).
bool rnnd_batcher_poll(struct rnnd_batcher *b, uint64_t now_ns, rnnd_batch_admit_fn admit,
                       void *ctx, struct rnnd_batch *out, uint64_t *wait_ns);
// Like rnnd_batcher_poll, but leaves control jobs queued (for a thread that runs Step batches
// only).
bool rnnd_batcher_poll_steps(struct rnnd_batcher *b, uint64_t now_ns, rnnd_batch_admit_fn admit,
                             void *ctx, struct rnnd_batch *out, uint64_t *wait_ns);
// Engine thread: sleeps up to wait_ns (UINT64_MAX: until woken) unless something arrived since
// the last poll; with spin, first polls for a push for up to the configured spin time.
void rnnd_batcher_sleep(struct rnnd_batcher *b, uint64_t wait_ns, bool spin);
// Engine thread: polls and sleeps until poll has something, or until timeout_ns passed (then
// returns false with *out empty). timeout_ns UINT64_MAX waits without limit.
bool rnnd_batcher_wait(struct rnnd_batcher *b, rnnd_batch_admit_fn admit, void *ctx,
                       struct rnnd_batch *out, uint64_t timeout_ns);

// Step rows queued (incoming and held back), for metrics.
int rnnd_batcher_rows(struct rnnd_batcher *b);
// True when nothing at all is queued.
bool rnnd_batcher_empty(struct rnnd_batcher *b);
// True when a control item is queued.
bool rnnd_batcher_controls(struct rnnd_batcher *b);

#endif // RNND_BATCHER_H
