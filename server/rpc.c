/*
 * rpc.c: the gRPC C core wrapper (see rpc.h) and the only file that calls grpc_*.
 *
 * Threads: one completion-queue thread runs every completion (new calls, sends, receives,
 * closes). Handlers run on it too, and finish their calls from any thread (the engine thread,
 * mostly) through rnnd_call_reply / rnnd_call_fail, which start the reply batch themselves.
 *
 * Calls: each struct rnnd_call is reference counted: one reference for the owner (the call's
 * handler side, dropped when the status is sent) and one per batch in flight. Tags are small
 * structs embedded in the call that say which batch finished. The per-call mutex guards the
 * stream state (what is being sent, what is queued, whether a status went out). A call holds
 * what it was given (its place in `active`, its --max-streams slot, its reply bytes, its Watch
 * slot) until the batch carrying its status has completed, i.e. until its reply has left, not
 * merely been handed to gRPC: call_done gives them all back.
 *
 * Bounds: --max-streams (rnnd.v1 calls), --max-reply-mb (replies reserved by their handler before
 * any work, then queued or being sent), --max-health-watches, --max-connections (see the accept4
 * section), --max-message-mb for requests (checked here rather than by gRPC, which would refuse
 * them unseen and uncounted after buffering them just the same) and --stream-idle-timeout-s
 * (rnnd_rpc_housekeeping).
 *
 * Shutdown (docs/grpc_notes.md): draining answers new calls UNAVAILABLE and ends Watch streams, while
 * the calls and StepStreams already running go on; rnnd_rpc_drain_end ends those streams with a
 * clean status. Once no call of ours is unfinished (or the grace period is over),
 * grpc_server_shutdown_and_notify and grpc_server_cancel_all_calls together (see maybe_shutdown
 * for why not earlier). Starting a batch after grpc_completion_queue_shutdown aborts, so every
 * batch start and request post holds the read side of `gate`, and the queue is shut down under
 * its write side with cq_open cleared.
 */
#include "rpc.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/status.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "metrics.h"
#include "request.h"
#include "rnnd/v1/rnnd.pb-c.h"
#include "rnnd_kernels.h"
#include "service.h"
#include "shm.h"

// ---------------------------------------------------------------------------------------------
// The method table

enum method_kind { KIND_UNARY, KIND_STEP_STREAM, KIND_HEALTH_CHECK, KIND_HEALTH_WATCH };

struct method {
    const char *path;
    enum rnnd_method metric;
    enum method_kind kind;
    rnnd_rpc_handler_fn handler;
    int posted; // requests kept waiting for this method
};

static const struct method methods[] = {
    {"/rnnd.v1.Rnn/GetModelInfo", RNND_METHOD_GET_MODEL_INFO, KIND_UNARY,
     rnnd_service_get_model_info, 8},
    {"/rnnd.v1.Rnn/Step", RNND_METHOD_STEP, KIND_UNARY, rnnd_service_step, 32},
    {"/rnnd.v1.Rnn/StepStream", RNND_METHOD_STEP_STREAM, KIND_STEP_STREAM, rnnd_service_step, 8},
    {"/rnnd.v1.Rnn/EndEpisodes", RNND_METHOD_END_EPISODES, KIND_UNARY, rnnd_service_end_episodes,
     4},
    {"/rnnd.v1.Rnn/Forward", RNND_METHOD_FORWARD, KIND_UNARY, rnnd_service_forward, 4},
    {"/rnnd.v1.Rnn/Backward", RNND_METHOD_BACKWARD, KIND_UNARY, rnnd_service_backward, 4},
    {"/rnnd.v1.Rnn/ApplyGradients", RNND_METHOD_APPLY_GRADIENTS, KIND_UNARY,
     rnnd_service_apply_gradients, 2},
    {"/rnnd.v1.Rnn/GetWeights", RNND_METHOD_GET_WEIGHTS, KIND_UNARY, rnnd_service_get_weights, 2},
    {"/rnnd.v1.Rnn/SetWeights", RNND_METHOD_SET_WEIGHTS, KIND_UNARY, rnnd_service_set_weights, 2},
    {"/rnnd.v1.Rnn/SaveCheckpoint", RNND_METHOD_SAVE_CHECKPOINT, KIND_UNARY,
     rnnd_service_save_checkpoint, 2},
    {"/rnnd.v1.Rnn/RegisterRegion", RNND_METHOD_REGISTER_REGION, KIND_UNARY,
     rnnd_service_register_region, 2},
    {"/rnnd.v1.Rnn/ReleaseRegion", RNND_METHOD_RELEASE_REGION, KIND_UNARY,
     rnnd_service_release_region, 2},
    {"/grpc.health.v1.Health/Check", RNND_METHOD_HEALTH_CHECK, KIND_HEALTH_CHECK, NULL, 4},
    {"/grpc.health.v1.Health/Watch", RNND_METHOD_HEALTH_WATCH, KIND_HEALTH_WATCH, NULL, 4},
};
#define NMETHODS         ((int)(sizeof(methods) / sizeof(methods[0])))
#define CATCH_ALL_POSTED 2


// ---------------------------------------------------------------------------------------------
// Types

enum tag_kind { TAG_NEW, TAG_CLOSE, TAG_SEND, TAG_STATUS, TAG_RECV, TAG_SHUTDOWN };

struct tag {
    enum tag_kind kind;
    struct rnnd_call *call;
};

struct outmsg {
    grpc_byte_buffer *buf;
    size_t bytes;
    struct outmsg *next;
};

struct rnnd_call {
    struct rnnd_rpc *rpc;
    int mi; // method index; -1 for the catch-all
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details; // catch-all only
    grpc_byte_buffer *payload; // received message (initial payload or RECV_MESSAGE)
    ProtobufCMessage *request; // decoded from payload
    struct rnnd_shm_use *shm;  // the request's resolved region spans, or NULL
    _Atomic int refs;
    _Atomic int cancelled;
    int close_cancelled; // written by RECV_CLOSE_ON_SERVER
    uint64_t start_ns;
    uint64_t msg_ns; // StepStream: when the message in flight arrived
    uint64_t source;
    bool source_set;
    bool counted;         // in rpc->active
    _Atomic bool limited; // holds one of rpc->max_streams slots
    _Atomic bool done;    // call_done ran
    struct tag t_new, t_close, t_send, t_status, t_recv;
    grpc_slice status_details;
    bool has_details;

    pthread_mutex_t lock;
    bool md_sent;     // initial metadata went out
    bool status_sent; // the status batch started (or the call was abandoned)
    bool sending;     // a SEND_MESSAGE batch is in flight
    grpc_byte_buffer *send_buf;
    size_t send_bytes; // of send_buf
    struct outmsg *outq, *outq_tail;
    // --max-reply-mb: what this call holds of rpc->reply_bytes (reserved for the reply being
    // computed, queued, being sent), and the part of it reserved and not yet replied.
    size_t reply_held, reserved;
    // --stream-idle-timeout-s: when the StepStream's last message arrived (or it opened), when
    // the send in flight (message or status) started (0: none), and whether it was cancelled.
    uint64_t last_msg_ns, send_ns;
    bool send_cancelled;
    bool ending; // send this status once the queue is empty
    int end_code;
    char *end_msg;
    bool inflight;    // StepStream: a request is with the handler
    bool half_closed; // StepStream: the client sent its last message
    // Health Watch:
    bool watching; // holds one of rpc->max_watches slots
    bool watch_known;
    int watch_last; // last status queued, -1 none
    // rpc->live list (every call from its arrival until freed), under rpc->live_lock.
    struct rnnd_call *lnext, *lprev;
    bool listed;
};

struct rnnd_rpc {
    grpc_server *server;
    grpc_completion_queue *cq;
    void *handles[NMETHODS];
    void *service;
    rnnd_rpc_stopped_cb stopped;
    rnnd_rpc_drained_cb drained;
    void *stopped_ctx;
    pthread_t threads[RNND_RPC_MAX_THREADS];
    int nthreads;
    _Atomic int alive; // completion-queue threads still running
    struct tag t_shutdown;

    pthread_rwlock_t gate;
    bool cq_open;     // under gate
    bool server_shut; // shutdown_and_notify was called, under gate

    _Atomic int serving;
    _Atomic int draining;
    _Atomic int streams_ending; // the drain's grace is over: StepStreams end
    _Atomic int drained_sent;   // `drained` was called
    _Atomic int active;         // calls started and not yet finished by us
    _Atomic int shut;           // shutdown_and_notify and cancel_all_calls were called
    int max_streams;
    _Atomic int calls; // rnnd.v1 calls holding a slot
    size_t max_message_bytes;
    size_t max_reply_bytes;
    _Atomic size_t reply_bytes; // held by calls (reply_held)
    int max_watches;
    _Atomic int watches; // Watch streams holding a slot
    int idle_timeout_s;

    pthread_mutex_t live_lock;
    struct rnnd_call *live;

    char *auth; // "Bearer <token>", or NULL
    struct rnnd_shm *shm;
    char addresses[RNND_RPC_MAX_LISTEN * 128]; // rnnd_rpc_addresses
    // The unix: socket files we created, removed at the end if they are still ours.
    struct {
        char path[108];
        ino_t ino;
    } sockets[RNND_RPC_MAX_LISTEN];
    int nsockets;
};

static void call_unref(struct rnnd_call *c);
static void call_done(struct rnnd_call *c);
static void post_request(struct rnnd_rpc *rpc, int mi);

// ---------------------------------------------------------------------------------------------
// Status mapping: the one place where rnnd error codes become gRPC statuses.

int rnnd_rpc_status(int err) {
    switch (err) {
        case 0:
            return GRPC_STATUS_OK;
        case RNND_EINVAL:
            return GRPC_STATUS_INVALID_ARGUMENT;
        case RNND_EPRECOND:
            return GRPC_STATUS_FAILED_PRECONDITION;
        case RNND_ENOTFOUND:
            return GRPC_STATUS_NOT_FOUND;
        case RNND_EFULL:
        case RNND_ENOMEM:
            return GRPC_STATUS_RESOURCE_EXHAUSTED;
        case RNND_EUNAVAIL:
            return GRPC_STATUS_UNAVAILABLE;
        case RNND_EAUTH:
            return GRPC_STATUS_UNAUTHENTICATED;
        case RNND_ENOTSUP:
            return GRPC_STATUS_UNIMPLEMENTED;
        case RNND_ECANCELED:
            return GRPC_STATUS_CANCELLED;
        case RNND_ECORRUPT:
            return GRPC_STATUS_DATA_LOSS;
        case RNND_EDEVICE:
        case RNND_EIO:
        default:
            return GRPC_STATUS_INTERNAL;
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers

static grpc_byte_buffer *encode(const ProtobufCMessage *m) {
    size_t n = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

// A block whose large bytes fields a reply sends from where they are (rnnd_call_reply_lent):
// released once the last slice that refers to it is gone.
struct lend {
    const uint8_t *lo, *hi;
    void *block;
    void (*release)(void *);
    _Atomic int refs;
};

static void lend_unref(void *p) {
    struct lend *l = p;
    if (atomic_fetch_sub(&l->refs, 1) == 1) {
        l->release(l->block);
        free(l);
    }
}

// Fields of at least this many bytes in a lent block are referred to, not copied: a 1024-row
// Step's fp32 output is 512 KB, which the copy took ~30-50 us of a reply thread to pack.
#define LEND_MIN_BYTES  (64 << 10)
#define LEND_MAX_FIELDS 16

// protobuf-c's packing into slices: runs of small fields copied into one allocation (sized by a
// first pass), each lent field a slice of its own.
struct lend_pack {
    ProtobufCBuffer base;
    struct lend *lend;
    bool count;     // first pass: count the bytes to copy
    size_t copied;  // bytes copied (or to copy)
    uint8_t *run;   // the copied bytes, NULL when counting
    grpc_slice all; // ... as a slice
    size_t cut;     // where the run not yet in slices[] starts
    grpc_slice slices[2 * LEND_MAX_FIELDS + 1];
    size_t n, lent;
};

static bool lendable(const struct lend_pack *p, size_t len, const uint8_t *data) {
    const struct lend *l = p->lend;
    return len >= LEND_MIN_BYTES && data >= l->lo && data + len <= l->hi &&
           p->lent < LEND_MAX_FIELDS;
}

static void lend_append(ProtobufCBuffer *b, size_t len, const uint8_t *data) {
    struct lend_pack *p = (struct lend_pack *)b;
    if (lendable(p, len, data)) {
        p->lent++;
        if (p->count)
            return;
        if (p->copied > p->cut)
            p->slices[p->n++] = grpc_slice_sub(p->all, p->cut, p->copied);
        p->cut = p->copied;
        atomic_fetch_add(&p->lend->refs, 1);
        p->slices[p->n++] = grpc_slice_new_with_user_data((void *)data, len, lend_unref, p->lend);
        return;
    }
    if (!p->count)
        memcpy(p->run + p->copied, data, len);
    p->copied += len;
}

// encode(m), with m's bytes fields of LEND_MIN_BYTES or more inside l's block referred to by the
// byte buffer instead of copied into it; l is released once gRPC is done with them. Two passes,
// as encode's: the first sizes the copied runs, the second fills them.
static grpc_byte_buffer *encode_lent(const ProtobufCMessage *m, struct lend *l) {
    struct lend_pack p = {.base.append = lend_append, .lend = l, .count = true};
    protobuf_c_message_pack_to_buffer(m, &p.base);
    p.all = grpc_slice_malloc(p.copied);
    p.run = GRPC_SLICE_START_PTR(p.all);
    p.count = false;
    p.copied = p.lent = 0;
    protobuf_c_message_pack_to_buffer(m, &p.base);
    if (p.copied > p.cut || p.n == 0)
        p.slices[p.n++] = grpc_slice_sub(p.all, p.cut, p.copied);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(p.slices, p.n);
    for (size_t i = 0; i < p.n; i++)
        grpc_slice_unref(p.slices[i]);
    grpc_slice_unref(p.all);
    lend_unref(l); // encode's own reference
    return bb;
}

// The received message of method m, decoded by request.c; NULL when absent or malformed.
static ProtobufCMessage *decode(enum rnnd_method m, grpc_byte_buffer *bb) {
    grpc_byte_buffer_reader r;
    if (bb == NULL || !grpc_byte_buffer_reader_init(&r, bb))
        return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    rnnd_histogram_observe(&rnnd_metrics.request_size, GRPC_SLICE_LENGTH(s));
    ProtobufCMessage *msg = rnnd_request_decode(m, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s));
    grpc_slice_unref(s);
    return msg;
}

// True when the received message bb is over --max-message-mb, with the client's message in msg.
// gRPC's own limit is off: it would refuse such a request before rnnd sees it (uncounted, with
// no advice), and only after buffering all of it, as here.
static bool too_large(struct rnnd_rpc *rpc, grpc_byte_buffer *bb, char *msg, size_t len) {
    size_t n = bb ? grpc_byte_buffer_length(bb) : 0;
    if (n <= rpc->max_message_bytes)
        return false;
    rnnd_metrics_limit_hit(RNND_LIMIT_MESSAGE);
    snprintf(msg, len,
             "the request is %.1f MiB, over --max-message-mb %zu; send fewer rows or steps per "
             "call, or raise --max-message-mb",
             (double)n / 1048576.0, rpc->max_message_bytes >> 20);
    return true;
}

// Starts a batch on c under the gate, taking a reference for it. False when the queue is
// closing or gRPC refused (then the tag will never complete).
static bool call_start(struct rnnd_call *c, const grpc_op *ops, size_t n, struct tag *tag) {
    struct rnnd_rpc *rpc = c->rpc;
    pthread_rwlock_rdlock(&rpc->gate);
    if (!rpc->cq_open) {
        pthread_rwlock_unlock(&rpc->gate);
        return false;
    }
    atomic_fetch_add(&c->refs, 1);
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    pthread_rwlock_unlock(&rpc->gate);
    if (e != GRPC_CALL_OK) {
        rnnd_log(RNND_LOG_WARN, "grpc_call_start_batch: error %d", (int)e);
        atomic_fetch_sub(&c->refs, 1);
        return false;
    }
    return true;
}

static struct rnnd_call *call_new(struct rnnd_rpc *rpc, int mi) {
    struct rnnd_call *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->rpc = rpc;
    c->mi = mi;
    atomic_init(&c->refs, 1);
    grpc_metadata_array_init(&c->md);
    if (mi < 0)
        grpc_call_details_init(&c->details);
    pthread_mutex_init(&c->lock, NULL);
    c->t_new = (struct tag){TAG_NEW, c};
    c->t_close = (struct tag){TAG_CLOSE, c};
    c->t_send = (struct tag){TAG_SEND, c};
    c->t_status = (struct tag){TAG_STATUS, c};
    c->t_recv = (struct tag){TAG_RECV, c};
    c->watch_last = -1;
    return c;
}

static void call_free(struct rnnd_call *c) {
    struct rnnd_rpc *rpc = c->rpc;
    call_done(c); // a call abandoned without a status batch (the queue was closing)
    if (c->listed) {
        pthread_mutex_lock(&rpc->live_lock);
        if (c->lprev)
            c->lprev->lnext = c->lnext;
        else
            rpc->live = c->lnext;
        if (c->lnext)
            c->lnext->lprev = c->lprev;
        pthread_mutex_unlock(&rpc->live_lock);
    }
    rnnd_shm_use_free(c->shm); // before the request, whose tensors it restores
    if (c->request)
        protobuf_c_message_free_unpacked(c->request, NULL);
    if (c->payload)
        grpc_byte_buffer_destroy(c->payload);
    if (c->send_buf)
        grpc_byte_buffer_destroy(c->send_buf);
    while (c->outq) {
        struct outmsg *o = c->outq;
        c->outq = o->next;
        grpc_byte_buffer_destroy(o->buf);
        free(o);
    }
    free(c->end_msg);
    if (c->has_details)
        grpc_slice_unref(c->status_details);
    grpc_metadata_array_destroy(&c->md);
    if (c->mi < 0)
        grpc_call_details_destroy(&c->details);
    if (c->call)
        grpc_call_unref(c->call);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

static void call_unref(struct rnnd_call *c) {
    if (atomic_fetch_sub(&c->refs, 1) == 1)
        call_free(c);
}

// Tells the owner once draining and no call of ours is unfinished (every reply and status has
// left), so that it shuts the gRPC server down (rnnd_rpc_cancel_all): the connections are closed
// (grpc_server_cancel_all_calls) and the server shut down right after. gRPC cancels (CANCELLED)
// any call that reaches a server after its shutdown began (grpc/grpc#41785), so the shutdown
// waits until every call in flight has been answered (new ones get UNAVAILABLE from us
// meanwhile) and closes the connections before it: a call still on its way then fails as
// UNAVAILABLE on the client, as a drain should.
static void maybe_shutdown(struct rnnd_rpc *rpc) {
    if (!atomic_load(&rpc->draining) || atomic_load(&rpc->active) != 0 ||
        atomic_exchange(&rpc->drained_sent, 1))
        return;
    rpc->drained(rpc->stopped_ctx);
}

// Gives back the call's --max-streams slot (once).
static void slot_release(struct rnnd_call *c) {
    if (atomic_exchange(&c->limited, false)) {
        atomic_fetch_sub(&c->rpc->calls, 1);
        // Added and subtracted (not stored): the gauge cannot be left stale by two threads
        // storing their snapshots out of order.
        atomic_fetch_sub_explicit(&rnnd_metrics.streams_active, 1, memory_order_relaxed);
    }
}

// Starts the status batch (with initial metadata if none went out yet). Call with c->lock held
// and nothing being sent. Returns true: the caller drops the owner reference after unlocking.
static bool status_start(struct rnnd_call *c, int code, const char *msg) {
    if (c->status_sent)
        return false;
    c->status_sent = true;
    c->has_details = true;
    c->status_details = grpc_slice_from_copied_string(msg ? msg : "");
    grpc_op ops[2];
    memset(ops, 0, sizeof(ops));
    size_t n = 0;
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->md_sent = true;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n].data.send_status_from_server.status_details = &c->status_details;
    n++;
    // Counted before the status leaves, so a client that reads /metrics right after its reply
    // sees its call. A StepStream counts each message as a request (in rnnd_call_reply), so its
    // end counts only when it is a failure.
    int mi = c->mi;
    bool stream = mi >= 0 && methods[mi].kind == KIND_STEP_STREAM;
    if (!stream || code != GRPC_STATUS_OK)
        rnnd_metrics_request(mi >= 0 ? methods[mi].metric : RNND_METHOD_UNKNOWN, code,
                             rnnd_now_ns() - (stream && c->msg_ns ? c->msg_ns : c->start_ns));
    c->send_ns = rnnd_now_ns();
    call_start(c, ops, n, &c->t_status);
    if (code != GRPC_STATUS_OK)
        rnnd_log(RNND_LOG_DEBUG, "%s -> %d: %s", mi >= 0 ? methods[mi].path : "unknown", code,
                 msg ? msg : "");
    return true;
}

// Adds n (negative: gives back) to the bytes held for replies, by c (c->lock held) and in all.
static void reply_add(struct rnnd_call *c, int64_t n) {
    c->reply_held += (size_t)n;
    atomic_fetch_add(&c->rpc->reply_bytes, (size_t)n);
    atomic_fetch_add_explicit(&rnnd_metrics.reply_bytes, n, memory_order_relaxed);
}

// The call is over on our side: the batch with its status completed (its reply has left), or it
// was abandoned. Gives back everything it held, once; the last call out lets a drain finish.
static void call_done(struct rnnd_call *c) {
    if (atomic_exchange(&c->done, true))
        return;
    struct rnnd_rpc *rpc = c->rpc;
    slot_release(c);
    pthread_mutex_lock(&c->lock);
    reply_add(c, -(int64_t)c->reply_held);
    c->reserved = 0;
    bool watching = c->watching;
    pthread_mutex_unlock(&c->lock);
    if (watching) {
        atomic_fetch_sub(&rpc->watches, 1);
        atomic_fetch_sub_explicit(&rnnd_metrics.health_watches, 1, memory_order_relaxed);
    }
    if (c->counted) {
        c->counted = false;
        atomic_fetch_sub(&rpc->active, 1);
        maybe_shutdown(rpc);
    }
}

// Ends the call with the status for err (0: OK) and msg once queued messages are out. Call with
// c->lock held; returns true when the caller must drop the owner reference after unlocking.
static bool end_locked(struct rnnd_call *c, int err, const char *msg) {
    if (c->status_sent || c->ending)
        return false;
    int code = rnnd_rpc_status(err);
    if (c->sending || c->outq) {
        c->ending = true;
        c->end_code = code;
        free(c->end_msg); // an end that on_close replaced (the peer left during a drain)
        c->end_msg = strdup(msg ? msg : "");
        return false;
    }
    return status_start(c, code, msg);
}

// Drops the owner reference when the status batch started (drop): the call is then finished
// by the batch's completion (call_done).
static void finish_owner(struct rnnd_call *c, bool drop) {
    if (drop)
        call_unref(c);
}

// Sends the next queued message if nothing is in flight. Call with c->lock held; returns true
// when a pending end started the status (drop the owner reference after unlocking).
static bool send_next_locked(struct rnnd_call *c) {
    if (c->sending || c->status_sent)
        return false;
    if (c->outq == NULL)
        return c->ending ? status_start(c, c->end_code, c->end_msg) : false;
    struct outmsg *o = c->outq;
    c->outq = o->next;
    if (c->outq == NULL)
        c->outq_tail = NULL;
    c->send_buf = o->buf;
    c->send_bytes = o->bytes;
    free(o);
    grpc_op ops[2];
    memset(ops, 0, sizeof(ops));
    size_t n = 0;
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->md_sent = true;
    }
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->send_buf;
    n++;
    c->send_ns = rnnd_now_ns();
    c->sending = call_start(c, ops, n, &c->t_send);
    if (!c->sending) {
        grpc_byte_buffer_destroy(c->send_buf);
        c->send_buf = NULL;
        // The queue is closing: abandon the call.
        if (!c->status_sent) {
            c->status_sent = true;
            return true;
        }
    }
    return false;
}

// Queues bb, whose `bytes` c already holds of the reply budget (reply_add).
static void enqueue_locked(struct rnnd_call *c, grpc_byte_buffer *bb, size_t bytes) {
    struct outmsg *o = malloc(sizeof(*o));
    if (o == NULL) {
        grpc_byte_buffer_destroy(bb);
        return;
    }
    o->buf = bb;
    o->bytes = bytes;
    o->next = NULL;
    if (c->outq_tail)
        c->outq_tail->next = o;
    else
        c->outq = o;
    c->outq_tail = o;
}

static void recv_start_locked(struct rnnd_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->payload;
    call_start(c, &op, 1, &c->t_recv);
}

static void list_call(struct rnnd_call *c) {
    struct rnnd_rpc *rpc = c->rpc;
    pthread_mutex_lock(&rpc->live_lock);
    c->lnext = rpc->live;
    c->lprev = NULL;
    if (rpc->live)
        rpc->live->lprev = c;
    rpc->live = c;
    c->listed = true;
    pthread_mutex_unlock(&rpc->live_lock);
}

static const char *not_serving_msg(struct rnnd_rpc *rpc) {
    return atomic_load(&rpc->draining)
               ? "rnnd is shutting down; retry on another replica"
               : "rnnd is starting up (loading the model); retry in a moment";
}

// ---------------------------------------------------------------------------------------------
// Finishing calls (handlers, any thread)

int rnnd_call_reserve(struct rnnd_call *c, size_t bytes, char *err, size_t errlen) {
    struct rnnd_rpc *rpc = c->rpc;
    size_t held = atomic_load(&rpc->reply_bytes);
    do {
        if (held > rpc->max_reply_bytes || bytes > rpc->max_reply_bytes - held) {
            rnnd_metrics_limit_hit(RNND_LIMIT_REPLY_BYTES);
            snprintf(err, errlen,
                     "replies not yet read by their clients hold %.1f MiB and this one needs "
                     "%.1f MiB, over --max-reply-mb %zu; read replies as they arrive, retry "
                     "after a short backoff, or raise --max-reply-mb",
                     (double)held / 1048576.0, (double)bytes / 1048576.0,
                     rpc->max_reply_bytes >> 20);
            return RNND_EFULL;
        }
    } while (!atomic_compare_exchange_weak(&rpc->reply_bytes, &held, held + bytes));
    atomic_fetch_add_explicit(&rnnd_metrics.reply_bytes, (int64_t)bytes, memory_order_relaxed);
    pthread_mutex_lock(&c->lock);
    c->reply_held += bytes;
    c->reserved += bytes;
    pthread_mutex_unlock(&c->lock);
    return 0;
}

void rnnd_call_reply(struct rnnd_call *c, const ProtobufCMessage *reply) {
    rnnd_call_reply_lent(c, reply, NULL, 0, NULL);
}

void rnnd_call_reply_lent(struct rnnd_call *c, const ProtobufCMessage *reply, void *block,
                          size_t size, void (*release)(void *)) {
    // A block too small to hold a lent field, or no memory for the lend: the reply is copied as
    // any other and the block released after.
    struct lend *l = block && size >= LEND_MIN_BYTES ? malloc(sizeof(*l)) : NULL;
    if (l)
        *l = (struct lend){block, (uint8_t *)block + size, block, release, 1};
    // Tensors bound for the request's reply_region are written there and leave the message while
    // it is packed; the handler's reply is as it was when this returns.
    ProtobufCMessage *m = (ProtobufCMessage *)reply;
    bool placed = c->shm && rnnd_shm_place(c->shm, m);
    size_t dev_len;
    if (!placed && rnnd_shm_use_device_reply(c->shm, &dev_len)) {
        // Its tensors are in GPU memory, which the packing below cannot read.
        if (l)
            lend_unref(l);
        else if (block)
            release(block);
        rnnd_call_fail(c, RNND_ENOMEM, "out of host memory placing the reply");
        return;
    }
    grpc_byte_buffer *bb = l ? encode_lent(reply, l) : encode(reply);
    if (block && !l)
        release(block);
    if (placed)
        rnnd_shm_unplace(c->shm);
    size_t n = grpc_byte_buffer_length(bb);
    bool drop = false;
    pthread_mutex_lock(&c->lock);
    // The reply takes the place of what was reserved for it.
    reply_add(c, (int64_t)n - (int64_t)c->reserved);
    c->reserved = 0;
    bool stream = c->mi >= 0 && methods[c->mi].kind == KIND_STEP_STREAM;
    if (stream) {
        c->inflight = false;
        c->last_msg_ns = rnnd_now_ns();
        rnnd_metrics_request(RNND_METHOD_STEP_STREAM, GRPC_STATUS_OK, c->last_msg_ns - c->msg_ns);
    }
    if (c->status_sent) {
        reply_add(c, -(int64_t)n);
        pthread_mutex_unlock(&c->lock);
        grpc_byte_buffer_destroy(bb);
        return;
    }
    if (stream) {
        enqueue_locked(c, bb, n);
        drop = send_next_locked(c);
        if (!drop && !c->status_sent) {
            if (atomic_load(&c->rpc->streams_ending))
                drop = end_locked(c, RNND_EUNAVAIL, not_serving_msg(c->rpc));
            else if (c->half_closed)
                drop = end_locked(c, 0, "");
            else if (atomic_load(&c->cancelled))
                drop = end_locked(c, RNND_ECANCELED, "cancelled");
            else
                recv_start_locked(c);
        }
        pthread_mutex_unlock(&c->lock);
        finish_owner(c, drop);
        return;
    }
    // Unary: initial metadata, message and status in one batch.
    c->status_sent = true;
    c->md_sent = true;
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[2].data.send_status_from_server.status = GRPC_STATUS_OK;
    c->send_buf = bb; // destroyed with the call; its bytes are given back by call_done
    rnnd_metrics_request(methods[c->mi].metric, GRPC_STATUS_OK, rnnd_now_ns() - c->start_ns);
    c->send_ns = rnnd_now_ns();
    call_start(c, ops, 3, &c->t_status);
    pthread_mutex_unlock(&c->lock);
    finish_owner(c, true);
}

void rnnd_call_fail(struct rnnd_call *c, int err, const char *msg) {
    pthread_mutex_lock(&c->lock);
    c->inflight = false;
    reply_add(c, -(int64_t)c->reserved);
    c->reserved = 0;
    bool drop = end_locked(c, err, msg);
    pthread_mutex_unlock(&c->lock);
    finish_owner(c, drop);
}

const ProtobufCMessage *rnnd_call_request(const struct rnnd_call *c) {
    return c->request;
}

const _Atomic int *rnnd_call_cancelled(struct rnnd_call *c) {
    return &c->cancelled;
}

static uint64_t hash_bytes(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

bool rnnd_call_peer_local(struct rnnd_call *c) {
    char *peer = grpc_call_get_peer(c->call);
    bool local = rnnd_shm_peer_local(peer);
    gpr_free(peer);
    return local;
}

// Resolves the region spans of c's request (shm.h). 0, or an RNND_E* with the reason in msg.
static int shm_resolve(struct rnnd_call *c, char *msg, size_t len) {
    if (!rnnd_shm_wanted(c->request))
        return 0;
    // CUDA regions only where the service reads nothing on the host (shm.h).
    enum rnnd_method mm = methods[c->mi].metric;
    unsigned dev_ok = mm == RNND_METHOD_BACKWARD  ? RNND_SHM_DEV_TENSORS | RNND_SHM_DEV_REPLY
                      : mm == RNND_METHOD_FORWARD ? RNND_SHM_DEV_REPLY
                                                  : 0;
    return rnnd_shm_resolve(c->rpc->shm, c->request, rnnd_call_peer_local(c), dev_ok, &c->shm, msg,
                            len);
}

bool rnnd_call_device_in(const struct rnnd_call *c) {
    return rnnd_shm_use_device_in(c->shm);
}

char *rnnd_call_device_reply(const struct rnnd_call *c, size_t *len) {
    return rnnd_shm_use_device_reply(c->shm, len);
}

bool rnnd_call_device_async(const struct rnnd_call *c) {
    return rnnd_shm_use_async(c->shm);
}

bool rnnd_call_host_in(const struct rnnd_call *c) {
    return rnnd_shm_use_host_in(c->shm);
}

char *rnnd_call_host_reply(const struct rnnd_call *c, size_t *len, bool *pinned) {
    return rnnd_shm_use_host_reply(c->shm, len, pinned);
}

uint64_t rnnd_call_source(struct rnnd_call *c) {
    if (!c->source_set) {
        if (c->mi >= 0 && methods[c->mi].kind == KIND_STEP_STREAM) {
            c->source = (uint64_t)(uintptr_t)c * 0x9e3779b97f4a7c15ull;
        } else {
            char *peer = grpc_call_get_peer(c->call);
            c->source = peer ? hash_bytes(peer) : 0;
            gpr_free(peer);
        }
        c->source_set = true;
    }
    return c->source;
}

// ---------------------------------------------------------------------------------------------
// Health

static int health_status_of(struct rnnd_rpc *rpc, bool known) {
    if (!known)
        return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    return atomic_load(&rpc->serving) && !atomic_load(&rpc->draining)
               ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
               : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static void health_check(struct rnnd_call *c) {
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)c->request;
    const char *svc = req->service ? req->service : "";
    if (!rnnd_request_health_known(svc)) {
        char msg[256];
        snprintf(msg, sizeof(msg), "unknown service '%.100s'; rnnd reports \"\" and rnnd.v1.Rnn",
                 svc);
        rnnd_call_fail(c, RNND_ENOTFOUND, msg);
        return;
    }
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = health_status_of(c->rpc, true);
    rnnd_call_reply(c, &r.base);
}

// Queues the watcher's current status if it changed. c->lock held.
static bool watch_update_locked(struct rnnd_call *c) {
    int st = health_status_of(c->rpc, c->watch_known);
    if (st == c->watch_last || c->status_sent || c->ending)
        return false;
    c->watch_last = st;
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = st;
    grpc_byte_buffer *bb = encode(&r.base);
    size_t n = grpc_byte_buffer_length(bb);
    reply_add(c, (int64_t)n);
    enqueue_locked(c, bb, n);
    return send_next_locked(c);
}

// Takes one of the max places counted in *n; when none is free, fails c with RESOURCE_EXHAUSTED
// (the message names what is full, the flag and what to do) and counts the refusal against
// limit. True when the place was taken (the caller gives it back with atomic_fetch_sub).
static bool slot_take(struct rnnd_call *c, _Atomic int *n, int max, enum rnnd_limit limit,
                      const char *what, const char *flag, const char *advice) {
    if (atomic_fetch_add(n, 1) < max)
        return true;
    atomic_fetch_sub(n, 1);
    rnnd_metrics_limit_hit(limit);
    char msg[256];
    snprintf(msg, sizeof(msg), "%d %s, --%s %d; %s or raise --%s", max, what, flag, max, advice,
             flag);
    rnnd_call_fail(c, RNND_EFULL, msg);
    return false;
}

static void health_watch(struct rnnd_call *c) {
    struct rnnd_rpc *rpc = c->rpc;
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)c->request;
    // Watch needs no token (probes), so its streams have a bound of their own.
    if (!slot_take(c, &rpc->watches, rpc->max_watches, RNND_LIMIT_HEALTH_WATCHES,
                   "health Watch streams are open", "max-health-watches",
                   "use Check, close unused Watch streams"))
        return;
    atomic_fetch_add_explicit(&rnnd_metrics.health_watches, 1, memory_order_relaxed);
    pthread_mutex_lock(&c->lock);
    c->watching = true;
    c->watch_known = rnnd_request_health_known(req->service ? req->service : "");
    bool drop = watch_update_locked(c);
    if (!drop && atomic_load(&c->rpc->draining))
        drop = end_locked(c, RNND_EUNAVAIL, not_serving_msg(c->rpc));
    pthread_mutex_unlock(&c->lock);
    finish_owner(c, drop);
}

// ---------------------------------------------------------------------------------------------
// Bearer tokens

// True when the call carries "authorization: Bearer <token>" (or no token is configured). The
// comparison takes the same time wherever the first difference is.
static bool auth_ok(const struct rnnd_call *c) {
    const char *want = c->rpc->auth;
    if (want == NULL)
        return true;
    size_t wn = strlen(want);
    bool ok = false;
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) != 13 ||
            memcmp(GRPC_SLICE_START_PTR(m->key), "authorization", 13) != 0)
            continue;
        size_t n = GRPC_SLICE_LENGTH(m->value);
        const unsigned char *v = GRPC_SLICE_START_PTR(m->value);
        unsigned diff = n != wn;
        for (size_t k = 0; k < wn; k++)
            diff |= (unsigned)(k < n ? v[k] : 0) ^ (unsigned char)want[k];
        ok = ok || diff == 0;
    }
    return ok;
}

// ---------------------------------------------------------------------------------------------
// Completions (the completion-queue thread)

static void on_new(struct rnnd_call *c, bool ok) {
    struct rnnd_rpc *rpc = c->rpc;
    if (!ok) { // the server is shutting down: this request was never matched
        call_unref(c);
        return;
    }
    post_request(rpc, c->mi);
    c->start_ns = rnnd_now_ns();
    c->last_msg_ns = c->start_ns;
    c->counted = true;
    atomic_fetch_add(&rpc->active, 1);
    list_call(c);
    {
        grpc_op op;
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        op.data.recv_close_on_server.cancelled = &c->close_cancelled;
        call_start(c, &op, 1, &c->t_close);
    }
    // Health stays open to probes (they carry no token); everything else needs it.
    bool health = c->mi >= 0 && (methods[c->mi].kind == KIND_HEALTH_CHECK ||
                                 methods[c->mi].kind == KIND_HEALTH_WATCH);
    if (!health && !auth_ok(c)) {
        rnnd_call_fail(c, RNND_EAUTH,
                       "missing or wrong bearer token; send metadata \"authorization: Bearer "
                       "<token>\" with the token of --auth-token-file");
        return;
    }
    if (c->mi < 0) {
        char msg[256];
        char *method = grpc_slice_to_c_string(c->details.method);
        snprintf(msg, sizeof(msg),
                 "unknown method %.120s; rnnd serves rnnd.v1.Rnn and grpc.health.v1.Health",
                 method);
        gpr_free(method);
        rnnd_call_fail(c, RNND_ENOTSUP, msg);
        return;
    }
    const struct method *m = &methods[c->mi];
    if (m->kind == KIND_UNARY || m->kind == KIND_STEP_STREAM) {
        // A slot for as long as the call runs; refused at once when none is free, so that a
        // flood of calls (or of idle streams) cannot grow memory or starve the engine.
        if (!slot_take(c, &rpc->calls, rpc->max_streams, RNND_LIMIT_STREAMS,
                       "rnnd.v1 calls are in progress", "max-streams",
                       "retry after a short backoff, close idle StepStreams"))
            return;
        atomic_store(&c->limited, true);
        atomic_fetch_add_explicit(&rnnd_metrics.streams_active, 1, memory_order_relaxed);
    }
    if (m->kind == KIND_STEP_STREAM) {
        if (!atomic_load(&rpc->serving) || atomic_load(&rpc->draining)) {
            rnnd_call_fail(c, RNND_EUNAVAIL, not_serving_msg(rpc));
            return;
        }
        pthread_mutex_lock(&c->lock);
        recv_start_locked(c);
        pthread_mutex_unlock(&c->lock);
        return;
    }
    char msg[512];
    bool big = too_large(rpc, c->payload, msg, sizeof(msg));
    c->request = big ? NULL : decode(m->metric, c->payload);
    if (c->payload) {
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
    }
    if (big) {
        rnnd_call_fail(c, RNND_EFULL, msg);
        return;
    }
    if (c->request == NULL) {
        snprintf(msg, sizeof(msg),
                 "the request of %s is missing or does not decode as %s; send a valid message",
                 m->path, rnnd_request_descriptor(m->metric)->name);
        rnnd_call_fail(c, RNND_EINVAL, msg);
        return;
    }
    switch (m->kind) {
        case KIND_HEALTH_CHECK:
            health_check(c);
            return;
        case KIND_HEALTH_WATCH:
            health_watch(c);
            return;
        default:
            break;
    }
    if (!atomic_load(&rpc->serving) || atomic_load(&rpc->draining)) {
        rnnd_call_fail(c, RNND_EUNAVAIL, not_serving_msg(rpc));
        return;
    }
    int rc = shm_resolve(c, msg, sizeof(msg));
    if (rc) {
        rnnd_call_fail(c, rc, msg);
        return;
    }
    m->handler(rpc->service, c, c->request);
}

static void on_recv(struct rnnd_call *c, bool ok) {
    struct rnnd_rpc *rpc = c->rpc;
    const struct method *m = &methods[c->mi];
    pthread_mutex_lock(&c->lock);
    if (!ok || c->payload == NULL) { // the client is done sending (or gone)
        c->half_closed = true;
        bool drop = c->inflight ? false : end_locked(c, 0, "");
        pthread_mutex_unlock(&c->lock);
        finish_owner(c, drop);
        return;
    }
    if (c->status_sent || c->ending) {
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
        pthread_mutex_unlock(&c->lock);
        return;
    }
    rnnd_shm_use_free(c->shm);
    c->shm = NULL;
    if (c->request)
        protobuf_c_message_free_unpacked(c->request, NULL);
    char msg[512];
    bool big = too_large(rpc, c->payload, msg, sizeof(msg));
    c->request = big ? NULL : decode(m->metric, c->payload);
    grpc_byte_buffer_destroy(c->payload);
    c->payload = NULL;
    bool drop = false;
    int rc;
    if (big) {
        drop = end_locked(c, RNND_EFULL, msg);
    } else if (c->request == NULL) {
        drop = end_locked(c, RNND_EINVAL,
                          "a StepStream message does not decode as rnnd.v1.StepRequest");
    } else if ((rc = shm_resolve(c, msg, sizeof(msg))) != 0) {
        drop = end_locked(c, rc, msg);
    } else if (atomic_load(&rpc->streams_ending)) {
        drop = end_locked(c, RNND_EUNAVAIL, not_serving_msg(rpc));
    } else {
        c->inflight = true;
        c->msg_ns = rnnd_now_ns();
        c->last_msg_ns = c->msg_ns;
    }
    bool run = c->inflight;
    pthread_mutex_unlock(&c->lock);
    if (run)
        m->handler(rpc->service, c, c->request);
    finish_owner(c, drop);
}

static void on_send(struct rnnd_call *c) {
    pthread_mutex_lock(&c->lock);
    c->sending = false;
    c->send_ns = 0;
    if (c->send_buf) {
        grpc_byte_buffer_destroy(c->send_buf);
        c->send_buf = NULL;
        reply_add(c, -(int64_t)c->send_bytes);
        c->send_bytes = 0;
    }
    bool drop = send_next_locked(c);
    pthread_mutex_unlock(&c->lock);
    finish_owner(c, drop);
}

static void on_close(struct rnnd_call *c) {
    if (c->close_cancelled)
        atomic_store(&c->cancelled, 1);
    bool drop = false;
    pthread_mutex_lock(&c->lock);
    // A watcher or an idle stream has nobody else to end it.
    if (c->watching || (c->mi >= 0 && methods[c->mi].kind == KIND_STEP_STREAM && !c->inflight)) {
        if (!c->status_sent) {
            // Drop what is queued: the peer is gone.
            c->ending = false;
            while (c->outq) {
                struct outmsg *o = c->outq;
                c->outq = o->next;
                grpc_byte_buffer_destroy(o->buf);
                free(o);
            }
            c->outq_tail = NULL;
            if (!c->sending)
                drop = status_start(c, rnnd_rpc_status(RNND_ECANCELED), "cancelled");
            else
                drop = end_locked(c, RNND_ECANCELED, "cancelled");
        }
    }
    pthread_mutex_unlock(&c->lock);
    finish_owner(c, drop);
}

static void *cq_main(void *arg) {
    struct rnnd_rpc *rpc = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(rpc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        struct tag *t = ev.tag;
        struct rnnd_call *c = t->call;
        switch (t->kind) {
            case TAG_NEW:
                on_new(c, ev.success);
                break;
            case TAG_CLOSE:
                on_close(c);
                call_unref(c);
                break;
            case TAG_SEND:
                on_send(c);
                call_unref(c);
                break;
            case TAG_STATUS:
                call_done(c);
                call_unref(c);
                break;
            case TAG_RECV:
                on_recv(c, ev.success);
                call_unref(c);
                break;
            case TAG_SHUTDOWN:
                rnnd_log(RNND_LOG_DEBUG, "grpc server shut down");
                pthread_rwlock_wrlock(&rpc->gate);
                rpc->cq_open = false;
                grpc_completion_queue_shutdown(rpc->cq);
                pthread_rwlock_unlock(&rpc->gate);
                break;
        }
    }
    // The last thread out reports the stop.
    if (atomic_fetch_sub(&rpc->alive, 1) == 1 && rpc->stopped)
        rpc->stopped(rpc->stopped_ctx);
    return NULL;
}

// Posts one request for method mi (-1: the catch-all).
static void post_request(struct rnnd_rpc *rpc, int mi) {
    struct rnnd_call *c = call_new(rpc, mi);
    if (c == NULL) {
        rnnd_log(RNND_LOG_ERROR, "out of memory posting a gRPC request");
        return;
    }
    pthread_rwlock_rdlock(&rpc->gate);
    grpc_call_error e = GRPC_CALL_ERROR;
    if (rpc->cq_open && !rpc->server_shut) {
        if (mi >= 0)
            e = grpc_server_request_registered_call(
                rpc->server, rpc->handles[mi], &c->call, &c->deadline, &c->md,
                methods[mi].kind == KIND_STEP_STREAM ? NULL : &c->payload, rpc->cq, rpc->cq,
                &c->t_new);
        else
            e = grpc_server_request_call(rpc->server, &c->call, &c->details, &c->md, rpc->cq,
                                         rpc->cq, &c->t_new);
    }
    pthread_rwlock_unlock(&rpc->gate);
    if (e != GRPC_CALL_OK)
        call_free(c);
}

// ---------------------------------------------------------------------------------------------
// Connections (--max-connections)
//
// gRPC 1.51 has no bound on connections (grpc.max_allowed_incoming_connections came later) and no
// hook that can refuse one as it arrives: a failing socket mutator stops the whole listener. Its
// listener accepts through libc's accept4, so rnnd defines accept4 itself (the executable's
// definition wins over libc's for every library) and passes each call through to the system call.
// For a socket that gRPC's listener accepted while --max-connections are open, the socket is
// closed at once (the client sees its connection reset, and retries later) and the next one
// taken, so gRPC only ever sees the connections it may keep, then EAGAIN.
//
// Connections are remembered as (descriptor, inode) pairs; gRPC closes its sockets itself, so an
// entry whose descriptor no longer names the same socket is gone. The list is checked when it is
// full and, for the gauge, about once a second (rnnd_rpc_housekeeping).

#define CONN_LISTENERS (2 * RNND_RPC_MAX_LISTEN) // a host name may bind IPv4 and IPv6

struct conn {
    int fd;
    ino_t ino;
};

static struct {
    pthread_mutex_t lock;
    int listeners[CONN_LISTENERS]; // gRPC's listening sockets
    int nlisteners;
    int max;
    struct conn *v; // (max)
    int n;
    uint64_t checked_ns, warned_ns;
    uint64_t refused; // since the last warning
} conns = {.lock = PTHREAD_MUTEX_INITIALIZER};

// Drops the entries whose socket is closed. conns.lock held.
static void conns_prune_locked(void) {
    int k = 0;
    for (int i = 0; i < conns.n; i++) {
        struct stat st;
        if (fstat(conns.v[i].fd, &st) == 0 && st.st_ino == conns.v[i].ino)
            conns.v[k++] = conns.v[i];
    }
    conns.n = k;
    conns.checked_ns = rnnd_now_ns();
    atomic_store_explicit(&rnnd_metrics.connections, k, memory_order_relaxed);
}

// Refreshes the gauge if it was last checked over a second ago (or always when force).
static void conns_refresh(bool force) {
    pthread_mutex_lock(&conns.lock);
    if (conns.v && (force || rnnd_now_ns() - conns.checked_ns > 1000000000ull))
        conns_prune_locked();
    pthread_mutex_unlock(&conns.lock);
}

// True to keep the socket fd that listener accepted.
static bool conns_admit(int listener, int fd) {
    pthread_mutex_lock(&conns.lock);
    bool ours = false;
    for (int i = 0; i < conns.nlisteners; i++)
        ours = ours || conns.listeners[i] == listener;
    if (!ours || conns.v == NULL) {
        pthread_mutex_unlock(&conns.lock);
        return true;
    }
    if (conns.n == conns.max)
        conns_prune_locked();
    struct stat st;
    bool keep = conns.n < conns.max && fstat(fd, &st) == 0;
    if (keep) {
        conns.v[conns.n++] = (struct conn){fd, st.st_ino};
        atomic_store_explicit(&rnnd_metrics.connections, conns.n, memory_order_relaxed);
    } else {
        rnnd_metrics_limit_hit(RNND_LIMIT_CONNECTIONS);
        conns.refused++;
        // One warning per 10 s at most: a flood of connections must not flood the log too.
        uint64_t now = rnnd_now_ns();
        if (conns.warned_ns == 0 || now - conns.warned_ns > 10000000000ull) {
            rnnd_log(RNND_LOG_WARN,
                     "%d gRPC connections are open, --max-connections %d: closed %" PRIu64
                     " new one(s); clients should share connections, or raise --max-connections",
                     conns.n, conns.max, conns.refused);
            conns.warned_ns = now;
            conns.refused = 0;
        }
    }
    pthread_mutex_unlock(&conns.lock);
    return keep;
}

int accept4(int listener, struct sockaddr *addr, socklen_t *addrlen, int flags) {
    for (;;) {
        int fd = (int)syscall(SYS_accept4, listener, addr, addrlen, flags);
        if (fd < 0 || conns_admit(listener, fd))
            return fd;
        close(fd);
    }
}

// Adds to out (up to cap) the listening sockets of this process; returns how many there are.
static int listening_sockets(int *out, int cap) {
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        int on = 0;
        socklen_t len = sizeof(on);
        if (e->d_name[0] == '.' || fd == dirfd(d) ||
            getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &len) != 0 || !on)
            continue;
        if (n < cap)
            out[n] = fd;
        n++;
    }
    closedir(d);
    return n;
}

// Starts counting the connections of the listening sockets gRPC opened since `before` (n of them)
// were listed. 0 or RNND_ENOMEM.
static int conns_start(int max, const int *before, int n) {
    int now[64];
    int m = listening_sockets(now, 64);
    pthread_mutex_lock(&conns.lock);
    conns.v = calloc((size_t)max, sizeof(*conns.v));
    conns.max = max;
    conns.n = 0;
    conns.nlisteners = 0;
    for (int i = 0; i < m && i < 64; i++) {
        bool old = false;
        for (int k = 0; k < n && k < 64; k++)
            old = old || before[k] == now[i];
        if (!old && conns.nlisteners < CONN_LISTENERS)
            conns.listeners[conns.nlisteners++] = now[i];
    }
    int rc = conns.v ? 0 : RNND_ENOMEM;
    pthread_mutex_unlock(&conns.lock);
    return rc;
}

static void conns_stop(void) {
    pthread_mutex_lock(&conns.lock);
    free(conns.v);
    conns.v = NULL;
    conns.n = conns.nlisteners = 0;
    atomic_store_explicit(&rnnd_metrics.connections, 0, memory_order_relaxed);
    pthread_mutex_unlock(&conns.lock);
}

// ---------------------------------------------------------------------------------------------
// Lifecycle

// True when a process accepts connections on the Unix socket at path.
static bool unix_live(const char *path) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    bool live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return live;
}

// Binds the unix:PATH address addr with the socket file's mode; the bound "port" (nonzero) or 0
// with the reason in err. gRPC replaces a socket file that is there (one a daemon left behind);
// a socket that another process still listens on stops the start instead, as a TCP port in use
// does.
static int unix_bind(grpc_server *server, const char *addr, int mode,
                     grpc_server_credentials *creds, char *err, size_t errlen) {
    const char *path = addr + 5;
    struct stat st;
    if (lstat(path, &st) == 0 && !S_ISSOCK(st.st_mode)) {
        snprintf(err, errlen,
                 "--listen %s: %s exists and is not a socket; remove it or choose "
                 "another path",
                 addr, path);
        return 0;
    }
    if (lstat(path, &st) == 0 && unix_live(path)) {
        snprintf(err, errlen,
                 "--listen %s: another process listens there (a second rnnd?); stop "
                 "it or choose another path",
                 addr);
        return 0;
    }
    // The socket file is created with the mode the umask leaves, so it never has another one.
    // The umask is process-wide: this runs at start-up, before any thread that creates files.
    mode_t old = umask((mode_t)(~mode & 0777));
    int bound = grpc_server_add_http2_port(server, addr, creds);
    umask(old);
    if (bound == 0)
        snprintf(err, errlen,
                 "--listen %s: cannot bind (does the directory exist, and may rnnd "
                 "write to it?)",
                 addr);
    return bound;
}

// Removes the socket files we created (not one another daemon has bound there since).
static void sockets_remove(struct rnnd_rpc *rpc) {
    for (int i = 0; i < rpc->nsockets; i++) {
        struct stat st;
        if (lstat(rpc->sockets[i].path, &st) == 0 && st.st_ino == rpc->sockets[i].ino)
            unlink(rpc->sockets[i].path);
    }
}

int rnnd_rpc_start(const struct rnnd_rpc_options *o, struct rnnd_rpc **out, char *err,
                   size_t errlen) {
    struct rnnd_rpc *rpc = calloc(1, sizeof(*rpc));
    if (rpc == NULL) {
        snprintf(err, errlen, "out of memory");
        return RNND_ENOMEM;
    }
    rpc->service = o->service;
    rpc->stopped = o->stopped;
    rpc->drained = o->drained;
    rpc->stopped_ctx = o->stopped_ctx;
    rpc->t_shutdown = (struct tag){TAG_SHUTDOWN, NULL};
    rpc->max_streams = o->max_streams > 0 ? o->max_streams : INT32_MAX;
    rpc->max_message_bytes = o->max_message_bytes;
    rpc->max_reply_bytes = o->max_reply_bytes > 0 ? o->max_reply_bytes : SIZE_MAX;
    rpc->max_watches = o->max_health_watches > 0 ? o->max_health_watches : INT32_MAX;
    rpc->idle_timeout_s = o->stream_idle_timeout_s;
    rpc->shm = o->shm;
    pthread_rwlock_init(&rpc->gate, NULL);
    pthread_mutex_init(&rpc->live_lock, NULL);

    int maxmsg = o->max_message_bytes > (size_t)INT32_MAX ? INT32_MAX : (int)o->max_message_bytes;
    grpc_arg args[3];
    memset(args, 0, sizeof(args));
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = -1; // checked by too_large
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = maxmsg;
    // Never share a port with another process: a second daemon must fail to bind.
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_ALLOW_REUSEPORT;
    args[2].value.integer = 0;
    grpc_channel_args cargs = {3, args};
    rpc->server = grpc_server_create(&cargs, NULL);
    rpc->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(rpc->server, rpc->cq, NULL);
    for (int i = 0; i < NMETHODS; i++) {
        rpc->handles[i] = grpc_server_register_method(
            rpc->server, methods[i].path, NULL,
            methods[i].kind == KIND_STEP_STREAM ? GRPC_SRM_PAYLOAD_NONE
                                                : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER,
            0);
        if (rpc->handles[i] == NULL) {
            snprintf(err, errlen, "cannot register %s", methods[i].path);
            goto fail;
        }
    }
    if (o->auth_token && o->auth_token[0]) {
        size_t n = strlen(o->auth_token) + 8;
        rpc->auth = malloc(n);
        if (rpc->auth == NULL) {
            snprintf(err, errlen, "out of memory");
            goto fail;
        }
        snprintf(rpc->auth, n, "Bearer %s", o->auth_token);
    }
    grpc_server_credentials *creds;
    if (o->tls_cert_pem) {
        grpc_ssl_pem_key_cert_pair pair = {o->tls_key_pem, o->tls_cert_pem};
        creds = grpc_ssl_server_credentials_create_ex(
            o->tls_client_ca_pem, &pair, 1,
            o->tls_client_ca_pem ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                 : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        if (creds == NULL) {
            snprintf(err, errlen, "--tls-cert/--tls-key: gRPC refused the certificate or key");
            goto fail;
        }
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    int before[64];
    int nbefore = listening_sockets(before, 64);
    size_t used = 0;
    for (int i = 0; i < o->nlisten && i < RNND_RPC_MAX_LISTEN; i++) {
        const char *a = o->listen[i];
        bool unix_socket = strncmp(a, "unix:", 5) == 0;
        int bound = unix_socket ? unix_bind(rpc->server, a, o->unix_mode, creds, err, errlen)
                                : grpc_server_add_http2_port(rpc->server, a, creds);
        if (bound == 0) {
            if (!unix_socket)
                snprintf(err, errlen, "--listen %s: cannot bind (address in use or not local?%s)",
                         a, o->tls_cert_pem ? " or a TLS certificate/key gRPC cannot use" : "");
            grpc_server_credentials_release(creds);
            goto fail;
        }
        struct stat st;
        if (unix_socket && lstat(a + 5, &st) == 0) {
            snprintf(rpc->sockets[rpc->nsockets].path, sizeof(rpc->sockets[0].path), "%s", a + 5);
            rpc->sockets[rpc->nsockets++].ino = st.st_ino;
        }
        // The address as clients reach it: port 0 took a free port.
        char *at = rpc->addresses + used;
        size_t room = sizeof(rpc->addresses) - used;
        if (unix_socket)
            used += (size_t)snprintf(at, room, "%s%s", i ? "," : "", a);
        else
            used += (size_t)snprintf(at, room, "%s%.*s:%d", i ? "," : "",
                                     (int)(strrchr(a, ':') - a), a, bound);
        used = used < sizeof(rpc->addresses) ? used : sizeof(rpc->addresses) - 1;
    }
    grpc_server_credentials_release(creds);
    if (conns_start(o->max_connections > 0 ? o->max_connections : INT32_MAX, before, nbefore)) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    grpc_server_start(rpc->server);
    rpc->cq_open = true;
    for (int i = 0; i < NMETHODS; i++)
        for (int k = 0; k < methods[i].posted; k++)
            post_request(rpc, i);
    for (int k = 0; k < CATCH_ALL_POSTED; k++)
        post_request(rpc, -1);
    int want = o->threads < 1                      ? 1
               : o->threads > RNND_RPC_MAX_THREADS ? RNND_RPC_MAX_THREADS
                                                   : o->threads;
    atomic_store(&rpc->alive, want);
    for (int k = 0; k < want; k++) {
        if (pthread_create(&rpc->threads[k], NULL, cq_main, rpc) != 0) {
            // The threads already running pick up the others' share; none at all is fatal.
            atomic_fetch_sub(&rpc->alive, want - k);
            if (k == 0) {
                snprintf(err, errlen, "cannot start the gRPC thread");
                goto fail_started;
            }
            rnnd_log(RNND_LOG_WARN, "started %d of %d gRPC threads", k, want);
            break;
        }
        pthread_setname_np(rpc->threads[k], "rnnd-grpc");
        rpc->nthreads++;
    }
    *out = rpc;
    return 0;
fail_started:
    grpc_server_shutdown_and_notify(rpc->server, rpc->cq, &rpc->t_shutdown);
    grpc_server_cancel_all_calls(rpc->server);
    rpc->cq_open = false;
    grpc_completion_queue_shutdown(rpc->cq);
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(rpc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        struct tag *t = ev.tag;
        if (t && t->call)
            call_free(t->call);
    }
    rpc->server_shut = true;
fail:
    if (!rpc->server_shut) {
        grpc_server_shutdown_and_notify(rpc->server, rpc->cq, &rpc->t_shutdown);
        grpc_completion_queue_shutdown(rpc->cq);
        while (grpc_completion_queue_next(rpc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
    }
    conns_stop();
    grpc_server_destroy(rpc->server);
    grpc_completion_queue_destroy(rpc->cq);
    sockets_remove(rpc);
    pthread_rwlock_destroy(&rpc->gate);
    pthread_mutex_destroy(&rpc->live_lock);
    free(rpc->auth);
    free(rpc);
    return RNND_EIO;
}

// Takes a reference unless the call is already being freed.
static bool call_tryref(struct rnnd_call *c) {
    int r = atomic_load(&c->refs);
    while (r > 0)
        if (atomic_compare_exchange_weak(&c->refs, &r, r + 1))
            return true;
    return false;
}

// Runs fn on every call in progress with its lock held, outside the list lock, holding a
// reference so that nothing frees a call under us. fn returns true to drop the owner reference.
static void calls_each(struct rnnd_rpc *rpc, bool (*fn)(struct rnnd_call *c, void *arg),
                       void *arg) {
    pthread_mutex_lock(&rpc->live_lock);
    int n = 0;
    for (struct rnnd_call *c = rpc->live; c; c = c->lnext)
        n++;
    struct rnnd_call **v = malloc(((size_t)n + 1) * sizeof(*v));
    int k = 0;
    for (struct rnnd_call *c = rpc->live; v && c; c = c->lnext)
        if (call_tryref(c))
            v[k++] = c;
    pthread_mutex_unlock(&rpc->live_lock);
    for (int i = 0; i < k; i++) {
        struct rnnd_call *c = v[i];
        pthread_mutex_lock(&c->lock);
        bool drop = fn(c, arg);
        pthread_mutex_unlock(&c->lock);
        finish_owner(c, drop);
        call_unref(c);
    }
    free(v);
}

static bool is_step_stream(const struct rnnd_call *c) {
    return c->mi >= 0 && methods[c->mi].kind == KIND_STEP_STREAM;
}

static bool serving_changed(struct rnnd_call *c, void *arg) {
    (void)arg;
    return c->watching ? watch_update_locked(c) : false;
}

// A watcher hears NOT_SERVING, then its stream ends: it is not work a drain should wait for.
static bool drain_watch(struct rnnd_call *c, void *arg) {
    (void)arg;
    if (!c->watching)
        return false;
    return watch_update_locked(c) || end_locked(c, RNND_EUNAVAIL, not_serving_msg(c->rpc));
}

// An idle StepStream ends now; one with a message in flight ends after its reply
// (rnnd_call_reply).
static bool drain_end_stream(struct rnnd_call *c, void *arg) {
    (void)arg;
    if (!is_step_stream(c) || c->inflight)
        return false;
    return end_locked(c, RNND_EUNAVAIL, not_serving_msg(c->rpc));
}

void rnnd_rpc_set_serving(struct rnnd_rpc *rpc, bool serving) {
    atomic_store(&rpc->serving, serving ? 1 : 0);
    calls_each(rpc, serving_changed, NULL);
}

void rnnd_rpc_drain(struct rnnd_rpc *rpc) {
    if (atomic_exchange(&rpc->draining, 1))
        return;
    rnnd_log(RNND_LOG_INFO, "draining: new calls get UNAVAILABLE; the calls and StepStreams "
                            "already open go on until they end or the drain's grace is over");
    calls_each(rpc, drain_watch, NULL);
    maybe_shutdown(rpc);
}

void rnnd_rpc_drain_end(struct rnnd_rpc *rpc) {
    if (atomic_exchange(&rpc->streams_ending, 1))
        return;
    calls_each(rpc, drain_end_stream, NULL);
}

void rnnd_rpc_cancel_all(struct rnnd_rpc *rpc) {
    if (atomic_exchange(&rpc->shut, 1))
        return;
    pthread_rwlock_wrlock(&rpc->gate);
    if (rpc->cq_open && !rpc->server_shut) {
        rpc->server_shut = true;
        // Connections first: a call on its way then meets a closed transport (UNAVAILABLE on
        // the client) instead of a server marked shut down (which would cancel it).
        grpc_server_cancel_all_calls(rpc->server);
        grpc_server_shutdown_and_notify(rpc->server, rpc->cq, &rpc->t_shutdown);
        grpc_server_cancel_all_calls(rpc->server); // any connection made in between
    }
    pthread_rwlock_unlock(&rpc->gate);
}

// --stream-idle-timeout-s for one call; now is the time in ns.
static bool idle_check(struct rnnd_call *c, void *now) {
    struct rnnd_rpc *rpc = c->rpc;
    uint64_t idle_now_ns = *(const uint64_t *)now;
    uint64_t limit = (uint64_t)rpc->idle_timeout_s * 1000000000ull;
    // A reply its client does not read holds its slot and its bytes: give them back. The status
    // cannot be sent (the client reads nothing), so the call is cancelled.
    // Times set after `now` was read (by other threads, meanwhile) are not in the past.
    if (c->send_ns && !c->send_cancelled && idle_now_ns > c->send_ns + limit) {
        c->send_cancelled = true;
        atomic_fetch_add_explicit(&rnnd_metrics.stream_idle_ends, 1, memory_order_relaxed);
        rnnd_log(RNND_LOG_DEBUG, "%s: reply not read for %d s: cancelling the call",
                 c->mi >= 0 ? methods[c->mi].path : "unknown", rpc->idle_timeout_s);
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_DEADLINE_EXCEEDED,
                                     "the reply was not read within --stream-idle-timeout-s", NULL);
        return false;
    }
    if (!is_step_stream(c) || c->inflight || c->sending || c->outq || c->status_sent || c->ending ||
        idle_now_ns <= c->last_msg_ns + limit)
        return false;
    atomic_fetch_add_explicit(&rnnd_metrics.stream_idle_ends, 1, memory_order_relaxed);
    char msg[256];
    snprintf(msg, sizeof(msg),
             "this StepStream sent no message for %d s (--stream-idle-timeout-s); open a new one "
             "when there are steps to send",
             rpc->idle_timeout_s);
    return end_locked(c, RNND_EUNAVAIL, msg);
}

void rnnd_rpc_housekeeping(struct rnnd_rpc *rpc) {
    if (rpc->idle_timeout_s > 0) {
        uint64_t now = rnnd_now_ns();
        calls_each(rpc, idle_check, &now);
    }
    conns_refresh(false);
}

const char *rnnd_rpc_addresses(const struct rnnd_rpc *rpc) {
    return rpc->addresses;
}

void rnnd_rpc_free(struct rnnd_rpc *rpc) {
    if (rpc == NULL)
        return;
    for (int k = 0; k < rpc->nthreads; k++)
        pthread_join(rpc->threads[k], NULL);
    sockets_remove(rpc);
    conns_stop();
    grpc_server_destroy(rpc->server);
    grpc_completion_queue_destroy(rpc->cq);
    pthread_rwlock_destroy(&rpc->gate);
    pthread_mutex_destroy(&rpc->live_lock);
    free(rpc->auth);
    free(rpc);
}
