/*
 * test_weights.c: weights and persistence. GetWeights names and shapes (PyTorch's), seeded
 * initialisation, SetWeights/GetWeights round trip (and Step uses what was set), rnndctl (every
 * command, weights export|import through safetensors files), SaveCheckpoint contents, and
 * restarts: a clean SIGTERM restart keeps weights, version and env states; after kill -9 the
 * daemon comes back from the last checkpoint; a corrupt newest checkpoint is skipped for the next
 * older one; --restore loads the one named.
 */
#include "harness.h"

#include <grpc/status.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rnnd_safetensors.h"

#define I_   8
#define H_   16
#define L_   2
#define ATOL 2e-5f
#define RTOL 1e-4f

static const char *const daemon_args[] = {
    "--cell", "gru", "--input-size", "8", "--hidden-size", "16", "--layers", "2", "--seed",
    "9",      NULL};

struct fixture {
    struct daemon d;
    struct rnnd_client *c;
    struct ref r;
    struct rng g;
};

static struct fixture fx = {.g = {4242}};

static int setup(void **state) {
    if (daemon_start(&fx.d, daemon_args) != 0)
        return -1;
    fx.c = daemon_client(&fx.d, NULL);
    ref_init(&fx.r, fx.c, 16);
    *state = &fx;
    return 0;
}

static int teardown(void **state) {
    struct fixture *f = *state;
    if (!f)
        return 0;
    if (f->d.pid && !daemon_alive(&f->d)) {
        fprintf(stderr, "rnnd died during the tests (status 0x%x)\n", f->d.exit_status);
        daemon_dump_log(&f->d, 4000);
    }
    ref_free(&f->r);
    rnnd_client_free(f->c);
    daemon_free(&f->d);
    return 0;
}

static float *get_params(struct fixture *f, uint64_t *version) {
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(f->c, &w, version));
    float *p = malloc(sizeof(float) * f->r.P);
    int err = rnnd_named_tensors_to_params(&w, &f->r.m, p);
    if (err)
        fprintf(stderr, "%s\n", rnnd_client_last_error()->message);
    assert_int_equal(err, 0);
    rnnd_named_tensors_free(&w);
    return p;
}

static void set_params(struct fixture *f, const float *p, uint64_t *version) {
    struct rnnd_named_tensors l;
    assert_int_equal(rnnd_named_tensors_from_params(&l, &f->r.m, p), 0);
    EXPECT_OK(rnnd_client_set_weights(f->c, &l, version));
    rnnd_named_tensors_free(&l);
}

static float *random_params(struct fixture *f, float scale) {
    float *p = malloc(sizeof(float) * f->r.P);
    rng_fill(&f->g, p, f->r.P);
    for (size_t k = 0; k < f->r.P; k++)
        p[k] *= scale;
    return p;
}

// ---------------------------------------------------------------------------------------------

static void test_names_and_init(void **state) {
    struct fixture *f = *state;
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(f->c, &w, NULL));
    assert_int_equal(w.n, 4 * L_);
    const char *kinds[4] = {"weight_ih_l%d", "weight_hh_l%d", "bias_ih_l%d", "bias_hh_l%d"};
    for (int l = 0; l < L_; l++) {
        for (int k = 0; k < 4; k++) {
            char name[32];
            snprintf(name, sizeof name, kinds[k], l);
            const struct rnnd_tensor *t = rnnd_named_tensors_find(&w, name);
            if (!t)
                fprintf(stderr, "GetWeights has no %s\n", name);
            assert_non_null(t);
            int in = l == 0 ? I_ : H_;
            if (k == 0)
                assert_tensor_f32(t, 2, 3 * H_, in, 0, 0);
            else if (k == 1)
                assert_tensor_f32(t, 2, 3 * H_, H_, 0, 0);
            else
                assert_tensor_f32(t, 1, 3 * H_, 0, 0, 0);
            // PyTorch's initialisation: uniform in [-1/sqrt(H), 1/sqrt(H)], not all equal.
            const float *v = t->data;
            float bound = 1.0f / sqrtf((float)H_), lo = 1, hi = -1;
            for (int64_t j = 0; j < rnnd_tensor_numel(t); j++) {
                assert_true(fabsf(v[j]) <= bound + 1e-6f);
                lo = fminf(lo, v[j]);
                hi = fmaxf(hi, v[j]);
            }
            assert_true(hi - lo > bound * 0.5f);
        }
    }
    rnnd_named_tensors_free(&w);

    // The same --seed gives the same weights; another seed different ones.
    struct daemon d2;
    assert_int_equal(daemon_start(&d2, daemon_args), 0);
    struct rnnd_client *c2 = daemon_client(&d2, NULL);
    struct fixture f2 = {.c = c2, .r = f->r};
    uint64_t v;
    float *a = get_params(f, &v), *b = get_params(&f2, &v);
    assert_memory_equal(a, b, sizeof(float) * f->r.P);
    free(a);
    free(b);
    rnnd_client_free(c2);
    daemon_free(&d2);
}

static void test_set_get_roundtrip(void **state) {
    struct fixture *f = *state;
    uint64_t v0, v1, v2;
    float *old = get_params(f, &v0);
    float *p = random_params(f, 0.3f);
    set_params(f, p, &v1);
    assert_true(v1 > v0);
    float *got = get_params(f, &v2);
    assert_int_equal(v2, v1);
    assert_memory_equal(got, p, sizeof(float) * f->r.P);
    // Steps run the new weights.
    ref_reload(&f->r, f->c);
    uint64_t id = 1;
    int32_t slot = 0;
    bool init = true;
    for (int s = 0; s < 3; s++) {
        float x[I_], ref[H_];
        rng_fill(&f->g, x, I_);
        struct rnnd_step_req req = {.n_env_ids = 1,
                                    .env_ids = &id,
                                    .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                    .n_is_init = 1,
                                    .is_init = &init};
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f->c, &req, &r));
        ref_step(&f->r, 1, &slot, x, &init, ref);
        assert_true(close_f32("step with set weights", r.output.data, ref, H_, ATOL, RTOL));
        assert_int_equal(r.model_version, v1);
        rnnd_step_reply_free(&r);
        init = false;
    }
    free(old);
    free(p);
    free(got);
}

// ---------------------------------------------------------------------------------------------
// rnndctl

static int ctl7(struct fixture *f, char **out, const char *a0, const char *a1, const char *a2,
                const char *a3, const char *a4, const char *a5, const char *a6, const char *a7) {
    const char *argv[14] = {rnndctl_bin(), "--target", f->d.grpc, a0, a1, a2, a3, a4, a5, a6, a7,
                            NULL};
    int rc = run_capture(argv, 30000, out);
    if (getenv("RNND_TEST_VERBOSE"))
        fprintf(stderr, "rnndctl %s %s ... -> %d\n%s", a0, a1 ? a1 : "", rc, *out);
    return rc;
}

static int ctl(struct fixture *f, char **out, const char *a0, const char *a1, const char *a2,
               const char *a3, const char *a4, const char *a5) {
    return ctl7(f, out, a0, a1, a2, a3, a4, a5, NULL, NULL);
}

static void expect_ctl(int rc_got, int rc_want, const char *out, const char *needle) {
    bool ok = rc_got == rc_want && (!needle || strstr(out, needle));
    if (!ok)
        fprintf(stderr, "rnndctl exited %d (want %d), output should contain \"%s\":\n%s\n", rc_got,
                rc_want, needle ? needle : "", out);
    assert_true(ok);
}

// The call runs before `out` is read (argument evaluation order is unspecified).
#define EXPECT_CTL(call, rc_want, needle)                                                          \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        expect_ctl(rc_, (rc_want), out, (needle));                                                 \
    } while (0)

static void test_rnndctl(void **state) {
    struct fixture *f = *state;
    char *out;
    char tmp[] = "/tmp/rnnd-ctl-XXXXXX";
    assert_non_null(mkdtemp(tmp));
    char file[300], file2[300];
    snprintf(file, sizeof file, "%s/w.safetensors", tmp);
    snprintf(file2, sizeof file2, "%s/w2.safetensors", tmp);

    const char *help[] = {rnndctl_bin(), "--help", NULL};
    EXPECT_CTL(run_capture(help, 5000, &out), 0, "bench");
    free(out);
    const char *bad[] = {rnndctl_bin(), "frobnicate", NULL};
    EXPECT_CTL(run_capture(bad, 5000, &out), 2, "frobnicate");
    free(out);
    const char *down[] = {rnndctl_bin(), "-t", "127.0.0.1:1", "--timeout-ms", "2000", "info", NULL};
    EXPECT_CTL(run_capture(down, 10000, &out), 1, "UNAVAILABLE");
    free(out);

    EXPECT_CTL(ctl(f, &out, "health", NULL, NULL, NULL, NULL, NULL), 0, "SERVING");
    free(out);
    EXPECT_CTL(ctl(f, &out, "info", NULL, NULL, NULL, NULL, NULL), 0, "hidden_size: 16");
    free(out);
    EXPECT_CTL(ctl(f, &out, "step", "--env", "700,701", "--init", "--steps", "3"), 0, "env 701:");
    free(out);
    EXPECT_CTL(ctl(f, &out, "step", "--env", "70000", NULL, NULL, NULL), 1, "FAILED_PRECONDITION");
    free(out);
    EXPECT_CTL(ctl(f, &out, "end", "--env", "700,701", NULL, NULL, NULL), 0, "released 2");
    free(out);

    // weights export: the file holds exactly what GetWeights returns.
    uint64_t v;
    float *w = get_params(f, &v);
    EXPECT_CTL(ctl(f, &out, "weights", "export", file, NULL, NULL, NULL), 0, "wrote");
    free(out);
    size_t len;
    FILE *fp = fopen(file, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    len = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc(len);
    assert_int_equal(fread(buf, 1, len, fp), len);
    fclose(fp);
    struct rnnd_st_file st;
    char why[256] = "";
    assert_int_equal(rnnd_st_decode(buf, len, &st, why, sizeof why), 0);
    float *p = malloc(sizeof(float) * f->r.P);
    int err = rnnd_st_decode_params(&f->r.m, &st, p, why, sizeof why);
    if (err)
        fprintf(stderr, "exported file: %s\n", why);
    assert_int_equal(err, 0);
    assert_memory_equal(p, w, sizeof(float) * f->r.P);
    rnnd_st_file_free(&st);
    free(buf);

    // weights import: a file made here (as PyTorch would save it) becomes the served weights.
    float *n = random_params(f, 0.2f);
    void *enc;
    size_t enc_len;
    assert_int_equal(rnnd_st_encode_params(&f->r.m, n, NULL, 0, &enc, &enc_len), 0);
    fp = fopen(file2, "wb");
    assert_int_equal(fwrite(enc, 1, enc_len, fp), enc_len);
    fclose(fp);
    free(enc);
    EXPECT_CTL(ctl(f, &out, "weights", "import", file2, NULL, NULL, NULL), 0, "imported");
    free(out);
    float *got = get_params(f, &v);
    assert_memory_equal(got, n, sizeof(float) * f->r.P);
    // And back: importing the exported file restores the first weights.
    EXPECT_CTL(ctl(f, &out, "weights", "import", file, NULL, NULL, NULL), 0, "imported");
    free(out);
    free(got);
    got = get_params(f, &v);
    assert_memory_equal(got, w, sizeof(float) * f->r.P);
    // A file that is not safetensors is refused before anything is sent.
    fp = fopen(file2, "wb");
    fputs("not a safetensors file", fp);
    fclose(fp);
    EXPECT_CTL(ctl(f, &out, "weights", "import", file2, NULL, NULL, NULL), 1, "safetensors");
    free(out);

    EXPECT_CTL(ctl(f, &out, "checkpoint", NULL, NULL, NULL, NULL, NULL), 0, "path: ");
    free(out);
    EXPECT_CTL(ctl7(f, &out, "bench", "-c", "2", "-e", "4", "-d", "0.5", "--warmup=0.2"), 0,
               "GetModelInfo");
    assert_non_null(strstr(out, "env-steps/s"));
    free(out);
    EXPECT_CTL(ctl7(f, &out, "bench", "-c", "1", "--stream", "-d", "0.3", "--no-floor", NULL), 0,
               "StepStream");
    free(out);
    free(w);
    free(p);
    free(n);
    free(got);
    remove(file);
    remove(file2);
    rmdir(tmp);
    ref_reload(&f->r, f->c);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints and restarts.

static bool inside(const char *path, const char *dir) {
    size_t n = strlen(dir);
    return strncmp(path, dir, n) == 0 && path[n] == '/';
}

static float *read_checkpoint_params(struct fixture *f, const char *dir) {
    char file[1200];
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    FILE *fp = fopen(file, "rb");
    if (!fp)
        fprintf(stderr, "no %s\n", file);
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    size_t len = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc(len);
    assert_int_equal(fread(buf, 1, len, fp), len);
    fclose(fp);
    struct rnnd_st_file st;
    char why[256] = "";
    int err = rnnd_st_decode(buf, len, &st, why, sizeof why);
    float *p = malloc(sizeof(float) * f->r.P);
    if (!err)
        err = rnnd_st_decode_params(&f->r.m, &st, p, why, sizeof why);
    if (err)
        fprintf(stderr, "%s: %s\n", file, why);
    assert_int_equal(err, 0);
    rnnd_st_file_free(&st);
    free(buf);
    return p;
}

static void test_checkpoint_contents(void **state) {
    struct fixture *f = *state;
    uint64_t v;
    float *w = get_params(f, &v);
    char *path = NULL;
    uint64_t cv;
    EXPECT_OK(rnnd_client_save_checkpoint(f->c, NULL, &path, &cv));
    assert_int_equal(cv, v);
    // The daemon may report the state dir through a symlink-free or relative spelling; the
    // directory must be inside it either way.
    char real_state[4096], real_path[4096];
    assert_non_null(realpath(f->d.state_dir, real_state));
    assert_non_null(realpath(path, real_path));
    if (!inside(real_path, real_state))
        fprintf(stderr, "checkpoint %s is not inside %s\n", real_path, real_state);
    assert_true(inside(real_path, real_state));
    float *p = read_checkpoint_params(f, real_path);
    assert_memory_equal(p, w, sizeof(float) * f->r.P);
    free(p);
    free(path);
    EXPECT_OK(rnnd_client_save_checkpoint(f->c, "named-one", &path, NULL));
    assert_non_null(realpath(path, real_path));
    char want[4200];
    snprintf(want, sizeof want, "%s/named-one", real_state);
    assert_string_equal(real_path, want);
    free(path);
    free(w);
}

// Steps envs 10..13 (slots 10..13) once, checking against the reference.
static void step_envs(struct fixture *f, bool init, const char *what) {
    uint64_t ids[4] = {10, 11, 12, 13};
    int32_t slots[4] = {10, 11, 12, 13};
    bool inits[4] = {init, init, init, init};
    float x[4 * I_], ref[4 * H_];
    rng_fill(&f->g, x, 4 * I_);
    struct rnnd_step_req req = {.n_env_ids = 4,
                                .env_ids = ids,
                                .obs = rnnd_tensor_f32(x, 2, 4, I_, 0, 0),
                                .n_is_init = 4,
                                .is_init = inits};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    ref_step(&f->r, 4, slots, x, inits, ref);
    assert_true(close_f32(what, r.output.data, ref, 4 * H_, ATOL, RTOL));
    rnnd_step_reply_free(&r);
}

static void restart(struct fixture *f, const char *const *extra) {
    rnnd_client_free(f->c);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", f->d.state_dir);
    const char *args[32];
    int n = 0;
    for (int k = 0; daemon_args[k]; k++)
        args[n++] = daemon_args[k];
    for (int k = 0; extra && extra[k]; k++)
        args[n++] = extra[k];
    args[n] = NULL;
    assert_int_equal(daemon_start_in(&f->d, dir, true, args), 0);
    f->c = daemon_client(&f->d, NULL);
}

static void test_clean_restart(void **state) {
    struct fixture *f = *state;
    step_envs(f, true, "before restart");
    step_envs(f, false, "before restart");
    // An update too, so the version moves.
    float *g = random_params(f, 0.01f);
    struct rnnd_named_tensors gl;
    assert_int_equal(rnnd_named_tensors_from_params(&gl, &f->r.m, g), 0);
    uint64_t v;
    EXPECT_OK(rnnd_client_apply_gradients(f->c, &gl, NULL, &v));
    rnnd_named_tensors_free(&gl);
    free(g);
    ref_reload(&f->r, f->c);
    step_envs(f, false, "after update");
    // env 20 carries a step index.
    uint64_t id = 20, k = 0;
    bool init = true;
    float x[I_] = {0};
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &id,
                                .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &init,
                                .n_step_index = 1,
                                .step_index = &k};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    rnnd_step_reply_free(&r);
    struct rnnd_model_info before;
    EXPECT_OK(rnnd_client_info(f->c, &before));
    float *w = get_params(f, &v);

    assert_int_equal(daemon_signal_wait(&f->d, SIGTERM, 15000), 0);
    if (!WIFEXITED(f->d.exit_status) || WEXITSTATUS(f->d.exit_status) != 0) {
        fprintf(stderr, "rnnd exited with status 0x%x after SIGTERM\n", f->d.exit_status);
        daemon_dump_log(&f->d, 3000);
    }
    assert_true(WIFEXITED(f->d.exit_status) && WEXITSTATUS(f->d.exit_status) == 0);
    restart(f, NULL);

    struct rnnd_model_info after;
    EXPECT_OK(rnnd_client_info(f->c, &after));
    assert_int_equal(after.model_version, before.model_version);
    assert_int_equal(after.envs_active, before.envs_active);
    float *w2 = get_params(f, &v);
    assert_memory_equal(w2, w, sizeof(float) * f->r.P);
    // Env states survived: the next steps continue without a reset.
    step_envs(f, false, "after restart");
    init = false;
    k = 2; // a skip is still refused: the index history survived
    EXPECT_STATUS(rnnd_client_step(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    k = 1;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    rnnd_step_reply_free(&r);
    free(w);
    free(w2);
}

static void test_kill9_and_corrupt(void **state) {
    struct fixture *f = *state;
    uint64_t v;
    // Checkpoint A.
    float *a = random_params(f, 0.3f);
    set_params(f, a, &v);
    char *path_a = NULL, *path_b = NULL;
    EXPECT_OK(rnnd_client_save_checkpoint(f->c, NULL, &path_a, NULL));
    sleep_ms(1100); // automatic names carry the time
    // Checkpoint B, then weights C that no checkpoint holds.
    float *b = random_params(f, 0.3f);
    set_params(f, b, &v);
    EXPECT_OK(rnnd_client_save_checkpoint(f->c, NULL, &path_b, NULL));
    float *c = random_params(f, 0.3f);
    set_params(f, c, &v);

    // kill -9: the daemon comes back from the newest checkpoint, B.
    assert_int_equal(daemon_signal_wait(&f->d, SIGKILL, 5000), 0);
    restart(f, NULL);
    float *got = get_params(f, &v);
    assert_memory_equal(got, b, sizeof(float) * f->r.P);
    free(got);

    // B corrupt: refused with a message, A used instead.
    assert_int_equal(daemon_signal_wait(&f->d, SIGKILL, 5000), 0);
    char file[1200];
    snprintf(file, sizeof file, "%s/model.safetensors", path_b);
    FILE *fp = fopen(file, "r+b");
    assert_non_null(fp);
    fputs("garbage garbage garbage", fp);
    fclose(fp);
    restart(f, NULL);
    got = get_params(f, &v);
    if (memcmp(got, a, sizeof(float) * f->r.P) != 0)
        daemon_dump_log(&f->d, 2000);
    assert_memory_equal(got, a, sizeof(float) * f->r.P);
    free(got);

    // --restore names one checkpoint explicitly.
    assert_int_equal(daemon_signal_wait(&f->d, SIGKILL, 5000), 0);
    snprintf(file, sizeof file, "%s/named-one", f->d.state_dir);
    const char *extra[] = {"--restore", file, NULL};
    struct stat sb;
    if (stat(file, &sb) == 0) {
        restart(f, extra);
        float *named = read_checkpoint_params(f, file);
        got = get_params(f, &v);
        assert_memory_equal(got, named, sizeof(float) * f->r.P);
        free(got);
        free(named);
    }
    free(a);
    free(b);
    free(c);
    free(path_a);
    free(path_b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_init), cmocka_unit_test(test_set_get_roundtrip),
        cmocka_unit_test(test_rnndctl),        cmocka_unit_test(test_checkpoint_contents),
        cmocka_unit_test(test_clean_restart),  cmocka_unit_test(test_kill9_and_corrupt),
    };
    return cmocka_run_group_tests_name("weights", tests, setup, teardown) ? 1 : 0;
}
