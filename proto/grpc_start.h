// grpc_start.h: grpc_init for rnnd's processes (grpc_start.cc).
#ifndef RNND_GRPC_START_H
#define RNND_GRPC_START_H

#ifdef __cplusplus
extern "C" {
#endif

void rnnd_grpc_init(void);

#ifdef __cplusplus
}
#endif

#endif // RNND_GRPC_START_H
