// The stream scheduler over the simulated link: anchors of all layers before
// any residual byte, stream order, the residual in-flight bound at every post,
// buffers released only after their final completion, reproducible timelines.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <lynx/planes/tensor.hpp>
#include <lynx/transport/scheduler.hpp>
#include <lynx/transport/simulated_link.hpp>

#include "transport_fixtures.hpp"

namespace {

using namespace std::chrono_literals;
using lynx::virtual_time;

constexpr lynx::kv_shape shape{256, 2, 64};

lynx::simulated_link_options shared_lane(std::size_t chunk) {
  auto o = lynx::simulated_link_options::one_lane(1'000'000'000, 10us);
  o.chunk_bytes = chunk;
  return o;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "all anchors reach the receiver before any residual byte is sent, then streams in order", Plan,
    lynx::plan_8_4_4, lynx::plan_8_2_2_4) {
  const lynx::test::encoded_request<Plan> request(6, shape);
  lynx::simulated_link link(shared_lane(4096));
  const std::size_t window = request.segment(0, 1).size() * 2;
  lynx::test::window_checking_sender checked(link.sender(), window);
  lynx::stream_scheduler scheduler(checked, {window});
  // Submitted residual-first and in reverse layer order: the scheduler reorders.
  auto segments = request.all_segments();
  std::reverse(segments.begin(), segments.end());
  for (const auto s : segments) scheduler.submit(s);
  REQUIRE(scheduler.run(virtual_time(10s)) == lynx::errc::ok);
  CHECK(scheduler.finished());
  CHECK_FALSE(checked.violated());
  CHECK(scheduler.peak_residual_in_flight() <= window);
  CHECK(checked.peak() == scheduler.peak_residual_in_flight());

  // Arrival order: (stream, layer) ascending.
  const auto& log = link.arrivals();
  REQUIRE(log.size() == segments.size());
  for (std::size_t i = 1; i < log.size(); ++i) {
    CAPTURE(i);
    CHECK(std::make_pair(log[i - 1].id.stream, log[i - 1].id.layer) <
          std::make_pair(log[i].id.stream, log[i].id.layer));
  }
  // On the shared lane no residual byte leaves before the last anchor's last byte.
  lynx::virtual_time anchors_sent{}, first_residual_byte = lynx::virtual_time::max();
  for (const auto& a : log) {
    if (a.id.stream == 0)
      anchors_sent = std::max(anchors_sent, a.last_byte_sent);
    else
      first_residual_byte = std::min(first_residual_byte, a.first_byte_sent);
  }
  CHECK(anchors_sent <= first_residual_byte);

  // Every record: posted, reusable, delivered, released, in time order.
  for (const auto& r : scheduler.records()) {
    CHECK(r.released);
    CHECK(r.delivered);
    CHECK(r.posted_at <= r.reusable_at);
    CHECK(r.reusable_at < r.delivered_at);
  }

  // What arrived is what was sent, and completes every layer's tensor.
  std::vector<lynx::host_bitplane_tensor<Plan>> tensors;
  for (int l = 0; l < 6; ++l) tensors.emplace_back(shape, static_cast<std::uint32_t>(l));
  while (true) {
    const auto r = lynx::poll(link.receiver());
    if (!r.ok()) break;
    const auto h = lynx::peek_header(r.segment.bytes);
    CHECK(tensors[h.layer].accept(r.segment.bytes) == lynx::accept_result::accepted);
    link.receiver().release(r.segment);
  }
  for (const auto& t : tensors) CHECK(t.complete());
}

TEST_CASE(
    "the residual window holds at every post, for windows smaller than, equal to and larger than a "
    "segment") {
  const lynx::test::encoded_request<lynx::plan_8_2_2_4> request(8, shape);
  const std::size_t residual = request.segment(0, 1).size();  // stream 1: 2 planes
  const std::size_t largest = request.segment(0, 2).size();   // stream 2: 4 planes
  for (const std::size_t window :
       {std::size_t{1}, residual, largest, residual + largest, 3 * largest, std::size_t{1} << 30}) {
    CAPTURE(window);
    lynx::simulated_link link(lynx::simulated_link_options::two_lanes(1'000'000'000, 10us));
    lynx::test::window_checking_sender checked(link.sender(), window);
    lynx::stream_scheduler scheduler(checked, {window});
    for (const auto s : request.all_segments()) scheduler.submit(s);
    REQUIRE(scheduler.run(virtual_time(10s)) == lynx::errc::ok);
    CHECK_FALSE(checked.violated());
    // An oversize segment goes alone: the bound is the window or the largest segment.
    CHECK(scheduler.peak_residual_in_flight() <= std::max(window, largest));
    if (window < residual) CHECK(scheduler.peak_residual_in_flight() == largest);
    CHECK(checked.posted().size() == request.all_segments().size());
  }
}

TEST_CASE(
    "layer-by-layer prefill: a later anchor waits at most one chunk behind the residual already "
    "flowing") {
  // Layers become ready every 60 us (the prefill's pace; an anchor takes 49 us on
  // the wire, its residual 33 us), so residual bytes are flowing when the next anchor comes.
  const lynx::test::encoded_request<lynx::plan_8_4_4> request(8, shape);
  for (const std::size_t chunk : {std::size_t{4096}, std::size_t{0}}) {
    CAPTURE(chunk);
    lynx::simulated_link link(shared_lane(chunk));
    lynx::stream_scheduler scheduler(link.sender(), {request.segment(0, 1).size()});
    link.on_step([&] { scheduler.progress(); });
    for (int l = 0; l < 8; ++l) {
      link.advance_to(virtual_time(60us * l));
      for (int s = 0; s < 2; ++s) scheduler.submit(request.segment(l, s));
      scheduler.progress();
    }
    REQUIRE(scheduler.run(virtual_time(10s)) == lynx::errc::ok);
    // Wait of each anchor behind anything but earlier anchors.
    lynx::virtual_duration worst{0};
    lynx::virtual_time previous_anchor_done{};
    for (const auto& a : link.arrivals())
      if (a.id.stream == 0) {
        worst = std::max(worst, a.first_byte_sent - std::max(a.posted, previous_anchor_done));
        previous_anchor_done = a.last_byte_sent;
      }
    const auto one_chunk = lynx::simulated_link::wire_time(4096, 1'000'000'000);
    if (chunk != 0)
      CHECK(worst <= one_chunk);
    else
      CHECK(worst > one_chunk);  // without preemption an anchor can wait a whole residual segment
  }
}

TEST_CASE(
    "buffers are released only after their final completion: overwriting them then never corrupts "
    "a delivery") {
  const lynx::test::encoded_request<lynx::plan_8_4_4> request(4, shape);
  // The scheduler sends private copies; on release the test poisons them.
  std::vector<lynx::aligned_buffer> copies;
  for (const auto s : request.all_segments()) {
    copies.emplace_back(s.size());
    std::memcpy(copies.back().data(), s.data(), s.size());
  }
  lynx::simulated_link link(shared_lane(4096));
  lynx::stream_scheduler scheduler(link.sender(), {1});
  int released = 0;
  scheduler.on_release([&](const auto& record) {
    CHECK(record.delivered);
    CHECK(record.final_at == link.now());  // reported at the virtual time of the final event
    std::memset(const_cast<std::byte*>(record.bytes.data()), 0xff, record.bytes.size());
    ++released;
  });
  for (const auto& c : copies) scheduler.submit(c.span());
  REQUIRE(scheduler.run(virtual_time(10s)) == lynx::errc::ok);
  CHECK(released == 8);
  std::vector<lynx::host_bitplane_tensor<lynx::plan_8_4_4>> tensors;
  for (int l = 0; l < 4; ++l) tensors.emplace_back(shape, static_cast<std::uint32_t>(l));
  int accepted = 0;
  for (auto r = lynx::poll(link.receiver()); r.ok(); r = lynx::poll(link.receiver())) {
    const auto h = lynx::peek_header(r.segment.bytes);
    CHECK(std::memcmp(r.segment.bytes.data(),
                      request.segment(static_cast<int>(h.layer), h.stream).data(),
                      r.segment.bytes.size()) == 0);
    tensors[h.layer].accept(r.segment.bytes);
    link.receiver().release(r.segment);
    ++accepted;
  }
  CHECK(accepted == 8);
}

TEST_CASE("timelines are reproducible: the same request twice gives identical logs and records") {
  const lynx::test::encoded_request<lynx::plan_8_2_2_4> request(5, shape);
  const auto once = [&] {
    lynx::simulated_link link(shared_lane(4096));
    lynx::stream_scheduler scheduler(link.sender(), {20'000});
    for (const auto s : request.all_segments()) scheduler.submit(s);
    REQUIRE(scheduler.run(virtual_time(10s)) == lynx::errc::ok);
    std::vector<std::int64_t> times;
    for (const auto& r : scheduler.records())
      for (const auto t : {r.posted_at, r.reusable_at, r.delivered_at})
        times.push_back(t.time_since_epoch().count());
    return std::make_pair(link.arrivals(), times);
  };
  const auto a = once();
  const auto b = once();
  CHECK(a.first == b.first);
  CHECK(a.second == b.second);
  CHECK(a.first.size() == 15);
}

TEST_CASE("the scheduler reports a deadline and a transport failure instead of waiting forever") {
  const lynx::test::encoded_request<lynx::plan_8_4_4> request(4, shape);
  SUBCASE("deadline") {
    lynx::simulated_link link(shared_lane(4096));
    lynx::stream_scheduler scheduler(link.sender(), {1});
    for (const auto s : request.all_segments()) scheduler.submit(s);
    CHECK(scheduler.run(virtual_time(30us)) == lynx::errc::timeout);
    CHECK(link.now() == virtual_time(30us));
    CHECK_FALSE(scheduler.finished());
    // Not final yet: nothing may be released.
    for (const auto& r : scheduler.records())
      if (!r.delivered) CHECK_FALSE(r.released);
    CHECK(scheduler.run(virtual_time(10s)) == lynx::errc::ok);  // resumes
  }
  SUBCASE("peer failure mid-residual") {
    lynx::simulated_link link(shared_lane(4096));
    lynx::stream_scheduler scheduler(link.sender(), {1});
    for (const auto s : request.all_segments()) scheduler.submit(s);
    CHECK(scheduler.run(virtual_time(60us)) == lynx::errc::timeout);
    link.break_link(lynx::errc::peer_failure);
    CHECK(scheduler.run(virtual_time(10s)) == lynx::errc::peer_failure);
    CHECK(scheduler.finished());
    CHECK(scheduler.outstanding() == 0);
    int failed = 0, unposted = 0;
    for (const auto& r : scheduler.records()) {
      if (!r.posted)
        ++unposted;
      else
        CHECK(r.released);
      if (r.status == lynx::errc::peer_failure) ++failed;
    }
    CHECK(failed >= 1);
    CHECK(unposted >= 1);  // nothing is posted after a failure
  }
}

TEST_CASE("submit rejects a segment given twice and bytes that are not a segment") {
  const lynx::test::encoded_request<lynx::plan_8_4_4> request(1, shape);
  lynx::simulated_link link(shared_lane(4096));
  lynx::stream_scheduler scheduler(link.sender());
  scheduler.submit(request.segment(0, 0));
  CHECK_THROWS_AS(scheduler.submit(request.segment(0, 0)), lynx::error);
  std::vector<std::byte> junk(200);
  CHECK_THROWS_AS(scheduler.submit(junk), lynx::error);
  std::vector<std::byte> tiny(10);
  CHECK_THROWS_AS(scheduler.submit(tiny), lynx::error);
}
