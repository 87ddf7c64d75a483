"""The lean wire from Python: float tensors as bfloat16/float16 both ways (a 16-bit reply is the
float32 reply rounded), forward_recorded(fields=) and backward(input_grads=) leaving tensors out,
refusals of what the daemon cannot take, and RemoteRecurrent(wire="bfloat16") training like the
float32 module within bfloat16's precision."""

import unittest

import numpy as np

from _common import daemon, rel_err, skip

import rnnd  # noqa: E402

I, H, L, B, T = 4, 6, 1, 3, 5


def bf16(a):
    """float32 -> bfloat16 (round to nearest even) -> float32, as the daemon rounds."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4")
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype("<u4").view("<f4")


class WireTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = daemon(cell="gru", layers=L, input_size=I, hidden_size=H).start()
        cls.c = cls.d.client()

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()

    def test_dtypes(self):
        rng = np.random.default_rng(1)
        obs = bf16(rng.standard_normal((B, T, I)).astype(np.float32))  # bf16 holds these exactly
        r32 = self.c.forward(obs)
        r16 = self.c.forward(obs, dtype="bfloat16")  # the reply follows: bfloat16
        np.testing.assert_array_equal(r16.output, bf16(r32.output))
        rh = self.c.forward(obs, dtype="bfloat16", reply_dtype="float16")
        np.testing.assert_array_equal(rh.output, r32.output.astype(np.float16))
        with self.assertRaises(ValueError):
            self.c.forward(obs, reply_dtype="int8")

    def test_fields_and_input_grads(self):
        ids = [700, 701]
        for t in range(T):
            self.c.step(ids, np.full((2, I), 0.1 * t, np.float32), is_init=(t == 0))
        full = self.c.forward_recorded(ids, T, keep_tape=True)
        self.assertIsNotNone(full.obs)
        some = self.c.forward_recorded(ids, T, fields=("is_init",))
        self.assertIsNone(some.obs)
        self.assertIsNone(some.step_model_version)
        np.testing.assert_array_equal(some.is_init, full.is_init)
        np.testing.assert_array_equal(some.output, full.output)
        g = self.c.backward(full.tape_id, np.ones_like(full.output), input_grads=())
        self.assertIsNone(g.grad_obs)
        self.assertIsNone(g.grad_h0)
        self.assertTrue(g.grads)
        # The daemon records no extras: asking for them is refused.
        with self.assertRaises(rnnd.RnndError) as e:
            self.c.forward_recorded(ids, T, fields=("extras",))
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        self.c.end_episodes(ids)

    def test_remote_recurrent_bf16(self):
        try:
            import torch
        except ImportError:
            skip("PyTorch is not installed (Debian: python3-torch)")
        import rnnd.torch
        torch.manual_seed(0)
        obs = torch.randn(B, T, I)
        grads = {}
        for wire in ("float32", "bfloat16"):
            core = rnnd.torch.RemoteRecurrent(self.d.client(), wire=wire)
            x = obs.clone().requires_grad_(True)
            out, _ = core(x)
            out.pow(2).sum().backward()
            grads[wire] = (core.weight_hh_l0.grad.clone(), x.grad.clone())
        for a, b in zip(grads["float32"], grads["bfloat16"]):
            self.assertLess(rel_err(b.numpy(), a.numpy()), 3e-2)


if __name__ == "__main__":
    unittest.main()
