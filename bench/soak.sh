#!/usr/bin/env bash
# The soak of issue 32: examples/soak (one long-lived decode process, a forked
# prefill process per request, a random fault per request, the failure
# policies in turn) run for many requests over TCP, then over UCX (skipped,
# visibly, where UCX is not built or cannot listen on loopback).
#
#   bench/soak.sh [BUILD_DIR] [REQUESTS] [SEED]     (defaults: build/soak 500 1)
#
# Builds the soak example in BUILD_DIR (configured Release when it is not yet),
# runs it at nice 10 and exits non-zero when either run fails (exit 77, a skip,
# counts as passed and is said).
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$here/build/soak}"
requests="${2:-500}"
seed="${3:-1}"

if [ ! -f "$build/build.ninja" ] && [ ! -f "$build/Makefile" ]; then
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLYNX_BUILD_BENCHMARKS=OFF \
    -DLYNX_HEADER_CHECKS=OFF -DLYNX_NATIVE=OFF || exit 1
fi
nice -n 10 cmake --build "$build" --target soak -j1 || exit 1

status=0
for transport in tcp ucx; do
  echo "== soak: $requests requests over $transport, seed $seed"
  start=$(date +%s)
  nice -n 10 "$build/examples/soak" --requests "$requests" --transport "$transport" --seed "$seed"
  rc=$?
  echo "== soak over $transport: exit $rc after $(( $(date +%s) - start )) s"
  if [ "$rc" -eq 77 ]; then
    echo "== soak over $transport: SKIPPED"
  elif [ "$rc" -ne 0 ]; then
    status=1
  fi
done
exit "$status"
