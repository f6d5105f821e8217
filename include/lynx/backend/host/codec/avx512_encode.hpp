// The AVX-512 encode of a work unit of any supported layout (encode_unit):
// key parameters, then per block key codes, value parameters and value codes,
// packed straight into the segments' plane words.
#pragma once

#include "lynx/backend/host/codec/avx512_encode_bf16.hpp"

#if LYNX_CODEC_AVX512

// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into these kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail::simd {

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
    // (its row pointers step by token_stride through the block: a paged view
    // qualifies with blocks of a multiple of 32 tokens)
    if (bf16_block_fits(g) && u1 - u0 == tokens_per_word &&
        keys.rows_even_in_runs_of(tokens_per_word) &&
        values.rows_even_in_runs_of(tokens_per_word)) {
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

}  // namespace lynx::detail::simd

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // LYNX_CODEC_AVX512
