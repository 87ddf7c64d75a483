/*
 * test_checkpoint.c: checkpoint directories (server/checkpoint.c): where SaveCheckpoint may
 * write, a write/read round trip (weights, optimizer, env states, recorded trajectories, creation
 * time), atomic replacement of a checkpoint of the same name, corrupt and truncated files
 * refused, newest-first listing, pruning of automatic checkpoints only, and weights files.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    assert_true(strncmp(out, "/s/ckpt-", 8) == 0);
    assert_non_null(strstr(out, "-v7"));
    assert_int_equal(rnnd_checkpoint_resolve("/s", "mine", 7, out, sizeof(out), err, sizeof(err)),
                     0);
    assert_string_equal(out, "/s/mine");
    assert_int_equal(
        rnnd_checkpoint_resolve("/s/", "/s/abs", 7, out, sizeof(out), err, sizeof(err)), 0);
    assert_string_equal(out, "/s//abs");
    const char *bad[] = {"../x", "a/../b", ".hidden", "a/b", "/etc/x", "/s", "/sx/y", NULL};
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
                                     .extras_size = 2};
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
    assert_int_equal(rnnd_checkpoint_write(dir, &g.ck, err, sizeof(err)), 0);
    assert_int_equal(rnnd_checkpoint_read(dir, &g.m, &d, err, sizeof(err)), 0);
    assert_int_equal(d.ck.model_version, 43);
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

static void test_list_and_prune(void **state) {
    (void)state;
    char sd[128], dir[300], err[512];
    snprintf(sd, sizeof(sd), "%s/state", root);
    mkdir(sd, 0755);
    struct fake f;
    fake_init(&f, 3.0f);
    const char *names[] = {"ckpt-20260101T000000.000Z-v1", "mine", "ckpt-20260101T000001.000Z-v2",
                           "ckpt-20260101T000002.000Z-v3"};
    for (int i = 0; i < 4; i++) {
        snprintf(dir, sizeof(dir), "%s/%s", sd, names[i]);
        assert_int_equal(rnnd_checkpoint_write(dir, &f.ck, err, sizeof(err)), 0);
        usleep(3000); // distinct creation times
    }
    snprintf(dir, sizeof(dir), "%s/not-a-checkpoint", sd);
    mkdir(dir, 0755);
    char **paths;
    int n;
    assert_int_equal(rnnd_checkpoint_list(sd, &paths, &n), 0);
    assert_int_equal(n, 4);
    // Newest first by creation time, whatever the name.
    assert_non_null(strstr(paths[0], "v3"));
    assert_non_null(strstr(paths[1], "v2"));
    assert_non_null(strstr(paths[2], "mine"));
    assert_non_null(strstr(paths[3], "v1"));
    rnnd_checkpoint_list_free(paths, n);
    // Pruning keeps the newest two automatic ones and never touches "mine".
    assert_int_equal(rnnd_checkpoint_prune(sd, 2), 1);
    assert_int_equal(rnnd_checkpoint_list(sd, &paths, &n), 0);
    assert_int_equal(n, 3);
    for (int i = 0; i < n; i++)
        assert_null(strstr(paths[i], "v1"));
    rnnd_checkpoint_list_free(paths, n);
    assert_int_equal(rnnd_checkpoint_list("/nonexistent-dir", &paths, &n), 0);
    assert_int_equal(n, 0);
    rnnd_checkpoint_list_free(paths, n);
    fake_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resolve),         cmocka_unit_test(test_round_trip_and_replace),
        cmocka_unit_test(test_corrupt_refused), cmocka_unit_test(test_truncated_refused),
        cmocka_unit_test(test_read_weights),    cmocka_unit_test(test_list_and_prune),
    };
    return cmocka_run_group_tests_name("checkpoint", tests, setup, teardown);
}
