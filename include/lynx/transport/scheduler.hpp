// The stream scheduler: sends the segments of a request in the order that
// lets the decode side start early, over any segment_sender.
//
//   1. every layer's anchor (stream 0), in layer order, as soon as submitted;
//   2. then residual streams: stream 1 of all layers in layer order, then
//      stream 2, ... with at most `residual_window_bytes` of residual segments
//      in flight (posted, no final completion yet), so a transport without
//      priorities never has more than a window of residual bytes queued ahead
//      of an anchor posted later (layer-by-layer prefill).
//
// It posts only when completion events free the window, records per segment
// the post / buffer-reusable / delivered times, and reports each segment's
// buffer as releasable only after its final completion (delivered or error).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/transport/concepts.hpp"

namespace lynx {

struct scheduler_options {
  /// Residual bytes (headers included) allowed in flight at once. A residual
  /// segment larger than the window is posted alone, when nothing else is in flight.
  std::size_t residual_window_bytes = std::size_t{64} << 20;
};

/// What the scheduler knows about one segment; times are valid when the
/// matching flag is set.
template <class Clock>
struct segment_record {
  using time_point = typename Clock::time_point;
  segment_id id{};
  std::span<const std::byte> bytes;  // the caller's buffer
  lane_index lane = anchor_lane;
  send_priority priority = 0;
  send_ticket ticket = 0;
  bool posted = false, reusable = false, delivered = false;
  bool released = false;  // final completion seen: the buffer may be freed or reused
  errc status = errc::ok;
  time_point posted_at{}, reusable_at{}, delivered_at{}, final_at{};
  [[nodiscard]] bool is_residual() const noexcept { return id.stream != 0; }
};

template <class Sender>
class stream_scheduler {
  static_assert(check_segment_sender<Sender>(),
                "stream_scheduler: the transport is not a segment_sender");

 public:
  using clock = typename Sender::clock;
  using time_point = typename clock::time_point;
  using record = segment_record<clock>;
  using release_handler = std::function<void(const record&)>;

  explicit stream_scheduler(Sender& sender, scheduler_options options = {})
      : sender_(sender), options_(options) {
    detail::require(
        sender.lane_count() >= 1, errc::invalid_argument,
        "stream_scheduler: the transport has " + std::to_string(sender.lane_count()) + " lanes");
  }
  stream_scheduler(const stream_scheduler&) = delete;
  stream_scheduler& operator=(const stream_scheduler&) = delete;

  /// Called once per segment when its final completion arrives: from then on
  /// the caller may free or reuse that buffer (never before).
  void on_release(release_handler handler) { on_release_ = std::move(handler); }

  /// Adds one segment (header + payload); its header says layer / stream /
  /// generation. The bytes must stay alive and unchanged until released.
  void submit(std::span<const std::byte> segment) {
    const segment_header h = peek_header(segment);
    detail::require(h.magic == segment_magic, errc::bad_magic,
                    "stream_scheduler::submit: not a Lynx segment (magic mismatch)");
    record r;
    r.id = segment_id{h.layer, h.stream, h.generation};
    r.bytes = segment;
    r.lane = lane_for_stream(h.stream, sender_.lane_count());
    r.priority = h.stream;
    const auto key = std::make_tuple(h.stream, h.layer, h.generation);
    detail::require(submitted_.insert(key).second, errc::invalid_argument,
                    "stream_scheduler::submit: " + describe(r.id) + " submitted twice");
    pending_.insert(std::make_tuple(r.id.stream, r.id.layer, records_.size()));
    records_.push_back(r);
  }

  /// Adds all segments of one layer (any order; anchor first is not required).
  void submit_layer(std::span<const std::span<const std::byte>> segments) {
    for (const auto& s : segments) submit(s);
  }

  /// Handles every completion event available now (never waits) and posts
  /// whatever the order and the window allow. Returns the events handled.
  std::size_t progress() {
    pump();
    std::size_t n = 0;
    while (auto e = sender_.next_event(sender_.now())) {
      handle(*e);
      ++n;
      pump();
    }
    return n;
  }

  /// Drives the transfer until every submitted segment has its final
  /// completion, the deadline passes (errc::timeout; buffers not final stay
  /// unreleased), or a send fails (that error, after the posted segments are
  /// final; nothing more is posted).
  errc run(time_point deadline) {
    if (status_ == errc::timeout) status_ = errc::ok;  // an earlier run ran out of time; try again
    pump();
    while (!finished()) {
      auto e = sender_.next_event(deadline);
      if (!e) {
        if (status_ == errc::ok) status_ = errc::timeout;
        return errc::timeout;
      }
      handle(*e);
      pump();
    }
    return status_;
  }

  /// Every submitted segment is final (or, after an error, every posted one).
  [[nodiscard]] bool finished() const noexcept {
    return outstanding_ == 0 && (pending_.empty() || failed());
  }
  [[nodiscard]] bool failed() const noexcept {
    return status_ != errc::ok && status_ != errc::timeout;
  }
  /// ok, or the first error: a send's failure or a run() that timed out.
  [[nodiscard]] errc status() const noexcept { return status_; }
  [[nodiscard]] const std::vector<record>& records() const noexcept { return records_; }
  [[nodiscard]] std::size_t residual_in_flight() const noexcept { return residual_in_flight_; }
  [[nodiscard]] std::size_t peak_residual_in_flight() const noexcept {
    return peak_residual_in_flight_;
  }
  [[nodiscard]] std::size_t outstanding() const noexcept { return outstanding_; }
  [[nodiscard]] const scheduler_options& options() const noexcept { return options_; }

 private:
  // Posts in (stream, layer) order while allowed: anchors always, residuals
  // while the window has room (or nothing is in flight).
  void pump() {
    while (!pending_.empty() && !failed()) {
      const auto [stream, layer, index] = *pending_.begin();
      record& r = records_[index];
      if (stream != 0 && residual_in_flight_ != 0 &&
          residual_in_flight_ + r.bytes.size() > options_.residual_window_bytes)
        return;
      const post_result p = sender_.post(send_request{r.bytes, r.id, r.lane, r.priority});
      pending_.erase(pending_.begin());
      if (!p.ok()) {
        r.status = p.status;
        r.released = true;  // nothing was posted: the transport never reads the buffer
        status_ = p.status;
        if (on_release_) on_release_(r);
        return;
      }
      r.posted = true;
      r.ticket = p.ticket;
      r.posted_at = sender_.now();
      by_ticket_.emplace(p.ticket, index);
      ++outstanding_;
      if (r.is_residual()) {
        residual_in_flight_ += r.bytes.size();
        if (residual_in_flight_ > peak_residual_in_flight_)
          peak_residual_in_flight_ = residual_in_flight_;
      }
    }
  }

  void handle(const send_event<clock>& e) {
    const auto it = by_ticket_.find(e.ticket);
    if (it == by_ticket_.end()) return;  // not ours, or already final
    record& r = records_[it->second];
    if (e.kind == completion_kind::buffer_reusable && e.status == errc::ok) {
      r.reusable = true;
      r.reusable_at = e.at;
    }
    if (!e.is_final()) return;
    if (e.status == errc::ok) {
      r.delivered = true;
      r.delivered_at = e.at;
      if (!r.reusable) {  // a transport may report delivery alone; it implies reusability
        r.reusable = true;
        r.reusable_at = e.at;
      }
    } else {
      r.status = e.status;
      if (!failed()) status_ = e.status;
    }
    r.final_at = e.at;
    r.released = true;
    by_ticket_.erase(it);
    --outstanding_;
    if (r.is_residual()) residual_in_flight_ -= r.bytes.size();
    if (on_release_) on_release_(r);
  }

  Sender& sender_;
  scheduler_options options_;
  std::vector<record> records_;
  std::set<std::tuple<int, std::uint32_t, std::size_t>>
      pending_;  // (stream, layer, record index): posting order
  std::set<std::tuple<int, std::uint32_t, std::uint64_t>> submitted_;
  std::unordered_map<send_ticket, std::size_t> by_ticket_;
  std::size_t outstanding_ = 0;
  std::size_t residual_in_flight_ = 0, peak_residual_in_flight_ = 0;
  errc status_ = errc::ok;
  release_handler on_release_;
};

}  // namespace lynx
