// A complete layer's B-bit codes laid out for attention (host).
//
// While streams are still arriving, attention reads the bit-planes and builds
// each code inside the dot products (lynx::bitplane_view). Once the last stream
// has landed, every later decode step reads all planes of every token: a layer
// can then be merged once into a code_tensor, which holds the same codes, one
// byte (B = 8) or two (B = 12, 16) per element, in the order the attention
// kernels read them, so the per-step work of gathering bits from planes is gone.
// Attention over a code_view gives the same bits as over the bit-plane view at
// all planes (same codes, same operations, same order; the tests check it).
//
//   key codes   [kv_heads][blocks][head_dim][32]    lane = token (32 tokens of a block)
//   value codes [kv_heads][blocks * 32][head_dim]   lane = channel
//   parameters  the anchor's parameter sections, copied (layout.hpp offsets)
// Padding tokens of the last block have code 0. The footprint is that of the
// planes (B bits per element, plus the block padding), so the bit-plane tensor
// can be dropped once the codes are made.
//
// Usage:
//   if (tensor.complete()) codes = lynx::code_tensor<Plan, G>(tensor, threads);
//   attn(codes.view(), tail_k, tail_v, queries, visibility, output, ws);
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "lynx/backend/host/attention/avx512_decode.hpp"
#include "lynx/backend/host/attention/sources.hpp"
#include "lynx/backend/host/isa.hpp"
#include "lynx/backend/host/parallel.hpp"
#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"

namespace lynx {

/// A non-owning view of a code_tensor (see the layout above).
template <stream_plan_type Plan, int G = 32>
struct code_view {
  using plan = Plan;
  using space = host_space;
  using code_type = std::conditional_t<(Plan::bits <= 8), std::uint8_t, std::uint16_t>;
  static constexpr int group_size = G;

  layer_geometry geometry{};
  std::uint32_t layer = 0;
  int level = Plan::streams;  // always complete
  const std::byte* params = nullptr;
  const code_type* key_codes = nullptr;
  const code_type* value_codes = nullptr;

  [[nodiscard]] int planes() const { return Plan::bits; }
  /// The anchor's bf16 parameters (layout.hpp), as a bitplane_view's.
  [[nodiscard]] const bf16* key_scale() const { return data().key_scale(); }
  [[nodiscard]] const bf16* key_zero() const { return data().key_zero(); }
  [[nodiscard]] const bf16* value_scale() const { return data().value_scale(); }
  [[nodiscard]] const bf16* value_zero() const { return data().value_zero(); }
  /// Key codes of block b of kv head h: [head_dim][32].
  [[nodiscard]] const code_type* key_block(std::int64_t h, std::int64_t b) const {
    return data().key_block(h, b);
  }
  /// Value codes of token t of kv head h: [head_dim] (t below blocks * 32).
  [[nodiscard]] const code_type* value_row(std::int64_t h, std::int64_t t) const {
    return data().value_row(h, t);
  }
  /// The view's data without its plan and group size in the type (they are in
  /// geometry): what the host attention walks read, one walk per code type.
  [[nodiscard]] detail::code_data<code_type> data() const {
    return {geometry, params, key_codes, value_codes};
  }
};

namespace detail {
/// The attention source of a code view.
template <stream_plan_type Plan, int G>
code_kv_source<code_data<typename code_view<Plan, G>::code_type>> code_source(
    const code_view<Plan, G>& v) {
  return {v.data(), Plan::bits};
}
}  // namespace detail

/// The codes of a complete layer, owned (see the layout above).
template <stream_plan_type Plan, int G = 32>
class code_tensor {
 public:
  using plan = Plan;
  using view_type = code_view<Plan, G>;
  using code_type = typename view_type::code_type;
  static constexpr int group_size = G;

  code_tensor() = default;

  /// Merges every plane of a complete layer; `threads` <= 0: all hardware threads.
  explicit code_tensor(const bitplane_view<Plan, G, host_space>& v, int threads = 1) {
    assign(v, threads);
  }
  /// Merges a complete tensor.
  explicit code_tensor(const bitplane_tensor<Plan, G, host_space>& t, int threads = 1) {
    assign(t.view(), threads);
  }

  /// Merges another complete layer into this tensor, reusing its buffers when
  /// they are large enough (a slot kept per layer allocates once: fresh pages
  /// cost a first touch that can outweigh the merge). A layer that is not
  /// complete is rejected before anything changes.
  void assign(const bitplane_view<Plan, G, host_space>& v, int threads = 1) {
    if (!(v.level == Plan::streams))
      detail::fail(errc::invalid_argument,
                   "code_tensor: layer " + std::to_string(v.layer) + " has " +
                       std::to_string(v.level) + " of " + std::to_string(Plan::streams) +
                       " streams; codes are made from every plane (merge once the last stream "
                       "has landed)");
    const layer_geometry& g = v.geometry;
    const std::int64_t D = g.head_dim, blocks = g.blocks();
    const std::size_t codes = static_cast<std::size_t>(g.kv_heads * blocks * tokens_per_word * D);
    const std::size_t params = static_cast<std::size_t>(g.wire_params_bytes());
    if (params_.size() < params || keys_.size() < codes * sizeof(code_type)) {
      aligned_buffer p(std::max(params, params_.size())), k(codes * sizeof(code_type)),
          w(codes * sizeof(code_type));
      params_ = std::move(p);
      keys_ = std::move(k);
      values_ = std::move(w);
    }
    geometry_ = g;
    layer_ = v.layer;
    std::memcpy(params_.data(), v.payload[0], params);  // the front of the anchor
    const detail::plane_kv_source src = detail::plane_source(v, Plan::bits);
    code_type* kc = reinterpret_cast<code_type*>(keys_.data());
    code_type* vc = reinterpret_cast<code_type*>(values_.data());
    const std::int64_t tile_floats = D * tokens_per_word;
    detail::parallel_for(threads, g.kv_heads * blocks, [&](std::int64_t i0, std::int64_t i1) {
      aligned_buffer tile_buffer(static_cast<std::size_t>(tile_floats) * 4);
      float* tile = reinterpret_cast<float*>(tile_buffer.data());  // [D][32]
      const std::uint32_t* rows[16];
      for (std::int64_t i = i0; i < i1; ++i) {
        const std::int64_t h = i / blocks, b = i % blocks;
#if LYNX_ATTENTION_AVX512
        if (detail::host_has_gfni()) {
          src.block_rows(true, h, b, rows);
          detail::block_codes_gfni<Plan::bits, false>(rows, static_cast<int>(D),
                                                      kc + i * tile_floats);
          src.block_rows(false, h, b, rows);
          detail::block_codes_gfni<Plan::bits, true>(rows, static_cast<int>(D),
                                                     vc + i * tile_floats);
          continue;
        }
#endif
        for (int keys = 1; keys >= 0; --keys) {
          src.block_rows(keys == 1, h, b, rows);
          decode_block(rows, static_cast<int>(D), tile);
          if (keys == 1) {
            code_type* out = kc + i * tile_floats;
            for (std::int64_t k = 0; k < tile_floats; ++k) out[k] = static_cast<code_type>(tile[k]);
          } else {
            code_type* out = vc + i * tile_floats;  // [32][D]
            for (std::int64_t c = 0; c < D; ++c)
              for (int t = 0; t < tokens_per_word; ++t)
                out[t * D + c] = static_cast<code_type>(tile[c * tokens_per_word + t]);
          }
        }
      }
    });
  }
  void assign(const bitplane_tensor<Plan, G, host_space>& t, int threads = 1) {
    assign(t.view(), threads);
  }

  [[nodiscard]] view_type view() const {
    view_type v;
    v.geometry = geometry_;
    v.layer = layer_;
    v.params = params_.data();
    v.key_codes = reinterpret_cast<const code_type*>(keys_.data());
    v.value_codes = reinterpret_cast<const code_type*>(values_.data());
    return v;
  }
  [[nodiscard]] const layer_geometry& geometry() const noexcept { return geometry_; }
  [[nodiscard]] std::uint32_t layer() const noexcept { return layer_; }
  /// Bytes held: parameters and codes (at least what the current layer needs).
  [[nodiscard]] std::size_t bytes() const noexcept {
    return params_.size() + keys_.size() + values_.size();
  }

 private:
  /// Codes of one 32-token block as floats, tile[c][32] (padding tokens: 0).
  static void decode_block(const std::uint32_t* const* rows, int D, float* tile) {
#if LYNX_ATTENTION_AVX512
    if (detail::host_has_avx512()) {
      detail::decode_key_block_avx512(rows, Plan::bits, D, tile);
      return;
    }
#endif
    for (int c = 0; c < D; ++c)
      for (int t = 0; t < tokens_per_word; ++t) {
        std::uint32_t k = 0;
        for (int j = 0; j < Plan::bits; ++j) k = (k << 1) | token_bit(rows[j][c], t);
        tile[c * tokens_per_word + t] = static_cast<float>(k);
      }
  }

  layer_geometry geometry_{};
  std::uint32_t layer_ = 0;
  aligned_buffer params_, keys_, values_;
};

}  // namespace lynx
