/*
 * comm.c (cpu): the in-process communicator of rnnd_comm.h. Ranks are threads of one process
 * (one engine each), so a collective is a barrier and plain loads and stores: every rank posts
 * its buffer, each rank sums one chunk of the vector over all ranks in rank order and writes the
 * chunk into every rank's buffer, and a second barrier ends the call. The sum of each element
 * is computed once, so all ranks get the same bits, as with NCCL.
 *
 * The id carries a pointer to the group (it never leaves the process: cross-process use is
 * refused by rnnd_comm_supported). The group is reference-counted: its maker and every rank
 * that joined hold one reference.
 */
#include "rnnd_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CPU_COMM_MAGIC 0x726e6e64637075ull // "rnndcpu"

struct cpu_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int nranks, refs, joined;
    bool broken; // a rank timed out: every later call fails
    int timeout_ms;
    uint64_t gen; // barrier generation
    int arrived;
    float **bufs; // (nranks) the buffers posted for the collective in progress
};

struct cpu_comm {
    struct rnnd_comm base;
    struct cpu_group *g;
};

struct id_layout {
    uint64_t magic;
    struct cpu_group *g;
};

static struct cpu_group *group_of(const struct rnnd_comm_id *id) {
    struct id_layout l;
    memcpy(&l, id->bytes, sizeof(l));
    return l.magic == CPU_COMM_MAGIC ? l.g : NULL;
}

static void group_unref_locked(struct cpu_group *g) {
    if (--g->refs > 0) {
        pthread_mutex_unlock(&g->mu);
        return;
    }
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g->bufs);
    free(g);
}

static void deadline_in(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

int rnnd__cpu_comm_id_new(int nranks, struct rnnd_comm_id *id) {
    if (nranks < 1 || id == NULL)
        return RNND_EINVAL;
    struct cpu_group *g = calloc(1, sizeof(*g));
    float **bufs = calloc((size_t)nranks, sizeof(*bufs));
    if (g == NULL || bufs == NULL) {
        free(g);
        free(bufs);
        return RNND_ENOMEM;
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->nranks = nranks;
    g->refs = 1;
    g->bufs = bufs;
    memset(id, 0, sizeof(*id));
    struct id_layout l = {CPU_COMM_MAGIC, g};
    memcpy(id->bytes, &l, sizeof(l));
    return 0;
}

void rnnd__cpu_comm_id_release(const struct rnnd_comm_id *id) {
    struct cpu_group *g = group_of(id);
    if (g == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    group_unref_locked(g);
}

// Waits until every rank has arrived (under g->mu). 0, or RNND_EUNAVAIL when one did not come
// within the timeout (the group is then broken for good).
static int barrier_locked(struct cpu_group *g) {
    if (g->broken)
        return RNND_EUNAVAIL;
    uint64_t gen = g->gen;
    if (++g->arrived == g->nranks) {
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
        return 0;
    }
    struct timespec dl;
    deadline_in(&dl, g->timeout_ms);
    while (g->gen == gen && !g->broken) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && g->gen == gen) {
            g->broken = true;
            pthread_cond_broadcast(&g->cv);
        }
    }
    return g->gen != gen ? 0 : RNND_EUNAVAIL;
}

static int barrier(struct cpu_group *g) {
    pthread_mutex_lock(&g->mu);
    int rc = barrier_locked(g);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

static int cpu_all_reduce(struct rnnd_comm *c, float *buf, size_t n) {
    struct cpu_group *g = ((struct cpu_comm *)c)->g;
    int N = g->nranks, r = c->rank;
    size_t lo = n * (size_t)r / (size_t)N, hi = n * (size_t)(r + 1) / (size_t)N;
    float *sum = malloc((hi - lo + 1) * sizeof(float));
    pthread_mutex_lock(&g->mu);
    g->bufs[r] = buf;
    int rc = barrier_locked(g);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0 && sum == NULL) {
        // Out of memory: still pass the barriers so the others are not left waiting.
        rc = barrier(g);
        if (rc == 0)
            rc = barrier(g);
        return rc ? rc : RNND_ENOMEM;
    }
    if (rc == 0) {
        for (size_t i = lo; i < hi; i++) {
            float s = 0.0f;
            for (int k = 0; k < N; k++)
                s += g->bufs[k][i];
            sum[i - lo] = s;
        }
        rc = barrier(g); // every rank has read every buffer
    }
    if (rc == 0) {
        for (int k = 0; k < N; k++)
            memcpy(g->bufs[k] + lo, sum, (hi - lo) * sizeof(float));
        rc = barrier(g); // every chunk is written everywhere
    }
    free(sum);
    return rc;
}

static int cpu_broadcast(struct rnnd_comm *c, float *buf, size_t n, int root) {
    struct cpu_group *g = ((struct cpu_comm *)c)->g;
    if (root < 0 || root >= g->nranks)
        return RNND_EINVAL;
    pthread_mutex_lock(&g->mu);
    g->bufs[c->rank] = buf;
    int rc = barrier_locked(g);
    pthread_mutex_unlock(&g->mu);
    if (rc == 0 && c->rank != root)
        memcpy(buf, g->bufs[root], n * sizeof(float));
    if (rc == 0)
        rc = barrier(g); // the root's buffer is read by all before it may change
    return rc;
}

static void cpu_comm_free(struct rnnd_comm *c) {
    struct cpu_group *g = ((struct cpu_comm *)c)->g;
    free(c);
    pthread_mutex_lock(&g->mu);
    group_unref_locked(g);
}

static const struct rnnd_comm_ops cpu_comm_ops = {
    .all_reduce = cpu_all_reduce,
    .broadcast = cpu_broadcast,
    .free = cpu_comm_free,
};

int rnnd__cpu_comm_init(const struct rnnd_comm_id *id, int nranks, int rank, int timeout_ms,
                        struct rnnd_comm **out) {
    struct cpu_group *g = group_of(id);
    *out = NULL;
    if (g == NULL || nranks != g->nranks || rank < 0 || rank >= nranks || timeout_ms < 1)
        return RNND_EINVAL;
    struct cpu_comm *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return RNND_ENOMEM;
    c->base = (struct rnnd_comm){.ops = &cpu_comm_ops, .rank = rank, .nranks = nranks};
    c->g = g;
    pthread_mutex_lock(&g->mu);
    g->refs++;
    g->timeout_ms = timeout_ms;
    if (++g->joined == nranks)
        pthread_cond_broadcast(&g->cv);
    struct timespec dl;
    deadline_in(&dl, timeout_ms);
    while (g->joined < nranks && !g->broken) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && g->joined < nranks) {
            g->broken = true;
            pthread_cond_broadcast(&g->cv);
        }
    }
    if (g->joined < nranks) {
        group_unref_locked(g);
        free(c);
        return RNND_EUNAVAIL;
    }
    pthread_mutex_unlock(&g->mu);
    *out = &c->base;
    return 0;
}
