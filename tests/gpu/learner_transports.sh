#!/usr/bin/env bash
# learner_transports.sh: the learner of issue 42's table (B=2048 T=64 I=64 H=128 GRU, 1% resets)
# through each transport on a GPU host, beside PyTorch in the same process, from a bundle made
# by `deploy/bundle.sh -b BUILD -o .device --tests` and the Python wheel beside it
# (`pip wheel --no-deps -w .device ./client/python`):
#   1. python_sock with CUDA tensors (socket regions bit for bit against the bytes path) and
#      test_integration_shm on the CUDA backend;
#   2. the loopback floor: 33.5 MB over a plain socket and inside grpcio messages;
#   3. learner_bench.py, bf16 then fp32 on the wire, rows socket (the learner as if on another
#      host: tensors beside gRPC, over 4 data connections and over 1), grpc (inside the
#      messages) and cuda (in place), twice each for socket, then PyTorch cuDNN and the
#      per-step loop.
# Usage (repository root on the GPU host): tests/gpu/learner_transports.sh [BUNDLE.tar.xz] [WHEEL]
# Logs go to $OUT (default /tmp/rnnd-out).
set -u
bundle=${1:-.device/rnnd-bundle.tar.xz}
wheel=${2:-$(ls .device/rnnd-*.whl | head -1)}
OUT=${OUT:-/tmp/rnnd-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$PWD
work=$(mktemp -d)
tar -C "$work" -xf "$bundle" || { echo "learner_transports: cannot unpack $bundle"; exit 1; }
R=$work/rnnd-bundle
python3 -m pip install -q --no-deps --target "$work/site" "$wheel" || exit 1
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
libs=$R/lib
for lib in libcublas.so.13 libcudnn.so.9; do
    d=$(find "$site/nvidia" -name "$lib" 2>/dev/null | head -1)
    [ -n "$d" ] && libs=$libs:$(dirname "$d")
done
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$work/site
export RNND_BIN=$R/bin/rnnd RNNDCTL_BIN=$R/bin/rnndctl RNND_CLIENT_LIB=$R/lib/librnnd_client.so

echo "== python_sock (CUDA tensors), test_integration_shm (CUDA backend)"
(cd client/python/tests && RNND_BACKEND=cuda timeout 120 python3 test_sock.py) \
    >"$OUT/test_sock.log" 2>&1
echo "python_sock rc=$? $(tail -1 "$OUT/test_sock.log")"
(cd "$work" && RNND_BACKEND=cuda timeout 120 "$R/bin/test_integration_shm") >"$OUT/shm.log" 2>&1
echo "test_integration_shm rc=$? $(grep -cE '^\[       OK \]' "$OUT/shm.log") ok"

echo "== loopback floor, 33.5 MB"
timeout 120 python3 -c "
import sys; sys.argv = ['x', '127.0.0.1:1']
src = open('$root/tests/gpu/transport_floor.py').read()
exec(compile(src[:src.index('target = sys.argv[1]')], 'transport_floor', 'exec'))" 2>&1 |
    tee "$OUT/floor.txt"

for wire in bfloat16 float32; do
    echo "== learner, $wire on the wire"
    timeout 300 python3 client/python/examples/learner_bench.py --rnnd "$RNND_BIN" \
        --backend cuda --device cuda -B 2048 -T 64 --iters 15 --warmup 3 --wire $wire \
        --grads apply --transports socket,socket:1,grpc,cuda,socket,socket:1 2>&1 | tee "$OUT/learner_$wire.txt" |
        grep -E '^rnnd|^PyTorch'
done
