"""rnnd.torch.Policy against the CPU backend's policy ops (tests/unit/policy_ref.c, at
$RNND_POLICY_REF).

For several models (GRU/LSTM, 1-2 layers, encoders of 0-3 layers with elu/relu/tanh, discrete or
Gaussian heads, with and without the value head, from h0 or from stored states, with resets):
the module runs in float64 on float32-exact inputs and weights, the C backend in fp32; logits,
mean, log-std, values, the core output and final state, log-probs and entropies of given
actions, and every gradient (each parameter's, the observations', the initial or stored
states') must agree to 1e-4 relative. The C side reads the module's weights by name, so its
state_dict names are the daemon's (and in the daemon's order: the C side lists them), and the
weights it writes back load into a fresh Policy unchanged (the safetensors round trip). The
C sampler's actions carry torch's log-prob, and repeat exactly on a second run.
Also: the module's core equals nn.GRU / nn.LSTM where the reset rule reduces to a plain
sequence, and a Policy without encoder or heads has nn.GRU's state_dict.
"""

import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from _common import rel_err, skip

try:
    import torch
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")
import rnnd  # noqa: E402
import rnnd.torch  # noqa: E402

TOL = 1e-4
B, T = 3, 5

CASES = [
    # cell, I, H, L, encoder, activation, K, A, value, initial state ("h0", "stored", None)
    ("gru", 6, 7, 1, (8, 5), "elu", 4, 0, True, None),
    ("lstm", 5, 6, 2, (7,), "tanh", 0, 3, True, "h0"),
    ("gru", 4, 5, 2, (), "elu", 3, 0, False, "stored"),
    ("lstm", 6, 4, 1, (5, 5, 6), "relu", 0, 2, False, "stored"),
    ("gru", 3, 4, 1, (6,), "relu", 0, 0, True, "h0"),  # value head only: no actions
]


def ref_binary():
    b = os.environ.get("RNND_POLICY_REF")
    if not b or not os.access(b, os.X_OK):
        skip("no policy_ref binary (RNND_POLICY_REF=%r); build tests/unit first" % b)
    return b


def f32(shape, rng, scale=1.0):
    """A float32 draw as float64 (exact in both)."""
    return torch.from_numpy(rng.uniform(-scale, scale, shape).astype(np.float32).astype(np.float64))


class PolicyTest(unittest.TestCase):
    def make(self, case, seed):
        cell, I, H, L, enc, act, K, A, value, init = case
        torch.manual_seed(seed)
        pi = rnnd.torch.Policy(I, H, L, cell=cell, encoder_widths=enc, encoder_activation=act,
                               discrete_actions=K, gaussian_actions=A, value_head=value)
        with torch.no_grad():  # a non-zero log-std; every value float32-exact
            if A:
                pi.action_log_std.uniform_(-0.5, 0.5)
            for p in pi.parameters():
                p.copy_(p.float())
        return pi.double()

    def run_c(self, d, pi, case, inputs):
        cell, I, H, L, enc, act, K, A, value, init = case
        meta = {"cell": cell, "I": I, "H": H, "L": L, "encoder": ",".join(map(str, enc)),
                "activation": act, "K": K, "A": A, "value": int(value), "seed": 17}
        rnnd.save_safetensors(os.path.join(d, "weights.safetensors"), pi.weights())
        rnnd.save_safetensors(os.path.join(d, "inputs.safetensors"), inputs, meta)
        r = subprocess.run([ref_binary(), d], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        return {n: rnnd.load_safetensors(os.path.join(d, n + ".safetensors"))
                for n in ("outputs", "grads", "weights_out")}

    def check_case(self, k, case):
        cell, I, H, L, enc, act, K, A, value, init = case
        rng = np.random.default_rng(100 + k)
        pi = self.make(case, k)
        lstm = cell == "lstm"
        obs = f32((B, T, I), rng).requires_grad_()
        is_init = torch.from_numpy(rng.random((B, T)) < 0.3)
        is_init[0, 2] = True  # a reset inside a window, whatever the draw
        state, hidden, cellst = None, None, None
        if init == "h0":
            h0 = f32((B, L, H), rng).requires_grad_()
            c0 = f32((B, L, H), rng).requires_grad_() if lstm else None
            state = (h0, c0) if lstm else h0
        elif init == "stored":
            hidden = f32((B, T, L, H), rng).requires_grad_()
            cellst = f32((B, T, L, H), rng).requires_grad_() if lstm else None
        else:  # the implied zero state gets a gradient too (grad_h0)
            h0 = torch.zeros(B, L, H, dtype=torch.float64, requires_grad=True)
            c0 = torch.zeros(B, L, H, dtype=torch.float64, requires_grad=True) if lstm else None
            state = (h0, c0) if lstm else h0
        out = pi(obs, is_init, state, hidden, cellst)

        # The loss the C side differentiates: sum(head * g) over every head output.
        g = {}
        loss = (out.output * 0).sum()
        for name, t in (("logits", out.logits), ("mean", out.mean), ("log_std", out.log_std),
                        ("value", out.value)):
            if t is not None:
                g[name] = f32(t.shape, rng)
                loss = loss + (t * g[name]).sum()
        loss.backward()

        inputs = {"obs": obs.detach().float(), "is_init": is_init.numpy().astype(np.uint8),
                  "env_ids": np.arange(B, dtype=np.int64) * 7919 + 3}
        for n, t in g.items():
            inputs["grad_" + n] = t.float()
        if init == "h0":
            inputs["h0"] = h0.detach().float()
            if lstm:
                inputs["c0"] = c0.detach().float()
        if init == "stored":
            inputs["hidden"] = hidden.detach().float()
            if lstm:
                inputs["cell"] = cellst.detach().float()
        dist = None
        if K or A:
            dist = pi.distribution(out)
            with torch.no_grad():
                actions = dist.sample().float().double()  # float32-exact (indices too)
            inputs["index" if K else "action"] = actions.long() if K else actions.float()

        with tempfile.TemporaryDirectory() as d:
            c = self.run_c(d, pi, case, inputs)
            again = self.run_c(d, pi, case, inputs)
        o, gr, wo = c["outputs"], c["grads"], c["weights_out"]

        def close(name, got, want):
            e = rel_err(got, want.detach().numpy())
            self.assertLessEqual(e, TOL, "case %d: %s off by %.2e" % (k, name, e))
            return e

        worst = 0.0
        for name, t in (("logits", out.logits), ("mean", out.mean), ("log_std", out.log_std),
                        ("value", out.value), ("output", out.output)):
            if t is not None:
                worst = max(worst, close(name, o[name], t))
        h_n, c_n = out.state if lstm else (out.state, None)
        worst = max(worst, close("h_n", o["h_n"], h_n))
        if lstm:
            worst = max(worst, close("c_n", o["c_n"], c_n))
        if dist is not None:
            worst = max(worst, close("logp", o["logp"], dist.log_prob(actions)))
            worst = max(worst, close("entropy", o["entropy"], dist.entropy()))
            drawn = (torch.from_numpy(o["sample_index"]) if K
                     else torch.from_numpy(o["sample_action"]).double())
            worst = max(worst, close("sample_logp", o["sample_logp"], dist.log_prob(drawn)))
            key = "sample_index" if K else "sample_action"
            np.testing.assert_array_equal(o[key], again["outputs"][key])  # same keys, same draws

        # Every gradient: parameters by name, observations, the initial or stored states.
        for name, p in pi.named_parameters():
            worst = max(worst, close("grad " + name, gr[name], p.grad))
        worst = max(worst, close("grad_obs", o["grad_obs"], obs.grad))
        if init == "stored":
            worst = max(worst, close("grad_hidden", o["grad_hidden"], hidden.grad))
            if lstm:
                worst = max(worst, close("grad_cell", o["grad_cell"], cellst.grad))
        else:
            worst = max(worst, close("grad_h0", o["grad_h0"], h0.grad))
            if lstm:
                worst = max(worst, close("grad_c0", o["grad_c0"], c0.grad))

        # Names and order are the daemon's; the weights written back load unchanged.
        self.assertEqual(list(pi.state_dict()), wo.metadata["names"].split(","))
        back = rnnd.torch.Policy(I, H, L, cell=cell, encoder_widths=enc, encoder_activation=act,
                                 discrete_actions=K, gaussian_actions=A, value_head=value)
        back.load_weights(wo)
        for name, v in back.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), pi.state_dict()[name].float().numpy(), name)
        print("case %d (%s L=%d enc=%s %s K=%d A=%d value=%s init=%s): worst relative error "
              "%.1e" % (k, cell, L, enc, act, K, A, value, init, worst))

    def test_against_cpu_backend(self):
        for k, case in enumerate(CASES):
            with self.subTest(case=k):
                self.check_case(k, case)

    def test_weights_of_another_model_are_refused(self):
        case = CASES[0]
        pi = self.make(case, 0)
        del pi.value  # the C model has a value head: value.weight is missing from the file
        pi.value_head = False
        inputs = {"obs": np.zeros((1, 1, case[1]), np.float32),
                  "is_init": np.ones((1, 1), np.uint8),
                  "env_ids": np.zeros(1, np.int64), "index": np.zeros((1, 1), np.int64)}
        with tempfile.TemporaryDirectory() as d:
            meta = {"cell": "gru", "I": case[1], "H": case[2], "L": 1, "encoder": "8,5",
                    "activation": "elu", "K": 4, "A": 0, "value": 1, "seed": 0}
            rnnd.save_safetensors(os.path.join(d, "weights.safetensors"), pi.weights())
            rnnd.save_safetensors(os.path.join(d, "inputs.safetensors"), inputs, meta)
            r = subprocess.run([ref_binary(), d], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn('missing tensor "value.weight"', r.stderr)

    def test_core_is_torch_rnn(self):
        """Without encoder and heads, Policy is nn.GRU / nn.LSTM: same state_dict names and
        shapes, same outputs with no resets (states converted from [B, L, H] to [L, B, H])."""
        for cell in ("gru", "lstm"):
            torch.manual_seed(1)
            pi = rnnd.torch.Policy(4, 5, 2, cell=cell).double()
            ref = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(4, 5, 2, batch_first=True)
            ref = ref.double()
            self.assertEqual([(k, v.shape) for k, v in pi.state_dict().items()],
                             [(k, v.shape) for k, v in ref.state_dict().items()])
            ref.load_state_dict(pi.state_dict())
            x = torch.randn(3, 6, 4, dtype=torch.float64)
            h0 = torch.randn(3, 2, 5, dtype=torch.float64)
            if cell == "lstm":
                c0 = torch.randn(3, 2, 5, dtype=torch.float64)
                out = pi(x, None, (h0, c0))
                want, (hn, cn) = ref(x, (h0.transpose(0, 1).contiguous(),
                                         c0.transpose(0, 1).contiguous()))
                torch.testing.assert_close(out.state[1], cn.transpose(0, 1))
                torch.testing.assert_close(out.state[0], hn.transpose(0, 1))
            else:
                out = pi(x, None, h0)
                want, hn = ref(x, h0.transpose(0, 1).contiguous())
                torch.testing.assert_close(out.state, hn.transpose(0, 1))
            torch.testing.assert_close(out.output, want)
            self.assertIsNone(out.logits)
            self.assertIsNone(out.value)

    def test_bad_config(self):
        with self.assertRaises(ValueError):
            rnnd.torch.Policy(3, 4, discrete_actions=2, gaussian_actions=2)
        with self.assertRaises(ValueError):
            rnnd.torch.Policy(3, 4, discrete_actions=1)
        with self.assertRaises(ValueError):
            rnnd.torch.Policy(3, 4, encoder_activation="gelu")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
