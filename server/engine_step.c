/*
 * engine_step.c: the engine's Step path (see engine.h): admitting each queued Step against the
 * env table (and the vote of a Step split over several engines), running a batch of admitted
 * Steps as one backend step (gathered into one packed block, one copy each way, recorded into
 * the trajectory store on the backend), the row workers that share a big batch's per-row copies
 * and the reply threads that send its replies; the EndEpisodes that wait for envs a held Step
 * part holds; and the public entry points that queue a Step, where with the CPU backend the
 * submitting thread may run the batch itself (inline steps).
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "engine_impl.h"
#include "log.h"
#include "metrics.h"

// ---------------------------------------------------------------------------------------------
// Step batches

struct step_layout rnnd__engine_step_layout(const struct rnnd_engine *e, int n) {
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
    const struct rnnd_policy_row *pr = &e->prow;
    if (pr->action >= 0) {
        l.keys = carve_off(&in, rows * sizeof(uint64_t));
        l.ksteps = carve_off(&in, rows * sizeof(uint64_t));
        l.greedy = carve_off(&in, rows);
    }
    l.in_used = in;
    l.out = carve_off(&out, rows * (size_t)e->model.H * sizeof(float));
    if (pr->dist >= 0) {
        l.dist = carve_off(&out, rows * (size_t)pr->ndist * sizeof(float));
        if (e->model.policy.K > 0)
            l.index = carve_off(&out, rows * sizeof(int64_t));
        else
            l.action = carve_off(&out, rows * (size_t)pr->naction * sizeof(float));
        l.logp = carve_off(&out, rows * sizeof(float));
    }
    if (pr->value >= 0)
        l.value = carve_off(&out, rows * sizeof(float));
    l.out_used = out;
    if (record) {
        l.hb = carve_off(&out, rows * e->LH * sizeof(float));
        l.cb = e->lstm ? carve_off(&out, rows * e->LH * sizeof(float)) : 0;
    }
    if (e->enc_acts)
        l.acts = carve_off(&out, rows * (size_t)e->enc_acts * sizeof(float));
    l.out_all = out;
    return l;
}

// The hints of a Step's source (struct step_hint).
static struct step_hint *step_hint_of(struct rnnd_engine *e, uint64_t source) {
    return &e->step_hints[(source * 0x9e3779b97f4a7c15ull) >> 56]; // 256 entries
}

// An admitted Step's env slots become its source's hints (kept as they were if out of memory).
static void step_hint_keep(struct rnnd_engine *e, const struct rnnd_job *job) {
    const struct rnnd_step_job *s = &job->step;
    struct step_hint *h = step_hint_of(e, job->item.source);
    if (h->cap < s->B) {
        int32_t *p = realloc(h->slots, (size_t)s->B * sizeof(int32_t));
        if (p == NULL)
            return;
        h->slots = p;
        h->cap = s->B;
    }
    for (int r = 0; r < s->B; r++)
        h->slots[r] = s->envs[r]->slot;
    h->source = job->item.source;
    h->n = s->B;
}

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
    step_hint_keep(e, job);
    return RNND_BATCH_ADMIT;
}

enum rnnd_batch_admit rnnd__engine_admit_step(void *ctx, struct rnnd_batch_item *item) {
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
    // Rows with a hint try the slot their source's last Step had there first.
    const struct step_hint *h = step_hint_of(e, job->item.source);
    int hn = h->source == job->item.source ? (h->n < s->B ? h->n : s->B) : 0;
    rnnd_envtable_prefetch_hints(e->envs, s->env_ids, h->slots, hn);
    rnnd_envtable_prefetch(e->envs, s->env_ids + hn, s->B - hn);
    for (int r = 0; r < s->B; r++) {
        struct rnnd_env *env = r < hn ? rnnd_envtable_find_hint(e->envs, s->env_ids[r], h->slots[r])
                                      : rnnd_envtable_find(e->envs, s->env_ids[r]);
        if (env && env->busy)
            return RNND_BATCH_HOLD; // its previous step still runs (the look-ahead, below)
        s->envs[r] = env;
        s->repeat[r] = 0;
        bool earned = (s->reward && s->reward[r] != 0.0f) || (s->done && s->done[r]) ||
                      (s->truncated && s->truncated[r]);
        if (earned && (env == NULL || env->traj.count == 0)) {
            rnnd_job_fail(job, RNND_EPRECOND,
                          "env %" PRIu64 " (row %d) has no recorded step to take reward %g, "
                          "done %d, truncated %d for (it is new, ended or evicted); send 0 and "
                          "false with an env's first step",
                          s->env_ids[r], r, s->reward ? (double)s->reward[r] : 0.0,
                          s->done ? s->done[r] : 0, s->truncated ? s->truncated[r] : 0);
            return step_refuse(s);
        }
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
    step_hint_keep(e, job);
    return RNND_BATCH_ADMIT;
}

// A batch's per-row work that needs no engine-wide state (rows of a batch belong to distinct
// envs, so they touch disjoint memory): before the step, gathering each row's inputs into the
// input block; after it, each env's bookkeeping and copying each row's output to its job (and to
// its env's cache for retries), in chunks of rows that any row worker may take.
struct row_task {
    struct rnnd_engine *e;
    const struct step_batch *b;
    void (*rows)(struct row_task *t, int first, int last);
    int parts;        // threads that take chunks: the row workers and the engine, or the engine
    _Atomic int next; // next chunk's first row
};

// A Step batch from its gather to its finish: its jobs, its rows and the buffer set its blocks
// lie in (struct step_bufs), how its backend work went, and its rows' finishing.
struct step_batch {
    struct rnnd_job *jobs;
    struct step_bufs *buf;
    struct step_layout lay;
    uint64_t now, version;
    uint64_t backend_ns; // the engine's time in the backend for it: launching, then waiting
    int n, rc;
    bool done; // its backend work is over (it ran at once, or was waited for)
    struct row_task fin;
};

// Row i's policy reply row (W floats, struct rnnd_policy_row) from the output block's columns.
static void policy_row_gather(const struct rnnd_engine *e, const struct row_task *t, int i,
                              float *row) {
    const struct rnnd_policy_row *pr = &e->prow;
    const struct step_layout *l = &t->b->lay;
    const char *outb = t->b->buf->h_outb;
    if (pr->dist >= 0) {
        size_t nd = (size_t)pr->ndist, na = (size_t)pr->naction;
        memcpy(row + pr->dist, (const float *)(outb + l->dist) + (size_t)i * nd,
               nd * sizeof(float));
        if (e->model.policy.K > 0)
            row[pr->action] = (float)((const int64_t *)(outb + l->index))[i];
        else
            memcpy(row + pr->action, (const float *)(outb + l->action) + (size_t)i * na,
                   na * sizeof(float));
        row[pr->logp] = ((const float *)(outb + l->logp))[i];
    }
    if (pr->value >= 0)
        row[pr->value] = ((const float *)(outb + l->value))[i];
}

// Row r of a job's core output from H fp32 values, in the reply's dtype (narrowed here, where
// the row is in cache, rather than in a second pass over the reply).
static void out_row(struct rnnd_step_job *s, int r, const float *src, size_t H) {
    size_t fb = rnnd_ftype_bytes(s->out_dtype);
    rnnd_cast_host((char *)s->out + (size_t)r * H * fb, s->out_dtype, src, RNND_FTYPE_F32, H);
}

// Rows first..last-1 of the input block: obs, is_init, state rows, sampling keys, and where
// each is recorded. Each env is busy until its batch is finished (step_finish).
static void gather_rows(struct row_task *t, int first, int last) {
    struct rnnd_engine *e = t->e;
    const struct step_batch *b = t->b;
    const struct step_layout *l = &b->lay;
    size_t I = (size_t)e->model.I, E = (size_t)e->tdims.E;
    bool record = e->tdims.cap > 0, act = e->prow.action >= 0;
    char *in = b->buf->h_in;
    for (int i = first; i < last; i++) {
        const struct rnnd_step_job *s = &b->buf->rows[i].job->step;
        int r = b->buf->rows[i].row;
        struct rnnd_env *env = s->envs[r];
        env->busy = true;
        memcpy((float *)(in + l->x) + (size_t)i * I, s->obs + (size_t)r * I, I * sizeof(float));
        ((uint8_t *)(in + l->init))[i] = s->is_init[r];
        ((int32_t *)(in + l->slots))[i] = (int32_t)env_row(e, env);
        ((int32_t *)(in + l->slots_new))[i] = (int32_t)env_row_next(e, env);
        if (act) {
            // The action's key: the step's index when the client numbers its steps (a replay,
            // or a retry after the cache is gone, draws the same), else the env's own count
            // of steps.
            ((uint64_t *)(in + l->keys))[i] = s->env_ids[r];
            ((uint64_t *)(in + l->ksteps))[i] = s->step_index ? s->step_index[r] : env->steps;
            ((uint8_t *)(in + l->greedy))[i] = s->greedy;
        }
        if (record) {
            // Where the step is recorded: the env's next ring position (taken only once the
            // step has run, finish_rows).
            ((int32_t *)(in + l->trows))[i] = rnnd_traj_next(&env->traj, &e->tdims, env->slot);
            ((uint64_t *)(in + l->version))[i] = b->version;
            float *x = (float *)(in + l->extras) + (size_t)i * E;
            if (E && s->extras)
                memcpy(x, s->extras + (size_t)r * E, E * sizeof(float));
            else if (E)
                memset(x, 0, E * sizeof(float));
        }
    }
}

// Rows first..last-1 once the step has run: each env's bookkeeping (its state row, its ring of
// recorded steps, its retry index), then its output row and cached output. Use order (the env
// table's list) and the end of busy are left to the engine thread: that list is shared, and the
// engine admits the next batch while the row workers run this (admission reads busy first).
static void finish_rows(struct row_task *t, int first, int last) {
    struct rnnd_engine *e = t->e;
    const struct step_batch *b = t->b;
    size_t H = (size_t)e->model.H, W = (size_t)e->prow.W;
    bool record = e->tdims.cap > 0;
    const float *h_out = (const float *)(b->buf->h_outb + b->lay.out);
    for (int i = first; i < last; i++) {
        struct rnnd_step_job *s = &b->buf->rows[i].job->step;
        int r = b->buf->rows[i].row;
        struct rnnd_env *env = s->envs[r];
        env->half ^= 1; // its new state is in the other row now
        env->steps++;
        if (e->prec && env->traj.count > 0 && (s->reward || s->done || s->truncated)) {
            // What the env's previous step earned, into that step's record (before this step's
            // record is written: with one step per ring they are the same row).
            int32_t prev = rnnd_traj_row(&env->traj, &e->tdims, env->slot, 1, 0);
            e->prec[(size_t)prev * e->prec_w + e->prec_w - 1] = s->reward ? s->reward[r] : 0.0f;
            e->pflags[prev] =
                (uint8_t)((s->done && s->done[r]) | ((s->truncated && s->truncated[r]) << 1));
        }
        if (record && e->tver)
            e->tver[rnnd_traj_next(&env->traj, &e->tdims, env->slot)] = b->version;
        if (record)
            rnnd_traj_push(&env->traj, &e->tdims);
        if (s->step_index) {
            env->has_index = true;
            env->last_index = s->step_index[r];
            env->out_version = b->version;
        } else {
            env->has_index = false;
        }
        const float *out = h_out + (size_t)i * H;
        out_row(s, r, out, H);
        if (W)
            policy_row_gather(e, t, i, s->pol + (size_t)r * W);
        if (e->prec) {
            // The step's record: what the policy chose; its reward comes with the next step.
            int32_t row = ((const int32_t *)(b->buf->h_in + b->lay.trows))[i];
            float *rec = e->prec + (size_t)row * e->prec_w;
            memcpy(rec, s->pol + (size_t)r * W + e->prow.ndist, (e->prec_w - 1) * sizeof(float));
            rec[e->prec_w - 1] = 0.0f;
            e->pflags[row] = 0;
        }
        if (s->step_index) {
            float *cache = rnnd_envtable_output(e->envs, env);
            memcpy(cache, out, H * sizeof(float));
            if (W)
                memcpy(cache + H, s->pol + (size_t)r * W, W * sizeof(float));
        }
    }
}

#define ROW_CHUNK           64
#define REPLY_POST_MIN_ROWS 256 // a reply of this many rows goes to a reply thread
#define ROW_PARALLEL_MIN    256 // fewer rows: one thread is quicker than waking others

// Takes chunks of rows until none is left: every part of the run (rnnd_threadpool_run) does
// the same.
static void rows_run(void *arg, int k, int parts) {
    (void)k;
    (void)parts;
    struct row_task *t = arg;
    int n = t->b->n;
    for (;;) {
        int first = atomic_fetch_add(&t->next, ROW_CHUNK);
        if (first >= n)
            return;
        t->rows(t, first, first + ROW_CHUNK < n ? first + ROW_CHUNK : n);
    }
}

// Starts fn over b's rows: the row workers take chunks from now on when there are many rows;
// rows_join takes the rest and returns when every row is done. t must live until then.
static void rows_start(struct rnnd_engine *e, struct row_task *t, const struct step_batch *b,
                       void (*fn)(struct row_task *, int, int)) {
    t->e = e;
    t->b = b;
    t->rows = fn;
    atomic_store_explicit(&t->next, 0, memory_order_relaxed);
    t->parts = b->n < ROW_PARALLEL_MIN ? 1 : rnnd_threadpool_workers(e->row_workers) + 1;
    if (t->parts > 1)
        rnnd_threadpool_start(e->row_workers, t->parts, rows_run, t);
}

static void rows_join(struct rnnd_engine *e, struct row_task *t) {
    if (t->parts > 1)
        rnnd_threadpool_join(e->row_workers);
    else
        rows_run(t, 0, 1);
}

static void rows_parallel(struct rnnd_engine *e, const struct step_batch *b,
                          void (*fn)(struct row_task *, int, int)) {
    struct row_task t;
    rows_start(e, &t, b, fn);
    rows_join(e, &t);
}

// Sends a finished Step's reply, on a reply thread.
static void reply_send(struct rnnd_threadpool_task *t) {
    struct rnnd_job *job = (struct rnnd_job *)((char *)t - offsetof(struct rnnd_job, reply));
    job->done(job);
}

// The backend work of batch b: one copy in, the kernels, one copy back, queued (done after the
// next sync).
static int step_work(struct rnnd_engine *e, const struct step_batch *b) {
    const struct step_layout *lay = &b->lay;
    const struct step_bufs *buf = b->buf;
    char *d_in = buf->d_in, *d_outb = buf->d_outb;
    int n = b->n;
    bool record = e->tdims.cap > 0, act = e->prow.action >= 0;
    int rc = be_in(e, d_in, buf->h_in, lay->in_used); // one copy: x, slots, slots_new, is_init
    const float *obs = (const float *)(d_in + lay->x), *x = obs;
    const float *params = e->cur->params;
    if (rc == 0 && e->enc_acts) {
        // The encoder's last block of activations is the core's input.
        float *acts = (float *)(d_outb + lay->acts);
        rc = e->be.ops->encoder_forward(e->be.ctx, acts, obs, n, params, &e->model);
        x = acts + (size_t)n * (size_t)(e->enc_acts - e->core.I);
    }
    struct rnnd_step st = {
        .B = n,
        .x = x,
        .is_init = (const uint8_t *)(d_in + lay->init),
        .slots = (const int32_t *)(d_in + lay->slots),
        .slots_new = (const int32_t *)(d_in + lay->slots_new),
        .state_h = e->state_h,
        .state_c = e->state_c,
        .out = (float *)(d_outb + lay->out),
        .h_before = record ? (float *)(d_outb + lay->hb) : NULL,
        .c_before = record && e->lstm ? (float *)(d_outb + lay->cb) : NULL,
        .derived = e->cur->derived,
    };
    if (rc == 0)
        rc = e->be.ops->rnn_step(e->be.ctx, &st, params, &e->core);
    if (rc == 0 && e->prow.W) {
        const struct rnnd_policy *p = &e->model.policy;
        float *dist = (float *)(d_outb + lay->dist);
        struct rnnd_heads hd = {
            .logits = p->K ? dist : NULL,
            .mean = p->A ? dist : NULL,
            .value = p->value ? (float *)(d_outb + lay->value) : NULL,
        };
        rc = e->be.ops->heads_forward(e->be.ctx, &hd, st.out, n, params, &e->model);
        if (rc == 0 && act) {
            struct rnnd_actions a = {
                .N = n,
                .logits = hd.logits,
                .mean = hd.mean,
                .index = p->K ? (int64_t *)(d_outb + lay->index) : NULL,
                .action = p->A ? (float *)(d_outb + lay->action) : NULL,
                .logp = (float *)(d_outb + lay->logp),
                .seed = e->cfg.seed,
                .env_ids = (const uint64_t *)(d_in + lay->keys),
                .steps = (const uint64_t *)(d_in + lay->ksteps),
                .greedy = (const uint8_t *)(d_in + lay->greedy),
            };
            rc = e->be.ops->policy_sample(e->be.ctx, &a, params, &e->model);
        }
    }
    if (rc == 0 && lay->out_used && !e->host_mem) // one copy back: out
        rc = e->be.ops->copy_out_async(e->be.ctx, buf->h_outb, d_outb, lay->out_used);
    // The replies wait for the work so far alone (step_sync), not for the store's.
    if (rc == 0 && e->be.ops->mark)
        rc = e->be.ops->mark(e->be.ctx);
    if (rc == 0 && record) {
        // The step's rows go into the store where they are, on the backend.
        struct rnnd_traj_rows tr = {
            .n = n,
            .rows = (const int32_t *)(d_in + lay->trows),
            .obs = (float *)obs,
            .extras = e->tdims.E ? (float *)(d_in + lay->extras) : NULL,
            .h = st.h_before,
            .c = st.c_before,
            .is_init = (uint8_t *)st.is_init,
            .version = (uint64_t *)(d_in + lay->version),
        };
        rc = e->be.ops->traj_write(e->be.ctx, &e->store, &tr, &e->model);
    }
    return rc;
}

// Waits for a step's outputs (step_work's mark): its store write may still run, before any work
// enqueued later. A 1-env Step's reply on the H200 host: ~3 us sooner (journal service-01 s28).
static int step_sync(struct rnnd_engine *e) {
    return e->be.ops->sync_mark ? e->be.ops->sync_mark(e->be.ctx) : e->be.ops->sync(e->be.ctx);
}

// step_work, replayed from a recording for its row count (rnnd_engine.step_replay), recorded
// first where there is none for the current weights; then the sync. 1: no recording could be
// made (recordings are then off: run step_work).
static int step_replayed(struct rnnd_engine *e, const struct step_batch *b) {
    struct step_replay *r = &e->step_replay[b->n];
    const float *params = e->cur->params;
    if (r->unit == NULL || r->params != params) {
        e->be.ops->free_unit(e->be.ctx, r->unit);
        *r = (struct step_replay){0};
        void *unit = NULL;
        int rc = e->be.ops->record_begin(e->be.ctx);
        if (rc == 0) {
            rc = step_work(e, b);
            int end = e->be.ops->record_end(e->be.ctx, &unit);
            rc = rc ? rc : end;
        }
        if (rc != 0 || unit == NULL) {
            rnnd_log(RNND_LOG_WARN,
                     "the backend could not record a step of %d rows (%s); steps run op by op",
                     b->n, rnnd_strerror(rc));
            e->step_replay_off = true;
            return 1;
        }
        *r = (struct step_replay){unit, params};
    }
    int rc = e->be.ops->replay(e->be.ctx, r->unit);
    return rc ? rc : step_sync(e);
}

// Forms the batch of jobs in buffer set buf: its rows, in job order (a repeated row is answered
// from its env's cache), their layout, and their inputs gathered into buf's input block.
static void step_gather(struct rnnd_engine *e, struct step_batch *b, struct rnnd_job *jobs,
                        struct step_bufs *buf) {
    uint64_t now = rnnd_now_ns();
    *b = (struct step_batch){.jobs = jobs, .buf = buf, .now = now, .version = e->cur->version};
    int n = 0;
    for (struct rnnd_job *job = jobs; job; job = (struct rnnd_job *)job->item.next) {
        struct rnnd_step_job *s = &job->step;
        rnnd_histogram_observe(&rnnd_metrics.queue_delay, now - job->item.enqueued_ns);
        for (int r = 0; r < s->B; r++)
            if (!s->repeat[r])
                buf->rows[n++] = (struct row_ref){job, r};
    }
    b->n = n;
    b->lay = rnnd__engine_step_layout(e, n);
    // The gather runs on the row workers too (none under 8 CPUs by default): on a 16-CPU host
    // it took the engine thread ~40 ns a row, a quarter of its time at 32 streams x 1024 envs.
    // Rows are independent here: a batch never holds two steps of one env.
    rows_parallel(e, b, gather_rows);
    atomic_fetch_add_explicit(&rnnd_metrics.engine_ns[RNND_PHASE_GATHER], rnnd_now_ns() - now,
                              memory_order_relaxed);
}

// Starts b's backend work: a small batch of the core alone on bufs[0] replays its recording and
// waits for it; any other is launched op by op and waited for in step_wait.
static void step_launch(struct rnnd_engine *e, struct step_batch *b) {
    if (b->n == 0) {
        b->done = true;
        return;
    }
    uint64_t t0 = rnnd_now_ns();
    int rc = 1;
    if (b->n <= STEP_REPLAY_ROWS && b->buf == &e->bufs[0] && !e->step_replay_off && !e->enc_acts &&
        !e->prow.W)
        rc = step_replayed(e, b);
    b->done = rc != 1;
    b->rc = rc == 1 ? step_work(e, b) : rc;
    b->backend_ns = rnnd_now_ns() - t0;
}

static void step_wait(struct rnnd_engine *e, struct step_batch *b) {
    if (!b->done) {
        uint64_t t0 = rnnd_now_ns();
        if (b->rc == 0)
            b->rc = step_sync(e);
        b->backend_ns += rnnd_now_ns() - t0;
        b->done = true;
    }
    if (b->n > 0) {
        rnnd_metrics_kernel(RNND_OP_STEP, b->backend_ns);
        atomic_fetch_add_explicit(&rnnd_metrics.batches, 1, memory_order_relaxed);
        rnnd_histogram_observe(&rnnd_metrics.batch_rows, (uint64_t)b->n);
        atomic_fetch_add_explicit(&rnnd_metrics.env_steps, (uint64_t)b->n, memory_order_relaxed);
    }
}

// The look-ahead's next batch, admitted while b runs on the backend (its envs must not be b's or
// the batch being finished: admission holds those): its jobs, or NULL when b is already done,
// when nothing is ready, or when control jobs wait (they run between batches).
static struct rnnd_job *step_admit_next(struct rnnd_engine *e, const struct step_batch *b) {
    if (b->done || b->rc != 0 || rnnd_batcher_controls(e->batcher))
        return NULL;
    struct rnnd_batch nb;
    uint64_t wait;
    if (!rnnd__engine_poll(e, false, &nb, &wait))
        return NULL;
    struct rnnd_job *job, *after;
    for (job = (struct rnnd_job *)nb.rejected; job; job = after) {
        after = (struct rnnd_job *)job->item.next;
        job->done(job);
    }
    return (struct rnnd_job *)nb.items;
}

// Once b's backend work is done: its rows go to the row workers (finish_rows), which step_finish
// joins.
static void step_finish_start(struct rnnd_engine *e, struct step_batch *b) {
    if (b->rc == 0)
        rows_start(e, &b->fin, b, finish_rows);
}

// After step_finish_start: each env's bookkeeping and the jobs' outputs (the rows the workers
// have not taken), the envs' end of busy and use order, then the replies. more: a batch is
// admitted behind this one and waits for this thread.
static void step_finish(struct rnnd_engine *e, struct step_batch *b, bool more) {
    size_t H = (size_t)e->model.H, LH = e->LH;
    int rc = b->rc;
    if (rc != 0) {
        // A store row may have been written by now (where a full ring keeps its oldest step):
        // only a device failure gets that far, and it ends the daemon.
        if (rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "backend step failed: %s", rnnd_strerror(rc));
        rnnd_log(RNND_LOG_ERROR, "backend step of %d rows failed: %s", b->n, rnnd_strerror(rc));
        for (int i = 0; i < b->n; i++)
            b->buf->rows[i].job->step.envs[b->buf->rows[i].row]->busy = false;
    }
    // Per computed row: the env's bookkeeping and the row's outputs (finish_rows), then its
    // place in the env table's use order (shared by every row: this thread).
    uint64_t t_update = rnnd_now_ns(), now = b->now;
    if (rc == 0) {
        rows_join(e, &b->fin);
        for (int i = 0; i < b->n; i++) {
            const struct row_ref *rr = &b->buf->rows[i];
            struct rnnd_env *env = rr->job->step.envs[rr->row];
            env->busy = false;
            rnnd_envtable_touch(e->envs, env, now);
        }
    }
    // Gauges first: a client that reads them after its reply sees its envs.
    rnnd__engine_env_gauges(e);
    // Per job: repeated rows from the cache, states when asked (engine state: this thread).
    int njobs = 0;
    for (struct rnnd_job *job = b->jobs; job; job = (struct rnnd_job *)job->item.next) {
        struct rnnd_step_job *s = &job->step;
        job->model_version = b->version;
        njobs++;
        if (rc != 0) {
            rnnd_job_fail(job, RNND_EDEVICE, "the backend failed to run the step: %s; retry",
                          rnnd_strerror(rc));
            continue;
        }
        for (int r = 0; r < s->B; r++) {
            struct rnnd_env *env = s->envs[r];
            if (s->repeat[r]) {
                const float *cache = rnnd_envtable_output(e->envs, env);
                out_row(s, r, cache, H);
                if (e->prow.W)
                    memcpy(s->pol + (size_t)r * (size_t)e->prow.W, cache + H,
                           (size_t)e->prow.W * sizeof(float));
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
    // Then the replies: several, one of many rows, or any while more Steps wait (admitted behind
    // this batch or queued) go to the reply threads; a lone small reply is quicker sent from
    // here. Packing a 1024-row reply took 209 us on this thread (H200 host, fp32), longer than
    // the gather, the kernel and the update together, and held the next batch; sending one of
    // 64 rows, ~20 us.
    struct rnnd_job *jobs = b->jobs;
    if ((more || njobs > 1 || jobs->step.B >= REPLY_POST_MIN_ROWS ||
         rnnd_batcher_rows(e->batcher) > 0) &&
        rnnd_threadpool_workers(e->replies) > 0) {
        struct rnnd_job *last = jobs;
        for (struct rnnd_job *job = jobs; job; job = (struct rnnd_job *)job->item.next) {
            struct rnnd_job *next = (struct rnnd_job *)job->item.next;
            job->reply =
                (struct rnnd_threadpool_task){.fn = reply_send, .next = next ? &next->reply : NULL};
            last = job;
        }
        rnnd_threadpool_post(e->replies, &jobs->reply, &last->reply);
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

void rnnd__engine_run_step_batch(struct rnnd_engine *e, struct rnnd_job *jobs, bool lookahead) {
    // Batches in a chain. While batch N runs on the backend and the row workers finish N-1's
    // rows, the engine admits N+1; then it sends N-1's replies, gathers N+1 into N-1's buffer
    // set, waits for N, launches N+1 and hands N's rows to the workers. The backend's time
    // (copies, kernels, the sync: ~115 us of ~560 a 4096-row batch on an H200 host) and the
    // rows' finishing overlap the engine's own work. Off by default where the backend's memory
    // is host memory: its step runs at once.
    struct step_batch b[2], *cur = &b[0], *prev = &b[1];
    bool finishing = false; // prev's rows are being finished
    step_gather(e, cur, jobs, &e->bufs[0]);
    step_launch(e, cur);
    for (;;) {
        struct rnnd_job *next = lookahead ? step_admit_next(e, cur) : NULL;
        if (finishing)
            step_finish(e, prev, next != NULL);
        if (next)
            step_gather(e, prev, next, cur->buf == &e->bufs[0] ? &e->bufs[1] : &e->bufs[0]);
        step_wait(e, cur);
        if (next)
            step_launch(e, prev);
        step_finish_start(e, cur);
        if (next == NULL) {
            step_finish(e, cur, false);
            return;
        }
        struct step_batch *ran = cur;
        cur = prev;
        prev = ran;
        finishing = true;
    }
}

// ---------------------------------------------------------------------------------------------
// EndEpisodes

// False when an env of the job is held by a Step part that waits for its other devices: that
// Step was admitted first, so the EndEpisodes waits in e->ends_held and runs after it
// (rnnd__engine_process).
bool rnnd__engine_run_end(struct rnnd_engine *e, struct rnnd_job *job) {
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
            rnnd__engine_env_drop(e, env, RNND_EVICT_RELEASED);
            released++;
        }
    }
    job->end.released = released;
    rnnd__engine_env_gauges(e);
    return true;
}

// The EndEpisodes that waited for held envs, once those Steps ran or gave up.
void rnnd__engine_run_ends_held(struct rnnd_engine *e) {
    struct rnnd_job *list = e->ends_held, *next;
    e->ends_held = NULL;
    for (struct rnnd_job *job = list; job; job = next) {
        next = (struct rnnd_job *)job->item.next;
        if (rnnd__engine_run_end(e, job))
            job->done(job);
    }
}

// ---------------------------------------------------------------------------------------------
// Public API: queueing a Step

static struct rnnd_batch_item *step_item(struct rnnd_job *job) {
    job->kind = RNND_JOB_STEP;
    job->item.B = job->step.B;
    job->item.env_ids = job->step.env_ids;
    return &job->item;
}

bool rnnd__engine_poll(struct rnnd_engine *e, bool controls, struct rnnd_batch *b, uint64_t *wait) {
    uint64_t t0 = rnnd_now_ns();
    bool got = controls
                   ? rnnd_batcher_poll(e->batcher, t0, rnnd__engine_admit_step, e, b, wait)
                   : rnnd_batcher_poll_steps(e->batcher, t0, rnnd__engine_admit_step, e, b, wait);
    if (b->items)
        atomic_fetch_add_explicit(&rnnd_metrics.engine_ns[RNND_PHASE_ADMIT], rnnd_now_ns() - t0,
                                  memory_order_relaxed);
    return got;
}

// If the engine is idle, this thread becomes the engine for one poll and runs the batch itself,
// saving the hand-off to the engine thread and back; with no look-ahead, so that it goes back to
// its own calls after one batch.
static void step_run_inline(struct rnnd_engine *e) {
    if (pthread_mutex_trylock(&e->emu) == 0) {
        struct rnnd_batch b;
        uint64_t wait;
        bool bound = e->be.ops->bind == NULL || e->be.ops->bind(e->be.ctx) == 0;
        if (bound && rnnd__engine_poll(e, false, &b, &wait))
            rnnd__engine_process(e, &b, false); // the job may be finished and freed here
        bool empty = rnnd_batcher_empty(e->batcher);
        pthread_mutex_unlock(&e->emu);
        if (empty)
            return;
    }
    rnnd_batcher_wake(e->batcher); // busy, or something left to do (controls, a timer)
}

// A Step of at most this many rows may run inline on a device backend: on an H200 host the
// hand-off to the engine thread and back cost a 1-env Step ~13 us of its ~100 us p50
// (docs/benchmarks.md). Larger Steps go to the engine thread, whose look-ahead overlaps their
// host work with the device's.
#define INLINE_DEVICE_ROWS 64

int rnnd_engine_submit_step(struct rnnd_engine *e, struct rnnd_job *job) {
    if (!atomic_load_explicit(&e->inline_steps, memory_order_acquire) ||
        (!e->host_mem && job->step.B > INLINE_DEVICE_ROWS))
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
    if (e->host_mem && atomic_load_explicit(&e->inline_steps, memory_order_acquire))
        step_run_inline(e);
    else
        rnnd_batcher_wake(e->batcher);
}
