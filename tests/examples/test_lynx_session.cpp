// The exactness contract on a real trained model (stories260K): for prompts
// sampled from the model, the tokens a greedy Lynx session commits equal,
// token for token, plain greedy decoding with all planes present, for the
// plans 8 = 4 + 4, 8 = 2 + 2 + 4 and 16 = 4 + 12, whether the residual lands
// before the first draft, mid-draft or after the draft limit; and 16 = 4 + 12
// also equals decoding with the unquantized fp32 cache. An engine that switches
// to the layers merged into codes (lynx::code_tensor) commits the same tokens,
// and so does one that reads each layer's codes as soon as a background merge
// (started when the last stream lands) has made them.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../support/real_model.hpp"
#include "llama2c/llama2c.hpp"
#include "llama2c/lynx_engine.hpp"
#include "lynx/attention/background_merge.hpp"
#include "lynx/speculation/session.hpp"

namespace ll = lynx_examples::llama2c;

namespace {

constexpr int committed_tokens = 64;

// 20 prompts; 5 with LYNX_TEST_QUICK set (the sanitizer preset sets it: memory
// errors do not depend on how many prompts, and the release build runs all 20).
const int prompts = std::getenv("LYNX_TEST_QUICK") != nullptr ? 5 : 20;

using lynx_tests::model_or_skip;
using lynx_tests::real_model;

struct prefilled {
  std::vector<int> prompt;
  ll::engine<> node;  // the prefill node, holding the exact fp32 prompt KV
  int first_token = 0;
  explicit prefilled(const ll::weights& w, std::uint64_t seed) : node(w) {
    prompt = ll::sample_prompt(w, seed, 200 + static_cast<int>((seed * 37) % 200));
    first_token = ll::argmax(node.prefill(prompt));
  }
};

// When each precision level becomes available, in session steps.
struct landing {
  const char* name;
  std::vector<int> level_at_step;  // level l + 1 lands at step level_at_step[l]
};

template <class Plan>
std::vector<int> plain_greedy(const ll::weights& w, const ll::prompt_tensors<Plan>& tensors,
                              const prefilled& p, const ll::prompt_codes<Plan>* codes = nullptr) {
  ll::lynx_decode_engine<Plan> e(w, tensors, static_cast<int>(p.prompt.size()));
  e.use_codes(codes);
  std::vector<int> out{p.first_token};
  std::vector<float> row(static_cast<std::size_t>(w.cfg().vocab_size));
  while (static_cast<int>(out.size()) < committed_tokens) {
    const int t = out.back();
    e.forward({&t, 1}, static_cast<std::int64_t>(p.prompt.size() + out.size() - 1), Plan::streams,
              row);
    out.push_back(lynx::argmax_token(row));
  }
  return out;
}

template <class Plan>
std::vector<int> lynx_session(const ll::weights& w, const ll::prompt_tensors<Plan>& tensors,
                              const prefilled& p, const landing& land, int max_draft,
                              lynx::session_stats& stats,
                              const ll::prompt_codes<Plan>* codes = nullptr,
                              bool background = false) {
  ll::lynx_decode_engine<Plan> e(w, tensors, static_cast<int>(p.prompt.size()));
  e.use_codes(codes);
  // background: when the last stream lands, merge on a helper thread; the steps
  // meanwhile read whatever layers are done, and from 4 steps later on, all of them
  std::optional<lynx::background_merge<Plan>> merge;
  int merge_started_at = 0;
  lynx::session_options o;
  o.max_draft = max_draft;
  o.max_new_tokens = committed_tokens;
  std::vector<int> streamed;
  lynx::progressive_session session(
      e, lynx::greedy_verifier{}, Plan::streams, static_cast<std::int64_t>(p.prompt.size()),
      p.first_token, o, [&](std::int32_t token, std::int64_t) { streamed.push_back(token); });
  int steps = 0;
  while (!session.finished()) {
    for (std::size_t l = 0; l < land.level_at_step.size(); ++l)
      if (steps >= land.level_at_step[l] && session.available_level() < static_cast<int>(l) + 1)
        session.set_available_level(static_cast<int>(l) + 1);
    if (background && !merge && session.available_level() == Plan::streams) {
      merge.emplace(std::span(tensors));
      e.use_codes(&*merge);
      merge_started_at = steps;
    }
    if (merge && steps == merge_started_at + 4) merge->wait();
    session.step();
    REQUIRE(++steps < 4 * committed_tokens + 64);
  }
  CHECK(streamed == std::vector<int>(session.committed().begin(), session.committed().end()));
  if (background) {
    REQUIRE(merge);
    CHECK(merge->ready() == tensors.size());
    CHECK(e.inner().attention().full_level_on_codes > 0);
  }
  stats.draft_tokens += session.stats().draft_tokens;
  stats.verifications += session.stats().verifications;
  stats.verified_drafts += session.stats().verified_drafts;
  stats.accepted_drafts += session.stats().accepted_drafts;
  return streamed;
}

template <class Plan>
void check_plan(const std::vector<landing>& landings,
                std::vector<std::vector<int>>* fp32_reference) {
  const ll::weights& w = *real_model();
  constexpr int max_draft = 8;
  lynx::session_stats stats;
  int sessions = 0;
  for (int seed = 0; seed < prompts; ++seed) {
    CAPTURE(seed);
    const prefilled p(w, static_cast<std::uint64_t>(seed));
    const auto encoded = ll::encode_prompt<Plan>(p.node);
    auto tensors = ll::make_prompt_tensors<Plan>(w.cfg(), static_cast<int>(p.prompt.size()));
    for (std::size_t l = 0; l < encoded.size(); ++l)
      for (int s = 0; s < Plan::streams; ++s) tensors[l].accept(encoded[l].segment(s));
    const std::vector<int> want = plain_greedy<Plan>(w, tensors, p);
    if (fp32_reference != nullptr) {
      const std::vector<int>& fp32 = (*fp32_reference)[static_cast<std::size_t>(seed)];
      if (want != fp32)
        MESSAGE("prompt " << seed << ": " << Plan::name()
                          << " greedy tokens differ from the fp32 cache's");
      CHECK(want == fp32);
    }
    for (const landing& land : landings) {
      CAPTURE(land.name);
      CHECK(lynx_session<Plan>(w, tensors, p, land, max_draft, stats) == want);
      ++sessions;
    }
    // the exact phase on codes: plain greedy decoding, and a session that
    // verifies and then decodes on them
    const auto codes = ll::make_prompt_codes(tensors);
    CHECK(plain_greedy<Plan>(w, tensors, p, &codes) == want);
    lynx::session_stats ignored;
    CHECK(lynx_session<Plan>(w, tensors, p, landings.back(), max_draft, ignored, &codes) == want);
    CHECK(lynx_session<Plan>(w, tensors, p, landings.back(), max_draft, ignored, nullptr, true) ==
          want);
  }
  MESSAGE(Plan::name() << ": " << sessions << " sessions exact; drafts " << stats.draft_tokens
                       << ", acceptance rate " << stats.acceptance_rate()
                       << ", mean accepted per verification " << stats.mean_accepted_length());
}

// Plain greedy decoding over the exact fp32 prompt cache (no quantization).
std::vector<std::vector<int>> fp32_references() {
  const ll::weights& w = *real_model();
  std::vector<std::vector<int>> refs;
  for (int seed = 0; seed < prompts; ++seed) {
    prefilled p(w, static_cast<std::uint64_t>(seed));
    ll::engine<> e(w);
    refs.push_back(ll::generate_greedy(e, p.prompt, committed_tokens));
  }
  return refs;
}

}  // namespace

TEST_CASE("8 = 4 + 4: greedy Lynx sessions commit exactly plain greedy decoding at 8 bits") {
  if (!model_or_skip()) return;
  check_plan<lynx::plan_8_4_4>({{"before the first draft", {0, 0}},
                                {"mid-draft", {0, 3}},
                                {"after the draft limit", {0, 20}}},
                               nullptr);
}

TEST_CASE("8 = 2 + 2 + 4: exact, verifying at each level") {
  if (!model_or_skip()) return;
  check_plan<lynx::plan_8_2_2_4>({{"before the first draft", {0, 0, 0}},
                                  {"mid-draft", {0, 2, 5}},
                                  {"after the draft limit", {0, 12, 30}},
                                  {"level 2 after the limit, level 3 soon after", {0, 20, 22}}},
                                 nullptr);
}

TEST_CASE("16 = 4 + 12: exact, and equal to decoding with the unquantized fp32 cache") {
  if (!model_or_skip()) return;
  auto refs = fp32_references();
  check_plan<lynx::plan_16_4_12>({{"before the first draft", {0, 0}},
                                  {"mid-draft", {0, 3}},
                                  {"after the draft limit", {0, 20}}},
                                 &refs);
}
