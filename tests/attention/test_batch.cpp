// Batched decode attention (decode_attention::batch): many requests in one
// call, each with its own prompt length and precision level (anchor for one,
// complete for another), query count, tail (contiguous or paged) and
// visibility. Every request's outputs and log-sum-exps are the bits of its own
// call, for batches of 1 to 16 requests, in any order, with 1 to 3 threads and
// on every host path; the same for dense bf16 prompts (the 16-bit baseline)
// and for requests without a prompt. A bad request is named in the error and
// nothing is written.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../support/attention_paths.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"

namespace {

using plan = lynx::plan_8_4_4;
using tensor = lynx::bitplane_tensor<plan>;
using planes_request =
    lynx::attention_request<lynx::bitplane_view<plan, 32, lynx::host_space>, float>;
constexpr int kv_heads = 2, q_heads = 4, head_dim = 64;

std::vector<float> values_for(std::int64_t n, unsigned salt) {
  std::vector<float> x(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(static_cast<int>((i + salt) * 2654435761u % 2001u) - 1000) /
           (250.0f + static_cast<float>(salt % 7) * 40.0f);
  return x;
}

/// One request's data: prompt tensor at a level, tail (maybe paged), queries, outputs.
struct request_data {
  lynx::kv_shape prompt_shape, tail_shape;
  std::vector<float> k, v, tk, tv, q;
  tensor planes;
  std::vector<float> pool_k, pool_v;  // paged copies of the tail
  std::vector<std::int32_t> table;
  bool paged = false;
  int count = 1;
  lynx::tail_visibility vis;
  std::vector<float> out, lse;

  request_data(int r, std::mt19937& rng)
      : prompt_shape{std::uniform_int_distribution<std::int64_t>(40, 2600)(rng), kv_heads,
                     head_dim},
        tail_shape{std::uniform_int_distribution<std::int64_t>(4, 40)(rng), kv_heads, head_dim},
        planes(prompt_shape, 0) {
    k = values_for(prompt_shape.elements(), 3u * static_cast<unsigned>(r) + 1);
    v = values_for(prompt_shape.elements(), 3u * static_cast<unsigned>(r) + 2);
    tk = values_for(tail_shape.elements(), 5u * static_cast<unsigned>(r) + 3);
    tv = values_for(tail_shape.elements(), 5u * static_cast<unsigned>(r) + 4);
    const auto e =
        lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), prompt_shape),
                                      lynx::token_major<const float>(v.data(), prompt_shape), 0);
    const int level = r % 3 == 0 ? 1 : 2;  // the anchor alone for a third of them
    for (int s = 0; s < level; ++s) planes.accept(e.segment(s));
    count = std::uniform_int_distribution<int>(1, 4)(rng);
    count = static_cast<int>(std::min<std::int64_t>(count, tail_shape.tokens));
    vis = {tail_shape.tokens - count, 1};
    q = values_for(static_cast<std::int64_t>(count) * q_heads * head_dim,
                   7u * static_cast<unsigned>(r) + 5);
    paged = r % 2 == 1;
    if (paged) {  // blocks of 16 in reverse order inside a pool
      const std::int64_t bs = 16, blocks = (tail_shape.tokens + bs - 1) / bs;
      pool_k.assign(static_cast<std::size_t>((blocks + 1) * bs * kv_heads * head_dim), 0.0f);
      pool_v = pool_k;
      for (std::int64_t b = 0; b < blocks; ++b)
        table.push_back(static_cast<std::int32_t>(blocks - b));
      const auto pk = lynx::paged_token_major<float>(pool_k.data(), tail_shape, table.data(), bs);
      const auto pv = lynx::paged_token_major<float>(pool_v.data(), tail_shape, table.data(), bs);
      for (std::int64_t t = 0; t < tail_shape.tokens; ++t)
        for (std::int64_t h = 0; h < kv_heads; ++h)
          for (std::int64_t c = 0; c < head_dim; ++c) {
            const auto i = static_cast<std::size_t>((t * kv_heads + h) * head_dim + c);
            pk(t, h, c) = tk[i];
            pv(t, h, c) = tv[i];
          }
    }
    out.assign(static_cast<std::size_t>(count) * q_heads * head_dim, -1.0f);
    lse.assign(static_cast<std::size_t>(count) * q_heads, -1.0f);
  }

  [[nodiscard]] lynx::kv_view<const float, lynx::host_space> tail_keys() const {
    return paged ? lynx::paged_token_major<const float>(pool_k.data(), tail_shape, table.data(), 16)
                 : lynx::token_major<const float>(tk.data(), tail_shape);
  }
  [[nodiscard]] lynx::kv_view<const float, lynx::host_space> tail_values() const {
    return paged ? lynx::paged_token_major<const float>(pool_v.data(), tail_shape, table.data(), 16)
                 : lynx::token_major<const float>(tv.data(), tail_shape);
  }
  [[nodiscard]] planes_request request() {
    return {planes.view(), tail_keys(),
            tail_values(), {q.data(), count, q_heads, head_dim},
            vis,           {out.data(), lse.data()}};
  }
  /// The outputs of this request's own call.
  void solo(std::vector<float>& o, std::vector<float>& l, int threads,
            lynx::attention_path path) const {
    o.assign(out.size(), -2.0f);
    l.assign(lse.size(), -2.0f);
    lynx::decode_attention<> attention{};
    const lynx::attention_queries queries{q.data(), count, q_heads, head_dim};
    lynx::attention_workspace ws(attention.problem(planes.view(), tail_keys(), queries, vis),
                                 threads);
    attention(planes.view(), tail_keys(), tail_values(), queries, vis, {o.data(), l.data()}, ws,
              {.threads = threads, .path = path});
  }
};

}  // namespace

TEST_CASE("batched attention: every request gets the bits of its own call") {
  std::mt19937 rng(2026);
  std::vector<request_data> data;
  data.reserve(16);
  for (int r = 0; r < 16; ++r) data.emplace_back(r, rng);
  lynx::decode_attention<> attention{};
  for (const auto path : lynx::test::host_attention_paths()) {
    CAPTURE(lynx::test::attention_path_name(path));
    std::vector<std::vector<float>> want_out(16), want_lse(16);
    for (std::size_t r = 0; r < 16; ++r) data[r].solo(want_out[r], want_lse[r], 1, path);
    for (const int size : {1, 2, 3, 5, 8, 16}) {
      for (const int threads : {1, 2, 3}) {
        CAPTURE(size);
        CAPTURE(threads);
        // a different mix of requests, in a different order, each time
        std::vector<std::size_t> order(16);
        std::iota(order.begin(), order.end(), std::size_t{0});
        std::shuffle(order.begin(), order.end(), rng);
        order.resize(static_cast<std::size_t>(size));
        std::vector<planes_request> batch;
        for (const std::size_t r : order) {
          std::fill(data[r].out.begin(), data[r].out.end(), -1.0f);
          batch.push_back(data[r].request());
        }
        lynx::attention_workspace ws;
        ws.reserve_bytes(
            lynx::decode_attention<>::batch_bytes<lynx::bitplane_view<plan, 32, lynx::host_space>,
                                                  float>(batch, threads));
        attention.batch<lynx::bitplane_view<plan, 32, lynx::host_space>, float>(
            batch, ws, {.threads = threads, .path = path});
        for (const std::size_t r : order) {
          CAPTURE(r);
          CHECK(std::memcmp(data[r].out.data(), want_out[r].data(), data[r].out.size() * 4) == 0);
          CHECK(std::memcmp(data[r].lse.data(), want_lse[r].data(), data[r].lse.size() * 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("batched attention over dense bf16 prompts and without a prompt: the solo bits") {
  std::mt19937 rng(7);
  lynx::decode_attention<> attention{};
  constexpr int n = 6;
  std::vector<std::vector<lynx::bf16>> keys(n), values(n), tails_k(n), tails_v(n);
  std::vector<std::vector<float>> queries(n), outs(n), want(n);
  std::vector<lynx::kv_shape> shapes(n), tail_shapes(n);
  std::vector<int> counts(n);
  using dense = lynx::dense_prompt<lynx::bf16>;
  std::vector<lynx::attention_request<dense, lynx::bf16>> batch;
  std::vector<lynx::attention_request<lynx::no_prompt, lynx::bf16>> alone;
  auto to_bf16 = [](const std::vector<float>& x) {
    std::vector<lynx::bf16> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = lynx::bf16(x[i]);
    return y;
  };
  for (int r = 0; r < n; ++r) {
    shapes[r] = {std::uniform_int_distribution<std::int64_t>(20, 2200)(rng), kv_heads, head_dim};
    tail_shapes[r] = {std::uniform_int_distribution<std::int64_t>(3, 20)(rng), kv_heads, head_dim};
    counts[r] = std::min<int>(3, static_cast<int>(tail_shapes[r].tokens));
    keys[r] = to_bf16(values_for(shapes[r].elements(), 11u * r + 1));
    values[r] = to_bf16(values_for(shapes[r].elements(), 11u * r + 2));
    tails_k[r] = to_bf16(values_for(tail_shapes[r].elements(), 11u * r + 3));
    tails_v[r] = to_bf16(values_for(tail_shapes[r].elements(), 11u * r + 4));
    queries[r] = values_for(static_cast<std::int64_t>(counts[r]) * q_heads * head_dim, 11u * r + 5);
    outs[r].assign(queries[r].size(), -1.0f);
    const dense prompt{lynx::token_major<const lynx::bf16>(keys[r].data(), shapes[r]),
                       lynx::token_major<const lynx::bf16>(values[r].data(), shapes[r])};
    const auto tk = lynx::token_major<const lynx::bf16>(tails_k[r].data(), tail_shapes[r]);
    const auto tv = lynx::token_major<const lynx::bf16>(tails_v[r].data(), tail_shapes[r]);
    const lynx::attention_queries q{queries[r].data(), counts[r], q_heads, head_dim};
    const lynx::tail_visibility vis{tail_shapes[r].tokens - counts[r], 1};
    want[r].assign(queries[r].size(), -2.0f);
    lynx::attention_workspace ws(attention.problem(prompt, tk, q, vis), 2);
    attention(prompt, tk, tv, q, vis, {want[r].data()}, ws, {.threads = 2});
    batch.push_back({prompt, tk, tv, q, vis, {outs[r].data()}});
    alone.push_back({{}, tk, tv, q, vis, {outs[r].data()}});
  }
  lynx::attention_workspace ws;
  ws.reserve_bytes(lynx::decode_attention<>::batch_bytes<dense, lynx::bf16>(batch, 2));
  attention.batch<dense, lynx::bf16>(batch, ws, {.threads = 2});
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(outs[r] == want[r]);
  }
  // no prompt: the tail alone, against its own call
  for (int r = 0; r < n; ++r) {
    const auto& a = alone[static_cast<std::size_t>(r)];
    lynx::attention_workspace w1(
        attention.problem(lynx::no_prompt{}, a.tail_keys, a.queries, a.visible), 1);
    attention(lynx::no_prompt{}, a.tail_keys, a.tail_values, a.queries, a.visible, {want[r].data()},
              w1, {.threads = 1});
  }
  ws.reserve_bytes(lynx::decode_attention<>::batch_bytes<lynx::no_prompt, lynx::bf16>(alone, 3));
  attention.batch<lynx::no_prompt, lynx::bf16>(alone, ws, {.threads = 3});
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(outs[r] == want[r]);
  }
}

TEST_CASE("a bad request is named and nothing is written") {
  std::mt19937 rng(3);
  std::vector<request_data> data;
  for (int r = 0; r < 3; ++r) data.emplace_back(r, rng);
  std::vector<planes_request> batch;
  for (auto& d : data) batch.push_back(d.request());
  batch[2].queries.head_dim = 32;  // not the prompt's
  lynx::decode_attention<> attention{};
  lynx::attention_workspace ws;
  ws.reserve_bytes(1 << 24);
  try {
    attention.batch<lynx::bitplane_view<plan, 32, lynx::host_space>, float>(batch, ws);
    FAIL("a request with the wrong head_dim was taken");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::shape_mismatch);
    CHECK(std::string(e.what()).find("attention batch: request 2: attention: queries have "
                                     "head_dim 32") != std::string::npos);
  }
  for (const auto& d : data)
    CHECK(std::all_of(d.out.begin(), d.out.end(), [](float x) { return x == -1.0f; }));
  // a workspace too small is refused with the size to reserve
  batch[2].queries.head_dim = head_dim;
  lynx::attention_workspace small;
  small.reserve_bytes(64);
  CHECK_THROWS_AS(
      (attention.batch<lynx::bitplane_view<plan, 32, lynx::host_space>, float>(batch, small)),
      lynx::error);
}
