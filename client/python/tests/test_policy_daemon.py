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

from _common import daemon, rel_err, rnnd_binary, skip

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

    def test_learner_calls_refused_on_policy_models(self):
        with daemon(**FLAGS) as d:
            with self.assertRaises(rnnd.RnndError) as e:
                d.client().forward(np.zeros((1, 2, I), np.float32))
            self.assertIn("FAILED_PRECONDITION", str(e.exception))
            self.assertIn("does not run policy models", str(e.exception))


if __name__ == "__main__":
    unittest.main()
