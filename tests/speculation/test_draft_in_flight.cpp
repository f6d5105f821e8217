// Drafting until the residual lands (session_options::max_draft_in_flight) on
// the toy engine: while no more planes have landed the session drafts past
// max_draft up to the in-flight limit, never past the request's end, and
// verifies per on_landing when they land; greedy decoding stays exact for every
// landing time, plan and policy; with the option off nothing changes.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "lynx/speculation/session.hpp"
#include "toy_engine.hpp"

using lynx_test::faithful_engine;
using lynx_test::greedy_at;
using lynx_test::toy_engine;

namespace {

constexpr std::int64_t prompt = 100;

lynx::session_options options(int max_draft, int in_flight, int tokens,
                              lynx::landing_policy policy = lynx::landing_policy::verify_now) {
  lynx::session_options o;
  o.max_draft = max_draft;
  o.max_draft_in_flight = in_flight;
  o.max_new_tokens = tokens;
  o.on_landing = policy;
  return o;
}

// Runs a session whose level l + 1 lands at step level_at[l]; returns every step's result.
template <class Engine>
std::vector<lynx::step_result> drive(Engine& e, const std::vector<int>& level_at,
                                     lynx::session_options o, std::int32_t first,
                                     std::vector<std::int32_t>* committed = nullptr) {
  lynx::progressive_session s(e, lynx::greedy_verifier{}, e.levels, prompt, first, o);
  std::vector<lynx::step_result> steps;
  for (int step = 0; !s.finished(); ++step) {
    REQUIRE(step < 10000);
    for (std::size_t l = 0; l < level_at.size(); ++l)
      if (step == level_at[l] && s.available_level() < static_cast<int>(l) + 1)
        s.set_available_level(static_cast<int>(l) + 1);
    steps.push_back(s.step());
  }
  if (committed) *committed = s.committed();
  return steps;
}

}  // namespace

TEST_CASE("draft in flight: the drafts cover the transfer, up to the in-flight limit") {
  for (const int land : {0, 1, 2, 3, 6, 10, 20}) {
    CAPTURE(land);
    faithful_engine e;
    std::vector<std::int32_t> got;
    const auto steps = drive(e, {0, land}, options(2, 10, 40), 0, &got);
    const int drafts = land < 10 ? land : 10;  // drafted before the residual landed
    for (int i = 0; i < drafts; ++i)
      CHECK(steps[static_cast<std::size_t>(i)].kind == lynx::step_kind::draft);
    for (int i = drafts; i < land; ++i)
      CHECK(steps[static_cast<std::size_t>(i)].kind == lynx::step_kind::idle);
    if (drafts > 0) {
      const auto& v = steps[static_cast<std::size_t>(land)];  // verified as it landed
      CHECK(v.kind == lynx::step_kind::verify);
      CHECK(v.drafted == drafts);
      CHECK(v.accepted == drafts);
      CHECK(v.committed == drafts + 1);
    } else {
      CHECK(steps[static_cast<std::size_t>(land)].kind == lynx::step_kind::decode);
    }
    CHECK(got == greedy_at(2, 2, 0, 40));
  }
}

TEST_CASE("draft in flight: never past the request's end; waits there for the residual") {
  faithful_engine e;
  lynx::progressive_session s(e, lynx::greedy_verifier{}, 2, prompt, 0, options(2, 32, 5));
  s.set_available_level(1);
  for (int i = 0; i < 4; ++i) CHECK(s.step().kind == lynx::step_kind::draft);
  CHECK(s.state() == lynx::session_state::waiting_for_residual);  // 4 drafts: all 5 tokens
  CHECK(s.step().kind == lynx::step_kind::idle);
  s.set_available_level(2);
  const auto v = s.step();
  CHECK(v.kind == lynx::step_kind::verify);
  CHECK(v.committed == 4);
  CHECK(s.finished());
  CHECK(s.committed() == std::vector<std::int32_t>{0, 1, 2, 3, 4});
}

TEST_CASE("draft in flight with finish_draft: drafts to max_draft after landing, else verifies") {
  {
    faithful_engine e;  // lands after 2 drafts: finish_draft goes on to max_draft (4)
    const auto steps = drive(e, {0, 2}, options(4, 10, 20, lynx::landing_policy::finish_draft), 0);
    for (int i = 0; i < 4; ++i)
      CHECK(steps[static_cast<std::size_t>(i)].kind == lynx::step_kind::draft);
    CHECK(steps[4].kind == lynx::step_kind::verify);
    CHECK(steps[4].drafted == 4);
  }
  {
    faithful_engine e;  // lands after 7 drafts, past max_draft: verified at once
    const auto steps = drive(e, {0, 7}, options(4, 10, 20, lynx::landing_policy::finish_draft), 0);
    CHECK(steps[7].kind == lynx::step_kind::verify);
    CHECK(steps[7].drafted == 7);
  }
}

TEST_CASE("draft in flight: greedy exactness for every landing time, plan and policy") {
  for (const int levels : {2, 3})
    for (const int max_draft : {0, 2, 8})
      for (const int in_flight : {0, 4, 16, 64})
        for (const int land : {0, 1, 3, 9, 30, 200})
          for (const int gap : {0, 3, 20})
            for (const auto policy :
                 {lynx::landing_policy::verify_now, lynx::landing_policy::finish_draft}) {
              CAPTURE(levels);
              CAPTURE(max_draft);
              CAPTURE(in_flight);
              CAPTURE(land);
              CAPTURE(gap);
              toy_engine e;
              e.levels = levels;
              std::vector<int> level_at{0, land};
              if (levels == 3) level_at.push_back(land + gap);
              std::vector<std::int32_t> got;
              drive(e, level_at, options(max_draft, in_flight, 40, policy), 5, &got);
              CHECK(got == greedy_at(levels, levels, 5, 40));
              CHECK(e.tail_size() == 39);
              for (const int l : e.tail_level) CHECK(l == levels);
            }
}

TEST_CASE("draft in flight off (0 or at most max_draft): the steps of today") {
  for (const int land : {1, 5, 12}) {
    CAPTURE(land);
    toy_engine a, b, c;
    const auto off = drive(a, {0, land}, options(4, 0, 30), 1);
    const auto same = drive(b, {0, land}, options(4, 4, 30), 1);
    const auto below = drive(c, {0, land}, options(4, 2, 30), 1);
    REQUIRE(off.size() == same.size());
    REQUIRE(off.size() == below.size());
    for (std::size_t i = 0; i < off.size(); ++i) {
      CHECK(off[i].kind == same[i].kind);
      CHECK(off[i].drafted == same[i].drafted);
      CHECK(off[i].kind == below[i].kind);
      CHECK(off[i].drafted == below[i].drafted);
    }
    CHECK(a.tail == b.tail);
  }
  toy_engine e;
  CHECK_THROWS_AS(
      (lynx::progressive_session(e, lynx::greedy_verifier{}, 2, prompt, 1, options(4, -1, 10))),
      lynx::error);
}
