/*
 * comm.c: rnnd_comm.h's entry points, which pick the implementation for the backend (the host one
 * in cpu/comm.c for host-memory backends, NCCL in cuda/comm.cu for cuda), and the calls every
 * communicator shares.
 */
#include "rnnd_comm.h"

#include <stdio.h>
#include <string.h>

static bool is_cpu(const struct rnnd_backend *b) {
    return b && b->ops && (b->ops->caps & RNND_BACKEND_CAP_HOST_MEMORY) != 0;
}

#ifdef RNND_HAVE_CUDA
static bool is_cuda(const struct rnnd_backend *b) {
    return b && b->ops && strcmp(b->ops->name, "cuda") == 0;
}
#endif

int rnnd_comm_supported(const struct rnnd_backend *b, char *why, size_t len) {
    if (is_cpu(b))
        return 0;
#ifdef RNND_HAVE_CUDA
    if (is_cuda(b))
        return rnnd__cuda_comm_supported(why, len);
#endif
    snprintf(why, len, "the %s backend has no collectives", b && b->ops ? b->ops->name : "?");
    return RNND_ENOTSUP;
}

int rnnd_comm_id_new(const struct rnnd_backend *b, int nranks, const char *host,
                     struct rnnd_comm_id *id) {
    if (is_cpu(b))
        return rnnd__cpu_comm_id_new(nranks, host, id);
#ifdef RNND_HAVE_CUDA
    if (is_cuda(b))
        return rnnd__cuda_comm_id_new(id);
#endif
    (void)nranks;
    (void)host;
    (void)id;
    return RNND_ENOTSUP;
}

void rnnd_comm_id_release(const struct rnnd_backend *b, const struct rnnd_comm_id *id) {
    if (is_cpu(b))
        rnnd__cpu_comm_id_release(id);
}

int rnnd_comm_init(struct rnnd_backend *b, const struct rnnd_comm_id *id, int nranks, int rank,
                   int timeout_ms, struct rnnd_comm **out) {
    *out = NULL;
    if (is_cpu(b))
        return rnnd__cpu_comm_init(id, nranks, rank, timeout_ms, out);
#ifdef RNND_HAVE_CUDA
    if (is_cuda(b))
        return rnnd__cuda_comm_init(b, id, nranks, rank, timeout_ms, out);
#endif
    return RNND_ENOTSUP;
}

void rnnd_comm_free(struct rnnd_comm *c) {
    if (c)
        c->ops->free(c);
}

int rnnd_comm_rank(const struct rnnd_comm *c) {
    return c->rank;
}

int rnnd_comm_all_reduce(struct rnnd_comm *c, float *buf, size_t n) {
    if (n == 0)
        return 0;
    return c->ops->all_reduce(c, buf, n);
}

int rnnd_comm_broadcast(struct rnnd_comm *c, float *buf, size_t n, int root) {
    if (n == 0)
        return 0;
    if (root < 0 || root >= c->nranks)
        return RNND_EINVAL;
    return c->ops->broadcast(c, buf, n, root);
}
