"""A daemon serving a policy (encoder, core, heads) against rnnd.torch.Policy, over real gRPC on
the CPU backend.

Configuration and weights: the policy flags show in GetModelInfo and bad values stop the start
with the model's reason; GetWeights loads into rnnd.torch.Policy (strict state_dict names and
shapes) and SetWeights from a Policy comes back exactly, through --weights files and checkpoint
restarts too. Steps: actions, log-probs and values equal what the Policy computes for the same
weights, observations and resets, with the same Philox draw (rnnd_philox.h, re-implemented
below); greedy rows take the mode; the same seed, env and step give the same action on two
daemons, and a retried step returns the same reply.
"""

import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from _common import BACKEND, daemon, rel_err, rnnd_binary, skip

try:
    import torch
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")
import rnnd  # noqa: E402
import rnnd.torch  # noqa: E402

# The model of most tests: LSTM, two layers, a two-layer tanh encoder, 3 actions and a value.
I, H, L, ENC, K = 5, 6, 2, (7, 8), 3
FLAGS = dict(input_size=I, hidden_size=H, layers=L, cell="lstm", encoder_widths="7,8",
             encoder_activation="tanh", discrete_actions=K, value_head=1, seed=11)


def policy(seed, **kw):
    torch.manual_seed(seed)
    args = dict(input_size=I, hidden_size=H, num_layers=L, cell="lstm", encoder_widths=ENC,
                encoder_activation="tanh", discrete_actions=K, value_head=True)
    args.update(kw)
    return rnnd.torch.Policy(**args)


class ConfigAndWeights(unittest.TestCase):
    def test_model_info(self):
        with daemon(**FLAGS) as d:
            info = d.client().info()
            self.assertEqual((info.encoder_widths, info.encoder_activation, info.discrete_actions,
                              info.gaussian_actions, info.value_head), (ENC, "tanh", K, 0, True))
        with daemon(input_size=I, hidden_size=H) as d:
            info = d.client().info()
            self.assertEqual((info.encoder_widths, info.encoder_activation, info.discrete_actions,
                              info.gaussian_actions, info.value_head), ((), "", 0, 0, False))

    def test_bad_policy_flags_stop_the_start(self):
        cases = [
            (["--discrete-actions", "1"], "discrete actions 1: 0 (no discrete head) or 2"),
            (["--discrete-actions", "3", "--gaussian-actions", "2"], "one action head"),
            (["--encoder-widths", "64,0"], "--encoder-widths: '64,0' is not"),
            (["--encoder-widths", "1,2,3,4,5"], "more than 4 encoder layers"),
            (["--encoder-activation", "gelu"], "--encoder-activation: 'gelu'"),
            (["--value-head", "2"], "--value-head: '2' is not 0 or 1"),
        ]
        for flags, want in cases:
            r = subprocess.run([rnnd_binary(), "--backend", "cpu"] + flags, capture_output=True,
                               text=True, timeout=30)
            self.assertNotEqual(r.returncode, 0, flags)
            self.assertIn(want, r.stderr + r.stdout, flags)

    def test_get_and_set_weights_with_policy(self):
        with daemon(**FLAGS) as d:
            c = d.client()
            got = c.get_weights()
            pi = policy(0)
            self.assertEqual(list(got), list(pi.state_dict()))  # names and order
            pi.load_weights(got)  # strict: every name and shape
            for k, v in pi.weights().items():
                np.testing.assert_array_equal(v, got[k])
            mine = policy(1)
            c.set_weights(mine.weights())
            back = c.get_weights()
            for k, v in mine.weights().items():
                np.testing.assert_array_equal(back[k], v, k)
            # A policy tensor missing is refused and changes nothing.
            partial = dict(mine.weights())
            del partial["value.bias"]
            with self.assertRaises(rnnd.RnndError) as e:
                c.set_weights(partial)
            self.assertIn("'value.bias' is missing", str(e.exception))
            np.testing.assert_array_equal(c.get_weights()["value.weight"],
                                          mine.weights()["value.weight"])

    def test_weights_file_and_checkpoint_restart(self):
        mine = policy(2, cell="gru", encoder_widths=(4,), discrete_actions=0, gaussian_actions=2)
        flags = dict(FLAGS, cell="gru", encoder_widths="4", discrete_actions=0,
                     gaussian_actions=2)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "policy.safetensors")
            with torch.no_grad():
                mine.action_log_std.uniform_(-0.5, 0.5)
            rnnd.save_safetensors(path, mine.weights())
            state = os.path.join(tmp, "state")
            os.mkdir(state)
            with daemon(state_dir=state, weights=path, **flags) as d:
                got = d.client().get_weights()
                for k, v in mine.weights().items():
                    np.testing.assert_array_equal(got[k], v, k)
                other = policy(3, cell="gru", encoder_widths=(4,), discrete_actions=0,
                               gaussian_actions=2)
                d.client().set_weights(other.weights())
            # Stopped with SIGTERM: the final checkpoint holds the policy's tensors.
            with daemon(state_dir=state, **flags) as d:
                got = d.client().get_weights()
                for k, v in other.weights().items():
                    np.testing.assert_array_equal(got[k], v, k)

    def test_forward_returns_heads_and_the_core_on_request(self):
        pi = policy(8)
        rng = np.random.default_rng(1)
        obs = rng.uniform(-1, 1, (2, 4, I)).astype(np.float32)
        is_init = np.zeros((2, 4), bool)
        is_init[1, 2] = True
        with daemon(**FLAGS) as d:
            c = d.client()
            c.set_weights(pi.weights())
            got = c.forward(obs, is_init, return_core=True)
            heads = c.forward(obs, is_init)
        ref = pi.double()(torch.from_numpy(obs).double(), torch.from_numpy(is_init))
        self.assertLess(rel_err(got.output, ref.output.detach().numpy()), 1e-4)
        self.assertIsNone(heads.output)  # a model with heads: the core output on request
        for r in (got, heads):
            self.assertLess(rel_err(r.logits, ref.logits.detach().numpy()), 1e-4)
            self.assertLess(rel_err(r.head_value, ref.value.detach().numpy()), 1e-4)
        self.assertLess(rel_err(got.h_n, ref.state[0].detach().numpy()), 1e-4)


# -- the sampler of kernels/include/rnnd_philox.h, in Python integers -------------------------

MASK = 0xFFFFFFFF


def philox(ctr, key):
    x0, x1, x2, x3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * x0, 0xCD9E8D57 * x2
        x0, x2 = (p1 >> 32) ^ x1 ^ k0, (p0 >> 32) ^ x3 ^ k1
        x1, x3 = p1 & MASK, p0 & MASK
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return [x0, x1, x2, x3]


def step_words(seed, env, step, block):
    key = philox([env & MASK, env >> 32, 0, 0], [seed & MASK, seed >> 32])[:2]
    return philox([step & MASK, step >> 32, block, 0], key)


def u01(w):
    return (w >> 8) * 2.0 ** -24


def draw_categorical(seed, env, step, logits):
    e = np.exp(logits - logits.max())
    return int(np.argmax(np.cumsum(e) > u01(step_words(seed, env, step, 0)[0]) * e.sum()))


def draw_gaussian(seed, env, step, mean, log_std):
    A, z = len(mean), np.zeros(len(mean))
    for j in range(0, A, 4):
        w = step_words(seed, env, step, j // 4)
        for p in range(2):
            if j + 2 * p < A:
                r = np.sqrt(-2.0 * np.log(1.0 - u01(w[2 * p])))
                t = 2.0 * np.pi * u01(w[2 * p + 1])
                z[j + 2 * p] = r * np.cos(t)
                if j + 2 * p + 1 < A:
                    z[j + 2 * p + 1] = r * np.sin(t)
    return mean + np.exp(log_std) * z


class Steps(unittest.TestCase):
    B, T, SEED = 4, 6, 11

    def run_steps(self, c, obs, is_init, greedy=False, first_index=100, **kw):
        """T Steps of B envs 0..B-1 (step_index first_index + t); the replies."""
        out = []
        for t in range(obs.shape[1]):
            out.append(c.step_result(np.arange(self.B), obs[:, t], is_init[:, t],
                                     step_index=np.full(self.B, first_index + t), greedy=greedy,
                                     return_logits=True, **kw))
        return out

    def inputs(self, rng):
        obs = rng.uniform(-1, 1, (self.B, self.T, I)).astype(np.float32)
        is_init = np.zeros((self.B, self.T), bool)
        is_init[:, 0] = True
        is_init[1, 3] = is_init[2, 4] = True  # resets inside the run
        return obs, is_init

    def check_against_torch(self, flags, pi):
        rng = np.random.default_rng(5)
        obs, is_init = self.inputs(rng)
        with daemon(**flags) as d:
            c = d.client()
            c.set_weights(pi.weights())
            got = self.run_steps(c, obs, is_init)
            c.end_episodes(np.arange(self.B))
            greedy = self.run_steps(c, obs, is_init, greedy=True, first_index=200)
        ref = pi.double()(torch.from_numpy(obs).double(), torch.from_numpy(is_init))
        dist = pi.distribution(ref)
        discrete = ref.logits is not None
        head = (ref.logits if discrete else ref.mean).detach().numpy()
        for t, r in enumerate(got):
            self.assertIsNone(r.output)  # the core output only with return_core
            self.assertLess(rel_err(r.logits if discrete else r.mean, head[:, t]), 1e-4)
            if ref.value is not None:
                self.assertLess(rel_err(r.value, ref.value[:, t].detach().numpy()), 1e-4)
            act = torch.from_numpy(np.asarray(r.action, np.int64 if discrete else np.float64))
            lp = dist.log_prob(act.unsqueeze(1).expand(-1, self.T, *act.shape[1:]))[:, t]
            self.assertLess(rel_err(r.log_prob, lp.detach().numpy()), 1e-4)
            for b in range(self.B):
                if discrete:
                    self.assertEqual(r.action[b], draw_categorical(self.SEED, b, 100 + t,
                                                                   head[b, t]), (b, t))
                    self.assertEqual(greedy[t].action[b], int(np.argmax(head[b, t])))
                else:
                    want = draw_gaussian(self.SEED, b, 100 + t, head[b, t],
                                         pi.action_log_std.detach().numpy())
                    self.assertLess(rel_err(r.action[b], want), 1e-4, (b, t))
                    self.assertLess(rel_err(greedy[t].action[b], head[b, t]), 1e-4)

    def test_discrete_actions_match_torch(self):
        self.check_against_torch(FLAGS, policy(4))

    def test_gaussian_actions_match_torch(self):
        pi = policy(6, cell="gru", num_layers=1, encoder_widths=(), discrete_actions=0,
                    gaussian_actions=3, value_head=False)
        with torch.no_grad():
            pi.action_log_std.uniform_(-0.5, 0.5)
        self.check_against_torch(dict(FLAGS, cell="gru", layers=1, encoder_widths="",
                                      discrete_actions=0, gaussian_actions=3, value_head=0), pi)

    def test_same_key_same_action_and_retries(self):
        rng = np.random.default_rng(7)
        obs, is_init = self.inputs(rng)
        flags = dict(FLAGS, discrete_actions=16)
        runs = []
        for seed in (3, 3, 4):
            with daemon(**dict(flags, seed=seed)) as d:
                c = d.client()
                replies = self.run_steps(c, obs, is_init, return_core=True)
                # The last step again (a lost reply): the same reply, and the env did not advance.
                again = c.step_result(np.arange(self.B), obs[:, -1], is_init[:, -1],
                                      step_index=np.full(self.B, 100 + self.T - 1),
                                      return_logits=True, return_core=True)
                for k in ("action", "log_prob", "value", "logits", "output"):
                    np.testing.assert_array_equal(getattr(again, k), getattr(replies[-1], k), k)
                # Without step_index the key is the env's own step count.
                c.end_episodes(np.arange(self.B))
                counted = [c.step_result(np.arange(self.B), obs[:, t], is_init[:, t]).action
                           for t in range(self.T)]
                runs.append((np.stack([r.action for r in replies]), np.stack(counted)))
        np.testing.assert_array_equal(runs[0][0], runs[1][0])
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        self.assertFalse(np.array_equal(runs[0][0], runs[2][0]))  # another seed, other draws

    def test_checkpoint_keeps_retry_replies_and_step_counts(self):
        rng = np.random.default_rng(9)
        obs, is_init = self.inputs(rng)
        flags = dict(FLAGS, discrete_actions=16)
        ids, B = np.arange(self.B), self.B

        def steps(c, ts):  # without step_index: keyed by each env's own step count
            return [c.step_result(ids, obs[:, t], is_init[:, t]).action for t in ts]

        def indexed(c):
            return c.step_result(ids + 100, obs[:, 0], True, step_index=np.full(B, 7),
                                 return_logits=True)

        with daemon(**flags) as d:
            straight = steps(d.client(), range(self.T))
        with tempfile.TemporaryDirectory() as state:
            with daemon(state_dir=state, **flags) as d:
                first = steps(d.client(), range(3))
                before = indexed(d.client())
            with daemon(state_dir=state, **flags) as d:  # restarted from its final checkpoint
                rest = steps(d.client(), range(3, self.T))
                again = indexed(d.client())  # a resend of step 7: the cached reply
        np.testing.assert_array_equal(np.stack(first + rest), np.stack(straight))
        for k in ("action", "log_prob", "value", "logits"):
            np.testing.assert_array_equal(getattr(again, k), getattr(before, k), k)

    def test_pool_of_policy_daemons(self):
        # Two daemons behind a Pool (envs placed by hash) answer as one: the key has no daemon
        # in it, so every env draws what it draws on a single daemon.
        rng = np.random.default_rng(3)
        obs, is_init = self.inputs(rng)
        ids = np.arange(12)
        flags = dict(FLAGS, discrete_actions=16)
        with daemon(**flags) as one, daemon(**flags) as a, daemon(**flags) as b:
            x = np.repeat(obs[:, 0], 3, 0)
            want = one.client().step_result(ids, x, True, return_logits=True)
            with rnnd.Pool([a.target, b.target]) as pool:
                self.assertGreater(len(pool.split(ids)), 1)
                got = pool.step_result(ids, x, True, return_logits=True)
        np.testing.assert_array_equal(got.action, want.action)
        for k in ("log_prob", "value", "logits"):  # other batch sizes round BLAS sums otherwise
            self.assertLess(rel_err(getattr(got, k), getattr(want, k)), 1e-5, k)
        self.assertIsNone(got.output)

    def test_recorded_actions_and_rewards(self):
        rng = np.random.default_rng(11)
        obs, is_init = self.inputs(rng)
        B, T, ids = self.B, self.T, np.arange(self.B)
        rewards = rng.uniform(-1, 1, (B, T)).astype(np.float32)
        done = np.zeros((B, T), bool)
        trunc = np.zeros((B, T), bool)
        done[1, 2] = trunc[2, 3] = True  # the steps before the resets of inputs()
        with daemon(**FLAGS) as d:
            c = d.client()
            # An env's first step reports nothing: a reward there is refused, changing nothing.
            with self.assertRaises(rnnd.RnndError) as e:
                c.step_result(ids, obs[:, 0], True, reward=np.ones(B))
            self.assertIn("FAILED_PRECONDITION", str(e.exception))
            self.assertIn("has no recorded step to take reward", str(e.exception))
            self.assertEqual(c.info().envs_active, 0)
            for bad, needle in ((dict(reward=np.ones(B - 1)), "reward has 3 values"),
                                (dict(reward=np.full(B, np.nan)), "send finite rewards")):
                with self.assertRaises(rnnd.RnndError) as e:
                    c.step_result(ids, obs[:, 0], True, **bad)
                self.assertIn(needle, str(e.exception))
            replies = []
            for t in range(T):
                prev = (dict(reward=rewards[:, t - 1], done=done[:, t - 1],
                             truncated=trunc[:, t - 1]) if t else {})
                replies.append(c.step_result(ids, obs[:, t], is_init[:, t], return_core=True,
                                             step_index=np.full(B, t), **prev))
            # The last step's reward is still to come: the window is the first T - 1 steps
            # plus it, with reward 0 for the last.
            got = c.forward_recorded(ids, T, return_core=True)
        for k in ("action", "log_prob", "value"):
            want = np.stack([getattr(r, k) for r in replies], 1)
            np.testing.assert_array_equal(getattr(got, k), want, k)
        np.testing.assert_array_equal(got.reward[:, :-1], rewards[:, :-1])
        np.testing.assert_array_equal(got.reward[:, -1], 0)
        np.testing.assert_array_equal(got.done[:, :-1], done[:, :-1])
        np.testing.assert_array_equal(got.truncated[:, :-1], trunc[:, :-1])
        # The replay runs the encoder and the core from the recorded states.
        self.assertLess(rel_err(got.output, np.stack([r.output for r in replies], 1)), 1e-5)
        with daemon(input_size=I, hidden_size=H) as d:
            with self.assertRaises(rnnd.RnndError) as e:
                d.client().step_result([1], np.zeros((1, I), np.float32), True, reward=[0.0])
            self.assertIn("INVALID_ARGUMENT", str(e.exception))
            self.assertIn("records no rewards", str(e.exception))

    def test_two_devices_answer_as_one(self):
        # --devices 0,1: Steps split by env over two engines, the policy rows merged, and a
        # recorded Forward's policy fields scattered back from both.
        if BACKEND == "cuda" and torch.cuda.device_count() < 2:
            self.skipTest("--devices 0,1 on the CUDA backend needs two GPUs")
        rng = np.random.default_rng(13)
        obs, is_init = self.inputs(rng)
        ids = np.arange(self.B)
        out = []
        for flags in (FLAGS, dict(FLAGS, devices="0,1")):
            with daemon(**flags) as d:
                c = d.client()
                steps = [c.step_result(ids, obs[:, t], is_init[:, t], step_index=np.full(self.B, t),
                                       reward=np.full(self.B, 0.5 * t) if t else None)
                         for t in range(self.T)]
                out.append((steps, c.forward_recorded(ids, self.T, return_core=True)))
                heads = c.forward_recorded(ids, self.T)  # the heads' outputs alone
                self.assertIsNone(heads.output)
                np.testing.assert_array_equal(heads.logits, out[-1][1].logits)
                if "devices" in flags:  # no policy tapes over several devices yet
                    with self.assertRaises(rnnd.RnndError) as e:
                        c.forward_recorded(ids, self.T, keep_tape=True)
                    self.assertIn("FAILED_PRECONDITION", str(e.exception))
                    self.assertIn("one device only", str(e.exception))
        (s1, f1), (s2, f2) = out
        for a, b in zip(s1, s2):
            np.testing.assert_array_equal(a.action, b.action)
            self.assertLess(rel_err(b.value, a.value), 1e-5)
        for k in ("action", "reward", "done", "truncated"):
            np.testing.assert_array_equal(getattr(f2, k), getattr(f1, k), k)
        for k in ("log_prob", "value", "output", "logits", "head_value"):
            self.assertLess(rel_err(getattr(f2, k), getattr(f1, k)), 1e-5, k)

    def test_recorded_record_survives_restart(self):
        rng = np.random.default_rng(17)
        obs, is_init = self.inputs(rng)
        ids, B = np.arange(self.B), self.B
        with tempfile.TemporaryDirectory() as state:
            with daemon(state_dir=state, **FLAGS) as d:
                c = d.client()
                for t in range(self.T):
                    c.step_result(ids, obs[:, t], is_init[:, t],
                                  reward=rng.uniform(-1, 1, B) if t else None,
                                  done=(ids == 1) if t == 3 else None)
                before = c.forward_recorded(ids, self.T, return_core=True)
            with daemon(state_dir=state, **FLAGS) as d:
                after = d.client().forward_recorded(ids, self.T, return_core=True)
        for k in ("action", "log_prob", "value", "reward", "done", "truncated", "output"):
            np.testing.assert_array_equal(getattr(after, k), getattr(before, k), k)
        self.assertTrue(before.done[1, 2] and before.reward[:, :-1].all())

    def test_reply_dtype(self):
        from rnnd._tensor import encode
        from rnnd.v1 import rnnd_pb2 as pb
        for flags, fields in ((dict(input_size=I, hidden_size=H), ("output",)),
                              (FLAGS, ("output", "log_prob", "value", "logits"))):
            with daemon(**flags) as d:
                req = pb.StepRequest(env_ids=[1], is_init=[True], reply_dtype=pb.FLOAT16,
                                     return_core=True, return_logits="log_prob" in fields)
                encode(np.zeros((1, I), np.float32), out=req.obs)
                r = d.client()._stub.Step(req)
                for f in fields:
                    t = getattr(r, f)
                    self.assertEqual(t.dtype, pb.FLOAT16, f)
                    self.assertEqual(len(t.data), 2 * int(np.prod(t.shape)), f)
                if "log_prob" in fields:
                    self.assertEqual(r.action.dtype, pb.INT64)

    def test_models_without_action_head_refuse_action_fields(self):
        for flags, needle in ((dict(input_size=I, hidden_size=H), "no heads"),
                              (dict(input_size=I, hidden_size=H, value_head=1), "no action head")):
            with daemon(**flags) as d:
                c = d.client()
                r = c.step_result([1], np.zeros((1, I), np.float32), True)
                self.assertEqual(r.output is None, "value_head" in flags)
                self.assertIsNone(r.action)
                self.assertEqual(r.value is None, "value_head" not in flags)
                for kw in (dict(greedy=True), dict(return_logits=True)):
                    with self.assertRaises(rnnd.RnndError) as e:
                        c.step_result([1], np.zeros((1, I), np.float32), **kw)
                    self.assertIn("INVALID_ARGUMENT", str(e.exception))
                    self.assertIn(needle, str(e.exception))
                # Refused requests changed nothing: the env is where the first step left it.
                self.assertEqual(c.info().envs_active, 1)


if __name__ == "__main__":
    unittest.main()
