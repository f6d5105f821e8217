// lynx::slot_tensor: a receiver over caller-owned segment slots. A segment
// written into its slot is validated where it lies and becomes visible without
// a copy (the view's payload pointers are the slots'); attention and
// reconstruct over it give the bits of bitplane_tensor's; every refusal
// (damaged, stale generation, another stream's segment in the slot, damaged
// parameters) leaves the tensor as it was; duplicates are idempotent; the copy
// path (a segment delivered elsewhere) lands in the slot; bad slots are
// refused at construction; reset() serves the next request.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "lynx/attention/decode_attention.hpp"
#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/tensor.hpp"

namespace {

using plan = lynx::plan_8_4_4;
const lynx::kv_shape shape{300, 2, 64};
constexpr std::uint64_t generation = 3;

struct fixture {
  std::vector<float> k, v;
  lynx::encoded_layer<plan> layer;
  std::vector<lynx::aligned_buffer> buffers;
  std::vector<std::span<std::byte>> slots;

  static lynx::encoded_layer<plan> encode_layer(const std::vector<float>& k,
                                                const std::vector<float>& v, std::uint64_t gen) {
    return lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                         lynx::token_major<const float>(v.data(), shape), 1,
                                         {.generation = gen});
  }
  fixture()
      : k(static_cast<std::size_t>(shape.elements())),
        v(k.size()),
        layer((fill(), encode_layer(k, v, generation))) {
    const auto g = lynx::make_geometry<plan, 32>(shape);
    for (int s = 0; s < plan::streams; ++s) {
      buffers.emplace_back(lynx::segment_bytes(g, s));
      slots.emplace_back(buffers.back().data(), buffers.back().size());
    }
  }
  void fill() {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f;
      v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f;
    }
  }
  /// What a transport does: the whole segment into its slot.
  void deliver(int s) {
    std::memcpy(slots[static_cast<std::size_t>(s)].data(), layer.segment(s).data(),
                layer.segment(s).size());
  }
};

std::vector<float> attend(const lynx::bitplane_view<plan, 32, lynx::host_space>& view) {
  constexpr int q_heads = 4, n = 2;
  std::vector<float> q(static_cast<std::size_t>(n * q_heads * 64)), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>(static_cast<int>(i * 7919u % 613u) - 306) / 97.0f;
  const lynx::kv_view<const float, lynx::host_space> no_tail{};
  const lynx::attention_queries queries{q.data(), n, q_heads, 64};
  const lynx::tail_visibility vis{0, 0};
  lynx::decode_attention<> attention{};
  lynx::attention_workspace ws(attention.problem(view, no_tail, queries, vis), 2);
  attention(view, no_tail, no_tail, queries, vis, {out.data()}, ws, {.threads = 2});
  return out;
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

TEST_CASE("segments validated in their slots: visible without a copy, the bits of accept") {
  fixture f;
  lynx::slot_tensor<plan> t(shape, 1, generation, f.slots);
  lynx::bitplane_tensor<plan> copy(shape, 1, generation);
  for (int s = 0; s < plan::streams; ++s) {
    CAPTURE(s);
    f.deliver(s);
    CHECK(t.accept_in_place(s) == lynx::accept_result::accepted);
    CHECK(copy.accept(f.layer.segment(s)) == lynx::accept_result::accepted);
    CHECK(t.precision_level() == s + 1);
    // zero copy: the view reads the slot itself
    CHECK(t.view().payload[static_cast<std::size_t>(s)] ==
          f.slots[static_cast<std::size_t>(s)].data() + lynx::segment_header_bytes);
    CHECK(attend(t.view()) == attend(copy.view()));
    std::vector<float> a(f.k.size()), b(f.k.size()), c(f.k.size()), d(f.k.size());
    lynx::reconstruct(t.view(), lynx::token_major<float>(a.data(), shape),
                      lynx::token_major<float>(b.data(), shape));
    lynx::reconstruct(copy, lynx::token_major<float>(c.data(), shape),
                      lynx::token_major<float>(d.data(), shape));
    CHECK(std::memcmp(a.data(), c.data(), a.size() * 4) == 0);
    CHECK(std::memcmp(b.data(), d.data(), b.size() * 4) == 0);
  }
  CHECK(t.accept_in_place(0) == lynx::accept_result::duplicate);
  CHECK(t.complete());
}

TEST_CASE("refusals leave the tensor as it was") {
  fixture f;
  lynx::slot_tensor<plan> t(shape, 1, generation, f.slots);
  SUBCASE("a damaged segment in its slot") {
    f.deliver(0);
    f.slots[0][f.slots[0].size() / 2] ^= std::byte{1};
    CHECK(code_of([&] { t.accept_in_place(0); }) == lynx::errc::corrupted_segment);
    CHECK(t.precision_level() == 0);
    f.deliver(0);  // the resend, written again before anything was accepted
    CHECK(t.accept_in_place(0) == lynx::accept_result::accepted);
  }
  SUBCASE("another stream's segment in the slot") {
    std::memcpy(f.slots[0].data(), f.layer.segment(1).data(), f.layer.segment(1).size());
    CHECK(code_of([&] { t.accept_in_place(0); }) != lynx::errc::ok);
    CHECK(t.precision_level() == 0);
  }
  SUBCASE("a stale generation") {
    const auto old = fixture::encode_layer(f.k, f.v, generation - 1);
    std::memcpy(f.slots[0].data(), old.segment(0).data(), old.segment(0).size());
    CHECK(code_of([&] { t.accept_in_place(0); }) == lynx::errc::stale_generation);
    CHECK(t.precision_level() == 0);
  }
  SUBCASE("the copy path: delivered elsewhere, copied into the slot; a refusal copies nothing") {
    std::vector<std::byte> bad(f.layer.segment(0).begin(), f.layer.segment(0).end());
    bad[bad.size() - 3] ^= std::byte{4};
    std::memset(f.slots[0].data(), 0x5a, f.slots[0].size());
    CHECK(code_of([&] { t.accept(bad); }) == lynx::errc::corrupted_segment);
    CHECK(f.slots[0][200] == std::byte{0x5a});
    CHECK(t.accept(f.layer.segment(0)) == lynx::accept_result::accepted);
    CHECK(std::memcmp(f.slots[0].data(), f.layer.segment(0).data(), f.layer.segment(0).size()) ==
          0);
    CHECK(t.precision_level() == 1);
  }
  SUBCASE("re-sealed parameters: refused where they lie, unless every range is finite") {
    // The checksum pass scans the anchor's parameters (lynx::stream_ledger::admit);
    // its bound on the ranges is only a filter: a range near the float limit is
    // checked group by group and taken, a NaN scale or an overflowing range refused.
    const auto g = lynx::make_geometry<plan, 32>(shape);
    const std::int64_t at = lynx::segment_header_bytes + g.param_section_offset(2, 2) + 2 * 5;
    const auto forge = [&](std::uint16_t bits) {
      f.deliver(0);
      std::memcpy(f.slots[0].data() + at, &bits, 2);
      lynx::seal_segment(f.slots[0]);
    };
    forge(0x7fc1);  // NaN
    std::string msg;
    try {
      t.accept_in_place(0);
    } catch (const lynx::error& e) {
      CHECK(e.code() == lynx::errc::corrupted_segment);
      msg = e.what();
    }
    CHECK(msg.find("value parameters of kv head 0, token 2, channel group 1") != std::string::npos);
    CHECK(t.precision_level() == 0);
    forge(static_cast<std::uint16_t>(0x7f00));  // 2^127: the range overflows
    CHECK(code_of([&] { t.accept_in_place(0); }) == lynx::errc::corrupted_segment);
    CHECK(t.precision_level() == 0);
    // 2^(127 - 8): a range just under 2^127, finite; the view reads it as it lies
    forge(static_cast<std::uint16_t>((254 - plan::bits) << 7));
    CHECK(t.accept_in_place(0) == lynx::accept_result::accepted);
    CHECK(static_cast<float>(t.view().value_scale()[5]) == std::ldexp(1.0f, 127 - plan::bits));
  }
  SUBCASE("reset serves the next request's generation") {
    f.deliver(0);
    CHECK(t.accept_in_place(0) == lynx::accept_result::accepted);
    t.reset(generation + 1);
    CHECK(t.precision_level() == 0);
    CHECK(code_of([&] { t.accept_in_place(0); }) == lynx::errc::stale_generation);
    const auto next = fixture::encode_layer(f.k, f.v, generation + 1);
    std::memcpy(f.slots[0].data(), next.segment(0).data(), next.segment(0).size());
    CHECK(t.accept_in_place(0) == lynx::accept_result::accepted);
  }
}

TEST_CASE("bad slots are refused at construction") {
  fixture f;
  auto short_slots = f.slots;
  short_slots[1] = short_slots[1].first(short_slots[1].size() - 1);
  CHECK(code_of([&] { lynx::slot_tensor<plan> t(shape, 1, generation, short_slots); }) ==
        lynx::errc::invalid_argument);
  auto misaligned = f.slots;
  std::vector<std::byte> big(f.slots[0].size() + 64);
  auto* p = big.data();
  while (reinterpret_cast<std::uintptr_t>(p) % 64 != 8) ++p;
  misaligned[0] = std::span<std::byte>(p, f.slots[0].size());
  CHECK(code_of([&] { lynx::slot_tensor<plan> t(shape, 1, generation, misaligned); }) ==
        lynx::errc::invalid_argument);
  CHECK(code_of([&] {
          lynx::slot_tensor<plan> t(shape, 1, generation,
                                    std::span<const std::span<std::byte>>(f.slots).first(1));
        }) == lynx::errc::invalid_argument);
}
