/*
 * client.c: the blocking rnnd client (rnnd_client.h) on gRPC C core and protobuf-c.
 *
 * Every unary call is one grpc_call with its own pluck completion queue and a single batch of all
 * six ops (docs/grpc_notes.md), so any number of threads may share a channel, none a queue.
 * Requests are translated into protobuf-c structs that point at the caller's memory (nothing is
 * copied before packing); replies are unpacked and copied into library-owned structs, so no
 * protobuf-c type leaks out of this file. With shared memory (see its section), the request's
 * tensors are copied into the region instead and the reply's tensors copied out of it.
 */
#include "rnnd_client.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "client_internal.h"
#include "grpc/health/v1/health.pb-c.h"
#include "grpc_start.h"
#include "rnnd/v1/rnnd.pb-c.h"

// How long rnnd_client_free waits for a connection attempt in flight (see there): a live daemon
// answers within milliseconds; an unreachable one is not worth blocking on longer.
#define FREE_CONNECT_WAIT_MS 1000

// ---------------------------------------------------------------------------------------------
// Errors.

static _Thread_local struct rnnd_client_error last_err;

const struct rnnd_client_error *rnnd_client_last_error(void) {
    return &last_err;
}

// Sets the calling thread's last error: pool.c reports a worker thread's failure on the caller's.
void rnnd__client_error_set(const struct rnnd_client_error *e) {
    last_err = *e;
}

static void clear_err(void) {
    last_err.code = 0;
    last_err.grpc_status = 0;
    last_err.message[0] = '\0';
}

// Records a local failure (no gRPC status) and returns code.
static int local_err(int code, const char *fmt, ...) {
    last_err.code = code;
    last_err.grpc_status = -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_err.message, sizeof last_err.message, fmt, ap);
    va_end(ap);
    return code;
}

static const char *const status_names[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *rnnd_grpc_status_name(int s) {
    if (s < 0 || s >= (int)(sizeof status_names / sizeof status_names[0]))
        return "UNKNOWN_STATUS";
    return status_names[s];
}

static int status_to_code(grpc_status_code s) {
    switch (s) {
        case GRPC_STATUS_OK:
            return 0;
        case GRPC_STATUS_INVALID_ARGUMENT:
            return RNND_EINVAL;
        case GRPC_STATUS_FAILED_PRECONDITION:
            return RNND_EPRECOND;
        case GRPC_STATUS_NOT_FOUND:
            return RNND_ENOTFOUND;
        case GRPC_STATUS_RESOURCE_EXHAUSTED:
            return RNND_EFULL;
        case GRPC_STATUS_UNAVAILABLE:
            return RNND_EUNAVAIL;
        case GRPC_STATUS_UNAUTHENTICATED:
            return RNND_EAUTH;
        case GRPC_STATUS_CANCELLED:
        case GRPC_STATUS_DEADLINE_EXCEEDED:
            return RNND_ECANCELED;
        case GRPC_STATUS_UNIMPLEMENTED:
            return RNND_ENOTSUP;
        default:
            return RNND_EIO;
    }
}

// Records a call's final status (details may be an empty slice) and returns its code. For
// UNAVAILABLE (no connection, or the daemon draining) the message asks whether rnnd runs at the
// target, the first thing to check.
static int status_err(grpc_status_code s, grpc_slice details, const char *error_string,
                      const char *target) {
    last_err.grpc_status = (int)s;
    last_err.code = status_to_code(s);
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof last_err.message)
        n = sizeof last_err.message - 1;
    memcpy(last_err.message, GRPC_SLICE_START_PTR(details), n);
    last_err.message[n] = '\0';
    if (n == 0 && error_string)
        n = (size_t)snprintf(last_err.message, sizeof last_err.message, "%s", error_string);
    if (s == GRPC_STATUS_UNAVAILABLE && n < sizeof last_err.message)
        snprintf(last_err.message + n, sizeof last_err.message - n, " (is rnnd running at %s?)",
                 target);
    return last_err.code;
}

// ---------------------------------------------------------------------------------------------
// Tensors.

size_t rnnd_dtype_size(enum rnnd_dtype dtype) {
    switch (dtype) {
        case RNND_DTYPE_FLOAT32:
            return 4;
        case RNND_DTYPE_BFLOAT16:
        case RNND_DTYPE_FLOAT16:
            return 2;
        case RNND_DTYPE_BOOL:
            return 1;
        case RNND_DTYPE_INT64:
            return 8;
        default:
            return 0;
    }
}

const char *rnnd_dtype_name(enum rnnd_dtype dtype) {
    switch (dtype) {
        case RNND_DTYPE_FLOAT32:
            return "float32";
        case RNND_DTYPE_BFLOAT16:
            return "bfloat16";
        case RNND_DTYPE_FLOAT16:
            return "float16";
        case RNND_DTYPE_BOOL:
            return "bool";
        case RNND_DTYPE_INT64:
            return "int64";
        case RNND_DTYPE_UNSPECIFIED:
            return "unspecified";
        default:
            return "unknown";
    }
}

int64_t rnnd_tensor_numel(const struct rnnd_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

struct rnnd_tensor rnnd_tensor_view(enum rnnd_dtype dtype, void *data, int ndim,
                                    const int64_t *shape) {
    struct rnnd_tensor t = {.present = true, .dtype = dtype, .data = data};
    if (ndim > RNND_TENSOR_MAX_DIMS)
        ndim = RNND_TENSOR_MAX_DIMS;
    t.ndim = ndim < 0 ? 0 : ndim;
    for (int d = 0; d < t.ndim; d++)
        t.shape[d] = shape[d];
    int64_t n = rnnd_tensor_numel(&t);
    t.nbytes = n > 0 ? (size_t)n * rnnd_dtype_size(dtype) : 0;
    return t;
}

struct rnnd_tensor rnnd_tensor_f32(float *data, int ndim, int64_t d0, int64_t d1, int64_t d2,
                                   int64_t d3) {
    int64_t shape[4] = {d0, d1, d2, d3};
    return rnnd_tensor_view(RNND_DTYPE_FLOAT32, data, ndim > 4 ? 4 : ndim, shape);
}

void rnnd_tensor_free(struct rnnd_tensor *t) {
    if (!t)
        return;
    free(t->data);
    memset(t, 0, sizeof *t);
}

void rnnd_named_tensors_free(struct rnnd_named_tensors *l) {
    if (!l)
        return;
    for (size_t i = 0; i < l->n; i++) {
        free(l->v[i].name);
        rnnd_tensor_free(&l->v[i].tensor);
    }
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

const struct rnnd_tensor *rnnd_named_tensors_find(const struct rnnd_named_tensors *l,
                                                  const char *name) {
    for (size_t i = 0; i < l->n; i++)
        if (l->v[i].name && strcmp(l->v[i].name, name) == 0)
            return &l->v[i].tensor;
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Shared memory.
//
// One memfd per client, registered once (RegisterRegion). Each call takes a span of it (first
// fit; the key's first 64 bytes stay reserved) for its request tensors followed by its
// reply_region, and gives the span back once the reply has been copied out; a call that finds
// no room goes as bytes. A StepStream holds the spans of its requests in flight.

#define SHM_ALIGN   64
#define SHM_SPANS   64 // calls in flight through the region at once
#define SHM_KEY     32 // bytes of the key at the region's start
#define SHM_TENSORS 8  // request tensors per call

struct shm {
    int fd;
    uint8_t *base;
    size_t size;
    uint64_t id;
    struct rnnd_model m; // for the size of replies
    size_t P;
    int64_t E;
    pthread_mutex_t lock;
    size_t off[SHM_SPANS], len[SHM_SPANS]; // spans in use, by offset
    int n;
};

// One call's share of the region.
struct shm_call {
    struct shm *s; // NULL: the call goes as bytes
    size_t off, len;
    size_t at; // the next request tensor's offset; after them, the reply_region
    Rnnd__V1__RegionSpan spans[SHM_TENSORS];
    int nspans;
    Rnnd__V1__RegionSpan reply;
};

static size_t align_up(size_t n) {
    return (n + SHM_ALIGN - 1) / SHM_ALIGN * SHM_ALIGN;
}

// Takes `need` bytes of s for a call (sc->s stays NULL when s is NULL or full).
static void shm_take(struct shm *s, size_t need, struct shm_call *sc) {
    memset(sc, 0, sizeof *sc);
    if (!s)
        return;
    need = align_up(need);
    pthread_mutex_lock(&s->lock);
    size_t at = SHM_ALIGN;
    int i = 0;
    for (; i < s->n && s->off[i] - at < need; i++)
        at = s->off[i] + s->len[i];
    if (s->n < SHM_SPANS && at <= s->size && s->size - at >= need) {
        memmove(&s->off[i + 1], &s->off[i], (size_t)(s->n - i) * sizeof s->off[0]);
        memmove(&s->len[i + 1], &s->len[i], (size_t)(s->n - i) * sizeof s->len[0]);
        s->off[i] = at;
        s->len[i] = need;
        s->n++;
        *sc = (struct shm_call){.s = s, .off = at, .len = need, .at = at};
    }
    pthread_mutex_unlock(&s->lock);
}

static void shm_give(struct shm_call *sc) {
    struct shm *s = sc->s;
    if (!s)
        return;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->n; i++) {
        if (s->off[i] == sc->off) {
            memmove(&s->off[i], &s->off[i + 1], (size_t)(s->n - i - 1) * sizeof s->off[0]);
            memmove(&s->len[i], &s->len[i + 1], (size_t)(s->n - i - 1) * sizeof s->len[0]);
            s->n--;
            break;
        }
    }
    pthread_mutex_unlock(&s->lock);
    sc->s = NULL;
}

// Bytes a call's span needs: its present request tensors, then its reply.
static size_t shm_need(const struct rnnd_tensor *const *in, int n, size_t reply) {
    size_t need = reply;
    for (int i = 0; i < n; i++)
        need += in[i]->present ? align_up(in[i]->nbytes) : 0;
    return need;
}

// The call's reply_region: what is left of its span after the request tensors.
static Rnnd__V1__RegionSpan *shm_reply(struct shm_call *sc) {
    if (!sc->s)
        return NULL;
    rnnd__v1__region_span__init(&sc->reply);
    sc->reply.region = sc->s->id;
    sc->reply.offset = sc->at;
    sc->reply.nbytes = sc->off + sc->len - sc->at;
    return &sc->reply;
}

// Points pb at t: at t's memory (no copy), or, through shared memory (sc->s), at a copy of it
// in the call's span. Returns pb, or NULL when t is not present.
static Rnnd__V1__Tensor *pb_tensor_in(struct shm_call *sc, const struct rnnd_tensor *t,
                                      Rnnd__V1__Tensor *pb) {
    if (!t->present)
        return NULL;
    rnnd__v1__tensor__init(pb);
    pb->n_shape = (size_t)t->ndim;
    pb->shape = (int64_t *)t->shape;
    pb->dtype = (Rnnd__V1__DType)t->dtype;
    if (sc && sc->s && sc->nspans < SHM_TENSORS) {
        Rnnd__V1__RegionSpan *sp = &sc->spans[sc->nspans++];
        rnnd__v1__region_span__init(sp);
        sp->region = sc->s->id;
        sp->offset = sc->at;
        sp->nbytes = t->nbytes;
        if (t->nbytes)
            memcpy(sc->s->base + sc->at, t->data, t->nbytes);
        sc->at += align_up(t->nbytes);
        pb->region = sp;
        return pb;
    }
    pb->data.len = t->nbytes;
    pb->data.data = t->data;
    return pb;
}

static Rnnd__V1__Tensor *pb_tensor(const struct rnnd_tensor *t, Rnnd__V1__Tensor *pb) {
    return pb_tensor_in(NULL, t, pb);
}

// pb as an owned tensor (not present when pb is NULL). Bytes in the message move over without a
// copy: protobuf-c allocated them on their own with malloc, as rnnd_tensor_free frees them, and
// the message loses them (it is freed unread). A reply written into shared memory (s) is copied.
static int take_tensor(const struct shm *s, Rnnd__V1__Tensor *pb, struct rnnd_tensor *t) {
    memset(t, 0, sizeof *t);
    if (!pb)
        return 0;
    if (pb->n_shape > RNND_TENSOR_MAX_DIMS)
        return local_err(RNND_ECORRUPT, "reply tensor has %zu dims (at most %d supported)",
                         pb->n_shape, RNND_TENSOR_MAX_DIMS);
    const uint8_t *from = pb->data.data;
    size_t n = pb->data.len;
    if (pb->region) {
        const Rnnd__V1__RegionSpan *sp = pb->region;
        if (!s || sp->region != s->id || sp->offset > s->size || sp->nbytes > s->size - sp->offset)
            return local_err(RNND_ECORRUPT,
                             "a reply tensor names region %llu [%llu, +%llu), "
                             "which is not this client's",
                             (unsigned long long)sp->region, (unsigned long long)sp->offset,
                             (unsigned long long)sp->nbytes);
        from = s->base + sp->offset;
        n = (size_t)sp->nbytes;
    }
    t->present = true;
    t->dtype = (enum rnnd_dtype)pb->dtype;
    t->ndim = (int)pb->n_shape;
    for (size_t d = 0; d < pb->n_shape; d++)
        t->shape[d] = pb->shape[d];
    t->nbytes = n;
    if (!pb->region && n) {
        t->data = pb->data.data;
        pb->data = (ProtobufCBinaryData){0};
        return 0;
    }
    t->data = malloc(n ? n : 1);
    if (!t->data) {
        memset(t, 0, sizeof *t);
        return local_err(RNND_ENOMEM, "out of memory copying a %zu-byte tensor", n);
    }
    if (n)
        memcpy(t->data, from, n);
    return 0;
}

static int copy_named(const struct shm *s, Rnnd__V1__NamedTensor *const *v, size_t n,
                      struct rnnd_named_tensors *out) {
    out->n = 0;
    out->v = calloc(n ? n : 1, sizeof *out->v);
    if (!out->v)
        return local_err(RNND_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        out->v[i].name = strdup(v[i]->name ? v[i]->name : "");
        out->n = i + 1;
        int err = out->v[i].name ? take_tensor(s, v[i]->tensor, &out->v[i].tensor)
                                 : local_err(RNND_ENOMEM, "out of memory");
        if (err) {
            rnnd_named_tensors_free(out);
            return err;
        }
    }
    return 0;
}

// Builds protobuf-c named tensors over l (no copies). Free the two arrays with free().
static int pb_named(const struct rnnd_named_tensors *l, Rnnd__V1__NamedTensor ***ptrs_out,
                    Rnnd__V1__NamedTensor **nts_out, Rnnd__V1__Tensor **ts_out) {
    size_t n = l ? l->n : 0;
    Rnnd__V1__NamedTensor **ptrs = calloc(n ? n : 1, sizeof *ptrs);
    Rnnd__V1__NamedTensor *nts = calloc(n ? n : 1, sizeof *nts);
    Rnnd__V1__Tensor *ts = calloc(n ? n : 1, sizeof *ts);
    if (!ptrs || !nts || !ts) {
        free(ptrs);
        free(nts);
        free(ts);
        return local_err(RNND_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        rnnd__v1__named_tensor__init(&nts[i]);
        nts[i].name = l->v[i].name ? l->v[i].name : (char *)"";
        nts[i].tensor = pb_tensor(&l->v[i].tensor, &ts[i]);
        ptrs[i] = &nts[i];
    }
    *ptrs_out = ptrs;
    *nts_out = nts;
    *ts_out = ts;
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The client.

enum method {
    M_INFO,
    M_STEP,
    M_STEP_STREAM,
    M_END,
    M_FORWARD,
    M_BACKWARD,
    M_APPLY,
    M_GETW,
    M_SETW,
    M_SAVE,
    M_HEALTH,
    M_WATCH,
    M_REGISTER,
    M_RELEASE,
    M_COUNT
};

static const char *const method_paths[M_COUNT] = {
    [M_INFO] = "/rnnd.v1.Rnn/GetModelInfo",       [M_STEP] = "/rnnd.v1.Rnn/Step",
    [M_STEP_STREAM] = "/rnnd.v1.Rnn/StepStream",  [M_END] = "/rnnd.v1.Rnn/EndEpisodes",
    [M_FORWARD] = "/rnnd.v1.Rnn/Forward",         [M_BACKWARD] = "/rnnd.v1.Rnn/Backward",
    [M_APPLY] = "/rnnd.v1.Rnn/ApplyGradients",    [M_GETW] = "/rnnd.v1.Rnn/GetWeights",
    [M_SETW] = "/rnnd.v1.Rnn/SetWeights",         [M_SAVE] = "/rnnd.v1.Rnn/SaveCheckpoint",
    [M_HEALTH] = "/grpc.health.v1.Health/Check",  [M_WATCH] = "/grpc.health.v1.Health/Watch",
    [M_REGISTER] = "/rnnd.v1.Rnn/RegisterRegion", [M_RELEASE] = "/rnnd.v1.Rnn/ReleaseRegion",
};

struct rnnd_client {
    char *target; // HOST:PORT as given, for error messages
    grpc_channel *ch;
    struct shm *shm;    // NULL: tensors travel as bytes
    void *reg[M_COUNT]; // registered-call handles: the method path is parsed once
    int64_t timeout_ms;
    size_t n_md;         // 0 or 1
    grpc_metadata md[1]; // "authorization: Bearer <token>"
};

static grpc_arg int_arg(const char *key, int value) {
    grpc_arg a;
    memset(&a, 0, sizeof a);
    a.type = GRPC_ARG_INTEGER;
    a.key = (char *)key;
    a.value.integer = value;
    return a;
}

int rnnd_client_init(const struct rnnd_client_opts *opts, struct rnnd_client **out) {
    *out = NULL;
    clear_err();
    if (!opts || !opts->target || !opts->target[0])
        return local_err(RNND_EINVAL, "no target given (want HOST:PORT)");
    if ((opts->tls_cert_pem == NULL) != (opts->tls_key_pem == NULL))
        return local_err(RNND_EINVAL, "a TLS client certificate needs its key and vice versa");
    struct rnnd_client *c = calloc(1, sizeof *c);
    if (!c)
        return local_err(RNND_ENOMEM, "out of memory");
    c->target = strdup(opts->target);
    if (!c->target) {
        free(c);
        return local_err(RNND_ENOMEM, "out of memory");
    }
    rnnd_grpc_init();
    c->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : 30000;

    int max = opts->max_message_bytes > 0 && opts->max_message_bytes < INT32_MAX
                  ? (int)opts->max_message_bytes
                  : -1;
    grpc_arg args[4];
    memset(args, 0, sizeof args);
    args[0] = int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max);
    args[1] = int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max);
    // One client, one connection: without this, channels with equal args share a subchannel,
    // and a load generator's "connections" would be one TCP connection.
    args[2] = int_arg(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    size_t nargs = 3;
    if (opts->tls_server_name) {
        args[nargs].type = GRPC_ARG_STRING;
        args[nargs].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[nargs++].value.string = (char *)opts->tls_server_name;
    }
    grpc_channel_args cargs = {.num_args = nargs, .args = args};

    grpc_channel_credentials *creds;
    if (opts->tls_root_pem || opts->tls_cert_pem) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = opts->tls_key_pem,
                                           .cert_chain = opts->tls_cert_pem};
        creds = grpc_ssl_credentials_create(opts->tls_root_pem, opts->tls_cert_pem ? &pair : NULL,
                                            NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    c->ch = grpc_channel_create(opts->target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!c->ch) {
        grpc_shutdown();
        free(c->target);
        free(c);
        return local_err(RNND_EINVAL, "cannot create a channel to %s", opts->target);
    }
    for (int m = 0; m < M_COUNT; m++)
        c->reg[m] = grpc_channel_register_call(c->ch, method_paths[m], NULL, NULL);
    if (opts->token) {
        size_t n = strlen(opts->token) + 8;
        char *v = malloc(n);
        if (!v) {
            rnnd_client_free(c);
            return local_err(RNND_ENOMEM, "out of memory");
        }
        snprintf(v, n, "Bearer %s", opts->token);
        c->md[0].key = grpc_slice_from_static_string("authorization");
        c->md[0].value = grpc_slice_from_copied_string(v);
        free(v);
        c->n_md = 1;
    }
    *out = c;
    return 0;
}

static bool awaiting(grpc_connectivity_state st, bool want_ready) {
    return want_ready ? st != GRPC_CHANNEL_READY : st == GRPC_CHANNEL_CONNECTING;
}

// Waits at most timeout_ms until the channel is READY (want_ready) or else no longer CONNECTING,
// and returns its state then; with connect, an idle channel starts connecting.
static grpc_connectivity_state await_state(grpc_channel *ch, bool connect, bool want_ready,
                                           int64_t timeout_ms) {
    grpc_connectivity_state st = grpc_channel_check_connectivity_state(ch, connect);
    if (!awaiting(st, want_ready)) // the common case in rnnd_client_free: no queue to make
        return st;
    gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    while (awaiting(st, want_ready)) {
        grpc_channel_watch_connectivity_state(ch, st, deadline, cq, NULL);
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (!ev.success)
            break; // deadline
        st = grpc_channel_check_connectivity_state(ch, connect);
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    return st;
}

static void shm_release(struct rnnd_client *c);

void rnnd_client_free(struct rnnd_client *c) {
    if (!c)
        return;
    shm_release(c);
    if (c->n_md)
        grpc_slice_unref(c->md[0].value);
    if (c->ch) {
        // gRPC 1.51 (Debian 12's) leaks the transport of a connection that completes after its
        // channel was destroyed (fixed upstream in grpc/grpc#32071, January 2023): the socket
        // stays open, ESTABLISHED, here and in the daemon, for the life of the process. A call
        // that gave up on its deadline while connecting leaves such a connect in flight, so let
        // it finish first.
        await_state(c->ch, false, false, FREE_CONNECT_WAIT_MS);
        grpc_channel_destroy(c->ch);
    }
    free(c->target);
    free(c);
    grpc_shutdown();
}

int rnnd_client_wait_connected(struct rnnd_client *c, int64_t timeout_ms) {
    clear_err();
    if (await_state(c->ch, true, true, timeout_ms) != GRPC_CHANNEL_READY)
        return local_err(RNND_EUNAVAIL,
                         "not connected to %s after %lld ms (is rnnd running at %s?)", c->target,
                         (long long)timeout_ms, c->target);
    return 0;
}

static gpr_timespec deadline_ms(int64_t ms) {
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void cq_destroy(grpc_completion_queue *cq) {
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
}

static grpc_call *call_create(struct rnnd_client *c, int m, const char *path,
                              grpc_completion_queue *cq, gpr_timespec deadline) {
    if (m >= 0)
        return grpc_channel_create_registered_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                                   c->reg[m], deadline, NULL);
    return grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                    grpc_slice_from_static_string(path), NULL, deadline, NULL);
}

// Copies a received byte buffer into one slice and destroys the buffer.
static grpc_slice buffer_take(grpc_byte_buffer *bb) {
    grpc_byte_buffer_reader r;
    grpc_slice s = grpc_empty_slice();
    if (grpc_byte_buffer_reader_init(&r, bb)) {
        s = grpc_byte_buffer_reader_readall(&r);
        grpc_byte_buffer_reader_destroy(&r);
    }
    grpc_byte_buffer_destroy(bb);
    return s;
}

// One unary call of method m (or path when m < 0): sends req_len bytes and, on OK, returns the
// reply in *reply (unref it). Returns 0 or the mapped status.
static int unary(struct rnnd_client *c, int m, const char *path, const uint8_t *req, size_t req_len,
                 grpc_slice *reply) {
    *reply = grpc_empty_slice();
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = call_create(c, m, path, cq, deadline_ms(c->timeout_ms));
    if (!call) {
        cq_destroy(cq);
        return local_err(RNND_EIO, "cannot create a call");
    }
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)req, req_len);
    grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);

    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_byte_buffer *recv = NULL;
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *error_string = NULL;

    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->n_md;
    ops[0].data.send_initial_metadata.metadata = c->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    ops[5].data.recv_status_on_client.error_string = &error_string;

    int err = 0;
    grpc_call_error ce = grpc_call_start_batch(call, ops, 6, (void *)1, NULL);
    if (ce != GRPC_CALL_OK) {
        err = local_err(RNND_EIO, "grpc_call_start_batch: %d", (int)ce);
    } else {
        grpc_event ev =
            grpc_completion_queue_pluck(cq, (void *)1, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            err = local_err(RNND_EIO, "completion queue event %d", (int)ev.type);
        else if (status != GRPC_STATUS_OK)
            err = status_err(status, details, error_string, c->target);
        else if (!recv)
            err = local_err(RNND_ECORRUPT, "OK status without a reply message");
    }
    if (recv) {
        if (err == 0)
            *reply = buffer_take(recv);
        else
            grpc_byte_buffer_destroy(recv);
    }
    grpc_byte_buffer_destroy(send);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_slice_unref(details);
    gpr_free((void *)error_string);
    grpc_call_unref(call);
    cq_destroy(cq);
    return err;
}

// Packs req, calls m and unpacks the reply as desc into *out (free with
// protobuf_c_message_free_unpacked).
static int call_pb(struct rnnd_client *c, int m, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc, ProtobufCMessage **out) {
    *out = NULL;
    clear_err();
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t stackbuf[4096];
    uint8_t *buf = len <= sizeof stackbuf ? stackbuf : malloc(len);
    if (!buf)
        return local_err(RNND_ENOMEM, "out of memory packing a %zu-byte request", len);
    protobuf_c_message_pack(req, buf);
    grpc_slice reply;
    int err = unary(c, m, NULL, buf, len, &reply);
    if (buf != stackbuf)
        free(buf);
    if (err)
        return err;
    *out = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(reply),
                                     GRPC_SLICE_START_PTR(reply));
    grpc_slice_unref(reply);
    if (!*out)
        return local_err(RNND_ECORRUPT, "cannot decode the %s reply", desc->name);
    return 0;
}

int rnnd_client_call_raw(struct rnnd_client *c, const char *method, const void *req, size_t req_len,
                         void **reply, size_t *reply_len) {
    clear_err();
    *reply = NULL;
    *reply_len = 0;
    grpc_slice r;
    int err = unary(c, -1, method, req, req_len, &r);
    if (err)
        return err;
    size_t n = GRPC_SLICE_LENGTH(r);
    *reply = malloc(n ? n : 1);
    if (!*reply) {
        grpc_slice_unref(r);
        return local_err(RNND_ENOMEM, "out of memory");
    }
    memcpy(*reply, GRPC_SLICE_START_PTR(r), n);
    *reply_len = n;
    grpc_slice_unref(r);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Shared memory: the region's set-up and release.

static void shm_unmap(struct shm *s) {
    if (s->base && s->base != MAP_FAILED)
        munmap(s->base, s->size);
    if (s->fd >= 0)
        close(s->fd); // drops our flock: the daemon then releases the region if we could not
    free(s);
}

int rnnd_client_shm_start(struct rnnd_client *c, size_t bytes) {
    clear_err();
    if (c->shm)
        return 0;
    bytes = align_up(bytes ? bytes : (size_t)64 << 20);
    if (bytes < 2 * SHM_ALIGN)
        bytes = 2 * SHM_ALIGN;
    // Reply sizes depend on the model.
    struct rnnd_model_info info;
    int err = rnnd_client_info(c, &info);
    if (err)
        return err;
    struct shm *s = calloc(1, sizeof *s);
    if (!s)
        return local_err(RNND_ENOMEM, "out of memory");
    s->fd = -1;
    if ((err = rnnd_model_info_to_model(&info, &s->m)) != 0) {
        shm_unmap(s);
        return err;
    }
    s->P = rnnd_model_param_count(&s->m);
    s->E = info.extras_size;
    // Sealed so that the daemon's mapping can never lose its pages; flock(LOCK_SH) held for the
    // life of the fd tells the daemon we are still there.
    uint8_t key[SHM_KEY];
    s->fd = memfd_create("rnnd-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (s->fd < 0 || ftruncate(s->fd, (off_t)bytes) != 0 ||
        fcntl(s->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
        flock(s->fd, LOCK_SH) != 0 ||
        (s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0)) == MAP_FAILED ||
        getrandom(key, sizeof key, 0) != (ssize_t)sizeof key) {
        err = local_err(RNND_EIO, "cannot create a %zu-byte shared memory region: %s", bytes,
                        strerror(errno));
        shm_unmap(s);
        return err;
    }
    s->size = bytes;
    memcpy(s->base, key, sizeof key);
    Rnnd__V1__MemfdRegion mf = RNND__V1__MEMFD_REGION__INIT;
    mf.pid = (uint32_t)getpid();
    mf.fd = s->fd;
    mf.size = bytes;
    mf.key.len = sizeof key;
    mf.key.data = key;
    Rnnd__V1__RegisterRegionRequest req = RNND__V1__REGISTER_REGION_REQUEST__INIT;
    req.kind_case = RNND__V1__REGISTER_REGION_REQUEST__KIND_MEMFD;
    req.memfd = &mf;
    ProtobufCMessage *msg;
    err = call_pb(c, M_REGISTER, &req.base, &rnnd__v1__register_region_reply__descriptor, &msg);
    if (err) {
        shm_unmap(s);
        return err;
    }
    s->id = ((Rnnd__V1__RegisterRegionReply *)msg)->region;
    protobuf_c_message_free_unpacked(msg, NULL);
    pthread_mutex_init(&s->lock, NULL);
    c->shm = s;
    return 0;
}

const char *rnnd_client_transport(const struct rnnd_client *c) {
    return c->shm ? "shm" : "grpc";
}

// Releases the region on the daemon (which would also notice our exit) and unmaps it; keeps the
// caller's last error.
static void shm_release(struct rnnd_client *c) {
    struct shm *s = c->shm;
    if (!s)
        return;
    struct rnnd_client_error saved = last_err;
    Rnnd__V1__ReleaseRegionRequest req = RNND__V1__RELEASE_REGION_REQUEST__INIT;
    req.region = s->id;
    ProtobufCMessage *msg;
    if (call_pb(c, M_RELEASE, &req.base, &rnnd__v1__release_region_reply__descriptor, &msg) == 0)
        protobuf_c_message_free_unpacked(msg, NULL);
    last_err = saved;
    c->shm = NULL;
    pthread_mutex_destroy(&s->lock);
    shm_unmap(s);
}

// ---------------------------------------------------------------------------------------------
// Health.

int rnnd_client_health(struct rnnd_client *c, const char *service, int *status) {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)(service ? service : "");
    ProtobufCMessage *out;
    int err =
        call_pb(c, M_HEALTH, &req.base, &grpc__health__v1__health_check_response__descriptor, &out);
    if (err)
        return err;
    *status = (int)((Grpc__Health__V1__HealthCheckResponse *)out)->status;
    protobuf_c_message_free_unpacked(out, NULL);
    return 0;
}

struct rnnd_client_watch {
    const char *target; // the client's (which outlives its watches)
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    grpc_byte_buffer *recv;
    bool recv_pending; // a RECV_MESSAGE batch is out
    bool status_done;
    char tag_start, tag_recv, tag_status;
};

int rnnd_client_watch_init(struct rnnd_client *c, const char *service,
                           struct rnnd_client_watch **out) {
    clear_err();
    *out = NULL;
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)(service ? service : "");
    size_t len = grpc__health__v1__health_check_request__get_packed_size(&req);
    uint8_t buf[512];
    if (len > sizeof buf)
        return local_err(RNND_EINVAL, "service name too long");
    grpc__health__v1__health_check_request__pack(&req, buf);
    struct rnnd_client_watch *w = calloc(1, sizeof *w);
    if (!w)
        return local_err(RNND_ENOMEM, "out of memory");
    w->target = c->target;
    w->cq = grpc_completion_queue_create_for_pluck(NULL);
    w->call = call_create(c, M_WATCH, NULL, w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    grpc_metadata_array_init(&w->init_md);
    grpc_metadata_array_init(&w->trail_md);
    w->details = grpc_empty_slice();
    w->status = GRPC_STATUS_UNKNOWN;
    if (!w->call) {
        w->status_done = true;
        rnnd_client_watch_free(w);
        return local_err(RNND_EIO, "cannot create a call");
    }
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, len);
    grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->n_md;
    ops[0].data.send_initial_metadata.metadata = c->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &w->init_md;
    grpc_op sop;
    memset(&sop, 0, sizeof sop);
    sop.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    sop.data.recv_status_on_client.trailing_metadata = &w->trail_md;
    sop.data.recv_status_on_client.status = &w->status;
    sop.data.recv_status_on_client.status_details = &w->details;
    sop.data.recv_status_on_client.error_string = &w->error_string;
    bool ok = grpc_call_start_batch(w->call, &sop, 1, &w->tag_status, NULL) == GRPC_CALL_OK;
    if (!ok)
        w->status_done = true;
    ok = ok && grpc_call_start_batch(w->call, ops, 4, &w->tag_start, NULL) == GRPC_CALL_OK;
    if (ok)
        grpc_completion_queue_pluck(w->cq, &w->tag_start, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                    NULL);
    grpc_byte_buffer_destroy(send);
    if (!ok) {
        rnnd_client_watch_free(w);
        return local_err(RNND_EIO, "cannot start Watch");
    }
    *out = w;
    return 0;
}

int rnnd_client_watch_next(struct rnnd_client_watch *w, int64_t timeout_ms, int *status) {
    clear_err();
    if (w->status_done) {
        int err = status_err(w->status, w->details, w->error_string, w->target);
        return err ? err : local_err(RNND_ECANCELED, "Watch ended with OK");
    }
    if (!w->recv_pending) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &w->recv;
        w->recv = NULL;
        if (grpc_call_start_batch(w->call, &op, 1, &w->tag_recv, NULL) != GRPC_CALL_OK)
            return local_err(RNND_EIO, "cannot receive on Watch");
        w->recv_pending = true;
    }
    grpc_event ev = grpc_completion_queue_pluck(w->cq, &w->tag_recv, deadline_ms(timeout_ms), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT)
        return local_err(RNND_ECANCELED, "no Watch update within %lld ms", (long long)timeout_ms);
    w->recv_pending = false;
    if (!w->recv) {
        grpc_completion_queue_pluck(w->cq, &w->tag_status, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                    NULL);
        w->status_done = true;
        int err = status_err(w->status, w->details, w->error_string, w->target);
        return err ? err : local_err(RNND_ECANCELED, "Watch ended with OK");
    }
    grpc_slice r = buffer_take(w->recv);
    w->recv = NULL;
    Grpc__Health__V1__HealthCheckResponse *resp = grpc__health__v1__health_check_response__unpack(
        NULL, GRPC_SLICE_LENGTH(r), GRPC_SLICE_START_PTR(r));
    grpc_slice_unref(r);
    if (!resp)
        return local_err(RNND_ECORRUPT, "cannot decode the Watch reply");
    *status = (int)resp->status;
    grpc__health__v1__health_check_response__free_unpacked(resp, NULL);
    return 0;
}

void rnnd_client_watch_free(struct rnnd_client_watch *w) {
    if (!w)
        return;
    if (w->call) {
        if (!w->status_done || w->recv_pending)
            grpc_call_cancel(w->call, NULL);
        if (w->recv_pending)
            grpc_completion_queue_pluck(w->cq, &w->tag_recv, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                        NULL);
        if (!w->status_done)
            grpc_completion_queue_pluck(w->cq, &w->tag_status, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                        NULL);
        grpc_call_unref(w->call);
    }
    if (w->recv)
        grpc_byte_buffer_destroy(w->recv);
    grpc_metadata_array_destroy(&w->init_md);
    grpc_metadata_array_destroy(&w->trail_md);
    grpc_slice_unref(w->details);
    gpr_free((void *)w->error_string);
    cq_destroy(w->cq);
    free(w);
}

int rnnd_client_health_watch_first(struct rnnd_client *c, const char *service, int *status) {
    struct rnnd_client_watch *w;
    int err = rnnd_client_watch_init(c, service, &w);
    if (err)
        return err;
    err = rnnd_client_watch_next(w, c->timeout_ms, status);
    rnnd_client_watch_free(w);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Model info.

static void copy_str(char *dst, size_t n, const char *src) {
    snprintf(dst, n, "%s", src ? src : "");
}

int rnnd_client_info(struct rnnd_client *c, struct rnnd_model_info *out) {
    memset(out, 0, sizeof *out);
    Rnnd__V1__GetModelInfoRequest req = RNND__V1__GET_MODEL_INFO_REQUEST__INIT;
    ProtobufCMessage *msg;
    int err = call_pb(c, M_INFO, &req.base, &rnnd__v1__model_info__descriptor, &msg);
    if (err)
        return err;
    Rnnd__V1__ModelInfo *r = (Rnnd__V1__ModelInfo *)msg;
    copy_str(out->cell, sizeof out->cell, r->cell);
    copy_str(out->compute, sizeof out->compute, r->compute);
    copy_str(out->backend, sizeof out->backend, r->backend);
    copy_str(out->device, sizeof out->device, r->device);
    out->input_size = r->input_size;
    out->hidden_size = r->hidden_size;
    out->num_layers = r->num_layers;
    out->model_version = r->model_version;
    out->envs_active = r->envs_active;
    out->max_batch = r->max_batch;
    out->extras_size = r->extras_size;
    copy_str(out->kernel_plan, sizeof out->kernel_plan, r->kernel_plan);
    for (size_t j = 0; j < r->n_encoder_widths && j < RNND_MAX_ENCODER_LAYERS; j++)
        out->encoder_widths[out->n_encoder_widths++] = r->encoder_widths[j];
    copy_str(out->encoder_activation, sizeof out->encoder_activation, r->encoder_activation);
    out->discrete_actions = r->discrete_actions;
    out->gaussian_actions = r->gaussian_actions;
    out->value_head = r->value_head;
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}

int rnnd_model_info_to_model(const struct rnnd_model_info *info, struct rnnd_model *m) {
    memset(m, 0, sizeof *m);
    if (strcmp(info->cell, "gru") == 0)
        m->cell = RNND_CELL_GRU;
    else if (strcmp(info->cell, "lstm") == 0)
        m->cell = RNND_CELL_LSTM;
    else
        return local_err(RNND_EINVAL, "unknown cell \"%s\"", info->cell);
    if (strcmp(info->compute, "fp32") == 0)
        m->compute = RNND_COMPUTE_FP32;
    else if (strcmp(info->compute, "ieee") == 0)
        m->compute = RNND_COMPUTE_IEEE;
    else if (strcmp(info->compute, "bf16") == 0)
        m->compute = RNND_COMPUTE_BF16;
    else
        return local_err(RNND_EINVAL, "unknown compute \"%s\"", info->compute);
    m->I = (int)info->input_size;
    m->H = (int)info->hidden_size;
    m->L = (int)info->num_layers;
    struct rnnd_policy *p = &m->policy;
    p->enc_layers = info->n_encoder_widths;
    for (int j = 0; j < info->n_encoder_widths; j++)
        p->enc_width[j] = (int)info->encoder_widths[j];
    const char *act = info->encoder_activation;
    p->enc_act = strcmp(act, "relu") == 0   ? RNND_ACT_RELU
                 : strcmp(act, "tanh") == 0 ? RNND_ACT_TANH
                                            : RNND_ACT_ELU;
    p->K = (int)info->discrete_actions;
    p->A = (int)info->gaussian_actions;
    p->value = info->value_head;
    if (rnnd_model_check(m) != 0)
        return local_err(RNND_EINVAL, "model I=%d H=%d L=%d is not valid", m->I, m->H, m->L);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Step and StepStream.

void rnnd_step_reply_free(struct rnnd_step_reply *r) {
    if (!r)
        return;
    rnnd_tensor_free(&r->output);
    rnnd_tensor_free(&r->h);
    rnnd_tensor_free(&r->c);
    rnnd_tensor_free(&r->action);
    rnnd_tensor_free(&r->log_prob);
    rnnd_tensor_free(&r->value);
    rnnd_tensor_free(&r->logits);
    rnnd_tensor_free(&r->mean);
    r->model_version = 0;
}

// The largest Step reply's tensors of req, as laid out in a reply_region.
static size_t step_reply_bytes(const struct shm *s, const struct rnnd_step_req *req) {
    size_t B = req->n_env_ids, H = (size_t)s->m.H, LH = (size_t)s->m.L * H;
    size_t state = req->return_state ? (s->m.cell == RNND_CELL_LSTM ? 2 : 1) * (B * LH * 4) : 0;
    const struct rnnd_policy *p = &s->m.policy;
    size_t D = (size_t)(p->K + p->A), heads = 0; // action, log-prob, value, logits or mean
    if (D || p->value)
        heads = align_up(B * (p->A ? (size_t)p->A * 4 : 8)) + 2 * align_up(B * 4) +
                (req->return_logits ? align_up(B * D * 4) : 0) + 4 * SHM_ALIGN;
    return align_up(B * H * 4) + align_up(state) + heads + SHM_ALIGN;
}

// Packs a StepRequest over req into a new buffer (free with free()); with shared memory its
// tensors go into a span of the region that *sc then holds.
static int step_pack(struct shm *shm, const struct rnnd_step_req *req, struct shm_call *sc,
                     uint8_t **buf, size_t *len) {
    Rnnd__V1__StepRequest pb = RNND__V1__STEP_REQUEST__INIT;
    Rnnd__V1__Tensor obs, extras;
    protobuf_c_boolean init_small[256];
    protobuf_c_boolean *init = init_small;
    if (req->n_is_init > 256) {
        init = malloc(req->n_is_init * sizeof *init);
        if (!init)
            return local_err(RNND_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < req->n_is_init; i++)
        init[i] = req->is_init[i];
    memset(sc, 0, sizeof *sc);
    if (shm) {
        const struct rnnd_tensor *in[] = {&req->obs, &req->extras};
        shm_take(shm, shm_need(in, 2, step_reply_bytes(shm, req)), sc);
    }
    pb.n_env_ids = req->n_env_ids;
    pb.env_ids = (uint64_t *)req->env_ids;
    pb.obs = pb_tensor_in(sc, &req->obs, &obs);
    pb.n_is_init = req->n_is_init;
    pb.is_init = init;
    pb.n_step_index = req->n_step_index;
    pb.step_index = (uint64_t *)req->step_index;
    pb.extras = pb_tensor_in(sc, &req->extras, &extras);
    pb.return_state = req->return_state;
    pb.greedy = req->greedy;
    pb.return_logits = req->return_logits;
    pb.return_core = req->return_core;
    size_t B = req->n_env_ids;
    protobuf_c_boolean *flags = NULL;
    if (req->done || req->truncated) {
        flags = malloc(2 * B * sizeof *flags + 1);
        if (!flags) {
            if (init != init_small)
                free(init);
            shm_give(sc);
            return local_err(RNND_ENOMEM, "out of memory");
        }
        for (size_t i = 0; i < B; i++) {
            flags[i] = req->done && req->done[i];
            flags[B + i] = req->truncated && req->truncated[i];
        }
    }
    pb.n_reward = req->reward ? B : 0;
    pb.reward = (float *)req->reward;
    pb.n_done = req->done ? B : 0;
    pb.done = flags;
    pb.n_truncated = req->truncated ? B : 0;
    pb.truncated = flags ? flags + B : NULL;
    pb.reply_dtype = (Rnnd__V1__DType)req->reply_dtype;
    pb.reply_region = shm_reply(sc);
    *len = rnnd__v1__step_request__get_packed_size(&pb);
    *buf = malloc(*len ? *len : 1);
    if (*buf)
        rnnd__v1__step_request__pack(&pb, *buf);
    if (init != init_small)
        free(init);
    free(flags);
    if (!*buf)
        shm_give(sc);
    return *buf ? 0 : local_err(RNND_ENOMEM, "out of memory");
}

static int step_unpack(const struct shm *shm, grpc_slice s, struct rnnd_step_reply *out) {
    Rnnd__V1__StepReply *r =
        rnnd__v1__step_reply__unpack(NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    if (!r)
        return local_err(RNND_ECORRUPT, "cannot decode the StepReply");
    out->model_version = r->model_version;
    int err = take_tensor(shm, r->output, &out->output);
    if (!err)
        err = take_tensor(shm, r->h, &out->h);
    if (!err)
        err = take_tensor(shm, r->c, &out->c);
    if (!err)
        err = take_tensor(shm, r->action, &out->action);
    if (!err)
        err = take_tensor(shm, r->log_prob, &out->log_prob);
    if (!err)
        err = take_tensor(shm, r->value, &out->value);
    if (!err)
        err = take_tensor(shm, r->logits, &out->logits);
    if (!err)
        err = take_tensor(shm, r->mean, &out->mean);
    rnnd__v1__step_reply__free_unpacked(r, NULL);
    if (err)
        rnnd_step_reply_free(out);
    return err;
}

int rnnd_client_step(struct rnnd_client *c, const struct rnnd_step_req *req,
                     struct rnnd_step_reply *out) {
    memset(out, 0, sizeof *out);
    clear_err();
    uint8_t *buf;
    size_t len;
    struct shm_call sc;
    int err = step_pack(c->shm, req, &sc, &buf, &len);
    if (err)
        return err;
    grpc_slice reply;
    err = unary(c, M_STEP, NULL, buf, len, &reply);
    free(buf);
    if (!err) {
        err = step_unpack(c->shm, reply, out);
        grpc_slice_unref(reply);
    }
    shm_give(&sc);
    return err;
}

struct rnnd_client_stream {
    struct rnnd_client *c;
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    bool half_closed;
    bool status_done;
    size_t pending; // requests sent whose replies were not received
    // Shared memory: the spans of the requests in flight, oldest first (a ring of cap).
    struct shm_call *spans;
    size_t span_head, span_n, span_cap;
    // Distinct addresses used as completion tags.
    char tag_send, tag_recv, tag_status, tag_close;
};

// Waits for tag; past the client's timeout the call is cancelled (which completes every op).
static bool stream_wait(struct rnnd_client_stream *s, void *tag) {
    grpc_event ev = grpc_completion_queue_pluck(s->cq, tag, deadline_ms(s->c->timeout_ms), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
        grpc_call_cancel_with_status(s->call, GRPC_STATUS_DEADLINE_EXCEEDED,
                                     "rnnd client: no progress within the timeout", NULL);
        ev = grpc_completion_queue_pluck(s->cq, tag, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    }
    return ev.type == GRPC_OP_COMPLETE && ev.success;
}

static int stream_status(struct rnnd_client_stream *s) {
    if (!s->status_done) {
        stream_wait(s, &s->tag_status);
        s->status_done = true;
    }
    return status_err(s->status, s->details, s->error_string, s->c->target);
}

int rnnd_client_stream_init(struct rnnd_client *c, struct rnnd_client_stream **out) {
    clear_err();
    *out = NULL;
    struct rnnd_client_stream *s = calloc(1, sizeof *s);
    if (!s)
        return local_err(RNND_ENOMEM, "out of memory");
    s->c = c;
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    s->call = call_create(c, M_STEP_STREAM, NULL, s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->details = grpc_empty_slice();
    s->status = GRPC_STATUS_UNKNOWN;
    if (!s->call) {
        rnnd_client_stream_free(s);
        return local_err(RNND_EIO, "cannot create a call");
    }
    // The initial metadata is asked for up front, with the status: gRPC (1.51) holds a received
    // status back until the initial metadata has been asked for. A server that refuses the stream
    // at once answers trailers-only; when that arrives before our first message, SEND_MESSAGE
    // fails on the closed stream and stream_status would wait for the status until the timeout.
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[0].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
    ops[1].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[1].data.recv_status_on_client.trailing_metadata = &s->trail_md;
    ops[1].data.recv_status_on_client.status = &s->status;
    ops[1].data.recv_status_on_client.status_details = &s->details;
    ops[1].data.recv_status_on_client.error_string = &s->error_string;
    if (grpc_call_start_batch(s->call, ops, 2, &s->tag_status, NULL) != GRPC_CALL_OK) {
        s->status_done = true;
        rnnd_client_stream_free(s);
        return local_err(RNND_EIO, "cannot start the stream");
    }
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    op.data.send_initial_metadata.count = c->n_md;
    op.data.send_initial_metadata.metadata = c->md;
    if (grpc_call_start_batch(s->call, &op, 1, &s->tag_send, NULL) != GRPC_CALL_OK ||
        !stream_wait(s, &s->tag_send)) {
        int err = stream_status(s);
        rnnd_client_stream_free(s);
        return err ? err : local_err(RNND_EIO, "cannot open the stream");
    }
    *out = s;
    return 0;
}

int rnnd_client_stream_send(struct rnnd_client_stream *s, const struct rnnd_step_req *req) {
    clear_err();
    if (s->half_closed || s->status_done)
        return local_err(RNND_EINVAL, "the stream is closed");
    if (s->c->shm && s->span_n == s->span_cap) {
        size_t cap = s->span_cap ? 2 * s->span_cap : 8;
        struct shm_call *v = malloc(cap * sizeof *v);
        if (!v)
            return local_err(RNND_ENOMEM, "out of memory");
        for (size_t i = 0; i < s->span_n; i++)
            v[i] = s->spans[(s->span_head + i) % s->span_cap];
        free(s->spans);
        s->spans = v;
        s->span_head = 0;
        s->span_cap = cap;
    }
    uint8_t *buf;
    size_t len;
    struct shm_call sc;
    int err = step_pack(s->c->shm, req, &sc, &buf, &len);
    if (err)
        return err;
    if (s->c->shm)
        s->spans[(s->span_head + s->span_n++) % s->span_cap] = sc;
    grpc_slice sl = grpc_slice_new(buf, len, free);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    bool ok = grpc_call_start_batch(s->call, &op, 1, &s->tag_send, NULL) == GRPC_CALL_OK &&
              stream_wait(s, &s->tag_send);
    grpc_byte_buffer_destroy(bb);
    if (!ok)
        return stream_status(s); // the call ended: its status says why
    s->pending++;
    return 0;
}

int rnnd_client_stream_recv(struct rnnd_client_stream *s, struct rnnd_step_reply *out) {
    clear_err();
    memset(out, 0, sizeof *out);
    grpc_byte_buffer *recv = NULL;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &recv;
    if (grpc_call_start_batch(s->call, &op, 1, &s->tag_recv, NULL) != GRPC_CALL_OK)
        return local_err(RNND_EIO, "cannot receive on the stream");
    stream_wait(s, &s->tag_recv);
    if (!recv) {
        int err = stream_status(s);
        return err ? err : local_err(RNND_ECANCELED, "the stream ended with OK and no reply");
    }
    if (s->pending)
        s->pending--;
    grpc_slice sl = buffer_take(recv);
    int err = step_unpack(s->c->shm, sl, out);
    grpc_slice_unref(sl);
    if (s->span_n) {
        shm_give(&s->spans[s->span_head]);
        s->span_head = (s->span_head + 1) % s->span_cap;
        s->span_n--;
    }
    return err;
}

int rnnd_client_stream_step(struct rnnd_client_stream *s, const struct rnnd_step_req *req,
                            struct rnnd_step_reply *out) {
    memset(out, 0, sizeof *out);
    int err = rnnd_client_stream_send(s, req);
    return err ? err : rnnd_client_stream_recv(s, out);
}

int rnnd_client_stream_close(struct rnnd_client_stream *s) {
    clear_err();
    if (!s->half_closed && !s->status_done) {
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        if (grpc_call_start_batch(s->call, &op, 1, &s->tag_close, NULL) == GRPC_CALL_OK)
            stream_wait(s, &s->tag_close);
        s->half_closed = true;
    }
    while (s->pending && !s->status_done) {
        struct rnnd_step_reply r;
        int err = rnnd_client_stream_recv(s, &r);
        rnnd_step_reply_free(&r);
        if (err)
            break;
    }
    return stream_status(s);
}

void rnnd_client_stream_free(struct rnnd_client_stream *s) {
    if (!s)
        return;
    if (s->call) {
        if (!s->status_done) {
            grpc_call_cancel(s->call, NULL);
            grpc_completion_queue_pluck(s->cq, &s->tag_status, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                        NULL);
        }
        grpc_call_unref(s->call);
    }
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    grpc_slice_unref(s->details);
    gpr_free((void *)s->error_string);
    cq_destroy(s->cq);
    for (size_t i = 0; i < s->span_n; i++)
        shm_give(&s->spans[(s->span_head + i) % s->span_cap]);
    free(s->spans);
    free(s);
}

// ---------------------------------------------------------------------------------------------
// EndEpisodes, Forward, Backward.

int rnnd_client_end_episodes(struct rnnd_client *c, const uint64_t *env_ids, size_t n,
                             uint64_t *released) {
    Rnnd__V1__EndEpisodesRequest req = RNND__V1__END_EPISODES_REQUEST__INIT;
    req.n_env_ids = n;
    req.env_ids = (uint64_t *)env_ids;
    ProtobufCMessage *msg;
    int err = call_pb(c, M_END, &req.base, &rnnd__v1__end_episodes_reply__descriptor, &msg);
    if (err)
        return err;
    if (released)
        *released = ((Rnnd__V1__EndEpisodesReply *)msg)->released;
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}

void rnnd_forward_reply_free(struct rnnd_forward_reply *r) {
    if (!r)
        return;
    rnnd_tensor_free(&r->output);
    rnnd_tensor_free(&r->h_n);
    rnnd_tensor_free(&r->c_n);
    rnnd_tensor_free(&r->obs);
    rnnd_tensor_free(&r->is_init);
    rnnd_tensor_free(&r->extras);
    rnnd_tensor_free(&r->step_model_version);
    rnnd_tensor_free(&r->action);
    rnnd_tensor_free(&r->log_prob);
    rnnd_tensor_free(&r->value);
    rnnd_tensor_free(&r->reward);
    rnnd_tensor_free(&r->done);
    rnnd_tensor_free(&r->truncated);
    rnnd_tensor_free(&r->logits);
    rnnd_tensor_free(&r->mean);
    rnnd_tensor_free(&r->log_std);
    rnnd_tensor_free(&r->head_value);
    r->tape_id = r->model_version = 0;
}

// The largest Forward reply's tensors of req, as laid out in a reply_region.
static size_t forward_reply_bytes(const struct shm *s, const struct rnnd_forward_req *req) {
    size_t B = req->recorded ? req->n_env_ids : (size_t)req->obs.shape[0];
    size_t T = req->recorded ? req->steps : (size_t)req->obs.shape[1];
    size_t H = (size_t)s->m.H, LH = (size_t)s->m.L * H;
    size_t n = align_up(B * T * H * 4) + 2 * align_up(B * LH * 4) + SHM_ALIGN;
    const struct rnnd_policy *p = &s->m.policy;
    n += align_up(B * T * (size_t)p->K * 4) + align_up(B * T * (size_t)p->A * 4) +
         align_up((size_t)p->A * 4) + align_up(B * T * 4) + 4 * SHM_ALIGN; // the heads' outputs
    if (req->recorded) // the recorded obs, is_init, extras, step_model_version
        n += align_up(B * T * (size_t)s->m.I * 4) + align_up(B * T) +
             align_up(B * T * (size_t)s->E * 4) + align_up(B * T * 8);
    return n;
}

int rnnd_client_forward(struct rnnd_client *c, const struct rnnd_forward_req *req,
                        struct rnnd_forward_reply *out) {
    memset(out, 0, sizeof *out);
    Rnnd__V1__ForwardRequest pb = RNND__V1__FORWARD_REQUEST__INIT;
    Rnnd__V1__Trajectories tr = RNND__V1__TRAJECTORIES__INIT;
    Rnnd__V1__Recorded rec = RNND__V1__RECORDED__INIT;
    Rnnd__V1__Tensor t[6];
    struct shm_call sc;
    memset(&sc, 0, sizeof sc);
    if (c->shm) {
        const struct rnnd_tensor *in[] = {&req->obs, &req->is_init, &req->h0,
                                          &req->c0,  &req->hidden,  &req->cell};
        shm_take(c->shm, shm_need(in, req->recorded ? 0 : 6, forward_reply_bytes(c->shm, req)),
                 &sc);
    }
    if (req->recorded) {
        rec.n_env_ids = req->n_env_ids;
        rec.env_ids = (uint64_t *)req->env_ids;
        rec.steps = req->steps;
        pb.source_case = RNND__V1__FORWARD_REQUEST__SOURCE_RECORDED;
        pb.recorded = &rec;
    } else {
        tr.obs = pb_tensor_in(&sc, &req->obs, &t[0]);
        tr.is_init = pb_tensor_in(&sc, &req->is_init, &t[1]);
        tr.h0 = pb_tensor_in(&sc, &req->h0, &t[2]);
        tr.c0 = pb_tensor_in(&sc, &req->c0, &t[3]);
        tr.hidden = pb_tensor_in(&sc, &req->hidden, &t[4]);
        tr.cell = pb_tensor_in(&sc, &req->cell, &t[5]);
        pb.source_case = RNND__V1__FORWARD_REQUEST__SOURCE_TRAJECTORIES;
        pb.trajectories = &tr;
    }
    pb.keep_tape = req->keep_tape;
    pb.return_core = req->return_core;
    pb.reply_dtype = (Rnnd__V1__DType)req->reply_dtype;
    if (req->has_recorded_fields) {
        pb._recorded_fields_case = RNND__V1__FORWARD_REQUEST___RECORDED_FIELDS_RECORDED_FIELDS;
        pb.recorded_fields = req->recorded_fields;
    }
    pb.reply_region = shm_reply(&sc);
    ProtobufCMessage *msg;
    int err = call_pb(c, M_FORWARD, &pb.base, &rnnd__v1__forward_reply__descriptor, &msg);
    if (err) {
        shm_give(&sc);
        return err;
    }
    Rnnd__V1__ForwardReply *r = (Rnnd__V1__ForwardReply *)msg;
    out->tape_id = r->tape_id;
    out->model_version = r->model_version;
    const struct shm *sh = c->shm;
    err = take_tensor(sh, r->output, &out->output);
    if (!err)
        err = take_tensor(sh, r->h_n, &out->h_n);
    if (!err)
        err = take_tensor(sh, r->c_n, &out->c_n);
    if (!err)
        err = take_tensor(sh, r->obs, &out->obs);
    if (!err)
        err = take_tensor(sh, r->is_init, &out->is_init);
    if (!err)
        err = take_tensor(sh, r->extras, &out->extras);
    if (!err)
        err = take_tensor(sh, r->step_model_version, &out->step_model_version);
    if (!err)
        err = take_tensor(sh, r->action, &out->action);
    if (!err)
        err = take_tensor(sh, r->log_prob, &out->log_prob);
    if (!err)
        err = take_tensor(sh, r->value, &out->value);
    if (!err)
        err = take_tensor(sh, r->reward, &out->reward);
    if (!err)
        err = take_tensor(sh, r->done, &out->done);
    if (!err)
        err = take_tensor(sh, r->truncated, &out->truncated);
    if (!err)
        err = take_tensor(sh, r->logits, &out->logits);
    if (!err)
        err = take_tensor(sh, r->mean, &out->mean);
    if (!err)
        err = take_tensor(sh, r->log_std, &out->log_std);
    if (!err)
        err = take_tensor(sh, r->head_value, &out->head_value);
    protobuf_c_message_free_unpacked(msg, NULL);
    shm_give(&sc);
    if (err)
        rnnd_forward_reply_free(out);
    return err;
}

void rnnd_backward_reply_free(struct rnnd_backward_reply *r) {
    if (!r)
        return;
    rnnd_named_tensors_free(&r->grads);
    rnnd_tensor_free(&r->grad_obs);
    rnnd_tensor_free(&r->grad_h0);
    rnnd_tensor_free(&r->grad_c0);
    rnnd_tensor_free(&r->grad_hidden);
    rnnd_tensor_free(&r->grad_cell);
}

// The largest Backward reply's tensors of req, as laid out in a reply_region: grads (unless
// accumulated), grad_obs and the initial states' gradients. grad_hidden/grad_cell (a tape with
// stored states) are left out: when they do not fit they come back as bytes.
static size_t backward_reply_bytes(const struct shm *s, const struct rnnd_backward_req *req) {
    // B and T from the first gradient sent that has them.
    const struct rnnd_tensor *bt = req->grad_output.present   ? &req->grad_output
                                   : req->grad_logits.present ? &req->grad_logits
                                   : req->grad_mean.present   ? &req->grad_mean
                                                              : &req->grad_head_value;
    size_t B = bt->present ? (size_t)bt->shape[0] : 0, T = bt->present ? (size_t)bt->shape[1] : 0;
    size_t LH = (size_t)s->m.L * (size_t)s->m.H;
    size_t n = align_up(B * T * (size_t)s->m.I * 4) + 2 * align_up(B * LH * 4) + SHM_ALIGN;
    if (!req->accumulate)
        n += s->P * 4 + (size_t)rnnd_model_param_tensors(&s->m) * SHM_ALIGN;
    return n;
}

int rnnd_client_backward(struct rnnd_client *c, const struct rnnd_backward_req *req,
                         struct rnnd_backward_reply *out) {
    memset(out, 0, sizeof *out);
    Rnnd__V1__BackwardRequest pb = RNND__V1__BACKWARD_REQUEST__INIT;
    Rnnd__V1__Tensor t[7];
    struct shm_call sc;
    memset(&sc, 0, sizeof sc);
    if (c->shm) {
        const struct rnnd_tensor *in[] = {&req->grad_output,    &req->grad_h_n,  &req->grad_c_n,
                                          &req->grad_logits,    &req->grad_mean, &req->grad_log_std,
                                          &req->grad_head_value};
        shm_take(c->shm, shm_need(in, 7, backward_reply_bytes(c->shm, req)), &sc);
    }
    pb.tape_id = req->tape_id;
    pb.grad_output = pb_tensor_in(&sc, &req->grad_output, &t[0]);
    pb.grad_h_n = pb_tensor_in(&sc, &req->grad_h_n, &t[1]);
    pb.grad_c_n = pb_tensor_in(&sc, &req->grad_c_n, &t[2]);
    pb.grad_logits = pb_tensor_in(&sc, &req->grad_logits, &t[3]);
    pb.grad_mean = pb_tensor_in(&sc, &req->grad_mean, &t[4]);
    pb.grad_log_std = pb_tensor_in(&sc, &req->grad_log_std, &t[5]);
    pb.grad_head_value = pb_tensor_in(&sc, &req->grad_head_value, &t[6]);
    pb.accumulate = req->accumulate;
    pb.reply_dtype = (Rnnd__V1__DType)req->reply_dtype;
    if (req->has_input_grads) {
        pb._input_grads_case = RNND__V1__BACKWARD_REQUEST___INPUT_GRADS_INPUT_GRADS;
        pb.input_grads = req->input_grads;
    }
    pb.reply_region = shm_reply(&sc);
    ProtobufCMessage *msg;
    int err = call_pb(c, M_BACKWARD, &pb.base, &rnnd__v1__backward_reply__descriptor, &msg);
    if (err) {
        shm_give(&sc);
        return err;
    }
    Rnnd__V1__BackwardReply *r = (Rnnd__V1__BackwardReply *)msg;
    const struct shm *sh = c->shm;
    err = copy_named(sh, r->grads, r->n_grads, &out->grads);
    if (!err)
        err = take_tensor(sh, r->grad_obs, &out->grad_obs);
    if (!err)
        err = take_tensor(sh, r->grad_h0, &out->grad_h0);
    if (!err)
        err = take_tensor(sh, r->grad_c0, &out->grad_c0);
    if (!err)
        err = take_tensor(sh, r->grad_hidden, &out->grad_hidden);
    if (!err)
        err = take_tensor(sh, r->grad_cell, &out->grad_cell);
    protobuf_c_message_free_unpacked(msg, NULL);
    shm_give(&sc);
    if (err)
        rnnd_backward_reply_free(out);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Learner and weights.

int rnnd_client_apply_gradients(struct rnnd_client *c, const struct rnnd_named_tensors *grads,
                                const float *lr, uint64_t *model_version) {
    clear_err();
    Rnnd__V1__ApplyGradientsRequest pb = RNND__V1__APPLY_GRADIENTS_REQUEST__INIT;
    Rnnd__V1__NamedTensor **ptrs, *nts;
    Rnnd__V1__Tensor *ts;
    int err = pb_named(grads, &ptrs, &nts, &ts);
    if (err)
        return err;
    pb.n_grads = grads ? grads->n : 0;
    pb.grads = ptrs;
    if (lr) {
        pb._lr_case = RNND__V1__APPLY_GRADIENTS_REQUEST___LR_LR;
        pb.lr = *lr;
    }
    ProtobufCMessage *msg;
    err = call_pb(c, M_APPLY, &pb.base, &rnnd__v1__apply_gradients_reply__descriptor, &msg);
    free(ptrs);
    free(nts);
    free(ts);
    if (err)
        return err;
    if (model_version)
        *model_version = ((Rnnd__V1__ApplyGradientsReply *)msg)->model_version;
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}

int rnnd_client_get_weights(struct rnnd_client *c, struct rnnd_named_tensors *out,
                            uint64_t *model_version) {
    memset(out, 0, sizeof *out);
    Rnnd__V1__GetWeightsRequest req = RNND__V1__GET_WEIGHTS_REQUEST__INIT;
    ProtobufCMessage *msg;
    int err = call_pb(c, M_GETW, &req.base, &rnnd__v1__weights__descriptor, &msg);
    if (err)
        return err;
    Rnnd__V1__Weights *w = (Rnnd__V1__Weights *)msg;
    err = copy_named(NULL, w->tensors, w->n_tensors, out);
    if (!err && model_version)
        *model_version = w->model_version;
    protobuf_c_message_free_unpacked(msg, NULL);
    return err;
}

int rnnd_client_set_weights(struct rnnd_client *c, const struct rnnd_named_tensors *tensors,
                            uint64_t *model_version) {
    clear_err();
    Rnnd__V1__SetWeightsRequest pb = RNND__V1__SET_WEIGHTS_REQUEST__INIT;
    Rnnd__V1__NamedTensor **ptrs, *nts;
    Rnnd__V1__Tensor *ts;
    int err = pb_named(tensors, &ptrs, &nts, &ts);
    if (err)
        return err;
    pb.n_tensors = tensors ? tensors->n : 0;
    pb.tensors = ptrs;
    ProtobufCMessage *msg;
    err = call_pb(c, M_SETW, &pb.base, &rnnd__v1__set_weights_reply__descriptor, &msg);
    free(ptrs);
    free(nts);
    free(ts);
    if (err)
        return err;
    if (model_version)
        *model_version = ((Rnnd__V1__SetWeightsReply *)msg)->model_version;
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}

int rnnd_client_save_checkpoint(struct rnnd_client *c, const char *path, char **path_out,
                                uint64_t *model_version) {
    if (path_out)
        *path_out = NULL;
    Rnnd__V1__SaveCheckpointRequest req = RNND__V1__SAVE_CHECKPOINT_REQUEST__INIT;
    req.path = (char *)(path ? path : "");
    ProtobufCMessage *msg;
    int err = call_pb(c, M_SAVE, &req.base, &rnnd__v1__save_checkpoint_reply__descriptor, &msg);
    if (err)
        return err;
    Rnnd__V1__SaveCheckpointReply *r = (Rnnd__V1__SaveCheckpointReply *)msg;
    if (model_version)
        *model_version = r->model_version;
    if (path_out) {
        *path_out = strdup(r->path ? r->path : "");
        if (!*path_out)
            err = local_err(RNND_ENOMEM, "out of memory");
    }
    protobuf_c_message_free_unpacked(msg, NULL);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Flat parameter helpers.

int rnnd_named_tensors_to_params(const struct rnnd_named_tensors *l, const struct rnnd_model *m,
                                 float *params) {
    int n = rnnd_model_param_tensors(m);
    for (int k = 0; k < n; k++) {
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(m, k, &pt);
        const struct rnnd_tensor *t = rnnd_named_tensors_find(l, pt.name);
        if (!t)
            return local_err(RNND_EINVAL, "tensor %s is missing", pt.name);
        bool shape_ok = t->ndim == pt.ndim;
        for (int d = 0; shape_ok && d < pt.ndim; d++)
            shape_ok = t->shape[d] == pt.shape[d];
        if (t->dtype != RNND_DTYPE_FLOAT32 || !shape_ok || t->nbytes != pt.count * sizeof(float))
            return local_err(RNND_EINVAL, "tensor %s has the wrong dtype, shape or size", pt.name);
        memcpy(params + pt.offset, t->data, t->nbytes);
    }
    return 0;
}

int rnnd_named_tensors_from_params(struct rnnd_named_tensors *out, const struct rnnd_model *m,
                                   const float *params) {
    int n = rnnd_model_param_tensors(m);
    out->n = 0;
    out->v = calloc((size_t)n, sizeof *out->v);
    if (!out->v)
        return local_err(RNND_ENOMEM, "out of memory");
    for (int k = 0; k < n; k++) {
        struct rnnd_param_tensor pt;
        rnnd_model_param_tensor(m, k, &pt);
        struct rnnd_named_tensor *nt = &out->v[k];
        out->n = (size_t)k + 1;
        nt->name = strdup(pt.name);
        nt->tensor = rnnd_tensor_view(RNND_DTYPE_FLOAT32, NULL, pt.ndim, pt.shape);
        nt->tensor.data = malloc(pt.count * sizeof(float));
        if (!nt->name || !nt->tensor.data) {
            rnnd_named_tensors_free(out);
            return local_err(RNND_ENOMEM, "out of memory");
        }
        memcpy(nt->tensor.data, params + pt.offset, pt.count * sizeof(float));
    }
    return 0;
}
