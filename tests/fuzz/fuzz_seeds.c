/*
 * fuzz_seeds.c: writes the seed corpora of fuzz_checkpoint, fuzz_safetensors and fuzz_http from
 * the code that writes the real thing, so that the seeds follow the formats as they change:
 *
 *   OUT/checkpoint/   for each model of fuzz_models.h: a full checkpoint (Adam, envs with
 *                     their states, recorded trajectories, extras on the LSTM), one with SGD and
 *                     no envs, and a PyTorch weights file alone; each written by
 *                     rnnd_checkpoint_write (or rnnd_st_encode_params) and packed as
 *                     fuzz_checkpoint.c reads it
 *   OUT/safetensors/  every .safetensors file of those checkpoints, and one of every dtype with
 *                     metadata and an empty tensor
 *   OUT/http/         requests: the probes', Prometheus's, and bad ones of each kind
 *
 * Usage: fuzz_seeds OUT (made if missing). Exit 0, or 1 with the reason on stderr.
 */
#include <errno.h>
#include <ftw.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "fuzz_models.h"
#include "rnnd_safetensors.h"

static int write_seed(const char *out, const char *sub, const char *name, const void *data,
                      size_t len) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", out, sub);
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return -1;
    snprintf(path, sizeof(path), "%s/%s/%s", out, sub, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return -1;
    bool ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static void *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

// ---------------------------------------------------------------------------------------------
// Packing a checkpoint directory: the regular files under it, by relative name, in name order.

#define MAX_FILES 64

static char walk_root[1024];
static char *walk_names[MAX_FILES];
static int walk_n;

static int walk_one(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st;
    (void)ftw;
    if (type == FTW_F && walk_n < MAX_FILES)
        walk_names[walk_n++] = strdup(path + strlen(walk_root) + 1);
    return 0;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

// Packs dir for model k into OUT/checkpoint/seed, and copies its safetensors files to
// OUT/safetensors/seed-FILE.
static int pack(const char *out, const char *dir, int k, const char *seed) {
    snprintf(walk_root, sizeof(walk_root), "%s", dir);
    walk_n = 0;
    if (nftw(dir, walk_one, 16, FTW_PHYS) != 0 || walk_n == 0)
        return -1;
    qsort(walk_names, (size_t)walk_n, sizeof(char *), name_cmp);
    size_t len = 1;
    uint8_t *buf = malloc(len);
    if (buf == NULL)
        return -1;
    buf[0] = (uint8_t)k;
    int rc = 0;
    for (int i = 0; i < walk_n; i++) {
        char path[2048];
        snprintf(path, sizeof(path), "%s/%s", dir, walk_names[i]);
        size_t n, nl = strlen(walk_names[i]);
        void *data = slurp(path, &n);
        uint8_t *more =
            data && nl <= 255 && n <= UINT32_MAX ? realloc(buf, len + 1 + nl + 4 + n) : NULL;
        if (more == NULL) {
            free(data);
            free(walk_names[i]);
            rc = -1;
            continue;
        }
        buf = more;
        buf[len++] = (uint8_t)nl;
        memcpy(buf + len, walk_names[i], nl);
        len += nl;
        for (int b = 0; b < 4; b++)
            buf[len++] = (uint8_t)(n >> (8 * b));
        memcpy(buf + len, data, n);
        len += n;
        const char *dot = strrchr(walk_names[i], '.');
        if (dot && strcmp(dot, ".safetensors") == 0) {
            char name[512];
            snprintf(name, sizeof(name), "%s-%s", seed, walk_names[i]);
            for (char *s = name; *s; s++)
                *s = *s == '/' ? '_' : *s;
            rc |= write_seed(out, "safetensors", name, data, n);
        }
        free(data);
        free(walk_names[i]);
    }
    rc |= write_seed(out, "checkpoint", seed, buf, len);
    free(buf);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

static float *floats(size_t n, float base) {
    float *v = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = base + 0.01f * (float)i;
    return v;
}

// Writes the two checkpoints and the weights file of model k.
static int checkpoints(const char *out, const char *state_dir, int k) {
    const struct rnnd_model *m = &fuzz_models[k];
    bool lstm = m->cell == RNND_CELL_LSTM;
    size_t P = rnnd_model_param_count(m), LH = (size_t)(m->L * m->H);
    enum { N = 3, R = 5 };
    int E = lstm ? 2 : 0;
    uint64_t ids[N] = {5, UINT64_MAX, 77}, last[N] = {3, 0, 99}, ver[R] = {40, 41, 42, 43, 44};
    uint8_t has[N] = {1, 0, 1}, init[R] = {1, 0, 0, 1, 0};
    int64_t count[N] = {2, 0, 3};
    float *params = floats(P, 0.5f), *ma = floats(P, -0.1f), *va = floats(P, 0.2f);
    float *h = floats(N * LH, 1), *c = floats(N * LH, -1), *lo = floats(N * (size_t)m->H, 2);
    float *tobs = floats(R * (size_t)m->I, 3), *tex = floats(R * (size_t)E, 4);
    float *th = floats(R * LH, 5), *tc = floats(R * LH, 6);
    struct rnnd_checkpoint full = {.model = *m,
                                   .P = P,
                                   .params = params,
                                   .model_version = 42,
                                   .optimizer = RNND_OPTIM_ADAM,
                                   .lr = 0.01f,
                                   .optim_step = 17,
                                   .exp_avg = ma,
                                   .exp_avg_sq = va,
                                   .n_envs = N,
                                   .env_ids = ids,
                                   .env_h = h,
                                   .env_c = lstm ? c : NULL,
                                   .last_index = last,
                                   .has_index = has,
                                   .last_output = lo,
                                   .traj_count = count,
                                   .traj_rows = R,
                                   .traj_obs = tobs,
                                   .traj_is_init = init,
                                   .traj_extras = E ? tex : NULL,
                                   .traj_version = ver,
                                   .traj_h = th,
                                   .traj_c = lstm ? tc : NULL,
                                   .extras_size = E,
                                   .seed = 7};
    struct rnnd_checkpoint bare = {.model = *m,
                                   .P = P,
                                   .params = params,
                                   .model_version = 3,
                                   .optimizer = RNND_OPTIM_SGD,
                                   .lr = 0.1f,
                                   .seed = 7};
    const struct {
        const char *name;
        const struct rnnd_checkpoint *ck;
    } kinds[] = {{"full", &full}, {"sgd-no-envs", &bare}};
    int rc = 0;
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        char name[64], dir[1024], err[512];
        snprintf(name, sizeof(name), "%s-%s", lstm ? "lstm" : "gru", kinds[i].name);
        if (rnnd_checkpoint_resolve(state_dir, name, kinds[i].ck->model_version, dir, sizeof(dir),
                                    err, sizeof(err)) != 0 ||
            rnnd_checkpoint_write(dir, kinds[i].ck, err, sizeof(err)) != 0) {
            fprintf(stderr, "fuzz_seeds: checkpoint %s: %s\n", name, err);
            rc = -1;
            continue;
        }
        // A seed the reader accepts, so that fuzzing starts past every check.
        struct rnnd_checkpoint_data back;
        if (rnnd_checkpoint_read(dir, m, &back, err, sizeof(err)) != 0) {
            fprintf(stderr, "fuzz_seeds: checkpoint %s does not read back: %s\n", name, err);
            rc = -1;
        }
        rnnd_checkpoint_data_free(&back);
        rc |= pack(out, dir, k, name);
    }
    // A model trained elsewhere: model.safetensors alone, as PyTorch users save it.
    void *st;
    size_t len;
    if (rnnd_st_encode_params(m, params, NULL, 0, &st, &len) == 0) {
        char name[64];
        snprintf(name, sizeof(name), "%s-weights", lstm ? "lstm" : "gru");
        size_t nl = strlen("model.safetensors");
        uint8_t *buf = malloc(1 + 1 + nl + 4 + len);
        buf[0] = (uint8_t)k;
        buf[1] = (uint8_t)nl;
        memcpy(buf + 2, "model.safetensors", nl);
        for (int b = 0; b < 4; b++)
            buf[2 + nl + b] = (uint8_t)(len >> (8 * b));
        memcpy(buf + 2 + nl + 4, st, len);
        rc |= write_seed(out, "checkpoint", name, buf, 2 + nl + 4 + len);
        snprintf(name, sizeof(name), "%s-weights.safetensors", lstm ? "lstm" : "gru");
        rc |= write_seed(out, "safetensors", name, st, len);
        free(buf);
        free(st);
    } else {
        rc = -1;
    }
    free(params);
    free(ma);
    free(va);
    free(h);
    free(c);
    free(lo);
    free(tobs);
    free(tex);
    free(th);
    free(tc);
    return rc;
}

// A file of every dtype, with metadata (escapes included) and an empty tensor.
static int mixed_safetensors(const char *out) {
    float f[6] = {1, -2, 0.5f, 1e30f, -0.0f, 3};
    int64_t i[2] = {-1, INT64_MAX};
    uint8_t u[3] = {0, 7, 255}, b[2] = {1, 0};
    struct rnnd_st_tensor t[] = {
        {.name = "f32", .dtype = RNND_ST_F32, .ndim = 2, .shape = {2, 3}, .data = f, .bytes = 24},
        {.name = "i64", .dtype = RNND_ST_I64, .ndim = 1, .shape = {2}, .data = i, .bytes = 16},
        {.name = "u8", .dtype = RNND_ST_U8, .ndim = 1, .shape = {3}, .data = u, .bytes = 3},
        {.name = "bool", .dtype = RNND_ST_BOOL, .ndim = 1, .shape = {2}, .data = b, .bytes = 2},
        {.name = "empty", .dtype = RNND_ST_F32, .ndim = 2, .shape = {0, 4}, .data = NULL},
        {.name = "scalar", .dtype = RNND_ST_F32, .ndim = 0, .data = f, .bytes = 4},
    };
    const char *meta[] = {"format", "pt", "note", "quote \" backslash \\ tab \t"};
    void *buf;
    size_t len;
    if (rnnd_st_encode(t, (int)(sizeof(t) / sizeof(t[0])), meta, 2, &buf, &len) != 0)
        return -1;
    int rc = write_seed(out, "safetensors", "mixed.safetensors", buf, len);
    free(buf);
    return rc;
}

static int http_requests(const char *out) {
    static const char *const reqs[] = {
        "GET /healthz HTTP/1.1\r\nHost: 10.0.0.5:9090\r\nUser-Agent: kube-probe/1.29\r\n"
        "Accept: */*\r\nConnection: close\r\n\r\n",
        "GET /readyz HTTP/1.1\r\nHost: rnnd-0.rnnd:9090\r\nUser-Agent: kube-probe/1.29\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: rnnd:9090\r\nUser-Agent: Prometheus/2.45.0\r\n"
        "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n"
        "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n",
        "GET /metrics?name[]=rnnd_up HTTP/1.0\n\n",
        "GET /readyz\r\n\r\n",
        "POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
        "GET /nope HTTP/1.1\r\n\r\n",
        "GET  /healthz HTTP/1.1\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nX-Slow: a",
    };
    int rc = 0;
    for (size_t i = 0; i < sizeof(reqs) / sizeof(reqs[0]); i++) {
        char name[32];
        snprintf(name, sizeof(name), "request-%02zu", i);
        rc |= write_seed(out, "http", name, reqs[i], strlen(reqs[i]));
    }
    return rc;
}

static int remove_one(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_seeds OUT\n");
        return 1;
    }
    const char *out = argv[1];
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "fuzz_seeds: %s: %s\n", out, strerror(errno));
        return 1;
    }
    char state_dir[] = "/tmp/rnnd-fuzz-seeds-XXXXXX";
    if (mkdtemp(state_dir) == NULL) {
        fprintf(stderr, "fuzz_seeds: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    int rc = 0;
    for (int k = 0; k < FUZZ_MODELS; k++)
        rc |= checkpoints(out, state_dir, k);
    rc |= mixed_safetensors(out);
    rc |= http_requests(out);
    nftw(state_dir, remove_one, 16, FTW_DEPTH | FTW_PHYS);
    if (rc != 0) {
        fprintf(stderr, "fuzz_seeds: could not write every seed into %s\n", out);
        return 1;
    }
    printf("fuzz_seeds: wrote the seeds into %s/{checkpoint,safetensors,http}\n", out);
    return 0;
}
