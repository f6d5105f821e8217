// Decode attention in a build for the x86-64 baseline (this binary is compiled
// without -march=native: what an engine that embeds Lynx with default flags
// gets). The portable walk runs in two forms that give the same bits:
//   portable_baseline  the loops as built: every std::fma is a libm call and
//                      nothing is vectorized;
//   portable           the same loops compiled for AVX2 + FMA (chosen at run
//                      time where the CPU has them);
// and `automatic` (the AVX-512 kernels, also chosen at run time, with the
// AVX2 + FMA loops as their fallback for shapes they do not take).
// Shapes, one query, one thread, 4,096 prompt tokens:
//   llama3   32 q heads, 8 kv heads, head_dim 128 (Llama-3-8B): all planes of
//            8 = 4 + 4, all planes of 16 = 4 + 12, and the bf16 baseline (dense
//            bf16 prompt)
//   d8       8 q heads, 4 kv heads, head_dim 8 (stories260K's shape): all planes
//            of 8 = 4 + 4, whose values the AVX-512 kernels leave to the loops
// After the runs it prints each case's time and its ratios to portable_baseline
// and to automatic of the same case. Run with --benchmark_repetitions=N on a shared machine.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"

namespace {

constexpr std::int64_t tokens = 4096;

struct shape {
  const char* name;
  std::int64_t q_heads, kv_heads, head_dim;
};
constexpr shape shapes[] = {{"llama3", 32, 8, 128}, {"d8", 8, 4, 8}};

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(gen);
  return x;
}

const char* path_name(lynx::attention_path p) {
  switch (p) {
    case lynx::attention_path::portable_baseline:
      return "portable_baseline";
    case lynx::attention_path::portable:
      return "portable";
    default:
      return "automatic";
  }
}

// One query over a prompt (planes or dense bf16) and an empty tail.
template <class Prompt>
void run_attention(benchmark::State& state, const Prompt& prompt, const shape& s,
                   lynx::attention_path path) {
  const auto q = random_floats(static_cast<std::size_t>(s.q_heads * s.head_dim), 3);
  const lynx::kv_shape tail_shape{0, s.kv_heads, s.head_dim};
  const float none = 0.0f;
  const auto tail = lynx::token_major<const float>(&none, tail_shape);
  const lynx::attention_queries queries{q.data(), 1, s.q_heads, s.head_dim};
  const lynx::tail_visibility vis{0, 0};  // no tail token visible
  const lynx::decode_attention<> attn{};
  lynx::attention_workspace ws(attn.problem(prompt, tail, queries, vis), 1);
  std::vector<float> out(q.size());
  for (auto _ : state) {
    attn(prompt, tail, tail, queries, vis, {out.data(), nullptr}, ws, {1, path});
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}

template <class Plan>
void run_planes(benchmark::State& state, const shape& s, lynx::attention_path path) {
  const lynx::kv_shape ks{tokens, s.kv_heads, s.head_dim};
  const auto k = random_floats(static_cast<std::size_t>(ks.elements()), 1),
             v = random_floats(static_cast<std::size_t>(ks.elements()), 2);
  const auto enc = lynx::encode<Plan>(lynx::token_major<const float>(k.data(), ks),
                                      lynx::token_major<const float>(v.data(), ks), 0);
  lynx::bitplane_tensor<Plan> t(ks, 0);
  for (int st = 0; st < Plan::streams; ++st) t.accept(enc.segment(st));
  run_attention(state, t.view(), s, path);
}

void run_bf16(benchmark::State& state, const shape& s, lynx::attention_path path) {
  const lynx::kv_shape ks{tokens, s.kv_heads, s.head_dim};
  const auto kf = random_floats(static_cast<std::size_t>(ks.elements()), 1),
             vf = random_floats(static_cast<std::size_t>(ks.elements()), 2);
  std::vector<lynx::bf16> k(kf.size()), v(vf.size());
  for (std::size_t i = 0; i < kf.size(); ++i)
    k[i] = lynx::from_float<lynx::bf16>(kf[i]), v[i] = lynx::from_float<lynx::bf16>(vf[i]);
  const lynx::dense_prompt<lynx::bf16> prompt{lynx::token_major<const lynx::bf16>(k.data(), ks),
                                              lynx::token_major<const lynx::bf16>(v.data(), ks)};
  run_attention(state, prompt, s, path);
}

class table_reporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, std::vector<double>> runs_ms;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred)
        runs_ms[r.benchmark_name()].push_back(
            r.GetAdjustedRealTime() * (r.time_unit == benchmark::kMillisecond ? 1.0 : 1e-3));
    ConsoleReporter::ReportRuns(runs);
  }
  [[nodiscard]] double median(const std::string& name) const {
    const auto it = runs_ms.find(name);
    if (it == runs_ms.end()) return std::nan("");
    std::vector<double> v = it->second;
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }
};

std::string bench_name(const char* prompt, const shape& s, lynx::attention_path p) {
  return std::string("attention/") + prompt + "/" + s.name + "/" + path_name(p);
}

}  // namespace

int main(int argc, char** argv) {
  const lynx::attention_path paths[] = {lynx::attention_path::portable_baseline,
                                        lynx::attention_path::portable,
                                        lynx::attention_path::automatic};
  std::vector<std::pair<const char*, const shape*>> cases;
  for (const shape& s : shapes) {
    cases.push_back({"planes_8=4+4", &s});
    if (s.head_dim >= 16) {
      cases.push_back({"planes_16=4+12", &s});
      cases.push_back({"bf16", &s});
    }
  }
  for (const auto& [prompt, s] : cases)
    for (lynx::attention_path p : paths) {
      const std::string name = prompt;
      benchmark::RegisterBenchmark(bench_name(prompt, *s, p).c_str(),
                                   [name, sh = *s, p](benchmark::State& st) {
                                     if (name == "planes_8=4+4")
                                       run_planes<lynx::plan_8_4_4>(st, sh, p);
                                     else if (name == "planes_16=4+12")
                                       run_planes<lynx::plan_16_4_12>(st, sh, p);
                                     else
                                       run_bf16(st, sh, p);
                                   })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  benchmark::Initialize(&argc, argv);
  table_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  std::printf("\nDecode attention, baseline-ISA build, 1 query, %lld tokens, 1 thread (ms)\n",
              static_cast<long long>(tokens));
  std::printf("%-15s %-7s %-18s %9s %12s %13s\n", "prompt", "shape", "path", "time", "vs baseline",
              "vs automatic");
  for (const auto& [prompt, s] : cases) {
    const double base = reporter.median(
        bench_name(prompt, *s, lynx::attention_path::portable_baseline) + "/real_time");
    const double simd =
        reporter.median(bench_name(prompt, *s, lynx::attention_path::automatic) + "/real_time");
    for (lynx::attention_path p : paths) {
      const double t = reporter.median(bench_name(prompt, *s, p) + "/real_time");
      if (std::isnan(t)) continue;
      // a ratio to a case that was not run (--benchmark_filter): n/a
      std::printf("%-15s %-7s %-18s %9.3f ", prompt, s->name, path_name(p), t);
      std::isnan(base) ? std::printf("%12s ", "n/a") : std::printf("%11.4fx ", t / base);
      std::isnan(simd) ? std::printf("%13s\n", "n/a") : std::printf("%12.2fx\n", t / simd);
    }
  }
  return 0;
}
