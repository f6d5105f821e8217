// Bounded resources under a receiver that stops reading (issue 32, item 3):
// the stream scheduler over TCP (real sockets on loopback, one process) and
// over the in-process loopback. While the receiver reads nothing, the sender
// keeps taking the scheduler's posts, and what it holds never exceeds the
// request's anchors plus the scheduler's residual window; the scheduler stops
// posting residuals when the window is full and posts again once the receiver
// resumes and its acks free the window; everything then lands bit for bit.
// A receiver's memory for frames still arriving is bounded by what its shape
// implies when tcp_options::max_segment_bytes is the shape's largest segment.
// A flood of small frames is read only as fast as the application takes them.
// Numbers are compared, never durations; every wait has a deadline.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <lynx/planes/codec.hpp>
#include <lynx/planes/tensor.hpp>
#include <lynx/transport/loopback.hpp>
#include <lynx/transport/scheduler.hpp>
#include <lynx/transport/tcp.hpp>

#include "../support/skip.hpp"
#include "net_fixtures.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using plan = lynx::plan_8_4_4;

// 5 blocks of 32 tokens: anchor segment 25,728 bytes, residual 20,608.
constexpr lynx::kv_shape shape{160, 2, 64};
constexpr std::uint32_t seed = 23;
constexpr int layers = 32;          // 823 KB of anchors: more than the sockets below hold
constexpr int window_segments = 3;  // the scheduler's window, in residual segments

clock_type::time_point in(clock_type::duration d) { return clock_type::now() + d; }

std::size_t segment_size(int stream) {
  return lynx::segment_bytes(lynx::make_geometry<plan, 32>(shape), stream);
}

/// The request's layers, and what every bound below is computed from.
struct request {
  std::vector<lynx::encoded_layer<plan>> encoded;
  std::size_t anchor_bytes = 0;  // every anchor segment together
  std::size_t residual = segment_size(1);
  std::size_t window = window_segments * segment_size(1);

  request() {
    for (int l = 0; l < layers; ++l) {
      encoded.push_back(
          lynx::test::encode_layer<plan>(shape, static_cast<std::uint32_t>(l), seed, 0));
      anchor_bytes += encoded.back().segment(0).size();
    }
  }
  [[nodiscard]] std::span<const std::byte> segment(std::uint32_t layer, int stream) const {
    return encoded[layer].segment(stream);
  }
};

template <class Clock>
int posted_residuals(const std::vector<lynx::segment_record<Clock>>& records) {
  return static_cast<int>(std::count_if(records.begin(), records.end(),
                                        [](const auto& r) { return r.posted && r.is_residual(); }));
}

/// The receiving application: checks each segment against the sender's bytes
/// (bitwise) and accepts it into its layer's tensor (which verifies its checksum).
struct receiving_side {
  const request& sent;
  std::vector<lynx::host_bitplane_tensor<plan>> tensors;
  int received = 0, residuals = 0, mismatched = 0;

  explicit receiving_side(const request& r) : sent(r) {
    for (int l = 0; l < layers; ++l) tensors.emplace_back(shape, static_cast<std::uint32_t>(l), 0);
  }
  void take(std::span<const std::byte> bytes) {
    const lynx::segment_header h = lynx::peek_header(bytes);
    REQUIRE(h.layer < static_cast<std::uint32_t>(layers));
    const auto expected = sent.segment(h.layer, h.stream);
    if (bytes.size() != expected.size() ||
        std::memcmp(bytes.data(), expected.data(), bytes.size()) != 0)
      ++mismatched;
    CHECK(tensors[h.layer].accept(bytes) == lynx::accept_result::accepted);
    ++received;
    residuals += h.stream != 0;
  }
  void check_complete() const {
    CHECK(received == 2 * layers);
    CHECK(mismatched == 0);
    CHECK(lynx::test::first_inexact_layer<plan>(tensors, layers, shape, seed) == -1);
  }
};

/// A listener on loopback, or nothing (the case is skipped, saying why) where
/// this machine gives no sockets (a sandbox without a network namespace).
std::optional<lynx::tcp_listener> loopback_listener() {
  try {
    return lynx::tcp_listener("127.0.0.1", 0);
  } catch (const lynx::error& e) {
    lynx_tests::skip_case(std::string("no TCP listener on 127.0.0.1: ") + e.what());
    return std::nullopt;
  }
}

}  // namespace

TEST_CASE(
    "tcp, receiver stops reading: the sender holds at most the anchors plus the residual window; "
    "the scheduler stops at the window and resumes with the receiver; everything lands exactly") {
  ::alarm(60);
  const request req;
  // Bound on what the sender holds queued (posted, not yet in the kernel): every
  // anchor, at most window_segments residuals, and one 24-byte frame header each.
  const std::size_t frame = sizeof(lynx::tcp_wire::frame);
  const std::size_t sender_bound =
      req.anchor_bytes + req.window + (layers + window_segments) * frame;
  CHECK(req.residual * window_segments == req.window);

  for (const int lanes : {2, 1}) {
    CAPTURE(lanes);
    auto listener = loopback_listener();
    if (!listener) return;
    // A send buffer near the kernel's minimum, so the stall reaches the
    // sender's own queue after a few segments. The receiving side keeps a
    // buffer of a few loopback MSS (64 KiB): with less, a window that reopens
    // by under two MSS is not announced and the sender waits for TCP's
    // persist timer (seconds) once the receiver resumes.
    lynx::tcp_options sending, receiving;
    sending.socket_buffer_bytes = 4096;
    receiving.socket_buffer_bytes = 128 << 10;
    auto sender = lynx::tcp_sender::connect("127.0.0.1", listener->port(), in(5s), sending, lanes);
    auto receiver = lynx::tcp_receiver::accept(*listener, in(5s), receiving, lanes);
    lynx::stream_scheduler scheduler(sender, {req.window});

    // Layer-by-layer prefill: half the layers now; the receiver reads nothing.
    for (std::uint32_t l = 0; l < layers / 2; ++l)
      for (int s = 0; s < plan::streams; ++s) scheduler.submit(req.segment(l, s));
    CHECK(scheduler.run(in(50ms)) == lynx::errc::timeout);
    CHECK(posted_residuals(scheduler.records()) == window_segments);
    CHECK(scheduler.residual_in_flight() == req.window);

    // The other half while stalled: the sender still takes every anchor the
    // scheduler posts; no residual goes past the full window.
    for (std::uint32_t l = layers / 2; l < layers; ++l)
      for (int s = 0; s < plan::streams; ++s) scheduler.submit(req.segment(l, s));
    CHECK(scheduler.run(in(100ms)) == lynx::errc::timeout);
    CHECK_FALSE(scheduler.failed());
    CHECK(sender.status() == lynx::errc::ok);
    int anchors_posted = 0;
    for (const auto& r : scheduler.records()) {
      anchors_posted += r.posted && !r.is_residual();
      CHECK_FALSE(r.delivered);  // no ack: the receiver handed nothing out
    }
    CHECK(anchors_posted == layers);
    CHECK(posted_residuals(scheduler.records()) == window_segments);
    CHECK(scheduler.residual_in_flight() == req.window);
    CHECK(scheduler.outstanding() == static_cast<std::size_t>(layers + window_segments));
    CHECK(sender.outstanding() == scheduler.outstanding());
    // The kernel is full (the stall is reached): the rest waits in the sender's
    // queue, within the bound.
    const std::size_t stalled = sender.queued_bytes();
    MESSAGE("lanes ", lanes, ": sender queue while stalled ", stalled, " bytes, bound ",
            sender_bound, " (anchors ", req.anchor_bytes, " + window ", req.window,
            " + frame headers)");
    CHECK(stalled > 0);
    CHECK(stalled <= sender_bound);
    // The receiver, never driven, holds nothing.
    CHECK(receiver.held() == 0);
    CHECK(receiver.body_bytes_in_flight() == 0);

    // The receiver resumes: one segment at a time, each released at once. Its
    // acks free the window and the scheduler posts again; the bounds hold at
    // every step.
    receiving_side app(req);
    std::size_t peak_queued = stalled;
    const auto give_up = in(20s);
    while (app.received < 2 * layers && clock_type::now() < give_up) {
      scheduler.progress();  // acks in, posts out, bytes into the kernel
      peak_queued = std::max(peak_queued, sender.queued_bytes());
      CHECK(scheduler.residual_in_flight() <= req.window);
      const auto r = receiver.try_receive(in(2ms));
      if (r.status == lynx::errc::timeout) continue;
      REQUIRE(r.ok());
      app.take(r.segment.bytes);
      receiver.release(r.segment);
      CHECK(receiver.held() == 0);
    }
    REQUIRE(scheduler.run(in(10s)) == lynx::errc::ok);  // the last acks
    CHECK(scheduler.finished());
    CHECK(posted_residuals(scheduler.records()) == layers);  // posting resumed to the end
    CHECK(scheduler.peak_residual_in_flight() == req.window);
    CHECK(peak_queued <= sender_bound);
    CHECK(sender.queued_bytes() == 0);
    CHECK(sender.outstanding() == 0);
    for (const auto& r : scheduler.records()) CHECK(r.delivered);
    app.check_complete();
  }
}

TEST_CASE(
    "loopback, receiver stops taking segments: the link holds exactly the anchors plus the "
    "residual window; posting resumes as the receiver drains; everything lands exactly") {
  const request req;
  for (const int lanes : {2, 1}) {
    CAPTURE(lanes);
    lynx::loopback_link link(lanes);
    lynx::stream_scheduler scheduler(link.sender(), {req.window});
    for (std::uint32_t l = 0; l < layers; ++l)
      for (int s = 0; s < plan::streams; ++s) scheduler.submit(req.segment(l, s));
    // Nothing is taken: the link copies each post and reports it reusable, but
    // "delivered" only when the receiver takes it, so the window stays full.
    for (int i = 0; i < 4; ++i) scheduler.progress();
    CHECK_FALSE(scheduler.failed());
    CHECK(posted_residuals(scheduler.records()) == window_segments);
    CHECK(scheduler.residual_in_flight() == req.window);
    CHECK(link.queued_bytes() == req.anchor_bytes + req.window);

    // The receiver drains one segment at a time; the link never holds more.
    receiving_side app(req);
    int posts_after_resume = 0;
    for (auto r = lynx::poll(link.receiver()); r.ok(); r = lynx::poll(link.receiver())) {
      app.take(r.segment.bytes);
      link.receiver().release(r.segment);
      const int before = posted_residuals(scheduler.records());
      scheduler.progress();
      posts_after_resume += posted_residuals(scheduler.records()) - before;
      CHECK(scheduler.residual_in_flight() <= req.window);
      CHECK(link.queued_bytes() <= req.anchor_bytes + req.window);
    }
    CHECK(posts_after_resume == layers - window_segments);
    CHECK(scheduler.finished());
    CHECK(scheduler.peak_residual_in_flight() == req.window);
    CHECK(link.queued_bytes() == 0);
    CHECK(link.receiver().held() == 0);
    app.check_complete();
  }
}

TEST_CASE(
    "tcp: with max_segment_bytes the largest segment of the declared shape, a frame header "
    "announcing more is refused before allocation, and a frame in flight holds at most that "
    "segment") {
  ::alarm(60);
  const std::size_t largest = std::max(segment_size(0), segment_size(1));
  lynx::tcp_options options;
  options.max_segment_bytes = largest;
  for (const std::uint64_t announced :
       {std::uint64_t{largest} + 1, std::uint64_t{1} << 29, ~std::uint64_t{0}}) {
    CAPTURE(announced);
    auto listener = loopback_listener();
    if (!listener) return;
    auto raw = lynx::tcp_connect_lanes("127.0.0.1", listener->port(), 2, in(5s));
    auto receiver = lynx::tcp_receiver::accept(*listener, in(5s), options);
    lynx::tcp_wire::frame f;
    f.ticket = 1;
    f.bytes = announced;
    lynx::detail::write_all(raw[0].fd(), &f, sizeof f, in(5s), "frame");
    CHECK(receiver.try_receive(in(5s)).status == lynx::errc::corrupted_segment);
    CHECK(receiver.body_bytes_in_flight() == 0);
  }
  // Frames announcing exactly the largest segment on both lanes, half their
  // bodies sent: what the receiver holds for them is within two such segments.
  auto listener = loopback_listener();
  if (!listener) return;
  auto raw = lynx::tcp_connect_lanes("127.0.0.1", listener->port(), 2, in(5s));
  auto receiver = lynx::tcp_receiver::accept(*listener, in(5s), options);
  const std::vector<std::byte> half(largest / 2, std::byte{3});
  for (auto& lane : raw) {
    lynx::tcp_wire::frame f;
    f.ticket = 1;
    f.bytes = largest;
    lynx::detail::write_all(lane.fd(), &f, sizeof f, in(5s), "frame");
    lynx::detail::write_all(lane.fd(), half.data(), half.size(), in(5s), "body");
  }
  CHECK(receiver.try_receive(in(100ms)).status == lynx::errc::timeout);
  CHECK(receiver.body_bytes_in_flight() > 0);
  CHECK(receiver.body_bytes_in_flight() <= 2 * largest);
  CHECK(receiver.held() == 0);
}

TEST_CASE("tcp: a flood of small frames is read only as fast as segments are handed out") {
  // Frames cost the sender 24 bytes and the receiver a queue entry each: a lane
  // stops reading while max_waiting_segments of its segments wait, so what the
  // receiver holds stays bounded whatever the sender writes.
  ::alarm(60);
  auto listener = loopback_listener();
  if (!listener) return;
  auto raw = lynx::tcp_connect_lanes("127.0.0.1", listener->port(), 1, in(5s));
  auto receiver = lynx::tcp_receiver::accept(*listener, in(5s), {}, 1);
  constexpr int frames = 4000;  // 96,000 bytes: within the loopback socket buffers
  std::vector<lynx::tcp_wire::frame> flood(frames);
  for (int i = 0; i < frames; ++i) {
    flood[static_cast<std::size_t>(i)].ticket = static_cast<std::uint64_t>(i + 1);
    flood[static_cast<std::size_t>(i)].bytes = 1;
  }
  // one body byte after each header
  std::vector<std::byte> wire;
  for (const auto& f : flood) {
    const auto* p = reinterpret_cast<const std::byte*>(&f);
    wire.insert(wire.end(), p, p + sizeof f);
    wire.push_back(std::byte{7});
  }
  lynx::detail::write_all(raw[0].fd(), wire.data(), wire.size(), in(5s), "flood");
  std::size_t most = 0;
  for (int i = 0; i < frames; ++i) {
    const auto r = receiver.try_receive(in(5s));
    REQUIRE(r.status == lynx::errc::ok);
    CHECK(r.segment.bytes.size() == 1);
    receiver.release(r.segment);
    most = std::max(most, receiver.segments_waiting());
  }
  CHECK(most <= lynx::tcp_receiver::max_waiting_segments);
  CHECK(most > 0);  // the flood was there to be read
  CHECK(receiver.segments_waiting() == 0);
}
