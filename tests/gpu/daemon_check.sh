#!/usr/bin/env bash
# daemon_check.sh: the whole daemon on a GPU host that has none of our Debian packages, from a
# bundle made here by `deploy/bundle.sh -b BUILD -o .device --tests` (BUILD configured with
# -DCMAKE_CUDA_ARCHITECTURES=90):
#   1. test_seq_cuda, test_step_cuda, test_optim_cuda (every CUDA op against the CPU reference)
#      and test_traj_cuda (the data plane's ops, bit for bit);
#   2. the integration suite against rnnd on the CUDA backend in strict fp32 (RNND_BACKEND=cuda
#      RNND_COMPUTE=ieee: the suite's tolerances are the CPU reference's; the devices suite
#      needs two GPUs and is skipped on one: tests/gpu/multi_gpu_check.sh runs it);
#   3. rnndctl bench against rnnd --backend cuda (fp32/TF32): 1 env x 1 connection (latency) and
#      64 envs x 16 connections (throughput), each next to the GetModelInfo floor, plus larger
#      requests for peak throughput.
# Usage (repository root on the GPU host): tests/gpu/daemon_check.sh [BUNDLE.tar.xz] [bench]
# (bench: only part 3, when parts 1 and 2 ran in the same session, e.g. from gpu_run.sh)
# Logs go to $OUT (default /tmp/rnnd-out); a summary is printed last.
set -u
bundle=${1:-.device/rnnd-bundle.tar.xz}
only=${2:-}
OUT=${OUT:-/tmp/rnnd-out}
mkdir -p "$OUT"
work=$(mktemp -d)
tar -C "$work" -xf "$bundle" || { echo "daemon_check: cannot unpack $bundle"; exit 1; }
R=$work/rnnd-bundle

# cuBLAS: the CUDA toolkit's, else PyTorch's pip wheel (nvidia-cublas).
libs=$R/lib
if [ -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
    libs=$libs:/usr/local/cuda/lib64
else
    site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
    d=$(find "$site/nvidia" -name libcublas.so.13 2>/dev/null | head -1)
    [ -n "$d" ] && libs=$libs:$(dirname "$d")
fi
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RNND_BIN=$R/bin/rnnd RNNDCTL_BIN=$R/bin/rnndctl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
ldd "$RNND_BIN" | grep 'not found' && exit 1

summary=()
if [ "$only" != bench ]; then
for t in test_seq_cuda test_step_cuda test_optim_cuda; do
    echo "== $t"
    timeout 200 "$R/bin/$t" >"$OUT/$t.log" 2>&1
    rc=$?
    tail -3 "$OUT/$t.log"
    summary+=("$t rc=$rc")
done

echo "== test_traj_cuda"
timeout 100 "$R/bin/test_traj_cuda" >"$OUT/test_traj_cuda.log" 2>&1
rc=$?
tail -3 "$OUT/test_traj_cuda.log"
summary+=("test_traj_cuda rc=$rc")

echo "== integration suite, RNND_BACKEND=cuda RNND_COMPUTE=ieee"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
for t in "$R"/bin/test_integration_*; do
    name=$(basename "$t")
    if [ "$name" = test_integration_devices ] && [ "$ngpu" -lt 2 ]; then
        # Its daemons run on --devices 0,1: tests/gpu/multi_gpu_check.sh runs it on two GPUs.
        echo "$name skipped: $ngpu GPU (needs 2; tests/gpu/multi_gpu_check.sh)"
        summary+=("$name skipped ($ngpu GPU)")
        continue
    fi
    (cd "$work" && RNND_BACKEND=cuda RNND_COMPUTE=ieee timeout 120 "$t") >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(grep -cE '^\[  FAILED  \] [a-z_]+$' "$OUT/$name.log") failed"
    grep -E '^\[  FAILED  \]|^\[  ERROR   \]' "$OUT/$name.log" | head -5
    summary+=("$name rc=$rc")
done
fi

echo "== rnndctl bench, rnnd --backend cuda"
state=$(mktemp -d)
"$RNND_BIN" --backend cuda --listen 127.0.0.1:0 --http 127.0.0.1:0 --state-dir "$state" \
    >"$OUT/rnnd.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
    grep -q 'rnnd ready' "$OUT/rnnd.log" && break
    sleep 0.2
done
target=$(grep -m1 -o 'grpc=[^ ]*' "$OUT/rnnd.log" | cut -d= -f2)
grep -m1 'rnnd ready' "$OUT/rnnd.log"
bench() {
    echo "-- bench $*" | tee -a "$OUT/bench.txt"
    timeout 60 "$RNNDCTL_BIN" -t "$target" bench "$@" 2>&1 | tee -a "$OUT/bench.txt"
}
bench --connections 1 --envs 1 --duration 5
bench --connections 16 --envs 64 --duration 5
bench --connections 16 --envs 1024 --duration 5 --no-floor
bench --connections 32 --envs 1024 --duration 5 --no-floor --stream
curl -s "http://$(grep -m1 -o 'http=[^ ]*' "$OUT/rnnd.log" | cut -d= -f2)/metrics" \
    >"$OUT/metrics.txt" 2>/dev/null
kill -TERM $pid
wait $pid
summary+=("rnnd exit on SIGTERM: $?")

echo "== summary"
printf '%s\n' "${summary[@]}"
