// The wire format of a segment: the bytes of one stream of one layer (K and V).
// A fixed 128-byte little-endian header, then the payload (see layout.hpp).
// The checksum is XXH3-64 of the payload, seeded with XXH3-64 of the header
// (checksum field zeroed), so a flipped bit anywhere, header or payload, is caught.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
// GCC 12's AVX-512 headers warn of "uninitialized" vectors inside the inline
// XXH3 when it is compiled for AVX-512 (-march=native): their idiom, not a bug.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <xxhash.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "lynx/core/error.hpp"
#include "lynx/planes/layout.hpp"

#if defined(LYNX_XXH3_DISPATCH) && LYNX_XXH3_DISPATCH
// libxxhash's XXH3 with run-time SIMD dispatch (AVX2/AVX-512 where the CPU has
// them; the same hash values as the inline XXH3). Declared here rather than
// through <xxh_x86dispatch.h>, whose declarations turn static under XXH_INLINE_ALL.
// CMake's lynx::xxhash links the library and defines LYNX_XXH3_DISPATCH where
// the symbol links (cmake/Findxxhash.cmake).
extern "C" std::uint64_t XXH3_64bits_withSeed_dispatch(const void* input, std::size_t length,
                                                       std::uint64_t seed);
extern "C" XXH_errorcode XXH3_64bits_update_dispatch(XXH3_state_t* state, const void* input,
                                                     std::size_t length);
#endif

namespace lynx {

namespace detail {
/// XXH3-64 of `bytes` with `seed`: the inline XXH3 for short inputs and where
/// no dispatching library is linked, else libxxhash's dispatch (same value).
inline std::uint64_t xxh3_64(const void* bytes, std::size_t length, std::uint64_t seed) {
#if defined(LYNX_XXH3_DISPATCH) && LYNX_XXH3_DISPATCH
  if (length >= 4096) return XXH3_64bits_withSeed_dispatch(bytes, length, seed);
#endif
  return XXH3_64bits_withSeed(bytes, length, seed);
}

/// Streaming XXH3-64 (the same value as xxh3_64 over the concatenated input).
class xxh3_stream {
 public:
  explicit xxh3_stream(std::uint64_t seed) { XXH3_64bits_reset_withSeed(&state_, seed); }
  void update(const std::byte* bytes, std::size_t length) {
#if defined(LYNX_XXH3_DISPATCH) && LYNX_XXH3_DISPATCH
    XXH3_64bits_update_dispatch(&state_, bytes, length);
#else
    XXH3_64bits_update(&state_, bytes, length);
#endif
  }
  [[nodiscard]] std::uint64_t digest() const { return XXH3_64bits_digest(&state_); }

 private:
  XXH3_state_t state_;
};

/// What the checksum pass over an anchor saw of its parameters (bf16 bits,
/// layout.hpp) while they were in cache: `suspect` when some scale is negative
/// or not finite, some zero point not finite, or a group's range
/// zero + scale (2^B - 1) could overflow (bounded from the largest scale and
/// zero point of each pair of sections). Not suspect: every parameter passes
/// the receiver's check (detail::check_params), which runs only for a suspect
/// anchor, to name the group at fault.
struct param_scan {
  bool suspect = false;
};

/// XXH3-64 of an anchor's payload with `seed` (segment_checksum's), scanning
/// the parameter sections chunk by chunk right after hashing them.
inline std::uint64_t checksum_scanning_params(const std::byte* payload, std::size_t length,
                                              std::uint64_t seed, const layer_geometry& g,
                                              param_scan& scan) {
  constexpr std::int64_t chunk = 16384;  // parameters per step: 32 KiB, hashed then read from L1
  constexpr std::int64_t w = layer_geometry::wire_param_bytes;
  xxh3_stream hash(seed);
  std::int64_t at = 0;  // bytes hashed
  const float top = static_cast<float>((std::uint32_t{1} << g.plan.bits) - 1u);
  for (int pair = 0; pair < 2; ++pair) {
    std::uint16_t largest[2] = {0, 0};  // bits of the largest scale, of the largest |zero|
    unsigned bad = 0;
    for (int part = 0; part < 2; ++part) {
      const int section = 2 * pair + part;
      const std::int64_t first = g.param_section_offset(section, w),
                         n = g.param_section_params(section);
      hash.update(payload + at, static_cast<std::size_t>(first - at));  // alignment padding
      at = first;
      const auto* bits = reinterpret_cast<const std::uint16_t*>(payload + first);
      for (std::int64_t i0 = 0; i0 < n; i0 += chunk) {
        const std::int64_t m = std::min(chunk, n - i0);
        hash.update(payload + at, static_cast<std::size_t>(m * w));
        at += m * w;
        // Integer tests (they vectorize): exponent all ones is an infinity or NaN;
        // scales must have the sign bit clear; the maxima of magnitudes as bits
        // are the bits of the largest magnitudes.
        std::uint16_t top_bits = largest[part];
        const std::uint16_t sign = part == 0 ? 0x8000u : 0u;
        const std::uint16_t magnitude = part == 0 ? 0xFFFFu : 0x7FFFu;
        for (std::int64_t i = i0; i < i0 + m; ++i) {
          const std::uint16_t b = bits[i];
          bad |= static_cast<unsigned>((b & 0x7F80u) == 0x7F80u) | (b & sign);
          top_bits = std::max<std::uint16_t>(top_bits, static_cast<std::uint16_t>(b & magnitude));
        }
        largest[part] = top_bits;
      }
    }
    // Every range zero + scale * top is then at most 2^126 in magnitude (exact
    // in double): finite in float, whatever the rounding.
    const double bound = static_cast<double>(bf16_bits_to_float(largest[0])) * top +
                         static_cast<double>(bf16_bits_to_float(largest[1]));
    if (bad != 0u || !(bound <= 0x1p126)) scan.suspect = true;
  }
  hash.update(payload + at, length - static_cast<std::size_t>(at));
  return hash.digest();
}
}  // namespace detail

static_assert(std::endian::native == std::endian::little,
              "Lynx's wire format is little-endian; big-endian hosts are not supported");

inline constexpr std::uint32_t segment_magic = 0x584e594cu;  // "LYNX" in memory order
inline constexpr std::uint16_t segment_version = 2;          // 2: scales and zero points as bf16
inline constexpr std::uint8_t layout_planes_along_tokens = 1;

/// The 128-byte header at the start of every segment (on the wire, as is).
struct segment_header {
  std::uint32_t magic = segment_magic;
  std::uint16_t version = segment_version;
  std::uint16_t header_bytes = 128;
  std::uint32_t layer = 0;
  std::uint8_t stream = 0;   // 0 = anchor
  std::uint8_t streams = 0;  // streams in the plan
  std::uint8_t bits = 0;     // code width B
  std::uint8_t layout = layout_planes_along_tokens;
  std::uint8_t widths[max_streams] = {};  // planes per stream
  std::uint16_t key_group = 0;            // tokens per key group
  std::uint16_t value_group = 0;          // channels per value group
  std::uint16_t kv_heads = 0;
  std::uint16_t head_dim = 0;
  std::uint32_t tokens = 0;
  std::uint32_t reserved0 = 0;
  std::uint64_t generation =
      0;  // request generation: a late segment of an old request is recognised
  std::uint64_t payload_bytes = 0;
  std::uint64_t checksum = 0;  // XXH3-64(payload, seed = XXH3-64(header with checksum = 0))
  std::uint8_t reserved[64] = {};
};
static_assert(sizeof(segment_header) == 128, "segment_header must be 128 bytes");
static_assert(std::is_trivially_copyable_v<segment_header>);

inline constexpr std::size_t segment_header_bytes = sizeof(segment_header);

/// Which layer, stream and request a segment belongs to.
struct segment_id {
  std::uint32_t layer = 0;
  int stream = 0;
  std::uint64_t generation = 0;
};

inline std::string describe(const segment_id& id) {
  return "layer " + std::to_string(id.layer) + " stream " + std::to_string(id.stream) +
         " generation " + std::to_string(id.generation);
}

/// Total bytes of the segment of stream s (header + payload).
inline std::size_t segment_bytes(const layer_geometry& g, int stream) {
  return segment_header_bytes + static_cast<std::size_t>(g.payload_bytes(stream));
}

inline segment_header make_header(const layer_geometry& g, std::uint32_t layer, int stream,
                                  std::uint64_t generation) {
  segment_header h;
  h.layer = layer;
  h.stream = static_cast<std::uint8_t>(stream);
  h.streams = static_cast<std::uint8_t>(g.plan.streams);
  h.bits = static_cast<std::uint8_t>(g.plan.bits);
  for (int i = 0; i < max_streams; ++i) h.widths[i] = g.plan.widths[static_cast<std::size_t>(i)];
  h.key_group = static_cast<std::uint16_t>(g.key_group);
  h.value_group = static_cast<std::uint16_t>(g.value_group);
  h.kv_heads = static_cast<std::uint16_t>(g.kv_heads);
  h.head_dim = static_cast<std::uint16_t>(g.head_dim);
  h.tokens = static_cast<std::uint32_t>(g.tokens);
  h.generation = generation;
  h.payload_bytes = static_cast<std::uint64_t>(g.payload_bytes(stream));
  return h;
}

/// The checksum of a segment whose header (any checksum value) and payload are given.
inline std::uint64_t segment_checksum(const segment_header& header,
                                      std::span<const std::byte> payload) {
  segment_header h = header;
  h.checksum = 0;
  const std::uint64_t seed = XXH3_64bits(&h, sizeof h);
  return detail::xxh3_64(payload.data(), payload.size(), seed);
}

/// Writes the checksum into the header at the front of `segment` (header + payload).
/// Call after the payload is final; until then the segment does not validate.
inline void seal_segment(std::span<std::byte> segment) {
  detail::require(segment.size() >= segment_header_bytes, errc::truncated_segment,
                  "seal_segment: buffer shorter than a header");
  segment_header h;
  std::memcpy(&h, segment.data(), sizeof h);
  h.checksum = segment_checksum(h, segment.subspan(segment_header_bytes));
  std::memcpy(segment.data(), &h, sizeof h);
}

/// Reads the header of a segment, checking only that there is one.
inline segment_header peek_header(std::span<const std::byte> segment) {
  detail::require(segment.size() >= segment_header_bytes, errc::truncated_segment,
                  "segment of " + std::to_string(segment.size()) + " bytes is shorter than its " +
                      std::to_string(segment_header_bytes) + "-byte header");
  segment_header h;
  std::memcpy(&h, segment.data(), sizeof h);
  return h;
}

/// Full validation of a segment against the geometry the receiver expects.
/// Throws lynx::error saying what is wrong and where; returns the header.
/// With `scan`, an anchor's parameters are scanned during the checksum pass
/// (detail::param_scan); other streams leave it unchanged.
inline segment_header validate_segment(std::span<const std::byte> segment,
                                       const layer_geometry& expected, std::uint32_t expected_layer,
                                       detail::param_scan* scan = nullptr) {
  const segment_header h = peek_header(segment);
  if (h.magic != segment_magic)
    detail::fail(errc::bad_magic, "not a Lynx segment (magic mismatch)");
  if (h.version != segment_version || h.header_bytes != segment_header_bytes)
    detail::fail(errc::unsupported_version, "segment format version " + std::to_string(h.version) +
                                                " (this build reads version " +
                                                std::to_string(segment_version) + ")");
  const std::string where =
      "segment of layer " + std::to_string(h.layer) + " stream " + std::to_string(h.stream);
  if (h.layout != layout_planes_along_tokens)
    detail::fail(errc::unsupported_version,
                 where + ": unknown plane layout " + std::to_string(h.layout));
  if (h.layer != expected_layer)
    detail::fail(errc::layer_mismatch,
                 where + " delivered to the tensor of layer " + std::to_string(expected_layer));
  plan_desc plan;
  plan.bits = h.bits;
  plan.streams = h.streams;
  for (int i = 0; i < max_streams; ++i) plan.widths[static_cast<std::size_t>(i)] = h.widths[i];
  if (!(plan == expected.plan))
    detail::fail(errc::plan_mismatch, where + " has stream plan '" + plan.name() +
                                          "', the tensor expects '" + expected.plan.name() + "'");
  if (h.key_group != expected.key_group || h.value_group != expected.value_group)
    detail::fail(errc::plan_mismatch, where + " has group sizes key " +
                                          std::to_string(h.key_group) + " / value " +
                                          std::to_string(h.value_group) + ", the tensor expects " +
                                          std::to_string(expected.key_group) + " / " +
                                          std::to_string(expected.value_group));
  if (h.tokens != expected.tokens || h.kv_heads != expected.kv_heads ||
      h.head_dim != expected.head_dim)
    detail::fail(errc::shape_mismatch, where + " has shape [tokens=" + std::to_string(h.tokens) +
                                           ", kv_heads=" + std::to_string(h.kv_heads) +
                                           ", head_dim=" + std::to_string(h.head_dim) +
                                           "], the tensor expects " + to_string(expected.shape()));
  if (h.stream >= expected.plan.streams)
    detail::fail(errc::corrupted_segment,
                 where + ": stream index out of range for plan '" + expected.plan.name() + "'");
  const auto want = static_cast<std::uint64_t>(expected.payload_bytes(h.stream));
  if (h.payload_bytes != want)
    detail::fail(errc::corrupted_segment, where + " announces " + std::to_string(h.payload_bytes) +
                                              " payload bytes, the geometry needs " +
                                              std::to_string(want));
  if (segment.size() < segment_header_bytes + want)
    detail::fail(errc::truncated_segment,
                 where + " is truncated: " + std::to_string(segment.size() - segment_header_bytes) +
                     " of " + std::to_string(want) + " payload bytes");
  if (segment.size() > segment_header_bytes + want)
    detail::fail(errc::corrupted_segment,
                 where + " has " + std::to_string(segment.size() - segment_header_bytes - want) +
                     " bytes past its payload");
  std::uint64_t sum = 0;
  if (scan != nullptr && h.stream == 0) {
    segment_header zeroed = h;
    zeroed.checksum = 0;
    sum = detail::checksum_scanning_params(segment.data() + segment_header_bytes,
                                           static_cast<std::size_t>(want),
                                           XXH3_64bits(&zeroed, sizeof zeroed), expected, *scan);
  } else {
    sum =
        segment_checksum(h, segment.subspan(segment_header_bytes, static_cast<std::size_t>(want)));
  }
  if (sum != h.checksum)
    detail::fail(errc::corrupted_segment,
                 where + ": checksum mismatch (payload or header corrupted in transit)");
  return h;
}

}  // namespace lynx
