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
    RNND_METHOD_REGISTER_REGION,
    RNND_METHOD_RELEASE_REGION,
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
    RNND_PHASE_ADMIT,  // taking the batch from the queue: each item's admission and env dedup
    RNND_PHASE_COUNT,
};

enum rnnd_evict_reason {
    RNND_EVICT_IDLE,     // --env-idle-timeout-s passed
    RNND_EVICT_RELEASED, // EndEpisodes
    RNND_EVICT_COUNT,
};

// Why recorded steps were never handed out in a cursor window (docs/design.md "Cursor").
enum rnnd_drop_reason {
    RNND_DROP_POLICY_LAG,  // computed by weights more than --max-policy-lag versions old
    RNND_DROP_OVERWRITTEN, // left the env's ring (--trajectory-steps) before being handed out
    RNND_DROP_COUNT,
};

// The bounded resources (every one has a flag, a gauge of its bound: rnnd_limit_bytes or
// rnnd_limit_items by its unit, and the deprecated rnnd_limit for all; and a counter of the
// requests refused with RESOURCE_EXHAUSTED when it was reached).
enum rnnd_limit {
    RNND_LIMIT_ENVS,           // --max-envs: envs holding state
    RNND_LIMIT_QUEUE_ROWS,     // --max-queue-rows: Step rows waiting for the engine
    RNND_LIMIT_TAPE_BYTES,     // --tape-memory-mb: memory of kept Forward tapes
    RNND_LIMIT_MESSAGE,        // --max-message-mb: bytes of one message either way
    RNND_LIMIT_STREAMS,        // --max-streams: rnnd.v1 calls in progress
    RNND_LIMIT_REPLY_BYTES,    // --max-reply-mb: replies sent or queued, not yet read by clients
    RNND_LIMIT_CONNECTIONS,    // --max-connections: gRPC connections open
    RNND_LIMIT_HEALTH_WATCHES, // --max-health-watches: grpc.health.v1 Watch streams open
    RNND_LIMIT_SHM_REGIONS,    // --max-shm-regions: shared-memory regions registered
    RNND_LIMIT_SOCKET_BYTES,   // --max-socket-region-mb: the daemon's memory in socket regions
    RNND_LIMIT_COUNT,
};

// Why an HTTP connection ended before its request was answered (http.h).
enum rnnd_http_drop {
    RNND_HTTP_DROP_EVICTED,        // closed to make room for a new one at the connection cap
    RNND_HTTP_DROP_HEADER_TIMEOUT, // no complete request head within the deadline (answered 408)
    RNND_HTTP_DROP_ACCEPT_FAILED,  // could not be accepted (descriptors or memory exhausted)
    RNND_HTTP_DROP_COUNT,
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
    _Atomic uint64_t recorded_dropped[RNND_DROP_COUNT]; // steps cursor windows skipped
    _Atomic uint64_t model_version;
    _Atomic int64_t tapes;
    _Atomic int64_t tape_bytes;
    _Atomic int64_t queue_rows; // Step rows waiting
    _Atomic uint64_t kernel_ns[RNND_OP_COUNT];
    _Atomic uint64_t engine_ns[RNND_PHASE_COUNT];
    _Atomic uint64_t kernel_calls[RNND_OP_COUNT];
    _Atomic uint64_t checkpoints_ok, checkpoints_failed;
    _Atomic int64_t limit[RNND_LIMIT_COUNT]; // the configured bounds (bytes, rows, ...)
    _Atomic uint64_t limit_rejections[RNND_LIMIT_COUNT];
    _Atomic int64_t streams_active;     // rnnd.v1 calls in progress
    struct rnnd_histogram request_size; // bytes of each decoded request message
    _Atomic int ready;                  // 1 while serving
    _Atomic int64_t http_connections;   // HTTP connections open
    _Atomic uint64_t http_dropped[RNND_HTTP_DROP_COUNT];
    _Atomic int64_t reply_bytes;        // replies reserved, queued or being sent
    _Atomic int64_t connections;        // gRPC connections open
    _Atomic int64_t health_watches;     // grpc.health.v1 Watch streams open
    _Atomic uint64_t stream_idle_ends;  // calls ended by --stream-idle-timeout-s
    _Atomic(const char *) backend;      // "cpu" or "cuda" (static) once the engine runs, or NULL
    _Atomic int64_t traj_store_bytes;   // backend memory of the trajectory stores
    _Atomic int64_t shm_regions;        // shared-memory regions registered
    _Atomic int64_t socket_bytes;       // bytes of the socket regions registered
    _Atomic uint64_t data_in, data_out; // bytes the data connections received and sent
};

extern struct rnnd_metrics rnnd_metrics;

// Sets the bucket layouts and zeroes everything. Call once before other threads start.
void rnnd_metrics_init(void);

void rnnd_histogram_observe(struct rnnd_histogram *h, uint64_t v);
void rnnd_metrics_request(enum rnnd_method m, int grpc_code, uint64_t duration_ns);
void rnnd_metrics_kernel(enum rnnd_backend_op op, uint64_t ns);
// A request was refused because the bound of resource r was reached.
void rnnd_metrics_limit_hit(enum rnnd_limit r);

// Renders every metric in Prometheus text format 0.0.4 into a new buffer *out (NUL-terminated,
// *len bytes without the NUL); free it with free(). 0 or RNND_ENOMEM.
int rnnd_metrics_render(char **out, size_t *len);

// Monotonic clock in nanoseconds.
uint64_t rnnd_now_ns(void);

#endif // RNND_METRICS_H
