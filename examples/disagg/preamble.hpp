// The request preamble: the one message of a disaggregated request that is not
// a Lynx segment. The prefill node posts it on the anchor lane as soon as its
// own token is chosen (before any segment); the decode node needs that token
// to start its session. 64 bytes, little-endian, its own magic so a receive
// loop tells it from a segment by the first four bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

namespace lynx_examples::disagg {

inline constexpr std::uint32_t preamble_magic = 0x51524c58u;  // "XLRQ" in memory order

struct request_preamble {
  std::uint32_t magic = preamble_magic;
  std::uint32_t version = 1;
  std::uint64_t generation = 0;  // the request's generation (as in every segment header)
  std::int32_t prompt_tokens = 0;
  std::int32_t first_token = 0;  // the prefill node's token from the prompt's last logits (exact)
  std::int32_t layers = 0;
  std::int32_t streams = 0;    // streams of the plan the segments use
  double prefill_seconds = 0;  // request arrival -> preamble posted at the prefill node: the decode
                               // side's timeline starts that long before arrival
  std::uint64_t reserved[3] = {};
};
static_assert(sizeof(request_preamble) == 64, "the preamble is 64 bytes on the wire");

inline std::vector<std::byte> to_bytes(const request_preamble& p) {
  std::vector<std::byte> b(sizeof p);
  std::memcpy(b.data(), &p, sizeof p);
  return b;
}

/// The preamble in `bytes`, or nullopt when they are not one (wrong magic or size).
inline std::optional<request_preamble> parse_preamble(std::span<const std::byte> bytes) {
  if (bytes.size() != sizeof(request_preamble)) return std::nullopt;
  request_preamble p;
  std::memcpy(&p, bytes.data(), sizeof p);
  if (p.magic != preamble_magic || p.version != 1) return std::nullopt;
  return p;
}

/// True when the bytes start with the preamble's magic (whatever their size).
inline bool looks_like_preamble(std::span<const std::byte> bytes) {
  std::uint32_t m = 0;
  if (bytes.size() < sizeof m) return false;
  std::memcpy(&m, bytes.data(), sizeof m);
  return m == preamble_magic;
}

}  // namespace lynx_examples::disagg
