// The engine concept: what the progressive decode session needs from an
// inference engine. Lynx never owns model weights; the engine owns them, its
// prompt KV (the bit-plane tensors being received) and its local tail.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

namespace lynx {

/// A decode engine:
///  - vocab_size(): logits per token;
///  - forward(tokens, first_position, level, logits): runs tokens at positions
///    first_position.. (causal among themselves), attending the prompt KV at
///    precision `level` (1 = anchor .. the plan's stream count), appends their
///    K/V to the local tail, and writes logits [tokens.size()][vocab] row-major;
///  - drop_tail(n): removes the last n tail entries (rejected drafts);
///  - tail_size(): tail entries held.
/// For exactness, forward over k tokens must give bitwise the logits of k
/// one-token forwards (batch-invariant kernels).
template <class E>
concept decode_engine = requires(E& e, const E& ce, std::span<const std::int32_t> tokens,
                                 std::int64_t position, int level, std::span<float> logits,
                                 std::int64_t n) {
  { ce.vocab_size() } -> std::convertible_to<std::int64_t>;
  e.forward(tokens, position, level, logits);
  e.drop_tail(n);
  { ce.tail_size() } -> std::convertible_to<std::int64_t>;
};

}  // namespace lynx
