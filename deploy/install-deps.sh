#!/usr/bin/env bash
# Installs, with apt, whatever rnnd needs to build and test that is not there yet. Idempotent and
# quiet when everything is present; uses sudo when not root. Debian 12 and Ubuntu 22.04+ names.
# --ci adds what .ci/run needs beyond that: clang and libFuzzer's runtime (tests/fuzz), and
# clang-format (make format-check).
set -euo pipefail

pkgs=(
  build-essential cmake pkg-config
  libgrpc-dev protobuf-compiler protobuf-compiler-grpc protobuf-c-compiler libprotobuf-c-dev
  grpc-proto libuv1-dev libcmocka-dev libopenblas-dev
  zlib1g-dev # crc32 checksums of checkpoint files
  xz-utils # deploy/bundle.sh packs with xz
  # Python client, fixtures and reference tests run on Debian's /usr/bin/python3.
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch python3-matplotlib python3-yaml
  # `pip install ./client/python` offline: a venv, pip, and setuptools + wheel to build with.
  python3-venv python3-pip python3-setuptools python3-wheel
)
if [ "${1:-}" = "--ci" ]; then
  pkgs+=(clang clang-format libclang-rt-dev)
fi

missing=()
for p in "${pkgs[@]}"; do
  # dpkg-query prints "install ok installed" only for a fully installed package.
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=()
[ "$(id -u)" -ne 0 ] && sudo=(sudo)
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
