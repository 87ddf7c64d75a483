/*
 * envtable.c: a chained hash over a fixed array of entries (see envtable.h). Chains and the
 * use-order list link entries by index, so the whole table is three allocations.
 */
#include "envtable.h"

#include <stdlib.h>
#include <string.h>

#include "rnnd_kernels.h"

struct rnnd_envtable {
    int cap, count, H;
    struct rnnd_env *e; // (cap)
    int32_t *buckets;   // (mask + 1) chain heads, -1 when empty
    uint32_t mask;
    int32_t free_head; // free entries chained through next
    int32_t lru_head, lru_tail;
    float *outs; // (cap, H)
};

static uint32_t hash64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

struct rnnd_envtable *rnnd_envtable_init(int cap, int H) {
    if (cap < 1 || H < 1)
        return NULL;
    struct rnnd_envtable *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    uint32_t nb = 1;
    while (nb < (uint32_t)cap * 2u && nb < (1u << 30))
        nb <<= 1;
    t->cap = cap;
    t->H = H;
    t->mask = nb - 1;
    t->e = calloc((size_t)cap, sizeof(*t->e));
    t->buckets = malloc(nb * sizeof(int32_t));
    // calloc: pages stay untouched until an env uses its row.
    t->outs = calloc((size_t)cap * (size_t)H, sizeof(float));
    if (t->e == NULL || t->buckets == NULL || t->outs == NULL) {
        rnnd_envtable_free(t);
        return NULL;
    }
    memset(t->buckets, 0xff, nb * sizeof(int32_t));
    // Free list in index order, so slots are handed out lowest first.
    for (int i = 0; i < cap; i++) {
        t->e[i].slot = i;
        t->e[i].next = i + 1 < cap ? i + 1 : -1;
    }
    t->free_head = 0;
    t->lru_head = t->lru_tail = -1;
    return t;
}

void rnnd_envtable_free(struct rnnd_envtable *t) {
    if (t == NULL)
        return;
    free(t->e);
    free(t->buckets);
    free(t->outs);
    free(t);
}

struct rnnd_env *rnnd_envtable_find(const struct rnnd_envtable *t, uint64_t id) {
    for (int32_t i = t->buckets[hash64(id) & t->mask]; i >= 0; i = t->e[i].next)
        if (t->e[i].id == id)
            return &t->e[i];
    return NULL;
}

struct rnnd_env *rnnd_envtable_find_hint(const struct rnnd_envtable *t, uint64_t id, int32_t hint) {
    // Ids are unique among used entries (rnnd_envtable_add), so a used entry holding id is it.
    if (hint >= 0 && hint < t->cap && t->e[hint].used && t->e[hint].id == id)
        return &t->e[hint];
    return rnnd_envtable_find(t, id);
}

void rnnd_envtable_prefetch_hints(const struct rnnd_envtable *t, const uint64_t *ids,
                                  const int32_t *hints, int n) {
    for (int i = 0; i < n; i++) {
        if (hints[i] >= 0 && hints[i] < t->cap)
            __builtin_prefetch(&t->e[hints[i]]);
        else
            __builtin_prefetch(&t->buckets[hash64(ids[i]) & t->mask]);
    }
}

void rnnd_envtable_prefetch(const struct rnnd_envtable *t, const uint64_t *ids, int n) {
    for (int i = 0; i < n; i++)
        __builtin_prefetch(&t->buckets[hash64(ids[i]) & t->mask]);
    for (int i = 0; i < n; i++) {
        int32_t k = t->buckets[hash64(ids[i]) & t->mask];
        if (k >= 0)
            __builtin_prefetch(&t->e[k]);
    }
}

static void lru_unlink(struct rnnd_envtable *t, struct rnnd_env *e) {
    if (e->lru_prev >= 0)
        t->e[e->lru_prev].lru_next = e->lru_next;
    else
        t->lru_head = e->lru_next;
    if (e->lru_next >= 0)
        t->e[e->lru_next].lru_prev = e->lru_prev;
    else
        t->lru_tail = e->lru_prev;
    e->lru_prev = e->lru_next = -1;
}

static void lru_append(struct rnnd_envtable *t, struct rnnd_env *e) {
    e->lru_prev = t->lru_tail;
    e->lru_next = -1;
    if (t->lru_tail >= 0)
        t->e[t->lru_tail].lru_next = e->slot;
    else
        t->lru_head = e->slot;
    t->lru_tail = e->slot;
}

int rnnd_envtable_add(struct rnnd_envtable *t, uint64_t id, uint64_t now_ns,
                      struct rnnd_env **out) {
    if (t->free_head < 0)
        return RNND_EFULL;
    int32_t i = t->free_head;
    struct rnnd_env *e = &t->e[i];
    t->free_head = e->next;
    memset(e, 0, sizeof(*e));
    e->id = id;
    e->slot = i;
    e->used = true;
    e->last_used_ns = e->moved_ns = now_ns;
    uint32_t b = hash64(id) & t->mask;
    e->next = t->buckets[b];
    t->buckets[b] = i;
    lru_append(t, e);
    t->count++;
    *out = e;
    return 0;
}

void rnnd_envtable_touch(struct rnnd_envtable *t, struct rnnd_env *e, uint64_t now_ns) {
    e->last_used_ns = now_ns;
    // Moving e reads and writes both its neighbours, two cache misses in a big table (~45 us a
    // 4096-row batch on the H200 host, on the engine thread). Within RNND_ENV_TOUCH_SLACK_NS of
    // its last move it stays where it is: idle eviction, which walks from the oldest and stops
    // at the first entry not idle, then runs late by at most that much.
    if (now_ns >= e->moved_ns && now_ns - e->moved_ns < RNND_ENV_TOUCH_SLACK_NS)
        return;
    e->moved_ns = now_ns;
    if (t->lru_tail != e->slot) {
        lru_unlink(t, e);
        lru_append(t, e);
    }
}

void rnnd_envtable_remove(struct rnnd_envtable *t, struct rnnd_env *e) {
    uint32_t b = hash64(e->id) & t->mask;
    int32_t *link = &t->buckets[b];
    while (*link >= 0 && *link != e->slot)
        link = &t->e[*link].next;
    if (*link == e->slot)
        *link = e->next;
    lru_unlink(t, e);
    int32_t slot = e->slot;
    memset(e, 0, sizeof(*e));
    e->slot = slot;
    e->next = t->free_head;
    t->free_head = slot;
    t->count--;
}

struct rnnd_env *rnnd_envtable_oldest(const struct rnnd_envtable *t) {
    return t->lru_head >= 0 ? &t->e[t->lru_head] : NULL;
}

struct rnnd_env *rnnd_envtable_newer(const struct rnnd_envtable *t, const struct rnnd_env *e) {
    return e->lru_next >= 0 ? &t->e[e->lru_next] : NULL;
}

int rnnd_envtable_count(const struct rnnd_envtable *t) {
    return t->count;
}

int rnnd_envtable_capacity(const struct rnnd_envtable *t) {
    return t->cap;
}

float *rnnd_envtable_output(struct rnnd_envtable *t, const struct rnnd_env *e) {
    return t->outs + (size_t)e->slot * (size_t)t->H;
}
