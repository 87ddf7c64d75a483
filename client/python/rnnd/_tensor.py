"""numpy <-> rnnd.v1.Tensor.

Tensors travel row-major and little-endian (docs/design.md). Encoding a C-contiguous array that
already has the wire dtype costs one copy (``tobytes``; protobuf wants ``bytes``). Decoding
costs none beyond the ``bytes`` object protobuf hands out: the array is a read-only view over
it (call ``.copy()`` for a writable one). bfloat16 has no numpy dtype: it decodes to float32.
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
        f = np.ascontiguousarray(a, dtype="<f4")
        u = f.view("<u4")
        # round to nearest even, as torch does
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        data = bits.tobytes()
    else:
        data = np.ascontiguousarray(a, dtype=_NP[dtype]).tobytes()
    t = out if out is not None else pb.Tensor()
    t.shape[:] = a.shape
    t.dtype = dtype
    t.data = data
    return t


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
        a = (a.astype("<u4") << 16).view("<f4")
    return a.reshape(shape)


def field(msg, name):
    """decode(msg.name) when the message carries that tensor field, else None."""
    if not msg.HasField(name):
        return None
    return decode(getattr(msg, name))
