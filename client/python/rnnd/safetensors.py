"""A small safetensors reader (numpy): rnnd checkpoints keep weights in model.safetensors with
PyTorch names. Debian 12 has no Python safetensors package; this reads what rnnd writes."""

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
