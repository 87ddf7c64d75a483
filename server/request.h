/*
 * request.h: decoding and checking every request the daemon accepts, as pure functions of the
 * request bytes (or message) and the daemon's limits: no engine, no gRPC, no allocation that
 * outlives a call. rpc.c decodes with rnnd_request_decode; each handler of service.c runs its
 * method's check before it builds a job, so a request refused here changes no state. The fuzz
 * target (tests/fuzz) drives exactly these functions.
 *
 * Checks return 0 or an RNND_E* code with a message in err (RNND_REQUEST_ERRLEN bytes) saying
 * what was wrong and what to send instead (docs/design.md "Status codes"). Any thread.
 */
#ifndef RNND_REQUEST_H
#define RNND_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "config.h"
#include "job.h"
#include "metrics.h"
#include "rnnd/v1/rnnd.pb-c.h"

#define RNND_REQUEST_ERRLEN 512

// What a request is checked against (copied from the configuration at start).
struct rnnd_request_limits {
    struct rnnd_model model;
    size_t P; // parameter count of model
    int max_batch;
    int extras_size;
    int trajectory_steps;
    uint64_t cursor_id; // this daemon's cursor windows' id (never 0), drawn at start
    size_t max_message_bytes;
    float lr;
    char state_dir[RNND_CONFIG_PATH_MAX];
};

void rnnd_request_limits_init(struct rnnd_request_limits *l, const struct rnnd_config *cfg);

// The protobuf descriptor of method m's request; NULL for RNND_METHOD_UNKNOWN.
const ProtobufCMessageDescriptor *rnnd_request_descriptor(enum rnnd_method m);
// Decodes len bytes at data (borrowed) as method m's request: a new message (free with
// protobuf_c_message_free_unpacked(msg, NULL)), or NULL when the bytes do not decode.
ProtobufCMessage *rnnd_request_decode(enum rnnd_method m, const uint8_t *data, size_t len);

// Bytes per element of a rnnd.v1 DType value; 0 for an unknown one.
size_t rnnd_request_dtype_size(int dtype);

// grpc.health.v1: true for the services rnnd reports ("" and "rnnd.v1.Rnn").
bool rnnd_request_health_known(const char *service);

// The wire dtypes of a request's float tensors (in) and of its reply's (out).
struct rnnd_request_dtypes {
    enum rnnd_ftype in, out;
};
// The engine's element type for a float rnnd.v1 DType value (FLOAT32 for others), and back.
enum rnnd_ftype rnnd_request_ftype(int dtype);
int rnnd_request_dtype_of(enum rnnd_ftype ft);

// Step / StepStream. *extras: whether the request carries a usable extras tensor; *dts the
// dtypes of obs (and extras) and of the reply.
int rnnd_request_step(const struct rnnd_request_limits *l, const Rnnd__V1__StepRequest *req,
                      bool *extras, struct rnnd_request_dtypes *dts, char *err);
int rnnd_request_end_episodes(const struct rnnd_request_limits *l,
                              const Rnnd__V1__EndEpisodesRequest *req, char *err);
// Forward: fills *f (zeroed first) with pointers into req (borrowed: valid while req is), its
// dtypes and the recorded fields it returns. An explicit source without is_init leaves
// f->is_init NULL (no resets).
int rnnd_request_forward(const struct rnnd_request_limits *l, const Rnnd__V1__ForwardRequest *req,
                         struct rnnd_forward_job *f, char *err);
// Backward: fills *g (zeroed first) with pointers into req. values_later: the engine checks the
// tensors' values once they are in place (a CUDA region's device pointers, a socket region in
// the backend's memory); they are not read here.
int rnnd_request_backward(const struct rnnd_request_limits *l, const Rnnd__V1__BackwardRequest *req,
                          struct rnnd_backward_job *g, bool values_later, char *err);
// ApplyGradients: *has_lr; when req carries grads they are copied into flat (P floats).
int rnnd_request_apply_gradients(const struct rnnd_request_limits *l,
                                 const Rnnd__V1__ApplyGradientsRequest *req, float *flat,
                                 bool *has_lr, char *err);
int rnnd_request_get_weights(const struct rnnd_request_limits *l, char *err);
// SetWeights: every tensor of the model exactly once, copied into flat (P floats).
int rnnd_request_set_weights(const struct rnnd_request_limits *l,
                             const Rnnd__V1__SetWeightsRequest *req, float *flat, char *err);
// SaveCheckpoint: a --state-dir is configured and a named path resolves inside it.
int rnnd_request_save_checkpoint(const struct rnnd_request_limits *l,
                                 const Rnnd__V1__SaveCheckpointRequest *req, char *err);

// The largest reply (bytes, framing included) of a request its check accepted: what
// --max-message-mb is checked against, and what the handler reserves of --max-reply-mb before
// any work starts (rnnd_call_reserve).
size_t rnnd_request_step_reply_bytes(const struct rnnd_request_limits *l,
                                     const Rnnd__V1__StepRequest *req);
size_t rnnd_request_forward_reply_bytes(const struct rnnd_request_limits *l,
                                        const struct rnnd_forward_job *f);
size_t rnnd_request_backward_reply_bytes(const struct rnnd_request_limits *l,
                                         const struct rnnd_backward_job *g);
size_t rnnd_request_get_weights_reply_bytes(const struct rnnd_request_limits *l);

#endif // RNND_REQUEST_H
