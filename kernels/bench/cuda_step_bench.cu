/*
 * cuda_step_bench.cu: rnnd-kernel-bench --op step on the CUDA backend (bench.h's
 * rnnd_bench_cuda_step): the single-step op (rnn_step) as the daemon runs it.
 *
 * For one case (cell, compute, B, I, H, L, reset probability): weights as PyTorch initialises
 * them, x uniform in [-1, 1], a state table of S = 4B rows (uniform in [-1, 1]), the B rows'
 * table rows and the rows their new states go to (struct rnnd_step: slots, slots_new) 2B
 * distinct rows of a random permutation of the table's, is_init set with probability p. Then:
 *   1. validation: one step on the CPU reference and on CUDA from the same table; out_err is
 *      ||out - ref|| / ||ref||, grad_err the same over the whole state table (h, and c);
 *   2. step_us: CUDA events around `launches` back-to-back rnn_step calls on the backend's
 *      stream (each reads the rows the one before wrote, as the daemon's steps do), per step,
 *      median of `repeat` after `warmup`; host_us: the host clock around the same `launches`
 *      calls (the enqueues only, no synchronisation), per call: when it is close to step_us, the
 *      back-to-back figure is set by the host's launch rate, not by the device;
 *   3. graph_us: one rnn_step captured in a CUDA graph, replayed `launches` times between events,
 *      per replay (what a caller that replays a captured step pays); gpu_us: `launches` steps
 *      captured in one graph, replayed once, per step: the device's own time per step, with no
 *      host launch cost in it (step_us - gpu_us is what launching costs on this host);
 *   4. call_us: a host clock around the whole backend call of the daemon's engine: one copy_in
 *      of x, both row lists and is_init from page-locked memory, rnn_step, copy_out of out (which
 *      synchronises), median over `launches` calls.
 * Figures go to res->step_us, graph_us, call_us; res->extra gets the launch count, slots,
 * host_us and the SM clock. RNND_CUDA_VARIANT (bench only) sets the backend's variant bits
 * (docs/journal).
 */
#include "bench.h"
#include "cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <vector>

#define STEP_LAUNCHES 200 // launches (or replays, or calls) per timed repeat

static uint64_t step_rng(uint64_t *s) { // splitmix64
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double step_uniform(uint64_t *s) {
    return (double)(step_rng(s) >> 11) * 0x1.0p-53;
}

static double step_median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double step_rel_err(const std::vector<float> &a, const std::vector<float> &ref) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < a.size(); i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

// Spins one warp for `cycles` SM clocks: timed with events, it gives the SM clock right after
// the timed loops (small grids may not bring the GPU to its boost clock).
static __global__ void step_spin_kernel(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

static double host_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// Inputs of a case in one backend's memory; the table starts from the host copy.
struct step_bufs {
    struct rnnd_backend *be;
    float *params, *x, *state_h, *state_c, *out;
    int32_t *slots; // (2B): the rows of one step, then the rows it writes
    uint8_t *init;
    void *derived; // what derive makes from params (NULL where the backend derives nothing)
};

struct step_host {
    std::vector<float> params, x, state_h, state_c;
    std::vector<int32_t> slots; // (2B): as step_bufs.slots
    std::vector<uint8_t> init;
};

static void step_bufs_free(struct step_bufs *b) {
    void *p[] = {b->params, b->x, b->state_h, b->state_c, b->out, b->slots, b->init, b->derived};
    for (void *q : p)
        b->be->ops->free(b->be->ctx, q);
}

static int step_bufs_init(struct step_bufs *b, struct rnnd_backend *be, const struct step_host *h,
                          const struct bench_case *bc) {
    const struct rnnd_backend_ops *o = be->ops;
    bool lstm = bc->model.cell == RNND_CELL_LSTM;
    memset(b, 0, sizeof(*b));
    b->be = be;
    int err = 0;
    auto put = [&](void **dst, const void *src, size_t bytes) {
        if (!err)
            err = o->alloc(be->ctx, bytes, dst);
        if (!err && src)
            err = o->copy_in(be->ctx, *dst, src, bytes);
    };
    put((void **)&b->params, h->params.data(), h->params.size() * 4);
    put((void **)&b->x, h->x.data(), h->x.size() * 4);
    put((void **)&b->state_h, h->state_h.data(), h->state_h.size() * 4);
    if (lstm)
        put((void **)&b->state_c, h->state_c.data(), h->state_c.size() * 4);
    put((void **)&b->out, NULL, (size_t)bc->B * bc->model.H * 4);
    put((void **)&b->slots, h->slots.data(), h->slots.size() * 4);
    put((void **)&b->init, h->init.data(), h->init.size());
    // The derived copy as the daemon keeps it with its weights (struct rnnd_step.derived).
    const size_t dbytes = o->derived_bytes ? o->derived_bytes(be->ctx, &bc->model) : 0;
    if (dbytes)
        put(&b->derived, NULL, dbytes);
    if (!err && dbytes)
        err = o->derive(be->ctx, b->derived, b->params, &bc->model);
    if (!err)
        err = o->sync(be->ctx);
    return err;
}

// A step from the rows in slots[0, B) to those in slots[B, 2B), or back (flip).
static struct rnnd_step step_of(const struct step_bufs *b, int B, bool flip) {
    struct rnnd_step st = {};
    st.B = B, st.x = b->x, st.is_init = b->init;
    st.slots = b->slots + (flip ? B : 0), st.slots_new = b->slots + (flip ? 0 : B);
    st.state_h = b->state_h, st.state_c = b->state_c, st.out = b->out;
    st.derived = b->derived;
    return st;
}

// One step on be from the host table; out and the new table back to the host.
static int step_once(struct rnnd_backend *be, const struct step_host *h,
                     const struct bench_case *bc, std::vector<float> &out,
                     std::vector<float> &table) {
    struct step_bufs b;
    int err = step_bufs_init(&b, be, h, bc);
    struct rnnd_step st = step_of(&b, bc->B, false);
    size_t tab = h->state_h.size();
    out.resize((size_t)bc->B * bc->model.H);
    table.resize(b.state_c ? 2 * tab : tab);
    if (!err)
        err = be->ops->rnn_step(be->ctx, &st, b.params, &bc->model);
    if (!err)
        err = be->ops->copy_out(be->ctx, out.data(), b.out, out.size() * 4);
    if (!err)
        err = be->ops->copy_out(be->ctx, table.data(), b.state_h, tab * 4);
    if (!err && b.state_c)
        err = be->ops->copy_out(be->ctx, table.data() + tab, b.state_c, tab * 4);
    step_bufs_free(&b);
    return err;
}

static int step_timings(struct rnnd_backend *be, const struct step_host *h,
                        const struct bench_case *bc, struct bench_result *res, double *enq_us) {
    const struct rnnd_model *m = &bc->model;
    const struct rnnd_backend_ops *o = be->ops;
    cudaStream_t s = (cudaStream_t)rnnd_cuda_stream(be);
    struct step_bufs b;
    int err = step_bufs_init(&b, be, h, bc);
    struct rnnd_step st[2] = {step_of(&b, bc->B, false), step_of(&b, bc->B, true)};
    int k_step = 0; // steps so far: the next one reads what the last one wrote
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    // Per step, between events: `calls` calls of launch() that run STEP_LAUNCHES steps in all;
    // the median over the repeats into *us (and the host's enqueue time per step into *host).
    auto events_us = [&](auto launch, int calls, double *us, double *host) {
        std::vector<double> v, vh;
        for (int i = -bc->warmup; i < bc->repeat && !err; i++) {
            cudaEventRecord(e0, s);
            const double t0 = host_us();
            for (int k = 0; k < calls && !err; k++)
                err = launch();
            if (i >= 0)
                vh.push_back((host_us() - t0) / STEP_LAUNCHES);
            cudaEventRecord(e1, s);
            if (cudaEventSynchronize(e1) != cudaSuccess)
                err = RNND_EDEVICE;
            float ms = 0.0f;
            cudaEventElapsedTime(&ms, e0, e1);
            if (i >= 0)
                v.push_back(1e3 * ms / STEP_LAUNCHES);
        }
        if (!err)
            *us = step_median(v);
        if (!err && host)
            *host = step_median(vh);
    };
    auto step = [&] { return o->rnn_step(be->ctx, &st[k_step++ % 2], b.params, m); };
    if (!err)
        events_us(step, STEP_LAUNCHES, &res->step_us, enq_us);

    // n steps captured in one graph, replayed: one step (what a caller that replays a captured
    // step pays) and STEP_LAUNCHES steps (the device's own time).
    auto graph_us = [&](int n, double *us) {
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        if (!err && cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
            err = RNND_EDEVICE;
        if (!err) {
            int e = 0;
            for (int k = 0; k < n && !e; k++)
                e = step();
            if (cudaStreamEndCapture(s, &graph) != cudaSuccess || e != 0 ||
                cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
                err = e ? e : RNND_EDEVICE;
        }
        if (!err)
            events_us([&] { return cudaGraphLaunch(exec, s) == cudaSuccess ? 0 : RNND_EDEVICE; },
                      STEP_LAUNCHES / n, us, nullptr);
        if (exec)
            cudaGraphExecDestroy(exec);
        if (graph)
            cudaGraphDestroy(graph);
    };
    graph_us(1, &res->graph_us);
    graph_us(STEP_LAUNCHES, &res->gpu_us);

    if (!err) {
        const long long cycles = 4000000;
        cudaEventRecord(e0, s);
        step_spin_kernel<<<1, 32, 0, s>>>(cycles);
        cudaEventRecord(e1, s);
        float ms = 0.0f;
        if (cudaEventSynchronize(e1) == cudaSuccess &&
            cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess)
            res->sm_mhz = cycles / (1e3 * ms);
    }

    // The engine's whole call: x, slots and is_init in one page-locked buffer, one copy each way.
    size_t nx = h->x.size() * 4, ns = h->slots.size() * 4, ni = h->init.size();
    size_t in_bytes = nx + ns + ni, out_bytes = (size_t)bc->B * m->H * 4;
    char *h_in = NULL, *h_out = NULL, *d_in = NULL;
    if (!err)
        err = o->host_alloc(be->ctx, in_bytes, (void **)&h_in);
    if (!err)
        err = o->host_alloc(be->ctx, out_bytes, (void **)&h_out);
    if (!err)
        err = o->alloc(be->ctx, in_bytes, (void **)&d_in);
    if (!err) {
        memcpy(h_in, h->x.data(), nx);
        memcpy(h_in + nx, h->slots.data(), ns);
        memcpy(h_in + nx + ns, h->init.data(), ni);
        const int32_t *rows = (const int32_t *)(d_in + nx);
        struct rnnd_step cs[2] = {st[0], st[0]};
        for (int f = 0; f < 2; f++) {
            cs[f].x = (const float *)d_in;
            cs[f].slots = rows + (f ? bc->B : 0), cs[f].slots_new = rows + (f ? 0 : bc->B);
            cs[f].is_init = (const uint8_t *)(d_in + nx + ns);
        }
        std::vector<double> v;
        for (int i = -bc->warmup * STEP_LAUNCHES; i < STEP_LAUNCHES && !err; i++) {
            double t0 = host_us();
            err = o->copy_in(be->ctx, d_in, h_in, in_bytes);
            if (!err)
                err = o->rnn_step(be->ctx, &cs[k_step++ % 2], b.params, m);
            if (!err)
                err = o->copy_out(be->ctx, h_out, b.out, out_bytes);
            if (i >= 0)
                v.push_back(host_us() - t0);
        }
        if (!err)
            res->call_us = step_median(v);
    }
    o->free(be->ctx, d_in);
    o->host_free(be->ctx, h_in);
    o->host_free(be->ctx, h_out);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    step_bufs_free(&b);
    return err;
}

extern "C" int rnnd_bench_cuda_step(const struct bench_case *bc, struct bench_result *res) {
    const struct rnnd_model *m = &bc->model;
    struct rnnd_backend gpu, cpu;
    int err = rnnd_backend_cuda_init(&gpu, bc->device);
    if (err) {
        fprintf(stderr, "cuda_step_bench: no CUDA backend on device %d: %s\n", bc->device,
                rnnd_strerror(err));
        return err;
    }
    snprintf(res->device, sizeof(res->device), "%s", gpu.device);
    const char *variant = getenv("RNND_CUDA_VARIANT");
    if (variant && *variant)
        rnnd_cuda_set_variant(&gpu, atoi(variant));
    err = rnnd_backend_cpu_init(&cpu);
    if (err) {
        rnnd_backend_free(&gpu);
        return err;
    }
    int S = 4 * bc->B;
    size_t tab = (size_t)S * m->L * m->H;
    uint64_t seed = bc->seed;
    struct step_host h;
    h.params.resize(rnnd_model_param_count(m));
    rnnd_model_init_params(m, bc->seed, h.params.data());
    h.x.resize((size_t)bc->B * m->I);
    h.state_h.resize(tab);
    h.state_c.resize(m->cell == RNND_CELL_LSTM ? tab : 0);
    for (float &v : h.x)
        v = (float)(2.0 * step_uniform(&seed) - 1.0);
    for (float &v : h.state_h)
        v = (float)(2.0 * step_uniform(&seed) - 1.0);
    for (float &v : h.state_c)
        v = (float)(2.0 * step_uniform(&seed) - 1.0);
    std::vector<int32_t> perm(S);
    for (int i = 0; i < S; i++)
        perm[i] = i;
    for (int i = S - 1; i > 0; i--)
        std::swap(perm[i], perm[step_rng(&seed) % (uint64_t)(i + 1)]);
    h.slots.assign(perm.begin(), perm.begin() + 2 * bc->B);
    h.init.resize(bc->B);
    for (uint8_t &v : h.init)
        v = step_uniform(&seed) < bc->reset_prob;

    std::vector<float> out, table, ref_out, ref_table;
    double enq_us = -1.0;
    err = step_once(&cpu, &h, bc, ref_out, ref_table);
    if (!err)
        err = step_once(&gpu, &h, bc, out, table);
    if (!err) {
        res->out_err = step_rel_err(out, ref_out);
        res->grad_err = step_rel_err(table, ref_table);
        err = step_timings(&gpu, &h, bc, res, &enq_us);
    }
    if (!err)
        snprintf(res->extra, sizeof(res->extra),
                 ",\"slots\":%d,\"launches\":%d,\"sm_mhz\":%.0f,\"host_us\":%.3f,\"variant\":%d", S,
                 STEP_LAUNCHES, res->sm_mhz, enq_us, variant && *variant ? atoi(variant) : 0);
    rnnd_backend_free(&cpu);
    rnnd_backend_free(&gpu);
    return err;
}
