"""rnnd.torch: the daemon's recurrent core as a PyTorch module.

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

Layout is batch-first, as on the wire and in TorchRL: states are [B, L, H] (not nn.GRU's
[L, B, H]), stored per-step states [B, T, L, H].

grads="local" (default): backward fills each Parameter's ``.grad`` with the daemon's gradient;
use ``apply_gradients()`` (daemon optimizer), or a local torch optimizer followed by ``push()``.
grads="server": backward accumulates the weight gradients in the daemon's buffer (no weight
gradients travel) and ``apply_gradients()`` applies that buffer; ``.grad`` stays None.
"""

import numpy as np
import torch
from torch import nn

from .client import Client


def _np(t):
    return None if t is None else t.detach().cpu().contiguous().numpy()


def _wire(t, wire):
    """t as a numpy array for the wire dtype `wire` (bfloat16: its bit patterns), or None."""
    if t is None:
        return None
    t = t.detach()
    if wire == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).cpu().contiguous().numpy().view(np.uint16)
    return _np(t.half() if wire == "float16" else t.float())


def _t(a, device=None):
    if a is None:
        return None
    # Arrays from the client are read-only views over the reply: one copy into torch.
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def _param_names(num_layers):
    return [f"{k}_l{l}" for l in range(num_layers)
            for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


class _Forward(torch.autograd.Function):
    """Inputs: module, obs, is_init, h0, c0, hidden, cell, *params.
    Outputs: output [B, T, H], h_n [B, L, H], c_n [B, L, H] (zeros for GRU)."""

    @staticmethod
    def forward(ctx, module, obs, is_init, h0, c0, hidden, cell, *params):
        ctx.set_materialize_grads(False)
        w = module.wire
        r = module.client.forward(_wire(obs, w), _np(is_init), _wire(h0, w), _wire(c0, w),
                                  _wire(hidden, w), _wire(cell, w), keep_tape=module._need_tape,
                                  dtype=w)
        # Only the input gradients autograd will use come back (and are computed).
        need = ctx.needs_input_grad
        ctx.input_grads = [n for n, i in (("obs", 1), ("h0", 3), ("h0", 4), ("hidden", 5),
                                          ("hidden", 6)) if need[i]]
        return _finish_forward(ctx, module, r, obs.device)

    @staticmethod
    def backward(ctx, grad_output, grad_h_n, grad_c_n):
        g = _run_backward(ctx, grad_output, grad_h_n, grad_c_n)
        need = ctx.needs_input_grad
        pick = lambda i, a: _t(a, ctx.device) if need[i] and a is not None else None  # noqa: E731
        return (None, pick(1, g.grad_obs), None, pick(3, g.grad_h0), pick(4, g.grad_c0),
                pick(5, g.grad_hidden), pick(6, g.grad_cell), *_param_grads(ctx, g, 7))


class _ForwardRecorded(torch.autograd.Function):
    """Inputs: module, env_ids, steps, *params. Outputs as _Forward."""

    @staticmethod
    def forward(ctx, module, env_ids, steps, fields, *params):
        ctx.set_materialize_grads(False)
        r = module.client.forward_recorded(env_ids, steps, keep_tape=module._need_tape,
                                           fields=fields, reply_dtype=module.wire)
        module._last_recorded = r
        ctx.input_grads = ()  # the window's inputs are constants: no input gradient is wanted
        return _finish_forward(ctx, module, r, torch.device("cpu"))

    @staticmethod
    def backward(ctx, grad_output, grad_h_n, grad_c_n):
        g = _run_backward(ctx, grad_output, grad_h_n, grad_c_n)
        return (None, None, None, None, *_param_grads(ctx, g, 4))


def _finish_forward(ctx, module, r, device):
    ctx.module = module
    ctx.tape_id = r.tape_id
    ctx.device = device
    ctx.model_version = r.model_version
    out = _t(r.output, device)
    ctx.out_shape = tuple(out.shape)
    h_n = _t(r.h_n, device)
    c_n = _t(r.c_n, device) if r.c_n is not None else torch.zeros_like(h_n)
    if module.cell == "gru":
        ctx.mark_non_differentiable(c_n)
    module.model_version = r.model_version
    return out, h_n, c_n


def _run_backward(ctx, grad_output, grad_h_n, grad_c_n):
    m = ctx.module
    if not ctx.tape_id:
        raise RuntimeError("rnnd: no tape was kept for this forward (it ran with grad disabled)")
    if grad_output is None:  # only h_n / c_n were used
        grad_output = torch.zeros(ctx.out_shape)
    g = m.client.backward(ctx.tape_id, _wire(grad_output, m.wire), _wire(grad_h_n, m.wire),
                          _wire(grad_c_n, m.wire) if m.cell == "lstm" else None,
                          accumulate=(m.grads == "server"), input_grads=ctx.input_grads,
                          dtype=m.wire)
    return g


def _param_grads(ctx, g, first):
    m = ctx.module
    out = []
    for i, name in enumerate(m._names):
        if m.grads == "server" or not ctx.needs_input_grad[first + i] or name not in g.grads:
            out.append(None)
        else:
            out.append(_t(g.grads[name], ctx.device))
    return out


class RemoteRecurrent(nn.Module):
    """The daemon's GRU/LSTM as an nn.Module (see the module docstring).

    client: an rnnd.Client or a "HOST:PORT" target. grads: "local" or "server".
    pull: copy the daemon's weights into the Parameters now. wire: the dtype tensors travel in
    ("float32", or "bfloat16"/"float16": half the bytes; the daemon computes in fp32).
    """

    def __init__(self, client, grads="local", pull=True, wire="float32"):
        super().__init__()
        if grads not in ("local", "server"):
            raise ValueError('grads must be "local" or "server"')
        if wire not in ("float32", "bfloat16", "float16"):
            raise ValueError('wire must be "float32", "bfloat16" or "float16"')
        self.wire = wire
        self.client = client if isinstance(client, Client) else Client(client)
        info = self.client.info()
        self.info = info
        self.cell = info.cell
        self.input_size = int(info.input_size)
        self.hidden_size = int(info.hidden_size)
        self.num_layers = int(info.num_layers)
        self.grads = grads
        self.model_version = info.model_version
        self._last_recorded = None
        self._need_tape = False
        gh = (4 if self.cell == "lstm" else 3) * self.hidden_size
        self._names = _param_names(self.num_layers)
        for l in range(self.num_layers):
            i = self.input_size if l == 0 else self.hidden_size
            for name, shape in ((f"weight_ih_l{l}", (gh, i)), (f"weight_hh_l{l}", (gh, self.hidden_size)),
                                (f"bias_ih_l{l}", (gh,)), (f"bias_hh_l{l}", (gh,))):
                self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        if pull:
            self.pull()

    def extra_repr(self):
        return (f"{self.cell}, input_size={self.input_size}, hidden_size={self.hidden_size}, "
                f"num_layers={self.num_layers}, target={self.client.target!r}, grads={self.grads!r}")

    def _params(self):
        return [getattr(self, n) for n in self._names]

    def _tape_wanted(self, *tensors):
        if not torch.is_grad_enabled():
            return False
        if self.grads == "server":
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
        """One optimizer step on the daemon: with grads="local" it sends the Parameters' .grad
        (and clears them), with grads="server" it applies the daemon's accumulated buffer. Then
        pulls the new weights (pull=False skips that). Returns the new model_version."""
        grads = {}
        if self.grads == "local":
            for n in self._names:
                p = getattr(self, n)
                if p.grad is not None:
                    grads[n] = _np(p.grad)
                    p.grad = None
            if not grads:
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
            is_init = torch.zeros(obs.shape[:2], dtype=torch.bool)
        h0 = c0 = None
        if hx is not None:
            h0, c0 = (hx if isinstance(hx, (tuple, list)) else (hx, None))
        self._need_tape = self._tape_wanted(obs, h0, c0, hidden, cell)
        out, h_n, c_n = _Forward.apply(self, obs, is_init.bool(), h0, c0, hidden, cell,
                                       *self._params())
        return (out, (h_n, c_n)) if self.cell == "lstm" else (out, h_n)

    def forward_recorded(self, env_ids, steps, fields=None):
        """Forward over the last ``steps`` steps the daemon recorded for each env in env_ids.
        Returns (output [B, T, H], recorded) where recorded is the client's ForwardResult with
        the recorded obs, is_init, extras [B, T, E] and step_model_version as numpy arrays, or
        only those named in ``fields`` (e.g. ("is_init", "extras"); None: all). Gradients flow
        to the Parameters (the window's initial state is a constant)."""
        self._need_tape = self._tape_wanted()
        fields = None if fields is None else tuple(fields)
        out, _, _ = _ForwardRecorded.apply(self, list(env_ids), int(steps), fields,
                                           *self._params())
        r, self._last_recorded = self._last_recorded, None
        return out, r

    @torch.no_grad()
    def step(self, env_ids, obs, is_init=None, extras=None):
        """Step for actors: obs [B, I] -> output [B, H] (no gradient)."""
        return _t(self.client.step(env_ids, _np(torch.as_tensor(obs).float()),
                                   _np(torch.as_tensor(is_init)) if is_init is not None else None,
                                   extras=_np(torch.as_tensor(extras)) if extras is not None else None))
