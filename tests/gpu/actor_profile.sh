#!/usr/bin/env bash
# actor_profile.sh: issue 42's actor loads through `rnndctl bench` against rnnd --backend cuda
# ($RNND_BACKEND to change it), each with the engine's profile per batch, from the daemon's
# /metrics read before and after:
# rows and requests a batch, the engine thread's time a batch in each phase (admit, gather, the
# backend's step with its copies and sync, update, reply), the queue delay and the unary Step's
# time in the daemon, and the share of the run the engine spent in those phases.
# Loads: 1 env x 1 connection (latency, with the GetModelInfo floor timed after the Steps, then
# beside them: --paired), 16 connections x 64 envs (unary), 32 StepStreams x 1024 envs in fp32
# and in bf16.
# Usage (repository root on the GPU host, from a bundle of deploy/bundle.sh):
#   tests/gpu/actor_profile.sh [BUNDLE.tar.xz] [RNND FLAGS...]
# With each load, the CPUs each thread name of the daemon and the bench used over two of its
# seconds. LOADS=streams runs only the 32-stream loads. Logs go to $OUT (default /tmp/rnnd-out).
set -u
bundle=${1:-.device/rnnd-bundle.tar.xz}
shift $(($# > 0 ? 1 : 0))
OUT=${OUT:-/tmp/rnnd-out}
mkdir -p "$OUT"
work=$(mktemp -d)
tar -C "$work" -xf "$bundle" || { echo "actor_profile: cannot unpack $bundle"; exit 1; }
R=$work/rnnd-bundle
libs=$R/lib
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
d=$(find /usr/local/cuda/lib64 "$site/nvidia" -name libcublas.so.13 2>/dev/null | head -1)
[ -n "$d" ] && libs=$libs:$(dirname "$d")
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

"$R/bin/rnnd" --backend "${RNND_BACKEND:-cuda}" --listen 127.0.0.1:0 --http 127.0.0.1:0 \
    --state-dir "$work/state" "$@" >"$OUT/rnnd.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
    grep -q 'rnnd ready' "$OUT/rnnd.log" && break
    sleep 0.2
done
grpc=$(grep -m1 -o 'grpc=[^ ]*' "$OUT/rnnd.log" | cut -d= -f2)
http=$(grep -m1 -o 'http=[^ ]*' "$OUT/rnnd.log" | cut -d= -f2)
echo "rnnd --backend ${RNND_BACKEND:-cuda} $* on" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)," "$(nproc) CPUs"

profile() { # the /metrics of before and after, and the seconds between
    python3 - "$1" "$2" "$3" <<'PY'
import sys

def load(path):
    d = {}
    for line in open(path):
        if line.strip() and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            d[k] = float(v)
    return d

a, b, secs = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
g = lambda k: b.get(k, 0.0) - a.get(k, 0.0)
nb, rows = g("rnnd_batch_rows_count"), g("rnnd_batch_rows_sum")
if nb == 0:
    sys.exit(print("  no batches"))
phase = lambda p: g('rnnd_engine_seconds_total{phase="%s"}' % p)
step = g('rnnd_backend_kernel_seconds_total{op="step"}')
reqs = g("rnnd_step_queue_delay_seconds_count")
unary = g('rnnd_request_duration_seconds_count{method="Step"}')
print("  %d batches, %.1f rows and %.2f requests a batch; a batch's us: admit %.1f, gather "
      "%.1f, step (backend) %.1f, update %.1f, reply %.1f; queue delay %.1f us; unary Step in "
      "the daemon %.1f us; engine busy %.0f%% of %.1f s" % (
          nb, rows / nb, reqs / nb, phase("admit") / nb * 1e6, phase("gather") / nb * 1e6,
          step / nb * 1e6,
          phase("update") / nb * 1e6, phase("reply") / nb * 1e6,
          g("rnnd_step_queue_delay_seconds_sum") / max(reqs, 1) * 1e6,
          g('rnnd_request_duration_seconds_sum{method="Step"}') / max(unary, 1) * 1e6,
          100 * (phase("admit") + phase("gather") + step + phase("update") + phase("reply")) /
          secs, secs))
PY
}

# CPU seconds a second of each thread name (/proc/PID/task/*/stat) in the processes PIDS between
# two snapshots: where the host's CPUs go.
threads() { # OUTFILE PID...
    local f=$1
    shift
    for p in "$@"; do
        for t in /proc/$p/task/*; do
            # comm may hold spaces: take it from between the parentheses.
            sed -E 's/^[0-9]+ \((.*)\) [A-Za-z] (.*)$/\1|\2/' "$t/stat" 2>/dev/null |
                awk -F'|' -v p="$p" '{split($2, a, " "); print p "|" $1 "|" a[11] + a[12]}'
        done
    done >"$f"
}
thread_table() { # BEFORE AFTER SECONDS
    python3 - "$1" "$2" "$3" "$(getconf CLK_TCK)" <<'PY'
import collections, sys
def load(path):
    d = collections.Counter()
    for line in open(path):
        pid, name, ticks = line.rstrip("\n").rsplit("|", 2)
        d[(pid, name)] += int(ticks)
    return d
a, b, secs, hz = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
rows = collections.Counter()
for k in b:
    rows[k] += b[k] - a.get(k, 0)
total = sum(rows.values()) / hz / secs
print("  CPUs busy by thread name (pid: name cpus), %.1f in all:" % total)
for (pid, name), t in sorted(rows.items(), key=lambda kv: -kv[1]):
    if t / hz / secs >= 0.05:
        print("    %s: %-16s %.2f" % (pid, name, t / hz / secs))
PY
}

bench() {
    echo "-- $*" | tee -a "$OUT/actor_profile.txt"
    curl -s "http://$http/metrics" >"$OUT/m0"
    t0=$(date +%s.%N)
    "$R/bin/rnndctl" -t "$grpc" bench "$@" --duration 4 >"$OUT/bench.out" 2>&1 &
    local bp=$!
    # A window inside the measured seconds (the bench warms up for 1 s by default).
    sleep 2
    threads "$OUT/c0" $pid $bp
    local w0=$(date +%s.%N)
    sleep 2
    threads "$OUT/c1" $pid $bp
    local w1=$(date +%s.%N)
    wait $bp
    grep -E '^Step|^GetModelInfo' "$OUT/bench.out" | sed 's/^/  /' | tee -a "$OUT/actor_profile.txt"
    t1=$(date +%s.%N)
    curl -s "http://$http/metrics" >"$OUT/m1"
    profile "$OUT/m0" "$OUT/m1" "$(python3 -c "print($t1 - $t0)")" | tee -a "$OUT/actor_profile.txt"
    thread_table "$OUT/c0" "$OUT/c1" "$(python3 -c "print($w1 - $w0)")" | tee -a "$OUT/actor_profile.txt"
}
if [ -z "${LOADS:-}" ]; then
    bench --connections 1 --envs 1
    bench --connections 1 --envs 1 --paired
    bench --connections 16 --envs 64 --no-floor
fi
bench --connections 32 --envs 1024 --no-floor --stream
bench --connections 32 --envs 1024 --no-floor --stream --dtype bfloat16
kill -TERM $pid
wait $pid
