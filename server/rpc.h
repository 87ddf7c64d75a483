/*
 * rpc.h: the gRPC layer. rpc.c alone calls grpc_* (docs/style.md "Threads"): it owns the
 * server, the completion-queue thread, every call's lifetime, the method table, the
 * grpc.health.v1.Health service and the one mapping of rnnd error codes to gRPC status codes.
 *
 * Handlers (service.c) receive a call and its decoded request on a completion-queue thread and
 * must finish it exactly once with rnnd_call_reply or rnnd_call_fail, from any thread, now or
 * later (for StepStream: once per received message; a reply keeps the stream going, a failure
 * ends it). The request stays valid until then. A handler whose reply can be large reserves it
 * first (rnnd_call_reserve), before it changes any state.
 *
 * Shared memory (shm.h): a request's region spans are resolved before its handler runs (a span
 * that does not resolve fails the call, the handler never sees it), and rnnd_call_reply writes
 * the reply's tensors into the request's reply_region.
 *
 * One server per process: --max-connections is counted process-wide (rpc.c defines accept4).
 */
#ifndef RNND_RPC_H
#define RNND_RPC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

struct rnnd_rpc;
struct rnnd_call;
struct rnnd_shm;

// A handler: svc is rnnd_rpc_options.service.
typedef void (*rnnd_rpc_handler_fn)(void *svc, struct rnnd_call *call,
                                    const ProtobufCMessage *request);
// Called on the completion-queue thread once the server has shut down and the thread is about
// to exit (after rnnd_rpc_drain).
typedef void (*rnnd_rpc_stopped_cb)(void *ctx);
// Called (any thread, once) when a drain has nothing left: every call finished, its reply and
// status sent. The owner then calls rnnd_rpc_cancel_all, after giving those statuses a moment
// to be read (a client still writing on a stream whose connection closes under it sees the
// broken connection instead of its status).
typedef void (*rnnd_rpc_drained_cb)(void *ctx);

#define RNND_RPC_MAX_THREADS 16
#define RNND_RPC_MAX_LISTEN  8

struct rnnd_rpc_options {
    const char *const *listen; // nlisten addresses: HOST:PORT or unix:PATH
    int nlisten;               // 1..RNND_RPC_MAX_LISTEN
    int unix_mode;             // file mode of the unix: sockets
    struct rnnd_shm *shm;      // shared-memory regions (requests' spans resolve here)
    int threads;               // completion-queue threads (1..RNND_RPC_MAX_THREADS)
    size_t max_message_bytes;  // both ways
    int max_streams;           // rnnd.v1 calls in progress at once (health not counted)
    size_t max_reply_bytes;    // replies reserved, queued or being sent, all calls together
    int max_connections;       // gRPC connections open at once
    int max_health_watches;    // grpc.health.v1 Watch streams open at once
    int stream_idle_timeout_s; // end idle StepStreams and unread replies after this; 0: never
    void *service;             // handed to handlers
    rnnd_rpc_stopped_cb stopped;
    rnnd_rpc_drained_cb drained;
    void *stopped_ctx; // for both
    // Security (all borrowed, NULL when unused):
    const char *tls_cert_pem;      // server certificate chain; TLS when set
    const char *tls_key_pem;       // its private key
    const char *tls_client_ca_pem; // when set, clients must present a certificate it signed
    const char *auth_token;        // when set, rnnd.v1 calls need "authorization: Bearer <token>"
};

// Creates the server, binds every opts->listen address and starts the completion-queue threads;
// the server answers health NOT_SERVING and the rnnd.v1 methods UNAVAILABLE until
// set_serving(true). A unix: socket is created with mode opts->unix_mode; one left by a daemon
// that is gone is replaced, one another process listens on is not. 0 and *out; or RNND_EIO /
// RNND_ENOMEM with the reason in err.
int rnnd_rpc_start(const struct rnnd_rpc_options *opts, struct rnnd_rpc **out, char *err,
                   size_t errlen);
// The bound addresses, comma-separated, in --listen order, with the ports port 0 got
// ("127.0.0.1:41234,unix:/run/rnnd.sock"). Valid until rnnd_rpc_free.
const char *rnnd_rpc_addresses(const struct rnnd_rpc *rpc);
// Switches between serving and not (health Watch streams hear about it). Any thread.
void rnnd_rpc_set_serving(struct rnnd_rpc *rpc, bool serving);
// Begins the graceful shutdown: health turns NOT_SERVING (Watch streams hear it, then end), new
// calls and new StepStreams get UNAVAILABLE, while the calls and StepStreams already open go on
// (their messages are still served). Once every call is finished, its reply and status sent and
// not merely handed to gRPC, `drained` runs; rnnd_rpc_cancel_all then shuts the gRPC server down
// and closes its connections (then `stopped` runs). Any thread; idempotent.
void rnnd_rpc_drain(struct rnnd_rpc *rpc);
// The drain's grace is over: every StepStream still open ends with a clean UNAVAILABLE status
// (an idle one now, one with a message in flight after its reply). Any thread; idempotent.
void rnnd_rpc_drain_end(struct rnnd_rpc *rpc);
// Shuts the server down now, cancelling every call still running. Any thread; idempotent.
void rnnd_rpc_cancel_all(struct rnnd_rpc *rpc);
// Periodic work (the cron): ends StepStreams idle for --stream-idle-timeout-s, cancels calls
// whose client has not read their reply for as long, refreshes the connection gauge. Any thread.
void rnnd_rpc_housekeeping(struct rnnd_rpc *rpc);
// Joins the completion-queue thread and destroys the server. Call after `stopped` ran and after
// every handler has finished its calls (e.g. the engine was joined).
void rnnd_rpc_free(struct rnnd_rpc *rpc);

// The decoded request of call (owned by the call).
const ProtobufCMessage *rnnd_call_request(const struct rnnd_call *call);
// Who sent it: the connection (unary calls) or the stream, as a hash; for dynamic batching.
uint64_t rnnd_call_source(struct rnnd_call *call);
// True when the call's peer is on this host (a unix: socket or loopback): shared memory is for
// such peers only (shm.h).
bool rnnd_call_peer_local(struct rnnd_call *call);
// The request's tensors are in a CUDA region: device pointers, never read on the host (shm.h).
bool rnnd_call_device_in(const struct rnnd_call *call);
// The reply_region's device memory when it is in a CUDA region (*len bytes), else NULL.
char *rnnd_call_device_reply(const struct rnnd_call *call, size_t *len);
// That CUDA region takes replies before the work is done (rnnd_shm_use_async).
bool rnnd_call_device_async(const struct rnnd_call *call);
// The same for a region the backend page-locked (shm.h: rnnd_shm_use_host_in,
// rnnd_shm_use_host_reply): the engine copies between it and the device without staging. The
// reply_region's memory is also returned when it is any host memory (*pinned false).
bool rnnd_call_host_in(const struct rnnd_call *call);
char *rnnd_call_host_reply(const struct rnnd_call *call, size_t *len, bool *pinned);
// Nonzero once the client cancelled the call or its deadline passed.
const _Atomic int *rnnd_call_cancelled(struct rnnd_call *call);
// Reserves bytes of --max-reply-mb for the reply the handler will send (it stays reserved until
// that reply has left, or the call fails). 0, or RNND_EFULL with the reason in err (counted in
// rnnd_limit_rejections_total{resource="reply_bytes"}); the call is then still the handler's to
// finish. Any thread, before the call is finished.
int rnnd_call_reserve(struct rnnd_call *call, size_t bytes, char *err, size_t errlen);
// Sends reply (packed here; the caller keeps it) with status OK, or as the next message of a
// StepStream. Any thread.
void rnnd_call_reply(struct rnnd_call *call, const ProtobufCMessage *reply);
// rnnd_call_reply for a reply whose tensors lie in block (size bytes, the handler's): its large
// bytes fields are sent from there rather than copied, and the reply owns block from now on,
// releasing it (release(block)) once gRPC is done with it, which may be before this returns.
void rnnd_call_reply_lent(struct rnnd_call *call, const ProtobufCMessage *reply, void *block,
                          size_t size, void (*release)(void *));
// Ends the call with the status for err (rnnd_rpc_status) and msg. Any thread.
void rnnd_call_fail(struct rnnd_call *call, int err, const char *msg);

// The gRPC status code (grpc_status_code values) for an rnnd error code; 0 (OK) for 0.
int rnnd_rpc_status(int err);

#endif // RNND_RPC_H
