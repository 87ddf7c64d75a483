/*
 * log.h: the daemon's one logging macro and its fail-fast checks.
 *
 * rnnd_log(level, fmt, ...) filters by level before it formats anything (redis serverLog), so a
 * debug line costs one comparison when debug is off. Lines go to stderr as
 * "2026-11-21T10:07:00.123Z I message", or with --log-format json as one JSON object per line:
 * {"ts":"2026-11-21T10:07:00.123Z","level":"info","msg":"message"} (a panic adds "file" and
 * "line"; bytes that are not UTF-8 become U+FFFD). Any thread may log; each line is one write(2).
 * RNND_ASSERT / rnnd_panic are for broken invariants (docs/style.md "Errors"): they log file:line
 * and abort, and the supervisor restarts the daemon.
 */
#ifndef RNND_LOG_H
#define RNND_LOG_H

#include <stdarg.h>
#include <stdbool.h>

enum rnnd_log_level {
    RNND_LOG_DEBUG,
    RNND_LOG_INFO,
    RNND_LOG_WARN,
    RNND_LOG_ERROR,
};

enum rnnd_log_format {
    RNND_LOG_FORMAT_TEXT,
    RNND_LOG_FORMAT_JSON,
};

// The current threshold; set once at start-up before other threads run.
extern int rnnd__log_level;

#define rnnd_log(level, ...)                                                                       \
    do {                                                                                           \
        if ((int)(level) >= rnnd__log_level)                                                       \
            rnnd__log_write((level), __VA_ARGS__);                                                 \
    } while (0)

void rnnd__log_write(enum rnnd_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void rnnd_log_set_level(enum rnnd_log_level level);
// Text or JSON lines; set once at start-up before other threads run.
void rnnd_log_set_format(enum rnnd_log_format format);
// Parses "debug", "info", "warn" or "error" into *out: 0, or -1 for anything else.
int rnnd_log_level_parse(const char *s, enum rnnd_log_level *out);
const char *rnnd_log_level_name(enum rnnd_log_level level);

// Writes line (no prefix, a newline added) to stdout and, unless it is the same file, stderr,
// flushed: the ready line, which tests and supervisors look for whatever stream they read. With
// JSON logs, stderr gets it as an info line's msg, and stdout the plain line unless stdout is
// stderr's file too (so the log stays all JSON).
void rnnd_log_banner(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

_Noreturn void rnnd_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define RNND_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond))                                                                               \
            rnnd_panic(__FILE__, __LINE__, "assertion failed: %s", #cond);                         \
    } while (0)

#endif // RNND_LOG_H
