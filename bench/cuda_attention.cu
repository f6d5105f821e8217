// CUDA decode attention on a Llama-3-8B-shaped layer (32 query heads, 8 KV
// heads, head_dim 128, one query, a 16-token bf16 tail) at 4,096 and 32,768
// prompt tokens: anchor of 8 = 4 + 4, all planes of 8 = 4 + 4, all planes of
// 16 = 4 + 12, and the dense bf16 baseline. The same binary measures a
// device-to-device cudaMemcpy (bytes read + written, per second) and reports
// each case's bytes read per second as a fraction of it, then prints a table.
// Target: anchor-only at >= 70% of the copy bandwidth (its time ~0.3-0.4x bf16's).
// Timing: CUDA events around each iteration (device time). Without a CUDA
// device the binary says so and exits 0.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda_harness.cuh"
#include "lynx/backend/cuda/attention.cuh"
#include "lynx/backend/cuda/tensor.cuh"
#include "lynx/planes/codec.hpp"

namespace {

constexpr std::int64_t kv_heads = 8, q_heads = 32, head_dim = 128, tail_tokens = 16;

struct result_row {
  double seconds = 0.0;
  double bytes = 0.0;
};
std::map<std::string, result_row>& results() {
  static std::map<std::string, result_row> r;
  return r;
}
std::map<std::int64_t, double>&
copy_rate() {  // tokens -> bytes moved per second by cudaMemcpy d2d (read + write)
  static std::map<std::int64_t, double> r;
  return r;
}

std::vector<float> normal_values(std::int64_t n, unsigned seed) {
  std::vector<float> x(static_cast<std::size_t>(n));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(rng);
  return x;
}

template <class T>
lynx::cuda::device_buffer to_device(const std::vector<T>& h) {
  lynx::cuda::device_buffer b(h.size() * sizeof(T));
  LYNX_CUDA_CHECK(cudaMemcpy(b.data(), h.data(), b.size(), cudaMemcpyHostToDevice));
  return b;
}

template <class T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = lynx::from_float<T>(x[i]);
  return r;
}

// Times `body` (lynx_bench::cuda_timed_loop); records seconds per iteration under `name`.
template <class F>
void timed_loop(benchmark::State& state, const std::string& name, double bytes, F&& body) {
  const double seconds = lynx_bench::cuda_timed_loop(state, bytes, body);
  if (state.iterations() > 0) results()[name] = {seconds, bytes};
}

std::string case_name(const char* what, std::int64_t tokens) {
  return std::string(what) + " @" + std::to_string(tokens);
}

// The inputs of one layer: queries, bf16 tail, output, shared by every case.
struct common_inputs {
  lynx::cuda::device_buffer q, tk, tv, out;
  explicit common_inputs()
      : q(to_device(normal_values(q_heads * head_dim, 3))),
        tk(to_device(convert<lynx::bf16>(normal_values(tail_tokens * kv_heads * head_dim, 4)))),
        tv(to_device(convert<lynx::bf16>(normal_values(tail_tokens * kv_heads * head_dim, 5)))),
        out(q_heads * head_dim * sizeof(float)) {}
  [[nodiscard]] lynx::kv_view<const lynx::bf16, lynx::device_space> tail(
      const lynx::cuda::device_buffer& b) const {
    return lynx::token_major<const lynx::bf16, lynx::device_space>(
        reinterpret_cast<const lynx::bf16*>(b.data()), {tail_tokens, kv_heads, head_dim});
  }
  [[nodiscard]] lynx::attention_queries queries() const {
    return {reinterpret_cast<const float*>(q.data()), 1, q_heads, head_dim};
  }
  lynx::attention_output output() { return {reinterpret_cast<float*>(out.data()), nullptr}; }
};

void bm_memcpy_d2d(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const std::int64_t bytes = 2 * tokens * kv_heads * head_dim * 2;  // a bf16 K + V layer
  lynx::cuda::device_buffer src(static_cast<std::size_t>(bytes)),
      dst(static_cast<std::size_t>(bytes));
  LYNX_CUDA_CHECK(cudaMemset(src.data(), 1, src.size()));
  // bytes moved = read + written
  timed_loop(state, case_name("memcpy d2d", tokens), 2.0 * static_cast<double>(bytes), [&] {
    LYNX_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size(), cudaMemcpyDeviceToDevice));
  });
  const auto& r = results()[case_name("memcpy d2d", tokens)];
  copy_rate()[tokens] = r.bytes / r.seconds;
}

// Bytes a bit-plane case reads: the anchor's parameters, P planes of K and V, the tail, the
// queries.
double plane_bytes(const lynx::layer_geometry& g, int planes) {
  const double params = 2.0 * 2.0 * static_cast<double>(g.key_params() + g.value_params());  // bf16
  const double words =
      2.0 * 4.0 * static_cast<double>(g.kv_heads * g.blocks() * g.head_dim) * planes;
  return params + words + 2.0 * 2.0 * tail_tokens * kv_heads * head_dim + 4.0 * q_heads * head_dim;
}

template <class Plan>
void bm_planes(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int level = static_cast<int>(state.range(1));
  const lynx::kv_shape shape{tokens, kv_heads, head_dim};
  const auto k = normal_values(shape.elements(), 1), v = normal_values(shape.elements(), 2);
  const auto enc = lynx::encode<Plan, 32>(lynx::token_major<const float>(k.data(), shape),
                                          lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<Plan, 32, lynx::device_space> tensor(shape, 0);
  for (int s = 0; s < level; ++s) tensor.accept(enc.segment(s));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(tensor.stream()));
  common_inputs in;
  const auto view = tensor.view();
  lynx::cuda::decode_attention<> attn;
  std::size_t ws_bytes = 0;
  LYNX_CUDA_CHECK(attn(nullptr, ws_bytes, view, in.tail(in.tk), in.tail(in.tv), in.queries(),
                       {tail_tokens - 1, 1}, in.output()));
  lynx::cuda::device_buffer ws(ws_bytes);
  const std::string what =
      level == Plan::streams ? "all of " + Plan::name() : "anchor of " + Plan::name();
  timed_loop(state, case_name(what.c_str(), tokens), plane_bytes(tensor.geometry(), view.planes()),
             [&] {
               LYNX_CUDA_CHECK(attn(ws.data(), ws_bytes, view, in.tail(in.tk), in.tail(in.tv),
                                    in.queries(), {tail_tokens - 1, 1}, in.output()));
             });
  lynx::cuda::check_attention_status(ws.data());  // the timed outputs are all finite
  state.SetLabel(what);
}

void bm_bf16(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const lynx::kv_shape shape{tokens, kv_heads, head_dim};
  const auto kb = to_device(convert<lynx::bf16>(normal_values(shape.elements(), 1)));
  const auto vb = to_device(convert<lynx::bf16>(normal_values(shape.elements(), 2)));
  const lynx::cuda::dense_prompt<lynx::bf16> prompt{
      lynx::token_major<const lynx::bf16, lynx::device_space>(
          reinterpret_cast<const lynx::bf16*>(kb.data()), shape),
      lynx::token_major<const lynx::bf16, lynx::device_space>(
          reinterpret_cast<const lynx::bf16*>(vb.data()), shape)};
  common_inputs in;
  lynx::cuda::decode_attention<> attn;
  std::size_t ws_bytes = 0;
  LYNX_CUDA_CHECK(attn(nullptr, ws_bytes, prompt, in.tail(in.tk), in.tail(in.tv), in.queries(),
                       {tail_tokens - 1, 1}, in.output()));
  lynx::cuda::device_buffer ws(ws_bytes);
  const double bytes = 2.0 * 2.0 * static_cast<double>(shape.elements()) +
                       2.0 * 2.0 * tail_tokens * kv_heads * head_dim + 4.0 * q_heads * head_dim;
  timed_loop(state, case_name("bf16 baseline", tokens), bytes, [&] {
    LYNX_CUDA_CHECK(attn(ws.data(), ws_bytes, prompt, in.tail(in.tk), in.tail(in.tv), in.queries(),
                         {tail_tokens - 1, 1}, in.output()));
  });
  lynx::cuda::check_attention_status(ws.data());
  state.SetLabel("bf16 baseline");
}

void token_args(benchmark::internal::Benchmark* b) {
  b->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
}
void anchor_args(benchmark::internal::Benchmark* b) {
  b->Args({4096, 1})->Args({32768, 1})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
void full_args(benchmark::internal::Benchmark* b) {
  b->Args({4096, 2})->Args({32768, 2})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(bm_memcpy_d2d)->Apply(token_args);
BENCHMARK(bm_planes<lynx::plan_8_4_4>)->Apply(anchor_args);
BENCHMARK(bm_planes<lynx::plan_8_4_4>)->Apply(full_args);
BENCHMARK(bm_planes<lynx::plan_16_4_12>)->Apply(full_args);
BENCHMARK(bm_bf16)->Apply(token_args);

void print_table() {
  std::printf("\n%-28s %10s %12s %10s %12s %10s\n", "case", "tokens", "time (us)", "GB read",
              "GB/s read", "of copy");
  for (const std::int64_t tokens : {4096, 32768}) {
    const double copy = copy_rate().count(tokens) ? copy_rate()[tokens] : 0.0;
    double bf16_time = 0.0;
    if (results().count(case_name("bf16 baseline", tokens)))
      bf16_time = results()[case_name("bf16 baseline", tokens)].seconds;
    for (const char* what :
         {"anchor of 8 = 4 + 4", "all of 8 = 4 + 4", "all of 16 = 4 + 12", "bf16 baseline"}) {
      const auto it = results().find(case_name(what, tokens));
      if (it == results().end()) continue;
      const double rate = it->second.bytes / it->second.seconds;
      std::printf("%-28s %10lld %12.2f %10.4f %12.1f %9.0f%%", what, static_cast<long long>(tokens),
                  it->second.seconds * 1e6, it->second.bytes * 1e-9, rate * 1e-9,
                  copy > 0 ? 100.0 * rate / copy : 0.0);
      if (bf16_time > 0) std::printf("   %.2fx bf16 time", it->second.seconds / bf16_time);
      std::printf("\n");
    }
    if (copy > 0)
      std::printf("%-28s %10lld %12s %10s %12.1f %9s\n", "memcpy d2d (read+write)",
                  static_cast<long long>(tokens), "", "", copy * 1e-9, "100%");
  }
  std::printf("target: anchor of 8 = 4 + 4 at >= 70%% of the copy bandwidth\n");
}

}  // namespace

int main(int argc, char** argv) {
  const int rc = lynx_bench::run_cuda_benchmarks(argc, argv, "bench_cuda_attention");
  if (rc == 0) print_table();
  return rc;
}
