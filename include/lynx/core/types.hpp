// Element types of KV tensors: bf16 and fp16 storage types usable on the host,
// bit-compatible with CUDA's __nv_bfloat16 and __half (one 16-bit word, same
// bit layout), so an engine's device buffers can be viewed as lynx types.
// Conversions are written once, as bit manipulation, for host and device.
#pragma once

#include <bit>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "lynx/core/config.hpp"

namespace lynx {

namespace detail {

LYNX_HOST_DEVICE std::uint32_t float_bits(float x) {
#if LYNX_DEVICE_CODE
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}

LYNX_HOST_DEVICE float bits_float(std::uint32_t b) {
#if LYNX_DEVICE_CODE
  return __uint_as_float(b);
#else
  return std::bit_cast<float>(b);
#endif
}

// float -> bf16 with round-to-nearest-even; NaN stays NaN (quiet bit set).
LYNX_HOST_DEVICE std::uint16_t float_to_bf16_bits(float x) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

LYNX_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

// IEEE binary16 -> binary32, exact (every half is a float).
LYNX_HOST_DEVICE float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // zero or subnormal: mantissa * 2^-24, exact in float
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
  return sign ? -magnitude : magnitude;
}

// IEEE binary32 -> binary16, round-to-nearest-even, overflow to infinity.
LYNX_HOST_DEVICE std::uint16_t float_to_fp16_bits(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  if (magnitude >= 0x477ff000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (magnitude < 0x38800000u) {
    // result is subnormal or zero: value / 2^-24 rounded to nearest even
    const std::uint32_t exponent = magnitude >> 23;
    if (exponent < 102u) return sign;  // below half of the smallest subnormal
    const std::uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14 + (112 - exponent) ... aligns to 2^-24 units
    const std::uint32_t truncated = mantissa >> shift;
    const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    const std::uint32_t rounded =
        truncated + ((remainder > halfway || (remainder == halfway && (truncated & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  // normal: rebias exponent, round the 13 dropped mantissa bits to nearest even
  const std::uint32_t rebased = magnitude - (112u << 23);
  const std::uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

}  // namespace detail

/// bfloat16 storage: 1 sign, 8 exponent, 7 mantissa bits. Arithmetic happens in float.
struct alignas(2) bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  LYNX_HOST_DEVICE explicit bf16(float x) : bits(detail::float_to_bf16_bits(x)) {}
  LYNX_HOST_DEVICE explicit operator float() const { return detail::bf16_bits_to_float(bits); }
  LYNX_HOST_DEVICE static bf16 from_bits(std::uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
  friend LYNX_HOST_DEVICE bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

/// IEEE binary16 storage: 1 sign, 5 exponent, 10 mantissa bits.
struct alignas(2) fp16 {
  std::uint16_t bits = 0;

  fp16() = default;
  LYNX_HOST_DEVICE explicit fp16(float x) : bits(detail::float_to_fp16_bits(x)) {}
  LYNX_HOST_DEVICE explicit operator float() const { return detail::fp16_bits_to_float(bits); }
  LYNX_HOST_DEVICE static fp16 from_bits(std::uint16_t b) {
    fp16 r;
    r.bits = b;
    return r;
  }
  friend LYNX_HOST_DEVICE bool operator==(fp16 a, fp16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);
static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable_v<fp16>);

/// The element types a KV view may hold.
template <class T>
concept kv_element = std::same_as<T, float> || std::same_as<T, bf16> || std::same_as<T, fp16>;

template <kv_element T>
LYNX_HOST_DEVICE float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(x);
  }
}

template <kv_element T>
LYNX_HOST_DEVICE T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T(x);
  }
}

/// Element type tags on the wire (segment header) and in messages.
enum class element_kind : std::uint8_t { f32 = 0, bf16 = 1, f16 = 2 };

template <kv_element T>
constexpr element_kind element_kind_of() {
  if constexpr (std::is_same_v<T, float>)
    return element_kind::f32;
  else if constexpr (std::is_same_v<T, bf16>)
    return element_kind::bf16;
  else
    return element_kind::f16;
}

template <kv_element T>
constexpr const char* element_name() {
  if constexpr (std::is_same_v<T, float>)
    return "f32";
  else if constexpr (std::is_same_v<T, bf16>)
    return "bf16";
  else
    return "f16";
}

}  // namespace lynx
