// The walk of one split of decode attention for one query and one kv head:
// which kernels take a source (avx512_supports, avx2_supports), the softmax of a
// split, and compute_split's dispatch to the portable, FMA-clone, AVX2 or
// AVX-512 walk (host_walk).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "lynx/backend/host/attention/avx2.hpp"
#include "lynx/backend/host/attention/portable.hpp"
#include "lynx/backend/host/attention/scratch.hpp"
#include "lynx/backend/host/attention/sources.hpp"
#include "lynx/backend/host/attention/target.hpp"
#include "lynx/backend/host/attention/tile_math.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"

namespace lynx::detail {

/// Whether the AVX-512 kernels handle this source (else the portable ones do).
inline bool avx512_supports(const plane_kv_source& src) {
  // one key group per 32-token block; any head_dim and value group
  return src.view.geometry.key_group % attention_block_tokens == 0;
}
template <class View>
bool avx512_supports(const code_kv_source<View>& src) {
  return src.view.geometry.key_group % attention_block_tokens == 0;  // one key group per block
}
template <class T>
bool avx512_supports(const dense_kv_source<T>& src) {
  if constexpr (std::is_same_v<T, fp16>) return false;  // fp16 rows: the portable loops
  // bf16 keys: the permuted queries of score_tokens_bf16_avx512 must fit its scratch
  return src.head_dim() % 16 == 0 && src.keys.channel_stride == 1 &&
         src.values.channel_stride == 1 &&
         (!std::is_same_v<T, bf16> || src.head_dim() <= attention_split_tokens);
}

/// Which loops a split is walked with: the portable ones as built, the portable ones
/// compiled for AVX2 + FMA, the AVX2 kernels, the AVX-512 kernels (same bits).
enum class host_walk : std::uint8_t { baseline, fma, avx2, avx512 };

/// Softmax of one head's scores over one split, in place: s becomes p =
/// exp2(s * log2(e) - m) (0 before first_visible), m its maximum and l = sum(p)
/// in fixed order; all masked: m = -inf, l = 0, p = 0.
template <class Variant>
void softmax_split(float* s, std::int64_t n, std::int64_t t0, std::int64_t first_visible,
                   const Variant& variant, host_walk walk, float& m, float& l) {
  (void)walk;
  if constexpr (Variant::has_logit_transform)
    for (std::int64_t i = 0; i < n; ++i) s[i] = variant.transform_logit(s[i]);
  float mx = attention_neg_inf;
  bool bad = false;
#if LYNX_ATTENTION_AVX512
  if (walk == host_walk::avx512) {
    mx = prepare_scores_avx512(s, n, t0, first_visible, bad);
  } else if (walk == host_walk::avx2) {
    mx = prepare_scores_avx2(s, n, t0, first_visible, bad);
  } else
#endif
  {
    for (std::int64_t i = 0; i < n; ++i) {
      const bool masked = (t0 + i) < first_visible;
      const float x = masked ? attention_neg_inf : s[i] * attention_log2e;
      s[i] = x;
      mx = x > mx ? x : mx;
      bad |= !masked && !is_finite_value(x);
    }
  }
  if (bad) [[unlikely]] {
    // a logit that is not finite: the max and exp2 would drop it silently; a NaN
    // sum makes the output NaN, which decode_attention reports with its cause
    m = mx > attention_neg_inf ? mx : 0.0f;
    l = std::numeric_limits<float>::quiet_NaN();
    std::fill(s, s + n, 0.0f);
    return;
  }
  m = mx;
  if (!(mx > attention_neg_inf)) {
    // nothing visible for this head (all masked): an empty state, p = 0
    std::fill(s, s + n, 0.0f);
    l = 0.0f;
    return;
  }
#if LYNX_ATTENTION_AVX512
  if (walk == host_walk::avx512) {
    l = exp2_shifted_sum_avx512(s, n, mx);
    return;
  }
  if (walk == host_walk::avx2) {
    l = exp2_shifted_sum_avx2(s, n, mx);
    return;
  }
#endif
  exp2_shifted_portable(s, n, mx);
  l = fixed_order_sum(s, n);
}

/// The portable walk's value side of one split: the value weights (plane and code
/// sources) and the sums of the weighted values into acc.
template <class Source>
void values_portable(const Source& src, std::int64_t kv_head, int heads, std::int64_t t0,
                     std::int64_t t1, float* acc, const split_scratch& w) {
  if constexpr (requires { src.view; }) value_weights_portable(src, kv_head, heads, t0, t1, w);
  accumulate_values_portable(src, kv_head, heads, t0, t1, acc, w);
}

// The portable loops as built, each compiled once per source (not per variant, and
// not again inside every walk that falls back to them): everything they call
// inlined into a function that GCC compiles without contracting a * b + c, as a
// build for a target with FMA (-march=native) would otherwise fuse what the loops
// round twice. The walks below call them and inline only the softmax.
template <class Source>
LYNX_ATTENTION_UNFUSED LYNX_NOINLINE void score_tokens_unfused(const Source& src,
                                                               std::int64_t kv_head, const float* q,
                                                               int heads, std::int64_t t0,
                                                               std::int64_t t1,
                                                               const split_scratch& w) {
  score_tokens_portable(src, kv_head, q, heads, t0, t1, w);
}

template <class Source>
LYNX_ATTENTION_UNFUSED LYNX_NOINLINE void values_unfused(const Source& src, std::int64_t kv_head,
                                                         int heads, std::int64_t t0,
                                                         std::int64_t t1, float* acc,
                                                         const split_scratch& w) {
  values_portable(src, kv_head, heads, t0, t1, acc, w);
}

#if LYNX_ATTENTION_AVX512
// The same loops compiled for AVX2 + FMA (host_has_fma): the same operations in the
// same order, so the same bits. The AVX2 walk falls back to these.
template <class Source>
LYNX_ATTENTION_FMA_CLONE __attribute__((noinline)) void score_tokens_portable_fma(
    const Source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, const split_scratch& w) {
  score_tokens_portable(src, kv_head, q, heads, t0, t1, w);
}

template <class Source>
LYNX_ATTENTION_FMA_CLONE __attribute__((noinline)) void values_portable_fma(
    const Source& src, std::int64_t kv_head, int heads, std::int64_t t0, std::int64_t t1,
    float* acc, const split_scratch& w) {
  values_portable(src, kv_head, heads, t0, t1, acc, w);
}
#endif

/// One split of one source for one query and one kv head: partial states of
/// `heads` query heads over tokens [t0, t1) with tokens before `first_visible` masked.
/// q: [heads][D], already multiplied by the softmax scale. m, l: [heads]; acc: [heads][D].
/// next: the split this worker walks after this one (for prefetches; never changes a result).
/// compute_split's portable walk (plain loops, the reference order), as built.
template <class Source, class Variant>
LYNX_ATTENTION_UNFUSED void compute_split_portable_unfused(
    const Source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, std::int64_t first_visible, const Variant& variant, const split_scratch& w,
    float* m, float* l, float* acc) {
  score_tokens_unfused(src, kv_head, q, heads, t0, t1, w);
  for (int h = 0; h < heads; ++h)
    softmax_split(w.scores + h * attention_split_tokens, t1 - t0, t0, first_visible, variant,
                  host_walk::baseline, m[h], l[h]);
  values_unfused(src, kv_head, heads, t0, t1, acc, w);
}

#if LYNX_ATTENTION_AVX512
/// The same walk compiled for AVX2 + FMA (host_has_fma).
template <class Source, class Variant>
LYNX_ATTENTION_FMA_CLONE void compute_split_portable_fma(
    const Source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, std::int64_t first_visible, const Variant& variant, const split_scratch& w,
    float* m, float* l, float* acc) {
  score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  for (int h = 0; h < heads; ++h)
    softmax_split(w.scores + h * attention_split_tokens, t1 - t0, t0, first_visible, variant,
                  host_walk::baseline, m[h], l[h]);
  values_portable_fma(src, kv_head, heads, t0, t1, acc, w);
}
#endif

#if LYNX_ATTENTION_AVX512
/// Whether the AVX2 dense kernels take this source: contiguous rows, head_dim a
/// multiple of 32 (bf16: the score lanes pair channels within 32) or of 16 (float);
/// bf16: the permuted queries must fit the value weight scratch (score_tokens_avx2).
template <class T>
bool avx2_supports(const dense_kv_source<T>& src) {
  if constexpr (std::is_same_v<T, fp16>) return false;  // fp16 rows: the portable loops
  return src.head_dim() % (std::is_same_v<T, bf16> ? 32 : 16) == 0 &&
         src.keys.channel_stride == 1 && src.values.channel_stride == 1 &&
         (!std::is_same_v<T, bf16> || src.head_dim() <= attention_split_tokens);
}

/// The AVX2 walk: the AVX2 kernels where they take the source, the portable loops
/// (compiled for AVX2 + FMA, everything inlined, no contraction) for the rest.
template <class Source, class Variant>
LYNX_ATTENTION_FMA_CLONE void compute_split_avx2(const Source& src, std::int64_t kv_head,
                                                 const float* q, int heads, std::int64_t t0,
                                                 std::int64_t t1, std::int64_t first_visible,
                                                 const Variant& variant, const split_scratch& w,
                                                 float* m, float* l, float* acc,
                                                 const next_split& next) {
  bool dense = false;  // a dense source the AVX2 kernels take
  if constexpr (requires { src.keys; }) {
    dense = avx2_supports(src);
    if (dense)
      score_tokens_avx2(src, kv_head, q, heads, t0, t1, w);
    else
      score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  } else if constexpr (requires { src.prefetch_block(true, 0, 0); }) {  // bit planes
    if (plane_count_compiled(src.planes))  // else the portable loops (the same bits)
      score_tokens_avx2(src, kv_head, q, heads, t0, t1, w, next);
    else
      score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  } else {  // merged codes
    score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  }
  for (int h = 0; h < heads; ++h)
    softmax_split(w.scores + h * attention_split_tokens, t1 - t0, t0, first_visible, variant,
                  host_walk::avx2, m[h], l[h]);
  if constexpr (requires { src.keys; }) {
    if (dense) {
      accumulate_values_avx2(src, kv_head, heads, t0, t1, acc, w);
      return;
    }
  } else if constexpr (requires { src.prefetch_block(true, 0, 0); }) {
    if (avx2_value_planes(src)) {
      value_weights_avx2(src, kv_head, heads, t0, t1, w);
      accumulate_values_avx2(src, kv_head, heads, t0, t1, acc, w);
      return;
    }
  }
  values_portable_fma(src, kv_head, heads, t0, t1, acc, w);
}
#endif

/// One split walked as `walk` says (the AVX-512 kernels fall back to nothing:
/// the caller picks host_walk::avx512 only where avx512_supports).
template <class Source, class Variant>
void compute_split_kernels(const Source& src, std::int64_t kv_head, const float* q, int heads,
                           std::int64_t t0, std::int64_t t1, std::int64_t first_visible,
                           const Variant& variant, host_walk walk, const split_scratch& w, float* m,
                           float* l, float* acc, const next_split& next = {}) {
  (void)next;
#if LYNX_ATTENTION_AVX512
  if (walk == host_walk::avx512) {
    const std::int64_t n = t1 - t0;
    if constexpr (requires { src.view; })
      score_tokens_avx512(src, kv_head, q, heads, t0, t1, w, next);
    else
      score_tokens_avx512(src, kv_head, q, heads, t0, t1, w);
    for (int h = 0; h < heads; ++h)
      softmax_split(w.scores + h * attention_split_tokens, n, t0, first_visible, variant,
                    host_walk::avx512, m[h], l[h]);
    if constexpr (requires { src.view; }) {
      // the GFNI value kernels compute their weights pass by pass
      if (!gfni_values(src)) value_weights_avx512(src, kv_head, heads, t0, t1, w);
      accumulate_values_avx512(src, kv_head, heads, t0, t1, acc, w, next);
    } else {
      accumulate_values_avx512(src, kv_head, heads, t0, t1, acc, w);
    }
    return;
  }
  if (walk == host_walk::avx2) {
    compute_split_avx2(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l, acc, next);
    return;
  }
  if (walk == host_walk::fma) {
    compute_split_portable_fma(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l,
                               acc);
    return;
  }
#else
  (void)walk;
#endif
  compute_split_portable_unfused(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l,
                                 acc);
}

/// fp16 rows (a tail): the AVX-512 and AVX2 dense kernels read float and bf16, so
/// the portable loops read them, as the floats they widen to and in the order every
/// walk sums float rows: the bits of a float tail holding the widened values.
template <class Source>
inline constexpr bool fp16_rows = false;
template <>
inline constexpr bool fp16_rows<dense_kv_source<fp16>> = true;

template <class Source, class Variant>
void compute_split(const Source& src, std::int64_t kv_head, const float* q, int heads,
                   std::int64_t t0, std::int64_t t1, std::int64_t first_visible,
                   const Variant& variant, host_walk walk, const split_scratch& w, float* m,
                   float* l, float* acc, const next_split& next = {}) {
  if constexpr (fp16_rows<Source>) {
#if LYNX_ATTENTION_AVX512
    if (walk != host_walk::baseline) {
      compute_split_portable_fma(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l,
                                 acc);
      return;
    }
#endif
    (void)walk;
    (void)next;
    compute_split_portable_unfused(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l,
                                   acc);
  } else {
    compute_split_kernels(src, kv_head, q, heads, t0, t1, first_visible, variant, walk, w, m, l,
                          acc, next);
  }
}

/// Whether a dense prompt's splits are walked for several kv heads at once
/// (compute_split_heads): bf16 on the AVX-512 path, the kv heads of a token side by
/// side in one row (token-major), and a group of 1, 2 or a multiple of 4 query
/// heads. Walked one kv head at a time, such a cache is read in 256-byte pieces a
/// row apart, which the hardware prefetchers do not follow: on AMD Zen 4 (one
/// thread, 32K tokens, min of alternating rounds) the bf16 baseline took 11.2-11.4
/// ms that way, 7.7 ms on a head-major copy of the same cache, and 8.7 ms with the
/// keys of all kv heads walked together (4K tokens: 0.97 -> 0.83 ms).
inline bool dense_heads_together(const kv_view<const bf16, host_space>& k,
                                 const kv_view<const bf16, host_space>& v, int heads) {
  auto together = [](const kv_view<const bf16, host_space>& x) {
    return x.shape.kv_heads > 1 && x.channel_stride == 1 && x.head_stride == x.shape.head_dim &&
           x.token_stride >= x.shape.kv_heads * x.shape.head_dim;
  };
  return together(k) && together(v) && (heads <= 2 || heads % 4 == 0);
}

#if LYNX_ATTENTION_AVX512
/// compute_split for kv heads [g0, g0 + gn) of a dense bf16 prompt on the AVX-512
/// path (dense_heads_together): the same scores, softmax and value sums per kv head,
/// so the same bits, with the rows of all gn kv heads read together. q:
/// [gn][heads][D]; the state (m, l, acc) of kv head g0 + j at state0 + j * state_stride.
template <class Variant>
void compute_split_heads(const dense_kv_source<bf16>& src, std::int64_t g0, int gn, const float* q,
                         int heads, std::int64_t t0, std::int64_t t1, std::int64_t first_visible,
                         const Variant& variant, const split_scratch& w, float* state0,
                         std::int64_t state_stride) {
  const std::int64_t n = t1 - t0;
  score_heads_bf16_avx512(src, g0, gn, q, heads, t0, t1, w);
  for (int j = 0; j < gn; ++j) {
    float* state = state0 + j * state_stride;
    for (int h = 0; h < heads; ++h)
      softmax_split(w.scores + (j * heads + h) * attention_split_tokens, n, t0, first_visible,
                    variant, host_walk::avx512, state[h], state[heads + h]);
  }
  // values one kv head at a time: walked together like the keys, they measured
  // slower (32-token blocks of every kv head in turn, sums kept in memory between
  // blocks: 9.8 ms against 8.4 ms at 32K tokens, one thread, AMD Zen 4)
  for (int j = 0; j < gn; ++j) {
    split_scratch wj = w;
    wj.scores = w.scores + j * heads * attention_split_tokens;
    accumulate_values_avx512(src, g0 + j, heads, t0, t1, state0 + j * state_stride + 2 * heads, wj);
  }
}
#endif

}  // namespace lynx::detail
