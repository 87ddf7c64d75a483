"""Cursor windows (docs/design.md "Cursor") on a real daemon (CPU backend, real gRPC).

Forward over recorded steps with recorded.cursor hands out each env's next window of T steps,
consecutive windows sharing exactly one step (the bootstrap step), so that across windows every
recorded step is handed out once; the outputs are what Step returned for those steps. An env
with fewer than T new steps, a cursor_id of another daemon (or of this one before a restart)
and cursor_id without cursor are refused and move nothing; steps that left the ring, and with
--max-policy-lag steps of too old weights, are skipped, reported per env and counted in
rnnd_recorded_steps_dropped_total; cursors survive a clean restart.
"""

import tempfile
import unittest
import urllib.request

import numpy as np

from _common import daemon

import rnnd  # noqa: E402

I, H = 3, 4
FLAGS = dict(input_size=I, hidden_size=H, trajectory_steps=16, seed=5)


def obs_of(ids, t):
    """Step t's observations: obs[:, 0] = t, so a window says which steps it holds."""
    o = np.zeros((len(ids), I), np.float32)
    o[:, 0] = t
    o[:, 1] = np.asarray(ids, np.float32)
    return o


def dropped(d, reason):
    text = urllib.request.urlopen("http://%s/metrics" % d.http, timeout=10).read().decode()
    key = 'rnnd_recorded_steps_dropped_total{reason="%s"} ' % reason
    return int(next(line for line in text.splitlines() if line.startswith(key))[len(key):])


class Cursor(unittest.TestCase):
    def step(self, c, ids, t0, n, outs=None):
        for t in range(t0, t0 + n):
            out = c.step(ids, obs_of(ids, t), is_init=[t == 0] * len(ids))
            if outs is not None:
                outs.append(np.asarray(out))

    def refused(self, code, needle, fn, *args, **kw):
        with self.assertRaises(rnnd.RnndError) as e:
            fn(*args, **kw)
        self.assertEqual(e.exception.code_name, code, str(e.exception))
        self.assertIn(needle, e.exception.details)
        return e.exception

    def test_each_step_once_with_one_step_overlap(self):
        ids = [7, 9]
        with daemon(**FLAGS) as d:
            c = d.client()
            outs = []
            self.step(c, ids, 0, 5, outs)
            # The plain recorded Forward (the last T steps) leaves the cursor alone.
            last = c.forward_recorded(ids, 3)
            np.testing.assert_array_equal(last.obs[:, :, 0], [[2, 3, 4]] * 2)
            self.assertIsNone(last.cursor_first)
            got = []
            for T in (3, 3):
                r = c.forward_recorded(ids, T, cursor=True)
                self.assertNotEqual(c.cursor_id, 0)
                np.testing.assert_array_equal(r.cursor_lagged, [0, 0])
                np.testing.assert_array_equal(r.cursor_overwritten, [0, 0])
                first = int(r.cursor_first[0])
                np.testing.assert_array_equal(r.cursor_first, [first, first])
                want = np.arange(first, first + T)
                np.testing.assert_array_equal(r.obs[:, :, 0], [want, want])
                # Replayed from the state before the window's first step: what Step returned.
                for t in range(T):
                    np.testing.assert_allclose(r.output[:, t], outs[first + t], rtol=1e-5,
                                               atol=1e-6)
                got.append(list(want))
            self.assertEqual(got, [[0, 1, 2], [2, 3, 4]])  # step 2 is the bootstrap step

            # One new step (4) is not a window of 3: refused, and nothing moves.
            e = self.refused("FAILED_PRECONDITION", "env 7 has 1 new recorded steps from its "
                             "cursor (step 4), a cursor window needs 3", c.forward_recorded,
                             ids, 3, cursor=True)
            self.assertIn("nothing was handed out", e.details)
            self.step(c, ids, 5, 2, outs)
            r = c.forward_recorded(ids, 3, cursor=True)
            np.testing.assert_array_equal(r.obs[:, :, 0], [[4, 5, 6]] * 2)
            np.testing.assert_array_equal(r.cursor_first, [4, 4])

            # Envs move on their own cursors.
            self.step(c, [7], 7, 4)
            r = c.forward_recorded([7], 5, cursor=True)
            np.testing.assert_array_equal(r.obs[0, :, 0], [6, 7, 8, 9, 10])
            self.step(c, [9], 7, 1)
            self.refused("FAILED_PRECONDITION", "env 7 has 1 new recorded steps from its cursor "
                         "(step 10)", c.forward_recorded, [9, 7], 2, cursor=True)
            r = c.forward_recorded([9], 2, cursor=True)  # the refusal above moved nothing
            np.testing.assert_array_equal(r.obs[0, :, 0], [6, 7])
            # A window of one step would never move.
            self.refused("INVALID_ARGUMENT", "recorded.steps is 1 with cursor",
                         c.forward_recorded, [9], 1, cursor=True)
            # An env with no state is refused as before.
            self.refused("FAILED_PRECONDITION", "env 3 has 0 recorded steps (no state",
                         c.forward_recorded, [3], 2, cursor=True)

    def test_foreign_cursor_is_refused_and_changes_nothing(self):
        with daemon(**FLAGS) as d1, daemon(**FLAGS) as d2:
            c1, c2 = d1.client(), d2.client(transport="grpc")  # both of the client's paths
            for c in (c1, c2):
                self.step(c, [1], 0, 4)
            c1.forward_recorded([1], 2, cursor=True)
            self.assertNotEqual(c1.cursor_id, 0)
            c2.cursor_id = c1.cursor_id
            e = self.refused("FAILED_PRECONDITION", "is not this daemon's", c2.forward_recorded,
                             [1], 2, cursor=True)
            self.assertIn("send cursor_id 0", e.details)
            self.assertEqual(c2.cursor_id, c1.cursor_id)  # a refusal keeps what the client had
            c2.cursor_id = 0
            r = c2.forward_recorded([1], 2, cursor=True)
            np.testing.assert_array_equal(r.cursor_first, [0])  # d2's cursor had not moved
            self.assertNotEqual(c2.cursor_id, c1.cursor_id)
            # cursor_id without cursor is a malformed request.
            from rnnd.v1 import rnnd_pb2 as pb
            req = pb.ForwardRequest(recorded=pb.Recorded(env_ids=[1], steps=2, cursor_id=5))
            self.refused("INVALID_ARGUMENT", "recorded.cursor_id is set but recorded.cursor is "
                         "false", c2._call, "Forward", req)

    def test_steps_gone_from_the_ring_are_reported(self):
        with daemon(**dict(FLAGS, trajectory_steps=4)) as d:
            c = d.client()
            self.step(c, [1, 2], 0, 10)
            self.assertEqual(dropped(d, "overwritten"), 0)
            r = c.forward_recorded([1, 2], 3, cursor=True)
            np.testing.assert_array_equal(r.cursor_first, [6, 6])  # the ring holds 6..9
            np.testing.assert_array_equal(r.cursor_overwritten, [6, 6])
            np.testing.assert_array_equal(r.obs[:, :, 0], [[6, 7, 8]] * 2)
            self.assertEqual(dropped(d, "overwritten"), 12)

    def test_policy_lag_skips_stale_steps(self):
        with daemon(**dict(FLAGS, max_policy_lag=1)) as d:
            c = d.client()
            self.step(c, [1, 2], 0, 3)  # version 0
            w = c.get_weights()
            c.set_weights(w)
            v = c.set_weights(w)  # version 2: steps of version 0 are more than 1 behind
            self.assertEqual(v, 2)
            e = self.refused("FAILED_PRECONDITION", "env 1 has 0 new recorded steps from its "
                             "cursor (step 3, past steps older than --max-policy-lag)",
                             c.forward_recorded, [1, 2], 2, cursor=True)
            self.assertIn("nothing was handed out", e.details)
            self.assertEqual(dropped(d, "policy_lag"), 0)  # a refusal counts nothing
            self.step(c, [1, 2], 3, 3)  # version 2
            r = c.forward_recorded([1, 2], 3, cursor=True)
            np.testing.assert_array_equal(r.cursor_first, [3, 3])
            np.testing.assert_array_equal(r.cursor_lagged, [3, 3])
            np.testing.assert_array_equal(r.step_model_version, [[2, 2, 2]] * 2)
            np.testing.assert_array_equal(r.obs[:, :, 0], [[3, 4, 5]] * 2)
            self.assertEqual(dropped(d, "policy_lag"), 6)
            # Within the bound: version 3 is one ahead of the steps of version 2.
            c.set_weights(w)
            self.step(c, [1, 2], 6, 1)
            r = c.forward_recorded([1, 2], 2, cursor=True)
            np.testing.assert_array_equal(r.obs[:, :, 0], [[5, 6]] * 2)
            np.testing.assert_array_equal(r.cursor_lagged, [0, 0])

    def test_cursors_survive_a_clean_restart(self):
        with tempfile.TemporaryDirectory(prefix="rnnd-cursor-") as state:
            with daemon(state_dir=state, **FLAGS) as d:
                c = d.client()
                self.step(c, [1], 0, 5)
                r = c.forward_recorded([1], 3, cursor=True)
                np.testing.assert_array_equal(r.cursor_first, [0])
                old = c.cursor_id
            with daemon(state_dir=state, **FLAGS) as d:
                c = d.client()
                c.cursor_id = old
                self.refused("FAILED_PRECONDITION", "before a restart", c.forward_recorded, [1],
                             3, cursor=True)
                c.cursor_id = 0
                r = c.forward_recorded([1], 3, cursor=True)
                np.testing.assert_array_equal(r.cursor_first, [2])
                np.testing.assert_array_equal(r.obs[0, :, 0], [2, 3, 4])


if __name__ == "__main__":
    unittest.main()
