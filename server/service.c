/*
 * service.c: the rnnd.v1.Rnn handlers (see service.h). Each handler checks its request with its
 * method's function of request.h, builds one job in one allocation, and submits it; the job's
 * done callback (engine thread) builds the reply from the job's outputs, finishes the call and
 * frees the job.
 */
#include "service.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "request.h"
#include "rnnd/v1/rnnd.pb-c.h"
#include "shm.h"

#define ERRLEN RNND_REQUEST_ERRLEN

typedef Rnnd__V1__Tensor Tensor;

// Bump allocator for a job and its arrays in one calloc.
struct alloc {
    char *base;
    size_t used;
};

static void *take(struct alloc *a, size_t bytes) {
    size_t at = (a->used + 15) / 16 * 16;
    a->used = at + bytes;
    return a->base ? a->base + at : NULL;
}

// ---------------------------------------------------------------------------------------------
// Reply tensors

struct tout {
    Tensor t;
    int64_t shape[4];
};

static Tensor *tset(struct tout *o, int dtype, const void *data, int ndim, int64_t d0, int64_t d1,
                    int64_t d2, int64_t d3) {
    rnnd__v1__tensor__init(&o->t);
    int64_t d[4] = {d0, d1, d2, d3};
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        o->shape[i] = d[i];
        count *= (uint64_t)d[i];
    }
    o->t.n_shape = (size_t)ndim;
    o->t.shape = o->shape;
    o->t.dtype = dtype;
    o->t.data.len = (size_t)(count * rnnd_request_dtype_size(dtype));
    o->t.data.data = (uint8_t *)data;
    return &o->t;
}

static struct rnnd_service *svc_of(void *p) {
    return p;
}

// A check's result; RNND_EFULL from request.c always means a reply over --max-message-mb.
static int counted(int rc) {
    if (rc == RNND_EFULL)
        rnnd_metrics_limit_hit(RNND_LIMIT_MESSAGE);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// GetModelInfo: answered on the gRPC thread from the engine's atomics.

void rnnd_service_get_model_info(void *p, struct rnnd_call *call, const ProtobufCMessage *req) {
    (void)req;
    struct rnnd_service *s = svc_of(p);
    const struct rnnd_model *m = rnnd_group_model(s->group);
    Rnnd__V1__ModelInfo info = RNND__V1__MODEL_INFO__INIT;
    info.cell = (char *)rnnd_config_cell_name(m->cell);
    info.input_size = m->I;
    info.hidden_size = m->H;
    info.num_layers = m->L;
    info.compute = (char *)rnnd_config_compute_name(m->compute);
    info.backend = (char *)rnnd_group_backend_name(s->group);
    info.device = (char *)rnnd_group_device_name(s->group);
    info.kernel_plan = (char *)rnnd_group_plan_name(s->group);
    info.model_version = rnnd_group_model_version(s->group);
    info.envs_active = rnnd_group_envs_active(s->group);
    info.max_batch = (uint64_t)s->cfg->max_batch;
    info.extras_size = s->cfg->extras_size;
    const struct rnnd_policy *pol = &m->policy;
    int64_t widths[RNND_MAX_ENCODER_LAYERS];
    for (int j = 0; j < pol->enc_layers; j++)
        widths[j] = pol->enc_width[j];
    info.n_encoder_widths = (size_t)pol->enc_layers;
    info.encoder_widths = widths;
    info.encoder_activation = (char *)(pol->enc_layers ? rnnd_config_act_name(pol->enc_act) : "");
    info.discrete_actions = pol->K;
    info.gaussian_actions = pol->A;
    info.value_head = pol->value;
    rnnd_call_reply(call, &info.base);
}

// ---------------------------------------------------------------------------------------------
// Step

// A Step's reply dtype and what it asked for, kept after its job (struct alloc), with the
// arrays its policy reply is unpacked into (NULL without heads).
struct step_extra {
    size_t bytes; // of the job's block (struct alloc), which the reply is sent from
    enum rnnd_ftype out;
    bool return_logits, return_core;
    int64_t *index; // (B) discrete action
    float *action;  // (B, A) Gaussian action
    float *logp;    // (B)
    float *value;   // (B)
    float *dist;    // (B, K or A) logits or mean, when return_logits
};

// Narrows n fp32 values at p to dtype ft in place (element i moves to bytes 2i: in increasing
// order nothing is overwritten before it is read) and returns ft's wire DType.
static int narrow(void *p, size_t n, enum rnnd_ftype ft) {
    if (ft != RNND_FTYPE_F32)
        rnnd_cast_host(p, ft, p, RNND_FTYPE_F32, n);
    return rnnd_request_dtype_of(ft);
}

// Where take() put the step_extra after the job (its 16-byte alignment, not job + 1).
static struct step_extra *step_extra_of(struct rnnd_job *job) {
    return (struct step_extra *)((char *)job + (sizeof(*job) + 15) / 16 * 16);
}

static void step_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    struct rnnd_step_job *st = &job->step;
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
    } else {
        const struct rnnd_model *m = rnnd_group_model(svc_of(job->aux)->group);
        int64_t dims[3] = {m->H, m->L, m->cell == RNND_CELL_LSTM};
        size_t LH = (size_t)(m->L * m->H), B = (size_t)st->B;
        struct step_extra *ex = step_extra_of(job);
        enum rnnd_ftype ft = ex->out;
        Rnnd__V1__StepReply r = RNND__V1__STEP_REPLY__INIT;
        struct tout out, h, c;
        struct rnnd_policy_row pr = rnnd_policy_row(m);
        if (pr.W == 0 || ex->return_core) // in the reply's dtype already (struct rnnd_step_job)
            r.output = tset(&out, rnnd_request_dtype_of(ft), st->out, 2, st->B, dims[0], 0, 0);
        r.model_version = job->model_version;
        struct tout act, logp, val, dist;
        if (pr.W) {
            // Unpack the rows into one array per tensor.
            size_t W = (size_t)pr.W, nd = (size_t)pr.ndist, na = (size_t)pr.naction;
            for (size_t b = 0; b < B; b++) {
                const float *row = st->pol + b * W;
                if (ex->index)
                    ex->index[b] = (int64_t)row[pr.action];
                if (ex->action)
                    memcpy(ex->action + b * na, row + pr.action, na * sizeof(float));
                if (ex->logp)
                    ex->logp[b] = row[pr.logp];
                if (ex->value)
                    ex->value[b] = row[pr.value];
                if (ex->dist)
                    memcpy(ex->dist + b * nd, row + pr.dist, nd * sizeof(float));
            }
            if (ex->index)
                r.action = tset(&act, RNND__V1__DTYPE__INT64, ex->index, 1, st->B, 0, 0, 0);
            if (ex->action)
                r.action = tset(&act, narrow(ex->action, B * na, ft), ex->action, 2, st->B,
                                (int64_t)na, 0, 0);
            if (ex->logp)
                r.log_prob = tset(&logp, narrow(ex->logp, B, ft), ex->logp, 1, st->B, 0, 0, 0);
            if (ex->value)
                r.value = tset(&val, narrow(ex->value, B, ft), ex->value, 1, st->B, 0, 0, 0);
            if (ex->dist) {
                Tensor *t = tset(&dist, narrow(ex->dist, B * nd, ft), ex->dist, 2, st->B,
                                 (int64_t)nd, 0, 0);
                if (m->policy.K)
                    r.logits = t;
                else
                    r.mean = t;
            }
        }
        if (st->return_state) {
            r.h = tset(&h, narrow(st->h, B * LH, ft), st->h, 3, st->B, dims[1], dims[0], 0);
            if (dims[2])
                r.c = tset(&c, narrow(st->c, B * LH, ft), st->c, 3, st->B, dims[1], dims[0], 0);
        }
        rnnd_call_reply_lent(call, &r.base, job, ex->bytes, free);
        return;
    }
    free(job);
}

void rnnd_service_step(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__StepRequest *req = (const Rnnd__V1__StepRequest *)msg;
    const struct rnnd_model *m = rnnd_group_model(s->group);
    char err[ERRLEN];
    size_t B = req->n_env_ids;
    bool lstm = m->cell == RNND_CELL_LSTM, extras;
    struct rnnd_request_dtypes dts;
    int rc = rnnd_request_step(&s->limits, req, &extras, &dts, err);
    if (rc == 0)
        rc = rnnd_call_reserve(call, rnnd_request_step_reply_bytes(&s->limits, req), err,
                               sizeof(err));
    if (rc != 0)
        goto bad;
    size_t H = (size_t)m->H, LH = (size_t)m->L * H, I = (size_t)m->I;
    size_t E = (size_t)s->cfg->extras_size;
    bool wide = dts.in != RNND_FTYPE_F32; // 16-bit inputs: widened here, the engine takes fp32
    struct alloc a = {0};
    struct rnnd_job *job;
    struct step_extra *ex;
    void *out;
    float *h = NULL, *c = NULL, *obs32 = NULL, *extras32 = NULL, *pol = NULL;
    struct rnnd_policy_row pr = rnnd_policy_row(m);
    size_t W = (size_t)pr.W;
    struct step_extra unpacked = {0};
    struct rnnd_env **envs;
    uint8_t *repeat, *is_init, *done = NULL, *trunc = NULL;
    for (int pass = 0; pass < 2; pass++) {
        job = take(&a, sizeof(*job));
        ex = take(&a, sizeof(*ex)); // right after the job (step_extra_of)
        if (wide) {
            obs32 = take(&a, B * I * sizeof(float));
            extras32 = extras ? take(&a, B * E * sizeof(float)) : NULL;
        }
        out = take(&a, B * H * rnnd_ftype_bytes(dts.out));
        if (req->return_state) {
            h = take(&a, B * LH * sizeof(float));
            c = lstm ? take(&a, B * LH * sizeof(float)) : NULL;
        }
        if (W) {
            pol = take(&a, B * W * sizeof(float));
            unpacked.index = m->policy.K ? take(&a, B * sizeof(int64_t)) : NULL;
            unpacked.action = m->policy.A ? take(&a, B * (size_t)pr.naction * sizeof(float)) : NULL;
            unpacked.logp = pr.logp >= 0 ? take(&a, B * sizeof(float)) : NULL;
            unpacked.value = pr.value >= 0 ? take(&a, B * sizeof(float)) : NULL;
            unpacked.dist =
                req->return_logits ? take(&a, B * (size_t)pr.ndist * sizeof(float)) : NULL;
        }
        envs = take(&a, B * sizeof(*envs));
        repeat = take(&a, B);
        is_init = take(&a, B);
        done = req->n_done ? take(&a, B) : NULL;
        trunc = req->n_truncated ? take(&a, B) : NULL;
        // Not zeroed: every array is written before it is read (by this function, the engine
        // or step_done), and a big Step's output arrays would cost a pass over memory.
        if (pass == 0 && (a.base = malloc(a.used)) == NULL) {
            rc = RNND_ENOMEM;
            snprintf(err, sizeof(err), "out of memory for a Step of %zu rows", B);
            goto bad;
        }
        if (pass == 0)
            a.used = 0;
    }
    for (size_t r = 0; r < B; r++) {
        is_init[r] = req->n_is_init ? (req->is_init[r] != 0) : 0;
        if (done)
            done[r] = req->done[r] != 0;
        if (trunc)
            trunc[r] = req->truncated[r] != 0;
    }
    memset(job, 0, sizeof(*job));
    *ex = unpacked;
    ex->bytes = a.used;
    ex->out = dts.out;
    ex->return_logits = req->return_logits;
    ex->return_core = req->return_core;
    const float *obs = (const float *)req->obs->data.data;
    const float *xtr = extras ? (const float *)req->extras->data.data : NULL;
    if (wide) {
        rnnd_cast_host(obs32, RNND_FTYPE_F32, req->obs->data.data, dts.in, B * I);
        obs = obs32;
        if (extras) {
            rnnd_cast_host(extras32, RNND_FTYPE_F32, req->extras->data.data, dts.in, B * E);
            xtr = extras32;
        }
    }
    job->kind = RNND_JOB_STEP;
    job->owner = call;
    job->aux = s;
    job->done = step_done;
    job->cancelled = rnnd_call_cancelled(call);
    job->item.source = rnnd_call_source(call);
    job->step = (struct rnnd_step_job){
        .B = (int)B,
        .env_ids = req->env_ids,
        .obs = obs,
        .is_init = is_init,
        .step_index = req->n_step_index ? req->step_index : NULL,
        .extras = xtr,
        .return_state = req->return_state,
        .greedy = req->greedy,
        .reward = req->n_reward ? req->reward : NULL,
        .done = done,
        .truncated = trunc,
        .out = out,
        .out_dtype = dts.out,
        .pol = pol,
        .h = h,
        .c = c,
        .envs = envs,
        .repeat = repeat,
    };
    rc = rnnd_group_submit_step(s->group, job);
    if (rc == 0)
        return;
    free(job);
    if (rc == RNND_EFULL) {
        rnnd_metrics_limit_hit(RNND_LIMIT_QUEUE_ROWS);
        snprintf(err, sizeof(err),
                 "the Step queue is full (%d rows waiting, --max-queue-rows %d); retry after a "
                 "short backoff or add replicas",
                 rnnd_group_queue_rows(s->group), rnnd_config_queue_rows(s->cfg));
    } else if (rc == RNND_EUNAVAIL)
        snprintf(err, sizeof(err), "rnnd is shutting down; retry on another replica");
    else
        snprintf(err, sizeof(err), "cannot queue the Step: %s", rnnd_strerror(rc));
bad:
    rnnd_call_fail(call, rc, err);
}

// ---------------------------------------------------------------------------------------------
// EndEpisodes

static void end_done(struct rnnd_job *job) {
    if (job->err) {
        rnnd_call_fail(job->owner, job->err, job->msg);
    } else {
        Rnnd__V1__EndEpisodesReply r = RNND__V1__END_EPISODES_REPLY__INIT;
        r.released = job->end.released;
        rnnd_call_reply(job->owner, &r.base);
    }
    free(job);
}

void rnnd_service_end_episodes(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__EndEpisodesRequest *req = (const Rnnd__V1__EndEpisodesRequest *)msg;
    char err[ERRLEN];
    int rc = rnnd_request_end_episodes(&s->limits, req, err);
    if (rc) {
        rnnd_call_fail(call, rc, err);
        return;
    }
    if (req->n_env_ids == 0) {
        Rnnd__V1__EndEpisodesReply r = RNND__V1__END_EPISODES_REPLY__INIT;
        rnnd_call_reply(call, &r.base);
        return;
    }
    struct rnnd_job *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    job->kind = RNND_JOB_END_EPISODES;
    job->owner = call;
    job->done = end_done;
    job->end.B = (int)req->n_env_ids;
    job->end.env_ids = req->env_ids;
    rnnd_group_submit(s->group, job);
}

// ---------------------------------------------------------------------------------------------
// Forward

static void forward_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    struct rnnd_forward_job *f = &job->fwd;
    struct rnnd_service *s = svc_of(job->aux);
    const struct rnnd_model *m = rnnd_group_model(s->group);
    int E = s->cfg->extras_size;
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
        free(job);
        return;
    }
    int64_t B = f->B, T = f->T, H = m->H, L = m->L, I = m->I;
    int dt = rnnd_request_dtype_of(f->out_dtype);
    Rnnd__V1__ForwardReply r = RNND__V1__FORWARD_REPLY__INIT;
    struct tout out, hn, cn, obs, ini, ex, ver, act, lp, val, rew, dn, tr, lg, mu, ls, hv;
    if (f->out)
        r.output = tset(&out, dt, f->out, 3, B, T, H, 0);
    const struct rnnd_policy *p = &m->policy;
    if (f->logits)
        r.logits = tset(&lg, dt, f->logits, 3, B, T, p->K, 0);
    if (f->mean) {
        r.mean = tset(&mu, dt, f->mean, 3, B, T, p->A, 0);
        r.log_std = tset(&ls, dt, f->log_std, 1, p->A, 0, 0, 0);
    }
    if (f->value)
        r.head_value = tset(&hv, dt, f->value, 2, B, T, 0, 0);
    r.h_n = tset(&hn, dt, f->h_n, 3, B, L, H, 0);
    if (m->cell == RNND_CELL_LSTM)
        r.c_n = tset(&cn, dt, f->c_n, 3, B, L, H, 0);
    r.tape_id = f->tape_id;
    r.model_version = job->model_version;
    if (f->rec_fields & RNND_REC_OBS)
        r.obs = tset(&obs, dt, f->rec_obs, 3, B, T, I, 0);
    if (f->rec_fields & RNND_REC_IS_INIT)
        r.is_init = tset(&ini, RNND__V1__DTYPE__BOOL, f->rec_is_init, 2, B, T, 0, 0);
    if ((f->rec_fields & RNND_REC_EXTRAS) && E > 0)
        r.extras = tset(&ex, dt, f->rec_extras, 3, B, T, E, 0);
    if (f->rec_fields & RNND_REC_VERSION)
        r.step_model_version = tset(&ver, RNND__V1__DTYPE__INT64, f->rec_version, 2, B, T, 0, 0);
    // A policy's record, kept in fp32 by the engine: narrowed here.
    size_t BT = (size_t)(B * T);
    int64_t A = m->policy.A;
    if (f->rec_action && A)
        r.action = tset(&act, narrow(f->rec_action, BT * (size_t)A, f->out_dtype), f->rec_action, 3,
                        B, T, A, 0);
    else if (f->rec_action)
        r.action = tset(&act, RNND__V1__DTYPE__INT64, f->rec_action, 2, B, T, 0, 0);
    if (f->rec_logp)
        r.log_prob = tset(&lp, narrow(f->rec_logp, BT, f->out_dtype), f->rec_logp, 2, B, T, 0, 0);
    if (f->rec_value)
        r.value = tset(&val, narrow(f->rec_value, BT, f->out_dtype), f->rec_value, 2, B, T, 0, 0);
    if (f->rec_reward) {
        r.reward =
            tset(&rew, narrow(f->rec_reward, BT, f->out_dtype), f->rec_reward, 2, B, T, 0, 0);
        r.done = tset(&dn, RNND__V1__DTYPE__BOOL, f->rec_done, 2, B, T, 0, 0);
        r.truncated = tset(&tr, RNND__V1__DTYPE__BOOL, f->rec_truncated, 2, B, T, 0, 0);
    }
    if (f->cursor) {
        r.cursor_id = svc_of(job->aux)->limits.cursor_id;
        r.n_cursor_first = r.n_cursor_lagged = r.n_cursor_overwritten = (size_t)B;
        r.cursor_first = f->cur_first;
        r.cursor_lagged = f->cur_lagged;
        r.cursor_overwritten = f->cur_over;
    }
    rnnd_call_reply(call, &r.base);
    free(job);
}

// The limits a Forward or Backward is checked against. What fits into the request's
// reply_region does not travel in the reply message, so --max-message-mb bounds only the rest.
static const struct rnnd_request_limits *limits_for(const struct rnnd_service *s,
                                                    const Rnnd__V1__RegionSpan *reply_region,
                                                    struct rnnd_request_limits *tmp) {
    if (reply_region == NULL || reply_region->nbytes == 0)
        return &s->limits;
    *tmp = s->limits;
    tmp->max_message_bytes += (size_t)reply_region->nbytes;
    return tmp;
}

// A job (with `extra` bytes after it) that knows the service.
static struct rnnd_job *job_with_model(struct rnnd_service *s, size_t extra) {
    struct rnnd_job *job = calloc(1, sizeof(*job) + extra);
    if (job)
        job->aux = s;
    return job;
}

void rnnd_service_forward(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__ForwardRequest *req = (const Rnnd__V1__ForwardRequest *)msg;
    char err[ERRLEN];
    struct rnnd_forward_job f;
    struct rnnd_request_limits tmp;
    const struct rnnd_request_limits *lim = limits_for(s, req->reply_region, &tmp);
    int rc = counted(rnnd_request_forward(lim, req, &f, err));
    if (rc == 0)
        rc = rnnd_call_reserve(call, rnnd_request_forward_reply_bytes(lim, &f), err, sizeof(err));
    if (rc != 0)
        goto bad;
    // is_init left out: no resets inside the window (zeros after the job, freed with it).
    bool zeros = !f.recorded && f.is_init == NULL;
    // Cursor windows: where each row's window starts and what was skipped, after the job too.
    size_t B = (size_t)f.B, extra = zeros ? B * (size_t)f.T : f.cursor ? 3 * B * 8 : 0;
    struct rnnd_job *job = job_with_model(s, extra);
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    if (zeros)
        f.is_init = (const uint8_t *)(job + 1);
    if (f.cursor) {
        f.cur_first = (uint64_t *)(job + 1);
        f.cur_lagged = f.cur_first + B;
        f.cur_over = f.cur_lagged + B;
    }
    job->kind = RNND_JOB_FORWARD;
    job->owner = call;
    job->done = forward_done;
    job->fwd = f;
    job->dev_out = rnnd_call_device_reply(call, &job->dev_out_bytes);
    job->dev_async = rnnd_call_device_async(call);
    job->host_out = rnnd_call_host_reply(call, &job->host_out_bytes, &job->host_out_pinned);
    rnnd_group_submit(s->group, job);
    return;
bad:
    rnnd_call_fail(call, rc, err);
}

// ---------------------------------------------------------------------------------------------
// Backward

static void backward_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    struct rnnd_backward_job *g = &job->bwd;
    const struct rnnd_model *m = rnnd_group_model(svc_of(job->aux)->group);
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
    } else {
        int64_t B = g->B, T = g->T, H = m->H, L = m->L, I = m->I;
        int dt = rnnd_request_dtype_of(g->out_dtype);
        size_t fb = rnnd_ftype_bytes(g->out_dtype);
        Rnnd__V1__BackwardReply r = RNND__V1__BACKWARD_REPLY__INIT;
        int K = rnnd_model_param_tensors(m);
        struct rnnd_param_tensor pt[RNND_MAX_PARAM_TENSORS];
        struct tout gt[RNND_MAX_PARAM_TENSORS], gx, gh0, gc0, ghid, gcell;
        Rnnd__V1__NamedTensor nt[RNND_MAX_PARAM_TENSORS], *ntp[RNND_MAX_PARAM_TENSORS];
        if (g->grads) {
            for (int k = 0; k < K; k++) {
                rnnd_model_param_tensor(m, k, &pt[k]);
                rnnd__v1__named_tensor__init(&nt[k]);
                nt[k].name = pt[k].name;
                nt[k].tensor = tset(&gt[k], dt, (char *)g->grads + pt[k].offset * fb, pt[k].ndim,
                                    pt[k].shape[0], pt[k].shape[1], 0, 0);
                ntp[k] = &nt[k];
            }
            r.n_grads = (size_t)K;
            r.grads = ntp;
        }
        if (g->grad_x)
            r.grad_obs = tset(&gx, dt, g->grad_x, 3, B, T, I, 0);
        if (g->grad_h0)
            r.grad_h0 = tset(&gh0, dt, g->grad_h0, 3, B, L, H, 0);
        if (g->grad_c0)
            r.grad_c0 = tset(&gc0, dt, g->grad_c0, 3, B, L, H, 0);
        if (g->grad_hidden)
            r.grad_hidden = tset(&ghid, dt, g->grad_hidden, 4, B, T, L, H);
        if (g->grad_cell)
            r.grad_cell = tset(&gcell, dt, g->grad_cell, 4, B, T, L, H);
        r.model_version = job->model_version;
        rnnd_call_reply(call, &r.base);
    }
    free(job);
}

void rnnd_service_backward(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__BackwardRequest *req = (const Rnnd__V1__BackwardRequest *)msg;
    char err[ERRLEN];
    struct rnnd_backward_job g;
    struct rnnd_request_limits tmp;
    const struct rnnd_request_limits *lim = limits_for(s, req->reply_region, &tmp);
    // Tensors in a region the engine reads from directly have their values checked there, once
    // in place, not here on the host.
    bool dev_in = rnnd_call_device_in(call), host_in = rnnd_call_host_in(call);
    int rc = counted(rnnd_request_backward(lim, req, &g, dev_in || host_in, err));
    if (rc == 0 && g.apply && (rnnd_group_devices(s->group) > 1 || s->cfg->world_size > 1)) {
        rc = RNND_EPRECOND;
        snprintf(err, sizeof(err),
                 "apply in Backward needs a daemon on one device alone (this one has %d "
                 "device(s) and --world-size %d): send ApplyGradients after Backward",
                 rnnd_group_devices(s->group), s->cfg->world_size);
    }
    if (rc == 0)
        rc = rnnd_call_reserve(call, rnnd_request_backward_reply_bytes(lim, &g), err, sizeof(err));
    if (rc != 0)
        goto bad;
    struct rnnd_job *job = job_with_model(s, 0);
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    job->kind = RNND_JOB_BACKWARD;
    job->owner = call;
    job->done = backward_done;
    job->bwd = g;
    job->dev_in = dev_in;
    job->dev_out = rnnd_call_device_reply(call, &job->dev_out_bytes);
    job->dev_async = rnnd_call_device_async(call);
    job->host_in = host_in;
    job->values_later = dev_in || host_in;
    job->host_out = rnnd_call_host_reply(call, &job->host_out_bytes, &job->host_out_pinned);
    rnnd_group_submit(s->group, job);
    return;
bad:
    rnnd_call_fail(call, rc, err);
}

// ---------------------------------------------------------------------------------------------
// ApplyGradients

static void apply_done(struct rnnd_job *job) {
    if (job->err) {
        rnnd_call_fail(job->owner, job->err, job->msg);
    } else {
        Rnnd__V1__ApplyGradientsReply r = RNND__V1__APPLY_GRADIENTS_REPLY__INIT;
        r.model_version = job->model_version;
        rnnd_call_reply(job->owner, &r.base);
    }
    free(job);
}

void rnnd_service_apply_gradients(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__ApplyGradientsRequest *req = (const Rnnd__V1__ApplyGradientsRequest *)msg;
    char err[ERRLEN];
    size_t extra = req->n_grads ? s->limits.P * sizeof(float) : 0;
    struct rnnd_job *job = calloc(1, sizeof(*job) + extra);
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    float *flat = (float *)(job + 1);
    bool has_lr;
    int rc = rnnd_request_apply_gradients(&s->limits, req, flat, &has_lr, err);
    if (rc != 0) {
        free(job);
        rnnd_call_fail(call, rc, err);
        return;
    }
    job->apply.grads = req->n_grads ? flat : NULL;
    job->apply.sent = req->n_grads != 0;
    job->apply.root = -1;
    job->kind = RNND_JOB_APPLY;
    job->owner = call;
    job->done = apply_done;
    job->apply.has_lr = has_lr;
    job->apply.lr = req->lr;
    rnnd_group_submit(s->group, job);
}

// ---------------------------------------------------------------------------------------------
// GetWeights, SetWeights

static void get_weights_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    const struct rnnd_model *m = rnnd_group_model(svc_of(job->aux)->group);
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
    } else {
        Rnnd__V1__Weights r = RNND__V1__WEIGHTS__INIT;
        int K = rnnd_model_param_tensors(m);
        struct rnnd_param_tensor pt[RNND_MAX_PARAM_TENSORS];
        struct tout t[RNND_MAX_PARAM_TENSORS];
        Rnnd__V1__NamedTensor nt[RNND_MAX_PARAM_TENSORS], *ntp[RNND_MAX_PARAM_TENSORS];
        for (int k = 0; k < K; k++) {
            rnnd_model_param_tensor(m, k, &pt[k]);
            rnnd__v1__named_tensor__init(&nt[k]);
            nt[k].name = pt[k].name;
            nt[k].tensor = tset(&t[k], RNND__V1__DTYPE__FLOAT32, job->weights.params + pt[k].offset,
                                pt[k].ndim, pt[k].shape[0], pt[k].shape[1], 0, 0);
            ntp[k] = &nt[k];
        }
        r.n_tensors = (size_t)K;
        r.tensors = ntp;
        r.model_version = job->model_version;
        rnnd_call_reply(call, &r.base);
    }
    free(job);
}

void rnnd_service_get_weights(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    (void)msg;
    struct rnnd_service *s = svc_of(p);
    char err[ERRLEN];
    size_t P = s->limits.P;
    int rc = counted(rnnd_request_get_weights(&s->limits, err));
    if (rc == 0)
        rc = rnnd_call_reserve(call, rnnd_request_get_weights_reply_bytes(&s->limits), err,
                               sizeof(err));
    if (rc != 0) {
        rnnd_call_fail(call, rc, err);
        return;
    }
    struct rnnd_job *job = calloc(1, sizeof(struct rnnd_job) + P * sizeof(float));
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    job->aux = s;
    job->weights.params = (float *)(job + 1);
    job->kind = RNND_JOB_GET_WEIGHTS;
    job->owner = call;
    job->done = get_weights_done;
    rnnd_group_submit(s->group, job);
}

static void set_weights_done(struct rnnd_job *job) {
    if (job->err) {
        rnnd_call_fail(job->owner, job->err, job->msg);
    } else {
        Rnnd__V1__SetWeightsReply r = RNND__V1__SET_WEIGHTS_REPLY__INIT;
        r.model_version = job->model_version;
        rnnd_call_reply(job->owner, &r.base);
    }
    free(job);
}

void rnnd_service_set_weights(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__SetWeightsRequest *req = (const Rnnd__V1__SetWeightsRequest *)msg;
    char err[ERRLEN];
    struct rnnd_job *job = calloc(1, sizeof(*job) + s->limits.P * sizeof(float));
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    float *flat = (float *)(job + 1);
    int rc = rnnd_request_set_weights(&s->limits, req, flat, err);
    if (rc) {
        free(job);
        rnnd_call_fail(call, rc, err);
        return;
    }
    job->weights.params = flat;
    job->weights.root = -1;
    job->kind = RNND_JOB_SET_WEIGHTS;
    job->owner = call;
    job->done = set_weights_done;
    rnnd_group_submit(s->group, job);
}

// ---------------------------------------------------------------------------------------------
// SaveCheckpoint

static void checkpoint_done(struct rnnd_job *job) {
    if (job->err) {
        rnnd_call_fail(job->owner, job->err, job->msg);
    } else {
        Rnnd__V1__SaveCheckpointReply r = RNND__V1__SAVE_CHECKPOINT_REPLY__INIT;
        r.path = job->ckpt.path;
        r.model_version = job->model_version;
        rnnd_call_reply(job->owner, &r.base);
    }
    free(job);
}

void rnnd_service_save_checkpoint(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__SaveCheckpointRequest *req = (const Rnnd__V1__SaveCheckpointRequest *)msg;
    char err[ERRLEN];
    int rc = rnnd_request_save_checkpoint(&s->limits, req, err);
    if (rc != 0) {
        rnnd_call_fail(call, rc, err);
        return;
    }
    struct rnnd_job *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    snprintf(job->ckpt.path, sizeof(job->ckpt.path), "%s", req->path ? req->path : "");
    job->kind = RNND_JOB_CHECKPOINT;
    job->owner = call;
    job->done = checkpoint_done;
    rnnd_group_submit(s->group, job);
}

// ---------------------------------------------------------------------------------------------
// RegisterRegion, ReleaseRegion

void rnnd_service_register_region(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    char err[ERRLEN];
    Rnnd__V1__RegisterRegionReply r = RNND__V1__REGISTER_REGION_REPLY__INIT;
    struct rnnd_shm_registered out;
    int rc = rnnd_shm_register(s->shm, (const Rnnd__V1__RegisterRegionRequest *)msg,
                               rnnd_call_peer_local(call), rnnd_group_sole_backend(s->group),
                               rnnd_group_host_backend(s->group), &out, err, sizeof(err));
    if (rc) {
        rnnd_call_fail(call, rc, err);
        return;
    }
    r.region = out.id;
    r.size = out.size;
    if (out.async)
        r.cuda_event = (ProtobufCBinaryData){sizeof(out.event), out.event};
    const Rnnd__V1__RegisterRegionRequest *req = (const Rnnd__V1__RegisterRegionRequest *)msg;
    if (req->kind_case == RNND__V1__REGISTER_REGION_REQUEST__KIND_SOCKET)
        r.data_port = (uint32_t)rnnd_shm_data_port(s->shm);
    rnnd_call_reply(call, &r.base);
}

void rnnd_service_release_region(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__ReleaseRegionRequest *req = (const Rnnd__V1__ReleaseRegionRequest *)msg;
    char err[ERRLEN];
    int rc = rnnd_shm_release(s->shm, req->region, rnnd_call_peer_local(call), err, sizeof(err));
    if (rc) {
        rnnd_call_fail(call, rc, err);
        return;
    }
    Rnnd__V1__ReleaseRegionReply r = RNND__V1__RELEASE_REGION_REPLY__INIT;
    rnnd_call_reply(call, &r.base);
}
