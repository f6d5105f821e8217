// Quickstart: encode one layer's K and V into an anchor and a residual segment,
// deliver the anchor, reconstruct, deliver the residual, reconstruct again,
// printing the error at each precision level.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "lynx/lynx.hpp"

// [quickstart]
int main() {
  // One layer of a KV cache: 1000 tokens x 8 KV heads x 128 channels, bf16, token-major.
  const lynx::kv_shape shape{1000, 8, 128};
  std::vector<lynx::bf16> keys(shape.elements()), values(shape.elements());
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  for (auto& k : keys) k = lynx::bf16(normal(rng));
  for (auto& v : values) v = lynx::bf16(normal(rng));

  // Prefill node: quantize to 8-bit codes and split them as 8 = 4 + 4.
  using plan = lynx::plan_8_4_4;
  const auto segments =
      lynx::encode<plan>(lynx::token_major<const lynx::bf16>(keys.data(), shape),
                         lynx::token_major<const lynx::bf16>(values.data(), shape), /*layer=*/0);

  // Decode node: a receiver tensor takes segments in any order, checks them, and
  // knows its precision level.
  lynx::bitplane_tensor<plan> received(shape, /*layer=*/0);
  std::vector<float> k_out(shape.elements()), v_out(shape.elements());
  auto report = [&](const char* when) {
    lynx::reconstruct(received, lynx::token_major(k_out.data(), shape),
                      lynx::token_major(v_out.data(), shape));
    double k_err = 0, v_err = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      k_err = std::fmax(k_err, std::fabs(k_out[i] - static_cast<float>(keys[i])));
      v_err = std::fmax(v_err, std::fabs(v_out[i] - static_cast<float>(values[i])));
    }
    std::printf("%-26s level %d (%d of %d planes): max |error| K %.5f, V %.5f\n", when,
                received.precision_level(), received.planes_present(), plan::bits, k_err, v_err);
  };
  received.accept(segments.segment(0));  // the anchor: top 4 planes + scales and zero points
  report("after the anchor:");
  received.accept(segments.segment(1));  // the residual: the other 4 planes
  report("after the residual:");
  received.accept(segments.segment(1));  // delivering twice changes nothing
  std::printf("segments: anchor %zu bytes, residual %zu bytes (bf16 K+V: %zu bytes)\n",
              segments.segment(0).size(), segments.segment(1).size(),
              2 * keys.size() * sizeof(lynx::bf16));
  return received.complete() ? 0 : 1;
}
// [quickstart]
