// The group quantizer: pure math, one source for host and device.
//
// Asymmetric uniform quantization of a group to B-bit codes. Scale and zero
// point travel as bf16 (2 bytes each on the wire), so they are chosen as bf16
// values first and the codes are computed with exactly those values:
//   zero  = min rounded down to bf16 (toward -inf),
//   scale = ((max - zero) / (2^B - 1)) rounded up to bf16 (toward +inf),
//   code  = clamp(round((x - zero) / scale), 0, 2^B - 1)      (round half to even)
// Rounding outward keeps [min, max] inside [zero, zero + scale (2^B - 1)]: the
// bins cover the group, at most about 2^-8 of the range wider than with fp32
// parameters (bf16 keeps 8 significant bits).
// Reconstruction from the p most significant planes of a code uses the midpoint
// of the bins still possible (unbiased, error at most half a bin of width
// scale * 2^(B-p)):
//   x = fma(scale, (c_p << (B-p)) + (2^(B-p) - 1) / 2, zero)
#pragma once

#include <cmath>
#include <cstdint>

#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"

namespace lynx {

/// Quantization parameters of one group, as they travel in the anchor segment.
struct group_params {
  float scale = 0.0f;  // width of one bin at full precision; 0 for a constant group
  float zero = 0.0f;   // value of code 0 (the group minimum)
};

/// A group whose range is below this is treated as constant (scale 0): far below
/// anything a model's KV holds, and it keeps every scale a normal float.
inline constexpr float min_group_range = 7.8886090522101181e-31f;  // 2^-100

template <int Bits>
inline constexpr std::uint32_t max_code = (1u << Bits) - 1u;

namespace detail {

LYNX_HOST_DEVICE float fused_multiply_add(float a, float b, float c) {
#if LYNX_DEVICE_CODE
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Round half to even for 0 <= t < 2^23 without a libm call: adding and subtracting
// 2^23 leaves the rounding to the FPU (default rounding mode), so it vectorizes
// on every target and gives the same bits on host and device.
LYNX_HOST_DEVICE float round_small_nonnegative(float t) {
  constexpr float two_23 = 8388608.0f;
#if LYNX_DEVICE_CODE
  return __fsub_rn(__fadd_rn(t, two_23), two_23);
#else
  return (t + two_23) - two_23;
#endif
}

}  // namespace detail

/// x rounded down (toward -inf) to a bf16 value, as a float; x finite. A value
/// below the lowest finite bf16 becomes -inf (range_overflow then reports it).
LYNX_HOST_DEVICE float bf16_round_down(float x) {
  const std::uint32_t u = detail::float_bits(x);
  std::uint32_t t = u & 0xffff0000u;
  if ((u & 0xffffu) != 0u && (u >> 31) != 0u) t += 0x10000u;  // negative: away from zero
  return detail::bits_float(t);
}

/// x >= 0 rounded up (toward +inf) to a bf16 value, as a float.
LYNX_HOST_DEVICE float bf16_round_up(float x) {
  const std::uint32_t u = detail::float_bits(x);
  std::uint32_t t = u & 0xffff0000u;
  if ((u & 0xffffu) != 0u) t += 0x10000u;
  return detail::bits_float(t);
}

/// Parameters of a group from its minimum and maximum (both finite), both bf16
/// values (see the top of this file). The caller rejects non-finite input
/// before; a range that overflows is reported by `range_overflow` below.
template <int Bits>
LYNX_HOST_DEVICE group_params make_group_params(float lo, float hi) {
  group_params p;
  p.zero = bf16_round_down(lo);
  const float range = hi - p.zero;
  p.scale =
      (range >= min_group_range) ? bf16_round_up(range / static_cast<float>(max_code<Bits>)) : 0.0f;
  return p;
}

/// True when max - zero (the zero point of make_group_params) is not a finite
/// float: such a group cannot be quantized.
LYNX_HOST_DEVICE bool range_overflow(float lo, float hi) {
  const float range = hi - bf16_round_down(lo);
  return !(range <= 3.4028234663852886e38f);
}

/// Reciprocal used by `quantize_value`: (2^B-1)/range, or 0 for a constant group.
/// Multiplying by it instead of dividing by scale is what lets encode vectorize;
/// the code can differ from exact division by one step only at a bin edge, which
/// keeps the reconstruction within half a bin (plus float rounding).
template <int Bits>
LYNX_HOST_DEVICE float inverse_scale(group_params p) {
  return p.scale > 0.0f ? 1.0f / p.scale : 0.0f;
}

/// code = clamp(round((x - zero) * inverse_scale), 0, 2^B-1)
template <int Bits>
LYNX_HOST_DEVICE std::uint32_t quantize_value(float x, float zero, float inv_scale) {
  float t = (x - zero) * inv_scale;
  t = t > 0.0f ? t : 0.0f;
  t = t < static_cast<float>(max_code<Bits>) ? t : static_cast<float>(max_code<Bits>);
  return static_cast<std::uint32_t>(detail::round_small_nonnegative(t));
}

/// Midpoint level of the bins still possible when `planes` of `Bits` planes are
/// present and the top planes read `prefix_code` (a planes-bit number).
template <int Bits>
LYNX_HOST_DEVICE float midpoint_level(std::uint32_t prefix_code, int planes) {
  const int missing = Bits - planes;
  const float half = static_cast<float>((1u << missing) - 1u) * 0.5f;
  return static_cast<float>(prefix_code << missing) + half;
}

/// Reconstruction of one element from the top `planes` planes of its code.
template <int Bits>
LYNX_HOST_DEVICE float reconstruct_value(std::uint32_t prefix_code, int planes, group_params p) {
  return detail::fused_multiply_add(p.scale, midpoint_level<Bits>(prefix_code, planes), p.zero);
}

/// Same, with the midpoint offset of this precision precomputed (hot loops):
/// level = float(prefix_code << (Bits - planes)) + half_offset.
LYNX_HOST_DEVICE float reconstruct_from_level(float level, group_params p) {
  return detail::fused_multiply_add(p.scale, level, p.zero);
}

/// (2^(Bits-planes) - 1) / 2: the midpoint offset at a precision of `planes` planes.
template <int Bits>
LYNX_HOST_DEVICE float midpoint_offset(int planes) {
  return static_cast<float>((1u << (Bits - planes)) - 1u) * 0.5f;
}

/// True for a finite float (not NaN, not infinity); cheap enough for hot loops.
LYNX_HOST_DEVICE bool is_finite_value(float x) {
  const float a = x < 0.0f ? -x : x;
  return a <= 3.4028234663852886e38f;
}

}  // namespace lynx
