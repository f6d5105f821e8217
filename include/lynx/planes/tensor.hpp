// Bit-plane tensors of one layer (K and V together).
//
// bitplane_view<Plan, G, Space>: non-owning, the pointers to each stream's
// payload plus the geometry and the precision level; what attention and
// reconstruction read. bitplane_tensor<Plan, G, host_space>: the receiver-side
// owning tensor. It accepts segments in any order and more than once, validates
// header and checksum before anything becomes visible, and knows its current
// precision level (the number of leading streams present). The device tensor
// lives in backend/cuda/tensor.cuh.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/core/types.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/stream_plan.hpp"

namespace lynx {

namespace detail {

/// A bit-plane layer's data as a bitplane_view holds it, with the plan and the group
/// sizes only in `geometry` (run-time values): the host attention walks take this,
/// so one compiled walk serves every plan and group size.
struct plane_data {
  layer_geometry geometry{};
  std::array<const std::byte*, max_streams> payload{};
  const std::byte* params = nullptr;

  const float* key_scale() const {
    return reinterpret_cast<const float*>(params + geometry.key_scale_offset());
  }
  const float* key_zero() const {
    return reinterpret_cast<const float*>(params + geometry.key_zero_offset());
  }
  const float* value_scale() const {
    return reinterpret_cast<const float*>(params + geometry.value_scale_offset());
  }
  const float* value_zero() const {
    return reinterpret_cast<const float*>(params + geometry.value_zero_offset());
  }
  const std::uint32_t* key_planes(int s) const {
    return reinterpret_cast<const std::uint32_t*>(payload[s] + geometry.key_planes_offset(s));
  }
  const std::uint32_t* value_planes(int s) const {
    return reinterpret_cast<const std::uint32_t*>(payload[s] + geometry.value_planes_offset(s));
  }
  /// bitplane_view::for_each_range.
  template <class F>
  void for_each_range(bool keys, int planes, std::int64_t h, std::int64_t t0, std::int64_t t1,
                      F&& f) const {
    if (t1 <= t0) return;
    const layer_geometry& g = geometry;
    const auto p = keys ? g.key_params_of(h, t0, t1) : g.value_params_of(h, t0, t1);
    f(static_cast<const void*>((keys ? key_scale() : value_scale()) + p.first),
      (p.end - p.first) * 4);
    f(static_cast<const void*>((keys ? key_zero() : value_zero()) + p.first),
      (p.end - p.first) * 4);
    const std::int64_t b0 = t0 / tokens_per_word, b1 = (t1 + tokens_per_word - 1) / tokens_per_word;
    int j = 0;
    for (int st = 0; j < planes; ++st) {  // blocks of a kv head are consecutive in each stream
      const int n = std::min(g.planes_in(st), planes - j);
      const std::uint32_t* base = keys ? key_planes(st) : value_planes(st);
      f(static_cast<const void*>(base + g.word_index(st, h, b0, 0, 0)),
        ((b1 - b0 - 1) * g.planes_in(st) + n) * g.head_dim * 4);
      j += n;
    }
  }
};

}  // namespace detail

/// A non-owning view of a layer's streams at a precision level.
template <stream_plan_type Plan, int G = 32, memory_space Space = host_space>
struct bitplane_view {
  using plan = Plan;
  using space = Space;
  static constexpr int group_size = G;

  layer_geometry geometry{};
  std::uint32_t layer = 0;
  int level = 0;  // streams present as a prefix: 0 (nothing usable) .. Plan::streams
  std::array<const std::byte*, max_streams>
      payload{};  // [stream] -> payload bytes as on the wire (nullptr when absent)
  const std::byte* params = nullptr;  // expanded float parameters (layout.hpp); with the anchor

  /// Planes present: the precision this view reconstructs at.
  LYNX_HOST_DEVICE int planes() const { return geometry.plan.plane_begin(level); }
  LYNX_HOST_DEVICE const float* key_scale() const {
    return reinterpret_cast<const float*>(params + geometry.key_scale_offset());
  }
  LYNX_HOST_DEVICE const float* key_zero() const {
    return reinterpret_cast<const float*>(params + geometry.key_zero_offset());
  }
  LYNX_HOST_DEVICE const float* value_scale() const {
    return reinterpret_cast<const float*>(params + geometry.value_scale_offset());
  }
  LYNX_HOST_DEVICE const float* value_zero() const {
    return reinterpret_cast<const float*>(params + geometry.value_zero_offset());
  }
  /// Key plane words of stream s: [kv_heads][blocks][planes of s][head_dim].
  LYNX_HOST_DEVICE const std::uint32_t* key_planes(int s) const {
    return reinterpret_cast<const std::uint32_t*>(payload[s] + geometry.key_planes_offset(s));
  }
  LYNX_HOST_DEVICE const std::uint32_t* value_planes(int s) const {
    return reinterpret_cast<const std::uint32_t*>(payload[s] + geometry.value_planes_offset(s));
  }
  /// Calls f(pointer, bytes) for each byte range that kv head h's tokens [t0, t1)
  /// occupy at the first `planes` planes, keys or values, in reading order: scales,
  /// zeros, then the plane words of each stream (whole 32-token blocks).
  template <class F>
  void for_each_range(bool keys, int planes, std::int64_t h, std::int64_t t0, std::int64_t t1,
                      F&& f) const {
    data().for_each_range(keys, planes, h, t0, t1, static_cast<F&&>(f));
  }
  /// The view's data without its plan and group size in the type (they are in
  /// geometry): what the host attention walks read, one walk for every plan.
  detail::plane_data data() const { return {geometry, payload, params}; }
  /// The same view at a lower precision level (at most the current one).
  bitplane_view at_level(int l) const {
    detail::require(l >= 1 && l <= level, errc::invalid_argument,
                    "precision level " + std::to_string(l) + " requested, the tensor has " +
                        std::to_string(level) + " stream(s)");
    bitplane_view v = *this;
    v.level = l;
    return v;
  }
};

/// Outcome of delivering a segment to a tensor.
enum class accept_result : std::uint8_t {
  accepted,   // new stream; may have raised the precision level
  duplicate,  // the same segment was already there; nothing changed
};

template <stream_plan_type Plan, int G = 32, memory_space Space = host_space>
class bitplane_tensor;

namespace detail {

/// Checks the bf16 parameters of an anchor payload and expands them to floats
/// into `out` (params_bytes() bytes, the layout of layer_geometry's expanded
/// block). A checksum can be re-sealed by anyone on the path, so the values are
/// checked too: every scale >= 0 and every group's range zero .. zero + scale
/// (2^B - 1) finite, else lynx::error (corrupted_segment) names the layer, the
/// stream, the kv head and the group. `out` may be partly written on error.
inline void expand_params(const layer_geometry& g, std::uint32_t layer, const std::byte* payload,
                          std::byte* out) {
  const float top = static_cast<float>((std::uint32_t{1} << g.plan.bits) - 1u);
  for (int pair = 0; pair < 2; ++pair) {  // keys, values
    const std::int64_t n = g.param_section_params(2 * pair);
    std::uint16_t scale_bits[256], zero_bits[256];
    const std::byte* scale_src = payload + g.param_section_offset(2 * pair, 2);
    const std::byte* zero_src = payload + g.param_section_offset(2 * pair + 1, 2);
    auto* scale_dst = reinterpret_cast<float*>(out + g.param_section_offset(2 * pair, 4));
    auto* zero_dst = reinterpret_cast<float*>(out + g.param_section_offset(2 * pair + 1, 4));
    for (std::int64_t i0 = 0; i0 < n; i0 += 256) {
      const std::int64_t m = std::min<std::int64_t>(256, n - i0);
      std::memcpy(scale_bits, scale_src + 2 * i0, static_cast<std::size_t>(2 * m));
      std::memcpy(zero_bits, zero_src + 2 * i0, static_cast<std::size_t>(2 * m));
      // Branch-free, so that compilers vectorize it: x - x is 0 exactly when x is finite.
      unsigned bad = 0;
      for (std::int64_t i = 0; i < m; ++i) {
        const float sc = bf16_bits_to_float(scale_bits[i]), z = bf16_bits_to_float(zero_bits[i]);
        scale_dst[i0 + i] = sc;
        zero_dst[i0 + i] = z;
        const float hi = z + sc * top;
        bad |= static_cast<unsigned>(!(hi - hi == 0.0f)) | static_cast<unsigned>(!(z - z == 0.0f)) |
               (static_cast<unsigned>(scale_bits[i]) >> 15);
      }
      if (bad == 0u) continue;
      for (std::int64_t i = 0; i < m; ++i) {
        const float sc = scale_dst[i0 + i], z = zero_dst[i0 + i];
        const float hi = z + sc * top;
        if ((hi - hi == 0.0f) && (z - z == 0.0f) && (scale_bits[i] & 0x8000u) == 0u) continue;
        const std::int64_t k = i0 + i;
        std::string where;
        if (pair == 0) {
          const std::int64_t per_head = g.key_token_groups() * g.head_dim;
          where = "key parameters of kv head " + std::to_string(k / per_head) + ", token group " +
                  std::to_string(k % per_head / g.head_dim) + " (tokens from " +
                  std::to_string(k % per_head / g.head_dim * g.key_group) + "), channel " +
                  std::to_string(k % g.head_dim);
        } else {
          const std::int64_t groups = g.value_channel_groups(), per_head = g.tokens * groups;
          where = "value parameters of kv head " + std::to_string(k / per_head) + ", token " +
                  std::to_string(k % per_head / groups) + ", channel group " +
                  std::to_string(k % groups);
        }
        fail(errc::corrupted_segment,
             "segment of layer " + std::to_string(layer) + " stream 0: " + where + " are scale " +
                 std::to_string(sc) + ", zero point " + std::to_string(z) +
                 " (a scale must be >= 0 and the group's range finite); the segment carries a "
                 "valid checksum, so it was corrupted before sealing or forged");
      }
    }
  }
}

}  // namespace detail

/// What a receiver tensor knows about its streams, wherever their bytes live:
/// the geometry it expects, which streams are present and their checksums, the
/// generation it belongs to. Host and device tensors derive from it and add
/// only the storage; an engine with its own storage can too: admit() validates
/// a segment (header, checksum, plan, shape, layer, generation; a resend that
/// differs from the copy held is refused) and says which stream it is and
/// whether it is a duplicate, record() marks it present once its bytes are
/// where the engine reads them.
template <stream_plan_type Plan, int G>
class stream_ledger {
 public:
  stream_ledger(kv_shape shape, std::uint32_t layer, std::uint64_t generation,
                std::int32_t value_group = 0)
      : geometry_(make_geometry<Plan, G>(shape, value_group)),
        layer_(layer),
        generation_(generation) {}

  /// Streams present as a prefix: 0 before the anchor, Plan::streams when complete.
  [[nodiscard]] int precision_level() const noexcept {
    int l = 0;
    while (l < Plan::streams && present_[static_cast<std::size_t>(l)]) ++l;
    return l;
  }
  [[nodiscard]] int planes_present() const noexcept {
    return Plan::planes_at_level(precision_level());
  }
  [[nodiscard]] bool has_stream(int s) const noexcept {
    return s >= 0 && s < Plan::streams && present_[static_cast<std::size_t>(s)];
  }
  [[nodiscard]] bool complete() const noexcept { return precision_level() == Plan::streams; }
  [[nodiscard]] const layer_geometry& geometry() const noexcept { return geometry_; }
  [[nodiscard]] kv_shape shape() const noexcept { return geometry_.shape(); }
  [[nodiscard]] std::uint32_t layer() const noexcept { return layer_; }
  [[nodiscard]] std::uint64_t generation() const noexcept { return generation_; }

  /// Forgets every stream (for reuse by a new request of the same shape).
  void reset(std::uint64_t generation) noexcept {
    generation_ = generation;
    present_ = {};
    checksum_ = {};
  }

 public:
  /// A validated segment, not yet stored.
  struct admission {
    std::size_t stream = 0;
    std::uint64_t checksum = 0;
    bool duplicate = false;
  };

  /// Validates a segment (header, checksum, plan, shape, layer, generation) and
  /// says where it goes; throws lynx::error on any problem. Changes nothing.
  [[nodiscard]] admission admit(std::span<const std::byte> segment) const {
    const segment_header h = validate_segment(segment, geometry_, layer_);
    if (h.generation != generation_)
      detail::fail(errc::stale_generation,
                   "segment of layer " + std::to_string(h.layer) + " stream " +
                       std::to_string(h.stream) + " belongs to generation " +
                       std::to_string(h.generation) + ", the tensor is generation " +
                       std::to_string(generation_));
    const auto s = static_cast<std::size_t>(h.stream);
    if (present_[s] && checksum_[s] != h.checksum)
      detail::fail(errc::corrupted_segment,
                   "segment of layer " + std::to_string(h.layer) + " stream " +
                       std::to_string(h.stream) +
                       " differs from the copy already received (a sender re-encoded the layer?)");
    return {s, h.checksum, present_[s]};
  }
  /// Marks a stream present once its payload is stored.
  void record(const admission& a) noexcept {
    checksum_[a.stream] = a.checksum;
    present_[a.stream] = true;
  }

 protected:
  /// A view at `level` whose stream s payload is payload_of(s) (absent streams:
  /// nullptr) and whose expanded parameters are at `params`.
  template <memory_space Space, class PayloadOf>
  [[nodiscard]] bitplane_view<Plan, G, Space> make_view(int level, PayloadOf payload_of,
                                                        const std::byte* params) const {
    if (level < 0 || level > precision_level())  // per layer per decode step: no message on success
      detail::fail(errc::invalid_argument, "precision level " + std::to_string(level) +
                                               " requested for layer " + std::to_string(layer_) +
                                               ", which has " + std::to_string(precision_level()) +
                                               " stream(s)");
    bitplane_view<Plan, G, Space> v;
    v.geometry = geometry_;
    v.layer = layer_;
    v.level = level;
    for (int s = 0; s < Plan::streams; ++s)
      v.payload[static_cast<std::size_t>(s)] =
          present_[static_cast<std::size_t>(s)] ? payload_of(s) : nullptr;
    v.params = present_[0] ? params : nullptr;
    return v;
  }

 private:
  layer_geometry geometry_;
  std::uint32_t layer_;
  std::uint64_t generation_;
  std::array<bool, max_streams> present_{};
  std::array<std::uint64_t, max_streams> checksum_{};
};

/// Host receiver tensor of one layer.
template <stream_plan_type Plan, int G>
class bitplane_tensor<Plan, G, host_space> : public stream_ledger<Plan, G> {
  using ledger = stream_ledger<Plan, G>;

 public:
  using plan = Plan;
  using space = host_space;
  using view_type = bitplane_view<Plan, G, host_space>;
  static constexpr int group_size = G;

  /// value_group: channels per value group, as the sender's encode_options
  /// (0: min(G, head_dim)); segments of any other geometry are refused.
  bitplane_tensor(kv_shape shape, std::uint32_t layer, std::uint64_t generation = 0,
                  std::int32_t value_group = 0)
      : ledger(shape, layer, generation, value_group),
        params_(static_cast<std::size_t>(this->geometry().params_bytes())) {
    for (int s = 0; s < Plan::streams; ++s)
      storage_[static_cast<std::size_t>(s)] =
          aligned_buffer(static_cast<std::size_t>(this->geometry().payload_bytes(s)));
  }

  /// Validates and stores a segment (header + payload). On any error the tensor
  /// is unchanged and lynx::error says what and where.
  accept_result accept(std::span<const std::byte> segment) {
    const auto a = this->admit(segment);
    if (a.duplicate) return accept_result::duplicate;
    if (a.stream == 0)
      detail::expand_params(this->geometry(), this->layer(), segment.data() + segment_header_bytes,
                            params_.data());
    std::memcpy(storage_[a.stream].data(), segment.data() + segment_header_bytes,
                storage_[a.stream].size());
    this->record(a);
    return accept_result::accepted;
  }

  /// View at the current precision level (or a lower one).
  [[nodiscard]] view_type view() const { return view_at(this->precision_level()); }
  [[nodiscard]] view_type view_at(int level) const {
    return this->template make_view<host_space>(
        level,
        [&](int s) -> const std::byte* { return storage_[static_cast<std::size_t>(s)].data(); },
        params_.data());
  }

 private:
  aligned_buffer params_;  // expanded float parameters, written when the anchor is accepted
  std::array<aligned_buffer, max_streams> storage_{};
};

template <stream_plan_type Plan, int G = 32>
using host_bitplane_tensor = bitplane_tensor<Plan, G, host_space>;

/// A host receiver tensor over caller-owned segment slots (an engine's
/// registered receive buffers, one per stream, each segment_bytes(geometry, s)
/// long and 64-byte aligned): a transport writes stream s's whole segment
/// (header and payload) into slot(s), then accept_in_place(s) validates it
/// where it lies (header, checksum, parameters) and makes it visible. The
/// planes are read from the slot, never copied; the anchor's parameters are
/// expanded into the tensor's own buffer, as bitplane_tensor::accept does.
/// Same refusals as bitplane_tensor (a refused segment changes nothing).
/// A slot must not be written again once its stream is accepted (until reset):
/// attention reads it.
template <stream_plan_type Plan, int G = 32>
class slot_tensor : public stream_ledger<Plan, G> {
  using ledger = stream_ledger<Plan, G>;

 public:
  using plan = Plan;
  using space = host_space;
  using view_type = bitplane_view<Plan, G, host_space>;
  static constexpr int group_size = G;

  slot_tensor(kv_shape shape, std::uint32_t layer, std::uint64_t generation,
              std::span<const std::span<std::byte>> slots, std::int32_t value_group = 0)
      : ledger(shape, layer, generation, value_group),
        params_(static_cast<std::size_t>(this->geometry().params_bytes())) {
    if (!(static_cast<int>(slots.size()) == Plan::streams))
      detail::fail(errc::invalid_argument, "slot_tensor: " + std::to_string(slots.size()) +
                                               " slots for a plan of " +
                                               std::to_string(Plan::streams) + " streams");
    for (int s = 0; s < Plan::streams; ++s) {
      const auto slot = slots[static_cast<std::size_t>(s)];
      const auto need = segment_bytes(this->geometry(), s);
      if (!(slot.size() >= need))
        detail::fail(errc::invalid_argument,
                     "slot_tensor: the slot of stream " + std::to_string(s) + " holds " +
                         std::to_string(slot.size()) + " bytes, its segment needs " +
                         std::to_string(need));
      if (!(reinterpret_cast<std::uintptr_t>(slot.data()) % 64 == 0))
        detail::fail(errc::invalid_argument, "slot_tensor: the slot of stream " +
                                                 std::to_string(s) + " is not 64-byte aligned");
      slots_[static_cast<std::size_t>(s)] = slot.first(need);
    }
  }

  /// Where the transport writes stream s's segment.
  [[nodiscard]] std::span<std::byte> slot(int stream) const {
    if (!(stream >= 0 && stream < Plan::streams))
      detail::fail(errc::invalid_argument, "slot_tensor: no stream " + std::to_string(stream));
    return slots_[static_cast<std::size_t>(stream)];
  }

  /// Validates the segment in slot(stream) where it lies and makes it visible.
  accept_result accept_in_place(int stream) {
    const std::span<const std::byte> segment = slot(stream);
    const auto a = this->admit(segment);
    if (!(a.stream == static_cast<std::size_t>(stream)))
      detail::fail(errc::layer_mismatch,
                   "slot_tensor: the slot of stream " + std::to_string(stream) +
                       " holds a segment of stream " + std::to_string(a.stream));
    return store(a, segment);
  }

  /// A segment delivered elsewhere (a transport without slots): validated,
  /// then copied into its slot. Refused segments leave the slot untouched.
  accept_result accept(std::span<const std::byte> segment) {
    return store(this->admit(segment), segment);
  }

  [[nodiscard]] view_type view() const { return view_at(this->precision_level()); }
  [[nodiscard]] view_type view_at(int level) const {
    return this->template make_view<host_space>(
        level,
        [&](int s) -> const std::byte* {
          return slots_[static_cast<std::size_t>(s)].data() + segment_header_bytes;
        },
        params_.data());
  }

 private:
  // An admitted segment into its slot (copied only when it lies elsewhere); the
  // parameters are checked first, so a refusal leaves the slot untouched.
  accept_result store(const typename ledger::admission& a, std::span<const std::byte> segment) {
    if (a.duplicate) return accept_result::duplicate;
    if (a.stream == 0)
      detail::expand_params(this->geometry(), this->layer(), segment.data() + segment_header_bytes,
                            params_.data());
    const auto dst = slots_[a.stream];
    if (segment.data() != dst.data()) std::memcpy(dst.data(), segment.data(), dst.size());
    this->record(a);
    return accept_result::accepted;
  }

  aligned_buffer params_;
  std::array<std::span<std::byte>, max_streams> slots_{};
};

}  // namespace lynx
