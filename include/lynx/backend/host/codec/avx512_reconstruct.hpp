// The AVX-512 reconstruct: plane words back to code bytes (byte networks and
// 8x8 bit transposes), then fma(scale, level, zero) per element into bf16, fp16
// or float rows (AVX512-BF16 conversion where the CPU has it).
#pragma once

#include "lynx/backend/host/codec/avx512_encode.hpp"

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
// Reconstruct.

template <class T>
bool reconstruct_supported(const kv_view<T, host_space>& keys_out,
                           const kv_view<T, host_space>& values_out, const layer_geometry& g) {
  // Rows step by token_stride through each 32-token block: a paged output
  // qualifies with blocks of a multiple of 32 tokens.
  return keys_out.channel_stride == 1 && values_out.channel_stride == 1 && g.head_dim % 16 == 0 &&
         g.value_group % 16 == 0 && keys_out.rows_even_in_runs_of(tokens_per_word) &&
         values_out.rows_even_in_runs_of(tokens_per_word);
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
LYNX_CODEC_AVX512_TARGET inline bool outputs_never_denormal(const bf16* scale, const bf16* zero,
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
    // the bf16 values as float bits (their 16 bits on top)
    const __m512i s = _mm512_and_si512(
                      _mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, scale + i)), 16),
                      abs_mask),
                  z = _mm512_and_si512(
                      _mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, zero + i)), 16),
                      abs_mask);
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
    bool stream, __m512 half_v, __m512 lut, const bf16* key_scale, const bf16* key_zero,
    const bf16* value_scale, const bf16* value_zero, const kv_view<T, host_space>& keys_out,
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
  const bf16* vs = value_scale + (h * g.tokens + t0) * g.value_channel_groups();
  const bf16* vz = value_zero + (h * g.tokens + t0) * g.value_channel_groups();
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
      const bf16* ks = key_scale + key_base;
      const bf16* kz = key_zero + key_base;
      store_row(row, chunks, stream, bf16_cvt, normal,
                [&](std::int64_t q) LYNX_CODEC_AVX512_TARGET {
                  return _mm512_fmadd_ps(load16(ks + 16 * q), level(q, t), load16(kz + 16 * q));
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
        const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(vs[grp])), lut,
                                             _mm512_set1_ps(static_cast<float>(vz[grp])));
        store32_bf16(reinterpret_cast<bf16*>(row) + 16 * q,
                     _mm512_permutexvar_ps(nibbles(q, t), table),
                     _mm512_permutexvar_ps(nibbles(q + 1, t), table), aligned, normal);
      }
    } else {
      store_row(row, chunks, stream, bf16_cvt, normal,
                [&](std::int64_t q) LYNX_CODEC_AVX512_TARGET {
                  const std::int64_t grp = small ? group_of_chunk[q] : (16 * q) / g.value_group;
                  return _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(vs[grp])), level(q, t),
                                         _mm512_set1_ps(static_cast<float>(vz[grp])));
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
    const bf16* key_scale, const bf16* key_zero, const bf16* value_scale, const bf16* value_zero,
    Rows&& plane_rows, const kv_view<T, host_space>& keys_out,
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
