"""Shared by the Python tests: find the daemon, skip (exit 77) when something is missing.

RNND_BIN: the rnnd binary (CTest sets it). RNND_BACKEND (default cpu) and RNND_COMPUTE (default:
what the test asks for) run the same tests on another backend, e.g. RNND_BACKEND=cuda
RNND_COMPUTE=ieee on a GPU host.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77


def skip(why):
    print("SKIP:", why)
    sys.exit(SKIP)


def rnnd_binary():
    b = os.environ.get("RNND_BIN")
    if not b or not os.access(b, os.X_OK):
        skip("no rnnd binary (RNND_BIN=%r); build the server first" % b)
    return b


BACKEND = os.environ.get("RNND_BACKEND", "cpu")


def daemon(**flags):
    import rnnd
    echo = sys.stderr if os.environ.get("RNND_ECHO") else None
    if os.environ.get("RNND_COMPUTE"):
        flags["compute"] = os.environ["RNND_COMPUTE"]
    return rnnd.Daemon(binary=rnnd_binary(), backend=BACKEND, echo=echo, **flags)


def rel_err(a, b):
    """max |a - b| / max |b| (b the reference)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, "shape %s != reference %s" % (a.shape, b.shape)
    if b.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
