/*
 * cluster.h: several rnnd instances (hosts) that keep one set of weights: the rendezvous that
 * forms the group and hands every rank the NCCL id, and the control channel that puts every
 * weight update into one order. The protocol is described at the top of cluster.c.
 *
 * The data (gradients, weights) never crosses this channel: it goes over NCCL (the cpu backend:
 * its own TCP connections to rank 0), inside the collective jobs that the commit callback starts
 * on every rank (group.c).
 */
#ifndef RNND_CLUSTER_H
#define RNND_CLUSTER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rnnd_comm.h"

// The weight updates that every rank runs, in one order.
enum rnnd_cluster_op_kind {
    RNND_CLUSTER_APPLY_ACCUMULATED = 1, // ApplyGradients of the accumulated gradients (summed)
    RNND_CLUSTER_APPLY_SENT = 2,        // ApplyGradients of gradients sent to the origin
    RNND_CLUSTER_SET_WEIGHTS = 3,       // SetWeights sent to the origin
};

struct rnnd_cluster_op {
    uint32_t kind;   // enum rnnd_cluster_op_kind
    uint32_t origin; // the rank whose client made the call (its data is broadcast from there)
    uint64_t token;  // the origin's own number for the call
    uint64_t seq;    // the place in the order, given by rank 0 (from 1)
    bool has_lr;
    float lr;
};

struct rnnd_cluster_config {
    int rank, world;           // 0 <= rank < world, world >= 2
    const char *rendezvous;    // HOST:PORT: rank 0 listens there, the others connect
    int timeout_ms;            // how long the ranks wait for each other at start
    uint64_t fingerprint;      // model and devices: the ranks must agree on it
    const _Atomic bool *abort; // optional: start gives up once it reads true
};

// Called on the channel thread, once per op, in the same order on every rank; never after
// rnnd_cluster_free has begun.
typedef void (*rnnd_cluster_commit_cb)(void *ctx, const struct rnnd_cluster_op *op);
// Called once on the channel thread when the group is broken (a peer closed its connection or
// stopped answering); no commit follows. why says which rank and what happened.
typedef void (*rnnd_cluster_lost_cb)(void *ctx, const char *why);

struct rnnd_cluster;

// Forms the group: rank 0 listens and waits for every other rank, the others connect (retrying
// until rank 0 is up). Rank 0 sends *id to every rank; on the others *id receives it. Blocks
// until all ranks have joined; then the channel thread runs. 0, or RNND_EUNAVAIL (timeout,
// abort, refused: a rank that is already there, another world size or model) /
// RNND_EINVAL (bad address) with the reason in err.
int rnnd_cluster_start(const struct rnnd_cluster_config *cfg, struct rnnd_comm_id *id,
                       rnnd_cluster_commit_cb commit, rnnd_cluster_lost_cb lost, void *ctx,
                       struct rnnd_cluster **out, char *err, size_t errlen);
// Puts op (kind, token, has_lr, lr; origin is set here) into the order: its commit comes back
// through the callback, on this rank as on every other. 0, or RNND_EUNAVAIL when the group is
// broken or rank 0 cannot be reached (then no commit comes). Any thread.
int rnnd_cluster_propose(struct rnnd_cluster *cl, struct rnnd_cluster_op *op);
// Leaves the group: closes the connections (the peers see the group end) and ends the thread.
void rnnd_cluster_free(struct rnnd_cluster *cl);
// The HOST of a HOST:PORT address ([v6]:PORT too) into host (len bytes). 0, or RNND_EINVAL
// when addr is not HOST:PORT or the host does not fit.
int rnnd_cluster_host(const char *addr, char *host, size_t len);

#endif // RNND_CLUSTER_H
