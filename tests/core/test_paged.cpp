// Paged K/V read in place through a block table (lynx::paged_token_major,
// lynx::paged_head_major): encode from a paged pool writes the bytes of encode
// from the contiguous cache (float and bf16, every codec path, blocks of 16, 32
// and 7 tokens, a last block partly used); reconstruct into a paged pool writes
// each row where the table says and nothing else; decode attention over a paged
// tail and a paged dense prompt gives the bits of the contiguous call on every
// host path. The pool's unused blocks hold NaN, so a row read from a wrong block
// shows as an error or a NaN. Bad tables are refused with what was wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../support/attention_paths.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/codec.hpp"

namespace {

using plan = lynx::plan_8_4_4;
const float nan_value = std::numeric_limits<float>::quiet_NaN();

enum class layout { token_major, head_major };

/// A paged copy of a token-major [tokens][heads][dim] cache: blocks in a shuffled
/// order inside a pool with spare blocks, every element outside the cache NaN.
template <class T>
struct paged_copy {
  std::vector<T> pool;
  std::vector<std::int32_t> table;
  lynx::kv_shape shape;
  std::int64_t block_tokens;
  layout order;

  paged_copy(const std::vector<T>& dense, lynx::kv_shape s, std::int64_t bs, layout o,
             unsigned seed)
      : shape(s), block_tokens(bs), order(o) {
    const std::int64_t used = (s.tokens + bs - 1) / bs, blocks = used + 3;
    pool.assign(static_cast<std::size_t>(blocks * bs * s.kv_heads * s.head_dim),
                static_cast<T>(nan_value));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
    table.assign(ids.begin(), ids.begin() + used);
    const auto v = view();
    for (std::int64_t t = 0; t < s.tokens; ++t)
      for (std::int64_t h = 0; h < s.kv_heads; ++h)
        for (std::int64_t c = 0; c < s.head_dim; ++c)
          v(t, h, c) = dense[static_cast<std::size_t>((t * s.kv_heads + h) * s.head_dim + c)];
  }
  [[nodiscard]] lynx::kv_view<T, lynx::host_space> view() {
    return order == layout::token_major
               ? lynx::paged_token_major<T>(pool.data(), shape, table.data(), block_tokens)
               : lynx::paged_head_major<T>(pool.data(), shape, table.data(), block_tokens);
  }
};

template <class T>
std::vector<T> some_values(lynx::kv_shape s, unsigned salt) {
  std::vector<T> x(static_cast<std::size_t>(s.elements()));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<T>(
        static_cast<float>(static_cast<int>((i + salt) * 2654435761u % 2001u) - 1000) /
        (300.0f + static_cast<float>(salt)));
  return x;
}

template <class T>
std::vector<std::byte> encoded_bytes(lynx::kv_view<const T, lynx::host_space> k,
                                     lynx::kv_view<const T, lynx::host_space> v) {
  const auto e = lynx::encode<plan, 32, T>(k, v, 2, {.generation = 4});
  std::vector<std::byte> b;
  for (int s = 0; s < plan::streams; ++s)
    b.insert(b.end(), e.segment(s).begin(), e.segment(s).end());
  return b;
}

struct limit_guard {
  ~limit_guard() { lynx::detail::codec_kernels_limit = lynx::detail::codec_kernels::best; }
};

}  // namespace

TEST_CASE_TEMPLATE("encode from a paged pool: the bytes of the contiguous cache", T, float,
                   lynx::bf16) {
  limit_guard guard;
  const lynx::kv_shape shape{300, 2, 128};  // the last block partly used for every block size
  const auto k = some_values<T>(shape, 1), v = some_values<T>(shape, 7);
  const auto want = encoded_bytes<T>(lynx::token_major<const T>(k.data(), shape),
                                     lynx::token_major<const T>(v.data(), shape));
  for (const std::int64_t bs : {16, 32, 7}) {
    for (const layout o : {layout::token_major, layout::head_major}) {
      CAPTURE(bs);
      CAPTURE(static_cast<int>(o));
      paged_copy<T> pk(k, shape, bs, o, 11), pv(v, shape, bs, o, 12);
      for (const auto limit :
           {lynx::detail::codec_kernels::best, lynx::detail::codec_kernels::avx512_without_bf16,
            lynx::detail::codec_kernels::portable}) {
        CAPTURE(static_cast<int>(limit));
        lynx::detail::codec_kernels_limit = limit;
        CHECK(encoded_bytes<T>(pk.view(), pv.view()) == want);
      }
      lynx::detail::codec_kernels_limit = lynx::detail::codec_kernels::best;
    }
  }
}

TEST_CASE("reconstruct into a paged pool: every row where the table says, nothing else") {
  limit_guard guard;
  const lynx::kv_shape shape{300, 2, 128};
  const auto k = some_values<float>(shape, 3), v = some_values<float>(shape, 5);
  const auto e = lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                               lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<plan> t(shape, 0);
  t.accept(e.segment(0));  // the anchor: reconstruct at level 1
  std::vector<float> rk(k.size()), rv(v.size());
  lynx::reconstruct(t, lynx::token_major<float>(rk.data(), shape),
                    lynx::token_major<float>(rv.data(), shape));
  for (const std::int64_t bs : {16, 32}) {
    for (const layout o : {layout::token_major, layout::head_major}) {
      for (const auto limit :
           {lynx::detail::codec_kernels::best, lynx::detail::codec_kernels::portable}) {
        CAPTURE(bs);
        CAPTURE(static_cast<int>(o));
        CAPTURE(static_cast<int>(limit));
        lynx::detail::codec_kernels_limit = limit;
        // pools of NaN with the same table as a paged copy would have
        std::vector<float> blank(k.size(), nan_value);
        paged_copy<float> pk(blank, shape, bs, o, 21), pv(blank, shape, bs, o, 22);
        lynx::reconstruct(t, pk.view(), pv.view());
        std::vector<float> gk(k.size()), gv(v.size());
        std::size_t written = 0;
        for (std::int64_t tok = 0; tok < shape.tokens; ++tok)
          for (std::int64_t h = 0; h < shape.kv_heads; ++h)
            for (std::int64_t c = 0; c < shape.head_dim; ++c) {
              const auto i = static_cast<std::size_t>((tok * shape.kv_heads + h) * 128 + c);
              gk[i] = pk.view()(tok, h, c);
              gv[i] = pv.view()(tok, h, c);
            }
        CHECK(std::memcmp(gk.data(), rk.data(), rk.size() * 4) == 0);
        CHECK(std::memcmp(gv.data(), rv.data(), rv.size() * 4) == 0);
        for (const float x : pk.pool) written += !std::isnan(x);
        CHECK(written == k.size());  // every other element of the pool still NaN
      }
    }
  }
}

TEST_CASE("attention over a paged tail and a paged dense prompt: the contiguous call's bits") {
  const lynx::kv_shape prompt_shape{1100, 2, 64}, tail_shape{45, 2, 64};
  constexpr int q_heads = 4, n = 3;
  const auto pk = some_values<float>(prompt_shape, 2), pv = some_values<float>(prompt_shape, 9);
  const auto tk = some_values<float>(tail_shape, 4), tv = some_values<float>(tail_shape, 6);
  std::vector<lynx::bf16> pkb(pk.size()), pvb(pv.size()), tkb(tk.size()), tvb(tv.size());
  for (std::size_t i = 0; i < pk.size(); ++i) {
    pkb[i] = lynx::bf16(pk[i]);
    pvb[i] = lynx::bf16(pv[i]);
  }
  for (std::size_t i = 0; i < tk.size(); ++i) {
    tkb[i] = lynx::bf16(tk[i]);
    tvb[i] = lynx::bf16(tv[i]);
  }
  const auto e =
      lynx::encode<plan, 32, float>(lynx::token_major<const float>(pk.data(), prompt_shape),
                                    lynx::token_major<const float>(pv.data(), prompt_shape), 0);
  lynx::bitplane_tensor<plan> planes(prompt_shape, 0);
  planes.accept(e.segment(0));
  std::vector<float> q(static_cast<std::size_t>(n * q_heads * 64));
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>(static_cast<int>(i * 7919u % 613u) - 306) / 97.0f;
  const lynx::attention_queries queries{q.data(), n, q_heads, 64};
  const lynx::tail_visibility vis{tail_shape.tokens - n, 1};
  auto call = [&](const auto& prompt, auto keys, auto values, lynx::attention_path path) {
    std::vector<float> out(q.size() + n * q_heads);
    lynx::decode_attention<> attention{};
    lynx::attention_workspace ws(attention.problem(prompt, keys, queries, vis), 2);
    attention(prompt, keys, values, queries, vis, {out.data(), out.data() + q.size()}, ws,
              {.threads = 2, .path = path});
    return out;
  };
  auto contiguous = [](const auto& x, lynx::kv_shape s) {
    using E = std::remove_cvref_t<decltype(x[0])>;
    return lynx::token_major<const E>(x.data(), s);
  };
  for (const std::int64_t bs : {16, 32}) {
    for (const layout o : {layout::token_major, layout::head_major}) {
      CAPTURE(bs);
      CAPTURE(static_cast<int>(o));
      paged_copy<float> ptk(tk, tail_shape, bs, o, 31), ptv(tv, tail_shape, bs, o, 32);
      paged_copy<lynx::bf16> ptkb(tkb, tail_shape, bs, o, 33), ptvb(tvb, tail_shape, bs, o, 34);
      paged_copy<float> ppk(pk, prompt_shape, bs, o, 35), ppv(pv, prompt_shape, bs, o, 36);
      paged_copy<lynx::bf16> ppkb(pkb, prompt_shape, bs, o, 37), ppvb(pvb, prompt_shape, bs, o, 38);
      using cf = lynx::kv_view<const float, lynx::host_space>;
      using cb = lynx::kv_view<const lynx::bf16, lynx::host_space>;
      for (const auto path : lynx::test::host_attention_paths()) {
        CAPTURE(lynx::test::attention_path_name(path));
        // a bit-plane prompt with a paged tail, float and bf16
        CHECK(call(planes.view(), cf(ptk.view()), cf(ptv.view()), path) ==
              call(planes.view(), contiguous(tk, tail_shape), contiguous(tv, tail_shape), path));
        CHECK(call(planes.view(), cb(ptkb.view()), cb(ptvb.view()), path) ==
              call(planes.view(), contiguous(tkb, tail_shape), contiguous(tvb, tail_shape), path));
        // paged dense prompts (the 16-bit baselines), paged tail
        const lynx::dense_prompt<float> dense_f{cf(ppk.view()), cf(ppv.view())};
        const lynx::dense_prompt<float> dense_f0{contiguous(pk, prompt_shape),
                                                 contiguous(pv, prompt_shape)};
        CHECK(call(dense_f, cf(ptk.view()), cf(ptv.view()), path) ==
              call(dense_f0, contiguous(tk, tail_shape), contiguous(tv, tail_shape), path));
        const lynx::dense_prompt<lynx::bf16> dense_b{cb(ppkb.view()), cb(ppvb.view())};
        const lynx::dense_prompt<lynx::bf16> dense_b0{contiguous(pkb, prompt_shape),
                                                      contiguous(pvb, prompt_shape)};
        CHECK(call(dense_b, cb(ptkb.view()), cb(ptvb.view()), path) ==
              call(dense_b0, contiguous(tkb, tail_shape), contiguous(tvb, tail_shape), path));
      }
    }
  }
}

TEST_CASE("bad block tables are refused, saying what was wrong") {
  const lynx::kv_shape shape{40, 1, 32};
  std::vector<float> pool(static_cast<std::size_t>(4 * 16 * 32));
  std::vector<std::int32_t> table{2, -1, 0};
  CHECK_THROWS_AS(lynx::paged_token_major<float>(pool.data(), shape, table.data(), 0), lynx::error);
  CHECK_THROWS_AS(lynx::paged_token_major<float>(pool.data(), shape, nullptr, 16), lynx::error);
  const auto view = lynx::paged_token_major<const float>(pool.data(), shape, table.data(), 16);
  try {
    (void)lynx::encode<plan, 32, float>(view, view, 0);
    FAIL("a block table with -1 was taken");
  } catch (const lynx::error& err) {
    CHECK(err.code() == lynx::errc::invalid_argument);
    CHECK(std::string(err.what()).find("block table entry 1 is -1") != std::string::npos);
  }
  auto zero_blocks = view;
  zero_blocks.block_tokens = 0;
  auto encode_zero = [&] { (void)lynx::encode<plan, 32, float>(zero_blocks, zero_blocks, 0); };
  CHECK_THROWS_AS(encode_zero(), lynx::error);
}
