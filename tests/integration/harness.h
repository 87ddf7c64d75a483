/*
 * harness.h: what every integration test needs: a real rnnd started on free loopback ports with
 * a temporary --state-dir (and killed afterwards), raw HTTP GETs, the CPU reference backend set up
 * with the daemon's own weights, and tensor comparisons that print the first mismatches.
 *
 * The daemon binary comes from RNND_BIN (a compile definition set by CMake), overridable with the
 * RNND_BIN environment variable. Its output goes to <state-dir>/rnnd.log; set RNND_TEST_KEEP=1 to
 * keep that directory after a test, and a failing start prints the log's tail.
 */
#ifndef RNND_TEST_HARNESS_H
#define RNND_TEST_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <cmocka.h>

#include "rnnd_client.h"
#include "rnnd_kernels.h"

// ---------------------------------------------------------------------------------------------
// The daemon.

struct daemon {
    pid_t pid;       // 0 once reaped
    int exit_status; // waitpid status once reaped
    char grpc[64];   // "127.0.0.1:PORT" from the ready line
    char http[64];
    char backend[32];
    char state_dir[256]; // temporary; removed by daemon_free unless RNND_TEST_KEEP is set
    char log_path[300];
    char ready_line[512];
    double start_seconds; // from spawn to the ready line
    size_t log_start;     // where this start's lines begin in log_path (restarts append)
    double spawn_seconds; // now_seconds() at the spawn
};

// Starts rnnd with --backend cpu --listen 127.0.0.1:0 --http 127.0.0.1:0 --state-dir <new temp
// dir> followed by args (NULL-terminated, may be NULL) and waits up to 30 s for the ready line.
// 0 on success; -1 (log tail printed) when it exits or never gets ready.
int daemon_start(struct daemon *d, const char *const *args);
// Same with an existing state directory (a restart); the directory is not removed by daemon_free
// unless owned is true.
int daemon_start_in(struct daemon *d, const char *state_dir, bool owned, const char *const *args);
// The two halves of daemon_start, for daemons that must start together (a group of instances
// whose ranks wait for each other): spawn returns once the process runs (0, or -1), wait_ready
// waits until timeout_s after the spawn for the ready line (0, or -1 with the log tail printed
// and the daemon freed).
int daemon_spawn(struct daemon *d, const char *const *args);
int daemon_spawn_in(struct daemon *d, const char *state_dir, bool owned, const char *const *args);
int daemon_wait_ready(struct daemon *d, double timeout_s);
// Sends sig and waits up to timeout_ms for the exit. 0 when it exited (status in d->exit_status),
// -1 on timeout (the daemon is then still running).
int daemon_signal_wait(struct daemon *d, int sig, int timeout_ms);
// True while the process has not exited.
bool daemon_alive(struct daemon *d);
// SIGKILLs the daemon if still running, reaps it, removes the state dir (when owned).
void daemon_free(struct daemon *d);
// The end of a test group's daemon: when it is gone with a nonzero exit status (it died during
// the tests, rather than being stopped by one or never started), says so with that status and
// the tail of its log; then daemon_free. Free its clients and reference first.
void daemon_teardown(struct daemon *d);
// True when the log written since this start contains needle.
bool daemon_log_contains(const struct daemon *d, const char *needle);
// Prints the last n bytes of the daemon's log to stderr.
void daemon_dump_log(const struct daemon *d, size_t n);
// The daemon's open descriptors (-1 when /proc/PID/fd cannot be read); with show, each one's
// target on stderr, and a socket's TCP line with it (to name a leak).
int daemon_fd_count(const struct daemon *d, bool show);
// The daemon's descriptors once they are back to at most before, or after 5 s (connections
// closed by a client take a moment to close on the daemon's side); above before, each one is
// shown (daemon_fd_count's show) before returning.
int daemon_fds_settle(const struct daemon *d, int before);
// A new client of d (asserts on failure). opts_token may be NULL.
struct rnnd_client *daemon_client(const struct daemon *d, const char *token);
// Runs an argv-style command line with stdout+stderr captured into *out (new, free()); returns
// the exit status (or -1). Used for rnndctl and for bad-flag runs of rnnd.
int run_capture(const char *const *argv, int timeout_ms, char **out);

// Path of the rnnd binary, and of rnndctl (RNNDCTL_BIN).
const char *rnnd_bin(void);
const char *rnndctl_bin(void);
// The backend and compute mode every daemon starts with: $RNND_BACKEND (default cpu) and
// $RNND_COMPUTE (default fp32), so a GPU host runs the same suite with RNND_BACKEND=cuda
// RNND_COMPUTE=ieee (strict fp32, within the suite's tolerances). A test's own flags come later
// and win.
const char *harness_backend(void);
const char *harness_compute(void);
// $RNND_DEVICES ("0,1"), passed as --devices to every daemon (the whole suite then runs on
// several devices), or NULL.
const char *harness_devices(void);

// ---------------------------------------------------------------------------------------------
// HTTP.

// GET path from host:port (HTTP/1.1, Connection: close). *status receives the code; *body a new
// NUL-terminated string (free()); *headers (may be NULL) the raw header block. 0 or -1.
int http_get(const char *hostport, const char *path, int *status, char **headers, char **body);
// Sends len raw bytes of request to host:port and reads the response as http_get does, waiting
// at most timeout_ms for each read. 0 or -1 (no HTTP response).
int http_raw(const char *hostport, const char *request, size_t len, int timeout_ms, int *status,
             char **headers, char **body);
// A connected TCP socket to host:port (an IPv4 address), or -1.
int tcp_connect(const char *hostport);
// The value of metric `name` (labels as for prom_value) in d's /metrics now; NAN when absent or
// when /metrics does not answer 200.
double daemon_metric(const struct daemon *d, const char *name, const char *labels);
// The value of the first sample of metric `name` whose label set contains every "k=\"v\""
// substring in `labels` (may be NULL), from a Prometheus text body; NAN when absent.
double prom_value(const char *body, const char *name, const char *labels);

// ---------------------------------------------------------------------------------------------
// The CPU reference, loaded with the daemon's weights.

struct ref {
    struct rnnd_model m;
    struct rnnd_backend be;
    float *params; // (P)
    size_t P;
    int S;          // state slots
    float *state_h; // (S, L, H)
    float *state_c; // (S, L, H) LSTM
    int extras_size;
};

// Fetches info and weights from c and builds the reference with S slots (zero states).
void ref_init(struct ref *r, struct rnnd_client *c, int S);
void ref_free(struct ref *r);
// Reloads params from c's GetWeights.
void ref_reload(struct ref *r, struct rnnd_client *c);
// One reference step of B rows (slots, each below S: checked; x (B, I), is_init (B) may be NULL)
// into out (B, H).
void ref_step(struct ref *r, int B, const int32_t *slots, const float *x, const bool *is_init,
              float *out);

// ---------------------------------------------------------------------------------------------
// Helpers.

// Deterministic uniform floats in [-1, 1] and integers.
struct rng {
    uint64_t s;
};
float rng_f(struct rng *g);
uint32_t rng_u(struct rng *g, uint32_t n); // [0, n)
void rng_fill(struct rng *g, float *v, size_t n);
void rng_perm(struct rng *g, int *perm, int n); // a random permutation of 0 .. n-1

// Compares n floats: |a - b| <= atol + rtol * |b|. On mismatch prints what and the first few
// indices, and returns false. NaN never matches.
bool close_f32(const char *what, const float *a, const float *b, size_t n, float atol, float rtol);
// Max |a - b|.
double max_abs_diff(const float *a, const float *b, size_t n);

// Asserts the tensor is present with dtype FLOAT32, the given dims and a matching byte count.
void assert_tensor_f32(const struct rnnd_tensor *t, int ndim, int64_t d0, int64_t d1, int64_t d2,
                       int64_t d3);

// Asserts that err is nonzero and the last error carries grpc status `status`; prints the
// message. Use with EXPECT_STATUS(call, GRPC_STATUS_...).
void expect_status_(int err, int status, const char *expr, const char *file, int line);
#define EXPECT_STATUS(call, status) expect_status_((call), (status), #call, __FILE__, __LINE__)
// Asserts err == 0 and prints the last error otherwise.
void expect_ok_(int err, const char *expr, const char *file, int line);
#define EXPECT_OK(call) expect_ok_((call), #call, __FILE__, __LINE__)

// A Step request of B envs: ids (B), obs x as a (B, I) FLOAT32 tensor and, when init is not NULL,
// is_init (B); everything else unset. It points at the caller's arrays.
struct rnnd_step_req step_request(int B, const uint64_t *ids, float *x, int I, const bool *init);
// One env's Step on stream s (obs x (1, I), is_init init) for its status alone: the reply is
// dropped. For tests of what the daemon admits, where the outputs are checked elsewhere.
int stream_step1(struct rnnd_client_stream *s, uint64_t id, float *x, int I, bool init);

// A whole file as a new NUL-terminated buffer (free()), its size in *len (may be NULL); NULL when
// it cannot be opened.
char *read_file(const char *path, size_t *len);

// Seconds on a monotonic clock.
double now_seconds(void);
void sleep_ms(int ms);

#endif // RNND_TEST_HARNESS_H
