"""rnnd.torch: the daemon's recurrent core as PyTorch operators and as an nn.Module.

    import rnnd, rnnd.torch
    core = rnnd.torch.RemoteRecurrent(rnnd.Client("127.0.0.1:50051"))
    out, h_n = core(obs, is_init)                # obs [B, T, I], is_init [B, T] -> out [B, T, H]
    loss = head(out).sum(); loss.backward()      # Backward runs on the daemon
    core.apply_gradients()                       # optimizer step on the daemon

The daemon holds the weights and computes; the module's Parameters (named and shaped like
nn.GRU / nn.LSTM: weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0, ...) mirror them.
``pull()`` copies the daemon's weights into the Parameters and ``push()`` sends the Parameters
to the daemon; ``state_dict()`` pulls first and ``load_state_dict()`` pushes after loading, so
both round-trip with nn.GRU / nn.LSTM state dicts. forward() always uses the daemon's weights.

``Policy`` (rnnd/torch_policy.py) is the daemon's policy model (encoder, core, heads) as a plain
local nn.Module: the reference its kernels are tested against, with the daemon's weight names.

Layout is batch-first, as on the wire and in TorchRL: states are [B, L, H] (not nn.GRU's
[L, B, H]), stored per-step states [B, T, L, H]. Env ids are int64 tensors holding the uint64
ids' bits (lists and numpy arrays are converted; under torch.compile pass a tensor).

grads="local" (default): backward fills each Parameter's ``.grad`` with the daemon's gradient;
use ``apply_gradients()`` (daemon optimizer), or a local torch optimizer followed by ``push()``.
grads="server": backward accumulates the weight gradients in the daemon's buffer (no weight
gradients travel; the Parameters' ``.grad`` get zeros) and ``apply_gradients()`` applies it.
grads="apply": as "server", and each backward also takes the daemon's optimizer step in the
same call (Backward with apply: one call less per iteration; a daemon on one device).

Operators. The calls an actor and a learner make are the ops in ``rnnd.torch.ops``: step,
forward (explicit trajectories), forward_recorded, forward_cursor (forward_recorded over cursor
windows, plus their cursor counts) and backward. With torch >= 2.4
(``CUSTOM_OPS``) they are torch.library custom ops, torch.ops.rnnd.*, each with a fake
implementation (output shapes from the model's sizes, which are arguments) and, for step and the
forwards, a registered autograd formula (the forwards' is rnnd::backward): torch.compile keeps
the remote core inside its graph (fullgraph=True works) and torch.export exports a module that
calls them. Outside those, and on older PyTorch (Debian 12's 1.13), the same functions and
formulas run eagerly through an autograd.Function, which costs less a call than the custom op. An op names its daemon by target string and reaches it through the newest
open Client registered for that target: RemoteRecurrent registers its own, ``register_client()``
one with a token or TLS for an exported program loaded elsewhere; with none, a plain
Client(target) is made.
"""

import types
import warnings
import weakref
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from .client import _RECORDED, Client, ForwardResult, _mask
from .cuda import staging as _staging
from .torch_policy import Policy, PolicyOutput  # noqa: F401 (the policy model's reference)
from .v1 import rnnd_pb2 as pb

CUSTOM_OPS = hasattr(torch.library, "custom_op")  # torch.library.custom_op: torch >= 2.4


# ---------------------------------------------------------------------------------------------
# Daemons, by target.

class _Target:
    """One daemon as the ops see it: the clients registered for it, of which the newest that is
    neither closed nor dropped serves (weak references: the ops keep no client alive), else one
    made here; and the last model_version the daemon reported."""

    def __init__(self, name):
        self.name = name
        self.refs = []
        self.own = None
        self.model_version = 0
        self.wire = "float32"  # the dtype tensors travel in (RemoteRecurrent's wire)
        self.apply = False  # backward applies the accumulated gradients (grads="apply")

    def add(self, client):
        self.refs = [r for r in self.refs if r() is not None and not r().closed]
        self.refs.append(weakref.ref(client))

    @property
    def client(self):
        for r in reversed(self.refs):
            c = r()
            if c is not None and not c.closed:
                return c
        if self.own is None or self.own.closed:
            self.own = Client(self.name)
        return self.own


_targets = {}


def register_client(client):
    """Makes the ops reach ``client.target`` through ``client`` (its token, TLS and timeout)
    while it is open. Returns the target's record."""
    t = _targets.get(client.target)
    if t is None:
        t = _targets[client.target] = _Target(client.target)
    t.add(client)
    return t


def _target(name):
    t = _targets.get(name)
    if t is None:
        t = _targets[name] = _Target(name)
    return t


# ---------------------------------------------------------------------------------------------
# Conversions.

def _np(t):
    return None if t is None else t.detach().cpu().contiguous().numpy()


# Tensors of a MB or more cross between host and GPU through a page-locked buffer: a pageable
# copy of tens of MB runs at a few GB/s, a pinned one at the link's speed (rnnd.cuda's staging).
_STAGE_MIN = 1 << 20


def _wire(t, wire, stage=False):
    """t as a numpy array for the wire dtype `wire` (bfloat16: its bit patterns), or None. The
    dtype changes on t's device. stage: a large CUDA tensor comes through this thread's pinned
    buffer, and the array is valid until the thread's next staged copy."""
    if t is None:
        return None
    t = t.detach()
    if wire == "bfloat16":
        x = t.to(torch.bfloat16).view(torch.int16)
    else:
        x = t.half() if wire == "float16" else t.float()
    nbytes = x.numel() * x.element_size()
    if stage and x.is_cuda and nbytes >= _STAGE_MIN:
        buf = _staging.get(nbytes).view(x.dtype).view(x.shape)
        buf.copy_(x)  # into page-locked memory: synchronous
        a = buf.numpy()
    else:
        a = x.cpu().contiguous().numpy()
    return a.view(np.uint16) if wire == "bfloat16" else a


_TORCH = {pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16,
          pb.BOOL: torch.bool, pb.INT64: torch.int64}


def _decoder(device):
    """A Client decode function: each reply Tensor as a new torch tensor on device, 16-bit
    floats widened to float32 there (after the copy, which then moves half the bytes). On the
    CPU a tensor that a shared-memory span leased (View.array) is handed out in place: its span
    stays the tensor's until the tensor is freed, and no copy or fresh pages are paid for."""
    def decode(t):
        if getattr(t, "array", None) is not None:  # leased: CPU only (decode.leases)
            return torch.from_numpy(t.array)
        dt = _TORCH.get(t.dtype)
        if dt is None:
            raise ValueError("tensor with unknown dtype %d" % t.dtype)
        shape = tuple(t.shape)
        nbytes = len(t.data)
        if nbytes != int(np.prod(shape, dtype=np.int64)) * _EL[dt]:
            raise ValueError("tensor of shape %s holds %d bytes, expected %d" %
                             (shape, nbytes, int(np.prod(shape, dtype=np.int64)) * _EL[dt]))
        if nbytes == 0:
            return torch.empty(shape, dtype=torch.float32 if dt.is_floating_point else dt,
                               device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: copied below, never written
            src = torch.frombuffer(t.data, dtype=torch.uint8)
        # The bytes are copied once (through the pinned buffer when large), then typed: the
        # copy is aligned where the reply's bytes may not be.
        if device.type == "cpu":
            x = src.clone()
        elif device.type == "cuda" and nbytes >= _STAGE_MIN:
            buf = _staging.get(nbytes)
            buf.copy_(src)
            x = buf.to(device, non_blocking=True)
            _staging.done = torch.cuda.Event()
            _staging.done.record(torch.cuda.current_stream(device))
        else:
            x = src.to(device)
        x = x.view(dt).view(shape)
        return x.float() if dt in (torch.float16, torch.bfloat16) else x
    decode.leases = device.type == "cpu"
    return decode


_EL = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.bool: 1, torch.int64: 8}


def _uids(env_ids):
    """int64 tensor -> the uint64 ids (same bits) the client sends."""
    return _np(env_ids).astype(np.int64, copy=False).view(np.uint64)


def _env_tensor(env_ids):
    if isinstance(env_ids, Tensor):
        return env_ids.to(torch.int64)
    ids = np.asarray(env_ids, dtype=np.uint64).reshape(-1)
    return torch.from_numpy(ids.view(np.int64).copy())


def _t(a, device):
    """A reply tensor on device: torch tensors (from _decoder) as they are; numpy arrays (read-only
    views over a reply, or copies out of shared memory) copied once into torch."""
    if isinstance(a, Tensor):
        return a.to(device)
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def _param_names(num_layers):
    return [f"{k}_l{l}" for l in range(num_layers)
            for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


def _is_lstm(params, hidden_size):
    # weight_ih_l0 is [G*H, I]: G = 4 for LSTM, 3 for GRU.
    return params[0].shape[0] == 4 * hidden_size


def _check_state(target, h_n, num_layers, hidden_size):
    if tuple(h_n.shape[1:]) != (num_layers, hidden_size):
        raise RuntimeError("rnnd: the daemon at %s has %d layers of width %d, the caller expects "
                           "%d of width %d (the model changed: make a new RemoteRecurrent)"
                           % (target, h_n.shape[1], h_n.shape[2], num_layers, hidden_size))


# ---------------------------------------------------------------------------------------------
# The ops: implementation, fake (shapes only) and autograd formula of each. Tapes travel as an
# int64 tensor [2] on the CPU: (tape_id, model_version); tape_id 0 means none was kept.

def _step(target: str, env_ids: Tensor, obs: Tensor, is_init: Optional[Tensor],
          extras: Optional[Tensor], hidden_size: int) -> Tensor:
    t = _target(target)
    r = t.client.step_result(_uids(env_ids), _np(obs), _np(is_init), extras=_np(extras))
    t.model_version = r.model_version
    if r.output.shape[1] != hidden_size:
        raise RuntimeError("rnnd: the daemon at %s has hidden_size %d, the caller expects %d"
                           % (target, r.output.shape[1], hidden_size))
    return _t(r.output, obs.device)


def _step_fake(target, env_ids, obs, is_init, extras, hidden_size):
    return _empty(obs, obs.shape[0], hidden_size)


def _step_setup(ctx, inputs, output):
    # Step keeps no tape on the daemon: its output is a constant for autograd (learn through
    # forward_recorded, which replays the recorded steps with a tape).
    ctx.mark_non_differentiable(output)


def _step_backward(ctx, grad):
    return None, None, None, None, None, None


def _forward_outputs(target, r, device, num_layers, hidden_size):
    t = _target(target)
    t.model_version = r.model_version
    _check_state(target, r.h_n, num_layers, hidden_size)
    h_n = _t(r.h_n, device)
    c_n = _t(r.c_n, device) if r.c_n is not None else torch.zeros_like(h_n)
    # uint64 values in an int64 tensor, bit for bit (a daemon on several devices sets bit 63)
    tape = torch.from_numpy(np.array([r.tape_id, r.model_version], dtype=np.uint64).view(np.int64))
    return _t(r.output, device), h_n, c_n, tape


def _forward(target: str, obs: Tensor, is_init: Tensor, h0: Optional[Tensor],
             c0: Optional[Tensor], hidden: Optional[Tensor], cell: Optional[Tensor],
             params: List[Tensor], hidden_size: int, keep_tape: bool,
             accumulate: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> output [B, T, H], h_n, c_n [B, L, H] (zeros for GRU), tape. params: the module's
    Parameters (their values are not sent: the daemon computes with its own weights)."""
    t = _target(target)
    w = t.wire
    r = t.client.forward(_wire(obs, w), _np(is_init), _wire(h0, w), _wire(c0, w),
                         _wire(hidden, w), _wire(cell, w), keep_tape=keep_tape, dtype=w,
                         decode=_decoder(obs.device))
    return _forward_outputs(target, r, obs.device, len(params) // 4, hidden_size)


def _empty(like, *shape, dtype=torch.float32):
    return like.new_empty(shape, dtype=dtype)


def _forward_fake(target, obs, is_init, h0, c0, hidden, cell, params, hidden_size, keep_tape,
                  accumulate):
    B, T, L, H = obs.shape[0], obs.shape[1], len(params) // 4, hidden_size
    return (_empty(obs, B, T, H), _empty(obs, B, L, H), _empty(obs, B, L, H),
            torch.empty(2, dtype=torch.int64))


# Bits of the recorded tensors forward_recorded returns (ForwardRequest.recorded_fields).
_RECORDED_ALL = (pb.RECORDED_OBS | pb.RECORDED_IS_INIT | pb.RECORDED_EXTRAS |
                 pb.RECORDED_STEP_MODEL_VERSION)


def _forward_recorded(target: str, env_ids: Tensor, steps: int, params: List[Tensor],
                      input_size: int, hidden_size: int, extras_size: int, keep_tape: bool,
                      accumulate: bool, fields: int = _RECORDED_ALL
                      ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> output, h_n, c_n, tape as _forward, then the recorded obs [B, T, I], is_init [B, T],
    extras [B, T, E] and step_model_version [B, T], on the Parameters' device; those whose
    RECORDED_* bit is not in fields are not sent and come back empty ([0])."""
    return _recorded(target, env_ids, steps, params, hidden_size, extras_size, keep_tape,
                     fields, False)[0]


def _forward_cursor(target: str, env_ids: Tensor, steps: int, params: List[Tensor],
                    input_size: int, hidden_size: int, extras_size: int, keep_tape: bool,
                    accumulate: bool, fields: int = _RECORDED_ALL
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor]:
    """forward_recorded over each env's next cursor window instead of its last steps
    (docs/design.md "Cursor"; the client's cursor_id goes with it): its 8 outputs, then cursor
    int64 [3, B] on the CPU: cursor_first, cursor_lagged and cursor_overwritten per env."""
    outs, r = _recorded(target, env_ids, steps, params, hidden_size, extras_size, keep_tape,
                        fields, True)
    cursor = np.stack([r.cursor_first, r.cursor_lagged, r.cursor_overwritten])
    return (*outs, torch.from_numpy(cursor.view(np.int64)))


def _recorded(target, env_ids, steps, params, hidden_size, extras_size, keep_tape, fields,
              cursor):
    """The forwards over recorded steps -> (their 8 outputs, the client's ForwardResult)."""
    device = params[0].device
    t = _target(target)
    # fields=None asks for all in the form shared memory also carries.
    r = t.client.forward_recorded(_uids(env_ids), steps, keep_tape=keep_tape,
                                  fields=None if fields == _RECORDED_ALL else fields,
                                  reply_dtype=t.wire, decode=_decoder(device), device=device,
                                  cursor=cursor)
    out, h_n, c_n, tape = _forward_outputs(target, r, device, len(params) // 4, hidden_size)
    B = env_ids.shape[0]

    def none(dtype=torch.float32):  # a new one each: a custom op's outputs may not alias
        return torch.empty(0, dtype=dtype, device=device)
    extras = none()
    if fields & pb.RECORDED_EXTRAS:
        extras = (_t(r.extras, device) if r.extras is not None
                  else torch.zeros((B, steps, extras_size), device=device))
    return (out, h_n, c_n, tape,
            _t(r.obs, device) if fields & pb.RECORDED_OBS else none(),
            _t(r.is_init, device) if fields & pb.RECORDED_IS_INIT else none(torch.bool),
            extras,
            _t(r.step_model_version, device) if fields & pb.RECORDED_STEP_MODEL_VERSION
            else none(torch.int64)), r


def _forward_recorded_fake(target, env_ids, steps, params, input_size, hidden_size, extras_size,
                           keep_tape, accumulate, fields=_RECORDED_ALL):
    B, T, L, H, p = env_ids.shape[0], steps, len(params) // 4, hidden_size, params[0]

    def rec(bit, *shape, dtype=torch.float32):
        return _empty(p, *(shape if fields & bit else (0,)), dtype=dtype)
    return (_empty(p, B, T, H), _empty(p, B, L, H), _empty(p, B, L, H),
            torch.empty(2, dtype=torch.int64), rec(pb.RECORDED_OBS, B, T, input_size),
            rec(pb.RECORDED_IS_INIT, B, T, dtype=torch.bool),
            rec(pb.RECORDED_EXTRAS, B, T, extras_size),
            rec(pb.RECORDED_STEP_MODEL_VERSION, B, T, dtype=torch.int64))


def _forward_cursor_fake(target, env_ids, steps, params, input_size, hidden_size, extras_size,
                         keep_tape, accumulate, fields=_RECORDED_ALL):
    return (*_forward_recorded_fake(target, env_ids, steps, params, input_size, hidden_size,
                                    extras_size, keep_tape, accumulate, fields),
            torch.empty(3, env_ids.shape[0], dtype=torch.int64))


def _backward_shapes(grad_output, params, input_size, input_grads, stored):
    """Shapes of backward's outputs before the Parameters' gradients: with input_grads,
    grad_obs, grad_h0, grad_c0 (LSTM) and, with stored states, grad_hidden and grad_cell (LSTM)."""
    if not input_grads:
        return []
    B, T, H = grad_output.shape
    L = len(params) // 4
    lstm = _is_lstm(params, H)
    shapes = [("grad_obs", (B, T, input_size)), ("grad_h0", (B, L, H))]
    if lstm:
        shapes.append(("grad_c0", (B, L, H)))
    if stored:
        shapes.append(("grad_hidden", (B, T, L, H)))
        if lstm:
            shapes.append(("grad_cell", (B, T, L, H)))
    return shapes


def _backward(target: str, tape: Tensor, grad_output: Tensor, grad_h_n: Optional[Tensor],
              grad_c_n: Optional[Tensor], params: List[Tensor], input_size: int,
              input_grads: bool, stored: bool, accumulate: bool) -> List[Tensor]:
    """Backward through a kept tape -> the input and state gradients (_backward_shapes), then
    one gradient per Parameter: the daemon's, or zeros with accumulate (the daemon keeps the
    sum; the zeros also keep a compiled graph from dropping this call as unused)."""
    tape_id = int(tape[0]) & 0xFFFFFFFFFFFFFFFF  # the uint64 id, from its int64 bits
    if tape_id == 0:
        raise RuntimeError("rnnd: no tape was kept for this forward (it ran with grad disabled)")
    t = _target(target)
    w = t.wire
    # Input gradients only when the caller takes them (a recorded window's inputs are constants).
    dev = grad_output.device
    apply = accumulate and t.apply
    if t.client._region_for(dev) is not None:  # through a CUDA or socket region
        g = t.client.backward(tape_id, grad_output, grad_h_n, grad_c_n, accumulate=accumulate,
                              input_grads=None if input_grads else (), dtype=w, apply=apply)
    else:
        g = t.client.backward(tape_id, _wire(grad_output, w, stage=True), _wire(grad_h_n, w),
                              _wire(grad_c_n, w), accumulate=accumulate,
                              input_grads=None if input_grads else (), dtype=w,
                              decode=_decoder(dev), apply=apply)
    if apply:
        t.model_version = g.model_version
    out = []
    for name, shape in _backward_shapes(grad_output, params, input_size, input_grads, stored):
        a = getattr(g, name)
        out.append(_t(a, dev) if a is not None else torch.zeros(shape, device=dev))
    for name, p in zip(_param_names(len(params) // 4), params):
        out.append(_t(g.grads[name], p.device) if name in g.grads else torch.zeros_like(p))
    return out


def _backward_fake(target, tape, grad_output, grad_h_n, grad_c_n, params, input_size,
                   input_grads, stored, accumulate):
    shapes = _backward_shapes(grad_output, params, input_size, input_grads, stored)
    return [grad_output.new_empty(s) for _, s in shapes] + [torch.empty_like(p) for p in params]


def _save_tape(ctx, target, output, params, input_size, hidden_size, accumulate, constants):
    """setup_context shared by the forwards: output[3] is the tape; constants are the outputs
    autograd must not differentiate (with c_n for GRU). Unused outputs get no gradient (None,
    not zeros): nothing is sent for them."""
    ctx.target, ctx.input_size, ctx.accumulate = target, input_size, accumulate
    ctx.lstm = _is_lstm(params, hidden_size)
    ctx.out_shape, ctx.out_device = output[0].shape, output[0].device
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[3], *constants, *(() if ctx.lstm else (output[2],)))
    ctx.save_for_backward(output[3], *params)


def _run_backward(ctx, grad_output, grad_h_n, grad_c_n, input_grads, stored):
    """-> (input and state gradients, the Parameters' gradients)."""
    tape, *params = ctx.saved_tensors
    if grad_output is None:  # only h_n / c_n were used
        grad_output = torch.zeros(ctx.out_shape, device=ctx.out_device)
    # The custom op where a compiled graph's backward may be traced, the function itself from
    # the eager path's autograd.Function (_Eager: its ctx has rnnd_at).
    backward = _backward if hasattr(ctx, "rnnd_at") else _backward_op
    grads = backward(ctx.target, tape, grad_output, grad_h_n, grad_c_n if ctx.lstm else None,
                     params, ctx.input_size, input_grads, stored, ctx.accumulate)
    n = len(_backward_shapes(grad_output, params, ctx.input_size, input_grads, stored))
    return grads[:n], list(grads[n:])


def _forward_setup(ctx, inputs, output):
    target, obs, _, h0, c0, hidden, cell, params, hidden_size, _, accumulate = inputs
    _save_tape(ctx, target, output, params, obs.shape[-1], hidden_size, accumulate, ())
    ctx.given = (h0 is not None, c0 is not None, hidden is not None, cell is not None)


def _forward_backward(ctx, grad_output, grad_h_n, grad_c_n, grad_tape):
    has_h0, has_c0, has_hidden, has_cell = ctx.given
    state, pgrads = _run_backward(ctx, grad_output, grad_h_n, grad_c_n, True, has_hidden)
    state = iter(state)
    g_obs, g_h0 = next(state), next(state)
    g_c0 = next(state) if ctx.lstm else None
    g_hidden = next(state) if has_hidden else None
    g_cell = next(state) if has_hidden and ctx.lstm else None
    return (None, g_obs, None, g_h0 if has_h0 else None, g_c0 if has_c0 else None, g_hidden,
            g_cell if has_cell else None, pgrads, None, None, None)


def _forward_recorded_setup(ctx, inputs, output):
    target, _, _, params, input_size, hidden_size, _, _, accumulate = inputs[:9]
    ctx.n_inputs = len(inputs)  # fields may be left to its default
    _save_tape(ctx, target, output, params, input_size, hidden_size, accumulate, output[4:])


def _forward_recorded_backward(ctx, grad_output, grad_h_n, grad_c_n, *constants):
    # The window's initial state and inputs are the recorded ones: only the weights get grads.
    _, pgrads = _run_backward(ctx, grad_output, grad_h_n, grad_c_n, False, False)
    # One gradient per input the op received: the dispatcher drops fields when it equals its
    # default, and a custom op's ctx.needs_input_grad has a flag for each input it kept (its
    # setup_context saw fields filled back in); _Eager counts the arguments passed.
    n = ctx.n_inputs if hasattr(ctx, "rnnd_at") else len(ctx.needs_input_grad)
    return (None, None, None, pgrads) + (None,) * (n - 4)


class _Eager(torch.autograd.Function):
    """One op through autograd with the same setup_context and backward as its custom op: the
    op itself on torch < 2.4, and outside torch.compile on newer torch. The List[Tensor]
    argument at position `at` (n Parameters) is spread into separate arguments, so that
    autograd sees each."""

    @staticmethod
    def forward(ctx, fns, at, n, *flat):
        impl, setup_context, backward = fns
        args = flat if at < 0 else (*flat[:at], list(flat[at:at + n]), *flat[at + n:])
        out = impl(*args)
        setup_context(ctx, args, out)
        ctx.rnnd_backward, ctx.rnnd_at = backward, at
        return out

    @staticmethod
    def backward(ctx, *grads):
        g, at = ctx.rnnd_backward(ctx, *grads), ctx.rnnd_at
        if at >= 0:
            g = (*g[:at], *g[at], *g[at + 1:])
        return (None, None, None, *g)


def _define(name, impl, fake, setup_context=None, backward=None):
    """-> (the op as called, the op as rnnd.torch.ops names it). An op with an autograd formula
    is called as the custom op under torch.compile and torch.export and eagerly through
    _Eager; the backward op (called inside formulas, where a compiled graph's backward is
    traced without torch.compile's flag) is the custom op, or its function on older torch."""
    eager = _eager(name, impl, setup_context, backward)
    if not CUSTOM_OPS:
        return eager, eager
    op = torch.library.custom_op("rnnd::" + name, impl, mutates_args=())
    op.register_fake(fake)
    if backward is None:
        return op, op
    op.register_autograd(backward, setup_context=setup_context)

    def call(*args):
        # Eagerly the same functions through an autograd.Function: a custom op's dispatch
        # and autograd wrapping cost ~0.1 ms a call, a learner iteration makes two.
        return op(*args) if torch.compiler.is_compiling() else eager(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = impl.__doc__
    return call, op


def _eager(name, impl, setup_context, backward):
    if backward is None:
        return impl

    def eager(*args):
        at = next((k for k, a in enumerate(args) if isinstance(a, list)), -1)
        flat = args if at < 0 else (*args[:at], *args[at], *args[at + 1:])
        if not (torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in flat)):
            return impl(*args)
        n = len(args[at]) if at >= 0 else 0
        return _Eager.apply((impl, setup_context, backward), at, n, *flat)

    eager.__name__ = eager.__qualname__ = name
    eager.__doc__ = impl.__doc__
    return eager


_step_op, _step_named = _define("step", _step, _step_fake, _step_setup, _step_backward)
_forward_op, _forward_named = _define("forward", _forward, _forward_fake, _forward_setup,
                                      _forward_backward)
_forward_recorded_op, _forward_recorded_named = _define(
    "forward_recorded", _forward_recorded, _forward_recorded_fake, _forward_recorded_setup,
    _forward_recorded_backward)
_forward_cursor_op, _forward_cursor_named = _define(
    "forward_cursor", _forward_cursor, _forward_cursor_fake, _forward_recorded_setup,
    _forward_recorded_backward)
_backward_op, _backward_named = _define("backward", _backward, _backward_fake)
ops = types.SimpleNamespace(step=_step_named, forward=_forward_named,
                            forward_recorded=_forward_recorded_named,
                            forward_cursor=_forward_cursor_named, backward=_backward_named)


# ---------------------------------------------------------------------------------------------
# The module.

class RemoteRecurrent(nn.Module):
    """The daemon's GRU/LSTM as an nn.Module (see the module docstring).

    client: an rnnd.Client or a "HOST:PORT" target. grads: "local", "server" or "apply".
    pull: copy the daemon's weights into the Parameters now. wire: the dtype tensors travel in,
    "float32", "bfloat16" or "float16" (the daemon computes in its own precision either way; it
    is set for every RemoteRecurrent of this target).
    """

    def __init__(self, client, grads="local", pull=True, wire="float32"):
        super().__init__()
        if grads not in ("local", "server", "apply"):
            raise ValueError('grads must be "local", "server" or "apply"')
        if wire not in ("float32", "bfloat16", "float16"):
            raise ValueError('wire must be "float32", "bfloat16" or "float16"')
        self.client = client if isinstance(client, Client) else Client(client)
        self.target = self.client.target
        self._remote = register_client(self.client)
        self.wire = _target(self.target).wire = wire
        info = self.client.info()
        self.info = info
        self.cell = info.cell
        self.input_size = int(info.input_size)
        self.hidden_size = int(info.hidden_size)
        self.num_layers = int(info.num_layers)
        self.extras_size = int(info.extras_size)
        self.grads = grads
        _target(self.target).apply = grads == "apply"
        self.model_version = info.model_version
        gh = (4 if self.cell == "lstm" else 3) * self.hidden_size
        self._names = _param_names(self.num_layers)
        for l in range(self.num_layers):
            i = self.input_size if l == 0 else self.hidden_size
            for name, shape in ((f"weight_ih_l{l}", (gh, i)), (f"weight_hh_l{l}", (gh, self.hidden_size)),
                                (f"bias_ih_l{l}", (gh,)), (f"bias_hh_l{l}", (gh,))):
                self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        if pull:
            self.pull()

    @property
    def model_version(self):
        """The daemon's model_version as last reported to any call on this target."""
        return self._remote.model_version

    @model_version.setter
    def model_version(self, v):
        self._remote.model_version = v

    def extra_repr(self):
        return (f"{self.cell}, input_size={self.input_size}, hidden_size={self.hidden_size}, "
                f"num_layers={self.num_layers}, target={self.target!r}, grads={self.grads!r}")

    def _params(self):
        return [getattr(self, n) for n in self._names]

    def _tape_wanted(self, *tensors):
        if not torch.is_grad_enabled():
            return False
        if self.grads != "local":
            return True
        return any(t is not None and t.requires_grad for t in (*tensors, *self._params()))

    # -- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def pull(self):
        """Copies the daemon's weights into the Parameters; returns the model_version."""
        w = self.client.get_weights()
        for n in self._names:
            getattr(self, n).copy_(torch.from_numpy(np.array(w[n])))
        self.model_version = w.model_version
        return w.model_version

    def push(self):
        """Sends the Parameters to the daemon (SetWeights); returns the new model_version."""
        self.model_version = self.client.set_weights({n: _np(getattr(self, n)) for n in self._names})
        return self.model_version

    def state_dict(self, *args, **kwargs):
        self.pull()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.push()

    def apply_gradients(self, lr=None, pull=True):
        """One optimizer step on the daemon: with grads="local" it sends the Parameters' .grad,
        with grads="server" it applies the daemon's accumulated buffer, with grads="apply" there
        is none left to take (backward took it); each clears .grad. Then pulls the new weights
        (pull=False skips that). Returns the new model_version."""
        if self.grads == "apply":
            for n in self._names:
                getattr(self, n).grad = None
            if pull:
                self.pull()
            return self.model_version
        grads = {}
        for n in self._names:
            p = getattr(self, n)
            if p.grad is not None and self.grads == "local":
                grads[n] = _np(p.grad)
            p.grad = None
        if self.grads == "local" and not grads:
            raise RuntimeError("rnnd: apply_gradients with no .grad on any parameter")
        self.model_version = self.client.apply_gradients(grads, lr=lr)
        if pull:
            self.pull()
        return self.model_version

    # -- compute -------------------------------------------------------------------------------

    def forward(self, obs, is_init=None, hx=None, hidden=None, cell=None):
        """obs [B, T, I]; is_init [B, T] bool (None: all false); hx: h0 [B, L, H] (GRU) or
        (h0, c0) (LSTM); hidden/cell [B, T, L, H]: TorchRL-style stored states used where
        is_init (and at t = 0; hx and hidden exclude each other). Returns (output [B, T, H],
        h_n) for GRU, (output, (h_n, c_n)) for LSTM. Gradients flow to obs, hx, hidden, cell and
        the Parameters. The daemon's tape serves one backward (no retain_graph)."""
        obs = obs.float()
        if is_init is None:
            is_init = torch.zeros(obs.shape[:2], dtype=torch.bool, device=obs.device)
        h0 = c0 = None
        if hx is not None:
            h0, c0 = (hx if isinstance(hx, (tuple, list)) else (hx, None))
        keep = self._tape_wanted(obs, h0, c0, hidden, cell)
        out, h_n, c_n, _ = _forward_op(self.target, obs, is_init.bool(), h0, c0, hidden, cell,
                                        self._params(), self.hidden_size, keep,
                                        self.grads != "local")
        return (out, (h_n, c_n)) if self.cell == "lstm" else (out, h_n)

    def forward_recorded(self, env_ids, steps, fields=None, cursor=False):
        """Forward over the last ``steps`` steps the daemon recorded for each env in env_ids.
        Returns (output [B, T, H], recorded): recorded is a ForwardResult of tensors on the
        Parameters' device: output, h_n, c_n (LSTM), tape_id and model_version (0-d), the
        recorded obs, is_init, extras [B, T, E] and step_model_version [B, T], or only those
        named in ``fields`` (e.g. ("is_init",); the others None and not sent; None: all).
        cursor: each env's next window from its cursor instead (docs/design.md "Cursor"), so
        that every recorded step is handed out once, consecutive windows sharing the bootstrap
        step; recorded then also holds cursor_first, cursor_lagged and cursor_overwritten
        (int64 [B] on the CPU: where each window starts, the steps skipped before it for
        --max-policy-lag and those that left the ring unseen).
        Gradients flow to the Parameters (the window's initial state is a constant)."""
        bits = _RECORDED_ALL if fields is None else _mask(fields, _RECORDED)
        op = _forward_cursor_op if cursor else _forward_recorded_op
        out, h_n, c_n, tape, obs, is_init, extras, smv, *cur = op(
            self.target, _env_tensor(env_ids), int(steps), self._params(), self.input_size,
            self.hidden_size, self.extras_size, self._tape_wanted(), self.grads != "local", bits)
        rec = ForwardResult(out, h_n, c_n if self.cell == "lstm" else None, tape[0], tape[1],
                            *(x if bits & bit else None for x, bit in (
                                (obs, pb.RECORDED_OBS), (is_init, pb.RECORDED_IS_INIT),
                                (extras, pb.RECORDED_EXTRAS),
                                (smv, pb.RECORDED_STEP_MODEL_VERSION))))
        if cursor:
            first, lagged, overwritten = cur[0]
            rec = rec._replace(cursor_first=first, cursor_lagged=lagged,
                               cursor_overwritten=overwritten)
        return out, rec

    def step(self, env_ids, obs, is_init=None, extras=None):
        """Step for actors: obs [B, I] -> output [B, H], a constant for autograd. is_init: B
        bools or one for all (None: all false); extras [B, E] are recorded with the step."""
        obs = torch.as_tensor(obs).float()
        return _step_op(self.target, _env_tensor(env_ids), obs,
                        None if is_init is None else torch.as_tensor(is_init, dtype=torch.bool),
                        None if extras is None else torch.as_tensor(extras).float(),
                        self.hidden_size)
