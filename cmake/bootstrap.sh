#!/usr/bin/env bash
# Installs what building and testing Lynx needs on Debian 12 / Ubuntu, and
# nothing when it is all there already (so it is cheap to run every time).
#   build-essential cmake ninja-build git pkg-config   toolchain
#   doctest-dev libbenchmark-dev libxxhash-dev        tests, benchmarks, checksums
#   libucx-dev iproute2                               UCX transport adapter; network namespaces for the slow-link bench
# With --aarch64 also (the ARM cross check, `cmake --workflow --preset aarch64`):
#   g++-aarch64-linux-gnu qemu-user                   cross compiler; runs the ARM tests
# With --fuzz also (the libFuzzer targets, tests/fuzz/run.sh):
#   clang                                             clang++ and its libFuzzer and sanitizer runtimes
# The CUDA toolkit is optional and not installed here (nvcc enables lynx::cuda).
set -euo pipefail

packages=(build-essential cmake ninja-build git pkg-config doctest-dev libbenchmark-dev libxxhash-dev libucx-dev iproute2)
for arg in "$@"; do
  case "$arg" in
    --aarch64) packages+=(g++-aarch64-linux-gnu qemu-user) ;;
    --fuzz) packages+=(clang) ;;
    *) echo "bootstrap: unknown option '$arg' (known: --aarch64, --fuzz)" >&2; exit 2 ;;
  esac
done

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
for cmd in c++ cmake ninja git; do
  command -v "$cmd" >/dev/null 2>&1 || echo "bootstrap: '$cmd' not on PATH"
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "bootstrap: all packages present (${packages[*]})"
  exit 0
fi

echo "bootstrap: installing ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "bootstrap: need root (or sudo) to install: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update
"${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
echo "bootstrap: done"
