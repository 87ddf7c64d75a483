/*
 * checkpoint.c: writing checkpoint directories (see checkpoint.h).
 */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "rnnd_safetensors.h"

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...) {
    if (errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return rc;
}

int rnnd_checkpoint_resolve(const char *state_dir, const char *requested, uint64_t version,
                            char *out, size_t cap, char *err, size_t errlen) {
    if (state_dir == NULL || state_dir[0] == '\0')
        return fail(err, errlen, RNND_EPRECOND,
                    "no --state-dir configured; start rnnd with --state-dir DIR to save "
                    "checkpoints");
    char name[512];
    if (requested == NULL || requested[0] == '\0') {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        struct tm tm;
        gmtime_r(&ts.tv_sec, &tm);
        snprintf(name, sizeof(name), "ckpt-%04d%02d%02dT%02d%02d%02d.%03ldZ-v%llu",
                 tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                 ts.tv_nsec / 1000000, (unsigned long long)version);
        requested = name;
    } else if (requested[0] == '/') {
        size_t n = strlen(state_dir);
        while (n > 1 && state_dir[n - 1] == '/')
            n--;
        if (strncmp(requested, state_dir, n) != 0 || requested[n] != '/')
            return fail(err, errlen, RNND_EINVAL,
                        "path '%s' is outside --state-dir %s; send a name inside it (or empty "
                        "for a new one)",
                        requested, state_dir);
        requested += n;
        while (*requested == '/')
            requested++;
    }
    if (requested[0] == '\0')
        return fail(err, errlen, RNND_EINVAL, "path names --state-dir itself; send a name inside it");
    if (strlen(requested) > 255)
        return fail(err, errlen, RNND_EINVAL, "path is longer than 255 bytes");
    // Each component: no "..", no hidden names (our temporaries start with '.').
    const char *p = requested;
    while (*p) {
        const char *slash = strchr(p, '/');
        size_t len = slash ? (size_t)(slash - p) : strlen(p);
        if (len == 0 || p[0] == '.')
            return fail(err, errlen, RNND_EINVAL,
                        "path '%s' has an empty, '.' or '..' component or a hidden name; send a "
                        "plain name such as \"ckpt-1\"",
                        requested);
        for (size_t i = 0; i < len; i++) {
            unsigned char ch = (unsigned char)p[i];
            if (ch < 0x20 || ch == 0x7f)
                return fail(err, errlen, RNND_EINVAL, "path has a control character");
        }
        p += len;
        if (*p == '/')
            p++;
    }
    if (strchr(requested, '/') != NULL)
        return fail(err, errlen, RNND_EINVAL,
                    "path '%s' has a '/': checkpoints are directories directly inside --state-dir",
                    requested);
    int n = snprintf(out, cap, "%s/%s", state_dir, requested);
    if (n < 0 || (size_t)n >= cap)
        return fail(err, errlen, RNND_EINVAL, "path too long");
    return 0;
}

static int write_file(int dirfd, const char *name, const void *data, size_t len, char *err,
                      size_t errlen) {
    int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return fail(err, errlen, RNND_EIO, "create %s: %s", name, strerror(errno));
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = errno;
            close(fd);
            return fail(err, errlen, RNND_EIO, "write %s: %s", name, strerror(e));
        }
        p += w;
        len -= (size_t)w;
    }
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return fail(err, errlen, RNND_EIO, "fsync %s: %s", name, strerror(e));
    }
    if (close(fd) != 0)
        return fail(err, errlen, RNND_EIO, "close %s: %s", name, strerror(errno));
    return 0;
}

static void remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            char p[RNND_CONFIG_PATH_MAX + 300];
            snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

static int fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

static int encode_parts(const struct rnnd_checkpoint *ck, int dirfd, char *err, size_t errlen) {
    char ver[32], step[32], lr[32], clip[32], seed[32];
    snprintf(ver, sizeof(ver), "%llu", (unsigned long long)ck->model_version);
    snprintf(step, sizeof(step), "%lld", (long long)ck->optim_step);
    snprintf(lr, sizeof(lr), "%.9g", (double)ck->lr);
    snprintf(clip, sizeof(clip), "%.9g", (double)ck->max_grad_norm);
    snprintf(seed, sizeof(seed), "%llu", (unsigned long long)ck->seed);
    const char *opt = ck->optimizer == RNND_OPTIM_SGD ? "sgd" : "adam";
    void *buf = NULL;
    size_t len = 0;
    int rc;

    // model.safetensors
    const char *model_meta[] = {"format", "pt", "rnnd_model_version", ver};
    rc = rnnd_st_encode_params(&ck->model, ck->params, model_meta, 2, &buf, &len);
    if (rc != 0)
        return fail(err, errlen, rc, "encode model.safetensors: %s", rnnd_strerror(rc));
    rc = write_file(dirfd, "model.safetensors", buf, len, err, errlen);
    free(buf);
    if (rc != 0)
        return rc;

    // optimizer.safetensors
    int64_t step_v = ck->optim_step;
    struct rnnd_st_tensor ot[3];
    int no = 0;
    ot[no++] = (struct rnnd_st_tensor){.name = "step", .dtype = RNND_ST_I64, .ndim = 1,
                                       .shape = {1}, .data = &step_v, .bytes = 8};
    if (ck->exp_avg && ck->exp_avg_sq) {
        ot[no++] = (struct rnnd_st_tensor){.name = "exp_avg", .dtype = RNND_ST_F32, .ndim = 1,
                                           .shape = {(int64_t)ck->P}, .data = ck->exp_avg,
                                           .bytes = ck->P * sizeof(float)};
        ot[no++] = (struct rnnd_st_tensor){.name = "exp_avg_sq", .dtype = RNND_ST_F32, .ndim = 1,
                                           .shape = {(int64_t)ck->P}, .data = ck->exp_avg_sq,
                                           .bytes = ck->P * sizeof(float)};
    }
    const char *opt_meta[] = {"optimizer", opt, "lr", lr, "max_grad_norm", clip,
                              "layout", "flat parameter order of model.safetensors"};
    rc = rnnd_st_encode(ot, no, opt_meta, 4, &buf, &len);
    if (rc != 0)
        return fail(err, errlen, rc, "encode optimizer.safetensors: %s", rnnd_strerror(rc));
    rc = write_file(dirfd, "optimizer.safetensors", buf, len, err, errlen);
    free(buf);
    if (rc != 0)
        return rc;

    // envs.safetensors
    int64_t N = ck->n_envs, L = ck->model.L, H = ck->model.H;
    size_t lh = (size_t)(L * H);
    struct rnnd_st_tensor et[5];
    int ne = 0;
    et[ne++] = (struct rnnd_st_tensor){.name = "env_ids", .dtype = RNND_ST_I64, .ndim = 1,
                                       .shape = {N}, .data = ck->env_ids,
                                       .bytes = (size_t)N * 8};
    et[ne++] = (struct rnnd_st_tensor){.name = "h", .dtype = RNND_ST_F32, .ndim = 3,
                                       .shape = {N, L, H}, .data = ck->env_h,
                                       .bytes = (size_t)N * lh * 4};
    if (ck->model.cell == RNND_CELL_LSTM)
        et[ne++] = (struct rnnd_st_tensor){.name = "c", .dtype = RNND_ST_F32, .ndim = 3,
                                           .shape = {N, L, H}, .data = ck->env_c,
                                           .bytes = (size_t)N * lh * 4};
    et[ne++] = (struct rnnd_st_tensor){.name = "last_index", .dtype = RNND_ST_I64, .ndim = 1,
                                       .shape = {N}, .data = ck->last_index,
                                       .bytes = (size_t)N * 8};
    et[ne++] = (struct rnnd_st_tensor){.name = "has_index", .dtype = RNND_ST_U8, .ndim = 1,
                                       .shape = {N}, .data = ck->has_index, .bytes = (size_t)N};
    const char *env_meta[] = {"env_ids", "uint64 bit patterns stored as I64"};
    rc = rnnd_st_encode(et, ne, env_meta, 1, &buf, &len);
    if (rc != 0)
        return fail(err, errlen, rc, "encode envs.safetensors: %s", rnnd_strerror(rc));
    rc = write_file(dirfd, "envs.safetensors", buf, len, err, errlen);
    free(buf);
    if (rc != 0)
        return rc;

    // metadata.json
    char created[64];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    strftime(created, sizeof(created), "%Y-%m-%dT%H:%M:%SZ", &tm);
    char json[2048];
    int n = snprintf(json, sizeof(json),
                     "{\n  \"format\": \"rnnd-checkpoint\",\n  \"format_version\": 1,\n"
                     "  \"cell\": \"%s\",\n  \"input_size\": %d,\n  \"hidden_size\": %d,\n"
                     "  \"num_layers\": %d,\n  \"compute\": \"%s\",\n"
                     "  \"model_version\": %s,\n  \"optimizer\": \"%s\",\n  \"lr\": %s,\n"
                     "  \"max_grad_norm\": %s,\n  \"optimizer_step\": %s,\n"
                     "  \"envs\": %d,\n  \"extras_size\": %d,\n  \"seed\": %s,\n"
                     "  \"created\": \"%s\"\n}\n",
                     rnnd_config_cell_name(ck->model.cell), ck->model.I, ck->model.H,
                     ck->model.L, rnnd_config_compute_name(ck->model.compute), ver, opt, lr, clip,
                     step, ck->n_envs, ck->extras_size, seed, created);
    return write_file(dirfd, "metadata.json", json, (size_t)n, err, errlen);
}

int rnnd_checkpoint_write(const char *dir, const struct rnnd_checkpoint *ck, char *err,
                          size_t errlen) {
    // The temporary sits next to the target: ".<name>.tmp-<pid>".
    char parent[RNND_CONFIG_PATH_MAX], tmp[2 * RNND_CONFIG_PATH_MAX];
    const char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : dir;
    if (slash == NULL)
        snprintf(parent, sizeof(parent), ".");
    else if (slash == dir)
        snprintf(parent, sizeof(parent), "/");
    else
        snprintf(parent, sizeof(parent), "%.*s", (int)(slash - dir), dir);
    snprintf(tmp, sizeof(tmp), "%s/.%s.tmp-%d", parent, base, (int)getpid());
    if (mkdir(parent, 0755) != 0 && errno != EEXIST)
        return fail(err, errlen, RNND_EIO, "mkdir %s: %s", parent, strerror(errno));
    remove_tree(tmp);
    if (mkdir(tmp, 0755) != 0)
        return fail(err, errlen, RNND_EIO, "mkdir %s: %s", tmp, strerror(errno));
    int dirfd = open(tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0) {
        int e = errno;
        remove_tree(tmp);
        return fail(err, errlen, RNND_EIO, "open %s: %s", tmp, strerror(e));
    }
    int rc = encode_parts(ck, dirfd, err, errlen);
    if (rc == 0 && fsync(dirfd) != 0)
        rc = fail(err, errlen, RNND_EIO, "fsync %s: %s", tmp, strerror(errno));
    close(dirfd);
    if (rc != 0) {
        remove_tree(tmp);
        return rc;
    }
    if (rename(tmp, dir) != 0) {
        if (errno != ENOTEMPTY && errno != EEXIST && errno != EISDIR) {
            int e = errno;
            remove_tree(tmp);
            return fail(err, errlen, RNND_EIO, "rename to %s: %s", dir, strerror(e));
        }
        // Replace an existing checkpoint atomically: swap, then drop the old one.
        if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE) != 0) {
            int e = errno;
            remove_tree(tmp);
            return fail(err, errlen, RNND_EIO, "replace %s: %s", dir, strerror(e));
        }
        remove_tree(tmp);
    }
    fsync_path(parent);
    return 0;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int rnnd_checkpoint_prune(const char *state_dir, int keep) {
    DIR *d = opendir(state_dir);
    if (d == NULL)
        return 0;
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, "ckpt-", 5) != 0)
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **p = realloc(names, (size_t)cap * sizeof(*p));
            if (p == NULL)
                break;
            names = p;
        }
        names[n] = strdup(de->d_name);
        if (names[n])
            n++;
    }
    closedir(d);
    // Automatic names embed the UTC time, so they sort oldest first.
    qsort(names, (size_t)n, sizeof(*names), name_cmp);
    int removed = 0;
    for (int i = 0; i < n; i++) {
        if (i < n - keep) {
            char p[2 * RNND_CONFIG_PATH_MAX];
            snprintf(p, sizeof(p), "%s/%s", state_dir, names[i]);
            remove_tree(p);
            removed++;
        }
        free(names[i]);
    }
    free(names);
    return removed;
}
