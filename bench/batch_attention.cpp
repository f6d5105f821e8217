// Batched decode attention (decode_attention::batch) against the same requests
// as solo calls, one after the other: 8 requests of one decode step (1 query
// each, 32 query heads over 8 kv heads of 128 channels, a 16-token local tail),
// each over its own 4K-token prompt in bit planes of 8 = 4 + 4, half of them at
// the anchor alone and half complete. Every request's bits are the same either
// way (attention.test_batch); the batch runs all their work items in one pool
// of workers (one fork and join instead of eight).
//
//   ./build/release/bench/bench_batch_attention --benchmark_min_time=0.5s
//
// The bar (issue 31): not slower than the solo calls with 1 thread, faster with 2.
#include <benchmark/benchmark.h>

#include <vector>

#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"

namespace {

using plan = lynx::plan_8_4_4;
using prompt_t = lynx::bitplane_view<plan, 32, lynx::host_space>;
constexpr int requests = 8, q_heads = 32, kv_heads = 8, head_dim = 128, tail_tokens = 16;
constexpr std::int64_t prompt_tokens = 4096;

struct batch_fixture {
  std::vector<lynx::bitplane_tensor<plan>> tensors;
  std::vector<std::vector<float>> tail, q, out;
  std::vector<lynx::attention_request<prompt_t, float>> batch;

  batch_fixture() {
    const lynx::kv_shape shape{prompt_tokens, kv_heads, head_dim},
        tail_shape{tail_tokens, kv_heads, head_dim};
    std::vector<float> k(static_cast<std::size_t>(shape.elements())), v(k.size());
    tensors.reserve(requests);
    for (int r = 0; r < requests; ++r) {
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = static_cast<float>(static_cast<int>((i + 31 * r) * 2654435761u % 2001u) - 1000) /
               400.0f;
        v[i] = static_cast<float>(static_cast<int>((i + 17 * r) * 40503u % 1777u) - 888) / 300.0f;
      }
      const auto e = lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                                   lynx::token_major<const float>(v.data(), shape),
                                                   0, {.threads = 0});
      tensors.emplace_back(shape, 0);
      for (int s = 0; s < (r % 2 == 0 ? 1 : plan::streams); ++s)
        tensors.back().accept(e.segment(s));
      tail.emplace_back(static_cast<std::size_t>(tail_shape.elements()), 0.25f);
      q.emplace_back(static_cast<std::size_t>(q_heads * head_dim), 0.01f * static_cast<float>(r));
      out.emplace_back(q.back().size());
    }
    for (int r = 0; r < requests; ++r) {
      const auto t = lynx::token_major<const float>(tail[r].data(), tail_shape);
      batch.push_back({tensors[r].view(),
                       t,
                       t,
                       {q[r].data(), 1, q_heads, head_dim},
                       {tail_tokens - 1, 1},
                       {out[r].data()}});
    }
  }
};

batch_fixture& fixture() {
  static batch_fixture f;
  return f;
}

void BM_solo_calls(benchmark::State& state) {
  auto& f = fixture();
  const int threads = static_cast<int>(state.range(0));
  lynx::decode_attention<> attention{};
  lynx::attention_workspace ws;
  for (const auto& r : f.batch)
    ws.reserve(attention.problem(r.prompt, r.tail_keys, r.queries, r.visible), threads);
  for (auto _ : state)
    for (const auto& r : f.batch)
      attention(r.prompt, r.tail_keys, r.tail_values, r.queries, r.visible, r.out, ws,
                {.threads = threads});
}

void BM_batch(benchmark::State& state) {
  auto& f = fixture();
  const int threads = static_cast<int>(state.range(0));
  lynx::decode_attention<> attention{};
  lynx::attention_workspace ws;
  ws.reserve_bytes(lynx::decode_attention<>::batch_bytes<prompt_t, float>(f.batch, threads));
  for (auto _ : state) attention.batch<prompt_t, float>(f.batch, ws, {.threads = threads});
}

}  // namespace

BENCHMARK(BM_solo_calls)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_batch)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond)->UseRealTime();
