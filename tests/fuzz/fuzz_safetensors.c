/*
 * fuzz_safetensors.c: libFuzzer target for the safetensors decoder (kernels/safetensors.c),
 * which reads every checkpoint part and every weights file (--weights, rnndctl weights import)
 * before anything else looks at them. The input is one file.
 *
 * A file the decoder accepts must keep its promises: every tensor's bytes lie inside the input
 * and match its shape and dtype (each is read, so ASan sees a stray one), names are unique, and
 * encoding the decoded file again and decoding that gives the same tensors and metadata. The
 * weights path (rnnd_st_decode_params) then runs on it for each model of fuzz_models.h. A
 * refusal must say why.
 *
 * Build: CC=clang cmake -DRNND_FUZZ=ON -DRNND_CUDA=OFF; seeds: fuzz_seeds OUT (OUT/safetensors).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_models.h"
#include "rnnd_safetensors.h"

static volatile uint8_t sink;
static void touch(const void *p, size_t n) {
    uint8_t s = 0;
    for (size_t i = 0; i < n; i++)
        s ^= ((const uint8_t *)p)[i];
    sink = s;
}

static void check_tensor(const struct rnnd_st_file *f, const struct rnnd_st_tensor *t,
                         const uint8_t *data, size_t size) {
    if (t->name == NULL || (unsigned)t->dtype > RNND_ST_BOOL || t->ndim < 0 ||
        t->ndim > RNND_ST_MAX_DIMS || rnnd_st_find(f, t->name) != t)
        abort();
    size_t count = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0)
            abort();
        count *= (size_t)t->shape[d]; // bounded by the bytes below, checked by the decoder
    }
    const uint8_t *p = t->data;
    if (count * rnnd_st_dtype_size(t->dtype) != t->bytes || p < data + 8 || p > data + size ||
        t->bytes > (size_t)(data + size - p))
        abort();
    touch(p, t->bytes);
}

// Encodes f again and checks that the result decodes to the same file.
static void check_round_trip(const struct rnnd_st_file *f) {
    void *buf;
    size_t len;
    int rc = rnnd_st_encode(f->tensors, f->n, (const char *const *)f->meta, f->n_meta, &buf, &len);
    if (rc != 0) {
        // The decoder takes an empty name, which the encoder refuses to write.
        bool empty = false;
        for (int i = 0; i < f->n; i++)
            empty |= f->tensors[i].name[0] == '\0';
        if (!(rc == RNND_EINVAL && empty) && rc != RNND_ENOMEM)
            abort();
        return;
    }
    struct rnnd_st_file g;
    char err[256];
    if (rnnd_st_decode(buf, len, &g, err, sizeof(err)) != 0 || g.n != f->n || g.n_meta != f->n_meta)
        abort();
    for (int i = 0; i < f->n; i++) {
        const struct rnnd_st_tensor *a = &f->tensors[i], *b = rnnd_st_find(&g, a->name);
        if (b == NULL || b->dtype != a->dtype || b->ndim != a->ndim || b->bytes != a->bytes ||
            memcmp(b->shape, a->shape, sizeof(a->shape[0]) * (size_t)a->ndim) != 0 ||
            (a->bytes && memcmp(b->data, a->data, a->bytes) != 0))
            abort();
    }
    for (int i = 0; i < 2 * f->n_meta; i++)
        if (strcmp(g.meta[i], f->meta[i]) != 0)
            abort();
    rnnd_st_file_free(&g);
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct rnnd_st_file f;
    char err[256] = "";
    int rc = rnnd_st_decode(data, size, &f, err, sizeof(err));
    if (rc != 0) {
        if ((rc != RNND_ECORRUPT && rc != RNND_ENOTSUP && rc != RNND_ENOMEM) || err[0] == '\0' ||
            f.n != 0 || f.tensors != NULL || f.meta != NULL)
            abort();
        return 0;
    }
    for (int i = 0; i < f.n; i++)
        check_tensor(&f, &f.tensors[i], data, size);
    for (int i = 0; i < f.n_meta; i++)
        if (f.meta[2 * i] == NULL || f.meta[2 * i + 1] == NULL ||
            rnnd_st_meta(&f, f.meta[2 * i]) == NULL)
            abort();
    check_round_trip(&f);
    // The weights path, as --weights and a checkpoint's model.safetensors take it.
    for (int k = 0; k < FUZZ_MODELS; k++) {
        size_t P = rnnd_model_param_count(&fuzz_models[k]);
        float *params = malloc(P * sizeof(float));
        err[0] = '\0';
        rc = rnnd_st_decode_params(&fuzz_models[k], &f, params, err, sizeof(err));
        if (rc == 0)
            touch(params, P * sizeof(float));
        else if (rc != RNND_EINVAL || err[0] == '\0')
            abort();
        free(params);
    }
    rnnd_st_file_free(&f);
    return 0;
}
