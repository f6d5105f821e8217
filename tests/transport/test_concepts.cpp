// The transport concepts: the provided endpoints satisfy them, types missing a
// requirement do not, and lanes map streams as documented.
#include <doctest/doctest.h>

#include <chrono>
#include <optional>

#include <lynx/transport/concepts.hpp>
#include <lynx/transport/loopback.hpp>
#include <lynx/transport/simulated_link.hpp>

namespace {

struct complete_sender {
  using clock = std::chrono::steady_clock;
  clock::time_point now() const { return clock::now(); }
  int lane_count() const { return 1; }
  lynx::post_result post(const lynx::send_request&) { return {}; }
  std::optional<lynx::send_event<clock>> next_event(clock::time_point) { return std::nullopt; }
};

struct sender_without_events {
  using clock = std::chrono::steady_clock;
  clock::time_point now() const { return clock::now(); }
  int lane_count() const { return 1; }
  lynx::post_result post(const lynx::send_request&) { return {}; }
};

struct sender_without_clock {
  int lane_count() const { return 1; }
  lynx::post_result post(const lynx::send_request&) { return {}; }
};

struct receiver_without_release {
  using clock = lynx::virtual_clock;
  clock::time_point now() const { return {}; }
  lynx::receive_result<clock> try_receive(clock::time_point) { return {}; }
};

}  // namespace

static_assert(lynx::segment_sender<complete_sender>);
static_assert(lynx::check_segment_sender<complete_sender>());
static_assert(!lynx::segment_sender<sender_without_events>);
static_assert(lynx::posts_segments<sender_without_events> &&
              !lynx::reports_completions<sender_without_events>);
static_assert(!lynx::segment_sender<sender_without_clock>);
static_assert(!lynx::has_transport_clock<sender_without_clock>);
static_assert(!lynx::segment_receiver<receiver_without_release>);
static_assert(lynx::yields_segments<receiver_without_release> &&
              !lynx::releases_segments<receiver_without_release>);
static_assert(lynx::segment_sender<lynx::loopback_link::sender_endpoint>);
static_assert(lynx::segment_receiver<lynx::loopback_link::receiver_endpoint>);
static_assert(lynx::segment_sender<lynx::simulated_link::sender_endpoint>);
static_assert(lynx::segment_receiver<lynx::simulated_link::receiver_endpoint>);
static_assert(lynx::transport_clock<lynx::virtual_clock> &&
              lynx::transport_clock<std::chrono::steady_clock>);
static_assert(!lynx::segment_sender<lynx::simulated_link::receiver_endpoint>);

TEST_CASE("streams map to lanes: anchors on lane 0, residuals on lane 1 when there is one") {
  CHECK(lynx::lane_for_stream(0, 1) == lynx::anchor_lane);
  CHECK(lynx::lane_for_stream(1, 1) == lynx::anchor_lane);
  CHECK(lynx::lane_for_stream(2, 1) == lynx::anchor_lane);
  CHECK(lynx::lane_for_stream(0, 2) == lynx::anchor_lane);
  CHECK(lynx::lane_for_stream(1, 2) == lynx::residual_lane);
  CHECK(lynx::lane_for_stream(3, 2) == lynx::residual_lane);
}

TEST_CASE("only delivered or an error is a final completion") {
  using event = lynx::send_event<lynx::virtual_clock>;
  CHECK_FALSE(event{1, lynx::completion_kind::buffer_reusable, lynx::errc::ok, {}}.is_final());
  CHECK(event{1, lynx::completion_kind::delivered, lynx::errc::ok, {}}.is_final());
  CHECK(event{1, lynx::completion_kind::buffer_reusable, lynx::errc::transport_failure, {}}
            .is_final());
}

TEST_CASE("posting on a lane the transport does not have is refused") {
  lynx::loopback_link loop(1);
  std::byte b[4]{};
  CHECK(loop.sender().post({b, {}, 1, 0}).status == lynx::errc::invalid_argument);
  lynx::simulated_link sim(
      lynx::simulated_link_options::one_lane(1000, std::chrono::microseconds(1)));
  CHECK(sim.sender().post({b, {}, 1, 0}).status == lynx::errc::invalid_argument);
  CHECK_THROWS_AS(lynx::loopback_link(3), lynx::error);
  CHECK_THROWS_AS(lynx::simulated_link(lynx::simulated_link_options{}), lynx::error);
  CHECK_THROWS_AS(
      lynx::simulated_link(lynx::simulated_link_options::one_lane(0, std::chrono::microseconds(1))),
      lynx::error);
}
