// lynx::background_merge: a complete prompt merged into codes on a helper
// thread gives, layer for layer, the bits of a code_tensor made on the spot;
// layers are readable while the rest are merged; incomplete layers are refused
// before a thread starts; kept slots are reused; cancel and destruction stop it;
// an error on the helper thread stops the merge and wait() rethrows it.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <new>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "lynx/attention/background_merge.hpp"
#include "lynx/planes/codec.hpp"

namespace {

std::vector<float> random_kv(const lynx::kv_shape& s, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(s.elements()));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = n(gen) + static_cast<float>(i % 7);  // channel-dependent offsets
  return x;
}

template <class Plan>
std::vector<lynx::bitplane_tensor<Plan>> make_layers(const std::vector<lynx::kv_shape>& shapes,
                                                     unsigned seed, int streams = Plan::streams) {
  std::vector<lynx::bitplane_tensor<Plan>> layers;
  for (std::size_t l = 0; l < shapes.size(); ++l) {
    const auto k = random_kv(shapes[l], seed + 2 * static_cast<unsigned>(l));
    const auto v = random_kv(shapes[l], seed + 2 * static_cast<unsigned>(l) + 1);
    const auto enc = lynx::encode<Plan>(lynx::token_major<const float>(k.data(), shapes[l]),
                                        lynx::token_major<const float>(v.data(), shapes[l]),
                                        static_cast<std::uint32_t>(l));
    layers.emplace_back(shapes[l], static_cast<std::uint32_t>(l));
    for (int s = 0; s < streams; ++s) layers.back().accept(enc.segment(s));
  }
  return layers;
}

// Geometry, layer, parameters and every code (padding included) bitwise equal.
template <class Plan>
bool same_codes(const lynx::code_tensor<Plan>& a, const lynx::code_tensor<Plan>& b) {
  const auto va = a.view(), vb = b.view();
  const lynx::layer_geometry& g = va.geometry;
  const std::size_t bytes = static_cast<std::size_t>(g.kv_heads * g.blocks() * 32 * g.head_dim) *
                            sizeof(typename lynx::code_tensor<Plan>::code_type);
  return va.geometry == vb.geometry && va.layer == vb.layer &&
         std::memcmp(va.params, vb.params, static_cast<std::size_t>(g.wire_params_bytes())) == 0 &&
         std::memcmp(va.key_codes, vb.key_codes, bytes) == 0 &&
         std::memcmp(va.value_codes, vb.value_codes, bytes) == 0;
}

const std::vector<lynx::kv_shape> shapes{
    {1, 2, 64}, {37, 2, 64}, {1100, 2, 64}, {300, 1, 128}, {65, 3, 16}};

}  // namespace

TEST_CASE_TEMPLATE("background_merge: every layer's codes are those of a code_tensor", Plan,
                   lynx::plan_8_4_4, lynx::plan_8_2_2_4, lynx::plan_16_4_12, lynx::plan_16_4_4_8) {
  const auto layers = make_layers<Plan>(shapes, 11);
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    lynx::background_merge<Plan> merge{std::span(layers), threads};
    CHECK(merge.size() == layers.size());
    // read layers while the rest are merged: whatever is published is complete
    std::size_t seen = 0;
    bool grew_in_order = true, published_whole = true;
    while (!merge.done()) {
      const std::size_t r = merge.ready();
      grew_in_order &= r >= seen && r <= layers.size();  // a prefix that only grows
      seen = r;
      for (std::size_t i = 0; i < r; ++i) {
        const auto* c = merge.layer(i);
        published_whole &= c != nullptr && c->layer() == static_cast<std::uint32_t>(i) &&
                           c->geometry().tokens == layers[i].shape().tokens;
      }
      // the entry in progress is not visible
      if (r < layers.size()) published_whole &= merge.layer(r) == nullptr || merge.ready() > r;
    }
    CHECK(grew_in_order);
    CHECK(published_whole);
    merge.wait();
    CHECK_FALSE(merge.failed());
    REQUIRE(merge.ready() == layers.size());
    CHECK(merge.elapsed().count() >= 0);
    CHECK(merge.finished_at() >= merge.started_at());
    for (std::size_t i = 0; i < layers.size(); ++i) {
      CAPTURE(i);
      const auto* c = merge.layer(i);
      REQUIRE(c != nullptr);
      CHECK(same_codes(*c, lynx::code_tensor<Plan>(layers[i])));
    }
    CHECK_THROWS_AS((void)merge.layer(layers.size()), lynx::error);
  }
}

TEST_CASE("background_merge: an incomplete layer is refused before anything starts") {
  using plan = lynx::plan_16_4_4_8;
  auto layers = make_layers<plan>(shapes, 21);
  auto partial = make_layers<plan>({{40, 1, 16}}, 23, 2);
  std::vector<lynx::bitplane_view<plan, 32, lynx::host_space>> views;
  for (const auto& t : layers) views.push_back(t.view());
  views.insert(views.begin() + 2, partial[0].view());
  try {
    lynx::background_merge<plan> merge(views);
    FAIL("no error thrown");
  } catch (const lynx::error& e) {
    CHECK(e.code() == lynx::errc::invalid_argument);
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("layer 0 (entry 2) has 2 of 3 streams") != std::string::npos);
  }
}

TEST_CASE("background_merge: nothing to merge is done at once") {
  lynx::background_merge<lynx::plan_8_4_4> idle;
  CHECK(idle.done());
  CHECK(idle.size() == 0);
  idle.wait();
  CHECK_THROWS_AS((void)idle.layer(0), lynx::error);
  lynx::background_merge<lynx::plan_8_4_4> empty(
      std::vector<lynx::bitplane_view<lynx::plan_8_4_4, 32, lynx::host_space>>{});
  empty.wait();
  CHECK(empty.done());
  CHECK(empty.ready() == 0);
  CHECK(empty.release().empty());
}

TEST_CASE("background_merge: the slots of one request are reused by the next") {
  using plan = lynx::plan_8_4_4;
  const auto first = make_layers<plan>(shapes, 31);
  std::vector<lynx::code_tensor<plan>> slots;
  std::vector<const void*> buffers;
  {
    lynx::background_merge<plan> merge{std::span(first)};
    merge.wait();
    slots = merge.release();
    CHECK(merge.size() == 0);
    CHECK(merge.ready() == 0);
  }
  REQUIRE(slots.size() == shapes.size());
  for (const auto& s : slots) buffers.push_back(s.view().key_codes);
  // the next request: the same number of layers, each no larger
  const std::vector<lynx::kv_shape> smaller{
      {1, 2, 64}, {20, 2, 64}, {900, 2, 64}, {300, 1, 128}, {64, 3, 16}};
  const auto second = make_layers<plan>(smaller, 41);
  lynx::background_merge<plan> merge{std::span(second), 2, std::move(slots)};
  merge.wait();
  for (std::size_t i = 0; i < second.size(); ++i) {
    CAPTURE(i);
    const auto* c = merge.layer(i);
    REQUIRE(c != nullptr);
    CHECK(static_cast<const void*>(c->view().key_codes) == buffers[i]);  // no new allocation
    CHECK(same_codes(*c, lynx::code_tensor<plan>(second[i])));
  }
  // more layers than slots: the extra ones start empty
  std::vector<lynx::code_tensor<plan>> two;
  two.emplace_back(first[0]);
  two.emplace_back(first[1]);
  lynx::background_merge<plan> more{std::span(second), 1, std::move(two)};
  more.wait();
  REQUIRE(more.ready() == second.size());
  for (std::size_t i = 0; i < second.size(); ++i)
    CHECK(same_codes(*more.layer(i), lynx::code_tensor<plan>(second[i])));
}

TEST_CASE("background_merge: cancel and destruction stop it; merged layers stay exact") {
  using plan = lynx::plan_16_4_12;
  const std::vector<lynx::kv_shape> big(6, lynx::kv_shape{4096, 2, 64});
  const auto layers = make_layers<plan>(big, 51);
  {
    lynx::background_merge<plan> merge{std::span(layers)};
    merge.cancel();
    merge.wait();
    CHECK(merge.done());
    CHECK_FALSE(merge.failed());
    const std::size_t r = merge.ready();
    MESSAGE("cancelled at once: " << r << " of " << layers.size() << " layers merged");
    CHECK(r <= layers.size());
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const auto* c = merge.layer(i);
      CHECK((c != nullptr) == (i < r));
      if (c != nullptr) CHECK(same_codes(*c, lynx::code_tensor<plan>(layers[i])));
    }
  }
  for (int i = 0; i < 3; ++i) {
    lynx::background_merge<plan> merge{std::span(layers), 2};  // destroyed while running
  }
  {
    lynx::background_merge<plan> merge{std::span(layers)};
    auto slots = merge.release();  // waits for the layer in progress
    CHECK(slots.size() == layers.size());
  }
}

TEST_CASE("background_merge: an error on the helper thread stops it; wait() rethrows it") {
  // The second entry claims 2^52 tokens: the merge cannot allocate its codes (more
  // bytes than an x86-64 address space holds), which fails on the helper thread
  // before anything is read. (The sanitizers' allocators are told to return null for
  // it, as the C library does, rather than abort: see the options at the end.)
  const auto layers = make_layers<lynx::plan_8_4_4>({{100, 2, 64}, {40, 1, 64}}, 71);
  std::vector<lynx::bitplane_view<lynx::plan_8_4_4, 32, lynx::host_space>> views{
      layers[0].view(), layers[1].view(), layers[0].view()};
  views[1].geometry.tokens = std::int64_t{1} << 52;
  lynx::background_merge<lynx::plan_8_4_4> merge(views);
  CHECK_THROWS_AS(merge.wait(), std::bad_alloc);
  CHECK(merge.done());
  CHECK(merge.failed());
  CHECK(merge.ready() == 1);  // the layer before the error stays published, and exact
  REQUIRE(merge.layer(0) != nullptr);
  CHECK(same_codes(*merge.layer(0), lynx::code_tensor<lynx::plan_8_4_4>(layers[0])));
  CHECK(merge.layer(1) == nullptr);
  CHECK(merge.layer(2) == nullptr);               // nothing after the error is merged
  CHECK_THROWS_AS(merge.wait(), std::bad_alloc);  // every wait() reports it
  CHECK(merge.elapsed() > std::chrono::steady_clock::duration{});
  // the slots come back, and a merge of complete layers with them succeeds
  auto slots = merge.release();
  CHECK(slots.size() == 3);
  lynx::background_merge<lynx::plan_8_4_4> again{std::span(layers), 1, std::move(slots)};
  again.wait();
  CHECK_FALSE(again.failed());
  CHECK(again.ready() == 2);
}

// An allocation larger than the sanitizers' allocators support returns null (as
// glibc's does) instead of aborting the test.
#if defined(__SANITIZE_ADDRESS__)
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
#endif
#if defined(__SANITIZE_THREAD__)
extern "C" const char* __tsan_default_options() { return "allocator_may_return_null=1"; }
#endif
