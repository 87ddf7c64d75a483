"""rnnd.Client against a real daemon (CPU backend): every RPC, the streaming stepper, recorded
trajectories with extras, retry-safe steps, checkpoints, auth, and that errors carry the gRPC
status code and the server's message (docs/design.md "Status codes")."""

import os
import sys
import tempfile
import unittest

import grpc
import numpy as np

import rnnd
from _common import BACKEND, daemon, rel_err

I, H, L, E = 6, 8, 2, 3


def _own_daemons():
    """PIDs of this process's running children that run the rnnd binary (Linux /proc)."""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % p) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open("/proc/%s/cmdline" % p, "rb") as f:
                argv0 = f.read().split(b"\0")[0]
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and argv0.endswith(b"rnnd"):
            pids.append(int(p))
    return pids

class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = daemon(cell="lstm", layers=L, input_size=I, hidden_size=H, extras_size=E,
                       trajectory_steps=64, seed=7).start()
        cls.c = cls.d.client()
        cls.rng = np.random.default_rng(0)
        cls.next_env = 1000

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.d.stop()

    def envs(self, n):
        ids = np.arange(self.next_env, self.next_env + n, dtype=np.uint64)
        type(self).next_env += n
        return ids

    def obs(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def assertStatus(self, code, fn, *args, **kw):
        with self.assertRaises(rnnd.RnndError) as cm:
            fn(*args, **kw)
        e = cm.exception
        self.assertEqual(e.code, code, "expected %s, got %s: %s" % (code.name, e.code_name, e.details))
        self.assertEqual(e.code_name, code.name)
        self.assertTrue(e.details, "the status must carry the server's message")
        self.assertIn(e.details, str(e))
        return e

    # -- service --

    def test_health(self):
        self.assertEqual(self.c.health(), "SERVING")
        self.assertEqual(self.c.health("rnnd.v1.Rnn"), "SERVING")

    def test_info(self):
        info = self.c.info()
        self.assertEqual((info.cell, info.input_size, info.hidden_size, info.num_layers,
                          info.extras_size), ("lstm", I, H, L, E))
        self.assertEqual(info.backend, BACKEND)
        self.assertIn(info.compute, ("fp32", "ieee", "bf16"))
        if BACKEND == "cpu":
            self.assertEqual(info.kernel_plan, "cpu_reference")
        else:
            self.assertTrue(info.kernel_plan)
        self.assertGreater(info.max_batch, 0)

    # -- Step --

    def test_step_shapes_and_determinism(self):
        ids = self.envs(5)
        x = self.obs(5, I)
        out = self.c.step(ids, x, is_init=True)
        self.assertEqual(out.shape, (5, H))
        self.assertEqual(out.dtype, np.float32)
        out2 = self.c.step(self.envs(5), x, is_init=True)
        np.testing.assert_array_equal(out, out2)
        res = self.c.step_result(ids, x, return_state=True)
        self.assertEqual(res.h.shape, (5, L, H))
        self.assertEqual(res.c.shape, (5, L, H))
        np.testing.assert_allclose(res.h[:, -1], res.output, rtol=0, atol=0)
        self.assertEqual(self.c.end_episodes(ids), 5)

    def test_stepper_matches_unary(self):
        a, b = self.envs(4), self.envs(4)
        with self.c.stepper() as s:
            for t in range(6):
                x = self.obs(4, I)
                init = t == 0 or (self.rng.random(4) < 0.3)
                u = self.c.step(a, x, init)
                v = s.step(b, x, init)
                np.testing.assert_allclose(v, u, rtol=1e-6, atol=1e-6)
            # pipelined: two in flight, replies in order
            x1, x2 = self.obs(4, I), self.obs(4, I)
            s.send(b, x1)
            s.send(b, x2)
            r1, r2 = s.recv(), s.recv()
            np.testing.assert_allclose(r1.output, self.c.step(a, x1), rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(r2.output, self.c.step(a, x2), rtol=1e-6, atol=1e-6)

    def test_stepper_error_ends_stream(self):
        with self.c.stepper() as s:
            s.step(self.envs(2), self.obs(2, I), True)
            e = self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, s.step, self.envs(1),
                                  self.obs(1, I), False)
            self.assertEqual(e.method, "StepStream")

    def test_step_errors(self):
        ids = self.envs(2)
        self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, self.c.step, ids, self.obs(2, I))
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.step, [ids[0], ids[0]],
                          self.obs(2, I), True)
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.step, ids, self.obs(2, I + 1), True)
        bad = self.obs(2, I)
        bad[1, 2] = np.nan
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.step, ids, bad, True)
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.step, ids, self.obs(2, I), True,
                          extras=self.obs(2, E + 1))
        # a rejected request changes no state: the envs still have none
        self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, self.c.step, ids, self.obs(2, I))

    def test_retry_safe_steps(self):
        ids = self.envs(3)
        x0, x1 = self.obs(3, I), self.obs(3, I)
        self.c.step(ids, x0, True, step_index=[0, 0, 0])
        o1 = self.c.step(ids, x1, step_index=[1, 1, 1])
        again = self.c.step(ids, x1, step_index=[1, 1, 1])  # a resent request: cached output
        np.testing.assert_array_equal(again, o1)
        self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, self.c.step, ids, x1,
                          step_index=[3, 3, 3])
        o2 = self.c.step(ids, x1, step_index=[2, 2, 2])
        self.assertFalse(np.array_equal(o2, o1))

    def test_end_episodes(self):
        ids = self.envs(3)
        self.c.step(ids, self.obs(3, I), True)
        self.assertEqual(self.c.end_episodes(list(ids) + [123456789]), 3)
        self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, self.c.step, ids[:1], self.obs(1, I))

    # -- Forward / Backward --

    def test_forward_recorded_equals_step(self):
        ids = self.envs(3)
        T, total = 7, 12
        outs, obs, inits, extras = [], [], [], []
        for t in range(total):
            x = self.obs(3, I)
            init = (self.rng.random(3) < 0.25) | (t == 0)
            ex = self.obs(3, E)
            outs.append(self.c.step(ids, x, init, extras=ex).copy())
            obs.append(x)
            inits.append(init)
            extras.append(ex)
        r = self.c.forward_recorded(ids, T)
        self.assertEqual(r.tape_id, 0)
        want = np.stack(outs[-T:], 1)
        self.assertEqual(r.output.shape, (3, T, H))
        self.assertLessEqual(rel_err(r.output, want), 1e-5)
        np.testing.assert_array_equal(r.obs, np.stack(obs[-T:], 1))
        np.testing.assert_array_equal(r.is_init, np.stack(inits[-T:], 1))
        np.testing.assert_array_equal(r.extras, np.stack(extras[-T:], 1))
        # The client keeps the last env_ids it encoded: other ids, then the first ones again.
        sub = self.c.forward_recorded(ids[::-1][:2], T)
        np.testing.assert_array_equal(sub.obs, np.stack(obs[-T:], 1)[::-1][:2])
        np.testing.assert_array_equal(self.c.forward_recorded(list(ids), T).output, r.output)
        self.assertEqual(r.step_model_version.shape, (3, T))
        self.assertEqual(r.step_model_version.dtype, np.int64)
        self.assertEqual(r.h_n.shape, (3, L, H))
        self.assertEqual(r.c_n.shape, (3, L, H))
        e = self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, self.c.forward_recorded, ids, total + 1)
        self.assertTrue(any(str(int(i)) in e.details for i in ids), e.details)
        # a recorded tape gives weight gradients
        r = self.c.forward_recorded(ids, T, keep_tape=True)
        self.assertNotEqual(r.tape_id, 0)
        g = self.c.backward(r.tape_id, np.ones((3, T, H), np.float32))
        self.assertEqual(set(g.grads), set(self.c.get_weights()))

    def test_backward_unknown_tape(self):
        self.assertStatus(grpc.StatusCode.NOT_FOUND, self.c.backward, 987654321,
                          np.zeros((1, 1, H), np.float32))

    def test_forward_errors(self):
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.forward, self.obs(2, 3, I + 1))
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.forward, self.obs(2, 3, I),
                          np.zeros((2, 4), bool))
        r = self.c.forward(self.obs(2, 3, I), keep_tape=True)
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.backward, r.tape_id,
                          np.zeros((2, 3, H + 1), np.float32))

    # -- weights, optimizer, checkpoints --

    def test_weights_roundtrip_and_training(self):
        w = self.c.get_weights()
        names = {f"{k}_l{l}" for l in range(L) for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        self.assertEqual(set(w), names)
        self.assertEqual(w["weight_ih_l0"].shape, (4 * H, I))
        self.assertEqual(w["weight_ih_l1"].shape, (4 * H, H))
        self.assertEqual(w["bias_hh_l1"].shape, (4 * H,))
        bound = 1 / np.sqrt(H)
        for v in w.values():
            self.assertLessEqual(np.abs(v).max(), bound + 1e-6)
        new = {k: (v * 0.5).astype(np.float32) for k, v in w.items()}
        v1 = self.c.set_weights(new)
        self.assertGreater(v1, w.model_version)
        got = self.c.get_weights()
        self.assertEqual(got.model_version, v1)
        for k in new:
            np.testing.assert_array_equal(got[k], new[k])
        self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.set_weights,
                          {"weight_ih_l0": np.zeros((3, 3), np.float32)})

        # explicit gradients
        x = self.obs(4, 5, I)
        r = self.c.forward(x, keep_tape=True)
        g = self.c.backward(r.tape_id, r.output.copy())  # d(0.5 |out|^2)
        v2 = self.c.apply_gradients(g.grads, lr=1e-2)
        self.assertEqual(v2, v1 + 1)
        after = self.c.forward(x).output
        self.assertLess(float((after ** 2).sum()), float((r.output ** 2).sum()))
        # accumulated on the server
        r = self.c.forward(x, keep_tape=True)
        g = self.c.backward(r.tape_id, r.output.copy(), accumulate=True)
        self.assertEqual(len(g.grads), 0)
        v3 = self.c.apply_gradients(lr=1e-2)
        self.assertEqual(v3, v2 + 1)
        self.assertLess(float((self.c.forward(x).output ** 2).sum()), float((r.output ** 2).sum()))
        self.assertGreaterEqual(self.c.info().model_version, v3)

    def test_backward_with_apply(self):
        # Backward(accumulate, apply) takes the optimizer step in the same call: the weights come
        # out bit for bit as Backward(accumulate) then ApplyGradients leave them, on twin daemons.
        x = self.obs(3, 4, 2)
        out = []
        for fused in (False, True):
            with daemon(input_size=2, hidden_size=5, seed=9) as d, d.client() as c:
                if fused:
                    # apply needs accumulate: refused, and the tape is still there
                    f = c.forward(x, keep_tape=True)
                    self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, c.backward, f.tape_id,
                                      f.output.copy(), apply=True)
                    self.assertEqual(c.info().model_version, f.model_version)
                    g = c.backward(f.tape_id, f.output.copy(), accumulate=True, apply=True)
                    self.assertEqual(g.model_version, f.model_version + 1)
                    self.assertEqual(c.info().model_version, g.model_version)
                    # nothing is left to apply
                    self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, c.apply_gradients)
                else:
                    f = c.forward(x, keep_tape=True)
                    g = c.backward(f.tape_id, f.output.copy(), accumulate=True)
                    self.assertEqual(g.model_version, f.model_version)
                    c.apply_gradients()
                out.append(c.get_weights())
        for k in out[0]:
            np.testing.assert_array_equal(out[0][k], out[1][k])
        # A daemon of two devices refuses it before anything runs (two CPU engines here; on the
        # CUDA backend that takes two GPUs).
        if BACKEND != "cpu":
            return
        with daemon(input_size=2, hidden_size=5, devices="0,1") as d, d.client() as c:
            f = c.forward(x, keep_tape=True)
            e = self.assertStatus(grpc.StatusCode.FAILED_PRECONDITION, c.backward, f.tape_id,
                                  f.output.copy(), accumulate=True, apply=True)
            self.assertIn("send ApplyGradients", e.details)

    def test_checkpoint(self):
        w = self.c.get_weights()
        ck = self.c.save_checkpoint()
        self.assertTrue(ck.path)
        self.assertGreaterEqual(ck.model_version, w.model_version)
        path = ck.path if os.path.isabs(ck.path) else os.path.join(self.d.state_dir, ck.path)
        self.assertTrue(os.path.isdir(path), path)
        st = rnnd.load_safetensors(path)
        self.assertEqual(set(st), set(w))
        for k in w:
            np.testing.assert_array_equal(st[k], w[k])

    def test_daemon_started_once(self):
        # `with daemon(...).start() as d:` (as several tests write it) runs one process, and
        # leaves none behind: entering the block used to start a second one and stop only that.
        before = set(_own_daemons())
        with daemon(input_size=2, hidden_size=3).start() as d:
            self.assertEqual(set(_own_daemons()) - before, {d.proc.pid})
        self.assertIsNotNone(d.proc.poll())
        self.assertEqual(set(_own_daemons()) - before, set())

    def test_unreachable_names_the_address(self):
        import socket
        with socket.socket() as s:  # a loopback port that nothing listens on
            s.bind(("127.0.0.1", 0))
            target = "127.0.0.1:%d" % s.getsockname()[1]
        hint = "(is rnnd running at %s?)" % target
        with rnnd.Client(target, timeout=5) as c:
            e = self.assertStatus(grpc.StatusCode.UNAVAILABLE, c.info)
            self.assertIn(hint, str(e))
            self.assertEqual((e.target, e.method), (target, "GetModelInfo"))
            with c.stepper() as s:
                with self.assertRaises(rnnd.RnndError) as cm:
                    s.step([1], np.zeros((1, I), np.float32), True)
                self.assertIn(hint, str(cm.exception))
        with rnnd.Pool([self.d.target, target], timeout=5) as p:
            ids = self.envs(64)
            with self.assertRaises(rnnd.RnndError) as cm:
                p.step(ids, np.zeros((64, I), np.float32), True)
            self.assertIn(hint, str(cm.exception))
        # an error the daemon sends (not a connection failure) carries no such question
        e = self.assertStatus(grpc.StatusCode.INVALID_ARGUMENT, self.c.step, [1],
                              np.zeros((1, I + 1), np.float32), True)
        self.assertNotIn("is rnnd running", str(e))


class NativeTest(unittest.TestCase):
    """The unary calls through the C client (rnnd._native) where its library is found: in a
    build tree CMake puts it beside the package, and RNND_NATIVE=0 (the python_client_grpcio
    test) runs this file on grpcio."""

    def test_which_path(self):
        want = os.environ.get("RNND_NATIVE") != "0" and rnnd._native.library() is not None
        beside = os.path.exists(os.path.join(os.path.dirname(rnnd.__file__), "librnnd_client.so"))
        if beside and os.environ.get("RNND_NATIVE") != "0":
            self.assertTrue(want, "librnnd_client.so is beside the package but does not load")
        with daemon(input_size=2, hidden_size=3) as d:
            with d.client() as c:
                self.assertEqual(c.native, want)
                if want:  # nothing goes through grpcio's stub
                    c._stub = None
                c.step([1], np.ones((1, 2), np.float32), True)
                r = c.forward_recorded([1], 1, keep_tape=True)
                self.assertEqual(c.backward(r.tape_id, np.ones((1, 1, 3), np.float32)).grads[
                    "weight_hh_l0"].shape, (9, 3))
                self.assertEqual(c.info().hidden_size, 3)
                with self.assertRaises(rnnd.RnndError) as cm:
                    c.step([1], np.ones((1, 5), np.float32))
                self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("obs", cm.exception.details)
                self.assertEqual(cm.exception.method, "Step")
            with d.client(native=False) as c:
                self.assertFalse(c.native)
                self.assertEqual(c.info().hidden_size, 3)
            if want:
                with self.assertRaises(ValueError):  # TLS channels stay on grpcio
                    rnnd.Client(d.target, tls=True, native=True)

    def test_native_required_but_missing(self):
        # RNND_NATIVE=1 with no library to load is an error naming where it looked.
        import subprocess
        env = dict(os.environ, RNND_NATIVE="1", RNND_CLIENT_LIB="/nonexistent/librnnd_client.so")
        r = subprocess.run([sys.executable, "-c", "import rnnd; rnnd.Client('127.0.0.1:1')"],
                           env=env, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("RNND_NATIVE=1 but librnnd_client.so is not found", r.stderr)
        self.assertIn("/nonexistent/librnnd_client.so", r.stderr)


class LimitsTest(unittest.TestCase):
    def test_env_table_full(self):
        with daemon(input_size=2, hidden_size=3, max_envs=4) as d, d.client() as c:
            c.step([1, 2, 3], np.zeros((3, 2), np.float32), True)
            e = None
            with self.assertRaises(rnnd.RnndError) as cm:
                c.step([4, 5], np.zeros((2, 2), np.float32), True)
            e = cm.exception
            self.assertEqual(e.code, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            self.assertTrue(e.details)
            # the rejected request took no slot; ending episodes frees them
            c.step([4], np.zeros((1, 2), np.float32), True)
            self.assertEqual(c.end_episodes([1, 2]), 2)
            c.step([5, 6], np.zeros((2, 2), np.float32), True)

    def test_message_too_large(self):
        # Through shared memory the tensors are not in the message: the limit is the bytes path's.
        with daemon(input_size=1024, hidden_size=3, max_message_mb=1, max_batch=16) as d, \
                d.client(transport="grpc") as c:
            with self.assertRaises(rnnd.RnndError) as cm:
                c.forward(np.zeros((4, 128, 1024), np.float32))  # 2 MiB
            self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED, str(cm.exception))
            self.assertEqual(c.forward(np.zeros((1, 2, 1024), np.float32)).output.shape, (1, 2, 3))

    def test_extras_default_zero(self):
        with daemon(input_size=2, hidden_size=3, extras_size=2) as d, d.client() as c:
            c.step([7], np.ones((1, 2), np.float32), True)
            c.step([7], np.ones((1, 2), np.float32), extras=[[1.5, -2]])
            r = c.forward_recorded([7], 2)
            np.testing.assert_array_equal(r.extras, [[[0, 0], [1.5, -2]]])
        with daemon(input_size=2, hidden_size=3) as d, d.client() as c:
            with self.assertRaises(rnnd.RnndError) as cm:
                c.step([7], np.ones((1, 2), np.float32), True, extras=[[1.0]])
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("extras-size", cm.exception.details)


class AuthTest(unittest.TestCase):
    def test_token(self):
        with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
            f.write("s3cret-token\n")
        try:
            with daemon(input_size=4, hidden_size=4, auth_token_file=f.name) as d:
                with d.client() as c:
                    with self.assertRaises(rnnd.RnndError) as cm:
                        c.info()
                    self.assertEqual(cm.exception.code, grpc.StatusCode.UNAUTHENTICATED)
                with d.client(token="wrong") as c:
                    with self.assertRaises(rnnd.RnndError) as cm:
                        c.step([1], np.zeros((1, 4), np.float32), True)
                    self.assertEqual(cm.exception.code, grpc.StatusCode.UNAUTHENTICATED)
                with d.client(token="s3cret-token") as c:
                    self.assertEqual(c.info().input_size, 4)
                    self.assertEqual(c.step([1], np.zeros((1, 4), np.float32), True).shape, (1, 4))
        finally:
            os.unlink(f.name)

    def test_tls(self):
        import shutil
        import subprocess
        if not shutil.which("openssl"):
            self.skipTest("no openssl to make a certificate")
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                            "-subj", "/CN=localhost", "-addext",
                            "subjectAltName=DNS:localhost,IP:127.0.0.1",
                            "-keyout", key, "-out", cert], check=True, capture_output=True)
            with daemon(input_size=3, hidden_size=5, tls_cert=cert, tls_key=key) as d:
                with d.client(tls=cert) as c:
                    self.assertEqual(c.info().hidden_size, 5)
                    self.assertEqual(c.health(), "SERVING")
                with d.client(tls={"ca": cert, "server_name": "localhost"}) as c:
                    self.assertEqual(c.step([1], np.zeros((1, 3), np.float32), True).shape, (1, 5))
                with d.client(timeout=5) as c:  # plaintext against a TLS port fails
                    with self.assertRaises(rnnd.RnndError) as cm:
                        c.info()
                    self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    sys.exit(not unittest.main(exit=False, verbosity=2).result.wasSuccessful())
