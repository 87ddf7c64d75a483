/*
 * test_log.c: log lines as written to stderr (server/log.c). Text lines keep their shape; with
 * --log-format json every line is one JSON object whose msg is escaped exactly (quotes,
 * backslashes, control characters, bytes that are not UTF-8), a panic adds file and line, a long
 * message is cut without breaking an escape, and the ready banner stays plain on stdout. Each case
 * runs in a child process whose stdout and stderr are pipes (a panic aborts it).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "log.h"

struct captured {
    char out[16384], err[16384];
};

static void read_all(int fd, char *buf, size_t cap) {
    size_t n = 0;
    ssize_t r;
    while (n + 1 < cap && (r = read(fd, buf + n, cap - 1 - n)) > 0)
        n += (size_t)r;
    buf[n] = '\0';
}

// Runs fn in a child with stdout and stderr on two pipes (or both on one when merged).
static void capture(void (*fn)(void), bool merged, struct captured *c) {
    int po[2], pe[2];
    assert_int_equal(pipe(po), 0);
    assert_int_equal(pipe(pe), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        dup2(po[1], STDOUT_FILENO);
        dup2(merged ? po[1] : pe[1], STDERR_FILENO);
        close(po[0]);
        close(pe[0]);
        fn();
        _exit(0);
    }
    close(po[1]);
    close(pe[1]);
    read_all(po[0], c->out, sizeof(c->out));
    read_all(pe[0], c->err, sizeof(c->err));
    close(po[0]);
    close(pe[0]);
    waitpid(pid, NULL, 0);
}

// line without its timestamp: checks the 24-character "2026-11-21T10:07:00.123Z" at ts_at.
static const char *after_ts(const char *line, size_t ts_at) {
    assert_true(strlen(line) > ts_at + 24);
    const char *ts = line + ts_at;
    assert_true(ts[4] == '-' && ts[10] == 'T' && ts[19] == '.' && ts[23] == 'Z');
    return ts + 24;
}

#define NASTY "q\"b\\n\nt\tc\x01 \xc3\xa9 \xff \xed\xa0\x80 end"

static void log_text(void) {
    rnnd_log_set_level(RNND_LOG_INFO);
    rnnd_log(RNND_LOG_DEBUG, "hidden");
    rnnd_log(RNND_LOG_INFO, "hello %d", 42);
    rnnd_panic("dir/f.c", 3, "boom");
}

static void test_text(void **state) {
    (void)state;
    struct captured c;
    capture(log_text, false, &c);
    char *second = strchr(c.err, '\n');
    assert_non_null(second);
    *second++ = '\0';
    assert_string_equal(after_ts(c.err, 0), " I hello 42");
    assert_string_equal(after_ts(second, 0), " E panic at dir/f.c:3: boom\n");
}

static void log_json(void) {
    rnnd_log_set_format(RNND_LOG_FORMAT_JSON);
    rnnd_log(RNND_LOG_DEBUG, "hidden");
    rnnd_log(RNND_LOG_WARN, "%s", NASTY);
    rnnd_panic("dir/x\"y.c", 42, "bad %d", 7);
}

static void test_json(void **state) {
    (void)state;
    struct captured c;
    capture(log_json, false, &c);
    char *second = strchr(c.err, '\n');
    assert_non_null(second);
    *second++ = '\0';
    assert_memory_equal(c.err, "{\"ts\":\"", 7);
    // é is kept as UTF-8; 0xff and the encoded surrogate ED A0 80 are not UTF-8.
    assert_string_equal(after_ts(c.err, 7),
                        "\",\"level\":\"warn\",\"msg\":\"q\\\"b\\\\n\\nt\\tc"
                        "\\u0001 \xc3\xa9 \\ufffd \\ufffd\\ufffd\\ufffd end\"}");
    assert_string_equal(after_ts(second, 7),
                        "\",\"level\":\"error\",\"msg\":\"panic at dir/x\\\"y.c:42: bad 7\","
                        "\"file\":\"dir/x\\\"y.c\",\"line\":42}\n");
}

static void log_long(void) {
    rnnd_log_set_format(RNND_LOG_FORMAT_JSON);
    char msg[3000];
    memset(msg, '"', sizeof(msg) - 1);
    msg[sizeof(msg) - 1] = '\0';
    rnnd_log(RNND_LOG_ERROR, "%s", msg);
}

static void test_json_long(void **state) {
    (void)state;
    struct captured c;
    capture(log_long, false, &c);
    // Cut to the formatting buffer, never inside an escape: the msg still ends in a whole \".
    size_t n = strlen(c.err);
    assert_true(n > 2000 && n < 8192);
    assert_string_equal(c.err + n - 5, "\\\"\"}\n");
    assert_ptr_equal(strchr(c.err, '\n'), c.err + n - 1);
}

static void banner_json(void) {
    rnnd_log_set_format(RNND_LOG_FORMAT_JSON);
    rnnd_log_banner("rnnd ready grpc=%s", "127.0.0.1:1");
}

static void test_banner(void **state) {
    (void)state;
    struct captured c;
    capture(banner_json, false, &c);
    assert_string_equal(c.out, "rnnd ready grpc=127.0.0.1:1\n");
    assert_string_equal(after_ts(c.err, 7), "\",\"level\":\"info\",\"msg\":\"rnnd ready "
                                            "grpc=127.0.0.1:1\"}\n");
    // One stream for both: the JSON line alone, so a collector reads nothing but JSON.
    capture(banner_json, true, &c);
    assert_string_equal(after_ts(c.out, 7), "\",\"level\":\"info\",\"msg\":\"rnnd ready "
                                            "grpc=127.0.0.1:1\"}\n");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_json),
        cmocka_unit_test(test_json_long),
        cmocka_unit_test(test_banner),
    };
    return cmocka_run_group_tests_name("log", tests, NULL, NULL);
}
