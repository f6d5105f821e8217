// lynx::request_driver on the simulated link's virtual clock with a fixed
// compute time per step, so every time in a report is the link's exact
// arithmetic: segments land into real bit-plane tensors, the session (toy
// engine with known logits) commits exactly the target level's greedy tokens,
// deadlines fire at their virtual times, each failure policy does what it
// says (continue_unverified, fail_request, rerequest with the list of what is
// missing), refused segments are counted by their error and change nothing,
// control messages reach their hook (which may attach the session late), an
// anchor-only request needs no residual; and the same loop over the loopback
// transport on the steady clock.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "lynx/planes/codec.hpp"
#include "lynx/planes/layer_set.hpp"
#include "lynx/speculation/request_driver.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/transport/loopback.hpp"
#include "lynx/transport/simulated_link.hpp"
#include "toy_engine.hpp"

using lynx_test::greedy_at;
using lynx_test::toy_engine;

namespace {

using plan = lynx::plan_8_4_4;  // two streams: anchor, residual
using tensor = lynx::bitplane_tensor<plan, 32, lynx::host_space>;
using received_type = lynx::layer_set<plan>;
using session_type = lynx::progressive_session<toy_engine, lynx::greedy_verifier>;
using sim_receiver = lynx::simulated_link::receiver_endpoint;
using sim_driver =
    lynx::request_driver<received_type, session_type, sim_receiver, lynx::simulated_time>;

const lynx::kv_shape shape{70, 2, 32};
constexpr int n_layers = 3;
constexpr std::uint64_t generation = 5;
constexpr int tokens = 24;
constexpr std::int32_t first_token = 3;
constexpr std::int64_t prompt_tokens = 70;
constexpr auto step_time = std::chrono::milliseconds(1);  // virtual compute per session step

std::vector<lynx::encoded_layer<plan>> encode_all(std::uint64_t gen = generation,
                                                  int layers = n_layers, int first_layer = 0) {
  std::vector<lynx::encoded_layer<plan>> out;
  std::vector<float> k(static_cast<std::size_t>(shape.tokens * shape.kv_heads * shape.head_dim));
  std::vector<float> v(k.size());
  for (int l = first_layer; l < first_layer + layers; ++l) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] =
          static_cast<float>(static_cast<int>((i + 53 * l) * 2654435761u % 2001u) - 1000) / 400.0f;
      v[i] = static_cast<float>(static_cast<int>((i + 17 * l) * 40503u % 1777u) - 888) / 300.0f;
    }
    out.push_back(lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                                lynx::token_major<const float>(v.data(), shape),
                                                static_cast<std::uint32_t>(l),
                                                {.generation = gen}));
  }
  return out;
}

std::vector<tensor> receivers() {
  std::vector<tensor> t;
  for (int l = 0; l < n_layers; ++l)
    t.emplace_back(shape, static_cast<std::uint32_t>(l), generation);
  return t;
}

// 1 Gbit/s (125 bytes per microsecond), 50 us one way: a segment of this shape
// takes a few tens of microseconds, a session step 1 ms.
lynx::simulated_link make_link() {
  return lynx::simulated_link(lynx::simulated_link_options::one_lane(
      125'000'000,
      std::chrono::duration_cast<lynx::virtual_duration>(std::chrono::microseconds(50))));
}

void post(lynx::simulated_link& link, std::span<const std::byte> bytes, int stream = 0) {
  const lynx::segment_header h = lynx::peek_header(bytes);
  const auto r = link.sender().post({bytes,
                                     {h.layer, static_cast<int>(h.stream), h.generation},
                                     lynx::anchor_lane,
                                     static_cast<std::uint8_t>(stream)});
  REQUIRE(r.ok());
}

double seconds(lynx::virtual_time t) { return lynx::to_seconds(t); }

lynx::request_options options(lynx::failure_policy policy) {
  lynx::request_options o;
  o.failure.policy = policy;
  o.deadlines.anchor = std::chrono::milliseconds(20);
  o.deadlines.residual = std::chrono::milliseconds(50);
  o.deadlines.request = std::chrono::milliseconds(10'000);
  return o;
}

struct run_result {
  lynx::request_report<lynx::virtual_clock> report;
  std::vector<std::int32_t> committed;
  lynx::session_stats stats;
};

// Runs a session of `target` levels over `link` with `o` and hooks.
run_result drive(lynx::simulated_link& link, lynx::request_options o, sim_driver::hooks hooks = {},
                 int target = plan::streams, bool attach = true) {
  auto t = receivers();
  received_type received(t);
  toy_engine e;
  e.levels = plan::streams;
  lynx::session_options so;
  so.max_draft = 4;
  so.max_new_tokens = tokens;
  session_type s(e, lynx::greedy_verifier{}, target, prompt_tokens, first_token, so);
  sim_driver d(
      received, link.receiver(), o, std::move(hooks),
      lynx::simulated_time(link, std::chrono::duration_cast<lynx::virtual_duration>(step_time)));
  if (attach) d.attach(s);
  run_result r{d.run(), s.committed(), s.stats()};
  return r;
}

// The latest arrival of stream `stream`'s segments on the link (seconds).
double landed(const lynx::simulated_link& link, int stream) {
  double t = -1;
  for (const auto& a : link.arrivals())
    if (a.id.stream == stream) t = std::max(t, seconds(a.arrived));
  return t;
}

}  // namespace

TEST_CASE("every segment lands: exact tokens, the level times are the link's arrival times") {
  const auto layers = encode_all();
  auto link = make_link();
  for (const auto& l : layers) post(link, l.segment(0), 0);
  for (const auto& l : layers) post(link, l.segment(1), 1);
  const run_result r = drive(link, options(lynx::failure_policy::fail_request));
  CHECK(r.report.outcome == lynx::request_outcome::completed);
  CHECK(r.committed == greedy_at(plan::streams, plan::streams, first_token, tokens));
  CHECK(r.report.failures.empty());
  CHECK(r.report.rejected.empty());
  CHECK(r.report.segments_accepted == n_layers * plan::streams);
  CHECK(r.report.level == plan::streams);
  REQUIRE(r.report.level_at.size() == plan::streams + 1);
  REQUIRE(r.report.level_at[1].has_value());
  REQUIRE(r.report.level_at[2].has_value());
  CHECK(seconds(*r.report.level_at[1]) == landed(link, 0));
  CHECK(seconds(*r.report.level_at[2]) == landed(link, 1));
  CHECK(r.report.finished.has_value());
  CHECK(r.report.first_committed.has_value());
  CHECK(r.stats.unverified_tokens == 0);
  // Deterministic: the same posts give the same report, time for time.
  auto link2 = make_link();
  for (const auto& l : layers) post(link2, l.segment(0), 0);
  for (const auto& l : layers) post(link2, l.segment(1), 1);
  const run_result r2 = drive(link2, options(lynx::failure_policy::fail_request));
  CHECK(r2.report.finished == r.report.finished);
  CHECK(r2.report.step_levels == r.report.step_levels);
}

TEST_CASE("the residual never comes: its deadline fires at anchor landing + residual deadline") {
  const auto layers = encode_all();
  const double step = std::chrono::duration<double>(step_time).count();
  SUBCASE("continue_unverified: every token committed, those after the failure flagged") {
    auto link = make_link();
    for (const auto& l : layers) post(link, l.segment(0), 0);
    const run_result r = drive(link, options(lynx::failure_policy::continue_unverified));
    CHECK(r.report.outcome == lynx::request_outcome::completed_unverified);
    REQUIRE(r.report.failures.size() == 1);
    const auto& f = r.report.failures[0];
    CHECK(f.status == lynx::errc::timeout);
    CHECK(f.applied == lynx::failure_policy::continue_unverified);
    CHECK(f.what == "the residual deadline passed with 3 segments missing");
    // The deadline, as the driver measures it: from the start, in the link's picoseconds.
    const double deadline =
        std::chrono::duration<double>(*r.report.level_at[1] + std::chrono::milliseconds(50) -
                                      r.report.started)
            .count();
    CHECK(f.at >= deadline);
    CHECK(f.at < deadline + step);  // checked between steps of 1 ms
    CHECK(r.committed.size() == tokens);
    CHECK(r.stats.unverified_tokens > 0);
    CHECK(r.report.failure == f.what);
  }
  SUBCASE("fail_request: the request fails, fewer tokens than asked") {
    auto link = make_link();
    for (const auto& l : layers) post(link, l.segment(0), 0);
    const run_result r = drive(link, options(lynx::failure_policy::fail_request));
    CHECK(r.report.outcome == lynx::request_outcome::failed);
    REQUIRE(r.report.failures.size() == 1);
    CHECK(r.report.failures[0].applied == lynx::failure_policy::fail_request);
    CHECK(r.committed.size() < tokens);
    CHECK_FALSE(r.report.finished.has_value());
    // What was committed before the failure was exact.
    const auto want = greedy_at(plan::streams, plan::streams, first_token, tokens);
    CHECK(std::equal(r.committed.begin(), r.committed.end(), want.begin()));
  }
  SUBCASE("no anchor either: the anchor deadline, with every segment missing") {
    auto link = make_link();
    const run_result r = drive(link, options(lynx::failure_policy::continue_unverified));
    CHECK(r.report.outcome == lynx::request_outcome::failed);  // unverified needs the anchor
    REQUIRE(r.report.failures.size() == 1);
    CHECK(r.report.failures[0].what == "the anchor deadline passed with 6 segments missing");
    CHECK(r.report.failures[0].at == doctest::Approx(0.020).epsilon(1e-12));
    CHECK(r.committed.size() == 1);  // the prefill's own token
  }
}

TEST_CASE("rerequest: the hook is told exactly what is missing; the resend completes the request") {
  const auto layers = encode_all();
  auto link = make_link();
  for (const auto& l : layers) post(link, l.segment(0), 0);
  post(link, layers[0].segment(1), 1);
  post(link, layers[2].segment(1), 1);  // layer 1's residual is lost
  std::vector<lynx::resend_request> asked;
  sim_driver::hooks h;
  h.rerequest = [&](const lynx::resend_request& req) -> sim_receiver* {
    asked.push_back(req);
    for (const auto& id : req.missing) post(link, layers[id.layer].segment(id.stream), id.stream);
    return &link.receiver();
  };
  const run_result r = drive(link, options(lynx::failure_policy::rerequest), h);
  REQUIRE(asked.size() == 1);
  CHECK(asked[0].generation == generation);
  CHECK(asked[0].attempt == 1);
  CHECK(lynx::format_segment_list(asked[0].missing) == "1:1");
  CHECK(r.report.outcome == lynx::request_outcome::completed);
  CHECK(r.report.rerequests == 1);
  REQUIRE(r.report.failures.size() == 1);  // the deadline that asked for the resend
  CHECK(r.report.failures[0].applied == lynx::failure_policy::rerequest);
  CHECK(r.committed == greedy_at(plan::streams, plan::streams, first_token, tokens));

  SUBCASE("no resend can be arranged: after_rerequests applies") {
    auto link2 = make_link();
    for (const auto& l : layers) post(link2, l.segment(0), 0);
    sim_driver::hooks none;
    none.rerequest = [](const lynx::resend_request&) -> sim_receiver* { return nullptr; };
    auto o = options(lynx::failure_policy::rerequest);
    o.failure.after_rerequests = lynx::failure_policy::continue_unverified;
    const run_result r2 = drive(link2, o, none);
    CHECK(r2.report.outcome == lynx::request_outcome::completed_unverified);
    CHECK(r2.report.rerequests == 0);
    REQUIRE(r2.report.failures.size() == 1);
    CHECK(r2.report.failures[0].applied == lynx::failure_policy::continue_unverified);
  }
}

TEST_CASE(
    "refused segments are counted by their error and change nothing; duplicates are idempotent") {
  const auto layers = encode_all();
  const auto stale = encode_all(generation - 1);
  const auto foreign = encode_all(generation, 1, 7);  // layer 7 of a 3-layer model
  auto link = make_link();
  const auto anchor0 = layers[0].segment(0);
  std::vector<std::byte> damaged(anchor0.begin(), anchor0.end());
  damaged[damaged.size() / 2] ^= std::byte{0x10};
  const std::vector<std::byte> truncated(anchor0.begin(), anchor0.end() - 7);
  post(link, stale[1].segment(0), 0);
  post(link, damaged, 0);
  post(link, truncated, 0);
  post(link, foreign[0].segment(0), 0);
  for (const auto& l : layers) post(link, l.segment(0), 0);
  post(link, anchor0, 0);  // a duplicate
  for (const auto& l : layers) post(link, l.segment(1), 1);
  const run_result r = drive(link, options(lynx::failure_policy::fail_request));
  CHECK(r.report.outcome == lynx::request_outcome::completed);
  CHECK(r.committed == greedy_at(plan::streams, plan::streams, first_token, tokens));
  CHECK(r.report.count(lynx::errc::stale_generation) == 1);
  CHECK(r.report.stale == 1);
  CHECK(r.report.count(lynx::errc::corrupted_segment) == 1);
  CHECK(r.report.count(lynx::errc::truncated_segment) == 1);
  CHECK(r.report.count(lynx::errc::layer_mismatch) == 1);
  CHECK(r.report.rejected.size() == 4);
  CHECK(r.report.duplicates == 1);
  CHECK(r.report.segments_accepted == n_layers * plan::streams);
}

TEST_CASE("control messages reach their hook, which may attach the session late") {
  const auto layers = encode_all();
  const std::vector<std::byte> hello{std::byte{'h'}, std::byte{'i'}};
  SUBCASE("the message comes: the session starts from it") {
    auto link = make_link();
    for (const auto& l : layers) post(link, l.segment(0), 0);
    REQUIRE(link.sender().post({hello, {}, lynx::anchor_lane, 0}).ok());
    for (const auto& l : layers) post(link, l.segment(1), 1);
    auto t = receivers();
    received_type received(t);
    toy_engine e;
    e.levels = plan::streams;
    lynx::session_options so;
    so.max_new_tokens = tokens;
    std::optional<session_type> s;
    sim_driver* driver = nullptr;
    int messages = 0;
    sim_driver::hooks h;
    h.on_message = [&](const lynx::received_segment<lynx::virtual_clock>& m) {
      if (m.bytes.size() != hello.size()) return false;
      ++messages;
      s.emplace(e, lynx::greedy_verifier{}, plan::streams, prompt_tokens, first_token, so);
      driver->attach(*s);
      return true;
    };
    sim_driver d(
        received, link.receiver(), options(lynx::failure_policy::fail_request), h,
        lynx::simulated_time(link, std::chrono::duration_cast<lynx::virtual_duration>(step_time)));
    driver = &d;
    const auto rep = d.run();
    CHECK(messages == 1);
    CHECK(rep.outcome == lynx::request_outcome::completed);
    REQUIRE(s);
    CHECK(s->committed() == greedy_at(plan::streams, plan::streams, first_token, tokens));
    CHECK(rep.rejected.empty());
    CHECK(rep.bytes_received > hello.size());
  }
  SUBCASE("it never comes: the request fails saying so") {
    auto link = make_link();
    for (const auto& l : layers) post(link, l.segment(0), 0);
    for (const auto& l : layers) post(link, l.segment(1), 1);
    const run_result r = drive(link, options(lynx::failure_policy::continue_unverified), {},
                               plan::streams, /*attach=*/false);
    CHECK(r.report.outcome == lynx::request_outcome::failed);
    CHECK(r.report.failure.find("no session was attached") != std::string::npos);
  }
}

TEST_CASE(
    "an anchor-only request (target level 1) needs no residual; a broken link fails the request") {
  const auto layers = encode_all();
  SUBCASE("anchor only, told when complete") {
    auto link = make_link();
    for (const auto& l : layers) post(link, l.segment(0), 0);
    auto o = options(lynx::failure_policy::fail_request);
    o.target_level = 1;
    o.hold_until_complete = true;
    const run_result r = drive(link, o, {}, 1);
    CHECK(r.report.outcome == lynx::request_outcome::completed);
    CHECK(r.report.failures.empty());
    CHECK(r.committed == greedy_at(plan::streams, 1, first_token, tokens));
    CHECK(r.report.level_at.size() == 2);
    CHECK(r.report.level == 1);
  }
  SUBCASE("the peer dies after the anchors") {
    auto link = make_link();
    for (const auto& l : layers) post(link, l.segment(0), 0);
    link.run_until_idle();
    link.break_link(lynx::errc::peer_failure);
    const run_result r = drive(link, options(lynx::failure_policy::continue_unverified));
    CHECK(r.report.outcome == lynx::request_outcome::completed_unverified);
    REQUIRE(r.report.failures.size() == 1);
    CHECK(r.report.failures[0].status == lynx::errc::peer_failure);
    CHECK(r.report.failures[0].what == "the link failed: peer_failure");
  }
  SUBCASE("bad options are refused") {
    auto t = receivers();
    received_type received(t);
    auto link = make_link();
    auto o = options(lynx::failure_policy::fail_request);
    auto make = [&] { sim_driver d(received, link.receiver(), o, {}, lynx::simulated_time(link)); };
    o.target_level = 3;
    CHECK_THROWS_AS(make(), lynx::error);
    o.target_level = 0;
    o.failure.after_rerequests = lynx::failure_policy::rerequest;
    CHECK_THROWS_AS(make(), lynx::error);
  }
}

TEST_CASE("the same loop on the steady clock: loopback transport, exact tokens") {
  const auto layers = encode_all();
  lynx::loopback_link link;
  for (const auto& l : layers)
    for (int s = 0; s < plan::streams; ++s) {
      const auto bytes = l.segment(s);
      const lynx::segment_header h = lynx::peek_header(bytes);
      REQUIRE(link.sender()
                  .post({bytes,
                         {h.layer, s, h.generation},
                         lynx::lane_for_stream(s, 2),
                         static_cast<std::uint8_t>(s)})
                  .ok());
    }
  auto t = receivers();
  received_type received(t);
  toy_engine e;
  e.levels = plan::streams;
  lynx::session_options so;
  so.max_new_tokens = tokens;
  session_type s(e, lynx::greedy_verifier{}, plan::streams, prompt_tokens, first_token, so);
  using receiver_type = std::remove_reference_t<decltype(link.receiver())>;
  lynx::request_driver<received_type, session_type, receiver_type> d(
      received, link.receiver(), options(lynx::failure_policy::fail_request));
  d.attach(s);
  const auto rep = d.run();
  CHECK(rep.outcome == lynx::request_outcome::completed);
  CHECK(s.committed() == greedy_at(plan::streams, plan::streams, first_token, tokens));
  CHECK(rep.segments_accepted == n_layers * plan::streams);
  REQUIRE(rep.level_at[2].has_value());
  CHECK(*rep.level_at[2] >= rep.started);
}
