/*
 * server.h: the daemon as a whole. rnnd_server_run owns the libuv loop (signals, HTTP, the cron
 * timer, handoffs from other threads), the gRPC layer and the engine, and runs the lifecycle:
 * bind, load, print the ready line, serve, and on SIGTERM/SIGINT drain and exit.
 */
#ifndef RNND_SERVER_H
#define RNND_SERVER_H

#include "config.h"

// Runs the daemon with cfg until it is told to stop. Returns the process exit code: 0 after a
// clean drain, 1 when start-up failed (the reason is logged).
int rnnd_server_run(const struct rnnd_config *cfg);

#endif // RNND_SERVER_H
