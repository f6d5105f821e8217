// Decode attention over a bit-plane prompt plus a local tail: accuracy against
// an fp64 reference on the reconstructed values, bitwise batch invariance,
// bitwise agreement of the portable walk (as built, and compiled for AVX2 + FMA) and the
// AVX-512 walk, and shape errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/attention_paths.hpp"
#include "../support/attention_reference.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"

namespace {

using lynx::bf16;

struct rng {
  std::mt19937 gen;
  explicit rng(unsigned seed) : gen(seed) {}
  float normal(float sd = 1.0f) { return std::normal_distribution<float>(0.0f, sd)(gen); }
};

// K with per-channel offsets (outlier channels), V plain: [tokens][kv_heads][head_dim].
std::vector<float> make_kv(std::int64_t tokens, std::int64_t kv_heads, std::int64_t D,
                           unsigned seed, bool keys) {
  rng r(seed);
  std::vector<float> offset(static_cast<std::size_t>(kv_heads * D));
  for (auto& o : offset) o = keys ? r.normal(2.0f) : 0.0f;
  std::vector<float> x(static_cast<std::size_t>(tokens * kv_heads * D));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < kv_heads * D; ++i)
      x[static_cast<std::size_t>(t * kv_heads * D + i)] =
          offset[static_cast<std::size_t>(i)] + r.normal();
  return x;
}

std::vector<float> make_queries(std::int64_t n, std::int64_t qh, std::int64_t D, unsigned seed) {
  rng r(seed);
  std::vector<float> q(static_cast<std::size_t>(n * qh * D));
  for (auto& v : q) v = r.normal(1.5f);
  return q;
}

using reference_result = lynx::test::attention_reference_result;

// fp64 attention reference (tests/support/attention_reference.hpp) with this
// backend's split of the context: 1024-token splits, plus one.
template <class TailT>
reference_result reference(const std::vector<float>& pk, const std::vector<float>& pv,
                           std::int64_t prompt_tokens, const std::vector<TailT>& tk,
                           const std::vector<TailT>& tv, std::int64_t kv_heads, std::int64_t D,
                           const std::vector<float>& q, std::int64_t n, std::int64_t qh,
                           lynx::tail_visibility vis, double scale, std::int64_t window = 0,
                           double cap = 0.0) {
  return lynx::test::attention_reference({1024.0, 1.0}, pk, pv, prompt_tokens, tk, tv, kv_heads, D,
                                         q, n, qh, vis, scale, window, cap);
}

template <class Plan, int G = 32>
lynx::bitplane_tensor<Plan, G> make_tensor(const std::vector<float>& k, const std::vector<float>& v,
                                           lynx::kv_shape shape, int level) {
  const auto enc = lynx::encode<Plan, G>(lynx::token_major<const float>(k.data(), shape),
                                         lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<Plan, G> t(shape, 0);
  for (int s = 0; s < level; ++s) t.accept(enc.segment(s));
  return t;
}

template <class Plan, int G>
void reconstructed(const lynx::bitplane_tensor<Plan, G>& t, std::vector<float>& k,
                   std::vector<float>& v) {
  const lynx::kv_shape shape = t.shape();
  k.resize(static_cast<std::size_t>(shape.elements()));
  v.resize(k.size());
  lynx::reconstruct(t, lynx::token_major<float>(k.data(), shape),
                    lynx::token_major<float>(v.data(), shape));
}

template <class TailT>
std::vector<TailT> to_tail(const std::vector<float>& x) {
  std::vector<TailT> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = lynx::from_float<TailT>(x[i]);
  return r;
}

template <class Prompt, class TailT, class Variant = lynx::default_variant>
std::vector<float> run_attention(const Prompt& prompt, const std::vector<TailT>& tk,
                                 const std::vector<TailT>& tv, std::int64_t tail_tokens,
                                 std::int64_t kv_heads, std::int64_t D, const float* q,
                                 std::int64_t n, std::int64_t qh, lynx::tail_visibility vis,
                                 int threads, lynx::attention_path path,
                                 std::vector<float>* lse = nullptr, Variant variant = {}) {
  const lynx::kv_shape ts{tail_tokens, kv_heads, D};
  const auto tkv = lynx::token_major<const TailT>(tk.data(), ts),
             tvv = lynx::token_major<const TailT>(tv.data(), ts);
  const lynx::attention_queries queries{q, n, qh, D};
  lynx::decode_attention<Variant> attn{variant};
  lynx::attention_workspace ws(attn.problem(prompt, tkv, queries, vis), threads);
  std::vector<float> out(static_cast<std::size_t>(n * qh * D), -1.0f);
  if (lse) lse->assign(static_cast<std::size_t>(n * qh), 0.0f);
  attn(prompt, tkv, tvv, queries, vis, {out.data(), lse ? lse->data() : nullptr}, ws,
       {threads, path});
  return out;
}

void check_close(const std::vector<float>& out, const reference_result& ref, std::int64_t D,
                 const std::string& what) {
  double worst = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double err = std::abs(out[i] - ref.out[i]),
                 tol = ref.tol[i / static_cast<std::size_t>(D)];
    worst = std::max(worst, err / tol);
  }
  INFO(what << ": worst error / tolerance = " << worst);
  CHECK(worst <= 1.0);
}

bool same_bits(const std::vector<float>& a, const float* b, std::size_t n) {
  return std::memcmp(a.data(), b, n * sizeof(float)) == 0;
}

std::vector<lynx::attention_path> paths() { return lynx::test::host_attention_paths(); }

template <class Plan, int G = 32>
void accuracy_case(std::int64_t tokens, std::int64_t kv_heads, std::int64_t group, std::int64_t D,
                   std::int64_t tail_tokens, std::int64_t n) {
  const lynx::kv_shape shape{tokens, kv_heads, D};
  const auto k = make_kv(tokens, kv_heads, D, 11, true),
             v = make_kv(tokens, kv_heads, D, 12, false);
  const auto tkf = make_kv(tail_tokens, kv_heads, D, 13, true),
             tvf = make_kv(tail_tokens, kv_heads, D, 14, false);
  const auto tk = to_tail<bf16>(tkf), tv = to_tail<bf16>(tvf);
  const std::int64_t qh = kv_heads * group;
  const auto q = make_queries(n, qh, D, 15);
  const lynx::tail_visibility vis{tail_tokens - n, 1};
  for (int level = 1; level <= Plan::streams; ++level) {
    const auto tensor = make_tensor<Plan, G>(k, v, shape, level);
    std::vector<float> rk, rv;
    reconstructed(tensor, rk, rv);
    const auto ref = reference(rk, rv, tokens, tk, tv, kv_heads, D, q, n, qh, vis,
                               1.0 / std::sqrt(static_cast<double>(D)));
    std::vector<std::vector<float>> outs;
    for (auto path : paths()) {
      std::vector<float> lse;
      const auto out = run_attention(tensor.view(), tk, tv, tail_tokens, kv_heads, D, q.data(), n,
                                     qh, vis, 1, path, &lse);
      check_close(out, ref, D,
                  Plan::name() + " G=" + std::to_string(G) + " level " + std::to_string(level) +
                      " T=" + std::to_string(tokens) + " D=" + std::to_string(D) + " group=" +
                      std::to_string(group) + " path=" + std::to_string(static_cast<int>(path)));
      for (std::size_t i = 0; i < lse.size(); ++i)
        CHECK(std::abs(lse[i] - ref.lse[i]) <= 1e-4 * (1.0 + std::abs(ref.lse[i])));
      outs.push_back(out);
    }
    // every walk does the same operations in the same order
    for (std::size_t i = 1; i < outs.size(); ++i)
      CHECK(same_bits(outs[0], outs[i].data(), outs[0].size()));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("attention on every precision level matches fp64 on the reconstructed values",
                   Plan, lynx::plan_8_4_4, lynx::plan_8_2_2_4, lynx::plan_16_4_12,
                   lynx::plan_16_4_4_8) {
  accuracy_case<Plan>(37, 2, 4, 64, 5, 3);
  accuracy_case<Plan>(1100, 1, 8, 128, 3, 2);  // two prompt splits, a last block of 12 tokens
  accuracy_case<Plan>(1, 3, 1, 8, 4, 4);       // head_dim 8 (the real model), a one-token prompt
  accuracy_case<Plan>(65, 1, 4, 256, 1, 1);
  // small head_dims (the AVX-512 walk reads a last chunk of D % 16 channels)
  accuracy_case<Plan>(300, 4, 2, 8, 40,
                      3);  // stories260K's shape: 4 kv heads, 2 q heads each, ~300 prompt tokens
  accuracy_case<Plan>(70, 2, 4, 16, 3, 2);
  accuracy_case<Plan>(90, 1, 8, 32, 2, 2);
  accuracy_case<Plan>(45, 2, 2, 24, 3, 2);   // one chunk of 16 channels and one of 8
  accuracy_case<Plan>(140, 1, 3, 64, 2, 2);  // 3 heads per kv head, a last partial block
}

TEST_CASE_TEMPLATE("groups of 64 tokens / channels: a value group spans several channel passes",
                   Plan, lynx::plan_8_4_4, lynx::plan_16_4_12) {
  accuracy_case<Plan, 64>(1100, 2, 4, 128, 3, 2);  // passes of 32 channels share a value group
  accuracy_case<Plan, 64>(300, 1, 2, 192, 2, 2);   // passes of 64 channels, then of 16
  accuracy_case<Plan, 64>(200, 3, 5, 64, 1, 1);    // 4 heads and 1 head per group of 5
}

// Plane counts outside detail::compiled_plane_counts (1, 3, 5, 7, 9, 13, 15): the
// portable loops run with the count known at run time and the AVX2 walk falls back
// to them; every path must still give the same bits, within the fp64 bound.
TEST_CASE_TEMPLATE("levels of plane counts the walks are not compiled for", Plan,
                   lynx::stream_plan<8, 1, 2, 5>, lynx::stream_plan<16, 3, 6, 4, 3>,
                   lynx::stream_plan<16, 9, 6, 1>) {
  accuracy_case<Plan>(37, 2, 4, 64, 5, 3);
  accuracy_case<Plan>(140, 1, 3, 128, 2, 2);  // the transposed value decode's head_dim
  accuracy_case<Plan>(45, 2, 2, 24, 3, 2);
}

TEST_CASE("long context: several splits, large GQA group") {
  accuracy_case<lynx::plan_8_4_4>(3000, 2, 8, 64, 1030, 4);  // tail crosses a split boundary
}

TEST_CASE("the longest context the attention is built for: 128K prompt tokens, 128 splits") {
  accuracy_case<lynx::plan_8_4_4>(131072, 1, 4, 64, 9, 2);
}

TEST_CASE("empty tail, tail only, float tail, dense bf16 prompt (the 16-bit baseline)") {
  const std::int64_t T = 300, H = 2, D = 64, group = 4, qh = H * group;
  const lynx::kv_shape shape{T, H, D};
  const auto k = make_kv(T, H, D, 21, true), v = make_kv(T, H, D, 22, false);
  const auto q = make_queries(3, qh, D, 23);
  const double scale = 1.0 / 8.0;
  for (auto path : paths()) {
    // empty tail: queries see the prompt only (per_query 0)
    const auto tensor = make_tensor<lynx::plan_8_4_4>(k, v, shape, 2);
    std::vector<float> rk, rv;
    reconstructed(tensor, rk, rv);
    const std::vector<float> none;
    const lynx::tail_visibility prompt_only{0, 0};
    check_close(
        run_attention(tensor.view(), none, none, 0, H, D, q.data(), 3, qh, prompt_only, 1, path),
        reference(rk, rv, T, none, none, H, D, q, 3, qh, prompt_only, scale), D, "empty tail");
    // tail only (no prompt), float tail, causal
    const auto tk = make_kv(40, H, D, 24, true), tv = make_kv(40, H, D, 25, false);
    const lynx::tail_visibility causal{37, 1};
    check_close(
        run_attention(lynx::no_prompt{}, tk, tv, 40, H, D, q.data(), 3, qh, causal, 1, path),
        reference(none, none, 0, tk, tv, H, D, q, 3, qh, causal, scale), D, "tail only");
    // dense bf16 prompt: the baseline; reference on the bf16 values
    const auto kb = to_tail<bf16>(k), vb = to_tail<bf16>(v);
    std::vector<float> kbf(kb.size()), vbf(vb.size());
    for (std::size_t i = 0; i < kb.size(); ++i)
      kbf[i] = static_cast<float>(kb[i]), vbf[i] = static_cast<float>(vb[i]);
    const lynx::dense_prompt<bf16> dp{lynx::token_major<const bf16>(kb.data(), shape),
                                      lynx::token_major<const bf16>(vb.data(), shape)};
    const auto tkb = to_tail<bf16>(tk), tvb = to_tail<bf16>(tv);
    check_close(run_attention(dp, tkb, tvb, 40, H, D, q.data(), 3, qh, causal, 1, path),
                reference(kbf, vbf, T, tkb, tvb, H, D, q, 3, qh, causal, scale), D,
                "bf16 baseline");
  }
}

TEST_CASE("variants: explicit scale, sliding window, soft-cap") {
  const std::int64_t T = 2100, H = 1, D = 64, qh = 4;
  const lynx::kv_shape shape{T, H, D};
  const auto k = make_kv(T, H, D, 31, true), v = make_kv(T, H, D, 32, false);
  const auto q = make_queries(2, qh, D, 33);
  const auto tensor = make_tensor<lynx::plan_8_4_4>(k, v, shape, 2);
  std::vector<float> rk, rv;
  reconstructed(tensor, rk, rv);
  const auto tk = make_kv(8, H, D, 34, true), tv = make_kv(8, H, D, 35, false);
  const lynx::tail_visibility causal{6, 1};
  for (auto path : paths()) {
    lynx::default_variant windowed;
    windowed.scale = 0.2f;
    windowed.window_ =
        1500;  // the first split is partly, and tokens before 600 fully, out of the window
    check_close(run_attention(tensor.view(), tk, tv, 8, H, D, q.data(), 2, qh, causal, 1, path,
                              nullptr, windowed),
                reference(rk, rv, T, tk, tv, H, D, q, 2, qh, causal, 0.2, 1500), D, "window");
    lynx::soft_cap_variant capped;
    capped.cap = 5.0f;
    check_close(run_attention(tensor.view(), tk, tv, 8, H, D, q.data(), 2, qh, causal, 1, path,
                              nullptr, capped),
                reference(rk, rv, T, tk, tv, H, D, q, 2, qh, causal, 1.0 / 8.0, 0, 5.0), D,
                "soft-cap");
  }
}

TEST_CASE_TEMPLATE("batch invariance: alone vs among k queries, any thread count", Plan,
                   lynx::plan_8_4_4, lynx::plan_16_4_4_8) {
  // head_dim 64, and 8 (a last partial chunk of channels on the AVX-512 walk)
  for (const std::int64_t D : {64, 8}) {
    CAPTURE(D);
    const std::int64_t T = 2500, H = 2, group = 4, qh = H * group, tail = 1100;
    const lynx::kv_shape shape{T, H, D};
    const auto k = make_kv(T, H, D, 41, true), v = make_kv(T, H, D, 42, false);
    const auto tk = to_tail<bf16>(make_kv(tail, H, D, 43, true)),
               tv = to_tail<bf16>(make_kv(tail, H, D, 44, false));
    const std::int64_t n = 8;
    const auto q = make_queries(n, qh, D, 45);
    const lynx::tail_visibility vis{tail - n,
                                    1};  // the 8 queries straddle the tail's split boundary at 1024
    for (int level = 1; level <= Plan::streams; ++level) {
      const auto tensor = make_tensor<Plan>(k, v, shape, level);
      for (auto path : paths()) {
        // each query alone, on one thread
        std::vector<std::vector<float>> alone;
        for (std::int64_t i = 0; i < n; ++i)
          alone.push_back(run_attention(tensor.view(), tk, tv, tail, H, D, q.data() + i * qh * D, 1,
                                        qh, {vis.base + i, 1}, 1, path));
        for (std::int64_t kq = 2; kq <= n; ++kq)
          for (int threads : {1, 2, 3, 7}) {
            // queries [n - kq, n) together
            const std::int64_t first = n - kq;
            const auto together =
                run_attention(tensor.view(), tk, tv, tail, H, D, q.data() + first * qh * D, kq, qh,
                              {vis.base + first, 1}, threads, path);
            for (std::int64_t i = 0; i < kq; ++i) {
              INFO("level " << level << " k=" << kq << " threads=" << threads << " query "
                            << first + i);
              CHECK(same_bits(alone[static_cast<std::size_t>(first + i)],
                              together.data() + i * qh * D, static_cast<std::size_t>(qh * D)));
            }
          }
      }
    }
  }
}

namespace {

// A complete layer merged into codes: the codes are merge()'s (padding tokens 0),
// and attention over them gives the bits of attention over all planes, on every
// path, batch and thread count.
template <class Plan, int G = 32>
void codes_case(std::int64_t tokens, std::int64_t kv_heads, std::int64_t group, std::int64_t D,
                std::int64_t tail_tokens, std::int64_t n) {
  CAPTURE(Plan::name());
  CAPTURE(G);
  CAPTURE(tokens);
  CAPTURE(D);
  CAPTURE(group);
  const lynx::kv_shape shape{tokens, kv_heads, D};
  const auto k = make_kv(tokens, kv_heads, D, 61, true),
             v = make_kv(tokens, kv_heads, D, 62, false);
  const auto tk = to_tail<bf16>(make_kv(tail_tokens, kv_heads, D, 63, true)),
             tv = to_tail<bf16>(make_kv(tail_tokens, kv_heads, D, 64, false));
  const std::int64_t qh = kv_heads * group;
  const auto q = make_queries(n, qh, D, 65);
  const lynx::tail_visibility vis{tail_tokens - n, 1};
  const auto tensor = make_tensor<Plan, G>(k, v, shape, Plan::streams);
  for (int threads : {1, 2}) {
    const lynx::code_tensor<Plan, G> codes(tensor, threads);
    const auto cv = codes.view();
    const auto merged = lynx::merge(tensor);
    const std::int64_t blocks = (tokens + 31) / 32;
    bool keys_same = true, values_same = true;
    for (std::int64_t h = 0; h < kv_heads; ++h)
      for (std::int64_t t = 0; t < blocks * 32; ++t)
        for (std::int64_t c = 0; c < D; ++c) {
          const std::size_t i = static_cast<std::size_t>((h * tokens + t) * D + c);
          const unsigned want_k = t < tokens ? merged.key_codes[i] : 0u,
                         want_v = t < tokens ? merged.value_codes[i] : 0u;
          keys_same &= cv.key_block(h, t / 32)[c * 32 + t % 32] == want_k;
          values_same &= cv.value_row(h, t)[c] == want_v;
        }
    CHECK(keys_same);
    CHECK(values_same);
    bool params_same = true;  // the code view's bf16 parameters are merge's floats
    for (std::size_t i = 0; i < merged.key_scale.size(); ++i)
      params_same &= std::bit_cast<std::uint32_t>(static_cast<float>(cv.key_scale()[i])) ==
                     std::bit_cast<std::uint32_t>(merged.key_scale[i]);
    for (std::size_t i = 0; i < merged.value_zero.size(); ++i)
      params_same &= std::bit_cast<std::uint32_t>(static_cast<float>(cv.value_zero()[i])) ==
                     std::bit_cast<std::uint32_t>(merged.value_zero[i]);
    CHECK(params_same);
    for (auto path : paths()) {
      CAPTURE(static_cast<int>(path));
      std::vector<float> lse_planes, lse_codes;
      const auto want = run_attention(tensor.view(), tk, tv, tail_tokens, kv_heads, D, q.data(), n,
                                      qh, vis, 1, path, &lse_planes);
      const auto got = run_attention(cv, tk, tv, tail_tokens, kv_heads, D, q.data(), n, qh, vis,
                                     threads, path, &lse_codes);
      CHECK(same_bits(want, got.data(), want.size()));
      CHECK(same_bits(lse_planes, lse_codes.data(), lse_planes.size()));
      // one query alone: the same bits as among the others
      const auto alone =
          run_attention(cv, tk, tv, tail_tokens, kv_heads, D, q.data() + (n - 1) * qh * D, 1, qh,
                        {vis.base + n - 1, 1}, 1, path);
      CHECK(same_bits(alone, got.data() + (n - 1) * qh * D, alone.size()));
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("a complete layer merged into codes: the bits of attention over all its planes",
                   Plan, lynx::plan_8_4_4, lynx::plan_8_2_2_4, lynx::plan_16_4_12,
                   lynx::plan_16_4_4_8) {
  codes_case<Plan>(37, 2, 4, 64, 5, 3);
  codes_case<Plan>(2100, 1, 8, 128, 1030, 3);  // three prompt splits, tail over a split boundary
  codes_case<Plan>(1, 3, 1, 8, 4, 4);          // head_dim 8: the portable value loop
  codes_case<Plan>(65, 1, 4, 256, 1, 1);
  codes_case<Plan>(45, 2, 2, 24, 3, 2);    // head_dim not a multiple of 16
  codes_case<Plan>(140, 1, 3, 64, 2, 2);   // 3 heads per kv head: passes of 2 heads and 1
  codes_case<Plan>(131, 1, 12, 64, 2, 2);  // 12 heads: score passes of 8 and 4
  // Group sizes lynx::kernels does not ship (64, 16, 8) are compiled in this file,
  // each (plan, G) at the cost of a whole attention build, so they run on the two
  // plans accuracy_case already builds at G = 64: plan_8_4_4 (8-bit codes) and
  // plan_16_4_12 (16-bit codes). The group size enters merge(), the code tensor
  // and the code walk only as the geometry's key_group / value_group, read at run
  // time; the plan enters them only through its code width and stream count, which
  // the G = 32 cases above cover for every plan. So plan_8_2_2_4 and plan_16_4_4_8
  // at G = 64 / 16 / 8 ran this same code again with other streams: left out.
  // G = 64 (a value group spans several channel passes): both code widths.
  if constexpr (std::is_same_v<Plan, lynx::plan_8_4_4> ||
                std::is_same_v<Plan, lynx::plan_16_4_12>) {
    codes_case<Plan, 64>(300, 2, 5, 48, 2, 2);    // 5 heads: 4 + 1; 48 channels: passes of 32, 16
    codes_case<Plan, 64>(1100, 2, 4, 128, 3, 2);  // a value group spans a pass of 32 channels
    codes_case<Plan, 64>(300, 1, 2, 192, 2, 2);
  }
  // Key groups of 16 tokens (the AVX-512 walks refuse them: the portable scores)
  // on 16-bit codes; tests/attention/test_attention_golden.cpp pins G = 16 on
  // 8-bit codes (plan_8_2_2_4), on every path.
  if constexpr (std::is_same_v<Plan, lynx::plan_16_4_12>) codes_case<Plan, 16>(200, 1, 4, 64, 2, 2);
  // Value groups of 8 channels (the portable values) on 8-bit codes; the value
  // loop over 8-channel groups reads the codes as floats, whatever their width.
  if constexpr (std::is_same_v<Plan, lynx::plan_8_4_4>) codes_case<Plan, 8>(100, 1, 4, 64, 2, 2);
}

TEST_CASE("a code_tensor kept per layer slot: each assign gives the codes of a fresh one") {
  using plan = lynx::plan_16_4_12;
  const lynx::kv_shape big{1100, 2, 64}, small{37, 3, 16};
  const auto t_big = make_tensor<plan>(make_kv(1100, 2, 64, 81, true),
                                       make_kv(1100, 2, 64, 82, false), big, plan::streams);
  const auto t_small = make_tensor<plan>(make_kv(37, 3, 16, 83, true),
                                         make_kv(37, 3, 16, 84, false), small, plan::streams);
  auto same_codes = [](const lynx::code_tensor<plan>& a, const lynx::code_tensor<plan>& b) {
    const auto va = a.view(), vb = b.view();
    const lynx::layer_geometry& g = va.geometry;
    const std::size_t codes = static_cast<std::size_t>(g.kv_heads * g.blocks() * 32 * g.head_dim);
    return va.geometry == vb.geometry && va.layer == vb.layer &&
           std::memcmp(va.params, vb.params, static_cast<std::size_t>(g.wire_params_bytes())) ==
               0 &&
           std::memcmp(va.key_codes, vb.key_codes, codes * 2) == 0 &&
           std::memcmp(va.value_codes, vb.value_codes, codes * 2) == 0;
  };
  lynx::code_tensor<plan> slot(t_big);
  const std::size_t held = slot.bytes();
  slot.assign(t_small, 2);  // smaller: the buffers are kept
  CHECK(slot.bytes() == held);
  CHECK(same_codes(slot, lynx::code_tensor<plan>(t_small)));
  slot.assign(t_big);
  CHECK(same_codes(slot, lynx::code_tensor<plan>(t_big)));
  // an incomplete layer leaves the slot as it was
  const auto partial =
      make_tensor<plan>(make_kv(37, 3, 16, 83, true), make_kv(37, 3, 16, 84, false), small, 1);
  CHECK_THROWS_AS(slot.assign(partial), lynx::error);
  CHECK(same_codes(slot, lynx::code_tensor<plan>(t_big)));
}

TEST_CASE("codes are made from a complete layer only") {
  const lynx::kv_shape shape{40, 1, 16};
  const auto k = make_kv(40, 1, 16, 71, true), v = make_kv(40, 1, 16, 72, false);
  const auto tensor = make_tensor<lynx::plan_16_4_4_8>(k, v, shape, 2);
  try {
    const lynx::code_tensor<lynx::plan_16_4_4_8> codes(tensor);
    FAIL("an incomplete layer was merged");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::invalid_argument);
    CHECK(std::string(e.what()).find("layer 0 has 2 of 3 streams") != std::string::npos);
  }
}

TEST_CASE("dense bf16 prompt: same bits on every path, layout, batch and thread count") {
  // A token-major bf16 prompt on the AVX-512 path is walked several kv heads per
  // work item; a head-major copy of the same cache, one kv head per item. Both,
  // and the portable walk, must give the same bits, alone or among k queries.
  for (const std::int64_t group : {4, 8, 2, 1, 3}) {
    for (const std::int64_t D : {128, 64}) {
      CAPTURE(group);
      CAPTURE(D);
      const std::int64_t T = 2100, H = 8, qh = H * group, tail = 40, n = 3;
      const lynx::kv_shape shape{T, H, D};
      const auto kb = to_tail<bf16>(make_kv(T, H, D, 61, true)),
                 vb = to_tail<bf16>(make_kv(T, H, D, 62, false));
      std::vector<bf16> kh(kb.size()), vh(vb.size());  // head-major copies
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t g = 0; g < H; ++g)
          for (std::int64_t c = 0; c < D; ++c) {
            kh[static_cast<std::size_t>((g * T + t) * D + c)] =
                kb[static_cast<std::size_t>((t * H + g) * D + c)];
            vh[static_cast<std::size_t>((g * T + t) * D + c)] =
                vb[static_cast<std::size_t>((t * H + g) * D + c)];
          }
      const lynx::dense_prompt<bf16> tm{lynx::token_major<const bf16>(kb.data(), shape),
                                        lynx::token_major<const bf16>(vb.data(), shape)};
      const lynx::dense_prompt<bf16> hm{lynx::head_major<const bf16>(kh.data(), shape),
                                        lynx::head_major<const bf16>(vh.data(), shape)};
      const auto tk = to_tail<bf16>(make_kv(tail, H, D, 63, true)),
                 tv = to_tail<bf16>(make_kv(tail, H, D, 64, false));
      const auto q = make_queries(n, qh, D, 65);
      const lynx::tail_visibility vis{tail - n, 1};
      std::vector<float> kf(kb.size()), vf(vb.size());
      for (std::size_t i = 0; i < kb.size(); ++i)
        kf[i] = static_cast<float>(kb[i]), vf[i] = static_cast<float>(vb[i]);
      const auto ref = reference(kf, vf, T, tk, tv, H, D, q, n, qh, vis,
                                 1.0 / std::sqrt(static_cast<double>(D)));
      const auto first = run_attention(tm, tk, tv, tail, H, D, q.data(), n, qh, vis, 1,
                                       lynx::attention_path::portable);
      check_close(first, ref, D, "bf16 prompt, portable");
      for (auto path : paths())
        for (int threads : {1, 2, 3, 7}) {
          INFO("path " << static_cast<int>(path) << " threads " << threads);
          const auto a = run_attention(tm, tk, tv, tail, H, D, q.data(), n, qh, vis, threads, path);
          const auto b = run_attention(hm, tk, tv, tail, H, D, q.data(), n, qh, vis, threads, path);
          CHECK(same_bits(first, a.data(), a.size()));
          CHECK(same_bits(first, b.data(), b.size()));
          for (std::int64_t i = 0; i < n; ++i) {  // each query alone
            const auto one = run_attention(tm, tk, tv, tail, H, D, q.data() + i * qh * D, 1, qh,
                                           {vis.base + i, 1}, threads, path);
            CHECK(same_bits(one, first.data() + i * qh * D, one.size()));
          }
        }
    }
  }
}

TEST_CASE("bad shapes are rejected with clear errors") {
  const std::int64_t T = 40, H = 2, D = 16;
  const lynx::kv_shape shape{T, H, D};
  const auto k = make_kv(T, H, D, 51, true), v = make_kv(T, H, D, 52, false);
  const auto tensor = make_tensor<lynx::plan_8_4_4>(k, v, shape, 1);
  const auto tk = make_kv(4, H, D, 53, true), tv = make_kv(4, H, D, 54, false);
  const auto q = make_queries(2, 8, 32, 55);
  auto call = [&](auto prompt, std::int64_t qh, std::int64_t d, lynx::tail_visibility vis) {
    (void)run_attention(prompt, tk, tv, 4, H, D, q.data(), 2, qh, vis, 1,
                        lynx::attention_path::automatic);
    (void)d;
  };
  auto expect = [](auto&& f, lynx::errc code, const char* fragment) {
    try {
      f();
      FAIL("no error thrown");
    } catch (const lynx::error& e) {
      CHECK(e.code() == code);
      INFO(e.what());
      CHECK(std::string(e.what()).find(fragment) != std::string::npos);
    }
  };
  expect(
      [&] {
        call(tensor.view(), 3, D, {0, 1});
      },
      lynx::errc::shape_mismatch, "q_heads 3 is not a multiple of kv_heads 2");
  expect(
      [&] {
        call(tensor.view(), 4, D, {3, 1});
      },
      lynx::errc::shape_mismatch, "the tail holds 4");
  expect(
      [&] {
        call(tensor.view().at_level(1), 4, D, {-2, 1});
      },
      lynx::errc::shape_mismatch, "at least -1");
  lynx::bitplane_tensor<lynx::plan_8_4_4> empty(shape, 7);
  expect([&] { call(empty.view(), 4, D, {0, 1}); }, lynx::errc::invalid_argument, "no anchor yet");
  // head_dim mismatch: queries of head_dim 32 against a prompt of head_dim 16
  expect(
      [&] {
        const lynx::kv_shape ts{4, H, D};
        const lynx::attention_queries qq{q.data(), 2, 4, 32};
        lynx::decode_attention<> attn;
        lynx::attention_workspace ws;
        std::vector<float> out(2 * 4 * 32);
        attn(tensor.view(), lynx::token_major<const float>(tk.data(), ts),
             lynx::token_major<const float>(tv.data(), ts), qq, {0, 1}, {out.data()}, ws);
      },
      lynx::errc::shape_mismatch, "queries have head_dim 32 but the prompt has head_dim 16");
  // a workspace that is too small is an error, not an allocation
  expect(
      [&] {
        const lynx::kv_shape ts{4, H, D};
        const lynx::attention_queries qq{q.data(), 2, 4, D};
        lynx::decode_attention<> attn;
        lynx::attention_workspace ws;
        std::vector<float> out(2 * 4 * D);
        attn(tensor.view(), lynx::token_major<const float>(tk.data(), ts),
             lynx::token_major<const float>(tv.data(), ts), qq, {0, 1}, {out.data()}, ws);
      },
      lynx::errc::invalid_argument, "workspace of 0 bytes");
  // a SIMD path the CPU lacks is an error; one it has gives the portable bits
  const auto portable = run_attention(tensor.view(), tk, tv, 4, H, D, q.data(), 2, 4, {2, 1}, 1,
                                      lynx::attention_path::portable);
  auto path_check = [&](lynx::attention_path path, bool has, const char* fragment) {
    if (has) {
      const auto out =
          run_attention(tensor.view(), tk, tv, 4, H, D, q.data(), 2, 4, {2, 1}, 1, path);
      CHECK(same_bits(portable, out.data(), out.size()));
    } else {
      expect(
          [&] {
            (void)run_attention(tensor.view(), tk, tv, 4, H, D, q.data(), 2, 4, {2, 1}, 1, path);
          },
          lynx::errc::invalid_argument, fragment);
    }
  };
  path_check(lynx::attention_path::avx2, lynx::detail::host_has_fma(),
             "AVX2 path requested on a CPU without AVX2 and FMA");
  path_check(lynx::attention_path::avx512, lynx::detail::host_has_avx512(),
             "AVX-512 path requested on a CPU without AVX-512F/BW");
}

TEST_CASE("non-finite input: the error names the query, tail or dense prompt element") {
  const std::int64_t T = 70, H = 2, D = 32, group = 4, qh = H * group, n = 3, TT = 40;
  const lynx::kv_shape shape{T, H, D};
  const auto k = make_kv(T, H, D, 61, true), v = make_kv(T, H, D, 62, false);
  const auto tensor = make_tensor<lynx::plan_8_4_4>(k, v, shape, 1);
  const auto kb = to_tail<bf16>(k), vb = to_tail<bf16>(v);
  const lynx::tail_visibility causal{TT - n - 1, 1};  // query i sees tail tokens [0, 37 + i)
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  auto expect = [](auto&& f, lynx::errc code, const std::string& fragment) {
    try {
      f();
      FAIL("no error thrown");
    } catch (const lynx::error& e) {
      INFO(e.what());
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find(fragment) != std::string::npos);
    }
  };
  for (auto path : paths()) {
    INFO("path " << static_cast<int>(path));
    auto q = make_queries(n, qh, D, 63);
    auto tk = make_kv(TT, H, D, 64, true), tv = make_kv(TT, H, D, 65, false);
    auto call = [&] {
      return run_attention(tensor.view(), tk, tv, TT, H, D, q.data(), n, qh, causal, 2, path);
    };
    auto all_finite = [](const std::vector<float>& x) {
      return std::all_of(x.begin(), x.end(), [](float y) { return lynx::is_finite_value(y); });
    };
    REQUIRE(all_finite(call()));  // the clean call
    q[static_cast<std::size_t>((1 * qh + 5) * D + 7)] = nan;
    expect(call, lynx::errc::non_finite_input, "query 1, head 5 holds NaN at channel 7");
    q = make_queries(n, qh, D, 63);
    tk[static_cast<std::size_t>((12 * H + 1) * D + 3)] = -inf;  // token 12, kv head 1
    expect(call, lynx::errc::non_finite_input,
           "tail keys hold infinity at kv head 1, token 12, channel 3");
    tk = make_kv(TT, H, D, 64, true);
    tv[static_cast<std::size_t>((20 * H + 0) * D + 31)] = nan;
    expect(call, lynx::errc::non_finite_input,
           "tail values hold NaN at kv head 0, token 20, channel 31");
    // a tail token no query sees (the last one: the queries see 37, 38, 39 tokens)
    tv = make_kv(TT, H, D, 65, false);
    tv[static_cast<std::size_t>((39 * H + 0) * D)] = nan;
    CHECK(all_finite(call()));
    tv = make_kv(TT, H, D, 65, false);
    // dense bf16 prompt (engine-owned, never validated up front)
    auto kbad = kb;
    kbad[static_cast<std::size_t>((33 * H + 1) * D + 9)] = lynx::from_float<bf16>(nan);
    const lynx::dense_prompt<bf16> dp{lynx::token_major<const bf16>(kbad.data(), shape),
                                      lynx::token_major<const bf16>(vb.data(), shape)};
    const auto tkb = to_tail<bf16>(tk), tvb = to_tail<bf16>(tv);
    expect([&] { (void)run_attention(dp, tkb, tvb, TT, H, D, q.data(), n, qh, causal, 1, path); },
           lynx::errc::non_finite_input, "prompt keys hold NaN at kv head 1, token 33, channel 9");
    // finite everywhere, but q . k overflows float
    std::vector<float> big(q.size(), 3e38f);
    expect(
        [&] {
          (void)run_attention(tensor.view(), tk, tv, TT, H, D, big.data(), n, qh, causal, 1, path);
        },
        lynx::errc::invalid_argument, "a logit overflowed float");
  }
}
