/*
 * test_checkpoints.c: what the operator or the disk may do to --state-dir, and that no trained
 * state is lost to it. Each test drives real daemons over one state directory:
 *   config slip     checkpoints of H=16, restarted with H=32: the start is refused (one line per
 *                   checkpoint, the flag that starts fresh named), --fresh-start 1 runs without
 *                   rotating them away, and H=16 again restores the trained weights;
 *   namespaces      named checkpoints (even "ckpt-zz-...") never rotate nor push automatic ones
 *                   out, and after kill -9 the newest automatic one is restored, not a named one;
 *   earlier layout  an automatic checkpoint at the top of the state dir, without checksums,
 *                   still restores (with a warning) and is never rotated;
 *   failures        a --state-dir that cannot be created stops the start; failing periodic
 *                   checkpoints are tried once per interval, counted; a failed final checkpoint
 *                   exits non-zero;
 *   integrity       a flipped byte, a NaN weight and a changed env id are refused, a missing part
 *                   is named, temporaries of a write cut short are removed; when none loads the
 *                   start is refused;
 *   modes           state dir 0700 and checkpoint files 0600 under umask 0; a token file that
 *                   others can read is warned about.
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

static const struct rnnd_model model16 = {.cell = RNND_CELL_GRU, .I = 8, .H = 16, .L = 2};

// The model flags with hidden size H, then extra (NULL-terminated, may be NULL).
static const char *const *args_with(const char *H, const char *const *extra) {
    static const char *args[32];
    const char *base[] = {"--cell",   "gru", "--input-size", "8", "--hidden-size", H,
                          "--layers", "2",   "--seed",       "9"};
    int n = 0;
    for (size_t k = 0; k < sizeof base / sizeof base[0]; k++)
        args[n++] = base[k];
    for (int k = 0; extra && extra[k]; k++)
        args[n++] = extra[k];
    args[n] = NULL;
    return args;
}

// How often needle occurs in the log of d's latest start.
static int log_count(const struct daemon *d, const char *needle) {
    size_t len;
    char *log = read_file(d->log_path, &len);
    int n = 0;
    for (const char *p = log && len >= d->log_start ? log + d->log_start : "";
         (p = strstr(p, needle)); p++)
        n++;
    free(log);
    return n;
}

// Starts rnnd on dir expecting it to refuse: its exit status, once it has exited. Fails the
// test when it gets ready instead.
static int start_refused(struct daemon *d, const char *dir, const char *const *args) {
    assert_int_equal(daemon_spawn_in(d, dir, true, args), 0);
    for (double t0 = now_seconds(); now_seconds() - t0 < 30;) {
        if (!daemon_alive(d))
            return WIFEXITED(d->exit_status) ? WEXITSTATUS(d->exit_status) : 128;
        if (daemon_log_contains(d, "rnnd ready ")) {
            daemon_dump_log(d, 3000);
            daemon_signal_wait(d, SIGKILL, 5000);
            fail_msg("rnnd started on %s; it should have refused", dir);
        }
        sleep_ms(20);
    }
    daemon_dump_log(d, 3000);
    fail_msg("rnnd neither started nor exited");
    return -1;
}

// SIGTERM, and the exit status (-1 when it did not exit in time).
static int stop(struct daemon *d) {
    if (daemon_signal_wait(d, SIGTERM, 15000) != 0)
        return -1;
    return WIFEXITED(d->exit_status) ? WEXITSTATUS(d->exit_status) : 128;
}

// The names in state_dir/auto, sorted (oldest first: they carry the time); their count.
static int auto_names(const char *state_dir, char names[][128], int cap) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/auto", state_dir);
    struct dirent **list;
    int n = scandir(dir, &list, NULL, alphasort), k = 0;
    for (int i = 0; i < n; i++) {
        if (list[i]->d_name[0] != '.' && k < cap)
            snprintf(names[k++], 128, "%.127s", list[i]->d_name);
        free(list[i]);
    }
    if (n >= 0)
        free(list);
    return k;
}

static bool exists(const char *dir, const char *rel) {
    char p[1024];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, rel);
    return stat(p, &st) == 0;
}

static float *get_params(struct rnnd_client *c) {
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(c, &w, NULL));
    float *p = malloc(sizeof(float) * rnnd_model_param_count(&model16));
    assert_int_equal(rnnd_named_tensors_to_params(&w, &model16, p), 0);
    rnnd_named_tensors_free(&w);
    return p;
}

// New random weights, set on the daemon; returned (free()).
static float *set_random(struct rnnd_client *c, struct rng *g) {
    size_t P = rnnd_model_param_count(&model16);
    float *p = malloc(sizeof(float) * P);
    rng_fill(g, p, P);
    struct rnnd_named_tensors l;
    assert_int_equal(rnnd_named_tensors_from_params(&l, &model16, p), 0);
    EXPECT_OK(rnnd_client_set_weights(c, &l, NULL));
    rnnd_named_tensors_free(&l);
    return p;
}

static void assert_params(struct rnnd_client *c, const float *want, const char *what) {
    float *got = get_params(c);
    if (memcmp(got, want, sizeof(float) * rnnd_model_param_count(&model16)) != 0)
        fail_msg("the weights are not those of %s", what);
    free(got);
}

// Steps envs 1..4 once, so that checkpoints hold env states and recorded steps.
static void step_envs(struct rnnd_client *c, struct rng *g) {
    uint64_t ids[4] = {1, 2, 3, 4};
    bool init[4] = {true, true, true, true};
    float x[4 * 8];
    rng_fill(g, x, 4 * 8);
    struct rnnd_step_req req = {.n_env_ids = 4,
                                .env_ids = ids,
                                .obs = rnnd_tensor_f32(x, 2, 4, 8, 0, 0),
                                .n_is_init = 4,
                                .is_init = init};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(c, &req, &r));
    rnnd_step_reply_free(&r);
}

static char *save(struct rnnd_client *c, const char *name) {
    char *path = NULL;
    EXPECT_OK(rnnd_client_save_checkpoint(c, name, &path, NULL));
    sleep_ms(5); // distinct creation times
    return path;
}

// Flips one byte of file at off from its end (inside the data).
static void flip_byte(const char *file, long off) {
    FILE *fp = fopen(file, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, -off, SEEK_END), 0);
    int ch = fgetc(fp);
    assert_int_equal(fseek(fp, -off, SEEK_END), 0);
    fputc(ch ^ 0x10, fp);
    fclose(fp);
}

// ---------------------------------------------------------------------------------------------

static void test_config_slip(void **state) {
    (void)state;
    struct daemon d;
    struct rng g = {11};
    assert_int_equal(daemon_start(&d, args_with("16", NULL)), 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", d.state_dir);
    struct rnnd_client *c = daemon_client(&d, NULL);
    step_envs(c, &g);
    float *trained = set_random(c, &g);
    free(save(c, NULL));
    free(save(c, NULL));
    rnnd_client_free(c);
    assert_int_equal(stop(&d), 0); // the shutdown checkpoint is the third
    char before[8][128];
    int n = auto_names(dir, before, 8);
    assert_int_equal(n, 3);

    // A config slip: every checkpoint is refused, each on its own line, and nothing starts.
    int rc = start_refused(&d, dir, args_with("32", NULL));
    int lines = log_count(&d, "refused: model.safetensors does not fit");
    fprintf(stderr, "  --hidden-size 32: exit %d, %d refusal lines\n", rc, lines);
    if (rc == 0 || lines != n || !daemon_log_contains(&d, "--fresh-start 1")) {
        daemon_dump_log(&d, 3000);
        fail_msg("a state dir of checkpoints that do not load must stop the start, naming each "
                 "and --fresh-start");
    }

    // Started fresh on purpose, with four periodic checkpoints and a shutdown one: the trained
    // checkpoints stay.
    const char *fresh[] = {"--fresh-start", "1", "--checkpoint-interval-s", "1", NULL};
    assert_int_equal(daemon_start_in(&d, dir, true, args_with("32", fresh)), 0);
    assert_true(daemon_log_contains(&d, "--fresh-start: starting from --seed"));
    sleep_ms(4300);
    assert_int_equal(stop(&d), 0);
    char after[16][128], rel[160];
    int m = auto_names(dir, after, 16);
    fprintf(stderr, "  after the fresh start: %d automatic checkpoints\n", m);
    for (int i = 0; i < n; i++) {
        snprintf(rel, sizeof rel, "auto/%.127s", before[i]);
        if (!exists(dir, rel))
            fail_msg("checkpoint %s of the trained model was removed", before[i]);
    }
    assert_int_equal(m, n + 3); // and the rotation kept three of the new ones

    // Back to the right configuration: the newer H=32 ones are refused, the trained one returns.
    assert_int_equal(daemon_start_in(&d, dir, true, args_with("16", NULL)), 0);
    c = daemon_client(&d, NULL);
    assert_params(c, trained, "the trained checkpoint");
    rnnd_client_free(c);
    free(trained);
    daemon_free(&d);
}

static void test_named_apart(void **state) {
    (void)state;
    struct daemon d;
    struct rng g = {12};
    assert_int_equal(daemon_start(&d, args_with("16", NULL)), 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", d.state_dir);
    struct rnnd_client *c = daemon_client(&d, NULL);
    float *w1 = set_random(c, &g);
    const char *named[] = {"ckpt-0-mine", "ckpt-zz-1", "ckpt-zz-2", "ckpt-zz-3"};
    for (int i = 0; i < 4; i++)
        free(save(c, named[i]));
    float *w2 = set_random(c, &g);
    for (int i = 0; i < 4; i++)
        free(save(c, NULL));
    // Every named one stays; the automatic ones rotate among themselves.
    for (int i = 0; i < 4; i++)
        if (!exists(dir, named[i]))
            fail_msg("named checkpoint %s was removed", named[i]);
    char names[8][128];
    assert_int_equal(auto_names(dir, names, 8), 3);
    // Names that would enter the rotation's namespace are refused.
    const char *reserved[] = {"auto", "ckpt-20260101T000000.000Z-v1"};
    for (int i = 0; i < 2; i++)
        EXPECT_STATUS(rnnd_client_save_checkpoint(c, reserved[i], NULL, NULL),
                      GRPC_STATUS_INVALID_ARGUMENT);

    // kill -9: the newest automatic checkpoint comes back, not a named one.
    rnnd_client_free(c);
    assert_int_equal(daemon_signal_wait(&d, SIGKILL, 5000), 0);
    assert_int_equal(daemon_start_in(&d, dir, true, args_with("16", NULL)), 0);
    c = daemon_client(&d, NULL);
    assert_params(c, w2, "the newest automatic checkpoint");
    // A named checkpoint newer than every automatic one is not restored unasked, and the log
    // says how to restore it.
    float *w3 = set_random(c, &g);
    free(save(c, "later"));
    rnnd_client_free(c);
    assert_int_equal(daemon_signal_wait(&d, SIGKILL, 5000), 0);
    assert_int_equal(daemon_start_in(&d, dir, true, args_with("16", NULL)), 0);
    c = daemon_client(&d, NULL);
    assert_params(c, w2, "the newest automatic checkpoint");
    if (!daemon_log_contains(&d, "named checkpoint") || !daemon_log_contains(&d, "/later")) {
        daemon_dump_log(&d, 2000);
        fail_msg("the log should name the newer named checkpoint and --restore");
    }
    rnnd_client_free(c);
    free(w1);
    free(w2);
    free(w3);
    daemon_free(&d);
}

static void test_earlier_layout(void **state) {
    (void)state;
    struct daemon d;
    struct rng g = {13};
    assert_int_equal(daemon_start(&d, args_with("16", NULL)), 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", d.state_dir);
    struct rnnd_client *c = daemon_client(&d, NULL);
    float *w = set_random(c, &g);
    char *path = NULL;
    EXPECT_OK(rnnd_client_save_checkpoint(c, NULL, &path, NULL));
    assert_non_null(path);
    rnnd_client_free(c);
    assert_int_equal(daemon_signal_wait(&d, SIGKILL, 5000), 0);
    // As an earlier rnnd left it: at the top of the state dir, without checksums.
    char top[1024], file[1200], base[256];
    snprintf(base, sizeof base, "%s", strrchr(path, '/') + 1);
    snprintf(top, sizeof top, "%s/%s", dir, base);
    assert_int_equal(rename(path, top), 0);
    snprintf(file, sizeof file, "%s/checksums", top);
    assert_int_equal(unlink(file), 0);

    assert_int_equal(daemon_start_in(&d, dir, true, args_with("16", NULL)), 0);
    c = daemon_client(&d, NULL);
    assert_params(c, w, "the checkpoint of the earlier layout");
    if (!daemon_log_contains(&d, top) || !daemon_log_contains(&d, "no checksums file")) {
        daemon_dump_log(&d, 2000);
        fail_msg("the log should say %s was restored without verification", top);
    }
    // It is never rotated away.
    for (int i = 0; i < 4; i++)
        free(save(c, NULL));
    assert_true(exists(dir, base));
    rnnd_client_free(c);
    free(path);
    free(w);
    daemon_free(&d);
}

static void test_failures_exit_nonzero(void **state) {
    (void)state;
    // A --state-dir that cannot be created stops the start, naming it.
    char tmp[] = "/tmp/rnnd-ckfail-XXXXXX";
    assert_non_null(mkdtemp(tmp));
    char file[300], below[400];
    snprintf(file, sizeof file, "%s/a-file", tmp);
    fclose(fopen(file, "w"));
    snprintf(below, sizeof below, "%s/state", file);
    const char *argv[] = {rnnd_bin(), "--backend",   "cpu",          "--listen", "127.0.0.1:0",
                          "--http",   "off",         "--input-size", "8",        "--hidden-size",
                          "16",       "--state-dir", below,          NULL};
    char *out = NULL;
    int rc = run_capture(argv, 20000, &out);
    if (rc == 0 || !out || !strstr(out, "--state-dir") || !strstr(out, below))
        fail_msg("--state-dir %s: exit %d, output:\n%s", below, rc, out ? out : "");
    free(out);

    // Periodic checkpoints into a state dir that became a file: tried once per interval.
    snprintf(below, sizeof below, "%s/state", tmp);
    const char *extra[] = {"--state-dir", below, "--checkpoint-interval-s", "1", NULL};
    struct daemon d;
    assert_int_equal(daemon_start(&d, args_with("16", extra)), 0);
    char cmd[1000];
    snprintf(cmd, sizeof cmd, "rm -rf %s && touch %s", below, below);
    assert_int_equal(system(cmd), 0);
    double f0 = daemon_metric(&d, "rnnd_checkpoints_total", "result=\"failed\"");
    sleep_ms(3500);
    double f1 = daemon_metric(&d, "rnnd_checkpoints_total", "result=\"failed\"");
    int warned = log_count(&d, "periodic checkpoint failed");
    fprintf(stderr, "  failing periodic checkpoints in 3.5 s at 1 s: %.0f tries, %d warnings\n",
            f1 - f0, warned);
    assert_true(f1 - f0 >= 2 && f1 - f0 <= 4);
    assert_true(warned >= 2 && warned <= 5);

    // The final checkpoint fails too: the exit status says so.
    rc = stop(&d);
    if (rc == 0 || !daemon_log_contains(&d, "final checkpoint failed")) {
        daemon_dump_log(&d, 2000);
        fail_msg("a stop whose checkpoint failed exited %d", rc);
    }
    daemon_free(&d);
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    assert_int_equal(system(cmd), 0);
}

// Offset from the end of envs.safetensors to its first env id.
static long env_id_offset(const char *file) {
    size_t len = 0;
    char *buf = read_file(file, &len);
    assert_non_null(buf);
    struct rnnd_st_file st;
    char why[256];
    assert_int_equal(rnnd_st_decode(buf, len, &st, why, sizeof why), 0);
    const struct rnnd_st_tensor *ids = rnnd_st_find(&st, "env_ids");
    assert_non_null(ids);
    long off = (long)len - (long)((const char *)ids->data - buf);
    rnnd_st_file_free(&st);
    free(buf);
    return off;
}

// Writes a NaN over the last float of dir/model.safetensors (a bias), and drops its checksums so
// that it is the NaN that is caught, as in a checkpoint of an earlier rnnd.
static void nan_weight(const char *dir) {
    char file[1200];
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    FILE *fp = fopen(file, "r+b");
    assert_non_null(fp);
    float nan = NAN;
    assert_int_equal(fseek(fp, -4, SEEK_END), 0);
    fwrite(&nan, 4, 1, fp);
    fclose(fp);
    snprintf(file, sizeof file, "%s/checksums", dir);
    assert_int_equal(unlink(file), 0);
}

static void test_integrity(void **state) {
    (void)state;
    struct daemon d;
    struct rng g = {14};
    assert_int_equal(daemon_start(&d, args_with("16", NULL)), 0);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", d.state_dir);
    struct rnnd_client *c = daemon_client(&d, NULL);
    step_envs(c, &g);
    float *wa = set_random(c, &g);
    char *a = save(c, NULL);
    float *wb = set_random(c, &g);
    char *b = save(c, NULL);
    float *wc = set_random(c, &g);
    char *cc = save(c, NULL);
    rnnd_client_free(c);
    assert_int_equal(daemon_signal_wait(&d, SIGKILL, 5000), 0);

    // C: a flipped byte in the weights; B: a NaN weight; A: its optimizer state gone. And the
    // temporaries a kill -9 during a write leaves.
    char file[1200];
    snprintf(file, sizeof file, "%s/model.safetensors", cc);
    flip_byte(file, 10);
    nan_weight(b);
    snprintf(file, sizeof file, "%s/optimizer.safetensors", a);
    assert_int_equal(unlink(file), 0);
    const char *temps[] = {"auto/.ckpt-20260101T000000.000Z-v9.tmp-99999", ".mine.tmp-4242"};
    for (int i = 0; i < 2; i++) {
        snprintf(file, sizeof file, "%s/%s", dir, temps[i]);
        assert_int_equal(mkdir(file, 0700), 0);
        strcat(file, "/model.safetensors");
        fclose(fopen(file, "w"));
    }

    assert_int_equal(daemon_start_in(&d, dir, true, args_with("16", NULL)), 0);
    c = daemon_client(&d, NULL);
    assert_params(c, wa, "A, the newest checkpoint that is intact");
    if (log_count(&d, "refused: model.safetensors:") != 2 || !daemon_log_contains(&d, "damaged") ||
        !daemon_log_contains(&d, "NaN") ||
        !daemon_log_contains(&d, "lacks optimizer.safetensors") ||
        !daemon_log_contains(&d, "removed 2 unfinished checkpoint writes")) {
        daemon_dump_log(&d, 3000);
        fail_msg("C and B should be refused (damaged, NaN), A's lost optimizer state named and "
                 "the temporaries removed");
    }
    for (int i = 0; i < 2; i++)
        if (exists(dir, temps[i]))
            fail_msg("temporary %s was left", temps[i]);
    rnnd_client_free(c);
    assert_int_equal(daemon_signal_wait(&d, SIGKILL, 5000), 0);

    // An env id changed in A too: none loads, and the start is refused.
    snprintf(file, sizeof file, "%s/envs.safetensors", a);
    flip_byte(file, env_id_offset(file));
    int rc = start_refused(&d, dir, args_with("16", NULL));
    fprintf(stderr, "  every checkpoint corrupt: exit %d, %d refusal lines\n", rc,
            log_count(&d, "refused:"));
    if (rc == 0 || log_count(&d, "refused:") != 3 || !daemon_log_contains(&d, "envs.safetensors")) {
        daemon_dump_log(&d, 3000);
        fail_msg("three corrupt checkpoints should each be refused and the start stopped");
    }
    // Started fresh on purpose: they stay.
    const char *fresh[] = {"--fresh-start", "1", NULL};
    assert_int_equal(daemon_start_in(&d, dir, true, args_with("16", fresh)), 0);
    assert_int_equal(stop(&d), 0);
    const char *kept[] = {a, b, cc};
    struct stat st;
    for (int i = 0; i < 3; i++)
        if (stat(kept[i], &st) != 0)
            fail_msg("refused checkpoint %s was removed", kept[i]);
    free(a);
    free(b);
    free(cc);
    free(wa);
    free(wb);
    free(wc);
    daemon_free(&d);
}

static void assert_mode(const char *path, unsigned mode) {
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    if ((st.st_mode & 0777) != mode)
        fail_msg("%s has mode %03o, not %03o", path, st.st_mode & 0777, mode);
}

static void test_modes(void **state) {
    (void)state;
    char tmp[] = "/tmp/rnnd-ckmode-XXXXXX";
    assert_non_null(mkdtemp(tmp));
    char sd[300], token[300], p[1200];
    snprintf(sd, sizeof sd, "%s/state", tmp);
    snprintf(token, sizeof token, "%s/token", tmp);
    FILE *fp = fopen(token, "w");
    fputs("s3cret\n", fp);
    fclose(fp);
    assert_int_equal(chmod(token, 0644), 0);
    const char *extra[] = {"--state-dir", sd, "--auth-token-file", token, NULL};
    struct daemon d;
    mode_t old = umask(0); // the daemon inherits it
    int rc = daemon_start(&d, args_with("16", extra));
    umask(old);
    assert_int_equal(rc, 0);
    if (!daemon_log_contains(&d, "--auth-token-file") || !daemon_log_contains(&d, "chmod 600")) {
        daemon_dump_log(&d, 2000);
        fail_msg("a token file others can read should be warned about");
    }
    struct rnnd_client *c = daemon_client(&d, "s3cret");
    char *path = save(c, NULL);
    rnnd_client_free(c);
    assert_mode(sd, 0700);
    snprintf(p, sizeof p, "%s/auto", sd);
    assert_mode(p, 0700);
    snprintf(p, sizeof p, "%s/.rnnd-running", sd);
    assert_mode(p, 0600);
    assert_mode(path, 0700);
    const char *files[] = {"model.safetensors", "optimizer.safetensors", "envs.safetensors",
                           "metadata.json", "checksums"};
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "%s/%s", path, files[i]);
        assert_mode(p, 0600);
    }
    free(path);
    // Private, it is not warned about.
    assert_int_equal(stop(&d), 0);
    assert_int_equal(chmod(token, 0600), 0);
    assert_int_equal(daemon_start_in(&d, d.state_dir, true, args_with("16", extra)), 0);
    assert_false(daemon_log_contains(&d, "chmod 600"));
    daemon_free(&d);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    assert_int_equal(system(cmd), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_slip),    cmocka_unit_test(test_named_apart),
        cmocka_unit_test(test_earlier_layout), cmocka_unit_test(test_failures_exit_nonzero),
        cmocka_unit_test(test_integrity),      cmocka_unit_test(test_modes),
    };
    return cmocka_run_group_tests_name("checkpoints", tests, NULL, NULL) ? 1 : 0;
}
