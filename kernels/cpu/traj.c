/*
 * traj.c: the trajectory store's row moves on the CPU (struct rnnd_traj_store): traj_write
 * scatters packed rows into the store, traj_read gathers store rows into packed arrays. Plain
 * copies; the rows are split over the backend's threads when there are many (a Step of 1024 rows
 * writes ~1 MB, a Forward of 256 x 64 steps reads ~4 MB).
 */
#include "cpu.h"

#include <string.h>

// Fewer rows than this run on the calling thread: waking workers costs more than they save.
#define TRAJ_PARALLEL_MIN 256

struct traj_job {
    const struct rnnd_traj_store *st;
    const struct rnnd_traj_rows *r;
    size_t I, E, LH;
    bool write;
};

// Copies n floats from src row (index si) to dst row (index di), rows of `w` floats.
static void row_copy(float *dst, size_t di, const float *src, size_t si, size_t w) {
    memcpy(dst + di * w, src + si * w, w * sizeof(float));
}

static void traj_rows_run(void *arg, int k, int nt) {
    const struct traj_job *j = arg;
    const struct rnnd_traj_store *st = j->st;
    const struct rnnd_traj_rows *r = j->r;
    int first = (int)((long)r->n * k / nt), last = (int)((long)r->n * (k + 1) / nt);
    for (int i = first; i < last; i++) {
        size_t s = (size_t)r->rows[i], p = (size_t)i;
        if (j->write) {
            row_copy(st->obs, s, r->obs, p, j->I);
            if (j->E)
                row_copy(st->extras, s, r->extras, p, j->E);
            row_copy(st->h, s, r->h, p, j->LH);
            if (st->c)
                row_copy(st->c, s, r->c, p, j->LH);
            st->is_init[s] = r->is_init[p];
            st->version[s] = r->version[p];
        } else {
            if (r->obs)
                row_copy(r->obs, p, st->obs, s, j->I);
            if (r->extras)
                row_copy(r->extras, p, st->extras, s, j->E);
            if (r->h)
                row_copy(r->h, p, st->h, s, j->LH);
            if (r->c)
                row_copy(r->c, p, st->c, s, j->LH);
            if (r->is_init)
                r->is_init[p] = st->is_init[s];
            if (r->version)
                r->version[p] = st->version[s];
        }
    }
}

// Every index in range and, for a write, no row twice (two writers of one row would race).
static int traj_rows_check(struct cpu_ctx *c, const struct rnnd_traj_store *st,
                           const struct rnnd_traj_rows *r, bool write) {
    for (int i = 0; i < r->n; i++)
        if (r->rows[i] < 0 || r->rows[i] >= st->R)
            return RNND_EINVAL;
    if (!write)
        return 0;
    // Duplicates: a hash set of the indices, in the scratch buffer.
    size_t cap = 16;
    while (cap < 2 * (size_t)r->n)
        cap <<= 1;
    if (rnnd__cpu_reserve(c, cap * sizeof(int32_t)) != 0)
        return RNND_ENOMEM;
    int32_t *set = c->work;
    memset(set, 0xff, cap * sizeof(int32_t));
    for (int i = 0; i < r->n; i++) {
        uint32_t x = (uint32_t)r->rows[i] * 0x9e3779b1u;
        for (size_t h = x & (cap - 1);; h = (h + 1) & (cap - 1)) {
            if (set[h] < 0) {
                set[h] = r->rows[i];
                break;
            }
            if (set[h] == r->rows[i])
                return RNND_EINVAL;
        }
    }
    return 0;
}

static int traj_move(struct cpu_ctx *c, const struct rnnd_traj_store *st,
                     const struct rnnd_traj_rows *r, const struct rnnd_model *m, bool write) {
    if (rnnd_traj_check(st, r, m, write) != 0)
        return RNND_EINVAL;
    int rc = traj_rows_check(c, st, r, write);
    if (rc != 0)
        return rc;
    struct traj_job j = {.st = st,
                         .r = r,
                         .I = (size_t)m->I,
                         .E = (size_t)st->E,
                         .LH = (size_t)m->L * (size_t)m->H,
                         .write = write};
    int nt = r->n < TRAJ_PARALLEL_MIN ? 1 : c->nthreads;
    rnnd__cpu_parallel(c, nt, traj_rows_run, &j);
    return 0;
}

int rnnd__cpu_traj_write(struct cpu_ctx *c, const struct rnnd_traj_store *st,
                         const struct rnnd_traj_rows *r, const struct rnnd_model *m) {
    return traj_move(c, st, r, m, true);
}

int rnnd__cpu_traj_read(struct cpu_ctx *c, const struct rnnd_traj_rows *r,
                        const struct rnnd_traj_store *st, const struct rnnd_model *m) {
    return traj_move(c, st, r, m, false);
}
