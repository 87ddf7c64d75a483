/*
 * kernel_fixture.h: reader for the PyTorch reference files written by tests/fixtures/
 * gen_fixtures.py (format described at the top of that script), plus the comparison helpers the
 * kernel tests share. Header-only (static functions): each test binary includes it once.
 *
 * The directory comes from $RNND_FIXTURE_DIR, else from the RNND_FIXTURE_DIR compile definition
 * (the build tree's tests/fixtures, where CTest's `kernels_fixtures` setup test writes them).
 */
#ifndef RNND_KERNEL_FIXTURE_H
#define RNND_KERNEL_FIXTURE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FX_MAGIC       0x464e4452
#define FX_VERSION     1
#define FX_MAX_TENSORS 64

struct fx_tensor {
    char name[24];
    int count;
    double *data; // (count)
};

struct fx_case {
    int32_t meta[16];
    int ntensors;
    struct fx_tensor t[FX_MAX_TENSORS];
};

struct fx_file {
    int ncases;
    struct fx_case *cases;
};

static void fx_free(struct fx_file *f) {
    for (int c = 0; f->cases && c < f->ncases; c++)
        for (int k = 0; k < f->cases[c].ntensors; k++)
            free(f->cases[c].t[k].data);
    free(f->cases);
    memset(f, 0, sizeof(*f));
}

// Loads DIR/name, checking magic, version and kind. Returns 0, or -1 after printing why.
static int fx_load(const char *name, int kind, struct fx_file *f) {
    memset(f, 0, sizeof(*f));
    const char *dir = getenv("RNND_FIXTURE_DIR");
#ifdef RNND_FIXTURE_DIR
    if (dir == NULL)
        dir = RNND_FIXTURE_DIR;
#endif
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", dir ? dir : ".", name);
    FILE *fp = fopen(path, "rb");
    if (fp == NULL) {
        fprintf(stderr,
                "fixture %s: cannot open (run tests/fixtures/gen_fixtures.py, or ctest, "
                "which runs it as kernels_fixtures)\n",
                path);
        return -1;
    }
    int32_t hdr[8];
    if (fread(hdr, sizeof(hdr), 1, fp) != 1 || hdr[0] != FX_MAGIC || hdr[1] != FX_VERSION ||
        hdr[2] != kind || hdr[3] < 1) {
        fprintf(stderr, "fixture %s: bad header (magic, version %d expected, or kind)\n", path,
                FX_VERSION);
        fclose(fp);
        return -1;
    }
    f->ncases = hdr[3];
    f->cases = calloc((size_t)f->ncases, sizeof(struct fx_case));
    int ok = f->cases != NULL;
    for (int c = 0; ok && c < f->ncases; c++) {
        struct fx_case *fc = &f->cases[c];
        int32_t n;
        ok = fread(fc->meta, sizeof(fc->meta), 1, fp) == 1 && fread(&n, 4, 1, fp) == 1 && n >= 0 &&
             n <= FX_MAX_TENSORS;
        for (int k = 0; ok && k < n; k++) {
            struct fx_tensor *t = &fc->t[k];
            int32_t cnt[2];
            ok = fread(t->name, sizeof(t->name), 1, fp) == 1 && fread(cnt, 8, 1, fp) == 1 &&
                 cnt[0] >= 0;
            t->name[sizeof(t->name) - 1] = '\0';
            if (ok) {
                t->count = cnt[0];
                t->data = malloc((size_t)(t->count ? t->count : 1) * sizeof(double));
                ok = t->data &&
                     fread(t->data, sizeof(double), (size_t)t->count, fp) == (size_t)t->count;
                fc->ntensors = k + 1;
            }
        }
    }
    fclose(fp);
    if (!ok) {
        fprintf(stderr, "fixture %s: truncated or corrupt\n", path);
        fx_free(f);
        return -1;
    }
    return 0;
}

// The tensor called name, or NULL.
static const struct fx_tensor *fx_get(const struct fx_case *c, const char *name) {
    for (int k = 0; k < c->ntensors; k++)
        if (strcmp(c->t[k].name, name) == 0)
            return &c->t[k];
    return NULL;
}

// A new float copy of tensor name (free with free), or NULL when the case has none.
static float *fx_floats(const struct fx_case *c, const char *name) {
    const struct fx_tensor *t = fx_get(c, name);
    if (t == NULL)
        return NULL;
    float *p = malloc((size_t)(t->count ? t->count : 1) * sizeof(float));
    for (int i = 0; p && i < t->count; i++)
        p[i] = (float)t->data[i];
    return p;
}

// ||a - ref|| / ||ref|| (norm-wise relative error); the absolute ||a - ref|| when ref is zero.
static double fx_rel_err(const float *a, const double *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

#endif // RNND_KERNEL_FIXTURE_H
