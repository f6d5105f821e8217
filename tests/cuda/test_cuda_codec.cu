// Device codecs against the host codecs: the device encoder's segments must be
// the host encoder's bytes (payload and, once sealed, header), the device
// reconstruction the host reconstruction bit for bit at every precision level,
// the device tensor must reject what the host tensor rejects, and bad input
// must raise the host's error with the same coordinates.
// Cases in the "host logic" suite need no device (geometry, launch shapes,
// error decisions); the main shared by CUDA tests skips the whole executable
// (exit 77) when no device is present.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "lynx/backend/cuda/codec.cuh"
#include "lynx/backend/cuda/tensor.cuh"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/tensor.hpp"

namespace {

using namespace lynx;

// ---------------------------------------------------------------------------
// Inputs: random and adversarial layers, [tokens][kv_heads][head_dim] or head-major
// ---------------------------------------------------------------------------

enum class data_kind { random, constant_groups, outlier_channel, denormals, signed_zeros };

const char* kind_name(data_kind k) {
  switch (k) {
    case data_kind::random:
      return "random";
    case data_kind::constant_groups:
      return "constant_groups";
    case data_kind::outlier_channel:
      return "outlier_channel";
    case data_kind::denormals:
      return "denormals";
    case data_kind::signed_zeros:
      return "signed_zeros";
  }
  return "?";
}

template <class T>
std::vector<T> make_layer(kv_shape shape, data_kind kind, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> x(static_cast<std::size_t>(shape.elements()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::int64_t c = static_cast<std::int64_t>(i) % shape.head_dim;
    const std::int64_t t = static_cast<std::int64_t>(i) / (shape.kv_heads * shape.head_dim);
    float v = normal(rng);
    switch (kind) {
      case data_kind::random:
        break;
      case data_kind::constant_groups:
        v = (t / 32) % 2 == 0 ? 0.375f * static_cast<float>(c % 5) : v;
        break;
      case data_kind::outlier_channel:
        v = c == 3 % shape.head_dim ? 3.0e4f * (1.0f + 0.01f * v) : v;
        break;
      case data_kind::denormals:
        v *= 1.0e-39f;
        break;  // float subnormals (fp16/bf16: flushed by the conversion or subnormal)
      case data_kind::signed_zeros:
        v = (rng() % 3 == 0) ? v : ((rng() & 1) ? 0.0f : -0.0f);
        break;
    }
    x[i] = from_float<T>(v);
  }
  return x;
}

// An owning device copy of a host vector.
template <class T>
struct device_array {
  lynx::cuda::device_buffer buffer;
  explicit device_array(const std::vector<T>& host) : buffer(host.size() * sizeof(T)) {
    LYNX_CUDA_CHECK(
        cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit device_array(std::size_t n) : buffer(n * sizeof(T)) {
    LYNX_CUDA_CHECK(cudaMemset(buffer.data(), 0xee, n * sizeof(T)));
  }
  T* data() { return reinterpret_cast<T*>(buffer.data()); }
  std::vector<T> to_host(std::size_t n) const {
    std::vector<T> h(n);
    LYNX_CUDA_CHECK(cudaMemcpy(h.data(), buffer.data(), n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class T, memory_space S>
kv_view<T, S> view_as(T* data, kv_shape shape, bool head_major_layout) {
  return head_major_layout ? head_major<T, S>(data, shape) : token_major<T, S>(data, shape);
}

template <class Plan, class T>
struct combo {
  using plan = Plan;
  using element = T;
};

#define LYNX_DEVICE_COMBOS                                                              \
  combo<plan_8_4_4, bf16>, combo<plan_8_4_4, float>, combo<plan_8_4_4, fp16>,           \
      combo<plan_8_2_2_4, bf16>, combo<plan_8_2_2_4, float>, combo<plan_8_2_2_4, fp16>, \
      combo<plan_16_4_12, bf16>, combo<plan_16_4_12, float>, combo<plan_16_4_12, fp16>, \
      combo<plan_16_4_4_8, bf16>, combo<plan_16_4_4_8, float>, combo<plan_16_4_4_8, fp16>

// Encodes on host and device, compares every byte, then reconstructs at every
// level on both and compares every output bit.
template <class Plan, class T>
void check_layer(kv_shape shape, data_kind kind, bool head_major_layout, std::uint32_t seed) {
  constexpr int G = 32;
  CAPTURE(Plan::name());
  CAPTURE(element_name<T>());
  CAPTURE(kind_name(kind));
  CAPTURE(to_string(shape));
  CAPTURE(head_major_layout);
  const std::uint32_t layer = 7;
  const std::uint64_t generation = 3;
  const std::vector<T> keys = make_layer<T>(shape, kind, seed),
                       values = make_layer<T>(shape, kind, seed + 1);
  const auto host_k = view_as<const T, host_space>(keys.data(), shape, head_major_layout);
  const auto host_v = view_as<const T, host_space>(values.data(), shape, head_major_layout);
  const auto host_layer = encode<Plan, G, T>(host_k, host_v, layer, {.generation = generation});

  device_array<T> dk(keys), dv(values);
  const auto dev_k = view_as<const T, device_space>(dk.data(), shape, head_major_layout);
  const auto dev_v = view_as<const T, device_space>(dv.data(), shape, head_major_layout);
  const auto dev_layer = lynx::cuda::encode<Plan, G, T>(dev_k, dev_v, layer, generation);

  bitplane_tensor<Plan, G, host_space> host_tensor(shape, layer, generation);
  bitplane_tensor<Plan, G, device_space> dev_tensor(shape, layer, generation);
  for (int s = 0; s < Plan::streams; ++s) {
    CAPTURE(s);
    const std::span<const std::byte> expected = host_layer.segment(s);
    std::vector<std::byte> staged(dev_layer.segment(s).size);
    REQUIRE(staged.size() == expected.size());
    // unsealed: the payload is final, the checksum field is still 0
    LYNX_CUDA_CHECK(cudaMemcpy(staged.data(), dev_layer.segment(s).data, staged.size(),
                               cudaMemcpyDeviceToHost));
    CHECK(peek_header(staged).checksum == 0);
    CHECK(std::memcmp(staged.data() + segment_header_bytes, expected.data() + segment_header_bytes,
                      expected.size() - segment_header_bytes) == 0);
    lynx::cuda::stage_to_host(dev_layer.segment(s), staged);
    CHECK(std::memcmp(staged.data(), expected.data(), expected.size()) ==
          0);  // header and checksum too
    host_tensor.accept(expected);
    CHECK(dev_tensor.accept(staged) == accept_result::accepted);
    CHECK(dev_tensor.precision_level() == host_tensor.precision_level());

    // reconstruct at every level reached so far
    for (int level = 1; level <= host_tensor.precision_level(); ++level) {
      CAPTURE(level);
      const std::size_t n = static_cast<std::size_t>(shape.elements());
      std::vector<T> hk(n), hv(n);
      reconstruct(host_tensor.view_at(level),
                  view_as<T, host_space>(hk.data(), shape, head_major_layout),
                  view_as<T, host_space>(hv.data(), shape, head_major_layout));
      device_array<T> ok(n), ov(n);
      lynx::cuda::reconstruct(dev_tensor.view_at(level),
                              view_as<T, device_space>(ok.data(), shape, head_major_layout),
                              view_as<T, device_space>(ov.data(), shape, head_major_layout));
      LYNX_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<T> gk = ok.to_host(n), gv = ov.to_host(n);
      CHECK(std::memcmp(gk.data(), hk.data(), n * sizeof(T)) == 0);
      CHECK(std::memcmp(gv.data(), hv.data(), n * sizeof(T)) == 0);
    }
  }
  CHECK(dev_tensor.complete());
}

std::string error_message(auto&& f) {
  try {
    f();
  } catch (const lynx::error& e) {
    return std::string(to_string(e.code())) + "|" + e.what();
  }
  return "no error";
}

}  // namespace

// ---------------------------------------------------------------------------
// Host logic (no device needed)
// ---------------------------------------------------------------------------

TEST_SUITE("host logic") {
  TEST_CASE("payload sections tile the payload and their padding is zero in host segments") {
    for (const kv_shape shape :
         {kv_shape{1, 1, 8}, kv_shape{33, 2, 64}, kv_shape{100, 3, 128}, kv_shape{70, 1, 256}}) {
      CAPTURE(to_string(shape));
      const std::vector<float> x = make_layer<float>(shape, data_kind::random, 1);
      const auto v = token_major<const float, host_space>(x.data(), shape);
      const auto enc = encode<plan_16_4_4_8, 32, float>(v, v, 0);
      const layer_geometry& g = enc.geometry();
      for (int s = 0; s < plan_16_4_4_8::streams; ++s) {
        lynx::cuda::detail::payload_section sec[lynx::cuda::detail::max_sections];
        const int n = lynx::cuda::detail::payload_sections(g, s, sec);
        CHECK(n == (s == 0 ? 6 : 2));
        std::int64_t next = 0;
        for (int i = 0; i < n; ++i) {
          CHECK(sec[i].offset == next);
          CHECK(sec[i].padded - sec[i].used < section_alignment);
          next = sec[i].offset + sec[i].padded;
          for (std::int64_t b = sec[i].used; b < sec[i].padded; ++b)
            CHECK(enc.segment(
                      s)[static_cast<std::size_t>(segment_header_bytes + sec[i].offset + b)] ==
                  std::byte{0});
        }
        CHECK(next == g.payload_bytes(s));
      }
    }
  }

  TEST_CASE("plane rows address the words the layout names") {
    const layer_geometry g = make_geometry<plan_8_2_2_4, 32>({70, 3, 64});
    std::vector<std::vector<std::byte>> payloads;
    std::byte* base[max_streams] = {};
    for (int s = 0; s < g.plan.streams; ++s)
      payloads.emplace_back(static_cast<std::size_t>(g.payload_bytes(s)));
    for (int s = 0; s < g.plan.streams; ++s) base[s] = payloads[static_cast<std::size_t>(s)].data();
    for (const bool keys : {true, false}) {
      const auto rows = lynx::cuda::detail::make_plane_rows<std::uint32_t>(g, base, keys, 8);
      int j = 0;
      for (int s = 0; s < g.plan.streams; ++s)
        for (int jl = 0; jl < g.planes_in(s); ++jl, ++j)
          for (std::int64_t h = 0; h < g.kv_heads; ++h)
            for (std::int64_t b = 0; b < g.blocks(); ++b)
              for (std::int64_t c : {std::int64_t{0}, std::int64_t{63}}) {
                const auto* expected =
                    reinterpret_cast<std::uint32_t*>(
                        base[s] + (keys ? g.key_planes_offset(s) : g.value_planes_offset(s))) +
                    g.word_index(s, h, b, jl, c);
                CHECK(rows.base[j] + (h * g.blocks() + b) * rows.head_block_stride[j] + c ==
                      expected);
              }
      CHECK(j == 8);
    }
  }

  TEST_CASE("launch geometry covers every group, block and channel") {
    for (const kv_shape shape : {kv_shape{1, 1, 8}, kv_shape{33, 2, 64}, kv_shape{4096, 8, 128},
                                 kv_shape{32768, 8, 128}, kv_shape{5, 3, 16}}) {
      CAPTURE(to_string(shape));
      const layer_geometry g = make_geometry<plan_8_4_4, 32>(shape);
      const auto l = lynx::cuda::detail::make_encode_launch(g);
      CHECK(l.key_params.x == g.key_token_groups());
      CHECK(l.key_params.y * 32 >= g.head_dim);
      CHECK((l.key_params.y - 1) * 32 < g.head_dim);
      CHECK(l.key_params.z == g.kv_heads);
      CHECK(l.value_group_count == g.kv_heads * g.tokens * g.value_channel_groups());
      CHECK(std::int64_t{l.value_params.x} * 8 >= l.value_group_count);
      CHECK((std::int64_t{l.value_params.x} - 1) * 8 < l.value_group_count);
      CHECK(l.pack.x * 32 >= g.tokens);
      CHECK((l.pack.x - 1) * 32 < g.tokens);
      CHECK(l.pack.y == l.key_params.y);
      CHECK(l.pack.z == g.kv_heads);
      const dim3 block = lynx::cuda::detail::block_shape();
      CHECK(block.x * block.y == 256);
    }
  }

  TEST_CASE("segment frames hold the host headers and the padding gaps") {
    const layer_geometry g = make_geometry<plan_8_4_4, 32>({33, 2, 64});
    std::array<lynx::cuda::device_bytes, 2> out{
        lynx::cuda::device_bytes{nullptr, segment_bytes(g, 0)},
        lynx::cuda::device_bytes{nullptr, segment_bytes(g, 1)}};
    const auto f = lynx::cuda::detail::make_segment_frames(g, 5, 9, out);
    CHECK(f.streams == 2);
    for (int s = 0; s < 2; ++s) {
      const segment_header h = make_header(g, 5, s, 9);
      CHECK(std::memcmp(f.header_words[s], &h, sizeof h) == 0);
      lynx::cuda::detail::payload_section sec[lynx::cuda::detail::max_sections];
      const int n = lynx::cuda::detail::payload_sections(g, s, sec);
      for (int i = 0; i < n; ++i) {
        CHECK(f.gap_offset[s][i] ==
              static_cast<std::int64_t>(segment_header_bytes) + sec[i].offset + sec[i].used);
        CHECK(f.gap_bytes[s][i] == sec[i].padded - sec[i].used);
      }
    }
  }

  // The device records the smallest linear index of each kind of problem (atomicMin);
  // emulate that here and check the decision gives the host encoder's error.
  TEST_CASE("status decisions reproduce the host encoder's errors") {
    const kv_shape shape{70, 3, 64};
    const layer_geometry g = make_geometry<plan_8_4_4, 32>(shape);
    struct bad {
      bool keys;
      std::int64_t t, h, c;
      float v;
    };
    const float nan = std::numeric_limits<float>::quiet_NaN(),
                inf = std::numeric_limits<float>::infinity();
    const std::vector<std::vector<bad>> cases = {
        {{true, 40, 1, 5, nan}},
        {{false, 3, 2, 63, inf}},
        {{true, 69, 2, 0, -inf}, {false, 0, 0, 0, nan}},     // keys first
        {{false, 10, 1, 40, nan}, {false, 10, 1, 33, inf}},  // same value group: first channel
        {{false, 10, 1, 40, nan}, {false, 9, 2, 1, inf}},    // earlier head wins over earlier token
        {{true, 2, 0, 7, 3.0e38f}, {true, 3, 0, 7, -3.0e38f}},  // range overflow, no NaN
        {{true, 2, 0, 7, 3.0e38f},
         {true, 3, 0, 7, -3.0e38f},
         {true, 31, 0, 60, nan}},  // same group: NaN named
        {{true, 40, 0, 7, 3.0e38f}, {true, 41, 0, 7, -3.0e38f}, {true, 5, 0, 60, nan}},
        {{true, 40, 0, 7, 3.0e38f},
         {true, 41, 0, 7, -3.0e38f},
         {true, 5, 1, 60, nan}},  // overflow group earlier (head 0)
        {{false, 12, 0, 3, 3.0e38f}, {false, 12, 0, 4, -3.0e38f}},
    };
    for (std::size_t k = 0; k < cases.size(); ++k) {
      CAPTURE(k);
      std::vector<float> keys = make_layer<float>(shape, data_kind::random, 11),
                         values = make_layer<float>(shape, data_kind::random, 12);
      for (const bad& b : cases[k])
        (b.keys ? keys : values)[static_cast<std::size_t>(
            (b.t * shape.kv_heads + b.h) * shape.head_dim + b.c)] = b.v;
      const auto kv = token_major<const float, host_space>(keys.data(), shape);
      const auto vv = token_major<const float, host_space>(values.data(), shape);
      const std::string host =
          error_message([&] { (void)encode<plan_8_4_4, 32, float>(kv, vv, 4); });
      // what the device kernels would leave in the status
      lynx::cuda::encode_status st{lynx::cuda::no_problem, lynx::cuda::no_problem,
                                   lynx::cuda::no_problem, lynx::cuda::no_problem};
      for (std::int64_t h = 0; h < g.kv_heads; ++h)
        for (std::int64_t t = 0; t < g.tokens; ++t)
          for (std::int64_t c = 0; c < g.head_dim; ++c) {
            const auto at = static_cast<unsigned long long>((h * g.tokens + t) * g.head_dim + c);
            if (!is_finite_value(kv(t, h, c))) st.key_non_finite = std::min(st.key_non_finite, at);
            if (!is_finite_value(vv(t, h, c)))
              st.value_non_finite = std::min(st.value_non_finite, at);
          }
      for (std::int64_t h = 0; h < g.kv_heads; ++h)
        for (std::int64_t grp = 0; grp < g.key_token_groups(); ++grp)
          for (std::int64_t c = 0; c < g.head_dim; ++c) {
            float lo = kv(grp * 32, h, c), hi = lo;
            for (std::int64_t t = grp * 32; t < std::min<std::int64_t>(grp * 32 + 32, g.tokens);
                 ++t) {
              lo = std::min(lo, kv(t, h, c));
              hi = std::max(hi, kv(t, h, c));
            }
            if (range_overflow(lo, hi))
              st.key_overflow_group =
                  std::min(st.key_overflow_group,
                           static_cast<unsigned long long>(h * g.key_token_groups() + grp));
          }
      for (std::int64_t h = 0; h < g.kv_heads; ++h)
        for (std::int64_t t = 0; t < g.tokens; ++t)
          for (std::int64_t grp = 0; grp < g.value_channel_groups(); ++grp) {
            float lo = vv(t, h, grp * 32), hi = lo;
            for (std::int64_t c = grp * 32; c < grp * 32 + 32; ++c) {
              lo = std::min(lo, vv(t, h, c));
              hi = std::max(hi, vv(t, h, c));
            }
            if (range_overflow(lo, hi))
              st.value_overflow_group =
                  std::min(st.value_overflow_group,
                           static_cast<unsigned long long>(
                               (h * g.tokens + t) * g.value_channel_groups() + grp));
          }
      const lynx::cuda::encode_problem p = lynx::cuda::first_problem(st, g);
      REQUIRE(p.kind != lynx::cuda::encode_problem::none);
      const float offending = p.kind == lynx::cuda::encode_problem::non_finite
                                  ? (p.keys ? kv : vv)(p.token, p.head, p.channel)
                                  : 0.0f;
      const std::string device =
          error_message([&] { lynx::cuda::report_problem(p, 4, offending); });
      CHECK(device == host);
    }
    const lynx::cuda::encode_status clean{lynx::cuda::no_problem, lynx::cuda::no_problem,
                                          lynx::cuda::no_problem, lynx::cuda::no_problem};
    CHECK(lynx::cuda::first_problem(clean, g).kind == lynx::cuda::encode_problem::none);
  }
}

// ---------------------------------------------------------------------------
// Device: bitwise equality with the host codecs
// ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("device encode and reconstruct equal the host's bit for bit", C,
                   LYNX_DEVICE_COMBOS) {
  using Plan = typename C::plan;
  using T = typename C::element;
  std::uint32_t seed = 100;
  for (const std::int64_t head_dim : {8, 64, 128, 256})
    for (const std::int64_t tokens : {1, 33, 100})
      check_layer<Plan, T>({tokens, 2, head_dim}, data_kind::random, false, seed++);
  for (const data_kind kind : {data_kind::constant_groups, data_kind::outlier_channel,
                               data_kind::denormals, data_kind::signed_zeros})
    for (const std::int64_t head_dim : {8, 128})
      check_layer<Plan, T>({70, 3, head_dim}, kind, false, seed++);
  check_layer<Plan, T>({65, 3, 64}, data_kind::random, true,
                       seed++);  // head-major input and output
}

TEST_CASE("device encode with other group sizes equals the host's") {
  const kv_shape shape{77, 2, 96};
  const std::vector<bf16> x = make_layer<bf16>(shape, data_kind::random, 5);
  const auto hv = token_major<const bf16, host_space>(x.data(), shape);
  device_array<bf16> dx(x);
  const auto dv = token_major<const bf16, device_space>(dx.data(), shape);
  const auto check_group = [&]<int G>() {
    CAPTURE(G);
    const auto host_layer = encode<plan_8_4_4, G, bf16>(hv, hv, 1);
    const auto dev_layer = lynx::cuda::encode<plan_8_4_4, G, bf16>(dv, dv, 1);
    for (int s = 0; s < 2; ++s) {
      std::vector<std::byte> staged(dev_layer.segment(s).size);
      lynx::cuda::stage_to_host(dev_layer.segment(s), staged);
      CHECK(std::memcmp(staged.data(), host_layer.segment(s).data(), staged.size()) == 0);
    }
  };
  check_group.template operator()<8>();
  check_group.template operator()<24>();   // value groups of 24 channels: not a power of two
  check_group.template operator()<64>();   // value groups wider than a warp
  check_group.template operator()<128>();  // value group = head_dim
}

TEST_CASE("device encode_async sizes its workspace first, then runs without allocating") {
  const kv_shape shape{40, 2, 64};
  const std::vector<fp16> x = make_layer<fp16>(shape, data_kind::random, 9);
  device_array<fp16> dx(x);
  const auto dv = token_major<const fp16, device_space>(dx.data(), shape);
  const layer_geometry g = make_geometry<plan_8_4_4, 32>(shape);
  std::size_t bytes = 0;
  std::array<lynx::cuda::device_bytes, 2> none{};
  CHECK(lynx::cuda::encode_async<plan_8_4_4, 32, fp16>(nullptr, bytes, dv, dv, 0, none) ==
        cudaSuccess);
  CHECK(bytes == lynx::cuda::encode_workspace_bytes(g));
  lynx::cuda::device_buffer workspace(bytes), s0(segment_bytes(g, 0)), s1(segment_bytes(g, 1));
  std::array<lynx::cuda::device_bytes, 2> out{s0.bytes(), s1.bytes()};
  CHECK(lynx::cuda::encode_async<plan_8_4_4, 32, fp16>(workspace.data(), bytes, dv, dv, 0, out) ==
        cudaSuccess);
  lynx::cuda::check_encode_status<plan_8_4_4, 32, fp16>(workspace.data(), dv, dv, 0);
  const auto host_layer =
      encode<plan_8_4_4, 32, fp16>(token_major<const fp16, host_space>(x.data(), shape),
                                   token_major<const fp16, host_space>(x.data(), shape), 0);
  std::vector<std::byte> staged(segment_bytes(g, 1));
  lynx::cuda::stage_to_host(out[1], staged);
  CHECK(std::memcmp(staged.data(), host_layer.segment(1).data(), staged.size()) == 0);
  // a wrong-sized output buffer is an argument error, like the host's encode_into
  std::array<lynx::cuda::device_bytes, 2> wrong{s0.bytes(),
                                                lynx::cuda::device_bytes{s1.data(), s1.size() - 4}};
  CHECK(error_message([&] {
          (void)lynx::cuda::encode_async<plan_8_4_4, 32, fp16>(workspace.data(), bytes, dv, dv, 0,
                                                               wrong);
        }).starts_with("invalid_argument|"));
}

TEST_CASE("device tensor rejects bad segments like the host tensor and stays unchanged") {
  const kv_shape shape{50, 2, 64};
  const std::vector<float> x = make_layer<float>(shape, data_kind::random, 21);
  const auto v = token_major<const float, host_space>(x.data(), shape);
  const auto enc = encode<plan_8_4_4, 32, float>(v, v, 3, {.generation = 2});
  const auto other_plan = encode<plan_16_4_12, 32, float>(v, v, 3, {.generation = 2});
  const auto other_layer = encode<plan_8_4_4, 32, float>(v, v, 4, {.generation = 2});
  const auto other_generation = encode<plan_8_4_4, 32, float>(v, v, 3, {.generation = 1});
  std::vector<float> x2 = x;
  x2[5] += 1.0f;
  const auto reencoded = encode<plan_8_4_4, 32, float>(
      token_major<const float, host_space>(x2.data(), shape),
      token_major<const float, host_space>(x2.data(), shape), 3, {.generation = 2});
  std::vector<std::byte> anchor(enc.segment(0).begin(), enc.segment(0).end());
  std::vector<std::byte> flipped = anchor;
  flipped[segment_header_bytes + 1000] ^= std::byte{0x10};
  std::vector<std::byte> magic = anchor;
  magic[0] ^= std::byte{1};
  const std::span<const std::byte> truncated(anchor.data(), anchor.size() - 1);

  bitplane_tensor<plan_8_4_4, 32, host_space> host(shape, 3, 2);
  bitplane_tensor<plan_8_4_4, 32, device_space> dev(shape, 3, 2);
  const auto both = [&](std::span<const std::byte> seg) {
    const std::string h = error_message([&] { host.accept(seg); });
    const std::string d = error_message([&] { dev.accept(seg); });
    CHECK(d == h);
    CHECK(dev.precision_level() == host.precision_level());
    return d;
  };
  CHECK(both(truncated).starts_with("truncated_segment|"));
  CHECK(both(flipped).starts_with("corrupted_segment|"));
  CHECK(both(magic).starts_with("bad_magic|"));
  CHECK(both(other_plan.segment(0)).starts_with("plan_mismatch|"));
  CHECK(both(other_layer.segment(0)).starts_with("layer_mismatch|"));
  CHECK(both(other_generation.segment(0)).starts_with("stale_generation|"));
  CHECK(dev.precision_level() == 0);
  // residual first, then anchor, then duplicates: same outcome as the host
  CHECK(dev.accept(enc.segment(1)) == accept_result::accepted);
  CHECK(dev.precision_level() == 0);
  CHECK(dev.accept(enc.segment(0)) == accept_result::accepted);
  CHECK(dev.precision_level() == 2);
  CHECK(dev.accept(enc.segment(0)) == accept_result::duplicate);
  host.accept(enc.segment(0));
  host.accept(enc.segment(1));
  CHECK(both(reencoded.segment(1))
            .starts_with("corrupted_segment|"));  // differs from the copy already received
  // accept_device validates through a host copy
  bitplane_tensor<plan_8_4_4, 32, device_space> dev2(shape, 3, 2);
  lynx::cuda::device_buffer on_device(anchor.size());
  LYNX_CUDA_CHECK(
      cudaMemcpy(on_device.data(), flipped.data(), flipped.size(), cudaMemcpyHostToDevice));
  CHECK(error_message([&] {
          dev2.accept_device(on_device.bytes());
        }).starts_with("corrupted_segment|"));
  CHECK(dev2.precision_level() == 0);
  LYNX_CUDA_CHECK(
      cudaMemcpy(on_device.data(), anchor.data(), anchor.size(), cudaMemcpyHostToDevice));
  CHECK(dev2.accept_device(on_device.bytes()) == accept_result::accepted);
  CHECK(dev2.precision_level() == 1);
  // the device copy holds exactly the validated payload
  std::vector<std::byte> back(static_cast<std::size_t>(dev2.geometry().payload_bytes(0)));
  LYNX_CUDA_CHECK(
      cudaMemcpy(back.data(), dev2.view().payload[0], back.size(), cudaMemcpyDeviceToHost));
  CHECK(std::memcmp(back.data(), anchor.data() + segment_header_bytes, back.size()) == 0);
}

TEST_CASE("device encode reports NaN and infinity with the host's coordinates") {
  const kv_shape shape{70, 3, 64};
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  struct bad {
    bool keys;
    std::int64_t t, h, c;
    float v;
  };
  const std::vector<std::vector<bad>> cases = {
      {{true, 40, 1, 5, nan}},
      {{false, 3, 2, 63, inf}},
      {{true, 69, 2, 0, -inf}, {false, 0, 0, 0, nan}},
      {{false, 10, 1, 40, nan}, {false, 10, 1, 33, inf}},
      {{true, 2, 0, 7, 3.0e38f}, {true, 3, 0, 7, -3.0e38f}},
      {{true, 2, 0, 7, 3.0e38f}, {true, 3, 0, 7, -3.0e38f}, {true, 31, 0, 60, nan}},
  };
  for (std::size_t k = 0; k < cases.size(); ++k) {
    CAPTURE(k);
    std::vector<float> keys = make_layer<float>(shape, data_kind::random, 31),
                       values = make_layer<float>(shape, data_kind::random, 32);
    for (const bad& b : cases[k])
      (b.keys ? keys : values)[static_cast<std::size_t>(
          (b.t * shape.kv_heads + b.h) * shape.head_dim + b.c)] = b.v;
    const std::string host = error_message([&] {
      (void)encode<plan_8_4_4, 32, float>(
          token_major<const float, host_space>(keys.data(), shape),
          token_major<const float, host_space>(values.data(), shape), 6);
    });
    device_array<float> dk(keys), dv(values);
    const std::string device = error_message([&] {
      (void)lynx::cuda::encode<plan_8_4_4, 32, float>(
          token_major<const float, device_space>(dk.data(), shape),
          token_major<const float, device_space>(dv.data(), shape), 6);
    });
    CHECK(device == host);
    CHECK(host != "no error");
  }
}
