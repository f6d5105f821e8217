// Strided views over one layer of an engine's K or V cache:
//   element (token t, kv head h, channel c) lives at data[t*token_stride + h*head_stride +
//   c*channel_stride]
// Strides are in elements and arbitrary, so token-major ([tokens, heads, dim])
// and head-major ([heads, tokens, dim]) caches are both read without a copy.
//
// Paged caches (vLLM, SGLang, TensorRT-LLM): a pool of fixed-size blocks and a
// block table per request. With block_table set, token t's row lives in block
// block_table[t / block_tokens], row t % block_tokens of it:
//   element (t, h, c) at data[block_table[t / block_tokens] * block_stride +
//                             (t % block_tokens) * token_stride + h*head_stride +
//                             c*channel_stride]
// (paged_token_major: pool [blocks][block_tokens][kv_heads][head_dim];
// paged_head_major: pool [blocks][kv_heads][block_tokens][head_dim]). The codecs
// and attention read such a view in place, no gather copy, with the same
// results, bit for bit, as over a contiguous copy.
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
  // Paged: the block of each block_tokens tokens (nullptr: not paged), in the
  // same memory space as data; block_stride elements between blocks of the pool.
  const std::int32_t* block_table = nullptr;
  std::int64_t block_tokens = 0;
  std::int64_t block_stride = 0;

  /// Elements from data to token t's row (kv head 0, channel 0).
  [[nodiscard]] LYNX_HOST_DEVICE std::int64_t token_offset(std::int64_t token) const {
    if (block_table == nullptr) return token * token_stride;
    return static_cast<std::int64_t>(block_table[token / block_tokens]) * block_stride +
           (token % block_tokens) * token_stride;
  }
  LYNX_HOST_DEVICE T& operator()(std::int64_t token, std::int64_t head,
                                 std::int64_t channel) const {
    return data[token_offset(token) + head * head_stride + channel * channel_stride];
  }
  [[nodiscard]] LYNX_HOST_DEVICE bool channels_contiguous() const { return channel_stride == 1; }
  [[nodiscard]] LYNX_HOST_DEVICE bool paged() const { return block_table != nullptr; }
  /// Whether every aligned run of `n` tokens ([k n, (k + 1) n)) is token_stride
  /// apart row to row: not paged, or blocks of a multiple of n tokens.
  [[nodiscard]] LYNX_HOST_DEVICE bool rows_even_in_runs_of(std::int64_t n) const {
    return block_table == nullptr || block_tokens % n == 0;
  }

  /// A view of mutable elements converts to a view of const ones.
  template <class U = T>
  requires(!std::is_const_v<U>) operator kv_view<const U, Space>() const {
    return {data,           shape,       token_stride, head_stride,
            channel_stride, block_table, block_tokens, block_stride};
  }
};

namespace detail {

/// A paged view's table: blocks of at least one token, no negative block (host
/// views: every entry is read; that each names a block of the pool is the caller's
/// promise). `what` names the view in the message. Nothing for an unpaged view.
template <class T, memory_space Space>
void check_paging(const kv_view<T, Space>& v, const char* what) {
  if (v.block_table == nullptr) return;
  if (!(v.block_tokens >= 1))
    fail(errc::invalid_argument, std::string(what) + ": a paged view with blocks of " +
                                     std::to_string(v.block_tokens) + " tokens");
  if constexpr (std::is_same_v<Space, host_space>) {
    const std::int64_t blocks = (v.shape.tokens + v.block_tokens - 1) / v.block_tokens;
    for (std::int64_t b = 0; b < blocks; ++b)
      if (!(v.block_table[b] >= 0))
        fail(errc::invalid_argument, std::string(what) + ": block table entry " +
                                         std::to_string(b) + " is " +
                                         std::to_string(v.block_table[b]));
  }
}

}  // namespace detail

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

/// A paged pool [blocks][block_tokens][kv_heads][head_dim] (vLLM's K or V cache
/// layout) read through `block_table`: token t in block block_table[t / block_tokens].
/// The table must hold ceil(shape.tokens / block_tokens) entries, each a block of the pool.
template <class T, memory_space Space = host_space>
kv_view<T, Space> paged_token_major(T* pool, kv_shape shape, const std::int32_t* block_table,
                                    std::int64_t block_tokens) {
  detail::require(block_table != nullptr && block_tokens >= 1, errc::invalid_argument,
                  "paged view: a block table and blocks of at least one token (got " +
                      std::to_string(block_tokens) + ")");
  return {pool,
          shape,
          shape.kv_heads * shape.head_dim,
          shape.head_dim,
          1,
          block_table,
          block_tokens,
          block_tokens * shape.kv_heads * shape.head_dim};
}

/// A paged pool [blocks][kv_heads][block_tokens][head_dim] read through `block_table`.
template <class T, memory_space Space = host_space>
kv_view<T, Space> paged_head_major(T* pool, kv_shape shape, const std::int32_t* block_table,
                                   std::int64_t block_tokens) {
  detail::require(block_table != nullptr && block_tokens >= 1, errc::invalid_argument,
                  "paged view: a block table and blocks of at least one token (got " +
                      std::to_string(block_tokens) + ")");
  return {pool, shape,       shape.head_dim, block_tokens * shape.head_dim,
          1,    block_table, block_tokens,   shape.kv_heads * block_tokens * shape.head_dim};
}

}  // namespace lynx
