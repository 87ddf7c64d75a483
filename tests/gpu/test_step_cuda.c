/*
 * test_step_cuda.c: the CUDA backend's single step with slot gather/scatter (rnn_step,
 * kernels/cuda/step.cu and step_wg.cu) against the CPU reference, one case of the table at a
 * time: two steps (four where captured in a CUDA graph and replayed) that alternate each env's
 * two table rows, then the output, the state tables and the states each row started from
 * (gpu_check.h has the method).
 *
 *   test_step_cuda [--quick]    --quick: one case per step kernel (for compute-sanitizer runs)
 */
#include "gpu_check.h"

#include "cuda_backend.h"
#include "tuning.h"

#include <cuda_runtime_api.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct step_case {
    enum rnnd_cell cell;
    enum rnnd_compute compute;
    int I, H, L, B, S;
    bool init_null; // is_init NULL (all false)
    bool graph;     // capture two steps in a CUDA graph and replay it twice
    bool feed;      // I == H: every other step's x is the out of the step before (early_x)
    int variant;    // variant bits added to the base variant for the case (tuning.h)
    bool quick;     // also in --quick
    bool derived;   // the weights' derived copy given (step16.cu's GEMM for many rows, H >= 512)
    float x_scale;  // x uniform in [-x_scale, x_scale] (0: 1)
};

static void test_step(struct rnnd_backend *gpu, struct rnnd_backend *cpu,
                      const struct step_case *sc) {
    const bool feed = sc->feed;
    const struct rnnd_model m = {
        .cell = sc->cell, .compute = sc->compute, .I = sc->I, .H = sc->H, .L = sc->L};
    bool lstm = sc->cell == RNND_CELL_LSTM;
    // Two rows per env as the daemon keeps them, s and s + S (struct rnnd_step): row b of the
    // first step reads rows[b] and writes rows[B + b], the next step goes back, and so on.
    size_t P = rnnd_model_param_count(&m), tab = 2 * (size_t)sc->S * sc->L * sc->H;
    size_t blh = (size_t)sc->B * sc->L * sc->H, nx = (size_t)sc->B * sc->I;
    size_t nout = (size_t)sc->B * sc->H;
    int nstep = sc->graph ? 4 : 2;
    char tag[96];
    snprintf(tag, sizeof(tag), "step %s %s I%d H%d L%d B%d S%d%s%s%s", lstm ? "lstm" : "gru",
             compute_name(sc->compute), sc->I, sc->H, sc->L, sc->B, sc->S,
             sc->init_null ? " noinit" : "", sc->graph ? " graph" : "", feed ? " feed" : "");
    if (sc->derived)
        snprintf(tag + strlen(tag), sizeof(tag) - strlen(tag), " derived");
    if (sc->x_scale)
        snprintf(tag + strlen(tag), sizeof(tag) - strlen(tag), " x*%g", sc->x_scale);
    if (sc->variant)
        snprintf(tag + strlen(tag), sizeof(tag) - strlen(tag), " v%d", sc->variant);
    printf("%s\n", tag);
    gpu_seed(tag);
    if (rnnd_cuda_set_variant(gpu, gpu_base_variant | sc->variant) != 0) {
        fail("%s: variant %d not accepted", tag, gpu_base_variant | sc->variant);
        return;
    }

    float *params = xmalloc(P * 4);
    rnnd_model_init_params(&m, rng_next(), params);
    float *x = host_uniform(nx, sc->x_scale ? sc->x_scale : 1.0f);
    float *sh = host_uniform(tab, 0.9f), *sc_ = host_uniform(tab, 0.9f);
    uint8_t *init = xmalloc(sc->B);
    int32_t *rows = xmalloc(2 * sc->B * sizeof(int32_t));
    int32_t *perm = xmalloc(sc->S * sizeof(int32_t));
    for (int i = 0; i < sc->S; i++)
        perm[i] = i;
    for (int i = sc->S - 1; i > 0; i--) {
        int j = (int)(rng_next() % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int b = 0; b < sc->B; b++) {
        init[b] = rng_uniform() < 0.3;
        int half = rng_uniform() < 0.5 ? sc->S : 0; // envs start in either row
        rows[b] = perm[b] + half;
        rows[sc->B + b] = perm[b] + (sc->S - half);
    }

    float *res[2][6];
    float *fed_out[2] = {NULL, NULL}; // feed: the last step's out
    struct rnnd_backend *bes[2] = {gpu, cpu};
    int errs[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        struct rnnd_backend *be = bes[k];
        struct bufs b = {.be = be};
        struct rnnd_step st = {.B = sc->B}, back;
        st.x = dev(&b, x, nx * 4);
        st.is_init = sc->init_null ? NULL : dev(&b, init, sc->B);
        const int32_t *drows = dev(&b, rows, 2 * sc->B * sizeof(int32_t));
        st.slots = drows, st.slots_new = drows + sc->B;
        st.state_h = dev(&b, sh, tab * 4);
        st.state_c = lstm ? dev(&b, sc_, tab * 4) : NULL;
        st.out = dev_poison(&b, nout, k == 0);
        st.h_before = dev_poison(&b, blh, k == 0);
        st.c_before = lstm ? dev_poison(&b, blh, k == 0) : NULL;
        float *dparams = dev(&b, params, P * 4);
        if (k == 0 && sc->derived) {
            size_t dbytes = be->ops->derived_bytes(be->ctx, &m);
            if (dbytes == 0)
                fail("%s: no derived copy for this model", tag);
            st.derived = dbytes ? dev_poison(&b, dbytes / 4, false) : NULL;
            if (st.derived && be->ops->derive(be->ctx, (void *)st.derived, dparams, &m) != 0)
                fail("%s: derive failed", tag);
        }
        back = st, back.slots = st.slots_new, back.slots_new = st.slots;
        if (feed)
            back.x = st.out, back.out = dev_poison(&b, nout, k == 0);
        if (k == 0 && sc->graph) {
            cudaStream_t s = (cudaStream_t)rnnd_cuda_stream(be);
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
                errs[k] = RNND_EDEVICE;
            } else {
                errs[k] = be->ops->rnn_step(be->ctx, &st, dparams, &m);
                if (!errs[k])
                    errs[k] = be->ops->rnn_step(be->ctx, &back, dparams, &m);
                if (cudaStreamEndCapture(s, &graph) != cudaSuccess)
                    errs[k] = RNND_EDEVICE;
                else if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
                    errs[k] = RNND_EDEVICE;
                else {
                    for (int r = 0; r < nstep / 2 && !errs[k]; r++)
                        if (cudaGraphLaunch(exec, s) != cudaSuccess)
                            errs[k] = RNND_EDEVICE;
                    cudaGraphExecDestroy(exec);
                    cudaGraphDestroy(graph);
                }
            }
        } else {
            for (int r = 0; r < nstep && !errs[k]; r++)
                errs[k] = be->ops->rnn_step(be->ctx, r % 2 ? &back : &st, dparams, &m);
        }
        res[k][0] = xmalloc(nout * 4), res[k][1] = xmalloc(tab * 4), res[k][2] = xmalloc(tab * 4);
        res[k][3] = xmalloc(blh * 4), res[k][4] = xmalloc(blh * 4);
        if (!errs[k]) {
            to_host(be, res[k][0], st.out, nout);
            if (feed) {
                fed_out[k] = xmalloc(nout * 4);
                to_host(be, fed_out[k], back.out, nout);
            }
            to_host(be, res[k][1], st.state_h, tab);
            if (lstm)
                to_host(be, res[k][2], st.state_c, tab);
            to_host(be, res[k][3], st.h_before, blh);
            if (lstm)
                to_host(be, res[k][4], st.c_before, blh);
        }
        bufs_free(&b);
    }
    if (errs[0] || errs[1]) {
        fail("%s: cuda %s, cpu %s", tag, rnnd_err_name(errs[0]), rnnd_err_name(errs[1]));
    } else {
        double tol = tolerance(sc->compute);
        compare("out", tag, res[0][0], res[1][0], NULL, nout, tol);
        if (feed)
            compare("fed step's out", tag, fed_out[0], fed_out[1], NULL, nout, tol);
        compare("state h", tag, res[0][1], res[1][1], NULL, tab, tol);
        compare("h before", tag, res[0][3], res[1][3], NULL, blh, tol);
        if (lstm) {
            compare("state c", tag, res[0][2], res[1][2], NULL, tab, tol);
            compare("c before", tag, res[0][4], res[1][4], NULL, blh, tol);
        }
    }
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 5; i++)
            free(res[k][i]);
        free(fed_out[k]);
    }
    free(params), free(x), free(sh), free(sc_), free(init), free(rows), free(perm);
    rnnd_cuda_set_variant(gpu, gpu_base_variant);
}

static const enum rnnd_cell GRU = RNND_CELL_GRU, LSTM = RNND_CELL_LSTM;
static const enum rnnd_compute F32 = RNND_COMPUTE_FP32, IEEE = RNND_COMPUTE_IEEE,
                               BF16 = RNND_COMPUTE_BF16;
static const int NO_WG = RNND_TUNE_NO_WG, STEP_LAYERS_APART = RNND_TUNE_STEP_LAYERS_APART,
                 GEMM16 = RNND_TUNE_STEP_GEMM16;

// cell, compute, I, H, L, B, S, init_null, graph, feed, variant, quick, derived, x_scale.
static const struct step_case step_cases[] = {
    // Both kernels (dot products up to 8 rows) and every tile shape (16 x 8, 32 x 16, 64 x 32
    // from ~1000 rows at H=256; TF32 on Hopper: the 64 x 32 tiles on warpgroup MMAs from 9 rows
    // where widths are multiples of 4), odd widths (4-byte copies), several layers, grids of
    // several waves (H=1024 LSTM: 320 blocks of 64 x 32 at 600 rows). --quick: the first five,
    // one per step kernel (tiles at one and two layers, few rows, one row, the 64 x 32 tiles at
    // B = 1024; on Hopper the first two on warpgroup MMAs too).
    {GRU, F32, 64, 128, 1, 17, 50, false, false, false, 0, true, false, 0},
    {LSTM, F32, 64, 128, 2, 33, 40, false, true, false, 0, true, false, 0},
    {LSTM, IEEE, 3, 7, 3, 5, 9, false, false, false, 0, true, false, 0},
    {GRU, F32, 256, 256, 1, 1, 7, false, true, false, 0, true, false, 0},
    {GRU, F32, 256, 256, 1, 1024, 4096, false, true, false, 0, true, false, 0},
    {GRU, BF16, 64, 96, 2, 9, 12, true, false, false, 0, false, false, 0},
    {GRU, IEEE, 64, 256, 1, 1, 3, false, true, false, 0, false, false, 0},
    {LSTM, F32, 64, 1024, 1, 6, 7, false, false, false, 0, false, false, 0},
    {GRU, F32, 256, 256, 1, 8, 40, false, true, false, 0, false, false, 0},
    {LSTM, F32, 256, 256, 1, 1024, 3000, false, false, false, 0, false, false, 0},
    {GRU, BF16, 256, 256, 2, 1024, 2048, false, false, false, 0, false, false, 0},
    {LSTM, BF16, 64, 128, 2, 1, 5, false, false, false, 0, false, false, 0},
    {GRU, IEEE, 256, 256, 2, 300, 1000, false, false, false, 0, false, false, 0},
    {LSTM, IEEE, 64, 256, 1, 700, 701, true, false, false, 0, false, false, 0},
    {GRU, F32, 5, 7, 3, 1030, 1100, false, true, false, 0, false, false, 0},
    {LSTM, F32, 33, 130, 4, 257, 600, false, false, false, 0, false, false, 0},
    {GRU, F32, 64, 512, 2, 200, 256, false, false, false, 0, false, false, 0},
    {LSTM, F32, 64, 1024, 1, 600, 1200, false, true, false, 0, false, false, 0},
    // The tile kernel on warpgroup MMAs (TF32 on Hopper) at widths that are not multiples of
    // its 32-column chunks or 32-unit slices, partial last row tiles, two layers.
    {GRU, F32, 36, 100, 2, 2000, 2100, false, false, false, 0, false, false, 0},
    {LSTM, F32, 20, 132, 1, 1100, 1200, true, false, false, 0, false, false, 0},
    // Two waves of its blocks (256 on an H100), in a graph: a block of the second wave finds
    // the first one's mbarriers in its shared memory (they must be set up before use).
    {GRU, F32, 256, 256, 1, 2048, 2100, false, true, false, 0, false, false, 0},
    // On Hopper TF32's 64 x 32 tiles run on warpgroup MMAs: their mma.sync kernel (NO_WG) at
    // B = 1024 and in the odd-width case, where it still runs elsewhere.
    {GRU, F32, 256, 256, 1, 1024, 4096, false, true, false, NO_WG, false, false, 0},
    {GRU, F32, 36, 100, 2, 2000, 2100, false, false, false, NO_WG, false, false, 0},
    // The step kernels read layer 0's x before their programmatic wait where the step before
    // wrote none of it (every case's later steps above, in graphs too); here every other step's
    // x is the out of the step before, which they must not read early (a stale or poisoned x
    // would miss the tolerance by orders of magnitude).
    {GRU, F32, 256, 256, 1, 1024, 2048, false, false, true, 0, false, false, 0},
    {LSTM, F32, 128, 128, 2, 600, 700, false, false, true, 0, false, false, 0},
    // One row's layers in one launch where the steps are not recorded (a launch a layer where
    // they are: the graph cases), meeting at a grid barrier between layers: two layers, four fed
    // from the step before, 515 blocks (several an SM), five (a launch a layer: more than the
    // kernel takes), and the launch a layer forced.
    {GRU, F32, 64, 128, 2, 1, 9, false, false, false, 0, true, false, 0},
    {LSTM, F32, 128, 128, 4, 1, 6, false, false, true, 0, false, false, 0},
    {GRU, IEEE, 37, 1030, 3, 1, 5, true, false, false, 0, false, false, 0},
    {LSTM, BF16, 64, 128, 5, 1, 4, false, false, false, 0, false, false, 0},
    {GRU, F32, 64, 128, 3, 1, 5, false, true, false, 0, false, false, 0},
    {LSTM, F32, 64, 128, 2, 1, 5, false, false, false, STEP_LAYERS_APART, false, false, 0},
    // The warpgroup tiles fill all 4 stages before their first MMA and refill a stage 3 chunks
    // ahead: fewer chunks than stages (3), as many (4, both layers), one more (5, in a graph).
    {GRU, F32, 32, 64, 1, 1024, 1100, false, false, false, 0, false, false, 0},
    {LSTM, F32, 64, 64, 2, 1024, 1100, false, false, false, 0, false, false, 0},
    {GRU, F32, 32, 128, 1, 600, 700, false, true, false, 0, false, false, 0},
    // step16.cu's GEMM on the derived fp16 copy: where the rule takes it (LSTM H = 1024 at 1024
    // rows, GRU H = 1024 at 512; the first grows the scratch, so that the graph cases after it
    // may take the path inside their recording), and forced (GEMM16) for both cells at two
    // layers, bf16 mode, x fed from the step before, a width past the tensor cores' 8 (I = 37:
    // zero columns), x far below fp16's normal range (each row's power), and 9 rows.
    {LSTM, F32, 512, 1024, 1, 1024, 1100, false, false, false, 0, false, true, 0},
    {GRU, BF16, 128, 1024, 1, 512, 600, false, false, false, 0, false, true, 0},
    {GRU, F32, 512, 512, 2, 600, 700, false, true, false, GEMM16, false, true, 0},
    {LSTM, BF16, 64, 512, 1, 300, 301, true, false, false, GEMM16, false, true, 0},
    {GRU, F32, 512, 512, 1, 256, 600, false, false, true, GEMM16, false, true, 0},
    {LSTM, F32, 37, 512, 2, 257, 300, false, true, false, GEMM16, false, true, 0},
    {LSTM, F32, 64, 512, 1, 400, 500, false, false, false, GEMM16, false, true, 1e-6f},
    {GRU, F32, 64, 512, 2, 9, 20, false, false, false, GEMM16, false, true, 0},
};

// derive refuses what it cannot use with RNND_EINVAL and enqueues nothing; models whose steps
// never take step16.cu's path (ieee mode, H < 512) have no derived copy.
static void test_derive_refusals(struct rnnd_backend *gpu) {
    const struct rnnd_model m = {
        .cell = RNND_CELL_LSTM, .compute = RNND_COMPUTE_FP32, .I = 64, .H = 512, .L = 1};
    struct rnnd_model ieee = m, small = m, bad = m;
    ieee.compute = RNND_COMPUTE_IEEE, small.H = 256, bad.L = 0;
    const struct rnnd_backend_ops *o = gpu->ops;
    struct bufs b = {.be = gpu};
    float *d = dev_poison(&b, o->derived_bytes(gpu->ctx, &m) / 4, false);
    float *p = dev_poison(&b, rnnd_model_param_count(&m), false);
    printf("derive refusals\n");
    if (o->derived_bytes(gpu->ctx, &m) == 0 || o->derived_bytes(gpu->ctx, &ieee) != 0 ||
        o->derived_bytes(gpu->ctx, &small) != 0 || o->derived_bytes(gpu->ctx, &bad) != 0)
        fail("derived_bytes: %zu, ieee %zu, H 256 %zu, invalid %zu", o->derived_bytes(gpu->ctx, &m),
             o->derived_bytes(gpu->ctx, &ieee), o->derived_bytes(gpu->ctx, &small),
             o->derived_bytes(gpu->ctx, &bad));
    if (o->derive(gpu->ctx, NULL, p, &m) != RNND_EINVAL ||
        o->derive(gpu->ctx, d, NULL, &m) != RNND_EINVAL ||
        o->derive(gpu->ctx, d, p, &bad) != RNND_EINVAL || o->derive(gpu->ctx, d, p, &m) != 0)
        fail("derive: bad arguments not refused with RNND_EINVAL, or good ones refused");
    bufs_free(&b);
}

int main(int argc, char **argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    struct rnnd_backend gpu = {0}, cpu = {0};
    gpu_check_open(&gpu, &cpu);
    for (size_t i = 0; i < sizeof(step_cases) / sizeof(step_cases[0]); i++)
        if (!quick || step_cases[i].quick)
            test_step(&gpu, &cpu, &step_cases[i]);
    if (!quick)
        test_derive_refusals(&gpu);
    return gpu_check_close(&gpu, &cpu);
}
