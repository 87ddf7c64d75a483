/*
 * envtable.h: env id -> state slot. Each env that holds state owns one slot index into the
 * engine's state tables on the backend (state_h (S, L, H) and state_c), plus what the daemon
 * remembers about it: the last step_index and output (for retry-safe steps), when it was last
 * used (idle eviction, oldest first) and where its ring of recorded steps stands (its rows of the
 * trajectory store are its slot's: trajectory.h).
 *
 * The table has a fixed capacity S = --max-envs; entries are preallocated and an entry's index
 * is its slot, so adding and removing never allocate. Engine thread only: no locks.
 */
#ifndef RNND_ENVTABLE_H
#define RNND_ENVTABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "trajectory.h"

struct rnnd_env {
    uint64_t id;
    int32_t slot; // index into the state tables; equals the entry's index
    bool used;
    bool has_index;      // last_index is valid (the latest step carried a step_index)
    uint64_t last_index; // step_index of the latest step
    uint64_t last_used_ns;
    uint64_t out_version;       // model version that computed the cached output
    uint64_t steps;             // steps it took since it got its slot (a policy's sampling key)
    struct rnnd_traj_ring traj; // its recorded steps in the trajectory store
    bool held;                  // engine: a Step part admitted for it waits for its other devices
    bool busy;                  // engine: in a Step batch still running on the backend
    bool half;                  // engine: its state is in table row slot + S (else slot)
    // Private to envtable.c:
    int32_t next, lru_prev, lru_next;
    uint64_t moved_ns; // when it last moved to the newest end of the use order
};

struct rnnd_envtable;

// A new table of cap entries with an H-float cached reply row each (the core output, then a
// policy's outputs); NULL when out of memory.
// Free with rnnd_envtable_free.
struct rnnd_envtable *rnnd_envtable_init(int cap, int H);
void rnnd_envtable_free(struct rnnd_envtable *t);

// The entry for id, or NULL.
struct rnnd_env *rnnd_envtable_find(const struct rnnd_envtable *t, uint64_t id);
// rnnd_envtable_find, trying entry `hint` first (an env's slot from an earlier find, or -1): one
// entry read instead of a bucket and a chain when the entry still holds id.
struct rnnd_env *rnnd_envtable_find_hint(const struct rnnd_envtable *t, uint64_t id, int32_t hint);
// Starts loading what finding each of the n ids will read (its bucket, then its chain's first
// entry), so that a run of finds does not wait on two cache misses each.
void rnnd_envtable_prefetch(const struct rnnd_envtable *t, const uint64_t *ids, int n);
// The same for n finds with hints: each hinted entry, or where there is none the id's bucket.
void rnnd_envtable_prefetch_hints(const struct rnnd_envtable *t, const uint64_t *ids,
                                  const int32_t *hints, int n);
// Adds id (which must not be present) with a free slot, as the most recently used entry.
// 0 and *out, or RNND_EFULL when every slot is taken.
int rnnd_envtable_add(struct rnnd_envtable *t, uint64_t id, uint64_t now_ns, struct rnnd_env **out);
// Marks e used at now_ns: it becomes the newest for eviction, unless it became so less than
// RNND_ENV_TOUCH_SLACK_NS before (the use order is then that much out of date).
#define RNND_ENV_TOUCH_SLACK_NS 100000000ull // 100 ms
void rnnd_envtable_touch(struct rnnd_envtable *t, struct rnnd_env *e, uint64_t now_ns);
// Removes e and frees its slot (its recorded steps are gone with it).
void rnnd_envtable_remove(struct rnnd_envtable *t, struct rnnd_env *e);
// The least recently used entry, or NULL when empty.
struct rnnd_env *rnnd_envtable_oldest(const struct rnnd_envtable *t);
// The entry after e in use order (oldest first), or NULL; for walking every env.
struct rnnd_env *rnnd_envtable_newer(const struct rnnd_envtable *t, const struct rnnd_env *e);

int rnnd_envtable_count(const struct rnnd_envtable *t);
int rnnd_envtable_capacity(const struct rnnd_envtable *t);
// The env's cached reply row of its latest step (the H of rnnd_envtable_init floats).
float *rnnd_envtable_output(struct rnnd_envtable *t, const struct rnnd_env *e);

#endif // RNND_ENVTABLE_H
