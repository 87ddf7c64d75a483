/*
 * config.h: rnnd's configuration: every flag (docs/design.md), also read from a redis.conf-style
 * file ("key value" per line, '#' comments, the key being the flag without its dashes:
 * "hidden-size 128"). Flags on the command line win over the file. Parsing is pure: it touches
 * nothing but the struct, so unit tests drive it directly.
 */
#ifndef RNND_CONFIG_H
#define RNND_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "rnnd_kernels.h"

enum rnnd_backend_kind { RNND_BACKEND_AUTO, RNND_BACKEND_CPU, RNND_BACKEND_CUDA };

#define RNND_CONFIG_PATH_MAX   1024
#define RNND_CONFIG_ADDR_MAX   256
#define RNND_CONFIG_LISTEN_MAX 8  // --listen addresses
#define RNND_MAX_DEVICES       16 // --devices entries (group.c keeps a device mask in tape ids)
#define RNND_RANK_AUTO         -1 // --rank auto

struct rnnd_config {
    char config_file[RNND_CONFIG_PATH_MAX];
    struct rnnd_model model; // cell, compute, I, H, L and the policy
    enum rnnd_backend_kind backend;
    int device;
    // gRPC addresses, comma-separated: HOST:PORT or unix:PATH (rnnd_config_listen splits them)
    char listen[RNND_CONFIG_LISTEN_MAX * RNND_CONFIG_ADDR_MAX];
    int listen_unix_mode;                   // file mode of the unix: sockets
    char http[RNND_CONFIG_ADDR_MAX];        // HTTP HOST:PORT, or "off"
    char data_listen[RNND_CONFIG_ADDR_MAX]; // socket regions' HOST:PORT, "auto" or "off"
    char state_dir[RNND_CONFIG_PATH_MAX];
    char restore[RNND_CONFIG_PATH_MAX];
    char weights[RNND_CONFIG_PATH_MAX]; // safetensors file of starting weights (PyTorch names)
    int checkpoint_interval_s;          // 0: only on SIGTERM and SaveCheckpoint
    int fresh_start; // start from --seed/--weights when no automatic checkpoint loads
    int max_batch;   // Step rows a batch; 0 until rnnd_config_parse picks the default
    int max_delay_us;
    int max_envs;
    int env_idle_timeout_s; // 0: never evict
    int trajectory_steps;   // 0: record nothing
    int extras_size;
    int max_policy_lag; // cursor windows skip steps more versions old than this; 0: off
    int tape_ttl_s;
    int tape_memory_mb;
    enum rnnd_optim_kind optimizer;
    float lr;
    float max_grad_norm; // 0: no clipping
    uint64_t seed;
    char tls_cert[RNND_CONFIG_PATH_MAX];
    char tls_key[RNND_CONFIG_PATH_MAX];
    char tls_client_ca[RNND_CONFIG_PATH_MAX];
    char auth_token_file[RNND_CONFIG_PATH_MAX];
    int max_message_mb;
    int log_level;  // enum rnnd_log_level
    int log_format; // enum rnnd_log_format
    // Tuning (docs/design.md "Limits", docs/architecture.md "Threads"):
    int hz;              // cron frequency: idle eviction, tape expiry, periodic checkpoints
    int max_queue_rows;  // Step rows waiting for the engine before RESOURCE_EXHAUSTED; 0: auto
    int drain_timeout_s; // after SIGTERM, calls still running after this are cancelled
    int engine_spin_us;  // the engine (and its row workers) poll this long for work before sleeping
    int grpc_threads;    // completion-queue threads; 0: automatic (1 per 4 CPUs, 1 to 4)
    int reply_threads;  // threads sending Step replies; -1: automatic (0 under 8 CPUs, else CPUs/4)
    int inline_steps;   // CPU backend: a Step arriving at an idle engine runs on its gRPC thread
    int step_lookahead; // gather the next Step batch while one runs; -1: where memory is separate
    int max_streams;    // rnnd.v1 calls (unary and StepStream) in progress at once
    int max_reply_mb;   // memory for replies not yet read by their clients
    int max_connections;       // gRPC connections open at once
    int max_health_watches;    // grpc.health.v1 Watch streams open at once
    int stream_idle_timeout_s; // end idle StepStreams and unread replies after this; 0: never
    int max_shm_regions;       // shared-memory regions registered at once; 0: none (off)
    int max_socket_region_mb;  // the daemon's memory all socket regions together may hold
    // Several devices and hosts (group.c, cluster.c):
    char devices[RNND_CONFIG_ADDR_MAX];    // "0,1,...": one engine per device; "": --device alone
    int place_block;                       // envs placed on the devices by blocks of ids (place.h)
    int rank;                              // this rnnd among --world-size, or RNND_RANK_AUTO
    int world_size;                        // rnnd instances sharing the weights (NCCL, or cpu: TCP)
    char rendezvous[RNND_CONFIG_ADDR_MAX]; // HOST:PORT where rank 0 meets the others
    int rendezvous_timeout_s;              // how long ranks wait for each other at start
    int comm_timeout_s;                    // a collective not finished by then fails
};

// Fills c with the defaults (docs/design.md "Configuration").
void rnnd_config_defaults(struct rnnd_config *c);

// What rnnd_config_parse decided.
enum rnnd_config_result {
    RNND_CONFIG_RUN = 0,   // start the daemon
    RNND_CONFIG_EXIT = 1,  // --help or --version was printed to out: exit 0
    RNND_CONFIG_ERROR = 2, // err holds a message naming the bad flag or key: exit non-zero
};

// Parses argv (argv[0] skipped): first the file named by --config, then the flags, then checks
// that the combination makes sense. c must hold defaults. --help and --version print to out.
enum rnnd_config_result rnnd_config_parse(struct rnnd_config *c, int argc, char **argv, FILE *out,
                                          char *err, size_t errlen);

// Sets one key ("hidden-size", also "hidden_size" and "--hidden-size") from its text value.
// 0, or RNND_EINVAL with a message in err naming the key and what it accepts.
int rnnd_config_set(struct rnnd_config *c, const char *key, const char *value, char *err,
                    size_t errlen);

// Reads a config file into c. 0, or RNND_EINVAL / RNND_EIO with "FILE:LINE: ..." in err.
int rnnd_config_load_file(struct rnnd_config *c, const char *path, char *err, size_t errlen);

// Where socket regions' data connections listen (--data-listen): the address given, or for
// "auto" the host of the first TCP --listen address other hosts reach (else of the first TCP
// one) with port 0; "" (off) for "off", for "auto"
// without a TCP --listen address, with TLS (data connections are plaintext) or with
// --max-shm-regions 0.
void rnnd_config_data_listen(const struct rnnd_config *c, char out[RNND_CONFIG_ADDR_MAX]);

// Cross-field checks after everything is set (e.g. --tls-key needs --tls-cert).
int rnnd_config_check(const struct rnnd_config *c, char *err, size_t errlen);

// When a --listen address is reachable from other hosts (not loopback, not a unix socket) and the
// security flags leave it open, a warning saying what is exposed and which flag closes it;
// NULL when there is nothing to warn about. A static string.
const char *rnnd_config_exposure(const struct rnnd_config *c);

// Splits a --listen list into out (each NUL-terminated); returns how many addresses (at most
// RNND_CONFIG_LISTEN_MAX, all valid once rnnd_config_set accepted the list).
int rnnd_config_listen(const char *list, char out[RNND_CONFIG_LISTEN_MAX][RNND_CONFIG_ADDR_MAX]);

// Prints the usage text: every flag with its argument, default and meaning.
void rnnd_config_usage(FILE *f);

// Effective queue bound in rows (max_queue_rows, or its automatic value).
int rnnd_config_queue_rows(const struct rnnd_config *c);

// The devices this daemon runs on, in order (--devices, else --device alone): their count (1 to
// RNND_MAX_DEVICES), indices in out. Valid after rnnd_config_check.
int rnnd_config_devices(const struct rnnd_config *c, int out[RNND_MAX_DEVICES]);
// This rnnd's rank: --rank when a number; for auto, $RNND_RANK when set, else the number that
// ends the host name (a StatefulSet's pods are NAME-0, NAME-1, ...). 0, or RNND_EINVAL with the
// reason in err.
int rnnd_config_rank(const struct rnnd_config *c, int *rank, char *err, size_t errlen);

const char *rnnd_config_cell_name(enum rnnd_cell cell);
const char *rnnd_config_compute_name(enum rnnd_compute compute);
const char *rnnd_config_act_name(enum rnnd_act act);

#endif // RNND_CONFIG_H
