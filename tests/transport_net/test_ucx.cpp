// The UCX transport across two real processes on loopback (UCX_TLS=tcp,
// UCX_NET_DEVICES=lo): a whole request through the stream scheduler into
// receiver tensors (merge == quantize, bit for bit), a stale generation and a
// corrupted segment rejected by the tensors, a sender killed mid-residual and a
// receiver killed mid-request (peer_failure within the deadline on the other
// side), residual sends held back until the anchors are delivered. Built only with UCX (target
// lynx::ucx defines LYNX_WITH_UCX). Without it, or where UCX cannot listen on loopback, ctest
// reports the test skipped (exit status 77, support/skip.hpp) and it prints why.
#include <doctest/doctest.h>

#include "../support/skip.hpp"

#if __has_include(<ucp/api/ucp.h>) && defined(LYNX_WITH_UCX)

#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <lynx/transport/ucx.hpp>

#include "net_fixtures.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using plan = lynx::plan_8_4_4;

static_assert(lynx::check_segment_sender<lynx::ucx_sender>());
static_assert(lynx::check_segment_receiver<lynx::ucx_receiver>());

constexpr lynx::kv_shape shape{160, 2, 64};
constexpr std::uint32_t seed = 23;

clock_type::time_point in(clock_type::duration d) { return clock_type::now() + d; }

std::size_t residual_bytes() {
  return lynx::segment_bytes(lynx::make_geometry<plan, 32>(shape), 1);
}

void use_loopback_tcp() {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
}

/// The port travels from the parent (which creates the UCX listener after the
/// fork: UCX state is never forked) to the child through a pipe.
struct port_pipe {
  int fd[2] = {-1, -1};
  port_pipe() { REQUIRE(::pipe(fd) == 0); }
  ~port_pipe() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  void put(std::uint16_t port) const {
    REQUIRE(::write(fd[1], &port, sizeof port) == static_cast<ssize_t>(sizeof port));
  }
  [[nodiscard]] std::optional<std::uint16_t> get(clock_type::time_point deadline) const {
    pollfd p{fd[0], POLLIN, 0};
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
    std::uint16_t port = 0;
    if (::poll(&p, 1, static_cast<int>(std::max<long long>(ms, 0))) != 1) return std::nullopt;
    if (::read(fd[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) return std::nullopt;
    return port;
  }
};

// Every case needs a UCX listener on loopback, so each first asks
// lynx::test::ucx_or_skip() whether UCX can listen here (one forked probe per
// run, net_fixtures.hpp): where it cannot, every case is skipped and ctest
// reports the executable skipped. Where it can, a listener that then fails to
// start is a failure, not a skip.
std::unique_ptr<lynx::ucx_receiver> listen_on_loopback() {
  return std::make_unique<lynx::ucx_receiver>("127.0.0.1", 0);
}

}  // namespace

TEST_CASE(
    "ucx, two processes: every layer through the scheduler; stale and corrupted segments rejected; "
    "merge equals quantize") {
  ::alarm(120);
  if (!lynx::test::ucx_or_skip()) return;
  use_loopback_tcp();
  constexpr int layers = 8;
  constexpr std::uint64_t generation = 9;
  port_pipe pipe;
  lynx::test::child_process sender([&] {
    const auto port = pipe.get(in(20s));
    if (!port) return 3;
    lynx::ucx_sender s("127.0.0.1", *port, in(10s));
    // First the anchor of layer 0 of the previous generation, then the request.
    return lynx::test::send_request<plan>(s, shape, layers, seed, generation, 2 * residual_bytes(),
                                          /*stale_layers=*/1);
  });
  auto receiver = listen_on_loopback();
  pipe.put(receiver->port());
  receiver->accept(in(10s));
  CHECK(receiver->lane_count() == 2);
  std::vector<lynx::host_bitplane_tensor<plan>> tensors;
  for (int l = 0; l < layers; ++l)
    tensors.emplace_back(shape, static_cast<std::uint32_t>(l), generation);
  int stale = 0;
  std::vector<std::uint32_t> anchor_order, residual_order;
  for (int i = 0; i < 2 * layers + 1; ++i) {
    const auto r = receiver->try_receive(in(20s));
    REQUIRE(r.status == lynx::errc::ok);
    const auto a = lynx::test::deliver(tensors, r.segment.bytes, r.segment.lane);
    receiver->release(r.segment);
    if (a.accepted == lynx::errc::stale_generation) {
      ++stale;
      continue;
    }
    CAPTURE(lynx::describe(a.id));
    CHECK(a.accepted == lynx::errc::ok);
    CHECK(a.lane == lynx::lane_for_stream(a.id.stream, 2));
    (a.id.stream == 0 ? anchor_order : residual_order).push_back(a.id.layer);
  }
  CHECK(stale == 1);
  CHECK(sender.wait(in(20s)) == 0);  // every send acked (delivered), reusable first
  CHECK(receiver->try_receive(in(10s)).status == lynx::errc::peer_failure);
  std::vector<std::uint32_t> in_order;
  for (int l = 0; l < layers; ++l) in_order.push_back(static_cast<std::uint32_t>(l));
  CHECK(anchor_order == in_order);
  CHECK(residual_order == in_order);
  // A flipped byte is caught by the checksum after a UCX transfer too.
  {
    auto e = lynx::test::encode_layer<plan>(shape, 0, seed, generation);
    auto bytes = e.segment(1);
    bytes[bytes.size() / 2] = ~bytes[bytes.size() / 2];
    lynx::host_bitplane_tensor<plan> t(shape, 0, generation);
    CHECK_THROWS_AS(t.accept(bytes), lynx::error);
  }
  CHECK(lynx::test::first_inexact_layer<plan>(tensors, layers, shape, seed) == -1);
}

TEST_CASE(
    "ucx, two processes: the sender killed mid-residual is reported as peer_failure within the "
    "deadline") {
  ::alarm(120);
  if (!lynx::test::ucx_or_skip()) return;
  use_loopback_tcp();
  constexpr int layers = 6;
  port_pipe pipe;
  lynx::test::child_process sender([&] {
    const auto port = pipe.get(in(20s));
    if (!port) return 3;
    lynx::ucx_sender s("127.0.0.1", *port, in(10s));
    return lynx::test::send_request<plan>(s, shape, layers, seed, 1, residual_bytes());
  });
  auto receiver = listen_on_loopback();
  pipe.put(receiver->port());
  receiver->accept(in(10s));
  int received = 0, anchors = 0, residuals = 0;
  while (anchors < layers || residuals < 1) {
    const auto r = receiver->try_receive(in(20s));
    REQUIRE(r.status == lynx::errc::ok);
    const auto h = lynx::peek_header(r.segment.bytes);
    (h.stream == 0 ? anchors : residuals)++;
    ++received;
    receiver->release(r.segment);
  }
  sender.kill(SIGKILL);
  CHECK(sender.wait(in(10s)) == 128 + SIGKILL);
  const auto deadline = in(10s);
  lynx::errc status = lynx::errc::ok;
  while (status == lynx::errc::ok) {
    const auto r = receiver->try_receive(deadline);
    status = r.status;
    if (r.ok()) {
      ++received;
      receiver->release(r.segment);
    }
  }
  CHECK(status == lynx::errc::peer_failure);
  CHECK(clock_type::now() < deadline);
  CHECK(received < 2 * layers);
}

TEST_CASE(
    "ucx, two processes: the receiver killed mid-request is reported to the sender's scheduler as "
    "peer_failure") {
  ::alarm(120);
  if (!lynx::test::ucx_or_skip()) return;
  use_loopback_tcp();
  constexpr int layers = 6;
  port_pipe pipe;
  // Here the child is the receiver (the UCX server) and the parent the sender.
  lynx::test::child_process receiver_process([&] {
    std::optional<lynx::ucx_receiver> r;
    r.emplace("127.0.0.1", 0);
    pipe.put(r->port());
    r->accept(in(10s));
    for (int i = 0; i < layers + 1; ++i) {
      const auto got = r->try_receive(in(20s));
      if (!got.ok()) return 1;
      r->release(got.segment);
    }
    // The acks of what was received leave before the process dies; without
    // this the kill can land while they wait behind the reply endpoint's
    // wireup, and the sender then rightly sees nothing delivered.
    if (r->flush_acks(in(10s)) != lynx::errc::ok) return 4;
    ::raise(SIGKILL);
    return 2;
  });
  const auto port = pipe.get(in(20s));
  REQUIRE_MESSAGE(port.has_value(), "the UCX receiver process did not listen (exit "
                                        << receiver_process.wait(in(5s)) << ")");
  std::vector<lynx::encoded_layer<plan>> encoded;
  for (int l = 0; l < layers; ++l)
    encoded.push_back(
        lynx::test::encode_layer<plan>(shape, static_cast<std::uint32_t>(l), seed, 0));
  lynx::ucx_sender sender("127.0.0.1", *port, in(10s));
  lynx::stream_scheduler scheduler(sender, {residual_bytes()});
  for (const auto& e : encoded)
    for (int s = 0; s < plan::streams; ++s) scheduler.submit(e.segment(s));
  const auto deadline = in(15s);
  const lynx::errc status = scheduler.run(deadline);
  CHECK(status == lynx::errc::peer_failure);
  CHECK(clock_type::now() < deadline);
  CHECK(receiver_process.wait(in(10s)) == 128 + SIGKILL);
  CHECK(scheduler.outstanding() == 0);
  int delivered = 0;
  for (const auto& r : scheduler.records()) {
    if (!r.posted) continue;
    CHECK(r.released);
    delivered += r.delivered;
  }
  CHECK(delivered >= 1);
  CHECK(delivered < 2 * layers);
}

TEST_CASE(
    "ucx, two processes: a residual send is handed to UCX only once every anchor posted before it "
    "was delivered (anchor_first_posts)") {
  ::alarm(120);
  if (!lynx::test::ucx_or_skip()) return;
  use_loopback_tcp();
  constexpr int layers = 8;
  constexpr lynx::kv_shape small{32, 1, 64};  // segments of a few KB: sent eagerly
  port_pipe pipe;
  lynx::test::child_process sender([&] {
    const auto port = pipe.get(in(20s));
    if (!port) return 3;
    lynx::ucx_sender s("127.0.0.1", *port, in(10s));
    // A window of every residual: the scheduler posts them all right behind the anchors.
    const std::size_t window =
        layers * lynx::segment_bytes(lynx::make_geometry<plan, 32>(small), 1);
    return lynx::test::send_request<plan>(s, small, layers, seed, 1, window);
  });
  auto receiver = listen_on_loopback();
  pipe.put(receiver->port());
  receiver->accept(in(10s));
  // The last anchor's ack leaves inside the try_receive that hands it out; a
  // residual can only be sent after the sender read it, and it arrives in a
  // later call: after `last_anchor_out`.
  clock_type::time_point last_anchor_out{};
  std::vector<clock_type::time_point> residual_arrivals;
  int anchors = 0;
  for (int i = 0; i < 2 * layers; ++i) {
    const auto r = receiver->try_receive(in(20s));
    REQUIRE(r.status == lynx::errc::ok);
    const auto h = lynx::peek_header(r.segment.bytes);
    if (h.stream == 0) {
      CHECK(residual_arrivals.empty());
      if (++anchors == layers) last_anchor_out = clock_type::now();
      // Whatever the sender has sent by now arrives in the next call's progress.
      if (anchors == 1) std::this_thread::sleep_for(200ms);
    } else {
      residual_arrivals.push_back(r.segment.arrival);
    }
    receiver->release(r.segment);
  }
  REQUIRE(anchors == layers);
  REQUIRE(residual_arrivals.size() == static_cast<std::size_t>(layers));
  for (const auto at : residual_arrivals) CHECK(at > last_anchor_out);
  CHECK(receiver->flush_acks(in(10s)) == lynx::errc::ok);
  CHECK(sender.wait(in(20s)) == 0);  // every send delivered, reusable first
}

#else

TEST_CASE("ucx transport tests") {
  lynx_tests::skip_case(
      "built without UCX (needs <ucp/api/ucp.h> and the lynx::ucx target, which defines "
      "LYNX_WITH_UCX)");
}

#endif
