// Acceptance statistics of greedy Lynx sessions on the real model
// (stories260K, 20 prompts of 200-399 tokens sampled from the model, 64
// committed tokens), per plan and draft limit, with the residual landing after
// the draft limit (every draft is checked at once): the mean accepted draft
// length per verification and the acceptance rate, as counters. The session
// time is the wall time of the whole decode (drafts + verification + exact
// decoding) and, beside it, plain greedy decoding of the same tokens at the
// target precision, so the ratio is the cost of speculating.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include "llama2c/llama2c.hpp"
#include "llama2c/lynx_engine.hpp"
#include "lynx/speculation/session.hpp"

namespace ll = lynx_examples::llama2c;

namespace {

constexpr int prompts = 20, committed_tokens = 64;

const ll::weights* model() {
  // Shipped with the sources (examples/models/README.md).
  static const std::filesystem::path path =
      std::filesystem::path(LYNX_SOURCE_DIR) / "examples" / "models" / "stories260K.bin";
  static std::unique_ptr<ll::weights> w =
      std::filesystem::exists(path) ? std::make_unique<ll::weights>(path) : nullptr;
  return w.get();
}

template <class Plan>
struct prepared {
  std::vector<int> prompt;
  int first = 0;
  ll::prompt_tensors<Plan> tensors;
};

template <class Plan>
const std::vector<prepared<Plan>>& requests() {
  static const std::vector<prepared<Plan>> all = [] {
    std::vector<prepared<Plan>> r;
    for (int seed = 0; seed < prompts; ++seed) {
      prepared<Plan> p;
      p.prompt =
          ll::sample_prompt(*model(), static_cast<std::uint64_t>(seed), 200 + (seed * 37) % 200);
      ll::engine<> pre(*model());
      p.first = ll::argmax(pre.prefill(p.prompt));
      const auto enc = ll::encode_prompt<Plan>(pre);
      p.tensors = ll::make_prompt_tensors<Plan>(model()->cfg(), static_cast<int>(p.prompt.size()));
      for (std::size_t l = 0; l < enc.size(); ++l)
        for (int s = 0; s < Plan::streams; ++s) p.tensors[l].accept(enc[l].segment(s));
      r.push_back(std::move(p));
    }
    return r;
  }();
  return all;
}

template <class Plan>
void lynx_session(benchmark::State& state) {
  if (model() == nullptr) {
    state.SkipWithError("stories260K.bin not found");
    return;
  }
  const int max_draft = static_cast<int>(state.range(0));
  (void)requests<Plan>();  // prompts, prefill and encode happen once, outside the timing
  lynx::session_stats total;
  for (auto _ : state) {
    total = {};
    for (const auto& p : requests<Plan>()) {
      ll::lynx_decode_engine<Plan> e(*model(), p.tensors, static_cast<int>(p.prompt.size()));
      lynx::session_options o;
      o.max_draft = max_draft;
      o.max_new_tokens = committed_tokens;
      lynx::progressive_session s(e, lynx::greedy_verifier{}, Plan::streams,
                                  static_cast<std::int64_t>(p.prompt.size()), p.first, o);
      // Level l + 1 lands once the drafts of level l are done: every draft is verified.
      for (int level = 1; !s.finished();) {
        if (s.available_level() < level) s.set_available_level(level);
        if (s.step().kind == lynx::step_kind::idle) ++level;
      }
      total.verifications += s.stats().verifications;
      total.verified_drafts += s.stats().verified_drafts;
      total.accepted_drafts += s.stats().accepted_drafts;
      total.draft_tokens += s.stats().draft_tokens;
    }
  }
  state.counters["acceptance_rate"] = total.acceptance_rate();
  state.counters["mean_accepted"] = total.mean_accepted_length();
  state.counters["drafts"] = static_cast<double>(total.draft_tokens);
  state.SetLabel(Plan::name());
}

template <class Plan>
void plain_greedy(benchmark::State& state) {
  if (model() == nullptr) {
    state.SkipWithError("stories260K.bin not found");
    return;
  }
  std::vector<float> row(static_cast<std::size_t>(model()->cfg().vocab_size));
  (void)requests<Plan>();
  for (auto _ : state)
    for (const auto& p : requests<Plan>()) {
      ll::lynx_decode_engine<Plan> e(*model(), p.tensors, static_cast<int>(p.prompt.size()));
      int token = p.first;
      for (int i = 1; i < committed_tokens; ++i) {
        e.forward({&token, 1}, static_cast<std::int64_t>(p.prompt.size()) + i - 1, Plan::streams,
                  row);
        token = lynx::argmax_token(row);
      }
      benchmark::DoNotOptimize(token);
    }
  state.SetLabel(Plan::name());
}

}  // namespace

BENCHMARK(plain_greedy<lynx::plan_8_4_4>)->Unit(benchmark::kMillisecond);
BENCHMARK(lynx_session<lynx::plan_8_4_4>)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(lynx_session<lynx::plan_8_2_2_4>)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(lynx_session<lynx::plan_16_4_12>)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(lynx_session<lynx::plan_16_4_4_8>)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
