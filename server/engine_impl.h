/*
 * engine_impl.h: private to the engine's files (engine.c, engine_step.c, engine_learn.c,
 * engine_ckpt.c); nothing else includes it. The engine's public interface is engine.h.
 *
 * It holds what those files share: struct rnnd_engine (everything the engine thread owns), the
 * weights versions, the helpers for backend memory, the layout of a Step batch's packed blocks,
 * and the functions each file offers the others, declared below by the file that defines them.
 */
#ifndef RNND_ENGINE_IMPL_H
#define RNND_ENGINE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "envtable.h"
#include "metrics.h"
#include "rnnd_threadpool.h"
#include "tape.h"
#include "trajectory.h"

#define CARVE_ALIGN 256

struct weights {
    int refs;
    uint64_t version;
    float *params;        // (P) backend memory
    void *derived;        // what the backend derives from params for steps, or NULL (none)
    struct weights *next; // free list
};

struct row_ref {
    struct rnnd_job *job;
    int row;
};

#define STEP_REPLAY_ROWS  16  // batches of at most this many rows replay a recording (below)
#define STEP_HINT_SOURCES 256 // sources whose last Step's env slots admission remembers

struct rnnd_engine {
    struct rnnd_config cfg;
    int index, count; // this engine's device among the daemon's (rnnd_place)
    // --state-dir as given; cfg.state_dir is this device's own directory inside it (device-N)
    // when there are several devices.
    char top_dir[RNND_CONFIG_PATH_MAX];
    struct rnnd_comm *local;    // this daemon's engines (Backward parts), or NULL
    struct rnnd_comm *replicas; // every replica of the weights (may be local), or NULL
    // What this engine last added to the daemon-wide gauges, to which every engine adds its own.
    int64_t pub_envs, pub_tapes, pub_tape_bytes, pub_queue, pub_store;
    struct rnnd_model model;
    size_t P, LH;
    bool lstm;
    // The policy around the core (docs/design.md "Policy"): the core alone as the core ops take
    // it, what a Step returns per row besides the core output, and the encoder's activations
    // per row (0 without encoder).
    struct rnnd_model core;
    bool policy;
    struct rnnd_policy_row prow;
    int enc_acts;
    // A policy's record of each trajectory store row, in host memory on every backend (the
    // engine reads and writes it per row; mapped lazily: rows never recorded cost no memory),
    // when the model has heads and steps are recorded: prec_w floats per row (the
    // policy row of rnnd_policy_row without its logits or mean, then the reward the env's next
    // step reports) and the done (bit 0) and truncated (bit 1) flags.
    float *prec;     // (R, prec_w)
    uint8_t *pflags; // (R)
    size_t prec_w;
    // The model version of each trajectory store row, in host memory, with --max-policy-lag:
    // what a cursor window's lag bound reads (the store's own copy may be device memory).
    uint64_t *tver; // (R)
    // Host memory of a recorded Forward's policy outputs (struct rnnd_forward_job), grown on
    // demand.
    char *rec_host;
    size_t rec_host_bytes;
    struct rnnd_backend be;
    bool host_mem;    // the backend's memory is host memory: no staging copies
    bool lookahead;   // the next Step batch is gathered while one runs (--step-lookahead)
    int max_delay_us; // --max-delay-us as resolved once the backend is open
    struct rnnd_batcher *batcher;

    pthread_t thread;
    bool thread_started;
    rnnd_engine_ready_cb ready_cb;
    void *ready_ctx;
    // The engine lock: whoever holds it acts as the engine (owns everything below). The engine
    // thread holds it while it works; another thread may take it to run a Step batch while the
    // engine thread sleeps (inline_steps): any Step with the CPU backend, a small one with a
    // backend that binds the thread to its device first (CUDA). Every other job's device work
    // stays on the engine thread.
    pthread_mutex_t emu;
    _Atomic bool inline_steps;
    pthread_mutex_t lock; // guards closed
    bool closed;          // the thread has finished: submit fails jobs itself
    bool stopping;        // engine thread only

    // Backend memory.
    struct weights *cur, *spare;
    float *grad_accum;   // (P + 1): the last float is 1 while gradients are pending (replicas)
    float *grad_scratch; // (P + 1): the last float is the flag replicas agree with (agree)
    bool grad_pending;
    // A job answered before its GPU work was done (rnnd_job.dev_async): the engine synchronises
    // before its next job touches host memory that work may still read (rnnd__engine_process).
    bool unsettled;
    float *adam_m, *adam_v; // (P), Adam only
    int64_t optim_t;
    // Two rows per env slot s, s and s + S: a step reads the env's current row (env->half) and
    // writes the other (struct rnnd_step), then flips env->half.
    float *state_h, *state_c; // (2S, L, H)
    // A batch's inputs (x, slots, slots_new, is_init; extras, store rows and versions when it is
    // recorded) and outputs (out; h_before, c_before, which stay on the backend) each sit packed
    // in one block, laid out for the batch's row count (rnnd__engine_step_layout), so that a
    // batch costs one copy in and one copy out. Sized for --max-batch rows. Two sets: while one
    // batch runs on the backend the engine gathers the next into the other (engine_step.c's
    // look-ahead); host_mem backends run each batch at once and have only the first.
    struct step_bufs {
        char *d_in, *d_outb;
        char *h_in, *h_outb;  // host staging (aliases of the above when host_mem)
        struct row_ref *rows; // (max_batch)
    } bufs[2];
    size_t in_bytes, out_bytes;
    // Batches of up to STEP_REPLAY_ROWS rows of the core alone replay a recording of their
    // backend work (record_begin: one launch instead of four) on bufs[0], one per row count,
    // recorded again when the weights move. A policy's ops (cuBLAS among them) have not been
    // tried inside a recording, so its batches run op by op. step_replay_off: the backend has
    // none, or one failed.
    struct step_replay {
        void *unit;
        const float *params; // the weights it was recorded with
    } step_replay[STEP_REPLAY_ROWS + 1];
    bool step_replay_off;
    // Each source's (connection's or stream's) last admitted Step: its envs' slots, row by row.
    // A source mostly steps the same envs in the same order, so admission tries those entries
    // before the hash chains (rnnd_envtable_find_hint). Direct-mapped on the source.
    struct step_hint {
        uint64_t source;
        int n, cap;
        int32_t *slots;
    } step_hints[STEP_HINT_SOURCES];
    // Every env slot's recorded steps (trajectory.h), when --trajectory-steps > 0.
    struct rnnd_traj_store store;
    void *d_store;
    size_t store_bytes;
    // Page-locked staging of Forward and Backward inputs and outputs (not with host_mem: those
    // use their backend block in place), grown on demand.
    char *xfer;
    size_t xfer_bytes;
    // Page-locked rows of a Backward part's gradients, gathered from the request
    // (rnnd__engine_part_host), grown on demand.
    char *part_in;
    size_t part_in_bytes;
    // Backend memory of the calls that keep nothing past their reply (rnnd__engine_work_reserve).
    void *work;
    size_t work_bytes;
    // The block of the last tape released, for the next tape (tape_block_alloc).
    void *spare_tape;
    size_t spare_tape_bytes;

    struct rnnd_envtable *envs;
    int envs_reserved; // slots promised to the new envs of held Step parts
    // EndEpisodes waiting for held envs (rnnd__engine_run_end), in arrival order.
    struct rnnd_job *ends_held;
    struct rnnd_traj_dims tdims;
    struct rnnd_tapes *tapes;
    uint64_t last_checkpoint_ns; // the last automatic checkpoint tried (written or not)
    // Automatic checkpoints the rotation leaves alone: found at start, newer than the state
    // restored or refused (spare_newer).
    char **spared;
    int n_spared;
    bool final_failed; // the checkpoint on stop was not written

    // Reply threads: finished Step jobs of a batch are handed to them so that packing and
    // sending replies runs in parallel and off the engine thread (0 threads: the engine does it).
    struct rnnd_threadpool *replies;
    // Row workers: help the engine with a big batch's per-row copies and recording.
    struct rnnd_threadpool *row_workers;

    _Atomic uint64_t version;
    _Atomic uint64_t envs_active;
    _Atomic int hk_queued;
    struct rnnd_job hk_job, stop_job;
    char backend_name[16];
    char plan[256]; // the backend's kernel plan for a learner batch of max_batch rows
    char device[128];
};

// ---------------------------------------------------------------------------------------------
// Backend memory helpers

struct carve {
    char *base;
    size_t used;
};

static inline void *carve(struct carve *c, size_t bytes) {
    size_t at = (c->used + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
    c->used = at + bytes;
    return c->base ? c->base + at : NULL;
}

static inline int be_alloc(struct rnnd_engine *e, size_t bytes, void **out) {
    *out = NULL;
    return e->be.ops->alloc(e->be.ctx, bytes ? bytes : 1, out);
}

static inline void be_free(struct rnnd_engine *e, void *p) {
    if (p)
        e->be.ops->free(e->be.ctx, p);
}

static inline int be_in(struct rnnd_engine *e, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src)
        return 0;
    return e->be.ops->copy_in(e->be.ctx, dst, src, bytes);
}

static inline int be_out(struct rnnd_engine *e, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src)
        return 0;
    return e->be.ops->copy_out(e->be.ctx, dst, src, bytes);
}

// Adds this engine's change of a gauge that every engine of the daemon contributes to.
static inline void publish(_Atomic int64_t *gauge, int64_t *mine, int64_t now) {
    atomic_fetch_add_explicit(gauge, now - *mine, memory_order_relaxed);
    *mine = now;
}

// Offset of a new aligned piece of `bytes` after *used.
static inline size_t carve_off(size_t *used, size_t bytes) {
    size_t at = (*used + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
    *used = at + bytes;
    return at;
}

// Where a batch of n rows keeps its inputs and outputs inside the packed blocks (see
// struct rnnd_engine): the same offsets on the host and on the device. When steps are recorded
// the input block also carries each row's extras, store row and model version, and the output
// block the state each row started from: the backend records the rows from there (traj_write)
// and only `out` comes back.
// A policy model adds each row's sampling key (env id, step) and greedy flag to the input block,
// the heads' outputs and the action to the part that comes back, and the encoder's activations
// to the rest.
struct step_layout {
    size_t x, slots, slots_new, init, extras, trows, version; // in the input block
    size_t keys, ksteps, greedy, in_used;                     // (policy)
    size_t out, dist, index, action, logp, value, out_used;   // in the output block: out_used
                                                              // covers what is copied back
    size_t hb, cb, acts, out_all;
};

// The state tables' row that holds env's state, and the one its next step writes.
static inline size_t env_row(const struct rnnd_engine *e, const struct rnnd_env *env) {
    return (size_t)env->slot + (env->half ? (size_t)e->cfg.max_envs : 0);
}
static inline size_t env_row_next(const struct rnnd_engine *e, const struct rnnd_env *env) {
    return (size_t)env->slot + (env->half ? 0 : (size_t)e->cfg.max_envs);
}

// ---------------------------------------------------------------------------------------------
// What each file offers the others

// engine.c: weights versions, envs, and the backend memory of Forward, Backward and checkpoints.
struct weights *rnnd__engine_weights_new(struct rnnd_engine *e);
void rnnd__engine_weights_unref(struct rnnd_engine *e, struct weights *w);
// After every write to w->params: the backend's derived copy made again from them.
int rnnd__engine_weights_changed(struct rnnd_engine *e, struct weights *w);
void rnnd__engine_weights_swap(struct rnnd_engine *e, struct weights *w);
void rnnd__engine_env_drop(struct rnnd_engine *e, struct rnnd_env *env, enum rnnd_evict_reason why);
void rnnd__engine_env_gauges(struct rnnd_engine *e);
int rnnd__engine_work_reserve(struct rnnd_engine *e, size_t bytes, void **out);
char *rnnd__engine_xfer_host(struct rnnd_engine *e, char *d_io, size_t bytes);
// The engine's host_alloc buffer for a part's gathered inputs, of at least bytes. NULL when out
// of memory.
char *rnnd__engine_part_host(struct rnnd_engine *e, size_t bytes);
// lookahead: a Step batch may admit the next while it runs (e->lookahead; never inline).
void rnnd__engine_process(struct rnnd_engine *e, struct rnnd_batch *b, bool lookahead);

// engine_step.c: the Step path, and EndEpisodes (which wait for held Step parts).
struct step_layout rnnd__engine_step_layout(const struct rnnd_engine *e, int n);
enum rnnd_batch_admit rnnd__engine_admit_step(void *ctx, struct rnnd_batch_item *item);
// The engine's poll of its batcher (with the control jobs, or Step batches only): a poll that
// forms a Step batch counts its time as the batch's admit phase.
bool rnnd__engine_poll(struct rnnd_engine *e, bool controls, struct rnnd_batch *b, uint64_t *wait);
void rnnd__engine_run_step_batch(struct rnnd_engine *e, struct rnnd_job *jobs, bool lookahead);
bool rnnd__engine_run_end(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_ends_held(struct rnnd_engine *e);

// engine_learn.c: tapes, Forward, Backward, the weights and the optimizer, and the replicas.
struct fwd_part;
struct agreement;
void rnnd__engine_tape_release(void *ctx, void *p);
void rnnd__engine_tape_gauges(struct rnnd_engine *e);
void rnnd__engine_run_forward(struct rnnd_engine *e, struct rnnd_job *job,
                              const struct fwd_part *pt);
void rnnd__engine_run_forward_part(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_backward(struct rnnd_engine *e, struct rnnd_job *job, struct agreement *ag,
                               uint64_t now);
void rnnd__engine_run_backward_part(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_apply(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_get_weights(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_set_weights(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_comm(struct rnnd_engine *e, struct rnnd_job *job);
void rnnd__engine_run_sync(struct rnnd_engine *e, struct rnnd_job *job);

// engine_ckpt.c: checkpoints, and the restore at start.
int rnnd__engine_restore(struct rnnd_engine *e, char *msg, size_t msglen);
void rnnd__engine_run_checkpoint(struct rnnd_engine *e, struct rnnd_job *job);
int rnnd__engine_checkpoint_auto(struct rnnd_engine *e, const char *why);
void rnnd__engine_running_marker(const struct rnnd_engine *e, char *path, size_t cap);

#endif // RNND_ENGINE_IMPL_H
