#!/usr/bin/env bash
# Packs rnnd for an air-gapped host that has an NVIDIA driver (and, for the CUDA backend, the CUDA
# 13 runtime libraries) but none of our Debian packages: the binaries plus every shared library
# they load that is not part of the base system, with a launcher that points the loader at them.
#
#   deploy/bundle.sh [-b BUILD_DIR] [-o OUT_DIR] [--tests]
#
# Produces OUT_DIR/rnnd-bundle/ and OUT_DIR/rnnd-bundle.tar.xz (default OUT_DIR: bundle/). On the
# target:  tar xf rnnd-bundle.tar.xz && rnnd-bundle/run rnnd --backend cuda ...
# xz, not gzip: with --tests the gzip tarball passed 64 MiB (65 MB at 11d0586), the most our GPU
# sessions may carry to the host; xz makes it 51 MB.
# --tests adds the test binaries a GPU host runs (tests/gpu, tests/integration: the unit tests
# need no GPU, and each would add the linked kernels, ~24 MB, to the tarball).
# lib/ also holds librnnd_client.so, the C client for foreign-function callers, and py/ the Python
# package when the build made it (PYTHONPATH=rnnd-bundle/py RNND_CLIENT_LIB=rnnd-bundle/lib/librnnd_client.so).
# Left out on purpose: glibc, libstdc++ and libgcc (the target's own, which must be as new as this
# machine's: Debian 12 = glibc 2.36), the NVIDIA driver (libcuda) and the CUDA toolkit's libraries
# (cuBLAS, cuDNN: hundreds of MB, and they must match the target's driver).
set -euo pipefail

build=build
out=bundle
tests=0
while [ $# -gt 0 ]; do
  case "$1" in
    -b) build=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --tests) tests=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bundle.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

bins=()
for f in server/rnnd client/rnndctl kernels/bench/rnnd-kernel-bench; do
  [ -x "$build/$f" ] && bins+=("$build/$f")
done
if [ "$tests" = 1 ]; then
  for f in "$build"/tests/gpu/test_* "$build"/tests/integration/test_*; do
    [ -x "$f" ] && [ -f "$f" ] && bins+=("$f")
  done
fi
[ ${#bins[@]} -gt 0 ] || { echo "bundle.sh: no binaries under $build (build first)" >&2; exit 1; }

dir=$out/rnnd-bundle
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/lib"

# The base system every Linux target has, and the GPU stack that must come from the target.
system='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda|libnvidia-|libcublas|libcublasLt|libcudnn|libcudart)[.-]'
libs_of() {
  ldd "$1" | awk '/=> \//{print $1, $3}' | while read -r name path; do
    [[ $name =~ $system ]] || cp -nL "$path" "$dir/lib/$name"
  done
}
for b in "${bins[@]}"; do
  cp "$b" "$dir/bin/"
  libs_of "$b"
done
if [ -f "$build/client/librnnd_client.so" ]; then
  cp "$build/client/librnnd_client.so" "$dir/lib/"
  libs_of "$build/client/librnnd_client.so"
fi
if [ -d "$build/client/python/rnnd" ]; then
  mkdir -p "$dir/py"
  cp -r "$build/client/python/rnnd" "$dir/py/"
  rm -rf "$dir/py/rnnd/librnnd_client.so" "$dir"/py/rnnd/__pycache__ "$dir"/py/rnnd/v1/__pycache__
fi

cat >"$dir/run" <<'EOF'
#!/bin/sh
# Runs one of the bundled programs with the bundled libraries: run rnnd --help
here=$(cd "$(dirname "$0")" && pwd)
prog=$1; shift
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/$prog" "$@"
EOF
chmod +x "$dir/run"

XZ_OPT=-T0 tar -C "$out" -cJf "$out/rnnd-bundle.tar.xz" rnnd-bundle
echo "bundle.sh: $(ls "$dir/bin" | wc -l) programs, $(ls "$dir/lib" | wc -l) libraries," \
     "$(du -sh "$out/rnnd-bundle.tar.xz" | cut -f1) in $out/rnnd-bundle.tar.xz"
