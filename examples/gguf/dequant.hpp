// Dequantization of GGUF tensor rows to float32: F32, F16, BF16, Q8_0, Q5_0,
// Q4_K and Q6_K, bit for bit the values the formats define (and gguf-py's
// numpy dequantizer computes). dequantize_row is the hot path of a forward
// pass over quantized weights: no allocation, and per-block loops of fixed
// trip count that GCC vectorizes.
//
// Why the bits cannot depend on the compiler: every product here is exact in
// float32. An f16 scale has at most 11 significant bits; times a 6-bit scale
// (Q4_K) or int8 scale (Q6_K) that is at most 18 bits, and times a quant of at
// most 8 bits (sign included) at most 24 bits, which float32 holds exactly
// (and the exponents stay far inside float's range). So d * scale * q rounds
// nowhere, whatever the association, and Q4_K's one subtraction rounds once,
// whether or not the compiler contracts it with the product into an FMA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "gguf/reader.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"

namespace lynx_examples::gguf {

/// True for the types dequantize_row decodes.
inline bool can_dequantize(tensor_type t) {
  switch (t) {
    case tensor_type::f32:
    case tensor_type::f16:
    case tensor_type::bf16:
    case tensor_type::q8_0:
    case tensor_type::q5_0:
    case tensor_type::q4_k:
    case tensor_type::q6_k:
      return true;
    default:
      return false;
  }
}

/// Bytes holding n elements of type t. Throws std::invalid_argument when the
/// type is unknown or n is negative or not a whole number of blocks.
inline std::size_t row_bytes(tensor_type t, std::int64_t n) {
  const std::int64_t block = block_elements(t);
  if (n < 0 || n % block != 0)
    throw std::invalid_argument("gguf: a row of " + std::to_string(n) +
                                " elements is not a whole number of " + std::string(type_name(t)) +
                                " blocks of " + std::to_string(block));
  return static_cast<std::size_t>(n / block) * block_bytes(t);
}

namespace detail {

inline float half_at(const std::byte* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(lynx::fp16::from_bits(bits));
}

// Bytes as the unsigned / signed integers the block layouts are made of.
inline const std::uint8_t* as_u8(const std::byte* p) {
  return reinterpret_cast<const std::uint8_t*>(p);
}
inline const std::int8_t* as_i8(const std::byte* p) {
  return reinterpret_cast<const std::int8_t*>(p);
}

inline void dequantize_f16(const std::byte* src, float* LYNX_RESTRICT dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = half_at(src + 2 * i);
}

// bf16 is the top half of a float32: widen by a 16-bit shift.
inline void dequantize_bf16(const std::byte* src, float* LYNX_RESTRICT dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    dst[i] = lynx::detail::bits_float(static_cast<std::uint32_t>(bits) << 16);
  }
}

// Q8_0 block (34 bytes, 32 values): f16 d, int8 q[32]; x = q * d.
inline void dequantize_q8_0(const std::byte* src, float* LYNX_RESTRICT dst, std::int64_t n) {
  for (std::int64_t b = 0; b < n / 32; ++b, src += 34, dst += 32) {
    const float d = half_at(src);
    const std::int8_t* q = as_i8(src + 2);
    for (int i = 0; i < 32; ++i) dst[i] = static_cast<float>(q[i]) * d;
  }
}

// Q5_0 block (22 bytes, 32 values): f16 d, u32 qh (bit i: 5th bit of value i),
// u8 qs[16] (value i < 16 in the low nibble of qs[i], value i + 16 in the high
// nibble); x = d * (q - 16), q in [0, 32).
// Bit i of qh is tested against a table of masks rather than shifted out by i:
// a shift by the lane index has no SSE2 instruction and kept the loop scalar.
inline constexpr std::uint32_t q5_0_bit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

inline void dequantize_q5_0(const std::byte* src, float* LYNX_RESTRICT dst, std::int64_t n) {
  for (std::int64_t b = 0; b < n / 32; ++b, src += 22, dst += 32) {
    const float d = half_at(src);
    std::uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    const std::uint8_t* qs = as_u8(src + 6);
    for (int i = 0; i < 16; ++i) {
      const int low = (qs[i] & 0x0f) | ((qh & q5_0_bit[i]) != 0 ? 16 : 0);
      const int high = (qs[i] >> 4) | ((qh & q5_0_bit[i + 16]) != 0 ? 16 : 0);
      dst[i] = d * static_cast<float>(low - 16);
      dst[i + 16] = d * static_cast<float>(high - 16);
    }
  }
}

// Q4_K's 12 scale bytes hold 8 six-bit scales and 8 six-bit mins. Sub-blocks
// j < 4: scale = low 6 bits of byte j, min = low 6 bits of byte j + 4. Sub-blocks
// j >= 4: the low 4 bits come from byte j + 4 (scale: its low nibble, min: its
// high nibble) and the top 2 bits from the top 2 bits of byte j - 4 (scale) and
// byte j (min).
inline void q4_k_scale_min(const std::uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K block (144 bytes, 256 values): f16 d, f16 dmin, 12 scale bytes, u8 qs[128].
// Values come in 4 groups of 64 sharing 32 qs bytes: the first 32 values are
// the low nibbles (sub-block 2g), the next 32 the high nibbles (sub-block 2g+1).
// x = (d * scale) * q - (dmin * min).
inline void dequantize_q4_k(const std::byte* src, float* LYNX_RESTRICT dst, std::int64_t n) {
  for (std::int64_t b = 0; b < n / 256; ++b, src += 144, dst += 256) {
    const float d = half_at(src);
    const float dmin = half_at(src + 2);
    const std::uint8_t* scales = as_u8(src + 4);
    const std::uint8_t* qs = as_u8(src + 16);
    for (int g = 0; g < 4; ++g) {
      int scale_low, min_low, scale_high, min_high;
      q4_k_scale_min(scales, 2 * g, scale_low, min_low);
      q4_k_scale_min(scales, 2 * g + 1, scale_high, min_high);
      const float d_low = d * static_cast<float>(scale_low);
      const float m_low = dmin * static_cast<float>(min_low);
      const float d_high = d * static_cast<float>(scale_high);
      const float m_high = dmin * static_cast<float>(min_high);
      const std::uint8_t* q = qs + 32 * g;
      float* y = dst + 64 * g;
      for (int l = 0; l < 32; ++l) {
        y[l] = d_low * static_cast<float>(q[l] & 0x0f) - m_low;
        y[l + 32] = d_high * static_cast<float>(q[l] >> 4) - m_high;
      }
    }
  }
}

// Q6_K block (210 bytes, 256 values): u8 ql[128] (low 4 bits), u8 qh[64]
// (high 2 bits), int8 scales[16] (one per 16 values), f16 d.
// Each half of 128 values uses 64 ql, 32 qh and 8 scales: for l < 32,
//   value l      = low nibble of ql[l]      | bits 0-1 of qh[l] << 4
//   value l + 32 = low nibble of ql[l + 32] | bits 2-3 of qh[l] << 4
//   value l + 64 = high nibble of ql[l]     | bits 4-5 of qh[l] << 4
//   value l + 96 = high nibble of ql[l + 32]| bits 6-7 of qh[l] << 4
// x = (d * scale) * (q - 32), scale = scales[value index / 16] of the half.
inline void dequantize_q6_k(const std::byte* src, float* LYNX_RESTRICT dst, std::int64_t n) {
  // Two passes per block, each a loop GCC vectorizes: the 6-bit quants into
  // int8 (16 lanes per SSE register), then 16 groups of 16 values times their
  // scale. (One pass with four float stores per byte vectorized poorly.)
  alignas(16) std::int8_t q[256];
  for (std::int64_t b = 0; b < n / 256; ++b, src += 210, dst += 256) {
    const std::uint8_t* ql = as_u8(src);
    const std::uint8_t* qh = as_u8(src + 128);
    const std::int8_t* sc = as_i8(src + 192);
    const float d = half_at(src + 208);
    for (int half = 0; half < 2; ++half) {
      const std::uint8_t* l4 = ql + 64 * half;
      const std::uint8_t* h2 = qh + 32 * half;
      std::int8_t* v = q + 128 * half;
      for (int l = 0; l < 32; ++l) {
        v[l] = static_cast<std::int8_t>(((l4[l] & 0x0f) | ((h2[l] & 0x03) << 4)) - 32);
        v[l + 32] =
            static_cast<std::int8_t>(((l4[l + 32] & 0x0f) | (((h2[l] >> 2) & 0x03) << 4)) - 32);
        v[l + 64] = static_cast<std::int8_t>(((l4[l] >> 4) | (((h2[l] >> 4) & 0x03) << 4)) - 32);
        v[l + 96] =
            static_cast<std::int8_t>(((l4[l + 32] >> 4) | (((h2[l] >> 6) & 0x03) << 4)) - 32);
      }
    }
    for (int g = 0; g < 16; ++g) {
      const float scale = d * static_cast<float>(sc[g]);
      LYNX_UNROLL(1)  // else -O3 peels this loop and vectorizes the one over g, 2x slower
      for (int k = 0; k < 16; ++k) dst[16 * g + k] = scale * static_cast<float>(q[16 * g + k]);
    }
  }
}

}  // namespace detail

/// Decodes n values of type t from src (row_bytes(t, n) bytes) into dst[0, n).
/// n must be a whole number of blocks. Throws std::invalid_argument for a type
/// it does not decode (naming it) or a bad n; never allocates.
inline void dequantize_row(tensor_type t, const std::byte* src, float* dst, std::int64_t n) {
  if (!can_dequantize(t))
    throw std::invalid_argument("gguf: cannot dequantize " + detail::type_label(t) +
                                " (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K)");
  (void)row_bytes(t, n);  // checks n against the block size
  switch (t) {
    case tensor_type::f32:
      if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case tensor_type::f16:
      detail::dequantize_f16(src, dst, n);
      return;
    case tensor_type::bf16:
      detail::dequantize_bf16(src, dst, n);
      return;
    case tensor_type::q8_0:
      detail::dequantize_q8_0(src, dst, n);
      return;
    case tensor_type::q5_0:
      detail::dequantize_q5_0(src, dst, n);
      return;
    case tensor_type::q4_k:
      detail::dequantize_q4_k(src, dst, n);
      return;
    case tensor_type::q6_k:
      detail::dequantize_q6_k(src, dst, n);
      return;
    default:
      return;  // excluded by can_dequantize above
  }
}

/// The whole tensor as float32, in file order (row after row of row_length()).
/// Throws std::invalid_argument naming the tensor and its type when the type
/// is not decoded here, format_error when its data cannot be located.
inline std::vector<float> dequantize(const file& f, const tensor_info& t) {
  if (!can_dequantize(t.type))
    throw std::invalid_argument("gguf: cannot dequantize tensor " + detail::quoted(t.name) +
                                " of " + detail::type_label(t.type) +
                                " (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K)");
  const std::span<const std::byte> bytes = f.data(t);
  std::vector<float> out(static_cast<std::size_t>(t.elements()));
  dequantize_row(t.type, bytes.data(), out.data(), t.elements());
  return out;
}

}  // namespace lynx_examples::gguf
