/*
 * test_learner.c: the learner RPCs against the CPU reference. Forward over explicit trajectories
 * (zero start, h0/c0, TorchRL stored states, resets inside the window) and Backward (weight
 * gradients by PyTorch name, grad_obs, grad_h0, grad_hidden); Forward over recorded steps equals
 * what Step returned and carries obs, is_init, extras and model versions; the trajectory ring
 * keeps --trajectory-steps steps; Backward accumulate + ApplyGradients is exactly SGD's update;
 * explicit gradients with an lr override; a few Adam steps on a synthetic task lower the loss;
 * tapes expire after --tape-ttl-s; bf16/fp16 tensors both ways (a 16-bit reply is the fp32 one
 * rounded, bit for bit), recorded_fields and input_grads leave tensors out, and bad dtypes or
 * masks are refused without changing anything.
 *
 * Two daemons: LSTM L=2 with extras, SGD lr 0.1, a 16-step ring and a 2 s tape TTL; GRU L=2 Adam
 * lr 0.01.
 */
#include "harness.h"

#include <grpc/status.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define I_   8
#define H_   16
#define L_   2
#define E_   3
#define RING 16
#define ATOL 2e-5f
#define RTOL 1e-4f
// Backward sums over rows and steps: a little more room.
#define GATOL 1e-4f
#define GRTOL 1e-3f

struct fixture {
    struct daemon d;
    struct rnnd_client *c;
    struct ref r;
    const char *const *args;
    struct rng g;
};

static const char *const lstm_args[] = {"--cell",
                                        "lstm",
                                        "--input-size",
                                        "8",
                                        "--hidden-size",
                                        "16",
                                        "--layers",
                                        "2",
                                        "--extras-size",
                                        "3",
                                        "--optimizer",
                                        "sgd",
                                        "--lr",
                                        "0.1",
                                        "--max-grad-norm",
                                        "1000000",
                                        "--trajectory-steps",
                                        "16",
                                        "--tape-ttl-s",
                                        "2",
                                        "--seed",
                                        "21",
                                        NULL};
static const char *const gru_args[] = {
    "--cell",      "gru",  "--input-size", "8",    "--hidden-size", "16", "--layers", "2",
    "--optimizer", "adam", "--lr",         "0.01", "--seed",        "22", NULL};

static struct fixture fx_lstm = {.args = lstm_args, .g = {77}};
static struct fixture fx_gru = {.args = gru_args, .g = {78}};

static int setup(void **state, struct fixture *f) {
    if (daemon_start(&f->d, (const char **)f->args) != 0)
        return -1;
    f->c = daemon_client(&f->d, NULL);
    ref_init(&f->r, f->c, 16);
    *state = f;
    return 0;
}
static int setup_lstm(void **state) {
    return setup(state, &fx_lstm);
}
static int setup_gru(void **state) {
    return setup(state, &fx_gru);
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

static bool is_lstm(const struct fixture *f) {
    return f->r.m.cell == RNND_CELL_LSTM;
}

// ---------------------------------------------------------------------------------------------
// A batch of trajectories and the reference's answer for it.

enum variant { V_ZERO, V_H0, V_STORED };

struct batch {
    int B, T;
    float *x;         // (B, T, I)
    uint8_t *init;    // (B, T)
    float *h0, *c0;   // (B, L, H) V_H0
    float *hid, *cel; // (B, T, L, H) V_STORED
    // reference results
    float *out, *h_n, *c_n;
    void *tape;
};

static void batch_make(struct fixture *f, struct batch *b, int B, int T, enum variant v) {
    memset(b, 0, sizeof *b);
    b->B = B;
    b->T = T;
    size_t n_state = (size_t)B * L_ * H_, n_stored = (size_t)B * T * L_ * H_;
    b->x = malloc(sizeof(float) * (size_t)B * T * I_);
    rng_fill(&f->g, b->x, (size_t)B * T * I_);
    b->init = calloc((size_t)B * T, 1);
    for (int k = 0; k < B * T; k++)
        b->init[k] = rng_u(&f->g, 4) == 0;
    b->init[0] = 1; // row 0 resets at t = 0; others may not
    if (v == V_H0) {
        b->h0 = malloc(sizeof(float) * n_state);
        rng_fill(&f->g, b->h0, n_state);
        if (is_lstm(f)) {
            b->c0 = malloc(sizeof(float) * n_state);
            rng_fill(&f->g, b->c0, n_state);
        }
    }
    if (v == V_STORED) {
        b->hid = malloc(sizeof(float) * n_stored);
        rng_fill(&f->g, b->hid, n_stored);
        if (is_lstm(f)) {
            b->cel = malloc(sizeof(float) * n_stored);
            rng_fill(&f->g, b->cel, n_stored);
        }
    }
}

static struct rnnd_seq batch_seq(const struct batch *b) {
    return (struct rnnd_seq){.B = b->B,
                             .T = b->T,
                             .x = b->x,
                             .is_init = b->init,
                             .h0 = b->h0,
                             .c0 = b->c0,
                             .hidden = b->hid,
                             .cell = b->cel};
}

static void batch_ref_forward(struct fixture *f, struct batch *b) {
    size_t n_state = (size_t)b->B * L_ * H_;
    b->out = malloc(sizeof(float) * (size_t)b->B * b->T * H_);
    b->h_n = malloc(sizeof(float) * n_state);
    b->c_n = is_lstm(f) ? malloc(sizeof(float) * n_state) : NULL;
    b->tape = malloc(f->r.be.ops->tape_bytes(f->r.be.ctx, &f->r.m, b->B, b->T) + 64);
    struct rnnd_seq seq = batch_seq(b);
    assert_int_equal(f->r.be.ops->rnn_forward(f->r.be.ctx, b->out, b->h_n, b->c_n, b->tape, &seq,
                                              f->r.params, &f->r.m),
                     0);
}

static void batch_free(struct batch *b) {
    free(b->x);
    free(b->init);
    free(b->h0);
    free(b->c0);
    free(b->hid);
    free(b->cel);
    free(b->out);
    free(b->h_n);
    free(b->c_n);
    free(b->tape);
}

static struct rnnd_forward_req batch_req(struct batch *b, bool keep_tape) {
    struct rnnd_forward_req req = {
        .obs = rnnd_tensor_f32(b->x, 3, b->B, b->T, I_, 0),
        .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, b->init, 2, (int64_t[]){b->B, b->T}),
        .keep_tape = keep_tape,
    };
    if (b->h0)
        req.h0 = rnnd_tensor_f32(b->h0, 3, b->B, L_, H_, 0);
    if (b->c0)
        req.c0 = rnnd_tensor_f32(b->c0, 3, b->B, L_, H_, 0);
    if (b->hid)
        req.hidden = rnnd_tensor_f32(b->hid, 4, b->B, b->T, L_, H_);
    if (b->cel)
        req.cell = rnnd_tensor_f32(b->cel, 4, b->B, b->T, L_, H_);
    return req;
}

static void check_forward(struct fixture *f, struct batch *b, const struct rnnd_forward_reply *r,
                          const char *what) {
    char w[96];
    assert_tensor_f32(&r->output, 3, b->B, b->T, H_, 0);
    snprintf(w, sizeof w, "%s output", what);
    assert_true(close_f32(w, r->output.data, b->out, (size_t)b->B * b->T * H_, ATOL, RTOL));
    assert_tensor_f32(&r->h_n, 3, b->B, L_, H_, 0);
    snprintf(w, sizeof w, "%s h_n", what);
    assert_true(close_f32(w, r->h_n.data, b->h_n, (size_t)b->B * L_ * H_, ATOL, RTOL));
    if (is_lstm(f)) {
        assert_tensor_f32(&r->c_n, 3, b->B, L_, H_, 0);
        snprintf(w, sizeof w, "%s c_n", what);
        assert_true(close_f32(w, r->c_n.data, b->c_n, (size_t)b->B * L_ * H_, ATOL, RTOL));
    }
}

// ---------------------------------------------------------------------------------------------

static void test_forward_explicit(void **state) {
    struct fixture *f = *state;
    const char *names[] = {"zero start", "h0", "stored states"};
    for (int v = V_ZERO; v <= V_STORED; v++) {
        for (int shape = 0; shape < 2; shape++) {
            int B = shape ? 5 : 1, T = shape ? 9 : 1;
            struct batch b;
            batch_make(f, &b, B, T, (enum variant)v);
            batch_ref_forward(f, &b);
            struct rnnd_forward_req req = batch_req(&b, false);
            struct rnnd_forward_reply r;
            EXPECT_OK(rnnd_client_forward(f->c, &req, &r));
            char what[64];
            snprintf(what, sizeof what, "forward %s B=%d T=%d", names[v], B, T);
            check_forward(f, &b, &r, what);
            assert_int_equal(r.tape_id, 0);              // keep_tape false
            assert_false(r.obs.present && r.obs.nbytes); // recorded-only fields stay empty
            rnnd_forward_reply_free(&r);
            batch_free(&b);
        }
    }
}

// Backward of one batch against the reference; returns the reference's parameter gradient
// (P floats, new) when want_params.
static float *backward_check(struct fixture *f, enum variant v, bool accumulate) {
    struct batch b;
    batch_make(f, &b, 4, 7, v);
    batch_ref_forward(f, &b);
    struct rnnd_forward_req req = batch_req(&b, true);
    struct rnnd_forward_reply fr;
    EXPECT_OK(rnnd_client_forward(f->c, &req, &fr));
    check_forward(f, &b, &fr, "forward with tape");
    assert_true(fr.tape_id != 0);

    size_t n_out = (size_t)b.B * b.T * H_, n_state = (size_t)b.B * L_ * H_;
    size_t n_stored = (size_t)b.B * b.T * L_ * H_;
    float *go = malloc(sizeof(float) * n_out), *ghn = malloc(sizeof(float) * n_state);
    float *gcn = malloc(sizeof(float) * n_state);
    rng_fill(&f->g, go, n_out);
    rng_fill(&f->g, ghn, n_state);
    rng_fill(&f->g, gcn, n_state);
    struct rnnd_backward_req bq = {.tape_id = fr.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, b.B, b.T, H_, 0),
                                   .grad_h_n = rnnd_tensor_f32(ghn, 3, b.B, L_, H_, 0),
                                   .accumulate = accumulate};
    if (is_lstm(f))
        bq.grad_c_n = rnnd_tensor_f32(gcn, 3, b.B, L_, H_, 0);
    struct rnnd_backward_reply br;
    EXPECT_OK(rnnd_client_backward(f->c, &bq, &br));

    float *gp = calloc(f->r.P, sizeof(float));
    float *gx = malloc(sizeof(float) * (size_t)b.B * b.T * I_);
    float *gh0 = malloc(sizeof(float) * n_state), *gc0 = malloc(sizeof(float) * n_state);
    float *ghid = malloc(sizeof(float) * n_stored), *gcel = malloc(sizeof(float) * n_stored);
    struct rnnd_seq_grads grads = {.params = gp,
                                   .x = gx,
                                   .h0 = b.h0 ? gh0 : NULL,
                                   .c0 = b.c0 ? gc0 : NULL,
                                   .hidden = b.hid ? ghid : NULL,
                                   .cell = b.cel ? gcel : NULL};
    struct rnnd_seq seq = batch_seq(&b);
    assert_int_equal(f->r.be.ops->rnn_backward(f->r.be.ctx, &grads, go, ghn,
                                               is_lstm(f) ? gcn : NULL, b.tape, &seq, f->r.params,
                                               &f->r.m),
                     0);

    if (accumulate) {
        assert_int_equal(br.grads.n, 0);
    } else {
        assert_int_equal(br.grads.n, (size_t)4 * L_);
        float *got = malloc(sizeof(float) * f->r.P);
        int err = rnnd_named_tensors_to_params(&br.grads, &f->r.m, got);
        if (err)
            fprintf(stderr, "grads: %s\n", rnnd_client_last_error()->message);
        assert_int_equal(err, 0);
        assert_true(close_f32("weight gradients", got, gp, f->r.P, GATOL, GRTOL));
        free(got);
    }
    assert_tensor_f32(&br.grad_obs, 3, b.B, b.T, I_, 0);
    assert_true(close_f32("grad_obs", br.grad_obs.data, gx, (size_t)b.B * b.T * I_, GATOL, GRTOL));
    if (b.h0) {
        assert_tensor_f32(&br.grad_h0, 3, b.B, L_, H_, 0);
        assert_true(close_f32("grad_h0", br.grad_h0.data, gh0, n_state, GATOL, GRTOL));
        if (b.c0) {
            assert_tensor_f32(&br.grad_c0, 3, b.B, L_, H_, 0);
            assert_true(close_f32("grad_c0", br.grad_c0.data, gc0, n_state, GATOL, GRTOL));
        }
    }
    if (b.hid) {
        assert_tensor_f32(&br.grad_hidden, 4, b.B, b.T, L_, H_);
        assert_true(close_f32("grad_hidden", br.grad_hidden.data, ghid, n_stored, GATOL, GRTOL));
        if (b.cel) {
            assert_tensor_f32(&br.grad_cell, 4, b.B, b.T, L_, H_);
            assert_true(close_f32("grad_cell", br.grad_cell.data, gcel, n_stored, GATOL, GRTOL));
        }
    }
    rnnd_backward_reply_free(&br);
    rnnd_forward_reply_free(&fr);
    free(go);
    free(ghn);
    free(gcn);
    free(gx);
    free(gh0);
    free(gc0);
    free(ghid);
    free(gcel);
    batch_free(&b);
    return gp;
}

static void test_backward(void **state) {
    struct fixture *f = *state;
    for (int v = V_ZERO; v <= V_STORED; v++)
        free(backward_check(f, (enum variant)v, false));
}

// ---------------------------------------------------------------------------------------------
// Recorded trajectories.

static void test_forward_recorded(void **state) {
    struct fixture *f = *state;
    enum { B = 3, STEPS = 10, W = 6 };
    uint64_t ids[B] = {9001, 9002, 9003};
    int32_t slots[B] = {0, 1, 2};
    float x[STEPS][B * I_], e[STEPS][B * E_], outs[STEPS][B * H_];
    bool init[STEPS][B];
    float h_before[B * L_ * H_], c_before[B * L_ * H_], h_last[B * L_ * H_], c_last[B * L_ * H_];
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(f->c, &info));
    bool extras = info.extras_size == E_;
    for (int s = 0; s < STEPS; s++) {
        rng_fill(&f->g, x[s], B * I_);
        rng_fill(&f->g, e[s], B * E_);
        for (int b = 0; b < B; b++)
            init[s][b] = s == 0 || (b == 1 && s == STEPS - W + 2);
        bool want_state = s == STEPS - W - 1 || s == STEPS - 1;
        struct rnnd_step_req req = {.n_env_ids = B,
                                    .env_ids = ids,
                                    .obs = rnnd_tensor_f32(x[s], 2, B, I_, 0, 0),
                                    .n_is_init = B,
                                    .is_init = init[s],
                                    .return_state = want_state};
        if (extras)
            req.extras = rnnd_tensor_f32(e[s], 2, B, E_, 0, 0);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f->c, &req, &r));
        assert_tensor_f32(&r.output, 2, B, H_, 0, 0);
        memcpy(outs[s], r.output.data, sizeof outs[s]);
        float ref[B * H_];
        ref_step(&f->r, B, slots, x[s], init[s], ref);
        assert_true(close_f32("recorded step", outs[s], ref, B * H_, ATOL, RTOL));
        if (want_state) {
            assert_tensor_f32(&r.h, 3, B, L_, H_, 0);
            memcpy(s == STEPS - 1 ? h_last : h_before, r.h.data, sizeof h_last);
            if (is_lstm(f)) {
                assert_tensor_f32(&r.c, 3, B, L_, H_, 0);
                memcpy(s == STEPS - 1 ? c_last : c_before, r.c.data, sizeof c_last);
            }
        }
        rnnd_step_reply_free(&r);
    }

    struct rnnd_forward_req req = {
        .recorded = true, .n_env_ids = B, .env_ids = ids, .steps = W, .keep_tape = true};
    struct rnnd_forward_reply r;
    EXPECT_OK(rnnd_client_forward(f->c, &req, &r));
    assert_tensor_f32(&r.output, 3, B, W, H_, 0);
    assert_tensor_f32(&r.obs, 3, B, W, I_, 0);
    assert_true(r.is_init.present && r.is_init.dtype == RNND_DTYPE_BOOL && r.is_init.ndim == 2 &&
                r.is_init.shape[0] == B && r.is_init.shape[1] == W && r.is_init.nbytes == B * W);
    assert_true(r.step_model_version.present && r.step_model_version.dtype == RNND_DTYPE_INT64 &&
                r.step_model_version.ndim == 2 && r.step_model_version.shape[0] == B &&
                r.step_model_version.shape[1] == W && r.step_model_version.nbytes == B * W * 8);
    if (extras)
        assert_tensor_f32(&r.extras, 3, B, W, E_, 0);
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < W; t++) {
            int s = STEPS - W + t;
            const float *o = (const float *)r.output.data + ((size_t)b * W + t) * H_;
            char what[64];
            snprintf(what, sizeof what, "recorded output env %d t %d", b, t);
            // The same weights, the same state: what Step returned.
            assert_true(close_f32(what, o, outs[s] + b * H_, H_, ATOL, RTOL));
            assert_memory_equal((const float *)r.obs.data + ((size_t)b * W + t) * I_, x[s] + b * I_,
                                sizeof(float) * I_);
            assert_int_equal(((const uint8_t *)r.is_init.data)[b * W + t], init[s][b]);
            assert_int_equal(((const int64_t *)r.step_model_version.data)[b * W + t],
                             (int64_t)info.model_version);
            if (extras)
                assert_memory_equal((const float *)r.extras.data + ((size_t)b * W + t) * E_,
                                    e[s] + b * E_, sizeof(float) * E_);
        }
    }
    assert_tensor_f32(&r.h_n, 3, B, L_, H_, 0);
    assert_true(close_f32("recorded h_n", r.h_n.data, h_last, B * L_ * H_, ATOL, RTOL));
    if (is_lstm(f))
        assert_true(close_f32("recorded c_n", r.c_n.data, c_last, B * L_ * H_, ATOL, RTOL));

    // Backward over the recorded tape equals the reference run from the state before the window.
    struct batch bb = {.B = B, .T = W};
    bb.x = malloc(sizeof(float) * B * W * I_);
    memcpy(bb.x, r.obs.data, sizeof(float) * B * W * I_);
    bb.init = malloc(B * W);
    memcpy(bb.init, r.is_init.data, B * W);
    bb.h0 = malloc(sizeof h_before);
    memcpy(bb.h0, h_before, sizeof h_before);
    if (is_lstm(f)) {
        bb.c0 = malloc(sizeof c_before);
        memcpy(bb.c0, c_before, sizeof c_before);
    }
    batch_ref_forward(f, &bb);
    assert_true(close_f32("recorded vs reference", r.output.data, bb.out, B * W * H_, ATOL, RTOL));
    float go[B * W * H_];
    rng_fill(&f->g, go, B * W * H_);
    struct rnnd_backward_req bq = {.tape_id = r.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, B, W, H_, 0)};
    struct rnnd_backward_reply br;
    EXPECT_OK(rnnd_client_backward(f->c, &bq, &br));
    float *gp = calloc(f->r.P, sizeof(float)), *got = malloc(sizeof(float) * f->r.P);
    float gx[B * W * I_];
    struct rnnd_seq_grads grads = {.params = gp, .x = gx};
    struct rnnd_seq seq = batch_seq(&bb);
    assert_int_equal(f->r.be.ops->rnn_backward(f->r.be.ctx, &grads, go, NULL, NULL, bb.tape, &seq,
                                               f->r.params, &f->r.m),
                     0);
    assert_int_equal(rnnd_named_tensors_to_params(&br.grads, &f->r.m, got), 0);
    assert_true(close_f32("recorded weight gradients", got, gp, f->r.P, GATOL, GRTOL));
    assert_tensor_f32(&br.grad_obs, 3, B, W, I_, 0);
    assert_true(close_f32("recorded grad_obs", br.grad_obs.data, gx, B * W * I_, GATOL, GRTOL));
    free(gp);
    free(got);
    batch_free(&bb);
    rnnd_backward_reply_free(&br);
    rnnd_forward_reply_free(&r);
}

static void test_trajectory_ring(void **state) {
    struct fixture *f = *state;
    uint64_t id = 9100;
    float xs[RING + 5][I_];
    bool init = true;
    for (int s = 0; s < RING + 5; s++) {
        rng_fill(&f->g, xs[s], I_);
        struct rnnd_step_req req = step_request(1, &id, xs[s], I_, &init);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f->c, &req, &r));
        rnnd_step_reply_free(&r);
        init = false;
    }
    struct rnnd_forward_req req = {.recorded = true, .n_env_ids = 1, .env_ids = &id, .steps = RING};
    struct rnnd_forward_reply r;
    EXPECT_OK(rnnd_client_forward(f->c, &req, &r));
    assert_tensor_f32(&r.output, 3, 1, RING, H_, 0);
    // The window is the last RING obs sent, in order across the ring's wrap.
    assert_memory_equal(r.obs.data, xs[5], sizeof(float) * RING * I_);
    rnnd_forward_reply_free(&r);
    // More than the ring holds can never be served (either refusal is fine).
    req.steps = RING + 1;
    int err = rnnd_client_forward(f->c, &req, &r);
    int st = rnnd_client_last_error()->grpc_status;
    assert_true(err != 0 &&
                (st == GRPC_STATUS_INVALID_ARGUMENT || st == GRPC_STATUS_FAILED_PRECONDITION));
    // EndEpisodes drops the recorded steps too: a new episode of 3 steps has 3, not RING.
    EXPECT_OK(rnnd_client_end_episodes(f->c, &id, 1, NULL));
    req.steps = 1;
    EXPECT_STATUS(rnnd_client_forward(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    init = true;
    for (int s = 0; s < 3; s++) {
        struct rnnd_step_req sq = {.n_env_ids = 1,
                                   .env_ids = &id,
                                   .obs = rnnd_tensor_f32(xs[0], 2, 1, I_, 0, 0),
                                   .n_is_init = 1,
                                   .is_init = &init};
        struct rnnd_step_reply sr;
        EXPECT_OK(rnnd_client_step(f->c, &sq, &sr));
        rnnd_step_reply_free(&sr);
        init = false;
    }
    req.steps = 4;
    EXPECT_STATUS(rnnd_client_forward(f->c, &req, &r), GRPC_STATUS_FAILED_PRECONDITION);
    req.steps = 3;
    EXPECT_OK(rnnd_client_forward(f->c, &req, &r));
    assert_tensor_f32(&r.output, 3, 1, 3, H_, 0);
    rnnd_forward_reply_free(&r);
}

// LSTM with --extras-size 3: extras and state-pair errors, each leaving the env where it was.
static void test_lstm_extras_errors(void **state) {
    struct fixture *f = *state;
    uint64_t ids[2] = {9300, 9301};
    int32_t slots[2] = {6, 7};
    float x[2 * I_], e[4 * (E_ + 1)], ref[2 * H_]; // room for an int64 reading of extras
    bool init[2] = {true, true};
    rng_fill(&f->g, x, 2 * I_);
    rng_fill(&f->g, e, 4 * (E_ + 1));
    struct rnnd_step_req ok = {.n_env_ids = 2,
                               .env_ids = ids,
                               .obs = rnnd_tensor_f32(x, 2, 2, I_, 0, 0),
                               .n_is_init = 2,
                               .is_init = init,
                               .extras = rnnd_tensor_f32(e, 2, 2, E_, 0, 0)};
    struct rnnd_step_reply r;
    EXPECT_OK(rnnd_client_step(f->c, &ok, &r));
    ref_step(&f->r, 2, slots, x, init, ref);
    rnnd_step_reply_free(&r);
    init[0] = init[1] = false;
    struct rnnd_step_req bad = ok;
    bad.extras = rnnd_tensor_f32(e, 2, 2, E_ + 1, 0, 0); // wrong width
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bad.extras = rnnd_tensor_f32(e, 2, 1, E_, 0, 0); // wrong rows
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bad.extras = rnnd_tensor_f32(e, 1, 2 * E_, 0, 0, 0);
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bad.extras = rnnd_tensor_f32(e, 2, 2, E_, 0, 0);
    bad.extras.dtype = RNND_DTYPE_INT64;
    bad.extras.nbytes = 2 * E_ * 8;
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &r), GRPC_STATUS_INVALID_ARGUMENT);
    bad.extras = rnnd_tensor_f32(e, 2, 2, E_, 0, 0);
    bad.extras.nbytes -= 4;
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &r), GRPC_STATUS_INVALID_ARGUMENT);
    float keep = e[4];
    e[4] = NAN;
    bad.extras = rnnd_tensor_f32(e, 2, 2, E_, 0, 0);
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &r), GRPC_STATUS_INVALID_ARGUMENT);
    e[4] = keep;
    // The envs are where the reference says, and the recorded window has the one good step.
    rng_fill(&f->g, x, 2 * I_);
    EXPECT_OK(rnnd_client_step(f->c, &ok, &r));
    ref_step(&f->r, 2, slots, x, init, ref);
    assert_true(close_f32("after extras errors", r.output.data, ref, 2 * H_, ATOL, RTOL));
    rnnd_step_reply_free(&r);
    struct rnnd_forward_req rq = {.recorded = true, .n_env_ids = 2, .env_ids = ids, .steps = 3};
    struct rnnd_forward_reply fr;
    EXPECT_STATUS(rnnd_client_forward(f->c, &rq, &fr), GRPC_STATUS_FAILED_PRECONDITION);
    rq.steps = 2;
    EXPECT_OK(rnnd_client_forward(f->c, &rq, &fr));
    assert_tensor_f32(&fr.extras, 3, 2, 2, E_, 0);
    rnnd_forward_reply_free(&fr);

    // LSTM state pairs: c0 needs h0, hidden and cell come together.
    struct batch b;
    batch_make(f, &b, 2, 3, V_STORED);
    struct rnnd_forward_req fq = batch_req(&b, false);
    fq.cell.present = false;
    EXPECT_STATUS(rnnd_client_forward(f->c, &fq, &fr), GRPC_STATUS_INVALID_ARGUMENT);
    fq = batch_req(&b, false);
    fq.hidden.present = false;
    EXPECT_STATUS(rnnd_client_forward(f->c, &fq, &fr), GRPC_STATUS_INVALID_ARGUMENT);
    fq = batch_req(&b, false);
    fq.hidden.present = fq.cell.present = false;
    fq.c0 = rnnd_tensor_f32(b.hid, 3, 2, L_, H_, 0); // c0 without h0
    EXPECT_STATUS(rnnd_client_forward(f->c, &fq, &fr), GRPC_STATUS_INVALID_ARGUMENT);
    // Backward: grad_c_n of the wrong shape.
    fq = batch_req(&b, true);
    EXPECT_OK(rnnd_client_forward(f->c, &fq, &fr));
    float go[2 * 3 * H_] = {0}, gc[2 * L_ * H_] = {0};
    struct rnnd_backward_req bq = {.tape_id = fr.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, 2, 3, H_, 0),
                                   .grad_c_n = rnnd_tensor_f32(gc, 3, 2, L_ - 1, H_, 0)};
    struct rnnd_backward_reply br;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bq, &br), GRPC_STATUS_INVALID_ARGUMENT);
    bq.grad_c_n = rnnd_tensor_f32(gc, 3, 2, L_, H_, 0);
    EXPECT_OK(rnnd_client_backward(f->c, &bq, &br));
    rnnd_backward_reply_free(&br);
    rnnd_forward_reply_free(&fr);
    batch_free(&b);
}

// ---------------------------------------------------------------------------------------------
// ApplyGradients (SGD daemon: lr 0.1, no clipping).

static float *get_params(struct fixture *f, uint64_t *version) {
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(f->c, &w, version));
    float *p = malloc(sizeof(float) * f->r.P);
    assert_int_equal(rnnd_named_tensors_to_params(&w, &f->r.m, p), 0);
    rnnd_named_tensors_free(&w);
    return p;
}

static void test_sgd_accumulate_apply(void **state) {
    struct fixture *f = *state;
    uint64_t v0;
    float *w0 = get_params(f, &v0);
    // Two accumulated backwards, then one update from the server's buffer.
    float *g1 = backward_check(f, V_H0, true);
    float *g2 = backward_check(f, V_ZERO, true);
    uint64_t v1 = 0;
    EXPECT_OK(rnnd_client_apply_gradients(f->c, NULL, NULL, &v1));
    assert_int_equal(v1, v0 + 1);
    uint64_t v;
    float *w1 = get_params(f, &v);
    assert_int_equal(v, v1);
    float *want = malloc(sizeof(float) * f->r.P);
    for (size_t k = 0; k < f->r.P; k++)
        want[k] = w0[k] - 0.1f * (g1[k] + g2[k]);
    assert_true(close_f32("SGD from the accumulated buffer", w1, want, f->r.P, 1e-5f, 1e-4f));

    // Explicit gradients with an lr override.
    float *g = malloc(sizeof(float) * f->r.P);
    rng_fill(&f->g, g, f->r.P);
    struct rnnd_named_tensors gl;
    assert_int_equal(rnnd_named_tensors_from_params(&gl, &f->r.m, g), 0);
    float lr = 0.05f;
    uint64_t v2 = 0;
    EXPECT_OK(rnnd_client_apply_gradients(f->c, &gl, &lr, &v2));
    assert_int_equal(v2, v1 + 1);
    float *w2 = get_params(f, &v);
    for (size_t k = 0; k < f->r.P; k++)
        want[k] = w1[k] - lr * g[k];
    assert_true(close_f32("SGD with lr 0.05", w2, want, f->r.P, 1e-6f, 1e-5f));
    rnnd_named_tensors_free(&gl);

    // Steps now run the new weights and report the new version, and recorded steps say which
    // version produced them.
    ref_reload(&f->r, f->c);
    uint64_t id = 9200;
    int32_t slot = 5;
    bool init = true;
    for (int s = 0; s < 2; s++) {
        float x[I_], ref[H_];
        rng_fill(&f->g, x, I_);
        struct rnnd_step_req req = step_request(1, &id, x, I_, &init);
        struct rnnd_step_reply r;
        EXPECT_OK(rnnd_client_step(f->c, &req, &r));
        assert_int_equal(r.model_version, v2);
        ref_step(&f->r, 1, &slot, x, &init, ref);
        assert_true(close_f32("step after update", r.output.data, ref, H_, ATOL, RTOL));
        rnnd_step_reply_free(&r);
        init = false;
        if (s == 0) { // an update between the two steps
            for (size_t k = 0; k < f->r.P; k++)
                g[k] *= 0.01f;
            assert_int_equal(rnnd_named_tensors_from_params(&gl, &f->r.m, g), 0);
            EXPECT_OK(rnnd_client_apply_gradients(f->c, &gl, NULL, &v2));
            rnnd_named_tensors_free(&gl);
            ref_reload(&f->r, f->c);
        }
    }
    struct rnnd_forward_req fq = {.recorded = true, .n_env_ids = 1, .env_ids = &id, .steps = 2};
    struct rnnd_forward_reply fr;
    EXPECT_OK(rnnd_client_forward(f->c, &fq, &fr));
    assert_int_equal(fr.model_version, v2);
    const int64_t *smv = fr.step_model_version.data;
    assert_int_equal(smv[0], (int64_t)v2 - 1);
    assert_int_equal(smv[1], (int64_t)v2);
    rnnd_forward_reply_free(&fr);
    free(w0);
    free(w1);
    free(w2);
    free(g);
    free(g1);
    free(g2);
    free(want);
}

static void test_tape_ttl(void **state) {
    struct fixture *f = *state;
    struct batch b;
    batch_make(f, &b, 2, 3, V_ZERO);
    struct rnnd_forward_req req = batch_req(&b, true);
    struct rnnd_forward_reply fr;
    EXPECT_OK(rnnd_client_forward(f->c, &req, &fr));
    float go[2 * 3 * H_] = {0};
    struct rnnd_backward_req bq = {.tape_id = fr.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, 2, 3, H_, 0)};
    sleep_ms(3500); // --tape-ttl-s 2, plus room for a once-a-second sweep
    struct rnnd_backward_reply br;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bq, &br), GRPC_STATUS_NOT_FOUND);
    rnnd_forward_reply_free(&fr);
    batch_free(&b);
}

// ---------------------------------------------------------------------------------------------
// Adam (GRU daemon): the first update matches torch.optim.Adam's, and a few steps on a synthetic
// sequence task lower the loss.

static double loss_and_grad(const float *out, const float *target, size_t n, float *grad) {
    double l = 0;
    for (size_t k = 0; k < n; k++) {
        double d = (double)out[k] - target[k];
        l += 0.5 * d * d / (double)n;
        grad[k] = (float)(d / (double)n);
    }
    return l;
}

static void test_adam_training(void **state) {
    struct fixture *f = *state;
    enum { B = 8, T = 12, ITERS = 30 };
    struct batch b;
    batch_make(f, &b, B, T, V_ZERO);
    float target[B * T * H_], grad[B * T * H_];
    for (int bb = 0; bb < B; bb++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H_; h++)
                target[(bb * T + t) * H_ + h] = 0.5f * sinf(0.3f * (float)(t + h + bb));
    uint64_t v0;
    float *w0 = get_params(f, &v0);
    double first = 0, last = 0;
    for (int it = 0; it < ITERS; it++) {
        struct rnnd_forward_req req = batch_req(&b, true);
        struct rnnd_forward_reply fr;
        EXPECT_OK(rnnd_client_forward(f->c, &req, &fr));
        assert_tensor_f32(&fr.output, 3, B, T, H_, 0);
        double l = loss_and_grad(fr.output.data, target, B * T * H_, grad);
        if (it == 0)
            first = l;
        last = l;
        struct rnnd_backward_req bq = {.tape_id = fr.tape_id,
                                       .grad_output = rnnd_tensor_f32(grad, 3, B, T, H_, 0),
                                       .accumulate = it % 2 == 0};
        struct rnnd_backward_reply br;
        EXPECT_OK(rnnd_client_backward(f->c, &bq, &br));
        uint64_t v = 0;
        if (bq.accumulate)
            EXPECT_OK(rnnd_client_apply_gradients(f->c, NULL, NULL, &v));
        else
            EXPECT_OK(rnnd_client_apply_gradients(f->c, &br.grads, NULL, &v));
        assert_int_equal(v, v0 + (uint64_t)it + 1);
        if (it == 0) {
            // torch.optim.Adam's first step (lr 0.01, betas 0.9/0.999, eps 1e-8) from the
            // reference gradient. Clipping, if the daemon's default clips, scales the gradient
            // and leaves Adam's first step (about lr * sign(g)) nearly unchanged.
            float *g = calloc(f->r.P, sizeof(float)), *m = calloc(f->r.P, sizeof(float));
            float *vv = calloc(f->r.P, sizeof(float));
            float *want = malloc(sizeof(float) * f->r.P);
            memcpy(want, w0, sizeof(float) * f->r.P);
            // The step-1 gradient from the reference (the reply has none when accumulated).
            {
                batch_ref_forward(f, &b);
                struct rnnd_seq seq = batch_seq(&b);
                struct rnnd_seq_grads gr = {.params = g};
                assert_int_equal(f->r.be.ops->rnn_backward(f->r.be.ctx, &gr, grad, NULL, NULL,
                                                           b.tape, &seq, f->r.params, &f->r.m),
                                 0);
            }
            struct rnnd_optim o = {
                .kind = RNND_OPTIM_ADAM, .lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
            float norm;
            assert_int_equal(
                f->r.be.ops->optim_step(f->r.be.ctx, want, g, m, vv, f->r.P, &o, 1, &norm), 0);
            uint64_t vv1;
            float *w1 = get_params(f, &vv1);
            assert_true(close_f32("Adam step 1", w1, want, f->r.P, 2e-4f, 1e-3f));
            free(w1);
            free(g);
            free(m);
            free(vv);
            free(want);
        }
        rnnd_backward_reply_free(&br);
        rnnd_forward_reply_free(&fr);
    }
    fprintf(stderr, "  Adam: loss %.5f -> %.5f over %d updates\n", first, last, ITERS);
    assert_true(last < 0.7 * first);
    free(w0);
    batch_free(&b);
}

// ---------------------------------------------------------------------------------------------
// The wire: 16-bit tensors, what a learner asks for, and refusals that change nothing.

// 16-bit values of n floats, as the daemon rounds them (to nearest even).
static void to16(uint16_t *dst, const float *src, size_t n, bool f16) {
    for (size_t i = 0; i < n; i++)
        dst[i] = f16 ? rnnd_f32_to_f16(src[i]) : rnnd_f32_to_bf16(src[i]);
}

// t holds the 16-bit (f16 or bf16) rounding of the n floats at want, bit for bit.
static void assert_rounded(const struct rnnd_tensor *t, const float *want, size_t n, bool f16) {
    assert_true(t->present);
    assert_int_equal(t->dtype, f16 ? RNND_DTYPE_FLOAT16 : RNND_DTYPE_BFLOAT16);
    assert_int_equal(t->nbytes, n * 2);
    uint16_t *w = malloc(n * 2);
    to16(w, want, n, f16);
    assert_memory_equal(t->data, w, n * 2);
    free(w);
}

static void test_wire_dtypes(void **state) {
    struct fixture *f = *state;
    enum { B = 3, T = 5, N = B * T * I_ };
    // Inputs bf16 holds exactly: fp32 and bf16 requests then run the same computation, and a
    // 16-bit reply is the fp32 reply rounded.
    float x[N], go[B * T * H_];
    uint16_t xb[N], gob[B * T * H_];
    rng_fill(&f->g, x, N);
    rng_fill(&f->g, go, B * T * H_);
    for (int i = 0; i < N; i++)
        x[i] = rnnd_round_bf16(x[i]);
    for (int i = 0; i < B * T * H_; i++)
        go[i] = rnnd_round_bf16(go[i]);
    to16(xb, x, N, false);
    to16(gob, go, B * T * H_, false);
    uint8_t init[B * T] = {0};
    init[7] = 1;
    struct rnnd_forward_req q = {.obs = rnnd_tensor_f32(x, 3, B, T, I_, 0),
                                 .is_init =
                                     rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T}),
                                 .keep_tape = true};
    struct rnnd_forward_reply r32, rb, rh;
    EXPECT_OK(rnnd_client_forward(f->c, &q, &r32));
    q.obs = rnnd_tensor_view(RNND_DTYPE_BFLOAT16, xb, 3, (int64_t[]){B, T, I_});
    EXPECT_OK(rnnd_client_forward(f->c, &q, &rb)); // the reply follows the request: bf16
    assert_rounded(&rb.output, r32.output.data, B * T * H_, false);
    assert_rounded(&rb.h_n, r32.h_n.data, B * L_ * H_, false);
    q.reply_dtype = RNND_DTYPE_FLOAT16;
    q.keep_tape = false;
    EXPECT_OK(rnnd_client_forward(f->c, &q, &rh));
    assert_rounded(&rh.output, r32.output.data, B * T * H_, true);
    rnnd_forward_reply_free(&rh);

    // Backward: grad_output in bf16, only the weight gradients back (no input gradients), bf16.
    struct rnnd_backward_req bq = {.tape_id = r32.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, B, T, H_, 0)};
    struct rnnd_backward_reply b32, bb;
    EXPECT_OK(rnnd_client_backward(f->c, &bq, &b32));
    assert_true(b32.grad_obs.present); // nothing asked: what the Forward had, as before
    bq.tape_id = rb.tape_id;
    bq.grad_output = rnnd_tensor_view(RNND_DTYPE_BFLOAT16, gob, 3, (int64_t[]){B, T, H_});
    bq.has_input_grads = true;
    bq.input_grads = 0;
    EXPECT_OK(rnnd_client_backward(f->c, &bq, &bb));
    assert_false(bb.grad_obs.present || bb.grad_h0.present || bb.grad_c0.present);
    assert_int_equal(bb.grads.n, b32.grads.n);
    for (size_t k = 0; k < b32.grads.n; k++)
        assert_rounded(rnnd_named_tensors_find(&bb.grads, b32.grads.v[k].name),
                       b32.grads.v[k].tensor.data,
                       (size_t)rnnd_tensor_numel(&b32.grads.v[k].tensor), false);
    rnnd_backward_reply_free(&b32);
    rnnd_backward_reply_free(&bb);
    rnnd_forward_reply_free(&r32);
    rnnd_forward_reply_free(&rb);

    // A step in fp16 with an fp32 reply equals the same step sent in fp32 to a twin env.
    uint64_t ids[2] = {8100, 8101};
    float sx[I_];
    uint16_t sh[I_];
    rng_fill(&f->g, sx, I_);
    to16(sh, sx, I_, true);
    for (int i = 0; i < I_; i++)
        sx[i] = rnnd_f16_to_f32(sh[i]);
    bool yes = true;
    struct rnnd_step_req s32 = {.n_env_ids = 1,
                                .env_ids = &ids[0],
                                .obs = rnnd_tensor_f32(sx, 2, 1, I_, 0, 0),
                                .n_is_init = 1,
                                .is_init = &yes};
    struct rnnd_step_req s16 = s32;
    s16.env_ids = &ids[1];
    s16.obs = rnnd_tensor_view(RNND_DTYPE_FLOAT16, sh, 2, (int64_t[]){1, I_});
    s16.reply_dtype = RNND_DTYPE_FLOAT32;
    struct rnnd_step_reply o32, o16;
    EXPECT_OK(rnnd_client_step(f->c, &s32, &o32));
    EXPECT_OK(rnnd_client_step(f->c, &s16, &o16));
    assert_int_equal(o16.output.dtype, RNND_DTYPE_FLOAT32);
    assert_memory_equal(o16.output.data, o32.output.data, sizeof(float) * H_);
    rnnd_step_reply_free(&o32);
    rnnd_step_reply_free(&o16);
    EXPECT_OK(rnnd_client_end_episodes(f->c, ids, 2, NULL));
}

static void test_wire_masks_and_refusals(void **state) {
    struct fixture *f = *state;
    enum { B = 2, T = 3 };
    uint64_t ids[B] = {8200, 8201};
    float x[B * I_];
    bool init[B] = {true, true};
    for (int s = 0; s < T + 1; s++) {
        rng_fill(&f->g, x, B * I_);
        struct rnnd_step_req sq = step_request(B, ids, x, I_, init);
        struct rnnd_step_reply sr;
        EXPECT_OK(rnnd_client_step(f->c, &sq, &sr));
        rnnd_step_reply_free(&sr);
        init[0] = init[1] = false;
    }
    // Only is_init besides the output: the rest stays out of the reply.
    struct rnnd_forward_req q = {
        .recorded = true, .n_env_ids = B, .env_ids = ids, .steps = T, .keep_tape = true};
    struct rnnd_forward_reply all, some;
    EXPECT_OK(rnnd_client_forward(f->c, &q, &all));
    assert_true(all.obs.present && all.is_init.present && all.step_model_version.present);
    assert_int_equal(all.extras.present, is_lstm(f)); // the LSTM daemon records extras
    q.has_recorded_fields = true;
    q.recorded_fields = 2; // RECORDED_IS_INIT
    q.keep_tape = false;
    EXPECT_OK(rnnd_client_forward(f->c, &q, &some));
    assert_false(some.obs.present || some.extras.present || some.step_model_version.present);
    assert_memory_equal(some.is_init.data, all.is_init.data, B * T);
    assert_memory_equal(some.output.data, all.output.data, sizeof(float) * B * T * H_);
    rnnd_forward_reply_free(&some);

    // Refused, nothing changed: recorded fields that name nothing, extras a daemon does not
    // record, recorded fields of an explicit source, a reply dtype the daemon does not send.
    q.recorded_fields = 16;
    EXPECT_STATUS(rnnd_client_forward(f->c, &q, &some), GRPC_STATUS_INVALID_ARGUMENT);
    if (!is_lstm(f)) {
        q.recorded_fields = 4; // RECORDED_EXTRAS, with --extras-size 0
        EXPECT_STATUS(rnnd_client_forward(f->c, &q, &some), GRPC_STATUS_INVALID_ARGUMENT);
    }
    q.recorded_fields = 1;
    q.reply_dtype = RNND_DTYPE_INT64;
    EXPECT_STATUS(rnnd_client_forward(f->c, &q, &some), GRPC_STATUS_INVALID_ARGUMENT);
    float tx[B * T * I_] = {0};
    uint16_t th[B * L_ * H_] = {0};
    struct rnnd_forward_req e = {.obs = rnnd_tensor_f32(tx, 3, B, T, I_, 0),
                                 .has_recorded_fields = true,
                                 .recorded_fields = 1};
    EXPECT_STATUS(rnnd_client_forward(f->c, &e, &some), GRPC_STATUS_INVALID_ARGUMENT);
    // Float tensors of two dtypes in one request; a NaN in fp16.
    e.has_recorded_fields = false;
    e.h0 = rnnd_tensor_view(RNND_DTYPE_FLOAT16, th, 3, (int64_t[]){B, L_, H_});
    if (is_lstm(f))
        e.c0 = e.h0;
    EXPECT_STATUS(rnnd_client_forward(f->c, &e, &some), GRPC_STATUS_INVALID_ARGUMENT);
    uint16_t nan16[B * I_] = {0};
    nan16[3] = 0x7e00;
    struct rnnd_step_req bad = {
        .n_env_ids = B,
        .env_ids = ids,
        .obs = rnnd_tensor_view(RNND_DTYPE_FLOAT16, nan16, 2, (int64_t[]){B, I_})};
    struct rnnd_step_reply sr;
    EXPECT_STATUS(rnnd_client_step(f->c, &bad, &sr), GRPC_STATUS_INVALID_ARGUMENT);
    // Backward: gradients of an input the Forward did not have (stored states), bits that
    // name nothing. The tape is still there afterwards and serves the Backward.
    float go[B * T * H_] = {0};
    struct rnnd_backward_req bq = {.tape_id = all.tape_id,
                                   .grad_output = rnnd_tensor_f32(go, 3, B, T, H_, 0),
                                   .has_input_grads = true,
                                   .input_grads = 4}; // INPUT_GRAD_HIDDEN
    struct rnnd_backward_reply br;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bq, &br), GRPC_STATUS_INVALID_ARGUMENT);
    bq.input_grads = 8;
    EXPECT_STATUS(rnnd_client_backward(f->c, &bq, &br), GRPC_STATUS_INVALID_ARGUMENT);
    bq.input_grads = 2; // INPUT_GRAD_H0: a recorded Forward starts from the recorded state
    EXPECT_OK(rnnd_client_backward(f->c, &bq, &br));
    assert_true(br.grad_h0.present && !br.grad_obs.present);
    rnnd_backward_reply_free(&br);
    // The envs' recorded steps did not move.
    q.has_recorded_fields = false;
    q.reply_dtype = RNND_DTYPE_UNSPECIFIED;
    EXPECT_OK(rnnd_client_forward(f->c, &q, &some));
    assert_memory_equal(some.obs.data, all.obs.data, sizeof(float) * B * T * I_);
    rnnd_forward_reply_free(&some);
    rnnd_forward_reply_free(&all);
    EXPECT_OK(rnnd_client_end_episodes(f->c, ids, B, NULL));
}

// A Backward whose reply would pass --max-message-mb (the gradients of stored states, which only
// the engine knows the Forward had, and fp32 asked for bf16 inputs) is refused with
// RESOURCE_EXHAUSTED and leaves the tape for a Backward whose reply fits.
static void test_backward_reply_limit(void **state) {
    (void)state;
    struct daemon d;
    const char *args[] = {"--cell",
                          "gru",
                          "--input-size",
                          "8",
                          "--hidden-size",
                          "16",
                          "--max-message-mb",
                          "1",
                          "--tape-memory-mb",
                          "64",
                          "--max-batch",
                          "16",
                          NULL};
    assert_int_equal(daemon_start(&d, args), 0);
    struct rnnd_client *c = daemon_client(&d, NULL);
    enum { B = 64, T = 256, H1 = 16 };
    uint16_t *x = calloc((size_t)B * T * I_, 2), *hid = calloc((size_t)B * T * H1, 2);
    uint16_t *go = calloc((size_t)B * T * H1, 2);
    uint8_t *init = calloc((size_t)B * T, 1);
    struct rnnd_forward_req fq = {
        .obs = rnnd_tensor_view(RNND_DTYPE_BFLOAT16, x, 3, (int64_t[]){B, T, I_}),
        .is_init = rnnd_tensor_view(RNND_DTYPE_BOOL, init, 2, (int64_t[]){B, T}),
        .hidden = rnnd_tensor_view(RNND_DTYPE_BFLOAT16, hid, 4, (int64_t[]){B, T, 1, H1}),
        .keep_tape = true};
    struct rnnd_forward_reply fr;
    EXPECT_OK(rnnd_client_forward(c, &fq, &fr));
    struct rnnd_backward_req bq = {
        .tape_id = fr.tape_id,
        .grad_output = rnnd_tensor_view(RNND_DTYPE_BFLOAT16, go, 3, (int64_t[]){B, T, H1}),
        .reply_dtype = RNND_DTYPE_FLOAT32}; // grad_obs and grad_hidden: 1.5 MB in fp32
    struct rnnd_backward_reply br;
    EXPECT_STATUS(rnnd_client_backward(c, &bq, &br), GRPC_STATUS_RESOURCE_EXHAUSTED);
    bq.reply_dtype = RNND_DTYPE_UNSPECIFIED; // bf16, as the request: 0.75 MB
    EXPECT_OK(rnnd_client_backward(c, &bq, &br));
    assert_true(br.grad_hidden.present && br.grad_hidden.dtype == RNND_DTYPE_BFLOAT16);
    rnnd_backward_reply_free(&br);
    rnnd_forward_reply_free(&fr);
    free(x);
    free(hid);
    free(go);
    free(init);
    rnnd_client_free(c);
    daemon_free(&d);
}

int main(void) {
    const struct CMUnitTest lstm[] = {
        cmocka_unit_test(test_forward_explicit),   cmocka_unit_test(test_backward),
        cmocka_unit_test(test_forward_recorded),   cmocka_unit_test(test_trajectory_ring),
        cmocka_unit_test(test_wire_dtypes),        cmocka_unit_test(test_wire_masks_and_refusals),
        cmocka_unit_test(test_lstm_extras_errors), cmocka_unit_test(test_sgd_accumulate_apply),
        cmocka_unit_test(test_tape_ttl),
    };
    const struct CMUnitTest gru[] = {
        cmocka_unit_test(test_forward_explicit),        cmocka_unit_test(test_backward),
        cmocka_unit_test(test_forward_recorded),        cmocka_unit_test(test_wire_dtypes),
        cmocka_unit_test(test_wire_masks_and_refusals), cmocka_unit_test(test_backward_reply_limit),
        cmocka_unit_test(test_adam_training),
    };
    int fails = cmocka_run_group_tests_name("learner (lstm, sgd)", lstm, setup_lstm, teardown);
    fails += cmocka_run_group_tests_name("learner (gru, adam)", gru, setup_gru, teardown);
    return fails ? 1 : 0;
}
