// Bit-plane math shared by every backend: which bit of a code a plane holds,
// and the code prefix a set of plane words gives for one token.
// Plane 0 is the most significant bit; a plane word holds 32 tokens (bit t = token t).
#pragma once

#include <cstdint>

#include "lynx/core/config.hpp"

namespace lynx {

/// Bit `plane` (0 = MSB) of a `bits`-bit code, as 0 or 1.
LYNX_HOST_DEVICE std::uint32_t plane_bit(std::uint32_t code, int bits, int plane) {
  return (code >> (bits - 1 - plane)) & 1u;
}

/// Token t's bit in a plane word.
LYNX_HOST_DEVICE std::uint32_t token_bit(std::uint32_t word, int token) {
  return (word >> token) & 1u;
}

/// The top-`planes` prefix of token t's code from plane words w[0..planes) (plane 0 first),
/// where consecutive planes are `plane_stride` words apart.
LYNX_HOST_DEVICE std::uint32_t prefix_code(const std::uint32_t* words, std::int64_t plane_stride,
                                           int planes, int token) {
  std::uint32_t c = 0;
  for (int j = 0; j < planes; ++j) c = (c << 1) | token_bit(words[j * plane_stride], token);
  return c;
}

}  // namespace lynx
