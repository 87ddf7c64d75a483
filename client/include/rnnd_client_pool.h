/*
 * rnnd_client_pool.h: one client over several rnnd instances. Each env lives on one instance,
 * chosen by rendezvous (highest-random-weight) hashing of its env id over the target names: every
 * target scores the env, the highest score wins. The choice depends only on the env id and the
 * set of target names (not their order), so every actor and learner that is given the same target
 * strings agrees on where an env's state lives, and adding an instance moves only the envs it now
 * wins (about 1/(n+1) of them); removing one moves only the envs it held.
 *
 * A moved env has no state on its new instance: its next step must carry is_init (the daemon
 * answers FAILED_PRECONDITION otherwise), so grow a pool between episodes where that matters.
 *
 * The hash is part of the contract: the Python client (rnnd.Pool, client/python/rnnd/pool.py)
 * computes the same placement, and tests/deploy checks both against the same vectors.
 *   target_hash(name) = FNV-1a 64 of the name's bytes
 *   mix64(z)          = the splitmix64 finalizer (z ^= z >> 30; z *= 0xbf58476d1ce4e5b9;
 *                       z ^= z >> 27; z *= 0x94d049bb133111eb; z ^= z >> 31)
 *   weight(env, th)   = mix64(th ^ mix64(env + 0x9e3779b97f4a7c15))   (all mod 2^64)
 *   pick(env)         = the target of highest weight; ties go to the smaller target hash.
 *
 * The single-target API (rnnd_client.h) is unchanged; a pool holds one struct rnnd_client per
 * target, reachable with rnnd_client_pool_client() for calls that are not split (GetModelInfo,
 * weights, learner calls). Errors follow rnnd_client.h: 0 or a negative RNND_E*, details in
 * rnnd_client_last_error() on the calling thread; a failure on one target names it in the message.
 */
#ifndef RNND_CLIENT_POOL_H
#define RNND_CLIENT_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "rnnd_client.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Rendezvous hashing (pure functions, no connection needed).

// FNV-1a 64 of name's bytes (the NUL excluded).
uint64_t rnnd_rendezvous_target_hash(const char *name);
// The score of env_id on the target whose hash is target_hash.
uint64_t rnnd_rendezvous_weight(uint64_t env_id, uint64_t target_hash);
// Index in target_hashes (n of them, n >= 1) of the target that wins env_id.
size_t rnnd_rendezvous_pick(uint64_t env_id, const uint64_t *target_hashes, size_t n);

// ---------------------------------------------------------------------------------------------
// The pool.

struct rnnd_client_pool;

// Returns a new pool over targets (n >= 1 distinct "HOST:PORT" strings, copied) in *out, free with
// rnnd_client_pool_free. opts gives everything but the target (opts->target is ignored; opts may
// be NULL for plaintext with defaults). Connections open lazily, as rnnd_client_init's do.
// RNND_EINVAL for no targets, an empty or repeated one; RNND_ENOMEM.
int rnnd_client_pool_init(const struct rnnd_client_opts *opts, const char *const *targets, size_t n,
                          struct rnnd_client_pool **out);
// Closes every client. NULL does nothing. No call may be in flight.
void rnnd_client_pool_free(struct rnnd_client_pool *p);

size_t rnnd_client_pool_size(const struct rnnd_client_pool *p);
// The i-th target string (borrowed), in the order given to init.
const char *rnnd_client_pool_target(const struct rnnd_client_pool *p, size_t i);
// The i-th target's client (borrowed; freed with the pool).
struct rnnd_client *rnnd_client_pool_client(struct rnnd_client_pool *p, size_t i);
// Index of the target that holds env_id.
size_t rnnd_client_pool_pick(const struct rnnd_client_pool *p, uint64_t env_id);
// Waits up to timeout_ms (in all) for every target to be connected: 0, or RNND_EUNAVAIL naming
// the first target that is not.
int rnnd_client_pool_wait_connected(struct rnnd_client_pool *p, int64_t timeout_ms);

// Step over the pool: req's rows are split by target (env_ids, obs, is_init, step_index and
// extras follow their rows), the parts run concurrently (one thread per extra target), and *out
// gets the rows back in req's order: output (B, H), h and c (B, L, H) when return_state.
// out->model_version is the smallest of the parts' versions. When every row goes to one target,
// req is sent unchanged. If a part fails, the call returns the failure of the lowest-indexed
// failing target and *out is left zeroed; parts that succeeded on other targets have advanced
// their envs (send step_index to make such a retry safe). Thread-safe, as rnnd_client_step is.
int rnnd_client_pool_step(struct rnnd_client_pool *p, const struct rnnd_step_req *req,
                          struct rnnd_step_reply *out);

// EndEpisodes over the pool: each env id goes to its target; *released (may be NULL) is the sum.
int rnnd_client_pool_end_episodes(struct rnnd_client_pool *p, const uint64_t *env_ids, size_t n,
                                  uint64_t *released);

// StepStream over the pool: one stream per target, opened when a request first has rows for it.
// send splits a request and sends each part on its target's stream; recv returns the replies of
// the oldest request not yet received, reassembled in its row order, so several requests may be
// in flight (replies come in order). After any error the stream is broken: every later call
// returns RNND_ECANCELED and it can only be freed. One thread at a time.
struct rnnd_client_pool_stream;
int rnnd_client_pool_stream_init(struct rnnd_client_pool *p, struct rnnd_client_pool_stream **out);
int rnnd_client_pool_stream_send(struct rnnd_client_pool_stream *s,
                                 const struct rnnd_step_req *req);
int rnnd_client_pool_stream_recv(struct rnnd_client_pool_stream *s, struct rnnd_step_reply *out);
// send + recv.
int rnnd_client_pool_stream_step(struct rnnd_client_pool_stream *s, const struct rnnd_step_req *req,
                                 struct rnnd_step_reply *out);
// Half-closes every open stream, drains replies not yet received and returns the first non-OK
// final status as a code (0 when all ended OK).
int rnnd_client_pool_stream_close(struct rnnd_client_pool_stream *s);
// Cancels the streams still open and frees everything. NULL does nothing.
void rnnd_client_pool_stream_free(struct rnnd_client_pool_stream *s);

#ifdef __cplusplus
}
#endif

#endif // RNND_CLIENT_POOL_H
