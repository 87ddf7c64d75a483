/*
 * test_cpu_optim.c: the CPU backend's optim_step against torch.optim.Adam / SGD after
 * torch.nn.utils.clip_grad_norm_ (fixtures from tests/fixtures/gen_fixtures.py, several steps
 * each; parameters, Adam moments and the reported norm within 5e-6, errors seen ~5e-7), plus
 * its argument checks.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "rnnd_kernels.h"
#include "kernel_fixture.h"

static struct fx_file optim_fx;
static struct rnnd_backend cpu;

static void test_optim_fixtures(void **state) {
    (void)state;
    double max_err = 0.0;
    for (int ci = 0; ci < optim_fx.ncases; ci++) {
        const struct fx_case *fc = &optim_fx.cases[ci];
        int kind = fc->meta[0], n = fc->meta[1], steps = fc->meta[2];
        const double *h = fx_get(fc, "hyper")->data;
        struct rnnd_optim o = {
            .kind = kind == 0 ? RNND_OPTIM_ADAM : RNND_OPTIM_SGD,
            .lr = (float)h[0],
            .beta1 = (float)h[1],
            .beta2 = (float)h[2],
            .eps = (float)h[3],
            .weight_decay = (float)h[4],
            .max_grad_norm = (float)h[5],
        };
        float *p = fx_floats(fc, "params0"), *m = fx_floats(fc, "m0"), *v = fx_floats(fc, "v0");
        for (int s = 1; s <= steps; s++) {
            char name[24];
            snprintf(name, sizeof(name), "grads_%d", s);
            float *g = fx_floats(fc, name);
            float norm = -1.0f;
            assert_int_equal(cpu.ops->optim_step(cpu.ctx, p, g, m, v, (size_t)n, &o, s, &norm), 0);
            snprintf(name, sizeof(name), "norm_%d", s);
            double ref_norm = fx_get(fc, name)->data[0];
            assert_true(fabs(norm - ref_norm) <= 1e-6 * ref_norm);
            // Parameters: compare the update (p - p0), which is small next to p itself.
            const char *what[3] = {"params", "m", "v"};
            float *got[3] = {p, m, v};
            for (int k = 0; k < (kind == 0 ? 3 : 1); k++) {
                snprintf(name, sizeof(name), "%s_%d", what[k], s);
                const double *ref = fx_get(fc, name)->data;
                double e = fx_rel_err(got[k], ref, (size_t)n);
                if (k == 0) { // relative to the size of the step taken
                    const double *p0 = fx_get(fc, "params0")->data;
                    double num = 0, den = 0;
                    for (int i = 0; i < n; i++) {
                        num += (got[0][i] - ref[i]) * (got[0][i] - ref[i]);
                        den += (ref[i] - p0[i]) * (ref[i] - p0[i]);
                    }
                    e = sqrt(num / den);
                }
                if (!(e <= 5e-6)) {
                    print_error("optim case %d step %d: %s error %.3e\n", ci, s, what[k], e);
                    fail();
                }
                max_err = fmax(max_err, e);
            }
            free(g);
        }
        free(p);
        free(m);
        free(v);
    }
    print_message("%d optimizer cases: largest error %.2e\n", optim_fx.ncases, max_err);
}

// Clipping scales the gradient in place to max_grad_norm and reports the norm before it.
static void test_optim_clip_in_place(void **state) {
    (void)state;
    float p[2] = {1.0f, 1.0f}, g[2] = {3.0f, 4.0f}, norm = 0.0f;
    struct rnnd_optim o = {.kind = RNND_OPTIM_SGD, .lr = 1.0f, .max_grad_norm = 1.0f};
    assert_int_equal(cpu.ops->optim_step(cpu.ctx, p, g, NULL, NULL, 2, &o, 1, &norm), 0);
    assert_float_equal(norm, 5.0f, 1e-6f);
    assert_float_equal(g[0], 0.6f, 1e-6f);
    assert_float_equal(g[1], 0.8f, 1e-6f);
    assert_float_equal(p[0], 0.4f, 1e-6f);
    // Clipping off (<= 0 or infinite): the gradient is left alone; the norm is still reported.
    float g2[2] = {3.0f, 4.0f};
    o.max_grad_norm = INFINITY;
    assert_int_equal(cpu.ops->optim_step(cpu.ctx, p, g2, NULL, NULL, 2, &o, 1, NULL), 0);
    assert_true(g2[0] == 3.0f && g2[1] == 4.0f);
}

static void test_optim_bad_arguments(void **state) {
    (void)state;
    float p[3] = {1, 2, 3}, g[3] = {1, 1, 1}, m[3] = {0}, v[3] = {0}, norm = -1.0f;
    struct rnnd_optim good = {.kind = RNND_OPTIM_ADAM,
                              .lr = 1e-3f,
                              .beta1 = 0.9f,
                              .beta2 = 0.999f,
                              .eps = 1e-8f,
                              .max_grad_norm = 1.0f};
    struct rnnd_optim o;
    const struct rnnd_backend_ops *ops = cpu.ops;
#define BAD(...) assert_int_equal(ops->optim_step(cpu.ctx, __VA_ARGS__), RNND_EINVAL)
    BAD(NULL, g, m, v, 3, &good, 1, &norm);
    BAD(p, NULL, m, v, 3, &good, 1, &norm);
    BAD(p, g, NULL, v, 3, &good, 1, &norm);
    BAD(p, g, m, NULL, 3, &good, 1, &norm);
    BAD(p, g, m, v, 0, &good, 1, &norm);
    BAD(p, g, m, v, 3, NULL, 1, &norm);
    BAD(p, g, m, v, 3, &good, 0, &norm);
    BAD(p, g, m, v, 3, &good, -5, &norm);
    o = good, o.lr = 0.0f;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.lr = NAN;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.beta1 = 1.0f;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.beta2 = -0.1f;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.eps = 0.0f;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.weight_decay = -1.0f;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.max_grad_norm = NAN;
    BAD(p, g, m, v, 3, &o, 1, &norm);
    o = good, o.kind = (enum rnnd_optim_kind)5;
    BAD(p, g, m, v, 3, &o, 1, &norm);
#undef BAD
    assert_true(p[0] == 1 && p[1] == 2 && p[2] == 3 && g[0] == 1 && g[2] == 1);
    assert_true(m[0] == 0 && v[0] == 0 && norm == -1.0f);
    // SGD needs no moments.
    o = good, o.kind = RNND_OPTIM_SGD;
    assert_int_equal(ops->optim_step(cpu.ctx, p, g, NULL, NULL, 3, &o, 1, &norm), 0);
}

static int group_setup(void **state) {
    (void)state;
    if (rnnd_backend_cpu_init(&cpu) != 0)
        return -1;
    return fx_load("optim_cases.bin", 2, &optim_fx);
}

static int group_teardown(void **state) {
    (void)state;
    fx_free(&optim_fx);
    rnnd_backend_free(&cpu);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_optim_fixtures),
        cmocka_unit_test(test_optim_clip_in_place),
        cmocka_unit_test(test_optim_bad_arguments),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
