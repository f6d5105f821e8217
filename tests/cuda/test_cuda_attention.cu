// CUDA decode attention against the host functor and an fp64 reference on the
// reconstructed values, bitwise batch invariance on the device, every precision
// level of 8 = 4 + 4, 8 = 2 + 2 + 4 and 16 = 4 + 12, empty tail, tail only, the
// dense bf16 baseline, shape errors, and non-finite input (NaN outputs and the
// status that names them).
// The "host logic" suite (sizing, shape errors) needs no device; the rest is
// skipped (exit 77) by the CUDA test main when no device is present.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../support/attention_reference.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/backend/cuda/attention.cuh"
#include "lynx/backend/cuda/tensor.cuh"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/tensor.hpp"

namespace {

using lynx::bf16;

// ---------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------

// K with per-channel offsets (outlier channels), V plain: [tokens][kv_heads][head_dim].
std::vector<float> make_kv(std::int64_t tokens, std::int64_t kv_heads, std::int64_t D,
                           unsigned seed, bool keys) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> offset(static_cast<std::size_t>(kv_heads * D));
  for (auto& o : offset) o = keys ? 2.0f * normal(gen) : 0.0f;
  std::vector<float> x(static_cast<std::size_t>(tokens * kv_heads * D));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < kv_heads * D; ++i)
      x[static_cast<std::size_t>(t * kv_heads * D + i)] =
          offset[static_cast<std::size_t>(i)] + normal(gen);
  return x;
}

std::vector<float> make_queries(std::int64_t n, std::int64_t qh, std::int64_t D, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<float> q(static_cast<std::size_t>(n * qh * D));
  for (auto& v : q) v = normal(gen);
  return q;
}

template <class T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = lynx::from_float<T>(x[i]);
  return r;
}

template <class T>
struct device_array {
  lynx::cuda::device_buffer buffer;
  std::size_t n = 0;
  explicit device_array(const std::vector<T>& host)
      : buffer(std::max<std::size_t>(host.size(), 1) * sizeof(T)), n(host.size()) {
    if (n)
      LYNX_CUDA_CHECK(
          cudaMemcpy(buffer.data(), host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit device_array(std::size_t count)
      : buffer(std::max<std::size_t>(count, 1) * sizeof(T)), n(count) {
    LYNX_CUDA_CHECK(cudaMemset(buffer.data(), 0xee, buffer.size()));
  }
  T* data() { return reinterpret_cast<T*>(buffer.data()); }
  const T* data() const { return reinterpret_cast<const T*>(buffer.data()); }
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    if (n)
      LYNX_CUDA_CHECK(cudaMemcpy(h.data(), buffer.data(), n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// ---------------------------------------------------------------------------
// fp64 reference on the reconstructed values
// ---------------------------------------------------------------------------

using reference_result = lynx::test::attention_reference_result;

// fp64 attention reference (tests/support/attention_reference.hpp) with this
// backend's split of the context: 256-token chunks, plus two.
template <class TailT>
reference_result reference(const std::vector<float>& pk, const std::vector<float>& pv,
                           std::int64_t prompt_tokens, const std::vector<TailT>& tk,
                           const std::vector<TailT>& tv, std::int64_t kv_heads, std::int64_t D,
                           const std::vector<float>& q, std::int64_t n, std::int64_t qh,
                           lynx::tail_visibility vis, double scale, std::int64_t window = 0,
                           double cap = 0.0) {
  return lynx::test::attention_reference({256.0, 2.0}, pk, pv, prompt_tokens, tk, tv, kv_heads, D,
                                         q, n, qh, vis, scale, window, cap);
}

// worst |out - ref| / tol over all elements
double worst_ratio(const std::vector<float>& out, const reference_result& ref, std::int64_t D) {
  double worst = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i)
    worst =
        std::max(worst, std::abs(out[i] - ref.out[i]) / ref.tol[i / static_cast<std::size_t>(D)]);
  return worst;
}

// |device - host| against the same tolerance: both are within tol of fp64, so within 2 tol of each
// other
double worst_vs_host(const std::vector<float>& dev, const std::vector<float>& host,
                     const reference_result& ref, std::int64_t D) {
  double worst = 0.0;
  for (std::size_t i = 0; i < dev.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(dev[i]) - host[i]) /
                                (2.0 * ref.tol[i / static_cast<std::size_t>(D)]));
  return worst;
}

// ---------------------------------------------------------------------------
// Runners
// ---------------------------------------------------------------------------

template <class TailT>
struct device_tail {
  device_array<TailT> k, v;
  lynx::kv_shape shape;
  device_tail(const std::vector<TailT>& hk, const std::vector<TailT>& hv, lynx::kv_shape s)
      : k(hk), v(hv), shape(s) {}
  [[nodiscard]] lynx::kv_view<const TailT, lynx::device_space> keys() const {
    return lynx::token_major<const TailT, lynx::device_space>(k.data(), shape);
  }
  [[nodiscard]] lynx::kv_view<const TailT, lynx::device_space> values() const {
    return lynx::token_major<const TailT, lynx::device_space>(v.data(), shape);
  }
};

// Runs the device attention for queries [n][qh][D] at q (device pointer); returns output (and
// lse). Every call checks the status the call left: `problem` (when given) receives the error's
// message, else an output that is not finite fails the test.
template <class Prompt, class TailT, class Variant = lynx::default_variant>
std::vector<float> run_device(const Prompt& prompt, const device_tail<TailT>& tail, const float* q,
                              std::int64_t n, std::int64_t qh, std::int64_t D,
                              lynx::tail_visibility vis, std::vector<float>* lse = nullptr,
                              Variant variant = {}, std::string* problem = nullptr) {
  const lynx::attention_queries queries{q, n, qh, D};
  device_array<float> out(static_cast<std::size_t>(n * qh * D)),
      lse_d(static_cast<std::size_t>(n * qh));
  const lynx::attention_output o{out.data(), lse ? lse_d.data() : nullptr};
  lynx::cuda::decode_attention<Variant> attn{variant};
  std::size_t bytes = 0;
  LYNX_CUDA_CHECK(attn(nullptr, bytes, prompt, tail.keys(), tail.values(), queries, vis, o));
  lynx::cuda::device_buffer ws(bytes);
  LYNX_CUDA_CHECK(attn(ws.data(), bytes, prompt, tail.keys(), tail.values(), queries, vis, o));
  LYNX_CUDA_CHECK(cudaDeviceSynchronize());
  if (problem) {
    problem->clear();
    try {
      lynx::cuda::check_attention_status(ws.data());
    } catch (const lynx::error& e) {
      CHECK(e.code() == lynx::errc::non_finite_input);
      *problem = e.what();
    }
  } else {
    lynx::cuda::check_attention_status(ws.data());
  }
  if (lse) *lse = lse_d.to_host();
  return out.to_host();
}

template <class Prompt, class TailT, class Variant = lynx::default_variant>
std::vector<float> run_host(const Prompt& prompt, const std::vector<TailT>& tk,
                            const std::vector<TailT>& tv, lynx::kv_shape ts, const float* q,
                            std::int64_t n, std::int64_t qh, std::int64_t D,
                            lynx::tail_visibility vis, Variant variant = {}) {
  const auto tkv = lynx::token_major<const TailT>(tk.data(), ts),
             tvv = lynx::token_major<const TailT>(tv.data(), ts);
  const lynx::attention_queries queries{q, n, qh, D};
  lynx::decode_attention<Variant> attn{variant};
  lynx::attention_workspace ws(attn.problem(prompt, tkv, queries, vis), 1);
  std::vector<float> out(static_cast<std::size_t>(n * qh * D));
  attn(prompt, tkv, tvv, queries, vis, {out.data(), nullptr}, ws,
       {1, lynx::attention_path::automatic});
  return out;
}

// The anchor (segment 0) of an encoded layer, delivered to a device tensor.
template <class Encoded>
auto device_anchor(const Encoded& enc, lynx::kv_shape shape) {
  lynx::bitplane_tensor<typename Encoded::plan, Encoded::group_size, lynx::device_space> tensor(
      shape, 0);
  tensor.accept(enc.segment(0));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(tensor.stream()));
  return tensor;
}

// The layer K, V [tokens][kv_heads][head_dim] encoded with 8 = 4 + 4.
auto encode_8_4_4(const std::vector<float>& k, const std::vector<float>& v, lynx::kv_shape shape) {
  return lynx::encode<lynx::plan_8_4_4, 32>(lynx::token_major<const float>(k.data(), shape),
                                            lynx::token_major<const float>(v.data(), shape), 0);
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

// Every precision level: device vs fp64 reference (on the values the host reconstructs) and vs the
// host functor.
template <class Plan, class TailT, int G = 32>
void accuracy_case(std::int64_t tokens, std::int64_t kv_heads, std::int64_t group, std::int64_t D,
                   std::int64_t tail_tokens, std::int64_t n) {
  const lynx::kv_shape shape{tokens, kv_heads, D}, ts{tail_tokens, kv_heads, D};
  const auto k = make_kv(tokens, kv_heads, D, 11, true),
             v = make_kv(tokens, kv_heads, D, 12, false);
  const auto tk = convert<TailT>(make_kv(tail_tokens, kv_heads, D, 13, true)),
             tv = convert<TailT>(make_kv(tail_tokens, kv_heads, D, 14, false));
  const std::int64_t qh = kv_heads * group;
  const auto q = make_queries(n, qh, D, 15);
  const lynx::tail_visibility vis{tail_tokens - n, 1};
  const auto enc = lynx::encode<Plan, G>(lynx::token_major<const float>(k.data(), shape),
                                         lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<Plan, G> host_tensor(shape, 0);
  lynx::bitplane_tensor<Plan, G, lynx::device_space> dev_tensor(shape, 0);
  const device_tail<TailT> dtail(tk, tv, ts);
  const device_array<float> dq(q);
  for (int level = 1; level <= Plan::streams; ++level) {
    host_tensor.accept(enc.segment(level - 1));
    dev_tensor.accept(enc.segment(level - 1));
    LYNX_CUDA_CHECK(cudaStreamSynchronize(dev_tensor.stream()));
    std::vector<float> rk, rv;
    reconstructed(host_tensor, rk, rv);
    const auto ref = reference(rk, rv, tokens, tk, tv, kv_heads, D, q, n, qh, vis,
                               1.0 / std::sqrt(static_cast<double>(D)));
    std::vector<float> lse;
    const auto dev = run_device(dev_tensor.view(), dtail, dq.data(), n, qh, D, vis, &lse);
    const auto host = run_host(host_tensor.view(), tk, tv, ts, q.data(), n, qh, D, vis);
    INFO(Plan::name() << " level " << level << " T=" << tokens << " D=" << D << " group=" << group
                      << " tail=" << tail_tokens << " G=" << G);
    const double vs_ref = worst_ratio(dev, ref, D), vs_host = worst_vs_host(dev, host, ref, D);
    INFO("worst error / tolerance: vs fp64 " << vs_ref << ", vs host " << vs_host);
    CHECK(vs_ref <= 1.0);
    CHECK(vs_host <= 1.0);
    for (std::size_t i = 0; i < lse.size(); ++i)
      CHECK(std::abs(lse[i] - ref.lse[i]) <= 1e-4 * (1.0 + std::abs(ref.lse[i])));
  }
}

// A device view with fake payload pointers: enough for the checks made before any launch.
template <class Plan, int G = 32>
lynx::bitplane_view<Plan, G, lynx::device_space> fake_view(lynx::kv_shape shape, int level) {
  lynx::bitplane_view<Plan, G, lynx::device_space> v;
  v.geometry = lynx::make_geometry<Plan, G>(shape);
  v.level = level;
  for (int s = 0; s < Plan::streams; ++s)
    v.payload[static_cast<std::size_t>(s)] =
        reinterpret_cast<const std::byte*>(std::uintptr_t{4096});
  return v;
}

}  // namespace

TEST_SUITE("host logic") {
  TEST_CASE(
      "launch shape: chunks fixed by position, workspace sized in two phases without a launch") {
    const lynx::kv_shape shape{1000, 2, 64};
    const auto view = fake_view<lynx::plan_8_4_4>(shape, 1);
    const auto* fake = reinterpret_cast<const bf16*>(std::uintptr_t{8192});
    const auto tail = lynx::token_major<const bf16, lynx::device_space>(fake, {300, 2, 64});
    const lynx::attention_queries q{reinterpret_cast<const float*>(std::uintptr_t{4096}), 3, 8, 64};
    const lynx::tail_visibility vis{297, 1};
    const auto s = lynx::cuda::decode_attention<>::shape_of(view, tail, tail, q, vis);
    CHECK(s.prompt_chunks() == 4);  // 1000 tokens in chunks of 256
    CHECK(s.tail_chunks() == 2);    // queries see up to 300 tail tokens
    CHECK(s.group_heads() == 4);
    CHECK(s.pair_tiles() == 2);  // 3 queries x 4 heads = 12 pairs, 8 per CTA
    CHECK(s.chunk_grid().x == 6);
    CHECK(s.chunk_grid().y == 2);
    CHECK(s.workspace_bytes() >= s.state_pairs() * (8 + 64 * 4));
    std::size_t bytes = 0;
    lynx::cuda::decode_attention<> attn;
    // sizing only: nothing is launched (this runs without a device)
    CHECK(attn(nullptr, bytes, view, tail, tail, q, vis,
               {reinterpret_cast<float*>(std::uintptr_t{4096}), nullptr}) == cudaSuccess);
    CHECK(bytes == s.workspace_bytes());
    // a split of the host is 4 chunks: partial states never straddle a host split
    CHECK(lynx::attention_split_tokens % lynx::cuda::attention_chunk_tokens == 0);
  }

  TEST_CASE("a status with a non-finite output becomes an error naming query, head and tokens") {
    using lynx::cuda::attention_status;
    auto message = [](attention_status st) -> std::string {
      try {
        lynx::cuda::throw_attention_status(st);
      } catch (const lynx::error& e) {
        CHECK(e.code() == lynx::errc::non_finite_input);
        return e.what();
      }
      return "";
    };
    CHECK(message({lynx::cuda::attention_no_problem, 32, 4}).empty());
    // row 37 of 32 q heads = query 1, head 5; chunk 2 of 4 prompt chunks
    const std::string prompt = message({37ull << 32 | 2u, 32, 4});
    CHECK(prompt.find("query 1, head 5 is not finite") != std::string::npos);
    CHECK(prompt.find("prompt tokens [512, 768)") != std::string::npos);
    const std::string tail = message({37ull << 32 | 5u, 32, 4});
    CHECK(tail.find("tail tokens [256, 512)") != std::string::npos);
    const std::string value = message({3ull << 32 | 0xffffffffu, 8, 1});
    CHECK(value.find("query 0, head 3") != std::string::npos);
    CHECK(value.find("a value it weighs") != std::string::npos);
  }

  TEST_CASE("bad shapes are rejected with clear errors before any launch") {
    const lynx::kv_shape shape{100, 2, 64};
    const auto* fake = reinterpret_cast<const bf16*>(std::uintptr_t{8192});
    auto* out_ptr = reinterpret_cast<float*>(std::uintptr_t{4096});
    const auto tail = lynx::token_major<const bf16, lynx::device_space>(fake, {4, 2, 64});
    const auto* qd = reinterpret_cast<const float*>(std::uintptr_t{4096});
    lynx::cuda::decode_attention<> attn;
    std::size_t bytes = 0;
    auto message = [&](auto&& call) -> std::string {
      try {
        (void)call();
      } catch (const lynx::error& e) {
        return e.what();
      }
      return "";
    };
    const auto view = fake_view<lynx::plan_8_4_4>(shape, 1);
    CHECK(message([&] {
            return attn(nullptr, bytes, fake_view<lynx::plan_8_4_4>(shape, 0), tail, tail,
                        {qd, 2, 4, 64}, {2, 1}, {out_ptr});
          }).find("precision level 0") != std::string::npos);
    CHECK(message([&] {
            return attn(nullptr, bytes, view, tail, tail, {qd, 2, 4, 128}, {2, 1}, {out_ptr});
          }).find("head_dim") != std::string::npos);
    CHECK(message([&] {
            return attn(nullptr, bytes, view, tail, tail, {qd, 2, 5, 64}, {2, 1}, {out_ptr});
          }).find("not a multiple") != std::string::npos);
    CHECK(message([&] {
            return attn(nullptr, bytes, view, tail, tail, {qd, 2, 4, 64}, {3, 1}, {out_ptr});
          }).find("tail holds 4") != std::string::npos);
    // null data is allowed in the sizing call (as in CUB), refused at launch
    std::size_t enough = 1 << 20;
    auto* ws = reinterpret_cast<void*>(std::uintptr_t{4096});
    CHECK(message([&] {
            return attn(nullptr, bytes, view, tail, tail, {nullptr, 2, 4, 64}, {2, 1}, {out_ptr});
          }).empty());
    CHECK(message([&] {
            return attn(ws, enough, view, tail, tail, {nullptr, 2, 4, 64}, {2, 1}, {out_ptr});
          }).find("null query") != std::string::npos);
    const auto other_tail = lynx::token_major<const bf16, lynx::device_space>(fake, {4, 1, 64});
    CHECK(message([&] {
            return attn(nullptr, bytes, view, other_tail, other_tail, {qd, 2, 4, 64}, {2, 1},
                        {out_ptr});
          }).find("does not match kv_heads=2") != std::string::npos);
    // head_dim 96 is valid for the host functor but not compiled on the device
    const auto view96 = fake_view<lynx::plan_8_4_4>({100, 2, 96}, 1);
    const auto tail96 = lynx::token_major<const bf16, lynx::device_space>(fake, {4, 2, 96});
    CHECK(message([&] {
            return attn(nullptr, bytes, view96, tail96, tail96, {qd, 2, 4, 96}, {2, 1}, {out_ptr});
          }).find("head_dim 96 is not compiled") != std::string::npos);
    // no prompt and an empty tail: nothing to attend to
    const auto empty = lynx::token_major<const bf16, lynx::device_space>(nullptr, {0, 2, 64});
    const lynx::cuda::dense_prompt<bf16> none{empty, empty};
    CHECK(message([&] {
            return attn(nullptr, bytes, none, tail, tail, {qd, 1, 4, 64}, {-1, 1}, {out_ptr});
          }).find("no token at all") != std::string::npos);
    const lynx::cuda::dense_prompt<bf16> uneven{
        lynx::token_major<const bf16, lynx::device_space>(fake, {10, 2, 64}),
        lynx::token_major<const bf16, lynx::device_space>(fake, {11, 2, 64})};
    CHECK(message([&] {
            return attn(nullptr, bytes, uneven, tail, tail, {qd, 1, 4, 64}, {0, 1}, {out_ptr});
          }).find("differ") != std::string::npos);
    // a workspace that is too small is refused before launching
    std::size_t small = 16;
    CHECK(message([&] {
            return attn(reinterpret_cast<void*>(std::uintptr_t{4096}), small, view, tail, tail,
                        {qd, 2, 4, 64}, {2, 1}, {out_ptr});
          }).find("workspace of 16 bytes") != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("device attention on every precision level matches fp64 and the host functor",
                   Plan, lynx::plan_8_4_4, lynx::plan_8_2_2_4, lynx::plan_16_4_12) {
  accuracy_case<Plan, bf16>(1000 + 37, 2, 4, 128, 40,
                            3);  // tokens not a multiple of G, several chunks
  accuracy_case<Plan, float>(300, 1, 1, 64, 9, 2);
  accuracy_case<Plan, bf16>(77, 1, 8, 256, 5, 4);
  accuracy_case<Plan, bf16>(70, 2, 4, 8, 3, 2);
}

TEST_CASE(
    "device attention with other group sizes (G = 64, G = 20: key groups not aligned to blocks)") {
  accuracy_case<lynx::plan_8_4_4, bf16, 64>(700, 2, 4, 64, 10, 2);
  accuracy_case<lynx::plan_16_4_12, bf16, 20>(333, 1, 4, 64, 6, 3);
}

TEST_CASE("long context on the device: many chunks, GQA 8") {
  accuracy_case<lynx::plan_8_4_4, bf16>(5000, 1, 8, 128, 300, 2);
}

TEST_CASE("the longest context the attention is built for: 128K prompt tokens, 512 chunks") {
  accuracy_case<lynx::plan_8_4_4, bf16>(131072, 1, 4, 64, 9, 2);
}

TEST_CASE_TEMPLATE("device batch invariance: a query alone gives the bits it gets among k = 2..8",
                   Plan, lynx::plan_8_4_4, lynx::plan_16_4_12) {
  const std::int64_t T = 1500, H = 2, group = 4, D = 128, qh = H * group, n = 8, tail = 300;
  const lynx::kv_shape shape{T, H, D}, ts{tail, H, D};
  const auto enc = lynx::encode<Plan, 32>(
      lynx::token_major<const float>(make_kv(T, H, D, 1, true).data(), shape),
      lynx::token_major<const float>(make_kv(T, H, D, 2, false).data(), shape), 0);
  lynx::bitplane_tensor<Plan, 32, lynx::device_space> tensor(shape, 0);
  for (int s = 0; s < Plan::streams; ++s) tensor.accept(enc.segment(s));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(tensor.stream()));
  const device_tail<bf16> dtail(convert<bf16>(make_kv(tail, H, D, 3, true)),
                                convert<bf16>(make_kv(tail, H, D, 4, false)), ts);
  const device_array<float> dq(make_queries(n, qh, D, 5));
  // the 8 queries straddle the tail's chunk boundary at 256: the last see 257..260 tail tokens
  const lynx::tail_visibility vis{tail - 48, 6};
  for (int level = 1; level <= Plan::streams; ++level) {
    const auto view = tensor.view_at(level);
    std::vector<std::vector<float>> alone;
    for (std::int64_t i = 0; i < n; ++i)
      alone.push_back(run_device(view, dtail, dq.data() + i * qh * D, 1, qh, D,
                                 {vis.base + vis.per_query * i, vis.per_query}));
    for (std::int64_t k = 2; k <= n; ++k)
      for (std::int64_t first = 0; first + k <= n; first += k) {
        const auto together = run_device(view, dtail, dq.data() + first * qh * D, k, qh, D,
                                         {vis.base + vis.per_query * first, vis.per_query});
        for (std::int64_t i = 0; i < k; ++i) {
          CAPTURE(level);
          CAPTURE(k);
          CAPTURE(first + i);
          CHECK(std::memcmp(alone[static_cast<std::size_t>(first + i)].data(),
                            together.data() + i * qh * D,
                            static_cast<std::size_t>(qh * D) * sizeof(float)) == 0);
        }
      }
  }
}

TEST_CASE("a batched call: each request's outputs are the bits of its solo call") {
  // 6 requests over one layer of 8 = 4 + 4: the anchor alone for some, both streams
  // for others; 1 to 3 queries each; tails seen to different depths
  const std::int64_t T = 1100, H = 2, group = 4, D = 128, qh = H * group, tail = 300;
  const lynx::kv_shape shape{T, H, D}, ts{tail, H, D};
  const auto enc = encode_8_4_4(make_kv(T, H, D, 21, true), make_kv(T, H, D, 22, false), shape);
  lynx::bitplane_tensor<lynx::plan_8_4_4, 32, lynx::device_space> tensor(shape, 0);
  for (int s = 0; s < 2; ++s) tensor.accept(enc.segment(s));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(tensor.stream()));
  const device_tail<bf16> dtail(convert<bf16>(make_kv(tail, H, D, 23, true)),
                                convert<bf16>(make_kv(tail, H, D, 24, false)), ts);
  const std::int64_t counts[6] = {1, 3, 2, 1, 2, 3};
  const int levels[6] = {1, 2, 2, 1, 1, 2};
  const std::int64_t seen[6] = {40, 300, 257, 1, 120, 200};
  using request =
      lynx::cuda::attention_request<lynx::bitplane_view<lynx::plan_8_4_4, 32, lynx::device_space>,
                                    bf16>;
  std::vector<request> requests;
  std::vector<device_array<float>> queries, outs;
  for (int r = 0; r < 6; ++r) {
    queries.emplace_back(make_queries(counts[r], qh, D, 30 + static_cast<unsigned>(r)));
    outs.emplace_back(static_cast<std::size_t>(counts[r] * qh * D));
  }
  for (int r = 0; r < 6; ++r)
    requests.push_back(
        {tensor.view_at(levels[r]), dtail.keys(), dtail.values(),
         lynx::attention_queries{queries[static_cast<std::size_t>(r)].data(), counts[r], qh, D},
         lynx::tail_visibility{seen[r] - counts[r] + 1, 1},
         lynx::attention_output{outs[static_cast<std::size_t>(r)].data(), nullptr}});
  lynx::cuda::decode_attention<> attn;
  const std::span<const request> batch(requests);
  std::size_t bytes = 0;
  LYNX_CUDA_CHECK(attn.batch(nullptr, bytes, batch));
  lynx::cuda::device_buffer ws(bytes);
  LYNX_CUDA_CHECK(attn.batch(ws.data(), bytes, batch));
  lynx::cuda::decode_attention<>::check_batch_status(ws.data(), batch);
  for (int r = 0; r < 6; ++r) {
    CAPTURE(r);
    const auto solo = run_device(requests[static_cast<std::size_t>(r)].prompt, dtail,
                                 queries[static_cast<std::size_t>(r)].data(), counts[r], qh, D,
                                 requests[static_cast<std::size_t>(r)].visible);
    const auto got = outs[static_cast<std::size_t>(r)].to_host();
    CHECK(std::memcmp(solo.data(), got.data(), solo.size() * sizeof(float)) == 0);
  }
  // a request with a bad shape is named before anything is launched
  requests[4].queries.head_dim = 64;
  CHECK_THROWS_WITH_AS((void)attn.batch(ws.data(), bytes, std::span<const request>(requests)),
                       doctest::Contains("request 4"), lynx::error);
}

TEST_CASE("device batch invariance with a sliding window and a soft-cap") {
  const std::int64_t T = 900, H = 1, group = 4, D = 64, qh = H * group, n = 6, tail = 40;
  const lynx::kv_shape shape{T, H, D}, ts{tail, H, D};
  const auto k = make_kv(T, H, D, 21, true), v = make_kv(T, H, D, 22, false);
  const auto enc = encode_8_4_4(k, v, shape);
  const auto tensor = device_anchor(enc, shape);
  const auto tkh = convert<bf16>(make_kv(tail, H, D, 23, true)),
             tvh = convert<bf16>(make_kv(tail, H, D, 24, false));
  const device_tail<bf16> dtail(tkh, tvh, ts);
  const auto q = make_queries(n, qh, D, 25);
  const device_array<float> dq(q);
  const lynx::tail_visibility vis{tail - n, 1};
  lynx::soft_cap_variant variant;
  variant.cap = 5.0f;
  variant.window_ =
      333;  // the window starts inside a block and inside a chunk, a different token for each query
  const auto together =
      run_device(tensor.view(), dtail, dq.data(), n, qh, D, vis, nullptr, variant);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto alone = run_device(tensor.view(), dtail, dq.data() + i * qh * D, 1, qh, D,
                                  {vis.base + i, 1}, nullptr, variant);
    CHECK(std::memcmp(alone.data(), together.data() + i * qh * D,
                      static_cast<std::size_t>(qh * D) * sizeof(float)) == 0);
  }
  lynx::bitplane_tensor<lynx::plan_8_4_4, 32> host_tensor(shape, 0);
  host_tensor.accept(enc.segment(0));
  std::vector<float> rk, rv;
  reconstructed(host_tensor, rk, rv);
  const auto ref = reference(rk, rv, T, tkh, tvh, H, D, q, n, qh, vis, 1.0 / 8.0, 333, 5.0);
  INFO("worst error / tolerance " << worst_ratio(together, ref, D));
  CHECK(worst_ratio(together, ref, D) <= 1.0);
}

TEST_CASE("empty tail, tail only, float tail, dense bf16 prompt (the 16-bit baseline)") {
  const std::int64_t T = 600, H = 2, group = 4, D = 128, qh = H * group;
  const lynx::kv_shape shape{T, H, D};
  const auto k = make_kv(T, H, D, 31, true), v = make_kv(T, H, D, 32, false);
  const auto q = make_queries(3, qh, D, 33);
  const device_array<float> dq(q);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  SUBCASE("empty tail: the queries see the prompt alone") {
    const auto enc = encode_8_4_4(k, v, shape);
    const auto tensor = device_anchor(enc, shape);
    lynx::bitplane_tensor<lynx::plan_8_4_4, 32> host_tensor(shape, 0);
    host_tensor.accept(enc.segment(0));
    const std::vector<bf16> none;
    const device_tail<bf16> empty(none, none, {0, H, D});
    const lynx::tail_visibility prompt_only{0, 0};
    std::vector<float> rk, rv;
    reconstructed(host_tensor, rk, rv);
    const auto out = run_device(tensor.view(), empty, dq.data(), 3, qh, D, prompt_only);
    CHECK(worst_ratio(out, reference(rk, rv, T, none, none, H, D, q, 3, qh, prompt_only, scale),
                      D) <= 1.0);
  }
  SUBCASE("tail only (float tail), no prompt") {
    const auto tk = make_kv(300, H, D, 34, true), tv = make_kv(300, H, D, 35, false);
    const device_tail<float> dtail(tk, tv, {300, H, D});
    const auto empty = lynx::token_major<const float, lynx::device_space>(nullptr, {0, H, D});
    const lynx::tail_visibility causal{290, 1};
    const auto out = run_device(lynx::cuda::dense_prompt<float>{empty, empty}, dtail, dq.data(), 3,
                                qh, D, causal);
    CHECK(worst_ratio(out,
                      reference(std::vector<float>{}, std::vector<float>{}, 0, tk, tv, H, D, q, 3,
                                qh, causal, scale),
                      D) <= 1.0);
  }
  SUBCASE("dense bf16 prompt: the baseline against fp64 and the host's dense path") {
    const auto kb = convert<bf16>(k), vb = convert<bf16>(v);
    const device_array<bf16> dk(kb), dv(vb);
    const lynx::cuda::dense_prompt<bf16> prompt{
        lynx::token_major<const bf16, lynx::device_space>(dk.data(), shape),
        lynx::token_major<const bf16, lynx::device_space>(dv.data(), shape)};
    const auto tk = convert<bf16>(make_kv(20, H, D, 36, true)),
               tv = convert<bf16>(make_kv(20, H, D, 37, false));
    const device_tail<bf16> dtail(tk, tv, {20, H, D});
    const lynx::tail_visibility causal{17, 1};
    std::vector<float> kf(kb.size()), vf(vb.size());
    for (std::size_t i = 0; i < kb.size(); ++i)
      kf[i] = lynx::to_float(kb[i]), vf[i] = lynx::to_float(vb[i]);
    const auto ref = reference(kf, vf, T, tk, tv, H, D, q, 3, qh, causal, scale);
    const auto out = run_device(prompt, dtail, dq.data(), 3, qh, D, causal);
    CHECK(worst_ratio(out, ref, D) <= 1.0);
    const lynx::dense_prompt<bf16> host_prompt{lynx::token_major<const bf16>(kb.data(), shape),
                                               lynx::token_major<const bf16>(vb.data(), shape)};
    CHECK(worst_vs_host(out, run_host(host_prompt, tk, tv, {20, H, D}, q.data(), 3, qh, D, causal),
                        ref, D) <= 1.0);
  }
}

TEST_CASE("non-finite input: NaN outputs for the queries that see it, named by the status") {
  const std::int64_t T = 600, H = 2, group = 4, D = 64, qh = H * group, n = 3, TT = 40;
  const lynx::kv_shape shape{T, H, D}, ts{TT, H, D};
  const auto k = make_kv(T, H, D, 41, true), v = make_kv(T, H, D, 42, false);
  const auto enc = encode_8_4_4(k, v, shape);
  const auto tensor = device_anchor(enc, shape);
  const auto q = make_queries(n, qh, D, 43);
  const auto tk = convert<bf16>(make_kv(TT, H, D, 44, true)),
             tv = convert<bf16>(make_kv(TT, H, D, 45, false));
  const lynx::tail_visibility vis{37, 1};  // query i sees tail tokens [0, 38 + i)
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  // runs with the given inputs; returns the outputs and the status's message
  auto run = [&](const std::vector<float>& qx, const std::vector<bf16>& kx,
                 const std::vector<bf16>& vx, lynx::tail_visibility vv, std::string& problem) {
    const device_array<float> dq(qx);
    const device_tail<bf16> dtail(kx, vx, ts);
    return run_device(tensor.view(), dtail, dq.data(), n, qh, D, vv, nullptr,
                      lynx::default_variant{}, &problem);
  };
  // Puts x at element `at` of input (0: queries, 1: tail keys, 2: tail values) and
  // runs: the rows (query, head) is_bad names are NaN, all others keep the clean bits,
  // and the status names `first` and `cause` (nothing when is_bad names no row).
  auto poisoned = [&](int input, std::int64_t at, float x, lynx::tail_visibility vv, auto is_bad,
                      const std::string& first, const std::string& cause) {
    std::string problem;
    const auto clean = run(q, tk, tv, vv, problem);
    REQUIRE(problem.empty());
    auto qx = q;
    auto kx = tk, vx = tv;
    if (input == 0) qx[static_cast<std::size_t>(at)] = x;
    if (input > 0) (input == 1 ? kx : vx)[static_cast<std::size_t>(at)] = lynx::from_float<bf16>(x);
    const auto out = run(qx, kx, vx, vv, problem);
    for (std::int64_t r = 0; r < n * qh; ++r) {
      CAPTURE(r);
      if (is_bad(r / qh, r % qh))
        CHECK(std::isnan(out[static_cast<std::size_t>(r * D)]));
      else
        CHECK(std::memcmp(out.data() + r * D, clean.data() + r * D, D * sizeof(float)) == 0);
    }
    if (first.empty()) CHECK(problem.empty());
    CHECK(problem.find(first) != std::string::npos);
    CHECK(problem.find(cause) != std::string::npos);
  };
  const auto kv_head = [&](std::int64_t g) {
    return [=](std::int64_t, std::int64_t h) { return h / group == g; };
  };
  SUBCASE("NaN in a query: that (query, head) alone, its logits named") {
    poisoned(
        0, (1 * qh + 5) * D + 7, nan, vis,
        [](std::int64_t i, std::int64_t h) { return i == 1 && h == 5; },
        "query 1, head 5 is not finite", "prompt tokens [0, 256)");
  }
  SUBCASE("-inf in a tail key every query sees: all heads of its kv head") {
    poisoned(1, (12 * H + 1) * D + 3, -inf, vis, kv_head(1), "query 0, head 4 is not finite",
             "tail tokens [0, 256)");
  }
  SUBCASE("NaN in a tail value: the output, with finite logits") {
    poisoned(2, (20 * H + 0) * D + 9, nan, vis, kv_head(0), "query 0, head 0 is not finite",
             "a value it weighs");
  }
  SUBCASE("NaN in a tail token only the last query sees, and in one no query sees") {
    poisoned(
        1, 39 * H * D, nan, vis,  // query 2 sees [0, 40)
        [](std::int64_t i, std::int64_t h) { return i == 2 && h / group == 0; },
        "query 2, head 0 is not finite", "tail tokens [0, 256)");
    poisoned(
        1, 39 * H * D, nan, {36, 1},  // query 2 sees [0, 39)
        [](std::int64_t, std::int64_t) { return false; }, "", "");
  }
}
