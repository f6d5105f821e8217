// The K/V sources one split of decode attention walks: a bit-plane prompt
// (plane_kv_source), full-precision rows (dense_kv_source) and a layer's stored
// codes (code_kv_source).
#pragma once

#include <cstdint>
#include <type_traits>

#include "lynx/backend/host/attention/tile_math.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"

namespace lynx::detail {

/// Bits of the integers the GFNI decoders give for P planes: prefix << (decoded_bits(P) - P).
inline int decoded_bits(int planes) { return planes > 8 ? 16 : 8; }

/// A bit-plane prompt at `planes` planes, of any plan and group size (both are
/// run-time values of view.geometry): every plan's prompt is walked by the same
/// compiled walk.
struct plane_kv_source {
  plane_data view;
  int planes = 0;
  [[nodiscard]] std::int64_t tokens() const { return view.geometry.tokens; }
  [[nodiscard]] int head_dim() const { return static_cast<int>(view.geometry.head_dim); }
  // Pointers to plane j's words [head_dim] of block (h, b), j < planes, across streams.
  void block_rows(bool keys, std::int64_t h, std::int64_t b, const std::uint32_t** rows) const {
    const layer_geometry& g = view.geometry;
    int j = 0;
    for (int s = 0; j < planes; ++s) {
      const std::uint32_t* base = keys ? view.key_planes(s) : view.value_planes(s);
      for (int jl = 0; jl < g.planes_in(s) && j < planes; ++jl, ++j)
        rows[j] = base + g.word_index(s, h, b, jl, 0);
    }
  }
  /// Asks the cache for block (h, b)'s plane words ahead of use (the walk is
  /// sequential, but each block is small next to the work done on it).
  void prefetch_block(bool keys, std::int64_t h, std::int64_t b) const {
    if (b >= view.geometry.blocks()) return;
    const std::uint32_t* rows[16];
    block_rows(keys, h, b, rows);
    for (int j = 0; j < planes; ++j) prefetch_lines<3>(rows[j], view.geometry.head_dim * 4);
  }
  /// Asks L2 for slice `part` of `parts` of everything one split [t0, t1) of kv
  /// head h reads (plane words of its blocks and its scales and zeros), keys
  /// or values. The kernels call it block by block for the split they will
  /// walk next, so its bytes are in L2 when the walk starts.
  void prefetch_split_slice(bool keys, std::int64_t h, std::int64_t t0, std::int64_t t1, int part,
                            int parts) const {
    view.for_each_range(keys, planes, h, t0, t1, [&](const void* base, std::int64_t bytes) {
      const std::int64_t lo = bytes * part / parts / 64 * 64, hi = bytes * (part + 1) / parts;
      prefetch_lines<2>(static_cast<const char*>(base) + lo, hi - lo);
    });
  }
  /// Adds to `walk` everything one split [t0, t1) of kv head h reads, keys or
  /// values, in the order the kernels read it: scales and zeros, then plane words.
  void walk_split(prefetch_walk& walk, bool keys, std::int64_t h, std::int64_t t0,
                  std::int64_t t1) const {
    view.for_each_range(keys, planes, h, t0, t1,
                        [&](const void* base, std::int64_t bytes) { walk.add(base, bytes); });
  }
  [[nodiscard]] float level_unit() const {
    return static_cast<float>(1u << (view.geometry.plan.bits - planes));
  }
  /// midpoint_offset<bits>(planes).
  [[nodiscard]] float half() const {
    return static_cast<float>((1u << (view.geometry.plan.bits - planes)) - 1u) * 0.5f;
  }
};

/// The source of a bit-plane view at `planes` planes.
template <stream_plan_type Plan, int G>
plane_kv_source plane_source(const bitplane_view<Plan, G, host_space>& v, int planes) {
  return {v.data(), planes};
}

/// Full-precision K/V (engine tail, or the 16-bit baseline's prompt).
template <class T>
struct dense_kv_source {
  kv_view<const T, host_space> keys, values;
  [[nodiscard]] std::int64_t tokens() const { return keys.shape.tokens; }
  [[nodiscard]] int head_dim() const { return static_cast<int>(keys.shape.head_dim); }
};

/// A lynx::code_view's data with its plan and group size only in `geometry`
/// (run-time values): Code is uint8_t (codes of up to 8 bits) or uint16_t.
template <class Code>
struct code_data {
  using code_type = Code;
  layer_geometry geometry{};
  const std::byte* params = nullptr;
  const Code* key_codes = nullptr;
  const Code* value_codes = nullptr;

  [[nodiscard]] const bf16* key_scale() const { return wire_params(geometry, params, 0); }
  [[nodiscard]] const bf16* key_zero() const { return wire_params(geometry, params, 1); }
  [[nodiscard]] const bf16* value_scale() const { return wire_params(geometry, params, 2); }
  [[nodiscard]] const bf16* value_zero() const { return wire_params(geometry, params, 3); }
  /// Key codes of block b of kv head h: [head_dim][32].
  [[nodiscard]] const Code* key_block(std::int64_t h, std::int64_t b) const {
    return key_codes + (h * geometry.blocks() + b) * geometry.head_dim * tokens_per_word;
  }
  /// Value codes of token t of kv head h: [head_dim] (t below blocks * 32).
  [[nodiscard]] const Code* value_row(std::int64_t h, std::int64_t t) const {
    return value_codes + (h * geometry.blocks() * tokens_per_word + t) * geometry.head_dim;
  }
};

/// A complete layer's codes laid out for attention (lynx::code_view): key codes
/// [kv_heads][blocks][head_dim][32] (lane = token), value codes [kv_heads][blocks * 32][head_dim]
/// (lane = channel), the anchor's parameters. The same math as a plane_kv_source at all
/// planes, the same bits; only the decoding of the planes is gone.
/// View: code_data<Code> (any plan and group size: one walk per code type).
template <class View>
struct code_kv_source {
  View view;
  int planes = 0;  // the plan's bits
  using code_type = typename View::code_type;
  [[nodiscard]] float level_unit() const {
    return static_cast<float>(1u << (view.geometry.plan.bits - planes));
  }
  /// midpoint_offset<bits>(planes).
  [[nodiscard]] float half() const {
    return static_cast<float>((1u << (view.geometry.plan.bits - planes)) - 1u) * 0.5f;
  }
  /// Adds to `walk` everything one split [t0, t1) of kv head h reads, keys or
  /// values, in the order the kernels read it: scales and zeros, then codes.
  void walk_split(prefetch_walk& walk, bool keys, std::int64_t h, std::int64_t t0,
                  std::int64_t t1) const {
    if (t1 <= t0) return;
    const layer_geometry& g = view.geometry;
    const std::int64_t b0 = t0 / attention_block_tokens,
                       b1 = (t1 + attention_block_tokens - 1) / attention_block_tokens;
    constexpr std::int64_t code_bytes = sizeof(code_type);
    const auto p = keys ? g.key_params_of(h, t0, t1) : g.value_params_of(h, t0, t1);
    walk.add((keys ? view.key_scale() : view.value_scale()) + p.first, (p.end - p.first) * 2);
    walk.add((keys ? view.key_zero() : view.value_zero()) + p.first, (p.end - p.first) * 2);
    if (keys)
      walk.add(view.key_block(h, b0), (b1 - b0) * g.head_dim * attention_block_tokens * code_bytes);
    else
      walk.add(view.value_row(h, t0), (b1 * attention_block_tokens - t0) * g.head_dim * code_bytes);
  }
};

/// The value weights of a code source: no GFNI decoder, so no shift folded in.
template <class View>
bool gfni_values(const code_kv_source<View>&) {
  return false;
}

}  // namespace lynx::detail
