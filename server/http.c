/*
 * http.c: a tiny HTTP/1.1 responder on libuv for health and metrics (see http.h for the bounds).
 * Each connection owns a read buffer, a deadline timer and its response; it is freed when both
 * of its handles have closed (libuv: memory of a handle is released only in its close callback).
 * Connections sit in one list in accept order, oldest first, so that the connection cap can
 * find the one to evict; a closing one stays in the list until its handles have closed, but no
 * longer counts against the cap.
 */
#include "http.h"

#include <netdb.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "metrics.h"
#include "net.h"
#include "rnnd_kernels.h"

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer; // the header deadline, then the write deadline
    uv_write_t wreq;
    struct rnnd_http *h;
    int open_handles;
    bool closing;
    bool responded;
    size_t len;
    char buf[RNND_HTTP_MAX_REQUEST];
    char *resp;
    struct conn *prev, *next;
};

struct rnnd_http {
    uv_tcp_t server;
    uv_loop_t *loop;
    struct conn *head, *tail; // accept order: head is the oldest
    int nopen;                // connections not closing: what the cap counts
    bool closing;
    bool server_closed;
    void (*done)(void *ctx);
    void *done_ctx;
};

// ---------------------------------------------------------------------------------------------
// Parsing

static bool is_visible(char ch) {
    return ch > ' ' && ch < 0x7f;
}

// The first blank line ("\r\n\r\n" or "\n\n") in buf, or NULL.
static const char *head_end(const char *buf, size_t len) {
    const char *crlf = memmem(buf, len, "\r\n\r\n", 4);
    const char *lf = memmem(buf, crlf ? (size_t)(crlf - buf) : len, "\n\n", 2);
    return lf ? lf : crlf;
}

enum rnnd_http_route rnnd_http_parse(const char *buf, size_t len, size_t cap) {
    const char *end = head_end(buf, len);
    if (end == NULL)
        return len >= cap ? RNND_HTTP_ROUTE_TOO_LARGE : RNND_HTTP_ROUTE_INCOMPLETE;
    // The request line: METHOD SP TARGET [SP VERSION], each a run of visible characters. It
    // ends at the first newline, which the blank line found above guarantees.
    const char *eol = memchr(buf, '\n', len);
    if (eol > buf && eol[-1] == '\r')
        eol--;
    const char *p = buf;
    const char *method = p;
    while (p < eol && is_visible(*p))
        p++;
    size_t method_len = (size_t)(p - method);
    if (method_len == 0 || p == eol || *p++ != ' ' || p == eol || *p != '/')
        return RNND_HTTP_ROUTE_BAD_REQUEST;
    const char *path = p;
    while (p < eol && is_visible(*p))
        p++;
    const char *query = memchr(path, '?', (size_t)(p - path));
    size_t path_len = (size_t)((query ? query : p) - path);
    if (p < eol) {
        if (*p++ != ' ' || (size_t)(eol - p) < 5 || memcmp(p, "HTTP/", 5) != 0)
            return RNND_HTTP_ROUTE_BAD_REQUEST;
        while (p < eol && is_visible(*p))
            p++;
        if (p != eol)
            return RNND_HTTP_ROUTE_BAD_REQUEST;
    }
    static const struct {
        const char *path;
        enum rnnd_http_route route;
    } routes[] = {{"/healthz", RNND_HTTP_ROUTE_HEALTHZ},
                  {"/readyz", RNND_HTTP_ROUTE_READYZ},
                  {"/metrics", RNND_HTTP_ROUTE_METRICS}};
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
        if (path_len == strlen(routes[i].path) && memcmp(path, routes[i].path, path_len) == 0)
            return method_len == 3 && memcmp(method, "GET", 3) == 0 ? routes[i].route
                                                                    : RNND_HTTP_ROUTE_BAD_METHOD;
    return RNND_HTTP_ROUTE_NOT_FOUND;
}

// ---------------------------------------------------------------------------------------------
// Connections

static void http_maybe_done(struct rnnd_http *h) {
    if (h->closing && h->server_closed && h->head == NULL) {
        void (*done)(void *) = h->done;
        void *ctx = h->done_ctx;
        free(h);
        if (done)
            done(ctx);
    }
}

static void conn_closed(uv_handle_t *handle) {
    struct conn *c = handle->data;
    if (--c->open_handles > 0)
        return;
    struct rnnd_http *h = c->h;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        h->tail = c->prev;
    free(c->resp);
    free(c);
    http_maybe_done(h);
}

static void conn_close(struct conn *c) {
    if (c->closing)
        return;
    c->closing = true;
    c->h->nopen--;
    atomic_store(&rnnd_metrics.http_connections, c->h->nopen);
    uv_close((uv_handle_t *)&c->tcp, conn_closed);
    uv_close((uv_handle_t *)&c->timer, conn_closed);
}

static void on_written(uv_write_t *req, int status) {
    (void)status;
    conn_close(req->data);
}

static void on_timeout(uv_timer_t *t);

static void respond(struct conn *c, int code, const char *reason, const char *ctype,
                    const char *body, size_t blen, const char *extra) {
    if (c->responded)
        return;
    c->responded = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
    // A client that does not read its response holds the connection no longer than this.
    uv_timer_start(&c->timer, on_timeout, RNND_HTTP_WRITE_TIMEOUT_MS, 0);
    char head[512];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n%s\r\n",
                     code, reason, ctype, blen, extra ? extra : "");
    c->resp = malloc((size_t)n + blen);
    if (c->resp == NULL) {
        conn_close(c);
        return;
    }
    memcpy(c->resp, head, (size_t)n);
    memcpy(c->resp + n, body, blen);
    uv_buf_t b = uv_buf_init(c->resp, (unsigned)((size_t)n + blen));
    c->wreq.data = c;
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0)
        conn_close(c);
}

static void respond_text(struct conn *c, int code, const char *reason, const char *text,
                         const char *extra) {
    respond(c, code, reason, "text/plain; charset=utf-8", text, strlen(text), extra);
}

static void respond_metrics(struct conn *c) {
    char *body;
    size_t len;
    if (rnnd_metrics_render(&body, &len) != 0) {
        respond_text(c, 500, "Internal Server Error", "out of memory\n", NULL);
        return;
    }
    respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", body, len, NULL);
    free(body);
}

static void handle_request(struct conn *c, enum rnnd_http_route route) {
    switch (route) {
        case RNND_HTTP_ROUTE_INCOMPLETE:
            break;
        case RNND_HTTP_ROUTE_HEALTHZ:
            respond_text(c, 200, "OK", "ok\n", NULL);
            break;
        case RNND_HTTP_ROUTE_READYZ:
            if (atomic_load(&rnnd_metrics.ready))
                respond_text(c, 200, "OK", "ready\n", NULL);
            else
                respond_text(c, 503, "Service Unavailable", "not ready\n", NULL);
            break;
        case RNND_HTTP_ROUTE_METRICS:
            respond_metrics(c);
            break;
        case RNND_HTTP_ROUTE_BAD_REQUEST:
            respond_text(c, 400, "Bad Request",
                         "bad request line: send GET /healthz, /readyz or /metrics HTTP/1.1\n",
                         NULL);
            break;
        case RNND_HTTP_ROUTE_NOT_FOUND:
            respond_text(c, 404, "Not Found", "not found: try /healthz, /readyz or /metrics\n",
                         NULL);
            break;
        case RNND_HTTP_ROUTE_BAD_METHOD:
            respond_text(c, 405, "Method Not Allowed", "only GET\n", "Allow: GET\r\n");
            break;
        case RNND_HTTP_ROUTE_TOO_LARGE:
            respond_text(c, 431, "Request Header Fields Too Large", "request too large\n", NULL);
            break;
    }
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    struct conn *c = handle->data;
    *buf = uv_buf_init(c->buf + c->len, (unsigned)(sizeof(c->buf) - c->len));
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
    (void)buf;
    struct conn *c = stream->data;
    if (nread < 0) {
        conn_close(c);
        return;
    }
    c->len += (size_t)nread;
    handle_request(c, rnnd_http_parse(c->buf, c->len, sizeof(c->buf)));
}

static void on_timeout(uv_timer_t *t) {
    struct conn *c = t->data;
    if (c->responded) { // the client did not take its response in time
        conn_close(c);
        return;
    }
    atomic_fetch_add_explicit(&rnnd_metrics.http_dropped[RNND_HTTP_DROP_HEADER_TIMEOUT], 1,
                              memory_order_relaxed);
    respond_text(c, 408, "Request Timeout", "request timeout: send the request at once\n", NULL);
}

// At the cap: closes the oldest connection still sending its request (a slow or idle client;
// a probe sends its request as it connects), else the oldest of all (a client that does not
// read its response). The newest connections are the last to go, so a probe that connects
// during a flood of slow connections is answered.
static void evict_one(struct rnnd_http *h) {
    struct conn *victim = NULL;
    for (struct conn *c = h->head; c; c = c->next) {
        if (c->closing)
            continue;
        if (!c->responded) {
            victim = c;
            break;
        }
        if (victim == NULL)
            victim = c;
    }
    if (victim == NULL)
        return;
    atomic_fetch_add_explicit(&rnnd_metrics.http_dropped[RNND_HTTP_DROP_EVICTED], 1,
                              memory_order_relaxed);
    conn_close(victim);
}

static void on_connection(uv_stream_t *server, int status) {
    struct rnnd_http *h = server->data;
    if (status < 0) {
        atomic_fetch_add_explicit(&rnnd_metrics.http_dropped[RNND_HTTP_DROP_ACCEPT_FAILED], 1,
                                  memory_order_relaxed);
        return;
    }
    if (h->closing)
        return;
    if (h->nopen >= RNND_HTTP_MAX_CONNS)
        evict_one(h);
    struct conn *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        atomic_fetch_add_explicit(&rnnd_metrics.http_dropped[RNND_HTTP_DROP_ACCEPT_FAILED], 1,
                                  memory_order_relaxed);
        return;
    }
    c->h = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->tcp.data = c;
    c->timer.data = c;
    c->open_handles = 2;
    c->prev = h->tail;
    if (h->tail)
        h->tail->next = c;
    else
        h->head = c;
    h->tail = c;
    h->nopen++;
    atomic_store(&rnnd_metrics.http_connections, h->nopen);
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_timeout, RNND_HTTP_HEADER_TIMEOUT_MS, 0);
}

static void free_on_close(uv_handle_t *handle) {
    free(handle->data);
}

int rnnd_http_start(uv_loop_t *loop, const char *addr, struct rnnd_http **out, int *port, char *err,
                    size_t errlen) {
    char host[256], service[16];
    if (rnnd_net_split(addr, host, sizeof(host), service, sizeof(service)) != 0) {
        snprintf(err, errlen, "--http %s: not HOST:PORT", addr);
        return RNND_EINVAL;
    }
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host[0] ? host : NULL, service, &hints, &res);
    if (gai != 0 || res == NULL) {
        snprintf(err, errlen, "--http %s: cannot resolve: %s", addr, gai_strerror(gai));
        return RNND_EINVAL;
    }
    struct rnnd_http *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        freeaddrinfo(res);
        snprintf(err, errlen, "out of memory");
        return RNND_ENOMEM;
    }
    h->loop = loop;
    uv_tcp_init(loop, &h->server);
    h->server.data = h;
    int rc = uv_tcp_bind(&h->server, res->ai_addr, 0);
    freeaddrinfo(res);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&h->server, 128, on_connection);
    if (rc != 0) {
        snprintf(err, errlen, "--http %s: cannot listen: %s", addr, uv_strerror(rc));
        // Freed when the loop processes the close.
        uv_close((uv_handle_t *)&h->server, free_on_close);
        *out = NULL;
        return RNND_EIO;
    }
    struct sockaddr_storage ss;
    int sl = sizeof(ss);
    uv_tcp_getsockname(&h->server, (struct sockaddr *)&ss, &sl);
    *port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                     : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    *out = h;
    return 0;
}

static void server_closed(uv_handle_t *handle) {
    struct rnnd_http *h = handle->data;
    h->server_closed = true;
    http_maybe_done(h);
}

void rnnd_http_close(struct rnnd_http *h, void (*done)(void *ctx), void *ctx) {
    if (h == NULL) {
        if (done)
            done(ctx);
        return;
    }
    h->done = done;
    h->done_ctx = ctx;
    h->closing = true;
    for (struct conn *c = h->head; c; c = c->next)
        conn_close(c);
    uv_close((uv_handle_t *)&h->server, server_closed);
}
