// The measures of an acceptance study, for any engine that satisfies
// lynx::decode_engine (the llama2.c and Gemma-3 examples): how far greedy
// decoding on the anchor agrees with decoding at full precision, and how many
// drafts a request accepts when its residual lands after the draft limit.
//
//   greedy_continuation     n greedy tokens after the prefill's own token at one
//                           precision level (optionally stopping at the first
//                           token that differs from a reference);
//   common_prefix           tokens before the first disagreement;
//   land_after_draft_limit  one request through lynx::progressive_session: the
//                           anchor is present from the start, the session
//                           drafts max_draft tokens, and each further level
//                           lands when the session idles (so every draft is
//                           verified). A request has one landing, so one
//                           verification at the target level.
//
// With the greedy verifier the drafts of such a request are greedy decoding on
// the anchor, so its accepted count is min(max_draft, common prefix of the
// anchor's and the full precision's continuations): a check the study makes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "lynx/speculation/engine.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/speculation/verifier.hpp"

namespace lynx_examples::acceptance {

/// Greedy decoding on an engine whose tail is empty: n tokens after `first`
/// (the prefill's token at position prompt_tokens), the prompt read at `level`.
/// With a non-empty `reference`, stops right after the first token that differs
/// from reference[i] (the rest cannot change the common prefix).
template <lynx::decode_engine Engine>
std::vector<std::int32_t> greedy_continuation(Engine& engine, std::int64_t prompt_tokens,
                                              std::int32_t first, int level, int n,
                                              std::span<const std::int32_t> reference = {}) {
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(n));
  std::vector<float> row(static_cast<std::size_t>(engine.vocab_size()));
  std::int32_t token = first;
  for (int i = 0; i < n; ++i) {
    engine.forward(std::span<const std::int32_t>(&token, 1), prompt_tokens + i, level, row);
    token = lynx::argmax_token(row);
    out.push_back(token);
    if (!reference.empty() && (static_cast<std::size_t>(i) >= reference.size() ||
                               reference[static_cast<std::size_t>(i)] != token))
      break;
  }
  return out;
}

/// Tokens before the first position where a and b differ (or the shorter length).
inline int common_prefix(std::span<const std::int32_t> a, std::span<const std::int32_t> b) {
  const std::size_t n = std::min(a.size(), b.size());
  std::size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int>(i);
}

struct landing_result {
  std::vector<std::int32_t> committed;  // the prefill's token first
  lynx::session_stats stats;
};

/// One request whose residual lands after the draft limit (see the file comment).
/// committed_tokens == 0: stop right after the verification at the target level
/// (the acceptance is known then); otherwise decode on, exactly, until that many
/// tokens (the prefill's own included) are committed.
template <lynx::decode_engine Engine, lynx::verifier_policy Verifier>
landing_result land_after_draft_limit(Engine& engine, Verifier verifier, int streams,
                                      std::int64_t prompt_tokens, std::int32_t first, int max_draft,
                                      int committed_tokens = 0) {
  lynx::session_options o;
  o.max_draft = max_draft;
  o.on_landing = lynx::landing_policy::verify_now;
  // Room for every draft to be verified and committed when stopping after the verification.
  o.max_new_tokens = committed_tokens > 0 ? committed_tokens : max_draft + 2;
  lynx::progressive_session session(engine, std::move(verifier), streams, prompt_tokens, first, o);
  // A bound on steps: drafts and verifications at each level, then exact steps.
  const std::int64_t step_limit =
      static_cast<std::int64_t>(streams) * (max_draft + 2) + o.max_new_tokens + 8;
  std::int64_t steps = 0;
  for (int level = 1; !session.finished();) {
    if (committed_tokens == 0 && session.stats().verifications > 0) break;
    if (session.available_level() < level) session.set_available_level(level);
    if (session.step().kind == lynx::step_kind::idle) ++level;
    if (++steps > step_limit)
      throw std::logic_error("land_after_draft_limit: no progress after " + std::to_string(steps) +
                             " steps");
  }
  return {session.committed(), session.stats()};
}

}  // namespace lynx_examples::acceptance
