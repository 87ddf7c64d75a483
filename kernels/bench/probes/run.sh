#!/usr/bin/env bash
# Builds and runs the probes on the GPU host (its nvcc, its cuBLAS: the toolkit's or PyTorch's
# wheel), from the repository root:  kernels/bench/probes/run.sh [probe...]  (default: dw16)
# Output: one JSON line a measurement, also into $OUT/<probe>.jsonl when OUT is set.
set -eu
cd "$(dirname "$0")"
CUB=$(find /usr/local/cuda/lib64/ /usr/local/cuda/targets/ -name 'libcublas.so.13*' 2>/dev/null | head -1)
if [ -z "$CUB" ]; then
    SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    CUB=$(find "$SITE/nvidia" -name 'libcublas.so.13' | head -1)
fi
LIBDIR=$(dirname "$CUB")
export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for p in "${@:-dw16}"; do
    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "/tmp/$p" "$p.cu" \
        -L"$LIBDIR" -l:"$(basename "$CUB")" -l:"$(basename "$CUB" | sed 's/cublas/cublasLt/')"
    "/tmp/$p" | tee ${OUT:+"$OUT/$p.jsonl"}
done
