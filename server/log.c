/*
 * log.c: formatting and writing log lines (see log.h). A line is formatted into a stack buffer
 * and written with one write(2), so lines from different threads never interleave.
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

static size_t log_prefix(char *buf, size_t cap, char letter) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(buf, cap, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %c ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                     ts.tv_nsec / 1000000, letter);
    return n < 0 ? 0 : (size_t)n;
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

static void log_vwrite(char letter, const char *fmt, va_list ap) {
    char buf[2048];
    size_t n = log_prefix(buf, sizeof(buf), letter);
    int m = vsnprintf(buf + n, sizeof(buf) - n - 1, fmt, ap);
    if (m < 0)
        m = 0;
    n += (size_t)m;
    if (n > sizeof(buf) - 2)
        n = sizeof(buf) - 2;
    buf[n++] = '\n';
    write_all(STDERR_FILENO, buf, n);
}

void rnnd__log_write(enum rnnd_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_vwrite((unsigned)level < 4 ? level_letters[level] : '?', fmt, ap);
    va_end(ap);
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
    buf[n++] = '\n';
    fflush(stdout);
    write_all(STDOUT_FILENO, buf, n);
    // Once when both streams lead to the same place (a terminal, a merged pipe, the journal).
    struct stat out, err;
    bool same = fstat(STDOUT_FILENO, &out) == 0 && fstat(STDERR_FILENO, &err) == 0 &&
                out.st_dev == err.st_dev && out.st_ino == err.st_ino;
    if (!same)
        write_all(STDERR_FILENO, buf, n);
}

void rnnd_panic(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    rnnd__log_write(RNND_LOG_ERROR, "panic at %s:%d: %s", file, line, msg);
    abort();
}
