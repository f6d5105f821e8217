// XXH3-64 (with and without seed) as host-device code, so that a segment sealed on
// the device can carry its checksum without a round trip to the host (the host
// keeps libxxhash for sealing; this file is about correctness, not speed).
// Written from the XXH3 specification (xxHash's doc/xxhash_spec.md); the values
// equal libxxhash's XXH3_64bits_withSeed, which tests/core/test_xxh3.cpp checks for
// every length class and many seeds. No intrinsics, no library calls: inputs and
// the secret are read as little-endian bytes, and the 64x64->128 multiply is done
// with 32-bit halves, so the one code path runs on any host and under nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lynx/core/config.hpp"

namespace lynx::detail {
namespace xxh3 {

using u8 = std::uint8_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

inline constexpr u64 prime32_1 = 0x9E3779B1u;
inline constexpr u64 prime32_2 = 0x85EBCA77u;
inline constexpr u64 prime32_3 = 0xC2B2AE3Du;
inline constexpr u64 prime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr u64 prime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr u64 prime64_3 = 0x165667B19E3779F9ull;
inline constexpr u64 prime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr u64 prime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr u64 prime_mx1 = 0x165667919E3779F9ull;
inline constexpr u64 prime_mx2 = 0x9FB21C651E98DF25ull;

inline constexpr std::size_t secret_bytes = 192;  // the default secret's size
inline constexpr std::size_t stripe_bytes = 64;   // 8 lanes of 8 bytes
inline constexpr std::size_t stripes_per_block = (secret_bytes - stripe_bytes) / 8;  // 16
inline constexpr std::size_t block_bytes = stripe_bytes * stripes_per_block;         // 1024

/// Little-endian loads, byte by byte: any alignment, any host byte order.
LYNX_HOST_DEVICE u32 read32(const u8* p) {
  return u32{p[0]} | (u32{p[1]} << 8) | (u32{p[2]} << 16) | (u32{p[3]} << 24);
}
LYNX_HOST_DEVICE u64 read64(const u8* p) { return u64{read32(p)} | (u64{read32(p + 4)} << 32); }
LYNX_HOST_DEVICE void write64(u8* p, u64 value) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<u8>(value >> (8 * i));
}

LYNX_HOST_DEVICE u32 bswap32(u32 x) {
  return (x >> 24) | ((x >> 8) & 0x0000FF00u) | ((x << 8) & 0x00FF0000u) | (x << 24);
}
LYNX_HOST_DEVICE u64 bswap64(u64 x) {
  return (u64{bswap32(static_cast<u32>(x))} << 32) | bswap32(static_cast<u32>(x >> 32));
}
LYNX_HOST_DEVICE u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }  // 0 < r < 64

/// The full 128-bit product of a and b, from four 32x32->64 partial products.
struct u128 {
  u64 low;
  u64 high;
};
LYNX_HOST_DEVICE u128 multiply_64x64(u64 a, u64 b) {
  const u64 a_lo = a & 0xFFFFFFFFu, a_hi = a >> 32;
  const u64 b_lo = b & 0xFFFFFFFFu, b_hi = b >> 32;
  const u64 lo_lo = a_lo * b_lo;
  const u64 hi_lo = a_hi * b_lo;
  const u64 lo_hi = a_lo * b_hi;
  const u64 hi_hi = a_hi * b_hi;
  // Middle column: at most (2^32-1)^2 + 2(2^32-1) = 2^64-1, so it cannot overflow.
  const u64 middle = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFu) + lo_hi;
  return {(middle << 32) | (lo_lo & 0xFFFFFFFFu), hi_hi + (hi_lo >> 32) + (middle >> 32)};
}
/// The 128-bit product folded to 64 bits (low half xor high half).
LYNX_HOST_DEVICE u64 multiply_fold64(u64 a, u64 b) {
  const u128 product = multiply_64x64(a, b);
  return product.low ^ product.high;
}

/// The spec's avalanche() (XXH3's own final mix) and avalanche_XXH64().
LYNX_HOST_DEVICE u64 avalanche(u64 x) {
  x ^= x >> 37;
  x *= prime_mx1;
  return x ^ (x >> 32);
}
LYNX_HOST_DEVICE u64 avalanche_xxh64(u64 x) {
  x ^= x >> 33;
  x *= prime64_2;
  x ^= x >> 29;
  x *= prime64_3;
  return x ^ (x >> 32);
}

/// Fills `secret` with the default secret; with `derive_from_seed`, the default read
/// as 24 little-endian words, seed added to the even words and subtracted from the
/// odd ones (the custom secret of inputs over 240 bytes).
LYNX_HOST_DEVICE void make_secret(u8 (&secret)[secret_bytes], u64 seed, bool derive_from_seed) {
  // A local constant rather than a namespace-scope table: device code can read it.
  constexpr u8 default_secret[secret_bytes] = {
      0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
      0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
      0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
      0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
      0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
      0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
      0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
      0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
      0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
      0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
      0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
      0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
      0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
  };
  for (std::size_t i = 0; i < secret_bytes; ++i) secret[i] = default_secret[i];
  if (!derive_from_seed) return;
  for (std::size_t w = 0; w < secret_bytes / 8; w += 2) {
    write64(secret + 8 * w, read64(secret + 8 * w) + seed);
    write64(secret + 8 * (w + 1), read64(secret + 8 * (w + 1)) - seed);
  }
}

/// Length 0: the seed and two secret words.
LYNX_HOST_DEVICE u64 hash_empty(const u8* secret, u64 seed) {
  return avalanche_xxh64(seed ^ read64(secret + 56) ^ read64(secret + 64));
}

/// Lengths 1-3: last byte, length, first byte and middle byte in one 32-bit value.
LYNX_HOST_DEVICE u64 hash_1to3(const u8* input, std::size_t length, const u8* secret, u64 seed) {
  const u32 combined = u32{input[length - 1]} | (static_cast<u32>(length) << 8) |
                       (u32{input[0]} << 16) | (u32{input[length >> 1]} << 24);
  const u64 secret_mix = u64{read32(secret) ^ read32(secret + 4)} + seed;
  return avalanche_xxh64(secret_mix ^ combined);
}

/// Lengths 4-8: the first and last 4 bytes (they may overlap).
LYNX_HOST_DEVICE u64 hash_4to8(const u8* input, std::size_t length, const u8* secret, u64 seed) {
  const u32 first = read32(input);
  const u32 last = read32(input + length - 4);
  const u64 modified_seed = seed ^ (u64{bswap32(static_cast<u32>(seed))} << 32);
  const u64 combined = u64{last} | (u64{first} << 32);
  u64 value = ((read64(secret + 8) ^ read64(secret + 16)) - modified_seed) ^ combined;
  value ^= rotl64(value, 49) ^ rotl64(value, 24);
  value *= prime_mx2;
  value ^= (value >> 35) + length;
  value *= prime_mx2;
  return value ^ (value >> 28);
}

/// Lengths 9-16: the first and last 8 bytes (they may overlap).
LYNX_HOST_DEVICE u64 hash_9to16(const u8* input, std::size_t length, const u8* secret, u64 seed) {
  const u64 low = ((read64(secret + 24) ^ read64(secret + 32)) + seed) ^ read64(input);
  const u64 high =
      ((read64(secret + 40) ^ read64(secret + 48)) - seed) ^ read64(input + length - 8);
  return avalanche(length + bswap64(low) + high + multiply_fold64(low, high));
}

/// The medium paths' mixing step: 16 input bytes against 16 secret bytes and the seed.
LYNX_HOST_DEVICE u64 mix16(const u8* input, const u8* secret, u64 seed) {
  return multiply_fold64(read64(input) ^ (read64(secret) + seed),
                         read64(input + 8) ^ (read64(secret + 8) - seed));
}

/// Lengths 17-128: N 16-byte chunks from the front paired with N from the back,
/// the smallest N whose 2N chunks cover the input.
LYNX_HOST_DEVICE u64 hash_17to128(const u8* input, std::size_t length, const u8* secret, u64 seed) {
  u64 acc = length * prime64_1;
  const std::size_t rounds = ((length - 1) >> 5) + 1;  // 1..4
  for (std::size_t i = rounds; i-- > 0;) {
    acc += mix16(input + 16 * i, secret + 32 * i, seed);
    acc += mix16(input + length - 16 * i - 16, secret + 32 * i + 16, seed);
  }
  return avalanche(acc);
}

/// Lengths 129-240: eight chunks, an intermediate avalanche, the remaining full
/// chunks (secret offset by 3), then the last 16 bytes at secret offset 119.
LYNX_HOST_DEVICE u64 hash_129to240(const u8* input, std::size_t length, const u8* secret,
                                   u64 seed) {
  u64 acc = length * prime64_1;
  for (std::size_t i = 0; i < 8; ++i) acc += mix16(input + 16 * i, secret + 16 * i, seed);
  acc = avalanche(acc);
  const std::size_t chunks = length >> 4;
  for (std::size_t i = 8; i < chunks; ++i)
    acc += mix16(input + 16 * i, secret + 16 * (i - 8) + 3, seed);
  acc += mix16(input + length - 16, secret + 119, seed);
  return avalanche(acc);
}

/// One stripe (8 little-endian lanes) into the 8 accumulators: each lane is added
/// to its neighbour's accumulator and, xored with the secret, multiplied low half
/// by high half into its own.
LYNX_HOST_DEVICE void accumulate(u64 (&acc)[8], const u8* stripe, const u8* secret) {
  for (int i = 0; i < 8; ++i) {
    const u64 lane = read64(stripe + 8 * i);
    const u64 keyed = lane ^ read64(secret + 8 * i);
    acc[i ^ 1] += lane;
    acc[i] += (keyed & 0xFFFFFFFFu) * (keyed >> 32);
  }
}

/// After each full block: fold the high bits down, key, multiply.
LYNX_HOST_DEVICE void scramble(u64 (&acc)[8], const u8* secret) {
  for (int i = 0; i < 8; ++i) {
    acc[i] ^= acc[i] >> 47;
    acc[i] ^= read64(secret + 8 * i);
    acc[i] *= prime32_1;
  }
}

/// Lengths over 240: 1024-byte blocks of 16 stripes, a scramble after each block
/// but the last; the last block's stripes but its last, then the input's last 64
/// bytes as a stripe; a final merge of the accumulators keyed at secret offset 11.
LYNX_HOST_DEVICE u64 hash_long(const u8* input, std::size_t length, const u8* secret) {
  u64 acc[8] = {prime32_3, prime64_1, prime64_2, prime64_3,
                prime64_4, prime32_2, prime64_5, prime32_1};
  const std::size_t full_blocks = (length - 1) / block_bytes;  // the last block waits
  for (std::size_t b = 0; b < full_blocks; ++b) {
    const u8* block = input + b * block_bytes;
    for (std::size_t s = 0; s < stripes_per_block; ++s)
      accumulate(acc, block + s * stripe_bytes, secret + 8 * s);
    scramble(acc, secret + secret_bytes - stripe_bytes);
  }
  const u8* last_block = input + full_blocks * block_bytes;
  const std::size_t last_block_bytes = length - full_blocks * block_bytes;  // 1..1024
  const std::size_t last_stripes = (last_block_bytes - 1) / stripe_bytes;
  for (std::size_t s = 0; s < last_stripes; ++s)
    accumulate(acc, last_block + s * stripe_bytes, secret + 8 * s);
  accumulate(acc, input + length - stripe_bytes, secret + secret_bytes - 71);

  const u8* merge_secret = secret + 11;
  u64 result = length * prime64_1;
  for (int i = 0; i < 4; ++i)
    result += multiply_fold64(acc[2 * i] ^ read64(merge_secret + 16 * i),
                              acc[2 * i + 1] ^ read64(merge_secret + 16 * i + 8));
  return avalanche(result);
}

}  // namespace xxh3

/// XXH3-64 of `length` bytes at `bytes` (any alignment) with `seed`; equal to
/// libxxhash's XXH3_64bits_withSeed, on host and device.
LYNX_HOST_DEVICE std::uint64_t xxh3_64_portable(const void* bytes, std::size_t length,
                                                std::uint64_t seed) {
  const auto* input = static_cast<const xxh3::u8*>(bytes);
  // Up to 240 bytes the seed enters the arithmetic and the secret is the default;
  // beyond, the seed only derives the secret (seed 0 derives the default).
  xxh3::u8 secret[xxh3::secret_bytes];
  xxh3::make_secret(secret, seed, length > 240);
  if (length == 0) return xxh3::hash_empty(secret, seed);
  if (length <= 3) return xxh3::hash_1to3(input, length, secret, seed);
  if (length <= 8) return xxh3::hash_4to8(input, length, secret, seed);
  if (length <= 16) return xxh3::hash_9to16(input, length, secret, seed);
  if (length <= 128) return xxh3::hash_17to128(input, length, secret, seed);
  if (length <= 240) return xxh3::hash_129to240(input, length, secret, seed);
  return xxh3::hash_long(input, length, secret);
}

/// XXH3-64 without a seed (seed 0): equal to libxxhash's XXH3_64bits.
LYNX_HOST_DEVICE std::uint64_t xxh3_64_portable(const void* bytes, std::size_t length) {
  return xxh3_64_portable(bytes, length, 0);
}

}  // namespace lynx::detail
