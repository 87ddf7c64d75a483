/*
 * test_checkpoint.c: checkpoint directories (server/checkpoint.c): where SaveCheckpoint may
 * write (automatic ones in auto/, names of that form reserved), a write/read round trip
 * (weights, optimizer, env states, recorded trajectories, creation time), atomic replacement of
 * a checkpoint of the same name, corrupt and truncated files refused, checksums (a flipped byte
 * in any file refused, none: loaded unverified), NaN/Inf refused, missing parts named, modes
 * 0700/0600 whatever the umask, newest-first listing of automatic and named checkpoints (and the
 * earlier layout), rotation of automatic ones only (sparing those of another model and those
 * asked for), removal of temporaries, and weights files.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "checkpoint.h"
#include "rnnd_kernels.h"
#include "rnnd_safetensors.h"

static char root[64];

static int setup(void **state) {
    (void)state;
    snprintf(root, sizeof(root), "/tmp/rnnd-test-ckpt-XXXXXX");
    return mkdtemp(root) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    return system(cmd) == 0 ? 0 : -1;
}

static void test_resolve(void **state) {
    (void)state;
    char out[1024], err[512];
    assert_int_equal(rnnd_checkpoint_resolve("", "x", 0, out, sizeof(out), err, sizeof(err)),
                     RNND_EPRECOND);
    assert_int_equal(rnnd_checkpoint_resolve("/s", "", 7, out, sizeof(out), err, sizeof(err)), 0);
    assert_true(strncmp(out, "/s/auto/ckpt-", 13) == 0);
    assert_non_null(strstr(out, "-v7"));
    // Any other name is a named checkpoint, even one that starts like an automatic one.
    assert_int_equal(
        rnnd_checkpoint_resolve("/s", "ckpt-zz-1", 7, out, sizeof(out), err, sizeof(err)), 0);
    assert_string_equal(out, "/s/ckpt-zz-1");
    assert_int_equal(rnnd_checkpoint_resolve("/s", "mine", 7, out, sizeof(out), err, sizeof(err)),
                     0);
    assert_string_equal(out, "/s/mine");
    assert_int_equal(
        rnnd_checkpoint_resolve("/s/", "/s/abs", 7, out, sizeof(out), err, sizeof(err)), 0);
    assert_string_equal(out, "/s//abs");
    const char *bad[] = {"../x",    "a/../b", ".hidden",
                         "a/b",     "/etc/x", "/s",
                         "/sx/y",   "auto",   "ckpt-20260101T000000.000Z-v3",
                         "/s/auto", NULL};
    for (int i = 0; bad[i]; i++)
        if (rnnd_checkpoint_resolve("/s", bad[i], 7, out, sizeof(out), err, sizeof(err)) !=
            RNND_EINVAL)
            fail_msg("path %s accepted", bad[i]);
}

struct fake {
    struct rnnd_model m;
    size_t P;
    float *params, *ma, *va, h[3 * 2 * 4], c[3 * 2 * 4], out[3 * 4];
    uint64_t ids[3], last[3];
    uint8_t has[3];
    // Recorded steps: 2, 0 and 3 for the three envs (R = 5), extras width 2.
    int64_t count[3];
    float tobs[5 * 3], tex[5 * 2], th[5 * 2 * 4], tc[5 * 2 * 4];
    uint8_t tinit[5];
    uint64_t tver[5];
    struct rnnd_checkpoint ck;
};

static void fake_init(struct fake *f, float base) {
    f->m = (struct rnnd_model){.cell = RNND_CELL_LSTM, .I = 3, .H = 4, .L = 2};
    f->P = rnnd_model_param_count(&f->m);
    f->params = malloc(f->P * 4);
    f->ma = malloc(f->P * 4);
    f->va = malloc(f->P * 4);
    for (size_t i = 0; i < f->P; i++) {
        f->params[i] = base + (float)i;
        f->ma[i] = -(float)i;
        f->va[i] = (float)i * 0.5f;
    }
    for (int i = 0; i < 24; i++) {
        f->h[i] = (float)i;
        f->c[i] = -(float)i;
    }
    for (int i = 0; i < 12; i++)
        f->out[i] = (float)i / 7.0f;
    uint64_t ids[3] = {5, UINT64_MAX, 77};
    memcpy(f->ids, ids, sizeof(ids));
    f->last[0] = 3;
    f->last[1] = 0;
    f->last[2] = 99;
    f->has[0] = 1;
    f->has[1] = 0;
    f->has[2] = 1;
    f->count[0] = 2;
    f->count[1] = 0;
    f->count[2] = 3;
    for (int i = 0; i < 5 * 3; i++)
        f->tobs[i] = base * 0.5f + (float)i;
    for (int i = 0; i < 5 * 2; i++)
        f->tex[i] = -(float)i;
    for (int i = 0; i < 5 * 8; i++) {
        f->th[i] = (float)i / 3.0f;
        f->tc[i] = -(float)i / 5.0f;
    }
    for (int i = 0; i < 5; i++) {
        f->tinit[i] = i == 2;
        f->tver[i] = 40 + (uint64_t)i;
    }
    f->ck = (struct rnnd_checkpoint){.model = f->m,
                                     .P = f->P,
                                     .params = f->params,
                                     .model_version = 42,
                                     .optimizer = RNND_OPTIM_ADAM,
                                     .lr = 0.01f,
                                     .optim_step = 17,
                                     .exp_avg = f->ma,
                                     .exp_avg_sq = f->va,
                                     .n_envs = 3,
                                     .env_ids = f->ids,
                                     .env_h = f->h,
                                     .env_c = f->c,
                                     .last_index = f->last,
                                     .has_index = f->has,
                                     .last_output = f->out,
                                     .traj_count = f->count,
                                     .traj_rows = 5,
                                     .traj_obs = f->tobs,
                                     .traj_is_init = f->tinit,
                                     .traj_extras = f->tex,
                                     .traj_version = f->tver,
                                     .traj_h = f->th,
                                     .traj_c = f->tc,
                                     .extras_size = 2,
                                     .devices = 2,
                                     .place_block = 64};
}

static void fake_free(struct fake *f) {
    free(f->params);
    free(f->ma);
    free(f->va);
}

static void test_round_trip_and_replace(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 1.0f);
    char dir[256], err[512];
    snprintf(dir, sizeof(dir), "%s/one", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    struct rnnd_checkpoint_data d;
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), 0);
    assert_int_equal(d.ck.model_version, 42);
    assert_int_equal(d.ck.optim_step, 17);
    assert_string_equal(d.optimizer, "adam");
    assert_memory_equal(d.ck.params, f.params, f.P * 4);
    assert_memory_equal(d.ck.exp_avg, f.ma, f.P * 4);
    assert_memory_equal(d.ck.exp_avg_sq, f.va, f.P * 4);
    assert_int_equal(d.ck.n_envs, 3);
    assert_memory_equal(d.ck.env_ids, f.ids, sizeof(f.ids));
    assert_memory_equal(d.ck.env_h, f.h, sizeof(f.h));
    assert_memory_equal(d.ck.env_c, f.c, sizeof(f.c));
    assert_memory_equal(d.ck.last_index, f.last, sizeof(f.last));
    assert_memory_equal(d.ck.has_index, f.has, sizeof(f.has));
    assert_memory_equal(d.ck.last_output, f.out, sizeof(f.out));
    assert_non_null(d.ck.traj_count);
    assert_memory_equal(d.ck.traj_count, f.count, sizeof(f.count));
    assert_int_equal(d.ck.traj_rows, 5);
    assert_int_equal(d.ck.extras_size, 2);
    assert_memory_equal(d.ck.traj_obs, f.tobs, sizeof(f.tobs));
    assert_memory_equal(d.ck.traj_extras, f.tex, sizeof(f.tex));
    assert_memory_equal(d.ck.traj_h, f.th, sizeof(f.th));
    assert_memory_equal(d.ck.traj_c, f.tc, sizeof(f.tc));
    assert_memory_equal(d.ck.traj_is_init, f.tinit, sizeof(f.tinit));
    assert_memory_equal(d.ck.traj_version, f.tver, sizeof(f.tver));
    // Where the writer placed its envs comes back (restore checks it against its own placement).
    assert_int_equal(d.ck.devices, 2);
    assert_int_equal(d.ck.place_block, 64);
    // The creation time comes back (restore logs the checkpoint's age from it).
    long long now_ms = (long long)time(NULL) * 1000;
    assert_true(d.ck.created_unix_ms > now_ms - 60000 && d.ck.created_unix_ms < now_ms + 60000);
    rnnd_checkpoint_data_free(&d);

    // Writing the same name again replaces it whole.
    struct fake g;
    fake_init(&g, 100.0f);
    g.ck.n_envs = 0;
    g.ck.traj_count = NULL;
    g.ck.model_version = 43;
    g.ck.devices = g.ck.place_block = 0; // a writer that does not know where its envs live
    assert_int_equal(rnnd_checkpoint_write(dir, &g.ck, err, sizeof(err)), 0);
    assert_int_equal(rnnd_checkpoint_read(dir, &g.m, &d, err, sizeof(err)), 0);
    assert_int_equal(d.ck.model_version, 43);
    assert_int_equal(d.ck.devices, 0);
    assert_int_equal(d.ck.place_block, 1);
    assert_int_equal(d.ck.n_envs, 0);
    assert_null(d.ck.traj_count); // no trajectories file: nothing recorded
    assert_memory_equal(d.ck.params, g.params, g.P * 4);
    rnnd_checkpoint_data_free(&d);

    // Another model shape is refused, naming the tensor.
    struct rnnd_model other = f.m;
    other.H = 5;
    assert_int_equal(rnnd_checkpoint_read(dir, &other, &d, err, sizeof(err)), RNND_EINVAL);
    assert_non_null(strstr(err, "model.safetensors"));
    fake_free(&f);
    fake_free(&g);
}

static void test_corrupt_refused(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 2.0f);
    char dir[256], file[300], err[512];
    snprintf(dir, sizeof(dir), "%s/bad", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    snprintf(file, sizeof(file), "%s/model.safetensors", dir);
    FILE *fp = fopen(file, "r+b");
    fputs("garbage garbage garbage", fp);
    fclose(fp);
    struct rnnd_checkpoint_data d;
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), RNND_ECORRUPT);
    snprintf(file, sizeof(file), "%s/envs.safetensors", dir);
    unlink(file);
    snprintf(dir, sizeof(dir), "%s/missing", root);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), RNND_ECORRUPT);
    fake_free(&f);
}

// Where the writer placed its envs, from metadata.json (a checkpoint without checksums, as
// older ones are): absent fields read as not known (0 devices, block 1, as written before
// them); values out of range are refused, naming them.
static void test_placement_metadata(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 3.0f);
    char dir[256], file[300], err[512];
    snprintf(dir, sizeof(dir), "%s/placed", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    snprintf(file, sizeof(file), "%s/checksums", dir);
    assert_int_equal(unlink(file), 0);
    snprintf(file, sizeof(file), "%s/metadata.json", dir);
    static const struct {
        const char *json;
        int rc, devices, block;
        const char *named;
    } cases[] = {
        {"{\"format\": \"rnnd-checkpoint\", \"envs\": 3}", 0, 0, 1, NULL},
        {"{\"devices\": 4, \"place_block\": 1024}", 0, 4, 1024, NULL},
        {"{\"devices\": 2, \"place_block\": 0}", RNND_ECORRUPT, 0, 0, "place_block 0"},
        {"{\"devices\": -1, \"place_block\": 64}", RNND_ECORRUPT, 0, 0, "devices -1"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        FILE *fp = fopen(file, "wb");
        fputs(cases[i].json, fp);
        fclose(fp);
        struct rnnd_checkpoint_data d;
        err[0] = '\0';
        assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), cases[i].rc);
        if (cases[i].rc == 0) {
            assert_int_equal(d.ck.devices, cases[i].devices);
            assert_int_equal(d.ck.place_block, cases[i].block);
            rnnd_checkpoint_data_free(&d);
        } else {
            assert_non_null(strstr(err, "metadata.json"));
            assert_non_null(strstr(err, cases[i].named));
        }
    }
    fake_free(&f);
}

// Cuts dir/name to half its length, as a crash in the middle of a copy would.
static void truncate_half(const char *dir, const char *name) {
    char file[512];
    snprintf(file, sizeof(file), "%s/%s", dir, name);
    struct stat st;
    assert_int_equal(stat(file, &st), 0);
    assert_int_equal(truncate(file, st.st_size / 2), 0);
}

static void test_truncated_refused(void **state) {
    (void)state;
    const char *files[] = {"model.safetensors", "optimizer.safetensors", "envs.safetensors",
                           "trajectories.safetensors"};
    struct fake f;
    fake_init(&f, 4.0f);
    for (int i = 0; i < 4; i++) {
        char dir[256], err[512] = "";
        snprintf(dir, sizeof(dir), "%s/trunc-%d", root, i);
        assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
        truncate_half(dir, files[i]);
        struct rnnd_checkpoint_data d;
        int rc = rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err));
        if (rc != RNND_ECORRUPT || !strstr(err, files[i]))
            fail_msg("truncated %s: rc %d, \"%s\"", files[i], rc, err);
    }
    // Row counts that do not add up to the rows stored are refused too.
    char dir[256], err[512] = "";
    snprintf(dir, sizeof(dir), "%s/bad-count", root);
    f.count[2] = 4;
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    struct rnnd_checkpoint_data d;
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), RNND_ECORRUPT);
    assert_non_null(strstr(err, "trajectories.safetensors"));
    fake_free(&f);
}

static void test_read_weights(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 5.0f);
    void *buf;
    size_t len;
    assert_int_equal(rnnd_st_encode_params(&f.m, f.params, NULL, 0, &buf, &len), 0);
    char file[256], err[512] = "";
    snprintf(file, sizeof(file), "%s/w.safetensors", root);
    FILE *fp = fopen(file, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(buf, 1, len, fp), len);
    fclose(fp);
    free(buf);
    float *p = calloc(f.P, 4);
    assert_int_equal(rnnd_checkpoint_read_weights(file, &f.m, p, err, sizeof(err)), 0);
    assert_memory_equal(p, f.params, f.P * 4);
    // Another shape, a missing file and a truncated one are refused and leave params alone.
    memset(p, 0, f.P * 4);
    struct rnnd_model other = f.m;
    other.L = 1;
    assert_int_equal(rnnd_checkpoint_read_weights(file, &other, p, err, sizeof(err)), RNND_EINVAL);
    assert_non_null(strstr(err, file));
    assert_int_equal(
        rnnd_checkpoint_read_weights("/nonexistent.safetensors", &f.m, p, err, sizeof(err)),
        RNND_EIO);
    assert_int_equal(truncate(file, (off_t)len / 2), 0);
    assert_int_equal(rnnd_checkpoint_read_weights(file, &f.m, p, err, sizeof(err)), RNND_ECORRUPT);
    for (size_t i = 0; i < f.P; i++)
        assert_true(p[i] == 0.0f);
    free(p);
    fake_free(&f);
}

// Flips the bits of one byte of dir/name, at off from its end: inside the data, past the header.
static void flip_byte(const char *dir, const char *name, long off) {
    char file[512];
    snprintf(file, sizeof(file), "%s/%s", dir, name);
    FILE *fp = fopen(file, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, -off, SEEK_END), 0);
    int c = fgetc(fp);
    assert_int_equal(fseek(fp, -off, SEEK_END), 0);
    fputc(c ^ 0xff, fp);
    fclose(fp);
}

static void test_checksums(void **state) {
    (void)state;
    const char *files[] = {"model.safetensors",        "optimizer.safetensors", "envs.safetensors",
                           "trajectories.safetensors", "metadata.json",         "checksums"};
    struct fake f;
    fake_init(&f, 6.0f);
    char dir[256], err[512] = "";
    struct rnnd_checkpoint_data d;
    // A flipped byte anywhere is refused, naming the file (a flip in checksums itself makes a
    // line disagree with its file).
    for (int i = 0; i < 6; i++) {
        snprintf(dir, sizeof(dir), "%s/flip-%d", root, i);
        assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
        flip_byte(dir, files[i], i == 5 ? 30 : 3);
        int rc = rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err));
        if (rc != RNND_ECORRUPT || !strstr(err, i == 5 ? "checksums" : files[i]))
            fail_msg("a flipped byte in %s: rc %d, \"%s\"", files[i], rc, err);
    }
    // An env id changed, as a bit rot in envs.safetensors would: refused, not one env lost.
    snprintf(dir, sizeof(dir), "%s/env-id", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    snprintf(dir, sizeof(dir), "%s/env-id/envs.safetensors", root);
    FILE *fp = fopen(dir, "rb");
    assert_non_null(fp);
    char buf[4096];
    size_t len = fread(buf, 1, sizeof(buf), fp);
    fclose(fp);
    struct rnnd_st_file st;
    assert_int_equal(rnnd_st_decode(buf, len, &st, err, sizeof(err)), 0);
    long at = (long)((const char *)rnnd_st_find(&st, "env_ids")->data - buf);
    rnnd_st_file_free(&st);
    snprintf(dir, sizeof(dir), "%s/env-id", root);
    flip_byte(dir, "envs.safetensors", (long)len - at);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), RNND_ECORRUPT);
    assert_non_null(strstr(err, "envs.safetensors"));

    // Intact, it is verified; without a checksums file (an older checkpoint) it loads unverified.
    snprintf(dir, sizeof(dir), "%s/sums", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), 0);
    assert_true(d.verified);
    assert_string_equal(d.lost, "");
    rnnd_checkpoint_data_free(&d);
    char file[512];
    snprintf(file, sizeof(file), "%s/checksums", dir);
    assert_int_equal(unlink(file), 0);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), 0);
    assert_false(d.verified);
    assert_memory_equal(d.ck.params, f.params, f.P * 4);
    rnnd_checkpoint_data_free(&d);

    // A file that checksums does not list is refused.
    snprintf(dir, sizeof(dir), "%s/unlisted", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    snprintf(file, sizeof(file), "%s/checksums", dir);
    fp = fopen(file, "rb");
    len = fread(buf, 1, sizeof(buf) - 1, fp);
    fclose(fp);
    buf[len] = '\0';
    char *line = strstr(buf, " optimizer.safetensors\n");
    assert_non_null(line);
    while (line > buf && line[-1] != '\n')
        line--;
    char *next = strchr(line, '\n') + 1;
    memmove(line, next, strlen(next) + 1);
    fp = fopen(file, "wb");
    fputs(buf, fp);
    fclose(fp);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), RNND_ECORRUPT);
    assert_non_null(strstr(err, "optimizer.safetensors is not listed in checksums"));
    fake_free(&f);
}

static void test_missing_parts(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 7.0f);
    char dir[256], file[512], err[512] = "";
    snprintf(dir, sizeof(dir), "%s/parts", root);
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    snprintf(file, sizeof(file), "%s/optimizer.safetensors", dir);
    assert_int_equal(unlink(file), 0);
    snprintf(file, sizeof(file), "%s/envs.safetensors", dir);
    assert_int_equal(unlink(file), 0);
    // The weights load; what is gone is named (trajectories go with the envs they belong to).
    struct rnnd_checkpoint_data d;
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), 0);
    assert_memory_equal(d.ck.params, f.params, f.P * 4);
    assert_int_equal(d.ck.n_envs, 0);
    assert_null(d.ck.traj_count);
    assert_non_null(strstr(d.lost, "optimizer.safetensors"));
    assert_non_null(strstr(d.lost, "envs.safetensors"));
    assert_non_null(strstr(d.lost, "trajectories.safetensors"));
    rnnd_checkpoint_data_free(&d);
    // Trajectories are not written without recorded steps: nothing is lost then.
    snprintf(dir, sizeof(dir), "%s/no-traj", root);
    f.ck.traj_count = NULL;
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), 0);
    assert_string_equal(d.lost, "");
    rnnd_checkpoint_data_free(&d);
    // A PyTorch model alone restores weights, and says what it lacks.
    snprintf(dir, sizeof(dir), "%s/torch-only", root);
    mkdir(dir, 0700);
    void *buf;
    size_t len;
    assert_int_equal(rnnd_st_encode_params(&f.m, f.params, NULL, 0, &buf, &len), 0);
    snprintf(file, sizeof(file), "%s/model.safetensors", dir);
    FILE *fp = fopen(file, "wb");
    fwrite(buf, 1, len, fp);
    fclose(fp);
    free(buf);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), 0);
    assert_false(d.verified);
    assert_non_null(strstr(d.lost, "optimizer.safetensors"));
    rnnd_checkpoint_data_free(&d);
    fake_free(&f);
}

static void test_nonfinite_refused(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 8.0f);
    char dir[256], file[300], err[512] = "";
    struct rnnd_checkpoint_data d;
    float bad[3] = {NAN, INFINITY, -INFINITY};
    const char *names[3] = {"NaN", "Inf", "-Inf"};
    for (int k = 0; k < 3; k++) {
        snprintf(dir, sizeof(dir), "%s/nonfinite-%d", root, k);
        float keep_p = f.params[5];
        f.params[5] = bad[k];
        assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
        f.params[5] = keep_p;
        int rc = rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err));
        if (rc != RNND_ECORRUPT || !strstr(err, "model.safetensors") || !strstr(err, names[k]))
            fail_msg("a %s weight: rc %d, \"%s\"", names[k], rc, err);
        // The same file as --weights.
        snprintf(file, sizeof(file), "%s/model.safetensors", dir);
        float *p = calloc(f.P, 4);
        assert_int_equal(rnnd_checkpoint_read_weights(file, &f.m, p, err, sizeof(err)),
                         RNND_ECORRUPT);
        assert_non_null(strstr(err, names[k]));
        free(p);
    }
    // Adam moments too: they become weights at the next update.
    snprintf(dir, sizeof(dir), "%s/nonfinite-m", root);
    f.ma[1] = NAN;
    assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
    assert_int_equal(rnnd_checkpoint_read(dir, &f.m, &d, err, sizeof(err)), RNND_ECORRUPT);
    assert_non_null(strstr(err, "optimizer.safetensors"));
    fake_free(&f);
}

static void assert_mode(const char *path, unsigned mode) {
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    if ((st.st_mode & 0777) != mode)
        fail_msg("%s has mode %03o, not %03o", path, st.st_mode & 0777, mode);
}

static void test_modes(void **state) {
    (void)state;
    struct fake f;
    fake_init(&f, 9.0f);
    const char *files[] = {"model.safetensors",        "optimizer.safetensors", "envs.safetensors",
                           "trajectories.safetensors", "metadata.json",         "checksums"};
    // 0700 and 0600 whether the umask would open them up or shut the owner out.
    mode_t masks[2] = {0, 0277};
    for (int k = 0; k < 2; k++) {
        char sd[256], dir[300], err[512] = "", file[400];
        snprintf(sd, sizeof(sd), "%s/modes-%d/state", root, k);
        snprintf(dir, sizeof(dir), "%s/auto/ckpt-1", sd);
        mode_t old = umask(masks[k]);
        int rc = rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err));
        umask(old);
        assert_int_equal(rc, 0);
        assert_mode(sd, 0700);
        snprintf(file, sizeof(file), "%s/auto", sd);
        assert_mode(file, 0700);
        assert_mode(dir, 0700);
        for (int i = 0; i < 6; i++) {
            snprintf(file, sizeof(file), "%s/%s", dir, files[i]);
            assert_mode(file, 0600);
        }
    }
    fake_free(&f);
}

// Writes a checkpoint of f at state/rel and waits a little, so creation times differ.
static void write_at(const char *sd, const char *rel, const struct rnnd_checkpoint *ck) {
    char dir[400], err[512];
    snprintf(dir, sizeof(dir), "%s/%s", sd, rel);
    if (rnnd_checkpoint_write(dir, ck, err, sizeof(err)) != 0)
        fail_msg("write %s: %s", dir, err);
    usleep(3000);
}

static bool exists(const char *sd, const char *rel) {
    char p[400];
    struct stat st;
    snprintf(p, sizeof(p), "%s/%s", sd, rel);
    return stat(p, &st) == 0;
}

static void test_list_and_prune(void **state) {
    (void)state;
    char sd[128], dir[300];
    snprintf(sd, sizeof(sd), "%s/state", root);
    struct fake f;
    fake_init(&f, 3.0f);
    struct rnnd_checkpoint other = f.ck;
    other.model.H = 5; // another configuration (its metadata.json says so)
    other.n_envs = 0;
    other.traj_count = NULL;
    size_t P5 = rnnd_model_param_count(&other.model);
    float *p5 = calloc(P5, 4);
    other.params = p5;
    other.P = P5;
    other.exp_avg = other.exp_avg_sq = NULL;
    // Oldest first: one of the earlier layout at the top, one of another model, automatic ones
    // in auto/, named ones at the top (one with a name that sorts after every automatic name).
    write_at(sd, "ckpt-20250101T000000.000Z-v0", &f.ck);
    write_at(sd, "auto/ckpt-20260101T000000.000Z-v1", &other);
    write_at(sd, "auto/ckpt-20260101T000001.000Z-v2", &f.ck);
    write_at(sd, "mine", &f.ck);
    write_at(sd, "auto/ckpt-20260101T000002.000Z-v3", &f.ck);
    write_at(sd, "ckpt-zz-1", &f.ck);
    write_at(sd, "auto/ckpt-20260101T000003.000Z-v4", &f.ck);
    write_at(sd, "auto/ckpt-20260101T000004.000Z-v5", &f.ck);
    snprintf(dir, sizeof(dir), "%s/not-a-checkpoint", sd);
    mkdir(dir, 0755);
    char **paths;
    int n;
    // Automatic ones, newest first by creation time, with the earlier layout's.
    assert_int_equal(rnnd_checkpoint_list(sd, false, &paths, &n), 0);
    assert_int_equal(n, 6);
    const char *want[] = {"auto/ckpt-20260101T000004.000Z-v5", "auto/ckpt-20260101T000003.000Z-v4",
                          "auto/ckpt-20260101T000002.000Z-v3", "auto/ckpt-20260101T000001.000Z-v2",
                          "auto/ckpt-20260101T000000.000Z-v1", "ckpt-20250101T000000.000Z-v0"};
    for (int i = 0; i < n; i++) {
        snprintf(dir, sizeof(dir), "%s/%s", sd, want[i]);
        assert_string_equal(paths[i], dir);
    }
    rnnd_checkpoint_list_free(paths, n);
    assert_int_equal(rnnd_checkpoint_list(sd, true, &paths, &n), 0);
    assert_int_equal(n, 2);
    assert_non_null(strstr(paths[0], "/ckpt-zz-1"));
    assert_non_null(strstr(paths[1], "/mine"));
    rnnd_checkpoint_list_free(paths, n);

    // Keeping two, sparing v4: v5 and v3 count, v2 goes; v1 (another model), v4 (spared), the
    // earlier layout's and the named ones stay.
    snprintf(dir, sizeof(dir), "%s/auto/ckpt-20260101T000003.000Z-v4", sd);
    char *spare[1] = {dir};
    assert_int_equal(rnnd_checkpoint_prune(sd, 2, &f.m, spare, 1), 1);
    assert_false(exists(sd, "auto/ckpt-20260101T000001.000Z-v2"));
    const char *stay[] = {"auto/ckpt-20260101T000000.000Z-v1",
                          "auto/ckpt-20260101T000002.000Z-v3",
                          "auto/ckpt-20260101T000003.000Z-v4",
                          "auto/ckpt-20260101T000004.000Z-v5",
                          "ckpt-20250101T000000.000Z-v0",
                          "mine",
                          "ckpt-zz-1"};
    for (int i = 0; i < 7; i++)
        if (!exists(sd, stay[i]))
            fail_msg("%s was removed", stay[i]);
    // Nothing spared: v4 goes too.
    assert_int_equal(rnnd_checkpoint_prune(sd, 2, &f.m, NULL, 0), 1);
    assert_false(exists(sd, "auto/ckpt-20260101T000002.000Z-v3"));
    assert_true(exists(sd, "auto/ckpt-20260101T000000.000Z-v1"));
    assert_int_equal(rnnd_checkpoint_list("/nonexistent-dir", false, &paths, &n), 0);
    assert_int_equal(n, 0);
    rnnd_checkpoint_list_free(paths, n);
    free(p5);
    fake_free(&f);
}

static void test_clean(void **state) {
    (void)state;
    char sd[128], p[300];
    snprintf(sd, sizeof(sd), "%s/clean", root);
    const char *dirs[] = {
        "",      "/auto", "/.ckpt-x.tmp-123", "/auto/.ckpt-y.tmp-4567", "/.hidden", "/.a.tmp-12x",
        "/named"};
    for (int i = 0; i < 7; i++) {
        snprintf(p, sizeof(p), "%s%s", sd, dirs[i]);
        assert_int_equal(mkdir(p, 0700), 0);
    }
    snprintf(p, sizeof(p), "%s/auto/.ckpt-y.tmp-4567/model.safetensors", sd);
    FILE *fp = fopen(p, "w");
    fputs("half", fp);
    fclose(fp);
    snprintf(p, sizeof(p), "%s/.rnnd-running", sd);
    fclose(fopen(p, "w"));
    assert_int_equal(rnnd_checkpoint_clean(sd), 2);
    assert_false(exists(sd, ".ckpt-x.tmp-123"));
    assert_false(exists(sd, "auto/.ckpt-y.tmp-4567"));
    assert_true(exists(sd, ".hidden"));
    assert_true(exists(sd, ".a.tmp-12x"));
    assert_true(exists(sd, "named"));
    assert_true(exists(sd, ".rnnd-running"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resolve),           cmocka_unit_test(test_round_trip_and_replace),
        cmocka_unit_test(test_corrupt_refused),   cmocka_unit_test(test_placement_metadata),
        cmocka_unit_test(test_truncated_refused), cmocka_unit_test(test_read_weights),
        cmocka_unit_test(test_checksums),         cmocka_unit_test(test_missing_parts),
        cmocka_unit_test(test_nonfinite_refused), cmocka_unit_test(test_modes),
        cmocka_unit_test(test_list_and_prune),    cmocka_unit_test(test_clean),
    };
    return cmocka_run_group_tests_name("checkpoint", tests, setup, teardown);
}
