/*
 * http.h: the operator's HTTP endpoints on the libuv loop: GET /healthz (200 while the process
 * runs), GET /readyz (200 only while serving: not starting, not draining) and GET /metrics
 * (Prometheus text, metrics.h). Anything else is 404, a method other than GET 405. Requests are
 * bounded in size (8 KiB of headers) and time (5 s); every response closes its connection.
 * Loop thread only.
 */
#ifndef RNND_HTTP_H
#define RNND_HTTP_H

#include <uv.h>

struct rnnd_http;

// Binds addr (HOST:PORT, port 0 for any) on loop and starts accepting. 0, *out and the bound
// port in *port; or a negative RNND_E* with the reason in err.
int rnnd_http_start(uv_loop_t *loop, const char *addr, struct rnnd_http **out, int *port, char *err,
                    size_t errlen);
// Stops accepting, closes every connection and frees h once all its handles are closed; then
// calls done(ctx) (may be NULL).
void rnnd_http_close(struct rnnd_http *h, void (*done)(void *ctx), void *ctx);

#endif // RNND_HTTP_H
