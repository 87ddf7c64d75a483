"""Native calls: rnnd.Client's unary RPCs through the C client (librnnd_client.so, client/client.c)
instead of grpcio.

The messages are the same, serialised by protobuf here; only the call itself changes hands. A
grpcio unary call costs 0.1-0.7 ms of Python-side work even for a descriptor-sized message, the C
client's about a tenth of that (docs/benchmarks.md), which is most of a learner iteration on CUDA
regions. The library is looked for in $RNND_CLIENT_LIB, beside this module (a build tree's
package, where CMake copies it), then on the system's library path; RNND_NATIVE=0 turns the
native calls off and RNND_NATIVE=1 makes a missing library an error.
"""

import ctypes
import ctypes.util
import os
import threading
import weakref

import grpc

_NAME = "librnnd_client.so"
_STATUS = {s.value[0]: s for s in grpc.StatusCode}


class _Opts(ctypes.Structure):  # struct rnnd_client_opts (client/include/rnnd_client.h)
    _fields_ = [("target", ctypes.c_char_p), ("tls_root_pem", ctypes.c_char_p),
                ("tls_cert_pem", ctypes.c_char_p), ("tls_key_pem", ctypes.c_char_p),
                ("tls_server_name", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int64), ("max_message_bytes", ctypes.c_int64)]


class _Error(ctypes.Structure):  # struct rnnd_client_error
    _fields_ = [("code", ctypes.c_int), ("grpc_status", ctypes.c_int),
                ("message", ctypes.c_char * 1024)]


_lib = None
_lock = threading.Lock()


def _candidates():
    env = os.environ.get("RNND_CLIENT_LIB")
    if env:
        return [env]
    found = ctypes.util.find_library("rnnd_client")
    return [os.path.join(os.path.dirname(os.path.abspath(__file__)), _NAME)] + (
        [found] if found else [])


def library():
    """The loaded librnnd_client, or None where it is not found (or RNND_NATIVE=0)."""
    global _lib
    if os.environ.get("RNND_NATIVE") == "0":
        return None
    with _lock:
        if _lib is None:
            _lib = False
            for path in _candidates():
                if not os.path.exists(path) and os.sep in path:
                    continue
                try:
                    lib = ctypes.CDLL(path)
                except OSError:
                    continue
                lib.rnnd_client_init.argtypes = [ctypes.POINTER(_Opts),
                                                 ctypes.POINTER(ctypes.c_void_p)]
                lib.rnnd_client_free.argtypes = [ctypes.c_void_p]
                lib.rnnd_client_free.restype = None
                lib.rnnd_client_call_raw.argtypes = [
                    ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
                lib.rnnd_client_last_error.restype = ctypes.POINTER(_Error)
                libc = ctypes.CDLL(None)
                libc.free.argtypes = [ctypes.c_void_p]
                libc.free.restype = None
                lib.free = libc.free
                _lib = lib
                break
        if _lib is False and os.environ.get("RNND_NATIVE") == "1":
            raise OSError("RNND_NATIVE=1 but %s is not found (tried %s)"
                          % (_NAME, ", ".join(_candidates())))
        return _lib or None


class Channel:
    """One C client on target: ``call(name, data)`` sends the serialised request of
    rnnd.v1.Rnn/name and returns the reply's bytes as a memoryview (the C client's buffer, freed
    when the last view of it goes), or raises error(code, details)."""

    def __init__(self, lib, target, token, timeout, max_message_bytes, error):
        self.lib, self.error, self.timeout = lib, error, timeout
        # The C client's deadline is fixed; a Client without one gets a year.
        ms = int(timeout * 1000) if timeout is not None else 365 * 86400 * 1000
        opts = _Opts(target=target.encode(), token=token.encode() if token else None,
                     timeout_ms=max(ms, 1), max_message_bytes=max_message_bytes)
        self._c = ctypes.c_void_p()
        if lib.rnnd_client_init(ctypes.byref(opts), ctypes.byref(self._c)) != 0:
            raise self._error("connect")
        self._paths = {}

    def _error(self, name):
        e = self.lib.rnnd_client_last_error().contents
        code = _STATUS.get(e.grpc_status, grpc.StatusCode.UNKNOWN)
        return self.error(code, e.message.decode(errors="replace"), name)

    def call(self, name, data):
        path = self._paths.get(name)
        if path is None:
            path = self._paths[name] = ("/rnnd.v1.Rnn/" + name).encode()
        reply, n = ctypes.c_void_p(), ctypes.c_size_t()
        if self.lib.rnnd_client_call_raw(self._c, path, data, len(data), ctypes.byref(reply),
                                         ctypes.byref(n)) != 0:
            raise self._error(name)
        buf = (ctypes.c_char * n.value).from_address(reply.value)
        weakref.finalize(buf, self.lib.free, reply.value)
        return memoryview(buf).cast("B")

    def close(self):
        if self._c:
            self.lib.rnnd_client_free(self._c)
            self._c = ctypes.c_void_p()
