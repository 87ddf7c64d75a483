/*
 * engine.c: the engine thread and everything it owns (see engine.h).
 *
 * Memory: the backend's memory (host for cpu, device for cuda) holds the weights versions, the
 * gradient buffers, Adam's moments, the env state tables (S, L, H), the trajectory store (every
 * env slot's recorded steps, trajectory.h) and the step buffers sized for --max-batch rows;
 * Forward and Backward work in one block reused from call to call, except a Forward that keeps
 * its tape, whose block the tape owns (the last released tape's, when it fits). Host memory
 * holds the env table (with each env's ring position in the store) and page-locked staging
 * copies of the step buffers and of the Forward/Backward blocks' inputs and outputs, so that a
 * call costs one copy each way (for the cpu backend the staging buffers are the blocks
 * themselves). Recorded steps come to the host only when a Forward returns them to its client
 * or a checkpoint is taken.
 *
 * Weights are versioned objects with reference counts: the engine holds the current one, a tape
 * holds the one its Forward used (so Backward differentiates the same weights). ApplyGradients
 * and SetWeights build the next version in a spare buffer and swap it in between two jobs, so
 * a batch never sees two versions; with no tapes pinning old versions this is a double buffer.
 *
 * Replicas (group.c): engines that share a communicator hold the same weights, bit for bit. They
 * change them only in collective jobs that every replica runs in the same order from the same
 * inputs: ApplyGradients sums the accumulated gradients over the replicas (their last float
 * counts the replicas that have any, so all agree on whether there is anything to apply) or
 * takes sent ones from the host or a broadcast, SetWeights likewise, and the start-up sync
 * broadcasts replica 0's state. Deterministic kernels on identical devices then keep the copies
 * identical; GetWeights on several devices compares them.
 */
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "envtable.h"
#include "place.h"
#include "log.h"
#include "metrics.h"
#include "tape.h"
#include "trajectory.h"

#define CARVE_ALIGN 256
// Automatic checkpoints kept in --state-dir/auto (named ones are never removed).
#define AUTO_CHECKPOINTS_KEPT 3

struct weights {
    int refs;
    uint64_t version;
    float *params;        // (P) backend memory
    struct weights *next; // free list
};

// A Forward kept for Backward: its inputs, its weights and the backend's tape, in one block.
struct tape_obj {
    struct weights *w;
    int B, T;
    int B_all;     // rows of the whole Forward (B, unless this is a part)
    int32_t *rows; // (B) host: a part's rows within the whole Forward, or NULL
    bool has_h0, has_hidden;
    void *block;          // backend memory, block_bytes of it
    size_t block_bytes;
    float *x;             // (B, T, I)
    uint8_t *is_init;     // (B, T)
    float *h0, *c0;       // (B, L, H) or NULL
    float *hidden, *cell; // (B, T, L, H) or NULL
    void *tape;
};

struct row_ref {
    struct rnnd_job *job;
    int row;
};

struct rnnd_engine {
    struct rnnd_config cfg;
    int index, count;            // this engine's device among the daemon's (rnnd_place)
    // --state-dir as given; cfg.state_dir is this device's own directory inside it (device-N)
    // when there are several devices.
    char top_dir[RNND_CONFIG_PATH_MAX];
    struct rnnd_comm *local;     // this daemon's engines (Backward parts), or NULL
    struct rnnd_comm *replicas;  // every replica of the weights (may be local), or NULL
    // What this engine last added to the daemon-wide gauges, to which every engine adds its own.
    int64_t pub_envs, pub_tapes, pub_tape_bytes, pub_queue, pub_store;
    struct rnnd_model model;
    size_t P, LH;
    bool lstm;
    struct rnnd_backend be;
    bool host_mem; // the backend's memory is host memory: no staging copies
    struct rnnd_batcher *batcher;

    pthread_t thread;
    bool thread_started;
    rnnd_engine_ready_cb ready_cb;
    void *ready_ctx;
    // The engine lock: whoever holds it acts as the engine (owns everything below). The engine
    // thread holds it while it works; with the CPU backend another thread may take it to run a
    // Step batch while the engine thread sleeps (inline_steps). CUDA work always stays on the
    // engine thread, which owns the device.
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
    float *adam_m, *adam_v; // (P), Adam only
    int64_t optim_t;
    // Two rows per env slot s, s and s + S: a step reads the env's current row (env->half) and
    // writes the other (struct rnnd_step), then flips env->half.
    float *state_h, *state_c; // (2S, L, H)
    // A batch's inputs (x, slots, slots_new, is_init; extras, store rows and versions when it is
    // recorded) and outputs (out; h_before, c_before, which stay on the backend) each sit packed
    // in one block, laid out for the batch's row count (step_layout), so that a batch costs one
    // copy in and one copy out. Sized for --max-batch rows.
    char *d_in, *d_outb;
    size_t in_bytes, out_bytes;
    // Host staging (aliases of the above when host_mem).
    char *h_in, *h_outb;
    struct row_ref *rows; // (max_batch)
    // Every env slot's recorded steps (trajectory.h), when --trajectory-steps > 0.
    struct rnnd_traj_store store;
    void *d_store;
    size_t store_bytes;
    // Page-locked staging of Forward and Backward inputs and outputs (not with host_mem: those
    // use their backend block in place), grown on demand.
    char *xfer;
    size_t xfer_bytes;
    // Backend memory of the calls that keep nothing past their reply (work_reserve).
    void *work;
    size_t work_bytes;
    // The block of the last tape released, for the next tape (tape_block_alloc).
    void *spare_tape;
    size_t spare_tape_bytes;

    struct rnnd_envtable *envs;
    int envs_reserved;          // slots promised to the new envs of held Step parts
    struct rnnd_job *ends_held; // EndEpisodes waiting for held envs (run_end), in arrival order
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
    pthread_mutex_t rlock;
    pthread_cond_t rcond;
    struct rnnd_job *rhead, *rtail;
    bool rstop;
    pthread_t rthreads[8];
    int nrthreads;

    // Row workers: help the engine with a big batch's per-row copies and recording.
    pthread_mutex_t wlock;
    pthread_cond_t wcond; // new task (wgen), or a worker finished (wbusy)
    struct row_task *wtask;
    uint64_t wgen;
    int wbusy;
    bool wstop;
    pthread_t wthreads[8];
    int nwthreads;

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

static void *carve(struct carve *c, size_t bytes) {
    size_t at = (c->used + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
    c->used = at + bytes;
    return c->base ? c->base + at : NULL;
}

static int be_alloc(struct rnnd_engine *e, size_t bytes, void **out) {
    *out = NULL;
    return e->be.ops->alloc(e->be.ctx, bytes ? bytes : 1, out);
}

static void be_free(struct rnnd_engine *e, void *p) {
    if (p)
        e->be.ops->free(e->be.ctx, p);
}

static int be_in(struct rnnd_engine *e, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src)
        return 0;
    return e->be.ops->copy_in(e->be.ctx, dst, src, bytes);
}

static int be_out(struct rnnd_engine *e, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src)
        return 0;
    return e->be.ops->copy_out(e->be.ctx, dst, src, bytes);
}

// Adds this engine's change of a gauge that every engine of the daemon contributes to.
static void publish(_Atomic int64_t *gauge, int64_t *mine, int64_t now) {
    atomic_fetch_add_explicit(gauge, now - *mine, memory_order_relaxed);
    *mine = now;
}

// ---------------------------------------------------------------------------------------------
// Weights versions

static struct weights *weights_new(struct rnnd_engine *e) {
    struct weights *w = e->spare;
    if (w) {
        e->spare = w->next;
        w->next = NULL;
        w->refs = 1;
        return w;
    }
    w = calloc(1, sizeof(*w));
    if (w == NULL)
        return NULL;
    if (be_alloc(e, e->P * sizeof(float), (void **)&w->params) != 0) {
        free(w);
        return NULL;
    }
    w->refs = 1;
    return w;
}

static void weights_unref(struct rnnd_engine *e, struct weights *w) {
    if (w == NULL || --w->refs > 0)
        return;
    if (e->spare == NULL) { // keep one spare: the other half of the double buffer
        w->next = NULL;
        e->spare = w;
        return;
    }
    be_free(e, w->params);
    free(w);
}

// Makes w the served version (taking over the caller's reference).
static void weights_swap(struct rnnd_engine *e, struct weights *w) {
    uint64_t v = atomic_load(&e->version) + 1;
    w->version = v;
    struct weights *old = e->cur;
    e->cur = w;
    weights_unref(e, old);
    atomic_store(&e->version, v);
    atomic_store_explicit(&rnnd_metrics.model_version, v, memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Tapes

// A learner's Forwards keep tapes of one size, one after the other: the block of a tape that is
// done is kept for the next one (a fresh block would cost a cudaMalloc and a synchronising
// cudaFree, or on the CPU a page fault per 4 KB touched).
static void tape_block_free(struct rnnd_engine *e, void *block, size_t bytes) {
    if (bytes > e->spare_tape_bytes) {
        be_free(e, e->spare_tape);
        e->spare_tape = block;
        e->spare_tape_bytes = bytes;
    } else {
        be_free(e, block);
    }
}

// A block of at least bytes for a tape: the spare one when it is not more than twice as big.
static int tape_block_alloc(struct rnnd_engine *e, size_t bytes, void **out, size_t *got) {
    if (e->spare_tape && e->spare_tape_bytes >= bytes && e->spare_tape_bytes / 2 <= bytes) {
        *out = e->spare_tape;
        *got = e->spare_tape_bytes;
        e->spare_tape = NULL;
        e->spare_tape_bytes = 0;
        return 0;
    }
    *got = bytes;
    return be_alloc(e, bytes, out);
}

static void tape_release(void *ctx, void *p) {
    struct rnnd_engine *e = ctx;
    struct tape_obj *t = p;
    tape_block_free(e, t->block, t->block_bytes);
    weights_unref(e, t->w);
    free(t->rows);
    free(t);
}

static void tape_gauges(struct rnnd_engine *e) {
    publish(&rnnd_metrics.tapes, &e->pub_tapes, rnnd_tapes_count(e->tapes));
    publish(&rnnd_metrics.tape_bytes, &e->pub_tape_bytes, (int64_t)rnnd_tapes_bytes(e->tapes));
}

// ---------------------------------------------------------------------------------------------
// Envs

static void env_drop(struct rnnd_engine *e, struct rnnd_env *env, enum rnnd_evict_reason why) {
    rnnd_envtable_remove(e->envs, env);
    atomic_fetch_add_explicit(&rnnd_metrics.evictions[why], 1, memory_order_relaxed);
}

static void env_gauges(struct rnnd_engine *e) {
    int n = rnnd_envtable_count(e->envs);
    atomic_store(&e->envs_active, (uint64_t)n);
    publish(&rnnd_metrics.envs_active, &e->pub_envs, n);
}

// ---------------------------------------------------------------------------------------------
// Start-up

static int engine_restore(struct rnnd_engine *e, char *msg, size_t msglen);
static void env_gauges(struct rnnd_engine *e);

// Where a batch of n rows keeps its inputs and outputs inside the packed blocks (see
// struct rnnd_engine): the same offsets on the host and on the device. When steps are recorded
// the input block also carries each row's extras, store row and model version, and the output
// block the state each row started from: the backend records the rows from there (traj_write)
// and only `out` comes back.
struct step_layout {
    size_t x, slots, slots_new, init, extras, trows, version, in_used; // in the input block
    size_t out, out_used; // in the output block: out_used covers what is copied back
    size_t hb, cb, out_all;
};

// Offset of a new aligned piece of `bytes` after *used.
static size_t carve_off(size_t *used, size_t bytes) {
    size_t at = (*used + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
    *used = at + bytes;
    return at;
}

static struct step_layout step_layout(const struct rnnd_engine *e, int n) {
    struct step_layout l = {0};
    bool record = e->tdims.cap > 0;
    size_t in = 0, out = 0, rows = (size_t)n, E = (size_t)e->tdims.E;
    l.x = carve_off(&in, rows * (size_t)e->model.I * sizeof(float));
    l.slots = carve_off(&in, rows * sizeof(int32_t));
    l.slots_new = carve_off(&in, rows * sizeof(int32_t));
    l.init = carve_off(&in, rows);
    if (record) {
        l.extras = E ? carve_off(&in, rows * E * sizeof(float)) : 0;
        l.trows = carve_off(&in, rows * sizeof(int32_t));
        l.version = carve_off(&in, rows * sizeof(uint64_t));
    }
    l.in_used = in;
    l.out = carve_off(&out, rows * (size_t)e->model.H * sizeof(float));
    l.out_used = out;
    if (record) {
        l.hb = carve_off(&out, rows * e->LH * sizeof(float));
        l.cb = e->lstm ? carve_off(&out, rows * e->LH * sizeof(float)) : 0;
    }
    l.out_all = out;
    return l;
}

// The trajectory store for every env slot, in the backend's memory (trajectory.h).
static int store_open(struct rnnd_engine *e, char *msg, size_t msglen) {
    const struct rnnd_config *c = &e->cfg;
    if (e->tdims.cap == 0)
        return 0;
    size_t row = rnnd_traj_row_bytes(&e->tdims);
    size_t bytes = rnnd_traj_layout(&e->store, &e->tdims, c->max_envs, NULL);
    if (bytes == 0) {
        snprintf(msg, msglen,
                 "the trajectory store would have %lld rows (--max-envs %d x --trajectory-steps "
                 "%d), more than %d; lower --max-envs or --trajectory-steps",
                 (long long)c->max_envs * c->trajectory_steps, c->max_envs, c->trajectory_steps,
                 INT32_MAX);
        return RNND_EINVAL;
    }
    int rc = e->be.ops->alloc_lazy(e->be.ctx, bytes, &e->d_store);
    if (rc != 0) {
        e->d_store = NULL;
        snprintf(msg, msglen,
                 "cannot allocate the trajectory store on the %s backend (%s): %.2f GiB = "
                 "--max-envs %d x --trajectory-steps %d x %zu bytes a step; lower --max-envs or "
                 "--trajectory-steps (0 records nothing)",
                 e->backend_name, rnnd_strerror(rc), (double)bytes / (1 << 30), c->max_envs,
                 c->trajectory_steps, row);
        return rc;
    }
    e->store_bytes = bytes;
    rnnd_traj_layout(&e->store, &e->tdims, c->max_envs, e->d_store);
    publish(&rnnd_metrics.traj_store_bytes, &e->pub_store, (int64_t)bytes);
    return 0;
}

static int engine_open(struct rnnd_engine *e, char *msg, size_t msglen) {
    const struct rnnd_config *c = &e->cfg;
    int rc;
    if (c->backend == RNND_BACKEND_CUDA || c->backend == RNND_BACKEND_AUTO) {
        rc = rnnd_backend_cuda_init(&e->be, c->device);
        if (rc != 0) {
            if (c->backend == RNND_BACKEND_CUDA) {
                snprintf(msg, msglen,
                         "--backend cuda: no usable CUDA device %d (%s)%s; use --backend cpu",
                         c->device, rnnd_strerror(rc),
                         rc == RNND_ENOTSUP ? ", this build has no CUDA backend" : "");
                return rc;
            }
            rnnd_log(RNND_LOG_INFO, "no usable CUDA device (%s): using the cpu backend",
                     rnnd_strerror(rc));
        }
    }
    if (e->be.ops == NULL) {
        rc = rnnd_backend_cpu_init(&e->be);
        if (rc != 0) {
            snprintf(msg, msglen, "cpu backend: %s", rnnd_strerror(rc));
            return rc;
        }
    }
    snprintf(e->backend_name, sizeof(e->backend_name), "%s", e->be.ops->name);
    snprintf(e->device, sizeof(e->device), "%s", e->be.device);
    e->host_mem = (e->be.ops->caps & RNND_BACKEND_CAP_HOST_MEMORY) != 0;
    rc = e->be.ops->supports(e->be.ctx, &e->model);
    if (rc != 0) {
        snprintf(msg, msglen, "the %s backend does not run %s I=%d H=%d L=%d compute=%s (%s)",
                 e->backend_name, rnnd_config_cell_name(e->model.cell), e->model.I, e->model.H,
                 e->model.L, rnnd_config_compute_name(e->model.compute), rnnd_strerror(rc));
        return rc;
    }
    e->be.ops->plan_name(e->be.ctx, &e->model, c->max_batch, e->plan, sizeof(e->plan));

    size_t P = e->P, LH = e->LH, S = (size_t)c->max_envs, MB = (size_t)c->max_batch;
    const char *what = "weights";
    float *init = malloc(P * sizeof(float));
    e->cur = init ? weights_new(e) : NULL;
    if (e->cur == NULL)
        goto oom;
    rnnd_model_init_params(&e->model, c->seed, init);
    rc = be_in(e, e->cur->params, init, P * sizeof(float));
    free(init);
    if (rc != 0)
        goto fail_rc;
    e->cur->version = 0;

    what = "gradient buffers";
    if (be_alloc(e, (P + 1) * sizeof(float), (void **)&e->grad_accum) != 0 ||
        be_alloc(e, (P + 1) * sizeof(float), (void **)&e->grad_scratch) != 0)
        goto oom;
    e->be.ops->zero(e->be.ctx, e->grad_accum, (P + 1) * sizeof(float));
    if (c->optimizer == RNND_OPTIM_ADAM) {
        what = "Adam moments";
        if (be_alloc(e, P * sizeof(float), (void **)&e->adam_m) != 0 ||
            be_alloc(e, P * sizeof(float), (void **)&e->adam_v) != 0)
            goto oom;
        e->be.ops->zero(e->be.ctx, e->adam_m, P * sizeof(float));
        e->be.ops->zero(e->be.ctx, e->adam_v, P * sizeof(float));
    }
    what = "env state table (lower --max-envs)";
    if (be_alloc(e, 2 * S * LH * sizeof(float), (void **)&e->state_h) != 0)
        goto oom;
    if (e->lstm && be_alloc(e, 2 * S * LH * sizeof(float), (void **)&e->state_c) != 0)
        goto oom;
    rc = store_open(e, msg, msglen);
    if (rc != 0)
        return rc;
    what = "step buffers (lower --max-batch)";
    struct step_layout most = step_layout(e, (int)MB);
    e->in_bytes = most.in_used;
    e->out_bytes = most.out_all;
    if (be_alloc(e, e->in_bytes, (void **)&e->d_in) != 0 ||
        be_alloc(e, e->out_bytes, (void **)&e->d_outb) != 0)
        goto oom;
    if (e->host_mem) {
        e->h_in = e->d_in;
        e->h_outb = e->d_outb;
    } else if (e->be.ops->host_alloc(e->be.ctx, e->in_bytes, (void **)&e->h_in) != 0 ||
               e->be.ops->host_alloc(e->be.ctx, e->out_bytes, (void **)&e->h_outb) != 0) {
        goto oom;
    }
    e->rows = malloc(MB * sizeof(*e->rows));
    what = "env table (lower --max-envs)";
    e->envs = rnnd_envtable_init(c->max_envs, e->model.H);
    e->tapes = rnnd_tapes_init((size_t)c->tape_memory_mb << 20,
                               (uint64_t)c->tape_ttl_s * 1000000000ull, tape_release, e);
    if (e->rows == NULL || e->envs == NULL || e->tapes == NULL)
        goto oom;
    e->last_checkpoint_ns = rnnd_now_ns();
    atomic_store_explicit(&rnnd_metrics.model_version, 0, memory_order_relaxed);
    return engine_restore(e, msg, msglen);
oom:
    rc = RNND_ENOMEM;
fail_rc:
    snprintf(msg, msglen, "cannot set up the %s on the %s backend: %s", what, e->backend_name,
             rnnd_strerror(rc));
    return rc;
}

static void engine_close(struct rnnd_engine *e) {
    if (e->be.ops == NULL)
        return;
    if (e->replicas != e->local)
        rnnd_comm_free(e->replicas);
    rnnd_comm_free(e->local);
    e->local = e->replicas = NULL;
    rnnd_tapes_free(e->tapes); // releases tapes (and their weights references)
    e->tapes = NULL;
    rnnd_envtable_free(e->envs);
    e->envs = NULL;
    weights_unref(e, e->cur);
    e->cur = NULL;
    while (e->spare) {
        struct weights *w = e->spare;
        e->spare = w->next;
        be_free(e, w->params);
        free(w);
    }
    void *bufs[] = {e->grad_accum, e->grad_scratch, e->adam_m, e->adam_v, e->state_h,
                    e->state_c,    e->d_in,         e->d_outb, e->work,  e->spare_tape};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        be_free(e, bufs[i]);
    if (!e->host_mem) {
        e->be.ops->host_free(e->be.ctx, e->h_in);
        e->be.ops->host_free(e->be.ctx, e->h_outb);
    }
    e->be.ops->host_free(e->be.ctx, e->xfer);
    e->be.ops->free_lazy(e->be.ctx, e->d_store, e->store_bytes);
    publish(&rnnd_metrics.traj_store_bytes, &e->pub_store, 0);
    free(e->rows);
    rnnd_backend_free(&e->be);
}

// ---------------------------------------------------------------------------------------------
// Step batches

// A refused Step: its vote, when it is a part.
static enum rnnd_batch_admit step_refuse(struct rnnd_step_job *s) {
    if (s->vote)
        rnnd_step_vote_cast(s->vote, false);
    return RNND_BATCH_REJECT;
}

// Gives the new envs of an admitted Step (envs[r] NULL) their slots.
static void step_add_envs(struct rnnd_engine *e, struct rnnd_step_job *s) {
    uint64_t now = rnnd_now_ns();
    for (int r = 0; r < s->B; r++) {
        if (s->envs[r] == NULL) {
            int rc = rnnd_envtable_add(e->envs, s->env_ids[r], now, &s->envs[r]);
            RNND_ASSERT(rc == 0);
        }
    }
}

// A held part, offered again: waits while the vote is open, then runs or gives back what it
// reserved (struct rnnd_step_vote). Nothing it checked can have changed meanwhile: its envs are
// held and its new envs' slots reserved.
static enum rnnd_batch_admit step_part_decide(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_step_job *s = &job->step;
    if (atomic_load(&s->vote->left) > 0)
        return RNND_BATCH_HOLD;
    s->held = false;
    int fresh = 0;
    for (int r = 0; r < s->B; r++) {
        if (s->envs[r])
            s->envs[r]->held = false;
        else
            fresh++;
    }
    e->envs_reserved -= fresh;
    if (atomic_load(&s->vote->refused)) {
        job->err = 0; // another part was refused: that one says why
        return RNND_BATCH_REJECT;
    }
    if (fresh)
        step_add_envs(e, s);
    return RNND_BATCH_ADMIT;
}

static enum rnnd_batch_admit admit_step(void *ctx, struct rnnd_batch_item *item) {
    struct rnnd_engine *e = ctx;
    struct rnnd_job *job = (struct rnnd_job *)item;
    struct rnnd_step_job *s = &job->step;
    if (s->held)
        return step_part_decide(e, job);
    if (job->cancelled && atomic_load(job->cancelled)) {
        rnnd_job_fail(job, RNND_ECANCELED, "the client cancelled the call before its step ran");
        return step_refuse(s);
    }
    int fresh = 0;
    for (int r = 0; r < s->B; r++) {
        struct rnnd_env *env = rnnd_envtable_find(e->envs, s->env_ids[r]);
        s->envs[r] = env;
        s->repeat[r] = 0;
        if (env == NULL) {
            if (!s->is_init[r]) {
                rnnd_job_fail(
                    job, RNND_EPRECOND,
                    "env %" PRIu64 " (row %d) has no state: it is new, was ended by "
                    "EndEpisodes, or was evicted after --env-idle-timeout-s %d s idle; send "
                    "is_init=true for its first step",
                    s->env_ids[r], r, e->cfg.env_idle_timeout_s);
                return step_refuse(s);
            }
            fresh++;
            continue;
        }
        if (s->step_index && env->has_index) {
            uint64_t si = s->step_index[r];
            if (si == env->last_index) {
                s->repeat[r] = 1;
            } else if (si != env->last_index + 1) {
                rnnd_job_fail(
                    job, RNND_EPRECOND,
                    "env %" PRIu64 " (row %d): step_index %" PRIu64
                    " but its last step was %" PRIu64 "; send %" PRIu64
                    " for the next step or %" PRIu64
                    " to repeat the last one (or is_init with EndEpisodes first to restart)",
                    s->env_ids[r], r, si, env->last_index, env->last_index + 1, env->last_index);
                return step_refuse(s);
            }
        }
    }
    int free_slots =
        rnnd_envtable_capacity(e->envs) - rnnd_envtable_count(e->envs) - e->envs_reserved;
    if (fresh > free_slots) {
        rnnd_metrics_limit_hit(RNND_LIMIT_ENVS);
        rnnd_job_fail(job, RNND_EFULL,
                      "env table full: %d new envs but %d of --max-envs %d slots free; send "
                      "EndEpisodes for finished envs or raise --max-envs",
                      fresh, free_slots, rnnd_envtable_capacity(e->envs));
        return step_refuse(s);
    }
    if (s->vote) {
        // A part: hold what it checked until every part has voted.
        s->held = true;
        for (int r = 0; r < s->B; r++)
            if (s->envs[r])
                s->envs[r]->held = true;
        e->envs_reserved += fresh;
        rnnd_step_vote_cast(s->vote, true);
        return step_part_decide(e, job);
    }
    if (fresh)
        step_add_envs(e, s);
    return RNND_BATCH_ADMIT;
}

// The state tables' row that holds env's state, and the one its next step writes.
static size_t env_row(const struct rnnd_engine *e, const struct rnnd_env *env) {
    return (size_t)env->slot + (env->half ? (size_t)e->cfg.max_envs : 0);
}
static size_t env_row_next(const struct rnnd_engine *e, const struct rnnd_env *env) {
    return (size_t)env->slot + (env->half ? 0 : (size_t)e->cfg.max_envs);
}

// The per-row work after a step that needs no engine-wide state: copy the row's output to its
// job (and to its env's cache for retries).
struct row_task {
    struct rnnd_engine *e;
    int n;
    const float *h_out;
    _Atomic int next; // next chunk's first row
    _Atomic int done; // rows finished
};

#define ROW_CHUNK        64
#define ROW_PARALLEL_MIN 256 // fewer rows: one thread is quicker than waking others

static void rows_run(struct row_task *t) {
    struct rnnd_engine *e = t->e;
    size_t H = (size_t)e->model.H;
    for (;;) {
        int first = atomic_fetch_add(&t->next, ROW_CHUNK);
        if (first >= t->n)
            return;
        int last = first + ROW_CHUNK < t->n ? first + ROW_CHUNK : t->n;
        for (int i = first; i < last; i++) {
            struct rnnd_step_job *s = &e->rows[i].job->step;
            int r = e->rows[i].row;
            struct rnnd_env *env = s->envs[r];
            const float *out = t->h_out + (size_t)i * H;
            memcpy(s->out + (size_t)r * H, out, H * sizeof(float));
            if (s->step_index)
                memcpy(rnnd_envtable_output(e->envs, env), out, H * sizeof(float));
        }
        atomic_fetch_add(&t->done, last - first);
    }
}

static void *row_worker_main(void *arg) {
    struct rnnd_engine *e = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&e->wlock);
    for (;;) {
        // A task counts once (wgen) and only while the engine still publishes it (wtask).
        while ((e->wgen == seen || e->wtask == NULL) && !e->wstop)
            pthread_cond_wait(&e->wcond, &e->wlock);
        if (e->wstop)
            break;
        seen = e->wgen;
        struct row_task *t = e->wtask;
        e->wbusy++;
        pthread_mutex_unlock(&e->wlock);
        rows_run(t);
        pthread_mutex_lock(&e->wlock);
        if (--e->wbusy == 0)
            pthread_cond_broadcast(&e->wcond);
    }
    pthread_mutex_unlock(&e->wlock);
    return NULL;
}

// Runs t over all its rows, with the row workers when there are many, and returns when every
// row is done (the task lives on the caller's stack).
static void rows_parallel(struct rnnd_engine *e, struct row_task *t) {
    if (e->nwthreads == 0 || t->n < ROW_PARALLEL_MIN) {
        rows_run(t);
        return;
    }
    pthread_mutex_lock(&e->wlock);
    e->wtask = t;
    e->wgen++;
    pthread_cond_broadcast(&e->wcond);
    pthread_mutex_unlock(&e->wlock);
    rows_run(t);
    // Every row is claimed; wait until the workers have finished theirs and let go of t.
    pthread_mutex_lock(&e->wlock);
    while (atomic_load(&t->done) < t->n || e->wbusy > 0)
        pthread_cond_wait(&e->wcond, &e->wlock);
    e->wtask = NULL;
    pthread_mutex_unlock(&e->wlock);
}

static void row_workers_start(struct rnnd_engine *e, int n) {
    for (int k = 0; k < n && k < (int)(sizeof(e->wthreads) / sizeof(e->wthreads[0])); k++) {
        if (pthread_create(&e->wthreads[k], NULL, row_worker_main, e) != 0)
            break;
        e->nwthreads++;
    }
}

static void row_workers_stop(struct rnnd_engine *e) {
    pthread_mutex_lock(&e->wlock);
    e->wstop = true;
    pthread_cond_broadcast(&e->wcond);
    pthread_mutex_unlock(&e->wlock);
    for (int k = 0; k < e->nwthreads; k++)
        pthread_join(e->wthreads[k], NULL);
    e->nwthreads = 0;
}

static void run_step_batch(struct rnnd_engine *e, struct rnnd_job *jobs) {
    uint64_t now = rnnd_now_ns();
    size_t I = (size_t)e->model.I, H = (size_t)e->model.H, LH = e->LH;
    size_t E = (size_t)e->tdims.E;
    bool record = e->tdims.cap > 0;
    uint64_t version = e->cur->version;
    int n = 0;
    for (struct rnnd_job *job = jobs; job; job = (struct rnnd_job *)job->item.next)
        for (int r = 0; r < job->step.B; r++)
            n += !job->step.repeat[r];
    struct step_layout lay = step_layout(e, n);
    float *h_x = (float *)(e->h_in + lay.x), *h_out = (float *)(e->h_outb + lay.out);
    int32_t *h_slots = (int32_t *)(e->h_in + lay.slots);
    int32_t *h_slots_new = (int32_t *)(e->h_in + lay.slots_new);
    uint8_t *h_init = (uint8_t *)(e->h_in + lay.init);
    float *h_extras = (float *)(e->h_in + lay.extras);
    int32_t *h_trows = (int32_t *)(e->h_in + lay.trows);
    uint64_t *h_version = (uint64_t *)(e->h_in + lay.version);
    n = 0;
    for (struct rnnd_job *job = jobs; job; job = (struct rnnd_job *)job->item.next) {
        struct rnnd_step_job *s = &job->step;
        rnnd_histogram_observe(&rnnd_metrics.queue_delay, now - job->item.enqueued_ns);
        for (int r = 0; r < s->B; r++) {
            if (s->repeat[r])
                continue;
            struct rnnd_env *env = s->envs[r];
            memcpy(h_x + (size_t)n * I, s->obs + (size_t)r * I, I * sizeof(float));
            h_init[n] = s->is_init[r];
            h_slots[n] = (int32_t)env_row(e, env);
            h_slots_new[n] = (int32_t)env_row_next(e, env);
            if (record) {
                // Where the step is recorded: the env's next ring position (taken only once
                // the step has run, below). Envs are unique in a batch, so are these rows.
                h_trows[n] = rnnd_traj_next(&env->traj, &e->tdims, env->slot);
                h_version[n] = version;
                if (E && s->extras)
                    memcpy(h_extras + (size_t)n * E, s->extras + (size_t)r * E, E * sizeof(float));
                else if (E)
                    memset(h_extras + (size_t)n * E, 0, E * sizeof(float));
            }
            e->rows[n] = (struct row_ref){job, r};
            n++;
        }
    }
    int rc = 0;
    uint64_t t_kernel = rnnd_now_ns();
    atomic_fetch_add_explicit(&rnnd_metrics.engine_ns[RNND_PHASE_GATHER], t_kernel - now,
                              memory_order_relaxed);
    if (n > 0) {
        uint64_t t0 = t_kernel;
        rc = be_in(e, e->d_in, e->h_in, lay.in_used); // one copy: x, slots, slots_new, is_init
        struct rnnd_step st = {
            .B = n,
            .x = (const float *)(e->d_in + lay.x),
            .is_init = (const uint8_t *)(e->d_in + lay.init),
            .slots = (const int32_t *)(e->d_in + lay.slots),
            .slots_new = (const int32_t *)(e->d_in + lay.slots_new),
            .state_h = e->state_h,
            .state_c = e->state_c,
            .out = (float *)(e->d_outb + lay.out),
            .h_before = record ? (float *)(e->d_outb + lay.hb) : NULL,
            .c_before = record && e->lstm ? (float *)(e->d_outb + lay.cb) : NULL,
        };
        if (rc == 0)
            rc = e->be.ops->rnn_step(e->be.ctx, &st, e->cur->params, &e->model);
        if (rc == 0 && record) {
            // The step's rows go into the store where they are, on the backend.
            struct rnnd_traj_rows tr = {
                .n = n,
                .rows = (const int32_t *)(e->d_in + lay.trows),
                .obs = (float *)st.x,
                .extras = E ? (float *)(e->d_in + lay.extras) : NULL,
                .h = st.h_before,
                .c = st.c_before,
                .is_init = (uint8_t *)st.is_init,
                .version = (uint64_t *)(e->d_in + lay.version),
            };
            rc = e->be.ops->traj_write(e->be.ctx, &e->store, &tr, &e->model);
        }
        if (rc == 0) // one copy back: out; copy_out synchronises
            rc = be_out(e, e->h_outb, e->d_outb, lay.out_used);
        rnnd_metrics_kernel(RNND_OP_STEP, rnnd_now_ns() - t0);
        atomic_fetch_add_explicit(&rnnd_metrics.batches, 1, memory_order_relaxed);
        rnnd_histogram_observe(&rnnd_metrics.batch_rows, (uint64_t)n);
        atomic_fetch_add_explicit(&rnnd_metrics.env_steps, (uint64_t)n, memory_order_relaxed);
    }
    if (rc != 0) {
        // A store row may have been written by now (where a full ring keeps its oldest step):
        // only a device failure gets that far, and it ends the daemon.
        if (rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "backend step failed: %s", rnnd_strerror(rc));
        rnnd_log(RNND_LOG_ERROR, "backend step of %d rows failed: %s", n, rnnd_strerror(rc));
    }
    // Per computed row: the env's bookkeeping (here: its state row, its ring of recorded steps),
    // then its output row and cached output (rows touch disjoint memory: split across the row
    // workers when there are many).
    uint64_t t_update = rnnd_now_ns();
    for (int i = 0; rc == 0 && i < n; i++) {
        struct rnnd_step_job *s = &e->rows[i].job->step;
        int r = e->rows[i].row;
        struct rnnd_env *env = s->envs[r];
        env->half ^= 1; // its new state is in the other row now
        if (record)
            rnnd_traj_push(&env->traj, &e->tdims);
        rnnd_envtable_touch(e->envs, env, now);
        if (s->step_index) {
            env->has_index = true;
            env->last_index = s->step_index[r];
            env->out_version = version;
        } else {
            env->has_index = false;
        }
    }
    if (rc == 0) {
        struct row_task t = {.e = e, .n = n, .h_out = h_out};
        rows_parallel(e, &t);
    }
    // Gauges first: a client that reads them after its reply sees its envs.
    env_gauges(e);
    // Per job: repeated rows from the cache, states when asked (engine state: this thread).
    int njobs = 0;
    for (struct rnnd_job *job = jobs; job; job = (struct rnnd_job *)job->item.next) {
        struct rnnd_step_job *s = &job->step;
        job->model_version = version;
        njobs++;
        if (rc != 0) {
            rnnd_job_fail(job, RNND_EDEVICE, "the backend failed to run the step: %s; retry",
                          rnnd_strerror(rc));
            continue;
        }
        for (int r = 0; r < s->B; r++) {
            struct rnnd_env *env = s->envs[r];
            if (s->repeat[r]) {
                memcpy(s->out + (size_t)r * H, rnnd_envtable_output(e->envs, env),
                       H * sizeof(float));
                rnnd_envtable_touch(e->envs, env, now);
            }
            if (s->return_state) {
                size_t off = env_row(e, env) * LH;
                be_out(e, s->h + (size_t)r * LH, e->state_h + off, LH * sizeof(float));
                if (e->lstm)
                    be_out(e, s->c + (size_t)r * LH, e->state_c + off, LH * sizeof(float));
            }
        }
        job->err = 0;
    }
    uint64_t t_reply = rnnd_now_ns();
    atomic_fetch_add_explicit(&rnnd_metrics.engine_ns[RNND_PHASE_UPDATE], t_reply - t_update,
                              memory_order_relaxed);
    // Then the replies: several go to the reply threads, one is quicker sent from here.
    if (njobs > 1 && e->nrthreads > 0) {
        pthread_mutex_lock(&e->rlock);
        if (e->rtail)
            e->rtail->item.next = &jobs->item;
        else
            e->rhead = jobs;
        struct rnnd_job *last = jobs;
        while (last->item.next)
            last = (struct rnnd_job *)last->item.next;
        e->rtail = last;
        pthread_cond_broadcast(&e->rcond);
        pthread_mutex_unlock(&e->rlock);
    } else {
        struct rnnd_job *next;
        for (struct rnnd_job *job = jobs; job; job = next) {
            next = (struct rnnd_job *)job->item.next;
            job->done(job);
        }
    }
    atomic_fetch_add_explicit(&rnnd_metrics.engine_ns[RNND_PHASE_REPLY], rnnd_now_ns() - t_reply,
                              memory_order_relaxed);
}

static void *reply_main(void *arg) {
    struct rnnd_engine *e = arg;
    pthread_mutex_lock(&e->rlock);
    for (;;) {
        struct rnnd_job *job = e->rhead;
        if (job == NULL) {
            if (e->rstop)
                break;
            pthread_cond_wait(&e->rcond, &e->rlock);
            continue;
        }
        e->rhead = (struct rnnd_job *)job->item.next;
        if (e->rhead == NULL)
            e->rtail = NULL;
        pthread_mutex_unlock(&e->rlock);
        job->done(job);
        pthread_mutex_lock(&e->rlock);
    }
    pthread_mutex_unlock(&e->rlock);
    return NULL;
}

static void reply_threads_start(struct rnnd_engine *e, int n) {
    for (int k = 0; k < n && k < (int)(sizeof(e->rthreads) / sizeof(e->rthreads[0])); k++) {
        if (pthread_create(&e->rthreads[k], NULL, reply_main, e) != 0)
            break;
        e->nrthreads++;
    }
}

// Sends what is queued, then ends the reply threads.
static void reply_threads_stop(struct rnnd_engine *e) {
    pthread_mutex_lock(&e->rlock);
    e->rstop = true;
    pthread_cond_broadcast(&e->rcond);
    pthread_mutex_unlock(&e->rlock);
    for (int k = 0; k < e->nrthreads; k++)
        pthread_join(e->rthreads[k], NULL);
    e->nrthreads = 0;
}

// ---------------------------------------------------------------------------------------------
// Agreement

// Engines that run one collective job (the replicas, or this daemon's engines) agree before any
// of them changes state that every one of them can go on, so that the job is done everywhere or
// nowhere (engine.h).
struct agreement {
    struct rnnd_comm *comm; // NULL: this engine alone
    bool done;              // agree ran
    bool all;               // every engine can go on
    int rc;                 // the communicator's error (then all is false)
};

// Adds this engine's word (ok) to a sum over the communicator, in the float after the scratch
// gradients, and returns whether every engine said ok. Each engine calls it once per job.
static bool agree(struct rnnd_engine *e, struct agreement *ag, bool ok) {
    ag->done = true;
    ag->all = ok;
    if (ag->comm == NULL)
        return ok;
    float *d_flag = e->grad_scratch + e->P, flag = ok ? 0.0f : 1.0f;
    int rc = be_in(e, d_flag, &flag, sizeof(flag));
    if (rc == 0)
        rc = rnnd_comm_all_reduce(ag->comm, d_flag, 1);
    if (rc == 0)
        rc = be_out(e, &flag, d_flag, sizeof(flag));
    ag->rc = rc;
    ag->all = rc == 0 && flag == 0.0f;
    return ag->all;
}

// ---------------------------------------------------------------------------------------------
// EndEpisodes

// False when an env of the job is held by a Step part that waits for its other devices: that
// Step was admitted first, so the EndEpisodes waits in e->ends_held and runs after it
// (engine_process).
static bool run_end(struct rnnd_engine *e, struct rnnd_job *job) {
    for (int r = 0; r < job->end.B; r++) {
        struct rnnd_env *env = rnnd_envtable_find(e->envs, job->end.env_ids[r]);
        if (env && env->held) {
            struct rnnd_job **tail = &e->ends_held;
            while (*tail)
                tail = (struct rnnd_job **)&(*tail)->item.next;
            job->item.next = NULL;
            *tail = job;
            return false;
        }
    }
    uint64_t released = 0;
    for (int r = 0; r < job->end.B; r++) {
        struct rnnd_env *env = rnnd_envtable_find(e->envs, job->end.env_ids[r]);
        if (env) {
            env_drop(e, env, RNND_EVICT_RELEASED);
            released++;
        }
    }
    job->end.released = released;
    env_gauges(e);
    return true;
}

// The EndEpisodes that waited for held envs, once those Steps ran or gave up.
static void run_ends_held(struct rnnd_engine *e) {
    struct rnnd_job *list = e->ends_held, *next;
    e->ends_held = NULL;
    for (struct rnnd_job *job = list; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        if (run_end(e, job))
            job->done(job);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward

// Backend memory for the calls that keep nothing past their reply (a Forward without tape, a
// Backward): one block reused from call to call, grown on demand, so that such calls allocate
// nothing on the device. 0 or RNND_ENOMEM.
static int work_reserve(struct rnnd_engine *e, size_t bytes, void **out) {
    if (bytes > e->work_bytes) {
        size_t want = bytes > e->work_bytes / 2 * 3 ? bytes : e->work_bytes / 2 * 3;
        be_free(e, e->work);
        e->work = NULL;
        e->work_bytes = 0;
        if (be_alloc(e, want, &e->work) != 0)
            return RNND_ENOMEM;
        e->work_bytes = want;
    }
    *out = e->work;
    return 0;
}

// Host memory that mirrors `bytes` of a block's input/output region at d_io: the region itself
// with host_mem (copies between them are then skipped), else the page-locked staging buffer,
// grown on demand. NULL when out of memory.
static char *xfer_host(struct rnnd_engine *e, char *d_io, size_t bytes) {
    if (e->host_mem)
        return d_io;
    if (bytes > e->xfer_bytes) {
        e->be.ops->host_free(e->be.ctx, e->xfer);
        e->xfer = NULL;
        size_t want = bytes > e->xfer_bytes / 2 * 3 ? bytes : e->xfer_bytes / 2 * 3;
        e->xfer_bytes = 0;
        if (e->be.ops->host_alloc(e->be.ctx, want, (void **)&e->xfer) != 0)
            return NULL;
        e->xfer_bytes = want;
    }
    return e->xfer;
}

// What a Forward or Backward moves between the client's tensors (host, the wire's dtypes) and its
// backend block: float parts (fp32 in the block, `ft` on the host) and raw parts (bytes as they
// are). Each direction is packed into one area of the block and its mirror in the staging, so it
// costs one copy, and float parts are converted on the backend (cast). With host_mem and fp32
// there is nothing to convert: inputs are copied into place and outputs are used where they are.
struct io_part {
    void *dev;        // the backend array
    size_t n;         // elements
    size_t raw;       // bytes per element of a raw part; 0: a float part
    const void *host; // an input's data
    void **out;       // an output: receives the host pointer of its data
};

static size_t io_part_bytes(const struct io_part *p, enum rnnd_ftype ft) {
    return p->n * (p->raw ? p->raw : rnnd_ftype_bytes(ft));
}

// Bytes of the area that packs k parts (0 when none is needed).
static size_t io_area_bytes(const struct rnnd_engine *e, const struct io_part *p, int k,
                            enum rnnd_ftype ft) {
    if (e->host_mem && ft == RNND_FTYPE_F32)
        return 0;
    size_t used = 0;
    for (int i = 0; i < k; i++)
        carve_off(&used, io_part_bytes(&p[i], ft));
    return used;
}

static int io_in(struct rnnd_engine *e, const struct io_part *p, int k, enum rnnd_ftype ft,
                 char *d_area, char *h_area) {
    int rc = 0;
    if (e->host_mem && ft == RNND_FTYPE_F32) {
        for (int i = 0; i < k; i++)
            memcpy(p[i].dev, p[i].host, io_part_bytes(&p[i], ft));
        return 0;
    }
    size_t used = 0, off[16];
    for (int i = 0; i < k; i++) {
        off[i] = carve_off(&used, io_part_bytes(&p[i], ft));
        memcpy(h_area + off[i], p[i].host, io_part_bytes(&p[i], ft));
    }
    rc = be_in(e, d_area, h_area, used);
    for (int i = 0; rc == 0 && i < k; i++)
        rc = p[i].raw ? e->be.ops->copy(e->be.ctx, p[i].dev, d_area + off[i], p[i].n * p[i].raw)
                      : e->be.ops->cast(e->be.ctx, p[i].dev, RNND_FTYPE_F32, d_area + off[i], ft,
                                        p[i].n);
    return rc;
}

// Synchronises (copy_out): the outputs are on the host when it returns 0.
static int io_out(struct rnnd_engine *e, const struct io_part *p, int k, enum rnnd_ftype ft,
                  char *d_area, char *h_area) {
    if (e->host_mem && ft == RNND_FTYPE_F32) {
        for (int i = 0; i < k; i++)
            *p[i].out = p[i].dev;
        return 0;
    }
    size_t used = 0, off[16];
    int rc = 0;
    for (int i = 0; i < k; i++) {
        off[i] = carve_off(&used, io_part_bytes(&p[i], ft));
        if (rc == 0)
            rc = p[i].raw ? e->be.ops->copy(e->be.ctx, d_area + off[i], p[i].dev, p[i].n * p[i].raw)
                          : e->be.ops->cast(e->be.ctx, d_area + off[i], ft, p[i].dev,
                                            RNND_FTYPE_F32, p[i].n);
        *p[i].out = h_area + off[i];
    }
    if (rc == 0)
        rc = be_out(e, h_area, d_area, used);
    return rc;
}

// A Forward's block: the tape, the arrays the op reads and writes (fp32) and the store rows of a
// recorded window. The areas that pack what travels (io_part: inputs, then outputs) follow it in
// the work block, or have the work block to themselves when the block is a kept tape's.
struct fwd_layout {
    void *tape;
    float *h0, *c0, *hidden, *cell;
    float *x;          // (B, T, I)
    uint8_t *is_init;  // (B, T)
    float *rec_extras; // (B, T, E) recorded only
    uint64_t *rec_ver; // (B, T) recorded only
    float *out, *h_n, *c_n;
    int32_t *idx;   // recorded: (B*T + B) store rows of the windows, then of their first steps
    char *area;     // the packed inputs (in_bytes), then the packed outputs; NULL when none
    size_t in_bytes, area_bytes;
};

// The parts of a Forward that travel, in l (io_part.dev) and f (host data and outputs). Which
// parts there are follows from f and the model alone, not from l's pointers: fwd_carve sizes the
// areas from a layout measured at base NULL.
static int fwd_parts(struct rnnd_engine *e, struct rnnd_forward_job *f, const struct fwd_layout *l,
                     struct io_part *in, int *nin, struct io_part *out, int *nout) {
    size_t B = (size_t)f->B, BT = B * (size_t)f->T, I = (size_t)e->model.I;
    size_t H = (size_t)e->model.H, LH = e->LH, E = (size_t)e->tdims.E;
    int k = 0;
    if (f->recorded) {
        in[k++] = (struct io_part){.dev = l->idx, .n = BT + B, .raw = 4, .host = NULL};
    } else {
        in[k++] = (struct io_part){.dev = l->x, .n = BT * I, .host = f->x};
        in[k++] = (struct io_part){.dev = l->is_init, .n = BT, .raw = 1, .host = f->is_init};
        if (f->h0)
            in[k++] = (struct io_part){.dev = l->h0, .n = B * LH, .host = f->h0};
        if (f->c0)
            in[k++] = (struct io_part){.dev = l->c0, .n = B * LH, .host = f->c0};
        if (f->hidden)
            in[k++] = (struct io_part){.dev = l->hidden, .n = BT * LH, .host = f->hidden};
        if (f->cell)
            in[k++] = (struct io_part){.dev = l->cell, .n = BT * LH, .host = f->cell};
    }
    *nin = k;
    k = 0;
    out[k++] = (struct io_part){.dev = l->out, .n = BT * H, .out = &f->out};
    out[k++] = (struct io_part){.dev = l->h_n, .n = B * LH, .out = &f->h_n};
    if (e->lstm)
        out[k++] = (struct io_part){.dev = l->c_n, .n = B * LH, .out = &f->c_n};
    if (f->recorded) {
        unsigned m = f->rec_fields;
        if (m & RNND_REC_OBS)
            out[k++] = (struct io_part){.dev = l->x, .n = BT * I, .out = &f->rec_obs};
        if ((m & RNND_REC_EXTRAS) && E)
            out[k++] = (struct io_part){.dev = l->rec_extras, .n = BT * E, .out = &f->rec_extras};
        if (m & RNND_REC_IS_INIT)
            out[k++] = (struct io_part){
                .dev = l->is_init, .n = BT, .raw = 1, .out = (void **)&f->rec_is_init};
        if (m & RNND_REC_VERSION)
            out[k++] = (struct io_part){
                .dev = l->rec_ver, .n = BT, .raw = 8, .out = (void **)&f->rec_version};
    }
    *nout = k;
    return 0;
}

static size_t fwd_carve(struct rnnd_engine *e, struct carve *cv, struct fwd_layout *l,
                        struct rnnd_forward_job *f, bool h0, bool hidden, size_t tape_bytes) {
    size_t B = (size_t)f->B, BT = B * (size_t)f->T, I = (size_t)e->model.I;
    size_t H = (size_t)e->model.H, LH = e->LH, E = (size_t)e->tdims.E;
    bool rec = f->recorded;
    l->tape = tape_bytes ? carve(cv, tape_bytes) : NULL;
    l->h0 = h0 ? carve(cv, B * LH * sizeof(float)) : NULL;
    l->c0 = h0 && e->lstm ? carve(cv, B * LH * sizeof(float)) : NULL;
    l->hidden = hidden ? carve(cv, BT * LH * sizeof(float)) : NULL;
    l->cell = hidden && e->lstm ? carve(cv, BT * LH * sizeof(float)) : NULL;
    l->x = carve(cv, BT * I * sizeof(float));
    l->is_init = carve(cv, BT);
    l->rec_extras = rec && E ? carve(cv, BT * E * sizeof(float)) : NULL;
    l->rec_ver = rec ? carve(cv, BT * sizeof(uint64_t)) : NULL;
    l->out = carve(cv, BT * H * sizeof(float));
    l->h_n = carve(cv, B * LH * sizeof(float));
    l->c_n = e->lstm ? carve(cv, B * LH * sizeof(float)) : NULL;
    l->idx = rec ? carve(cv, (BT + B) * sizeof(int32_t)) : NULL;
    struct io_part in[8], out[8];
    int nin, nout;
    fwd_parts(e, f, l, in, &nin, out, &nout);
    l->in_bytes = io_area_bytes(e, in, nin, f->in);
    if (rec && l->in_bytes == 0) // the rows are built on the host: they need the staging
        l->in_bytes = (BT + B) * sizeof(int32_t);
    size_t out_bytes = io_area_bytes(e, out, nout, f->out_dtype);
    l->area_bytes = (l->in_bytes + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN + out_bytes;
    return cv->used;
}

// Fills the store rows of a recorded Forward (host: (B*T) rows of the windows, then B rows of
// their first steps); refuses envs that have recorded fewer than T steps.
static int recorded_rows(struct rnnd_engine *e, struct rnnd_job *job, int32_t *idx) {
    struct rnnd_forward_job *f = &job->fwd;
    int B = f->B, T = f->T;
    for (int b = 0; b < B; b++) {
        struct rnnd_env *env = rnnd_envtable_find(e->envs, f->env_ids[b]);
        int have = env ? env->traj.count : 0;
        if (have < T)
            return rnnd_job_fail(
                job, RNND_EPRECOND,
                "env %" PRIu64 " has %d recorded steps%s, Forward asked for the last %d; "
                "ask for at most %d steps or step the env more first",
                f->env_ids[b], have, env ? "" : " (no state: unknown, ended or evicted)", T, have);
        if (idx == NULL)
            continue;
        int32_t *row = idx + (size_t)b * (size_t)T;
        for (int t = 0; t < T; t++)
            row[t] = rnnd_traj_row(&env->traj, &e->tdims, env->slot, T, t);
        idx[(size_t)B * (size_t)T + (size_t)b] = row[0];
    }
    return 0;
}

// What a Forward that is part of a larger one keeps in its tape (run_forward_part).
struct fwd_part {
    uint64_t tape_id;    // the id every engine keeps its part under
    const int32_t *rows; // (B) the rows within the whole Forward
    int B_all;
};

static void run_forward(struct rnnd_engine *e, struct rnnd_job *job, const struct fwd_part *pt) {
    struct rnnd_forward_job *f = &job->fwd;
    int B = f->B, T = f->T;
    size_t BT = (size_t)B * (size_t)T;
    bool rec = f->recorded;
    bool has_h0 = rec || f->h0, has_hidden = !rec && f->hidden;
    void *block = NULL;
    struct tape_obj *tobj = NULL;
    if (rec && recorded_rows(e, job, NULL) != 0)
        return;
    size_t tape_bytes = 0;
    if (f->keep_tape) {
        tape_bytes = e->be.ops->tape_bytes(e->be.ctx, &e->model, B, T);
        if (tape_bytes == 0)
            tape_bytes = 1;
    }
    struct fwd_layout l;
    struct carve cv = {0};
    size_t bytes = fwd_carve(e, &cv, &l, f, has_h0, has_hidden, tape_bytes);
    uint64_t now = rnnd_now_ns();
    if (f->keep_tape && rnnd_tapes_fits(e->tapes, bytes, now) != 0) {
        rnnd_metrics_limit_hit(RNND_LIMIT_TAPE_BYTES);
        rnnd_job_fail(
            job, RNND_EFULL,
            "tape memory budget reached: this tape needs %.1f MiB, %d tapes hold %.1f of "
            "--tape-memory-mb %zu MiB; call Backward on earlier tapes (or let them expire "
            "after --tape-ttl-s %d s), send keep_tape=false, or raise --tape-memory-mb",
            (double)bytes / 1048576.0, rnnd_tapes_count(e->tapes),
            (double)rnnd_tapes_bytes(e->tapes) / 1048576.0, rnnd_tapes_budget(e->tapes) >> 20,
            e->cfg.tape_ttl_s);
        return;
    }
    size_t area_at = (bytes + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
    void *work = NULL;
    size_t block_bytes = 0;
    int rc = f->keep_tape ? tape_block_alloc(e, bytes, &block, &block_bytes)
                          : work_reserve(e, area_at + l.area_bytes, &block);
    if (rc == 0 && f->keep_tape && l.area_bytes)
        rc = work_reserve(e, l.area_bytes, &work);
    char *host = NULL;
    if (rc == 0) {
        cv = (struct carve){block, 0};
        fwd_carve(e, &cv, &l, f, has_h0, has_hidden, tape_bytes);
        l.area = !l.area_bytes ? NULL : f->keep_tape ? work : (char *)block + area_at;
        host = l.area ? xfer_host(e, l.area, l.area_bytes) : (char *)block;
    }
    if (host == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM,
                      "out of memory for a Forward of %d x %d steps (%.1f MiB on the %s "
                      "backend); send fewer rows or steps",
                      B, T, (double)bytes / 1048576.0, e->backend_name);
        goto out;
    }
    struct io_part in[8], outs[8];
    int nin, nout;
    fwd_parts(e, f, &l, in, &nin, outs, &nout);
    size_t out_at = (l.in_bytes + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
    if (rec) {
        // The windows come straight from the store, on the backend: only their rows travel.
        int32_t *h_idx = (int32_t *)host;
        recorded_rows(e, job, h_idx);
        rc = be_in(e, l.idx, h_idx, (BT + (size_t)B) * sizeof(int32_t));
        struct rnnd_traj_rows win = {.n = (int)BT,
                                     .rows = l.idx,
                                     .obs = l.x,
                                     .extras = l.rec_extras,
                                     .is_init = l.is_init,
                                     .version = l.rec_ver};
        struct rnnd_traj_rows first = {.n = B, .rows = l.idx + BT, .h = l.h0, .c = l.c0};
        if (rc == 0)
            rc = e->be.ops->traj_read(e->be.ctx, &win, &e->store, &e->model);
        if (rc == 0)
            rc = e->be.ops->traj_read(e->be.ctx, &first, &e->store, &e->model);
    } else {
        rc = io_in(e, in, nin, f->in, l.area, host);
    }
    struct rnnd_seq seq = {.B = B,
                           .T = T,
                           .x = l.x,
                           .is_init = l.is_init,
                           .h0 = l.h0,
                           .c0 = l.c0,
                           .hidden = l.hidden,
                           .cell = l.cell};
    uint64_t t0 = rnnd_now_ns();
    if (rc == 0)
        rc = e->be.ops->rnn_forward(e->be.ctx, l.out, l.h_n, l.c_n, l.tape, &seq, e->cur->params,
                                    &e->model);
    if (rc == 0) // one copy back of everything returned
        rc = io_out(e, outs, nout, f->out_dtype, l.area ? l.area + out_at : NULL, host + out_at);
    rnnd_metrics_kernel(RNND_OP_FORWARD, rnnd_now_ns() - t0);
    if (rc != 0) {
        if (rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "backend forward failed: %s", rnnd_strerror(rc));
        rnnd_job_fail(job, rc, "the backend refused the Forward: %s", rnnd_strerror(rc));
        goto out;
    }
    job->model_version = e->cur->version;
    if (f->keep_tape) {
        tobj = calloc(1, sizeof(*tobj));
        if (tobj == NULL) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of host memory keeping the tape");
            goto out;
        }
        *tobj = (struct tape_obj){.w = e->cur,
                                  .B = B,
                                  .T = T,
                                  .B_all = pt ? pt->B_all : B,
                                  .has_h0 = has_h0,
                                  .has_hidden = has_hidden,
                                  .block = block,
                                  .block_bytes = block_bytes,
                                  .x = l.x,
                                  .is_init = l.is_init,
                                  .h0 = l.h0,
                                  .c0 = l.c0,
                                  .hidden = l.hidden,
                                  .cell = l.cell,
                                  .tape = l.tape};
        if (pt) {
            tobj->rows = malloc((size_t)B * sizeof(int32_t));
            if (tobj->rows == NULL) {
                free(tobj);
                rnnd_job_fail(job, RNND_ENOMEM, "out of host memory keeping the tape");
                goto out;
            }
            memcpy(tobj->rows, pt->rows, (size_t)B * sizeof(int32_t));
            f->tape_id = pt->tape_id;
        }
        e->cur->refs++;
        rc = pt ? rnnd_tapes_add_as(e->tapes, tobj, bytes, now, f->tape_id)
                : rnnd_tapes_add(e->tapes, tobj, bytes, now, &f->tape_id);
        if (rc != 0) {
            e->cur->refs--;
            free(tobj->rows);
            free(tobj);
            rnnd_job_fail(job, rc, "cannot keep the tape: %s", rnnd_strerror(rc));
            goto out;
        }
        block = NULL; // the tape owns it now
        tape_gauges(e);
    }
    job->err = 0;
out:
    if (block && block != e->work)
        tape_block_free(e, block, block_bytes);
}

// Copies n rows of `row` bytes each: dst[i] = src[rows[i]] (gather) or dst[rows[i]] = src[i].
static void rows_gather(void *dst, const void *src, const int32_t *rows, int n, size_t row) {
    for (int i = 0; i < n; i++)
        memcpy((char *)dst + (size_t)i * row, (const char *)src + (size_t)rows[i] * row, row);
}

static void rows_scatter(void *dst, const void *src, const int32_t *rows, int n, size_t row) {
    for (int i = 0; i < n; i++)
        memcpy((char *)dst + (size_t)rows[i] * row, (const char *)src + (size_t)i * row, row);
}

// This engine's rows of a Forward shared by several engines (struct rnnd_forward_job): gathers
// them into a Forward of its own, runs it, and scatters the outputs into the submitter's arrays.
static void run_forward_part(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_forward_job *f = &job->fwd;
    const int32_t *rows = f->rows;
    int n = f->nrows, T = f->T;
    size_t Tz = (size_t)T, I = (size_t)e->model.I, H = (size_t)e->model.H, LH = e->LH;
    size_t E = (size_t)e->cfg.extras_size;
    size_t fi = rnnd_ftype_bytes(f->in), fo = rnnd_ftype_bytes(f->out_dtype);
    struct rnnd_job sub = {.kind = RNND_JOB_FORWARD};
    struct rnnd_forward_job *s = &sub.fwd;
    s->recorded = f->recorded;
    s->keep_tape = f->keep_tape;
    s->B = n;
    s->T = T;
    s->in = f->in;
    s->out_dtype = f->out_dtype;
    s->rec_fields = f->rec_fields;
    char *block = NULL;
    uint64_t *ids = NULL;
    if (f->recorded) {
        ids = malloc((size_t)n * sizeof(*ids));
        if (ids == NULL) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of host memory for a Forward part of %d rows", n);
            return;
        }
        rows_gather(ids, f->env_ids, rows, n, sizeof(*ids));
        s->env_ids = ids;
    } else {
        struct carve cv = {0};
        for (int pass = 0; pass < 2; pass++) {
            s->x = carve(&cv, (size_t)n * Tz * I * fi);
            s->is_init = carve(&cv, (size_t)n * Tz);
            s->h0 = f->h0 ? carve(&cv, (size_t)n * LH * fi) : NULL;
            s->c0 = f->c0 ? carve(&cv, (size_t)n * LH * fi) : NULL;
            s->hidden = f->hidden ? carve(&cv, (size_t)n * Tz * LH * fi) : NULL;
            s->cell = f->cell ? carve(&cv, (size_t)n * Tz * LH * fi) : NULL;
            if (pass == 0) {
                block = malloc(cv.used);
                if (block == NULL) {
                    rnnd_job_fail(job, RNND_ENOMEM,
                                  "out of host memory for a Forward part of %d rows", n);
                    return;
                }
                cv = (struct carve){block, 0};
            }
        }
        rows_gather((void *)s->x, f->x, rows, n, Tz * I * fi);
        rows_gather((void *)s->is_init, f->is_init, rows, n, Tz);
        if (f->h0)
            rows_gather((void *)s->h0, f->h0, rows, n, LH * fi);
        if (f->c0)
            rows_gather((void *)s->c0, f->c0, rows, n, LH * fi);
        if (f->hidden)
            rows_gather((void *)s->hidden, f->hidden, rows, n, Tz * LH * fi);
        if (f->cell)
            rows_gather((void *)s->cell, f->cell, rows, n, Tz * LH * fi);
    }
    struct fwd_part pt = {.tape_id = f->tape_id, .rows = rows, .B_all = f->B};
    run_forward(e, &sub, &pt);
    job->err = sub.err;
    memcpy(job->msg, sub.msg, sizeof(job->msg));
    job->model_version = sub.model_version;
    if (sub.err == 0) {
        rows_scatter(f->out, s->out, rows, n, Tz * H * fo);
        rows_scatter(f->h_n, s->h_n, rows, n, LH * fo);
        if (e->lstm)
            rows_scatter(f->c_n, s->c_n, rows, n, LH * fo);
        if (s->rec_obs)
            rows_scatter(f->rec_obs, s->rec_obs, rows, n, Tz * I * fo);
        if (s->rec_is_init)
            rows_scatter(f->rec_is_init, s->rec_is_init, rows, n, Tz);
        if (s->rec_extras)
            rows_scatter(f->rec_extras, s->rec_extras, rows, n, Tz * E * fo);
        if (s->rec_version)
            rows_scatter(f->rec_version, s->rec_version, rows, n, Tz * sizeof(int64_t));
    }
    free(block);
    free(ids);
}

// ---------------------------------------------------------------------------------------------
// Backward

// ag: a part's own rows (run_backward_part), which run only once every engine agrees, and whose
// weight gradients stay in grad_scratch (without accumulate) for the all-reduce; NULL alone.
// The tape is looked up as of now.
static void run_backward(struct rnnd_engine *e, struct rnnd_job *job, struct agreement *ag,
                         uint64_t now) {
    struct rnnd_backward_job *g = &job->bwd;
    bool part = ag != NULL;
    void *p;
    if (rnnd_tapes_get(e->tapes, g->tape_id, now, &p) != 0) {
        tape_gauges(e);
        rnnd_job_fail(
            job, RNND_ENOTFOUND,
            "tape %" PRIu64 " is unknown or expired (a tape lives --tape-ttl-s %d s and is used "
            "by one Backward); run Forward with keep_tape=true again and send its tape_id",
            g->tape_id, e->cfg.tape_ttl_s);
        return;
    }
    struct tape_obj *t = p;
    int B = t->B, T = t->T;
    if (g->B != B || g->T != T) {
        rnnd_job_fail(job, RNND_EINVAL,
                      "grad_output: shape [%d, %d, %d] does not match tape %" PRIu64
                      " ([B, T, H] = [%d, "
                      "%d, %d] from its Forward); send the gradient of that Forward's output",
                      g->B, g->T, e->model.H, g->tape_id, B, T, e->model.H);
        return;
    }
    if ((g->grad_h_n && g->grad_h_n_B != B) || (g->grad_c_n && g->grad_c_n_B != B)) {
        rnnd_job_fail(
            job, RNND_EINVAL,
            "grad_h_n/grad_c_n: first dim %d does not match tape %" PRIu64 "'s B = %d; send [%d, "
            "%d, %d]",
            g->grad_h_n ? g->grad_h_n_B : g->grad_c_n_B, g->tape_id, B, B, e->model.L, e->model.H);
        return;
    }
    // Input gradients: those asked for (all the Forward had, unless the request said which),
    // never one of an input the Forward did not have.
    unsigned want = g->input_grads_set
                        ? g->input_grads
                        : RNND_GRAD_OBS | (t->has_h0 ? RNND_GRAD_H0 : 0) |
                              (t->has_hidden ? RNND_GRAD_HIDDEN : 0);
    if (((want & RNND_GRAD_H0) && !t->has_h0) || ((want & RNND_GRAD_HIDDEN) && !t->has_hidden)) {
        rnnd_job_fail(job, RNND_EINVAL,
                      "input_grads asks for %s but the Forward of tape %" PRIu64
                      " had no %s; drop that bit",
                      (want & RNND_GRAD_H0) && !t->has_h0 ? "grad_h0" : "grad_hidden", g->tape_id,
                      (want & RNND_GRAD_H0) && !t->has_h0 ? "h0 (nor a recorded state)"
                                                          : "stored states (hidden)");
        return;
    }
    size_t BT = (size_t)B * (size_t)T, I = (size_t)e->model.I, H = (size_t)e->model.H;
    size_t LH = e->LH, BLH = (size_t)B * LH;
    bool lstm = e->lstm;
    bool want_grads = !g->accumulate && !part;
    // The reply (of every row of the Backward, also when this is a part) within the limit.
    uint64_t rows_all = (uint64_t)t->B_all * (uint64_t)T, sl = lstm ? 2 : 1;
    uint64_t reply = ((want & RNND_GRAD_OBS ? rows_all * I : 0) +
                      (want & RNND_GRAD_H0 ? (uint64_t)t->B_all * LH * sl : 0) +
                      (want & RNND_GRAD_HIDDEN ? rows_all * LH * sl : 0) +
                      (g->accumulate ? 0 : e->P)) *
                     rnnd_ftype_bytes(g->out_dtype);
    if (reply + 4096 > (uint64_t)e->cfg.max_message_mb << 20) {
        rnnd_metrics_limit_hit(RNND_LIMIT_MESSAGE);
        rnnd_job_fail(job, RNND_EFULL,
                      "the reply would be %.1f MiB, over --max-message-mb %d; ask for fewer "
                      "input_grads, a 16-bit reply_dtype, or send fewer rows or steps",
                      (double)reply / 1048576.0, e->cfg.max_message_mb);
        return;
    }
    float *dparams = g->accumulate ? e->grad_accum : e->grad_scratch;
    // The arrays the op reads and writes (fp32), then the areas that pack what travels
    // (io_part): one copy each way. Gradients not asked for are not computed.
    struct carve cv = {0};
    float *d_go, *d_ghn, *d_gcn, *d_gx, *d_gh0, *d_gc0, *d_ghid, *d_gcell;
    struct io_part in[3], outs[7];
    int nin, nout;
    size_t area_at = 0, in_bytes = 0, area_bytes = 0;
    void *block = NULL;
    char *area = NULL, *host = NULL;
    for (int pass = 0; pass < 2; pass++) {
        d_go = carve(&cv, BT * H * sizeof(float));
        d_ghn = g->grad_h_n ? carve(&cv, BLH * sizeof(float)) : NULL;
        d_gcn = g->grad_c_n ? carve(&cv, BLH * sizeof(float)) : NULL;
        d_gx = want & RNND_GRAD_OBS ? carve(&cv, BT * I * sizeof(float)) : NULL;
        d_gh0 = want & RNND_GRAD_H0 ? carve(&cv, BLH * sizeof(float)) : NULL;
        d_gc0 = want & RNND_GRAD_H0 && lstm ? carve(&cv, BLH * sizeof(float)) : NULL;
        d_ghid = want & RNND_GRAD_HIDDEN ? carve(&cv, BT * LH * sizeof(float)) : NULL;
        d_gcell = want & RNND_GRAD_HIDDEN && lstm ? carve(&cv, BT * LH * sizeof(float)) : NULL;
        // The parts follow from the request alone (pass 0 measures with NULL pointers).
        nin = nout = 0;
        in[nin++] = (struct io_part){.dev = d_go, .n = BT * H, .host = g->grad_out};
        if (g->grad_h_n)
            in[nin++] = (struct io_part){.dev = d_ghn, .n = BLH, .host = g->grad_h_n};
        if (g->grad_c_n)
            in[nin++] = (struct io_part){.dev = d_gcn, .n = BLH, .host = g->grad_c_n};
        if (want_grads)
            outs[nout++] = (struct io_part){.dev = dparams, .n = e->P, .out = &g->grads};
        if (want & RNND_GRAD_OBS)
            outs[nout++] = (struct io_part){.dev = d_gx, .n = BT * I, .out = &g->grad_x};
        if (want & RNND_GRAD_H0)
            outs[nout++] = (struct io_part){.dev = d_gh0, .n = BLH, .out = &g->grad_h0};
        if (want & RNND_GRAD_H0 && lstm)
            outs[nout++] = (struct io_part){.dev = d_gc0, .n = BLH, .out = &g->grad_c0};
        if (want & RNND_GRAD_HIDDEN)
            outs[nout++] = (struct io_part){.dev = d_ghid, .n = BT * LH, .out = &g->grad_hidden};
        if (want & RNND_GRAD_HIDDEN && lstm)
            outs[nout++] = (struct io_part){.dev = d_gcell, .n = BT * LH, .out = &g->grad_cell};
        if (pass == 1)
            break;
        in_bytes = carve_off(&(size_t){io_area_bytes(e, in, nin, g->in)}, 0);
        area_bytes = in_bytes + io_area_bytes(e, outs, nout, g->out_dtype);
        area_at = carve_off(&(size_t){cv.used}, 0);
        if (work_reserve(e, area_at + area_bytes, &block) != 0 ||
            (area_bytes && (host = xfer_host(e, (char *)block + area_at, area_bytes)) == NULL)) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of memory for a Backward of %d x %d steps", B,
                          T);
            return;
        }
        area = area_bytes ? (char *)block + area_at : NULL;
        cv = (struct carve){block, 0};
    }
    // Everything this part needs is here; from now on it changes state (the tape, and the
    // accumulated gradients), so only if every other part can run too.
    if (part && !agree(e, ag, true))
        return;
    int rc = 0;
    if (!g->accumulate)
        rc = e->be.ops->zero(e->be.ctx, dparams, e->P * sizeof(float));
    if (rc == 0)
        rc = io_in(e, in, nin, g->in, area, host);
    struct rnnd_seq seq = {.B = B,
                           .T = T,
                           .x = t->x,
                           .is_init = t->is_init,
                           .h0 = t->h0,
                           .c0 = t->c0,
                           .hidden = t->hidden,
                           .cell = t->cell};
    struct rnnd_seq_grads grads = {
        .params = dparams, .x = d_gx, .h0 = d_gh0, .c0 = d_gc0, .hidden = d_ghid, .cell = d_gcell};
    uint64_t t0 = rnnd_now_ns();
    if (rc == 0)
        rc = e->be.ops->rnn_backward(e->be.ctx, &grads, d_go, d_ghn, d_gcn, t->tape, &seq,
                                     t->w->params, &e->model);
    if (rc == 0) // one copy back of everything returned
        rc = io_out(e, outs, nout, g->out_dtype, area ? area + in_bytes : NULL,
                    host ? host + in_bytes : NULL);
    rnnd_metrics_kernel(RNND_OP_BACKWARD, rnnd_now_ns() - t0);
    if (rc != 0) {
        if (rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "backend backward failed: %s", rnnd_strerror(rc));
        rnnd_job_fail(job, rc, "the backend refused the Backward: %s", rnnd_strerror(rc));
        return;
    }
    job->model_version = t->w->version;
    if (g->accumulate && e->replicas && !e->grad_pending) {
        // The pending flag that the all-reduce of ApplyGradients sums over the replicas.
        const float one = 1.0f;
        rc = be_in(e, e->grad_accum + e->P, &one, sizeof(one));
        if (rc != 0)
            rnnd_panic(__FILE__, __LINE__, "cannot set the pending flag: %s", rnnd_strerror(rc));
    }
    if (g->accumulate)
        e->grad_pending = true;
    rnnd_tapes_remove(e->tapes, g->tape_id); // a tape serves one Backward
    tape_gauges(e);
    job->err = 0;
}

// This engine's share of a Backward over a Forward that several engines ran (struct
// rnnd_backward_job): every engine of the daemon checks its part (its tape part is there, the
// shapes match, the memory is there), all agree, and only then run their rows and, without
// accumulate, all-reduce the weight gradients. A part refused here is the Backward's error;
// the others finish with err 0 and their tape parts kept.
static void run_backward_part(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_backward_job *g = &job->bwd;
    size_t P = e->P, Tz = (size_t)g->T, I = (size_t)e->model.I, H = (size_t)e->model.H;
    size_t LH = e->LH, fi = rnnd_ftype_bytes(g->in), fo = rnnd_ftype_bytes(g->out_dtype);
    struct agreement ag = {.comm = e->local};
    uint64_t now = rnnd_now_ns(); // one instant for every look at the tape: it cannot expire midway
    int rc = 0;
    if (!g->accumulate)
        rc = e->be.ops->zero(e->be.ctx, e->grad_scratch, P * sizeof(float));
    void *p = NULL;
    struct tape_obj *t = NULL;
    if (!g->has_part) {
        // No rows here: only the agreement and the all-reduce below.
    } else if (rnnd_tapes_get(e->tapes, g->tape_id, now, &p) != 0) {
        tape_gauges(e);
        rnnd_job_fail(
            job, RNND_ENOTFOUND,
            "tape %" PRIu64 " is unknown or expired (a tape lives --tape-ttl-s %d s and is used "
            "by one Backward); run Forward with keep_tape=true again and send its tape_id",
            g->tape_id, e->cfg.tape_ttl_s);
    } else if ((t = p)->rows == NULL || g->B != t->B_all || g->T != t->T ||
               (g->grad_h_n && g->grad_h_n_B != t->B_all) ||
               (g->grad_c_n && g->grad_c_n_B != t->B_all)) {
        rnnd_job_fail(
            job, RNND_EINVAL,
            "grad_output: shape [%d, %d, %d] (grad_h_n/grad_c_n first dim %d) does not match "
            "tape %" PRIu64 " ([B, T, H] = [%d, %d, %d] from its Forward); send the gradient of "
            "that Forward's output",
            g->B, g->T, e->model.H, g->grad_h_n ? g->grad_h_n_B : g->grad_c_n_B, g->tape_id,
            t->B_all, t->T, e->model.H);
    } else {
        int n = t->B;
        const int32_t *rows = t->rows;
        char *go = malloc((size_t)n * Tz * H * fi);
        char *ghn = g->grad_h_n ? malloc((size_t)n * LH * fi) : NULL;
        char *gcn = g->grad_c_n ? malloc((size_t)n * LH * fi) : NULL;
        if (!go || (g->grad_h_n && !ghn) || (g->grad_c_n && !gcn)) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of host memory for a Backward part of %d rows", n);
        } else {
            rows_gather(go, g->grad_out, rows, n, Tz * H * fi);
            if (ghn)
                rows_gather(ghn, g->grad_h_n, rows, n, LH * fi);
            if (gcn)
                rows_gather(gcn, g->grad_c_n, rows, n, LH * fi);
            // The tape is dropped by the inner Backward when it runs: keep its rows.
            int32_t *mine = t->rows;
            t->rows = NULL;
            struct rnnd_job sub = {.kind = RNND_JOB_BACKWARD};
            sub.bwd = (struct rnnd_backward_job){.tape_id = g->tape_id,
                                                 .B = n,
                                                 .T = g->T,
                                                 .grad_out = go,
                                                 .grad_h_n = ghn,
                                                 .grad_c_n = gcn,
                                                 .grad_h_n_B = n,
                                                 .grad_c_n_B = n,
                                                 .in = g->in,
                                                 .out_dtype = g->out_dtype,
                                                 .input_grads_set = g->input_grads_set,
                                                 .input_grads = g->input_grads,
                                                 .accumulate = g->accumulate};
            run_backward(e, &sub, &ag, now);
            struct rnnd_backward_job *sb = &sub.bwd;
            // Still there unless the rows ran (refused, a part elsewhere refused, or failed).
            bool kept = rnnd_tapes_get(e->tapes, g->tape_id, now, &p) == 0;
            if (sub.err) {
                job->err = sub.err;
                memcpy(job->msg, sub.msg, sizeof(job->msg));
            } else if (!kept) {
                job->model_version = sub.model_version;
                if (g->grad_x && sb->grad_x)
                    rows_scatter(g->grad_x, sb->grad_x, mine, n, Tz * I * fo);
                if (g->grad_h0 && sb->grad_h0)
                    rows_scatter(g->grad_h0, sb->grad_h0, mine, n, LH * fo);
                if (g->grad_c0 && sb->grad_c0)
                    rows_scatter(g->grad_c0, sb->grad_c0, mine, n, LH * fo);
                if (g->grad_hidden && sb->grad_hidden)
                    rows_scatter(g->grad_hidden, sb->grad_hidden, mine, n, Tz * LH * fo);
                if (g->grad_cell && sb->grad_cell)
                    rows_scatter(g->grad_cell, sb->grad_cell, mine, n, Tz * LH * fo);
            }
            if (kept)
                ((struct tape_obj *)p)->rows = mine;
            else
                free(mine);
        }
        free(go);
        free(ghn);
        free(gcn);
    }
    // An engine without rows, or refused before the agreement, still has its say: the others
    // wait for it.
    if (!ag.done)
        agree(e, &ag, job->err == 0);
    if (ag.rc != 0 && job->err == 0)
        rnnd_job_fail(job, ag.rc == RNND_EUNAVAIL ? RNND_EUNAVAIL : RNND_EDEVICE,
                      "this daemon's devices could not agree to run the Backward: %s",
                      rnnd_strerror(ag.rc));
    if (g->accumulate || !ag.all)
        return;
    // Every engine joins, also one whose rows failed after the agreement (the Backward then
    // fails with its error), or a peer would wait.
    int crc = rc == 0 ? rnnd_comm_all_reduce(e->local, e->grad_scratch, P) : rc;
    if (crc == 0 && e->index == 0) {
        float *sum = g->out_dtype == RNND_FTYPE_F32 ? g->grads : malloc(P * sizeof(float));
        crc = sum ? be_out(e, sum, e->grad_scratch, P * sizeof(float)) : RNND_ENOMEM;
        if (crc == 0 && sum != g->grads)
            rnnd_cast_host(g->grads, g->out_dtype, sum, RNND_FTYPE_F32, P);
        if (sum != g->grads)
            free(sum);
    }
    if (crc != 0 && job->err == 0)
        rnnd_job_fail(job, crc == RNND_EUNAVAIL ? RNND_EUNAVAIL : RNND_EDEVICE,
                      "summing the gradients over this daemon's devices failed: %s",
                      rnnd_strerror(crc));
}

// ---------------------------------------------------------------------------------------------
// Weights and the optimizer

// An update (ApplyGradients, SetWeights) that some replica could not take (rc here, or another
// replica's: agree): no replica changed anything.
static void update_refused(struct rnnd_engine *e, struct rnnd_job *job, int rc,
                           const struct agreement *ag) {
    if (ag->rc != 0) {
        if (ag->rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "agreeing on an update failed: %s",
                       rnnd_strerror(ag->rc));
        rnnd_job_fail(
            job, ag->rc,
            "the replicas could not agree on the update: %s; updates need every device and "
            "every rnnd of the group (--comm-timeout-s %d)",
            rnnd_strerror(ag->rc), e->cfg.comm_timeout_s);
    } else if (rc != 0) {
        rnnd_log(RNND_LOG_WARN, "device %d cannot take an update: %s", e->index, rnnd_strerror(rc));
        rnnd_job_fail(
            job, rc,
            "device %d cannot take the update: %s (kept tapes hold older weights: call Backward "
            "on them or let them expire); nothing changed, retry",
            e->index, rnnd_strerror(rc));
    } else {
        rnnd_job_fail(
            job, RNND_ENOMEM,
            "another replica (device or rnnd instance of the group) cannot take the update "
            "(its log says why); nothing changed, retry");
    }
}

static void run_apply(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_apply_job *a = &job->apply;
    bool sent = a->sent || a->grads != NULL;
    if (!sent && !e->grad_pending && e->replicas == NULL) {
        rnnd_job_fail(
            job, RNND_EPRECOND,
            "no accumulated gradients to apply; call Backward with accumulate=true first, or "
            "send grads");
        return;
    }
    struct rnnd_optim o = {
        .kind = e->cfg.optimizer,
        .lr = a->has_lr ? a->lr : e->cfg.lr,
        .beta1 = 0.9f,
        .beta2 = 0.999f,
        .eps = 1e-8f,
        .weight_decay = 0.0f,
        .max_grad_norm = e->cfg.max_grad_norm,
    };
    // Replicas see the same lr, so all of them refuse here alike, before any collective.
    if (rnnd_optim_check(&o) != 0) {
        rnnd_job_fail(job, RNND_EINVAL, "lr %g is not usable; send a finite lr > 0", (double)o.lr);
        return;
    }
    // What this replica needs (a buffer for the new weights, the sent gradients where they
    // arrive), then the agreement: the update runs on every replica or on none.
    struct weights *w = weights_new(e);
    size_t bytes = e->P * sizeof(float);
    float *g = sent ? e->grad_scratch : e->grad_accum;
    int rc = w ? 0 : RNND_ENOMEM;
    bool root_here = a->root < 0 || !e->replicas || rnnd_comm_rank(e->replicas) == a->root;
    if (rc == 0 && sent && a->grads && root_here)
        rc = be_in(e, g, a->grads, bytes);
    struct agreement ag = {.comm = e->replicas};
    if (!agree(e, &ag, rc == 0)) {
        weights_unref(e, w);
        update_refused(e, job, rc, &ag);
        return;
    }
    // From here on a replica takes part in the collective even when its own steps fail.
    int crc = 0;
    if (e->replicas) {
        if (!sent)
            crc = rnnd_comm_all_reduce(e->replicas, e->grad_accum, e->P + 1);
        else if (a->root >= 0)
            crc = rnnd_comm_broadcast(e->replicas, g, e->P, a->root);
    }
    bool pending = e->grad_pending;
    if (crc == 0 && e->replicas && !sent) {
        float flag = 0.0f;
        crc = be_out(e, &flag, e->grad_accum + e->P, sizeof(flag));
        pending = flag > 0.0f;
    }
    if (crc != 0) {
        weights_unref(e, w);
        if (crc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "gradient exchange failed: %s", rnnd_strerror(crc));
        rnnd_job_fail(job, crc,
                      "the replicas did not exchange the gradients: %s; ApplyGradients needs every "
                      "device and every rnnd of the group (--comm-timeout-s %d)",
                      rnnd_strerror(crc), e->cfg.comm_timeout_s);
        return;
    }
    if (!sent && !pending) {
        weights_unref(e, w);
        rnnd_job_fail(job, RNND_EPRECOND,
                      "no accumulated gradients to apply on any replica; call Backward with "
                      "accumulate=true first, or send grads");
        return;
    }
    float norm = 0.0f;
    uint64_t t0 = rnnd_now_ns();
    rc = e->be.ops->copy(e->be.ctx, w->params, e->cur->params, bytes);
    if (rc == 0)
        rc = e->be.ops->optim_step(e->be.ctx, w->params, g, e->adam_m, e->adam_v, e->P, &o,
                                   e->optim_t + 1, &norm);
    if (rc == 0)
        rc = e->be.ops->sync(e->be.ctx);
    rnnd_metrics_kernel(RNND_OP_OPTIM, rnnd_now_ns() - t0);
    if (rc != 0) {
        weights_unref(e, w);
        if (rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "backend optimizer step failed: %s", rnnd_strerror(rc));
        if (e->replicas)
            rnnd_log(RNND_LOG_ERROR, "device %d skipped an update (%s): its weights now differ "
                     "from the other replicas'; restart rnnd to resynchronise them",
                     e->index, rnnd_strerror(rc));
        rnnd_job_fail(job, rc, "the optimizer step failed: %s", rnnd_strerror(rc));
        return;
    }
    e->optim_t++;
    if (!sent) {
        e->be.ops->zero(e->be.ctx, e->grad_accum, bytes + sizeof(float));
        e->grad_pending = false;
    }
    weights_swap(e, w);
    rnnd_log(RNND_LOG_DEBUG, "applied gradients: version %" PRIu64 ", grad norm %g, lr %g",
             e->cur->version, (double)norm, (double)o.lr);
    job->model_version = e->cur->version;
    job->err = 0;
}

static void run_get_weights(struct rnnd_engine *e, struct rnnd_job *job) {
    int rc = be_out(e, job->weights.params, e->cur->params, e->P * sizeof(float));
    if (rc != 0) {
        rnnd_job_fail(job, rc, "cannot read the weights: %s", rnnd_strerror(rc));
        return;
    }
    job->model_version = e->cur->version;
    job->err = 0;
}

static void run_set_weights(struct rnnd_engine *e, struct rnnd_job *job) {
    int root = job->weights.root;
    struct weights *w = weights_new(e);
    int rc = w ? 0 : RNND_ENOMEM;
    bool root_here = root < 0 || !e->replicas || rnnd_comm_rank(e->replicas) == root;
    if (rc == 0 && root_here)
        rc = be_in(e, w->params, job->weights.params, e->P * sizeof(float));
    // The new weights run on every replica or on none.
    struct agreement ag = {.comm = e->replicas};
    if (!agree(e, &ag, rc == 0)) {
        weights_unref(e, w);
        update_refused(e, job, rc, &ag);
        return;
    }
    if (e->replicas && root >= 0)
        rc = rnnd_comm_broadcast(e->replicas, w->params, e->P, root);
    if (rc == 0)
        rc = e->be.ops->sync(e->be.ctx);
    if (rc != 0) {
        weights_unref(e, w);
        if (e->replicas)
            rnnd_log(RNND_LOG_ERROR, "device %d did not take the new weights (%s): its weights "
                     "differ from the other replicas'; restart rnnd to resynchronise them",
                     e->index, rnnd_strerror(rc));
        rnnd_job_fail(job, rc, "cannot load the weights: %s", rnnd_strerror(rc));
        return;
    }
    weights_swap(e, w);
    job->model_version = e->cur->version;
    job->err = 0;
}

// ---------------------------------------------------------------------------------------------
// Replicas: joining a communicator, and the start-up sync

static void run_comm(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_comm_job *c = &job->comm;
    struct rnnd_comm *comm;
    int rc = rnnd_comm_init(&e->be, &c->id, c->nranks, c->rank, c->timeout_ms, &comm);
    if (rc != 0) {
        rnnd_job_fail(job, rc, "device %d could not join the communicator as rank %d of %d: %s",
                      e->index, c->rank, c->nranks, rnnd_strerror(rc));
        return;
    }
    if (c->local)
        e->local = comm;
    if (c->replicas)
        e->replicas = comm;
    job->err = 0;
}

// Every replica takes replica 0's weights, Adam moments, step count and version, so replicas
// that restored different checkpoints (or none) start identical. The two integers travel as
// the bits of four floats (a broadcast copies bits).
static void run_sync(struct rnnd_engine *e, struct rnnd_job *job) {
    size_t P = e->P;
    uint64_t meta[2] = {e->cur->version, (uint64_t)e->optim_t};
    float *d_meta = e->grad_scratch; // P >= 4 for every model
    int rc = be_in(e, d_meta, meta, sizeof(meta));
    if (rc == 0)
        rc = rnnd_comm_broadcast(e->replicas, d_meta, 4, 0);
    if (rc == 0)
        rc = be_out(e, meta, d_meta, sizeof(meta));
    if (rc == 0)
        rc = rnnd_comm_broadcast(e->replicas, e->cur->params, P, 0);
    if (rc == 0 && e->adam_m)
        rc = rnnd_comm_broadcast(e->replicas, e->adam_m, P, 0);
    if (rc == 0 && e->adam_v)
        rc = rnnd_comm_broadcast(e->replicas, e->adam_v, P, 0);
    if (rc == 0)
        rc = e->be.ops->zero(e->be.ctx, e->grad_accum, (P + 1) * sizeof(float));
    if (rc == 0)
        rc = e->be.ops->sync(e->be.ctx);
    if (rc != 0) {
        rnnd_job_fail(job, rc, "device %d could not take replica 0's weights: %s", e->index,
                      rnnd_strerror(rc));
        return;
    }
    e->grad_pending = false;
    e->optim_t = (int64_t)meta[1];
    e->cur->version = meta[0];
    atomic_store(&e->version, meta[0]);
    atomic_store_explicit(&rnnd_metrics.model_version, meta[0], memory_order_relaxed);
    job->model_version = meta[0];
    job->err = 0;
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

// Checkpoints move recorded steps between the store and host arrays in chunks of up to
// TRAJ_CHUNK rows, through a block laid out as a small store (the work block) and its host
// mirror: per chunk one copy of the rows' indices in, one traj_read or traj_write, one copy of
// the columns.
#define TRAJ_CHUNK 16384

struct traj_chunk {
    struct rnnd_traj_store d, h; // the chunk's columns on the backend, and on the host
    int32_t *d_idx, *h_idx;      // (cap) the store rows of the chunk's rows
    void *block;
    char *host;
    size_t bytes;
    int cap, n;
};

static int traj_chunk_open(struct rnnd_engine *e, struct traj_chunk *k, int64_t rows) {
    struct rnnd_traj_dims d = e->tdims;
    memset(k, 0, sizeof(*k));
    k->cap = rows < 1 ? 1 : rows < TRAJ_CHUNK ? (int)rows : TRAJ_CHUNK;
    d.cap = k->cap;
    size_t idx_at = carve_off(&(size_t){rnnd_traj_layout(&k->d, &d, 1, NULL)}, 0);
    k->bytes = idx_at + (size_t)k->cap * sizeof(int32_t);
    if (work_reserve(e, k->bytes, &k->block) != 0 ||
        (k->host = xfer_host(e, k->block, k->bytes)) == NULL)
        return RNND_ENOMEM;
    rnnd_traj_layout(&k->d, &d, 1, k->block);
    rnnd_traj_layout(&k->h, &d, 1, k->host);
    k->d_idx = (int32_t *)((char *)k->block + idx_at);
    k->h_idx = (int32_t *)(k->host + idx_at);
    return 0;
}

static struct rnnd_traj_rows traj_chunk_rows(const struct traj_chunk *k) {
    return (struct rnnd_traj_rows){.n = k->n,
                                   .rows = k->d_idx,
                                   .obs = k->d.obs,
                                   .extras = k->d.extras,
                                   .h = k->d.h,
                                   .c = k->d.c,
                                   .is_init = k->d.is_init,
                                   .version = k->d.version};
}

// Copies row i of the chunk's host columns to or from row `at` of checkpoint-shaped arrays.
static void traj_chunk_row(const struct rnnd_engine *e, const struct traj_chunk *k, int i,
                           size_t at, float *obs, float *extras, float *h, float *c,
                           uint8_t *is_init, uint64_t *version, bool to_chunk) {
    size_t I = (size_t)e->tdims.I, E = (size_t)e->tdims.E, LH = e->LH, r = (size_t)i;
#define TRAJ_MOVE(dst, src, w) memcpy(dst, src, (w) * sizeof(*(src)))
#define TRAJ_COL(ck, ar, w)                                                                        \
    do {                                                                                           \
        if (to_chunk)                                                                              \
            TRAJ_MOVE(k->h.ck + r * (w), ar + at * (w), w);                                        \
        else                                                                                       \
            TRAJ_MOVE(ar + at * (w), k->h.ck + r * (w), w);                                        \
    } while (0)
    TRAJ_COL(obs, obs, I);
    if (E)
        TRAJ_COL(extras, extras, E);
    TRAJ_COL(h, h, LH);
    if (e->lstm)
        TRAJ_COL(c, c, LH);
    TRAJ_COL(is_init, is_init, 1);
    TRAJ_COL(version, version, 1);
#undef TRAJ_COL
#undef TRAJ_MOVE
}

// Host copies of every env's recorded steps for a checkpoint (env order of the snapshot).
struct traj_snapshot {
    int64_t *count; // (N)
    int64_t rows;
    float *obs, *extras, *h, *c;
    uint8_t *is_init;
    uint64_t *version;
};

static void traj_snapshot_free(struct traj_snapshot *t) {
    free(t->count);
    free(t->obs);
    free(t->extras);
    free(t->h);
    free(t->c);
    free(t->is_init);
    free(t->version);
}

// Reads the chunk's rows from the store into t from row `at` on.
static int traj_snapshot_flush(struct rnnd_engine *e, struct traj_chunk *k, struct traj_snapshot *t,
                               size_t at) {
    if (k->n == 0)
        return 0;
    struct rnnd_traj_rows r = traj_chunk_rows(k);
    int rc = be_in(e, k->d_idx, k->h_idx, (size_t)k->n * sizeof(int32_t));
    if (rc == 0)
        rc = e->be.ops->traj_read(e->be.ctx, &r, &e->store, &e->model);
    if (rc == 0)
        rc = be_out(e, k->host, k->block, k->bytes);
    for (int i = 0; rc == 0 && i < k->n; i++)
        traj_chunk_row(e, k, i, at + (size_t)i, t->obs, t->extras, t->h, t->c, t->is_init,
                       t->version, false);
    k->n = 0;
    return rc;
}

// A consistent copy of the store's recorded steps (the engine thread takes it between jobs).
static int traj_snapshot(struct rnnd_engine *e, int N, struct traj_snapshot *t) {
    const struct rnnd_traj_dims *d = &e->tdims;
    memset(t, 0, sizeof(*t));
    t->count = malloc(((size_t)N + 1) * sizeof(int64_t));
    if (t->count == NULL)
        return RNND_ENOMEM;
    int i = 0;
    for (struct rnnd_env *env = rnnd_envtable_oldest(e->envs); env;
         env = rnnd_envtable_newer(e->envs, env), i++) {
        t->count[i] = env->traj.count;
        t->rows += t->count[i];
    }
    size_t R = (size_t)t->rows + 1, I = (size_t)d->I, E = (size_t)d->E, LH = e->LH;
    t->obs = malloc(R * I * sizeof(float));
    t->extras = E ? malloc(R * E * sizeof(float)) : NULL;
    t->h = malloc(R * LH * sizeof(float));
    t->c = d->lstm ? malloc(R * LH * sizeof(float)) : NULL;
    t->is_init = malloc(R);
    t->version = malloc(R * sizeof(uint64_t));
    if (!t->obs || (E && !t->extras) || !t->h || (d->lstm && !t->c) || !t->is_init || !t->version)
        return RNND_ENOMEM;
    struct traj_chunk k;
    int rc = traj_chunk_open(e, &k, t->rows);
    size_t at = 0;
    for (struct rnnd_env *env = rnnd_envtable_oldest(e->envs); rc == 0 && env;
         env = rnnd_envtable_newer(e->envs, env)) {
        for (int s = 0; rc == 0 && s < env->traj.count; s++) {
            k.h_idx[k.n++] = rnnd_traj_row(&env->traj, d, env->slot, env->traj.count, s);
            if (k.n == k.cap) {
                rc = traj_snapshot_flush(e, &k, t, at);
                at += (size_t)k.cap;
            }
        }
    }
    if (rc == 0)
        rc = traj_snapshot_flush(e, &k, t, at);
    return rc;
}

// Writes a checkpoint into dir (resolved). 0 or an error with the reason in msg.
static int checkpoint_save(struct rnnd_engine *e, const char *dir, char *msg, size_t msglen) {
    size_t P = e->P, LH = e->LH, bytes = P * sizeof(float);
    int N = rnnd_envtable_count(e->envs);
    struct rnnd_checkpoint ck = {
        .model = e->model,
        .P = P,
        .model_version = e->cur->version,
        .optimizer = e->cfg.optimizer,
        .lr = e->cfg.lr,
        .max_grad_norm = e->cfg.max_grad_norm,
        .optim_step = e->optim_t,
        .n_envs = N,
        .extras_size = e->cfg.extras_size,
        .seed = e->cfg.seed,
    };
    float *params = malloc(bytes);
    float *m = e->adam_m ? malloc(bytes) : NULL;
    float *v = e->adam_v ? malloc(bytes) : NULL;
    uint64_t *ids = malloc(((size_t)N + 1) * sizeof(uint64_t));
    uint64_t *last = malloc(((size_t)N + 1) * sizeof(uint64_t));
    uint8_t *has = malloc((size_t)N + 1);
    float *h = malloc(((size_t)N * LH + 1) * sizeof(float));
    float *c = e->lstm ? malloc(((size_t)N * LH + 1) * sizeof(float)) : NULL;
    float *lo = malloc(((size_t)N * (size_t)e->model.H + 1) * sizeof(float));
    struct traj_snapshot tr = {0};
    int rc = RNND_ENOMEM;
    if (!params || (e->adam_m && (!m || !v)) || !ids || !last || !has || !h || (e->lstm && !c) ||
        !lo || (e->tdims.cap > 0 && traj_snapshot(e, N, &tr) != 0)) {
        snprintf(msg, msglen, "out of host memory for a checkpoint snapshot");
        goto out;
    }
    rc = be_out(e, params, e->cur->params, bytes);
    if (rc == 0 && m)
        rc = be_out(e, m, e->adam_m, bytes);
    if (rc == 0 && v)
        rc = be_out(e, v, e->adam_v, bytes);
    int i = 0;
    for (struct rnnd_env *env = rnnd_envtable_oldest(e->envs); rc == 0 && env;
         env = rnnd_envtable_newer(e->envs, env), i++) {
        ids[i] = env->id;
        last[i] = env->last_index;
        has[i] = env->has_index;
        memcpy(lo + (size_t)i * (size_t)e->model.H, rnnd_envtable_output(e->envs, env),
               (size_t)e->model.H * sizeof(float));
        size_t off = env_row(e, env) * LH;
        rc = be_out(e, h + (size_t)i * LH, e->state_h + off, LH * sizeof(float));
        if (rc == 0 && e->lstm)
            rc = be_out(e, c + (size_t)i * LH, e->state_c + off, LH * sizeof(float));
    }
    if (rc != 0) {
        snprintf(msg, msglen, "cannot read state from the backend: %s", rnnd_strerror(rc));
        goto out;
    }
    ck.params = params;
    ck.exp_avg = m;
    ck.exp_avg_sq = v;
    ck.env_ids = ids;
    ck.last_index = last;
    ck.has_index = has;
    ck.env_h = h;
    ck.env_c = c;
    ck.last_output = lo;
    if (tr.count) {
        ck.traj_count = tr.count;
        ck.traj_rows = tr.rows;
        ck.traj_obs = tr.obs;
        ck.traj_is_init = tr.is_init;
        ck.traj_extras = tr.extras;
        ck.traj_version = tr.version;
        ck.traj_h = tr.h;
        ck.traj_c = tr.c;
    }
    uint64_t t0 = rnnd_now_ns();
    rc = rnnd_checkpoint_write(dir, &ck, msg, msglen);
    if (rc == 0)
        rnnd_log(RNND_LOG_INFO,
                 "checkpoint %s written (version %" PRIu64 ", %d envs, %" PRId64
                 " recorded steps, %.1f ms)",
                 dir, ck.model_version, N, tr.rows, (double)(rnnd_now_ns() - t0) / 1e6);
out:
    atomic_fetch_add_explicit(rc == 0 ? &rnnd_metrics.checkpoints_ok
                                      : &rnnd_metrics.checkpoints_failed,
                              1, memory_order_relaxed);
    free(params);
    free(m);
    free(v);
    free(ids);
    free(last);
    free(has);
    free(h);
    free(c);
    free(lo);
    traj_snapshot_free(&tr);
    return rc;
}

static void run_checkpoint(struct rnnd_engine *e, struct rnnd_job *job) {
    char dir[RNND_CONFIG_PATH_MAX];
    bool automatic = job->ckpt.path[0] == '\0';
    size_t top = strlen(e->top_dir);
    if (e->count > 1 && strncmp(job->ckpt.path, e->top_dir, top) == 0 && job->ckpt.path[top] == '/')
        // A path inside --state-dir names this device's part inside its own directory.
        memmove(job->ckpt.path, job->ckpt.path + top + 1, strlen(job->ckpt.path + top + 1) + 1);
    int rc = rnnd_checkpoint_resolve(e->cfg.state_dir, job->ckpt.path, e->cur->version, dir,
                                     sizeof(dir), job->msg, sizeof(job->msg));
    if (rc != 0) {
        job->err = rc;
        return;
    }
    rc = checkpoint_save(e, dir, job->msg, sizeof(job->msg));
    if (rc != 0) {
        rnnd_log(RNND_LOG_WARN, "checkpoint %s failed: %s", dir, job->msg);
        job->err = rc == RNND_ENOMEM ? RNND_ENOMEM : RNND_EIO;
        return;
    }
    // An automatically named one joins the rotation; named ones are the caller's to remove.
    if (automatic)
        rnnd_checkpoint_prune(e->cfg.state_dir, AUTO_CHECKPOINTS_KEPT, &e->model, e->spared,
                              e->n_spared);
    snprintf(job->ckpt.path, sizeof(job->ckpt.path), "%s", dir);
    job->model_version = e->cur->version;
    job->err = 0;
}

// A periodic or shutdown checkpoint under a new automatic name; 0 or -1 (logged). A periodic
// one that fails is tried again one interval later, not at every housekeeping tick: each try
// snapshots the whole state.
static int checkpoint_auto(struct rnnd_engine *e, const char *why) {
    if (e->cfg.state_dir[0] == '\0')
        return 0;
    char dir[RNND_CONFIG_PATH_MAX], msg[512];
    int rc = rnnd_checkpoint_resolve(e->cfg.state_dir, "", e->cur->version, dir, sizeof(dir), msg,
                                     sizeof(msg));
    if (rc == 0)
        rc = checkpoint_save(e, dir, msg, sizeof(msg));
    e->last_checkpoint_ns = rnnd_now_ns();
    if (rc != 0) {
        if (e->cfg.checkpoint_interval_s > 0 && strcmp(why, "periodic") == 0)
            rnnd_log(RNND_LOG_WARN, "periodic checkpoint failed: %s; next try in %d s", msg,
                     e->cfg.checkpoint_interval_s);
        else
            rnnd_log(RNND_LOG_WARN, "%s checkpoint failed: %s", why, msg);
        return -1;
    }
    rnnd_checkpoint_prune(e->cfg.state_dir, AUTO_CHECKPOINTS_KEPT, &e->model, e->spared,
                          e->n_spared);
    return 0;
}

// Drops every env (and its recorded steps): undoes a restore that failed half way.
static void envs_clear(struct rnnd_engine *e) {
    struct rnnd_env *env;
    while ((env = rnnd_envtable_oldest(e->envs)))
        rnnd_envtable_remove(e->envs, env);
}

// Writes the chunk's rows into the store.
static int restore_traj_flush(struct rnnd_engine *e, struct traj_chunk *k) {
    if (k->n == 0)
        return 0;
    struct rnnd_traj_rows r = traj_chunk_rows(k);
    int rc = be_in(e, k->block, k->host, k->bytes);
    if (rc == 0)
        rc = e->be.ops->traj_write(e->be.ctx, &e->store, &r, &e->model);
    if (rc == 0) // the host mirror is refilled next: the copy from it must be done
        rc = e->be.ops->sync(e->be.ctx);
    k->n = 0;
    return rc;
}

// Rebuilds env's ring from rows [at, at + n) of the checkpoint's trajectories, through k.
static int restore_traj(struct rnnd_engine *e, struct traj_chunk *k, struct rnnd_env *env,
                        const struct rnnd_checkpoint *ck, size_t at, int64_t n) {
    const struct rnnd_traj_dims *d = &e->tdims;
    // A ring shorter than the checkpoint's (a lower --trajectory-steps) keeps the newest steps.
    int64_t skip = n > d->cap ? n - d->cap : 0;
    int rc = 0;
    for (int64_t s = skip; rc == 0 && s < n; s++) {
        k->h_idx[k->n] = rnnd_traj_next(&env->traj, d, env->slot);
        traj_chunk_row(e, k, k->n, at + (size_t)s, (float *)ck->traj_obs,
                       (float *)ck->traj_extras, (float *)ck->traj_h, (float *)ck->traj_c,
                       (uint8_t *)ck->traj_is_init, (uint64_t *)ck->traj_version, true);
        rnnd_traj_push(&env->traj, d);
        if (++k->n == k->cap)
            rc = restore_traj_flush(e, k);
    }
    return rc;
}

// Loads a checkpoint read from disk into the (fresh) engine. Nothing changes on failure.
static int restore_apply(struct rnnd_engine *e, const struct rnnd_checkpoint_data *d, char *msg,
                         size_t msglen) {
    const struct rnnd_checkpoint *ck = &d->ck;
    size_t LH = e->LH, H = (size_t)e->model.H, bytes = e->P * sizeof(float);
    if (ck->n_envs > e->cfg.max_envs) {
        snprintf(msg, msglen, "it holds %d envs, more than --max-envs %d; raise --max-envs",
                 ck->n_envs, e->cfg.max_envs);
        return RNND_EINVAL;
    }
    // Recorded steps come back when this daemon records steps of the same width; otherwise the
    // weights and env states are still worth restoring, and the log says what was left out.
    bool traj = ck->traj_count != NULL && ck->traj_rows > 0;
    if (traj && e->tdims.cap == 0) {
        rnnd_log(RNND_LOG_WARN,
                 "the checkpoint's %" PRId64 " recorded steps are not restored: "
                 "--trajectory-steps is 0",
                 ck->traj_rows);
        traj = false;
    } else if (traj && ck->extras_size != e->cfg.extras_size) {
        rnnd_log(RNND_LOG_WARN,
                 "the checkpoint's %" PRId64 " recorded steps carry extras of width %d, not "
                 "--extras-size %d: not restored (start with --extras-size %d to keep them)",
                 ck->traj_rows, ck->extras_size, e->cfg.extras_size, ck->extras_size);
        traj = false;
    }
    uint64_t now = rnnd_now_ns();
    int rc = 0, elsewhere = 0;
    size_t at = 0;
    struct traj_chunk k;
    if (traj)
        rc = traj_chunk_open(e, &k, ck->traj_rows);
    for (int i = 0; i < ck->n_envs && rc == 0; i++) {
        struct rnnd_env *env;
        if (e->count > 1 && rnnd_place(ck->env_ids[i], e->count) != e->index) {
            // Another device holds this env now (a checkpoint of another --devices list).
            elsewhere++;
            if (ck->traj_count)
                at += (size_t)ck->traj_count[i];
            continue;
        }
        if (rnnd_envtable_find(e->envs, ck->env_ids[i])) {
            snprintf(msg, msglen, "env %" PRIu64 " appears twice in envs.safetensors",
                     ck->env_ids[i]);
            rc = RNND_ECORRUPT;
            break;
        }
        rc = rnnd_envtable_add(e->envs, ck->env_ids[i], now, &env);
        if (rc != 0)
            break;
        env->has_index = ck->has_index[i] != 0;
        env->last_index = ck->last_index[i];
        if (ck->last_output)
            memcpy(rnnd_envtable_output(e->envs, env), ck->last_output + (size_t)i * H,
                   H * sizeof(float));
        size_t off = env_row(e, env) * LH;
        rc = be_in(e, e->state_h + off, ck->env_h + (size_t)i * LH, LH * sizeof(float));
        if (rc == 0 && e->lstm)
            rc = be_in(e, e->state_c + off, ck->env_c + (size_t)i * LH, LH * sizeof(float));
        if (rc == 0 && traj)
            rc = restore_traj(e, &k, env, ck, at, ck->traj_count[i]);
        if (ck->traj_count)
            at += (size_t)ck->traj_count[i];
    }
    if (rc == 0 && traj)
        rc = restore_traj_flush(e, &k);
    if (rc == 0 && e->adam_m) {
        bool same = strcmp(d->optimizer, "adam") == 0 && ck->exp_avg;
        if (same) {
            rc = be_in(e, e->adam_m, ck->exp_avg, bytes);
            if (rc == 0)
                rc = be_in(e, e->adam_v, ck->exp_avg_sq, bytes);
        }
    }
    if (rc == 0)
        rc = be_in(e, e->cur->params, ck->params, bytes);
    if (rc != 0) {
        if (msg[0] == '\0')
            snprintf(msg, msglen, "cannot load it: %s", rnnd_strerror(rc));
        envs_clear(e);
        if (e->adam_m) {
            e->be.ops->zero(e->be.ctx, e->adam_m, bytes);
            e->be.ops->zero(e->be.ctx, e->adam_v, bytes);
        }
        return rc;
    }
    if (elsewhere)
        rnnd_log(RNND_LOG_INFO,
                 "device %d: %d of the checkpoint's %d envs are placed on other devices and are "
                 "restored there (from their own checkpoints, or this one)",
                 e->index, elsewhere, ck->n_envs);
    bool same_opt = strcmp(d->optimizer, e->cfg.optimizer == RNND_OPTIM_ADAM ? "adam" : "sgd") == 0;
    e->optim_t = same_opt ? ck->optim_step : 0;
    e->cur->version = ck->model_version;
    atomic_store(&e->version, ck->model_version);
    atomic_store_explicit(&rnnd_metrics.model_version, ck->model_version, memory_order_relaxed);
    env_gauges(e);
    return 0;
}

// The marker file that says a daemon is running on this --state-dir: created at start, removed
// after the shutdown checkpoint. Found at start, it means the last run did not stop cleanly.
static void running_marker(const struct rnnd_engine *e, char *path, size_t cap) {
    snprintf(path, cap, "%s/.rnnd-running", e->cfg.state_dir);
}

// Logs what was restored and how old it is: after a crash or kill -9 whatever happened after
// that checkpoint is gone, and the operator needs to know how much. Then what it could not
// vouch for: files without checksums, parts that are missing.
static void restore_log(const struct rnnd_engine *e, const char *path,
                        const struct rnnd_checkpoint_data *d, bool unclean) {
    const struct rnnd_checkpoint *ck = &d->ck;
    char age[64] = "of unknown age";
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long now_ms = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    if (ck->created_unix_ms > 0) {
        double s = (double)(now_ms - ck->created_unix_ms) / 1000.0;
        if (s < 0)
            s = 0;
        if (s < 120)
            snprintf(age, sizeof(age), "written %.1f s ago", s);
        else if (s < 7200)
            snprintf(age, sizeof(age), "written %.1f min ago", s / 60);
        else
            snprintf(age, sizeof(age), "written %.1f h ago", s / 3600);
    }
    int64_t steps = ck->traj_count ? ck->traj_rows : 0;
    if (unclean)
        rnnd_log(RNND_LOG_WARN,
                 "the last run on %s did not stop cleanly (killed or crashed): restored %s, %s "
                 "(version %" PRIu64 ", %d envs, %" PRId64
                 " recorded steps); steps and updates after it are lost",
                 e->cfg.state_dir, path, age, ck->model_version, ck->n_envs, steps);
    else
        rnnd_log(RNND_LOG_INFO,
                 "restored %s, %s (version %" PRIu64 ", %d envs, %" PRId64 " recorded steps)", path,
                 age, ck->model_version, ck->n_envs, steps);
    if (!d->verified)
        rnnd_log(RNND_LOG_WARN,
                 "checkpoint %s has no checksums file (written by an older rnnd, or by hand): "
                 "its files could not be verified",
                 path);
    if (d->lost[0])
        rnnd_log(RNND_LOG_WARN, "checkpoint %s lacks %s: restored without it", path, d->lost);
}

// Reads and applies the checkpoint in dir; 0, or an error with the reason in why.
static int restore_one(struct rnnd_engine *e, const char *dir, bool unclean, long long *created,
                       char *why, size_t whylen) {
    struct rnnd_checkpoint_data d;
    why[0] = '\0';
    int rc = rnnd_checkpoint_read(dir, &e->model, &d, why, whylen);
    if (rc != 0)
        return rc;
    why[0] = '\0';
    rc = restore_apply(e, &d, why, whylen);
    if (rc == 0) {
        restore_log(e, dir, &d, unclean);
        *created = d.ck.created_unix_ms;
    }
    rnnd_checkpoint_data_free(&d);
    return rc;
}

// Keeps out of the rotation the automatic checkpoints found at start that are newer than the
// state restored (restored_ms; -1 when none was), those refused among them: they may hold what
// this run lacks, and only the operator may drop them.
static int spare_newer(struct rnnd_engine *e, const char *restored, long long restored_ms) {
    char **paths;
    int n;
    if (rnnd_checkpoint_list(e->cfg.state_dir, false, &paths, &n) != 0)
        return RNND_ENOMEM;
    e->spared = paths;
    for (int i = 0; i < n; i++) {
        if ((restored && strcmp(paths[i], restored) == 0) ||
            rnnd_checkpoint_created_ms(paths[i]) < restored_ms) {
            free(paths[i]);
            continue;
        }
        paths[e->n_spared++] = paths[i];
    }
    if (e->n_spared)
        rnnd_log(RNND_LOG_INFO,
                 "%d automatic checkpoints in %s are newer than the state restored or were "
                 "refused: kept out of the rotation (remove them yourself when not needed)",
                 e->n_spared, e->cfg.state_dir);
    return 0;
}

// Creates --state-dir and its auto/ (0700) and the running marker (0600). 0, or RNND_EIO with
// the reason in msg: a state directory that cannot be written would lose every checkpoint.
static int state_dir_open(struct rnnd_engine *e, const char *marker, char *msg, size_t msglen) {
    char dir[RNND_CONFIG_PATH_MAX + 16];
    snprintf(dir, sizeof(dir), "%s/" RNND_CHECKPOINT_AUTO_DIR, e->cfg.state_dir);
    const char *failed = dir;
    int fd = -1, err = 0;
    if (rnnd__mkdirs(dir) != 0) {
        err = errno;
    } else {
        failed = marker;
        fd = open(marker, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || fchmod(fd, 0600) != 0)
            err = errno;
    }
    if (fd >= 0)
        close(fd);
    if (err == 0)
        return 0;
    snprintf(msg, msglen,
             "--state-dir %.150s: cannot create %.200s: %s; make it a directory this user can "
             "write, or choose another --state-dir",
             e->top_dir, failed, strerror(err));
    return RNND_EIO;
}

// --restore DIR, else the newest automatic checkpoint of --state-dir that loads, else --weights,
// else --seed. An automatic checkpoint that does not load is refused with a line saying why and
// the next older one tried; when there were some and none loads the start stops (unless
// --fresh-start): a configuration that changed by mistake must not start over and rotate the
// trained checkpoints away. A bad --restore or --weights stops the start.
static int engine_restore(struct rnnd_engine *e, char *msg, size_t msglen) {
    char why[512], marker[RNND_CONFIG_PATH_MAX + 32];
    bool unclean = false;
    if (e->cfg.state_dir[0]) {
        running_marker(e, marker, sizeof(marker));
        unclean = access(marker, F_OK) == 0;
        int n = rnnd_checkpoint_clean(e->cfg.state_dir);
        if (e->count > 1 && e->index == 0)
            n += rnnd_checkpoint_clean(e->top_dir);
        if (n)
            rnnd_log(RNND_LOG_WARN,
                     "removed %d unfinished checkpoint writes from %s (temporaries left by a "
                     "kill -9 or crash during a write)",
                     n, e->top_dir);
    }
    // Starting weights from a file are checked first, so that a bad --weights fails the start
    // even when a checkpoint wins.
    float *weights = NULL;
    if (e->cfg.weights[0]) {
        weights = malloc(e->P * sizeof(float));
        int rc = weights ? rnnd_checkpoint_read_weights(e->cfg.weights, &e->model, weights, why,
                                                        sizeof(why))
                         : RNND_ENOMEM;
        if (rc != 0) {
            snprintf(msg, msglen, "--weights %.300s", weights ? why : "out of memory");
            free(weights);
            return rc;
        }
    }
    char restored[RNND_CONFIG_PATH_MAX + 300] = "";
    long long restored_ms = -1;
    int rc = 0, refused = 0;
    if (e->cfg.restore[0]) {
        rc = restore_one(e, e->cfg.restore, unclean, &restored_ms, why, sizeof(why));
        if (rc != 0) {
            snprintf(msg, msglen, "--restore %.200s: %.280s", e->cfg.restore, why);
            free(weights);
            return rc;
        }
        snprintf(restored, sizeof(restored), "%s", e->cfg.restore);
    } else if (e->cfg.state_dir[0]) {
        // Several devices: this device's own directory first, then --state-dir itself, whose
        // checkpoints (written with one device) hold every env.
        const char *dirs[2] = {e->cfg.state_dir, e->count > 1 ? e->top_dir : NULL};
        for (int k = 0; k < 2 && dirs[k] && !restored[0] && rc == 0; k++) {
            char **paths;
            int n;
            rc = rnnd_checkpoint_list(dirs[k], false, &paths, &n);
            for (int i = 0; i < n && !restored[0]; i++) {
                if (restore_one(e, paths[i], unclean, &restored_ms, why, sizeof(why)) == 0) {
                    snprintf(restored, sizeof(restored), "%s", paths[i]);
                } else {
                    rnnd_log(RNND_LOG_WARN, "checkpoint %s refused: %s", paths[i], why);
                    refused++;
                }
            }
            rnnd_checkpoint_list_free(paths, n);
        }
        if (rc != 0) {
            snprintf(msg, msglen, "out of memory listing --state-dir");
            free(weights);
            return rc;
        }
    }
    char start[64];
    snprintf(start, sizeof(start), weights ? "--weights" : "--seed %" PRIu64, e->cfg.seed);
    if (refused && !restored[0]) {
        if (!e->cfg.fresh_start) {
            snprintf(msg, msglen,
                     "none of the %d automatic checkpoints in %.150s loads (each is refused "
                     "above, and left as it is): fix the setting that changed (metadata.json "
                     "in each names the model it holds), or start with --fresh-start 1 to "
                     "start from %s and keep them",
                     refused, e->cfg.state_dir, start);
            free(weights);
            return RNND_EPRECOND;
        }
        rnnd_log(RNND_LOG_WARN,
                 "--fresh-start: starting from %s although %d automatic checkpoints in %s are "
                 "there; they do not load and are kept",
                 start, refused, e->cfg.state_dir);
    }
    if (e->cfg.state_dir[0] && !e->cfg.restore[0]) {
        // A named checkpoint is restored only when asked for; say so when it is the newest.
        char **named = NULL;
        int n = 0;
        if (rnnd_checkpoint_list(e->cfg.state_dir, true, &named, &n) == 0 && n > 0 &&
            rnnd_checkpoint_created_ms(named[0]) > restored_ms)
            rnnd_log(RNND_LOG_WARN,
                     "named checkpoint %s is newer than %s: named checkpoints are restored only "
                     "with --restore (start with --restore %s to use it)",
                     named[0], restored[0] ? restored : "any automatic one", named[0]);
        rnnd_checkpoint_list_free(named, n); // the array is allocated even when n is 0
    }
    if (weights && restored[0]) {
        rnnd_log(RNND_LOG_WARN,
                 "--weights %s not loaded: checkpoint %s holds this daemon's newer state; "
                 "replace the weights of the running daemon with rnndctl weights import",
                 e->cfg.weights, restored);
    } else if (weights) {
        rc = be_in(e, e->cur->params, weights, e->P * sizeof(float));
        if (rc != 0) {
            snprintf(msg, msglen, "--weights %.300s: cannot load them: %s", e->cfg.weights,
                     rnnd_strerror(rc));
            free(weights);
            return rc;
        }
        rnnd_log(RNND_LOG_INFO, "weights from %s (version 0)", e->cfg.weights);
    } else if (!restored[0] && e->cfg.state_dir[0] && !refused) {
        rnnd_log(RNND_LOG_INFO, "no automatic checkpoint in %s: starting from %s", e->cfg.state_dir,
                 start);
    }
    free(weights);
    if (unclean && !restored[0])
        rnnd_log(RNND_LOG_WARN,
                 "the last run on %s did not stop cleanly and left no usable "
                 "checkpoint",
                 e->cfg.state_dir);
    if (e->cfg.state_dir[0]) {
        rc = spare_newer(e, restored[0] ? restored : NULL, restored[0] ? restored_ms : -1);
        if (rc == 0)
            rc = state_dir_open(e, marker, msg, msglen);
        if (rc == RNND_ENOMEM)
            snprintf(msg, msglen, "out of memory listing --state-dir");
    }
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Housekeeping: idle eviction, tape expiry, periodic checkpoints.

static void run_housekeeping(struct rnnd_engine *e) {
    uint64_t now = rnnd_now_ns();
    if (e->cfg.env_idle_timeout_s > 0) {
        uint64_t ttl = (uint64_t)e->cfg.env_idle_timeout_s * 1000000000ull;
        int n = 0;
        struct rnnd_env *env = rnnd_envtable_oldest(e->envs), *next;
        for (; env && now - env->last_used_ns >= ttl && now >= env->last_used_ns; env = next) {
            next = rnnd_envtable_newer(e->envs, env);
            if (env->held) // a Step admitted for it is about to run (admit_step)
                continue;
            env_drop(e, env, RNND_EVICT_IDLE);
            n++;
        }
        if (n)
            rnnd_log(RNND_LOG_DEBUG, "evicted %d envs idle for %d s", n, e->cfg.env_idle_timeout_s);
    }
    int expired = rnnd_tapes_expire(e->tapes, now);
    if (expired)
        rnnd_log(RNND_LOG_DEBUG, "%d tapes expired", expired);
    env_gauges(e);
    tape_gauges(e);
    if (e->cfg.checkpoint_interval_s > 0 && e->cfg.state_dir[0] &&
        now - e->last_checkpoint_ns >= (uint64_t)e->cfg.checkpoint_interval_s * 1000000000ull)
        checkpoint_auto(e, "periodic");
}

// ---------------------------------------------------------------------------------------------
// The thread

static void run_control(struct rnnd_engine *e, struct rnnd_job *job) {
    job->err = 0;
    job->msg[0] = '\0';
    job->model_version = e->cur->version;
    switch (job->kind) {
        case RNND_JOB_END_EPISODES:
            if (!run_end(e, job))
                return;
            break;
        case RNND_JOB_FORWARD:
            if (job->fwd.part)
                run_forward_part(e, job);
            else
                run_forward(e, job, NULL);
            break;
        case RNND_JOB_BACKWARD:
            if (job->bwd.part)
                run_backward_part(e, job);
            else
                run_backward(e, job, NULL, rnnd_now_ns());
            break;
        case RNND_JOB_COMM:
            run_comm(e, job);
            break;
        case RNND_JOB_SYNC:
            run_sync(e, job);
            break;
        case RNND_JOB_DROP_TAPE:
            rnnd_tapes_remove(e->tapes, job->fwd.tape_id);
            tape_gauges(e);
            break;
        case RNND_JOB_APPLY:
            run_apply(e, job);
            break;
        case RNND_JOB_GET_WEIGHTS:
            run_get_weights(e, job);
            break;
        case RNND_JOB_SET_WEIGHTS:
            run_set_weights(e, job);
            break;
        case RNND_JOB_CHECKPOINT:
            run_checkpoint(e, job);
            break;
        case RNND_JOB_HOUSEKEEPING:
            if (job == &e->stop_job) {
                e->stopping = true;
                return;
            }
            run_housekeeping(e);
            atomic_store(&e->hk_queued, 0);
            return;
        case RNND_JOB_STEP:
            RNND_ASSERT(!"step job on the control queue");
    }
    job->done(job);
}

static void finish_unavailable(struct rnnd_job *list) {
    struct rnnd_job *next;
    for (struct rnnd_job *job = list; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        if (job->kind == RNND_JOB_HOUSEKEEPING)
            continue;
        rnnd_job_fail(job, RNND_EUNAVAIL, "rnnd is shutting down; retry on another replica");
        job->done(job);
    }
}

// Runs what a poll handed out (under emu): control jobs, refusals, then the Step batch.
static void engine_process(struct rnnd_engine *e, struct rnnd_batch *b) {
    struct rnnd_job *next;
    for (struct rnnd_job *job = (struct rnnd_job *)b->controls; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        run_control(e, job);
    }
    for (struct rnnd_job *job = (struct rnnd_job *)b->rejected; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        job->done(job);
    }
    if (b->items)
        run_step_batch(e, (struct rnnd_job *)b->items);
    if (e->ends_held)
        run_ends_held(e);
    publish(&rnnd_metrics.queue_rows, &e->pub_queue, rnnd_batcher_rows(e->batcher));
}

// Admits nothing: for the last sweep after the engine stopped.
static enum rnnd_batch_admit admit_none(void *ctx, struct rnnd_batch_item *item) {
    (void)ctx;
    (void)item;
    return RNND_BATCH_REJECT;
}

static void *engine_main(void *arg) {
    struct rnnd_engine *e = arg;
    char msg[512] = "";
    int rc = engine_open(e, msg, sizeof(msg));
    if (rc == 0) {
        reply_threads_start(e, e->cfg.reply_threads);
        row_workers_start(e, e->cfg.reply_threads);
        atomic_store_explicit(&e->inline_steps, e->host_mem && e->cfg.inline_steps,
                              memory_order_release);
    }
    e->ready_cb(e->ready_ctx, rc, msg);
    if (rc == 0) {
        rnnd_log(RNND_LOG_INFO,
                 "engine ready: %s backend on %s, %s I=%d H=%d L=%d %s, %zu parameters, "
                 "%d env slots; kernels for %d rows: %s",
                 e->backend_name, e->device, rnnd_config_cell_name(e->model.cell), e->model.I,
                 e->model.H, e->model.L, rnnd_config_compute_name(e->model.compute), e->P,
                 e->cfg.max_envs, e->cfg.max_batch, e->plan);
        bool spin = false;
        for (;;) {
            struct rnnd_batch b;
            uint64_t wait;
            pthread_mutex_lock(&e->emu);
            bool got = rnnd_batcher_poll(e->batcher, rnnd_now_ns(), admit_step, e, &b, &wait);
            if (got)
                engine_process(e, &b);
            bool finished = e->stopping && rnnd_batcher_empty(e->batcher);
            pthread_mutex_unlock(&e->emu);
            if (finished)
                break;
            if (!got)
                rnnd_batcher_sleep(e->batcher, wait, spin);
            spin = got;
        }
        // Steps run inline by other threads are done once the lock is ours; none start again
        // (the batcher refuses pushes since rnnd_engine_stop).
        pthread_mutex_lock(&e->emu);
        pthread_mutex_unlock(&e->emu);
        reply_threads_stop(e);
        row_workers_stop(e);
        // The marker goes only once the final state is on disk: a failed shutdown checkpoint
        // leaves it, so the next start warns that the restored checkpoint is older.
        e->final_failed = checkpoint_auto(e, "shutdown") != 0;
        if (!e->final_failed && e->cfg.state_dir[0]) {
            char marker[RNND_CONFIG_PATH_MAX + 32];
            running_marker(e, marker, sizeof(marker));
            unlink(marker);
        }
    }
    // From here on submit fails jobs itself; finish whatever slipped in before.
    pthread_mutex_lock(&e->lock);
    e->closed = true;
    pthread_mutex_unlock(&e->lock);
    rnnd_batcher_close(e->batcher);
    for (;;) {
        struct rnnd_batch b;
        uint64_t wait;
        if (!rnnd_batcher_poll(e->batcher, rnnd_now_ns(), admit_none, e, &b, &wait))
            break;
        finish_unavailable((struct rnnd_job *)b.controls);
        finish_unavailable((struct rnnd_job *)b.rejected);
        finish_unavailable((struct rnnd_job *)b.items);
    }
    engine_close(e);
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Public API

struct rnnd_engine *rnnd_engine_init(const struct rnnd_config *cfg, int index, int count) {
    struct rnnd_engine *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    e->cfg = *cfg;
    e->index = index;
    e->count = count;
    snprintf(e->top_dir, sizeof(e->top_dir), "%s", cfg->state_dir);
    if (count > 1 && cfg->state_dir[0]) {
        // Each device checkpoints its envs into a directory of its own.
        size_t n = strlen(cfg->state_dir);
        while (n > 1 && cfg->state_dir[n - 1] == '/')
            n--;
        snprintf(e->cfg.state_dir, sizeof(e->cfg.state_dir), "%.*s/device-%d", (int)n,
                 cfg->state_dir, index);
        e->top_dir[n] = '\0';
    }
    e->model = cfg->model;
    e->lstm = cfg->model.cell == RNND_CELL_LSTM;
    e->P = rnnd_model_param_count(&e->model);
    e->LH = (size_t)e->model.L * (size_t)e->model.H;
    e->tdims = (struct rnnd_traj_dims){.I = e->model.I,
                                       .E = cfg->extras_size,
                                       .L = e->model.L,
                                       .H = e->model.H,
                                       .lstm = e->lstm,
                                       .cap = cfg->trajectory_steps};
    struct rnnd_batcher_config bc = {
        .max_batch = cfg->max_batch,
        .max_delay_ns = (uint64_t)cfg->max_delay_us * 1000ull,
        .max_queue_rows = rnnd_config_queue_rows(cfg),
        .spin_ns = (uint64_t)cfg->engine_spin_us * 1000ull,
    };
    e->batcher = rnnd_batcher_init(&bc);
    if (e->batcher == NULL) {
        free(e);
        return NULL;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->emu, NULL);
    pthread_mutex_init(&e->rlock, NULL);
    pthread_cond_init(&e->rcond, NULL);
    pthread_mutex_init(&e->wlock, NULL);
    pthread_cond_init(&e->wcond, NULL);
    e->hk_job.kind = RNND_JOB_HOUSEKEEPING;
    e->stop_job.kind = RNND_JOB_HOUSEKEEPING;
    snprintf(e->backend_name, sizeof(e->backend_name), "none");
    return e;
}

int rnnd_engine_start(struct rnnd_engine *e, rnnd_engine_ready_cb ready, void *ctx) {
    e->ready_cb = ready;
    e->ready_ctx = ctx;
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0)
        return RNND_ENOMEM;
    e->thread_started = true;
    return 0;
}

static struct rnnd_batch_item *step_item(struct rnnd_job *job) {
    job->kind = RNND_JOB_STEP;
    job->item.B = job->step.B;
    job->item.env_ids = job->step.env_ids;
    return &job->item;
}

// CPU backend: if the engine is idle, this thread becomes the engine for one poll and runs the
// batch itself, saving the hand-off to the engine thread and back.
static void step_run_inline(struct rnnd_engine *e) {
    if (pthread_mutex_trylock(&e->emu) == 0) {
        struct rnnd_batch b;
        uint64_t wait;
        if (rnnd_batcher_poll_steps(e->batcher, rnnd_now_ns(), admit_step, e, &b, &wait))
            engine_process(e, &b); // the job may be finished and freed here
        bool empty = rnnd_batcher_empty(e->batcher);
        pthread_mutex_unlock(&e->emu);
        if (empty)
            return;
    }
    rnnd_batcher_wake(e->batcher); // busy, or something left to do (controls, a timer)
}

int rnnd_engine_submit_step(struct rnnd_engine *e, struct rnnd_job *job) {
    if (!atomic_load_explicit(&e->inline_steps, memory_order_acquire))
        return rnnd_batcher_push(e->batcher, step_item(job), rnnd_now_ns());
    int rc = rnnd_batcher_push_quiet(e->batcher, step_item(job), rnnd_now_ns());
    if (rc == 0)
        step_run_inline(e);
    return rc;
}

int rnnd_engine_queue_step(struct rnnd_engine *e, struct rnnd_job *job) {
    return rnnd_batcher_push_quiet(e->batcher, step_item(job), rnnd_now_ns());
}

void rnnd_engine_kick(struct rnnd_engine *e) {
    if (atomic_load_explicit(&e->inline_steps, memory_order_acquire))
        step_run_inline(e);
    else
        rnnd_batcher_wake(e->batcher);
}

void rnnd_engine_wake(struct rnnd_engine *e) {
    rnnd_batcher_wake(e->batcher);
}

void rnnd_engine_submit(struct rnnd_engine *e, struct rnnd_job *job) {
    pthread_mutex_lock(&e->lock);
    bool closed = e->closed;
    if (!closed)
        rnnd_batcher_push_control(e->batcher, &job->item);
    pthread_mutex_unlock(&e->lock);
    if (closed) {
        job->item.next = NULL;
        finish_unavailable(job);
    }
}

void rnnd_engine_housekeeping(struct rnnd_engine *e) {
    if (atomic_exchange(&e->hk_queued, 1) == 0) {
        pthread_mutex_lock(&e->lock);
        if (!e->closed)
            rnnd_batcher_push_control(e->batcher, &e->hk_job.item);
        pthread_mutex_unlock(&e->lock);
    }
}

void rnnd_engine_stop(struct rnnd_engine *e) {
    rnnd_batcher_close(e->batcher);
    pthread_mutex_lock(&e->lock);
    if (!e->closed)
        rnnd_batcher_push_control(e->batcher, &e->stop_job.item);
    pthread_mutex_unlock(&e->lock);
}

void rnnd_engine_join(struct rnnd_engine *e) {
    if (e->thread_started) {
        pthread_join(e->thread, NULL);
        e->thread_started = false;
    }
}

void rnnd_engine_free(struct rnnd_engine *e) {
    if (e == NULL)
        return;
    rnnd_engine_join(e);
    rnnd_batcher_free(e->batcher);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->emu);
    pthread_mutex_destroy(&e->rlock);
    pthread_cond_destroy(&e->rcond);
    pthread_mutex_destroy(&e->wlock);
    pthread_cond_destroy(&e->wcond);
    rnnd_checkpoint_list_free(e->spared, e->n_spared);
    free(e);
}

bool rnnd_engine_final_checkpoint_failed(const struct rnnd_engine *e) {
    return e->final_failed;
}

uint64_t rnnd_engine_model_version(const struct rnnd_engine *e) {
    return atomic_load(&((struct rnnd_engine *)e)->version);
}

uint64_t rnnd_engine_envs_active(const struct rnnd_engine *e) {
    return atomic_load(&((struct rnnd_engine *)e)->envs_active);
}

const char *rnnd_engine_backend_name(const struct rnnd_engine *e) {
    return e->backend_name;
}

const char *rnnd_engine_device_name(const struct rnnd_engine *e) {
    return e->device;
}

const char *rnnd_engine_plan_name(const struct rnnd_engine *e) {
    return e->plan;
}

const struct rnnd_model *rnnd_engine_model(const struct rnnd_engine *e) {
    return &e->model;
}

size_t rnnd_engine_param_count(const struct rnnd_engine *e) {
    return e->P;
}

int rnnd_engine_queue_rows(struct rnnd_engine *e) {
    return rnnd_batcher_rows(e->batcher);
}

const struct rnnd_backend *rnnd_engine_backend(const struct rnnd_engine *e) {
    return &e->be;
}
