// The prefill node of a disaggregated request over a real transport (any
// lynx::segment_sender: TCP, UCX, loopback): prefill the prompt, post the
// request preamble (its own token), then encode the prompt KV layer by layer
// and hand every segment to the stream scheduler, anchors first. A resend
// (the decode side's rerequest) sends only the segments asked for.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "disagg/preamble.hpp"
#include "disagg/request.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/transport/scheduler.hpp"

namespace lynx_examples::disagg {

template <lynx::segment_sender Sender>
struct prefill_node_options {
  std::uint64_t generation = 1;
  std::size_t residual_window = 256 << 10;  // residual bytes in flight at once
  int encode_threads = 1;
  std::chrono::milliseconds deadline{30'000};  // from the start until every segment is final
  /// Non-empty: a resend; only these (layer, stream) segments go (the preamble always does).
  std::vector<lynx::segment_id> only;
  /// Fault injection: before the request, the anchors of this many layers from
  /// generation - 1 with other contents (a late segment of an earlier request).
  int stale_anchor_layers = 0;
  /// Called at each segment's final completion (delivered or failed), after the
  /// scheduler released its buffer. Tests kill the process here, mid-residual.
  std::function<void(const lynx::segment_record<typename Sender::clock>&)> on_final;
};

/// What the prefill node saw; seconds from the request's arrival, -1 when it did not happen.
struct prefill_report {
  double prefill_done = -1, encode_done = -1, anchors_delivered = -1, all_delivered = -1;
  lynx::errc status = lynx::errc::ok;  // the scheduler's: ok, or the first send failure / timeout
  std::uint64_t bytes_sent = 0;        // segments and preamble
  int segments = 0;                    // segments of this request submitted
  int first_token = 0;
  std::string error;
};

/// Runs the prefill node's side of one request over `sender`, on the model
/// family of `w` (disagg/family.hpp); the first token is `verifier`'s choice.
template <lynx::stream_plan_type Plan, lynx::segment_sender Sender, class Weights>
prefill_report run_prefill_node(Sender& sender, const Weights& w, std::vector<int> prompt,
                                const prefill_node_options<Sender>& o,
                                const request_verifier& verifier = {}) {
  using F = family<Weights>;
  static_assert(std::is_same_v<typename Sender::clock, std::chrono::steady_clock>,
                "run_prefill_node: a wall-clock transport");
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const auto deadline = t0 + o.deadline;
  auto since = [&](clock::time_point t) { return std::chrono::duration<double>(t - t0).count(); };
  prefill_report report;

  const prefill_result<Weights> pre = run_prefill(w, std::move(prompt), verifier);
  report.prefill_done = since(clock::now());  // the engine's setup included, not only pre.seconds
  report.first_token = pre.first_token;
  const int layers = F::layers(w);
  const int prompt_tokens = static_cast<int>(pre.prompt.size());

  request_preamble p;
  p.generation = o.generation;
  p.prompt_tokens = prompt_tokens;
  p.first_token = pre.first_token;
  p.layers = layers;
  p.streams = Plan::streams;
  p.prefill_seconds = report.prefill_done;
  const std::vector<std::byte> preamble =
      to_bytes(p);  // alive until return: past its final completion
  const lynx::post_result posted =
      sender.post({preamble, {0, 0, o.generation}, lynx::anchor_lane, 0});
  if (!posted.ok()) {
    report.status = posted.status;
    report.error = "posting the request preamble failed";
    return report;
  }
  report.bytes_sent += preamble.size();

  auto wanted = [&](std::uint32_t layer, int stream) {
    if (o.only.empty()) return true;
    for (const auto& id : o.only)
      if (id.layer == layer && id.stream == stream) return true;
    return false;
  };

  lynx::stream_scheduler<Sender> scheduler(sender, lynx::scheduler_options{o.residual_window});
  int anchors_left = 0;
  for (int l = 0; l < layers; ++l) anchors_left += wanted(static_cast<std::uint32_t>(l), 0);
  scheduler.on_release([&](const lynx::segment_record<clock>& r) {
    if (r.delivered && r.id.generation == o.generation && r.id.stream == 0 && --anchors_left == 0)
      report.anchors_delivered = since(r.final_at);
    if (o.on_final) o.on_final(r);
  });

  std::vector<lynx::encoded_layer<Plan>> stale, encoded;
  for (int l = 0; l < o.stale_anchor_layers && l < layers; ++l) {
    // Layer l's header over layer l+1's data: if it were ever applied, the tokens would change.
    const int source = (l + 1) % layers;
    lynx::encode_options eo{o.generation - 1, 1};
    const auto kv = F::shipped(pre.node, source);
    stale.push_back(lynx::encode<Plan, 32, float>(
        lynx::token_major<const float>(kv.keys, kv.shape),
        lynx::token_major<const float>(kv.values, kv.shape), static_cast<std::uint32_t>(l), eo));
    scheduler.submit(stale.back().segment(0));
    report.bytes_sent += stale.back().segment(0).size();
  }
  encoded.reserve(static_cast<std::size_t>(layers));
  for (int l = 0; l < layers; ++l) {
    lynx::encode_options eo;
    eo.generation = o.generation;
    eo.threads = o.encode_threads;
    encoded.push_back(encode_layer<Plan>(pre.node, l, eo));
    for (int s = 0; s < Plan::streams; ++s) {
      if (!wanted(static_cast<std::uint32_t>(l), s)) continue;
      scheduler.submit(encoded.back().segment(s));
      report.bytes_sent += encoded.back().segment(s).size();
      ++report.segments;
    }
    scheduler.progress();  // anchors leave as soon as they exist
  }
  report.encode_done = since(clock::now());
  report.status = scheduler.run(deadline);
  if (report.status == lynx::errc::ok)
    report.all_delivered = since(clock::now());
  else
    report.error =
        std::string("the transfer ended with ") + std::string(lynx::to_string(report.status));
  return report;
}

}  // namespace lynx_examples::disagg
