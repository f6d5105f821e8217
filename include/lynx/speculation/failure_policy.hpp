// What the decode side does when the prompt KV does not arrive whole: the
// failure policy of a request, its deadlines, and the resend request it sends
// back to the prefill side. Chosen per request; applied by whatever drives the
// receive loop (examples/disagg/decode_node.hpp is one such driver).
//
// A transfer has failed when the link reports an error (peer_failure,
// transport_failure) or a deadline passes while streams are still missing:
//
//   anchor deadline    from the start of the request until every layer's anchor
//                      (stream 0) has landed;
//   residual deadline  from the moment the anchor of every layer has landed (or
//                      a resend was asked) until every stream of every layer has;
//   request deadline   the whole request, decoding included; when it passes the
//                      request fails whatever the policy.
//
// Then, by policy:
//
//   fail_request         the session reports a failed request (session::fail);
//                        nothing more is committed. The tokens committed before
//                        stay valid: they were exact.
//   continue_unverified  decoding goes on at the best level present on every
//                        layer (progressive_session::continue_unverified); every
//                        token committed from then on is delivered marked
//                        unverified (committed_token::verified == false) and
//                        counted in session_stats::unverified_tokens. Never
//                        silent. Needs the anchor: without it the request fails.
//   rerequest            the decode side asks the prefill side to resend the
//                        segments still missing (a resend_request through a
//                        hook); the session keeps drafting meanwhile. The deadlines
//                        restart from the resend. After `max_rerequests` resends
//                        the `after_rerequests` policy applies.
//
// Segments of another generation (a late segment of an earlier request) are
// reported and ignored, never applied (bitplane_tensor::accept refuses them
// with errc::stale_generation); a resend carries the request's own generation.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/planes/segment.hpp"

namespace lynx {

/// What the decode side does when the residual (or the anchor) never arrives or fails.
enum class failure_policy : std::uint8_t {
  fail_request,         // report a failed request; commit nothing more
  continue_unverified,  // decode on at the best level present; later tokens marked unverified
  rerequest,            // ask the prefill side to resend the missing segments
};

constexpr std::string_view to_string(failure_policy p) noexcept {
  switch (p) {
    case failure_policy::fail_request:
      return "fail_request";
    case failure_policy::continue_unverified:
      return "continue_unverified";
    case failure_policy::rerequest:
      return "rerequest";
  }
  return "unknown";
}

/// The policy named by its to_string text; errc::invalid_argument otherwise.
inline failure_policy parse_failure_policy(std::string_view text) {
  for (const auto p : {failure_policy::fail_request, failure_policy::continue_unverified,
                       failure_policy::rerequest})
    if (text == to_string(p)) return p;
  detail::fail(errc::invalid_argument, "unknown failure policy '" + std::string(text) +
                                           "' (fail_request, continue_unverified or rerequest)");
}

/// Deadlines of one request (see the top of this header for what each measures).
struct request_deadlines {
  std::chrono::milliseconds anchor{10'000};  // request start -> every anchor landed
  std::chrono::milliseconds residual{
      10'000};  // every anchor landed (or a resend asked) -> every stream landed
  std::chrono::milliseconds request{120'000};  // request start -> last token committed
};

struct failure_options {
  failure_policy policy = failure_policy::fail_request;
  /// rerequest: resends asked before giving up on the link.
  int max_rerequests = 1;
  /// rerequest: what applies once the resends are spent (fail_request or continue_unverified).
  failure_policy after_rerequests = failure_policy::fail_request;
};

/// How a request ended.
enum class request_outcome : std::uint8_t {
  pending,               // not finished yet
  completed,             // every token verified (exact)
  completed_unverified,  // finished, with tokens after the failure marked unverified
  failed,                // the session reported a failure; fewer tokens than asked
};

constexpr std::string_view to_string(request_outcome o) noexcept {
  switch (o) {
    case request_outcome::pending:
      return "pending";
    case request_outcome::completed:
      return "completed";
    case request_outcome::completed_unverified:
      return "completed_unverified";
    case request_outcome::failed:
      return "failed";
  }
  return "unknown";
}

/// What the decode side asks the prefill side to send again: the segments of
/// its request (generation) that have not landed whole.
struct resend_request {
  std::uint64_t generation = 0;
  std::vector<segment_id> missing;  // (layer, stream) of each segment still needed
  int attempt = 1;                  // 1 for the first resend of the request
};

/// "layer:stream,layer:stream,..." (the generation is not part of the text).
inline std::string format_segment_list(const std::vector<segment_id>& ids) {
  std::string s;
  for (const auto& id : ids) {
    if (!s.empty()) s += ',';
    s += std::to_string(id.layer) + ':' + std::to_string(id.stream);
  }
  return s;
}

/// Parses format_segment_list's text, giving every id `generation`.
inline std::vector<segment_id> parse_segment_list(std::string_view text, std::uint64_t generation) {
  std::vector<segment_id> ids;
  while (!text.empty()) {
    const auto comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    const auto colon = item.find(':');
    detail::require(colon != std::string_view::npos && colon > 0 && colon + 1 < item.size(),
                    errc::invalid_argument,
                    "segment list: '" + std::string(item) + "' is not layer:stream");
    try {
      const std::string layer(item.substr(0, colon)), stream(item.substr(colon + 1));
      std::size_t used_layer = 0, used_stream = 0;
      const unsigned long l = std::stoul(layer, &used_layer);
      const int s = std::stoi(stream, &used_stream);
      detail::require(used_layer == layer.size() && used_stream == stream.size() && s >= 0,
                      errc::invalid_argument,
                      "segment list: '" + std::string(item) + "' is not layer:stream");
      ids.push_back({static_cast<std::uint32_t>(l), s, generation});
    } catch (const std::logic_error&) {
      detail::fail(errc::invalid_argument,
                   "segment list: '" + std::string(item) + "' is not layer:stream");
    }
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
  }
  return ids;
}

}  // namespace lynx
