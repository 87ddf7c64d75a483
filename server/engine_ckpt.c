/*
 * engine_ckpt.c: the engine's checkpoints (see engine.h; the files themselves are checkpoint.c's):
 * a consistent snapshot of the weights, optimizer state, env states and recorded steps, taken
 * on the engine thread between two jobs and written under a named or automatic path (the
 * automatic ones rotate); and at start, the restore: --restore, else the newest automatic
 * checkpoint of --state-dir that loads, else --weights, else --seed, with the running marker
 * that tells a clean stop from a crash.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "engine_impl.h"
#include "log.h"
#include "metrics.h"
#include "place.h"

// Automatic checkpoints kept in --state-dir/auto (named ones are never removed).
#define AUTO_CHECKPOINTS_KEPT 3

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
    if (rnnd__engine_work_reserve(e, k->bytes, &k->block) != 0 ||
        (k->host = rnnd__engine_xfer_host(e, k->block, k->bytes)) == NULL)
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
    float *prec;      // (rows, prec_w) a policy's record (host memory: copied directly)
    uint8_t *pflags;  // (rows)
    uint64_t *cursor; // (N, 2) each env's recorded total and cursor (trajectory.h)
};

static void traj_snapshot_free(struct traj_snapshot *t) {
    free(t->count);
    free(t->obs);
    free(t->extras);
    free(t->h);
    free(t->c);
    free(t->is_init);
    free(t->version);
    free(t->prec);
    free(t->pflags);
    free(t->cursor);
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
    t->cursor = malloc(((size_t)N + 1) * 2 * sizeof(uint64_t));
    if (t->count == NULL || t->cursor == NULL)
        return RNND_ENOMEM;
    int i = 0;
    for (struct rnnd_env *env = rnnd_envtable_oldest(e->envs); env;
         env = rnnd_envtable_newer(e->envs, env), i++) {
        t->count[i] = env->traj.count;
        t->cursor[2 * i] = env->traj.total;
        t->cursor[2 * i + 1] = env->traj.cursor;
        t->rows += t->count[i];
    }
    size_t R = (size_t)t->rows + 1, I = (size_t)d->I, E = (size_t)d->E, LH = e->LH;
    t->obs = malloc(R * I * sizeof(float));
    t->extras = E ? malloc(R * E * sizeof(float)) : NULL;
    t->h = malloc(R * LH * sizeof(float));
    t->c = d->lstm ? malloc(R * LH * sizeof(float)) : NULL;
    t->is_init = malloc(R);
    t->version = malloc(R * sizeof(uint64_t));
    t->prec = e->prec ? malloc(R * e->prec_w * sizeof(float)) : NULL;
    t->pflags = e->prec ? malloc(R) : NULL;
    if (!t->obs || (E && !t->extras) || !t->h || (d->lstm && !t->c) || !t->is_init || !t->version ||
        (e->prec && (!t->prec || !t->pflags)))
        return RNND_ENOMEM;
    struct traj_chunk k;
    int rc = traj_chunk_open(e, &k, t->rows);
    size_t at = 0, j = 0;
    for (struct rnnd_env *env = rnnd_envtable_oldest(e->envs); rc == 0 && env;
         env = rnnd_envtable_newer(e->envs, env)) {
        for (int s = 0; rc == 0 && s < env->traj.count; s++, j++) {
            int32_t row = rnnd_traj_row(&env->traj, d, env->slot, env->traj.count, s);
            k.h_idx[k.n++] = row;
            if (t->prec) {
                memcpy(t->prec + j * e->prec_w, e->prec + (size_t)row * e->prec_w,
                       e->prec_w * sizeof(float));
                t->pflags[j] = e->pflags[row];
            }
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
        .devices = e->count,
        .place_block = e->cfg.place_block,
    };
    float *params = malloc(bytes);
    float *m = e->adam_m ? malloc(bytes) : NULL;
    float *v = e->adam_v ? malloc(bytes) : NULL;
    uint64_t *ids = malloc(((size_t)N + 1) * sizeof(uint64_t));
    uint64_t *last = malloc(((size_t)N + 1) * sizeof(uint64_t));
    uint8_t *has = malloc((size_t)N + 1);
    float *h = malloc(((size_t)N * LH + 1) * sizeof(float));
    float *c = e->lstm ? malloc(((size_t)N * LH + 1) * sizeof(float)) : NULL;
    size_t OW = (size_t)e->model.H + (size_t)e->prow.W; // each env's cached reply row
    float *lo = malloc(((size_t)N * OW + 1) * sizeof(float));
    uint64_t *steps = e->prow.action >= 0 ? malloc(((size_t)N + 1) * sizeof(uint64_t)) : NULL;
    struct traj_snapshot tr = {0};
    int rc = RNND_ENOMEM;
    if (!params || (e->adam_m && (!m || !v)) || !ids || !last || !has || !h || (e->lstm && !c) ||
        !lo || (e->prow.action >= 0 && !steps) ||
        (e->tdims.cap > 0 && traj_snapshot(e, N, &tr) != 0)) {
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
        memcpy(lo + (size_t)i * OW, rnnd_envtable_output(e->envs, env), OW * sizeof(float));
        if (steps)
            steps[i] = env->steps;
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
    ck.step_count = steps;
    if (tr.count) {
        ck.traj_count = tr.count;
        ck.traj_rows = tr.rows;
        ck.traj_obs = tr.obs;
        ck.traj_is_init = tr.is_init;
        ck.traj_extras = tr.extras;
        ck.traj_version = tr.version;
        ck.traj_h = tr.h;
        ck.traj_c = tr.c;
        ck.traj_policy = tr.prec;
        ck.traj_policy_flags = tr.pflags;
        ck.traj_cursor = tr.cursor;
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
    free(steps);
    traj_snapshot_free(&tr);
    return rc;
}

void rnnd__engine_run_checkpoint(struct rnnd_engine *e, struct rnnd_job *job) {
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
int rnnd__engine_checkpoint_auto(struct rnnd_engine *e, const char *why) {
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
        if (e->prec && ck->traj_policy) {
            size_t row = (size_t)k->h_idx[k->n], from = at + (size_t)s;
            memcpy(e->prec + row * e->prec_w, ck->traj_policy + from * e->prec_w,
                   e->prec_w * sizeof(float));
            e->pflags[row] = ck->traj_policy_flags[from];
        }
        if (e->tver)
            e->tver[k->h_idx[k->n]] = ck->traj_version[at + (size_t)s];
        traj_chunk_row(e, k, k->n, at + (size_t)s, (float *)ck->traj_obs, (float *)ck->traj_extras,
                       (float *)ck->traj_h, (float *)ck->traj_c, (uint8_t *)ck->traj_is_init,
                       (uint64_t *)ck->traj_version, true);
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
        if (e->count > 1 && rnnd_place(ck->env_ids[i], e->count, e->cfg.place_block) != e->index) {
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
        size_t OW = H + (size_t)e->prow.W;
        if (ck->last_output)
            memcpy(rnnd_envtable_output(e->envs, env), ck->last_output + (size_t)i * OW,
                   OW * sizeof(float));
        if (ck->step_count)
            env->steps = ck->step_count[i];
        size_t off = env_row(e, env) * LH;
        rc = be_in(e, e->state_h + off, ck->env_h + (size_t)i * LH, LH * sizeof(float));
        if (rc == 0 && e->lstm)
            rc = be_in(e, e->state_c + off, ck->env_c + (size_t)i * LH, LH * sizeof(float));
        if (rc == 0 && traj)
            rc = restore_traj(e, &k, env, ck, at, ck->traj_count[i]);
        if (rc == 0 && traj && ck->traj_cursor) {
            // Cursors go on where they were: no step is handed out twice across a restart.
            env->traj.total = ck->traj_cursor[2 * i];
            env->traj.cursor = ck->traj_cursor[2 * i + 1];
        }
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
    if (rc == 0)
        rc = rnnd__engine_weights_changed(e, e->cur);
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
    rnnd__engine_env_gauges(e);
    return 0;
}

// The marker file that says a daemon is running on this --state-dir: created at start, removed
// after the shutdown checkpoint. Found at start, it means the last run did not stop cleanly.
void rnnd__engine_running_marker(const struct rnnd_engine *e, char *path, size_t cap) {
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

// A checkpoint of one device among several holds only the envs placed on it. Each device
// restores from its own part, so a part is taken up only under the placement that wrote it:
// the same --place-block and, for blocks, the same number of devices (a hash moves only a
// share of the envs when devices are added; blocks taken in turn move most). A part whose
// metadata.json does not say is known by its directory (TOP/device-N/...), written by hash.
static int placement_check(const struct rnnd_engine *e, const char *dir,
                           const struct rnnd_checkpoint *ck, char *why, size_t whylen) {
    size_t top = strlen(e->top_dir);
    bool part =
        ck->devices > 1 || (ck->devices == 0 && top > 0 && strncmp(dir, e->top_dir, top) == 0 &&
                            strncmp(dir + top, "/device-", 8) == 0);
    int block = e->cfg.place_block;
    if (e->count == 1 || !part ||
        (ck->place_block == block && (block == 1 || ck->devices == e->count)))
        return 0;
    char devs[32] = "several devices";
    if (ck->devices > 1)
        snprintf(devs, sizeof(devs), "%d devices", ck->devices);
    snprintf(why, whylen,
             "its envs were placed on %s by --place-block %d, and each device restores only its "
             "own part: start with that placement (this daemon: %d devices, --place-block %d), "
             "or restore a checkpoint taken on one device",
             devs, ck->place_block, e->count, block);
    return RNND_EINVAL;
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
    rc = placement_check(e, dir, &d.ck, why, whylen);
    if (rc == 0)
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
int rnnd__engine_restore(struct rnnd_engine *e, char *msg, size_t msglen) {
    char why[512], marker[RNND_CONFIG_PATH_MAX + 32];
    bool unclean = false;
    if (e->cfg.state_dir[0]) {
        rnnd__engine_running_marker(e, marker, sizeof(marker));
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
        if (rc == 0)
            rc = rnnd__engine_weights_changed(e, e->cur);
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
