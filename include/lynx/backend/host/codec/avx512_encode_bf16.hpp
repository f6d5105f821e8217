// The AVX-512 encode of one whole 32-token block of bf16 K and V with groups of
// 32, 8-bit codes and head_dim 128 (encode_bf16_block): the common case, with
// 16-vector byte networks and integer min/max on the bf16 bits.
#pragma once

#include "lynx/backend/host/codec/avx512_encode_steps.hpp"

#if LYNX_CODEC_AVX512

// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into these kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail::simd {

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

}  // namespace lynx::detail::simd

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // LYNX_CODEC_AVX512
