"""A small safetensors reader and writer (numpy): rnnd checkpoints keep weights in
model.safetensors with PyTorch names, and ``rnnd --weights FILE`` starts from such a file.
Debian 12 has no Python safetensors package; these read what rnnd writes and write what it
(and safetensors.torch) reads."""

import json
import os
import struct

import numpy as np

_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4", "U8": "u1",
           "BOOL": "|b1"}


def load_safetensors(path):
    """dict name -> numpy array from a .safetensors file (or a checkpoint directory holding
    model.safetensors); metadata is in the result's ``metadata`` attribute."""
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = _Tensors()
    out.metadata = header.pop("__metadata__", {}) or {}
    for name, d in header.items():
        dt = np.dtype(_DTYPES[d["dtype"]])
        b, e = d["data_offsets"]
        out[name] = np.frombuffer(buf, dtype=dt, count=(e - b) // dt.itemsize,
                                  offset=base + b).reshape(d["shape"]).copy()
    return out


class _Tensors(dict):
    metadata = {}


_CODES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<f8"): "F64",
          np.dtype("<i8"): "I64", np.dtype("<i4"): "I32", np.dtype("u1"): "U8",
          np.dtype("|b1"): "BOOL"}


def save_safetensors(path, tensors, metadata=None):
    """Writes dict name -> array (numpy, or anything np.asarray takes, e.g. a CPU torch tensor)
    as a .safetensors file that safetensors.torch.load_file and ``rnnd --weights`` read:
    ``rnnd.save_safetensors("policy.safetensors", gru.state_dict())``."""
    arrays = {}
    for name, v in tensors.items():
        if hasattr(v, "detach"):  # torch.Tensor
            v = v.detach().cpu().numpy()
        a = np.ascontiguousarray(v)
        if a.dtype.newbyteorder("<") not in _CODES and a.dtype not in _CODES:
            raise TypeError("%s: dtype %s has no safetensors code" % (name, a.dtype))
        arrays[name] = a.astype(a.dtype.newbyteorder("<"), copy=False)
    header, offset = {}, 0
    for name in sorted(arrays):
        a = arrays[name]
        header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
