/*
 * test_config.c: rnnd's configuration (server/config.c): the defaults of docs/design.md, flags in
 * both spellings, config files (comments, quotes, line numbers in errors), flags winning over
 * the file, refusals that name the offending flag, the warning for a listen address that
 * other hosts reach without TLS or a token, --listen lists (TCP and unix: sockets) and
 * --data-listen.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "log.h"

static enum rnnd_config_result parse(struct rnnd_config *c, char *err, const char *const *args) {
    char *argv[64];
    int argc = 0;
    argv[argc++] = "rnnd";
    for (int i = 0; args[i]; i++)
        argv[argc++] = (char *)args[i];
    rnnd_config_defaults(c);
    FILE *out = fopen("/dev/null", "w");
    enum rnnd_config_result r = rnnd_config_parse(c, argc, argv, out, err, 512);
    fclose(out);
    return r;
}

static void test_defaults(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    assert_int_equal(parse(&c, err, (const char *[]){NULL}), RNND_CONFIG_RUN);
    assert_string_equal(c.listen, "127.0.0.1:50051");
    assert_string_equal(c.http, "127.0.0.1:9090");
    assert_int_equal(c.model.cell, RNND_CELL_GRU);
    assert_int_equal(c.model.I, 64);
    assert_int_equal(c.model.H, 128);
    assert_int_equal(c.model.L, 1);
    assert_int_equal(c.model.compute, RNND_COMPUTE_FP32);
    assert_int_equal(c.backend, RNND_BACKEND_AUTO);
    assert_int_equal(c.optimizer, RNND_OPTIM_ADAM);
    assert_true(c.lr == 1e-3f);
    assert_int_equal(c.max_delay_us, -1);
    assert_int_equal(c.env_idle_timeout_s, 3600);
    assert_int_equal(c.trajectory_steps, 256);
    assert_int_equal(c.max_message_mb, 128);
    assert_int_equal(c.extras_size, 0);
    assert_int_equal(c.max_batch, 4096);
    assert_int_equal(rnnd_config_queue_rows(&c), 64 * 4096);
}

// --max-batch left out: 4096 rows, or as many as one message holds; given: checked as it is.
static void test_max_batch_auto(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    // A row of I=64, H=4096, L=1: (64 + 2*4096 + 4096) * 4 bytes; 64 MiB hold 1358 of them.
    assert_int_equal(
        parse(&c, err, (const char *[]){"--hidden-size", "4096", "--max-message-mb", "64", NULL}),
        RNND_CONFIG_RUN);
    assert_int_equal(c.max_batch, (64 << 20) / ((64 + 3 * 4096) * 4));
    assert_int_equal(parse(&c, err,
                           (const char *[]){"--hidden-size", "4096", "--max-message-mb", "64",
                                            "--max-batch", "4096", NULL}),
                     RNND_CONFIG_ERROR);
    assert_non_null(strstr(err, "--max-batch 4096"));
    assert_int_equal(parse(&c, err, (const char *[]){"--max-batch", "1024", NULL}),
                     RNND_CONFIG_RUN);
    assert_int_equal(c.max_batch, 1024);
}

static void test_flags(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    assert_int_equal(parse(&c, err,
                           (const char *[]){"--cell",
                                            "lstm",
                                            "--hidden-size=32",
                                            "--layers",
                                            "3",
                                            "--compute",
                                            "bf16",
                                            "--lr",
                                            "0.5",
                                            "--seed",
                                            "18446744073709551615",
                                            "--listen",
                                            "[::1]:0",
                                            "--http",
                                            "off",
                                            "--log-level",
                                            "debug",
                                            "--max-grad-norm",
                                            "1.5",
                                            NULL}),
                     RNND_CONFIG_RUN);
    assert_int_equal(c.model.cell, RNND_CELL_LSTM);
    assert_int_equal(c.model.H, 32);
    assert_int_equal(c.model.L, 3);
    assert_int_equal(c.model.compute, RNND_COMPUTE_BF16);
    assert_true(c.lr == 0.5f);
    assert_true(c.seed == UINT64_MAX);
    assert_string_equal(c.listen, "[::1]:0");
    assert_string_equal(c.http, "off");
    assert_int_equal(c.log_level, RNND_LOG_DEBUG);
    assert_true(c.max_grad_norm == 1.5f);
}

static void expect_error(const char *const *args, const char *needle) {
    struct rnnd_config c;
    char err[512] = "";
    assert_int_equal(parse(&c, err, args), RNND_CONFIG_ERROR);
    if (strstr(err, needle) == NULL)
        fail_msg("error \"%s\" does not name \"%s\"", err, needle);
}

static void test_bad_flags_name_themselves(void **state) {
    (void)state;
    expect_error((const char *[]){"--hidden-size", "0", NULL}, "--hidden-size");
    expect_error((const char *[]){"--hidden-size", "12abc", NULL}, "--hidden-size");
    expect_error((const char *[]){"--layers", "9", NULL}, "--layers");
    expect_error((const char *[]){"--cell", "rnn", NULL}, "--cell");
    expect_error((const char *[]){"--lr", "nan", NULL}, "--lr");
    expect_error((const char *[]){"--lr", "0", NULL}, "--lr");
    expect_error((const char *[]){"--lr", "-1", NULL}, "--lr");
    expect_error((const char *[]){"--seed", "-3", NULL}, "--seed");
    expect_error((const char *[]){"--listen", "localhost", NULL}, "--listen");
    expect_error((const char *[]){"--listen", "h:99999", NULL}, "--listen");
    expect_error((const char *[]){"--http", ":80", NULL}, "--http");
    expect_error((const char *[]){"--no-such-flag", "1", NULL}, "no-such-flag");
    expect_error((const char *[]){"--max-batch", NULL}, "--max-batch");
    expect_error((const char *[]){"stray", NULL}, "stray");
    expect_error((const char *[]){"--tls-key", "/k.pem", NULL}, "--tls-key");
    expect_error((const char *[]){"--tls-client-ca", "/ca.pem", NULL}, "--tls-client-ca");
    expect_error((const char *[]){"--config", "/nonexistent/rnnd.conf", NULL},
                 "/nonexistent/rnnd.conf");
    // A batch that cannot fit into one message.
    expect_error((const char *[]){"--max-batch", "1000000", "--max-message-mb", "1", NULL},
                 "--max-message-mb");
    // A reply budget that cannot hold one reply.
    expect_error((const char *[]){"--max-reply-mb", "32", "--max-message-mb", "64", NULL},
                 "--max-reply-mb");
    expect_error((const char *[]){"--max-connections", "0", NULL}, "--max-connections");
    expect_error((const char *[]){"--max-health-watches", "0", NULL}, "--max-health-watches");
    expect_error((const char *[]){"--stream-idle-timeout-s", "-1", NULL},
                 "--stream-idle-timeout-s");
    // -1 is the automatic delay (test_ops' test_batching_defaults); below it, no delay at all.
    expect_error((const char *[]){"--max-delay-us", "-2", NULL}, "--max-delay-us");
}

// The policy flags fill model.policy; the model's own check refuses what no backend runs.
static void test_policy_flags(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    assert_int_equal(parse(&c, err, (const char *[]){NULL}), RNND_CONFIG_RUN);
    assert_false(rnnd_model_has_policy(&c.model));
    assert_int_equal(
        parse(&c, err,
              (const char *[]){"--encoder-widths", "64,32", "--encoder-activation", "relu",
                               "--discrete-actions", "6", "--value-head", "1", NULL}),
        RNND_CONFIG_RUN);
    assert_int_equal(c.model.policy.enc_layers, 2);
    assert_int_equal(c.model.policy.enc_width[0], 64);
    assert_int_equal(c.model.policy.enc_width[1], 32);
    assert_int_equal(c.model.policy.enc_act, RNND_ACT_RELU);
    assert_int_equal(c.model.policy.K, 6);
    assert_true(c.model.policy.value);
    // An empty list is no encoder, even after a file set one.
    assert_int_equal(
        parse(&c, err, (const char *[]){"--encoder-widths", "64", "--encoder-widths", "", NULL}),
        RNND_CONFIG_RUN);
    assert_int_equal(c.model.policy.enc_layers, 0);
    expect_error((const char *[]){"--encoder-widths", "64,", NULL}, "--encoder-widths");
    expect_error((const char *[]){"--encoder-widths", "8,8,8,8,8", NULL}, "more than 4");
    expect_error((const char *[]){"--encoder-activation", "gelu", NULL}, "--encoder-activation");
    expect_error((const char *[]){"--value-head", "yes", NULL}, "--value-head");
    expect_error((const char *[]){"--discrete-actions", "1", NULL}, "discrete actions 1");
    expect_error((const char *[]){"--discrete-actions", "2", "--gaussian-actions", "2", NULL},
                 "one action head");
}

static void test_help_and_version(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    assert_int_equal(parse(&c, err, (const char *[]){"--hidden-size", "bad", "--help", NULL}),
                     RNND_CONFIG_EXIT);
    assert_int_equal(parse(&c, err, (const char *[]){"--version", NULL}), RNND_CONFIG_EXIT);
    // Every flag of docs/design.md "Configuration" is in the usage text.
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    rnnd_config_usage(f);
    fclose(f);
    const char *flags[] = {"--config",
                           "--cell",
                           "--input-size",
                           "--hidden-size",
                           "--layers",
                           "--compute",
                           "--backend",
                           "--device",
                           "--listen",
                           "--http",
                           "--state-dir",
                           "--restore",
                           "--checkpoint-interval-s",
                           "--max-batch",
                           "--max-delay-us",
                           "--max-envs",
                           "--env-idle-timeout-s",
                           "--trajectory-steps",
                           "--extras-size",
                           "--tape-ttl-s",
                           "--tape-memory-mb",
                           "--optimizer",
                           "--lr",
                           "--max-grad-norm",
                           "--seed",
                           "--tls-cert",
                           "--tls-key",
                           "--tls-client-ca",
                           "--auth-token-file",
                           "--max-message-mb",
                           "--log-level",
                           "--listen-unix-mode",
                           "--max-shm-regions",
                           NULL};
    for (int i = 0; flags[i]; i++)
        if (strstr(text, flags[i]) == NULL)
            fail_msg("usage lacks %s", flags[i]);
    free(text);
}

static char *write_file(const char *body) {
    static char path[64];
    snprintf(path, sizeof(path), "/tmp/rnnd-test-conf-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_true(write(fd, body, strlen(body)) == (ssize_t)strlen(body));
    close(fd);
    return path;
}

static void test_config_file(void **state) {
    (void)state;
    char *path = write_file("# rnnd.conf\n"
                            "\n"
                            "  cell lstm\n"
                            "hidden-size 24   # trailing comment\n"
                            "input_size 5\n"
                            "max-batch 33\n"
                            "state-dir \"/tmp/with space\"\n"
                            "listen 127.0.0.1:7000\n");
    struct rnnd_config c;
    char err[512];
    // The file is read first; flags win.
    assert_int_equal(
        parse(&c, err, (const char *[]){"--listen", "127.0.0.1:0", "--config", path, NULL}),
        RNND_CONFIG_RUN);
    assert_int_equal(c.model.cell, RNND_CELL_LSTM);
    assert_int_equal(c.model.H, 24);
    assert_int_equal(c.model.I, 5);
    assert_int_equal(c.max_batch, 33);
    assert_string_equal(c.state_dir, "/tmp/with space");
    assert_string_equal(c.listen, "127.0.0.1:0");
    unlink(path);

    path = write_file("input-size 8\nhidden-size many\n");
    char err2[512];
    assert_int_equal(parse(&c, err2, (const char *[]){"--config", path, NULL}), RNND_CONFIG_ERROR);
    assert_non_null(strstr(err2, ":2:")); // file:line
    assert_non_null(strstr(err2, "hidden-size"));
    unlink(path);

    path = write_file("bogus-key 1\n");
    assert_int_equal(parse(&c, err2, (const char *[]){"--config", path, NULL}), RNND_CONFIG_ERROR);
    assert_non_null(strstr(err2, "bogus-key"));
    unlink(path);
}

static void test_set_spellings(void **state) {
    (void)state;
    struct rnnd_config c;
    rnnd_config_defaults(&c);
    char err[512];
    assert_int_equal(rnnd_config_set(&c, "max-envs", "10", err, sizeof(err)), 0);
    assert_int_equal(rnnd_config_set(&c, "env_idle_timeout_s", "0", err, sizeof(err)), 0);
    assert_int_equal(rnnd_config_set(&c, "--tape-ttl-s", "7", err, sizeof(err)), 0);
    assert_int_equal(c.max_envs, 10);
    assert_int_equal(c.env_idle_timeout_s, 0);
    assert_int_equal(c.tape_ttl_s, 7);
    assert_int_equal(rnnd_config_set(&c, "max-envs", "0", err, sizeof(err)), RNND_EINVAL);
    assert_int_equal(c.max_envs, 10); // a refused value changes nothing
}

static void test_weights_streams_and_exposure(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    assert_int_equal(parse(&c, err, (const char *[]){NULL}), RNND_CONFIG_RUN);
    assert_int_equal(c.max_streams, 1024);
    assert_int_equal(c.max_reply_mb, 1024);
    assert_int_equal(c.max_connections, 1024);
    assert_int_equal(c.max_health_watches, 256);
    assert_int_equal(c.stream_idle_timeout_s, 300);
    assert_string_equal(c.weights, "");
    assert_null(rnnd_config_exposure(&c)); // loopback by default
    assert_int_equal(
        parse(&c, err, (const char *[]){"--weights", "/w.safetensors", "--max-streams", "3", NULL}),
        RNND_CONFIG_RUN);
    assert_string_equal(c.weights, "/w.safetensors");
    assert_int_equal(c.max_streams, 3);
    assert_int_equal(parse(&c, err, (const char *[]){"--max-streams", "0", NULL}),
                     RNND_CONFIG_ERROR);
    assert_non_null(strstr(err, "--max-streams"));
    assert_int_equal(
        parse(&c, err, (const char *[]){"--weights", "/w", "--restore", "/ckpt", NULL}),
        RNND_CONFIG_ERROR);
    assert_non_null(strstr(err, "--weights"));

    // Local addresses never warn; others warn until both TLS and client authentication are on.
    const char *local[] = {"127.0.0.1:1", "127.9.9.9:1", "localhost:1", "[::1]:1", NULL};
    for (int i = 0; local[i]; i++) {
        assert_int_equal(parse(&c, err, (const char *[]){"--listen", local[i], NULL}),
                         RNND_CONFIG_RUN);
        if (rnnd_config_exposure(&c))
            fail_msg("%s warned: %s", local[i], rnnd_config_exposure(&c));
    }
    struct {
        const char *args[10];
        const char *says; // NULL: no warning
    } cases[] = {
        {{"--listen", "0.0.0.0:1", NULL}, "neither TLS nor a token"},
        {{"--listen", "[::]:1", NULL}, "neither TLS nor a token"},
        {{"--listen", "10.0.0.5:1", "--auth-token-file", "/t", NULL}, "without TLS"},
        {{"--listen", "0.0.0.0:1", "--tls-cert", "/c", "--tls-key", "/k", NULL},
         "no client authentication"},
        {{"--listen", "0.0.0.0:1", "--tls-cert", "/c", "--tls-key", "/k", "--auth-token-file",
          "/t"},
         NULL},
        {{"--listen", "0.0.0.0:1", "--tls-cert", "/c", "--tls-key", "/k", "--tls-client-ca", "/ca"},
         NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_int_equal(parse(&c, err, cases[i].args), RNND_CONFIG_RUN);
        const char *w = rnnd_config_exposure(&c);
        if (cases[i].says ? (w == NULL || !strstr(w, cases[i].says)) : w != NULL)
            fail_msg("case %zu: \"%s\"", i, w ? w : "(no warning)");
    }
}

static void test_listen_list(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512];
    char addrs[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX];
    assert_int_equal(parse(&c, err, (const char *[]){NULL}), RNND_CONFIG_RUN);
    assert_int_equal(c.listen_unix_mode, 0600);
    assert_int_equal(c.max_shm_regions, 64);
    assert_int_equal(rnnd_config_listen(c.listen, addrs), 1);
    assert_string_equal(addrs[0], "127.0.0.1:50051");

    // Comma-separated, and a repeated flag adds to the list (the first replaces the default).
    assert_int_equal(parse(&c, err,
                           (const char *[]){"--listen", "0.0.0.0:1,unix:/run/rnnd.sock", "--listen",
                                            "unix:/tmp/b.sock", "--listen-unix-mode", "0660",
                                            "--max-shm-regions", "0", NULL}),
                     RNND_CONFIG_RUN);
    assert_int_equal(rnnd_config_listen(c.listen, addrs), 3);
    assert_string_equal(addrs[0], "0.0.0.0:1");
    assert_string_equal(addrs[1], "unix:/run/rnnd.sock");
    assert_string_equal(addrs[2], "unix:/tmp/b.sock");
    assert_int_equal(c.listen_unix_mode, 0660);
    assert_int_equal(c.max_shm_regions, 0);

    // A config file's list is replaced by the flags, as any key.
    char path[] = "/tmp/rnnd-test-conf-XXXXXX";
    int fd = mkstemp(path);
    const char *body = "listen unix:/tmp/a.sock,127.0.0.1:7\nlisten-unix-mode 600\n";
    assert_true(write(fd, body, strlen(body)) == (ssize_t)strlen(body));
    close(fd);
    assert_int_equal(parse(&c, err, (const char *[]){"--config", path, NULL}), RNND_CONFIG_RUN);
    assert_int_equal(rnnd_config_listen(c.listen, addrs), 2);
    assert_string_equal(addrs[0], "unix:/tmp/a.sock");
    assert_int_equal(
        parse(&c, err, (const char *[]){"--config", path, "--listen", "[::1]:0", NULL}),
        RNND_CONFIG_RUN);
    assert_string_equal(c.listen, "[::1]:0");
    unlink(path);

    // Unix sockets alone never warn; one open TCP address among them does.
    assert_int_equal(parse(&c, err, (const char *[]){"--listen", "unix:/run/r.sock", NULL}),
                     RNND_CONFIG_RUN);
    assert_null(rnnd_config_exposure(&c));
    assert_int_equal(
        parse(&c, err, (const char *[]){"--listen", "unix:/run/r.sock,0.0.0.0:1", NULL}),
        RNND_CONFIG_RUN);
    assert_non_null(rnnd_config_exposure(&c));

    struct {
        const char *args[6];
        const char *says;
    } bad[] = {
        {{"--listen", "unix:relative.sock"}, "absolute path"},
        {{"--listen", "127.0.0.1:1,,unix:/a"}, "empty address"},
        {{"--listen", "127.0.0.1:1,"}, "empty address"},
        {{"--listen", "unix:/a,localhost"}, "'localhost' is neither"},
        {{"--listen", "unix:/a", "--listen", "unix:/a"}, "twice"},
        {{"--listen", "1:1,2:2,3:3,4:4,5:5,6:6,7:7,8:8,9:9"}, "more than 8"},
        {{"--listen-unix-mode", "0999"}, "octal"},
        {{"--listen-unix-mode", "1777"}, "octal"},
        {{"--max-shm-regions", "-1"}, "--max-shm-regions"},
    };
    char long_path[200] = "unix:/";
    memset(long_path + 6, 'p', 110);
    assert_int_equal(parse(&c, err, (const char *[]){"--listen", long_path, NULL}),
                     RNND_CONFIG_ERROR);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(parse(&c, err, bad[i].args), RNND_CONFIG_ERROR);
        if (strstr(err, bad[i].says) == NULL)
            fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err, bad[i].says);
    }
}

// --data-listen: "auto" follows the first TCP --listen host other hosts reach (port 0), else
// the first TCP one, and is off without one, with TLS or without shared memory; an address is taken as given, but not with TLS (data connections are plaintext).
static void test_data_listen(void **state) {
    (void)state;
    struct rnnd_config c;
    char err[512], addr[RNND_CONFIG_ADDR_MAX];
    assert_int_equal(parse(&c, err, (const char *[]){NULL}), RNND_CONFIG_RUN);
    assert_string_equal(c.data_listen, "auto");
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "127.0.0.1:0");
    assert_int_equal(parse(&c, err, (const char *[]){"--listen", "unix:/a.sock,[::1]:5", NULL}),
                     RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "[::1]:0");
    assert_int_equal(parse(&c, err, (const char *[]){"--listen", "127.0.0.1:1,0.0.0.0:2", NULL}),
                     RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "0.0.0.0:0");
    assert_int_equal(parse(&c, err, (const char *[]){"--listen", "unix:/a.sock", NULL}),
                     RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "");
    assert_int_equal(parse(&c, err, (const char *[]){"--data-listen", "off", NULL}),
                     RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "");
    assert_int_equal(parse(&c, err, (const char *[]){"--data-listen", "0.0.0.0:7000", NULL}),
                     RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "0.0.0.0:7000");
    assert_int_equal(
        parse(&c, err, (const char *[]){"--tls-cert", "c.pem", "--tls-key", "k.pem", NULL}),
        RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "");
    assert_int_equal(parse(&c, err,
                           (const char *[]){"--tls-cert", "c.pem", "--tls-key", "k.pem",
                                            "--data-listen", "127.0.0.1:7000", NULL}),
                     RNND_CONFIG_ERROR);
    assert_non_null(strstr(err, "plaintext"));
    assert_int_equal(parse(&c, err, (const char *[]){"--max-shm-regions", "0", NULL}),
                     RNND_CONFIG_RUN);
    rnnd_config_data_listen(&c, addr);
    assert_string_equal(addr, "");
    assert_int_equal(
        parse(&c, err,
              (const char *[]){"--max-shm-regions", "0", "--data-listen", "127.0.0.1:7000", NULL}),
        RNND_CONFIG_ERROR);
    assert_non_null(strstr(err, "--max-shm-regions"));
    assert_int_equal(parse(&c, err, (const char *[]){"--data-listen", "nowhere", NULL}),
                     RNND_CONFIG_ERROR);
    assert_non_null(strstr(err, "--data-listen"));
    assert_int_equal(parse(&c, err, (const char *[]){"--rendezvous", "off", NULL}),
                     RNND_CONFIG_ERROR);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_max_batch_auto),
        cmocka_unit_test(test_flags),
        cmocka_unit_test(test_bad_flags_name_themselves),
        cmocka_unit_test(test_policy_flags),
        cmocka_unit_test(test_help_and_version),
        cmocka_unit_test(test_config_file),
        cmocka_unit_test(test_set_spellings),
        cmocka_unit_test(test_weights_streams_and_exposure),
        cmocka_unit_test(test_listen_list),
        cmocka_unit_test(test_data_listen),
    };
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
