/*
 * rpc.h: the gRPC layer. rpc.c alone calls grpc_* (docs/style.md "Threads"): it owns the
 * server, the completion-queue thread, every call's lifetime, the method table, the
 * grpc.health.v1.Health service and the one mapping of rnnd error codes to gRPC status codes.
 *
 * Handlers (service.c) receive a call and its decoded request on a completion-queue thread and
 * must finish it exactly once with rnnd_call_reply or rnnd_call_fail, from any thread, now or
 * later (for StepStream: once per received message; a reply keeps the stream going, a failure
 * ends it). The request stays valid until then.
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

// A handler: svc is rnnd_rpc_options.service.
typedef void (*rnnd_rpc_handler_fn)(void *svc, struct rnnd_call *call,
                                    const ProtobufCMessage *request);
// Called on the completion-queue thread once the server has shut down and the thread is about
// to exit (after rnnd_rpc_drain).
typedef void (*rnnd_rpc_stopped_cb)(void *ctx);

#define RNND_RPC_MAX_THREADS 16

struct rnnd_rpc_options {
    const char *listen;       // HOST:PORT
    int threads;              // completion-queue threads (1..RNND_RPC_MAX_THREADS)
    size_t max_message_bytes; // both ways
    int max_streams;          // rnnd.v1 calls in progress at once (health not counted)
    void *service;            // handed to handlers
    rnnd_rpc_stopped_cb stopped;
    void *stopped_ctx;
    // Security (all borrowed, NULL when unused):
    const char *tls_cert_pem;      // server certificate chain; TLS when set
    const char *tls_key_pem;       // its private key
    const char *tls_client_ca_pem; // when set, clients must present a certificate it signed
    const char *auth_token;        // when set, rnnd.v1 calls need "authorization: Bearer <token>"
};

// Creates the server, binds opts->listen and starts the completion-queue thread; the server
// answers health NOT_SERVING and the rnnd.v1 methods UNAVAILABLE until set_serving(true).
// 0, *out and the bound port in *port; or RNND_EIO / RNND_ENOMEM with the reason in err.
int rnnd_rpc_start(const struct rnnd_rpc_options *opts, struct rnnd_rpc **out, int *port, char *err,
                   size_t errlen);
// Switches between serving and not (health Watch streams hear about it). Any thread.
void rnnd_rpc_set_serving(struct rnnd_rpc *rpc, bool serving);
// Begins the graceful shutdown: health turns NOT_SERVING, new calls get UNAVAILABLE, open
// streams are ended after their message in flight, and once every call has been answered the
// gRPC server shuts down and closes its connections (then `stopped` runs). Any thread;
// idempotent.
void rnnd_rpc_drain(struct rnnd_rpc *rpc);
// Shuts the server down now, cancelling every call still running (the drain's grace period is
// over). Any thread; idempotent.
void rnnd_rpc_cancel_all(struct rnnd_rpc *rpc);
// Joins the completion-queue thread and destroys the server. Call after `stopped` ran and after
// every handler has finished its calls (e.g. the engine was joined).
void rnnd_rpc_free(struct rnnd_rpc *rpc);

// The decoded request of call (owned by the call).
const ProtobufCMessage *rnnd_call_request(const struct rnnd_call *call);
// Who sent it: the connection (unary calls) or the stream, as a hash; for dynamic batching.
uint64_t rnnd_call_source(struct rnnd_call *call);
// Nonzero once the client cancelled the call or its deadline passed.
const _Atomic int *rnnd_call_cancelled(struct rnnd_call *call);
// Sends reply (packed here; the caller keeps it) with status OK, or as the next message of a
// StepStream. Any thread.
void rnnd_call_reply(struct rnnd_call *call, const ProtobufCMessage *reply);
// Ends the call with the status for err (rnnd_rpc_status) and msg. Any thread.
void rnnd_call_fail(struct rnnd_call *call, int err, const char *msg);

// The gRPC status code (grpc_status_code values) for an rnnd error code; 0 (OK) for 0.
int rnnd_rpc_status(int err);

#endif // RNND_RPC_H
