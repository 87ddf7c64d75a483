/*
 * test_weights.c: weights and persistence. GetWeights names and shapes (PyTorch's), seeded
 * initialisation, SetWeights/GetWeights round trip (and Step uses what was set), rnndctl (every
 * command, weights export|import through safetensors files), SaveCheckpoint contents, and
 * restarts: a clean SIGTERM restart keeps weights, version, env states and recorded trajectories
 * (Forward over recorded steps continues as if the daemon never stopped); after kill -9 the
 * daemon comes back from the last checkpoint and logs how old it is; a corrupt newest checkpoint
 * is skipped for the next older one; --restore loads the one named; automatic checkpoints
 * (in auto/) rotate (three kept); --weights starts from a safetensors file unless a checkpoint
 * is newer.
 */
#include "harness.h"

#include <grpc/status.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
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
    ref_free(&f->r);
    rnnd_client_free(f->c);
    daemon_teardown(&f->d);
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
        struct rnnd_step_req req = step_request(1, &id, x, I_, &init);
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
    const char *version[] = {rnndctl_bin(), "--version", NULL};
    EXPECT_CTL(run_capture(version, 5000, &out), 0,
               "rnndctl " RNND_VERSION " (commit " RNND_COMMIT ")\n");
    free(out);
    // A daemon that is not there: the error names the address and what to check.
    const char *down[] = {rnndctl_bin(), "-t", "127.0.0.1:1", "--timeout-ms", "2000", "info", NULL};
    EXPECT_CTL(run_capture(down, 10000, &out), 1, "UNAVAILABLE");
    assert_non_null(strstr(out, "(is rnnd running at 127.0.0.1:1?)"));
    free(out);
    const char *down_health[] = {rnndctl_bin(), "-t", "127.0.0.1:1", "health", "--watch", NULL};
    EXPECT_CTL(run_capture(down_health, 10000, &out), 1, "(is rnnd running at 127.0.0.1:1?)");
    free(out);

    EXPECT_CTL(ctl(f, &out, "health", NULL, NULL, NULL, NULL, NULL), 0, "SERVING");
    free(out);
    EXPECT_CTL(ctl(f, &out, "info", NULL, NULL, NULL, NULL, NULL), 0, "hidden_size: 16");
    free(out);
    EXPECT_CTL(ctl(f, &out, "step", "--env", "700,701", "--init", "--steps", "3"), 0, "env 701:");
    free(out);
    // bench with bfloat16 on the wire both ways (a reply in another dtype counts as an error).
    EXPECT_CTL(ctl7(f, &out, "bench", "--dtype", "bfloat16", "--envs", "4", "--duration", "0.2",
                    "--no-floor"),
               0, "errors 0");
    assert_non_null(strstr(out, "bfloat16"));
    free(out);
    EXPECT_CTL(ctl(f, &out, "bench", "--dtype", "int8", NULL, NULL, NULL), 2, "bad --dtype");
    free(out);
    // --paired: the floor from the same window, a GetModelInfo after every Step on each
    // connection, both lines with calls in them.
    EXPECT_CTL(ctl7(f, &out, "bench", "-c", "2", "-d", "0.3", "--warmup=0.1", "--paired", NULL), 0,
               "(paired");
    assert_non_null(strstr(out, "GetModelInfo"));
    assert_null(strstr(out, " 0 req/s"));
    assert_null(strstr(out, "nan"));
    free(out);
    EXPECT_CTL(ctl(f, &out, "bench", "--paired", "--no-floor", NULL, NULL, NULL), 2, "--paired");
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

// Steps envs 10..13 (slots 10..13) once, checking against the reference; the outputs (4, H) go
// to out when it is not NULL.
static void step_envs_out(struct fixture *f, bool init, const char *what, float *out) {
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
    if (out)
        memcpy(out, r.output.data, sizeof(float) * 4 * H_);
    rnnd_step_reply_free(&r);
}

static void step_envs(struct fixture *f, bool init, const char *what) {
    step_envs_out(f, init, what, NULL);
}

// Forward over the last T recorded steps of envs 10..13.
static void forward_recorded(struct fixture *f, uint32_t T, struct rnnd_forward_reply *r) {
    uint64_t ids[4] = {10, 11, 12, 13};
    struct rnnd_forward_req req = {.recorded = true, .n_env_ids = 4, .env_ids = ids, .steps = T};
    EXPECT_OK(rnnd_client_forward(f->c, &req, r));
    assert_tensor_f32(&r->output, 3, 4, T, H_, 0);
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
    float last[4 * H_];
    step_envs_out(f, false, "after update", last);
    struct rnnd_forward_reply before_rec;
    forward_recorded(f, 2, &before_rec);
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
    if (daemon_log_contains(&f->d, "did not stop cleanly") ||
        !daemon_log_contains(&f->d, " ago (version")) {
        daemon_dump_log(&f->d, 2000);
        fail_msg("a clean restart should log the restored checkpoint's age, no crash warning");
    }

    struct rnnd_model_info after;
    EXPECT_OK(rnnd_client_info(f->c, &after));
    assert_int_equal(after.model_version, before.model_version);
    assert_int_equal(after.envs_active, before.envs_active);
    float *w2 = get_params(f, &v);
    assert_memory_equal(w2, w, sizeof(float) * f->r.P);
    // Recorded steps survived: the same window replays to the same outputs and inputs.
    struct rnnd_forward_reply after_rec;
    forward_recorded(f, 2, &after_rec);
    assert_memory_equal(after_rec.output.data, before_rec.output.data, sizeof(float) * 4 * 2 * H_);
    assert_memory_equal(after_rec.obs.data, before_rec.obs.data, sizeof(float) * 4 * 2 * I_);
    assert_memory_equal(after_rec.is_init.data, before_rec.is_init.data, 4 * 2);
    assert_memory_equal(after_rec.step_model_version.data, before_rec.step_model_version.data,
                        sizeof(int64_t) * 4 * 2);
    rnnd_forward_reply_free(&after_rec);
    // Env states survived: the next steps continue without a reset, and a window that spans the
    // restart equals what Step returned on either side of it.
    float next[4 * H_];
    step_envs_out(f, false, "after restart", next);
    forward_recorded(f, 2, &after_rec);
    for (int b = 0; b < 4; b++) {
        const float *o = (const float *)after_rec.output.data + (size_t)b * 2 * H_;
        assert_true(
            close_f32("recorded step before the restart", o, last + b * H_, H_, ATOL, RTOL));
        assert_true(
            close_f32("recorded step after the restart", o + H_, next + b * H_, H_, ATOL, RTOL));
    }
    rnnd_forward_reply_free(&after_rec);
    rnnd_forward_reply_free(&before_rec);
    init = false;
    k = 2; // a skip is still refused: the index history survived
    EXPECT_STATUS(rnnd_client_step(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    k = 1;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    rnnd_step_reply_free(&r);
    free(w);
    free(w2);
}

// Rings that wrapped (more steps than --trajectory-steps), with a reset inside: a clean restart
// brings every recorded row back bit for bit from the trajectory store's snapshot, and a restart
// with a shorter ring keeps the newest steps.
static void test_restart_wrapped_rings(void **state) {
    struct fixture *f = *state;
    for (int k = 0; k < 300; k++)
        step_envs(f, k == 150, "stepping past the ring");
    enum { T = 256, T2 = 100 };
    struct rnnd_forward_reply before, after;
    forward_recorded(f, T, &before);
    assert_int_equal(daemon_signal_wait(&f->d, SIGTERM, 15000), 0);
    restart(f, NULL);
    forward_recorded(f, T, &after);
    assert_memory_equal(after.output.data, before.output.data, sizeof(float) * 4 * T * H_);
    assert_memory_equal(after.obs.data, before.obs.data, sizeof(float) * 4 * T * I_);
    assert_memory_equal(after.is_init.data, before.is_init.data, 4 * T);
    assert_memory_equal(after.step_model_version.data, before.step_model_version.data,
                        sizeof(int64_t) * 4 * T);
    rnnd_forward_reply_free(&after);
    // A shorter ring: the newest T2 steps, from the state recorded before the first of them.
    assert_int_equal(daemon_signal_wait(&f->d, SIGTERM, 15000), 0);
    restart(f, (const char *[]){"--trajectory-steps", "100", NULL});
    forward_recorded(f, T2, &after);
    for (int b = 0; b < 4; b++) {
        size_t o = (size_t)b * T + (T - T2);
        assert_memory_equal((const float *)after.obs.data + (size_t)b * T2 * I_,
                            (const float *)before.obs.data + o * I_, sizeof(float) * T2 * I_);
        assert_memory_equal((const uint8_t *)after.is_init.data + (size_t)b * T2,
                            (const uint8_t *)before.is_init.data + o, T2);
        assert_true(close_f32("the newest steps of a shorter ring",
                              (const float *)after.output.data + (size_t)b * T2 * H_,
                              (const float *)before.output.data + o * H_, T2 * H_, ATOL, RTOL));
    }
    rnnd_forward_reply_free(&after);
    rnnd_forward_reply_free(&before);
    step_envs(f, false, "after the restarts"); // the env states continue
    assert_int_equal(daemon_signal_wait(&f->d, SIGTERM, 15000), 0);
    restart(f, NULL);
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

    // kill -9: the daemon comes back from the newest checkpoint, B, and says the last run did
    // not stop cleanly and how old the checkpoint is.
    sleep_ms(300);
    assert_int_equal(daemon_signal_wait(&f->d, SIGKILL, 5000), 0);
    restart(f, NULL);
    float *got = get_params(f, &v);
    assert_memory_equal(got, b, sizeof(float) * f->r.P);
    free(got);
    if (!daemon_log_contains(&f->d, "did not stop cleanly") ||
        !daemon_log_contains(&f->d, path_b) || !daemon_log_contains(&f->d, " s ago")) {
        daemon_dump_log(&f->d, 2000);
        fail_msg("after kill -9 the log should name %s, its age and the unclean stop", path_b);
    }

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

// Automatic checkpoints ("ckpt-*" in dir/auto); the newest name (they sort by time) into newest.
static int count_auto(const char *state_dir, char *newest, size_t cap) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/auto", state_dir);
    DIR *dp = opendir(dir);
    assert_non_null(dp);
    int n = 0;
    if (newest)
        newest[0] = '\0';
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (strncmp(e->d_name, "ckpt-", 5) != 0)
            continue;
        n++;
        if (newest && strcmp(e->d_name, newest) > 0)
            snprintf(newest, cap, "%s", e->d_name);
    }
    closedir(dp);
    return n;
}

static void test_rotation(void **state) {
    struct fixture *f = *state;
    // A clean restart first: the daemon before came from --restore of an older checkpoint, which
    // keeps the automatic checkpoints newer than that out of the rotation (test_checkpoints.c).
    assert_int_equal(daemon_signal_wait(&f->d, SIGTERM, 15000), 0);
    restart(f, NULL);
    // SaveCheckpoint without a name joins the rotation: three automatic ones stay, the named
    // one is the caller's and stays too.
    for (int k = 0; k < 5; k++) {
        char *path = NULL;
        EXPECT_OK(rnnd_client_save_checkpoint(f->c, NULL, &path, NULL));
        free(path);
    }
    char newest[256], named[512];
    assert_int_equal(count_auto(f->d.state_dir, newest, sizeof newest), 3);
    snprintf(named, sizeof named, "%s/named-one/model.safetensors", f->d.state_dir);
    struct stat sb;
    assert_int_equal(stat(named, &sb), 0);

    // Periodic checkpoints (--checkpoint-interval-s) rotate the same way.
    assert_int_equal(daemon_signal_wait(&f->d, SIGTERM, 15000), 0);
    const char *extra[] = {"--checkpoint-interval-s", "1", NULL};
    restart(f, extra);
    assert_int_equal(count_auto(f->d.state_dir, newest, sizeof newest), 3);
    char before[256];
    snprintf(before, sizeof before, "%s", newest);
    int status;
    char *body = NULL;
    double ok0 = 0, ok1 = 0;
    assert_int_equal(http_get(f->d.http, "/metrics", &status, NULL, &body), 0);
    ok0 = prom_value(body, "rnnd_checkpoints_total", "result=\"ok\"");
    free(body);
    sleep_ms(2600);
    assert_int_equal(http_get(f->d.http, "/metrics", &status, NULL, &body), 0);
    ok1 = prom_value(body, "rnnd_checkpoints_total", "result=\"ok\"");
    free(body);
    fprintf(stderr, "  periodic checkpoints in 2.6 s: %.0f\n", ok1 - ok0);
    assert_true(ok1 - ok0 >= 2);
    assert_int_equal(count_auto(f->d.state_dir, newest, sizeof newest), 3);
    assert_true(strcmp(newest, before) > 0);
}

// Writes the model's parameters p as a safetensors file, as safetensors.torch.save_file would.
static void write_weights(const struct rnnd_model *m, const float *p, const char *file) {
    void *enc;
    size_t len;
    assert_int_equal(rnnd_st_encode_params(m, p, NULL, 0, &enc, &len), 0);
    FILE *fp = fopen(file, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(enc, 1, len, fp), len);
    fclose(fp);
    free(enc);
}

static void test_weights_flag(void **state) {
    struct fixture *f = *state;
    char tmp[] = "/tmp/rnnd-weights-XXXXXX";
    assert_non_null(mkdtemp(tmp));
    char file1[300], file2[300], small[300];
    snprintf(file1, sizeof file1, "%s/a.safetensors", tmp);
    snprintf(file2, sizeof file2, "%s/b.safetensors", tmp);
    snprintf(small, sizeof small, "%s/small.safetensors", tmp);
    float *p1 = random_params(f, 0.25f), *p2 = random_params(f, 0.25f);
    write_weights(&f->r.m, p1, file1);
    write_weights(&f->r.m, p2, file2);
    struct rnnd_model other = f->r.m;
    other.L = 1;
    write_weights(&other, p1, small);

    const char *args[32];
    int n = 0;
    for (int k = 0; daemon_args[k]; k++)
        args[n++] = daemon_args[k];
    args[n++] = "--weights";
    args[n++] = file1;
    args[n] = NULL;
    struct daemon d2;
    assert_int_equal(daemon_start(&d2, args), 0);
    struct rnnd_client *c2 = daemon_client(&d2, NULL);
    struct rnnd_named_tensors w;
    uint64_t v = 99;
    EXPECT_OK(rnnd_client_get_weights(c2, &w, &v));
    float *got = malloc(sizeof(float) * f->r.P);
    assert_int_equal(rnnd_named_tensors_to_params(&w, &f->r.m, got), 0);
    rnnd_named_tensors_free(&w);
    assert_memory_equal(got, p1, sizeof(float) * f->r.P);
    assert_int_equal(v, 0);

    // After a restart the daemon's own checkpoint wins over --weights, and the log says so.
    rnnd_client_free(c2);
    assert_int_equal(daemon_signal_wait(&d2, SIGTERM, 15000), 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", d2.state_dir);
    args[n - 1] = file2;
    assert_int_equal(daemon_start_in(&d2, dir, true, args), 0);
    c2 = daemon_client(&d2, NULL);
    EXPECT_OK(rnnd_client_get_weights(c2, &w, &v));
    assert_int_equal(rnnd_named_tensors_to_params(&w, &f->r.m, got), 0);
    rnnd_named_tensors_free(&w);
    assert_memory_equal(got, p1, sizeof(float) * f->r.P);
    assert_true(daemon_log_contains(&d2, "not loaded"));
    rnnd_client_free(c2);
    daemon_free(&d2);

    // A missing file or one of another shape stops the start with a message naming the flag.
    const char *bad[] = {file2, small};
    snprintf(file2, sizeof file2, "%s/missing.safetensors", tmp);
    for (int i = 0; i < 2; i++) {
        const char *argv[] = {rnnd_bin(),  "--backend",     "cpu",    "--listen", "127.0.0.1:0",
                              "--http",    "off",           "--cell", "gru",      "--input-size",
                              "8",         "--hidden-size", "16",     "--layers", "2",
                              "--weights", bad[i],          NULL};
        char *out = NULL;
        int rc = run_capture(argv, 20000, &out);
        if (rc == 0 || !out || !strstr(out, "--weights") || !strstr(out, bad[i]))
            fail_msg("rnnd --weights %s: exit %d, output:\n%s", bad[i], rc, out ? out : "");
        free(out);
    }
    free(got);
    free(p1);
    free(p2);
    remove(file1);
    remove(small);
    snprintf(file2, sizeof file2, "%s/b.safetensors", tmp);
    remove(file2);
    rmdir(tmp);
}

// A device backend may step many rows at a large H on a copy it derives from the weights
// (CUDA: fp16, struct rnnd_step.derived), which every change of the weights must make again.
// 512 envs of an LSTM at H = 512 in fp32 mode (tensor cores on CUDA, whatever RNND_COMPUTE
// says), one Step for all of them after each way the weights change: seeded at start, SetWeights,
// ApplyGradients, and a clean restart from the checkpoint after one more update. A stale copy
// would step on the old weights, far outside the tolerance (the CPU backend computes exactly).
static void test_large_steps_follow_weights(void **state) {
    (void)state;
    enum { N = 512, LI = 64, LH = 512 };
    const char *args[] = {"--cell",      "lstm", "--input-size", "64",   "--hidden-size", "512",
                          "--max-batch", "512",  "--compute",    "fp32", "--seed",        "5",
                          NULL};
    struct fixture f = {.g = {77}};
    assert_int_equal(daemon_start(&f.d, args), 0);
    f.c = daemon_client(&f.d, NULL);
    ref_init(&f.r, f.c, N);
    uint64_t *ids = malloc(N * sizeof *ids);
    int32_t *slots = malloc(N * sizeof *slots);
    bool *init = malloc(N);
    float *x = malloc(sizeof(float) * N * LI), *ref = malloc(sizeof(float) * N * LH);
    for (int k = 0; k < N; k++)
        ids[k] = 70000 + (uint64_t)k, slots[k] = k, init[k] = true;
    for (int round = 0; round < 4; round++) {
        if (round == 1) { // SetWeights
            float *p = random_params(&f, 0.05f);
            set_params(&f, p, NULL);
            free(p);
        } else if (round >= 2) { // ApplyGradients; before round 3, one more and a restart
            float *g = random_params(&f, 0.5f);
            struct rnnd_named_tensors gl;
            assert_int_equal(rnnd_named_tensors_from_params(&gl, &f.r.m, g), 0);
            const float lr = 0.02f; // Adam: every weight moves by about lr
            EXPECT_OK(rnnd_client_apply_gradients(f.c, &gl, &lr, NULL));
            rnnd_named_tensors_free(&gl);
            free(g);
            if (round == 3) {
                assert_int_equal(daemon_signal_wait(&f.d, SIGTERM, 15000), 0);
                rnnd_client_free(f.c);
                char dir[256];
                snprintf(dir, sizeof dir, "%s", f.d.state_dir);
                assert_int_equal(daemon_start_in(&f.d, dir, true, args), 0);
                f.c = daemon_client(&f.d, NULL);
            }
        }
        ref_reload(&f.r, f.c);
        rng_fill(&f.g, x, N * LI);
        struct rnnd_step_req req = step_request(N, ids, x, LI, init);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f.c, &req, &r));
        ref_step(&f.r, N, slots, x, init, ref);
        char what[64];
        snprintf(what, sizeof what, "512 rows at H = 512, round %d", round);
        assert_true(close_f32(what, r.output.data, ref, (size_t)N * LH, 2e-3f, 2e-2f));
        rnnd_step_reply_free(&r);
        memset(init, 0, N);
    }
    free(ids), free(slots), free(init), free(x), free(ref);
    teardown((void *[]){&f});
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_init),    cmocka_unit_test(test_set_get_roundtrip),
        cmocka_unit_test(test_rnndctl),           cmocka_unit_test(test_checkpoint_contents),
        cmocka_unit_test(test_clean_restart),     cmocka_unit_test(test_restart_wrapped_rings),
        cmocka_unit_test(test_kill9_and_corrupt), cmocka_unit_test(test_rotation),
        cmocka_unit_test(test_weights_flag),      cmocka_unit_test(test_large_steps_follow_weights),
    };
    return cmocka_run_group_tests_name("weights", tests, setup, teardown) ? 1 : 0;
}
