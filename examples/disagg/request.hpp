// One disaggregated request, end to end, on a simulated link: a prefill node
// computes the prompt KV, encodes it layer by layer and sends it; a decode node
// receives segments into bit-plane tensors and decodes with a progressive
// session (Lynx), or waits for the whole cache (the blocking baselines).
//
// Time: the link runs on its virtual clock; compute (prefill, encode, every
// decode forward) is measured on this machine with a steady clock and added to
// the virtual time, so the timeline is the link's exact arithmetic plus real
// compute costs.
//
// Any model family of disagg/family.hpp (llama2.c, Gemma-3 GGUF): the weights'
// type picks it. Greedy decoding at temperature 0, speculative sampling above
// (request_verifier).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "disagg/family.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/layer_set.hpp"
#include "lynx/speculation/request_driver.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/speculation/verifier.hpp"
#include "lynx/transport/scheduler.hpp"
#include "lynx/transport/simulated_link.hpp"

namespace lynx_examples::disagg {

/// The verifier of every run of a request, chosen at run time so that one
/// instantiation serves both: greedy (lynx::greedy_verifier) at temperature 0,
/// speculative sampling (lynx::sampling_verifier, counter-based draws of
/// (seed, purpose, position, round)) above it. Blocking runs and the prefill
/// node's own token choose with decide(row, position), the draw a Lynx
/// session's exact steps take too; drafts, acceptance tests and resampling
/// take draws of their own, so at T > 0 a session's tokens follow the target
/// distribution without repeating blocking sampling's draws.
struct request_verifier {
  using verifier_tag = void;
  static constexpr bool needs_draft_rows = true;  // sampling needs q; greedy ignores the rows

  lynx::sampling_verifier sampling{0.0f, {}};  // temperature 0: greedy

  static request_verifier at(float temperature, std::uint64_t seed) {
    request_verifier v;
    v.sampling.temperature = temperature;
    v.sampling.rng.seed = seed;
    return v;
  }
  [[nodiscard]] bool greedy() const { return !(sampling.temperature > 0.0f); }

  std::int32_t draft(std::span<const float> row, std::int64_t position) {
    return greedy() ? lynx::argmax_token(row) : sampling.draft(row, position);
  }
  std::int32_t decide(std::span<const float> row, std::int64_t position) {
    return greedy() ? lynx::argmax_token(row) : sampling.decide(row, position);
  }
  lynx::verify_outcome verify(std::span<const std::int32_t> drafts,
                              std::span<const float> draft_rows, std::span<const float> target_rows,
                              std::int64_t vocab, std::int64_t first_position, int level) {
    return greedy()
               ? lynx::greedy_verifier{}.verify(drafts, draft_rows, target_rows, vocab,
                                                first_position, level)
               : sampling.verify(drafts, draft_rows, target_rows, vocab, first_position, level);
  }
};
static_assert(lynx::verifier_policy<request_verifier>);

struct link_config {
  double gbit_per_s = 0.01;  // link bandwidth
  double latency_us = 50;    // one way
  int lanes =
      1;  // 1: one link, strict priority; 2: a lane per stream kind, both sharing gbit_per_s
  std::size_t residual_window = 256 << 10;  // residual bytes in flight at once
};

struct request_config {
  link_config link;
  int committed_tokens = 64;  // tokens after the prompt, the prefill's own included
  int max_draft = 8;
  int max_draft_in_flight = 0;  // draft on while the residual is in flight, up to this many
                                // (lynx::session_options::max_draft_in_flight; 0: max_draft)
  int encode_threads = 1;
  request_verifier verifier{};  // greedy unless a temperature is set
};

/// Timeline of one request, seconds from the request's arrival at the prefill node.
/// -1: the event did not happen (e.g. no draft in a blocking transfer).
struct timeline {
  std::string name;
  double prefill_done = -1, encode_done = -1, anchor_landed = -1, first_draft = -1,
         residual_landed = -1, verification_done = -1, first_committed = -1, all_committed = -1;
  std::int64_t verified_drafts = 0, accepted_drafts = 0;
  // Lynx runs, from session_stats: drafts shown as provisional tokens (the first at
  // first_draft), those taken back, and the retraction events.
  std::int64_t provisional_tokens = 0, retracted_tokens = 0, retractions = 0;
  std::uint64_t bytes_sent = 0;
  std::vector<int> tokens;       // committed tokens
  std::vector<int> step_levels;  // Lynx runs: the level available at each session step (a replay)
};

/// The prefill node's result, shared by every variant of a request.
template <class Weights>
struct prefill_result {
  std::vector<int> prompt;
  int first_token = 0;
  double seconds = 0;  // measured prefill compute
  prefill_engine_of<Weights> node;
  explicit prefill_result(const Weights& w) : node(w) {}
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Prefills `prompt`; the first token is the verifier's choice at position prompt.size().
template <class Weights>
prefill_result<Weights> run_prefill(const Weights& w, std::vector<int> prompt,
                                    request_verifier verifier = {}) {
  prefill_result<Weights> r(w);
  r.prompt = std::move(prompt);
  const auto t0 = std::chrono::steady_clock::now();
  r.first_token =
      verifier.decide(r.node.prefill(r.prompt), static_cast<std::int64_t>(r.prompt.size()));
  r.seconds = seconds_since(t0);
  return r;
}

inline lynx::virtual_duration virtual_seconds(double s) {
  return lynx::virtual_duration(static_cast<std::int64_t>(s * 1e12));
}

inline lynx::simulated_link_options link_options(const link_config& c) {
  const auto bps = static_cast<std::uint64_t>(c.gbit_per_s * 1e9 / 8);
  const auto latency = virtual_seconds(c.latency_us * 1e-6);
  return c.lanes == 2 ? lynx::simulated_link_options::two_lanes(bps, latency)
                      : lynx::simulated_link_options::one_lane(bps, latency);
}

/// The prompt as a decode node holds it once every stream has landed: each layer
/// of the prefill node's engine encoded and accepted into its receiver tensor.
template <lynx::stream_plan_type Plan, class Weights>
typename family<Weights>::template tensors<Plan> received_locally(
    const Weights& w, const prefill_engine_of<Weights>& node) {
  const int prompt_tokens = node.cache().prompt_length();
  auto tensors = family<Weights>::template make_tensors<Plan>(w, prompt_tokens, 0);
  for (int l = 0; l < family<Weights>::layers(w); ++l) {
    const auto encoded = encode_layer<Plan>(node, l);
    for (int s = 0; s < Plan::streams; ++s)
      (void)tensors[static_cast<std::size_t>(l)].accept(encoded.segment(s));
  }
  return tensors;
}

/// Sends `streams_sent` streams of `Plan` (all of them for Lynx and blocking 8-bit,
/// only the anchor for blocking 4-bit) and decodes with a session whose target is
/// the highest level sent. With one stream sent, the session decodes exactly at
/// that level as soon as the whole cache has landed: the blocking baseline; so
/// does it with decode_when_complete (a blocking transfer of every stream).
template <lynx::stream_plan_type Plan, class Weights>
timeline run_request(const Weights& w, const prefill_result<Weights>& pre,
                     const request_config& cfg, int streams_sent, std::string name,
                     bool decode_when_complete = false) {
  using F = family<Weights>;
  if (streams_sent < 1 || streams_sent > Plan::streams)
    throw std::invalid_argument("run_request: streams_sent out of range");
  timeline tl;
  tl.name = std::move(name);
  tl.prefill_done = pre.seconds;
  const int prompt_tokens = static_cast<int>(pre.prompt.size());
  const int layers = F::layers(w);

  lynx::simulated_link link(link_options(cfg.link));
  lynx::stream_scheduler scheduler(link.sender(),
                                   lynx::scheduler_options{cfg.link.residual_window});
  link.on_step([&] { scheduler.progress(); });

  // Prefill node: encode each layer (measured) and hand it to the scheduler at
  // the virtual time its encode finished; anchors leave as soon as they exist.
  std::vector<lynx::encoded_layer<Plan>> encoded;
  encoded.reserve(static_cast<std::size_t>(layers));
  double t = pre.seconds;
  for (int l = 0; l < layers; ++l) {
    const auto t0 = std::chrono::steady_clock::now();
    encoded.push_back(encode_layer<Plan>(pre.node, l, {0, cfg.encode_threads}));
    t += seconds_since(t0);
    link.advance_to(lynx::virtual_time(virtual_seconds(t)));
    for (int s = 0; s < streams_sent; ++s) {
      scheduler.submit(encoded.back().segment(s));
      tl.bytes_sent += encoded.back().segment(s).size();
    }
    scheduler.progress();
  }
  tl.encode_done = t;

  // Decode node: lynx::request_driver on the link's virtual clock, each
  // session step moving it by the step's measured compute.
  auto tensors = F::template make_tensors<Plan>(w, prompt_tokens, 0);
  lynx::layer_set<Plan> received(tensors);
  using engine_type = typename F::template decode_engine<Plan>;
  engine_type engine(w, tensors, prompt_tokens);
  lynx::session_options options;
  options.max_draft = cfg.max_draft;
  options.max_draft_in_flight = cfg.max_draft_in_flight;
  options.max_new_tokens = cfg.committed_tokens;
  using session_type = lynx::progressive_session<engine_type, request_verifier>;
  session_type session(engine, cfg.verifier, streams_sent, prompt_tokens, pre.first_token, options);
  link.advance_to(lynx::virtual_time(virtual_seconds(std::max(t, lynx::to_seconds(link.now())))));
  lynx::request_options ro;
  ro.target_level = streams_sent;
  ro.hold_until_complete = decode_when_complete;
  // A simulated link loses nothing: no deadline applies (a day of virtual time
  // each), and a broken link fails the request.
  ro.deadlines = {std::chrono::hours(24), std::chrono::hours(24), std::chrono::hours(24)};
  lynx::request_driver<lynx::layer_set<Plan>, session_type, lynx::simulated_link::receiver_endpoint,
                       lynx::simulated_time>
      driver(received, link.receiver(), ro, {}, lynx::simulated_time(link));
  driver.attach(session);
  const auto rep = driver.run();
  if (rep.outcome != lynx::request_outcome::completed)
    throw std::runtime_error("run_request: " + rep.failure);
  if (!rep.rejected.empty())  // a simulated link neither damages nor mixes requests
    throw std::runtime_error("run_request: a segment was refused: " + rep.rejected[0].what);
  const lynx::virtual_time origin{};  // the request's arrival at the prefill node
  tl.step_levels = rep.step_levels;
  tl.verified_drafts = rep.verified_drafts;
  tl.accepted_drafts = rep.accepted_drafts;
  tl.first_draft = rep.seconds(rep.first_draft, origin);
  tl.verification_done = rep.seconds(rep.verification, origin);
  tl.first_committed = rep.seconds(rep.first_committed, origin);
  tl.all_committed = rep.seconds(rep.finished, origin);
  tl.anchor_landed = rep.seconds(rep.level_at[1], origin);
  if (streams_sent > 1)
    tl.residual_landed = rep.seconds(rep.level_at[static_cast<std::size_t>(streams_sent)], origin);
  tl.tokens.assign(session.committed().begin(), session.committed().end());
  tl.provisional_tokens = session.stats().provisional_tokens;
  tl.retracted_tokens = session.stats().retracted_tokens;
  tl.retractions = session.stats().retractions;
  link.run_until_idle();
  return tl;
}

/// A Lynx session replayed over the planes the prefill node sent, all present
/// from the start, told at each step the level the real run had then
/// (`step_levels`, from its timeline). A session's choices depend only on the
/// planes it reads at each level and on its verifier's draws, so the replay
/// commits what the run committed when the decode node read, at every level,
/// the bits that were sent. At T > 0 this is the exact check of a run:
/// speculative sampling matches blocking sampling in distribution, not token
/// for token.
template <lynx::stream_plan_type Plan, class Weights>
std::vector<int> replay_session(const Weights& w, const prefill_engine_of<Weights>& node,
                                int first_token, int count, int max_draft,
                                const request_verifier& verifier, std::span<const int> step_levels,
                                int max_draft_in_flight = 0) {
  const int prompt_tokens = node.cache().prompt_length();
  const auto tensors = received_locally<Plan>(w, node);
  typename family<Weights>::template decode_engine<Plan> engine(w, tensors, prompt_tokens);
  lynx::session_options options;
  options.max_draft = max_draft;
  options.max_draft_in_flight = max_draft_in_flight;
  options.max_new_tokens = count;
  lynx::progressive_session session(engine, verifier, Plan::streams, prompt_tokens, first_token,
                                    options);
  for (const int level : step_levels) {
    if (session.finished()) break;
    if (level > session.available_level()) session.set_available_level(level);
    (void)session.step();
  }
  return {session.committed().begin(), session.committed().end()};
}

/// Blocking bf16: every layer's K and V as raw bf16 (2 bytes per element, no
/// quantization), sent whole; decoding starts when the last byte has landed and
/// attends a bf16-rounded fp32 cache.
template <class Weights>
timeline run_blocking_bf16(const Weights& w, const prefill_result<Weights>& pre,
                           const request_config& cfg) {
  using F = family<Weights>;
  timeline tl;
  tl.name = "blocking bf16";
  tl.prefill_done = pre.seconds;
  const int layers = F::layers(w);
  lynx::simulated_link link(link_options(cfg.link));
  std::vector<std::vector<lynx::bf16>> wire(static_cast<std::size_t>(layers));
  double t = pre.seconds;
  for (int l = 0; l < layers; ++l) {
    const auto t0 = std::chrono::steady_clock::now();
    auto& buf = wire[static_cast<std::size_t>(l)];
    const auto kv = F::shipped(pre.node, l);
    const auto n = static_cast<std::size_t>(kv.shape.elements());
    for (std::size_t i = 0; i < n; ++i) buf.push_back(lynx::bf16(kv.keys[i]));
    for (std::size_t i = 0; i < n; ++i) buf.push_back(lynx::bf16(kv.values[i]));
    t += seconds_since(t0);
    link.advance_to(lynx::virtual_time(virtual_seconds(t)));
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(buf.data()),
                                           buf.size() * sizeof(lynx::bf16));
    const auto posted =
        link.sender().post({bytes, {static_cast<std::uint32_t>(l), 0, 0}, lynx::anchor_lane, 0});
    if (posted.status != lynx::errc::ok)
      throw lynx::error(posted.status, "blocking bf16: post failed");
    tl.bytes_sent += bytes.size();
  }
  tl.encode_done = t;
  link.run_until_idle();
  double landed = 0;
  for (const auto& a : link.arrivals()) landed = std::max(landed, lynx::to_seconds(a.arrived));
  tl.anchor_landed = landed;
  // Decode node: the prefill node's engine with its shipped prompt KV replaced by
  // the received bf16 values, widened to fp32 (what a decode node's exact fp32
  // attention over the received cache computes).
  prefill_engine_of<Weights> engine = pre.node;
  for (int l = 0; l < layers; ++l) {
    const auto& buf = wire[static_cast<std::size_t>(l)];
    const auto kv = F::shipped(engine, l);
    const auto n = static_cast<std::size_t>(kv.shape.elements());
    for (std::size_t i = 0; i < n; ++i) kv.keys[i] = static_cast<float>(buf[i]);
    for (std::size_t i = 0; i < n; ++i) kv.values[i] = static_cast<float>(buf[n + i]);
  }
  request_verifier verifier = cfg.verifier;
  double now = std::max(t, landed);
  tl.tokens.push_back(pre.first_token);
  std::vector<float> logits(static_cast<std::size_t>(F::vocab(w)));
  while (static_cast<int>(tl.tokens.size()) < cfg.committed_tokens) {
    const auto t0 = std::chrono::steady_clock::now();
    const int token = tl.tokens.back();
    engine.decode(std::span<const int>(&token, 1), engine.position(), logits);
    tl.tokens.push_back(verifier.decide(logits, engine.position()));
    now += seconds_since(t0);
    if (tl.tokens.size() == 2) tl.first_committed = now;
  }
  tl.all_committed = now;
  return tl;
}

}  // namespace lynx_examples::disagg
