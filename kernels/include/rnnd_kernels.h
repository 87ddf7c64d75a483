/*
 * rnnd_kernels.h: the backend-neutral op API of rnnd's recurrent cores and the policies around
 * them.
 *
 * The math of docs/design.md (PyTorch nn.GRU / nn.LSTM with TorchRL-style resets; an MLP
 * encoder and discrete, Gaussian and value heads, as rnnd.torch.Policy) behind a small vtable,
 * so the server runs the same calls on the CPU reference and on CUDA. Kernels do no I/O, never log and keep no global state; each backend context belongs to one thread at a time.
 *
 * Dimension letters, used in every shape comment:
 *   B batch rows, T steps, I input width, H hidden width, L layers,
 *   G gates per layer (3 for GRU: r z n; 4 for LSTM: i f g o), S state slots, P parameter count,
 *   N rows of a row-wise op (B, or B*T), K discrete actions, A Gaussian action dims.
 * Tensors are fp32, row-major, batch-first. Pointers handed to an op live in the backend's memory
 * (host memory for the CPU backend, device memory for CUDA) unless a comment says "host".
 */
#ifndef RNND_KERNELS_H
#define RNND_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Errors: 0 is success, a negative RNND_E* is a failure (libuv's convention). The server maps each
// code to one gRPC status in server/rpc.c.

#define RNND_ERRNO_MAP(XX)                                                                         \
    XX(EINVAL, -1, "invalid argument")                                                             \
    XX(ENOMEM, -2, "out of memory")                                                                \
    XX(ENOTSUP, -3, "not supported by this backend or build")                                      \
    XX(EDEVICE, -4, "device error")                                                                \
    XX(ENOTFOUND, -5, "not found")                                                                 \
    XX(EPRECOND, -6, "failed precondition")                                                        \
    XX(EFULL, -7, "resource exhausted")                                                            \
    XX(EUNAVAIL, -8, "unavailable")                                                                \
    XX(EAUTH, -9, "unauthenticated")                                                               \
    XX(EIO, -10, "i/o error")                                                                      \
    XX(ECORRUPT, -11, "corrupt or unrecognised data")                                              \
    XX(ECANCELED, -12, "canceled")

enum rnnd_errno {
#define RNND__ERRNO_ENUM(name, value, msg) RNND_##name = value,
    RNND_ERRNO_MAP(RNND__ERRNO_ENUM)
#undef RNND__ERRNO_ENUM
};

// A static string describing err ("invalid argument"), or "unknown error".
const char *rnnd_strerror(int err);
// A static string naming err ("EINVAL"), or "EUNKNOWN".
const char *rnnd_err_name(int err);

// ---------------------------------------------------------------------------------------------
// The model: shape and numerics of a recurrent core.

enum rnnd_cell { RNND_CELL_GRU, RNND_CELL_LSTM };

// Matmul precision. Storage and state are always fp32.
enum rnnd_compute {
    RNND_COMPUTE_FP32, // fp32 with TF32 tensor cores allowed (cuDNN's default); plain fp32 on CPU
    RNND_COMPUTE_IEEE, // strict fp32 arithmetic
    RNND_COMPUTE_BF16, // bf16 matmul operands, fp32 accumulation and state
};

// The encoder's activation, after every Linear of the MLP. ELU (alpha 1) is Sample Factory's
// default; relu is SEED RL's; tanh is CleanRL's and Stable-Baselines3's.
enum rnnd_act { RNND_ACT_ELU, RNND_ACT_RELU, RNND_ACT_TANH };

// Largest sizes any backend accepts; rnnd_model_check refuses more.
#define RNND_MAX_LAYERS         8
#define RNND_MAX_WIDTH          65536
#define RNND_MAX_ENCODER_LAYERS 4

// The policy around the recurrent core (docs/design.md "Policy"). All zero: no policy, the model
// is the core alone, exactly as before policies existed (parameters, names, init, files).
//   obs (I) -> encoder: enc_layers x (Linear, act) -> core (GRU/LSTM over enc_width[last], or
//   over I without an encoder) -> h (H) -> heads: logits (K) | mean (A) and log-std (A) | value.
struct rnnd_policy {
    int enc_layers;                         // 0 .. RNND_MAX_ENCODER_LAYERS
    int enc_width[RNND_MAX_ENCODER_LAYERS]; // output width of each encoder Linear
    enum rnnd_act enc_act;
    int K;      // discrete actions: policy_logits (K, H); 0: no discrete head
    int A;      // diagonal Gaussian action dims: action_mean (A, H), action_log_std (A); 0: none
    bool value; // value head (1, H)
};

struct rnnd_model {
    enum rnnd_cell cell;
    enum rnnd_compute compute;
    int I; // input width of the model: the observation (the core's own input when no encoder)
    int H; // hidden width of every layer
    int L; // layers
    struct rnnd_policy policy;
};

// Most named parameter tensors a model has: the core's 4 per layer, 2 per encoder layer, and
// policy_logits (2), action_mean (2), action_log_std, value (2).
#define RNND_MAX_PARAM_TENSORS (4 * RNND_MAX_LAYERS + 2 * RNND_MAX_ENCODER_LAYERS + 7)

// 0 when m is a valid model (cell and compute known, 1 <= I, H <= RNND_MAX_WIDTH,
// 1 <= L <= RNND_MAX_LAYERS, and a valid policy: see rnnd_model_validate), RNND_EINVAL otherwise.
int rnnd_model_check(const struct rnnd_model *m);
// rnnd_model_check, and on RNND_EINVAL a one-line reason naming the field, its value and what
// is accepted in err (errlen bytes, may be 0). A policy is refused when an encoder width is out
// of 1 .. RNND_MAX_WIDTH, the activation is unknown, K is 1 (a one-way choice is no policy) or
// above RNND_MAX_WIDTH, A is out of 0 .. RNND_MAX_WIDTH, or both K and A are set (one action
// head: discrete or Gaussian).
int rnnd_model_validate(const struct rnnd_model *m, char *err, size_t errlen);
// True when m has any policy part (encoder or head).
bool rnnd_model_has_policy(const struct rnnd_model *m);
// The recurrent core of m alone, as the core ops (rnn_forward, rnn_backward, rnn_step) take it:
// I is the core's input width (the last encoder width, or m->I) and there is no policy. Its
// parameters are the first rnnd_model_param_count(core) floats of m's flat array.
struct rnnd_model rnnd_model_core(const struct rnnd_model *m);
// G: 3 for GRU, 4 for LSTM.
int rnnd_model_gates(const struct rnnd_model *m);
// Input width of core layer l: the core's input width for l = 0, H above.
int rnnd_model_layer_input(const struct rnnd_model *m, int l);
// Floats per row of the encoder's saved activations: the sum of enc_width (0 without encoder).
int rnnd_model_encoder_acts(const struct rnnd_model *m);
// Input width of encoder layer j: the observation's (I) for j = 0, the previous width above.
int rnnd_model_encoder_input(const struct rnnd_model *m, int j);
// The widest of the encoder's input and layers: the row width of its backward's buffers.
int rnnd_model_encoder_widest(const struct rnnd_model *m);

// Parameters are one flat fp32 array of P floats. The core comes first, in PyTorch's order
// (nn.GRU/nn.LSTM _flat_weights): for each layer l, weight_ih_l{l} (G*H, I_l), weight_hh_l{l}
// (G*H, H), bias_ih_l{l} (G*H), bias_hh_l{l} (G*H). The policy's tensors follow, in the order of
// rnnd.torch.Policy's state_dict (whose names they carry): action_log_std (A);
// encoder.{j}.weight (enc_width[j], in_j), encoder.{j}.bias (enc_width[j]) for each encoder
// layer j (in_0 = I, then the previous width); policy_logits.weight (K, H), .bias (K);
// action_mean.weight (A, H), .bias (A); value.weight (1, H), .bias (1); each only when its part
// is there. Gradients, Adam moments and checkpoints use the same layout, so each is one copy and
// the optimizer is one pass over one array.
enum rnnd_param_kind {
    RNND_PARAM_WEIGHT_IH,
    RNND_PARAM_WEIGHT_HH,
    RNND_PARAM_BIAS_IH,
    RNND_PARAM_BIAS_HH,
};

struct rnnd_param_tensor {
    char name[32]; // PyTorch's name, e.g. "weight_ih_l0", "encoder.0.weight"
    size_t offset; // in floats from the start of the flat array
    int ndim;      // 2 for weights, 1 for biases
    int64_t shape[2];
    size_t count; // floats
};

// P, the number of floats in the flat parameter array.
size_t rnnd_model_param_count(const struct rnnd_model *m);
// The number of named tensors: 4 * L for the core, then the policy's (at most
// RNND_MAX_PARAM_TENSORS).
int rnnd_model_param_tensors(const struct rnnd_model *m);
// Describes tensor k (0 <= k < rnnd_model_param_tensors; k = 4*l + kind for the core) into *out.
void rnnd_model_param_tensor(const struct rnnd_model *m, int k, struct rnnd_param_tensor *out);
// Index k of the tensor called name, or RNND_ENOTFOUND.
int rnnd_model_param_find(const struct rnnd_model *m, const char *name);
// Where the tensor called name starts in a flat array of m's parameters (or of anything laid out
// as they are: gradients, optimizer moments), in floats. m must have it.
size_t rnnd_model_param_offset(const struct rnnd_model *m, const char *name);

// Fills params (host, P floats) as PyTorch initialises its modules, from a generator seeded with
// seed (not PyTorch's generator: the same seed gives the same weights in rnnd, not in torch):
// the core as nn.GRU/nn.LSTM, uniform in [-1/sqrt(H), 1/sqrt(H)]; then each policy Linear as
// nn.Linear, weight and bias uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)]; action_log_std 0.
// The core's values do not depend on the policy.
void rnnd_model_init_params(const struct rnnd_model *m, uint64_t seed, float *params);

// ---------------------------------------------------------------------------------------------
// Op arguments.

// A batch of trajectories for rnn_forward / rnn_backward. Reset rule (docs/design.md): before step
// t of row b, where is_init[b, t] is set, every layer's state is replaced by the reset value:
// hidden[b, t] (and cell[b, t]) when stored states are given, zero otherwise. The state at t = 0
// is h0 when given, else hidden[b, 0] when given, else zero. h0 and hidden are exclusive.
struct rnnd_seq {
    int B, T;
    const float *x;         // (B, T, I)
    const uint8_t *is_init; // (B, T) 0 or 1
    const float *h0;        // (B, L, H) or NULL
    const float *c0;        // (B, L, H) or NULL; LSTM only, only with h0
    const float *hidden;    // (B, T, L, H) or NULL: TorchRL-style stored per-step states
    const float *cell;      // (B, T, L, H); LSTM: present exactly when hidden is
};

// Outputs of rnn_backward. The parameter gradient is accumulated (+=) so that several backward
// calls sum into one buffer, as autograd does; every other output is overwritten (=).
struct rnnd_seq_grads {
    float *params; // (P)          +=
    float *x;      // (B, T, I)    =  or NULL when not wanted
    float *h0;     // (B, L, H)    =  or NULL; the gradient of the state at t = 0 when h0 was given
    float *c0;     // (B, L, H)    =  or NULL; LSTM
    float *hidden; // (B, T, L, H) =  or NULL; only with seq->hidden: the gradient of each reset
                   //                 value used, zero at steps that used none
    float *cell;   // (B, T, L, H) =  or NULL; LSTM
};

// One step for a batch of rows whose states live in a table of rows (the inference path): row b
// reads table row slots[b] (zero instead when is_init[b]), runs every layer and writes its new
// state to table row slots_new[b]. No table row is both read and written by one call: the 2B
// indices are distinct (the CPU backend refuses others with RNND_EINVAL; the CUDA backend, whose
// indices are in device memory, leaves the result undefined). So a call never reads a state it
// has already replaced, and the CUDA kernels need no barrier between the blocks that read a row's
// old state and those that write its new one (docs/journal "single step" v19). A
// caller keeps two rows per env and alternates them (the daemon: rows slot and slot + S). The
// inputs (x, is_init, slots, slots_new) never lie in the state tables, nor overlap this call's
// out, h_before or c_before; they may be what the call before wrote there (x = the last out):
// the CUDA backend then waits for that call before it reads them ("single step" v20).
struct rnnd_step {
    int B;
    const float *x;           // (B, I)
    const uint8_t *is_init;   // (B) 0 or 1, or NULL for all 0
    const int32_t *slots;     // (B) table rows the states are read from
    const int32_t *slots_new; // (B) table rows the new states are written to
    float *state_h;           // (rows, L, H)
    float *state_c;           // (rows, L, H) LSTM, else NULL
    float *out;               // (B, H) last layer's new h
    float *h_before;          // (B, L, H) or NULL: the state each row started from (after reset)
    float *c_before;          // (B, L, H) or NULL; LSTM
    // What derive made from params' current values, or NULL: a step of many rows at a large H
    // may then multiply on it (CUDA: fp16 copies of the weights); without it, on params alone.
    const void *derived;
};

// Element types of the tensors a client sends and receives. Compute and storage stay fp32; cast
// converts at the edge (round to nearest even; fp16 keeps subnormals and overflows to Inf).
enum rnnd_ftype { RNND_FTYPE_F32, RNND_FTYPE_BF16, RNND_FTYPE_F16 };

// Bytes per element: 4, 2, 2.
static inline size_t rnnd_ftype_bytes(enum rnnd_ftype d) {
    return d == RNND_FTYPE_F32 ? 4 : 2;
}

// The trajectory store: every env's recorded steps in the backend's memory (the daemon's
// Forward over `recorded`), written by the step path and read by Forward, with no copy through
// the host. It is R rows of one recorded step each; which row a step goes to (an env's slot and
// its ring position) is the caller's business: the ops only move rows, by index.
struct rnnd_traj_store {
    int64_t R;         // rows
    int E;             // extras width (0: none)
    float *obs;        // (R, I)
    float *extras;     // (R, E), NULL when E = 0
    float *h;          // (R, L, H) the state the step started from (after any reset)
    float *c;          // (R, L, H) LSTM, else NULL
    uint8_t *is_init;  // (R) 0 or 1
    uint64_t *version; // (R) the model version that ran the step
};

// n rows moved between a store and packed arrays: array row i <-> store row rows[i].
// traj_write reads every column the store has (extras when E > 0, c for LSTM); the n indices are
// distinct (the CPU backend refuses others with RNND_EINVAL, the CUDA backend leaves the result
// undefined). traj_read fills the columns that are not NULL.
struct rnnd_traj_rows {
    int n;
    const int32_t *rows; // (n) store rows, 0 <= rows[i] < R
    float *obs;          // (n, I)
    float *extras;       // (n, E)
    float *h, *c;        // (n, L, H)
    uint8_t *is_init;    // (n)
    uint64_t *version;   // (n)
};

// The policy's outputs over N rows of core output h (N, H), as heads_forward writes them and
// as heads_backward reads their gradients (dL/d of the same quantities). Each pointer may be
// NULL (forward: not wanted; backward: a zero gradient); one for a head the model lacks is
// RNND_EINVAL.
struct rnnd_heads {
    float *logits;  // (N, K) discrete head
    float *mean;    // (N, A) Gaussian head
    float *log_std; // (N, A) Gaussian head: action_log_std, the same for every row
    float *value;   // (N) value head
};

// Actions of N rows from the action head's outputs (docs/design.md "Policy"). policy_sample
// writes the action (index or action) and policy_logp reads it; both write logp and entropy
// when they are not NULL. Discrete head: index, from logits. Gaussian head: action, from mean
// and the parameter action_log_std.
struct rnnd_actions {
    int N;
    const float *logits; // (N, K) discrete head
    const float *mean;   // (N, A) Gaussian head
    int64_t *index;      // (N) discrete head: actions in 0 .. K-1
    float *action;       // (N, A) Gaussian head
    float *logp;         // (N) or NULL: log-probability of each row's action
    float *entropy;      // (N) or NULL: entropy of each row's distribution
    // policy_sample only: row i draws from the counter-based generator of rnnd_philox.h keyed
    // by (seed, env_ids[i], steps[i]), so the same key always gives the same action.
    uint64_t seed;
    const uint64_t *env_ids; // (N)
    const uint64_t *steps;   // (N)
    const uint8_t *greedy;   // (N) or NULL: 1 takes the mode (argmax, mean) instead of a draw
};

enum rnnd_optim_kind { RNND_OPTIM_ADAM, RNND_OPTIM_SGD };

// torch.optim.Adam (no amsgrad, L2 weight decay added to the gradient) or torch.optim.SGD
// (no momentum), after torch.nn.utils.clip_grad_norm_(max_grad_norm) over the whole array.
struct rnnd_optim {
    enum rnnd_optim_kind kind;
    float lr;
    float beta1, beta2, eps; // Adam
    float weight_decay;
    float max_grad_norm; // <= 0 or infinite: no clipping
};

// ---------------------------------------------------------------------------------------------
// The backend seam. Every op returns 0 or a negative RNND_E*; on failure its outputs are
// unspecified and nothing else changed. Ops may run asynchronously on a device: results are
// valid after sync (copy_out synchronises).

// What a backend can do, as bits of rnnd_backend_ops.caps, so callers ask for what they need
// rather than for a backend by name.
enum {
    // The backend's memory is host memory: the server reads and writes its buffers directly
    // (no staging copies), and its collectives run on the host communicator (cpu/comm.c).
    RNND_BACKEND_CAP_HOST_MEMORY = 1u << 0,
};

struct rnnd_backend_ops {
    const char *name;           // "cpu" or "cuda"
    unsigned caps;              // RNND_BACKEND_CAP_* bits
    void (*destroy)(void *ctx); // releases the context (rnnd_backend_free calls it)

    // Memory in the backend's address space. alloc returns RNND_ENOMEM when it cannot.
    int (*alloc)(void *ctx, size_t bytes, void **out);
    void (*free)(void *ctx, void *ptr); // free(NULL) does nothing
    // Memory for a large table most of which may never be touched (the trajectory store): the
    // CPU backend maps pages on first touch without reserving them (so its size is bounded by
    // the address space, not by the memory free now), CUDA allocates as alloc does. RNND_ENOMEM
    // when it cannot. Release with free_lazy and the same size.
    int (*alloc_lazy)(void *ctx, size_t bytes, void **out);
    void (*free_lazy)(void *ctx, void *ptr, size_t bytes); // free_lazy(NULL, ...) does nothing
    // Host memory the backend copies from and to fastest (page-locked on CUDA, plain on CPU), for
    // staging buffers reused on every call and socket regions. host_free may run on any thread.
    int (*host_alloc)(void *ctx, size_t bytes, void **out);
    void (*host_free)(void *ctx, void *ptr); // host_free(NULL) does nothing
    // Existing host memory (a client's shared memory) made what host_alloc gives: page-locked
    // and copied from and to as host_alloc's memory is. 0, or RNND_ENOMEM when it cannot (the
    // memory is then as it was); NULL where host memory needs nothing (CPU). host_unregister
    // undoes it before the memory is unmapped; any thread.
    int (*host_register)(void *ctx, void *ptr, size_t bytes);
    void (*host_unregister)(void *ctx, void *ptr);
    // copy_in may return before the copy is done: ordinary host memory may be reused at once (it
    // is staged before the call returns), memory from host_alloc only after the next sync or
    // copy_out. copy_out returns when host_dst holds the data; copy_out_async may return before,
    // and host_dst (host_alloc memory) holds it after the next sync or copy_out.
    int (*copy_in)(void *ctx, void *dst, const void *host_src, size_t bytes);
    int (*copy_out)(void *ctx, void *host_dst, const void *src, size_t bytes);
    int (*copy_out_async)(void *ctx, void *host_dst, const void *src, size_t bytes);
    int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    int (*zero)(void *ctx, void *dst, size_t bytes);
    int (*sync)(void *ctx);
    // mark: a point in the work enqueued so far; sync_mark returns once the work before the last
    // mark is done, while what was enqueued after it may still run (a step's reply need not wait
    // for its trajectory write). A recording holds its mark, and each replay moves it. NULL ops
    // where ops are done when they return (CPU).
    int (*mark)(void *ctx);
    int (*sync_mark)(void *ctx);
    // Synchronous: *first = the index of the first NaN or infinity among n floats at x (backend
    // memory), or -1 when every one is finite. For inputs the server does not read on the host:
    // CUDA regions, and socket regions in host_alloc memory, checked once they are in place.
    int (*nonfinite)(void *ctx, const float *x, size_t n, int64_t *first);
    // Memory another process of this host shared (a CUDA IPC handle of handle_len bytes): maps
    // it, checks that at least offset + size bytes follow, and returns in *base the first byte
    // of [offset, offset + size), with its first head_len bytes copied into head (host) so the
    // caller can check what it holds. RNND_ENOTSUP on a backend without such memory (NULL op),
    // RNND_EINVAL for a malformed handle or range, RNND_EDEVICE when the driver refuses it.
    // Callable from any thread. ipc_close(base) unmaps it.
    int (*ipc_open)(void *ctx, const void *handle, size_t handle_len, uint64_t offset,
                    uint64_t size, void *head, size_t head_len, void **base);
    void (*ipc_close)(void *ctx, void *base);
    // An event other processes of this host can wait for, so that an op's reply may go before
    // its work is done: ipc_event writes its handle (handle_len bytes, the 64 of a
    // cudaIpcEventHandle_t; RNND_ENOTSUP where the driver cannot share one), ipc_record records
    // it after the work enqueued so far. ipc_close first waits for its last record. NULL on
    // backends without (their ops are done when they return). Callable from any thread.
    int (*ipc_event)(void *ctx, void *handle, size_t handle_len);
    int (*ipc_record)(void *ctx);

    // 0 when this backend runs model m, RNND_ENOTSUP (or RNND_EINVAL) otherwise; the server asks
    // once at load time so no request fails on it later.
    int (*supports)(void *ctx, const struct rnnd_model *m);
    // Bytes of the tape rnn_forward saves for rnn_backward over B rows and T steps.
    size_t (*tape_bytes)(void *ctx, const struct rnnd_model *m, int B, int T);

    // Sequence forward. out (B, T, H) is the last layer's h at every step; h_n, c_n (B, L, H) the
    // final states (c_n LSTM only; either may be NULL). tape (tape_bytes, 16-byte aligned as
    // any allocation of the backend) is filled for backward when not NULL.
    int (*rnn_forward)(void *ctx, float *out, float *h_n, float *c_n, void *tape,
                       const struct rnnd_seq *seq, const float *params, const struct rnnd_model *m);
    // Sequence backward over the same seq and params as the forward that filled tape.
    // grad_out (B, T, H); grad_h_n, grad_c_n (B, L, H) or NULL for zero.
    int (*rnn_backward)(void *ctx, const struct rnnd_seq_grads *grads, const float *grad_out,
                        const float *grad_h_n, const float *grad_c_n, const void *tape,
                        const struct rnnd_seq *seq, const float *params,
                        const struct rnnd_model *m);
    // Single step with gathered state (struct rnnd_step).
    int (*rnn_step)(void *ctx, const struct rnnd_step *step, const float *params,
                    const struct rnnd_model *m);
    // Optional (NULL, or 0 bytes, where the backend derives nothing for m): derived_bytes is the
    // size of what derive makes from params for rnn_step (struct rnnd_step.derived), in backend
    // memory of that size. derive enqueues it like any op; call it again after every change to
    // params, before the next step that passes it (a stale copy would step on old weights).
    size_t (*derived_bytes)(void *ctx, const struct rnnd_model *m);
    int (*derive)(void *ctx, void *derived, const float *params, const struct rnnd_model *m);

    // Trajectory store rows (struct rnnd_traj_rows): traj_write scatters r's rows into st,
    // traj_read gathers st's rows into r. The arrays of r and the indices are backend memory.
    int (*traj_write)(void *ctx, const struct rnnd_traj_store *st, const struct rnnd_traj_rows *r,
                      const struct rnnd_model *m);
    int (*traj_read)(void *ctx, const struct rnnd_traj_rows *r, const struct rnnd_traj_store *st,
                     const struct rnnd_model *m);

    // dst (n elements of dst_dtype) = src (n elements of src_dtype), converted; one of the two
    // is RNND_FTYPE_F32 (the other any), and they do not overlap.
    int (*cast)(void *ctx, void *dst, enum rnnd_ftype dst_dtype, const void *src,
                enum rnnd_ftype src_dtype, size_t n);

    // One optimizer update of params (n floats) from grads, t the 1-based step count. grads are
    // clipped in place like clip_grad_norm_; m and v (n floats, Adam only, zero at t = 1) are
    // updated. *grad_norm (host) receives the total norm before clipping; with grad_norm NULL
    // the update may still be running when it returns.
    int (*optim_step)(void *ctx, float *params, float *grads, float *m, float *v, size_t n,
                      const struct rnnd_optim *o, int64_t t, float *grad_norm);

    // The name of the kernels a training step of model m over B rows runs here (rnn_forward
    // with a tape, then rnn_backward, on aligned buffers), for logs, metrics and the bench:
    // "cpu_reference" on the CPU; on CUDA the model and each layer's forward loop, backward loop
    // and weight-gradient product (docs/kernels.md), e.g.
    // "gru_h128_fp32: wgmma_fwd gru_gate_tape_bwd dw16_product". Written to buf (len bytes,
    // NUL-terminated, truncated where it does not fit). 0, or RNND_EINVAL for an invalid model,
    // B < 1 or no buffer.
    int (*plan_name)(void *ctx, const struct rnnd_model *m, int B, char *buf, size_t len);

    // The policy around the core (docs/design.md "Policy"), over N >= 1 independent rows, with
    // m the whole model and params its whole flat array (the core ops take rnnd_model_core(m)
    // and the same params). A backend that leaves these NULL refuses policies in supports.
    // A training step: encoder_forward (B*T rows of obs) -> rnn_forward (x = the last block of
    // acts) -> heads_forward (h = out); then heads_backward -> rnn_backward (grad_out = grad_h,
    // grads->x wanted) -> encoder_backward (grad_out = grads->x).
    //
    // Encoder forward: acts (N, rnnd_model_encoder_acts(m)) receives every layer's output,
    // layer-major: layer j's block (N, enc_width[j]) follows layer j-1's, and the last block is
    // the core's input. RNND_EINVAL without an encoder.
    int (*encoder_forward)(void *ctx, float *acts, const float *obs, int N, const float *params,
                           const struct rnnd_model *m);
    // Encoder backward from grad_out (N, enc_width[last]), the gradient of acts' last block:
    // grad_params (P) += the encoder's weight and bias gradients; grad_obs (N, I) = dL/d obs,
    // or NULL when not wanted.
    int (*encoder_backward)(void *ctx, float *grad_params, float *grad_obs, const float *grad_out,
                            const float *acts, const float *obs, int N, const float *params,
                            const struct rnnd_model *m);
    // Heads forward: fills out's non-NULL members from h (N, H).
    int (*heads_forward)(void *ctx, const struct rnnd_heads *out, const float *h, int N,
                         const float *params, const struct rnnd_model *m);
    // Heads backward from grad's members: grad_params (P) += the heads' gradients; grad_h (N, H)
    // += dL/dh, so that it adds to the core's grad_out in place.
    int (*heads_backward)(void *ctx, float *grad_params, float *grad_h,
                          const struct rnnd_heads *grad, const float *h, int N, const float *params,
                          const struct rnnd_model *m);
    // Draws each row's action (struct rnnd_actions), with its logp and entropy when asked.
    int (*policy_sample)(void *ctx, const struct rnnd_actions *a, const float *params,
                         const struct rnnd_model *m);
    // logp and entropy of the given actions (a->index or a->action read).
    int (*policy_logp)(void *ctx, const struct rnnd_actions *a, const float *params,
                       const struct rnnd_model *m);

    // Optional (NULL where the backend has none): the work that the ops called between
    // record_begin and record_end enqueue is recorded, not run, as one unit (a CUDA graph) that
    // replay enqueues again for a fraction of the separate launches' cost, with the same
    // addresses, sizes and values of host-side arguments; the memory it reads is read at each
    // replay. Inside a recording copy_out does not wait (call sync after replay), and sync,
    // nonfinite and host_alloc must not be called. record_end always ends the recording: *unit
    // is NULL when it failed. free_unit(NULL) does nothing.
    int (*record_begin)(void *ctx);
    int (*record_end)(void *ctx, void **unit);
    int (*replay)(void *ctx, void *unit);
    void (*free_unit)(void *ctx, void *unit);

    // Optional (NULL where any thread may call every op as it is): binds the calling thread to
    // the context's device, so that a thread other than the one that opened it may run ops (one
    // thread at a time, as ever). CUDA: cudaSetDevice.
    int (*bind)(void *ctx);
};

struct rnnd_backend {
    const struct rnnd_backend_ops *ops;
    void *ctx;
    char device[128]; // human-readable device name, e.g. "cpu (2 threads)" or "NVIDIA H100"
};

// The CPU reference backend; always built. Returns 0, or RNND_ENOMEM.
int rnnd_backend_cpu_init(struct rnnd_backend *b);
// Call first thing in main(argv): when OpenBLAS did not recognise this CPU and loaded its slow
// generic kernels, sets OPENBLAS_CORETYPE from the CPU's features and re-executes the program once
// (execv of its own path, so it keeps its name), so the library loads again with fast ones. Returns when nothing
// needed doing or the re-exec failed.
void rnnd_cpu_blas_reexec(char **argv);
// The CUDA backend on device `device`: RNND_ENOTSUP in a build without CUDA, RNND_EDEVICE when no
// such device is usable.
int rnnd_backend_cuda_init(struct rnnd_backend *b, int device);
// Releases what init made; a zeroed struct is a no-op.
void rnnd_backend_free(struct rnnd_backend *b);

// ---------------------------------------------------------------------------------------------
// Argument checks shared by the backends (so both refuse the same input with the same code).

// 0 when seq is a valid batch for m (a core-only model: rnnd_model_core; B, T >= 1, x and
// is_init set, LSTM state pairs consistent, h0 and hidden not both), RNND_EINVAL otherwise.
int rnnd_seq_check(const struct rnnd_seq *seq, const struct rnnd_model *m);
// 0 when step is a valid single-step batch for m (core-only), RNND_EINVAL otherwise.
int rnnd_step_check(const struct rnnd_step *step, const struct rnnd_model *m);
// 0 when the encoder ops can run over N rows of m (valid, with an encoder, N >= 1, the arrays
// they read and write given), RNND_EINVAL otherwise.
int rnnd_encoder_check(const struct rnnd_model *m, int N, const void *out, const void *in);
// 0 when hd's members match m's heads (none for a head m lacks), N >= 1 and h given.
int rnnd_heads_check(const struct rnnd_heads *hd, const float *h, int N,
                     const struct rnnd_model *m);
// 0 when a fits m's action head (m has one; N >= 1; logits or mean, and index or action, given;
// for sample, env_ids and steps too), RNND_EINVAL otherwise.
int rnnd_actions_check(const struct rnnd_actions *a, const struct rnnd_model *m, bool sample);
// 0 when r can move rows of st for m (n >= 1, indices given, the columns traj_write needs when
// write), RNND_EINVAL otherwise. The indices themselves are checked by the CPU backend only.
int rnnd_traj_check(const struct rnnd_traj_store *st, const struct rnnd_traj_rows *r,
                    const struct rnnd_model *m, bool write);
// 0 when o holds usable hyperparameters (finite lr > 0, betas in [0, 1), eps > 0,
// weight_decay >= 0), RNND_EINVAL otherwise.
int rnnd_optim_check(const struct rnnd_optim *o);

// The conversions of cast, one element (host code; the CPU backend's cast uses them).
uint16_t rnnd_f32_to_bf16(float f);
uint16_t rnnd_f32_to_f16(float f);
float rnnd_bf16_to_f32(uint16_t h);
float rnnd_f16_to_f32(uint16_t h);
// Casts n elements on the host (the same conversions as the backends' cast); narrowing fp32 to a
// 16-bit type may be done in place (dst == src), as it goes in increasing order.
void rnnd_cast_host(void *dst, enum rnnd_ftype dst_dtype, const void *src,
                    enum rnnd_ftype src_dtype, size_t n);

// The index of the first NaN or infinity among n elements of type ft at p (host memory, any
// alignment, little-endian), or n when every one is finite.
size_t rnnd_first_nonfinite(const void *p, enum rnnd_ftype ft, size_t n);

// Round-to-nearest-even fp32 -> bf16 -> fp32, as the bf16 compute mode rounds matmul operands.
static inline float rnnd_round_bf16(float f) {
    union {
        float f;
        uint32_t u;
    } v = {f};
    if ((v.u & 0x7f800000u) != 0x7f800000u) // leave Inf/NaN alone
        v.u += 0x7fffu + ((v.u >> 16) & 1u);
    v.u &= 0xffff0000u;
    return v.f;
}

#ifdef __cplusplus
}
#endif

#endif // RNND_KERNELS_H
