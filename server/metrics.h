/*
 * metrics.h: the daemon's Prometheus metrics. One global struct of C11 atomics: the gRPC thread,
 * the engine and the loop all add to it with relaxed atomic operations, and http.c renders it
 * for GET /metrics. No label carries an env id (unbounded cardinality); labels are the method,
 * the status code, the eviction reason and the backend op.
 */
#ifndef RNND_METRICS_H
#define RNND_METRICS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

enum rnnd_method {
    RNND_METHOD_GET_MODEL_INFO,
    RNND_METHOD_STEP,
    RNND_METHOD_STEP_STREAM,
    RNND_METHOD_END_EPISODES,
    RNND_METHOD_FORWARD,
    RNND_METHOD_BACKWARD,
    RNND_METHOD_APPLY_GRADIENTS,
    RNND_METHOD_GET_WEIGHTS,
    RNND_METHOD_SET_WEIGHTS,
    RNND_METHOD_SAVE_CHECKPOINT,
    RNND_METHOD_HEALTH_CHECK,
    RNND_METHOD_HEALTH_WATCH,
    RNND_METHOD_UNKNOWN,
    RNND_METHOD_COUNT,
};

// "Step", "grpc.health.v1.Health/Check", ...
const char *rnnd_method_name(enum rnnd_method m);

enum rnnd_backend_op {
    RNND_OP_STEP,
    RNND_OP_FORWARD,
    RNND_OP_BACKWARD,
    RNND_OP_OPTIM,
    RNND_OP_COUNT,
};

// Where the engine thread spends a Step batch's time (the backend op itself is
// kernel_ns[RNND_OP_STEP]).
enum rnnd_engine_phase {
    RNND_PHASE_GATHER, // forming the batch and staging its inputs
    RNND_PHASE_UPDATE, // env bookkeeping and trajectory recording
    RNND_PHASE_REPLY,  // finishing jobs (replies sent by the engine, or handed to reply threads)
    RNND_PHASE_COUNT,
};

enum rnnd_evict_reason {
    RNND_EVICT_IDLE,     // --env-idle-timeout-s passed
    RNND_EVICT_RELEASED, // EndEpisodes
    RNND_EVICT_COUNT,
};

#define RNND_HIST_MAX_BUCKETS 24
#define RNND_GRPC_CODES       17

// A histogram with fixed upper bounds (le) in base units: seconds are kept as nanoseconds.
struct rnnd_histogram {
    int n;                                              // finite buckets
    uint64_t bounds[RNND_HIST_MAX_BUCKETS];             // upper bounds, ascending, in base units
    _Atomic uint64_t counts[RNND_HIST_MAX_BUCKETS + 1]; // last: +Inf
    _Atomic uint64_t sum;
};

struct rnnd_metrics {
    _Atomic uint64_t requests[RNND_METHOD_COUNT][RNND_GRPC_CODES];
    struct rnnd_histogram duration[RNND_METHOD_COUNT]; // ns
    struct rnnd_histogram queue_delay;                 // ns, Step rows from arrival to batch
    struct rnnd_histogram batch_rows;                  // rows per backend step call
    _Atomic uint64_t env_steps;                        // rows stepped
    _Atomic uint64_t batches;
    _Atomic int64_t envs_active;
    _Atomic uint64_t evictions[RNND_EVICT_COUNT];
    _Atomic uint64_t model_version;
    _Atomic int64_t tapes;
    _Atomic int64_t tape_bytes;
    _Atomic int64_t queue_rows; // Step rows waiting
    _Atomic uint64_t kernel_ns[RNND_OP_COUNT];
    _Atomic uint64_t engine_ns[RNND_PHASE_COUNT];
    _Atomic uint64_t kernel_calls[RNND_OP_COUNT];
    _Atomic uint64_t checkpoints_ok, checkpoints_failed;
    _Atomic int ready; // 1 while serving
};

extern struct rnnd_metrics rnnd_metrics;

// Sets the bucket layouts and zeroes everything. Call once before other threads start.
void rnnd_metrics_init(void);

void rnnd_histogram_observe(struct rnnd_histogram *h, uint64_t v);
void rnnd_metrics_request(enum rnnd_method m, int grpc_code, uint64_t duration_ns);
void rnnd_metrics_kernel(enum rnnd_backend_op op, uint64_t ns);

// Renders every metric in Prometheus text format 0.0.4 into a new buffer *out (NUL-terminated,
// *len bytes without the NUL); free it with free(). 0 or RNND_ENOMEM.
int rnnd_metrics_render(char **out, size_t *len);

// Monotonic clock in nanoseconds.
uint64_t rnnd_now_ns(void);

#endif // RNND_METRICS_H
