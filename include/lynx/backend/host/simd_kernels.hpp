// AVX-512 host kernels of the codecs (AVX-512 F/BW/DQ/VL, AVX512-VBMI and GFNI),
// bit-identical to the portable kernels in codec_kernels.hpp, which stay the
// fallback and the reference. Every function here carries a target attribute
// (LYNX_CODEC_AVX512_TARGET), so the kernels are compiled whatever the includer's
// -march (LYNX_CODEC_AVX512 == 1 on x86-64 with GCC or clang) and run only where
// detail::host_has_avx512_codec() says the CPU has those extensions; callers
// also test `encode_supported` / `reconstruct_supported`.
//
// Data flow of one 32-token block of one head, per 16-channel chunk q:
//   encode:      16-bit input -> float -> code (sub, mul, clamp, cvtps2dq: the same
//                IEEE operations and round-half-even as quantize_value) -> code
//                bytes, 4 tokens x 16 channels per vector (packssdw/packuswb)
//                -> byte network -> one qword per (channel, 8 tokens)
//                -> gf2p8affineqb (8x8 bit transpose) -> one byte per plane
//                -> byte network -> 16 plane words per plane, stored in place.
//   reconstruct: the same steps backwards, then fma(scale, level, zero) per element.
// Codes wider than 8 bits travel as two byte matrices: hi = code >> (B-8)
// (planes 0-7) and lo = code << (16-B) (planes 8..B-1 at the top of a byte).
// Group minima/maxima use the same (a < b ? a : b) selections as the portable
// code; where a reduction order could change which zero (+0 or -0) is kept,
// the group is recomputed by the portable loop.
#pragma once

#include <atomic>

#include "lynx/backend/host/isa.hpp"

#if LYNX_HOST_CPU_DISPATCH
#define LYNX_CODEC_AVX512 1
#else
#define LYNX_CODEC_AVX512 0
#endif

namespace lynx::detail {

/// Which kernels the host codecs (encode_into, reconstruct) may use: all that this
/// CPU runs (the default), or fewer. Tests lower it to compare every path, bit for
/// bit, in one binary; it is read once per call of a codec.
enum class codec_kernels { best, avx512_without_bf16, portable };
inline std::atomic<codec_kernels> codec_kernels_limit{codec_kernels::best};

/// True when the codecs take the AVX-512 kernels below.
inline bool use_avx512_codec() {
  return LYNX_CODEC_AVX512 && host_has_avx512_codec() &&
         codec_kernels_limit.load(std::memory_order_relaxed) != codec_kernels::portable;
}

/// True when they also convert float to bf16 with AVX512-BF16.
inline bool use_avx512_bf16_codec() {
  return use_avx512_codec() && host_has_avx512_bf16() &&
         codec_kernels_limit.load(std::memory_order_relaxed) == codec_kernels::best;
}

}  // namespace lynx::detail

#if LYNX_CODEC_AVX512

// The extensions every kernel (and every lambda in one that uses intrinsics) is
// compiled for: what host_has_avx512_codec() checks. Helpers forced inline need
// it too, as the compilers inline only into a function with at least the
// callee's extensions. Such lambdas capture by reference even when they need
// nothing: a captureless one also converts to a plain function, which would be
// compiled without the attribute.
#define LYNX_CODEC_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,gfni")))

// Unrolling hints: loops over arrays of vectors must be unrolled for the arrays to
// stay in registers, which -O2 alone does not always do.
#define LYNX_SIMD_PRAGMA(x) _Pragma(#x)
#define LYNX_SIMD_UNROLL(n) LYNX_SIMD_PRAGMA(GCC unroll n)

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/buffer.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/quant/quantizer.hpp"

// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into these kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail::simd {

/// Thrown by the fast encode on non-finite input or an overflowing range; the
/// caller reruns the portable path, which reports the canonical error.
struct needs_portable_path {};

// ---------------------------------------------------------------------------
// Byte networks: a fixed permutation of 8 vectors (512 bytes) done by three
// levels of two-source byte permutes (vpermt2b). Level L exchanges bytes
// between vectors whose index differs in bit L, moving each byte toward its
// destination vector; the last level puts it at its final position. Any
// permutation in which every input vector sends exactly 8 bytes to every
// output vector routes this way; the tables are built at compile time.
struct byte_network {
  alignas(64) std::array<std::array<std::array<std::uint8_t, 64>, 8>, 3> index{};
};

/// dest(i, p) -> {o, q}: byte p of input vector i goes to byte q of output vector o.
template <class Dest>
constexpr byte_network make_network(Dest dest) {
  byte_network net;
  std::array<int, 512> vec{}, pos{}, out_vec{}, out_pos{};
  for (int i = 0; i < 8; ++i)
    for (int p = 0; p < 64; ++p) {
      const auto d = dest(i, p);
      vec[i * 64 + p] = i;
      pos[i * 64 + p] = p;
      out_vec[i * 64 + p] = d.first;
      out_pos[i * 64 + p] = d.second;
    }
  for (int level = 0; level < 3; ++level) {
    const int bit = 1 << level;
    std::array<int, 8> fill{};
    std::array<int, 512> new_vec{}, new_pos{};
    for (int id = 0; id < 512; ++id) {
      const int n = (vec[id] & ~bit) | (out_vec[id] & bit);
      const int q = level == 2 ? out_pos[id] : fill[n]++;
      if (q >= 64) throw "byte network: a vector overflows (the permutation is not uniform)";
      net.index[level][n][q] =
          static_cast<std::uint8_t>((vec[id] == (n & ~bit) ? 0 : 64) + pos[id]);
      new_vec[id] = n;
      new_pos[id] = q;
    }
    vec = new_vec;
    pos = new_pos;
  }
  return net;
}

LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void run_network(const byte_network& net,
                                                             __m512i (&v)[8]) {
  LYNX_SIMD_UNROLL(3)
  for (int level = 0; level < 3; ++level) {
    const int bit = 1 << level;
    __m512i next[8];
    LYNX_SIMD_UNROLL(8)
    for (int n = 0; n < 8; ++n)
      next[n] = _mm512_permutex2var_epi8(v[n & ~bit], _mm512_load_si512(net.index[level][n].data()),
                                         v[n | bit]);
    LYNX_SIMD_UNROLL(8)
    for (int n = 0; n < 8; ++n) v[n] = next[n];
  }
}

// Code bytes of a chunk as the packs leave them: vector i holds tokens 4i..4i+3;
// byte 16l + k (128-bit lane l) is token 4i + k/4, channel 4l + k%4.
constexpr std::pair<int, int> packed_token_channel(int i, int p) {
  const int l = p / 16, k = p % 16;
  return {4 * i + k / 4, 4 * l + k % 4};
}
// Qword layout before the bit transpose: vector c/2, qword (c%2)*4 + t/8,
// byte 7 - t%8 (reversed, so that bit b of a plane byte is token 8g + b).
constexpr std::pair<int, int> qword_slot(int t, int c) {
  return {c / 2, ((c % 2) * 4 + t / 8) * 8 + 7 - t % 8};
}
// After the bit transpose, byte j of qword (c, g) is plane j of tokens 8g..8g+7;
// plane vector j holds the 16 plane words of the chunk: byte 4c + g.
constexpr std::pair<int, int> plane_slot(int o, int p) {
  const int k = p / 8, j = p % 8;
  const int c = 2 * o + k / 4, g = k % 4;
  return {j, 4 * c + g};
}

inline constexpr byte_network pack_gather = make_network([](int i, int p) {
  const auto tc = packed_token_channel(i, p);
  return qword_slot(tc.first, tc.second);
});
inline constexpr byte_network pack_scatter =
    make_network([](int o, int p) { return plane_slot(o, p); });

// Reconstruct runs the inverses: plane vectors -> qwords (c, g) with byte j = plane j,
// then (after the transpose, byte b of qword (c, g) = code of token 8g + b) ->
// natural rows: vector i = tokens 4i..4i+3, byte 16*(t%4) + c.
inline constexpr byte_network unpack_gather = make_network([](int j, int p) {
  const int c = p / 4, g = p % 4;
  return std::pair<int, int>{c / 2, ((c % 2) * 4 + g) * 8 + j};
});
inline constexpr byte_network unpack_scatter = make_network([](int o, int p) {
  const int k = p / 8, b = p % 8;
  const int c = 2 * o + k / 4, t = (k % 4) * 8 + b;
  return std::pair<int, int>{t / 4, 16 * (t % 4) + c};
});

// gf2p8affineqb(x, A): bit b of result byte i = parity(A.byte[7-b] & x.byte[i]);
// with x.byte[i] a single bit it is an 8x8 bit-matrix transpose of A.
inline constexpr long long planes_of_tokens = 0x0102040810204080LL;  // x.byte[i] = 1 << (7-i)
inline constexpr long long tokens_of_planes =
    static_cast<long long>(0x8040201008040201ULL);  // x.byte[i] = 1 << i

// ---------------------------------------------------------------------------
// Element loads and stores (16 elements).

template <class T>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, bf16>) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    // vcvtph2ps is exact for every finite half, as fp16_bits_to_float; non-finite
    // input is rejected (and reported by the portable path) anyway.
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

template <class T>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void store16(T* p, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else if constexpr (std::is_same_v<T, bf16>) {
    // float_to_bf16_bits: round to nearest even on the bits; NaN keeps its top
    // bits with the quiet bit set. (vcvtneps2bf16 flushes denormals, so not used.)
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// quantize_value with vectors: clamp((x - zero) * inv, 0, max) then round half to
// even (cvtps2dq in the default rounding mode equals (t + 2^23) - 2^23 for
// 0 <= t < 2^23).
template <int Bits>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512i quantize16(__m512 x, __m512 zero, __m512 inv) {
  __m512 t = _mm512_mul_ps(_mm512_sub_ps(x, zero), inv);
  t = _mm512_max_ps(t, _mm512_setzero_ps());                                 // t > 0 ? t : 0
  t = _mm512_min_ps(t, _mm512_set1_ps(static_cast<float>(max_code<Bits>)));  // t < max ? t : max
  return _mm512_cvtps_epi32(t);
}

// bf16_round_down / bf16_round_up (quantizer.hpp) of 16 floats.
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512 bf16_round16(__m512 x, bool up) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i t = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  __mmask16 bump = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0xffff));
  if (!up) bump &= _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512());  // negative: sign bit set
  return _mm512_castsi512_ps(_mm512_mask_add_epi32(t, bump, t, _mm512_set1_epi32(0x10000)));
}

// make_group_params + inverse_scale for 16 groups: `lo` (the minima) becomes the
// zero points; sets `bad` on an overflowing range.
template <int Bits>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void group_params16(__m512& lo, __m512 hi,
                                                                __m512& scale, __m512& inv,
                                                                __mmask16& bad) {
  lo = bf16_round16(lo, false);
  const __m512 range = _mm512_sub_ps(hi, lo);
  bad |= _mm512_cmp_ps_mask(range, _mm512_set1_ps(3.4028234663852886e38f), _CMP_NLE_UQ);
  const __mmask16 nonconstant =
      _mm512_cmp_ps_mask(range, _mm512_set1_ps(min_group_range), _CMP_GE_OQ);
  scale = bf16_round16(
      _mm512_maskz_div_ps(nonconstant, range, _mm512_set1_ps(static_cast<float>(max_code<Bits>))),
      true);
  const __mmask16 positive = _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_GT_OQ);
  inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0f), scale);
}

// Accumulates NaN when x holds a NaN or an infinity (x * 0 is then NaN).
/// Group minima lo and maxima hi of 16 groups where one is a zero: which zero
/// (+0 or -0) the portable loop keeps depends on the order of its comparisons, so
/// the lanes of `live` with a zero extreme are recomputed by that loop over
/// elem(lane, c), c = 0 .. n-1.
template <class Elem>
LYNX_CODEC_AVX512_TARGET inline void redo_zero_extremes(__m512& lo, __m512& hi, __mmask16 live,
                                                        int n, Elem&& elem) {
  const __mmask16 zeros = (_mm512_cmp_ps_mask(lo, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                           _mm512_cmp_ps_mask(hi, _mm512_setzero_ps(), _CMP_EQ_OQ)) &
                          live;
  if (!zeros) return;
  alignas(64) float l[16], u[16];
  _mm512_store_ps(l, lo);
  _mm512_store_ps(u, hi);
  for (int lane = 0; lane < 16; ++lane)
    if (zeros >> lane & 1) {
      float a = elem(lane, 0), m = a;
      for (int c = 0; c < n; ++c) {
        const float e = elem(lane, c);
        a = e < a ? e : a;
        m = e > m ? e : m;
      }
      l[lane] = a;
      u[lane] = m;
    }
  lo = _mm512_load_ps(l);
  hi = _mm512_load_ps(u);
}

LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512 track_non_finite(__m512 acc, __m512 x) {
  return _mm512_fmadd_ps(x, _mm512_setzero_ps(), acc);
}

// Reduces 16 vectors to one: lane k = min (max) over the lanes of m[k]. Pairwise
// merges halve the lanes per group; values are exact, the sign of a zero result
// is not (callers recompute such groups).
struct reduce_tables {
  alignas(64) std::int32_t x[4][16]{}, y[4][16]{};
};
constexpr reduce_tables make_reduce_tables() {
  reduce_tables r;
  int step = 0;
  for (int width = 16; width > 1; width /= 2, ++step) {
    const int half = width / 2;
    for (int lane = 0; lane < 16; ++lane) {
      // lanes 0-7 from the first vector, 8-15 from the second (index + 16)
      const int side = lane < 8 ? 0 : 16, within = lane % 8, group = within / half,
                sub = within % half;
      r.x[step][lane] = side + group * width + sub;
      r.y[step][lane] = side + group * width + sub + half;
    }
  }
  return r;
}
inline constexpr reduce_tables reduce_index = make_reduce_tables();

template <bool Max>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512 reduce16(__m512 (&m)[16]) {
  int count = 16;
  LYNX_SIMD_UNROLL(4)
  for (int step = 0; step < 4; ++step) {
    const __m512i x_index = _mm512_load_si512(reduce_index.x[step]),
                  y_index = _mm512_load_si512(reduce_index.y[step]);
    LYNX_SIMD_UNROLL(8)
    for (int k = 0; k < count / 2; ++k) {
      const __m512 x = _mm512_permutex2var_ps(m[2 * k], x_index, m[2 * k + 1]);
      const __m512 y = _mm512_permutex2var_ps(m[2 * k], y_index, m[2 * k + 1]);
      m[k] = Max ? _mm512_max_ps(x, y) : _mm512_min_ps(x, y);
    }
    count /= 2;
  }
  return m[0];
}

/// Outputs (reconstructed K+V, or encoded segments) at least this large are written with
/// non-temporal stores (where a 64-byte store is aligned): they would not stay in cache anyway, and
/// streaming saves reading every output line before it is overwritten.
#ifndef LYNX_STREAM_MIN_BYTES
#define LYNX_STREAM_MIN_BYTES (std::int64_t{16} << 20)
#endif
inline constexpr std::int64_t stream_store_min_bytes = LYNX_STREAM_MIN_BYTES;

/// The same for the plane words of encoded segments (all streams of a layer together):
/// the encoder never reads them back, and streaming them spares the read of every
/// line before it is written, which costs more than the checksum pass then loses.
#ifndef LYNX_ENCODE_STREAM_MIN_BYTES
#define LYNX_ENCODE_STREAM_MIN_BYTES (std::int64_t{4} << 20)
#endif
inline constexpr std::int64_t encode_stream_min_bytes = LYNX_ENCODE_STREAM_MIN_BYTES;

// ---------------------------------------------------------------------------
// Encode.

template <class T>
bool encode_supported(const kv_view<const T, host_space>& keys,
                      const kv_view<const T, host_space>& values, const layer_geometry& g) {
  return keys.channel_stride == 1 && values.channel_stride == 1 && g.head_dim % 16 == 0 &&
         g.value_group % 16 == 0 &&
         (g.key_group % tokens_per_word == 0 || tokens_per_word % g.key_group == 0);
}

/// Tokens of one work unit: whole blocks and whole key groups.
inline std::int64_t unit_tokens(const layer_geometry& g) {
  return std::max<std::int64_t>(g.key_group, tokens_per_word);
}

/// The K and V rows of the next work item (head h, tokens [t0, t1)), asked into L1
/// a row at a time while the current item is encoded: rows of one head are 2 KB
/// apart in a token-major cache, a pattern the hardware prefetchers do not follow.
template <class T>
struct next_rows {
  const kv_view<const T, host_space>* keys = nullptr;
  const kv_view<const T, host_space>* values = nullptr;
  std::int64_t h = 0, t0 = 0, t1 = 0;  // t1 == t0: no next item
  LYNX_ALWAYS_INLINE void prefetch_key_row(std::int64_t i) const {
    if (t0 + i < t1)
      prefetch_lines<3>(&(*keys)(t0 + i, h, 0),
                        keys->shape.head_dim * static_cast<std::int64_t>(sizeof(T)));
  }
  LYNX_ALWAYS_INLINE void prefetch_value_row(std::int64_t i) const {
    if (t0 + i < t1)
      prefetch_lines<3>(&(*values)(t0 + i, h, 0),
                        values->shape.head_dim * static_cast<std::int64_t>(sizeof(T)));
  }
};

// Min and max of 16 value groups (PerGroup chunks each, at gp[k]) reduced as reduce16 does,
// evaluated depth first so the partial results stay in registers. Non-finite input
// gives NaN in nf; each group has its own accumulator (no serial chain of fmas).
template <int PerGroup, class T>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void group_minmax(const T* p, __m512& nf, __m512& l,
                                                              __m512& u) {
  l = load16(p);
  u = l;
  nf = _mm512_mul_ps(l, _mm512_setzero_ps());
  LYNX_SIMD_UNROLL(4)
  for (int i = 1; i < PerGroup; ++i) {
    const __m512 v = load16(p + 16 * i);
    nf = track_non_finite(nf, v);
    l = _mm512_min_ps(v, l);
    u = _mm512_max_ps(v, u);
  }
}

template <int Width, int PerGroup, class T>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void reduce_groups(const T* const* gp, __m512& nf,
                                                               __m512& l, __m512& u) {
  if constexpr (Width == 1) {
    group_minmax<PerGroup>(gp[0], nf, l, u);
  } else {
    __m512 nfa, la, ua, nfb, lb, ub;
    reduce_groups<Width / 2, PerGroup>(gp, nfa, la, ua);
    reduce_groups<Width / 2, PerGroup>(gp + Width / 2, nfb, lb, ub);
    constexpr int step = Width == 2 ? 0 : Width == 4 ? 1 : Width == 8 ? 2 : 3;
    const __m512i x_index = _mm512_load_si512(reduce_index.x[step]),
                  y_index = _mm512_load_si512(reduce_index.y[step]);
    l = _mm512_min_ps(_mm512_permutex2var_ps(la, x_index, lb),
                      _mm512_permutex2var_ps(la, y_index, lb));
    u = _mm512_max_ps(_mm512_permutex2var_ps(ua, x_index, ub),
                      _mm512_permutex2var_ps(ua, y_index, ub));
    nf = _mm512_add_ps(nfa, nfb);
  }
}

// Key group minima/maxima of NQ chunks from channel 16 q0, tokens [t0, t1), as the
// portable loop (l = v < l ? v : l from the first token); one NaN accumulator per chunk.
template <int NQ, class T>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void key_minmax(
    const kv_view<const T, host_space>& keys, std::int64_t h, std::int64_t q0, std::int64_t t0,
    std::int64_t t1, const next_rows<T>& next, std::int64_t u0, __m512 (&lo)[8], __m512 (&hi)[8],
    __m512& non_finite) {
  __m512 nf[NQ];
  LYNX_SIMD_UNROLL(8)
  for (int k = 0; k < NQ; ++k) {
    lo[k] = hi[k] = load16(&keys(t0, h, 16 * (q0 + k)));
    nf[k] = _mm512_setzero_ps();
  }
  for (std::int64_t t = t0; t < t1; ++t) {
    if (q0 == 0) next.prefetch_key_row(t - u0);
    const T* row = &keys(t, h, 16 * q0);
    LYNX_SIMD_UNROLL(8)
    for (int k = 0; k < NQ; ++k) {
      const __m512 v = load16(row + 16 * k);
      nf[k] = track_non_finite(nf[k], v);
      lo[k] = _mm512_min_ps(v, lo[k]);
      hi[k] = _mm512_max_ps(v, hi[k]);
    }
  }
  LYNX_SIMD_UNROLL(8)
  for (int k = 0; k < NQ; ++k) non_finite = _mm512_add_ps(non_finite, nf[k]);
}

/// Per-thread scratch of the encoder.
struct encode_scratch {
  std::vector<float> key_inv;                // [key groups in a unit][head_dim]
  std::vector<float> value_zero, value_inv;  // [32 tokens][value groups]
  aligned_buffer stage_hi_bytes,
      stage_lo_bytes;  // [head_dim / 16][8] vectors of code bytes of one block
  __m512i* stage_hi = nullptr;
  __m512i* stage_lo = nullptr;
  bool stream = false;  // plane words with non-temporal stores (large segments)
  void size_for(const layer_geometry& g) {
    const std::int64_t D = g.head_dim;
    key_inv.resize(static_cast<std::size_t>(ceil_div(unit_tokens(g), g.key_group) * D));
    value_zero.resize(static_cast<std::size_t>(tokens_per_word * g.value_channel_groups() + 16));
    value_inv.resize(value_zero.size());
    stage_hi_bytes = aligned_buffer(static_cast<std::size_t>(D / 16 * 8) * sizeof(__m512i));
    stage_lo_bytes = aligned_buffer(stage_hi_bytes.size());
    stage_hi = reinterpret_cast<__m512i*>(stage_hi_bytes.data());
    stage_lo = reinterpret_cast<__m512i*>(stage_lo_bytes.data());
  }
};

// Splits 4 code vectors (4 tokens, 16 channels each) into hi/lo code bytes.
template <int Bits>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void stage_codes(__m512i c0, __m512i c1, __m512i c2,
                                                             __m512i c3, __m512i* hi, __m512i* lo) {
  if constexpr (Bits == 8) {
    *hi = _mm512_packus_epi16(_mm512_packs_epi32(c0, c1), _mm512_packs_epi32(c2, c3));
  } else {
    constexpr int down = Bits - 8, up = 16 - Bits;
    const __m512i byte = _mm512_set1_epi32(0xff);
    *hi = _mm512_packus_epi16(
        _mm512_packs_epi32(_mm512_srli_epi32(c0, down), _mm512_srli_epi32(c1, down)),
        _mm512_packs_epi32(_mm512_srli_epi32(c2, down), _mm512_srli_epi32(c3, down)));
    *lo =
        _mm512_packus_epi16(_mm512_packs_epi32(_mm512_and_si512(_mm512_slli_epi32(c0, up), byte),
                                               _mm512_and_si512(_mm512_slli_epi32(c1, up), byte)),
                            _mm512_packs_epi32(_mm512_and_si512(_mm512_slli_epi32(c2, up), byte),
                                               _mm512_and_si512(_mm512_slli_epi32(c3, up), byte)));
  }
}

// Packs the staged code bytes of one block into plane words: planes [first, first + count)
// of every chunk, written to plane_rows[first + j] + 16 q.
LYNX_CODEC_AVX512_TARGET inline void pack_stage(const __m512i* stage, std::int64_t D, int first,
                                                int count, std::uint32_t* const* plane_rows,
                                                bool stream) {
  const __m512i transpose = _mm512_set1_epi64(planes_of_tokens);
  for (int j = 0; j < count; ++j)
    stream = stream && (reinterpret_cast<std::uintptr_t>(plane_rows[first + j]) & 63) == 0;
  for (std::int64_t q = 0; q < D / 16; ++q) {
    __m512i v[8];
    LYNX_SIMD_UNROLL(8)
    for (int i = 0; i < 8; ++i) v[i] = stage[q * 8 + i];
    run_network(pack_gather, v);
    LYNX_SIMD_UNROLL(8)
    for (int i = 0; i < 8; ++i) v[i] = _mm512_gf2p8affine_epi64_epi8(transpose, v[i], 0);
    run_network(pack_scatter, v);
    // j < 8 with a test, not j < count: unrolled, every v[j] stays in a register
    LYNX_SIMD_UNROLL(8)
    for (int j = 0; j < 8; ++j) {
      if (j >= count) break;
      std::uint32_t* dst = plane_rows[first + j] + 16 * q;
      if (stream)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v[j]);
      else
        _mm512_storeu_si512(dst, v[j]);
    }
  }
}

// ---------------------------------------------------------------------------
// Encode of one whole 32-token block of bf16 K and V with groups of 32 (keys: a
// channel over the block's 32 tokens; values: a token over 32 channels), 8-bit
// codes and head_dim 128: the common case, with fewer operations per element than
// encode_unit's general loops. Per 32-channel slice of a head (32 rows of 32
// channels, one zmm of bf16 per row):
//   key min/max    on the bf16 bits as integers: signed max, unsigned min and
//                  unsigned max of the rows give the float min and max of every
//                  channel and flag NaN and infinity (3 ops per row);
//   value min/max  per row on order-preserving integers (x ^ (x >> 15 & 0x7fff)),
//                  reduced for 32 rows at once by a tree of in-lane shuffles;
//   quantize       even and odd channels as floats (x << 16, x & 0xffff0000), then
//                  the IEEE sub, mul and round-half-even of quantize_value. The clamp
//                  is left out: zero is the group minimum, so x - zero >= 0, and
//                  (x - zero) * inv <= range * (1 / (range / 255)) <= 255 (1 + 2^-22)
//                  rounds to at most 255, so clamping changes no code;
//   planes         packs to code bytes, one byte network level (8 tokens of a
//                  channel per qword), gf2p8affineqb (8x8 bit transpose), three
//                  network levels (16 plane words per vector), stored in place.
// A zero minimum or maximum is recomputed by the portable loop, whose order
// decides between +0 and -0.

/// A byte network over 16 vectors whose levels exchange the given vector-index
/// bits (masks); built as make_network above.
template <int Levels>
struct byte_network16 {
  std::array<int, Levels> bits{};
  alignas(64) std::array<std::array<std::array<std::uint8_t, 64>, 16>, Levels> index{};
};

template <int Levels, class Dest>
constexpr byte_network16<Levels> make_network16(std::array<int, Levels> bits, Dest dest) {
  byte_network16<Levels> net;
  net.bits = bits;
  std::array<int, 1024> vec{}, pos{}, out_vec{}, out_pos{};
  for (int i = 0; i < 16; ++i)
    for (int p = 0; p < 64; ++p) {
      const auto d = dest(i, p);
      vec[i * 64 + p] = i;
      pos[i * 64 + p] = p;
      out_vec[i * 64 + p] = d.first;
      out_pos[i * 64 + p] = d.second;
    }
  for (int level = 0; level < Levels; ++level) {
    const int bit = bits[level];
    std::array<int, 16> fill{};
    std::array<bool, 1024> used{};
    std::array<int, 1024> new_vec{}, new_pos{};
    for (int id = 0; id < 1024; ++id) {
      const int n = (vec[id] & ~bit) | (out_vec[id] & bit);
      const int q = level == Levels - 1 ? out_pos[id] : fill[n]++;
      if (q >= 64 || used[n * 64 + q]) throw "byte network: the permutation does not route";
      used[n * 64 + q] = true;
      net.index[level][n][q] =
          static_cast<std::uint8_t>((vec[id] == (n & ~bit) ? 0 : 64) + pos[id]);
      new_vec[id] = n;
      new_pos[id] = q;
    }
    vec = new_vec;
    pos = new_pos;
  }
  for (int id = 0; id < 1024; ++id)
    if (vec[id] != out_vec[id]) throw "byte network: a vector-index bit is never exchanged";
  return net;
}

// Code bytes of a slice as the packs leave them (token t, channel c < 32 of the
// slice): vector (c & 1) * 8 + t / 4; in 128-bit lane c / 8, byte 8 (t/2 & 1) +
// 4 (t & 1) + (c/2 & 3).
constexpr std::pair<int, int> slice_token_channel(int v, int p) {
  return {4 * (v & 7) + 2 * ((p >> 3) & 1) + ((p >> 2) & 1),
          (v >> 3) + 2 * (p & 3) + 8 * ((p >> 4) & 3)};
}
// Before the bit transpose: vector (c & 1) * 8 + (t / 8) * 2 + c / 16, qword c/2 & 7,
// byte 7 - t%8 (so that bit b of a plane byte is token 8 (t/8) + b).
inline constexpr byte_network16<1> slice_gather = make_network16<1>({1}, [](int v, int p) {
  const auto [t, c] = slice_token_channel(v, p);
  return std::pair<int, int>{(c & 1) * 8 + (t >> 3) * 2 + (c >> 4),
                             8 * ((c >> 1) & 7) + 7 - (t & 7)};
});
// After it, byte j of a qword is plane j; plane vector 2 j + c / 16 holds the 16
// plane words of channels 16 (c/16)..: byte 4 (c % 16) + t / 8.
inline constexpr byte_network16<3> slice_scatter = make_network16<3>({2, 4, 8}, [](int w, int p) {
  const int c = (w >> 3) + 2 * (p >> 3) + 16 * (w & 1), g = (w >> 1) & 3, j = p & 7;
  return std::pair<int, int>{2 * j + (c >> 4), 4 * (c & 15) + g};
});

// Codes of one slice, 32 rows, to plane words stored at rows[j] + 32 sl (channels 0-15)
// and + 16 (channels 16-31). code_row(t, even, odd) gives the codes of row t as
// dwords of the even and the odd channels.
// Rows go 8 at a time through the packs, the gather level and the bit transpose; the
// scatter levels then run on each half (channels 0-15, 16-31) of the 16 vectors.
template <class CodeRow>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void slice_planes(CodeRow&& code_row,
                                                              std::uint32_t* const* rows, int sl,
                                                              bool stream) {
  const __m512i transpose = _mm512_set1_epi64(planes_of_tokens);
  __m512i w[16];
  LYNX_SIMD_UNROLL(4)
  for (int m = 0; m < 4; ++m) {
    __m512i staged[2][2];  // [c % 2][rows 8m + 4h..]
    LYNX_SIMD_UNROLL(2)
    for (int h = 0; h < 2; ++h) {
      __m512i even[4], odd[4];
      LYNX_SIMD_UNROLL(4)
      for (int k = 0; k < 4; ++k) code_row(8 * m + 4 * h + k, even[k], odd[k]);
      staged[0][h] = _mm512_packus_epi16(_mm512_packus_epi32(even[0], even[1]),
                                         _mm512_packus_epi32(even[2], even[3]));
      staged[1][h] = _mm512_packus_epi16(_mm512_packus_epi32(odd[0], odd[1]),
                                         _mm512_packus_epi32(odd[2], odd[3]));
    }
    // Stage vectors 8 (c % 2) + 2m + h; the gather level pairs h = 0 and 1.
    LYNX_SIMD_UNROLL(2)
    for (int c0 = 0; c0 < 2; ++c0) LYNX_SIMD_UNROLL(2)
    for (int bit = 0; bit < 2; ++bit) {
      const int n = 8 * c0 + 2 * m + bit;
      w[n] = _mm512_gf2p8affine_epi64_epi8(
          transpose,
          _mm512_permutex2var_epi8(
              staged[c0][0], _mm512_load_si512(slice_gather.index[0][n].data()), staged[c0][1]),
          0);
    }
  }
  LYNX_SIMD_UNROLL(2)
  for (int half = 0; half < 2; ++half) {
    __m512i v[8];  // vector 2 i + half
    LYNX_SIMD_UNROLL(8)
    for (int i = 0; i < 8; ++i) v[i] = w[2 * i + half];
    LYNX_SIMD_UNROLL(3)
    for (int level = 0; level < 3; ++level) {
      const int bit = 1 << level;
      __m512i next[8];
      LYNX_SIMD_UNROLL(8)
      for (int i = 0; i < 8; ++i)
        next[i] = _mm512_permutex2var_epi8(
            v[i & ~bit], _mm512_load_si512(slice_scatter.index[level][2 * i + half].data()),
            v[i | bit]);
      LYNX_SIMD_UNROLL(8)
      for (int i = 0; i < 8; ++i) v[i] = next[i];
    }
    LYNX_SIMD_UNROLL(8)
    for (int j = 0; j < 8; ++j) {
      std::uint32_t* dst = rows[j] + 32 * sl + 16 * half;
      if (stream)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v[j]);
      else
        _mm512_storeu_si512(dst, v[j]);
    }
  }
}

// Even and odd channels of 32 bf16 as floats.
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512 bf16_even(__m512i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512 bf16_odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
// quantize_value without the clamp (see above).
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512i code_of(__m512 x, __m512 zero, __m512 inv) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(x, zero), inv));
}
// x ^ (x >> 15 & 0x7fff) on 16-bit lanes: bf16 bits -> integers in float order (-0 below +0),
// and back.
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512i float_order(__m512i x) {
  return _mm512_ternarylogic_epi32(x, _mm512_srai_epi16(x, 15), _mm512_set1_epi16(0x7fff),
                                   0x78);  // a ^ (b & c)
}

// Lane tables of the bf16 block encode: natural channel order from even/odd vectors,
// and the word pairs of the last level of rows_minmax.
struct block_tables {
  alignas(64) std::int32_t low[16]{}, high[16]{};
  alignas(64) std::int16_t even[32]{}, odd[32]{};
};
constexpr block_tables make_block_tables() {
  block_tables r;
  for (int k = 0; k < 16; ++k) {
    r.low[k] = (k & 1) * 16 + k / 2;
    r.high[k] = (k & 1) * 16 + 8 + k / 2;
    r.even[2 * k] = static_cast<std::int16_t>(2 * k);
    r.even[2 * k + 1] = static_cast<std::int16_t>(32 + 2 * k);
    r.odd[2 * k] = static_cast<std::int16_t>(2 * k + 1);
    r.odd[2 * k + 1] = static_cast<std::int16_t>(33 + 2 * k);
  }
  return r;
}
inline constexpr block_tables interleave_index = make_block_tables();
inline constexpr const block_tables& word_pairs = interleave_index;

// Minimum and maximum (order-preserving integers) of each of Rows rows row(r0 + i),
// depth first so that few vectors are live. With Rows = 32, word w of the results is
// row 16 (w & 1) + 4 (w/2 & 3) + w / 8.
template <int Rows, class Row>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void rows_minmax(Row&& row, int r0, __m512i& mn,
                                                             __m512i& mx) {
  if constexpr (Rows == 2) {
    // 256-bit halves: row r0 in the low half, row r0 + 1 in the high half
    const __m512i a = row(r0), b = row(r0 + 1);
    const __m512i x = _mm512_shuffle_i64x2(a, b, 0x44), y = _mm512_shuffle_i64x2(a, b, 0xee);
    mn = _mm512_min_epi16(x, y);
    mx = _mm512_max_epi16(x, y);
  } else {
    __m512i mn_a, mx_a, mn_b, mx_b;
    rows_minmax<Rows / 2>(row, r0, mn_a, mx_a);
    rows_minmax<Rows / 2>(row, r0 + Rows / 2, mn_b, mx_b);
    auto pair = [&](__m512i a, __m512i b, __m512i& x, __m512i& y) LYNX_CODEC_AVX512_TARGET {
      if constexpr (Rows == 4) {  // 128-bit lane L: row r0 + L
        x = _mm512_shuffle_i64x2(a, b, 0x88);
        y = _mm512_shuffle_i64x2(a, b, 0xdd);
      } else if constexpr (Rows == 8) {  // lane L, qword i: row r0 + 4i + L
        x = _mm512_unpacklo_epi64(a, b);
        y = _mm512_unpackhi_epi64(a, b);
      } else if constexpr (Rows == 16) {  // lane L, dword d: row r0 + 4d + L
        const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
        x = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0)));
        y = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1)));
      } else {  // word 2D + u: row r0 + 16u + 4 (D & 3) + D / 4
        static_assert(Rows == 32);
        x = _mm512_permutex2var_epi16(a, _mm512_load_si512(word_pairs.even), b);
        y = _mm512_permutex2var_epi16(a, _mm512_load_si512(word_pairs.odd), b);
      }
    };
    __m512i x, y;
    pair(mn_a, mn_b, x, y);
    mn = _mm512_min_epi16(x, y);
    pair(mx_a, mx_b, x, y);
    mx = _mm512_max_epi16(x, y);
  }
}

/// True when encode_bf16_block encodes the blocks of this layout.
inline bool bf16_block_fits(const layer_geometry& g) {
  return g.key_group == 32 && g.value_group == 32 && g.head_dim == 128;
}

/// Encodes block t0 / 32 (tokens t0..t0+31, all present) of head h: parameters into
/// the heads' parameter rows, plane words through key_planes/value_planes(b, j).
template <class KeyPlanes, class ValuePlanes>
LYNX_CODEC_AVX512_TARGET void encode_bf16_block(const kv_view<const bf16, host_space>& keys,
                                                const kv_view<const bf16, host_space>& values,
                                                std::int64_t h, std::int64_t t0,
                                                float* key_scale_head, float* key_zero_head,
                                                float* value_scale_head, float* value_zero_head,
                                                KeyPlanes&& key_planes, ValuePlanes&& value_planes,
                                                const next_rows<bf16>& next, encode_scratch& s) {
  constexpr int D = 128, slices = D / 32;
  const std::int64_t b = t0 / tokens_per_word;
  const std::int64_t ks = keys.token_stride, vs = values.token_stride;
  const bf16* kbase = &keys(t0, h, 0);
  const bf16* vbase = &values(t0, h, 0);
  __mmask32 non_finite = 0;
  __mmask16 bad_range = 0;
  std::uint32_t* rows[8];
  auto plane_rows = [&](auto&& planes) {
    bool stream = s.stream;
    for (int j = 0; j < 8; ++j) {
      rows[j] = planes(b, j);
      stream = stream && (reinterpret_cast<std::uintptr_t>(rows[j]) & 63) == 0;
    }
    return stream;
  };
  auto load_row = [&](const bf16* p) LYNX_CODEC_AVX512_TARGET { return _mm512_loadu_si512(p); };
  // The next item's rows (32 key rows, then 32 value rows, 4 lines a row), asked
  // into L1 one line per row of codes made below (256 of them): this CPU drops
  // most of a burst of prefetches issued back to back, not lines asked one by one.
  // (Pointers and strides are set up here: computing each line's address through
  // the views in the code loops cost 13% of the encode.)
  const bool next_in_range = next.t1 - next.t0 == tokens_per_word;
  const char* next_keys =
      next_in_range ? reinterpret_cast<const char*>(&(*next.keys)(next.t0, next.h, 0)) : nullptr;
  const char* next_values =
      next_in_range ? reinterpret_cast<const char*>(&(*next.values)(next.t0, next.h, 0)) : nullptr;
  const std::int64_t next_ks = next_in_range ? next.keys->token_stride * 2 : 0,
                     next_vs = next_in_range ? next.values->token_stride * 2 : 0;
  int next_line = next_in_range ? 0 : 256;
  // into L2 where the L1 is small (prefetch_into_l2): on AMD Zen 4 (32 KiB L1)
  // the encode of 8 = 4 + 4 took 1.76 -> 1.61 ms at 4K tokens, 18.8 -> 16.0 ms at 32K
  const bool into_l2 = prefetch_into_l2();
  auto next_step = [&]() {
    if (next_line >= 256) return;
    const int row = next_line >> 2, line = next_line & 3;
    const char* p = row < 32 ? next_keys + row * next_ks + 64 * line
                             : next_values + (row - 32) * next_vs + 64 * line;
    if (into_l2)
      _mm_prefetch(p, _MM_HINT_T1);
    else
      _mm_prefetch(p, _MM_HINT_T0);
    ++next_line;
  };

  // Keys, slice by slice: parameters of the 32 channels, codes, planes.
  bool stream = plane_rows(key_planes);
  float* key_scale = key_scale_head + (t0 / 32) * D;
  float* key_zero = key_zero_head + (t0 / 32) * D;
  const __m512i natural_low = _mm512_load_si512(interleave_index.low),
                natural_high = _mm512_load_si512(interleave_index.high);
  // Min/max statistics of all slices in one pass over the rows, front to back.
  __m512i smax_of[slices], umin_of[slices], umax_of[slices];
  LYNX_SIMD_UNROLL(4)
  for (int sl = 0; sl < slices; ++sl)
    smax_of[sl] = umin_of[sl] = umax_of[sl] = load_row(kbase + 32 * sl);
  for (int t = 0; t < 32; ++t) {
    const bf16* row = kbase + t * ks;
    LYNX_SIMD_UNROLL(4)
    for (int sl = 0; sl < slices; ++sl) {
      const __m512i x = load_row(row + 32 * sl);
      smax_of[sl] = _mm512_max_epi16(smax_of[sl], x);
      umin_of[sl] = _mm512_min_epu16(umin_of[sl], x);
      umax_of[sl] = _mm512_max_epu16(umax_of[sl], x);
    }
  }
  for (int sl = 0; sl < slices; ++sl) {
    const bf16* p = kbase + 32 * sl;
    const __m512i smax = smax_of[sl], umin = umin_of[sl], umax = umax_of[sl];
    // NaN or infinity: a sign-clear one is the signed maximum, a negative one the unsigned.
    non_finite |= _mm512_cmpgt_epi16_mask(smax, _mm512_set1_epi16(0x7f7f)) |
                  _mm512_cmpge_epu16_mask(umax, _mm512_set1_epi16(static_cast<short>(0xff80)));
    // min: the largest negative bits if there is a negative, else the smallest bits;
    // max: the largest sign-clear bits if there is one, else the smallest (negative) bits.
    __m512i lo = _mm512_mask_blend_epi16(_mm512_movepi16_mask(umax), umin, umax);
    __m512i hi = _mm512_mask_blend_epi16(_mm512_movepi16_mask(smax), smax, umin);
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    if (const __mmask32 zeros =
            _mm512_testn_epi16_mask(lo, magnitude) | _mm512_testn_epi16_mask(hi, magnitude)) {
      alignas(64) bf16 l[32], u[32];
      _mm512_store_si512(l, lo);
      _mm512_store_si512(u, hi);
      for (int c = 0; c < 32; ++c)
        if (zeros >> c & 1) {
          float a = to_float(p[c]), z = a;
          for (int t = 0; t < 32; ++t) {
            const float v = to_float(p[t * ks + c]);
            a = v < a ? v : a;
            z = v > z ? v : z;
          }
          l[c] = bf16(a);
          u[c] = bf16(z);
        }
      lo = _mm512_load_si512(l);
      hi = _mm512_load_si512(u);
    }
    __m512 lo_even = bf16_even(lo), lo_odd = bf16_odd(lo);  // become the zero points
    __m512 scale_even, inv_even, scale_odd, inv_odd;
    group_params16<8>(lo_even, bf16_even(hi), scale_even, inv_even, bad_range);
    group_params16<8>(lo_odd, bf16_odd(hi), scale_odd, inv_odd, bad_range);
    _mm512_storeu_ps(key_scale + 32 * sl,
                     _mm512_permutex2var_ps(scale_even, natural_low, scale_odd));
    _mm512_storeu_ps(key_scale + 32 * sl + 16,
                     _mm512_permutex2var_ps(scale_even, natural_high, scale_odd));
    _mm512_storeu_ps(key_zero + 32 * sl, _mm512_permutex2var_ps(lo_even, natural_low, lo_odd));
    _mm512_storeu_ps(key_zero + 32 * sl + 16,
                     _mm512_permutex2var_ps(lo_even, natural_high, lo_odd));
    slice_planes(
        [&](int t, __m512i& even, __m512i& odd) LYNX_CODEC_AVX512_TARGET {
          next_step();
          const __m512i x = load_row(p + t * ks);
          even = code_of(bf16_even(x), lo_even, inv_even);
          odd = code_of(bf16_odd(x), lo_odd, inv_odd);
        },
        rows, sl, stream);
  }

  // Value parameters: 4 trees of 32 rows (8 tokens x 4 slices) give them in the
  // order of the parameter rows, [token][slice]; kept for the codes in s.value_zero/inv.
  float* value_scale = value_scale_head + t0 * slices;
  float* value_zero = value_zero_head + t0 * slices;
  float* zero_of = s.value_zero.data();
  float* inv_of = s.value_inv.data();
  for (int tree = 0; tree < 4; ++tree) {
    __m512i mn, mx;
    rows_minmax<32>(
        [&](int r) LYNX_CODEC_AVX512_TARGET {
          const int t = 8 * tree + 4 * (r >> 4) + (r & 3), sl = (r >> 2) & 3;
          return float_order(load_row(vbase + t * vs + 32 * sl));
        },
        0, mn, mx);
    non_finite |= _mm512_cmpge_epi16_mask(mx, _mm512_set1_epi16(0x7f80)) |
                  _mm512_cmple_epi16_mask(mn, _mm512_set1_epi16(static_cast<short>(0x807f)));
    mn = float_order(mn);
    mx = float_order(mx);
    for (int u = 0; u < 2; ++u) {
      const int f = 2 * tree + u;  // parameters 16 f.. : tokens 4 f + lane / 4, slice lane % 4
      __m512 lo = u ? bf16_odd(mn) : bf16_even(mn), hi = u ? bf16_odd(mx) : bf16_even(mx);
      redo_zero_extremes(lo, hi, 0xFFFF, 32, [&](int lane, int c) {
        return to_float(vbase[(4 * f + lane / 4) * vs + 32 * (lane % 4) + c]);
      });
      __m512 scale, inv;
      group_params16<8>(lo, hi, scale, inv, bad_range);
      _mm512_storeu_ps(value_scale + 16 * f, scale);
      _mm512_storeu_ps(value_zero + 16 * f, lo);
      _mm512_storeu_ps(zero_of + 16 * f, lo);
      _mm512_storeu_ps(inv_of + 16 * f, inv);
    }
  }

  // Value codes, slice by slice.
  stream = plane_rows(value_planes);
  for (int sl = 0; sl < slices; ++sl) {
    const bf16* p = vbase + 32 * sl;
    slice_planes(
        [&](int t, __m512i& even, __m512i& odd) LYNX_CODEC_AVX512_TARGET {
          next_step();
          const __m512i x = load_row(p + t * vs);
          const __m512 zero = _mm512_set1_ps(zero_of[4 * t + sl]),
                       inv = _mm512_set1_ps(inv_of[4 * t + sl]);
          even = code_of(bf16_even(x), zero, inv);
          odd = code_of(bf16_odd(x), zero, inv);
        },
        rows, sl, stream);
  }
  if (non_finite || bad_range) throw needs_portable_path{};
}

/// Encodes the blocks of tokens [u0, u1) of head h (u0 a multiple of unit_tokens):
/// key parameters of the unit's key groups, then per block key codes, value
/// parameters and value codes, packed straight into the segments' plane words.
/// key_planes/value_planes(b, j): pointer to plane j's D words of block b.
template <int Bits, class T, class KeyPlanes, class ValuePlanes>
LYNX_CODEC_AVX512_TARGET void encode_unit(const kv_view<const T, host_space>& keys,
                                          const kv_view<const T, host_space>& values,
                                          const layer_geometry& g, std::int64_t h, std::int64_t u0,
                                          std::int64_t u1, float* key_scale_head,
                                          float* key_zero_head, float* value_scale_head,
                                          float* value_zero_head, KeyPlanes&& key_planes,
                                          ValuePlanes&& value_planes, const next_rows<T>& next,
                                          encode_scratch& s) {
  if constexpr (std::is_same_v<T, bf16> && Bits == 8) {
    if (bf16_block_fits(g) && u1 - u0 == tokens_per_word) {
      encode_bf16_block(keys, values, h, u0, key_scale_head, key_zero_head, value_scale_head,
                        value_zero_head, key_planes, value_planes, next, s);
      return;
    }
  }
  const std::int64_t D = g.head_dim, chunks = D / 16, KG = g.key_group;
  __m512 non_finite = _mm512_setzero_ps();
  __mmask16 bad = 0;

  // Key parameters, per channel over each key group of the unit (token order as the
  // portable loop: l = v < l ? v : l from the group's first token). Row by row, up to
  // 8 chunks (128 channels) of accumulators in registers: each token row is read
  // once, front to back. The rows of the next item are prefetched meanwhile.
  const std::int64_t grp0 = u0 / KG;
  for (std::int64_t grp = grp0; grp * KG < u1; ++grp) {
    const std::int64_t t0 = grp * KG, t1 = std::min<std::int64_t>(t0 + KG, g.tokens);
    for (std::int64_t q0 = 0; q0 < chunks; q0 += 8) {
      const int nq = static_cast<int>(std::min<std::int64_t>(8, chunks - q0));
      __m512 lo[8], hi[8];
      if (nq == 8) {
        key_minmax<8>(keys, h, q0, t0, t1, next, u0, lo, hi, non_finite);
      } else if (nq == 4) {
        key_minmax<4>(keys, h, q0, t0, t1, next, u0, lo, hi, non_finite);
      } else {
        for (int k = 0; k < 8; ++k)
          if (k < nq) lo[k] = hi[k] = load16(&keys(t0, h, 16 * (q0 + k)));
        for (std::int64_t t = t0; t < t1; ++t) {
          if (q0 == 0) next.prefetch_key_row(t - u0);
          const T* row = &keys(t, h, 16 * q0);
          for (int k = 0; k < 8; ++k)
            if (k < nq) {
              const __m512 v = load16(row + 16 * k);
              non_finite = track_non_finite(non_finite, v);
              lo[k] = _mm512_min_ps(v, lo[k]);
              hi[k] = _mm512_max_ps(v, hi[k]);
            }
        }
      }
      for (int k = 0; k < nq; ++k) {
        const std::int64_t q = q0 + k;
        __m512 scale, inv;
        group_params16<Bits>(lo[k], hi[k], scale, inv, bad);
        _mm512_storeu_ps(key_scale_head + grp * D + 16 * q, scale);
        _mm512_storeu_ps(key_zero_head + grp * D + 16 * q, lo[k]);
        _mm512_storeu_ps(s.key_inv.data() + (grp - grp0) * D + 16 * q, inv);
      }
    }
  }
  if (bad || _mm512_cmp_ps_mask(non_finite, non_finite, _CMP_UNORD_Q)) throw needs_portable_path{};

  const std::int64_t VG = g.value_group, VGs = g.value_channel_groups(), per_group = VG / 16;
  std::uint32_t* rows[16];
  for (std::int64_t t0 = u0; t0 < u1; t0 += tokens_per_word) {
    const std::int64_t b = t0 / tokens_per_word,
                       n = std::min<std::int64_t>(tokens_per_word, g.tokens - t0);
    // Keys: codes of 4 tokens at a time per chunk; tokens past n are code 0.
    for (std::int64_t t = 0; t < tokens_per_word; t += 4) {
      // Parameter rows of the 4 tokens' key groups (divisions out of the chunk loop).
      const float* inv_row[4];
      const float* zero_row[4];
      const T* key_row[4];
      for (int k = 0; k < 4; ++k) {
        const std::int64_t tok = std::min(t0 + t + k, g.tokens - 1);
        inv_row[k] = s.key_inv.data() + (tok / KG - grp0) * D;
        zero_row[k] = key_zero_head + (tok / KG) * D;
        key_row[k] = &keys(tok, h, 0);
      }
      for (std::int64_t q = 0; q < chunks; ++q) {
        __m512i c[4];
        LYNX_SIMD_UNROLL(4)
        for (int k = 0; k < 4; ++k) {
          if (t + k < n) {
            c[k] =
                quantize16<Bits>(load16(key_row[k] + 16 * q), _mm512_loadu_ps(zero_row[k] + 16 * q),
                                 _mm512_loadu_ps(inv_row[k] + 16 * q));
          } else {
            c[k] = _mm512_setzero_si512();
          }
        }
        stage_codes<Bits>(c[0], c[1], c[2], c[3], &s.stage_hi[q * 8 + t / 4],
                          &s.stage_lo[q * 8 + t / 4]);
      }
    }
    for (int j = 0; j < Bits; ++j) rows[j] = key_planes(b, j);
    pack_stage(s.stage_hi, D, 0, 8, rows, s.stream);
    if constexpr (Bits > 8) pack_stage(s.stage_lo, D, 8, Bits - 8, rows, s.stream);

    // Value parameters: per token over groups of VG channels, 16 groups at a time.
    for (std::int64_t t = 0; t < tokens_per_word; ++t) next.prefetch_value_row(t0 - u0 + t);
    const std::int64_t groups = n * VGs;
    float* vscale = value_scale_head + t0 * VGs;
    float* vzero = value_zero_head + t0 * VGs;
    for (std::int64_t f0 = 0; f0 < groups; f0 += 16) {
      const int batch = static_cast<int>(std::min<std::int64_t>(16, groups - f0));
      // Group f = f0 + k is (token f / VGs, channels from (f % VGs) * VG), stepped
      // without divisions; past the batch the last group repeats.
      const T* gp[16];
      std::int64_t f_tok = f0 / VGs, f_grp = f0 % VGs;
      for (int k = 0; k < 16; ++k) {
        gp[k] = &values(t0 + f_tok, h, f_grp * VG);
        if (k + 1 < batch && ++f_grp == VGs) f_grp = 0, ++f_tok;
      }
      __m512 l, u, nf;
      switch (per_group) {
        case 1:
          reduce_groups<16, 1>(gp, nf, l, u);
          break;
        case 2:
          reduce_groups<16, 2>(gp, nf, l, u);
          break;
        case 4:
          reduce_groups<16, 4>(gp, nf, l, u);
          break;
        default: {
          __m512 lo[16], hi[16];
          nf = _mm512_setzero_ps();
          for (int k = 0; k < 16; ++k) {
            __m512 lk = load16(gp[k]), uk = lk;
            nf = track_non_finite(nf, lk);
            for (std::int64_t i = 1; i < per_group; ++i) {
              const __m512 v = load16(gp[k] + 16 * i);
              nf = track_non_finite(nf, v);
              lk = _mm512_min_ps(v, lk);
              uk = _mm512_max_ps(v, uk);
            }
            lo[k] = lk;
            hi[k] = uk;
          }
          l = reduce16<false>(lo);
          u = reduce16<true>(hi);
        }
      }
      non_finite = _mm512_add_ps(non_finite, nf);
      // A zero minimum or maximum: which zero the portable loop keeps depends on order.
      redo_zero_extremes(l, u, static_cast<__mmask16>((1u << batch) - 1u), static_cast<int>(VG),
                         [&](int k, int c) {
                           const std::int64_t f = f0 + k, tok = t0 + f / VGs;
                           return to_float(values(tok, h, (f % VGs) * VG + c));
                         });
      __m512 scale, inv;
      group_params16<Bits>(l, u, scale, inv, bad);
      const __mmask16 live = static_cast<__mmask16>((1u << batch) - 1u);
      bad &= live;
      _mm512_mask_storeu_ps(vscale + f0, live, scale);
      _mm512_mask_storeu_ps(vzero + f0, live, l);
      _mm512_storeu_ps(s.value_zero.data() + f0, l);
      _mm512_storeu_ps(s.value_inv.data() + f0, inv);
    }
    if (bad || _mm512_cmp_ps_mask(non_finite, non_finite, _CMP_UNORD_Q))
      throw needs_portable_path{};

    // Value codes.
    for (std::int64_t t = 0; t < tokens_per_word; t += 4) {
      // Rows and parameter rows of the 4 tokens (no stride arithmetic in the chunk loop).
      const T* value_row[4];
      const float* zero_of[4];
      const float* inv_of[4];
      for (int k = 0; k < 4; ++k) {
        value_row[k] = &values(std::min(t0 + t + k, g.tokens - 1), h, 0);
        zero_of[k] = s.value_zero.data() + (t + k) * VGs;
        inv_of[k] = s.value_inv.data() + (t + k) * VGs;
      }
      for (std::int64_t q = 0, grp = 0, in_group = 0; q < chunks; ++q) {
        __m512i c[4];
        const std::int64_t group_of_q = grp;
        if (++in_group == per_group) in_group = 0, ++grp;
        LYNX_SIMD_UNROLL(4)
        for (int k = 0; k < 4; ++k) {
          if (t + k < n) {
            c[k] = quantize16<Bits>(load16(value_row[k] + 16 * q),
                                    _mm512_set1_ps(zero_of[k][group_of_q]),
                                    _mm512_set1_ps(inv_of[k][group_of_q]));
          } else {
            c[k] = _mm512_setzero_si512();
          }
        }
        stage_codes<Bits>(c[0], c[1], c[2], c[3], &s.stage_hi[q * 8 + t / 4],
                          &s.stage_lo[q * 8 + t / 4]);
      }
    }
    for (int j = 0; j < Bits; ++j) rows[j] = value_planes(b, j);
    pack_stage(s.stage_hi, D, 0, 8, rows, s.stream);
    if constexpr (Bits > 8) pack_stage(s.stage_lo, D, 8, Bits - 8, rows, s.stream);
  }
}

// ---------------------------------------------------------------------------
// Reconstruct.

template <class T>
bool reconstruct_supported(const kv_view<T, host_space>& keys_out,
                           const kv_view<T, host_space>& values_out, const layer_geometry& g) {
  return keys_out.channel_stride == 1 && values_out.channel_stride == 1 && g.head_dim % 16 == 0 &&
         g.value_group % 16 == 0;
}

// Byte network, 8x8 bit transpose and network back: plane words v[j] (16
// channels) become code bytes stage[i] (tokens 4i..4i+3, byte 16*(t%4) + c), v[j]
// giving bit 7 - j of every byte.
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void stage_chunk(__m512i (&v)[8], __m512i* stage) {
  const __m512i transpose = _mm512_set1_epi64(tokens_of_planes);
  run_network(unpack_gather, v);
  LYNX_SIMD_UNROLL(8)
  for (int i = 0; i < 8; ++i) v[i] = _mm512_gf2p8affine_epi64_epi8(transpose, v[i], 0);
  run_network(unpack_scatter, v);
  LYNX_SIMD_UNROLL(8)
  for (int i = 0; i < 8; ++i) stage[i] = v[i];
}

// Code bytes of one block from plane words: planes [first, first + count) of
// plane_rows, as rows stage[q * 8 + t/4] byte 16*(t%4) + c.
LYNX_CODEC_AVX512_TARGET inline void unpack_stage(const std::uint32_t* const* plane_rows, int first,
                                                  int count, std::int64_t D, __m512i* stage) {
  for (std::int64_t q = 0; q < D / 16; ++q) {
    __m512i v[8];
    LYNX_SIMD_UNROLL(8)
    for (int j = 0; j < 8; ++j)
      v[j] =
          j < count ? _mm512_loadu_si512(plane_rows[first + j] + 16 * q) : _mm512_setzero_si512();
    stage_chunk(v, stage + q * 8);
  }
}

// Prefixes of at most 4 planes, two chunks per byte network: chunk q (q even)
// in bits [0, P) and chunk q + 1 in bits [4, 4 + P) of the bytes of
// stage[q * 8 + t/4] (same byte positions as unpack_stage): half the networks
// of staging one prefix per byte.
LYNX_CODEC_AVX512_TARGET inline void unpack_stage_nibbles(const std::uint32_t* const* plane_rows,
                                                          int P, std::int64_t D, __m512i* stage) {
  const std::int64_t chunks = D / 16;
  for (std::int64_t q = 0; q < chunks; q += 2) {
    const bool pair = q + 1 < chunks;
    __m512i v[8];
    // Plane i (i = 0 the most significant) of chunk q at j = 8 - P + i, of
    // chunk q + 1 at j = 4 - P + i.
    LYNX_SIMD_UNROLL(8)
    for (int j = 0; j < 8; ++j) {
      if (j >= 8 - P)
        v[j] = _mm512_loadu_si512(plane_rows[j - (8 - P)] + 16 * q);
      else if (pair && j >= 4 - P && j < 4)
        v[j] = _mm512_loadu_si512(plane_rows[j - (4 - P)] + 16 * (q + 1));
      else
        v[j] = _mm512_setzero_si512();
    }
    stage_chunk(v, stage + q * 8);
  }
}

// Codes (missing planes zero) of token t, channels 16q..16q+15, as dwords.
template <int Bits>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE __m512i staged_codes(const __m512i* hi,
                                                                 const __m512i* lo, std::int64_t q,
                                                                 std::int64_t t) {
  const auto* hb = reinterpret_cast<const __m128i*>(hi + q * 8 + t / 4) + t % 4;
  const __m512i h = _mm512_cvtepu8_epi32(_mm_load_si128(hb));
  if constexpr (Bits == 8) {
    return h;
  } else {
    const auto* lb = reinterpret_cast<const __m128i*>(lo + q * 8 + t / 4) + t % 4;
    const __m512i l = _mm512_cvtepu8_epi32(_mm_load_si128(lb));
    return _mm512_or_si512(_mm512_slli_epi32(h, Bits - 8), _mm512_srli_epi32(l, 16 - Bits));
  }
}

// float_to_bf16_bits of 32 floats at once: vcvtne2ps2bf16 (AVX512-BF16) rounds to
// nearest even like the portable code and quiets NaN the same way, but reads
// denormals as zero. `normal`: the caller knows no input is a denormal or NaN (see
// outputs_never_denormal); otherwise vectors holding either take store16. Callers
// use it only where host_has_avx512_bf16(); the instruction is written as inline
// assembly so that the kernels need no bf16 target (which would let the compiler
// use the extension anywhere in them, also on CPUs without it).
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void store32_bf16(bf16* p, __m512 lo, __m512 hi,
                                                              bool stream, bool normal) {
  constexpr int nan_or_denormal = 0x01 | 0x20 | 0x80;  // QNaN | denormal | SNaN
  if (!normal && !_kortestz_mask16_u8(_mm512_fpclass_ps_mask(lo, nan_or_denormal),
                                      _mm512_fpclass_ps_mask(hi, nan_or_denormal))) {
    store16(p, lo);
    store16(p + 16, hi);
    return;
  }
  __m512i r;  // words 0-15 from lo, 16-31 from hi (_mm512_cvtne2ps_pbh(hi, lo))
  __asm__("vcvtne2ps2bf16 {%2, %1, %0|%0, %1, %2}" : "=v"(r) : "v"(hi), "v"(lo));
  if (stream)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), r);
  else
    _mm512_storeu_si512(p, r);
}

/// True when fma(scale[i], level, zero[i]) is never a denormal or NaN, for every
/// i < count and every level that is a multiple of 1/2 (the reconstruction levels
/// are: an integer plus midpoint_offset). Holds when each scale and each zero is 0
/// or finite with |scale| >= 2^-102 and |zero| >= 2^-103: scale * level is then
/// an exact multiple of 2^(e_scale - 24) >= 2^-126 (e: the unbiased exponent) and
/// zero one of 2^(e_zero - 23) >= 2^-126, so their exact sum is 0 or at least
/// 2^-126, the smallest normal, and so is its rounding. Parameters from real
/// K/V always pass; the check lets a block skip the per-vector denormal test.
LYNX_CODEC_AVX512_TARGET inline bool outputs_never_denormal(const float* scale, const float* zero,
                                                            std::int64_t count) {
  // |x| bits - 1 below (threshold bits - 1), unsigned: nonzero and under the
  // threshold; NaN and infinity fail the second test.
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), one = _mm512_set1_epi32(1),
                scale_low = _mm512_set1_epi32((25 << 23) - 1),  // 2^-102: biased exponent 25
      zero_low = _mm512_set1_epi32((24 << 23) - 1), inf = _mm512_set1_epi32(0x7f800000);
  __mmask16 bad = 0;
  for (std::int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes =
        count - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (count - i)) - 1u);
    const __m512i s = _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes, scale + i), abs_mask),
                  z = _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes, zero + i), abs_mask);
    bad |= _mm512_cmplt_epu32_mask(_mm512_sub_epi32(s, one), scale_low) |
           _mm512_cmplt_epu32_mask(_mm512_sub_epi32(z, one), zero_low) |
           _mm512_cmpge_epu32_mask(s, inf) | _mm512_cmpge_epu32_mask(z, inf);
  }
  return bad == 0;
}

/// Writes one output row (D elements) from x(q), the 16 floats of chunk q.
/// `bf16_cvt`: bf16 outputs go through store32_bf16 (the CPU has AVX512-BF16);
/// `normal`: no x(q) is then a denormal or NaN (outputs_never_denormal).
template <class T, class Row>
LYNX_CODEC_AVX512_TARGET LYNX_ALWAYS_INLINE void store_row(T* out, std::int64_t chunks, bool stream,
                                                           bool bf16_cvt, bool normal, Row&& x) {
  std::int64_t q = 0;
  if constexpr (std::is_same_v<T, bf16>) {
    if (bf16_cvt) {
      const bool aligned = stream && (reinterpret_cast<std::uintptr_t>(out) & 63) == 0;
      for (; q + 2 <= chunks; q += 2) store32_bf16(out + 16 * q, x(q), x(q + 1), aligned, normal);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (stream && (reinterpret_cast<std::uintptr_t>(out) & 63) == 0) {
      for (; q < chunks; ++q) _mm512_stream_ps(out + 16 * q, x(q));
      return;
    }
  }
  for (; q < chunks; ++q) store16(out + 16 * q, x(q));
}

// Rows of one block from its staged codes. Lut: stage_hi holds the prefixes
// (P <= 4) as nibbles (unpack_stage_nibbles) and the level float(prefix << (B-P)) + half comes
// from a 16-entry table, the same float the portable expression gives.
// Flattened: at -O2 GCC leaves some of the lambdas and helpers below out of line,
// and their captures then go through memory in the row loop.
template <int Bits, bool Lut, class T>
LYNX_CODEC_AVX512_TARGET __attribute__((flatten)) void reconstruct_rows(
    const layer_geometry& g, std::int64_t h, std::int64_t t0, std::int64_t n, bool keys,
    bool stream, __m512 half_v, __m512 lut, const float* key_scale, const float* key_zero,
    const float* value_scale, const float* value_zero, const kv_view<T, host_space>& keys_out,
    const kv_view<T, host_space>& values_out, const __m512i* stage_hi, const __m512i* stage_lo,
    prefetch_walk& walk, int lines_per_row, bool bf16_cvt) {
  const std::int64_t D = g.head_dim, chunks = D / 16;
  // Lut: the prefixes of chunk q as dword indexes (vpermps reads their low 4 bits).
  auto nibbles = [&](std::int64_t q, std::int64_t t) LYNX_CODEC_AVX512_TARGET {
    const auto* hb = reinterpret_cast<const __m128i*>(stage_hi + (q & ~1) * 8 + t / 4) + t % 4;
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_load_si128(hb));
    return q & 1 ? _mm512_srli_epi32(bytes, 4) : bytes;
  };
  auto level = [&](std::int64_t q, std::int64_t t) LYNX_CODEC_AVX512_TARGET {
    if constexpr (Lut) {
      return _mm512_permutexvar_ps(nibbles(q, t), lut);
    } else {
      return _mm512_add_ps(_mm512_cvtepi32_ps(staged_codes<Bits>(stage_hi, stage_lo, q, t)),
                           half_v);
    }
  };
  // Value group of each chunk (no division in the row loop).
  std::int32_t group_of_chunk[64];
  const bool small = chunks <= 64;
  if (!keys && small)
    for (std::int64_t q = 0; q < chunks; ++q)
      group_of_chunk[q] = static_cast<std::int32_t>((16 * q) / g.value_group);
  // Row pointers and parameter offsets advance by a row (no division or
  // multiplication per row: the rows are short, their overhead counted).
  const kv_view<T, host_space>& out = keys ? keys_out : values_out;
  T* row = &out(t0, h, 0);
  const std::int64_t row_stride = out.token_stride;
  std::int64_t key_base = (h * g.key_token_groups() + t0 / g.key_group) * D,
               in_group = t0 % g.key_group;
  const float* vs = value_scale + (h * g.tokens + t0) * g.value_channel_groups();
  const float* vz = value_zero + (h * g.tokens + t0) * g.value_channel_groups();
  const std::int64_t value_step = g.value_channel_groups();
  bool normal = false;        // read by the bf16 stores only
  bool value_tables = false;  // the path below: bf16 outputs, prefixes, groups of 32k channels
  if (std::is_same_v<T, bf16> && bf16_cvt) {
    const std::int64_t key_groups = (t0 + n - 1) / g.key_group - t0 / g.key_group + 1;
    normal = keys
                 ? outputs_never_denormal(key_scale + key_base, key_zero + key_base, key_groups * D)
                 : outputs_never_denormal(vs, vz, n * value_step);
    value_tables = Lut && !keys && small && chunks % 2 == 0 && g.value_group % 32 == 0;
  }
  for (std::int64_t t = 0; t < n; ++t, row += row_stride) {
    walk.step_n(lines_per_row);
    if (keys) {
      const float* ks = key_scale + key_base;
      const float* kz = key_zero + key_base;
      store_row(row, chunks, stream, bf16_cvt, normal,
                [&](std::int64_t q) LYNX_CODEC_AVX512_TARGET {
                  return _mm512_fmadd_ps(_mm512_loadu_ps(ks + 16 * q), level(q, t),
                                         _mm512_loadu_ps(kz + 16 * q));
                });
      if (++in_group == g.key_group) {
        in_group = 0;
        key_base += D;
      }
    } else if (value_tables) {
      // A value group covers whole pairs of chunks: its 16 outputs
      // fma(scale, level, zero) once, then picked per element (the same fma of
      // the same operands, so the same bits).
      const bool aligned = stream && (reinterpret_cast<std::uintptr_t>(row) & 63) == 0;
      for (std::int64_t q = 0; q < chunks; q += 2) {
        const std::int32_t grp = group_of_chunk[q];
        const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(vs[grp]), lut, _mm512_set1_ps(vz[grp]));
        store32_bf16(reinterpret_cast<bf16*>(row) + 16 * q,
                     _mm512_permutexvar_ps(nibbles(q, t), table),
                     _mm512_permutexvar_ps(nibbles(q + 1, t), table), aligned, normal);
      }
    } else {
      store_row(
          row, chunks, stream, bf16_cvt, normal, [&](std::int64_t q) LYNX_CODEC_AVX512_TARGET {
            const std::int64_t grp = small ? group_of_chunk[q] : (16 * q) / g.value_group;
            return _mm512_fmadd_ps(_mm512_set1_ps(vs[grp]), level(q, t), _mm512_set1_ps(vz[grp]));
          });
    }
    if (!keys) {
      vs += value_step;
      vz += value_step;
    }
  }
}

/// Reconstructs block b of head h (K and V) at P planes. `next`: the inputs of
/// the next block, asked for a few lines per row written. `bf16_cvt`: bf16
/// outputs may use AVX512-BF16 (use_avx512_bf16_codec()).
template <int Bits, class T, class Rows>
LYNX_CODEC_AVX512_TARGET void reconstruct_block(
    const layer_geometry& g, std::int64_t h, std::int64_t b, int P, float half,
    const float* key_scale, const float* key_zero, const float* value_scale,
    const float* value_zero, Rows&& plane_rows, const kv_view<T, host_space>& keys_out,
    const kv_view<T, host_space>& values_out, __m512i* stage_hi, __m512i* stage_lo,
    prefetch_walk& next, bool bf16_cvt) {
  const std::int64_t D = g.head_dim, chunks = D / 16, T_ = g.tokens;
  const std::int64_t t0 = b * tokens_per_word, n = std::min<std::int64_t>(tokens_per_word, T_ - t0);
  const int lines_per_row = walk_step_lines(next, 2 * n);  // a step per row written
  const __m512 half_v = _mm512_set1_ps(half);
  const bool lut_path = P <= 4;
  const bool stream = 2 * g.tokens * g.kv_heads * D * static_cast<std::int64_t>(sizeof(T)) >=
                      stream_store_min_bytes;
  alignas(64) float lut_levels[16];
  for (int i = 0; i < 16; ++i)
    lut_levels[i] =
        lut_path ? static_cast<float>(static_cast<std::uint32_t>(i) << (Bits - P)) + half : 0.0f;
  const __m512 lut = _mm512_load_ps(lut_levels);
  const std::uint32_t* rows[16];
  for (int which = 0; which < 2; ++which) {
    plane_rows(which == 0, rows);
    if (lut_path) {
      unpack_stage_nibbles(rows, P, D, stage_hi);
      reconstruct_rows<Bits, true, T>(g, h, t0, n, which == 0, stream, half_v, lut, key_scale,
                                      key_zero, value_scale, value_zero, keys_out, values_out,
                                      stage_hi, stage_lo, next, lines_per_row, bf16_cvt);
      continue;
    }
    unpack_stage(rows, 0, std::min(P, 8), D, stage_hi);
    if (Bits > 8 && P > 8)
      unpack_stage(rows, 8, P - 8, D, stage_lo);
    else if (Bits > 8)
      std::fill(stage_lo, stage_lo + chunks * 8, _mm512_setzero_si512());
    reconstruct_rows<Bits, false, T>(g, h, t0, n, which == 0, stream, half_v, lut, key_scale,
                                     key_zero, value_scale, value_zero, keys_out, values_out,
                                     stage_hi, stage_lo, next, lines_per_row, bf16_cvt);
  }
}

}  // namespace lynx::detail::simd

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // LYNX_CODEC_AVX512
