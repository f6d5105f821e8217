// The decode side's failure policy at the session level (toy engine with known
// logits): continue_unverified decodes on at the level present, committing
// exactly that level's greedy tokens, each flagged unverified and counted;
// nothing changes when every level is present; it needs the anchor. Plus the
// policy names and the resend request's segment list text.
#include <doctest/doctest.h>

#include <vector>

#include "lynx/speculation/failure_policy.hpp"
#include "lynx/speculation/session.hpp"
#include "toy_engine.hpp"

using lynx_test::greedy_at;
using lynx_test::toy_engine;

namespace {

constexpr int tokens = 40;

}  // namespace

TEST_CASE(
    "continue_unverified mid-draft: the level present becomes the target; every later token is "
    "flagged and counted") {
  for (const int drafts_before : {0, 1, 3, 8}) {
    for (const int max_draft : {0, 4, 8}) {
      CAPTURE(drafts_before);
      CAPTURE(max_draft);
      toy_engine e;
      e.levels = 2;
      lynx::session_options o;
      o.max_draft = max_draft;
      o.max_new_tokens = tokens;
      lynx::progressive_session s(e, lynx::greedy_verifier{}, 2, 100, 3, o);
      std::vector<lynx::committed_token> events;
      s.on_commit_event([&](const lynx::committed_token& t) { events.push_back(t); });
      REQUIRE(events.size() == 1);  // the prefill's own token, replayed
      CHECK(events[0].verified);
      CHECK(events[0].position == 100);
      s.set_available_level(1);
      for (int i = 0; i < drafts_before; ++i) s.step();
      CHECK(s.committed().size() == 1);  // drafts are never committed by themselves
      s.continue_unverified("the residual's sender died");
      CHECK(s.unverified());
      CHECK(s.target_level() == 1);
      CHECK(s.requested_level() == 2);
      CHECK(s.failure() == "the residual's sender died");
      for (int guard = 0; !s.finished(); ++guard) {
        REQUIRE(guard < 1000);
        CHECK(s.step().kind != lynx::step_kind::idle);  // never waits for planes that will not come
      }
      CHECK(s.state() == lynx::session_state::finished);
      const auto want = greedy_at(2, 1, 3, tokens);
      CHECK(s.committed() == want);
      REQUIRE(events.size() == static_cast<std::size_t>(tokens));
      for (std::size_t i = 0; i < events.size(); ++i) {
        CAPTURE(i);
        CHECK(events[i].token == want[i]);
        CHECK(events[i].position == 100 + static_cast<std::int64_t>(i));
        CHECK(events[i].verified == (i == 0));
      }
      CHECK(s.stats().unverified_tokens == tokens - 1);
      CHECK(s.verified_tokens() == 1);
      // The tail holds every committed token but the last, all at the degraded level.
      CHECK(e.tail == std::vector<std::int32_t>(want.begin(), want.end() - 1));
      for (const int l : e.tail_level) CHECK(l == 1);
    }
  }
}

TEST_CASE(
    "continue_unverified with three streams: drafts of level 1 are verified at level 2, the new "
    "target") {
  for (const int drafts_before : {0, 2, 6}) {
    CAPTURE(drafts_before);
    toy_engine e;
    e.levels = 3;
    lynx::session_options o;
    o.max_new_tokens = tokens;
    lynx::progressive_session s(e, lynx::greedy_verifier{}, 3, 100, 1, o);
    s.set_available_level(1);
    for (int i = 0; i < drafts_before; ++i) s.step();
    s.set_available_level(2);
    s.continue_unverified("stream 2 timed out");
    while (!s.finished()) s.step();
    CHECK(s.committed() == greedy_at(3, 2, 1, tokens));
    CHECK(s.stats().unverified_tokens == tokens - 1);
  }
}

TEST_CASE(
    "continue_unverified changes nothing when every level is present; it needs the anchor; not "
    "after fail") {
  {
    toy_engine e;
    lynx::session_options o;
    o.max_new_tokens = tokens;
    lynx::progressive_session s(e, lynx::greedy_verifier{}, 2, 100, 4, o);
    s.set_available_level(2);
    s.continue_unverified("late report");
    CHECK_FALSE(s.unverified());
    while (!s.finished()) s.step();
    CHECK(s.committed() == greedy_at(2, 2, 4, tokens));
    CHECK(s.stats().unverified_tokens == 0);
    CHECK(s.verified_tokens() == tokens);
  }
  {
    toy_engine e;
    lynx::progressive_session s(e, lynx::greedy_verifier{}, 2, 100, 4);
    try {
      s.continue_unverified("nothing landed");
      FAIL("continue_unverified without the anchor must throw");
    } catch (const lynx::error& err) {
      CHECK(err.code() == lynx::errc::invalid_argument);
    }
    s.fail("the link broke");
    CHECK(s.state() == lynx::session_state::failed);
    s.set_available_level(1);
    CHECK_THROWS_AS(s.continue_unverified("too late"), lynx::error);
    CHECK_THROWS_AS(s.step(), lynx::error);
    CHECK(s.committed().size() == 1);
  }
}

TEST_CASE("failure policy names and resend segment lists round-trip; bad text is refused") {
  for (const auto p : {lynx::failure_policy::fail_request,
                       lynx::failure_policy::continue_unverified, lynx::failure_policy::rerequest})
    CHECK(lynx::parse_failure_policy(lynx::to_string(p)) == p);
  CHECK_THROWS_AS(lynx::parse_failure_policy("retry"), lynx::error);
  const std::vector<lynx::segment_id> ids{{0, 1, 9}, {3, 1, 9}, {12, 2, 9}};
  const std::string text = lynx::format_segment_list(ids);
  CHECK(text == "0:1,3:1,12:2");
  const auto back = lynx::parse_segment_list(text, 9);
  REQUIRE(back.size() == ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    CHECK(back[i].layer == ids[i].layer);
    CHECK(back[i].stream == ids[i].stream);
    CHECK(back[i].generation == 9);
  }
  CHECK(lynx::parse_segment_list("", 1).empty());
  for (const char* bad : {"1", "1:", ":1", "a:1", "1:b", "1:-1", "1:1,,2:1", "1:1x"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(lynx::parse_segment_list(bad, 1), lynx::error);
  }
}
