/*
 * test_safetensors.c: the in-memory safetensors codec. Round trips, a file laid out the way the
 * reference Python library writes it, and refusal of damaged files without crashing (every
 * truncation and single-byte corruption of a valid file).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "rnnd_safetensors.h"

static const struct rnnd_model gru2 = {.cell = RNND_CELL_GRU, .I = 5, .H = 7, .L = 2};

static void *encode_model(const struct rnnd_model *m, float *params, size_t *len) {
    rnnd_model_init_params(m, 42, params);
    const char *meta[] = {"format", "pt", "note", "quote \" and \\ and \n"};
    void *buf = NULL;
    assert_int_equal(rnnd_st_encode_params(m, params, meta, 2, &buf, len), 0);
    return buf;
}

static void test_params_round_trip(void **state) {
    (void)state;
    size_t P = rnnd_model_param_count(&gru2), len;
    float *params = malloc(P * sizeof(float)), *back = calloc(P, sizeof(float));
    void *buf = encode_model(&gru2, params, &len);

    // The data must start 8-byte aligned, as the reference writer pads the header.
    uint64_t hlen;
    memcpy(&hlen, buf, 8);
    assert_int_equal(hlen % 8, 0);

    struct rnnd_st_file f;
    char err[256];
    assert_int_equal(rnnd_st_decode(buf, len, &f, err, sizeof(err)), 0);
    assert_int_equal(f.n, 8);
    assert_string_equal(rnnd_st_meta(&f, "format"), "pt");
    assert_string_equal(rnnd_st_meta(&f, "note"), "quote \" and \\ and \n");
    const struct rnnd_st_tensor *w = rnnd_st_find(&f, "weight_ih_l1");
    assert_non_null(w);
    assert_int_equal(w->ndim, 2);
    assert_int_equal(w->shape[0], 21);
    assert_int_equal(w->shape[1], 7);
    assert_int_equal(rnnd_st_decode_params(&gru2, &f, back, err, sizeof(err)), 0);
    assert_memory_equal(params, back, P * sizeof(float));
    rnnd_st_file_free(&f);
    free(buf);
    free(params);
    free(back);
}

// A file as safetensors' Python writer lays it out (metadata first, tensors sorted, spaces to
// pad), written out by hand: rnnd must read what PyTorch users save.
static void test_reads_reference_layout(void **state) {
    (void)state;
    const char json[] = "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":"
                        "[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"I64\",\"shape\":[1,1],"
                        "\"data_offsets\":[8,16]}}";
    size_t hlen = (sizeof(json) - 1 + 7) / 8 * 8;
    unsigned char buf[8 + 256 + 16];
    memset(buf, ' ', sizeof(buf));
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(buf + 8, json, sizeof(json) - 1);
    float a[2] = {1.5f, -2.0f};
    int64_t b = -7;
    memcpy(buf + 8 + hlen, a, 8);
    memcpy(buf + 8 + hlen + 8, &b, 8);

    struct rnnd_st_file f;
    char err[256];
    assert_int_equal(rnnd_st_decode(buf, 8 + hlen + 16, &f, err, sizeof(err)), 0);
    assert_int_equal(f.n, 2);
    const struct rnnd_st_tensor *ta = rnnd_st_find(&f, "a"), *tb = rnnd_st_find(&f, "b");
    assert_int_equal(ta->dtype, RNND_ST_F32);
    assert_memory_equal(ta->data, a, 8);
    assert_int_equal(tb->dtype, RNND_ST_I64);
    assert_int_equal(tb->ndim, 2);
    assert_memory_equal(tb->data, &b, 8);
    rnnd_st_file_free(&f);

    // One data byte short: the tensors no longer fit.
    assert_int_equal(rnnd_st_decode(buf, 8 + hlen + 15, &f, err, sizeof(err)), RNND_ECORRUPT);
    assert_non_null(strstr(err, "\"b\""));
}

static void test_refuses_damage(void **state) {
    (void)state;
    size_t P = rnnd_model_param_count(&gru2), len;
    float *params = malloc(P * sizeof(float));
    unsigned char *buf = encode_model(&gru2, params, &len);
    unsigned char *copy = malloc(len);
    struct rnnd_st_file f;
    char err[256];

    // Every truncation is refused, never read past its end (ASan builds check the latter).
    for (size_t n = 0; n < len; n++) {
        unsigned char *t = malloc(n ? n : 1);
        memcpy(t, buf, n);
        assert_int_equal(rnnd_st_decode(t, n, &f, err, sizeof(err)), RNND_ECORRUPT);
        assert_true(err[0] != '\0');
        free(t);
    }
    // Any byte of the header changed to a random value: decoded or refused, never a crash; a
    // file that still decodes must still describe data inside the buffer.
    uint64_t hlen;
    memcpy(&hlen, buf, 8);
    srand(7);
    for (size_t i = 0; i < 8 + hlen; i++) {
        memcpy(copy, buf, len);
        copy[i] = (unsigned char)(rand() & 0xff);
        if (rnnd_st_decode(copy, len, &f, err, sizeof(err)) == 0) {
            for (int k = 0; k < f.n; k++)
                assert_true((const unsigned char *)f.tensors[k].data + f.tensors[k].bytes <=
                            copy + len);
            rnnd_st_file_free(&f);
        }
    }
    free(copy);
    free(buf);
    free(params);
}

static void decode_json(const char *json, int want, const char *err_part) {
    size_t n = strlen(json);
    unsigned char *buf = malloc(8 + n + 8);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(buf + 8, json, n);
    memset(buf + 8 + n, 0, 8);
    struct rnnd_st_file f;
    char err[256];
    int rc = rnnd_st_decode(buf, 8 + n + 8, &f, err, sizeof(err));
    if (rc == 0)
        rnnd_st_file_free(&f);
    assert_int_equal(rc, want);
    if (err_part)
        assert_non_null(strstr(err, err_part));
    free(buf);
}

static void test_refuses_bad_headers(void **state) {
    (void)state;
    // Valid: one 8-byte tensor covering the data.
    decode_json("{\"x\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]}}", 0, NULL);
    decode_json("{\"x\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}}", RNND_ENOTSUP,
                "F16");
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", RNND_ECORRUPT,
                "\"x\"");
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", RNND_ECORRUPT,
                "cover"); // 4 data bytes left over
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                RNND_ECORRUPT, "overlap");
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]}}",
                RNND_ECORRUPT, "twice");
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[2]}}", RNND_ECORRUPT, "data_offsets");
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} trailing",
                RNND_ECORRUPT, "trailing");
    decode_json("[1,2]", RNND_ECORRUPT, "expected '{'");
    decode_json("{\"x\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],"
                "\"data_offsets\":[0,8]}}",
                RNND_ECORRUPT, "range");
}

static void test_decode_params_checks_before_copying(void **state) {
    (void)state;
    struct rnnd_model gru1 = gru2;
    gru1.L = 1;
    size_t P1 = rnnd_model_param_count(&gru1), P2 = rnnd_model_param_count(&gru2), len;
    float *p2 = malloc(P2 * sizeof(float)), *p1 = malloc(P1 * sizeof(float));
    void *buf = encode_model(&gru2, p2, &len);
    struct rnnd_st_file f;
    char err[256];
    assert_int_equal(rnnd_st_decode(buf, len, &f, err, sizeof(err)), 0);

    // A 2-layer file into a 1-layer model: refused, naming the extra tensor, params untouched.
    for (size_t i = 0; i < P1; i++)
        p1[i] = 123.0f;
    assert_int_equal(rnnd_st_decode_params(&gru1, &f, p1, err, sizeof(err)), RNND_EINVAL);
    assert_non_null(strstr(err, "_l1"));
    for (size_t i = 0; i < P1; i++)
        assert_true(p1[i] == 123.0f);

    // Into a model with another hidden width: refused with the expected shape.
    struct rnnd_model wide = gru2;
    wide.H = 8;
    float *pw = malloc(rnnd_model_param_count(&wide) * sizeof(float));
    assert_int_equal(rnnd_st_decode_params(&wide, &f, pw, err, sizeof(err)), RNND_EINVAL);
    assert_non_null(strstr(err, "expected F32 [24, 5]"));
    rnnd_st_file_free(&f);

    // A missing tensor.
    struct rnnd_st_tensor one = {.name = "weight_ih_l0",
                                 .dtype = RNND_ST_F32,
                                 .ndim = 2,
                                 .shape = {21, 5},
                                 .data = p2,
                                 .bytes = 21 * 5 * 4};
    void *b1;
    size_t l1;
    assert_int_equal(rnnd_st_encode(&one, 1, NULL, 0, &b1, &l1), 0);
    assert_int_equal(rnnd_st_decode(b1, l1, &f, err, sizeof(err)), 0);
    assert_int_equal(rnnd_st_decode_params(&gru1, &f, p1, err, sizeof(err)), RNND_EINVAL);
    assert_non_null(strstr(err, "missing tensor \"weight_hh_l0\""));
    rnnd_st_file_free(&f);
    free(b1);
    free(pw);
    free(buf);
    free(p1);
    free(p2);
}

static void test_encode_refuses_bad_tensors(void **state) {
    (void)state;
    float d[4] = {0};
    void *out;
    size_t len;
    struct rnnd_st_tensor t[2] = {
        {.name = "a", .dtype = RNND_ST_F32, .ndim = 1, .shape = {4}, .data = d, .bytes = 16},
        {.name = "a", .dtype = RNND_ST_F32, .ndim = 1, .shape = {4}, .data = d, .bytes = 16},
    };
    assert_int_equal(rnnd_st_encode(t, 2, NULL, 0, &out, &len), RNND_EINVAL); // repeated name
    t[0].bytes = 12;
    assert_int_equal(rnnd_st_encode(t, 1, NULL, 0, &out, &len), RNND_EINVAL); // size mismatch
    t[0].bytes = 16;
    t[0].name = "";
    assert_int_equal(rnnd_st_encode(t, 1, NULL, 0, &out, &len), RNND_EINVAL); // empty name
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_params_round_trip),
        cmocka_unit_test(test_reads_reference_layout),
        cmocka_unit_test(test_refuses_damage),
        cmocka_unit_test(test_refuses_bad_headers),
        cmocka_unit_test(test_decode_params_checks_before_copying),
        cmocka_unit_test(test_encode_refuses_bad_tensors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
