// The receive side of one request: a model's per-layer receiver tensors, the
// segments routed to them by their headers, and the precision level present
// on every layer (what a decode step may read). Transport-agnostic: whatever
// delivers a segment's bytes (TCP, UCX, loopback, a simulated link) hands them
// to accept().
//
//   std::vector<lynx::bitplane_tensor<Plan>> tensors = ...;  // one per layer, the
//                                                            // request's generation
//   lynx::layer_set<Plan> layers(tensors);
//   const auto r = layers.accept(bytes);   // throws lynx::error on a bad segment
//   if (r.level_rose) session.set_available_level(r.level);
//
// A segment of a layer outside the set, of another generation, damaged,
// truncated or of another shape throws lynx::error naming it, and changes
// nothing; a segment already held is a duplicate and changes nothing either.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"

namespace lynx {

template <stream_plan_type Plan, int G = 32, memory_space Space = host_space>
class layer_set {
 public:
  using plan_type = Plan;
  using tensor_type = bitplane_tensor<Plan, G, Space>;

  /// What one accept did.
  struct outcome {
    segment_id id;  // from the segment's header
    accept_result result = accept_result::accepted;
    int level = 0;            // the level present on every layer now
    bool level_rose = false;  // this segment raised it
  };

  /// tensors[l] receives layer l; the caller owns them (and sets each one's
  /// shape and generation). They must be in layer order.
  explicit layer_set(std::span<tensor_type> tensors) : tensors_(tensors) {
    for (std::size_t l = 0; l < tensors_.size(); ++l)
      if (!(tensors_[l].layer() == static_cast<std::uint32_t>(l)))
        detail::fail(errc::invalid_argument, "layer_set: the tensor at index " + std::to_string(l) +
                                                 " receives layer " +
                                                 std::to_string(tensors_[l].layer()));
    level_ = compute_level();
  }

  /// Routes a segment to its layer's tensor by its header.
  outcome accept(std::span<const std::byte> segment) {
    const segment_header h = peek_header(segment);
    outcome r;
    r.id = {h.layer, static_cast<int>(h.stream), h.generation};
    if (!(h.magic == segment_magic)) detail::fail(errc::bad_magic, "not a Lynx segment");
    if (!(h.layer < tensors_.size()))
      detail::fail(errc::layer_mismatch, "segment of layer " + std::to_string(h.layer) + " for a " +
                                             std::to_string(tensors_.size()) + "-layer model");
    r.result = tensors_[h.layer].accept(segment);
    if (r.result == accept_result::duplicate) {
      ++duplicates_;
    } else {
      ++accepted_;
      const int before = level_;
      level_ = compute_level();
      r.level_rose = level_ > before;
    }
    r.level = level_;
    return r;
  }

  /// The precision level present on every layer (0: some anchor is missing).
  [[nodiscard]] int level() const noexcept { return level_; }
  [[nodiscard]] bool complete() const noexcept { return level_ == Plan::streams; }
  [[nodiscard]] std::size_t layers() const noexcept { return tensors_.size(); }
  /// Segments accepted (new streams) and duplicates seen so far.
  [[nodiscard]] std::int64_t accepted() const noexcept { return accepted_; }
  [[nodiscard]] std::int64_t duplicates() const noexcept { return duplicates_; }

  /// The segments not received yet, layer by layer, stream by stream.
  [[nodiscard]] std::vector<segment_id> missing() const {
    std::vector<segment_id> m;
    for (const tensor_type& t : tensors_)
      for (int s = 0; s < Plan::streams; ++s)
        if (!t.has_stream(s)) m.push_back({t.layer(), s, t.generation()});
    return m;
  }

  [[nodiscard]] tensor_type& operator[](std::size_t layer) { return tensors_[layer]; }
  [[nodiscard]] const tensor_type& operator[](std::size_t layer) const { return tensors_[layer]; }

 private:
  [[nodiscard]] int compute_level() const noexcept {
    int l = tensors_.empty() ? 0 : Plan::streams;
    for (const tensor_type& t : tensors_) l = std::min(l, t.precision_level());
    return l;
  }

  std::span<tensor_type> tensors_;
  int level_ = 0;
  std::int64_t accepted_ = 0, duplicates_ = 0;
};

}  // namespace lynx
