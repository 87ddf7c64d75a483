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
#include "rnnd_comm.h"
#include "rnnd_kernels.h"

enum rnnd_job_kind {
    RNND_JOB_STEP,
    RNND_JOB_END_EPISODES,
    RNND_JOB_FORWARD,
    RNND_JOB_BACKWARD,
    RNND_JOB_APPLY,
    RNND_JOB_GET_WEIGHTS,
    RNND_JOB_SET_WEIGHTS,
    RNND_JOB_CHECKPOINT,
    RNND_JOB_HOUSEKEEPING,
    RNND_JOB_COMM,      // join a communicator (group.c)
    RNND_JOB_SYNC,      // take the weights, optimizer state and version of replica 0 (group.c)
    RNND_JOB_DROP_TAPE, // forget fwd.tape_id, kept by a Forward part whose Forward failed
};

struct rnnd_env;

// The parts of one Step over several devices (group.c) run on every device or on none. Each
// engine admits its part as it would a Step of its own (checks its envs, reserves slots for the
// new ones) and votes; a part admitted before the vote is complete stays queued, its envs held
// (no other step, EndEpisodes or eviction touches them), until it is. Then every part runs, or,
// if one was refused, the others give their reservations back and finish with err 0 (the refused
// part's err and msg are the Step's).
struct rnnd_step_vote {
    _Atomic int left;     // parts that have not voted
    _Atomic bool refused; // some part was refused
    // Called once by whoever casts the last vote (an engine, or group.c for a part its engine
    // would not queue), on that thread, before the voter's own part finishes; wakes the engines.
    void (*decided)(struct rnnd_step_vote *v);
};

// Casts one part's vote (any thread).
void rnnd_step_vote_cast(struct rnnd_step_vote *v, bool admitted);

// A Step: B rows, one per env. Inputs are borrowed (host memory).
struct rnnd_step_job {
    int B;
    const uint64_t *env_ids;    // (B) unique
    const float *obs;           // (B, I)
    const uint8_t *is_init;     // (B)
    const uint64_t *step_index; // (B) or NULL
    const float *extras;        // (B, E) or NULL
    bool return_state;
    // Outputs, allocated by the submitter:
    float *out; // (B, H)
    float *h;   // (B, L, H) when return_state
    float *c;   // (B, L, H) when return_state, LSTM
    // Engine scratch, allocated by the submitter:
    struct rnnd_env **envs; // (B)
    uint8_t *repeat;        // (B) 1: the row resends its env's last step_index
    // A part of a Step over several devices, or NULL:
    struct rnnd_step_vote *vote;
    bool held; // engine: admitted and waiting for the vote (envs[r] NULL: a reserved new env)
};

struct rnnd_end_job {
    int B;
    const uint64_t *env_ids; // (B) unique
    uint64_t released;       // out
};

// What a recorded Forward returns besides out, h_n, c_n (rnnd.v1.RecordedField bits), and which
// gradients of its inputs a Backward returns (rnnd.v1.InputGrad bits).
#define RNND_REC_OBS      1u
#define RNND_REC_IS_INIT  2u
#define RNND_REC_EXTRAS   4u
#define RNND_REC_VERSION  8u
#define RNND_REC_ALL      15u
#define RNND_GRAD_OBS     1u
#define RNND_GRAD_H0      2u // and grad_c0
#define RNND_GRAD_HIDDEN  4u // and grad_cell
#define RNND_GRAD_ALL     7u

// Forward over explicit trajectories (recorded false) or the last T recorded steps of envs.
// Float inputs arrive in dtype `in`, float outputs leave in dtype `out` (the wire's; the engine
// converts on the backend: rnnd_backend_ops.cast).
//
// A part (several engines share one Forward, group.c): the inputs hold all B rows and this engine
// runs rows[0..nrows) of them (env_ids too are all B); the outputs are allocated by the submitter
// for all B rows and the engine writes only its rows; a kept tape is stored under tape_id as
// given (the same id on every engine) and remembers its rows for Backward.
struct rnnd_forward_job {
    bool recorded;
    bool keep_tape;
    int B, T;
    enum rnnd_ftype in, out_dtype;
    // Explicit (host, borrowed):
    const void *x;          // (B, T, I)
    const uint8_t *is_init; // (B, T)
    const void *h0, *c0;    // (B, L, H) or NULL
    const void *hidden;     // (B, T, L, H) or NULL
    const void *cell;       // (B, T, L, H) or NULL
    // Recorded:
    const uint64_t *env_ids; // (B) unique
    unsigned rec_fields;     // RNND_REC_* bits: the recorded tensors returned
    // Outputs, set by the engine and valid until done returns (its memory: nobody frees them),
    // or for a part the submitter's arrays for all B rows:
    void *out;            // (B, T, H)
    void *h_n, *c_n;      // (B, L, H); c_n LSTM
    uint64_t tape_id;     // 0 unless keep_tape
    void *rec_obs;        // (B, T, I) recorded, RNND_REC_OBS
    uint8_t *rec_is_init; // (B, T) RNND_REC_IS_INIT
    void *rec_extras;     // (B, T, E) when E > 0, RNND_REC_EXTRAS
    int64_t *rec_version; // (B, T) RNND_REC_VERSION
    // Parts only:
    bool part;
    const int32_t *rows; // (nrows) ascending row indices
    int nrows;
};

// A part (group.c): every engine of the daemon gets the job, with all B rows of grad_out (and
// grad_h_n, grad_c_n); an engine that holds part of the tape (has_part) runs its rows and writes
// them into the outputs, which the submitter allocated for all B rows, once every engine has
// agreed that it can (its tape part found and the memory there). Without accumulate the weight
// gradients are summed over the engines (all-reduce) and engine 0 writes grads (P), also
// allocated by the submitter.
struct rnnd_backward_job {
    uint64_t tape_id;
    int B, T;                   // dims of grad_output as sent (checked against the tape)
    enum rnnd_ftype in, out_dtype; // of the float inputs and outputs, as for Forward
    const void *grad_out;       // (B, T, H)
    const void *grad_h_n;       // (B, L, H) or NULL
    const void *grad_c_n;       // (B, L, H) or NULL
    int grad_h_n_B, grad_c_n_B; // their first dims as sent
    bool accumulate;
    bool input_grads_set;       // false: every input gradient the Forward had, else these:
    unsigned input_grads;       // RNND_GRAD_* bits (asking for an input the Forward had not is
                                // refused)
    bool part;
    bool has_part; // part only: this engine holds rows of the tape
    // Outputs, set by the engine and valid until done returns (its memory: nobody frees them),
    // or for a part the submitter's arrays for all B rows:
    void *grads;       // (P) unless accumulate
    void *grad_x;      // (B, T, I) RNND_GRAD_OBS
    void *grad_h0;     // (B, L, H) RNND_GRAD_H0, when the Forward started from h0 (or a
                       // recorded state)
    void *grad_c0;     // (B, L, H) LSTM, likewise
    void *grad_hidden; // (B, T, L, H) RNND_GRAD_HIDDEN, when the Forward had stored states
    void *grad_cell;   // (B, T, L, H) LSTM, likewise
};

// With replicas (engines sharing a communicator) the accumulated gradients are summed over every
// replica first; sent gradients come from the host (root < 0) or are broadcast from replica
// `root`, the only one whose grads must be set.
struct rnnd_apply_job {
    const float *grads; // (P) host, or NULL: use the accumulated buffer (unless sent)
    bool sent;          // gradients were sent (grads, or a broadcast from root)
    bool has_lr;
    float lr;
    int root;
};

struct rnnd_weights_job {
    float *params; // (P) host: GetWeights fills it, SetWeights reads it; submitter allocates
    int root;      // SetWeights with replicas: -1 (every engine has params) or the replica whose
                   // params are broadcast (params may be NULL elsewhere)
};

// Joins a communicator: as the engines of this daemon (local: Backward parts), as the replicas
// of the weights (ApplyGradients, SetWeights, the start-up sync), or both.
struct rnnd_comm_job {
    struct rnnd_comm_id id;
    int nranks, rank, timeout_ms;
    bool local, replicas;
};

struct rnnd_checkpoint_job {
    char path[RNND_CONFIG_PATH_MAX]; // in: requested directory (may be empty); out: written path
};

struct rnnd_job {
    struct rnnd_batch_item item; // first: the batcher's link
    enum rnnd_job_kind kind;
    int err;                      // out: 0 or RNND_E*
    char msg[512];                // out: what was wrong, when err < 0
    uint64_t model_version;       // out: the version the job saw (or made)
    const _Atomic int *cancelled; // optional: nonzero when the client gave up (skip if queued)
    void (*done)(struct rnnd_job *job); // called once on the engine thread
    void *owner;                        // the submitter's
    void *aux;                          // the submitter's
    union {
        struct rnnd_step_job step;
        struct rnnd_end_job end;
        struct rnnd_forward_job fwd;
        struct rnnd_backward_job bwd;
        struct rnnd_apply_job apply;
        struct rnnd_weights_job weights;
        struct rnnd_checkpoint_job ckpt;
        struct rnnd_comm_job comm;
    };
};

// Marks job failed with err and the message; returns err.
int rnnd_job_fail(struct rnnd_job *job, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

struct rnnd_engine;

// Called once from the engine thread after start: err 0 when the backend and model are ready,
// else the reason in msg (and the thread exits).
typedef void (*rnnd_engine_ready_cb)(void *ctx, int err, const char *msg);

// A new engine for cfg (copied; its device, state_dir and restore are this engine's own), device
// `index` of `count` in this daemon: a restored checkpoint keeps only the envs that rnnd_place
// puts on index. Nothing runs yet. NULL when out of memory.
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
// batch itself, as submit_step does).
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

// The device index (0 <= result < n) that holds env id among n devices: jump consistent hashing
// (Lamping and Veach) of a mix of the id, so envs spread evenly and going from n to n + 1 devices
// moves only a 1/(n+1) share of them.
int rnnd_place(uint64_t env_id, int n);

#endif // RNND_ENGINE_H
