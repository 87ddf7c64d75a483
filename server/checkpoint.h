/*
 * checkpoint.h: checkpoints as directories inside --state-dir (docs/design.md "Persistence"):
 *   model.safetensors     the weights with PyTorch names (loadable into nn.GRU / nn.LSTM)
 *   optimizer.safetensors exp_avg, exp_avg_sq (flat, P floats, the layout of rnnd_kernels.h), step
 *   envs.safetensors      env_ids, h (and c), last_index, has_index of every env holding state
 *   trajectories.safetensors  every env's recorded steps (count per env, in env_ids order, then
 *                         obs, is_init, extras, the state before each step and its version)
 *   metadata.json         model shape, versions, optimizer settings, creation time
 *   checksums             one line per file above: zlib crc32 (8 hex digits), size, name
 * A checkpoint is written under a temporary name (".NAME.tmp-PID", mode 0700, files 0600), every
 * file and the directory fsynced, then renamed into place (replacing an existing one of the same
 * name atomically), and the parent directory fsynced.
 *
 * Two namespaces: automatic checkpoints (periodic, shutdown, SaveCheckpoint without a name) are
 * STATE_DIR/auto/ckpt-<UTC time>-v<version> and rotate; named ones are STATE_DIR/NAME and are
 * never removed by rnnd. Earlier versions wrote automatic ones at the top (STATE_DIR/ckpt-...):
 * those are still found as automatic, and are left where they are.
 * Pure file work on host snapshots (nothing is logged here): any thread.
 */
#ifndef RNND_CHECKPOINT_H
#define RNND_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rnnd_kernels.h"

// The directory inside --state-dir that holds the automatic checkpoints.
#define RNND_CHECKPOINT_AUTO_DIR "auto"

// A snapshot of everything a checkpoint holds; every pointer is borrowed host memory.
struct rnnd_checkpoint {
    struct rnnd_model model;
    size_t P;
    const float *params; // (P)
    uint64_t model_version;
    enum rnnd_optim_kind optimizer;
    float lr, max_grad_norm;
    int64_t optim_step;
    const float *exp_avg, *exp_avg_sq; // (P), Adam only (NULL for SGD)
    int n_envs;
    const uint64_t *env_ids;    // (N)
    const float *env_h;         // (N, L, H)
    const float *env_c;         // (N, L, H) LSTM
    const uint64_t *last_index; // (N)
    const uint8_t *has_index;   // (N)
    const float *last_output;   // (N, H + W) the reply of each env's latest step (retries): the
                                // output, then a policy's row (W of rnnd_policy_row, job.h)
    const uint64_t *step_count; // (N) or NULL: the steps each env took (a policy's sampling key)
    // Recorded trajectories, or traj_count NULL for none (R rows: the sum of traj_count):
    const int64_t *traj_count;    // (N) steps recorded for each env, oldest first
    int64_t traj_rows;            // R
    const float *traj_obs;        // (R, I)
    const uint8_t *traj_is_init;  // (R)
    const float *traj_extras;     // (R, extras_size) when extras_size > 0
    const uint64_t *traj_version; // (R)
    const float *traj_h;          // (R, L, H) the state before each step
    const float *traj_c;          // (R, L, H) LSTM
    // A policy model's record of each row (engine_impl.h), or NULL: W' = the policy row
    // without its logits or mean, plus the reward; flags: done (bit 0), truncated (bit 1).
    const float *traj_policy;         // (R, W')
    const uint8_t *traj_policy_flags; // (R)
    // Each env's recorded total and cursor (struct rnnd_traj_ring), or NULL: restored as
    // total = count, cursor 0.
    const uint64_t *traj_cursor; // (N, 2)
    int extras_size;
    uint64_t seed;
    // Where the writer placed its envs (place.h): its devices and --place-block (0 and 0 say
    // not known: written as 0 and 1). A checkpoint of several devices holds only the envs of
    // one. Read back as 0 and 1 when metadata.json does not say (written before these fields).
    int devices, place_block;
    int64_t created_unix_ms; // read back: when it was written (0 when unknown)
};

// Resolves the directory a SaveCheckpoint asks for: requested empty gives a new automatic one,
// state_dir/auto/ckpt-<UTC time>-v<version>; a relative name is taken inside state_dir; an
// absolute path must lie inside state_dir. Names with "..", or starting with '.', "auto" and
// names of the automatic form are refused. 0 and out (cap bytes), or RNND_EINVAL with the reason
// in err.
int rnnd_checkpoint_resolve(const char *state_dir, const char *requested, uint64_t version,
                            char *out, size_t cap, char *err, size_t errlen);

// Writes ck into dir (a path from rnnd_checkpoint_resolve) atomically, creating the directories
// above it (0700) that are missing. 0, or RNND_EIO / RNND_ENOMEM with the reason in err; on
// failure nothing is left behind and an existing checkpoint of that name is untouched.
int rnnd_checkpoint_write(const char *dir, const struct rnnd_checkpoint *ck, char *err,
                          size_t errlen);

// A checkpoint read back: ck's pointers refer to the arrays owned here.
struct rnnd_checkpoint_data {
    struct rnnd_checkpoint ck;
    bool has_optimizer; // optimizer.safetensors was there
    char optimizer[16]; // "adam", "sgd" or ""
    bool verified;      // a checksums file was there and every file matched it
    char lost[256];     // the parts missing (each with what it held), "" when none
    void *mem[24];      // what to free
};

// Reads the checkpoint in dir for model m (borrowed) into *out; free with
// rnnd_checkpoint_data_free. model.safetensors must hold exactly m's tensors; optimizer, env and
// trajectory files may be missing (lost names them; a directory holding only a PyTorch
// model.safetensors restores weights). With a checksums file every file must be listed there and
// match it; without one (older checkpoints) nothing is verified. A NaN or Inf in any float tensor
// is refused. ck.extras_size is the extras width of the recorded steps. 0, or RNND_ECORRUPT /
// RNND_EINVAL / RNND_EIO / RNND_ENOMEM with the reason in err.
int rnnd_checkpoint_read(const char *dir, const struct rnnd_model *m,
                         struct rnnd_checkpoint_data *out, char *err, size_t errlen);
void rnnd_checkpoint_data_free(struct rnnd_checkpoint_data *d);

// Reads a safetensors file holding exactly m's parameters with PyTorch names (a model trained
// elsewhere, or a checkpoint's model.safetensors), all finite, into params (P floats). 0, or
// RNND_EINVAL / RNND_ECORRUPT / RNND_EIO / RNND_ENOMEM with the reason in err; params untouched
// on failure.
int rnnd_checkpoint_read_weights(const char *file, const struct rnnd_model *m, float *params,
                                 char *err, size_t errlen);

// The automatic checkpoints of state_dir (those in state_dir/auto, and the ones of the automatic
// form at its top that earlier versions wrote there), or with named true the named ones (every
// other checkpoint directory at its top); checkpoint directories hold model.safetensors or
// metadata.json. Newest first by creation time. *paths is a new array of n new strings; free
// with rnnd_checkpoint_list_free. 0 (also when the directory does not exist) or RNND_ENOMEM.
int rnnd_checkpoint_list(const char *state_dir, bool named, char ***paths, int *n);
void rnnd_checkpoint_list_free(char **paths, int n);

// When the checkpoint in dir was written, in ms since the epoch: metadata.json's
// created_unix_ms, else the directory's mtime; -1 when neither can be read.
long long rnnd_checkpoint_created_ms(const char *dir);

// Removes the oldest automatic checkpoints in state_dir/auto beyond the newest keep. Left alone,
// and not counted: those in spare (n_spare paths as rnnd_checkpoint_list gives them) and those
// whose metadata.json does not say they hold model m (a checkpoint of another configuration is
// never rotated away). Named checkpoints and those of the earlier layout are never removed.
// Returns how many were removed.
int rnnd_checkpoint_prune(const char *state_dir, int keep, const struct rnnd_model *m,
                          char *const *spare, int n_spare);

// mkdir -p: creates each missing directory of dir with mode 0700 whatever the umask (those that
// exist are left as they are). 0, or -1 with errno set (ENOTDIR when dir is not a directory).
int rnnd__mkdirs(const char *dir);

// Removes the temporaries (".NAME.tmp-PID") that a write cut short by kill -9 or a crash left in
// dir and dir/auto. Returns how many were removed.
int rnnd_checkpoint_clean(const char *dir);

#endif // RNND_CHECKPOINT_H
