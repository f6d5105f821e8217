// AVX2 kernels of the host attention (x86-64 without AVX-512): dense scores and
// values, exp2 and score preparation, bit-plane key decoding and scores, query
// folding, bit-plane value weights and sums.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "lynx/backend/host/attention/avx512_dense.hpp"
#include "lynx/backend/host/isa.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/dispatch.hpp"

namespace lynx::detail {

// ---------------------------------------------------------------------------
// AVX2 kernels (x86-64 without AVX-512: AMD Zen 2/3, Intel client parts).
// ---------------------------------------------------------------------------
// The same operations in the same order as the portable walk, lane by lane, so
// the same bits; a 16-lane sum of the fixed order is two 8-lane vectors (lanes
// 0-7, lanes 8-15). Where a kernel here does not take a shape, the portable walk
// compiled for AVX2 + FMA does (compute_split_avx2).
#if LYNX_ATTENTION_AVX512
#define LYNX_ATTENTION_AVX2_TARGET __attribute__((target("avx2,fma")))

/// The halving tree (reduce_lanes) of four 16-lane sums at once, each given as
/// its lanes 0-7 (lo) and 8-15 (hi): l += l+8, l += l+4, l += l+2, l += l+1.
/// Returns the four totals in lanes 0, 4, 1 and 5 (sums 0, 1, 2, 3).
LYNX_ATTENTION_AVX2_TARGET inline __m256 fold4_avx2(const __m256* lo, const __m256* hi) {
  __m256 s[4];
  for (int i = 0; i < 4; ++i) s[i] = _mm256_add_ps(lo[i], hi[i]);  // l += l + 8
  // l += l + 4: the low 128 bits of sums 0 and 1 (2 and 3) plus their high 128 bits
  const __m256 u0 = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20),
                                  _mm256_permute2f128_ps(s[0], s[1], 0x31));
  const __m256 u1 = _mm256_add_ps(_mm256_permute2f128_ps(s[2], s[3], 0x20),
                                  _mm256_permute2f128_ps(s[2], s[3], 0x31));
  // l += l + 2: [a0 a1 b0 b1] + [a2 a3 b2 b3] in each half (a: sum 0 or 1, b: sum 2 or 3)
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x44), _mm256_shuffle_ps(u0, u1, 0xEE));
  // l += l + 1: [v0 v2] + [v1 v3]
  return _mm256_add_ps(_mm256_shuffle_ps(v, v, 0x88), _mm256_shuffle_ps(v, v, 0xDD));
}

/// 8 consecutive bf16 values (quantization parameters) as floats.
LYNX_ATTENTION_AVX2_TARGET inline __m256 load8_bf16_avx2(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

/// Dense bf16 scores of HC (1, 2 or 4) heads against key row `row` (D a multiple
/// of 32): the 32 channels of each step are widened as even and odd halves and
/// multiplied by the query permuted the same way (qp: [HC][D], permute_query_bf16),
/// so lane l of a head's sum takes channels 32j + 2l, then 32j + 2l + 1
/// (dense_score_lane<bf16>); then the halving tree. out: [HC][S] at the token.
template <int HC>
LYNX_ATTENTION_AVX2_TARGET inline void score_bf16_row_avx2(const bf16* row, const float* qp, int D,
                                                           float* out) {
  __m256 lo[4], hi[4];
  for (int h = 0; h < 4; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < D; c += 32) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c + 16));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)),
                 odd0 = _mm256_castsi256_ps(_mm256_and_si256(x0, high)),
                 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16)),
                 odd1 = _mm256_castsi256_ps(_mm256_and_si256(x1, high));
    for (int h = 0; h < HC; ++h) {
      const float* qh = qp + h * D + c;
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), even0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), even1, hi[h]);
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16), odd0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 24), odd1, hi[h]);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, fold4_avx2(lo, hi));
  constexpr int lane_of[4] = {0, 4, 1, 5};
  for (int h = 0; h < HC; ++h) out[h * attention_split_tokens] = r[lane_of[h]];
}

/// Dense float scores of HC (1, 2 or 4) heads against key row `row` (D a multiple
/// of 16): lane l of a head's sum takes channels 16j + l in channel order, then the
/// halving tree. q: [HC][D].
template <int HC>
LYNX_ATTENTION_AVX2_TARGET inline void score_float_row_avx2(const float* row, const float* q, int D,
                                                            float* out) {
  __m256 lo[4], hi[4];
  for (int h = 0; h < 4; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 16) {
    const __m256 k0 = _mm256_loadu_ps(row + c), k1 = _mm256_loadu_ps(row + c + 8);
    for (int h = 0; h < HC; ++h) {
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c), k0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c + 8), k1, hi[h]);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, fold4_avx2(lo, hi));
  constexpr int lane_of[4] = {0, 4, 1, 5};
  for (int h = 0; h < HC; ++h) out[h * attention_split_tokens] = r[lane_of[h]];
}

/// Dense scores of tokens [t0, t1), four heads per pass over a row (avx2_supports:
/// contiguous rows, head_dim a multiple of 32 for bf16 and of 16 for float). bf16
/// queries are permuted into the value weight scratch (a dense source has none).
template <class T>
LYNX_ATTENTION_AVX2_TARGET void score_tokens_avx2(const dense_kv_source<T>& src,
                                                  std::int64_t kv_head, const float* q, int heads,
                                                  std::int64_t t0, std::int64_t t1,
                                                  const split_scratch& w) {
  const int D = src.head_dim();
  const float* qp = q;
  if constexpr (std::is_same_v<T, bf16>) {
    permute_query_bf16(q, heads, D, D, w.weights);
    qp = w.weights;
  }
  for (std::int64_t t = t0; t < t1; ++t) {
    if (t + dense_prefetch_rows < t1)
      prefetch_lines<2>(&src.keys(t + dense_prefetch_rows, kv_head, 0), D * sizeof(T));
    const T* row = &src.keys(t, kv_head, 0);
    float* out = w.scores + (t - t0);
    for (int h = 0; h < heads;) {
      const int hc = heads - h >= 4 ? 4 : heads - h >= 2 ? 2 : 1;
      dispatch<1, 2, 4>(hc, [&]<int HC>() {
        if constexpr (std::is_same_v<T, bf16>)
          score_bf16_row_avx2<HC>(row, qp + h * D, D, out + h * attention_split_tokens);
        else
          score_float_row_avx2<HC>(row, qp + h * D, D, out + h * attention_split_tokens);
      });
      h += hc;
    }
  }
}

/// Dense values of HC (1..4) heads x 16 channels [c0, c0 + 16) over the n rows of a
/// tile (rows[i][D], floats): lane = channel, one fused multiply-add per row in
/// order, the sums carried in acc between calls (0 before the first). p: the
/// weights of the tile's first row (heads attention_split_tokens apart).
template <int HC>
LYNX_ATTENTION_AVX2_TARGET inline void add_dense_tile_chunk_avx2(const float* rows, std::int64_t n,
                                                                 int c0, const float* p, float* acc,
                                                                 int D) {
  __m256 a[HC][2];
  for (int h = 0; h < HC; ++h) {
    a[h][0] = _mm256_loadu_ps(acc + h * D + c0);
    a[h][1] = _mm256_loadu_ps(acc + h * D + c0 + 8);
  }
  const float* row = rows + c0;
  for (std::int64_t i = 0; i < n; ++i, row += D) {
    __m256 v0 = _mm256_load_ps(row), v1 = _mm256_load_ps(row + 8);
    // held in registers for all heads: GCC 12 otherwise folds the two loads into
    // every head's multiply-add (12 loads a row where 6 do; the bf16 baseline at 32K
    // tokens, one thread, Zen 3, minimum of 6 alternating rounds: 19.1 -> 18.0 ms)
    asm("" : "+x"(v0), "+x"(v1));
    for (int h = 0; h < HC; ++h) {
      const __m256 ph = _mm256_broadcast_ss(p + h * attention_split_tokens + i);
      a[h][0] = _mm256_fmadd_ps(ph, v0, a[h][0]);
      a[h][1] = _mm256_fmadd_ps(ph, v1, a[h][1]);
    }
  }
  for (int h = 0; h < HC; ++h) {
    _mm256_storeu_ps(acc + h * D + c0, a[h][0]);
    _mm256_storeu_ps(acc + h * D + c0 + 8, a[h][1]);
  }
}

/// A value row as floats into a tile row (16-float aligned): bf16 16 channels per
/// load as even and odd halves (channels c + 2l, then c + 2l + 1), floats as they are.
template <class T>
LYNX_ATTENTION_AVX2_TARGET inline void tile_row_avx2(const T* x, int D, float* out) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int c = 0; c < D; c += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c));
      _mm256_store_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_store_ps(out + c + 8, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
  } else {
    for (int c = 0; c < D; c += 8) _mm256_store_ps(out + c, _mm256_loadu_ps(x + c));
  }
}

/// 16 sums kept in the order of tile_row_avx2's bf16 rows (channels 2l, then
/// 2l + 1) put back in channel order, in place.
LYNX_ATTENTION_AVX2_TARGET inline void unpermute_bf16_avx2(float* x16) {
  const __m256 e = _mm256_loadu_ps(x16), o = _mm256_loadu_ps(x16 + 8);
  const __m256 x = _mm256_unpacklo_ps(e, o),  // channels 0-3 | 8-11
      y = _mm256_unpackhi_ps(e, o);           // channels 4-7 | 12-15
  _mm256_storeu_ps(x16, _mm256_permute2f128_ps(x, y, 0x20));
  _mm256_storeu_ps(x16 + 8, _mm256_permute2f128_ps(x, y, 0x31));
}

/// Dense values of tokens [t0, t1): acc[h][c] = sum_t p[h][t] * v[t][c]. The rows
/// of a 32-token block are first copied as floats into a contiguous tile: read in
/// place, rows kv_heads * head_dim apart (2 KiB for 8 x 128 bf16) fall in two L1
/// sets per line and evict each other between the passes over channels. The sums
/// are carried in acc (bf16: in tile_row_avx2's order until the end).
template <class T>
LYNX_ATTENTION_AVX2_TARGET void accumulate_values_avx2(const dense_kv_source<T>& src,
                                                       std::int64_t kv_head, int heads,
                                                       std::int64_t t0, std::int64_t t1, float* acc,
                                                       const split_scratch& w) {
  const int D = src.head_dim();
  std::fill(acc, acc + heads * D, 0.0f);
  for (std::int64_t ta = t0; ta < t1; ta += attention_block_tokens) {
    const std::int64_t tz = std::min<std::int64_t>(ta + attention_block_tokens, t1);
    for (std::int64_t t = ta; t < tz; ++t) {
      if (t + dense_prefetch_rows < t1)
        prefetch_lines<2>(&src.values(t + dense_prefetch_rows, kv_head, 0), D * sizeof(T));
      tile_row_avx2(&src.values(t, kv_head, 0), D, w.tile + (t - ta) * D);
    }
    for (int h = 0; h < heads; h += 4) {
      const float* p = w.scores + h * attention_split_tokens + (ta - t0);
      for (int c0 = 0; c0 < D; c0 += 16)
        dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
          add_dense_tile_chunk_avx2<HC>(w.tile, tz - ta, c0, p, acc + h * D, D);
        });
    }
  }
  if constexpr (std::is_same_v<T, bf16>)
    for (int i = 0; i < heads * D; i += 16) unpermute_bf16_avx2(acc + i);
}

/// attention_exp2 lane by lane (tile_math.hpp): the same operations.
LYNX_ATTENTION_AVX2_TARGET inline __m256 exp2_avx2(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
  x = _mm256_and_ps(x, live);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(x, magic), magic);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(exp2_poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_poly[i]));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

/// Lanes [0, k) of 8 set (k <= 8), as a mask for maskload / maskstore / blends.
LYNX_ATTENTION_AVX2_TARGET inline __m256i first_lanes_avx2(std::int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// s[i] = exp2(s[i] - m) in place; returns fixed_order_sum of the results (lanes
/// 0-7 and 8-15 of each 16 summed as they are made, then the halving tree).
LYNX_ATTENTION_AVX2_TARGET inline float exp2_shifted_sum_avx2(float* s, std::int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 lane[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    lane[(i / 8) % 2] = _mm256_add_ps(lane[(i / 8) % 2], e);
  }
  if (i < n) {
    const __m256i k = first_lanes_avx2(n - i);
    const __m256 e = exp2_avx2(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), mv));
    _mm256_maskstore_ps(s + i, k, e);
    __m256& a = lane[(i / 8) % 2];
    a = _mm256_blendv_ps(a, _mm256_add_ps(a, e), _mm256_castsi256_ps(k));
  }
  alignas(32) float r[16];
  _mm256_store_ps(r, lane[0]);
  _mm256_store_ps(r + 8, lane[1]);
  return reduce_lanes(r);
}

/// Logits to the log2 domain with tokens before first_visible masked; returns the
/// max and sets `bad` for a visible logit that is not finite (prepare_scores_avx512).
LYNX_ATTENTION_AVX2_TARGET inline float prepare_scores_avx2(float* s, std::int64_t n,
                                                            std::int64_t t0,
                                                            std::int64_t first_visible, bool& bad) {
  const __m256 log2e = _mm256_set1_ps(attention_log2e), ninf = _mm256_set1_ps(attention_neg_inf);
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256 mx = ninf;
  __m256i non_finite = _mm256_setzero_si256();
  for (std::int64_t i = 0; i < n; i += 8) {
    const __m256i live = first_lanes_avx2(n - i);
    // visible: t0 + i + lane >= first_visible  <=>  lane > first_visible - t0 - i - 1
    const std::int64_t need = std::clamp<std::int64_t>(first_visible - t0 - i, 0, 8);
    const __m256i seen = _mm256_cmpgt_epi32(_mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8),
                                            _mm256_set1_epi32(static_cast<int>(need)));
    const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_maskload_ps(s + i, live), log2e),
                                      _mm256_castsi256_ps(seen));
    _mm256_maskstore_ps(s + i, live, x);
    mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, x), _mm256_castsi256_ps(live));
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), exponent);
    non_finite = _mm256_or_si256(non_finite, _mm256_and_si256(_mm256_and_si256(live, seen),
                                                              _mm256_cmpeq_epi32(e, exponent)));
  }
  bad = !_mm256_testz_si256(non_finite, non_finite);
  alignas(32) float r[8];
  _mm256_store_ps(r, mx);
  float m = r[0];
  for (int l = 1; l < 8; ++l) m = r[l] > m ? r[l] : m;
  return m;
}

/// Exchanges bit b + S of each byte of a with bit b of the same byte of b (the
/// bits of m): swap_bits on eight lanes.
template <int S>
LYNX_ATTENTION_AVX2_TARGET inline void swap_bits_avx2(__m256i& a, __m256i& b, __m256i m) {
  const __m256i t = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi32(a, S), b), m);
  b = _mm256_xor_si256(b, t);
  a = _mm256_xor_si256(a, _mm256_slli_epi32(t, S));
}

/// The R rows of a bit matrix whose transpose is N planes' codes at channels
/// [c, c + 8): plane N - 1 - k as row k (the code's lowest bit first), rows N..R-1
/// zero (absent planes).
template <int N, int R>
LYNX_ATTENTION_AVX2_TARGET inline void load_plane_rows_avx2(const std::uint32_t* const* row, int c,
                                                            __m256i* r) {
  static_assert(N >= 1 && N <= R);
  for (int k = 0; k < R; ++k)
    r[k] = k < N ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[(N - 1 - k) % N] + c))
                 : _mm256_setzero_si256();
}

/// The codes of one 32-token block of N (<= 8) planes at channels [c, c + 8), a
/// lane each, as bytes: byte g of lane l of r[i] is token 8g + i's code in channel
/// c + l (plane 0 at bit N - 1, the bits above N 0). Each lane's plane words are
/// the rows of an 8 x 32 bit matrix (plane N - 1 - k as row k, absent planes 0),
/// transposed as four 8x8 blocks like transpose_bytes_8x8.
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void plane_code_lanes_avx2(const std::uint32_t* const* row, int c,
                                                             __m256i* r) {
  static_assert(N >= 1 && N <= 8);
  load_plane_rows_avx2<N, 8>(row, c, r);
  const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x33333333),
                m1 = _mm256_set1_epi32(0x55555555);
  for (int i = 0; i < 4; ++i) swap_bits_avx2<4>(r[i], r[i + 4], m4);
  for (int i : {0, 1, 4, 5}) swap_bits_avx2<2>(r[i], r[i + 2], m2);
  for (int i : {0, 2, 4, 6}) swap_bits_avx2<1>(r[i], r[i + 1], m1);
}

/// The codes of one 32-token block of N (<= 4) planes at channels [c, c + 8), a
/// lane each, as nibbles: byte g of lane l of r[k] holds token 8g + k's code in its
/// low nibble and token 8g + k + 4's in its high one (plane 0 at bit N - 1). The
/// rows (plane N - 1 - m as row m, absent planes 0) are transposed as 4 x 4 bit
/// blocks, one per nibble: two delta swap stages where 8 planes need three.
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void plane_code_nibbles_avx2(const std::uint32_t* const* row,
                                                               int c, __m256i* r) {
  static_assert(N >= 1 && N <= 4);
  load_plane_rows_avx2<N, 4>(row, c, r);
  const __m256i m2 = _mm256_set1_epi32(0x33333333), m1 = _mm256_set1_epi32(0x55555555);
  swap_bits_avx2<2>(r[0], r[2], m2);
  swap_bits_avx2<2>(r[1], r[3], m2);
  swap_bits_avx2<1>(r[0], r[1], m1);
  swap_bits_avx2<1>(r[2], r[3], m1);
}

/// x[l] lane i = r[i] lane l: an 8 x 8 transpose of 32-bit lanes.
LYNX_ATTENTION_AVX2_TARGET inline void transpose_8x8_epi32_avx2(const __m256i* r, __m256i* x) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);      // lanes 0, 1 | 4, 5
    t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);  // lanes 2, 3 | 6, 7
  }
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < 2; ++j) {
      u[4 * k + 2 * j] = _mm256_unpacklo_epi64(t[4 * k + j], t[4 * k + j + 2]);      // lane 2j | +4
      u[4 * k + 2 * j + 1] = _mm256_unpackhi_epi64(t[4 * k + j], t[4 * k + j + 2]);  // 2j + 1
    }
  for (int l = 0; l < 4; ++l) {
    x[l] = _mm256_permute2x128_si256(u[l], u[4 + l], 0x20);
    x[l + 4] = _mm256_permute2x128_si256(u[l], u[4 + l], 0x31);
  }
}

/// Byte q of each 32-bit lane of v.
LYNX_ATTENTION_AVX2_TARGET inline __m256i lane_byte_avx2(__m256i v, int q) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * q), _mm256_set1_epi32(0xff));
}

/// N planes' codes of channels c0.. (word c of each plane row on) as bytes, a
/// channel per vector into out[c0..] (decode_key_tile_avx2's tile layout).
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void store_key_chunk_avx2(const std::uint32_t* const* planes,
                                                            int c, int c0, int D, __m256i* out) {
  __m256i r[8], x[8];
  plane_code_lanes_avx2<N>(planes, c, r);
  transpose_8x8_epi32_avx2(r, x);
  for (int l = 0; l < std::min(8, D - c0); ++l) _mm256_store_si256(out + c0 + l, x[l]);
}

/// store_key_chunk_avx2 for N <= 4 planes from plane_code_nibbles_avx2: a 4 x 8
/// transpose of 32-bit lanes gives each channel its four dwords, which fill lanes
/// 0-3 of its vector (low nibbles) and, shifted by 4, lanes 4-7 (high nibbles),
/// masked to one code per byte: the same tile as from bytes.
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void store_key_nibbles_avx2(const std::uint32_t* const* planes,
                                                              int c, int c0, int D, __m256i* out) {
  __m256i r[4];
  plane_code_nibbles_avx2<N>(planes, c, r);
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]),
                t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  // u[l]: channel c0 + l's dwords in the low 128 bits, channel c0 + 4 + l's in the high
  const __m256i u[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                        _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
  const __m256i sh = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i m = _mm256_set1_epi32(0x0f0f0f0f);
  auto spread = [&](__m256i x) LYNX_ATTENTION_AVX2_TARGET {
    return _mm256_and_si256(_mm256_srlv_epi32(x, sh), m);
  };
  for (int l = 0; l < 4; ++l) {
    if (l < D - c0)
      _mm256_store_si256(out + c0 + l, spread(_mm256_permute2x128_si256(u[l], u[l], 0x00)));
    if (l + 4 < D - c0)
      _mm256_store_si256(out + c0 + 4 + l, spread(_mm256_permute2x128_si256(u[l], u[l], 0x11)));
  }
}

/// Codes of one 32-token block of P planes, tile[c] a vector per channel: lane i,
/// byte g is token 8g + i's code (lane_byte_avx2(tile[c], g) is tokens 8g..8g + 7
/// in order). Eight channels at a time: their codes as bytes (plane_code_lanes_avx2:
/// byte g of lane l of r[i] is token 8g + i of channel l), transposed to a channel
/// per vector. More than 8 planes: tile[c] holds planes 0..7 (the code's high
/// bits), tile[D + c] planes 8..P-1. Four times smaller than a float tile, which
/// evicted the plane words asked into L1 ahead of use.
template <int P>
LYNX_ATTENTION_AVX2_TARGET inline void decode_key_tile_avx2(const std::uint32_t* const* rows, int D,
                                                            __m256i* tile) {
  constexpr int PH = P < 8 ? P : 8, PL = P - PH;
  for (int c0 = 0; c0 < D; c0 += 8) {
    const std::uint32_t* const* src = rows;
    int c = c0;
    std::uint32_t pad[P][8];  // a last chunk of fewer than 8 channels, zero padded
    const std::uint32_t* padded[P];
    if (c0 + 8 > D) {
      for (int j = 0; j < P; ++j) {
        for (int k = 0; k < 8; ++k) pad[j][k] = c0 + k < D ? rows[j][c0 + k] : 0u;
        padded[j] = pad[j];
      }
      src = padded;
      c = 0;
    }
    if constexpr (P <= 4) {
      store_key_nibbles_avx2<P>(src, c, c0, D, tile);
    } else {
      store_key_chunk_avx2<PH>(src, c, c0, D, tile);
      if constexpr (PL > 0) store_key_chunk_avx2<PL>(src + PH, c, c0, D, tile + D);
    }
  }
}

/// Scores of tokens [la, lb) of a block for HC (1..4) heads (score_block_portable's
/// operations): bias[h] + sum_c qs[h][c] * code(c, t), the sum from 0 in channel
/// order, 16 tokens per pass, the codes of decode_key_tile_avx2's tile turned into
/// floats as they are used (Two: high << pl | low). out: [HC][S] at the block's
/// first token.
template <int HC, bool Two>
LYNX_ATTENTION_AVX2_TARGET inline void score_tile_avx2(const __m256i* tile, int D, int pl,
                                                       const float* qs, const float* bias,
                                                       float* out, int la, int lb) {
  static_assert(HC >= 1 && HC <= 4);
  const __m128i pls = _mm_cvtsi32_si128(pl);
  auto pass = [&]<int T0>() LYNX_ATTENTION_AVX2_TARGET {
    if (T0 >= lb || T0 + 16 <= la) return;
    // tokens 8g..8g + 7 of a channel whose tile vectors are hv (high) and lv (low)
    auto code = [&](__m256i hv, __m256i lv, int g) LYNX_ATTENTION_AVX2_TARGET {
      const __m256i high = lane_byte_avx2(hv, g);
      if constexpr (!Two)
        return _mm256_cvtepi32_ps(high);
      else
        return _mm256_cvtepi32_ps(
            _mm256_or_si256(_mm256_sll_epi32(high, pls), lane_byte_avx2(lv, g)));
    };
    // named sums, not an array: GCC 12 kept an array of them in memory as well
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (int c = 0; c < D; ++c) {
      const __m256i hv = _mm256_load_si256(tile + c);
      const __m256i lv = Two ? _mm256_load_si256(tile + D + c) : hv;
      const __m256 k0 = code(hv, lv, T0 / 8), k1 = code(hv, lv, T0 / 8 + 1);
      const __m256 q0 = _mm256_broadcast_ss(qs + c);
      a0 = _mm256_fmadd_ps(q0, k0, a0);
      b0 = _mm256_fmadd_ps(q0, k1, b0);
      if constexpr (HC > 1) {
        const __m256 q1 = _mm256_broadcast_ss(qs + D + c);
        a1 = _mm256_fmadd_ps(q1, k0, a1);
        b1 = _mm256_fmadd_ps(q1, k1, b1);
      }
      if constexpr (HC > 2) {
        const __m256 q2 = _mm256_broadcast_ss(qs + 2 * D + c);
        a2 = _mm256_fmadd_ps(q2, k0, a2);
        b2 = _mm256_fmadd_ps(q2, k1, b2);
      }
      if constexpr (HC > 3) {
        const __m256 q3 = _mm256_broadcast_ss(qs + 3 * D + c);
        a3 = _mm256_fmadd_ps(q3, k0, a3);
        b3 = _mm256_fmadd_ps(q3, k1, b3);
      }
    }
    const __m256 lo[4] = {a0, a1, a2, a3}, hi[4] = {b0, b1, b2, b3};
    const int ta = std::max(la, T0), tz = std::min(lb, T0 + 16);
    for (int h = 0; h < HC; ++h) {
      const __m256 bv = _mm256_set1_ps(bias[h]);
      alignas(32) float r[16];
      _mm256_store_ps(r, _mm256_add_ps(lo[h], bv));
      _mm256_store_ps(r + 8, _mm256_add_ps(hi[h], bv));
      float* o = out + h * attention_split_tokens;
      for (int t = ta; t < tz; ++t) o[t] = r[t - T0];
    }
  };
  pass.template operator()<0>();
  pass.template operator()<16>();
}

/// fold_queries_portable on AVX2 for head_dim a multiple of 16 (else the portable
/// one): fold_query_into_key_group's operations lane by lane (lane = channel mod
/// 16 as two 8-lane halves), the scale terms once for all heads, the bias sums of
/// four heads folded together (fold4_avx2: the halving tree of reduce_lanes).
template <class Source>
LYNX_ATTENTION_AVX2_TARGET void fold_queries_avx2(const Source& src, std::int64_t kv_head,
                                                  std::int64_t grp, const float* q, int heads,
                                                  const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  if (D % attention_reduction_lanes != 0)
    return fold_queries_portable(src, kv_head, grp, q, heads, w);
  const std::int64_t base = (kv_head * g.key_token_groups() + grp) * D;
  const bf16* scale = src.view.key_scale() + base;
  const bf16* zero = src.view.key_zero() + base;
  const __m256 unit = _mm256_set1_ps(src.level_unit()), half = _mm256_set1_ps(src.half());
  for (int h0 = 0; h0 < heads; h0 += 4) {
    const int hn = std::min(4, heads - h0);
    __m256 sum[2][4];  // lanes 0-7 and 8-15 of each head's bias sum
    for (int b = 0; b < 4; ++b) sum[0][b] = sum[1][b] = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 8) {
      const __m256 sc = load8_bf16_avx2(scale + c);
      const __m256 su = _mm256_mul_ps(sc, unit);
      const __m256 shift = _mm256_fmadd_ps(sc, half, load8_bf16_avx2(zero + c));
      const int k = (c / 8) % 2;
      for (int b = 0; b < hn; ++b) {
        const __m256 qv = _mm256_loadu_ps(q + (h0 + b) * D + c);
        _mm256_storeu_ps(w.qs + (h0 + b) * D + c, _mm256_mul_ps(qv, su));
        sum[k][b] = _mm256_fmadd_ps(qv, shift, sum[k][b]);
      }
    }
    alignas(32) float totals[8];  // heads 0..3 in lanes 0, 4, 1, 5
    _mm256_store_ps(totals, fold4_avx2(sum[0], sum[1]));
    constexpr int lane[4] = {0, 4, 1, 5};
    for (int b = 0; b < hn; ++b) w.bias[h0 + b] = totals[lane[b]];
  }
}

/// Logits of tokens [t0, t1) of a bit-plane prompt (score_blocks_portable's walk):
/// each block decoded once by decode_key_tile_avx2, scored per key group it holds.
LYNX_ATTENTION_AVX2_TARGET inline void score_tokens_avx2(const plane_kv_source& src,
                                                         std::int64_t kv_head, const float* q,
                                                         int heads, std::int64_t t0,
                                                         std::int64_t t1, const split_scratch& w,
                                                         const next_split& next = {}) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t KG = g.key_group;
  const std::int64_t b0 = t0 / attention_block_tokens;
  const int nb = static_cast<int>((t1 + attention_block_tokens - 1) / attention_block_tokens - b0);
  with_compiled_plane_count(src.planes, [&](auto p) LYNX_ATTENTION_AVX2_TARGET {
    constexpr int P = p();
    constexpr bool Two = P > 8;             // codes of more than a byte
    constexpr int pl = std::max(P - 8, 0);  // planes of the codes' low byte
    std::int64_t folded_group = -1;
    const std::uint32_t* rows[16];
    __m256i* tile = reinterpret_cast<__m256i*>(w.tile);  // 32-byte aligned (carve_scratch)
    for (std::int64_t b = b0; b * attention_block_tokens < t1; ++b) {
      const std::int64_t tb = b * attention_block_tokens;
      // L2 gets this split's values and the next split's keys a slice per block, as
      // on the AVX-512 path; L1 the keys a few blocks ahead
      src.prefetch_split_slice(false, kv_head, t0, t1, static_cast<int>(b - b0), nb);
      if (next.t1 > next.t0)
        src.prefetch_split_slice(true, next.kv_head, next.t0, next.t1, static_cast<int>(b - b0),
                                 nb);
      src.prefetch_block(true, kv_head, b + prefetch_blocks);
      src.block_rows(true, kv_head, b, rows);
      decode_key_tile_avx2<P>(rows, D, tile);
      for (std::int64_t a = std::max(tb, t0); a < std::min(tb + attention_block_tokens, t1);) {
        const std::int64_t e = std::min({(a / KG + 1) * KG, tb + attention_block_tokens, t1});
        if (a / KG != folded_group)
          fold_queries_avx2(src, kv_head, folded_group = a / KG, q, heads, w);
        for (int h = 0; h < heads; h += 4)
          dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
            float* out = w.scores + h * attention_split_tokens + (tb - t0);
            const int la = static_cast<int>(a - tb), lb = static_cast<int>(e - tb);
            score_tile_avx2<HC, Two>(tile, D, pl, w.qs + h * D, w.bias + h, out, la, lb);
          });
        a = e;
      }
    }
  });
}

/// Whether the AVX2 bit-plane value kernels (value_weights_avx2,
/// accumulate_values_avx2) take this source: head_dim a multiple of 8, each
/// 8-channel chunk within one value group, and 1, 2, 4 or 8 value groups per token
/// (a token's groups side by side in the weights fill whole 8-lane steps).
inline bool avx2_value_planes(const plane_kv_source& src) {
  const layer_geometry& g = src.view.geometry;
  const std::int64_t groups = g.value_channel_groups();
  return plane_count_compiled(src.planes) && g.head_dim % 8 == 0 &&
         (g.value_group % 8 == 0 || groups == 1) &&
         (groups == 1 || groups == 2 || groups == 4 || groups == 8);
}

/// value_weights_portable's numbers for the AVX2 bit-plane values, laid out
/// [h][t - t0][grp] (a token's groups side by side, so that the scales and zeros
/// are read as stored): weight = p * (scale * unit), and offsets[h][grp] from lane
/// (t - t0) mod 16 of each group, value_offset_step in token order, then
/// reduce_lanes. Eight (token, group) elements per step; the scale terms are
/// computed once for all heads.
LYNX_ATTENTION_AVX2_TARGET inline void value_weights_avx2(const plane_kv_source& src,
                                                          std::int64_t kv_head, int heads,
                                                          std::int64_t t0, std::int64_t t1,
                                                          const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int groups = static_cast<int>(g.value_channel_groups());
  const float unit = src.level_unit(), half = src.half();
  const bf16* vs = src.view.value_scale() + (kv_head * g.tokens + t0) * groups;
  const bf16* vz = src.view.value_zero() + (kv_head * g.tokens + t0) * groups;
  constexpr std::int64_t S = attention_split_tokens;
  const std::int64_t n = (t1 - t0) * groups;         // elements (token, group)
  const int L = attention_reduction_lanes * groups;  // lanes of all groups: [lane][grp]
  alignas(32) float lanes[4][attention_reduction_lanes * 8];
  // element e of a step of 8 takes the p of token e / groups of the step
  const __m256i pick = groups == 1   ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                       : groups == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                     : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  auto token_p =
      [&](const float* p)
          LYNX_ATTENTION_AVX2_TARGET {  // p of the step's tokens, spread to their elements
            if (groups == 1) return _mm256_loadu_ps(p);
            if (groups == 2)
              return _mm256_permutevar8x32_ps(_mm256_broadcast_ps((const __m128*)p), pick);
            if (groups == 4)
              return _mm256_permutevar8x32_ps(
                  _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))), pick);
            return _mm256_broadcast_ss(p);
          };
  const __m256 vu = _mm256_set1_ps(unit), vh = _mm256_set1_ps(half);
  for (int h0 = 0; h0 < heads; h0 += 4) {
    const int hn = std::min(4, heads - h0);
    for (int b = 0; b < hn; ++b) std::fill(lanes[b], lanes[b] + L, 0.0f);
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 s = load8_bf16_avx2(vs + i);
      const __m256 su = _mm256_mul_ps(s, vu);
      const __m256 shift = _mm256_fmadd_ps(s, vh, load8_bf16_avx2(vz + i));
      for (int b = 0; b < hn; ++b) {
        const __m256 p = token_p(w.scores + (h0 + b) * S + i / groups);
        _mm256_storeu_ps(w.weights + (h0 + b) * S * groups + i, _mm256_mul_ps(p, su));
        float* lane = lanes[b] + i % L;
        _mm256_store_ps(lane, _mm256_fmadd_ps(p, shift, _mm256_load_ps(lane)));
      }
    }
    for (; i < n; ++i)  // a last step of fewer than 8 elements
      for (int b = 0; b < hn; ++b) {
        const float p = w.scores[(h0 + b) * S + i / groups];
        const value_token_weight vw =
            fold_value_token(p, static_cast<float>(vs[i]), static_cast<float>(vz[i]), unit, half);
        w.weights[(h0 + b) * S * groups + i] = vw.weight;
        float& sum = lanes[b][i % L];
        sum = value_offset_step(sum, p, vw.shift);
      }
    for (int b = 0; b < hn; ++b)
      for (int grp = 0; grp < groups; ++grp) {
        float lane[attention_reduction_lanes];
        for (int l = 0; l < attention_reduction_lanes; ++l) lane[l] = lanes[b][l * groups + grp];
        w.offsets[(h0 + b) * groups + grp] = reduce_lanes(lane);
      }
  }
}

/// Token t's codes (8 channels, a lane each) from plane_code_lanes_avx2's bytes:
/// r's, or with Two (more than 8 planes) r's << pl | s's (planes 8..8 + pl - 1).
/// Nib: r from plane_code_nibbles_avx2 (4 planes or fewer).
template <bool Two, bool Nib>
LYNX_ATTENTION_AVX2_TARGET inline __m256 value_code_avx2(const __m256i* r, const __m256i* s,
                                                         __m128i pl, int t) {
  if constexpr (Nib) {
    const __m128i shift = _mm_cvtsi32_si128(8 * (t / 8) + 4 * (t % 8 / 4));
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srl_epi32(r[t % 4], shift), _mm256_set1_epi32(0xf)));
  }
  const __m256i byte = _mm256_set1_epi32(0xff);
  const __m128i shift = _mm_cvtsi32_si128(8 * (t / 8));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi32(r[t % 8], shift), byte);
  if constexpr (!Two) {
    return _mm256_cvtepi32_ps(high);
  } else {
    const __m256i low = _mm256_and_si256(_mm256_srl_epi32(s[t % 8], shift), byte);
    return _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_sll_epi32(high, pl), low));
  }
}

/// The value sums of HC (1..4) heads at channels [c0, c0 + 8) over tokens [la, lb)
/// of one block (accumulate_values_portable's operations) from its codes
/// (plane_code_lanes_avx2: r, and s with Two): one fused multiply-add per token in
/// order into the sum of its parity (acc even, odd odd; a block starts at an even
/// token). wt: the weight of head 0, token 0 of the block in c0's group; head h,
/// token t at wt[h * hs + t * groups]; acc and odd: head h at h * D. Full: [la, lb) is the whole
/// block, its 32 tokens unrolled. Nib: r holds nibbles (4 planes or fewer). Not inlined: one
/// copy per (HC, Two, Full, Nib), shared by every plane count.
template <int HC, bool Two, bool Full, bool Nib>
LYNX_ATTENTION_AVX2_TARGET __attribute__((noinline)) void add_value_codes_avx2(
    const __m256i* r, const __m256i* s, int pl, const float* wt, std::int64_t hs, int groups,
    float* acc, float* odd, int D, int la, int lb) {
  const __m128i pls = _mm_cvtsi32_si128(pl);
  __m256 e[HC], o[HC];
  for (int h = 0; h < HC; ++h) {
    e[h] = _mm256_loadu_ps(acc + h * D);
    o[h] = _mm256_loadu_ps(odd + h * D);
  }
  auto add = [&](int t) LYNX_ATTENTION_AVX2_TARGET {
    const __m256 k = value_code_avx2<Two, Nib>(r, s, pls, t);
    for (int h = 0; h < HC; ++h) {
      const __m256 wv = _mm256_broadcast_ss(wt + h * hs + t * groups);
      if (t % 2 == 0)
        e[h] = _mm256_fmadd_ps(wv, k, e[h]);
      else
        o[h] = _mm256_fmadd_ps(wv, k, o[h]);
    }
  };
  if constexpr (Full) {
    [&]<int... T>(std::integer_sequence<int, T...>) LYNX_ATTENTION_AVX2_TARGET { (add(T), ...); }
    (std::make_integer_sequence<int, attention_block_tokens>{});
  } else {
    for (int t = la; t < lb; ++t) add(t);
  }
  for (int h = 0; h < HC; ++h) {
    _mm256_storeu_ps(acc + h * D, e[h]);
    _mm256_storeu_ps(odd + h * D, o[h]);
  }
}

/// accumulate_values_portable of a bit-plane prompt (the same sums in the same
/// order) with the weights of value_weights_avx2; avx2_value_planes(src).
LYNX_ATTENTION_AVX2_TARGET inline void accumulate_values_avx2(const plane_kv_source& src,
                                                              std::int64_t kv_head, int heads,
                                                              std::int64_t t0, std::int64_t t1,
                                                              float* acc, const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const int groups = static_cast<int>(g.value_channel_groups());
  const std::int64_t VG = g.value_group, hs = attention_split_tokens * groups;
  float* odd = w.odd;
  std::fill(acc, acc + heads * D, 0.0f);
  std::fill(odd, odd + heads * D, 0.0f);
  with_compiled_plane_count(src.planes, [&](auto p) LYNX_ATTENTION_AVX2_TARGET {
    constexpr int P = p();
    constexpr bool Two = P > 8;             // codes of more than a byte
    constexpr bool Nib = P <= 4;            // plane_code_nibbles_avx2's codes
    constexpr int pl = std::max(P - 8, 0);  // planes past the high byte
    const std::uint32_t* rows[16];
    for (std::int64_t b = t0 / attention_block_tokens; b * attention_block_tokens < t1; ++b) {
      const std::int64_t tb = b * attention_block_tokens;
      src.prefetch_block(false, kv_head, b + prefetch_blocks);
      src.block_rows(false, kv_head, b, rows);
      const int la = static_cast<int>(std::max(tb, t0) - tb);
      const int lb = static_cast<int>(std::min(tb + attention_block_tokens, t1) - tb);
      // the weights of the block's token 0 (before t0 when the split starts mid-block:
      // only tokens from la on are read)
      const float* wt = w.weights + (tb - t0) * groups;
      const bool full = la == 0 && lb == attention_block_tokens;
      // a chunk's codes: [0, 8) planes 0..7, [8, 16) planes 8..; two chunks' worth,
      // the next chunk decoded before this one's multiply-adds are issued, so that its
      // loads and transposes overlap them (a chunk's FMAs outnumber the reorder window)
      __m256i codes[2][16];
      auto decode = [&](int c0, __m256i* r) LYNX_ATTENTION_AVX2_TARGET {
        if constexpr (Nib) {
          plane_code_nibbles_avx2<P>(rows, c0, r);
        } else {
          plane_code_lanes_avx2<(P < 8 ? P : 8)>(rows, c0, r);
          if constexpr (Two) plane_code_lanes_avx2<P - 8>(rows + 8, c0, r + 8);
        }
      };
      decode(0, codes[0]);
      for (int c0 = 0, k = 0; c0 < D; c0 += 8, k ^= 1) {
        if (c0 + 8 < D) decode(c0 + 8, codes[k ^ 1]);
        const __m256i *r = codes[k], *s = codes[k] + 8;
        for (int h = 0; h < heads; h += 4)
          dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
            auto go = [&]<bool Full>() {
              add_value_codes_avx2<HC, Two, Full, Nib>(r, s, pl, wt + h * hs + c0 / VG, hs, groups,
                                                       acc + h * D + c0, odd + h * D + c0, D, la,
                                                       lb);
            };
            full ? go.template operator()<true>() : go.template operator()<false>();
          });
      }
    }
  });
  for (std::int64_t i = 0; i < heads * D; ++i) acc[i] += odd[i];
  add_value_offsets(w.offsets, heads, D, groups, VG, acc);
}
#endif  // LYNX_ATTENTION_AVX512

}  // namespace lynx::detail
