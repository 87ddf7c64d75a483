/*
 * engine.h: the engine thread, which owns the backend and everything that lives in its memory:
 * the weights (double-buffered versions), the gradient buffer and optimizer state, the env state
 * table, the trajectory rings and the tapes. One per device (docs/architecture.md "Threads").
 *
 * Work arrives as jobs through the batcher (batcher.h): Step jobs are merged into batches, every
 * other kind runs alone, between batches (so a weight swap never lands inside a batch). Whoever
 * submits a job keeps ownership of its inputs; the engine fills its outputs and then calls
 * job->done(job) on the engine thread, after which it never touches the job again. A job the
 * engine refuses is finished the same way, with job->err < 0 and job->msg saying what was wrong
 * and what to send instead; a refused job changed no state.
 *
 * Several engines (one per device, or replicas on several hosts) are driven by group.c, which
 * splits work between them and keeps their weights identical: it submits the collective jobs
 * (RNND_JOB_COMM, _SYNC, and ApplyGradients / SetWeights / Backward parts once engines share a
 * communicator) to every engine in one order, and each engine takes part in every collective it
 * is given even when its own part failed, so that no peer is left waiting. A job split over
 * several engines is done by all of them or by none (a refused request changes no state): the
 * parts of a Step vote (struct rnnd_step_vote), the collective jobs first agree over their
 * communicator that every engine can go on before any of them changes anything, and a Forward
 * part's kept tape is dropped again (RNND_JOB_DROP_TAPE) when another part failed.
 */
#ifndef RNND_ENGINE_H
#define RNND_ENGINE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "batcher.h"
#include "config.h"
#include "job.h"
#include "rnnd_comm.h"
#include "rnnd_kernels.h"

struct rnnd_engine;

// Called once from the engine thread after start: err 0 when the backend and model are ready,
// else the reason in msg (and the thread exits).
typedef void (*rnnd_engine_ready_cb)(void *ctx, int err, const char *msg);

// A new engine for cfg (copied; its device, state_dir and restore are this engine's own), device
// `index` of `count` in this daemon: a restored checkpoint keeps only the envs that rnnd_place
// (group.h) puts on index. Nothing runs yet. NULL when out of memory.
struct rnnd_engine *rnnd_engine_init(const struct rnnd_config *cfg, int index, int count);
// Starts the engine thread, which opens the backend and loads the model, then calls ready.
// 0 or RNND_ENOMEM (no thread).
int rnnd_engine_start(struct rnnd_engine *e, rnnd_engine_ready_cb ready, void *ctx);
// Queues a Step job (any thread). 0, or RNND_EFULL (queue full), RNND_EUNAVAIL (stopping),
// RNND_EINVAL (B out of range): then the caller keeps the job and done is not called.
int rnnd_engine_submit_step(struct rnnd_engine *e, struct rnnd_job *job);
// rnnd_engine_submit_step in two halves, for group.c, which queues the parts of a Step on its
// engines in one order (under its lock) before any may run: queue_step queues the job (returns
// as submit_step) and kick lets the engine take it (with the CPU backend this thread may run the
// batch itself, as submit_step does; a device's parts go to its engine thread).
int rnnd_engine_queue_step(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd_engine_kick(struct rnnd_engine *e);
// Wakes the engine thread so that it looks at its queue again: a held Step part may now run or
// give up (struct rnnd_step_vote). Any thread.
void rnnd_engine_wake(struct rnnd_engine *e);
// Queues any other job (any thread); done is always called.
void rnnd_engine_submit(struct rnnd_engine *e, struct rnnd_job *job);
// Queues one housekeeping pass (idle eviction, tape expiry, periodic checkpoint) unless one is
// already queued (any thread; the cron calls it).
void rnnd_engine_housekeeping(struct rnnd_engine *e);
// Stops taking Step jobs, finishes everything queued, writes a final checkpoint when
// --state-dir is set, and ends the thread (any thread; returns at once).
void rnnd_engine_stop(struct rnnd_engine *e);
// Waits for the engine thread to end (after stop or a failed start).
void rnnd_engine_join(struct rnnd_engine *e);
void rnnd_engine_free(struct rnnd_engine *e);
// After rnnd_engine_join: true when the checkpoint written on stop failed (what changed since
// the last checkpoint is lost), false when it was written or none was due.
bool rnnd_engine_final_checkpoint_failed(const struct rnnd_engine *e);

// Thread-safe readings.
uint64_t rnnd_engine_model_version(const struct rnnd_engine *e);
uint64_t rnnd_engine_envs_active(const struct rnnd_engine *e);
// Valid after ready: "cpu" / "cuda" and the device's name.
const char *rnnd_engine_backend_name(const struct rnnd_engine *e);
const char *rnnd_engine_device_name(const struct rnnd_engine *e);
// Valid after ready: the backend's name for the kernels it runs for a learner batch of
// --max-batch rows (the plan of docs/kernels.md; "cpu_reference" on the CPU).
const char *rnnd_engine_plan_name(const struct rnnd_engine *e);
// The model served and its parameter count P.
const struct rnnd_model *rnnd_engine_model(const struct rnnd_engine *e);
size_t rnnd_engine_param_count(const struct rnnd_engine *e);
// Step rows waiting.
int rnnd_engine_queue_rows(struct rnnd_engine *e);
// The backend, valid after ready, for rnnd_comm_supported / rnnd_comm_id_new (which read only its
// kind); any thread.
const struct rnnd_backend *rnnd_engine_backend(const struct rnnd_engine *e);

#endif // RNND_ENGINE_H
