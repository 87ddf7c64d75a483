/*
 * traj.cu: the trajectory store's row moves (traj.cuh). A warp owns one row: it copies the row's
 * float columns (obs I, extras E, h and c L*H each) with consecutive lanes on consecutive floats,
 * so every column moves in full 128-byte transactions, and lane 0 the row's is_init and version.
 * A block is TRAJ_WARPS warps, the grid covers n rows. Pure copies: bit-exact either way.
 */
#include "traj.cuh"

#define TRAJ_WARPS 8

struct traj_kargs {
    int n;
    const int32_t *rows;
    int I, E, LH;
    bool write;
    // store columns
    float *s_obs, *s_extras, *s_h, *s_c;
    uint8_t *s_init;
    uint64_t *s_ver;
    // packed columns (NULL: not moved)
    float *p_obs, *p_extras, *p_h, *p_c;
    uint8_t *p_init;
    uint64_t *p_ver;
};

// Moves one row of w floats between the store (row s) and the packed array (row p).
static __device__ __forceinline__ void move_row(float *store, float *packed, size_t s, size_t p,
                                                int w, bool write, int lane) {
    if (packed == NULL || w == 0)
        return;
    float *sr = store + s * (size_t)w, *pr = packed + p * (size_t)w;
    if (write)
        for (int k = lane; k < w; k += 32)
            sr[k] = pr[k];
    else
        for (int k = lane; k < w; k += 32)
            pr[k] = sr[k];
}

static __global__ void traj_move_kernel(traj_kargs a) {
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.x * TRAJ_WARPS + (threadIdx.x >> 5);
    if (i >= a.n)
        return;
    const size_t s = (size_t)a.rows[i], p = (size_t)i;
    move_row(a.s_obs, a.p_obs, s, p, a.I, a.write, lane);
    move_row(a.s_extras, a.p_extras, s, p, a.E, a.write, lane);
    move_row(a.s_h, a.p_h, s, p, a.LH, a.write, lane);
    move_row(a.s_c, a.p_c, s, p, a.LH, a.write, lane);
    if (lane == 0) {
        if (a.write) {
            a.s_init[s] = a.p_init[p];
            a.s_ver[s] = a.p_ver[p];
        } else {
            if (a.p_init)
                a.p_init[p] = a.s_init[s];
            if (a.p_ver)
                a.p_ver[p] = a.s_ver[s];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// kernel launchers

static int traj_move(struct cuda_ctx *c, const struct rnnd_traj_store *st,
                     const struct rnnd_traj_rows *r, const struct rnnd_model *m, bool write) {
    if (c == NULL || rnnd_traj_check(st, r, m, write) != 0)
        return RNND_EINVAL;
    traj_kargs a = {};
    a.n = r->n;
    a.rows = r->rows;
    a.I = m->I, a.E = st->E, a.LH = m->L * m->H;
    a.write = write;
    a.s_obs = st->obs, a.s_extras = st->extras, a.s_h = st->h, a.s_c = st->c;
    a.s_init = st->is_init, a.s_ver = st->version;
    a.p_obs = r->obs, a.p_extras = r->extras, a.p_h = r->h, a.p_c = r->c;
    a.p_init = r->is_init, a.p_ver = r->version;
    // The next step may not read its weights or inputs early: this is not a step (common.cuh).
    c->step_tail = false;
    traj_move_kernel<<<CEIL_DIV(r->n, TRAJ_WARPS), 32 * TRAJ_WARPS, 0, c->stream>>>(a);
    CUDA_LAUNCH_CHECK();
    return 0;
}

int rnnd__cuda_traj_write(struct cuda_ctx *c, const struct rnnd_traj_store *st,
                          const struct rnnd_traj_rows *r, const struct rnnd_model *m) {
    return traj_move(c, st, r, m, true);
}

int rnnd__cuda_traj_read(struct cuda_ctx *c, const struct rnnd_traj_rows *r,
                         const struct rnnd_traj_store *st, const struct rnnd_model *m) {
    return traj_move(c, st, r, m, false);
}
