// Errors of the host API: lynx::error carries an error code and a message that
// says what was wrong and with which values. Device code asserts instead.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace lynx {

enum class errc : int {
  ok = 0,
  invalid_argument,     // a parameter out of range (bits, group size, precision level)
  shape_mismatch,       // tensor shapes disagree with each other or with a plan
  non_finite_input,     // NaN or infinity in a KV tensor
  plan_mismatch,        // a segment of another stream plan or group size
  layer_mismatch,       // a segment of another layer
  truncated_segment,    // fewer bytes than the header announces
  corrupted_segment,    // checksum or header fields inconsistent
  bad_magic,            // not a Lynx segment at all
  unsupported_version,  // a wire format this build does not read
  stale_generation,     // a segment of an earlier request
  out_of_memory,
  transport_failure,  // a transport reported an error
  timeout,            // a deadline expired
  peer_failure,       // the remote side died or closed
  cuda_error,
  internal,
};

constexpr std::string_view to_string(errc code) noexcept {
  switch (code) {
    case errc::ok:
      return "ok";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::shape_mismatch:
      return "shape_mismatch";
    case errc::non_finite_input:
      return "non_finite_input";
    case errc::plan_mismatch:
      return "plan_mismatch";
    case errc::layer_mismatch:
      return "layer_mismatch";
    case errc::truncated_segment:
      return "truncated_segment";
    case errc::corrupted_segment:
      return "corrupted_segment";
    case errc::bad_magic:
      return "bad_magic";
    case errc::unsupported_version:
      return "unsupported_version";
    case errc::stale_generation:
      return "stale_generation";
    case errc::out_of_memory:
      return "out_of_memory";
    case errc::transport_failure:
      return "transport_failure";
    case errc::timeout:
      return "timeout";
    case errc::peer_failure:
      return "peer_failure";
    case errc::cuda_error:
      return "cuda_error";
    case errc::internal:
      return "internal";
  }
  return "unknown";
}

/// The exception every host API of Lynx throws. `code()` is stable and meant
/// for programs; `what()` is for people ("lynx: shape_mismatch: ...").
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message)
      : std::runtime_error("lynx: " + std::string(to_string(code)) + ": " + message), code_(code) {}
  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  errc code_;
};

namespace detail {
[[noreturn]] inline void fail(errc code, const std::string& message) { throw error(code, message); }
inline void require(bool condition, errc code, const std::string& message) {
  if (!condition) throw error(code, message);
}
}  // namespace detail

}  // namespace lynx
