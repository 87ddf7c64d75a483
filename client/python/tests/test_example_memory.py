"""The end-to-end example, short: actors that hold no weights step freely through the daemon,
which holds the whole policy (GRU core, policy and value heads) and returns actions, and a
PyTorch learner taking cursor windows and sending dL/d logits and dL/d value must lift the
cue-recall success rate from chance (25%) to at least 80% within a minute on the CPU backend (4
cues, episodes of 3-10 steps; about 10-25 s on a loaded 2-core machine). The full run
(examples/memory_task.py, default flags: 8 cues, episodes of 4-20 steps) reaches 90% in about a
minute there."""

import os
import sys
import tempfile
import unittest

from _common import HERE, rnnd_binary, skip

try:
    import torch  # noqa: F401
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import memory_task  # noqa: E402


class ExampleTest(unittest.TestCase):
    def test_learns(self):
        binary = rnnd_binary()
        if isinstance(binary, list):
            binary = binary[-1]
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "curve.png")
            curve, reached = memory_task.main(
                ["--rnnd", binary, "--minutes", "1.0", "--target", "0.8", "--stop-at-target",
                 "--report-s", "3", "--png", png, "--seed", "1", "--cues", "4", "--min-len", "3",
                 "--max-len", "10", "--unroll", "24"])
            self.assertTrue(curve, "no progress was reported")
            first, last = curve[0][3], curve[-1][3]
            print("success: first report %.1f%%, last %.1f%%" % (100 * first, 100 * last))
            self.assertLess(first, 0.5, "the first report should be near chance (25%)")
            self.assertIsNotNone(reached, "success never reached 80%% (last %.1f%%)" % (100 * last))
            self.assertGreaterEqual(last, 0.8)
            self.assertTrue(os.path.getsize(png) > 0)


if __name__ == "__main__":
    sys.exit(not unittest.main(exit=False, verbosity=2).result.wasSuccessful())
