/*
 * fuzz_checkpoint.c: libFuzzer target for reading a checkpoint directory (rnnd_checkpoint_read,
 * server/checkpoint.c), what rnnd does with whatever it finds in --state-dir or --restore at
 * start. Only the public API is used, so the target follows the checkpoint layout wherever it
 * goes: the input is a directory's files, whatever their names.
 *
 * Input: byte 0 picks the daemon's model (fuzz_models.h); then files, each
 *     [name length: 1 byte][name][data length: 4 bytes, little-endian][data]
 * (data cut short where the input ends), written into a fresh directory. A name is a relative
 * path of [A-Za-z0-9._-] components joined by '/' (subdirectories are made); the first name
 * that is not ends the list. fuzz_seeds writes the seeds: checkpoints written by
 * rnnd_checkpoint_write, packed this way.
 *
 * A checkpoint the reader accepts is read the way the engine restores it (every array it
 * returns, at the sizes it claims), so a check that lets a short array through shows up under
 * ASan; its counts must add up. A refusal must say why and leave nothing allocated.
 *
 * Build: CC=clang cmake -DRNND_FUZZ=ON -DRNND_CUDA=OFF; seeds: fuzz_seeds OUT (OUT/checkpoint).
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "fuzz_models.h"

static char root[64]; // a private directory, made once
static char dir[96];  // root/ckpt: the checkpoint of one input

static int remove_one(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

static void remove_root(void) {
    nftw(root, remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void init(void) {
    // tmpfs when there is one: every input writes and removes a directory.
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(root, sizeof(root), "%s/rnnd-fuzz-ckpt-XXXXXX", base);
    if (mkdtemp(root) == NULL)
        abort();
    snprintf(dir, sizeof(dir), "%s/ckpt", root);
    atexit(remove_root);
}

static bool name_ok(const char *name, size_t n) {
    if (n == 0 || name[0] == '/' || name[n - 1] == '/')
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        bool plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                     (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
        if (!plain && !(ch == '/' && name[i + 1] != '/'))
            return false;
        if (ch == '.' && i + 1 < n && name[i + 1] == '.')
            return false;
    }
    return true;
}

// Writes the input's files under dir. Files that cannot be made (a name that is also a
// directory) are left out.
static void write_files(const uint8_t *p, size_t n) {
    for (int files = 0; files < 16 && n >= 1; files++) {
        size_t nl = p[0];
        if (n < 1 + nl + 4 || !name_ok((const char *)p + 1, nl))
            return;
        char path[512];
        snprintf(path, sizeof(path), "%s/%.*s", dir, (int)nl, (const char *)p + 1);
        p += 1 + nl;
        size_t len = (size_t)p[0] | (size_t)p[1] << 8 | (size_t)p[2] << 16 | (size_t)p[3] << 24;
        p += 4;
        n -= 1 + nl + 4;
        len = len < n ? len : n;
        for (char *slash = strchr(path + strlen(dir) + 1, '/'); slash;
             slash = strchr(slash + 1, '/')) {
            *slash = '\0';
            mkdir(path, 0700);
            *slash = '/';
        }
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            if (len && write(fd, p, len) != (ssize_t)len)
                abort();
            close(fd);
        }
        p += len;
        n -= len;
    }
}

static volatile float sink;
static void touch(const void *p, size_t bytes) {
    uint8_t s = 0;
    for (size_t i = 0; i < bytes; i++)
        s ^= ((const uint8_t *)p)[i];
    sink = s;
}

// Reads what a restore reads, at the sizes the checkpoint claims.
static void check_accepted(const struct rnnd_checkpoint *ck, const struct rnnd_model *m) {
    size_t P = rnnd_model_param_count(m), L = (size_t)m->L, H = (size_t)m->H, I = (size_t)m->I;
    bool lstm = m->cell == RNND_CELL_LSTM;
    if (ck->P != P || ck->params == NULL || (ck->exp_avg == NULL) != (ck->exp_avg_sq == NULL) ||
        ck->n_envs < 0 || ck->extras_size < 0)
        abort();
    touch(ck->params, P * 4);
    if (ck->exp_avg) {
        touch(ck->exp_avg, P * 4);
        touch(ck->exp_avg_sq, P * 4);
    }
    size_t N = (size_t)ck->n_envs;
    if (N > 0) {
        if (!ck->env_ids || !ck->env_h || !ck->last_index || !ck->has_index || (lstm && !ck->env_c))
            abort();
        touch(ck->env_ids, N * 8);
        touch(ck->env_h, N * L * H * 4);
        if (lstm)
            touch(ck->env_c, N * L * H * 4);
        touch(ck->last_index, N * 8);
        touch(ck->has_index, N);
        if (ck->last_output)
            touch(ck->last_output, N * H * 4);
    }
    if (ck->traj_count == NULL)
        return;
    int64_t R = 0;
    for (size_t i = 0; i < N; i++) {
        if (ck->traj_count[i] < 0)
            abort();
        R += ck->traj_count[i];
    }
    if (R != ck->traj_rows)
        abort();
    size_t r = (size_t)R, E = (size_t)ck->extras_size;
    if (r > 0 && (!ck->traj_obs || !ck->traj_is_init || !ck->traj_version || !ck->traj_h ||
                  (lstm && !ck->traj_c) || (E && !ck->traj_extras)))
        abort();
    if (r == 0)
        return;
    touch(ck->traj_obs, r * I * 4);
    touch(ck->traj_is_init, r);
    touch(ck->traj_version, r * 8);
    touch(ck->traj_h, r * L * H * 4);
    if (lstm)
        touch(ck->traj_c, r * L * H * 4);
    if (E)
        touch(ck->traj_extras, r * E * 4);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (root[0] == '\0')
        init();
    if (size < 1)
        return 0;
    const struct rnnd_model *m = &fuzz_models[data[0] % FUZZ_MODELS];
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        abort();
    write_files(data + 1, size - 1);
    struct rnnd_checkpoint_data out;
    char err[512] = "";
    int rc = rnnd_checkpoint_read(dir, m, &out, err, sizeof(err));
    if (rc == 0) {
        check_accepted(&out.ck, m);
        rnnd_checkpoint_data_free(&out);
    } else if (rc > 0 || err[0] == '\0' || out.ck.params != NULL) {
        abort(); // a refusal says why and keeps nothing
    }
    nftw(dir, remove_one, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}
