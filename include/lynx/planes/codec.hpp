// The codecs of a layer (host):
//   encode      quantize + split a layer's K and V into its segments (one per stream)
//   quantize    the B-bit codes and parameters alone (the reference for merge)
//   split       codes -> segments;  merge: all planes of a tensor -> codes
//   reconstruct dequantize at the tensor's precision level into an engine's layout
// Sizes come first (segment_bytes) so a caller can encode into its own,
// registered buffers with encode_into and no allocation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "lynx/backend/host/codec_kernels.hpp"
#include "lynx/backend/host/parallel.hpp"
#include "lynx/backend/host/simd_kernels.hpp"
#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/executor.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/quant/quantizer.hpp"

namespace lynx {

struct encode_options {
  std::uint64_t generation = 0;       // request generation written into every header
  int threads = 1;                    // host threads; <= 0 means all hardware threads
  task_executor* executor = nullptr;  // the engine's workers run the threads' shares (optional)
  std::int32_t value_group = 0;       // channels per value group: a divisor of head_dim (16 for
                                      // head_dim 80 or 112 at G = 32); 0: min(G, head_dim)
};

/// The segments of one layer, owned: segment(s) is what a transport sends.
template <stream_plan_type Plan, int G = 32>
class encoded_layer {
 public:
  using plan = Plan;
  static constexpr int group_size = G;

  encoded_layer(layer_geometry geometry, std::uint32_t layer) : geometry_(geometry), layer_(layer) {
    for (int s = 0; s < Plan::streams; ++s)
      segments_[static_cast<std::size_t>(s)] = aligned_buffer(segment_bytes(geometry_, s));
  }
  [[nodiscard]] std::span<const std::byte> segment(int s) const {
    return segments_[static_cast<std::size_t>(s)].span();
  }
  [[nodiscard]] std::span<std::byte> segment(int s) {
    return segments_[static_cast<std::size_t>(s)].span();
  }
  [[nodiscard]] const layer_geometry& geometry() const noexcept { return geometry_; }
  [[nodiscard]] std::uint32_t layer() const noexcept { return layer_; }
  [[nodiscard]] std::size_t total_bytes() const noexcept {
    std::size_t n = 0;
    for (int s = 0; s < Plan::streams; ++s) n += segments_[static_cast<std::size_t>(s)].size();
    return n;
  }

 private:
  layer_geometry geometry_;
  std::uint32_t layer_;
  std::array<aligned_buffer, max_streams> segments_{};
};

/// B-bit codes and group parameters of a layer, unpacked:
/// key_codes/value_codes [kv_heads][tokens][head_dim]; parameters as in layout.hpp.
struct quantized_layer {
  layer_geometry geometry{};
  std::vector<std::uint16_t> key_codes, value_codes;
  std::vector<float> key_scale, key_zero, value_scale, value_zero;
  friend bool operator==(const quantized_layer&, const quantized_layer&) = default;
};

namespace detail {

template <class T>
void check_input_views(const kv_view<const T, host_space>& keys,
                       const kv_view<const T, host_space>& values) {
  require(keys.data != nullptr && values.data != nullptr, errc::invalid_argument,
          "encode: null K or V data");
  require(keys.shape == values.shape, errc::shape_mismatch,
          "K has shape " + to_string(keys.shape) + " but V has shape " + to_string(values.shape));
  check_paging(keys, "encode: K");
  check_paging(values, "encode: V");
}

inline void check_output_spans(const layer_geometry& g, std::span<const std::span<std::byte>> out) {
  require(static_cast<int>(out.size()) == g.plan.streams, errc::invalid_argument,
          "encode_into: " + std::to_string(out.size()) + " output buffers for a plan of " +
              std::to_string(g.plan.streams) + " streams");
  for (int s = 0; s < g.plan.streams; ++s)
    require(out[static_cast<std::size_t>(s)].size() == segment_bytes(g, s), errc::invalid_argument,
            "encode_into: buffer of stream " + std::to_string(s) + " has " +
                std::to_string(out[static_cast<std::size_t>(s)].size()) +
                " bytes, the segment needs " + std::to_string(segment_bytes(g, s)));
}

/// Where a 32-token block's planes go: copies the packed planes (Bits x D words)
/// into the plane sections of every stream (a stream's planes of one block are contiguous).
inline void scatter_planes(const layer_geometry& g, const std::uint32_t* packed, std::int64_t h,
                           std::int64_t b, bool keys, std::span<const std::span<std::byte>> out) {
  for (int s = 0; s < g.plan.streams; ++s) {
    std::byte* payload = out[static_cast<std::size_t>(s)].data() + segment_header_bytes;
    auto* words = reinterpret_cast<std::uint32_t*>(
        payload + (keys ? g.key_planes_offset(s) : g.value_planes_offset(s)));
    std::memcpy(words + g.word_index(s, h, b, 0, 0), packed + g.plan.plane_begin(s) * g.head_dim,
                static_cast<std::size_t>(g.planes_in(s) * g.head_dim) * sizeof(std::uint32_t));
  }
}

inline void finish_segments(const layer_geometry& g, std::uint32_t layer, std::uint64_t generation,
                            std::span<const std::span<std::byte>> out) {
  for (int s = 0; s < g.plan.streams; ++s) {
    std::span<std::byte> seg = out[static_cast<std::size_t>(s)];
    const segment_header h = make_header(g, layer, s, generation);
    std::memcpy(seg.data(), &h, sizeof h);
    seal_segment(seg);
  }
}

// Zero the alignment padding between sections so segments are deterministic bytes.
inline void zero_padding(const layer_geometry& g, std::span<const std::span<std::byte>> out) {
  for (int s = 0; s < g.plan.streams; ++s)
    std::memset(out[static_cast<std::size_t>(s)].data() + segment_header_bytes, 0,
                static_cast<std::size_t>(g.payload_bytes(s)));
}

}  // namespace detail

/// Segment sizes for a layer: sizes()[s] bytes for stream s (header included).
inline std::vector<std::size_t> segment_sizes(const layer_geometry& g) {
  std::vector<std::size_t> n;
  for (int s = 0; s < g.plan.streams; ++s) n.push_back(segment_bytes(g, s));
  return n;
}

namespace detail {

/// encode_into's work for codes of B bits, any plan and group size (both are in
/// g): one compiled body per (B, T), shared by every plan of that width.
template <int B, kv_element T>
void encode_layer(kv_view<const T, host_space> keys, kv_view<const T, host_space> values,
                  std::uint32_t layer, std::span<const std::span<std::byte>> out,
                  const encode_options& options, const layer_geometry& g) {
  detail::check_output_spans(g, out);
  detail::zero_section_gaps(g, out);
  const std::int64_t D = g.head_dim;
  std::byte* anchor = out[0].data() + segment_header_bytes;
  // The parameters are computed as floats (bf16 values) into a per-thread block
  // of the expanded layout, then written to the anchor as bf16.
  thread_local std::vector<float> expanded_params;
  if (expanded_params.size() < static_cast<std::size_t>(g.params_bytes() / 4))
    expanded_params.resize(static_cast<std::size_t>(g.params_bytes() / 4));
  float* const params = expanded_params.data();
  float* key_scale = params + g.key_scale_offset() / 4;
  float* key_zero = params + g.key_zero_offset() / 4;
  float* value_scale = params + g.value_scale_offset() / 4;
  float* value_zero = params + g.value_zero_offset() / 4;
  const std::int64_t key_params_per_head = g.key_token_groups() * D;
  const std::int64_t value_params_per_head = g.tokens * g.value_channel_groups();

#if LYNX_CODEC_AVX512
  // Vector path, where the CPU runs it: one pass per (head, unit of whole blocks
  // and key groups). On non-finite input it gives way to the portable path below,
  // which reports it.
  if (detail::use_avx512_codec() && detail::simd::encode_supported(keys, values, g)) {
    std::array<int, 16> plane_stream{}, plane_local{};
    for (int s = 0, j = 0; s < g.plan.streams; ++s)
      for (int jl = 0; jl < g.planes_in(s); ++jl, ++j)
        plane_stream[static_cast<std::size_t>(j)] = s,
        plane_local[static_cast<std::size_t>(j)] = jl;
    std::array<std::uint32_t*, max_streams> key_words{}, value_words{};
    for (int s = 0; s < g.plan.streams; ++s) {
      std::byte* payload = out[static_cast<std::size_t>(s)].data() + segment_header_bytes;
      key_words[static_cast<std::size_t>(s)] =
          reinterpret_cast<std::uint32_t*>(payload + g.key_planes_offset(s));
      value_words[static_cast<std::size_t>(s)] =
          reinterpret_cast<std::uint32_t*>(payload + g.value_planes_offset(s));
    }
    const std::int64_t unit = detail::simd::unit_tokens(g), units = ceil_div(g.tokens, unit);
    bool vector_path_done = true;
    try {
      // Unit-major, head inner: consecutive items read neighbouring bytes of the same
      // token rows (token-major caches), and the next unit's rows are prefetched.
      detail::parallel_for(
          options.threads, g.kv_heads * units,
          [&](std::int64_t i0, std::int64_t i1) {
            detail::simd::encode_scratch scratch;
            scratch.size_for(g);
            std::int64_t segment_total = 0;
            for (int st = 0; st < g.plan.streams; ++st)
              segment_total += static_cast<std::int64_t>(out[static_cast<std::size_t>(st)].size());
            scratch.stream = segment_total >= detail::simd::encode_stream_min_bytes;
            for (std::int64_t i = i0; i < i1; ++i) {
              const std::int64_t h = i % g.kv_heads, u0 = (i / g.kv_heads) * unit,
                                 u1 = std::min<std::int64_t>(u0 + unit, g.tokens);
              detail::simd::next_rows<T> next{&keys, &values};
              if (i + 1 < i1) {
                next.h = (i + 1) % g.kv_heads;
                next.t0 = ((i + 1) / g.kv_heads) * unit;
                next.t1 = std::min<std::int64_t>(next.t0 + unit, g.tokens);
              }
              auto plane_row = [&](const std::array<std::uint32_t*, max_streams>& words) {
                return [&, h](std::int64_t b, int j) {
                  const int s = plane_stream[static_cast<std::size_t>(j)];
                  return words[static_cast<std::size_t>(s)] +
                         g.word_index(s, h, b, plane_local[static_cast<std::size_t>(j)], 0);
                };
              };
              detail::simd::encode_unit<B, T>(
                  keys, values, g, h, u0, u1, key_scale + h * key_params_per_head,
                  key_zero + h * key_params_per_head, value_scale + h * value_params_per_head,
                  value_zero + h * value_params_per_head, plane_row(key_words),
                  plane_row(value_words), next, scratch);
            }
            _mm_sfence();  // order any non-temporal stores of plane words before the join and the
                           // checksums
          },
          options.executor);
    } catch (const detail::simd::needs_portable_path&) {
      vector_path_done = false;
    }
    if (vector_path_done) {
      detail::write_wire_params(g, params, anchor);
      detail::finish_segments(g, layer, options.generation, out);
      return;
    }
  }
#endif

  // Phase 1: key parameters need whole token groups, which may span blocks.
  detail::parallel_for(
      options.threads, g.kv_heads,
      [&](std::int64_t h0, std::int64_t h1) {
        std::vector<float> lo, hi;
        for (std::int64_t h = h0; h < h1; ++h)
          detail::key_params_for_head<B>(keys, g, layer, h, key_scale + h * key_params_per_head,
                                         key_zero + h * key_params_per_head, lo, hi);
      },
      options.executor);
  // Phase 2: every (head, block) independently: quantize to a code tile, pack, scatter.
  const std::int64_t blocks = g.blocks();
  detail::parallel_for(
      options.threads, g.kv_heads * blocks,
      [&](std::int64_t i0, std::int64_t i1) {
        std::vector<std::uint16_t> codes(static_cast<std::size_t>(tokens_per_word * D));
        std::vector<std::uint32_t> packed(static_cast<std::size_t>(B * D));
        std::vector<float> scratch(static_cast<std::size_t>(D));
        for (std::int64_t i = i0; i < i1; ++i) {
          const std::int64_t h = i / blocks, b = i % blocks;
          const std::int64_t t0 = b * tokens_per_word,
                             n = std::min<std::int64_t>(tokens_per_word, g.tokens - t0);
          detail::quantize_key_block<B>(keys, g, h, t0, n, key_scale + h * key_params_per_head,
                                        key_zero + h * key_params_per_head, codes.data(),
                                        scratch.data());
          detail::pack_block<B>(codes.data(), n, D, packed.data());
          detail::scatter_planes(g, packed.data(), h, b, true, out);
          detail::quantize_value_block<B>(
              values, g, layer, h, t0, n, value_scale + h * value_params_per_head,
              value_zero + h * value_params_per_head, codes.data(), scratch.data());
          detail::pack_block<B>(codes.data(), n, D, packed.data());
          detail::scatter_planes(g, packed.data(), h, b, false, out);
        }
      },
      options.executor);
  detail::write_wire_params(g, params, anchor);
  detail::finish_segments(g, layer, options.generation, out);
}

}  // namespace detail

/// Encodes one layer into caller-provided buffers, out[s] of exactly segment_bytes(g, s).
template <stream_plan_type Plan, int G = 32, kv_element T>
void encode_into(kv_view<const T, host_space> keys, kv_view<const T, host_space> values,
                 std::uint32_t layer, std::span<const std::span<std::byte>> out,
                 const encode_options& options = {}) {
  detail::check_input_views(keys, values);
  detail::encode_layer<Plan::bits, T>(keys, values, layer, out, options,
                                      make_geometry<Plan, G>(keys.shape, options.value_group));
}

/// Encodes one layer into newly allocated segments.
template <stream_plan_type Plan, int G = 32, kv_element T>
encoded_layer<Plan, G> encode(kv_view<const T, host_space> keys,
                              kv_view<const T, host_space> values, std::uint32_t layer,
                              const encode_options& options = {}) {
  detail::check_input_views(keys, values);
  encoded_layer<Plan, G> result(make_geometry<Plan, G>(keys.shape, options.value_group), layer);
  std::array<std::span<std::byte>, max_streams> spans{};
  for (int s = 0; s < Plan::streams; ++s) spans[static_cast<std::size_t>(s)] = result.segment(s);
  encode_into<Plan, G, T>(keys, values, layer,
                          std::span<const std::span<std::byte>>(spans.data(), Plan::streams),
                          options);
  return result;
}

template <stream_plan_type Plan, int G = 32, kv_element T>
encoded_layer<Plan, G> encode(kv_view<T, host_space> keys, kv_view<T, host_space> values,
                              std::uint32_t layer,
                              const encode_options& options = {}) requires(!std::is_const_v<T>) {
  return encode<Plan, G, T>(kv_view<const T, host_space>(keys),
                            kv_view<const T, host_space>(values), layer, options);
}

/// The codes and parameters of a layer, without splitting (the reference for merge).
template <stream_plan_type Plan, int G = 32, kv_element T>
quantized_layer quantize(kv_view<const T, host_space> keys, kv_view<const T, host_space> values,
                         std::uint32_t layer = 0, std::int32_t value_group = 0) {
  detail::check_input_views(keys, values);
  constexpr int B = Plan::bits;
  quantized_layer q;
  q.geometry = make_geometry<Plan, G>(keys.shape, value_group);
  const layer_geometry& g = q.geometry;
  const std::int64_t D = g.head_dim, T_ = g.tokens;
  q.key_codes.resize(static_cast<std::size_t>(g.kv_heads * T_ * D));
  q.value_codes.resize(q.key_codes.size());
  q.key_scale.resize(static_cast<std::size_t>(g.key_params()));
  q.key_zero.resize(q.key_scale.size());
  q.value_scale.resize(static_cast<std::size_t>(g.value_params()));
  q.value_zero.resize(q.value_scale.size());
  std::vector<float> lo, hi, scratch(static_cast<std::size_t>(D));
  for (std::int64_t h = 0; h < g.kv_heads; ++h) {
    float* ks = q.key_scale.data() + h * g.key_token_groups() * D;
    float* kz = q.key_zero.data() + h * g.key_token_groups() * D;
    detail::key_params_for_head<B>(keys, g, layer, h, ks, kz, lo, hi);
    for (std::int64_t b = 0; b < g.blocks(); ++b) {
      const std::int64_t t0 = b * tokens_per_word,
                         n = std::min<std::int64_t>(tokens_per_word, T_ - t0);
      detail::quantize_key_block<B>(keys, g, h, t0, n, ks, kz,
                                    q.key_codes.data() + (h * T_ + t0) * D, scratch.data());
      detail::quantize_value_block<B>(values, g, layer, h, t0, n,
                                      q.value_scale.data() + h * T_ * g.value_channel_groups(),
                                      q.value_zero.data() + h * T_ * g.value_channel_groups(),
                                      q.value_codes.data() + (h * T_ + t0) * D, scratch.data());
    }
  }
  return q;
}

/// Splits codes into the segments of a layer.
template <stream_plan_type Plan, int G = 32>
encoded_layer<Plan, G> split(const quantized_layer& q, std::uint32_t layer,
                             std::uint64_t generation = 0) {
  const layer_geometry& g = q.geometry;
  detail::require(
      g == make_geometry<Plan, G>(g.shape(), g.value_group), errc::plan_mismatch,
      "split: codes were quantized with plan '" + g.plan.name() + "', not '" + Plan::name() + "'");
  encoded_layer<Plan, G> result(g, layer);
  std::array<std::span<std::byte>, max_streams> spans{};
  for (int s = 0; s < Plan::streams; ++s) spans[static_cast<std::size_t>(s)] = result.segment(s);
  const std::span<const std::span<std::byte>> out(spans.data(), Plan::streams);
  detail::zero_padding(g, out);
  std::byte* anchor = out[0].data() + segment_header_bytes;
  {
    std::vector<float> expanded(static_cast<std::size_t>(g.params_bytes() / 4));
    const std::vector<float>* sections[4] = {&q.key_scale, &q.key_zero, &q.value_scale,
                                             &q.value_zero};
    for (int section = 0; section < 4; ++section) {
      const std::vector<float>& src = *sections[section];
      detail::require(static_cast<std::int64_t>(src.size()) == g.param_section_params(section),
                      errc::shape_mismatch, "split: parameter arrays do not match the geometry");
      for (const float x : src)
        detail::require((detail::float_bits(x) & 0xffffu) == 0u, errc::invalid_argument,
                        "split: a scale or zero point is not a bf16 value (codes must come from "
                        "lynx::quantize or lynx::merge)");
      std::memcpy(expanded.data() + g.param_section_offset(section, 4) / 4, src.data(),
                  src.size() * 4);
    }
    detail::write_wire_params(g, expanded.data(), anchor);
  }
  const std::int64_t D = g.head_dim, T_ = g.tokens;
  std::vector<std::uint32_t> packed(static_cast<std::size_t>(Plan::bits * D));
  for (std::int64_t h = 0; h < g.kv_heads; ++h)
    for (std::int64_t b = 0; b < g.blocks(); ++b) {
      const std::int64_t t0 = b * tokens_per_word,
                         n = std::min<std::int64_t>(tokens_per_word, T_ - t0);
      detail::pack_block<Plan::bits>(q.key_codes.data() + (h * T_ + t0) * D, n, D, packed.data());
      detail::scatter_planes(g, packed.data(), h, b, true, out);
      detail::pack_block<Plan::bits>(q.value_codes.data() + (h * T_ + t0) * D, n, D, packed.data());
      detail::scatter_planes(g, packed.data(), h, b, false, out);
    }
  detail::finish_segments(g, layer, generation, out);
  return result;
}

namespace detail {
// Pointers to plane j's words of block (h, b) for j < planes, across streams.
template <class View>
void block_plane_rows(const View& v, bool keys, std::int64_t h, std::int64_t b, int planes,
                      const std::uint32_t** rows) {
  const layer_geometry& g = v.geometry;
  int j = 0;
  for (int s = 0; j < planes; ++s)
    for (int jl = 0; jl < g.planes_in(s) && j < planes; ++jl, ++j)
      rows[j] = (keys ? v.key_planes(s) : v.value_planes(s)) + g.word_index(s, h, b, jl, 0);
}
}  // namespace detail

/// All planes back to B-bit codes (requires a complete tensor).
template <stream_plan_type Plan, int G>
quantized_layer merge(const bitplane_tensor<Plan, G, host_space>& tensor) {
  detail::require(tensor.complete(), errc::invalid_argument,
                  "merge: layer " + std::to_string(tensor.layer()) + " has " +
                      std::to_string(tensor.precision_level()) + " of " +
                      std::to_string(Plan::streams) + " streams");
  const auto v = tensor.view();
  const layer_geometry& g = v.geometry;
  quantized_layer q;
  q.geometry = g;
  const std::int64_t D = g.head_dim, T_ = g.tokens;
  q.key_codes.resize(static_cast<std::size_t>(g.kv_heads * T_ * D));
  q.value_codes.resize(q.key_codes.size());
  const auto floats = [](const bf16* p, std::int64_t n) {
    std::vector<float> out(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      out[static_cast<std::size_t>(i)] = static_cast<float>(p[i]);
    return out;
  };
  q.key_scale = floats(v.key_scale(), g.key_params());
  q.key_zero = floats(v.key_zero(), g.key_params());
  q.value_scale = floats(v.value_scale(), g.value_params());
  q.value_zero = floats(v.value_zero(), g.value_params());
  std::vector<std::uint32_t> codes(static_cast<std::size_t>(tokens_per_word * D));
  const std::uint32_t* rows[16];
  for (int which = 0; which < 2; ++which) {
    std::uint16_t* dst = which == 0 ? q.key_codes.data() : q.value_codes.data();
    for (std::int64_t h = 0; h < g.kv_heads; ++h)
      for (std::int64_t b = 0; b < g.blocks(); ++b) {
        const std::int64_t t0 = b * tokens_per_word,
                           n = std::min<std::int64_t>(tokens_per_word, T_ - t0);
        detail::block_plane_rows(v, which == 0, h, b, Plan::bits, rows);
        detail::unpack_block(rows, Plan::bits, n, D, codes.data());
        for (std::int64_t i = 0; i < n * D; ++i)
          dst[(h * T_ + t0) * D + i] =
              static_cast<std::uint16_t>(codes[static_cast<std::size_t>(i)]);
      }
  }
  return q;
}

struct reconstruct_options {
  int threads = 1;                    // <= 0: all hardware threads
  task_executor* executor = nullptr;  // the engine's workers run the threads' shares (optional)
  std::int32_t value_group = 0;       // channels per value group: a divisor of head_dim (16 for
                                      // head_dim 80 or 112 at G = 32); 0: min(G, head_dim)
};

namespace detail {

/// reconstruct's work for codes of B bits, any plan and group size (both are in
/// v.geometry): one compiled body per (B, T), shared by every plan of that width.
/// P: the planes present (the view's level).
template <int B, kv_element T>
void reconstruct_layer(const plane_data& v, std::uint32_t layer, int level, int P,
                       kv_view<T, host_space> keys_out, kv_view<T, host_space> values_out,
                       const reconstruct_options& options) {
  const layer_geometry& g = v.geometry;
  detail::require(
      level >= 1, errc::invalid_argument,
      "reconstruct: layer " + std::to_string(layer) + " has no anchor yet (precision level 0)");
  detail::require(keys_out.shape == g.shape() && values_out.shape == g.shape(),
                  errc::shape_mismatch,
                  "reconstruct: outputs " + to_string(keys_out.shape) + " / " +
                      to_string(values_out.shape) + ", the layer is " + to_string(g.shape()));
  detail::check_paging(keys_out, "reconstruct: K output");
  detail::check_paging(values_out, "reconstruct: V output");
  const float half = midpoint_offset<B>(P);
  const std::int64_t D = g.head_dim, T_ = g.tokens, VG = g.value_group,
                     VGs = g.value_channel_groups();
  const std::int64_t blocks = g.blocks();
#if LYNX_CODEC_AVX512
  if (detail::use_avx512_codec() && detail::simd::reconstruct_supported(keys_out, values_out, g)) {
    const bool bf16_cvt = detail::use_avx512_bf16_codec();
    detail::parallel_for(
        options.threads, g.kv_heads * blocks,
        [&](std::int64_t i0, std::int64_t i1) {
          aligned_buffer stage(static_cast<std::size_t>(2 * D / 16 * 8) * sizeof(__m512i));
          auto* stage_hi = reinterpret_cast<__m512i*>(stage.data());
          for (std::int64_t i = i0; i < i1; ++i) {
            const std::int64_t h = i % g.kv_heads,
                               b = i / g.kv_heads;  // block-major: neighbouring output bytes
            // The next item's inputs (plane rows, key and value parameters) come from
            // 3 x kv_heads strided streams the hardware prefetchers do not follow: asked
            // for a few lines per row written (see prefetch_walk).
            detail::prefetch_walk next;
            if (i + 1 < i1) {
              const std::int64_t hn = (i + 1) % g.kv_heads,
                                 t = (i + 1) / g.kv_heads * tokens_per_word;
              for (bool keys : {true, false})
                v.for_each_range(keys, P, hn, t, std::min(T_, t + tokens_per_word),
                                 [&](const void* p, std::int64_t bytes) { next.add(p, bytes); });
            }
            detail::simd::reconstruct_block<B, T>(
                g, h, b, P, half, v.key_scale(), v.key_zero(), v.value_scale(), v.value_zero(),
                [&](bool keys, const std::uint32_t** rows) {
                  detail::block_plane_rows(v, keys, h, b, P, rows);
                },
                keys_out, values_out, stage_hi, stage_hi + D / 16 * 8, next, bf16_cvt);
          }
          _mm_sfence();  // order any non-temporal stores of the rows before the join
        },
        options.executor);
    return;
  }
#endif
  detail::parallel_for(
      options.threads, g.kv_heads * blocks,
      [&](std::int64_t i0, std::int64_t i1) {
        std::vector<std::uint32_t> codes(static_cast<std::size_t>(tokens_per_word * D));
        std::vector<float> row(static_cast<std::size_t>(D));
        const std::uint32_t* rows[16];
        for (std::int64_t i = i0; i < i1; ++i) {
          const std::int64_t h = i / blocks, b = i % blocks;
          const std::int64_t t0 = b * tokens_per_word,
                             n = std::min<std::int64_t>(tokens_per_word, T_ - t0);
          // keys: per channel parameters of the token's group
          detail::block_plane_rows(v, true, h, b, P, rows);
          detail::unpack_block(rows, P, n, D, codes.data());
          for (std::int64_t t = 0; t < n; ++t) {
            const std::int64_t base = (h * g.key_token_groups() + (t0 + t) / g.key_group) * D;
            const bf16* LYNX_RESTRICT scale = v.key_scale() + base;
            const bf16* LYNX_RESTRICT zero = v.key_zero() + base;
            const std::uint32_t* LYNX_RESTRICT c = codes.data() + t * D;
            float* LYNX_RESTRICT r = row.data();
            for (std::int64_t ch = 0; ch < D; ++ch)
              r[ch] = reconstruct_from_level(
                  static_cast<float>(c[ch] << (B - P)) + half,
                  {static_cast<float>(scale[ch]), static_cast<float>(zero[ch])});
            for (std::int64_t ch = 0; ch < D; ++ch) keys_out(t0 + t, h, ch) = from_float<T>(r[ch]);
          }
          // values: per token parameters of each channel group
          detail::block_plane_rows(v, false, h, b, P, rows);
          detail::unpack_block(rows, P, n, D, codes.data());
          for (std::int64_t t = 0; t < n; ++t) {
            const std::int64_t base = (h * T_ + t0 + t) * VGs;
            const std::uint32_t* LYNX_RESTRICT c = codes.data() + t * D;
            float* LYNX_RESTRICT r = row.data();
            for (std::int64_t grp = 0; grp < VGs; ++grp) {
              const group_params p{static_cast<float>(v.value_scale()[base + grp]),
                                   static_cast<float>(v.value_zero()[base + grp])};
              for (std::int64_t ch = grp * VG; ch < grp * VG + VG; ++ch)
                r[ch] = reconstruct_from_level(static_cast<float>(c[ch] << (B - P)) + half, p);
            }
            for (std::int64_t ch = 0; ch < D; ++ch)
              values_out(t0 + t, h, ch) = from_float<T>(r[ch]);
          }
        }
      },
      options.executor);
}

}  // namespace detail

/// Dequantizes K and V at the view's precision level into the engine's layout.
template <stream_plan_type Plan, int G, kv_element T>
void reconstruct(const bitplane_view<Plan, G, host_space>& v, kv_view<T, host_space> keys_out,
                 kv_view<T, host_space> values_out, const reconstruct_options& options = {}) {
  detail::reconstruct_layer<Plan::bits, T>(v.data(), v.layer, v.level, v.planes(), keys_out,
                                           values_out, options);
}

template <stream_plan_type Plan, int G, kv_element T>
void reconstruct(const bitplane_tensor<Plan, G, host_space>& tensor,
                 kv_view<T, host_space> keys_out, kv_view<T, host_space> values_out,
                 const reconstruct_options& options = {}) {
  reconstruct(tensor.view(), keys_out, values_out, options);
}

}  // namespace lynx

// With lynx::kernels linked, the configurations it ships are compiled there once.
#if defined(LYNX_KERNELS)
#include "lynx/kernels/config.hpp"
#include "lynx/kernels/instances.hpp"
LYNX_KERNELS_FOR_EACH(LYNX_KERNELS_DECLARE_CODEC)
LYNX_KERNELS_CODEC_LAYERS(extern)
#endif
