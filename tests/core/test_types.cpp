// Tests of lynx/core: bf16/fp16 storage types and their conversions, errors,
// strided KV views, and the runtime -> compile-time dispatch helper.
//
// Conversions are checked against an independent reference written here in
// double: the nearest representable value, ties to the even significand, found
// by search among the target type's values (not by the bit tricks under test).
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/core/dispatch.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define LYNX_TEST_HAVE_F16C 1
#else
#define LYNX_TEST_HAVE_F16C 0
#endif

namespace {

float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t to_bits(float x) { return std::bit_cast<std::uint32_t>(x); }

// Exact value of an fp16 bit pattern, from its fields (finite patterns only).
double fp16_value(std::uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const double magnitude = exponent == 0 ? std::ldexp(static_cast<double>(mantissa), -24)
                                         : std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  return sign ? -magnitude : magnitude;
}

// Reference float -> fp16: nearest of the finite fp16 values, ties to even;
// values at or beyond 65520 (half-way from 65504 to the next power 65536) overflow to inf.
std::uint16_t fp16_reference(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0;  // not used for NaN
  const double a = std::fabs(static_cast<double>(x));
  // positive patterns 0 .. 0x7bff are increasing; 0x7c00 stands for 65536 while rounding
  auto value = [](std::uint32_t k) {
    return k == 0x7c00 ? 65536.0 : fp16_value(static_cast<std::uint16_t>(k));
  };
  if (a >= 65536.0) return static_cast<std::uint16_t>(sign | 0x7c00);
  std::uint32_t lo = 0, hi = 0x7c00;  // invariant: value(lo) <= a < value(hi)
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    (value(mid) <= a ? lo : hi) = mid;
  }
  const double below = a - value(lo), above = value(hi) - a;
  const std::uint32_t k = below < above ? lo : above < below ? hi : ((lo & 1u) ? hi : lo);
  return static_cast<std::uint16_t>(sign | k);
}

// Reference float -> bf16: the two bf16 neighbours are the float truncated to its
// top 16 bits and the next pattern up in magnitude (0x7f80 standing for 2^128).
std::uint16_t bf16_reference(float x) {
  const std::uint32_t u = to_bits(x);
  const std::uint32_t sign = u & 0x80000000u, magnitude = u & 0x7fffffffu;
  const std::uint32_t lo = magnitude & 0xffff0000u, hi = lo + 0x10000u;
  auto value = [](std::uint32_t bits) {
    return bits == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(from_bits(bits));
  };
  const double a = static_cast<double>(from_bits(magnitude));
  const double below = a - value(lo), above = value(hi) - a;
  const std::uint32_t pick = below < above   ? lo
                             : above < below ? hi
                                             : (((lo >> 16) & 1u) ? hi : lo);
  return static_cast<std::uint16_t>((sign | pick) >> 16);
}

// Floats to test conversions on: a stride through all bit patterns, plus every
// midpoint between adjacent fp16 values and its two float neighbours (where
// round-to-nearest-even decides), plus the special values.
std::vector<float> conversion_samples() {
  std::vector<float> xs;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4093)
    xs.push_back(from_bits(static_cast<std::uint32_t>(u)));
  for (std::uint32_t k = 0; k < 0x7bff; ++k) {
    const double mid = (fp16_value(static_cast<std::uint16_t>(k)) +
                        fp16_value(static_cast<std::uint16_t>(k + 1))) /
                       2;
    const float m = static_cast<float>(mid);
    REQUIRE(static_cast<double>(m) ==
            mid);  // fp16 midpoints have 12 significant bits: exact in float
    for (float v : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e30f)}) {
      xs.push_back(v);
      xs.push_back(-v);
    }
  }
  // bf16 midpoints: a float whose low 16 bits are exactly 0x8000, and its neighbours
  for (std::uint32_t hi = 0; hi < 0x7f80; hi += 7) {
    const std::uint32_t m = (hi << 16) | 0x8000u;
    for (std::uint32_t v : {m, m - 1, m + 1}) {
      xs.push_back(from_bits(v));
      xs.push_back(from_bits(v | 0x80000000u));
    }
  }
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            65504.0f,
                            65519.996f,
                            65520.0f,
                            65536.0f,
                            1e30f,
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::denorm_min(),
                            5.9604644775390625e-08f /* 2^-24 */,
                            2.98023223876953125e-08f /* 2^-25 */,
                            2.9802326e-08f,
                            6.103515625e-05f /* 2^-14 */,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (float s : specials) {
    xs.push_back(s);
    xs.push_back(-s);
  }
  return xs;
}

#if LYNX_TEST_HAVE_F16C
__attribute__((target("f16c"))) std::uint16_t fp16_hardware(float x) {
  return static_cast<std::uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
__attribute__((target("f16c"))) float fp16_hardware_to_float(std::uint16_t h) {
  return _cvtsh_ss(h);
}
// CPUID leaf 1 directly: clang 14's __builtin_cpu_supports does not know "f16c".
bool have_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & bit_F16C) != 0 && (ecx & bit_AVX) != 0 && (ecx & bit_OSXSAVE) != 0;
}
#endif

}  // namespace

TEST_CASE("bf16 and fp16 are 16-bit trivially copyable words, bit-compatible with CUDA's types") {
  static_assert(sizeof(lynx::bf16) == 2 && alignof(lynx::bf16) == 2);
  static_assert(sizeof(lynx::fp16) == 2 && alignof(lynx::fp16) == 2);
  static_assert(std::is_trivially_copyable_v<lynx::bf16> && std::is_standard_layout_v<lynx::bf16>);
  static_assert(std::is_trivially_copyable_v<lynx::fp16> && std::is_standard_layout_v<lynx::fp16>);
  static_assert(lynx::kv_element<float> && lynx::kv_element<lynx::bf16> &&
                lynx::kv_element<lynx::fp16>);
  static_assert(!lynx::kv_element<double> && !lynx::kv_element<std::uint16_t>);
  // Known patterns (the same as __float2bfloat16_rn / __float2half_rn).
  CHECK(lynx::bf16(1.0f).bits == 0x3f80);
  CHECK(lynx::bf16(-2.0f).bits == 0xc000);
  CHECK(lynx::bf16(3.140625f).bits == 0x4049);
  CHECK(lynx::fp16(1.0f).bits == 0x3c00);
  CHECK(lynx::fp16(-2.0f).bits == 0xc000);
  CHECK(lynx::fp16(65504.0f).bits == 0x7bff);
  CHECK(lynx::fp16(5.9604644775390625e-08f).bits == 0x0001);
  CHECK(lynx::fp16(0.0f).bits == 0x0000);
  CHECK(lynx::fp16(-0.0f).bits == 0x8000);
  CHECK(lynx::bf16(-0.0f).bits == 0x8000);
  // Storage is the bits, nothing else: memcpy of an array of words is an array of values.
  const std::uint16_t words[3] = {0x3f80, 0x4000, 0xbf80};
  lynx::bf16 values[3];
  std::memcpy(values, words, sizeof words);
  CHECK(static_cast<float>(values[0]) == 1.0f);
  CHECK(static_cast<float>(values[1]) == 2.0f);
  CHECK(static_cast<float>(values[2]) == -1.0f);
  CHECK(lynx::bf16::from_bits(0x4000) == lynx::bf16(2.0f));
  CHECK(lynx::fp16::from_bits(0x4000) == lynx::fp16(2.0f));
  CHECK(lynx::element_kind_of<float>() == lynx::element_kind::f32);
  CHECK(lynx::element_kind_of<lynx::bf16>() == lynx::element_kind::bf16);
  CHECK(lynx::element_kind_of<lynx::fp16>() == lynx::element_kind::f16);
  CHECK(std::string(lynx::element_name<lynx::bf16>()) == "bf16");
}

TEST_CASE(
    "bf16 -> float is exact for all 65536 patterns; float -> bf16 -> float round-trips every "
    "bf16") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(lynx::bf16::from_bits(bits));
    REQUIRE(to_bits(f) == (b << 16));
    const lynx::bf16 back(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(static_cast<float>(back)));
      REQUIRE((back.bits & 0x8000) == (bits & 0x8000));  // sign kept
      REQUIRE((back.bits & 0x0040) != 0);                // quiet NaN
    } else {
      REQUIRE(back.bits == bits);
    }
  }
}

TEST_CASE(
    "float -> bf16 rounds to nearest, ties to even, like the reference; NaN stays NaN, overflow "
    "goes to inf") {
  const std::vector<float> xs = conversion_samples();
  std::size_t checked = 0;
  for (float x : xs) {
    const lynx::bf16 got(x);
    if (std::isnan(x)) {
      REQUIRE(std::isnan(static_cast<float>(got)));
      continue;
    }
    INFO("x = " << x << " (bits 0x" << std::hex << to_bits(x) << ")");
    REQUIRE(got.bits == bf16_reference(x));
    ++checked;
  }
  CHECK(checked > 1000000);
  // Every NaN pattern (signalling ones included) converts to a NaN of the same sign.
  for (std::uint32_t payload :
       {0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0xff800001u, 0x7f800100u, 0x7f810000u}) {
    const lynx::bf16 n(from_bits(payload));
    CHECK(std::isnan(static_cast<float>(n)));
    CHECK((n.bits >> 15) == (payload >> 31));
  }
  CHECK(lynx::bf16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(lynx::bf16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
  CHECK(lynx::bf16(std::numeric_limits<float>::max()).bits ==
        0x7f80);                                             // rounds up past the largest bf16
  CHECK(lynx::bf16(from_bits(0x7f7f7fffu)).bits == 0x7f7f);  // just below the half-way point
  // Subnormal floats round to bf16 subnormals (same exponent range as float).
  CHECK(lynx::bf16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  CHECK(lynx::bf16(from_bits(0x00008000u)).bits == 0x0000);  // tie, even is 0
  CHECK(lynx::bf16(from_bits(0x00018000u)).bits == 0x0002);  // tie, even is 2
  CHECK(lynx::bf16(from_bits(0x00008001u)).bits == 0x0001);
}

TEST_CASE("fp16: exhaustive 65536 fp16 -> float -> fp16 round trip, and fp16 -> float exact") {
#if LYNX_TEST_HAVE_F16C
  const bool hardware = have_f16c();
#endif
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(lynx::fp16::from_bits(bits));
    const bool is_nan = ((bits >> 10) & 0x1f) == 0x1f && (bits & 0x3ff) != 0;
    const bool is_inf = ((bits >> 10) & 0x1f) == 0x1f && (bits & 0x3ff) == 0;
    INFO("fp16 bits 0x" << std::hex << b);
    if (is_nan) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::signbit(f) == ((bits & 0x8000) != 0));
      const lynx::fp16 back(f);
      REQUIRE(((back.bits >> 10) & 0x1f) == 0x1f);
      REQUIRE((back.bits & 0x3ff) != 0);                 // still NaN
      REQUIRE((back.bits & 0x8000) == (bits & 0x8000));  // same sign
      REQUIRE((back.bits & 0x0200) != 0);                // quiet
      continue;
    }
    if (is_inf) {
      REQUIRE(std::isinf(f));
      REQUIRE(std::signbit(f) == ((bits & 0x8000) != 0));
    } else {
      REQUIRE(static_cast<double>(f) == fp16_value(bits));  // exact value, subnormals included
      REQUIRE(std::signbit(f) == ((bits & 0x8000) != 0));   // -0 stays -0
    }
    REQUIRE(lynx::fp16(f).bits == bits);
#if LYNX_TEST_HAVE_F16C
    if (hardware) REQUIRE(to_bits(fp16_hardware_to_float(bits)) == to_bits(f));
#endif
  }
}

TEST_CASE("float -> fp16 rounds to nearest, ties to even, subnormals and overflow included") {
  const std::vector<float> xs = conversion_samples();
#if LYNX_TEST_HAVE_F16C
  const bool hardware = have_f16c();
#endif
  for (float x : xs) {
    const lynx::fp16 got(x);
    if (std::isnan(x)) {
      const float back = static_cast<float>(got);
      REQUIRE(std::isnan(back));
      REQUIRE(std::signbit(back) == std::signbit(x));
      continue;
    }
    INFO("x = " << x << " (bits 0x" << std::hex << to_bits(x) << ")");
    REQUIRE(got.bits == fp16_reference(x));
#if LYNX_TEST_HAVE_F16C
    if (hardware) REQUIRE(got.bits == fp16_hardware(x));
#endif
  }
  CHECK(lynx::fp16(65519.996f).bits == 0x7bff);
  CHECK(lynx::fp16(65520.0f).bits == 0x7c00);  // the tie rounds to even, which is 2^16: inf
  CHECK(lynx::fp16(-1e30f).bits == 0xfc00);
  CHECK(lynx::fp16(2.98023223876953125e-08f).bits ==
        0x0000);                                     // 2^-25: tie between 0 and 2^-24, even is 0
  CHECK(lynx::fp16(2.9802326e-08f).bits == 0x0001);  // just above the tie
  CHECK(lynx::fp16(8.940697e-08f).bits == 0x0002);   // 1.5 * 2^-24: tie, even is 2
  CHECK(lynx::fp16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  CHECK(lynx::fp16(-std::numeric_limits<float>::denorm_min()).bits == 0x8000);
}

TEST_CASE("to_float / from_float agree with the storage types' conversions") {
  CHECK(lynx::to_float(2.5f) == 2.5f);
  CHECK(lynx::from_float<float>(2.5f) == 2.5f);
  CHECK(lynx::from_float<lynx::bf16>(1.00390625f).bits == lynx::bf16(1.00390625f).bits);
  CHECK(lynx::to_float(lynx::fp16::from_bits(0x3555)) ==
        static_cast<float>(lynx::fp16::from_bits(0x3555)));
}

TEST_CASE("lynx::error carries a code and a message naming it") {
  using lynx::errc;
  const errc all[] = {errc::ok,
                      errc::invalid_argument,
                      errc::shape_mismatch,
                      errc::non_finite_input,
                      errc::plan_mismatch,
                      errc::layer_mismatch,
                      errc::truncated_segment,
                      errc::corrupted_segment,
                      errc::bad_magic,
                      errc::unsupported_version,
                      errc::stale_generation,
                      errc::out_of_memory,
                      errc::transport_failure,
                      errc::timeout,
                      errc::peer_failure,
                      errc::cuda_error,
                      errc::internal};
  std::vector<std::string> names;
  for (errc c : all) {
    const std::string name(lynx::to_string(c));
    CHECK(name != "unknown");
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  CHECK(std::adjacent_find(names.begin(), names.end()) ==
        names.end());  // every code has its own name

  const lynx::error e(errc::shape_mismatch, "K is [1, 2, 3]");
  CHECK(e.code() == errc::shape_mismatch);
  CHECK(std::string(e.what()) == "lynx: shape_mismatch: K is [1, 2, 3]");
  const std::runtime_error& base = e;  // catchable as a standard exception
  CHECK(std::string(base.what()).find("K is") != std::string::npos);

  CHECK_NOTHROW(lynx::detail::require(true, errc::internal, "never"));
  try {
    lynx::detail::require(false, errc::layer_mismatch, "layer 3 vs 4");
    FAIL("require(false) did not throw");
  } catch (const lynx::error& err) {
    CHECK(err.code() == errc::layer_mismatch);
    CHECK(std::string(err.what()).find("layer 3 vs 4") != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("token-major, head-major and strided views address the same elements", T, float,
                   lynx::bf16, lynx::fp16) {
  const lynx::kv_shape shape{5, 3, 8};
  CHECK(shape.elements() == 120);
  CHECK(lynx::to_string(shape) == "[tokens=5, kv_heads=3, head_dim=8]");
  auto value = [](std::int64_t t, std::int64_t h, std::int64_t c) {
    return static_cast<float>(t * 32 + h * 8 + c);
  };  // < 256: exact in bf16 and fp16
  std::vector<T> token_major_data(static_cast<std::size_t>(shape.elements()));
  std::vector<T> head_major_data(token_major_data.size());
  std::vector<T> strided_data(token_major_data.size() *
                              3);  // channel stride 3, heads and tokens outermost
  for (std::int64_t t = 0; t < shape.tokens; ++t)
    for (std::int64_t h = 0; h < shape.kv_heads; ++h)
      for (std::int64_t c = 0; c < shape.head_dim; ++c) {
        token_major_data[static_cast<std::size_t>((t * shape.kv_heads + h) * shape.head_dim + c)] =
            lynx::from_float<T>(value(t, h, c));
        head_major_data[static_cast<std::size_t>((h * shape.tokens + t) * shape.head_dim + c)] =
            lynx::from_float<T>(value(t, h, c));
        strided_data[static_cast<std::size_t>(((h * shape.tokens + t) * shape.head_dim + c) * 3)] =
            lynx::from_float<T>(value(t, h, c));
      }
  const auto tm = lynx::token_major(token_major_data.data(), shape);
  const auto hm = lynx::head_major(head_major_data.data(), shape);
  const lynx::kv_view<T> strided{strided_data.data(), shape, shape.head_dim * 3,
                                 shape.tokens * shape.head_dim * 3, 3};
  CHECK(tm.token_stride == 24);
  CHECK(tm.head_stride == 8);
  CHECK(hm.token_stride == 8);
  CHECK(hm.head_stride == 40);
  CHECK(tm.channels_contiguous());
  CHECK(!strided.channels_contiguous());
  for (std::int64_t t = 0; t < shape.tokens; ++t)
    for (std::int64_t h = 0; h < shape.kv_heads; ++h)
      for (std::int64_t c = 0; c < shape.head_dim; ++c) {
        REQUIRE(lynx::to_float(tm(t, h, c)) == value(t, h, c));
        REQUIRE(lynx::to_float(hm(t, h, c)) == value(t, h, c));
        REQUIRE(lynx::to_float(strided(t, h, c)) == value(t, h, c));
      }
  // A view converts to its const view, same addressing; writes through a view land in the buffer.
  const lynx::kv_view<const T> ctm = tm;
  CHECK(&ctm(4, 2, 7) == &token_major_data.back());
  hm(1, 2, 3) = lynx::from_float<T>(-7.0f);
  CHECK(lynx::to_float(head_major_data[static_cast<std::size_t>((2 * 5 + 1) * 8 + 3)]) == -7.0f);
}

TEST_CASE("aligned_buffer is 64-byte aligned and copies deeply") {
  lynx::aligned_buffer a(100);
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 64 == 0);
  CHECK(a.size() == 100);
  a.zero();
  a.data()[7] = std::byte{42};
  lynx::aligned_buffer b = a;
  CHECK(b.data() != a.data());
  CHECK(std::memcmp(a.data(), b.data(), 100) == 0);
  b.data()[7] = std::byte{1};
  CHECK(a.data()[7] == std::byte{42});
  lynx::aligned_buffer empty;
  CHECK(empty.size() == 0);
  CHECK(empty.data() == nullptr);
}

TEST_CASE("dispatch turns a runtime value into a compile-time one, and rejects others") {
  const int bits = lynx::dispatch<8, 12, 16>(12, []<int B>() { return B * 2; });
  CHECK(bits == 24);
  int seen = 0;
  lynx::dispatch<8, 12, 16>(16, [&]<int B>() { seen = B; });
  CHECK(seen == 16);
  try {
    (void)lynx::dispatch<8, 12, 16>(10, []<int B>() { return B; });
    FAIL("dispatch accepted 10");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::invalid_argument);
    CHECK(std::string(e.what()).find("10") != std::string::npos);
  }
  auto dispatch_zero = [&] { lynx::dispatch<4, 8>(0, [&]<int B>() { seen = B; }); };
  CHECK_THROWS_AS(dispatch_zero(), lynx::error);
  CHECK(seen == 16);  // nothing ran for the rejected value
}
