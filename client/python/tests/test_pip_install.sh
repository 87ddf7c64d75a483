#!/usr/bin/env bash
# test_pip_install.sh PYTHON SRC: `pip install ./client/python` as a user would do it, offline.
# Makes a fresh virtual environment in a temporary directory (--system-site-packages, for
# Debian's grpcio, protobuf, numpy and torch) and installs SRC (client/python) into it with the
# system's setuptools and pip (--no-build-isolation --no-index: no package index is reached;
# pip --python: the environment's own pip would be the same one, after seconds of ensurepip).
# Then checks that `import rnnd` resolves to the environment's copy with its generated stubs and
# runs the client and torch tests from the temporary directory, where nothing of the repository
# is importable.
# RNND_BIN: the daemon the tests start.
set -euo pipefail
python=$1
src=$(cd "$2" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset PYTHONPATH

if ! "$python" -m venv --system-site-packages --without-pip "$tmp/venv"; then
    echo "FAIL: $python -m venv failed (Debian: apt-get install python3-venv)"
    exit 1
fi
py=$tmp/venv/bin/python
pip=("$python" -m pip --python "$py")
if ! "${pip[@]}" --version >/dev/null 2>&1; then
    "$py" -m ensurepip >/dev/null  # pip before 22.3 (Ubuntu 22.04) has no --python
    pip=("$py" -m pip)
fi
"${pip[@]}" install -q --no-build-isolation --no-index "$src"
cd "$tmp"
"$py" - <<'PY'
import os, sys
import rnnd, rnnd.torch
from rnnd.v1 import health_pb2, rnnd_pb2
for m in (rnnd, rnnd.torch, rnnd_pb2, health_pb2):
    assert m.__file__.startswith(sys.prefix + os.sep), "%s comes from %s" % (m.__name__, m.__file__)
print("import rnnd:", os.path.dirname(rnnd.__file__), rnnd.__version__)
PY
for t in client torch_module; do
    echo "== tests/test_$t.py"
    "$py" "$src/tests/test_$t.py"
done
