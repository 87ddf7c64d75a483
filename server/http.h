/*
 * http.h: the operator's HTTP endpoints on the libuv loop: GET /healthz (200 while the process
 * runs), GET /readyz (200 only while serving: 503 while starting and while draining) and GET
 * /metrics (Prometheus text, metrics.h). Anything else is 404, a method other than GET 405.
 * Every response closes its connection. Loop thread only.
 *
 * Bounds, so that probes and scrapes keep answering while clients misbehave (slowloris):
 * a request head is at most RNND_HTTP_MAX_REQUEST bytes (431 past it) and must arrive within
 * RNND_HTTP_HEADER_TIMEOUT_MS of the connect (408 then); a response must be written within
 * RNND_HTTP_WRITE_TIMEOUT_MS; at most RNND_HTTP_MAX_CONNS connections are open, and a new one
 * beyond that closes the oldest connection still sending its request (else the oldest one), so
 * a new client is never turned away. rnnd_http_connections and
 * rnnd_http_connections_dropped_total (metrics.h) count them.
 */
#ifndef RNND_HTTP_H
#define RNND_HTTP_H

#include <stddef.h>
#include <uv.h>

#define RNND_HTTP_MAX_REQUEST       8192
#define RNND_HTTP_HEADER_TIMEOUT_MS 2000
#define RNND_HTTP_WRITE_TIMEOUT_MS  5000
#define RNND_HTTP_MAX_CONNS         256

struct rnnd_http;

// Binds addr (HOST:PORT, port 0 for any) on loop and starts accepting. 0, *out and the bound
// port in *port; or a negative RNND_E* with the reason in err.
int rnnd_http_start(uv_loop_t *loop, const char *addr, struct rnnd_http **out, int *port, char *err,
                    size_t errlen);
// Stops accepting, closes every connection and frees h once all its handles are closed; then
// calls done(ctx) (may be NULL).
void rnnd_http_close(struct rnnd_http *h, void (*done)(void *ctx), void *ctx);

// What the bytes received so far on a connection ask for.
enum rnnd_http_route {
    RNND_HTTP_ROUTE_INCOMPLETE,  // the head has not ended (no blank line yet): read more
    RNND_HTTP_ROUTE_HEALTHZ,     // GET /healthz (a query string is ignored)
    RNND_HTTP_ROUTE_READYZ,      // GET /readyz
    RNND_HTTP_ROUTE_METRICS,     // GET /metrics
    RNND_HTTP_ROUTE_BAD_REQUEST, // 400: the first line is not METHOD SP /PATH [SP HTTP/...]
    RNND_HTTP_ROUTE_NOT_FOUND,   // 404: a path other than the three
    RNND_HTTP_ROUTE_BAD_METHOD,  // 405: a method other than GET on one of the three
    RNND_HTTP_ROUTE_TOO_LARGE,   // 431: cap bytes and the head has not ended
};

// Classifies the first len bytes (borrowed; any bytes, no NUL needed) received on a connection
// whose buffer holds cap bytes. Bytes after the blank line ending the head are ignored. Pure
// (no allocation, no state): any thread; tests/fuzz/fuzz_http.c fuzzes it.
enum rnnd_http_route rnnd_http_parse(const char *buf, size_t len, size_t cap);

#endif // RNND_HTTP_H
