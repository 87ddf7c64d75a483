/*
 * service.h: the rnnd.v1.Rnn handlers: check each request against the model (request.h: shapes,
 * dtypes, byte counts, duplicates, non-finite values), turn it into an engine job, and turn the
 * finished job into the reply. Checks that need engine state (env table, tapes) happen in the
 * engine; everything else is refused here, before anything is queued, so a rejected request
 * changes no state. A reply that can be large is reserved of --max-reply-mb (rnnd_call_reserve)
 * right after the check, before any work. No grpc_* calls here (rpc.h is the seam). Jobs go to
 * the group (group.h), which runs them on this daemon's one engine or splits them over several.
 */
#ifndef RNND_SERVICE_H
#define RNND_SERVICE_H

#include <stddef.h>

#include "config.h"
#include "group.h"
#include "request.h"
#include "rpc.h"

struct rnnd_service {
    const struct rnnd_config *cfg;
    struct rnnd_group *group;
    struct rnnd_request_limits limits; // what requests are checked against
    struct rnnd_shm *shm;              // shared-memory regions (RegisterRegion, ReleaseRegion)
};

// rnnd_rpc_handler_fn for each method; svc is a struct rnnd_service.
void rnnd_service_get_model_info(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_step(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_end_episodes(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_forward(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_backward(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_apply_gradients(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_get_weights(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_set_weights(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_save_checkpoint(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
// Answered on the gRPC thread (shm.c: a few system calls).
void rnnd_service_register_region(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);
void rnnd_service_release_region(void *svc, struct rnnd_call *call, const ProtobufCMessage *req);

#endif // RNND_SERVICE_H
