// Transport concepts: what Lynx needs from anything that moves segments
// (in-process loopback, simulated link, UCX, TCP, ...). Lynx never does
// networking itself; it posts segments on lanes and reads completion events.
//
// A segment is a std::span<const std::byte> whose 128-byte header names its
// layer, stream and generation (planes/segment.hpp). A lane is an ordered path
// (an endpoint, a connection, a tag space): lane 0 carries anchors, lane 1 (if
// the transport has one) residuals. A transport with one lane shares it and
// must honour the priority of a send (0 = most urgent) between segments or at a
// chunk granularity. Completion is two events: "buffer reusable" (the transport
// no longer reads the bytes: local completion) and "delivered" (the receiver has
// them: remote completion or an application ack). Only "delivered" or an error
// is final; buffers are released after the final event, never before.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>

#include "lynx/core/error.hpp"
#include "lynx/planes/segment.hpp"

namespace lynx {

// ---------------------------------------------------------------------------
// Vocabulary types shared by every transport.
// ---------------------------------------------------------------------------

/// Index of a lane of a transport, 0 .. lane_count() - 1.
using lane_index = std::uint8_t;
inline constexpr lane_index anchor_lane = 0;
inline constexpr lane_index residual_lane = 1;

/// The lane a stream goes on: anchors on lane 0, residuals on lane 1 when the
/// transport has a second lane, else on the shared lane 0.
constexpr lane_index lane_for_stream(int stream, int lane_count) noexcept {
  return (stream == 0 || lane_count < 2) ? anchor_lane : residual_lane;
}

/// Send priority: 0 is most urgent. The scheduler uses the stream index, so
/// the anchor preempts residual 1, which preempts residual 2.
using send_priority = std::uint8_t;

/// A transport's handle for one posted send; unique per sender, never reused.
using send_ticket = std::uint64_t;

/// Where a one-sided write lands (NIXL, Mooncake, UCX RMA style): a memory
/// region the receiver registered with the transport, named by an opaque key
/// the transport gave out (an rkey, a descriptor handle), and a byte offset in
/// it. The receiver learns of the write by a notification that carries the
/// bytes where they landed, so a receiver over its own slots
/// (lynx::slot_tensor) validates them in place.
struct remote_slot {
  std::uint64_t key = 0;  // 0: none (a two-sided send into the transport's own buffers)
  std::uint64_t offset = 0;
  [[nodiscard]] constexpr bool named() const noexcept { return key != 0; }
};

/// What one post asks for. `bytes` must stay alive and unchanged until the
/// final completion event of the returned ticket.
struct send_request {
  std::span<const std::byte> bytes;  // one whole segment (header + payload)
  segment_id id{};                   // layer / stream / generation, for events and logs
  lane_index lane = anchor_lane;
  send_priority priority = 0;
  remote_slot destination{};  // a one-sided write into this slot; a transport that cannot
                              // write one refuses the post (invalid_argument)
};

/// The answer to a post: a ticket, or an error (peer_failure, transport_failure,
/// invalid_argument for a lane out of range) and no events will follow.
struct post_result {
  errc status = errc::ok;
  send_ticket ticket = 0;
  [[nodiscard]] bool ok() const noexcept { return status == errc::ok; }
};

enum class completion_kind : std::uint8_t {
  buffer_reusable,  // local completion: the transport no longer reads the bytes
  delivered,        // remote completion: the receiver holds the bytes (final)
};

/// A completion event of a send. An event with status != ok is final whatever
/// its kind (transport_failure, peer_failure, timeout inside the transport).
template <class Clock>
struct send_event {
  send_ticket ticket = 0;
  completion_kind kind = completion_kind::delivered;
  errc status = errc::ok;
  typename Clock::time_point at{};
  [[nodiscard]] bool is_final() const noexcept {
    return kind == completion_kind::delivered || status != errc::ok;
  }
};

/// An arrived segment. `bytes` belong to the receiver and stay valid until
/// release(segment) is called on the receiver that returned it.
template <class Clock>
struct received_segment {
  std::span<const std::byte> bytes;
  lane_index lane = anchor_lane;
  typename Clock::time_point arrival{};
  std::uint64_t handle = 0;  // the receiver's token for release()
};

/// The answer to try_receive: status ok with a segment; timeout when nothing
/// arrived by the deadline; peer_failure / transport_failure when the link broke.
template <class Clock>
struct receive_result {
  errc status = errc::ok;
  received_segment<Clock> segment{};
  [[nodiscard]] bool ok() const noexcept { return status == errc::ok; }
};

// ---------------------------------------------------------------------------
// Concepts. Each is small and named, so a failed static_assert names the
// requirement that is missing.
// ---------------------------------------------------------------------------

/// A clock type for deadlines and timestamps: std::chrono::steady_clock, or a
/// transport's own virtual clock (which need not have a static now()).
template <class C>
concept transport_clock = requires {
  typename C::duration;
  typename C::time_point;
  requires std::same_as<typename C::time_point, std::chrono::time_point<C, typename C::duration>>;
};

/// A transport endpoint that tells time: a nested `clock` type and a member
/// `now()`, so deadlines are written in the transport's own time.
template <class T>
concept has_transport_clock = requires(const T& t) {
  typename T::clock;
  requires transport_clock<typename T::clock>;
  { t.now() } -> std::same_as<typename T::clock::time_point>;
};

/// Knows how many lanes it has (at least one).
template <class T>
concept has_lanes = requires(const T& t) {
  { t.lane_count() } -> std::convertible_to<int>;
};

/// Posts a segment on a lane with a priority; returns a ticket or an error.
template <class T>
concept posts_segments = requires(T& t, const send_request& request) {
  { t.post(request) } -> std::same_as<post_result>;
};

/// Yields completion events: the next one, waiting at most until the deadline
/// (std::nullopt when none came by then). Every successful post produces
/// exactly one final event, possibly preceded by a buffer_reusable one.
template <class T>
concept reports_completions = has_transport_clock<T> &&
    requires(T& t, typename T::clock::time_point deadline) {
  { t.next_event(deadline) } -> std::same_as<std::optional<send_event<typename T::clock>>>;
};

/// The sending side of a transport.
template <class T>
concept segment_sender =
    has_transport_clock<T> && has_lanes<T> && posts_segments<T> && reports_completions<T>;

/// Yields arrived segments, waiting at most until the deadline.
template <class T>
concept yields_segments = has_transport_clock<T> &&
    requires(T& t, typename T::clock::time_point deadline) {
  { t.try_receive(deadline) } -> std::same_as<receive_result<typename T::clock>>;
};

/// Gives the bytes of an arrived segment back to the transport.
template <class T>
concept releases_segments = has_transport_clock<T> &&
    requires(T& t, const received_segment<typename T::clock>& segment) {
  { t.release(segment) } -> std::same_as<void>;
};

/// The receiving side of a transport.
template <class T>
concept segment_receiver = has_transport_clock<T> && yields_segments<T> && releases_segments<T>;

/// A non-blocking receive: whatever has arrived by now (timeout when nothing has).
template <segment_receiver R>
receive_result<typename R::clock> poll(R& receiver) {
  return receiver.try_receive(receiver.now());
}

/// Checks a sender type requirement by requirement, so the compiler says which
/// one is missing (use: static_assert(check_segment_sender<T>())).
template <class T>
consteval bool check_segment_sender() {
  static_assert(has_transport_clock<T>,
                "segment_sender: needs a nested `clock` type (duration, time_point) and `now()` "
                "returning clock::time_point");
  static_assert(has_lanes<T>, "segment_sender: needs `int lane_count() const`");
  static_assert(posts_segments<T>, "segment_sender: needs `post_result post(const send_request&)`");
  static_assert(reports_completions<T>,
                "segment_sender: needs `std::optional<send_event<clock>> "
                "next_event(clock::time_point deadline)`");
  return segment_sender<T>;
}

template <class T>
consteval bool check_segment_receiver() {
  static_assert(has_transport_clock<T>,
                "segment_receiver: needs a nested `clock` type (duration, time_point) and `now()` "
                "returning clock::time_point");
  static_assert(
      yields_segments<T>,
      "segment_receiver: needs `receive_result<clock> try_receive(clock::time_point deadline)`");
  static_assert(releases_segments<T>,
                "segment_receiver: needs `void release(const received_segment<clock>&)`");
  return segment_receiver<T>;
}

}  // namespace lynx
