/*
 * test_errors.c: every error case of docs/design.md, each followed by a check that the rejected
 * request changed nothing: the probe envs (which most bad requests also name) continue exactly as
 * the reference says, the weights and model version are the same and no env appeared or vanished.
 *
 * One daemon for the file: GRU I=8 H=16, --max-message-mb 2, --max-envs 32, --tape-memory-mb 1.
 * With RNND_DEVICES=0,1 (CMakeLists.txt) the daemon runs two engines: the probe envs then live on
 * both devices, and the requests that mix envs of both devices, one of which refuses its part,
 * check that the other device ran nothing either. --max-envs and --tape-memory-mb count per
 * device.
 */
#include "harness.h"

#include <grpc/status.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "group.h" // rnnd_place: the device that holds an env

#define I_     8
#define H_     16
#define NPROBE 4
#define ATOL   2e-5f
#define RTOL   1e-4f

struct fixture {
    struct daemon d;
    int devices; // engines of the daemon (--devices)
    struct rnnd_client *c;
    struct ref r;
    uint64_t version;
    uint64_t envs_active;
    struct rng g;
};

static struct fixture fx;
static const uint64_t probe_ids[NPROBE] = {100, 101, 102, 103};
static const int32_t probe_slots[NPROBE] = {0, 1, 2, 3};

// The device (engine) that holds env id.
static int device_of(const struct fixture *f, uint64_t id) {
    return rnnd_place(id, f->devices, 1);
}

// The first env id from `from` on that holds its state on device k.
static uint64_t id_on(const struct fixture *f, int k, uint64_t from) {
    while (device_of(f, from) != k)
        from++;
    return from;
}

// Forward tapes the daemon holds (every device's), from /metrics.
static double tapes_held(const struct fixture *f) {
    return daemon_metric(&f->d, "rnnd_tapes", NULL);
}

static void probe_step(struct fixture *f, bool init, const char *what) {
    float x[NPROBE * I_], ref[NPROBE * H_];
    rng_fill(&f->g, x, NPROBE * I_);
    bool inits[NPROBE] = {init, init, init, init};
    struct rnnd_step_req req = step_request(NPROBE, probe_ids, x, I_, inits);
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    ref_step(&f->r, NPROBE, probe_slots, x, inits, ref);
    assert_tensor_f32(&r.output, 2, NPROBE, H_, 0, 0);
    assert_true(close_f32(what, r.output.data, ref, NPROBE * H_, ATOL, RTOL));
    assert_int_equal(r.model_version, f->version);
    rnnd_step_reply_free(&r);
}

// The rejected request changed nothing: same version, same env count, same weights, and the
// probe envs continue from the state the reference holds.
static void check_unchanged_(struct fixture *f, const char *what) {
    assert_true(daemon_alive(&f->d));
    struct rnnd_model_info i;
    EXPECT_OK(rnnd_client_info(f->c, &i));
    if (i.model_version != f->version || i.envs_active != f->envs_active)
        fprintf(stderr, "%s: model_version %llu (want %llu), envs_active %llu (want %llu)\n", what,
                (unsigned long long)i.model_version, (unsigned long long)f->version,
                (unsigned long long)i.envs_active, (unsigned long long)f->envs_active);
    assert_int_equal(i.model_version, f->version);
    assert_int_equal(i.envs_active, f->envs_active);
    // Every test uses up the tapes it keeps: a tape still held was left by a refused call.
    double tapes = tapes_held(f);
    if (tapes != 0)
        fprintf(stderr, "%s: %g tapes held\n", what, tapes);
    assert_true(tapes == 0);
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(f->c, &w, NULL));
    float *p = malloc(f->r.P * sizeof(float));
    assert_int_equal(rnnd_named_tensors_to_params(&w, &f->r.m, p), 0);
    if (memcmp(p, f->r.params, f->r.P * sizeof(float)) != 0)
        fprintf(stderr, "%s: the weights changed\n", what);
    assert_memory_equal(p, f->r.params, f->r.P * sizeof(float));
    free(p);
    rnnd_named_tensors_free(&w);
    probe_step(f, false, what);
}
#define check_unchanged(f) check_unchanged_((f), __func__)

static int setup(void **state) {
    struct fixture *f = &fx;
    f->g.s = 1234;
    f->devices = 1;
    for (const char *d = harness_devices(); d && *d; d++)
        f->devices += *d == ',';
    const char *args[] = {"--cell",
                          "gru",
                          "--input-size",
                          "8",
                          "--hidden-size",
                          "16",
                          "--layers",
                          "1",
                          "--max-message-mb",
                          "2",
                          "--max-envs",
                          "32",
                          "--tape-memory-mb",
                          "1",
                          "--seed",
                          "3",
                          NULL};
    if (daemon_start(&f->d, args) != 0)
        return -1;
    f->c = daemon_client(&f->d, NULL);
    ref_init(&f->r, f->c, 8);
    struct rnnd_model_info i;
    EXPECT_OK(rnnd_client_info(f->c, &i));
    f->version = i.model_version;
    probe_step(f, true, "probe init");
    EXPECT_OK(rnnd_client_info(f->c, &i));
    f->envs_active = i.envs_active;
    assert_int_equal(f->envs_active, NPROBE);
    *state = f;
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

// A request over the probe envs with obs as given.
static struct rnnd_step_req probe_req(struct rnnd_tensor obs) {
    return (struct rnnd_step_req){.n_env_ids = NPROBE, .env_ids = probe_ids, .obs = obs};
}

static int step(struct fixture *f, const struct rnnd_step_req *req) {
    struct rnnd_step_reply r;
    int err = rnnd_client_step(f->c, req, &r);
    rnnd_step_reply_free(&r);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Step.

static void test_obs_shape(void **state) {
    struct fixture *f = *state;
    float x[(NPROBE + 1) * (I_ + 1)] = {0};
    struct rnnd_step_req req = probe_req(rnnd_tensor_f32(x, 2, NPROBE, I_ + 1, 0, 0));
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs = rnnd_tensor_f32(x, 2, NPROBE, I_ - 1, 0, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs = rnnd_tensor_f32(x, 2, NPROBE - 1, I_, 0, 0); // rows != env ids
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs = rnnd_tensor_f32(x, 2, NPROBE + 1, I_, 0, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs = rnnd_tensor_f32(x, 1, NPROBE * I_, 0, 0, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs = rnnd_tensor_f32(x, 3, NPROBE, 1, I_, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs = rnnd_tensor_f32(x, 2, -NPROBE, -I_, 0, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs.present = false; // no obs at all
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    check_unchanged(f);
}

static void test_obs_dtype(void **state) {
    struct fixture *f = *state;
    static uint8_t x[NPROBE * I_ * 8];
    // FLOAT32, BFLOAT16 and FLOAT16 are taken (test_step: wire dtypes); nothing else.
    const enum rnnd_dtype bad[] = {RNND_DTYPE_UNSPECIFIED, RNND_DTYPE_BOOL, RNND_DTYPE_INT64,
                                   (enum rnnd_dtype)77};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        int64_t shape[2] = {NPROBE, I_};
        struct rnnd_step_req req = probe_req(rnnd_tensor_view(bad[k], x, 2, shape));
        if (req.obs.nbytes == 0)
            req.obs.nbytes = NPROBE * I_ * 4;
        EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    }
    check_unchanged(f);
}

static void test_obs_bytes(void **state) {
    struct fixture *f = *state;
    float x[NPROBE * I_ + 4] = {0};
    struct rnnd_step_req req = probe_req(rnnd_tensor_f32(x, 2, NPROBE, I_, 0, 0));
    req.obs.nbytes -= 4;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs.nbytes += 8;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs.nbytes = 1;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.obs.nbytes = 0;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    check_unchanged(f);
}

static void test_flag_lengths(void **state) {
    struct fixture *f = *state;
    float x[NPROBE * I_] = {0};
    bool init[NPROBE + 1] = {false};
    uint64_t idx[NPROBE + 1] = {0};
    struct rnnd_step_req req = probe_req(rnnd_tensor_f32(x, 2, NPROBE, I_, 0, 0));
    req.is_init = init;
    req.n_is_init = NPROBE - 1;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.n_is_init = NPROBE + 1;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    req.n_is_init = 0;
    req.step_index = idx;
    req.n_step_index = 2;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    check_unchanged(f);
}

static void test_duplicate_env(void **state) {
    struct fixture *f = *state;
    uint64_t ids[NPROBE] = {100, 101, 100, 102};
    float x[NPROBE * I_] = {0};
    struct rnnd_step_req req = {
        .n_env_ids = NPROBE, .env_ids = ids, .obs = rnnd_tensor_f32(x, 2, NPROBE, I_, 0, 0)};
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    // Also for envs that do not exist yet, with is_init.
    uint64_t fresh[2] = {7777, 7777};
    bool init[2] = {true, true};
    req = (struct rnnd_step_req){.n_env_ids = 2,
                                 .env_ids = fresh,
                                 .obs = rnnd_tensor_f32(x, 2, 2, I_, 0, 0),
                                 .n_is_init = 2,
                                 .is_init = init};
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    // EndEpisodes refuses duplicates too (recorded Forward: test_forward_errors).
    uint64_t released;
    EXPECT_STATUS(rnnd_client_end_episodes(f->c, ids, NPROBE, &released),
                  GRPC_STATUS_INVALID_ARGUMENT);
    check_unchanged(f);
}

static void test_non_finite(void **state) {
    struct fixture *f = *state;
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (int k = 0; k < 3; k++) {
        float x[NPROBE * I_];
        rng_fill(&f->g, x, NPROBE * I_);
        x[2 * I_ + 5] = bad[k];
        struct rnnd_step_req req = probe_req(rnnd_tensor_f32(x, 2, NPROBE, I_, 0, 0));
        EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    }
    check_unchanged(f);
}

static void test_unknown_env(void **state) {
    struct fixture *f = *state;
    float x[3 * I_] = {0};
    uint64_t ids[3] = {100, 101, 999999};
    struct rnnd_step_req req = {
        .n_env_ids = 3, .env_ids = ids, .obs = rnnd_tensor_f32(x, 2, 3, I_, 0, 0)};
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    req.n_env_ids = 1;
    req.env_ids = &ids[2];
    req.obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    // Still unknown: the refusal did not create a zero state.
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    // is_init false given explicitly is the same as empty.
    bool no[1] = {false};
    req.n_is_init = 1;
    req.is_init = no;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    check_unchanged(f);
}

static void test_step_index_errors(void **state) {
    struct fixture *f = *state;
    // The probe envs have no index history; env 200 gets one.
    uint64_t id = 200, k;
    bool init = true;
    float x[I_] = {0};
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &id,
                                .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &init,
                                .n_step_index = 1,
                                .step_index = &k};
    k = 10;
    EXPECT_OK(step(f, &req));
    f->envs_active++;
    init = false;
    struct rnnd_step_reply r;
    k = 11;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    float out11[H_];
    memcpy(out11, r.output.data, sizeof out11);
    rnnd_step_reply_free(&r);
    k = 13;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    k = 9;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    k = UINT64_MAX;
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_FAILED_PRECONDITION);
    k = 11; // the retry still answers from the cache: the refusals did not advance the env
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    assert_memory_equal(out11, r.output.data, sizeof out11);
    rnnd_step_reply_free(&r);
    // A request where one env skips ahead is refused as a whole: the other env does not advance.
    uint64_t ids[2] = {200, 100};
    uint64_t idx[2] = {14, 0};
    float x2[2 * I_] = {0};
    struct rnnd_step_req req2 = {.n_env_ids = 2,
                                 .env_ids = ids,
                                 .obs = rnnd_tensor_f32(x2, 2, 2, I_, 0, 0),
                                 .n_step_index = 2,
                                 .step_index = idx};
    EXPECT_STATUS(step(f, &req2), GRPC_STATUS_FAILED_PRECONDITION);
    check_unchanged(f);
    k = 12;
    EXPECT_OK(step(f, &req));
}

static void test_extras_without_flag(void **state) {
    struct fixture *f = *state;
    float x[NPROBE * I_] = {0}, e[NPROBE * 2] = {0};
    struct rnnd_step_req req = probe_req(rnnd_tensor_f32(x, 2, NPROBE, I_, 0, 0));
    req.extras = rnnd_tensor_f32(e, 2, NPROBE, 2, 0, 0);
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_INVALID_ARGUMENT);
    const char *msg = rnnd_client_last_error()->message;
    if (!strstr(msg, "extras-size"))
        fprintf(stderr, "the message should name --extras-size: \"%s\"\n", msg);
    assert_non_null(strstr(msg, "extras-size"));
    check_unchanged(f);
}

static void test_oversize(void **state) {
    struct fixture *f = *state;
    // 2.5 MB of obs against --max-message-mb 2.
    int B = 80000;
    float *x = calloc((size_t)B * I_, sizeof(float));
    uint64_t *ids = malloc(sizeof(uint64_t) * (size_t)B);
    for (int b = 0; b < B; b++)
        ids[b] = 1000000 + (uint64_t)b;
    bool *init = malloc((size_t)B);
    memset(init, 1, (size_t)B);
    struct rnnd_step_req req = {.n_env_ids = (size_t)B,
                                .env_ids = ids,
                                .obs = rnnd_tensor_f32(x, 2, B, I_, 0, 0),
                                .n_is_init = (size_t)B,
                                .is_init = init};
    EXPECT_STATUS(step(f, &req), GRPC_STATUS_RESOURCE_EXHAUSTED);
    // Oversize SetWeights too.
    struct rnnd_named_tensor nt = {.name = "weight_ih_l0",
                                   .tensor = rnnd_tensor_f32(x, 2, B, I_, 0, 0)};
    struct rnnd_named_tensors l = {.n = 1, .v = &nt};
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, NULL), GRPC_STATUS_RESOURCE_EXHAUSTED);
    free(x);
    free(ids);
    free(init);
    check_unchanged(f);
}

// Steps one new env (is_init) with step_index `index` (no index when 0): 0 or the error.
static int step_new(struct fixture *f, uint64_t id, uint64_t index) {
    float x[I_] = {0};
    bool init = true;
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &id,
                                .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &init,
                                .n_step_index = index ? 1 : 0,
                                .step_index = &index};
    return step(f, &req);
}

// A Step over the probe envs (which live on every device when there are several) plus a new env
// `fresh` (is_init) and an env `bad` that its device refuses (`bad_init`, `bad_index`: its row's
// is_init and step_index; every row gets step_index when bad_index is nonzero), sent on a stream
// or as a unary call. It must be refused with `status` and change nothing: the probes continue as
// the reference says and `fresh` is not created, also on the devices that had nothing to refuse.
static void refused_mix(struct fixture *f, uint64_t fresh, uint64_t bad, bool bad_init,
                        uint64_t bad_index, bool stream, int status, const char *what) {
    enum { B = NPROBE + 2 };
    uint64_t ids[B], index[B];
    bool init[B] = {false};
    float x[B * I_];
    rng_fill(&f->g, x, B * I_);
    for (int k = 0; k < NPROBE; k++) {
        ids[k] = probe_ids[k];
        index[k] = 1; // the probes have no step_index history: any index is their next
    }
    ids[NPROBE] = fresh;
    init[NPROBE] = true;
    index[NPROBE] = 1;
    ids[NPROBE + 1] = bad;
    init[NPROBE + 1] = bad_init;
    index[NPROBE + 1] = bad_index;
    struct rnnd_step_req req = {.n_env_ids = B,
                                .env_ids = ids,
                                .obs = rnnd_tensor_f32(x, 2, B, I_, 0, 0),
                                .n_is_init = B,
                                .is_init = init,
                                .n_step_index = bad_index ? B : 0,
                                .step_index = index};
    fprintf(stderr, "%s (%s): env %llu on device %d refused, new env %llu on device %d\n", what,
            stream ? "StepStream" : "Step", (unsigned long long)bad, device_of(f, bad),
            (unsigned long long)fresh, device_of(f, fresh));
    if (stream) {
        struct rnnd_client_stream *s;
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_stream_init(f->c, &s));
        EXPECT_STATUS(rnnd_client_stream_step(s, &req, &r), status);
        rnnd_client_stream_free(s);
    } else {
        EXPECT_STATUS(step(f, &req), status);
    }
    check_unchanged_(f, what);
    // Still unknown (check_unchanged counted the envs; this names the one).
    float y[I_] = {0};
    struct rnnd_step_req again = {
        .n_env_ids = 1, .env_ids = &fresh, .obs = rnnd_tensor_f32(y, 2, 1, I_, 0, 0)};
    EXPECT_STATUS(step(f, &again), GRPC_STATUS_FAILED_PRECONDITION);
}

// A Step that one device refuses runs on no device (docs/design.md), as a unary call and on a
// stream: an unknown env without is_init, and a step_index that skips ahead.
static void test_refused_on_one_device(void **state) {
    struct fixture *f = *state;
    // The probes live on every device, so whichever device refuses, another one holds probes.
    bool on[8] = {false};
    for (int k = 0; k < NPROBE; k++)
        on[device_of(f, probe_ids[k])] = true;
    for (int d = 0; d < f->devices && d < 8; d++)
        assert_true(on[d]);
    int bad_dev = 0, other = 1 % f->devices;
    uint64_t fresh = id_on(f, other, 5000);
    uint64_t unknown = id_on(f, bad_dev, 6000);
    for (int stream = 0; stream < 2; stream++)
        refused_mix(f, fresh, unknown, false, 0, stream, GRPC_STATUS_FAILED_PRECONDITION,
                    "unknown env");
    // An env with a step_index history: last index 10.
    uint64_t indexed = id_on(f, bad_dev, 7000);
    EXPECT_OK(step_new(f, indexed, 10));
    f->envs_active++;
    for (int stream = 0; stream < 2; stream++)
        refused_mix(f, fresh, indexed, false, 12, stream, GRPC_STATUS_FAILED_PRECONDITION,
                    "step_index skips ahead");
    // The refusals did not advance it: 11 is still its next step.
    float x[I_] = {0};
    uint64_t k = 11;
    struct rnnd_step_req next = {.n_env_ids = 1,
                                 .env_ids = &indexed,
                                 .obs = rnnd_tensor_f32(x, 2, 1, I_, 0, 0),
                                 .n_step_index = 1,
                                 .step_index = &k};
    EXPECT_OK(step(f, &next));
    uint64_t released;
    EXPECT_OK(rnnd_client_end_episodes(f->c, &indexed, 1, &released));
    assert_int_equal(released, 1);
    f->envs_active--;
    check_unchanged(f);
}

static void test_env_table_full(void **state) {
    struct fixture *f = *state;
    // --max-envs counts per device: fill device 0's table with new envs that live there, one Step
    // each until it refuses (how many it already holds depends on the tests before).
    uint64_t ids[32], id = 300;
    int added = 0;
    for (;;) {
        id = id_on(f, 0, id + 1);
        int err = step_new(f, id, 0);
        if (err) {
            EXPECT_STATUS(err, GRPC_STATUS_RESOURCE_EXHAUSTED);
            break;
        }
        assert_true(added < 32);
        ids[added++] = id;
        f->envs_active++;
    }
    assert_true(added > 2);
    // Known envs still step while the table is full.
    check_unchanged(f);
    // A new env for the full device next to new and known envs elsewhere: nothing happens on any
    // device.
    uint64_t fresh = id_on(f, 1 % f->devices, 400), more = id_on(f, 0, id + 1);
    for (int stream = 0; stream < 2; stream++)
        refused_mix(f, fresh, more, true, 0, stream, GRPC_STATUS_RESOURCE_EXHAUSTED,
                    "env table full");
    uint64_t released;
    EXPECT_OK(rnnd_client_end_episodes(f->c, ids, (size_t)added, &released));
    assert_int_equal(released, (uint64_t)added);
    f->envs_active -= (uint64_t)added;
    EXPECT_OK(step_new(f, more, 0)); // room again
    EXPECT_OK(step_new(f, fresh, 0));
    f->envs_active += 2;
    check_unchanged(f);
}

// ---------------------------------------------------------------------------------------------
// Forward, Backward.

static int forward(struct fixture *f, const struct rnnd_forward_req *req, uint64_t *tape) {
    struct rnnd_forward_reply r;
    int err = rnnd_client_forward(f->c, req, &r);
    if (tape)
        *tape = r.tape_id;
    rnnd_forward_reply_free(&r);
    return err;
}

static void test_forward_errors(void **state) {
    struct fixture *f = *state;
    enum { B = 2, T = 3 };
    float x[B * T * (I_ + 1)], h0[B * H_], hid[B * T * H_];
    uint8_t init[B * (T + 1)] = {0};
    rng_fill(&f->g, x, sizeof x / sizeof x[0]);
    memset(h0, 0, sizeof h0);
    memset(hid, 0, sizeof hid);
    int64_t ishape[2] = {B, T};
    struct rnnd_forward_req ok = {
        .obs = rnnd_tensor_f32(x, 3, B, T, I_, 0),
        .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, ishape),
    };
    EXPECT_OK(forward(f, &ok, NULL));
    struct rnnd_forward_req req = ok;
    req.obs = rnnd_tensor_f32(x, 3, B, T, I_ + 1, 0);
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.obs = rnnd_tensor_f32(x, 2, B * T, I_, 0, 0);
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.obs.nbytes -= 4;
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.obs = rnnd_tensor_f32(x, 3, B, 0, I_, 0); // T = 0
    req.is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, 0});
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.is_init = rnnd_tensor_f32((float *)x, 2, B, T, 0, 0); // FLOAT32, not BOOL
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T + 1});
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.h0 = rnnd_tensor_f32(h0, 3, B, 1, H_ - 1, 0);
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.h0 = rnnd_tensor_f32(h0, 3, B, 1, H_, 0);
    req.hidden = rnnd_tensor_f32(hid, 4, B, T, 1, H_); // h0 and hidden are exclusive
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    req.c0 = rnnd_tensor_f32(h0, 3, B, 1, H_, 0); // c0 on a GRU
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    req = ok;
    x[7] = NAN;
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    x[7] = 0;
    req = ok;
    h0[3] = INFINITY;
    req.h0 = rnnd_tensor_f32(h0, 3, B, 1, H_, 0);
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    h0[3] = 0;
    req = (struct rnnd_forward_req){0}; // no source at all
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);

    // Recorded: more steps than recorded, an unknown env, duplicates.
    uint64_t ids[2] = {100, 101};
    // More steps than the ring can ever hold is a bad argument or a failed precondition; more
    // than the envs have recorded so far (they have a few dozen; the ring holds 256) is the latter.
    req = (struct rnnd_forward_req){
        .recorded = true, .n_env_ids = 2, .env_ids = ids, .steps = 100000};
    int err = forward(f, &req, NULL);
    int st = rnnd_client_last_error()->grpc_status;
    assert_true(err != 0 &&
                (st == GRPC_STATUS_INVALID_ARGUMENT || st == GRPC_STATUS_FAILED_PRECONDITION));
    req.steps = 250;
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_FAILED_PRECONDITION);
    const char *msg = rnnd_client_last_error()->message;
    if (!strstr(msg, "100"))
        fprintf(stderr, "the message should name the env: \"%s\"\n", msg);
    assert_non_null(strstr(msg, "100"));
    uint64_t unknown[2] = {100, 888888};
    req.env_ids = unknown;
    req.steps = 1;
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_FAILED_PRECONDITION);
    // With keep_tape, and the unknown env on another device than env 100 when there are several:
    // the device that could run its part keeps no tape of it (check_unchanged counts tapes).
    uint64_t elsewhere[2] = {100, id_on(f, (device_of(f, 100) + 1) % f->devices, 888888)};
    req.env_ids = elsewhere;
    req.keep_tape = true;
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_FAILED_PRECONDITION);
    req.keep_tape = false;
    uint64_t dup[2] = {100, 100};
    req.env_ids = dup;
    EXPECT_STATUS(forward(f, &req, NULL), GRPC_STATUS_INVALID_ARGUMENT);
    check_unchanged(f);
}

static void test_backward_errors(void **state) {
    struct fixture *f = *state;
    enum { B = 2, T = 3 };
    float x[B * T * I_], g[B * T * (H_ + 1)];
    uint8_t init[B * T] = {1, 0, 0, 1, 0, 0};
    rng_fill(&f->g, x, B * T * I_);
    rng_fill(&f->g, g, B * T * (H_ + 1));
    struct rnnd_forward_req fw = {
        .obs = rnnd_tensor_f32(x, 3, B, T, I_, 0),
        .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T}),
        .keep_tape = true,
    };
    uint64_t tape = 0;
    EXPECT_OK(forward(f, &fw, &tape));
    assert_true(tape != 0);
    struct rnnd_backward_reply r;
    struct rnnd_backward_req bw = {.tape_id = tape,
                                   .grad_output = rnnd_tensor_f32(g, 3, B, T, H_, 0)};
    bw.tape_id = tape + 1000;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_NOT_FOUND);
    bw.tape_id = 0;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_NOT_FOUND);
    bw.tape_id = tape;
    bw.grad_output = rnnd_tensor_f32(g, 3, B, T, H_ + 1, 0);
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bw.grad_output = rnnd_tensor_f32(g, 3, B, T - 1, H_, 0);
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bw.grad_output = rnnd_tensor_f32(g, 3, B, T, H_, 0);
    bw.grad_output.nbytes -= 4;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bw.grad_output = rnnd_tensor_f32(g, 3, B, T, H_, 0);
    bw.grad_h_n = rnnd_tensor_f32(g, 3, B, 2, H_, 0); // L = 1
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bw.grad_h_n.present = false;
    g[4] = NAN;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bw, &r), GRPC_STATUS_INVALID_ARGUMENT);
    g[4] = 0.5f;
    // The refusals did not consume the tape.
    EXPECT_OK(rnnd_client_backward(f->c, &bw, &r));
    assert_true(r.grads.n == 4);
    rnnd_backward_reply_free(&r);
    check_unchanged(f);
}

static void test_tape_budget(void **state) {
    struct fixture *f = *state;
    // A tape over --tape-memory-mb 1 (the daemon runs the CPU backend, so its tape has the size the
    // reference backend reports); obs 512 KB, output 1 MB, both under --max-message-mb 2.
    enum { B = 32, T = 512 };
    size_t tape_bytes = f->r.be.ops->tape_bytes(f->r.be.ctx, &f->r.m, B, T);
    assert_true(tape_bytes > (1u << 20));
    float *x = calloc((size_t)B * T * I_, sizeof(float));
    uint8_t *init = calloc((size_t)B * T, 1);
    struct rnnd_forward_req fw = {
        .obs = rnnd_tensor_f32(x, 3, B, T, I_, 0),
        .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T}),
        .keep_tape = true,
    };
    EXPECT_STATUS(forward(f, &fw, NULL), GRPC_STATUS_RESOURCE_EXHAUSTED);
    // Without a tape the same Forward is fine... but its reply (1 MB) fits the 2 MB limit.
    fw.keep_tape = false;
    uint64_t tape = 99;
    EXPECT_OK(forward(f, &fw, &tape));
    assert_int_equal(tape, 0);
    free(x);
    free(init);
    check_unchanged(f);
}

// ---------------------------------------------------------------------------------------------
// ApplyGradients, SetWeights, SaveCheckpoint.

static struct rnnd_named_tensors grads_like(struct fixture *f, float value) {
    float *p = malloc(f->r.P * sizeof(float));
    for (size_t k = 0; k < f->r.P; k++)
        p[k] = value;
    struct rnnd_named_tensors l;
    assert_int_equal(rnnd_named_tensors_from_params(&l, &f->r.m, p), 0);
    free(p);
    return l;
}

static void test_apply_gradients_errors(void **state) {
    struct fixture *f = *state;
    struct rnnd_named_tensors l = grads_like(f, 0.01f);
    uint64_t v;
    // Unknown name.
    char *saved = l.v[1].name;
    l.v[1].name = "weight_xx_l0";
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[1].name = "weight_ih_l0"; // duplicate of v[0]
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[1].name = saved;
    // Wrong shape, dtype, byte count.
    struct rnnd_tensor t = l.v[0].tensor;
    l.v[0].tensor.shape[0] -= 1;
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[0].tensor = t;
    l.v[0].tensor.dtype = RNND_DTYPE_BFLOAT16;
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[0].tensor = t;
    l.v[0].tensor.nbytes -= 4;
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[0].tensor = t;
    // Non-finite gradient.
    ((float *)l.v[2].tensor.data)[3] = NAN;
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    ((float *)l.v[2].tensor.data)[3] = INFINITY;
    EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, NULL, &v), GRPC_STATUS_INVALID_ARGUMENT);
    ((float *)l.v[2].tensor.data)[3] = 0.01f;
    // Bad learning rates.
    const float bad_lr[] = {-1.0f, NAN, INFINITY};
    for (int k = 0; k < 3; k++)
        EXPECT_STATUS(rnnd_client_apply_gradients(f->c, &l, &bad_lr[k], &v),
                      GRPC_STATUS_INVALID_ARGUMENT);
    rnnd_named_tensors_free(&l);
    check_unchanged(f);
}

static void test_set_weights_errors(void **state) {
    struct fixture *f = *state;
    struct rnnd_named_tensors l;
    assert_int_equal(rnnd_named_tensors_from_params(&l, &f->r.m, f->r.params), 0);
    for (size_t k = 0; k < l.n; k++) // different values, so an accepted partial write would show
        for (int64_t j = 0; j < rnnd_tensor_numel(&l.v[k].tensor); j++)
            ((float *)l.v[k].tensor.data)[j] += 0.5f;
    uint64_t v;
    struct rnnd_tensor t = l.v[3].tensor;
    l.v[3].tensor.shape[0] += 1;
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[3].tensor = t;
    l.v[3].tensor.ndim = 2;
    l.v[3].tensor.shape[1] = 1;
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[3].tensor = t;
    l.v[3].tensor.dtype = RNND_DTYPE_INT64;
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[3].tensor = t;
    l.v[3].tensor.nbytes -= 4; // (a longer claim would read past the buffer)
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    float longer[3 * H_ + 1];
    memcpy(longer, t.data, t.nbytes);
    longer[3 * H_] = 0.0f;
    l.v[3].tensor.data = longer;
    l.v[3].tensor.nbytes = t.nbytes + 4;
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[3].tensor = t;
    char *saved = l.v[2].name;
    l.v[2].name = "bias_xx_l0";
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[2].name = "weight_hh_l1"; // a layer the model does not have
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    l.v[2].name = saved;
    ((float *)l.v[1].tensor.data)[0] = NAN;
    EXPECT_STATUS(rnnd_client_set_weights(f->c, &l, &v), GRPC_STATUS_INVALID_ARGUMENT);
    rnnd_named_tensors_free(&l);
    check_unchanged(f);
}

static void test_checkpoint_path_outside(void **state) {
    struct fixture *f = *state;
    const char *bad[] = {"/tmp/rnnd-escape-test", "../escape", "a/../../escape"};
    for (int k = 0; k < 3; k++) {
        char *path = NULL;
        int err = rnnd_client_save_checkpoint(f->c, bad[k], &path, NULL);
        if (err == 0)
            fprintf(stderr, "SaveCheckpoint(\"%s\") wrote %s, outside --state-dir\n", bad[k], path);
        free(path);
        EXPECT_STATUS(err, GRPC_STATUS_INVALID_ARGUMENT);
    }
    check_unchanged(f);
}

// ---------------------------------------------------------------------------------------------
// Bytes that are not the message the method wants.

static void test_malformed_and_unknown(void **state) {
    struct fixture *f = *state;
    const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x12, 0x99, 0x01, 0x02};
    void *reply;
    size_t len;
    int err =
        rnnd_client_call_raw(f->c, "/rnnd.v1.Rnn/Step", garbage, sizeof garbage, &reply, &len);
    int st = rnnd_client_last_error()->grpc_status;
    if (err == 0 || (st != GRPC_STATUS_INVALID_ARGUMENT && st != GRPC_STATUS_INTERNAL))
        fprintf(stderr, "garbage Step: %s: %s\n", rnnd_grpc_status_name(st),
                rnnd_client_last_error()->message);
    assert_true(err != 0 && (st == GRPC_STATUS_INVALID_ARGUMENT || st == GRPC_STATUS_INTERNAL));
    err = rnnd_client_call_raw(f->c, "/rnnd.v1.Rnn/Forward", garbage, sizeof garbage, &reply, &len);
    st = rnnd_client_last_error()->grpc_status;
    assert_true(err != 0 && (st == GRPC_STATUS_INVALID_ARGUMENT || st == GRPC_STATUS_INTERNAL));
    EXPECT_STATUS(rnnd_client_call_raw(f->c, "/rnnd.v1.Rnn/NoSuchMethod", "", 0, &reply, &len),
                  GRPC_STATUS_UNIMPLEMENTED);
    EXPECT_STATUS(rnnd_client_call_raw(f->c, "/rnnd.v2.Rnn/Step", "", 0, &reply, &len),
                  GRPC_STATUS_UNIMPLEMENTED);
    // An empty message is a valid StepRequest with no envs and no obs: refused as bad input.
    EXPECT_STATUS(rnnd_client_call_raw(f->c, "/rnnd.v1.Rnn/Step", "", 0, &reply, &len),
                  GRPC_STATUS_INVALID_ARGUMENT);
    check_unchanged(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_obs_shape),
        cmocka_unit_test(test_obs_dtype),
        cmocka_unit_test(test_obs_bytes),
        cmocka_unit_test(test_flag_lengths),
        cmocka_unit_test(test_duplicate_env),
        cmocka_unit_test(test_non_finite),
        cmocka_unit_test(test_unknown_env),
        cmocka_unit_test(test_step_index_errors),
        cmocka_unit_test(test_refused_on_one_device),
        cmocka_unit_test(test_extras_without_flag),
        cmocka_unit_test(test_oversize),
        cmocka_unit_test(test_env_table_full),
        cmocka_unit_test(test_forward_errors),
        cmocka_unit_test(test_backward_errors),
        cmocka_unit_test(test_tape_budget),
        cmocka_unit_test(test_apply_gradients_errors),
        cmocka_unit_test(test_set_weights_errors),
        cmocka_unit_test(test_checkpoint_path_outside),
        cmocka_unit_test(test_malformed_and_unknown),
    };
    return cmocka_run_group_tests_name("errors", tests, setup, teardown) ? 1 : 0;
}
