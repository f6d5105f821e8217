// An in-process loopback transport: two endpoints of one link, usable from two
// threads (sender and receiver), a FIFO queue per lane. Delivery is in post
// order per lane; the receiver drains lower lanes first (lane 0, the anchor's,
// before lane 1), so with two lanes an anchor never waits behind a residual.
//
// post() copies the segment into the link (so "buffer reusable" is reported at
// once); "delivered" is reported when the receiver takes the segment. Fault
// injection for tests: a hook may drop, duplicate, reorder, corrupt (flip a
// byte) or truncate any posted segment; break_link() simulates a dead peer.
//
// One-sided writes (the shape of NIXL / Mooncake transfers): the receiver
// registers a memory region (register_region gives its key); a post naming a
// remote_slot in it writes the segment there at once, then queues a
// notification whose bytes are the slot itself (no copy on the receiving
// side). Faults apply to what is written (a corrupted or truncated write, a
// dropped one that writes nothing and never notifies).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/transport/concepts.hpp"

namespace lynx {

enum class fault_kind : std::uint8_t {
  none,
  drop,       // never delivered (the sender sees buffer_reusable, never delivered)
  duplicate,  // delivered twice in a row on its lane (one delivered event)
  reorder,    // jumps ahead of the previous segment still queued on its lane
  corrupt,    // one byte flipped (all 8 bits) at `offset`
  truncate,   // only the first `offset` bytes delivered
};

/// What happens to one posted segment. For corrupt, offset defaults to the
/// middle of the segment; for truncate it is the number of bytes kept.
struct fault {
  fault_kind kind = fault_kind::none;
  std::size_t offset = std::numeric_limits<std::size_t>::max();
};

/// Decides the fault of each post: (request, 0-based index of the post on the link).
using fault_hook = std::function<fault(const send_request&, std::uint64_t post_index)>;

class loopback_link {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

 private:
  struct queued {
    send_ticket ticket = 0;
    lane_index lane = 0;
    aligned_buffer bytes;
    std::size_t size = 0;         // bytes delivered (truncation shortens it)
    std::byte* remote = nullptr;  // a one-sided write: the bytes are here, in a registered region
    [[nodiscard]] const std::byte* data() const {
      return remote != nullptr ? remote : bytes.data();
    }
  };

  struct state {
    std::mutex mutex;
    std::condition_variable arrived;    // receiver waits on this
    std::condition_variable completed;  // sender waits on this
    int lanes = 1;
    std::vector<std::deque<queued>> queues;  // [lane]
    std::deque<send_event<clock>> events;
    std::set<send_ticket> undelivered;     // posted, no final event yet
    std::map<std::uint64_t, queued> held;  // handle -> bytes owned by the receiver until released
    send_ticket next_ticket = 1;
    std::uint64_t next_handle = 1;
    std::uint64_t posts = 0;
    errc broken = errc::ok;
    fault_hook hook;
    std::map<std::uint64_t, std::span<std::byte>> regions;  // key -> registered memory
    std::uint64_t next_key = 1;
  };

 public:
  /// The sending endpoint (a segment_sender).
  class sender_endpoint {
   public:
    using clock = loopback_link::clock;
    explicit sender_endpoint(state& s) : s_(&s) {}
    [[nodiscard]] time_point now() const { return clock::now(); }
    [[nodiscard]] int lane_count() const { return s_->lanes; }

    post_result post(const send_request& request) {
      std::unique_lock lock(s_->mutex);
      if (s_->broken != errc::ok) return {s_->broken, 0};
      if (request.lane >= s_->lanes) return {errc::invalid_argument, 0};
      std::byte* remote = nullptr;
      if (request.destination.named()) {
        const auto region = s_->regions.find(request.destination.key);
        if (region == s_->regions.end() || request.destination.offset > region->second.size() ||
            request.bytes.size() > region->second.size() - request.destination.offset)
          return {errc::invalid_argument, 0};  // no such region, or the write would not fit
        remote = region->second.data() + request.destination.offset;
      }
      const fault f = s_->hook ? s_->hook(request, s_->posts) : fault{};
      ++s_->posts;
      const send_ticket ticket = s_->next_ticket++;
      queued q;
      q.ticket = ticket;
      q.lane = request.lane;
      q.size = request.bytes.size();
      if (remote != nullptr) {  // the one-sided write, as it lands (a dropped one: nothing)
        q.remote = remote;
        if (f.kind == fault_kind::truncate) q.size = f.offset < q.size ? f.offset : q.size;
        if (f.kind != fault_kind::drop && q.size) std::memcpy(remote, request.bytes.data(), q.size);
        if (f.kind == fault_kind::corrupt && q.size) {
          const std::size_t at = f.offset < q.size ? f.offset : q.size / 2;
          remote[at] = ~remote[at];
        }
      } else {
        q.bytes = aligned_buffer(q.size);
        if (q.size) std::memcpy(q.bytes.data(), request.bytes.data(), q.size);
      }
      auto& lane = s_->queues[request.lane];
      switch (f.kind) {
        case fault_kind::none:
          lane.push_back(std::move(q));
          break;
        case fault_kind::drop:
          break;
        case fault_kind::duplicate: {
          queued copy;
          copy.ticket = ticket;
          copy.lane = q.lane;
          copy.size = q.size;
          copy.remote = q.remote;
          if (q.remote == nullptr) copy.bytes = q.bytes;
          lane.push_back(std::move(q));
          lane.push_back(std::move(copy));
          break;
        }
        case fault_kind::reorder:
          lane.insert(lane.empty() ? lane.end() : lane.end() - 1, std::move(q));
          break;
        case fault_kind::corrupt: {
          if (q.size && q.remote == nullptr) {  // (a one-sided write was corrupted as written)
            const std::size_t at = f.offset < q.size ? f.offset : q.size / 2;
            q.bytes.data()[at] = ~q.bytes.data()[at];
          }
          lane.push_back(std::move(q));
          break;
        }
        case fault_kind::truncate:
          q.size = f.offset < q.size ? f.offset : q.size;
          lane.push_back(std::move(q));
          break;
      }
      s_->undelivered.insert(ticket);
      // The bytes were copied: the caller's buffer is reusable now.
      s_->events.push_back({ticket, completion_kind::buffer_reusable, errc::ok, clock::now()});
      lock.unlock();
      s_->arrived.notify_all();
      s_->completed.notify_all();
      return {errc::ok, ticket};
    }

    std::optional<send_event<clock>> next_event(time_point deadline) {
      std::unique_lock lock(s_->mutex);
      if (!s_->completed.wait_until(lock, deadline, [&] { return !s_->events.empty(); }))
        return std::nullopt;
      const send_event<clock> e = s_->events.front();
      s_->events.pop_front();
      return e;
    }

   private:
    state* s_;
  };

  /// The receiving endpoint (a segment_receiver).
  class receiver_endpoint {
   public:
    using clock = loopback_link::clock;
    explicit receiver_endpoint(state& s) : s_(&s) {}
    [[nodiscard]] time_point now() const { return clock::now(); }
    [[nodiscard]] int lane_count() const { return s_->lanes; }

    /// The oldest segment of the lowest non-empty lane; segments queued before
    /// a break are still delivered, then the break's status is returned.
    receive_result<clock> try_receive(time_point deadline) {
      std::unique_lock lock(s_->mutex);
      const auto ready = [&] {
        if (s_->broken != errc::ok) return true;
        for (const auto& q : s_->queues)
          if (!q.empty()) return true;
        return false;
      };
      const bool woke = s_->arrived.wait_until(lock, deadline, ready);
      for (auto& lane : s_->queues) {
        if (lane.empty()) continue;
        queued q = std::move(lane.front());
        lane.pop_front();
        const time_point at = clock::now();
        if (s_->undelivered.erase(q.ticket))
          s_->events.push_back({q.ticket, completion_kind::delivered, errc::ok, at});
        const std::uint64_t handle = s_->next_handle++;
        received_segment<clock> seg{std::span<const std::byte>(q.data(), q.size), q.lane, at,
                                    handle};
        s_->held.emplace(handle, std::move(q));  // the buffer's address is stable across the move
        lock.unlock();
        s_->completed.notify_all();
        return {errc::ok, seg};
      }
      if (woke && s_->broken != errc::ok) return {s_->broken, {}};
      return {errc::timeout, {}};
    }

    void release(const received_segment<clock>& segment) {
      std::lock_guard lock(s_->mutex);
      s_->held.erase(segment.handle);
    }

    /// Segments handed out and not yet released.
    [[nodiscard]] std::size_t held() const {
      std::lock_guard lock(s_->mutex);
      return s_->held.size();
    }

   private:
    state* s_;
  };

  explicit loopback_link(int lanes = 2) : sender_(state_), receiver_(state_) {
    detail::require(lanes == 1 || lanes == 2, errc::invalid_argument,
                    "loopback_link: " + std::to_string(lanes) + " lanes requested (1 or 2)");
    state_.lanes = lanes;
    state_.queues.resize(static_cast<std::size_t>(lanes));
  }
  loopback_link(const loopback_link&) = delete;
  loopback_link& operator=(const loopback_link&) = delete;

  [[nodiscard]] sender_endpoint& sender() noexcept { return sender_; }
  [[nodiscard]] receiver_endpoint& receiver() noexcept { return receiver_; }
  [[nodiscard]] int lane_count() const noexcept { return state_.lanes; }

  /// Bytes the link holds for segments posted and not yet taken by the
  /// receiver (its copies; a one-sided write holds none). It grows only with
  /// what is posted: a receiver that stops taking segments stops the
  /// "delivered" events, so a stream_scheduler stops at its residual window.
  [[nodiscard]] std::size_t queued_bytes() {
    std::lock_guard lock(state_.mutex);
    std::size_t n = 0;
    for (const auto& lane : state_.queues)
      for (const queued& q : lane) n += q.bytes.size();
    return n;
  }

  /// Registers receive memory for one-sided writes; the key names it in a
  /// send_request's remote_slot. The memory must outlive the link's use of it.
  std::uint64_t register_region(std::span<std::byte> region) {
    std::lock_guard lock(state_.mutex);
    const std::uint64_t key = state_.next_key++;
    state_.regions.emplace(key, region);
    return key;
  }

  /// Installs the fault hook (tests); an empty function turns faults off.
  void set_fault_hook(fault_hook hook) {
    std::lock_guard lock(state_.mutex);
    state_.hook = std::move(hook);
  }

  /// The peer died (or the link failed): every send without a final event
  /// gets one with `status`, later posts fail with it, and the receiver
  /// returns it once the segments already queued are drained.
  void break_link(errc status = errc::peer_failure) {
    detail::require(status != errc::ok, errc::invalid_argument,
                    "loopback_link::break_link: status must be an error");
    {
      std::lock_guard lock(state_.mutex);
      state_.broken = status;
      const time_point at = clock::now();
      for (const send_ticket t : state_.undelivered)
        state_.events.push_back({t, completion_kind::delivered, status, at});
      state_.undelivered.clear();
    }
    state_.arrived.notify_all();
    state_.completed.notify_all();
  }

 private:
  state state_;
  sender_endpoint sender_;
  receiver_endpoint receiver_;
};

static_assert(check_segment_sender<loopback_link::sender_endpoint>());
static_assert(check_segment_receiver<loopback_link::receiver_endpoint>());

}  // namespace lynx
