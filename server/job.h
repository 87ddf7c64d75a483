/*
 * job.h: the work handed to an engine (engine.h), one struct per kind in struct rnnd_job, and the
 * vote of a Step split over several engines. request.c fills these from the wire, service.c and
 * group.c submit them, the engine runs them; engine.h says who owns a job when.
 */
#ifndef RNND_JOB_H
#define RNND_JOB_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "batcher.h"
#include "config.h"
#include "rnnd_comm.h"
#include "rnnd_kernels.h"
#include "rnnd_threadpool.h"

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
// What a Step of a policy model returns per row besides the core output, packed in one row of
// W floats (in the job, in the env's retry cache and between the parts of a split Step): the
// action head's logits (K) or mean (A); the action (the index as a float, exact below 2^24, or
// A floats); its log-prob; the value. Offsets are -1 for what the model lacks; W is 0 for a
// model without heads.
struct rnnd_policy_row {
    int dist, ndist;     // logits or mean
    int action, naction; // 1 (index) or A
    int logp, value;
    int W;
};

static inline struct rnnd_policy_row rnnd_policy_row(const struct rnnd_model *m) {
    const struct rnnd_policy *p = &m->policy;
    struct rnnd_policy_row r = {-1, 0, -1, 0, -1, -1, 0};
    if (p->K > 0 || p->A > 0) {
        r.dist = 0;
        r.ndist = p->K > 0 ? p->K : p->A;
        r.action = r.ndist;
        r.naction = p->K > 0 ? 1 : p->A;
        r.logp = r.action + r.naction;
        r.W = r.logp + 1;
    }
    if (p->value)
        r.value = r.W++;
    return r;
}

struct rnnd_step_job {
    int B;
    const uint64_t *env_ids;    // (B) unique
    const float *obs;           // (B, I)
    const uint8_t *is_init;     // (B)
    const uint64_t *step_index; // (B) or NULL
    const float *extras;        // (B, E) or NULL
    bool return_state;
    bool greedy; // policy: the mode (argmax, mean) instead of a draw
    // Policy: what each env's previous step earned (struct rnnd_policy_row's record), or NULL.
    const float *reward;             // (B)
    const uint8_t *done, *truncated; // (B)
    // Outputs, allocated by the submitter:
    void *out;                 // (B, H) of out_dtype: the engine narrows rows as it copies them
    enum rnnd_ftype out_dtype; // the reply's (the rest stays fp32)
    float *pol;                // (B, W) of rnnd_policy_row, for a model with heads (else NULL)
    float *h;                  // (B, L, H) when return_state
    float *c;                  // (B, L, H) when return_state, LSTM
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
#define RNND_REC_OBS     1u
#define RNND_REC_IS_INIT 2u
#define RNND_REC_EXTRAS  4u
#define RNND_REC_VERSION 8u
#define RNND_REC_ACTION  16u // action, log-prob, value (policy models)
#define RNND_REC_REWARD  32u // reward, done, truncated (policy models)
#define RNND_REC_ALL     63u
#define RNND_GRAD_OBS    1u
#define RNND_GRAD_H0     2u // and grad_c0
#define RNND_GRAD_HIDDEN 4u // and grad_cell
#define RNND_GRAD_ALL    7u

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
    // A model with heads returns out only with return_core (without heads: always).
    bool return_core;
    // Recorded cursor windows (docs/design.md "Cursor"): each env's next T steps from its
    // cursor, which the engine moves once the Forward has run. Per row, the submitter's arrays
    // the engine fills: the window's first step, and the steps skipped before it as older than
    // --max-policy-lag or as gone from the ring.
    bool cursor;
    uint64_t *cur_first, *cur_lagged, *cur_over; // (B)
    // Outputs, set by the engine and valid until done returns (its memory: nobody frees them),
    // or for a part the submitter's arrays for all B rows:
    void *out;            // (B, T, H)
    void *h_n, *c_n;      // (B, L, H); c_n LSTM
    uint64_t tape_id;     // 0 unless keep_tape
    void *rec_obs;        // (B, T, I) recorded, RNND_REC_OBS
    uint8_t *rec_is_init; // (B, T) RNND_REC_IS_INIT
    void *rec_extras;     // (B, T, E) when E > 0, RNND_REC_EXTRAS
    int64_t *rec_version; // (B, T) RNND_REC_VERSION
    void *rec_action;     // (B, T) int64 or (B, T, A) fp32 (not the reply dtype), REC_ACTION
    float *rec_logp;      // (B, T) fp32, RNND_REC_ACTION with an action head
    float *rec_value;     // (B, T) fp32, RNND_REC_ACTION with a value head
    float *rec_reward;    // (B, T) fp32, RNND_REC_REWARD
    uint8_t *rec_done, *rec_truncated; // (B, T), RNND_REC_REWARD
    // The heads' outputs at every step (models with heads), in the reply dtype:
    void *logits;  // (B, T, K) discrete head
    void *mean;    // (B, T, A) Gaussian head
    void *log_std; // (A) Gaussian head
    void *value;   // (B, T) value head
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
    int B, T;                      // dims of grad_output as sent (checked against the tape)
    enum rnnd_ftype in, out_dtype; // of the float inputs and outputs, as for Forward
    const void *grad_out;          // (B, T, H), or NULL (models with heads: heads' grads only)
    // The gradients of the Forward's head outputs (models with heads), each NULL for zero:
    const void *grad_logits;    // (B, T, K)
    const void *grad_mean;      // (B, T, A)
    const void *grad_log_std;   // (A)
    const void *grad_value;     // (B, T)
    const void *grad_h_n;       // (B, L, H) or NULL
    const void *grad_c_n;       // (B, L, H) or NULL
    int grad_h_n_B, grad_c_n_B; // their first dims as sent
    bool accumulate;
    bool apply;           // then an ApplyGradients step on the accumulated buffer (one engine)
    bool input_grads_set; // false: every input gradient the Forward had, else these:
    unsigned input_grads; // RNND_GRAD_* bits (asking for an input the Forward had not is
                          // refused)
    bool part;
    bool has_part;       // part only: this engine holds rows of the tape
    const int32_t *rows; // a part's inner Backward: its rows in the request (errors name those)
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
    struct rnnd_threadpool_task reply;  // the engine's: sends a Step's reply on a reply thread
    // Forward and Backward with a CUDA region (shm.h): dev_in, the float and raw inputs are
    // device pointers (checked for NaN on the device); dev_out, the reply_region's device memory
    // (dev_out_bytes), where the engine writes the outputs it computes.
    bool dev_in;
    char *dev_out;
    size_t dev_out_bytes;
    // The reply may go once the job's GPU work is queued (the region's async replies): the
    // engine records the backend's ipc_record after it instead of synchronising.
    bool dev_async;
    // With a region the backend page-locked (shm.h: a socket region, a memfd's on CUDA): host_in,
    // the inputs lie there (copied to the device one by one, without staging, and checked for
    // NaN there). host_out: the reply_region's memory (host_out_bytes) when it is host memory,
    // where a Forward split over devices scatters its outputs and, when host_out_pinned (such a
    // region), the engine copies its outputs from the device.
    bool host_in;
    // Backward: the request's checks did not read the gradients' values (dev_in or host_in); the
    // engine checks them once they are in place, before anything changes.
    bool values_later;
    char *host_out;
    size_t host_out_bytes;
    bool host_out_pinned;
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

#endif
