#!/usr/bin/env bash
# gpu_run.sh: the whole GPU session of the CUDA backend, in two halves.
#
#   kernels/bench/gpu_run.sh bundle     (on the build machine, from the repository root)
#       Builds everything for sm_90 into build-dev/ and packs it with deploy/bundle.sh --tests into
#       .device/rnnd-bundle.tar.xz (git-ignored; name it in the device tool's carry list). The
#       same bundle serves tests/gpu/daemon_check.sh. PHASE_CLOCKS=1 builds the time loops'
#       phase-clock instances (RNND_CUDA_PHASE_CLOCKS; variant bit 8 asks for them).
#   kernels/bench/gpu_run.sh run [test|sanitize|bench|all]...   (on the GPU host, repository root)
#       Unpacks the bundle, finds libcublas/libcudnn (CUDA toolkit or PyTorch's pip wheels), then:
#       test      test_seq_cuda, test_step_cuda, test_optim_cuda: every op against the CPU
#                 reference;
#       sanitize  compute-sanitizer memcheck over test_seq_cuda --quick and test_step_cuda --quick;
#       race      compute-sanitizer memcheck, racecheck and synccheck over one small bench run
#                 (GRU and LSTM, TF32, B=40 T=9: every loop of a forward, a forward with tape and
#                 a backward); with RNND_CUDA_VARIANT=4096 the GRU runs the KP loop, whose
#                 bar.arrive hand-over racecheck misreports (docs/kernels.md) (not in all);
#       bench     rnnd-kernel-bench --backend cuda at the issue's shapes (ours and cuDNN; LSTM
#                 also at H=256);
#       profile   ncu metrics of one GRU and one LSTM forward+backward, SASS (not in all);
#       variants  the variants under trial, VARIANTS_GRU / VARIANTS_LSTM (not in all);
#       h256      LSTM H=256 at B=384, 1920 (one wave of clusters on an H100) and 2048, with
#                 each of VARIANTS_H256 (default "0 256": the cluster backward on / off) (not
#                 in all);
#       rows      rnnd-kernel-bench at issue 45's rows (GRU H=64, H=256, two layers, LSTM two
#                 layers, H=512, H=1024), fp32 at resets 0 / 0.01 / 0.1 and bf16, with cuDNN
#                 (not in all); ROW_ARGS replaces the rows (';'-separated), each run with every
#                 variant of VARIANTS_ROWS in turn (default 0);
#       step      rnnd-kernel-bench --op step at issue 8's single-step shapes, then
#                 torch_step_bench.py (PyTorch GRUCell/LSTMCell + index ops, CUDA graph) at the
#                 same shapes (not in all); OLD_BENCH names a bench binary of an older step
#                 kernel to time beside it, PROFILE_STEP=1 adds ncu metrics of the step
#                 kernels, NO_TORCH=1 leaves out PyTorch, STEP_ARGS replaces the cases (bench
#                 arguments, ';'-separated);
#       all       test, sanitize and bench (the default).
#       Logs and bench JSON lines go to $OUT (default /tmp/rnnd-out); a short table is printed last.
#       FP32_ONLY=1 leaves out the bf16 and ieee bench cases, NO_IEEE=1 the ieee ones (the slow
#       per-step path), NO_H256=1 the H=256 ones; REPEAT sets the bench's repeats; TEST_VARIANTS
#       runs the GPU tests again with each of these variant bits (RNND_CUDA_VARIANT,
#       kernels/cuda/tuning.h);
#       BUNDLE names another bundle (default .device/rnnd-bundle.tar.xz; any tar that tar -xf reads).
set -u
HERE=$(cd "$(dirname "$0")" && pwd) # torch_step_bench.py lies beside this script
cd "$(dirname "$0")/../.."
MODE=${1:-run}
shift || true

if [ "$MODE" = bundle ]; then
    # One bundle for every GPU script (this one and tests/gpu/daemon_check.sh): the whole build
    # for sm_90 with its non-system libraries, OpenBLAS included (the GPU host has none).
    set -e
    cmake --fresh -S . -B build-dev -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
        -DRNND_CUDA_PHASE_CLOCKS="$([ -n "${PHASE_CLOCKS:-}" ] && echo ON || echo OFF)" >/dev/null
    cmake --build build-dev -j"$(nproc)"
    deploy/bundle.sh -b build-dev -o .device --tests
    rm -rf .device/rnnd-bundle
    { git rev-parse HEAD; git status --short kernels tests; } >.device/bundle.commit
    exit 0
fi

OUT=${OUT:-/tmp/rnnd-out}
mkdir -p "$OUT"
: >"$OUT/bench.jsonl"
W=/tmp/rnnd-bundle
rm -rf "$W"
mkdir -p "$W"
BUNDLE=${BUNDLE:-.device/rnnd-bundle.tar.xz}
tar -C "$W" -xf "$BUNDLE" || { echo "no bundle: run gpu_run.sh bundle first"; exit 1; }
BIN=$W/rnnd-bundle/bin
cat "$(dirname "$BUNDLE")/bundle.commit" 2>/dev/null | head -1 | sed 's/^/bundle built from /'

# Libraries: the toolkit's, else PyTorch's wheels (nvidia-cublas, nvidia-cudnn-cu13).
LIBS=$W/rnnd-bundle/lib:/usr/local/cuda/lib64
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
for lib in libcublas.so.13 libcudnn.so.9; do
    d=$(find /usr/local/cuda/lib64/ -maxdepth 1 -name "$lib" 2>/dev/null | head -1)
    [ -n "$d" ] && continue
    d=$(find "$SITE/nvidia" -name "$lib" 2>/dev/null | head -1)
    [ -n "$d" ] && LIBS=$LIBS:$(dirname "$d")
done
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd "$BIN/rnnd-kernel-bench" | grep -E 'cublas|cudnn|not found'
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv | tee "$OUT/gpu.txt"

STEPS=${*:-all}
has() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }

GPU_TESTS="test_seq_cuda test_step_cuda test_optim_cuda"
if has test; then
    : >"$OUT/test.log"
    for t in $GPU_TESTS; do
        echo "== $t"
        timeout 150 "$BIN/$t" >>"$OUT/test.log" 2>&1
        echo "$t rc=$?" | tee -a "$OUT/test.log"
    done
    grep -E 'FAIL|checks' "$OUT/test.log" | head -40
    for v in ${TEST_VARIANTS:-}; do
        for t in $GPU_TESTS; do
            RNND_CUDA_VARIANT=$v timeout 150 "$BIN/$t" >>"$OUT/test_v$v.log" 2>&1
            echo "$t variant $v rc=$?" | tee -a "$OUT/test_v$v.log"
        done
        grep -E 'FAIL|checks' "$OUT/test_v$v.log" | head -20
    done
fi

if has sanitize; then
    echo "== compute-sanitizer memcheck (test_seq_cuda --quick, test_step_cuda --quick)"
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    : >"$OUT/sanitizer.log"
    for t in test_seq_cuda test_step_cuda; do
        timeout 120 "$CS" --tool memcheck "$BIN/$t" --quick >>"$OUT/sanitizer.log" 2>&1
        echo "sanitizer $t rc=$?" | tee -a "$OUT/sanitizer.log"
    done
    grep -E 'ERROR SUMMARY|FAIL|checks|Invalid' "$OUT/sanitizer.log" | head -20
fi

if [[ " $STEPS " == *" race "* ]]; then
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for tool in memcheck racecheck synccheck; do
        for cell in gru lstm; do
            echo "== compute-sanitizer $tool ($cell bench, B=40 T=9)"
            RNND_BENCH_NO_CUDNN=1 timeout 200 "$CS" --tool $tool "$BIN/rnnd-kernel-bench" \
                --backend cuda --cell $cell --batch 40 --steps 9 --input 64 --hidden 128 \
                --warmup 0 --repeat 1 >"$OUT/${tool}_$cell.log" 2>&1
            echo "$tool $cell rc=$?" | tee -a "$OUT/${tool}_$cell.log"
            grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/${tool}_$cell.log"
        done
    done
fi

BENCH="$BIN/rnnd-kernel-bench --backend cuda --batch 2048 --steps 256 --input 64 --hidden 128 \
--layers 1 --warmup 3 --repeat ${REPEAT:-15}"
if has bench; then
    echo "== bench"
    : >"$OUT/bench.log"
    timeout 180 $BENCH --cell gru,lstm --compute fp32 --reset-prob 0,0.01,0.1 >>"$OUT/bench.log" 2>&1
    echo "bench fp32 rc=$?" | tee -a "$OUT/bench.log"
    if [ -z "${NO_H256:-}" ]; then
        # The issue's wide row: LSTM H=256 (W_hh does not fit one SM's shared memory).
        timeout 150 ${BENCH/--hidden 128/--hidden 256} --repeat 5 --cell lstm --compute fp32 \
            --reset-prob 0,0.01,0.1 >>"$OUT/bench.log" 2>&1
        echo "bench fp32 H=256 rc=$?" | tee -a "$OUT/bench.log"
    fi
    if [ -z "${FP32_ONLY:-}" ]; then
        timeout 100 $BENCH --cell gru,lstm --compute bf16 --reset-prob 0,0.01,0.1 >>"$OUT/bench.log" 2>&1
        echo "bench bf16 rc=$?" | tee -a "$OUT/bench.log"
    fi
    if [ -z "${FP32_ONLY:-}" ] && [ -z "${NO_IEEE:-}" ]; then
        timeout 70 $BENCH --cell gru,lstm --compute ieee --reset-prob 0 --repeat 5 >>"$OUT/bench.log" 2>&1
        echo "bench ieee rc=$?" | tee -a "$OUT/bench.log"
    fi
    grep '^{' "$OUT/bench.log" >>"$OUT/bench.jsonl"
fi


if [[ " $STEPS " == *" profile "* ]]; then
    # Per-kernel view of one validation forward+backward (the first kernels the bench launches):
    # durations, DRAM share, instructions, shared-memory wavefronts and the warp stall reasons.
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for cell in ${PROFILE_CELLS:-gru lstm}; do
        echo "== ncu $cell"
        timeout 120 "$NCU" --clock-control none --kernel-name regex:seq_ --launch-count 2 \
            --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__cycles_active.avg,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
            $BIN/rnnd-kernel-bench --backend cuda --cell $cell --batch 2048 --steps 256 --input 64 \
            --hidden 128 --reset-prob 0.1 --warmup 0 --repeat 1 >"$OUT/ncu_$cell.txt" 2>&1
        echo "ncu $cell rc=$?"
        grep -E 'seq_|duration|dram__|inst_executed|cycles_active|shared|stalled' "$OUT/ncu_$cell.txt" \
            | awk '$NF+0 > 0.05 || /seq_/' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -60
    done
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    for f in _Z18seq_forward_kernelI8cell_gru9mode_tf32Li128ELb1ELb1ELi0EEv16persist_fwd_args \
             _Z19seq_backward_kernelI8cell_gru9mode_tf32Li128ELb1ELi0ELb1EEv16persist_bwd_args; do
        "$CUOBJ" -sass -fun "$f" "$BIN/rnnd-kernel-bench" >"$OUT/sass_${f:4:12}.txt" 2>&1
        echo "sass $f: $(wc -l <"$OUT/sass_${f:4:12}.txt") lines"
    done
fi

if [[ " $STEPS " == *" variants "* ]]; then
    # Variants of the TF32 H=128 loops (RNND_CUDA_VARIANT; docs/journal).
    : >"$OUT/variants.log"
    VB="$BIN/rnnd-kernel-bench --backend cuda --batch 2048 --steps 256 --input 64 --hidden 128 \
--compute fp32 --reset-prob 0.1 --warmup 3 --repeat 10"
    for v in ${VARIANTS_GRU:-0}; do
        RNND_BENCH_NO_CUDNN=1 RNND_CUDA_VARIANT=$v timeout 60 $VB --cell gru >>"$OUT/variants.log" 2>&1
    done
    for v in ${VARIANTS_LSTM:-0}; do
        RNND_BENCH_NO_CUDNN=1 RNND_CUDA_VARIANT=$v timeout 60 $VB --cell lstm >>"$OUT/variants.log" 2>&1
    done
    grep '^{' "$OUT/variants.log" >>"$OUT/bench.jsonl"
fi

if [[ " $STEPS " == *" h256 "* ]]; then
    # Where the cluster loops of LSTM H=256 win: batches in one wave and not (docs/journal v11).
    : >"$OUT/h256.log"
    for v in ${VARIANTS_H256:-0 256}; do
        for b in 384 1920 2048; do
            RNND_BENCH_NO_CUDNN=1 RNND_CUDA_VARIANT=$v timeout 60 ${BENCH/--hidden 128/--hidden 256} \
                --batch $b --repeat 5 --cell lstm --compute fp32 --reset-prob 0.1 >>"$OUT/h256.log" 2>&1
            echo "h256 variant $v B=$b rc=$?" | tee -a "$OUT/h256.log"
        done
    done
    grep '^{' "$OUT/h256.log" >>"$OUT/bench.jsonl"
fi

if [[ " $STEPS " == *" rows "* ]]; then
    # Issue 45's rows (docs/kernels.md "Which kernel runs"): fwd+bwd at resets 0 / 0.01 / 0.1
    # in fp32 (TF32) and bf16, each with cuDNN over whole rows and split at the resets.
    : >"$OUT/rows.log"
    ROWS=(
        "--cell gru --batch 2048 --steps 256 --input 64 --hidden 64"
        "--cell gru --batch 2048 --steps 256 --input 64 --hidden 256"
        "--cell gru --batch 2048 --steps 256 --input 64 --hidden 128 --layers 2"
        "--cell lstm --batch 2048 --steps 256 --input 64 --hidden 128 --layers 2"
        "--cell lstm --batch 256 --steps 80 --input 512 --hidden 512"
        "--cell gru --batch 256 --steps 80 --input 512 --hidden 512"
        "--cell lstm --batch 64 --steps 80 --input 512 --hidden 1024")
    # ROW_ARGS: other rows, ';'-separated; VARIANTS_ROWS: variant bits to alternate at each.
    [ -n "${ROW_ARGS:-}" ] && IFS=';' read -ra ROWS <<<"$ROW_ARGS"
    for args in "${ROWS[@]}"; do
        for comp in fp32 bf16; do
            resets=0,0.01,0.1
            [ $comp = bf16 ] && resets=0.01
            for v in ${VARIANTS_ROWS:-0}; do
                RNND_CUDA_VARIANT=$v timeout 200 "$BIN/rnnd-kernel-bench" --backend cuda \
                    --compute $comp --warmup 3 --repeat ${REPEAT:-10} --reset-prob $resets \
                    $args >>"$OUT/rows.log" 2>&1
                echo "rows $comp variant $v $args rc=$?" | tee -a "$OUT/rows.log"
            done
        done
    done
    grep '^{' "$OUT/rows.log" >>"$OUT/bench.jsonl"
fi

if [[ " $STEPS " == *" step "* ]]; then
    # Issue 8's rows (GRU H=256 I=256, B=1024 and B=1, resets 0 / 0.01 / 0.1), LSTM, bf16 and
    # ieee, two layers, and the daemon's default model (I=64 H=128) at B=1. SM clocks are
    # sampled meanwhile (clocks.csv).
    nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,power.draw --format=csv \
        -lms 250 >"$OUT/clocks.csv" 2>&1 &
    SMI=$!
    : >"$OUT/step.log"
    SB="$BIN/rnnd-kernel-bench --backend cuda --op step --warmup 3 --repeat ${REPEAT:-15}"
    STEP_CASES=(
        "--cell gru,lstm --compute fp32 --batch 1,1024 --input 256 --hidden 256 --reset-prob 0,0.01,0.1"
        "--cell gru,lstm --compute bf16,ieee --batch 1,1024 --input 256 --hidden 256 --reset-prob 0.1"
        "--cell gru,lstm --compute fp32 --batch 1,1024 --input 256 --hidden 256 --layers 2 --reset-prob 0.1"
        "--cell gru --compute fp32 --batch 1,64,256,4096 --input 64 --hidden 128 --reset-prob 0.1")
    # STEP_ARGS: other cases, ';'-separated (a short run of the rows under trial).
    [ -n "${STEP_ARGS:-}" ] && IFS=';' read -ra STEP_CASES <<<"$STEP_ARGS"
    for args in "${STEP_CASES[@]}"; do
        echo "== step $args" | tee -a "$OUT/step.log"
        timeout 120 $SB $args >>"$OUT/step.log" 2>&1
        echo "step rc=$?" | tee -a "$OUT/step.log"
        if [ -n "${OLD_BENCH:-}" ]; then
            timeout 120 "$OLD_BENCH" --backend cuda --op step --warmup 3 --repeat 5 $args \
                >>"$OUT/step_old.log" 2>&1
            echo "old step rc=$?" | tee -a "$OUT/step_old.log"
        fi
    done
    grep -v '^{' "$OUT/step.log"
    [ -n "${OLD_BENCH:-}" ] && grep -v '^{' "$OUT/step_old.log" | grep -v '^==' | sed 's/^/old: /'
    if [ -n "${PROFILE_STEP:-}" ]; then
        # One step kernel at B=1 and at B=1024 (warm L2, clocks as found).
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        for b in 1 1024; do
            timeout 90 "$NCU" --clock-control none --cache-control none --kernel-name \
                regex:step_ --launch-skip 100 --launch-count 2 --metrics \
gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,smsp__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
                $BIN/rnnd-kernel-bench --backend cuda --op step --cell gru --batch $b --input 256 \
                --hidden 256 --reset-prob 0.1 --warmup 0 --repeat 1 >"$OUT/ncu_step_$b.txt" 2>&1
            echo "ncu step B=$b rc=$?"
            grep -E 'step_|duration|per_second|cycles_active|warps_active|bytes|hit_rate|wavefronts|inst_executed|stalled' \
                "$OUT/ncu_step_$b.txt" | awk '$NF+0 > 0.05 || /step_/' \
                | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -40
        done
    fi
    if [ -z "${NO_TORCH:-}" ]; then
        echo "== torch step"
        for args in "${STEP_CASES[@]}"; do
            PYTHONUNBUFFERED=1 timeout 150 python3 "$HERE/torch_step_bench.py" --warmup 3 \
                --repeat ${REPEAT:-15} $args >>"$OUT/torch_step.log" 2>&1
            echo "torch step rc=$?" >>"$OUT/torch_step.log"
        done
        grep -v '^{' "$OUT/torch_step.log" | grep -v '^backend' | grep -v skipped
    fi
    kill "$SMI" 2>/dev/null
    awk -F', ' 'NR > 1 {n[$2]++} END {for (c in n) print "sm clock", c, n[c], "samples"}' \
        "$OUT/clocks.csv" | sort -k4 -n | tail -4
    cat "$OUT/step.log" "$OUT/torch_step.log" "$OUT/step_old.log" 2>/dev/null | grep '^{' \
        >"$OUT/step.jsonl"
fi

if [ -s "$OUT/bench.jsonl" ]; then
    python3 - "$OUT/bench.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
def f(r, k):
    v = r.get(k)
    return f"{v:8.2f}" if isinstance(v, (int, float)) and v >= 0 else "       -"
print("cell    H L    B   T    I comp  reset |  fwd(notape) fwd+tape  fwd+bwd fwdbwd+dx |  cudnn:fwd  fwd+bwd  split:fwd  fwd+bwd | err out/grad   plan")
for r in rows:
    print(f"{r.get('cell','?'):4} {r.get('H',0):4} {r.get('L',1)} {r.get('B',0):4} {r.get('T',0):3} {r.get('I',0):4} "
          f"{r.get('compute','?'):4} {r.get('reset_prob',0):5.2f} | "
          f"{f(r,'fwd_notape_ms')} {f(r,'fwd_ms')} {f(r,'fwdbwd_ms')} {f(r,'fwdbwd_gradx_ms')} | "
          f"{f(r,'cudnn_fwd_ms')} {f(r,'cudnn_fwdbwd_ms')} {f(r,'cudnn_split_fwd_ms')} {f(r,'cudnn_split_fwdbwd_ms')} | "
          f"{r.get('out_err',-1):.1e}/{r.get('grad_err',-1):.1e} {r.get('plan','')} v{r.get('variant','')}")
for r in rows:
    if "fwd_phase_cycles" in r:
        print(f"{r['cell']} v{r.get('variant')} phase cycles/step fwd", r["fwd_phase_cycles"], "bwd", r["bwd_phase_cycles"],
              "fwd without tape", r.get("fwd_notape_phase_cycles"))
print("device:", rows[0].get("device") if rows else "?")
EOF
fi
