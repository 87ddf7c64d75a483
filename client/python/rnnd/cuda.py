"""CUDA tensors in place with a daemon on this host and GPU (docs/design.md "CUDA regions").

A Region is one CUDA allocation (a uint8 torch tensor) registered with the daemon once
(RegisterRegion with its CUDA IPC handle, and a random key written at its start). Each
Forward or Backward takes a span of it (``Region.call``): Backward's gradients are copied in on
the GPU, the rest of the span is the call's reply_region, where the daemon's GPU writes the
reply's tensors. Only small descriptors cross gRPC; no tensor touches the host.

Ordering: before a call that puts tensors in its span the client waits for its current stream
(``Call.ready``), so the daemon never reads a gradient still being computed; before every call it
waits for the copies out of spans given back since (``Region.settle``), so the daemon never
writes over a reply the client is still copying out. The region asks for async replies: the
daemon answers once its GPU work is queued and records an event after it (RegisterRegionReply's
cuda_event), which the client's stream waits for (``Region.order``) before it reads a reply
tensor or writes a span, so the client's next work queues up behind the daemon's instead of
waiting on the host. A daemon that gives no event answers once its work is done.

Client uses this by itself for calls on CUDA tensors (``Client(transport="auto")``).
"""

import ctypes
import os
import threading

import numpy as np
import torch

from . import shm as _shm
from ._tensor import decode as _decode_bytes
from .v1 import rnnd_pb2 as pb

_TORCH = {pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16,
          pb.BOOL: torch.bool, pb.INT64: torch.int64}
_WIRE = {"float32": (torch.float32, pb.FLOAT32), "bfloat16": (torch.bfloat16, pb.BFLOAT16),
         "float16": (torch.float16, pb.FLOAT16)}


class _Staging(threading.local):
    """This thread's page-locked buffer between host and GPU (a pageable copy of tens of MB
    runs at a few GB/s, a pinned one at the link's speed), and the event after which the copy
    out of it is done: rnnd.torch's large tensors and socket regions (rnnd.sock) go through
    it."""

    buf = None
    done = None

    def get(self, nbytes):
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None
            self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self.buf[:nbytes]


staging = _Staging()


def _export(ptr):
    """(cudaIpcMemHandle_t bytes of the allocation holding device pointer ptr, ptr's offset in
    it), from the driver (libcuda), in the context current on this thread (PyTorch's)."""
    cu = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    handle = ctypes.create_string_buffer(64)
    rc = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc == 0:
        rc = cu.cuIpcGetMemHandle(handle, base)
    if rc != 0:
        raise RuntimeError("CUDA IPC cannot export this tensor's memory (driver error %d; "
                           "expandable segments cannot be exported)" % rc)
    return handle.raw, ptr - base.value


class Region(_shm.Spans):
    """``size`` bytes of GPU memory on ``device`` shared with the daemon."""

    kind = "cuda"

    def __init__(self, size, device):
        super().__init__(size)
        self._reads = []  # events after the copies out of given-back spans
        self.event = None  # the daemon's event after its work for an async reply
        self.device = torch.device(device)
        self.mem = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        self.key = os.urandom(_shm.KEY_BYTES)
        self.mem[:_shm.KEY_BYTES].copy_(torch.frombuffer(bytearray(self.key), dtype=torch.uint8))
        torch.cuda.synchronize(self.device)

    def register(self, call):
        with torch.cuda.device(self.device):
            handle, offset = _export(self.mem.data_ptr())
        req = pb.RegisterRegionRequest(cuda=pb.CudaRegion(
            ipc_handle=handle, offset=offset, size=self.size, key=self.key, pid=os.getpid(),
            async_replies=True))
        r = call("RegisterRegion", req)
        self.id = r.region
        if r.cuda_event:
            self.event = torch.cuda.Event.from_ipc_handle(self.device, r.cuda_event)
        return self

    def release(self, call):
        self.settle()
        if self.event is not None:  # the daemon's last writes, before the memory goes
            self.event.synchronize()
        _shm.release(self, call)
        self.mem = None

    def order(self, stream):
        """Makes stream's next work wait for the daemon's work of the replies so far (a no-op
        without async replies)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def read_after(self, stream):
        """Marks the copies out of a span queued on ``stream`` so far: its memory is reused only
        once they are done (settle)."""
        done = torch.cuda.Event()
        done.record(stream)
        with self._lock:
            self._reads.append(done)

    def settle(self):
        """Waits for the copies out of spans given back (read_after): by the next call they have
        usually run, where waiting at each span's close would stall on every one."""
        with self._lock:
            reads, self._reads = self._reads, []
        for done in reads:
            done.synchronize()

    def _call(self, at, need):
        return Call(self, at, need)


class Call:
    """One RPC's span: ``put`` copies a request tensor in (on the GPU), ``ready()`` waits for the
    copies, ``reply_region()`` is what is left, ``get`` reads a reply tensor as a new torch
    tensor on the region's device (16-bit floats widened to float32). ``close()`` gives the
    span back."""

    on_device = True
    fresh = False  # _read's tensor is the region's own memory (copied before it is returned)

    def __init__(self, region, off, n):
        self.region, self.off, self.n, self.at = region, off, n, off
        self._stream = None  # the caller's current stream, looked up once a call
        self._put_ordered = self._read_ordered = False

    def stream(self):
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.region.device)
        return self._stream

    def _store(self, x, dt, nbytes):
        """Request tensor x into the span at self.at, as dt."""
        if not self._put_ordered:
            self.region.settle()  # a copy out of this memory on another stream is done
            self.region.order(self.stream())  # and the daemon's reads of it
            self._put_ordered = True
        self.region.mem[self.at:self.at + nbytes].view(dt).view(x.shape).copy_(x)

    def _read(self, sp):
        """The bytes of reply span sp, as a uint8 tensor on the region's device, for work on the
        call's stream (ordered after the daemon's writes)."""
        if not self._read_ordered:
            self.region.order(self.stream())
            self._read_ordered = True
        return self.region.mem[sp.offset:sp.offset + sp.nbytes]

    def put(self, tensor, out, wire="float32"):
        dt, code = _WIRE[wire or "float32"]
        x = tensor.detach()
        nbytes = x.numel() * torch.empty((), dtype=dt).element_size()
        self._store(x, dt, nbytes)
        out.shape[:] = list(x.shape)
        out.dtype = code
        out.region.region = self.region.id
        out.region.offset = self.at
        out.region.nbytes = nbytes
        self.at += _shm._up(nbytes)
        return out

    def ready(self, puts=True):
        """Before the call: the copies into the span (puts: there are some) and out of spans
        given back are done."""
        if puts:
            self.stream().synchronize()
        self.region.settle()

    def reply_region(self):
        return pb.RegionSpan(region=self.region.id, offset=self.at,
                             nbytes=self.off + self.n - self.at)

    def get(self, t):
        if t is None:
            return None
        if not t.HasField("region"):
            a = np.array(_decode_bytes(t))
            return torch.from_numpy(a).to(self.region.device)
        sp = t.region
        dt = _TORCH.get(t.dtype)
        if sp.region != self.region.id or sp.offset + sp.nbytes > self.region.size or dt is None:
            raise ValueError("a reply tensor names region %d [%d, +%d) with dtype %d, not this "
                             "client's" % (sp.region, sp.offset, sp.nbytes, t.dtype))
        x = self._read(sp).view(dt).view(tuple(t.shape))
        if dt in (torch.float16, torch.bfloat16):
            return x.float()
        return x if self.fresh else x.clone()

    def field(self, msg, name):
        return self.get(getattr(msg, name)) if msg.HasField(name) else None

    def close(self):
        if self.region is not None:
            self.region.read_after(self.stream())
            self.region._give(self.off)
            self.region = None
