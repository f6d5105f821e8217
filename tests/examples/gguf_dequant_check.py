#!/usr/bin/env python3
"""Checks Lynx's GGUF dequantization against gguf-py, bit for bit, on every tensor of a model.

usage: gguf_dequant_check.py GGUF_DUMP [MODEL.gguf]

GGUF_DUMP is the examples/gguf/gguf_dump executable. MODEL defaults to
$LYNX_GEMMA3_GGUF, else the cache path cmake/fetch_gemma3.sh writes:
${LYNX_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lynx}/gemma-3-270m-q4_k_m.gguf.

gguf_dump streams every tensor dequantized to float32 ("tensor <elements> <type>
<name>" line, then the raw floats; "end <count>" at the end); this script reads it
from a pipe a chunk of rows at a time and compares each chunk with
gguf.quants.dequantize of the same rows (float32 bits as uint32, array_equal), so
neither side holds a whole tensor twice. It prints, per type, the tensors and
elements compared and, where anything differs, the count and the largest
difference in ulps.

Exit status: 0 all equal, 1 a difference or a broken stream, 77 skipped (printing
"SKIPPED: <reason>") when numpy, the gguf module or the model file is missing.
"""

import os
import subprocess
import sys
import time

SKIP = 77
CHUNK_ELEMENTS = 1 << 20  # gguf_dump's chunk size too; any whole number of rows works


def skip(reason):
    print(f"SKIPPED: {reason}")
    sys.exit(SKIP)


def default_model_path():
    if os.environ.get("LYNX_GEMMA3_GGUF"):
        return os.environ["LYNX_GEMMA3_GGUF"]
    cache = os.environ.get("LYNX_MODEL_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(xdg, "lynx")
    return os.path.join(cache, "gemma-3-270m-q4_k_m.gguf")


def read_exactly(stream, count):
    """count bytes from the pipe as a bytearray, or fewer if the stream ends."""
    buf = bytearray(count)
    view = memoryview(buf)
    got = 0
    while got < count:
        n = stream.readinto(view[got:])
        if not n:
            return buf[:got]
        got += n
    return buf


def ulp_distance(np, a_bits, b_bits):
    """Largest distance in ulps between float32 bit patterns (sign-magnitude mapped onto a line)."""
    def ordered(bits):
        b = bits.astype(np.int64)
        magnitude = b & 0x7FFFFFFF
        return np.where(b & 0x80000000, -magnitude, magnitude)
    return int(np.max(np.abs(ordered(a_bits) - ordered(b_bits))))


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dump = argv[1]
    model = argv[2] if len(argv) > 2 else default_model_path()
    try:
        import numpy as np
    except ImportError:
        skip("python module numpy is not installed (pip install numpy)")
    try:
        import gguf
    except ImportError:
        skip("python module gguf is not installed (pip install gguf)")
    if not os.path.isfile(model):
        skip(f"model file {model} not found (run cmake/fetch_gemma3.sh, or set LYNX_GEMMA3_GGUF)")
    if not os.access(dump, os.X_OK):
        print(f"FAILED: gguf_dump executable {dump} not found", file=sys.stderr)
        return 1

    start = time.monotonic()
    reader = gguf.GGUFReader(model)
    proc = subprocess.Popen([dump, model, "--dequantize"], stdout=subprocess.PIPE,
                            bufsize=1 << 20)
    stats = {}  # type name -> [tensors, elements, differing elements, max ulp]
    failures = []
    broken = None
    try:
        for t in reader.tensors:
            header = proc.stdout.readline().decode("utf-8", "replace").rstrip("\n")
            parts = header.split(" ", 3)
            if len(parts) != 4 or parts[0] != "tensor":
                broken = f"expected a tensor header for {t.name!r}, got {header[:100]!r}"
                break
            elements, type_name, name = int(parts[1]), parts[2], parts[3]
            expected_type = t.tensor_type.name
            if name != t.name or type_name != expected_type or elements != int(t.n_elements):
                broken = (f"header {header!r} does not match gguf-py's tensor "
                          f"{t.name} {expected_type} {int(t.n_elements)}")
                break
            row = int(t.shape[0])  # gguf-py's shape is the file's dims, dims[0] fastest
            rows = elements // row
            data = np.asarray(t.data).reshape(rows, -1)  # one row of bytes (or values) each
            chunk_rows = max(1, CHUNK_ELEMENTS // row)
            entry = stats.setdefault(type_name, [0, 0, 0, 0])
            differing = 0
            for r in range(0, rows, chunk_rows):
                n = min(chunk_rows, rows - r)
                reference = gguf.quants.dequantize(data[r:r + n], t.tensor_type)
                reference = np.ascontiguousarray(reference, dtype=np.float32).reshape(-1)
                raw = read_exactly(proc.stdout, n * row * 4)
                if len(raw) != n * row * 4:
                    broken = f"stream ended inside tensor {name!r} (rows {r}..{r + n})"
                    break
                got = np.frombuffer(raw, dtype="<f4")
                ref_bits = reference.view(np.uint32)
                got_bits = got.view(np.uint32)
                if not np.array_equal(ref_bits, got_bits):
                    mask = ref_bits != got_bits
                    differing += int(np.count_nonzero(mask))
                    entry[3] = max(entry[3], ulp_distance(np, ref_bits[mask], got_bits[mask]))
            if broken:
                break
            entry[0] += 1
            entry[1] += elements
            entry[2] += differing
            if differing:
                failures.append(f"{name} ({type_name}): {differing} of {elements} elements differ")
        if not broken:
            tail = proc.stdout.readline().decode("utf-8", "replace").rstrip("\n")
            if tail != f"end {len(reader.tensors)}":
                broken = f"expected 'end {len(reader.tensors)}', got {tail[:100]!r}"
    finally:
        if broken:
            proc.kill()
        proc.stdout.close()
        status = proc.wait()
    if not broken and status != 0:
        broken = f"gguf_dump exited with status {status}"

    print(f"model: {model}")
    print(f"{'type':<6} {'tensors':>8} {'elements':>12} {'differ':>8} {'max ulp':>8}")
    for type_name in sorted(stats):
        tensors, elements, differ, max_ulp = stats[type_name]
        print(f"{type_name:<6} {tensors:>8} {elements:>12} {differ:>8} {max_ulp:>8}")
    total_tensors = sum(s[0] for s in stats.values())
    total_elements = sum(s[1] for s in stats.values())
    print(f"{'all':<6} {total_tensors:>8} {total_elements:>12}   "
          f"({time.monotonic() - start:.1f} s)")
    for line in failures[:20]:
        print(f"DIFFERS: {line}")
    if broken:
        print(f"FAILED: {broken}")
        return 1
    if failures:
        print(f"FAILED: {len(failures)} tensors differ from gguf.quants.dequantize")
        return 1
    print(f"OK: all {total_tensors} tensors bitwise equal to gguf.quants.dequantize")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
