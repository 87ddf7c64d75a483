/*
 * checkpoint.c: writing, reading, listing and rotating checkpoint directories (see
 * checkpoint.h). Checksums are zlib's crc32 over each file's bytes, computed from the buffer
 * that is written and checked against the buffer that is read.
 */
#include "checkpoint.h"

#include <ctype.h>
#include <dirent.h>
#include <stdbool.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "config.h"
#include "job.h"
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

// The names rnnd gives automatic checkpoints: ckpt-YYYYMMDDTHHMMSS.mmmZ-v<version>.
static bool auto_name(const char *name) {
    const char *form = "ckpt-########T######.###Z-v";
    for (; *form; form++, name++) {
        if (*form == '#' ? *name < '0' || *name > '9' : *name != *form)
            return false;
    }
    if (*name == '\0')
        return false;
    for (; *name; name++)
        if (*name < '0' || *name > '9')
            return false;
    return true;
}

int rnnd_checkpoint_resolve(const char *state_dir, const char *requested, uint64_t version,
                            char *out, size_t cap, char *err, size_t errlen) {
    if (state_dir == NULL || state_dir[0] == '\0')
        return fail(err, errlen, RNND_EPRECOND,
                    "no --state-dir configured; start rnnd with --state-dir DIR to save "
                    "checkpoints");
    char name[512];
    const char *ns = "";
    if (requested == NULL || requested[0] == '\0') {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        struct tm tm;
        gmtime_r(&ts.tv_sec, &tm);
        snprintf(name, sizeof(name), "ckpt-%04d%02d%02dT%02d%02d%02d.%03ldZ-v%llu",
                 tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                 ts.tv_nsec / 1000000, (unsigned long long)version);
        requested = name;
        ns = RNND_CHECKPOINT_AUTO_DIR "/";
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
        return fail(err, errlen, RNND_EINVAL,
                    "path names --state-dir itself; send a name inside it");
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
    // Named checkpoints stay out of the rotation's namespace, so that none is ever rotated away
    // and none is mistaken for an automatic one at start.
    if (ns[0] == '\0' && (strcmp(requested, RNND_CHECKPOINT_AUTO_DIR) == 0 || auto_name(requested)))
        return fail(err, errlen, RNND_EINVAL,
                    "path '%s' is reserved for automatic checkpoints; send another name, or none "
                    "for an automatic checkpoint",
                    requested);
    int n = snprintf(out, cap, "%s/%s%s", state_dir, ns, requested);
    if (n < 0 || (size_t)n >= cap)
        return fail(err, errlen, RNND_EINVAL, "path too long");
    return 0;
}

// What the checksums file lists: every file written so far.
struct sums {
    int n;
    struct {
        const char *name;
        uint32_t crc;
        size_t bytes;
    } e[8];
};

static uint32_t crc_of(const void *data, size_t len) {
    uLong crc = crc32(0L, Z_NULL, 0);
    const Bytef *p = data;
    while (len > 0) { // crc32 takes a uInt length
        uInt chunk = len > (1u << 30) ? (1u << 30) : (uInt)len;
        crc = crc32(crc, p, chunk);
        p += chunk;
        len -= chunk;
    }
    return (uint32_t)crc;
}

// Writes name inside dirfd, mode 0600 whatever the umask, fsynced; adds it to sums.
static int write_file(int dirfd, const char *name, const void *data, size_t len, struct sums *sums,
                      char *err, size_t errlen) {
    int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return fail(err, errlen, RNND_EIO, "create %s: %s", name, strerror(errno));
    if (fchmod(fd, 0600) != 0) {
        int e = errno;
        close(fd);
        return fail(err, errlen, RNND_EIO, "chmod %s: %s", name, strerror(e));
    }
    if (sums) {
        sums->e[sums->n].name = name;
        sums->e[sums->n].crc = crc_of(data, len);
        sums->e[sums->n].bytes = len;
        sums->n++;
    }
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = w < 0 ? errno : ENOSPC;
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

int rnnd__mkdirs(const char *dir) {
    char path[RNND_CONFIG_PATH_MAX + 64];
    int n = snprintf(path, sizeof(path), "%s", dir);
    if (n <= 0 || (size_t)n >= sizeof(path)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    // Each missing component, top down; one that exists is left as it is.
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char c = *p;
        *p = '\0';
        if (mkdir(path, 0700) == 0) {
            if (chmod(path, 0700) != 0)
                return -1;
        } else if (errno != EEXIST) {
            return -1;
        }
        *p = c;
        if (c == '\0')
            break;
    }
    struct stat st;
    if (stat(path, &st) != 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
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
    struct sums sums = {0};
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
    rc = write_file(dirfd, "model.safetensors", buf, len, &sums, err, errlen);
    free(buf);
    if (rc != 0)
        return rc;

    // optimizer.safetensors
    int64_t step_v = ck->optim_step;
    struct rnnd_st_tensor ot[3];
    int no = 0;
    ot[no++] = (struct rnnd_st_tensor){
        .name = "step", .dtype = RNND_ST_I64, .ndim = 1, .shape = {1}, .data = &step_v, .bytes = 8};
    if (ck->exp_avg && ck->exp_avg_sq) {
        ot[no++] = (struct rnnd_st_tensor){.name = "exp_avg",
                                           .dtype = RNND_ST_F32,
                                           .ndim = 1,
                                           .shape = {(int64_t)ck->P},
                                           .data = ck->exp_avg,
                                           .bytes = ck->P * sizeof(float)};
        ot[no++] = (struct rnnd_st_tensor){.name = "exp_avg_sq",
                                           .dtype = RNND_ST_F32,
                                           .ndim = 1,
                                           .shape = {(int64_t)ck->P},
                                           .data = ck->exp_avg_sq,
                                           .bytes = ck->P * sizeof(float)};
    }
    const char *opt_meta[] = {
        "optimizer",     opt,  "lr",     lr,
        "max_grad_norm", clip, "layout", "flat parameter order of model.safetensors"};
    rc = rnnd_st_encode(ot, no, opt_meta, 4, &buf, &len);
    if (rc != 0)
        return fail(err, errlen, rc, "encode optimizer.safetensors: %s", rnnd_strerror(rc));
    rc = write_file(dirfd, "optimizer.safetensors", buf, len, &sums, err, errlen);
    free(buf);
    if (rc != 0)
        return rc;

    // envs.safetensors
    int64_t N = ck->n_envs, L = ck->model.L, H = ck->model.H;
    size_t lh = (size_t)(L * H);
    struct rnnd_st_tensor et[7];
    int64_t OW = H + rnnd_policy_row(&ck->model).W;
    int ne = 0;
    et[ne++] = (struct rnnd_st_tensor){.name = "env_ids",
                                       .dtype = RNND_ST_I64,
                                       .ndim = 1,
                                       .shape = {N},
                                       .data = ck->env_ids,
                                       .bytes = (size_t)N * 8};
    et[ne++] = (struct rnnd_st_tensor){.name = "h",
                                       .dtype = RNND_ST_F32,
                                       .ndim = 3,
                                       .shape = {N, L, H},
                                       .data = ck->env_h,
                                       .bytes = (size_t)N * lh * 4};
    if (ck->model.cell == RNND_CELL_LSTM)
        et[ne++] = (struct rnnd_st_tensor){.name = "c",
                                           .dtype = RNND_ST_F32,
                                           .ndim = 3,
                                           .shape = {N, L, H},
                                           .data = ck->env_c,
                                           .bytes = (size_t)N * lh * 4};
    et[ne++] = (struct rnnd_st_tensor){.name = "last_index",
                                       .dtype = RNND_ST_I64,
                                       .ndim = 1,
                                       .shape = {N},
                                       .data = ck->last_index,
                                       .bytes = (size_t)N * 8};
    et[ne++] = (struct rnnd_st_tensor){.name = "has_index",
                                       .dtype = RNND_ST_U8,
                                       .ndim = 1,
                                       .shape = {N},
                                       .data = ck->has_index,
                                       .bytes = (size_t)N};
    if (ck->last_output)
        et[ne++] = (struct rnnd_st_tensor){.name = "last_output",
                                           .dtype = RNND_ST_F32,
                                           .ndim = 2,
                                           .shape = {N, OW},
                                           .data = ck->last_output,
                                           .bytes = (size_t)(N * OW) * 4};
    if (ck->step_count)
        et[ne++] = (struct rnnd_st_tensor){.name = "step_count",
                                           .dtype = RNND_ST_I64,
                                           .ndim = 1,
                                           .shape = {N},
                                           .data = ck->step_count,
                                           .bytes = (size_t)N * 8};
    const char *env_meta[] = {"env_ids", "uint64 bit patterns stored as I64"};
    rc = rnnd_st_encode(et, ne, env_meta, 1, &buf, &len);
    if (rc != 0)
        return fail(err, errlen, rc, "encode envs.safetensors: %s", rnnd_strerror(rc));
    rc = write_file(dirfd, "envs.safetensors", buf, len, &sums, err, errlen);
    free(buf);
    if (rc != 0)
        return rc;

    // trajectories.safetensors
    if (ck->traj_count) {
        int64_t R = ck->traj_rows, I = ck->model.I, E = ck->extras_size;
        struct rnnd_st_tensor tt[10];
        int nt = 0;
        tt[nt++] = (struct rnnd_st_tensor){.name = "count",
                                           .dtype = RNND_ST_I64,
                                           .ndim = 1,
                                           .shape = {N},
                                           .data = ck->traj_count,
                                           .bytes = (size_t)N * 8};
        tt[nt++] = (struct rnnd_st_tensor){.name = "obs",
                                           .dtype = RNND_ST_F32,
                                           .ndim = 2,
                                           .shape = {R, I},
                                           .data = ck->traj_obs,
                                           .bytes = (size_t)(R * I) * 4};
        tt[nt++] = (struct rnnd_st_tensor){.name = "is_init",
                                           .dtype = RNND_ST_U8,
                                           .ndim = 1,
                                           .shape = {R},
                                           .data = ck->traj_is_init,
                                           .bytes = (size_t)R};
        if (E > 0)
            tt[nt++] = (struct rnnd_st_tensor){.name = "extras",
                                               .dtype = RNND_ST_F32,
                                               .ndim = 2,
                                               .shape = {R, E},
                                               .data = ck->traj_extras,
                                               .bytes = (size_t)(R * E) * 4};
        tt[nt++] = (struct rnnd_st_tensor){.name = "version",
                                           .dtype = RNND_ST_I64,
                                           .ndim = 1,
                                           .shape = {R},
                                           .data = ck->traj_version,
                                           .bytes = (size_t)R * 8};
        tt[nt++] = (struct rnnd_st_tensor){.name = "h",
                                           .dtype = RNND_ST_F32,
                                           .ndim = 3,
                                           .shape = {R, L, H},
                                           .data = ck->traj_h,
                                           .bytes = (size_t)R * lh * 4};
        if (ck->model.cell == RNND_CELL_LSTM)
            tt[nt++] = (struct rnnd_st_tensor){.name = "c",
                                               .dtype = RNND_ST_F32,
                                               .ndim = 3,
                                               .shape = {R, L, H},
                                               .data = ck->traj_c,
                                               .bytes = (size_t)R * lh * 4};
        struct rnnd_policy_row pr = rnnd_policy_row(&ck->model);
        int64_t PW = pr.W - pr.ndist + 1;
        if (ck->traj_policy) {
            tt[nt++] = (struct rnnd_st_tensor){.name = "policy_record",
                                               .dtype = RNND_ST_F32,
                                               .ndim = 2,
                                               .shape = {R, PW},
                                               .data = ck->traj_policy,
                                               .bytes = (size_t)(R * PW) * 4};
            tt[nt++] = (struct rnnd_st_tensor){.name = "policy_flags",
                                               .dtype = RNND_ST_U8,
                                               .ndim = 1,
                                               .shape = {R},
                                               .data = ck->traj_policy_flags,
                                               .bytes = (size_t)R};
        }
        if (ck->traj_cursor)
            tt[nt++] = (struct rnnd_st_tensor){.name = "cursor",
                                               .dtype = RNND_ST_I64,
                                               .ndim = 2,
                                               .shape = {N, 2},
                                               .data = ck->traj_cursor,
                                               .bytes = (size_t)N * 16};
        const char *traj_meta[] = {"layout",
                                   "rows of every env in envs.safetensors order, count[i] each, "
                                   "oldest first; h/c: the state before the step"};
        rc = rnnd_st_encode(tt, nt, traj_meta, 1, &buf, &len);
        if (rc != 0)
            return fail(err, errlen, rc, "encode trajectories.safetensors: %s", rnnd_strerror(rc));
        rc = write_file(dirfd, "trajectories.safetensors", buf, len, &sums, err, errlen);
        free(buf);
        if (rc != 0)
            return rc;
    }

    // metadata.json
    char created[64];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    strftime(created, sizeof(created), "%Y-%m-%dT%H:%M:%SZ", &tm);
    char json[2048];
    int n =
        snprintf(json, sizeof(json),
                 "{\n  \"format\": \"rnnd-checkpoint\",\n  \"format_version\": 1,\n"
                 "  \"cell\": \"%s\",\n  \"input_size\": %d,\n  \"hidden_size\": %d,\n"
                 "  \"num_layers\": %d,\n  \"compute\": \"%s\",\n"
                 "  \"model_version\": %s,\n  \"optimizer\": \"%s\",\n  \"lr\": %s,\n"
                 "  \"max_grad_norm\": %s,\n  \"optimizer_step\": %s,\n"
                 "  \"envs\": %d,\n  \"extras_size\": %d,\n  \"seed\": %s,\n"
                 "  \"devices\": %d,\n  \"place_block\": %d,\n"
                 "  \"created\": \"%s\",\n  \"created_unix_ms\": %lld\n}\n",
                 rnnd_config_cell_name(ck->model.cell), ck->model.I, ck->model.H, ck->model.L,
                 rnnd_config_compute_name(ck->model.compute), ver, opt, lr, clip, step, ck->n_envs,
                 ck->extras_size, seed, ck->devices, ck->place_block > 1 ? ck->place_block : 1,
                 created, (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
    rc = write_file(dirfd, "metadata.json", json, (size_t)n, &sums, err, errlen);
    if (rc != 0)
        return rc;

    // checksums, last: a reader checks every file above against it.
    char list[8 * 96];
    size_t at = 0;
    for (int i = 0; i < sums.n; i++)
        at += (size_t)snprintf(list + at, sizeof(list) - at, "%08" PRIx32 " %zu %s\n",
                               sums.e[i].crc, sums.e[i].bytes, sums.e[i].name);
    return write_file(dirfd, "checksums", list, at, NULL, err, errlen);
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
    if (rnnd__mkdirs(parent) != 0)
        return fail(err, errlen, RNND_EIO, "mkdir %s: %s", parent, strerror(errno));
    remove_tree(tmp);
    if (mkdir(tmp, 0700) != 0)
        return fail(err, errlen, RNND_EIO, "mkdir %s: %s", tmp, strerror(errno));
    int dirfd = open(tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0 || fchmod(dirfd, 0700) != 0) {
        int e = errno;
        if (dirfd >= 0)
            close(dirfd);
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

// ---------------------------------------------------------------------------------------------
// Reading

// Reads path into a new buffer. 0, RNND_ENOTFOUND when it does not exist, RNND_EIO otherwise.
static int slurp(const char *path, void **out, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? RNND_ENOTFOUND
                               : fail(err, errlen, RNND_EIO, "open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < 0) {
        close(fd);
        return fail(err, errlen, RNND_EIO, "stat %s: %s", path, strerror(errno));
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n ? n : 1);
    if (buf == NULL) {
        close(fd);
        return fail(err, errlen, RNND_ENOMEM, "out of memory reading %s", path);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (got != n) {
        free(buf);
        return fail(err, errlen, RNND_EIO, "read %s: short read", path);
    }
    *out = buf;
    *len = n;
    return 0;
}

// The files a checkpoint holds, and what a checkpoint missing one has lost.
static const struct part {
    const char *name, *holds;
} parts[] = {
    {"model.safetensors", "the weights"}, {"optimizer.safetensors", "optimizer moments and step"},
    {"envs.safetensors", "env states"},   {"trajectories.safetensors", "recorded steps"},
    {"metadata.json", "creation time"},
};
#define NPARTS (sizeof(parts) / sizeof(parts[0]))

// A checkpoint's checksums file, parsed.
struct manifest {
    bool present;
    int n;
    struct {
        const char *name; // one of parts[]
        uint32_t crc;
        size_t bytes;
    } e[NPARTS];
};

// Reads dir/checksums into *mf (mf->present false when there is none). Lines are
// "CRC32 BYTES NAME": 8 hex digits, a decimal size and one of parts[], each at most once.
static int manifest_read(const char *dir, struct manifest *mf, char *err, size_t errlen) {
    memset(mf, 0, sizeof(*mf));
    char path[2 * RNND_CONFIG_PATH_MAX];
    snprintf(path, sizeof(path), "%s/checksums", dir);
    void *buf;
    size_t len;
    int rc = slurp(path, &buf, &len, err, errlen);
    if (rc == RNND_ENOTFOUND)
        return 0;
    if (rc != 0)
        return rc;
    mf->present = true;
    const char *p = buf, *end = p + len;
    for (int line = 1; rc == 0 && p < end; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        char l[128], name[64];
        size_t ll = nl ? (size_t)(nl - p) : 0;
        unsigned crc;
        size_t bytes;
        int used = -1;
        bool ok = nl && ll < sizeof(l);
        if (ok) {
            memcpy(l, p, ll);
            l[ll] = '\0';
            for (int i = 0; i < 8; i++)
                ok = ok && isxdigit((unsigned char)l[i]);
            ok = ok && l[8] == ' ' && l[9] >= '0' && l[9] <= '9' &&
                 sscanf(l, "%8x %zu %63s%n", &crc, &bytes, name, &used) == 3 && used == (int)ll;
        }
        if (!ok) {
            rc = fail(err, errlen, RNND_ECORRUPT,
                      "checksums: line %d is not \"CRC32 BYTES NAME\": the file is damaged", line);
            break;
        }
        size_t k = 0;
        while (k < NPARTS && strcmp(parts[k].name, name) != 0)
            k++;
        for (int i = 0; i < mf->n && k < NPARTS; i++)
            if (mf->e[i].name == parts[k].name)
                k = NPARTS;
        if (k == NPARTS) {
            rc = fail(err, errlen, RNND_ECORRUPT,
                      "checksums: line %d names '%s', not a checkpoint file or one listed twice: "
                      "the file is damaged",
                      line, name);
            break;
        }
        mf->e[mf->n].name = parts[k].name;
        mf->e[mf->n].crc = (uint32_t)crc;
        mf->e[mf->n].bytes = bytes;
        mf->n++;
        p = nl + 1;
    }
    free(buf);
    return rc;
}

static bool manifest_lists(const struct manifest *mf, const char *name) {
    for (int i = 0; i < mf->n; i++)
        if (strcmp(mf->e[i].name, name) == 0)
            return true;
    return false;
}

// Checks the len bytes read from file name against the checksums file, when there is one.
static int manifest_check(const struct manifest *mf, const char *name, const void *buf, size_t len,
                          char *err, size_t errlen) {
    if (mf == NULL || !mf->present)
        return 0;
    for (int i = 0; i < mf->n; i++) {
        if (strcmp(mf->e[i].name, name) != 0)
            continue;
        uint32_t crc = crc_of(buf, len);
        if (len != mf->e[i].bytes || crc != mf->e[i].crc)
            return fail(err, errlen, RNND_ECORRUPT,
                        "%s: %zu bytes with crc32 %08" PRIx32 ", but checksums says %zu bytes "
                        "with crc32 %08" PRIx32 ": the file is damaged",
                        name, len, crc, mf->e[i].bytes, mf->e[i].crc);
        return 0;
    }
    return fail(err, errlen, RNND_ECORRUPT,
                "%s is not listed in checksums: the checkpoint is damaged", name);
}

// Refuses NaN and Inf in the float tensors of f (read from file name), naming the first one:
// restored, one would turn every output it reaches into NaN.
static int finite_check(const struct rnnd_st_file *f, const char *name, char *err, size_t errlen) {
    for (int t = 0; t < f->n; t++) {
        const struct rnnd_st_tensor *x = &f->tensors[t];
        if (x->dtype != RNND_ST_F32)
            continue;
        size_t n = x->bytes / 4, i = rnnd_first_nonfinite(x->data, RNND_FTYPE_F32, n);
        if (i == n)
            continue;
        uint32_t bits;
        memcpy(&bits, (const uint8_t *)x->data + 4 * i, 4);
        return fail(err, errlen, RNND_ECORRUPT,
                    "%s: %s holds %s at flat index %zu; only finite values can be loaded", name,
                    x->name,
                    (bits & 0x007fffffu) ? "NaN"
                    : (bits >> 31)       ? "-Inf"
                                         : "Inf",
                    i);
    }
    return 0;
}

// The value after "key": in a JSON text, or NULL (metadata.json is written by us, flat).
static const char *json_value(const char *text, const char *key) {
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *v = strstr(text, pat);
    if (v == NULL)
        return NULL;
    v += strlen(pat);
    while (*v == ' ')
        v++;
    return v;
}

// Reads dir/name, checked against mf (may be NULL). 0, RNND_ENOTFOUND (missing) or an error
// naming the file. dir NULL: name is the file's path.
static int read_checked(const char *dir, const char *name, const struct manifest *mf, void **buf,
                        size_t *len, char *err, size_t errlen) {
    char path[2 * RNND_CONFIG_PATH_MAX];
    snprintf(path, sizeof(path), "%s%s%s", dir ? dir : "", dir ? "/" : "", name);
    int rc = slurp(path, buf, len, err, errlen);
    if (rc != 0)
        return rc;
    rc = manifest_check(mf, name, *buf, *len, err, errlen);
    if (rc != 0) {
        free(*buf);
        *buf = NULL;
    }
    return rc;
}

// Reads and decodes dir/name as read_checked does; every float in it must be finite.
static int read_st(const char *dir, const char *name, const struct manifest *mf, void **buf,
                   struct rnnd_st_file *f, char *err, size_t errlen) {
    size_t len;
    int rc = read_checked(dir, name, mf, buf, &len, err, errlen);
    if (rc != 0)
        return rc;
    char why[256];
    rc = rnnd_st_decode(*buf, len, f, why, sizeof(why));
    if (rc != 0)
        rc = fail(err, errlen, rc == RNND_ENOMEM ? rc : RNND_ECORRUPT, "%s: %s", name,
                  rc == RNND_ENOMEM ? "out of memory" : why);
    else
        rc = finite_check(f, name, err, errlen);
    if (rc != 0) {
        rnnd_st_file_free(f);
        free(*buf);
        *buf = NULL;
    }
    return rc;
}

static const struct rnnd_st_tensor *want_tensor(const struct rnnd_st_file *f, const char *name,
                                                enum rnnd_st_dtype dt, int ndim,
                                                const int64_t *shape) {
    const struct rnnd_st_tensor *t = rnnd_st_find(f, name);
    if (t == NULL || t->dtype != dt || t->ndim != ndim)
        return NULL;
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] != shape[i])
            return NULL;
    return t;
}

void rnnd_checkpoint_data_free(struct rnnd_checkpoint_data *d) {
    if (d == NULL)
        return;
    for (size_t i = 0; i < sizeof(d->mem) / sizeof(d->mem[0]); i++)
        free(d->mem[i]);
    memset(d, 0, sizeof(*d));
}

static void *keep(struct rnnd_checkpoint_data *d, size_t bytes) {
    for (size_t i = 0; i < sizeof(d->mem) / sizeof(d->mem[0]); i++) {
        if (d->mem[i] == NULL) {
            d->mem[i] = malloc(bytes ? bytes : 1);
            return d->mem[i];
        }
    }
    return NULL;
}

// Adds name (with what it holds) to d->lost when it is missing from a checkpoint that should
// have it: one whose checksums file lists it or, without checksums, expected (every checkpoint
// rnnd writes holds it).
static void lost_note(struct rnnd_checkpoint_data *d, const struct manifest *mf, const char *name,
                      bool expected) {
    if (mf->present ? !manifest_lists(mf, name) : !expected)
        return;
    for (size_t k = 0; k < NPARTS; k++) {
        if (strcmp(parts[k].name, name) != 0)
            continue;
        size_t at = strlen(d->lost);
        snprintf(d->lost + at, sizeof(d->lost) - at, "%s%s (%s)", at ? ", " : "", name,
                 parts[k].holds);
    }
}

// Checks trajectories.safetensors (f) against the envs already read into d and copies it.
static int read_trajectories(struct rnnd_checkpoint_data *d, const struct rnnd_st_file *f,
                             char *err, size_t errlen) {
    struct rnnd_checkpoint *ck = &d->ck;
    int64_t N = ck->n_envs, I = ck->model.I, L = ck->model.L, H = ck->model.H;
    int64_t s1[1] = {N};
    const struct rnnd_st_tensor *cnt = want_tensor(f, "count", RNND_ST_I64, 1, s1);
    if (cnt == NULL)
        return fail(err, errlen, RNND_ECORRUPT,
                    "trajectories.safetensors: expected I64 'count' [%lld], one per env of "
                    "envs.safetensors",
                    (long long)N);
    int64_t *count = keep(d, (size_t)N * 8);
    if (count == NULL)
        return fail(err, errlen, RNND_ENOMEM, "out of memory");
    memcpy(count, cnt->data, (size_t)N * 8);
    int64_t R = 0;
    for (int64_t i = 0; i < N; i++) {
        if (count[i] < 0 || count[i] > INT32_MAX || R > INT64_MAX / 2)
            return fail(err, errlen, RNND_ECORRUPT,
                        "trajectories.safetensors: count[%lld] = %lld is out of range",
                        (long long)i, (long long)count[i]);
        R += count[i];
    }
    const struct rnnd_st_tensor *obs = rnnd_st_find(f, "obs");
    const struct rnnd_st_tensor *ex = rnnd_st_find(f, "extras");
    int64_t E = ex && ex->ndim == 2 ? ex->shape[1] : 0;
    int64_t so[2] = {R, I}, se[2] = {R, E}, s3[3] = {R, L, H}, sr[1] = {R};
    obs = want_tensor(f, "obs", RNND_ST_F32, 2, so);
    ex = E > 0 ? want_tensor(f, "extras", RNND_ST_F32, 2, se) : NULL;
    const struct rnnd_st_tensor *ini = want_tensor(f, "is_init", RNND_ST_U8, 1, sr);
    const struct rnnd_st_tensor *ver = want_tensor(f, "version", RNND_ST_I64, 1, sr);
    const struct rnnd_st_tensor *h = want_tensor(f, "h", RNND_ST_F32, 3, s3);
    bool lstm = ck->model.cell == RNND_CELL_LSTM;
    const struct rnnd_st_tensor *c = lstm ? want_tensor(f, "c", RNND_ST_F32, 3, s3) : NULL;
    if (!obs || !ini || !ver || !h || (lstm && !c) || (rnnd_st_find(f, "extras") && !ex) ||
        E > INT32_MAX)
        return fail(err, errlen, RNND_ECORRUPT,
                    "trajectories.safetensors: expected obs [%lld, %lld], is_init and version "
                    "[%lld], h%s [%lld, %lld, %lld] for the %lld rows that count adds up to",
                    (long long)R, (long long)I, (long long)R, lstm ? " and c" : "", (long long)R,
                    (long long)L, (long long)H, (long long)R);
    size_t r = (size_t)R, lh = (size_t)(L * H);
    float *obs_v = keep(d, r * (size_t)I * 4), *h_v = keep(d, r * lh * 4);
    float *c_v = lstm ? keep(d, r * lh * 4) : NULL, *ex_v = E ? keep(d, r * (size_t)E * 4) : NULL;
    uint8_t *ini_v = keep(d, r);
    uint64_t *ver_v = keep(d, r * 8);
    if (!obs_v || !h_v || (lstm && !c_v) || (E && !ex_v) || !ini_v || !ver_v)
        return fail(err, errlen, RNND_ENOMEM, "out of memory");
    memcpy(obs_v, obs->data, r * (size_t)I * 4);
    memcpy(h_v, h->data, r * lh * 4);
    if (c_v)
        memcpy(c_v, c->data, r * lh * 4);
    if (ex_v)
        memcpy(ex_v, ex->data, r * (size_t)E * 4);
    memcpy(ini_v, ini->data, r);
    memcpy(ver_v, ver->data, r * 8);
    // A policy's record (optional: absent, the recorded steps have none).
    struct rnnd_policy_row pr = rnnd_policy_row(&ck->model);
    int64_t sp[2] = {R, pr.W - pr.ndist + 1};
    const struct rnnd_st_tensor *prec =
        pr.W ? want_tensor(f, "policy_record", RNND_ST_F32, 2, sp) : NULL;
    const struct rnnd_st_tensor *pfl =
        prec ? want_tensor(f, "policy_flags", RNND_ST_U8, 1, sr) : NULL;
    if (prec && pfl) {
        float *pv = keep(d, r * (size_t)sp[1] * 4);
        uint8_t *fv = keep(d, r);
        if (!pv || !fv)
            return fail(err, errlen, RNND_ENOMEM, "out of memory");
        memcpy(pv, prec->data, r * (size_t)sp[1] * 4);
        memcpy(fv, pfl->data, r);
        ck->traj_policy = pv;
        ck->traj_policy_flags = fv;
    }
    // Each env's recorded total and cursor (optional: absent, cursors start at the oldest step).
    int64_t sc[2] = {N, 2};
    const struct rnnd_st_tensor *cur = want_tensor(f, "cursor", RNND_ST_I64, 2, sc);
    if (cur) {
        uint64_t *cv = keep(d, (size_t)N * 16 + 1);
        if (cv == NULL)
            return fail(err, errlen, RNND_ENOMEM, "out of memory");
        memcpy(cv, cur->data, (size_t)N * 16);
        for (int64_t i = 0; i < N; i++)
            if (cv[2 * i] < (uint64_t)count[i] || cv[2 * i + 1] > cv[2 * i])
                return fail(err, errlen, RNND_ECORRUPT,
                            "trajectories.safetensors: cursor[%lld] = (%llu, %llu) does not fit "
                            "its %lld recorded steps",
                            (long long)i, (unsigned long long)cv[2 * i],
                            (unsigned long long)cv[2 * i + 1], (long long)count[i]);
        ck->traj_cursor = cv;
    }
    ck->traj_count = count;
    ck->traj_rows = R;
    ck->traj_obs = obs_v;
    ck->traj_is_init = ini_v;
    ck->traj_extras = ex_v;
    ck->traj_version = ver_v;
    ck->traj_h = h_v;
    ck->traj_c = c_v;
    ck->extras_size = (int)E;
    return 0;
}

int rnnd_checkpoint_read(const char *dir, const struct rnnd_model *m,
                         struct rnnd_checkpoint_data *out, char *err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    struct rnnd_checkpoint *ck = &out->ck;
    ck->model = *m;
    ck->P = rnnd_model_param_count(m);
    struct manifest mf;
    int rc = manifest_read(dir, &mf, err, errlen);
    if (rc != 0)
        return rc;
    out->verified = mf.present;
    void *buf = NULL;
    size_t len;
    struct rnnd_st_file f = {0};
    rc = read_st(dir, "model.safetensors", &mf, &buf, &f, err, errlen);
    if (rc == RNND_ENOTFOUND)
        return fail(err, errlen, RNND_ECORRUPT, "model.safetensors is missing");
    if (rc != 0)
        return rc;
    float *params = keep(out, ck->P * sizeof(float));
    if (params == NULL) {
        rc = fail(err, errlen, RNND_ENOMEM, "out of memory");
        goto done;
    }
    char why[256];
    rc = rnnd_st_decode_params(m, &f, params, why, sizeof(why));
    if (rc != 0) {
        rc = fail(err, errlen, RNND_EINVAL,
                  "model.safetensors does not fit this daemon's %s I=%d H=%d L=%d: %s",
                  rnnd_config_cell_name(m->cell), m->I, m->H, m->L, why);
        goto done;
    }
    ck->params = params;
    const char *ver = rnnd_st_meta(&f, "rnnd_model_version");
    ck->model_version = ver ? strtoull(ver, NULL, 10) : 0;
    rnnd_st_file_free(&f);
    free(buf);
    buf = NULL;

    // metadata.json: when it was written and where the envs were placed
    ck->devices = 0;
    ck->place_block = 1;
    rc = read_checked(dir, "metadata.json", &mf, &buf, &len, err, errlen);
    if (rc == RNND_ENOTFOUND) {
        lost_note(out, &mf, "metadata.json", false);
    } else if (rc != 0) {
        goto done;
    } else {
        char *text = realloc(buf, len + 1);
        if (text == NULL) {
            rc = fail(err, errlen, RNND_ENOMEM, "out of memory reading metadata.json");
            goto done;
        }
        buf = text;
        text[len] = '\0';
        const char *v = json_value(text, "created_unix_ms");
        ck->created_unix_ms = v ? strtoll(v, NULL, 10) : 0;
        v = json_value(text, "devices");
        ck->devices = v ? atoi(v) : 0;
        v = json_value(text, "place_block");
        ck->place_block = v ? atoi(v) : 1;
        if (ck->devices < 0 || ck->place_block < 1) {
            rc = fail(err, errlen, RNND_ECORRUPT,
                      "metadata.json: devices %d / place_block %d out of range", ck->devices,
                      ck->place_block);
            goto done;
        }
    }
    free(buf);
    buf = NULL;

    // optimizer.safetensors (optional)
    rc = read_st(dir, "optimizer.safetensors", &mf, &buf, &f, err, errlen);
    if (rc == 0) {
        out->has_optimizer = true;
        const char *opt = rnnd_st_meta(&f, "optimizer");
        snprintf(out->optimizer, sizeof(out->optimizer), "%s", opt ? opt : "");
        int64_t one = 1, P = (int64_t)ck->P;
        const struct rnnd_st_tensor *step = want_tensor(&f, "step", RNND_ST_I64, 1, &one);
        if (step == NULL) {
            rc = fail(err, errlen, RNND_ECORRUPT, "optimizer.safetensors: no I64 [1] 'step'");
            goto done;
        }
        memcpy(&ck->optim_step, step->data, 8);
        const struct rnnd_st_tensor *ma = want_tensor(&f, "exp_avg", RNND_ST_F32, 1, &P);
        const struct rnnd_st_tensor *va = want_tensor(&f, "exp_avg_sq", RNND_ST_F32, 1, &P);
        if ((ma == NULL) != (va == NULL)) {
            rc = fail(err, errlen, RNND_ECORRUPT,
                      "optimizer.safetensors: exp_avg and exp_avg_sq must both be F32 [%lld]",
                      (long long)P);
            goto done;
        }
        if (ma) {
            float *mm = keep(out, ck->P * 4), *vv = keep(out, ck->P * 4);
            if (mm == NULL || vv == NULL) {
                rc = fail(err, errlen, RNND_ENOMEM, "out of memory");
                goto done;
            }
            memcpy(mm, ma->data, ck->P * 4);
            memcpy(vv, va->data, ck->P * 4);
            ck->exp_avg = mm;
            ck->exp_avg_sq = vv;
        }
        rnnd_st_file_free(&f);
        free(buf);
        buf = NULL;
    } else if (rc == RNND_ENOTFOUND) {
        lost_note(out, &mf, "optimizer.safetensors", true);
    } else {
        goto done;
    }

    // envs.safetensors (optional)
    rc = read_st(dir, "envs.safetensors", &mf, &buf, &f, err, errlen);
    bool envs = rc == 0;
    if (rc == 0) {
        const struct rnnd_st_tensor *ids = rnnd_st_find(&f, "env_ids");
        if (ids == NULL || ids->dtype != RNND_ST_I64 || ids->ndim != 1) {
            rc = fail(err, errlen, RNND_ECORRUPT, "envs.safetensors: no I64 [N] 'env_ids'");
            goto done;
        }
        int64_t N = ids->shape[0], L = m->L, H = m->H, OW = H + rnnd_policy_row(m).W;
        int64_t s3[3] = {N, L, H}, s1[1] = {N}, s2[2] = {N, OW};
        const struct rnnd_st_tensor *h = want_tensor(&f, "h", RNND_ST_F32, 3, s3);
        const struct rnnd_st_tensor *c =
            m->cell == RNND_CELL_LSTM ? want_tensor(&f, "c", RNND_ST_F32, 3, s3) : NULL;
        const struct rnnd_st_tensor *li = want_tensor(&f, "last_index", RNND_ST_I64, 1, s1);
        const struct rnnd_st_tensor *hi = want_tensor(&f, "has_index", RNND_ST_U8, 1, s1);
        const struct rnnd_st_tensor *lo = want_tensor(&f, "last_output", RNND_ST_F32, 2, s2);
        const struct rnnd_st_tensor *sc = want_tensor(&f, "step_count", RNND_ST_I64, 1, s1);
        if (h == NULL || (m->cell == RNND_CELL_LSTM && c == NULL) || li == NULL || hi == NULL ||
            N > INT32_MAX) {
            rc = fail(err, errlen, RNND_ECORRUPT,
                      "envs.safetensors: expected h%s [N, %lld, %lld], last_index and has_index "
                      "[N] for N = %lld env_ids",
                      m->cell == RNND_CELL_LSTM ? " and c" : "", (long long)L, (long long)H,
                      (long long)N);
            goto done;
        }
        size_t n = (size_t)N, lh = (size_t)(L * H);
        uint64_t *idv = keep(out, n * 8), *liv = keep(out, n * 8);
        uint8_t *hiv = keep(out, n);
        float *hv = keep(out, n * lh * 4);
        float *cv = c ? keep(out, n * lh * 4) : NULL;
        float *lov = lo ? keep(out, n * (size_t)OW * 4) : NULL;
        uint64_t *scv = sc ? keep(out, n * 8) : NULL;
        if (!idv || !liv || !hiv || !hv || (c && !cv) || (lo && !lov) || (sc && !scv)) {
            rc = fail(err, errlen, RNND_ENOMEM, "out of memory");
            goto done;
        }
        memcpy(idv, ids->data, n * 8);
        memcpy(liv, li->data, n * 8);
        memcpy(hiv, hi->data, n);
        memcpy(hv, h->data, n * lh * 4);
        if (c)
            memcpy(cv, c->data, n * lh * 4);
        if (lo)
            memcpy(lov, lo->data, n * (size_t)OW * 4);
        if (sc)
            memcpy(scv, sc->data, n * 8);
        ck->n_envs = (int)N;
        ck->env_ids = idv;
        ck->last_index = liv;
        ck->has_index = hiv;
        ck->env_h = hv;
        ck->env_c = cv;
        ck->last_output = lov;
        ck->step_count = scv;
        rnnd_st_file_free(&f);
        free(buf);
        buf = NULL;
    } else if (rc == RNND_ENOTFOUND) {
        lost_note(out, &mf, "envs.safetensors", true);
    } else {
        goto done;
    }

    // trajectories.safetensors (optional; without the envs it belongs to, lost with them)
    char path[2 * RNND_CONFIG_PATH_MAX];
    snprintf(path, sizeof(path), "%s/trajectories.safetensors", dir);
    rc = envs ? read_st(dir, "trajectories.safetensors", &mf, &buf, &f, err, errlen)
         : access(path, F_OK) == 0 ? RNND_ENOTSUP
                                   : RNND_ENOTFOUND;
    if (rc == 0) {
        rc = read_trajectories(out, &f, err, errlen);
        if (rc != 0)
            goto done;
        rnnd_st_file_free(&f);
        free(buf);
        buf = NULL;
    } else if (rc == RNND_ENOTFOUND) {
        lost_note(out, &mf, "trajectories.safetensors", false);
    } else if (rc == RNND_ENOTSUP) {
        lost_note(out, &mf, "trajectories.safetensors", true);
    } else {
        goto done;
    }
    if (ck->created_unix_ms <= 0) // no metadata.json, or one without the time: the mtime
        ck->created_unix_ms = rnnd_checkpoint_created_ms(dir);
    rc = 0;
done:
    rnnd_st_file_free(&f);
    free(buf);
    if (rc != 0)
        rnnd_checkpoint_data_free(out);
    return rc;
}

int rnnd_checkpoint_read_weights(const char *file, const struct rnnd_model *m, float *params,
                                 char *err, size_t errlen) {
    void *buf = NULL;
    struct rnnd_st_file f = {0};
    int rc = read_st(NULL, file, NULL, &buf, &f, err, errlen);
    if (rc == RNND_ENOTFOUND)
        return fail(err, errlen, RNND_EIO, "%s: no such file", file);
    if (rc != 0)
        return rc;
    char why[256];
    rc = rnnd_st_decode_params(m, &f, params, why, sizeof(why));
    if (rc != 0)
        rc = fail(err, errlen, RNND_EINVAL, "%s does not fit this daemon's %s I=%d H=%d L=%d: %s",
                  file, rnnd_config_cell_name(m->cell), m->I, m->H, m->L, why);
    rnnd_st_file_free(&f);
    free(buf);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Listing, rotation, clean-up

// dir/metadata.json as a new NUL-terminated string, or NULL.
static char *metadata(const char *dir) {
    char path[3 * RNND_CONFIG_PATH_MAX];
    snprintf(path, sizeof(path), "%s/metadata.json", dir);
    void *buf;
    size_t len;
    char err[64];
    if (slurp(path, &buf, &len, err, sizeof(err)) != 0)
        return NULL;
    char *text = realloc(buf, len + 1);
    if (text == NULL) {
        free(buf);
        return NULL;
    }
    text[len] = '\0';
    return text;
}

long long rnnd_checkpoint_created_ms(const char *dir) {
    char *text = metadata(dir);
    const char *v = text ? json_value(text, "created_unix_ms") : NULL;
    long long t = v ? strtoll(v, NULL, 10) : -1;
    free(text);
    if (t < 0) {
        struct stat st;
        if (stat(dir, &st) == 0)
            t = (long long)st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000;
    }
    return t;
}

// True when dir's metadata.json says it holds model m (cell and sizes).
static bool holds_model(const char *dir, const struct rnnd_model *m) {
    char *text = metadata(dir);
    if (text == NULL)
        return false;
    char cell[32];
    snprintf(cell, sizeof(cell), "\"%s\"", rnnd_config_cell_name(m->cell));
    const char *c = json_value(text, "cell"), *i = json_value(text, "input_size");
    const char *h = json_value(text, "hidden_size"), *l = json_value(text, "num_layers");
    bool same = c && i && h && l && strncmp(c, cell, strlen(cell)) == 0 &&
                strtol(i, NULL, 10) == m->I && strtol(h, NULL, 10) == m->H &&
                strtol(l, NULL, 10) == m->L;
    free(text);
    return same;
}

struct listed {
    char *path;
    long long t;
};

static int listed_cmp(const void *a, const void *b) {
    const struct listed *x = a, *y = b;
    if (x->t != y->t)
        return x->t > y->t ? -1 : 1; // newest first
    return -strcmp(x->path, y->path);
}

enum scan_kind {
    SCAN_ALL,       // every checkpoint directory (state_dir/auto)
    SCAN_AUTO_NAME, // those of the automatic form (the top of state_dir, earlier layout)
    SCAN_NAMED,     // the others at the top of state_dir
};

// Appends the checkpoint directories of dir that kind selects to *v (k of cap).
static int scan(const char *dir, enum scan_kind kind, struct listed **v, int *k, int *cap) {
    DIR *d = opendir(dir);
    if (d == NULL)
        return 0;
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const char *name = de->d_name;
        if (name[0] == '.' || (kind == SCAN_AUTO_NAME && !auto_name(name)) ||
            (kind == SCAN_NAMED &&
             (auto_name(name) || strcmp(name, RNND_CHECKPOINT_AUTO_DIR) == 0)))
            continue;
        char path[2 * RNND_CONFIG_PATH_MAX], probe[2 * RNND_CONFIG_PATH_MAX + 32];
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        struct stat st;
        snprintf(probe, sizeof(probe), "%s/model.safetensors", path);
        bool is_ck = stat(probe, &st) == 0;
        snprintf(probe, sizeof(probe), "%s/metadata.json", path);
        is_ck = is_ck || stat(probe, &st) == 0;
        if (!is_ck)
            continue;
        if (*k == *cap) {
            int ncap = *cap ? 2 * *cap : 16;
            struct listed *nv = realloc(*v, (size_t)ncap * sizeof(*nv));
            if (nv == NULL) {
                rc = RNND_ENOMEM;
                break;
            }
            *v = nv;
            *cap = ncap;
        }
        (*v)[*k].path = strdup(path);
        if ((*v)[*k].path == NULL) {
            rc = RNND_ENOMEM;
            break;
        }
        (*v)[*k].t = rnnd_checkpoint_created_ms(path);
        (*k)++;
    }
    closedir(d);
    return rc;
}

// The named checkpoints of state_dir, or its automatic ones (those of the earlier layout too
// when legacy), newest first.
static int list(const char *state_dir, bool named, bool legacy, char ***paths, int *n) {
    *paths = NULL;
    *n = 0;
    struct listed *v = NULL;
    int k = 0, cap = 0, rc;
    if (named) {
        rc = scan(state_dir, SCAN_NAMED, &v, &k, &cap);
    } else {
        char dir[RNND_CONFIG_PATH_MAX + 16];
        snprintf(dir, sizeof(dir), "%s/" RNND_CHECKPOINT_AUTO_DIR, state_dir);
        rc = scan(dir, SCAN_ALL, &v, &k, &cap);
        if (rc == 0 && legacy)
            rc = scan(state_dir, SCAN_AUTO_NAME, &v, &k, &cap);
    }
    if (k > 1)
        qsort(v, (size_t)k, sizeof(*v), listed_cmp);
    char **out = rc == 0 ? malloc(((size_t)k + 1) * sizeof(char *)) : NULL;
    for (int i = 0; i < k; i++) {
        if (out)
            out[i] = v[i].path;
        else
            free(v[i].path);
    }
    free(v);
    if (out == NULL)
        return RNND_ENOMEM;
    *paths = out;
    *n = k;
    return 0;
}

int rnnd_checkpoint_list(const char *state_dir, bool named, char ***paths, int *n) {
    return list(state_dir, named, true, paths, n);
}

void rnnd_checkpoint_list_free(char **paths, int n) {
    for (int i = 0; i < n; i++)
        free(paths[i]);
    free(paths);
}

int rnnd_checkpoint_prune(const char *state_dir, int keep, const struct rnnd_model *m,
                          char *const *spare, int n_spare) {
    char **paths;
    int n;
    if (list(state_dir, false, false, &paths, &n) != 0)
        return 0;
    int kept = 0, removed = 0;
    for (int i = 0; i < n; i++) {
        bool spared = !holds_model(paths[i], m);
        for (int s = 0; s < n_spare && !spared; s++)
            spared = strcmp(paths[i], spare[s]) == 0;
        if (spared)
            continue;
        if (kept < keep) {
            kept++;
            continue;
        }
        remove_tree(paths[i]);
        removed++;
    }
    rnnd_checkpoint_list_free(paths, n);
    return removed;
}

// True for ".NAME.tmp-PID", the temporary rnnd_checkpoint_write writes into.
static bool temp_name(const char *name) {
    const char *t = strstr(name, ".tmp-");
    if (name[0] != '.' || t == NULL || t == name || t[5] == '\0')
        return false;
    for (t += 5; *t; t++)
        if (*t < '0' || *t > '9')
            return false;
    return true;
}

int rnnd_checkpoint_clean(const char *dir) {
    int removed = 0;
    for (int k = 0; k < 2; k++) {
        char d[RNND_CONFIG_PATH_MAX + 16];
        snprintf(d, sizeof(d), k ? "%s/" RNND_CHECKPOINT_AUTO_DIR : "%s", dir);
        DIR *dp = opendir(d);
        if (dp == NULL)
            continue;
        struct dirent *de;
        while ((de = readdir(dp)) != NULL) {
            char path[2 * RNND_CONFIG_PATH_MAX];
            struct stat st;
            snprintf(path, sizeof(path), "%s/%s", d, de->d_name);
            if (!temp_name(de->d_name) || lstat(path, &st) != 0 || !S_ISDIR(st.st_mode))
                continue;
            remove_tree(path);
            removed++;
        }
        closedir(dp);
    }
    return removed;
}
