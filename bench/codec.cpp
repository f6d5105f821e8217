// Host codec benchmarks on a Llama-3-8B-shaped layer: 8 KV heads x 128 channels,
// 4,096, 8,192 and 32,768 tokens, bf16 K and V, token-major ([tokens][heads][dim]).
//
//   memcpy/<tokens>/<threads>                 baseline: copy of the K+V bf16 bytes
//   encode/<plan>/<tokens>/<threads>          encode_into preallocated segments
//   reconstruct/<plan>/<level>/<tokens>/<threads>  dequantize to bf16 K+V (token-major)
//
// Encode reads, and reconstruct writes, exactly the bytes the memcpy baseline
// copies (tokens * 8 * 128 * 2 bytes * 2 tensors), so every benchmark reports
// those bytes per second and a counter `x_memcpy` = its time / memcpy's time at
// the same tokens and threads (the bars: encode 8 = 4 + 4 <= 2, anchor
// reconstruct <= 1.5, single thread). The table is printed again at the end.
//
// threads: 1 and all hardware threads (the same fork-join the codecs use).
//
// Built twice: bench_codec (-O3, -march=native with LYNX_NATIVE) and
// bench_codec_baseline_isa (-O2, the compiler's default target). Both run the
// kernels the CPU has, chosen at run time; the bar for the second: encode
// 8 = 4 + 4 within 1.2x of the first's time on the same machine.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "huge_pages.hpp"
#include "lynx/backend/host/parallel.hpp"
#include "lynx/core/buffer.hpp"
#include "lynx/planes/codec.hpp"

namespace {

constexpr std::int64_t kv_heads = 8, head_dim = 128;

lynx::kv_shape shape_of(std::int64_t tokens) { return {tokens, kv_heads, head_dim}; }

// Bytes of K and V together at a token count (bf16).
std::size_t kv_bytes(std::int64_t tokens) {
  return static_cast<std::size_t>(2 * tokens * kv_heads * head_dim) * sizeof(lynx::bf16);
}

// K and V of one layer: roughly Gaussian per channel with per-channel offsets and
// a few outlier channels, like real keys; deterministic.
struct layer_input {
  lynx_bench::huge_page_array<lynx::bf16> keys, values;  // as an engine's cache is allocated
  explicit layer_input(std::int64_t tokens) {
    const auto n = static_cast<std::size_t>(tokens * kv_heads * head_dim);
    keys.resize(n);
    values.resize(n);
    std::mt19937 rng(12345);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      const auto c = static_cast<int>(i % head_dim);
      const float channel_scale = (c % 31 == 0) ? 8.0f : 1.0f;
      keys[i] = lynx::bf16(normal(rng) * channel_scale + 0.1f * static_cast<float>(c % 5));
      values[i] = lynx::bf16(normal(rng));
    }
  }
};

const layer_input& input_for(std::int64_t tokens) {
  static std::map<std::int64_t, layer_input> cache;
  auto it = cache.find(tokens);
  if (it == cache.end()) it = cache.emplace(tokens, layer_input(tokens)).first;
  return it->second;
}

// Seconds per iteration of the memcpy baseline at (tokens, threads), and of every
// benchmark, for the ratio counter and the closing table.
std::map<std::pair<std::int64_t, int>, double>& memcpy_seconds() {
  static std::map<std::pair<std::int64_t, int>, double> m;
  return m;
}
struct table_row {
  std::string name;
  std::int64_t tokens;
  int threads;
  double seconds;      // wall
  double ratio;        // wall / memcpy wall
  double cpu_seconds;  // CPU time of the calling thread (the whole work when threads == 1)
  double cpu_ratio;    // cpu_seconds / memcpy cpu_seconds (meaningful for threads == 1)
};
std::map<std::pair<std::int64_t, int>, double>& memcpy_cpu_seconds() {
  static std::map<std::pair<std::int64_t, int>, double> m;
  return m;
}
double thread_cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
// CPU seconds per iteration of the last timed_loop on this thread.
double last_cpu_seconds = 0.0;
std::vector<table_row>& table() {
  static std::vector<table_row> t;
  return t;
}

int resolved_threads(int threads) {
  return threads <= 0 ? lynx::detail::hardware_threads() : threads;
}

// Runs body() in the benchmark loop, timing it with a steady clock so the
// ratio uses the same (wall) time the report shows; also the CPU time of this
// thread, which on a shared machine is the steadier measure for one thread.
template <class F>
double timed_loop(benchmark::State& state, F&& body) {
  std::int64_t iterations = 0;
  const double cpu_start = thread_cpu_now();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    body();
    ++iterations;
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  last_cpu_seconds =
      iterations > 0 ? (thread_cpu_now() - cpu_start) / static_cast<double>(iterations) : 0.0;
  return iterations > 0 ? elapsed.count() / static_cast<double>(iterations) : 0.0;
}

void report(benchmark::State& state, const std::string& name, std::int64_t tokens, int threads,
            double seconds) {
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kv_bytes(tokens)));
  state.counters["tokens"] = static_cast<double>(tokens);
  double ratio = 0.0, cpu_ratio = 0.0;
  const double cpu_seconds = last_cpu_seconds;
  const auto it = memcpy_seconds().find({tokens, threads});
  if (it != memcpy_seconds().end() && it->second > 0.0) {
    ratio = seconds / it->second;
    state.counters["x_memcpy"] = ratio;
  }
  const auto ic = memcpy_cpu_seconds().find({tokens, threads});
  if (threads == 1 && ic != memcpy_cpu_seconds().end() && ic->second > 0.0) {
    cpu_ratio = cpu_seconds / ic->second;
    state.counters["x_memcpy_cpu"] = cpu_ratio;
  }
  // Google Benchmark calls a benchmark several times while it sizes the run;
  // the last call is the reported one, so it overwrites earlier rows.
  for (auto& row : table())
    if (row.name == name && row.tokens == tokens && row.threads == threads) {
      row = {name, tokens, threads, seconds, ratio, cpu_seconds, cpu_ratio};
      return;
    }
  table().push_back({name, tokens, threads, seconds, ratio, cpu_seconds, cpu_ratio});
}

void bm_memcpy(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int threads = resolved_threads(static_cast<int>(state.range(1)));
  const layer_input& in = input_for(tokens);
  const std::size_t half = kv_bytes(tokens) / 2;
  lynx_bench::huge_page_array<std::byte> out;  // as the reconstruct outputs
  out.resize(2 * half);
  std::memset(out.data(), 1, 2 * half);
  const auto* k = reinterpret_cast<const std::byte*>(in.keys.data());
  const auto* v = reinterpret_cast<const std::byte*>(in.values.data());
  const double seconds = timed_loop(state, [&] {
    // The same fork-join as the codecs: contiguous chunks of K and of V per thread.
    lynx::detail::parallel_for(threads, threads, [&](std::int64_t i0, std::int64_t i1) {
      for (std::int64_t i = i0; i < i1; ++i) {
        const std::size_t b =
            half * static_cast<std::size_t>(i) / static_cast<std::size_t>(threads);
        const std::size_t e =
            half * static_cast<std::size_t>(i + 1) / static_cast<std::size_t>(threads);
        std::memcpy(out.data() + b, k + b, e - b);
        std::memcpy(out.data() + half + b, v + b, e - b);
      }
    });
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  });
  memcpy_seconds()[{tokens, threads}] = seconds;
  memcpy_cpu_seconds()[{tokens, threads}] = last_cpu_seconds;
  report(state, "memcpy", tokens, threads, seconds);
}

template <class Plan>
void bm_encode(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int threads = resolved_threads(static_cast<int>(state.range(1)));
  const layer_input& in = input_for(tokens);
  const lynx::kv_shape s = shape_of(tokens);
  const lynx::layer_geometry g = lynx::make_geometry<Plan, 32>(s);
  std::vector<lynx::aligned_buffer> segments;
  std::vector<std::span<std::byte>> spans;
  for (int st = 0; st < Plan::streams; ++st) segments.emplace_back(lynx::segment_bytes(g, st));
  for (auto& seg : segments) spans.push_back(seg.span());
  // Written once before the timed loop, as memcpy's and reconstruct's outputs are:
  // otherwise the first call pays the page faults of fresh memory, and when that
  // call alone outlasts the minimum time it is the one reported (16 = 4 + 12 at
  // 32K tokens, one thread, on a virtual machine: 390-535 ms in about half the
  // runs, 43-45 ms otherwise; clear_page_erms most of the samples).
  for (auto& span : spans) std::memset(span.data(), 0, span.size());
  const auto keys = lynx::token_major<const lynx::bf16>(in.keys.data(), s);
  const auto values = lynx::token_major<const lynx::bf16>(in.values.data(), s);
  const lynx::encode_options options{0, threads};
  const double seconds = timed_loop(state, [&] {
    lynx::encode_into<Plan, 32, lynx::bf16>(keys, values, 0, spans, options);
    benchmark::DoNotOptimize(segments[0].data());
    benchmark::ClobberMemory();
  });
  report(state, "encode " + Plan::name(), tokens, threads, seconds);
}

template <class Plan, int Level>
void bm_reconstruct(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int threads = resolved_threads(static_cast<int>(state.range(1)));
  const layer_input& in = input_for(tokens);
  const lynx::kv_shape s = shape_of(tokens);
  const auto encoded = lynx::encode<Plan, 32, lynx::bf16>(
      lynx::token_major<const lynx::bf16>(in.keys.data(), s),
      lynx::token_major<const lynx::bf16>(in.values.data(), s), 0);
  lynx::host_bitplane_tensor<Plan, 32> tensor(s, 0);
  for (int st = 0; st < Plan::streams; ++st) tensor.accept(encoded.segment(st));
  const auto view = tensor.view_at(Level);
  // Outputs on huge pages, as an engine's cache is (and as memcpy's destination).
  lynx_bench::huge_page_array<std::byte> keys_out, values_out;
  keys_out.resize(in.keys.size() * sizeof(lynx::bf16));
  values_out.resize(in.values.size() * sizeof(lynx::bf16));
  std::memset(keys_out.data(), 0, in.keys.size() * sizeof(lynx::bf16));
  std::memset(values_out.data(), 0, in.values.size() * sizeof(lynx::bf16));
  const auto keys = lynx::token_major(reinterpret_cast<lynx::bf16*>(keys_out.data()), s);
  const auto values = lynx::token_major(reinterpret_cast<lynx::bf16*>(values_out.data()), s);
  const lynx::reconstruct_options options{threads};
  const double seconds = timed_loop(state, [&] {
    lynx::reconstruct(view, keys, values, options);
    benchmark::DoNotOptimize(keys_out.data());
    benchmark::ClobberMemory();
  });
  report(state,
         "reconstruct " + Plan::name() +
             (Level == Plan::streams ? " full" : " level " + std::to_string(Level)) + " (" +
             std::to_string(Plan::planes_at_level(Level)) + " planes)",
         tokens, threads, seconds);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (const std::int64_t tokens : {4096, 8192, 32768})
    for (const int threads : {1, lynx::detail::hardware_threads()}) b->Args({tokens, threads});
  b->ArgNames({"tokens", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(bm_memcpy)->Name("memcpy")->Apply(shapes);
BENCHMARK(bm_encode<lynx::plan_8_4_4>)->Name("encode/8=4+4")->Apply(shapes);
BENCHMARK(bm_encode<lynx::plan_16_4_12>)->Name("encode/16=4+12")->Apply(shapes);
BENCHMARK(bm_reconstruct<lynx::plan_8_4_4, 1>)->Name("reconstruct/8=4+4/anchor")->Apply(shapes);
BENCHMARK(bm_reconstruct<lynx::plan_8_4_4, 2>)->Name("reconstruct/8=4+4/full")->Apply(shapes);
BENCHMARK(bm_reconstruct<lynx::plan_16_4_12, 1>)->Name("reconstruct/16=4+12/anchor")->Apply(shapes);
BENCHMARK(bm_reconstruct<lynx::plan_16_4_12, 2>)->Name("reconstruct/16=4+12/full")->Apply(shapes);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (table().empty()) return 0;
  // Closing table: time, bytes/s and ratio to memcpy of the same bytes (same tokens, threads).
  // Wall time for every row; for one thread also CPU time and its ratio (steadier
  // when other work shares the cores).
  std::printf("\n%-44s %7s %7s %10s %9s %9s %10s %9s\n", "benchmark (bf16, 8 x 128, token-major)",
              "tokens", "threads", "wall ms", "GB/s", "x memcpy", "cpu ms", "x cpu");
  for (const auto& row : table()) {
    std::printf("%-44s %7lld %7d %10.3f %9.2f %9.2f", row.name.c_str(),
                static_cast<long long>(row.tokens), row.threads, row.seconds * 1e3,
                static_cast<double>(kv_bytes(row.tokens)) / row.seconds * 1e-9, row.ratio);
    if (row.threads == 1) std::printf(" %10.3f %9.2f", row.cpu_seconds * 1e3, row.cpu_ratio);
    std::printf("\n");
  }
  return 0;
}
