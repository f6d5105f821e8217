// Value groups apart from key groups: keys group G = 32 tokens per channel
// while values group any divisor of head_dim channels per token
// (encode_options::value_group, the receiver tensor's value_group), so
// head_dim 80 and 112 run at G = 32. For each shape: every codec path (AVX-512
// with and without BF16, portable) writes the same bytes as the scalar
// reference (quantize + split) and the header carries the value group; a
// receiver of another value group refuses the segments; each value's
// parameters are those of its own group of channels; every host attention path
// gives the same bits at every level, within the fp64 reference's bound over
// the reconstructed K/V (the AVX-512 walk takes any head_dim and value group
// at G = 32; its GFNI value kernels any value group of a multiple of 16).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../support/attention_paths.hpp"
#include "../support/attention_reference.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"

namespace {

using plan = lynx::plan_8_4_4;
using tensor = lynx::bitplane_tensor<plan, 32, lynx::host_space>;

struct layer_data {
  lynx::kv_shape shape;
  std::vector<float> k, v;
  explicit layer_data(lynx::kv_shape s)
      : shape(s), k(static_cast<std::size_t>(s.tokens * s.kv_heads * s.head_dim)) {
    v.resize(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f;
      // values whose scale differs by channel group, so a wrong group shows
      const auto c = static_cast<std::int64_t>(i) % s.head_dim;
      v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f *
             static_cast<float>(1 + c / 16);
    }
  }
  [[nodiscard]] lynx::kv_view<const float, lynx::host_space> keys() const {
    return lynx::token_major<const float>(k.data(), shape);
  }
  [[nodiscard]] lynx::kv_view<const float, lynx::host_space> values() const {
    return lynx::token_major<const float>(v.data(), shape);
  }
};

std::vector<std::byte> bytes_of(const lynx::encoded_layer<plan>& l) {
  std::vector<std::byte> b;
  for (int s = 0; s < plan::streams; ++s)
    b.insert(b.end(), l.segment(s).begin(), l.segment(s).end());
  return b;
}

struct limit_guard {
  ~limit_guard() { lynx::detail::codec_kernels_limit = lynx::detail::codec_kernels::best; }
};

}  // namespace

TEST_CASE("value groups apart from key groups: every codec path writes the reference's bytes") {
  limit_guard guard;
  for (const auto& [head_dim, value_group] :
       {std::pair{80, 16}, {112, 16}, {128, 16}, {128, 64}, {80, 40}, {96, 8}, {64, 64}}) {
    CAPTURE(head_dim);
    CAPTURE(value_group);
    const layer_data d({300, 2, head_dim});
    const lynx::encode_options o{.generation = 9, .value_group = value_group};
    const auto reference = lynx::split<plan, 32>(
        lynx::quantize<plan, 32, float>(d.keys(), d.values(), 3, value_group), 3, 9);
    CHECK(reference.geometry().value_group == value_group);
    CHECK(reference.geometry().key_group == 32);
    CHECK(reference.geometry().value_channel_groups() == head_dim / value_group);
    for (const auto limit :
         {lynx::detail::codec_kernels::best, lynx::detail::codec_kernels::avx512_without_bf16,
          lynx::detail::codec_kernels::portable}) {
      lynx::detail::codec_kernels_limit = limit;
      CAPTURE(static_cast<int>(limit));
      const auto encoded = lynx::encode<plan, 32, float>(d.keys(), d.values(), 3, o);
      CHECK(bytes_of(encoded) == bytes_of(reference));
      CHECK(lynx::peek_header(encoded.segment(0)).value_group == value_group);
    }
    lynx::detail::codec_kernels_limit = lynx::detail::codec_kernels::best;
    const auto encoded = lynx::encode<plan, 32, float>(d.keys(), d.values(), 3, o);
    // The receiver must be told the same value group: any other geometry is refused.
    tensor other(d.shape, 3, 9, value_group == 16 ? 8 : 16);
    CHECK_THROWS_AS(other.accept(encoded.segment(0)), lynx::error);
    CHECK(other.precision_level() == 0);
    tensor t(d.shape, 3, 9, value_group);
    for (int s = 0; s < plan::streams; ++s) t.accept(encoded.segment(s));
    CHECK(t.precision_level() == plan::streams);
    // Each value's parameters are its own group's: reconstruct at full precision
    // is within half a step of that group's scale.
    const auto q = lynx::quantize<plan, 32, float>(d.keys(), d.values(), 3, value_group);
    std::vector<float> rk(d.k.size()), rv(d.v.size());
    lynx::reconstruct(t, lynx::token_major<float>(rk.data(), d.shape),
                      lynx::token_major<float>(rv.data(), d.shape));
    const std::int64_t groups = head_dim / value_group;
    for (std::int64_t h = 0; h < d.shape.kv_heads; ++h)
      for (std::int64_t tok = 0; tok < d.shape.tokens; ++tok)
        for (std::int64_t c = 0; c < head_dim; ++c) {
          const auto i = static_cast<std::size_t>((tok * d.shape.kv_heads + h) * head_dim + c);
          const float scale = q.value_scale[static_cast<std::size_t>(
              (h * d.shape.tokens + tok) * groups + c / value_group)];
          if (!(std::abs(rv[i] - d.v[i]) <= 0.5f * scale * 1.0001f)) {
            FAIL_CHECK("value (head " << h << ", token " << tok << ", channel " << c << ") "
                                      << rv[i] << " vs " << d.v[i] << ", scale " << scale);
            break;
          }
        }
  }
}

TEST_CASE("a value group that does not divide head_dim is refused with what to do") {
  const layer_data d({40, 1, 80});
  try {
    (void)lynx::encode<plan, 32, float>(d.keys(), d.values(), 0);
    FAIL("head_dim 80 at the default value group (32) was taken");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::shape_mismatch);
    CHECK(std::string(e.what()).find("value_group") != std::string::npos);
  }
  CHECK_THROWS_AS(tensor(d.shape, 0, 0, 48), lynx::error);   // 80 % 48 != 0
  CHECK_THROWS_AS(tensor(d.shape, 0, 0, 96), lynx::error);   // more than head_dim
  CHECK_THROWS_AS(tensor(d.shape, 0, 0, -16), lynx::error);  // negative
}

TEST_CASE(
    "attention over head_dim 80 and 112 at G = 32, value groups of 16: every path, same bits") {
  for (const int head_dim : {80, 112}) {
    CAPTURE(head_dim);
    const lynx::kv_shape shape{1500, 2, head_dim};  // two splits of the host walk
    const layer_data d(shape);
    const auto encoded =
        lynx::encode<plan, 32, float>(d.keys(), d.values(), 0, {.value_group = 16});
    tensor t(shape, 0, 0, 16);
    constexpr int q_heads = 4, n = 3, tail_tokens = 5;
    std::vector<float> q(static_cast<std::size_t>(n * q_heads * head_dim));
    for (std::size_t i = 0; i < q.size(); ++i)
      q[i] = static_cast<float>(static_cast<int>(i * 7919u % 613u) - 306) / 197.0f;
    std::vector<float> tk(static_cast<std::size_t>(tail_tokens * shape.kv_heads * head_dim)),
        tv(tk.size());
    for (std::size_t i = 0; i < tk.size(); ++i) {
      tk[i] = static_cast<float>(static_cast<int>(i * 613u % 401u) - 200) / 150.0f;
      tv[i] = static_cast<float>(static_cast<int>(i * 97u % 331u) - 165) / 120.0f;
    }
    const lynx::kv_shape tail_shape{tail_tokens, shape.kv_heads, head_dim};
    const auto tail_k = lynx::token_major<const float>(tk.data(), tail_shape);
    const auto tail_v = lynx::token_major<const float>(tv.data(), tail_shape);
    const lynx::tail_visibility vis{tail_tokens - n, 1};  // causal: query i sees 3 + i
    for (int level = 1; level <= plan::streams; ++level) {
      CAPTURE(level);
      t.accept(encoded.segment(level - 1));
      std::vector<float> first_out, first_lse;
      for (const auto path : lynx::test::host_attention_paths()) {
        CAPTURE(lynx::test::attention_path_name(path));
        std::vector<float> out(q.size()), lse(static_cast<std::size_t>(n * q_heads));
        lynx::decode_attention<> attention{};
        const lynx::attention_queries queries{q.data(), n, q_heads, head_dim};
        lynx::attention_workspace ws(attention.problem(t.view(), tail_k, queries, vis), 2);
        attention(t.view(), tail_k, tail_v, queries, vis, {out.data(), lse.data()}, ws,
                  {.threads = 2, .path = path});
        if (first_out.empty()) {
          first_out = out;
          first_lse = lse;
          // Within the fp64 reference's bound over the K/V this level reconstructs to.
          std::vector<float> rk(d.k.size()), rv(d.v.size());
          lynx::reconstruct(t, lynx::token_major<float>(rk.data(), shape),
                            lynx::token_major<float>(rv.data(), shape));
          const auto ref = lynx::test::attention_reference(
              {static_cast<double>(lynx::attention_split_tokens), 1.0}, rk, rv, shape.tokens, tk,
              tv, shape.kv_heads, head_dim, q, n, q_heads, vis,
              1.0 / std::sqrt(static_cast<double>(head_dim)), 0, 0.0);
          for (std::int64_t i = 0; i < n * q_heads; ++i)
            for (std::int64_t c = 0; c < head_dim; ++c) {
              const auto e = static_cast<std::size_t>(i * head_dim + c);
              if (!(std::abs(out[e] - ref.out[e]) <= ref.tol[static_cast<std::size_t>(i)])) {
                FAIL_CHECK("output " << i << ", channel " << c << ": " << out[e] << " vs "
                                     << ref.out[e]);
                break;
              }
            }
        } else {
          CHECK(std::memcmp(out.data(), first_out.data(), out.size() * 4) == 0);
          CHECK(std::memcmp(lse.data(), first_lse.data(), lse.size() * 4) == 0);
        }
      }
    }
  }
}
