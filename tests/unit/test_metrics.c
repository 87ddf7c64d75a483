/*
 * test_metrics.c: the Prometheus text that server/metrics.c renders, against operators'
 * conventions: bucket bounds and sums printed exactly (no %g rounding such as 1.04858e+06), one
 * unit per limit family (rnnd_limit_bytes, rnnd_limit_items; rnnd_limit kept, deprecated),
 * rnnd_build_info once the backend is known, and the standard process_* metrics, which must agree
 * with what this process reads about itself.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>

#include <cmocka.h>

#include "metrics.h"

// /metrics as rendered now: a new string, free with free().
// Out of line: inlined, GCC 12 takes the pointers its callers find in the result (strstr) for
// pointers into this frame (-Wdangling-pointer).
__attribute__((noinline)) static char *render(void) {
    char *text = NULL;
    size_t len = 0;
    int err = rnnd_metrics_render(&text, &len);
    assert_int_equal(err, 0);
    assert_int_equal(strlen(text), len);
    return text;
}

// The value of the sample written exactly as `sample` (name and labels), or NAN.
static double sample(const char *text, const char *name) {
    size_t n = strlen(name);
    for (const char *p = text; (p = strstr(p, name)); p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return NAN;
}

static void test_bounds_exact(void **state) {
    (void)state;
    rnnd_metrics_init();
    rnnd_histogram_observe(&rnnd_metrics.request_size, 1048576);
    rnnd_histogram_observe(&rnnd_metrics.request_size, 3);
    rnnd_metrics_request(RNND_METHOD_STEP, 0, 25000);
    rnnd_metrics_request(RNND_METHOD_STEP, 0, 1);
    rnnd_metrics_kernel(RNND_OP_STEP, 1234567890123ull);
    char *text = render();
    assert_non_null(strstr(text, "rnnd_request_message_bytes_bucket{le=\"1048576\"} 2\n"));
    assert_non_null(strstr(text, "rnnd_request_message_bytes_bucket{le=\"268435456\"} 2\n"));
    assert_non_null(strstr(text, "rnnd_request_message_bytes_sum 1048579\n"));
    assert_non_null(strstr(text, "rnnd_request_duration_seconds_bucket{method=\"Step\","
                                 "le=\"0.000025\"} 2\n"));
    assert_non_null(strstr(text, "rnnd_request_duration_seconds_bucket{method=\"Step\","
                                 "le=\"0.4096\"} 2\n"));
    assert_non_null(strstr(text, "rnnd_request_duration_seconds_bucket{method=\"Step\","
                                 "le=\"10\"} 2\n"));
    assert_non_null(
        strstr(text, "rnnd_request_duration_seconds_sum{method=\"Step\"} 0.000025001\n"));
    assert_non_null(
        strstr(text, "rnnd_backend_kernel_seconds_total{op=\"step\"} 1234.567890123\n"));
    assert_non_null(strstr(text, "rnnd_step_queue_delay_seconds_bucket{le=\"0.000001\"} 0\n"));
    // Every bound: digits, at most one point, no trailing zero after it, no exponent.
    int bounds = 0;
    for (const char *p = text; (p = strstr(p, "le=\"")); bounds++) {
        p += 4;
        size_t n = strcspn(p, "\"");
        if (n == 4 && memcmp(p, "+Inf", 4) == 0)
            continue;
        int points = 0;
        for (size_t i = 0; i < n; i++) {
            points += p[i] == '.';
            if (!isdigit((unsigned char)p[i]) && p[i] != '.')
                fail_msg("bound %.*s is not a plain decimal", (int)n, p);
        }
        assert_true(points <= 1 && (points == 0 || p[n - 1] != '0'));
    }
    assert_true(bounds > 100);
    free(text);
}

static void test_limit_units(void **state) {
    (void)state;
    rnnd_metrics_init();
    const char *names[RNND_LIMIT_COUNT] = {
        "envs",        "step_queue_rows", "tape_bytes",     "message_bytes", "streams",
        "reply_bytes", "connections",     "health_watches", "shm_regions",   "socket_region_bytes"};
    for (int i = 0; i < RNND_LIMIT_COUNT; i++)
        atomic_store(&rnnd_metrics.limit[i], 1000 + i);
    char *text = render();
    assert_non_null(strstr(text, "# HELP rnnd_limit Deprecated: "));
    assert_non_null(strstr(text, "# TYPE rnnd_limit_bytes gauge\n"));
    assert_non_null(strstr(text, "# TYPE rnnd_limit_items gauge\n"));
    for (int i = 0; i < RNND_LIMIT_COUNT; i++) {
        char old[96], bytes[96], items[96];
        snprintf(old, sizeof old, "rnnd_limit{resource=\"%s\"}", names[i]);
        snprintf(bytes, sizeof bytes, "rnnd_limit_bytes{resource=\"%s\"}", names[i]);
        snprintf(items, sizeof items, "rnnd_limit_items{resource=\"%s\"}", names[i]);
        assert_true(sample(text, old) == 1000 + i);
        // Byte bounds, and only they, are in rnnd_limit_bytes; each bound is in one family.
        bool in_bytes = strstr(names[i], "_bytes") != NULL;
        assert_true(sample(text, in_bytes ? bytes : items) == 1000 + i);
        assert_true(isnan(sample(text, in_bytes ? items : bytes)));
    }
    free(text);
}

static void test_build_info(void **state) {
    (void)state;
    rnnd_metrics_init();
    char *before = render();
    assert_null(strstr(before, "rnnd_build_info")); // no backend yet
    free(before);
    atomic_store(&rnnd_metrics.backend, "cpu");
    char *text = render();
    const char *p = strstr(text, "\nrnnd_build_info{version=\"");
    assert_non_null(p);
    char version[32], commit[64], backend[16], cuda[16];
    int got =
        sscanf(p,
               "\nrnnd_build_info{version=\"%31[^\"]\",commit=\"%63[^\"]\",backend=\"%15[^\"]\","
               "cuda=\"%15[^\"]\"} 1\n",
               version, commit, backend, cuda);
    assert_int_equal(got, 4);
    assert_true(isdigit((unsigned char)version[0]) && strchr(version, '.'));
    assert_true(strcmp(commit, "unknown") == 0 || strspn(commit, "0123456789abcdef") == 12);
    assert_string_equal(backend, "cpu");
    assert_true(strcmp(cuda, "none") == 0 || isdigit((unsigned char)cuda[0]));
    assert_non_null(strstr(text, "# TYPE rnnd_build_info gauge\n"));
    free(text);
}

static void test_process(void **state) {
    (void)state;
    rnnd_metrics_init();
    // Hold a few more descriptors, so the count is seen to follow them.
    FILE *held[3];
    for (int i = 0; i < 3; i++)
        assert_non_null(held[i] = fopen("/proc/self/stat", "r"));
    int fds = 0;
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));)
        fds += e->d_name[0] != '.';
    closedir(d);
    fds -= 1; // the directory's own
    char *text = render();
    for (int i = 0; i < 3; i++)
        fclose(held[i]);
    assert_true(sample(text, "process_open_fds") == fds);
    struct rlimit rl;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    assert_true(sample(text, "process_max_fds") == (double)rl.rlim_cur);
    // Resident memory between 1 MiB and the virtual size; the process started a moment ago.
    double rss = sample(text, "process_resident_memory_bytes");
    assert_true(rss > (1 << 20) && rss <= sample(text, "process_virtual_memory_bytes"));
    double start = sample(text, "process_start_time_seconds");
    assert_true(fabs(start - (double)time(NULL)) < 60);
    assert_true(sample(text, "process_cpu_seconds_total") >= 0);
    assert_non_null(strstr(text, "# TYPE process_cpu_seconds_total counter\n"));
    assert_non_null(strstr(text, "# TYPE process_start_time_seconds gauge\n"));
    free(text);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bounds_exact),
        cmocka_unit_test(test_limit_units),
        cmocka_unit_test(test_build_info),
        cmocka_unit_test(test_process),
    };
    return cmocka_run_group_tests_name("metrics", tests, NULL, NULL);
}
