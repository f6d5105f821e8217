// Per-worker scratch of the host attention walk (split_scratch: its size and
// its carving out of one buffer), the next split a worker walks (for the L2
// prefetches) and how far ahead the bit-plane walks prefetch.
#pragma once

#include <algorithm>
#include <cstdint>

#include "lynx/backend/host/attention/tile_math.hpp"

namespace lynx::detail {

/// A split a worker walks next (kv head, tokens), for the L2 prefetches; t1 <= t0: none.
struct next_split {
  std::int64_t kv_head = 0, t0 = 0, t1 = 0;
};

/// How far ahead (in 32-token blocks) the bit-plane walks ask for plane words:
/// far enough to cover a DRAM round trip at the work done per block.
inline constexpr std::int64_t prefetch_blocks = 4;

/// Scratch of one worker, in floats; see split_scratch_floats.
struct split_scratch {
  float* scores;   // [item kv heads][heads][S]: logits, then p
  float* qs;       // [2][heads][head_dim]: folded queries of two key groups
  float* bias;     // [2][heads]
  float* weights;  // [heads][value groups][S]: value weights of the split (dense: queries)
  float* offsets;  // [heads][value groups]
  float* tile;     // [head_dim][32]: codes of one block, lane = token (or 16 float key rows)
  float* queries;  // [item kv heads][heads][head_dim]: queries times the softmax scale
  float* odd;      // [heads][head_dim]: the odd tokens' value sums (portable bit-plane path)
};

/// Floats of one worker's scratch for `heads` query heads per kv head, and
/// `value_groups` value channel groups per token. `item_kv_heads`: the kv heads one
/// work item may cover (dense_heads_together); scores, weights (which hold a dense
/// item's permuted queries) and queries are sized for all of them.
inline std::int64_t split_scratch_floats(std::int64_t heads, std::int64_t head_dim,
                                         std::int64_t value_groups,
                                         std::int64_t item_kv_heads = 1) {
  const std::int64_t S = attention_split_tokens;
  const std::int64_t gh = item_kv_heads * heads;
  return gh * S + 2 * heads * head_dim + 2 * heads +
         heads * std::max(value_groups, item_kv_heads) * S + heads * value_groups +
         head_dim * attention_block_tokens + (gh + heads) * head_dim + 8 * 16 +
         1024;  // + 8 alignments and the shift of `weights` (carve_scratch)
}

inline split_scratch carve_scratch(float* base, std::int64_t heads, std::int64_t head_dim,
                                   std::int64_t value_groups, std::int64_t item_kv_heads = 1) {
  const std::int64_t S = attention_split_tokens;
  const std::int64_t gh = item_kv_heads * heads;
  auto align = [](float* p) {
    return reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(p) + 63) &
                                    ~std::uintptr_t{63});
  };
  split_scratch s;
  s.scores = align(base);
  s.qs = align(s.scores + gh * S);
  s.bias = align(s.qs + 2 * heads * head_dim);
  // Rows of scores and weights are 4 KiB apart; value_weights loads scores
  // while it stores weights at the same offsets, so `weights` starts 2 KiB
  // off `scores` modulo 4 KiB: loads never wait on a store that only shares
  // their low 12 address bits (4K aliasing).
  s.weights = align(s.bias + 2 * heads);
  s.weights += ((s.scores - s.weights) % 1024 + 1024 + 512) % 1024;
  s.offsets = align(s.weights + heads * std::max(value_groups, item_kv_heads) * S);
  s.tile = align(s.offsets + heads * value_groups);
  s.queries = align(s.tile + head_dim * attention_block_tokens);
  s.odd = align(s.queries + gh * head_dim);
  return s;
}

}  // namespace lynx::detail
