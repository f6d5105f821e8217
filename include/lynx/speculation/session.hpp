// The progressive decode session, a state machine:
//
//   waiting for anchor -> drafting (up to max_draft tokens on the current precision level,
//   or up to max_draft_in_flight while the residual is in flight)
//   -> verifying (one multi-token forward at a higher level: accept a prefix, correct
//   the first miss, drop the tail entries of rejected drafts) -> exact decoding.
//
// The caller drives it: it reports the precision level available on every layer
// (set_available_level) as segments land, and calls step() to do one unit of
// work (one forward). Only committed tokens reach the user, through on_commit.
// With plans of three or more streams it verifies at each level as it lands.
//
// When the residual will not come (failure_policy.hpp), the driver either
// fails the session (fail) or lets it decode on at the level present
// (continue_unverified): every token committed after that is reported with
// committed_token::verified == false, through on_commit_event, and counted in
// stats().unverified_tokens.
//
// Provisional tokens (opt in with on_token_event): an application that wants to
// show text at anchor time also receives every draft as it is made, and a
// retraction when verification rejects drafts; committed tokens follow as
// through on_commit_event. Appending provisional tokens, popping on a
// retraction and marking commits gives, at every moment, the committed tokens
// followed by the drafts still standing; at the end exactly committed().
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/speculation/engine.hpp"
#include "lynx/speculation/verifier.hpp"

namespace lynx {

/// What happens when more planes land while drafting.
enum class landing_policy : std::uint8_t {
  verify_now,    // stop drafting, verify at once (lowest latency to committed tokens)
  finish_draft,  // keep drafting up to max_draft, then verify
};

struct session_options {
  int max_draft = 8;  // draft tokens before waiting for more planes
  /// Draft until the residual lands: while no more planes have landed than the
  /// drafts were made with, keep drafting up to this many drafts (never past
  /// max_new_tokens), so that the drafts cover the transfer; verification still
  /// follows on_landing. 0 (or anything <= max_draft): max_draft bounds it, as before.
  int max_draft_in_flight = 0;
  landing_policy on_landing = landing_policy::verify_now;
  bool verify_intermediate_levels = true;  // with 3+ streams: re-check drafts at each level
  std::int64_t max_new_tokens =
      64;  // committed tokens after the prompt, the prefill's own token included
};

enum class session_state : std::uint8_t {
  waiting_for_anchor,
  drafting,
  waiting_for_residual,
  exact,
  finished,
  failed
};

inline const char* to_string(session_state s) {
  switch (s) {
    case session_state::waiting_for_anchor:
      return "waiting_for_anchor";
    case session_state::drafting:
      return "drafting";
    case session_state::waiting_for_residual:
      return "waiting_for_residual";
    case session_state::exact:
      return "exact";
    case session_state::finished:
      return "finished";
    case session_state::failed:
      return "failed";
  }
  return "?";
}

/// What one step() did.
enum class step_kind : std::uint8_t { idle, draft, verify, decode, done };

struct step_result {
  step_kind kind = step_kind::idle;
  int level = 0;               // precision level the forward ran at
  std::int64_t tokens = 0;     // tokens in that forward
  std::int64_t accepted = 0;   // verify: drafts accepted
  std::int64_t drafted = 0;    // verify: drafts checked
  std::int64_t committed = 0;  // tokens committed by this step
  std::int64_t retracted = 0;  // verify: provisional tokens taken back by this step
};

/// Acceptance statistics of a request.
struct session_stats {
  std::int64_t draft_tokens = 0;     // drafts generated
  std::int64_t verifications = 0;    // verify passes at the target level
  std::int64_t verified_drafts = 0;  // drafts checked at the target level
  std::int64_t accepted_drafts = 0;  // of those, accepted
  std::int64_t forwards = 0;         // engine forwards of any kind
  std::int64_t unverified_tokens =
      0;  // committed after continue_unverified: not checked at the request's full precision
  std::int64_t provisional_tokens = 0;  // drafts delivered as provisional (those the request
                                        // could commit: inside max_new_tokens)
  std::int64_t retracted_tokens = 0;    // provisional tokens taken back (rejected, or the failure)
  std::int64_t retractions = 0;         // retraction events (one per verification that rejects)
  [[nodiscard]] double acceptance_rate() const {
    return verified_drafts ? double(accepted_drafts) / double(verified_drafts) : 0.0;
  }
  [[nodiscard]] double mean_accepted_length() const {
    return verifications ? double(accepted_drafts) / double(verifications) : 0.0;
  }
  /// Provisional tokens taken back, as a fraction of those delivered.
  [[nodiscard]] double retraction_rate() const {
    return provisional_tokens ? double(retracted_tokens) / double(provisional_tokens) : 0.0;
  }
};

/// One committed token as the flagged callback sees it.
struct committed_token {
  std::int32_t token = 0;
  std::int64_t position = 0;  // its position in the sequence (the prompt is 0 .. prompt_tokens - 1)
  bool verified =
      true;  // false: committed after continue_unverified, at a level below the request's target
};

/// What a token event says (progressive_session::on_token_event).
enum class token_event_kind : std::uint8_t {
  provisional,  // a draft: show it, it may be taken back
  retract,      // take back the last `count` provisional tokens (rejected drafts)
  commit,       // the token at `position` is final: it confirms the provisional token there,
                // or, where none stands (a correction, a bonus token, an exact step), adds it
};

inline const char* to_string(token_event_kind k) {
  switch (k) {
    case token_event_kind::provisional:
      return "provisional";
    case token_event_kind::retract:
      return "retract";
    case token_event_kind::commit:
      return "commit";
  }
  return "?";
}

/// One event of the provisional token stream. Positions count from the start
/// of the sequence (the prompt is 0 .. prompt_tokens - 1). Provisional tokens
/// always stand right after the committed ones, so a retraction pops the newest
/// and a commit's position is the next one after the committed tokens.
struct token_event {
  token_event_kind kind = token_event_kind::commit;
  std::int32_t token = 0;     // provisional, commit: the token; retract: unused (0)
  std::int64_t position = 0;  // provisional, commit: its position; retract: the first taken back
  std::int64_t count = 1;     // retract: provisional tokens taken back (>= 1); otherwise 1
  int level = 0;  // provisional: the precision level it was drafted (or corrected) at; in the
                  // replay of on_token_event, the drafts' current level
  bool verified = false;  // commit: as committed_token::verified; false otherwise
};

/// The forward a session needs next, for an engine that gathers the forwards
/// of many sessions into one batched forward (progressive_session::prepare /
/// complete). kind idle or done: nothing to run. Otherwise the engine runs
/// `tokens` at positions position, position + 1, ... at precision `level` on
/// this session's sequence (appending their K/V to its tail, as forward()
/// does) and hands back the logits of every token, [tokens][vocab].
struct forward_request {
  step_kind kind = step_kind::idle;
  std::span<const std::int32_t> tokens{};  // valid until complete()
  std::int64_t position = 0;
  int level = 0;
};

template <decode_engine Engine, verifier_policy Verifier = greedy_verifier>
class progressive_session {
 public:
  using commit_callback = std::function<void(std::int32_t token, std::int64_t position)>;
  using commit_event_callback = std::function<void(const committed_token&)>;
  using token_event_callback = std::function<void(const token_event&)>;

  /// prompt_tokens: tokens of the prompt (their KV is the transferred cache);
  /// first_token: the token the prefill node chose from the prompt's last logits
  /// (exact: computed at full precision), committed at once.
  progressive_session(Engine& engine, Verifier verifier, int target_level,
                      std::int64_t prompt_tokens, std::int32_t first_token,
                      session_options options = {}, commit_callback on_commit = {})
      : engine_(engine),
        verifier_(std::move(verifier)),
        options_(options),
        on_commit_(std::move(on_commit)),
        target_level_(target_level),
        requested_level_(target_level),
        prompt_tokens_(prompt_tokens),
        base_tail_(engine.tail_size()) {
    detail::require(target_level >= 1, errc::invalid_argument,
                    "session: target level must be at least 1");
    detail::require(options.max_draft >= 0, errc::invalid_argument,
                    "session: max_draft must be >= 0");
    detail::require(options.max_draft_in_flight >= 0, errc::invalid_argument,
                    "session: max_draft_in_flight must be >= 0");
    detail::require(options.max_new_tokens >= 1, errc::invalid_argument,
                    "session: max_new_tokens must be >= 1");
    vocab_ = static_cast<std::int64_t>(engine.vocab_size());
    inputs_.push_back(first_token);
    commit(first_token);
  }

  /// The precision level present on every layer (the minimum over layers).
  void set_available_level(int level) {
    detail::require(level >= available_ && level <= target_level_, errc::invalid_argument,
                    "session: available level went from " + std::to_string(available_) + " to " +
                        std::to_string(level) + " (target " + std::to_string(target_level_) + ")");
    available_ = level;
  }
  /// A transfer failed: the session stops and reports it; nothing more is committed.
  /// Provisional tokens still standing are retracted (they will never be checked).
  void fail(const std::string& why) {
    failure_ = why;
    state_override_failed_ = true;
    retract(shown_);
  }

  /// Also receives every committed token, with its verified flag (the
  /// constructor's callback, if any, still gets every token too). Tokens
  /// committed before the call (the prefill's own token) are replayed at once.
  void on_commit_event(commit_event_callback callback) {
    on_commit_event_ = std::move(callback);
    if (!on_commit_event_) return;
    const std::int64_t verified = verified_tokens();
    for (std::size_t i = 0; i < committed_.size(); ++i)
      on_commit_event_({committed_[i], prompt_tokens_ + static_cast<std::int64_t>(i),
                        static_cast<std::int64_t>(i) < verified});
  }

  /// Opt in to the provisional token stream (see token_event): every draft as
  /// it is made, retractions, and every commit. The state at the call is
  /// replayed at once: a commit event per committed token, then a provisional
  /// event per draft standing. Without it nothing of this is delivered and the
  /// session behaves the same (stats() counts provisional tokens either way).
  void on_token_event(token_event_callback callback) {
    on_token_event_ = std::move(callback);
    if (!on_token_event_) return;
    const std::int64_t verified = verified_tokens();
    for (std::size_t i = 0; i < committed_.size(); ++i) {
      const auto k = static_cast<std::int64_t>(i);
      on_token_event_(
          {token_event_kind::commit, committed_[i], prompt_tokens_ + k, 1, 0, k < verified});
    }
    for (std::int64_t i = 1; i <= shown_; ++i)
      on_token_event_({token_event_kind::provisional, inputs_[static_cast<std::size_t>(i)],
                       position_of_input(i), 1, draft_level_, false});
  }

  /// The missing planes will not come: decode on at the level available on
  /// every layer (at least the anchor), which becomes the session's target.
  /// Drafts pending at that level are committed as they are (they are that
  /// level's own tokens), drafts of a lower level are verified at it; every
  /// token committed from now on is marked unverified. Nothing changes when
  /// every level is already present. errc::invalid_argument without the anchor.
  void continue_unverified(const std::string& why) {
    detail::require(!state_override_failed_, errc::invalid_argument,
                    "session: continue_unverified after the session failed: " + failure_);
    detail::require(available_ >= 1, errc::invalid_argument,
                    "session: continue_unverified without the anchor (no level present): " + why);
    if (available_ == target_level_) return;
    failure_ = why;
    unverified_ = true;
    target_level_ = available_;
    if (draft_level_ == available_ && drafts() > 0) {
      // inputs_ = [a, d1 .. dn] with a .. d(n-1) in the tail at this level: greedy or
      // sampled at the new target, so a check at the same level would accept them all.
      const std::int64_t n = drafts();
      for (std::int64_t i = 1; i <= n; ++i) commit(inputs_[static_cast<std::size_t>(i)]);
      shown_ = 0;  // every provisional token was confirmed
      verified_ += n;
      const std::int32_t last = inputs_.back();
      inputs_.assign(1, last);
      draft_rows_.clear();
      fed_ = 0;
    }
  }
  /// continue_unverified took effect: tokens committed from then on are unverified.
  [[nodiscard]] bool unverified() const noexcept { return unverified_; }
  /// Committed tokens that are exact (a prefix of committed()).
  [[nodiscard]] std::int64_t verified_tokens() const noexcept {
    return static_cast<std::int64_t>(committed_.size()) - stats_.unverified_tokens;
  }
  /// The level the session decodes to: the request's target, or lower after continue_unverified.
  [[nodiscard]] int target_level() const noexcept { return target_level_; }
  /// The level the request asked for (every stream of the plan that is sent).
  [[nodiscard]] int requested_level() const noexcept { return requested_level_; }

  [[nodiscard]] session_state state() const {
    if (state_override_failed_) return session_state::failed;
    if (finished()) return session_state::finished;
    if (available_ == 0) return session_state::waiting_for_anchor;
    if (draft_level_ == target_level_ || (draft_level_ == 0 && available_ == target_level_))
      return session_state::exact;
    if (drafts() >= in_flight_limit() && available_ <= draft_level_)
      return session_state::waiting_for_residual;
    return session_state::drafting;
  }
  [[nodiscard]] bool finished() const {
    return static_cast<std::int64_t>(committed_.size()) >= options_.max_new_tokens;
  }
  [[nodiscard]] const std::vector<std::int32_t>& committed() const { return committed_; }
  [[nodiscard]] const session_stats& stats() const { return stats_; }
  [[nodiscard]] const std::string& failure() const { return failure_; }
  [[nodiscard]] int available_level() const { return available_; }

  /// One unit of work: a draft forward, a verification, or an exact decode step;
  /// idle when it must wait for planes. Throws what the engine throws.
  /// The same as prepare(), the engine's forward of what it asks, complete().
  step_result step() {
    const forward_request f = prepare();
    if (f.kind == step_kind::idle || f.kind == step_kind::done) return {f.kind};
    std::vector<float>& rows = f.kind == step_kind::verify ? rows_ : row_;
    rows.resize(f.tokens.size() * static_cast<std::size_t>(vocab_));
    try {
      engine_.forward(f.tokens, f.position, f.level, rows);
    } catch (...) {
      pending_ = step_kind::idle;
      throw;
    }
    return complete(rows);
  }

  /// Split-phase stepping (an engine that batches the forwards of many
  /// sessions): what the next step needs run. Decides as step() does and does
  /// the session's own part first (a verification drops the draft-level K/V
  /// from the engine's tail); the caller runs the forward, then calls
  /// complete() with its logits before anything else of this session.
  /// Nothing to run (idle, done): nothing pending.
  forward_request prepare() {
    if (state_override_failed_)
      detail::fail(errc::transport_failure, "session failed: " + failure_);
    detail::require(pending_ == step_kind::idle, errc::invalid_argument,
                    "session: prepare() again before complete() of the forward it asked for");
    if (finished()) return {step_kind::done};
    if (available_ == 0) return {step_kind::idle};
    if (draft_level_ == 0) draft_level_ = available_;
    if (draft_level_ == target_level_) return begin_exact();
    if (available_ > draft_level_) {
      // More planes than the drafts were made with.
      if (options_.on_landing == landing_policy::verify_now || drafts() >= options_.max_draft) {
        if (available_ == target_level_ || options_.verify_intermediate_levels)
          return begin_verify(available_);
        draft_level_ =
            available_;  // no intermediate check: keep the drafts, go on at the better level
      }
    }
    // Here either no more planes have landed (draft up to the in-flight limit), or
    // finish_draft goes on to max_draft (below the in-flight limit).
    if (drafts() >= in_flight_limit()) return {step_kind::idle};
    return begin_draft();
  }

  /// The logits of the forward prepare() asked for ([tokens][vocab]): the step's result.
  step_result complete(std::span<const float> logits) {
    const step_kind k = pending_;
    detail::require(k != step_kind::idle, errc::invalid_argument,
                    "session: complete() without a forward prepare() asked for");
    detail::require(
        logits.size() == static_cast<std::size_t>(pending_tokens_ * vocab_), errc::invalid_argument,
        "session: complete() with " + std::to_string(logits.size()) + " logits for a forward of " +
            std::to_string(pending_tokens_) + " tokens of vocab " + std::to_string(vocab_));
    pending_ = step_kind::idle;
    ++stats_.forwards;
    switch (k) {
      case step_kind::draft:
        return finish_draft(logits);
      case step_kind::verify:
        return finish_verify(pending_level_, logits);
      default:
        return finish_exact(logits);
    }
  }

 private:
  // inputs_ = [a, d1 .. dn]: a is the last committed token whose K/V is not yet
  // exact in the tail; d1..dn are drafts. The tail holds base_tail_ + verified_
  // exact entries, then fed_ entries of inputs_ computed at draft_level_.
  [[nodiscard]] std::int64_t drafts() const {
    return static_cast<std::int64_t>(inputs_.size()) - 1;
  }
  [[nodiscard]] std::int64_t position_of_input(std::int64_t i) const {
    return prompt_tokens_ + verified_ + i;
  }
  // Drafts allowed while waiting for planes: max_draft, or with max_draft_in_flight
  // above it, up to that many but none the request could not commit.
  [[nodiscard]] std::int64_t in_flight_limit() const {
    const std::int64_t base = options_.max_draft;
    if (options_.max_draft_in_flight <= base) return base;
    const std::int64_t remaining =
        options_.max_new_tokens - static_cast<std::int64_t>(committed_.size());
    return std::max(base, std::min<std::int64_t>(options_.max_draft_in_flight, remaining));
  }

  void commit(std::int32_t token) {
    if (finished()) return;
    const std::int64_t position = prompt_tokens_ + static_cast<std::int64_t>(committed_.size());
    committed_.push_back(token);
    if (unverified_) ++stats_.unverified_tokens;
    if (on_commit_) on_commit_(token, position);
    if (on_commit_event_) on_commit_event_({token, position, !unverified_});
    if (on_token_event_)
      on_token_event_({token_event_kind::commit, token, position, 1, 0, !unverified_});
  }

  // Input i (a draft, i >= 1) becomes provisional when the request could still
  // commit it: its position is inside max_new_tokens. Drafts past the end are
  // never shown, so they never need taking back.
  void show(std::int64_t i) {
    if (position_of_input(i) >= prompt_tokens_ + options_.max_new_tokens) return;
    ++shown_;
    ++stats_.provisional_tokens;
    if (on_token_event_)
      on_token_event_({token_event_kind::provisional, inputs_[static_cast<std::size_t>(i)],
                       position_of_input(i), 1, draft_level_, false});
  }
  // Takes back the newest n provisional tokens.
  void retract(std::int64_t n) {
    if (n <= 0) return;
    shown_ -= n;
    stats_.retracted_tokens += n;
    ++stats_.retractions;
    if (on_token_event_)
      on_token_event_({token_event_kind::retract, 0, position_of_input(shown_ + 1), n, 0, false});
  }

  forward_request pending(step_kind kind, std::span<const std::int32_t> tokens,
                          std::int64_t position, int level) {
    pending_ = kind;
    pending_tokens_ = static_cast<std::int64_t>(tokens.size());
    pending_level_ = level;
    return {kind, tokens, position, level};
  }

  forward_request begin_draft() {
    // Feed the last input; its logits propose the next draft.
    const auto i = fed_;
    detail::require(i == drafts(), errc::internal, "session: draft inputs out of step");
    return pending(step_kind::draft,
                   std::span<const std::int32_t>(inputs_).subspan(static_cast<std::size_t>(i), 1),
                   position_of_input(i), draft_level_);
  }

  step_result finish_draft(std::span<const float> row) {
    const auto i = fed_;
    ++fed_;
    const std::int32_t d = verifier_.draft(row, position_of_input(i + 1));
    inputs_.push_back(d);
    if (Verifier::needs_draft_rows) draft_rows_.insert(draft_rows_.end(), row.begin(), row.end());
    ++stats_.draft_tokens;
    show(i + 1);
    return {step_kind::draft, draft_level_, 1, 0, 0, 0};
  }

  forward_request begin_verify(int level) {
    engine_.drop_tail(fed_);  // every entry computed at the draft level is redone
    fed_ = 0;
    return pending(step_kind::verify, inputs_, position_of_input(0), level);
  }

  step_result finish_verify(int level, std::span<const float> rows) {
    const std::int64_t n = drafts();
    const std::span<const std::int32_t> draft_tokens(inputs_.data() + 1,
                                                     static_cast<std::size_t>(n));
    const verify_outcome out =
        verifier_.verify(draft_tokens, draft_rows_, rows, vocab_, position_of_input(1), level);
    const std::int64_t m = out.accepted;
    engine_.drop_tail(n - m);  // keep a, d1..dm
    // The shown drafts past the accepted ones go back before anything is committed,
    // so that the provisional tokens left stand right after the committed ones.
    const std::int64_t before_retract = shown_;
    retract(shown_ - std::min(m, shown_));
    step_result r{step_kind::verify, level, n + 1, m, n, 0};
    r.retracted = before_retract - shown_;
    if (level == target_level_) {
      ++stats_.verifications;
      stats_.verified_drafts += n;
      stats_.accepted_drafts += m;
      const std::size_t before = committed_.size();
      for (std::int64_t i = 1; i <= m; ++i) commit(inputs_[static_cast<std::size_t>(i)]);
      commit(out.next);
      r.committed = static_cast<std::int64_t>(committed_.size() - before);
      shown_ = 0;  // d1..dm confirmed; out.next committed at once
      verified_ += m + 1;
      inputs_.assign(1, out.next);
      draft_rows_.clear();
      fed_ = 0;
    } else {
      // Intermediate level: d1..dm and the correction stay drafts, now of this level.
      inputs_.resize(static_cast<std::size_t>(m + 1));
      inputs_.push_back(out.next);
      if (Verifier::needs_draft_rows)
        draft_rows_.assign(rows.begin(), rows.begin() + (m + 1) * vocab_);
      fed_ = m + 1;
      draft_level_ = level;
      show(m + 1);  // the correction is a draft of this level
      return r;
    }
    draft_level_ = level;
    return r;
  }

  forward_request begin_exact() {
    return pending(step_kind::decode, std::span<const std::int32_t>(inputs_).first(1),
                   position_of_input(0), target_level_);
  }

  step_result finish_exact(std::span<const float> row) {
    const std::int32_t next = verifier_.decide(row, position_of_input(1));
    ++verified_;
    inputs_[0] = next;
    commit(next);
    return {step_kind::decode, target_level_, 1, 0, 0, 1};
  }

  Engine& engine_;
  Verifier verifier_;
  session_options options_;
  commit_callback on_commit_;
  commit_event_callback on_commit_event_;
  token_event_callback on_token_event_;
  int target_level_;
  int requested_level_;
  std::int64_t prompt_tokens_;
  std::int64_t base_tail_;
  std::int64_t vocab_ = 0;
  int available_ = 0;
  int draft_level_ = 0;
  std::int64_t verified_ = 0;  // exact tail entries made by this session
  std::int64_t fed_ = 0;       // inputs whose K/V sit in the tail at draft_level_
  std::int64_t shown_ = 0;     // drafts d1..d(shown_) delivered as provisional (a prefix)
  std::vector<std::int32_t> inputs_;
  std::vector<float> draft_rows_, rows_, row_;
  std::vector<std::int32_t> committed_;
  session_stats stats_;
  std::string failure_;
  bool state_override_failed_ = false;
  bool unverified_ = false;
  step_kind pending_ = step_kind::idle;  // the forward prepare() asked for, not yet completed
  std::int64_t pending_tokens_ = 0;
  int pending_level_ = 0;
};

}  // namespace lynx
