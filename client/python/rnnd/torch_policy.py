"""rnnd.torch.Policy: the daemon's policy model as a plain PyTorch module, its reference.

    import rnnd, rnnd.torch
    pi = rnnd.torch.Policy(input_size=8, hidden_size=64, cell="gru", encoder_widths=(64,),
                           discrete_actions=4, value_head=True)
    out = pi(obs, is_init)                  # obs [B, T, I], is_init [B, T] bool
    dist = pi.distribution(out)             # Categorical(logits) or Normal(mean, std) per dim
    loss = -(dist.log_prob(actions) * adv).mean() + ((out.value - ret) ** 2).mean()
    rnnd.save_safetensors("policy.safetensors", pi.weights())   # what rnnd --weights reads

The model (docs/design.md "Policy"): obs -> encoder (Linear then activation, per width) ->
recurrent core (GRU/LSTM, PyTorch's gate math and weights) -> heads on the core output h:
policy_logits (K), action_mean (A) with a learned state-independent action_log_std (A), value (1).
Its state_dict names are the daemon's weight names, in the daemon's order: the core's as
nn.GRU/nn.LSTM names them (weight_ih_l0, ...), action_log_std, encoder.{j}.weight/.bias,
policy_logits.*, action_mean.*, value.*. Without encoder and heads it is the core alone.

forward runs the daemon's semantics: batch-first, and before step t of row b where is_init[b, t]
the state of every layer is reset to zero, or to the stored state hidden[b, t] (and cell[b, t])
when given (TorchRL's convention); at t = 0 the state is hidden[:, 0], else state (h0 [B, L, H],
or (h0, c0) for LSTM), else zero. States are [B, L, H], as on the wire (not nn.GRU's [L, B, H]).
It is written as a loop over steps for clarity; it is the float64 reference the daemon's kernels
are tested against, and a learner may train it locally in any dtype.
"""

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

ACTIVATIONS = {"elu": nn.functional.elu, "relu": nn.functional.relu, "tanh": torch.tanh}


class PolicyOutput(NamedTuple):
    """What Policy.forward returns. Heads the model lacks are None."""
    logits: Optional[Tensor]   # [B, T, K]
    mean: Optional[Tensor]     # [B, T, A]
    log_std: Optional[Tensor]  # [B, T, A] (action_log_std, the same for every step)
    value: Optional[Tensor]    # [B, T]
    output: Tensor             # [B, T, H]: the core's last layer at every step
    state: object              # h_n [B, L, H] for GRU, (h_n, c_n) for LSTM


class Policy(nn.Module):
    """Encoder -> GRU/LSTM core -> heads (see the module docstring).

    input_size: observation width I. hidden_size, num_layers, cell ("gru" | "lstm"): the core.
    encoder_widths: output width of each encoder Linear (empty: the core reads the observation);
    encoder_activation: "elu" (Sample Factory's default), "relu" or "tanh".
    discrete_actions: K logits (0: none); gaussian_actions: A dims of a diagonal Gaussian (0:
    none); at most one of the two. value_head: a value output.
    Initialisation is PyTorch's: the core as nn.GRU/nn.LSTM, the Linears as nn.Linear,
    action_log_std zero.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, cell: str = "gru",
                 encoder_widths: Sequence[int] = (), encoder_activation: str = "elu",
                 discrete_actions: int = 0, gaussian_actions: int = 0, value_head: bool = False):
        super().__init__()
        if cell not in ("gru", "lstm"):
            raise ValueError('cell must be "gru" or "lstm"')
        if encoder_activation not in ACTIVATIONS:
            raise ValueError("encoder_activation must be one of %s" % ", ".join(ACTIVATIONS))
        if discrete_actions == 1 or discrete_actions < 0 or gaussian_actions < 0:
            raise ValueError("discrete_actions is 0 or >= 2, gaussian_actions >= 0")
        if discrete_actions and gaussian_actions:
            raise ValueError("a policy has one action head: discrete_actions or gaussian_actions")
        self.cell, self.input_size, self.hidden_size = cell, input_size, hidden_size
        self.num_layers = num_layers
        self.encoder_widths = tuple(int(w) for w in encoder_widths)
        self.encoder_activation = encoder_activation
        self.discrete_actions, self.gaussian_actions = discrete_actions, gaussian_actions
        self.value_head = value_head

        # The core's Parameters sit on the module itself, so their names are nn.GRU's.
        gh = (4 if cell == "lstm" else 3) * hidden_size
        core_in = self.encoder_widths[-1] if self.encoder_widths else input_size
        k = 1.0 / math.sqrt(hidden_size)
        self._core_names = []
        for l in range(num_layers):
            i = core_in if l == 0 else hidden_size
            for name, shape in ((f"weight_ih_l{l}", (gh, i)),
                                (f"weight_hh_l{l}", (gh, hidden_size)),
                                (f"bias_ih_l{l}", (gh,)), (f"bias_hh_l{l}", (gh,))):
                self.register_parameter(name, nn.Parameter(torch.empty(shape).uniform_(-k, k)))
                self._core_names.append(name)
        if gaussian_actions:
            self.action_log_std = nn.Parameter(torch.zeros(gaussian_actions))
        widths = (input_size,) + self.encoder_widths
        self.encoder = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        if discrete_actions:
            self.policy_logits = nn.Linear(hidden_size, discrete_actions)
        if gaussian_actions:
            self.action_mean = nn.Linear(hidden_size, gaussian_actions)
        if value_head:
            self.value = nn.Linear(hidden_size, 1)

    def extra_repr(self):
        return (f"{self.cell}, input_size={self.input_size}, hidden_size={self.hidden_size}, "
                f"num_layers={self.num_layers}, encoder_activation={self.encoder_activation!r}")

    # -- weights -------------------------------------------------------------------------------

    def weights(self):
        """The state_dict as float32 numpy arrays: what the daemon's SetWeights and
        rnnd.save_safetensors take (the daemon stores fp32)."""
        return {k: v.detach().cpu().float().numpy() for k, v in self.state_dict().items()}

    @torch.no_grad()
    def load_weights(self, tensors):
        """Loads name -> array (rnnd.load_safetensors, the daemon's GetWeights, weights()) into
        the Parameters, converting to their dtype and device; every name must match (strict)."""
        own = self.state_dict()
        self.load_state_dict({k: torch.tensor(np.asarray(v), dtype=own[k].dtype if k in own
                                              else None) for k, v in tensors.items()})

    # -- compute -------------------------------------------------------------------------------

    def _core_step(self, l, x, h, c):
        w_ih, w_hh, b_ih, b_hh = (getattr(self, n) for n in self._core_names[4 * l:4 * l + 4])
        H = self.hidden_size
        if self.cell == "lstm":
            a = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh
            i, f = torch.sigmoid(a[:, :H]), torch.sigmoid(a[:, H:2 * H])
            g, o = torch.tanh(a[:, 2 * H:3 * H]), torch.sigmoid(a[:, 3 * H:])
            c = f * c + i * g
            return o * torch.tanh(c), c
        gi, gh = x @ w_ih.T + b_ih, h @ w_hh.T + b_hh
        r = torch.sigmoid(gi[:, :H] + gh[:, :H])
        z = torch.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
        n = torch.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
        return (1 - z) * n + z * h, None

    def encode(self, obs: Tensor) -> Tensor:
        """The encoder alone: obs [..., I] -> [..., encoder_widths[-1]] (obs without encoder)."""
        act = ACTIVATIONS[self.encoder_activation]
        for lin in self.encoder:
            obs = act(lin(obs))
        return obs

    def forward(self, obs: Tensor, is_init: Optional[Tensor] = None, state=None,
                hidden: Optional[Tensor] = None, cell: Optional[Tensor] = None) -> PolicyOutput:
        """obs [B, T, I]; is_init [B, T] bool (None: all false); state: h0 [B, L, H] (GRU) or
        (h0, c0) (LSTM), exclusive with the stored states hidden/cell [B, T, L, H]."""
        B, T = obs.shape[:2]
        L, H, lstm = self.num_layers, self.hidden_size, self.cell == "lstm"
        if is_init is None:
            is_init = torch.zeros(B, T, dtype=torch.bool, device=obs.device)
        h0, c0 = (state if isinstance(state, (tuple, list)) else (state, None))
        if (h0 is not None or c0 is not None) and hidden is not None:
            raise ValueError("state and stored states (hidden) exclude each other")
        x = self.encode(obs)
        zero = x.new_zeros(B, H)

        def start(stored, given, l):
            if stored is not None:
                return stored[:, 0, l]
            return given[:, l] if given is not None else zero

        h = [start(hidden, h0, l) for l in range(L)]
        c = [start(cell, c0, l) for l in range(L)] if lstm else [None] * L
        outs = []
        for t in range(T):
            reset = is_init[:, t].bool().unsqueeze(1)
            inp = x[:, t]
            for l in range(L):
                h[l] = torch.where(reset, hidden[:, t, l] if hidden is not None else zero, h[l])
                if lstm:
                    c[l] = torch.where(reset, cell[:, t, l] if cell is not None else zero, c[l])
                h[l], c[l] = self._core_step(l, inp, h[l], c[l])
                inp = h[l]
            outs.append(inp)
        out = torch.stack(outs, 1)
        h_n = torch.stack(h, 1)
        new_state = (h_n, torch.stack(c, 1)) if lstm else h_n
        logits = self.policy_logits(out) if self.discrete_actions else None
        mean = log_std = None
        if self.gaussian_actions:
            mean = self.action_mean(out)
            log_std = self.action_log_std.expand_as(mean)
        value = self.value(out).squeeze(-1) if self.value_head else None
        return PolicyOutput(logits, mean, log_std, value, out, new_state)

    def distribution(self, out: PolicyOutput):
        """The action distribution of forward's output: Categorical over the logits, or
        Independent(Normal(mean, exp(log_std)), 1) (log_prob sums over the A dims), as the
        daemon's log-probs and entropies are defined."""
        if out.logits is not None:
            return torch.distributions.Categorical(logits=out.logits)
        if out.mean is not None:
            return torch.distributions.Independent(
                torch.distributions.Normal(out.mean, out.log_std.exp()), 1)
        raise ValueError("this Policy has no action head")
