"""Socket regions: CUDA tensors as raw TCP bytes with a daemon on another host (docs/design.md
"Socket regions").

A Region is memory of the daemon's own (RegisterRegion with a SocketRegion) that this client
writes and reads through plain TCP data connections to the daemon's data port, each opened
with the region's random key. Transfers of SPLIT bytes or more are split over every connection,
side by side (one TCP stream moves ~4 GB/s on a loopback; the daemon takes up to 4 a region).
Each Forward or Backward takes a span of it (``Region.call``), as with the other kinds: ``put``
sends a request tensor into the span at once (through a page-locked buffer), ``ready()`` waits
until the daemon has all of it, the rest of the span is the call's reply_region, and ``get``
reads a reply tensor back and makes it a torch tensor on the caller's device. Only descriptors
cross gRPC, and a tensor the caller never reads never travels.

The frames (little-endian u64 each): (1, offset, n) then n bytes: write; (2, offset, n): the
daemon sends n bytes; (3, token, 0): the daemon sends the token back once it has everything
written before on that connection.

Client uses this by itself for calls on CUDA tensors to a daemon on another host
(``Client(transport="auto")``).
"""

import concurrent.futures
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
SPLIT = 4 << 20  # bytes from which a transfer goes over every connection


class Region(_shm.Spans):
    """``size`` bytes of the daemon's memory, for calls on tensors of ``device``, through
    ``conns`` data connections."""

    kind = "socket"

    def __init__(self, size, device, conns=4):
        super().__init__(size)
        self.device = torch.device(device)
        self.key = os.urandom(_shm.KEY_BYTES)
        self.conns = conns
        self.socks = []
        self._pool = None  # threads for the other connections' parts of a split transfer
        self._io = threading.Lock()  # one transfer (and its answers) at a time
        self._token = 0
        self.closed = False  # a data connection failed: the client registers a new region

    def register(self, call, host):
        """RegisterRegion through ``call(name, request)``, then the data connections to ``host``
        (the gRPC target's) on the port the daemon answered with."""
        r = call("RegisterRegion", pb.RegisterRegionRequest(
            socket=pb.SocketRegion(size=self.size, key=self.key)))
        self.id = r.region
        try:
            for _ in range(self.conns):
                self.socks.append(self._connect(host, r.data_port))
        except BaseException:
            self._close_socks()
            _shm.release(self, call)  # the daemon's memory back now, not at its 30 s expiry
            raise
        if self.conns > 1:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.conns - 1,
                                                               "rnnd-sock-%d" % self.id)
        return self

    def _connect(self, host, port):
        s = socket.create_connection((host, port), timeout=10)
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
        return s

    def _close_socks(self):
        for s in self.socks:
            s.close()
        self.socks = []
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def release(self, call):
        """ReleaseRegion (the daemon also drops the region when a connection closes)."""
        _shm.release(self, call)
        self._close_socks()

    @contextlib.contextmanager
    def _guard(self):
        """Any socket error marks the region closed."""
        if self.closed or not self.socks:
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

    def _parts(self, mv, off, fn):
        """fn(sock, offset, memoryview) for the parts of mv (to or from the region at off): one
        on the first connection, or, from SPLIT bytes on, one on each, side by side."""
        n = len(mv)
        if n == 0:
            return
        k = len(self.socks) if n >= SPLIT else 1
        step = ((n + k - 1) // k + 63) // 64 * 64
        jobs = [(self.socks[i], off + i * step, mv[i * step:(i + 1) * step])
                for i in range(k) if i * step < n]
        futs = [self._pool.submit(fn, *j) for j in jobs[1:]]
        try:
            fn(*jobs[0])
        finally:
            for f in futs:
                f.result()  # every part ends before any error is raised

    @staticmethod
    def _send(s, off, mv):
        s.sendall(struct.pack("<QQQ", WRITE, off, len(mv)))
        s.sendall(mv)

    @staticmethod
    def _recv(s, off, mv):
        s.sendall(struct.pack("<QQQ", READ, off, len(mv)))
        got, n = 0, len(mv)
        while got < n:
            k = s.recv_into(mv[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError("the data connection closed")
            got += k

    def write(self, off, x):
        """Sends tensor x (any device) into the region at off."""
        nbytes = x.numel() * x.element_size()
        with self._io, self._guard():
            if x.is_cuda:
                buf = _cuda.staging.get(nbytes)
                buf.view(x.dtype).view(x.shape).copy_(x)  # into page-locked memory: synchronous
            else:  # the tensor's own bytes
                buf = x.contiguous().view(-1).view(torch.uint8)
            self._parts(memoryview(buf.numpy()), off, self._send)

    def sync(self):
        """Returns once the daemon holds everything written before, on every connection."""
        with self._io, self._guard():
            self._token += 1
            for s in self.socks:
                s.sendall(struct.pack("<QQQ", SYNC, self._token, 0))
            for s in self.socks:
                echo = s.recv(8, socket.MSG_WAITALL)
                if len(echo) != 8 or struct.unpack("<Q", echo)[0] != self._token:
                    raise self._failed("the data connection closed")

    def read(self, off, nbytes):
        """nbytes of the region from off, as a new uint8 tensor on the region's device."""
        with self._io, self._guard():
            # CPU: straight into the new tensor; CUDA: through the page-locked buffer.
            cuda = self.device.type == "cuda"
            buf = _cuda.staging.get(nbytes) if cuda else torch.empty(nbytes, dtype=torch.uint8)
            self._parts(memoryview(buf.numpy()), off, self._recv)
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

    def ready(self, puts=True):
        """Also without puts: a lost data connection shows here, before the call."""
        self.region.sync()

    def close(self):  # nothing of the daemon's to wait for
        if self.region is not None:
            self.region._give(self.off)
            self.region = None
