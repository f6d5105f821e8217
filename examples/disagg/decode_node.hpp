// The decode node of a disaggregated request over a real transport (any
// lynx::segment_receiver on the steady clock: TCP, UCX, loopback): receives
// the request preamble and the segments into per-layer bit-plane tensors,
// reports the precision level present on every layer to a progressive session
// that decodes speculatively meanwhile, enforces the request's deadlines and
// applies its failure policy (lynx/speculation/failure_policy.hpp).
//
// Receiving and decoding interleave on one thread: between two forwards it
// takes whatever has arrived (never waiting); when the session must wait for
// planes it waits on the receiver until the next deadline. Each segment is
// accepted into its tensor (which copies it) and released to the transport at
// once; segments of another generation, damaged or of a wrong layer are
// reported and ignored; duplicates are idempotent. When the last stream of
// every layer has landed, a helper thread merges the layers into codes
// (lynx::background_merge) and the engine reads each layer's codes as soon as
// they are made: the same bits as its planes, less work per decode step (an
// engine that can: llama2.c's; the Gemma-3 engine reads the planes).
// Any model family of disagg/family.hpp; greedy or speculative sampling
// (decode_node_options::verifier).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "disagg/preamble.hpp"
#include "disagg/request.hpp"
#include "lynx/attention/background_merge.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/layer_set.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/speculation/failure_policy.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/transport/concepts.hpp"

namespace lynx_examples::disagg {

struct decode_node_options {
  std::uint64_t generation = 1;  // the request's generation: anything else is stale
  int committed_tokens = 64;     // tokens after the prompt, the prefill's own included
  int max_draft = 8;
  int max_draft_in_flight = 0;  // draft on while the residual is in flight, up to this many
                                // (lynx::session_options::max_draft_in_flight; 0: max_draft)
  lynx::failure_options failure;
  lynx::request_deadlines deadlines;
  bool merge_codes = true;      // merge the complete prompt into codes on a helper thread (for an
                                // engine that reads codes: llama2.c's)
  int merge_threads = 1;        // threads of that merge (<= 0: every hardware thread)
  request_verifier verifier{};  // greedy unless a temperature is set
};

/// A segment (or preamble) the decode node refused, and why.
struct rejected_segment {
  lynx::segment_id id;  // from its header when readable
  lynx::lane_index lane = 0;
  lynx::errc status = lynx::errc::ok;  // stale_generation, corrupted_segment, truncated_segment,
                                       // layer_mismatch, ...
  std::string what;
};

/// A failure of the transfer as the decode node saw it.
struct transfer_failure {
  lynx::errc status = lynx::errc::ok;  // peer_failure, transport_failure, timeout (a deadline)
  std::string what;
  double at = -1;  // seconds on the request's timeline
  lynx::failure_policy applied = lynx::failure_policy::fail_request;
};

struct decode_result {
  timeline tl;  // anchor landed, drafts, residual landed, verification, commits (bytes_sent: bytes
                // received)
  lynx::request_outcome outcome = lynx::request_outcome::pending;
  std::vector<lynx::committed_token> commits;  // in order, each with its verified flag
  lynx::session_stats stats;
  std::vector<rejected_segment> rejected;
  std::vector<transfer_failure> failures;  // in order; a rerequest that worked is followed by none
  std::string failure;  // why the request failed or went unverified (empty when completed)
  int duplicates = 0, stale = 0, rerequests = 0, segments_accepted = 0;
  int level = 0;             // precision level present on every layer at the end
  double codes_ready = -1;   // seconds on the request's timeline when every layer's codes were made
  double merge_seconds = 0;  // the merge's own time (helper thread)
  std::int64_t full_level_on_codes = 0,
               full_level_on_planes = 0;  // layer attentions at the full level, by what they read
  [[nodiscard]] int count(lynx::errc status) const {
    return static_cast<int>(
        std::count_if(rejected.begin(), rejected.end(),
                      [&](const rejected_segment& r) { return r.status == status; }));
  }
};

/// Hooks of a decode node. Receiver is the transport's receiver type.
template <class Receiver>
struct decode_node_hooks {
  /// rerequest policy: ask the prefill side to resend `request` and return the
  /// receiver the resend arrives on (the old one may be dead), or nullptr when
  /// no resend can be arranged. The caller owns the returned receiver.
  std::function<Receiver*(const lynx::resend_request& request)> rerequest;
  /// Observes every segment accepted (its id, the level now present on every layer).
  std::function<void(const lynx::segment_id&, int level)> on_segment;
  /// Observes every committed token as it is committed.
  std::function<void(const lynx::committed_token&)> on_commit;
  /// Opts in to provisional tokens (progressive_session::on_token_event): every
  /// draft as it is made, retractions, and commits.
  std::function<void(const lynx::token_event&)> on_token;
};

/// Runs the decode node's side of one request whose prompt has `prompt_tokens`
/// tokens, reading from `receiver` (already connected), on the model family of
/// `w` (disagg/family.hpp).
template <lynx::stream_plan_type Plan, lynx::segment_receiver Receiver, class Weights>
decode_result run_decode_node(const Weights& w, int prompt_tokens, Receiver& receiver,
                              const decode_node_options& o,
                              const decode_node_hooks<Receiver>& hooks = {}) {
  using clock = std::chrono::steady_clock;
  static_assert(std::is_same_v<typename Receiver::clock, clock>,
                "run_decode_node: a wall-clock transport");
  using time_point = clock::time_point;
  using F = family<Weights>;
  using engine_type = typename F::template decode_engine<Plan>;
  // Only an engine that can read merged codes gets a merge (llama2.c's); the others read planes.
  constexpr bool reads_codes = requires(engine_type & e, const lynx::background_merge<Plan>* m) {
    e.use_codes(m);
  };
  const int layers = F::layers(w);
  const time_point start = clock::now();

  decode_result res;
  res.tl.name = "Lynx " + Plan::name();
  auto tensors = F::template make_tensors<Plan>(w, prompt_tokens, o.generation);
  lynx::layer_set<Plan> received(tensors);  // routes segments, tracks the level
  engine_type engine(w, tensors, prompt_tokens);
  lynx::session_options so;
  so.max_draft = o.max_draft;
  so.max_draft_in_flight = o.max_draft_in_flight;
  so.max_new_tokens = o.committed_tokens;
  using session_type = lynx::progressive_session<engine_type, request_verifier>;
  std::optional<session_type> session;
  // Declared after the tensors and the engine: destroyed (stopped, joined) before them.
  std::optional<lynx::background_merge<Plan>> merge;

  Receiver* rx = &receiver;
  std::optional<request_preamble> preamble;
  time_point preamble_at{};
  std::vector<time_point> level_at(static_cast<std::size_t>(Plan::streams) + 1);
  std::vector<bool> level_seen(static_cast<std::size_t>(Plan::streams) + 1, false);
  time_point first_draft{}, verification{}, first_committed{}, all_committed{};
  bool have_first_draft = false, have_verification = false, have_first_committed = false;
  int level = 0;
  bool link_done = false;  // every stream landed, or the failure policy let go of the link
  bool failed = false;
  int attempts = 0;
  time_point anchor_deadline = start + o.deadlines.anchor;
  time_point residual_deadline = time_point::max();
  const time_point request_deadline = start + o.deadlines.request;

  auto update_level = [&](time_point at) {
    const int l = received.level();
    if (l <= level) return;
    for (int k = level + 1; k <= l; ++k) {
      level_seen[static_cast<std::size_t>(k)] = true;
      level_at[static_cast<std::size_t>(k)] = at;
    }
    if (level == 0)
      residual_deadline = at + o.deadlines.residual;  // measured from the anchor's landing
    level = l;
    if (level == Plan::streams) {
      link_done = true;
      if constexpr (reads_codes) {
        if (o.merge_codes) {
          merge.emplace(std::span<const lynx::bitplane_tensor<Plan>>(tensors), o.merge_threads);
          engine.use_codes(&*merge);
        }
      }
    }
    if (session && !session->unverified()) session->set_available_level(level);
  };

  auto start_session = [&] {
    session.emplace(engine, o.verifier, Plan::streams, prompt_tokens, preamble->first_token, so);
    session->on_commit_event([&](const lynx::committed_token& t) {
      res.commits.push_back(t);
      if (hooks.on_commit) hooks.on_commit(t);
    });
    if (hooks.on_token) session->on_token_event(hooks.on_token);
    if (level > 0) session->set_available_level(level);
  };

  auto reject = [&](lynx::segment_id id, lynx::lane_index lane, lynx::errc status,
                    std::string what) {
    if (status == lynx::errc::stale_generation) ++res.stale;
    res.rejected.push_back({id, lane, status, std::move(what)});
  };

  auto handle = [&](const lynx::received_segment<clock>& seg) {
    res.tl.bytes_sent += seg.bytes.size();
    if (looks_like_preamble(seg.bytes)) {
      const auto p = parse_preamble(seg.bytes);
      if (!p)
        reject({}, seg.lane, lynx::errc::corrupted_segment,
               "a request preamble of the wrong size or version");
      else if (p->generation != o.generation)
        reject({0, 0, p->generation}, seg.lane, lynx::errc::stale_generation,
               "request preamble of generation " + std::to_string(p->generation) +
                   ", the request is " + std::to_string(o.generation));
      else if (p->prompt_tokens != prompt_tokens || p->layers != layers ||
               p->streams != Plan::streams)
        reject({0, 0, p->generation}, seg.lane, lynx::errc::shape_mismatch,
               "request preamble of " + std::to_string(p->prompt_tokens) + " tokens, " +
                   std::to_string(p->layers) + " layers, " + std::to_string(p->streams) +
                   " streams; expected " + std::to_string(prompt_tokens) + ", " +
                   std::to_string(layers) + ", " + std::to_string(Plan::streams));
      else if (!preamble) {  // a resend repeats it: the first one counts
        preamble = p;
        preamble_at = seg.arrival;
        start_session();
      }
      rx->release(seg);
      return;
    }
    lynx::segment_id id{};
    try {
      const lynx::segment_header h = lynx::peek_header(seg.bytes);
      id = {h.layer, h.stream, h.generation};
      if (received.accept(seg.bytes).result == lynx::accept_result::duplicate)
        ++res.duplicates;
      else
        ++res.segments_accepted;
    } catch (const lynx::error& e) {
      reject(id, seg.lane, e.code(), e.what());
      rx->release(seg);
      return;
    }
    rx->release(seg);  // the tensor holds its own copy
    update_level(seg.arrival);
    if (hooks.on_segment) hooks.on_segment(id, level);
  };

  auto missing_segments = [&] { return received.missing(); };

  auto give_up = [&](const std::string& why) {
    res.failure = why;
    failed = true;
    if (session) session->fail(why);
  };

  // The link broke or a deadline passed with streams missing: apply the policy.
  auto on_failure = [&](lynx::errc status, const std::string& what) {
    const time_point now = clock::now();
    transfer_failure f{status, what, -1, o.failure.policy};
    f.at = std::chrono::duration<double>(now - start)
               .count();  // rebased on the request's timeline below
    lynx::failure_policy policy = o.failure.policy;
    if (policy == lynx::failure_policy::rerequest) {
      if (attempts < o.failure.max_rerequests && hooks.rerequest) {
        lynx::resend_request req{o.generation, missing_segments(), attempts + 1};
        Receiver* next = hooks.rerequest(req);
        if (next != nullptr) {
          ++attempts;
          ++res.rerequests;
          res.failures.push_back(f);
          rx = next;
          const time_point t = clock::now();
          if (level == 0) anchor_deadline = t + o.deadlines.anchor;
          residual_deadline = level == 0 ? time_point::max() : t + o.deadlines.residual;
          return;
        }
      }
      policy = o.failure.after_rerequests;
    }
    f.applied = policy;
    res.failures.push_back(f);
    if (policy == lynx::failure_policy::continue_unverified && session && level >= 1) {
      session->continue_unverified(what);
      res.failure = what;
      link_done = true;
      return;
    }
    f.applied = lynx::failure_policy::fail_request;
    res.failures.back().applied = f.applied;
    give_up(what);
  };

  auto check_deadlines = [&] {
    if (link_done || failed) return;
    const time_point now = clock::now();
    if (now >= request_deadline) {
      res.failures.push_back({lynx::errc::timeout, "the request deadline passed",
                              std::chrono::duration<double>(now - start).count(),
                              lynx::failure_policy::fail_request});
      give_up("the request deadline passed");
    } else if (level == 0 && now >= anchor_deadline) {
      on_failure(lynx::errc::timeout, "the anchor deadline passed with " +
                                          std::to_string(missing_segments().size()) +
                                          " segments missing");
    } else if (level > 0 && now >= residual_deadline) {
      on_failure(lynx::errc::timeout, "the residual deadline passed with " +
                                          std::to_string(missing_segments().size()) +
                                          " segments missing");
    }
  };

  // Takes one result of try_receive; false when nothing came.
  auto take = [&](const lynx::receive_result<clock>& r) {
    if (r.ok()) {
      handle(r.segment);
      return true;
    }
    if (r.status == lynx::errc::timeout) return false;
    if (r.status ==
        lynx::errc::corrupted_segment) {  // a framing error, reported once; the link state follows
      reject({}, 0, r.status, "the transport refused a frame");
      return true;
    }
    on_failure(r.status, std::string("the link failed: ") + std::string(lynx::to_string(r.status)));
    return true;
  };

  auto next_deadline = [&] {
    return std::min({request_deadline, level == 0 ? anchor_deadline : residual_deadline});
  };

  while (!failed && !(session && session->finished())) {
    if (!link_done) {
      while (!link_done && !failed && take(rx->try_receive(clock::now()))) {
      }
      check_deadlines();
      if (failed) break;
    } else if (clock::now() >= request_deadline) {
      res.failures.push_back({lynx::errc::timeout, "the request deadline passed", -1,
                              lynx::failure_policy::fail_request});
      give_up("the request deadline passed");
      break;
    }
    if (!session) {
      if (link_done) {  // every segment but no preamble: it can no longer come
        on_failure(lynx::errc::timeout, "every segment landed but the request preamble did not");
        continue;
      }
      take(rx->try_receive(next_deadline()));
      continue;
    }
    const std::size_t before = session->committed().size();
    res.tl.step_levels.push_back(session->available_level());
    const lynx::step_result step = session->step();
    const time_point now = clock::now();
    if (step.kind == lynx::step_kind::idle) {
      if (link_done)
        lynx::detail::fail(lynx::errc::internal,
                           "decode node: the session waits but the link is done");
      take(rx->try_receive(next_deadline()));
      continue;
    }
    if (step.kind == lynx::step_kind::draft && !have_first_draft) {
      have_first_draft = true;
      first_draft = now;
    }
    if (step.kind == lynx::step_kind::verify && step.level == session->requested_level()) {
      have_verification = true;
      verification = now;
      res.tl.verified_drafts += step.drafted;
      res.tl.accepted_drafts += step.accepted;
    }
    if (before < 2 && session->committed().size() >= 2 && !have_first_committed) {
      have_first_committed = true;
      first_committed = now;
    }
  }
  all_committed = clock::now();

  // Timeline: from the request's arrival at the prefill node, taken as the
  // preamble's arrival less the prefill node's time until it posted it (the preamble is 64
  // bytes: its transit is latency only); without a preamble, from this start.
  const time_point t0 =
      preamble ? preamble_at - std::chrono::duration_cast<clock::duration>(
                                   std::chrono::duration<double>(preamble->prefill_seconds))
               : start;
  auto at = [&](bool happened, time_point t) {
    return happened ? std::chrono::duration<double>(t - t0).count() : -1.0;
  };
  const double shift = std::chrono::duration<double>(start - t0).count();
  for (auto& f : res.failures)
    if (f.at >= 0) f.at += shift;
  if (preamble) res.tl.prefill_done = preamble->prefill_seconds;
  res.tl.anchor_landed = at(level_seen[1], level_at[1]);
  res.tl.residual_landed = at(level_seen[static_cast<std::size_t>(Plan::streams)],
                              level_at[static_cast<std::size_t>(Plan::streams)]);
  res.tl.first_draft = at(have_first_draft, first_draft);
  res.tl.verification_done = at(have_verification, verification);
  res.tl.first_committed = at(have_first_committed, first_committed);
  res.tl.all_committed = at(session && session->finished(), all_committed);
  res.level = level;
  if constexpr (reads_codes) {
    if (merge) {
      if (merge->done() && !merge->failed() && merge->ready() == merge->size()) {
        res.codes_ready = at(true, merge->finished_at());
        res.merge_seconds = std::chrono::duration<double>(merge->elapsed()).count();
      }
      engine.use_codes(static_cast<const lynx::background_merge<Plan>*>(nullptr));
      merge.reset();  // stops a merge still running
    }
    res.full_level_on_codes = engine.inner().attention().full_level_on_codes;
    res.full_level_on_planes = engine.inner().attention().full_level_on_planes;
  }
  if (session) {
    res.tl.tokens.assign(session->committed().begin(), session->committed().end());
    res.stats = session->stats();
    res.tl.provisional_tokens = res.stats.provisional_tokens;
    res.tl.retracted_tokens = res.stats.retracted_tokens;
    res.tl.retractions = res.stats.retractions;
  }
  if (failed)
    res.outcome = lynx::request_outcome::failed;
  else if (session && session->unverified())
    res.outcome = lynx::request_outcome::completed_unverified;
  else
    res.outcome = lynx::request_outcome::completed;
  return res;
}

/// The tokens of plain decoding (no speculation) over the prompt KV of `prompt`
/// quantized by Plan and read at `level` on every layer (Plan::streams: all
/// planes, the exactness reference; 1: the anchor alone): `count` tokens, the
/// prefill's own first, each chosen by `verifier`'s decide() (greedy, or
/// sampling with the draw of its position). Computed locally, for checking a
/// decode node.
template <lynx::stream_plan_type Plan, class Weights>
std::vector<int> plain_reference(const Weights& w, const std::vector<int>& prompt, int count,
                                 int level, request_verifier verifier) {
  const prefill_result<Weights> pre = run_prefill(w, prompt, verifier);
  const auto tensors = received_locally<Plan>(w, pre.node);
  typename family<Weights>::template decode_engine<Plan> e(w, tensors,
                                                           static_cast<int>(prompt.size()));
  std::vector<int> out{pre.first_token};
  std::vector<float> row(static_cast<std::size_t>(family<Weights>::vocab(w)));
  while (static_cast<int>(out.size()) < count) {
    const int t = out.back();
    const auto position = static_cast<std::int64_t>(prompt.size() + out.size());
    e.forward({&t, 1}, position - 1, level, row);
    out.push_back(verifier.decide(row, position));
  }
  return out;
}

/// plain_reference with greedy decoding.
template <lynx::stream_plan_type Plan, class Weights>
std::vector<int> plain_greedy_reference(const Weights& w, const std::vector<int>& prompt, int count,
                                        int level = Plan::streams) {
  return plain_reference<Plan>(w, prompt, count, level, {});
}

}  // namespace lynx_examples::disagg
