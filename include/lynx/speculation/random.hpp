// A counter-based random generator: the n-th draw of a named purpose at a
// position is a pure function of (seed, purpose, position, n), so a run is
// reproducible however the work is batched or re-ordered.
#pragma once

#include <cstdint>

namespace lynx {

struct counter_rng {
  std::uint64_t seed = 0;

  static constexpr std::uint64_t mix(std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// 64 random bits for (purpose, position, draw).
  [[nodiscard]] constexpr std::uint64_t bits(std::uint64_t purpose, std::uint64_t position,
                                             std::uint64_t draw = 0) const {
    return mix(mix(mix(seed ^ (purpose * 0xd1b54a32d192ed03ull)) ^ position) ^ draw);
  }
  /// Uniform double in [0, 1) with 53 random bits.
  [[nodiscard]] constexpr double uniform(std::uint64_t purpose, std::uint64_t position,
                                         std::uint64_t draw = 0) const {
    return static_cast<double>(bits(purpose, position, draw) >> 11) * 0x1.0p-53;
  }
};

}  // namespace lynx
