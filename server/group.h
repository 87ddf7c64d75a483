/*
 * group.h: the engines of this daemon, one per --devices entry, and (with --world-size) its place
 * among several rnnd instances that keep one set of weights. The service talks to the group as
 * it would to one engine (same job types, same contract: engine.h); the group splits each job
 * over its engines and merges their results. With one device and no other instance every call
 * goes straight to the one engine.
 *
 *   Step, EndEpisodes  an env lives on the device rnnd_place gives it (state, recorded steps);
 *                      a batch is split by that, run on every device at once, and merged.
 *   Forward            split into contiguous row ranges (recorded: by where each env lives); a
 *                      kept tape is one id for all its parts: bit 63, a sequence number, whether
 *                      it has h0 (bit 16) and stored states (bit 17), and the mask of devices
 *                      holding a part (bits 0..15).
 *   Backward           every device runs its part of the tape; the weight gradients are summed
 *                      over the devices (NCCL all-reduce), or accumulated where they are.
 *   ApplyGradients,    run on every device from the same inputs (accumulated gradients summed
 *   SetWeights         over every device and host first), so all replicas stay bit-identical;
 *                      with several hosts they are first put into one order by rank 0
 *                      (cluster.h) and their data is broadcast from the receiving host.
 *   GetWeights         read from every device and compared: a difference is reported as an
 *                      error (it would be a bug), so tests and operators see it.
 *
 * A job split over several devices runs on all of them or on none: a request refused on one
 * device changes nothing on the others either (docs/design.md "Several devices and hosts").
 *   Step               every device admits its part first (checks its envs, reserves slots for
 *                      the new ones, holds the envs); the parts run once all are admitted, and
 *                      give their reservations back when one is refused (unknown env without
 *                      is_init, step_index that skips ahead, env table or queue full, cancelled):
 *                      struct rnnd_step_vote, job.h. A Step on one device runs as before.
 *   Backward,          every device (every replica, across instances) says whether it can go
 *   ApplyGradients,    on (its tape part is there, memory for the new weights) in an all-reduce
 *   SetWeights         of one flag before anything changes, and none goes on unless all can.
 *   Forward            its only state is a kept tape: when a part failed, the devices that kept
 *                      theirs drop them again before the reply.
 *   EndEpisodes        cannot fail on one device alone; once rnnd stops, a job that needs
 *                      several engines goes to none (they stop one after the other).
 *   GetWeights         reads only.
 *   SaveCheckpoint     each device writes its own directory, complete on its own (as the
 *                      periodic ones, written at each device's own times): when one fails, the
 *                      others' new checkpoints stay.
 * What remains is a device failing while it runs its part after all agreed (a backend fault:
 * rnnd aborts on a sticky device error); the call then fails with it.
 */
#ifndef RNND_GROUP_H
#define RNND_GROUP_H

#include "config.h"
#include "engine.h"
#include "place.h"

struct rnnd_group;


// Called once when the group of instances breaks after start (a peer is gone); any thread.
typedef void (*rnnd_group_lost_cb)(void *ctx, const char *why);

// A new group for cfg (copied): one engine per device; nothing runs yet. NULL when out of memory.
struct rnnd_group *rnnd_group_init(const struct rnnd_config *cfg);
// Starts every engine, then (several devices or instances) forms the communicators, meets the
// other instances and gives every replica replica 0's weights; then calls ready once, from some
// thread: err 0, or the reason in msg. lost may follow later. 0 or RNND_ENOMEM.
int rnnd_group_start(struct rnnd_group *g, rnnd_engine_ready_cb ready, rnnd_group_lost_cb lost,
                     void *ctx);
// As rnnd_engine_submit_step and rnnd_engine_submit (engine.h). With several devices a Step that
// one device cannot queue is finished through done with the reason (no device runs it), and
// submit returns 0.
int rnnd_group_submit_step(struct rnnd_group *g, struct rnnd_job *job);
void rnnd_group_submit(struct rnnd_group *g, struct rnnd_job *job);
void rnnd_group_housekeeping(struct rnnd_group *g);
// As rnnd_engine_stop / _join for every engine; join also leaves the group of instances.
void rnnd_group_stop(struct rnnd_group *g);
void rnnd_group_join(struct rnnd_group *g);
void rnnd_group_free(struct rnnd_group *g);
// After rnnd_group_join: true when a device's checkpoint on stop failed.
bool rnnd_group_final_checkpoint_failed(const struct rnnd_group *g);

// Thread-safe readings, as the engine's (sums over the devices where that is what they count).
uint64_t rnnd_group_model_version(const struct rnnd_group *g);
uint64_t rnnd_group_envs_active(const struct rnnd_group *g);
const char *rnnd_group_backend_name(const struct rnnd_group *g);
const char *rnnd_group_device_name(const struct rnnd_group *g); // valid after ready
const char *rnnd_group_plan_name(const struct rnnd_group *g);   // valid after ready
const struct rnnd_model *rnnd_group_model(const struct rnnd_group *g);
int rnnd_group_queue_rows(struct rnnd_group *g);
int rnnd_group_devices(const struct rnnd_group *g);
// The only engine's backend (shm.h: it opens CUDA regions); NULL with several devices. Valid
// after ready.
const struct rnnd_backend *rnnd_group_sole_backend(const struct rnnd_group *g);
// Device 0's backend, whose host_alloc memory every device's copies take without staging (on
// CUDA: page-locked and portable), for socket regions (shm.h). Valid after ready.
const struct rnnd_backend *rnnd_group_host_backend(const struct rnnd_group *g);

#endif // RNND_GROUP_H
