/*
 * engine.c: the engine's core (see engine.h): the engine's lifetime (init, start-up, close,
 * free), its weights versions and env bookkeeping, the engine thread and the dispatch of every
 * job, and housekeeping. The jobs themselves run in the other engine files, over the state this
 * file sets up (engine_impl.h, private to them, holds struct rnnd_engine):
 *   engine_step.c   Step: admission, batches, the row workers and reply threads; EndEpisodes;
 *   engine_learn.c  Forward, Backward, ApplyGradients, Get/SetWeights, tapes, the replicas;
 *   engine_ckpt.c   checkpoints: writing one, and the restore at start.
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
 */
#include "engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "checkpoint.h"
#include "engine_impl.h"
#include "log.h"
#include "metrics.h"

// --max-delay-us -1 is 0 where the step look-ahead is on: the next batch is admitted while one
// runs on the device, and on an H200 host 16 unary connections x 64 envs went from 1.5-1.6M to
// 1.9M env-steps/s without the wait (the larger loads unchanged). Elsewhere (the CPU backend,
// whose batches cost more each) 200 us: on 2 cores the same load ran 7-14% slower without it.
#define MAX_DELAY_US_HOST 200

// ---------------------------------------------------------------------------------------------
// Weights versions

struct weights *rnnd__engine_weights_new(struct rnnd_engine *e) {
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
    const struct rnnd_backend_ops *o = e->be.ops;
    size_t dbytes = o->derived_bytes ? o->derived_bytes(e->be.ctx, &e->core) : 0;
    if (be_alloc(e, e->P * sizeof(float), (void **)&w->params) != 0 ||
        (dbytes && be_alloc(e, dbytes, &w->derived) != 0)) {
        be_free(e, w->params);
        free(w);
        return NULL;
    }
    w->refs = 1;
    return w;
}

static void weights_free(struct rnnd_engine *e, struct weights *w) {
    be_free(e, w->params);
    be_free(e, w->derived);
    free(w);
}

void rnnd__engine_weights_unref(struct rnnd_engine *e, struct weights *w) {
    if (w == NULL || --w->refs > 0)
        return;
    if (e->spare == NULL) { // keep one spare: the other half of the double buffer
        w->next = NULL;
        e->spare = w;
        return;
    }
    weights_free(e, w);
}

int rnnd__engine_weights_changed(struct rnnd_engine *e, struct weights *w) {
    return w->derived ? e->be.ops->derive(e->be.ctx, w->derived, w->params, &e->core) : 0;
}

// Makes w the served version (taking over the caller's reference).
void rnnd__engine_weights_swap(struct rnnd_engine *e, struct weights *w) {
    int rc = rnnd__engine_weights_changed(e, w);
    if (rc != 0) // a launch refused on the stream the weights were just written on
        rnnd_panic(__FILE__, __LINE__, "deriving the new weights' step copy failed: %s",
                   rnnd_strerror(rc));
    uint64_t v = atomic_load(&e->version) + 1;
    w->version = v;
    struct weights *old = e->cur;
    e->cur = w;
    rnnd__engine_weights_unref(e, old);
    atomic_store(&e->version, v);
    atomic_store_explicit(&rnnd_metrics.model_version, v, memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Envs

void rnnd__engine_env_drop(struct rnnd_engine *e, struct rnnd_env *env,
                           enum rnnd_evict_reason why) {
    rnnd_envtable_remove(e->envs, env);
    atomic_fetch_add_explicit(&rnnd_metrics.evictions[why], 1, memory_order_relaxed);
}

void rnnd__engine_env_gauges(struct rnnd_engine *e) {
    int n = rnnd_envtable_count(e->envs);
    atomic_store(&e->envs_active, (uint64_t)n);
    publish(&rnnd_metrics.envs_active, &e->pub_envs, n);
}

// ---------------------------------------------------------------------------------------------
// Work blocks: backend memory and staging for Forward, Backward and checkpoints

// Backend memory for the calls that keep nothing past their reply (a Forward without tape, a
// Backward): one block reused from call to call, grown on demand, so that such calls allocate
// nothing on the device. 0 or RNND_ENOMEM.
int rnnd__engine_work_reserve(struct rnnd_engine *e, size_t bytes, void **out) {
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
// *buf (host_alloc memory of *have bytes) with at least bytes, grown by half at least.
static char *host_grow(struct rnnd_engine *e, char **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        e->be.ops->host_free(e->be.ctx, *buf);
        *buf = NULL;
        size_t want = bytes > *have / 2 * 3 ? bytes : *have / 2 * 3;
        *have = 0;
        if (e->be.ops->host_alloc(e->be.ctx, want, (void **)buf) != 0)
            return NULL;
        *have = want;
    }
    return *buf;
}

char *rnnd__engine_xfer_host(struct rnnd_engine *e, char *d_io, size_t bytes) {
    return e->host_mem ? d_io : host_grow(e, &e->xfer, &e->xfer_bytes, bytes);
}

char *rnnd__engine_part_host(struct rnnd_engine *e, size_t bytes) {
    return host_grow(e, &e->part_in, &e->part_in_bytes, bytes);
}

// ---------------------------------------------------------------------------------------------
// Start-up

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

// Zeroed host memory whose pages are mapped as they are first touched (none reserved), or NULL.
static void *host_lazy(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void host_lazy_free(void *p, size_t bytes) {
    if (p)
        munmap(p, bytes);
}

// A Backward with apply (one engine alone, the service checked): the ApplyGradients step it
// asks for, as that call would run it, right after the gradients were accumulated.
static void backward_apply(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_job a = {
        .kind = RNND_JOB_APPLY, .dev_async = job->dev_async, .apply = {.root = -1}};
    rnnd__engine_run_apply(e, &a);
    if (a.err)
        rnnd_job_fail(job, a.err,
                      "the gradients were accumulated (as Backward with accumulate alone), "
                      "then the update failed: %s",
                      a.msg);
    else
        job->model_version = a.model_version;
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
    e->step_replay_off = e->be.ops->record_begin == NULL;
    rc = e->be.ops->supports(e->be.ctx, &e->model);
    if (rc != 0) {
        snprintf(msg, msglen, "the %s backend does not run %s I=%d H=%d L=%d compute=%s%s (%s)",
                 e->backend_name, rnnd_config_cell_name(e->model.cell), e->model.I, e->model.H,
                 e->model.L, rnnd_config_compute_name(e->model.compute),
                 rnnd_model_has_policy(&e->model)
                     ? " with a policy (encoder or heads); use --backend cpu or auto"
                     : "",
                 rnnd_strerror(rc));
        return rc;
    }
    e->be.ops->plan_name(e->be.ctx, &e->model, c->max_batch, e->plan, sizeof(e->plan));

    size_t P = e->P, LH = e->LH, S = (size_t)c->max_envs, MB = (size_t)c->max_batch;
    const char *what = "weights";
    float *init = malloc(P * sizeof(float));
    e->cur = init ? rnnd__engine_weights_new(e) : NULL;
    if (e->cur == NULL)
        goto oom;
    rnnd_model_init_params(&e->model, c->seed, init);
    rc = be_in(e, e->cur->params, init, P * sizeof(float));
    free(init);
    if (rc == 0)
        rc = rnnd__engine_weights_changed(e, e->cur);
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
    if (e->prow.W && e->tdims.cap > 0) {
        what = "policy record of the trajectory store (lower --max-envs or --trajectory-steps)";
        size_t R = (size_t)e->store.R;
        e->prec_w = (size_t)(e->prow.W - e->prow.ndist) + 1;
        e->prec = host_lazy(R * e->prec_w * sizeof(float));
        e->pflags = host_lazy(R);
        if (e->prec == NULL || e->pflags == NULL)
            goto oom;
    }
    if (e->cfg.max_policy_lag > 0 && e->tdims.cap > 0) {
        what = "model versions of the trajectory store (lower --max-envs or --trajectory-steps)";
        if ((e->tver = calloc((size_t)e->store.R, sizeof(uint64_t))) == NULL)
            goto oom;
    }
    what = "step buffers (lower --max-batch)";
    struct step_layout most = rnnd__engine_step_layout(e, (int)MB);
    e->in_bytes = most.in_used;
    e->out_bytes = most.out_all;
    e->lookahead = c->step_lookahead < 0 ? !e->host_mem : c->step_lookahead == 1;
    e->max_delay_us = c->max_delay_us >= 0 ? c->max_delay_us : e->lookahead ? 0 : MAX_DELAY_US_HOST;
    rnnd_batcher_set_delay(e->batcher, (uint64_t)e->max_delay_us * 1000ull);
    for (int k = 0; k < (e->lookahead ? 2 : 1); k++) {
        struct step_bufs *sb = &e->bufs[k];
        if (be_alloc(e, e->in_bytes, (void **)&sb->d_in) != 0 ||
            be_alloc(e, e->out_bytes, (void **)&sb->d_outb) != 0 ||
            (sb->rows = malloc(MB * sizeof(*sb->rows))) == NULL)
            goto oom;
        if (e->host_mem) {
            sb->h_in = sb->d_in;
            sb->h_outb = sb->d_outb;
        } else if (e->be.ops->host_alloc(e->be.ctx, e->in_bytes, (void **)&sb->h_in) != 0 ||
                   e->be.ops->host_alloc(e->be.ctx, e->out_bytes, (void **)&sb->h_outb) != 0) {
            goto oom;
        }
    }
    what = "env table (lower --max-envs)";
    // Each env's retry cache holds its last reply row: the core output, then the policy's.
    e->envs = rnnd_envtable_init(c->max_envs, e->model.H + e->prow.W);
    e->tapes =
        rnnd_tapes_init((size_t)c->tape_memory_mb << 20, (uint64_t)c->tape_ttl_s * 1000000000ull,
                        rnnd__engine_tape_release, e);
    if (e->envs == NULL || e->tapes == NULL)
        goto oom;
    e->last_checkpoint_ns = rnnd_now_ns();
    atomic_store_explicit(&rnnd_metrics.model_version, 0, memory_order_relaxed);
    return rnnd__engine_restore(e, msg, msglen);
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
    rnnd__engine_weights_unref(e, e->cur);
    e->cur = NULL;
    while (e->spare) {
        struct weights *w = e->spare;
        e->spare = w->next;
        weights_free(e, w);
    }
    for (int n = 0; n <= STEP_REPLAY_ROWS; n++)
        if (e->step_replay[n].unit)
            e->be.ops->free_unit(e->be.ctx, e->step_replay[n].unit);
    void *bufs[] = {e->grad_accum, e->grad_scratch, e->adam_m, e->adam_v,
                    e->state_h,    e->state_c,      e->work,   e->spare_tape};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        be_free(e, bufs[i]);
    for (int k = 0; k < 2; k++) {
        struct step_bufs *sb = &e->bufs[k];
        be_free(e, sb->d_in);
        be_free(e, sb->d_outb);
        if (!e->host_mem) {
            e->be.ops->host_free(e->be.ctx, sb->h_in);
            e->be.ops->host_free(e->be.ctx, sb->h_outb);
        }
        free(sb->rows);
    }
    for (int i = 0; i < STEP_HINT_SOURCES; i++) {
        free(e->step_hints[i].slots);
        e->step_hints[i] = (struct step_hint){0};
    }
    e->be.ops->host_free(e->be.ctx, e->xfer);
    e->be.ops->host_free(e->be.ctx, e->part_in);
    e->be.ops->free_lazy(e->be.ctx, e->d_store, e->store_bytes);
    host_lazy_free(e->prec, (size_t)e->store.R * e->prec_w * sizeof(float));
    host_lazy_free(e->pflags, (size_t)e->store.R);
    free(e->rec_host);
    free(e->tver);
    publish(&rnnd_metrics.traj_store_bytes, &e->pub_store, 0);
    rnnd_backend_free(&e->be);
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
            if (env->held) // a Step admitted for it is about to run (rnnd__engine_admit_step)
                continue;
            rnnd__engine_env_drop(e, env, RNND_EVICT_IDLE);
            n++;
        }
        if (n)
            rnnd_log(RNND_LOG_DEBUG, "evicted %d envs idle for %d s", n, e->cfg.env_idle_timeout_s);
    }
    int expired = rnnd_tapes_expire(e->tapes, now);
    if (expired)
        rnnd_log(RNND_LOG_DEBUG, "%d tapes expired", expired);
    rnnd__engine_env_gauges(e);
    rnnd__engine_tape_gauges(e);
    if (e->cfg.checkpoint_interval_s > 0 && e->cfg.state_dir[0] &&
        now - e->last_checkpoint_ns >= (uint64_t)e->cfg.checkpoint_interval_s * 1000000000ull)
        rnnd__engine_checkpoint_auto(e, "periodic");
}

// ---------------------------------------------------------------------------------------------
// The thread

static void run_control(struct rnnd_engine *e, struct rnnd_job *job) {
    job->err = 0;
    job->msg[0] = '\0';
    job->model_version = e->cur->version;
    switch (job->kind) {
        case RNND_JOB_END_EPISODES:
            if (!rnnd__engine_run_end(e, job))
                return;
            break;
        case RNND_JOB_FORWARD:
            if (job->fwd.part)
                rnnd__engine_run_forward_part(e, job);
            else
                rnnd__engine_run_forward(e, job, NULL);
            break;
        case RNND_JOB_BACKWARD:
            if (job->bwd.part) {
                rnnd__engine_run_backward_part(e, job);
            } else {
                rnnd__engine_run_backward(e, job, NULL, rnnd_now_ns());
                if (job->err == 0 && job->bwd.apply)
                    backward_apply(e, job);
            }
            break;
        case RNND_JOB_COMM:
            rnnd__engine_run_comm(e, job);
            break;
        case RNND_JOB_SYNC:
            rnnd__engine_run_sync(e, job);
            break;
        case RNND_JOB_DROP_TAPE:
            rnnd_tapes_remove(e->tapes, job->fwd.tape_id);
            rnnd__engine_tape_gauges(e);
            break;
        case RNND_JOB_APPLY:
            rnnd__engine_run_apply(e, job);
            break;
        case RNND_JOB_GET_WEIGHTS:
            rnnd__engine_run_get_weights(e, job);
            break;
        case RNND_JOB_SET_WEIGHTS:
            rnnd__engine_run_set_weights(e, job);
            break;
        case RNND_JOB_CHECKPOINT:
            rnnd__engine_run_checkpoint(e, job);
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

// Waits for the work of a job answered early (e->unsettled). A failure there is a kernel's that
// ran after its reply went, so the device is in an unknown state.
static void settle(struct rnnd_engine *e) {
    if (!e->unsettled)
        return;
    e->unsettled = false;
    int rc = e->be.ops->sync(e->be.ctx);
    if (rc != 0)
        rnnd_panic(__FILE__, __LINE__, "backend work answered early failed: %s", rnnd_strerror(rc));
}

// Runs what a poll handed out (under emu): control jobs, refusals, then the Step batch.
void rnnd__engine_process(struct rnnd_engine *e, struct rnnd_batch *b, bool lookahead) {
    struct rnnd_job *next;
    for (struct rnnd_job *job = (struct rnnd_job *)b->controls; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        settle(e);
        run_control(e, job);
    }
    for (struct rnnd_job *job = (struct rnnd_job *)b->rejected; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        job->done(job);
    }
    settle(e);
    if (b->items)
        rnnd__engine_run_step_batch(e, (struct rnnd_job *)b->items, lookahead);
    if (e->ends_held)
        rnnd__engine_run_ends_held(e);
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
        e->replies = rnnd_threadpool_init(e->cfg.reply_threads, "rnnd-reply");
        e->row_workers = rnnd_threadpool_init(e->cfg.reply_threads, "rnnd-rows");
        rnnd_threadpool_spin(e->row_workers, e->cfg.engine_spin_us);
        atomic_store_explicit(&e->inline_steps,
                              e->cfg.inline_steps && (e->host_mem || e->be.ops->bind),
                              memory_order_release);
        // Logged before the engine reports ready, so that they precede "rnnd ready".
        rnnd_log(RNND_LOG_INFO,
                 "engine ready: %s backend on %s, %s I=%d H=%d L=%d %s, %zu parameters, "
                 "%d env slots; kernels for %d rows: %s",
                 e->backend_name, e->device, rnnd_config_cell_name(e->model.cell), e->model.I,
                 e->model.H, e->model.L, rnnd_config_compute_name(e->model.compute), e->P,
                 e->cfg.max_envs, e->cfg.max_batch, e->plan);
        rnnd_log(RNND_LOG_INFO,
                 "Step batches: up to %d rows, waiting up to %d us for more; look-ahead %s; "
                 "%d reply threads and as many row workers",
                 e->cfg.max_batch, e->max_delay_us, e->lookahead ? "on" : "off",
                 rnnd_threadpool_workers(e->replies));
    }
    e->ready_cb(e->ready_ctx, rc, msg);
    if (rc == 0) {
        bool spin = false;
        for (;;) {
            struct rnnd_batch b;
            uint64_t wait;
            pthread_mutex_lock(&e->emu);
            bool got = rnnd__engine_poll(e, true, &b, &wait);
            if (got)
                rnnd__engine_process(e, &b, e->lookahead);
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
        rnnd_threadpool_free(e->replies); // sends the replies still queued first
        rnnd_threadpool_free(e->row_workers);
        e->replies = e->row_workers = NULL;
        // The marker goes only once the final state is on disk: a failed shutdown checkpoint
        // leaves it, so the next start warns that the restored checkpoint is older.
        e->final_failed = rnnd__engine_checkpoint_auto(e, "shutdown") != 0;
        if (!e->final_failed && e->cfg.state_dir[0]) {
            char marker[RNND_CONFIG_PATH_MAX + 32];
            rnnd__engine_running_marker(e, marker, sizeof(marker));
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
    e->core = rnnd_model_core(&e->model);
    e->policy = rnnd_model_has_policy(&e->model);
    e->prow = rnnd_policy_row(&e->model);
    e->enc_acts = rnnd_model_encoder_acts(&e->model);
    e->tdims = (struct rnnd_traj_dims){.I = e->model.I,
                                       .E = cfg->extras_size,
                                       .L = e->model.L,
                                       .H = e->model.H,
                                       .lstm = e->lstm,
                                       .cap = cfg->trajectory_steps};
    struct rnnd_batcher_config bc = {
        .max_batch = cfg->max_batch,
        .max_delay_ns = 0, // engine_open sets it: -1 resolves with the backend
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
    pthread_setname_np(e->thread, "rnnd-engine");
    e->thread_started = true;
    return 0;
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
