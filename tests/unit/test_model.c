/*
 * test_model.c: the parameter layout shared by every backend (PyTorch's names, shapes and flat
 * order), weight initialisation, the argument checks and the error strings.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "rnnd_kernels.h"

// nn.LSTM(5, 7, num_layers=2): the names, shapes and order of _flat_weights.
static void test_lstm_layout_matches_pytorch(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_LSTM, .I = 5, .H = 7, .L = 2};
    static const struct {
        const char *name;
        int ndim;
        int64_t rows, cols;
    } want[] = {
        {"weight_ih_l0", 2, 28, 5}, {"weight_hh_l0", 2, 28, 7}, {"bias_ih_l0", 1, 28, 0},
        {"bias_hh_l0", 1, 28, 0},   {"weight_ih_l1", 2, 28, 7}, {"weight_hh_l1", 2, 28, 7},
        {"bias_ih_l1", 1, 28, 0},   {"bias_hh_l1", 1, 28, 0},
    };
    assert_int_equal(rnnd_model_param_tensors(&m), 8);
    size_t offset = 0;
    for (int k = 0; k < 8; k++) {
        struct rnnd_param_tensor t;
        rnnd_model_param_tensor(&m, k, &t);
        assert_string_equal(t.name, want[k].name);
        assert_int_equal(t.ndim, want[k].ndim);
        assert_int_equal(t.shape[0], want[k].rows);
        if (t.ndim == 2)
            assert_int_equal(t.shape[1], want[k].cols);
        assert_int_equal(t.offset, offset); // tensors tile the flat array in order
        offset += t.count;
        assert_int_equal(rnnd_model_param_find(&m, want[k].name), k);
    }
    assert_int_equal(offset, rnnd_model_param_count(&m));
    // 4*7*(5+7+2) + 4*7*(7+7+2)
    assert_int_equal(rnnd_model_param_count(&m), 28 * 14 + 28 * 16);
    assert_int_equal(rnnd_model_param_find(&m, "weight_ih_l2"), RNND_ENOTFOUND);
}

static void test_init_is_seeded_and_bounded(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_GRU, .I = 3, .H = 16, .L = 1};
    size_t P = rnnd_model_param_count(&m);
    float *a = malloc(P * sizeof(float)), *b = malloc(P * sizeof(float));
    rnnd_model_init_params(&m, 1, a);
    rnnd_model_init_params(&m, 1, b);
    assert_memory_equal(a, b, P * sizeof(float));
    double mean = 0;
    for (size_t i = 0; i < P; i++) {
        assert_true(fabsf(a[i]) <= 0.25f); // 1/sqrt(16)
        mean += a[i];
    }
    assert_true(fabs(mean / (double)P) < 0.05);
    rnnd_model_init_params(&m, 2, b);
    assert_memory_not_equal(a, b, P * sizeof(float));
    free(a);
    free(b);
}

static void test_checks(void **state) {
    (void)state;
    struct rnnd_model m = {.cell = RNND_CELL_LSTM, .I = 4, .H = 4, .L = 1};
    assert_int_equal(rnnd_model_check(&m), 0);
    struct rnnd_model bad = m;
    bad.L = 0;
    assert_int_equal(rnnd_model_check(&bad), RNND_EINVAL);
    bad = m;
    bad.H = RNND_MAX_WIDTH + 1;
    assert_int_equal(rnnd_model_check(&bad), RNND_EINVAL);
    bad = m;
    bad.cell = (enum rnnd_cell)7;
    assert_int_equal(rnnd_model_check(&bad), RNND_EINVAL);

    float x[4], h[4], c[4];
    uint8_t init[1] = {0};
    struct rnnd_seq s = {.B = 1, .T = 1, .x = x, .is_init = init, .h0 = h, .c0 = c};
    assert_int_equal(rnnd_seq_check(&s, &m), 0);
    s.c0 = NULL; // LSTM h0 without c0
    assert_int_equal(rnnd_seq_check(&s, &m), RNND_EINVAL);
    s.c0 = c;
    s.hidden = h; // h0 and stored states together
    s.cell = c;
    assert_int_equal(rnnd_seq_check(&s, &m), RNND_EINVAL);
    s.hidden = s.cell = NULL;
    s.T = 0;
    assert_int_equal(rnnd_seq_check(&s, &m), RNND_EINVAL);

    struct rnnd_optim o = {
        .kind = RNND_OPTIM_ADAM, .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    assert_int_equal(rnnd_optim_check(&o), 0);
    o.lr = NAN;
    assert_int_equal(rnnd_optim_check(&o), RNND_EINVAL);
    o.lr = 1e-3f;
    o.beta2 = 1.0f;
    assert_int_equal(rnnd_optim_check(&o), RNND_EINVAL);
}

static void test_error_strings(void **state) {
    (void)state;
    assert_string_equal(rnnd_err_name(RNND_EINVAL), "EINVAL");
    assert_string_equal(rnnd_strerror(RNND_EFULL), "resource exhausted");
    assert_string_equal(rnnd_err_name(0), "OK");
    assert_string_equal(rnnd_err_name(-1000), "EUNKNOWN");
}

static void test_round_bf16(void **state) {
    (void)state;
    assert_true(rnnd_round_bf16(1.0f) == 1.0f);
    // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0).
    assert_true(rnnd_round_bf16(1.0f + 0x1p-8f) == 1.0f);
    assert_true(rnnd_round_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
    assert_true(isinf(rnnd_round_bf16(INFINITY)));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lstm_layout_matches_pytorch),
        cmocka_unit_test(test_init_is_seeded_and_bounded),
        cmocka_unit_test(test_checks),
        cmocka_unit_test(test_error_strings),
        cmocka_unit_test(test_round_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
