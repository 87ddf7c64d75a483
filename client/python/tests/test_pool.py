"""rnnd.Pool: rendezvous placement (the same vectors as the C client's
tests/deploy/test_pool_hash.c, so Python and C place every env alike), balance and minimal movement; then two real daemons behind
a Pool against one daemon alone (CPU backend, same seed): each env's outputs and states through
the pool equal the single daemon's, for step_result and the PoolStepper, and every env's state
lives on the daemon its hash picks."""

import sys
import unittest

import grpc
import numpy as np

import rnnd
from rnnd import pool as rp
from _common import daemon

I, H, L = 6, 8, 2
TARGETS = ["rnnd-0.rnnd:50051", "rnnd-1.rnnd:50051", "rnnd-2.rnnd:50051"]


class HashTest(unittest.TestCase):
    # The same numbers are in tests/deploy/test_pool_hash.c: change both or neither.
    def test_vectors(self):
        self.assertEqual(rp.target_hash(""), 0xCBF29CE484222325)
        self.assertEqual(rp.target_hash("a"), 0xAF63DC4C8601EC8C)
        self.assertEqual([rp.target_hash(t) for t in TARGETS],
                         [0x6152EB87895C0C35, 0xEFFFB51CD81C060C, 0x32088C167FAD1E5F])
        envs = [0, 1, 2, 3, 42, 1000, 2**64 - 1, 0x123456789ABCDEF]
        w = rp.weights(envs, [rp.target_hash(TARGETS[0])])[:, 0]
        self.assertEqual([int(x) for x in w],
                         [0xD6E775F7C36F7A2A, 0xA165AE671D47F04B, 0xD41D910913A5C4D1,
                          0x4DDBFF778C1F194B, 0x597A5BD7961627D8, 0x7AA7013AAD37010D,
                          0xE93FDAC18E43D99C, 0xAFD9AA0EB06ED0EA])
        self.assertEqual(rp.pick(range(24), TARGETS[:2]).tolist(),
                         [0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0])
        self.assertEqual(rp.pick(range(24), TARGETS).tolist(),
                         [0, 1, 0, 0, 2, 1, 0, 0, 2, 0, 1, 0, 2, 1, 1, 0, 1, 1, 1, 1, 2, 2, 2, 0])
        self.assertEqual(rp.pick(range(5), TARGETS[:1]).tolist(), [0] * 5)
        self.assertEqual(rp.pick([], TARGETS).tolist(), [])

    def test_order_independent(self):
        ids = np.arange(20000, dtype=np.uint64) * np.uint64(7919) + np.uint64(13)
        names = np.array(["10.0.0.%d:50051" % i for i in range(1, 6)])
        a = names[rp.pick(ids, list(names))]
        rev, rot = names[::-1], np.roll(names, 2)
        b = rev[rp.pick(ids, list(rev))]
        c = rot[rp.pick(ids, list(rot))]
        self.assertTrue((a == b).all() and (a == c).all())

    def test_balance(self):
        names = ["rnnd-%d.rnnd.default.svc:50051" % i for i in range(8)]
        rng = np.random.default_rng(1)
        for n in range(2, 9):
            for ids in (np.arange(100000, dtype=np.uint64),
                        rng.integers(0, 2**63, 100000, dtype=np.uint64)):
                counts = np.bincount(rp.pick(ids, names[:n]), minlength=n)
                rel = counts / (100000 / n) - 1
                self.assertLess(np.max(np.abs(rel)), 0.04, "n=%d counts %s" % (n, counts))

    def test_minimal_movement(self):
        names = ["10.1.0.%d:50051" % (i + 10) for i in range(9)]
        ids = np.arange(100000, dtype=np.uint64)
        for n in range(1, 9):
            before, after = rp.pick(ids, names[:n]), rp.pick(ids, names[:n + 1])
            moved = before != after
            self.assertTrue((after[moved] == n).all(), "envs moved between old targets")
            self.assertAlmostEqual(moved.mean(), 1 / (n + 1), delta=0.04 / (n + 1))
        # Removing target 3 moves only its envs.
        full = np.array(names)[rp.pick(ids, names)]
        rest = np.array(names)[[i for i in range(9) if i != 3]]
        less = rest[rp.pick(ids, list(rest))]
        keep = full != names[3]
        self.assertTrue((full[keep] == less[keep]).all())

    def test_pool_checks(self):
        with self.assertRaises(ValueError):
            rnnd.Pool([])
        with self.assertRaises(ValueError):
            rnnd.Pool(["a:1", "b:2", "a:1"])
        with rnnd.Pool(TARGETS) as p:
            self.assertEqual(len(p), 3)
            self.assertEqual(p.pick(range(24)).tolist(), rp.pick(range(24), TARGETS).tolist())
            parts = p.split(np.arange(100, dtype=np.uint64))
            rows = np.sort(np.concatenate([r for _, r in parts]))
            self.assertEqual(rows.tolist(), list(range(100)))
            with self.assertRaises(ValueError):  # obs must have one row per env
                p.step(np.arange(4), np.zeros((3, I), np.float32), True)


class PoolDaemonsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        flags = dict(cell="lstm", layers=L, input_size=I, hidden_size=H, seed=7)
        cls.ds = []
        for _ in range(3):
            cls.ds.append(daemon(**flags).start())
        cls.ref = cls.ds[0].client()
        cls.pool = rnnd.Pool([cls.ds[1].target, cls.ds[2].target])
        cls.pool.wait_ready(30)
        cls.ids = np.arange(40, dtype=np.uint64) * np.uint64(0x100000001) + np.uint64(5 << 36)
        cls.rng = np.random.default_rng(3)

    @classmethod
    def tearDownClass(cls):
        cls.pool.close()
        cls.ref.close()
        for d in cls.ds:
            d.stop()

    def round(self, all_envs=False):
        B = len(self.ids) if all_envs else int(self.rng.integers(2, len(self.ids) + 1))
        ids = self.rng.permutation(self.ids)[:B]
        init = np.ones(B, bool) if all_envs else self.rng.random(B) < 0.15
        obs = self.rng.standard_normal((B, I)).astype(np.float32)
        return ids, obs, init

    def assertSame(self, got, want, state):
        np.testing.assert_allclose(got.output, want.output, rtol=1e-5, atol=1e-5)
        self.assertEqual(got.model_version, want.model_version)
        if state:
            np.testing.assert_allclose(got.h, want.h, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got.c, want.c, rtol=1e-5, atol=1e-5)

    def test_1_same_weights(self):
        w0 = self.ref.get_weights()
        for c in self.pool.clients:
            w = c.get_weights()
            self.assertEqual(sorted(w), sorted(w0))
            for k in w0:
                np.testing.assert_array_equal(w[k], w0[k])

    def test_2_step(self):
        for it in range(20):
            ids, obs, init = self.round(it == 0)
            state = it % 3 == 1
            got = self.pool.step_result(ids, obs, init, return_state=state)
            want = self.ref.step_result(ids, obs, init, return_state=state)
            self.assertSame(got, want, state)
        # Each env's state is on the daemon its hash picks, and only there.
        where = self.pool.pick(self.ids)
        active = [i.envs_active for i in self.pool.info()]
        self.assertEqual(active, [int(np.sum(where == 0)), int(np.sum(where == 1))])
        self.assertTrue(all(a > 0 for a in active))
        for t in (0, 1):
            other = self.pool.clients[1 - t]
            with self.assertRaises(rnnd.RnndError) as cm:
                other.step(self.ids[where == t][:1], np.zeros((1, I), np.float32))
            self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_3_stepper(self):
        with self.pool.stepper() as s:
            for it in range(10):
                a, b = self.round(), self.round()
                s.send(*a, return_state=True)
                s.send(*b)
                self.assertSame(s.recv(), self.ref.step_result(*a, return_state=True), True)
                self.assertSame(s.recv(), self.ref.step_result(*b), False)
            self.assertEqual(s.step(*a[:2]).shape, (len(a[0]), H))
            self.ref.step(*a[:2])
            self.assertSame(s.step_result(*b), self.ref.step_result(*b), False)

    def test_4_errors_name_the_target(self):
        where = self.pool.pick(self.ids)
        ids = self.ids[where == 1][:3]
        k = 10**6
        self.pool.step(ids, np.zeros((3, I), np.float32), step_index=[k] * 3)
        self.ref.step(ids, np.zeros((3, I), np.float32), step_index=[k] * 3)
        with self.assertRaises(rnnd.RnndError) as cm:  # skipping ahead is refused
            self.pool.step(ids, np.zeros((3, I), np.float32), step_index=[k + 2] * 3)
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("target " + self.pool.targets[1], cm.exception.details)

    def test_5_end_episodes_and_weights(self):
        self.assertEqual(self.pool.end_episodes(self.ids), len(self.ids))
        self.assertEqual([i.envs_active for i in self.pool.info()], [0, 0])
        w = {k: np.asarray(v) * 0.5 for k, v in self.ref.get_weights().items()}
        versions = self.pool.set_weights(w)
        self.assertEqual(len(versions), 2)
        self.ref.set_weights(w)
        ids, obs, init = self.round(True)
        self.assertSame(self.pool.step_result(ids, obs, init), self.ref.step_result(ids, obs, init),
                        False)
        self.assertEqual(self.pool.health(), ["SERVING", "SERVING"])


if __name__ == "__main__":
    sys.exit(not unittest.main(exit=False, verbosity=2).result.wasSuccessful())
