/*
 * test_optim_cuda.c: the CUDA backend's optimizer step (optim_step: Adam and SGD, L2 weight
 * decay, clip_grad_norm_) against the CPU reference (kernels/cuda/optim.cu against
 * kernels/cpu/optim.c), one case of the table at a time: the updated parameters, the clipped
 * gradients, Adam's moments and the norm (gpu_check.h has the method).
 */
#include "gpu_check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

struct optim_case {
    enum rnnd_optim_kind kind;
    float max_norm; // clip_grad_norm_'s bound (0: none)
    float wd;       // weight decay
    size_t n;       // parameters
};

static void test_optim(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                       const struct optim_case *oc) {
    const enum rnnd_optim_kind kind = oc->kind;
    const float max_norm = oc->max_norm, wd = oc->wd;
    const size_t n = oc->n;
    struct rnnd_optim o = {.kind = kind,
                           .lr = 1e-2f,
                           .beta1 = 0.9f,
                           .beta2 = 0.999f,
                           .eps = 1e-8f,
                           .weight_decay = wd,
                           .max_grad_norm = max_norm};
    char tag[96];
    snprintf(tag, sizeof(tag), "optim %s clip %g wd %g n %zu",
             kind == RNND_OPTIM_ADAM ? "adam" : "sgd", max_norm, wd, n);
    printf("%s\n", tag);
    gpu_seed(tag);
    float *p = host_uniform(n, 1.0f), *g = host_uniform(n, 0.1f);
    float *m = host_uniform(n, 0.01f), *v = host_uniform(n, 0.01f);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    float *res[2][4], norm[2] = {0, 0};
    struct rnnd_backend *bes[2] = {gpu, cpu};
    int errs[2];
    for (int k = 0; k < 2; k++) {
        struct rnnd_backend *be = bes[k];
        struct bufs b = {.be = be};
        float *dp = dev(&b, p, n * 4), *dg = dev(&b, g, n * 4);
        float *dm = dev(&b, m, n * 4), *dv = dev(&b, v, n * 4);
        errs[k] = be->ops->optim_step(be->ctx, dp, dg, dm, dv, n, &o, 3, &norm[k]);
        for (int i = 0; i < 4; i++)
            res[k][i] = xmalloc(n * 4);
        if (!errs[k]) {
            to_host(be, res[k][0], dp, n);
            to_host(be, res[k][1], dg, n);
            to_host(be, res[k][2], dm, n);
            to_host(be, res[k][3], dv, n);
        }
        bufs_free(&b);
    }
    if (errs[0] || errs[1]) {
        fail("%s: cuda %s, cpu %s", tag, rnnd_err_name(errs[0]), rnnd_err_name(errs[1]));
    } else {
        compare("params", tag, res[0][0], res[1][0], p, n, 1e-5);
        compare("grads", tag, res[0][1], res[1][1], NULL, n, 1e-6);
        if (kind == RNND_OPTIM_ADAM) {
            compare("adam m", tag, res[0][2], res[1][2], NULL, n, 1e-6);
            compare("adam v", tag, res[0][3], res[1][3], NULL, n, 1e-6);
        }
        compare("norm", tag, &norm[0], &norm[1], NULL, 1, 1e-6);
    }
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 4; i++)
            free(res[k][i]);
    free(p), free(g), free(m), free(v);
}

// Clipping and weight decay on and off, sizes that are no multiple of a block.
static const struct optim_case optim_cases[] = {
    {RNND_OPTIM_ADAM, 0.5f, 0.01f, 10007},
    {RNND_OPTIM_ADAM, 0.0f, 0.0f, 4099},
    {RNND_OPTIM_SGD, 1e9f, 0.1f, 777},
};

int main(void) {
    struct rnnd_backend gpu = {0}, cpu = {0};
    gpu_check_open(&gpu, &cpu);
    for (size_t i = 0; i < sizeof(optim_cases) / sizeof(optim_cases[0]); i++)
        test_optim(&gpu, &cpu, &optim_cases[i]);
    return gpu_check_close(&gpu, &cpu);
}
