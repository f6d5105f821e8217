// Per-tile math of decode attention, shared by every backend (host SIMD,
// host portable, CUDA): the fixed split of a context, the exp2 both backends
// evaluate, the folding of a query into a key group (a key's score is then
// bias + sum_c qs[c] * float(k_c): the channel sum starts at 0 and runs in
// channel order, one fused multiply-add per channel, and the bias is added
// last), the weights of one value token, and the online-softmax merge of two
// partial states.
//
// Scores live in the log2 domain: s2 = logit * log2(e), p = exp2(s2 - m).
// A partial state over a set of tokens is (m, l, acc[D]) with
//   m = max s2, l = sum_t exp2(s2_t - m), acc[c] = sum_t exp2(s2_t - m) * v[t][c].
// The order of every sum is fixed by token position and channel index, never
// by how many queries, threads or blocks a launch uses: this is what makes a
// query's output bits independent of the batch it is computed in.
#pragma once

#include <cstdint>

#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"
#include "lynx/planes/bitplane.hpp"
#include "lynx/quant/quantizer.hpp"

namespace lynx {

/// Tokens per split of a context. A context (prompt, then tail) is cut into
/// splits at multiples of this many tokens of each part; each split gives one
/// partial state, and partial states are merged left to right.
inline constexpr std::int64_t attention_split_tokens = 1024;
/// Tokens of one plane word; the key/value tile of the bit-plane kernels.
inline constexpr int attention_block_tokens = 32;
/// Lanes of the fixed reduction of sums over tokens (l) and over channels
/// (dense scores): partial sums by index mod 16, then a halving tree.
inline constexpr int attention_reduction_lanes = 16;

inline constexpr float attention_log2e = 1.44269504088896340736f;
inline constexpr float attention_ln2 = 0.693147180559945309417f;
inline constexpr float attention_neg_inf = -__builtin_huge_valf();

/// 2^x for x <= 0 (x = -inf or below -126 gives 0), to about 1 ulp:
///   n = round(x), f = x - n in [-0.5, 0.5], 2^f by a degree-7 Taylor polynomial
///   in Horner form with fused multiply-adds, 2^n by building the exponent.
/// The host SIMD kernels evaluate exactly these operations lane by lane, so
/// every backend gets the same bits.
/// Written without a branch: an input that gives 0 is replaced by +0 and its
/// result masked to +0 at the end, by AND on the bits. A select (?:) would do the
/// same, but GCC turns it into a jump around the trapping float-to-int conversion
/// and then, under the default -ftrapping-math, vectorizes no loop of it.
LYNX_HOST_DEVICE float attention_exp2(float x) {
  const std::uint32_t keep = 0u - static_cast<std::uint32_t>(x > -126.0f);  // 0: NaN, -inf too
  x = detail::bits_float(detail::float_bits(x) & keep);
  constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x + round_magic) - round_magic;
  const float f = x - n;
  float p = 1.5252733804059840e-05f;  // ln2^7 / 7!
  p = detail::fused_multiply_add(p, f, 1.5403530393381609e-04f);
  p = detail::fused_multiply_add(p, f, 1.3333558146428443e-03f);
  p = detail::fused_multiply_add(p, f, 9.6181291076284772e-03f);
  p = detail::fused_multiply_add(p, f, 5.5504108664821580e-02f);
  p = detail::fused_multiply_add(p, f, 2.4022650695910071e-01f);
  p = detail::fused_multiply_add(p, f, 6.9314718055994531e-01f);
  p = detail::fused_multiply_add(p, f, 1.0f);
  const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
  return detail::bits_float(detail::float_bits(p * detail::bits_float(bits)) & keep);
}

/// The halving tree that ends every fixed-order sum: lane l += lane l + 8, then
/// l + 4, l + 2, l + 1 (lane[] is overwritten); returns the total.
LYNX_HOST_DEVICE float reduce_lanes(float* lane) {
  for (int w = attention_reduction_lanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

/// Folds a (scaled) query into one key group of a bit-plane tile, so that the
/// score against a token with prefix codes k_c (P planes of B) is
///   bias + sum_c qs[c] * float(k_c)
/// which equals sum_c q[c] * reconstruct(k_c) up to rounding:
///   reconstruct(k_c) = scale_c * (k_c * 2^(B-P) + half) + zero_c
///   qs[c] = q[c] * (scale_c * 2^(B-P)),  bias = sum_c q[c] * (scale_c * half + zero_c)
/// bias is summed like a dense score: lane c mod 16 by fused multiply-adds in
/// channel order, then the halving tree (so SIMD backends evaluate it 16 wide).
/// Param: float or bf16 (the parameters as they travel; the same values).
template <class Param>
LYNX_HOST_DEVICE float fold_query_into_key_group(const float* q, const Param* scale,
                                                 const Param* zero, int head_dim, float level_unit,
                                                 float half, float* LYNX_RESTRICT qs) {
  constexpr int N = attention_reduction_lanes;
  float lane[N] = {};
  const auto fold = [&](int c, int l) {  // channel c into lane l = c mod 16
    const float sc = static_cast<float>(scale[c]), z = static_cast<float>(zero[c]);
    qs[c] = q[c] * (sc * level_unit);
    lane[l] = detail::fused_multiply_add(q[c], detail::fused_multiply_add(sc, half, z), lane[l]);
  };
  int c = 0;
  for (; c + N <= head_dim; c += N)  // whole steps of the 16 lanes (a compiler vectorizes them)
    for (int l = 0; l < N; ++l) fold(c + l, l);
  for (; c < head_dim; ++c) fold(c, c % N);
  return reduce_lanes(lane);
}

/// Weights of one value token of one channel group: the output gains
///   p * reconstruct(v_c) = weight * float(v_c) + p * shift
/// weight = p * scale * 2^(B-P), shift = scale * half + zero. The p * shift terms
/// of a group are summed as a fixed-order sum of fused multiply-adds
/// (value_offset_step), so no compiler can contract them differently.
struct value_token_weight {
  float weight;
  float shift;
};
LYNX_HOST_DEVICE value_token_weight fold_value_token(float p, float scale, float zero,
                                                     float level_unit, float half) {
  return {p * (scale * level_unit), detail::fused_multiply_add(scale, half, zero)};
}
/// One term of a value group's offset sum: sum + p * shift, rounded once.
LYNX_HOST_DEVICE float value_offset_step(float sum, float p, float shift) {
  return detail::fused_multiply_add(p, shift, sum);
}

/// Sum of x[0..n) in the fixed order of every backend: lane l accumulates
/// x[l], x[l+16], ... in index order; then lanes fold as l += l+8, l += l+4,
/// l += l+2, l += l+1.
LYNX_HOST_DEVICE float fixed_order_sum(const float* x, std::int64_t n) {
  float lane[attention_reduction_lanes] = {};
  for (std::int64_t i = 0; i < n; ++i) lane[i % attention_reduction_lanes] += x[i];
  return reduce_lanes(lane);
}

/// Merges partial state b into a (both over disjoint token sets; a first in
/// context order). An empty state has m = -inf.
LYNX_HOST_DEVICE void merge_partial_state(float& m_a, float& l_a, float* acc_a, float m_b,
                                          float l_b, const float* acc_b, int head_dim) {
  if (!(m_b > attention_neg_inf)) return;
  if (!(m_a > attention_neg_inf)) {
    m_a = m_b;
    l_a = l_b;
    for (int c = 0; c < head_dim; ++c) acc_a[c] = acc_b[c];
    return;
  }
  const float m = m_a > m_b ? m_a : m_b;
  const float wa = attention_exp2(m_a - m), wb = attention_exp2(m_b - m);
  l_a = detail::fused_multiply_add(l_b, wb, l_a * wa);
  for (int c = 0; c < head_dim; ++c)
    acc_a[c] = detail::fused_multiply_add(acc_b[c], wb, acc_a[c] * wa);
  m_a = m;
}

}  // namespace lynx
