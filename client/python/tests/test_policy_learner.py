"""The learner of a policy on the daemon (CPU backend, real gRPC): Forward returns the heads'
outputs at every step, Backward takes their gradients and back-propagates through heads, core
and encoder, and ApplyGradients updates every tensor.

Checked against rnnd.torch.Policy in float64 with the daemon's weights: logits / mean, log-std
and values of explicit and recorded windows with resets inside them, and the gradient of every
parameter (and of the observations and the initial state) for head and core-output gradients
sent together, within 1e-4 relative. Then a few accumulated Backwards and ApplyGradients lower
a loss; bad head gradients are refused with INVALID_ARGUMENT and leave the tape usable.
"""

import unittest

import numpy as np

from _common import daemon, rel_err, skip

try:
    import torch
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")
import rnnd  # noqa: E402
import rnnd.torch  # noqa: E402

I, H, B, T = 5, 6, 3, 5
# Discrete: LSTM of two layers under a two-layer tanh encoder; Gaussian: a GRU under one elu layer.
DISCRETE = dict(input_size=I, hidden_size=H, layers=2, cell="lstm", encoder_widths="7,8",
                encoder_activation="tanh", discrete_actions=4, value_head=1, seed=3,
                trajectory_steps=T)
GAUSSIAN = dict(input_size=I, hidden_size=H, layers=1, cell="gru", encoder_widths="8",
                encoder_activation="elu", gaussian_actions=2, value_head=1, seed=4,
                trajectory_steps=T)


def reference(flags, weights):
    """rnnd.torch.Policy in float64 holding the daemon's weights."""
    widths = tuple(int(w) for w in flags["encoder_widths"].split(","))
    pi = rnnd.torch.Policy(I, H, num_layers=flags["layers"], cell=flags["cell"],
                           encoder_widths=widths,
                           encoder_activation=flags["encoder_activation"],
                           discrete_actions=flags.get("discrete_actions", 0),
                           gaussian_actions=flags.get("gaussian_actions", 0),
                           value_head=bool(flags["value_head"]))
    pi.load_weights({k: v for k, v in weights.items()})
    return pi.double()


def resets(rng):
    is_init = rng.uniform(size=(B, T)) < 0.3
    is_init[:, 0] = True
    is_init[0, 2] = True  # at least one inside the window
    return is_init


def t64(a):
    return torch.from_numpy(np.asarray(a, np.float64))


class Learner(unittest.TestCase):
    def check_grads(self, got, pi, extra=()):
        names = [k for k, _ in pi.named_parameters()]
        self.assertEqual(sorted(got.grads), sorted(names))
        for k, p in pi.named_parameters():
            self.assertLess(rel_err(got.grads[k], p.grad.numpy()), 1e-4, k)
        for name, want in extra:
            self.assertLess(rel_err(getattr(got, name), want), 1e-4, name)

    def test_explicit_discrete_from_a_state(self):
        rng = np.random.default_rng(1)
        obs = rng.uniform(-1, 1, (B, T, I)).astype(np.float32)
        is_init = resets(rng)
        is_init[:, 0] = False  # the window starts from h0, c0
        h0 = rng.uniform(-1, 1, (B, 2, H)).astype(np.float32)
        c0 = rng.uniform(-1, 1, (B, 2, H)).astype(np.float32)
        g_logits = rng.normal(size=(B, T, 4)).astype(np.float32)
        g_value = rng.normal(size=(B, T)).astype(np.float32)
        g_out = rng.normal(size=(B, T, H)).astype(np.float32)
        with daemon(**DISCRETE) as d:
            c = d.client()
            w = c.get_weights()
            pi = reference(DISCRETE, w)
            # The shared-memory reply is sized for every gradient the policy has.
            self.assertEqual(rnnd.shm.param_tensors(c.info()),
                             (sum(v.size for v in w.values()), len(w)))
            f = c.forward(obs, is_init, h0=h0, c0=c0, keep_tape=True)
            self.assertIsNone(f.output)
            self.assertEqual(f.logits.shape, (B, T, 4))
            self.assertEqual(f.head_value.shape, (B, T))
            g = c.backward(f.tape_id, g_out, grad_logits=g_logits, grad_head_value=g_value)
        x, s0 = t64(obs).requires_grad_(), (t64(h0).requires_grad_(), t64(c0).requires_grad_())
        ref = pi(x, torch.from_numpy(is_init), state=s0)
        self.assertLess(rel_err(f.logits, ref.logits.detach().numpy()), 1e-4)
        self.assertLess(rel_err(f.head_value, ref.value.detach().numpy()), 1e-4)
        self.assertLess(rel_err(f.h_n, ref.state[0].detach().numpy()), 1e-4)
        loss = ((ref.logits * t64(g_logits)).sum() + (ref.value * t64(g_value)).sum() +
                (ref.output * t64(g_out)).sum())
        loss.backward()
        self.check_grads(g, pi, (("grad_obs", x.grad.numpy()), ("grad_h0", s0[0].grad.numpy()),
                                 ("grad_c0", s0[1].grad.numpy())))

    def test_recorded_gaussian(self):
        rng = np.random.default_rng(2)
        ids = np.arange(B)
        obs = rng.uniform(-1, 1, (B, T, I)).astype(np.float32)
        is_init = resets(rng)
        g_mean = rng.normal(size=(B, T, 2)).astype(np.float32)
        g_log_std = rng.normal(size=2).astype(np.float32)
        g_value = rng.normal(size=(B, T)).astype(np.float32)
        with daemon(**GAUSSIAN) as d:
            c = d.client(transport="grpc")  # the other test goes through shared memory
            pi = reference(GAUSSIAN, c.get_weights())
            for t in range(T):
                c.step_result(ids, obs[:, t], is_init[:, t])
            f = c.forward_recorded(ids, T, keep_tape=True, fields=("obs", "is_init"))
            np.testing.assert_array_equal(f.is_init, is_init)
            g = c.backward(f.tape_id, grad_mean=g_mean, grad_log_std=g_log_std,
                           grad_head_value=g_value, input_grads=())
            # decode= makes the heads' tensors too.
            shapes = c.forward_recorded(ids, T, decode=lambda t: tuple(t.shape))
            self.assertEqual((shapes.mean, shapes.log_std, shapes.head_value),
                             ((B, T, 2), (2,), (B, T)))
        ref = pi(t64(obs), torch.from_numpy(is_init))
        self.assertIsNone(f.output)
        self.assertIsNone(f.logits)
        self.assertLess(rel_err(f.mean, ref.mean.detach().numpy()), 1e-4)
        self.assertLess(rel_err(f.log_std, ref.log_std[0, 0].detach().numpy()), 1e-4)
        self.assertLess(rel_err(f.head_value, ref.value.detach().numpy()), 1e-4)
        loss = ((ref.mean * t64(g_mean)).sum() + (ref.log_std[0, 0] * t64(g_log_std)).sum() +
                (ref.value * t64(g_value)).sum())
        loss.backward()
        self.check_grads(g, pi)
        self.assertIsNone(g.grad_obs)

    def test_encoder_without_heads(self):
        # No heads: the core's output is the reply, and its gradient flows into the encoder.
        flags = dict(input_size=I, hidden_size=H, layers=1, cell="gru", encoder_widths="4",
                     encoder_activation="relu", value_head=0, seed=5)
        rng = np.random.default_rng(5)
        obs = rng.uniform(-1, 1, (B, T, I)).astype(np.float32)
        is_init = resets(rng)
        g_out = rng.normal(size=(B, T, H)).astype(np.float32)
        with daemon(**flags) as d:
            c = d.client()
            pi = reference(flags, c.get_weights())
            f = c.forward(obs, is_init, keep_tape=True)
            self.assertIsNone(f.logits)
            g = c.backward(f.tape_id, g_out)
        x = t64(obs).requires_grad_()
        ref = pi(x, torch.from_numpy(is_init))
        self.assertLess(rel_err(f.output, ref.output.detach().numpy()), 1e-4)
        (ref.output * t64(g_out)).sum().backward()
        self.check_grads(g, pi, (("grad_obs", x.grad.numpy()),))

    def test_accumulate_and_apply_lower_the_loss(self):
        # Cross-entropy towards fixed actions plus a value regression, over two accumulated
        # Backwards per update: every tensor moves and the loss goes down.
        rng = np.random.default_rng(3)
        obs = rng.uniform(-1, 1, (B, T, I)).astype(np.float32)
        is_init = resets(rng)
        target = rng.integers(0, 4, (B, T))
        ret = rng.uniform(-1, 1, (B, T)).astype(np.float32)

        def loss_and_grads(f, rows=slice(None)):
            # The mean over all B * T steps of whichever rows f holds.
            lg = f.logits.astype(np.float64)
            p = np.exp(lg - lg.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            onehot, dv, n = np.eye(4)[target[rows]], f.head_value - ret[rows], B * T
            loss = (-np.log((p * onehot).sum(-1)).sum() + (dv ** 2).sum()) / n
            return loss, ((p - onehot) / n).astype(np.float32), (2 * dv / n).astype(np.float32)

        with daemon(lr=0.02, **DISCRETE) as d:
            c = d.client()
            before = c.get_weights()
            losses = []
            for it in range(4):
                for half in (slice(0, 2), slice(2, B)):
                    f = c.forward(obs[half], is_init[half], keep_tape=True)
                    _, gl, gv = loss_and_grads(f, half)
                    c.backward(f.tape_id, accumulate=True, grad_logits=gl, grad_head_value=gv)
                losses.append(loss_and_grads(c.forward(obs, is_init))[0])
                c.apply_gradients()
            losses.append(loss_and_grads(c.forward(obs, is_init))[0])
            after = c.get_weights()
        self.assertLess(losses[-1], losses[0])
        for k in before:
            self.assertFalse(np.array_equal(before[k], after[k]), k)

    def test_bad_head_gradients_are_refused(self):
        rng = np.random.default_rng(4)
        obs = rng.uniform(-1, 1, (B, T, I)).astype(np.float32)
        with daemon(**DISCRETE) as d:
            c = d.client()
            f = c.forward(obs, keep_tape=True)
            for kw, needle in (
                    (dict(grad_mean=np.ones((B, T, 2), np.float32)),
                     "grad_mean: this model has no such head (--gaussian-actions"),
                    (dict(grad_logits=np.ones((B, T, 3), np.float32)),
                     "grad_logits: shape [3, 5, 3] does not match [B, T, K]"),
                    (dict(grad_logits=np.ones((B, T, 4), np.float32),
                          grad_head_value=np.ones((B, T + 1), np.float32)),
                     "grad_head_value: shape [3, 6] does not match [B, T]"),
                    (dict(grad_logits=np.ones((B + 1, T, 4), np.float32)),
                     "grad_logits: [B, T] = [4, 5] does not match tape"),
                    ({}, "no gradient of the Forward's outputs")):
                with self.assertRaises(rnnd.RnndError) as e:
                    c.backward(f.tape_id, **kw)
                self.assertIn("INVALID_ARGUMENT", str(e.exception), kw)
                self.assertIn(needle, str(e.exception), kw)
            # Nothing changed: the tape still serves its Backward.
            g = c.backward(f.tape_id, grad_logits=np.ones((B, T, 4), np.float32))
            self.assertIn("policy_logits.weight", g.grads)
        with daemon(input_size=I, hidden_size=H) as d:
            c = d.client()
            f = c.forward(obs, keep_tape=True)
            self.assertEqual(f.output.shape, (B, T, H))
            with self.assertRaises(rnnd.RnndError) as e:
                c.backward(f.tape_id, np.ones((B, T, H), np.float32),
                           grad_logits=np.ones((B, T, 4), np.float32))
            self.assertIn("INVALID_ARGUMENT", str(e.exception))
            self.assertIn("grad_logits: this model has no such head", str(e.exception))
            c.backward(f.tape_id, np.ones((B, T, H), np.float32))


if __name__ == "__main__":
    unittest.main()
