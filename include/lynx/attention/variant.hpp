// Attention variants: the softmax scale, an optional logit soft-cap and an
// optional sliding window, as a functor the kernels are instantiated with
// (the FlashInfer habit). A variant opts in with `variant_tag`.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>

namespace lynx {

/// An attention variant:
///  - `float query_scale(int head_dim) const`: factor applied to q before q.k
///    (the softmax scale);
///  - `static constexpr bool has_logit_transform` and
///    `float transform_logit(float) const`: applied to every scaled logit;
///  - `std::int64_t window() const`: tokens a query sees back from its own
///    position (itself included); 0 = unlimited.
template <class V>
concept attention_variant = requires(const V& v, float x, int d) {
  typename V::variant_tag;
  { v.query_scale(d) } -> std::convertible_to<float>;
  { V::has_logit_transform } -> std::convertible_to<bool>;
  { v.transform_logit(x) } -> std::convertible_to<float>;
  { v.window() } -> std::convertible_to<std::int64_t>;
};

/// Softmax scale 1/sqrt(head_dim) unless set; no soft-cap; no window unless set.
struct default_variant {
  using variant_tag = void;
  static constexpr bool has_logit_transform = false;
  float scale = 0.0f;        // 0: 1 / sqrt(head_dim)
  std::int64_t window_ = 0;  // 0: unlimited
  [[nodiscard]] float query_scale(int head_dim) const {
    return scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  }
  [[nodiscard]] float transform_logit(float x) const { return x; }
  [[nodiscard]] std::int64_t window() const { return window_; }
};

/// Logit soft-cap (Gemma-2 style): logit -> cap * tanh(logit / cap).
struct soft_cap_variant {
  using variant_tag = void;
  static constexpr bool has_logit_transform = true;
  float cap = 50.0f;
  float scale = 0.0f;
  std::int64_t window_ = 0;
  [[nodiscard]] float query_scale(int head_dim) const {
    return scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  }
  [[nodiscard]] float transform_logit(float x) const { return cap * std::tanh(x / cap); }
  [[nodiscard]] std::int64_t window() const { return window_; }
};

}  // namespace lynx
