/*
 * tape.h: Forward tapes kept for Backward (docs/design.md), under a time-to-live (--tape-ttl-s)
 * and a memory budget (--tape-memory-mb).
 *
 * The store keeps opaque tape objects with their byte counts; the engine owns what they point
 * to and frees it through the release callback (it holds backend memory). A tape is found by
 * its id until Backward takes it, it expires, or the store is freed. Ids are never reused.
 * Engine thread only: no locks.
 */
#ifndef RNND_TAPE_H
#define RNND_TAPE_H

#include <stddef.h>
#include <stdint.h>

typedef void (*rnnd_tape_release_cb)(void *ctx, void *tape);

struct rnnd_tapes;

// A new store: budget in bytes, ttl in ns; release(ctx, tape) frees a tape the store drops.
// NULL when out of memory. Free with rnnd_tapes_free (which releases every tape).
struct rnnd_tapes *rnnd_tapes_init(size_t budget, uint64_t ttl_ns, rnnd_tape_release_cb release,
                                   void *ctx);
void rnnd_tapes_free(struct rnnd_tapes *ts);

// 0 when bytes more fit into the budget now (after dropping expired tapes), else RNND_EFULL.
int rnnd_tapes_fits(struct rnnd_tapes *ts, size_t bytes, uint64_t now_ns);
// Takes ownership of tape (bytes counted against the budget) and returns its id (never 0) in
// *id. RNND_EFULL when over budget, RNND_ENOMEM: then the caller still owns tape.
int rnnd_tapes_add(struct rnnd_tapes *ts, void *tape, size_t bytes, uint64_t now_ns, uint64_t *id);
// The same under an id chosen by the caller (group.c gives the parts of one Forward on several
// engines one id), which must not be 0 or in use (RNND_EINVAL); ids from rnnd_tapes_add and
// chosen ones must not meet (group.c sets bit 63 in its own).
int rnnd_tapes_add_as(struct rnnd_tapes *ts, void *tape, size_t bytes, uint64_t now_ns,
                      uint64_t id);
// The tape with this id, still owned by the store: 0 and *tape, or RNND_ENOTFOUND when the id
// is unknown, was taken or has expired.
int rnnd_tapes_get(struct rnnd_tapes *ts, uint64_t id, uint64_t now_ns, void **tape);
// Drops the tape with this id (released through the callback). 0 or RNND_ENOTFOUND.
int rnnd_tapes_remove(struct rnnd_tapes *ts, uint64_t id);
// Drops every tape older than the ttl; returns how many.
int rnnd_tapes_expire(struct rnnd_tapes *ts, uint64_t now_ns);

int rnnd_tapes_count(const struct rnnd_tapes *ts);
size_t rnnd_tapes_bytes(const struct rnnd_tapes *ts);
size_t rnnd_tapes_budget(const struct rnnd_tapes *ts);

#endif // RNND_TAPE_H
