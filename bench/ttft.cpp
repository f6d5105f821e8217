// The headline benchmark: time to N committed tokens (N = 1, 8, 32, 64) after
// the end of prefill, for a Llama-3-8B-shaped cache (32 layers, 8 KV heads,
// head_dim 128) and Gemma-3-270M's (18 layers, 1 KV head, head_dim 256; its 15
// sliding-window layers ship their last 511 tokens, as examples/gemma3 does) at
// 8K and 32K prompt tokens over 1, 10, 25 and 100 Gbit/s:
// blocking bf16 / 8-bit / 4-bit transfers against Lynx 8 = 4 + 4 (anchor first,
// residual after, drafting on the anchor until the residual lands, then one
// verification pass). Plus the time to Lynx's first provisional token (a draft,
// shown as provisional) against blocking 4-bit's first token, and retractions.
//
// Every transfer crosses the same link: lynx::simulated_link, one lane, one rate,
// driven by lynx::stream_scheduler with real segment headers and the real
// segment sizes (payloads are not touched: a timeline, not a copy). Encode is
// pipelined with the link (layer l is posted when its encode ends); the decode
// node reconstructs each layer when it has landed.
//
// Two cost models side by side (printed with the tables):
//   cpu  encode and reconstruct per layer measured in this binary (Google
//        Benchmark, all threads of this CPU);
//   gpu  encode and reconstruct at 70% of H100 HBM3 bandwidth (issue 33's bar,
//        not yet measured on a device).
// Forwards: a stated GPU model (no CPU decodes an 8B model at serving speed): a
// decode step reads the weights and the KV cache at 80% of 3.35 TB/s (at least
// 1 ms: a small model's step is launch-bound); verifying k drafts costs one step
// plus the k tokens' FLOPs at half of 989 TFLOP/s (NVIDIA H100 SXM datasheet;
// Llama-3-8B: 8.03e9 parameters, Meta's model card). The cpu cost model charges
// Gemma-3-270M's forwards as bench_gemma3 measured them on this 2-core machine.
//
//   ./build/release/bench/bench_ttft [--csv FILE] [--prefix P] [--batch B]
// --csv appends every row to FILE (bench/plot_ttft.py draws the curves from it);
// --prefix P: the "measured" Lynx column accepts the first P drafts (the tokens
// before the anchor-only decode first disagrees; bench_acceptance_models measured
// 7.8 to 31.5 for Gemma-3-270M at 4K-16K with a 4-bit anchor of 8; default 8);
// --batch B: the decode node runs B requests of the same length in one batch, so a
// step reads the weights once and B caches (default 1, a lone request; a serving
// node runs many: B = 8 of 32K tokens is 34 GB of cache beside 16 GB of weights).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "lynx/backend/host/parallel.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/transport/scheduler.hpp"
#include "lynx/transport/simulated_link.hpp"

namespace {

// The Llama-3-8B layer the codec benchmarks run on.
constexpr std::int64_t kv_heads = 8, head_dim = 128;
const std::int64_t token_counts[] = {8192, 32768};
const double link_gbps[] = {1, 10, 25, 100};
const int token_targets[] = {1, 8, 32, 64};
constexpr int draft_cap = 64;  // the landing-aware policy's bound on drafts in flight

// A model's cache as it crosses the link: per layer, the tokens shipped (a
// sliding-window layer ships only its window, as the Gemma-3 example does).
struct model_case {
  const char* name;
  int layers;
  std::int64_t kv_heads, head_dim;
  double params;          // weights (bf16 on the GPU)
  int window = 0;         // sliding window of the local layers (0: none)
  int global_period = 0;  // every global_period-th layer (the last of each period) is global
  [[nodiscard]] std::int64_t shipped(int layer, std::int64_t tokens) const {
    const bool local = window > 0 && (layer + 1) % global_period != 0;
    return local ? std::min<std::int64_t>(tokens, window - 1) : tokens;
  }
  [[nodiscard]] double cache_bytes(std::int64_t tokens) const {  // bf16 K and V, as shipped
    double n = 0;
    for (int l = 0; l < layers; ++l) n += 2.0 * shipped(l, tokens) * kv_heads * head_dim * 2;
    return n;
  }
};
// Llama-3-8B: Meta's model card. Gemma-3-270M: its GGUF metadata (window 512;
// layers 5, 11, 17 global).
const model_case llama{"Llama-3-8B", 32, 8, 128, 8.03e9};
const model_case gemma{"Gemma-3-270M", 18, 1, 256, 2.68e8, 512, 6};

// The stated GPU model (see the top of the file).
constexpr double hbm_bytes_per_s = 3.35e12, decode_bandwidth_share = 0.8,
                 codec_bandwidth_share = 0.7;
constexpr double peak_flops = 989e12, verify_flops_share = 0.5;
constexpr double min_gpu_step_s = 1e-3;  // a small model's step is launch-bound (stated floor)
int decode_batch = 1;  // requests of this length decoded together on the decode node (--batch)
double gpu_step_s(const model_case& m, std::int64_t tokens) {
  return std::max(min_gpu_step_s, (m.params * 2 + decode_batch * m.cache_bytes(tokens)) /
                                      (hbm_bytes_per_s * decode_bandwidth_share));
}
double gpu_verify_s(const model_case& m, std::int64_t tokens, int drafts) {
  return gpu_step_s(m, tokens) + 2.0 * m.params * (drafts + 1) / (peak_flops * verify_flops_share);
}
// Measured on this machine (bench_gemma3, 2 threads, 4K context): one Gemma-3-270M
// decode step 33 ms, a verification forward of k tokens about 1 + 0.16 k steps
// (2.29x at k = 8, 3.86x at k = 16). The cpu cost model charges Gemma's forwards so.
constexpr double gemma_cpu_step_s = 0.033, gemma_cpu_verify_per_token = 0.16;

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

// Codec seconds per element (K and V elements of a layer) under one cost model.
struct codec_rates {
  double encode_8 = 0, encode_4 = 0, encode_44 = 0;
  double rec_8 = 0, rec_4 = 0, rec_anchor = 0, rec_44 = 0;
};

// cpu: measured on the Llama-3-8B layer at `tokens`, per element; other shapes
// are charged in proportion to their elements.
codec_rates cpu_rates(std::int64_t tokens, int threads) {
  const double elements = static_cast<double>(tokens) * kv_heads * head_dim;
  codec_rates c;
  c.encode_8 = measured[key("encode_8_8", tokens, threads)] / elements;
  c.encode_44 = measured[key("encode_8_4_4", tokens, threads)] / elements;
  c.encode_4 = c.encode_44;  // a 4-bit transfer: the bytes of the anchor (see compute_row)
  c.rec_8 = measured[key("reconstruct_8_8", tokens, threads, 1)] / elements;
  c.rec_4 = c.rec_anchor = measured[key("reconstruct_8_4_4", tokens, threads, 1)] / elements;
  c.rec_44 = measured[key("reconstruct_8_4_4", tokens, threads, 2)] / elements;
  return c;
}

// gpu: bf16 K and V read and the segment bytes written (or the reverse) at 70% of
// HBM bandwidth: 4 bytes per element plus B/8 (8 or 4 bits) plus the parameters.
codec_rates gpu_rates() {
  const double bw = hbm_bytes_per_s * codec_bandwidth_share;
  const double params = 2.0 * 2 * 2 / 32;  // scale and zero point, bf16, per 32 elements, K and V
  codec_rates c;
  c.encode_8 = c.rec_8 = c.encode_44 = c.rec_44 = (4 + 1 + params) / bw;
  c.encode_4 = c.rec_4 = c.rec_anchor = (4 + 0.5 + params) / bw;
  return c;
}

// Sends `streams` streams of every layer of `Plan` through the scheduler over a
// one-lane link; returns when the first stream (anchor) and all streams have
// landed on every layer, encode pipelined with sending (layer l is posted when
// its encode, `encode_rate` seconds per element, ends).
template <class Plan>
std::pair<double, double> link_times(const model_case& m, std::int64_t tokens, double gbps,
                                     int streams, double encode_rate) {
  auto options = lynx::simulated_link_options::one_lane(static_cast<std::uint64_t>(gbps * 1e9 / 8),
                                                        lynx::virtual_duration(10'000'000));
  options.keep_bytes = false;
  lynx::simulated_link link(options);
  lynx::stream_scheduler scheduler(link.sender(), lynx::scheduler_options{std::size_t{64} << 20});
  link.on_step([&] { scheduler.progress(); });
  // Real headers in buffers of the real sizes; the payload pages are never touched.
  std::vector<lynx::aligned_buffer> buffers;
  for (int l = 0; l < m.layers; ++l) {
    const lynx::layer_geometry g =
        lynx::make_geometry<Plan, 32>({m.shipped(l, tokens), m.kv_heads, m.head_dim});
    for (int s = 0; s < streams; ++s) {
      buffers.emplace_back(lynx::segment_bytes(g, s));
      const lynx::segment_header h = lynx::make_header(g, static_cast<std::uint32_t>(l), s, 0);
      std::memcpy(buffers.back().data(), &h, sizeof h);
    }
  }
  double encoded = 0;
  for (int l = 0; l < m.layers; ++l) {
    encoded += encode_rate * static_cast<double>(m.shipped(l, tokens) * m.kv_heads * m.head_dim);
    link.advance_to(
        lynx::virtual_time(lynx::virtual_duration(static_cast<std::int64_t>(encoded * 1e12))));
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

// One row: every time is seconds after the end of prefill; tokens counted after
// the prefill's own token.
struct row_times {
  double bf16[4], blocking8[4], blocking4[4];
  double lynx_all[4], lynx_prefix[4], lynx_none[4];
  double first_provisional = 0;
  int drafts = 0, retracted_prefix = 0;
  double anchor_landed = 0, all_landed = 0, whole_8 = 0;
  double step = 0;
};

row_times compute_row(const model_case& m, std::int64_t tokens, double gbps, const codec_rates& c,
                      bool cpu_forwards, int prefix) {
  row_times r{};
  const bool gemma_cpu = cpu_forwards && m.window > 0;
  const double step = gemma_cpu ? gemma_cpu_step_s : gpu_step_s(m, tokens);
  const auto verify_s = [&](int drafts) {
    return gemma_cpu ? gemma_cpu_step_s * (1 + gemma_cpu_verify_per_token * (drafts + 1))
                     : gpu_verify_s(m, tokens, drafts);
  };
  r.step = step;
  // Reconstruction: the last layer's (a global one) once it has landed; the others overlap.
  const double last_elements =
      static_cast<double>(m.shipped(m.layers - 1, tokens) * m.kv_heads * m.head_dim);
  const double bf16_landed = m.cache_bytes(tokens) * 8 / (gbps * 1e9) + 10e-6;
  const double l8 = link_times<lynx::plan_8_8>(m, tokens, gbps, 1, c.encode_8).second;
  // Blocking 4-bit: 4-bit codes and their parameters, the bytes of the anchor of 8 = 4 + 4
  // (Lynx's plans are 8, 12 or 16 bits wide; a 4-bit code is an 8-bit code's top half).
  const double l4 = link_times<lynx::plan_8_4_4>(m, tokens, gbps, 1, c.encode_4).second;
  const auto [anchor, all] = link_times<lynx::plan_8_4_4>(m, tokens, gbps, 2, c.encode_44);
  r.anchor_landed = anchor;
  r.all_landed = all;
  r.whole_8 = l8;
  const double start16 = bf16_landed, start8 = l8 + c.rec_8 * last_elements,
               start4 = l4 + c.rec_4 * last_elements;
  // Lynx: drafts from the anchor while the residual is in flight (the draft under
  // way when it lands completes), at most draft_cap, then one verification.
  const double draft_start = anchor + c.rec_anchor * last_elements,
               usable = all + c.rec_44 * last_elements;
  int drafts = 0;
  while (drafts < draft_cap && draft_start + drafts * step < usable) ++drafts;
  r.drafts = drafts;
  r.first_provisional = drafts > 0 ? draft_start + step : -1;
  const double verified = std::max(usable, draft_start + drafts * step) + verify_s(drafts);
  const int accepted_prefix = std::min(prefix, drafts);
  r.retracted_prefix = drafts - accepted_prefix;
  for (int i = 0; i < 4; ++i) {
    const int n = token_targets[i];
    r.bf16[i] = start16 + n * step;
    r.blocking8[i] = start8 + n * step;
    r.blocking4[i] = start4 + n * step;
    // committed at verification: the accepted drafts plus one (correction or bonus)
    auto lynx_time = [&](int accepted) {
      const int at_verify = accepted + 1;
      return verified + std::max(0, n - at_verify) * step;
    };
    r.lynx_all[i] = lynx_time(drafts);
    r.lynx_prefix[i] = lynx_time(accepted_prefix);
    r.lynx_none[i] = lynx_time(0);
  }
  return r;
}

void print_tables(const model_case& m, const char* cost, int threads, std::FILE* csv, int prefix) {
  const bool gpu = std::string(cost) == "gpu";
  std::printf(
      "\n== %s (%d layers x %lld KV heads x %lld%s), cost model %s, one link, one rate, 10 us "
      "latency ==\n",
      m.name, m.layers, static_cast<long long>(m.kv_heads), static_cast<long long>(m.head_dim),
      m.window ? ", local layers ship their window" : "", cost);
  if (gpu)
    std::printf(
        "encode/reconstruct: bytes moved at 70%% of 3.35 TB/s (H100 HBM3, stated, not "
        "measured)\n");
  else
    std::printf(
        "encode/reconstruct: measured per element on this CPU, %d thread(s) (benchmark lines "
        "above)\n",
        threads);
  if (!gpu && m.window)
    std::printf(
        "forwards: measured on this CPU (bench_gemma3): step %.0f ms, verification of k drafts "
        "(1 + %.2f (k+1)) steps\n",
        gemma_cpu_step_s * 1e3, gemma_cpu_verify_per_token);
  else
    std::printf(
        "forwards (stated GPU model, batch of %d): step %.2f ms at 8K, %.2f ms at 32K; "
        "verification of k drafts: step + 2 x %.3g x (k+1) FLOP at 495 TFLOP/s\n",
        decode_batch, gpu_step_s(m, 8192) * 1e3, gpu_step_s(m, 32768) * 1e3, m.params);
  std::printf(
      "times in ms after the end of prefill; N = committed tokens after the prefill's own. Lynx+: "
      "every draft accepted; Lynx~: the first %d accepted; Lynx-: none.\n",
      prefix);
  std::printf("%6s %6s %3s | %9s %9s %9s | %9s %9s %9s | %7s %7s | %6s %6s | %9s %7s\n", "tokens",
              "Gbit/s", "N", "bf16", "8-bit", "4-bit", "Lynx+", "Lynx~", "Lynx-", "8b/L+", "8b/L~",
              "drafts", "retr~", "1st prov", "prov/4b");
  for (const std::int64_t tokens : token_counts)
    for (const double gbps : link_gbps) {
      const codec_rates c = gpu ? gpu_rates() : cpu_rates(tokens, threads);
      const row_times r = compute_row(m, tokens, gbps, c, !gpu, prefix);
      const double first4 = r.blocking4[0];
      for (int i = 0; i < 4; ++i) {
        std::printf(
            "%6lld %6.0f %3d | %9.1f %9.1f %9.1f | %9.1f %9.1f %9.1f | %7.3f %7.3f | %6d %6d | "
            "%9.1f %7.3f\n",
            static_cast<long long>(tokens), gbps, token_targets[i], r.bf16[i] * 1e3,
            r.blocking8[i] * 1e3, r.blocking4[i] * 1e3, r.lynx_all[i] * 1e3, r.lynx_prefix[i] * 1e3,
            r.lynx_none[i] * 1e3, r.blocking8[i] / r.lynx_all[i], r.blocking8[i] / r.lynx_prefix[i],
            r.drafts, r.retracted_prefix, r.first_provisional * 1e3, r.first_provisional / first4);
        if (csv)
          std::fprintf(csv,
                       "%s,%s,%d,%lld,%g,%d,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%d,%d,%.6f,%.6f,"
                       "%.6f\n",
                       cost, m.name, decode_batch, static_cast<long long>(tokens), gbps,
                       token_targets[i], r.bf16[i], r.blocking8[i], r.blocking4[i], r.lynx_all[i],
                       r.lynx_prefix[i], r.lynx_none[i], r.first_provisional, r.drafts,
                       r.retracted_prefix, r.anchor_landed, r.all_landed, r.whole_8);
      }
    }
  std::printf(
      "\n8b/L+ > 1: Lynx commits N tokens sooner than a blocking 8-bit transfer (every draft "
      "accepted); 8b/L~ the same with the stated prefix.\n"
      "1st prov: Lynx's first provisional token (a draft on the anchor); prov/4b near 1: it comes "
      "when a blocking 4-bit transfer's first token would.\n"
      "retr~: drafts retracted at verification with the stated prefix (Lynx+: 0; Lynx-: all).\n"
      "Bars (issue 29), 8K and 32K at 10 Gbit/s: 8b/L+ >= 1.25 at N = 32, prov/4b <= 1.05.\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string csv_path;
  int prefix = 8;
  // our flags first; the rest goes to Google Benchmark
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--csv" && i + 1 < argc)
      csv_path = argv[++i];
    else if (a == "--prefix" && i + 1 < argc)
      prefix = std::stoi(argv[++i]);
    else if (a == "--batch" && i + 1 < argc)
      decode_batch = std::stoi(argv[++i]);
    else
      rest.push_back(argv[i]);
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  const int all = lynx::detail::hardware_threads();
  for (const std::int64_t tokens : token_counts) {
    benchmark::RegisterBenchmark("encode_8_8", encode_layer<lynx::plan_8_8>)
        ->Args({tokens, all})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("encode_8_4_4", encode_layer<lynx::plan_8_4_4>)
        ->Args({tokens, all})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("reconstruct_8_8", reconstruct_layer<lynx::plan_8_8>)
        ->Args({tokens, all, 1})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (int level : {1, 2})
      benchmark::RegisterBenchmark("reconstruct_8_4_4", reconstruct_layer<lynx::plan_8_4_4>)
          ->Args({tokens, all, level})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  }
  capturing_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  std::FILE* csv = nullptr;
  if (!csv_path.empty()) {
    csv = std::fopen(csv_path.c_str(), "a");  // appends: runs with other --batch values add rows
    if (!csv) {
      std::fprintf(stderr, "cannot write %s\n", csv_path.c_str());
      return 1;
    }
    std::fseek(csv, 0, SEEK_END);
    if (std::ftell(csv) == 0)
      std::fprintf(
          csv,
          "cost,model,batch,tokens,gbps,n,bf16_s,blocking8_s,blocking4_s,lynx_all_s,lynx_prefix_s,"
          "lynx_none_s,first_provisional_s,drafts,retracted_prefix,anchor_landed_s,"
          "all_landed_s,blocking8_landed_s\n");
  }
  for (const model_case* m : {&llama, &gemma}) {
    print_tables(*m, "gpu", all, csv, prefix);
    if (measured.size() >= 5 * 2) print_tables(*m, "cpu", all, csv, prefix);
  }
  if (csv) std::fclose(csv);
  return 0;
}
