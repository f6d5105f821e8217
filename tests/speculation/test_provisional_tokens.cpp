// The provisional token stream of the progressive session (on_token_event), on
// the toy engine with known logits: drafts are delivered as provisional when
// drafted, a retraction takes back exactly the rejected tail, and commits follow
// as through on_commit_event. The invariant: replaying the stream (append a
// provisional token, pop on a retraction, mark a commit) ends with exactly the
// committed tokens, and every commit either confirms the provisional token at
// its position or adds a token where none stands (a correction, a bonus token,
// an exact step). Exact event lists for small cases; the invariant over a sweep
// of draft limits, landing times, plans, failure policies and verifiers.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "lynx/speculation/session.hpp"
#include "toy_engine.hpp"

using lynx::token_event;
using lynx::token_event_kind;
using lynx_test::faithful_engine;
using lynx_test::greedy_at;
using lynx_test::toy_engine;

namespace {

constexpr std::int64_t prompt = 100;

// Three levels whose middle one decides as the target does: the level-1 drafts the
// target would reject are already rejected at level 2 (an intermediate retraction).
struct sharp_middle_engine : toy_engine {
  void forward(std::span<const std::int32_t> tokens, std::int64_t position, int level,
               std::span<float> logits) {
    toy_engine::forward(tokens, position, level == 2 ? levels : level, logits);
  }
};

// Replays a token event stream as an application would, checking it as it goes.
struct replay {
  std::vector<std::int32_t> shown;  // committed tokens, then the provisional ones
  std::size_t committed = 0;
  std::int64_t provisional = 0, confirmed = 0, added = 0, retracted = 0, retractions = 0;
  std::vector<bool> verified;
  std::vector<token_event> events;

  void operator()(const token_event& e) {
    events.push_back(e);
    const auto standing = static_cast<std::int64_t>(shown.size());
    switch (e.kind) {
      case token_event_kind::provisional:
        CHECK(e.position == prompt + standing);  // right after the tokens standing
        CHECK(e.count == 1);
        CHECK_FALSE(e.verified);
        CHECK(e.level >= 1);
        shown.push_back(e.token);
        ++provisional;
        break;
      case token_event_kind::retract:
        REQUIRE(e.count >= 1);
        REQUIRE(e.count <= standing - static_cast<std::int64_t>(committed));  // provisional only
        CHECK(e.position == prompt + standing - e.count);
        shown.resize(shown.size() - static_cast<std::size_t>(e.count));
        retracted += e.count;
        ++retractions;
        break;
      case token_event_kind::commit:
        REQUIRE(e.position == prompt + static_cast<std::int64_t>(committed));  // in order
        CHECK(e.count == 1);
        if (shown.size() > committed) {
          CHECK(shown[committed] == e.token);  // confirms the provisional token there
          ++confirmed;
        } else {
          shown.push_back(e.token);  // a correction, a bonus token or an exact step
          ++added;
        }
        ++committed;
        verified.push_back(e.verified);
        break;
    }
  }
  // The provisional tokens standing.
  [[nodiscard]] std::int64_t pending() const {
    return static_cast<std::int64_t>(shown.size() - committed);
  }
};

struct plan {
  std::vector<int> level_at;  // step index at which level l + 1 becomes available
  int unverified_at = -1;     // step index of continue_unverified (-1: never)
};

// Drives a session through `p`, replaying its events; checks per step that a draft
// shows one token (when the request could commit it) and a verification retracts
// step_result::retracted tokens. Ends with the stream invariant.
template <class Engine, class Verifier = lynx::greedy_verifier>
std::vector<std::int32_t> drive(Engine& e, const plan& p, lynx::session_options o,
                                std::int32_t first, replay& r, Verifier v = {},
                                lynx::session_stats* stats = nullptr) {
  lynx::progressive_session<Engine, Verifier> s(e, v, e.levels, prompt, first, o);
  s.on_token_event([&](const token_event& ev) { r(ev); });
  REQUIRE(r.events.size() == 1);  // the prefill's own token, replayed
  for (int step = 0; !s.finished(); ++step) {
    REQUIRE(step < 10000);
    for (std::size_t l = 0; l < p.level_at.size(); ++l)
      if (step == p.level_at[l] && s.available_level() < static_cast<int>(l) + 1 && !s.unverified())
        s.set_available_level(static_cast<int>(l) + 1);
    if (step == p.unverified_at) s.continue_unverified("the residual will not come");
    const std::int64_t provisional_before = r.provisional, retracted_before = r.retracted;
    const std::size_t committed_before = r.committed, shown_before = r.shown.size();
    const lynx::step_result res = s.step();
    // Shown unless every position the request could commit already holds a token.
    if (res.kind == lynx::step_kind::draft)
      CHECK(r.provisional - provisional_before ==
            (static_cast<std::int64_t>(shown_before) < o.max_new_tokens ? 1 : 0));
    CHECK(r.retracted - retracted_before == res.retracted);
    if (res.kind != lynx::step_kind::draft)
      CHECK(r.committed - committed_before == static_cast<std::size_t>(res.committed));
  }
  // The invariant: the replay holds exactly the committed tokens.
  CHECK(r.shown == s.committed());
  CHECK(r.committed == s.committed().size());
  CHECK(r.confirmed + r.added == static_cast<std::int64_t>(r.committed));
  CHECK(r.provisional == r.confirmed + r.retracted);  // each provisional token: one or the other
  CHECK(s.stats().provisional_tokens == r.provisional);
  CHECK(s.stats().retracted_tokens == r.retracted);
  CHECK(s.stats().retractions == r.retractions);
  for (std::size_t i = 0; i < r.verified.size(); ++i)
    CHECK(r.verified[i] == (static_cast<std::int64_t>(i) < s.verified_tokens()));
  if (stats) *stats = s.stats();
  return s.committed();
}

// An event as a compact tuple for exact comparisons: kind, token, position, count, verified.
struct ev {
  token_event_kind kind;
  std::int32_t token;
  std::int64_t position, count;
  bool verified;
  bool operator==(const ev&) const = default;
};
constexpr auto P = token_event_kind::provisional;
constexpr auto R = token_event_kind::retract;
constexpr auto C = token_event_kind::commit;

std::vector<ev> compact(const std::vector<token_event>& events) {
  std::vector<ev> out;
  for (const auto& e : events) out.push_back({e.kind, e.token, e.position, e.count, e.verified});
  return out;
}

lynx::session_options options(int max_draft, int tokens) {
  lynx::session_options o;
  o.max_draft = max_draft;
  o.max_new_tokens = tokens;
  return o;
}

}  // namespace

// Toy greedy tables (token -> next), two levels: target x -> x + 1 mod 6;
// anchor 0->3 1->2 2->4 3->0 4->5 5->1 (agrees with the target at 1 and 4 only).

TEST_CASE("provisional tokens: every draft accepted, nothing retracted") {
  faithful_engine e;
  replay r;
  const auto got = drive(e, {{0, 4}}, options(4, 9), 0, r);
  CHECK(got == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 0, 1, 2});
  // 4 drafts, all confirmed, the bonus token added at verification, then exact steps.
  const std::vector<ev> want{{C, 0, 100, 1, true},  {P, 1, 101, 1, false}, {P, 2, 102, 1, false},
                             {P, 3, 103, 1, false}, {P, 4, 104, 1, false}, {C, 1, 101, 1, true},
                             {C, 2, 102, 1, true},  {C, 3, 103, 1, true},  {C, 4, 104, 1, true},
                             {C, 5, 105, 1, true},  {C, 0, 106, 1, true},  {C, 1, 107, 1, true},
                             {C, 2, 108, 1, true}};
  CHECK(compact(r.events) == want);
  CHECK(r.retractions == 0);
  CHECK(r.confirmed == 4);
}

TEST_CASE("provisional tokens: the first draft rejected retracts every draft") {
  toy_engine e;
  replay r;
  lynx::session_stats st;
  const auto got = drive(e, {{0, 2}}, options(2, 5), 2, r, lynx::greedy_verifier{}, &st);
  CHECK(got == std::vector<std::int32_t>{2, 3, 4, 5, 0});
  const std::vector<ev> want{{C, 2, 100, 1, true},  {P, 4, 101, 1, false}, {P, 5, 102, 1, false},
                             {R, 0, 101, 2, false}, {C, 3, 101, 1, true},  {C, 4, 102, 1, true},
                             {C, 5, 103, 1, true},  {C, 0, 104, 1, true}};
  CHECK(compact(r.events) == want);
  CHECK(st.retracted_tokens == 2);
  CHECK(st.retractions == 1);
  CHECK(st.provisional_tokens == 2);
  CHECK(st.retraction_rate() == doctest::Approx(1.0));
}

TEST_CASE("provisional tokens: a rejection in the middle retracts the rejected tail only") {
  toy_engine e;
  replay r;
  const auto got = drive(e, {{0, 3}}, options(3, 6), 1, r);
  CHECK(got == std::vector<std::int32_t>{1, 2, 3, 4, 5, 0});
  // Drafts 2 4 5; the target accepts 2, rejects 4: retract 4 and 5, confirm 2, correct with 3.
  const std::vector<ev> want{{C, 1, 100, 1, true},  {P, 2, 101, 1, false}, {P, 4, 102, 1, false},
                             {P, 5, 103, 1, false}, {R, 0, 102, 2, false}, {C, 2, 101, 1, true},
                             {C, 3, 102, 1, true},  {C, 4, 103, 1, true},  {C, 5, 104, 1, true},
                             {C, 0, 105, 1, true}};
  CHECK(compact(r.events) == want);
  CHECK(r.confirmed == 1);
}

TEST_CASE("provisional tokens: three streams retract at the intermediate level") {
  sharp_middle_engine e;
  e.levels = 3;
  replay r;
  const auto got = drive(e, {{0, 3, 5}}, options(3, 8), 1, r);
  CHECK(got == std::vector<std::int32_t>{1, 2, 3, 4, 5, 0, 1, 2});
  // Level-1 drafts 2 4 5; level 2 accepts 2, rejects 4 (retract 2) and its correction 3
  // becomes a level-2 draft, then one more (4); the target accepts all, adds the bonus 5.
  const std::vector<ev> want{{C, 1, 100, 1, true},  {P, 2, 101, 1, false}, {P, 4, 102, 1, false},
                             {P, 5, 103, 1, false}, {R, 0, 102, 2, false}, {P, 3, 102, 1, false},
                             {P, 4, 103, 1, false}, {C, 2, 101, 1, true},  {C, 3, 102, 1, true},
                             {C, 4, 103, 1, true},  {C, 5, 104, 1, true},  {C, 0, 105, 1, true},
                             {C, 1, 106, 1, true},  {C, 2, 107, 1, true}};
  CHECK(compact(r.events) == want);
  REQUIRE(r.events.size() == want.size());
  CHECK(r.events[5].level == 2);  // the intermediate correction is a draft of level 2
  CHECK(r.events[1].level == 1);
}

TEST_CASE("provisional tokens: continue_unverified confirms the drafts of the level present") {
  toy_engine e;
  replay r;
  const auto got = drive(e, {{0}, 2}, options(3, 5), 1, r);
  CHECK(got == std::vector<std::int32_t>{1, 2, 4, 5, 1});  // the anchor's own greedy tokens
  const std::vector<ev> want{{C, 1, 100, 1, true},  {P, 2, 101, 1, false}, {P, 4, 102, 1, false},
                             {C, 2, 101, 1, false}, {C, 4, 102, 1, false}, {C, 5, 103, 1, false},
                             {C, 1, 104, 1, false}};
  CHECK(compact(r.events) == want);
  CHECK(r.retractions == 0);
}

TEST_CASE("provisional tokens: drafts past the request's end are never shown") {
  faithful_engine e;
  replay r;
  // 3 tokens: the prefill's and two more; 8 drafts are made but only 2 could be committed.
  const auto got = drive(e, {{0, 8}}, options(8, 3), 0, r);
  CHECK(got == std::vector<std::int32_t>{0, 1, 2});
  CHECK(r.provisional == 2);
  CHECK(r.retractions == 0);
}

TEST_CASE("provisional tokens: a failed transfer retracts the drafts standing") {
  toy_engine e;
  lynx::progressive_session s(e, lynx::greedy_verifier{}, 2, prompt, 1, options(4, 20));
  s.set_available_level(1);
  s.step();
  s.step();
  replay r;
  s.on_token_event([&](const token_event& ev) { r(ev); });  // late: the state is replayed
  const std::vector<ev> before{{C, 1, 100, 1, true}, {P, 2, 101, 1, false}, {P, 4, 102, 1, false}};
  CHECK(compact(r.events) == before);
  s.fail("the link broke");
  CHECK(r.events.back().kind == R);
  CHECK(r.events.back().count == 2);
  CHECK(r.shown == s.committed());
  CHECK(s.stats().retracted_tokens == 2);
  CHECK(s.stats().retractions == 1);
}

TEST_CASE("provisional tokens: the invariant over draft limits, landings, plans and policies") {
  for (const int levels : {2, 3})
    for (const int max_draft : {0, 1, 2, 5, 8})
      for (const int land : {0, 1, 3, 7, 30})
        for (const int gap : {0, 2, 5})
          for (const int unverified_at : {-1, 1, 4})
            for (const bool intermediate : {true, false})
              for (const auto policy :
                   {lynx::landing_policy::verify_now, lynx::landing_policy::finish_draft}) {
                CAPTURE(levels);
                CAPTURE(max_draft);
                CAPTURE(land);
                CAPTURE(gap);
                CAPTURE(unverified_at);
                CAPTURE(intermediate);
                auto o = options(max_draft, 30);
                o.on_landing = policy;
                o.verify_intermediate_levels = intermediate;
                plan p;
                p.level_at = {0, land};
                if (levels == 3) p.level_at.push_back(land + gap);
                // continue_unverified before the residual lands (else it changes nothing)
                p.unverified_at = unverified_at >= 0 && unverified_at < land ? unverified_at : -1;
                toy_engine e;
                e.levels = levels;
                replay r;
                const auto got = drive(e, p, o, 3, r);
                if (p.unverified_at < 0) CHECK(got == greedy_at(levels, levels, 3, 30));
                // The same session without the opt-in commits the same tokens and counts the same.
                toy_engine quiet;
                quiet.levels = levels;
                lynx::progressive_session s(quiet, lynx::greedy_verifier{}, levels, prompt, 3, o);
                for (int step = 0; !s.finished(); ++step) {
                  for (std::size_t l = 0; l < p.level_at.size(); ++l)
                    if (step == p.level_at[l] && s.available_level() < static_cast<int>(l) + 1 &&
                        !s.unverified())
                      s.set_available_level(static_cast<int>(l) + 1);
                  if (step == p.unverified_at) s.continue_unverified("gone");
                  s.step();
                }
                CHECK(s.committed() == got);
                CHECK(s.stats().retracted_tokens == r.retracted);
                CHECK(s.stats().provisional_tokens == r.provisional);
                CHECK(quiet.tail == e.tail);
              }
}

TEST_CASE("provisional tokens: the invariant holds under speculative sampling") {
  std::int64_t retracted = 0;
  for (int seed = 0; seed < 200; ++seed) {
    CAPTURE(seed);
    toy_engine e;
    e.levels = 2 + seed % 2;
    lynx::sampling_verifier v;
    v.rng.seed = 0xfeed0000u + static_cast<std::uint64_t>(seed);
    replay r;
    plan p;
    p.level_at = {0, 1 + seed % 7};
    if (e.levels == 3) p.level_at.push_back(p.level_at[1] + seed % 4);
    drive(e, p, options(1 + seed % 6, 24), 2, r, v);
    retracted += r.retracted;
  }
  CHECK(retracted > 0);  // the drafts really were rejected now and then
}
