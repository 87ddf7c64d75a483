/*
 * test_tls.c: TLS and mutual TLS on the gRPC port, with a throwaway CA made by the openssl CLI
 * (the test skips when there is no openssl). The daemon with --tls-cert/--tls-key serves clients
 * that trust the CA, and refuses plaintext clients and clients trusting another CA; with
 * --tls-client-ca it also wants a client certificate signed by that CA. rnndctl --tls-ca works.
 * A key file that its group or others can read is warned about at start.
 */
#include "harness.h"

#include <grpc/status.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static int sh(const char *cmd) {
    const char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    char *out;
    int rc = run_capture(argv, 30000, &out);
    if (rc != 0)
        fprintf(stderr, "$ %s\n%s(exit %d)\n", cmd, out, rc);
    free(out);
    return rc;
}

static char *slurp_file(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *buf = read_file(path, NULL);
    assert_non_null(buf);
    return buf;
}

// A CA, a second unrelated CA, a server certificate for 127.0.0.1/localhost and a client
// certificate, all EC P-256, valid for a day.
static int setup(void **state) {
    (void)state;
    if (access("/usr/bin/openssl", X_OK) != 0 && sh("command -v openssl >/dev/null") != 0)
        return 0; // tests skip
    snprintf(dir, sizeof dir, "/tmp/rnnd-tls-XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "set -e; cd %s; K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes';"
             "openssl req -x509 $K -keyout ca.key -out ca.pem -days 1 -subj /CN=rnnd-test-ca;"
             "openssl req -x509 $K -keyout other.key -out other.pem -days 1 -subj /CN=other-ca;"
             "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext;"
             "openssl req $K -keyout server.key -out server.csr -subj /CN=localhost;"
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "  -out server.pem -days 1 -extfile san.ext;"
             "openssl req $K -keyout client.key -out client.csr -subj /CN=rnnd-test-client;"
             "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "  -out client.pem -days 1",
             dir);
    return sh(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    if (dir[0]) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        sh(cmd);
    }
    return 0;
}

static int connect_info(const struct daemon *d, const char *root, const char *cert,
                        const char *key) {
    struct rnnd_client_opts o = {.target = d->grpc,
                                 .tls_root_pem = root,
                                 .tls_cert_pem = cert,
                                 .tls_key_pem = key,
                                 .timeout_ms = 5000};
    struct rnnd_client *c;
    int err = rnnd_client_init(&o, &c);
    if (err)
        return err;
    struct rnnd_model_info info;
    err = rnnd_client_info(c, &info);
    int st = rnnd_client_last_error()->grpc_status;
    char msg[1100];
    snprintf(msg, sizeof msg, "%s", rnnd_client_last_error()->message);
    rnnd_client_free(c);
    // Keep the call's error visible to the caller after free.
    if (err && getenv("RNND_TEST_VERBOSE"))
        fprintf(stderr, "  %s: %s\n", rnnd_grpc_status_name(st), msg);
    return err;
}

static void test_tls(void **state) {
    (void)state;
    if (!dir[0])
        skip();
    char cert[256], key[256];
    snprintf(cert, sizeof cert, "%s/server.pem", dir);
    snprintf(key, sizeof key, "%s/server.key", dir);
    struct daemon d;
    const char *args[] = {
        "--input-size", "4", "--hidden-size", "8", "--tls-cert", cert, "--tls-key", key, NULL};
    assert_int_equal(chmod(key, 0640), 0);
    assert_int_equal(daemon_start(&d, args), 0);
    if (!daemon_log_contains(&d, "--tls-key") || !daemon_log_contains(&d, "chmod 600")) {
        daemon_dump_log(&d, 2000);
        fail_msg("a key file its group can read should be warned about");
    }
    char *ca = slurp_file("ca.pem"), *other = slurp_file("other.pem");
    EXPECT_OK(connect_info(&d, ca, NULL, NULL));
    assert_int_equal(connect_info(&d, NULL, NULL, NULL), RNND_EUNAVAIL);  // plaintext
    assert_int_equal(connect_info(&d, other, NULL, NULL), RNND_EUNAVAIL); // wrong CA
    // rnndctl with --tls-ca.
    char capath[256];
    snprintf(capath, sizeof capath, "%s/ca.pem", dir);
    const char *argv[] = {rnndctl_bin(), "-t", d.grpc, "--tls-ca", capath, "health", NULL};
    char *out;
    int rc = run_capture(argv, 10000, &out);
    if (rc != 0 || !strstr(out, "SERVING"))
        fprintf(stderr, "rnndctl over TLS: exit %d\n%s\n", rc, out);
    assert_int_equal(rc, 0);
    free(out);
    free(ca);
    free(other);
    daemon_free(&d);
}

static void test_mutual_tls(void **state) {
    (void)state;
    if (!dir[0])
        skip();
    char cert[256], key[256], ca[256];
    snprintf(cert, sizeof cert, "%s/server.pem", dir);
    snprintf(key, sizeof key, "%s/server.key", dir);
    snprintf(ca, sizeof ca, "%s/ca.pem", dir);
    struct daemon d;
    const char *args[] = {"--input-size", "4", "--hidden-size",   "8", "--tls-cert", cert,
                          "--tls-key",    key, "--tls-client-ca", ca,  NULL};
    assert_int_equal(chmod(key, 0600), 0);
    assert_int_equal(daemon_start(&d, args), 0);
    assert_false(daemon_log_contains(&d, "chmod 600")); // a private key is not warned about
    char *root = slurp_file("ca.pem"), *ccert = slurp_file("client.pem");
    char *ckey = slurp_file("client.key"), *okey = slurp_file("other.key");
    char *ocert = slurp_file("other.pem");
    EXPECT_OK(connect_info(&d, root, ccert, ckey));
    assert_true(connect_info(&d, root, NULL, NULL) != 0);  // no client certificate
    assert_true(connect_info(&d, root, ocert, okey) != 0); // one the CA did not sign
    free(root);
    free(ccert);
    free(ckey);
    free(okey);
    free(ocert);
    daemon_free(&d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tls),
        cmocka_unit_test(test_mutual_tls),
    };
    return cmocka_run_group_tests_name("tls", tests, setup, teardown) ? 1 : 0;
}
