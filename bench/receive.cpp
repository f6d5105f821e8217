// Receiving one layer: a bitplane_tensor's accept (validate, then copy each
// segment's payload into the tensor) against a slot_tensor's accept_in_place
// (the transport wrote the segment into the engine's slot; validate it there,
// no copy), with the checksum pass alone as the floor both pay. Llama-3-8B
// layer shape (8 kv heads x 128), 8 = 4 + 4 at G = 32, 4K and 32K tokens.
//
//   ./build/release/bench/bench_receive --benchmark_min_time=0.5
//
// The bar (issue 31): in place at most the checksum's time plus 10%.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/tensor.hpp"

namespace {

using plan = lynx::plan_8_4_4;

struct layer_fixture {
  lynx::kv_shape shape;
  lynx::encoded_layer<plan> layer;
  std::vector<lynx::aligned_buffer> buffers;
  std::vector<std::span<std::byte>> slots;
  std::int64_t bytes = 0;

  static lynx::encoded_layer<plan> make(lynx::kv_shape s) {
    std::vector<float> k(static_cast<std::size_t>(s.elements())), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f;
      v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f;
    }
    return lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), s),
                                         lynx::token_major<const float>(v.data(), s), 0,
                                         {.generation = 1, .threads = 0});
  }
  explicit layer_fixture(std::int64_t tokens) : shape{tokens, 8, 128}, layer(make(shape)) {
    for (int s = 0; s < plan::streams; ++s) {
      buffers.emplace_back(layer.segment(s).size());
      std::memcpy(buffers.back().data(), layer.segment(s).data(), layer.segment(s).size());
      slots.emplace_back(buffers.back().data(), buffers.back().size());
      bytes += static_cast<std::int64_t>(layer.segment(s).size());
    }
  }
};

layer_fixture& fixture_of(std::int64_t tokens) {
  static layer_fixture f4(4096), f32(32768);
  return tokens == 4096 ? f4 : f32;
}

void BM_checksum(benchmark::State& state) {
  auto& f = fixture_of(state.range(0));
  for (auto _ : state) {
    for (int s = 0; s < plan::streams; ++s) {
      const std::span<const std::byte> seg =
          f.slots[static_cast<std::size_t>(s)];  // the same bytes
      const lynx::segment_header h = lynx::peek_header(seg);
      benchmark::DoNotOptimize(lynx::segment_checksum(h, seg.subspan(lynx::segment_header_bytes)));
    }
  }
  state.SetBytesProcessed(state.iterations() * f.bytes);
}

void BM_accept_copy(benchmark::State& state) {
  auto& f = fixture_of(state.range(0));
  lynx::bitplane_tensor<plan> t(f.shape, 0, 1);
  for (auto _ : state) {
    t.reset(1);
    for (int s = 0; s < plan::streams; ++s) benchmark::DoNotOptimize(t.accept(f.layer.segment(s)));
  }
  state.SetBytesProcessed(state.iterations() * f.bytes);
}

void BM_accept_in_place(benchmark::State& state) {
  auto& f = fixture_of(state.range(0));
  lynx::slot_tensor<plan> t(f.shape, 0, 1, f.slots);
  for (auto _ : state) {
    t.reset(1);
    for (int s = 0; s < plan::streams; ++s) benchmark::DoNotOptimize(t.accept_in_place(s));
  }
  state.SetBytesProcessed(state.iterations() * f.bytes);
}

// The exact per-group parameter check, which accept runs only for an anchor
// the checksum pass found suspect: what a second pass over the parameters
// would cost every anchor.
void BM_check_params(benchmark::State& state) {
  auto& f = fixture_of(state.range(0));
  const auto g = lynx::make_geometry<plan, 32>(f.shape);
  for (auto _ : state) {
    lynx::detail::check_params(g, 0, f.layer.segment(0).data() + lynx::segment_header_bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * g.wire_params_bytes());
}

}  // namespace

BENCHMARK(BM_check_params)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_checksum)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_accept_copy)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_accept_in_place)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
