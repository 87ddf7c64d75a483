#!/usr/bin/env bash
# check_bundle.sh RNNDCTL [PYPKG]: deploy/bundle.sh on a build tree holding only rnndctl (a small
# program with the same gRPC, protobuf-c and TLS libraries as rnnd, so the check takes seconds)
# and, given PYPKG (a build's client/python/rnnd), the Python package ($RNND_PYTHON imports it);
# then the tarball unpacked elsewhere as a GPU host would: its libraries must be the ones the
# loader picks through the launcher's path, the base system's must stay out, the launcher must
# run the program, and py/rnnd must import without the build's copies of the C client or
# bytecode. Bad arguments and an empty build tree must fail with a message.
set -euo pipefail
rnndctl=$1
pypkg=${2:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail() { echo "check_bundle: $*" >&2; exit 1; }

mkdir -p "$t/build/client" "$t/empty" "$t/host"
cp "$rnndctl" "$t/build/client/rnndctl"
if [ -n "$pypkg" ]; then
  mkdir -p "$t/build/client/python"
  cp -r "$pypkg" "$t/build/client/python/rnnd"
fi
"$repo/deploy/bundle.sh" -b "$t/build" -o "$t/out"
tar -C "$t/host" -xf "$t/out/rnnd-bundle.tar.xz"
b=$t/host/rnnd-bundle

# ldd's output is read whole: grep -q would stop reading early, and ldd's SIGPIPE would fail
# the pipe under pipefail.
libs=$(LD_LIBRARY_PATH=$b/lib ldd "$b/bin/rnndctl")
for lib in libgrpc.so libprotobuf-c.so libssl.so; do
  grep -q "$lib.* => $b/lib/" <<<"$libs" || fail "$lib is not loaded from the bundle"
done
grep -q "not found" <<<"$libs" && fail "a library is missing"
grep -qE '^(libc|libm|libstdc\+\+|libgcc_s)\.' <<<"$(ls "$b/lib")" && fail "base system libraries bundled"
"$b/run" rnndctl --help >/dev/null || fail "the launcher cannot run rnndctl"
if [ -n "$pypkg" ]; then
  [ -f "$b/py/rnnd/v1/rnnd_pb2.py" ] || fail "py/rnnd lacks its gRPC stubs"
  [ -e "$b/py/rnnd/librnnd_client.so" ] && fail "py/rnnd holds the build's C client (lib/ has it)"
  find "$b/py" -name __pycache__ | grep -q . && fail "py/ holds bytecode"
  (cd "$t" && PYTHONPATH=$b/py PYTHONDONTWRITEBYTECODE=1 "${RNND_PYTHON:-python3}" -c \
    "import rnnd, sys; sys.exit(not rnnd.__file__.startswith('$b/py/'))") ||
    fail "rnnd does not import from the bundle's py/"
fi

set +e
msg=$("$repo/deploy/bundle.sh" --bogus 2>&1); rc=$?
[ $rc -eq 2 ] && [[ $msg == *"unknown argument"* ]] || fail "unknown argument: rc $rc, '$msg'"
msg=$("$repo/deploy/bundle.sh" -b "$t/empty" -o "$t/out2" 2>&1); rc=$?
[ $rc -eq 1 ] && [[ $msg == *"no binaries"* ]] || fail "empty build tree: rc $rc, '$msg'"
[ -e "$t/out2" ] && fail "an empty build tree left an output directory"
echo "check_bundle: ok ($(ls "$b/lib" | wc -l) libraries, $(du -h "$t/out/rnnd-bundle.tar.xz" | cut -f1))"
