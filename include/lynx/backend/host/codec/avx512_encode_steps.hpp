// Steps of the AVX-512 encode: which layouts it takes, the work unit, prefetches
// of the next item, group minima/maxima, the encoder's scratch, and the packing of
// staged code bytes into plane words.
#pragma once

#include "lynx/backend/host/codec/avx512_base.hpp"

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

}  // namespace lynx::detail::simd

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // LYNX_CODEC_AVX512
