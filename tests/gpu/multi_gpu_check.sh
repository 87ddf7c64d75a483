#!/usr/bin/env bash
# multi_gpu_check.sh: several GPUs in one rnnd (--devices) and two rnnd as two hosts
# (--world-size 2), on a host with two or more GPUs, from a bundle made here by
# `deploy/bundle.sh -b BUILD -o .device --tests` (BUILD configured with -DCMAKE_CUDA_ARCHITECTURES=90
# on a machine with nccl.h; NCCL itself comes from this host: the CUDA toolkit's or PyTorch's
# nvidia-nccl wheel):
#   1. test_integration_devices on --devices 0,1, strict fp32 against the CPU reference:
#      bit-identical replicas (GetWeights compares the devices, per-device checkpoints compared
#      byte for byte), restart and 1 -> 2 device restore; then, alone and under a watchdog
#      (TWO_DAEMONS_S, default 120 s), two daemons (rank 0 on GPU 0, rank 1 on GPU 1) staying in
#      sync and rank 0 leaving when rank 1 stops: when it hangs, the watchdog prints the test's
#      last step, the daemons' threads (stacks with gdb or eu-stack) and their log tails, and
#      the daemons' state dirs (their logs) go into the archive either way;
#   2. every integration suite with every daemon on --devices 0,1 but weights, ops and
#      checkpoints (which check one device's specifics): the CPU reference still holds, and a
#      request refused on one GPU changes nothing on the other;
#   3. the time of a learner step (Forward + Backward + ApplyGradients, B=2048 T=64 GRU H=128,
#      fp32/TF32) on 1 and 2 GPUs: the C harness's, and the Python learner benchmark's
#      (client/python/examples/learner_bench.py, the bundle's py/) with bf16 on the wire through
#      socket regions (the learner as on another host) and shared memory, two rounds each;
#   4. rnndctl bench throughput on 1 and 2 GPUs (32 connections x 64 envs; 32 streams of 1024
#      envs, two rounds in fp32 and one in bf16), the two GPUs with --place-block set to the envs
#      of a request (each request on one device), and once with envs placed by hash (each
#      request split over both);
#   5. the one-GPU integration suite (everything as before on --devices unset), time permitting.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0): it can take a shared host's GPUs out of service.
# Usage (repository root on the GPU host): tests/gpu/multi_gpu_check.sh [BUNDLE.tar.xz]
# The console log goes to $OUT/multi_gpu.log, every other log into $OUT/logs.tar.gz (the device
# tool brings back few files); default OUT /tmp/rnnd-out. A table is printed last. BUDGET_S
# (default 330) stops starting new sections when the time is nearly up. BACKEND=cpu dry-runs the script anywhere
# (two CPU engines; the two-daemon test on two CPU daemons, as in make test).
set -u
BACKEND=${BACKEND:-cuda}
cluster='RNND_TEST_CLUSTER_DEVICES=0;1'
[ "$BACKEND" = cuda ] || cluster=RNND_TEST_CLUSTER_DEVICES=
export NCCL_NVLS_ENABLE=0 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=${NCCL_DEBUG:-WARN}
t_start=$(date +%s)
budget=${BUDGET_S:-330}
left() { echo $((budget - ($(date +%s) - t_start))); }
bundle=${1:-.device/rnnd-bundle.tar.xz}
OUT=${OUT:-/tmp/rnnd-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/multi_gpu.log") 2>&1
LOGS=$(mktemp -d)
trap 'tar -C "$LOGS" -czf "$OUT/logs.tar.gz" .' EXIT
work=$(mktemp -d)
tar -C "$work" -xf "$bundle" || { echo "multi_gpu_check: cannot unpack $bundle"; exit 1; }
R=$work/rnnd-bundle
cat .device/bundle.commit 2>/dev/null | head -1 | sed 's/^/bundle built from /'

# cuBLAS and NCCL: the CUDA toolkit's, else PyTorch's pip wheels.
libs=$R/lib
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
for lib in libcublas.so.13 libnccl.so.2; do
    d=$(ls /usr/local/cuda/lib64/$lib 2>/dev/null || find "$site/nvidia" -name "$lib" 2>/dev/null | head -1)
    [ -n "$d" ] && libs=$libs:$(dirname "$d")
    [ "$lib" = libnccl.so.2 ] && [ -n "$d" ] && export RNND_NCCL_LIBRARY=$d
done
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RNND_BIN=$R/bin/rnnd RNNDCTL_BIN=$R/bin/rnndctl
echo "NCCL: ${RNND_NCCL_LIBRARY:-not found}"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
ldd "$RNND_BIN" | grep 'not found' && exit 1

declare -A res
run_test() { # name timeout env... -- binary
    local name=$1 to=$2
    shift 2
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    if [ "$(left)" -lt "$to" ]; then res[$name]="not run (time)"; echo "== $name: not run (time)"; return; fi
    echo "== $name"
    (cd "$work" && env "${envs[@]}" timeout "$to" "$@") >"$LOGS/$name.log" 2>&1
    local rc=$?
    local ok failed
    ok=$(grep -cE '^\[       OK \]' "$LOGS/$name.log")
    failed=$(grep -cE '^\[  FAILED  \] [a-z_]+$' "$LOGS/$name.log")
    res[$name]="rc=$rc ok=$ok failed=$failed"
    echo "${res[$name]}"
    grep -E '^\[  FAILED  \]|^\[  ERROR   \]|^\[  SKIPPED \] [a-z]|mismatch|devices:' "$LOGS/$name.log" | head -12
}

# Where a process is: every thread's stack (gdb, else eu-stack), else each thread's name and the
# kernel function it waits in.
where() { # pid
    echo "-- pid $1: $(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | cut -c1-160)"
    if command -v gdb >/dev/null; then
        timeout 30 gdb -p "$1" -batch -nx -ex 'thread apply all bt' 2>&1 | grep -E '^Thread|^#'
    elif command -v eu-stack >/dev/null; then
        timeout 30 eu-stack -p "$1" 2>&1
    else
        for t in /proc/"$1"/task/*; do
            echo "   thread $(basename "$t") $(cat "$t/comm" 2>/dev/null): $(cat "$t/wchan" 2>/dev/null)"
        done
    fi
}

# The two-daemon test alone, under a watchdog that says where it was if it hangs; the daemons'
# state dirs (RNND_TEST_KEEP=1: their rnnd.log) go into the archive.
two_daemons() { # timeout
    local to=$1 log=$LOGS/two_daemons.log
    if [ "$(left)" -lt "$to" ]; then res[two_daemons]="not run (time)"; echo "== two_daemons: not run (time)"; return; fi
    echo "== two_daemons"
    (cd "$work" && exec env RNND_BACKEND=$BACKEND RNND_COMPUTE=ieee RNND_TEST_DEVICES=0,1 \
        "$cluster" RNND_TEST_KEEP=1 'RNND_TEST_FILTER=*two_daemons' \
        "$B/test_integration_devices") >"$log" 2>&1 &
    local pid=$! waited=0 hung=""
    while kill -0 $pid 2>/dev/null && [ $waited -lt "$to" ]; do sleep 1; waited=$((waited + 1)); done
    if kill -0 $pid 2>/dev/null; then
        hung=" (hung: killed after $to s)"
        {
            echo "== watchdog: still running after $to s; the test's last step:"
            grep '^two daemons' "$log" | tail -1
            for p in $pid $(ps -o pid= --ppid $pid); do where "$p"; done
        } >"$LOGS/two_daemons_where.txt" 2>&1
        cat "$LOGS/two_daemons_where.txt"
        kill -TERM $pid
        sleep 2
        kill -KILL $pid 2>/dev/null
    fi
    wait $pid
    local rc=$?
    res[two_daemons]="rc=$rc ok=$(grep -cE '^\[       OK \]' "$log") skipped=$(grep -cE '^\[  SKIPPED \]' "$log")$hung"
    echo "${res[two_daemons]}"
    grep -E '^two daemons|^\[  FAILED  \]|^\[  ERROR   \]|^\[  SKIPPED \]' "$log" | tail -12
    local d
    for d in $(grep '^two daemons' "$log" | grep -o ' in /[^ ,;]*rnnd-it-[^ ,;]*' | cut -c5-); do
        [ -d "$d" ] || continue
        mkdir -p "$LOGS/two_daemons"
        cp -r "$d" "$LOGS/two_daemons/" && rm -rf "$d"
        if [ -n "$hung" ]; then
            echo "-- $(basename "$d")/rnnd.log, last lines"
            tail -n 15 "$LOGS/two_daemons/$(basename "$d")/rnnd.log"
        fi
    done
}

B=$R/bin
# 1. replicas, placement; then two daemons
run_test devices 150 RNND_BACKEND=$BACKEND RNND_COMPUTE=ieee RNND_TEST_DEVICES=0,1 -- \
    "$B/test_integration_devices"
two_daemons "${TWO_DAEMONS_S:-120}"
# 3. learner step timing (before the long suites, on a quiet machine)
run_test learner_timing 90 RNND_BACKEND=$BACKEND RNND_COMPUTE=fp32 RNND_TEST_DEVICES=0,1 \
    RNND_TEST_TIMING=1 'RNND_TEST_FILTER=*timing' -- "$B/test_integration_devices"
grep '^learner_step' "$LOGS/learner_timing.log"
# The Python learner, bf16 wire, on 1 and 2 GPUs: the bundle's package (py/, with the C client
# from lib/), socket regions and shared memory, two rounds each; on 1 GPU also CUDA regions (one
# device alone) and PyTorch's cuDNN and per-step loop in the same process.
if [ "$BACKEND" = cuda ] && [ -d "$R/py" ] && [ "$(left)" -gt 120 ]; then
    for devs in 0 0,1; do
        if [ "$devs" = 0 ]; then more=(--transports socket,shm,cuda,socket,shm,cuda); else
            more=(--transports socket,shm,socket,shm --no-torch); fi
        echo "-- learner_bench devices=$devs" | tee -a "$LOGS/learner_bench.txt"
        PYTHONPATH=$R/py RNND_CLIENT_LIB=$R/lib/librnnd_client.so timeout 150 python3 \
            client/python/examples/learner_bench.py --rnnd "$RNND_BIN" --backend cuda \
            --devices $devs --device cuda -B 2048 -T 64 --wire bfloat16 --iters 15 --warmup 3 \
            "${more[@]}" 2>&1 | grep -vE '^\s*$' | tee -a "$LOGS/learner_bench.txt"
        for tr in socket shm; do
            res[learner_py_${tr}_$devs]=$(sed -n "/devices=$devs\$/,/^-- /p" "$LOGS/learner_bench.txt" |
                grep "^rnnd $tr" | grep -o '[0-9.]* ms (min' | cut -d' ' -f1 | paste -sd/)
        done
    done
fi

# 4. bench: rnnd on 1 and 2 GPUs
bench_on() { # devices label args... (the daemon's extra flags in $DARGS)
    local devs=$1 label=$2
    shift 2
    if [ "$(left)" -lt 25 ]; then res[bench_$label]="not run (time)"; return; fi
    local state dlog pid target
    state=$(mktemp -d)
    dlog=$LOGS/rnnd_bench_$label.log
    "$RNND_BIN" --backend "$BACKEND" --devices "$devs" --listen 127.0.0.1:0 --http off \
        --state-dir "$state" ${DARGS:-} >"$dlog" 2>&1 &
    pid=$!
    for _ in $(seq 150); do grep -q 'rnnd ready' "$dlog" && break; sleep 0.1; done
    target=$(grep -m1 -o 'grpc=[^ ]*' "$dlog" | cut -d= -f2)
    echo "-- bench devices=$devs ${DARGS:-} | $*" | tee -a "$LOGS/bench.txt"
    timeout 40 "$RNNDCTL_BIN" -t "$target" bench "$@" --no-floor 2>&1 | tee -a "$LOGS/bench.txt" \
        >"$LOGS/bench_$label.txt"
    res[bench_$label]=$(grep -m1 '^Step ' "$LOGS/bench_$label.txt" | tr -s ' ' | cut -d' ' -f2-9)
    kill -TERM $pid
    wait $pid
}
# rnndctl numbers its envs from 2^30, a multiple of every block here.
bench_on 0 1gpu_c32e64 --connections 32 --envs 64 --duration 5
DARGS="--place-block 64" bench_on 0,1 2gpu_c32e64 --connections 32 --envs 64 --duration 5
for round in a b; do
    bench_on 0 1gpu_c32e1024s_$round --connections 32 --envs 1024 --duration 5 --stream
    DARGS="--place-block 1024" bench_on 0,1 2gpu_c32e1024s_$round --connections 32 --envs 1024 \
        --duration 5 --stream
done
bench_on 0,1 2gpu_c32e1024s_hash --connections 32 --envs 1024 --duration 5 --stream
bench_on 0 1gpu_c32e1024s_bf16 --connections 32 --envs 1024 --duration 5 --stream --dtype bfloat16
DARGS="--place-block 1024" bench_on 0,1 2gpu_c32e1024s_bf16 --connections 32 --envs 1024 \
    --duration 5 --stream --dtype bfloat16

# 2. the suites on two devices
# (weights, ops and checkpoints check one device's specifics: the queue bound per device, the
# checkpoints' paths; test_integration_devices covers checkpoints on two devices.)
suites2="step learner concurrency errors shm http bounds tls"
for t in $suites2; do
    run_test ${t}_2gpu 90 RNND_BACKEND=$BACKEND RNND_COMPUTE=ieee RNND_DEVICES=0,1 -- \
        "$B/test_integration_$t"
done
# 5. the one-GPU suite, as before
for t in step learner errors weights ops concurrency tls; do
    run_test ${t}_1gpu 60 RNND_BACKEND=$BACKEND RNND_COMPUTE=ieee -- "$B/test_integration_$t"
done

echo "== summary ($(($(date +%s) - t_start)) s)"
printf '%-22s %s\n' check result
for k in devices two_daemons learner_timing; do printf '%-22s %s\n' "$k" "${res[$k]:-?}"; done
for t in $suites2; do printf '%-22s %s\n' "${t}_2gpu" "${res[${t}_2gpu]:-?}"; done
for t in step learner errors weights ops concurrency tls; do
    printf '%-22s %s\n' "${t}_1gpu" "${res[${t}_1gpu]:-?}"
done
for k in c32e64 c32e1024s_a c32e1024s_b c32e1024s_bf16; do
    printf '%-22s %-52s | %s\n' "bench $k" "1 GPU ${res[bench_1gpu_$k]:-?}" "2 GPUs ${res[bench_2gpu_$k]:-?}"
done
printf '%-22s %s\n' "bench c32e1024s_hash" "2 GPUs, envs placed by hash: ${res[bench_2gpu_c32e1024s_hash]:-?}"
for tr in socket shm; do
    printf '%-22s %s\n' "learner py bf16 $tr" "1 GPU ${res[learner_py_${tr}_0]:-?} ms | 2 GPUs ${res[learner_py_${tr}_0,1]:-?} ms"
done
grep '^learner_step' "$LOGS/learner_timing.log" 2>/dev/null | sed 's/ (median.*; / (/'
