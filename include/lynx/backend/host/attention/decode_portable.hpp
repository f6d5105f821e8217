// Portable decoders of one 32-token block of bit planes into codes as floats:
// keys by nibbles (tile[c][32], nibble lane order), values by 8x8 bit-matrix
// transposes (tile[t][D]) or by nibbles for other head_dims.
#pragma once

#include <cstdint>
#include <type_traits>

#include "lynx/backend/host/attention/tile_math.hpp"
#include "lynx/core/config.hpp"

namespace lynx::detail {

/// The float of a code (codes are below 2^16: the signed conversion, which
/// every SIMD instruction set has, is exact); a decoded code is one already.
template <class Code>
inline float code_float(Code k) {
  if constexpr (std::is_same_v<Code, float>)
    return k;
  else
    return static_cast<float>(static_cast<std::int32_t>(k));
}

/// Lane of token t (0..31) of a block in a key tile decoded by nibbles
/// (decode_key_tile_portable): token 4q + i is in lane 8i + q.
inline int nibble_lane(int t) { return 8 * (t % 4) + t / 4; }

/// Where nibbles_to_bytes wants the nibble of code bit a (0..7): at bit 4 * slot.
constexpr int nibble_slot(int a) { return ((a & 3) << 1) | (a >> 2); }

/// Eight nibbles (the plane with code bit a at bit 4 * nibble_slot(a), its bit i
/// for token i) to four bytes (byte i: token i's code, bit a from that plane).
/// Writing a bit position as p4..p0, nibble_slot puts code bit a = (a2 a1 a0) at
/// p2 p4 p3 = a2 a1 a0 and token i at p1 p0; exchanging p0 with p3 and p1 with p4
/// (two delta swaps) makes it p1 p0 p2 p4 p3, bit a of byte i.
inline std::uint32_t nibbles_to_bytes(std::uint32_t x) {
  std::uint32_t t = (x ^ (x >> 7)) & 0x00aa00aau;  // p0 = 1, p3 = 0 with p + 7
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000ccccu;  // p1 = 1, p4 = 0 with p + 14
  return x ^ t ^ (t << 14);
}

/// The codes of tokens s..s+3 of channel c (bits s..s+3 of each plane word) as the
/// bytes of x (planes 0..7, the high byte) and y (planes 8..P-1, the low byte;
/// 0 for up to 8 planes): nibbles packed at nibble_slot, then nibbles_to_bytes.
/// P = 0: `planes` planes (1..16), known at run time; else P planes (`planes` unused).
template <int P>
inline void nibble_code_bytes(const std::uint32_t* const* rows, int c, int s, std::uint32_t& x,
                              std::uint32_t& y, int planes = P) {
  const int n = P > 0 ? P : planes, PH = n < 8 ? n : 8;
  std::uint32_t v = 0, u = 0;
  for (int j = 0; j < PH; ++j) v |= ((rows[j][c] >> s) & 0xfu) << (4 * nibble_slot(PH - 1 - j));
  for (int j = PH; j < n; ++j) u |= ((rows[j][c] >> s) & 0xfu) << (4 * nibble_slot(n - 1 - j));
  x = nibbles_to_bytes(v);
  y = nibbles_to_bytes(u);
}

/// Token i's code from byte i of the high and low words of nibble_code_bytes.
template <int P>
inline std::uint32_t nibble_code(std::uint32_t x, std::uint32_t y, int i, int planes = P) {
  const int n = P > 0 ? P : planes, PH = n < 8 ? n : 8;
  return (((x >> (8 * i)) & 0xffu) << (n - PH)) | ((y >> (8 * i)) & 0xffu);
}

/// Codes of one 32-token block of P planes as floats, tile[c][32], a lane per
/// token in the nibble order (nibble_lane). Nibble q of each plane word holds the
/// bits of tokens 4q..4q+3; the nibbles of up to 8 planes are packed into one word
/// (nibble_slot) and turned into a byte per token (nibbles_to_bytes), the 8 nibbles
/// of a channel being the SIMD lanes; byte i of nibble q's word is token 4q + i,
/// written to lane 8i + q so that the stores stay contiguous. More than 8 planes:
/// planes 0..7 and 8..P-1 each give a byte, the code is (high << (P - 8)) | low.
/// P = 0: `planes` planes, known at run time (the same operations).
template <int P>
inline void decode_key_tile_portable(const std::uint32_t* const* rows, int D, float* tile,
                                     int planes = P) {
  static_assert(P >= 0 && P <= 16);
  constexpr int L = attention_block_tokens;
  for (int c = 0; c < D; ++c) {
    std::uint32_t x[L / 4], y[L / 4];  // byte i of x[q] (y[q]): token 4q + i's high (low) bits
    for (int q = 0; q < L / 4; ++q) nibble_code_bytes<P>(rows, c, 4 * q, x[q], y[q], planes);
    for (int i = 0; i < 4; ++i)
      for (int q = 0; q < L / 4; ++q)
        tile[c * L + 8 * i + q] = code_float(nibble_code<P>(x[q], y[q], i, planes));
  }
}

/// Exchanges bit b + s of each byte of a with bit b of the same byte of b, for
/// the b with b mod 2s < s (the bits set in m): one delta swap.
inline void swap_bits(std::uint32_t& a, std::uint32_t& b, int s, std::uint32_t m) {
  const std::uint32_t t = ((a >> s) ^ b) & m;
  b ^= t;
  a ^= t << s;
}

/// Transposes the four 8x8 bit matrices held by bytes 0..3 of r0..r7 (row i: r_i):
/// on return, bit k of byte g of r_i is what bit i of byte g of r_k was. Delta
/// swaps of the off-diagonal blocks of 4, 2, then 1 rows, written out so that a
/// loop around it vectorizes.
inline void transpose_bytes_8x8(std::uint32_t* r) {
  constexpr std::uint32_t m4 = 0x0f0f0f0fu, m2 = 0x33333333u, m1 = 0x55555555u;
  swap_bits(r[0], r[4], 4, m4), swap_bits(r[1], r[5], 4, m4);
  swap_bits(r[2], r[6], 4, m4), swap_bits(r[3], r[7], 4, m4);
  swap_bits(r[0], r[2], 2, m2), swap_bits(r[1], r[3], 2, m2);
  swap_bits(r[4], r[6], 2, m2), swap_bits(r[5], r[7], 2, m2);
  swap_bits(r[0], r[1], 1, m1), swap_bits(r[2], r[3], 1, m1);
  swap_bits(r[4], r[5], 1, m1), swap_bits(r[6], r[7], 1, m1);
}

/// Loads the plane words of channel c, planes [j0, j0 + n) (n <= 8), as the rows
/// of an 8 x 32 bit matrix (plane j0 as row 7, absent planes 0) and transposes
/// its four 8x8 blocks: byte g of r[i] is then token 8g + i's bits of those
/// planes, plane j0 in the top bit.
template <int N>
inline void transposed_plane_bytes(const std::uint32_t* const* row, int c, std::uint32_t* r) {
  LYNX_UNROLL(8)
  for (int i = 0; i < 8; ++i) r[i] = 7 - i < N ? row[(7 - i) % N][c] : 0u;
  transpose_bytes_8x8(r);
}

/// decode_value_block_portable for a head_dim D known at compile time (so that a
/// compiler sees the 32 token rows of the tile do not overlap and vectorizes
/// over channels). A channel's plane words, 8 planes at a time, are an 8 x 32 bit
/// matrix (transposed_plane_bytes): planes 0..7 give the code's high byte,
/// planes 8..P-1 its low byte.
template <int P, int D>
inline void decode_value_block_transposed(const std::uint32_t* const* rows,
                                          float* LYNX_RESTRICT tile) {
  static_assert(P >= 1 && P <= 16);
  constexpr int L = attention_block_tokens;
  constexpr int PH = P < 8 ? P : 8, PL = P - PH;  // planes in the high and the low byte
  const std::uint32_t* row[P];
  for (int j = 0; j < P; ++j) row[j] = rows[j];
  for (int c = 0; c < D; ++c) {
    std::uint32_t r[8], s[8];
    transposed_plane_bytes<PH>(row, c, r);
    if constexpr (PL > 0) transposed_plane_bytes<PL>(row + PH, c, s);
    LYNX_UNROLL(32)
    for (int t = 0; t < L; ++t) {
      const std::uint32_t high = ((r[t % 8] >> (8 * (t / 8))) & 0xffu) >> (8 - PH);
      if constexpr (PL > 0)
        tile[t * D + c] =
            code_float((high << PL) | (((s[t % 8] >> (8 * (t / 8))) & 0xffu) >> (8 - PL)));
      else
        tile[t * D + c] = code_float(high);
    }
  }
}

/// Codes of the 32 tokens of a block of P planes as floats, tile[t][D] (lane =
/// channel): for head_dim 64, 128 and 256 by bit-matrix transposes
/// (decode_value_block_transposed); else four tokens at a time, each plane word
/// giving the four tokens' bits (a nibble), packed and turned into a byte per
/// token as the keys' (nibbles_to_bytes; planes 0..7 the high byte, 8..P-1 the low).
/// P = 0: `planes` planes, known at run time (by nibbles for every head_dim).
template <int P>
inline void decode_value_block_portable(const std::uint32_t* const* rows, int D, float* tile,
                                        int planes = P) {
  constexpr int L = attention_block_tokens;
  if constexpr (P > 0) {
    if (D == 64) return decode_value_block_transposed<P, 64>(rows, tile);
    if (D == 128) return decode_value_block_transposed<P, 128>(rows, tile);
    if (D == 256) return decode_value_block_transposed<P, 256>(rows, tile);
  }
  for (int t = 0; t < L; t += 4)
    for (int c = 0; c < D; ++c) {
      std::uint32_t x, y;  // byte i: token t + i's high (low) bits
      nibble_code_bytes<P>(rows, c, t, x, y, planes);
      for (int i = 0; i < 4; ++i)
        tile[(t + i) * D + c] = code_float(nibble_code<P>(x, y, i, planes));
    }
}

}  // namespace lynx::detail
