/*
 * test_devices.c: several devices in one daemon (--devices) and several daemons sharing their
 * weights (--world-size, --rank, --rendezvous).
 *
 *   replicas   after rounds of Backward(accumulate) + ApplyGradients (Adam), explicit gradients
 *              and SetWeights, every device holds the same bits: GetWeights (which compares the
 *              devices) succeeds and the per-device checkpoints (state-dir/device-N) have
 *              byte-identical model.safetensors and optimizer.safetensors; the update equals the
 *              CPU reference's Adam step over the summed gradients.
 *   placement  Steps of many envs against the reference, a restart that restores each device's
 *              envs from its own directory, and a one-device checkpoint taken up by two devices.
 *   flags      bad --devices / --world-size / --rendezvous / --rank values are refused with a
 *              message; a rank whose rank 0 never answers gives up after --rendezvous-timeout-s.
 *   cluster    two daemons form a group: rank 1 starts with another seed and takes rank 0's
 *              weights; gradients accumulated on both and applied through rank 1 give both the
 *              same bits (the reference's SGD step over the sum); sent gradients and SetWeights
 *              through either rank reach both; Steps on both run on the new weights; when rank
 *              1 stops, rank 0 drains and exits with status 3. The cpu backend runs it with one
 *              engine per daemon and with two (its communicator joins processes over TCP);
 *              RNND_TEST_CLUSTER_DEVICES="0;1" gives the --devices of rank 0 and rank 1 (GPUs:
 *              NCCL). It says on stderr where it is ("two daemons [SECONDS s]: ...", first the
 *              daemons' state dirs, kept with RNND_TEST_KEEP=1), so that a hang shows where it
 *              hung (tests/gpu/multi_gpu_check.sh runs it under a watchdog).
 *   timing     (RNND_TEST_TIMING=1; RNND_TEST_FILTER=*timing runs it alone) a learner step (Forward
 * + Backward(accumulate) + ApplyGradients, B=2048 T=64 I=64 H=128 GRU) on --devices 0 and on the
 *              RNND_TEST_DEVICES list; medians printed as "learner_step devices=... ms".
 *
 * The devices come from RNND_TEST_DEVICES (default "0,1": with the cpu backend, two CPU
 * engines); the backend from RNND_BACKEND as for every integration test.
 */
#include "harness.h"
#include "loopback_port.h"

#include <dirent.h>
#include <grpc/status.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define I_    8
#define H_    16
#define L_    2
#define ATOL  2e-5f
#define RTOL  1e-4f
#define GATOL 1e-4f
#define GRTOL 1e-3f

static const char *devices(void) {
    const char *e = getenv("RNND_TEST_DEVICES");
    return e && *e ? e : "0,1";
}

static int device_count(void) {
    int n = 1;
    for (const char *p = devices(); *p; p++)
        n += *p == ',';
    return n;
}

static const char *const model_args[] = {
    "--cell", "gru", "--input-size", "8", "--hidden-size", "16", "--layers", "2", NULL};

// args = model_args + --devices LIST + extra (NULL-terminated).
static void build_args(const char **out, const char *list, const char *const *extra) {
    int n = 0;
    for (int k = 0; model_args[k]; k++)
        out[n++] = model_args[k];
    if (list) {
        out[n++] = "--devices";
        out[n++] = list;
    }
    for (int k = 0; extra && extra[k]; k++)
        out[n++] = extra[k];
    out[n] = NULL;
}

static float *get_params(struct rnnd_client *c, const struct rnnd_model *m, uint64_t *version) {
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(c, &w, version));
    float *p = malloc(rnnd_model_param_count(m) * sizeof(float));
    assert_int_equal(rnnd_named_tensors_to_params(&w, m, p), 0);
    rnnd_named_tensors_free(&w);
    return p;
}

// A Forward(keep_tape) of B rows x T steps of random data and its Backward with a random
// grad_output. accumulate: the server keeps the gradients; else *grads (P) receives them.
// The reference's gradients (P, +=) are added into ref_grads when not NULL.
static void forward_backward(struct rnnd_client *c, struct ref *r, struct rng *g, int B, int T,
                             bool accumulate, float *grads, float *ref_grads) {
    size_t nx = (size_t)B * T * I_, no = (size_t)B * T * H_, P = r->P;
    float *x = malloc(nx * sizeof(float)), *go = malloc(no * sizeof(float));
    uint8_t *init = calloc((size_t)B * T, 1);
    rng_fill(g, x, nx);
    rng_fill(g, go, no);
    for (int k = 0; k < B * T; k++)
        init[k] = rng_u(g, 5) == 0;
    struct rnnd_forward_req fr = {
        .obs = rnnd_tensor_f32(x, 3, B, T, I_, 0),
        .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T}),
        .keep_tape = true,
    };
    struct rnnd_forward_reply f;
    EXPECT_OK(rnnd_client_forward(c, &fr, &f));
    assert_true(f.tape_id != 0);
    // The reference forward and backward over the same weights and data.
    float *out = malloc(no * sizeof(float)), *hn = malloc((size_t)B * L_ * H_ * sizeof(float));
    void *tape = malloc(r->be.ops->tape_bytes(r->be.ctx, &r->m, B, T) + 64);
    struct rnnd_seq seq = {.B = B, .T = T, .x = x, .is_init = init};
    assert_int_equal(r->be.ops->rnn_forward(r->be.ctx, out, hn, NULL, tape, &seq, r->params, &r->m),
                     0);
    assert_true(close_f32("forward output", f.output.data, out, no, ATOL, RTOL));
    float *rg = calloc(P, sizeof(float)), *rgx = malloc(nx * sizeof(float));
    struct rnnd_seq_grads sg = {.params = rg, .x = rgx};
    assert_int_equal(
        r->be.ops->rnn_backward(r->be.ctx, &sg, go, NULL, NULL, tape, &seq, r->params, &r->m), 0);
    struct rnnd_backward_req br = {.tape_id = f.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, B, T, H_, 0),
                                   .accumulate = accumulate};
    struct rnnd_backward_reply b;
    EXPECT_OK(rnnd_client_backward(c, &br, &b));
    assert_true(close_f32("grad_obs", b.grad_obs.data, rgx, nx, GATOL, GRTOL));
    if (!accumulate) {
        assert_int_equal(rnnd_named_tensors_to_params(&b.grads, &r->m, grads), 0);
        assert_true(close_f32("weight gradients", grads, rg, P, GATOL, GRTOL));
    }
    if (ref_grads)
        for (size_t i = 0; i < P; i++)
            ref_grads[i] += rg[i];
    rnnd_backward_reply_free(&b);
    rnnd_forward_reply_free(&f);
    free(x);
    free(go);
    free(init);
    free(out);
    free(hn);
    free(tape);
    free(rg);
    free(rgx);
}

// Adam (torch defaults, no clipping) for t = 1 on zero moments: the reference update.
static void adam_first_step(float *p, const float *g, size_t n, float lr) {
    for (size_t i = 0; i < n; i++) {
        double m = 0.1 * g[i], v = 0.001 * (double)g[i] * g[i];
        double mh = m / (1 - 0.9), vh = v / (1 - 0.999);
        p[i] = (float)(p[i] - lr * mh / (sqrt(vh) + 1e-8));
    }
}

// Every device's files of checkpoint NAME hold the same bytes as device 0's.
static void assert_device_checkpoints_equal(const struct daemon *d, const char *name, int n) {
    const char *files[] = {"model.safetensors", "optimizer.safetensors"};
    for (int f = 0; f < 2; f++) {
        char path[512];
        size_t len0 = 0, len = 0;
        snprintf(path, sizeof(path), "%s/device-0/%s/%s", d->state_dir, name, files[f]);
        char *a = read_file(path, &len0);
        assert_non_null(a);
        for (int k = 1; k < n; k++) {
            snprintf(path, sizeof(path), "%s/device-%d/%s/%s", d->state_dir, k, name, files[f]);
            char *b = read_file(path, &len);
            assert_non_null(b);
            if (len != len0 || memcmp(a, b, len) != 0)
                fprintf(stderr, "%s of device %d differs from device 0's\n", files[f], k);
            assert_int_equal(len, len0);
            assert_memory_equal(a, b, len);
            free(b);
        }
        free(a);
    }
}

// ---------------------------------------------------------------------------------------------

static void test_replicas_identical(void **state) {
    (void)state;
    struct daemon d;
    const char *args[32];
    const char *extra[] = {"--optimizer", "adam", "--lr", "0.01", "--seed", "5", NULL};
    build_args(args, devices(), extra);
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct ref r;
    ref_init(&r, c, 4);
    struct rng g = {4242};
    size_t P = r.P;
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    fprintf(stderr, "devices: %s\n", info.device);

    // Round 1: gradients accumulated from two Backwards (odd B: uneven parts), one Adam step;
    // compared with the reference's Adam step over their sum.
    float *sum = calloc(P, sizeof(float));
    forward_backward(c, &r, &g, 13, 6, true, NULL, sum);
    forward_backward(c, &r, &g, 3, 4, true, NULL, sum);
    uint64_t v;
    EXPECT_OK(rnnd_client_apply_gradients(c, NULL, NULL, &v));
    assert_int_equal(v, 1);
    float *want = malloc(P * sizeof(float));
    memcpy(want, r.params, P * sizeof(float));
    adam_first_step(want, sum, P, 0.01f);
    float *have = get_params(c, &r.m, &v);
    assert_int_equal(v, 1);
    // Adam's first step is lr * sign(g) where |g| >> eps: compare where the summed gradient is
    // clearly away from zero (elsewhere the devices' and the reference's rounding may differ
    // in sign); the update stays within lr everywhere.
    size_t checked = 0;
    for (size_t i = 0; i < P; i++) {
        if (fabsf(sum[i]) > 1e-3f) {
            checked++;
            if (fabsf(have[i] - want[i]) > 1e-5f + 1e-4f * fabsf(want[i]))
                fprintf(stderr, "weight %zu: %.9g, reference %.9g\n", i, have[i], want[i]);
            assert_true(fabsf(have[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]));
        }
        assert_true(fabsf(have[i] - r.params[i]) <= 0.0101f);
    }
    assert_true(checked > P / 2);
    free(have);

    // More rounds: accumulated, sent (from a Backward without accumulate) with an lr, and a
    // SetWeights; GetWeights compares the devices after each.
    ref_reload(&r, c);
    float *grads = malloc(P * sizeof(float));
    for (int round = 0; round < 3; round++) {
        forward_backward(c, &r, &g, 9, 5, true, NULL, NULL);
        EXPECT_OK(rnnd_client_apply_gradients(c, NULL, NULL, &v));
        ref_reload(&r, c);
        forward_backward(c, &r, &g, 7, 3, false, grads, NULL);
        struct rnnd_named_tensors nt;
        assert_int_equal(rnnd_named_tensors_from_params(&nt, &r.m, grads), 0);
        float lr = 0.003f;
        EXPECT_OK(rnnd_client_apply_gradients(c, &nt, &lr, &v));
        rnnd_named_tensors_free(&nt);
        ref_reload(&r, c); // GetWeights: fails if the devices differ
    }
    assert_int_equal(v, 7);
    EXPECT_OK(rnnd_client_save_checkpoint(c, "after-training", NULL, NULL));
    assert_device_checkpoints_equal(&d, "after-training", device_count());

    // SetWeights reaches every device.
    for (size_t i = 0; i < P; i++)
        want[i] = rng_f(&g) * 0.1f;
    struct rnnd_named_tensors nt;
    assert_int_equal(rnnd_named_tensors_from_params(&nt, &r.m, want), 0);
    EXPECT_OK(rnnd_client_set_weights(c, &nt, &v));
    rnnd_named_tensors_free(&nt);
    have = get_params(c, &r.m, &v);
    assert_memory_equal(have, want, P * sizeof(float));
    EXPECT_OK(rnnd_client_save_checkpoint(c, "after-set", NULL, NULL));
    assert_device_checkpoints_equal(&d, "after-set", device_count());

    free(have);
    free(want);
    free(sum);
    free(grads);
    ref_free(&r);
    rnnd_client_free(c);
    daemon_free(&d);
}

// Steps 48 envs (over every device) for a few steps, checking against the reference.
static void step_envs(struct rnnd_client *c, struct ref *r, struct rng *g, int steps, bool first) {
    enum { B = 48 };
    uint64_t ids[B];
    int32_t slots[B];
    for (int b = 0; b < B; b++) {
        ids[b] = 1000 + 7 * (uint64_t)b;
        slots[b] = b;
    }
    for (int t = 0; t < steps; t++) {
        float x[B * I_], ref[B * H_];
        bool init[B];
        rng_fill(g, x, B * I_);
        for (int b = 0; b < B; b++)
            init[b] = (first && t == 0) || rng_u(g, 9) == 0;
        struct rnnd_step_req req = {.n_env_ids = B,
                                    .env_ids = ids,
                                    .obs = rnnd_tensor_f32(x, 2, B, I_, 0, 0),
                                    .n_is_init = B,
                                    .is_init = init};
        struct rnnd_step_reply rep;
        EXPECT_OK(rnnd_client_step(c, &req, &rep));
        ref_step(r, B, slots, x, init, ref);
        assert_true(close_f32("step output", rep.output.data, ref, B * H_, ATOL, RTOL));
        rnnd_step_reply_free(&rep);
    }
}

// Starts *d with args, steps 48 new envs `steps` times against the reference r, and stops it
// with SIGTERM, which writes one checkpoint per device (restart_continues takes them up).
static void first_run(struct daemon *d, const char *const *args, struct ref *r, struct rng *g,
                      int steps) {
    assert_int_equal(daemon_start(d, args), 0);
    struct rnnd_client *c = daemon_client(d, NULL);
    ref_init(r, c, 48);
    step_envs(c, r, g, steps, true);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    assert_int_equal(info.envs_active, 48);
    rnnd_client_free(c);
    assert_int_equal(daemon_signal_wait(d, SIGTERM, 20000), 0);
    assert_true(WIFEXITED(d->exit_status) && WEXITSTATUS(d->exit_status) == 0);
}

// Starts *d in dir (a restart: owned as the first start of dir said) and checks that it holds
// the 48 envs and continues each against the reference for `steps` more steps.
static void restart_continues(struct daemon *d, const char *dir, bool owned,
                              const char *const *args, struct ref *r, struct rng *g, int steps) {
    assert_int_equal(daemon_start_in(d, dir, owned, args), 0);
    struct rnnd_client *c = daemon_client(d, NULL);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    assert_int_equal(info.envs_active, 48);
    step_envs(c, r, g, steps, false);
    rnnd_client_free(c);
}

static void test_placement_and_restart(void **state) {
    (void)state;
    struct daemon d;
    const char *args[32];
    build_args(args, devices(), NULL);
    struct ref r;
    struct rng g = {99};
    // One checkpoint per device; a restart restores every env where it lives.
    first_run(&d, args, &r, &g, 4);
    char dir[256];
    snprintf(dir, sizeof(dir), "%s", d.state_dir);
    struct daemon d2;
    restart_continues(&d2, dir, true, args, &r, &g, 3);
    ref_free(&r);
    daemon_free(&d2);
    daemon_free(&d);
}

// A checkpoint written with one device is taken up by several: each takes its envs.
static void test_one_device_checkpoint_to_several(void **state) {
    (void)state;
    struct daemon d;
    const char *one[32], *several[32];
    build_args(one, NULL, NULL);
    build_args(several, devices(), NULL);
    if (harness_devices()) { // the suite's own --devices would come first and be overridden
        skip();
        return;
    }
    struct ref r;
    struct rng g = {7};
    first_run(&d, one, &r, &g, 3);
    struct daemon d2;
    restart_continues(&d2, d.state_dir, true, several, &r, &g, 2);
    ref_free(&r);
    daemon_free(&d2);
    daemon_free(&d);
}

// The envs in device k's one automatic checkpoint under dir (its metadata.json), or -1.
static int part_envs(const char *dir, int k) {
    char path[512];
    snprintf(path, sizeof(path), "%s/device-%d/auto", dir, k);
    DIR *dp = opendir(path);
    if (dp == NULL)
        return -1;
    int envs = -1, found = 0;
    for (struct dirent *de; (de = readdir(dp)) != NULL;) {
        if (strncmp(de->d_name, "ckpt-", 5) != 0)
            continue;
        char meta[1024];
        snprintf(meta, sizeof(meta), "%s/%s/metadata.json", path, de->d_name);
        char *text = read_file(meta, NULL);
        const char *v = text ? strstr(text, "\"envs\":") : NULL;
        envs = v ? atoi(v + 7) : -1;
        free(text);
        found++;
    }
    closedir(dp);
    return found == 1 ? envs : -1;
}

// --place-block 64: the 48 envs (ids 1000 + 7b) live on the device that their block of 64 ids
// gives in turn, each device's checkpoint holds exactly those, a restart with the same placement
// continues every env, and one with another placement is refused (each device would restore
// only its own part, and the envs that moved would be lost) until it is given back.
static void test_place_block(void **state) {
    (void)state;
    if (harness_devices()) {
        skip();
        return;
    }
    const char *blocks[] = {"--place-block", "64", NULL}, *hashed[] = {"--place-block", "1", NULL};
    const char *args[32], *other[32];
    build_args(args, devices(), blocks);
    build_args(other, devices(), hashed);
    struct daemon d;
    struct ref r;
    struct rng g = {5};
    first_run(&d, args, &r, &g, 3);
    int n = device_count(), want[8] = {0};
    for (int b = 0; b < 48; b++)
        want[(1000 + 7 * b) / 64 % n]++;
    for (int k = 0; k < n && k < 8; k++) {
        int got = part_envs(d.state_dir, k);
        if (got != want[k])
            fprintf(stderr, "device %d checkpointed %d envs, want %d\n", k, got, want[k]);
        assert_int_equal(got, want[k]);
    }

    struct daemon d2;
    assert_int_equal(daemon_spawn_in(&d2, d.state_dir, false, other), 0);
    for (double t0 = now_seconds(); daemon_alive(&d2) && now_seconds() - t0 < 30;)
        sleep_ms(20);
    char why[64];
    snprintf(why, sizeof(why), "placed on %d devices by --place-block 64", n);
    if (daemon_alive(&d2) || !daemon_log_contains(&d2, why) ||
        !daemon_log_contains(&d2, "--fresh-start 1")) {
        daemon_dump_log(&d2, 3000);
        fail_msg("a restart with another --place-block must refuse the parts, saying why");
    }

    struct daemon d3;
    restart_continues(&d3, d.state_dir, false, args, &r, &g, 2);
    ref_free(&r);
    daemon_free(&d3);
    daemon_free(&d2);
    daemon_free(&d);
}

// rnnd with these flags exits with status `status` and says `needle`.
static void expect_refused(const char *const *flags, int status, const char *needle) {
    const char *argv[40];
    int n = 0;
    argv[n++] = rnnd_bin();
    argv[n++] = "--backend";
    argv[n++] = harness_backend();
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--http";
    argv[n++] = "off";
    for (int k = 0; flags[k]; k++)
        argv[n++] = flags[k];
    argv[n] = NULL;
    char *out = NULL;
    int rc = run_capture(argv, 20000, &out);
    bool ok = rc == status && out && strstr(out, needle);
    if (!ok)
        fprintf(stderr, "wanted exit %d with '%s'; got 0x%x:\n%s\n", status, needle, rc,
                out ? out : "");
    free(out);
    assert_true(ok);
}

static void test_bad_flags(void **state) {
    (void)state;
    expect_refused((const char *[]){"--devices", "0,0", NULL}, 2, "device 0 is listed twice");
    expect_refused((const char *[]){"--devices", "0,x", NULL}, 2, "comma-separated list");
    expect_refused((const char *[]){"--devices", "0,", NULL}, 2, "ends with a comma");
    expect_refused((const char *[]){"--world-size", "2", NULL}, 2, "needs --rendezvous");
    expect_refused((const char *[]){"--rendezvous", "127.0.0.1:1", NULL}, 2,
                   "--rendezvous needs --world-size");
    expect_refused(
        (const char *[]){"--world-size", "2", "--rank", "2", "--rendezvous", "127.0.0.1:1", NULL},
        2, "--rank 2 is not below --world-size 2");
    expect_refused((const char *[]){"--rank", "x", NULL}, 2, "neither auto nor an integer");
    setenv("RNND_RANK", "7", 1);
    expect_refused((const char *[]){"--world-size", "2", "--rank", "auto", "--rendezvous",
                                    "127.0.0.1:1", NULL},
                   1, "$RNND_RANK is '7'");
    unsetenv("RNND_RANK");
    // Nobody listens there (the port was free a moment ago).
    char rdv[64];
    snprintf(rdv, sizeof(rdv), "127.0.0.1:%d", loopback_free_port());
    expect_refused((const char *[]){"--world-size", "2", "--rank", "1", "--rendezvous", rdv,
                                    "--rendezvous-timeout-s", "1", NULL},
                   1, "did not answer within --rendezvous-timeout-s 1");
}

// ---------------------------------------------------------------------------------------------
// Two daemons as two hosts.

// Where the two-daemon test is, on stderr, with the seconds since it began.
static double cluster_t0;
static void cluster_phase(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void cluster_phase(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "two daemons [%.1f s]: ", now_seconds() - cluster_t0);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

// Two daemons on the --devices lists dev0 and dev1 ("": none) form a group and stay in sync.
static void two_daemons(const char *dev0, const char *dev1) {
    cluster_t0 = now_seconds();
    cluster_phase("rank 0 on --devices '%s', rank 1 on --devices '%s'", dev0, dev1);
    char rdv[64];
    snprintf(rdv, sizeof(rdv), "127.0.0.1:%d", loopback_free_port());
    const char *e0[] = {"--world-size",     "2",  "--rank",      "0",   "--rendezvous", rdv,
                        "--seed",           "1",  "--optimizer", "sgd", "--lr",         "0.1",
                        "--comm-timeout-s", "20", NULL};
    const char *e1[] = {"--world-size",     "2",  "--rank",      "1",   "--rendezvous", rdv,
                        "--seed",           "2",  "--optimizer", "sgd", "--lr",         "0.1",
                        "--comm-timeout-s", "20", NULL};
    const char *a0[40], *a1[40];
    build_args(a0, dev0[0] ? dev0 : NULL, e0);
    build_args(a1, dev1[0] ? dev1 : NULL, e1);
    // Both from this thread (the harness's daemons die with the thread that forked them), rank 1
    // first: it retries until rank 0 listens; neither is ready before the other has joined.
    struct daemon d0, d1;
    assert_int_equal(daemon_spawn(&d1, a1), 0);
    assert_int_equal(daemon_spawn(&d0, a0), 0);
    cluster_phase("rank 0 (pid %d) in %s, rank 1 (pid %d) in %s; waiting for both to be ready",
                  (int)d0.pid, d0.state_dir, (int)d1.pid, d1.state_dir);
    int rc0 = daemon_wait_ready(&d0, 60.0), rc1 = daemon_wait_ready(&d1, 60.0);
    if (rc0 != 0 || rc1 != 0) {
        daemon_free(&d0);
        daemon_free(&d1);
    }
    assert_int_equal(rc0, 0);
    assert_int_equal(rc1, 0);
    cluster_phase("both ready; reading their weights");
    struct rnnd_client *c0 = daemon_client(&d0, NULL), *c1 = daemon_client(&d1, NULL);
    struct ref r0, r1;
    ref_init(&r0, c0, 48); // step_envs steps 48 envs
    ref_init(&r1, c1, 48);
    size_t P = r0.P;
    // Rank 1 began from seed 2 and took rank 0's weights when the group formed.
    assert_memory_equal(r0.params, r1.params, P * sizeof(float));

    // Data-parallel: each rank accumulates its own batch; one ApplyGradients (through rank 1)
    // applies the sum on both.
    struct rng g = {31337};
    float *sum = calloc(P, sizeof(float));
    cluster_phase("Forward + Backward(accumulate) on each rank");
    forward_backward(c0, &r0, &g, 11, 6, true, NULL, sum);
    forward_backward(c1, &r1, &g, 5, 4, true, NULL, sum);
    uint64_t v0, v1;
    cluster_phase("ApplyGradients (accumulated) through rank 1");
    EXPECT_OK(rnnd_client_apply_gradients(c1, NULL, NULL, &v1));
    float *w0 = get_params(c0, &r0.m, &v0), *w1 = get_params(c1, &r1.m, &v1);
    assert_int_equal(v0, 1);
    assert_int_equal(v1, 1);
    assert_memory_equal(w0, w1, P * sizeof(float));
    float *want = malloc(P * sizeof(float));
    for (size_t i = 0; i < P; i++)
        want[i] = r0.params[i] - 0.1f * sum[i];
    assert_true(close_f32("weights after the summed SGD step", w0, want, P, 1e-5f, 1e-4f));
    free(w0);
    free(w1);

    // Sent gradients through rank 0, then a SetWeights through rank 1, reach both; Steps run on
    // each after.
    ref_reload(&r0, c0);
    struct rnnd_named_tensors nt;
    float *grads = malloc(P * sizeof(float));
    for (size_t i = 0; i < P; i++)
        grads[i] = rng_f(&g);
    assert_int_equal(rnnd_named_tensors_from_params(&nt, &r0.m, grads), 0);
    cluster_phase("ApplyGradients (sent) through rank 0");
    EXPECT_OK(rnnd_client_apply_gradients(c0, &nt, NULL, &v0));
    rnnd_named_tensors_free(&nt);
    w0 = get_params(c0, &r0.m, &v0);
    w1 = get_params(c1, &r1.m, &v1);
    assert_int_equal(v0, 2);
    assert_int_equal(v1, 2);
    assert_memory_equal(w0, w1, P * sizeof(float));
    for (size_t i = 0; i < P; i++)
        want[i] = rng_f(&g) * 0.2f;
    assert_int_equal(rnnd_named_tensors_from_params(&nt, &r1.m, want), 0);
    cluster_phase("SetWeights through rank 1");
    EXPECT_OK(rnnd_client_set_weights(c1, &nt, &v1));
    rnnd_named_tensors_free(&nt);
    free(w0);
    free(w1);
    w0 = get_params(c0, &r0.m, &v0);
    assert_int_equal(v0, 3);
    assert_memory_equal(w0, want, P * sizeof(float));
    ref_reload(&r0, c0);
    ref_reload(&r1, c1);
    cluster_phase("Steps on rank 0");
    step_envs(c0, &r0, &g, 2, true);
    cluster_phase("Steps on rank 1");
    step_envs(c1, &r1, &g, 2, true);

    // Rank 1 stops: rank 0 cannot update alone; it drains and exits with status 3.
    rnnd_client_free(c1);
    cluster_phase("SIGTERM to rank 1; waiting for it to exit");
    assert_int_equal(daemon_signal_wait(&d1, SIGTERM, 30000), 0);
    cluster_phase("rank 1 exited; waiting for rank 0 to drain and exit with status 3");
    int rc = daemon_signal_wait(&d0, 0, 30000);
    if (rc != 0 || !WIFEXITED(d0.exit_status) || WEXITSTATUS(d0.exit_status) != 3)
        daemon_dump_log(&d0, 3000);
    assert_int_equal(rc, 0);
    assert_true(WIFEXITED(d0.exit_status) && WEXITSTATUS(d0.exit_status) == 3);
    assert_true(daemon_log_contains(&d0, "rank 1 closed its connection"));
    cluster_phase("done");

    free(w0);
    free(want);
    free(grads);
    free(sum);
    ref_free(&r0);
    ref_free(&r1);
    rnnd_client_free(c0);
    daemon_free(&d0);
    daemon_free(&d1);
}

static void test_cluster_two_daemons(void **state) {
    (void)state;
    const char *spec = getenv("RNND_TEST_CLUSTER_DEVICES");
    if (spec && strchr(spec, ';')) {
        char dev0[64], dev1[64];
        snprintf(dev0, sizeof(dev0), "%.*s", (int)(strchr(spec, ';') - spec), spec);
        snprintf(dev1, sizeof(dev1), "%s", strchr(spec, ';') + 1);
        two_daemons(dev0, dev1);
    } else if (strcmp(harness_backend(), "cpu") == 0) {
        // One engine each, as one GPU each; then two each (ranks in one process and in two).
        two_daemons("", "");
        two_daemons("0,1", "0,1");
    } else {
        fprintf(stderr, "two daemons: set RNND_TEST_CLUSTER_DEVICES=\"0;1\" (needs NCCL)\n");
        skip();
    }
}

// ---------------------------------------------------------------------------------------------
// Timing of a learner step.

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Backend seconds and calls of each learner op so far, from /metrics.
static void op_totals(const struct daemon *d, double secs[3], double calls[3]) {
    static const char *const ops[3] = {"op=\"forward\"", "op=\"backward\"", "op=\"optim\""};
    int status;
    char *body = NULL;
    assert_int_equal(http_get(d->http, "/metrics", &status, NULL, &body), 0);
    for (int k = 0; k < 3; k++) {
        secs[k] = prom_value(body, "rnnd_backend_kernel_seconds_total", ops[k]);
        calls[k] = prom_value(body, "rnnd_backend_calls_total", ops[k]);
    }
    free(body);
}

static void time_learner_step(const char *list) {
    enum { B = 2048, T = 64, I = 64, H = 128, WARM = 3, REPS = 10 };
    struct daemon d;
    const char *args[] = {
        "--cell",    "gru", "--input-size",     "64",   "--hidden-size",    "128", "--layers", "1",
        "--devices", list,  "--tape-memory-mb", "8192", "--max-message-mb", "512", NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client_opts o = {.target = d.grpc, .max_message_bytes = 512 << 20};
    struct rnnd_client *c;
    EXPECT_OK(rnnd_client_init(&o, &c));
    size_t nx = (size_t)B * T * I, no = (size_t)B * T * H;
    float *x = malloc(nx * sizeof(float)), *go = malloc(no * sizeof(float));
    uint8_t *init = calloc((size_t)B * T, 1);
    struct rng g = {1};
    rng_fill(&g, x, nx);
    rng_fill(&g, go, no);
    double ms[3][REPS], s0[3], c0[3], s1[3], c1[3];
    for (int it = 0; it < WARM + REPS; it++) {
        if (it == WARM)
            op_totals(&d, s0, c0);
        double t0 = now_seconds();
        struct rnnd_forward_req fr = {
            .obs = rnnd_tensor_f32(x, 3, B, T, I, 0),
            .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T}),
            .keep_tape = true};
        struct rnnd_forward_reply f;
        EXPECT_OK(rnnd_client_forward(c, &fr, &f));
        double t1 = now_seconds();
        struct rnnd_backward_req br = {.tape_id = f.tape_id,
                                       .grad_output = rnnd_tensor_f32(go, 3, B, T, H, 0),
                                       .accumulate = true};
        struct rnnd_backward_reply b;
        EXPECT_OK(rnnd_client_backward(c, &br, &b));
        double t2 = now_seconds();
        uint64_t v;
        EXPECT_OK(rnnd_client_apply_gradients(c, NULL, NULL, &v));
        double t3 = now_seconds();
        rnnd_backward_reply_free(&b);
        rnnd_forward_reply_free(&f);
        if (it >= WARM) {
            ms[0][it - WARM] = (t1 - t0) * 1e3;
            ms[1][it - WARM] = (t2 - t1) * 1e3;
            ms[2][it - WARM] = (t3 - t2) * 1e3;
        }
    }
    op_totals(&d, s1, c1);
    double med[3];
    for (int k = 0; k < 3; k++) {
        qsort(ms[k], REPS, sizeof(double), cmp_double);
        med[k] = ms[k][REPS / 2];
    }
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    printf("learner_step devices=%s B=%d T=%d forward=%.2f ms backward=%.2f ms apply=%.2f ms "
           "total=%.2f ms (median of %d, over gRPC from this process; %s)\n",
           list, B, T, med[0], med[1], med[2], med[0] + med[1] + med[2], REPS, info.device);
    // Inside the daemon: each device's part, per call (copies to and from the device included;
    // with several devices the parts run at once).
    printf("learner_step devices=%s in the daemon per device: forward=%.2f ms backward=%.2f ms "
           "optim=%.2f ms\n",
           list, 1e3 * (s1[0] - s0[0]) / (c1[0] - c0[0]), 1e3 * (s1[1] - s0[1]) / (c1[1] - c0[1]),
           1e3 * (s1[2] - s0[2]) / (c1[2] - c0[2]));
    fflush(stdout);
    free(x);
    free(go);
    free(init);
    rnnd_client_free(c);
    daemon_free(&d);
}

static void test_learner_step_timing(void **state) {
    (void)state;
    if (getenv("RNND_TEST_TIMING") == NULL) {
        skip();
        return;
    }
    char first[16];
    snprintf(first, sizeof(first), "%.*s", (int)strcspn(devices(), ","), devices());
    time_learner_step(first);
    time_learner_step(devices());
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_flags),
        cmocka_unit_test(test_replicas_identical),
        cmocka_unit_test(test_placement_and_restart),
        cmocka_unit_test(test_one_device_checkpoint_to_several),
        cmocka_unit_test(test_place_block),
        cmocka_unit_test(test_cluster_two_daemons),
        cmocka_unit_test(test_learner_step_timing),
    };
    // RNND_TEST_FILTER: run only the tests whose names match (cmocka's pattern, e.g. "*timing").
    if (getenv("RNND_TEST_FILTER"))
        cmocka_set_test_filter(getenv("RNND_TEST_FILTER"));
    return cmocka_run_group_tests_name("devices", tests, NULL, NULL) ? 1 : 0;
}
