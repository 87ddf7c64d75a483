/*
 * group.c: the engines of this daemon and its place among several instances (see group.h).
 *
 * A job for several engines is a fan: one allocation holding the parts (one engine job each,
 * with their own arrays where the rows differ) and what is needed to merge them. Each part's
 * done runs on its engine's thread; the last one merges into the caller's job and calls its
 * done (after undoing, for a Forward, what the parts that succeeded kept). Parts of one fan that
 * meet in a collective must reach every engine in the same order as every other collective, and
 * the parts of Steps, which hold their envs while they wait for each other, must too: all
 * multi-engine submissions happen under g->lock.
 *
 * Start-up with several devices or instances runs on a thread of its own (the starter), since
 * forming communicators blocks: wait until every engine is ready, check that NCCL (or the cpu
 * stand-in) is there, meet the other instances (cluster.c), join the communicators (one COMM job
 * per engine, which the engines run concurrently), and SYNC every replica to replica 0.
 */
#include "group.h"

#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster.h"
#include "log.h"
#include "metrics.h"
#include "shm.h"

// Tape ids of a Forward split over several devices (group.h).
#define TAPE_GROUP_BIT  (1ull << 63)
#define TAPE_H0_BIT     (1ull << 16)
#define TAPE_HIDDEN_BIT (1ull << 17)
#define TAPE_SEQ_SHIFT  20
#define TAPE_MASK(id)   ((unsigned)((id)&0xffffu))

struct pending {
    uint64_t token;
    struct rnnd_job *job;
    struct pending *next;
};

struct ready_slot {
    struct rnnd_group *g;
    int index;
};

struct rnnd_group {
    struct rnnd_config cfg;
    int n; // devices (engines)
    struct rnnd_engine *e[RNND_MAX_DEVICES];
    struct ready_slot slots[RNND_MAX_DEVICES];
    int rank, world; // this instance among --world-size (0 of 1 alone)
    size_t I, H, LH, E, P;
    size_t W; // floats of a Step's policy reply row (struct rnnd_policy_row)
    bool lstm;

    rnnd_engine_ready_cb ready_cb;
    rnnd_group_lost_cb lost_cb;
    void *cb_ctx;
    pthread_t starter;
    bool starter_started;
    _Atomic bool aborting; // stop: the starter gives up waiting for other instances

    // Orders multi-engine submissions; guards everything below.
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int ready_count, ready_err;
    char ready_msg[512];
    uint64_t tape_seq;
    struct rnnd_cluster *cluster;
    struct pending *pending; // our calls proposed to rank 0, waiting for their commit
    uint64_t next_token;
    bool stopping; // rnnd_group_stop: multi-engine jobs go to no engine rather than to some
    bool broken;   // the group of instances is gone: no more updates
    char broken_why[512];
    char device_name[256];
};

// ---------------------------------------------------------------------------------------------
// Fans

struct fan;
typedef void (*fan_finish_fn)(struct fan *f);
typedef bool (*fan_undo_fn)(struct fan *f);

// The most outputs of a parent job the fan frees (a recorded Forward of a policy model).
#define FAN_OUTPUTS 17

struct fan {
    struct rnnd_group *g;
    struct rnnd_job *parent;
    fan_finish_fn finish; // merges the parts into parent (parent->err is set from them first)
    // When a part failed: takes back what the other parts did, by submitting the parts again as
    // other jobs, and returns true (the parts finish once more, then finish and the parent's done
    // run); false when there is nothing to take back.
    fan_undo_fn undo;
    bool undone;
    _Atomic int left;
    int n;                           // parts
    int engine[RNND_MAX_DEVICES];    // each part's engine
    int32_t *rows[RNND_MAX_DEVICES]; // Step: each part's rows in the parent
    float *copy[RNND_MAX_DEVICES];   // GetWeights: each device's weights (part 0: the parent's)
    struct rnnd_step_vote vote;      // Step
    // Forward, Backward: the parent's outputs, which the parts fill and the fan frees once the
    // parent's done has returned (outputs are valid until then: engine.h).
    void *outputs[FAN_OUTPUTS];
    struct rnnd_job parts[RNND_MAX_DEVICES];
};

// The device that holds env id (place.h).
static int device_of(const struct rnnd_group *g, uint64_t id) {
    return rnnd_place(id, g->n, g->cfg.place_block);
}

static void outputs_free(void *const *p, int n) {
    for (int i = 0; i < n; i++)
        free(p[i]);
}

// Bump allocation of a fan and its arrays in one calloc: measure with base NULL, then carve.
struct bump {
    char *base;
    size_t used;
};

static void *take(struct bump *b, size_t bytes) {
    size_t at = (b->used + 15) / 16 * 16;
    b->used = at + bytes;
    return b->base ? b->base + at : NULL;
}

static void part_done(struct rnnd_job *part) {
    struct fan *f = part->owner;
    if (atomic_fetch_sub(&f->left, 1) != 1)
        return;
    struct rnnd_job *p = f->parent;
    if (!f->undone) {
        p->err = 0;
        p->msg[0] = '\0';
        p->model_version = f->parts[0].model_version;
        for (int i = 0; i < f->n; i++) {
            if (f->parts[i].err && p->err == 0) {
                p->err = f->parts[i].err;
                memcpy(p->msg, f->parts[i].msg, sizeof(p->msg));
            }
        }
        f->undone = true;
        if (p->err && f->undo && f->undo(f))
            return;
    }
    if (f->finish)
        f->finish(f);
    p->done(p);
    outputs_free(f->outputs, FAN_OUTPUTS);
    free(f);
}

// A part for engine k of parent, as a copy of the parent's job with the fan as its owner.
static struct rnnd_job *part_init(struct fan *f, int i, const struct rnnd_job *parent) {
    struct rnnd_job *q = &f->parts[i];
    *q = *parent;
    q->item = (struct rnnd_batch_item){.source = parent->item.source};
    q->owner = f;
    q->aux = NULL;
    q->done = part_done;
    q->err = 0;
    q->msg[0] = '\0';
    return q;
}

// Queues every part on its engine, under the group lock so that collectives keep one order.
static void fan_submit(struct fan *f) {
    struct rnnd_group *g = f->g;
    int n = f->n; // f is freed by the last part to finish, maybe before the loop ends
    atomic_store(&f->left, n);
    pthread_mutex_lock(&g->lock);
    bool stopping = g->stopping;
    for (int i = 0; !stopping && i < n; i++)
        rnnd_engine_submit(g->e[f->engine[i]], &f->parts[i]);
    pthread_mutex_unlock(&g->lock);
    if (stopping) {
        // The engines stop taking jobs one after the other: the job goes to none of them.
        rnnd_job_fail(f->parent, RNND_EUNAVAIL, "rnnd is shutting down; retry on another replica");
        f->parent->done(f->parent);
        outputs_free(f->outputs, FAN_OUTPUTS);
        free(f);
    }
}

static struct fan *fan_new(struct rnnd_group *g, struct rnnd_job *parent, size_t extra,
                           struct bump *b) {
    struct fan *f = calloc(1, sizeof(*f) + extra + 16);
    if (f == NULL)
        return NULL;
    f->g = g;
    f->parent = parent;
    *b = (struct bump){(char *)(f + 1), 0};
    return f;
}

// The same job on every engine (k = i).
static void fan_all(struct rnnd_group *g, struct rnnd_job *job, fan_finish_fn finish) {
    struct bump b;
    struct fan *f = fan_new(g, job, 0, &b);
    if (f == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM, "out of memory");
        job->done(job);
        return;
    }
    f->finish = finish;
    f->n = g->n;
    for (int i = 0; i < g->n; i++) {
        part_init(f, i, job);
        f->engine[i] = i;
    }
    fan_submit(f);
}

// ---------------------------------------------------------------------------------------------
// Step

static void step_merge(struct fan *f) {
    struct rnnd_group *g = f->g;
    struct rnnd_step_job *s = &f->parent->step;
    uint64_t version = UINT64_MAX;
    for (int i = 0; i < f->n; i++) {
        struct rnnd_step_job *q = &f->parts[i].step;
        if (f->parts[i].model_version < version)
            version = f->parts[i].model_version;
        if (f->parent->err)
            continue;
        for (int r = 0; r < q->B; r++) {
            int at = f->rows[i][r];
            size_t ob = g->H * rnnd_ftype_bytes(s->out_dtype);
            memcpy((char *)s->out + (size_t)at * ob, (const char *)q->out + (size_t)r * ob, ob);
            if (s->pol)
                memcpy(s->pol + (size_t)at * g->W, q->pol + (size_t)r * g->W, g->W * sizeof(float));
            if (s->return_state) {
                memcpy(s->h + (size_t)at * g->LH, q->h + (size_t)r * g->LH, g->LH * sizeof(float));
                if (g->lstm)
                    memcpy(s->c + (size_t)at * g->LH, q->c + (size_t)r * g->LH,
                           g->LH * sizeof(float));
            }
        }
    }
    // Rows may have run on either side of an update on different devices: the oldest version.
    f->parent->model_version = version;
}

// Whoever cast the last vote: the engines holding parts run them, or give them up.
static void step_decided(struct rnnd_step_vote *v) {
    struct fan *f = (struct fan *)((char *)v - offsetof(struct fan, vote));
    for (int i = 0; i < f->n; i++)
        rnnd_engine_wake(f->g->e[f->engine[i]]);
}

// A part its engine would not queue: finished here, as the engine would have refused it.
static void step_refused(struct rnnd_group *g, int k, struct rnnd_job *part, int rc) {
    rnnd_step_vote_cast(part->step.vote, false);
    if (rc == RNND_EFULL) {
        rnnd_metrics_limit_hit(RNND_LIMIT_QUEUE_ROWS);
        rnnd_job_fail(
            part, rc,
            "the Step queue of device %d is full (%d rows waiting, --max-queue-rows %d per "
            "device); retry after a short backoff or add replicas",
            k, rnnd_engine_queue_rows(g->e[k]), rnnd_config_queue_rows(&g->cfg));
    } else if (rc == RNND_EUNAVAIL) {
        rnnd_job_fail(part, rc, "rnnd is shutting down; retry on another replica");
    } else {
        rnnd_job_fail(part, rc, "cannot queue the Step on device %d: %s", k, rnnd_strerror(rc));
    }
    part->done(part);
}

int rnnd_group_submit_step(struct rnnd_group *g, struct rnnd_job *job) {
    if (g->n == 1)
        return rnnd_engine_submit_step(g->e[0], job);
    struct rnnd_step_job *s = &job->step;
    int count[RNND_MAX_DEVICES] = {0}, used = 0, only = 0;
    for (int r = 0; r < s->B; r++)
        count[device_of(g, s->env_ids[r])]++;
    for (int k = 0; k < g->n; k++)
        if (count[k]) {
            used++;
            only = k;
        }
    if (used == 1) // every env of the call lives on one device: no copies
        return rnnd_engine_submit_step(g->e[only], job);

    struct bump b = {0};
    struct fan *f = NULL;
    int engine[RNND_MAX_DEVICES];
    struct rnnd_step_job parts[RNND_MAX_DEVICES] = {0};
    for (int pass = 0; pass < 2; pass++) {
        int i = 0;
        for (int k = 0; k < g->n; k++) {
            if (count[k] == 0)
                continue;
            size_t nk = (size_t)count[k];
            struct rnnd_step_job *q = &parts[i];
            q->B = count[k];
            q->env_ids = take(&b, nk * sizeof(uint64_t));
            q->obs = take(&b, nk * g->I * sizeof(float));
            q->is_init = take(&b, nk);
            q->step_index = s->step_index ? take(&b, nk * sizeof(uint64_t)) : NULL;
            q->extras = s->extras && g->E ? take(&b, nk * g->E * sizeof(float)) : NULL;
            q->return_state = s->return_state;
            q->greedy = s->greedy;
            q->reward = s->reward ? take(&b, nk * sizeof(float)) : NULL;
            q->done = s->done ? take(&b, nk) : NULL;
            q->truncated = s->truncated ? take(&b, nk) : NULL;
            q->out = take(&b, nk * g->H * rnnd_ftype_bytes(s->out_dtype));
            q->out_dtype = s->out_dtype;
            q->pol = s->pol ? take(&b, nk * g->W * sizeof(float)) : NULL;
            q->h = s->return_state ? take(&b, nk * g->LH * sizeof(float)) : NULL;
            q->c = s->return_state && g->lstm ? take(&b, nk * g->LH * sizeof(float)) : NULL;
            q->envs = take(&b, nk * sizeof(struct rnnd_env *));
            q->repeat = take(&b, nk);
            int32_t *rows = take(&b, nk * sizeof(int32_t));
            if (f)
                f->rows[i] = rows;
            engine[i] = k;
            i++;
        }
        if (pass == 0) {
            f = fan_new(g, job, b.used, &b);
            if (f == NULL)
                return RNND_ENOMEM;
            f->n = i;
            f->finish = step_merge;
            memcpy(f->engine, engine, sizeof(engine));
        }
    }
    // Gather each part's rows.
    int fill[RNND_MAX_DEVICES] = {0}, part_of[RNND_MAX_DEVICES];
    for (int i = 0; i < f->n; i++)
        part_of[engine[i]] = i;
    for (int r = 0; r < s->B; r++) {
        int i = part_of[device_of(g, s->env_ids[r])], at = fill[i]++;
        struct rnnd_step_job *q = &parts[i];
        f->rows[i][at] = r;
        ((uint64_t *)q->env_ids)[at] = s->env_ids[r];
        memcpy((float *)q->obs + (size_t)at * g->I, s->obs + (size_t)r * g->I,
               g->I * sizeof(float));
        ((uint8_t *)q->is_init)[at] = s->is_init[r];
        if (q->step_index)
            ((uint64_t *)q->step_index)[at] = s->step_index[r];
        if (q->reward)
            ((float *)q->reward)[at] = s->reward[r];
        if (q->done)
            ((uint8_t *)q->done)[at] = s->done[r];
        if (q->truncated)
            ((uint8_t *)q->truncated)[at] = s->truncated[r];
        if (q->extras)
            memcpy((float *)q->extras + (size_t)at * g->E, s->extras + (size_t)r * g->E,
                   g->E * sizeof(float));
    }
    for (int i = 0; i < f->n; i++) {
        struct rnnd_job *q = part_init(f, i, job);
        q->step = parts[i];
        q->step.vote = &f->vote;
    }
    f->vote.decided = step_decided;
    atomic_store(&f->vote.left, f->n);
    atomic_store(&f->left, f->n);
    // Every engine admits its part, then holds it with its envs until all parts are admitted
    // (engine.h). Two Steps that share envs on two engines must therefore be queued in the same
    // order on both, or each could hold what the other waits for: parts are queued under the lock.
    int n = f->n, rc[RNND_MAX_DEVICES]; // f may be freed by the last part
    pthread_mutex_lock(&g->lock);
    for (int i = 0; i < n; i++)
        rc[i] = rnnd_engine_queue_step(g->e[engine[i]], &f->parts[i]);
    pthread_mutex_unlock(&g->lock);
    for (int i = 0; i < n; i++) {
        if (rc[i] != 0)
            step_refused(g, engine[i], &f->parts[i], rc[i]);
    }
    for (int i = 0; i < n; i++) {
        if (rc[i] == 0)
            rnnd_engine_kick(g->e[engine[i]]);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// EndEpisodes

static void end_merge(struct fan *f) {
    uint64_t released = 0;
    for (int i = 0; i < f->n; i++)
        released += f->parts[i].end.released;
    f->parent->end.released = released;
}

static void submit_end(struct rnnd_group *g, struct rnnd_job *job) {
    struct rnnd_end_job *s = &job->end;
    int count[RNND_MAX_DEVICES] = {0}, part_of[RNND_MAX_DEVICES];
    for (int r = 0; r < s->B; r++)
        count[device_of(g, s->env_ids[r])]++;
    struct bump b = {0};
    size_t bytes = (size_t)s->B * sizeof(uint64_t);
    struct fan *f = fan_new(g, job, bytes, &b);
    if (f == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM, "out of memory");
        job->done(job);
        return;
    }
    uint64_t *ids = take(&b, bytes);
    f->finish = end_merge;
    size_t at = 0;
    for (int k = 0; k < g->n; k++) {
        if (count[k] == 0)
            continue;
        int i = f->n++;
        struct rnnd_job *q = part_init(f, i, job);
        q->end = (struct rnnd_end_job){.B = count[k], .env_ids = ids + at};
        f->engine[i] = k;
        part_of[k] = i;
        at += (size_t)count[k];
    }
    int fill[RNND_MAX_DEVICES] = {0};
    for (int r = 0; r < s->B; r++) {
        int i = part_of[device_of(g, s->env_ids[r])];
        ((uint64_t *)f->parts[i].end.env_ids)[fill[i]++] = s->env_ids[r];
    }
    fan_submit(f);
}

// ---------------------------------------------------------------------------------------------
// Forward and Backward

static void forward_merge(struct fan *f) {
    if (f->parent->err)
        f->parent->fwd.tape_id = 0;
}

// A Forward that failed on some device: the devices that kept their part of its tape drop it
// again, before the reply (nobody could use it: the reply carries no tape id).
static bool forward_undo(struct fan *f) {
    int n = 0;
    for (int i = 0; i < f->n; i++) {
        struct rnnd_job *q = &f->parts[i];
        if (q->err == 0 && q->fwd.keep_tape) {
            q->kind = RNND_JOB_DROP_TAPE;
            f->parts[n] = *q;
            f->engine[n++] = f->engine[i];
        }
    }
    if (n == 0)
        return false;
    f->n = n;
    atomic_store(&f->left, n);
    // Not through fan_submit: no collective, and a stopping engine still drops (or frees) it.
    for (int i = 0; i < n; i++)
        rnnd_engine_submit(f->g->e[f->engine[i]], &f->parts[i]);
    return true;
}

static void submit_forward(struct rnnd_group *g, struct rnnd_job *job) {
    struct rnnd_forward_job *fw = &job->fwd;
    size_t B = (size_t)fw->B, Tz = (size_t)fw->T, fb = rnnd_ftype_bytes(fw->out_dtype);
    unsigned m = fw->rec_fields;
    const struct rnnd_model *pm = &g->cfg.model;
    struct rnnd_policy_row pr = rnnd_policy_row(pm);
    const struct rnnd_policy *pp = &pm->policy;
    if (fw->cursor) {
        rnnd_job_fail(job, RNND_EPRECOND,
                      "recorded.cursor: cursor windows run on a daemon of one device only for "
                      "now; take the last steps (cursor false), or run this learner on a daemon "
                      "of one device");
        job->done(job);
        return;
    }
    if (fw->keep_tape && rnnd_model_has_policy(pm)) {
        rnnd_job_fail(job, RNND_EPRECOND,
                      "keep_tape: a policy model's Backward runs on one device only for now; "
                      "send keep_tape=false, or run this learner on a daemon of one device");
        job->done(job);
        return;
    }
    bool core = pr.W == 0 || fw->return_core;
    bool rec = fw->recorded;
    // A policy's record (fp32 and int64, whatever the reply dtype: forward_done narrows).
    bool act = (m & RNND_REC_ACTION) && pr.action >= 0, rew = m & RNND_REC_REWARD;
    size_t BT = B * Tz, K = (size_t)pp->K, A = (size_t)pp->A;
    // The outputs' bytes, in the order of struct fan's outputs; 0 for one the reply lacks.
    size_t bytes[FAN_OUTPUTS] = {
        core ? BT * g->H * fb : 0,
        B * g->LH * fb,
        g->lstm ? B * g->LH * fb : 0,
        m & RNND_REC_OBS ? BT * g->I * fb : 0,
        m & RNND_REC_IS_INIT ? BT : 0,
        m & RNND_REC_EXTRAS ? BT * g->E * fb : 0,
        m & RNND_REC_VERSION ? BT * sizeof(int64_t) : 0,
        act ? BT * (A ? A * 4 : 8) : 0,
        act ? BT * sizeof(float) : 0,
        (m & RNND_REC_ACTION) && pr.value >= 0 ? BT * sizeof(float) : 0,
        rew ? BT * sizeof(float) : 0,
        rew ? BT : 0,
        rew ? BT : 0,
        BT * K * fb,
        BT * A * fb,
        A * fb,
        pp->value ? BT * fb : 0,
    };
    // Into the reply_region when it is host memory and holds them all: the parts scatter their
    // rows straight into it, and rnnd_shm_place leaves them where they are. Else on the heap.
    size_t off[FAN_OUTPUTS], need = 0;
    for (int i = 0; i < FAN_OUTPUTS; i++) {
        off[i] = (need + RNND_SHM_ALIGN - 1) / RNND_SHM_ALIGN * RNND_SHM_ALIGN;
        need = bytes[i] ? off[i] + bytes[i] : need;
    }
    char *area = job->host_out && need <= job->host_out_bytes ? job->host_out : NULL;
    void *outs[FAN_OUTPUTS] = {0};
    bool ok = true;
    for (int i = 0; i < FAN_OUTPUTS; i++) {
        if (bytes[i])
            outs[i] = area ? area + off[i] : malloc(bytes[i]);
        ok = ok && (bytes[i] == 0 || outs[i]);
    }
    fw->out = outs[0];
    fw->h_n = outs[1];
    fw->c_n = outs[2];
    fw->rec_obs = outs[3];
    fw->rec_is_init = outs[4];
    fw->rec_extras = outs[5];
    fw->rec_version = outs[6];
    fw->rec_action = outs[7];
    fw->rec_logp = outs[8];
    fw->rec_value = outs[9];
    fw->rec_reward = outs[10];
    fw->rec_done = outs[11];
    fw->rec_truncated = outs[12];
    fw->logits = outs[13];
    fw->mean = outs[14];
    fw->log_std = outs[15];
    fw->value = outs[16];
    struct bump b = {0};
    struct fan *f = ok ? fan_new(g, job, B * sizeof(int32_t), &b) : NULL;
    if (area) // the region's, not the fan's to free
        memset(outs, 0, sizeof(outs));
    if (f == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM, "out of memory for a Forward of %zu x %zu steps", B, Tz);
        job->done(job);
        outputs_free(outs, FAN_OUTPUTS);
        return;
    }
    memcpy(f->outputs, outs, sizeof(outs));
    f->finish = forward_merge;
    f->undo = forward_undo;
    int32_t *rows = take(&b, B * sizeof(int32_t));
    // Rows: contiguous ranges, or recorded envs where they live.
    int count[RNND_MAX_DEVICES] = {0}, first[RNND_MAX_DEVICES];
    for (size_t r = 0; r < B; r++)
        count[rec ? device_of(g, fw->env_ids[r]) : (int)(r * (size_t)g->n / B)]++;
    int at = 0;
    unsigned mask = 0;
    for (int k = 0; k < g->n; k++) {
        first[k] = at;
        at += count[k];
        if (count[k])
            mask |= 1u << k;
    }
    int fill[RNND_MAX_DEVICES] = {0};
    for (size_t r = 0; r < B; r++) {
        int k = rec ? device_of(g, fw->env_ids[r]) : (int)(r * (size_t)g->n / B);
        rows[first[k] + fill[k]++] = (int32_t)r;
    }
    uint64_t tape_id = 0;
    if (fw->keep_tape) {
        pthread_mutex_lock(&g->lock);
        uint64_t seq = ++g->tape_seq;
        pthread_mutex_unlock(&g->lock);
        tape_id = TAPE_GROUP_BIT | (seq << TAPE_SEQ_SHIFT) | mask;
        if (rec || fw->h0)
            tape_id |= TAPE_H0_BIT;
        if (!rec && fw->hidden)
            tape_id |= TAPE_HIDDEN_BIT;
    }
    for (int k = 0; k < g->n; k++) {
        if (count[k] == 0)
            continue;
        int i = f->n++;
        struct rnnd_job *q = part_init(f, i, job);
        q->fwd.part = true;
        q->fwd.rows = rows + first[k];
        q->fwd.nrows = count[k];
        q->fwd.tape_id = tape_id;
        f->engine[i] = k;
    }
    fw->tape_id = tape_id; // the parts return it; the reply carries it only on success
    fan_submit(f);
}

static void backward_merge(struct fan *f) {
    // The version of the weights the tape was made with, from a device that held a part.
    for (int i = 0; i < f->n; i++)
        if (f->parts[i].bwd.has_part) {
            f->parent->model_version = f->parts[i].model_version;
            break;
        }
}

static void submit_backward(struct rnnd_group *g, struct rnnd_job *job) {
    struct rnnd_backward_job *bw = &job->bwd;
    uint64_t id = bw->tape_id;
    unsigned mask = TAPE_MASK(id);
    if (!(id & TAPE_GROUP_BIT) || mask == 0 || mask >= (1u << g->n)) {
        rnnd_job_fail(
            job, RNND_ENOTFOUND,
            "tape %" PRIu64 " is unknown or expired (a tape lives --tape-ttl-s %d s and is used "
            "by one Backward); run Forward with keep_tape=true again and send its tape_id",
            id, g->cfg.tape_ttl_s);
        job->done(job);
        return;
    }
    size_t B = (size_t)bw->B, Tz = (size_t)bw->T, BLH = B * g->LH;
    size_t fb = rnnd_ftype_bytes(bw->out_dtype);
    // The input gradients asked for among those the Forward had (the parts refuse any other).
    unsigned want = bw->input_grads_set ? bw->input_grads : RNND_GRAD_ALL;
    bool x = want & RNND_GRAD_OBS;
    bool h0 = (id & TAPE_H0_BIT) && (want & RNND_GRAD_H0);
    bool hidden = (id & TAPE_HIDDEN_BIT) && (want & RNND_GRAD_HIDDEN);
    bw->grads = bw->accumulate ? NULL : malloc(g->P * fb);
    bw->grad_x = x ? malloc(B * Tz * g->I * fb) : NULL;
    bw->grad_h0 = h0 ? malloc(BLH * fb) : NULL;
    bw->grad_c0 = h0 && g->lstm ? malloc(BLH * fb) : NULL;
    bw->grad_hidden = hidden ? malloc(Tz * BLH * fb) : NULL;
    bw->grad_cell = hidden && g->lstm ? malloc(Tz * BLH * fb) : NULL;
    struct bump b;
    struct fan *f = NULL;
    if ((bw->accumulate || bw->grads) && (!x || bw->grad_x) && (!h0 || bw->grad_h0) &&
        (!h0 || !g->lstm || bw->grad_c0) && (!hidden || bw->grad_hidden) &&
        (!hidden || !g->lstm || bw->grad_cell))
        f = fan_new(g, job, 0, &b);
    void *outs[] = {bw->grads,   bw->grad_x,      bw->grad_h0,
                    bw->grad_c0, bw->grad_hidden, bw->grad_cell};
    if (f == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM, "out of memory for a Backward of %zu x %zu steps", B, Tz);
        job->done(job);
        outputs_free(outs, 6);
        return;
    }
    memcpy(f->outputs, outs, sizeof(outs));
    f->finish = backward_merge;
    // Every device has its say before any runs its rows (engine.h), and without accumulate
    // every device joins the sum of the gradients.
    for (int k = 0; k < g->n; k++) {
        int i = f->n++;
        struct rnnd_job *q = part_init(f, i, job);
        q->bwd.part = true;
        q->bwd.has_part = mask & (1u << k);
        f->engine[i] = k;
    }
    fan_submit(f);
}

// ---------------------------------------------------------------------------------------------
// Weights

static void get_weights_merge(struct fan *f) {
    struct rnnd_group *g = f->g;
    if (f->parent->err)
        return;
    const float *a = f->copy[0];
    for (int i = 1; i < f->n; i++) {
        const float *w = f->copy[i];
        if (memcmp(a, w, g->P * sizeof(float)) == 0)
            continue;
        size_t first = 0, differ = 0;
        for (size_t j = g->P; j-- > 0;) {
            uint32_t x, y;
            memcpy(&x, a + j, sizeof(x));
            memcpy(&y, w + j, sizeof(y));
            if (x != y) {
                differ++;
                first = j;
            }
        }
        rnnd_job_fail(
            f->parent, RNND_EDEVICE,
            "the devices' weights differ: device %d has %zu of %zu floats unlike device 0's "
            "(first at %zu: %.9g vs %.9g); this is a bug: restart rnnd, which gives every "
            "device device 0's weights",
            i, differ, g->P, first, (double)w[first], (double)a[first]);
        rnnd_log(RNND_LOG_ERROR, "GetWeights: %s", f->parent->msg);
        return;
    }
}

static void submit_get_weights(struct rnnd_group *g, struct rnnd_job *job) {
    struct bump b;
    size_t bytes = g->P * sizeof(float);
    struct fan *f = fan_new(g, job, (size_t)(g->n - 1) * (bytes + 16), &b);
    if (f == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM, "out of memory");
        job->done(job);
        return;
    }
    f->finish = get_weights_merge;
    f->n = g->n;
    for (int i = 0; i < g->n; i++) {
        struct rnnd_job *q = part_init(f, i, job);
        f->copy[i] = i == 0 ? job->weights.params : take(&b, bytes);
        q->weights.params = f->copy[i];
        f->engine[i] = i;
    }
    fan_submit(f);
}

static void checkpoint_merge(struct fan *f) {
    // Each device wrote its part under its own directory; the reply names device 0's.
    memcpy(f->parent->ckpt.path, f->parts[0].ckpt.path, sizeof(f->parent->ckpt.path));
}

// ---------------------------------------------------------------------------------------------
// Updates across instances

// Runs an update (ApplyGradients or SetWeights) on every engine; root is the replica whose data
// is broadcast, or -1 when every engine has it.
static void run_update(struct rnnd_group *g, struct rnnd_job *job, int root) {
    if (job->kind == RNND_JOB_APPLY)
        job->apply.root = root;
    else
        job->weights.root = root;
    if (g->n == 1)
        rnnd_engine_submit(g->e[0], job);
    else
        fan_all(g, job, NULL);
}

static void follower_done(struct rnnd_job *job) {
    if (job->err)
        rnnd_log(RNND_LOG_WARN, "an update made on another rnnd failed here: %s", job->msg);
    free(job);
}

// Channel thread: an update in the group's order (cluster.h).
static void on_commit(void *ctx, const struct rnnd_cluster_op *op) {
    struct rnnd_group *g = ctx;
    struct rnnd_job *job = NULL;
    if (op->origin == (uint32_t)g->rank) {
        pthread_mutex_lock(&g->lock);
        for (struct pending **pp = &g->pending; *pp; pp = &(*pp)->next) {
            if ((*pp)->token == op->token) {
                struct pending *p = *pp;
                *pp = p->next;
                job = p->job;
                free(p);
                break;
            }
        }
        pthread_mutex_unlock(&g->lock);
    }
    if (job == NULL) {
        // Our own update must be pending here: its data is only in that job.
        RNND_ASSERT(op->origin != (uint32_t)g->rank);
        // Another instance's update: this rank joins it with nothing of its own to send.
        job = calloc(1, sizeof(*job));
        if (job == NULL)
            rnnd_panic(__FILE__, __LINE__, "out of memory for update %" PRIu64, op->seq);
        job->kind = op->kind == RNND_CLUSTER_SET_WEIGHTS ? RNND_JOB_SET_WEIGHTS : RNND_JOB_APPLY;
        job->done = follower_done;
    }
    if (job->kind == RNND_JOB_APPLY) {
        job->apply.sent = op->kind == RNND_CLUSTER_APPLY_SENT;
        job->apply.has_lr = op->has_lr;
        job->apply.lr = op->lr;
    }
    bool sent = op->kind != RNND_CLUSTER_APPLY_ACCUMULATED;
    run_update(g, job, sent ? (int)op->origin * g->n : -1);
}

static void on_lost(void *ctx, const char *why) {
    struct rnnd_group *g = ctx;
    rnnd_log(RNND_LOG_ERROR, "%s", why);
    pthread_mutex_lock(&g->lock);
    g->broken = true;
    snprintf(g->broken_why, sizeof(g->broken_why), "%s", why);
    struct pending *p = g->pending;
    g->pending = NULL;
    pthread_mutex_unlock(&g->lock);
    while (p) {
        struct pending *next = p->next;
        rnnd_job_fail(
            p->job, RNND_EUNAVAIL,
            "the group of rnnd instances broke before this update ran (%s); retry once it has "
            "formed again",
            why);
        p->job->done(p->job);
        free(p);
        p = next;
    }
    g->lost_cb(g->cb_ctx, why);
}

// An update received here: through rank 0's order when there are other instances.
static void submit_update(struct rnnd_group *g, struct rnnd_job *job) {
    if (g->world == 1) {
        run_update(g, job, -1);
        return;
    }
    struct rnnd_cluster_op op = {0};
    if (job->kind == RNND_JOB_SET_WEIGHTS) {
        op.kind = RNND_CLUSTER_SET_WEIGHTS;
    } else {
        op.kind = job->apply.grads ? RNND_CLUSTER_APPLY_SENT : RNND_CLUSTER_APPLY_ACCUMULATED;
        op.has_lr = job->apply.has_lr;
        op.lr = job->apply.lr;
    }
    struct pending *p = malloc(sizeof(*p));
    if (p == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM, "out of memory");
        job->done(job);
        return;
    }
    pthread_mutex_lock(&g->lock);
    if (g->broken || g->cluster == NULL) {
        char why[512];
        snprintf(why, sizeof(why), "%s", g->broken ? g->broken_why : "not formed yet");
        pthread_mutex_unlock(&g->lock);
        free(p);
        rnnd_job_fail(
            job, RNND_EUNAVAIL,
            "the group of rnnd instances is not available (%s); weights change only with every "
            "instance there",
            why);
        job->done(job);
        return;
    }
    // Listed before the proposal: the commit may come back before propose returns.
    p->token = op.token = ++g->next_token;
    p->job = job;
    p->next = g->pending;
    g->pending = p;
    struct rnnd_cluster *cl = g->cluster;
    pthread_mutex_unlock(&g->lock);
    if (rnnd_cluster_propose(cl, &op) == 0)
        return;
    pthread_mutex_lock(&g->lock);
    bool mine = false;
    for (struct pending **pp = &g->pending; *pp; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            mine = true;
            break;
        }
    }
    pthread_mutex_unlock(&g->lock);
    if (!mine) // on_lost took it and has answered the call
        return;
    free(p);
    rnnd_job_fail(
        job, RNND_EUNAVAIL,
        "rank 0 (--rendezvous %s) cannot be reached to order this update; weights change only "
        "with every instance there",
        g->cfg.rendezvous);
    job->done(job);
}

// ---------------------------------------------------------------------------------------------
// Submission

void rnnd_group_submit(struct rnnd_group *g, struct rnnd_job *job) {
    if (job->kind == RNND_JOB_APPLY || job->kind == RNND_JOB_SET_WEIGHTS) {
        submit_update(g, job);
        return;
    }
    if (g->n == 1) {
        rnnd_engine_submit(g->e[0], job);
        return;
    }
    switch (job->kind) {
        case RNND_JOB_END_EPISODES:
            submit_end(g, job);
            break;
        case RNND_JOB_FORWARD:
            submit_forward(g, job);
            break;
        case RNND_JOB_BACKWARD:
            submit_backward(g, job);
            break;
        case RNND_JOB_GET_WEIGHTS:
            submit_get_weights(g, job);
            break;
        case RNND_JOB_CHECKPOINT:
            fan_all(g, job, checkpoint_merge);
            break;
        default:
            RNND_ASSERT(!"job kind the service does not submit");
    }
}

void rnnd_group_housekeeping(struct rnnd_group *g) {
    for (int k = 0; k < g->n; k++)
        rnnd_engine_housekeeping(g->e[k]);
}

// ---------------------------------------------------------------------------------------------
// Start-up

// Engine thread: one engine is ready (or failed).
static void on_engine_ready(void *ctx, int err, const char *msg) {
    struct ready_slot *slot = ctx;
    struct rnnd_group *g = slot->g;
    if (g->n == 1 && g->world == 1) {
        g->ready_cb(g->cb_ctx, err, msg);
        return;
    }
    pthread_mutex_lock(&g->lock);
    if (err && g->ready_err == 0) {
        g->ready_err = err;
        snprintf(g->ready_msg, sizeof(g->ready_msg), "device %d: %s", slot->index, msg);
    }
    g->ready_count++;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
}

struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int left, err;
    char msg[512];
};

static void waiter_done(struct rnnd_job *job) {
    struct waiter *w = job->owner;
    pthread_mutex_lock(&w->mu);
    if (job->err && w->err == 0) {
        w->err = job->err;
        snprintf(w->msg, sizeof(w->msg), "%s", job->msg);
    }
    if (--w->left == 0)
        pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

// Runs jobs[k] on engine k for every engine and waits for all; 0 or the first error (in msg).
static int run_on_all(struct rnnd_group *g, struct rnnd_job *jobs, char *msg, size_t msglen) {
    struct waiter w = {.left = g->n};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    pthread_mutex_lock(&g->lock);
    for (int k = 0; k < g->n; k++) {
        jobs[k].owner = &w;
        jobs[k].done = waiter_done;
        rnnd_engine_submit(g->e[k], &jobs[k]);
    }
    pthread_mutex_unlock(&g->lock);
    pthread_mutex_lock(&w.mu);
    while (w.left > 0)
        pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    if (w.err)
        snprintf(msg, msglen, "%s", w.msg);
    return w.err;
}

// Every engine joins the communicator id as rank first + k of nranks.
static int join_all(struct rnnd_group *g, const struct rnnd_comm_id *id, int nranks, int first,
                    bool local, bool replicas, char *msg, size_t msglen) {
    struct rnnd_job jobs[RNND_MAX_DEVICES];
    memset(jobs, 0, sizeof(jobs));
    for (int k = 0; k < g->n; k++) {
        jobs[k].kind = RNND_JOB_COMM;
        jobs[k].comm = (struct rnnd_comm_job){.id = *id,
                                              .nranks = nranks,
                                              .rank = first + k,
                                              .timeout_ms = g->cfg.comm_timeout_s * 1000,
                                              .local = local,
                                              .replicas = replicas};
    }
    return run_on_all(g, jobs, msg, msglen);
}

// Same model, compute, optimizer, device count and backend: what ranks must agree on (FNV-1a).
static uint64_t fingerprint(const struct rnnd_group *g) {
    const struct rnnd_model *m = &g->cfg.model;
    // A host-memory rank (host communicator) cannot join a device one (NCCL): their communicator
    // ids differ. The last value marks host-memory ranks only, so that device ranks keep the
    // fingerprint of builds before it (rolling upgrades).
    bool host = (rnnd_engine_backend(g->e[0])->ops->caps & RNND_BACKEND_CAP_HOST_MEMORY) != 0;
    int64_t v[] = {m->cell, m->compute, m->I, m->H, m->L, g->cfg.optimizer, g->n, 1};
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]) - !host; i++)
        for (int b = 0; b < 8; b++) {
            h ^= (uint64_t)(v[i] >> (8 * b)) & 0xffu;
            h *= 0x100000001b3ull;
        }
    return h;
}

static int group_form(struct rnnd_group *g, char *msg, size_t msglen) {
    const struct rnnd_backend *b0 = rnnd_engine_backend(g->e[0]);
    const char *name0 = rnnd_engine_device_name(g->e[0]);
    bool same = true;
    for (int k = 1; k < g->n; k++) {
        const struct rnnd_backend *bk = rnnd_engine_backend(g->e[k]);
        if (strcmp(bk->ops->name, b0->ops->name) != 0) {
            snprintf(msg, msglen, "device %d runs the %s backend, device 0 the %s one", k,
                     bk->ops->name, b0->ops->name);
            return RNND_EINVAL;
        }
        same = same && strcmp(rnnd_engine_device_name(g->e[k]), name0) == 0;
    }
    if (g->n > 1 && same)
        snprintf(g->device_name, sizeof(g->device_name), "%d x %s", g->n, name0);
    else if (g->n > 1)
        snprintf(g->device_name, sizeof(g->device_name), "%d devices: %s, ...", g->n, name0);
    char why[512];
    if (rnnd_comm_supported(b0, why, sizeof(why)) != 0) {
        snprintf(msg, msglen, "%s: %.400s",
                 g->world > 1 ? "--world-size above 1" : "--devices with several devices", why);
        return RNND_ENOTSUP;
    }
    struct rnnd_comm_id id;
    int rc;
    if (g->world == 1) {
        // One communicator: this daemon's engines are all the replicas.
        if ((rc = rnnd_comm_id_new(b0, g->n, NULL, &id)) != 0) {
            snprintf(msg, msglen, "cannot create a communicator: %s", rnnd_strerror(rc));
            return rc;
        }
        rc = join_all(g, &id, g->n, 0, true, true, msg, msglen);
        rnnd_comm_id_release(b0, &id);
        if (rc)
            return rc;
    } else {
        if (g->n > 1) {
            if ((rc = rnnd_comm_id_new(b0, g->n, NULL, &id)) != 0) {
                snprintf(msg, msglen, "cannot create a communicator: %s", rnnd_strerror(rc));
                return rc;
            }
            rc = join_all(g, &id, g->n, 0, true, false, msg, msglen);
            rnnd_comm_id_release(b0, &id);
            if (rc)
                return rc;
        }
        // The other ranks reach rank 0 where they reach its rendezvous (the cpu backend listens
        // there for them).
        int nranks = g->world * g->n;
        char host[RNND_CONFIG_ADDR_MAX];
        if (g->rank == 0) {
            rc = rnnd_cluster_host(g->cfg.rendezvous, host, sizeof(host));
            if (rc == 0)
                rc = rnnd_comm_id_new(b0, nranks, host, &id);
            if (rc != 0) {
                snprintf(msg, msglen, "cannot create the group's communicator id on %s: %s",
                         g->cfg.rendezvous, rnnd_strerror(rc));
                return rc;
            }
        }
        struct rnnd_cluster_config cc = {.rank = g->rank,
                                         .world = g->world,
                                         .rendezvous = g->cfg.rendezvous,
                                         .timeout_ms = g->cfg.rendezvous_timeout_s * 1000,
                                         .fingerprint = fingerprint(g),
                                         .abort = &g->aborting};
        struct rnnd_cluster *cl;
        rc = rnnd_cluster_start(&cc, &id, on_commit, on_lost, g, &cl, msg, msglen);
        if (rc == 0) {
            pthread_mutex_lock(&g->lock);
            g->cluster = cl;
            pthread_mutex_unlock(&g->lock);
            rc = join_all(g, &id, nranks, g->rank * g->n, false, true, msg, msglen);
        }
        if (g->rank == 0)
            rnnd_comm_id_release(b0, &id); // every rank has joined or given up
        if (rc)
            return rc;
        rnnd_log(RNND_LOG_INFO, "rank %d of %d: the group formed (%d devices in all)", g->rank,
                 g->world, nranks);
    }
    struct rnnd_job jobs[RNND_MAX_DEVICES];
    memset(jobs, 0, sizeof(jobs));
    for (int k = 0; k < g->n; k++)
        jobs[k].kind = RNND_JOB_SYNC;
    return run_on_all(g, jobs, msg, msglen);
}

static void *starter_main(void *arg) {
    struct rnnd_group *g = arg;
    pthread_mutex_lock(&g->lock);
    while (g->ready_count < g->n)
        pthread_cond_wait(&g->cond, &g->lock);
    int rc = g->ready_err;
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", g->ready_msg);
    pthread_mutex_unlock(&g->lock);
    if (rc == 0)
        rc = group_form(g, msg, sizeof(msg));
    g->ready_cb(g->cb_ctx, rc, rc ? msg : "");
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Public API

struct rnnd_group *rnnd_group_init(const struct rnnd_config *cfg) {
    struct rnnd_group *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return NULL;
    g->cfg = *cfg;
    int devices[RNND_MAX_DEVICES];
    g->n = rnnd_config_devices(cfg, devices);
    g->world = cfg->world_size;
    const struct rnnd_model *m = &cfg->model;
    g->lstm = m->cell == RNND_CELL_LSTM;
    g->I = (size_t)m->I;
    g->H = (size_t)m->H;
    g->W = (size_t)rnnd_policy_row(m).W;
    g->LH = (size_t)m->L * (size_t)m->H;
    g->E = (size_t)cfg->extras_size;
    g->P = rnnd_model_param_count(m);
    pthread_mutex_init(&g->lock, NULL);
    pthread_cond_init(&g->cond, NULL);
    for (int k = 0; k < g->n; k++) {
        struct rnnd_config ec = *cfg;
        ec.device = devices[k];
        g->slots[k] = (struct ready_slot){g, k};
        g->e[k] = rnnd_engine_init(&ec, k, g->n);
        if (g->e[k] == NULL) {
            rnnd_group_free(g);
            return NULL;
        }
    }
    return g;
}

int rnnd_group_start(struct rnnd_group *g, rnnd_engine_ready_cb ready, rnnd_group_lost_cb lost,
                     void *ctx) {
    g->ready_cb = ready;
    g->lost_cb = lost;
    g->cb_ctx = ctx;
    char err[256];
    if (g->world > 1 && rnnd_config_rank(&g->cfg, &g->rank, err, sizeof(err)) != 0) {
        // Reported like any failed start, from the starter's place.
        ready(ctx, RNND_EINVAL, err);
        return 0;
    }
    if (g->n > 1 || g->world > 1) {
        if (pthread_create(&g->starter, NULL, starter_main, g) != 0)
            return RNND_ENOMEM;
        g->starter_started = true;
    }
    for (int k = 0; k < g->n; k++) {
        if (rnnd_engine_start(g->e[k], on_engine_ready, &g->slots[k]) != 0) {
            // The engines started so far stop with the group; the starter waits for them all.
            for (int j = k; j < g->n; j++)
                on_engine_ready(&g->slots[j], RNND_ENOMEM, "cannot start the engine thread");
            break;
        }
    }
    return 0;
}

void rnnd_group_stop(struct rnnd_group *g) {
    atomic_store(&g->aborting, true);
    pthread_mutex_lock(&g->lock);
    g->stopping = true;
    pthread_mutex_unlock(&g->lock);
    for (int k = 0; k < g->n; k++)
        rnnd_engine_stop(g->e[k]);
}

void rnnd_group_join(struct rnnd_group *g) {
    if (g->starter_started) {
        pthread_join(g->starter, NULL);
        g->starter_started = false;
    }
    for (int k = 0; k < g->n; k++)
        rnnd_engine_join(g->e[k]);
    // Only now: the engines' last collectives may still have needed the peers.
    pthread_mutex_lock(&g->lock);
    struct rnnd_cluster *cl = g->cluster;
    g->cluster = NULL;
    pthread_mutex_unlock(&g->lock);
    rnnd_cluster_free(cl);
}

void rnnd_group_free(struct rnnd_group *g) {
    if (g == NULL)
        return;
    rnnd_group_join(g);
    for (int k = 0; k < g->n; k++)
        rnnd_engine_free(g->e[k]);
    pthread_mutex_destroy(&g->lock);
    pthread_cond_destroy(&g->cond);
    free(g);
}

bool rnnd_group_final_checkpoint_failed(const struct rnnd_group *g) {
    for (int k = 0; k < g->n; k++)
        if (rnnd_engine_final_checkpoint_failed(g->e[k]))
            return true;
    return false;
}

uint64_t rnnd_group_model_version(const struct rnnd_group *g) {
    return rnnd_engine_model_version(g->e[0]);
}

uint64_t rnnd_group_envs_active(const struct rnnd_group *g) {
    uint64_t n = 0;
    for (int k = 0; k < g->n; k++)
        n += rnnd_engine_envs_active(g->e[k]);
    return n;
}

const char *rnnd_group_backend_name(const struct rnnd_group *g) {
    return rnnd_engine_backend_name(g->e[0]);
}

const char *rnnd_group_device_name(const struct rnnd_group *g) {
    return g->n > 1 ? g->device_name : rnnd_engine_device_name(g->e[0]);
}

const char *rnnd_group_plan_name(const struct rnnd_group *g) {
    return rnnd_engine_plan_name(g->e[0]); // every engine serves the same model on alike devices
}

const struct rnnd_model *rnnd_group_model(const struct rnnd_group *g) {
    return rnnd_engine_model(g->e[0]);
}

int rnnd_group_queue_rows(struct rnnd_group *g) {
    int n = 0;
    for (int k = 0; k < g->n; k++)
        n += rnnd_engine_queue_rows(g->e[k]);
    return n;
}

int rnnd_group_devices(const struct rnnd_group *g) {
    return g->n;
}

const struct rnnd_backend *rnnd_group_sole_backend(const struct rnnd_group *g) {
    return g->n == 1 ? rnnd_group_host_backend(g) : NULL;
}

const struct rnnd_backend *rnnd_group_host_backend(const struct rnnd_group *g) {
    const struct rnnd_backend *be = rnnd_engine_backend(g->e[0]);
    return be->ops ? be : NULL;
}
