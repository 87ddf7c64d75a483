"""rnnd.torch.RemoteRecurrent against a real daemon: state_dict round trip with nn.GRU/nn.LSTM,
forward/backward through autograd equal to nn.GRU/nn.LSTM (Parameters' .grad, input and state
gradients), inside a loss with a local head; apply_gradients in both gradient modes; the ops of
rnnd.torch.ops called directly (custom ops on torch >= 2.4, the eager autograd.Function path on
older torch such as Debian's 1.13: whichever this torch has). torch.compile and torch.export are
checked on a GPU host by gpu_torch_compile_check.py."""

import sys
import unittest

import numpy as np

from _common import BACKEND, daemon, rel_err, skip

try:
    import torch
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")
import rnnd.torch  # noqa: E402

I, H, L = 4, 6, 2
TOL = 1e-4


class RemoteRecurrentTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = {c: daemon(cell=c, layers=L, input_size=I, hidden_size=H, extras_size=1).start()
                 for c in ("gru", "lstm")}

    @classmethod
    def tearDownClass(cls):
        for d in cls.d.values():
            d.stop()

    def ref(self, cell, seed=0):
        torch.manual_seed(seed)
        return (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(I, H, L, batch_first=True)

    def check_state_dict(self, cell):
        core = rnnd.torch.RemoteRecurrent(self.d[cell].client())
        self.assertIn(cell, repr(core))
        ref = self.ref(cell, 3)
        self.assertEqual(list(core.state_dict().keys()), list(ref.state_dict().keys()))
        core.load_state_dict(ref.state_dict())  # pushes to the daemon
        w = core.client.get_weights()
        for k, v in ref.state_dict().items():
            np.testing.assert_array_equal(w[k], v.numpy(), err_msg=k)
        back = self.ref(cell, 99)
        back.load_state_dict(core.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
        # nested in a parent module, keys get the prefix and loading still pushes
        parent = torch.nn.Module()
        parent.core = core
        sd = parent.state_dict()
        self.assertIn("core.weight_hh_l1", sd)
        sd = {k: v * 0.5 for k, v in sd.items()}
        parent.load_state_dict(sd)
        np.testing.assert_allclose(core.client.get_weights()["weight_hh_l1"],
                                   sd["core.weight_hh_l1"].numpy(), rtol=0, atol=0)
        return core

    def check_autograd(self, cell):
        core = rnnd.torch.RemoteRecurrent(self.d[cell].client())
        ref = self.ref(cell, 5)
        core.load_state_dict(ref.state_dict())
        head = torch.nn.Linear(H, 3)
        B, T = 3, 5
        torch.manual_seed(1)
        x = torch.randn(B, T, I)
        h0 = torch.randn(B, L, H) * 0.5
        c0 = torch.randn(B, L, H) * 0.5
        target = torch.randn(B, T, 3)

        def run(mod, remote):
            xx = x.clone().requires_grad_()
            hh = h0.clone().requires_grad_()
            cc = c0.clone().requires_grad_()
            if remote:
                hx = (hh, cc) if cell == "lstm" else hh
                out, st = mod(xx, None, hx)
            else:
                hx = (hh.transpose(0, 1), cc.transpose(0, 1)) if cell == "lstm" else hh.transpose(0, 1)
                out, st = mod(xx, hx)
            hn = st[0] if cell == "lstm" else st
            if not remote:
                hn = hn.transpose(0, 1)
            loss = ((head(out) - target) ** 2).mean() + (hn ** 2).sum() * 0.1
            head.zero_grad()
            loss.backward()
            return out.detach(), hn.detach(), xx.grad, hh.grad, cc.grad, head.weight.grad.clone()

        got = run(core, True)
        want = run(ref, False)
        for name, a, b in zip(("output", "h_n", "grad obs", "grad h0", "grad c0", "grad head"),
                              got, want):
            if b is None:
                self.assertIsNone(a, name)
                continue
            self.assertLessEqual(rel_err(a.numpy(), b.numpy()), TOL, "%s %s" % (cell, name))
        for n, p in ref.named_parameters():
            g = getattr(core, n).grad
            self.assertIsNotNone(g, n)
            self.assertLessEqual(rel_err(g.numpy(), p.grad.numpy()), TOL, "%s grad %s" % (cell, n))
        # resets with stored states go through the same Function
        init = torch.zeros(B, T, dtype=torch.bool)
        init[:, 2] = True
        hidden = torch.randn(B, T, L, H, requires_grad=True)
        cellst = torch.randn(B, T, L, H, requires_grad=True) if cell == "lstm" else None
        out, _ = core(x, init, hidden=hidden, cell=cellst)
        out.sum().backward()
        self.assertEqual(tuple(hidden.grad.shape), (B, T, L, H))
        self.assertTrue(torch.all(hidden.grad[:, 1] == 0))
        self.assertTrue(torch.any(hidden.grad[:, 2] != 0))

        # local mode: apply_gradients sends .grad, bumps the version, pulls the new weights
        before = core.weight_ih_l0.detach().clone()
        v = core.model_version
        core.apply_gradients(lr=1e-2)
        self.assertGreater(core.model_version, v)
        self.assertIsNone(core.weight_ih_l0.grad)
        self.assertFalse(torch.equal(before, core.weight_ih_l0.detach()))
        # no tape without grad
        with torch.no_grad():
            out, _ = core(x)
        self.assertEqual(tuple(out.shape), (B, T, H))

    def test_gru_state_dict(self):
        self.check_state_dict("gru")

    def test_lstm_state_dict(self):
        self.check_state_dict("lstm")

    def test_gru_autograd(self):
        self.check_autograd("gru")

    def test_lstm_autograd(self):
        self.check_autograd("lstm")

    def test_server_mode_recorded(self):
        c = self.d["gru"].client()
        core = rnnd.torch.RemoteRecurrent(c, grads="server")
        ids = [501, 502]
        rng = np.random.default_rng(0)
        for t in range(6):
            c.step(ids, rng.standard_normal((2, I)).astype(np.float32), t == 0,
                   extras=np.full((2, 1), t, np.float32))
        out, rec = core.forward_recorded(ids, 4)
        self.assertEqual(tuple(out.shape), (2, 4, H))
        np.testing.assert_array_equal(rec.extras[:, :, 0], [[2, 3, 4, 5]] * 2)
        self.assertIsInstance(rec.obs, torch.Tensor)
        self.assertEqual(tuple(rec.obs.shape), (2, 4, I))
        self.assertEqual(rec.is_init.dtype, torch.bool)
        self.assertEqual(int(rec.model_version), core.model_version)
        self.assertEqual(rec.step_model_version.tolist(), [[core.model_version] * 4] * 2)
        (out ** 2).sum().backward()
        # the weights' gradient stays in the daemon's buffer: zeros here
        self.assertEqual(float(core.weight_hh_l0.grad.abs().sum()), 0.0)
        v = core.model_version
        core.apply_gradients(lr=1e-2)
        self.assertEqual(core.model_version, v + 1)
        self.assertIsNone(core.weight_hh_l0.grad)
        out2, _ = core.forward_recorded(ids, 4)
        self.assertLess(float((out2 ** 2).sum()), float((out ** 2).sum()))
        # Only what the learner asks for comes back; the rest is neither sent nor returned.
        out3, rec3 = core.forward_recorded(ids, 4, fields=("is_init",))
        torch.testing.assert_close(out3, out2, rtol=0, atol=0)
        self.assertEqual(rec3.is_init.tolist(), rec.is_init.tolist())
        self.assertIsNone(rec3.obs)
        self.assertIsNone(rec3.extras)
        self.assertIsNone(rec3.step_model_version)
        (out3 ** 2).sum().backward()
        core.apply_gradients(lr=1e-2)
        self.assertEqual(core.model_version, v + 2)
        with self.assertRaises(ValueError):
            core.forward_recorded(ids, 4, fields=("actions",))

    def test_apply_in_backward(self):
        # grads="apply": loss.backward() takes the daemon's optimizer step too; the weights match
        # grads="server" followed by apply_gradients() bit for bit (twin daemons, one seed).
        x = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 5, I)).astype(np.float32))
        weights = []
        for grads in ("server", "apply"):
            with daemon(cell="gru", input_size=I, hidden_size=H, seed=11).start() as d:
                core = rnnd.torch.RemoteRecurrent(d.client(), grads=grads)
                v = core.model_version
                out, _ = core(x)
                (out ** 2).sum().backward()
                self.assertEqual(core.model_version, v + (grads == "apply"))
                self.assertEqual(core.apply_gradients(), v + 1)
                self.assertEqual(core.model_version, v + 1)
                weights.append({k: t.clone() for k, t in core.state_dict().items()})
        for k in weights[0]:
            torch.testing.assert_close(weights[1][k], weights[0][k], rtol=0, atol=0)

    def test_cursor_windows(self):
        # Each env's next window, once: consecutive windows share the bootstrap step, and the
        # counts the learner needs come back as tensors; steps of too old weights are skipped.
        with daemon(cell="gru", input_size=I, hidden_size=H, trajectory_steps=16,
                    max_policy_lag=1).start() as d:
            c = d.client()
            core = rnnd.torch.RemoteRecurrent(c, grads="server")
            ids = [21, 22]
            outs = []

            def step(t0, n):
                for t in range(t0, t0 + n):
                    x = np.zeros((2, I), np.float32)
                    x[:, 0] = t
                    outs.append(c.step(ids, x, t == 0))
            step(0, 5)
            _, last = core.forward_recorded(ids, 3)
            self.assertIsNone(last.cursor_first)  # the last steps: no cursor, none moved
            for first in (0, 2):
                out, rec = core.forward_recorded(ids, 3, cursor=True)
                self.assertEqual(rec.cursor_first.dtype, torch.int64)
                self.assertEqual(rec.cursor_first.tolist(), [first] * 2)
                self.assertEqual(rec.cursor_lagged.tolist(), [0, 0])
                self.assertEqual(rec.cursor_overwritten.tolist(), [0, 0])
                self.assertEqual(rec.obs[:, :, 0].tolist(), [list(range(first, first + 3))] * 2)
                if first == 0:  # the weights that stepped: replayed, what Step returned
                    for t in range(3):
                        np.testing.assert_allclose(out[:, t].detach().numpy(), outs[t],
                                                   rtol=1e-5, atol=1e-6)
                (out ** 2).sum().backward()
                core.apply_gradients()
            self.assertEqual(core.model_version, 2)
            # Step 4 (version 0) is more than one version behind: skipped and counted.
            step(5, 3)
            _, rec = core.forward_recorded(ids, 3, fields=("obs",), cursor=True)
            self.assertEqual(rec.cursor_first.tolist(), [5, 5])
            self.assertEqual(rec.cursor_lagged.tolist(), [1, 1])
            self.assertEqual(rec.obs[:, :, 0].tolist(), [[5, 6, 7]] * 2)
            self.assertIsNone(rec.is_init)
            # The ops: forward_recorded keeps its 8 outputs; forward_cursor adds cursor [3, B].
            step(8, 2)
            args = (d.target, torch.tensor(ids), 3, core._params(), I, H, 0, False, False)
            self.assertEqual(len(rnnd.torch.ops.forward_recorded(*args)), 8)
            *_, obs, _, _, _, cur = rnnd.torch.ops.forward_cursor(*args)
            self.assertEqual(cur.tolist(), [[7, 7], [0, 0], [0, 0]])
            self.assertEqual(obs[:, :, 0].tolist(), [[7, 8, 9]] * 2)

    def test_two_engines(self):
        # On several devices a tape id has bit 63 set: it must travel through the op's int64
        # tensor bit for bit.
        if BACKEND == "cuda" and torch.cuda.device_count() < 2:
            self.skipTest("--devices 0,1 on the CUDA backend needs two GPUs")
        with daemon(cell="gru", input_size=I, hidden_size=H, devices="0,1").start() as d:
            core = rnnd.torch.RemoteRecurrent(d.client(), grads="server")
            ids = [11, 12, 13, 14]
            rng = np.random.default_rng(5)
            for t in range(3):
                core.client.step(ids, rng.standard_normal((4, I)).astype(np.float32), t == 0)
            out, rec = core.forward_recorded(ids, 3, fields=())
            self.assertLess(int(rec.tape_id), 0)  # bit 63, as int64
            v = core.model_version
            (out ** 2).sum().backward()
            core.apply_gradients()
            self.assertEqual(core.model_version, v + 1)

    def test_ops(self):
        ops = rnnd.torch.ops
        self.assertEqual(rnnd.torch.CUSTOM_OPS, hasattr(torch.library, "custom_op"))
        if rnnd.torch.CUSTOM_OPS:
            self.assertIs(ops.step._opoverload, torch.ops.rnnd.step.default)
        d = self.d["lstm"]
        target = d.target
        c = d.client()
        # An op reaches a target nobody registered through a client of its own (an exported
        # program loaded in another process does that).
        rnnd.torch._targets.pop(target, None)
        rng = np.random.default_rng(3)
        x = rng.standard_normal((3, I)).astype(np.float32)
        ids = torch.tensor([7001, 7002, 7003])
        obs = torch.from_numpy(x).requires_grad_()
        out = ops.step(target, ids, obs, torch.ones(3, dtype=torch.bool), None, H)
        self.assertFalse(out.requires_grad, "Step keeps no tape: its output is a constant")
        want = c.step([8001, 8002, 8003], x, True)
        np.testing.assert_array_equal(out.numpy(), want)
        self.assertIn(target, rnnd.torch._targets)
        # ids past 2**63 travel as int64 with the same bits
        big = torch.tensor([-1], dtype=torch.int64)  # uint64 2**64 - 1
        ops.step(target, big, obs[:1].detach(), torch.ones(1, dtype=torch.bool), None, H)
        self.assertEqual(c.end_episodes([2 ** 64 - 1]), 1)
        # a caller whose sizes do not match the daemon's is told so
        with self.assertRaisesRegex(RuntimeError, "has hidden_size %d, the caller expects %d"
                                    % (H, H + 1)):
            ops.step(target, ids, obs, None, None, H + 1)
        # forward returns (output, h_n, c_n, tape); its formula sends grad_output to Backward
        core = rnnd.torch.RemoteRecurrent(c)
        xs = torch.randn(2, 3, I, requires_grad=True)
        init = torch.zeros(2, 3, dtype=torch.bool)
        out, h_n, c_n, tape = ops.forward(target, xs, init, None, None, None, None,
                                          core._params(), H, True, False)
        self.assertEqual(tape.dtype, torch.int64)
        self.assertGreater(int(tape[0]), 0)
        self.assertEqual(int(tape[1]), core.model_version)
        out.sum().backward()
        self.assertEqual(tuple(xs.grad.shape), (2, 3, I))
        self.assertEqual(tuple(core.weight_ih_l0.grad.shape), (4 * H, I))
        # only h_n used: zeros go for grad_output
        xs.grad = None
        _, h_n, _, _ = ops.forward(target, xs, init, None, None, None, None, core._params(), H,
                                   True, False)
        h_n.sum().backward()
        self.assertTrue(torch.all(xs.grad[:, -1] != 0))
        # a closed client is passed over: the newest open one registered for the target serves
        other = d.client()
        rnnd.torch.register_client(other)
        other.close()
        out2, _, _, _ = ops.forward(target, xs, init, None, None, None, None, core._params(), H,
                                    False, False)
        torch.testing.assert_close(out2, out.detach(), rtol=0, atol=0)
        # the module's model_version follows the daemon's, also through forward
        v = c.apply_gradients({n: np.zeros_like(w) for n, w in c.get_weights().items()})
        self.assertEqual(core.model_version, v - 1)
        with torch.no_grad():
            core(xs)
        self.assertEqual(core.model_version, v)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(not unittest.main(exit=False, verbosity=2).result.wasSuccessful())
