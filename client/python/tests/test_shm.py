"""rnnd.Client's same-host paths against a real daemon (CPU backend): a unix: socket target, the
transport it picks by itself (shared memory on this host, gRPC otherwise or when told), results
through shared memory equal to the bytes path bit for bit (step, stepper, forward over explicit
and recorded trajectories, backward), tensors larger than the message limit that only shared
memory can carry, and a daemon with shared memory off."""

import os
import sys
import tempfile
import unittest

import grpc
import numpy as np

import rnnd
from rnnd._tensor import _NP
from _common import BACKEND, daemon

I, H, L, E = 6, 32, 2, 3


class ShmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="rnnd-sock-")
        cls.sock = "unix:" + os.path.join(cls.tmp.name, "rnnd.sock")
        cls.d = daemon(cell="lstm", layers=L, input_size=I, hidden_size=H, extras_size=E,
                       trajectory_steps=16, seed=3, listen=cls.sock).start()
        # One client each way: shared memory over the socket, bytes over TCP.
        cls.s = rnnd.Client(cls.sock)
        cls.b = cls.d.client(transport="grpc")
        cls.rng = np.random.default_rng(1)

    @classmethod
    def tearDownClass(cls):
        cls.s.close()
        cls.b.close()
        cls.d.stop()
        cls.tmp.cleanup()

    def x(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def assertBits(self, a, b, what):
        self.assertIsNotNone(a, what)
        self.assertEqual(a.dtype, b.dtype, what)
        self.assertEqual(a.shape, b.shape, what)
        self.assertTrue(np.array_equal(a.view(np.uint8), b.view(np.uint8)), what + " differs")

    def test_transport_choice(self):
        self.assertEqual(self.d.addresses, [self.d.target, self.sock])
        self.assertEqual(self.s.transport, "shm")
        self.assertEqual(self.b.transport, "grpc")
        with self.d.client() as loop:  # loopback is this host too
            self.assertEqual(loop.transport, "shm")
        with rnnd.Client("192.0.2.1:1") as far:  # another host: not even tried
            self.assertEqual(far.transport, "grpc")
        with self.assertRaises(ValueError):
            rnnd.Client(self.sock, transport="carrier-pigeon")

    def test_step_and_stepper(self):
        ids_s = np.arange(100, 108, dtype=np.uint64)
        ids_b = ids_s + 1000
        for t in range(3):
            obs, ex = self.x(8, I), self.x(8, E)
            init = np.arange(8) == t if t else True
            rs = self.s.step_result(ids_s, obs, init, extras=ex, return_state=True)
            rb = self.b.step_result(ids_b, obs, init, extras=ex, return_state=True)
            for name in ("output", "h", "c"):
                self.assertBits(getattr(rs, name), getattr(rb, name), "step " + name)
            self.assertEqual(rs.model_version, rb.model_version)
        # Two requests in flight on each stream, one stream after the other.
        obs = [self.x(8, I), self.x(8, I)]
        out = []
        for client, ids in ((self.s, ids_s), (self.b, ids_b)):
            with client.stepper() as st:
                for o in obs:
                    st.send(ids, o)
                out.append([st.recv().output for _ in obs])
        for k in range(2):
            self.assertBits(out[0][k], out[1][k], "stepper output")
        # Recorded trajectories, with their obs, is_init, extras and versions.
        fs = self.s.forward_recorded(ids_s, 4)
        fb = self.b.forward_recorded(ids_b, 4)
        for name in fs._fields:
            if name in ("tape_id",):
                continue
            a, b = getattr(fs, name), getattr(fb, name)
            if isinstance(a, np.ndarray):
                self.assertBits(a, b, "recorded " + name)
            else:
                self.assertEqual(a, b, name)

    def test_forward_backward(self):
        B, T = 5, 7
        obs, h0, c0 = self.x(B, T, I), self.x(B, L, H), self.x(B, L, H)
        init = self.rng.random((B, T)) < 0.2
        go, gh, gc = self.x(B, T, H), self.x(B, L, H), self.x(B, L, H)
        res = []
        for c in (self.s, self.b):
            f = c.forward(obs, init, h0=h0, c0=c0, keep_tape=True)
            g = c.backward(f.tape_id, go, grad_h_n=gh, grad_c_n=gc)
            res.append((f, g))
        (fs, gs), (fb, gb) = res
        for name in ("output", "h_n", "c_n"):
            self.assertBits(getattr(fs, name), getattr(fb, name), "forward " + name)
        self.assertEqual(sorted(gs.grads), sorted(gb.grads))
        for name in gs.grads:
            self.assertBits(gs.grads[name], gb.grads[name], "grad " + name)
        for name in ("grad_obs", "grad_h0", "grad_c0"):
            self.assertBits(getattr(gs, name), getattr(gb, name), name)
        # Accumulated: no weight gradients come back.
        f = self.s.forward(obs, init, keep_tape=True)
        self.assertEqual(self.s.backward(f.tape_id, go, accumulate=True).grads, {})
        # recorded_fields, input_grads and a decode function go through shared memory too: the
        # decode function reads the region in place.
        ids = np.arange(300, 303, dtype=np.uint64)
        for t in range(T):
            for c, base in ((self.s, 0), (self.b, 1000)):
                c.step(ids + base, obs[:3, t], init[:3, t] | (t == 0))
        seen = []

        def dec(t):
            seen.append(t.data.obj)
            return np.frombuffer(t.data, dtype=_NP[t.dtype]).reshape(tuple(t.shape)).copy()
        fs = self.s.forward_recorded(ids, T, keep_tape=True, fields=("is_init",), decode=dec)
        fb = self.b.forward_recorded(ids + 1000, T, keep_tape=True, fields=("is_init",))
        self.assertIsInstance(seen[0], np.ndarray)  # the region, not a reply's bytes
        self.assertBits(fs.output, fb.output, "recorded output")
        self.assertIsNone(fs.obs)
        np.testing.assert_array_equal(fs.is_init, fb.is_init)
        gs = self.s.backward(fs.tape_id, go[:3], input_grads=())
        gb = self.b.backward(fb.tape_id, go[:3], input_grads=())
        self.assertIsNone(gs.grad_obs)
        for name in gs.grads:
            self.assertBits(gs.grads[name], gb.grads[name], "recorded grad " + name)

    def test_16bit_wire(self):
        # bfloat16 and float16 go through shared memory too, with the bytes path's bits: floats
        # sent in the wire dtype, replies in it (bfloat16 widened to float32 as decode does).
        # Outputs and gradients of 1 MiB and more: with 1 MiB messages they fit only outside.
        B, T, R, S = 256, 64, 1024, 16  # explicit, then recorded windows
        obs, h0, c0 = self.x(B, T, I), self.x(B, L, H), self.x(B, L, H)
        init = self.rng.random((B, T)) < 0.2
        go, gr_out = self.x(B, T, H), self.x(R, S, H)
        ids = np.arange(10000, 10000 + R, dtype=np.uint64)
        for t in range(S):
            x = self.x(R, I)
            for c, base in ((self.s, 0), (self.b, R)):
                c.step(ids + base, x, t == 0)
        with rnnd.Client(self.sock, max_message_mb=1) as small:
            for wire in ("bfloat16", "float16"):
                res = []
                for c in (small, self.b):
                    f = c.forward(obs, init, h0=h0, c0=c0, keep_tape=True, dtype=wire)
                    g = c.backward(f.tape_id, go, dtype=wire)
                    r = c.forward_recorded(ids + (0 if c is small else R), S, keep_tape=True,
                                           fields=("obs",), reply_dtype=wire)
                    gr = c.backward(r.tape_id, gr_out, dtype=wire, input_grads=())
                    res.append((f, g, r, gr))
                self.assertEqual(small.transport, "shm")
                (fs, gs, rs, grs), (fb, gb, rb, grb) = res
                for name in ("output", "h_n", "c_n"):
                    self.assertBits(getattr(fs, name), getattr(fb, name), wire + " " + name)
                    self.assertBits(getattr(rs, name), getattr(rb, name), wire + " rec " + name)
                self.assertBits(rs.obs, rb.obs, wire + " recorded obs")
                for name in gs.grads:
                    self.assertBits(gs.grads[name], gb.grads[name], wire + " grad " + name)
                    self.assertBits(grs.grads[name], grb.grads[name], wire + " rec grad " + name)
                for name in ("grad_obs", "grad_h0", "grad_c0"):
                    self.assertBits(getattr(gs, name), getattr(gb, name), wire + " " + name)

    def test_larger_than_messages(self):
        # 1 MiB messages: a 2 MiB output fits only through shared memory.
        B, T = 256, 64
        obs = self.x(B, T, I)
        with rnnd.Client(self.sock, max_message_mb=1) as small:
            f = small.forward(obs)
            self.assertEqual(f.output.shape, (B, T, H))
        with rnnd.Client(self.sock, max_message_mb=1, transport="grpc") as small:
            with self.assertRaises(rnnd.RnndError) as cm:
                small.forward(obs)
            self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def test_leased_replies(self):
        # rnnd.torch's CPU decoder hands reply tensors out in place: each keeps its span from
        # other calls while it lives (a later call must not write over it), gives it back when
        # it goes, leases at most half the region (copies after that, the calls still fit),
        # and outlives the client.
        try:
            import torch
        except ImportError:
            self.skipTest("no torch")
        import gc
        from rnnd.torch import _decoder
        dec = _decoder(torch.device("cpu"))
        B, T = 5, 7
        obs, obs2, init = self.x(B, T, I), self.x(B, T, I), self.rng.random((B, T)) < 0.2
        want = self.b.forward(obs, init).output
        c = rnnd.Client(self.sock, shm_mb=1)
        f = c.forward(obs, init, decode=dec)
        region = c._region
        self.assertTrue(np.shares_memory(f.output.numpy(), region.bytes))  # in place
        self.assertGreater(region._leased, 0)
        c.forward(obs2, init, decode=dec)  # its own span, not f's
        self.assertBits(f.output.numpy(), want, "leased output after another call")
        del f
        gc.collect()
        self.assertTrue(region.idle())  # settles the freed leases
        self.assertEqual(region._leased, 0)
        # A lease may go in a garbage collection while the region's lock is held (an allocation
        # inside it): its finalizer must not wait for that lock.
        import threading
        held = [c.forward(obs, init, decode=dec).output]

        def free_inside_the_lock():
            with region._lock:
                held.clear()
        t = threading.Thread(target=free_inside_the_lock, daemon=True)
        t.start()
        t.join(10)
        self.assertFalse(t.is_alive(), "a freed lease waited for the region's lock")
        self.assertTrue(region.idle())
        kept = [c.forward(obs, init, decode=dec).output for _ in range(200)]
        self.assertLessEqual(region._leased, region.size // 2)
        copied = [k for k in kept if not np.shares_memory(k.numpy(), region.bytes)]
        self.assertTrue(copied and len(copied) < len(kept))
        for k in kept:
            self.assertBits(k.numpy(), want, "kept output")
        c.close()
        for k in kept:
            self.assertBits(k.numpy(), want, "kept output after close")

    def test_cuda_region_refused_on_the_cpu_backend(self):
        # A CUDA region needs a daemon on one CUDA device: refused with what to do instead,
        # malformed ones named; the client's CUDA path then stays closed and calls on CUDA
        # tensors go the other ways (transport "cuda" makes that an error).
        if BACKEND != "cpu":
            self.skipTest("a CUDA daemon opens CUDA regions (tests/gpu/cuda_region_check.py)")
        from rnnd.v1 import rnnd_pb2 as pb, rnnd_pb2_grpc
        stub = rnnd_pb2_grpc.RnnStub(grpc.insecure_channel(self.sock))
        good = pb.CudaRegion(ipc_handle=bytes(64), offset=0, size=1 << 20, key=bytes(32),
                             pid=os.getpid())
        with self.assertRaises(grpc.RpcError) as cm:
            stub.RegisterRegion(pb.RegisterRegionRequest(cuda=good))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("one CUDA device", cm.exception.details())
        self.assertIn("memfd region", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            stub.RegisterRegion(pb.RegisterRegionRequest())
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("set memfd, cuda or socket", cm.exception.details())
        with rnnd.Client(self.sock) as c:
            self.assertIsNone(c._region_for(None))
            self.assertEqual(c.transport, "shm")

    def test_errors_still_name_the_field(self):
        with self.assertRaises(rnnd.RnndError) as cm:
            self.s.step([1, 2], self.x(2, I + 1), True)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("obs", cm.exception.details)


class LimitsTest(unittest.TestCase):
    def test_reply_beyond_message_limit(self):
        # --max-message-mb 1: a Forward whose 2 MiB output goes into the reply_region is
        # accepted; as bytes it is refused before any work.
        with daemon(input_size=I, hidden_size=H, max_message_mb=1) as d:
            obs = np.zeros((256, 64, I), np.float32)
            with d.client() as c:
                self.assertEqual(c.transport, "shm")
                self.assertEqual(c.forward(obs).output.shape, (256, 64, H))
            with d.client(transport="grpc") as c:
                with self.assertRaises(rnnd.RnndError) as cm:
                    c.forward(obs)
                self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
                self.assertIn("--max-message-mb", cm.exception.details)

    def test_off(self):
        with daemon(input_size=I, hidden_size=H, max_shm_regions=0) as d:
            with d.client() as c:
                self.assertEqual(c.transport, "grpc")  # auto: the daemon said no
                self.assertEqual(c.step([1], np.zeros((1, I), np.float32), True).shape, (1, H))
            with d.client(transport="shm") as c:
                with self.assertRaises(rnnd.RnndError) as cm:
                    c.transport
                self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn("--max-shm-regions 0", cm.exception.details)


if __name__ == "__main__":
    sys.exit(not unittest.main(exit=False, verbosity=2).result.wasSuccessful())
