// One disaggregated request on the real model (stories260K) across two real
// processes on loopback: a forked prefill process (examples/disagg/prefill_node.hpp)
// sends over TCP (or UCX) to the decode node running in the test process
// (examples/disagg/decode_node.hpp). Checks: the committed tokens equal plain
// greedy decoding with every plane present (8 = 4 + 4), and fp32 greedy
// decoding (16 = 4 + 12); the prefill process killed mid-residual under each
// failure policy; a stalled prefill caught by the residual deadline; stale
// segments of the previous generation ignored and reported. Every child has an
// alarm() and dies with the test; every wait has a deadline.
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "../support/real_model.hpp"
#include "../transport_net/net_fixtures.hpp"
#include "disagg/decode_node.hpp"
#include "disagg/prefill_node.hpp"
#include "lynx/transport/tcp.hpp"
#if defined(LYNX_WITH_UCX)
#include "lynx/transport/ucx.hpp"
#endif

namespace ll = lynx_examples::llama2c;
namespace dg = lynx_examples::disagg;

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

constexpr int committed_tokens = 64;
constexpr int prompt_tokens = 256;
constexpr std::uint64_t generation = 7;

clock_type::time_point in(clock_type::duration d) { return clock_type::now() + d; }

using lynx_tests::model_or_skip;
using lynx_tests::real_model;

std::vector<int> prompt_of(std::uint64_t seed) {
  return ll::sample_prompt(*real_model(), seed, prompt_tokens);
}

/// Bytes of one residual segment (stream 1) of this request: a scheduler window
/// of exactly that keeps the prefill process from running ahead of the decode
/// side's acks, so a kill after k residuals leaves most of them missing.
template <class Plan>
std::size_t residual_segment_bytes() {
  const ll::config& c = real_model()->cfg();
  return lynx::segment_bytes(
      lynx::make_geometry<Plan, 32>(lynx::kv_shape{prompt_tokens, c.n_kv_heads, c.head_size()}), 1);
}

/// What the prefill process does wrong, if anything. A faulty one sends every
/// anchor and the residual of the first `residual_layers` layers, waits until
/// they are delivered, then dies (SIGKILL) or stalls with the link open.
struct prefill_fault {
  enum kind_t { none, die, stall } kind = none;
  int residual_layers = 2;
  int stale_layers = 0;  // first send anchors of generation - 1
};

/// The prefill process: connects to the decode side's port, runs the prefill
/// node, exits 0 when every segment was delivered.
template <class Plan>
int prefill_process(std::uint16_t port, const std::vector<int>& prompt, prefill_fault fault,
                    std::vector<lynx::segment_id> only) {
  auto sender = lynx::tcp_sender::connect("127.0.0.1", port, in(10s));
  dg::prefill_node_options<lynx::tcp_sender> o;
  o.generation = generation;
  o.residual_window = residual_segment_bytes<Plan>();
  o.stale_anchor_layers = fault.stale_layers;
  o.only = std::move(only);
  if (fault.kind != prefill_fault::none) {
    for (int l = 0; l < real_model()->cfg().n_layers; ++l) {
      o.only.push_back({static_cast<std::uint32_t>(l), 0, generation});
      for (int s = 1; s < Plan::streams && l < fault.residual_layers; ++s)
        o.only.push_back({static_cast<std::uint32_t>(l), s, generation});
    }
  }
  const bool ok =
      dg::run_prefill_node<Plan>(sender, *real_model(), prompt, o).status == lynx::errc::ok;
  if (fault.kind == prefill_fault::die)
    ::raise(SIGKILL);  // mid-residual: the rest of it never comes
  if (fault.kind == prefill_fault::stall)
    std::this_thread::sleep_for(60s);  // link open, nothing sent; the alarm or the test ends it
  return ok ? 0 : 1;
}

struct run_outcome {
  dg::decode_result decode;
  int prefill_exit = -2, resend_exit = -2;
  double decode_seconds = 0;  // wall time of run_decode_node
  std::size_t held_after =
      0;  // segments the receiver still held at the end (must be 0: released after accept)
};

/// One request: the prefill in a forked process, the decode node here, over TCP.
/// With the rerequest policy, a resend starts a second prefill process that
/// sends only the missing segments on a new connection.
template <class Plan>
run_outcome run_tcp(const std::vector<int>& prompt, prefill_fault fault,
                    lynx::failure_options failure,
                    lynx::request_deadlines deadlines = {10'000ms, 10'000ms, 60'000ms}) {
  lynx::tcp_listener listener;
  const std::uint16_t port = listener.port();
  lynx::test::child_process prefill([&] { return prefill_process<Plan>(port, prompt, fault, {}); },
                                    60);
  REQUIRE(prefill.started());
  std::unique_ptr<lynx::test::child_process> resender;
  auto receiver = lynx::tcp_receiver::accept(listener, in(10s));
  std::optional<lynx::tcp_receiver> resent;
  run_outcome out;

  dg::decode_node_options o;
  o.generation = generation;
  o.committed_tokens = committed_tokens;
  o.failure = failure;
  o.deadlines = deadlines;
  dg::decode_node_hooks<lynx::tcp_receiver> hooks;
  hooks.rerequest = [&](const lynx::resend_request& req) -> lynx::tcp_receiver* {
    CHECK(req.generation == generation);
    CHECK_FALSE(req.missing.empty());
    // The old process is dead: reap it before forking another from this (single-threaded) process.
    out.prefill_exit = prefill.wait(in(10s));
    const auto missing = req.missing;
    resender = std::make_unique<lynx::test::child_process>(
        [&, missing] { return prefill_process<Plan>(port, prompt, {}, missing); }, 60);
    resent.emplace(lynx::tcp_receiver::accept(listener, in(10s)));
    return &*resent;
  };
  const auto t0 = clock_type::now();
  out.decode =
      dg::run_decode_node<Plan>(*real_model(), static_cast<int>(prompt.size()), receiver, o, hooks);
  out.decode_seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  out.held_after = receiver.held() + (resent ? resent->held() : 0);
  if (fault.kind == prefill_fault::stall) prefill.kill(SIGKILL);
  if (!resender) out.prefill_exit = prefill.wait(in(20s));  // else reaped in the hook
  if (resender) out.resend_exit = resender->wait(in(20s));
  return out;
}

std::vector<int> tokens_of(const dg::decode_result& r) {
  std::vector<int> t;
  for (const auto& c : r.commits) t.push_back(c.token);
  return t;
}

}  // namespace

TEST_CASE(
    "two processes over TCP, 8 = 4 + 4: committed tokens equal plain greedy decoding with every "
    "plane present") {
  ::alarm(300);
  if (!model_or_skip()) return;
  for (const std::uint64_t seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    const auto prompt = prompt_of(seed);
    const auto want =
        dg::plain_greedy_reference<lynx::plan_8_4_4>(*real_model(), prompt, committed_tokens);
    const run_outcome r = run_tcp<lynx::plan_8_4_4>(prompt, {}, {});
    CHECK(r.decode.outcome == lynx::request_outcome::completed);
    CHECK(r.decode.failures.empty());
    CHECK(tokens_of(r.decode) == want);
    CHECK(r.decode.tl.tokens == want);
    for (const auto& c : r.decode.commits) CHECK(c.verified);
    CHECK(r.decode.stats.unverified_tokens == 0);
    CHECK(r.decode.level == 2);
    CHECK(r.decode.segments_accepted == 2 * real_model()->cfg().n_layers);
    CHECK(r.decode.rejected.empty());
    CHECK(r.held_after == 0);
    CHECK(r.prefill_exit ==
          0);  // every segment acked: delivered, buffers released after their final completion
    CHECK(r.decode.tl.anchor_landed >= 0);
    CHECK(r.decode.tl.residual_landed >= r.decode.tl.anchor_landed);
    // the residual landed, so the prompt was merged into codes meanwhile (the
    // tokens above are the same whichever layers were read as codes)
    if (r.decode.codes_ready >= 0) CHECK(r.decode.codes_ready >= r.decode.tl.residual_landed);
    MESSAGE("seed " << seed << ": decode " << r.decode_seconds * 1e3 << " ms; drafts accepted "
                    << r.decode.tl.accepted_drafts << " of " << r.decode.tl.verified_drafts
                    << "; codes ready at " << r.decode.codes_ready * 1e3 << " ms (merge "
                    << r.decode.merge_seconds * 1e6 << " us), full-level layer attentions on codes "
                    << r.decode.full_level_on_codes << ", on planes "
                    << r.decode.full_level_on_planes);
  }
}

TEST_CASE("two processes over TCP, 16 = 4 + 12: committed tokens equal fp32 greedy decoding") {
  ::alarm(300);
  if (!model_or_skip()) return;
  for (const std::uint64_t seed : {4u, 5u}) {
    CAPTURE(seed);
    const auto prompt = prompt_of(seed);
    ll::engine<> e(*real_model());
    const std::vector<int> fp32 = ll::generate_greedy(e, prompt, committed_tokens);
    const run_outcome r = run_tcp<lynx::plan_16_4_12>(prompt, {}, {});
    CHECK(r.decode.outcome == lynx::request_outcome::completed);
    CHECK(tokens_of(r.decode) == fp32);
    CHECK(r.held_after == 0);
    CHECK(r.prefill_exit == 0);
  }
}

TEST_CASE(
    "prefill killed mid-residual, fail_request: the decode side reports a failed request at once, "
    "nothing more committed") {
  ::alarm(120);
  if (!model_or_skip()) return;
  const auto prompt = prompt_of(11);
  const auto want =
      dg::plain_greedy_reference<lynx::plan_8_4_4>(*real_model(), prompt, committed_tokens);
  const run_outcome r = run_tcp<lynx::plan_8_4_4>(prompt, {.kind = prefill_fault::die},
                                                  {lynx::failure_policy::fail_request});
  CHECK(r.prefill_exit == 128 + SIGKILL);
  CHECK(r.decode.outcome == lynx::request_outcome::failed);
  REQUIRE(r.decode.failures.size() == 1);
  CHECK(r.decode.failures[0].status == lynx::errc::peer_failure);
  CHECK(r.decode.failures[0].applied == lynx::failure_policy::fail_request);
  CHECK_FALSE(r.decode.failure.empty());
  CHECK(r.decode_seconds < 10.0);  // the residual deadline: the death was reported, not waited out
  CHECK(r.decode.level == 1);      // anchors all landed, the residual did not
  CHECK(r.decode.commits.size() < static_cast<std::size_t>(committed_tokens));
  // What was committed before the failure is exact: the prefill's own token, never a draft.
  REQUIRE_FALSE(r.decode.commits.empty());
  for (std::size_t i = 0; i < r.decode.commits.size(); ++i) {
    CHECK(r.decode.commits[i].verified);
    CHECK(r.decode.commits[i].token == want[i]);
  }
  CHECK(r.held_after == 0);
}

TEST_CASE(
    "prefill killed mid-residual, continue_unverified: tokens keep coming, every one after the "
    "failure marked unverified") {
  ::alarm(120);
  if (!model_or_skip()) return;
  const auto prompt = prompt_of(12);
  const auto want =
      dg::plain_greedy_reference<lynx::plan_8_4_4>(*real_model(), prompt, committed_tokens);
  // Decoding on at the anchor alone: plain greedy decoding at level 1 of the same cache.
  const auto anchor_only =
      dg::plain_greedy_reference<lynx::plan_8_4_4>(*real_model(), prompt, committed_tokens, 1);
  const run_outcome r = run_tcp<lynx::plan_8_4_4>(prompt, {.kind = prefill_fault::die},
                                                  {lynx::failure_policy::continue_unverified});
  CHECK(r.prefill_exit == 128 + SIGKILL);
  CHECK(r.decode.outcome == lynx::request_outcome::completed_unverified);
  REQUIRE(r.decode.failures.size() == 1);
  CHECK(r.decode.failures[0].status == lynx::errc::peer_failure);
  CHECK(r.decode.failures[0].applied == lynx::failure_policy::continue_unverified);
  REQUIRE(r.decode.commits.size() == static_cast<std::size_t>(committed_tokens));
  // A verified prefix (equal to the reference), then only unverified tokens.
  std::size_t verified = 0;
  while (verified < r.decode.commits.size() && r.decode.commits[verified].verified) ++verified;
  CHECK(verified >= 1);
  for (std::size_t i = verified; i < r.decode.commits.size(); ++i)
    CHECK_FALSE(r.decode.commits[i].verified);
  CHECK(r.decode.stats.unverified_tokens ==
        static_cast<std::int64_t>(r.decode.commits.size() - verified));
  for (std::size_t i = 0; i < verified; ++i) CHECK(r.decode.commits[i].token == want[i]);
  CHECK(tokens_of(r.decode) == anchor_only);
  std::size_t same = 0;
  while (same < want.size() && want[same] == anchor_only[same]) ++same;
  MESSAGE("verified prefix " << verified << " tokens; anchor-only decoding agrees with 8-bit for "
                             << same << " of " << committed_tokens);
  CHECK(r.held_after == 0);
}

TEST_CASE(
    "prefill killed mid-residual, rerequest: a second prefill process resends the missing "
    "segments; tokens equal the reference") {
  ::alarm(120);
  if (!model_or_skip()) return;
  const auto prompt = prompt_of(13);
  const auto want =
      dg::plain_greedy_reference<lynx::plan_8_4_4>(*real_model(), prompt, committed_tokens);
  const run_outcome r = run_tcp<lynx::plan_8_4_4>(prompt, {.kind = prefill_fault::die},
                                                  {lynx::failure_policy::rerequest, 1});
  CHECK(r.prefill_exit == 128 + SIGKILL);
  CHECK(r.resend_exit == 0);
  CHECK(r.decode.rerequests == 1);
  REQUIRE(r.decode.failures.size() == 1);
  CHECK(r.decode.failures[0].status == lynx::errc::peer_failure);
  CHECK(r.decode.failures[0].applied == lynx::failure_policy::rerequest);
  CHECK(r.decode.outcome == lynx::request_outcome::completed);
  CHECK(tokens_of(r.decode) == want);
  for (const auto& c : r.decode.commits) CHECK(c.verified);
  CHECK(r.decode.level == 2);
  CHECK(r.decode.rejected.empty());
  CHECK(r.held_after == 0);
}

TEST_CASE(
    "rerequest that cannot be answered falls back to after_rerequests; a stalled prefill is caught "
    "by the residual deadline") {
  ::alarm(120);
  if (!model_or_skip()) return;
  const auto prompt = prompt_of(14);
  // The prefill stops sending but keeps the link open: only the deadline can tell.
  lynx::failure_options f{lynx::failure_policy::rerequest, 0,
                          lynx::failure_policy::continue_unverified};
  const run_outcome r = run_tcp<lynx::plan_8_4_4>(prompt, {.kind = prefill_fault::stall}, f,
                                                  {10'000ms, 700ms, 60'000ms});
  REQUIRE(r.decode.failures.size() == 1);
  CHECK(r.decode.failures[0].status == lynx::errc::timeout);
  CHECK(r.decode.failures[0].applied == lynx::failure_policy::continue_unverified);
  CHECK(r.decode.outcome == lynx::request_outcome::completed_unverified);
  CHECK(r.decode.commits.size() == static_cast<std::size_t>(committed_tokens));
  CHECK(r.decode.stats.unverified_tokens >= 1);
  CHECK(r.decode_seconds < 10.0);
  CHECK(r.prefill_exit == 128 + SIGKILL);  // killed by the test after the decode side let go

  // The same stall with fail_request: a failed request, reported at the deadline.
  const run_outcome g =
      run_tcp<lynx::plan_8_4_4>(prompt, {.kind = prefill_fault::stall},
                                {lynx::failure_policy::fail_request}, {10'000ms, 700ms, 60'000ms});
  CHECK(g.decode.outcome == lynx::request_outcome::failed);
  REQUIRE(g.decode.failures.size() == 1);
  CHECK(g.decode.failures[0].status == lynx::errc::timeout);
  CHECK(g.decode_seconds < 10.0);
}

TEST_CASE(
    "segments of the previous generation are ignored and reported; the request is still exact") {
  ::alarm(120);
  if (!model_or_skip()) return;
  const auto prompt = prompt_of(15);
  const auto want =
      dg::plain_greedy_reference<lynx::plan_8_4_4>(*real_model(), prompt, committed_tokens);
  const int layers = real_model()->cfg().n_layers;
  const run_outcome r = run_tcp<lynx::plan_8_4_4>(prompt, {.stale_layers = layers}, {});
  CHECK(r.decode.outcome == lynx::request_outcome::completed);
  CHECK(r.decode.stale == layers);
  CHECK(r.decode.count(lynx::errc::stale_generation) == layers);
  for (const auto& x : r.decode.rejected) {
    CHECK(x.status == lynx::errc::stale_generation);
    CHECK(x.id.generation == generation - 1);
    CHECK(x.id.stream == 0);
  }
  CHECK(tokens_of(r.decode) ==
        want);  // the stale anchors carry other contents: applied, they would change the tokens
  CHECK(r.held_after == 0);
  CHECK(r.prefill_exit == 0);
}

#if defined(LYNX_WITH_UCX)
/// One request over UCX (tcp on lo) between this process (decode) and a forked
/// prefill child. UCX state is never forked: the child is forked first and
/// learns the listener's port through a pipe. `prefill_options` adjusts the
/// child's prefill_node_options; the child exits 0 when its request completed.
/// A case asks lynx::test::ucx_or_skip() first: where UCX cannot listen on
/// loopback the UCX cases are skipped, and a listener that fails after the
/// probe succeeded fails the case.
class ucx_request {
 public:
  template <class Plan, class Adjust>
  ucx_request(Plan, const std::vector<int>& prompt, Adjust prefill_options) {
    ::setenv("UCX_TLS", "tcp", 1);
    ::setenv("UCX_NET_DEVICES", "lo", 1);
    REQUIRE(::pipe(fds_) == 0);
    prefill_.emplace(
        [&, prefill_options] {
          std::uint16_t port = 0;
          if (::read(fds_[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) return 3;
          lynx::ucx_sender sender("127.0.0.1", port, in(10s));
          dg::prefill_node_options<lynx::ucx_sender> o;
          o.generation = generation;
          o.residual_window = residual_segment_bytes<Plan>();
          prefill_options(o);
          return dg::run_prefill_node<Plan>(sender, *real_model(), prompt, o).status ==
                         lynx::errc::ok
                     ? 0
                     : 1;
        },
        60);
    receiver_ = std::make_unique<lynx::ucx_receiver>("127.0.0.1", 0);
    const std::uint16_t port = receiver_->port();
    REQUIRE(::write(fds_[1], &port, sizeof port) == static_cast<ssize_t>(sizeof port));
    receiver_->accept(in(10s));
  }
  ucx_request(const ucx_request&) = delete;
  ucx_request& operator=(const ucx_request&) = delete;
  ~ucx_request() {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  lynx::ucx_receiver& receiver() { return *receiver_; }
  lynx::test::child_process& prefill() { return *prefill_; }

 private:
  int fds_[2] = {-1, -1};
  std::optional<lynx::test::child_process> prefill_;
  std::unique_ptr<lynx::ucx_receiver> receiver_;
};

TEST_CASE(
    "two processes over UCX (tcp on lo), 8 = 4 + 4: committed tokens equal plain greedy decoding") {
  ::alarm(120);
  if (!model_or_skip() || !lynx::test::ucx_or_skip()) return;
  using plan = lynx::plan_8_4_4;
  const auto prompt = prompt_of(21);
  const auto want = dg::plain_greedy_reference<plan>(*real_model(), prompt, committed_tokens);
  ucx_request req(plan{}, prompt, [](auto& o) { o.stale_anchor_layers = 1; });
  dg::decode_node_options o;
  o.generation = generation;
  o.committed_tokens = committed_tokens;
  const auto r = dg::run_decode_node<plan>(*real_model(), prompt_tokens, req.receiver(), o);
  CHECK(r.outcome == lynx::request_outcome::completed);
  CHECK(tokens_of(r) == want);
  CHECK(r.stale == 1);
  CHECK(req.receiver().held() == 0);
  CHECK(req.prefill().wait(in(20s)) == 0);
}

TEST_CASE(
    "UCX: prefill killed mid-residual, fail_request: reported as a failed request within the "
    "deadline") {
  ::alarm(120);
  if (!model_or_skip() || !lynx::test::ucx_or_skip()) return;
  using plan = lynx::plan_8_4_4;
  const auto prompt = prompt_of(22);
  ucx_request req(plan{}, prompt, [](auto& o) {
    o.on_final = [residuals = 0](const auto& rec) mutable {
      if (rec.delivered && rec.id.stream != 0 && ++residuals == 2) ::raise(SIGKILL);
    };
  });
  dg::decode_node_options o;
  o.generation = generation;
  o.committed_tokens = committed_tokens;
  o.deadlines = {10'000ms, 10'000ms, 60'000ms};
  const auto t0 = clock_type::now();
  const auto r = dg::run_decode_node<plan>(*real_model(), prompt_tokens, req.receiver(), o);
  CHECK(std::chrono::duration<double>(clock_type::now() - t0).count() < 10.0);
  CHECK(r.outcome == lynx::request_outcome::failed);
  REQUIRE(r.failures.size() == 1);
  CHECK(r.failures[0].status == lynx::errc::peer_failure);
  CHECK(req.prefill().wait(in(20s)) == 128 + SIGKILL);
}
#else
TEST_CASE("two processes over UCX") {
  lynx_tests::skip_case(
      "the UCX cases: built without UCX (the test links lynx::ucx only when the build adds it; "
      "LYNX_WITH_UCX undefined)");
}
#endif
