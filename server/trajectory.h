/*
 * trajectory.h: where recorded steps live (docs/design.md "Learners"). Every env's
 * steps are rows of one trajectory store in the backend's memory (struct rnnd_traj_store: device
 * memory on CUDA, host memory on the CPU backend), sized at start for every env slot: slot s owns
 * rows [s * cap, (s + 1) * cap), a ring of its last `cap` steps (--trajectory-steps). The step
 * path writes its rows there (traj_write) and Forward reads them (traj_read) on the backend; the
 * host keeps only each env's ring position (struct rnnd_traj_ring, in its env table entry).
 *
 * Each row keeps what a learner needs to replay the step exactly: the observation, is_init, the
 * extras vector, the state the step started from (after any reset: rnnd_step.h_before) and the
 * model version that computed it. Engine thread only.
 */
#ifndef RNND_TRAJECTORY_H
#define RNND_TRAJECTORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rnnd_kernels.h"

struct rnnd_traj_dims {
    int I;     // obs width
    int E;     // extras width (0: none)
    int L, H;  // state is (L, H)
    bool lstm; // record the cell state too
    int cap;   // steps kept per env (0: none recorded)
};

// One env's ring in its slot's rows: the oldest step is at ring position head. Steps are
// numbered from the env's first recorded step since it got its slot: the ring holds steps
// [total - count, total).
struct rnnd_traj_ring {
    int32_t head;
    int32_t count;   // steps held (at most cap)
    uint64_t total;  // steps recorded since the env got its slot
    uint64_t cursor; // the first step of the env's next cursor window (docs/design.md "Cursor")
};

// Bytes of one recorded step in the store.
size_t rnnd_traj_row_bytes(const struct rnnd_traj_dims *d);

// Lays out a store of slots * cap rows in the block at base (NULL: only measure) and returns the
// block's size in bytes, or 0 when the row count does not fit the ops' int32 indices.
size_t rnnd_traj_layout(struct rnnd_traj_store *st, const struct rnnd_traj_dims *d, int slots,
                        void *base);

// The store row the env in `slot` writes its next step to. The ring changes only with
// rnnd_traj_push, once the step was recorded.
int32_t rnnd_traj_next(const struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d,
                       int32_t slot);
// Takes the step written at rnnd_traj_next into the ring (dropping the oldest when full).
void rnnd_traj_push(struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d);
// The store row of step k (0 = oldest) of the last T (1 <= T <= count, 0 <= k < T).
int32_t rnnd_traj_row(const struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d, int32_t slot,
                      int T, int k);
// The store row of step `step` (total - count <= step < total).
int32_t rnnd_traj_row_at(const struct rnnd_traj_ring *r, const struct rnnd_traj_dims *d,
                         int32_t slot, uint64_t step);

#endif // RNND_TRAJECTORY_H
