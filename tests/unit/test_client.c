/*
 * test_client.c: the client library without a daemon: tensor helpers, the flat-parameter
 * conversions, option checks, and how a failed call reports itself (code, gRPC status, message)
 * when nothing listens. The integration tests cover the library against the real daemon.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <unistd.h>

#include "rnnd_client.h"
#include "loopback_port.h"

static void test_tensor_helpers(void **state) {
    (void)state;
    assert_int_equal(rnnd_dtype_size(RNND_DTYPE_FLOAT32), 4);
    assert_int_equal(rnnd_dtype_size(RNND_DTYPE_BFLOAT16), 2);
    assert_int_equal(rnnd_dtype_size(RNND_DTYPE_BOOL), 1);
    assert_int_equal(rnnd_dtype_size(RNND_DTYPE_INT64), 8);
    assert_int_equal(rnnd_dtype_size(RNND_DTYPE_UNSPECIFIED), 0);
    assert_string_equal(rnnd_dtype_name(RNND_DTYPE_BOOL), "bool");
    float x[24];
    struct rnnd_tensor t = rnnd_tensor_f32(x, 3, 2, 3, 4, 0);
    assert_true(t.present);
    assert_int_equal(t.ndim, 3);
    assert_int_equal(rnnd_tensor_numel(&t), 24);
    assert_int_equal(t.nbytes, 96);
    assert_ptr_equal(t.data, x);
    uint8_t b[6];
    t = rnnd_tensor_view(RNND_DTYPE_BOOL, b, 2, (int64_t[]){2, 3});
    assert_int_equal(t.nbytes, 6);
    // Negative dims give no bytes (the tests send such tensors on purpose).
    t = rnnd_tensor_f32(x, 2, -2, 3, 0, 0);
    assert_int_equal(t.nbytes, 0);
    struct rnnd_tensor z = {0};
    rnnd_tensor_free(&z);
    rnnd_tensor_free(NULL);
    rnnd_named_tensors_free(NULL);
}

static void test_grpc_status_names(void **state) {
    (void)state;
    assert_string_equal(rnnd_grpc_status_name(0), "OK");
    assert_string_equal(rnnd_grpc_status_name(3), "INVALID_ARGUMENT");
    assert_string_equal(rnnd_grpc_status_name(9), "FAILED_PRECONDITION");
    assert_string_equal(rnnd_grpc_status_name(16), "UNAUTHENTICATED");
    assert_string_equal(rnnd_grpc_status_name(17), "UNKNOWN_STATUS");
    assert_string_equal(rnnd_grpc_status_name(-1), "UNKNOWN_STATUS");
}

static void test_params_roundtrip(void **state) {
    (void)state;
    struct rnnd_model m = {
        .cell = RNND_CELL_LSTM, .compute = RNND_COMPUTE_FP32, .I = 3, .H = 5, .L = 2};
    size_t P = rnnd_model_param_count(&m);
    float *p = malloc(P * sizeof(float)), *q = malloc(P * sizeof(float));
    for (size_t k = 0; k < P; k++)
        p[k] = (float)k * 0.5f;
    struct rnnd_named_tensors l;
    assert_int_equal(rnnd_named_tensors_from_params(&l, &m, p), 0);
    assert_int_equal(l.n, 8);
    const struct rnnd_tensor *t = rnnd_named_tensors_find(&l, "weight_ih_l1");
    assert_non_null(t);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 4 * 5);
    assert_int_equal(t->shape[1], 5);
    assert_null(rnnd_named_tensors_find(&l, "weight_ih_l2"));
    assert_int_equal(rnnd_named_tensors_to_params(&l, &m, q), 0);
    assert_memory_equal(p, q, P * sizeof(float));
    // A wrong shape is refused with a message naming the tensor.
    l.v[1].tensor.shape[1] += 1;
    assert_int_equal(rnnd_named_tensors_to_params(&l, &m, q), RNND_EINVAL);
    assert_non_null(strstr(rnnd_client_last_error()->message, l.v[1].name));
    l.v[1].tensor.shape[1] -= 1;
    l.v[2].tensor.dtype = RNND_DTYPE_BFLOAT16;
    assert_int_equal(rnnd_named_tensors_to_params(&l, &m, q), RNND_EINVAL);
    rnnd_named_tensors_free(&l);
    assert_int_equal(l.n, 0);
    free(p);
    free(q);
}

static void test_info_to_model(void **state) {
    (void)state;
    struct rnnd_model_info i = {
        .cell = "lstm", .compute = "bf16", .input_size = 4, .hidden_size = 8, .num_layers = 3};
    struct rnnd_model m;
    assert_int_equal(rnnd_model_info_to_model(&i, &m), 0);
    assert_int_equal(m.cell, RNND_CELL_LSTM);
    assert_int_equal(m.compute, RNND_COMPUTE_BF16);
    assert_int_equal(m.L, 3);
    strcpy(i.cell, "rnn");
    assert_int_equal(rnnd_model_info_to_model(&i, &m), RNND_EINVAL);
}

static void test_init_checks(void **state) {
    (void)state;
    struct rnnd_client *c = (void *)1;
    struct rnnd_client_opts o = {0};
    assert_int_equal(rnnd_client_init(&o, &c), RNND_EINVAL);
    assert_null(c);
    assert_int_equal(rnnd_client_last_error()->code, RNND_EINVAL);
    assert_int_equal(rnnd_client_last_error()->grpc_status, -1);
    o.target = "127.0.0.1:1";
    o.tls_cert_pem = "x"; // a certificate without its key
    assert_int_equal(rnnd_client_init(&o, &c), RNND_EINVAL);
    rnnd_client_free(NULL);
}

static void test_unreachable(void **state) {
    (void)state;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", loopback_free_port());
    struct rnnd_client_opts o = {.target = target, .timeout_ms = 3000};
    struct rnnd_client *c;
    assert_int_equal(rnnd_client_init(&o, &c), 0);
    struct rnnd_model_info info;
    assert_int_equal(rnnd_client_info(c, &info), RNND_EUNAVAIL);
    assert_int_equal(rnnd_client_last_error()->grpc_status, 14);
    assert_true(strlen(rnnd_client_last_error()->message) > 0);
    assert_int_equal(rnnd_client_wait_connected(c, 100), RNND_EUNAVAIL);
    float x[4] = {0};
    uint64_t id = 1;
    struct rnnd_step_req req = {
        .n_env_ids = 1, .env_ids = &id, .obs = rnnd_tensor_f32(x, 2, 1, 4, 0, 0)};
    struct rnnd_step_reply r;
    assert_int_equal(rnnd_client_step(c, &req, &r), RNND_EUNAVAIL);
    assert_false(r.output.present);
    struct rnnd_client_stream *s = NULL;
    int err = rnnd_client_stream_init(c, &s);
    if (err == 0) {
        err = rnnd_client_stream_step(s, &req, &r);
        rnnd_client_stream_free(s);
    }
    assert_int_equal(err, RNND_EUNAVAIL);
    rnnd_client_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tensor_helpers),   cmocka_unit_test(test_grpc_status_names),
        cmocka_unit_test(test_params_roundtrip), cmocka_unit_test(test_info_to_model),
        cmocka_unit_test(test_init_checks),      cmocka_unit_test(test_unreachable),
    };
    return cmocka_run_group_tests_name("client", tests, NULL, NULL);
}
