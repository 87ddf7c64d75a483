/*
 * trajectory.c: the store's layout and each env's ring arithmetic (see trajectory.h). Ring
 * position p of slot s is store row s * cap + p; step k (0 = oldest) of a ring is at position
 * (head + k) % cap.
 */
#include "trajectory.h"

#define STORE_ALIGN 256

size_t rnnd_traj_row_bytes(const struct rnnd_traj_dims *d) {
    size_t lh = (size_t)d->L * (size_t)d->H;
    return sizeof(float) * ((size_t)d->I + (size_t)d->E + lh * (d->lstm ? 2 : 1)) +
           sizeof(uint64_t) + 1;
}

static void *column(char *base, size_t *used, size_t bytes) {
    size_t at = (*used + STORE_ALIGN - 1) / STORE_ALIGN * STORE_ALIGN;
    *used = at + bytes;
    return base ? base + at : NULL;
}

size_t rnnd_traj_layout(struct rnnd_traj_store *st, const struct rnnd_traj_dims *d, int slots,
                        void *base) {
    int64_t R = (int64_t)slots * (int64_t)d->cap;
    if (R < 1 || R > INT32_MAX)
        return 0;
    size_t r = (size_t)R, lh = (size_t)d->L * (size_t)d->H, used = 0;
    char *b = base;
    st->R = R;
    st->E = d->E;
    st->version = column(b, &used, r * sizeof(uint64_t));
    st->obs = column(b, &used, r * (size_t)d->I * sizeof(float));
    st->extras = d->E ? column(b, &used, r * (size_t)d->E * sizeof(float)) : NULL;
    st->h = column(b, &used, r * lh * sizeof(float));
    st->c = d->lstm ? column(b, &used, r * lh * sizeof(float)) : NULL;
    st->is_init = column(b, &used, r);
    return used;
}

int32_t rnnd_traj_next(const struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d,
                       int32_t slot) {
    int32_t pos = r->count < d->cap ? (r->head + r->count) % d->cap : r->head;
    return slot * d->cap + pos;
}

void rnnd_traj_push(struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d) {
    r->total++;
    if (r->count < d->cap)
        r->count++;
    else
        r->head = (r->head + 1) % d->cap;
}

int32_t rnnd_traj_row(const struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d, int32_t slot,
                      int T, int k) {
    return slot * d->cap + (r->head + r->count - T + k) % d->cap;
}

int32_t rnnd_traj_row_at(const struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d,
                         int32_t slot, uint64_t step) {
    uint64_t k = step - (r->total - (uint64_t)r->count);
    return slot * d->cap + (int32_t)(((uint64_t)r->head + k) % (uint64_t)d->cap);
}
