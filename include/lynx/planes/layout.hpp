// Geometry of one layer's segments: where every scale, zero point and plane word
// lives in a stream's payload. Pure arithmetic, host and device.
//
// Planes are packed along tokens for both K and V: one 32-bit word holds one
// plane of one channel for 32 consecutive tokens (bit t = token 32*block + t),
// so a SIMD lane or a GPU thread is a token when attention scores a query
// against many keys, and any head_dim (8 as well as 256) packs without padding.
//
// Payload of stream s (every section starts at a multiple of 64 bytes):
//   s == 0 only: key_scale  [kv_heads][key_token_groups][head_dim]        bf16
//                key_zero   [kv_heads][key_token_groups][head_dim]        bf16
//                value_scale[kv_heads][tokens][value_channel_groups]      bf16
//                value_zero [kv_heads][tokens][value_channel_groups]      bf16
//   every s:     key_planes  [kv_heads][blocks][planes of s][head_dim]    uint32
//                value_planes[kv_heads][blocks][planes of s][head_dim]    uint32
// Padding tokens of the last block have all plane bits 0.
//
// Receivers check the four bf16 parameter sections at accept; views, attention
// and reconstruction read them where the anchor lies. The encoders compute the
// parameters as floats in a block of the same shape (the "expanded parameters",
// offsets key_scale_offset() .. params_bytes()) before writing them as bf16.
#pragma once

#include <cstdint>
#include <string>

#include "lynx/core/config.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/stream_plan.hpp"

namespace lynx {

inline constexpr int tokens_per_word = 32;  // tokens of one plane word
inline constexpr std::int64_t section_alignment = 64;

LYNX_HOST_DEVICE constexpr std::int64_t align_up(std::int64_t n, std::int64_t a) {
  return (n + a - 1) / a * a;
}
LYNX_HOST_DEVICE constexpr std::int64_t ceil_div(std::int64_t n, std::int64_t d) {
  return (n + d - 1) / d;
}

/// Everything needed to find a byte of a layer's segments.
struct layer_geometry {
  plan_desc plan{};
  std::int32_t key_group = 32;  // tokens per key group (keys: per channel over key_group tokens)
  std::int32_t value_group =
      32;  // channels per value group (values: per token over value_group channels)
  std::int64_t tokens = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;

  LYNX_HOST_DEVICE constexpr std::int64_t blocks() const {
    return ceil_div(tokens, tokens_per_word);
  }
  LYNX_HOST_DEVICE constexpr std::int64_t key_token_groups() const {
    return ceil_div(tokens, key_group);
  }
  LYNX_HOST_DEVICE constexpr std::int64_t value_channel_groups() const {
    return head_dim / value_group;
  }
  LYNX_HOST_DEVICE constexpr std::int64_t key_params() const {
    return kv_heads * key_token_groups() * head_dim;
  }
  LYNX_HOST_DEVICE constexpr std::int64_t value_params() const {
    return kv_heads * tokens * value_channel_groups();
  }
  LYNX_HOST_DEVICE constexpr int planes_in(int stream) const { return plan.width(stream); }
  /// uint32 words of one tensor (K or V) in stream s.
  LYNX_HOST_DEVICE constexpr std::int64_t plane_words(int stream) const {
    return kv_heads * blocks() * planes_in(stream) * head_dim;
  }

  // Byte offsets of the four parameter sections: on the wire (bf16, inside the
  // payload of stream 0) and expanded (float, the encoders' parameter block).
  // section: 0 key_scale, 1 key_zero, 2 value_scale, 3 value_zero.
  LYNX_HOST_DEVICE constexpr std::int64_t param_section_offset(int section,
                                                               std::int64_t bytes_each) const {
    const std::int64_t k = align_up(key_params() * bytes_each, section_alignment),
                       v = align_up(value_params() * bytes_each, section_alignment);
    return section <= 2 ? section * k : 2 * k + (section - 2) * v;
  }
  LYNX_HOST_DEVICE constexpr std::int64_t param_section_params(int section) const {
    return section < 2 ? key_params() : value_params();
  }
  static constexpr std::int64_t wire_param_bytes = 2;  // bf16
  LYNX_HOST_DEVICE constexpr std::int64_t wire_params_bytes() const {
    return param_section_offset(4, wire_param_bytes);
  }
  // The expanded (float) parameter block of the encoders.
  LYNX_HOST_DEVICE constexpr std::int64_t key_scale_offset() const { return 0; }
  LYNX_HOST_DEVICE constexpr std::int64_t key_zero_offset() const {
    return param_section_offset(1, 4);
  }
  LYNX_HOST_DEVICE constexpr std::int64_t value_scale_offset() const {
    return param_section_offset(2, 4);
  }
  LYNX_HOST_DEVICE constexpr std::int64_t value_zero_offset() const {
    return param_section_offset(3, 4);
  }
  LYNX_HOST_DEVICE constexpr std::int64_t params_bytes() const {
    return param_section_offset(4, 4);
  }
  /// Byte offsets of the plane sections inside the payload of stream s.
  LYNX_HOST_DEVICE constexpr std::int64_t key_planes_offset(int stream) const {
    return stream == 0 ? wire_params_bytes() : 0;
  }
  LYNX_HOST_DEVICE constexpr std::int64_t value_planes_offset(int stream) const {
    return key_planes_offset(stream) + align_up(plane_words(stream) * 4, section_alignment);
  }
  LYNX_HOST_DEVICE constexpr std::int64_t payload_bytes(int stream) const {
    return value_planes_offset(stream) + align_up(plane_words(stream) * 4, section_alignment);
  }
  /// Word index, inside a plane section of stream s, of (head, block, local plane, channel).
  LYNX_HOST_DEVICE constexpr std::int64_t word_index(int stream, std::int64_t head,
                                                     std::int64_t block, int local_plane,
                                                     std::int64_t channel) const {
    return ((head * blocks() + block) * planes_in(stream) + local_plane) * head_dim + channel;
  }
  /// Index of (head, token group, channel) among the key parameters.
  LYNX_HOST_DEVICE constexpr std::int64_t key_param_index(std::int64_t head, std::int64_t token,
                                                          std::int64_t channel) const {
    return (head * key_token_groups() + token / key_group) * head_dim + channel;
  }
  /// Index of (head, token, channel group) among the value parameters.
  LYNX_HOST_DEVICE constexpr std::int64_t value_param_index(std::int64_t head, std::int64_t token,
                                                            std::int64_t channel) const {
    return (head * tokens + token) * value_channel_groups() + channel / value_group;
  }
  /// Indices [first, end) of the key parameters that kv head h's tokens [t0, t1) use (t0 < t1).
  struct index_range {
    std::int64_t first, end;
  };
  LYNX_HOST_DEVICE constexpr index_range key_params_of(std::int64_t h, std::int64_t t0,
                                                       std::int64_t t1) const {
    return {(h * key_token_groups() + t0 / key_group) * head_dim,
            (h * key_token_groups() + (t1 - 1) / key_group + 1) * head_dim};
  }
  /// Indices [first, end) of the value parameters of kv head h's tokens [t0, t1).
  LYNX_HOST_DEVICE constexpr index_range value_params_of(std::int64_t h, std::int64_t t0,
                                                         std::int64_t t1) const {
    return {(h * tokens + t0) * value_channel_groups(), (h * tokens + t1) * value_channel_groups()};
  }
  LYNX_HOST_DEVICE constexpr kv_shape shape() const { return {tokens, kv_heads, head_dim}; }

  friend constexpr bool operator==(const layer_geometry&, const layer_geometry&) = default;
};

/// The geometry Lynx uses for a plan, a group size G and a layer's shape.
/// Keys group G tokens per channel. Values group `value_group` channels per
/// token: any size that divides head_dim (16 for head_dim 80 or 112 at G = 32,
/// say); 0 (the default) means min(G, head_dim).
template <stream_plan_type Plan, int G>
layer_geometry make_geometry(kv_shape shape, std::int32_t value_group = 0) {
  static_assert(G >= 1 && G <= 1024, "group size G must be in [1, 1024]");
  detail::require(
      shape.tokens >= 1 && shape.kv_heads >= 1 && shape.head_dim >= 1, errc::shape_mismatch,
      "a layer needs at least one token, one kv head and one channel, got " + to_string(shape));
  detail::require(
      shape.tokens <= (std::int64_t{1} << 31) && shape.kv_heads <= 65535 && shape.head_dim <= 65535,
      errc::shape_mismatch,
      "layer shape " + to_string(shape) + " exceeds the wire format's limits");
  layer_geometry g;
  g.plan = plan_desc::of<Plan>();
  g.key_group = G;
  detail::require(value_group >= 0 && value_group <= shape.head_dim, errc::shape_mismatch,
                  "value group of " + std::to_string(value_group) + " channels for head_dim " +
                      std::to_string(shape.head_dim) + " (0: min(G, head_dim))");
  g.value_group = value_group != 0
                      ? value_group
                      : static_cast<std::int32_t>(G < shape.head_dim ? G : shape.head_dim);
  detail::require(shape.head_dim % g.value_group == 0, errc::shape_mismatch,
                  "head_dim " + std::to_string(shape.head_dim) +
                      " is not a multiple of the value group size " +
                      std::to_string(g.value_group) +
                      (value_group == 0 ? " (min(G, head_dim)): choose a value group that divides "
                                          "it (encode_options::value_group and the receiver "
                                          "tensor's value_group)"
                                        : ""));
  g.tokens = shape.tokens;
  g.kv_heads = shape.kv_heads;
  g.head_dim = shape.head_dim;
  return g;
}

}  // namespace lynx
