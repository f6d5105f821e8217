// A tiny engine with known next-token distributions for the session tests:
// the logits of the token after x are table[level][x], so the target
// distribution (all planes) and the draft distributions (fewer planes) are
// known exactly and differ. faithful_engine: drafts that the target always accepts.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "lynx/speculation/verifier.hpp"  // argmax_token

namespace lynx_test {

struct toy_engine {
  static constexpr int vocab = 6;
  int levels = 2;
  std::vector<std::int32_t> tail;  // inputs fed, one entry per token
  std::vector<int> tail_level;     // the level each entry was computed at
  std::int64_t forwards = 0;

  // logits of the token following x at a precision level (level == levels: target)
  static float logit(int level, int levels, std::int32_t x, int v) {
    const double target =
        std::log(1.0 + static_cast<double>((x * 7 + v * 5) % 6));  // p(v | x) ∝ 1 + (7x + 5v) mod 6
    const double skew =
        (levels - level) * 0.8 * ((v + x) % 3 == 0 ? 1.0 : -0.5);  // drafts lean elsewhere
    return static_cast<float>(target + skew);
  }

  std::int64_t vocab_size() const { return vocab; }
  std::int64_t tail_size() const { return static_cast<std::int64_t>(tail.size()); }
  void drop_tail(std::int64_t n) {
    if (n < 0 || n > tail_size()) throw std::out_of_range("toy_engine: drop_tail out of range");
    tail.resize(tail.size() - static_cast<std::size_t>(n));
    tail_level.resize(tail.size());
  }
  void forward(std::span<const std::int32_t> tokens, std::int64_t /*position*/, int level,
               std::span<float> logits) {
    if (logits.size() != tokens.size() * vocab)
      throw std::invalid_argument("toy_engine: logits size");
    ++forwards;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tail.push_back(tokens[i]);
      tail_level.push_back(level);
      for (int v = 0; v < vocab; ++v)
        logits[i * vocab + static_cast<std::size_t>(v)] = logit(level, levels, tokens[i], v);
    }
  }
};

// The toy engine whose lower levels decide as the target does: every draft is accepted.
struct faithful_engine : toy_engine {
  void forward(std::span<const std::int32_t> tokens, std::int64_t position, int /*level*/,
               std::span<float> logits) {
    toy_engine::forward(tokens, position, levels, logits);
  }
};

/// Plain greedy decoding at `level` of `levels` from `first`, n tokens in all (the
/// toy's logits depend on the last token only): what a session must commit.
inline std::vector<std::int32_t> greedy_at(int levels, int level, std::int32_t first, int n) {
  toy_engine e;
  e.levels = levels;
  std::vector<std::int32_t> out{first};
  std::vector<float> row(toy_engine::vocab);
  while (static_cast<int>(out.size()) < n) {
    const std::int32_t t = out.back();
    e.forward({&t, 1}, 0, level, row);
    out.push_back(lynx::argmax_token(row));
  }
  return out;
}

}  // namespace lynx_test
