"""Shared memory with a daemon on this host (docs/design.md "Shared memory").

A Region is one memfd registered with the daemon once (RegisterRegion): sealed against
shrinking, its random key at offset 0, and flock(LOCK_SH)ed for as long as this process keeps it
(the daemon drops a region once no process holds that lock). Each call takes a span of it
(``Region.call``): the request's tensors are copied in and travel as RegionSpans, and the rest
of the span is the call's reply_region, where the daemon writes the reply's tensors. Only small
descriptors cross gRPC. A call that finds no room goes as bytes.

Client uses this by itself (``Client(transport="auto")``); nothing here is needed directly.
"""

import collections
import fcntl
import mmap
import os
import threading
import weakref

import numpy as np

from ._tensor import _NP, View, bf16_bits, bf16_widen, decode as _decode_bytes
from .v1 import rnnd_pb2 as pb

ALIGN = 64
KEY_BYTES = 32


def _up(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


_FLOATS = {None: pb.FLOAT32, "float32": pb.FLOAT32, "bfloat16": pb.BFLOAT16,
           "float16": pb.FLOAT16}


def _wire(array, wire=None):
    """(array, wire dtype) as encode() would send it: bool as BOOL, integers as INT64 (but a
    uint16 array with wire "bfloat16": bfloat16 bit patterns), the rest as wire ("float32",
    "bfloat16" or "float16"; None: "float32")."""
    a = np.asarray(array)
    if a.dtype == np.bool_:
        return a, pb.BOOL
    if wire == "bfloat16" and a.dtype == np.uint16:
        return a, pb.BFLOAT16
    if np.issubdtype(a.dtype, np.integer):
        return a, pb.INT64
    return a, _FLOATS[wire]


def nbytes(array, wire=None):
    """Bytes of ``array`` on the wire (as ``Call.put`` writes it)."""
    a, dtype = _wire(array, wire)
    return a.size * _NP[dtype].itemsize


def need(arrays, reply_bytes, wire=None):
    """Bytes of a span for these request arrays (None skipped) and a reply of reply_bytes."""
    return sum(_up(nbytes(a, wire)) for a in arrays if a is not None) + reply_bytes


def _close(fd, mm, buf):
    buf.clear()  # drop the numpy view first: an mmap with exported buffers cannot close
    try:
        mm.close()
    except BufferError:
        pass  # leased reply tensors still map it: it goes with the last of them
    os.close(fd)  # releases the lock: the daemon lets the region go


class Spans:
    """First-fit spans of a region of ``size`` bytes, after its first ALIGN bytes (the key's):
    one per call in flight. Subclasses make the Call (``_call``)."""

    def __init__(self, size):
        self.size = _up(max(int(size), 2 * ALIGN))
        self.id = 0
        self._lock = threading.Lock()
        self._used = []  # [offset, length] of the calls in flight, by offset
        self._leased = 0  # bytes of the spans that leased reply tensors keep (Call.view)
        # Calls one of whose leased arrays was freed: a finalizer only appends here (it may run
        # in a garbage collection inside this lock), the holder of the lock settles them.
        self._unleased = collections.deque()

    def _settle_locked(self):
        while self._unleased:
            c = self._unleased.popleft()
            c._leases -= 1
            if c._leases == 0:
                self._leased -= c.n
                if c._closed:
                    self._give_locked(c.off)

    def idle(self):
        with self._lock:
            self._settle_locked()
            return not self._used

    def call(self, need):
        """A Call holding ``need`` bytes of the region, or None when they do not fit now."""
        need = _up(need)
        with self._lock:
            self._settle_locked()
            at = ALIGN  # the key's bytes stay as they are
            i = 0
            for i, (off, n) in enumerate(self._used):
                if off - at >= need:
                    break
                at = off + n
            else:
                i = len(self._used)
            if self.size - at < need:
                return None
            self._used.insert(i, [at, need])
        return self._call(at, need)

    def _give(self, off):
        with self._lock:
            self._give_locked(off)

    def _give_locked(self, off):
        self._used = [u for u in self._used if u[0] != off]


class Region(Spans):
    """A memfd of ``size`` bytes shared with the daemon. ``register(stub_call)`` sends
    RegisterRegion through ``stub_call(name, request)``; ``id`` is then the daemon's id."""

    def __init__(self, size):
        super().__init__(size)
        fd = os.memfd_create("rnnd-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._mm = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.key = os.urandom(KEY_BYTES)
        self._mm[:KEY_BYTES] = self.key
        self._buf = [np.frombuffer(self._mm, dtype=np.uint8)]
        self._finalizer = weakref.finalize(self, _close, fd, self._mm, self._buf)

    @property
    def bytes(self):
        return self._buf[0]

    def register(self, call):
        req = pb.RegisterRegionRequest(memfd=pb.MemfdRegion(
            pid=os.getpid(), fd=self.fd, size=self.size, key=self.key))
        self.id = call("RegisterRegion", req).region
        return self

    def release(self, call):
        """ReleaseRegion (errors ignored: the daemon also notices the close), then unmaps."""
        release(self, call)
        self._finalizer()

    def _call(self, at, need):
        return Call(self, at, need)


def release(region, call):
    """ReleaseRegion for region (errors ignored: the daemon also notices its client's exit)."""
    if region.id and call is not None:
        try:
            call("ReleaseRegion", pb.ReleaseRegionRequest(region=region.id))
        except Exception:  # noqa: BLE001 - the daemon may be gone; the close releases it too
            pass
    region.id = 0


class Call:
    """One RPC's span: ``put`` copies request tensors in, ``reply_region()`` is what is left,
    ``get`` reads a reply tensor (from the region or, when it did not fit, from its bytes) as a
    new array. ``close()`` gives the span back, or leaves it to the last reply array that
    ``view(t, lease=True)`` handed out."""

    def __init__(self, region, off, n):
        self.region, self.off, self.n, self.at = region, off, n, off
        self._leases = 0  # live arrays of view(lease=True); the span waits for them
        self._closed = False

    def put(self, array, out, wire=None):
        a, dtype = _wire(array, wire)
        nbytes = a.size * _NP[dtype].itemsize
        dst = self.region.bytes[self.at:self.at + nbytes].view(_NP[dtype]).reshape(a.shape)
        if dtype == pb.BFLOAT16 and a.dtype != np.uint16:
            dst[...] = bf16_bits(a).reshape(a.shape)
        else:
            np.copyto(dst, a, casting="unsafe")
        out.shape[:] = a.shape
        out.dtype = dtype
        out.region.region = self.region.id
        out.region.offset = self.at
        out.region.nbytes = nbytes
        self.at += _up(nbytes)
        return out

    def reply_region(self):
        return pb.RegionSpan(region=self.region.id, offset=self.at, nbytes=self.off + self.n - self.at)

    def _raw(self, t):
        """The region's bytes that reply tensor t names (checked)."""
        sp = t.region
        if sp.region != self.region.id or sp.offset + sp.nbytes > self.region.size:
            raise ValueError("a reply tensor names region %d [%d, +%d), not this client's"
                             % (sp.region, sp.offset, sp.nbytes))
        if _NP.get(t.dtype) is None:
            raise ValueError("reply tensor in shared memory with dtype %d" % t.dtype)
        return self.region.bytes[sp.offset:sp.offset + sp.nbytes]

    def get(self, t):
        """Reply tensor t as a new array (bfloat16 widened to float32, as decode does)."""
        if t is None or not t.HasField("region"):
            return _decode_bytes(t)
        a = self._raw(t).view(_NP[t.dtype]).reshape(tuple(t.shape))
        return bf16_widen(a) if t.dtype == pb.BFLOAT16 else a.copy()

    def view(self, t, lease=False):
        """Reply tensor t with its data in place (a View of the region's bytes, valid until
        close()), for a decode function; t itself when it came as bytes. lease: the View's
        ``array`` is also the region's bytes as an array of t's dtype (float32, int64 or bool),
        which keeps this span from other calls for as long as it lives, so that a decode
        function can hand it out without a copy; None where the region's leased spans would
        then pass half of it (a copy keeps the rest for calls)."""
        if t is None or not t.HasField("region"):
            return t
        v = View(memoryview(b""))
        v.shape, v.dtype, v.data = list(t.shape), t.dtype, memoryview(self._raw(t))
        v.array = self._lease(t) if lease and t.dtype in _LEASED else None
        return v

    def _lease(self, t):
        r = self.region
        with r._lock:
            r._settle_locked()
            if self._closed or (self._leases == 0 and r._leased + self.n > r.size // 2):
                return None
            if self._leases == 0:
                r._leased += self.n
            self._leases += 1
        a = self._raw(t).view(_NP[t.dtype]).reshape(tuple(t.shape))
        weakref.finalize(a, r._unleased.append, self)
        return a

    def field(self, msg, name):
        return self.get(getattr(msg, name)) if msg.HasField(name) else None

    def close(self):
        r = self.region
        with r._lock:
            r._settle_locked()
            if not self._closed and self._leases == 0:  # else the last lease, once settled
                r._give_locked(self.off)
            self._closed = True


# The reply dtypes a leased view hands out as they are (16-bit floats are widened: a copy).
_LEASED = (pb.FLOAT32, pb.INT64, pb.BOOL)

# Reply sizes, as laid out in a reply_region (each tensor at a multiple of ALIGN). What does not
# fit comes back as bytes, so these only need to be right for the common case.

def step_reply_bytes(info, B, return_state):
    n = _up(B * info.hidden_size * 4) + ALIGN
    if return_state:
        n += (2 if info.cell == "lstm" else 1) * _up(B * info.num_layers * info.hidden_size * 4)
    return n


def forward_reply_bytes(info, B, T, recorded):
    H, LH = info.hidden_size, info.num_layers * info.hidden_size
    n = _up(B * T * H * 4) + 2 * _up(B * LH * 4) + ALIGN
    K, A = info.discrete_actions, info.gaussian_actions
    n += _up(B * T * K * 4) + _up(B * T * A * 4) + _up(A * 4) + _up(B * T * 4) + 4 * ALIGN
    if recorded:
        n += (_up(B * T * info.input_size * 4) + _up(B * T) + _up(B * T * info.extras_size * 4)
              + _up(B * T * 8))
    return n


def param_tensors(info):
    """(count of floats, count of tensors) of the model's parameters: the core's, reading the
    last encoder width when there is an encoder, then the policy's (docs/design.md "Policy")."""
    G = 4 if info.cell == "lstm" else 3
    H, n = info.hidden_size, 0
    widths = tuple(info.encoder_widths or ())
    core_in = widths[-1] if widths else info.input_size
    for layer in range(info.num_layers):
        n += G * H * ((core_in if layer == 0 else H) + H + 2)
    fan = info.input_size
    for w in widths:
        n += w * fan + w
        fan = w
    K, A, V = info.discrete_actions, info.gaussian_actions, 1 if info.value_head else 0
    n += (K + A + V) * (H + 1) + A
    tensors = (4 * info.num_layers + 2 * len(widths) + (2 if K else 0) + (3 if A else 0)
               + 2 * V)
    return n, tensors


def backward_reply_bytes(info, B, T, accumulate):
    LH = info.num_layers * info.hidden_size
    n = _up(B * T * info.input_size * 4) + 2 * _up(B * LH * 4) + ALIGN
    if not accumulate:
        floats, tensors = param_tensors(info)
        n += floats * 4 + tensors * ALIGN
    return n
