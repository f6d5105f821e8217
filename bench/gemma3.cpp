// Gemma-3-270M (GGUF, Q4_K_M) on this machine: the engine's speed and what
// window-aware transfer saves.
//   - prefill tokens/s (1,024 tokens);
//   - one decode step at a 4,096-token context: the exact fp32 engine (dense
//     fp32 prompt KV, the baseline), and the Lynx engine reading the prompt's
//     8 = 4 + 4 planes at the anchor level and at full precision;
//   - a verification forward of k = 4, 8, 16 tokens at full precision, with
//     its time as a multiple of one decode step measured in the same run
//     (counter x_step: weights are read once for the k tokens);
//   - bytes on the wire for a 4K and a 32K prompt, whole prompt on every layer
//     vs window-aware (local layers ship their last window - 1 tokens), per plan.
//   bench_gemma3 [--model FILE.gguf] [Google Benchmark flags]
// Needs the model (--model, LYNX_GEMMA3_GGUF, or cmake/fetch_gemma3.sh's cache);
// without it every benchmark reports an error.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

#include "gemma3/forward.hpp"
#include "gemma3/lynx_engine.hpp"
#include "gemma3/model.hpp"
#include "gemma3/model_path.hpp"

namespace g3 = lynx_examples::gemma3;

namespace {

constexpr int context_tokens = 4096;

const g3::weights* model() {
  static const std::unique_ptr<g3::weights> w = [] {
    const auto p = g3::find_model();
    return p ? std::make_unique<g3::weights>(*p) : nullptr;
  }();
  return w.get();
}

std::vector<std::int32_t> pseudo_text(int n, std::uint32_t seed) {
  // Token ids drawn from the common part of the vocabulary; the cost of a
  // forward does not depend on which tokens they are.
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> id(1000, 60000);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  t[0] = 2;  // BOS
  for (int i = 1; i < n; ++i) t[static_cast<std::size_t>(i)] = id(rng);
  return t;
}

// The 4K-token prompt prefilled once, its KV encoded as 8 = 4 + 4 and received.
struct prepared_context {
  std::vector<std::int32_t> prompt;
  std::unique_ptr<g3::engine<>> node;
  g3::prompt_tensors<lynx::plan_8_4_4> tensors;
  double prefill_seconds = 0;
};

const prepared_context& context() {
  static const std::unique_ptr<prepared_context> c = [] {
    auto p = std::make_unique<prepared_context>();
    p->prompt = pseudo_text(context_tokens, 1);
    p->node = std::make_unique<g3::engine<>>(*model());
    std::fprintf(stderr, "prefill of %d tokens for the decode benchmarks...\n", context_tokens);
    const auto t0 = std::chrono::steady_clock::now();
    (void)p->node->prefill(p->prompt);
    p->prefill_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto enc = g3::encode_prompt<lynx::plan_8_4_4>(*p->node);
    p->tensors = g3::make_prompt_tensors<lynx::plan_8_4_4>(model()->cfg(), context_tokens);
    for (std::size_t l = 0; l < enc.size(); ++l)
      for (int s = 0; s < lynx::plan_8_4_4::streams; ++s) p->tensors[l].accept(enc[l].segment(s));
    return p;
  }();
  return *c;
}

bool have_model(benchmark::State& state) {
  if (model() != nullptr) return true;
  state.SkipWithError("Gemma-3 GGUF not found (cmake/fetch_gemma3.sh; or LYNX_GEMMA3_GGUF)");
  return false;
}

void BM_prefill(benchmark::State& state) {
  if (!have_model(state)) return;
  const int n = static_cast<int>(state.range(0));
  const auto prompt = pseudo_text(n, 2);
  g3::engine<> e(*model());
  for (auto _ : state) benchmark::DoNotOptimize(e.prefill(prompt));
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

// One step (k tokens) of the exact engine after a 4K prefill; the KV appended is dropped again.
void BM_exact_step(benchmark::State& state) {
  if (!have_model(state)) return;
  const prepared_context& c = context();
  g3::engine<> e(*model());
  (void)e.prefill(c.prompt);  // its own copy of the prompt KV
  const std::vector<std::int32_t> tokens(1, 1234);
  std::vector<float> logits(static_cast<std::size_t>(model()->cfg().vocab_size));
  for (auto _ : state) {
    e.decode(tokens, e.position(), logits);
    e.truncate_tail(1);
  }
}

double lynx_step_seconds(g3::lynx_decode_engine<lynx::plan_8_4_4>& e, int level, int k,
                         std::vector<float>& logits, int repeats) {
  const std::vector<std::int32_t> tokens(static_cast<std::size_t>(k), 1234);
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    e.forward(
        tokens, context_tokens + e.tail_size(), level,
        std::span<float>(logits.data(), static_cast<std::size_t>(k) *
                                            static_cast<std::size_t>(model()->cfg().vocab_size)));
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    e.drop_tail(k);
  }
  return best;
}

// Lynx decode engine at a 4K context: range(0) = level (1 anchor, 2 full), range(1) = k tokens.
void BM_lynx_forward(benchmark::State& state) {
  if (!have_model(state)) return;
  const prepared_context& c = context();
  const int level = static_cast<int>(state.range(0)), k = static_cast<int>(state.range(1));
  g3::lynx_decode_engine<lynx::plan_8_4_4> e(*model(), c.tensors, context_tokens);
  std::vector<float> logits(static_cast<std::size_t>(k) *
                            static_cast<std::size_t>(model()->cfg().vocab_size));
  // one decode step at full precision, measured in this run: the ratio's denominator
  const double step = lynx_step_seconds(e, 2, 1, logits, 5);
  const std::vector<std::int32_t> tokens(static_cast<std::size_t>(k), 1234);
  for (auto _ : state) {
    e.forward(tokens, context_tokens, level, logits);
    e.drop_tail(k);
  }
  state.counters["x_step"] = benchmark::Counter(
      step, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["step_ms"] = step * 1e3;
}

// Bytes of every layer's segments for a prompt of range(0) tokens: whole prompt
// everywhere (counter full_bytes) vs window-aware (window_bytes), 8 = 4 + 4 and 16 = 4 + 12.
template <class Plan>
void BM_window_bytes(benchmark::State& state) {
  if (!have_model(state)) return;
  const g3::config& c = model()->cfg();
  const int P = static_cast<int>(state.range(0));
  std::uint64_t full = 0, window = 0;
  for (auto _ : state) {
    full = window = 0;
    for (int l = 0; l < c.n_layers; ++l) {
      for (const bool aware : {false, true}) {
        const lynx::kv_shape shape{g3::shipped_tokens(c, l, P, aware), c.n_kv_heads, c.head_dim};
        const auto g = lynx::make_geometry<Plan, 32>(shape);
        std::uint64_t bytes = 0;
        for (int s = 0; s < Plan::streams; ++s)
          bytes += lynx::segment_header_bytes + static_cast<std::uint64_t>(g.payload_bytes(s));
        (aware ? window : full) += bytes;
      }
    }
  }
  state.counters["full_MB"] = static_cast<double>(full) / 1e6;
  state.counters["window_MB"] = static_cast<double>(window) / 1e6;
  state.counters["window_over_full"] = static_cast<double>(window) / static_cast<double>(full);
}

}  // namespace

// Wall time: the matrix products run on every hardware thread.
BENCHMARK(BM_prefill)->Arg(1024)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_exact_step)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_lynx_forward)
    ->ArgNames({"level", "k"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({2, 4})
    ->Args({2, 8})
    ->Args({2, 16})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_window_bytes, lynx::plan_8_4_4)->Arg(4096)->Arg(32768)->Iterations(1);
BENCHMARK_TEMPLATE(BM_window_bytes, lynx::plan_16_4_12)->Arg(4096)->Arg(32768)->Iterations(1);

// --model FILE.gguf (a copy the user already has) is taken out of the arguments
// before Google Benchmark reads them; without it the model is looked for as
// g3::default_model_path() says (LYNX_GEMMA3_GGUF, then the fetch script's cache).
int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      ::setenv("LYNX_GEMMA3_GGUF", argv[++i], 1);
    } else if (a.starts_with("--model=")) {
      ::setenv("LYNX_GEMMA3_GGUF", argv[i] + 8, 1);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
