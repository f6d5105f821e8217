// Building blocks of the AVX-512 codec kernels: their target attribute, the byte
// networks (three levels of vpermt2b) and bit-transpose constants, 16-element
// loads and stores, vector quantization and group parameters, min/max reductions,
// and the sizes above which outputs are streamed.
#pragma once

#include "lynx/backend/host/codec/dispatch.hpp"

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

}  // namespace lynx::detail::simd

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // LYNX_CODEC_AVX512
