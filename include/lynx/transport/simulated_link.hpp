// A simulated link with a virtual clock: reproducible timelines, no wall clock.
//
// Each lane has a one-way `latency` and sends one segment at a time in chunks
// of `chunk_bytes`; at every chunk boundary it picks the most urgent pending
// segment (lowest priority value, then earliest post), so on one lane an
// anchor posted while a residual is on the wire waits at most one chunk
// (chunk_bytes = 0: whole segments, no preemption).
//
// Two lanes share one rate by default (lane_sharing::shared), as two TCP
// connections share a NIC: while both lanes are busy each moves at half of
// `bytes_per_second`, while one is idle the other has all of it (processor
// sharing; the link is busy at its full rate whenever any lane is). So a Lynx
// run on two lanes and a baseline on one lane see the same total bandwidth.
// lane_sharing::independent makes them two separate paths, each with its own
// full rate (twice the bandwidth of one lane: say so wherever it is used).
//
// Times are integers (picoseconds). Service is counted exactly (in units of
// 1/(2e12) byte, so half of any rate over a whole picosecond is an integer);
// an event happens at the first picosecond at or after the exact moment a
// chunk's last byte is served, and what a lane is served past that moment
// counts toward its next chunk, so chunking never accumulates rounding: a lane
// alone on the link, busy since t0, that has put n bytes on the wire finishes
// them at t0 + ceil(n * 1e12 / bytes_per_second). (Shares change at event
// times, so a lane that goes idle hands its share over up to 1 ps late.)
// For a segment whose last byte leaves at t: buffer_reusable at t, arrival at
// t + latency, delivered (the ack back) at t + 2 * latency.
//
// Time moves only when asked: step() / advance_to(t) / run_until_idle(), or a
// next_event / try_receive that waits (which advances the clock to the next
// event or to its deadline). arrivals() is the log of what arrived when.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/transport/concepts.hpp"

namespace lynx {

/// The simulated link's clock: picoseconds since the link was made. A type
/// only: the time is the link's now(), not a global.
struct virtual_clock {
  using rep = std::int64_t;
  using period = std::pico;
  using duration = std::chrono::duration<rep, period>;
  using time_point = std::chrono::time_point<virtual_clock, duration>;
  static constexpr bool is_steady = true;
};
using virtual_duration = virtual_clock::duration;
using virtual_time = virtual_clock::time_point;

/// Seconds as a double, for printing timelines.
inline double to_seconds(virtual_duration d) { return std::chrono::duration<double>(d).count(); }
inline double to_seconds(virtual_time t) { return to_seconds(t.time_since_epoch()); }

struct simulated_lane {
  std::uint64_t bytes_per_second = 0;  // shared lanes: the link's one rate, the same on each
  virtual_duration latency{0};         // one way
};

/// How two lanes use bandwidth.
enum class lane_sharing : std::uint8_t {
  shared,       ///< one path (a NIC): the busy lanes split one rate equally
  independent,  ///< two paths, each with its own full rate (twice one lane's bandwidth)
};

struct simulated_link_options {
  std::vector<simulated_lane> lanes;  // 1 (strict priority) or 2 (anchor lane, residual lane)
  lane_sharing sharing = lane_sharing::shared;
  std::size_t chunk_bytes = std::size_t{64}
                            << 10;  // preemption granularity; 0: between segments only
  bool keep_bytes =
      true;  // copy delivered bytes for the receiver; false: timeline only (empty spans)

  static simulated_link_options one_lane(std::uint64_t bytes_per_second, virtual_duration latency) {
    return {{{bytes_per_second, latency}}};
  }
  /// Two lanes sharing `bytes_per_second` in total (two connections over one
  /// NIC): the same bandwidth as one_lane(bytes_per_second, latency).
  static simulated_link_options two_lanes(std::uint64_t bytes_per_second,
                                          virtual_duration latency) {
    return {{{bytes_per_second, latency}, {bytes_per_second, latency}}, lane_sharing::shared};
  }
  /// Two separate paths of `bytes_per_second` each: twice the bandwidth of
  /// one_lane(bytes_per_second, latency), so not a fair comparison with it.
  static simulated_link_options two_independent_lanes(std::uint64_t bytes_per_second_each,
                                                      virtual_duration latency) {
    return {{{bytes_per_second_each, latency}, {bytes_per_second_each, latency}},
            lane_sharing::independent};
  }
};

/// One segment's journey on the link.
struct arrival_event {
  segment_id id{};
  send_ticket ticket = 0;
  lane_index lane = 0;
  std::size_t bytes = 0;
  virtual_time posted{}, first_byte_sent{}, last_byte_sent{}, arrived{};
  friend bool operator==(const arrival_event& a, const arrival_event& b) {
    return a.id.layer == b.id.layer && a.id.stream == b.id.stream &&
           a.id.generation == b.id.generation && a.ticket == b.ticket && a.lane == b.lane &&
           a.bytes == b.bytes && a.posted == b.posted && a.first_byte_sent == b.first_byte_sent &&
           a.last_byte_sent == b.last_byte_sent && a.arrived == b.arrived;
  }
};

class simulated_link {
 public:
  using clock = virtual_clock;
  using time_point = virtual_time;

  /// Wire time of n bytes at a lane's bandwidth, rounded up to a picosecond.
  static virtual_duration wire_time(std::uint64_t bytes, std::uint64_t bytes_per_second) {
    __extension__ using wide = unsigned __int128;
    const wide ps =
        (static_cast<wide>(bytes) * 1'000'000'000'000u + bytes_per_second - 1) / bytes_per_second;
    return virtual_duration(static_cast<std::int64_t>(ps));
  }

  class sender_endpoint {
   public:
    using clock = virtual_clock;
    explicit sender_endpoint(simulated_link& link) : link_(&link) {}
    [[nodiscard]] time_point now() const { return link_->now(); }
    [[nodiscard]] int lane_count() const { return link_->lane_count(); }
    post_result post(const send_request& request) { return link_->post(request); }
    std::optional<send_event<clock>> next_event(time_point deadline) {
      return link_->next_event(deadline);
    }

   private:
    simulated_link* link_;
  };

  class receiver_endpoint {
   public:
    using clock = virtual_clock;
    explicit receiver_endpoint(simulated_link& link) : link_(&link) {}
    [[nodiscard]] time_point now() const { return link_->now(); }
    receive_result<clock> try_receive(time_point deadline) { return link_->try_receive(deadline); }
    void release(const received_segment<clock>& segment) { link_->held_.erase(segment.handle); }
    [[nodiscard]] std::size_t held() const { return link_->held_.size(); }

   private:
    simulated_link* link_;
  };

  explicit simulated_link(simulated_link_options options)
      : options_(std::move(options)), sender_(*this), receiver_(*this) {
    detail::require(
        options_.lanes.size() == 1 || options_.lanes.size() == 2, errc::invalid_argument,
        "simulated_link: " + std::to_string(options_.lanes.size()) + " lanes configured (1 or 2)");
    for (std::size_t l = 0; l < options_.lanes.size(); ++l) {
      detail::require(
          options_.lanes[l].bytes_per_second > 0, errc::invalid_argument,
          "simulated_link: lane " + std::to_string(l) + " has a bandwidth of 0 bytes/s");
      detail::require(options_.lanes[l].latency.count() >= 0, errc::invalid_argument,
                      "simulated_link: lane " + std::to_string(l) + " has a negative latency");
    }
    detail::require(
        options_.sharing == lane_sharing::independent ||
            options_.lanes.back().bytes_per_second == options_.lanes.front().bytes_per_second,
        errc::invalid_argument,
        "simulated_link: shared lanes name one rate, but lane 0 has " +
            std::to_string(options_.lanes.front().bytes_per_second) + " bytes/s and lane 1 " +
            std::to_string(options_.lanes.back().bytes_per_second) +
            " (lane_sharing::independent for separate paths)");
    lanes_.resize(options_.lanes.size());
  }
  simulated_link(const simulated_link&) = delete;
  simulated_link& operator=(const simulated_link&) = delete;

  [[nodiscard]] sender_endpoint& sender() noexcept { return sender_; }
  [[nodiscard]] receiver_endpoint& receiver() noexcept { return receiver_; }
  [[nodiscard]] time_point now() const noexcept { return now_; }
  [[nodiscard]] int lane_count() const noexcept { return static_cast<int>(options_.lanes.size()); }
  [[nodiscard]] const simulated_link_options& options() const noexcept { return options_; }

  /// Called after every step of time taken outside the sender's own waits
  /// (advance_to, run_until_idle, a waiting try_receive): a driver hangs its
  /// scheduler's progress() here so posts happen at the virtual time the
  /// window frees, even while the receiver is the one waiting.
  void on_step(std::function<void()> hook) { hook_ = std::move(hook); }

  /// Processes every event at the next event time; returns that time, or
  /// std::nullopt when nothing is pending.
  std::optional<time_point> step() { return step_once(true); }

  /// Processes every event up to and including t; the clock ends at t.
  void advance_to(time_point t) {
    while (!timed_.empty() && timed_.begin()->first.first <= t.time_since_epoch().count())
      step_once(true);
    if (t > now_) now_ = t;
  }

  /// Runs until nothing is pending; returns the time of the last event.
  time_point run_until_idle() {
    while (step_once(true)) {
    }
    return now_;
  }

  [[nodiscard]] bool idle() const noexcept { return timed_.empty(); }

  /// Every arrival so far, in arrival order (what has arrived by now()).
  [[nodiscard]] const std::vector<arrival_event>& arrivals() const noexcept { return log_; }

  /// The arrivals at or before t (t <= now(); advance_to(t) first for a later t).
  [[nodiscard]] std::vector<arrival_event> arrived_by(time_point t) const {
    detail::require(t <= now_, errc::invalid_argument,
                    "simulated_link::arrived_by: time " + std::to_string(to_seconds(t)) +
                        " s is after now() = " + std::to_string(to_seconds(now_)) +
                        " s; advance_to it first");
    std::vector<arrival_event> r;
    for (const auto& a : log_)
      if (a.arrived <= t) r.push_back(a);
    return r;
  }

  /// The peer dies at now(): sends without a final event get one with
  /// `status`, later posts fail with it, the receiver returns it once the
  /// segments that already arrived are drained. Bytes still on the wire are lost.
  void break_link(errc status = errc::peer_failure) {
    detail::require(status != errc::ok, errc::invalid_argument,
                    "simulated_link::break_link: status must be an error");
    broken_ = status;
    timed_.clear();
    // Sends still on the wire, and those that arrived but whose ack had not come back yet.
    for (auto& [ticket, t] : transfers_)
      sender_events_.push_back({ticket, completion_kind::delivered, status, now_});
    for (const send_ticket ticket : pending_acks_)
      sender_events_.push_back({ticket, completion_kind::delivered, status, now_});
    transfers_.clear();
    pending_acks_.clear();
    for (auto& l : lanes_) l = lane_state{};
  }

 private:
  __extension__ typedef __int128 service;  // units of 1/(2e12) byte: exact for half of any rate
  // (a typedef: nvcc's front end takes __extension__ before a typedef, not before a using)
  static constexpr service units_per_byte = 2'000'000'000'000;

  struct ticket_and_chunk {
    send_ticket ticket = 0;
    std::size_t bytes = 0;
  };
  struct transfer {
    send_request request;
    std::uint64_t seq = 0;
    std::size_t remaining = 0;
    bool started = false;
    arrival_event journey;
    aligned_buffer copy;  // the bytes as they left the wire (keep_bytes)
  };
  struct lane_state {
    bool busy = false;
    // Service the current chunk still needs (units); <= 0 once it is done. A
    // chunk served past its end leaves a negative remainder, counted toward
    // the next chunk of the same busy period.
    service left = 0;
    std::optional<std::pair<std::int64_t, std::uint64_t>> due;  // its chunk_done's key in timed_
    ticket_and_chunk current{};
    std::set<std::pair<std::pair<send_priority, std::uint64_t>, send_ticket>>
        pending;  // ((priority, seq), ticket)
  };
  enum class action_kind : std::uint8_t { chunk_done, arrive, sender_event };
  struct action {
    action_kind kind{};
    lane_index lane = 0;
    send_ticket ticket = 0;
    std::size_t chunk = 0;
    send_event<clock> event{};
  };
  struct arrived_segment {
    lane_index lane = 0;
    time_point at{};
    aligned_buffer bytes;
    std::size_t size = 0;
  };

  void schedule(std::int64_t at, action a) {
    timed_.emplace(std::make_pair(at, next_seq_++), std::move(a));
  }

  post_result post(const send_request& request) {
    if (request.destination.named()) return {errc::invalid_argument, 0};  // no one-sided writes
    if (broken_ != errc::ok) return {broken_, 0};
    if (request.lane >= lane_count()) return {errc::invalid_argument, 0};
    const send_ticket ticket = next_ticket_++;
    transfer t;
    t.request = request;
    t.seq = next_seq_++;
    t.remaining = request.bytes.size();
    t.journey.id = request.id;
    t.journey.ticket = ticket;
    t.journey.lane = request.lane;
    t.journey.bytes = request.bytes.size();
    t.journey.posted = now_;
    lanes_[request.lane].pending.insert({{request.priority, t.seq}, ticket});
    transfers_.emplace(ticket, std::move(t));
    if (!lanes_[request.lane].busy) {
      serve_until_now();  // the busy lanes' service so far, at the rate before this lane joins
      start_chunk(request.lane);
      schedule_chunks();  // a lane joined: the shares changed
    }
    return {errc::ok, ticket};
  }

  // Service units per picosecond lane l gets while busy: its own rate, or an
  // equal share of the link's one rate among the busy lanes. 1 byte/s is 2
  // units per picosecond, so a half share is an integer.
  [[nodiscard]] service rate_of(std::size_t l) const {
    const auto full = static_cast<service>(options_.lanes[l].bytes_per_second) * 2;
    if (options_.sharing == lane_sharing::independent) return full;
    service busy = 0;
    for (const auto& lane : lanes_) busy += lane.busy;
    return full / busy;
  }

  // Brings every busy lane's service up to now_ at the shares in force since
  // the last event (they change only at events, after this is called).
  void serve_until_now() {
    const std::int64_t t = now_.time_since_epoch().count();
    const service dt = t - served_at_;
    served_at_ = t;
    if (dt == 0) return;
    for (std::size_t l = 0; l < lanes_.size(); ++l)
      if (lanes_[l].busy) lanes_[l].left -= rate_of(l) * dt;  // the busy set is unchanged here
  }

  // (Re)schedules every busy lane's chunk_done at the first picosecond its
  // chunk is wholly served at the current shares.
  void schedule_chunks() {
    const std::int64_t t = now_.time_since_epoch().count();
    for (std::size_t l = 0; l < lanes_.size(); ++l) {
      lane_state& lane = lanes_[l];
      if (!lane.busy) continue;
      const service rate = rate_of(l);
      const std::int64_t end =
          t + (lane.left <= 0 ? 0 : static_cast<std::int64_t>((lane.left + rate - 1) / rate));
      if (lane.due && lane.due->first == end) continue;
      if (lane.due) timed_.erase(*lane.due);
      action a;
      a.kind = action_kind::chunk_done;
      a.lane = static_cast<lane_index>(l);
      a.ticket = lane.current.ticket;
      a.chunk = lane.current.bytes;
      lane.due = std::make_pair(end, next_seq_);
      schedule(end, std::move(a));
    }
  }

  // Puts the next chunk of the most urgent pending segment on the lane's wire
  // (its chunk_done is scheduled by schedule_chunks).
  void start_chunk(lane_index l) {
    lane_state& lane = lanes_[l];
    if (lane.pending.empty()) {
      lane.busy = false;
      lane.left = 0;  // service past the last chunk's end is not kept across idle time
      return;
    }
    if (!lane.busy) {
      lane.busy = true;
      lane.left = 0;
    }
    const send_ticket ticket = lane.pending.begin()->second;
    transfer& t = transfers_.at(ticket);
    if (!t.started) {
      t.started = true;
      t.journey.first_byte_sent = now_;
    }
    const std::size_t chunk =
        options_.chunk_bytes == 0 ? t.remaining : std::min(options_.chunk_bytes, t.remaining);
    lane.left += static_cast<service>(chunk) * units_per_byte;
    lane.current = {ticket, chunk};
  }

  void chunk_done(const action& a) {
    serve_until_now();
    lanes_[a.lane].due.reset();
    transfer& t = transfers_.at(a.ticket);
    t.remaining -= a.chunk;
    if (t.remaining == 0) {
      lanes_[a.lane].pending.erase({{t.request.priority, t.seq}, a.ticket});
      t.journey.last_byte_sent = now_;
      if (options_.keep_bytes) {  // read the caller's bytes now: after this they are reusable
        t.copy = aligned_buffer(t.request.bytes.size());
        if (!t.request.bytes.empty())
          std::memcpy(t.copy.data(), t.request.bytes.data(), t.request.bytes.size());
      }
      const std::int64_t latency = options_.lanes[a.lane].latency.count();
      const std::int64_t at = now_.time_since_epoch().count();
      action reusable;
      reusable.kind = action_kind::sender_event;
      reusable.event = {a.ticket, completion_kind::buffer_reusable, errc::ok, now_};
      schedule(at, reusable);
      action arrive;
      arrive.kind = action_kind::arrive;
      arrive.lane = a.lane;
      arrive.ticket = a.ticket;
      schedule(at + latency, arrive);
    }
    start_chunk(a.lane);
    schedule_chunks();  // this lane's next chunk, and the others' if it went idle
  }

  void arrive(const action& a) {
    auto it = transfers_.find(a.ticket);
    transfer& t = it->second;
    t.journey.arrived = now_;
    log_.push_back(t.journey);
    arrived_segment s;
    s.lane = a.lane;
    s.at = now_;
    s.size = t.request.bytes.size();
    s.bytes = std::move(t.copy);
    if (!options_.keep_bytes) s.size = 0;
    ready_.push_back(std::move(s));
    action ack;
    ack.kind = action_kind::sender_event;
    ack.event = {a.ticket, completion_kind::delivered, errc::ok,
                 now_ + options_.lanes[a.lane].latency};
    schedule(ack.event.at.time_since_epoch().count(), ack);
    transfers_.erase(it);
    pending_acks_.insert(a.ticket);
  }

  std::optional<time_point> step_once(bool call_hook) {
    if (timed_.empty()) return std::nullopt;
    const std::int64_t t = timed_.begin()->first.first;
    now_ = time_point(virtual_duration(t));
    while (!timed_.empty() && timed_.begin()->first.first == t) {
      const action a = std::move(timed_.begin()->second);
      timed_.erase(timed_.begin());
      switch (a.kind) {
        case action_kind::chunk_done:
          chunk_done(a);
          break;
        case action_kind::arrive:
          arrive(a);
          break;
        case action_kind::sender_event:
          if (a.event.kind == completion_kind::delivered) pending_acks_.erase(a.event.ticket);
          sender_events_.push_back(a.event);
          break;
      }
    }
    if (call_hook && hook_) hook_();
    return now_;
  }

  [[nodiscard]] bool next_before(time_point deadline) const {
    return !timed_.empty() && timed_.begin()->first.first <= deadline.time_since_epoch().count();
  }

  std::optional<send_event<clock>> next_event(time_point deadline) {
    while (sender_events_.empty() && next_before(deadline)) step_once(false);
    if (sender_events_.empty()) {
      if (deadline > now_) now_ = deadline;
      return std::nullopt;
    }
    const send_event<clock> e = sender_events_.front();
    sender_events_.pop_front();
    return e;
  }

  receive_result<clock> try_receive(time_point deadline) {
    while (ready_.empty() && next_before(deadline)) step_once(true);
    if (!ready_.empty()) {
      arrived_segment s = std::move(ready_.front());
      ready_.pop_front();
      const std::uint64_t handle = next_handle_++;
      received_segment<clock> seg{std::span<const std::byte>(s.bytes.data(), s.size), s.lane, s.at,
                                  handle};
      held_.emplace(handle, std::move(s.bytes));
      return {errc::ok, seg};
    }
    if (broken_ != errc::ok) return {broken_, {}};
    if (deadline > now_) now_ = deadline;
    return {errc::timeout, {}};
  }

  simulated_link_options options_;
  sender_endpoint sender_;
  receiver_endpoint receiver_;
  time_point now_{};
  std::vector<lane_state> lanes_;
  std::int64_t served_at_ = 0;  // ps: the busy lanes' `left` counts the service up to here
  std::map<std::pair<std::int64_t, std::uint64_t>, action>
      timed_;                                  // (time ps, seq) -> action: deterministic order
  std::map<send_ticket, transfer> transfers_;  // posted, not yet arrived
  std::set<send_ticket> pending_acks_;         // arrived, delivered event not yet due
  std::deque<send_event<clock>> sender_events_;
  std::deque<arrived_segment> ready_;
  std::map<std::uint64_t, aligned_buffer> held_;
  std::vector<arrival_event> log_;
  send_ticket next_ticket_ = 1;
  std::uint64_t next_seq_ = 0, next_handle_ = 1;
  errc broken_ = errc::ok;
  std::function<void()> hook_;
};

/// Request time on the link's virtual clock (lynx::request_driver's Time): a
/// receive that waits moves the link to its next event, or to the deadline when
/// nothing is due before it; each session step's compute, measured on the
/// steady clock, moves the link on by as much (or by `fixed_step` when set: a
/// deterministic timeline for tests and what-if studies).
struct simulated_time {
  using clock = virtual_clock;
  simulated_link* link;
  std::optional<virtual_duration> fixed_step;

  explicit simulated_time(simulated_link& l, std::optional<virtual_duration> fixed = {})
      : link(&l), fixed_step(fixed) {}

  [[nodiscard]] virtual_time now() const { return link->now(); }
  receive_result<clock> wait(simulated_link::receiver_endpoint& receiver, virtual_time deadline) {
    return receiver.try_receive(deadline);
  }
  void computed(std::chrono::steady_clock::duration measured) {
    link->advance_to(link->now() +
                     fixed_step.value_or(std::chrono::duration_cast<virtual_duration>(measured)));
  }
};

static_assert(check_segment_sender<simulated_link::sender_endpoint>());
static_assert(check_segment_receiver<simulated_link::receiver_endpoint>());

}  // namespace lynx
