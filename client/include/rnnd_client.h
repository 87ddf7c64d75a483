/*
 * rnnd_client.h: a small blocking C client for the rnnd daemon (rnnd.v1.Rnn and
 * grpc.health.v1.Health), used by rnndctl and the integration tests.
 *
 * One struct rnnd_client is one gRPC channel (its own connection: channels never share one),
 * to HOST:PORT or, on the daemon's host, to a unix:PATH socket. On the daemon's host a client can
 * also send its tensors through shared memory (rnnd_client_shm_start). Every call blocks the calling thread until the reply, the deadline or an error. A client
 * may be used by several threads at once; a struct rnnd_client_stream belongs to one thread at a
 * time.
 *
 * Errors: every fallible function returns 0 or a negative RNND_E* (rnnd_kernels.h). The details of
 * the last failure on the calling thread, including the gRPC status code and the server's message,
 * are in rnnd_client_last_error() (a thread-local, like errno). Status → code:
 *   INVALID_ARGUMENT → RNND_EINVAL, FAILED_PRECONDITION → RNND_EPRECOND, NOT_FOUND →
 *   RNND_ENOTFOUND, RESOURCE_EXHAUSTED → RNND_EFULL, UNAVAILABLE → RNND_EUNAVAIL,
 *   UNAUTHENTICATED → RNND_EAUTH, CANCELLED / DEADLINE_EXCEEDED → RNND_ECANCELED,
 *   UNIMPLEMENTED → RNND_ENOTSUP, a reply that does not decode → RNND_ECORRUPT, others → RNND_EIO.
 *
 * Ownership: request structs and the tensors they point to are borrowed for the duration of the
 * call. Reply structs are filled with memory the library allocates; free each with the matching
 * *_free function (which also accepts a zeroed struct). Shapes use the letters of rnnd_kernels.h.
 */
#ifndef RNND_CLIENT_H
#define RNND_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rnnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Tensors, as on the wire: row-major, little-endian.

// Same values as rnnd.v1.DType.
enum rnnd_dtype {
    RNND_DTYPE_UNSPECIFIED = 0,
    RNND_DTYPE_FLOAT32 = 1,
    RNND_DTYPE_BFLOAT16 = 2,
    RNND_DTYPE_FLOAT16 = 3,
    RNND_DTYPE_BOOL = 4, // one byte per element
    RNND_DTYPE_INT64 = 5,
};

#define RNND_TENSOR_MAX_DIMS 8

// A tensor in a request (data borrowed) or a reply (data owned: free with rnnd_tensor_free).
// present is false for an optional tensor the message did not carry (or a request's "leave it
// out"). Nothing checks that nbytes matches the shape, so tests can send malformed tensors.
struct rnnd_tensor {
    bool present;
    enum rnnd_dtype dtype;
    int ndim;
    int64_t shape[RNND_TENSOR_MAX_DIMS];
    void *data;
    size_t nbytes;
};

// A present tensor of dtype over data (borrowed), with ndim dims from shape and nbytes computed
// from the shape and the element size.
struct rnnd_tensor rnnd_tensor_view(enum rnnd_dtype dtype, void *data, int ndim,
                                    const int64_t *shape);
// rnnd_tensor_view for FLOAT32 with 1 to 4 dims given inline; unused dims are 0.
struct rnnd_tensor rnnd_tensor_f32(float *data, int ndim, int64_t d0, int64_t d1, int64_t d2,
                                   int64_t d3);
// Bytes per element (0 for UNSPECIFIED or unknown values).
size_t rnnd_dtype_size(enum rnnd_dtype dtype);
// "float32", "bool", ... or "unknown".
const char *rnnd_dtype_name(enum rnnd_dtype dtype);
// Product of the dims (1 for ndim 0).
int64_t rnnd_tensor_numel(const struct rnnd_tensor *t);
// Frees the data of a reply tensor and zeroes it. NULL does nothing.
void rnnd_tensor_free(struct rnnd_tensor *t);

struct rnnd_named_tensor {
    char *name; // PyTorch's name, e.g. "weight_hh_l0"
    struct rnnd_tensor tensor;
};

// A list of named tensors. In requests the names and tensors are borrowed; in replies they are
// owned: free with rnnd_named_tensors_free.
struct rnnd_named_tensors {
    size_t n;
    struct rnnd_named_tensor *v;
};
void rnnd_named_tensors_free(struct rnnd_named_tensors *l);
// The tensor called name in l, or NULL.
const struct rnnd_tensor *rnnd_named_tensors_find(const struct rnnd_named_tensors *l,
                                                  const char *name);

// ---------------------------------------------------------------------------------------------
// Errors.

struct rnnd_client_error {
    int code;        // RNND_E* returned by the failed call, 0 after a success
    int grpc_status; // grpc_status_code (0 OK, 3 INVALID_ARGUMENT, ...); -1 when no call was made
    char message[1024]; // the server's status message, or what went wrong locally
};

// The last error on the calling thread (valid until the thread's next client call).
const struct rnnd_client_error *rnnd_client_last_error(void);
// "INVALID_ARGUMENT", ... for a grpc_status_code; "UNKNOWN_STATUS" otherwise.
const char *rnnd_grpc_status_name(int grpc_status);

// ---------------------------------------------------------------------------------------------
// Connections.

struct rnnd_client_opts {
    const char *target;          // "HOST:PORT" or "unix:PATH" (gRPC target syntax); required
    const char *tls_root_pem;    // PEM of the roots to trust; NULL for plaintext
    const char *tls_cert_pem;    // client certificate chain (mutual TLS) or NULL
    const char *tls_key_pem;     // client private key (mutual TLS) or NULL
    const char *tls_server_name; // override the name checked in the server's certificate, or NULL
    const char *token;           // bearer token sent as "authorization: Bearer <token>", or NULL
    int64_t timeout_ms;          // per-call deadline; <= 0: 30000
    int64_t max_message_bytes;   // send and receive limit; <= 0: unlimited
};

struct rnnd_client;

// Connects (lazily: the first call opens the connection) and returns a new client in *out, free
// with rnnd_client_free. Copies what it keeps from opts. RNND_EINVAL for a missing target,
// RNND_ENOMEM. Initialises gRPC (reference-counted).
int rnnd_client_init(const struct rnnd_client_opts *opts, struct rnnd_client **out);
// Closes the channel, first letting a connection attempt in flight finish (up to 1 s: gRPC 1.51
// would otherwise leak its socket). NULL does nothing. No call may be in flight.
void rnnd_client_free(struct rnnd_client *c);
// Waits up to timeout_ms for the channel to be connected: 0, or RNND_EUNAVAIL.
int rnnd_client_wait_connected(struct rnnd_client *c, int64_t timeout_ms);

// ---------------------------------------------------------------------------------------------
// Calls. Each returns 0 or a negative RNND_E* (details in rnnd_client_last_error()).

// grpc.health.v1.Health/Check for service ("" for the whole server). *status receives the
// serving status: 1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN (0 UNKNOWN).
int rnnd_client_health(struct rnnd_client *c, const char *service, int *status);
// grpc.health.v1.Health/Watch: opens the stream and returns its first status in *status, then
// ends the call.
int rnnd_client_health_watch_first(struct rnnd_client *c, const char *service, int *status);

// A Watch stream kept open: each rnnd_client_watch_next returns the next status the server sends.
// One thread at a time.
struct rnnd_client_watch;
// Opens Watch(service); free with rnnd_client_watch_free.
int rnnd_client_watch_init(struct rnnd_client *c, const char *service,
                           struct rnnd_client_watch **out);
// Waits up to timeout_ms for the next status: 0 and *status; RNND_ECANCELED (grpc_status -1) when
// nothing came in time (the stream stays usable); when the server ended the stream, its status
// as a code (RNND_ECANCELED with grpc_status 0 for an OK end).
int rnnd_client_watch_next(struct rnnd_client_watch *w, int64_t timeout_ms, int *status);
// Cancels the stream if open and frees it. NULL does nothing.
void rnnd_client_watch_free(struct rnnd_client_watch *w);

struct rnnd_model_info {
    char cell[16]; // "gru" or "lstm"
    int64_t input_size, hidden_size, num_layers;
    char compute[16]; // "fp32", "ieee", "bf16"
    char backend[16]; // "cpu", "cuda"
    char device[128];
    uint64_t model_version;
    uint64_t envs_active;
    uint64_t max_batch;
    int64_t extras_size;
    char kernel_plan[256]; // the kernels a learner batch of max_batch rows runs
    // The policy (docs/design.md "Policy"); zero and empty for a core-only model.
    int n_encoder_widths;
    int64_t encoder_widths[RNND_MAX_ENCODER_LAYERS];
    char encoder_activation[8]; // "elu", "relu", "tanh"; "" without encoder
    int64_t discrete_actions, gaussian_actions;
    bool value_head;
};
int rnnd_client_info(struct rnnd_client *c, struct rnnd_model_info *out);
// Fills m from info (cell, I, H, L, compute, the policy); RNND_EINVAL when info names something
// unknown.
int rnnd_model_info_to_model(const struct rnnd_model_info *info, struct rnnd_model *m);

struct rnnd_step_req {
    size_t n_env_ids;
    const uint64_t *env_ids;    // (B) unique
    struct rnnd_tensor obs;     // (B, I) FLOAT32
    size_t n_is_init;           // B, or 0 for all false
    const bool *is_init;        // (n_is_init)
    size_t n_step_index;        // B, or 0 for none
    const uint64_t *step_index; // (n_step_index)
    struct rnnd_tensor extras;  // (B, E) in obs's dtype, or not present
    bool return_state;
    enum rnnd_dtype reply_dtype; // UNSPECIFIED: obs's dtype (FLOAT32, BFLOAT16, FLOAT16)
    // A policy model (docs/design.md "Policy"): the mode instead of a draw; also the logits or
    // mean; also the core output (a model with heads returns it only then).
    bool greedy, return_logits, return_core;
    // What each env's previous step earned (a policy model recording steps), or NULL: none.
    const float *reward;          // (n_env_ids)
    const bool *done, *truncated; // (n_env_ids)
};

struct rnnd_step_reply {
    struct rnnd_tensor output; // (B, H); with heads only when return_core
    uint64_t model_version;
    struct rnnd_tensor h; // (B, L, H) when return_state
    struct rnnd_tensor c; // (B, L, H) LSTM, when return_state
    // A model with heads (not present otherwise):
    struct rnnd_tensor action;   // (B) INT64 discrete, (B, A) Gaussian
    struct rnnd_tensor log_prob; // (B)
    struct rnnd_tensor value;    // (B) value head
    struct rnnd_tensor logits;   // (B, K) when return_logits, discrete
    struct rnnd_tensor mean;     // (B, A) when return_logits, Gaussian
};
void rnnd_step_reply_free(struct rnnd_step_reply *r);

// Step: fills *out (free with rnnd_step_reply_free; left zeroed on failure).
int rnnd_client_step(struct rnnd_client *c, const struct rnnd_step_req *req,
                     struct rnnd_step_reply *out);

// StepStream: one bidirectional call; replies come in request order. Send and receive may be
// interleaved freely (send k requests, then receive k replies) from one thread.
struct rnnd_client_stream;
// Opens a stream; free with rnnd_client_stream_free.
int rnnd_client_stream_init(struct rnnd_client *c, struct rnnd_client_stream **out);
int rnnd_client_stream_send(struct rnnd_client_stream *s, const struct rnnd_step_req *req);
// Receives the next reply. When the server ended the stream, returns the stream's status as a code
// (RNND_ECANCELED with grpc_status 0 when it ended with OK and no more replies).
int rnnd_client_stream_recv(struct rnnd_client_stream *s, struct rnnd_step_reply *out);
// send + recv.
int rnnd_client_stream_step(struct rnnd_client_stream *s, const struct rnnd_step_req *req,
                            struct rnnd_step_reply *out);
// Half-closes the stream, drains replies not yet received and returns its final status as a code.
int rnnd_client_stream_close(struct rnnd_client_stream *s);
// Cancels the call if it is still open and frees it. NULL does nothing.
void rnnd_client_stream_free(struct rnnd_client_stream *s);

// EndEpisodes: *released receives how many envs had state.
int rnnd_client_end_episodes(struct rnnd_client *c, const uint64_t *env_ids, size_t n,
                             uint64_t *released);

// Forward. Exactly one source: trajectories (obs present) or recorded (n_env_ids > 0 or
// recorded set).
struct rnnd_forward_req {
    bool recorded; // true: the recorded source below; false: the trajectory tensors
    // trajectories
    struct rnnd_tensor obs;     // (B, T, I) FLOAT32
    struct rnnd_tensor is_init; // (B, T) BOOL
    struct rnnd_tensor h0;      // (B, L, H) optional
    struct rnnd_tensor c0;      // (B, L, H) optional, LSTM
    struct rnnd_tensor hidden;  // (B, T, L, H) optional
    struct rnnd_tensor cell;    // (B, T, L, H) optional, LSTM
    // recorded
    size_t n_env_ids;
    const uint64_t *env_ids;
    uint32_t steps;
    bool keep_tape;
    enum rnnd_dtype reply_dtype; // UNSPECIFIED: obs's dtype (FLOAT32 for recorded)
    // Recorded: the tensors returned besides output, h_n, c_n (RECORDED_* bits of rnnd.proto's
    // RecordedField: obs 1, is_init 2, extras 4, step_model_version 8, a policy's action 16 and
    // reward 32) when has_recorded_fields, else all of them.
    bool has_recorded_fields;
    uint32_t recorded_fields;
    // A model with heads returns the core's output only with return_core (docs/design.md
    // "Policy").
    bool return_core;
};

struct rnnd_forward_reply {
    struct rnnd_tensor output; // (B, T, H)
    struct rnnd_tensor h_n;    // (B, L, H)
    struct rnnd_tensor c_n;    // (B, L, H) LSTM
    uint64_t tape_id;          // 0 unless keep_tape
    uint64_t model_version;
    struct rnnd_tensor obs;                // (B, T, I) recorded only
    struct rnnd_tensor is_init;            // (B, T) BOOL, recorded only
    struct rnnd_tensor extras;             // (B, T, E) recorded only
    struct rnnd_tensor step_model_version; // (B, T) INT64, recorded only
    // Recorded only, a policy model's (docs/design.md "Policy"):
    struct rnnd_tensor action;          // (B, T) INT64 or (B, T, A)
    struct rnnd_tensor log_prob, value; // (B, T)
    struct rnnd_tensor reward;          // (B, T)
    struct rnnd_tensor done, truncated; // (B, T) BOOL
    // A model with heads: the current policy's outputs at every step.
    struct rnnd_tensor logits;     // (B, T, K) discrete head
    struct rnnd_tensor mean;       // (B, T, A) Gaussian head
    struct rnnd_tensor log_std;    // (A) Gaussian head
    struct rnnd_tensor head_value; // (B, T) value head
};
void rnnd_forward_reply_free(struct rnnd_forward_reply *r);
int rnnd_client_forward(struct rnnd_client *c, const struct rnnd_forward_req *req,
                        struct rnnd_forward_reply *out);

struct rnnd_backward_req {
    uint64_t tape_id;
    struct rnnd_tensor grad_output; // (B, T, H); optional when a head's gradient is given
    struct rnnd_tensor grad_h_n;    // (B, L, H) optional
    struct rnnd_tensor grad_c_n;    // (B, L, H) optional, LSTM
    bool accumulate;
    enum rnnd_dtype reply_dtype; // UNSPECIFIED: grad_output's dtype
    // The input gradients returned (INPUT_GRAD_* bits of rnnd.proto's InputGrad: obs 1, h0 2,
    // hidden 4) when has_input_grads, else every one the Forward had.
    bool has_input_grads;
    uint32_t input_grads;
    // A model with heads: the gradients of its Forward's head outputs, each optional.
    struct rnnd_tensor grad_logits;     // (B, T, K)
    struct rnnd_tensor grad_mean;       // (B, T, A)
    struct rnnd_tensor grad_log_std;    // (A)
    struct rnnd_tensor grad_head_value; // (B, T)
};

struct rnnd_backward_reply {
    struct rnnd_named_tensors grads; // PyTorch names; empty when accumulate
    struct rnnd_tensor grad_obs;     // (B, T, I)
    struct rnnd_tensor grad_h0;      // (B, L, H)
    struct rnnd_tensor grad_c0;      // (B, L, H) LSTM
    struct rnnd_tensor grad_hidden;  // (B, T, L, H) with stored states
    struct rnnd_tensor grad_cell;    // (B, T, L, H) LSTM, with stored states
};
void rnnd_backward_reply_free(struct rnnd_backward_reply *r);
int rnnd_client_backward(struct rnnd_client *c, const struct rnnd_backward_req *req,
                         struct rnnd_backward_reply *out);

// ApplyGradients: grads (borrowed) may be empty to use the server's accumulated buffer; lr NULL
// for the configured rate. *model_version receives the new version.
int rnnd_client_apply_gradients(struct rnnd_client *c, const struct rnnd_named_tensors *grads,
                                const float *lr, uint64_t *model_version);

// GetWeights: *out receives new tensors (free with rnnd_named_tensors_free); model_version may be
// NULL.
int rnnd_client_get_weights(struct rnnd_client *c, struct rnnd_named_tensors *out,
                            uint64_t *model_version);
// SetWeights: tensors borrowed; model_version may be NULL.
int rnnd_client_set_weights(struct rnnd_client *c, const struct rnnd_named_tensors *tensors,
                            uint64_t *model_version);

// SaveCheckpoint: path NULL or "" for a new directory. *path_out (may be NULL) receives a new
// string, free with free(); model_version may be NULL.
int rnnd_client_save_checkpoint(struct rnnd_client *c, const char *path, char **path_out,
                                uint64_t *model_version);

// Sends raw request bytes to method ("/rnnd.v1.Rnn/Step") and returns the raw reply in *reply
// (new, free with free()) and *reply_len: for callers with their own serialisation (the Python
// client's native calls, rnnd/_native.py) and tests that send what the typed calls cannot.
int rnnd_client_call_raw(struct rnnd_client *c, const char *method, const void *req, size_t req_len,
                         void **reply, size_t *reply_len);

// ---------------------------------------------------------------------------------------------
// Shared memory (docs/design.md "Shared memory"): for a client on the daemon's host, reached
// through a unix: target or loopback and running as the daemon's user.

// Creates a memory region of `bytes` (0: 64 MiB) shared with the daemon (a sealed memfd,
// registered once with RegisterRegion). From then on Step, StepStream, Forward and Backward copy
// their tensors into it and the daemon writes the replies' tensors into it: only small
// descriptors travel over gRPC, and replies still come back as owned tensors. A call whose
// tensors do not fit into the region's free part goes as bytes. The region is released by
// rnnd_client_free. 0, or the daemon's refusal (RNND_EPRECOND: another host, another user,
// shared memory off; RNND_EFULL: --max-shm-regions), or a local RNND_EIO / RNND_ENOMEM; the
// client then keeps sending bytes. Call it before other threads use the client.
int rnnd_client_shm_start(struct rnnd_client *c, size_t bytes);
// How the tensors travel: "shm" after rnnd_client_shm_start succeeded, else "grpc".
const char *rnnd_client_transport(const struct rnnd_client *c);

// ---------------------------------------------------------------------------------------------
// Helpers for callers that hold weights as one flat array (rnnd_kernels.h layout).

// Copies the 4*L tensors of m from l into params (P floats). RNND_EINVAL when a tensor is
// missing or has the wrong shape, dtype or byte count.
int rnnd_named_tensors_to_params(const struct rnnd_named_tensors *l, const struct rnnd_model *m,
                                 float *params);
// Fills *out with new FLOAT32 tensors of m taken from params (free with rnnd_named_tensors_free).
int rnnd_named_tensors_from_params(struct rnnd_named_tensors *out, const struct rnnd_model *m,
                                   const float *params);

#ifdef __cplusplus
}
#endif

#endif // RNND_CLIENT_H
