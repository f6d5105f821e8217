// lynx::detail::xxh3_64_portable, the host-device XXH3-64, equals libxxhash's
// XXH3_64bits_withSeed bit for bit: every length 0..2048 (all the length classes and
// the long path's stripe and block boundaries), larger inputs, seeds 0, 1, random
// ones and those Lynx derives from real segment headers, at odd alignments.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "lynx/core/xxh3.hpp"
#include "lynx/planes/segment.hpp"  // XXH_INLINE_ALL + <xxhash.h>, segment_header

namespace {

using lynx::detail::xxh3_64_portable;

// splitmix64: reproducible pseudo-random input bytes and seeds.
std::uint64_t next_random(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t state) {
  std::vector<std::uint8_t> bytes(n);
  for (auto& b : bytes) b = static_cast<std::uint8_t>(next_random(state) >> 56);
  return bytes;
}

// Seeds Lynx derives for real segments: XXH3-64 of the header with checksum 0.
std::vector<std::uint64_t> header_seeds() {
  std::vector<std::uint64_t> seeds;
  const lynx::layer_geometry geometries[] = {
      lynx::make_geometry<lynx::plan_8_4_4, 32>({33, 2, 64}),
      lynx::make_geometry<lynx::plan_8_4_4, 32>({4096, 8, 128}),
  };
  for (const auto& g : geometries) {
    for (int stream = 0; stream < g.plan.streams; ++stream) {
      const lynx::segment_header h = lynx::make_header(g, 5, stream, 9);
      seeds.push_back(XXH3_64bits(&h, sizeof h));
    }
  }
  return seeds;
}

std::vector<std::uint64_t> test_seeds() {
  std::vector<std::uint64_t> seeds = {0, 1, ~std::uint64_t{0}, 0x8000000000000000ull};
  std::uint64_t state = 42;
  for (int i = 0; i < 4; ++i) seeds.push_back(next_random(state));
  for (const std::uint64_t s : header_seeds()) seeds.push_back(s);
  return seeds;
}

}  // namespace

TEST_CASE("xxh3_64_portable equals XXH3_64bits_withSeed for every length 0..2048") {
  constexpr std::size_t max_length = 2048;
  constexpr std::size_t offsets[] = {0, 1, 3, 7};  // odd alignments of the input
  const std::vector<std::uint8_t> buffer = random_bytes(max_length + 8, 1);
  const std::vector<std::uint64_t> seeds = test_seeds();
  long comparisons = 0;
  for (std::size_t length = 0; length <= max_length; ++length) {
    for (const std::uint64_t seed : seeds) {
      for (const std::size_t offset : offsets) {
        const std::uint8_t* input = buffer.data() + offset;
        const std::uint64_t want = XXH3_64bits_withSeed(input, length, seed);
        const std::uint64_t got = xxh3_64_portable(input, length, seed);
        CHECK_MESSAGE(got == want, "length ", length, " seed ", seed, " offset ", offset);
        ++comparisons;
      }
    }
  }
  MESSAGE(comparisons, " comparisons");
}

TEST_CASE("xxh3_64_portable equals XXH3_64bits_withSeed for large inputs") {
  constexpr std::size_t lengths[] = {4095, 4096, 4097, 65536 + 17, std::size_t{1} << 20};
  const std::vector<std::uint8_t> buffer = random_bytes((std::size_t{1} << 20) + 8, 2);
  const std::vector<std::uint64_t> seeds = test_seeds();
  for (const std::size_t length : lengths) {
    for (const std::uint64_t seed : seeds) {
      for (const std::size_t offset : {std::size_t{0}, std::size_t{5}}) {
        const std::uint8_t* input = buffer.data() + offset;
        CHECK_MESSAGE(
            xxh3_64_portable(input, length, seed) == XXH3_64bits_withSeed(input, length, seed),
            "length ", length, " seed ", seed, " offset ", offset);
      }
    }
  }
}

TEST_CASE("the no-seed form equals XXH3_64bits") {
  const std::vector<std::uint8_t> buffer = random_bytes(4096, 3);
  for (const std::size_t length : {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4096}) {
    CHECK_MESSAGE(xxh3_64_portable(buffer.data(), length) == XXH3_64bits(buffer.data(), length),
                  "length ", length);
  }
}

TEST_CASE("a segment checksum computed with xxh3_64_portable equals segment_checksum") {
  const lynx::layer_geometry g = lynx::make_geometry<lynx::plan_8_4_4, 32>({70, 3, 64});
  for (int stream = 0; stream < g.plan.streams; ++stream) {
    const lynx::segment_header h = lynx::make_header(g, 7, stream, 11);
    const auto payload = random_bytes(static_cast<std::size_t>(h.payload_bytes), 4 + stream);
    const std::uint64_t seed = xxh3_64_portable(&h, sizeof h);  // h.checksum is 0
    const std::uint64_t portable = xxh3_64_portable(payload.data(), payload.size(), seed);
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(payload.data()),
                                           payload.size());
    CHECK(portable == lynx::segment_checksum(h, bytes));
  }
}

#if defined(__SIZEOF_INT128__)
TEST_CASE("the 32-bit-halves 64x64->128 multiply equals unsigned __int128") {
  std::uint64_t state = 5;
  std::vector<std::uint64_t> values = {0, 1, 0xFFFFFFFFull, 0x100000000ull, ~std::uint64_t{0}};
  for (int i = 0; i < 64; ++i) values.push_back(next_random(state));
  for (const std::uint64_t a : values) {
    for (const std::uint64_t b : values) {
      const unsigned __int128 want = static_cast<unsigned __int128>(a) * b;
      const auto got = lynx::detail::xxh3::multiply_64x64(a, b);
      CHECK(got.low == static_cast<std::uint64_t>(want));
      CHECK(got.high == static_cast<std::uint64_t>(want >> 64));
    }
  }
}
#endif
