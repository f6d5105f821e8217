// The codecs of a layer on the GPU: encode (quantize + split K and V into the
// segments of a plan, payload bytes identical to the host encoder's) and
// reconstruct (dequantize at a view's precision level into an engine's layout).
//
// The math is quant/quantizer.hpp and planes/bitplane.hpp, the same functions
// the host calls; these kernels only walk the data:
//   key_params_kernel    block per (head, key token group, 32-channel tile):
//                        per channel min/max over the group's tokens, rows of
//                        the block scanned serially, then cub::WarpReduce over rows
//   value_params_kernel  warp per (head, token, value channel group):
//                        cub::WarpReduce over the group's channels
//   pack_kernel          block per (head, 32-token block, 32-channel tile):
//                        quantize_value per element, then a warp per channel,
//                        lane t = token t: __ballot_sync(plane_bit(code, B, j))
//                        is exactly plane word j (padding tokens contribute 0)
//   reconstruct_kernel   thread per (token, channel): the prefix code from the
//                        plane words, reconstruct_from_level (fma as on the host)
// Bitwise equality with the host needs IEEE float semantics in device code:
// build without --use_fast_math, -ftz=true or -prec-div=false (nvcc defaults).
//
// Min/max ties: the host scans `v < lo ? v : lo` in token (keys) or channel
// (values) order, which keeps the FIRST of equal values (+0 and -0 compare
// equal, and the zero point's sign bit travels in the anchor). The reduction
// therefore carries the position of its value and breaks ties towards the
// lower position: any reduction order then returns the host's value, bit for bit.
//
// Segments written on the device carry a header whose checksum field is 0:
// XXH3 is computed on the host, when a segment is staged to host memory for
// sending (stage_to_host / seal_on_host). Only sealed segments validate.
#pragma once

#include <cuda_runtime_api.h>

#include <cub/warp/warp_reduce.cuh>

#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "lynx/backend/cuda/error.cuh"
#include "lynx/backend/cuda/tensor.cuh"
#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/bitplane.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/quant/quantizer.hpp"

namespace lynx::cuda {

/// What an encode found wrong with its input, in device memory (the workspace).
/// Each field is the smallest linear index of an offending element or group,
/// `no_problem` when there is none; the host entry point turns it into the same
/// lynx::error the host encoder throws.
struct encode_status {
  unsigned long long key_non_finite;      // (head * tokens + token) * head_dim + channel
  unsigned long long key_overflow_group;  // head * key_token_groups + group: range overflows float
  unsigned long long value_non_finite;    // (head * tokens + token) * head_dim + channel
  unsigned long long
      value_overflow_group;  // (head * tokens + token) * value_channel_groups + group
};
inline constexpr unsigned long long no_problem = ~0ull;

/// Bytes of device workspace an encode of a layer of geometry g needs (CUB
/// style: also what encode_async reports when called with a null workspace):
/// the status, then the expanded float parameters the codes are computed with
/// (written to the anchor as bf16 at the end).
inline constexpr std::size_t encode_status_bytes = 256;  // sizeof(encode_status), 256-aligned
static_assert(sizeof(encode_status) <= encode_status_bytes);
inline std::size_t encode_workspace_bytes(const layer_geometry& g) {
  return encode_status_bytes + static_cast<std::size_t>(g.params_bytes());
}

namespace detail {

inline constexpr int tile_channels = 32;  // channels of one block tile (lanes of a warp)
inline constexpr int tile_rows = 8;       // warps of a block: blocks are 32 x 8 = 256 threads
inline constexpr int max_planes = 16;

// ---------------------------------------------------------------------------
// Host-side geometry: pure arithmetic, testable without a device.
// ---------------------------------------------------------------------------

/// One section of a payload: [offset, offset + used) holds data, [offset + used,
/// offset + padded) is alignment padding that must be zero. Offsets in payload bytes.
struct payload_section {
  std::int64_t offset = 0;
  std::int64_t used = 0;
  std::int64_t padded = 0;
};

/// The sections of stream s's payload in order: 4 parameter sections (anchor
/// only), then key planes and value planes. Returns how many were written.
inline int payload_sections(const layer_geometry& g, int stream, payload_section* out) {
  int n = 0;
  const auto add = [&](std::int64_t offset, std::int64_t used) {
    out[n++] = {offset, used, align_up(used, section_alignment)};
  };
  if (stream == 0)
    for (int section = 0; section < 4; ++section)
      add(g.param_section_offset(section, layer_geometry::wire_param_bytes),
          g.param_section_params(section) * layer_geometry::wire_param_bytes);
  add(g.key_planes_offset(stream), g.plane_words(stream) * 4);
  add(g.value_planes_offset(stream), g.plane_words(stream) * 4);
  return n;
}
inline constexpr int max_sections = 6;

/// Where plane j (0 = MSB, across all streams) of (head, block, channel) lives:
///   base[j] + (head * blocks + block) * head_block_stride[j] + channel   (uint32 words)
template <class Word>
struct plane_rows {
  Word* base[max_planes];
  std::int64_t head_block_stride[max_planes];
};

/// Plane rows of the K (keys = true) or V plane sections of the given payloads,
/// for the first `planes` planes of the plan.
template <class Word, class Byte>
plane_rows<Word> make_plane_rows(const layer_geometry& g, Byte* const* payload, bool keys,
                                 int planes) {
  plane_rows<Word> r{};
  int j = 0;
  for (int s = 0; s < g.plan.streams && j < planes; ++s) {
    Byte* section = payload[s] + (keys ? g.key_planes_offset(s) : g.value_planes_offset(s));
    for (int jl = 0; jl < g.planes_in(s) && j < planes; ++jl, ++j) {
      r.base[j] = reinterpret_cast<Word*>(section) + static_cast<std::int64_t>(jl) * g.head_dim;
      r.head_block_stride[j] = static_cast<std::int64_t>(g.planes_in(s)) * g.head_dim;
    }
  }
  return r;
}

/// Headers and padding of the segments of one encode (a kernel parameter, < 2 KiB).
struct segment_frames {
  std::byte* segment[max_streams];
  std::uint32_t header_words[max_streams][segment_header_bytes / 4];  // header, checksum 0
  std::int64_t gap_offset[max_streams][max_sections];  // bytes from the segment start
  std::int32_t gap_bytes[max_streams][max_sections];   // < 64
  int streams;
};

inline segment_frames make_segment_frames(const layer_geometry& g, std::uint32_t layer,
                                          std::uint64_t generation,
                                          std::span<const device_bytes> out) {
  segment_frames f{};
  f.streams = g.plan.streams;
  for (int s = 0; s < g.plan.streams; ++s) {
    f.segment[s] = out[static_cast<std::size_t>(s)].data;
    const segment_header h = make_header(g, layer, s, generation);
    std::memcpy(f.header_words[s], &h, sizeof h);
    payload_section sections[max_sections];
    const int n = payload_sections(g, s, sections);
    for (int i = 0; i < n; ++i) {
      f.gap_offset[s][i] =
          static_cast<std::int64_t>(segment_header_bytes) + sections[i].offset + sections[i].used;
      f.gap_bytes[s][i] = static_cast<std::int32_t>(sections[i].padded - sections[i].used);
    }
  }
  return f;
}

/// Launch geometry of the kernels (grid sizes; every block is 32 x 8 threads).
struct encode_launch {
  dim3 key_params;    // x: key token groups, y: channel tiles, z: kv heads
  dim3 value_params;  // x: blocks of 8 warps, one warp per (head, token, value group)
  dim3 pack;          // x: 32-token blocks, y: channel tiles, z: kv heads
  std::int64_t value_group_count = 0;  // kv_heads * tokens * value_channel_groups
};

inline encode_launch make_encode_launch(const layer_geometry& g) {
  const std::int64_t tiles = ceil_div(g.head_dim, tile_channels);
  const std::int64_t value_groups = g.kv_heads * g.tokens * g.value_channel_groups();
  const std::int64_t value_blocks = ceil_div(value_groups, tile_rows);
  lynx::detail::require(
      g.key_token_groups() <= INT_MAX && value_blocks <= INT_MAX && g.blocks() <= INT_MAX,
      errc::shape_mismatch,
      "layer " + to_string(g.shape()) + " needs more CUDA blocks than a grid dimension holds");
  encode_launch l;
  l.key_params = dim3(static_cast<unsigned>(g.key_token_groups()), static_cast<unsigned>(tiles),
                      static_cast<unsigned>(g.kv_heads));
  l.value_params = dim3(static_cast<unsigned>(value_blocks), 1, 1);
  l.pack = dim3(static_cast<unsigned>(g.blocks()), static_cast<unsigned>(tiles),
                static_cast<unsigned>(g.kv_heads));
  l.value_group_count = value_groups;
  return l;
}

inline dim3 block_shape() { return dim3(tile_channels, tile_rows, 1); }

// ---------------------------------------------------------------------------
// Device code
// ---------------------------------------------------------------------------

/// Min and max of a group so far, each with the position (token or channel) it came from.
struct minmax_item {
  float lo;
  float hi;
  int lo_at;
  int hi_at;
};

__device__ __forceinline__ minmax_item minmax_identity() {
  const float inf = __uint_as_float(0x7f800000u);
  return {inf, -inf, INT_MAX, INT_MAX};
}
__device__ __forceinline__ minmax_item minmax_of(float v, int at) { return {v, v, at, at}; }

/// Associative, commutative combination keeping the first (lowest position)
/// of equal minima and of equal maxima: the host scan's result in any order.
struct minmax_combine {
  __device__ __forceinline__ minmax_item operator()(const minmax_item& a,
                                                    const minmax_item& b) const {
    minmax_item r;
    const bool take_b_lo = b.lo < a.lo || (!(a.lo < b.lo) && b.lo_at < a.lo_at);
    r.lo = take_b_lo ? b.lo : a.lo;
    r.lo_at = take_b_lo ? b.lo_at : a.lo_at;
    const bool take_b_hi = b.hi > a.hi || (!(a.hi > b.hi) && b.hi_at < a.hi_at);
    r.hi = take_b_hi ? b.hi : a.hi;
    r.hi_at = take_b_hi ? b.hi_at : a.hi_at;
    return r;
  }
};

/// Writes the segment headers (checksum 0) and zeroes the alignment padding
/// between payload sections. Grid: one block per stream.
__global__ void frame_kernel(segment_frames f) {
  const int s = static_cast<int>(blockIdx.x);
  std::byte* seg = f.segment[s];
  auto* header = reinterpret_cast<std::uint32_t*>(seg);
  for (int i = static_cast<int>(threadIdx.x); i < static_cast<int>(segment_header_bytes / 4);
       i += static_cast<int>(blockDim.x))
    header[i] = f.header_words[s][i];
  for (int i = static_cast<int>(threadIdx.x);
       i < max_sections * static_cast<int>(section_alignment); i += static_cast<int>(blockDim.x)) {
    const int section = i / static_cast<int>(section_alignment),
              byte = i % static_cast<int>(section_alignment);
    if (byte < f.gap_bytes[s][section]) seg[f.gap_offset[s][section] + byte] = std::byte{0};
  }
}

/// Key parameters: block (32 channels x 8 rows) per (group, channel tile, head).
/// Row y scans tokens t0+y, t0+y+8, ... of its channel; the 8 row results of a
/// channel are combined by a logical warp of 8 lanes (cub::WarpReduce).
/// key_scale/key_zero: [kv_heads][key_token_groups][head_dim].
template <int Bits, class T>
__global__ void __launch_bounds__(tile_channels* tile_rows)
    key_params_kernel(kv_view<const T, device_space> keys, layer_geometry g, float* key_scale,
                      float* key_zero, encode_status* status) {
  using row_reduce = cub::WarpReduce<minmax_item, tile_rows>;
  __shared__ minmax_item rows[tile_rows][tile_channels];
  __shared__ typename row_reduce::TempStorage temp[tile_channels];

  const std::int64_t group = blockIdx.x, h = blockIdx.z;
  const std::int64_t D = g.head_dim, T_ = g.tokens;
  const std::int64_t t0 = group * g.key_group;
  const std::int64_t t1 = t0 + g.key_group < T_ ? t0 + g.key_group : T_;
  const int x = static_cast<int>(threadIdx.x), y = static_cast<int>(threadIdx.y);
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * tile_channels + x;

  minmax_item acc = minmax_identity();
  if (c < D) {
    for (std::int64_t t = t0 + y; t < t1; t += tile_rows) {
      const float v = to_float(keys(t, h, c));
      if (!is_finite_value(v))
        atomicMin(&status->key_non_finite, static_cast<unsigned long long>((h * T_ + t) * D + c));
      acc = minmax_combine{}(acc, minmax_of(v, static_cast<int>(t - t0)));
    }
  }
  rows[y][x] = acc;
  __syncthreads();

  // Warp y combines the rows of channels 4y .. 4y+3: lane = 8 * (channel - 4y) + row.
  const int lane = y * tile_channels + x;
  const int channel_local = lane / tile_rows, row = lane % tile_rows;
  const minmax_item r =
      row_reduce(temp[channel_local]).Reduce(rows[row][channel_local], minmax_combine{});
  const std::int64_t cc = static_cast<std::int64_t>(blockIdx.y) * tile_channels + channel_local;
  if (row == 0 && cc < D) {
    if (range_overflow(r.lo, r.hi))
      atomicMin(&status->key_overflow_group,
                static_cast<unsigned long long>(h * g.key_token_groups() + group));
    const group_params p = make_group_params<Bits>(r.lo, r.hi);
    const std::int64_t i = (h * g.key_token_groups() + group) * D + cc;
    key_scale[i] = p.scale;
    key_zero[i] = p.zero;
  }
}

/// Value parameters: one warp per (head, token, value group); lanes stride over
/// the group's channels, then cub::WarpReduce over the 32 lanes.
/// value_scale/value_zero: [kv_heads][tokens][value_channel_groups].
template <int Bits, class T>
__global__ void __launch_bounds__(tile_channels* tile_rows)
    value_params_kernel(kv_view<const T, device_space> values, layer_geometry g, float* value_scale,
                        float* value_zero, encode_status* status, std::int64_t group_count) {
  using lane_reduce = cub::WarpReduce<minmax_item>;
  __shared__ typename lane_reduce::TempStorage temp[tile_rows];

  const int lane = static_cast<int>(threadIdx.x), warp = static_cast<int>(threadIdx.y);
  const std::int64_t index =
      static_cast<std::int64_t>(blockIdx.x) * tile_rows + warp;  // (h * tokens + t) * groups + grp
  if (index >= group_count) return;  // uniform across the warp; no block-wide barrier below
  const std::int64_t groups = g.value_channel_groups(), VG = g.value_group, D = g.head_dim,
                     T_ = g.tokens;
  const std::int64_t grp = index % groups, t = (index / groups) % T_, h = index / groups / T_;

  minmax_item acc = minmax_identity();
  for (std::int64_t k = lane; k < VG; k += tile_channels) {
    const std::int64_t c = grp * VG + k;
    const float v = to_float(values(t, h, c));
    if (!is_finite_value(v))
      atomicMin(&status->value_non_finite, static_cast<unsigned long long>((h * T_ + t) * D + c));
    acc = minmax_combine{}(acc, minmax_of(v, static_cast<int>(k)));
  }
  const minmax_item r = lane_reduce(temp[warp]).Reduce(acc, minmax_combine{});
  if (lane == 0) {
    if (range_overflow(r.lo, r.hi))
      atomicMin(&status->value_overflow_group, static_cast<unsigned long long>(index));
    const group_params p = make_group_params<Bits>(r.lo, r.hi);
    value_scale[index] = p.scale;
    value_zero[index] = p.zero;
  }
}

/// Quantize and pack one (32-token block, 32-channel tile, head) of K or V.
/// Phase 1: thread (x, y) quantizes tokens y, y+8, y+16, y+24 of channel x
///          (loads coalesced along channels) into a code tile in shared memory.
/// Phase 2: warp y takes channels y, y+8, y+16, y+24; lane t holds token t's
///          code; __ballot_sync of plane_bit j is plane word j of that channel.
/// Phase 3: the block writes the plane words, channel-contiguous (coalesced).
template <int Bits, bool Keys, class T>
__global__ void __launch_bounds__(tile_channels* tile_rows)
    pack_kernel(kv_view<const T, device_space> x, layer_geometry g, const float* scale,
                const float* zero, plane_rows<std::uint32_t> out) {
  __shared__ std::uint32_t codes[tokens_per_word][tile_channels + 1];  // [token][channel]; +1 keeps
                                                                       // columns conflict-free
  __shared__ std::uint32_t planes[Bits][tile_channels];                // [plane][channel]

  const std::int64_t b = blockIdx.x, h = blockIdx.z;
  const std::int64_t D = g.head_dim, T_ = g.tokens;
  const std::int64_t t0 = b * tokens_per_word;
  const int n = static_cast<int>(T_ - t0 < tokens_per_word ? T_ - t0 : tokens_per_word);
  const int lx = static_cast<int>(threadIdx.x), ly = static_cast<int>(threadIdx.y);
  const std::int64_t tile0 = static_cast<std::int64_t>(blockIdx.y) * tile_channels;
  const std::int64_t c = tile0 + lx;

  for (int r = ly; r < tokens_per_word; r += tile_rows) {
    std::uint32_t code = 0;  // padding tokens and channels past head_dim stay 0
    if (r < n && c < D) {
      const std::int64_t t = t0 + r;
      const std::int64_t i = Keys ? (h * g.key_token_groups() + t / g.key_group) * D + c
                                  : (h * T_ + t) * g.value_channel_groups() + c / g.value_group;
      const group_params p{scale[i], zero[i]};
      code = quantize_value<Bits>(to_float(x(t, h, c)), p.zero, inverse_scale<Bits>(p));
    }
    codes[r][lx] = code;
  }
  __syncthreads();

  for (int cl = ly; cl < tile_channels; cl += tile_rows) {
    const std::uint32_t code = codes[lx][cl];  // lane = token
#pragma unroll
    for (int j = 0; j < Bits; ++j) {
      const std::uint32_t word =
          __ballot_sync(0xffffffffu, plane_bit(code, Bits, j) != 0u);  // bit t = token t
      if (lx == j) planes[j][cl] = word;
    }
  }
  __syncthreads();

  if (c < D)
    for (int j = ly; j < Bits; j += tile_rows)
      out.base[j][(h * g.blocks() + b) * out.head_block_stride[j] + c] = planes[j][lx];
}

/// Reconstruction of one (32-token block, 32-channel tile, head) of K or V at a
/// precision of `planes` planes: thread (x, y) reads channel x's plane words
/// once and writes tokens y, y+8, y+16, y+24.
template <int Bits, bool Keys, class T>
__global__ void __launch_bounds__(tile_channels* tile_rows)
    reconstruct_kernel(kv_view<T, device_space> out, layer_geometry g, const bf16* scale,
                       const bf16* zero, plane_rows<const std::uint32_t> in, int planes,
                       float half) {
  const std::int64_t b = blockIdx.x, h = blockIdx.z;
  const std::int64_t D = g.head_dim, T_ = g.tokens;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * tile_channels + threadIdx.x;
  if (c >= D) return;  // no barrier in this kernel
  const std::int64_t t0 = b * tokens_per_word;
  const int n = static_cast<int>(T_ - t0 < tokens_per_word ? T_ - t0 : tokens_per_word);

  std::uint32_t words[Bits];
#pragma unroll
  for (int j = 0; j < Bits; ++j)
    words[j] = j < planes ? in.base[j][(h * g.blocks() + b) * in.head_block_stride[j] + c] : 0u;

  for (int r = static_cast<int>(threadIdx.y); r < n; r += tile_rows) {
    std::uint32_t prefix = 0;
#pragma unroll
    for (int j = 0; j < Bits; ++j)
      if (j < planes) prefix = (prefix << 1) | token_bit(words[j], r);
    const std::int64_t t = t0 + r;
    const std::int64_t i = Keys ? (h * g.key_token_groups() + t / g.key_group) * D + c
                                : (h * T_ + t) * g.value_channel_groups() + c / g.value_group;
    const float level = static_cast<float>(prefix << (Bits - planes)) + half;
    out(t, h, c) = from_float<T>(
        reconstruct_from_level(level, {static_cast<float>(scale[i]), static_cast<float>(zero[i])}));
  }
}

// ---------------------------------------------------------------------------
// Host entry helpers
// ---------------------------------------------------------------------------

template <class T>
void check_device_inputs(const kv_view<const T, device_space>& keys,
                         const kv_view<const T, device_space>& values) {
  lynx::detail::require(keys.data != nullptr && values.data != nullptr, errc::invalid_argument,
                        "cuda::encode: null K or V data");
  lynx::detail::require(!keys.paged() && !values.paged(), errc::invalid_argument,
                        "cuda::encode: paged K/V views are read by the host codecs only (yet)");
  lynx::detail::require(
      keys.shape == values.shape, errc::shape_mismatch,
      "K has shape " + to_string(keys.shape) + " but V has shape " + to_string(values.shape));
}

inline void check_device_outputs(const layer_geometry& g, std::span<const device_bytes> out) {
  lynx::detail::require(static_cast<int>(out.size()) == g.plan.streams, errc::invalid_argument,
                        "cuda::encode_async: " + std::to_string(out.size()) +
                            " output buffers for a plan of " + std::to_string(g.plan.streams) +
                            " streams");
  for (int s = 0; s < g.plan.streams; ++s) {
    const device_bytes& o = out[static_cast<std::size_t>(s)];
    lynx::detail::require(o.size == segment_bytes(g, s), errc::invalid_argument,
                          "cuda::encode_async: buffer of stream " + std::to_string(s) + " has " +
                              std::to_string(o.size) + " bytes, the segment needs " +
                              std::to_string(segment_bytes(g, s)));
    lynx::detail::require(o.data != nullptr && reinterpret_cast<std::uintptr_t>(o.data) % 16 == 0,
                          errc::invalid_argument,
                          "cuda::encode_async: buffer of stream " + std::to_string(s) +
                              " is null or not 16-byte aligned");
  }
}

}  // namespace detail

/// The error an encode's input check found, in the host encoder's terms.
struct encode_problem {
  enum kind_type : std::uint8_t { none, non_finite, range_overflow } kind = none;
  bool keys = true;  // which tensor: K or V
  std::int64_t head = 0;
  std::int64_t token =
      0;  // non_finite: the element's token; range_overflow: first token of the group
  std::int64_t token_end = 0;  // range_overflow: one past the group's last token
  std::int64_t channel = 0;    // non_finite only
};

/// Which error the host encoder would throw for this status: the first
/// offending key group, else the first value group (the host quantizes all
/// keys before any value); within a group the first non-finite element in
/// (token, channel) order, else the range overflow. Host-only arithmetic.
inline encode_problem first_problem(const encode_status& st, const layer_geometry& g) {
  const auto D = static_cast<unsigned long long>(g.head_dim),
             Tn = static_cast<unsigned long long>(g.tokens);
  const auto KG = static_cast<unsigned long long>(g.key_token_groups());
  const auto G = static_cast<unsigned long long>(g.key_group),
             VG = static_cast<unsigned long long>(g.value_group);
  const auto VGs = static_cast<unsigned long long>(g.value_channel_groups());
  const auto element = [&](unsigned long long at, bool keys) {
    encode_problem p;
    p.kind = encode_problem::non_finite;
    p.keys = keys;
    p.channel = static_cast<std::int64_t>(at % D);
    p.token = static_cast<std::int64_t>(at / D % Tn);
    p.head = static_cast<std::int64_t>(at / D / Tn);
    return p;
  };
  if (st.key_non_finite != no_problem || st.key_overflow_group != no_problem) {
    unsigned long long nf_group = no_problem;
    if (st.key_non_finite != no_problem)
      nf_group = st.key_non_finite / D / Tn * KG + st.key_non_finite / D % Tn / G;
    if (nf_group <= st.key_overflow_group) return element(st.key_non_finite, true);
    encode_problem p;
    p.kind = encode_problem::range_overflow;
    p.keys = true;
    p.head = static_cast<std::int64_t>(st.key_overflow_group / KG);
    p.token = static_cast<std::int64_t>(st.key_overflow_group % KG) * g.key_group;
    p.token_end = p.token + g.key_group < g.tokens ? p.token + g.key_group : g.tokens;
    return p;
  }
  if (st.value_non_finite != no_problem || st.value_overflow_group != no_problem) {
    unsigned long long nf_group = no_problem;
    if (st.value_non_finite != no_problem)
      nf_group = st.value_non_finite / D * VGs + st.value_non_finite % D / VG;
    if (nf_group <= st.value_overflow_group) return element(st.value_non_finite, false);
    encode_problem p;
    p.kind = encode_problem::range_overflow;
    p.keys = false;
    p.token = static_cast<std::int64_t>(st.value_overflow_group / VGs % Tn);
    p.head = static_cast<std::int64_t>(st.value_overflow_group / VGs / Tn);
    p.token_end = p.token + 1;
    return p;
  }
  return {};
}

/// Throws the host encoder's lynx::error for a problem (same code, same message);
/// `offending` is the non-finite element's value (NaN or infinity).
[[noreturn]] inline void report_problem(const encode_problem& p, std::uint32_t layer,
                                        float offending) {
  const std::string tensor = p.keys ? "keys" : "values";
  if (p.kind == encode_problem::non_finite)
    lynx::detail::fail(errc::non_finite_input,
                       tensor + " of layer " + std::to_string(layer) + " holds " +
                           (offending != offending ? "NaN" : "infinity") + " at kv head " +
                           std::to_string(p.head) + ", token " + std::to_string(p.token) +
                           ", channel " + std::to_string(p.channel));
  lynx::detail::fail(errc::invalid_argument,
                     tensor + " of layer " + std::to_string(layer) +
                         ": range of a group at kv head " + std::to_string(p.head) + ", tokens [" +
                         std::to_string(p.token) + ", " + std::to_string(p.token_end) +
                         ") exceeds the float range");
}

/// Throws the host encoder's error for an encode's status, if any; reads the
/// offending element back from the device to say NaN or infinity.
template <class T>
void throw_encode_status(const encode_status& st, const kv_view<const T, device_space>& keys,
                         const kv_view<const T, device_space>& values, const layer_geometry& g,
                         std::uint32_t layer) {
  const encode_problem p = first_problem(st, g);
  if (p.kind == encode_problem::none) return;
  float offending = 0.0f;
  if (p.kind == encode_problem::non_finite) {
    const kv_view<const T, device_space>& x = p.keys ? keys : values;
    T element{};
    // &x(...) only forms the device address; the element is read by cudaMemcpy
    LYNX_CUDA_CHECK(
        cudaMemcpy(&element, &x(p.token, p.head, p.channel), sizeof(T), cudaMemcpyDeviceToHost));
    offending = to_float(element);
  }
  report_problem(p, layer, offending);
}

namespace detail {
/// The expanded float parameters (bf16 values) to the anchor's bf16 sections.
template <int Unused = 0>
__global__ void wire_params_kernel(layer_geometry g, const float* expanded, std::byte* payload) {
  for (int section = 0; section < 4; ++section) {
    const float* src = expanded + g.param_section_offset(section, 4) / 4;
    auto* dst = reinterpret_cast<std::uint16_t*>(
        payload + g.param_section_offset(section, layer_geometry::wire_param_bytes));
    const std::int64_t n = g.param_section_params(section);
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
      dst[i] = static_cast<std::uint16_t>(__float_as_uint(src[i]) >> 16);
  }
}
}  // namespace detail

/// Launches the encode of one layer on `stream` (CUB style):
///  - workspace == nullptr: sets workspace_bytes to what it needs, launches nothing;
///  - otherwise: writes the segments of every stream into out[s] (device memory,
///    exactly segment_bytes(g, s) bytes, 16-byte aligned) and the input check
///    into the workspace; read it with check_encode_status after the stream.
/// The headers carry checksum 0 (see stage_to_host). Argument errors (shapes,
/// buffer sizes) throw lynx::error like the host API; CUDA failures are returned.
template <stream_plan_type Plan, int G = 32, kv_element T>
[[nodiscard]] cudaError_t encode_async(void* workspace, std::size_t& workspace_bytes,
                                       kv_view<const T, device_space> keys,
                                       kv_view<const T, device_space> values, std::uint32_t layer,
                                       std::span<const device_bytes> out,
                                       std::uint64_t generation = 0,
                                       cudaStream_t stream = nullptr) {
  detail::check_device_inputs(keys, values);
  const layer_geometry g = make_geometry<Plan, G>(keys.shape);
  if (workspace == nullptr) {
    workspace_bytes = encode_workspace_bytes(g);
    return cudaSuccess;
  }
  lynx::detail::require(workspace_bytes >= encode_workspace_bytes(g), errc::invalid_argument,
                        "cuda::encode_async: workspace of " + std::to_string(workspace_bytes) +
                            " bytes, it needs " + std::to_string(encode_workspace_bytes(g)));
  lynx::detail::require(
      reinterpret_cast<std::uintptr_t>(workspace) % alignof(encode_status) == 0,
      errc::invalid_argument,
      "cuda::encode_async: workspace is not 8-byte aligned (its fields are 64-bit atomics)");
  detail::check_device_outputs(g, out);
  const detail::encode_launch launch = detail::make_encode_launch(g);
  constexpr int B = Plan::bits;
  auto* status = static_cast<encode_status*>(workspace);

  std::byte* payload[max_streams] = {};
  for (int s = 0; s < Plan::streams; ++s)
    payload[s] = out[static_cast<std::size_t>(s)].data + segment_header_bytes;
  std::byte* params = static_cast<std::byte*>(workspace) + encode_status_bytes;
  auto* key_scale = reinterpret_cast<float*>(params + g.key_scale_offset());
  auto* key_zero = reinterpret_cast<float*>(params + g.key_zero_offset());
  auto* value_scale = reinterpret_cast<float*>(params + g.value_scale_offset());
  auto* value_zero = reinterpret_cast<float*>(params + g.value_zero_offset());

  LYNX_CUDA_TRY(
      cudaMemsetAsync(status, 0xff, sizeof(encode_status), stream));  // every field = no_problem
  detail::frame_kernel<<<Plan::streams, 128, 0, stream>>>(
      detail::make_segment_frames(g, layer, generation, out));
  LYNX_CUDA_TRY(cudaGetLastError());
  detail::key_params_kernel<B, T><<<launch.key_params, detail::block_shape(), 0, stream>>>(
      keys, g, key_scale, key_zero, status);
  LYNX_CUDA_TRY(cudaGetLastError());
  detail::value_params_kernel<B, T><<<launch.value_params, detail::block_shape(), 0, stream>>>(
      values, g, value_scale, value_zero, status, launch.value_group_count);
  LYNX_CUDA_TRY(cudaGetLastError());
  detail::pack_kernel<B, true, T><<<launch.pack, detail::block_shape(), 0, stream>>>(
      keys, g, key_scale, key_zero, detail::make_plane_rows<std::uint32_t>(g, payload, true, B));
  LYNX_CUDA_TRY(cudaGetLastError());
  detail::pack_kernel<B, false, T><<<launch.pack, detail::block_shape(), 0, stream>>>(
      values, g, value_scale, value_zero,
      detail::make_plane_rows<std::uint32_t>(g, payload, false, B));
  LYNX_CUDA_TRY(cudaGetLastError());
  detail::wire_params_kernel<>
      <<<256, 256, 0, stream>>>(g, reinterpret_cast<const float*>(params), payload[0]);
  return cudaGetLastError();
}

/// Waits for `stream`, reads the status an encode left in `workspace` and
/// throws the host encoder's error if the input held NaN, infinity or a range
/// that overflows float.
template <stream_plan_type Plan, int G = 32, kv_element T>
void check_encode_status(const void* workspace, kv_view<const T, device_space> keys,
                         kv_view<const T, device_space> values, std::uint32_t layer,
                         cudaStream_t stream = nullptr) {
  encode_status st{};
  LYNX_CUDA_CHECK(cudaMemcpyAsync(&st, workspace, sizeof st, cudaMemcpyDeviceToHost, stream));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(stream));
  throw_encode_status(st, keys, values, make_geometry<Plan, G>(keys.shape), layer);
}

/// Encodes one layer into preallocated device buffers (no allocation): out[s]
/// of segment_bytes(g, s) bytes, workspace of encode_workspace_bytes(g). Waits for
/// `stream` and throws lynx::error on bad input like the host encoder.
template <stream_plan_type Plan, int G = 32, kv_element T>
void encode_into(kv_view<const T, device_space> keys, kv_view<const T, device_space> values,
                 std::uint32_t layer, std::span<const device_bytes> out, device_bytes workspace,
                 std::uint64_t generation = 0, cudaStream_t stream = nullptr) {
  std::size_t bytes = workspace.size;
  LYNX_CUDA_CHECK((encode_async<Plan, G, T>(workspace.data, bytes, keys, values, layer, out,
                                            generation, stream)));
  check_encode_status<Plan, G, T>(workspace.data, keys, values, layer, stream);
}

/// The segments of one layer in device memory (headers unsealed: checksum 0).
template <stream_plan_type Plan, int G = 32>
class device_encoded_layer {
 public:
  using plan = Plan;
  static constexpr int group_size = G;

  device_encoded_layer(layer_geometry geometry, std::uint32_t layer)
      : geometry_(geometry), layer_(layer), workspace_(encode_workspace_bytes(geometry)) {
    for (int s = 0; s < Plan::streams; ++s)
      segments_[static_cast<std::size_t>(s)] = device_buffer(segment_bytes(geometry_, s));
    for (int s = 0; s < Plan::streams; ++s)
      spans_[static_cast<std::size_t>(s)] = segments_[static_cast<std::size_t>(s)].bytes();
  }
  [[nodiscard]] device_bytes segment(int s) const { return spans_[static_cast<std::size_t>(s)]; }
  /// One device_bytes per stream, as encode_async takes them.
  [[nodiscard]] std::span<const device_bytes> segments() const {
    return {spans_.data(), static_cast<std::size_t>(Plan::streams)};
  }
  [[nodiscard]] device_bytes workspace() noexcept { return workspace_.bytes(); }
  [[nodiscard]] const layer_geometry& geometry() const noexcept { return geometry_; }
  [[nodiscard]] std::uint32_t layer() const noexcept { return layer_; }

 private:
  layer_geometry geometry_;
  std::uint32_t layer_;
  std::array<device_buffer, max_streams> segments_{};
  std::array<device_bytes, max_streams> spans_{};
  device_buffer workspace_;
};

/// Convenience: allocates the segments and workspace, encodes, checks.
template <stream_plan_type Plan, int G = 32, kv_element T>
device_encoded_layer<Plan, G> encode(kv_view<const T, device_space> keys,
                                     kv_view<const T, device_space> values, std::uint32_t layer,
                                     std::uint64_t generation = 0, cudaStream_t stream = nullptr) {
  detail::check_device_inputs(keys, values);
  device_encoded_layer<Plan, G> result(make_geometry<Plan, G>(keys.shape), layer);
  encode_into<Plan, G, T>(keys, values, layer, result.segments(), result.workspace(), generation,
                          stream);
  return result;
}

/// Writes the checksum of a segment in host memory (header + payload): what a
/// device-encoded segment needs before it validates. Same as seal_segment.
inline void seal_on_host(std::span<std::byte> segment) { seal_segment(segment); }

/// Copies a device segment to host memory (`host` of exactly segment.size
/// bytes), waits for `stream`, and seals it: the bytes a transport sends.
inline void stage_to_host(device_bytes segment, std::span<std::byte> host,
                          cudaStream_t stream = nullptr) {
  lynx::detail::require(host.size() == segment.size, errc::invalid_argument,
                        "stage_to_host: host buffer of " + std::to_string(host.size()) +
                            " bytes for a segment of " + std::to_string(segment.size));
  LYNX_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), segment.data, segment.size, cudaMemcpyDeviceToHost, stream));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(stream));
  seal_on_host(host);
}

/// Launches the reconstruction of K and V at the view's precision level into
/// the engine's layout (device views, any strides). Argument errors throw
/// lynx::error like the host reconstruct; CUDA failures are returned.
template <stream_plan_type Plan, int G, kv_element T>
[[nodiscard]] cudaError_t reconstruct_async(const bitplane_view<Plan, G, device_space>& v,
                                            kv_view<T, device_space> keys_out,
                                            kv_view<T, device_space> values_out,
                                            cudaStream_t stream = nullptr) {
  const layer_geometry& g = v.geometry;
  lynx::detail::require(
      v.level >= 1, errc::invalid_argument,
      "reconstruct: layer " + std::to_string(v.layer) + " has no anchor yet (precision level 0)");
  lynx::detail::require(keys_out.shape == g.shape() && values_out.shape == g.shape(),
                        errc::shape_mismatch,
                        "reconstruct: outputs " + to_string(keys_out.shape) + " / " +
                            to_string(values_out.shape) + ", the layer is " + to_string(g.shape()));
  lynx::detail::require(keys_out.data != nullptr && values_out.data != nullptr,
                        errc::invalid_argument, "reconstruct: null output");
  constexpr int B = Plan::bits;
  const int P = v.planes();
  const float half = midpoint_offset<B>(P);
  const detail::encode_launch launch = detail::make_encode_launch(g);
  const std::byte* payload[max_streams] = {};
  for (int s = 0; s < Plan::streams; ++s) payload[s] = v.payload[static_cast<std::size_t>(s)];
  detail::reconstruct_kernel<B, true, T><<<launch.pack, detail::block_shape(), 0, stream>>>(
      keys_out, g, v.key_scale(), v.key_zero(),
      detail::make_plane_rows<const std::uint32_t>(g, payload, true, P), P, half);
  LYNX_CUDA_TRY(cudaGetLastError());
  detail::reconstruct_kernel<B, false, T><<<launch.pack, detail::block_shape(), 0, stream>>>(
      values_out, g, v.value_scale(), v.value_zero(),
      detail::make_plane_rows<const std::uint32_t>(g, payload, false, P), P, half);
  return cudaGetLastError();
}

/// Host API: reconstruct at the view's level and throw lynx::error(cuda_error)
/// on a CUDA failure. Stream-ordered: the outputs are ready when `stream` passes.
template <stream_plan_type Plan, int G, kv_element T>
void reconstruct(const bitplane_view<Plan, G, device_space>& v, kv_view<T, device_space> keys_out,
                 kv_view<T, device_space> values_out, cudaStream_t stream = nullptr) {
  LYNX_CUDA_CHECK((reconstruct_async<Plan, G, T>(v, keys_out, values_out, stream)));
}

/// Same, at the tensor's current precision level, on the tensor's stream.
template <stream_plan_type Plan, int G, kv_element T>
void reconstruct(const bitplane_tensor<Plan, G, device_space>& tensor,
                 kv_view<T, device_space> keys_out, kv_view<T, device_space> values_out) {
  reconstruct<Plan, G, T>(tensor.view(), keys_out, values_out, tensor.stream());
}

}  // namespace lynx::cuda
