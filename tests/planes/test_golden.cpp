// Golden checksums of encoded segments (tests/support/golden.hpp): a fixed,
// portable input encoded with the main plans must give the same segment
// checksums on every compiler, standard library and backend. A change of the
// wire format or of the quantization math shows up here first; if the change is
// intended, bump the format version and refresh the table (the test prints it).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "../support/golden.hpp"
#include "lynx/planes/codec.hpp"  // the inline XXH3 (planes/segment.hpp), its GCC warnings silenced

namespace {

namespace golden = lynx_tests::golden;

template <class P, class T>
struct config {
  using plan = P;
  using element = T;
};

using golden_configs =
    std::tuple<config<lynx::plan_8_4_4, float>, config<lynx::plan_8_4_4, lynx::bf16>,
               config<lynx::plan_8_2_2_4, float>, config<lynx::plan_8_2_2_4, lynx::bf16>,
               config<lynx::plan_16_4_12, float>, config<lynx::plan_16_4_12, lynx::bf16>,
               config<lynx::plan_16_4_4_8, float>, config<lynx::plan_16_4_4_8, lynx::bf16>>;

template <class T>
std::vector<T> as_elements(const std::vector<float>& x) {
  std::vector<T> out;
  out.reserve(x.size());
  for (float v : x) out.push_back(lynx::from_float<T>(v));
  return out;
}

std::uint64_t header_checksum(std::span<const std::byte> segment) {
  return lynx::peek_header(segment).checksum;
}

}  // namespace

TEST_CASE("the golden input generator is fixed") {
  // Pinned values: the generator is integer arithmetic and one exact float product.
  CHECK(golden::golden_value(1, 0) == -0x1.1c5p-9f);
  CHECK(golden::golden_value(1, 7) == -0x1.48cbb2p+9f);  // an outlier (index 7 mod 613)
  CHECK(golden::golden_value(2, 1000) == -0x1.b65p-5f);
  const std::vector<float> k = golden::golden_input(golden::key_seed, golden::shape);
  const std::vector<float> v = golden::golden_input(golden::value_seed, golden::shape);
  REQUIRE(k.size() == static_cast<std::size_t>(77 * 2 * 64));
  float lo = 0, hi = 0;
  int outliers = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    CHECK(k[i] == golden::golden_value(golden::key_seed, i));
    lo = std::min(lo, k[i]);
    hi = std::max(hi, k[i]);
    outliers += (k[i] < -4.0f || k[i] >= 4.0f);
  }
  CHECK(lo >= -1000.0f);
  CHECK(hi < 1000.0f);
  CHECK(outliers > 0);
  CHECK(k != v);
  const std::uint64_t key_hash = XXH3_64bits(k.data(), k.size() * sizeof(float));
  const std::uint64_t value_hash = XXH3_64bits(v.data(), v.size() * sizeof(float));
  const std::uint64_t expected_key_hash = 0xe59b5b9d5eb43045ull,
                      expected_value_hash = 0x51227fed303f1272ull;
  CHECK(key_hash == expected_key_hash);
  CHECK(value_hash == expected_value_hash);
}

TEST_CASE_TEMPLATE_DEFINE("golden checksums of the encoded segments", C, golden_id) {
  using Plan = typename C::plan;
  using T = typename C::element;
  constexpr int G = golden::group_size;
  const auto key_data = as_elements<T>(golden::golden_input(golden::key_seed, golden::shape));
  const auto value_data = as_elements<T>(golden::golden_input(golden::value_seed, golden::shape));
  const auto keys = lynx::token_major(key_data.data(), golden::shape);
  const auto values = lynx::token_major(value_data.data(), golden::shape);
  const auto encoded =
      lynx::encode<Plan, G, T>(keys, values, golden::layer, {golden::generation, 1});

  const golden::checksum_entry* entry = nullptr;
  for (const auto& e : golden::checksums)
    if (Plan::name() == e.plan && e.element == lynx::element_kind_of<T>()) entry = &e;
  REQUIRE_MESSAGE(entry != nullptr,
                  "no golden entry for plan " << Plan::name() << ", " << lynx::element_name<T>());
  REQUIRE(entry->streams == Plan::streams);

  std::string line = "    {\"" + Plan::name() +
                     "\", lynx::element_kind::" + lynx::element_name<T>() + ", " +
                     std::to_string(Plan::streams) + ", {";
  bool unfilled = true;
  for (int s = 0; s < Plan::streams; ++s) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "0x%016llxull",
                  static_cast<unsigned long long>(header_checksum(encoded.segment(s))));
    line += (s ? ", " : "") + std::string(hex);
    unfilled &= entry->checksum[s] == 0;
  }
  line += "}},";
  if (unfilled)
    std::printf("%s\n", line.c_str());  // the table line to paste into tests/support/golden.hpp
  INFO("actual: " << line);
  for (int s = 0; s < Plan::streams; ++s) {
    CHECK(header_checksum(encoded.segment(s)) == entry->checksum[s]);
    // The header's checksum is the one the receiver recomputes.
    const lynx::segment_header h =
        lynx::validate_segment(encoded.segment(s), encoded.geometry(), golden::layer);
    CHECK(h.generation == golden::generation);
    CHECK(h.layer == golden::layer);
  }
  // Any path to the same segments gives the same checksums: threads, split(quantize),
  // the portable kernels where the CPU runs the AVX-512 ones.
  const auto threaded =
      lynx::encode<Plan, G, T>(keys, values, golden::layer, {golden::generation, 2});
  const auto split = lynx::split<Plan, G>(lynx::quantize<Plan, G, T>(keys, values, golden::layer),
                                          golden::layer, golden::generation);
  const auto kernels =
      lynx::detail::codec_kernels_limit.exchange(lynx::detail::codec_kernels::portable);
  const auto portable =
      lynx::encode<Plan, G, T>(keys, values, golden::layer, {golden::generation, 1});
  lynx::detail::codec_kernels_limit.store(kernels);
  for (int s = 0; s < Plan::streams; ++s) {
    CHECK(header_checksum(threaded.segment(s)) == entry->checksum[s]);
    CHECK(header_checksum(split.segment(s)) == entry->checksum[s]);
    CHECK(header_checksum(portable.segment(s)) == entry->checksum[s]);
  }
}
TEST_CASE_TEMPLATE_APPLY(golden_id, golden_configs);

TEST_CASE("segment checksums: the dispatched XXH3 gives the inline XXH3's values") {
  // Where lynx::xxhash links libxxhash's run-time dispatch (LYNX_XXH3_DISPATCH),
  // payloads of 4 KiB or more go through it; the checksum must stay XXH3-64.
#if defined(LYNX_XXH3_DISPATCH) && LYNX_XXH3_DISPATCH
  MESSAGE("checksums of 4 KiB or more use libxxhash's XXH3_64bits_withSeed_dispatch");
#else
  MESSAGE("no dispatching libxxhash linked: checksums use the inline XXH3 only");
#endif
  std::vector<unsigned char> bytes((std::size_t{3} << 20) + 64);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x >> 56);
  }
  for (const std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{63}})
    for (const std::size_t length :
         {std::size_t{0}, std::size_t{1}, std::size_t{240}, std::size_t{4095}, std::size_t{4096},
          std::size_t{4097}, std::size_t{65536 + 13}, std::size_t{3} << 20}) {
      const std::uint64_t seed = length * 31 + offset;
      CAPTURE(offset);
      CAPTURE(length);
      CHECK(lynx::detail::xxh3_64(bytes.data() + offset, length, seed) ==
            XXH3_64bits_withSeed(bytes.data() + offset, length, seed));
    }
}
