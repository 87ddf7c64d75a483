/*
 * fuzz_request.c: libFuzzer target for request decoding and checking (server/request.c), the
 * code every rnnd.v1 and grpc.health.v1 request goes through before it can touch the engine.
 *
 * Input: byte 0 picks the method (enum rnnd_method), byte 1 the daemon configuration it is
 * checked against (GRU or LSTM, extras or none, a --state-dir or none), the rest is the request
 * message as it arrives on the wire. Each input is decoded with rnnd_request_decode and checked
 * with the method's own function, exactly as rpc.c and service.c do. A request the check accepts
 * is then read the way the engine reads it (every float of every tensor it will use), so that a
 * check which lets a short tensor through shows up as an out-of-bounds read under ASan. A
 * refused request must say why.
 *
 * Build: CC=clang cmake -DRNND_FUZZ=ON -DRNND_CUDA=OFF; run: fuzz_request CORPUS_DIR
 * (tests/fuzz/corpus holds the seeds; tests/fuzz/make_corpus.py wrote them).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "request.h"

static struct rnnd_request_limits limits[4];
static float *flat; // (P) of the largest model

static void limits_init(void) {
    struct rnnd_config cfg;
    for (int k = 0; k < 4; k++) {
        rnnd_config_defaults(&cfg);
        bool lstm = k & 1;
        cfg.model = (struct rnnd_model){.cell = lstm ? RNND_CELL_LSTM : RNND_CELL_GRU,
                                        .compute = RNND_COMPUTE_FP32,
                                        .I = lstm ? 3 : 4,
                                        .H = lstm ? 2 : 3,
                                        .L = lstm ? 2 : 1};
        cfg.max_batch = 16;
        cfg.extras_size = lstm ? 2 : 0;
        cfg.trajectory_steps = k & 2 ? 0 : 8;
        cfg.max_message_mb = 1;
        snprintf(cfg.state_dir, sizeof(cfg.state_dir), "%s", k & 2 ? "" : "/var/lib/rnnd");
        rnnd_request_limits_init(&limits[k], &cfg);
    }
    size_t P = 0;
    for (int k = 0; k < 4; k++)
        P = limits[k].P > P ? limits[k].P : P;
    flat = malloc(P * sizeof(float));
}

// Reads n bytes the way the engine will; the sum keeps the reads from being optimised away.
static volatile float sink;
static void touch_bytes(const void *v, size_t n) {
    const uint8_t *p = v;
    uint8_t s = 0;
    for (size_t i = 0; i < n; i++)
        s ^= p[i];
    sink = s;
}

// n float elements of the wire dtype ft.
static void touch(const void *p, size_t n, enum rnnd_ftype ft) {
    touch_bytes(p, n * rnnd_ftype_bytes(ft));
}

static void accepted_step(const struct rnnd_request_limits *l, const Rnnd__V1__StepRequest *req,
                          bool extras, enum rnnd_ftype ft) {
    size_t B = req->n_env_ids;
    if (B == 0 || B > (size_t)l->max_batch)
        abort();
    touch(req->obs->data.data, B * (size_t)l->model.I, ft);
    if (extras)
        touch(req->extras->data.data, B * (size_t)l->extras_size, ft);
    if (req->n_is_init)
        touch_bytes((const uint8_t *)req->is_init, B);
}

static void accepted_forward(const struct rnnd_request_limits *l,
                             const struct rnnd_forward_job *f) {
    size_t B = (size_t)f->B, T = (size_t)f->T, LH = (size_t)(l->model.L * l->model.H);
    if (f->B < 1 || f->T < 1)
        abort();
    if (f->recorded) {
        if (f->env_ids == NULL || f->T > l->trajectory_steps)
            abort();
        return;
    }
    touch(f->x, B * T * (size_t)l->model.I, f->in);
    if (f->is_init)
        touch_bytes(f->is_init, B * T);
    if (f->h0)
        touch(f->h0, B * LH, f->in);
    if (f->c0)
        touch(f->c0, B * LH, f->in);
    if (f->hidden)
        touch(f->hidden, B * T * LH, f->in);
    if (f->cell)
        touch(f->cell, B * T * LH, f->in);
}

static void accepted_backward(const struct rnnd_request_limits *l,
                              const struct rnnd_backward_job *g) {
    size_t LH = (size_t)(l->model.L * l->model.H);
    if (g->tape_id == 0 || g->B < 1 || g->T < 1)
        abort();
    touch(g->grad_out, (size_t)g->B * (size_t)g->T * (size_t)l->model.H, g->in);
    if (g->grad_h_n)
        touch(g->grad_h_n, (size_t)g->grad_h_n_B * LH, g->in);
    if (g->grad_c_n)
        touch(g->grad_c_n, (size_t)g->grad_c_n_B * LH, g->in);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (flat == NULL)
        limits_init();
    if (size < 2)
        return 0;
    enum rnnd_method m = (enum rnnd_method)(data[0] % RNND_METHOD_UNKNOWN);
    const struct rnnd_request_limits *l = &limits[data[1] % 4];
    ProtobufCMessage *msg = rnnd_request_decode(m, data + 2, size - 2);
    if (msg == NULL)
        return 0;
    char err[RNND_REQUEST_ERRLEN] = "";
    int rc = 0;
    switch (m) {
        case RNND_METHOD_STEP:
        case RNND_METHOD_STEP_STREAM: {
            bool extras;
            struct rnnd_request_dtypes dts;
            const Rnnd__V1__StepRequest *req = (const Rnnd__V1__StepRequest *)msg;
            rc = rnnd_request_step(l, req, &extras, &dts, err);
            if (rc == 0)
                accepted_step(l, req, extras, dts.in);
            break;
        }
        case RNND_METHOD_END_EPISODES:
            rc = rnnd_request_end_episodes(l, (const Rnnd__V1__EndEpisodesRequest *)msg, err);
            break;
        case RNND_METHOD_FORWARD: {
            struct rnnd_forward_job f;
            rc = rnnd_request_forward(l, (const Rnnd__V1__ForwardRequest *)msg, &f, err);
            if (rc == 0)
                accepted_forward(l, &f);
            break;
        }
        case RNND_METHOD_BACKWARD: {
            struct rnnd_backward_job g;
            rc = rnnd_request_backward(l, (const Rnnd__V1__BackwardRequest *)msg, &g, false, err);
            if (rc == 0)
                accepted_backward(l, &g);
            break;
        }
        case RNND_METHOD_APPLY_GRADIENTS: {
            bool has_lr;
            const Rnnd__V1__ApplyGradientsRequest *req =
                (const Rnnd__V1__ApplyGradientsRequest *)msg;
            rc = rnnd_request_apply_gradients(l, req, flat, &has_lr, err);
            if (rc == 0 && req->n_grads)
                touch(flat, l->P, RNND_FTYPE_F32);
            break;
        }
        case RNND_METHOD_GET_WEIGHTS:
            rc = rnnd_request_get_weights(l, err);
            break;
        case RNND_METHOD_SET_WEIGHTS:
            rc = rnnd_request_set_weights(l, (const Rnnd__V1__SetWeightsRequest *)msg, flat, err);
            if (rc == 0)
                touch(flat, l->P, RNND_FTYPE_F32);
            break;
        case RNND_METHOD_SAVE_CHECKPOINT:
            rc = rnnd_request_save_checkpoint(l, (const Rnnd__V1__SaveCheckpointRequest *)msg, err);
            break;
        case RNND_METHOD_HEALTH_CHECK:
        case RNND_METHOD_HEALTH_WATCH: {
            const Grpc__Health__V1__HealthCheckRequest *req =
                (const Grpc__Health__V1__HealthCheckRequest *)msg;
            rnnd_request_health_known(req->service ? req->service : "");
            break;
        }
        case RNND_METHOD_GET_MODEL_INFO:
        case RNND_METHOD_REGISTER_REGION: // checked against the process table (shm.c), not pure
        case RNND_METHOD_RELEASE_REGION:
        case RNND_METHOD_UNKNOWN:
        case RNND_METHOD_COUNT:
            break;
    }
    // A refusal is a client's error (or a bound) with a message that says what was wrong.
    if (rc != 0 && (strlen(err) == 0 || strlen(err) >= sizeof(err) ||
                    (rc != RNND_EINVAL && rc != RNND_EPRECOND && rc != RNND_ENOTFOUND &&
                     rc != RNND_EFULL && rc != RNND_ENOMEM)))
        abort();
    protobuf_c_message_free_unpacked(msg, NULL);
    return 0;
}
