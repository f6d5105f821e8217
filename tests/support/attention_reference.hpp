// The fp64 attention reference the host and CUDA attention tests share: dense
// float K/V (prompt, then a float or bf16 tail), every query's visible tokens,
// optional sliding window and logit soft-cap, and the error bound of the fp32
// kernels (u = 2^-24):
//   score error   |ds| <= (D + 4) u sum_c |q_c k_c| * scale  (fold and fp32 channel sums)
//   weights       relative error <= 2 |ds| + 8 u             (exp2 polynomial, rescales, merges)
//   value sums    (split tokens + D + 16 + 8 * splits) u * max|v|
// so |out - ref| <= 2 max|v| (4 max|ds| + (1024 + D + 16 + 8 * splits) u), the factor 2 for
// slack. `splits` counts the partial states a kernel merges: ceil(total / split_tokens) + extra.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lynx/attention/decode_attention.hpp"
#include "lynx/core/types.hpp"

namespace lynx::test {

struct attention_reference_result {
  std::vector<double> out, lse;  // [n][qh][D], [n][qh]
  std::vector<double> tol;       // per (query, head)
};

/// How a kernel splits a context, for the tolerance: ceil(total / tokens) + extra partial states.
struct attention_split_rule {
  double tokens;
  double extra;
};

template <class TailT>
attention_reference_result attention_reference(
    attention_split_rule split, const std::vector<float>& pk, const std::vector<float>& pv,
    std::int64_t prompt_tokens, const std::vector<TailT>& tk, const std::vector<TailT>& tv,
    std::int64_t kv_heads, std::int64_t D, const std::vector<float>& q, std::int64_t n,
    std::int64_t qh, tail_visibility vis, double scale, std::int64_t window, double cap) {
  const double u = std::ldexp(1.0, -24);
  attention_reference_result r;
  r.out.assign(static_cast<std::size_t>(n * qh * D), 0.0);
  r.lse.assign(static_cast<std::size_t>(n * qh), 0.0);
  r.tol.assign(static_cast<std::size_t>(n * qh), 0.0);
  const std::int64_t group = qh / kv_heads;
  auto element = [&](const std::vector<float>& prompt, const std::vector<TailT>& tail,
                     std::int64_t t, std::int64_t g, std::int64_t c) {
    return t < prompt_tokens
               ? static_cast<double>(prompt[static_cast<std::size_t>((t * kv_heads + g) * D + c)])
               : static_cast<double>(to_float(
                     tail[static_cast<std::size_t>(((t - prompt_tokens) * kv_heads + g) * D + c)]));
  };
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t h = 0; h < qh; ++h) {
      const std::int64_t g = h / group;
      const float* qv = q.data() + (i * qh + h) * D;
      const std::int64_t total = prompt_tokens + vis(i), qpos = total - 1,
                         first = window > 0 ? qpos - window + 1 : 0;
      std::vector<double> s;
      std::vector<std::int64_t> pos;
      double max_ds = 0.0, max_v = 0.0;
      for (std::int64_t t = std::max<std::int64_t>(first, 0); t < total; ++t) {
        double dot = 0.0, mag = 0.0;
        for (std::int64_t c = 0; c < D; ++c) {
          const double k = element(pk, tk, t, g, c);
          dot += qv[c] * k;
          mag += std::abs(qv[c] * k);
        }
        dot *= scale;
        if (cap > 0) dot = cap * std::tanh(dot / cap);
        s.push_back(dot);
        pos.push_back(t);
        max_ds = std::max(
            max_ds, (static_cast<double>(D) + 4.0) * u * mag * scale * 4.0 + 4 * u * std::abs(dot));
      }
      const double m = *std::max_element(s.begin(), s.end());
      double l = 0.0;
      for (double& x : s) l += (x = std::exp(x - m));
      for (std::size_t k = 0; k < s.size(); ++k)
        for (std::int64_t c = 0; c < D; ++c) {
          const double v = element(pv, tv, pos[k], g, c);
          max_v = std::max(max_v, std::abs(v));
          r.out[static_cast<std::size_t>((i * qh + h) * D + c)] += s[k] / l * v;
        }
      r.lse[static_cast<std::size_t>(i * qh + h)] = m + std::log(l);
      const double splits = std::ceil(static_cast<double>(total) / split.tokens) + split.extra;
      r.tol[static_cast<std::size_t>(i * qh + h)] =
          2.0 * max_v * (4.0 * max_ds + (1024.0 + D + 16.0 + 8.0 * splits) * u) + 1e-30;
    }
  return r;
}

}  // namespace lynx::test
