/*
 * test_nonfinite.c: rnnd_first_nonfinite (kernels/common.c), the scan for NaN and Inf that the
 * request checks, the checkpoint loader and the CPU backend share, against a plain
 * element-by-element reference: fp32, bf16 and fp16, each kind of non-finite value at the start,
 * in the middle of a later block, in the last element of a tail shorter than eight bytes, at an
 * odd address, and none at all; finite values with every exponent bit but one set pass.
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

struct kind {
    enum rnnd_ftype ft;
    size_t esize;
    uint32_t exp;
    uint32_t bad[3]; // NaN, +Inf, -Inf
};

static const struct kind kinds[] = {
    {RNND_FTYPE_F32, 4, 0x7f800000u, {0x7fc00000u, 0x7f800000u, 0xff800000u}},
    {RNND_FTYPE_BF16, 2, 0x7f80u, {0x7fc1u, 0x7f80u, 0xff80u}},
    {RNND_FTYPE_F16, 2, 0x7c00u, {0x7e00u, 0x7c00u, 0xfc00u}},
};

static void put(uint8_t *p, size_t esize, size_t i, uint32_t v) {
    memcpy(p + esize * i, &v, esize); // little-endian host, as the wire
}

// Finite values of every exponent, mostly the largest ones (all exponent bits but one set).
static void fill(uint8_t *p, const struct kind *k, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t low = k->exp & (~k->exp + 1);
        uint32_t v = (i % 3 == 0) ? (k->exp - low) : (uint32_t)(i * 2654435761u) & ~k->exp;
        v |= (uint32_t)(i * 40503u) & ~(k->exp | (k->esize == 2 ? 0xffff8000u : 0x80000000u));
        if (i & 1)
            v |= k->esize == 2 ? 0x8000u : 0x80000000u;
        put(p, k->esize, i, v);
    }
}

static size_t reference(const uint8_t *p, size_t n, const struct kind *k) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v = 0;
        memcpy(&v, p + k->esize * i, k->esize);
        if ((v & k->exp) == k->exp)
            return i;
    }
    return n;
}

static void test_scan(void **state) {
    (void)state;
    const size_t sizes[] = {1, 3, 4, 7, 2047, 2048, 2049, 100003};
    for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
        const struct kind *k = &kinds[ki];
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            size_t n = sizes[si];
            uint8_t *buf = malloc(n * k->esize + 1);
            assert_non_null(buf);
            for (size_t shift = 0; shift < 2; shift++) { // aligned, then an odd address
                uint8_t *p = buf + shift;
                fill(p, k, n);
                assert_int_equal(rnnd_first_nonfinite(p, k->ft, n), n);
                const size_t at[] = {0, n / 2, n - 1, n > 1500 ? 1500 : n - 1};
                for (size_t ai = 0; ai < 4; ai++) {
                    for (int b = 0; b < 3; b++) {
                        fill(p, k, n);
                        put(p, k->esize, at[ai], k->bad[b]);
                        if (at[ai] + 7 < n) // a later one does not hide the first
                            put(p, k->esize, at[ai] + 7, k->bad[(b + 1) % 3]);
                        size_t got = rnnd_first_nonfinite(p, k->ft, n);
                        assert_int_equal(got, at[ai]);
                        assert_int_equal(got, reference(p, n, k));
                    }
                }
            }
            free(buf);
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_scan)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
