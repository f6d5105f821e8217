#!/usr/bin/env bash
# Builds every libFuzzer target of tests/fuzz with clang++ (-fsanitize=fuzzer,
# address,undefined; undefined behaviour aborts), makes their seed corpora
# (each target's --make-seeds mode; the tokenizer's also from the shipped
# examples/models/tok512.bin), runs each for the given seconds, one at a time,
# and prints per target: executions, exec/s, coverage (cov, ft: libFuzzer's
# final stats) and crashes.
#
#   bash tests/fuzz/run.sh <seconds-per-target> [outdir]
#
# outdir (default: a new /tmp/lynx_fuzz.XXXXXX) holds bin/, seeds/, corpus/
# (what each run added; reused by a later run with the same outdir), logs/ and
# findings/ (crash-*, leak-*, timeout-*, oom-* reproducers; LYNX_FUZZ_FINDINGS
# puts them elsewhere). Environment: CXX (default clang++), LYNX_FUZZ_TARGETS
# (a space-separated subset of the target names). Targets build and run one at
# a time.
#
# Bounds, for every target: -timeout=10 (one input over 10 s is a hang),
# -rss_limit_mb=2048, -malloc_limit_mb=64 (one allocation over 64 MiB fails:
# no input here justifies one), inputs of at most 4 KiB (transports) or
# 64 KiB (loaders).
#
# Exit status: 0 when every target ran clean; 1 on any crash, leak, timeout or
# out-of-memory (or a target that fails to build or run); 77 (skipped) when
# clang++ or its libFuzzer runtime is missing. A target whose dependency is
# missing (UCX for ucx_header) is reported skipped and does not fail the run;
# when no selected target could run at all, the exit status is 77.
set -u

usage() { echo "usage: bash tests/fuzz/run.sh <seconds-per-target> [outdir]" >&2; exit 2; }
[[ $# -ge 1 && $1 =~ ^[0-9]+$ && $1 -gt 0 ]] || usage
seconds=$1
out=${2:-$(mktemp -d /tmp/lynx_fuzz.XXXXXX)}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cxx=${CXX:-clang++}
findings=${LYNX_FUZZ_FINDINGS:-$out/findings}
mkdir -p "$out"/{bin,seeds,corpus,logs} "$findings" || exit 1

skip() { echo "SKIP: tests/fuzz/run.sh: $*" >&2; exit 77; }
command -v "$cxx" >/dev/null 2>&1 || skip "$cxx not found (Debian: apt-get install clang)"
probe=$out/bin/.probe
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
  >"$probe.cpp"
"$cxx" -fsanitize=fuzzer,address,undefined "$probe.cpp" -o "$probe" >"$probe.log" 2>&1 ||
  skip "$cxx cannot link -fsanitize=fuzzer,address,undefined (libFuzzer or sanitizer runtime missing; Debian: libclang-rt-14-dev, a dependency of clang-14): $(head -c 400 "$probe.log")"

flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=all)

# name | compile arguments | max_len | seed command ("" = none; SEEDS is the seed dir)
targets=(
  "segment_accept|-I$root/include $root/tests/fuzz/segment_accept.cpp|4096|"
  "tcp_frames|-I$root/include $root/tests/fuzz/tcp_frames.cpp|4096|--make-seeds SEEDS"
  "ucx_header|-I$root/include $root/tests/fuzz/ucx_header.cpp -lucp -lucs|4096|--make-seeds SEEDS"
  "llama2c_checkpoint|-I$root/examples/llama2c $root/tests/fuzz/llama2c_checkpoint.cpp|65536|--make-seeds SEEDS"
  "llama2c_tokenizer|-I$root/examples/llama2c $root/tests/fuzz/llama2c_tokenizer.cpp|65536|--make-seeds SEEDS $root/examples/models/tok512.bin"
  "gguf_reader|-I$root/include -I$root/examples $root/tests/fuzz/gguf_reader.cpp|65536|--make-seeds SEEDS"
)

selected=${LYNX_FUZZ_TARGETS:-}
failures=0
ran=0
rows=()
for spec in "${targets[@]}"; do
  IFS='|' read -r name args max_len seed_args <<<"$spec"
  [[ -z $selected || " $selected " == *" $name "* ]] || continue
  bin=$out/bin/$name
  log=$out/logs/$name.log
  echo "== $name: building" >&2
  # shellcheck disable=SC2086  # args holds several words on purpose
  if ! "$cxx" "${flags[@]}" $args -o "$bin" >"$out/logs/$name.build.log" 2>&1; then
    if [[ $name == ucx_header ]] && grep -q "ucp/api/ucp.h\|needs <ucp/api/ucp.h>\|-lucp\|-lucs" "$out/logs/$name.build.log"; then
      echo "SKIP: $name: UCX not found (Debian: libucx-dev)" >&2
      rows+=("$name|$seconds|-|-|-|-|-|skipped (no UCX)")
      continue
    fi
    echo "FAIL: $name does not build; see $out/logs/$name.build.log" >&2
    tail -n 20 "$out/logs/$name.build.log" >&2
    rows+=("$name|$seconds|-|-|-|-|-|BUILD FAILED")
    failures=$((failures + 1))
    continue
  fi
  seeds=$out/seeds/$name
  corpus=$out/corpus/$name
  mkdir -p "$seeds" "$corpus" "$findings/$name"
  if [[ -n $seed_args ]]; then
    # shellcheck disable=SC2086
    "$bin" ${seed_args//SEEDS/$seeds} >"$out/logs/$name.seeds.log" 2>&1 || {
      echo "FAIL: $name --make-seeds failed; see $out/logs/$name.seeds.log" >&2
      rows+=("$name|$seconds|-|-|-|-|-|SEEDS FAILED")
      failures=$((failures + 1))
      continue
    }
  fi
  before=$(find "$findings/$name" -type f | wc -l)
  echo "== $name: running ${seconds}s" >&2
  "$bin" "$corpus" "$seeds" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=64 -max_len="$max_len" -print_final_stats=1 -error_exitcode=1 \
    -timeout_exitcode=1 -artifact_prefix="$findings/$name/" >"$log" 2>&1
  rc=$?
  after=$(find "$findings/$name" -type f | wc -l)
  crashes=$((after - before))
  if [[ $rc -eq 77 ]] && grep -q "SKIP" "$log"; then
    grep "SKIP" "$log" >&2
    rows+=("$name|$seconds|-|-|-|-|-|skipped ($(grep -o 'SKIP.*' "$log" | head -c 60))")
    continue
  fi
  ran=$((ran + 1))
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | tail -n 1 | grep -o '[0-9]*$')
  rate=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | tail -n 1 | grep -o '[0-9]*$')
  last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' <<<"$last" | grep -o '[0-9]*$')
  ft=$(grep -o 'ft: [0-9]*' <<<"$last" | grep -o '[0-9]*$')
  status=ok
  if [[ $rc -ne 0 || $crashes -gt 0 ]]; then
    status="FAILED (exit $rc; $(grep -m1 -oE 'ERROR: [A-Za-z]+: [^ ]+( [^ ]+)?|deadly signal|timeout after [0-9]+ seconds|out-of-memory \([^)]*\)|detected memory leaks' "$log" | head -n 1))"
    failures=$((failures + 1))
    echo "FAIL: $name; log $log; reproducers:" >&2
    find "$findings/$name" -type f -newer "$seeds" >&2
  fi
  rows+=("$name|$seconds|${execs:--}|${rate:--}|${cov:--}|${ft:--}|$crashes|$status")
done

printf '\n%-20s %8s %12s %8s %6s %7s %8s  %s\n' target seconds executions exec/s cov ft crashes status
for r in "${rows[@]}"; do
  IFS='|' read -r n s e x c f k st <<<"$r"
  printf '%-20s %8s %12s %8s %6s %7s %8s  %s\n' "$n" "$s" "$e" "$x" "$c" "$f" "$k" "$st"
done
echo "outdir: $out; findings: $findings"
[[ $failures -eq 0 ]] || exit 1
[[ $ran -gt 0 ]] || { echo "SKIP: no target could run" >&2; exit 77; }
exit 0
