// CUDA codec throughput on a Llama-3-8B-shaped layer (8 KV heads x 128 channels,
// 4,096 and 32,768 tokens, bf16 K and V), with cudaMemcpy device-to-device of
// the same bytes as the baseline in the same binary. Timing: CUDA events around
// each iteration (manual time), so the numbers are device time, not launch time.
//   encode       bytes/s of input (K + V), target: >= 70% of the memcpy rate
//   reconstruct  bytes/s of output (K + V, bf16), anchor only and full precision
// Without a CUDA device the binary says so and exits 0.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_harness.cuh"
#include "lynx/backend/cuda/codec.cuh"
#include "lynx/backend/cuda/tensor.cuh"

namespace {

constexpr std::int64_t kv_heads = 8, head_dim = 128;

lynx::kv_shape layer_shape(std::int64_t tokens) { return {tokens, kv_heads, head_dim}; }

std::int64_t kv_bytes(std::int64_t tokens) {
  return 2 * tokens * kv_heads * head_dim * static_cast<std::int64_t>(sizeof(lynx::bf16));
}

// K and V of one layer on the device, token-major, random normal values.
struct device_layer {
  lynx::cuda::device_buffer keys, values;
  lynx::kv_shape shape;
  explicit device_layer(std::int64_t tokens) : shape(layer_shape(tokens)) {
    std::vector<lynx::bf16> host(static_cast<std::size_t>(shape.elements()));
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& x : host) x = lynx::bf16(normal(rng));
    keys = lynx::cuda::device_buffer(host.size() * sizeof(lynx::bf16));
    values = lynx::cuda::device_buffer(host.size() * sizeof(lynx::bf16));
    LYNX_CUDA_CHECK(cudaMemcpy(keys.data(), host.data(), keys.size(), cudaMemcpyHostToDevice));
    for (auto& x : host) x = lynx::bf16(normal(rng));
    LYNX_CUDA_CHECK(cudaMemcpy(values.data(), host.data(), values.size(), cudaMemcpyHostToDevice));
  }
  template <class T>
  lynx::kv_view<T, lynx::device_space> view(lynx::cuda::device_buffer& b) {
    return lynx::token_major<T, lynx::device_space>(reinterpret_cast<T*>(b.data()), shape);
  }
};

void bm_cuda_memcpy_d2d(benchmark::State& state) {
  const std::int64_t bytes = kv_bytes(state.range(0));
  lynx::cuda::device_buffer src(static_cast<std::size_t>(bytes)),
      dst(static_cast<std::size_t>(bytes));
  LYNX_CUDA_CHECK(cudaMemset(src.data(), 1, src.size()));
  lynx_bench::cuda_timed_loop(state, static_cast<double>(bytes), [&] {
    LYNX_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size(), cudaMemcpyDeviceToDevice));
  });
}

template <class Plan>
void bm_cuda_encode(benchmark::State& state) {
  device_layer layer(state.range(0));
  const auto keys = layer.view<const lynx::bf16>(layer.keys);
  const auto values = layer.view<const lynx::bf16>(layer.values);
  lynx::cuda::device_encoded_layer<Plan, 32> out(lynx::make_geometry<Plan, 32>(layer.shape), 0);
  std::size_t workspace_bytes = out.workspace().size;
  lynx_bench::cuda_timed_loop(state, static_cast<double>(kv_bytes(state.range(0))), [&] {
    LYNX_CUDA_CHECK((lynx::cuda::encode_async<Plan, 32, lynx::bf16>(
        out.workspace().data, workspace_bytes, keys, values, 0, out.segments())));
  });
  lynx::cuda::check_encode_status<Plan, 32, lynx::bf16>(out.workspace().data, keys, values, 0);
}

template <class Plan>
void bm_cuda_reconstruct(benchmark::State& state) {
  const int level = static_cast<int>(state.range(1));
  device_layer layer(state.range(0));
  lynx::cuda::device_buffer keys_out(layer.keys.size()), values_out(layer.values.size());
  const auto encoded = lynx::cuda::encode<Plan, 32, lynx::bf16>(
      layer.view<const lynx::bf16>(layer.keys), layer.view<const lynx::bf16>(layer.values), 0);
  // the segments as a device receiver holds them after accept (parameters expanded)
  lynx::device_bitplane_tensor<Plan, 32> tensor(encoded.geometry().shape(), 0);
  for (int s = 0; s < Plan::streams; ++s) {
    std::vector<std::byte> host(encoded.segment(s).size);
    lynx::cuda::stage_to_host(encoded.segment(s), host);
    tensor.accept(host);
  }
  LYNX_CUDA_CHECK(cudaStreamSynchronize(tensor.stream()));
  const auto view = tensor.view_at(level);
  const auto k = layer.view<lynx::bf16>(keys_out);
  const auto v = layer.view<lynx::bf16>(values_out);
  lynx_bench::cuda_timed_loop(state, static_cast<double>(kv_bytes(state.range(0))),
                              [&] { lynx::cuda::reconstruct<Plan, 32, lynx::bf16>(view, k, v); });
  state.SetLabel(level == 1 ? "anchor" : "full");
}

void token_args(benchmark::internal::Benchmark* b) {
  b->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
}
void level_args(benchmark::internal::Benchmark* b) {
  for (const std::int64_t tokens : {4096, 32768})
    for (const std::int64_t level : {1, 2}) b->Args({tokens, level});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(bm_cuda_memcpy_d2d)->Apply(token_args);
BENCHMARK(bm_cuda_encode<lynx::plan_8_4_4>)->Apply(token_args);
BENCHMARK(bm_cuda_reconstruct<lynx::plan_8_4_4>)->Apply(level_args);

}  // namespace

int main(int argc, char** argv) {
  return lynx_bench::run_cuda_benchmarks(argc, argv, "bench_cuda_codec");
}
