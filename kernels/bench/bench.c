/*
 * bench.c: rnnd-kernel-bench, the kernel benchmark (in the spirit of llm.c's dev/cuda).
 *
 *   rnnd-kernel-bench --backend cpu|cuda --cell gru|lstm --batch B --steps T --input I
 *       --hidden H --layers L --reset-prob p --compute fp32|ieee|bf16
 *       [--warmup n] [--repeat n] [--seed n] [--device n] [--threads n] [--grad-input]
 *   rnnd-kernel-bench --backend cuda --op step --cell gru --batch B --input I --hidden H
 *       --layers L --reset-prob p --compute fp32|ieee|bf16 [--warmup n] [--repeat n]
 *
 * --cell, --batch, --steps, --input, --hidden, --layers, --reset-prob and --compute take comma
 * lists (--batch 16,64); every combination is one case. Each case draws random non-zero inputs
 * (uniform weights as PyTorch initialises them, x uniform in [-1, 1], is_init set with probability
 * p at every (b, t), zero initial state, random output gradient), checks a non-cpu backend
 * against the CPU reference once, runs warm-up calls, then times `repeat` calls of forward (with
 * tape) and of forward+backward and reports medians: a table on stdout, then one JSON line per
 * case (lines starting with '{'). The input gradient is not computed unless --grad-input is given
 * (a policy's observations need none; kernels/bench/torch_cpu_bench.py does the same).
 * --op step times the single-step op instead (rnn_step, B rows gathered from a 4B-slot table
 * through a random permutation; CUDA only, kernels/bench/cuda_step_bench.cu): a step table and
 * JSON lines with "op":"step" (--steps is ignored).
 * --threads sets the CPU backend's thread count (RNND_CPU_THREADS; default: the CPUs available).
 * The device column names OpenBLAS's kernel; on CPUs the OpenBLAS build does not know, the bench
 * re-executes itself with OPENBLAS_CORETYPE set (rnnd_cpu_blas_reexec), as rnnd does.
 *
 * Plugging in CUDA (kernels/bench/cuda_*.cu, built only when RNND_HAVE_CUDA is defined): implement
 * rnnd_bench_cuda() from bench.h. main() below calls it for --backend cuda, and that is the only
 * hook: it opens rnnd_backend_cuda_init(bc->device), calls rnnd_bench_backend() with a CUDA-event
 * bench_timer (validation against the CPU reference comes with it), then times cuDNN at the same
 * shape and appends its figures to res->extra (e.g. ,"cudnn_fwd_ms":0.41,"cudnn_fwdbwd_ms":1.3).
 */
#include "bench.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


// ---------------------------------------------------------------------------------------------
// Helpers

static uint64_t rng_next(uint64_t *s) { // splitmix64
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(uint64_t *s) { // [0, 1)
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

static void fill_uniform(float *p, size_t n, uint64_t *s) {
    for (size_t i = 0; i < n; i++)
        p[i] = (float)(2.0 * rng_uniform(s) - 1.0);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double rel_err(const float *a, const float *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

// Floating-point operations of one forward (matmuls only); backward is about twice that.
static double forward_flops(const struct rnnd_model *m, int B, int T) {
    double gh = (double)rnnd_model_gates(m) * m->H, f = 0.0;
    for (int l = 0; l < m->L; l++)
        f += 2.0 * B * T * gh * (rnnd_model_layer_input(m, l) + m->H);
    return f;
}

// ---------------------------------------------------------------------------------------------
// One case on one backend

// Host inputs of a case.
struct bench_data {
    float *params, *x, *grad_out;
    uint8_t *is_init;
    size_t P, nx, nout, nbt;
};

static void bench_data_free(struct bench_data *d) {
    free(d->params);
    free(d->x);
    free(d->grad_out);
    free(d->is_init);
}

static int bench_data_init(struct bench_data *d, const struct bench_case *bc) {
    const struct rnnd_model *m = &bc->model;
    memset(d, 0, sizeof(*d));
    d->P = rnnd_model_param_count(m);
    d->nbt = (size_t)bc->B * bc->T;
    d->nx = d->nbt * m->I;
    d->nout = d->nbt * m->H;
    d->params = malloc(d->P * sizeof(float));
    d->x = malloc(d->nx * sizeof(float));
    d->grad_out = malloc(d->nout * sizeof(float));
    d->is_init = malloc(d->nbt);
    if (!d->params || !d->x || !d->grad_out || !d->is_init) {
        bench_data_free(d);
        return RNND_ENOMEM;
    }
    uint64_t s = bc->seed;
    rnnd_model_init_params(m, bc->seed, d->params);
    fill_uniform(d->x, d->nx, &s);
    fill_uniform(d->grad_out, d->nout, &s);
    for (size_t i = 0; i < d->nbt; i++)
        d->is_init[i] = rng_uniform(&s) < bc->reset_prob;
    return 0;
}

// Buffers of one case in a backend's memory.
struct bench_bufs {
    struct rnnd_backend *be;
    float *params, *x, *grad_out, *out, *h_n, *c_n, *gparams, *gx;
    uint8_t *is_init;
    void *tape;
};

static void bench_bufs_free(struct bench_bufs *b) {
    if (b->be == NULL)
        return;
    void *ptrs[] = {b->params, b->x,  b->grad_out, b->out,     b->h_n,
                    b->c_n,    b->gx, b->gparams,  b->is_init, b->tape};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++)
        b->be->ops->free(b->be->ctx, ptrs[i]);
    memset(b, 0, sizeof(*b));
}

static int bench_bufs_init(struct bench_bufs *b, struct rnnd_backend *be,
                           const struct bench_case *bc, const struct bench_data *d) {
    const struct rnnd_model *m = &bc->model;
    const struct rnnd_backend_ops *ops = be->ops;
    size_t blh = (size_t)bc->B * m->L * m->H * sizeof(float);
    memset(b, 0, sizeof(*b));
    b->be = be;
    int err = 0;
#define ALLOC(ptr, bytes)                                                                          \
    if (!err)                                                                                      \
    err = ops->alloc(be->ctx, (bytes), (void **)&(ptr))
    ALLOC(b->params, d->P * sizeof(float));
    ALLOC(b->gparams, d->P * sizeof(float));
    ALLOC(b->x, d->nx * sizeof(float));
    ALLOC(b->gx, d->nx * sizeof(float));
    ALLOC(b->grad_out, d->nout * sizeof(float));
    ALLOC(b->out, d->nout * sizeof(float));
    ALLOC(b->h_n, blh);
    if (m->cell == RNND_CELL_LSTM)
        ALLOC(b->c_n, blh);
    ALLOC(b->is_init, d->nbt);
    ALLOC(b->tape, ops->tape_bytes(be->ctx, m, bc->B, bc->T));
#undef ALLOC
    if (!err)
        err = ops->copy_in(be->ctx, b->params, d->params, d->P * sizeof(float));
    if (!err)
        err = ops->copy_in(be->ctx, b->x, d->x, d->nx * sizeof(float));
    if (!err)
        err = ops->copy_in(be->ctx, b->grad_out, d->grad_out, d->nout * sizeof(float));
    if (!err)
        err = ops->copy_in(be->ctx, b->is_init, d->is_init, d->nbt);
    if (!err)
        err = ops->zero(be->ctx, b->gparams, d->P * sizeof(float));
    if (err)
        bench_bufs_free(b);
    return err;
}

static int run_forward(struct bench_bufs *b, const struct bench_case *bc) {
    struct rnnd_seq seq = {.B = bc->B, .T = bc->T, .x = b->x, .is_init = b->is_init};
    return b->be->ops->rnn_forward(b->be->ctx, b->out, b->h_n, b->c_n, b->tape, &seq, b->params,
                                   &bc->model);
}

static int run_fwdbwd(struct bench_bufs *b, const struct bench_case *bc, bool grad_x) {
    int err = run_forward(b, bc);
    if (err)
        return err;
    struct rnnd_seq seq = {.B = bc->B, .T = bc->T, .x = b->x, .is_init = b->is_init};
    struct rnnd_seq_grads g = {.params = b->gparams, .x = grad_x ? b->gx : NULL};
    return b->be->ops->rnn_backward(b->be->ctx, &g, b->grad_out, NULL, NULL, b->tape, &seq,
                                    b->params, &bc->model);
}

// Output and parameter gradient of one forward+backward on be, copied to the host.
static int run_once_to_host(struct rnnd_backend *be, const struct bench_case *bc,
                            const struct bench_data *d, float *out, float *gparams, float *gx) {
    struct bench_bufs b;
    int err = bench_bufs_init(&b, be, bc, d);
    if (err)
        return err;
    err = run_fwdbwd(&b, bc, true);
    if (!err)
        err = be->ops->copy_out(be->ctx, out, b.out, d->nout * sizeof(float));
    if (!err)
        err = be->ops->copy_out(be->ctx, gparams, b.gparams, d->P * sizeof(float));
    if (!err)
        err = be->ops->copy_out(be->ctx, gx, b.gx, d->nx * sizeof(float));
    bench_bufs_free(&b);
    return err;
}

// Compares be with the CPU reference on the case's inputs (res->out_err, res->grad_err).
static int validate(struct rnnd_backend *be, const struct bench_case *bc,
                    const struct bench_data *d, struct bench_result *res) {
    struct rnnd_backend cpu = {0};
    int err = rnnd_backend_cpu_init(&cpu);
    if (err)
        return err;
    size_t n_out = d->nout, n_g = d->P + d->nx;
    float *buf = malloc(2 * (n_out + n_g) * sizeof(float));
    if (buf == NULL) {
        rnnd_backend_free(&cpu);
        return RNND_ENOMEM;
    }
    float *ref_out = buf, *ref_g = ref_out + n_out, *out = ref_g + n_g, *g = out + n_out;
    err = run_once_to_host(&cpu, bc, d, ref_out, ref_g, ref_g + d->P);
    if (!err)
        err = run_once_to_host(be, bc, d, out, g, g + d->P);
    if (!err) {
        res->out_err = rel_err(out, ref_out, n_out);
        res->grad_err = rel_err(g, ref_g, n_g);
    }
    free(buf);
    rnnd_backend_free(&cpu);
    return err;
}

int rnnd_bench_backend(struct rnnd_backend *be, const struct bench_case *bc,
                       const struct bench_timer *timer, struct bench_result *res) {
    snprintf(res->device, sizeof(res->device), "%s", be->device);
    res->out_err = res->grad_err = -1.0;
    int err = be->ops->supports(be->ctx, &bc->model);
    if (!err)
        err = be->ops->plan_name(be->ctx, &bc->model, bc->B, res->plan, sizeof(res->plan));
    if (err)
        return err;
    struct bench_data d;
    err = bench_data_init(&d, bc);
    if (err)
        return err;
    if (strcmp(be->ops->name, "cpu") != 0)
        err = validate(be, bc, &d, res);

    struct bench_bufs b = {0};
    double *t_fwd = calloc((size_t)bc->repeat, sizeof(double));
    double *t_all = calloc((size_t)bc->repeat, sizeof(double));
    if (!err && (t_fwd == NULL || t_all == NULL))
        err = RNND_ENOMEM;
    if (!err)
        err = bench_bufs_init(&b, be, bc, &d);
    for (int pass = 0; pass < 2 && !err; pass++) {
        double *times = pass == 0 ? t_fwd : t_all;
        for (int i = -bc->warmup; i < bc->repeat && !err; i++) {
            double t0 = 0.0;
            if (timer && timer->start)
                timer->start(timer->ctx);
            else
                t0 = now_ms();
            err = pass == 0 ? run_forward(&b, bc) : run_fwdbwd(&b, bc, bc->grad_input);
            double ms;
            if (timer && timer->stop) {
                ms = timer->stop(timer->ctx);
            } else {
                if (!err)
                    err = be->ops->sync(be->ctx);
                ms = now_ms() - t0;
            }
            if (i >= 0)
                times[i] = ms;
        }
    }
    if (!err) {
        res->fwd_ms = median(t_fwd, bc->repeat);
        res->fwdbwd_ms = median(t_all, bc->repeat);
        res->fwd_min_ms = t_fwd[0]; // sorted by median()
        res->fwdbwd_min_ms = t_all[0];
    }
    bench_bufs_free(&b);
    free(t_fwd);
    free(t_all);
    bench_data_free(&d);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Command line

#define MAX_LIST 16

struct int_list {
    int n;
    int v[MAX_LIST];
};
struct dbl_list {
    int n;
    double v[MAX_LIST];
};
struct str_list {
    int n;
    char v[MAX_LIST][16];
};

static int parse_list(const char *arg, void *list, char kind) {
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", arg);
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (n == MAX_LIST)
            return -1;
        char *end;
        if (kind == 'i') {
            long v = strtol(tok, &end, 10);
            if (*end || v < 1 || v > 1 << 24)
                return -1;
            ((struct int_list *)list)->v[n] = (int)v;
        } else if (kind == 'd') {
            double v = strtod(tok, &end);
            if (*end || !(v >= 0.0 && v <= 1.0))
                return -1;
            ((struct dbl_list *)list)->v[n] = v;
        } else {
            snprintf(((struct str_list *)list)->v[n], 16, "%s", tok);
        }
        n++;
    }
    if (n == 0)
        return -1;
    if (kind == 'i')
        ((struct int_list *)list)->n = n;
    else if (kind == 'd')
        ((struct dbl_list *)list)->n = n;
    else
        ((struct str_list *)list)->n = n;
    return 0;
}

static void usage(FILE *f) {
    fprintf(f, "usage: rnnd-kernel-bench [--backend cpu|cuda] [--cell gru|lstm] [--batch B]\n"
               "         [--steps T] [--input I] [--hidden H] [--layers L] [--reset-prob p]\n"
               "         [--compute fp32|ieee|bf16] [--warmup n] [--repeat n] [--seed n]\n"
               "         [--device n] [--threads n] [--grad-input] [--op seq|step]\n"
               "List options take comma lists (--batch 16,64); every combination is one case.\n"
               "Defaults: cpu gru B=64 T=128 I=64 H=128 L=1 p=0.1 fp32, warmup 3, repeat 10.\n");
}

static const char *compute_name(enum rnnd_compute c) {
    return c == RNND_COMPUTE_BF16 ? "bf16" : c == RNND_COMPUTE_IEEE ? "ieee" : "fp32";
}

static int run_case(const struct bench_case *bc, struct bench_result *res) {
    if (bc->step && strcmp(bc->backend, "cuda") != 0) {
        fprintf(stderr, "rnnd-kernel-bench: --op step runs on --backend cuda only\n");
        return RNND_ENOTSUP;
    }
    if (strcmp(bc->backend, "cuda") == 0) {
#ifdef RNND_HAVE_CUDA
        return bc->step ? rnnd_bench_cuda_step(bc, res) : rnnd_bench_cuda(bc, res);
#else
        fprintf(stderr, "rnnd-kernel-bench: this build has no CUDA backend (RNND_CUDA=OFF or no "
                        "nvcc); use --backend cpu\n");
        return RNND_ENOTSUP;
#endif
    }
    struct rnnd_backend be;
    int err = rnnd_backend_cpu_init(&be);
    if (err)
        return err;
    err = rnnd_bench_backend(&be, bc, NULL, res);
    rnnd_backend_free(&be);
    return err;
}

// --op step: runs the cases, prints a table, then one JSON line per case.
static int step_main(const struct bench_case *cases, struct bench_result *results, int *errs,
                     int ncase) {
    printf("%-7s %-4s %-5s %5s %5s %5s %2s %6s %8s %8s %8s %8s %9s %9s %5s\n", "backend", "cell",
           "comp", "B", "I", "H", "L", "reset", "step_us", "graph_us", "gpu_us", "call_us",
           "out_err", "state_err", "MHz");
    int failed = 0;
    for (int c = 0; c < ncase; c++) {
        const struct bench_case *bc = &cases[c];
        struct bench_result *r = &results[c];
        const struct rnnd_model *m = &bc->model;
        errs[c] = run_case(bc, r);
        printf("%-7s %-4s %-5s %5d %5d %5d %2d %6.3f ", bc->backend,
               m->cell == RNND_CELL_LSTM ? "lstm" : "gru", compute_name(m->compute), bc->B, m->I,
               m->H, m->L, bc->reset_prob);
        if (errs[c]) {
            failed = 1;
            printf(" failed: %s\n", rnnd_strerror(errs[c]));
            continue;
        }
        printf("%8.2f %8.2f %8.2f %8.2f %9.1e %9.1e %5.0f\n", r->step_us, r->graph_us, r->gpu_us,
               r->call_us, r->out_err, r->grad_err, r->sm_mhz);
    }
    fflush(stdout);
    for (int c = 0; c < ncase; c++) {
        if (errs[c])
            continue;
        const struct bench_case *bc = &cases[c];
        const struct bench_result *r = &results[c];
        const struct rnnd_model *m = &bc->model;
        printf("{\"op\":\"step\",\"backend\":\"%s\",\"device\":\"%s\",\"cell\":\"%s\",\"B\":%d,"
               "\"I\":%d,\"H\":%d,\"L\":%d,\"reset_prob\":%g,\"compute\":\"%s\",\"step_us\":%.3f,"
               "\"graph_us\":%.3f,\"gpu_us\":%.3f,\"call_us\":%.3f,\"out_err\":%.3e,\"state_err\":%"
               ".3e,"
               "\"warmup\":%d,\"repeat\":%d,\"seed\":%llu%s}\n",
               bc->backend, r->device, m->cell == RNND_CELL_LSTM ? "lstm" : "gru", bc->B, m->I,
               m->H, m->L, bc->reset_prob, compute_name(m->compute), r->step_us, r->graph_us,
               r->gpu_us, r->call_us, r->out_err, r->grad_err, bc->warmup, bc->repeat,
               (unsigned long long)bc->seed, r->extra);
    }
    return failed;
}

int main(int argc, char **argv) {
    rnnd_cpu_blas_reexec(argv);
    const char *backend = "cpu";
    struct str_list cells = {1, {"gru"}}, computes = {1, {"fp32"}};
    struct int_list Bs = {1, {64}}, Ts = {1, {128}}, Is = {1, {64}}, Hs = {1, {128}}, Ls = {1, {1}};
    struct dbl_list ps = {1, {0.1}};
    int warmup = 3, repeat = 10, device = 0, threads = 0;
    uint64_t seed = 1;
    bool grad_input = false, step = false;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--grad-input") == 0) {
            grad_input = true;
            continue;
        } else if (v == NULL) {
            bad = 1;
        } else if (strcmp(a, "--op") == 0) {
            step = strcmp(v, "step") == 0;
            bad = !step && strcmp(v, "seq") != 0;
        } else if (strcmp(a, "--backend") == 0) {
            backend = v;
            bad = strcmp(v, "cpu") != 0 && strcmp(v, "cuda") != 0;
        } else if (strcmp(a, "--cell") == 0) {
            bad = parse_list(v, &cells, 's');
        } else if (strcmp(a, "--compute") == 0) {
            bad = parse_list(v, &computes, 's');
        } else if (strcmp(a, "--batch") == 0) {
            bad = parse_list(v, &Bs, 'i');
        } else if (strcmp(a, "--steps") == 0) {
            bad = parse_list(v, &Ts, 'i');
        } else if (strcmp(a, "--input") == 0) {
            bad = parse_list(v, &Is, 'i');
        } else if (strcmp(a, "--hidden") == 0) {
            bad = parse_list(v, &Hs, 'i');
        } else if (strcmp(a, "--layers") == 0) {
            bad = parse_list(v, &Ls, 'i');
        } else if (strcmp(a, "--reset-prob") == 0) {
            bad = parse_list(v, &ps, 'd');
        } else if (strcmp(a, "--warmup") == 0) {
            warmup = atoi(v);
            bad = warmup < 0;
        } else if (strcmp(a, "--repeat") == 0) {
            repeat = atoi(v);
            bad = repeat < 1;
        } else if (strcmp(a, "--seed") == 0) {
            seed = strtoull(v, NULL, 10);
        } else if (strcmp(a, "--device") == 0) {
            device = atoi(v);
        } else if (strcmp(a, "--threads") == 0) {
            threads = atoi(v);
            bad = threads < 1;
        } else {
            bad = 1;
        }
        if (bad) {
            fprintf(stderr, "rnnd-kernel-bench: bad or incomplete option %s%s%s\n", a, v ? " " : "",
                    v ? v : "");
            usage(stderr);
            return 2;
        }
        i++;
    }
    for (int k = 0; k < cells.n; k++)
        if (strcmp(cells.v[k], "gru") != 0 && strcmp(cells.v[k], "lstm") != 0) {
            fprintf(stderr, "rnnd-kernel-bench: --cell takes gru or lstm, not %s\n", cells.v[k]);
            return 2;
        }
    for (int k = 0; k < computes.n; k++)
        if (strcmp(computes.v[k], "fp32") != 0 && strcmp(computes.v[k], "ieee") != 0 &&
            strcmp(computes.v[k], "bf16") != 0) {
            fprintf(stderr, "rnnd-kernel-bench: --compute takes fp32, ieee or bf16, not %s\n",
                    computes.v[k]);
            return 2;
        }
    if (threads > 0) { // read by rnnd_backend_cpu_init (the cpu backend, and the reference)
        char buf[16];
        snprintf(buf, sizeof(buf), "%d", threads);
        setenv("RNND_CPU_THREADS", buf, 1);
    }

    // Cases in nested order: cell, compute, L, H, I, B, T, reset probability.
    int ncase = cells.n * computes.n * Ls.n * Hs.n * Is.n * Bs.n * Ts.n * ps.n;
    struct bench_case *cases = calloc((size_t)ncase, sizeof(*cases));
    struct bench_result *results = calloc((size_t)ncase, sizeof(*results));
    int *errs = calloc((size_t)ncase, sizeof(int));
    if (!cases || !results || !errs) {
        fprintf(stderr, "rnnd-kernel-bench: out of memory\n");
        return 1;
    }
    int c = 0;
    for (int a = 0; a < cells.n; a++)
        for (int k = 0; k < computes.n; k++)
            for (int l = 0; l < Ls.n; l++)
                for (int h = 0; h < Hs.n; h++)
                    for (int in = 0; in < Is.n; in++)
                        for (int b = 0; b < Bs.n; b++)
                            for (int t = 0; t < Ts.n; t++)
                                for (int p = 0; p < ps.n; p++, c++) {
                                    struct bench_case *bc = &cases[c];
                                    bc->backend = backend;
                                    bc->device = device;
                                    bc->model.cell = strcmp(cells.v[a], "lstm") == 0
                                                         ? RNND_CELL_LSTM
                                                         : RNND_CELL_GRU;
                                    bc->model.compute =
                                        strcmp(computes.v[k], "bf16") == 0   ? RNND_COMPUTE_BF16
                                        : strcmp(computes.v[k], "ieee") == 0 ? RNND_COMPUTE_IEEE
                                                                             : RNND_COMPUTE_FP32;
                                    bc->model.I = Is.v[in];
                                    bc->model.H = Hs.v[h];
                                    bc->model.L = Ls.v[l];
                                    bc->B = Bs.v[b];
                                    bc->T = Ts.v[t];
                                    bc->reset_prob = ps.v[p];
                                    bc->warmup = warmup;
                                    bc->repeat = repeat;
                                    bc->seed = seed;
                                    bc->grad_input = grad_input;
                                    bc->step = step;
                                }

    if (step) {
        int failed = step_main(cases, results, errs, ncase);
        free(cases);
        free(results);
        free(errs);
        return failed;
    }
    printf("%-7s %-4s %-5s %5s %5s %5s %5s %2s %6s %10s %10s %8s %10s  %s\n", "backend", "cell",
           "comp", "B", "T", "I", "H", "L", "reset", "fwd_ms", "fwdbwd_ms", "GFLOP/s", "err",
           "plan");
    int failed = 0;
    for (c = 0; c < ncase; c++) {
        struct bench_case *bc = &cases[c];
        struct bench_result *r = &results[c];
        errs[c] = run_case(bc, r);
        const struct rnnd_model *m = &bc->model;
        if (errs[c]) {
            failed = 1;
            printf("%-7s %-4s %-5s %5d %5d %5d %5d %2d %6.3f  failed: %s\n", backend,
                   m->cell == RNND_CELL_LSTM ? "lstm" : "gru", compute_name(m->compute), bc->B,
                   bc->T, m->I, m->H, m->L, bc->reset_prob, rnnd_strerror(errs[c]));
            continue;
        }
        double gflops = 3.0 * forward_flops(m, bc->B, bc->T) / (r->fwdbwd_ms * 1e6);
        char err_s[32] = "-";
        if (r->out_err >= 0.0)
            snprintf(err_s, sizeof(err_s), "%.1e", fmax(r->out_err, r->grad_err));
        printf("%-7s %-4s %-5s %5d %5d %5d %5d %2d %6.3f %10.3f %10.3f %8.1f %10s  %s\n", backend,
               m->cell == RNND_CELL_LSTM ? "lstm" : "gru", compute_name(m->compute), bc->B, bc->T,
               m->I, m->H, m->L, bc->reset_prob, r->fwd_ms, r->fwdbwd_ms, gflops, err_s, r->plan);
    }
    fflush(stdout);
    for (c = 0; c < ncase; c++) {
        if (errs[c])
            continue;
        struct bench_case *bc = &cases[c];
        struct bench_result *r = &results[c];
        const struct rnnd_model *m = &bc->model;
        printf("{\"backend\":\"%s\",\"device\":\"%s\",\"cell\":\"%s\",\"B\":%d,\"T\":%d,\"I\":%d,"
               "\"H\":%d,\"L\":%d,\"reset_prob\":%g,\"compute\":\"%s\",\"fwd_ms\":%.4f,"
               "\"fwdbwd_ms\":%.4f,\"fwd_min_ms\":%.4f,\"fwdbwd_min_ms\":%.4f,"
               "\"fwdbwd_gflops\":%.2f,\"grad_input\":%s,\"warmup\":%d,\"repeat\":%d,"
               "\"seed\":%llu",
               backend, r->device, m->cell == RNND_CELL_LSTM ? "lstm" : "gru", bc->B, bc->T, m->I,
               m->H, m->L, bc->reset_prob, compute_name(m->compute), r->fwd_ms, r->fwdbwd_ms,
               r->fwd_min_ms, r->fwdbwd_min_ms,
               3.0 * forward_flops(m, bc->B, bc->T) / (r->fwdbwd_ms * 1e6),
               bc->grad_input ? "true" : "false", bc->warmup, bc->repeat,
               (unsigned long long)bc->seed);
        if (r->out_err >= 0.0)
            printf(",\"out_err\":%.3e,\"grad_err\":%.3e", r->out_err, r->grad_err);
        printf(",\"plan\":\"%s\"%s}\n", r->plan, r->extra);
    }
    free(cases);
    free(results);
    free(errs);
    return failed;
}
