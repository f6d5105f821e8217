// Host kernels of the codecs: quantize a 32-token block of one head into a code
// tile, pack/unpack code tiles to/from plane words, reconstruct at a precision
// level. The math comes from quant/ and planes/; this file only walks the data,
// with the innermost loop over channels so the compiler vectorizes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/bitplane.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/quant/quantizer.hpp"

namespace lynx::detail {

/// Zeroes the alignment padding after every section of every stream's payload
/// (everything else is written by the encoder), so segments are deterministic bytes.
inline void zero_section_gaps(const layer_geometry& g, std::span<const std::span<std::byte>> out) {
  for (int s = 0; s < g.plan.streams; ++s) {
    std::byte* payload = out[static_cast<std::size_t>(s)].data() + segment_header_bytes;
    auto gap = [&](std::int64_t data_end, std::int64_t next_section) {
      std::memset(payload + data_end, 0, static_cast<std::size_t>(next_section - data_end));
    };
    if (s == 0)
      for (int section = 0; section < 4; ++section)
        gap(g.param_section_offset(section, layer_geometry::wire_param_bytes) +
                g.param_section_params(section) * layer_geometry::wire_param_bytes,
            g.param_section_offset(section + 1, layer_geometry::wire_param_bytes));
    gap(g.key_planes_offset(s) + g.plane_words(s) * 4, g.value_planes_offset(s));
    gap(g.value_planes_offset(s) + g.plane_words(s) * 4, g.payload_bytes(s));
  }
}

/// Writes the four parameter sections of an anchor payload (bf16, exact: the
/// encoder's parameters are bf16 values) from the expanded float block.
inline void write_wire_params(const layer_geometry& g, const float* expanded, std::byte* payload) {
  for (int section = 0; section < 4; ++section) {
    const float* src = expanded + g.param_section_offset(section, 4) / 4;
    auto* dst = reinterpret_cast<std::uint16_t*>(
        payload + g.param_section_offset(section, layer_geometry::wire_param_bytes));
    const std::int64_t n = g.param_section_params(section);
    for (std::int64_t i = 0; i < n; ++i)
      dst[i] = static_cast<std::uint16_t>(float_bits(src[i]) >> 16);
  }
}

/// Reports the first non-finite element of a group with its coordinates.
template <class T>
[[noreturn]] void report_non_finite(const kv_view<const T, host_space>& x, const char* tensor,
                                    std::uint32_t layer, std::int64_t t0, std::int64_t t1,
                                    std::int64_t h, std::int64_t c0, std::int64_t c1) {
  for (std::int64_t t = t0; t < t1; ++t)
    for (std::int64_t c = c0; c < c1; ++c) {
      const float v = to_float(x(t, h, c));
      if (!is_finite_value(v))
        fail(errc::non_finite_input, std::string(tensor) + " of layer " + std::to_string(layer) +
                                         " holds " + (v != v ? "NaN" : "infinity") +
                                         " at kv head " + std::to_string(h) + ", token " +
                                         std::to_string(t) + ", channel " + std::to_string(c));
    }
  fail(errc::invalid_argument, std::string(tensor) + " of layer " + std::to_string(layer) +
                                   ": range of a group at kv head " + std::to_string(h) +
                                   ", tokens [" + std::to_string(t0) + ", " + std::to_string(t1) +
                                   ") exceeds the float range");
}

/// Key parameters of one head: per channel over each group of key_group tokens.
/// scale/zero: [key_token_groups][head_dim] of this head.
template <int Bits, class T>
void key_params_for_head(const kv_view<const T, host_space>& keys, const layer_geometry& g,
                         std::uint32_t layer, std::int64_t h, float* LYNX_RESTRICT scale,
                         float* LYNX_RESTRICT zero, std::vector<float>& lo,
                         std::vector<float>& hi) {
  const std::int64_t D = g.head_dim;
  lo.resize(static_cast<std::size_t>(D));
  hi.resize(static_cast<std::size_t>(D));
  for (std::int64_t grp = 0; grp < g.key_token_groups(); ++grp) {
    const std::int64_t t0 = grp * g.key_group,
                       t1 = std::min<std::int64_t>(t0 + g.key_group, g.tokens);
    float* LYNX_RESTRICT l = lo.data();
    float* LYNX_RESTRICT u = hi.data();
    bool finite = true;
    if (keys.channel_stride == 1) {
      const T* row = &keys(t0, h, 0);
      for (std::int64_t c = 0; c < D; ++c) l[c] = u[c] = to_float(row[c]);
      for (std::int64_t t = t0; t < t1; ++t) {
        row = &keys(t, h, 0);
        bool row_ok = true;
        for (std::int64_t c = 0; c < D; ++c) {
          const float v = to_float(row[c]);
          row_ok &= is_finite_value(v);
          l[c] = v < l[c] ? v : l[c];
          u[c] = v > u[c] ? v : u[c];
        }
        finite &= row_ok;
      }
    } else {
      for (std::int64_t c = 0; c < D; ++c) l[c] = u[c] = to_float(keys(t0, h, c));
      for (std::int64_t t = t0; t < t1; ++t)
        for (std::int64_t c = 0; c < D; ++c) {
          const float v = to_float(keys(t, h, c));
          finite &= is_finite_value(v);
          l[c] = std::min(l[c], v);
          u[c] = std::max(u[c], v);
        }
    }
    bool overflow = false;
    for (std::int64_t c = 0; c < D; ++c) overflow |= range_overflow(l[c], u[c]);
    if (!finite || overflow) report_non_finite(keys, "keys", layer, t0, t1, h, 0, D);
    for (std::int64_t c = 0; c < D; ++c) {
      const group_params p = make_group_params<Bits>(l[c], u[c]);
      scale[grp * D + c] = p.scale;
      zero[grp * D + c] = p.zero;
    }
  }
}

/// Codes of the keys of one 32-token block of head h: codes[t][c], t < n.
template <int Bits, class T>
void quantize_key_block(const kv_view<const T, host_space>& keys, const layer_geometry& g,
                        std::int64_t h, std::int64_t t0, std::int64_t n,
                        const float* key_scale_head, const float* key_zero_head,
                        std::uint16_t* LYNX_RESTRICT codes, float* LYNX_RESTRICT inv) {
  const std::int64_t D = g.head_dim;
  std::int64_t current_group = -1;
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t grp = (t0 + t) / g.key_group;
    const float* LYNX_RESTRICT zero = key_zero_head + grp * D;
    if (grp != current_group) {
      const float* LYNX_RESTRICT scale = key_scale_head + grp * D;
      for (std::int64_t c = 0; c < D; ++c) inv[c] = scale[c] > 0.0f ? 1.0f / scale[c] : 0.0f;
      current_group = grp;
    }
    std::uint16_t* LYNX_RESTRICT out = codes + t * D;
    if (keys.channel_stride == 1) {
      const T* LYNX_RESTRICT row = &keys(t0 + t, h, 0);
      for (std::int64_t c = 0; c < D; ++c)
        out[c] =
            static_cast<std::uint16_t>(quantize_value<Bits>(to_float(row[c]), zero[c], inv[c]));
    } else {
      for (std::int64_t c = 0; c < D; ++c)
        out[c] = static_cast<std::uint16_t>(
            quantize_value<Bits>(to_float(keys(t0 + t, h, c)), zero[c], inv[c]));
    }
  }
}

/// Value parameters and codes of one 32-token block of head h: per token over
/// groups of value_group channels. scale/zero: [tokens][value_channel_groups] of this head.
template <int Bits, class T>
void quantize_value_block(const kv_view<const T, host_space>& values, const layer_geometry& g,
                          std::uint32_t layer, std::int64_t h, std::int64_t t0, std::int64_t n,
                          float* value_scale_head, float* value_zero_head,
                          std::uint16_t* LYNX_RESTRICT codes, float* LYNX_RESTRICT row_buffer) {
  const std::int64_t D = g.head_dim, VG = g.value_group, groups = g.value_channel_groups();
  for (std::int64_t t = 0; t < n; ++t) {
    float* LYNX_RESTRICT x = row_buffer;
    if (values.channel_stride == 1) {
      const T* LYNX_RESTRICT row = &values(t0 + t, h, 0);
      for (std::int64_t c = 0; c < D; ++c) x[c] = to_float(row[c]);
    } else {
      for (std::int64_t c = 0; c < D; ++c) x[c] = to_float(values(t0 + t, h, c));
    }
    std::uint16_t* LYNX_RESTRICT out = codes + t * D;
    for (std::int64_t grp = 0; grp < groups; ++grp) {
      const float* LYNX_RESTRICT xs = x + grp * VG;
      float lo = xs[0], hi = xs[0];
      bool finite = true;
      for (std::int64_t c = 0; c < VG; ++c) {
        finite &= is_finite_value(xs[c]);
        lo = xs[c] < lo ? xs[c] : lo;
        hi = xs[c] > hi ? xs[c] : hi;
      }
      if (!finite || range_overflow(lo, hi))
        report_non_finite(values, "values", layer, t0 + t, t0 + t + 1, h, grp * VG, grp * VG + VG);
      const group_params p = make_group_params<Bits>(lo, hi);
      value_scale_head[(t0 + t) * groups + grp] = p.scale;
      value_zero_head[(t0 + t) * groups + grp] = p.zero;
      const float inv = inverse_scale<Bits>(p);
      for (std::int64_t c = 0; c < VG; ++c)
        out[grp * VG + c] = static_cast<std::uint16_t>(quantize_value<Bits>(xs[c], p.zero, inv));
    }
  }
}

/// Packs a code tile codes[t][c] (t < n <= 32, Bits-bit codes) into plane words:
/// planes[j][c] for j < Bits, bit t of planes[j][c] = bit (Bits-1-j) of codes[t][c].
template <int Bits>
void pack_block(const std::uint16_t* LYNX_RESTRICT codes, std::int64_t n, std::int64_t D,
                std::uint32_t* LYNX_RESTRICT planes) {
  std::fill(planes, planes + Bits * D, 0u);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::uint16_t* LYNX_RESTRICT row = codes + t * D;
    for (int j = 0; j < Bits; ++j) {
      std::uint32_t* LYNX_RESTRICT w = planes + j * D;
      const int shift = Bits - 1 - j;
      for (std::int64_t c = 0; c < D; ++c)
        w[c] |= ((static_cast<std::uint32_t>(row[c]) >> shift) & 1u) << t;
    }
  }
}

/// Inverse of pack_block over the first `planes` planes: prefix codes[t][c] (t < n),
/// where plane j's words for this block are at plane_rows[j][0..D).
inline void unpack_block(const std::uint32_t* const* plane_rows, int planes, std::int64_t n,
                         std::int64_t D, std::uint32_t* LYNX_RESTRICT codes) {
  for (std::int64_t t = 0; t < n; ++t) {
    std::uint32_t* LYNX_RESTRICT out = codes + t * D;
    for (std::int64_t c = 0; c < D; ++c) out[c] = 0;
    for (int j = 0; j < planes; ++j) {
      const std::uint32_t* LYNX_RESTRICT w = plane_rows[j];
      for (std::int64_t c = 0; c < D; ++c) out[c] = (out[c] << 1) | ((w[c] >> t) & 1u);
    }
  }
}

}  // namespace lynx::detail
