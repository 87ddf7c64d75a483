/*
 * test_traj_cuda.c: the CUDA backend's data-plane ops against the CPU reference, bit for bit:
 * traj_write / traj_read (the trajectory store: rows scattered by the step path and gathered by
 * Forward over recorded steps and checkpoints) for GRU and LSTM, with and without extras, and
 * cast (the wire dtypes) over random values, every 16-bit pattern and the edge cases of rounding
 * (ties, subnormals, overflow to Inf; NaN only has to stay NaN); and copy_in / copy_out between
 * page-locked (host_alloc), pageable or registered (host_register: a shared memfd mapping, as a
 * shared-memory region's) memory and the device at every alignment, at the sizes around the
 * small copies' threshold (copied by a kernel) and above it (DMA); and mark / sync_mark, op by
 * op and in a replayed recording. Exits 77 (CTest: skipped) when no CUDA device is usable.
 */
#include "rnnd_kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int failures;

static uint64_t rng_state = 0x5eedull;
static uint64_t rng_next(void) { // splitmix64
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void check(bool ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "FAIL: %s\n", what);
        failures++;
    }
}

// Copies n bytes of host data into new backend memory.
static void *put(struct rnnd_backend *be, const void *host, size_t n) {
    void *p = NULL;
    if (be->ops->alloc(be->ctx, n ? n : 1, &p) != 0 || be->ops->copy_in(be->ctx, p, host, n) != 0)
        abort();
    return p;
}

static void get(struct rnnd_backend *be, void *host, const void *p, size_t n) {
    if (be->ops->copy_out(be->ctx, host, p, n) != 0)
        abort();
}

// ---------------------------------------------------------------------------------------------
// traj_write, traj_read

struct cols {
    float *obs, *extras, *h, *c;
    uint8_t *is_init;
    uint64_t *version;
};

// One backend's run: write n rows at rows_w, then read m rows at rows_r into out (host).
static void traj_run(struct rnnd_backend *be, const struct rnnd_model *m, int E, int64_t R,
                     const struct cols *in, const int32_t *rows_w, int n, const int32_t *rows_r,
                     int mr, struct cols *out) {
    size_t I = (size_t)m->I, LH = (size_t)m->L * (size_t)m->H, Ez = (size_t)E;
    bool lstm = m->cell == RNND_CELL_LSTM;
    struct rnnd_traj_store st = {.R = R, .E = E};
    void *block[6];
    size_t sz[6] = {R * I * 4, R * Ez * 4, R * LH * 4, R * LH * 4, (size_t)R, R * 8};
    for (int k = 0; k < 6; k++) {
        block[k] = NULL;
        if (be->ops->alloc(be->ctx, sz[k] ? sz[k] : 1, &block[k]) != 0 ||
            be->ops->zero(be->ctx, block[k], sz[k]) != 0)
            abort();
    }
    st.obs = block[0], st.extras = E ? block[1] : NULL, st.h = block[2];
    st.c = lstm ? block[3] : NULL, st.is_init = block[4], st.version = block[5];
    struct rnnd_traj_rows w = {.n = n,
                               .rows = put(be, rows_w, (size_t)n * 4),
                               .obs = put(be, in->obs, (size_t)n * I * 4),
                               .extras = E ? put(be, in->extras, (size_t)n * Ez * 4) : NULL,
                               .h = put(be, in->h, (size_t)n * LH * 4),
                               .c = lstm ? put(be, in->c, (size_t)n * LH * 4) : NULL,
                               .is_init = put(be, in->is_init, (size_t)n),
                               .version = put(be, in->version, (size_t)n * 8)};
    check(be->ops->traj_write(be->ctx, &st, &w, m) == 0, "traj_write");
    struct rnnd_traj_rows r = {.n = mr, .rows = put(be, rows_r, (size_t)mr * 4)};
    void *o[6];
    size_t osz[6] = {mr * I * 4, mr * Ez * 4, mr * LH * 4, mr * LH * 4, (size_t)mr, mr * 8u};
    for (int k = 0; k < 6; k++)
        if (be->ops->alloc(be->ctx, osz[k] ? osz[k] : 1, &o[k]) != 0)
            abort();
    r.obs = o[0], r.extras = E ? o[1] : NULL, r.h = o[2], r.c = lstm ? o[3] : NULL;
    r.is_init = o[4], r.version = o[5];
    check(be->ops->traj_read(be->ctx, &r, &st, m) == 0, "traj_read");
    get(be, out->obs, o[0], osz[0]);
    if (E)
        get(be, out->extras, o[1], osz[1]);
    get(be, out->h, o[2], osz[2]);
    if (lstm)
        get(be, out->c, o[3], osz[3]);
    get(be, out->is_init, o[4], osz[4]);
    get(be, out->version, o[5], osz[5]);
    void *all[] = {(void *)w.rows, w.obs, w.extras, w.h, w.c, w.is_init, w.version, (void *)r.rows};
    for (size_t k = 0; k < sizeof(all) / sizeof(all[0]); k++)
        be->ops->free(be->ctx, all[k]);
    for (int k = 0; k < 6; k++) {
        be->ops->free(be->ctx, o[k]);
        be->ops->free(be->ctx, block[k]);
    }
}

static void test_traj(struct rnnd_backend *gpu, struct rnnd_backend *cpu, enum rnnd_cell cell,
                      int E) {
    struct rnnd_model m = {.cell = cell, .compute = RNND_COMPUTE_FP32, .I = 37, .H = 45, .L = 2};
    enum { SLOTS = 50, CAP = 13, N = 300, M = 500 };
    int64_t R = SLOTS * CAP;
    size_t I = 37, LH = 90;
    struct cols in, a, b;
    struct cols *all[] = {&in, &a, &b};
    for (int k = 0; k < 3; k++) {
        size_t n = k == 0 ? N : M;
        all[k]->obs = calloc(n * I, 4);
        all[k]->extras = calloc(n * (size_t)(E ? E : 1), 4);
        all[k]->h = calloc(n * LH, 4);
        all[k]->c = calloc(n * LH, 4);
        all[k]->is_init = calloc(n, 1);
        all[k]->version = calloc(n, 8);
    }
    for (size_t i = 0; i < N * I; i++)
        in.obs[i] = (float)(rng_next() >> 40) / 1000.0f - 8000.0f;
    for (size_t i = 0; i < N * (size_t)E; i++)
        in.extras[i] = (float)(rng_next() % 1000);
    for (size_t i = 0; i < N * LH; i++) {
        in.h[i] = (float)(int64_t)(rng_next() % 2001 - 1000) / 7.0f;
        in.c[i] = -in.h[i];
    }
    for (int i = 0; i < N; i++) {
        in.is_init[i] = rng_next() & 1;
        in.version[i] = rng_next();
    }
    // Distinct rows to write (a shuffled prefix of the store), rows to read (any, repeats too).
    int32_t *perm = malloc((size_t)R * 4), rows_r[M];
    for (int64_t i = 0; i < R; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = R - 1; i > 0; i--) {
        int64_t j = (int64_t)(rng_next() % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int i = 0; i < M; i++)
        rows_r[i] = perm[rng_next() % N];
    traj_run(cpu, &m, E, R, &in, perm, N, rows_r, M, &a);
    traj_run(gpu, &m, E, R, &in, perm, N, rows_r, M, &b);
    char what[96];
    snprintf(what, sizeof what, "traj %s E=%d: rows read back",
             cell == RNND_CELL_LSTM ? "lstm" : "gru", E);
    bool ok = memcmp(a.obs, b.obs, M * I * 4) == 0 && memcmp(a.h, b.h, M * LH * 4) == 0 &&
              memcmp(a.is_init, b.is_init, M) == 0 && memcmp(a.version, b.version, M * 8) == 0 &&
              (!E || memcmp(a.extras, b.extras, M * (size_t)E * 4) == 0) &&
              (cell != RNND_CELL_LSTM || memcmp(a.c, b.c, M * LH * 4) == 0);
    check(ok, what);
    for (int k = 0; k < 3; k++) {
        free(all[k]->obs);
        free(all[k]->extras);
        free(all[k]->h);
        free(all[k]->c);
        free(all[k]->is_init);
        free(all[k]->version);
    }
    free(perm);
}

// ---------------------------------------------------------------------------------------------
// cast

static bool nan16(uint16_t v, bool f16) {
    return f16 ? (v & 0x7c00u) == 0x7c00u && (v & 0x3ffu) : (v & 0x7f80u) == 0x7f80u && (v & 0x7fu);
}

static void test_cast(struct rnnd_backend *gpu) {
    enum { N = 1 << 20 };
    float *x = malloc(N * 4), *back_cpu = malloc(65536 * 4), *back_gpu = malloc(65536 * 4);
    uint16_t *cpu16 = malloc(N * 2), *gpu16 = malloc(N * 2), *pat = malloc(65536 * 2);
    const uint32_t edges[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x007fffffu, 0x00800000u,
                              0x33000000u, 0x33000001u, 0x337fffffu, 0x38800000u, 0x387fffffu,
                              0x477fefffu, 0x477ff000u, 0x477fffffu, 0x7f7fffffu, 0x7f800000u,
                              0xff800000u, 0x7fc00000u, 0x7f800001u, 0x3f808000u, 0x3f818000u,
                              0x3f800fffu, 0x3f801000u, 0x3f803000u, 0xc77ff000u};
    for (size_t i = 0; i < N; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i < sizeof(edges) / sizeof(edges[0]))
            u = edges[i];
        else if (i % 3 == 0) // values near the fp16 range, where its rounding happens
            u = (u & 0x807fffffu) | ((uint32_t)(100 + rng_next() % 60) << 23);
        memcpy(&x[i], &u, 4);
    }
    for (int f16 = 0; f16 < 2; f16++) {
        enum rnnd_ftype ft = f16 ? RNND_FTYPE_F16 : RNND_FTYPE_BF16;
        rnnd_cast_host(cpu16, ft, x, RNND_FTYPE_F32, N);
        void *dx = put(gpu, x, N * 4), *dy = NULL;
        if (gpu->ops->alloc(gpu->ctx, N * 2, &dy) != 0)
            abort();
        check(gpu->ops->cast(gpu->ctx, dy, ft, dx, RNND_FTYPE_F32, N) == 0, "cast f32 -> 16");
        get(gpu, gpu16, dy, N * 2);
        int bad = 0;
        for (size_t i = 0; i < N; i++) {
            bool same = cpu16[i] == gpu16[i] || (nan16(cpu16[i], f16) && nan16(gpu16[i], f16));
            if (!same && bad++ < 5)
                fprintf(stderr, "%s(%a = 0x%08x): cpu 0x%04x gpu 0x%04x\n", f16 ? "f16" : "bf16",
                        (double)x[i], *(uint32_t *)&x[i], cpu16[i], gpu16[i]);
        }
        check(bad == 0,
              f16 ? "cast f32 -> f16 matches the CPU" : "cast f32 -> bf16 matches the CPU");
        gpu->ops->free(gpu->ctx, dx);
        gpu->ops->free(gpu->ctx, dy);
        // Every 16-bit pattern back to fp32.
        for (int v = 0; v < 65536; v++)
            pat[v] = (uint16_t)v;
        rnnd_cast_host(back_cpu, RNND_FTYPE_F32, pat, ft, 65536);
        void *dp = put(gpu, pat, 65536 * 2), *df = NULL;
        if (gpu->ops->alloc(gpu->ctx, 65536 * 4, &df) != 0)
            abort();
        check(gpu->ops->cast(gpu->ctx, df, RNND_FTYPE_F32, dp, ft, 65536) == 0, "cast 16 -> f32");
        get(gpu, back_gpu, df, 65536 * 4);
        bad = 0;
        for (int v = 0; v < 65536; v++) {
            bool same = memcmp(&back_cpu[v], &back_gpu[v], 4) == 0 ||
                        (isnan(back_cpu[v]) && isnan(back_gpu[v]));
            if (!same && bad++ < 5)
                fprintf(stderr, "%s 0x%04x: cpu %a gpu %a\n", f16 ? "f16" : "bf16", v,
                        (double)back_cpu[v], (double)back_gpu[v]);
        }
        check(bad == 0,
              f16 ? "cast f16 -> f32 matches the CPU" : "cast bf16 -> f32 matches the CPU");
        gpu->ops->free(gpu->ctx, dp);
        gpu->ops->free(gpu->ctx, df);
    }
    free(x);
    free(back_cpu);
    free(back_gpu);
    free(cpu16);
    free(gpu16);
    free(pat);
}

// copy_in then copy_out of n bytes at host offset a and device offset b, from pageable memory,
// host_alloc's, or a shared mapping of a memfd (a shared-memory region's) made page-locked by
// host_register, against the bytes themselves; neither may touch the bytes next to its own.
static void test_copies(struct rnnd_backend *gpu) {
    enum { MAX = 20000, SHARED = 2 * (MAX + 64) };
    unsigned char *pin = NULL, *pout = NULL, *dev = NULL;
    unsigned char *heap_in = malloc(MAX + 64), *heap_out = malloc(MAX + 64);
    unsigned char *fill = malloc(MAX + 64), *whole = malloc(MAX + 64);
    int fd = memfd_create("test_copies", MFD_CLOEXEC);
    unsigned char *shared = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, SHARED) == 0)
        shared = mmap(NULL, SHARED, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (shared == MAP_FAILED || gpu->ops->host_alloc(gpu->ctx, MAX + 64, (void **)&pin) != 0 ||
        gpu->ops->host_alloc(gpu->ctx, MAX + 64, (void **)&pout) != 0 ||
        gpu->ops->alloc(gpu->ctx, MAX + 64, (void **)&dev) != 0)
        abort();
    check(gpu->ops->host_register(gpu->ctx, NULL, 64) == RNND_EINVAL,
          "host_register refuses no memory");
    check(gpu->ops->host_register(gpu->ctx, shared, SHARED) == 0,
          "host_register page-locks a shared mapping");
    const size_t sizes[] = {1, 3, 15, 16, 17, 255, 4096, 4097, 16383, 16384, 16385, MAX};
    static const char *const kinds[] = {"pageable", "page-locked", "registered"};
    int bad = 0;
    for (int kind = 0; kind < 3; kind++) {
        unsigned char *in = kind == 0 ? heap_in : kind == 1 ? pin : shared;
        unsigned char *out = kind == 0 ? heap_out : kind == 1 ? pout : shared + MAX + 64;
        for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++)
            for (size_t a = 0; a < 20; a += 3)
                for (size_t b = 0; b < 20; b += 5) {
                    size_t n = sizes[k];
                    for (size_t i = 0; i < MAX + 64; i++)
                        in[i] = (unsigned char)rng_next();
                    memset(out, 0xa5, MAX + 64);
                    memset(fill, 0x5a, MAX + 64);
                    if (gpu->ops->copy_in(gpu->ctx, dev, fill, MAX + 64) != 0 ||
                        gpu->ops->copy_in(gpu->ctx, dev + b, in + a, n) != 0 ||
                        gpu->ops->copy_out(gpu->ctx, out + a, dev + b, n) != 0)
                        abort();
                    // copy_out's n bytes, and nothing around them; then the device's whole
                    // buffer (one large copy): copy_in's n bytes, and nothing around them.
                    bool ok = memcmp(out + a, in + a, n) == 0;
                    for (size_t i = 0; ok && i < MAX + 64; i++)
                        ok = (i >= a && i < a + n) || out[i] == 0xa5;
                    get(gpu, whole, dev, MAX + 64);
                    ok = ok && memcmp(whole + b, in + a, n) == 0;
                    for (size_t i = 0; ok && i < MAX + 64; i++)
                        ok = (i >= b && i < b + n) || whole[i] == 0x5a;
                    if (!ok && bad++ < 5)
                        fprintf(stderr, "copy of %zu bytes, host +%zu, device +%zu, %s\n", n, a, b,
                                kinds[kind]);
                }
    }
    check(bad == 0, "copy_in / copy_out give the bytes back at every size and alignment");
    gpu->ops->host_unregister(gpu->ctx, shared);
    munmap(shared, SHARED);
    close(fd);
    gpu->ops->host_free(gpu->ctx, pin);
    gpu->ops->host_free(gpu->ctx, pout);
    gpu->ops->free(gpu->ctx, dev);
    free(heap_in);
    free(heap_out);
    free(fill);
    free(whole);
}

// ---------------------------------------------------------------------------------------------
// mark, sync_mark

// The work before the last mark is done when sync_mark returns (a Step's reply: its outputs'
// copy back, not the store write after it), enqueued op by op and replayed from a recording,
// where the mark must be a node that each replay records again. Ahead of the copy the mark
// covers, a zero of 256 MB (~0.1 ms), so that a sync_mark that did not wait would find the host
// buffer as it was; after the mark, another.
static void test_mark(struct rnnd_backend *gpu) {
    enum { BIG = 256 << 20, N = 4096 };
    const struct rnnd_backend_ops *ops = gpu->ops;
    unsigned char *big = NULL, *after = NULL, *dev = NULL, *host = NULL, *ones = malloc(N);
    if (ones == NULL || ops->alloc(gpu->ctx, BIG, (void **)&big) != 0 ||
        ops->alloc(gpu->ctx, BIG, (void **)&after) != 0 ||
        ops->alloc(gpu->ctx, N, (void **)&dev) != 0 ||
        ops->host_alloc(gpu->ctx, N, (void **)&host) != 0)
        abort();
    memset(ones, 1, N);
    void *unit = NULL;
    for (int pass = 0; pass < 2; pass++) { // 0: op by op; 1: recorded once, replayed thrice
        bool ok = true;
        for (int r = 0; r < (pass ? 3 : 1); r++) {
            // dev holds ones and host 0xa5 until the work, behind the big zero, zeroes both.
            memset(host, 0xa5, N);
            if (ops->copy_in(gpu->ctx, dev, ones, N) != 0 || ops->sync(gpu->ctx) != 0)
                abort();
            if (r == 0) {
                int rc = pass ? ops->record_begin(gpu->ctx) : 0;
                rc = rc ? rc : ops->zero(gpu->ctx, big, BIG);
                rc = rc ? rc : ops->zero(gpu->ctx, dev, N);
                rc = rc ? rc : ops->copy_out_async(gpu->ctx, host, dev, N);
                rc = rc ? rc : ops->mark(gpu->ctx);
                rc = rc ? rc : ops->zero(gpu->ctx, after, BIG);
                if (pass) {
                    int end = ops->record_end(gpu->ctx, &unit);
                    rc = rc ? rc : end;
                }
                check(rc == 0 && (!pass || unit), pass ? "mark in a recording" : "mark");
            }
            if (pass && unit && ops->replay(gpu->ctx, unit) != 0)
                abort();
            check(ops->sync_mark(gpu->ctx) == 0, "sync_mark");
            for (int i = 0; i < N; i++)
                ok = ok && host[i] == 0;
            if (ops->sync(gpu->ctx) != 0)
                abort();
        }
        check(ok, pass ? "sync_mark waits for the work before a replayed recording's mark"
                       : "sync_mark waits for the work before the mark");
    }
    ops->free_unit(gpu->ctx, unit);
    ops->free(gpu->ctx, big);
    ops->free(gpu->ctx, after);
    ops->free(gpu->ctx, dev);
    ops->host_free(gpu->ctx, host);
    free(ones);
}

int main(void) {
    struct rnnd_backend gpu, cpu;
    if (rnnd_backend_cuda_init(&gpu, 0) != 0) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
    if (rnnd_backend_cpu_init(&cpu) != 0)
        return 1;
    test_traj(&gpu, &cpu, RNND_CELL_GRU, 0);
    test_traj(&gpu, &cpu, RNND_CELL_LSTM, 3);
    test_cast(&gpu);
    test_copies(&gpu);
    test_mark(&gpu);
    check(cpu.ops->mark == NULL && cpu.ops->sync_mark == NULL,
          "the CPU backend's ops are done when they return: no marks");
    rnnd_backend_free(&gpu);
    rnnd_backend_free(&cpu);
    printf("%d failures\n", failures);
    return failures ? 1 : 0;
}
