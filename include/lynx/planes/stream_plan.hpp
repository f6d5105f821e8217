// Stream plans: a compile-time partition of the B planes of a code into ordered
// streams. stream_plan<8, 4, 4> reads "8 = 4 + 4": stream 0 (the anchor) carries
// planes 0-3 (the most significant) and every scale and zero point; stream 1
// (the residual) carries planes 4-7. A plan that does not add up does not compile.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <string>

#include "lynx/core/config.hpp"

namespace lynx {

inline constexpr int max_streams = 8;

template <int Bits, int... Widths>
struct stream_plan {
  static_assert(Bits == 8 || Bits == 12 || Bits == 16,
                "stream_plan: code width must be 8, 12 or 16 bits");
  static_assert(sizeof...(Widths) >= 1 && sizeof...(Widths) <= max_streams,
                "stream_plan: 1 to 8 streams");
  static_assert(((Widths > 0) && ...), "stream_plan: every stream carries at least one plane");
  static_assert((Widths + ... + 0) == Bits,
                "stream_plan: the stream widths must add up to the code width");

  using plan_tag = void;  // opt-in tag checked by the concept below
  static constexpr int bits = Bits;
  static constexpr int streams = static_cast<int>(sizeof...(Widths));
  static constexpr std::array<int, sizeof...(Widths)> widths{Widths...};

  /// First plane of stream s (planes are numbered from the MSB, plane 0).
  static constexpr int plane_begin(int s) {
    int b = 0;
    for (int i = 0; i < s; ++i) b += widths[static_cast<std::size_t>(i)];
    return b;
  }
  /// Planes present at precision level `level` (1 = anchor only, streams = all).
  static constexpr int planes_at_level(int level) { return plane_begin(level); }

  static std::string name() {
    std::string n = std::to_string(Bits) + " =";
    for (int i = 0; i < streams; ++i)
      n += (i ? " + " : " ") + std::to_string(widths[static_cast<std::size_t>(i)]);
    return n;
  }
};

/// A type is a stream plan when it opts in with `plan_tag` and names its widths.
template <class P>
concept stream_plan_type = requires {
  typename P::plan_tag;
  { P::bits } -> std::convertible_to<int>;
  { P::streams } -> std::convertible_to<int>;
};

/// The plans of the paper and beyond.
using plan_8_4_4 = stream_plan<8, 4, 4>;         // the paper's
using plan_8_2_2_4 = stream_plan<8, 2, 2, 4>;    // progressive 8-bit
using plan_8_8 = stream_plan<8, 8>;              // blocking 8-bit (one stream)
using plan_16_4_12 = stream_plan<16, 4, 12>;     // exact-to-bf16 mode
using plan_16_4_4_8 = stream_plan<16, 4, 4, 8>;  // progressive exact-to-bf16
using plan_12_4_8 = stream_plan<12, 4, 8>;

/// Runtime description of a plan, as it travels in the segment header.
struct plan_desc {
  int bits = 0;
  int streams = 0;
  std::array<std::uint8_t, max_streams> widths{};

  template <stream_plan_type P>
  static constexpr plan_desc of() {
    plan_desc d;
    d.bits = P::bits;
    d.streams = P::streams;
    for (int i = 0; i < P::streams; ++i)
      d.widths[static_cast<std::size_t>(i)] =
          static_cast<std::uint8_t>(P::widths[static_cast<std::size_t>(i)]);
    return d;
  }
  LYNX_HOST_DEVICE constexpr int plane_begin(int s) const {
    int b = 0;
    for (int i = 0; i < s; ++i) b += widths[static_cast<std::size_t>(i)];
    return b;
  }
  LYNX_HOST_DEVICE constexpr int width(int s) const { return widths[static_cast<std::size_t>(s)]; }
  friend constexpr bool operator==(const plan_desc&, const plan_desc&) = default;

  std::string name() const {
    // A descriptor read from a corrupted header may claim more than max_streams
    // streams: name only the widths there are, never read past the array.
    std::string n = std::to_string(bits) + " =";
    for (int i = 0; i < streams && i < max_streams; ++i)
      n += (i ? " + " : " ") + std::to_string(widths[static_cast<std::size_t>(i)]);
    if (streams > max_streams)
      n += " (+ " + std::to_string(streams - max_streams) + " more streams)";
    return n;
  }
};

}  // namespace lynx
