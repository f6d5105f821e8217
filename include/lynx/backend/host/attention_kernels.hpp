// Host kernels of decode attention: how one split of a context is walked for
// one query and one kv head (all query heads of the group at once, so every
// K/V row is read once for the group). The math comes from
// attention/tile_math.hpp; this file only walks the data.
//
// Three paths, chosen at run time: a portable one (plain loops), an AVX-512 one
// (function-level target attributes, used when the CPU has AVX-512F/BW) and an
// AVX2 one (when it has AVX2 + FMA but not AVX-512; the portable loops where it
// has no kernel). All evaluate the same operations in the same order, lane by lane:
//  - bit-plane keys (and stored codes): lane = token; score = (0 + sum_c qs[c] * code[c] in
//    channel order) + bias;
//  - bit-plane values and dense values: lane = channel; acc = 0, acc += w[t] * v[t] in token
//    order (bit-plane values then add the offset);
//  - dense keys: 16 channel lanes summed in channel order, then a halving tree;
//  - l = fixed_order_sum(p); p = attention_exp2(s2 - m).
// so the paths give the same bits (the tests check it).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "lynx/attention/tile_math.hpp"
#include "lynx/backend/host/isa.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/dispatch.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__)
#include <immintrin.h>
#define LYNX_ATTENTION_AVX512 1
#define LYNX_ATTENTION_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
// A portable walk compiled for AVX2 + FMA (for CPUs with host_has_fma), as
// LYNX_ATTENTION_UNFUSED below: everything it calls inlined, no contraction.
#define LYNX_ATTENTION_FMA_CLONE __attribute__((target("avx2,fma"))) LYNX_ATTENTION_UNFUSED
#else
#define LYNX_ATTENTION_AVX512 0
#endif

// A portable walk with everything it calls inlined (flatten), compiled by GCC
// without contracting a * b + c: GCC fuses it into one FMA by default in C++
// (-ffp-contract=fast) on targets with FMA, which rounds once where the walk, and
// the AVX-512 kernels lane by lane, round twice. (clang contracts only within one
// expression by default, and the walks write none that it would fuse.)
#if defined(__CUDACC__) || !defined(__GNUC__)
#define LYNX_ATTENTION_UNFUSED
#elif defined(__clang__)
#define LYNX_ATTENTION_UNFUSED __attribute__((flatten))
#else
#define LYNX_ATTENTION_UNFUSED __attribute__((flatten, optimize("fp-contract=off")))
#endif

namespace lynx::detail {

/// Bits of the integers the GFNI decoders give for P planes: prefix << (decoded_bits(P) - P).
inline int decoded_bits(int planes) { return planes > 8 ? 16 : 8; }

/// A bit-plane prompt at `planes` planes of Plan::bits.
template <stream_plan_type Plan, int G>
struct plane_kv_source {
  bitplane_view<Plan, G, host_space> view;
  int planes = 0;
  [[nodiscard]] std::int64_t tokens() const { return view.geometry.tokens; }
  [[nodiscard]] int head_dim() const { return static_cast<int>(view.geometry.head_dim); }
  // Pointers to plane j's words [head_dim] of block (h, b), j < planes, across streams.
  void block_rows(bool keys, std::int64_t h, std::int64_t b, const std::uint32_t** rows) const {
    const layer_geometry& g = view.geometry;
    int j = 0;
    for (int s = 0; j < planes; ++s) {
      const std::uint32_t* base = keys ? view.key_planes(s) : view.value_planes(s);
      for (int jl = 0; jl < g.planes_in(s) && j < planes; ++jl, ++j)
        rows[j] = base + g.word_index(s, h, b, jl, 0);
    }
  }
  /// Asks the cache for block (h, b)'s plane words ahead of use (the walk is
  /// sequential, but each block is small next to the work done on it).
  void prefetch_block(bool keys, std::int64_t h, std::int64_t b) const {
    if (b >= view.geometry.blocks()) return;
    const std::uint32_t* rows[16];
    block_rows(keys, h, b, rows);
    for (int j = 0; j < planes; ++j) prefetch_lines<3>(rows[j], view.geometry.head_dim * 4);
  }
  /// Asks L2 for slice `part` of `parts` of everything one split [t0, t1) of kv
  /// head h reads (plane words of its blocks and its scales and zeros), keys
  /// or values. The kernels call it block by block for the split they will
  /// walk next, so its bytes are in L2 when the walk starts.
  void prefetch_split_slice(bool keys, std::int64_t h, std::int64_t t0, std::int64_t t1, int part,
                            int parts) const {
    view.for_each_range(keys, planes, h, t0, t1, [&](const void* base, std::int64_t bytes) {
      const std::int64_t lo = bytes * part / parts / 64 * 64, hi = bytes * (part + 1) / parts;
      prefetch_lines<2>(static_cast<const char*>(base) + lo, hi - lo);
    });
  }
  /// Adds to `walk` everything one split [t0, t1) of kv head h reads, keys or
  /// values, in the order the kernels read it: scales and zeros, then plane words.
  void walk_split(prefetch_walk& walk, bool keys, std::int64_t h, std::int64_t t0,
                  std::int64_t t1) const {
    view.for_each_range(keys, planes, h, t0, t1,
                        [&](const void* base, std::int64_t bytes) { walk.add(base, bytes); });
  }
  [[nodiscard]] float level_unit() const { return static_cast<float>(1u << (Plan::bits - planes)); }
  [[nodiscard]] float half() const { return midpoint_offset<Plan::bits>(planes); }
};

/// Full-precision K/V (engine tail, or the 16-bit baseline's prompt).
template <class T>
struct dense_kv_source {
  kv_view<const T, host_space> keys, values;
  [[nodiscard]] std::int64_t tokens() const { return keys.shape.tokens; }
  [[nodiscard]] int head_dim() const { return static_cast<int>(keys.shape.head_dim); }
};

/// A complete layer's codes laid out for attention (lynx::code_view): key codes
/// [kv_heads][blocks][head_dim][32] (lane = token), value codes [kv_heads][blocks * 32][head_dim]
/// (lane = channel), the anchor's parameters. The same math as a plane_kv_source at all
/// planes, the same bits; only the decoding of the planes is gone.
template <class View>
struct code_kv_source {
  View view;
  int planes = View::plan::bits;
  using code_type = typename View::code_type;
  [[nodiscard]] float level_unit() const {
    return static_cast<float>(1u << (View::plan::bits - planes));
  }
  [[nodiscard]] float half() const { return midpoint_offset<View::plan::bits>(planes); }
  /// Adds to `walk` everything one split [t0, t1) of kv head h reads, keys or
  /// values, in the order the kernels read it: scales and zeros, then codes.
  void walk_split(prefetch_walk& walk, bool keys, std::int64_t h, std::int64_t t0,
                  std::int64_t t1) const {
    if (t1 <= t0) return;
    const layer_geometry& g = view.geometry;
    const std::int64_t b0 = t0 / attention_block_tokens,
                       b1 = (t1 + attention_block_tokens - 1) / attention_block_tokens;
    constexpr std::int64_t code_bytes = sizeof(code_type);
    const auto p = keys ? g.key_params_of(h, t0, t1) : g.value_params_of(h, t0, t1);
    walk.add((keys ? view.key_scale() : view.value_scale()) + p.first, (p.end - p.first) * 4);
    walk.add((keys ? view.key_zero() : view.value_zero()) + p.first, (p.end - p.first) * 4);
    if (keys)
      walk.add(view.key_block(h, b0), (b1 - b0) * g.head_dim * attention_block_tokens * code_bytes);
    else
      walk.add(view.value_row(h, t0), (b1 * attention_block_tokens - t0) * g.head_dim * code_bytes);
  }
};

/// The value weights of a code source: no GFNI decoder, so no shift folded in.
template <class View>
bool gfni_values(const code_kv_source<View>&) {
  return false;
}

/// A split a worker walks next (kv head, tokens), for the L2 prefetches; t1 <= t0: none.
struct next_split {
  std::int64_t kv_head = 0, t0 = 0, t1 = 0;
};

/// How far ahead (in 32-token blocks) the bit-plane walks ask for plane words:
/// far enough to cover a DRAM round trip at the work done per block.
inline constexpr std::int64_t prefetch_blocks = 4;

/// Scratch of one worker, in floats; see split_scratch_floats.
struct split_scratch {
  float* scores;   // [item kv heads][heads][S]: logits, then p
  float* qs;       // [2][heads][head_dim]: folded queries of two key groups
  float* bias;     // [2][heads]
  float* weights;  // [heads][value groups][S]: value weights of the split (dense: queries)
  float* offsets;  // [heads][value groups]
  float* tile;     // [head_dim][32]: codes of one block, lane = token (or 16 float key rows)
  float* queries;  // [item kv heads][heads][head_dim]: queries times the softmax scale
  float* odd;      // [heads][head_dim]: the odd tokens' value sums (portable bit-plane path)
};

/// Floats of one worker's scratch for `heads` query heads per kv head, and
/// `value_groups` value channel groups per token. `item_kv_heads`: the kv heads one
/// work item may cover (dense_heads_together); scores, weights (which hold a dense
/// item's permuted queries) and queries are sized for all of them.
inline std::int64_t split_scratch_floats(std::int64_t heads, std::int64_t head_dim,
                                         std::int64_t value_groups,
                                         std::int64_t item_kv_heads = 1) {
  const std::int64_t S = attention_split_tokens;
  const std::int64_t gh = item_kv_heads * heads;
  return gh * S + 2 * heads * head_dim + 2 * heads +
         heads * std::max(value_groups, item_kv_heads) * S + heads * value_groups +
         head_dim * attention_block_tokens + (gh + heads) * head_dim + 8 * 16 +
         1024;  // + 8 alignments and the shift of `weights` (carve_scratch)
}

inline split_scratch carve_scratch(float* base, std::int64_t heads, std::int64_t head_dim,
                                   std::int64_t value_groups, std::int64_t item_kv_heads = 1) {
  const std::int64_t S = attention_split_tokens;
  const std::int64_t gh = item_kv_heads * heads;
  auto align = [](float* p) {
    return reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(p) + 63) &
                                    ~std::uintptr_t{63});
  };
  split_scratch s;
  s.scores = align(base);
  s.qs = align(s.scores + gh * S);
  s.bias = align(s.qs + 2 * heads * head_dim);
  // Rows of scores and weights are 4 KiB apart; value_weights loads scores
  // while it stores weights at the same offsets, so `weights` starts 2 KiB
  // off `scores` modulo 4 KiB: loads never wait on a store that only shares
  // their low 12 address bits (4K aliasing).
  s.weights = align(s.bias + 2 * heads);
  s.weights += ((s.scores - s.weights) % 1024 + 1024 + 512) % 1024;
  s.offsets = align(s.weights + heads * std::max(value_groups, item_kv_heads) * S);
  s.tile = align(s.offsets + heads * value_groups);
  s.queries = align(s.tile + head_dim * attention_block_tokens);
  s.odd = align(s.queries + gh * head_dim);
  return s;
}

// ---------------------------------------------------------------------------
// Portable kernels.
// ---------------------------------------------------------------------------

/// The bit-plane value sums' offsets: acc[h][c] += offsets[h][c / VG].
inline void add_value_offsets(const float* offsets, int heads, std::int64_t D, std::int64_t groups,
                              std::int64_t VG, float* acc) {
  for (int h = 0; h < heads; ++h)
    for (std::int64_t gi = 0; gi < groups; ++gi) {
      const float off = offsets[h * groups + gi];
      float* a = acc + h * D;
      for (std::int64_t c = gi * VG; c < std::min(D, (gi + 1) * VG); ++c) a[c] += off;
    }
}

/// fold_query_into_key_group for `heads` queries q[h][D] against key group grp
/// of kv head h (a plane or code source): w.qs[h][D] and w.bias[h].
template <class Source>
void fold_queries_portable(const Source& src, std::int64_t kv_head, std::int64_t grp,
                           const float* q, int heads, const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t base = (kv_head * g.key_token_groups() + grp) * D;
  for (int h = 0; h < heads; ++h)
    w.bias[h] = fold_query_into_key_group(q + h * D, src.view.key_scale() + base,
                                          src.view.key_zero() + base, D, src.level_unit(),
                                          src.half(), w.qs + h * D);
}

/// One value token of the portable value sums: sums[h][c] += weight[h][grp(c)] *
/// row[c], one fused multiply-add each; wt: the token's weights (w.weights + t -
/// t0), row: its codes as floats. The channel loops are contiguous, so a compiler
/// vectorizes them.
inline void add_value_row_portable(float* sums, int heads, int D, std::int64_t groups,
                                   std::int64_t VG, const float* wt,
                                   const float* LYNX_RESTRICT row) {
  constexpr int N = attention_reduction_lanes;
  for (int h = 0; h < heads; ++h)
    for (std::int64_t grp = 0; grp < groups; ++grp) {
      const float weight = wt[(h * groups + grp) * attention_split_tokens];
      float* LYNX_RESTRICT sum = sums + h * D;
      std::int64_t c = grp * VG;
      const std::int64_t end = std::min<std::int64_t>(D, (grp + 1) * VG);
      for (; c + N <= end; c += N)  // whole steps: no loop overhead per group
        for (int l = 0; l < N; ++l)
          sum[c + l] = detail::fused_multiply_add(weight, row[c + l], sum[c + l]);
      for (; c < end; ++c) sum[c] = detail::fused_multiply_add(weight, row[c], sum[c]);
    }
}

/// Tokens [ta, tz) of a tile of rows (rows[t - ta][D], codes as floats) added to
/// the value sums (acc: even tokens, odd: odd tokens), as add_value_row_portable
/// token by token, but 16 channels of two heads at a time over all the tokens:
/// the 16-lane even and odd sums stay in registers and each step is four fused
/// multiply-adds on independent sums (one head's two would wait on the
/// multiply-add's latency). wt: the weights of token ta (w.weights + ta - t0).
/// Needs head_dim and the value group to be multiples of 16; otherwise a row at
/// a time.
inline void add_value_tile_portable(float* acc, float* odd, int heads, int D, std::int64_t groups,
                                    std::int64_t VG, const float* wt, const float* rows,
                                    std::int64_t ta, std::int64_t tz) {
  constexpr int N = attention_reduction_lanes;
  if (D % N != 0 || VG % N != 0) {
    for (std::int64_t t = ta; t < tz; ++t)
      add_value_row_portable(t % 2 == 0 ? acc : odd, heads, D, groups, VG, wt + (t - ta),
                             rows + (t - ta) * D);
    return;
  }
  // HB heads h0.. at channels c0..c0 + 15
  auto pass = [&]<int HB>(int h0, int c0) {
    const float* weight[HB];
    float* LYNX_RESTRICT sum[HB][2];
    float e[HB][N], o[HB][N];  // the sums of tokens of ta's parity, and of the others
    for (int b = 0; b < HB; ++b) {
      weight[b] = wt + ((h0 + b) * groups + c0 / VG) * attention_split_tokens;
      sum[b][0] = (ta % 2 == 0 ? acc : odd) + (h0 + b) * D + c0;
      sum[b][1] = (ta % 2 == 0 ? odd : acc) + (h0 + b) * D + c0;
      for (int l = 0; l < N; ++l) {
        e[b][l] = sum[b][0][l];
        o[b][l] = sum[b][1][l];
      }
    }
    const float* row = rows + c0;
    std::int64_t t = ta;
    for (; t + 2 <= tz; t += 2, row += 2 * D)
      for (int b = 0; b < HB; ++b) {
        const float we = weight[b][t - ta], wo = weight[b][t + 1 - ta];
        for (int l = 0; l < N; ++l) {
          e[b][l] = detail::fused_multiply_add(we, row[l], e[b][l]);
          o[b][l] = detail::fused_multiply_add(wo, row[D + l], o[b][l]);
        }
      }
    if (t < tz)
      for (int b = 0; b < HB; ++b)
        for (int l = 0; l < N; ++l)
          e[b][l] = detail::fused_multiply_add(weight[b][t - ta], row[l], e[b][l]);
    for (int b = 0; b < HB; ++b)
      for (int l = 0; l < N; ++l) {
        sum[b][0][l] = e[b][l];
        sum[b][1][l] = o[b][l];
      }
  };
  int h = 0;
  for (; h + 2 <= heads; h += 2)
    for (int c0 = 0; c0 < D; c0 += N) pass.template operator()<2>(h, c0);
  if (h < heads)
    for (int c0 = 0; c0 < D; c0 += N) pass.template operator()<1>(h, c0);
}

/// The float of a code (codes are below 2^16: the signed conversion, which
/// every SIMD instruction set has, is exact); a decoded code is one already.
template <class Code>
inline float code_float(Code k) {
  if constexpr (std::is_same_v<Code, float>)
    return k;
  else
    return static_cast<float>(static_cast<std::int32_t>(k));
}

/// Calls f(std::integral_constant<int, P>) for P = planes, one of the plane counts
/// Plan's precision levels hold (its streams' running sums: 4 and 16 for
/// 16 = 4 + 12), so loops over planes unroll and the loops around them vectorize.
/// Only those counts are compiled: a bit-plane source never holds another
/// (plane_kv_source::planes is planes_at_level of its view's level).
template <stream_plan_type Plan, class F>
void with_level_planes(int planes, F&& f) {
  [&]<int... L>(std::integer_sequence<int, L...>) {
    (void)((planes == Plan::planes_at_level(L + 1)
                ? (f(std::integral_constant<int, Plan::planes_at_level(L + 1)>{}), true)
                : false) ||
           ...);
  }
  (std::make_integer_sequence<int, Plan::streams>{});
}

/// Lane of token t (0..31) of a block in a key tile decoded by nibbles
/// (decode_key_tile_portable): token 4q + i is in lane 8i + q.
inline int nibble_lane(int t) { return 8 * (t % 4) + t / 4; }

/// Where nibbles_to_bytes wants the nibble of code bit a (0..7): at bit 4 * slot.
constexpr int nibble_slot(int a) { return ((a & 3) << 1) | (a >> 2); }

/// Eight nibbles (the plane with code bit a at bit 4 * nibble_slot(a), its bit i
/// for token i) to four bytes (byte i: token i's code, bit a from that plane).
/// Writing a bit position as p4..p0, nibble_slot puts code bit a = (a2 a1 a0) at
/// p2 p4 p3 = a2 a1 a0 and token i at p1 p0; exchanging p0 with p3 and p1 with p4
/// (two delta swaps) makes it p1 p0 p2 p4 p3, bit a of byte i.
inline std::uint32_t nibbles_to_bytes(std::uint32_t x) {
  std::uint32_t t = (x ^ (x >> 7)) & 0x00aa00aau;  // p0 = 1, p3 = 0 with p + 7
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000ccccu;  // p1 = 1, p4 = 0 with p + 14
  return x ^ t ^ (t << 14);
}

/// The codes of tokens s..s+3 of channel c (bits s..s+3 of each plane word) as the
/// bytes of x (planes 0..7, the high byte) and y (planes 8..P-1, the low byte;
/// 0 for up to 8 planes): nibbles packed at nibble_slot, then nibbles_to_bytes.
template <int P>
inline void nibble_code_bytes(const std::uint32_t* const* rows, int c, int s, std::uint32_t& x,
                              std::uint32_t& y) {
  constexpr int PH = P < 8 ? P : 8;
  std::uint32_t v = 0, u = 0;
  for (int j = 0; j < PH; ++j) v |= ((rows[j][c] >> s) & 0xfu) << (4 * nibble_slot(PH - 1 - j));
  for (int j = PH; j < P; ++j) u |= ((rows[j][c] >> s) & 0xfu) << (4 * nibble_slot(P - 1 - j));
  x = nibbles_to_bytes(v);
  y = nibbles_to_bytes(u);
}

/// Token i's code from byte i of the high and low words of nibble_code_bytes.
template <int P>
inline std::uint32_t nibble_code(std::uint32_t x, std::uint32_t y, int i) {
  constexpr int PH = P < 8 ? P : 8;
  return (((x >> (8 * i)) & 0xffu) << (P - PH)) | ((y >> (8 * i)) & 0xffu);
}

/// Codes of one 32-token block of P planes as floats, tile[c][32], a lane per
/// token in the nibble order (nibble_lane). Nibble q of each plane word holds the
/// bits of tokens 4q..4q+3; the nibbles of up to 8 planes are packed into one word
/// (nibble_slot) and turned into a byte per token (nibbles_to_bytes), the 8 nibbles
/// of a channel being the SIMD lanes; byte i of nibble q's word is token 4q + i,
/// written to lane 8i + q so that the stores stay contiguous. More than 8 planes:
/// planes 0..7 and 8..P-1 each give a byte, the code is (high << (P - 8)) | low.
template <int P>
inline void decode_key_tile_portable(const std::uint32_t* const* rows, int D, float* tile) {
  static_assert(P >= 1 && P <= 16);
  constexpr int L = attention_block_tokens;
  for (int c = 0; c < D; ++c) {
    std::uint32_t x[L / 4], y[L / 4];  // byte i of x[q] (y[q]): token 4q + i's high (low) bits
    for (int q = 0; q < L / 4; ++q) nibble_code_bytes<P>(rows, c, 4 * q, x[q], y[q]);
    for (int i = 0; i < 4; ++i)
      for (int q = 0; q < L / 4; ++q)
        tile[c * L + 8 * i + q] = code_float(nibble_code<P>(x[q], y[q], i));
  }
}

/// Exchanges bit b + s of each byte of a with bit b of the same byte of b, for
/// the b with b mod 2s < s (the bits set in m): one delta swap.
inline void swap_bits(std::uint32_t& a, std::uint32_t& b, int s, std::uint32_t m) {
  const std::uint32_t t = ((a >> s) ^ b) & m;
  b ^= t;
  a ^= t << s;
}

/// Transposes the four 8x8 bit matrices held by bytes 0..3 of r0..r7 (row i: r_i):
/// on return, bit k of byte g of r_i is what bit i of byte g of r_k was. Delta
/// swaps of the off-diagonal blocks of 4, 2, then 1 rows, written out so that a
/// loop around it vectorizes.
inline void transpose_bytes_8x8(std::uint32_t* r) {
  constexpr std::uint32_t m4 = 0x0f0f0f0fu, m2 = 0x33333333u, m1 = 0x55555555u;
  swap_bits(r[0], r[4], 4, m4), swap_bits(r[1], r[5], 4, m4);
  swap_bits(r[2], r[6], 4, m4), swap_bits(r[3], r[7], 4, m4);
  swap_bits(r[0], r[2], 2, m2), swap_bits(r[1], r[3], 2, m2);
  swap_bits(r[4], r[6], 2, m2), swap_bits(r[5], r[7], 2, m2);
  swap_bits(r[0], r[1], 1, m1), swap_bits(r[2], r[3], 1, m1);
  swap_bits(r[4], r[5], 1, m1), swap_bits(r[6], r[7], 1, m1);
}

/// Loads the plane words of channel c, planes [j0, j0 + n) (n <= 8), as the rows
/// of an 8 x 32 bit matrix (plane j0 as row 7, absent planes 0) and transposes
/// its four 8x8 blocks: byte g of r[i] is then token 8g + i's bits of those
/// planes, plane j0 in the top bit.
template <int N>
inline void transposed_plane_bytes(const std::uint32_t* const* row, int c, std::uint32_t* r) {
  LYNX_UNROLL(8)
  for (int i = 0; i < 8; ++i) r[i] = 7 - i < N ? row[(7 - i) % N][c] : 0u;
  transpose_bytes_8x8(r);
}

/// decode_value_block_portable for a head_dim D known at compile time (so that a
/// compiler sees the 32 token rows of the tile do not overlap and vectorizes
/// over channels). A channel's plane words, 8 planes at a time, are an 8 x 32 bit
/// matrix (transposed_plane_bytes): planes 0..7 give the code's high byte,
/// planes 8..P-1 its low byte.
template <int P, int D>
inline void decode_value_block_transposed(const std::uint32_t* const* rows,
                                          float* LYNX_RESTRICT tile) {
  static_assert(P >= 1 && P <= 16);
  constexpr int L = attention_block_tokens;
  constexpr int PH = P < 8 ? P : 8, PL = P - PH;  // planes in the high and the low byte
  const std::uint32_t* row[P];
  for (int j = 0; j < P; ++j) row[j] = rows[j];
  for (int c = 0; c < D; ++c) {
    std::uint32_t r[8], s[8];
    transposed_plane_bytes<PH>(row, c, r);
    if constexpr (PL > 0) transposed_plane_bytes<PL>(row + PH, c, s);
    LYNX_UNROLL(32)
    for (int t = 0; t < L; ++t) {
      const std::uint32_t high = ((r[t % 8] >> (8 * (t / 8))) & 0xffu) >> (8 - PH);
      if constexpr (PL > 0)
        tile[t * D + c] =
            code_float((high << PL) | (((s[t % 8] >> (8 * (t / 8))) & 0xffu) >> (8 - PL)));
      else
        tile[t * D + c] = code_float(high);
    }
  }
}

/// Codes of the 32 tokens of a block of P planes as floats, tile[t][D] (lane =
/// channel): for head_dim 64, 128 and 256 by bit-matrix transposes
/// (decode_value_block_transposed); else four tokens at a time, each plane word
/// giving the four tokens' bits (a nibble), packed and turned into a byte per
/// token as the keys' (nibbles_to_bytes; planes 0..7 the high byte, 8..P-1 the low).
template <int P>
inline void decode_value_block_portable(const std::uint32_t* const* rows, int D, float* tile) {
  constexpr int L = attention_block_tokens;
  if (D == 64) return decode_value_block_transposed<P, 64>(rows, tile);
  if (D == 128) return decode_value_block_transposed<P, 128>(rows, tile);
  if (D == 256) return decode_value_block_transposed<P, 256>(rows, tile);
  for (int t = 0; t < L; t += 4)
    for (int c = 0; c < D; ++c) {
      std::uint32_t x, y;  // byte i: token t + i's high (low) bits
      nibble_code_bytes<P>(rows, c, t, x, y);
      for (int i = 0; i < 4; ++i) tile[(t + i) * D + c] = code_float(nibble_code<P>(x, y, i));
    }
}

/// Scores of tokens [la, lb) of one 32-token block, of the heads' folded queries
/// (w.qs, w.bias) against tile[c][32] (a lane per token: lane = token, or
/// nibble_lane(token) if `nibble_order`; floats or codes), token t into
/// w.scores[h * S + first + t]: bias[h] + sum_c qs[h][c] * tile[c][lane], the sum
/// starting at 0 in channel order (tile_math.hpp), all 32 lanes at once.
template <class K>
void score_block_portable(const K* tile, int D, int heads, const split_scratch& w,
                          std::int64_t first, int la, int lb, bool nibble_order) {
  constexpr int L = attention_block_tokens;
  // HB heads from h0 at once: independent sums, so that the multiply-adds of a
  // channel do not wait on each other's latency; each lane's order is the same
  auto pass = [&]<int HB>(int h0) {
    float s[HB][L] = {};
    for (int c = 0; c < D; ++c) {
      const K* k = tile + c * L;
      for (int b = 0; b < HB; ++b) {
        const float qc = w.qs[(h0 + b) * D + c];
        for (int l = 0; l < L; ++l)
          s[b][l] = detail::fused_multiply_add(qc, code_float(k[l]), s[b][l]);
      }
    }
    for (int b = 0; b < HB; ++b) {
      float* out = w.scores + (h0 + b) * attention_split_tokens + first;
      const float bias = w.bias[h0 + b];
      if (nibble_order)
        for (int t = la; t < lb; ++t) out[t] = s[b][nibble_lane(t)] + bias;
      else
        for (int t = la; t < lb; ++t) out[t] = s[b][t] + bias;
    }
  };
  int h = 0;
  for (; h + 2 <= heads; h += 2) pass.template operator()<2>(h);
  if (h < heads) pass.template operator()<1>(h);
}

/// Logits of tokens [t0, t1) of a plane or code prompt: scores[h][t - t0]. A block
/// is decoded once (plane source) for all heads, and scored once per key group
/// it holds (key groups of fewer than 32 tokens: a block holds several).
/// decode_block(b) returns block b's tile; its lanes are in nibble order if
/// `nibble_order`.
template <class Source, class DecodeBlock>
void score_blocks_portable(const Source& src, std::int64_t kv_head, const float* q, int heads,
                           std::int64_t t0, std::int64_t t1, const split_scratch& w,
                           bool nibble_order, DecodeBlock&& decode_block) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t KG = g.key_group;
  std::int64_t folded_group = -1;
  for (std::int64_t b = t0 / attention_block_tokens; b * attention_block_tokens < t1; ++b) {
    const std::int64_t tb = b * attention_block_tokens;
    const auto* tile = decode_block(b);
    for (std::int64_t a = std::max(tb, t0); a < std::min(tb + attention_block_tokens, t1);) {
      const std::int64_t e = std::min({(a / KG + 1) * KG, tb + attention_block_tokens, t1});
      if (a / KG != folded_group)
        fold_queries_portable(src, kv_head, folded_group = a / KG, q, heads, w);
      score_block_portable(tile, D, heads, w, tb - t0, static_cast<int>(a - tb),
                           static_cast<int>(e - tb), nibble_order);
      a = e;
    }
  }
}

/// Logits of tokens [t0, t1) of a bit-plane prompt: scores[h][t - t0].
template <stream_plan_type Plan, int G>
void score_tokens_portable(const plane_kv_source<Plan, G>& src, std::int64_t kv_head,
                           const float* q, int heads, std::int64_t t0, std::int64_t t1,
                           const split_scratch& w) {
  const int D = static_cast<int>(src.view.geometry.head_dim);
  score_blocks_portable(src, kv_head, q, heads, t0, t1, w, true, [&](std::int64_t b) {
    const std::uint32_t* rows[16];
    src.block_rows(true, kv_head, b, rows);
    with_level_planes<Plan>(src.planes,
                            [&](auto p) { decode_key_tile_portable<p()>(rows, D, w.tile); });
    return static_cast<const float*>(w.tile);
  });
}

/// Value weights of tokens [t0, t1) (shared by both paths): weights[h][grp][t - t0]
/// and offsets[h][grp] = sum_t p * (scale * half + zero), in token order (lane t mod 16
/// by value_offset_step, then the halving tree).
template <class Source>
void value_weights_portable(const Source& src, std::int64_t kv_head, int heads, std::int64_t t0,
                            std::int64_t t1, const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const std::int64_t groups = g.value_channel_groups();
  const float unit = src.level_unit(), half = src.half();
  const float* vs = src.view.value_scale() + kv_head * g.tokens * groups;
  const float* vz = src.view.value_zero() + kv_head * g.tokens * groups;
  constexpr int N = attention_reduction_lanes;
  for (int h = 0; h < heads; ++h)
    for (std::int64_t grp = 0; grp < groups; ++grp) {
      const float* p = w.scores + h * attention_split_tokens;
      float* LYNX_RESTRICT out = w.weights + (h * groups + grp) * attention_split_tokens;
      float lane[N] = {};
      std::int64_t t = t0;
      for (; t + N <= t1; t += N)  // a step of 16 lanes at a time (vectorizes)
        for (int l = 0; l < N; ++l) {
          const std::int64_t i = t + l;
          const value_token_weight vw =
              fold_value_token(p[i - t0], vs[i * groups + grp], vz[i * groups + grp], unit, half);
          out[i - t0] = vw.weight;
          lane[l] = value_offset_step(lane[l], p[i - t0], vw.shift);
        }
      for (; t < t1; ++t) {
        const value_token_weight vw =
            fold_value_token(p[t - t0], vs[t * groups + grp], vz[t * groups + grp], unit, half);
        out[t - t0] = vw.weight;
        float& sum = lane[(t - t0) % N];
        sum = value_offset_step(sum, p[t - t0], vw.shift);
      }
      w.offsets[h * groups + grp] = reduce_lanes(lane);
      // tokens past t1 in the last block weigh 0 (the kernels walk whole blocks)
      for (std::int64_t t = t1;
           t < (t1 + attention_block_tokens - 1) / attention_block_tokens * attention_block_tokens;
           ++t)
        out[t - t0] = 0.0f;
    }
}

/// acc[h][c] = offsets[h][grp(c)] + sum_t weights[h][grp(c)][t] * code(t, c):
/// two sums per (head, channel), over the even and over the odd tokens, each
/// one fused multiply-add per token in token order starting from 0; then
/// even + odd, then the offset. Lane = channel in the SIMD kernels, which take
/// two tokens per step (a lane per token parity): the sums stay in registers
/// and need one addition at the end.
template <stream_plan_type Plan, int G>
void accumulate_values_portable(const plane_kv_source<Plan, G>& src, std::int64_t kv_head,
                                int heads, std::int64_t t0, std::int64_t t1, float* acc,
                                const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t groups = g.value_channel_groups(), VG = g.value_group;
  float* odd = w.odd;
  float* tile = w.tile;
  std::fill(acc, acc + heads * D, 0.0f);
  std::fill(odd, odd + heads * D, 0.0f);
  const std::uint32_t* rows[16];
  for (std::int64_t b = t0 / attention_block_tokens; b * attention_block_tokens < t1; ++b) {
    src.block_rows(false, kv_head, b, rows);
    const std::int64_t tb = b * attention_block_tokens;
    with_level_planes<Plan>(src.planes,
                            [&](auto p) { decode_value_block_portable<p()>(rows, D, tile); });
    const std::int64_t ta = std::max(tb, t0), tz = std::min(tb + attention_block_tokens, t1);
    add_value_tile_portable(acc, odd, heads, D, groups, VG, w.weights + (ta - t0),
                            tile + (ta - tb) * D, ta, tz);
  }
  for (std::int64_t i = 0; i < heads * D; ++i) acc[i] += odd[i];
  add_value_offsets(w.offsets, heads, D, groups, VG, acc);
}

/// score_tokens_portable of a code source: the same operations on the stored codes
/// (already [c][32], lane = token).
template <class View>
void score_tokens_portable(const code_kv_source<View>& src, std::int64_t kv_head, const float* q,
                           int heads, std::int64_t t0, std::int64_t t1, const split_scratch& w) {
  score_blocks_portable(src, kv_head, q, heads, t0, t1, w, false,
                        [&](std::int64_t b) { return src.view.key_block(kv_head, b); });
}

/// accumulate_values_portable of a code source: the same operations on the stored codes.
template <class View>
void accumulate_values_portable(const code_kv_source<View>& src, std::int64_t kv_head, int heads,
                                std::int64_t t0, std::int64_t t1, float* acc,
                                const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t groups = g.value_channel_groups(), VG = g.value_group;
  float* odd = w.odd;
  float* tile = w.tile;  // the codes of up to 32 tokens as floats
  std::fill(acc, acc + heads * D, 0.0f);
  std::fill(odd, odd + heads * D, 0.0f);
  for (std::int64_t ta = t0; ta < t1; ta += attention_block_tokens) {
    const std::int64_t tz = std::min(ta + attention_block_tokens, t1);
    const auto* codes = src.view.value_row(kv_head, ta);  // rows of consecutive tokens
    for (std::int64_t i = 0; i < (tz - ta) * D; ++i) tile[i] = code_float(codes[i]);
    add_value_tile_portable(acc, odd, heads, D, groups, VG, w.weights + (ta - t0), tile, ta, tz);
  }
  for (std::int64_t i = 0; i < heads * D; ++i) acc[i] += odd[i];
  add_value_offsets(w.offsets, heads, D, groups, VG, acc);
}

/// How far ahead (in tokens) the dense kernels ask for the rows of one kv head,
/// into L2 (hint 2): bf16 keys and values of any element type (fp32 keys keep
/// their own 32 rows into L1, unmeasured here). Rows lie kv_heads * head_dim
/// apart, so the hardware prefetchers, which stay within a 4 KiB page, cannot
/// follow them. Measured on the bf16 baseline at 32K tokens (single thread):
/// 32 rows into L1 7.2-7.6 ms, 32 into L2 6.3, 64 into L2 5.6-5.7, 96 5.5-5.8,
/// 192 6.8; a head-major cache (contiguous rows) 5.8. L1 holds too few
/// outstanding misses for these bursts. On AMD Zen 4 64 into L2 is also best
/// (32: 12.9 ms, 64: 11.2, 128: 11.6, 192: 12.0, 64 into L1: 15.6). The
/// portable dense loops ask the same (bf16 baseline, 4,096 tokens, AVX2 clone:
/// 6.5-6.7 -> 5.4-5.9 ms).
inline constexpr std::int64_t dense_prefetch_rows = 64;

/// Lane of channel c in a dense score: c mod 16 for float keys; for bf16 keys
/// (c mod 32) / 2, the lane channel c lands in when 32 bf16 are widened per
/// load as even and odd halves.
template <class T>
constexpr int dense_score_lane(int c) {
  if constexpr (std::is_same_v<T, bf16>)
    return (c % 32) / 2;
  else
    return c % attention_reduction_lanes;
}

/// Dense score in the fixed order: 16 lanes (dense_score_lane), each summing its
/// channels in channel order, then a halving tree.
template <class T>
float dense_score(const float* q, const T* k, std::int64_t channel_stride, int D) {
  float lane[attention_reduction_lanes] = {};
  for (int c = 0; c < D; ++c)
    lane[dense_score_lane<T>(c)] = detail::fused_multiply_add(q[c], to_float(k[c * channel_stride]),
                                                              lane[dense_score_lane<T>(c)]);
  return reduce_lanes(lane);
}

/// A contiguous row of D channels as floats in the lane order of dense_score:
/// bf16 (read as little-endian words of two channels) puts the even channels of
/// each 32 first, then the odd ones, so that out[i] belongs to lane i mod 16 up to
/// the last whole 32; other types and bf16 on big-endian hosts keep channel order.
template <class T>
void dense_lane_order(const T* LYNX_RESTRICT x, int D, float* LYNX_RESTRICT out) {
  constexpr int N = attention_reduction_lanes;
  int c = 0;
  if constexpr (std::is_same_v<T, bf16> && std::endian::native == std::endian::little) {
    // Each word read straight from the row, once per half: GCC 12 vectorizes this
    // for AVX2 (two loads, two shifts, two ANDs, four stores per 32 channels) and
    // for AArch64 NEON. Copied into a local array first, every word went through
    // general registers; both halves in one loop stay scalar on AArch64.
    const auto* bytes = reinterpret_cast<const unsigned char*>(x);
    const auto word = [&](int i) {
      std::uint32_t w;
      std::memcpy(&w, bytes + 2 * i, sizeof(w));
      return w;
    };
    for (; c + 2 * N <= D; c += 2 * N) {
      for (int l = 0; l < N; ++l) out[c + l] = bits_float(word(c + 2 * l) << 16);
      for (int l = 0; l < N; ++l) out[c + N + l] = bits_float(word(c + 2 * l) & 0xffff0000u);
    }
  }
  for (; c < D; ++c) out[c] = to_float(x[c]);
}

/// The query's channels in the lane order of a key row of T (dense_lane_order).
template <class T>
void dense_query_lane_order(const float* q, int D, float* out) {
  constexpr int N = attention_reduction_lanes;
  int c = 0;
  if constexpr (std::is_same_v<T, bf16> && std::endian::native == std::endian::little)
    for (; c + 2 * N <= D; c += 2 * N)
      for (int l = 0; l < N; ++l) {
        out[c + l] = q[c + 2 * l];
        out[c + N + l] = q[c + 2 * l + 1];
      }
  for (; c < D; ++c) out[c] = q[c];
}

/// Channels [0, this) are in lane order after dense_lane_order, the rest in channel order.
template <class T>
constexpr int dense_lane_ordered(int D) {
  if constexpr (std::is_same_v<T, bf16> && std::endian::native == std::endian::little)
    return D / (2 * attention_reduction_lanes) * (2 * attention_reduction_lanes);
  else
    return D / attention_reduction_lanes * attention_reduction_lanes;
}

/// dense_score of a query and a key row both in dense_lane_order: the same lanes
/// and order, a whole step of 16 lanes at a time (so a compiler vectorizes it).
template <class T>
float dense_score_lanes(const float* q, const float* k, int D) {
  constexpr int N = attention_reduction_lanes;
  float lane[N] = {};
  const int ordered = dense_lane_ordered<T>(D);
  for (int c = 0; c < ordered; c += N)
    for (int l = 0; l < N; ++l) lane[l] = detail::fused_multiply_add(q[c + l], k[c + l], lane[l]);
  for (int c = ordered; c < D; ++c)
    lane[dense_score_lane<T>(c)] =
        detail::fused_multiply_add(q[c], k[c], lane[dense_score_lane<T>(c)]);
  return reduce_lanes(lane);
}

template <class T>
void score_tokens_portable(const dense_kv_source<T>& src, std::int64_t kv_head, const float* q,
                           int heads, std::int64_t t0, std::int64_t t1, const split_scratch& w) {
  const int D = src.head_dim();
  if (src.keys.channel_stride != 1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      const T* k = &src.keys(t, kv_head, 0);
      for (int h = 0; h < heads; ++h)
        w.scores[h * attention_split_tokens + (t - t0)] =
            dense_score(q + h * D, k, src.keys.channel_stride, D);
    }
    return;
  }
  float* row = w.tile;
  for (int h = 0; h < heads; ++h) dense_query_lane_order<T>(q + h * D, D, w.qs + h * D);
  for (std::int64_t t = t0; t < t1; ++t) {
    if (t + dense_prefetch_rows < t1)
      prefetch_lines<2>(&src.keys(t + dense_prefetch_rows, kv_head, 0), D * sizeof(T));
    dense_lane_order(&src.keys(t, kv_head, 0), D, row);
    for (int h = 0; h < heads; ++h)
      w.scores[h * attention_split_tokens + (t - t0)] = dense_score_lanes<T>(w.qs + h * D, row, D);
  }
}

/// acc[h][c] += p[h][i] * rows[i][c] for the n rows of a tile in order, one fused
/// multiply-add each (p: scores, heads attention_split_tokens apart). The sums of
/// HB heads x 16 channels stay in registers over the rows: one pass per block of
/// them, where a loop over rows would load and store every sum once per row.
inline void add_dense_value_tile_portable(float* acc, int heads, int D, const float* p,
                                          const float* rows, std::int64_t n) {
  constexpr int N = attention_reduction_lanes;
  if (D % N != 0) {
    for (std::int64_t i = 0; i < n; ++i)
      for (int h = 0; h < heads; ++h) {
        const float w = p[h * attention_split_tokens + i];
        float* a = acc + h * D;
        for (int c = 0; c < D; ++c) a[c] = detail::fused_multiply_add(w, rows[i * D + c], a[c]);
      }
    return;
  }
  auto pass = [&]<int HB>(int h0, int c0) {
    float sum[HB][N];
    const float* weight[HB];
    for (int b = 0; b < HB; ++b) {
      weight[b] = p + (h0 + b) * attention_split_tokens;
      for (int l = 0; l < N; ++l) sum[b][l] = acc[(h0 + b) * D + c0 + l];
    }
    const float* row = rows + c0;
    for (std::int64_t i = 0; i < n; ++i, row += D) {
      // Unrolled, or GCC keeps sum[][] in memory (an index it does not know).
      // (nvcc's front end does not know the pragma; its host loops are for tests.)
#if defined(__GNUC__) && !defined(__CUDACC__)
#pragma GCC unroll 4
#endif
      for (int b = 0; b < HB; ++b) {
        const float w = weight[b][i];
        for (int l = 0; l < N; ++l) sum[b][l] = detail::fused_multiply_add(w, row[l], sum[b][l]);
      }
    }
    for (int b = 0; b < HB; ++b)
      for (int l = 0; l < N; ++l) acc[(h0 + b) * D + c0 + l] = sum[b][l];
  };
  int h = 0;
  for (; h + 4 <= heads; h += 4)
    for (int c0 = 0; c0 < D; c0 += N) pass.template operator()<4>(h, c0);
  for (; h + 2 <= heads; h += 2)
    for (int c0 = 0; c0 < D; c0 += N) pass.template operator()<2>(h, c0);
  if (h < heads)
    for (int c0 = 0; c0 < D; c0 += N) pass.template operator()<1>(h, c0);
}

/// acc[h][c] = sum_t p[h][t] * v[t][c] over tokens [t0, t1), one fused
/// multiply-add per token in token order starting from 0, rows taken as floats
/// a tile of up to 32 at a time.
template <class T>
void accumulate_values_portable(const dense_kv_source<T>& src, std::int64_t kv_head, int heads,
                                std::int64_t t0, std::int64_t t1, float* acc,
                                const split_scratch& w) {
  const int D = src.head_dim();
  const std::int64_t stride = src.values.channel_stride;
  float* tile = w.tile;  // up to 32 rows as floats
  std::fill(acc, acc + heads * D, 0.0f);
  for (std::int64_t ta = t0; ta < t1; ta += attention_block_tokens) {
    const std::int64_t tz = std::min(ta + attention_block_tokens, t1);
    for (std::int64_t t = ta; t < tz; ++t) {
      const T* v = &src.values(t, kv_head, 0);
      float* row = tile + (t - ta) * D;
      if (stride == 1) {
        if (t + dense_prefetch_rows < t1)
          prefetch_lines<2>(&src.values(t + dense_prefetch_rows, kv_head, 0), D * sizeof(T));
        for (int c = 0; c < D; ++c) row[c] = to_float(v[c]);
      } else {
        for (int c = 0; c < D; ++c) row[c] = to_float(v[c * stride]);
      }
    }
    add_dense_value_tile_portable(acc, heads, D, w.scores + (ta - t0), tile, tz - ta);
  }
}

#if LYNX_ATTENTION_AVX512
/// accumulate_values_portable compiled for AVX2 + FMA: the AVX-512 kernels' loop for
/// the shapes they do not take (same operations, same bits).
template <class Source>
LYNX_ATTENTION_FMA_CLONE LYNX_NOINLINE void accumulate_values_portable_fma(
    const Source& src, std::int64_t kv_head, int heads, std::int64_t t0, std::int64_t t1,
    float* acc, const split_scratch& w) {
  accumulate_values_portable(src, kv_head, heads, t0, t1, acc, w);
}
#endif

/// p = exp2(s2 - m) over n scores, in place.
inline void exp2_shifted_portable(float* s, std::int64_t n, float m) {
  for (std::int64_t i = 0; i < n; ++i) s[i] = attention_exp2(s[i] - m);
}

// ---------------------------------------------------------------------------
// AVX-512 kernels.
// ---------------------------------------------------------------------------
#if LYNX_ATTENTION_AVX512
// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into target functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/// attention_exp2's polynomial (tile_math.hpp), highest degree first: the SIMD
/// kernels evaluate it with the same fused multiply-adds in the same order.
inline constexpr float exp2_poly[8] = {1.5252733804059840e-05f, 1.5403530393381609e-04f,
                                       1.3333558146428443e-03f, 9.6181291076284772e-03f,
                                       5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                       6.9314718055994531e-01f, 1.0f};

LYNX_ATTENTION_AVX512_TARGET inline __m512 exp2_avx512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(exp2_poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_poly[i]));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_maskz_mov_ps(live, n)), _mm512_set1_epi32(127)),
      23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

/// s[i] = exp2(s[i] - m) in place, and returns fixed_order_sum (tile_math.hpp) of
/// the results: its 16 lanes added as each vector is made, then its halving tree
/// (the same adds in the same order as a second pass, without the second pass).
LYNX_ATTENTION_AVX512_TARGET inline float exp2_shifted_sum_avx512(float* s, std::int64_t n,
                                                                  float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lane = _mm512_setzero_ps();
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
    _mm512_storeu_ps(s + i, e);
    lane = _mm512_add_ps(lane, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 e = exp2_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    _mm512_mask_storeu_ps(s + i, k, e);
    lane = _mm512_mask_add_ps(lane, k, lane, e);
  }
  alignas(64) float r[16];
  _mm512_store_ps(r, lane);
  return reduce_lanes(r);
}

/// fold_query_into_key_group for `heads` queries q[h][D] against one key group,
/// 16 channels per step (same operations per lane): the group's scale * unit and
/// scale * half + zero are computed once for all heads, each head's lanes fold by
/// the same halving tree, in registers.
LYNX_ATTENTION_AVX512_TARGET inline void fold_queries_avx512(const float* q, int heads,
                                                             const float* scale, const float* zero,
                                                             int D, float unit, float half,
                                                             float* qs, float* bias) {
  const __m512 u = _mm512_set1_ps(unit), hv = _mm512_set1_ps(half);
  for (int h0 = 0; h0 < heads; h0 += 8) {
    const int hn = heads - h0 < 8 ? heads - h0 : 8;
    __m512 lane[8];  // constant bounds and guards below: the lanes stay in registers
    for (int h = 0; h < 8; ++h) lane[h] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
      const __mmask16 k = D - c >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << (D - c)) - 1u);
      const __m512 sc = _mm512_maskz_loadu_ps(k, scale + c);
      const __m512 su = _mm512_mul_ps(sc, u),
                   off = _mm512_fmadd_ps(sc, hv, _mm512_maskz_loadu_ps(k, zero + c));
#pragma GCC unroll 8
      for (int h = 0; h < 8; ++h) {
        if (h >= hn) break;
        const __m512 qv = _mm512_maskz_loadu_ps(k, q + (h0 + h) * D + c);
        _mm512_mask_storeu_ps(qs + (h0 + h) * D + c, k, _mm512_mul_ps(qv, su));
        lane[h] = _mm512_mask3_fmadd_ps(qv, off, lane[h], k);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < 8; ++h) {  // l += l+8, l += l+4, l += l+2, l += l+1
      if (h >= hn) break;
      __m512 x = lane[h];
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xEE));
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x55));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xEE));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x55));
      bias[h0 + h] = _mm512_cvtss_f32(x);
    }
  }
}

/// Column g of 16 consecutive rows of a [rows][groups] float array (the value
/// parameters of 16 tokens): permutes for 1, 2, 4, 8 groups, a gather otherwise.
LYNX_ATTENTION_AVX512_TARGET inline __m512 group_column_avx512(const float* rows,
                                                               std::int64_t groups, std::int64_t g,
                                                               __m512i stride) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int G = static_cast<int>(groups), gi = static_cast<int>(g);
  switch (G) {
    case 1:
      return _mm512_loadu_ps(rows);
    case 2: {
      const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(lane, 1), _mm512_set1_epi32(gi));
      return _mm512_permutex2var_ps(_mm512_loadu_ps(rows), idx, _mm512_loadu_ps(rows + 16));
    }
    case 4: {
      const __m512i idx =
          _mm512_add_epi32(_mm512_slli_epi32(lane, 2), _mm512_set1_epi32(gi));  // lanes 0-7 valid
      const __m512 a =
          _mm512_permutex2var_ps(_mm512_loadu_ps(rows), idx, _mm512_loadu_ps(rows + 16));
      const __m512 b =
          _mm512_permutex2var_ps(_mm512_loadu_ps(rows + 32), idx, _mm512_loadu_ps(rows + 48));
      return _mm512_shuffle_f32x4(a, b, 0x44);
    }
    case 8: {
      const __m512i idx =
          _mm512_add_epi32(_mm512_slli_epi32(lane, 3), _mm512_set1_epi32(gi));  // lanes 0-3 valid
      __m512 q[4];
      for (int k = 0; k < 4; ++k)
        q[k] = _mm512_permutex2var_ps(_mm512_loadu_ps(rows + 32 * k), idx,
                                      _mm512_loadu_ps(rows + 32 * k + 16));
      const __m512 x = _mm512_shuffle_f32x4(q[0], q[1], 0x00),
                   y = _mm512_shuffle_f32x4(q[2], q[3], 0x00);
      return _mm512_shuffle_f32x4(x, y, 0x88);
    }
    default:
      return _mm512_i32gather_ps(stride, rows + g, 4);
  }
}

/// value_weights_avx512 for heads [h0, h0 + hn) and groups [g0, g0 + gn), hn <= HN, gn <= GN
/// (the loops run to the constants HN, GN, so the lanes stay in registers).
/// The weights of head h, group grp go to row (h - out.h0) * out.groups + grp - out.g0 of out.rows.
struct weight_rows {
  float* rows;
  int h0;
  std::int64_t g0, groups;
};
template <int HN, int GN>
LYNX_ATTENTION_AVX512_TARGET inline void value_weights_tile_avx512(
    const float* vs, const float* vz, std::int64_t groups, int h0, int hn, std::int64_t g0, int gn,
    std::int64_t t0, std::int64_t n, __m512 u, __m512 hv, __m512i stride, const split_scratch& w,
    const weight_rows& out) {
  // local copies: the stores below cannot change them
  const float* const scores = w.scores;
  float* const weights =
      out.rows + ((h0 - out.h0) * out.groups + g0 - out.g0) * attention_split_tokens;
  const std::int64_t out_groups = out.groups;
  __m512 lanes[HN][GN];
  for (int h = 0; h < HN; ++h)
    for (int k = 0; k < GN; ++k) lanes[h][k] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 live =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const bool whole = live == static_cast<__mmask16>(0xFFFF);
    __m512 p[HN];
#pragma GCC unroll 8
    for (int h = 0; h < HN; ++h)
      p[h] = h < hn ? _mm512_maskz_loadu_ps(live, scores + (h0 + h) * attention_split_tokens + i)
                    : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int k = 0; k < GN; ++k) {
      if (k >= gn) break;
      const std::int64_t grp = g0 + k;
      const float* base_s = vs + (t0 + i) * groups + grp;
      const float* base_z = vz + (t0 + i) * groups + grp;
      const __m512 sc =
          whole ? group_column_avx512(base_s - grp, groups, grp, stride)
                : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, stride, base_s, 4);
      const __m512 zr =
          whole ? group_column_avx512(base_z - grp, groups, grp, stride)
                : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, stride, base_z, 4);
      const __m512 su = _mm512_mul_ps(sc, u), off = _mm512_fmadd_ps(sc, hv, zr);
#pragma GCC unroll 8
      for (int h = 0; h < HN; ++h) {
        if (h >= hn) break;
        _mm512_mask_storeu_ps(weights + (h * out_groups + k) * attention_split_tokens + i, live,
                              _mm512_mul_ps(p[h], su));
        lanes[h][k] = _mm512_mask3_fmadd_ps(p[h], off, lanes[h][k], live);  // value_offset_step
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < HN; ++h)
#pragma GCC unroll 8
    for (int k = 0; k < GN; ++k) {  // l += l+8, l += l+4, l += l+2, l += l+1
      if (h >= hn || k >= gn) continue;
      __m512 x = lanes[h][k];
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xEE));
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x55));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xEE));
      x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x55));
      w.offsets[(h0 + h) * groups + g0 + k] = _mm512_cvtss_f32(x);
    }
}

/// True when accumulate_values_avx512 runs the GFNI value kernels (which compute
/// the value weights themselves), false when it runs the portable loop.
template <stream_plan_type Plan, int G>
bool gfni_values(const plane_kv_source<Plan, G>& src) {
  return host_has_gfni() && src.view.geometry.value_group % 16 == 0;
}

/// value_weights_portable for heads [h0, h0 + hn) and groups [g0, g0 + gn), 16
/// tokens per step (same operations per lane), the weights into `out`.
template <class Source>
LYNX_ATTENTION_AVX512_TARGET void value_weights_range_avx512(
    const Source& src, std::int64_t kv_head, int h0, int hn, std::int64_t g0, std::int64_t gn,
    std::int64_t t0, std::int64_t t1, const split_scratch& w, const weight_rows& out) {
  const layer_geometry& g = src.view.geometry;
  const std::int64_t groups = g.value_channel_groups();
  // the GFNI value kernels multiply by prefix << (decoded_bits - P): the weights
  // carry 2^-(decoded_bits - P) (exact, a power of two)
  const int shift = gfni_values(src) ? decoded_bits(src.planes) - src.planes : 0;
  const __m512 u = _mm512_set1_ps(std::ldexp(src.level_unit(), -shift)),
               hv = _mm512_set1_ps(src.half());
  const float* vs = src.view.value_scale() + kv_head * g.tokens * groups;
  const float* vz = src.view.value_zero() + kv_head * g.tokens * groups;
  const __m512i stride =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(groups)));
  const std::int64_t n = t1 - t0;
  // up to 4 heads x 4 groups at a time (the 16 offset lanes stay in registers), else 8 x 8
  // (no dispatch lambda here: a lambda has no target attribute, and the tiles take vectors)
  if (gn == 1 && hn == 4) {  // one pass of the GFNI value kernels
    value_weights_tile_avx512<4, 1>(vs, vz, groups, h0, 4, g0, 1, t0, n, u, hv, stride, w, out);
  } else if (gn == 1 && hn == 2) {
    value_weights_tile_avx512<2, 1>(vs, vz, groups, h0, 2, g0, 1, t0, n, u, hv, stride, w, out);
  } else if (gn == 1 && hn == 1) {
    value_weights_tile_avx512<1, 1>(vs, vz, groups, h0, 1, g0, 1, t0, n, u, hv, stride, w, out);
  } else if (hn <= 4 && gn <= 4) {
    value_weights_tile_avx512<4, 4>(vs, vz, groups, h0, hn, g0, static_cast<int>(gn), t0, n, u, hv,
                                    stride, w, out);
  } else if (hn % 4 == 0 && gn % 4 == 0) {
    for (int h = h0; h < h0 + hn; h += 4)
      for (std::int64_t k = g0; k < g0 + gn; k += 4)
        value_weights_tile_avx512<4, 4>(vs, vz, groups, h, 4, k, 4, t0, n, u, hv, stride, w, out);
  } else {
    for (int h = h0; h < h0 + hn; h += 8)
      for (std::int64_t k = g0; k < g0 + gn; k += 8)
        value_weights_tile_avx512<8, 8>(vs, vz, groups, h, std::min(8, h0 + hn - h), k,
                                        static_cast<int>(std::min<std::int64_t>(8, g0 + gn - k)),
                                        t0, n, u, hv, stride, w, out);
  }
  // tokens past t1 in the last block weigh 0 (the kernels walk whole blocks)
  const std::int64_t end =
      (t1 + attention_block_tokens - 1) / attention_block_tokens * attention_block_tokens;
  for (int h = h0; h < h0 + hn; ++h)
    for (std::int64_t grp = g0; grp < g0 + gn; ++grp)
      for (std::int64_t t = t1; t < end; ++t)
        out.rows[((h - out.h0) * out.groups + grp - out.g0) * attention_split_tokens + (t - t0)] =
            0.0f;
}

/// value_weights_portable: all heads and groups into w.weights.
template <class Source>
LYNX_ATTENTION_AVX512_TARGET void value_weights_avx512(const Source& src, std::int64_t kv_head,
                                                       int heads, std::int64_t t0, std::int64_t t1,
                                                       const split_scratch& w) {
  const std::int64_t groups = src.view.geometry.value_channel_groups();
  value_weights_range_avx512(src, kv_head, 0, heads, 0, groups, t0, t1, w,
                             weight_rows{w.weights, 0, 0, groups});
}

/// Logits to the log2 domain with tokens before first_visible masked; returns the max.
/// Sets `bad` when a visible logit is not finite (NaN or infinite K/V or queries, or
/// an overflow), which the max and exp2 would otherwise pass over silently.
LYNX_ATTENTION_AVX512_TARGET inline float prepare_scores_avx512(float* s, std::int64_t n,
                                                                std::int64_t t0,
                                                                std::int64_t first_visible,
                                                                bool& bad) {
  const __m512 log2e = _mm512_set1_ps(attention_log2e), ninf = _mm512_set1_ps(attention_neg_inf);
  __m512 mx = ninf;
  __mmask16 non_finite = 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 live =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    // visible: t0 + i + lane >= first_visible  <=>  lane >= first_visible - t0 - i
    const std::int64_t need = first_visible - t0 - i;
    const __mmask16 seen =
        need <= 0    ? static_cast<__mmask16>(0xFFFF)
        : need >= 16 ? static_cast<__mmask16>(0)
                     : _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(need)));
    const __m512 x = _mm512_mask_mul_ps(ninf, seen, _mm512_maskz_loadu_ps(live, s + i), log2e);
    _mm512_mask_storeu_ps(s + i, live, x);
    mx = _mm512_mask_max_ps(mx, live, mx, x);
    non_finite |= _mm512_mask_fpclass_ps_mask(live & seen, x, 0x99);  // NaN, +-infinity
  }
  bad = non_finite != 0;
  return _mm512_reduce_max_ps(mx);
}

/// Codes of one key block into tile[c][32] (lane = token), for P planes:
/// plane j's bit of token t is rotated to bit P-1-j and merged.
LYNX_ATTENTION_AVX512_TARGET inline void decode_key_block_avx512(const std::uint32_t* const* rows,
                                                                 int planes, int D, float* tile) {
  __m512i rot[16][2];
  __m512i bit[16];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int j = 0; j < planes; ++j) {
    const int pos = planes - 1 - j;
    rot[j][0] =
        _mm512_and_si512(_mm512_sub_epi32(_mm512_set1_epi32(pos), lane), _mm512_set1_epi32(31));
    rot[j][1] = _mm512_and_si512(_mm512_sub_epi32(_mm512_set1_epi32(pos - 16), lane),
                                 _mm512_set1_epi32(31));
    bit[j] = _mm512_set1_epi32(1 << pos);
  }
  for (int c = 0; c < D; ++c) {
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int j = 0; j < planes; ++j) {
      const __m512i wv = _mm512_set1_epi32(static_cast<int>(rows[j][c]));
      lo = _mm512_ternarylogic_epi32(lo, _mm512_rolv_epi32(wv, rot[j][0]), bit[j], 0xF8);
      hi = _mm512_ternarylogic_epi32(hi, _mm512_rolv_epi32(wv, rot[j][1]), bit[j], 0xF8);
    }
    _mm512_store_ps(tile + c * 32, _mm512_cvtepi32_ps(lo));
    _mm512_store_ps(tile + c * 32 + 16, _mm512_cvtepi32_ps(hi));
  }
}

#define LYNX_ATTENTION_GFNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,gfni,fma")))

/// The words of 16 channels c0..c0+15 of planes [first, first + count)
/// (count <= 8), one register per plane: planes past count and channels past
/// `channels` read as zero.
LYNX_ATTENTION_GFNI_TARGET __attribute__((always_inline)) inline void load_plane_words_gfni(
    const std::uint32_t* const* rows, int first, int count, int c0, int channels, __m512i w[8]) {
  const __mmask16 live = channels >= 16 ? static_cast<__mmask16>(0xFFFF)
                                        : static_cast<__mmask16>((1u << channels) - 1u);
  for (int j = 0; j < 8; ++j)
    w[j] = j >= count       ? _mm512_setzero_si512()
           : channels >= 16 ? _mm512_loadu_si512(rows[first + j] + c0)
                            : _mm512_maskz_loadu_epi32(live, rows[first + j] + c0);
}

/// The first two levels of an 8-register byte transpose: b[p][h][s] interleaves,
/// within each 128-bit lane, the bytes of registers 4p..4p+3 (h: bytes 0-7 or
/// 8-15 of the lane; s: the low or high half of those), 4 bytes (one per
/// register) per dword.
LYNX_ATTENTION_GFNI_TARGET __attribute__((always_inline)) inline void interleave_bytes_of_8(
    const __m512i x[8], __m512i b[2][2][2]) {
  __m512i a[4][2];
  for (int p = 0; p < 4; ++p) {
    a[p][0] = _mm512_unpacklo_epi8(x[2 * p], x[2 * p + 1]);
    a[p][1] = _mm512_unpackhi_epi8(x[2 * p], x[2 * p + 1]);
  }
  for (int p = 0; p < 2; ++p)
    for (int h = 0; h < 2; ++h) {
      b[p][h][0] = _mm512_unpacklo_epi16(a[2 * p][h], a[2 * p + 1][h]);
      b[p][h][1] = _mm512_unpackhi_epi16(a[2 * p][h], a[2 * p + 1][h]);
    }
}

/// Codes of one 32-token block, 16 channels at a time, by bit-matrix transposes:
/// the plane words of 16 channels (one zmm per plane) are byte-transposed so each
/// qword holds one byte (8 tokens) of 8 planes; GF2P8AFFINEQB transposes each
/// 8x8 bit matrix, giving one byte per token with plane 0 in the top bit
/// (= prefix << (8 - planes) for up to 8 planes). Planes 8..15 make a low byte.
/// `channels` (1..16) of the 16 are read (head_dims that are not multiples of 16):
/// the others transpose as zero words and their codes are never used.
LYNX_ATTENTION_GFNI_TARGET __attribute__((always_inline)) inline void transpose_planes_gfni(
    const std::uint32_t* const* rows, int first, int count, int c0, int channels,
    __m512i out[2][2][2]) {
  __m512i wv[8];
  load_plane_words_gfni(rows, first, count, c0, channels, wv);
  __m512i bq[2][2][2];
  interleave_bytes_of_8(wv, bq);
  const __m512i tokens = _mm512_set1_epi64(static_cast<long long>(0x8040201008040201ull));
  for (int s1 = 0; s1 < 2; ++s1)
    for (int s2 = 0; s2 < 2; ++s2) {
      // qword g of lane L: byte 8*s1 + 4*s2 + 2*s3 + g of the lane = channel 4L + 2*s1 + s2, token
      // byte 2*s3 + g
      out[s1][s2][0] = _mm512_gf2p8affine_epi64_epi8(
          tokens, _mm512_unpacklo_epi32(bq[0][s1][s2], bq[1][s1][s2]), 0);
      out[s1][s2][1] = _mm512_gf2p8affine_epi64_epi8(
          tokens, _mm512_unpackhi_epi32(bq[0][s1][s2], bq[1][s1][s2]), 0);
    }
}

#define LYNX_ATTENTION_GFNI_INLINE LYNX_ATTENTION_GFNI_TARGET __attribute__((always_inline)) inline

/// Byte-index vectors that zero-extend token bytes to dwords: zext[L] picks
/// byte 16 L + i / 4 into dword i (with the low_bytes mask below).
LYNX_ATTENTION_GFNI_INLINE void token_byte_zext_gfni(__m512i zext[4]) {
  for (int L = 0; L < 4; ++L)
    zext[L] = _mm512_add_epi8(
        _mm512_set1_epi8(static_cast<char>(16 * L)),
        _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12, 11, 11, 11,
                        11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5,
                        5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
}
inline constexpr __mmask64 gfni_low_bytes = 0x1111111111111111ull;
inline constexpr __mmask64 gfni_two_low_bytes = 0x3333333333333333ull;

/// Codes of `cn` (<= 16) channels c0 + i of one block, as floats (lane = token,
/// k[i][0]: tokens 0-15, k[i][1]: tokens 16-31), each channel handed to `use(i, k)`
/// in channel order. Two: more than 8 planes (a low byte too). cn is a constant
/// in the full-chunk calls, so the loops unroll and the bounds fold away.
template <bool Two, class Use>
LYNX_ATTENTION_GFNI_INLINE void decode_chunk_gfni(const std::uint32_t* const* rows, int planes,
                                                  int c0, int cn, const __m512i zext[4],
                                                  Use&& use) {
  __m512i hi[2][2][2], lo[2][2][2];
  transpose_planes_gfni(rows, 0, Two ? 8 : planes, c0, cn, hi);
  if constexpr (Two) transpose_planes_gfni(rows, 8, planes - 8, c0, cn, lo);
#pragma GCC unroll 4
  for (int L = 0; L < 4; ++L)
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      if (4 * L + m >= cn) return;
      __m512 k[2];
      for (int s3 = 0; s3 < 2; ++s3) {
        __m512i code;
        if constexpr (Two)  // one two-source permute: byte 0 from lo, byte 1 (index + 64) from hi
          code = _mm512_maskz_permutex2var_epi8(gfni_two_low_bytes, lo[m >> 1][m & 1][s3],
                                                _mm512_or_si512(zext[L], _mm512_set1_epi32(0x4000)),
                                                hi[m >> 1][m & 1][s3]);
        else
          code = _mm512_maskz_permutexvar_epi8(gfni_low_bytes, zext[L], hi[m >> 1][m & 1][s3]);
        k[s3] = _mm512_cvtepi32_ps(code);
      }
      use(4 * L + m, k);
    }
}

/// Codes of 16 channels x 32 tokens, rows[i] = channel i (16-bit codes, lane =
/// token), stored token-major: out[t * D + i] for i < cn. Three unpack levels
/// leave in 128-bit lane L of x[n][s] channels 8n..8n+7 of token 8L + s; a
/// two-source permute pairs the channel halves of a token, one 256-bit store each.
template <class Code>
LYNX_ATTENTION_GFNI_INLINE void store_transposed_16x32(const __m512i r[16], int cn, std::int64_t D,
                                                       Code* out) {
  __m512i a[8], b[8], c[4], d[4], e[4], f[4], x[2][8];
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm512_unpacklo_epi16(r[2 * j], r[2 * j + 1]);  // lane L: tokens 8L..8L+3
    b[j] = _mm512_unpackhi_epi16(r[2 * j], r[2 * j + 1]);  // tokens 8L+4..8L+7
  }
  for (int m = 0; m < 4; ++m) {
    c[m] = _mm512_unpacklo_epi32(a[2 * m], a[2 * m + 1]);  // qword q: token 8L+q
    d[m] = _mm512_unpackhi_epi32(a[2 * m], a[2 * m + 1]);  // 8L+2+q
    e[m] = _mm512_unpacklo_epi32(b[2 * m], b[2 * m + 1]);  // 8L+4+q
    f[m] = _mm512_unpackhi_epi32(b[2 * m], b[2 * m + 1]);  // 8L+6+q
  }
  for (int n = 0; n < 2; ++n) {
    x[n][0] = _mm512_unpacklo_epi64(c[2 * n], c[2 * n + 1]);
    x[n][1] = _mm512_unpackhi_epi64(c[2 * n], c[2 * n + 1]);
    x[n][2] = _mm512_unpacklo_epi64(d[2 * n], d[2 * n + 1]);
    x[n][3] = _mm512_unpackhi_epi64(d[2 * n], d[2 * n + 1]);
    x[n][4] = _mm512_unpacklo_epi64(e[2 * n], e[2 * n + 1]);
    x[n][5] = _mm512_unpackhi_epi64(e[2 * n], e[2 * n + 1]);
    x[n][6] = _mm512_unpacklo_epi64(f[2 * n], f[2 * n + 1]);
    x[n][7] = _mm512_unpackhi_epi64(f[2 * n], f[2 * n + 1]);
  }
  // [x0 lane 0, x1 lane 0, x0 lane 1, x1 lane 1] and the same for lanes 2, 3
  const __m512i lanes01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i lanes23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __mmask16 live =
      cn >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cn) - 1u);
  for (int s = 0; s < 8; ++s) {
    const __m512i p01 = _mm512_permutex2var_epi64(x[0][s], lanes01, x[1][s]);
    const __m512i p23 = _mm512_permutex2var_epi64(x[0][s], lanes23, x[1][s]);
    const __m256i tok[4] = {_mm512_castsi512_si256(p01), _mm512_extracti64x4_epi64(p01, 1),
                            _mm512_castsi512_si256(p23), _mm512_extracti64x4_epi64(p23, 1)};
    for (int L = 0; L < 4; ++L) {  // token 8L + s
      Code* o = out + (8 * L + s) * D;
      if constexpr (sizeof(Code) == 1)
        _mm_mask_storeu_epi8(o, live, _mm256_cvtepi16_epi8(tok[L]));
      else
        _mm256_mask_storeu_epi16(o, live, tok[L]);
    }
  }
}

/// The codes of one 32-token block of Bits planes (all of them) as integers, for
/// code_tensor: out[c][32] (lane = token, Transposed false) or out[t][D]
/// (Transposed true). Padding tokens decode as 0 (their plane bits are 0).
template <int Bits, bool Transposed, class Code>
LYNX_ATTENTION_GFNI_TARGET void block_codes_gfni(const std::uint32_t* const* rows, int D,
                                                 Code* out) {
  constexpr bool Two = Bits > 8;
  constexpr int shift = (Two ? 16 : 8) - Bits;  // the decoder gives code << shift
  __m512i zext[4];
  token_byte_zext_gfni(zext);
  struct store {
    Code* dst;      // [c][32] (not transposed)
    __m512i* regs;  // [16]: channel i's 32 codes as 16-bit lanes (transposed)
    LYNX_ATTENTION_GFNI_INLINE void operator()(int i, const __m512* k) const {
      const __m512i lo = _mm512_srli_epi32(_mm512_cvttps_epi32(k[0]), shift),
                    hi = _mm512_srli_epi32(_mm512_cvttps_epi32(k[1]), shift);
      if constexpr (Transposed) {
        regs[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                     _mm512_cvtepi32_epi16(hi), 1);
      } else if constexpr (sizeof(Code) == 1) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * 32), _mm512_cvtepi32_epi8(lo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * 32 + 16), _mm512_cvtepi32_epi8(hi));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * 32), _mm512_cvtepi32_epi16(lo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * 32 + 16),
                            _mm512_cvtepi32_epi16(hi));
      }
    }
  };
  __m512i regs[16];
  for (int i = 0; i < 16; ++i) regs[i] = _mm512_setzero_si512();
  for (int c0 = 0; c0 < D; c0 += 16) {
    const int cn = D - c0 < 16 ? D - c0 : 16;
    const store st{out + c0 * 32, regs};
    if (cn == 16)
      decode_chunk_gfni<Two>(rows, Bits, c0, 16, zext, st);
    else
      decode_chunk_gfni<Two>(rows, Bits, c0, cn, zext, st);
    if constexpr (Transposed) store_transposed_16x32(regs, cn, D, out + c0);
  }
}

/// Scores of HC heads against one key block, decoding 16 channels at a time in
/// registers (no tile in memory) and multiplying right away; each head's two
/// token halves accumulate in channel order, exactly as score_block_avx512.
/// Any head_dim: a last chunk of D % 16 channels reads only those channels.
/// Two: more than 8 planes. `walk` steps Lines lines every other channel, into
/// the cache level of Hint.
template <int HC, bool Two, int Lines, int Hint>
LYNX_ATTENTION_GFNI_TARGET inline void score_block_fused_gfni(const std::uint32_t* const* rows,
                                                              int planes, int D, const float* qs,
                                                              const float* bias, float* out,
                                                              prefetch_walk& walk_io) {
  prefetch_walk walk = walk_io;  // a local copy: its cursor stays in registers
  __m512i zext[4];
  token_byte_zext_gfni(zext);
  __m512 a[HC][2];
  for (int h = 0; h < HC; ++h) a[h][0] = a[h][1] = _mm512_setzero_ps();
  struct accumulate {
    const float* const* qh;  // head h's query at channel c0
    __m512 (*a)[2];
    prefetch_walk& walk;
    LYNX_ATTENTION_GFNI_INLINE void operator()(int i, const __m512* k) const {
      if (i % 2 == 0) walk.step<Lines, Hint>();
      for (int h = 0; h < HC; ++h) {
        const __m512 qv = _mm512_set1_ps(qh[h][i]);
        a[h][0] = _mm512_fmadd_ps(qv, k[0], a[h][0]);
        a[h][1] = _mm512_fmadd_ps(qv, k[1], a[h][1]);
      }
    }
  };
  // one pointer per head, advanced by 16 channels per chunk: the broadcasts
  // address a register plus a constant
  const float* qh[HC];
  for (int h = 0; h < HC; ++h) qh[h] = qs + h * D;
  int c0 = 0;
  for (; c0 + 16 <= D; c0 += 16) {
    decode_chunk_gfni<Two>(rows, planes, c0, 16, zext, accumulate{qh, a, walk});
    for (int h = 0; h < HC; ++h) qh[h] += 16;
  }
  if (c0 < D) decode_chunk_gfni<Two>(rows, planes, c0, D - c0, zext, accumulate{qh, a, walk});
  for (int h = 0; h < HC; ++h) {
    const __m512 b = _mm512_set1_ps(bias[h]);
    _mm512_storeu_ps(out + h * attention_split_tokens, _mm512_add_ps(a[h][0], b));
    _mm512_storeu_ps(out + h * attention_split_tokens + 16, _mm512_add_ps(a[h][1], b));
  }
  walk_io = walk;
}

/// Plane matrices of one 32-token block for 16 channels c0..c0+15 from x[j], the
/// words of 16 channels of plane j (j < count <= 8; x[j] for j >= count is zero;
/// x is clobbered): m[2 o + u], qword (L, q) holds in byte j word j's bits of
/// tokens 8o..8o+7 (bit i = token 8o + i) for channel c0 + 4L + 2u + q.
///   1. a byte shuffle per plane puts each 128-bit lane in octet-major order
///      (byte 4o + c' = byte o of channel 4L + c');
///   2. three unpack levels gather the 8 planes' bytes of one (octet, channel).
/// GF2P8AFFINEQB with one bit per byte of its first operand then reads the
/// codes of chosen tokens out of each matrix (token_pair_pick_gfni).
LYNX_ATTENTION_GFNI_INLINE void plane_matrices_of_words_gfni(__m512i x[8], int count,
                                                             __m512i m[8]) {
  const __m512i octet_major =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  for (int j = 0; j < 8; ++j)
    if (j < count) x[j] = _mm512_shuffle_epi8(x[j], octet_major);
  __m512i b[2][2][2];
  interleave_bytes_of_8(x, b);
  // b[.][h][s] holds lane bytes 8h + 4s .. 8h + 4s + 3 = octet 2h + s, channels 4L + 0..3
  for (int h = 0; h < 2; ++h)
    for (int s2 = 0; s2 < 2; ++s2) {
      m[2 * (2 * h + s2)] = _mm512_unpacklo_epi32(b[0][h][s2], b[1][h][s2]);
      m[2 * (2 * h + s2) + 1] = _mm512_unpackhi_epi32(b[0][h][s2], b[1][h][s2]);
    }
}

/// plane_matrices_of_words_gfni of planes [0, count) read from rows (channels past
/// `channels` read as zero words).
LYNX_ATTENTION_GFNI_INLINE void plane_matrices_gfni(const std::uint32_t* const* rows, int count,
                                                    int c0, int channels, __m512i m[8]) {
  __m512i x[8];
  load_plane_words_gfni(rows, 0, count, c0, channels, x);
  plane_matrices_of_words_gfni(x, count, m);
}

/// For more than 8 planes: plane matrices of 4 tokens and 16 planes, m[2 o + u] for
/// tokens 8o..8o+3 and n[2 o + u] for tokens 8o+4..8o+7 (o, u, qwords as in
/// plane_matrices_of_words_gfni): byte j holds plane j's bits of the 4 tokens in its low
/// nibble and plane j + 8's in its high nibble. One GF2P8AFFINEQB then reads both
/// bytes of a token's code at once (token_pair_pick_two_gfni), where two 8-plane
/// matrices need one each and an OR: half the picks for two shifts and two bit
/// selects per plane pair and block. Planes past `planes` read as zero.
/// Measured on AMD Zen 4 (all planes of 16 = 4 + 12, 32K tokens, one thread): the
/// value kernel's samples per call 11% fewer, the attention 13.2 -> 13.0 ms (min of
/// alternating rounds; the machine's noise is about as large).
LYNX_ATTENTION_GFNI_INLINE void nibble_plane_matrices_gfni(const std::uint32_t* const* rows,
                                                           int planes, int c0, int channels,
                                                           __m512i m[8], __m512i n[8]) {
  __m512i hi[8], lo[8], x[8], y[8];
  load_plane_words_gfni(rows, 0, 8, c0, channels, hi);
  load_plane_words_gfni(rows, 8, planes - 8, c0, channels, lo);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 8; ++j) {  // ternary logic 0xE4: third operand ? first : second
    x[j] = _mm512_ternarylogic_epi32(hi[j], _mm512_slli_epi32(lo[j], 4), low_nibbles, 0xE4);
    y[j] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(hi[j], 4), lo[j], low_nibbles, 0xE4);
  }
  plane_matrices_of_words_gfni(x, 8, m);
  plane_matrices_of_words_gfni(y, 8, n);
}

/// First operand of GF2P8AFFINEQB that reads tokens 2i and 2i + 1 of an octet
/// out of every plane matrix: their codes land in the low bytes of the qword's
/// two dwords (plane 0 in the top bit), the other bytes are 0.
LYNX_ATTENTION_GFNI_INLINE __m512i token_pair_pick_gfni(int i) {
  return _mm512_set1_epi64(static_cast<long long>((1ull << (2 * i)) | (1ull << (2 * i + 1 + 32))));
}

/// First operand of GF2P8AFFINEQB that reads tokens 2k and 2k + 1 (k: 0, 1) of a
/// nibble plane matrix (nibble_plane_matrices_gfni): each token's 16-bit code in
/// its dword, planes 8..15 in byte 0 (bits 2k + 4, 2k + 5 of the matrix bytes) and
/// planes 0..7 in byte 1 (bits 2k, 2k + 1), plane 0 in the top bit.
LYNX_ATTENTION_GFNI_INLINE __m512i token_pair_pick_two_gfni(int k) {
  const std::uint64_t t0 = (1ull << (2 * k + 4)) | (1ull << (2 * k + 8)),
                      t1 = (1ull << (2 * k + 5)) | (1ull << (2 * k + 9));
  return _mm512_set1_epi64(static_cast<long long>(t0 | t1 << 32));
}

/// Adds the value blocks [b0, b0 + nblocks) of NC chunks of 16 channels
/// (c0 + 16 n) to the sums of HC heads, two tokens per step: a register holds
/// 8 channels x (token t, token t + 1), multiplied by the weights (w[t],
/// w[t + 1]) broadcast as a pair, so each channel keeps two sums, over even
/// and over odd tokens, each in token order; they are added at the end, as in
/// accumulate_values_portable. Lanes: dword 4L + 2q + d of sum[h][n][u] is
/// channel c0 + 16 n + 4L + 2u + q, token parity d.
/// weights: [HC][groups][S] (groups g_base, g_base + 1, ...) at the first block's first
/// token, already times 2^-(decoded_bits - P) (the codes here are prefix << (decoded_bits - P)).
/// rows0[j]: plane j's words of the first block; stride[j]: words to the next block.
/// OneGroup: the NC chunks lie in one value group, so each head's weights are
/// broadcast once per step for all of them (the same values, the same bits).
/// `walk` steps Lines lines per token pair, into the cache level of Hint.
template <int HC, int NC, bool TwoBytes, bool OneGroup, int Lines, int Hint>
LYNX_ATTENTION_GFNI_TARGET void add_values_pairs_gfni(
    const std::uint32_t* const* rows0, const std::int64_t* stride, std::int64_t nblocks, int planes,
    int c0, int channels, std::int64_t VG, const float* weights, std::int64_t groups,
    std::int64_t g_base, std::int64_t head_stride /*floats between heads in acc*/, float* acc,
    prefetch_walk& walk_io) {
  prefetch_walk walk = walk_io;  // a local copy: its cursor stays in registers
  __m512 sum[HC][NC][2];
  for (int h = 0; h < HC; ++h)
    for (int n = 0; n < NC; ++n) sum[h][n][0] = sum[h][n][1] = _mm512_setzero_ps();
  const float* wn[HC][NC];
  for (int h = 0; h < HC; ++h)
    for (int n = 0; n < NC; ++n)
      wn[h][n] = weights + (h * groups + (c0 + 16 * n) / VG - g_base) * attention_split_tokens;
  __m512i pick[4];
  for (int i = 0; i < 4; ++i)
    pick[i] = TwoBytes ? token_pair_pick_two_gfni(i & 1) : token_pair_pick_gfni(i);
  auto pair_weights = [](const float* w) {  // (w[0], w[1]) in every qword
    double d;
    std::memcpy(&d, w, sizeof d);
    return d;
  };
  const std::uint32_t* rows[16];
  for (std::int64_t k = 0; k < nblocks; ++k) {
    for (int j = 0; j < planes; ++j) rows[j] = rows0[j] + k * stride[j];
    // TwoBytes: hi holds the nibble matrices of tokens 0-3 of each octet, lo of tokens 4-7
    __m512i hi[NC][8], lo[TwoBytes ? NC : 1][8];
    for (int n = 0; n < NC; ++n) {
      const int cn = channels - 16 * n;
      if constexpr (TwoBytes)
        nibble_plane_matrices_gfni(rows, planes, c0 + 16 * n, cn, hi[n], lo[n]);
      else
        plane_matrices_gfni(rows, planes, c0 + 16 * n, cn, hi[n]);
    }
    const std::int64_t tb = k * attention_block_tokens;
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int t = 8 * o + 2 * i;
        walk.step<Lines, Hint>();
        __m512 code[NC][2];
        for (int n = 0; n < NC; ++n)
          for (int u = 0; u < 2; ++u) {
            __m512i x;
            if constexpr (TwoBytes)  // a token's 16-bit code in one pick
              x = _mm512_gf2p8affine_epi64_epi8(pick[i],
                                                i < 2 ? hi[n][2 * o + u] : lo[n][2 * o + u], 0);
            else
              x = _mm512_gf2p8affine_epi64_epi8(pick[i], hi[n][2 * o + u], 0);
            code[n][u] = _mm512_cvtepi32_ps(x);
          }
        for (int h = 0; h < HC; ++h) {
          if constexpr (OneGroup) {
            const __m512 wv = _mm512_castpd_ps(_mm512_set1_pd(pair_weights(wn[h][0] + tb + t)));
            for (int n = 0; n < NC; ++n)
              for (int u = 0; u < 2; ++u)
                sum[h][n][u] = _mm512_fmadd_ps(wv, code[n][u], sum[h][n][u]);
          } else {
            for (int n = 0; n < NC; ++n) {
              const __m512 wv = _mm512_castpd_ps(_mm512_set1_pd(pair_weights(wn[h][n] + tb + t)));
              for (int u = 0; u < 2; ++u)
                sum[h][n][u] = _mm512_fmadd_ps(wv, code[n][u], sum[h][n][u]);
            }
          }
        }
      }
  }
  // channel 4L + 2u + q: even-token sum (lane 4L + 2q of sum[u]) + odd-token sum (lane + 1)
  const __m512i even = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int h = 0; h < HC; ++h)
    for (int n = 0; n < NC; ++n) {
      const int cn = channels - 16 * n;
      if (cn <= 0) continue;
      const __m512 v = _mm512_add_ps(_mm512_permutex2var_ps(sum[h][n][0], even, sum[h][n][1]),
                                     _mm512_permutex2var_ps(sum[h][n][0], odd, sum[h][n][1]));
      float* o = acc + h * head_stride + c0 + 16 * n;
      if (cn >= 16)
        _mm512_storeu_ps(o, v);
      else
        _mm512_mask_storeu_ps(o, static_cast<__mmask16>((1u << cn) - 1u), v);
    }
  walk_io = walk;
}

/// 16 consecutive codes as floats (exact: codes are below 2^16), or 16 floats.
template <class Code>
LYNX_ATTENTION_AVX512_TARGET __attribute__((always_inline)) inline __m512 load16_codes_avx512(
    const Code* p) {
  if constexpr (std::is_same_v<Code, float>)
    return _mm512_loadu_ps(p);
  else if constexpr (sizeof(Code) == 1)
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  else
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

/// Scores of HC heads against one block of key codes kb[c][32] (lane = token;
/// stored codes, or floats of codes decoded into a tile): each head's two token
/// halves accumulate in channel order from 0, then the bias is added.
/// Lines > 0: `walk` steps Lines lines per channel, into the cache level of
/// Hint, and the next block's codes are asked into L1.
template <int HC, int Lines, int Hint, class Code>
LYNX_ATTENTION_AVX512_TARGET inline void score_code_block_avx512(const Code* kb, int D,
                                                                 const float* qs, const float* bias,
                                                                 float* out,
                                                                 prefetch_walk& walk_io) {
  prefetch_walk walk = walk_io;  // a local copy: its cursor stays in registers
  // the next block's codes into L1 (from L2, where the previous split's value
  // pass asked for them), one line per channel step
  const char* next = reinterpret_cast<const char*>(kb + D * 32);
  const int next_lines = D * 32 * static_cast<int>(sizeof(Code)) / 64;
  __m512 a[HC][2];
  for (int h = 0; h < HC; ++h) a[h][0] = a[h][1] = _mm512_setzero_ps();
  for (int c = 0; c < D; ++c) {
    if constexpr (Lines > 0) {
      walk.step<Lines, Hint>();
      if (c < next_lines) _mm_prefetch(next + 64 * c, _MM_HINT_T0);
    }
    const __m512 k0 = load16_codes_avx512(kb + c * 32), k1 = load16_codes_avx512(kb + c * 32 + 16);
    for (int h = 0; h < HC; ++h) {
      const __m512 qv = _mm512_set1_ps(qs[h * D + c]);
      a[h][0] = _mm512_fmadd_ps(qv, k0, a[h][0]);
      a[h][1] = _mm512_fmadd_ps(qv, k1, a[h][1]);
    }
  }
  for (int h = 0; h < HC; ++h) {
    const __m512 b = _mm512_set1_ps(bias[h]);
    _mm512_storeu_ps(out + h * attention_split_tokens, _mm512_add_ps(a[h][0], b));
    _mm512_storeu_ps(out + h * attention_split_tokens + 16, _mm512_add_ps(a[h][1], b));
  }
  walk_io = walk;
}

/// Scores of HC heads against a block decoded into tile[c][32] (floats).
template <int HC>
LYNX_ATTENTION_AVX512_TARGET inline void score_block_avx512(const float* tile, int D,
                                                            const float* qs, const float* bias,
                                                            float* out) {
  prefetch_walk none;
  score_code_block_avx512<HC, 0, 3>(tile, D, qs, bias, out, none);
}

/// The folded queries (fold_queries_avx512) of a kv head's key groups, two at a
/// time in slots grp & 1 of w.qs and w.bias: the next group's is folded before
/// the current block is scored, so its stores have reached L1 when the block's
/// broadcasts read them.
struct key_group_folds {
  const float* q;
  int heads, D;
  float unit, half;
  const float *scale, *zero;  // the layer's key parameters
  std::int64_t first_group;   // kv_head * key_token_groups
  const split_scratch& w;
  std::int64_t folded[2] = {-1, -1};
  LYNX_ATTENTION_AVX512_TARGET void operator()(std::int64_t grp) {
    const int slot = static_cast<int>(grp & 1);
    if (folded[slot] == grp) return;
    const std::int64_t base = (first_group + grp) * D;
    fold_queries_avx512(q, heads, scale + base, zero + base, D, unit, half, w.qs + slot * heads * D,
                        w.bias + slot * heads);
    folded[slot] = grp;
  }
};

template <stream_plan_type Plan, int G>
LYNX_ATTENTION_AVX512_TARGET void score_tokens_avx512(const plane_kv_source<Plan, G>& src,
                                                      std::int64_t kv_head, const float* q,
                                                      int heads, std::int64_t t0, std::int64_t t1,
                                                      const split_scratch& w,
                                                      const next_split& next = {}) {
  const int nb = static_cast<int>((t1 + attention_block_tokens - 1) / attention_block_tokens -
                                  t0 / attention_block_tokens);
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  // the tile holds prefix << shift: fold 2^-shift into the query (exact, a power of two)
  const bool gfni = host_has_gfni();
  const int shift = gfni ? decoded_bits(src.planes) - src.planes : 0;
  const float unit = std::ldexp(src.level_unit(), -shift), half = src.half();
  const std::uint32_t* rows[16];
  key_group_folds fold{q,
                       heads,
                       D,
                       unit,
                       half,
                       src.view.key_scale(),
                       src.view.key_zero(),
                       kv_head * g.key_token_groups(),
                       w};
  // The GFNI path asks for this split's values (walked after the scores) while
  // it scores (see score_block_fused_gfni); accumulate_values_avx512 then asks
  // for the next split's keys. The other path asks L2 for both in slices.
  prefetch_walk walk;
  if (gfni) src.walk_split(walk, false, kv_head, t0, t1);
  // lines per step (one step per two channels of each 8 heads' pass) to finish
  // the walk within this split; the one-byte kernels take 1 or 2 (2: 5 to 8
  // planes, whose values outnumber the steps), the two-byte ones 3
  const int walk_lines = walk_step_lines(walk, nb * ((heads + 7) / 8) * ((D + 15) / 16 * 8));
  for (std::int64_t b = t0 / attention_block_tokens; b * attention_block_tokens < t1; ++b) {
    const std::int64_t tb = b * attention_block_tokens;
    const std::int64_t grp = tb / G;  // G % 32 == 0: one key group per block
    fold(grp);
    if (tb + attention_block_tokens < t1) fold((tb + attention_block_tokens) / G);
    const float* qs = w.qs + (grp & 1) * heads * D;
    const float* bias = w.bias + (grp & 1) * heads;
    if (!gfni) {
      const int part = static_cast<int>(b - t0 / attention_block_tokens);
      src.prefetch_split_slice(false, kv_head, t0, t1, part, nb);
      if (next.t1 > next.t0)
        src.prefetch_split_slice(true, next.kv_head, next.t0, next.t1, part, nb);
    }
    src.prefetch_block(true, kv_head, b + prefetch_blocks);
    if (b + prefetch_blocks < g.blocks()) {  // the key parameters of that block's group
      const std::int64_t pf =
          (kv_head * g.key_token_groups() + (b + prefetch_blocks) * attention_block_tokens / G) * D;
      prefetch_lines<3>(src.view.key_scale() + pf, D * 4);
      prefetch_lines<3>(src.view.key_zero() + pf, D * 4);
    }
    src.block_rows(true, kv_head, b, rows);
    float* out = w.scores + (tb - t0);
    if (gfni) {  // the GFNI decoder: fused, 8 heads at a time
      for (int h = 0; h < heads; h += 8)
        dispatch<1, 2, 3, 4, 5, 6, 7, 8>(std::min(8, heads - h), [&]<int HC>() {
          float* o = out + h * attention_split_tokens;
          with_walk_hint([&]<int Hint>() {
            if (src.planes > 8)
              score_block_fused_gfni<HC, true, 3, Hint>(rows, src.planes, D, qs + h * D, bias + h,
                                                        o, walk);
            else if (walk_lines <= 1)
              score_block_fused_gfni<HC, false, 1, Hint>(rows, src.planes, D, qs + h * D, bias + h,
                                                         o, walk);
            else
              score_block_fused_gfni<HC, false, 2, Hint>(rows, src.planes, D, qs + h * D, bias + h,
                                                         o, walk);
          });
        });
      continue;
    }
    decode_key_block_avx512(rows, src.planes, D, w.tile);  // codes = prefix (shift 0)
    for (int h = 0; h < heads; h += 4)
      dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
        score_block_avx512<HC>(w.tile, D, qs + h * D, bias + h, out + h * attention_split_tokens);
      });
  }
}

/// Values over tokens [t0, t1) (see accumulate_values_portable): the GFNI
/// kernels where the CPU has them and a chunk of 16 channels lies in one value
/// group, else the portable loop (same operations, same bits).
template <stream_plan_type Plan, int G>
LYNX_ATTENTION_AVX512_TARGET void accumulate_values_avx512(const plane_kv_source<Plan, G>& src,
                                                           std::int64_t kv_head, int heads,
                                                           std::int64_t t0, std::int64_t t1,
                                                           float* acc, const split_scratch& w,
                                                           const next_split& next = {}) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t groups = g.value_channel_groups(), VG = g.value_group;
  if (!gfni_values(src)) {  // the weights are in w.weights (compute_split)
    accumulate_values_portable_fma(src, kv_head, heads, t0, t1, acc, w);
    return;
  }
  const std::int64_t b0 = t0 / attention_block_tokens,
                     nblocks = (t1 + attention_block_tokens - 1) / attention_block_tokens - b0;
  const std::uint32_t* rows[16];
  const std::uint32_t* second[16];
  std::int64_t stride[16] = {};
  src.block_rows(false, kv_head, b0, rows);
  if (nblocks > 1) {  // blocks of a kv head are evenly spaced in each stream's section
    src.block_rows(false, kv_head, b0 + 1, second);
    for (int j = 0; j < src.planes; ++j) stride[j] = second[j] - rows[j];
  }
  for (std::int64_t k = 0; k < prefetch_blocks && k < nblocks; ++k)
    src.prefetch_block(false, kv_head, b0 + k);
  const bool two = src.planes > 8;
  prefetch_walk walk;  // the next split's keys, stepped by the passes below
  src.walk_split(walk, true, next.kv_head, next.t0, next.t1);
  // a step per two tokens of each pass (4 heads x 32 channels, or fewer heads x 64)
  const int walk_lines = walk_step_lines(
      walk, nblocks * attention_block_tokens / 2 * ((heads + 3) / 4) * ((D + 31) / 32));
  // The weights of a pass's heads and groups are computed right before it, into
  // rows [heads of the pass][its groups] at the start of w.weights (at most 16
  // KiB for 4 heads and one group), so they are written and read in L1.
  int have_h0 = -1;
  std::int64_t have_g0 = -1, have_gn = 0;
  for (int h0 = 0; h0 < heads;) {
    // 4, 2 or 1 heads at a time, with 32 (4 heads) or 64 channels per pass where the head_dim
    // allows (at least 8 independent sums), else 16
    const int hc = heads - h0 >= 4 ? 4 : heads - h0 >= 2 ? 2 : 1;
    float* ah = acc + h0 * D;
    dispatch<1, 2, 4>(hc, [&]<int HC>() {
      constexpr int NC = HC == 4 ? 2 : 4;
      // c0 steps in the loop head (clang's -Wall reads a loop whose counter only a
      // lambda moves as one that never ends) by the channels of the pass taken.
      for (int c0 = 0, step = 0; c0 < D; c0 += step) {
        const int rest = D - c0;
        step = rest >= 16 * NC ? 16 * NC : 16;
        auto pass = [&]<int N>() {
          const std::int64_t g_lo = c0 / VG, g_hi = (std::min(D, c0 + 16 * N) - 1) / VG;
          if (have_h0 != h0 || g_lo < have_g0 || g_hi >= have_g0 + have_gn) {
            value_weights_range_avx512(src, kv_head, h0, HC, g_lo, g_hi - g_lo + 1, t0, t1, w,
                                       weight_rows{w.weights, h0, g_lo, g_hi - g_lo + 1});
            have_h0 = h0, have_g0 = g_lo, have_gn = g_hi - g_lo + 1;
          }
          const float* wh = w.weights + (b0 * attention_block_tokens - t0);
          const bool one_group = N > 1 && c0 % (16 * N) == 0 && VG % (16 * N) == 0;
          auto run = [&]<bool Two, bool One, int Lines>() {
            with_walk_hint([&]<int Hint>() {
              add_values_pairs_gfni<HC, N, Two, One, Lines, Hint>(rows, stride, nblocks, src.planes,
                                                                  c0, rest, VG, wh, have_gn,
                                                                  have_g0, D, ah, walk);
            });
          };
          if (two)
            one_group ? run.template operator()<true, true, 3>()
                      : run.template operator()<true, false, 3>();
          else if (walk_lines <= 1)
            one_group ? run.template operator()<false, true, 1>()
                      : run.template operator()<false, false, 1>();
          else
            one_group ? run.template operator()<false, true, 2>()
                      : run.template operator()<false, false, 2>();
        };
        if (step == 16 * NC)
          pass.template operator()<NC>();
        else
          pass.template operator()<1>();
      }
    });
    h0 += hc;
  }
  add_value_offsets(w.offsets, heads, D, groups, VG, acc);
}

/// score_tokens_avx512 of a code source (G % 32 == 0: one key group per block).
template <class View>
LYNX_ATTENTION_AVX512_TARGET void score_tokens_avx512(const code_kv_source<View>& src,
                                                      std::int64_t kv_head, const float* q,
                                                      int heads, std::int64_t t0, std::int64_t t1,
                                                      const split_scratch& w,
                                                      const next_split& = {}) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  key_group_folds fold{q,
                       heads,
                       D,
                       src.level_unit(),
                       src.half(),
                       src.view.key_scale(),
                       src.view.key_zero(),
                       kv_head * g.key_token_groups(),
                       w};
  // this split's values (walked after the scores) are asked for while it scores;
  // accumulate_values_avx512 then asks for the next split's keys
  prefetch_walk walk;
  src.walk_split(walk, false, kv_head, t0, t1);
  const std::int64_t nb =
      (t1 + attention_block_tokens - 1) / attention_block_tokens - t0 / attention_block_tokens;
  const int lines = walk_step_lines(walk, nb * ((heads + 7) / 8) * D);
  for (std::int64_t b = t0 / attention_block_tokens; b * attention_block_tokens < t1; ++b) {
    const std::int64_t tb = b * attention_block_tokens;
    const std::int64_t grp = tb / g.key_group;
    fold(grp);
    if (tb + attention_block_tokens < t1) fold((tb + attention_block_tokens) / g.key_group);
    const float* qs = w.qs + (grp & 1) * heads * D;
    const float* bias = w.bias + (grp & 1) * heads;
    const auto* kb = src.view.key_block(kv_head, b);
    float* out = w.scores + (tb - t0);
    for (int h = 0; h < heads; h += 8)
      dispatch<1, 2, 3, 4, 5, 6, 7, 8>(std::min(8, heads - h), [&]<int HC>() {
        with_walk_hint([&]<int Hint>() {
          float* o = out + h * attention_split_tokens;
          if (lines <= 1)
            score_code_block_avx512<HC, 1, Hint>(kb, D, qs + h * D, bias + h, o, walk);
          else if (lines == 2)
            score_code_block_avx512<HC, 2, Hint>(kb, D, qs + h * D, bias + h, o, walk);
          else
            score_code_block_avx512<HC, 4, Hint>(kb, D, qs + h * D, bias + h, o, walk);
        });
      });
  }
}

/// Values of a code source over `pairs` token pairs from row `rows` (value codes
/// [t][D] at channel c0), HC heads x NC chunks of 16 channels: even and odd
/// tokens in their own sums, each in token order from 0, stored as even + odd
/// (accumulate_values_portable, lane = channel). wr[h][k]: head h's weight row
/// of chunk k's group at the first token.
/// `walk` steps Lines lines per pair, into the cache level of Hint.
template <int HC, int NC, int Lines, int Hint, class Code>
LYNX_ATTENTION_AVX512_TARGET inline void add_value_codes_avx512(const Code* rows, int D,
                                                                std::int64_t pairs,
                                                                const float* const (*wr)[NC],
                                                                float* out,
                                                                prefetch_walk& walk_io) {
  prefetch_walk walk = walk_io;  // a local copy: its cursor stays in registers
  __m512 e[HC][NC], o[HC][NC];
  for (int h = 0; h < HC; ++h)
    for (int k = 0; k < NC; ++k) e[h][k] = o[h][k] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < pairs; ++i) {
    const Code* r0 = rows + 2 * i * D;
    walk.step<Lines, Hint>();
    // this pass's lines of the rows 16 pairs ahead into L1 (from L2: the scores' walk)
    _mm_prefetch(reinterpret_cast<const char*>(r0 + 32 * D), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(r0 + 33 * D), _MM_HINT_T0);
    __m512 ve[NC], vo[NC];
    for (int k = 0; k < NC; ++k) {
      ve[k] = load16_codes_avx512(r0 + 16 * k);
      vo[k] = load16_codes_avx512(r0 + D + 16 * k);
    }
    for (int h = 0; h < HC; ++h)
      for (int k = 0; k < NC; ++k) {
        e[h][k] = _mm512_fmadd_ps(_mm512_set1_ps(wr[h][k][2 * i]), ve[k], e[h][k]);
        o[h][k] = _mm512_fmadd_ps(_mm512_set1_ps(wr[h][k][2 * i + 1]), vo[k], o[h][k]);
      }
  }
  for (int h = 0; h < HC; ++h)
    for (int k = 0; k < NC; ++k)
      _mm512_storeu_ps(out + h * D + 16 * k, _mm512_add_ps(e[h][k], o[h][k]));
  walk_io = walk;
}

/// accumulate_values_avx512 of a code source: head_dim and the value group
/// multiples of 16 (a chunk of 16 channels in one group), else the portable loop.
/// The weights are in w.weights (compute_split).
template <class View>
LYNX_ATTENTION_AVX512_TARGET void accumulate_values_avx512(const code_kv_source<View>& src,
                                                           std::int64_t kv_head, int heads,
                                                           std::int64_t t0, std::int64_t t1,
                                                           float* acc, const split_scratch& w,
                                                           const next_split& next = {}) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t groups = g.value_channel_groups(), VG = g.value_group;
  if (D % 16 != 0 || VG % 16 != 0) {
    accumulate_values_portable_fma(src, kv_head, heads, t0, t1, acc, w);
    return;
  }
  // whole pairs: t0 is even (a multiple of the split size); a token past t1 weighs 0
  // and its codes exist (value rows are padded to whole blocks)
  const std::int64_t pairs = (t1 - t0 + 1) / 2;
  const auto* rows = src.view.value_row(kv_head, t0);
  prefetch_walk walk;  // the next split's keys, stepped by the passes below
  src.walk_split(walk, true, next.kv_head, next.t0, next.t1);
  const int lines = walk_step_lines(walk, pairs * ((heads + 3) / 4) * ((D + 31) / 32));
  for (int h0 = 0; h0 < heads;) {
    const int hc = heads - h0 >= 4 ? 4 : heads - h0 >= 2 ? 2 : 1;
    dispatch<1, 2, 4>(hc, [&]<int HC>() {
      for (int c0 = 0, step = 0; c0 < D; c0 += step) {
        step = D - c0 >= 32 ? 32 : 16;  // the channels of the pass taken
        auto pass = [&]<int NC>() {
          const float* wr[HC][NC];
          for (int h = 0; h < HC; ++h)
            for (int k = 0; k < NC; ++k)
              wr[h][k] =
                  w.weights + ((h0 + h) * groups + (c0 + 16 * k) / VG) * attention_split_tokens;
          float* out = acc + h0 * D + c0;
          with_walk_hint([&]<int Hint>() {
            if (lines <= 1)
              add_value_codes_avx512<HC, NC, 1, Hint>(rows + c0, D, pairs, wr, out, walk);
            else if (lines == 2)
              add_value_codes_avx512<HC, NC, 2, Hint>(rows + c0, D, pairs, wr, out, walk);
            else
              add_value_codes_avx512<HC, NC, 4, Hint>(rows + c0, D, pairs, wr, out, walk);
          });
        };
        if (step == 32)
          pass.template operator()<2>();
        else
          pass.template operator()<1>();
      }
    });
    h0 += hc;
  }
  add_value_offsets(w.offsets, heads, D, groups, VG, acc);
}

/// 16 consecutive channels of a dense row as floats.
template <class T>
LYNX_ATTENTION_AVX512_TARGET inline __m512 load16_avx512(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    static_assert(std::is_same_v<T, bf16>, "AVX-512 dense kernels read float or bf16");
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

/// Fold of 16 lane vectors (one per token) into one vector of 16 scores in token
/// order, each by the halving tree l += l+8, l += l+4, l += l+2, l += l+1.
LYNX_ATTENTION_AVX512_TARGET inline __m512 fold16_avx512(__m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7 of v[2i] + lanes 8-15, then the same of v[2i+1]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // chunks (x0, x2 | y0, y2) + (x1, x3 | y1, y3)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  const __m512 r =
      _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  // lane (chunk k, position i) now holds the token whose index the table gives
  return r;
}

/// Lane permutation that puts fold16_avx512's result in token order, found by
/// folding vectors that each hold their token's index.
LYNX_ATTENTION_AVX512_TARGET inline __m512i fold16_token_order_avx512() {
  __m512 v[16];
  for (int t = 0; t < 16; ++t) v[t] = _mm512_set1_ps(static_cast<float>(t));
  alignas(64) float r[16];
  _mm512_store_ps(r, fold16_avx512(v));  // each lane: 16 * its token
  alignas(64) std::int32_t idx[16];
  for (int l = 0; l < 16; ++l) idx[static_cast<int>(r[l]) / 16] = l;
  return _mm512_load_si512(idx);
}

/// Scores of one head against 16 converted key rows [16][16 NV] (NV = head_dim / 16
/// known at compile time): the query stays in registers and the 16 tokens' chains
/// interleave; each token's 16 lanes accumulate in channel order as in dense_score.
template <int NV>
LYNX_ATTENTION_AVX512_TARGET inline void score_dense_block_avx512(const float* rows,
                                                                  const float* qh, __m512i perm,
                                                                  float* out) {
  __m512 qv[NV];
  for (int k = 0; k < NV; ++k) qv[k] = _mm512_loadu_ps(qh + 16 * k);
  __m512 v[16];
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int k = 0; k < NV; ++k)
      a = _mm512_fmadd_ps(qv[k], _mm512_load_ps(rows + (i * NV + k) * 16), a);
    v[i] = a;
  }
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(perm, fold16_avx512(v)));
}

/// Scores of HC heads against bf16 keys, 16 / HC tokens per step (16 chains, one
/// per (token, head), folded together by fold16_avx512): each key row is widened
/// in registers, 32 channels per load as even and odd halves, and multiplied by
/// the query permuted the same way (qp: [HC][D], pairs of even/odd vectors).
/// Lane l of a chain sums channels 32j + 2l, 32j + 2l + 1 in channel order
/// (dense_score_lane<bf16>). Rows [t, t + 16 / HC) must all exist.
template <int HC>
LYNX_ATTENTION_AVX512_TARGET inline void score_bf16_step_avx512(const dense_kv_source<bf16>& src,
                                                                std::int64_t kv_head,
                                                                std::int64_t t, const float* qp,
                                                                int DP, int D, __m512i perm,
                                                                float* out /*[HC][S] at t*/) {
  constexpr int TOK = 16 / HC;
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 32) {
    const int rest = D - c;
    const __mmask32 live = rest >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu)
                                      : static_cast<__mmask32>((1u << rest) - 1u);
    for (int i = 0; i < TOK; ++i) {
      const bf16* row = &src.keys(t + i, kv_head, c);
      const __m512i x = rest >= 32 ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi16(live, row);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 odd = _mm512_castsi512_ps(
          _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      for (int h = 0; h < HC; ++h) {
        a[i * HC + h] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + h * DP + c), even, a[i * HC + h]);
        a[i * HC + h] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + h * DP + c + 16), odd, a[i * HC + h]);
      }
    }
  }
  alignas(64) float r[16];
  _mm512_store_ps(r, _mm512_permutexvar_ps(perm, fold16_avx512(a)));  // r[i * HC + h]
  for (int i = 0; i < TOK; ++i)
    for (int h = 0; h < HC; ++h) out[h * attention_split_tokens + i] = r[i * HC + h];
}

/// The query of each head with its channels in the order score_bf16_step_avx512
/// multiplies them: per 32 channels, the 16 even then the 16 odd ones, zeros
/// past D. qp: [heads][DP], DP = D rounded up to 32.
inline void permute_query_bf16(const float* q, int heads, int D, int DP, float* qp) {
  for (int h = 0; h < heads; ++h)
    for (int c = 0; c < DP; c += 32)
      for (int l = 0; l < 16; ++l) {
        qp[h * DP + c + l] = c + 2 * l < D ? q[h * D + c + 2 * l] : 0.0f;
        qp[h * DP + c + 16 + l] = c + 2 * l + 1 < D ? q[h * D + c + 2 * l + 1] : 0.0f;
      }
}

/// Asks L2 for key rows [t, t + n) of one kv head (written out, not prefetch_lines:
/// that form measured 8% slower on the bf16 baseline at 32K tokens, same prefetches).
__attribute__((always_inline)) inline void prefetch_key_rows_bf16(const dense_kv_source<bf16>& src,
                                                                  std::int64_t kv_head,
                                                                  std::int64_t t, int n, int D) {
  for (int i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(&src.keys(t + i, kv_head, 0));
    for (std::size_t off = 0; off < D * sizeof(bf16); off += 64)
      __builtin_prefetch(row + off, 0, 2);
  }
}

/// score_bf16_step_avx512 for hc = 4, 2 or 1 heads (16 / hc tokens).
LYNX_ATTENTION_AVX512_TARGET inline void score_bf16_step_hc_avx512(
    int hc, const dense_kv_source<bf16>& src, std::int64_t kv_head, std::int64_t t, const float* qp,
    int DP, int D, __m512i perm, float* out) {
  if (hc == 4)
    score_bf16_step_avx512<4>(src, kv_head, t, qp, DP, D, perm, out);
  else if (hc == 2)
    score_bf16_step_avx512<2>(src, kv_head, t, qp, DP, D, perm, out);
  else
    score_bf16_step_avx512<1>(src, kv_head, t, qp, DP, D, perm, out);
}

/// Dense bf16 scores of tokens [t0, t1): score_bf16_step_avx512 for whole steps,
/// dense_score for the last few tokens. The permuted queries live in the value
/// weight scratch (a dense source has no value weights; it holds heads x S floats).
LYNX_ATTENTION_AVX512_TARGET inline void score_tokens_bf16_avx512(const dense_kv_source<bf16>& src,
                                                                  std::int64_t kv_head,
                                                                  const float* q, int heads,
                                                                  std::int64_t t0, std::int64_t t1,
                                                                  const split_scratch& w) {
  const int D = src.head_dim();
  const int DP = (D + 31) / 32 * 32;
  static const __m512i perm = fold16_token_order_avx512();
  float* qp = w.weights;
  permute_query_bf16(q, heads, D, DP, qp);
  int h0 = 0;
  while (h0 < heads) {
    const int hc = heads - h0 >= 4 ? 4 : heads - h0 >= 2 ? 2 : 1;
    const int tok = 16 / hc;
    std::int64_t t = t0;
    for (; t + tok <= t1; t += tok) {
      if (h0 == 0 && t + dense_prefetch_rows + tok <= t1)
        prefetch_key_rows_bf16(src, kv_head, t + dense_prefetch_rows, tok, D);
      score_bf16_step_hc_avx512(hc, src, kv_head, t, qp + h0 * DP, DP, D, perm,
                                w.scores + h0 * attention_split_tokens + (t - t0));
    }
    for (; t < t1; ++t)
      for (int h = h0; h < h0 + hc; ++h)
        w.scores[h * attention_split_tokens + (t - t0)] =
            dense_score(q + h * D, &src.keys(t, kv_head, 0), 1, D);
    h0 += hc;
  }
}

template <class T>
LYNX_ATTENTION_AVX512_TARGET void score_tokens_avx512(const dense_kv_source<T>& src,
                                                      std::int64_t kv_head, const float* q,
                                                      int heads, std::int64_t t0, std::int64_t t1,
                                                      const split_scratch& w) {
  if constexpr (std::is_same_v<T, bf16>) {  // avx512_supports: head_dim <= S
    score_tokens_bf16_avx512(src, kv_head, q, heads, t0, t1, w);
    return;
  }
  const int D = src.head_dim();
  static const __m512i perm = fold16_token_order_avx512();
  std::int64_t t = t0;
  float* rows = w.tile;  // [16][D] floats: the block's keys, converted once for all heads
  for (; t + 16 <= t1; t += 16) {
    for (int i = 0; i < 16; ++i) {
      const T* k = &src.keys(t + i, kv_head, 0);
      if (i + 32 < t1 - t)  // rows are kv_heads * head_dim apart: the row 32 tokens ahead
        prefetch_lines<3>(&src.keys(t + i + 32, kv_head, 0), D * sizeof(T));
      for (int c = 0; c < D; c += 16) _mm512_store_ps(rows + i * D + c, load16_avx512(k + c));
    }
    for (int h = 0; h < heads; ++h) {
      float* out = w.scores + h * attention_split_tokens + (t - t0);
      switch (D) {
        case 16:
          score_dense_block_avx512<1>(rows, q + h * D, perm, out);
          continue;
        case 32:
          score_dense_block_avx512<2>(rows, q + h * D, perm, out);
          continue;
        case 64:
          score_dense_block_avx512<4>(rows, q + h * D, perm, out);
          continue;
        case 128:
          score_dense_block_avx512<8>(rows, q + h * D, perm, out);
          continue;
        default:
          break;
      }
      __m512 v[16];
      const float* qh = q + h * D;
      for (int i = 0; i < 16; ++i) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 16)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c), _mm512_load_ps(rows + i * D + c), a);
        v[i] = a;
      }
      _mm512_storeu_ps(w.scores + h * attention_split_tokens + (t - t0),
                       _mm512_permutexvar_ps(perm, fold16_avx512(v)));
    }
  }
  for (; t < t1; ++t)
    for (int h = 0; h < heads; ++h)
      w.scores[h * attention_split_tokens + (t - t0)] =
          dense_score(q + h * D, &src.keys(t, kv_head, 0), 1, D);
}

template <int HC, int NV, class T>
LYNX_ATTENTION_AVX512_TARGET void accumulate_dense_chunk_avx512(const dense_kv_source<T>& src,
                                                                std::int64_t kv_head,
                                                                std::int64_t t0, std::int64_t t1,
                                                                int c0, const float* p /*[HC][S]*/,
                                                                float* acc, int D) {
  __m512 a[HC][NV];
  for (int h = 0; h < HC; ++h)
    for (int k = 0; k < NV; ++k) a[h][k] = _mm512_setzero_ps();
  for (std::int64_t t = t0; t < t1; ++t) {
    const T* row = &src.values(t, kv_head, c0);
    if (t + dense_prefetch_rows < t1)
      prefetch_lines<2>(&src.values(t + dense_prefetch_rows, kv_head, c0), 16 * NV * sizeof(T));
    __m512 v[NV];
    if constexpr (std::is_same_v<T, bf16> && NV % 2 == 0) {
      // 32 bf16 per load: the even channels are the low halves shifted up, the
      // odd ones the high halves masked (v[2j]: channels 32j + 2l, v[2j+1]: 32j + 2l + 1)
      for (int j = 0; j < NV / 2; ++j) {
        const __m512i x = _mm512_loadu_si512(row + 32 * j);
        v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        v[2 * j + 1] = _mm512_castsi512_ps(
            _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      }
    } else {
      for (int k = 0; k < NV; ++k) v[k] = load16_avx512(row + 16 * k);
    }
    for (int h = 0; h < HC; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * attention_split_tokens + (t - t0)]);
      for (int k = 0; k < NV; ++k) a[h][k] = _mm512_fmadd_ps(ph, v[k], a[h][k]);
    }
  }
  for (int h = 0; h < HC; ++h) {
    if constexpr (std::is_same_v<T, bf16> && NV % 2 == 0) {
      for (int j = 0; j < NV / 2; ++j) {  // back to channel order
        alignas(64) float e[16], o[16];
        _mm512_store_ps(e, a[h][2 * j]);
        _mm512_store_ps(o, a[h][2 * j + 1]);
        float* out = acc + h * D + c0 + 32 * j;
        for (int l = 0; l < 16; ++l) {
          out[2 * l] = e[l];
          out[2 * l + 1] = o[l];
        }
      }
    } else {
      for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + h * D + c0 + 16 * k, a[h][k]);
    }
  }
}

template <int NV, class T>
LYNX_ATTENTION_AVX512_TARGET void accumulate_dense_avx512(const dense_kv_source<T>& src,
                                                          std::int64_t kv_head, int heads,
                                                          std::int64_t t0, std::int64_t t1,
                                                          float* acc, const split_scratch& w,
                                                          int D) {
  for (int h = 0; h < heads; h += 4) {
    const float* p = w.scores + h * attention_split_tokens;
    for (int c0 = 0; c0 < D; c0 += 16 * NV) {
      dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
        accumulate_dense_chunk_avx512<HC, NV>(src, kv_head, t0, t1, c0, p, acc + h * D, D);
      });
    }
  }
}

/// Dense values, lane = channel, token order: 4 heads x 64 channels of accumulators.
template <class T>
LYNX_ATTENTION_AVX512_TARGET void accumulate_values_avx512(const dense_kv_source<T>& src,
                                                           std::int64_t kv_head, int heads,
                                                           std::int64_t t0, std::int64_t t1,
                                                           float* acc, const split_scratch& w) {
  const int D = src.head_dim();
  if (D % 64 == 0)
    accumulate_dense_avx512<4>(src, kv_head, heads, t0, t1, acc, w, D);
  else if (D % 32 == 0)
    accumulate_dense_avx512<2>(src, kv_head, heads, t0, t1, acc, w, D);
  else
    accumulate_dense_avx512<1>(src, kv_head, heads, t0, t1, acc, w, D);
}

/// Scores of kv heads [g0, g0 + gn) over tokens [t0, t1): the steps and bits of
/// score_tokens_bf16_avx512 for each kv head, but each step of tokens reads the rows
/// of all gn kv heads, so a token-major cache is read front to back
/// (dense_heads_together). Scores of kv head g0 + j: w.scores + j * heads * S; its
/// permuted queries: w.weights + j * heads * DP. heads: 1, 2 or a multiple of 4.
LYNX_ATTENTION_AVX512_TARGET inline void score_heads_bf16_avx512(
    const dense_kv_source<bf16>& src, std::int64_t g0, int gn, const float* q /*[gn][heads][D]*/,
    int heads, std::int64_t t0, std::int64_t t1, const split_scratch& w) {
  constexpr std::int64_t S = attention_split_tokens;
  const int D = src.head_dim();
  const int DP = (D + 31) / 32 * 32;
  static const __m512i perm = fold16_token_order_avx512();
  for (int j = 0; j < gn; ++j)
    permute_query_bf16(q + j * heads * D, heads, D, DP, w.weights + j * heads * DP);
  const int hc = heads >= 4 ? 4 : heads;
  const int tok = 16 / hc;
  std::int64_t t = t0;
  for (; t + tok <= t1; t += tok) {
    const bool ahead = t + dense_prefetch_rows + tok <= t1;
    for (int j = 0; j < gn; ++j) {
      if (ahead) prefetch_key_rows_bf16(src, g0 + j, t + dense_prefetch_rows, tok, D);
      for (int h0 = 0; h0 < heads; h0 += hc)
        score_bf16_step_hc_avx512(hc, src, g0 + j, t, w.weights + (j * heads + h0) * DP, DP, D,
                                  perm, w.scores + (j * heads + h0) * S + (t - t0));
    }
  }
  for (; t < t1; ++t)
    for (int j = 0; j < gn; ++j)
      for (int h = 0; h < heads; ++h)
        w.scores[(j * heads + h) * S + (t - t0)] =
            dense_score(q + (j * heads + h) * D, &src.keys(t, g0 + j, 0), 1, D);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // LYNX_ATTENTION_AVX512

// ---------------------------------------------------------------------------
// AVX2 kernels (x86-64 without AVX-512: AMD Zen 2/3, Intel client parts).
// ---------------------------------------------------------------------------
// The same operations in the same order as the portable walk, lane by lane, so
// the same bits; a 16-lane sum of the fixed order is two 8-lane vectors (lanes
// 0-7, lanes 8-15). Where a kernel here does not take a shape, the portable walk
// compiled for AVX2 + FMA does (compute_split_avx2).
#if LYNX_ATTENTION_AVX512
#define LYNX_ATTENTION_AVX2_TARGET __attribute__((target("avx2,fma")))

/// The halving tree (reduce_lanes) of four 16-lane sums at once, each given as
/// its lanes 0-7 (lo) and 8-15 (hi): l += l+8, l += l+4, l += l+2, l += l+1.
/// Returns the four totals in lanes 0, 4, 1 and 5 (sums 0, 1, 2, 3).
LYNX_ATTENTION_AVX2_TARGET inline __m256 fold4_avx2(const __m256* lo, const __m256* hi) {
  __m256 s[4];
  for (int i = 0; i < 4; ++i) s[i] = _mm256_add_ps(lo[i], hi[i]);  // l += l + 8
  // l += l + 4: the low 128 bits of sums 0 and 1 (2 and 3) plus their high 128 bits
  const __m256 u0 = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20),
                                  _mm256_permute2f128_ps(s[0], s[1], 0x31));
  const __m256 u1 = _mm256_add_ps(_mm256_permute2f128_ps(s[2], s[3], 0x20),
                                  _mm256_permute2f128_ps(s[2], s[3], 0x31));
  // l += l + 2: [a0 a1 b0 b1] + [a2 a3 b2 b3] in each half (a: sum 0 or 1, b: sum 2 or 3)
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x44), _mm256_shuffle_ps(u0, u1, 0xEE));
  // l += l + 1: [v0 v2] + [v1 v3]
  return _mm256_add_ps(_mm256_shuffle_ps(v, v, 0x88), _mm256_shuffle_ps(v, v, 0xDD));
}

/// Dense bf16 scores of HC (1, 2 or 4) heads against key row `row` (D a multiple
/// of 32): the 32 channels of each step are widened as even and odd halves and
/// multiplied by the query permuted the same way (qp: [HC][D], permute_query_bf16),
/// so lane l of a head's sum takes channels 32j + 2l, then 32j + 2l + 1
/// (dense_score_lane<bf16>); then the halving tree. out: [HC][S] at the token.
template <int HC>
LYNX_ATTENTION_AVX2_TARGET inline void score_bf16_row_avx2(const bf16* row, const float* qp, int D,
                                                           float* out) {
  __m256 lo[4], hi[4];
  for (int h = 0; h < 4; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < D; c += 32) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c + 16));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)),
                 odd0 = _mm256_castsi256_ps(_mm256_and_si256(x0, high)),
                 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16)),
                 odd1 = _mm256_castsi256_ps(_mm256_and_si256(x1, high));
    for (int h = 0; h < HC; ++h) {
      const float* qh = qp + h * D + c;
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), even0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), even1, hi[h]);
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16), odd0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 24), odd1, hi[h]);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, fold4_avx2(lo, hi));
  constexpr int lane_of[4] = {0, 4, 1, 5};
  for (int h = 0; h < HC; ++h) out[h * attention_split_tokens] = r[lane_of[h]];
}

/// Dense float scores of HC (1, 2 or 4) heads against key row `row` (D a multiple
/// of 16): lane l of a head's sum takes channels 16j + l in channel order, then the
/// halving tree. q: [HC][D].
template <int HC>
LYNX_ATTENTION_AVX2_TARGET inline void score_float_row_avx2(const float* row, const float* q, int D,
                                                            float* out) {
  __m256 lo[4], hi[4];
  for (int h = 0; h < 4; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 16) {
    const __m256 k0 = _mm256_loadu_ps(row + c), k1 = _mm256_loadu_ps(row + c + 8);
    for (int h = 0; h < HC; ++h) {
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c), k0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c + 8), k1, hi[h]);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, fold4_avx2(lo, hi));
  constexpr int lane_of[4] = {0, 4, 1, 5};
  for (int h = 0; h < HC; ++h) out[h * attention_split_tokens] = r[lane_of[h]];
}

/// Dense scores of tokens [t0, t1), four heads per pass over a row (avx2_supports:
/// contiguous rows, head_dim a multiple of 32 for bf16 and of 16 for float). bf16
/// queries are permuted into the value weight scratch (a dense source has none).
template <class T>
LYNX_ATTENTION_AVX2_TARGET void score_tokens_avx2(const dense_kv_source<T>& src,
                                                  std::int64_t kv_head, const float* q, int heads,
                                                  std::int64_t t0, std::int64_t t1,
                                                  const split_scratch& w) {
  const int D = src.head_dim();
  const float* qp = q;
  if constexpr (std::is_same_v<T, bf16>) {
    permute_query_bf16(q, heads, D, D, w.weights);
    qp = w.weights;
  }
  for (std::int64_t t = t0; t < t1; ++t) {
    if (t + dense_prefetch_rows < t1)
      prefetch_lines<2>(&src.keys(t + dense_prefetch_rows, kv_head, 0), D * sizeof(T));
    const T* row = &src.keys(t, kv_head, 0);
    float* out = w.scores + (t - t0);
    for (int h = 0; h < heads;) {
      const int hc = heads - h >= 4 ? 4 : heads - h >= 2 ? 2 : 1;
      dispatch<1, 2, 4>(hc, [&]<int HC>() {
        if constexpr (std::is_same_v<T, bf16>)
          score_bf16_row_avx2<HC>(row, qp + h * D, D, out + h * attention_split_tokens);
        else
          score_float_row_avx2<HC>(row, qp + h * D, D, out + h * attention_split_tokens);
      });
      h += hc;
    }
  }
}

/// Dense values of HC (1..4) heads x 16 channels [c0, c0 + 16) over the n rows of a
/// tile (rows[i][D], floats): lane = channel, one fused multiply-add per row in
/// order, the sums carried in acc between calls (0 before the first). p: the
/// weights of the tile's first row (heads attention_split_tokens apart).
template <int HC>
LYNX_ATTENTION_AVX2_TARGET inline void add_dense_tile_chunk_avx2(const float* rows, std::int64_t n,
                                                                 int c0, const float* p, float* acc,
                                                                 int D) {
  __m256 a[HC][2];
  for (int h = 0; h < HC; ++h) {
    a[h][0] = _mm256_loadu_ps(acc + h * D + c0);
    a[h][1] = _mm256_loadu_ps(acc + h * D + c0 + 8);
  }
  const float* row = rows + c0;
  for (std::int64_t i = 0; i < n; ++i, row += D) {
    __m256 v0 = _mm256_load_ps(row), v1 = _mm256_load_ps(row + 8);
    // held in registers for all heads: GCC 12 otherwise folds the two loads into
    // every head's multiply-add (12 loads a row where 6 do; the bf16 baseline at 32K
    // tokens, one thread, Zen 3, minimum of 6 alternating rounds: 19.1 -> 18.0 ms)
    asm("" : "+x"(v0), "+x"(v1));
    for (int h = 0; h < HC; ++h) {
      const __m256 ph = _mm256_broadcast_ss(p + h * attention_split_tokens + i);
      a[h][0] = _mm256_fmadd_ps(ph, v0, a[h][0]);
      a[h][1] = _mm256_fmadd_ps(ph, v1, a[h][1]);
    }
  }
  for (int h = 0; h < HC; ++h) {
    _mm256_storeu_ps(acc + h * D + c0, a[h][0]);
    _mm256_storeu_ps(acc + h * D + c0 + 8, a[h][1]);
  }
}

/// A value row as floats into a tile row (16-float aligned): bf16 16 channels per
/// load as even and odd halves (channels c + 2l, then c + 2l + 1), floats as they are.
template <class T>
LYNX_ATTENTION_AVX2_TARGET inline void tile_row_avx2(const T* x, int D, float* out) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int c = 0; c < D; c += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c));
      _mm256_store_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_store_ps(out + c + 8, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
  } else {
    for (int c = 0; c < D; c += 8) _mm256_store_ps(out + c, _mm256_loadu_ps(x + c));
  }
}

/// 16 sums kept in the order of tile_row_avx2's bf16 rows (channels 2l, then
/// 2l + 1) put back in channel order, in place.
LYNX_ATTENTION_AVX2_TARGET inline void unpermute_bf16_avx2(float* x16) {
  const __m256 e = _mm256_loadu_ps(x16), o = _mm256_loadu_ps(x16 + 8);
  const __m256 x = _mm256_unpacklo_ps(e, o),  // channels 0-3 | 8-11
      y = _mm256_unpackhi_ps(e, o);           // channels 4-7 | 12-15
  _mm256_storeu_ps(x16, _mm256_permute2f128_ps(x, y, 0x20));
  _mm256_storeu_ps(x16 + 8, _mm256_permute2f128_ps(x, y, 0x31));
}

/// Dense values of tokens [t0, t1): acc[h][c] = sum_t p[h][t] * v[t][c]. The rows
/// of a 32-token block are first copied as floats into a contiguous tile: read in
/// place, rows kv_heads * head_dim apart (2 KiB for 8 x 128 bf16) fall in two L1
/// sets per line and evict each other between the passes over channels. The sums
/// are carried in acc (bf16: in tile_row_avx2's order until the end).
template <class T>
LYNX_ATTENTION_AVX2_TARGET void accumulate_values_avx2(const dense_kv_source<T>& src,
                                                       std::int64_t kv_head, int heads,
                                                       std::int64_t t0, std::int64_t t1, float* acc,
                                                       const split_scratch& w) {
  const int D = src.head_dim();
  std::fill(acc, acc + heads * D, 0.0f);
  for (std::int64_t ta = t0; ta < t1; ta += attention_block_tokens) {
    const std::int64_t tz = std::min<std::int64_t>(ta + attention_block_tokens, t1);
    for (std::int64_t t = ta; t < tz; ++t) {
      if (t + dense_prefetch_rows < t1)
        prefetch_lines<2>(&src.values(t + dense_prefetch_rows, kv_head, 0), D * sizeof(T));
      tile_row_avx2(&src.values(t, kv_head, 0), D, w.tile + (t - ta) * D);
    }
    for (int h = 0; h < heads; h += 4) {
      const float* p = w.scores + h * attention_split_tokens + (ta - t0);
      for (int c0 = 0; c0 < D; c0 += 16)
        dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
          add_dense_tile_chunk_avx2<HC>(w.tile, tz - ta, c0, p, acc + h * D, D);
        });
    }
  }
  if constexpr (std::is_same_v<T, bf16>)
    for (int i = 0; i < heads * D; i += 16) unpermute_bf16_avx2(acc + i);
}

/// attention_exp2 lane by lane (tile_math.hpp): the same operations.
LYNX_ATTENTION_AVX2_TARGET inline __m256 exp2_avx2(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
  x = _mm256_and_ps(x, live);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(x, magic), magic);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(exp2_poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_poly[i]));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

/// Lanes [0, k) of 8 set (k <= 8), as a mask for maskload / maskstore / blends.
LYNX_ATTENTION_AVX2_TARGET inline __m256i first_lanes_avx2(std::int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// s[i] = exp2(s[i] - m) in place; returns fixed_order_sum of the results (lanes
/// 0-7 and 8-15 of each 16 summed as they are made, then the halving tree).
LYNX_ATTENTION_AVX2_TARGET inline float exp2_shifted_sum_avx2(float* s, std::int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 lane[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    lane[(i / 8) % 2] = _mm256_add_ps(lane[(i / 8) % 2], e);
  }
  if (i < n) {
    const __m256i k = first_lanes_avx2(n - i);
    const __m256 e = exp2_avx2(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), mv));
    _mm256_maskstore_ps(s + i, k, e);
    __m256& a = lane[(i / 8) % 2];
    a = _mm256_blendv_ps(a, _mm256_add_ps(a, e), _mm256_castsi256_ps(k));
  }
  alignas(32) float r[16];
  _mm256_store_ps(r, lane[0]);
  _mm256_store_ps(r + 8, lane[1]);
  return reduce_lanes(r);
}

/// Logits to the log2 domain with tokens before first_visible masked; returns the
/// max and sets `bad` for a visible logit that is not finite (prepare_scores_avx512).
LYNX_ATTENTION_AVX2_TARGET inline float prepare_scores_avx2(float* s, std::int64_t n,
                                                            std::int64_t t0,
                                                            std::int64_t first_visible, bool& bad) {
  const __m256 log2e = _mm256_set1_ps(attention_log2e), ninf = _mm256_set1_ps(attention_neg_inf);
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256 mx = ninf;
  __m256i non_finite = _mm256_setzero_si256();
  for (std::int64_t i = 0; i < n; i += 8) {
    const __m256i live = first_lanes_avx2(n - i);
    // visible: t0 + i + lane >= first_visible  <=>  lane > first_visible - t0 - i - 1
    const std::int64_t need = std::clamp<std::int64_t>(first_visible - t0 - i, 0, 8);
    const __m256i seen = _mm256_cmpgt_epi32(_mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8),
                                            _mm256_set1_epi32(static_cast<int>(need)));
    const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_maskload_ps(s + i, live), log2e),
                                      _mm256_castsi256_ps(seen));
    _mm256_maskstore_ps(s + i, live, x);
    mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, x), _mm256_castsi256_ps(live));
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), exponent);
    non_finite = _mm256_or_si256(non_finite, _mm256_and_si256(_mm256_and_si256(live, seen),
                                                              _mm256_cmpeq_epi32(e, exponent)));
  }
  bad = !_mm256_testz_si256(non_finite, non_finite);
  alignas(32) float r[8];
  _mm256_store_ps(r, mx);
  float m = r[0];
  for (int l = 1; l < 8; ++l) m = r[l] > m ? r[l] : m;
  return m;
}

/// Exchanges bit b + S of each byte of a with bit b of the same byte of b (the
/// bits of m): swap_bits on eight lanes.
template <int S>
LYNX_ATTENTION_AVX2_TARGET inline void swap_bits_avx2(__m256i& a, __m256i& b, __m256i m) {
  const __m256i t = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi32(a, S), b), m);
  b = _mm256_xor_si256(b, t);
  a = _mm256_xor_si256(a, _mm256_slli_epi32(t, S));
}

/// The R rows of a bit matrix whose transpose is N planes' codes at channels
/// [c, c + 8): plane N - 1 - k as row k (the code's lowest bit first), rows N..R-1
/// zero (absent planes).
template <int N, int R>
LYNX_ATTENTION_AVX2_TARGET inline void load_plane_rows_avx2(const std::uint32_t* const* row, int c,
                                                            __m256i* r) {
  static_assert(N >= 1 && N <= R);
  for (int k = 0; k < R; ++k)
    r[k] = k < N ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[(N - 1 - k) % N] + c))
                 : _mm256_setzero_si256();
}

/// The codes of one 32-token block of N (<= 8) planes at channels [c, c + 8), a
/// lane each, as bytes: byte g of lane l of r[i] is token 8g + i's code in channel
/// c + l (plane 0 at bit N - 1, the bits above N 0). Each lane's plane words are
/// the rows of an 8 x 32 bit matrix (plane N - 1 - k as row k, absent planes 0),
/// transposed as four 8x8 blocks like transpose_bytes_8x8.
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void plane_code_lanes_avx2(const std::uint32_t* const* row, int c,
                                                             __m256i* r) {
  static_assert(N >= 1 && N <= 8);
  load_plane_rows_avx2<N, 8>(row, c, r);
  const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x33333333),
                m1 = _mm256_set1_epi32(0x55555555);
  for (int i = 0; i < 4; ++i) swap_bits_avx2<4>(r[i], r[i + 4], m4);
  for (int i : {0, 1, 4, 5}) swap_bits_avx2<2>(r[i], r[i + 2], m2);
  for (int i : {0, 2, 4, 6}) swap_bits_avx2<1>(r[i], r[i + 1], m1);
}

/// The codes of one 32-token block of N (<= 4) planes at channels [c, c + 8), a
/// lane each, as nibbles: byte g of lane l of r[k] holds token 8g + k's code in its
/// low nibble and token 8g + k + 4's in its high one (plane 0 at bit N - 1). The
/// rows (plane N - 1 - m as row m, absent planes 0) are transposed as 4 x 4 bit
/// blocks, one per nibble: two delta swap stages where 8 planes need three.
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void plane_code_nibbles_avx2(const std::uint32_t* const* row,
                                                               int c, __m256i* r) {
  static_assert(N >= 1 && N <= 4);
  load_plane_rows_avx2<N, 4>(row, c, r);
  const __m256i m2 = _mm256_set1_epi32(0x33333333), m1 = _mm256_set1_epi32(0x55555555);
  swap_bits_avx2<2>(r[0], r[2], m2);
  swap_bits_avx2<2>(r[1], r[3], m2);
  swap_bits_avx2<1>(r[0], r[1], m1);
  swap_bits_avx2<1>(r[2], r[3], m1);
}

/// x[l] lane i = r[i] lane l: an 8 x 8 transpose of 32-bit lanes.
LYNX_ATTENTION_AVX2_TARGET inline void transpose_8x8_epi32_avx2(const __m256i* r, __m256i* x) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);      // lanes 0, 1 | 4, 5
    t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);  // lanes 2, 3 | 6, 7
  }
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < 2; ++j) {
      u[4 * k + 2 * j] = _mm256_unpacklo_epi64(t[4 * k + j], t[4 * k + j + 2]);      // lane 2j | +4
      u[4 * k + 2 * j + 1] = _mm256_unpackhi_epi64(t[4 * k + j], t[4 * k + j + 2]);  // 2j + 1
    }
  for (int l = 0; l < 4; ++l) {
    x[l] = _mm256_permute2x128_si256(u[l], u[4 + l], 0x20);
    x[l + 4] = _mm256_permute2x128_si256(u[l], u[4 + l], 0x31);
  }
}

/// Byte q of each 32-bit lane of v.
LYNX_ATTENTION_AVX2_TARGET inline __m256i lane_byte_avx2(__m256i v, int q) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * q), _mm256_set1_epi32(0xff));
}

/// N planes' codes of channels c0.. (word c of each plane row on) as bytes, a
/// channel per vector into out[c0..] (decode_key_tile_avx2's tile layout).
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void store_key_chunk_avx2(const std::uint32_t* const* planes,
                                                            int c, int c0, int D, __m256i* out) {
  __m256i r[8], x[8];
  plane_code_lanes_avx2<N>(planes, c, r);
  transpose_8x8_epi32_avx2(r, x);
  for (int l = 0; l < std::min(8, D - c0); ++l) _mm256_store_si256(out + c0 + l, x[l]);
}

/// store_key_chunk_avx2 for N <= 4 planes from plane_code_nibbles_avx2: a 4 x 8
/// transpose of 32-bit lanes gives each channel its four dwords, which fill lanes
/// 0-3 of its vector (low nibbles) and, shifted by 4, lanes 4-7 (high nibbles),
/// masked to one code per byte: the same tile as from bytes.
template <int N>
LYNX_ATTENTION_AVX2_TARGET inline void store_key_nibbles_avx2(const std::uint32_t* const* planes,
                                                              int c, int c0, int D, __m256i* out) {
  __m256i r[4];
  plane_code_nibbles_avx2<N>(planes, c, r);
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]),
                t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  // u[l]: channel c0 + l's dwords in the low 128 bits, channel c0 + 4 + l's in the high
  const __m256i u[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                        _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
  const __m256i sh = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i m = _mm256_set1_epi32(0x0f0f0f0f);
  auto spread = [&](__m256i x) LYNX_ATTENTION_AVX2_TARGET {
    return _mm256_and_si256(_mm256_srlv_epi32(x, sh), m);
  };
  for (int l = 0; l < 4; ++l) {
    if (l < D - c0)
      _mm256_store_si256(out + c0 + l, spread(_mm256_permute2x128_si256(u[l], u[l], 0x00)));
    if (l + 4 < D - c0)
      _mm256_store_si256(out + c0 + 4 + l, spread(_mm256_permute2x128_si256(u[l], u[l], 0x11)));
  }
}

/// Codes of one 32-token block of P planes, tile[c] a vector per channel: lane i,
/// byte g is token 8g + i's code (lane_byte_avx2(tile[c], g) is tokens 8g..8g + 7
/// in order). Eight channels at a time: their codes as bytes (plane_code_lanes_avx2:
/// byte g of lane l of r[i] is token 8g + i of channel l), transposed to a channel
/// per vector. More than 8 planes: tile[c] holds planes 0..7 (the code's high
/// bits), tile[D + c] planes 8..P-1. Four times smaller than a float tile, which
/// evicted the plane words asked into L1 ahead of use.
template <int P>
LYNX_ATTENTION_AVX2_TARGET inline void decode_key_tile_avx2(const std::uint32_t* const* rows, int D,
                                                            __m256i* tile) {
  constexpr int PH = P < 8 ? P : 8, PL = P - PH;
  for (int c0 = 0; c0 < D; c0 += 8) {
    const std::uint32_t* const* src = rows;
    int c = c0;
    std::uint32_t pad[P][8];  // a last chunk of fewer than 8 channels, zero padded
    const std::uint32_t* padded[P];
    if (c0 + 8 > D) {
      for (int j = 0; j < P; ++j) {
        for (int k = 0; k < 8; ++k) pad[j][k] = c0 + k < D ? rows[j][c0 + k] : 0u;
        padded[j] = pad[j];
      }
      src = padded;
      c = 0;
    }
    if constexpr (P <= 4) {
      store_key_nibbles_avx2<P>(src, c, c0, D, tile);
    } else {
      store_key_chunk_avx2<PH>(src, c, c0, D, tile);
      if constexpr (PL > 0) store_key_chunk_avx2<PL>(src + PH, c, c0, D, tile + D);
    }
  }
}

/// Scores of tokens [la, lb) of a block for HC (1..4) heads (score_block_portable's
/// operations): bias[h] + sum_c qs[h][c] * code(c, t), the sum from 0 in channel
/// order, 16 tokens per pass, the codes of decode_key_tile_avx2's tile turned into
/// floats as they are used (Two: high << pl | low). out: [HC][S] at the block's
/// first token.
template <int HC, bool Two>
LYNX_ATTENTION_AVX2_TARGET inline void score_tile_avx2(const __m256i* tile, int D, int pl,
                                                       const float* qs, const float* bias,
                                                       float* out, int la, int lb) {
  static_assert(HC >= 1 && HC <= 4);
  const __m128i pls = _mm_cvtsi32_si128(pl);
  auto pass = [&]<int T0>() LYNX_ATTENTION_AVX2_TARGET {
    if (T0 >= lb || T0 + 16 <= la) return;
    // tokens 8g..8g + 7 of a channel whose tile vectors are hv (high) and lv (low)
    auto code = [&](__m256i hv, __m256i lv, int g) LYNX_ATTENTION_AVX2_TARGET {
      const __m256i high = lane_byte_avx2(hv, g);
      if constexpr (!Two)
        return _mm256_cvtepi32_ps(high);
      else
        return _mm256_cvtepi32_ps(
            _mm256_or_si256(_mm256_sll_epi32(high, pls), lane_byte_avx2(lv, g)));
    };
    // named sums, not an array: GCC 12 kept an array of them in memory as well
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (int c = 0; c < D; ++c) {
      const __m256i hv = _mm256_load_si256(tile + c);
      const __m256i lv = Two ? _mm256_load_si256(tile + D + c) : hv;
      const __m256 k0 = code(hv, lv, T0 / 8), k1 = code(hv, lv, T0 / 8 + 1);
      const __m256 q0 = _mm256_broadcast_ss(qs + c);
      a0 = _mm256_fmadd_ps(q0, k0, a0);
      b0 = _mm256_fmadd_ps(q0, k1, b0);
      if constexpr (HC > 1) {
        const __m256 q1 = _mm256_broadcast_ss(qs + D + c);
        a1 = _mm256_fmadd_ps(q1, k0, a1);
        b1 = _mm256_fmadd_ps(q1, k1, b1);
      }
      if constexpr (HC > 2) {
        const __m256 q2 = _mm256_broadcast_ss(qs + 2 * D + c);
        a2 = _mm256_fmadd_ps(q2, k0, a2);
        b2 = _mm256_fmadd_ps(q2, k1, b2);
      }
      if constexpr (HC > 3) {
        const __m256 q3 = _mm256_broadcast_ss(qs + 3 * D + c);
        a3 = _mm256_fmadd_ps(q3, k0, a3);
        b3 = _mm256_fmadd_ps(q3, k1, b3);
      }
    }
    const __m256 lo[4] = {a0, a1, a2, a3}, hi[4] = {b0, b1, b2, b3};
    const int ta = std::max(la, T0), tz = std::min(lb, T0 + 16);
    for (int h = 0; h < HC; ++h) {
      const __m256 bv = _mm256_set1_ps(bias[h]);
      alignas(32) float r[16];
      _mm256_store_ps(r, _mm256_add_ps(lo[h], bv));
      _mm256_store_ps(r + 8, _mm256_add_ps(hi[h], bv));
      float* o = out + h * attention_split_tokens;
      for (int t = ta; t < tz; ++t) o[t] = r[t - T0];
    }
  };
  pass.template operator()<0>();
  pass.template operator()<16>();
}

/// fold_queries_portable on AVX2 for head_dim a multiple of 16 (else the portable
/// one): fold_query_into_key_group's operations lane by lane (lane = channel mod
/// 16 as two 8-lane halves), the scale terms once for all heads, the bias sums of
/// four heads folded together (fold4_avx2: the halving tree of reduce_lanes).
template <class Source>
LYNX_ATTENTION_AVX2_TARGET void fold_queries_avx2(const Source& src, std::int64_t kv_head,
                                                  std::int64_t grp, const float* q, int heads,
                                                  const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  if (D % attention_reduction_lanes != 0)
    return fold_queries_portable(src, kv_head, grp, q, heads, w);
  const std::int64_t base = (kv_head * g.key_token_groups() + grp) * D;
  const float* scale = src.view.key_scale() + base;
  const float* zero = src.view.key_zero() + base;
  const __m256 unit = _mm256_set1_ps(src.level_unit()), half = _mm256_set1_ps(src.half());
  for (int h0 = 0; h0 < heads; h0 += 4) {
    const int hn = std::min(4, heads - h0);
    __m256 sum[2][4];  // lanes 0-7 and 8-15 of each head's bias sum
    for (int b = 0; b < 4; ++b) sum[0][b] = sum[1][b] = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 8) {
      const __m256 sc = _mm256_loadu_ps(scale + c);
      const __m256 su = _mm256_mul_ps(sc, unit);
      const __m256 shift = _mm256_fmadd_ps(sc, half, _mm256_loadu_ps(zero + c));
      const int k = (c / 8) % 2;
      for (int b = 0; b < hn; ++b) {
        const __m256 qv = _mm256_loadu_ps(q + (h0 + b) * D + c);
        _mm256_storeu_ps(w.qs + (h0 + b) * D + c, _mm256_mul_ps(qv, su));
        sum[k][b] = _mm256_fmadd_ps(qv, shift, sum[k][b]);
      }
    }
    alignas(32) float totals[8];  // heads 0..3 in lanes 0, 4, 1, 5
    _mm256_store_ps(totals, fold4_avx2(sum[0], sum[1]));
    constexpr int lane[4] = {0, 4, 1, 5};
    for (int b = 0; b < hn; ++b) w.bias[h0 + b] = totals[lane[b]];
  }
}

/// Logits of tokens [t0, t1) of a bit-plane prompt (score_blocks_portable's walk):
/// each block decoded once by decode_key_tile_avx2, scored per key group it holds.
template <stream_plan_type Plan, int G>
LYNX_ATTENTION_AVX2_TARGET void score_tokens_avx2(const plane_kv_source<Plan, G>& src,
                                                  std::int64_t kv_head, const float* q, int heads,
                                                  std::int64_t t0, std::int64_t t1,
                                                  const split_scratch& w,
                                                  const next_split& next = {}) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t KG = g.key_group;
  const std::int64_t b0 = t0 / attention_block_tokens;
  const int nb = static_cast<int>((t1 + attention_block_tokens - 1) / attention_block_tokens - b0);
  with_level_planes<Plan>(src.planes, [&](auto p) LYNX_ATTENTION_AVX2_TARGET {
    constexpr int P = p();
    constexpr bool Two = P > 8;             // codes of more than a byte
    constexpr int pl = std::max(P - 8, 0);  // planes of the codes' low byte
    std::int64_t folded_group = -1;
    const std::uint32_t* rows[16];
    __m256i* tile = reinterpret_cast<__m256i*>(w.tile);  // 32-byte aligned (carve_scratch)
    for (std::int64_t b = b0; b * attention_block_tokens < t1; ++b) {
      const std::int64_t tb = b * attention_block_tokens;
      // L2 gets this split's values and the next split's keys a slice per block, as
      // on the AVX-512 path; L1 the keys a few blocks ahead
      src.prefetch_split_slice(false, kv_head, t0, t1, static_cast<int>(b - b0), nb);
      if (next.t1 > next.t0)
        src.prefetch_split_slice(true, next.kv_head, next.t0, next.t1, static_cast<int>(b - b0),
                                 nb);
      src.prefetch_block(true, kv_head, b + prefetch_blocks);
      src.block_rows(true, kv_head, b, rows);
      decode_key_tile_avx2<P>(rows, D, tile);
      for (std::int64_t a = std::max(tb, t0); a < std::min(tb + attention_block_tokens, t1);) {
        const std::int64_t e = std::min({(a / KG + 1) * KG, tb + attention_block_tokens, t1});
        if (a / KG != folded_group)
          fold_queries_avx2(src, kv_head, folded_group = a / KG, q, heads, w);
        for (int h = 0; h < heads; h += 4)
          dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
            float* out = w.scores + h * attention_split_tokens + (tb - t0);
            const int la = static_cast<int>(a - tb), lb = static_cast<int>(e - tb);
            score_tile_avx2<HC, Two>(tile, D, pl, w.qs + h * D, w.bias + h, out, la, lb);
          });
        a = e;
      }
    }
  });
}

/// Whether the AVX2 bit-plane value kernels (value_weights_avx2,
/// accumulate_values_avx2) take this source: head_dim a multiple of 8, each
/// 8-channel chunk within one value group, and 1, 2, 4 or 8 value groups per token
/// (a token's groups side by side in the weights fill whole 8-lane steps).
template <stream_plan_type Plan, int G>
bool avx2_value_planes(const plane_kv_source<Plan, G>& src) {
  const layer_geometry& g = src.view.geometry;
  const std::int64_t groups = g.value_channel_groups();
  return g.head_dim % 8 == 0 && (g.value_group % 8 == 0 || groups == 1) &&
         (groups == 1 || groups == 2 || groups == 4 || groups == 8);
}

/// value_weights_portable's numbers for the AVX2 bit-plane values, laid out
/// [h][t - t0][grp] (a token's groups side by side, so that the scales and zeros
/// are read as stored): weight = p * (scale * unit), and offsets[h][grp] from lane
/// (t - t0) mod 16 of each group, value_offset_step in token order, then
/// reduce_lanes. Eight (token, group) elements per step; the scale terms are
/// computed once for all heads.
template <stream_plan_type Plan, int G>
LYNX_ATTENTION_AVX2_TARGET void value_weights_avx2(const plane_kv_source<Plan, G>& src,
                                                   std::int64_t kv_head, int heads, std::int64_t t0,
                                                   std::int64_t t1, const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int groups = static_cast<int>(g.value_channel_groups());
  const float unit = src.level_unit(), half = src.half();
  const float* vs = src.view.value_scale() + (kv_head * g.tokens + t0) * groups;
  const float* vz = src.view.value_zero() + (kv_head * g.tokens + t0) * groups;
  constexpr std::int64_t S = attention_split_tokens;
  const std::int64_t n = (t1 - t0) * groups;         // elements (token, group)
  const int L = attention_reduction_lanes * groups;  // lanes of all groups: [lane][grp]
  alignas(32) float lanes[4][attention_reduction_lanes * 8];
  // element e of a step of 8 takes the p of token e / groups of the step
  const __m256i pick = groups == 1   ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                       : groups == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                     : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  auto token_p =
      [&](const float* p)
          LYNX_ATTENTION_AVX2_TARGET {  // p of the step's tokens, spread to their elements
            if (groups == 1) return _mm256_loadu_ps(p);
            if (groups == 2)
              return _mm256_permutevar8x32_ps(_mm256_broadcast_ps((const __m128*)p), pick);
            if (groups == 4)
              return _mm256_permutevar8x32_ps(
                  _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))), pick);
            return _mm256_broadcast_ss(p);
          };
  const __m256 vu = _mm256_set1_ps(unit), vh = _mm256_set1_ps(half);
  for (int h0 = 0; h0 < heads; h0 += 4) {
    const int hn = std::min(4, heads - h0);
    for (int b = 0; b < hn; ++b) std::fill(lanes[b], lanes[b] + L, 0.0f);
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 s = _mm256_loadu_ps(vs + i);
      const __m256 su = _mm256_mul_ps(s, vu);
      const __m256 shift = _mm256_fmadd_ps(s, vh, _mm256_loadu_ps(vz + i));
      for (int b = 0; b < hn; ++b) {
        const __m256 p = token_p(w.scores + (h0 + b) * S + i / groups);
        _mm256_storeu_ps(w.weights + (h0 + b) * S * groups + i, _mm256_mul_ps(p, su));
        float* lane = lanes[b] + i % L;
        _mm256_store_ps(lane, _mm256_fmadd_ps(p, shift, _mm256_load_ps(lane)));
      }
    }
    for (; i < n; ++i)  // a last step of fewer than 8 elements
      for (int b = 0; b < hn; ++b) {
        const float p = w.scores[(h0 + b) * S + i / groups];
        const value_token_weight vw = fold_value_token(p, vs[i], vz[i], unit, half);
        w.weights[(h0 + b) * S * groups + i] = vw.weight;
        float& sum = lanes[b][i % L];
        sum = value_offset_step(sum, p, vw.shift);
      }
    for (int b = 0; b < hn; ++b)
      for (int grp = 0; grp < groups; ++grp) {
        float lane[attention_reduction_lanes];
        for (int l = 0; l < attention_reduction_lanes; ++l) lane[l] = lanes[b][l * groups + grp];
        w.offsets[(h0 + b) * groups + grp] = reduce_lanes(lane);
      }
  }
}

/// Token t's codes (8 channels, a lane each) from plane_code_lanes_avx2's bytes:
/// r's, or with Two (more than 8 planes) r's << pl | s's (planes 8..8 + pl - 1).
/// Nib: r from plane_code_nibbles_avx2 (4 planes or fewer).
template <bool Two, bool Nib>
LYNX_ATTENTION_AVX2_TARGET inline __m256 value_code_avx2(const __m256i* r, const __m256i* s,
                                                         __m128i pl, int t) {
  if constexpr (Nib) {
    const __m128i shift = _mm_cvtsi32_si128(8 * (t / 8) + 4 * (t % 8 / 4));
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srl_epi32(r[t % 4], shift), _mm256_set1_epi32(0xf)));
  }
  const __m256i byte = _mm256_set1_epi32(0xff);
  const __m128i shift = _mm_cvtsi32_si128(8 * (t / 8));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi32(r[t % 8], shift), byte);
  if constexpr (!Two) {
    return _mm256_cvtepi32_ps(high);
  } else {
    const __m256i low = _mm256_and_si256(_mm256_srl_epi32(s[t % 8], shift), byte);
    return _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_sll_epi32(high, pl), low));
  }
}

/// The value sums of HC (1..4) heads at channels [c0, c0 + 8) over tokens [la, lb)
/// of one block (accumulate_values_portable's operations) from its codes
/// (plane_code_lanes_avx2: r, and s with Two): one fused multiply-add per token in
/// order into the sum of its parity (acc even, odd odd; a block starts at an even
/// token). wt: the weight of head 0, token 0 of the block in c0's group; head h,
/// token t at wt[h * hs + t * groups]; acc and odd: head h at h * D. Full: [la, lb) is the whole
/// block, its 32 tokens unrolled. Nib: r holds nibbles (4 planes or fewer). Not inlined: one
/// copy per (HC, Two, Full, Nib), shared by every plane count.
template <int HC, bool Two, bool Full, bool Nib>
LYNX_ATTENTION_AVX2_TARGET __attribute__((noinline)) void add_value_codes_avx2(
    const __m256i* r, const __m256i* s, int pl, const float* wt, std::int64_t hs, int groups,
    float* acc, float* odd, int D, int la, int lb) {
  const __m128i pls = _mm_cvtsi32_si128(pl);
  __m256 e[HC], o[HC];
  for (int h = 0; h < HC; ++h) {
    e[h] = _mm256_loadu_ps(acc + h * D);
    o[h] = _mm256_loadu_ps(odd + h * D);
  }
  auto add = [&](int t) LYNX_ATTENTION_AVX2_TARGET {
    const __m256 k = value_code_avx2<Two, Nib>(r, s, pls, t);
    for (int h = 0; h < HC; ++h) {
      const __m256 wv = _mm256_broadcast_ss(wt + h * hs + t * groups);
      if (t % 2 == 0)
        e[h] = _mm256_fmadd_ps(wv, k, e[h]);
      else
        o[h] = _mm256_fmadd_ps(wv, k, o[h]);
    }
  };
  if constexpr (Full) {
    [&]<int... T>(std::integer_sequence<int, T...>) LYNX_ATTENTION_AVX2_TARGET { (add(T), ...); }
    (std::make_integer_sequence<int, attention_block_tokens>{});
  } else {
    for (int t = la; t < lb; ++t) add(t);
  }
  for (int h = 0; h < HC; ++h) {
    _mm256_storeu_ps(acc + h * D, e[h]);
    _mm256_storeu_ps(odd + h * D, o[h]);
  }
}

/// accumulate_values_portable of a bit-plane prompt (the same sums in the same
/// order) with the weights of value_weights_avx2; avx2_value_planes(src).
template <stream_plan_type Plan, int G>
LYNX_ATTENTION_AVX2_TARGET void accumulate_values_avx2(const plane_kv_source<Plan, G>& src,
                                                       std::int64_t kv_head, int heads,
                                                       std::int64_t t0, std::int64_t t1, float* acc,
                                                       const split_scratch& w) {
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const int groups = static_cast<int>(g.value_channel_groups());
  const std::int64_t VG = g.value_group, hs = attention_split_tokens * groups;
  float* odd = w.odd;
  std::fill(acc, acc + heads * D, 0.0f);
  std::fill(odd, odd + heads * D, 0.0f);
  with_level_planes<Plan>(src.planes, [&](auto p) LYNX_ATTENTION_AVX2_TARGET {
    constexpr int P = p();
    constexpr bool Two = P > 8;             // codes of more than a byte
    constexpr bool Nib = P <= 4;            // plane_code_nibbles_avx2's codes
    constexpr int pl = std::max(P - 8, 0);  // planes past the high byte
    const std::uint32_t* rows[16];
    for (std::int64_t b = t0 / attention_block_tokens; b * attention_block_tokens < t1; ++b) {
      const std::int64_t tb = b * attention_block_tokens;
      src.prefetch_block(false, kv_head, b + prefetch_blocks);
      src.block_rows(false, kv_head, b, rows);
      const int la = static_cast<int>(std::max(tb, t0) - tb);
      const int lb = static_cast<int>(std::min(tb + attention_block_tokens, t1) - tb);
      // the weights of the block's token 0 (before t0 when the split starts mid-block:
      // only tokens from la on are read)
      const float* wt = w.weights + (tb - t0) * groups;
      const bool full = la == 0 && lb == attention_block_tokens;
      // a chunk's codes: [0, 8) planes 0..7, [8, 16) planes 8..; two chunks' worth,
      // the next chunk decoded before this one's multiply-adds are issued, so that its
      // loads and transposes overlap them (a chunk's FMAs outnumber the reorder window)
      __m256i codes[2][16];
      auto decode = [&](int c0, __m256i* r) LYNX_ATTENTION_AVX2_TARGET {
        if constexpr (Nib) {
          plane_code_nibbles_avx2<P>(rows, c0, r);
        } else {
          plane_code_lanes_avx2<(P < 8 ? P : 8)>(rows, c0, r);
          if constexpr (Two) plane_code_lanes_avx2<P - 8>(rows + 8, c0, r + 8);
        }
      };
      decode(0, codes[0]);
      for (int c0 = 0, k = 0; c0 < D; c0 += 8, k ^= 1) {
        if (c0 + 8 < D) decode(c0 + 8, codes[k ^ 1]);
        const __m256i *r = codes[k], *s = codes[k] + 8;
        for (int h = 0; h < heads; h += 4)
          dispatch<1, 2, 3, 4>(std::min(4, heads - h), [&]<int HC>() {
            auto go = [&]<bool Full>() {
              add_value_codes_avx2<HC, Two, Full, Nib>(r, s, pl, wt + h * hs + c0 / VG, hs, groups,
                                                       acc + h * D + c0, odd + h * D + c0, D, la,
                                                       lb);
            };
            full ? go.template operator()<true>() : go.template operator()<false>();
          });
      }
    }
  });
  for (std::int64_t i = 0; i < heads * D; ++i) acc[i] += odd[i];
  add_value_offsets(w.offsets, heads, D, groups, VG, acc);
}
#endif  // LYNX_ATTENTION_AVX512

/// Whether the AVX-512 kernels handle this source (else the portable ones do).
template <stream_plan_type Plan, int G>
bool avx512_supports(const plane_kv_source<Plan, G>&) {
  return G % attention_block_tokens ==
         0;  // one key group per 32-token block; any head_dim and value group
}
template <class View>
bool avx512_supports(const code_kv_source<View>& src) {
  return src.view.geometry.key_group % attention_block_tokens == 0;  // one key group per block
}
template <class T>
bool avx512_supports(const dense_kv_source<T>& src) {
  // bf16 keys: the permuted queries of score_tokens_bf16_avx512 must fit its scratch
  return src.head_dim() % 16 == 0 && src.keys.channel_stride == 1 &&
         src.values.channel_stride == 1 &&
         (!std::is_same_v<T, bf16> || src.head_dim() <= attention_split_tokens);
}

/// Softmax of one head's scores over one split, in place: s becomes p =
/// exp2(s * log2(e) - m) (0 before first_visible), m its maximum and l = sum(p)
/// in fixed order; all masked: m = -inf, l = 0, p = 0.
/// Which loops a split is walked with: the portable ones as built, the portable ones
/// compiled for AVX2 + FMA, the AVX2 kernels, the AVX-512 kernels (same bits).
enum class host_walk : std::uint8_t { baseline, fma, avx2, avx512 };

template <class Variant>
void softmax_split(float* s, std::int64_t n, std::int64_t t0, std::int64_t first_visible,
                   const Variant& variant, host_walk walk, float& m, float& l) {
  (void)walk;
  if constexpr (Variant::has_logit_transform)
    for (std::int64_t i = 0; i < n; ++i) s[i] = variant.transform_logit(s[i]);
  float mx = attention_neg_inf;
  bool bad = false;
#if LYNX_ATTENTION_AVX512
  if (walk == host_walk::avx512) {
    mx = prepare_scores_avx512(s, n, t0, first_visible, bad);
  } else if (walk == host_walk::avx2) {
    mx = prepare_scores_avx2(s, n, t0, first_visible, bad);
  } else
#endif
  {
    for (std::int64_t i = 0; i < n; ++i) {
      const bool masked = (t0 + i) < first_visible;
      const float x = masked ? attention_neg_inf : s[i] * attention_log2e;
      s[i] = x;
      mx = x > mx ? x : mx;
      bad |= !masked && !is_finite_value(x);
    }
  }
  if (bad) [[unlikely]] {
    // a logit that is not finite: the max and exp2 would drop it silently; a NaN
    // sum makes the output NaN, which decode_attention reports with its cause
    m = mx > attention_neg_inf ? mx : 0.0f;
    l = std::numeric_limits<float>::quiet_NaN();
    std::fill(s, s + n, 0.0f);
    return;
  }
  m = mx;
  if (!(mx > attention_neg_inf)) {
    // nothing visible for this head (all masked): an empty state, p = 0
    std::fill(s, s + n, 0.0f);
    l = 0.0f;
    return;
  }
#if LYNX_ATTENTION_AVX512
  if (walk == host_walk::avx512) {
    l = exp2_shifted_sum_avx512(s, n, mx);
    return;
  }
  if (walk == host_walk::avx2) {
    l = exp2_shifted_sum_avx2(s, n, mx);
    return;
  }
#endif
  exp2_shifted_portable(s, n, mx);
  l = fixed_order_sum(s, n);
}

/// The portable walk's value side of one split: the value weights (plane and code
/// sources) and the sums of the weighted values into acc.
template <class Source>
void values_portable(const Source& src, std::int64_t kv_head, int heads, std::int64_t t0,
                     std::int64_t t1, float* acc, const split_scratch& w) {
  if constexpr (requires { src.view; }) value_weights_portable(src, kv_head, heads, t0, t1, w);
  accumulate_values_portable(src, kv_head, heads, t0, t1, acc, w);
}

// The portable loops as built, each compiled once per source (not per variant, and
// not again inside every walk that falls back to them): everything they call
// inlined into a function that GCC compiles without contracting a * b + c, as a
// build for a target with FMA (-march=native) would otherwise fuse what the loops
// round twice. The walks below call them and inline only the softmax.
template <class Source>
LYNX_ATTENTION_UNFUSED LYNX_NOINLINE void score_tokens_unfused(const Source& src,
                                                               std::int64_t kv_head, const float* q,
                                                               int heads, std::int64_t t0,
                                                               std::int64_t t1,
                                                               const split_scratch& w) {
  score_tokens_portable(src, kv_head, q, heads, t0, t1, w);
}

template <class Source>
LYNX_ATTENTION_UNFUSED LYNX_NOINLINE void values_unfused(const Source& src, std::int64_t kv_head,
                                                         int heads, std::int64_t t0,
                                                         std::int64_t t1, float* acc,
                                                         const split_scratch& w) {
  values_portable(src, kv_head, heads, t0, t1, acc, w);
}

#if LYNX_ATTENTION_AVX512
// The same loops compiled for AVX2 + FMA (host_has_fma): the same operations in the
// same order, so the same bits. The AVX2 walk falls back to these.
template <class Source>
LYNX_ATTENTION_FMA_CLONE __attribute__((noinline)) void score_tokens_portable_fma(
    const Source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, const split_scratch& w) {
  score_tokens_portable(src, kv_head, q, heads, t0, t1, w);
}

template <class Source>
LYNX_ATTENTION_FMA_CLONE __attribute__((noinline)) void values_portable_fma(
    const Source& src, std::int64_t kv_head, int heads, std::int64_t t0, std::int64_t t1,
    float* acc, const split_scratch& w) {
  values_portable(src, kv_head, heads, t0, t1, acc, w);
}
#endif

/// One split of one source for one query and one kv head: partial states of
/// `heads` query heads over tokens [t0, t1) with tokens before `first_visible` masked.
/// q: [heads][D], already multiplied by the softmax scale. m, l: [heads]; acc: [heads][D].
/// next: the split this worker walks after this one (for prefetches; never changes a result).
/// compute_split's portable walk (plain loops, the reference order), as built.
template <class Source, class Variant>
LYNX_ATTENTION_UNFUSED void compute_split_portable_unfused(
    const Source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, std::int64_t first_visible, const Variant& variant, const split_scratch& w,
    float* m, float* l, float* acc) {
  score_tokens_unfused(src, kv_head, q, heads, t0, t1, w);
  for (int h = 0; h < heads; ++h)
    softmax_split(w.scores + h * attention_split_tokens, t1 - t0, t0, first_visible, variant,
                  host_walk::baseline, m[h], l[h]);
  values_unfused(src, kv_head, heads, t0, t1, acc, w);
}

#if LYNX_ATTENTION_AVX512
/// The same walk compiled for AVX2 + FMA (host_has_fma).
template <class Source, class Variant>
LYNX_ATTENTION_FMA_CLONE void compute_split_portable_fma(
    const Source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, std::int64_t first_visible, const Variant& variant, const split_scratch& w,
    float* m, float* l, float* acc) {
  score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  for (int h = 0; h < heads; ++h)
    softmax_split(w.scores + h * attention_split_tokens, t1 - t0, t0, first_visible, variant,
                  host_walk::baseline, m[h], l[h]);
  values_portable_fma(src, kv_head, heads, t0, t1, acc, w);
}
#endif

#if LYNX_ATTENTION_AVX512
/// Whether the AVX2 dense kernels take this source: contiguous rows, head_dim a
/// multiple of 32 (bf16: the score lanes pair channels within 32) or of 16 (float);
/// bf16: the permuted queries must fit the value weight scratch (score_tokens_avx2).
template <class T>
bool avx2_supports(const dense_kv_source<T>& src) {
  return src.head_dim() % (std::is_same_v<T, bf16> ? 32 : 16) == 0 &&
         src.keys.channel_stride == 1 && src.values.channel_stride == 1 &&
         (!std::is_same_v<T, bf16> || src.head_dim() <= attention_split_tokens);
}

/// The AVX2 walk: the AVX2 kernels where they take the source, the portable loops
/// (compiled for AVX2 + FMA, everything inlined, no contraction) for the rest.
template <class Source, class Variant>
LYNX_ATTENTION_FMA_CLONE void compute_split_avx2(const Source& src, std::int64_t kv_head,
                                                 const float* q, int heads, std::int64_t t0,
                                                 std::int64_t t1, std::int64_t first_visible,
                                                 const Variant& variant, const split_scratch& w,
                                                 float* m, float* l, float* acc,
                                                 const next_split& next) {
  bool dense = false;  // a dense source the AVX2 kernels take
  if constexpr (requires { src.keys; }) {
    dense = avx2_supports(src);
    if (dense)
      score_tokens_avx2(src, kv_head, q, heads, t0, t1, w);
    else
      score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  } else if constexpr (requires { src.prefetch_block(true, 0, 0); }) {  // bit planes
    score_tokens_avx2(src, kv_head, q, heads, t0, t1, w, next);
  } else {  // merged codes
    score_tokens_portable_fma(src, kv_head, q, heads, t0, t1, w);
  }
  for (int h = 0; h < heads; ++h)
    softmax_split(w.scores + h * attention_split_tokens, t1 - t0, t0, first_visible, variant,
                  host_walk::avx2, m[h], l[h]);
  if constexpr (requires { src.keys; }) {
    if (dense) {
      accumulate_values_avx2(src, kv_head, heads, t0, t1, acc, w);
      return;
    }
  } else if constexpr (requires { src.prefetch_block(true, 0, 0); }) {
    if (avx2_value_planes(src)) {
      value_weights_avx2(src, kv_head, heads, t0, t1, w);
      accumulate_values_avx2(src, kv_head, heads, t0, t1, acc, w);
      return;
    }
  }
  values_portable_fma(src, kv_head, heads, t0, t1, acc, w);
}
#endif

/// One split walked as `walk` says (the AVX-512 kernels fall back to nothing:
/// the caller picks host_walk::avx512 only where avx512_supports).
template <class Source, class Variant>
void compute_split(const Source& src, std::int64_t kv_head, const float* q, int heads,
                   std::int64_t t0, std::int64_t t1, std::int64_t first_visible,
                   const Variant& variant, host_walk walk, const split_scratch& w, float* m,
                   float* l, float* acc, const next_split& next = {}) {
  (void)next;
#if LYNX_ATTENTION_AVX512
  if (walk == host_walk::avx512) {
    const std::int64_t n = t1 - t0;
    if constexpr (requires { src.view; })
      score_tokens_avx512(src, kv_head, q, heads, t0, t1, w, next);
    else
      score_tokens_avx512(src, kv_head, q, heads, t0, t1, w);
    for (int h = 0; h < heads; ++h)
      softmax_split(w.scores + h * attention_split_tokens, n, t0, first_visible, variant,
                    host_walk::avx512, m[h], l[h]);
    if constexpr (requires { src.view; }) {
      // the GFNI value kernels compute their weights pass by pass
      if (!gfni_values(src)) value_weights_avx512(src, kv_head, heads, t0, t1, w);
      accumulate_values_avx512(src, kv_head, heads, t0, t1, acc, w, next);
    } else {
      accumulate_values_avx512(src, kv_head, heads, t0, t1, acc, w);
    }
    return;
  }
  if (walk == host_walk::avx2) {
    compute_split_avx2(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l, acc, next);
    return;
  }
  if (walk == host_walk::fma) {
    compute_split_portable_fma(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l,
                               acc);
    return;
  }
#else
  (void)walk;
#endif
  compute_split_portable_unfused(src, kv_head, q, heads, t0, t1, first_visible, variant, w, m, l,
                                 acc);
}

/// Whether a dense prompt's splits are walked for several kv heads at once
/// (compute_split_heads): bf16 on the AVX-512 path, the kv heads of a token side by
/// side in one row (token-major), and a group of 1, 2 or a multiple of 4 query
/// heads. Walked one kv head at a time, such a cache is read in 256-byte pieces a
/// row apart, which the hardware prefetchers do not follow: on AMD Zen 4 (one
/// thread, 32K tokens, min of alternating rounds) the bf16 baseline took 11.2-11.4
/// ms that way, 7.7 ms on a head-major copy of the same cache, and 8.7 ms with the
/// keys of all kv heads walked together (4K tokens: 0.97 -> 0.83 ms).
inline bool dense_heads_together(const kv_view<const bf16, host_space>& k,
                                 const kv_view<const bf16, host_space>& v, int heads) {
  auto together = [](const kv_view<const bf16, host_space>& x) {
    return x.shape.kv_heads > 1 && x.channel_stride == 1 && x.head_stride == x.shape.head_dim &&
           x.token_stride >= x.shape.kv_heads * x.shape.head_dim;
  };
  return together(k) && together(v) && (heads <= 2 || heads % 4 == 0);
}

#if LYNX_ATTENTION_AVX512
/// compute_split for kv heads [g0, g0 + gn) of a dense bf16 prompt on the AVX-512
/// path (dense_heads_together): the same scores, softmax and value sums per kv head,
/// so the same bits, with the rows of all gn kv heads read together. q:
/// [gn][heads][D]; the state (m, l, acc) of kv head g0 + j at state0 + j * state_stride.
template <class Variant>
void compute_split_heads(const dense_kv_source<bf16>& src, std::int64_t g0, int gn, const float* q,
                         int heads, std::int64_t t0, std::int64_t t1, std::int64_t first_visible,
                         const Variant& variant, const split_scratch& w, float* state0,
                         std::int64_t state_stride) {
  const std::int64_t n = t1 - t0;
  score_heads_bf16_avx512(src, g0, gn, q, heads, t0, t1, w);
  for (int j = 0; j < gn; ++j) {
    float* state = state0 + j * state_stride;
    for (int h = 0; h < heads; ++h)
      softmax_split(w.scores + (j * heads + h) * attention_split_tokens, n, t0, first_visible,
                    variant, host_walk::avx512, state[h], state[heads + h]);
  }
  // values one kv head at a time: walked together like the keys, they measured
  // slower (32-token blocks of every kv head in turn, sums kept in memory between
  // blocks: 9.8 ms against 8.4 ms at 32K tokens, one thread, AMD Zen 4)
  for (int j = 0; j < gn; ++j) {
    split_scratch wj = w;
    wj.scores = w.scores + j * heads * attention_split_tokens;
    accumulate_values_avx512(src, g0 + j, heads, t0, t1, state0 + j * state_stride + 2 * heads, wj);
  }
}
#endif

}  // namespace lynx::detail
