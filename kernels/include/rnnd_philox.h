/*
 * rnnd_philox.h: the counter-based generator that draws the policy's actions, the draws
 * themselves (categorical by inverse CDF, Gaussian by Box-Muller) and the log-probability and
 * entropy of an action (fp64 sums). Header-only and plain C that
 * nvcc also compiles (RNND_HD marks every function __host__ __device__ there), so the CPU
 * backend and the CUDA kernels run the same code on the same key.
 *
 * Generator: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
 * the Random123 reference, and cuRAND's and PyTorch's Philox): a bijection of a 128-bit counter
 * under a 64-bit key, so any draw is computed directly from its coordinates, with no state.
 *
 * Key. An action is keyed by (seed, env id, step): the env's key is the first two words of
 * Philox(counter = (env lo, env hi, 0, 0), key = (seed lo, seed hi)) (a fold-in, as JAX's
 * fold_in hashes data into a key), and the step's words w_0, w_1, ... are Philox(counter =
 * (step lo, step hi, i / 4, 0), key = env key) lane i % 4. So the same seed, env and step give
 * the same words on every backend and on every retry, and different envs or steps give
 * independent ones (keys of two (seed, env) pairs coincide with probability 2^-64).
 *
 * Draws from the words (u(w) = (w >> 8) 2^-24 in [0, 1): 24 bits, exact in fp32):
 *   categorical: m = max logits, e_k = exp(l_k - m), S = sum e_k (in order k = 0 .. K-1); the
 *     action is the first k with e_0 + .. + e_k > u(w_0) S (inverse CDF of softmax).
 *   Gaussian dim j: Box-Muller on the pair p = j / 2: r = sqrt(-2 ln u1), u1 = 1 - u(w_2p) in
 *     (0, 1], t = 2 pi u(w_2p+1); z_j = r cos t for even j, r sin t for odd j (tails reach
 *     sqrt(-2 ln 2^-24) = 5.8 sigma). The action is mean_j + exp(log_std_j) z_j.
 * CPU and CUDA use the same formulas and the same fp32 operations. Their elementary functions
 * differ: CUDA's expf, logf, cosf and sinf are off by up to 2 ulps, glibc's stay within about
 * half an ulp (correctly rounded for nearly every argument). So device code takes each as its
 * fp64 function rounded once to fp32 (RNND_EXPF and its siblings below): correctly rounded but
 * where the exact value lies within an fp64 ulp of an fp32 rounding boundary. The backends' draws
 * then differ only where one of those functions rounds apart on the two (rare): a Gaussian action
 * by an ulp, a categorical one only if besides u S falls within that ulp of a category boundary.
 */
#ifndef RNND_PHILOX_H
#define RNND_PHILOX_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define RNND_HD __host__ __device__
#else
#define RNND_HD
#endif

// The fp32 elementary functions of the draws (header comment): the C library's on the host,
// fp64 rounded to fp32 on the device.
#if defined(__CUDA_ARCH__)
#define RNND_EXPF(x) ((float)exp((double)(x)))
#define RNND_LOGF(x) ((float)log((double)(x)))
#define RNND_COSF(x) ((float)cos((double)(x)))
#define RNND_SINF(x) ((float)sin((double)(x)))
#else
#define RNND_EXPF(x) expf(x)
#define RNND_LOGF(x) logf(x)
#define RNND_COSF(x) cosf(x)
#define RNND_SINF(x) sinf(x)
#endif

#define RNND_PHILOX_M0 0xD2511F53u
#define RNND_PHILOX_M1 0xCD9E8D57u
#define RNND_PHILOX_W0 0x9E3779B9u // key schedule (golden ratio)
#define RNND_PHILOX_W1 0xBB67AE85u // (sqrt(3) - 1)

// out = Philox4x32-10(ctr, key).
static inline RNND_HD void rnnd_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2],
                                              uint32_t out[4]) {
    uint32_t x0 = ctr[0], x1 = ctr[1], x2 = ctr[2], x3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)RNND_PHILOX_M0 * x0, p1 = (uint64_t)RNND_PHILOX_M1 * x2;
        uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
        x1 = (uint32_t)p1;
        x3 = (uint32_t)p0;
        x0 = y0;
        x2 = y2;
        k0 += RNND_PHILOX_W0;
        k1 += RNND_PHILOX_W1;
    }
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
}

// The key of env env_id under seed (the fold-in of the header comment).
static inline RNND_HD void rnnd_philox_env_key(uint64_t seed, uint64_t env_id, uint32_t key[2]) {
    uint32_t ctr[4] = {(uint32_t)env_id, (uint32_t)(env_id >> 32), 0, 0};
    uint32_t sk[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, out[4];
    rnnd_philox4x32_10(ctr, sk, out);
    key[0] = out[0];
    key[1] = out[1];
}

// Words 4 block .. 4 block + 3 of a step under an env's key.
static inline RNND_HD void rnnd_philox_step_words(const uint32_t key[2], uint64_t step,
                                                  uint32_t block, uint32_t out[4]) {
    uint32_t ctr[4] = {(uint32_t)step, (uint32_t)(step >> 32), block, 0};
    rnnd_philox4x32_10(ctr, key, out);
}

// u(w): [0, 1) in steps of 2^-24.
static inline RNND_HD float rnnd_philox_u01(uint32_t w) {
    return (float)(w >> 8) * 0x1p-24f;
}

// The inverse-CDF draw from softmax(logits[0 .. K-1]) at uniform u (header comment).
static inline RNND_HD int rnnd_sample_categorical(const float *logits, int K, float u) {
    float m = logits[0];
    for (int k = 1; k < K; k++)
        m = fmaxf(m, logits[k]);
    float S = 0.0f;
    for (int k = 0; k < K; k++)
        S += RNND_EXPF(logits[k] - m);
    float target = u * S, c = 0.0f;
    int last = 0;
    for (int k = 0; k < K; k++) {
        float e = RNND_EXPF(logits[k] - m);
        c += e;
        if (e > 0.0f)
            last = k;
        if (target < c)
            return k;
    }
    return last; // rounding left u S at the top: the last category with any mass
}

// z (n) = standard normal draws 0 .. n-1 of a step's words (Box-Muller, header comment).
static inline RNND_HD void rnnd_sample_normals(const uint32_t key[2], uint64_t step, int n,
                                               float *z) {
    for (int j = 0; j < n; j += 4) {
        uint32_t w[4];
        rnnd_philox_step_words(key, step, (uint32_t)(j / 4), w);
        for (int p = 0; p < 2 && j + 2 * p < n; p++) {
            float r = sqrtf(-2.0f * RNND_LOGF(1.0f - rnnd_philox_u01(w[2 * p])));
            float t = 6.28318530717958648f * rnnd_philox_u01(w[2 * p + 1]);
            z[j + 2 * p] = r * RNND_COSF(t);
            if (j + 2 * p + 1 < n)
                z[j + 2 * p + 1] = r * RNND_SINF(t);
        }
    }
}

// The log-probability of action a under softmax(l[0 .. K-1]) and the distribution's entropy, in
// fp64 sums (either output may be NULL).
static inline RNND_HD void rnnd_categorical_stats(const float *l, int K, int64_t a, float *logp,
                                                  float *entropy) {
    float mx = l[0];
    for (int k = 1; k < K; k++)
        mx = fmaxf(mx, l[k]);
    double S = 0.0, dot = 0.0;
    for (int k = 0; k < K; k++) {
        double e = exp((double)l[k] - mx);
        S += e;
        dot += e * ((double)l[k] - mx);
    }
    double lnS = log(S);
    if (logp)
        *logp = (float)((double)l[a] - mx - lnS);
    if (entropy)
        *entropy = (float)(lnS - dot / S);
}

// The same for action x (A values) under the diagonal Gaussian N(mean, exp(log_std)^2).
static inline RNND_HD void rnnd_gaussian_stats(const float *mean, const float *log_std,
                                               const float *x, int A, float *logp, float *entropy) {
    const double half_ln_2pi = 0.91893853320467274178;
    double lp = 0.0, ent = 0.0;
    for (int j = 0; j < A; j++) {
        double z = ((double)x[j] - mean[j]) * exp(-(double)log_std[j]);
        lp += -0.5 * z * z - log_std[j] - half_ln_2pi;
        ent += 0.5 + half_ln_2pi + log_std[j];
    }
    if (logp)
        *logp = (float)lp;
    if (entropy)
        *entropy = (float)ent;
}

#endif // RNND_PHILOX_H
