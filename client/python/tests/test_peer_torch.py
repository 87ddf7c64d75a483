"""Peer check against PyTorch (issue 5): through the daemon (CPU backend), with weights copied
from torch nn.GRU / nn.LSTM (2 layers), outputs and every gradient equal PyTorch autograd of a
per-step loop with random resets and stored states (relative error <= 1e-4, fp32 compute), and
Step over 50 steps with random resets and random env subsets equals a per-env PyTorch loop.
The reference runs in float64 so that its own rounding does not count against the daemon."""

import sys
import unittest

import numpy as np

from _common import daemon, rel_err, skip

try:
    import torch
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")

TOL = 1e-4
I, H, L = 5, 7, 2


def make_module(cell, seed):
    torch.manual_seed(seed)
    cls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
    return cls(I, H, L, batch_first=True)


def weights_of(mod):
    return {k: v.detach().numpy().astype(np.float32) for k, v in mod.state_dict().items()}


def reference_sequence(mod, obs, is_init, h0=None, c0=None, hidden=None, cell=None):
    """Per-step loop in float64 with TorchRL resets; everything batch-first ([B, L, H]).
    Returns (output, h_n, c_n) and the leaf tensors (for gradients)."""
    lstm = isinstance(mod, torch.nn.LSTM)
    m = mod.double()
    B, T, _ = obs.shape
    zeros = torch.zeros(B, L, H, dtype=torch.float64)
    if hidden is not None:
        h = hidden[:, 0]
        c = cell[:, 0] if lstm else None
    else:
        h = h0 if h0 is not None else zeros
        c = (c0 if c0 is not None else zeros) if lstm else None
    outs = []
    for t in range(T):
        reset = is_init[:, t].view(B, 1, 1)
        h = torch.where(reset, hidden[:, t] if hidden is not None else zeros, h)
        if lstm:
            c = torch.where(reset, cell[:, t] if cell is not None else zeros, c)
            o, (hn, cn) = m(obs[:, t:t + 1], (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()))
            c = cn.transpose(0, 1)
        else:
            o, hn = m(obs[:, t:t + 1], h.transpose(0, 1).contiguous())
        h = hn.transpose(0, 1)
        outs.append(o[:, 0])
    return torch.stack(outs, 1), h, c


class PeerSequence(unittest.TestCase):
    def run_case(self, cell, stored, seed, B=4, T=9):
        rng = np.random.default_rng(seed)
        mod = make_module(cell, seed)
        w = weights_of(mod)
        lstm = cell == "lstm"
        obs = rng.standard_normal((B, T, I)).astype(np.float32)
        is_init = rng.random((B, T)) < 0.3
        is_init[0, 0] = True
        kw = {}
        if stored:
            kw["hidden"] = (0.5 * rng.standard_normal((B, T, L, H))).astype(np.float32)
            if lstm:
                kw["cell"] = (0.5 * rng.standard_normal((B, T, L, H))).astype(np.float32)
        else:
            kw["h0"] = (0.5 * rng.standard_normal((B, L, H))).astype(np.float32)
            if lstm:
                kw["c0"] = (0.5 * rng.standard_normal((B, L, H))).astype(np.float32)
        g_out = rng.standard_normal((B, T, H)).astype(np.float32)
        g_hn = rng.standard_normal((B, L, H)).astype(np.float32)
        g_cn = rng.standard_normal((B, L, H)).astype(np.float32) if lstm else None

        c = self.clients[cell]
        c.set_weights(w)
        r = c.forward(obs, is_init, keep_tape=True, **kw)
        self.assertNotEqual(r.tape_id, 0, "keep_tape=True must give a tape id")
        g = c.backward(r.tape_id, g_out, g_hn, g_cn)

        # reference
        ref_mod = make_module(cell, seed)
        ref_mod.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
        leaves = {"obs": torch.tensor(obs, dtype=torch.float64, requires_grad=True)}
        for k, v in kw.items():
            leaves[k] = torch.tensor(v, dtype=torch.float64, requires_grad=True)
        args = {k: v for k, v in leaves.items() if k != "obs"}
        out, hn, cn = reference_sequence(ref_mod, leaves["obs"], torch.from_numpy(is_init), **args)
        loss = (out * torch.from_numpy(g_out).double()).sum() + (hn * torch.from_numpy(g_hn).double()).sum()
        if lstm:
            loss = loss + (cn * torch.from_numpy(g_cn).double()).sum()
        loss.backward()

        what = "%s %s" % (cell, "stored states" if stored else "h0")
        checks = [("output", r.output, out), ("h_n", r.h_n, hn)]
        if lstm:
            checks.append(("c_n", r.c_n, cn))
        for name, p in ref_mod.named_parameters():
            self.assertIn(name, g.grads, "%s: Backward did not return %s" % (what, name))
            checks.append(("grad " + name, g.grads[name], p.grad))
        checks.append(("grad_obs", g.grad_obs, leaves["obs"].grad))
        grad_field = {"h0": g.grad_h0, "c0": g.grad_c0, "hidden": g.grad_hidden, "cell": g.grad_cell}
        for k in args:
            checks.append(("grad_" + k, grad_field[k], leaves[k].grad))
        for name, got, ref in checks:
            ref = ref.detach().numpy()
            self.assertIsNotNone(got, "%s: %s missing from the reply" % (what, name))
            e = rel_err(got, ref)
            self.worst = max(getattr(self, "worst", 0.0), e)
            self.assertLessEqual(e, TOL, "%s: %s relative error %.3g" % (what, name, e))
        self.assertEqual(len(g.grads), len(list(ref_mod.parameters())),
                         "%s: grads %s" % (what, sorted(g.grads)))

    def test_gru_h0(self):
        self.run_case("gru", False, 1)

    def test_gru_stored_states(self):
        self.run_case("gru", True, 2)

    def test_lstm_h0(self):
        self.run_case("lstm", False, 3)

    def test_lstm_stored_states(self):
        self.run_case("lstm", True, 4)

    def test_shapes(self):
        for cell in ("gru", "lstm"):
            for stored in (False, True):
                self.run_case(cell, stored, 20, B=1, T=1)
                self.run_case(cell, stored, 21, B=6, T=40)

    def run_steps(self, cell, seed):
        rng = np.random.default_rng(seed)
        mod = make_module(cell, seed + 10)
        c = self.clients[cell]
        c.set_weights(weights_of(mod))
        ref = mod.double()
        lstm = cell == "lstm"
        N = 10
        env_ids = rng.choice(1 << 40, size=N, replace=False).astype(np.uint64) + np.uint64(seed << 48)
        state = {}
        for step in range(50):
            k = int(rng.integers(1, N + 1))
            pick = rng.choice(N, size=k, replace=False)
            ids = env_ids[pick]
            obs = rng.standard_normal((k, I)).astype(np.float32)
            init = rng.random(k) < 0.15
            for j, e in enumerate(ids):
                if int(e) not in state:
                    init[j] = True
            res = c.step_result(ids, obs, init, return_state=True)
            self.assertEqual(res.output.shape, (k, H))
            for j, e in enumerate(ids):
                e = int(e)
                if init[j] or e not in state:
                    h = torch.zeros(L, 1, H, dtype=torch.float64)
                    cc = torch.zeros(L, 1, H, dtype=torch.float64)
                else:
                    h, cc = state[e]
                x = torch.tensor(obs[j], dtype=torch.float64).view(1, 1, I)
                with torch.no_grad():
                    if lstm:
                        o, (h, cc) = ref(x, (h, cc))
                    else:
                        o, h = ref(x, h)
                state[e] = (h, cc)
                where = "%s step %d env %d" % (cell, step, e)
                e1 = rel_err(res.output[j], o[0, 0].numpy())
                self.assertLessEqual(e1, TOL, "%s: output relative error %.3g" % (where, e1))
                self.assertIsNotNone(res.h, "%s: return_state gave no h" % where)
                e2 = rel_err(res.h[j], h[:, 0].numpy())
                self.assertLessEqual(e2, TOL, "%s: h relative error %.3g" % (where, e2))
                if lstm:
                    self.assertIsNotNone(res.c, "%s: return_state gave no c" % where)
                    e3 = rel_err(res.c[j], cc[:, 0].numpy())
                    self.assertLessEqual(e3, TOL, "%s: c relative error %.3g" % (where, e3))
        c.end_episodes(env_ids)

    def test_gru_steps(self):
        self.run_steps("gru", 5)

    def test_lstm_steps(self):
        self.run_steps("lstm", 6)

    @classmethod
    def setUpClass(cls):
        cls.daemons = {}
        cls.clients = {}
        for cell in ("gru", "lstm"):
            d = daemon(cell=cell, layers=L, input_size=I, hidden_size=H, compute="fp32").start()
            cls.daemons[cell] = d
            cls.clients[cell] = d.client()

    def tearDown(self):
        if getattr(self, "worst", None) is not None:
            print("  worst relative error %.2e" % self.worst, file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        for c in cls.clients.values():
            c.close()
        for d in cls.daemons.values():
            d.stop()


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(not unittest.main(exit=False, verbosity=2).result.wasSuccessful())
