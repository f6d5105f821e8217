// Strided views over one layer of an engine's K or V cache:
//   element (token t, kv head h, channel c) lives at data[t*token_stride + h*head_stride +
//   c*channel_stride]
// Strides are in elements and arbitrary, so token-major ([tokens, heads, dim])
// and head-major ([heads, tokens, dim]) caches are both read without a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "lynx/core/config.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/core/types.hpp"

namespace lynx {

/// Shape of one layer's K (or V): tokens x kv_heads x head_dim.
struct kv_shape {
  std::int64_t tokens = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  friend constexpr bool operator==(const kv_shape&, const kv_shape&) = default;
  [[nodiscard]] constexpr std::int64_t elements() const { return tokens * kv_heads * head_dim; }
};

inline std::string to_string(const kv_shape& s) {
  return "[tokens=" + std::to_string(s.tokens) + ", kv_heads=" + std::to_string(s.kv_heads) +
         ", head_dim=" + std::to_string(s.head_dim) + "]";
}

/// Non-owning strided view of one layer's K or V. T may be const-qualified.
template <class T, memory_space Space = host_space>
struct kv_view {
  using element_type = T;
  using space = Space;

  T* data = nullptr;
  kv_shape shape{};
  std::int64_t token_stride = 0;    // elements between consecutive tokens
  std::int64_t head_stride = 0;     // elements between consecutive kv heads
  std::int64_t channel_stride = 1;  // elements between consecutive channels

  LYNX_HOST_DEVICE T& operator()(std::int64_t token, std::int64_t head,
                                 std::int64_t channel) const {
    return data[token * token_stride + head * head_stride + channel * channel_stride];
  }
  [[nodiscard]] LYNX_HOST_DEVICE bool channels_contiguous() const { return channel_stride == 1; }

  /// A view of mutable elements converts to a view of const ones.
  template <class U = T>
  requires(!std::is_const_v<U>) operator kv_view<const U, Space>() const {
    return {data, shape, token_stride, head_stride, channel_stride};
  }
};

/// [tokens, kv_heads, head_dim], row-major: the layout of most paged caches within a page.
template <class T, memory_space Space = host_space>
kv_view<T, Space> token_major(T* data, kv_shape shape) {
  return {data, shape, shape.kv_heads * shape.head_dim, shape.head_dim, 1};
}

/// [kv_heads, tokens, head_dim], row-major.
template <class T, memory_space Space = host_space>
kv_view<T, Space> head_major(T* data, kv_shape shape) {
  return {data, shape, shape.head_dim, shape.tokens * shape.head_dim, 1};
}

}  // namespace lynx
