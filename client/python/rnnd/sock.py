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

import torch

from . import cuda as _cuda
from . import shm as _shm
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
        self._token = 0
        self.closed = False  # the data connection failed: the client registers a new region

    def register(self, call, host):
        """RegisterRegion through ``call(name, request)``, then the data connection to ``host``
        (the gRPC target's) on the port the daemon answered with."""
        r = call("RegisterRegion", pb.RegisterRegionRequest(
            socket=pb.SocketRegion(size=self.size, key=self.key)))
        self.id = r.region
        try:
            s = socket.create_connection((host, r.data_port), timeout=10)
        except OSError:
            _shm.release(self, call)  # the daemon's memory back now, not at its 30 s expiry
            raise
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
            _shm.release(self, call)
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

    def _failed(self, why):
        self.closed = True
        return ConnectionError("socket region %d: %s (the daemon restarted or released it; the "
                               "next call registers a new one)" % (self.id, why))

    def write(self, off, x):
        """Sends tensor x (any device) into the region at off."""
        nbytes = x.numel() * x.element_size()
        with self._io, self._guard():
            if x.is_cuda:
                buf = _cuda.staging.get(nbytes)
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
            buf = _cuda.staging.get(nbytes) if cuda else torch.empty(nbytes, dtype=torch.uint8)
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
            _cuda.staging.done = torch.cuda.Event()
            _cuda.staging.done.record(torch.cuda.current_stream(self.device))
            return x

    def _call(self, at, need):
        return Call(self, at, need)


class Call(_cuda.Call):
    """One RPC's span, as a CUDA region's (rnnd.cuda.Call) but through the data connection:
    ``put`` sends a request tensor at once, ``ready()`` waits for the daemon to hold them, and
    ``get`` reads a reply tensor when it is asked for."""

    fresh = True  # _read's tensor is new

    def _store(self, x, dt, nbytes):
        self.region.write(self.at, x.to(dt))

    def _read(self, sp):
        return self.region.read(sp.offset, sp.nbytes)

    def ready(self):
        self.region.sync()

    def close(self):  # nothing of the daemon's to wait for
        if self.region is not None:
            self.region._give(self.off)
            self.region = None
