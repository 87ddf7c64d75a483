/*
 * client_internal.h: what the files of the client library share and callers never see
 * (libuv's uv-common.h idea, on a small scale). Not installed.
 */
#ifndef RNND_CLIENT_INTERNAL_H
#define RNND_CLIENT_INTERNAL_H

#include "rnnd_client.h"

// Copies *e into the calling thread's last error (rnnd_client_last_error()).
void rnnd__client_error_set(const struct rnnd_client_error *e);

#endif // RNND_CLIENT_INTERNAL_H
