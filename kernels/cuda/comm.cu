/*
 * comm.cu: the CUDA backend's communicator (rnnd_comm.h) on NCCL.
 *
 * NCCL is loaded at run time (dlopen), not linked: a build made with nccl.h then runs one GPU on
 * hosts that lack the library, and a host that has it only in PyTorch's wheel
 * (site-packages/nvidia/nccl/lib) can point LD_LIBRARY_PATH or $RNND_NCCL_LIBRARY there. The
 * loaded entry points are process-wide state, set once (pthread_once).
 *
 * Hangs are the failure to design for: a peer that died never joins. So init runs in a helper
 * thread that the caller waits for with a timeout (a late one is abandoned: the daemon exits on
 * a failed start anyway), and a collective is enqueued on the backend's stream and then polled
 * (cudaStreamQuery plus ncclCommGetAsyncError) until it finishes, NCCL reports an error, or the
 * timeout passes; then the communicator is aborted (ncclCommAbort ends its kernels) and every
 * later call fails at once.
 *
 * Built without nccl.h (RNND_HAVE_NCCL unset) the entry points say so and refuse.
 */
#include "common.cuh"
#include "rnnd_comm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef RNND_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

static_assert(sizeof(ncclUniqueId) == RNND_COMM_ID_BYTES, "ncclUniqueId is 128 bytes");

struct nccl_api {
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*CommAbort)(ncclComm_t);
    const char *(*GetErrorString)(ncclResult_t);
};

static struct nccl_api nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_error[512]; // empty once loaded

static void nccl_load(void) {
    // NVLink multicast (NVLS) can take the GPUs of a shared host out of service; rnnd's
    // collectives are small and gain nothing from it. Off unless the operator says otherwise.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    const char *path = getenv("RNND_NCCL_LIBRARY");
    if (path == NULL || path[0] == '\0')
        path = "libnccl.so.2";
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (h == NULL) {
        snprintf(nccl_error, sizeof(nccl_error),
                 "NCCL is not loadable (%s); install NCCL (the CUDA toolkit's or PyTorch's "
                 "nvidia-nccl wheel) and put its lib directory on LD_LIBRARY_PATH, or set "
                 "RNND_NCCL_LIBRARY to libnccl.so.2",
                 dlerror());
        return;
    }
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&nccl.GetVersion, "ncclGetVersion"},
        {(void **)&nccl.GetUniqueId, "ncclGetUniqueId"},
        {(void **)&nccl.CommInitRank, "ncclCommInitRank"},
        {(void **)&nccl.AllReduce, "ncclAllReduce"},
        {(void **)&nccl.Broadcast, "ncclBroadcast"},
        {(void **)&nccl.CommGetAsyncError, "ncclCommGetAsyncError"},
        {(void **)&nccl.CommAbort, "ncclCommAbort"},
        {(void **)&nccl.GetErrorString, "ncclGetErrorString"},
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        *syms[i].slot = dlsym(h, syms[i].name);
        if (*syms[i].slot == NULL) {
            snprintf(nccl_error, sizeof(nccl_error), "%s has no %s: NCCL 2.12 or newer is needed",
                     path, syms[i].name);
            return;
        }
    }
    nccl_error[0] = '\0';
}

static bool nccl_ready(void) {
    pthread_once(&nccl_once, nccl_load);
    return nccl.GetErrorString != NULL && nccl_error[0] == '\0';
}

extern "C" int rnnd__cuda_comm_supported(char *why, size_t len) {
    if (nccl_ready())
        return 0;
    snprintf(why, len, "%s", nccl_error);
    return RNND_ENOTSUP;
}

extern "C" int rnnd__cuda_comm_id_new(struct rnnd_comm_id *id) {
    if (!nccl_ready())
        return RNND_ENOTSUP;
    ncclUniqueId u;
    if (nccl.GetUniqueId(&u) != ncclSuccess)
        return RNND_EDEVICE;
    memcpy(id->bytes, &u, sizeof(u));
    return 0;
}

struct nccl_comm {
    struct rnnd_comm base;
    ncclComm_t comm;
    cudaStream_t stream; // the backend's
    int device;
    int timeout_ms;
    bool broken;
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void comm_break(struct nccl_comm *c) {
    if (c->comm)
        nccl.CommAbort(c->comm);
    c->comm = NULL;
    c->broken = true;
}

// Waits for what was just enqueued on the stream (see the file comment).
static int comm_wait(struct nccl_comm *c) {
    double t0 = now_ms();
    for (long polls = 0;; polls++) {
        cudaError_t e = cudaStreamQuery(c->stream);
        if (e == cudaSuccess)
            return 0;
        if (e != cudaErrorNotReady) {
            comm_break(c);
            return RNND_EDEVICE;
        }
        ncclResult_t ae = ncclSuccess;
        if (nccl.CommGetAsyncError(c->comm, &ae) != ncclSuccess ||
            (ae != ncclSuccess && ae != ncclInProgress)) {
            comm_break(c);
            return RNND_EUNAVAIL;
        }
        if (now_ms() - t0 > c->timeout_ms) {
            comm_break(c);
            return RNND_EUNAVAIL;
        }
        // Spin briefly (a collective between idle GPUs takes tens of microseconds), then sleep.
        if (polls < 2000)
            sched_yield();
        else
            usleep(200);
    }
}

static int enqueued(struct nccl_comm *c, ncclResult_t r) {
    if (r == ncclSuccess || r == ncclInProgress)
        return comm_wait(c);
    bool remote = r == ncclRemoteError || r == ncclSystemError;
    comm_break(c);
    return remote ? RNND_EUNAVAIL : RNND_EDEVICE;
}

static int nccl_all_reduce(struct rnnd_comm *rc, float *buf, size_t n) {
    struct nccl_comm *c = (struct nccl_comm *)rc;
    if (c->broken)
        return RNND_EUNAVAIL;
    RNND_CUDA_TRY(cudaSetDevice(c->device));
    return enqueued(c, nccl.AllReduce(buf, buf, n, ncclFloat32, ncclSum, c->comm, c->stream));
}

static int nccl_broadcast(struct rnnd_comm *rc, float *buf, size_t n, int root) {
    struct nccl_comm *c = (struct nccl_comm *)rc;
    if (c->broken)
        return RNND_EUNAVAIL;
    RNND_CUDA_TRY(cudaSetDevice(c->device));
    return enqueued(c, nccl.Broadcast(buf, buf, n, ncclFloat32, root, c->comm, c->stream));
}

// Abort, not destroy: every collective of ours has finished when it returned, and destroying
// (which finalises with the peers) can wait forever for a peer that is already gone.
static void nccl_comm_free(struct rnnd_comm *rc) {
    struct nccl_comm *c = (struct nccl_comm *)rc;
    if (c->comm) {
        cudaSetDevice(c->device);
        cudaStreamSynchronize(c->stream);
        nccl.CommAbort(c->comm);
    }
    free(c);
}

static const struct rnnd_comm_ops nccl_comm_ops = {
    /* .all_reduce = */ nccl_all_reduce,
    /* .broadcast = */ nccl_broadcast,
    /* .free = */ nccl_comm_free,
};

// ncclCommInitRank in a helper thread, so that the caller can stop waiting.
struct init_call {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ncclUniqueId id;
    int nranks, rank, device;
    ncclComm_t comm;
    ncclResult_t rc;
    bool done, abandoned;
};

static void init_call_free(struct init_call *ic) {
    pthread_mutex_destroy(&ic->mu);
    pthread_cond_destroy(&ic->cv);
    free(ic);
}

static void *init_main(void *arg) {
    struct init_call *ic = (struct init_call *)arg;
    ncclComm_t comm = NULL;
    ncclResult_t rc = ncclUnhandledCudaError;
    if (cudaSetDevice(ic->device) == cudaSuccess)
        rc = nccl.CommInitRank(&comm, ic->nranks, ic->id, ic->rank);
    pthread_mutex_lock(&ic->mu);
    ic->comm = comm;
    ic->rc = rc;
    ic->done = true;
    bool abandoned = ic->abandoned;
    pthread_cond_signal(&ic->cv);
    pthread_mutex_unlock(&ic->mu);
    if (abandoned) { // the caller gave up: nobody will use this communicator
        if (rc == ncclSuccess)
            nccl.CommAbort(comm);
        init_call_free(ic);
    }
    return NULL;
}

extern "C" int rnnd__cuda_comm_init(struct rnnd_backend *b, const struct rnnd_comm_id *id,
                                    int nranks, int rank, int timeout_ms, struct rnnd_comm **out) {
    if (!nccl_ready())
        return RNND_ENOTSUP;
    if (nranks < 1 || rank < 0 || rank >= nranks || timeout_ms < 1)
        return RNND_EINVAL;
    struct cuda_ctx *cx = (struct cuda_ctx *)b->ctx;
    struct nccl_comm *c = (struct nccl_comm *)calloc(1, sizeof(*c));
    struct init_call *ic = (struct init_call *)calloc(1, sizeof(*ic));
    if (c == NULL || ic == NULL) {
        free(c);
        free(ic);
        return RNND_ENOMEM;
    }
    pthread_mutex_init(&ic->mu, NULL);
    pthread_cond_init(&ic->cv, NULL);
    memcpy(&ic->id, id->bytes, sizeof(ic->id));
    ic->nranks = nranks;
    ic->rank = rank;
    ic->device = cx->device;
    pthread_t t;
    if (pthread_create(&t, NULL, init_main, ic) != 0) {
        init_call_free(ic);
        free(c);
        return RNND_ENOMEM;
    }
    pthread_detach(t);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&ic->mu);
    while (!ic->done && pthread_cond_timedwait(&ic->cv, &ic->mu, &dl) == 0) {
    }
    if (!ic->done) {
        ic->abandoned = true; // init_main frees ic
        pthread_mutex_unlock(&ic->mu);
        free(c);
        return RNND_EUNAVAIL;
    }
    pthread_mutex_unlock(&ic->mu);
    ncclResult_t rc = ic->rc;
    c->comm = ic->comm;
    init_call_free(ic);
    if (rc != ncclSuccess) {
        free(c);
        return rc == ncclRemoteError || rc == ncclSystemError ? RNND_EUNAVAIL : RNND_EDEVICE;
    }
    c->base.ops = &nccl_comm_ops;
    c->base.rank = rank;
    c->base.nranks = nranks;
    c->stream = cx->stream;
    c->device = cx->device;
    c->timeout_ms = timeout_ms;
    *out = &c->base;
    return 0;
}

#else // no nccl.h at build time

extern "C" int rnnd__cuda_comm_supported(char *why, size_t len) {
    snprintf(why, len,
             "this rnnd was built without NCCL (nccl.h was not found): one GPU only; rebuild "
             "with NCCL's headers installed for --devices with several GPUs or several hosts");
    return RNND_ENOTSUP;
}

extern "C" int rnnd__cuda_comm_id_new(struct rnnd_comm_id *id) {
    (void)id;
    return RNND_ENOTSUP;
}

extern "C" int rnnd__cuda_comm_init(struct rnnd_backend *b, const struct rnnd_comm_id *id,
                                    int nranks, int rank, int timeout_ms, struct rnnd_comm **out) {
    (void)b;
    (void)id;
    (void)nranks;
    (void)rank;
    (void)timeout_ms;
    *out = NULL;
    return RNND_ENOTSUP;
}

#endif
