// AVX-512 kernels shared by the bit-plane and code paths of the host attention:
// exp2 and the softmax's score preparation, query folding into a key group, and
// the value weights.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lynx/backend/host/attention/portable.hpp"
#include "lynx/backend/host/attention/target.hpp"
#include "lynx/backend/host/isa.hpp"

#if LYNX_ATTENTION_AVX512
// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into target functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail {

/// attention_exp2's polynomial (tile_math.hpp), highest degree first: the SIMD
/// kernels evaluate it with the same fused multiply-adds in the same order.
inline constexpr float exp2_poly[8] = {1.5252733804059840e-05f, 1.5403530393381609e-04f,
                                       1.3333558146428443e-03f, 9.6181291076284772e-03f,
                                       5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                       6.9314718055994531e-01f, 1.0f};

LYNX_ATTENTION_AVX512_TARGET inline __m512 exp2_avx512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(exp2_poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_poly[i]));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_maskz_mov_ps(live, n)), _mm512_set1_epi32(127)),
      23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

/// s[i] = exp2(s[i] - m) in place, and returns fixed_order_sum (tile_math.hpp) of
/// the results: its 16 lanes added as each vector is made, then its halving tree
/// (the same adds in the same order as a second pass, without the second pass).
LYNX_ATTENTION_AVX512_TARGET inline float exp2_shifted_sum_avx512(float* s, std::int64_t n,
                                                                  float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lane = _mm512_setzero_ps();
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
    _mm512_storeu_ps(s + i, e);
    lane = _mm512_add_ps(lane, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 e = exp2_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    _mm512_mask_storeu_ps(s + i, k, e);
    lane = _mm512_mask_add_ps(lane, k, lane, e);
  }
  alignas(64) float r[16];
  _mm512_store_ps(r, lane);
  return reduce_lanes(r);
}

/// 16 consecutive bf16 parameters as floats (exact); with k, those of the lanes
/// set in k (the rest 0, nothing read for them).
LYNX_ATTENTION_AVX512_TARGET inline __m512 params16_avx512(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
LYNX_ATTENTION_AVX512_TARGET inline __m512 params16_avx512(__mmask16 k, const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/// fold_query_into_key_group for `heads` queries q[h][D] against one key group,
/// 16 channels per step (same operations per lane): the group's scale * unit and
/// scale * half + zero are computed once for all heads, each head's lanes fold by
/// the same halving tree, in registers.
LYNX_ATTENTION_AVX512_TARGET inline void fold_queries_avx512(const float* q, int heads,
                                                             const bf16* scale, const bf16* zero,
                                                             int D, float unit, float half,
                                                             float* qs, float* bias) {
  const __m512 u = _mm512_set1_ps(unit), hv = _mm512_set1_ps(half);
  for (int h0 = 0; h0 < heads; h0 += 8) {
    const int hn = heads - h0 < 8 ? heads - h0 : 8;
    __m512 lane[8];  // constant bounds and guards below: the lanes stay in registers
    for (int h = 0; h < 8; ++h) lane[h] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
      const __mmask16 k = D - c >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << (D - c)) - 1u);
      const __m512 sc = params16_avx512(k, scale + c);
      const __m512 su = _mm512_mul_ps(sc, u),
                   off = _mm512_fmadd_ps(sc, hv, params16_avx512(k, zero + c));
#pragma GCC unroll 8
      for (int h = 0; h < 8; ++h) {
        if (h >= hn) break;
        const __m512 qv = _mm512_maskz_loadu_ps(k, q + (h0 + h) * D + c);
        _mm512_mask_storeu_ps(qs + (h0 + h) * D + c, k, _mm512_mul_ps(qv, su));
        lane[h] = _mm512_mask3_fmadd_ps(qv, off, lane[h], k);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < 8; ++h) {  // l += l+8, l += l+4, l += l+2, l += l+1
      if (h >= hn) break;
      __m512 x = lane[h];
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xEE));
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x55));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xEE));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x55));
      bias[h0 + h] = _mm512_cvtss_f32(x);
    }
  }
}

/// Elements 0, groups, 2 groups, ... of `column` (a column of the value
/// parameters) for the lanes set in `live`, the rest 0: one element at a time
/// (the ends of splits and uncommon group counts), never reading past the last.
LYNX_ATTENTION_AVX512_TARGET inline __m512 group_column_part_avx512(const bf16* column,
                                                                    std::int64_t groups,
                                                                    __mmask16 live) {
  alignas(32) std::uint16_t bits[16] = {};
  for (int l = 0; l < 16; ++l)
    if ((live >> l) & 1u) bits[l] = column[l * groups].bits;
  return params16_avx512(reinterpret_cast<const bf16*>(bits));
}

/// Column g of 16 consecutive rows of a [rows][groups] bf16 array (the value
/// parameters of 16 tokens) as floats: permutes for 1, 2, 4, 8 groups.
LYNX_ATTENTION_AVX512_TARGET inline __m512 group_column_avx512(const bf16* rows,
                                                               std::int64_t groups,
                                                               std::int64_t g) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int G = static_cast<int>(groups), gi = static_cast<int>(g);
  switch (G) {
    case 1:
      return params16_avx512(rows);
    case 2: {
      const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(lane, 1), _mm512_set1_epi32(gi));
      return _mm512_permutex2var_ps(params16_avx512(rows), idx, params16_avx512(rows + 16));
    }
    case 4: {
      const __m512i idx =
          _mm512_add_epi32(_mm512_slli_epi32(lane, 2), _mm512_set1_epi32(gi));  // lanes 0-7 valid
      const __m512 a =
          _mm512_permutex2var_ps(params16_avx512(rows), idx, params16_avx512(rows + 16));
      const __m512 b =
          _mm512_permutex2var_ps(params16_avx512(rows + 32), idx, params16_avx512(rows + 48));
      return _mm512_shuffle_f32x4(a, b, 0x44);
    }
    case 8: {
      const __m512i idx =
          _mm512_add_epi32(_mm512_slli_epi32(lane, 3), _mm512_set1_epi32(gi));  // lanes 0-3 valid
      __m512 q[4];
      for (int k = 0; k < 4; ++k)
        q[k] = _mm512_permutex2var_ps(params16_avx512(rows + 32 * k), idx,
                                      params16_avx512(rows + 32 * k + 16));
      const __m512 x = _mm512_shuffle_f32x4(q[0], q[1], 0x00),
                   y = _mm512_shuffle_f32x4(q[2], q[3], 0x00);
      return _mm512_shuffle_f32x4(x, y, 0x88);
    }
    default:
      return group_column_part_avx512(rows + g, groups, static_cast<__mmask16>(0xFFFF));
  }
}

/// value_weights_avx512 for heads [h0, h0 + hn) and groups [g0, g0 + gn), hn <= HN, gn <= GN
/// (the loops run to the constants HN, GN, so the lanes stay in registers).
/// The weights of head h, group grp go to row (h - out.h0) * out.groups + grp - out.g0 of out.rows.
struct weight_rows {
  float* rows;
  int h0;
  std::int64_t g0, groups;
};
template <int HN, int GN>
LYNX_ATTENTION_AVX512_TARGET inline void value_weights_tile_avx512(
    const bf16* vs, const bf16* vz, std::int64_t groups, int h0, int hn, std::int64_t g0, int gn,
    std::int64_t t0, std::int64_t n, __m512 u, __m512 hv, const split_scratch& w,
    const weight_rows& out) {
  // local copies: the stores below cannot change them
  const float* const scores = w.scores;
  float* const weights =
      out.rows + ((h0 - out.h0) * out.groups + g0 - out.g0) * attention_split_tokens;
  const std::int64_t out_groups = out.groups;
  __m512 lanes[HN][GN];
  for (int h = 0; h < HN; ++h)
    for (int k = 0; k < GN; ++k) lanes[h][k] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 live =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const bool whole = live == static_cast<__mmask16>(0xFFFF);
    __m512 p[HN];
#pragma GCC unroll 8
    for (int h = 0; h < HN; ++h)
      p[h] = h < hn ? _mm512_maskz_loadu_ps(live, scores + (h0 + h) * attention_split_tokens + i)
                    : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int k = 0; k < GN; ++k) {
      if (k >= gn) break;
      const std::int64_t grp = g0 + k;
      const bf16* base_s = vs + (t0 + i) * groups + grp;
      const bf16* base_z = vz + (t0 + i) * groups + grp;
      const __m512 sc = whole ? group_column_avx512(base_s - grp, groups, grp)
                              : group_column_part_avx512(base_s, groups, live);
      const __m512 zr = whole ? group_column_avx512(base_z - grp, groups, grp)
                              : group_column_part_avx512(base_z, groups, live);
      const __m512 su = _mm512_mul_ps(sc, u), off = _mm512_fmadd_ps(sc, hv, zr);
#pragma GCC unroll 8
      for (int h = 0; h < HN; ++h) {
        if (h >= hn) break;
        _mm512_mask_storeu_ps(weights + (h * out_groups + k) * attention_split_tokens + i, live,
                              _mm512_mul_ps(p[h], su));
        lanes[h][k] = _mm512_mask3_fmadd_ps(p[h], off, lanes[h][k], live);  // value_offset_step
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < HN; ++h)
#pragma GCC unroll 8
    for (int k = 0; k < GN; ++k) {  // l += l+8, l += l+4, l += l+2, l += l+1
      if (h >= hn || k >= gn) continue;
      __m512 x = lanes[h][k];
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xEE));
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x55));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xEE));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x55));
      w.offsets[(h0 + h) * groups + g0 + k] = _mm512_cvtss_f32(x);
    }
}

/// True when accumulate_values_avx512 runs the GFNI value kernels (which compute
/// the value weights themselves), false when it runs the portable loop.
inline bool gfni_values(const plane_kv_source& src) {
  return host_has_gfni() && src.view.geometry.value_group % 16 == 0;
}

/// value_weights_portable for heads [h0, h0 + hn) and groups [g0, g0 + gn), 16
/// tokens per step (same operations per lane), the weights into `out`.
template <class Source>
LYNX_ATTENTION_AVX512_TARGET void value_weights_range_avx512(
    const Source& src, std::int64_t kv_head, int h0, int hn, std::int64_t g0, std::int64_t gn,
    std::int64_t t0, std::int64_t t1, const split_scratch& w, const weight_rows& out) {
  const layer_geometry& g = src.view.geometry;
  const std::int64_t groups = g.value_channel_groups();
  // the GFNI value kernels multiply by prefix << (decoded_bits - P): the weights
  // carry 2^-(decoded_bits - P) (exact, a power of two)
  const int shift = gfni_values(src) ? decoded_bits(src.planes) - src.planes : 0;
  const __m512 u = _mm512_set1_ps(std::ldexp(src.level_unit(), -shift)),
               hv = _mm512_set1_ps(src.half());
  const bf16* vs = src.view.value_scale() + kv_head * g.tokens * groups;
  const bf16* vz = src.view.value_zero() + kv_head * g.tokens * groups;
  const std::int64_t n = t1 - t0;
  // up to 4 heads x 4 groups at a time (the 16 offset lanes stay in registers), else 8 x 8
  // (no dispatch lambda here: a lambda has no target attribute, and the tiles take vectors)
  if (gn == 1 && hn == 4) {  // one pass of the GFNI value kernels
    value_weights_tile_avx512<4, 1>(vs, vz, groups, h0, 4, g0, 1, t0, n, u, hv, w, out);
  } else if (gn == 1 && hn == 2) {
    value_weights_tile_avx512<2, 1>(vs, vz, groups, h0, 2, g0, 1, t0, n, u, hv, w, out);
  } else if (gn == 1 && hn == 1) {
    value_weights_tile_avx512<1, 1>(vs, vz, groups, h0, 1, g0, 1, t0, n, u, hv, w, out);
  } else if (hn <= 4 && gn <= 4) {
    value_weights_tile_avx512<4, 4>(vs, vz, groups, h0, hn, g0, static_cast<int>(gn), t0, n, u, hv,
                                    w, out);
  } else if (hn % 4 == 0 && gn % 4 == 0) {
    for (int h = h0; h < h0 + hn; h += 4)
      for (std::int64_t k = g0; k < g0 + gn; k += 4)
        value_weights_tile_avx512<4, 4>(vs, vz, groups, h, 4, k, 4, t0, n, u, hv, w, out);
  } else {
    for (int h = h0; h < h0 + hn; h += 8)
      for (std::int64_t k = g0; k < g0 + gn; k += 8)
        value_weights_tile_avx512<8, 8>(vs, vz, groups, h, std::min(8, h0 + hn - h), k,
                                        static_cast<int>(std::min<std::int64_t>(8, g0 + gn - k)),
                                        t0, n, u, hv, w, out);
  }
  // tokens past t1 in the last block weigh 0 (the kernels walk whole blocks)
  const std::int64_t end =
      (t1 + attention_block_tokens - 1) / attention_block_tokens * attention_block_tokens;
  for (int h = h0; h < h0 + hn; ++h)
    for (std::int64_t grp = g0; grp < g0 + gn; ++grp)
      for (std::int64_t t = t1; t < end; ++t)
        out.rows[((h - out.h0) * out.groups + grp - out.g0) * attention_split_tokens + (t - t0)] =
            0.0f;
}

/// value_weights_portable: all heads and groups into w.weights.
template <class Source>
LYNX_ATTENTION_AVX512_TARGET void value_weights_avx512(const Source& src, std::int64_t kv_head,
                                                       int heads, std::int64_t t0, std::int64_t t1,
                                                       const split_scratch& w) {
  const std::int64_t groups = src.view.geometry.value_channel_groups();
  value_weights_range_avx512(src, kv_head, 0, heads, 0, groups, t0, t1, w,
                             weight_rows{w.weights, 0, 0, groups});
}

/// Logits to the log2 domain with tokens before first_visible masked; returns the max.
/// Sets `bad` when a visible logit is not finite (NaN or infinite K/V or queries, or
/// an overflow), which the max and exp2 would otherwise pass over silently.
LYNX_ATTENTION_AVX512_TARGET inline float prepare_scores_avx512(float* s, std::int64_t n,
                                                                std::int64_t t0,
                                                                std::int64_t first_visible,
                                                                bool& bad) {
  const __m512 log2e = _mm512_set1_ps(attention_log2e), ninf = _mm512_set1_ps(attention_neg_inf);
  __m512 mx = ninf;
  __mmask16 non_finite = 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 live =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    // visible: t0 + i + lane >= first_visible  <=>  lane >= first_visible - t0 - i
    const std::int64_t need = first_visible - t0 - i;
    const __mmask16 seen =
        need <= 0    ? static_cast<__mmask16>(0xFFFF)
        : need >= 16 ? static_cast<__mmask16>(0)
                     : _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(need)));
    const __m512 x = _mm512_mask_mul_ps(ninf, seen, _mm512_maskz_loadu_ps(live, s + i), log2e);
    _mm512_mask_storeu_ps(s + i, live, x);
    mx = _mm512_mask_max_ps(mx, live, mx, x);
    non_finite |= _mm512_mask_fpclass_ps_mask(live & seen, x, 0x99);  // NaN, +-infinity
  }
  bad = non_finite != 0;
  return _mm512_reduce_max_ps(mx);
}

}  // namespace lynx::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // LYNX_ATTENTION_AVX512
