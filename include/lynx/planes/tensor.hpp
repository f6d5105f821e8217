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
#include <cmath>
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

/// Parameter section `section` (0 key scales, 1 key zero points, 2 value scales,
/// 3 value zero points) of the bf16 parameters at `params` (the anchor's payload).
LYNX_HOST_DEVICE const bf16* wire_params(const layer_geometry& g, const std::byte* params,
                                         int section) {
  return reinterpret_cast<const bf16*>(
      params + g.param_section_offset(section, layer_geometry::wire_param_bytes));
}

/// A bit-plane layer's data as a bitplane_view holds it, with the plan and the group
/// sizes only in `geometry` (run-time values): the host attention walks take this,
/// so one compiled walk serves every plan and group size.
struct plane_data {
  layer_geometry geometry{};
  std::array<const std::byte*, max_streams> payload{};

  // The anchor's parameters as they travel (bf16, the front of its payload,
  // layout.hpp), read in place.
  const bf16* key_scale() const { return wire_params(geometry, payload[0], 0); }
  const bf16* key_zero() const { return wire_params(geometry, payload[0], 1); }
  const bf16* value_scale() const { return wire_params(geometry, payload[0], 2); }
  const bf16* value_zero() const { return wire_params(geometry, payload[0], 3); }
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
      (p.end - p.first) * 2);
    f(static_cast<const void*>((keys ? key_zero() : value_zero()) + p.first),
      (p.end - p.first) * 2);
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
  // [stream] -> payload bytes as on the wire (nullptr when absent); the
  // anchor's begins with its bf16 parameters (layout.hpp), read in place
  std::array<const std::byte*, max_streams> payload{};

  /// Planes present: the precision this view reconstructs at.
  LYNX_HOST_DEVICE int planes() const { return geometry.plan.plane_begin(level); }
  /// Key scales [kv_heads][key_token_groups][head_dim], key zero points (the
  /// same), value scales [kv_heads][tokens][value_channel_groups], value zero
  /// points (the same): bf16 values, read where the anchor lies.
  LYNX_HOST_DEVICE const bf16* key_scale() const {
    return detail::wire_params(geometry, payload[0], 0);
  }
  LYNX_HOST_DEVICE const bf16* key_zero() const {
    return detail::wire_params(geometry, payload[0], 1);
  }
  LYNX_HOST_DEVICE const bf16* value_scale() const {
    return detail::wire_params(geometry, payload[0], 2);
  }
  LYNX_HOST_DEVICE const bf16* value_zero() const {
    return detail::wire_params(geometry, payload[0], 3);
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
  detail::plane_data data() const { return {geometry, payload}; }
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

/// Checks the bf16 parameters at the front of an anchor payload, which attention
/// and reconstruction read where they lie. A checksum can be re-sealed by anyone
/// on the path, so the values are checked too: every scale >= 0 and every
/// group's range zero .. zero + scale (2^B - 1) finite, else lynx::error
/// (corrupted_segment) names the layer, the stream, the kv head and the group.
/// stream_ledger::admit runs it only for an anchor the checksum pass found
/// suspect (detail::param_scan), so it is written for the message, not speed.
inline void check_params(const layer_geometry& g, std::uint32_t layer, const std::byte* payload) {
  const float top = static_cast<float>((std::uint32_t{1} << g.plan.bits) - 1u);
  for (int pair = 0; pair < 2; ++pair) {  // keys, values
    const std::int64_t n = g.param_section_params(2 * pair);
    const bf16* scales = wire_params(g, payload, 2 * pair);
    const bf16* zeros = wire_params(g, payload, 2 * pair + 1);
    for (std::int64_t k = 0; k < n; ++k) {
      const float sc = static_cast<float>(scales[k]), z = static_cast<float>(zeros[k]);
      const float hi = z + sc * top;
      if (std::isfinite(hi) && std::isfinite(z) && (scales[k].bits & 0x8000u) == 0u) continue;
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

}  // namespace detail

/// What a receiver tensor knows about its streams, wherever their bytes live:
/// the geometry it expects, which streams are present and their checksums, the
/// generation it belongs to. Host and device tensors derive from it and add
/// only the storage; an engine with its own storage can too: admit() validates
/// a segment (header, checksum, plan, shape, layer, generation, an anchor's
/// scales and zero points; a resend that differs from the copy held is
/// refused) and says which stream it is and
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

  /// Validates a segment (header, checksum, plan, shape, layer, generation; an
  /// anchor's scales and zero points too, scanned in the checksum pass) and
  /// says where it goes; throws lynx::error on any problem. Changes nothing.
  [[nodiscard]] admission admit(std::span<const std::byte> segment) const {
    detail::param_scan scan;
    const segment_header h = validate_segment(segment, geometry_, layer_, &scan);
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
    if (scan.suspect)  // names the group at fault (or finds every range finite after all)
      detail::check_params(geometry_, layer_, segment.data() + segment_header_bytes);
    return {s, h.checksum, present_[s]};
  }
  /// Marks a stream present once its payload is stored.
  void record(const admission& a) noexcept {
    checksum_[a.stream] = a.checksum;
    present_[a.stream] = true;
  }

 protected:
  /// A view at `level` whose stream s payload is payload_of(s) (absent streams: nullptr).
  template <memory_space Space, class PayloadOf>
  [[nodiscard]] bitplane_view<Plan, G, Space> make_view(int level, PayloadOf payload_of) const {
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
      : ledger(shape, layer, generation, value_group) {
    for (int s = 0; s < Plan::streams; ++s)
      storage_[static_cast<std::size_t>(s)] =
          aligned_buffer(static_cast<std::size_t>(this->geometry().payload_bytes(s)));
  }

  /// Validates and stores a segment (header + payload). On any error the tensor
  /// is unchanged and lynx::error says what and where.
  accept_result accept(std::span<const std::byte> segment) {
    const auto a = this->admit(segment);
    if (a.duplicate) return accept_result::duplicate;
    std::memcpy(storage_[a.stream].data(), segment.data() + segment_header_bytes,
                storage_[a.stream].size());
    this->record(a);
    return accept_result::accepted;
  }

  /// View at the current precision level (or a lower one).
  [[nodiscard]] view_type view() const { return view_at(this->precision_level()); }
  [[nodiscard]] view_type view_at(int level) const {
    return this->template make_view<host_space>(level, [&](int s) -> const std::byte* {
      return storage_[static_cast<std::size_t>(s)].data();
    });
  }

 private:
  std::array<aligned_buffer, max_streams> storage_{};
};

template <stream_plan_type Plan, int G = 32>
using host_bitplane_tensor = bitplane_tensor<Plan, G, host_space>;

/// A host receiver tensor over caller-owned segment slots (an engine's
/// registered receive buffers, one per stream, each segment_bytes(geometry, s)
/// long and 64-byte aligned): a transport writes stream s's whole segment
/// (header and payload) into slot(s), then accept_in_place(s) validates it
/// where it lies (header, checksum, parameters) and makes it visible. Planes
/// and parameters are read from the slot, never copied.
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
      : ledger(shape, layer, generation, value_group) {
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
    return this->template make_view<host_space>(level, [&](int s) -> const std::byte* {
      return slots_[static_cast<std::size_t>(s)].data() + segment_header_bytes;
    });
  }

 private:
  // An admitted segment into its slot (copied only when it lies elsewhere).
  accept_result store(const typename ledger::admission& a, std::span<const std::byte> segment) {
    if (a.duplicate) return accept_result::duplicate;
    const auto dst = slots_[a.stream];
    if (segment.data() != dst.data()) std::memcpy(dst.data(), segment.data(), dst.size());
    this->record(a);
    return accept_result::accepted;
  }

  std::array<std::span<std::byte>, max_streams> slots_{};
};

}  // namespace lynx
