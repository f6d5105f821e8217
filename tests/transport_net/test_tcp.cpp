// The TCP transport across two real processes on loopback: a whole request
// through the stream scheduler into receiver tensors (merge == quantize, bit
// for bit); a sender killed mid-residual and a receiver killed mid-request
// (peer_failure on the other side within its deadline); a relay that flips,
// truncates, duplicates and reorders segments; a stale generation; framing
// errors (absurd length, damaged frame) refused without allocation; deadlines;
// anchor-first writes (no residual byte written while anchor bytes are unsent).
// Every wait has a deadline and every child an alarm().
#include <doctest/doctest.h>

#include <sys/ioctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include <lynx/transport/tcp.hpp>

#include "net_fixtures.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using plan = lynx::plan_8_4_4;

static_assert(lynx::check_segment_sender<lynx::tcp_sender>());
static_assert(lynx::check_segment_receiver<lynx::tcp_receiver>());

constexpr lynx::kv_shape shape{160, 2, 64};  // 5 blocks of 32 tokens; anchor segment 20,608 bytes
constexpr std::uint32_t seed = 11;

clock_type::time_point in(clock_type::duration d) { return clock_type::now() + d; }

// A child receiver's loop: takes n segments, releasing each; 0, or 2 on an error.
int receive_and_release(lynx::tcp_receiver& r, int n) {
  for (int i = 0; i < n; ++i) {
    const auto got = r.try_receive(in(20s));
    if (!got.ok()) return 2;
    r.release(got.segment);
  }
  return 0;
}

std::vector<lynx::host_bitplane_tensor<plan>> make_tensors(int layers, std::uint64_t generation,
                                                           lynx::kv_shape of = shape) {
  std::vector<lynx::host_bitplane_tensor<plan>> t;
  for (int l = 0; l < layers; ++l) t.emplace_back(of, static_cast<std::uint32_t>(l), generation);
  return t;
}

std::size_t residual_bytes() {
  return lynx::segment_bytes(lynx::make_geometry<plan, 32>(shape), 1);
}

// A test relay between a sender and a receiver, one thread per lane and
// direction: frames from the sender are parsed and may be altered; acks from
// the receiver are copied back unchanged.
struct relay_fault {
  enum kind_t { flip_payload, flip_header_size, truncate, duplicate, hold_for_next } kind;
};

class relay {
 public:
  using fault_map = std::map<std::pair<std::uint32_t, int>,
                             relay_fault>;  // (layer, stream) of the current generation

  relay(std::uint16_t receiver_port, fault_map faults, std::uint64_t generation)
      : faults_(std::move(faults)), generation_(generation), receiver_port_(receiver_port) {}
  [[nodiscard]] std::uint16_t port() const { return listener_.port(); }

  void start() {
    thread_ = std::thread([this] { run(); });
  }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  ~relay() { join(); }

 private:
  void run() {
    const auto deadline = in(30s);
    try {
      up_ = lynx::tcp_accept_lanes(listener_, 2, deadline);
      down_ = lynx::tcp_connect_lanes("127.0.0.1", receiver_port_, 2, deadline);
    } catch (const lynx::error&) {
      return;
    }
    std::vector<std::thread> t;
    for (int l = 0; l < 2; ++l) {
      t.emplace_back([this, l, deadline] { forward(l, deadline); });
      t.emplace_back([this, l, deadline] { backward(l, deadline); });
    }
    for (auto& x : t) x.join();
  }

  void send_frame(int lane, lynx::tcp_wire::frame f, const std::vector<std::byte>& body,
                  clock_type::time_point deadline) {
    f.bytes = body.size();
    lynx::detail::write_all(down_[lane].fd(), &f, sizeof f, deadline, "relayed frame");
    lynx::detail::write_all(down_[lane].fd(), body.data(), body.size(), deadline,
                            "relayed segment");
  }

  void forward(int lane, clock_type::time_point deadline) {
    std::optional<std::pair<lynx::tcp_wire::frame, std::vector<std::byte>>> held;
    try {
      while (true) {
        lynx::tcp_wire::frame f;
        lynx::detail::read_all(up_[lane].fd(), &f, sizeof f, deadline, "frame");
        std::vector<std::byte> body(static_cast<std::size_t>(f.bytes));
        lynx::detail::read_all(up_[lane].fd(), body.data(), body.size(), deadline, "segment");
        const lynx::segment_header h = lynx::peek_header(body);
        const auto it =
            h.generation == generation_ ? faults_.find({h.layer, h.stream}) : faults_.end();
        const auto kind = it == faults_.end() ? -1 : static_cast<int>(it->second.kind);
        switch (kind) {
          case relay_fault::flip_payload:
            body[body.size() / 2] = ~body[body.size() / 2];
            break;
          case relay_fault::flip_header_size:
            body[offsetof(lynx::segment_header, payload_bytes)] ^= std::byte{0x40};
            break;
          case relay_fault::truncate:
            body.resize(body.size() - 1);
            break;
          default:
            break;
        }
        if (kind == relay_fault::hold_for_next) {
          held.emplace(f, std::move(body));
          continue;
        }
        send_frame(lane, f, body, deadline);
        if (kind == relay_fault::duplicate) send_frame(lane, f, body, deadline);
        if (held) {
          send_frame(lane, held->first, held->second, deadline);
          held.reset();
        }
      }
    } catch (const lynx::error&) {
      // The sender closed (or died): pass the end on.
      down_[lane].shutdown();
    }
  }

  void backward(int lane, clock_type::time_point deadline) {
    try {
      while (true) {
        lynx::tcp_wire::ack a;
        lynx::detail::read_all(down_[lane].fd(), &a, sizeof a, deadline, "ack");
        lynx::detail::write_all(up_[lane].fd(), &a, sizeof a, deadline, "relayed ack");
      }
    } catch (const lynx::error&) {
      up_[lane].shutdown();
    }
  }

  lynx::tcp_listener listener_;
  fault_map faults_;
  std::uint64_t generation_;
  std::uint16_t receiver_port_;
  std::vector<lynx::tcp_socket> up_, down_;
  std::thread thread_;
};

}  // namespace

TEST_CASE(
    "tcp, two processes: every layer through the scheduler; tensors complete and merge equals "
    "quantize bit for bit") {
  ::alarm(120);
  constexpr int layers = 8;
  lynx::tcp_listener listener;
  const std::uint16_t port = listener.port();
  lynx::test::child_process sender([port] {
    auto s = lynx::tcp_sender::connect("127.0.0.1", port, in(10s));
    return lynx::test::send_request<plan>(s, shape, layers, seed, /*generation=*/3,
                                          /*window=*/2 * residual_bytes());
  });
  REQUIRE(sender.started());
  auto receiver = lynx::tcp_receiver::accept(listener, in(10s));
  CHECK(receiver.lane_count() == 2);
  auto tensors = make_tensors(layers, 3);
  std::vector<lynx::test::arrival> arrivals;
  for (int i = 0; i < 2 * layers; ++i) {
    const auto r = receiver.try_receive(in(20s));
    REQUIRE(r.status == lynx::errc::ok);
    arrivals.push_back(lynx::test::deliver(tensors, r.segment.bytes, r.segment.lane));
    receiver.release(r.segment);
  }
  CHECK(receiver.held() == 0);
  CHECK(sender.wait(in(20s)) ==
        0);  // the sender saw every segment delivered (acked), reusable before delivered
  // The sender is gone: the receiver says so instead of waiting.
  CHECK(receiver.try_receive(in(10s)).status == lynx::errc::peer_failure);

  std::vector<std::uint32_t> anchor_order, residual_order;
  for (const auto& a : arrivals) {
    CAPTURE(lynx::describe(a.id));
    CHECK(a.accepted == lynx::errc::ok);
    CHECK_FALSE(a.duplicate);
    CHECK(a.lane == lynx::lane_for_stream(a.id.stream, 2));
    (a.id.stream == 0 ? anchor_order : residual_order).push_back(a.id.layer);
  }
  // Each lane is in layer order (the scheduler's order; TCP keeps it per connection).
  std::vector<std::uint32_t> in_order(layers);
  for (int l = 0; l < layers; ++l)
    in_order[static_cast<std::size_t>(l)] = static_cast<std::uint32_t>(l);
  CHECK(anchor_order == in_order);
  CHECK(residual_order == in_order);
  CHECK(lynx::test::first_inexact_layer<plan>(tensors, layers, shape, seed) == -1);
}

TEST_CASE(
    "tcp, two processes: the sender killed mid-residual is reported as peer_failure within the "
    "deadline") {
  ::alarm(120);
  constexpr int layers = 6;
  lynx::tcp_listener listener;
  const std::uint16_t port = listener.port();
  // Window of one residual segment: the sender cannot run ahead of the receiver's acks.
  lynx::test::child_process sender([port] {
    auto s = lynx::tcp_sender::connect("127.0.0.1", port, in(10s));
    return lynx::test::send_request<plan>(s, shape, layers, seed, 1, residual_bytes());
  });
  auto receiver = lynx::tcp_receiver::accept(listener, in(10s));
  auto tensors = make_tensors(layers, 1);
  int received = 0, anchors = 0, residuals = 0;
  while (anchors < layers || residuals < 1) {  // every anchor and at least one residual
    const auto r = receiver.try_receive(in(20s));
    REQUIRE(r.status == lynx::errc::ok);
    const auto a = lynx::test::deliver(tensors, r.segment.bytes, r.segment.lane);
    CHECK(a.accepted == lynx::errc::ok);
    residuals += a.id.stream != 0;
    anchors += a.id.stream == 0;
    ++received;
    receiver.release(r.segment);
  }
  sender.kill(SIGKILL);
  CHECK(sender.wait(in(10s)) == 128 + SIGKILL);
  const auto deadline = in(5s);
  lynx::errc status = lynx::errc::ok;
  while (status == lynx::errc::ok) {
    const auto r = receiver.try_receive(deadline);
    status = r.status;
    if (r.ok()) {
      ++received;
      receiver.release(r.segment);
    }
  }
  CHECK(status == lynx::errc::peer_failure);
  CHECK(clock_type::now() < deadline);
  CHECK(received < 2 * layers);                                   // the residual was cut short
  for (const auto& t : tensors) CHECK(t.precision_level() >= 1);  // every anchor had landed
  CHECK(receiver.try_receive(in(1s)).status == lynx::errc::peer_failure);  // and stays failed
}

TEST_CASE(
    "tcp, two processes: the receiver killed mid-request is reported to the sender's scheduler as "
    "peer_failure") {
  ::alarm(120);
  constexpr int layers = 6;
  lynx::tcp_listener listener;  // the sender listens here; the receiver connects
  const std::uint16_t port = listener.port();
  lynx::test::child_process receiver_process([port] {
    auto r = lynx::tcp_receiver::connect("127.0.0.1", port, in(10s));
    for (int i = 0; i < layers + 1; ++i) {
      const auto got = r.try_receive(in(20s));
      if (!got.ok()) return 1;
      r.release(got.segment);
    }
    ::raise(SIGKILL);  // dies with the residual in flight
    return 2;
  });
  auto sender = lynx::tcp_sender::accept(listener, in(10s));
  std::vector<lynx::encoded_layer<plan>> encoded;
  for (int l = 0; l < layers; ++l)
    encoded.push_back(
        lynx::test::encode_layer<plan>(shape, static_cast<std::uint32_t>(l), seed, 0));
  lynx::stream_scheduler scheduler(sender, {residual_bytes()});
  for (const auto& e : encoded)
    for (int s = 0; s < plan::streams; ++s) scheduler.submit(e.segment(s));
  const auto deadline = in(10s);
  const lynx::errc status = scheduler.run(deadline);
  CHECK(status == lynx::errc::peer_failure);
  CHECK(clock_type::now() < deadline);
  CHECK(sender.status() == lynx::errc::peer_failure);
  CHECK(receiver_process.wait(in(10s)) == 128 + SIGKILL);
  CHECK(scheduler.outstanding() == 0);
  int delivered = 0, failed = 0;
  for (const auto& r : scheduler.records()) {
    if (r.posted) CHECK(r.released);  // every posted buffer got its final event
    delivered += r.delivered;
    // A posted send whose ack did not come, or the post refused once the link was gone. (A send
    // whose ack came back before the receiver died counts as delivered even when the other
    // lane's end was read first.)
    failed += !r.delivered && r.status == lynx::errc::peer_failure;
  }
  CHECK(delivered >= 1);  // acks that came back before the receiver died count
  CHECK(delivered < 2 * layers);
  CHECK(failed >= 1);
  CHECK(sender.post({encoded[0].segment(0), {0, 0, 0}, lynx::anchor_lane, 0}).status ==
        lynx::errc::peer_failure);
}

TEST_CASE(
    "tcp through a faulty relay: flipped, truncated, duplicated, reordered and stale segments") {
  ::alarm(120);
  constexpr int layers = 6;
  constexpr std::uint64_t generation = 5;
  lynx::tcp_listener listener;
  relay proxy(listener.port(),
              {{{1, 0}, {relay_fault::duplicate}},
               {{2, 0}, {relay_fault::hold_for_next}},  // (2,0) arrives after (3,0)
               {{3, 1}, {relay_fault::flip_payload}},
               {{4, 0}, {relay_fault::truncate}},
               {{4, 1}, {relay_fault::flip_header_size}}},
              generation);
  const std::uint16_t relay_port = proxy.port();
  lynx::test::child_process sender([relay_port] {
    auto s = lynx::tcp_sender::connect("127.0.0.1", relay_port, in(10s));
    // One stale anchor (generation 4, layer 0) goes first, then the request.
    return lynx::test::send_request<plan>(s, shape, layers, seed, generation, 2 * residual_bytes(),
                                          /*stale_layers=*/1);
  });
  proxy.start();  // after the fork: the child is forked from a single-threaded process
  auto receiver = lynx::tcp_receiver::accept(listener, in(10s));
  auto tensors = make_tensors(layers, generation);
  std::vector<lynx::test::arrival> arrivals;
  constexpr int frames = 2 * layers + 1 /*stale*/ + 1 /*duplicate*/;
  for (int i = 0; i < frames; ++i) {
    const auto r = receiver.try_receive(in(20s));
    REQUIRE(r.status == lynx::errc::ok);
    arrivals.push_back(lynx::test::deliver(tensors, r.segment.bytes, r.segment.lane));
    receiver.release(r.segment);
  }
  // Corrupted and truncated segments were still delivered (the transport's job
  // is bytes; the tensor's is validity), so the sender sees every ack.
  CHECK(sender.wait(in(20s)) == 0);
  CHECK(receiver.try_receive(in(10s)).status ==
        lynx::errc::peer_failure);  // the relay passed the close on
  proxy.join();

  std::map<std::pair<std::uint32_t, int>, std::vector<lynx::errc>> outcome;
  std::vector<std::uint32_t> anchor_order;
  int duplicates = 0, stale = 0;
  for (const auto& a : arrivals) {
    if (a.accepted == lynx::errc::stale_generation) {
      ++stale;
      CHECK(a.id.generation == generation - 1);
      continue;
    }
    duplicates += a.duplicate;
    if (a.lane == lynx::anchor_lane && a.accepted != lynx::errc::truncated_segment)
      anchor_order.push_back(a.id.layer);
    outcome[{a.id.layer, a.id.stream}].push_back(a.accepted);
  }
  CHECK(stale == 1);
  CHECK(duplicates == 1);
  CHECK(anchor_order == std::vector<std::uint32_t>{
                            0, 1, 1, 3, 2, 5});  // duplicate of 1, 2 held behind 3, 4 truncated
  using lynx::errc;
  CHECK(outcome[{0, 0}] == std::vector{errc::ok});
  CHECK(outcome[{1, 0}] == std::vector{errc::ok, errc::ok});
  CHECK(outcome[{3, 1}] == std::vector{errc::corrupted_segment});
  CHECK(outcome[{4, 1}] ==
        std::vector{errc::corrupted_segment});  // its header's size field no longer matches
  // The truncated anchor of layer 4: its header is intact, its payload one byte short.
  int truncated = 0;
  for (const auto& a : arrivals)
    truncated += a.accepted == errc::truncated_segment && a.id.layer == 4 && a.id.stream == 0;
  CHECK(truncated == 1);

  CHECK(tensors[0].precision_level() == 2);
  CHECK(tensors[1].precision_level() == 2);
  CHECK(tensors[2].precision_level() == 2);
  CHECK(tensors[3].precision_level() == 1);  // the corrupted residual never became visible
  CHECK(tensors[4].precision_level() == 0);
  CHECK(tensors[5].precision_level() == 2);
  // The stale segment left layer 0 untouched and the rejected ones left 3 and 4
  // unchanged: re-sending intact copies completes them, and every layer merges
  // to exactly the sender's codes.
  for (const int l : {3, 4}) {
    const auto e =
        lynx::test::encode_layer<plan>(shape, static_cast<std::uint32_t>(l), seed, generation);
    for (int s = 0; s < 2; ++s) (void)tensors[static_cast<std::size_t>(l)].accept(e.segment(s));
  }
  CHECK(lynx::test::first_inexact_layer<plan>(tensors, layers, shape, seed) == -1);
}

TEST_CASE("a frame header is not trusted with memory: the body grows with what arrives") {
  // Found by fuzzing: a header announcing up to the 512 MiB cap allocated that
  // much, per lane, before any body byte came. Now 1 MiB at first, then doubling.
  ::alarm(60);
  lynx::tcp_listener listener;
  auto raw = lynx::tcp_connect_lanes("127.0.0.1", listener.port(), 2, in(5s));
  auto receiver = lynx::tcp_receiver::accept(listener, in(5s));
  lynx::tcp_wire::frame f;
  f.ticket = 1;
  f.bytes = (std::uint64_t{512} << 20) - 1;  // just under the default cap
  lynx::detail::write_all(raw[0].fd(), &f, sizeof f, in(5s), "frame");
  std::vector<std::byte> some(3000, std::byte{1});
  lynx::detail::write_all(raw[0].fd(), some.data(), some.size(), in(5s), "body");
  CHECK(receiver.try_receive(in(300ms)).status == lynx::errc::timeout);
  CHECK(receiver.body_bytes_in_flight() > 0);
  CHECK(receiver.body_bytes_in_flight() <= (std::size_t{1} << 20));
  // A real 5 MiB segment across the growth steps arrives whole and intact.
  lynx::tcp_listener listener2;
  auto sender = lynx::tcp_sender::connect("127.0.0.1", listener2.port(), in(5s));
  auto receiver2 = lynx::tcp_receiver::accept(listener2, in(5s));
  std::vector<std::byte> big(5 << 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::byte>(i * 131 % 251);
  REQUIRE(sender.post({big, {}, lynx::anchor_lane, 0}).ok());
  lynx::receive_result<clock_type> r{lynx::errc::timeout, {}};
  for (int i = 0; i < 200 && !r.ok(); ++i) {
    r = receiver2.try_receive(in(50ms));
    while (sender.next_event(clock_type::now())) {
    }
  }
  REQUIRE(r.ok());
  REQUIRE(r.segment.bytes.size() == big.size());
  CHECK(std::memcmp(r.segment.bytes.data(), big.data(), big.size()) == 0);
  receiver2.release(r.segment);
}

TEST_CASE(
    "tcp framing errors: an absurd length or a damaged frame header is refused before any "
    "allocation") {
  ::alarm(60);
  for (const bool damaged_magic : {false, true}) {
    CAPTURE(damaged_magic);
    lynx::tcp_listener listener;
    lynx::tcp_options options;
    options.max_segment_bytes = 1 << 20;
    auto raw = lynx::tcp_connect_lanes("127.0.0.1", listener.port(), 2, in(5s));
    auto receiver = lynx::tcp_receiver::accept(listener, in(5s), options);
    lynx::tcp_wire::frame f;
    f.ticket = 1;
    f.bytes = damaged_magic ? 64 : std::uint64_t{1} << 40;  // 1 TiB announced
    if (damaged_magic) f.magic ^= 0x100u;
    lynx::detail::write_all(raw[1].fd(), &f, sizeof f, in(5s), "frame");
    const auto deadline = in(5s);
    CHECK(receiver.try_receive(deadline).status == lynx::errc::corrupted_segment);
    CHECK(clock_type::now() < deadline);
    CHECK_FALSE(receiver.last_error().empty());
    // The stream position is lost: the link is failed from now on, and the
    // connector sees it closed rather than waiting for acks.
    CHECK(receiver.try_receive(in(1s)).status == lynx::errc::transport_failure);
    char byte = 0;
    REQUIRE(lynx::detail::wait_fd(raw[0].fd(), POLLIN, in(5s)));
    CHECK(::recv(raw[0].fd(), &byte, 1, 0) == 0);
  }
  // Just over a configured cap is refused too; at the cap it is accepted.
  lynx::tcp_listener listener;
  lynx::tcp_options options;
  options.max_segment_bytes = 4096;
  auto sender = lynx::tcp_sender::connect("127.0.0.1", listener.port(), in(5s), options);
  auto receiver = lynx::tcp_receiver::accept(listener, in(5s), options);
  std::vector<std::byte> at_cap(4096, std::byte{7}), over(4097, std::byte{7});
  REQUIRE(sender.post({at_cap, {}, lynx::anchor_lane, 0}).ok());
  const auto r = receiver.try_receive(in(5s));
  REQUIRE(r.ok());
  CHECK(r.segment.bytes.size() == 4096);
  receiver.release(r.segment);
  REQUIRE(sender.post({over, {}, lynx::anchor_lane, 0}).ok());
  CHECK(receiver.try_receive(in(5s)).status == lynx::errc::corrupted_segment);
}

TEST_CASE(
    "tcp deadlines fire on an idle link; events in order reusable then delivered; lane out of "
    "range refused") {
  ::alarm(60);
  lynx::tcp_listener listener;
  auto sender = lynx::tcp_sender::connect("127.0.0.1", listener.port(), in(5s));
  auto receiver = lynx::tcp_receiver::accept(listener, in(5s));
  auto deadline = in(50ms);
  CHECK(receiver.try_receive(deadline).status == lynx::errc::timeout);
  CHECK(clock_type::now() >= deadline);
  deadline = in(30ms);
  CHECK_FALSE(sender.next_event(deadline).has_value());
  CHECK(clock_type::now() >= deadline);
  CHECK(lynx::poll(receiver).status == lynx::errc::timeout);

  std::vector<std::byte> bytes(1000, std::byte{1});
  CHECK(sender.post({bytes, {}, 2, 0}).status == lynx::errc::invalid_argument);
  const auto p = sender.post({bytes, {}, lynx::residual_lane, 1});
  REQUIRE(p.ok());
  const auto e1 = sender.next_event(in(5s));
  REQUIRE(e1.has_value());
  CHECK(e1->ticket == p.ticket);
  CHECK(e1->kind == lynx::completion_kind::buffer_reusable);
  // Not delivered until the receiver takes it.
  CHECK_FALSE(sender.next_event(in(50ms)).has_value());
  const auto r = receiver.try_receive(in(5s));
  REQUIRE(r.ok());
  CHECK(r.segment.lane == lynx::residual_lane);
  const auto e2 = sender.next_event(in(5s));
  REQUIRE(e2.has_value());
  CHECK(e2->ticket == p.ticket);
  CHECK(e2->kind == lynx::completion_kind::delivered);
  CHECK(e2->status == lynx::errc::ok);
  CHECK(e1->at <= e2->at);
  receiver.release(r.segment);
  // The receiver closes: the sender learns it at its next wait, and posting fails.
  receiver.close();
  CHECK_FALSE(sender.next_event(in(2s)).has_value());
  CHECK(sender.status() == lynx::errc::peer_failure);
  CHECK(sender.post({bytes, {}, lynx::anchor_lane, 0}).status == lynx::errc::peer_failure);
}

namespace {

constexpr lynx::kv_shape small_shape{128, 2, 64};  // a 128-token request: segments of ~16 KB

// A pipe the parent writes one byte into to let a forked child go on.
struct gate {
  int fds[2] = {-1, -1};
  gate() { REQUIRE(::pipe(fds) == 0); }
  ~gate() {
    for (const int fd : fds) ::close(fd);
  }
  void open() const { REQUIRE(::write(fds[1], "g", 1) == 1); }
  [[nodiscard]] bool wait() const {
    char c = 0;
    return ::read(fds[0], &c, 1) == 1;
  }
};

// Drives `sender` until every posted ticket's buffer is reusable (the bytes are
// in the kernel); collects the events. No ack can come: the peer is gated.
std::vector<lynx::send_event<clock_type>> until_all_written(lynx::tcp_sender& sender, int tickets) {
  std::vector<lynx::send_event<clock_type>> events;
  int reusable = 0;
  const auto deadline = in(20s);
  while (reusable < tickets) {
    const auto e = sender.next_event(deadline);
    REQUIRE(e.has_value());
    REQUIRE(e->status == lynx::errc::ok);
    reusable += e->kind == lynx::completion_kind::buffer_reusable;
    events.push_back(*e);
  }
  return events;
}

}  // namespace

TEST_CASE(
    "tcp: a receiver that closes right after acking its last segment leaves every send delivered, "
    "on both lanes (no spurious peer_failure)") {
  ::alarm(120);
  constexpr int layers = 3;
  lynx::tcp_options options;
  options.socket_buffer_bytes = 512 << 10;  // every segment fits in the kernel before it is read
  SUBCASE("every ack and both ends of stream wait in the sender's sockets before it reads one") {
    lynx::tcp_listener listener;
    const std::uint16_t port = listener.port();
    const gate go;
    // The receiver takes every segment only once the sender has written them all, acks each
    // as it hands it out, and exits: both lanes end right behind their last ack.
    lynx::test::child_process receiver([port, &go, options] {
      auto r = lynx::tcp_receiver::connect("127.0.0.1", port, in(10s), options);
      if (!go.wait()) return 1;
      return receive_and_release(r, 2 * layers);
    });
    auto sender = lynx::tcp_sender::accept(listener, in(10s), options);
    std::vector<lynx::encoded_layer<plan>> encoded;
    std::map<lynx::send_ticket, int> stream_of;
    for (int l = 0; l < layers; ++l) {
      encoded.push_back(
          lynx::test::encode_layer<plan>(small_shape, static_cast<std::uint32_t>(l), seed, 0));
      for (int s = 0; s < plan::streams; ++s) {
        const auto p = sender.post({encoded.back().segment(s),
                                    {static_cast<std::uint32_t>(l), s, 0},
                                    lynx::lane_for_stream(s, 2),
                                    static_cast<lynx::send_priority>(s)});
        REQUIRE(p.ok());
        stream_of[p.ticket] = s;
      }
    }
    auto events = until_all_written(sender, 2 * layers);
    go.open();
    REQUIRE(receiver.wait(in(20s)) == 0);  // every segment handed out and acked; sockets closed
    // Now the sender reads: lane 0's acks and its end of stream, lane 1's acks and its end.
    while (const auto e = sender.next_event(in(10s))) events.push_back(*e);
    std::map<lynx::send_ticket, lynx::errc> final_status;
    for (const auto& e : events)
      if (e.is_final()) CHECK(final_status.emplace(e.ticket, e.status).second);
    REQUIRE(final_status.size() == stream_of.size());
    for (const auto& [ticket, status] : final_status) {
      CAPTURE(stream_of[ticket]);
      CHECK(status == lynx::errc::ok);  // acked by the receiver before it closed
    }
    CHECK(sender.outstanding() == 0);
    // The link itself is gone: nothing more can be sent.
    CHECK(sender.status() == lynx::errc::peer_failure);
    CHECK(sender.post({encoded[0].segment(0), {0, 0, 0}, lynx::anchor_lane, 0}).status ==
          lynx::errc::peer_failure);
  }
  SUBCASE("20 requests of 128 tokens through the scheduler, each receiver exiting at once") {
    int failures = 0;
    for (int request = 0; request < 20; ++request) {
      CAPTURE(request);
      lynx::tcp_listener listener;
      const std::uint16_t port = listener.port();
      lynx::test::child_process receiver([port, options] {
        auto r = lynx::tcp_receiver::connect("127.0.0.1", port, in(10s), options);
        return receive_and_release(r, 2 * layers);
      });
      auto sender = lynx::tcp_sender::accept(listener, in(10s), options);
      const int rc = lynx::test::send_request<plan>(sender, small_shape, layers, seed,
                                                    static_cast<std::uint64_t>(request),
                                                    /*window=*/std::size_t{1} << 20);
      CHECK(rc == 0);  // the sender saw every segment delivered
      failures += rc != 0;
      CHECK(receiver.wait(in(20s)) == 0);
    }
    CHECK(failures == 0);
  }
}

TEST_CASE(
    "tcp: a sender that closes once every byte is written loses nothing: the receiver hands out "
    "every segment of both lanes, then peer_failure") {
  ::alarm(60);
  constexpr int layers = 3;
  lynx::tcp_options options;
  options.socket_buffer_bytes = 512 << 10;
  lynx::tcp_listener listener;
  const std::uint16_t port = listener.port();
  const gate go;
  lynx::test::child_process sender_process([port, &go, options] {
    auto s = lynx::tcp_sender::connect("127.0.0.1", port, in(10s), options);
    std::vector<lynx::encoded_layer<plan>> encoded;
    for (int l = 0; l < layers; ++l) {
      encoded.push_back(
          lynx::test::encode_layer<plan>(small_shape, static_cast<std::uint32_t>(l), seed, 0));
      for (int st = 0; st < plan::streams; ++st)
        if (!s.post({encoded.back().segment(st),
                     {static_cast<std::uint32_t>(l), st, 0},
                     lynx::lane_for_stream(st, 2),
                     static_cast<lynx::send_priority>(st)})
                 .ok())
          return 1;
    }
    for (int reusable = 0; reusable < 2 * layers;) {
      const auto e = s.next_event(in(20s));
      if (!e || e->status != lynx::errc::ok) return 2;
      reusable += e->kind == lynx::completion_kind::buffer_reusable;
    }
    s.close();  // every byte is in the kernel; the receiver has read none of them yet
    go.open();
    return 0;
  });
  auto receiver = lynx::tcp_receiver::accept(listener, in(10s), options);
  REQUIRE(go.wait());
  REQUIRE(sender_process.wait(in(20s)) == 0);
  auto tensors = make_tensors(layers, 0, small_shape);
  int anchors = 0, residuals = 0;
  lynx::errc status = lynx::errc::ok;
  while (status == lynx::errc::ok) {
    const auto r = receiver.try_receive(in(10s));
    status = r.status;
    if (!r.ok()) break;
    const auto a = lynx::test::deliver(tensors, r.segment.bytes, r.segment.lane);
    CHECK(a.accepted == lynx::errc::ok);
    (a.id.stream == 0 ? anchors : residuals) += 1;
    receiver.release(r.segment);
  }
  CHECK(anchors == layers);
  CHECK(residuals == layers);  // lane 1's bytes, behind lane 0's end of stream, were read too
  CHECK(status == lynx::errc::peer_failure);
  for (const auto& t : tensors) CHECK(t.complete());
}

namespace {

// Reads what `fd` has now (non-blocking) onto the end of `into`.
void read_available(int fd, std::vector<std::byte>& into) {
  std::byte chunk[1 << 16];
  while (true) {
    const ssize_t n = ::recv(fd, chunk, sizeof chunk, MSG_DONTWAIT);
    if (n <= 0) return;
    into.insert(into.end(), chunk, chunk + n);
  }
}

int readable_bytes(int fd) {
  int n = -1;
  REQUIRE(::ioctl(fd, FIONREAD, &n) == 0);
  return n;
}

}  // namespace

TEST_CASE(
    "tcp: with anchor_first_writes no residual byte is written while anchor bytes wait unsent in "
    "the kernel; the residual socket's unsent bytes are capped") {
  ::alarm(60);
  for (const bool priority : {true, false}) {
    CAPTURE(priority);
    lynx::tcp_listener listener;
    // Accepted sockets inherit this: the receiving side's window is a few KiB,
    // so the anchor's bytes stay unsent in the sender's kernel until the test reads them.
    const int small = 4096;
    REQUIRE(::setsockopt(listener.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small) == 0);
    lynx::tcp_options options;
    options.anchor_first_writes = priority;
    options.socket_buffer_bytes = 1 << 20;  // the sender's kernel takes the whole anchor at once
    auto lanes = lynx::tcp_connect_lanes("127.0.0.1", listener.port(), 2, in(5s), options);
    const int residual_fd = lanes[1].fd();
    lynx::tcp_sender sender(std::move(lanes), options);
    auto raw = lynx::tcp_accept_lanes(listener, 2, in(5s));  // read by the test itself
#if defined(TCP_NOTSENT_LOWAT)
    int lowat = -1;
    socklen_t len = sizeof lowat;
    REQUIRE(::getsockopt(residual_fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, &len) == 0);
    CHECK(lowat == (priority ? options.residual_unsent_bytes : 0));
#else
    (void)residual_fd;
#endif
    std::vector<std::byte> anchor(256 << 10), residual(4096);
    for (std::size_t i = 0; i < anchor.size(); ++i) anchor[i] = static_cast<std::byte>(i * 7);
    for (std::size_t i = 0; i < residual.size(); ++i) residual[i] = static_cast<std::byte>(i * 5);
    const auto a = sender.post({anchor, {0, 0, 0}, lynx::anchor_lane, 0});
    const auto r = sender.post({residual, {0, 1, 0}, lynx::residual_lane, 1});
    REQUIRE(a.ok());
    REQUIRE(r.ok());
    // Drive the sender until both buffers are in the kernel, or for 200 ms.
    std::map<lynx::send_ticket, std::vector<lynx::completion_kind>> seen;
    const auto drive = [&](clock_type::time_point until) {
      while (const auto e = sender.next_event(until)) {
        REQUIRE(e->status == lynx::errc::ok);
        seen[e->ticket].push_back(e->kind);
      }
    };
    drive(in(200ms));
    CHECK(seen[a.ticket] == std::vector{lynx::completion_kind::buffer_reusable});
    if (priority) {
      // Most of the anchor is still unsent (the peer reads nothing): the residual waits.
      CHECK(seen[r.ticket].empty());
      CHECK(readable_bytes(raw[1].fd()) == 0);
    } else {
      CHECK(seen[r.ticket] == std::vector{lynx::completion_kind::buffer_reusable});
    }
    // The receiving side reads the whole anchor frame, then the residual frame.
    std::vector<std::byte> lane0, lane1;
    const std::size_t head = sizeof(lynx::tcp_wire::frame);
    const auto deadline = in(20s);
    while (lane0.size() < head + anchor.size() && clock_type::now() < deadline) {
      read_available(raw[0].fd(), lane0);
      drive(in(1ms));
    }
    while (lane1.size() < head + residual.size() && clock_type::now() < deadline) {
      read_available(raw[1].fd(), lane1);
      drive(in(1ms));
    }
    REQUIRE(lane0.size() == head + anchor.size());
    REQUIRE(lane1.size() == head + residual.size());
    CHECK(std::equal(anchor.begin(), anchor.end(), lane0.begin() + head));
    CHECK(std::equal(residual.begin(), residual.end(), lane1.begin() + head));
    // Acks for both: each send ends delivered.
    for (const auto& [fd, ticket] : {std::pair{raw[0].fd(), a.ticket}, {raw[1].fd(), r.ticket}}) {
      lynx::tcp_wire::ack ack;
      ack.ticket = ticket;
      lynx::detail::write_all(fd, &ack, sizeof ack, in(5s), "ack");
    }
    while (sender.outstanding() != 0 && clock_type::now() < deadline) drive(in(5ms));
    const std::vector both{lynx::completion_kind::buffer_reusable,
                           lynx::completion_kind::delivered};
    CHECK(seen[a.ticket] == both);
    CHECK(seen[r.ticket] == both);
    CHECK(sender.status() == lynx::errc::ok);
  }
}
