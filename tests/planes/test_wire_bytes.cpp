// Bytes on the wire against the blocking baselines: the bars of issue 29 on the
// segment sizes (planes.test_codec checks that encoded segments have exactly
// these sizes; bench_wire_bytes prints the whole table).
#include <doctest/doctest.h>

#include <cstdint>

#include "lynx/planes/segment.hpp"

namespace {

template <lynx::stream_plan_type Plan, int G>
std::uint64_t bytes_of(const lynx::kv_shape& s, int first_stream = 0, int end_stream = -1) {
  const lynx::layer_geometry g = lynx::make_geometry<Plan, G>(s);
  std::uint64_t n = 0;
  for (int st = first_stream; st < (end_stream < 0 ? Plan::streams : end_stream); ++st)
    n += lynx::segment_bytes(g, st);
  return n;
}

std::uint64_t bf16_bytes(const lynx::kv_shape& s) {
  return static_cast<std::uint64_t>(s.elements()) * 2 * 2;  // K and V, 2 bytes each
}

}  // namespace

TEST_CASE("a Llama-3-8B layer at 8K tokens, G = 32: the bytes by hand") {
  const lynx::kv_shape s{8192, 8, 128};
  // parameters: keys 8 heads x 256 token groups x 128 channels, values 8 x 8192 x 4
  // channel groups = 262,144 each; scale and zero point, 2 bytes each: 2 MiB in all.
  // One plane of K (or V): 8 x 256 blocks x 128 channels x 4 bytes = 1 MiB.
  constexpr std::uint64_t MiB = 1u << 20, header = 128;
  CHECK(bytes_of<lynx::plan_8_4_4, 32>(s, 0, 1) == header + 2 * MiB + 8 * MiB);
  CHECK(bytes_of<lynx::plan_8_4_4, 32>(s, 1, 2) == header + 8 * MiB);
  CHECK(bytes_of<lynx::plan_8_8, 32>(s) == header + 2 * MiB + 16 * MiB);
  CHECK(bytes_of<lynx::plan_16_4_12, 32>(s) == 2 * header + 2 * MiB + 32 * MiB);
  CHECK(bf16_bytes(s) == 32 * MiB);
}

TEST_CASE("the anchor of 8 = 4 + 4 is at most 0.56x a blocking 8-bit transfer at G = 32") {
  for (const std::int64_t tokens : {1024, 4096, 8192, 32768}) {
    const lynx::kv_shape s{tokens, 8, 128};
    CAPTURE(tokens);
    const double anchor = static_cast<double>(bytes_of<lynx::plan_8_4_4, 32>(s, 0, 1));
    const double blocking8 = static_cast<double>(bytes_of<lynx::plan_8_8, 32>(s));
    CHECK(anchor <= 0.56 * blocking8);
    // and the whole progressive transfer costs no more than the blocking one plus a header
    CHECK(bytes_of<lynx::plan_8_4_4, 32>(s) <= bytes_of<lynx::plan_8_8, 32>(s) + 128);
    CHECK(bytes_of<lynx::plan_8_2_2_4, 32>(s) <= bytes_of<lynx::plan_8_8, 32>(s) + 2 * 128);
  }
}

TEST_CASE("every 16-bit plan is at most 1.07x the bytes of bf16 (G = 32, 64, 128)") {
  for (const std::int64_t tokens : {1024, 8192, 32768}) {
    const lynx::kv_shape s{tokens, 8, 128};
    CAPTURE(tokens);
    const double bf16 = static_cast<double>(bf16_bytes(s));
    CHECK(static_cast<double>(bytes_of<lynx::plan_16_4_12, 32>(s)) <= 1.07 * bf16);
    CHECK(static_cast<double>(bytes_of<lynx::plan_16_4_4_8, 32>(s)) <= 1.07 * bf16);
    CHECK(static_cast<double>(bytes_of<lynx::plan_16_4_12, 64>(s)) <= 1.04 * bf16);
    CHECK(static_cast<double>(bytes_of<lynx::plan_16_4_12, 128>(s)) <= 1.02 * bf16);
  }
}
