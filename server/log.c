/*
 * log.c: formatting and writing log lines, as text or JSON (see log.h). A line is formatted into
 * a stack buffer and written with one write(2), so lines from different threads never interleave.
 */
#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

int rnnd__log_level = RNND_LOG_INFO;

static const char *const level_names[] = {"debug", "info", "warn", "error"};
static const char level_letters[] = {'D', 'I', 'W', 'E'};

void rnnd_log_set_level(enum rnnd_log_level level) {
    rnnd__log_level = (int)level;
}

int rnnd_log_level_parse(const char *s, enum rnnd_log_level *out) {
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (enum rnnd_log_level)i;
            return 0;
        }
    }
    return -1;
}

const char *rnnd_log_level_name(enum rnnd_log_level level) {
    return (unsigned)level < 4 ? level_names[level] : "?";
}

static int log_format = RNND_LOG_FORMAT_TEXT;

void rnnd_log_set_format(enum rnnd_log_format format) {
    log_format = (int)format;
}

// "2026-11-21T10:07:00.123Z" into buf (at least 32 bytes).
static void log_time(char *buf, size_t cap) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03dZ", (int)(ts.tv_nsec / 1000000));
}

// Bytes of the well-formed UTF-8 sequence that starts at s (1 to 4), or 0 when it is not one
// (a stray continuation byte, an overlong form, a surrogate, or a sequence cut short).
static int utf8_seq(const unsigned char *s) {
    unsigned lo = 0x80, hi = 0xBF;
    int n;
    if (s[0] < 0x80)
        return 1;
    if (s[0] >= 0xC2 && s[0] <= 0xDF) {
        n = 2;
    } else if (s[0] >= 0xE0 && s[0] <= 0xEF) {
        n = 3;
        lo = s[0] == 0xE0 ? 0xA0 : lo;
        hi = s[0] == 0xED ? 0x9F : hi;
    } else if (s[0] >= 0xF0 && s[0] <= 0xF4) {
        n = 4;
        lo = s[0] == 0xF0 ? 0x90 : lo;
        hi = s[0] == 0xF4 ? 0x8F : hi;
    } else {
        return 0;
    }
    if (s[1] < lo || s[1] > hi)
        return 0;
    for (int i = 2; i < n; i++)
        if ((s[i] & 0xC0) != 0x80)
            return 0;
    return n;
}

// Writes src into dst as the inside of a JSON string, at most cap bytes and never half an
// escape: quotes, backslashes and control characters escaped, bytes that are not UTF-8 as
// \ufffd (JSON text must be UTF-8, and a path or a peer's bytes need not be). Returns the length.
static size_t json_escape(char *dst, size_t cap, const char *src) {
    size_t n = 0;
    for (const unsigned char *s = (const unsigned char *)src; *s;) {
        char esc[8];
        const char *piece = esc;
        size_t len = 2;
        int adv = 1, seq = utf8_seq(s);
        if (*s == '"' || *s == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*s;
        } else if (*s == '\n' || *s == '\r' || *s == '\t') {
            esc[0] = '\\';
            esc[1] = *s == '\n' ? 'n' : *s == '\r' ? 'r' : 't';
        } else if (*s < 0x20) {
            len = (size_t)snprintf(esc, sizeof(esc), "\\u%04x", *s);
        } else if (seq == 0) {
            piece = "\\ufffd";
            len = 6;
        } else {
            piece = (const char *)s;
            len = (size_t)seq;
            adv = seq;
        }
        if (n + len > cap)
            break;
        memcpy(dst + n, piece, len);
        n += len;
        s += adv;
    }
    return n;
}

static void write_all(int fd, const char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w <= 0)
            return;
        buf += w;
        n -= (size_t)w;
    }
}

// One line to stderr in the chosen format; file is NULL except for a panic.
static void log_emit(enum rnnd_log_level level, const char *file, int line, const char *msg) {
    char ts[32], buf[8192];
    log_time(ts, sizeof(ts));
    size_t n;
    if (log_format == RNND_LOG_FORMAT_JSON) {
        n = (size_t)snprintf(buf, sizeof(buf), "{\"ts\":\"%s\",\"level\":\"%s\",\"msg\":\"", ts,
                             rnnd_log_level_name(level));
        n += json_escape(buf + n, sizeof(buf) - n - 600, msg); // room left for the rest
        if (file) {
            n += (size_t)snprintf(buf + n, sizeof(buf) - n, "\",\"file\":\"");
            n += json_escape(buf + n, 500, file);
            n += (size_t)snprintf(buf + n, sizeof(buf) - n, "\",\"line\":%d}\n", line);
        } else {
            n += (size_t)snprintf(buf + n, sizeof(buf) - n, "\"}\n");
        }
    } else {
        // Text lines stay as long as they always were: at most 2 KiB.
        int m = snprintf(buf, 2048, "%s %c %s", ts,
                         (unsigned)level < 4 ? level_letters[level] : '?', msg);
        n = m < 0 ? 0 : (size_t)m < 2047 ? (size_t)m : 2046;
        buf[n++] = '\n';
    }
    write_all(STDERR_FILENO, buf, n);
}

void rnnd__log_write(enum rnnd_log_level level, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    log_emit(level, NULL, 0, msg);
}

void rnnd_log_banner(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        m = 0;
    size_t n = (size_t)m < sizeof(buf) - 1 ? (size_t)m : sizeof(buf) - 2;
    buf[n] = '\0';
    // Once when both streams lead to the same place (a terminal, a merged pipe, the journal).
    struct stat out, err;
    bool same = fstat(STDOUT_FILENO, &out) == 0 && fstat(STDERR_FILENO, &err) == 0 &&
                out.st_dev == err.st_dev && out.st_ino == err.st_ino;
    bool json = log_format == RNND_LOG_FORMAT_JSON;
    if (json)
        log_emit(RNND_LOG_INFO, NULL, 0, buf);
    buf[n++] = '\n';
    fflush(stdout);
    if (!(json && same))
        write_all(STDOUT_FILENO, buf, n);
    if (!json && !same)
        write_all(STDERR_FILENO, buf, n);
}

void rnnd_panic(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    char text[1400];
    snprintf(text, sizeof(text), "panic at %s:%d: %s", file, line, msg);
    log_emit(RNND_LOG_ERROR, file, line, text);
    abort();
}
