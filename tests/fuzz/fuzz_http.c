/*
 * fuzz_http.c: libFuzzer target for the HTTP request parser (rnnd_http_parse, server/http.c),
 * which sees every byte anyone sends to the HTTP port. The input is what a connection has
 * received, cut at the connection's buffer size as the server cuts it.
 *
 * Besides what ASan and UBSan catch, the result is checked against a plain restatement of the
 * rules: a request is complete at its first blank line and not before, bytes after that line
 * change nothing, 431 only for a full buffer without one, and an endpoint only for a GET.
 *
 * Build: CC=clang cmake -DRNND_FUZZ=ON -DRNND_CUDA=OFF; seeds: fuzz_seeds OUT (OUT/http).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"

// Where the head ends (just past its first blank line), or 0 when it has not.
static size_t head_len(const char *p, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (p[i] != '\n')
            continue;
        if (p[i + 1] == '\n')
            return i + 2;
        if (i > 0 && p[i - 1] == '\r' && p[i + 1] == '\r' && i + 2 < n && p[i + 2] == '\n')
            return i + 3;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const size_t cap = RNND_HTTP_MAX_REQUEST;
    size_t n = size < cap ? size : cap;
    const char *buf = (const char *)data;
    enum rnnd_http_route r = rnnd_http_parse(buf, n, cap);
    size_t head = head_len(buf, n);
    if (head == 0) {
        if (r != (n == cap ? RNND_HTTP_ROUTE_TOO_LARGE : RNND_HTTP_ROUTE_INCOMPLETE))
            abort();
        return 0;
    }
    if (r == RNND_HTTP_ROUTE_INCOMPLETE || r == RNND_HTTP_ROUTE_TOO_LARGE ||
        r > RNND_HTTP_ROUTE_TOO_LARGE)
        abort();
    // One byte short of its blank line, the head is incomplete; the bytes after it are ignored.
    if (rnnd_http_parse(buf, head - 1, cap) != RNND_HTTP_ROUTE_INCOMPLETE ||
        rnnd_http_parse(buf, head, cap) != r)
        abort();
    bool endpoint =
        r == RNND_HTTP_ROUTE_HEALTHZ || r == RNND_HTTP_ROUTE_READYZ || r == RNND_HTTP_ROUTE_METRICS;
    if (endpoint && memcmp(buf, "GET /", 5) != 0)
        abort();
    return 0;
}
