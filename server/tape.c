/*
 * tape.c: the tape store (see tape.h). Tapes sit in a list in creation order, which is also
 * expiry order (one ttl for all), so expiry pops from the front. Lookups walk the list: the
 * budget keeps it short.
 */
#include "tape.h"

#include <stdbool.h>
#include <stdlib.h>

#include "rnnd_kernels.h"

struct tape_entry {
    uint64_t id;
    uint64_t created_ns;
    size_t bytes;
    void *tape;
    struct tape_entry *prev, *next;
};

struct rnnd_tapes {
    size_t budget, bytes;
    uint64_t ttl_ns;
    uint64_t next_id;
    int count;
    rnnd_tape_release_cb release;
    void *ctx;
    struct tape_entry *head, *tail; // oldest first
};

struct rnnd_tapes *rnnd_tapes_init(size_t budget, uint64_t ttl_ns, rnnd_tape_release_cb release,
                                   void *ctx) {
    struct rnnd_tapes *ts = calloc(1, sizeof(*ts));
    if (ts == NULL)
        return NULL;
    ts->budget = budget;
    ts->ttl_ns = ttl_ns;
    ts->next_id = 1;
    ts->release = release;
    ts->ctx = ctx;
    return ts;
}

static void entry_drop(struct rnnd_tapes *ts, struct tape_entry *e) {
    if (e->prev)
        e->prev->next = e->next;
    else
        ts->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        ts->tail = e->prev;
    ts->bytes -= e->bytes;
    ts->count--;
    if (ts->release)
        ts->release(ts->ctx, e->tape);
    free(e);
}

void rnnd_tapes_free(struct rnnd_tapes *ts) {
    if (ts == NULL)
        return;
    while (ts->head)
        entry_drop(ts, ts->head);
    free(ts);
}

static bool expired(const struct rnnd_tapes *ts, const struct tape_entry *e, uint64_t now_ns) {
    return now_ns >= e->created_ns + ts->ttl_ns;
}

int rnnd_tapes_expire(struct rnnd_tapes *ts, uint64_t now_ns) {
    int n = 0;
    while (ts->head && expired(ts, ts->head, now_ns)) {
        entry_drop(ts, ts->head);
        n++;
    }
    return n;
}

int rnnd_tapes_fits(struct rnnd_tapes *ts, size_t bytes, uint64_t now_ns) {
    rnnd_tapes_expire(ts, now_ns);
    return bytes <= ts->budget && ts->bytes <= ts->budget - bytes ? 0 : RNND_EFULL;
}

static struct tape_entry *entry_find(const struct rnnd_tapes *ts, uint64_t id);

static int add(struct rnnd_tapes *ts, void *tape, size_t bytes, uint64_t now_ns, uint64_t id) {
    if (rnnd_tapes_fits(ts, bytes, now_ns) != 0)
        return RNND_EFULL;
    struct tape_entry *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return RNND_ENOMEM;
    e->id = id;
    e->created_ns = now_ns;
    e->bytes = bytes;
    e->tape = tape;
    e->prev = ts->tail;
    if (ts->tail)
        ts->tail->next = e;
    else
        ts->head = e;
    ts->tail = e;
    ts->bytes += bytes;
    ts->count++;
    return 0;
}

int rnnd_tapes_add(struct rnnd_tapes *ts, void *tape, size_t bytes, uint64_t now_ns, uint64_t *id) {
    int rc = add(ts, tape, bytes, now_ns, ts->next_id);
    if (rc == 0)
        *id = ts->next_id++;
    return rc;
}

int rnnd_tapes_add_as(struct rnnd_tapes *ts, void *tape, size_t bytes, uint64_t now_ns,
                      uint64_t id) {
    if (id == 0 || entry_find(ts, id))
        return RNND_EINVAL;
    return add(ts, tape, bytes, now_ns, id);
}

static struct tape_entry *entry_find(const struct rnnd_tapes *ts, uint64_t id) {
    // Newest first: Backward usually follows its Forward closely.
    for (struct tape_entry *e = ts->tail; e; e = e->prev)
        if (e->id == id)
            return e;
    return NULL;
}

int rnnd_tapes_get(struct rnnd_tapes *ts, uint64_t id, uint64_t now_ns, void **tape) {
    rnnd_tapes_expire(ts, now_ns);
    struct tape_entry *e = id ? entry_find(ts, id) : NULL;
    if (e == NULL)
        return RNND_ENOTFOUND;
    *tape = e->tape;
    return 0;
}

int rnnd_tapes_remove(struct rnnd_tapes *ts, uint64_t id) {
    struct tape_entry *e = entry_find(ts, id);
    if (e == NULL)
        return RNND_ENOTFOUND;
    entry_drop(ts, e);
    return 0;
}

int rnnd_tapes_count(const struct rnnd_tapes *ts) {
    return ts->count;
}

size_t rnnd_tapes_bytes(const struct rnnd_tapes *ts) {
    return ts->bytes;
}

size_t rnnd_tapes_budget(const struct rnnd_tapes *ts) {
    return ts->budget;
}
