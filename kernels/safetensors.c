/*
 * safetensors.c: encode and decode the safetensors format in memory (see rnnd_safetensors.h).
 *
 * The decoder is written for untrusted input (files from disk, from users): every length and
 * offset is checked before use, the JSON parser accepts only the shapes safetensors uses (an
 * object of objects with strings, integer arrays and one string map) and nests at most two deep.
 */
#include "rnnd_safetensors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The format caps the header at 100 MB; a larger length is a corrupt or hostile file.
#define ST_MAX_HEADER (100u * 1000u * 1000u)

static const char *const dtype_names[] = {"F32", "I64", "U8", "BOOL"};

size_t rnnd_st_dtype_size(enum rnnd_st_dtype dtype) {
    return dtype == RNND_ST_F32 ? 4 : dtype == RNND_ST_I64 ? 8 : 1;
}

static bool tensor_count(const struct rnnd_st_tensor *t, size_t *count) {
    size_t n = 1;
    if (t->ndim < 0 || t->ndim > RNND_ST_MAX_DIMS)
        return false;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 || (t->shape[d] > 0 && n > SIZE_MAX / (size_t)t->shape[d]))
            return false;
        n *= (size_t)t->shape[d];
    }
    *count = n;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Encoding

// A growable string for the JSON header.
struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

static void sbuf_printf(struct sbuf *s, const char *fmt, ...) {
    if (s->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(s->p ? s->p + s->len : NULL, s->cap - s->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            s->oom = true;
            return;
        }
        if ((size_t)n < s->cap - s->len) {
            s->len += (size_t)n;
            return;
        }
        size_t cap = (s->cap + (size_t)n + 1) * 2;
        char *p = realloc(s->p, cap);
        if (p == NULL) {
            s->oom = true;
            return;
        }
        s->p = p;
        s->cap = cap;
    }
}

static void sbuf_json_string(struct sbuf *s, const char *str) {
    sbuf_printf(s, "\"");
    for (const unsigned char *c = (const unsigned char *)str; *c; c++) {
        if (*c == '"' || *c == '\\')
            sbuf_printf(s, "\\%c", *c);
        else if (*c < 0x20)
            sbuf_printf(s, "\\u%04x", *c);
        else
            sbuf_printf(s, "%c", *c);
    }
    sbuf_printf(s, "\"");
}

int rnnd_st_encode(const struct rnnd_st_tensor *t, int n, const char *const *meta, int n_meta,
                   void **out, size_t *out_len) {
    if (n < 0 || n_meta < 0 || (n > 0 && t == NULL) || (n_meta > 0 && meta == NULL) || !out ||
        !out_len)
        return RNND_EINVAL;
    for (int i = 0; i < n; i++) {
        size_t count;
        if (t[i].name == NULL || t[i].name[0] == '\0' || (unsigned)t[i].dtype > RNND_ST_BOOL ||
            !tensor_count(&t[i], &count) || count * rnnd_st_dtype_size(t[i].dtype) != t[i].bytes ||
            (t[i].bytes > 0 && t[i].data == NULL) || strcmp(t[i].name, "__metadata__") == 0)
            return RNND_EINVAL;
        for (int j = 0; j < i; j++)
            if (strcmp(t[i].name, t[j].name) == 0)
                return RNND_EINVAL;
    }

    struct sbuf h = {0};
    size_t offset = 0;
    sbuf_printf(&h, "{");
    if (n_meta > 0) {
        sbuf_printf(&h, "\"__metadata__\":{");
        for (int i = 0; i < n_meta; i++) {
            sbuf_printf(&h, i ? "," : "");
            sbuf_json_string(&h, meta[2 * i]);
            sbuf_printf(&h, ":");
            sbuf_json_string(&h, meta[2 * i + 1]);
        }
        sbuf_printf(&h, "}");
    }
    for (int i = 0; i < n; i++) {
        sbuf_printf(&h, (i || n_meta) ? "," : "");
        sbuf_json_string(&h, t[i].name);
        sbuf_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", dtype_names[t[i].dtype]);
        for (int d = 0; d < t[i].ndim; d++)
            sbuf_printf(&h, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        sbuf_printf(&h, "],\"data_offsets\":[%zu,%zu]}", offset, offset + t[i].bytes);
        offset += t[i].bytes;
    }
    sbuf_printf(&h, "}");
    while (!h.oom && h.len % 8 != 0) // pad so the data starts 8-byte aligned
        sbuf_printf(&h, " ");
    if (h.oom) {
        free(h.p);
        return RNND_ENOMEM;
    }

    size_t total = 8 + h.len + offset;
    unsigned char *buf = malloc(total ? total : 1);
    if (buf == NULL) {
        free(h.p);
        return RNND_ENOMEM;
    }
    for (int b = 0; b < 8; b++)
        buf[b] = (unsigned char)((uint64_t)h.len >> (8 * b));
    memcpy(buf + 8, h.p, h.len);
    unsigned char *data = buf + 8 + h.len;
    for (int i = 0; i < n; i++) {
        if (t[i].bytes)
            memcpy(data, t[i].data, t[i].bytes);
        data += t[i].bytes;
    }
    free(h.p);
    *out = buf;
    *out_len = total;
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Decoding: a strict parser for the subset of JSON a safetensors header uses.

struct parser {
    const char *start, *p, *end;
    char *err;
    size_t errlen;
    int status;
};

static bool fail(struct parser *ps, int status, const char *fmt, ...) {
    if (ps->status == 0) {
        ps->status = status;
        if (ps->errlen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(ps->err, ps->errlen, fmt, ap);
            va_end(ap);
        }
    }
    return false;
}

static void skip_ws(struct parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t'))
        ps->p++;
}

static bool expect(struct parser *ps, char c) {
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == c) {
        ps->p++;
        return true;
    }
    return fail(ps, RNND_ECORRUPT, "safetensors header: expected '%c' at byte %td", c,
                ps->p - ps->start);
}

static bool peek(struct parser *ps, char c) {
    skip_ws(ps);
    return ps->p < ps->end && *ps->p == c;
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

// Parses a JSON string into a new NUL-terminated copy (\uXXXX escapes become UTF-8).
static char *parse_string(struct parser *ps) {
    if (!expect(ps, '"'))
        return NULL;
    size_t cap = (size_t)(ps->end - ps->p) + 1;
    char *s = malloc(cap);
    if (s == NULL) {
        fail(ps, RNND_ENOMEM, "out of memory");
        return NULL;
    }
    size_t n = 0;
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned char c = (unsigned char)*ps->p++;
        if (c < 0x20)
            goto bad;
        if (c != '\\') {
            s[n++] = (char)c;
            continue;
        }
        if (ps->p >= ps->end)
            goto bad;
        char e = *ps->p++;
        const char *simple = strchr("\"\\/bfnrt", e);
        if (simple && e != '\0') {
            static const char map[] = "\"\\/\b\f\n\r\t";
            s[n++] = map[simple - "\"\\/bfnrt"];
        } else if (e == 'u') {
            unsigned v = 0;
            for (int k = 0; k < 4; k++) {
                int d = ps->p < ps->end ? hex_digit(*ps->p++) : -1;
                if (d < 0)
                    goto bad;
                v = v * 16 + (unsigned)d;
            }
            if (v == 0 || (v >= 0xd800 && v <= 0xdfff)) // NUL or a lone surrogate half
                goto bad;
            if (v < 0x80) {
                s[n++] = (char)v;
            } else if (v < 0x800) {
                s[n++] = (char)(0xc0 | (v >> 6));
                s[n++] = (char)(0x80 | (v & 0x3f));
            } else {
                s[n++] = (char)(0xe0 | (v >> 12));
                s[n++] = (char)(0x80 | ((v >> 6) & 0x3f));
                s[n++] = (char)(0x80 | (v & 0x3f));
            }
        } else {
            goto bad;
        }
    }
    if (ps->p >= ps->end)
        goto bad;
    ps->p++; // closing quote
    s[n] = '\0';
    return s;
bad:
    free(s);
    fail(ps, RNND_ECORRUPT, "safetensors header: malformed string");
    return NULL;
}

static bool parse_u64(struct parser *ps, uint64_t *v) {
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
        return fail(ps, RNND_ECORRUPT, "safetensors header: expected a non-negative integer");
    uint64_t x = 0;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        uint64_t d = (uint64_t)(*ps->p++ - '0');
        if (x > (UINT64_MAX - d) / 10)
            return fail(ps, RNND_ECORRUPT, "safetensors header: integer out of range");
        x = x * 10 + d;
    }
    *v = x;
    return true;
}

// [u64, u64, ...] with at most max entries.
static bool parse_u64_array(struct parser *ps, uint64_t *v, int max, int *count) {
    if (!expect(ps, '['))
        return false;
    *count = 0;
    if (peek(ps, ']'))
        return expect(ps, ']');
    do {
        if (*count == max)
            return fail(ps, RNND_ECORRUPT, "safetensors header: array longer than %d", max);
        if (!parse_u64(ps, &v[(*count)++]))
            return false;
    } while (peek(ps, ',') && expect(ps, ','));
    return expect(ps, ']');
}

static bool parse_metadata(struct parser *ps, struct rnnd_st_file *f) {
    if (!expect(ps, '{'))
        return false;
    if (peek(ps, '}'))
        return expect(ps, '}');
    do {
        char **meta = realloc(f->meta, sizeof(char *) * 2 * (size_t)(f->n_meta + 1));
        if (meta == NULL)
            return fail(ps, RNND_ENOMEM, "out of memory");
        f->meta = meta;
        meta[2 * f->n_meta] = parse_string(ps);
        if (meta[2 * f->n_meta] == NULL)
            return false;
        meta[2 * f->n_meta + 1] = NULL;
        f->n_meta++;
        if (!expect(ps, ':') || (meta[2 * f->n_meta - 1] = parse_string(ps)) == NULL)
            return false;
    } while (peek(ps, ',') && expect(ps, ','));
    return expect(ps, '}');
}

// {"dtype": "...", "shape": [...], "data_offsets": [b, e]} in any order, each key once.
static bool parse_tensor(struct parser *ps, struct rnnd_st_tensor *t, uint64_t off[2]) {
    bool have_dtype = false, have_shape = false, have_offsets = false;
    if (!expect(ps, '{'))
        return false;
    do {
        char *key = parse_string(ps);
        if (key == NULL || !expect(ps, ':')) {
            free(key);
            return false;
        }
        bool ok;
        if (strcmp(key, "dtype") == 0 && !have_dtype) {
            char *dt = parse_string(ps);
            ok = dt != NULL;
            if (ok) {
                int k = 0;
                while (k < 4 && strcmp(dt, dtype_names[k]) != 0)
                    k++;
                if (k == 4)
                    ok = fail(ps, RNND_ENOTSUP,
                              "tensor \"%s\" has dtype %s; rnnd reads F32, I64, U8 and BOOL",
                              t->name, dt);
                t->dtype = (enum rnnd_st_dtype)k;
            }
            free(dt);
            have_dtype = true;
        } else if (strcmp(key, "shape") == 0 && !have_shape) {
            uint64_t shape[RNND_ST_MAX_DIMS];
            ok = parse_u64_array(ps, shape, RNND_ST_MAX_DIMS, &t->ndim);
            for (int d = 0; ok && d < t->ndim; d++) {
                if (shape[d] > (uint64_t)INT64_MAX)
                    ok = fail(ps, RNND_ECORRUPT, "safetensors header: dimension out of range");
                t->shape[d] = (int64_t)shape[d];
            }
            have_shape = true;
        } else if (strcmp(key, "data_offsets") == 0 && !have_offsets) {
            int count = 0;
            ok = parse_u64_array(ps, off, 2, &count);
            if (ok && count != 2)
                ok =
                    fail(ps, RNND_ECORRUPT, "tensor \"%s\": data_offsets needs 2 entries", t->name);
            have_offsets = true;
        } else {
            ok = fail(ps, RNND_ECORRUPT, "tensor \"%s\": unexpected or repeated key \"%s\"",
                      t->name, key);
        }
        free(key);
        if (!ok)
            return false;
    } while (peek(ps, ',') && expect(ps, ','));
    if (!expect(ps, '}'))
        return false;
    if (!have_dtype || !have_shape || !have_offsets)
        return fail(ps, RNND_ECORRUPT, "tensor \"%s\": needs dtype, shape and data_offsets",
                    t->name);
    return true;
}

struct span {
    uint64_t begin, end;
};

static int span_cmp(const void *a, const void *b) {
    const struct span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

int rnnd_st_decode(const void *buf, size_t len, struct rnnd_st_file *f, char *err, size_t errlen) {
    memset(f, 0, sizeof(*f));
    if (errlen)
        err[0] = '\0';
    struct parser ps = {.err = err, .errlen = errlen};
    const unsigned char *b = buf;
    uint64_t hlen = 0;
    if (buf == NULL || len < 8) {
        fail(&ps, RNND_ECORRUPT, "not a safetensors file: %zu bytes, shorter than its header", len);
        return ps.status;
    }
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)b[i] << (8 * i);
    if (hlen > ST_MAX_HEADER || hlen > len - 8) {
        fail(&ps, RNND_ECORRUPT, "not a safetensors file: header length %llu exceeds the file",
             (unsigned long long)hlen);
        return ps.status;
    }
    ps.start = ps.p = (const char *)b + 8;
    ps.end = ps.p + hlen;
    const unsigned char *data = b + 8 + hlen;
    uint64_t data_len = len - 8 - hlen;

    struct span *spans = NULL;
    bool have_meta = false;
    if (!expect(&ps, '{'))
        goto fail;
    if (!peek(&ps, '}')) {
        do {
            char *name = parse_string(&ps);
            if (name == NULL || !expect(&ps, ':')) {
                free(name);
                goto fail;
            }
            if (strcmp(name, "__metadata__") == 0) {
                free(name);
                if (have_meta || !parse_metadata(&ps, f)) {
                    fail(&ps, RNND_ECORRUPT, "safetensors header: bad or repeated __metadata__");
                    goto fail;
                }
                have_meta = true;
                continue;
            }
            struct rnnd_st_tensor *ts = realloc(f->tensors, sizeof(*ts) * (size_t)(f->n + 1));
            struct span *sp = realloc(spans, sizeof(*sp) * (size_t)(f->n + 1));
            if (ts)
                f->tensors = ts;
            if (sp)
                spans = sp;
            if (!ts || !sp) {
                free(name);
                fail(&ps, RNND_ENOMEM, "out of memory");
                goto fail;
            }
            struct rnnd_st_tensor *t = &f->tensors[f->n++];
            memset(t, 0, sizeof(*t));
            t->name = name;
            uint64_t off[2];
            if (rnnd_st_find(f, name) != t) {
                fail(&ps, RNND_ECORRUPT, "safetensors header: tensor \"%s\" appears twice", name);
                goto fail;
            }
            if (!parse_tensor(&ps, t, off))
                goto fail;
            size_t count;
            if (off[0] > off[1] || off[1] > data_len || !tensor_count(t, &count) ||
                count > SIZE_MAX / rnnd_st_dtype_size(t->dtype) ||
                count * rnnd_st_dtype_size(t->dtype) != off[1] - off[0]) {
                fail(&ps, RNND_ECORRUPT,
                     "tensor \"%s\": data_offsets [%llu, %llu] do not fit its shape and dtype "
                     "inside %llu data bytes",
                     name, (unsigned long long)off[0], (unsigned long long)off[1],
                     (unsigned long long)data_len);
                goto fail;
            }
            t->data = data + off[0];
            t->bytes = (size_t)(off[1] - off[0]);
            spans[f->n - 1] = (struct span){off[0], off[1]};
        } while (peek(&ps, ',') && expect(&ps, ','));
    }
    if (!expect(&ps, '}'))
        goto fail;
    skip_ws(&ps);
    if (ps.p != ps.end) {
        fail(&ps, RNND_ECORRUPT, "safetensors header: trailing bytes after the JSON object");
        goto fail;
    }
    // The tensors must tile the data exactly: a gap or an overlap means a damaged file.
    if (f->n > 0)
        qsort(spans, (size_t)f->n, sizeof(*spans), span_cmp);
    uint64_t at = 0;
    for (int i = 0; i < f->n; i++) {
        if (spans[i].begin != at) {
            fail(&ps, RNND_ECORRUPT, "safetensors data: gap or overlap at byte %llu",
                 (unsigned long long)at);
            goto fail;
        }
        at = spans[i].end;
    }
    if (at != data_len) {
        fail(&ps, RNND_ECORRUPT, "safetensors data: %llu bytes present, tensors cover %llu",
             (unsigned long long)data_len, (unsigned long long)at);
        goto fail;
    }
    free(spans);
    return 0;

fail:
    free(spans);
    rnnd_st_file_free(f);
    return ps.status;
}

void rnnd_st_file_free(struct rnnd_st_file *f) {
    if (f == NULL)
        return;
    for (int i = 0; i < f->n; i++)
        free((char *)f->tensors[i].name);
    for (int i = 0; i < 2 * f->n_meta; i++)
        free(f->meta[i]);
    free(f->tensors);
    free(f->meta);
    memset(f, 0, sizeof(*f));
}

const struct rnnd_st_tensor *rnnd_st_find(const struct rnnd_st_file *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (f->tensors[i].name && strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    return NULL;
}

const char *rnnd_st_meta(const struct rnnd_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0)
            return f->meta[2 * i + 1];
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Model parameters

int rnnd_st_encode_params(const struct rnnd_model *m, const float *params, const char *const *meta,
                          int n_meta, void **out, size_t *out_len) {
    if (rnnd_model_check(m) != 0 || params == NULL)
        return RNND_EINVAL;
    int n = rnnd_model_param_tensors(m);
    struct rnnd_param_tensor p[RNND_MAX_PARAM_TENSORS];
    struct rnnd_st_tensor t[RNND_MAX_PARAM_TENSORS];
    for (int k = 0; k < n; k++) {
        rnnd_model_param_tensor(m, k, &p[k]);
        t[k] = (struct rnnd_st_tensor){.name = p[k].name,
                                       .dtype = RNND_ST_F32,
                                       .ndim = p[k].ndim,
                                       .shape = {p[k].shape[0], p[k].shape[1]},
                                       .data = params + p[k].offset,
                                       .bytes = p[k].count * sizeof(float)};
    }
    return rnnd_st_encode(t, n, meta, n_meta, out, out_len);
}

int rnnd_st_decode_params(const struct rnnd_model *m, const struct rnnd_st_file *f, float *params,
                          char *err, size_t errlen) {
    struct parser ps = {.err = err, .errlen = errlen};
    if (errlen)
        err[0] = '\0';
    if (rnnd_model_check(m) != 0 || f == NULL || params == NULL) {
        fail(&ps, RNND_EINVAL, "invalid model or arguments");
        return ps.status;
    }
    int n = rnnd_model_param_tensors(m);
    for (int i = 0; i < f->n; i++)
        if (rnnd_model_param_find(m, f->tensors[i].name) < 0) {
            fail(&ps, RNND_EINVAL,
                 "unexpected tensor \"%s\": this model (%d layer(s)%s) has none by that name",
                 f->tensors[i].name, m->L, rnnd_model_has_policy(m) ? ", with a policy" : "");
            return ps.status;
        }
    // Check everything before copying anything, so a refused file changes nothing.
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < n; k++) {
            struct rnnd_param_tensor p;
            rnnd_model_param_tensor(m, k, &p);
            const struct rnnd_st_tensor *t = rnnd_st_find(f, p.name);
            if (pass == 1) {
                memcpy(params + p.offset, t->data, t->bytes);
                continue;
            }
            if (t == NULL) {
                fail(&ps, RNND_EINVAL, "missing tensor \"%s\"", p.name);
                return ps.status;
            }
            bool shape_ok = t->ndim == p.ndim && t->shape[0] == p.shape[0] &&
                            (p.ndim == 1 || t->shape[1] == p.shape[1]);
            if (t->dtype != RNND_ST_F32 || !shape_ok) {
                if (p.ndim == 2)
                    fail(&ps, RNND_EINVAL, "tensor \"%s\": expected F32 [%lld, %lld]", p.name,
                         (long long)p.shape[0], (long long)p.shape[1]);
                else
                    fail(&ps, RNND_EINVAL, "tensor \"%s\": expected F32 [%lld]", p.name,
                         (long long)p.shape[0]);
                return ps.status;
            }
        }
    }
    return 0;
}
