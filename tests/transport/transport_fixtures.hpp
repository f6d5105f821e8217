// Shared by the transport tests: real encoded layers, and a sender wrapper that
// checks the residual in-flight bound at every post (the only instants at which
// the in-flight byte count grows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include <lynx/planes/codec.hpp>
#include <lynx/transport/concepts.hpp>

namespace lynx::test {

/// `layers` layers of random K/V encoded with Plan; segments(l)[s] is what a transport sends.
template <stream_plan_type Plan>
struct encoded_request {
  kv_shape shape;
  std::vector<encoded_layer<Plan>> layers;

  encoded_request(int layer_count, kv_shape s, std::uint64_t generation = 0, std::uint32_t seed = 1)
      : shape(s) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> k(static_cast<std::size_t>(s.elements())), v(k.size());
    for (int l = 0; l < layer_count; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      encode_options o;
      o.generation = generation;
      layers.push_back(encode<Plan>(token_major<const float>(k.data(), s),
                                    token_major<const float>(v.data(), s),
                                    static_cast<std::uint32_t>(l), o));
    }
  }
  [[nodiscard]] std::span<const std::byte> segment(int layer, int stream) const {
    return layers[static_cast<std::size_t>(layer)].segment(stream);
  }
  [[nodiscard]] std::vector<std::span<const std::byte>> all_segments() const {
    std::vector<std::span<const std::byte>> r;
    for (const auto& l : layers)
      for (int s = 0; s < Plan::streams; ++s) r.push_back(l.segment(s));
    return r;
  }
};

/// Wraps a sender; counts residual bytes posted and not yet final, and
/// records whether that count ever exceeded the window (a lone oversize
/// segment with nothing else in flight is allowed).
template <class Inner>
class window_checking_sender {
 public:
  using clock = typename Inner::clock;

  window_checking_sender(Inner& inner, std::size_t window) : inner_(inner), window_(window) {}
  [[nodiscard]] typename clock::time_point now() const { return inner_.now(); }
  [[nodiscard]] int lane_count() const { return inner_.lane_count(); }

  post_result post(const send_request& r) {
    const post_result p = inner_.post(r);
    if (p.ok() && r.id.stream != 0) {
      const bool alone = in_flight_ == 0;
      in_flight_ += r.bytes.size();
      residual_.emplace(p.ticket, r.bytes.size());
      if (in_flight_ > window_ && !alone) violated_ = true;
      if (in_flight_ > peak_) peak_ = in_flight_;
    }
    if (p.ok()) posted_.push_back(r.id);
    return p;
  }
  std::optional<send_event<clock>> next_event(typename clock::time_point deadline) {
    auto e = inner_.next_event(deadline);
    if (e && e->is_final()) {
      const auto it = residual_.find(e->ticket);
      if (it != residual_.end()) {
        in_flight_ -= it->second;
        residual_.erase(it);
      }
    }
    return e;
  }

  [[nodiscard]] bool violated() const noexcept { return violated_; }
  [[nodiscard]] std::size_t peak() const noexcept { return peak_; }
  [[nodiscard]] const std::vector<segment_id>& posted() const noexcept { return posted_; }

 private:
  Inner& inner_;
  std::size_t window_;
  std::map<send_ticket, std::size_t> residual_;
  std::size_t in_flight_ = 0, peak_ = 0;
  bool violated_ = false;
  std::vector<segment_id> posted_;
};

}  // namespace lynx::test
