/*
 * test_step.c: Step and StepStream semantics against the CPU reference (docs/design.md): many
 * steps over random subsets of envs in random order with random resets, for GRU and LSTM with
 * two layers; returned states; retry-safe step_index; EndEpisodes; determinism; GetModelInfo;
 * and a policy daemon's info and actions through the C client (unary and StepStream).
 *
 * Each group starts its own daemon; the reference gets the daemon's weights through GetWeights.
 */
#include "harness.h"

#include <grpc/status.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define I_   16
#define H_   32
#define L_   2
#define NENV 48
#define ATOL 2e-5f
#define RTOL 1e-4f

struct fixture {
    struct daemon d;
    struct rnnd_client *c;
    struct ref r;
    const char *cell;
};

static struct fixture fx_gru = {.cell = "gru"}, fx_lstm = {.cell = "lstm"};

static int setup(void **state, struct fixture *f) {
    const char *args[] = {"--cell",   f->cell, "--input-size", "16", "--hidden-size", "32",
                          "--layers", "2",     "--max-batch",  "64", "--seed",        "7",
                          NULL};
    if (daemon_start(&f->d, args) != 0)
        return -1;
    f->c = daemon_client(&f->d, NULL);
    ref_init(&f->r, f->c, NENV + 8);
    *state = f;
    return 0;
}

static int setup_gru(void **state) {
    return setup(state, &fx_gru);
}
static int setup_lstm(void **state) {
    return setup(state, &fx_lstm);
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

// Env ids far apart and large, to catch truncation to 32 bits or dense-array assumptions.
static uint64_t env_id(uint64_t base, int k) {
    return base + (uint64_t)k * 0x100000001ull;
}

// Checks reply r for the B rows of slots: output against out_ref and, when present, the returned
// state against the reference slot table.
static void check_reply(struct fixture *f, const struct rnnd_step_reply *r, int B,
                        const int32_t *slots, const float *out_ref, bool want_state,
                        const char *what) {
    int L = f->r.m.L, H = f->r.m.H;
    assert_tensor_f32(&r->output, 2, B, H, 0, 0);
    assert_true(close_f32(what, r->output.data, out_ref, (size_t)B * H, ATOL, RTOL));
    if (!want_state)
        return;
    assert_tensor_f32(&r->h, 3, B, L, H, 0);
    for (int b = 0; b < B; b++)
        assert_true(close_f32("h", (const float *)r->h.data + (size_t)b * L * H,
                              f->r.state_h + (size_t)slots[b] * L * H, (size_t)L * H, ATOL, RTOL));
    if (f->r.m.cell == RNND_CELL_LSTM) {
        assert_tensor_f32(&r->c, 3, B, L, H, 0);
        for (int b = 0; b < B; b++)
            assert_true(close_f32("c", (const float *)r->c.data + (size_t)b * L * H,
                                  f->r.state_c + (size_t)slots[b] * L * H, (size_t)L * H, ATOL,
                                  RTOL));
    } else {
        assert_false(r->c.present && r->c.nbytes > 0);
    }
}

// Builds one random request: a random subset of the NENV envs in random order, with resets.
struct round {
    int B;
    uint64_t ids[NENV];
    int32_t slots[NENV];
    bool init[NENV];
    bool any_init;
    float obs[NENV * I_];
};

static void make_round(struct rng *g, uint64_t base, bool all_init, struct round *rd) {
    int perm[NENV];
    rng_perm(g, perm, NENV);
    rd->B = all_init ? NENV : 1 + (int)rng_u(g, NENV);
    rd->any_init = false;
    for (int b = 0; b < rd->B; b++) {
        rd->slots[b] = perm[b];
        rd->ids[b] = env_id(base, perm[b]);
        rd->init[b] = all_init || rng_u(g, 10) == 0;
        rd->any_init |= rd->init[b];
    }
    rng_fill(g, rd->obs, (size_t)rd->B * I_);
}

static struct rnnd_step_req round_req(struct round *rd, bool return_state) {
    return (struct rnnd_step_req){
        .n_env_ids = (size_t)rd->B,
        .env_ids = rd->ids,
        .obs = rnnd_tensor_f32(rd->obs, 2, rd->B, I_, 0, 0),
        // Rounds without a reset send an empty is_init ("empty = all false").
        .n_is_init = rd->any_init ? (size_t)rd->B : 0,
        .is_init = rd->init,
        .return_state = return_state,
    };
}

// ---------------------------------------------------------------------------------------------

static void test_info(void **state) {
    struct fixture *f = *state;
    struct rnnd_model_info i;
    EXPECT_OK(rnnd_client_info(f->c, &i));
    assert_string_equal(i.cell, f->cell);
    assert_int_equal(i.input_size, I_);
    assert_int_equal(i.hidden_size, H_);
    assert_int_equal(i.num_layers, L_);
    assert_string_equal(i.backend, harness_backend());
    assert_string_equal(i.compute, harness_compute());
    assert_int_equal(i.max_batch, 64);
    assert_int_equal(i.extras_size, 0);
    assert_true(i.device[0] != '\0');
    if (strcmp(i.backend, "cpu") == 0)
        assert_string_equal(i.kernel_plan, "cpu_reference");
    else
        assert_true(strlen(i.kernel_plan) > 0);
    assert_string_equal(f->d.backend, harness_backend());
}

static void run_unary(struct fixture *f, uint64_t base, int rounds, uint64_t seed) {
    struct rng g = {seed};
    struct round *rd = malloc(sizeof *rd);
    float *out = malloc(sizeof(float) * NENV * H_);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(f->c, &info));
    for (int n = 0; n < rounds; n++) {
        make_round(&g, base, n == 0, rd);
        bool want_state = n % 3 == 0;
        struct rnnd_step_req req = round_req(rd, want_state);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f->c, &req, &r));
        ref_step(&f->r, rd->B, rd->slots, rd->obs, rd->init, out);
        char what[64];
        snprintf(what, sizeof what, "%s round %d output", f->cell, n);
        check_reply(f, &r, rd->B, rd->slots, out, want_state, what);
        assert_int_equal(r.model_version, info.model_version);
        rnnd_step_reply_free(&r);
    }
    free(rd);
    free(out);
}

static void test_step_reference(void **state) {
    struct fixture *f = *state;
    memset(f->r.state_h, 0, sizeof(float) * (size_t)f->r.S * L_ * H_);
    run_unary(f, 1000000000000ull, 150, 11);
}

static void test_stream_reference(void **state) {
    struct fixture *f = *state;
    struct rnnd_client_stream *s;
    EXPECT_OK(rnnd_client_stream_init(f->c, &s));
    struct rng g = {23};
    enum { DEPTH = 4 };
    struct round *rd = malloc(sizeof *rd * DEPTH);
    float *out = malloc(sizeof(float) * NENV * H_);
    uint64_t base = 2000000000000ull;
    for (int n = 0; n < 40; n++) {
        // Pipelined: DEPTH requests in flight on one stream, most envs appearing in several of
        // them; the replies must come back in order, each computed after the previous step of
        // every env it names.
        int depth = n == 0 ? 1 : DEPTH;
        for (int k = 0; k < depth; k++) {
            make_round(&g, base, n == 0, &rd[k]);
            struct rnnd_step_req req = round_req(&rd[k], k == depth - 1);
            EXPECT_OK(rnnd_client_stream_send(s, &req));
        }
        for (int k = 0; k < depth; k++) {
            struct rnnd_step_reply r;
            EXPECT_OK(rnnd_client_stream_recv(s, &r));
            ref_step(&f->r, rd[k].B, rd[k].slots, rd[k].obs, rd[k].init, out);
            char what[64];
            snprintf(what, sizeof what, "%s stream batch %d.%d", f->cell, n, k);
            check_reply(f, &r, rd[k].B, rd[k].slots, out, k == depth - 1, what);
            rnnd_step_reply_free(&r);
        }
    }
    EXPECT_OK(rnnd_client_stream_close(s));
    rnnd_client_stream_free(s);
    free(rd);
    free(out);
}

// The same request sequence replayed from a reset gives bit-identical outputs.
static void test_deterministic(void **state) {
    struct fixture *f = *state;
    uint64_t ids[3] = {77, 78, 79};
    float obs[3 * I_];
    float first[5][3 * H_];
    bool init[3] = {true, true, true};
    for (int pass = 0; pass < 2; pass++) {
        struct rng g = {99};
        for (int n = 0; n < 5; n++) {
            rng_fill(&g, obs, sizeof obs / sizeof obs[0]);
            struct rnnd_step_req req = {.n_env_ids = 3,
                                        .env_ids = ids,
                                        .obs = rnnd_tensor_f32(obs, 2, 3, I_, 0, 0),
                                        .n_is_init = n == 0 ? 3 : 0,
                                        .is_init = init};
            struct rnnd_step_reply r;
            EXPECT_OK(rnnd_client_step(f->c, &req, &r));
            assert_tensor_f32(&r.output, 2, 3, H_, 0, 0);
            if (pass == 0)
                memcpy(first[n], r.output.data, sizeof first[n]);
            else
                assert_memory_equal(first[n], r.output.data, sizeof first[n]);
            rnnd_step_reply_free(&r);
        }
    }
}

static void step1(struct fixture *f, uint64_t id, int32_t slot, const float *x, bool init,
                  const uint64_t *step_index, float *out_server, float *out_ref) {
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &id,
                                .obs = rnnd_tensor_f32((float *)x, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &init,
                                .n_step_index = step_index ? 1 : 0,
                                .step_index = step_index};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    assert_tensor_f32(&r.output, 2, 1, H_, 0, 0);
    memcpy(out_server, r.output.data, sizeof(float) * H_);
    rnnd_step_reply_free(&r);
    if (out_ref)
        ref_step(&f->r, 1, &slot, x, &init, out_ref);
}

static void test_step_index(void **state) {
    struct fixture *f = *state;
    struct rng g = {5};
    int32_t slot = NENV; // a spare slot
    uint64_t id = 31337;
    float x[5][I_], out[H_], ref[H_], again[H_];
    for (int k = 0; k < 5; k++)
        rng_fill(&g, x[k], I_);
    uint64_t k0 = 0, k1 = 1, k2 = 2, k3 = 3, k5 = 5;
    step1(f, id, slot, x[0], true, &k0, out, ref);
    assert_true(close_f32("index 0", out, ref, H_, ATOL, RTOL));
    step1(f, id, slot, x[1], false, &k1, out, ref);
    assert_true(close_f32("index 1", out, ref, H_, ATOL, RTOL));
    // A resent request (same index) returns the cached output and does not advance.
    step1(f, id, slot, x[1], false, &k1, again, NULL);
    assert_memory_equal(out, again, sizeof out);
    step1(f, id, slot, x[1], false, &k1, again, NULL);
    assert_memory_equal(out, again, sizeof out);
    // Skipping ahead and going back are refused without touching the state.
    struct rnnd_step_req req = {.n_env_ids = 1,
                                .env_ids = &id,
                                .obs = rnnd_tensor_f32(x[2], 2, 1, I_, 0, 0),
                                .n_step_index = 1,
                                .step_index = &k3};
    struct rnnd_step_reply r;
    EXPECT_STATUS(rnnd_client_step(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    req.step_index = &k5;
    EXPECT_STATUS(rnnd_client_step(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    req.step_index = &k0;
    EXPECT_STATUS(rnnd_client_step(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    step1(f, id, slot, x[2], false, &k2, out, ref);
    assert_true(close_f32("index 2 after refusals", out, ref, H_, ATOL, RTOL));
    // Steps without an index still advance the env; an index then continues from there.
    step1(f, id, slot, x[3], false, NULL, out, ref);
    assert_true(close_f32("no index", out, ref, H_, ATOL, RTOL));

    // A multi-env request resent as a whole returns the same outputs.
    uint64_t ids[2] = {41, 42};
    bool init[2] = {true, true};
    uint64_t idx[2] = {0, 0};
    float obs[2 * I_];
    rng_fill(&g, obs, 2 * I_);
    req = (struct rnnd_step_req){.n_env_ids = 2,
                                 .env_ids = ids,
                                 .obs = rnnd_tensor_f32(obs, 2, 2, I_, 0, 0),
                                 .n_is_init = 2,
                                 .is_init = init,
                                 .n_step_index = 2,
                                 .step_index = idx};
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    rnnd_step_reply_free(&r);
    idx[0] = idx[1] = 1;
    req.n_is_init = 0;
    struct rnnd_step_reply r1, r2;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r1));
    EXPECT_OK(rnnd_client_step(f->c, &req, &r2));
    assert_int_equal(r1.output.nbytes, r2.output.nbytes);
    assert_memory_equal(r1.output.data, r2.output.data, r1.output.nbytes);
    rnnd_step_reply_free(&r1);
    rnnd_step_reply_free(&r2);
}

static void test_end_episodes(void **state) {
    struct fixture *f = *state;
    struct rng g = {8};
    uint64_t ids[2] = {5000, 5001};
    int32_t slots[2] = {NENV + 1, NENV + 2};
    bool init[2] = {true, true};
    float x[2 * I_], out[2 * H_], ref[2 * H_];
    rng_fill(&g, x, 2 * I_);
    struct rnnd_step_req req = {.n_env_ids = 2,
                                .env_ids = ids,
                                .obs = rnnd_tensor_f32(x, 2, 2, I_, 0, 0),
                                .n_is_init = 2,
                                .is_init = init};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    rnnd_step_reply_free(&r);
    ref_step(&f->r, 2, slots, x, init, ref);
    struct rnnd_model_info before, after;
    EXPECT_OK(rnnd_client_info(f->c, &before));

    uint64_t end[3] = {5000, 5001, 5999}; // 5999 never existed
    uint64_t released = 99;
    EXPECT_OK(rnnd_client_end_episodes(f->c, end, 3, &released));
    assert_int_equal(released, 2);
    EXPECT_OK(rnnd_client_info(f->c, &after));
    assert_int_equal(after.envs_active + 2, before.envs_active);
    EXPECT_OK(rnnd_client_end_episodes(f->c, end, 3, &released));
    assert_int_equal(released, 0);

    // An ended env has no state: stepping it without is_init is refused, not zero-filled.
    req.n_is_init = 0;
    EXPECT_STATUS(rnnd_client_step(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    req.n_is_init = 2;
    EXPECT_OK(rnnd_client_step(f->c, &req, &r));
    ref_step(&f->r, 2, slots, x, init, ref);
    memcpy(out, r.output.data, sizeof out);
    assert_true(close_f32("after EndEpisodes", out, ref, 2 * H_, ATOL, RTOL));
    rnnd_step_reply_free(&r);
}

// A first step with is_init over many envs, then one env stepped alone many times: a long chain
// catches state that is written back to the wrong slot or not at all.
static void test_long_chain(void **state) {
    struct fixture *f = *state;
    struct rng g = {3};
    uint64_t id = 424242;
    int32_t slot = NENV + 3;
    float x[I_], out[H_], ref[H_];
    for (int n = 0; n < 100; n++) {
        rng_fill(&g, x, I_);
        step1(f, id, slot, x, n == 0, NULL, out, ref);
        char what[32];
        snprintf(what, sizeof what, "chain step %d", n);
        assert_true(close_f32(what, out, ref, H_, ATOL, RTOL));
    }
}

// A reply's effects are visible to the caller's next call: after a Step that created an env,
// GetModelInfo counts it; after EndEpisodes, it does not.
static void test_envs_active_visible(void **state) {
    struct fixture *f = *state;
    struct rnnd_model_info i;
    EXPECT_OK(rnnd_client_info(f->c, &i));
    uint64_t base = i.envs_active;
    float x[I_] = {0};
    bool init = true;
    int stale = 0;
    for (int k = 0; k < 100; k++) {
        uint64_t id = 0xE0000000ull + (uint64_t)k;
        struct rnnd_step_req req = step_request(1, &id, x, I_, &init);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f->c, &req, &r));
        rnnd_step_reply_free(&r);
        EXPECT_OK(rnnd_client_info(f->c, &i));
        stale += i.envs_active != base + 1;
        uint64_t released;
        EXPECT_OK(rnnd_client_end_episodes(f->c, &id, 1, &released));
        assert_int_equal(released, 1);
        EXPECT_OK(rnnd_client_info(f->c, &i));
        stale += i.envs_active != base;
    }
    if (stale)
        fprintf(stderr, "GetModelInfo.envs_active was stale after %d of 200 replies\n", stale);
    assert_int_equal(stale, 0);
}

// ---------------------------------------------------------------------------------------------
// A policy model through the C client (its math is test_policy_daemon.py's).

static void test_policy_steps(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {"--input-size",
                          "5",
                          "--hidden-size",
                          "6",
                          "--encoder-widths",
                          "7",
                          "--discrete-actions",
                          "4",
                          "--value-head",
                          "1",
                          NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    assert_int_equal(info.n_encoder_widths, 1);
    assert_int_equal(info.encoder_widths[0], 7);
    assert_string_equal(info.encoder_activation, "elu");
    assert_int_equal(info.discrete_actions, 4);
    assert_int_equal(info.gaussian_actions, 0);
    assert_true(info.value_head);
    struct rnnd_model m;
    EXPECT_OK(rnnd_model_info_to_model(&info, &m));
    assert_true(rnnd_model_has_policy(&m));
    assert_int_equal(m.policy.K, 4);

    enum { B = 3 };
    uint64_t ids[B] = {5, 6, 7};
    bool init[B] = {true, true, true};
    float obs[B * 5];
    for (int i = 0; i < B * 5; i++)
        obs[i] = 0.1f * (float)(i % 7) - 0.3f;
    struct rnnd_step_req req = {
        .n_env_ids = B,
        .env_ids = ids,
        .obs = rnnd_tensor_f32(obs, 2, B, 5, 0, 0),
        .n_is_init = B,
        .is_init = init,
        .greedy = true,
        .return_logits = true,
    };
    struct rnnd_client_stream *st;
    EXPECT_OK(rnnd_client_stream_init(c, &st));
    for (int pass = 0; pass < 2; pass++) {
        struct rnnd_step_reply r = {0};
        if (pass == 0)
            EXPECT_OK(rnnd_client_step(c, &req, &r));
        else
            EXPECT_OK(rnnd_client_stream_step(st, &req, &r));
        assert_false(r.output.present); // the core output only with return_core
        assert_true(r.action.present && r.action.dtype == RNND_DTYPE_INT64);
        assert_int_equal(r.action.ndim, 1);
        assert_int_equal(r.action.shape[0], B);
        assert_tensor_f32(&r.log_prob, 1, B, 0, 0, 0);
        assert_tensor_f32(&r.value, 1, B, 0, 0, 0);
        assert_tensor_f32(&r.logits, 2, B, 4, 0, 0);
        assert_false(r.mean.present);
        const int64_t *a = r.action.data;
        const float *lg = r.logits.data;
        for (int b = 0; b < B; b++) { // greedy: the first argmax
            int best = 0;
            for (int k = 1; k < 4; k++)
                if (lg[b * 4 + k] > lg[b * 4 + best])
                    best = k;
            assert_int_equal(a[b], best);
            assert_true(((const float *)r.log_prob.data)[b] <= 0.0f);
        }
        rnnd_step_reply_free(&r);
    }
    EXPECT_OK(rnnd_client_stream_close(st));
    rnnd_client_stream_free(st);
    req.greedy = req.return_logits = false;
    req.return_core = true;
    // What the previous step earned goes with this one.
    float reward[B] = {0.5f, 1.5f, -2.5f};
    bool done[B] = {false, true, false};
    req.reward = reward;
    req.done = done;
    struct rnnd_step_reply r = {0};
    EXPECT_OK(rnnd_client_step(c, &req, &r));
    assert_tensor_f32(&r.output, 2, B, 6, 0, 0);
    assert_false(r.logits.present);
    int64_t last[B];
    memcpy(last, r.action.data, sizeof(last));
    rnnd_step_reply_free(&r);
    struct rnnd_forward_req fq = {.recorded = true, .n_env_ids = B, .env_ids = ids, .steps = 3};
    struct rnnd_forward_reply fr = {0};
    EXPECT_OK(rnnd_client_forward(c, &fq, &fr));
    assert_tensor_f32(&fr.reward, 2, B, 3, 0, 0);
    assert_true(fr.action.present && fr.action.dtype == RNND_DTYPE_INT64);
    assert_true(fr.done.present && fr.done.dtype == RNND_DTYPE_BOOL);
    for (int b = 0; b < B; b++) {
        const float *rw = (const float *)fr.reward.data + b * 3;
        const uint8_t *dn = (const uint8_t *)fr.done.data + b * 3;
        assert_true(rw[0] == 0.0f && rw[1] == reward[b] && rw[2] == 0.0f);
        assert_int_equal(dn[1], done[b]);
        assert_int_equal(((const int64_t *)fr.action.data)[b * 3 + 2], last[b]);
    }
    // The learner's reply: the heads' outputs at every step, the core's only with return_core.
    assert_false(fr.output.present);
    assert_tensor_f32(&fr.logits, 3, B, 3, 4, 0);
    assert_tensor_f32(&fr.head_value, 2, B, 3, 0, 0);
    assert_false(fr.mean.present || fr.log_std.present);
    rnnd_forward_reply_free(&fr);
    fq.return_core = fq.keep_tape = true;
    if (harness_devices() && strchr(harness_devices(), ',')) {
        // No policy tapes over several devices yet.
        EXPECT_STATUS(rnnd_client_forward(c, &fq, &fr), GRPC_STATUS_FAILED_PRECONDITION);
    } else {
        EXPECT_OK(rnnd_client_forward(c, &fq, &fr));
        assert_tensor_f32(&fr.output, 3, B, 3, 6, 0);
        // Backward from the heads alone returns every tensor's gradient, the encoder's too.
        float gl[B * 3 * 4], gv[B * 3];
        for (int i = 0; i < B * 3 * 4; i++)
            gl[i] = 0.25f * (float)(i % 5) - 0.5f;
        for (int i = 0; i < B * 3; i++)
            gv[i] = 1.0f;
        struct rnnd_backward_req bq = {.tape_id = fr.tape_id,
                                       .grad_logits = rnnd_tensor_f32(gl, 3, B, 3, 4, 0),
                                       .grad_head_value = rnnd_tensor_f32(gv, 2, B, 3, 0, 0)};
        struct rnnd_backward_reply br = {0};
        EXPECT_OK(rnnd_client_backward(c, &bq, &br));
        assert_int_equal(br.grads.n, rnnd_model_param_tensors(&m));
        bool enc = false, head = false;
        for (size_t k = 0; k < br.grads.n; k++) {
            const struct rnnd_tensor *t = &br.grads.v[k].tensor;
            bool nonzero = false;
            for (size_t i = 0; i < t->nbytes / 4; i++)
                nonzero |= ((const float *)t->data)[i] != 0.0f;
            enc |= strcmp(br.grads.v[k].name, "encoder.0.weight") == 0 && nonzero;
            head |= strcmp(br.grads.v[k].name, "policy_logits.weight") == 0 && nonzero;
        }
        assert_true(enc && head);
        rnnd_backward_reply_free(&br);
        rnnd_forward_reply_free(&fr);
    }
    // rnndctl shows the policy and the actions.
    char *text = NULL;
    const char *info_argv[] = {rnndctl_bin(), "-t", d.grpc, "info", NULL};
    assert_int_equal(run_capture(info_argv, 10000, &text), 0);
    assert_non_null(strstr(text, "encoder_widths: 7\n"));
    assert_non_null(strstr(text, "discrete_actions: 4\n"));
    free(text);
    const char *step_argv[] = {rnndctl_bin(), "-t", d.grpc, "step", "--env", "9", "--init", NULL};
    assert_int_equal(run_capture(step_argv, 10000, &text), 0);
    assert_non_null(strstr(text, "action env 9: "));
    assert_non_null(strstr(text, " log_prob "));
    free(text);
    // rnndctl bench takes a policy's replies (actions and log-probs, no core output) as answers.
    const char *bench_argv[] = {rnndctl_bin(), "-t",  d.grpc,     "bench", "--envs",     "4",
                                "--duration",  "0.3", "--warmup", "0",     "--no-floor", NULL};
    assert_int_equal(run_capture(bench_argv, 20000, &text), 0);
    if (!strstr(text, "errors 0"))
        fail_msg("rnndctl bench on a policy daemon: %s", text);
    free(text);
    rnnd_client_free(c);
    daemon_teardown(&d);
}

// Big batches on the row workers (--reply-threads 2): requests of NBIG envs in random order, with
// resets, numbered steps, whole requests resent and requests where some envs resend their last
// step while the others advance, some with bf16 replies. Every row is checked against the
// per-env sequential reference (a resent row against its first answer, bit for bit); at the end
// each env's recorded steps (obs, is_init, outputs) against what was sent.
#define NBIG 640 // over the row workers' threshold, in one batch
#define TREC 4   // recorded steps checked per env

struct big {
    uint64_t ids[NBIG], idx[NBIG], last[NBIG];
    int32_t slots[NBIG];
    bool init[NBIG];
    float obs[NBIG * I_], out[NBIG * H_];
    float last_out[NBIG * H_];     // each env's latest answer
    float rec_obs[NBIG][TREC][I_]; // each env's last TREC computed steps, oldest first
    float rec_out[NBIG][TREC][H_];
    bool rec_init[NBIG][TREC];
};

static void big_record(struct big *b, int k, const float *x, bool init, const float *out) {
    memmove(b->rec_obs[k][0], b->rec_obs[k][1], sizeof(b->rec_obs[k][0]) * (TREC - 1));
    memmove(b->rec_out[k][0], b->rec_out[k][1], sizeof(b->rec_out[k][0]) * (TREC - 1));
    memmove(&b->rec_init[k][0], &b->rec_init[k][1], sizeof(bool) * (TREC - 1));
    memcpy(b->rec_obs[k][TREC - 1], x, sizeof(b->rec_obs[k][0]));
    memcpy(b->rec_out[k][TREC - 1], out, sizeof(b->rec_out[k][0]));
    b->rec_init[k][TREC - 1] = init;
}

static void test_big_batches(void **state) {
    (void)state;
    const char *args[] = {
        "--cell",      "gru",  "--input-size",    "16", "--hidden-size", "32", "--layers", "2",
        "--max-batch", "1024", "--reply-threads", "2",  "--seed",        "3",  NULL};
    struct daemon d;
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct ref ref;
    ref_init(&ref, c, NBIG);
    struct big *b = calloc(1, sizeof *b);
    struct rng g = {17};
    uint64_t base = 3000000000000ull;
    float *want = malloc(sizeof(float) * NBIG * H_);
    for (int round = 0; round < 16; round++) {
        int perm[NBIG];
        rng_perm(&g, perm, NBIG);
        // Round 5 resends round 4 as a whole; rounds 6, 9, 12, ... resend some envs' last step.
        bool resend = round == 5, mixed = round > 5 && round % 3 == 0;
        int ncomp = 0;
        int32_t comp_slots[NBIG];
        float comp_obs[NBIG * I_];
        bool comp_init[NBIG];
        for (int r = 0; r < NBIG && !resend; r++) {
            int k = perm[r];
            b->slots[r] = k;
            b->ids[r] = env_id(base, k);
            bool again = mixed && rng_u(&g, 3) == 0;
            b->idx[r] = again ? b->last[k] : round == 0 ? 0 : ++b->last[k];
            b->init[r] = !again && (round == 0 || rng_u(&g, 10) == 0);
            rng_fill(&g, b->obs + (size_t)r * I_, I_);
            if (again)
                continue;
            comp_slots[ncomp] = k;
            comp_init[ncomp] = b->init[r];
            memcpy(comp_obs + (size_t)ncomp * I_, b->obs + (size_t)r * I_, sizeof(float) * I_);
            ncomp++;
        }
        struct rnnd_step_req req = {.n_env_ids = NBIG,
                                    .env_ids = b->ids,
                                    .obs = rnnd_tensor_f32(b->obs, 2, NBIG, I_, 0, 0),
                                    .n_is_init = NBIG,
                                    .is_init = b->init,
                                    .n_step_index = NBIG,
                                    .step_index = b->idx};
        struct rnnd_step_reply rep;
        if (round % 6 == 3) {
            // bf16 replies, then the same request with fp32 replies: every row resends, so
            // its cached fp32 output comes back, and narrowed it is the bf16 reply bit for bit.
            req.reply_dtype = RNND_DTYPE_BFLOAT16;
            EXPECT_OK(rnnd_client_step(c, &req, &rep));
            assert_int_equal(rep.output.dtype, RNND_DTYPE_BFLOAT16);
            assert_int_equal(rep.output.nbytes, sizeof(uint16_t) * NBIG * H_);
            uint16_t *bf = malloc(rep.output.nbytes);
            memcpy(bf, rep.output.data, rep.output.nbytes);
            rnnd_step_reply_free(&rep);
            req.reply_dtype = RNND_DTYPE_FLOAT32;
            EXPECT_OK(rnnd_client_step(c, &req, &rep));
            uint16_t *narrowed = malloc(sizeof(uint16_t) * NBIG * H_);
            rnnd_cast_host(narrowed, RNND_FTYPE_BF16, rep.output.data, RNND_FTYPE_F32,
                           (size_t)NBIG * H_);
            assert_memory_equal(bf, narrowed, sizeof(uint16_t) * NBIG * H_);
            free(bf);
            free(narrowed);
        } else {
            EXPECT_OK(rnnd_client_step(c, &req, &rep));
        }
        assert_tensor_f32(&rep.output, 2, NBIG, H_, 0, 0);
        const float *got = rep.output.data;
        if (resend) {
            assert_memory_equal(got, b->out, sizeof(float) * NBIG * H_);
            rnnd_step_reply_free(&rep);
            continue;
        }
        ref_step(&ref, ncomp, comp_slots, comp_obs, comp_init, want);
        for (int r = 0, m = 0; r < NBIG; r++) {
            int k = b->slots[r];
            const float *row = got + (size_t)r * H_;
            char what[64];
            snprintf(what, sizeof what, "round %d row %d env %d", round, r, k);
            if (m < ncomp && comp_slots[m] == k) {
                assert_true(close_f32(what, row, want + (size_t)m * H_, H_, ATOL, RTOL));
                big_record(b, k, b->obs + (size_t)r * I_, b->init[r], row);
                m++;
            } else {
                assert_memory_equal(row, b->last_out + (size_t)k * H_, sizeof(float) * H_);
            }
            memcpy(b->last_out + (size_t)k * H_, row, sizeof(float) * H_);
        }
        memcpy(b->out, got, sizeof(float) * NBIG * H_);
        rnnd_step_reply_free(&rep);
    }
    // The recorded steps: what each env was sent, and a replay that gives its answers.
    uint64_t ids[NBIG];
    for (int k = 0; k < NBIG; k++)
        ids[k] = env_id(base, k);
    struct rnnd_forward_req fr = {
        .recorded = true, .n_env_ids = NBIG, .env_ids = ids, .steps = TREC};
    struct rnnd_forward_reply fo;
    EXPECT_OK(rnnd_client_forward(c, &fr, &fo));
    assert_tensor_f32(&fo.obs, 3, NBIG, TREC, I_, 0);
    assert_tensor_f32(&fo.output, 3, NBIG, TREC, H_, 0);
    for (int k = 0; k < NBIG; k++) {
        char what[64];
        snprintf(what, sizeof what, "recorded env %d", k);
        assert_memory_equal((const float *)fo.obs.data + (size_t)k * TREC * I_, b->rec_obs[k],
                            sizeof b->rec_obs[k]);
        for (int t = 0; t < TREC; t++)
            assert_int_equal(((const uint8_t *)fo.is_init.data)[k * TREC + t], b->rec_init[k][t]);
        assert_true(close_f32(what, (const float *)fo.output.data + (size_t)k * TREC * H_,
                              &b->rec_out[k][0][0], TREC * H_, ATOL, RTOL));
    }
    rnnd_forward_reply_free(&fo);
    free(want);
    free(b);
    ref_free(&ref);
    rnnd_client_free(c);
    daemon_teardown(&d);
}

// Replies of 64 KB or more are sent from the memory of their job (rnnd_call_reply_lent): DEPTH
// such replies queued on one StepStream (all sent before any is read), with their states, each
// checked against the reference; the client takes their bytes without a copy (take_tensor).
static void test_big_stream(void **state) {
    (void)state;
    const char *args[] = {"--cell",   "gru", "--input-size", "16",   "--hidden-size",   "32",
                          "--layers", "2",   "--max-batch",  "1024", "--reply-threads", "2",
                          NULL};
    enum { DEPTH = 3 };
    const size_t LH = (size_t)L_ * H_;
    struct daemon d;
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    struct ref ref;
    ref_init(&ref, c, NBIG);
    struct rng g = {29};
    uint64_t *ids = malloc(sizeof(uint64_t) * NBIG);
    int32_t *slots = malloc(sizeof(int32_t) * NBIG);
    bool *init = malloc(NBIG);
    float *obs = malloc(sizeof(float) * NBIG * I_);
    float *want = malloc(sizeof(float) * DEPTH * NBIG * H_);
    float *want_h = malloc(sizeof(float) * DEPTH * NBIG * LH);
    for (int k = 0; k < NBIG; k++) {
        slots[k] = k;
        ids[k] = env_id(4000000000000ull, k);
    }
    struct rnnd_client_stream *s;
    EXPECT_OK(rnnd_client_stream_init(c, &s));
    for (int k = 0; k < DEPTH; k++) {
        for (int r = 0; r < NBIG; r++)
            init[r] = k == 0 || rng_u(&g, 7) == 0;
        rng_fill(&g, obs, NBIG * I_);
        struct rnnd_step_req req = {.n_env_ids = NBIG,
                                    .env_ids = ids,
                                    .obs = rnnd_tensor_f32(obs, 2, NBIG, I_, 0, 0),
                                    .n_is_init = NBIG,
                                    .is_init = init,
                                    .return_state = true};
        EXPECT_OK(rnnd_client_stream_send(s, &req));
        ref_step(&ref, NBIG, slots, obs, init, want + (size_t)k * NBIG * H_);
        memcpy(want_h + (size_t)k * NBIG * LH, ref.state_h, sizeof(float) * NBIG * LH);
    }
    for (int k = 0; k < DEPTH; k++) {
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_stream_recv(s, &r));
        assert_tensor_f32(&r.output, 2, NBIG, H_, 0, 0);
        assert_tensor_f32(&r.h, 3, NBIG, L_, H_, 0);
        char what[64];
        snprintf(what, sizeof what, "stream reply %d", k);
        assert_true(close_f32(what, r.output.data, want + (size_t)k * NBIG * H_, (size_t)NBIG * H_,
                              ATOL, RTOL));
        assert_true(
            close_f32(what, r.h.data, want_h + (size_t)k * NBIG * LH, NBIG * LH, ATOL, RTOL));
        rnnd_step_reply_free(&r);
    }
    EXPECT_OK(rnnd_client_stream_close(s));
    rnnd_client_stream_free(s);
    ref_free(&ref);
    free(ids);
    free(slots);
    free(init);
    free(obs);
    free(want);
    free(want_h);
    rnnd_client_free(c);
    daemon_teardown(&d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info),
        cmocka_unit_test(test_step_reference),
        cmocka_unit_test(test_stream_reference),
        cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_step_index),
        cmocka_unit_test(test_end_episodes),
        cmocka_unit_test(test_long_chain),
        cmocka_unit_test(test_envs_active_visible),
    };
    int fails = cmocka_run_group_tests_name("step (gru)", tests, setup_gru, teardown);
    fails += cmocka_run_group_tests_name("step (lstm)", tests, setup_lstm, teardown);
    const struct CMUnitTest policy[] = {cmocka_unit_test(test_policy_steps)};
    fails += cmocka_run_group_tests_name("step (policy)", policy, NULL, NULL);
    const struct CMUnitTest big[] = {cmocka_unit_test(test_big_batches),
                                     cmocka_unit_test(test_big_stream)};
    fails += cmocka_run_group_tests_name("step (big batches)", big, NULL, NULL);
    return fails ? 1 : 0;
}
