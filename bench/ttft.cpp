// Time to first token of a disaggregated request for a Llama-3-8B-shaped cache
// (32 layers, 8 KV heads, head_dim 128) at 8K and 32K prompt tokens, over
// 10, 25 and 100 Gbit/s links: blocking bf16 / 8-bit / 4-bit transfers vs Lynx
// 8 = 4 + 4 (anchor first, residual after, speculative decoding in between).
//
// Measured in this binary (Google Benchmark, this CPU): encode of one layer
// (bf16 input) and reconstruction of one layer to bf16 (anchor and all planes),
// single thread and all threads. The link is lynx::simulated_link driven by
// lynx::stream_scheduler with real segment headers and the real segment sizes
// (payloads are not touched: a timeline, not a copy). Assumed, stated in the
// output: the prefill time and the decode-step time of an 8B model on the GPU.
// Encode is pipelined with the link (layer l is posted when its encode ends);
// the decode node reconstructs each layer when it has landed.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "lynx/backend/host/parallel.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/transport/scheduler.hpp"
#include "lynx/transport/simulated_link.hpp"

namespace {

constexpr int layers = 32;
constexpr std::int64_t kv_heads = 8, head_dim = 128;
const std::int64_t token_counts[] = {8192, 32768};
const double link_gbps[] = {10, 25, 100};

// Assumed GPU-side costs of an 8B model (the decode node's forward passes);
// stated beside the table. Verification of k+1 tokens is memory-bound like a
// decode step, so it is charged one step plus 10%.
double assumed_prefill_s(std::int64_t tokens) { return tokens == 8192 ? 0.60 : 3.20; }
double assumed_step_s(std::int64_t tokens) { return tokens == 8192 ? 0.012 : 0.020; }

struct layer_input {
  std::vector<lynx::bf16> keys, values;
  explicit layer_input(std::int64_t tokens) {
    const auto n = static_cast<std::size_t>(tokens * kv_heads * head_dim);
    keys.resize(n);
    values.resize(n);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      keys[i] = lynx::bf16(normal(rng) * ((i % head_dim) % 31 == 0 ? 8.0f : 1.0f));
      values[i] = lynx::bf16(normal(rng));
    }
  }
  [[nodiscard]] lynx::kv_view<const lynx::bf16> k() const {
    return lynx::token_major<const lynx::bf16>(
        keys.data(),
        {static_cast<std::int64_t>(keys.size() / (kv_heads * head_dim)), kv_heads, head_dim});
  }
  [[nodiscard]] lynx::kv_view<const lynx::bf16> v() const {
    return lynx::token_major<const lynx::bf16>(
        values.data(),
        {static_cast<std::int64_t>(values.size() / (kv_heads * head_dim)), kv_heads, head_dim});
  }
};

const layer_input& input_for(std::int64_t tokens) {
  static std::map<std::int64_t, layer_input> cache;
  auto it = cache.find(tokens);
  if (it == cache.end()) it = cache.emplace(tokens, layer_input(tokens)).first;
  return it->second;
}

// Measured seconds per layer, by name, filled from the benchmark runs.
std::map<std::string, double> measured;

template <class Plan>
void encode_layer(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const auto& in = input_for(tokens);
  // Into buffers allocated once (a sender registers its buffers once), as for every plan.
  lynx::encoded_layer<Plan> enc(lynx::make_geometry<Plan, 32>(in.k().shape), 0);
  std::array<std::span<std::byte>, lynx::max_streams> out{};
  for (int s = 0; s < Plan::streams; ++s) out[static_cast<std::size_t>(s)] = enc.segment(s);
  for (auto _ : state) {
    lynx::encode_into<Plan, 32, lynx::bf16>(
        in.k(), in.v(), 0, std::span<const std::span<std::byte>>(out.data(), Plan::streams),
        {0, threads});
    benchmark::DoNotOptimize(enc.segment(0).data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(in.keys.size() * 4));
}

template <class Plan>
void reconstruct_layer(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const int level = static_cast<int>(state.range(2));
  const auto& in = input_for(tokens);
  const auto enc = lynx::encode<Plan, 32, lynx::bf16>(in.k(), in.v(), 0);
  lynx::bitplane_tensor<Plan> t({tokens, kv_heads, head_dim}, 0);
  for (int s = 0; s < Plan::streams; ++s) t.accept(enc.segment(s));
  std::vector<lynx::bf16> k(in.keys.size()), v(in.values.size());
  const lynx::kv_shape shape{tokens, kv_heads, head_dim};
  for (auto _ : state) {
    lynx::reconstruct(t.view_at(level), lynx::token_major(k.data(), shape),
                      lynx::token_major(v.data(), shape), {threads});
    benchmark::DoNotOptimize(k.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(in.keys.size() * 4));
}

// Remembers each run's time per iteration (seconds) by benchmark name.
class capturing_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && r.iterations > 0)
        measured[r.benchmark_name()] =
            r.real_accumulated_time / static_cast<double>(r.iterations);  // seconds per layer
    ConsoleReporter::ReportRuns(runs);
  }
};

std::string key(const char* what, std::int64_t tokens, int threads, int level = -1) {
  std::string k = std::string(what) + "/" + std::to_string(tokens) + "/" + std::to_string(threads);
  if (level >= 0) k += "/" + std::to_string(level);
  return k + "/real_time";
}

struct ttft_row {
  double first_token = 0;  // first token after the prefill's that the user gets (committed)
  double first_draft = -1;
  double anchor_landed = 0, all_landed = 0;
};

// Sends `streams` streams of every layer of `Plan` through the scheduler over a
// one-lane link; returns when the first stream (anchor) and all streams have
// landed on every layer, encode pipelined with sending.
template <class Plan>
std::pair<double, double> link_times(std::int64_t tokens, double gbps, int streams,
                                     double encode_per_layer, double start) {
  const lynx::layer_geometry g = lynx::make_geometry<Plan, 32>({tokens, kv_heads, head_dim});
  auto options = lynx::simulated_link_options::one_lane(static_cast<std::uint64_t>(gbps * 1e9 / 8),
                                                        lynx::virtual_duration(10'000'000));
  options.keep_bytes = false;
  lynx::simulated_link link(options);
  lynx::stream_scheduler scheduler(link.sender(), lynx::scheduler_options{std::size_t{64} << 20});
  link.on_step([&] { scheduler.progress(); });
  // Real headers in buffers of the real sizes; the payload pages are never touched.
  std::vector<lynx::aligned_buffer> buffers;
  for (int l = 0; l < layers; ++l)
    for (int s = 0; s < streams; ++s) {
      buffers.emplace_back(lynx::segment_bytes(g, s));
      const lynx::segment_header h = lynx::make_header(g, static_cast<std::uint32_t>(l), s, 0);
      std::memcpy(buffers.back().data(), &h, sizeof h);
    }
  for (int l = 0; l < layers; ++l) {
    link.advance_to(lynx::virtual_time(lynx::virtual_duration(
        static_cast<std::int64_t>((start + (l + 1) * encode_per_layer) * 1e12))));
    for (int s = 0; s < streams; ++s)
      scheduler.submit(buffers[static_cast<std::size_t>(l * streams + s)].span());
    scheduler.progress();
  }
  link.run_until_idle();
  double anchor = 0, all = 0;
  for (const auto& a : link.arrivals()) {
    const double t = lynx::to_seconds(a.arrived);
    all = std::max(all, t);
    if (a.id.stream == 0) anchor = std::max(anchor, t);
  }
  return {anchor, all};
}

void print_table(int threads, bool codec_free = false) {
  if (codec_free)
    std::printf(
        "\nTTFT of the first token after the prefill's (ms), Llama-3-8B-shaped cache (32 layers x "
        "8 KV heads x 128), "
        "one shared link, 10 us latency, encode and reconstruct NOT charged (as if on the GPU, "
        "hidden under the link)\n");
  else
    std::printf(
        "\nTTFT of the first token after the prefill's (ms), Llama-3-8B-shaped cache (32 layers x "
        "8 KV heads x 128), "
        "one shared link, 10 us latency, %d encode/reconstruct thread(s) on this CPU\n",
        threads);
  std::printf(
      "assumed (8B model on a GPU): prefill 0.60 s at 8K, 3.20 s at 32K; decode step 12 ms at 8K, "
      "20 ms at 32K; "
      "verification = step + 10%%\n");
  std::printf(
      "measured per layer here: encode and reconstruct to bf16 (see the benchmark lines "
      "above)\n\n");
  std::printf("%7s %6s | %9s %9s %9s | %10s %11s | %7s %7s | %10s %10s %10s\n", "tokens", "Gbit/s",
              "bf16", "8-bit", "4-bit", "Lynx draft", "Lynx commit", "8b/Lynx", "Lynx/4b",
              "32: 8-bit", "32: Lynx+", "32: Lynx-");
  for (const std::int64_t tokens : token_counts)
    for (const double gbps : link_gbps) {
      const double prefill = assumed_prefill_s(tokens), step = assumed_step_s(tokens);
      const double enc8 = codec_free ? 0.0 : measured[key("encode_8_8", tokens, threads)];
      const double enc44 = codec_free ? 0.0 : measured[key("encode_8_4_4", tokens, threads)];
      const double rec_full =
          codec_free ? 0.0 : measured[key("reconstruct_8_8", tokens, threads, 1)];
      const double rec_anchor =
          codec_free ? 0.0 : measured[key("reconstruct_8_4_4", tokens, threads, 1)];
      const double rec_44_full =
          codec_free ? 0.0 : measured[key("reconstruct_8_4_4", tokens, threads, 2)];
      // bf16: no encode; the bytes are the cache itself (2 bytes per element).
      const double bf16_bytes = static_cast<double>(layers) * 2 * tokens * kv_heads * head_dim * 2;
      const double bf16 = prefill + bf16_bytes * 8 / (gbps * 1e9) + 10e-6 + step;
      // Reconstruction of a layer overlaps the link except for the last layer's.
      const auto [a8, all8] = link_times<lynx::plan_8_8>(tokens, gbps, 1, enc8, prefill);
      const double blocking8 = all8 + rec_full + step;
      const auto [a4, all4] = link_times<lynx::plan_8_4_4>(tokens, gbps, 1, enc44, prefill);
      const double blocking4 = a4 + rec_anchor + step;
      const auto [anchor, all] = link_times<lynx::plan_8_4_4>(tokens, gbps, 2, enc44, prefill);
      const double draft = anchor + rec_anchor + step;
      const double commit = std::max(all + rec_44_full, draft) + step * 1.1;
      // Time to 32 committed tokens after the prefill's: blocking 8-bit decodes one per step; Lynx
      // drafts (up to 32) from the anchor until the residual lands, then commits the accepted
      // prefix plus one at verification: + every draft accepted, - none accepted.
      constexpr int n = 32;
      const double to_n_8 = blocking8 + (n - 1) * step;
      const double drafting = std::max(0.0, all + rec_44_full - (anchor + rec_anchor));
      const int drafts = std::min(n, 1 + static_cast<int>(drafting / step));
      const double to_n_best = commit + std::max(0, n - (drafts + 1)) * step;
      const double to_n_worst = commit + (n - 1) * step;
      std::printf(
          "%7lld %6.0f | %9.1f %9.1f %9.1f | %10.1f %11.1f | %7.3f %7.3f | %10.1f %10.1f %10.1f\n",
          static_cast<long long>(tokens), gbps, bf16 * 1e3, blocking8 * 1e3, blocking4 * 1e3,
          draft * 1e3, commit * 1e3, blocking8 / commit, draft / blocking4, to_n_8 * 1e3,
          to_n_best * 1e3, to_n_worst * 1e3);
    }
  std::printf(
      "\nLynx draft: the first token drafted on the anchor (what a 4-bit transfer would show); "
      "Lynx commit: the first\n"
      "token verified at full precision, i.e. what Lynx hands the user. 8b/Lynx > 1 means Lynx "
      "commits earlier than a\n"
      "blocking 8-bit transfer; Lynx/4b near 1 means drafting starts when a 4-bit transfer would "
      "have landed.\n"
      "32: time to 32 committed tokens after the prefill's; Lynx+ if every draft made before the "
      "residual landed is\n"
      "accepted, Lynx- if none is (the acceptance rate of a real model lies between).\n");
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const int all = lynx::detail::hardware_threads();
  for (const std::int64_t tokens : token_counts)
    for (const int threads : {1, all}) {
      benchmark::RegisterBenchmark("encode_8_8", encode_layer<lynx::plan_8_8>)
          ->Args({tokens, threads})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark("encode_8_4_4", encode_layer<lynx::plan_8_4_4>)
          ->Args({tokens, threads})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark("reconstruct_8_8", reconstruct_layer<lynx::plan_8_8>)
          ->Args({tokens, threads, 1})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      for (int level : {1, 2})
        benchmark::RegisterBenchmark("reconstruct_8_4_4", reconstruct_layer<lynx::plan_8_4_4>)
            ->Args({tokens, threads, level})
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
    }
  capturing_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  if (measured.empty()) return 0;  // filtered out: nothing to tabulate
  print_table(1);
  if (all > 1) print_table(all);
  print_table(1, true);
  return 0;
}
