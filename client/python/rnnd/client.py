"""rnnd.Client: a blocking client for the rnnd daemon (rnnd.v1.Rnn and grpc.health.v1.Health).

numpy in, numpy out. Every method maps to one RPC of proto/rnnd/v1/rnnd.proto (docs/design.md);
layout is batch-first: obs [B, T, I], is_init [B, T], output [B, T, H], states [B, L, H], stored
states [B, T, L, H]. Arrays that come back are read-only views over the reply's bytes (no copy
beyond the one protobuf makes); call ``.copy()`` where you need to write into one.

A failed call raises RnndError, which carries the gRPC status code (``.code``, a
grpc.StatusCode), its name (``.code_name``) and the server's message (``.details``).

A Client is one gRPC channel and may be shared by threads. It is not fork-safe: create clients
in each process after fork (or use the "spawn" start method).

On the daemon's host (a "unix:PATH" target or loopback, the daemon running as this user) the
tensors of step, forward and backward travel through shared memory instead of inside the
messages (rnnd.shm); ``client.transport`` says which path is in use ("shm" or "grpc"), and
``transport=`` overrides the choice.
"""

import collections
import queue
import threading

import grpc
import numpy as np

from . import _native
from . import shm as _shm
from ._tensor import Lazy, _varint, decode, encode, encode_field, field
from .v1 import health_pb2, health_pb2_grpc
from .v1 import rnnd_pb2 as pb
from .v1 import rnnd_pb2_grpc

SERVICE = "rnnd.v1.Rnn"


class RnndError(Exception):
    """A failed RPC: ``code`` (grpc.StatusCode), ``code_name`` ("INVALID_ARGUMENT", ...),
    ``details`` (the server's message, or gRPC's when the daemon was not reached), ``method``
    (the RPC's name) and ``target`` (the daemon's address, when known). For UNAVAILABLE the
    message asks whether rnnd is running at the target."""

    def __init__(self, code, details, method="", target=None):
        self.code = code
        self.code_name = code.name if code is not None else "UNKNOWN"
        self.details = details or ""
        self.method = method
        self.target = target
        msg = "%s: %s: %s" % (method or "rnnd", self.code_name, self.details)
        if code == grpc.StatusCode.UNAVAILABLE and target:
            msg += " (is rnnd running at %s?)" % target
        super().__init__(msg)

    @classmethod
    def from_rpc_error(cls, err, method, target=None):
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code, details, method, target)


_REPLY = {}


def _reply_class(name):
    """The reply message class of rnnd.v1.Rnn/name."""
    cls = _REPLY.get(name)
    if cls is None:
        out = pb.DESCRIPTOR.services_by_name["Rnn"].methods_by_name[name].output_type
        cls = _REPLY[name] = getattr(pb, out.name)
    return cls


ModelInfo = collections.namedtuple(
    "ModelInfo",
    "cell input_size hidden_size num_layers compute backend device model_version envs_active "
    "max_batch extras_size kernel_plan encoder_widths encoder_activation discrete_actions "
    "gaussian_actions value_head",
)
# action, log_prob, value, logits, mean: a policy model's (docs/design.md "Policy"); None else.
StepResult = collections.namedtuple(
    "StepResult", "output model_version h c action log_prob value logits mean",
    defaults=(None,) * 5)
# action ... truncated: a policy model's record of recorded steps; logits, mean, log_std,
# head_value: the heads' outputs of a model with heads, whose output (the core's) then comes
# only with return_core (docs/design.md "Policy"). cursor_first, cursor_lagged,
# cursor_overwritten: [B] uint64 arrays of cursor windows (docs/design.md "Cursor"), else None.
ForwardResult = collections.namedtuple(
    "ForwardResult",
    "output h_n c_n tape_id model_version obs is_init extras step_model_version action log_prob "
    "value reward done truncated logits mean log_std head_value cursor_first cursor_lagged "
    "cursor_overwritten",
    defaults=(None,) * 13,
)
BackwardResult = collections.namedtuple(
    "BackwardResult", "grads grad_obs grad_h0 grad_c0 grad_hidden grad_cell model_version",
    defaults=(None,),
)
Checkpoint = collections.namedtuple("Checkpoint", "path model_version")


class Weights(dict):
    """name -> numpy array (PyTorch names, e.g. "weight_hh_l0"), plus ``model_version``."""

    model_version = 0


def _ids(env_ids):
    return np.asarray(env_ids, dtype=np.uint64).reshape(-1).tolist()


def _serialized(msg):
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _bools(flags, n):
    if flags is None:
        return []
    a = np.asarray(flags, dtype=bool)
    if a.ndim == 0:
        return [bool(a)] * n
    return a.reshape(-1).tolist()


# Wire dtypes by name (reply_dtype=, dtype=): float tensors travel as fp32, bf16 or fp16.
_DTYPES = {None: 0, "float32": pb.FLOAT32, "bfloat16": pb.BFLOAT16, "float16": pb.FLOAT16}
# Bits of ForwardRequest.recorded_fields and BackwardRequest.input_grads by name.
_RECORDED = {"obs": pb.RECORDED_OBS, "is_init": pb.RECORDED_IS_INIT, "extras": pb.RECORDED_EXTRAS,
             "step_model_version": pb.RECORDED_STEP_MODEL_VERSION, "action": pb.RECORDED_ACTION,
             "reward": pb.RECORDED_REWARD}
_INPUT_GRADS = {"obs": pb.INPUT_GRAD_OBS, "h0": pb.INPUT_GRAD_H0, "hidden": pb.INPUT_GRAD_HIDDEN}


def _dtype(name):
    if name not in _DTYPES:
        raise ValueError("dtype %r: use 'float32', 'bfloat16' or 'float16'" % (name,))
    return _DTYPES[name]


def _getters(call, decode_fn):
    """(get, field) reading a reply's tensors: from call's shared-memory span, or with
    decode_fn (a Tensor -> value; numpy decoding by default)."""
    if call is not None and (decode_fn is None or getattr(call, "on_device", False)):
        return call.get, call.field
    if decode_fn is None:
        return decode, field
    if call is not None:
        # The decode function copies out before the span closes, or (a decoder with `leases`)
        # keeps a leased array of the span's bytes (shm.Call.view).
        lease = getattr(decode_fn, "leases", False)
        get = lambda t: decode_fn(call.view(t, lease))  # noqa: E731
    else:
        get = decode_fn
    return get, lambda msg, name: get(getattr(msg, name)) if msg.HasField(name) else None


def _mask(names, table):
    """An int, or an iterable of names of table, as bits."""
    if isinstance(names, int):
        return names
    bits = 0
    for n in names:
        if n not in table:
            raise ValueError("%r: use %s" % (n, ", ".join(map(repr, table))))
        bits |= table[n]
    return bits


def _named(tensors):
    return [pb.NamedTensor(name=k, tensor=encode(v)) for k, v in tensors.items()]


def _unnamed(named, get=decode):  # decode: _tensor's, not a caller's decode argument
    w = Weights()
    for nt in named:
        w[nt.name] = get(nt.tensor)
    return w


def _backward_result(r, get, fld):
    """BackwardResult of reply r: its weight gradients read with get, the rest with fld."""
    return BackwardResult(_unnamed(r.grads, get), *(fld(r, n) for n in (
        "grad_obs", "grad_h0", "grad_c0", "grad_hidden", "grad_cell")), r.model_version)


def _put(call, msg, wire=None, **arrays):
    """Sets msg's tensor fields from arrays (None skipped): as bytes, or through call's span of
    shared memory (then the rest of the span is the reply's); float arrays in the wire dtype
    ("float32", "bfloat16" (a uint16 array: its bit patterns) or "float16"; None: float32)."""
    for name, v in arrays.items():
        if v is None:
            continue
        if call is not None:
            call.put(v, getattr(msg, name), wire)
            continue
        a = np.asarray(v)
        floats = a.dtype.kind == "f" or (wire == "bfloat16" and a.dtype == np.uint16)
        encode(a, dtype=(_dtype(wire) or None) if floats else None, out=getattr(msg, name))


def _step_request(env_ids, obs, is_init=None, step_index=None, extras=None, return_state=False,
                  call=None, greedy=False, return_logits=False, return_core=False, reward=None,
                  done=None, truncated=None):
    ids = _ids(env_ids)
    req = pb.StepRequest(env_ids=ids, return_state=bool(return_state), greedy=bool(greedy),
                         return_logits=bool(return_logits), return_core=bool(return_core))
    if reward is not None:
        r = np.asarray(reward, np.float32)
        req.reward[:] = (np.full(len(ids), r) if r.ndim == 0 else r.reshape(-1)).tolist()
    req.done[:] = _bools(done, len(ids))
    req.truncated[:] = _bools(truncated, len(ids))
    _put(call, req, obs=obs, extras=extras)
    if call is not None:
        req.reply_region.CopyFrom(call.reply_region())
    req.is_init[:] = _bools(is_init, len(ids))
    if step_index is not None:
        req.step_index[:] = _ids(step_index)
    return req


def _step_result(reply, call=None):
    get, fld = (call.get, call.field) if call is not None else (decode, field)
    return StepResult(fld(reply, "output"), reply.model_version, fld(reply, "h"), fld(reply, "c"),
                      *(fld(reply, n) for n in ("action", "log_prob", "value", "logits", "mean")))


def _local_target(target):
    """True for a target only this host can be: a unix socket or a loopback address."""
    if target.startswith("unix:"):
        return True
    host = target.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("localhost", "::1")


def _credentials(tls):
    """tls: None/False (plaintext), True (system roots), a path or PEM string of the roots to
    trust, a dict {ca, cert, key, server_name} (paths or PEM), or grpc.ChannelCredentials.
    Returns (credentials or None, extra channel options)."""
    if tls is None or tls is False:
        return None, []
    if isinstance(tls, grpc.ChannelCredentials):
        return tls, []
    if tls is True:
        return grpc.ssl_channel_credentials(), []
    if isinstance(tls, (str, bytes)):
        tls = {"ca": tls}

    def pem(v):
        if v is None:
            return None
        if isinstance(v, bytes):
            return v
        if v.lstrip().startswith("-----BEGIN"):
            return v.encode()
        with open(v, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        root_certificates=pem(tls.get("ca")),
        private_key=pem(tls.get("key")),
        certificate_chain=pem(tls.get("cert")),
    )
    opts = []
    if tls.get("server_name"):
        opts.append(("grpc.ssl_target_name_override", tls["server_name"]))
    return creds, opts


class Client:
    """A connection to one rnnd daemon.

    target: "HOST:PORT" or "unix:PATH". token: bearer token (sent as "authorization: Bearer
    <token>"). tls: see _credentials (None: plaintext). timeout: per-call deadline in seconds
    (None: none). max_message_mb: send/receive limit (-1: unlimited, the default).
    transport: "auto" (shared memory when the target is on this host and the daemon accepts the
    region, else gRPC; for calls on CUDA tensors, a CUDA region when the daemon is on this
    host's GPU and opens one (a daemon of one CUDA device), else its socket region; for calls on
    torch tensors, a socket region when the daemon is on another host and offers one), "cuda"
    (like auto, but a call on CUDA tensors that cannot use either
    region is an error), "socket" (calls on torch tensors, CUDA or CPU, through a socket region
    whatever the host, or an error), "shm" (shared memory or an error) or "grpc" (tensors
    inside the messages).
    shm_mb: size of the shared region (virtual: pages are used as calls touch them); cuda_mb:
    of the CUDA region, allocated on the GPU at the first call on CUDA tensors; sock_mb: of the
    socket region, the daemon's memory (counted against its --max-socket-region-mb, touched as
    data arrives). A call that does not fit its region goes as bytes. sock_conns: the socket
    region's data connections (1 to 4), over which large transfers are split.
    native: send the unary calls of rnnd.v1.Rnn through the C client (rnnd._native), None
    (default) where its library is found and the channel is plaintext without extra options,
    True (an error where it cannot), False (grpcio); ``client.native`` says which.
    """

    def __init__(self, target, token=None, tls=None, timeout=60.0, max_message_mb=-1, options=(),
                 transport="auto", shm_mb=1024, cuda_mb=1024, sock_mb=256, sock_conns=4,
                 native=None):
        if transport not in ("auto", "cuda", "socket", "shm", "grpc"):
            raise ValueError('transport is "auto", "cuda", "socket", "shm" or "grpc", not %r'
                             % (transport,))
        self.target = target
        self.closed = False
        self._want = transport
        self._shm_mb = int(shm_mb)
        self._cuda_mb = int(cuda_mb)
        self._sock_mb = int(sock_mb)
        self._sock_conns = int(sock_conns)
        if not 1 <= self._sock_conns <= 4:
            raise ValueError("sock_conns is 1 to 4 (a daemon takes 4 connections a socket "
                             "region), not %r" % (sock_conns,))
        self._transport = None  # decided at first use
        self._region = None
        # Regions for calls on torch tensors, by device index ("cpu" for CPU tensors): a
        # cuda.Region or a sock.Region, or False (refused).
        self._regions = {}
        self._info = None
        self._tlock = threading.Lock()
        self.timeout = timeout
        limit = -1 if max_message_mb is None or max_message_mb < 0 else int(max_message_mb) << 20
        opts = [("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit)]
        creds, extra = _credentials(tls)
        opts += extra + list(options)
        if creds is None:
            self._channel = grpc.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.secure_channel(target, creds, options=opts)
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        self._stub = rnnd_pb2_grpc.RnnStub(self._channel)
        # A learner's biggest tensors: Backward's request is serialised by hand, and both replies
        # come as bytes that Lazy reads without copying their tensors.
        self._forward_raw = self._channel.unary_unary(
            "/rnnd.v1.Rnn/Forward", request_serializer=_serialized, response_deserializer=None)
        self._bytes_calls = {}  # name -> grpcio callable taking a serialised request
        self._recorded_ids = (None, b"", 0)  # the last Recorded.env_ids: (key, field, count)
        self._backward_raw = self._channel.unary_unary(
            "/rnnd.v1.Rnn/Backward", request_serializer=None, response_deserializer=None)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._native = None
        if native is not False:
            lib = _native.library() if creds is None and not options else None
            if lib is None and native:
                raise ValueError("native=True needs librnnd_client.so (RNND_CLIENT_LIB) and a "
                                 "plaintext channel without options")
            if lib is not None:
                self._native = _native.Channel(
                    lib, target, token, timeout, limit,
                    lambda code, details, name: RnndError(code, details, name, target))
        # The daemon's id that cursor windows carry (docs/design.md "Cursor"): sent back with
        # the next ones, so that windows from another daemon, or from one that restarted, are
        # refused; 0 takes the daemon's cursors as they are (set it after such a refusal).
        self.cursor_id = 0

    # -- plumbing ------------------------------------------------------------------------------

    def close(self):
        self.closed = True
        if self._region is not None:
            self._region.release(self._call)
            self._region = None
            self._transport = "grpc"
        for region in self._regions.values():
            if region:
                region.release(self._call)
        self._regions = {}
        if self._native is not None:
            self._native.close()
            self._native = None
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name, request, timeout=None, stub=None, fn=None):
        """One unary call: the reply message, or its bytes where fn (a raw grpcio callable)
        is given."""
        n = self._native
        if n is not None and stub is None and timeout is None and n.timeout == self.timeout:
            data = n.call(name, request if isinstance(request, bytes)
                          else request.SerializeToString())
            return data if fn is not None else _reply_class(name).FromString(data)
        if fn is None and stub is None and isinstance(request, bytes):
            fn = self._bytes_calls.get(name)
            if fn is None:
                fn = self._bytes_calls[name] = self._channel.unary_unary(
                    "/rnnd.v1.Rnn/" + name, request_serializer=None,
                    response_deserializer=_reply_class(name).FromString)
        fn = fn or getattr(stub or self._stub, name)
        try:
            return fn(request, timeout=timeout if timeout is not None else self.timeout,
                      metadata=self._metadata)
        except grpc.RpcError as e:
            raise RnndError.from_rpc_error(e, name, self.target) from None

    @property
    def native(self):
        """True where the unary calls go through the C client (rnnd._native), else grpcio."""
        return self._native is not None

    @property
    def transport(self):
        """How tensors travel: "cuda" (CUDA tensors in place, once a call on them registered a
        CUDA region; the other calls as below), "socket" (calls on torch tensors through a
        socket region's data connection, once a call registered one), "shm" (shared memory
        with a daemon on this host) or "grpc"."""
        regions = [r for r in self._regions.values() if r]
        if regions:
            return regions[0].kind
        if self._transport is None:
            self._choose_transport()
        return self._transport or "grpc"

    def _region_for(self, device):
        """The region for a call on torch tensors of device (a torch.device), registered at the
        first such call: a CUDA region (CUDA, a daemon on this host) or a socket region (a
        daemon on another host, or transport="socket"; CPU tensors too); None where the path is
        not open (refused, or neither applies)."""
        kind = getattr(device, "type", None)
        if kind not in ("cuda", "cpu") or self._want in ("shm", "grpc") or (
                kind == "cpu" and self._want != "socket" and (
                    self._want == "cuda" or _local_target(self.target))):
            return None
        from . import cuda as _cuda  # torch only for callers with torch tensors
        index = "cpu" if kind == "cpu" else (
            device.index if device.index is not None else _cuda.torch.cuda.current_device())
        region = self._regions.get(index)
        if region is None or getattr(region, "closed", False):
            with self._tlock:
                region = self._regions.get(index)
                if region is not None and getattr(region, "closed", False):
                    region.release(None)  # a socket region whose connection failed: anew
                    del self._regions[index]
                    region = None
                if region is None:
                    region = self._region_register(_cuda, index)
        return region or None

    def _region_register(self, _cuda, index):
        region = None
        try:
            self._info = self._info or self.info()
            device = "cpu" if index == "cpu" else "cuda:%d" % index
            if _local_target(self.target) and self._want != "socket":
                try:
                    region = _cuda.Region(self._cuda_mb << 20, device)
                    self._regions[index] = region.register(self._call)
                    return self._regions[index]
                except RnndError as e:
                    # A daemon that opens no CUDA region (one on several devices, or on the
                    # CPU): its socket region is the next fastest path for CUDA tensors.
                    if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    region.release(None)
                    region = None
            # The daemon's memory, through a data connection.
            from . import sock as _sock
            region = _sock.Region(self._sock_mb << 20, device, self._sock_conns)
            self._regions[index] = region.register(self._call, self.target.rsplit(":", 1)[0]
                                                .strip("[]"))
        except (RnndError, RuntimeError, OSError) as e:
            if isinstance(e, RnndError) and e.code in (grpc.StatusCode.UNAVAILABLE,
                                                       grpc.StatusCode.DEADLINE_EXCEEDED):
                raise  # a daemon not reachable yet: decide at a later call
            if region is not None:
                region.release(None)
            if self._want in ("cuda", "socket"):
                raise
            self._regions[index] = False
        return self._regions[index]

    def _choose_transport(self):
        with self._tlock:
            if self._transport is not None:
                return
            if self._want == "grpc" or (self._want == "auto" and not _local_target(self.target)):
                self._transport = "grpc"
                return
            region = None
            try:
                self._info = self.info()
                region = _shm.Region(self._shm_mb << 20)
                self._region = region.register(self._call)
                self._transport = "shm"
            except (RnndError, OSError) as e:
                if region is not None:
                    region.release(None)
                if self._want == "shm":
                    raise
                # A daemon not reachable yet: decide at a later call.
                if not (isinstance(e, RnndError) and e.code in (
                        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)):
                    self._transport = "grpc"

    def _span(self, arrays, reply_bytes, wire=None):
        """A span of the shared region for a call with these request arrays (float ones in the
        wire dtype) and reply, or None (the call goes as bytes)."""
        if self.transport != "shm":
            return None
        return self._region.call(_shm.need(arrays, reply_bytes, wire))

    def _shm_call(self, name, req, call, result):
        """Sends req (built over call's span, or as bytes when call is None) and returns
        result(reply), giving the span back."""
        try:
            return result(self._call(name, req))
        finally:
            if call is not None:
                call.close()

    def wait_ready(self, timeout=30.0):
        """Blocks until the channel is connected (grpc.FutureTimeoutError after timeout)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # -- service -------------------------------------------------------------------------------

    def health(self, service="", timeout=None):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"."""
        r = self._call("Check", health_pb2.HealthCheckRequest(service=service), timeout,
                       stub=self._health)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def info(self):
        """GetModelInfo as a ModelInfo namedtuple."""
        r = self._call("GetModelInfo", pb.GetModelInfoRequest())
        return ModelInfo(r.cell, r.input_size, r.hidden_size, r.num_layers, r.compute, r.backend,
                         r.device, r.model_version, r.envs_active, r.max_batch, r.extras_size,
                         r.kernel_plan, tuple(r.encoder_widths), r.encoder_activation,
                         r.discrete_actions, r.gaussian_actions, r.value_head)

    def step(self, env_ids, obs, is_init=None, step_index=None, extras=None):
        """One recurrent step for B envs: obs [B, I], is_init B bools (a scalar broadcasts; None:
        all false), step_index B uint64 (retry-safe steps), extras [B, E]. Returns output [B, H]."""
        return self.step_result(env_ids, obs, is_init, step_index, extras).output

    def step_result(self, env_ids, obs, is_init=None, step_index=None, extras=None,
                    return_state=False, greedy=False, return_logits=False, return_core=False,
                    reward=None, done=None, truncated=None):
        """step() returning StepResult(output, model_version, h, c, action, log_prob, value,
        logits, mean); h/c [B, L, H] only with return_state (c for LSTM).

        A policy model (docs/design.md "Policy") returns action ([B] int64 for a discrete head,
        [B, A] for a Gaussian one), log_prob [B] and value [B] (value head), drawn from a
        generator keyed by (--seed, env id, step_index or the env's step count); greedy takes
        the mode instead; return_logits adds logits [B, K] or mean [B, A]; output (the core's
        [B, H]) comes back only with return_core. reward, done, truncated (B values or a scalar)
        report what each env's previous step earned; forward_recorded returns them with it."""
        call = self._span((obs, extras), _shm.step_reply_bytes(self._info, len(_ids(env_ids)),
                                                                return_state)
                          if self.transport == "shm" else 0)
        req = _step_request(env_ids, obs, is_init, step_index, extras, return_state, call,
                            greedy, return_logits, return_core, reward, done, truncated)
        return self._shm_call("Step", req, call, lambda r: _step_result(r, call))

    def stepper(self):
        """A Stepper: Step over one bidirectional StepStream (lower latency for actors)."""
        return Stepper(self)

    def end_episodes(self, env_ids):
        """Drops the state and recorded steps of env_ids; returns how many were released."""
        return self._call("EndEpisodes", pb.EndEpisodesRequest(env_ids=_ids(env_ids))).released

    def forward(self, obs, is_init=None, h0=None, c0=None, hidden=None, cell=None,
                keep_tape=False, dtype=None, reply_dtype=None, decode=None, return_core=False):
        """Sequence forward over explicit trajectories: obs [B, T, I], is_init [B, T] (None: all
        false), h0/c0 [B, L, H], stored states hidden/cell [B, T, L, H] (TorchRL style: the reset
        value where is_init). keep_tape keeps activations for backward(). dtype: the wire dtype
        of the float tensors sent ('float32' by default, 'bfloat16', 'float16'); reply_dtype:
        of those returned (default: dtype). Returns ForwardResult (bfloat16 decodes to
        float32). decode: a function making each returned Tensor (pb.Tensor or _tensor.View)
        the value returned, instead of a numpy array, for tensors that come through gRPC
        (rnnd.torch passes one that makes torch tensors on the learner's device). A model with
        heads returns logits / mean and log_std / head_value, and output only with
        return_core."""
        obs = np.asarray(obs)
        if self.transport == "shm":
            if is_init is None:
                is_init = np.zeros(obs.shape[:2], dtype=bool)
            arrays = dict(obs=obs, is_init=np.asarray(is_init, dtype=bool), h0=h0, c0=c0,
                          hidden=hidden, cell=cell)
            call = self._span(arrays.values(), _shm.forward_reply_bytes(
                self._info, obs.shape[0], obs.shape[1], False), dtype)
            tr = pb.Trajectories()
            _put(call, tr, dtype, **arrays)
            req = pb.ForwardRequest(trajectories=tr, keep_tape=bool(keep_tape),
                                    reply_dtype=_dtype(reply_dtype), return_core=bool(return_core))
            if call is not None:
                req.reply_region.CopyFrom(call.reply_region())
            return self._shm_call("Forward", req, call,
                                  lambda r: self._forward_result(r, call, decode))
        else:
            wire = _dtype(dtype) or None
            tr = pb.Trajectories()
            encode(obs, dtype=wire, out=tr.obs)
            if is_init is None:
                is_init = np.zeros(obs.shape[:2], dtype=bool)
            encode(np.asarray(is_init, dtype=bool), out=tr.is_init)
            for name, v in (("h0", h0), ("c0", c0), ("hidden", hidden), ("cell", cell)):
                if v is not None:
                    encode(v, dtype=wire, out=getattr(tr, name))
            req = pb.ForwardRequest(trajectories=tr, keep_tape=bool(keep_tape),
                                    reply_dtype=_dtype(reply_dtype), return_core=bool(return_core))
            return self._forward_result(self._forward_lazy(req), decode=decode)

    def forward_recorded(self, env_ids, steps, keep_tape=False, fields=None, reply_dtype=None,
                         decode=None, return_core=False, cursor=False, device=None):
        """Sequence forward over the last ``steps`` steps the daemon recorded for each env (from
        the state recorded before the window). The result also carries the recorded obs,
        is_init, extras [B, T, E] and step_model_version [B, T], or only those named in
        ``fields`` (e.g. ("is_init",); () for none; None: all). reply_dtype: 'float32' (default),
        'bfloat16' or 'float16' for the float tensors returned. decode, return_core: as for
        forward(). cursor: each env's next window from its cursor instead of its last steps, so
        that every recorded step is handed out once (consecutive windows share one step, the
        bootstrap); the result's cursor_first says where each window starts. Sends
        ``self.cursor_id`` and keeps the reply's (docs/design.md "Cursor"). device: a torch
        device makes the reply's tensors torch tensors there: on this host's GPU written in
        place by the daemon's GPU (a CUDA region), from another host through a socket region
        (see transport)."""
        rec, B = self._recorded(env_ids, steps, cursor)
        region = self._region_for(device)
        call = region and region.call(_shm.forward_reply_bytes(
            self._info, B, int(steps), fields is None or _mask(fields, _RECORDED) != 0))
        if call is not None:
            req = pb.ForwardRequest(keep_tape=bool(keep_tape), reply_dtype=_dtype(reply_dtype),
                                    return_core=bool(return_core))
            if fields is not None:
                req.recorded_fields = _mask(fields, _RECORDED)
            req.reply_region.CopyFrom(call.reply_region())
            call.ready(puts=False)
            return self._shm_call("Forward", req.SerializeToString() + rec, call,
                                  lambda r: self._cursor_kept(self._forward_result(r, call), r))
        if self.transport == "shm":
            call = self._span((), _shm.forward_reply_bytes(
                self._info, B, int(steps), fields is None or _mask(fields, _RECORDED) != 0))
            req = pb.ForwardRequest(keep_tape=bool(keep_tape), reply_dtype=_dtype(reply_dtype),
                                    return_core=bool(return_core))
            if fields is not None:
                req.recorded_fields = _mask(fields, _RECORDED)
            if call is not None:
                req.reply_region.CopyFrom(call.reply_region())
            return self._shm_call("Forward", req.SerializeToString() + rec, call,
                                  lambda r: self._cursor_kept(
                                      self._forward_result(r, call, decode), r))
        else:
            req = pb.ForwardRequest(keep_tape=bool(keep_tape), reply_dtype=_dtype(reply_dtype),
                                    return_core=bool(return_core))
            if fields is not None:
                req.recorded_fields = _mask(fields, _RECORDED)
            r = self._forward_lazy(req.SerializeToString() + rec)
            return self._cursor_kept(self._forward_result(r, decode=decode), r)

    def _recorded(self, env_ids, steps, cursor):
        """(ForwardRequest.recorded serialised, the number of envs). The env_ids field of the
        last call is kept: a learner asks for the same envs every iteration, and encoding 2048
        of them costs ~0.1 ms."""
        ids = np.ascontiguousarray(np.asarray(env_ids, dtype=np.uint64).reshape(-1))
        key = ids.tobytes()
        kept = self._recorded_ids
        if kept[0] != key:
            kept = self._recorded_ids = (key, pb.Recorded(env_ids=ids.tolist())
                                         .SerializeToString(), len(ids))
        rest = pb.Recorded(steps=int(steps), cursor=bool(cursor),
                           cursor_id=int(self.cursor_id) if cursor else 0).SerializeToString()
        body = kept[1] + rest
        return b"\x12" + _varint(len(body)) + body, kept[2]  # field 2 (recorded), length

    def _cursor_kept(self, res, r):
        """res with a cursor reply's windows, whose cursor_id the client keeps."""
        if not r.cursor_id:
            return res
        self.cursor_id = r.cursor_id
        return res._replace(**{n: np.asarray(getattr(r, n), dtype=np.uint64) for n in (
            "cursor_first", "cursor_lagged", "cursor_overwritten")})

    def _forward_lazy(self, req):
        return Lazy(pb.ForwardReply, self._call("Forward", req, fn=self._forward_raw))

    @staticmethod
    def _forward_result(r, call=None, decode=None):
        get, fld = _getters(call, decode)
        return ForwardResult(fld(r, "output"), fld(r, "h_n"), fld(r, "c_n"), r.tape_id,
                             r.model_version, fld(r, "obs"), fld(r, "is_init"),
                             fld(r, "extras"), fld(r, "step_model_version"),
                             *(fld(r, n) for n in ("action", "log_prob", "value", "reward",
                                                   "done", "truncated", "logits", "mean",
                                                   "log_std", "head_value")))

    def backward(self, tape_id, grad_output=None, grad_h_n=None, grad_c_n=None, accumulate=False,
                 input_grads=None, dtype=None, reply_dtype=None, decode=None, grad_logits=None,
                 grad_mean=None, grad_log_std=None, grad_head_value=None, apply=False):
        """Backward through a kept tape: grad_output [B, T, H], optional grad_h_n/grad_c_n
        [B, L, H]. accumulate adds the weight gradients into the daemon's buffer (for
        apply_gradients()) instead of returning them; apply (with accumulate) then takes that
        optimizer step in the same call (a daemon on one device), and the result's
        model_version is the new version. input_grads names the input gradients
        wanted among "obs", "h0", "hidden" (None: every one the Forward had; (): none, which
        also spares computing them). dtype / reply_dtype: wire dtypes as for forward(). Returns
        BackwardResult(grads: dict name -> array, grad_obs, grad_h0, grad_c0, grad_hidden,
        grad_cell). decode: as for forward(), for the input gradients. A model with heads takes
        the gradients of its Forward's head outputs, grad_logits [B, T, K], grad_mean [B, T, A],
        grad_log_std [A], grad_head_value [B, T] (each optional), with or without grad_output;
        the weight gradients then cover the heads and the encoder too."""
        heads = dict(grad_logits=grad_logits, grad_mean=grad_mean, grad_log_std=grad_log_std,
                     grad_head_value=grad_head_value)
        grads = dict(grad_output=grad_output, grad_h_n=grad_h_n, grad_c_n=grad_c_n, **heads)
        first = next((v for v in grads.values() if v is not None), None)
        if getattr(first, "is_cuda", False) or (hasattr(first, "detach") and
                                                 self._region_for(first.device) is not None):
            # torch tensors: through the call's region when it has room
            r = self._backward_region(tape_id, grads, accumulate, input_grads, dtype, first, apply)
            if r is not None:
                return r
        if getattr(first, "is_cuda", False):
            from .torch import _wire as wire_of  # the bytes path, as rnnd.torch sends them
            grads = {k: None if v is None else wire_of(v, dtype or "float32",
                                                       stage=k == "grad_output")
                     for k, v in grads.items()}
            grad_output, grad_h_n, grad_c_n = (grads.pop(k) for k in
                                               ("grad_output", "grad_h_n", "grad_c_n"))
            heads = grads
        if self.transport == "shm":
            return self._backward_shm(tape_id, grad_output, grad_h_n, grad_c_n, accumulate,
                                      input_grads, decode, heads, apply, dtype, reply_dtype)
        wire = _dtype(dtype) or None
        req = pb.BackwardRequest(tape_id=int(tape_id), accumulate=bool(accumulate),
                                 reply_dtype=_dtype(reply_dtype), apply=bool(apply))
        if input_grads is not None:
            req.input_grads = _mask(input_grads, _INPUT_GRADS)
        if grad_h_n is not None:
            encode(grad_h_n, dtype=wire, out=req.grad_h_n)
        if grad_c_n is not None:
            encode(grad_c_n, dtype=wire, out=req.grad_c_n)
        for name, v in heads.items():
            if v is not None:
                encode(v, dtype=wire, out=getattr(req, name))
        data = b"".join([req.SerializeToString(),
                         *(encode_field(2, grad_output, wire) if grad_output is not None else ())])
        r = Lazy(pb.BackwardReply, self._call("Backward", data, fn=self._backward_raw))
        return _backward_result(r, _getters(None, None)[0], _getters(None, decode)[1])

    def _backward_region(self, tape_id, grads, accumulate, input_grads, dtype, first, apply):
        """backward() on torch tensors through their region (CUDA or socket), or None when it
        has no room."""
        region = self._region_for(first.device)
        if region is None:
            return None
        wire = dtype if _dtype(dtype) else "float32"
        el = 4 if wire == "float32" else 2
        B, T = first.shape[:2] if first.dim() >= 2 else (0, 0)
        need = sum(_shm._up(v.numel() * el) for v in grads.values() if v is not None)
        call = region.call(need + _shm.backward_reply_bytes(self._info, B, T, accumulate))
        if call is None:
            return None
        req = pb.BackwardRequest(tape_id=int(tape_id), accumulate=bool(accumulate),
                                 apply=bool(apply))
        if input_grads is not None:
            req.input_grads = _mask(input_grads, _INPUT_GRADS)
        for name, v in grads.items():
            if v is not None:
                call.put(v, getattr(req, name), wire)
        req.reply_region.CopyFrom(call.reply_region())
        call.ready()
        return self._shm_call("Backward", req, call,
                              lambda r: _backward_result(r, call.get, call.field))

    def _backward_shm(self, tape_id, grad_output, grad_h_n, grad_c_n, accumulate, input_grads,
                      decode, heads, apply, dtype, reply_dtype):
        """backward() through the shared-memory region, floats in the wire dtype."""
        bt = [np.asarray(v) for v in (grad_output, heads["grad_logits"], heads["grad_mean"],
                                      heads["grad_head_value"]) if v is not None]
        bt = bt[0].shape[:2] if bt and bt[0].ndim >= 2 else None
        call = self._span((grad_output, grad_h_n, grad_c_n, *heads.values()),
                          _shm.backward_reply_bytes(self._info, bt[0], bt[1], accumulate)
                          if bt else 0, dtype)
        req = pb.BackwardRequest(tape_id=int(tape_id), accumulate=bool(accumulate),
                                 reply_dtype=_dtype(reply_dtype), apply=bool(apply))
        if input_grads is not None:
            req.input_grads = _mask(input_grads, _INPUT_GRADS)
        _put(call, req, dtype, grad_output=grad_output, grad_h_n=grad_h_n, grad_c_n=grad_c_n,
             **heads)
        if call is not None:
            req.reply_region.CopyFrom(call.reply_region())

        return self._shm_call("Backward", req, call, lambda r: _backward_result(
            r, _getters(call, None)[0], _getters(call, decode)[1]))

    def apply_gradients(self, grads=None, lr=None):
        """One optimizer step on the daemon with grads (dict name -> array; None or empty: the
        buffer accumulated by backward(accumulate=True)); lr overrides the configured rate.
        Returns the new model_version."""
        req = pb.ApplyGradientsRequest(grads=_named(grads or {}))
        if lr is not None:
            req.lr = float(lr)
        return self._call("ApplyGradients", req).model_version

    def get_weights(self):
        """Weights: dict name -> array (PyTorch names) with ``.model_version``."""
        r = self._call("GetWeights", pb.GetWeightsRequest())
        w = _unnamed(r.tensors)
        w.model_version = r.model_version
        return w

    def set_weights(self, tensors):
        """Replaces weights (dict name -> array, e.g. an nn.GRU state_dict as numpy); returns the
        new model_version."""
        return self._call("SetWeights", pb.SetWeightsRequest(tensors=_named(tensors))).model_version

    def save_checkpoint(self, path=None):
        """Writes a checkpoint (path: a directory inside --state-dir; None: a new one); returns
        Checkpoint(path, model_version)."""
        r = self._call("SaveCheckpoint", pb.SaveCheckpointRequest(path=path or ""))
        return Checkpoint(r.path, r.model_version)


_END = object()


class _SendRecv:
    """step()/step_result() for a stepper that has send() and recv() (Stepper, PoolStepper)."""

    def step(self, env_ids, obs, is_init=None, step_index=None, extras=None):
        self.send(env_ids, obs, is_init, step_index, extras)
        return self.recv().output

    def step_result(self, env_ids, obs, is_init=None, step_index=None, extras=None,
                    return_state=False, **policy):
        self.send(env_ids, obs, is_init, step_index, extras, return_state, **policy)
        return self.recv()


class Stepper(_SendRecv):
    """Step over one StepStream. ``step()`` sends one request and waits for its reply;
    ``send()``/``recv()`` let an actor keep several requests in flight (replies come in order).
    An error ends the stream (gRPC semantics): the RnndError is raised from recv()/step() and
    the Stepper cannot be used afterwards. Use one Stepper per thread.
    """

    def __init__(self, client):
        self._target = client.target
        self._client = client
        self._requests = queue.SimpleQueue()
        self._call = client._stub.StepStream(iter(self._requests.get, _END),
                                             metadata=client._metadata)
        self._pending = 0
        self._spans = collections.deque()  # shared memory of the requests in flight, or None
        self._closed = False

    def send(self, env_ids, obs, is_init=None, step_index=None, extras=None, return_state=False,
             **policy):
        if self._closed:
            raise RnndError(grpc.StatusCode.CANCELLED, "stepper is closed", "StepStream")
        c = self._client
        call = c._span((obs, extras), _shm.step_reply_bytes(c._info, len(_ids(env_ids)),
                                                             return_state)
                       if c.transport == "shm" else 0)
        self._spans.append(call)
        self._requests.put(_step_request(env_ids, obs, is_init, step_index, extras, return_state,
                                         call, **policy))
        self._pending += 1

    def recv(self):
        """The StepResult of the oldest request sent and not yet received."""
        if self._pending == 0:
            raise RuntimeError("Stepper.recv() with no request in flight")
        try:
            reply = next(self._call)
        except grpc.RpcError as e:
            self._closed = True
            self._give_spans()
            raise RnndError.from_rpc_error(e, "StepStream", self._target) from None
        except StopIteration:
            self._closed = True
            self._give_spans()
            raise RnndError(grpc.StatusCode.UNKNOWN, "the daemon ended the stream",
                            "StepStream") from None
        self._pending -= 1
        call = self._spans.popleft()
        try:
            return _step_result(reply, call)
        finally:
            if call is not None:
                call.close()

    def _give_spans(self):
        while self._spans:
            call = self._spans.popleft()
            if call is not None:
                call.close()

    def close(self):
        """Half-closes the stream and waits for the daemon to finish it."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_END)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass
        self._give_spans()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            self._call.cancel()
            self._closed = True
        self.close()
