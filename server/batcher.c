/*
 * batcher.c: the engine's inbox (see batcher.h).
 *
 * Two lists of Step items: `incoming`, filled by pushers under the lock, and `pending`, the
 * engine's own, to which incoming is spliced at each poll. Batch formation walks pending without
 * the lock, using a generation-stamped hash set of env ids ("taken": in the batch or held back
 * behind an item that is waiting). Only the row count and the lists' ends are shared.
 */
#include "batcher.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rnnd_kernels.h"

// An open-addressing set of uint64 keys; clearing bumps the generation instead of zeroing.
struct idset {
    uint64_t *keys;
    uint32_t *gen;
    uint32_t mask, cur;
};

static int idset_reserve(struct idset *s, size_t n) {
    size_t want = 16;
    while (want < 2 * n)
        want <<= 1;
    if (s->keys && (size_t)s->mask + 1 >= want)
        return 0;
    uint64_t *k = malloc(want * sizeof(*k));
    uint32_t *g = calloc(want, sizeof(*g));
    if (k == NULL || g == NULL) {
        free(k);
        free(g);
        return RNND_ENOMEM;
    }
    free(s->keys);
    free(s->gen);
    s->keys = k;
    s->gen = g;
    s->mask = (uint32_t)(want - 1);
    s->cur = 1;
    return 0;
}

static void idset_clear(struct idset *s) {
    if (++s->cur == 0) { // wrapped: really clear
        memset(s->gen, 0, ((size_t)s->mask + 1) * sizeof(*s->gen));
        s->cur = 1;
    }
}

static uint32_t idset_hash(uint64_t x) {
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ull;
    x ^= x >> 27;
    x *= 0x81dadef4bc2dd44dull;
    x ^= x >> 33;
    return (uint32_t)x;
}

// False when key was in the set already. The caller keeps the set at most half full
// (idset_reserve).
static bool idset_add(struct idset *s, uint64_t key) {
    for (uint32_t i = idset_hash(key) & s->mask;; i = (i + 1) & s->mask) {
        if (s->gen[i] != s->cur) {
            s->gen[i] = s->cur;
            s->keys[i] = key;
            return true;
        }
        if (s->keys[i] == key)
            return false;
    }
}

static void idset_free(struct idset *s) {
    free(s->keys);
    free(s->gen);
}

// Sources (connections, streams) with the time each last sent a step. Open addressing; stale
// entries are dropped by rebuilding the table when it fills up.
struct srcmap {
    uint64_t *keys;
    uint64_t *seen; // 0: empty slot
    uint32_t mask;
    int used;
};

static int srcmap_rebuild(struct srcmap *m, size_t cap, uint64_t now_ns, uint64_t window_ns) {
    uint64_t *k = calloc(cap, sizeof(*k)), *s = calloc(cap, sizeof(*s));
    if (k == NULL || s == NULL) {
        free(k);
        free(s);
        return RNND_ENOMEM;
    }
    struct srcmap n = {k, s, (uint32_t)(cap - 1), 0};
    for (size_t i = 0; m->keys && i <= m->mask; i++) {
        if (m->seen[i] == 0 || m->seen[i] + window_ns < now_ns)
            continue;
        for (uint32_t j = idset_hash(m->keys[i]) & n.mask;; j = (j + 1) & n.mask) {
            if (n.seen[j] == 0) {
                n.keys[j] = m->keys[i];
                n.seen[j] = m->seen[i];
                n.used++;
                break;
            }
        }
    }
    free(m->keys);
    free(m->seen);
    *m = n;
    return 0;
}

static void srcmap_touch(struct srcmap *m, uint64_t key, uint64_t now_ns, uint64_t window_ns) {
    if (now_ns == 0)
        now_ns = 1; // 0 marks an empty slot
    if (m->keys == NULL || (size_t)(m->used + 1) * 2 > (size_t)m->mask + 1) {
        // Full: drop stale sources, and grow if the live ones still fill half.
        size_t cap = m->keys ? (size_t)m->mask + 1 : 64;
        int live = 0;
        for (size_t i = 0; m->keys && i <= m->mask; i++)
            live += m->seen[i] && m->seen[i] + window_ns >= now_ns;
        while ((size_t)(live + 1) * 4 > cap)
            cap *= 2;
        if (srcmap_rebuild(m, cap, now_ns, window_ns) != 0)
            return; // no memory: the source is just not tracked
    }
    for (uint32_t j = idset_hash(key) & m->mask;; j = (j + 1) & m->mask) {
        if (m->seen[j] == 0) {
            m->keys[j] = key;
            m->seen[j] = now_ns;
            m->used++;
            return;
        }
        if (m->keys[j] == key) {
            if (now_ns > m->seen[j])
                m->seen[j] = now_ns;
            return;
        }
    }
}

// Sources seen within the window.
static int srcmap_active(const struct srcmap *m, uint64_t now_ns, uint64_t window_ns) {
    int n = 0;
    for (size_t i = 0; m->keys && i <= m->mask; i++)
        n += m->seen[i] && m->seen[i] + window_ns >= now_ns;
    return n;
}

struct list {
    struct rnnd_batch_item *head, *tail;
};

static void list_append(struct list *l, struct rnnd_batch_item *it) {
    it->next = NULL;
    if (l->tail)
        l->tail->next = it;
    else
        l->head = it;
    l->tail = it;
}

static void list_splice(struct list *dst, struct list *src) {
    if (src->head == NULL)
        return;
    if (dst->tail)
        dst->tail->next = src->head;
    else
        dst->head = src->head;
    dst->tail = src->tail;
    src->head = src->tail = NULL;
}

struct rnnd_batcher {
    struct rnnd_batcher_config cfg;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    // Shared, under lock:
    struct list incoming, controls;
    int rows; // Step rows in incoming + pending
    bool closed;
    bool waiting;            // the engine sleeps on cond
    _Atomic unsigned pushes; // bumped by every push: what a spinning engine watches
    bool wake;               // rnnd_batcher_wake was called: the next sleep returns at once
    // Engine thread only:
    struct list pending;
    int pending_rows;
    bool held_back;       // items stayed in pending after the last batch: flush at once
    struct idset taken;   // env ids in the forming batch or held back
    struct idset present; // sources with an item pending
    struct srcmap active; // source -> when it last sent a step
    uint64_t window_ns;   // a source that sent within this window counts as active
};

struct rnnd_batcher *rnnd_batcher_init(const struct rnnd_batcher_config *cfg) {
    if (cfg->max_batch < 1 || cfg->max_queue_rows < 1)
        return NULL;
    struct rnnd_batcher *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return NULL;
    b->cfg = *cfg;
    rnnd_batcher_set_delay(b, cfg->max_delay_ns);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&b->lock, NULL);
    if (idset_reserve(&b->taken, (size_t)cfg->max_batch) != 0 ||
        idset_reserve(&b->present, 64) != 0) {
        rnnd_batcher_free(b);
        return NULL;
    }
    return b;
}

void rnnd_batcher_set_delay(struct rnnd_batcher *b, uint64_t max_delay_ns) {
    b->cfg.max_delay_ns = max_delay_ns;
    // Active means "sent within 20 max-delays" (1 ms to 1 s): long enough to span the round
    // trips of actors stepping back to back, short enough that a client that left stops
    // holding batches back soon.
    b->window_ns = 20 * max_delay_ns;
    if (b->window_ns < 1000000ull)
        b->window_ns = 1000000ull;
    if (b->window_ns > 1000000000ull)
        b->window_ns = 1000000000ull;
}

void rnnd_batcher_free(struct rnnd_batcher *b) {
    if (b == NULL)
        return;
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->cond);
    idset_free(&b->taken);
    idset_free(&b->present);
    free(b->active.keys);
    free(b->active.seen);
    free(b);
}

static int batcher_push(struct rnnd_batcher *b, struct rnnd_batch_item *item, uint64_t now_ns,
                        bool wake) {
    if (item->B < 1 || item->B > b->cfg.max_batch)
        return RNND_EINVAL;
    item->enqueued_ns = now_ns;
    pthread_mutex_lock(&b->lock);
    int rc = 0;
    if (b->closed) {
        rc = RNND_EUNAVAIL;
    } else if (b->rows > b->cfg.max_queue_rows - item->B) {
        rc = RNND_EFULL;
    } else {
        list_append(&b->incoming, item);
        b->rows += item->B;
        atomic_fetch_add_explicit(&b->pushes, 1, memory_order_release);
        if (wake && b->waiting)
            pthread_cond_signal(&b->cond);
    }
    pthread_mutex_unlock(&b->lock);
    return rc;
}

int rnnd_batcher_push(struct rnnd_batcher *b, struct rnnd_batch_item *item, uint64_t now_ns) {
    return batcher_push(b, item, now_ns, true);
}

int rnnd_batcher_push_quiet(struct rnnd_batcher *b, struct rnnd_batch_item *item, uint64_t now_ns) {
    return batcher_push(b, item, now_ns, false);
}

void rnnd_batcher_wake(struct rnnd_batcher *b) {
    pthread_mutex_lock(&b->lock);
    b->wake = true;
    atomic_fetch_add_explicit(&b->pushes, 1, memory_order_release);
    if (b->waiting)
        pthread_cond_signal(&b->cond);
    pthread_mutex_unlock(&b->lock);
}

void rnnd_batcher_push_control(struct rnnd_batcher *b, struct rnnd_batch_item *item) {
    item->B = 0;
    pthread_mutex_lock(&b->lock);
    list_append(&b->controls, item);
    atomic_fetch_add_explicit(&b->pushes, 1, memory_order_release);
    if (b->waiting)
        pthread_cond_signal(&b->cond);
    pthread_mutex_unlock(&b->lock);
}

void rnnd_batcher_close(struct rnnd_batcher *b) {
    pthread_mutex_lock(&b->lock);
    b->closed = true;
    if (b->waiting)
        pthread_cond_signal(&b->cond);
    pthread_mutex_unlock(&b->lock);
}

int rnnd_batcher_rows(struct rnnd_batcher *b) {
    pthread_mutex_lock(&b->lock);
    int rows = b->rows;
    pthread_mutex_unlock(&b->lock);
    return rows;
}

bool rnnd_batcher_empty(struct rnnd_batcher *b) {
    pthread_mutex_lock(&b->lock);
    bool empty = b->rows == 0 && b->controls.head == NULL;
    pthread_mutex_unlock(&b->lock);
    return empty;
}

bool rnnd_batcher_controls(struct rnnd_batcher *b) {
    pthread_mutex_lock(&b->lock);
    bool any = b->controls.head != NULL;
    pthread_mutex_unlock(&b->lock);
    return any;
}

// True when every active source (one that sent a step within the window) has a step pending:
// nobody a batch could wait for is on the way, so waiting longer only adds latency. For one
// actor that is at once; for many synchronous actors it is when the last of them is back.
static bool sources_all_waiting(struct rnnd_batcher *b, uint64_t now_ns) {
    int active = srcmap_active(&b->active, now_ns, b->window_ns);
    int n = 0;
    for (struct rnnd_batch_item *it = b->pending.head; it; it = it->next)
        n++;
    if (idset_reserve(&b->present, (size_t)n) != 0)
        return true;
    idset_clear(&b->present);
    int distinct = 0;
    for (struct rnnd_batch_item *it = b->pending.head; it; it = it->next) {
        distinct += idset_add(&b->present, it->source);
    }
    return distinct >= active;
}

// Takes the item's envs (one pass: a 4096-row batch spent ~45 ns a row on admission at
// 32 streams x 1024 envs on an H200 host). True when one of them was taken already: the item
// waits for a later batch, and holds back later items of its envs.
static bool item_take_envs(struct rnnd_batcher *b, const struct rnnd_batch_item *it) {
    bool clash = false;
    for (int i = 0; i < it->B; i++)
        clash |= !idset_add(&b->taken, it->env_ids[i]);
    return clash;
}

// Forms one batch from pending into out (see batcher.h for the rules).
static void batch_form(struct rnnd_batcher *b, rnnd_batch_admit_fn admit, void *ctx,
                       struct rnnd_batch *out) {
    if (idset_reserve(&b->taken, (size_t)b->pending_rows) != 0) {
        // Out of memory for the set: fall back to one item per batch, which needs no set.
        struct rnnd_batch_item *it = b->pending.head;
        b->pending.head = it->next;
        if (b->pending.head == NULL)
            b->pending.tail = NULL;
        b->pending_rows -= it->B;
        it->next = NULL;
        enum rnnd_batch_admit a = admit(ctx, it);
        if (a == RNND_BATCH_ADMIT) {
            out->items = it;
            out->rows = it->B;
        } else if (a == RNND_BATCH_HOLD) {
            it->next = b->pending.head;
            b->pending.head = it;
            if (b->pending.tail == NULL)
                b->pending.tail = it;
            b->pending_rows += it->B;
        } else {
            out->rejected = it;
        }
        return;
    }
    idset_clear(&b->taken);
    struct list keep = {0}, items = {0}, rejected = {0};
    struct rnnd_batch_item *it = b->pending.head, *next;
    bool full = false;
    for (; it; it = next) {
        next = it->next;
        if (full || item_take_envs(b, it)) {
            list_append(&keep, it);
            continue;
        }
        if (out->rows + it->B > b->cfg.max_batch) {
            full = true; // items stay in arrival order: nothing overtakes this one
            list_append(&keep, it);
            continue;
        }
        b->pending_rows -= it->B;
        enum rnnd_batch_admit a = admit(ctx, it);
        if (a == RNND_BATCH_ADMIT) {
            list_append(&items, it);
            out->rows += it->B;
        } else if (a == RNND_BATCH_HOLD) {
            // Keeps its place, and its envs: nothing behind it may step them meanwhile.
            b->pending_rows += it->B;
            list_append(&keep, it);
        } else {
            // Refused: it holds nobody back, so the set is made again without its envs (rare).
            list_append(&rejected, it);
            idset_clear(&b->taken);
            for (struct rnnd_batch_item *x = items.head; x; x = x->next)
                item_take_envs(b, x);
            for (struct rnnd_batch_item *x = keep.head; x; x = x->next)
                item_take_envs(b, x);
        }
    }
    b->pending = keep;
    b->held_back = keep.head != NULL;
    out->items = items.head;
    out->rejected = rejected.head;
}

static bool batcher_poll(struct rnnd_batcher *b, uint64_t now_ns, rnnd_batch_admit_fn admit,
                         void *ctx, struct rnnd_batch *out, uint64_t *wait_ns, bool controls) {
    memset(out, 0, sizeof(*out));
    *wait_ns = UINT64_MAX;
    pthread_mutex_lock(&b->lock);
    struct rnnd_batch_item *fresh = b->incoming.head;
    for (struct rnnd_batch_item *it = fresh; it; it = it->next)
        b->pending_rows += it->B;
    list_splice(&b->pending, &b->incoming);
    if (controls) {
        out->controls = b->controls.head;
        b->controls.head = b->controls.tail = NULL;
    }
    bool closed = b->closed;
    pthread_mutex_unlock(&b->lock);
    for (struct rnnd_batch_item *it = fresh; it; it = it->next)
        srcmap_touch(&b->active, it->source, it->enqueued_ns, b->window_ns);

    // The controls run before anything is admitted (batcher.h); the caller polls again after.
    if (b->pending.head && out->controls == NULL) {
        uint64_t due = b->pending.head->enqueued_ns + b->cfg.max_delay_ns;
        bool ready = closed || b->held_back || b->pending_rows >= b->cfg.max_batch ||
                     now_ns >= due || sources_all_waiting(b, now_ns);
        if (ready) {
            int before = b->pending_rows;
            batch_form(b, admit, ctx, out);
            pthread_mutex_lock(&b->lock);
            b->rows -= before - b->pending_rows;
            pthread_mutex_unlock(&b->lock);
        } else {
            *wait_ns = due - now_ns;
        }
    }
    return out->controls || out->items || out->rejected;
}

bool rnnd_batcher_poll(struct rnnd_batcher *b, uint64_t now_ns, rnnd_batch_admit_fn admit,
                       void *ctx, struct rnnd_batch *out, uint64_t *wait_ns) {
    return batcher_poll(b, now_ns, admit, ctx, out, wait_ns, true);
}

bool rnnd_batcher_poll_steps(struct rnnd_batcher *b, uint64_t now_ns, rnnd_batch_admit_fn admit,
                             void *ctx, struct rnnd_batch *out, uint64_t *wait_ns) {
    return batcher_poll(b, now_ns, admit, ctx, out, wait_ns, false);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void rnnd_batcher_sleep(struct rnnd_batcher *b, uint64_t wait_ns, bool spin) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    if (wait_ns == 0)
        return;
    uint64_t until = wait_ns == UINT64_MAX ? UINT64_MAX : now + wait_ns;
    if (spin && b->cfg.spin_ns > 0) {
        // Right after work, poll a little before sleeping: an actor stepping back to back
        // sends its next step about one round trip later, and catching it here saves the
        // sleep and wake-up (tens of microseconds on a busy or virtual machine).
        unsigned seen = atomic_load_explicit(&b->pushes, memory_order_acquire);
        uint64_t end = now + b->cfg.spin_ns;
        if (end > until)
            end = until;
        for (int i = 0;; i++) {
            if (atomic_load_explicit(&b->pushes, memory_order_acquire) != seen)
                return;
            if ((i & 63) == 0) {
                clock_gettime(CLOCK_MONOTONIC, &ts);
                if ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec >= end)
                    break;
            }
            cpu_relax();
        }
    }
    pthread_mutex_lock(&b->lock);
    // Sleep only if nothing arrived since the caller's poll; pushes signal while we wait.
    if (b->incoming.head == NULL && b->controls.head == NULL && !b->wake &&
        !(b->closed && b->pending.head)) {
        b->waiting = true;
        if (until == UINT64_MAX) {
            pthread_cond_wait(&b->cond, &b->lock);
        } else {
            struct timespec dl = {(time_t)(until / 1000000000ull), (long)(until % 1000000000ull)};
            pthread_cond_timedwait(&b->cond, &b->lock, &dl);
        }
        b->waiting = false;
    }
    b->wake = false;
    pthread_mutex_unlock(&b->lock);
}

bool rnnd_batcher_wait(struct rnnd_batcher *b, rnnd_batch_admit_fn admit, void *ctx,
                       struct rnnd_batch *out, uint64_t timeout_ns) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t start = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    uint64_t limit = timeout_ns == UINT64_MAX ? UINT64_MAX : start + timeout_ns;
    bool spun = false;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        uint64_t wait;
        if (rnnd_batcher_poll(b, now, admit, ctx, out, &wait))
            return true;
        if (now >= limit)
            return false;
        if (wait != UINT64_MAX && now + wait > limit)
            wait = limit - now;
        else if (wait == UINT64_MAX && limit != UINT64_MAX)
            wait = limit - now;
        rnnd_batcher_sleep(b, wait, !spun);
        spun = true;
    }
}
