// Golden fingerprints of decode attention: fixed, portable inputs (the counter-based
// generator of tests/support/golden.hpp) and the XXH3-64 of the output bits, pinned
// in a table. The other attention tests compare the walks of one build with each
// other; this one compares every build with the table, so the output bits cannot
// depend on the compiler, its flags (-O0, -march=native, contraction of a * b + c)
// or a refactoring that changes every walk alike. The exactness contract needs
// that: the draft, the verification and plain decoding may run in different
// builds, on different machines.
//
// What is pinned: the attention output [n][q_heads][head_dim]. Not the log-sum-exp
// (it calls the C library's log2, whose last bit may differ between libraries) and
// no soft-cap (tanh, likewise). If a change of the math is intended, zero the
// entries it changes: the test then prints the lines to paste.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../support/attention_paths.hpp"
#include "../support/golden.hpp"
#include "lynx/attention/code_tensor.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"  // encode, and the inline XXH3

namespace {

namespace golden = lynx_tests::golden;
using lynx::bf16;

// The golden stream without its outliers (an outlier key makes a softmax of one
// token, which would leave most of the value sums out of the fingerprint).
float smooth_value(std::uint64_t seed, std::uint64_t i) {
  const float x = golden::golden_value(seed, i);
  return i % 613 == 7 ? x / 250.0f : x;
}

// Keys get a per-channel offset (outlier channels, as real K has); queries are scaled
// so that logits spread over a few units.
std::vector<float> keys_of(std::uint64_t seed, lynx::kv_shape s) {
  std::vector<float> x(static_cast<std::size_t>(s.elements()));
  const std::int64_t row = s.kv_heads * s.head_dim;
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = smooth_value(seed, i) + 2.0f * golden::golden_value(seed + 1000, i % row);
  return x;
}
std::vector<float> values_of(std::uint64_t seed, lynx::kv_shape s) {
  std::vector<float> x(static_cast<std::size_t>(s.elements()));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = smooth_value(seed, i);
  return x;
}
std::vector<float> queries_of(std::uint64_t seed, std::int64_t n, std::int64_t qh, std::int64_t D) {
  std::vector<float> q(static_cast<std::size_t>(n * qh * D));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.25f * smooth_value(seed, i);
  return q;
}
template <class T>
std::vector<T> as(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = lynx::from_float<T>(x[i]);
  return r;
}

// A layer of `shape` encoded with Plan and G, its first `level` streams accepted (last
// first when `reversed`: a tensor takes its streams in any order).
template <class Plan, int G = 32>
lynx::bitplane_tensor<Plan, G> tensor_of(const std::vector<float>& k, const std::vector<float>& v,
                                         lynx::kv_shape shape, int level, bool reversed = false) {
  const auto enc = lynx::encode<Plan, G>(lynx::token_major<const float>(k.data(), shape),
                                         lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<Plan, G> t(shape, 0);
  for (int i = 0; i < level; ++i) t.accept(enc.segment(reversed ? level - 1 - i : i));
  return t;
}

// One golden case: a prompt of `tokens`, a tail of `tail` tokens, n queries
// causal over the tail, GQA `group`.
struct shape_case {
  std::int64_t tokens, kv_heads, head_dim, group, n, tail;
};

struct golden_entry {
  const char* name;
  std::uint64_t hash;
};

// XXH3-64 of the output floats of each case. Checked on x86-64, every path, 1 and 2
// threads: GCC 12 at -O0, -O2, -O3 -march=native (also with -funroll-loops), -O2
// -march=x86-64-v3; clang 14 at -O2, -O3 -march=native, and -O3 -march=native
// -ffp-contract=fast. Plans with the same bits at a level share an entry's value
// (8 = 4 + 4 level 1 is 8 = 2 + 2 + 4 level 2: the same 4 planes).
constexpr golden_entry table[] = {
    {"8 = 4 + 4 level 1", 0xbea772090fe9fcdeull},
    {"8 = 4 + 4 level 2", 0x519344e21bd399d6ull},
    {"8 = 2 + 2 + 4 level 1", 0x074fad1d269b8763ull},
    {"8 = 2 + 2 + 4 level 2", 0xbea772090fe9fcdeull},
    {"8 = 2 + 2 + 4 level 3", 0x519344e21bd399d6ull},
    {"16 = 4 + 12 level 1", 0x0c127b0842f64b31ull},
    {"16 = 4 + 12 level 2", 0x91dfa2259775044eull},
    {"16 = 4 + 4 + 8 level 1", 0x0c127b0842f64b31ull},
    {"16 = 4 + 4 + 8 level 2", 0x791097bb79b8dfacull},
    {"16 = 4 + 4 + 8 level 3", 0x91dfa2259775044eull},
    {"Llama shape, 8 = 4 + 4 level 1, float tail", 0x7817ab942a4631aaull},
    {"Llama shape, 8 = 4 + 4 level 2, float tail", 0x9405e845adca4913ull},
    {"head_dim 8, 8 = 4 + 4 level 2", 0xbbf88cab4320378aull},
    {"G = 64, 16 = 4 + 12 level 2", 0x363724bb51c7aae3ull},
    {"head_dim 12, GQA 3, 16 = 4 + 12 level 2", 0x3e63ee5b11aa4502ull},
    {"G = 16, GQA 2, 8 = 2 + 2 + 4 level 2", 0xcaed296fdecb760full},
    {"window 700, scale 0.2, 8 = 4 + 4 level 2", 0x7d6814277b8ded84ull},
    {"dense bf16 prompt", 0x42130419e04bb3baull},
    {"dense float prompt", 0x173ee852b7a353dbull},
    {"tail only", 0xd24e3e50417caf44ull},
};

std::uint64_t expected(const std::string& name) {
  for (const auto& e : table)
    if (name == e.name) return e.hash;
  FAIL("no golden entry named \"" << name << "\"");
  return 0;
}

std::set<std::string> printed_entries;  // table lines printed so far

// Runs the attention on every path with 1 and 2 threads; every run must give the
// table's hash. Returns that hash (of the first run).
template <class Prompt, class TailT, class Variant = lynx::default_variant>
std::uint64_t check_golden(const std::string& name, const Prompt& prompt, const shape_case& c,
                           const std::vector<TailT>& tk, const std::vector<TailT>& tv,
                           const std::vector<float>& q, Variant variant = {}) {
  const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
  const auto tkv = lynx::token_major<const TailT>(tk.data(), ts),
             tvv = lynx::token_major<const TailT>(tv.data(), ts);
  const std::int64_t qh = c.kv_heads * c.group;
  const lynx::attention_queries queries{q.data(), c.n, qh, c.head_dim};
  const lynx::tail_visibility vis{c.tail - c.n, 1};
  lynx::decode_attention<Variant> attn{variant};
  const std::uint64_t want = expected(name);
  std::uint64_t first = 0;
  bool have_first = false;
  for (const auto path : lynx::test::host_attention_paths())
    for (const int threads : {1, 2}) {
      lynx::attention_workspace ws(attn.problem(prompt, tkv, queries, vis), threads);
      std::vector<float> out(static_cast<std::size_t>(c.n * qh * c.head_dim), -1.0f);
      attn(prompt, tkv, tvv, queries, vis, {out.data(), nullptr}, ws, {threads, path});
      const std::uint64_t h = XXH3_64bits(out.data(), out.size() * sizeof(float));
      if (!have_first) {
        first = h, have_first = true;
        if (want == 0 &&
            printed_entries.insert(name).second)  // a new or cleared entry: its table line
          std::printf("    {\"%s\", 0x%016llxull},\n", name.c_str(),
                      static_cast<unsigned long long>(h));
      }
      char hex[24];
      std::snprintf(hex, sizeof hex, "0x%016llx", static_cast<unsigned long long>(h));
      INFO(name << ", path " << lynx::test::attention_path_name(path) << ", " << threads
                << " thread(s): " << hex);
      CHECK(h == want);
    }
  return first;
}

template <class Plan, int G = 32>
void plane_cases(const std::string& prefix, const shape_case& c, bool float_tail = false) {
  const lynx::kv_shape shape{c.tokens, c.kv_heads, c.head_dim};
  const auto k = keys_of(golden::key_seed, shape), v = values_of(golden::value_seed, shape);
  const auto enc = lynx::encode<Plan, G>(lynx::token_major<const float>(k.data(), shape),
                                         lynx::token_major<const float>(v.data(), shape), 0);
  const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
  const auto tkf = keys_of(3, ts), tvf = values_of(4, ts);
  const auto q = queries_of(5, c.n, c.kv_heads * c.group, c.head_dim);
  lynx::bitplane_tensor<Plan, G> t(shape, 0);
  for (int level = 1; level <= Plan::streams; ++level) {
    t.accept(enc.segment(level - 1));
    const std::string name = prefix + Plan::name() + " level " + std::to_string(level) +
                             (float_tail ? ", float tail" : "");
    CAPTURE(name);
    std::uint64_t planes_hash = 0;
    if (float_tail)
      planes_hash = check_golden(name, t.view(), c, tkf, tvf, q);
    else
      planes_hash = check_golden(name, t.view(), c, as<bf16>(tkf), as<bf16>(tvf), q);
    if (level == Plan::streams && !float_tail) {
      // the layer merged into codes reads the same bits as all its planes
      const lynx::code_tensor<Plan, G> codes(t);
      CHECK(check_golden(name, codes.view(), c, as<bf16>(tkf), as<bf16>(tvf), q) == planes_hash);
    }
  }
}

constexpr shape_case standard{1100, 2, 64, 4, 3, 5};  // two splits, a partial last block

}  // namespace

TEST_CASE("golden attention: every plan at every precision level, and the merged codes") {
  plane_cases<lynx::plan_8_4_4>("", standard);
  plane_cases<lynx::plan_8_2_2_4>("", standard);
  plane_cases<lynx::plan_16_4_12>("", standard);
  plane_cases<lynx::plan_16_4_4_8>("", standard);
}

TEST_CASE("golden attention: Llama-3-8B head shape (head_dim 128, GQA 8), head_dim 8, G = 64") {
  plane_cases<lynx::plan_8_4_4>("Llama shape, ", {1100, 2, 128, 8, 2, 3}, true);
  // stories260K's shape: the portable value loop on every path
  {
    const shape_case c{300, 4, 8, 2, 3, 4};
    const lynx::kv_shape shape{c.tokens, c.kv_heads, c.head_dim};
    const auto t = tensor_of<lynx::plan_8_4_4>(keys_of(11, shape), values_of(12, shape), shape, 2);
    const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
    check_golden("head_dim 8, 8 = 4 + 4 level 2", t.view(), c, as<bf16>(keys_of(13, ts)),
                 as<bf16>(values_of(14, ts)), queries_of(15, c.n, c.kv_heads * c.group, 8));
  }
  {
    const shape_case c{700, 1, 128, 4, 2, 3};
    const lynx::kv_shape shape{c.tokens, c.kv_heads, c.head_dim};
    const auto t =
        tensor_of<lynx::plan_16_4_12, 64>(keys_of(21, shape), values_of(22, shape), shape, 2, true);
    const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
    check_golden("G = 64, 16 = 4 + 12 level 2", t.view(), c, as<bf16>(keys_of(23, ts)),
                 as<bf16>(values_of(24, ts)), queries_of(25, c.n, c.kv_heads * c.group, 128));
  }
}

TEST_CASE("golden attention: head_dim 12 (a partial chunk of 8 channels), G = 16, GQA 2 and 3") {
  // head_dim 12: the AVX2 key decode pads its last 4 channels, the values run the
  // portable loop; 3 query heads per kv head; all 16 planes (two code bytes)
  {
    const shape_case c{1100, 2, 12, 3, 2, 5};
    const lynx::kv_shape shape{c.tokens, c.kv_heads, c.head_dim};
    const auto t =
        tensor_of<lynx::plan_16_4_12>(keys_of(41, shape), values_of(42, shape), shape, 2);
    const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
    check_golden("head_dim 12, GQA 3, 16 = 4 + 12 level 2", t.view(), c, as<bf16>(keys_of(43, ts)),
                 as<bf16>(values_of(44, ts)),
                 queries_of(45, c.n, c.kv_heads * c.group, c.head_dim));
  }
  // G = 16: two key groups per 32-token block, four value groups per token
  {
    const shape_case c{1100, 2, 64, 2, 2, 5};
    const lynx::kv_shape shape{c.tokens, c.kv_heads, c.head_dim};
    const auto t =
        tensor_of<lynx::plan_8_2_2_4, 16>(keys_of(51, shape), values_of(52, shape), shape, 2);
    const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
    check_golden("G = 16, GQA 2, 8 = 2 + 2 + 4 level 2", t.view(), c, as<bf16>(keys_of(53, ts)),
                 as<bf16>(values_of(54, ts)),
                 queries_of(55, c.n, c.kv_heads * c.group, c.head_dim));
  }
}

TEST_CASE("golden attention: sliding window, dense prompts (the 16-bit baseline), tail only") {
  const shape_case c{1100, 2, 64, 4, 3, 6};
  const lynx::kv_shape shape{c.tokens, c.kv_heads, c.head_dim};
  const lynx::kv_shape ts{c.tail, c.kv_heads, c.head_dim};
  const auto k = keys_of(31, shape), v = values_of(32, shape);
  const auto tk = as<bf16>(keys_of(33, ts)), tv = as<bf16>(values_of(34, ts));
  const auto q = queries_of(35, c.n, c.kv_heads * c.group, c.head_dim);
  {
    const auto t = tensor_of<lynx::plan_8_4_4>(k, v, shape, 2);
    lynx::default_variant windowed;
    windowed.scale = 0.2f;
    windowed.window_ = 700;  // the first split partly, and tokens before 400 fully, outside
    check_golden("window 700, scale 0.2, 8 = 4 + 4 level 2", t.view(), c, tk, tv, q, windowed);
  }
  const auto kb = as<bf16>(k), vb = as<bf16>(v);
  check_golden("dense bf16 prompt",
               lynx::dense_prompt<bf16>{lynx::token_major<const bf16>(kb.data(), shape),
                                        lynx::token_major<const bf16>(vb.data(), shape)},
               c, tk, tv, q);
  check_golden("dense float prompt",
               lynx::dense_prompt<float>{lynx::token_major<const float>(k.data(), shape),
                                         lynx::token_major<const float>(v.data(), shape)},
               c, tk, tv, q);
  check_golden("tail only", lynx::no_prompt{}, c, tk, tv, q);
}

// The portable walk's plane decoders (the path of CPUs without AVX-512, ARM among
// them) against the definition, prefix_code: every plane count of a 16-bit plan,
// the head_dims with a transposing value decoder (64, 128, 256) and others, random
// plane words. The golden table above covers them only through the plans it runs.
template <int P>
void check_plane_decoders(int D) {
  constexpr int L = lynx::attention_block_tokens;
  std::vector<std::uint32_t> words(static_cast<std::size_t>(P * D));
  for (std::size_t i = 0; i < words.size(); ++i)
    words[i] = static_cast<std::uint32_t>(golden::mix(0x9e37u * static_cast<std::uint64_t>(P) + i));
  const std::uint32_t* rows[P];
  for (int j = 0; j < P; ++j) rows[j] = words.data() + j * D;
  std::vector<float> keys(static_cast<std::size_t>(D * L)), values(keys.size());
  lynx::detail::decode_key_tile_portable<P>(rows, D, keys.data());
  lynx::detail::decode_value_block_portable<P>(rows, D, values.data());
  int wrong_keys = 0, wrong_values = 0;
  for (int c = 0; c < D; ++c)
    for (int t = 0; t < L; ++t) {
      const auto code = static_cast<float>(lynx::prefix_code(words.data() + c, D, P, t));
      wrong_keys += keys[c * L + lynx::detail::nibble_lane(t)] != code;
      wrong_values += values[t * D + c] != code;
    }
  INFO("planes ", P, ", head_dim ", D);
  CHECK(wrong_keys == 0);
  CHECK(wrong_values == 0);
}

TEST_CASE("portable plane decoders give each token's prefix code, 1 to 16 planes") {
  for (int D : {8, 24, 64, 96, 128, 256}) [D]<int... I>(std::integer_sequence<int, I...>) {
      (check_plane_decoders<I + 1>(D), ...);
    }
  (std::make_integer_sequence<int, 16>{});
}
