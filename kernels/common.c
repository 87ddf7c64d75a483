/*
 * common.c: what every backend shares and no backend computes: error strings, the model's
 * parameter layout (PyTorch names and offsets), weight initialisation and argument checks.
 */
#include "rnnd_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *rnnd_strerror(int err) {
#define RNND__STRERROR(name, value, msg)                                                           \
    case RNND_##name:                                                                              \
        return msg;
    switch (err) {
        case 0:
            return "success";
            RNND_ERRNO_MAP(RNND__STRERROR)
    }
#undef RNND__STRERROR
    return "unknown error";
}

const char *rnnd_err_name(int err) {
#define RNND__ERR_NAME(name, value, msg)                                                           \
    case RNND_##name:                                                                              \
        return #name;
    switch (err) {
        case 0:
            return "OK";
            RNND_ERRNO_MAP(RNND__ERR_NAME)
    }
#undef RNND__ERR_NAME
    return "EUNKNOWN";
}

// ---------------------------------------------------------------------------------------------
// Model layout

// A reason into err (errlen bytes, may be 0), then RNND_EINVAL.
static int invalid(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int invalid(char *err, size_t errlen, const char *fmt, ...) {
    if (errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return RNND_EINVAL;
}

int rnnd_model_validate(const struct rnnd_model *m, char *err, size_t errlen) {
    if (errlen)
        err[0] = '\0';
    if (m == NULL)
        return invalid(err, errlen, "no model");
    if (m->cell != RNND_CELL_GRU && m->cell != RNND_CELL_LSTM)
        return invalid(err, errlen, "unknown cell %d: gru or lstm", (int)m->cell);
    if (m->compute != RNND_COMPUTE_FP32 && m->compute != RNND_COMPUTE_IEEE &&
        m->compute != RNND_COMPUTE_BF16)
        return invalid(err, errlen, "unknown compute %d: fp32, ieee or bf16", (int)m->compute);
    if (m->I < 1 || m->I > RNND_MAX_WIDTH)
        return invalid(err, errlen, "input size %d: 1 .. %d", m->I, RNND_MAX_WIDTH);
    if (m->H < 1 || m->H > RNND_MAX_WIDTH)
        return invalid(err, errlen, "hidden size %d: 1 .. %d", m->H, RNND_MAX_WIDTH);
    if (m->L < 1 || m->L > RNND_MAX_LAYERS)
        return invalid(err, errlen, "layers %d: 1 .. %d", m->L, RNND_MAX_LAYERS);
    const struct rnnd_policy *p = &m->policy;
    if (p->enc_layers < 0 || p->enc_layers > RNND_MAX_ENCODER_LAYERS)
        return invalid(err, errlen, "encoder layers %d: 0 .. %d", p->enc_layers,
                       RNND_MAX_ENCODER_LAYERS);
    for (int j = 0; j < p->enc_layers; j++)
        if (p->enc_width[j] < 1 || p->enc_width[j] > RNND_MAX_WIDTH)
            return invalid(err, errlen, "encoder layer %d width %d: 1 .. %d", j, p->enc_width[j],
                           RNND_MAX_WIDTH);
    if (p->enc_act != RNND_ACT_ELU && p->enc_act != RNND_ACT_RELU && p->enc_act != RNND_ACT_TANH)
        return invalid(err, errlen, "unknown encoder activation %d: elu, relu or tanh",
                       (int)p->enc_act);
    if (p->K < 0 || p->K == 1 || p->K > RNND_MAX_WIDTH)
        return invalid(err, errlen, "discrete actions %d: 0 (no discrete head) or 2 .. %d", p->K,
                       RNND_MAX_WIDTH);
    if (p->A < 0 || p->A > RNND_MAX_WIDTH)
        return invalid(err, errlen, "Gaussian action dims %d: 0 (no Gaussian head) .. %d", p->A,
                       RNND_MAX_WIDTH);
    if (p->K > 0 && p->A > 0)
        return invalid(err, errlen,
                       "discrete actions %d and Gaussian action dims %d: a policy has one action "
                       "head, set one of them to 0",
                       p->K, p->A);
    return 0;
}

int rnnd_model_check(const struct rnnd_model *m) {
    return rnnd_model_validate(m, NULL, 0);
}

bool rnnd_model_has_policy(const struct rnnd_model *m) {
    const struct rnnd_policy *p = &m->policy;
    return p->enc_layers > 0 || p->K > 0 || p->A > 0 || p->value;
}

static int core_input(const struct rnnd_model *m) {
    const struct rnnd_policy *p = &m->policy;
    return p->enc_layers > 0 ? p->enc_width[p->enc_layers - 1] : m->I;
}

struct rnnd_model rnnd_model_core(const struct rnnd_model *m) {
    return (struct rnnd_model){
        .cell = m->cell, .compute = m->compute, .I = core_input(m), .H = m->H, .L = m->L};
}

int rnnd_model_gates(const struct rnnd_model *m) {
    return m->cell == RNND_CELL_LSTM ? 4 : 3;
}

int rnnd_model_layer_input(const struct rnnd_model *m, int l) {
    return l == 0 ? core_input(m) : m->H;
}

int rnnd_model_encoder_input(const struct rnnd_model *m, int j) {
    return j == 0 ? m->I : m->policy.enc_width[j - 1];
}

int rnnd_model_encoder_widest(const struct rnnd_model *m) {
    int w = m->I;
    for (int j = 0; j < m->policy.enc_layers; j++)
        w = m->policy.enc_width[j] > w ? m->policy.enc_width[j] : w;
    return w;
}

int rnnd_model_encoder_acts(const struct rnnd_model *m) {
    int n = 0;
    for (int j = 0; j < m->policy.enc_layers; j++)
        n += m->policy.enc_width[j];
    return n;
}

static size_t layer_param_count(const struct rnnd_model *m, int l) {
    size_t gh = (size_t)rnnd_model_gates(m) * (size_t)m->H;
    return gh * (size_t)rnnd_model_layer_input(m, l) + gh * (size_t)m->H + 2 * gh;
}

static size_t core_param_count(const struct rnnd_model *m) {
    size_t n = 0;
    for (int l = 0; l < m->L; l++)
        n += layer_param_count(m, l);
    return n;
}

// The policy's tensors, in order, with offsets after the core's; returns how many (at most
// RNND_MAX_PARAM_TENSORS - 4 * RNND_MAX_LAYERS). The order is rnnd.torch.Policy's state_dict:
// its own Parameters first (the core's, then action_log_std), then its submodules.
static int policy_layout(const struct rnnd_model *m, struct rnnd_param_tensor *t) {
    const struct rnnd_policy *p = &m->policy;
    size_t offset = core_param_count(m);
    int n = 0;
#define ADD(rows, cols, ...)                                                                       \
    do {                                                                                           \
        struct rnnd_param_tensor *o = &t[n++];                                                     \
        memset(o, 0, sizeof(*o));                                                                  \
        snprintf(o->name, sizeof(o->name), __VA_ARGS__);                                           \
        o->offset = offset;                                                                        \
        o->ndim = (cols) > 0 ? 2 : 1;                                                              \
        o->shape[0] = (rows);                                                                      \
        o->shape[1] = (cols);                                                                      \
        o->count = (size_t)(rows) * (size_t)((cols) > 0 ? (cols) : 1);                             \
        offset += o->count;                                                                        \
    } while (0)
    if (p->A > 0)
        ADD(p->A, 0, "action_log_std");
    for (int j = 0, in = m->I; j < p->enc_layers; in = p->enc_width[j], j++) {
        ADD(p->enc_width[j], in, "encoder.%d.weight", j);
        ADD(p->enc_width[j], 0, "encoder.%d.bias", j);
    }
    if (p->K > 0) {
        ADD(p->K, m->H, "policy_logits.weight");
        ADD(p->K, 0, "policy_logits.bias");
    }
    if (p->A > 0) {
        ADD(p->A, m->H, "action_mean.weight");
        ADD(p->A, 0, "action_mean.bias");
    }
    if (p->value) {
        ADD(1, m->H, "value.weight");
        ADD(1, 0, "value.bias");
    }
#undef ADD
    return n;
}

size_t rnnd_model_param_count(const struct rnnd_model *m) {
    struct rnnd_param_tensor t[RNND_MAX_PARAM_TENSORS];
    int n = policy_layout(m, t);
    return n ? t[n - 1].offset + t[n - 1].count : core_param_count(m);
}

int rnnd_model_param_tensors(const struct rnnd_model *m) {
    struct rnnd_param_tensor t[RNND_MAX_PARAM_TENSORS];
    return 4 * m->L + policy_layout(m, t);
}

void rnnd_model_param_tensor(const struct rnnd_model *m, int k, struct rnnd_param_tensor *out) {
    if (k >= 4 * m->L) {
        struct rnnd_param_tensor t[RNND_MAX_PARAM_TENSORS];
        policy_layout(m, t);
        *out = t[k - 4 * m->L];
        return;
    }
    static const char *const prefix[4] = {"weight_ih", "weight_hh", "bias_ih", "bias_hh"};
    int l = k / 4;
    enum rnnd_param_kind kind = (enum rnnd_param_kind)(k % 4);
    int64_t gh = (int64_t)rnnd_model_gates(m) * m->H;

    size_t offset = 0;
    for (int j = 0; j < l; j++)
        offset += layer_param_count(m, j);
    int64_t cols[4] = {rnnd_model_layer_input(m, l), m->H, 0, 0};
    for (int j = 0; j < (int)kind; j++)
        offset += (size_t)(gh * (cols[j] ? cols[j] : 1));

    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s_l%d", prefix[kind], l);
    out->offset = offset;
    out->shape[0] = gh;
    if (cols[kind]) {
        out->ndim = 2;
        out->shape[1] = cols[kind];
        out->count = (size_t)(gh * cols[kind]);
    } else {
        out->ndim = 1;
        out->count = (size_t)gh;
    }
}

int rnnd_model_param_find(const struct rnnd_model *m, const char *name) {
    struct rnnd_param_tensor t;
    for (int k = 0; k < rnnd_model_param_tensors(m); k++) {
        rnnd_model_param_tensor(m, k, &t);
        if (strcmp(t.name, name) == 0)
            return k;
    }
    return RNND_ENOTFOUND;
}

size_t rnnd_model_param_offset(const struct rnnd_model *m, const char *name) {
    struct rnnd_param_tensor t;
    int k = rnnd_model_param_find(m, name);
    if (k < 0) { // a caller's bug: the model's parts were checked before
        fprintf(stderr, "rnnd: the model has no parameter %s\n", name);
        abort();
    }
    rnnd_model_param_tensor(m, k, &t);
    return t.offset;
}

// splitmix64: a tiny, well-mixed generator; enough for weight initialisation.
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float uniform_pm(uint64_t *s, float bound) {
    double u = (double)(splitmix64(s) >> 11) * 0x1.0p-53; // [0, 1)
    return (float)((2.0 * u - 1.0) * bound);
}

void rnnd_model_init_params(const struct rnnd_model *m, uint64_t seed, float *params) {
    float bound = 1.0f / sqrtf((float)m->H);
    uint64_t s = seed;
    size_t n = core_param_count(m);
    for (size_t i = 0; i < n; i++)
        params[i] = uniform_pm(&s, bound);
    // The policy's Linears continue the same stream; each bias follows its weight (fan_in).
    struct rnnd_param_tensor t[RNND_MAX_PARAM_TENSORS];
    int np = policy_layout(m, t);
    for (int k = 0; k < np; k++) {
        if (strcmp(t[k].name, "action_log_std") == 0) {
            memset(params + t[k].offset, 0, t[k].count * sizeof(float));
            continue;
        }
        if (t[k].ndim == 2)
            bound = 1.0f / sqrtf((float)t[k].shape[1]);
        for (size_t i = 0; i < t[k].count; i++)
            params[t[k].offset + i] = uniform_pm(&s, bound);
    }
}

// ---------------------------------------------------------------------------------------------
// Argument checks

int rnnd_seq_check(const struct rnnd_seq *seq, const struct rnnd_model *m) {
    if (seq == NULL || rnnd_model_check(m) != 0 || rnnd_model_has_policy(m))
        return RNND_EINVAL;
    if (seq->B < 1 || seq->T < 1 || seq->x == NULL || seq->is_init == NULL)
        return RNND_EINVAL;
    // Keep B*T*max(I, G*H) inside what a size_t and an int index of rows can address.
    if ((int64_t)seq->B * seq->T > INT32_MAX / 4)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (seq->h0 && seq->hidden)
        return RNND_EINVAL;
    if (lstm) {
        if ((seq->h0 == NULL) != (seq->c0 == NULL) || (seq->hidden == NULL) != (seq->cell == NULL))
            return RNND_EINVAL;
    } else if (seq->c0 || seq->cell) {
        return RNND_EINVAL;
    }
    return 0;
}

int rnnd_step_check(const struct rnnd_step *step, const struct rnnd_model *m) {
    if (step == NULL || rnnd_model_check(m) != 0 || rnnd_model_has_policy(m))
        return RNND_EINVAL;
    if (step->B < 1 || step->x == NULL || step->slots == NULL || step->slots_new == NULL ||
        step->state_h == NULL || step->out == NULL)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (lstm != (step->state_c != NULL))
        return RNND_EINVAL;
    if (!lstm && step->c_before)
        return RNND_EINVAL;
    return 0;
}

int rnnd_encoder_check(const struct rnnd_model *m, int N, const void *out, const void *in) {
    if (rnnd_model_check(m) != 0 || m->policy.enc_layers < 1 || N < 1 || !out || !in)
        return RNND_EINVAL;
    // Keep N times any width inside what an int row index and a size_t can address.
    if ((int64_t)N * rnnd_model_encoder_acts(m) > (int64_t)INT32_MAX * 4)
        return RNND_EINVAL;
    return 0;
}

int rnnd_heads_check(const struct rnnd_heads *hd, const float *h, int N,
                     const struct rnnd_model *m) {
    if (hd == NULL || h == NULL || N < 1 || rnnd_model_check(m) != 0)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    if ((hd->logits && p->K == 0) || ((hd->mean || hd->log_std) && p->A == 0) ||
        (hd->value && !p->value))
        return RNND_EINVAL;
    return 0;
}

int rnnd_actions_check(const struct rnnd_actions *a, const struct rnnd_model *m, bool sample) {
    if (a == NULL || rnnd_model_check(m) != 0 || a->N < 1)
        return RNND_EINVAL;
    const struct rnnd_policy *p = &m->policy;
    if (p->K > 0 && (!a->logits || !a->index))
        return RNND_EINVAL;
    if (p->A > 0 && (!a->mean || !a->action))
        return RNND_EINVAL;
    if (p->K == 0 && p->A == 0)
        return RNND_EINVAL;
    if (sample && (!a->env_ids || !a->steps))
        return RNND_EINVAL;
    return 0;
}

int rnnd_traj_check(const struct rnnd_traj_store *st, const struct rnnd_traj_rows *r,
                    const struct rnnd_model *m, bool write) {
    if (st == NULL || r == NULL || rnnd_model_check(m) != 0)
        return RNND_EINVAL;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (r->n < 1 || r->rows == NULL || st->R < 1 || st->E < 0 ||
        (st->E > 0) != (st->extras != NULL))
        return RNND_EINVAL;
    if (!st->obs || !st->h || lstm != (st->c != NULL) || !st->is_init || !st->version)
        return RNND_EINVAL;
    if ((r->extras && st->E == 0) || (r->c && !lstm))
        return RNND_EINVAL;
    if (write && (!r->obs || (st->E && !r->extras) || !r->h || (lstm && !r->c) || !r->is_init ||
                  !r->version))
        return RNND_EINVAL;
    return 0;
}

int rnnd_optim_check(const struct rnnd_optim *o) {
    if (o == NULL)
        return RNND_EINVAL;
    if (o->kind != RNND_OPTIM_ADAM && o->kind != RNND_OPTIM_SGD)
        return RNND_EINVAL;
    if (!isfinite(o->lr) || o->lr <= 0.0f)
        return RNND_EINVAL;
    if (!(o->weight_decay >= 0.0f) || !isfinite(o->weight_decay))
        return RNND_EINVAL;
    if (isnan(o->max_grad_norm))
        return RNND_EINVAL;
    if (o->kind == RNND_OPTIM_ADAM) {
        if (!(o->beta1 >= 0.0f && o->beta1 < 1.0f) || !(o->beta2 >= 0.0f && o->beta2 < 1.0f))
            return RNND_EINVAL;
        if (!(o->eps > 0.0f) || !isfinite(o->eps))
            return RNND_EINVAL;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Backends

void rnnd_backend_free(struct rnnd_backend *b) {
    if (b == NULL || b->ops == NULL)
        return;
    b->ops->destroy(b->ctx);
    memset(b, 0, sizeof(*b));
}

#ifndef RNND_HAVE_CUDA
// A build without CUDA still links callers of the CUDA backend; they learn at run time.
int rnnd_backend_cuda_init(struct rnnd_backend *b, int device) {
    (void)device;
    memset(b, 0, sizeof(*b));
    return RNND_ENOTSUP;
}
#endif

// ---------------------------------------------------------------------------------------------
// Wire dtypes: fp32 <-> bf16 / fp16, round to nearest even.

static inline uint32_t f32_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    return x;
}

static inline float bits_f32(uint32_t x) {
    float f;
    memcpy(&f, &x, sizeof(f));
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) // NaN stays a (quiet) NaN
        return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline uint16_t to_f16(float f) {
    uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) // Inf, NaN (quiet)
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) // 65520 and above round to Inf
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) { // a normal half: rebias the exponent, drop 13 mantissa bits
        uint32_t r = ax - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (ax < 0x33000000u) // below half the smallest subnormal (2^-25): zero
        return (uint16_t)sign;
    // A subnormal half: the value in units of 2^-24 is m >> shift, rounded to nearest even.
    uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return (uint16_t)(sign | q);
}

static inline float from_bf16(uint16_t h) {
    return bits_f32((uint32_t)h << 16);
}

static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)
        return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e)
        return bits_f32(sign | ((e + 112) << 23) | (m << 13));
    if (m == 0)
        return bits_f32(sign);
    e = 113; // a subnormal: normalise
    while (!(m & 0x400u)) {
        m <<= 1;
        e--;
    }
    return bits_f32(sign | (e << 23) | ((m & 0x3ffu) << 13));
}

uint16_t rnnd_f32_to_bf16(float f) {
    return to_bf16(f);
}

uint16_t rnnd_f32_to_f16(float f) {
    return to_f16(f);
}

float rnnd_bf16_to_f32(uint16_t h) {
    return from_bf16(h);
}

float rnnd_f16_to_f32(uint16_t h) {
    return from_f16(h);
}

void rnnd_cast_host(void *dst, enum rnnd_ftype dst_dtype, const void *src,
                    enum rnnd_ftype src_dtype, size_t n) {
    if (dst_dtype == src_dtype) {
        memmove(dst, src, n * rnnd_ftype_bytes(dst_dtype));
        return;
    }
    float *fd = dst;
    const float *fs = src;
    uint16_t *hd = dst;
    const uint16_t *hs = src;
    if (src_dtype == RNND_FTYPE_F32 && dst_dtype == RNND_FTYPE_BF16)
        for (size_t i = 0; i < n; i++)
            hd[i] = to_bf16(fs[i]);
    else if (src_dtype == RNND_FTYPE_F32 && dst_dtype == RNND_FTYPE_F16)
        for (size_t i = 0; i < n; i++)
            hd[i] = to_f16(fs[i]);
    else if (src_dtype == RNND_FTYPE_BF16 && dst_dtype == RNND_FTYPE_F32)
        for (size_t i = 0; i < n; i++)
            fd[i] = from_bf16(hs[i]);
    else if (src_dtype == RNND_FTYPE_F16 && dst_dtype == RNND_FTYPE_F32)
        for (size_t i = 0; i < n; i++)
            fd[i] = from_f16(hs[i]);
}

// Eight bytes at a time, a block of them before any branch: within each lane (one element),
// (v & exp) plus exp's lowest bit carries into the lane's top bit only when every exponent bit
// is set. Only a block with a hit is scanned again element by element.
size_t rnnd_first_nonfinite(const void *p, enum rnnd_ftype ft, size_t n) {
    const uint8_t *b = p;
    const size_t esize = rnnd_ftype_bytes(ft);
    const uint32_t exp = ft == RNND_FTYPE_F32    ? 0x7f800000u
                         : ft == RNND_FTYPE_BF16 ? 0x7f80u
                                                 : 0x7c00u;
    const uint64_t lanes = esize == 2 ? 0x0001000100010001ull : 0x0000000100000001ull;
    const uint64_t m = exp * lanes, add = (exp & (~exp + 1)) * lanes,
                   top = (esize == 2 ? 0x8000ull : 0x80000000ull) * lanes;
    const size_t words = n * esize / 8, block = 512;
    size_t from = 0;
    for (size_t w0 = 0; w0 < words; w0 += block) {
        size_t w1 = w0 + block < words ? w0 + block : words;
        uint64_t hit = 0;
        for (size_t w = w0; w < w1; w++) {
            uint64_t v;
            memcpy(&v, b + 8 * w, 8);
            hit |= ((v & m) + add) & top;
        }
        if (hit)
            break;
        from = w1 * 8 / esize;
    }
    for (size_t i = from; i < n; i++) {
        uint32_t v = 0;
        memcpy(&v, b + esize * i, esize);
        if ((v & exp) == exp)
            return i;
    }
    return n;
}
