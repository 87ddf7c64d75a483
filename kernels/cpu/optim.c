/*
 * optim.c: one optimizer update over the flat parameter array, reproducing PyTorch 1.13:
 *
 *   torch.nn.utils.clip_grad_norm_(max_norm):   norm = ||g||_2 (summed in double here);
 *       when clipping is on (max_norm > 0 and finite): coef = max_norm / (norm + 1e-6), and
 *       g *= coef where coef < 1 (torch multiplies by min(coef, 1); by 1 is a no-op).
 *   torch.optim.SGD (no momentum):               d = g + wd p;  p -= lr d
 *   torch.optim.Adam (no amsgrad, single-tensor): d = g + wd p
 *       m = beta1 m + (1 - beta1) d;  v = beta2 v + (1 - beta2) d^2
 *       denom = sqrt(v) / sqrt(1 - beta2^t) + eps       (eps outside the root, as torch does)
 *       p -= lr / (1 - beta1^t) * m / denom
 * The per-element arithmetic is fp32 in torch's order of operations; the step scalars are computed
 * in double, as Python computes them. The weight-decayed d is not written back into grads.
 */
#include "cpu.h"

#include <math.h>

int rnnd__cpu_optim_step(float *params, float *grads, float *m, float *v, size_t n,
                         const struct rnnd_optim *o, int64_t t, float *grad_norm) {
    if (params == NULL || grads == NULL || n == 0 || t < 1 || rnnd_optim_check(o) != 0)
        return RNND_EINVAL;
    if (o->kind == RNND_OPTIM_ADAM && (m == NULL || v == NULL))
        return RNND_EINVAL;

    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)grads[i] * grads[i];
    float norm = (float)sqrt(ss);
    if (grad_norm)
        *grad_norm = norm;
    if (o->max_grad_norm > 0.0f && isfinite(o->max_grad_norm)) {
        float coef = o->max_grad_norm / (norm + 1e-6f);
        if (coef < 1.0f)
            for (size_t i = 0; i < n; i++)
                grads[i] *= coef;
    }

    float wd = o->weight_decay;
    if (o->kind == RNND_OPTIM_SGD) {
        float neg_lr = -o->lr;
        for (size_t i = 0; i < n; i++) {
            float d = wd != 0.0f ? grads[i] + wd * params[i] : grads[i];
            params[i] += neg_lr * d;
        }
        return 0;
    }

    double beta1 = o->beta1, beta2 = o->beta2;
    double bc1 = 1.0 - pow(beta1, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
    float neg_step = (float)(-(double)o->lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    float b1 = o->beta1, b2 = o->beta2, a1 = (float)(1.0 - beta1), a2 = (float)(1.0 - beta2);
    float eps = o->eps;
    for (size_t i = 0; i < n; i++) {
        float d = wd != 0.0f ? grads[i] + wd * params[i] : grads[i];
        m[i] = m[i] * b1 + d * a1;
        v[i] = v[i] * b2 + a2 * d * d;
        float denom = sqrtf(v[i]) / bc2_sqrt + eps;
        params[i] += neg_step * (m[i] / denom);
    }
    return 0;
}
