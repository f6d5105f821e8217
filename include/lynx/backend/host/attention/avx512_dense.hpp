// AVX-512 kernels of dense (bf16 / float) K/V: scores in the fixed lane order of
// dense_score, value sums, and the walk over several kv heads of a token-major
// cache at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lynx/backend/host/attention/avx512_planes.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/dispatch.hpp"
#include "lynx/core/types.hpp"

#if LYNX_ATTENTION_AVX512
// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into target functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail {

/// 16 consecutive channels of a dense row as floats.
template <class T>
LYNX_ATTENTION_AVX512_TARGET inline __m512 load16_avx512(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    static_assert(std::is_same_v<T, bf16>, "AVX-512 dense kernels read float or bf16");
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

/// Fold of 16 lane vectors (one per token) into one vector of 16 scores in token
/// order, each by the halving tree l += l+8, l += l+4, l += l+2, l += l+1.
LYNX_ATTENTION_AVX512_TARGET inline __m512 fold16_avx512(__m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7 of v[2i] + lanes 8-15, then the same of v[2i+1]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // chunks (x0, x2 | y0, y2) + (x1, x3 | y1, y3)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  const __m512 r =
      _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  // lane (chunk k, position i) now holds the token whose index the table gives
  return r;
}

/// Lane permutation that puts fold16_avx512's result in token order, found by
/// folding vectors that each hold their token's index.
LYNX_ATTENTION_AVX512_TARGET inline __m512i fold16_token_order_avx512() {
  __m512 v[16];
  for (int t = 0; t < 16; ++t) v[t] = _mm512_set1_ps(static_cast<float>(t));
  alignas(64) float r[16];
  _mm512_store_ps(r, fold16_avx512(v));  // each lane: 16 * its token
  alignas(64) std::int32_t idx[16];
  for (int l = 0; l < 16; ++l) idx[static_cast<int>(r[l]) / 16] = l;
  return _mm512_load_si512(idx);
}

/// Scores of one head against 16 converted key rows [16][16 NV] (NV = head_dim / 16
/// known at compile time): the query stays in registers and the 16 tokens' chains
/// interleave; each token's 16 lanes accumulate in channel order as in dense_score.
template <int NV>
LYNX_ATTENTION_AVX512_TARGET inline void score_dense_block_avx512(const float* rows,
                                                                  const float* qh, __m512i perm,
                                                                  float* out) {
  __m512 qv[NV];
  for (int k = 0; k < NV; ++k) qv[k] = _mm512_loadu_ps(qh + 16 * k);
  __m512 v[16];
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int k = 0; k < NV; ++k)
      a = _mm512_fmadd_ps(qv[k], _mm512_load_ps(rows + (i * NV + k) * 16), a);
    v[i] = a;
  }
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(perm, fold16_avx512(v)));
}

/// Scores of HC heads against bf16 keys, 16 / HC tokens per step (16 chains, one
/// per (token, head), folded together by fold16_avx512): each key row is widened
/// in registers, 32 channels per load as even and odd halves, and multiplied by
/// the query permuted the same way (qp: [HC][D], pairs of even/odd vectors).
/// Lane l of a chain sums channels 32j + 2l, 32j + 2l + 1 in channel order
/// (dense_score_lane<bf16>). Rows [t, t + 16 / HC) must all exist.
template <int HC>
LYNX_ATTENTION_AVX512_TARGET inline void score_bf16_step_avx512(const dense_kv_source<bf16>& src,
                                                                std::int64_t kv_head,
                                                                std::int64_t t, const float* qp,
                                                                int DP, int D, __m512i perm,
                                                                float* out /*[HC][S] at t*/) {
  constexpr int TOK = 16 / HC;
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 32) {
    const int rest = D - c;
    const __mmask32 live = rest >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu)
                                      : static_cast<__mmask32>((1u << rest) - 1u);
    for (int i = 0; i < TOK; ++i) {
      const bf16* row = &src.keys(t + i, kv_head, c);
      const __m512i x = rest >= 32 ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi16(live, row);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 odd = _mm512_castsi512_ps(
          _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      for (int h = 0; h < HC; ++h) {
        a[i * HC + h] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + h * DP + c), even, a[i * HC + h]);
        a[i * HC + h] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + h * DP + c + 16), odd, a[i * HC + h]);
      }
    }
  }
  alignas(64) float r[16];
  _mm512_store_ps(r, _mm512_permutexvar_ps(perm, fold16_avx512(a)));  // r[i * HC + h]
  for (int i = 0; i < TOK; ++i)
    for (int h = 0; h < HC; ++h) out[h * attention_split_tokens + i] = r[i * HC + h];
}

/// The query of each head with its channels in the order score_bf16_step_avx512
/// multiplies them: per 32 channels, the 16 even then the 16 odd ones, zeros
/// past D. qp: [heads][DP], DP = D rounded up to 32.
inline void permute_query_bf16(const float* q, int heads, int D, int DP, float* qp) {
  for (int h = 0; h < heads; ++h)
    for (int c = 0; c < DP; c += 32)
      for (int l = 0; l < 16; ++l) {
        qp[h * DP + c + l] = c + 2 * l < D ? q[h * D + c + 2 * l] : 0.0f;
        qp[h * DP + c + 16 + l] = c + 2 * l + 1 < D ? q[h * D + c + 2 * l + 1] : 0.0f;
      }
}

/// Asks L2 for key rows [t, t + n) of one kv head (written out, not prefetch_lines:
/// that form measured 8% slower on the bf16 baseline at 32K tokens, same prefetches).
__attribute__((always_inline)) inline void prefetch_key_rows_bf16(const dense_kv_source<bf16>& src,
                                                                  std::int64_t kv_head,
                                                                  std::int64_t t, int n, int D) {
  for (int i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(&src.keys(t + i, kv_head, 0));
    for (std::size_t off = 0; off < D * sizeof(bf16); off += 64)
      __builtin_prefetch(row + off, 0, 2);
  }
}

/// score_bf16_step_avx512 for hc = 4, 2 or 1 heads (16 / hc tokens).
LYNX_ATTENTION_AVX512_TARGET inline void score_bf16_step_hc_avx512(
    int hc, const dense_kv_source<bf16>& src, std::int64_t kv_head, std::int64_t t, const float* qp,
    int DP, int D, __m512i perm, float* out) {
  if (hc == 4)
    score_bf16_step_avx512<4>(src, kv_head, t, qp, DP, D, perm, out);
  else if (hc == 2)
    score_bf16_step_avx512<2>(src, kv_head, t, qp, DP, D, perm, out);
  else
    score_bf16_step_avx512<1>(src, kv_head, t, qp, DP, D, perm, out);
}

/// Dense bf16 scores of tokens [t0, t1): score_bf16_step_avx512 for whole steps,
/// dense_score for the last few tokens. The permuted queries live in the value
/// weight scratch (a dense source has no value weights; it holds heads x S floats).
LYNX_ATTENTION_AVX512_TARGET inline void score_tokens_bf16_avx512(const dense_kv_source<bf16>& src,
                                                                  std::int64_t kv_head,
                                                                  const float* q, int heads,
                                                                  std::int64_t t0, std::int64_t t1,
                                                                  const split_scratch& w) {
  const int D = src.head_dim();
  const int DP = (D + 31) / 32 * 32;
  static const __m512i perm = fold16_token_order_avx512();
  float* qp = w.weights;
  permute_query_bf16(q, heads, D, DP, qp);
  int h0 = 0;
  while (h0 < heads) {
    const int hc = heads - h0 >= 4 ? 4 : heads - h0 >= 2 ? 2 : 1;
    const int tok = 16 / hc;
    std::int64_t t = t0;
    for (; t + tok <= t1; t += tok) {
      if (h0 == 0 && t + dense_prefetch_rows + tok <= t1)
        prefetch_key_rows_bf16(src, kv_head, t + dense_prefetch_rows, tok, D);
      score_bf16_step_hc_avx512(hc, src, kv_head, t, qp + h0 * DP, DP, D, perm,
                                w.scores + h0 * attention_split_tokens + (t - t0));
    }
    for (; t < t1; ++t)
      for (int h = h0; h < h0 + hc; ++h)
        w.scores[h * attention_split_tokens + (t - t0)] =
            dense_score(q + h * D, &src.keys(t, kv_head, 0), 1, D);
    h0 += hc;
  }
}

template <class T>
LYNX_ATTENTION_AVX512_TARGET void score_tokens_avx512(const dense_kv_source<T>& src,
                                                      std::int64_t kv_head, const float* q,
                                                      int heads, std::int64_t t0, std::int64_t t1,
                                                      const split_scratch& w) {
  if constexpr (std::is_same_v<T, bf16>) {  // avx512_supports: head_dim <= S
    score_tokens_bf16_avx512(src, kv_head, q, heads, t0, t1, w);
    return;
  }
  const int D = src.head_dim();
  static const __m512i perm = fold16_token_order_avx512();
  std::int64_t t = t0;
  float* rows = w.tile;  // [16][D] floats: the block's keys, converted once for all heads
  for (; t + 16 <= t1; t += 16) {
    for (int i = 0; i < 16; ++i) {
      const T* k = &src.keys(t + i, kv_head, 0);
      if (i + 32 < t1 - t)  // rows are kv_heads * head_dim apart: the row 32 tokens ahead
        prefetch_lines<3>(&src.keys(t + i + 32, kv_head, 0), D * sizeof(T));
      for (int c = 0; c < D; c += 16) _mm512_store_ps(rows + i * D + c, load16_avx512(k + c));
    }
    for (int h = 0; h < heads; ++h) {
      float* out = w.scores + h * attention_split_tokens + (t - t0);
      switch (D) {
        case 16:
          score_dense_block_avx512<1>(rows, q + h * D, perm, out);
          continue;
        case 32:
          score_dense_block_avx512<2>(rows, q + h * D, perm, out);
          continue;
        case 64:
          score_dense_block_avx512<4>(rows, q + h * D, perm, out);
          continue;
        case 128:
          score_dense_block_avx512<8>(rows, q + h * D, perm, out);
          continue;
        default:
          break;
      }
      __m512 v[16];
      const float* qh = q + h * D;
      for (int i = 0; i < 16; ++i) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 16)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c), _mm512_load_ps(rows + i * D + c), a);
        v[i] = a;
      }
      _mm512_storeu_ps(w.scores + h * attention_split_tokens + (t - t0),
                       _mm512_permutexvar_ps(perm, fold16_avx512(v)));
    }
  }
  for (; t < t1; ++t)
    for (int h = 0; h < heads; ++h)
      w.scores[h * attention_split_tokens + (t - t0)] =
          dense_score(q + h * D, &src.keys(t, kv_head, 0), 1, D);
}

template <int HC, int NV, class T>
LYNX_ATTENTION_AVX512_TARGET void accumulate_dense_chunk_avx512(const dense_kv_source<T>& src,
                                                                std::int64_t kv_head,
                                                                std::int64_t t0, std::int64_t t1,
                                                                int c0, const float* p /*[HC][S]*/,
                                                                float* acc, int D) {
  __m512 a[HC][NV];
  for (int h = 0; h < HC; ++h)
    for (int k = 0; k < NV; ++k) a[h][k] = _mm512_setzero_ps();
  for (std::int64_t t = t0; t < t1; ++t) {
    const T* row = &src.values(t, kv_head, c0);
    if (t + dense_prefetch_rows < t1)
      prefetch_lines<2>(&src.values(t + dense_prefetch_rows, kv_head, c0), 16 * NV * sizeof(T));
    __m512 v[NV];
    if constexpr (std::is_same_v<T, bf16> && NV % 2 == 0) {
      // 32 bf16 per load: the even channels are the low halves shifted up, the
      // odd ones the high halves masked (v[2j]: channels 32j + 2l, v[2j+1]: 32j + 2l + 1)
      for (int j = 0; j < NV / 2; ++j) {
        const __m512i x = _mm512_loadu_si512(row + 32 * j);
        v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        v[2 * j + 1] = _mm512_castsi512_ps(
            _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      }
    } else {
      for (int k = 0; k < NV; ++k) v[k] = load16_avx512(row + 16 * k);
    }
    for (int h = 0; h < HC; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * attention_split_tokens + (t - t0)]);
      for (int k = 0; k < NV; ++k) a[h][k] = _mm512_fmadd_ps(ph, v[k], a[h][k]);
    }
  }
  for (int h = 0; h < HC; ++h) {
    if constexpr (std::is_same_v<T, bf16> && NV % 2 == 0) {
      for (int j = 0; j < NV / 2; ++j) {  // back to channel order
        alignas(64) float e[16], o[16];
        _mm512_store_ps(e, a[h][2 * j]);
        _mm512_store_ps(o, a[h][2 * j + 1]);
        float* out = acc + h * D + c0 + 32 * j;
        for (int l = 0; l < 16; ++l) {
          out[2 * l] = e[l];
          out[2 * l + 1] = o[l];
        }
      }
    } else {
      for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + h * D + c0 + 16 * k, a[h][k]);
    }
  }
}

template <int NV, class T>
LYNX_ATTENTION_AVX512_TARGET void accumulate_dense_avx512(const dense_kv_source<T>& src,
                                                          std::int64_t kv_head, int heads,
                                                          std::int64_t t0, std::int64_t t1,
                                                          float* acc, const split_scratch& w,
                                                          int D) {
  for (int h = 0; h < heads; h += 4) {
    const float* p = w.scores + h * attention_split_tokens;
    for (int c0 = 0; c0 < D; c0 += 16 * NV) {
      dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
        accumulate_dense_chunk_avx512<HC, NV>(src, kv_head, t0, t1, c0, p, acc + h * D, D);
      });
    }
  }
}

/// Dense values, lane = channel, token order: 4 heads x 64 channels of accumulators.
template <class T>
LYNX_ATTENTION_AVX512_TARGET void accumulate_values_avx512(const dense_kv_source<T>& src,
                                                           std::int64_t kv_head, int heads,
                                                           std::int64_t t0, std::int64_t t1,
                                                           float* acc, const split_scratch& w) {
  const int D = src.head_dim();
  if (D % 64 == 0)
    accumulate_dense_avx512<4>(src, kv_head, heads, t0, t1, acc, w, D);
  else if (D % 32 == 0)
    accumulate_dense_avx512<2>(src, kv_head, heads, t0, t1, acc, w, D);
  else
    accumulate_dense_avx512<1>(src, kv_head, heads, t0, t1, acc, w, D);
}

/// Scores of kv heads [g0, g0 + gn) over tokens [t0, t1): the steps and bits of
/// score_tokens_bf16_avx512 for each kv head, but each step of tokens reads the rows
/// of all gn kv heads, so a token-major cache is read front to back
/// (dense_heads_together). Scores of kv head g0 + j: w.scores + j * heads * S; its
/// permuted queries: w.weights + j * heads * DP. heads: 1, 2 or a multiple of 4.
LYNX_ATTENTION_AVX512_TARGET inline void score_heads_bf16_avx512(
    const dense_kv_source<bf16>& src, std::int64_t g0, int gn, const float* q /*[gn][heads][D]*/,
    int heads, std::int64_t t0, std::int64_t t1, const split_scratch& w) {
  constexpr std::int64_t S = attention_split_tokens;
  const int D = src.head_dim();
  const int DP = (D + 31) / 32 * 32;
  static const __m512i perm = fold16_token_order_avx512();
  for (int j = 0; j < gn; ++j)
    permute_query_bf16(q + j * heads * D, heads, D, DP, w.weights + j * heads * DP);
  const int hc = heads >= 4 ? 4 : heads;
  const int tok = 16 / hc;
  std::int64_t t = t0;
  for (; t + tok <= t1; t += tok) {
    const bool ahead = t + dense_prefetch_rows + tok <= t1;
    for (int j = 0; j < gn; ++j) {
      if (ahead) prefetch_key_rows_bf16(src, g0 + j, t + dense_prefetch_rows, tok, D);
      for (int h0 = 0; h0 < heads; h0 += hc)
        score_bf16_step_hc_avx512(hc, src, g0 + j, t, w.weights + (j * heads + h0) * DP, DP, D,
                                  perm, w.scores + (j * heads + h0) * S + (t - t0));
    }
  }
  for (; t < t1; ++t)
    for (int j = 0; j < gn; ++j)
      for (int h = 0; h < heads; ++h)
        w.scores[(j * heads + h) * S + (t - t0)] =
            dense_score(q + (j * heads + h) * D, &src.keys(t, g0 + j, 0), 1, D);
}

}  // namespace lynx::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // LYNX_ATTENTION_AVX512
