#!/usr/bin/env bash
# Usage: bash bench/device_check.sh      (on a GPU machine, from the repository root)
#
# Builds and runs everything GPU-related in Lynx in one command: the CUDA tests
# (tests/**/test_*.cu, CTest label "cuda") and the CUDA benchmarks (bench/*.cu),
# compiled for sm_90 only (H100/H200), then the tests once more under
# compute-sanitizer memcheck where it is installed. Meant for a machine that has
# nvcc, CMake and a host compiler but none of doctest, Google Benchmark and xxHash:
# those come from the prefix that cmake/device_bundle.sh makes on Debian 12
# (default .device/, copied along with the source tree). Release build in
# build/device.
#
# Results go to $OUT (default build/device/out), at most 8 files:
#   env.txt        GPU (nvidia-smi), compiler and tool versions, configure and build log
#   tests.txt      ctest output of the CUDA tests
#   bench_<name>.txt / bench_<name>.json   each CUDA benchmark's console and JSON output
#   sanitizer.txt  compute-sanitizer memcheck of each CUDA test (or why it did not run)
#   summary.txt    what ran, how long each phase took, and the verdict
# Order: configure, build, tests, benchmarks, sanitizer. The sanitizer is last
# because it is the slowest and least predictable phase: it gets whatever is left
# of the time limit, and the benchmark numbers are in hand by then. Every phase
# after the build is cut to fit the limit (DEVICE_CHECK_LIMIT_S), so the summary
# is written even when something hangs. On 16 cores the build should take a minute
# or two (each .cu file took 30-45 s on one core where this was written); memcheck
# takes at most DEVICE_CHECK_SANITIZER_S more.
#
# Exit status 0 only if everything built, every CUDA test passed (a test that
# reports itself skipped, exit code 77, counts as a failure: on a GPU machine it
# means the device was not usable), every benchmark measured something and
# memcheck found no error. Tests, benchmarks and memcheck each run even when an
# earlier one of them failed; a failed configure ends the run.
#
# Environment (all optional):
#   OUT                       result folder (default build/device/out)
#   LYNX_DEVICE_BUNDLE        prefix from cmake/device_bundle.sh (default .device)
#   DEVICE_CHECK_JOBS         build parallelism (default: nproc)
#   DEVICE_CHECK_TESTS        space-separated CTest names to build and run
#                             (default: every test labelled cuda, e.g. cuda.test_cuda_codec)
#   DEVICE_CHECK_BENCHES      space-separated benchmark targets (default: every bench/*.cu,
#                             e.g. bench_cuda_codec); "none" builds and runs none
#   DEVICE_CHECK_LIMIT_S      seconds the whole run may take (default 540: under a 600 s
#                             limit on the command, with room to spare)
#   DEVICE_CHECK_SANITIZER_S  seconds for memcheck over all CUDA tests (default 180)
#   DEVICE_CHECK_CMAKE_ARGS   extra configure arguments (split on spaces)
#   DEVICE_CHECK_FALLBACK     1: force the bundled libstdc++ for the benchmarks (testing)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bundle=$(realpath -m "${LYNX_DEVICE_BUNDLE:-$root/.device}")
build=$root/build/device
out=${OUT:-$build/out}
jobs=${DEVICE_CHECK_JOBS:-$(nproc)}
limit_s=${DEVICE_CHECK_LIMIT_S:-540}
test_timeout_s=240   # all CUDA tests together (CTest's default per Lynx test is 900)
bench_timeout_s=180  # per benchmark executable
sanitizer_s=${DEVICE_CHECK_SANITIZER_S:-180}
bundle_lib=$bundle/lib/x86_64-linux-gnu

mkdir -p "$out"
out=$(cd "$out" && pwd)
# A reused folder (the default one) must not show results of an earlier run.
rm -f "$out"/{env,tests,sanitizer,summary,benches}.txt "$out"/bench_*.{txt,json} \
  "$out"/benches_json.tar
env_log=$out/env.txt

start_s=$SECONDS
phase_names=()
phase_secs=()
current_phase=""
phase_start_s=0
finished=0    # set by finish(); an exit without it is an unexpected stop
failures=()   # one line per thing that went wrong, for the summary
tests=()
benches=()
bench_results=()
tests_summary="not run"
sanitizer_summary="not run"

# Prints a phase header with the wall clock and seconds since the start, and
# closes the previous phase so the summary can say where the time went.
phase() {
  end_phase
  current_phase=$1
  phase_start_s=$SECONDS
  printf '\n[device_check %s +%4ds] == %s\n' "$(date +%H:%M:%S)" $((SECONDS - start_s)) "$1"
}
end_phase() {
  if [ -n "$current_phase" ]; then
    phase_names+=("$current_phase")
    phase_secs+=($((SECONDS - phase_start_s)))
    printf '[device_check %s +%4ds] -- %s took %ds\n' "$(date +%H:%M:%S)" \
      $((SECONDS - start_s)) "$current_phase" $((SECONDS - phase_start_s))
    current_phase=""
  fi
}
note() { echo "device_check: $*"; }

# Seconds a step may still take: its own limit, or what is left of the whole
# run's, less 20 s kept for the summary (0 or less: no time left).
cap() {
  local left=$((limit_s - (SECONDS - start_s) - 20))
  echo $(($1 < left ? $1 : left))
}
fail() { failures+=("$*"); echo "device_check: FAILED: $*"; }

# Runs a command with its output appended to env.txt under a heading (nothing on
# the console: the build log is long, and the console's tail should be the results).
logged() {
  local title=$1
  shift
  { echo; echo "===== $title: $*"; } >> "$env_log"
  "$@" >> "$env_log" 2>&1
}

# Should the script stop early (an error outside the handled paths, a signal),
# still say where, so a short console tail explains what happened.
# shellcheck disable=SC2317  # reached through the trap
on_exit() {
  local rc=$?
  if [ "$finished" = 0 ]; then
    echo "device_check: stopped unexpectedly in '${current_phase:-the summary}' (exit $rc);" \
         "logs in $out" >&2
  fi
}
trap on_exit EXIT

# ---------------------------------------------------------------------------
# Summary, and the 8-file limit on what comes back from $OUT: with more CUDA
# benchmarks than fit, their console logs are merged into benches.txt and, if
# that is still too many, their JSON files into benches_json.tar.
# ---------------------------------------------------------------------------
file_count() { find "$out" -type f | wc -l; }
finish() {
  end_phase
  if [ $(($(file_count) + 1)) -gt 8 ]; then
    for bench in "${benches[@]}"; do
      if [ -f "$out/$bench.txt" ]; then
        { echo "===== $bench"; cat "$out/$bench.txt"; } >> "$out/benches.txt"
        rm "$out/$bench.txt"
      fi
    done
  fi
  if [ $(($(file_count) + 1)) -gt 8 ] && compgen -G "$out/bench_*.json" > /dev/null; then
    (cd "$out" && tar -cf benches_json.tar bench_*.json && rm bench_*.json)
  fi

  {
    echo "Lynx device check: $([ ${#failures[@]} -eq 0 ] && echo PASSED || echo FAILED)" \
         "in $((SECONDS - start_s))s on" \
         "$(nvidia-smi -L 2>/dev/null | head -n 1 || echo "a machine without nvidia-smi")"
    echo "phases:"
    for i in "${!phase_names[@]}"; do
      printf '  %5ds  %s\n' "${phase_secs[$i]}" "${phase_names[$i]}"
    done
    echo "CUDA tests: ${tests_summary:-not run}"
    echo "benchmarks:"
    for line in "${bench_results[@]}"; do echo "  $line"; done
    [ ${#bench_results[@]} -gt 0 ] || echo "  (none run)"
    echo "sanitizer: $sanitizer_summary"
    if [ ${#failures[@]} -gt 0 ]; then
      echo "failures:"
      for line in "${failures[@]}"; do echo "  - $line"; done
    fi
    if [ "$(file_count)" -gt 8 ]; then  # summary.txt exists by now
      echo "WARNING: $out holds more than 8 files (some not from this script)"
    fi
    echo "files in $out:"
    (cd "$out" && find . -type f | sed 's|^\./|  |' | sort)
  } > "$out/summary.txt"
  echo
  cat "$out/summary.txt"
  finished=1
  [ ${#failures[@]} -eq 0 ] && exit 0
  exit 1
}

# ---------------------------------------------------------------------------
phase "environment"
# ---------------------------------------------------------------------------
# nvcc may be installed but not on the PATH (the usual /usr/local/cuda layout).
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
{
  echo "Lynx device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm), $(nproc) cores"
  grep -E '^PRETTY_NAME=' /etc/os-release 2>/dev/null || true
  echo "git: $(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)"
  free -g 2>/dev/null | head -n 2 || true
} >> "$env_log"
if command -v nvidia-smi > /dev/null; then
  logged "GPU" nvidia-smi || fail "nvidia-smi exited nonzero (driver not loaded?)"
  query=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit
  query+=,persistence_mode,mig.mode.current
  logged "GPU details" nvidia-smi --format=csv --query-gpu="$query" || true
  nvidia-smi -L || true
else
  echo "nvidia-smi: not found" >> "$env_log"
  note "nvidia-smi not found"
fi
for tool in nvcc cmake ninja c++ g++ compute-sanitizer; do
  if command -v "$tool" > /dev/null; then
    logged "$tool" "$tool" --version || true
  else
    echo "$tool: not on PATH" >> "$env_log"
  fi
done
grep -E 'release [0-9]|^cmake version|^c\+\+ |^g\+\+ ' "$env_log" | sed 's/^/  /' || true

if ! command -v nvcc > /dev/null; then
  fail "nvcc not found (neither on PATH nor in /usr/local/cuda/bin)"
  finish
fi
if [ ! -f "$bundle/lib/cmake/doctest/doctestConfig.cmake" ] ||
   [ ! -f "$bundle_lib/cmake/benchmark/benchmarkConfig.cmake" ] ||
   [ ! -f "$bundle/include/xxhash.h" ]; then
  fail "no package bundle in $bundle: run 'bash cmake/device_bundle.sh .device' on Debian 12" \
       "and copy .device along with the source tree"
  finish
fi
head -n 7 "$bundle/MANIFEST.txt" >> "$env_log" 2>/dev/null || true
# The bundle's libbenchmark and libxxhash are found through this at run time (the
# build tree's RPATH also names them; this covers a copied build too).
export LD_LIBRARY_PATH=$bundle_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# Can this machine's C and C++ runtimes load Debian 12's libbenchmark? It needs
# GLIBC_2.32 and GLIBCXX_3.4.30 (GCC 12). An older libstdc++ is made up for by the
# bundled one (benchmarks only, and linking with --allow-shlib-undefined so the
# linker does not check libbenchmark against the older libstdc++); an older glibc
# cannot be, and the benchmarks are then not built.
bench_ld_path=$LD_LIBRARY_PATH
bench_link_flags=""
benches_possible=1
libbenchmark=$(find "$bundle_lib" -maxdepth 1 -name 'libbenchmark.so.*.*' | head -n 1)
missing=$(ldd "$libbenchmark" 2>&1 | grep 'not found' || true)
if [ -n "$missing" ] || [ "${DEVICE_CHECK_FALLBACK:-0}" = 1 ]; then
  echo "libbenchmark with this machine's runtime: ${missing:-(forced fallback)}" >> "$env_log"
  with_fallback=$(LD_LIBRARY_PATH=$bundle/fallback:$LD_LIBRARY_PATH ldd "$libbenchmark" 2>&1 |
                  grep 'not found' || true)
  if [ -z "$with_fallback" ] && [ -f "$bundle/fallback/libstdc++.so.6" ]; then
    note "libbenchmark needs a newer libstdc++ than this machine's; the benchmarks use" \
         "the bundled one ($bundle/fallback)"
    bench_ld_path=$bundle/fallback:$LD_LIBRARY_PATH
    bench_link_flags="-Wl,--allow-shlib-undefined"
  else
    fail "libbenchmark cannot load here: $(echo "$with_fallback" | tr -s ' \n' ' ')"
    benches_possible=0
  fi
else
  echo "libbenchmark loads with this machine's runtime (ldd: nothing missing)" >> "$env_log"
fi

# ---------------------------------------------------------------------------
phase "configure (build/device, Release, sm_90)"
# ---------------------------------------------------------------------------
cmake_args=(-S "$root" -B "$build"
  -DCMAKE_BUILD_TYPE=Release
  -DLYNX_ENABLE_CUDA=ON
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)"
  # H200 and H100 are sm_90; the default "80;90" would compile every kernel twice.
  -DCMAKE_CUDA_ARCHITECTURES=90
  # Source lines in memcheck reports; does not change the generated code.
  -DCMAKE_CUDA_FLAGS=-lineinfo
  -DLYNX_BUILD_TESTS=ON -DLYNX_BUILD_BENCHMARKS=ON
  -DLYNX_BUILD_EXAMPLES=OFF -DLYNX_INSTALL=OFF
  # The bundle, named explicitly so that a system copy of a package is never used
  # by accident (the cache then shows where each one came from).
  -DCMAKE_PREFIX_PATH="$bundle"
  -Ddoctest_DIR="$bundle/lib/cmake/doctest"
  -Dbenchmark_DIR="$bundle_lib/cmake/benchmark"
  -DXXHASH_INCLUDE_DIR="$bundle/include"
  -DXXHASH_LIBRARY="$bundle_lib/libxxhash.so"
  -DCMAKE_EXE_LINKER_FLAGS="$bench_link_flags")
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja > /dev/null; then
  cmake_args+=(-G Ninja)  # a generator cannot change in an existing build tree
fi
read -r -a extra_args <<< "${DEVICE_CHECK_CMAKE_ARGS:-}"
cmake_args+=("${extra_args[@]}")
if ! logged "configure" cmake "${cmake_args[@]}"; then
  fail "configure (see env.txt)"
  tail -n 30 "$env_log"
  finish
fi
grep -E '^(doctest_DIR|benchmark_DIR|XXHASH_INCLUDE_DIR|XXHASH_LIBRARY|CMAKE_CUDA_ARCHITECTURES|'\
'CMAKE_CUDA_COMPILER|CMAKE_CXX_COMPILER|LYNX_XXH3_DISPATCH_LINKS)[:=]' "$build/CMakeCache.txt" |
  sed 's/^/  /'
grep -E 'Lynx: ' "$env_log" | sed 's/^-- /  /' || true

# The CUDA tests: every CTest test labelled cuda (their names are their targets).
if [ -n "${DEVICE_CHECK_TESTS:-}" ]; then
  read -r -a tests <<< "$DEVICE_CHECK_TESTS"
else
  mapfile -t tests < <(cd "$build" && ctest -N -L cuda | sed -n 's/^ *Test *#[0-9]*: //p')
fi
# The CUDA benchmarks: bench/<stem>.cu -> bench_<stem>, with _cuda appended when a
# bench/<stem>.cpp exists too (the rule in bench/CMakeLists.txt).
if [ "${DEVICE_CHECK_BENCHES:-}" = none ] || [ "$benches_possible" = 0 ]; then
  benches=()
elif [ -n "${DEVICE_CHECK_BENCHES:-}" ]; then
  read -r -a benches <<< "$DEVICE_CHECK_BENCHES"
else
  benches=()
  for source in "$root"/bench/*.cu; do
    [ -e "$source" ] || continue
    stem=$(basename "$source" .cu)
    if [ -f "$root/bench/$stem.cpp" ]; then benches+=("bench_${stem}_cuda")
    else benches+=("bench_$stem"); fi
  done
fi
note "CUDA tests: ${tests[*]:-(none)}"
note "CUDA benchmarks: ${benches[*]:-(none)}"
if [ ${#tests[@]} -eq 0 ]; then
  fail "no CUDA tests registered (is doctest found? is CUDA on?)"
fi

# ---------------------------------------------------------------------------
phase "build (${#tests[@]} tests, ${#benches[@]} benchmarks, -j$jobs)"
# ---------------------------------------------------------------------------
targets=("${tests[@]}" "${benches[@]}")
keep_going=(-k)  # build what can be built: one broken file must not hide the others
if grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$build/CMakeCache.txt"; then keep_going=(-k 0); fi
if [ ${#targets[@]} -gt 0 ]; then
  if ! logged "build" cmake --build "$build" -j "$jobs" --target "${targets[@]}" -- \
       "${keep_going[@]}"; then
    fail "build (see env.txt)"
    # The first errors of the build section (the log above it is configure's).
    sed -n '/^===== build: /,$p' "$env_log" | grep -E -B 2 -A 12 'error|FAILED' |
      head -n 60 || true
  fi
fi

# Locates a built executable (tests sit in build/device/tests/<dir>/, benches in bench/).
find_exe() { find "$build/$1" -type f -name "$2" -perm -u+x 2>/dev/null | head -n 1; }

# ---------------------------------------------------------------------------
phase "CUDA tests (ctest -L cuda)"
# ---------------------------------------------------------------------------
tests_s=$(cap "$test_timeout_s")
if [ ${#tests[@]} -gt 0 ] && [ "$tests_s" -lt 10 ]; then
  fail "no time left for the CUDA tests"
elif [ ${#tests[@]} -gt 0 ]; then
  # Only the selected tests, by exact name (dots are regex metacharacters).
  regex="^($(printf '%s|' "${tests[@]}" | sed 's/\./\\./g; s/|$//'))\$"
  note "at most ${tests_s}s"
  set +e
  (cd "$build" && timeout -k 10 "$((tests_s + 5))" ctest -L cuda -R "$regex" \
     --output-on-failure --no-tests=error --timeout "$tests_s") 2>&1 | tee "$out/tests.txt"
  ctest_rc=${PIPESTATUS[0]}
  set -e
  # ctest counts a skipped test (exit 77) as "not failed"; on a GPU machine it is.
  # Lines like "1/2 Test #27: cuda.test_cuda_codec .....***Skipped   3.21 sec".
  skipped=$(sed -n 's/.*Test *#[0-9]*: \([^ ]*\) .*\*\*\*Skipped.*/\1/p' "$out/tests.txt" |
            paste -s -d ' ')
  tests_summary=$(grep -E 'tests passed' "$out/tests.txt" | tail -n 1 || true)
  if [ -n "$skipped" ]; then
    tests_summary+=" ($(wc -w <<< "$skipped") of them skipped)"
  fi
  # ctest shows the output of a passing or skipped test nowhere; its log has every
  # test's full output (doctest's case and assertion counts, the reason for a skip).
  ctest_log=$build/Testing/Temporary/LastTest.log
  if [ -f "$ctest_log" ]; then
    { echo; echo "===== every test's output ($ctest_log)"; cat "$ctest_log"; } \
      >> "$out/tests.txt"
    grep -E '^\[doctest\] (test cases|assertions):' "$ctest_log" | sed 's/^/  /' || true
  fi
  if [ -n "$skipped" ]; then
    fail "CUDA tests reported themselves skipped (no usable CUDA device?): $skipped"
    grep -h '^SKIPPED:' "$out/tests.txt" | sort -u | head -n 3 | sed 's/^/  /' || true
  fi
  if [ "$ctest_rc" -ne 0 ]; then
    fail "ctest exited $ctest_rc: ${tests_summary:-see tests.txt}"
  fi
fi

# ---------------------------------------------------------------------------
phase "CUDA benchmarks"
# ---------------------------------------------------------------------------
for bench in "${benches[@]}"; do
  exe=$(find_exe bench "$bench")
  if [ -z "$exe" ]; then
    fail "$bench was not built"
    bench_results+=("$bench: not built")
    continue
  fi
  bench_s=$(cap "$bench_timeout_s")
  if [ "$bench_s" -lt 20 ]; then
    fail "no time left for $bench"
    bench_results+=("$bench: not run (no time left)")
    continue
  fi
  note "running $bench (at most ${bench_s}s)"
  set +e
  LD_LIBRARY_PATH=$bench_ld_path timeout -k 10 "$bench_s" "$exe" \
    --benchmark_out="$out/$bench.json" --benchmark_out_format=json 2>&1 | tee "$out/$bench.txt"
  rc=${PIPESTATUS[0]}
  set -e
  # Without a device the harness prints "no CUDA device, nothing to measure" and
  # exits 0 without writing JSON: that is not a result either.
  if grep -q 'no CUDA device' "$out/$bench.txt"; then
    fail "$bench: no CUDA device, nothing measured"
    bench_results+=("$bench: no CUDA device")
  elif [ "$rc" -ne 0 ]; then
    fail "$bench exited $rc$([ "$rc" -eq 124 ] && echo " (timed out after ${bench_s}s)")"
    bench_results+=("$bench: exit $rc")
  elif [ ! -s "$out/$bench.json" ]; then
    fail "$bench wrote no JSON"
    bench_results+=("$bench: no JSON")
  else
    count=$(grep -c '"run_name"' "$out/$bench.json" || true)
    bench_results+=("$bench: ok, $count results")
  fi
done

# ---------------------------------------------------------------------------
phase "compute-sanitizer memcheck"
# ---------------------------------------------------------------------------
sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ] && [ -x "$(dirname "$(command -v nvcc)")/compute-sanitizer" ]; then
  sanitizer=$(dirname "$(command -v nvcc)")/compute-sanitizer
fi
sanitizer_summary=""
left_s=$(cap "$sanitizer_s")
if [ -z "$sanitizer" ]; then
  sanitizer_summary="not run: compute-sanitizer not found"
elif [ ${#tests[@]} -eq 0 ]; then
  sanitizer_summary="not run: no CUDA tests"
elif [ "$left_s" -lt 30 ]; then
  sanitizer_summary="not run: only ${left_s}s left (limit ${limit_s}s)"
else
  # Memcheck slows kernels down many times over; the tests share what is left of
  # the limit, and one that runs out is reported as cut off, not as failed.
  per_test_s=$((left_s / ${#tests[@]}))
  { "$sanitizer" --version | tail -n 1; echo "per test: ${per_test_s}s"; } \
    > "$out/sanitizer.txt"
  for test in "${tests[@]}"; do
    exe=$(find_exe tests "$test")
    if [ -z "$exe" ]; then
      sanitizer_summary+="$test: not built; "
      continue
    fi
    note "memcheck $test (at most ${per_test_s}s)"
    one_log=$build/sanitizer_$test.log
    set +e
    # Tests read their data relative to build/device/tests (CTest's working directory).
    (cd "$build/tests" && timeout -k 10 "$per_test_s" "$sanitizer" --tool memcheck \
       --error-exitcode 86 --print-limit 50 "$exe") > "$one_log" 2>&1
    rc=$?
    set -e
    { echo "===== $test"; cat "$one_log"; } >> "$out/sanitizer.txt"
    # Only errors memcheck reports fail the run; a sanitizer that cannot attach to
    # the device (seen on some container runtimes: "Device not supported") says
    # nothing about Lynx, and the other tests would fare no better.
    unusable=0
    if grep -q 'Device not supported' "$one_log" && [ "$rc" -ne 86 ]; then
      unusable=1
    fi
    case $rc in
      0) result="clean" ;;
      86) result="MEMCHECK ERRORS"; fail "memcheck found errors in $test (see sanitizer.txt)" ;;
      77) result="skipped (no device)" ;;  # already a failure of the test phase
      124 | 137) result="cut off after ${per_test_s}s (not counted as a failure)" ;;
      *) result="exit $rc" ;;
    esac
    if [ "$unusable" = 1 ]; then
      result="compute-sanitizer cannot run here (exit $rc; not counted as a failure)"
    elif [[ $result == "exit $rc" ]]; then
      fail "$test exited $rc under memcheck (see sanitizer.txt)"
    fi
    echo "===== $test: $result" >> "$out/sanitizer.txt"
    sanitizer_summary+="$test: $result; "
    [ "$unusable" = 0 ] || break
  done
fi
sanitizer_summary=${sanitizer_summary%; }
if [ ! -f "$out/sanitizer.txt" ]; then echo "$sanitizer_summary" > "$out/sanitizer.txt"; fi
note "sanitizer: $sanitizer_summary"
end_phase

finish
