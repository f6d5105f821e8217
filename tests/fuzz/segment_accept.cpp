// libFuzzer target: segments from the network into a request's receive side.
// A fixed receiver (two layers of 8 = 2 + 2 + 4, 40 tokens x 2 kv heads x 32)
// takes a sequence of segments built from the input: each step picks one of
// the six valid segments (or raw input bytes), flips input-chosen bytes, may
// truncate it, and may re-seal its checksum (what anyone on the path can do:
// XXH3 is unkeyed). Every refusal must be a lynx::error; whatever is accepted
// must reconstruct to finite values (a forged scale or zero point must have
// been refused at accept); the level never exceeds what was accepted.
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iinclude \
//       tests/fuzz/segment_accept.cpp -o /tmp/fuzz_segment_accept
//   /tmp/fuzz_segment_accept -max_total_time=60
//
// Built by hand for now (clang and its libFuzzer runtime); its place in CMake
// and .ci/run, beside targets for the TCP frames, the UCX header and the model
// loaders, is issue 32's.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/layer_set.hpp"

namespace {

using plan = lynx::plan_8_2_2_4;
const lynx::kv_shape shape{40, 2, 32};
constexpr std::uint64_t generation = 3;

const std::vector<std::vector<std::byte>>& valid_segments() {
  static const std::vector<std::vector<std::byte>> segments = [] {
    std::vector<std::vector<std::byte>> out;
    std::vector<float> k(static_cast<std::size_t>(shape.elements())), v(k.size());
    for (std::uint32_t l = 0; l < 2; ++l) {
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] =
            static_cast<float>(static_cast<int>((i + 7 * l) * 2654435761u % 2001u) - 1000) / 400.0f;
        v[i] = static_cast<float>(static_cast<int>((i + 3 * l) * 40503u % 1777u) - 888) / 300.0f;
      }
      const auto e = lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                                   lynx::token_major<const float>(v.data(), shape),
                                                   l, {.generation = generation});
      for (int s = 0; s < plan::streams; ++s)
        out.emplace_back(e.segment(s).begin(), e.segment(s).end());
    }
    return out;
  }();
  return segments;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<lynx::bitplane_tensor<plan>> tensors;
  for (std::uint32_t l = 0; l < 2; ++l) tensors.emplace_back(shape, l, generation);
  lynx::layer_set<plan> received(tensors);
  std::size_t at = 0;
  auto next = [&](std::size_t n) -> std::uint64_t {  // little-endian, zero past the end
    std::uint64_t x = 0;
    for (std::size_t i = 0; i < n; ++i, ++at)
      x |= std::uint64_t{at < size ? data[at] : 0u} << (8 * i);
    return x;
  };
  for (int step = 0; step < 12 && at < size; ++step) {
    const auto op = static_cast<std::uint8_t>(next(1));
    std::vector<std::byte> seg;
    if ((op & 7) < 6) {
      seg = valid_segments()[op & 7];
    } else {  // raw input bytes as a segment
      const std::size_t n = std::min<std::size_t>(next(2), size - std::min(at, size));
      seg.assign(reinterpret_cast<const std::byte*>(data + at),
                 reinterpret_cast<const std::byte*>(data + at + n));
      at += n;
    }
    const int flips = static_cast<int>((op >> 3) & 3);
    for (int f = 0; f < flips && !seg.empty(); ++f) {
      const std::size_t where = next(3) % seg.size();
      seg[where] ^= static_cast<std::byte>(next(1) | 1u);
    }
    if (op & 0x20) seg.resize(next(3) % (seg.size() + 1));  // truncated
    if ((op & 0x40) && seg.size() >= lynx::segment_header_bytes) {
      try {
        lynx::seal_segment(seg);  // a forger re-seals
      } catch (const lynx::error&) {
      }
    }
    try {
      (void)received.accept(seg);
    } catch (const lynx::error&) {
      // refused: fine, and the state must not have changed (checked by the level below)
    }
    if (received.level() < 0 || received.level() > plan::streams) std::abort();
  }
  // Whatever was accepted reconstructs to finite values.
  std::vector<float> k(static_cast<std::size_t>(shape.elements())), v(k.size());
  for (const auto& t : tensors) {
    if (t.precision_level() == 0) continue;
    lynx::reconstruct(t, lynx::token_major<float>(k.data(), shape),
                      lynx::token_major<float>(v.data(), shape));
    for (std::size_t i = 0; i < k.size(); ++i)
      if (!std::isfinite(k[i]) || !std::isfinite(v[i])) std::abort();
  }
  return 0;
}
