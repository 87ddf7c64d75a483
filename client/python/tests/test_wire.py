"""The lean wire from Python: float tensors as bfloat16/float16 both ways (a 16-bit reply is the
float32 reply rounded), forward_recorded(fields=) and backward(input_grads=) leaving tensors out,
refusals of what the daemon cannot take, replies read in place (Lazy: arrays view the reply's
bytes; it reads like protobuf's parse and refuses truncated replies), rnnd.torch's decoder, and
RemoteRecurrent(wire="bfloat16") training like the float32 module within bfloat16's
precision."""

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

    def test_replies_read_in_place(self):
        from rnnd._tensor import Lazy, decode, encode
        from rnnd.v1 import rnnd_pb2 as pb
        rng = np.random.default_rng(2)
        c = self.d.client(transport="grpc")  # on this host fp32 would go through shared memory
        r = c.forward(rng.standard_normal((B, T, I)).astype(np.float32), keep_tape=True)
        # The output views the whole reply as gRPC handed it over, not a copy of its own bytes.
        base = r.output
        while isinstance(base, np.ndarray):
            base = base.base
        self.assertIsInstance(base, memoryview)
        self.assertGreater(len(base.obj), r.output.nbytes)
        g = c.backward(r.tape_id, np.ones_like(r.output))
        self.assertEqual(g.grad_obs.shape, (B, T, I))
        c.close()

        msg = pb.ForwardReply(tape_id=7, model_version=3)
        out = rng.standard_normal((2, 3, 4)).astype(np.float32)
        encode(out, out=msg.output)
        encode(np.array([[True, False, True]]), out=msg.is_init)
        encode(np.arange(3, dtype=np.int64).reshape(1, 3), out=msg.step_model_version)
        data = msg.SerializeToString()
        lazy = Lazy(pb.ForwardReply, data)
        self.assertEqual((lazy.tape_id, lazy.model_version), (7, 3))
        np.testing.assert_array_equal(decode(lazy.output), out)
        np.testing.assert_array_equal(decode(lazy.is_init), [[True, False, True]])
        np.testing.assert_array_equal(decode(lazy.step_model_version), [[0, 1, 2]])
        self.assertTrue(lazy.HasField("is_init"))
        self.assertFalse(lazy.HasField("c_n"))
        self.assertIsNone(decode(lazy.c_n))
        for cut in (1, len(data) // 2, len(data) - 1):
            with self.assertRaises(ValueError):
                Lazy(pb.ForwardReply, data[:cut])

    def test_torch_decoder(self):
        try:
            import torch
        except ImportError:
            skip("PyTorch is not installed (Debian: python3-torch)")
        import rnnd.torch
        from rnnd._tensor import View, encode
        from rnnd.v1 import rnnd_pb2 as pb
        dec = rnnd.torch._decoder(torch.device("cpu"))
        a = np.random.default_rng(3).standard_normal((2, 5)).astype(np.float32)

        def view(array, dtype=None):
            return View(memoryview(encode(array, dtype).SerializeToString()))
        np.testing.assert_array_equal(dec(view(a, pb.BFLOAT16)).numpy(), bf16(a))
        np.testing.assert_array_equal(dec(view(a, pb.FLOAT16)).numpy(), a.astype(np.float16))
        x = dec(view(a))
        np.testing.assert_array_equal(x.numpy(), a)
        x += 1  # a copy of its own, writable
        b = dec(view(np.array([True, False])))
        self.assertEqual(b.dtype, torch.bool)
        self.assertEqual(dec(view(np.arange(4).reshape(2, 2))).dtype, torch.int64)
        t = encode(a)
        t.shape[:] = [3, 5]
        with self.assertRaises(ValueError):
            dec(t)

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
