/*
 * pool.c: one client over several rnnd instances (rnnd_client_pool.h). Each env is placed on a
 * target by rendezvous hashing of its env id; a Step is split into one part per target, the parts
 * run concurrently and the replies are put back in the request's row order.
 *
 * Only the public API of client.c is used, plus rnnd__client_error_set to report a failure seen on
 * a worker thread as the caller's last error. Tensors are split and joined by rows: a tensor of B
 * rows is B equal slices of nbytes / B bytes, whatever its dtype and trailing dims.
 */
#include "rnnd_client_pool.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client_internal.h"

// ---------------------------------------------------------------------------------------------
// Rendezvous hashing. The constants are part of the contract (rnnd_client_pool.h): the Python
// client computes the same placement.

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME  0x100000001b3ull
#define GOLDEN     0x9e3779b97f4a7c15ull

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t rnnd_rendezvous_target_hash(const char *name) {
    uint64_t h = FNV_OFFSET;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) {
        h ^= *c;
        h *= FNV_PRIME;
    }
    return h;
}

uint64_t rnnd_rendezvous_weight(uint64_t env_id, uint64_t target_hash) {
    return mix64(target_hash ^ mix64(env_id + GOLDEN));
}

size_t rnnd_rendezvous_pick(uint64_t env_id, const uint64_t *target_hashes, size_t n) {
    uint64_t e = mix64(env_id + GOLDEN);
    size_t best = 0;
    uint64_t best_w = mix64(target_hashes[0] ^ e);
    for (size_t i = 1; i < n; i++) {
        uint64_t w = mix64(target_hashes[i] ^ e);
        // Ties go to the smaller target hash, so the order of the targets never matters.
        if (w > best_w || (w == best_w && target_hashes[i] < target_hashes[best])) {
            best = i;
            best_w = w;
        }
    }
    return best;
}

// ---------------------------------------------------------------------------------------------
// Errors.

static int pool_err(int code, int grpc_status, const char *fmt, ...) {
    struct rnnd_client_error e = {.code = code, .grpc_status = grpc_status};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    rnnd__client_error_set(&e);
    return code;
}

static void pool_ok(void) {
    struct rnnd_client_error e = {0};
    rnnd__client_error_set(&e);
}

// Reports a target's failure (err, with the details in e) as the caller's, naming the target.
static int target_err(const char *target, int err, const struct rnnd_client_error *e) {
    return pool_err(err, e->grpc_status, "target %s: %s", target, e->message);
}

// ---------------------------------------------------------------------------------------------
// The pool.

struct rnnd_client_pool {
    size_t n;
    char **targets;               // (n) copies
    uint64_t *hashes;             // (n) rnnd_rendezvous_target_hash of each target
    struct rnnd_client **clients; // (n)
};

int rnnd_client_pool_init(const struct rnnd_client_opts *opts, const char *const *targets, size_t n,
                          struct rnnd_client_pool **out) {
    *out = NULL;
    if (n == 0)
        return pool_err(RNND_EINVAL, -1, "a pool needs at least one target");
    for (size_t i = 0; i < n; i++) {
        if (!targets[i] || !targets[i][0])
            return pool_err(RNND_EINVAL, -1, "target %zu is empty (want HOST:PORT)", i);
        for (size_t j = 0; j < i; j++)
            if (strcmp(targets[i], targets[j]) == 0)
                return pool_err(RNND_EINVAL, -1, "target %s is given twice", targets[i]);
    }
    struct rnnd_client_pool *p = calloc(1, sizeof *p);
    if (!p)
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    p->targets = calloc(n, sizeof *p->targets);
    p->hashes = calloc(n, sizeof *p->hashes);
    p->clients = calloc(n, sizeof *p->clients);
    if (!p->targets || !p->hashes || !p->clients) {
        rnnd_client_pool_free(p);
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    }
    struct rnnd_client_opts o = {0};
    if (opts)
        o = *opts;
    for (size_t i = 0; i < n; i++, p->n++) {
        p->targets[i] = strdup(targets[i]);
        if (!p->targets[i]) {
            rnnd_client_pool_free(p);
            return pool_err(RNND_ENOMEM, -1, "out of memory");
        }
        p->hashes[i] = rnnd_rendezvous_target_hash(targets[i]);
        o.target = targets[i];
        int err = rnnd_client_init(&o, &p->clients[i]);
        if (err) {
            struct rnnd_client_error e = *rnnd_client_last_error();
            p->n++; // free this target's copied name too
            rnnd_client_pool_free(p);
            return target_err(targets[i], err, &e);
        }
    }
    *out = p;
    pool_ok();
    return 0;
}

void rnnd_client_pool_free(struct rnnd_client_pool *p) {
    if (!p)
        return;
    for (size_t i = 0; i < p->n; i++) {
        if (p->clients)
            rnnd_client_free(p->clients[i]);
        if (p->targets)
            free(p->targets[i]);
    }
    free(p->clients);
    free(p->targets);
    free(p->hashes);
    free(p);
}

size_t rnnd_client_pool_size(const struct rnnd_client_pool *p) {
    return p->n;
}

const char *rnnd_client_pool_target(const struct rnnd_client_pool *p, size_t i) {
    return i < p->n ? p->targets[i] : NULL;
}

struct rnnd_client *rnnd_client_pool_client(struct rnnd_client_pool *p, size_t i) {
    return i < p->n ? p->clients[i] : NULL;
}

size_t rnnd_client_pool_pick(const struct rnnd_client_pool *p, uint64_t env_id) {
    return rnnd_rendezvous_pick(env_id, p->hashes, p->n);
}

int rnnd_client_pool_wait_connected(struct rnnd_client_pool *p, int64_t timeout_ms) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t i = 0; i < p->n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        int64_t spent = (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
        int64_t left = timeout_ms - spent;
        int err = rnnd_client_wait_connected(p->clients[i], left > 0 ? left : 0);
        if (err)
            return target_err(p->targets[i], err, rnnd_client_last_error());
    }
    pool_ok();
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Splitting a Step by target, and joining the replies.

struct part {
    size_t target;
    size_t n;     // rows
    size_t *rows; // (n) row indices into the whole request, ascending
    struct rnnd_step_req req;
    // Owned copies of the part's rows (NULL when the part is the whole request).
    uint64_t *env_ids;
    bool *is_init;
    uint64_t *step_index;
    float *reward;
    bool *done, *truncated;
    void *obs, *extras;
    // Results.
    struct rnnd_client *client;
    struct rnnd_step_reply reply;
    int err;
    struct rnnd_client_error error;
};

struct split {
    size_t B;
    size_t n_parts;
    struct part *parts; // (n_parts) in target order
};

static void part_free_req(struct part *pt) {
    free(pt->env_ids);
    free(pt->is_init);
    free(pt->step_index);
    free(pt->reward);
    free(pt->done);
    free(pt->truncated);
    free(pt->obs);
    free(pt->extras);
    pt->env_ids = NULL;
    pt->is_init = NULL;
    pt->step_index = NULL;
    pt->reward = NULL;
    pt->done = pt->truncated = NULL;
    pt->obs = pt->extras = NULL;
}

static void split_free(struct split *sp) {
    if (!sp)
        return;
    for (size_t k = 0; sp->parts && k < sp->n_parts; k++) {
        part_free_req(&sp->parts[k]);
        free(sp->parts[k].rows);
        rnnd_step_reply_free(&sp->parts[k].reply);
    }
    free(sp->parts);
    free(sp);
}

// Bytes per row of t when it holds B rows, or 0 (with a local error) when it does not.
static size_t row_bytes(const struct rnnd_tensor *t, size_t B, const char *what) {
    if (t->ndim < 1 || t->shape[0] != (int64_t)B || t->nbytes % B != 0) {
        pool_err(RNND_EINVAL, -1,
                 "%s has %lld rows (%zu bytes) but the request has %zu env ids: a pool splits "
                 "requests by rows, so send %s as [B, ...] with one row per env id",
                 what, t->ndim < 1 ? -1LL : (long long)t->shape[0], t->nbytes, B, what);
        return 0;
    }
    return t->nbytes / B;
}

// A copy of the rows of t (row bytes rb) listed in rows, as a tensor of n rows over *buf (new).
static int gather_rows(const struct rnnd_tensor *t, size_t rb, const size_t *rows, size_t n,
                       void **buf, struct rnnd_tensor *out) {
    *out = *t;
    *buf = malloc(n * rb > 0 ? n * rb : 1);
    if (!*buf)
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    for (size_t i = 0; i < n; i++)
        memcpy((char *)*buf + i * rb, (const char *)t->data + rows[i] * rb, rb);
    out->shape[0] = (int64_t)n;
    out->nbytes = n * rb;
    out->data = *buf;
    return 0;
}

// Splits req by target into a new *out (free with split_free). A request whose rows all go to
// one target (or that has no rows) becomes one part that points at req itself.
static int split_step(struct rnnd_client_pool *p, const struct rnnd_step_req *req,
                      struct split **out) {
    *out = NULL;
    size_t B = req->n_env_ids;
    if (req->n_is_init != 0 && req->n_is_init != B)
        return pool_err(RNND_EINVAL, -1, "is_init has %zu flags for %zu env ids", req->n_is_init,
                        B);
    if (req->n_step_index != 0 && req->n_step_index != B)
        return pool_err(RNND_EINVAL, -1, "step_index has %zu values for %zu env ids",
                        req->n_step_index, B);
    struct split *sp = calloc(1, sizeof *sp);
    size_t *tgt = malloc((B ? B : 1) * sizeof *tgt);
    size_t *count = calloc(p->n, sizeof *count);
    if (!sp || !tgt || !count) {
        free(sp);
        free(tgt);
        free(count);
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    }
    sp->B = B;
    for (size_t b = 0; b < B; b++) {
        tgt[b] = rnnd_rendezvous_pick(req->env_ids[b], p->hashes, p->n);
        if (count[tgt[b]]++ == 0)
            sp->n_parts++;
    }
    int err = 0;
    if (sp->n_parts <= 1) {
        // The whole request goes to one target, unchanged (an empty one to the first).
        sp->n_parts = 1;
        sp->parts = calloc(1, sizeof *sp->parts);
        if (!sp->parts) {
            err = pool_err(RNND_ENOMEM, -1, "out of memory");
            goto done;
        }
        struct part *pt = &sp->parts[0];
        pt->target = B ? tgt[0] : 0;
        pt->n = B;
        pt->rows = malloc((B ? B : 1) * sizeof *pt->rows);
        if (!pt->rows) {
            err = pool_err(RNND_ENOMEM, -1, "out of memory");
            goto done;
        }
        for (size_t b = 0; b < B; b++)
            pt->rows[b] = b;
        pt->req = *req;
        pt->client = p->clients[pt->target];
        goto done;
    }

    size_t obs_rb = 0, extras_rb = 0;
    if (req->obs.present && !(obs_rb = row_bytes(&req->obs, B, "obs"))) {
        err = RNND_EINVAL;
        goto done;
    }
    if (req->extras.present && !(extras_rb = row_bytes(&req->extras, B, "extras"))) {
        err = RNND_EINVAL;
        goto done;
    }
    sp->parts = calloc(sp->n_parts, sizeof *sp->parts);
    if (!sp->parts) {
        err = pool_err(RNND_ENOMEM, -1, "out of memory");
        goto done;
    }
    // Parts in target order; slot[t] is target t's part.
    size_t *slot = count; // reused: count[t] becomes t's part index once counted
    size_t k = 0;
    for (size_t t = 0; t < p->n; t++) {
        if (!count[t])
            continue;
        struct part *pt = &sp->parts[k];
        pt->target = t;
        pt->client = p->clients[t];
        pt->rows = malloc(count[t] * sizeof *pt->rows);
        if (!pt->rows) {
            err = pool_err(RNND_ENOMEM, -1, "out of memory");
            goto done;
        }
        slot[t] = k++;
    }
    for (size_t b = 0; b < B; b++) {
        struct part *pt = &sp->parts[slot[tgt[b]]];
        pt->rows[pt->n++] = b;
    }
    for (k = 0; k < sp->n_parts; k++) {
        struct part *pt = &sp->parts[k];
        size_t n = pt->n;
        pt->req = *req;
        pt->env_ids = malloc(n * sizeof *pt->env_ids);
        if (!pt->env_ids) {
            err = pool_err(RNND_ENOMEM, -1, "out of memory");
            goto done;
        }
        for (size_t i = 0; i < n; i++)
            pt->env_ids[i] = req->env_ids[pt->rows[i]];
        pt->req.env_ids = pt->env_ids;
        pt->req.n_env_ids = n;
        if (req->n_is_init) {
            pt->is_init = malloc(n * sizeof *pt->is_init);
            if (!pt->is_init) {
                err = pool_err(RNND_ENOMEM, -1, "out of memory");
                goto done;
            }
            for (size_t i = 0; i < n; i++)
                pt->is_init[i] = req->is_init[pt->rows[i]];
            pt->req.is_init = pt->is_init;
            pt->req.n_is_init = n;
        }
        if (req->n_step_index) {
            pt->step_index = malloc(n * sizeof *pt->step_index);
            if (!pt->step_index) {
                err = pool_err(RNND_ENOMEM, -1, "out of memory");
                goto done;
            }
            for (size_t i = 0; i < n; i++)
                pt->step_index[i] = req->step_index[pt->rows[i]];
            pt->req.step_index = pt->step_index;
            pt->req.n_step_index = n;
        }
        // What the previous steps earned goes with their envs' rows.
        if ((req->reward && !(pt->reward = malloc(n * sizeof *pt->reward))) ||
            (req->done && !(pt->done = malloc(n * sizeof *pt->done))) ||
            (req->truncated && !(pt->truncated = malloc(n * sizeof *pt->truncated)))) {
            err = pool_err(RNND_ENOMEM, -1, "out of memory");
            goto done;
        }
        for (size_t i = 0; i < n; i++) {
            if (pt->reward)
                pt->reward[i] = req->reward[pt->rows[i]];
            if (pt->done)
                pt->done[i] = req->done[pt->rows[i]];
            if (pt->truncated)
                pt->truncated[i] = req->truncated[pt->rows[i]];
        }
        pt->req.reward = pt->reward;
        pt->req.done = pt->done;
        pt->req.truncated = pt->truncated;
        if (req->obs.present &&
            (err = gather_rows(&req->obs, obs_rb, pt->rows, n, &pt->obs, &pt->req.obs)))
            goto done;
        if (req->extras.present &&
            (err = gather_rows(&req->extras, extras_rb, pt->rows, n, &pt->extras, &pt->req.extras)))
            goto done;
    }

done:
    free(tgt);
    free(count);
    if (err) {
        split_free(sp);
        return err;
    }
    *out = sp;
    return 0;
}

// Joins the parts' tensor `field` (offset into struct rnnd_step_reply) into out, in row order.
static int join_tensor(const struct split *sp, size_t field, const char *what,
                       struct rnnd_tensor *out) {
    memset(out, 0, sizeof *out);
    const struct rnnd_tensor *first =
        (const struct rnnd_tensor *)((const char *)&sp->parts[0].reply + field);
    if (!first->present)
        return 0;
    size_t rb = 0;
    for (size_t k = 0; k < sp->n_parts; k++) {
        const struct part *pt = &sp->parts[k];
        const struct rnnd_tensor *t =
            (const struct rnnd_tensor *)((const char *)&pt->reply + field);
        bool ok = t->present && t->dtype == first->dtype && t->ndim == first->ndim &&
                  t->ndim >= 1 && t->shape[0] == (int64_t)pt->n;
        for (int d = 1; ok && d < t->ndim; d++)
            ok = t->shape[d] == first->shape[d];
        ok = ok && pt->n && t->nbytes % pt->n == 0 && (k == 0 || t->nbytes / pt->n == rb);
        if (!ok)
            return pool_err(RNND_ECORRUPT, -1,
                            "target %zu's reply has a %s that does not match its %zu rows", k, what,
                            pt->n);
        rb = t->nbytes / pt->n;
    }
    *out = *first;
    out->shape[0] = (int64_t)sp->B;
    out->nbytes = sp->B * rb;
    out->data = malloc(out->nbytes ? out->nbytes : 1);
    if (!out->data) {
        memset(out, 0, sizeof *out);
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    }
    for (size_t k = 0; k < sp->n_parts; k++) {
        const struct part *pt = &sp->parts[k];
        const struct rnnd_tensor *t =
            (const struct rnnd_tensor *)((const char *)&pt->reply + field);
        for (size_t i = 0; i < pt->n; i++)
            memcpy((char *)out->data + pt->rows[i] * rb, (const char *)t->data + i * rb, rb);
    }
    return 0;
}

// Fills *out from the parts' replies (all succeeded).
static int join_step(struct split *sp, struct rnnd_step_reply *out) {
    memset(out, 0, sizeof *out);
    if (sp->n_parts == 1) {
        // One part in request order: its reply is the reply.
        *out = sp->parts[0].reply;
        memset(&sp->parts[0].reply, 0, sizeof sp->parts[0].reply);
        return 0;
    }
    out->model_version = sp->parts[0].reply.model_version;
    for (size_t k = 1; k < sp->n_parts; k++)
        if (sp->parts[k].reply.model_version < out->model_version)
            out->model_version = sp->parts[k].reply.model_version;
#define JOIN(f) join_tensor(sp, offsetof(struct rnnd_step_reply, f), #f, &out->f)
    int err = JOIN(output);
    if (!err)
        err = JOIN(h);
    if (!err)
        err = JOIN(c);
    if (!err)
        err = JOIN(action);
    if (!err)
        err = JOIN(log_prob);
    if (!err)
        err = JOIN(value);
    if (!err)
        err = JOIN(logits);
    if (!err)
        err = JOIN(mean);
#undef JOIN
    if (err)
        rnnd_step_reply_free(out);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Step and EndEpisodes.

static void *part_step(void *arg) {
    struct part *pt = arg;
    pt->err = rnnd_client_step(pt->client, &pt->req, &pt->reply);
    if (pt->err)
        pt->error = *rnnd_client_last_error();
    return NULL;
}

int rnnd_client_pool_step(struct rnnd_client_pool *p, const struct rnnd_step_req *req,
                          struct rnnd_step_reply *out) {
    memset(out, 0, sizeof *out);
    struct split *sp;
    int err = split_step(p, req, &sp);
    if (err)
        return err;
    // Parts 1.. on their own threads, part 0 on this one.
    pthread_t *th = calloc(sp->n_parts, sizeof *th);
    bool *started = calloc(sp->n_parts, sizeof *started);
    for (size_t k = 1; th && started && k < sp->n_parts; k++)
        started[k] = pthread_create(&th[k], NULL, part_step, &sp->parts[k]) == 0;
    for (size_t k = 0; k < sp->n_parts; k++)
        if (!(started && started[k])) // part 0, and any part whose thread did not start
            part_step(&sp->parts[k]);
    for (size_t k = 1; started && k < sp->n_parts; k++)
        if (started[k])
            pthread_join(th[k], NULL);
    free(th);
    free(started);
    for (size_t k = 0; k < sp->n_parts; k++) {
        struct part *pt = &sp->parts[k];
        if (pt->err) {
            err = target_err(p->targets[pt->target], pt->err, &pt->error);
            split_free(sp);
            return err;
        }
    }
    err = join_step(sp, out);
    split_free(sp);
    if (!err)
        pool_ok();
    return err;
}

int rnnd_client_pool_end_episodes(struct rnnd_client_pool *p, const uint64_t *env_ids, size_t n,
                                  uint64_t *released) {
    if (released)
        *released = 0;
    uint64_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids)
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    uint64_t total = 0;
    int err = 0;
    for (size_t t = 0; t < p->n && !err; t++) {
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (rnnd_rendezvous_pick(env_ids[i], p->hashes, p->n) == t)
                ids[m++] = env_ids[i];
        if (m == 0)
            continue;
        uint64_t r = 0;
        err = rnnd_client_end_episodes(p->clients[t], ids, m, &r);
        if (err)
            err = target_err(p->targets[t], err, rnnd_client_last_error());
        total += r;
    }
    free(ids);
    if (err)
        return err;
    if (released)
        *released = total;
    pool_ok();
    return 0;
}

// ---------------------------------------------------------------------------------------------
// StepStream over the pool.

struct rnnd_client_pool_stream {
    struct rnnd_client_pool *p;
    struct rnnd_client_stream **streams; // (p->n) NULL until a request has rows for the target
    // Requests sent and not yet received, oldest first (a ring of cap entries).
    struct split **q;
    size_t head, len, cap;
    bool broken;
};

int rnnd_client_pool_stream_init(struct rnnd_client_pool *p, struct rnnd_client_pool_stream **out) {
    *out = NULL;
    struct rnnd_client_pool_stream *s = calloc(1, sizeof *s);
    if (!s)
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    s->p = p;
    s->streams = calloc(p->n, sizeof *s->streams);
    if (!s->streams) {
        free(s);
        return pool_err(RNND_ENOMEM, -1, "out of memory");
    }
    *out = s;
    pool_ok();
    return 0;
}

static int broken_err(void) {
    return pool_err(RNND_ECANCELED, -1, "the pool stream is broken by an earlier error");
}

int rnnd_client_pool_stream_send(struct rnnd_client_pool_stream *s,
                                 const struct rnnd_step_req *req) {
    if (s->broken)
        return broken_err();
    if (s->len == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 8;
        struct split **q = malloc(cap * sizeof *q);
        if (!q)
            return pool_err(RNND_ENOMEM, -1, "out of memory");
        for (size_t i = 0; i < s->len; i++)
            q[i] = s->q[(s->head + i) % s->cap];
        free(s->q);
        s->q = q;
        s->cap = cap;
        s->head = 0;
    }
    struct split *sp;
    int err = split_step(s->p, req, &sp);
    if (err)
        return err; // nothing was sent: the stream stays usable
    for (size_t k = 0; k < sp->n_parts; k++) {
        struct part *pt = &sp->parts[k];
        struct rnnd_client_stream **st = &s->streams[pt->target];
        if (!*st)
            err = rnnd_client_stream_init(s->p->clients[pt->target], st);
        if (!err)
            err = rnnd_client_stream_send(*st, &pt->req);
        if (err) {
            // Parts already sent would leave the streams out of step: the stream is done.
            s->broken = true;
            err = target_err(s->p->targets[pt->target], err, rnnd_client_last_error());
            split_free(sp);
            return err;
        }
        part_free_req(pt);
        memset(&pt->req, 0, sizeof pt->req); // may point into the caller's request
    }
    s->q[(s->head + s->len++) % s->cap] = sp;
    pool_ok();
    return 0;
}

int rnnd_client_pool_stream_recv(struct rnnd_client_pool_stream *s, struct rnnd_step_reply *out) {
    memset(out, 0, sizeof *out);
    if (s->broken)
        return broken_err();
    if (s->len == 0)
        return pool_err(RNND_EINVAL, -1, "recv with no request in flight");
    struct split *sp = s->q[s->head];
    s->head = (s->head + 1) % s->cap;
    s->len--;
    int err = 0;
    for (size_t k = 0; k < sp->n_parts && !err; k++) {
        struct part *pt = &sp->parts[k];
        err = rnnd_client_stream_recv(s->streams[pt->target], &pt->reply);
        if (err)
            err = target_err(s->p->targets[pt->target], err, rnnd_client_last_error());
    }
    if (!err)
        err = join_step(sp, out);
    if (err)
        s->broken = true;
    else
        pool_ok();
    split_free(sp);
    return err;
}

int rnnd_client_pool_stream_step(struct rnnd_client_pool_stream *s, const struct rnnd_step_req *req,
                                 struct rnnd_step_reply *out) {
    memset(out, 0, sizeof *out);
    int err = rnnd_client_pool_stream_send(s, req);
    return err ? err : rnnd_client_pool_stream_recv(s, out);
}

static void queue_clear(struct rnnd_client_pool_stream *s) {
    for (size_t i = 0; i < s->len; i++)
        split_free(s->q[(s->head + i) % s->cap]);
    s->len = 0;
    s->head = 0;
}

int rnnd_client_pool_stream_close(struct rnnd_client_pool_stream *s) {
    int first = 0;
    struct rnnd_client_error e = {0};
    const char *where = NULL;
    for (size_t t = 0; t < s->p->n; t++) {
        if (!s->streams[t])
            continue;
        int err = rnnd_client_stream_close(s->streams[t]);
        if (err && !first) {
            first = err;
            e = *rnnd_client_last_error();
            where = s->p->targets[t];
        }
    }
    queue_clear(s);
    s->broken = true;
    if (first)
        return target_err(where, first, &e);
    pool_ok();
    return 0;
}

void rnnd_client_pool_stream_free(struct rnnd_client_pool_stream *s) {
    if (!s)
        return;
    for (size_t t = 0; t < s->p->n; t++)
        rnnd_client_stream_free(s->streams[t]);
    queue_clear(s);
    free(s->q);
    free(s->streams);
    free(s);
}
