/*
 * engine_learn.c: the engine's learner jobs (see engine.h): Forward (from sent inputs or from
 * recorded windows of the trajectory store, keeping a tape or not, and this engine's rows of a
 * Forward split over several engines), Backward (over a kept tape, accumulating or returning
 * the weight gradients, and its parts), ApplyGradients, GetWeights and SetWeights, the tapes
 * they keep, and the replicas' communicators and start-up sync.
 *
 * Replicas (group.c): engines that share a communicator hold the same weights, bit for bit. They
 * change them only in collective jobs that every replica runs in the same order from the same
 * inputs: ApplyGradients sums the accumulated gradients over the replicas (their last float
 * counts the replicas that have any, so all agree on whether there is anything to apply) or
 * takes sent ones from the host or a broadcast, SetWeights likewise, and the start-up sync
 * broadcasts replica 0's state. Deterministic kernels on identical devices then keep the copies
 * identical; GetWeights on several devices compares them.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine_impl.h"
#include "log.h"
#include "metrics.h"
#include "shm.h"

// ---------------------------------------------------------------------------------------------
// Tapes

// A Forward kept for Backward: its inputs, its weights and the backend's tape, in one block.
struct tape_obj {
    struct weights *w;
    int B, T;
    int B_all;     // rows of the whole Forward (B, unless this is a part)
    int32_t *rows; // (B) host: a part's rows within the whole Forward, or NULL
    bool has_h0, has_hidden;
    void *block; // backend memory, block_bytes of it
    size_t block_bytes;
    float *x;             // (B, T, I)
    uint8_t *is_init;     // (B, T)
    float *h0, *c0;       // (B, L, H) or NULL
    float *hidden, *cell; // (B, T, L, H) or NULL
    void *tape;
    // A policy's: the encoder's activations (B*T rows, or NULL) and the core's output (the
    // heads' input), for the backward through heads and encoder.
    float *acts, *out; // (B*T, encoder acts), (B, T, H)
};

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

void rnnd__engine_tape_release(void *ctx, void *p) {
    struct rnnd_engine *e = ctx;
    struct tape_obj *t = p;
    tape_block_free(e, t->block, t->block_bytes);
    rnnd__engine_weights_unref(e, t->w);
    free(t->rows);
    free(t);
}

void rnnd__engine_tape_gauges(struct rnnd_engine *e) {
    publish(&rnnd_metrics.tapes, &e->pub_tapes, rnnd_tapes_count(e->tapes));
    publish(&rnnd_metrics.tape_bytes, &e->pub_tape_bytes, (int64_t)rnnd_tapes_bytes(e->tapes));
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
// Forward


// What a Forward or Backward moves between the client's tensors (host, the wire's dtypes) and its
// backend block: float parts (fp32 in the block, `ft` on the host) and raw parts (bytes as they
// are). Each direction is packed into one area of the block and its mirror in the staging, so it
// costs one copy, and float parts are converted on the backend (cast). With host_mem and fp32
// there is nothing to convert: inputs are copied into place and outputs are used where they are.
// A CUDA region (job->dev_in, job->dev_out) skips the host: inputs are converted from the
// client's device memory, outputs into it. A region the backend page-locked (a socket region, a
// memfd's on CUDA: job->host_in, job->host_out) skips the staging copy: inputs are copied from
// it one by one, outputs into it.
struct io_part {
    void *dev;        // the backend array
    size_t n;         // elements
    size_t raw;       // bytes per element of a raw part; 0: a float part
    const void *host; // an input's data (a device pointer with job->dev_in)
    void **out;       // an output: receives the pointer to its data (host, or job->dev_out)
    const char *name; // an input's field, for errors
};

static size_t io_part_bytes(const struct io_part *p, enum rnnd_ftype ft) {
    return p->n * (p->raw ? p->raw : rnnd_ftype_bytes(ft));
}

// A part moved between backend memory and the client's memory in the wire dtype ft: cast, or a
// copy of raw bytes.
static int io_move(struct rnnd_engine *e, void *dst, const void *src, const struct io_part *p,
                   enum rnnd_ftype ft, bool in) {
    if (p->raw)
        return e->be.ops->copy(e->be.ctx, dst, src, p->n * p->raw);
    return in ? e->be.ops->cast(e->be.ctx, dst, RNND_FTYPE_F32, src, ft, p->n)
              : e->be.ops->cast(e->be.ctx, dst, ft, src, RNND_FTYPE_F32, p->n);
}

// The values of inputs the request's checks did not read (job->values_later), once they are
// in place: 0, or the job failed with the first bad value named by its index in the request
// (through rows, a part's rows in the request, of B; NULL: the request's own).
static int io_check(struct rnnd_engine *e, struct rnnd_job *job, const struct io_part *p, int k,
                    const int32_t *rows, int B) {
    for (int i = 0; i < k; i++) {
        int64_t first = -1;
        int rc = p[i].raw ? 0 : e->be.ops->nonfinite(e->be.ctx, p[i].dev, p[i].n, &first);
        if (rc)
            return rnnd_job_fail(job, rc, "cannot check the request's tensors: %s",
                                 rnnd_strerror(rc));
        if (first < 0)
            continue;
        int64_t per = (int64_t)p[i].n / B; // a part's inputs are all per row
        if (rows)
            first = rows[first / per] * per + first % per;
        return rnnd_job_fail(job, RNND_EINVAL,
                             "%s: element %" PRId64 " is NaN or infinite; send finite values",
                             p[i].name, first);
    }
    return 0;
}

// Inputs from a CUDA region, converted on the device. 0, or the job failed.
static int io_in_device(struct rnnd_engine *e, struct rnnd_job *job, const struct io_part *p, int k,
                        enum rnnd_ftype ft) {
    int rc = 0;
    for (int i = 0; rc == 0 && i < k; i++)
        rc = io_move(e, p[i].dev, p[i].host, &p[i], ft, true);
    if (rc)
        return rnnd_job_fail(job, rc, "cannot read the request's CUDA region: %s",
                             rnnd_strerror(rc));
    return 0;
}

// The job's GPU work is all queued: waits for it, or where the reply may go before it is done
// (job->dev_async) records the region's event after it and leaves the wait to the next job.
static int io_done(struct rnnd_engine *e, const struct rnnd_job *job) {
    if (!job->dev_async)
        return e->be.ops->sync(e->be.ctx);
    e->unsettled = true;
    return e->be.ops->ipc_record(e->be.ctx);
}

// Outputs into a CUDA reply_region, each at a multiple of RNND_SHM_ALIGN (64) bytes. Returns 1
// when they do not all fit (io_out then sends them as bytes), else 0 or the backend's error;
// then the work is done, or answered early (io_done).
static int io_out_device(struct rnnd_engine *e, struct rnnd_job *job, const struct io_part *p,
                         int k, enum rnnd_ftype ft) {
    size_t at = 0, off[16];
    for (int i = 0; i < k; i++) {
        off[i] = at;
        at = (at + io_part_bytes(&p[i], ft) + 63) / 64 * 64;
    }
    if (at > job->dev_out_bytes)
        return 1;
    int rc = 0;
    for (int i = 0; rc == 0 && i < k; i++) {
        rc = io_move(e, job->dev_out + off[i], p[i].dev, &p[i], ft, false);
        *p[i].out = job->dev_out + off[i];
    }
    return rc ? rc : io_done(e, job);
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

static int io_in(struct rnnd_engine *e, struct rnnd_job *job, const struct io_part *p, int k,
                 enum rnnd_ftype ft, char *d_area, char *h_area) {
    int rc = 0;
    if (e->host_mem && ft == RNND_FTYPE_F32) {
        for (int i = 0; i < k; i++)
            memcpy(p[i].dev, p[i].host, io_part_bytes(&p[i], ft));
        return 0;
    }
    size_t used = 0, off[16];
    for (int i = 0; i < k; i++) {
        off[i] = carve_off(&used, io_part_bytes(&p[i], ft));
        if (job->host_in) // already in the backend's host memory: straight to the device
            rc = rc ? rc : be_in(e, d_area + off[i], p[i].host, io_part_bytes(&p[i], ft));
        else
            memcpy(h_area + off[i], p[i].host, io_part_bytes(&p[i], ft));
    }
    // From the region the copies run asynchronously: the client may write it again once the
    // reply is out, which may come before any later synchronisation.
    if (job->host_in)
        rc = rc ? rc : e->be.ops->sync(e->be.ctx);
    else
        rc = be_in(e, d_area, h_area, used);
    for (int i = 0; rc == 0 && i < k; i++)
        rc = io_move(e, p[i].dev, d_area + off[i], &p[i], ft, true);
    return rc;
}

// Synchronises: the outputs are where *p[i].out points when it returns 0: in the job's CUDA
// reply_region when it has one they fit into, else on the host (copy_out).
static int io_out(struct rnnd_engine *e, struct rnnd_job *job, const struct io_part *p, int k,
                  enum rnnd_ftype ft, char *d_area, char *h_area) {
    int drc = job->dev_out ? io_out_device(e, job, p, k, ft) : 1;
    if (drc != 1)
        return drc;
    if (e->host_mem && ft == RNND_FTYPE_F32) {
        for (int i = 0; i < k; i++)
            *p[i].out = p[i].dev;
        return 0;
    }
    size_t used = 0, off[16];
    int rc = 0;
    for (int i = 0; i < k; i++)
        off[i] = carve_off(&used, io_part_bytes(&p[i], ft));
    // Into the reply_region itself where it is the backend's host memory and holds them all
    // (rnnd_shm_place then leaves them where they are), else through the staging.
    if (job->host_out_pinned && used <= job->host_out_bytes)
        h_area = job->host_out;
    for (int i = 0; i < k; i++) {
        if (rc == 0)
            rc = io_move(e, d_area + off[i], p[i].dev, &p[i], ft, false);
        *p[i].out = h_area + off[i];
    }
    // Nothing to copy still waits for the work: a reply then means it is done (and the kernel
    // time measured after it is the kernels').
    if (rc == 0)
        rc = used ? be_out(e, h_area, d_area, used) : e->be.ops->sync(e->be.ctx);
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
    float *acts; // (B*T, encoder acts) a policy's encoder activations, or NULL
    // The heads' outputs (models with heads), each NULL for a head the model lacks.
    float *logits, *mean, *log_std, *value; // (B, T, K), (B, T, A), (A), (B, T)
    int32_t *idx; // recorded: (B*T + B) store rows of the windows, then of their first steps
    char *area;   // the packed inputs (in_bytes), then the packed outputs; NULL when none
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
    const struct rnnd_policy *p = &e->model.policy;
    if (e->prow.W == 0 || f->return_core)
        out[k++] = (struct io_part){.dev = l->out, .n = BT * H, .out = &f->out};
    if (p->K)
        out[k++] = (struct io_part){.dev = l->logits, .n = BT * p->K, .out = &f->logits};
    if (p->A) {
        out[k++] = (struct io_part){.dev = l->mean, .n = BT * p->A, .out = &f->mean};
        out[k++] = (struct io_part){.dev = l->log_std, .n = p->A, .out = &f->log_std};
    }
    if (p->value)
        out[k++] = (struct io_part){.dev = l->value, .n = BT, .out = &f->value};
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
    l->acts = e->enc_acts ? carve(cv, BT * (size_t)e->enc_acts * sizeof(float)) : NULL;
    const struct rnnd_policy *p = &e->model.policy;
    l->logits = p->K ? carve(cv, BT * (size_t)p->K * sizeof(float)) : NULL;
    l->mean = p->A ? carve(cv, BT * (size_t)p->A * sizeof(float)) : NULL;
    l->log_std = p->A ? carve(cv, (size_t)p->A * sizeof(float)) : NULL;
    l->value = p->value ? carve(cv, BT * sizeof(float)) : NULL;
    struct io_part in[8], out[12];
    int nin, nout;
    fwd_parts(e, f, l, in, &nin, out, &nout);
    l->in_bytes = io_area_bytes(e, in, nin, f->in);
    if (rec && l->in_bytes == 0) // the rows are built on the host: they need the staging
        l->in_bytes = (BT + B) * sizeof(int32_t);
    size_t out_bytes = io_area_bytes(e, out, nout, f->out_dtype);
    l->area_bytes = (l->in_bytes + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN + out_bytes;
    return cv->used;
}

// Where env's next cursor window starts (docs/design.md "Cursor"): at its cursor, or past the
// steps that left the ring since (*over) and then past those computed by weights more than
// --max-policy-lag versions old (*lagged; versions only grow along an env's steps). Returns the
// steps there are from that start on.
static uint64_t cursor_start(const struct rnnd_engine *e, const struct rnnd_env *env,
                             uint64_t *first, uint64_t *lagged, uint64_t *over) {
    const struct rnnd_traj_ring *r = &env->traj;
    uint64_t oldest = r->total - (uint64_t)r->count;
    uint64_t at = r->cursor > oldest ? r->cursor : oldest;
    *over = at - r->cursor;
    uint64_t lag = (uint64_t)e->cfg.max_policy_lag, now = e->cur->version;
    *lagged = 0;
    while (e->tver && at < r->total &&
           e->tver[rnnd_traj_row_at(r, &e->tdims, env->slot, at)] + lag < now) {
        at++;
        (*lagged)++;
    }
    *first = at;
    return r->total - at;
}

// Fills the store rows of a recorded Forward (host: (B*T) rows of the windows, then B rows of
// their first steps); refuses envs that have recorded fewer than T steps (cursor windows: fewer
// than T from where the window starts, which the first call, idx NULL, fixes in f->cur_first).
static int recorded_rows(struct rnnd_engine *e, struct rnnd_job *job, int32_t *idx) {
    struct rnnd_forward_job *f = &job->fwd;
    int B = f->B, T = f->T;
    for (int b = 0; b < B; b++) {
        struct rnnd_env *env = rnnd_envtable_find(e->envs, f->env_ids[b]);
        int have = env ? env->traj.count : 0;
        if (f->cursor && idx == NULL && env) {
            uint64_t n = cursor_start(e, env, &f->cur_first[b], &f->cur_lagged[b], &f->cur_over[b]);
            if (n < (uint64_t)T)
                return rnnd_job_fail(
                    job, RNND_EPRECOND,
                    "env %" PRIu64 " has %" PRIu64 " new recorded steps from its cursor (step "
                    "%" PRIu64 "%s), a cursor window needs %d; step the env more first or ask "
                    "for fewer steps (nothing was handed out)",
                    f->env_ids[b], n, f->cur_first[b],
                    f->cur_lagged[b] ? ", past steps older than --max-policy-lag" : "", T);
        }
        if (have < T)
            return rnnd_job_fail(
                job, RNND_EPRECOND,
                "env %" PRIu64 " has %d recorded steps%s, Forward asked for the last %d; "
                "ask for at most %d steps or step the env more first",
                f->env_ids[b], have, env ? "" : " (no state: unknown, ended or evicted)", T, have);
        if (idx == NULL)
            continue;
        // The window's rows follow each other around the env's ring: from its first one to the
        // ring's end, then from the ring's start: two runs with no branch a row, which the
        // compiler vectorises (B=2048 T=64 is 131k rows).
        int32_t *row = idx + (size_t)b * (size_t)T;
        int32_t base = env->slot * e->tdims.cap;
        int32_t first = f->cursor
                            ? rnnd_traj_row_at(&env->traj, &e->tdims, env->slot, f->cur_first[b])
                            : rnnd_traj_row(&env->traj, &e->tdims, env->slot, T, 0);
        int run = base + e->tdims.cap - first < T ? base + e->tdims.cap - first : T;
        for (int t = 0; t < run; t++)
            row[t] = first + t;
        for (int t = run; t < T; t++)
            row[t] = base + (t - run);
        idx[(size_t)B * (size_t)T + (size_t)b] = row[0];
    }
    return 0;
}

// A cursor Forward that ran: each env's cursor moves to its window's last step, the bootstrap
// step of its next window, and what was skipped is counted.
static void cursor_advance(struct rnnd_engine *e, struct rnnd_forward_job *f) {
    uint64_t lagged = 0, over = 0;
    for (int b = 0; b < f->B; b++) {
        struct rnnd_env *env = rnnd_envtable_find(e->envs, f->env_ids[b]);
        env->traj.cursor = f->cur_first[b] + (uint64_t)f->T - 1;
        lagged += f->cur_lagged[b];
        over += f->cur_over[b];
    }
    atomic_fetch_add_explicit(&rnnd_metrics.recorded_dropped[RNND_DROP_POLICY_LAG], lagged,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&rnnd_metrics.recorded_dropped[RNND_DROP_OVERWRITTEN], over,
                              memory_order_relaxed);
}

// A recorded Forward's policy fields (struct rnnd_forward_job) from the record of its windows'
// rows, into the engine's host buffer (valid until the job is done). 0 or RNND_ENOMEM.
static int policy_record_read(struct rnnd_engine *e, struct rnnd_job *job) {
    struct rnnd_forward_job *f = &job->fwd;
    size_t BT = (size_t)f->B * (size_t)f->T, na = (size_t)e->prow.naction;
    bool act = e->prow.action >= 0, val = e->prow.value >= 0;
    bool want_act = f->rec_fields & RNND_REC_ACTION, want_rew = f->rec_fields & RNND_REC_REWARD;
    struct carve cv = {0};
    for (int pass = 0; pass < 2; pass++) {
        int32_t *idx = carve(&cv, (BT + (size_t)f->B) * sizeof(int32_t));
        f->rec_action = want_act && act ? carve(&cv, BT * (e->model.policy.A ? na * 4 : 8)) : NULL;
        f->rec_logp = want_act && act ? carve(&cv, BT * sizeof(float)) : NULL;
        f->rec_value = want_act && val ? carve(&cv, BT * sizeof(float)) : NULL;
        f->rec_reward = want_rew ? carve(&cv, BT * sizeof(float)) : NULL;
        f->rec_done = want_rew ? carve(&cv, BT) : NULL;
        f->rec_truncated = want_rew ? carve(&cv, BT) : NULL;
        if (pass == 1) {
            recorded_rows(e, job, idx);
            break;
        }
        if (cv.used > e->rec_host_bytes) {
            free(e->rec_host);
            e->rec_host_bytes = 0;
            if ((e->rec_host = malloc(cv.used)) == NULL)
                return RNND_ENOMEM;
            e->rec_host_bytes = cv.used;
        }
        cv = (struct carve){e->rec_host, 0};
    }
    const int32_t *idx = (const int32_t *)e->rec_host;
    size_t off_logp = (size_t)(e->prow.logp - e->prow.ndist);
    size_t off_val = (size_t)(e->prow.value - e->prow.ndist);
    for (size_t i = 0; i < BT; i++) {
        const float *rec = e->prec + (size_t)idx[i] * e->prec_w;
        if (f->rec_action && e->model.policy.K)
            ((int64_t *)f->rec_action)[i] = (int64_t)rec[0];
        else if (f->rec_action)
            memcpy((float *)f->rec_action + i * na, rec, na * sizeof(float));
        if (f->rec_logp)
            f->rec_logp[i] = rec[off_logp];
        if (f->rec_value)
            f->rec_value[i] = rec[off_val];
        if (f->rec_reward) {
            f->rec_reward[i] = rec[e->prec_w - 1];
            f->rec_done[i] = e->pflags[idx[i]] & 1;
            f->rec_truncated[i] = (e->pflags[idx[i]] >> 1) & 1;
        }
    }
    return 0;
}

// What a Forward that is part of a larger one keeps in its tape (rnnd__engine_run_forward_part).
struct fwd_part {
    uint64_t tape_id;    // the id every engine keeps its part under
    const int32_t *rows; // (B) the rows within the whole Forward
    int B_all;
};

void rnnd__engine_run_forward(struct rnnd_engine *e, struct rnnd_job *job,
                              const struct fwd_part *pt) {
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
        tape_bytes = e->be.ops->tape_bytes(e->be.ctx, &e->core, B, T);
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
                          : rnnd__engine_work_reserve(e, area_at + l.area_bytes, &block);
    if (rc == 0 && f->keep_tape && l.area_bytes)
        rc = rnnd__engine_work_reserve(e, l.area_bytes, &work);
    char *host = NULL;
    if (rc == 0) {
        cv = (struct carve){block, 0};
        fwd_carve(e, &cv, &l, f, has_h0, has_hidden, tape_bytes);
        l.area = !l.area_bytes ? NULL : f->keep_tape ? work : (char *)block + area_at;
        host = l.area ? rnnd__engine_xfer_host(e, l.area, l.area_bytes) : (char *)block;
        // With the CPU backend an fp32 output is written straight into a host reply_region that
        // holds it (rnnd_shm_place leaves it there) instead of being copied there after: only
        // the heads' backward reads it again, and a model with heads keeps it in the tape.
        if (e->host_mem && f->out_dtype == RNND_FTYPE_F32 && !e->prow.W && job->host_out &&
            (uintptr_t)job->host_out % RNND_SHM_ALIGN == 0 &&
            (size_t)B * T * e->model.H * sizeof(float) <= job->host_out_bytes)
            l.out = (float *)job->host_out;
    }
    if (host == NULL) {
        rnnd_job_fail(job, RNND_ENOMEM,
                      "out of memory for a Forward of %d x %d steps (%.1f MiB on the %s "
                      "backend); send fewer rows or steps",
                      B, T, (double)bytes / 1048576.0, e->backend_name);
        goto out;
    }
    struct io_part in[8], outs[12];
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
        rc = io_in(e, job, in, nin, f->in, l.area, host);
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
    if (rc == 0 && l.acts) {
        // A policy's encoder first: its last block of activations is the core's input.
        rc = e->be.ops->encoder_forward(e->be.ctx, l.acts, l.x, (int)BT, e->cur->params, &e->model);
        seq.x = l.acts + BT * (size_t)(e->enc_acts - e->core.I);
    }
    if (rc == 0)
        rc = e->be.ops->rnn_forward(e->be.ctx, l.out, l.h_n, l.c_n, l.tape, &seq, e->cur->params,
                                    &e->core);
    if (rc == 0 && e->prow.W) {
        // The heads on every step's core output; the log-std is the parameter itself.
        struct rnnd_heads hd = {.logits = l.logits, .mean = l.mean, .value = l.value};
        rc = e->be.ops->heads_forward(e->be.ctx, &hd, l.out, (int)BT, e->cur->params, &e->model);
        if (rc == 0 && l.log_std)
            rc = e->be.ops->copy(e->be.ctx, l.log_std,
                                 e->cur->params +
                                     rnnd_model_param_offset(&e->model, "action_log_std"),
                                 (size_t)e->model.policy.A * sizeof(float));
    }
    if (rc == 0 && rec && (f->rec_fields & (RNND_REC_ACTION | RNND_REC_REWARD)))
        rc = policy_record_read(e, job);
    if (rc == 0) // one copy back of everything returned
        rc = io_out(e, job, outs, nout, f->out_dtype, l.area ? l.area + out_at : NULL,
                    host + out_at);
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
                                  .tape = l.tape,
                                  .acts = l.acts,
                                  .out = e->prow.W ? l.out : NULL};
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
        rnnd__engine_tape_gauges(e);
    }
    if (f->cursor)
        cursor_advance(e, f);
    job->err = 0;
out:
    if (block && block != e->work)
        tape_block_free(e, block, block_bytes);
}

// n rows of `row` bytes copied dst[i] = src[rows[i]] (gather) or dst[rows[i]] = src[i].
struct rows_copy {
    char *dst;
    const char *src;
    const int32_t *rows;
    int n;
    size_t row;
    bool scatter;
};

static void rows_copy_part(void *arg, int k, int parts) {
    const struct rows_copy *c = arg;
    int lo = (int)((int64_t)c->n * k / parts), hi = (int)((int64_t)c->n * (k + 1) / parts);
    for (int i = lo; i < hi; i++) {
        size_t mine = (size_t)i * c->row, theirs = (size_t)c->rows[i] * c->row;
        memcpy(c->dst + (c->scatter ? theirs : mine), c->src + (c->scatter ? mine : theirs),
               c->row);
    }
}

// A part's rows of a learner's batch move tens of MB between the request or reply and the
// engine's memory: on the row workers too, a MiB or more each (less: one thread is quicker
// than waking others).
static void rows_copy(struct rnnd_engine *e, void *dst, const void *src, const int32_t *rows, int n,
                      size_t row, bool scatter) {
    struct rows_copy c = {dst, src, rows, n, row, scatter};
    rnnd_threadpool_run(e->row_workers, (int)((size_t)n * row >> 20), rows_copy_part, &c);
}

static void rows_gather(struct rnnd_engine *e, void *dst, const void *src, const int32_t *rows,
                        int n, size_t row) {
    rows_copy(e, dst, src, rows, n, row, false);
}

static void rows_scatter(struct rnnd_engine *e, void *dst, const void *src, const int32_t *rows,
                         int n, size_t row) {
    rows_copy(e, dst, src, rows, n, row, true);
}

// This engine's rows of a Forward shared by several engines (struct rnnd_forward_job): gathers
// them into a Forward of its own, runs it, and scatters the outputs into the submitter's arrays.
void rnnd__engine_run_forward_part(struct rnnd_engine *e, struct rnnd_job *job) {
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
    s->return_core = f->return_core;
    char *block = NULL;
    uint64_t *ids = NULL;
    if (f->recorded) {
        ids = malloc((size_t)n * sizeof(*ids));
        if (ids == NULL) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of host memory for a Forward part of %d rows", n);
            return;
        }
        rows_gather(e, ids, f->env_ids, rows, n, sizeof(*ids));
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
        rows_gather(e, (void *)s->x, f->x, rows, n, Tz * I * fi);
        rows_gather(e, (void *)s->is_init, f->is_init, rows, n, Tz);
        if (f->h0)
            rows_gather(e, (void *)s->h0, f->h0, rows, n, LH * fi);
        if (f->c0)
            rows_gather(e, (void *)s->c0, f->c0, rows, n, LH * fi);
        if (f->hidden)
            rows_gather(e, (void *)s->hidden, f->hidden, rows, n, Tz * LH * fi);
        if (f->cell)
            rows_gather(e, (void *)s->cell, f->cell, rows, n, Tz * LH * fi);
    }
    struct fwd_part pt = {.tape_id = f->tape_id, .rows = rows, .B_all = f->B};
    rnnd__engine_run_forward(e, &sub, &pt);
    job->err = sub.err;
    memcpy(job->msg, sub.msg, sizeof(job->msg));
    job->model_version = sub.model_version;
    if (sub.err == 0) {
        const struct rnnd_policy *p = &e->model.policy;
        if (s->out)
            rows_scatter(e, f->out, s->out, rows, n, Tz * H * fo);
        if (s->logits)
            rows_scatter(e, f->logits, s->logits, rows, n, Tz * (size_t)p->K * fo);
        if (s->mean) {
            rows_scatter(e, f->mean, s->mean, rows, n, Tz * (size_t)p->A * fo);
            memcpy(f->log_std, s->log_std, (size_t)p->A * fo);
        }
        if (s->value)
            rows_scatter(e, f->value, s->value, rows, n, Tz * fo);
        rows_scatter(e, f->h_n, s->h_n, rows, n, LH * fo);
        if (e->lstm)
            rows_scatter(e, f->c_n, s->c_n, rows, n, LH * fo);
        if (s->rec_obs)
            rows_scatter(e, f->rec_obs, s->rec_obs, rows, n, Tz * I * fo);
        if (s->rec_is_init)
            rows_scatter(e, f->rec_is_init, s->rec_is_init, rows, n, Tz);
        if (s->rec_extras)
            rows_scatter(e, f->rec_extras, s->rec_extras, rows, n, Tz * E * fo);
        if (s->rec_version)
            rows_scatter(e, f->rec_version, s->rec_version, rows, n, Tz * sizeof(int64_t));
        size_t A = (size_t)e->model.policy.A;
        if (s->rec_action)
            rows_scatter(e, f->rec_action, s->rec_action, rows, n, Tz * (A ? A * 4 : 8));
        if (s->rec_logp)
            rows_scatter(e, f->rec_logp, s->rec_logp, rows, n, Tz * sizeof(float));
        if (s->rec_value)
            rows_scatter(e, f->rec_value, s->rec_value, rows, n, Tz * sizeof(float));
        if (s->rec_reward) {
            rows_scatter(e, f->rec_reward, s->rec_reward, rows, n, Tz * sizeof(float));
            rows_scatter(e, f->rec_done, s->rec_done, rows, n, Tz);
            rows_scatter(e, f->rec_truncated, s->rec_truncated, rows, n, Tz);
        }
    }
    free(block);
    free(ids);
}

// ---------------------------------------------------------------------------------------------
// Backward

// ag: a part's own rows (rnnd__engine_run_backward_part), which run only once every engine
// agrees, and whose weight gradients stay in grad_scratch (without accumulate) for the
// all-reduce; NULL alone.
// The tape is looked up as of now.
void rnnd__engine_run_backward(struct rnnd_engine *e, struct rnnd_job *job, struct agreement *ag,
                               uint64_t now) {
    struct rnnd_backward_job *g = &job->bwd;
    bool part = ag != NULL;
    void *p;
    if (rnnd_tapes_get(e->tapes, g->tape_id, now, &p) != 0) {
        rnnd__engine_tape_gauges(e);
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
        const char *name = g->grad_out      ? "grad_output"
                           : g->grad_logits ? "grad_logits"
                           : g->grad_mean   ? "grad_mean"
                                            : "grad_head_value";
        rnnd_job_fail(job, RNND_EINVAL,
                      "%s: [B, T] = [%d, %d] does not match tape %" PRIu64
                      " ([B, T] = [%d, %d] from its Forward); send the gradients of that "
                      "Forward's outputs",
                      name, g->B, g->T, g->tape_id, B, T);
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
    unsigned want = g->input_grads_set ? g->input_grads
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
    uint64_t reply =
        ((want & RNND_GRAD_OBS ? rows_all * I : 0) +
         (want & RNND_GRAD_H0 ? (uint64_t)t->B_all * LH * sl : 0) +
         (want & RNND_GRAD_HIDDEN ? rows_all * LH * sl : 0) + (g->accumulate ? 0 : e->P)) *
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
    // A policy's: the heads' output gradients, dL/dh from the heads, and dL/d the core's input
    // (the encoder's output).
    const struct rnnd_policy *pol = &e->model.policy;
    bool heads = g->grad_logits || g->grad_mean || g->grad_value;
    size_t CI = (size_t)e->core.I;
    float *d_gl, *d_gm, *d_gls, *d_gv, *d_gcx;
    struct io_part in[7], outs[7];
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
        d_gl = g->grad_logits ? carve(&cv, BT * (size_t)pol->K * sizeof(float)) : NULL;
        d_gm = g->grad_mean ? carve(&cv, BT * (size_t)pol->A * sizeof(float)) : NULL;
        d_gls = g->grad_log_std ? carve(&cv, (size_t)pol->A * sizeof(float)) : NULL;
        d_gv = g->grad_value ? carve(&cv, BT * sizeof(float)) : NULL;
        d_gcx = e->enc_acts ? carve(&cv, BT * CI * sizeof(float)) : NULL;
        // The parts follow from the request alone (pass 0 measures with NULL pointers).
        nin = nout = 0;
        if (g->grad_out)
            in[nin++] = (struct io_part){
                .dev = d_go, .n = BT * H, .host = g->grad_out, .name = "grad_output"};
        if (d_gl)
            in[nin++] = (struct io_part){
                .dev = d_gl, .n = BT * pol->K, .host = g->grad_logits, .name = "grad_logits"};
        if (d_gm)
            in[nin++] = (struct io_part){
                .dev = d_gm, .n = BT * pol->A, .host = g->grad_mean, .name = "grad_mean"};
        if (d_gls)
            in[nin++] = (struct io_part){
                .dev = d_gls, .n = pol->A, .host = g->grad_log_std, .name = "grad_log_std"};
        if (d_gv)
            in[nin++] = (struct io_part){
                .dev = d_gv, .n = BT, .host = g->grad_value, .name = "grad_head_value"};
        if (g->grad_h_n)
            in[nin++] =
                (struct io_part){.dev = d_ghn, .n = BLH, .host = g->grad_h_n, .name = "grad_h_n"};
        if (g->grad_c_n)
            in[nin++] =
                (struct io_part){.dev = d_gcn, .n = BLH, .host = g->grad_c_n, .name = "grad_c_n"};
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
        if (rnnd__engine_work_reserve(e, area_at + area_bytes, &block) != 0 ||
            (area_bytes &&
             (host = rnnd__engine_xfer_host(e, (char *)block + area_at, area_bytes)) == NULL)) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of memory for a Backward of %d x %d steps", B, T);
            return;
        }
        area = area_bytes ? (char *)block + area_at : NULL;
        cv = (struct carve){block, 0};
    }
    // The inputs in place, and checked where the request's checks did not read them, before
    // anything changes. fp32 gradients are read where they arrived: in a CUDA region
    // (rnn_backward stages arrays its vector loads cannot take, as a span's offset need only be
    // a multiple of 4), or in host memory with the CPU backend (the request's bytes or its
    // shared-memory region, which the client leaves alone until the reply); with heads, dL/dh
    // is added into grad_output, so a copy of it.
    bool in_place = (job->dev_in || e->host_mem) && g->in == RNND_FTYPE_F32 && !heads;
    for (int i = 0; i < nin; i++)
        in_place = in_place && (uintptr_t)in[i].host % sizeof(float) == 0;
    for (int i = 0; in_place && i < nin; i++)
        in[i].dev = (void *)in[i].host;
    const float *go = in_place && g->grad_out ? (const float *)g->grad_out : d_go;
    const float *ghn = in_place && g->grad_h_n ? (const float *)g->grad_h_n : d_ghn;
    const float *gcn = in_place && g->grad_c_n ? (const float *)g->grad_c_n : d_gcn;
    if (job->dev_in && !in_place && io_in_device(e, job, in, nin, g->in) != 0)
        return;
    int rc = job->dev_in || in_place ? 0 : io_in(e, job, in, nin, g->in, area, host);
    if (rc == 0 && job->values_later && io_check(e, job, in, nin, g->rows, B) != 0)
        return;
    // Everything this part needs is here and checked; from now on it changes state (the tape,
    // and the accumulated gradients), so only if every other part can run too. (A part that
    // fails before this point says no after it returns: rnnd__engine_run_backward_part.)
    if (part && rc == 0 && !agree(e, ag, true))
        return;
    if (rc == 0 && !g->accumulate)
        rc = e->be.ops->zero(e->be.ctx, dparams, e->P * sizeof(float));
    if (rc == 0 && !g->grad_out)
        rc = e->be.ops->zero(e->be.ctx, d_go, BT * H * sizeof(float));
    uint64_t t0 = rnnd_now_ns();
    // The heads first: their weight gradients, and dL/dh added to grad_output's in place; the
    // log-std's gradient [A] as one row of per-row ones.
    struct rnnd_heads hg = {.logits = d_gl, .mean = d_gm, .value = d_gv};
    if (rc == 0 && heads)
        rc = e->be.ops->heads_backward(e->be.ctx, dparams, d_go, &hg, t->out, (int)BT, t->w->params,
                                       &e->model);
    if (rc == 0 && d_gls)
        rc = e->be.ops->heads_backward(e->be.ctx, dparams, d_go,
                                       &(struct rnnd_heads){.log_std = d_gls}, t->out, 1,
                                       t->w->params, &e->model);
    struct rnnd_seq seq = {.B = B,
                           .T = T,
                           .x = t->acts ? t->acts + BT * (size_t)(e->enc_acts - e->core.I) : t->x,
                           .is_init = t->is_init,
                           .h0 = t->h0,
                           .c0 = t->c0,
                           .hidden = t->hidden,
                           .cell = t->cell};
    struct rnnd_seq_grads grads = {.params = dparams,
                                   .x = d_gcx ? d_gcx : d_gx,
                                   .h0 = d_gh0,
                                   .c0 = d_gc0,
                                   .hidden = d_ghid,
                                   .cell = d_gcell};
    if (rc == 0)
        rc = e->be.ops->rnn_backward(e->be.ctx, &grads, go, ghn, gcn, t->tape, &seq, t->w->params,
                                     &e->core);
    if (rc == 0 && d_gcx) // the encoder last, from the core input's gradient
        rc = e->be.ops->encoder_backward(e->be.ctx, dparams, d_gx, d_gcx, t->acts, t->x, (int)BT,
                                         t->w->params, &e->model);
    if (rc == 0) // one copy back of everything returned
        rc = io_out(e, job, outs, nout, g->out_dtype, area ? area + in_bytes : NULL,
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
    rnnd__engine_tape_gauges(e);
    job->err = 0;
}

// This engine's share of a Backward over a Forward that several engines ran (struct
// rnnd_backward_job): every engine of the daemon checks its part (its tape part is there, the
// shapes match, the memory is there), all agree, and only then run their rows and, without
// accumulate, all-reduce the weight gradients. A part refused here is the Backward's error;
// the others finish with err 0 and their tape parts kept.
void rnnd__engine_run_backward_part(struct rnnd_engine *e, struct rnnd_job *job) {
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
        rnnd__engine_tape_gauges(e);
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
        // This engine's rows, gathered into its page-locked buffer, which the inner Backward
        // copies to the device without staging (and checks there before the agreement, where
        // the request's checks did not read them).
        size_t go_row = Tz * H * fi, hn_row = LH * fi, at_hn = (size_t)n * go_row;
        size_t at_cn = at_hn + (g->grad_h_n ? (size_t)n * hn_row : 0);
        char *buf = rnnd__engine_part_host(e, at_cn + (g->grad_c_n ? (size_t)n * hn_row : 0));
        char *go = buf, *ghn = g->grad_h_n && buf ? buf + at_hn : NULL;
        char *gcn = g->grad_c_n && buf ? buf + at_cn : NULL;
        if (buf == NULL) {
            rnnd_job_fail(job, RNND_ENOMEM, "out of host memory for a Backward part of %d rows", n);
        } else {
            rows_gather(e, go, g->grad_out, rows, n, go_row);
            if (ghn)
                rows_gather(e, ghn, g->grad_h_n, rows, n, hn_row);
            if (gcn)
                rows_gather(e, gcn, g->grad_c_n, rows, n, hn_row);
            // The tape is dropped by the inner Backward when it runs: keep its rows.
            int32_t *mine = t->rows;
            t->rows = NULL;
            struct rnnd_job sub = {
                .kind = RNND_JOB_BACKWARD, .host_in = true, .values_later = job->values_later};
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
                                                 .accumulate = g->accumulate,
                                                 .rows = rows};
            rnnd__engine_run_backward(e, &sub, &ag, now);
            struct rnnd_backward_job *sb = &sub.bwd;
            // Still there unless the rows ran (refused, a part elsewhere refused, or failed).
            bool kept = rnnd_tapes_get(e->tapes, g->tape_id, now, &p) == 0;
            if (sub.err) {
                job->err = sub.err;
                memcpy(job->msg, sub.msg, sizeof(job->msg));
            } else if (!kept) {
                job->model_version = sub.model_version;
                if (g->grad_x && sb->grad_x)
                    rows_scatter(e, g->grad_x, sb->grad_x, mine, n, Tz * I * fo);
                if (g->grad_h0 && sb->grad_h0)
                    rows_scatter(e, g->grad_h0, sb->grad_h0, mine, n, LH * fo);
                if (g->grad_c0 && sb->grad_c0)
                    rows_scatter(e, g->grad_c0, sb->grad_c0, mine, n, LH * fo);
                if (g->grad_hidden && sb->grad_hidden)
                    rows_scatter(e, g->grad_hidden, sb->grad_hidden, mine, n, Tz * LH * fo);
                if (g->grad_cell && sb->grad_cell)
                    rows_scatter(e, g->grad_cell, sb->grad_cell, mine, n, Tz * LH * fo);
            }
            if (kept)
                ((struct tape_obj *)p)->rows = mine;
            else
                free(mine);
        }
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

void rnnd__engine_run_apply(struct rnnd_engine *e, struct rnnd_job *job) {
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
    struct weights *w = rnnd__engine_weights_new(e);
    size_t bytes = e->P * sizeof(float);
    float *g = sent ? e->grad_scratch : e->grad_accum;
    int rc = w ? 0 : RNND_ENOMEM;
    bool root_here = a->root < 0 || !e->replicas || rnnd_comm_rank(e->replicas) == a->root;
    if (rc == 0 && sent && a->grads && root_here)
        rc = be_in(e, g, a->grads, bytes);
    struct agreement ag = {.comm = e->replicas};
    if (!agree(e, &ag, rc == 0)) {
        rnnd__engine_weights_unref(e, w);
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
        rnnd__engine_weights_unref(e, w);
        if (crc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "gradient exchange failed: %s", rnnd_strerror(crc));
        rnnd_job_fail(job, crc,
                      "the replicas did not exchange the gradients: %s; ApplyGradients needs every "
                      "device and every rnnd of the group (--comm-timeout-s %d)",
                      rnnd_strerror(crc), e->cfg.comm_timeout_s);
        return;
    }
    if (!sent && !pending) {
        rnnd__engine_weights_unref(e, w);
        rnnd_job_fail(job, RNND_EPRECOND,
                      "no accumulated gradients to apply on any replica; call Backward with "
                      "accumulate=true first, or send grads");
        return;
    }
    // Answered early (a Backward's apply into an async region), nothing here waits, not even
    // for the norm (logged as nan).
    float norm = NAN;
    uint64_t t0 = rnnd_now_ns();
    rc = e->be.ops->copy(e->be.ctx, w->params, e->cur->params, bytes);
    if (rc == 0)
        rc = e->be.ops->optim_step(e->be.ctx, w->params, g, e->adam_m, e->adam_v, e->P, &o,
                                   e->optim_t + 1, job->dev_async ? NULL : &norm);
    if (rc == 0 && !job->dev_async)
        rc = e->be.ops->sync(e->be.ctx);
    rnnd_metrics_kernel(RNND_OP_OPTIM, rnnd_now_ns() - t0);
    if (rc != 0) {
        rnnd__engine_weights_unref(e, w);
        if (rc == RNND_EDEVICE)
            rnnd_panic(__FILE__, __LINE__, "backend optimizer step failed: %s", rnnd_strerror(rc));
        if (e->replicas)
            rnnd_log(RNND_LOG_ERROR,
                     "device %d skipped an update (%s): its weights now differ "
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
    rnnd__engine_weights_swap(e, w);
    rnnd_log(RNND_LOG_DEBUG, "applied gradients: version %" PRIu64 ", grad norm %g, lr %g",
             e->cur->version, (double)norm, (double)o.lr);
    job->model_version = e->cur->version;
    job->err = 0;
}

void rnnd__engine_run_get_weights(struct rnnd_engine *e, struct rnnd_job *job) {
    int rc = be_out(e, job->weights.params, e->cur->params, e->P * sizeof(float));
    if (rc != 0) {
        rnnd_job_fail(job, rc, "cannot read the weights: %s", rnnd_strerror(rc));
        return;
    }
    job->model_version = e->cur->version;
    job->err = 0;
}

void rnnd__engine_run_set_weights(struct rnnd_engine *e, struct rnnd_job *job) {
    int root = job->weights.root;
    struct weights *w = rnnd__engine_weights_new(e);
    int rc = w ? 0 : RNND_ENOMEM;
    bool root_here = root < 0 || !e->replicas || rnnd_comm_rank(e->replicas) == root;
    if (rc == 0 && root_here)
        rc = be_in(e, w->params, job->weights.params, e->P * sizeof(float));
    // The new weights run on every replica or on none.
    struct agreement ag = {.comm = e->replicas};
    if (!agree(e, &ag, rc == 0)) {
        rnnd__engine_weights_unref(e, w);
        update_refused(e, job, rc, &ag);
        return;
    }
    if (e->replicas && root >= 0)
        rc = rnnd_comm_broadcast(e->replicas, w->params, e->P, root);
    if (rc == 0)
        rc = e->be.ops->sync(e->be.ctx);
    if (rc != 0) {
        rnnd__engine_weights_unref(e, w);
        if (e->replicas)
            rnnd_log(RNND_LOG_ERROR,
                     "device %d did not take the new weights (%s): its weights "
                     "differ from the other replicas'; restart rnnd to resynchronise them",
                     e->index, rnnd_strerror(rc));
        rnnd_job_fail(job, rc, "cannot load the weights: %s", rnnd_strerror(rc));
        return;
    }
    rnnd__engine_weights_swap(e, w);
    job->model_version = e->cur->version;
    job->err = 0;
}

// ---------------------------------------------------------------------------------------------
// Replicas: joining a communicator, and the start-up sync

void rnnd__engine_run_comm(struct rnnd_engine *e, struct rnnd_job *job) {
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
void rnnd__engine_run_sync(struct rnnd_engine *e, struct rnnd_job *job) {
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
    if (rc == 0)
        rc = rnnd__engine_weights_changed(e, e->cur);
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
