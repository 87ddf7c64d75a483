/*
 * request.c: decoding and checking requests (see request.h). The tensor checks come first, then
 * one function per method, in the order of docs/design.md "Wire".
 */
#include "request.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "grpc/health/v1/health.pb-c.h"

typedef Rnnd__V1__Tensor Tensor;

static int errf(char *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int errf(char *err, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, RNND_REQUEST_ERRLEN, fmt, ap);
    va_end(ap);
    return code;
}

void rnnd_request_limits_init(struct rnnd_request_limits *l, const struct rnnd_config *cfg) {
    memset(l, 0, sizeof(*l));
    l->model = cfg->model;
    l->P = rnnd_model_param_count(&cfg->model);
    l->max_batch = cfg->max_batch;
    l->extras_size = cfg->extras_size;
    l->trajectory_steps = cfg->trajectory_steps;
    l->max_message_bytes = (size_t)cfg->max_message_mb << 20;
    l->lr = cfg->lr;
    snprintf(l->state_dir, sizeof(l->state_dir), "%s", cfg->state_dir);
}

// ---------------------------------------------------------------------------------------------
// Decoding

const ProtobufCMessageDescriptor *rnnd_request_descriptor(enum rnnd_method m) {
    switch (m) {
        case RNND_METHOD_GET_MODEL_INFO:
            return &rnnd__v1__get_model_info_request__descriptor;
        case RNND_METHOD_STEP:
        case RNND_METHOD_STEP_STREAM:
            return &rnnd__v1__step_request__descriptor;
        case RNND_METHOD_END_EPISODES:
            return &rnnd__v1__end_episodes_request__descriptor;
        case RNND_METHOD_FORWARD:
            return &rnnd__v1__forward_request__descriptor;
        case RNND_METHOD_BACKWARD:
            return &rnnd__v1__backward_request__descriptor;
        case RNND_METHOD_APPLY_GRADIENTS:
            return &rnnd__v1__apply_gradients_request__descriptor;
        case RNND_METHOD_GET_WEIGHTS:
            return &rnnd__v1__get_weights_request__descriptor;
        case RNND_METHOD_SET_WEIGHTS:
            return &rnnd__v1__set_weights_request__descriptor;
        case RNND_METHOD_SAVE_CHECKPOINT:
            return &rnnd__v1__save_checkpoint_request__descriptor;
        case RNND_METHOD_REGISTER_REGION:
            return &rnnd__v1__register_region_request__descriptor;
        case RNND_METHOD_RELEASE_REGION:
            return &rnnd__v1__release_region_request__descriptor;
        case RNND_METHOD_HEALTH_CHECK:
        case RNND_METHOD_HEALTH_WATCH:
            return &grpc__health__v1__health_check_request__descriptor;
        case RNND_METHOD_UNKNOWN:
        case RNND_METHOD_COUNT:
            break;
    }
    return NULL;
}

ProtobufCMessage *rnnd_request_decode(enum rnnd_method m, const uint8_t *data, size_t len) {
    const ProtobufCMessageDescriptor *d = rnnd_request_descriptor(m);
    return d ? protobuf_c_message_unpack(d, NULL, len, data) : NULL;
}

bool rnnd_request_health_known(const char *service) {
    return service[0] == '\0' || strcmp(service, "rnnd.v1.Rnn") == 0;
}

// ---------------------------------------------------------------------------------------------
// Tensor checks

static const char *dtype_name(int dt) {
    static const char *const names[] = {"DTYPE_UNSPECIFIED", "FLOAT32", "BFLOAT16",
                                        "FLOAT16",           "BOOL",    "INT64"};
    return dt >= 0 && dt <= 5 ? names[dt] : "an unknown dtype";
}

size_t rnnd_request_dtype_size(int dt) {
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
    uint64_t bytes = count * rnnd_request_dtype_size(dtype);
    if ((uint64_t)t->data.len != bytes)
        return errf(err, RNND_EINVAL,
                    "%s: data has %zu bytes but shape %s of %s needs %" PRIu64
                    " (row-major, little-endian); send exactly that many",
                    name, t->data.len, gbuf, dtype_name(dtype), bytes);
    return 0;
}

// Refuses NaN and Inf in the FLOAT32 data of t, naming the first one's index over t's shape.
static int finite_check(const Tensor *t, const char *name, char *err) {
    size_t n = t->data.len / 4;
    size_t i = rnnd_first_nonfinite(t->data.data, RNND_FTYPE_F32, n);
    if (i == n)
        return 0;
    uint32_t bits;
    memcpy(&bits, t->data.data + 4 * i, 4);
    char idx[96];
    size_t k = 0, rem = i;
    int64_t sub[8] = {0};
    for (size_t d = t->n_shape; d-- > 0 && d < 8;) {
        sub[d] = (int64_t)(rem % (size_t)t->shape[d]);
        rem /= (size_t)t->shape[d];
    }
    for (size_t d = 0; d < t->n_shape && d < 8 && k < sizeof(idx); d++)
        k += (size_t)snprintf(idx + k, sizeof(idx) - k, "%s%lld", d ? ", " : "", (long long)sub[d]);
    return errf(err, RNND_EINVAL, "%s[%s] is %s; send finite values", name, idx,
                (bits & 0x007fffffu) ? "NaN"
                : (bits >> 31)       ? "-Inf"
                                     : "Inf");
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

// Refuses NaN and Inf in the 16-bit floats (BFLOAT16 or FLOAT16: dt) of t.
static int finite16_check(const Tensor *t, const char *name, int dt, char *err) {
    size_t n = t->data.len / 2;
    enum rnnd_ftype ft = rnnd_request_ftype(dt);
    size_t i = rnnd_first_nonfinite(t->data.data, ft, n);
    if (i == n)
        return 0;
    uint16_t v = (uint16_t)(t->data.data[2 * i] | (t->data.data[2 * i + 1] << 8));
    uint16_t mantissa = ft == RNND_FTYPE_BF16 ? 0x007fu : 0x03ffu;
    return errf(err, RNND_EINVAL, "%s: element %zu is %s; send finite values", name, i,
                (v & mantissa) ? "NaN" : "Inf");
}

static bool float_dtype(int dt) {
    return dt == RNND__V1__DTYPE__FLOAT32 || dt == RNND__V1__DTYPE__BFLOAT16 ||
           dt == RNND__V1__DTYPE__FLOAT16;
}

enum rnnd_ftype rnnd_request_ftype(int dtype) {
    return dtype == RNND__V1__DTYPE__BFLOAT16  ? RNND_FTYPE_BF16
           : dtype == RNND__V1__DTYPE__FLOAT16 ? RNND_FTYPE_F16
                                               : RNND_FTYPE_F32;
}

int rnnd_request_dtype_of(enum rnnd_ftype ft) {
    return ft == RNND_FTYPE_BF16  ? RNND__V1__DTYPE__BFLOAT16
           : ft == RNND_FTYPE_F16 ? RNND__V1__DTYPE__FLOAT16
                                  : RNND__V1__DTYPE__FLOAT32;
}

// A float tensor of a request: FLOAT32, BFLOAT16 or FLOAT16, the dtype of the request's other
// float tensors (*dt: 0 until the first one is checked, then its dtype). Its data are not read:
// device pointers (a CUDA region) pass this alone, and the engine checks their values there.
static int float_shape_check(const Tensor *t, const char *name, int ndim, const int64_t *want,
                             const char *layout, int64_t *got, int *dt, const char *first,
                             char *err) {
    if (present(t) && !float_dtype(t->dtype))
        return errf(err, RNND_EINVAL,
                    "%s: dtype %s is not accepted; send FLOAT32, BFLOAT16 or FLOAT16 %s", name,
                    dtype_name(t->dtype), layout);
    if (present(t) && *dt && (int)t->dtype != *dt)
        return errf(err, RNND_EINVAL,
                    "%s is %s but %s is %s; send every float tensor of a request in one dtype",
                    name, dtype_name(t->dtype), first, dtype_name(*dt));
    int want_dt = present(t) ? (int)t->dtype : *dt ? *dt : RNND__V1__DTYPE__FLOAT32;
    int rc = tensor_check(t, name, want_dt, ndim, want, layout, got, err);
    if (rc == 0)
        *dt = want_dt;
    return rc;
}

// float_shape_check, and the values finite.
static int float_check(const Tensor *t, const char *name, int ndim, const int64_t *want,
                       const char *layout, int64_t *got, int *dt, const char *first, char *err) {
    int rc = float_shape_check(t, name, ndim, want, layout, got, dt, first, err);
    if (rc)
        return rc;
    int want_dt = *dt;
    if (want_dt == RNND__V1__DTYPE__FLOAT32)
        return finite_check(t, name, err);
    return finite16_check(t, name, want_dt, err);
}

// The dtype of a reply's float tensors: reply_dtype when set, else the request's (in).
static int reply_dtype(int reply, int in, enum rnnd_ftype *out, char *err) {
    if (reply != RNND__V1__DTYPE__DTYPE_UNSPECIFIED && !float_dtype(reply))
        return errf(
            err, RNND_EINVAL,
            "reply_dtype %s is not one the daemon sends; send FLOAT32, BFLOAT16 or FLOAT16, "
            "or leave it unset for the request's own",
            dtype_name(reply));
    *out = rnnd_request_ftype(reply ? reply : in);
    return 0;
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

// ---------------------------------------------------------------------------------------------
// Named parameter lists (ApplyGradients, SetWeights)

// Checks that v holds every parameter of m exactly once, FLOAT32 with its shape and finite, and
// copies them into flat (P floats).
static int named_params(const struct rnnd_model *m, Rnnd__V1__NamedTensor *const *v, size_t n,
                        const char *field, float *flat, char *err) {
    int K = rnnd_model_param_tensors(m);
    bool seen[RNND_MAX_PARAM_TENSORS] = {false};
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

// Room for framing and the reply's other fields, on top of its tensors.
#define REPLY_FRAMING 4096

// True when a reply of `bytes` (framing included) fits into --max-message-mb; else RNND_EFULL in
// err with the advice `what`.
static int reply_fits(const struct rnnd_request_limits *l, size_t bytes, const char *what,
                      char *err) {
    if (bytes <= l->max_message_bytes)
        return 0;
    return errf(err, RNND_EFULL, "the reply would be %.1f MiB, over --max-message-mb %zu; %s",
                (double)bytes / 1048576.0, l->max_message_bytes >> 20, what);
}

size_t rnnd_request_step_reply_bytes(const struct rnnd_request_limits *l,
                                     const Rnnd__V1__StepRequest *req) {
    const struct rnnd_model *m = &l->model;
    size_t B = req->n_env_ids, H = (size_t)m->H, LH = (size_t)m->L * H;
    size_t state = req->return_state ? (m->cell == RNND_CELL_LSTM ? 2 : 1) * LH : 0;
    // A policy's row, with room for an int64 action and the logits or mean when asked for.
    size_t pol = (size_t)rnnd_policy_row(m).W + 1;
    return B * (H + state + pol) * sizeof(float) + REPLY_FRAMING;
}

size_t rnnd_request_forward_reply_bytes(const struct rnnd_request_limits *l,
                                        const struct rnnd_forward_job *f) {
    const struct rnnd_model *m = &l->model;
    uint64_t B = (uint64_t)f->B, T = (uint64_t)f->T, H = (uint64_t)m->H, LH = (uint64_t)m->L * H;
    const struct rnnd_policy *p = &m->policy;
    bool heads = rnnd_policy_row(m).W > 0;
    uint64_t fb = rnnd_ftype_bytes(f->out_dtype);
    uint64_t per_step = ((heads && !f->return_core ? 0 : H) + (uint64_t)p->K + (uint64_t)p->A +
                         (p->value ? 1 : 0)) *
                        fb;
    if (f->recorded) { // the recorded tensors asked for (recorded_fields), in the reply dtype
        unsigned k = f->rec_fields;
        per_step += (k & RNND_REC_OBS ? (uint64_t)m->I * fb : 0) +
                    (k & RNND_REC_EXTRAS ? (uint64_t)l->extras_size * fb : 0) +
                    (k & RNND_REC_IS_INIT ? 1 : 0) + (k & RNND_REC_VERSION ? 8 : 0) +
                    (k & RNND_REC_ACTION ? 8 * (uint64_t)(m->policy.A + 1) + 8 : 0) +
                    (k & RNND_REC_REWARD ? 6 : 0);
    }
    uint64_t cursor = f->cursor ? 3 * 10 * B : 0; // cursor_first, _lagged, _overwritten varints
    return (size_t)(B * T * per_step + (2 * B * LH + (uint64_t)p->A) * fb + cursor) + REPLY_FRAMING;
}

// Gradients of stored states come back only from Forwards that had them, which the engine knows
// (it checks the reply against the limit again, with the tape's inputs); here they count only
// when asked for by name.
size_t rnnd_request_backward_reply_bytes(const struct rnnd_request_limits *l,
                                         const struct rnnd_backward_job *g) {
    const struct rnnd_model *m = &l->model;
    uint64_t B = (uint64_t)g->B, T = (uint64_t)g->T, LH = (uint64_t)m->L * (uint64_t)m->H;
    unsigned w = g->input_grads;
    bool hidden = g->input_grads_set && (w & RNND_GRAD_HIDDEN);
    uint64_t n = (w & RNND_GRAD_OBS ? B * T * (uint64_t)m->I : 0) + (hidden ? 2 * B * T * LH : 0) +
                 (w & RNND_GRAD_H0 ? 2 * B * LH : 0) + (g->accumulate ? 0 : l->P);
    return (size_t)(n * rnnd_ftype_bytes(g->out_dtype)) + REPLY_FRAMING;
}

size_t rnnd_request_get_weights_reply_bytes(const struct rnnd_request_limits *l) {
    return l->P * 4 + 64 * RNND_MAX_PARAM_TENSORS + REPLY_FRAMING;
}

// ---------------------------------------------------------------------------------------------
// Step, EndEpisodes

int rnnd_request_step(const struct rnnd_request_limits *l, const Rnnd__V1__StepRequest *req,
                      bool *extras, struct rnnd_request_dtypes *dts, char *err) {
    const struct rnnd_model *m = &l->model;
    size_t B = req->n_env_ids;
    int64_t E = l->extras_size;
    int rc, dt = 0;
    *extras = false;
    if (B == 0)
        return errf(err, RNND_EINVAL, "env_ids is empty; send one env id per obs row");
    if (B > (size_t)l->max_batch)
        return errf(err, RNND_EINVAL,
                    "%zu env_ids exceed --max-batch %d; split the request into smaller ones", B,
                    l->max_batch);
    if ((rc = unique_check(req->env_ids, B, "env_ids", err)) != 0)
        return rc;
    int64_t want_obs[2] = {(int64_t)B, m->I};
    char layout[128];
    snprintf(layout, sizeof(layout), "[B, I] (B = %zu env_ids, I = --input-size %d)", B, m->I);
    if ((rc = float_check(req->obs, "obs", 2, want_obs, layout, NULL, &dt, "obs", err)) != 0)
        return rc;
    dts->in = rnnd_request_ftype(dt);
    if ((rc = reply_dtype(req->reply_dtype, dt, &dts->out, err)) != 0)
        return rc;
    if (req->n_is_init != 0 && req->n_is_init != B)
        return errf(err, RNND_EINVAL,
                    "is_init has %zu values for %zu env_ids; send one per env or none (all "
                    "false)",
                    req->n_is_init, B);
    if (req->n_step_index != 0 && req->n_step_index != B)
        return errf(err, RNND_EINVAL,
                    "step_index has %zu values for %zu env_ids; send one per env or none",
                    req->n_step_index, B);
    size_t fb[3] = {req->n_reward, req->n_done, req->n_truncated};
    const char *fname[3] = {"reward", "done", "truncated"};
    for (int k = 0; k < 3; k++) {
        if (fb[k] == 0)
            continue;
        if (rnnd_policy_row(m).W == 0 || l->trajectory_steps == 0)
            return errf(err, RNND_EINVAL, "%s: this daemon records no %s (%s); drop the field",
                        fname[k], rnnd_policy_row(m).W ? "steps" : "rewards",
                        rnnd_policy_row(m).W
                            ? "--trajectory-steps 0"
                            : "the model has no heads: --discrete-actions, --gaussian-actions "
                              "or --value-head; extras carry other per-step data");
        if (fb[k] != B)
            return errf(err, RNND_EINVAL,
                        "%s has %zu values for %zu env_ids; send one per env (of its previous "
                        "step) or none",
                        fname[k], fb[k], B);
    }
    for (size_t r = 0; r < req->n_reward; r++)
        if (!isfinite(req->reward[r]))
            return errf(err, RNND_EINVAL, "reward[%zu] is %g; send finite rewards", r,
                        (double)req->reward[r]);
    if ((req->greedy || req->return_logits) && m->policy.K == 0 && m->policy.A == 0)
        return errf(err, RNND_EINVAL,
                    "%s: this model has no action head%s, so Step returns no actions; drop the "
                    "field, or start rnnd with --discrete-actions K or --gaussian-actions A",
                    req->greedy ? "greedy" : "return_logits",
                    rnnd_model_has_policy(m) ? "" : " (no heads: it serves the core output)");
    if (!present(req->extras))
        return 0;
    if (E == 0) {
        // An explicitly empty [B, 0] tensor is the same as none.
        bool empty =
            req->extras->data.len == 0 && req->extras->n_shape == 2 && req->extras->shape[1] == 0;
        if (!empty)
            return errf(err, RNND_EINVAL,
                        "extras sent but this daemon records none (--extras-size 0); drop extras "
                        "or start rnnd with --extras-size E");
        return 0;
    }
    int64_t want[2] = {(int64_t)B, E};
    snprintf(layout, sizeof(layout), "[B, E] (B = %zu env_ids, E = --extras-size %lld)", B,
             (long long)E);
    if ((rc = float_check(req->extras, "extras", 2, want, layout, NULL, &dt, "obs", err)) != 0)
        return rc;
    *extras = true;
    return 0;
}

int rnnd_request_end_episodes(const struct rnnd_request_limits *l,
                              const Rnnd__V1__EndEpisodesRequest *req, char *err) {
    (void)l;
    return unique_check(req->env_ids, req->n_env_ids, "env_ids", err);
}

// ---------------------------------------------------------------------------------------------
// Forward, Backward

static int forward_explicit(const struct rnnd_request_limits *l, const Rnnd__V1__Trajectories *t,
                            int reply, struct rnnd_forward_job *f, char *err) {
    const struct rnnd_model *m = &l->model;
    bool lstm = m->cell == RNND_CELL_LSTM;
    int64_t L = m->L, H = m->H, I = m->I;
    char layout[128];
    int rc, dt = 0;
    const char *first = "trajectories.obs";
    int64_t got[3], want3[3] = {-1, -1, I};
    snprintf(layout, sizeof(layout), "[B, T, I] (I = --input-size %d)", m->I);
    if ((rc = float_check(t->obs, "trajectories.obs", 3, want3, layout, got, &dt, first, err)) != 0)
        return rc;
    f->in = rnnd_request_ftype(dt);
    if ((rc = reply_dtype(reply, dt, &f->out_dtype, err)) != 0)
        return rc;
    if (got[0] > INT32_MAX / 4 || got[1] > INT32_MAX / 4 || got[0] * got[1] > INT32_MAX / 4)
        return errf(err, RNND_EINVAL, "trajectories.obs: B * T is too large");
    int64_t B = got[0], T = got[1];
    f->B = (int)B;
    f->T = (int)T;
    f->x = (const float *)t->obs->data.data;
    if (present(t->is_init)) {
        int64_t want[2] = {B, T};
        snprintf(layout, sizeof(layout), "[B, T] = [%lld, %lld] (from obs)", (long long)B,
                 (long long)T);
        if ((rc = tensor_check(t->is_init, "trajectories.is_init", RNND__V1__DTYPE__BOOL, 2, want,
                               layout, NULL, err)) != 0 ||
            (rc = bool_check(t->is_init, "trajectories.is_init", err)) != 0)
            return rc;
        f->is_init = t->is_init->data.data;
    }
    int64_t want_state[3] = {B, L, H}, want_stored[4] = {B, T, L, H};
    snprintf(layout, sizeof(layout), "[B, L, H] = [%lld, %lld, %lld]", (long long)B, (long long)L,
             (long long)H);
    if (present(t->h0)) {
        if ((rc = float_check(t->h0, "trajectories.h0", 3, want_state, layout, NULL, &dt, first,
                              err)))
            return rc;
        f->h0 = (const float *)t->h0->data.data;
    }
    if (present(t->c0)) {
        if (!lstm)
            return errf(err, RNND_EINVAL,
                        "trajectories.c0 is for LSTM; this model is a GRU: drop c0");
        if ((rc = float_check(t->c0, "trajectories.c0", 3, want_state, layout, NULL, &dt, first,
                              err)))
            return rc;
        f->c0 = (const float *)t->c0->data.data;
    }
    snprintf(layout, sizeof(layout), "[B, T, L, H] = [%lld, %lld, %lld, %lld]", (long long)B,
             (long long)T, (long long)L, (long long)H);
    if (present(t->hidden)) {
        if ((rc = float_check(t->hidden, "trajectories.hidden", 4, want_stored, layout, NULL, &dt,
                              first, err)))
            return rc;
        f->hidden = (const float *)t->hidden->data.data;
    }
    if (present(t->cell)) {
        if (!lstm)
            return errf(err, RNND_EINVAL,
                        "trajectories.cell is for LSTM; this model is a GRU: drop cell");
        if ((rc = float_check(t->cell, "trajectories.cell", 4, want_stored, layout, NULL, &dt,
                              first, err)))
            return rc;
        f->cell = (const float *)t->cell->data.data;
    }
    if (f->h0 && f->hidden)
        return errf(err, RNND_EINVAL,
                    "trajectories: h0 and hidden exclude each other (hidden [:, 0] is the "
                    "initial state); send one of them");
    if (lstm && (!f->h0 != !f->c0))
        return errf(err, RNND_EINVAL,
                    "trajectories: an LSTM needs h0 and c0 together; send both or neither");
    if (lstm && (!f->hidden != !f->cell))
        return errf(err, RNND_EINVAL,
                    "trajectories: an LSTM needs hidden and cell together; send both or neither");
    return reply_fits(l, rnnd_request_forward_reply_bytes(l, f),
                      "send fewer rows or steps per Forward (or ask for a 16-bit reply_dtype)",
                      err);
}

static int forward_recorded(const struct rnnd_request_limits *l, const Rnnd__V1__Recorded *rec,
                            int reply, struct rnnd_forward_job *f, char *err) {
    int rc;
    if ((rc = reply_dtype(reply, RNND__V1__DTYPE__FLOAT32, &f->out_dtype, err)) != 0)
        return rc;
    if ((f->rec_fields & RNND_REC_EXTRAS) && l->extras_size == 0)
        return errf(err, RNND_EINVAL,
                    "recorded_fields asks for RECORDED_EXTRAS but this daemon records none "
                    "(--extras-size 0); drop that bit");
    if (l->trajectory_steps == 0)
        return errf(err, RNND_EPRECOND,
                    "this daemon records no steps (--trajectory-steps 0); send explicit "
                    "trajectories or restart it with --trajectory-steps N");
    if (rec->n_env_ids == 0)
        return errf(err, RNND_EINVAL, "recorded.env_ids is empty; send the envs to replay");
    if (rec->steps == 0 || rec->steps > (uint32_t)l->trajectory_steps)
        return errf(err, RNND_EINVAL,
                    "recorded.steps is %u; send 1 to %d (--trajectory-steps keeps that many per "
                    "env)",
                    rec->steps, l->trajectory_steps);
    if (rec->n_env_ids > (size_t)(INT32_MAX / 4) / rec->steps)
        return errf(err, RNND_EINVAL, "recorded: too many env_ids x steps");
    if ((rc = unique_check(rec->env_ids, rec->n_env_ids, "recorded.env_ids", err)) != 0)
        return rc;
    if (rec->cursor_id && !rec->cursor)
        return errf(err, RNND_EINVAL,
                    "recorded.cursor_id is set but recorded.cursor is false; set cursor to take "
                    "cursor windows, or leave cursor_id 0");
    if (rec->cursor_id && rec->cursor_id != l->cursor_id)
        return errf(err, RNND_EPRECOND,
                    "recorded.cursor_id %016" PRIx64 " is not this daemon's (%016" PRIx64
                    "): it comes from another rnnd, or from this one before a restart (its "
                    "cursors are those of the checkpoint it restored, so windows handed out "
                    "since may come again); send cursor_id 0 to go on from this daemon's "
                    "cursors, or reach the daemon that issued it",
                    rec->cursor_id, l->cursor_id);
    if (rec->cursor && rec->steps < 2)
        return errf(err, RNND_EINVAL,
                    "recorded.steps is 1 with cursor; send 2 or more (consecutive cursor windows "
                    "share one step, so a window of one would never move)");
    f->recorded = true;
    f->cursor = rec->cursor;
    f->B = (int)rec->n_env_ids;
    f->T = (int)rec->steps;
    f->env_ids = rec->env_ids;
    return reply_fits(l, rnnd_request_forward_reply_bytes(l, f),
                      "send fewer rows or steps per Forward, ask for fewer recorded_fields, or "
                      "a 16-bit reply_dtype",
                      err);
}

int rnnd_request_forward(const struct rnnd_request_limits *l, const Rnnd__V1__ForwardRequest *req,
                         struct rnnd_forward_job *f, char *err) {
    memset(f, 0, sizeof(*f));
    f->keep_tape = req->keep_tape;
    f->return_core = req->return_core;
    bool has_fields =
        req->_recorded_fields_case == RNND__V1__FORWARD_REQUEST___RECORDED_FIELDS_RECORDED_FIELDS;
    // Absent: everything there is (no extras when the daemon records none, no actions and
    // rewards without heads), as before the mask.
    unsigned heads = rnnd_policy_row(&l->model).W ? 0u : RNND_REC_ACTION | RNND_REC_REWARD;
    f->rec_fields = has_fields ? req->recorded_fields
                               : RNND_REC_ALL & ~(l->extras_size ? 0u : RNND_REC_EXTRAS) & ~heads;
    if (f->rec_fields & ~RNND_REC_ALL)
        return errf(err, RNND_EINVAL,
                    "recorded_fields 0x%x has bits that name no field; send an OR of "
                    "RECORDED_OBS (1), RECORDED_IS_INIT (2), RECORDED_EXTRAS (4), "
                    "RECORDED_STEP_MODEL_VERSION (8), RECORDED_ACTION (16) and RECORDED_REWARD "
                    "(32)",
                    f->rec_fields);
    if (f->rec_fields & heads)
        return errf(err, RNND_EINVAL,
                    "recorded_fields asks for RECORDED_ACTION or RECORDED_REWARD, but this model "
                    "has no heads (--discrete-actions, --gaussian-actions, --value-head), so "
                    "no actions or rewards are recorded; drop those bits");
    if (req->source_case == RNND__V1__FORWARD_REQUEST__SOURCE_TRAJECTORIES && req->trajectories) {
        if (has_fields && f->rec_fields)
            return errf(err, RNND_EINVAL,
                        "recorded_fields asks for recorded tensors, but explicit trajectories have "
                        "none; leave it unset (or 0) with trajectories");
        f->rec_fields = 0;
        return forward_explicit(l, req->trajectories, req->reply_dtype, f, err);
    }
    if (req->source_case == RNND__V1__FORWARD_REQUEST__SOURCE_RECORDED && req->recorded)
        return forward_recorded(l, req->recorded, req->reply_dtype, f, err);
    return errf(err, RNND_EINVAL,
                "ForwardRequest has no source; set trajectories (explicit obs/is_init) or "
                "recorded (env_ids and steps)");
}

int rnnd_request_backward(const struct rnnd_request_limits *l, const Rnnd__V1__BackwardRequest *req,
                          struct rnnd_backward_job *g, bool values_later, char *err) {
    int (*check)(const Tensor *, const char *, int, const int64_t *, const char *, int64_t *, int *,
                 const char *, char *) = values_later ? float_shape_check : float_check;
    const struct rnnd_model *m = &l->model;
    char layout[160];
    int rc, dt = 0;
    int64_t L = m->L, H = m->H;
    memset(g, 0, sizeof(*g));
    g->tape_id = req->tape_id;
    g->accumulate = req->accumulate;
    g->apply = req->apply;
    if (g->apply && !g->accumulate)
        return errf(err, RNND_EINVAL,
                    "apply steps on the accumulated gradients: send accumulate=true with it, or "
                    "call ApplyGradients with the gradients");
    g->input_grads_set =
        req->_input_grads_case == RNND__V1__BACKWARD_REQUEST___INPUT_GRADS_INPUT_GRADS;
    g->input_grads = g->input_grads_set ? req->input_grads : RNND_GRAD_ALL;
    if (g->input_grads & ~RNND_GRAD_ALL)
        return errf(err, RNND_EINVAL,
                    "input_grads 0x%x has bits that name no gradient; send an OR of "
                    "INPUT_GRAD_OBS (1), INPUT_GRAD_H0 (2) and INPUT_GRAD_HIDDEN (4)",
                    g->input_grads);
    if (req->tape_id == 0)
        return errf(err, RNND_ENOTFOUND,
                    "tape_id 0 names no tape; run Forward with keep_tape=true and send the "
                    "tape_id it returns");
    // What flows into the core's output: grad_output, and (models with heads) the gradients of
    // the heads' outputs, each optional but at least one of them; all of one B and T.
    const struct rnnd_policy *p = &m->policy;
    struct {
        const Tensor *t;
        const char *name, *dims, *flag;
        int has, ndim; // has: the width (0: the model has no such head)
        const void **dst;
    } in[] = {
        {req->grad_output, "grad_output", "[B, T, H]", "--hidden-size", m->H, 3, &g->grad_out},
        {req->grad_logits, "grad_logits", "[B, T, K]", "--discrete-actions", p->K, 3,
         &g->grad_logits},
        {req->grad_mean, "grad_mean", "[B, T, A]", "--gaussian-actions", p->A, 3, &g->grad_mean},
        {req->grad_head_value, "grad_head_value", "[B, T]", "--value-head", p->value, 2,
         &g->grad_value},
        {req->grad_log_std, "grad_log_std", "[A]", "--gaussian-actions", p->A, 1, &g->grad_log_std},
    };
    const char *first = NULL;
    int64_t B = -1, T = -1;
    for (size_t i = 0; i < sizeof(in) / sizeof(in[0]); i++) {
        if (!present(in[i].t))
            continue;
        if (in[i].has == 0)
            return errf(err, RNND_EINVAL,
                        "%s: this model has no such head (%s is not set); send only the "
                        "gradients of the outputs its Forward returns",
                        in[i].name, in[i].flag);
        int64_t got[3], want[3] = {B, T, in[i].has};
        if (in[i].ndim == 1)
            want[0] = p->A;
        snprintf(layout, sizeof(layout), "%s (%s %d; B and T of the Forward)", in[i].dims,
                 in[i].flag, in[i].has);
        if ((rc = check(in[i].t, in[i].name, in[i].ndim, want, layout, got, &dt,
                        first ? first : in[i].name, err)) != 0)
            return rc;
        first = first ? first : in[i].name;
        if (in[i].ndim > 1) {
            B = got[0];
            T = got[1];
        }
        *in[i].dst = in[i].t->data.data;
    }
    if (B < 0) {
        if (rnnd_policy_row(m).W == 0)
            return errf(err, RNND_EINVAL,
                        "grad_output: missing; send the gradient of the Forward's output, "
                        "[B, T, H] (H = --hidden-size %d)",
                        m->H);
        return errf(err, RNND_EINVAL,
                    "no gradient of the Forward's outputs; send grad_logits, grad_mean or "
                    "grad_head_value [B, T, ...] (and/or grad_output [B, T, H] for the core's "
                    "output)%s",
                    present(req->grad_log_std) ? ": grad_log_std [A] alone has no B and T" : "");
    }
    g->in = rnnd_request_ftype(dt);
    if ((rc = reply_dtype(req->reply_dtype, dt, &g->out_dtype, err)) != 0)
        return rc;
    if (B > INT32_MAX / 4 || T > INT32_MAX / 4)
        return errf(err, RNND_EINVAL, "%s: shape too large", first);
    g->B = (int)B;
    g->T = (int)T;
    int64_t wstate[3] = {-1, L, H}, sgot[3];
    snprintf(layout, sizeof(layout), "[B, L, H] (L = %lld, H = %lld)", (long long)L, (long long)H);
    if (present(req->grad_h_n)) {
        if ((rc = check(req->grad_h_n, "grad_h_n", 3, wstate, layout, sgot, &dt, first, err)) != 0)
            return rc;
        g->grad_h_n = (const float *)req->grad_h_n->data.data;
        g->grad_h_n_B = (int)sgot[0];
    }
    if (present(req->grad_c_n)) {
        if (m->cell != RNND_CELL_LSTM)
            return errf(err, RNND_EINVAL, "grad_c_n is for LSTM; this model is a GRU: drop it");
        if ((rc = check(req->grad_c_n, "grad_c_n", 3, wstate, layout, sgot, &dt, first, err)) != 0)
            return rc;
        g->grad_c_n = (const float *)req->grad_c_n->data.data;
        g->grad_c_n_B = (int)sgot[0];
    }
    return reply_fits(l, rnnd_request_backward_reply_bytes(l, g),
                      "send fewer rows or steps per Forward/Backward, ask for fewer input_grads, "
                      "or a 16-bit reply_dtype",
                      err);
}

// ---------------------------------------------------------------------------------------------
// ApplyGradients, GetWeights, SetWeights, SaveCheckpoint

int rnnd_request_apply_gradients(const struct rnnd_request_limits *l,
                                 const Rnnd__V1__ApplyGradientsRequest *req, float *flat,
                                 bool *has_lr, char *err) {
    *has_lr = req->_lr_case == RNND__V1__APPLY_GRADIENTS_REQUEST___LR_LR;
    if (*has_lr && !(req->lr > 0.0f && req->lr < 1e30f))
        return errf(err, RNND_EINVAL,
                    "lr %g is not usable; send a finite lr > 0 or leave it out for --lr %g",
                    (double)req->lr, (double)l->lr);
    if (req->n_grads == 0)
        return 0;
    return named_params(&l->model, req->grads, req->n_grads, "grads", flat, err);
}

int rnnd_request_get_weights(const struct rnnd_request_limits *l, char *err) {
    return reply_fits(l, rnnd_request_get_weights_reply_bytes(l),
                      "raise --max-message-mb to fetch this model", err);
}

int rnnd_request_set_weights(const struct rnnd_request_limits *l,
                             const Rnnd__V1__SetWeightsRequest *req, float *flat, char *err) {
    return named_params(&l->model, req->tensors, req->n_tensors, "tensors", flat, err);
}

int rnnd_request_save_checkpoint(const struct rnnd_request_limits *l,
                                 const Rnnd__V1__SaveCheckpointRequest *req, char *err) {
    const char *path = req->path ? req->path : "";
    if (strlen(path) >= RNND_CONFIG_PATH_MAX)
        return errf(err, RNND_EINVAL, "path is too long; send a short directory name");
    // Resolving a name is pure string work: a bad one is refused before anything is queued
    // (the engine resolves it again, with the version, when it writes).
    char dir[RNND_CONFIG_PATH_MAX];
    return rnnd_checkpoint_resolve(l->state_dir, path, 0, dir, sizeof(dir), err,
                                   RNND_REQUEST_ERRLEN);
}
