// lynx::layer_set: segments routed to their layer's tensor by header, in any
// order; the level present on every layer rises only when the last layer gets
// the stream; duplicates change nothing; missing() lists exactly what has not
// landed; a bad segment (magic, layer out of range, stale generation, truncated,
// damaged) throws with its error code and changes nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/layer_set.hpp"

namespace {

using plan = lynx::plan_8_2_2_4;  // three streams
using tensor = lynx::bitplane_tensor<plan, 32, lynx::host_space>;
const lynx::kv_shape shape{70, 2, 32};
constexpr int n_layers = 3;
constexpr std::uint64_t generation = 5;

std::vector<lynx::encoded_layer<plan>> encode_all(std::uint64_t gen = generation) {
  std::vector<lynx::encoded_layer<plan>> out;
  std::vector<float> k(static_cast<std::size_t>(shape.tokens * shape.kv_heads * shape.head_dim));
  std::vector<float> v(k.size());
  for (int l = 0; l < n_layers; ++l) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] =
          static_cast<float>(static_cast<int>((i + 97 * l) * 2654435761u % 2001u) - 1000) / 400.0f;
      v[i] = static_cast<float>(static_cast<int>((i + 31 * l) * 40503u % 1777u) - 888) / 300.0f;
    }
    out.push_back(lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                                lynx::token_major<const float>(v.data(), shape),
                                                static_cast<std::uint32_t>(l),
                                                {.generation = gen}));
  }
  return out;
}

std::vector<tensor> receivers() {
  std::vector<tensor> t;
  for (int l = 0; l < n_layers; ++l)
    t.emplace_back(shape, static_cast<std::uint32_t>(l), generation);
  return t;
}

lynx::errc code_of(auto&& f) {
  try {
    f();
  } catch (const lynx::error& e) {
    return e.code();
  }
  return lynx::errc::ok;
}

}  // namespace

TEST_CASE("segments in any order: the level rises when the last layer gets a stream") {
  const auto layers = encode_all();
  std::vector<std::pair<int, int>> order;  // (layer, stream)
  for (int l = 0; l < n_layers; ++l)
    for (int s = 0; s < plan::streams; ++s) order.emplace_back(l, s);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    auto t = receivers();
    lynx::layer_set<plan> set(t);
    CHECK(set.level() == 0);
    CHECK(set.missing().size() == static_cast<std::size_t>(n_layers * plan::streams));
    std::vector<int> have(n_layers, 0);  // streams held per layer (a prefix counts)
    std::vector<std::vector<bool>> got(n_layers, std::vector<bool>(plan::streams, false));
    int expected_accepted = 0;
    for (const auto& [l, s] : order) {
      const auto r = set.accept(layers[static_cast<std::size_t>(l)].segment(s));
      got[static_cast<std::size_t>(l)][static_cast<std::size_t>(s)] = true;
      ++expected_accepted;
      // the level of a layer: its longest prefix of streams
      int level = plan::streams;
      for (int m = 0; m < n_layers; ++m) {
        int p = 0;
        while (p < plan::streams && got[static_cast<std::size_t>(m)][static_cast<std::size_t>(p)])
          ++p;
        level = std::min(level, p);
      }
      CHECK(r.result == lynx::accept_result::accepted);
      CHECK(r.id.layer == static_cast<std::uint32_t>(l));
      CHECK(r.id.stream == s);
      CHECK(r.id.generation == generation);
      CHECK(r.level == level);
      CHECK(set.level() == level);
      // a duplicate changes nothing and never raises the level
      const auto d = set.accept(layers[static_cast<std::size_t>(l)].segment(s));
      CHECK(d.result == lynx::accept_result::duplicate);
      CHECK_FALSE(d.level_rose);
      CHECK(d.level == level);
      std::size_t missing = 0;
      for (const auto& row : got)
        missing += static_cast<std::size_t>(std::count(row.begin(), row.end(), false));
      const auto m = set.missing();
      REQUIRE(m.size() == missing);
      for (const auto& id : m) {
        CHECK_FALSE(got[id.layer][static_cast<std::size_t>(id.stream)]);
        CHECK(id.generation == generation);
      }
    }
    CHECK(set.complete());
    CHECK(set.accepted() == expected_accepted);
    CHECK(set.duplicates() == expected_accepted);
  }
}

TEST_CASE("a bad segment throws its error and changes nothing") {
  const auto layers = encode_all();
  const auto stale = encode_all(generation + 1);
  auto t = receivers();
  lynx::layer_set<plan> set(t);
  set.accept(layers[0].segment(0));
  set.accept(layers[1].segment(0));
  const auto before = set.missing();

  std::vector<std::byte> bad(layers[2].segment(0).begin(), layers[2].segment(0).end());
  bad[0] ^= std::byte{0xff};  // magic
  CHECK(code_of([&] { set.accept(bad); }) == lynx::errc::bad_magic);

  std::vector<std::byte> far(layers[2].segment(0).begin(), layers[2].segment(0).end());
  far[8] = std::byte{7};  // the header's layer field (little-endian u32 after magic and version)
  lynx::segment_header h = lynx::peek_header(far);
  CHECK(h.layer == 7);
  try {
    set.accept(far);
    FAIL("a segment of layer 7 was accepted by a 3-layer set");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::layer_mismatch);
    CHECK(std::string(e.what()).find("segment of layer 7 for a 3-layer model") !=
          std::string::npos);
  }
  CHECK(code_of([&] { set.accept(stale[2].segment(0)); }) == lynx::errc::stale_generation);
  std::vector<std::byte> cut(layers[2].segment(0).begin(), layers[2].segment(0).begin() + 5);
  CHECK(code_of([&] { set.accept(cut); }) == lynx::errc::truncated_segment);
  std::vector<std::byte> flipped(layers[2].segment(0).begin(), layers[2].segment(0).end());
  flipped[flipped.size() - 1] ^= std::byte{1};
  CHECK(code_of([&] { set.accept(flipped); }) == lynx::errc::corrupted_segment);

  CHECK(set.level() == 0);
  CHECK(set.accepted() == 2);
  CHECK(set.duplicates() == 0);
  CHECK(set.missing().size() == before.size());
  CHECK(set.accept(layers[2].segment(0)).level_rose);
  CHECK(set.level() == 1);
}

TEST_CASE("the tensors must be in layer order") {
  std::vector<tensor> t;
  t.emplace_back(shape, 1, generation);
  t.emplace_back(shape, 0, generation);
  try {
    lynx::layer_set<plan> set(t);
    FAIL("tensors out of order were taken");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::invalid_argument);
    CHECK(std::string(e.what()).find("the tensor at index 0 receives layer 1") !=
          std::string::npos);
  }
}
