#!/usr/bin/env bash
# Usage: bash cmake/device_bundle.sh DIR        (Lynx convention: DIR = .device)
#
# Copies into DIR a small relocatable prefix holding the third-party packages that
# building and running Lynx's CUDA tests and benchmarks needs, for a GPU machine
# that has nvcc, CMake and a host compiler but no doctest, Google Benchmark or
# xxHash and no network. Run it on Debian 12 with doctest-dev, libbenchmark-dev
# and libxxhash-dev installed (cmake/bootstrap.sh installs them), copy DIR to the
# GPU machine along with the source tree, and run bench/device_check.sh there.
# `/.device/` is git-ignored, so the bundle never ends up in a commit.
#
# DIR keeps the layout the packages have under /usr, because their CMake package
# files find the headers and libraries relative to their own location:
#   DIR/include/{doctest,benchmark}/..., DIR/include/xxhash.h (+ xxh3.h, xxh_x86dispatch.h)
#   DIR/lib/cmake/doctest/                        doctest config (prefix made relative here)
#   DIR/lib/x86_64-linux-gnu/cmake/benchmark/     Google Benchmark config
#   DIR/lib/x86_64-linux-gnu/libbenchmark.so*, libbenchmark_main.a
#   DIR/lib/x86_64-linux-gnu/libxxhash.so*        XXH3 with run-time SIMD dispatch
#   DIR/fallback/libstdc++.so.6                   only used where the GPU machine's
#                                                 libstdc++ is too old for libbenchmark
#   DIR/MANIFEST.txt                              package versions and checksums
# At the end it configures a throw-away CMake project against DIR alone and fails
# unless every imported path resolves inside DIR. Prints the bundle size.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

if [ $# -ne 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  usage >&2
  exit 2
fi

arch_dir=lib/x86_64-linux-gnu  # Debian's multiarch libdir; the packages' configs assume it
packages=(doctest-dev libbenchmark-dev libbenchmark1debian libxxhash-dev libxxhash0)

for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    echo "device_bundle: package $pkg is not installed (run cmake/bootstrap.sh)" >&2
    exit 1
  fi
done

# The old include/ and lib/ are deleted below, so only ever in a folder that is
# empty or holds an earlier bundle (a mistyped DIR such as /usr must not lose them).
if [ -d "$1" ] && [ -n "$(ls -A "$1")" ] && [ ! -f "$1/MANIFEST.txt" ]; then
  echo "device_bundle: $1 is not empty and holds no earlier bundle; refusing to write there" >&2
  exit 1
fi
mkdir -p "$1"
dest=$(cd "$1" && pwd)
# Start from empty so files from an older bundle (another package version) cannot linger.
rm -rf "${dest:?}/include" "${dest:?}/lib" "${dest:?}/fallback" "${dest:?}/MANIFEST.txt"

# Copies /usr/<rel> to DIR/<rel>; symbolic links stay links (-P), so the SONAME
# chain libbenchmark.so -> .so.1debian -> .so.1.7.1 survives as it is on Debian.
copy_from_usr() {
  local rel
  for rel in "$@"; do
    mkdir -p "$dest/$(dirname "$rel")"
    cp -P "/usr/$rel" "$dest/$rel"
  done
}

# Lists the files (and links) of a package under /usr/<prefix>, relative to /usr,
# so that a file added by a newer package version is not silently left behind.
package_files() {
  local pkg=$1 prefix=$2
  dpkg -L "$pkg" | while read -r path; do
    case "$path" in
      "/usr/$prefix"*)
        if [ -f "$path" ] || [ -L "$path" ]; then echo "${path#/usr/}"; fi ;;
    esac
  done
}

# doctest: header-only; its config files plus the header.
mapfile -t files < <(package_files doctest-dev include/; package_files doctest-dev lib/cmake/)
copy_from_usr "${files[@]}"

# Google Benchmark: headers, config, the shared library with its SONAME links and
# the static benchmark_main. pkg-config files are left out (CMake uses the config).
mapfile -t files < <(package_files libbenchmark-dev include/
                     package_files libbenchmark-dev "$arch_dir/")
mapfile -t files < <(printf '%s\n' "${files[@]}" | grep -v '/pkgconfig/')
copy_from_usr "${files[@]}"
mapfile -t files < <(package_files libbenchmark1debian "$arch_dir/")
copy_from_usr "${files[@]}"

# xxHash: cmake/Findxxhash.cmake needs xxhash.h, and links libxxhash when its XXH3
# run-time dispatch symbol links (fast checksums); the shared library suffices.
mapfile -t files < <(package_files libxxhash-dev include/
                     package_files libxxhash-dev "$arch_dir/" | grep -E '\.so$'
                     package_files libxxhash0 "$arch_dir/")
copy_from_usr "${files[@]}"

# Debian's doctestTargets.cmake hard-codes set(_IMPORT_PREFIX "/usr"); the GPU
# machine has no /usr/include/doctest, so compute the prefix from the file's own
# place instead (it sits at PREFIX/lib/cmake/doctest/).
doctest_targets="$dest/lib/cmake/doctest/doctestTargets.cmake"
if ! grep -q '^set(_IMPORT_PREFIX "/usr")$' "$doctest_targets"; then
  echo "device_bundle: $doctest_targets no longer sets _IMPORT_PREFIX to /usr;" \
       "check how this doctest version finds its prefix" >&2
  exit 1
fi
# shellcheck disable=SC2016  # ${CMAKE_CURRENT_LIST_DIR} is for CMake, not the shell
sed -i 's|^set(_IMPORT_PREFIX "/usr")$|get_filename_component(_IMPORT_PREFIX '\
'"${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)  # made relocatable by device_bundle.sh|' \
  "$doctest_targets"

# libbenchmark.so needs GLIBCXX_3.4.30 (GCC 12's libstdc++). A GPU machine with an
# older libstdc++ (RHEL 9: GCC 11) can still run the benchmarks with this newer one
# on LD_LIBRARY_PATH; device_check.sh uses it only when the system's is too old,
# since forcing an older libstdc++ on newer programs would break them.
libstdcxx=$(readlink -f "$(g++ -print-file-name=libstdc++.so.6 2>/dev/null)" || true)
if [ -z "$libstdcxx" ] || [ ! -f "$libstdcxx" ]; then
  libstdcxx=$(readlink -f "/usr/$arch_dir/libstdc++.so.6")
fi
mkdir -p "$dest/fallback"
cp -L "$libstdcxx" "$dest/fallback/libstdc++.so.6"

{
  echo "Lynx device bundle, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  dpkg-query -W -f='${Package} ${Version} ${Architecture}\n' "${packages[@]}"
  echo "fallback/libstdc++.so.6 from $libstdcxx" \
    "($(dpkg -S "$libstdcxx" 2>/dev/null | cut -d: -f1 | head -n 1))"
  echo
  (cd "$dest" && find include lib fallback -type f | sort | xargs sha256sum)
} > "$dest/MANIFEST.txt"

# Self-check: a throw-away project finds every package in DIR alone (the system
# prefixes are switched off) and each imported include dir and library must lie
# inside DIR, i.e. nothing still points at /usr.
check_dir=$(mktemp -d)
trap 'rm -rf "$check_dir"' EXIT
cat > "$check_dir/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(lynx_bundle_check LANGUAGES CXX)
set(CMAKE_FIND_USE_CMAKE_SYSTEM_PATH FALSE)
set(CMAKE_FIND_USE_SYSTEM_ENVIRONMENT_PATH FALSE)
set(CMAKE_FIND_USE_PACKAGE_REGISTRY FALSE)
find_package(doctest CONFIG REQUIRED)
find_package(benchmark CONFIG REQUIRED)
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY xxhash REQUIRED)
set(paths "${XXHASH_INCLUDE_DIR}" "${XXHASH_LIBRARY}")
foreach(target IN ITEMS doctest::doctest benchmark::benchmark benchmark::benchmark_main)
  get_target_property(inc ${target} INTERFACE_INCLUDE_DIRECTORIES)
  list(APPEND paths ${inc})
  get_target_property(type ${target} TYPE)
  if(NOT type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(loc ${target} IMPORTED_LOCATION_NONE)
    list(APPEND paths ${loc})
  endif()
endforeach()
foreach(path IN LISTS paths)
  cmake_path(IS_PREFIX BUNDLE "${path}" NORMALIZE inside)
  if(NOT inside OR NOT EXISTS "${path}")
    message(FATAL_ERROR "bundle check: ${path} is not an existing path inside ${BUNDLE}")
  endif()
  message(STATUS "bundle check: ${path}")
endforeach()
EOF
echo "device_bundle: checking that CMake resolves every package inside $dest"
if ! cmake -S "$check_dir" -B "$check_dir/build" -DBUNDLE="$dest" -DCMAKE_PREFIX_PATH="$dest" \
     > "$check_dir/log.txt" 2>&1; then
  cat "$check_dir/log.txt" >&2
  echo "device_bundle: the bundle in $dest does not resolve on its own" >&2
  exit 1
fi
grep 'bundle check:' "$check_dir/log.txt" | sed "s|$dest|DIR|"

echo "device_bundle: $(find "$dest" -type f | wc -l) files, $(du -sh "$dest" | cut -f1) in $dest"
