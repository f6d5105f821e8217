// The decode node of a disaggregated request over a real transport (any
// lynx::segment_receiver on the steady clock: TCP, UCX, loopback): the
// library's lynx::request_driver does the work (segments into per-layer
// bit-plane tensors, the level present on every layer told to a progressive
// session that decodes speculatively meanwhile, deadlines, the failure policy
// of lynx/speculation/failure_policy.hpp, resend requests); this file adds what
// is the example's own: the request preamble that carries the first token and
// starts the session, the background merge of the complete prompt into codes
// for an engine that reads codes (llama2.c's; the Gemma-3 engine reads the
// planes), and the timeline of the request as the demo prints it.
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
#include "lynx/speculation/request_driver.hpp"
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

using lynx::rejected_segment;  // a segment (or preamble) the decode node refused, and why
using lynx::transfer_failure;  // a failure of the transfer as the decode node saw it

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
  std::optional<request_preamble> preamble;
  time_point preamble_at{};

  using driver_type = lynx::request_driver<lynx::layer_set<Plan>, session_type, Receiver>;
  typename driver_type::hooks dh;
  dh.rerequest = hooks.rerequest;
  dh.on_segment = hooks.on_segment;
  driver_type* driver = nullptr;
  // The request preamble (first token, prefill time) shares the lanes with the
  // segments; the session starts when it lands.
  dh.on_message = [&](const lynx::received_segment<clock>& seg) {
    if (!looks_like_preamble(seg.bytes)) return false;
    const auto p = parse_preamble(seg.bytes);
    if (!p)
      driver->reject({}, seg.lane, lynx::errc::corrupted_segment,
                     "a request preamble of the wrong size or version");
    else if (p->generation != o.generation)
      driver->reject({0, 0, p->generation}, seg.lane, lynx::errc::stale_generation,
                     "request preamble of generation " + std::to_string(p->generation) +
                         ", the request is " + std::to_string(o.generation));
    else if (p->prompt_tokens != prompt_tokens || p->layers != layers ||
             p->streams != Plan::streams)
      driver->reject({0, 0, p->generation}, seg.lane, lynx::errc::shape_mismatch,
                     "request preamble of " + std::to_string(p->prompt_tokens) + " tokens, " +
                         std::to_string(p->layers) + " layers, " + std::to_string(p->streams) +
                         " streams; expected " + std::to_string(prompt_tokens) + ", " +
                         std::to_string(layers) + ", " + std::to_string(Plan::streams));
    else if (!preamble) {  // a resend repeats it: the first one counts
      preamble = p;
      preamble_at = seg.arrival;
      session.emplace(engine, o.verifier, Plan::streams, prompt_tokens, preamble->first_token, so);
      session->on_commit_event([&](const lynx::committed_token& t) {
        res.commits.push_back(t);
        if (hooks.on_commit) hooks.on_commit(t);
      });
      if (hooks.on_token) session->on_token_event(hooks.on_token);
      driver->attach(*session);
    }
    return true;
  };
  // The complete prompt: merge it into codes on a helper thread (an engine that reads codes).
  dh.on_level = [&](int level, time_point) {
    if constexpr (reads_codes) {
      if (level == Plan::streams && o.merge_codes) {
        merge.emplace(std::span<const lynx::bitplane_tensor<Plan>>(tensors), o.merge_threads);
        engine.use_codes(&*merge);
      }
    }
  };
  lynx::request_options ro;
  ro.failure = o.failure;
  ro.deadlines = o.deadlines;
  driver_type d(received, receiver, ro, std::move(dh));
  driver = &d;
  const lynx::request_report<clock> rep = d.run();

  // Timeline: from the request's arrival at the prefill node, taken as the
  // preamble's arrival less the prefill node's time until it posted it (the preamble is 64
  // bytes: its transit is latency only); without a preamble, from the driver's start.
  const time_point t0 =
      preamble ? preamble_at - std::chrono::duration_cast<clock::duration>(
                                   std::chrono::duration<double>(preamble->prefill_seconds))
               : rep.started;
  const double shift = std::chrono::duration<double>(rep.started - t0).count();
  res.rejected = rep.rejected;
  res.failures = rep.failures;
  for (auto& f : res.failures)
    if (f.at >= 0) f.at += shift;
  res.failure = rep.failure;
  res.duplicates = rep.duplicates;
  res.stale = rep.stale;
  res.rerequests = rep.rerequests;
  res.segments_accepted = rep.segments_accepted;
  res.level = rep.level;
  res.outcome = rep.outcome;
  res.tl.bytes_sent = rep.bytes_received;
  res.tl.step_levels = rep.step_levels;
  res.tl.verified_drafts = rep.verified_drafts;
  res.tl.accepted_drafts = rep.accepted_drafts;
  if (preamble) res.tl.prefill_done = preamble->prefill_seconds;
  res.tl.anchor_landed = rep.seconds(rep.level_at[1], t0);
  res.tl.residual_landed = rep.seconds(rep.level_at[static_cast<std::size_t>(Plan::streams)], t0);
  res.tl.first_draft = rep.seconds(rep.first_draft, t0);
  res.tl.verification_done = rep.seconds(rep.verification, t0);
  res.tl.first_committed = rep.seconds(rep.first_committed, t0);
  res.tl.all_committed = rep.seconds(rep.finished, t0);
  if constexpr (reads_codes) {
    if (merge) {
      if (merge->done() && !merge->failed() && merge->ready() == merge->size()) {
        res.codes_ready = rep.seconds(merge->finished_at(), t0);
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
