/*
 * test_status.c: the one mapping from rnnd error codes to gRPC status codes (server/rpc.c,
 * docs/design.md): bad input INVALID_ARGUMENT, missing state FAILED_PRECONDITION, unknown tape
 * NOT_FOUND, full queues and budgets RESOURCE_EXHAUSTED, draining UNAVAILABLE, tokens
 * UNAUTHENTICATED; internal failures never masquerade as a client's mistake.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <grpc/status.h>

#include "rnnd_kernels.h"
#include "rpc.h"

static void test_mapping(void **state) {
    (void)state;
    assert_int_equal(rnnd_rpc_status(0), GRPC_STATUS_OK);
    assert_int_equal(rnnd_rpc_status(RNND_EINVAL), GRPC_STATUS_INVALID_ARGUMENT);
    assert_int_equal(rnnd_rpc_status(RNND_EPRECOND), GRPC_STATUS_FAILED_PRECONDITION);
    assert_int_equal(rnnd_rpc_status(RNND_ENOTFOUND), GRPC_STATUS_NOT_FOUND);
    assert_int_equal(rnnd_rpc_status(RNND_EFULL), GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_int_equal(rnnd_rpc_status(RNND_ENOMEM), GRPC_STATUS_RESOURCE_EXHAUSTED);
    assert_int_equal(rnnd_rpc_status(RNND_EUNAVAIL), GRPC_STATUS_UNAVAILABLE);
    assert_int_equal(rnnd_rpc_status(RNND_EAUTH), GRPC_STATUS_UNAUTHENTICATED);
    assert_int_equal(rnnd_rpc_status(RNND_ECANCELED), GRPC_STATUS_CANCELLED);
    assert_int_equal(rnnd_rpc_status(RNND_ENOTSUP), GRPC_STATUS_UNIMPLEMENTED);
    assert_int_equal(rnnd_rpc_status(RNND_ECORRUPT), GRPC_STATUS_DATA_LOSS);
    assert_int_equal(rnnd_rpc_status(RNND_EDEVICE), GRPC_STATUS_INTERNAL);
    assert_int_equal(rnnd_rpc_status(RNND_EIO), GRPC_STATUS_INTERNAL);
    assert_int_equal(rnnd_rpc_status(-12345), GRPC_STATUS_INTERNAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mapping),
    };
    return cmocka_run_group_tests_name("status", tests, NULL, NULL);
}
