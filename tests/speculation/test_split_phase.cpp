// Split-phase sessions (progressive_session::prepare / complete): eight
// sessions stepped together, one gathered round of forwards at a time (as an
// engine that batches them would run them), commit exactly what each commits
// stepped alone with step(): the same tokens, the same forwards, the same
// statistics, greedy and sampling, with planes landing at different steps for
// each request. Misuse (prepare twice, complete without prepare, logits of the
// wrong size) is refused.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/speculation/verifier.hpp"
#include "toy_engine.hpp"

using lynx_test::toy_engine;

namespace {

constexpr int requests = 8, tokens = 30, levels = 3;

lynx::session_options options_of(int r) {
  lynx::session_options o;
  o.max_draft = 2 + r % 4;
  o.max_draft_in_flight = r % 2 == 0 ? 0 : 10;
  o.max_new_tokens = tokens;
  return o;
}

// Round at which request r's level l becomes available (l = 1 .. levels).
int lands_at(int r, int l) { return (r * 3 + l * (2 + r % 3)) % 9 + l; }

struct outcome {
  std::vector<std::int32_t> committed;
  std::int64_t forwards = 0, drafts = 0, verifications = 0;
};

template <class Verifier>
std::vector<outcome> alone(const Verifier& v) {
  std::vector<outcome> out;
  for (int r = 0; r < requests; ++r) {
    toy_engine e;
    e.levels = levels;
    lynx::progressive_session s(e, v, levels, 50 + r, r % toy_engine::vocab, options_of(r));
    for (int round = 0; !s.finished(); ++round) {
      REQUIRE(round < 10000);
      for (int l = s.available_level() + 1; l <= levels; ++l)
        if (round >= lands_at(r, l)) s.set_available_level(l);
      (void)s.step();
    }
    out.push_back(
        {s.committed(), s.stats().forwards, s.stats().draft_tokens, s.stats().verifications});
  }
  return out;
}

template <class Verifier>
std::vector<outcome> together(const Verifier& v) {
  std::vector<toy_engine> engines(requests);
  std::vector<lynx::progressive_session<toy_engine, Verifier>> sessions;
  sessions.reserve(requests);
  for (int r = 0; r < requests; ++r) {
    engines[r].levels = levels;
    sessions.emplace_back(engines[r], v, levels, 50 + r, r % toy_engine::vocab, options_of(r));
  }
  std::vector<float> logits;  // every forward of a round, back to back
  for (int round = 0;; ++round) {
    REQUIRE(round < 10000);
    bool all_done = true;
    std::vector<lynx::forward_request> asked(requests);
    for (int r = 0; r < requests; ++r) {
      auto& s = sessions[static_cast<std::size_t>(r)];
      for (int l = s.available_level() + 1; l <= levels; ++l)
        if (round >= lands_at(r, l)) s.set_available_level(l);
      asked[r] = s.prepare();
      all_done &= asked[r].kind == lynx::step_kind::done;
    }
    if (all_done) break;
    // One gathered round: every forward asked for, into one buffer.
    std::vector<std::size_t> at(requests);
    logits.clear();
    for (int r = 0; r < requests; ++r) {
      at[r] = logits.size();
      const auto& f = asked[r];
      if (f.kind == lynx::step_kind::idle || f.kind == lynx::step_kind::done) continue;
      logits.resize(logits.size() + f.tokens.size() * toy_engine::vocab);
      engines[r].forward(
          f.tokens, f.position, f.level,
          std::span<float>(logits).subspan(at[r], f.tokens.size() * toy_engine::vocab));
    }
    for (int r = 0; r < requests; ++r) {
      const auto& f = asked[r];
      if (f.kind == lynx::step_kind::idle || f.kind == lynx::step_kind::done) continue;
      const auto step = sessions[static_cast<std::size_t>(r)].complete(
          std::span<const float>(logits).subspan(at[r], f.tokens.size() * toy_engine::vocab));
      CHECK(step.kind == f.kind);
    }
  }
  std::vector<outcome> out;
  for (const auto& s : sessions)
    out.push_back(
        {s.committed(), s.stats().forwards, s.stats().draft_tokens, s.stats().verifications});
  return out;
}

template <class Verifier>
void compare(const Verifier& v) {
  const auto a = alone(v), b = together(v);
  for (int r = 0; r < requests; ++r) {
    CAPTURE(r);
    CHECK(b[r].committed == a[r].committed);
    CHECK(b[r].committed.size() == tokens);
    CHECK(b[r].forwards == a[r].forwards);
    CHECK(b[r].drafts == a[r].drafts);
    CHECK(b[r].verifications == a[r].verifications);
  }
}

}  // namespace

TEST_CASE("split-phase sessions stepped together commit what each commits alone") {
  SUBCASE("greedy") { compare(lynx::greedy_verifier{}); }
  SUBCASE("speculative sampling") {
    lynx::sampling_verifier v;
    v.temperature = 0.8f;
    v.rng.seed = 99;
    compare(v);
  }
}

TEST_CASE("split-phase misuse is refused") {
  toy_engine e;
  e.levels = 2;
  lynx::session_options o;
  o.max_new_tokens = 10;
  lynx::progressive_session s(e, lynx::greedy_verifier{}, 2, 10, 1, o);
  std::vector<float> row(toy_engine::vocab);
  CHECK_THROWS_AS(s.complete(row), lynx::error);     // nothing asked
  CHECK(s.prepare().kind == lynx::step_kind::idle);  // no planes yet: nothing pending
  s.set_available_level(1);
  const auto f = s.prepare();
  REQUIRE(f.kind == lynx::step_kind::draft);
  CHECK_THROWS_AS(s.prepare(), lynx::error);  // the forward is still pending
  std::vector<float> wrong(toy_engine::vocab + 1);
  CHECK_THROWS_AS(s.complete(wrong), lynx::error);
  e.forward(f.tokens, f.position, f.level, row);
  CHECK(s.complete(row).kind == lynx::step_kind::draft);
}
