// Verifiers: how draft tokens are chosen on a partial cache and how they are
// checked once more planes have landed. Compile-time policies of the session.
//
//   greedy_verifier    argmax (ties to the lowest token id); accept the longest
//                      matching prefix, emit the target's token at the first miss,
//                      a bonus token when all match. Committed tokens equal plain
//                      greedy decoding at the target precision.
//   sampling_verifier  speculative sampling: accept a draft with probability
//                      min(1, p/q), else resample from norm(max(0, p - q)).
//                      Committed tokens follow the target distribution p.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/speculation/random.hpp"

namespace lynx {

/// What a verification decided: the first `accepted` drafts stand, and `next`
/// follows them (the correction at the first miss, or the bonus token).
struct verify_outcome {
  std::int64_t accepted = 0;
  std::int32_t next = 0;
};

/// Argmax of a logits row; ties go to the lowest token id. NaN logits are an error.
inline std::int32_t argmax_token(std::span<const float> logits) {
  detail::require(!logits.empty(), errc::invalid_argument, "argmax of an empty logits row");
  std::size_t best = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] != logits[i])
      detail::fail(errc::non_finite_input, "logit of token " + std::to_string(i) + " is NaN");
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<std::int32_t>(best);
}

/// A verifier policy: draft(), decide() and verify() as documented on greedy_verifier.
template <class V>
concept verifier_policy = requires(V& v, std::span<const float> row,
                                   std::span<const std::int32_t> drafts,
                                   std::span<const float> rows, std::int64_t position,
                                   std::int64_t vocab) {
  typename V::verifier_tag;
  { V::needs_draft_rows } -> std::convertible_to<bool>;
  { v.draft(row, position) } -> std::same_as<std::int32_t>;
  { v.decide(row, position) } -> std::same_as<std::int32_t>;
  { v.verify(drafts, rows, rows, vocab, position, 1) } -> std::same_as<verify_outcome>;
};

struct greedy_verifier {
  using verifier_tag = void;
  static constexpr bool needs_draft_rows = false;  // greedy needs only the draft tokens

  /// A draft token from draft-precision logits for the token at `position`.
  std::int32_t draft(std::span<const float> row, std::int64_t /*position*/) {
    return argmax_token(row);
  }
  /// The token at `position` in exact decoding (target precision logits).
  std::int32_t decide(std::span<const float> row, std::int64_t /*position*/) {
    return argmax_token(row);
  }
  /// drafts[i] was proposed for position first_position + i. target_rows: [n+1][vocab]
  /// target logits for positions first_position .. first_position + n; `level` is the
  /// precision level verified at (randomized policies draw fresh numbers per level).
  verify_outcome verify(std::span<const std::int32_t> drafts, std::span<const float> /*draft_rows*/,
                        std::span<const float> target_rows, std::int64_t vocab,
                        std::int64_t /*first_position*/, int /*level*/) {
    verify_outcome out;
    for (std::size_t i = 0; i <= drafts.size(); ++i) {
      const std::int32_t target = argmax_token(target_rows.subspan(
          i * static_cast<std::size_t>(vocab), static_cast<std::size_t>(vocab)));
      if (i == drafts.size() || drafts[i] != target) {
        out.next = target;
        return out;
      }
      ++out.accepted;
    }
    return out;
  }
};

/// Speculative sampling at a temperature, reproducible through a counter-based generator.
struct sampling_verifier {
  using verifier_tag = void;
  static constexpr bool needs_draft_rows = true;  // q is needed for min(1, p/q)

  float temperature = 1.0f;
  counter_rng rng{};

  enum purpose : std::uint64_t {
    draft_purpose = 1,
    decide_purpose = 2,
    accept_purpose = 3,
    resample_purpose = 4
  };

  /// softmax(row / temperature) in double.
  [[nodiscard]] std::vector<double> probabilities(std::span<const float> row) const {
    detail::require(temperature > 0.0f, errc::invalid_argument,
                    "sampling temperature must be positive");
    double top = -INFINITY;
    for (float x : row) {
      if (x != x) detail::fail(errc::non_finite_input, "NaN logit");
      top = std::max(top, static_cast<double>(x) / temperature);
    }
    std::vector<double> p(row.size());
    double sum = 0;
    for (std::size_t i = 0; i < row.size(); ++i)
      sum += p[i] = std::exp(static_cast<double>(row[i]) / temperature - top);
    for (double& x : p) x /= sum;
    return p;
  }
  static std::int32_t sample(const std::vector<double>& p, double u) {
    double total = 0;
    for (double x : p) total += x;
    double c = 0;
    const double target = u * total;
    for (std::size_t i = 0; i < p.size(); ++i) {
      c += p[i];
      if (target < c && p[i] > 0) return static_cast<std::int32_t>(i);
    }
    for (std::size_t i = p.size(); i-- > 0;)  // rounding at the very top: the last token with mass
      if (p[i] > 0) return static_cast<std::int32_t>(i);
    return 0;
  }

  std::int32_t draft(std::span<const float> row, std::int64_t position) {
    return sample(probabilities(row),
                  rng.uniform(draft_purpose, static_cast<std::uint64_t>(position)));
  }
  std::int32_t decide(std::span<const float> row, std::int64_t position) {
    return sample(probabilities(row),
                  rng.uniform(decide_purpose, static_cast<std::uint64_t>(position)));
  }
  verify_outcome verify(std::span<const std::int32_t> drafts, std::span<const float> draft_rows,
                        std::span<const float> target_rows, std::int64_t vocab,
                        std::int64_t first_position, int level) {
    // A verification at each level draws its own numbers: re-using one uniform for two
    // acceptance tests of the same token would correlate them and bias the result.
    const auto round = static_cast<std::uint64_t>(level);
    const auto V = static_cast<std::size_t>(vocab);
    verify_outcome out;
    for (std::size_t i = 0; i < drafts.size(); ++i) {
      const auto position = static_cast<std::uint64_t>(first_position) + i;
      const std::vector<double> p = probabilities(target_rows.subspan(i * V, V));
      const std::vector<double> q = probabilities(draft_rows.subspan(i * V, V));
      const auto d = static_cast<std::size_t>(drafts[i]);
      const double ratio = q[d] > 0 ? p[d] / q[d] : 1.0;
      if (rng.uniform(accept_purpose, position, round) < std::min(1.0, ratio)) {
        ++out.accepted;
        continue;
      }
      std::vector<double> residual(V);
      double mass = 0;
      for (std::size_t t = 0; t < V; ++t) mass += residual[t] = std::max(0.0, p[t] - q[t]);
      out.next = mass > 0 ? sample(residual, rng.uniform(resample_purpose, position, round))
                          : sample(p, rng.uniform(resample_purpose, position, round));
      return out;
    }
    const auto position = static_cast<std::uint64_t>(first_position) + drafts.size();
    out.next = sample(probabilities(target_rows.subspan(drafts.size() * V, V)),
                      rng.uniform(decide_purpose, position, round));
    return out;
  }
};

static_assert(verifier_policy<greedy_verifier>);
static_assert(verifier_policy<sampling_verifier>);

}  // namespace lynx
