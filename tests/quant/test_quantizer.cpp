// Tests of lynx/quant/quantizer.hpp: the group quantizer and the reconstruction
// from a prefix of planes, against a scalar fp64 reference written here.
//
// Error bound checked everywhere: with p of B planes present, the reconstruction
// lies within half a bin of width scale * 2^(B-p) of the input, where scale is the
// fp64 reference (max - min) / (2^B - 1), plus a float slack of
//     2^-20 * (|min| + range)
// Why that slack: the code is computed in float as round((x - zero) * inv_scale);
// x - zero, inv_scale = 1/scale and the product each round once (relative 2^-24),
// so t is off by at most ~3 * 2^-24 * 2^B bins, i.e. 3 * 2^-24 * range in value;
// scale itself is (hi - lo) / (2^B - 1) rounded twice (2 * 2^-24 * range over the
// 2^B codes); the final fma rounds once (2^-24 * |result| <= 2^-24 * (|min| + range)).
// The sum is below 8 * 2^-24 * (|min| + range) = 2^-21 * (...); we allow twice that.
#include <doctest/doctest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "lynx/planes/stream_plan.hpp"
#include "lynx/quant/quantizer.hpp"

namespace {

// Counter-based generator (splitmix64): same numbers on every standard library.
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  float uniform(float lo, float hi) { return static_cast<float>(lo + (hi - lo) * uniform()); }
};

struct group_reference {
  double lo = 0, hi = 0;
  [[nodiscard]] double range() const { return hi - lo; }
};

group_reference reference_of(const std::vector<float>& xs) {
  group_reference r{xs[0], xs[0]};
  for (float x : xs) {
    r.lo = std::min(r.lo, static_cast<double>(x));
    r.hi = std::max(r.hi, static_cast<double>(x));
  }
  return r;
}

double float_slack(const group_reference& r) { return 0x1.0p-20 * (std::fabs(r.lo) + r.range()); }

bool is_bf16_value(float x) { return (std::bit_cast<std::uint32_t>(x) & 0xffffu) == 0u; }

// Quantizes a group with the library's functions and checks the parameters (bf16
// values, zero at or below the minimum, bins covering the group), the code and
// every reconstruction from p = 1..B planes against the fp64 reference.
template <int B>
void check_group(const std::vector<float>& xs) {
  float lo = xs[0], hi = xs[0];
  for (float x : xs) {
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  const lynx::group_params p = lynx::make_group_params<B>(lo, hi);
  const group_reference ref = reference_of(xs);
  // zero: lo rounded down to bf16 (less than one bf16 step below it).
  REQUIRE(is_bf16_value(p.zero));
  REQUIRE(is_bf16_value(p.scale));
  REQUIRE(p.zero <= lo);
  // (bf16 subnormals are 2^-133 apart)
  REQUIRE(static_cast<double>(lo) - p.zero <=
          std::max(0x1.0p-7 * std::fabs(static_cast<double>(lo)), 0x1.0p-133));
  REQUIRE(!lynx::range_overflow(lo, hi));
  const double covered = static_cast<double>(hi) - p.zero;  // what the bins must span
  const float inv = lynx::inverse_scale<B>(p);
  if (static_cast<float>(hi - p.zero) < lynx::min_group_range) {
    // Constant (or range below 2^-100): scale 0, every code 0, reconstruction = zero.
    REQUIRE(p.scale == 0.0f);
    REQUIRE(inv == 0.0f);
    for (float x : xs) {
      REQUIRE(lynx::quantize_value<B>(x, p.zero, inv) == 0u);
      for (int planes = 1; planes <= B; ++planes) {
        const float r = lynx::reconstruct_value<B>(0u, planes, p);
        REQUIRE(r == p.zero);
        REQUIRE(std::fabs(static_cast<double>(r) - x) <= covered);
      }
    }
    return;
  }
  // scale: covered / (2^B - 1) rounded up to bf16 (8 significant bits): the bins
  // span the group and are at most 2^-7 wider than fp32 parameters would make them.
  const double scale_min = covered / static_cast<double>(lynx::max_code<B>);
  REQUIRE(static_cast<double>(p.scale) >= scale_min * (1.0 - 0x1.0p-22));
  REQUIRE(static_cast<double>(p.scale) <= scale_min * (1.0 + 0x1.0p-7));
  const double scale = p.scale;
  const double slack = float_slack(ref);
  for (float x : xs) {
    const std::uint32_t code = lynx::quantize_value<B>(x, p.zero, inv);
    REQUIRE(code <= lynx::max_code<B>);
    // fp64: code is the nearest level to (x - zero) / scale (up to the float slack).
    const double t = (static_cast<double>(x) - p.zero) / scale;
    REQUIRE(std::fabs(static_cast<double>(code) - t) <= 0.5 + slack / scale);
    for (int planes = 1; planes <= B; ++planes) {
      const int missing = B - planes;
      const std::uint32_t prefix = code >> missing;
      const float r = lynx::reconstruct_value<B>(prefix, planes, p);
      // The same value through the hot-loop form.
      const float level = static_cast<float>(prefix << missing) + lynx::midpoint_offset<B>(planes);
      REQUIRE(level == lynx::midpoint_level<B>(prefix, planes));
      REQUIRE(std::bit_cast<std::uint32_t>(lynx::reconstruct_from_level(level, p)) ==
              std::bit_cast<std::uint32_t>(r));
      // fma rounds once: r is the float nearest to zero + scale * level (computed exactly in
      // double: scale has 24 significant bits, level at most 17, so the product is exact).
      const double exact =
          static_cast<double>(p.zero) + static_cast<double>(p.scale) * static_cast<double>(level);
      const double spacing = static_cast<double>(std::nextafter(std::fabs(r), 3e38f)) -
                             std::fabs(static_cast<double>(r));
      REQUIRE(std::fabs(static_cast<double>(r) - exact) <= 0.5 * spacing);
      // Half a bin of width scale * 2^(B - planes) of the input.
      const double half_bin = 0.5 * scale * std::ldexp(1.0, missing);
      INFO("B=" << B << " planes=" << planes << " x=" << x << " code=" << code << " r=" << r);
      REQUIRE(std::fabs(static_cast<double>(r) - x) <= half_bin + slack);
    }
  }
}

// Random groups of various sizes, offsets and ranges, including the group's
// extremes sitting exactly on the min and max.
template <int B>
void check_random_groups(std::uint64_t seed, int groups) {
  splitmix64 rng{seed};
  for (int gi = 0; gi < groups; ++gi) {
    const int n = 1 + static_cast<int>(rng.next() % 64);
    const double magnitude =
        std::ldexp(1.0, static_cast<int>(rng.next() % 40) - 20);  // 2^-20 .. 2^19
    const double center = (rng.uniform() - 0.5) * magnitude * ((gi % 3 == 0) ? 1000.0 : 2.0);
    std::vector<float> xs(static_cast<std::size_t>(n));
    for (auto& x : xs) x = static_cast<float>(center + (rng.uniform() - 0.5) * magnitude);
    check_group<B>(xs);
  }
}

using plans = std::tuple<lynx::plan_8_4_4, lynx::plan_8_2_2_4, lynx::plan_16_4_12,
                         lynx::plan_16_4_4_8, lynx::plan_12_4_8>;

}  // namespace

TEST_CASE("round_small_nonnegative rounds half to even") {
  using lynx::detail::round_small_nonnegative;
  CHECK(round_small_nonnegative(0.0f) == 0.0f);
  CHECK(round_small_nonnegative(0.5f) == 0.0f);
  CHECK(round_small_nonnegative(1.5f) == 2.0f);
  CHECK(round_small_nonnegative(2.5f) == 2.0f);
  CHECK(round_small_nonnegative(2.5000002f) == 3.0f);
  CHECK(round_small_nonnegative(65534.5f) == 65534.0f);
  CHECK(round_small_nonnegative(65535.0f) == 65535.0f);
  CHECK(round_small_nonnegative(0.49999997f) == 0.0f);
  for (int i = 0; i < 70000; ++i) {
    const float x = static_cast<float>(i) * 0.25f;
    const float want = std::nearbyint(x);  // default rounding mode: to nearest even
    REQUIRE(round_small_nonnegative(x) == want);
  }
}

TEST_CASE(
    "group parameters: bf16 zero = min rounded down, bf16 scale = range / (2^B - 1) rounded up; "
    "tiny ranges are constant; overflow detected") {
  auto p8 = lynx::make_group_params<8>(-1.0f, 1.55f);
  CHECK(p8.zero == -1.0f);            // a bf16 value: kept
  CHECK(p8.scale == 0x1.48p-7f);      // 0.01 rounded up to 8 significant bits
  CHECK(p8.scale * 255.0f >= 2.55f);  // the bins cover the group
  CHECK(lynx::make_group_params<8>(0.3f, 1.0f).zero == 0x1.32p-2f);    // 0.3 rounded down
  CHECK(lynx::make_group_params<8>(-0.3f, 1.0f).zero == -0x1.34p-2f);  // -0.3 rounded down
  CHECK(lynx::bf16_round_down(-0.0f) == 0.0f);
  CHECK(std::signbit(lynx::bf16_round_down(-0.0f)));
  CHECK(lynx::bf16_round_up(0x1.0001p0f) == 0x1.02p0f);
  auto p16 = lynx::make_group_params<16>(0.0f, 65535.0f);
  CHECK(p16.scale == 1.0f);
  CHECK(lynx::inverse_scale<16>(p16) == 1.0f);
  CHECK(lynx::make_group_params<8>(3.0f, 3.0f).scale == 0.0f);
  CHECK(lynx::make_group_params<8>(0.0f, 0x1.0p-101f).scale == 0.0f);  // below min_group_range
  CHECK(lynx::make_group_params<8>(0.0f, 0x1.0p-100f).scale > 0.0f);   // at it: quantized
  CHECK(std::isnormal(
      lynx::make_group_params<16>(0.0f, 0x1.0p-100f).scale));  // every scale is a normal float
  CHECK(lynx::range_overflow(-3e38f, 3e38f));
  // the lowest floats round down past the lowest bf16: no zero point exists
  CHECK(lynx::range_overflow(-std::numeric_limits<float>::max(), 0.0f));
  CHECK(!lynx::range_overflow(-1e38f, 1e38f));
  CHECK(lynx::range_overflow(0.0f, std::numeric_limits<float>::infinity()));
  CHECK(lynx::range_overflow(std::numeric_limits<float>::quiet_NaN(), 0.0f));
  CHECK(lynx::is_finite_value(std::numeric_limits<float>::max()));
  CHECK(lynx::is_finite_value(-std::numeric_limits<float>::max()));
  CHECK(lynx::is_finite_value(std::numeric_limits<float>::denorm_min()));
  CHECK(lynx::is_finite_value(-0.0f));
  CHECK(!lynx::is_finite_value(std::numeric_limits<float>::infinity()));
  CHECK(!lynx::is_finite_value(-std::numeric_limits<float>::infinity()));
  CHECK(!lynx::is_finite_value(std::numeric_limits<float>::quiet_NaN()));
  CHECK(!lynx::is_finite_value(-std::numeric_limits<float>::quiet_NaN()));
}

TEST_CASE("quantize_value clamps to [0, 2^B - 1] and maps min and max to the end codes") {
  const auto p = lynx::make_group_params<8>(-2.0f, 3.0f);
  const float inv = lynx::inverse_scale<8>(p);
  CHECK(lynx::quantize_value<8>(-2.0f, p.zero, inv) == 0u);
  // 5 / 255 rounds up to a bf16 scale: the maximum lands within one code of the end
  CHECK(lynx::quantize_value<8>(3.0f, p.zero, inv) >= 254u);
  const auto exact = lynx::make_group_params<8>(-2.0f, 0.5f * 255.0f - 2.0f);  // scale 0.5
  CHECK(exact.scale == 0.5f);
  CHECK(lynx::quantize_value<8>(0.5f * 255.0f - 2.0f, exact.zero, lynx::inverse_scale<8>(exact)) ==
        255u);
  CHECK(lynx::quantize_value<8>(-5.0f, p.zero, inv) == 0u);     // below the group: clamped
  CHECK(lynx::quantize_value<8>(100.0f, p.zero, inv) == 255u);  // above: clamped
  const auto q = lynx::make_group_params<16>(-2.0f, 65535.0f * 0.25f - 2.0f);  // scale 0.25
  CHECK(lynx::quantize_value<16>(65535.0f * 0.25f - 2.0f, q.zero, lynx::inverse_scale<16>(q)) ==
        65535u);
}

TEST_CASE("midpoint reconstruction: the midpoint of the bins still possible") {
  // B = 8, 4 planes: prefix 0b1010 covers codes 160..175, midpoint 167.5.
  CHECK(lynx::midpoint_level<8>(0b1010u, 4) == 167.5f);
  CHECK(lynx::midpoint_offset<8>(4) == 7.5f);
  CHECK(lynx::midpoint_offset<8>(8) == 0.0f);
  CHECK(lynx::midpoint_offset<16>(4) == 2047.5f);
  CHECK(lynx::midpoint_level<16>(0xffffu, 16) == 65535.0f);
  CHECK(lynx::midpoint_level<12>(1u, 1) == 2048.0f + 1023.5f);
  const lynx::group_params p{0.5f, -1.0f};
  CHECK(lynx::reconstruct_value<8>(0b1010u, 4, p) == -1.0f + 0.5f * 167.5f);
}

TEST_CASE_TEMPLATE_DEFINE(
    "reconstruction at every precision level is within half a bin of the fp64 reference", Plan,
    reference_id) {
  constexpr int B = Plan::bits;
  // Every level of the plan is among p = 1..B, which check_group covers; make sure of it.
  for (int level = 1; level <= Plan::streams; ++level) {
    CHECK(Plan::planes_at_level(level) >= 1);
    CHECK(Plan::planes_at_level(level) <= B);
  }
  check_random_groups<B>(0x1234 + B, 1500);
  // Adversarial groups: an outlier, denormals next to normals, negative only, mixed signs of zero.
  check_group<B>({0.0f, 1e4f, -0.5f, 0.25f, 1e-3f});
  check_group<B>({1e-40f, 1.0f, -1e-42f, 0.5f});
  check_group<B>({-7.0f, -6.5f, -6.999f, -6.0001f});
  check_group<B>({-0.0f, 0.0f, 1.0f, -0.0f});
  check_group<B>({1000.0f, 1000.0001f, 1000.00006f});  // range near the float spacing of the values
  check_group<B>({-1.5e38f, 1.5e38f, 0.0f});           // range close to the float maximum
}
TEST_CASE_TEMPLATE_APPLY(reference_id, plans);

TEST_CASE_TEMPLATE_DEFINE(
    "constant, denormal-only and signed-zero groups: scale 0, codes 0, reconstruction = zero point",
    Plan, constant_id) {
  constexpr int B = Plan::bits;
  check_group<B>({2.5f, 2.5f, 2.5f});
  check_group<B>({-1e-30f});                                // one element
  check_group<B>({0.0f, -0.0f, 0.0f, -0.0f});               // +0 and -0 compare equal: constant
  check_group<B>({1e-45f, 3e-45f, -1e-45f, 1e-40f, 0.0f});  // only denormals: range < 2^-100
  check_group<B>(
      {std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()});
  const auto p = lynx::make_group_params<B>(-0.0f, 0.0f);
  CHECK(p.scale == 0.0f);
  for (int planes = 1; planes <= B; ++planes)
    CHECK(lynx::reconstruct_value<B>(0u, planes, p) == 0.0f);
}
TEST_CASE_TEMPLATE_APPLY(constant_id, plans);

TEST_CASE_TEMPLATE_DEFINE("anchor-only reconstruction is unbiased", Plan, unbiased_id) {
  // 10^5 groups of 32 values near zero (uniform in [-a, a), a random per group).
  // Error of each element in units of the anchor's bin width w = scale * 2^(B - p):
  // if an element's position inside its bin is uniform, the error is uniform on
  // [-1/2, 1/2), sigma = 1/sqrt(12). A group's mean error has at most that sigma
  // (averaging does not raise it), so over n groups the grand mean is within
  // 4 sigma / sqrt(n) of 0 unless reconstruction is biased. The seed is fixed, so
  // the outcome is deterministic; with a fresh seed an unbiased reconstruction
  // would cross a 4-sigma bound by chance less than once in 15,000 runs.
  constexpr int B = Plan::bits;
  const int anchor_planes = Plan::planes_at_level(1);
  const int missing = B - anchor_planes;
  constexpr int groups = 100000, group_size = 32;
  splitmix64 rng{0xb1a5 + static_cast<std::uint64_t>(anchor_planes)};
  double sum_midpoint = 0, sum_truncated = 0;
  std::array<float, group_size> xs{};
  for (int g = 0; g < groups; ++g) {
    const float a = rng.uniform(0.01f, 4.0f);
    float lo = 0, hi = 0;
    for (int i = 0; i < group_size; ++i) {
      xs[static_cast<std::size_t>(i)] = rng.uniform(-a, a);
      lo = i == 0 || xs[static_cast<std::size_t>(i)] < lo ? xs[static_cast<std::size_t>(i)] : lo;
      hi = i == 0 || xs[static_cast<std::size_t>(i)] > hi ? xs[static_cast<std::size_t>(i)] : hi;
    }
    const lynx::group_params p = lynx::make_group_params<B>(lo, hi);
    const float inv = lynx::inverse_scale<B>(p);
    const double w = (static_cast<double>(hi) - lo) / lynx::max_code<B> * std::ldexp(1.0, missing);
    double group_midpoint = 0, group_truncated = 0;
    for (float x : xs) {
      const std::uint32_t prefix = lynx::quantize_value<B>(x, p.zero, inv) >> missing;
      group_midpoint +=
          (static_cast<double>(lynx::reconstruct_value<B>(prefix, anchor_planes, p)) - x) / w;
      // Negative control: the bin's lower edge instead of its midpoint is biased by about -1/2 bin.
      group_truncated +=
          (static_cast<double>(p.zero) +
           static_cast<double>(p.scale) * static_cast<double>(prefix << missing) - x) /
          w;
    }
    sum_midpoint += group_midpoint / group_size;
    sum_truncated += group_truncated / group_size;
  }
  const double sigma = 1.0 / std::sqrt(12.0);
  const double bound = 4.0 * sigma / std::sqrt(static_cast<double>(groups));  // ~0.0037 bins
  const double mean = sum_midpoint / groups;
  INFO("plan " << Plan::name() << ": mean anchor-only error " << mean << " bins, bound " << bound);
  CHECK(std::fabs(mean) < bound);
  // The bound is tight enough to see the bias of a reconstruction without the midpoint.
  CHECK(std::fabs(sum_truncated / groups) > 100 * bound);
}
TEST_CASE_TEMPLATE_APPLY(unbiased_id, plans);
