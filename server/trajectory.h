/*
 * trajectory.h: the per-env ring of recorded steps (docs/design.md "Learners").
 *
 * Each step keeps what a learner needs to replay it exactly: the observation, is_init, the
 * extras vector, the state the step started from (after any reset: rnnd_step.h_before) and the
 * model version that computed it. The ring holds the last `cap` steps (--trajectory-steps); its
 * storage grows by doubling up to cap, so an env that took few steps costs little.
 * Engine thread only.
 */
#ifndef RNND_TRAJECTORY_H
#define RNND_TRAJECTORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct rnnd_traj_dims {
    int I;     // obs width
    int E;     // extras width (0: none)
    int L, H;  // state is (L, H)
    bool lstm; // record the cell state too
    int cap;   // steps kept
};

struct rnnd_traj;

// A new empty ring; NULL when out of memory. Free with rnnd_traj_free.
struct rnnd_traj *rnnd_traj_init(const struct rnnd_traj_dims *d);
void rnnd_traj_free(struct rnnd_traj *tr);

// Appends one step, dropping the oldest when full. obs (I), extras (E) or NULL for zeros,
// h_before and c_before (L, H) (c_before LSTM only). 0 or RNND_ENOMEM (the ring is unchanged).
int rnnd_traj_push(struct rnnd_traj *tr, const struct rnnd_traj_dims *d, const float *obs,
                   bool is_init, const float *extras, const float *h_before, const float *c_before,
                   uint64_t version);

// Steps held (at most cap).
int rnnd_traj_count(const struct rnnd_traj *tr);

// Copies the last T steps (1 <= T <= count): obs (T, I), is_init (T), extras (T, E) when E > 0
// and extras is not NULL, version (T), and the state before the first of them: h0 (L, H) and
// c0 (L, H) for LSTM. Any output may be NULL. RNND_EINVAL when T is out of range.
int rnnd_traj_window(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d, int T, float *obs,
                     uint8_t *is_init, float *extras, int64_t *version, float *h0, float *c0);

// Copies every step held (count of them, oldest first) with the state before each: obs
// (count, I), is_init (count), extras (count, E) when E > 0, version (count), h (count, L, H)
// and c (count, L, H) for LSTM. For checkpoints; pushing the rows back in order rebuilds the ring.
void rnnd_traj_export(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d, float *obs,
                      uint8_t *is_init, float *extras, uint64_t *version, float *h, float *c);

// Bytes the ring holds now.
size_t rnnd_traj_bytes(const struct rnnd_traj *tr, const struct rnnd_traj_dims *d);

#endif // RNND_TRAJECTORY_H
