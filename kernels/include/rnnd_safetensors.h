/*
 * rnnd_safetensors.h: the safetensors format, in memory. Checkpoints (model.safetensors and the
 * other parts of a checkpoint directory) and `rnndctl weights import|export` use it, so that
 * `safetensors.torch.load_file` reads what rnnd writes and rnnd reads what PyTorch users save.
 *
 * Format: an 8-byte little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {"key": "value"}}, padded with spaces to a multiple of 8, then the data; offsets
 * are relative to the start of the data and the tensors tile it without gaps or overlap.
 * Pure functions over buffers: no file I/O here, no global state.
 */
#ifndef RNND_SAFETENSORS_H
#define RNND_SAFETENSORS_H

#include "rnnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

enum rnnd_st_dtype { RNND_ST_F32, RNND_ST_I64, RNND_ST_U8, RNND_ST_BOOL };

#define RNND_ST_MAX_DIMS 8

struct rnnd_st_tensor {
    const char *name;
    enum rnnd_st_dtype dtype;
    int ndim;
    int64_t shape[RNND_ST_MAX_DIMS];
    const void *data; // bytes of data, little-endian, row-major; possibly unaligned
    size_t bytes;
};

// A decoded file: tensors and metadata point into the decoder's own copies of the names and
// into the caller's buffer for data, so the buffer must outlive the file.
struct rnnd_st_file {
    struct rnnd_st_tensor *tensors;
    int n;
    char **meta; // 2 * n_meta strings: key, value, key, value...
    int n_meta;
};

// Bytes per element of dtype.
size_t rnnd_st_dtype_size(enum rnnd_st_dtype dtype);

// Encodes n tensors (borrowed) and n_meta key/value string pairs (meta[2i], meta[2i+1]; may be
// NULL when n_meta is 0) into a new buffer *out of *out_len bytes; free it with free().
// RNND_EINVAL when a tensor's bytes do not match its shape or a name is empty or repeated,
// RNND_ENOMEM when allocation fails.
int rnnd_st_encode(const struct rnnd_st_tensor *t, int n, const char *const *meta, int n_meta,
                   void **out, size_t *out_len);

// Parses buf (borrowed) into *f; free with rnnd_st_file_free. On malformed input returns
// RNND_ECORRUPT and writes a one-line reason into err (errlen bytes, may be 0); RNND_ENOMEM when
// allocation fails. Dtypes other than the four above are refused as RNND_ENOTSUP (named in err).
int rnnd_st_decode(const void *buf, size_t len, struct rnnd_st_file *f, char *err, size_t errlen);
void rnnd_st_file_free(struct rnnd_st_file *f);

// The tensor called name, or NULL.
const struct rnnd_st_tensor *rnnd_st_find(const struct rnnd_st_file *f, const char *name);
// The metadata value for key, or NULL.
const char *rnnd_st_meta(const struct rnnd_st_file *f, const char *key);

// Encodes the model's parameters (host, P floats, the flat layout of rnnd_kernels.h) as its
// PyTorch-named tensors (weight_ih_l0, ...), loadable into nn.GRU / nn.LSTM (a core-only model)
// or rnnd.torch.Policy (a model with a policy) with load_state_dict. Same ownership and errors
// as rnnd_st_encode.
int rnnd_st_encode_params(const struct rnnd_model *m, const float *params, const char *const *meta,
                          int n_meta, void **out, size_t *out_len);

// Copies every parameter tensor of m out of f into params (host, P floats). Every tensor must be
// there, F32, with the model's shape, and f must hold no other tensor; otherwise RNND_EINVAL with
// the offending name and what was expected in err, and params is left untouched.
int rnnd_st_decode_params(const struct rnnd_model *m, const struct rnnd_st_file *f, float *params,
                          char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif // RNND_SAFETENSORS_H
