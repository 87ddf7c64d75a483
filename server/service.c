/*
 * service.c: the rnnd.v1.Rnn handlers (see service.h). Each handler checks its request, builds
 * one job in one allocation, and submits it; the job's done callback (engine thread) builds the
 * reply from the job's outputs, finishes the call and frees the job.
 *
 * Error messages say what was wrong and what to send instead (DESIGN.md §3), naming the field,
 * the expected layout with its numbers, and the flag behind a limit.
 */
#include "service.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "rnnd/v1/rnnd.pb-c.h"

#define ERRLEN 512

typedef Rnnd__V1__Tensor Tensor;

static int errf(char *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int errf(char *err, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, ERRLEN, fmt, ap);
    va_end(ap);
    return code;
}

// ---------------------------------------------------------------------------------------------
// Tensor checks

static const char *dtype_name(int dt) {
    static const char *const names[] = {"DTYPE_UNSPECIFIED", "FLOAT32", "BFLOAT16",
                                        "FLOAT16",           "BOOL",    "INT64"};
    return dt >= 0 && dt <= 5 ? names[dt] : "an unknown dtype";
}

static size_t dtype_size(int dt) {
    switch (dt) {
        case RNND__V1__DTYPE__FLOAT32:
            return 4;
        case RNND__V1__DTYPE__BFLOAT16:
        case RNND__V1__DTYPE__FLOAT16:
            return 2;
        case RNND__V1__DTYPE__BOOL:
            return 1;
        case RNND__V1__DTYPE__INT64:
            return 8;
    }
    return 0;
}

// An unset message field, or one set to an empty Tensor{}, counts as absent.
static bool present(const Tensor *t) {
    return t && (t->n_shape || t->data.len || t->dtype);
}

static void fmt_dims(char *buf, size_t cap, const int64_t *d, size_t n) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (size_t i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)d[i]);
    if (k < cap)
        snprintf(buf + k, cap - k, "]");
}

// Checks t: dtype, ndim dims where want[i] >= 0 must match exactly and want[i] < 0 accepts any
// size >= 1 (returned in got[i]), and a byte count that matches. layout names the dims
// ("[B, I]"). Element counts are capped so sizes never overflow.
static int tensor_check(const Tensor *t, const char *name, int dtype, int ndim, const int64_t *want,
                        const char *layout, int64_t *got, char *err) {
    char wbuf[96], gbuf[96];
    int64_t w[8];
    for (int i = 0; i < ndim; i++)
        w[i] = want[i];
    if (!present(t)) {
        return errf(err, RNND_EINVAL, "%s: missing; send a %s tensor %s", name, dtype_name(dtype),
                    layout);
    }
    if ((int)t->dtype != dtype)
        return errf(err, RNND_EINVAL, "%s: dtype %s is not accepted; send %s %s", name,
                    dtype_name(t->dtype), dtype_name(dtype), layout);
    fmt_dims(gbuf, sizeof(gbuf), t->shape, t->n_shape);
    // Expected dims, with '*' where any size goes: formatted by hand.
    {
        size_t k = (size_t)snprintf(wbuf, sizeof(wbuf), "[");
        for (int i = 0; i < ndim && k < sizeof(wbuf); i++) {
            if (w[i] >= 0)
                k += (size_t)snprintf(wbuf + k, sizeof(wbuf) - k, "%s%lld", i ? ", " : "",
                                      (long long)w[i]);
            else
                k += (size_t)snprintf(wbuf + k, sizeof(wbuf) - k, "%s*", i ? ", " : "");
        }
        if (k < sizeof(wbuf))
            snprintf(wbuf + k, sizeof(wbuf) - k, "]");
    }
    if (t->n_shape != (size_t)ndim)
        return errf(err, RNND_EINVAL, "%s: shape %s has %zu dims; send %s = %s", name, gbuf,
                    t->n_shape, layout, wbuf);
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        int64_t d = t->shape[i];
        if (d < 1 || (w[i] >= 0 && d != w[i]))
            return errf(err, RNND_EINVAL, "%s: shape %s does not match %s = %s", name, gbuf, layout,
                        wbuf);
        if (got)
            got[i] = d;
        if (d > (int64_t)(1ull << 40) || count > (1ull << 40) / (uint64_t)d)
            return errf(err, RNND_EINVAL, "%s: shape %s is too large", name, gbuf);
        count *= (uint64_t)d;
    }
    uint64_t bytes = count * dtype_size(dtype);
    if ((uint64_t)t->data.len != bytes)
        return errf(err, RNND_EINVAL,
                    "%s: data has %zu bytes but shape %s of %s needs %" PRIu64
                    " (row-major, little-endian); send exactly that many",
                    name, t->data.len, gbuf, dtype_name(dtype), bytes);
    return 0;
}

// Refuses NaN and Inf in n floats at data (any alignment), naming the first one's index.
static int finite_check(const Tensor *t, const char *name, char *err) {
    size_t n = t->data.len / 4;
    const uint8_t *p = t->data.data;
    for (size_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, p + 4 * i, 4);
        if ((bits & 0x7f800000u) != 0x7f800000u)
            continue;
        // Unflatten i into an index over t's shape.
        char idx[96];
        size_t k = 0, rem = i;
        int64_t sub[8] = {0};
        for (size_t d = t->n_shape; d-- > 0 && d < 8;) {
            sub[d] = (int64_t)(rem % (size_t)t->shape[d]);
            rem /= (size_t)t->shape[d];
        }
        for (size_t d = 0; d < t->n_shape && d < 8 && k < sizeof(idx); d++)
            k += (size_t)snprintf(idx + k, sizeof(idx) - k, "%s%lld", d ? ", " : "",
                                  (long long)sub[d]);
        return errf(err, RNND_EINVAL, "%s[%s] is %s; send finite values", name, idx,
                    (bits & 0x007fffffu) ? "NaN"
                    : (bits >> 31)       ? "-Inf"
                                         : "Inf");
    }
    return 0;
}

static int bool_check(const Tensor *t, const char *name, char *err) {
    const uint8_t *p = t->data.data;
    for (size_t i = 0; i < t->data.len; i++)
        if (p[i] > 1)
            return errf(err, RNND_EINVAL, "%s: element %zu is %u; BOOL elements are 0 or 1", name,
                        i, p[i]);
    return 0;
}

static int f32_check(const Tensor *t, const char *name, int ndim, const int64_t *want,
                     const char *layout, int64_t *got, char *err) {
    int rc = tensor_check(t, name, RNND__V1__DTYPE__FLOAT32, ndim, want, layout, got, err);
    return rc ? rc : finite_check(t, name, err);
}

// Finds a repeated id: 0 when all are unique, else RNND_EINVAL with both rows in err.
static int unique_check(const uint64_t *ids, size_t n, const char *field, char *err) {
    if (n < 2)
        return 0;
    size_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    int32_t *slots = malloc(cap * sizeof(int32_t));
    if (slots == NULL)
        return errf(err, RNND_ENOMEM, "out of memory checking %s", field);
    memset(slots, 0xff, cap * sizeof(int32_t));
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        uint64_t x = ids[i] * 0x9e3779b97f4a7c15ull;
        for (size_t s = (size_t)(x >> 32) & (cap - 1);; s = (s + 1) & (cap - 1)) {
            if (slots[s] < 0) {
                slots[s] = (int32_t)i;
                break;
            }
            if (ids[slots[s]] == ids[i]) {
                rc = errf(err, RNND_EINVAL,
                          "%s: env id %" PRIu64 " appears twice (rows %d and %zu); send each "
                          "env at most once per request",
                          field, ids[i], slots[s], i);
                break;
            }
        }
    }
    free(slots);
    return rc;
}

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
    o->t.data.len = (size_t)(count * dtype_size(dtype));
    o->t.data.data = (uint8_t *)data;
    return &o->t;
}

static struct rnnd_service *svc_of(void *p) {
    return p;
}

static bool reply_fits(struct rnnd_service *s, uint64_t bytes, const char *what, char *err) {
    // Leave room for framing and the other fields.
    if (bytes + 4096 <= (uint64_t)s->max_message_bytes)
        return true;
    errf(err, RNND_EFULL, "the reply would be %.1f MiB, over --max-message-mb %zu; %s",
         (double)bytes / 1048576.0, s->max_message_bytes >> 20, what);
    return false;
}

// ---------------------------------------------------------------------------------------------
// GetModelInfo: answered on the gRPC thread from the engine's atomics.

void rnnd_service_get_model_info(void *p, struct rnnd_call *call, const ProtobufCMessage *req) {
    (void)req;
    struct rnnd_service *s = svc_of(p);
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    Rnnd__V1__ModelInfo info = RNND__V1__MODEL_INFO__INIT;
    info.cell = (char *)rnnd_config_cell_name(m->cell);
    info.input_size = m->I;
    info.hidden_size = m->H;
    info.num_layers = m->L;
    info.compute = (char *)rnnd_config_compute_name(m->compute);
    info.backend = (char *)rnnd_engine_backend_name(s->engine);
    info.device = (char *)rnnd_engine_device_name(s->engine);
    info.model_version = rnnd_engine_model_version(s->engine);
    info.envs_active = rnnd_engine_envs_active(s->engine);
    info.max_batch = (uint64_t)s->cfg->max_batch;
    info.extras_size = s->cfg->extras_size;
    rnnd_call_reply(call, &info.base);
}

// ---------------------------------------------------------------------------------------------
// Step

static void step_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    struct rnnd_step_job *st = &job->step;
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
    } else {
        const struct rnnd_model *m = rnnd_engine_model(svc_of(job->aux)->engine);
        int64_t dims[3] = {m->H, m->L, m->cell == RNND_CELL_LSTM};
        Rnnd__V1__StepReply r = RNND__V1__STEP_REPLY__INIT;
        struct tout out, h, c;
        r.output = tset(&out, RNND__V1__DTYPE__FLOAT32, st->out, 2, st->B, dims[0], 0, 0);
        r.model_version = job->model_version;
        if (st->return_state) {
            r.h = tset(&h, RNND__V1__DTYPE__FLOAT32, st->h, 3, st->B, dims[1], dims[0], 0);
            if (dims[2])
                r.c = tset(&c, RNND__V1__DTYPE__FLOAT32, st->c, 3, st->B, dims[1], dims[0], 0);
        }
        rnnd_call_reply(call, &r.base);
    }
    free(job);
}

void rnnd_service_step(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__StepRequest *req = (const Rnnd__V1__StepRequest *)msg;
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    char err[ERRLEN];
    int rc = 0;
    size_t B = req->n_env_ids;
    int64_t E = s->cfg->extras_size;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (B == 0) {
        rc = errf(err, RNND_EINVAL, "env_ids is empty; send one env id per obs row");
        goto bad;
    }
    if (B > (size_t)s->cfg->max_batch) {
        rc = errf(err, RNND_EINVAL,
                  "%zu env_ids exceed --max-batch %d; split the request into smaller ones", B,
                  s->cfg->max_batch);
        goto bad;
    }
    if ((rc = unique_check(req->env_ids, B, "env_ids", err)) != 0)
        goto bad;
    int64_t want_obs[2] = {(int64_t)B, m->I};
    char layout[128];
    snprintf(layout, sizeof(layout), "[B, I] (B = %zu env_ids, I = --input-size %d)", B, m->I);
    if ((rc = f32_check(req->obs, "obs", 2, want_obs, layout, NULL, err)) != 0)
        goto bad;
    if (req->n_is_init != 0 && req->n_is_init != B) {
        rc = errf(err, RNND_EINVAL,
                  "is_init has %zu values for %zu env_ids; send one per env "
                  "or none (all false)",
                  req->n_is_init, B);
        goto bad;
    }
    if (req->n_step_index != 0 && req->n_step_index != B) {
        rc = errf(err, RNND_EINVAL,
                  "step_index has %zu values for %zu env_ids; send one per env or none",
                  req->n_step_index, B);
        goto bad;
    }
    bool extras = present(req->extras);
    if (extras && E == 0) {
        // An explicitly empty [B, 0] tensor is the same as none.
        bool empty =
            req->extras->data.len == 0 && req->extras->n_shape == 2 && req->extras->shape[1] == 0;
        if (!empty) {
            rc = errf(err, RNND_EINVAL,
                      "extras sent but this daemon records none (--extras-size 0); drop extras "
                      "or start rnnd with --extras-size E");
            goto bad;
        }
        extras = false;
    }
    if (extras) {
        int64_t want[2] = {(int64_t)B, E};
        snprintf(layout, sizeof(layout), "[B, E] (B = %zu env_ids, E = --extras-size %lld)", B,
                 (long long)E);
        if ((rc = f32_check(req->extras, "extras", 2, want, layout, NULL, err)) != 0)
            goto bad;
    }

    size_t H = (size_t)m->H, LH = (size_t)m->L * H;
    struct alloc a = {0};
    struct rnnd_job *job;
    float *out, *h = NULL, *c = NULL;
    struct rnnd_env **envs;
    uint8_t *repeat, *is_init;
    for (int pass = 0; pass < 2; pass++) {
        job = take(&a, sizeof(*job));
        out = take(&a, B * H * sizeof(float));
        if (req->return_state) {
            h = take(&a, B * LH * sizeof(float));
            c = lstm ? take(&a, B * LH * sizeof(float)) : NULL;
        }
        envs = take(&a, B * sizeof(*envs));
        repeat = take(&a, B);
        is_init = take(&a, B);
        if (pass == 0 && (a.base = calloc(1, a.used)) == NULL) {
            rc = errf(err, RNND_ENOMEM, "out of memory for a Step of %zu rows", B);
            goto bad;
        }
        if (pass == 0)
            a.used = 0;
    }
    for (size_t r = 0; r < B; r++)
        is_init[r] = req->n_is_init ? (req->is_init[r] != 0) : 0;
    job->kind = RNND_JOB_STEP;
    job->owner = call;
    job->aux = s;
    job->done = step_done;
    job->cancelled = rnnd_call_cancelled(call);
    job->item.source = rnnd_call_source(call);
    job->step = (struct rnnd_step_job){
        .B = (int)B,
        .env_ids = req->env_ids,
        .obs = (const float *)req->obs->data.data,
        .is_init = is_init,
        .step_index = req->n_step_index ? req->step_index : NULL,
        .extras = extras ? (const float *)req->extras->data.data : NULL,
        .return_state = req->return_state,
        .out = out,
        .h = h,
        .c = c,
        .envs = envs,
        .repeat = repeat,
    };
    rc = rnnd_engine_submit_step(s->engine, job);
    if (rc == 0)
        return;
    free(job);
    if (rc == RNND_EFULL)
        errf(err, rc,
             "the Step queue is full (%d rows waiting, --max-queue-rows %d); retry after a "
             "short backoff or add replicas",
             rnnd_engine_queue_rows(s->engine), rnnd_config_queue_rows(s->cfg));
    else if (rc == RNND_EUNAVAIL)
        errf(err, rc, "rnnd is shutting down; retry on another replica");
    else
        errf(err, rc, "cannot queue the Step: %s", rnnd_strerror(rc));
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
    int rc = unique_check(req->env_ids, req->n_env_ids, "env_ids", err);
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
    rnnd_engine_submit(s->engine, job);
}

// ---------------------------------------------------------------------------------------------
// Forward

static void forward_free(struct rnnd_job *job) {
    struct rnnd_forward_job *f = &job->fwd;
    free(f->out);
    free(f->h_n);
    free(f->c_n);
    free(f->rec_obs);
    free(f->rec_is_init);
    free(f->rec_extras);
    free(f->rec_version);
    free(job);
}

static void forward_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    struct rnnd_forward_job *f = &job->fwd;
    struct rnnd_service *s = svc_of(job->aux);
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    int E = s->cfg->extras_size;
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
        forward_free(job);
        return;
    }
    int64_t B = f->B, T = f->T, H = m->H, L = m->L, I = m->I;
    Rnnd__V1__ForwardReply r = RNND__V1__FORWARD_REPLY__INIT;
    struct tout out, hn, cn, obs, ini, ex, ver;
    r.output = tset(&out, RNND__V1__DTYPE__FLOAT32, f->out, 3, B, T, H, 0);
    r.h_n = tset(&hn, RNND__V1__DTYPE__FLOAT32, f->h_n, 3, B, L, H, 0);
    if (m->cell == RNND_CELL_LSTM)
        r.c_n = tset(&cn, RNND__V1__DTYPE__FLOAT32, f->c_n, 3, B, L, H, 0);
    r.tape_id = f->tape_id;
    r.model_version = job->model_version;
    if (f->recorded) {
        r.obs = tset(&obs, RNND__V1__DTYPE__FLOAT32, f->rec_obs, 3, B, T, I, 0);
        r.is_init = tset(&ini, RNND__V1__DTYPE__BOOL, f->rec_is_init, 2, B, T, 0, 0);
        if (E > 0)
            r.extras = tset(&ex, RNND__V1__DTYPE__FLOAT32, f->rec_extras, 3, B, T, E, 0);
        r.step_model_version = tset(&ver, RNND__V1__DTYPE__INT64, f->rec_version, 2, B, T, 0, 0);
    }
    rnnd_call_reply(call, &r.base);
    forward_free(job);
}

static struct rnnd_job *job_with_model(struct rnnd_service *s) {
    struct rnnd_job *job = calloc(1, sizeof(*job));
    if (job)
        job->aux = s;
    return job;
}

void rnnd_service_forward(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__ForwardRequest *req = (const Rnnd__V1__ForwardRequest *)msg;
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    bool lstm = m->cell == RNND_CELL_LSTM;
    char err[ERRLEN], layout[128];
    int rc = 0;
    struct rnnd_forward_job f = {.keep_tape = req->keep_tape};
    uint64_t reply_bytes;
    int64_t L = m->L, H = m->H, I = m->I, E = s->cfg->extras_size;

    if (req->source_case == RNND__V1__FORWARD_REQUEST__SOURCE_TRAJECTORIES && req->trajectories) {
        const Rnnd__V1__Trajectories *t = req->trajectories;
        int64_t got[3], want3[3] = {-1, -1, I};
        snprintf(layout, sizeof(layout), "[B, T, I] (I = --input-size %d)", m->I);
        if ((rc = f32_check(t->obs, "trajectories.obs", 3, want3, layout, got, err)) != 0)
            goto bad;
        if (got[0] > INT32_MAX / 4 || got[1] > INT32_MAX / 4 || got[0] * got[1] > INT32_MAX / 4) {
            rc = errf(err, RNND_EINVAL, "trajectories.obs: B * T is too large");
            goto bad;
        }
        int64_t B = got[0], T = got[1];
        f.B = (int)B;
        f.T = (int)T;
        f.x = (const float *)t->obs->data.data;
        if (present(t->is_init)) {
            int64_t want[2] = {B, T};
            snprintf(layout, sizeof(layout), "[B, T] = [%lld, %lld] (from obs)", (long long)B,
                     (long long)T);
            if ((rc = tensor_check(t->is_init, "trajectories.is_init", RNND__V1__DTYPE__BOOL, 2,
                                   want, layout, NULL, err)) != 0 ||
                (rc = bool_check(t->is_init, "trajectories.is_init", err)) != 0)
                goto bad;
            f.is_init = t->is_init->data.data;
        }
        int64_t want_state[3] = {B, L, H}, want_stored[4] = {B, T, L, H};
        snprintf(layout, sizeof(layout), "[B, L, H] = [%lld, %lld, %lld]", (long long)B,
                 (long long)L, (long long)H);
        if (present(t->h0)) {
            if ((rc = f32_check(t->h0, "trajectories.h0", 3, want_state, layout, NULL, err)))
                goto bad;
            f.h0 = (const float *)t->h0->data.data;
        }
        if (present(t->c0)) {
            if (!lstm) {
                rc = errf(err, RNND_EINVAL,
                          "trajectories.c0 is for LSTM; this model is a GRU: "
                          "drop c0");
                goto bad;
            }
            if ((rc = f32_check(t->c0, "trajectories.c0", 3, want_state, layout, NULL, err)))
                goto bad;
            f.c0 = (const float *)t->c0->data.data;
        }
        snprintf(layout, sizeof(layout), "[B, T, L, H] = [%lld, %lld, %lld, %lld]", (long long)B,
                 (long long)T, (long long)L, (long long)H);
        if (present(t->hidden)) {
            if ((rc = f32_check(t->hidden, "trajectories.hidden", 4, want_stored, layout, NULL,
                                err)))
                goto bad;
            f.hidden = (const float *)t->hidden->data.data;
        }
        if (present(t->cell)) {
            if (!lstm) {
                rc = errf(err, RNND_EINVAL,
                          "trajectories.cell is for LSTM; this model is a GRU: drop cell");
                goto bad;
            }
            if ((rc = f32_check(t->cell, "trajectories.cell", 4, want_stored, layout, NULL, err)))
                goto bad;
            f.cell = (const float *)t->cell->data.data;
        }
        if (f.h0 && f.hidden) {
            rc = errf(err, RNND_EINVAL,
                      "trajectories: h0 and hidden exclude each other (hidden "
                      "[:, 0] is the initial state); send one of them");
            goto bad;
        }
        if (lstm && (!f.h0 != !f.c0)) {
            rc = errf(err, RNND_EINVAL,
                      "trajectories: an LSTM needs h0 and c0 together; send "
                      "both or neither");
            goto bad;
        }
        if (lstm && (!f.hidden != !f.cell)) {
            rc = errf(err, RNND_EINVAL,
                      "trajectories: an LSTM needs hidden and cell together; "
                      "send both or neither");
            goto bad;
        }
        reply_bytes = (uint64_t)(B * T * H + 2 * B * L * H) * 4;
    } else if (req->source_case == RNND__V1__FORWARD_REQUEST__SOURCE_RECORDED && req->recorded) {
        const Rnnd__V1__Recorded *rec = req->recorded;
        if (s->cfg->trajectory_steps == 0) {
            rc = errf(err, RNND_EPRECOND,
                      "this daemon records no steps (--trajectory-steps 0); "
                      "send explicit trajectories or restart it with "
                      "--trajectory-steps N");
            goto bad;
        }
        if (rec->n_env_ids == 0) {
            rc = errf(err, RNND_EINVAL, "recorded.env_ids is empty; send the envs to replay");
            goto bad;
        }
        if (rec->steps == 0 || rec->steps > (uint32_t)s->cfg->trajectory_steps) {
            rc = errf(err, RNND_EINVAL,
                      "recorded.steps is %u; send 1 to %d (--trajectory-steps keeps that many "
                      "per env)",
                      rec->steps, s->cfg->trajectory_steps);
            goto bad;
        }
        if (rec->n_env_ids > (size_t)(INT32_MAX / 4) / rec->steps) {
            rc = errf(err, RNND_EINVAL, "recorded: too many env_ids x steps");
            goto bad;
        }
        if ((rc = unique_check(rec->env_ids, rec->n_env_ids, "recorded.env_ids", err)) != 0)
            goto bad;
        f.recorded = true;
        f.B = (int)rec->n_env_ids;
        f.T = (int)rec->steps;
        f.env_ids = rec->env_ids;
        int64_t B = f.B, T = f.T;
        reply_bytes = (uint64_t)(B * T * (H + I + E + 3) + 2 * B * L * H) * 4;
    } else {
        rc = errf(err, RNND_EINVAL,
                  "ForwardRequest has no source; set trajectories (explicit "
                  "obs/is_init) or recorded (env_ids and steps)");
        goto bad;
    }
    if (!reply_fits(s, reply_bytes, "send fewer rows or steps per Forward", err)) {
        rc = RNND_EFULL;
        goto bad;
    }
    struct rnnd_job *job = job_with_model(s);
    uint8_t *zeros = NULL;
    if (job && !f.recorded && f.is_init == NULL) {
        // is_init left out: no resets inside the window.
        zeros = calloc((size_t)f.B * (size_t)f.T, 1);
        if (zeros == NULL) {
            free(job);
            job = NULL;
        }
    }
    if (job == NULL) {
        rc = errf(err, RNND_ENOMEM, "out of memory");
        goto bad;
    }
    if (zeros) {
        // Owned by the job through rec_is_init (freed with it), read through f.is_init.
        f.is_init = zeros;
        f.rec_is_init = zeros;
    }
    job->kind = RNND_JOB_FORWARD;
    job->owner = call;
    job->done = forward_done;
    job->fwd = f;
    rnnd_engine_submit(s->engine, job);
    return;
bad:
    rnnd_call_fail(call, rc, err);
}

// ---------------------------------------------------------------------------------------------
// Backward

static void backward_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    struct rnnd_backward_job *g = &job->bwd;
    const struct rnnd_model *m = rnnd_engine_model(svc_of(job->aux)->engine);
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
    } else {
        int64_t B = g->B, T = g->T, H = m->H, L = m->L, I = m->I;
        Rnnd__V1__BackwardReply r = RNND__V1__BACKWARD_REPLY__INIT;
        int K = rnnd_model_param_tensors(m);
        struct rnnd_param_tensor pt[4 * RNND_MAX_LAYERS];
        struct tout gt[4 * RNND_MAX_LAYERS], gx, gh0, gc0, ghid, gcell;
        Rnnd__V1__NamedTensor nt[4 * RNND_MAX_LAYERS], *ntp[4 * RNND_MAX_LAYERS];
        if (g->grads) {
            for (int k = 0; k < K; k++) {
                rnnd_model_param_tensor(m, k, &pt[k]);
                rnnd__v1__named_tensor__init(&nt[k]);
                nt[k].name = pt[k].name;
                nt[k].tensor = tset(&gt[k], RNND__V1__DTYPE__FLOAT32, g->grads + pt[k].offset,
                                    pt[k].ndim, pt[k].shape[0], pt[k].shape[1], 0, 0);
                ntp[k] = &nt[k];
            }
            r.n_grads = (size_t)K;
            r.grads = ntp;
        }
        r.grad_obs = tset(&gx, RNND__V1__DTYPE__FLOAT32, g->grad_x, 3, B, T, I, 0);
        if (g->grad_h0)
            r.grad_h0 = tset(&gh0, RNND__V1__DTYPE__FLOAT32, g->grad_h0, 3, B, L, H, 0);
        if (g->grad_c0)
            r.grad_c0 = tset(&gc0, RNND__V1__DTYPE__FLOAT32, g->grad_c0, 3, B, L, H, 0);
        if (g->grad_hidden)
            r.grad_hidden = tset(&ghid, RNND__V1__DTYPE__FLOAT32, g->grad_hidden, 4, B, T, L, H);
        if (g->grad_cell)
            r.grad_cell = tset(&gcell, RNND__V1__DTYPE__FLOAT32, g->grad_cell, 4, B, T, L, H);
        rnnd_call_reply(call, &r.base);
    }
    free(g->grads);
    free(g->grad_x);
    free(g->grad_h0);
    free(g->grad_c0);
    free(g->grad_hidden);
    free(g->grad_cell);
    free(job);
}

void rnnd_service_backward(void *p, struct rnnd_call *call, const ProtobufCMessage *msg) {
    struct rnnd_service *s = svc_of(p);
    const Rnnd__V1__BackwardRequest *req = (const Rnnd__V1__BackwardRequest *)msg;
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    char err[ERRLEN], layout[128];
    int rc;
    int64_t L = m->L, H = m->H, I = m->I;
    struct rnnd_backward_job g = {.tape_id = req->tape_id, .accumulate = req->accumulate};
    if (req->tape_id == 0) {
        rc = errf(err, RNND_ENOTFOUND,
                  "tape_id 0 names no tape; run Forward with "
                  "keep_tape=true and send the tape_id it returns");
        goto bad;
    }
    int64_t got[3], want[3] = {-1, -1, H};
    snprintf(layout, sizeof(layout), "[B, T, H] (H = --hidden-size %d)", m->H);
    if ((rc = f32_check(req->grad_output, "grad_output", 3, want, layout, got, err)) != 0)
        goto bad;
    if (got[0] > INT32_MAX / 4 || got[1] > INT32_MAX / 4) {
        rc = errf(err, RNND_EINVAL, "grad_output: shape too large");
        goto bad;
    }
    g.B = (int)got[0];
    g.T = (int)got[1];
    g.grad_out = (const float *)req->grad_output->data.data;
    int64_t wstate[3] = {-1, L, H}, sgot[3];
    snprintf(layout, sizeof(layout), "[B, L, H] (L = %lld, H = %lld)", (long long)L, (long long)H);
    if (present(req->grad_h_n)) {
        if ((rc = f32_check(req->grad_h_n, "grad_h_n", 3, wstate, layout, sgot, err)) != 0)
            goto bad;
        g.grad_h_n = (const float *)req->grad_h_n->data.data;
        g.grad_h_n_B = (int)sgot[0];
    }
    if (present(req->grad_c_n)) {
        if (m->cell != RNND_CELL_LSTM) {
            rc = errf(err, RNND_EINVAL, "grad_c_n is for LSTM; this model is a GRU: drop it");
            goto bad;
        }
        if ((rc = f32_check(req->grad_c_n, "grad_c_n", 3, wstate, layout, sgot, err)) != 0)
            goto bad;
        g.grad_c_n = (const float *)req->grad_c_n->data.data;
        g.grad_c_n_B = (int)sgot[0];
    }
    uint64_t B = (uint64_t)g.B, T = (uint64_t)g.T;
    uint64_t bytes = (B * T * ((uint64_t)I + 2 * (uint64_t)(L * H)) + 2 * B * (uint64_t)(L * H) +
                      (req->accumulate ? 0 : rnnd_engine_param_count(s->engine))) *
                     4;
    if (!reply_fits(s, bytes, "send fewer rows or steps per Forward/Backward", err)) {
        rc = RNND_EFULL;
        goto bad;
    }
    struct rnnd_job *job = job_with_model(s);
    if (job == NULL) {
        rc = errf(err, RNND_ENOMEM, "out of memory");
        goto bad;
    }
    job->kind = RNND_JOB_BACKWARD;
    job->owner = call;
    job->done = backward_done;
    job->bwd = g;
    rnnd_engine_submit(s->engine, job);
    return;
bad:
    rnnd_call_fail(call, rc, err);
}

// ---------------------------------------------------------------------------------------------
// Named parameter lists (ApplyGradients, SetWeights)

// Checks that v holds every parameter of m exactly once, FLOAT32 with its shape and finite, and
// copies them into flat (P floats).
static int named_params(const struct rnnd_model *m, Rnnd__V1__NamedTensor *const *v, size_t n,
                        const char *field, float *flat, char *err) {
    int K = rnnd_model_param_tensors(m);
    bool seen[4 * RNND_MAX_LAYERS] = {false};
    char name[96];
    for (size_t i = 0; i < n; i++) {
        const char *nm = v[i] && v[i]->name ? v[i]->name : "";
        int k = nm[0] ? rnnd_model_param_find(m, nm) : RNND_ENOTFOUND;
        if (k < 0) {
            struct rnnd_param_tensor last;
            rnnd_model_param_tensor(m, K - 1, &last);
            return errf(err, RNND_EINVAL,
                        "%s[%zu]: unknown tensor name '%.64s'; this model's are weight_ih_l0, "
                        "weight_hh_l0, bias_ih_l0, bias_hh_l0 ... %s (GetWeights lists them)",
                        field, i, nm, last.name);
        }
        if (seen[k])
            return errf(err, RNND_EINVAL, "%s: '%s' appears twice; send each tensor once", field,
                        nm);
        seen[k] = true;
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(m, k, &pt);
        char layout[96];
        if (pt.ndim == 2)
            snprintf(layout, sizeof(layout), "[%lld, %lld]", (long long)pt.shape[0],
                     (long long)pt.shape[1]);
        else
            snprintf(layout, sizeof(layout), "[%lld]", (long long)pt.shape[0]);
        snprintf(name, sizeof(name), "%s '%s'", field, pt.name);
        int rc = f32_check(v[i]->tensor, name, pt.ndim, pt.shape, layout, NULL, err);
        if (rc)
            return rc;
        memcpy(flat + pt.offset, v[i]->tensor->data.data, pt.count * sizeof(float));
    }
    for (int k = 0; k < K; k++) {
        if (!seen[k]) {
            struct rnnd_param_tensor pt;
            rnnd_model_param_tensor(m, k, &pt);
            return errf(err, RNND_EINVAL,
                        "%s: '%s' is missing; send all %d tensors of the model (GetWeights "
                        "lists them)",
                        field, pt.name, K);
        }
    }
    return 0;
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
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    char err[ERRLEN];
    int rc;
    size_t P = rnnd_engine_param_count(s->engine);
    bool has_lr = req->_lr_case == RNND__V1__APPLY_GRADIENTS_REQUEST___LR_LR;
    if (has_lr && !(req->lr > 0.0f && req->lr < 1e30f)) {
        rc = errf(err, RNND_EINVAL,
                  "lr %g is not usable; send a finite lr > 0 or leave it out "
                  "for --lr %g",
                  (double)req->lr, (double)s->cfg->lr);
        goto bad;
    }
    size_t extra = req->n_grads ? P * sizeof(float) : 0;
    struct rnnd_job *job = calloc(1, sizeof(*job) + extra);
    if (job == NULL) {
        rc = errf(err, RNND_ENOMEM, "out of memory");
        goto bad;
    }
    if (req->n_grads) {
        float *flat = (float *)(job + 1);
        if ((rc = named_params(m, req->grads, req->n_grads, "grads", flat, err)) != 0) {
            free(job);
            goto bad;
        }
        job->apply.grads = flat;
    }
    job->kind = RNND_JOB_APPLY;
    job->owner = call;
    job->done = apply_done;
    job->apply.has_lr = has_lr;
    job->apply.lr = req->lr;
    rnnd_engine_submit(s->engine, job);
    return;
bad:
    rnnd_call_fail(call, rc, err);
}

// ---------------------------------------------------------------------------------------------
// GetWeights, SetWeights

static void get_weights_done(struct rnnd_job *job) {
    struct rnnd_call *call = job->owner;
    const struct rnnd_model *m = rnnd_engine_model(svc_of(job->aux)->engine);
    if (job->err) {
        rnnd_call_fail(call, job->err, job->msg);
    } else {
        Rnnd__V1__Weights r = RNND__V1__WEIGHTS__INIT;
        int K = rnnd_model_param_tensors(m);
        struct rnnd_param_tensor pt[4 * RNND_MAX_LAYERS];
        struct tout t[4 * RNND_MAX_LAYERS];
        Rnnd__V1__NamedTensor nt[4 * RNND_MAX_LAYERS], *ntp[4 * RNND_MAX_LAYERS];
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
    size_t P = rnnd_engine_param_count(s->engine);
    if (!reply_fits(s, P * 4 + 64 * 32, "raise --max-message-mb to fetch this model", err)) {
        rnnd_call_fail(call, RNND_EFULL, err);
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
    rnnd_engine_submit(s->engine, job);
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
    const struct rnnd_model *m = rnnd_engine_model(s->engine);
    char err[ERRLEN];
    size_t P = rnnd_engine_param_count(s->engine);
    struct rnnd_job *job = calloc(1, sizeof(*job) + P * sizeof(float));
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    float *flat = (float *)(job + 1);
    int rc = named_params(m, req->tensors, req->n_tensors, "tensors", flat, err);
    if (rc) {
        free(job);
        rnnd_call_fail(call, rc, err);
        return;
    }
    job->weights.params = flat;
    job->kind = RNND_JOB_SET_WEIGHTS;
    job->owner = call;
    job->done = set_weights_done;
    rnnd_engine_submit(s->engine, job);
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
    const char *path = req->path ? req->path : "";
    if (strlen(path) >= RNND_CONFIG_PATH_MAX) {
        rnnd_call_fail(call, RNND_EINVAL, "path is too long; send a short directory name");
        return;
    }
    if (s->cfg->state_dir[0] == '\0') {
        errf(err, RNND_EPRECOND,
             "no --state-dir configured; start rnnd with --state-dir DIR "
             "to save checkpoints");
        rnnd_call_fail(call, RNND_EPRECOND, err);
        return;
    }
    struct rnnd_job *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        rnnd_call_fail(call, RNND_ENOMEM, "out of memory");
        return;
    }
    snprintf(job->ckpt.path, sizeof(job->ckpt.path), "%s", path);
    job->kind = RNND_JOB_CHECKPOINT;
    job->owner = call;
    job->done = checkpoint_done;
    rnnd_engine_submit(s->engine, job);
}
