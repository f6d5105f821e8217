// bf16 and fp16 queries and outputs of the host attention: bf16/fp16 queries
// give the bits of the same call on their float values (widening is exact); a
// bf16/fp16 output holds the float output rounded to nearest even, element for
// element; a call must set exactly one query and one output pointer; an output
// beyond fp16's range is refused with a message; an fp16 tail gives the bits of
// a float tail holding its widened values.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/attention_paths.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"

namespace {

using plan = lynx::plan_8_4_4;
const lynx::kv_shape shape{700, 2, 64};
constexpr int q_heads = 4, n_queries = 2;

struct fixture {
  std::vector<float> k, v;
  lynx::bitplane_tensor<plan, 32, lynx::host_space> tensor{shape, 0};
  fixture() : k(static_cast<std::size_t>(shape.tokens * shape.kv_heads * shape.head_dim)) {
    v.resize(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f;
      v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f;
    }
    const auto layer =
        lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                      lynx::token_major<const float>(v.data(), shape), 0);
    tensor.accept(layer.segment(0));
  }
  // one call over the anchor, no tail
  void run(const lynx::attention_queries& q, const lynx::attention_output& out) const {
    const lynx::kv_view<const float, lynx::host_space> no_tail{};
    const lynx::tail_visibility visible{0, 0};
    lynx::decode_attention<> attention{};
    lynx::attention_workspace ws(attention.problem(tensor.view(), no_tail, q, visible), 2);
    attention(tensor.view(), no_tail, no_tail, q, visible, out, ws, {.threads = 2});
  }
};

constexpr std::size_t elements = static_cast<std::size_t>(n_queries) * q_heads * 64;

std::vector<float> some_queries() {
  std::vector<float> q(elements);
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>(static_cast<int>(i * 7919u % 613u) - 306) / 97.0f;
  return q;
}

}  // namespace

TEST_CASE("bf16 and fp16 queries: the bits of the call on their float values") {
  const fixture f;
  const std::vector<float> base = some_queries();
  std::vector<lynx::bf16> qb(elements);
  std::vector<lynx::fp16> qh(elements);
  std::vector<float> wide_b(elements), wide_h(elements);
  for (std::size_t i = 0; i < elements; ++i) {
    qb[i] = lynx::bf16(base[i]);
    qh[i] = lynx::fp16(base[i]);
    wide_b[i] = lynx::to_float(qb[i]);
    wide_h[i] = lynx::to_float(qh[i]);
  }
  std::vector<float> out_f(elements), out_t(elements), lse_f(n_queries * q_heads),
      lse_t(n_queries * q_heads);
  f.run({wide_b.data(), n_queries, q_heads, 64}, {out_f.data(), lse_f.data()});
  f.run({.count = n_queries, .q_heads = q_heads, .head_dim = 64, .data_bf16 = qb.data()},
        {out_t.data(), lse_t.data()});
  CHECK(std::memcmp(out_f.data(), out_t.data(), elements * 4) == 0);
  CHECK(std::memcmp(lse_f.data(), lse_t.data(), lse_f.size() * 4) == 0);
  f.run({wide_h.data(), n_queries, q_heads, 64}, {out_f.data(), lse_f.data()});
  f.run({.count = n_queries, .q_heads = q_heads, .head_dim = 64, .data_fp16 = qh.data()},
        {out_t.data(), lse_t.data()});
  CHECK(std::memcmp(out_f.data(), out_t.data(), elements * 4) == 0);
  CHECK(std::memcmp(lse_f.data(), lse_t.data(), lse_f.size() * 4) == 0);
}

TEST_CASE("bf16 and fp16 outputs: the float output rounded to nearest even") {
  const fixture f;
  const std::vector<float> q = some_queries();
  std::vector<float> out_f(elements), lse_f(n_queries * q_heads), lse_t(n_queries * q_heads);
  std::vector<lynx::bf16> out_b(elements);
  std::vector<lynx::fp16> out_h(elements);
  f.run({q.data(), n_queries, q_heads, 64}, {out_f.data(), lse_f.data()});
  f.run({q.data(), n_queries, q_heads, 64}, {.lse = lse_t.data(), .data_bf16 = out_b.data()});
  CHECK(std::memcmp(lse_f.data(), lse_t.data(), lse_f.size() * 4) == 0);
  f.run({q.data(), n_queries, q_heads, 64}, {.data_fp16 = out_h.data()});
  int bad_b = 0, bad_h = 0;
  for (std::size_t i = 0; i < elements; ++i) {
    bad_b += lynx::bf16(out_f[i]).bits != out_b[i].bits;
    bad_h += lynx::fp16(out_f[i]).bits != out_h[i].bits;
  }
  CHECK(bad_b == 0);
  CHECK(bad_h == 0);
}

TEST_CASE("exactly one query and one output pointer; fp16 outputs within fp16's range") {
  const fixture f;
  const std::vector<float> q = some_queries();
  std::vector<lynx::bf16> qb(elements);
  std::vector<float> out(elements);
  std::vector<lynx::fp16> out_h(elements);
  CHECK_THROWS_WITH(f.run({.data = q.data(),
                           .count = n_queries,
                           .q_heads = q_heads,
                           .head_dim = 64,
                           .data_bf16 = qb.data()},
                          {out.data()}),
                    "lynx: invalid_argument: attention: 2 query and 1 output pointers set; exactly "
                    "one of each (data, "
                    "data_bf16, data_fp16)");
  CHECK_THROWS_WITH(f.run({q.data(), n_queries, q_heads, 64}, {}),
                    "lynx: invalid_argument: attention: 1 query and 0 output pointers set; exactly "
                    "one of each (data, "
                    "data_bf16, data_fp16)");
  CHECK_THROWS_WITH(
      f.run({q.data(), n_queries, q_heads, 64}, {.data = out.data(), .data_fp16 = out_h.data()}),
      "lynx: invalid_argument: attention: 1 query and 2 output pointers set; exactly one of each "
      "(data, data_bf16, "
      "data_fp16)");

  // values of 1e5 on a tail alone: every output is 1e5, beyond fp16
  const lynx::kv_shape tail_shape{5, 2, 64};
  std::vector<float> tail(static_cast<std::size_t>(5 * 2 * 64), 1.0e5f);
  const auto tk = lynx::token_major<const float>(tail.data(), tail_shape);
  const lynx::attention_queries one{q.data(), 1, q_heads, 64};
  const lynx::tail_visibility all{5, 0};
  lynx::decode_attention<> attention{};
  lynx::attention_workspace ws(attention.problem(lynx::no_prompt{}, tk, one, all), 1);
  try {
    attention(lynx::no_prompt{}, tk, tk, one, all, {.data_fp16 = out_h.data()}, ws);
    FAIL("an fp16 output of 1e5 was accepted");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::invalid_argument);
    CHECK(std::string(e.what()).find("beyond fp16's range (65504)") != std::string::npos);
  }
  std::vector<lynx::bf16> out_b(elements);
  attention(lynx::no_prompt{}, tk, tk, one, all, {.data_bf16 = out_b.data()}, ws);
  CHECK(lynx::to_float(out_b[0]) == lynx::to_float(lynx::bf16(1.0e5f)));
}

TEST_CASE("an fp16 tail: the bits of a float tail of its widened values, on every host path") {
  const fixture f;
  const std::vector<float> q = some_queries();
  constexpr int tail_tokens = 40;  // query i sees 38 + i of them (causal)
  const lynx::kv_shape ts{tail_tokens, 2, 64};
  std::vector<lynx::fp16> hk(static_cast<std::size_t>(ts.elements())), hv(hk.size());
  std::vector<float> wk(hk.size()), wv(hk.size());
  for (std::size_t i = 0; i < hk.size(); ++i) {
    hk[i] = lynx::fp16(static_cast<float>(static_cast<int>(i * 613u % 401u) - 200) / 37.0f);
    hv[i] = lynx::fp16(static_cast<float>(static_cast<int>(i * 97u % 331u) - 165) / 29.0f);
    wk[i] = lynx::to_float(hk[i]);
    wv[i] = lynx::to_float(hv[i]);
  }
  const lynx::tail_visibility vis{tail_tokens - n_queries, 1};
  const lynx::attention_queries queries{q.data(), n_queries, q_heads, 64};
  auto call = [&](const auto& prompt, const auto& keys, const auto& values,
                  lynx::attention_path path) {
    const auto k = lynx::token_major<const std::remove_cvref_t<decltype(keys[0])>>(keys.data(), ts);
    const auto v =
        lynx::token_major<const std::remove_cvref_t<decltype(values[0])>>(values.data(), ts);
    std::vector<float> out(elements + n_queries * q_heads);
    lynx::decode_attention<> attention{};
    lynx::attention_workspace ws(attention.problem(prompt, k, queries, vis), 2);
    attention(prompt, k, v, queries, vis, {out.data(), out.data() + elements}, ws,
              {.threads = 2, .path = path});
    return out;
  };
  for (const auto path : lynx::test::host_attention_paths()) {
    CAPTURE(lynx::test::attention_path_name(path));
    // over the anchor of a bit-plane prompt, and with no prompt
    const auto planes_f = call(f.tensor.view(), wk, wv, path);
    CHECK(call(f.tensor.view(), hk, hv, path) == planes_f);
    const auto alone_f = call(lynx::no_prompt{}, wk, wv, path);
    CHECK(call(lynx::no_prompt{}, hk, hv, path) == alone_f);
    // and the same bits on every path (the first one's)
    CHECK(planes_f == call(f.tensor.view(), wk, wv, lynx::attention_path::portable));
  }
}
