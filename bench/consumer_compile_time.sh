#!/usr/bin/env bash
# How long a consumer's file that encodes a layer and calls decode_attention
# (tests/consumer/kernels.cpp) takes to compile at -O2: header-only (every
# template instantiated in the file) beside linking lynx::kernels (the shipped
# configurations declared extern, their bodies in the library). The best of
# RUNS compiles each; the kernels build is also linked and run.
#
#   bash bench/consumer_compile_time.sh [BUILD_DIR]   (default build/release; it must
#                                                      hold a built lynx_kernels)
#   CXX=clang++ RUNS=3 bash bench/consumer_compile_time.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:-build/release}
cxx=${CXX:-g++}
runs=${RUNS:-2}
lib="$build/liblynx_kernels.a"
gen="$build/lynx_kernels/include"
[ -f "$lib" ] && [ -f "$gen/lynx/kernels/config.hpp" ] || {
  echo "no built lynx::kernels in $build (cmake --build $build --target lynx_kernels)" >&2
  exit 2
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src=tests/consumer/kernels.cpp
flags=(-std=c++20 -O2 -Iinclude)
xxh=()
if grep -q 'LYNX_XXH3_DISPATCH=1' "$build/build.ninja" 2>/dev/null; then
  flags+=(-DLYNX_XXH3_DISPATCH=1)
  xxh=(-lxxhash)
fi

best() {  # best wall time (s) of $runs compiles: best <label> <args...>
  local label=$1 t b=""
  shift
  for ((i = 0; i < runs; i++)); do
    local s e
    s=$(date +%s.%N)
    "$cxx" "$@"
    e=$(date +%s.%N)
    t=$(echo "$e - $s" | bc)
    if [ -z "$b" ] || [ "$(echo "$t < $b" | bc)" = 1 ]; then b=$t; fi
  done
  printf '%-34s %6.2f s\n' "$label" "$b" >&2
  echo "$b"
}

echo "$cxx $("$cxx" -dumpversion), -O2, best of $runs: $src" >&2
header_only=$(best "header-only (lynx::lynx)" "${flags[@]}" -c "$src" -o "$tmp/h.o")
kernels=$(best "with lynx::kernels (extern)" "${flags[@]}" -DLYNX_KERNELS=1 -I"$gen" -c "$src" -o "$tmp/k.o")
"$cxx" "$tmp/k.o" "$lib" "${xxh[@]}" -pthread -o "$tmp/k"
"$tmp/k" >&2
printf 'ratio header-only / lynx::kernels: %.1fx\n' "$(echo "$header_only / $kernels" | bc -l)" >&2
