// What the CUDA benchmarks share: timing a launch sequence with CUDA events,
// and a main that says so and measures nothing where there is no device.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "lynx/backend/cuda/error.cuh"

namespace lynx_bench {

/// Times `body` (launches on the default stream) with CUDA events per iteration,
/// after one warm-up call; reports `bytes` per iteration. Returns the mean
/// seconds per iteration (0 when the state ran none).
template <class F>
double cuda_timed_loop(benchmark::State& state, double bytes, F&& body) {
  cudaEvent_t start, stop;
  LYNX_CUDA_CHECK(cudaEventCreate(&start));
  LYNX_CUDA_CHECK(cudaEventCreate(&stop));
  body();  // warm-up
  LYNX_CUDA_CHECK(cudaDeviceSynchronize());
  double total = 0.0;
  for (auto _ : state) {
    LYNX_CUDA_CHECK(cudaEventRecord(start));
    body();
    LYNX_CUDA_CHECK(cudaEventRecord(stop));
    LYNX_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    LYNX_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    total += static_cast<double>(ms) * 1e-3;
  }
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * bytes));
  LYNX_CUDA_CHECK(cudaEventDestroy(start));
  LYNX_CUDA_CHECK(cudaEventDestroy(stop));
  return state.iterations() > 0 ? total / static_cast<double>(state.iterations()) : 0.0;
}

/// Runs the registered benchmarks; prints that there is nothing to measure (and
/// returns 0) where no CUDA device is present.
inline int run_cuda_benchmarks(int argc, char** argv, const char* name) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("%s: no CUDA device, nothing to measure\n", name);
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace lynx_bench
