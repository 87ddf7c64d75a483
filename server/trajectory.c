/*
 * trajectory.c: the ring of recorded steps (see trajectory.h). One allocation holds every column
 * for `alloc` steps; physical row of logical step i (0 = oldest) is (head + i) % alloc.
 */
#include "trajectory.h"

#include <stdlib.h>
#include <string.h>

#include "rnnd_kernels.h"

#define TRAJ_FIRST_ALLOC 16

struct rnnd_traj {
    int alloc; // rows allocated (<= cap)
    int head;  // physical row of the oldest step
    int count;
    float *obs;        // (alloc, I)
    float *extras;     // (alloc, E)
    float *h;          // (alloc, L, H)
    float *c;          // (alloc, L, H) LSTM
    uint8_t *is_init;  // (alloc)
    uint64_t *version; // (alloc)
    void *block;
};

static size_t row_bytes(const struct rnnd_traj_dims *d) {
    size_t lh = (size_t)d->L * (size_t)d->H;
    return sizeof(float) * ((size_t)d->I + (size_t)d->E + lh * (d->lstm ? 2 : 1)) +
           sizeof(uint64_t) + 1;
}

// Lays out columns for n rows in a fresh block: 8-byte columns first for alignment.
static int traj_alloc(struct rnnd_traj *tr, const struct rnnd_traj_dims *d, int n) {
    size_t lh = (size_t)d->L * (size_t)d->H;
    char *p = malloc(row_bytes(d) * (size_t)n);
    if (p == NULL)
        return RNND_ENOMEM;
    tr->block = p;
    tr->version = (uint64_t *)p;
    p += sizeof(uint64_t) * (size_t)n;
    tr->obs = (float *)p;
    p += sizeof(float) * (size_t)d->I * (size_t)n;
    tr->extras = (float *)p;
    p += sizeof(float) * (size_t)d->E * (size_t)n;
    tr->h = (float *)p;
    p += sizeof(float) * lh * (size_t)n;
    tr->c = d->lstm ? (float *)p : NULL;
    p += d->lstm ? sizeof(float) * lh * (size_t)n : 0;
    tr->is_init = (uint8_t *)p;
    tr->alloc = n;
    return 0;
}

struct rnnd_traj *rnnd_traj_init(const struct rnnd_traj_dims *d) {
    if (d->cap < 1)
        return NULL;
    struct rnnd_traj *tr = calloc(1, sizeof(*tr));
    if (tr == NULL)
        return NULL;
    if (traj_alloc(tr, d, d->cap < TRAJ_FIRST_ALLOC ? d->cap : TRAJ_FIRST_ALLOC) != 0) {
        free(tr);
        return NULL;
    }
    return tr;
}

void rnnd_traj_free(struct rnnd_traj *tr) {
    if (tr == NULL)
        return;
    free(tr->block);
    free(tr);
}

// Doubles the rows (up to cap). Only called while the ring has not wrapped (head == 0).
static int traj_grow(struct rnnd_traj *tr, const struct rnnd_traj_dims *d) {
    struct rnnd_traj old = *tr;
    int n = old.alloc * 2 < d->cap ? old.alloc * 2 : d->cap;
    if (traj_alloc(tr, d, n) != 0) {
        *tr = old;
        return RNND_ENOMEM;
    }
    size_t lh = (size_t)d->L * (size_t)d->H;
    size_t k = (size_t)old.count;
    memcpy(tr->version, old.version, k * sizeof(uint64_t));
    memcpy(tr->obs, old.obs, k * (size_t)d->I * sizeof(float));
    if (d->E)
        memcpy(tr->extras, old.extras, k * (size_t)d->E * sizeof(float));
    memcpy(tr->h, old.h, k * lh * sizeof(float));
    if (d->lstm)
        memcpy(tr->c, old.c, k * lh * sizeof(float));
    memcpy(tr->is_init, old.is_init, k);
    tr->head = 0;
    tr->count = old.count;
    free(old.block);
    return 0;
}

int rnnd_traj_push(struct rnnd_traj *tr, const struct rnnd_traj_dims *d, const float *obs,
                   bool is_init, const float *extras, const float *h_before, const float *c_before,
                   uint64_t version) {
    int row;
    if (tr->count == tr->alloc && tr->alloc < d->cap) {
        int rc = traj_grow(tr, d);
        if (rc != 0)
            return rc;
    }
    if (tr->count < tr->alloc) {
        row = (tr->head + tr->count) % tr->alloc;
        tr->count++;
    } else {
        row = tr->head;
        tr->head = (tr->head + 1) % tr->alloc;
    }
    size_t lh = (size_t)d->L * (size_t)d->H;
    tr->version[row] = version;
    memcpy(tr->obs + (size_t)row * (size_t)d->I, obs, (size_t)d->I * sizeof(float));
    if (d->E) {
        float *dst = tr->extras + (size_t)row * (size_t)d->E;
        if (extras)
            memcpy(dst, extras, (size_t)d->E * sizeof(float));
        else
            memset(dst, 0, (size_t)d->E * sizeof(float));
    }
    memcpy(tr->h + (size_t)row * lh, h_before, lh * sizeof(float));
    if (d->lstm)
        memcpy(tr->c + (size_t)row * lh, c_before, lh * sizeof(float));
    tr->is_init[row] = is_init ? 1 : 0;
    return 0;
}

int rnnd_traj_count(const struct rnnd_traj *tr) {
    return tr ? tr->count : 0;
}

int rnnd_traj_window(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d, int T, float *obs,
                     uint8_t *is_init, float *extras, int64_t *version, float *h0, float *c0) {
    if (tr == NULL || T < 1 || T > tr->count)
        return RNND_EINVAL;
    size_t lh = (size_t)d->L * (size_t)d->H;
    int first = tr->count - T;
    for (int t = 0; t < T; t++) {
        int row = (tr->head + first + t) % tr->alloc;
        if (obs)
            memcpy(obs + (size_t)t * (size_t)d->I, tr->obs + (size_t)row * (size_t)d->I,
                   (size_t)d->I * sizeof(float));
        if (is_init)
            is_init[t] = tr->is_init[row];
        if (extras && d->E)
            memcpy(extras + (size_t)t * (size_t)d->E, tr->extras + (size_t)row * (size_t)d->E,
                   (size_t)d->E * sizeof(float));
        if (version)
            version[t] = (int64_t)tr->version[row];
        if (t == 0) {
            if (h0)
                memcpy(h0, tr->h + (size_t)row * lh, lh * sizeof(float));
            if (c0 && d->lstm)
                memcpy(c0, tr->c + (size_t)row * lh, lh * sizeof(float));
        }
    }
    return 0;
}

void rnnd_traj_export(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d, float *obs,
                      uint8_t *is_init, float *extras, uint64_t *version, float *h, float *c) {
    size_t I = (size_t)d->I, E = (size_t)d->E, lh = (size_t)d->L * (size_t)d->H;
    for (int t = 0; tr && t < tr->count; t++) {
        size_t row = (size_t)((tr->head + t) % tr->alloc), k = (size_t)t;
        memcpy(obs + k * I, tr->obs + row * I, I * sizeof(float));
        is_init[k] = tr->is_init[row];
        if (E)
            memcpy(extras + k * E, tr->extras + row * E, E * sizeof(float));
        version[k] = tr->version[row];
        memcpy(h + k * lh, tr->h + row * lh, lh * sizeof(float));
        if (d->lstm)
            memcpy(c + k * lh, tr->c + row * lh, lh * sizeof(float));
    }
}

size_t rnnd_traj_bytes(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d) {
    return tr ? row_bytes(d) * (size_t)tr->alloc + sizeof(*tr) : 0;
}
