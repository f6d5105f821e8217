// One-sided writes into registered receive memory (the shape of NIXL and
// Mooncake transfers), modelled by the loopback link: the receiver registers
// the slots of a lynx::slot_tensor, the sender posts each segment naming its
// slot (remote_slot: key, offset), the notification's bytes are the slot
// itself, and the tensor validates them in place: the layer's attention bits
// equal bitplane_tensor's. A damaged write is refused and the resend into the
// same slot is taken; a write to an unknown region or past its end is refused
// at post; transports without one-sided writes refuse a post that names a slot.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/transport/loopback.hpp"
#include "lynx/transport/simulated_link.hpp"

namespace {

using plan = lynx::plan_8_4_4;
const lynx::kv_shape shape{200, 2, 64};
constexpr std::uint64_t generation = 9;

lynx::encoded_layer<plan> some_layer() {
  std::vector<float> k(static_cast<std::size_t>(shape.elements())), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f;
    v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f;
  }
  return lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                       lynx::token_major<const float>(v.data(), shape), 0,
                                       {.generation = generation});
}

/// One registered region holding every stream's slot, 64-byte aligned each.
struct receive_memory {
  lynx::aligned_buffer region;
  std::vector<std::uint64_t> offsets;
  std::vector<std::span<std::byte>> slots;
  receive_memory() {
    const auto g = lynx::make_geometry<plan, 32>(shape);
    std::uint64_t total = 0;
    for (int s = 0; s < plan::streams; ++s) {
      offsets.push_back(total);
      total += (lynx::segment_bytes(g, s) + 63) / 64 * 64;
    }
    region = lynx::aligned_buffer(total);
    for (int s = 0; s < plan::streams; ++s)
      slots.emplace_back(region.data() + offsets[static_cast<std::size_t>(s)],
                         lynx::segment_bytes(g, s));
  }
};

lynx::receive_result<std::chrono::steady_clock> next(lynx::loopback_link& link) {
  return link.receiver().try_receive(std::chrono::steady_clock::now() + std::chrono::seconds(5));
}

}  // namespace

TEST_CASE("one-sided writes into a slot_tensor's slots: validated where they landed") {
  const auto layer = some_layer();
  receive_memory mem;
  lynx::loopback_link link;
  const std::uint64_t key =
      link.register_region(std::span<std::byte>(mem.region.data(), mem.region.size()));
  lynx::slot_tensor<plan> t(shape, 0, generation, mem.slots);
  lynx::bitplane_tensor<plan> reference(shape, 0, generation);
  for (int s = 0; s < plan::streams; ++s) {
    const auto seg = layer.segment(s);
    const auto posted = link.sender().post({seg,
                                            {0, s, generation},
                                            lynx::lane_for_stream(s, 2),
                                            static_cast<std::uint8_t>(s),
                                            {key, mem.offsets[static_cast<std::size_t>(s)]}});
    REQUIRE(posted.ok());
    const auto r = next(link);
    REQUIRE(r.ok());
    // the notification's bytes are the slot: nothing was copied on the receiving side
    CHECK(r.segment.bytes.data() == mem.slots[static_cast<std::size_t>(s)].data());
    CHECK(r.segment.bytes.size() == seg.size());
    CHECK(t.accept(r.segment.bytes) == lynx::accept_result::accepted);
    link.receiver().release(r.segment);
    reference.accept(seg);
  }
  CHECK(t.complete());
  for (int s = 0; s < plan::streams; ++s)
    CHECK(std::memcmp(t.view().payload[static_cast<std::size_t>(s)],
                      reference.view().payload[static_cast<std::size_t>(s)],
                      layer.segment(s).size() - lynx::segment_header_bytes) == 0);
  // every post gets its delivered event
  int delivered = 0;
  while (auto e = link.sender().next_event(std::chrono::steady_clock::now()))
    delivered += e->kind == lynx::completion_kind::delivered && e->status == lynx::errc::ok;
  CHECK(delivered == plan::streams);
}

TEST_CASE("a damaged one-sided write is refused; the resend into the same slot is taken") {
  const auto layer = some_layer();
  receive_memory mem;
  lynx::loopback_link link;
  const std::uint64_t key =
      link.register_region(std::span<std::byte>(mem.region.data(), mem.region.size()));
  lynx::slot_tensor<plan> t(shape, 0, generation, mem.slots);
  int posts = 0;
  link.set_fault_hook([&](const lynx::send_request&, std::uint64_t) {
    return posts++ == 0 ? lynx::fault{lynx::fault_kind::corrupt, 300} : lynx::fault{};
  });
  const lynx::send_request req{layer.segment(0), {0, 0, generation}, 0, 0, {key, mem.offsets[0]}};
  REQUIRE(link.sender().post(req).ok());
  auto r = next(link);
  REQUIRE(r.ok());
  CHECK_THROWS_AS(t.accept(r.segment.bytes), lynx::error);
  CHECK(t.precision_level() == 0);
  link.receiver().release(r.segment);
  REQUIRE(link.sender().post(req).ok());  // the resend
  r = next(link);
  REQUIRE(r.ok());
  CHECK(t.accept(r.segment.bytes) == lynx::accept_result::accepted);
  CHECK(t.precision_level() == 1);
}

TEST_CASE(
    "writes to an unknown region, past a region's end, or on a two-sided transport are refused") {
  const auto layer = some_layer();
  receive_memory mem;
  lynx::loopback_link link;
  const std::uint64_t key =
      link.register_region(std::span<std::byte>(mem.region.data(), mem.region.size()));
  const auto seg = layer.segment(0);
  CHECK(link.sender().post({seg, {}, 0, 0, {key + 1, 0}}).status == lynx::errc::invalid_argument);
  CHECK(link.sender().post({seg, {}, 0, 0, {key, mem.region.size() - seg.size() + 1}}).status ==
        lynx::errc::invalid_argument);
  CHECK(link.sender().post({seg, {}, 0, 0, {key, mem.region.size() + 64}}).status ==
        lynx::errc::invalid_argument);
  lynx::simulated_link sim(lynx::simulated_link_options::one_lane(1'000'000'000, {}));
  CHECK(sim.sender().post({seg, {}, 0, 0, {1, 0}}).status == lynx::errc::invalid_argument);
  CHECK(sim.sender().post({seg, {}, 0, 0, {}}).ok());
}
