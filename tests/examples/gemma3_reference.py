#!/usr/bin/env python3
"""Independent numpy reference forward pass for Gemma-3-270M stored as GGUF.

Written from the published facts of the Gemma 3 architecture and the GGUF
file's metadata (not from llama.cpp or transformers code).  Used in CI to check the C++ forward pass of Lynx.

Reading and dequantization use the `gguf` python package; everything else is
plain numpy.  The default precision is float64 (weights are dequantized once,
to float32 by gguf, then widened to float64, which is exact), so the reference
is more accurate than a float32 forward; `dtype=np.float32` gives an fp32
variant used to size the comparison tolerance.

CLI:
    python3 gemma3_reference.py --model M --tokens 2,818,5279,... [--out logits.npy]
        computes the logits of every position (causal prefill), prints the
        top-5 token ids/logits per position and optionally saves them as a
        float32 [n, vocab] .npy file.
    --greedy N     additionally continue the sequence greedily for N tokens.
    --last K       only compute (and save) the logits of the last K positions.
    --no-window    disable the sliding window (diagnostics only).
    --fp32         run the float32 variant instead of float64.
"""

import argparse
import math
import os
import sys
import time

# Small matrices (a few tokens x 640) are much slower with OpenBLAS's threads
# than without on a busy 2-core machine (4 s vs 0.3 s per forward here); the
# caller can still override this by setting the variable.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the thread setting)

# Defaults for keys the GGUF file does not carry (the Gemma 3 architecture as published).
DEFAULT_SWA_PERIOD = 6          # last layer of every six is global
DEFAULT_ROPE_BASE_SWA = 10000.0  # sliding-window layers
DEFAULT_ROPE_BASE = 1000000.0    # global layers (also in the file)
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_RMS_EPS = 1e-6

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def default_model_path():
    """--model fallback: $LYNX_GEMMA3_GGUF, else the Lynx model cache."""
    env = os.environ.get("LYNX_GEMMA3_GGUF")
    if env:
        return env
    cache = os.environ.get("LYNX_MODEL_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(
            os.path.expanduser("~"), ".cache")
        cache = os.path.join(xdg, "lynx")
    return os.path.join(cache, DEFAULT_MODEL_NAME)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Gemma3Reference:
    """Gemma-3 text model forward pass over dequantized GGUF weights."""

    def __init__(self, path, dtype=np.float64, naive=False):
        import gguf  # imported here so the check script can report a skip
        self.gguf = gguf
        self.path = path
        self.dtype = np.dtype(dtype)
        # naive=True (diagnostic, slow): every dot product and sum of squares is
        # accumulated strictly sequentially in self.dtype, like a plain C++ loop,
        # instead of BLAS's blocked sums; used to size the CI tolerance.
        self.naive = bool(naive)
        # kv_dtype (diagnostic): round K (after RoPE) and V to this type, to see
        # what an fp16 KV cache would cost; None keeps them in self.dtype.
        self.kv_dtype = None
        self.reader = gguf.GGUFReader(path)
        r = self.reader
        arch = _field(r, "general.architecture", "gemma3")
        if arch != "gemma3":
            raise ValueError(f"{path}: architecture {arch!r}, expected gemma3")
        p = "gemma3."
        self.n_embd = int(_field(r, p + "embedding_length"))
        self.n_layer = int(_field(r, p + "block_count"))
        self.n_ff = int(_field(r, p + "feed_forward_length"))
        self.n_head = int(_field(r, p + "attention.head_count"))
        self.n_head_kv = int(_field(r, p + "attention.head_count_kv"))
        self.head_dim = int(_field(r, p + "attention.key_length"))
        self.head_dim_v = int(_field(r, p + "attention.value_length", self.head_dim))
        self.eps = float(_field(r, p + "attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS))
        self.window = int(_field(r, p + "attention.sliding_window", DEFAULT_SLIDING_WINDOW))
        self.rope_base = float(_field(r, p + "rope.freq_base", DEFAULT_ROPE_BASE))
        self.rope_base_swa = float(_field(r, p + "rope.freq_base_swa", DEFAULT_ROPE_BASE_SWA))
        self.rope_dim = int(_field(r, p + "rope.dimension_count", self.head_dim))
        period = _field(r, p + "attention.sliding_window_pattern", None)
        if isinstance(period, list):  # per-layer boolean pattern (True = sliding)
            self.is_sliding = [bool(x) for x in period]
        else:
            period = int(period) if period is not None else DEFAULT_SWA_PERIOD
            self.is_sliding = [(i % period) != period - 1 for i in range(self.n_layer)]
        if _field(r, p + "final_logit_softcapping") or _field(r, p + "attn_logit_softcapping"):
            raise NotImplementedError("softcapping present; Gemma 3 should have none")
        if self.rope_dim != self.head_dim:
            raise NotImplementedError("partial RoPE not supported")
        self.bos = int(_field(r, "tokenizer.ggml.bos_token_id", 2))
        self._tensors = {t.name: t for t in r.tensors}
        self._cache = {}
        self._tokens = None
        self.vocab_size = int(self._tensors["token_embd.weight"].data.shape[0])
        self.q_scale = 1.0 / math.sqrt(self.head_dim)

    # ---- weights ---------------------------------------------------------
    def w(self, name):
        """Dequantized weight, cached; matrices are [out, in] row-major."""
        a = self._cache.get(name)
        if a is None:
            t = self._tensors[name]
            a = self.gguf.quants.dequantize(t.data, t.tensor_type)
            a = np.ascontiguousarray(a, dtype=self.dtype)
            self._cache[name] = a
        return a

    def load_all(self):
        for name in self._tensors:
            self.w(name)

    @property
    def tokens(self):
        if self._tokens is None:
            self._tokens = list(_field(self.reader, "tokenizer.ggml.tokens"))
        return self._tokens

    def decode(self, ids):
        """Concatenate the vocab pieces; '▁' is a space, <0xNN> a byte."""
        out = bytearray()
        for i in ids:
            piece = self.tokens[int(i)]
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(int(piece[3:5], 16))
            else:
                out += piece.replace("\u2581", " ").encode("utf-8")
        return out.decode("utf-8", errors="replace")

    # ---- building blocks -------------------------------------------------
    def rms_norm(self, x, weight):
        # mean of squares accumulated in float64 in both variants
        if self.naive:
            sq = np.square(x)
            ms = np.cumsum(sq, axis=-1, dtype=self.dtype)[..., -1:] / self.dtype.type(x.shape[-1])
            inv = (self.dtype.type(1) / np.sqrt(ms + self.dtype.type(self.eps))).astype(self.dtype)
            return (x * inv) * weight
        ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
        inv = (1.0 / np.sqrt(ms + self.eps)).astype(self.dtype)
        return (x * inv) * weight

    def rope(self, x, pos, base):
        """NeoX rotate-half RoPE: element j pairs with j + d/2. x: [n, h, d]."""
        d = x.shape[-1]
        half = d // 2
        inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        x1 = x[..., :half]
        x2 = x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def mm(self, x, weight):
        """x [n, in] times weight [out, in]^T -> [n, out]."""
        if not self.naive:
            return x @ weight.T
        acc = np.zeros((x.shape[0], weight.shape[0]), dtype=self.dtype)
        wt = np.ascontiguousarray(weight.T)
        for j in range(x.shape[1]):  # sequential accumulation over the inner dim
            acc += x[:, j:j + 1] * wt[j]
        return acc

    @staticmethod
    def gelu_tanh(x):
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x * x * x)))

    # ---- forward ---------------------------------------------------------
    def forward(self, token_ids, logits_for=None, use_window=True, window=None,
                return_hidden=False):
        """Causal prefill of token_ids (positions 0..n-1).

        logits_for: indices of the positions whose logits to return
        (default all).  Returns [len(logits_for), vocab] in self.dtype.
        use_window=False / window=W: diagnostics (no window / another size).
        """
        ids = np.asarray(token_ids, dtype=np.int64)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("empty token sequence")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError("token id out of range")
        dt = self.dtype
        emb = self.w("token_embd.weight")
        x = emb[ids] * dt.type(math.sqrt(self.n_embd))  # [n, 640]
        pos = np.arange(n)

        # masks: causal, plus window on sliding layers
        delta = pos[:, None] - pos[None, :]  # q_pos - k_pos
        mask_global = delta >= 0
        mask_local = mask_global & (delta < (self.window if window is None else window))
        neg = dt.type(-np.inf)

        H, Hkv, D, Dv = self.n_head, self.n_head_kv, self.head_dim, self.head_dim_v
        group = H // Hkv
        for il in range(self.n_layer):
            b = f"blk.{il}."
            sliding = self.is_sliding[il]
            h = self.rms_norm(x, self.w(b + "attn_norm.weight"))
            q = self.mm(h, self.w(b + "attn_q.weight")).reshape(n, H, D)
            k = self.mm(h, self.w(b + "attn_k.weight")).reshape(n, Hkv, D)
            v = self.mm(h, self.w(b + "attn_v.weight")).reshape(n, Hkv, Dv)
            q = self.rms_norm(q, self.w(b + "attn_q_norm.weight"))
            k = self.rms_norm(k, self.w(b + "attn_k_norm.weight"))
            base = self.rope_base_swa if sliding else self.rope_base
            q = self.rope(q, pos, base) * dt.type(self.q_scale)
            k = self.rope(k, pos, base)
            if self.kv_dtype is not None:
                k = k.astype(self.kv_dtype).astype(dt)
                v = v.astype(self.kv_dtype).astype(dt)
            mask = mask_local if (sliding and use_window) else mask_global
            attn = np.empty((n, H, Dv), dtype=dt)
            for hh in range(H):
                kh = hh // group
                s = self.mm(q[:, hh, :], k[:, kh, :])  # [n_q, n_k]
                s = np.where(mask, s, neg)
                s = s - s.max(axis=-1, keepdims=True)
                p = np.exp(s)
                if self.naive:
                    p /= np.cumsum(p, axis=-1, dtype=dt)[:, -1:]
                else:
                    p /= p.sum(axis=-1, keepdims=True)
                attn[:, hh, :] = self.mm(p, v[:, kh, :].T)
            o = self.mm(attn.reshape(n, H * Dv), self.w(b + "attn_output.weight"))
            o = self.rms_norm(o, self.w(b + "post_attention_norm.weight"))
            x = x + o

            h = self.rms_norm(x, self.w(b + "ffn_norm.weight"))
            g = self.mm(h, self.w(b + "ffn_gate.weight"))
            u = self.mm(h, self.w(b + "ffn_up.weight"))
            f = self.mm(self.gelu_tanh(g) * u, self.w(b + "ffn_down.weight"))
            f = self.rms_norm(f, self.w(b + "post_ffw_norm.weight"))
            x = x + f

        sel = np.arange(n) if logits_for is None else np.asarray(logits_for, dtype=np.int64)
        hf = self.rms_norm(x[sel], self.w("output_norm.weight"))
        out_name = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        wout = self.w(out_name)
        logits = np.empty((len(sel), wout.shape[0]), dtype=dt)
        step = 64
        for i in range(0, len(sel), step):
            logits[i:i + step] = self.mm(hf[i:i + step], wout)
        if return_hidden:
            return logits, x
        return logits

    def greedy(self, token_ids, n_new, stop_ids=(1, 106, 212), gaps=None):
        """Greedy continuation by full re-prefill per step (slow but exact).

        If gaps is a list, the top-2 logit gap of each step is appended to it
        (small gaps are steps where another engine may legitimately diverge).
        """
        ids = list(token_ids)
        new = []
        for _ in range(n_new):
            lg = self.forward(ids, logits_for=[len(ids) - 1])[0]
            t = int(np.argmax(lg))
            if gaps is not None:
                top2 = np.partition(lg, -2)[-2:]
                gaps.append(float(abs(top2[1] - top2[0])))
            new.append(t)
            ids.append(t)
            if t in stop_ids:
                break
        return new


_MODELS = {}


def get_model(path, dtype=np.float64, naive=False):
    """Per-process cache of loaded models (weights dequantized once)."""
    key = (os.path.abspath(path), np.dtype(dtype).str, bool(naive))
    m = _MODELS.get(key)
    if m is None:
        m = Gemma3Reference(path, dtype, naive)
        _MODELS[key] = m
    return m


def parse_tokens(s):
    return [int(t) for t in s.replace(" ", "").split(",") if t != ""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: $LYNX_GEMMA3_GGUF "
                    "or ${LYNX_MODEL_CACHE:-${XDG_CACHE_HOME:-~/.cache}/lynx}/" + DEFAULT_MODEL_NAME + ")")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 2,818,5279")
    ap.add_argument("--out", default=None, help="write float32 [n, vocab] logits (.npy)")
    ap.add_argument("--last", type=int, default=0, help="only the last K positions")
    ap.add_argument("--greedy", type=int, default=0, help="greedy-continue N tokens")
    ap.add_argument("--no-window", action="store_true", help="disable sliding window")
    ap.add_argument("--fp32", action="store_true", help="float32 variant instead of float64")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)

    path = args.model or default_model_path()
    ids = parse_tokens(args.tokens)
    t0 = time.time()
    m = get_model(path, np.float32 if args.fp32 else np.float64)
    m.load_all()
    t1 = time.time()
    n = len(ids)
    sel = list(range(n)) if args.last <= 0 else list(range(max(0, n - args.last), n))
    logits = m.forward(ids, logits_for=sel, use_window=not args.no_window)
    t2 = time.time()
    print(f"# model {path}  dtype {m.dtype.name}  load {t1 - t0:.1f}s  forward({n} tokens) {t2 - t1:.2f}s",
          file=sys.stderr)
    for row, p in enumerate(sel):
        lg = logits[row]
        top = np.argsort(-lg)[:args.top]
        items = "  ".join(f"{int(t)}:{lg[t]:.4f}({m.tokens[int(t)]!r})" for t in top)
        print(f"pos {p:4d} tok {ids[p]:6d} {m.tokens[ids[p]]!r:>14}  top: {items}")
    if args.out:
        np.save(args.out, logits.astype(np.float32))
        print(f"# wrote {args.out} {logits.shape} float32", file=sys.stderr)
    if args.greedy > 0:
        gaps = []
        new = m.greedy(ids, args.greedy, gaps=gaps)
        print("greedy ids:", ",".join(str(t) for t in new))
        print("top-2 gaps:", " ".join(f"{g:.3f}" for g in gaps))
        print("prompt:", repr(m.decode(ids[1:] if ids and ids[0] == m.bos else ids)))
        print("greedy text:", repr(m.decode(new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
