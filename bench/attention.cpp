// Decode attention for a Llama-3-8B-shaped layer (32 query heads, 8 kv heads,
// head_dim 128), one query, at 4,096 and 32,768 prompt tokens, single thread and
// all threads:
//   anchor of 8 = 4 + 4 (4 planes), all planes of 8 = 4 + 4, all planes of
//   16 = 4 + 12, the same two complete layers merged once into codes
//   (lynx::code_tensor: what decoding reads after the last stream has landed),
//   and the bf16 baseline (dense bf16 K/V, same functor),
// and, in the same binary, each case's two limits on this machine:
//   memory floor   a streaming read of exactly the bytes the case reads
//                  (plane words at its precision + scales/zeros, or bf16 K/V);
//   compute floor  an FMA loop doing the case's multiply-adds (2 * q_heads *
//                  tokens * head_dim per query: q.k and p.v) at the widest
//                  SIMD width, with enough independent chains to saturate it.
// After the runs it prints each case's time as a multiple of its floor
// max(memory, compute) and as a ratio to the bf16 baseline of the same shape,
// then the one-time cost of merging a complete layer into codes.
// LYNX_ATTENTION_PATH=portable|avx2|avx512 runs the cases on that path (default:
// automatic), to compare paths with one binary.
// LYNX_PREFETCH=l1|l2 sets the cache level the walks prefetch into (default: by
// the L1 size, lynx::detail::prefetch_into_l2); the table's header names it.
// On a shared machine run with --benchmark_repetitions=N: the table takes the
// median repetition of every benchmark (floors and cases alike).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "huge_pages.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/backend/host/parallel.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/planes/codec.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using lynx_bench::huge_page_array;

constexpr std::int64_t q_heads = 32, kv_heads = 8, head_dim = 128;

// ---------------------------------------------------------------------------
// Floors.
// ---------------------------------------------------------------------------

// Sum of every 32-bit word of [p, p + bytes): a streaming read with independent accumulators.
std::uint32_t stream_read(const std::byte* p, std::size_t bytes) {
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_epi32(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_load_si512(p + i + 192));
  }
  std::uint32_t s = static_cast<std::uint32_t>(_mm512_reduce_add_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3))));
#else
  std::uint32_t s = 0;
  std::size_t i = 0;
  for (; i + 4 <= bytes; i += 4) {
    std::uint32_t w;
    std::memcpy(&w, p + i, 4);
    s += w;
  }
#endif
  for (; i < bytes; ++i) s += static_cast<std::uint32_t>(p[i]);
  return s;
}

// `fmas` fused multiply-adds in SIMD registers, 12 independent chains.
float fma_loop(std::int64_t fmas) {
#if defined(__AVX512F__)
  constexpr int lanes = 16;
  __m512 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm512_set1_ps(static_cast<float>(k));
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
  const std::int64_t steps = fmas / (lanes * 12);
  for (std::int64_t i = 0; i < steps; ++i)
    for (int k = 0; k < 12; ++k) a[k] = _mm512_fmadd_ps(a[k], x, y);
  __m512 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm512_add_ps(s, a[k]);
  return _mm512_reduce_add_ps(s);
#else
  float a[12 * 8];
  for (int k = 0; k < 12 * 8; ++k) a[k] = static_cast<float>(k);
  const std::int64_t steps = fmas / (12 * 8);
  for (std::int64_t i = 0; i < steps; ++i)
    for (int k = 0; k < 12 * 8; ++k) a[k] = std::fma(a[k], 0.999f, 1e-3f);
  float s = 0;
  for (float v : a) s += v;
  return s;
#endif
}

// ---------------------------------------------------------------------------
// Cases.
// ---------------------------------------------------------------------------

struct layer_data {
  std::int64_t tokens;
  huge_page_array<lynx::bf16> keys, values;  // [tokens][kv_heads][head_dim]
  lynx::bitplane_tensor<lynx::plan_8_4_4> t8;
  lynx::bitplane_tensor<lynx::plan_16_4_12> t16;
  lynx::code_tensor<lynx::plan_8_4_4> c8;
  lynx::code_tensor<lynx::plan_16_4_12> c16;
  std::vector<float> query;  // [q_heads][head_dim]

  explicit layer_data(std::int64_t T)
      : tokens(T), t8({T, kv_heads, head_dim}, 0), t16({T, kv_heads, head_dim}, 0) {
    const lynx::kv_shape shape{T, kv_heads, head_dim};
    keys.resize(static_cast<std::size_t>(shape.elements()));
    values.resize(keys.size());
    std::mt19937 gen(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> offset(static_cast<std::size_t>(kv_heads * head_dim));
    for (auto& o : offset) o = 2.0f * nd(gen);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      keys[i] = lynx::bf16(offset[i % offset.size()] + nd(gen));
      values[i] = lynx::bf16(nd(gen));
    }
    query.resize(static_cast<std::size_t>(q_heads * head_dim));
    for (auto& v : query) v = nd(gen);
    const auto kv = lynx::token_major<const lynx::bf16>(keys.data(), shape),
               vv = lynx::token_major<const lynx::bf16>(values.data(), shape);
    const lynx::encode_options opt{0, 0};
    const auto e8 = lynx::encode<lynx::plan_8_4_4>(kv, vv, 0, opt);
    for (int s = 0; s < 2; ++s) t8.accept(e8.segment(s));
    const auto e16 = lynx::encode<lynx::plan_16_4_12>(kv, vv, 0, opt);
    for (int s = 0; s < 2; ++s) t16.accept(e16.segment(s));
    c8 = lynx::code_tensor<lynx::plan_8_4_4>(t8, 0);
    c16 = lynx::code_tensor<lynx::plan_16_4_12>(t16, 0);
  }
};

enum class which {
  anchor_8_4_4,
  all_8_4_4,
  all_16_4_12,
  codes_8_4_4,
  codes_16_4_12,
  bf16_baseline
};
const char* case_name(which w) {
  switch (w) {
    case which::anchor_8_4_4:
      return "anchor_8=4+4";
    case which::all_8_4_4:
      return "all_8=4+4";
    case which::all_16_4_12:
      return "all_16=4+12";
    case which::codes_8_4_4:
      return "codes_8=4+4";
    case which::codes_16_4_12:
      return "codes_16=4+12";
    default:
      return "bf16_baseline";
  }
}

// Bytes a case must read: plane words at its precision (or the codes, the same
// bytes) plus the anchor's scales and zeros, or the bf16 K/V.
std::size_t case_bytes(which w, std::int64_t T) {
  const std::int64_t blocks = (T + 31) / 32;
  const std::int64_t words_per_plane = 2 * kv_heads * blocks * head_dim;  // K and V
  const std::int64_t params =
      2 * (kv_heads * blocks * head_dim + kv_heads * T * (head_dim / 32)) * 2;  // bf16 scale + zero
  switch (w) {
    case which::anchor_8_4_4:
      return static_cast<std::size_t>(words_per_plane * 4 * 4 + params);
    case which::all_8_4_4:
    case which::codes_8_4_4:
      return static_cast<std::size_t>(words_per_plane * 8 * 4 + params);
    case which::all_16_4_12:
    case which::codes_16_4_12:
      return static_cast<std::size_t>(words_per_plane * 16 * 4 + params);
    default:
      return static_cast<std::size_t>(2 * T * kv_heads * head_dim * 2);
  }
}

std::int64_t case_fmas(std::int64_t T) { return 2 * q_heads * T * head_dim; }

std::map<std::int64_t, std::unique_ptr<layer_data>>& layers() {
  static std::map<std::int64_t, std::unique_ptr<layer_data>> m;
  return m;
}
layer_data& layer(std::int64_t T) {
  auto& p = layers()[T];
  if (!p) p = std::make_unique<layer_data>(T);
  return *p;
}

// The attention path of every case: LYNX_ATTENTION_PATH=portable, avx2, avx512 or
// automatic (the default), so that one binary measures a path against another.
lynx::attention_path bench_path() {
  const char* e = std::getenv("LYNX_ATTENTION_PATH");
  const std::string v = e ? e : "automatic";
  if (v == "portable") return lynx::attention_path::portable;
  if (v == "avx2") return lynx::attention_path::avx2;
  if (v == "avx512") return lynx::attention_path::avx512;
  if (v != "automatic") {
    std::fprintf(stderr, "LYNX_ATTENTION_PATH=%s: expected portable, avx2, avx512 or automatic\n",
                 v.c_str());
    std::exit(2);
  }
  return lynx::attention_path::automatic;
}

void run_case(benchmark::State& state, which w, std::int64_t T, int threads) {
  layer_data& d = layer(T);
  const lynx::attention_queries q{d.query.data(), 1, q_heads, head_dim};
  const lynx::kv_view<const float> no_tail{
      nullptr, {0, kv_heads, head_dim}, kv_heads * head_dim, head_dim, 1};
  const lynx::tail_visibility vis{0, 0};
  std::vector<float> out(static_cast<std::size_t>(q_heads * head_dim));
  lynx::decode_attention<> attn;
  lynx::attention_workspace ws;
  const lynx::kv_shape shape{T, kv_heads, head_dim};
  const lynx::dense_prompt<lynx::bf16> dense{
      lynx::token_major<const lynx::bf16>(d.keys.data(), shape),
      lynx::token_major<const lynx::bf16>(d.values.data(), shape)};
  const lynx::attention_path path = bench_path();
  auto call = [&](const auto& prompt) {
    ws.reserve(attn.problem(prompt, no_tail, q, vis), threads);
    for (auto _ : state) {
      attn(prompt, no_tail, no_tail, q, vis, {out.data()}, ws, {threads, path});
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
  };
  switch (w) {
    case which::anchor_8_4_4:
      call(d.t8.view_at(1));
      break;
    case which::all_8_4_4:
      call(d.t8.view());
      break;
    case which::all_16_4_12:
      call(d.t16.view());
      break;
    case which::codes_8_4_4:
      call(d.c8.view());
      break;
    case which::codes_16_4_12:
      call(d.c16.view());
      break;
    default:
      call(dense);
      break;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(case_bytes(w, T)));
}

// The one-time merge of a complete layer into codes, into a code_tensor kept
// per layer slot (allocated once, before the timing).
template <class Plan>
void run_merge(benchmark::State& state, std::int64_t T, int threads) {
  layer_data& d = layer(T);
  const auto& tensor = [&]() -> const auto& {
    if constexpr (Plan::bits == 8)
      return d.t8;
    else
      return d.t16;
  }
  ();
  lynx::code_tensor<Plan> codes(tensor, threads);  // a slot kept per layer: allocated once
  for (auto _ : state) {
    codes.assign(tensor, threads);
    benchmark::DoNotOptimize(codes.view().key_codes);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          (T * kv_heads * head_dim * 2 * Plan::bits / 8));
}

void run_memory_floor(benchmark::State& state, which w, std::int64_t T, int threads) {
  const std::size_t bytes = (case_bytes(w, T) + 255) / 256 * 256;
  huge_page_array<std::byte>
      buf;  // the same pages as the dense cache: the floor is no slower for it
  buf.resize(bytes);
  for (std::size_t i = 0; i < bytes; ++i) buf.data()[i] = static_cast<std::byte>(i * 131);
  const int n = threads <= 0 ? lynx::detail::hardware_threads() : threads;
  for (auto _ : state) {
    lynx::detail::parallel_for(n, n, [&](std::int64_t a, std::int64_t b) {
      for (std::int64_t t = a; t < b; ++t) {
        const std::size_t lo =
            bytes / 256 * static_cast<std::size_t>(t) / static_cast<std::size_t>(n) * 256;
        const std::size_t hi =
            bytes / 256 * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(n) * 256;
        benchmark::DoNotOptimize(stream_read(buf.data() + lo, hi - lo));
      }
    });
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bytes));
}

void run_compute_floor(benchmark::State& state, std::int64_t T, int threads) {
  const int n = threads <= 0 ? lynx::detail::hardware_threads() : threads;
  const std::int64_t fmas = case_fmas(T);
  for (auto _ : state) {
    lynx::detail::parallel_for(n, n, [&](std::int64_t a, std::int64_t b) {
      for (std::int64_t t = a; t < b; ++t) benchmark::DoNotOptimize(fma_loop(fmas / n));
    });
  }
}

// Captures each run's real time per iteration (ms) for the table.
class table_reporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, std::vector<double>> runs_ms;  // every repetition of each benchmark
  std::map<std::string, double> ms;                    // median repetition of each benchmark
  void note(const std::string& name, double t) {
    std::vector<double>& v = runs_ms[name];
    v.push_back(t);
    std::vector<double> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    const std::size_t n = sorted.size();
    ms[name] = n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred)
        note(r.benchmark_name(),
             r.GetAdjustedRealTime() * (r.time_unit == benchmark::kMillisecond   ? 1.0
                                        : r.time_unit == benchmark::kMicrosecond ? 1e-3
                                                                                 : 1e-6));
    ConsoleReporter::ReportRuns(runs);
  }
};

std::string name(const char* kind, const char* what, std::int64_t T, int threads) {
  return std::string(kind) + "/" + what + "/T:" + std::to_string(T) +
         "/threads:" + std::to_string(threads);
}
std::string key(const char* kind, const char* name, std::int64_t T, int threads) {
  return std::string(kind) + "/" + name + "/T:" + std::to_string(T) +
         "/threads:" + std::to_string(threads) + "/real_time";
}

}  // namespace

int main(int argc, char** argv) {
  const int all = lynx::detail::hardware_threads();
  std::vector<int> thread_counts{1};
  if (all > 1) thread_counts.push_back(all);
  const std::vector<std::int64_t> contexts{4096, 32768};
  const which cases[] = {which::anchor_8_4_4, which::all_8_4_4,     which::all_16_4_12,
                         which::codes_8_4_4,  which::codes_16_4_12, which::bf16_baseline};
  for (std::int64_t T : contexts)
    for (int th : thread_counts) {
      for (which w : cases) {
        benchmark::RegisterBenchmark(name("attention", case_name(w), T, th).c_str(),
                                     [=](benchmark::State& s) { run_case(s, w, T, th); })
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark(name("floor_memory", case_name(w), T, th).c_str(),
                                     [=](benchmark::State& s) { run_memory_floor(s, w, T, th); })
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
      benchmark::RegisterBenchmark(
          name("merge", "8=4+4", T, th).c_str(),
          [=](benchmark::State& s) { run_merge<lynx::plan_8_4_4>(s, T, th); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(
          name("merge", "16=4+12", T, th).c_str(),
          [=](benchmark::State& s) { run_merge<lynx::plan_16_4_12>(s, T, th); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(name("floor_compute", "fma", T, th).c_str(),
                                   [=](benchmark::State& s) { run_compute_floor(s, T, th); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  benchmark::Initialize(&argc, argv);
  table_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const char* path = std::getenv("LYNX_ATTENTION_PATH");
  std::printf(
      "\nDecode attention, 1 query, %lld q heads, %lld kv heads, head_dim %lld, path %s, "
      "prefetch %s (times in ms)\n",
      static_cast<long long>(q_heads), static_cast<long long>(kv_heads),
      static_cast<long long>(head_dim), path ? path : "automatic",
      lynx::detail::prefetch_into_l2() ? "l2" : "l1");
  std::printf("%-15s %7s %7s %9s %9s %9s %12s %9s\n", "case", "tokens", "threads", "time", "memory",
              "compute", "x floor", "vs bf16");
  for (std::int64_t T : contexts)
    for (int th : thread_counts) {
      const auto find = [&](const std::string& k) {
        const auto it = reporter.ms.find(k);
        return it == reporter.ms.end() ? std::nan("") : it->second;
      };
      const double bf16_ms = find(key("attention", case_name(which::bf16_baseline), T, th));
      const double compute = find(key("floor_compute", "fma", T, th));
      for (which w : cases) {
        const double t = find(key("attention", case_name(w), T, th));
        const double mem = find(key("floor_memory", case_name(w), T, th));
        if (std::isnan(t)) continue;
        const double floor = std::max(mem, compute);
        std::printf("%-15s %7lld %7d %9.3f %9.3f %9.3f %11.2fx %8.2fx\n", case_name(w),
                    static_cast<long long>(T), th, t, mem, compute, t / floor, t / bf16_ms);
      }
    }
  std::printf(
      "\nMerging a complete layer into codes (once per layer, when its last stream lands),\n"
      "in ms and in decode steps the codes save over reading all planes:\n");
  for (std::int64_t T : contexts)
    for (int th : thread_counts) {
      const auto find = [&](const std::string& k) {
        const auto it = reporter.ms.find(k);
        return it == reporter.ms.end() ? std::nan("") : it->second;
      };
      const std::pair<which, which> pairs[] = {{which::all_8_4_4, which::codes_8_4_4},
                                               {which::all_16_4_12, which::codes_16_4_12}};
      const char* merges[] = {"8=4+4", "16=4+12"};
      for (int k = 0; k < 2; ++k) {
        const double m = find(key("merge", merges[k], T, th));
        if (std::isnan(m)) continue;
        const double saved = find(key("attention", case_name(pairs[k].first), T, th)) -
                             find(key("attention", case_name(pairs[k].second), T, th));
        std::printf("merge %-9s %7lld %7d %9.3f ms  = %6.1f steps\n", merges[k],
                    static_cast<long long>(T), th, m, m / saved);
      }
    }
  return 0;
}
