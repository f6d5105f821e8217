// Golden input and the expected checksums of its encoded segments: the wire
// format's fingerprint. Host tests (tests/planes/test_golden.cpp) and device
// tests check the same table, so neither the format nor the math of either
// backend can change by accident.
//
// The input comes from a counter-based generator written here (splitmix64 of
// seed and element index), not from <random>'s distributions, whose output
// differs between standard libraries. Every value is a multiple of 2^-21 in
// [-4, 4) (exact in float), except fixed outliers scaled by 250.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"

namespace lynx_tests::golden {

/// splitmix64's output function of a 64-bit counter.
constexpr std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Element `index` of the golden stream of `seed`: 24 random bits as a multiple of
/// 2^-21 in [-4, 4); every element whose index is 7 mod 613 is an outlier (x 250).
constexpr float golden_value(std::uint64_t seed, std::uint64_t index) {
  const std::uint64_t z = mix(seed * 0x100000001b3ull + index);
  const float x = static_cast<float>(static_cast<std::int64_t>(z >> 40) - (std::int64_t{1} << 23)) *
                  4.76837158203125e-07f;  // * 2^-21
  return index % 613 == 7 ? x * 250.0f : x;
}

/// Golden K or V of one layer, token-major [tokens][kv_heads][head_dim].
inline std::vector<float> golden_input(std::uint64_t seed, lynx::kv_shape shape) {
  std::vector<float> x(static_cast<std::size_t>(shape.elements()));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = golden_value(seed, i);
  return x;
}

/// The golden case: one layer of this shape, layer index, generation and seeds,
/// encoded with group size 32. bf16 input is golden_input converted with
/// lynx::bf16(float) (round to nearest even).
inline constexpr lynx::kv_shape shape{77, 2, 64};
inline constexpr std::uint32_t layer = 5;
inline constexpr std::uint64_t generation = 9;
inline constexpr std::uint64_t key_seed = 1;
inline constexpr std::uint64_t value_seed = 2;
inline constexpr int group_size = 32;

/// Expected `checksum` field of the header of each stream's segment (segment format
/// version 2: scales and zero points as bf16).
struct checksum_entry {
  const char* plan;            // stream_plan<...>::name(), e.g. "8 = 4 + 4"
  lynx::element_kind element;  // input element type
  int streams;
  std::uint64_t checksum[4];
};

inline constexpr checksum_entry checksums[] = {
    {"8 = 4 + 4", lynx::element_kind::f32, 2, {0x1d5155bee5c8e288ull, 0xc334441ba94f1723ull}},
    {"8 = 4 + 4", lynx::element_kind::bf16, 2, {0x906a5262a42894baull, 0xff2d3ba08813ff82ull}},
    {"8 = 2 + 2 + 4",
     lynx::element_kind::f32,
     3,
     {0x5698e43dbc9760b6ull, 0xfd0db5c696accc3eull, 0x1c6d7cbcfa6e753eull}},
    {"8 = 2 + 2 + 4",
     lynx::element_kind::bf16,
     3,
     {0xacc9519d56ebaefbull, 0x406562f7eac23647ull, 0x4d0124ec1c27119eull}},
    {"16 = 4 + 12", lynx::element_kind::f32, 2, {0x0f796403361988b8ull, 0x53844976686d0eb3ull}},
    {"16 = 4 + 12", lynx::element_kind::bf16, 2, {0x83a13700c8e1e61eull, 0x5f284163a8ab72afull}},
    {"16 = 4 + 4 + 8",
     lynx::element_kind::f32,
     3,
     {0x89fa55bd6ff9c5abull, 0x10c6b80bd6792cabull, 0x58b6e5a1c3783bb0ull}},
    {"16 = 4 + 4 + 8",
     lynx::element_kind::bf16,
     3,
     {0x79e8da52976436fcull, 0x380d038813d9022dull, 0x6a4c6a5ab3529020ull}},
};

}  // namespace lynx_tests::golden
