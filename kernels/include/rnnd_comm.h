/*
 * rnnd_comm.h: collectives between replicas of the model (the seam for data parallelism).
 *
 * A communicator joins `nranks` backends, one per rank, each on its own thread (an engine). Every
 * rank calls the same collectives in the same order; a rank that calls none leaves the others
 * waiting until the timeout given at init. Results are identical on every rank (a reduction is
 * computed once and copied), so replicas that start equal and apply the same reduced gradients
 * with deterministic kernels stay bit-identical.
 *
 *   cuda: NCCL, loaded at run time (dlopen of libnccl.so.2, or $RNND_NCCL_LIBRARY), so a build
 *         with nccl.h runs single-GPU on hosts without NCCL; ranks may live in several processes
 *         and hosts (the id travels over the caller's own channel: rnnd's rendezvous).
 *   cpu:  ranks are threads of one process that share host memory, or (an id made with a host)
 *         live in several processes and hosts, connected over TCP to rank 0, which must run in
 *         the process that made the id; the sum is taken in rank order. It exists so that the
 *         multi-device and multi-host daemon runs, and is tested, without a GPU.
 *
 * Buffers are backend memory of the rank's own backend (device memory for cuda). Calls block the
 * calling thread until this rank's part is done.
 */
#ifndef RNND_COMM_H
#define RNND_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rnnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RNND_COMM_ID_BYTES 128 // NCCL's ncclUniqueId

// Names one communicator; made by one rank, handed to the others. Opaque.
struct rnnd_comm_id {
    uint8_t bytes[RNND_COMM_ID_BYTES];
};

struct rnnd_comm;

// 0 when b can join communicators (of one process or several), else RNND_ENOTSUP with the
// reason (what to install or change) in why.
int rnnd_comm_supported(const struct rnnd_backend *b, char *why, size_t len);
// A new id for a communicator of nranks ranks on backends like b. host NULL: every rank lives in
// this process. Else ranks may live in other processes and hosts, which reach this one at host
// (a name or address of this machine, as they know it): the cpu backend listens there on a port
// the system picks, and rank 0 must then join from this process; NCCL picks its own interface.
// For cpu the id holds a group (shared state, or the listening socket) that lives until every
// in-process rank has freed its communicator and the maker has called rnnd_comm_id_release
// (which does nothing for cuda): call it once every rank has joined or given up. 0, RNND_ENOMEM,
// RNND_ENOTSUP, RNND_EINVAL (host does not resolve) or RNND_EDEVICE (no socket could be opened:
// the cpu backend's, or NCCL's bootstrap socket).
int rnnd_comm_id_new(const struct rnnd_backend *b, int nranks, const char *host,
                     struct rnnd_comm_id *id);
void rnnd_comm_id_release(const struct rnnd_backend *b, const struct rnnd_comm_id *id);

// Joins communicator id as rank (0 <= rank < nranks) with backend b (borrowed; it must outlive
// the communicator). Blocks until every rank has joined: RNND_EUNAVAIL when they have not within
// timeout_ms. Later collectives fail with RNND_EUNAVAIL when a peer does not join one within the
// same time. *out is freed with rnnd_comm_free.
int rnnd_comm_init(struct rnnd_backend *b, const struct rnnd_comm_id *id, int nranks, int rank,
                   int timeout_ms, struct rnnd_comm **out);
void rnnd_comm_free(struct rnnd_comm *c); // NULL does nothing

int rnnd_comm_rank(const struct rnnd_comm *c);

// buf (n floats) = the sum of every rank's buf, on every rank. 0, RNND_EUNAVAIL (a peer did not
// join in time or is gone: the communicator is then unusable and every later call fails the same
// way), RNND_EDEVICE.
int rnnd_comm_all_reduce(struct rnnd_comm *c, float *buf, size_t n);
// buf (n floats) = root's buf, on every rank. Errors as rnnd_comm_all_reduce.
int rnnd_comm_broadcast(struct rnnd_comm *c, float *buf, size_t n, int root);

// ---------------------------------------------------------------------------------------------
// For the backends' implementations.

struct rnnd_comm_ops {
    int (*all_reduce)(struct rnnd_comm *c, float *buf, size_t n);
    int (*broadcast)(struct rnnd_comm *c, float *buf, size_t n, int root);
    void (*free)(struct rnnd_comm *c);
};

// The first member of every backend's communicator.
struct rnnd_comm {
    const struct rnnd_comm_ops *ops;
    int rank, nranks;
};

int rnnd__cpu_comm_id_new(int nranks, const char *host, struct rnnd_comm_id *id);
void rnnd__cpu_comm_id_release(const struct rnnd_comm_id *id);
int rnnd__cpu_comm_init(const struct rnnd_comm_id *id, int nranks, int rank, int timeout_ms,
                        struct rnnd_comm **out);
int rnnd__cuda_comm_supported(char *why, size_t len);
int rnnd__cuda_comm_id_new(struct rnnd_comm_id *id);
int rnnd__cuda_comm_init(struct rnnd_backend *b, const struct rnnd_comm_id *id, int nranks,
                         int rank, int timeout_ms, struct rnnd_comm **out);

#ifdef __cplusplus
}
#endif

#endif // RNND_COMM_H
