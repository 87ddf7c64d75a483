"""Socket regions: CUDA tensors as raw TCP bytes with a daemon on another host (docs/design.md
"Socket regions").

A Region is memory of the daemon's own (RegisterRegion with a SocketRegion) that this client
writes and reads through one plain TCP data connection to the daemon's data port, opened with
the region's random key. Each Forward or Backward takes a span of it (``Region.call``), as with
the other kinds: ``put`` sends a request tensor into the span at once (through a page-locked
buffer), ``ready()`` waits until the daemon has all of it, the rest of the span is the call's
reply_region, and ``get`` reads a reply tensor back and makes it a torch tensor on the caller's
device. Only descriptors cross gRPC, and a tensor the caller never reads never travels.

The frames (little-endian u64 each): (1, offset, n) then n bytes: write; (2, offset, n): the
daemon sends n bytes; (3, token, 0): the daemon sends the token back once it has everything
written before.

Client uses this by itself for calls on CUDA tensors to a daemon on another host
(``Client(transport="auto")``).
"""

import contextlib
import os
import socket
import struct
import threading

import numpy as np
import torch

from . import shm as _shm
from ._tensor import decode as _decode_bytes
from .cuda import _TORCH, _WIRE
from .v1 import rnnd_pb2 as pb

HELLO = b"RNNDSOCK"
WRITE, READ, SYNC = 1, 2, 3


class Region(_shm.Spans):
    """``size`` bytes of the daemon's memory, for calls on tensors of ``device``."""

    kind = "socket"

    def __init__(self, size, device):
        super().__init__(size)
        self.device = torch.device(device)
        self.key = os.urandom(_shm.KEY_BYTES)
        self.sock = None
        self._io = threading.Lock()  # one frame (and its answer) at a time on the connection
        self._buf = None  # page-locked bytes between the socket and the GPU
        self._done = None  # the event after which the copy out of _buf has finished
        self._token = 0
        self.closed = False  # the data connection failed: the client registers a new region

    def register(self, call, host):
        """RegisterRegion through ``call(name, request)``, then the data connection to ``host``
        (the gRPC target's) on the port the daemon answered with."""
        r = call("RegisterRegion", pb.RegisterRegionRequest(
            socket=pb.SocketRegion(size=self.size, key=self.key)))
        self.id = r.region
        s = socket.create_connection((host, r.data_port), timeout=10)
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(HELLO + self.key)
            size = s.recv(8, socket.MSG_WAITALL)
            if len(size) != 8 or struct.unpack("<Q", size)[0] != self.size:
                raise ConnectionError("the daemon's data port did not take socket region %d"
                                      % self.id)
            s.settimeout(None)
        except BaseException:
            s.close()
            raise
        self.sock = s
        return self

    def release(self, call):
        """ReleaseRegion (the daemon also drops the region when the connection closes)."""
        _shm.release(self, call)
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    @contextlib.contextmanager
    def _guard(self):
        """Any socket error marks the region closed."""
        if self.closed or self.sock is None:
            raise self._failed("its data connection is closed")
        try:
            yield
        except OSError as e:
            if isinstance(e, ConnectionError) and self.closed:
                raise
            raise self._failed(str(e)) from None

    def _pinned(self, nbytes):
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None
            self._buf = torch.empty(nbytes, dtype=torch.uint8,
                                    pin_memory=self.device.type == "cuda")
        return self._buf[:nbytes]

    def _failed(self, why):
        self.closed = True
        return ConnectionError("socket region %d: %s (the daemon restarted or released it; the "
                               "next call registers a new one)" % (self.id, why))

    def write(self, off, x):
        """Sends tensor x (any device) into the region at off."""
        nbytes = x.numel() * x.element_size()
        with self._io, self._guard():
            if x.is_cuda:
                buf = self._pinned(nbytes)
                buf.view(x.dtype).view(x.shape).copy_(x)  # into page-locked memory: synchronous
            else:  # the tensor's own bytes
                buf = x.contiguous().view(-1).view(torch.uint8)
            self.sock.sendall(struct.pack("<QQQ", WRITE, off, nbytes))
            self.sock.sendall(memoryview(buf.numpy()))

    def sync(self):
        """Returns once the daemon holds everything written before."""
        with self._io, self._guard():
            self._token += 1
            self.sock.sendall(struct.pack("<QQQ", SYNC, self._token, 0))
            echo = self.sock.recv(8, socket.MSG_WAITALL)
            if len(echo) != 8 or struct.unpack("<Q", echo)[0] != self._token:
                raise self._failed("the data connection closed")

    def read(self, off, nbytes):
        """nbytes of the region from off, as a new uint8 tensor on the region's device."""
        with self._io, self._guard():
            # CPU: straight into the new tensor; CUDA: through the page-locked buffer.
            cuda = self.device.type == "cuda"
            buf = self._pinned(nbytes) if cuda else torch.empty(nbytes, dtype=torch.uint8)
            self.sock.sendall(struct.pack("<QQQ", READ, off, nbytes))
            mv, got = memoryview(buf.numpy()), 0
            while got < nbytes:
                k = self.sock.recv_into(mv[got:], nbytes - got, socket.MSG_WAITALL)
                if k == 0:
                    raise self._failed("the data connection closed")
                got += k
            if not cuda:
                return buf
            x = buf.to(self.device, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.device))
            return x

    def _call(self, at, need):
        return Call(self, at, need)


class Call:
    """One RPC's span: ``put`` sends a request tensor, ``ready()`` waits for the daemon to hold
    them, ``reply_region()`` is what is left, ``get`` reads a reply tensor as a new torch tensor
    on the region's device (16-bit floats widened to float32). ``close()`` gives the span
    back."""

    on_device = True

    def __init__(self, region, off, n):
        self.region, self.off, self.n, self.at = region, off, n, off

    def put(self, tensor, out, wire="float32"):
        dt, code = _WIRE[wire or "float32"]
        x = tensor.detach().to(dt)
        nbytes = x.numel() * x.element_size()
        self.region.write(self.at, x)
        out.shape[:] = list(x.shape)
        out.dtype = code
        out.region.region = self.region.id
        out.region.offset = self.at
        out.region.nbytes = nbytes
        self.at += _shm._up(nbytes)
        return out

    def ready(self):
        self.region.sync()

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
        x = self.region.read(sp.offset, sp.nbytes).view(dt).view(tuple(t.shape))
        return x.float() if dt in (torch.float16, torch.bfloat16) else x

    def field(self, msg, name):
        return self.get(getattr(msg, name)) if msg.HasField(name) else None

    def close(self):
        if self.region is not None:
            self.region._give(self.off)
            self.region = None
