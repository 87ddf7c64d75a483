/*
 * http.c: a tiny HTTP/1.1 responder on libuv for health and metrics (see http.h). Each
 * connection owns a read buffer, a timeout timer and its response; it is freed when both of its
 * handles have closed (libuv: memory of a handle is released only in its close callback).
 */
#include "http.h"

#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "metrics.h"
#include "rnnd_kernels.h"

#define HTTP_MAX_REQUEST 8192
#define HTTP_TIMEOUT_MS  5000
#define HTTP_MAX_CONNS   256 // beyond this, new connections are closed at once

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wreq;
    struct rnnd_http *h;
    int open_handles;
    bool closing;
    bool responded;
    size_t len;
    char buf[HTTP_MAX_REQUEST];
    char *resp;
    struct conn *prev, *next;
};

struct rnnd_http {
    uv_tcp_t server;
    uv_loop_t *loop;
    struct conn *conns;
    int nconns;
    bool closing;
    bool server_closed;
    void (*done)(void *ctx);
    void *done_ctx;
};

static void http_maybe_done(struct rnnd_http *h) {
    if (h->closing && h->server_closed && h->conns == NULL) {
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
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    h->nconns--;
    free(c->resp);
    free(c);
    http_maybe_done(h);
}

static void conn_close(struct conn *c) {
    if (c->closing)
        return;
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, conn_closed);
    uv_close((uv_handle_t *)&c->timer, conn_closed);
}

static void on_written(uv_write_t *req, int status) {
    (void)status;
    conn_close(req->data);
}

static void respond(struct conn *c, int code, const char *reason, const char *ctype,
                    const char *body, size_t blen, const char *extra) {
    if (c->responded)
        return;
    c->responded = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
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

static void handle_request(struct conn *c) {
    // Request line: METHOD SP TARGET SP VERSION
    char method[16], target[1024];
    if (sscanf(c->buf, "%15s %1023s", method, target) != 2) {
        respond_text(c, 400, "Bad Request", "bad request line\n", NULL);
        return;
    }
    char *q = strchr(target, '?');
    if (q)
        *q = '\0';
    bool known = strcmp(target, "/healthz") == 0 || strcmp(target, "/readyz") == 0 ||
                 strcmp(target, "/metrics") == 0;
    if (!known) {
        respond_text(c, 404, "Not Found", "not found: try /healthz, /readyz or /metrics\n", NULL);
        return;
    }
    if (strcmp(method, "GET") != 0) {
        respond_text(c, 405, "Method Not Allowed", "only GET\n", "Allow: GET\r\n");
        return;
    }
    if (strcmp(target, "/healthz") == 0) {
        respond_text(c, 200, "OK", "ok\n", NULL);
    } else if (strcmp(target, "/readyz") == 0) {
        if (atomic_load(&rnnd_metrics.ready))
            respond_text(c, 200, "OK", "ready\n", NULL);
        else
            respond_text(c, 503, "Service Unavailable", "not ready\n", NULL);
    } else {
        char *body;
        size_t len;
        if (rnnd_metrics_render(&body, &len) != 0) {
            respond_text(c, 500, "Internal Server Error", "out of memory\n", NULL);
            return;
        }
        respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", body, len, NULL);
        free(body);
    }
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    struct conn *c = handle->data;
    size_t room = sizeof(c->buf) - 1 - c->len;
    *buf = uv_buf_init(c->buf + c->len, (unsigned)room);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
    (void)buf;
    struct conn *c = stream->data;
    if (nread < 0) {
        conn_close(c);
        return;
    }
    c->len += (size_t)nread;
    c->buf[c->len] = '\0';
    if (strstr(c->buf, "\r\n\r\n") || strstr(c->buf, "\n\n")) {
        handle_request(c);
        return;
    }
    if (c->len >= sizeof(c->buf) - 1)
        respond_text(c, 431, "Request Header Fields Too Large", "request too large\n", NULL);
}

static void on_timeout(uv_timer_t *t) {
    struct conn *c = t->data;
    if (!c->responded)
        respond_text(c, 408, "Request Timeout", "request timeout\n", NULL);
    else
        conn_close(c);
}

static void on_connection(uv_stream_t *server, int status) {
    struct rnnd_http *h = server->data;
    if (status < 0 || h->closing)
        return;
    struct conn *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return;
    c->h = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->tcp.data = c;
    c->timer.data = c;
    c->open_handles = 2;
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->nconns++;
    if (h->nconns > HTTP_MAX_CONNS) {
        // Accept and close: a flood of idle connections must not pin memory or descriptors.
        uv_accept(server, (uv_stream_t *)&c->tcp);
        conn_close(c);
        return;
    }
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_timeout, HTTP_TIMEOUT_MS, 0);
}

static void free_on_close(uv_handle_t *handle) {
    free(handle->data);
}

int rnnd_http_start(uv_loop_t *loop, const char *addr, struct rnnd_http **out, int *port, char *err,
                    size_t errlen) {
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (colon == NULL) {
        snprintf(err, errlen, "--http %s: not HOST:PORT", addr);
        return RNND_EINVAL;
    }
    size_t hl = (size_t)(colon - addr);
    if (hl >= sizeof(host))
        hl = sizeof(host) - 1;
    memcpy(host, addr, hl);
    host[hl] = '\0';
    if (host[0] == '[' && hl >= 2 && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &res);
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
    for (struct conn *c = h->conns; c; c = c->next)
        conn_close(c);
    uv_close((uv_handle_t *)&h->server, server_closed);
}
