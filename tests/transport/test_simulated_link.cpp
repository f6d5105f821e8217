// The simulated link: exact timeline arithmetic, chunk preemption on one lane
// vs a second lane, two lanes sharing one rate (processor sharing) or, when
// asked, two independent paths, deadlines in virtual time, reproducibility,
// failures.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include <lynx/transport/simulated_link.hpp>

namespace {

using namespace std::chrono_literals;
using lynx::virtual_duration;
using lynx::virtual_time;

constexpr std::int64_t ps_per_us = 1'000'000;

virtual_time at_ps(std::int64_t ps) { return virtual_time(virtual_duration(ps)); }

lynx::send_request raw(std::span<const std::byte> bytes, std::uint32_t layer, int stream,
                       lynx::lane_index lane) {
  return {bytes, {layer, stream, 0}, lane, static_cast<lynx::send_priority>(stream)};
}

}  // namespace

TEST_CASE("1 MB at 1 GB/s with 10 us latency arrives at exactly 1.01 ms virtual") {
  lynx::simulated_link link(lynx::simulated_link_options::one_lane(1'000'000'000, 10us));
  std::vector<std::byte> bytes(1'000'000, std::byte{0x5a});
  const auto p = link.sender().post(raw(bytes, 0, 0, 0));
  REQUIRE(p.ok());

  // The receiver waits in virtual time: the clock jumps to the arrival.
  const auto r = link.receiver().try_receive(at_ps(2'000 * ps_per_us));
  REQUIRE(r.ok());
  CHECK(r.segment.arrival == at_ps(1'010 * ps_per_us));
  CHECK(link.now() == at_ps(1'010 * ps_per_us));
  CHECK(r.segment.bytes.size() == bytes.size());
  CHECK(std::memcmp(r.segment.bytes.data(), bytes.data(), bytes.size()) == 0);
  link.receiver().release(r.segment);
  CHECK(link.receiver().held() == 0);

  // Sender: buffer reusable when the last byte left (1 ms), delivered when the ack is back (1.02
  // ms).
  auto e1 = link.sender().next_event(at_ps(5'000 * ps_per_us));
  REQUIRE(e1);
  CHECK(e1->kind == lynx::completion_kind::buffer_reusable);
  CHECK(e1->at == at_ps(1'000 * ps_per_us));
  CHECK_FALSE(e1->is_final());
  auto e2 = link.sender().next_event(at_ps(5'000 * ps_per_us));
  REQUIRE(e2);
  CHECK(e2->kind == lynx::completion_kind::delivered);
  CHECK(e2->status == lynx::errc::ok);
  CHECK(e2->at == at_ps(1'020 * ps_per_us));
  CHECK(e2->ticket == p.ticket);

  REQUIRE(link.arrivals().size() == 1);
  const auto& a = link.arrivals()[0];
  CHECK(a.posted == at_ps(0));
  CHECK(a.first_byte_sent == at_ps(0));
  CHECK(a.last_byte_sent == at_ps(1'000 * ps_per_us));
  CHECK(a.arrived == at_ps(1'010 * ps_per_us));
}

TEST_CASE("chunking does not accumulate rounding: the busy period's total bytes set the time") {
  // 1000 bytes at 3 bytes/s: 333.333...s, rounded up once to the picosecond.
  for (std::size_t chunk : {std::size_t{0}, std::size_t{7}, std::size_t{64}, std::size_t{999}}) {
    lynx::simulated_link_options o = lynx::simulated_link_options::one_lane(3, 0us);
    o.chunk_bytes = chunk;
    o.keep_bytes = false;
    lynx::simulated_link link(o);
    std::vector<std::byte> bytes(1000);
    REQUIRE(link.sender().post(raw(bytes, 0, 0, 0)).ok());
    link.run_until_idle();
    REQUIRE(link.arrivals().size() == 1);
    CAPTURE(chunk);
    CHECK(link.arrivals()[0].arrived.time_since_epoch().count() == 333'333'333'333'334);
  }
  CHECK(lynx::simulated_link::wire_time(65536, 1'250'000'000).count() ==
        52'428'800);  // 64 KiB at 10 Gbit/s
}

namespace {

// A 1 MiB residual posted at t = 0, then a 100 kB anchor at t = 100 us; 1 GB/s, 10 us.
struct preemption_result {
  lynx::arrival_event anchor, residual;
};

preemption_result run_preemption(int lanes, std::size_t chunk_bytes,
                                 lynx::lane_sharing sharing = lynx::lane_sharing::shared) {
  lynx::simulated_link_options o =
      lanes == 1 ? lynx::simulated_link_options::one_lane(1'000'000'000, 10us)
      : sharing == lynx::lane_sharing::shared
          ? lynx::simulated_link_options::two_lanes(1'000'000'000, 10us)
          : lynx::simulated_link_options::two_independent_lanes(1'000'000'000, 10us);
  o.chunk_bytes = chunk_bytes;
  lynx::simulated_link link(o);
  std::vector<std::byte> residual(1 << 20), anchor(100'000);
  REQUIRE(link.sender().post(raw(residual, 0, 1, lynx::lane_for_stream(1, lanes))).ok());
  link.advance_to(at_ps(100 * ps_per_us));
  REQUIRE(link.sender().post(raw(anchor, 1, 0, lynx::lane_for_stream(0, lanes))).ok());
  link.run_until_idle();
  REQUIRE(link.arrivals().size() == 2);
  preemption_result r;
  for (const auto& a : link.arrivals()) (a.id.stream == 0 ? r.anchor : r.residual) = a;
  return r;
}

}  // namespace

TEST_CASE(
    "one lane: an anchor posted mid-residual waits at most one chunk; two lanes: not at all, and "
    "it shares the rate with the residual") {
  SUBCASE("one lane, 64 KiB chunks") {
    const auto r = run_preemption(1, 65536);
    // Chunk boundaries at k * 65.536 us; the first after 100 us is 131.072 us.
    CHECK(r.anchor.first_byte_sent == at_ps(131'072'000));
    CHECK(r.anchor.first_byte_sent - r.anchor.posted <=
          lynx::simulated_link::wire_time(65536, 1'000'000'000));
    CHECK(r.anchor.arrived == at_ps(131'072'000 + 100'000'000 + 10'000'000));
    // The residual resumes after the anchor: all 1'148'576 bytes by 1148.576 us.
    CHECK(r.residual.last_byte_sent == at_ps(1'148'576'000));
    CHECK(r.residual.arrived == at_ps(1'158'576'000));
  }
  SUBCASE("one lane, whole segments (no preemption)") {
    const auto r = run_preemption(1, 0);
    CHECK(r.anchor.first_byte_sent == at_ps(1'048'576'000));  // behind the whole residual
    CHECK(r.anchor.arrived == at_ps(1'048'576'000 + 100'000'000 + 10'000'000));
    CHECK(r.residual.arrived == at_ps(1'058'576'000));
  }
  SUBCASE("two lanes sharing 1 GB/s") {
    for (const std::size_t chunk : {std::size_t{65536}, std::size_t{0}}) {
      CAPTURE(chunk);
      const auto r = run_preemption(2, chunk);
      CHECK(r.anchor.lane == 0);
      CHECK(r.residual.lane == 1);
      CHECK(r.anchor.first_byte_sent == r.anchor.posted);
      // Both lanes busy from 100 us: 100 kB at 0.5 GB/s take 200 us.
      CHECK(r.anchor.last_byte_sent == at_ps(300'000'000));
      CHECK(r.anchor.arrived == at_ps(300'000'000 + 10'000'000));
      // The residual: 100 kB alone by 100 us, 100 kB more by 300 us, the other 848,576 bytes
      // at the full rate. It ends when it does on one lane: the link never idles.
      CHECK(r.residual.last_byte_sent == at_ps(1'148'576'000));
      CHECK(r.residual.arrived == at_ps(1'158'576'000));
    }
  }
  SUBCASE("two independent lanes of 1 GB/s each (twice the bandwidth)") {
    for (const std::size_t chunk : {std::size_t{65536}, std::size_t{0}}) {
      CAPTURE(chunk);
      const auto r = run_preemption(2, chunk, lynx::lane_sharing::independent);
      CHECK(r.anchor.first_byte_sent == r.anchor.posted);
      CHECK(r.anchor.arrived == at_ps(100'000'000 + 100'000'000 + 10'000'000));
      CHECK(r.residual.arrived == at_ps(1'058'576'000));
    }
  }
}

namespace {

// Posts `bytes[l]` on lane l at t = 0 (0: nothing) and returns each lane's last-byte time.
std::vector<std::int64_t> last_bytes_at(const lynx::simulated_link_options& o,
                                        const std::vector<std::size_t>& bytes) {
  lynx::simulated_link link(o);
  std::vector<std::vector<std::byte>> buffers;
  buffers.reserve(bytes.size());  // the posted spans stay valid
  for (std::size_t l = 0; l < bytes.size(); ++l) {
    buffers.emplace_back(bytes[l]);
    if (bytes[l])
      REQUIRE(link.sender()
                  .post(raw(buffers.back(), static_cast<std::uint32_t>(l), static_cast<int>(l),
                            static_cast<lynx::lane_index>(l)))
                  .ok());
  }
  link.run_until_idle();
  std::vector<std::int64_t> at(bytes.size(), -1);
  for (const auto& a : link.arrivals()) at[a.lane] = a.last_byte_sent.time_since_epoch().count();
  return at;
}

}  // namespace

TEST_CASE(
    "two lanes share one rate: both busy, each moves at half of it; one idle, the other has all") {
  using options = lynx::simulated_link_options;
  constexpr std::uint64_t rate = 1'000'000'000;  // 1 GB/s: 1 byte per 1000 ps
  constexpr std::size_t n = 1'000'000;
  const std::int64_t one = lynx::simulated_link::wire_time(n, rate).count();
  REQUIRE(one == 1'000'000'000);  // 1 ms
  for (const std::size_t chunk : {std::size_t{0}, std::size_t{4096}, std::size_t{65536}}) {
    CAPTURE(chunk);
    options o = options::two_lanes(rate, 0us);
    o.chunk_bytes = chunk;
    o.keep_bytes = false;
    // Two equal segments started together: each finishes at twice one segment's wire time.
    CHECK(last_bytes_at(o, {n, n}) == std::vector<std::int64_t>{2 * one, 2 * one});
    // A lone segment on lane 1 (lane 0 idle) has the whole rate, and so does one on lane 0.
    CHECK(last_bytes_at(o, {0, n}) == std::vector<std::int64_t>{-1, one});
    CHECK(last_bytes_at(o, {n, 0}) == std::vector<std::int64_t>{one, -1});
    // Unequal: the smaller (300 kB) is done when 2 x 300 kB have left, the larger when all
    // 1.3 MB have, the same moment one lane carrying both would finish.
    CHECK(last_bytes_at(o, {300'000, n}) == std::vector<std::int64_t>{600'000'000, 1'300'000'000});
    options one_lane = options::one_lane(rate, 0us);
    one_lane.chunk_bytes = chunk;
    one_lane.keep_bytes = false;
    lynx::simulated_link single(one_lane);
    std::vector<std::byte> a(300'000), b(n);
    REQUIRE(single.sender().post(raw(a, 0, 0, 0)).ok());
    REQUIRE(single.sender().post(raw(b, 1, 1, 0)).ok());
    CHECK(single.run_until_idle() == at_ps(1'300'000'000));

    // Independent lanes, only when asked: each has the whole rate.
    options ind = options::two_independent_lanes(rate, 0us);
    ind.chunk_bytes = chunk;
    ind.keep_bytes = false;
    CHECK(last_bytes_at(ind, {n, n}) == std::vector<std::int64_t>{one, one});
  }
  // Halves of an awkward rate round once, at the end: 1000 bytes each at 3 bytes/s in total,
  // in 7-byte chunks, end at ceil(2000 / 3 s) = 666.666666666667 s on both lanes.
  options o = options::two_lanes(3, 0us);
  o.chunk_bytes = 7;
  o.keep_bytes = false;
  CHECK(last_bytes_at(o, {1000, 1000}) ==
        std::vector<std::int64_t>{666'666'666'666'667, 666'666'666'666'667});
  CHECK(lynx::simulated_link::wire_time(2000, 3).count() == 666'666'666'666'667);
  // Shared lanes name one rate.
  o.lanes[1].bytes_per_second = 4;
  CHECK_THROWS_AS(lynx::simulated_link{o}, lynx::error);
  o.sharing = lynx::lane_sharing::independent;
  CHECK_NOTHROW(lynx::simulated_link{o});
}

TEST_CASE("two shared lanes: a lane that joins or leaves changes the other's pace at that moment") {
  // 1 GB/s shared, no latency. Lane 1: 500 kB at t = 0. Lane 0: 100 kB at t = 200 us.
  // 0-200 us: lane 1 alone, 200 kB. 200-400 us: both, 100 kB each (lane 0 done at 400 us).
  // Then lane 1 alone again: its last 200 kB by 600 us = (500 + 100) kB at 1 GB/s.
  auto o = lynx::simulated_link_options::two_lanes(1'000'000'000, 0us);
  o.keep_bytes = false;
  lynx::simulated_link link(o);
  std::vector<std::byte> residual(500'000), anchor(100'000);
  REQUIRE(link.sender().post(raw(residual, 0, 1, 1)).ok());
  link.advance_to(at_ps(200 * ps_per_us));
  REQUIRE(link.sender().post(raw(anchor, 0, 0, 0)).ok());
  link.run_until_idle();
  REQUIRE(link.arrivals().size() == 2);
  for (const auto& a : link.arrivals()) {
    CAPTURE(a.lane);
    CHECK(a.last_byte_sent == at_ps((a.lane == 0 ? 400 : 600) * ps_per_us));
  }
  // The same timeline, run again: the same log.
  lynx::simulated_link again(o);
  REQUIRE(again.sender().post(raw(residual, 0, 1, 1)).ok());
  again.advance_to(at_ps(200 * ps_per_us));
  REQUIRE(again.sender().post(raw(anchor, 0, 0, 0)).ok());
  again.run_until_idle();
  CHECK(again.arrivals() == link.arrivals());
}

TEST_CASE(
    "strict priority on one lane: a more urgent segment is sent first, equal ones in post "
    "order") {
  lynx::simulated_link_options o = lynx::simulated_link_options::one_lane(1'000'000, 0us);
  o.keep_bytes = false;
  lynx::simulated_link link(o);
  std::vector<std::byte> b(1000);
  // All posted at t = 0; the lane starts the first at once, then picks by priority.
  REQUIRE(link.sender().post(raw(b, 0, 2, 0)).ok());
  REQUIRE(link.sender().post(raw(b, 1, 2, 0)).ok());
  REQUIRE(link.sender().post(raw(b, 2, 1, 0)).ok());
  REQUIRE(link.sender().post(raw(b, 3, 0, 0)).ok());
  link.run_until_idle();
  std::vector<std::uint32_t> order;
  for (const auto& a : link.arrivals()) order.push_back(a.id.layer);
  CHECK(order == std::vector<std::uint32_t>{0, 3, 2, 1});
}

TEST_CASE("deadlines fire in virtual time on an empty link") {
  lynx::simulated_link link(lynx::simulated_link_options::one_lane(1'000'000'000, 10us));
  const auto r = link.receiver().try_receive(at_ps(5 * ps_per_us));
  CHECK(r.status == lynx::errc::timeout);
  CHECK(link.now() == at_ps(5 * ps_per_us));
  CHECK_FALSE(link.sender().next_event(at_ps(7 * ps_per_us)).has_value());
  CHECK(link.now() == at_ps(7 * ps_per_us));
  // A deadline before the arrival times out at the deadline, the segment comes later.
  std::vector<std::byte> b(1000);
  REQUIRE(link.sender().post(raw(b, 0, 0, 0)).ok());
  CHECK(link.receiver().try_receive(at_ps(8 * ps_per_us)).status == lynx::errc::timeout);
  CHECK(link.now() == at_ps(8 * ps_per_us));
  const auto later = link.receiver().try_receive(at_ps(100 * ps_per_us));
  REQUIRE(later.ok());
  CHECK(later.segment.arrival ==
        at_ps(7 * ps_per_us + 1 * ps_per_us +
              10 * ps_per_us));  // posted 7 us, 1 us on the wire, 10 us latency
  CHECK(lynx::poll(link.receiver()).status == lynx::errc::timeout);
}

TEST_CASE("arrived_by answers what has arrived by a virtual time") {
  lynx::simulated_link link(lynx::simulated_link_options::one_lane(1'000'000'000, 1us));
  std::vector<std::byte> b(1000);  // 1 us each on the wire
  for (std::uint32_t l = 0; l < 3; ++l) REQUIRE(link.sender().post(raw(b, l, 0, 0)).ok());
  link.run_until_idle();
  CHECK(link.arrived_by(at_ps(1 * ps_per_us)).empty());
  CHECK(link.arrived_by(at_ps(2 * ps_per_us)).size() == 1);
  CHECK(link.arrived_by(at_ps(3 * ps_per_us + 999'999)).size() == 2);
  CHECK(link.arrived_by(at_ps(4 * ps_per_us)).size() == 3);
  CHECK_THROWS_AS((void)link.arrived_by(link.now() + 1us), lynx::error);
}

TEST_CASE("a broken link reports its error to both sides, nothing hangs") {
  lynx::simulated_link link(lynx::simulated_link_options::one_lane(1'000'000'000, 10us));
  std::vector<std::byte> a(1000), r(1 << 20);
  const auto pa = link.sender().post(raw(a, 0, 0, 0));
  const auto pr = link.sender().post(raw(r, 0, 1, 0));
  link.advance_to(at_ps(500 * ps_per_us));  // anchor arrived, residual half way
  link.break_link(lynx::errc::peer_failure);
  std::vector<lynx::send_event<lynx::virtual_clock>> events;
  while (auto e = link.sender().next_event(at_ps(10'000 * ps_per_us))) events.push_back(*e);
  std::map<lynx::send_ticket, lynx::errc> final_status;
  for (const auto& e : events)
    if (e.is_final())
      CHECK(final_status.emplace(e.ticket, e.status).second);  // exactly one final event per send
  CHECK(final_status.size() == 2);
  CHECK(final_status[pa.ticket] == lynx::errc::ok);  // delivered and acknowledged at 21 us
  CHECK(final_status[pr.ticket] == lynx::errc::peer_failure);  // on the wire when the peer died
  const auto first = link.receiver().try_receive(at_ps(10'000 * ps_per_us));
  REQUIRE(first.ok());  // the anchor had arrived before the break
  link.receiver().release(first.segment);
  CHECK(link.receiver().try_receive(at_ps(20'000 * ps_per_us)).status == lynx::errc::peer_failure);
  CHECK(link.sender().post(raw(a, 1, 0, 0)).status == lynx::errc::peer_failure);
}
