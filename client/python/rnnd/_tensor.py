"""numpy <-> rnnd.v1.Tensor.

Tensors travel row-major and little-endian (docs/design.md). Encoding a C-contiguous array that
already has the wire dtype costs one copy (``tobytes``; protobuf wants ``bytes``). Decoding
costs none: replies whose tensors are large are read with ``Lazy``, whose tensors' data are
views of the reply's bytes as gRPC hands them over (protobuf's parser would copy them), and the
array is a read-only view over that (call ``.copy()`` for a writable one). bfloat16 has no
numpy dtype: it decodes to float32.
"""

import numpy as np

from .v1 import rnnd_pb2 as pb

# wire dtype -> numpy dtype (little-endian)
_NP = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.BOOL: np.dtype("|b1"),
    pb.INT64: np.dtype("<i8"),
    pb.BFLOAT16: np.dtype("<u2"),  # raw bits; widened to float32 by decode
}


def encode(array, dtype=None, out=None):
    """Returns (or fills ``out`` with) a Tensor holding ``array``.

    dtype: a wire DType; by default bool arrays go as BOOL, integer arrays as INT64 and
    everything else as FLOAT32. With BFLOAT16 a uint16 array is taken as bfloat16 bit patterns
    (torch: ``t.bfloat16().view(torch.int16).numpy().view(np.uint16)``).
    """
    a = np.asarray(array)
    if dtype is None:
        if a.dtype == np.bool_:
            dtype = pb.BOOL
        elif np.issubdtype(a.dtype, np.integer):
            dtype = pb.INT64
        else:
            dtype = pb.FLOAT32
    if dtype == pb.BFLOAT16 and a.dtype == np.uint16:
        data = np.ascontiguousarray(a, dtype="<u2").tobytes()  # bfloat16 bit patterns as they are
    elif dtype == pb.BFLOAT16:
        data = bf16_bits(a).tobytes()
    else:
        data = np.ascontiguousarray(a, dtype=_NP[dtype]).tobytes()
    t = out if out is not None else pb.Tensor()
    t.shape[:] = a.shape
    t.dtype = dtype
    t.data = data
    return t


def bf16_bits(a):
    """The bfloat16 bit patterns (uint16) of float array a, rounded to nearest even as torch
    rounds."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4")
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def bf16_widen(bits):
    """float32 values of bfloat16 bit patterns (a uint16 array), as a new array."""
    w = bits.astype("<u4")
    w <<= 16
    return w.view("<f4")


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_field(number, array, dtype=None):
    """Tensor field ``number`` of a message, serialised, as a list of byte chunks whose join is
    the field (protobuf merges fields appended to a serialised message): the data is copied once,
    by the join, where encode() and SerializeToString() copy it three times."""
    a = np.asarray(array)
    if dtype == pb.BFLOAT16 and a.dtype != np.uint16:
        data = np.frombuffer(encode(a, dtype).data, dtype="<u2")
    else:
        if dtype is None:
            dtype = pb.FLOAT32
        data = np.ascontiguousarray(a, dtype="<u2" if dtype == pb.BFLOAT16 else _NP[dtype])
    head = pb.Tensor(shape=a.shape, dtype=dtype).SerializeToString()
    body = memoryview(data).cast("B")
    inner = head + b"\x1a" + _varint(body.nbytes)
    return [_varint(number << 3 | 2), _varint(len(inner) + body.nbytes), inner, body]


def decode(t):
    """The numpy array of Tensor ``t`` (read-only view), or None when the field is empty."""
    if t is None or (len(t.shape) == 0 and len(t.data) == 0 and t.dtype == 0):
        return None
    dt = _NP.get(t.dtype)
    if dt is None:
        raise ValueError("tensor with unknown dtype %d" % t.dtype)
    shape = tuple(t.shape)
    a = np.frombuffer(t.data, dtype=dt)
    n = int(np.prod(shape, dtype=np.int64))
    if a.size != n:
        raise ValueError("tensor of shape %s holds %d elements, expected %d" % (shape, a.size, n))
    if t.dtype == pb.BFLOAT16:
        a = bf16_widen(a)
    return a.reshape(shape)


def field(msg, name):
    """decode(msg.name) when the message carries that tensor field, else None."""
    if not msg.HasField(name):
        return None
    return decode(getattr(msg, name))


# ---------------------------------------------------------------------------------------------
# Reading replies without copying their tensors (protobuf's wire format, docs/design.md).

def _varint_at(b, i):
    n = shift = 0
    while True:
        if i >= len(b) or shift > 63:
            raise ValueError("malformed reply: a varint runs past its end")
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        if c < 0x80:
            return n, i
        shift += 7


def _fields(b):
    """(number, wire type, value, start, end) of each field of the serialised message b (a
    memoryview); a length-delimited value is a view of b."""
    i, n = 0, len(b)
    while i < n:
        start = i
        key, i = _varint_at(b, i)
        number, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint_at(b, i)
        elif wt == 2:
            ln, i = _varint_at(b, i)
            v, i = b[i:i + ln], i + ln
        elif wt in (1, 5):
            v, i = b[i:i + (8 if wt == 1 else 4)], i + (8 if wt == 1 else 4)
        else:
            raise ValueError("malformed reply: wire type %d" % wt)
        if i > n:
            raise ValueError("malformed reply: a field runs past the message's end")
        yield number, wt, v, start, i


class View:
    """A Tensor as pb.Tensor has it (shape, dtype, data, region), read from a serialised message
    without copying: data is a view of the message's bytes. array: the same bytes as a numpy
    array that a shared-memory span leased (shm.Call.view), or None."""

    __slots__ = ("shape", "dtype", "data", "region", "array")

    def __init__(self, b):
        self.shape, self.dtype, self.data, self.region, self.array = [], 0, b"", None, None
        for number, wt, v, _, _ in _fields(b):
            if number == 1 and wt == 2:  # packed
                j = 0
                while j < len(v):
                    x, j = _varint_at(v, j)
                    self.shape.append(x)
            elif number == 1:
                self.shape.append(v)
            elif number == 2:
                self.dtype = v
            elif number == 3:
                self.data = v
            elif number == 100:
                self.region = pb.RegionSpan.FromString(bytes(v))

    def HasField(self, name):
        return name == "region" and self.region is not None


_TENSOR_FIELDS = {}


def _repeated(f):
    # protobuf >= 5 has is_repeated; older ones only label (which protobuf 7 removed)
    return f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED


class Lazy:
    """A serialised reply of message class cls, parsed but for its top-level Tensor fields,
    which are Views of ``data`` (bytes, kept alive by the views). Reads like the message."""

    def __init__(self, cls, data):
        fields = _TENSOR_FIELDS.get(cls)
        if fields is None:
            fields = _TENSOR_FIELDS[cls] = {
                f.number: f.name for f in cls.DESCRIPTOR.fields
                if f.message_type is pb.Tensor.DESCRIPTOR and not _repeated(f)}
        b = memoryview(data)
        views, rest = {}, []
        for number, wt, v, start, end in _fields(b):
            name = fields.get(number)
            if name is not None and wt == 2:
                views[name] = View(v)
            else:
                rest.append(b[start:end])
        self._views = views
        self._msg = cls.FromString(b"".join(rest))

    def __getattr__(self, name):
        v = self.__dict__["_views"].get(name)
        return v if v is not None else getattr(self.__dict__["_msg"], name)

    def HasField(self, name):
        return name in self._views or self._msg.HasField(name)
