// One disaggregated request, end to end, on a simulated link: a prefill node
// computes the prompt KV, encodes it layer by layer and sends it; a decode node
// receives segments into bit-plane tensors and decodes with a progressive
// session (Lynx), or waits for the whole cache (the blocking baselines).
//
// Time: the link runs on its virtual clock; compute (prefill, encode, every
// decode forward) is measured on this machine with a steady clock and added to
// the virtual time, so the timeline is the link's exact arithmetic plus real
// compute costs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "llama2c/llama2c.hpp"
#include "llama2c/lynx_engine.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/transport/scheduler.hpp"
#include "lynx/transport/simulated_link.hpp"

namespace lynx_examples::disagg {

namespace ll = lynx_examples::llama2c;

struct link_config {
  double gbit_per_s = 0.01;  // link bandwidth
  double latency_us = 50;    // one way
  int lanes = 1;             // 1: one shared link, strict priority; 2: a lane per stream kind
  std::size_t residual_window = 256 << 10;  // residual bytes in flight at once
};

struct request_config {
  link_config link;
  int committed_tokens = 64;  // tokens after the prompt, the prefill's own included
  int max_draft = 8;
  int encode_threads = 1;
};

/// Timeline of one request, seconds from the request's arrival at the prefill node.
/// -1: the event did not happen (e.g. no draft in a blocking transfer).
struct timeline {
  std::string name;
  double prefill_done = -1, encode_done = -1, anchor_landed = -1, first_draft = -1,
         residual_landed = -1, verification_done = -1, first_committed = -1, all_committed = -1;
  std::int64_t verified_drafts = 0, accepted_drafts = 0;
  std::uint64_t bytes_sent = 0;
  std::vector<int> tokens;  // committed tokens
};

/// The prefill node's result, shared by every variant of a request.
struct prefill_result {
  std::vector<int> prompt;
  int first_token = 0;
  double seconds = 0;  // measured prefill compute
  ll::engine<> node;
  explicit prefill_result(const ll::weights& w) : node(w) {}
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline prefill_result run_prefill(const ll::weights& w, std::vector<int> prompt) {
  prefill_result r(w);
  r.prompt = std::move(prompt);
  const auto t0 = std::chrono::steady_clock::now();
  r.first_token = ll::argmax(r.node.prefill(r.prompt));
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

/// Sends `streams_sent` streams of `Plan` (all of them for Lynx and blocking 8-bit,
/// only the anchor for blocking 4-bit) and decodes with a session whose target is
/// the highest level sent. With one stream sent, the session decodes exactly at
/// that level as soon as the whole cache has landed: the blocking baseline.
template <lynx::stream_plan_type Plan>
timeline run_request(const ll::weights& w, const prefill_result& pre, const request_config& cfg,
                     int streams_sent, std::string name) {
  if (streams_sent < 1 || streams_sent > Plan::streams)
    throw std::invalid_argument("run_request: streams_sent out of range");
  timeline tl;
  tl.name = std::move(name);
  tl.prefill_done = pre.seconds;
  const int prompt_tokens = static_cast<int>(pre.prompt.size());
  const int layers = w.cfg().n_layers;

  lynx::simulated_link link(link_options(cfg.link));
  lynx::stream_scheduler scheduler(link.sender(),
                                   lynx::scheduler_options{cfg.link.residual_window});
  link.on_step([&] { scheduler.progress(); });

  // Prefill node: encode each layer (measured) and hand it to the scheduler at
  // the virtual time its encode finished; anchors leave as soon as they exist.
  std::vector<lynx::encoded_layer<Plan>> encoded;
  encoded.reserve(static_cast<std::size_t>(layers));
  double t = pre.seconds;
  const ll::kv_cache& cache = pre.node.cache();
  const lynx::kv_shape shape{prompt_tokens, cache.n_kv_heads(), cache.head_dim()};
  for (int l = 0; l < layers; ++l) {
    const auto t0 = std::chrono::steady_clock::now();
    encoded.push_back(lynx::encode<Plan, 32, float>(
        lynx::token_major<const float>(cache.prompt_keys(l).data(), shape),
        lynx::token_major<const float>(cache.prompt_values(l).data(), shape),
        static_cast<std::uint32_t>(l), {0, cfg.encode_threads}));
    t += seconds_since(t0);
    link.advance_to(lynx::virtual_time(virtual_seconds(t)));
    for (int s = 0; s < streams_sent; ++s) {
      scheduler.submit(encoded.back().segment(s));
      tl.bytes_sent += encoded.back().segment(s).size();
    }
    scheduler.progress();
  }
  tl.encode_done = t;

  // Decode node.
  auto tensors = ll::make_prompt_tensors<Plan>(w.cfg(), prompt_tokens);
  ll::lynx_decode_engine<Plan> engine(w, tensors, prompt_tokens);
  lynx::session_options options;
  options.max_draft = cfg.max_draft;
  options.max_new_tokens = cfg.committed_tokens;
  lynx::progressive_session session(engine, lynx::greedy_verifier{}, streams_sent, prompt_tokens,
                                    pre.first_token, options);
  std::vector<double> level_time(static_cast<std::size_t>(streams_sent) + 1, -1.0);
  auto& receiver = link.receiver();
  double now = std::max(t, lynx::to_seconds(link.now()));
  link.advance_to(lynx::virtual_time(virtual_seconds(now)));
  auto deliver = [&] {
    for (;;) {
      auto r = receiver.try_receive(link.now());
      if (r.status == lynx::errc::timeout) break;
      if (r.status != lynx::errc::ok) throw lynx::error(r.status, "decode node: the link failed");
      tensors[lynx::peek_header(r.segment.bytes).layer].accept(r.segment.bytes);
      const double arrived = lynx::to_seconds(r.segment.arrival);
      receiver.release(r.segment);
      int level = streams_sent;
      for (const auto& tensor : tensors) level = std::min(level, tensor.precision_level());
      for (int l = 1; l <= level; ++l)
        if (level_time[static_cast<std::size_t>(l)] < 0)
          level_time[static_cast<std::size_t>(l)] = arrived;
      if (level > session.available_level()) session.set_available_level(level);
    }
  };
  for (int guard = 0; !session.finished(); ++guard) {
    if (guard > 1000000) throw std::runtime_error("run_request: no progress");
    deliver();
    const std::size_t committed_before = session.committed().size();
    const auto t0 = std::chrono::steady_clock::now();
    const lynx::step_result step = session.step();
    if (step.kind == lynx::step_kind::idle) {
      if (!link.step())
        throw std::runtime_error(
            "run_request: the session waits for planes the link will never deliver");
      now = std::max(now, lynx::to_seconds(link.now()));
      continue;
    }
    now += seconds_since(t0);
    link.advance_to(lynx::virtual_time(virtual_seconds(now)));
    if (step.kind == lynx::step_kind::draft && tl.first_draft < 0) tl.first_draft = now;
    if (step.kind == lynx::step_kind::verify && step.level == streams_sent) {
      tl.verification_done = now;
      tl.verified_drafts += step.drafted;
      tl.accepted_drafts += step.accepted;
    }
    if (committed_before < 2 && session.committed().size() >= 2) tl.first_committed = now;
  }
  tl.all_committed = now;
  tl.anchor_landed = level_time[1];
  if (streams_sent > 1) tl.residual_landed = level_time[static_cast<std::size_t>(streams_sent)];
  tl.tokens.assign(session.committed().begin(), session.committed().end());
  link.run_until_idle();
  return tl;
}

/// Blocking bf16: every layer's K and V as raw bf16 (2 bytes per element, no
/// quantization), sent whole; decoding starts when the last byte has landed and
/// attends a bf16-rounded fp32 cache.
inline timeline run_blocking_bf16(const ll::weights& w, const prefill_result& pre,
                                  const request_config& cfg) {
  timeline tl;
  tl.name = "blocking bf16";
  tl.prefill_done = pre.seconds;
  const ll::kv_cache& cache = pre.node.cache();
  const int layers = w.cfg().n_layers;
  lynx::simulated_link link(link_options(cfg.link));
  std::vector<std::vector<lynx::bf16>> wire(static_cast<std::size_t>(layers));
  double t = pre.seconds;
  for (int l = 0; l < layers; ++l) {
    const auto t0 = std::chrono::steady_clock::now();
    auto& buf = wire[static_cast<std::size_t>(l)];
    for (const float x : cache.prompt_keys(l)) buf.push_back(lynx::bf16(x));
    for (const float x : cache.prompt_values(l)) buf.push_back(lynx::bf16(x));
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
  // Decode node: the received bf16 values, widened to the engine's fp32 prompt cache.
  ll::engine<> engine(w);
  engine.begin_decode(static_cast<int>(pre.prompt.size()));
  for (int l = 0; l < layers; ++l) {
    const auto& buf = wire[static_cast<std::size_t>(l)];
    auto keys = engine.cache().prompt_keys(l);
    auto values = engine.cache().prompt_values(l);
    for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<float>(buf[i]);
    for (std::size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<float>(buf[keys.size() + i]);
  }
  double now = std::max(t, landed);
  tl.tokens.push_back(pre.first_token);
  std::vector<float> logits(static_cast<std::size_t>(w.cfg().vocab_size));
  while (static_cast<int>(tl.tokens.size()) < cfg.committed_tokens) {
    const auto t0 = std::chrono::steady_clock::now();
    const int token = tl.tokens.back();
    engine.decode(std::span<const int>(&token, 1), engine.position(), logits);
    tl.tokens.push_back(ll::argmax(logits));
    now += seconds_since(t0);
    if (tl.tokens.size() == 2) tl.first_committed = now;
  }
  tl.all_committed = now;
  return tl;
}

}  // namespace lynx_examples::disagg
