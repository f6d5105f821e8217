// Portable kernels of the host attention walk (plain loops, the reference
// order): query folding, scores, value weights and value sums of bit-plane,
// code and dense sources, and exp2 of the softmax.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "lynx/backend/host/attention/decode_portable.hpp"
#include "lynx/backend/host/attention/scratch.hpp"
#include "lynx/backend/host/attention/sources.hpp"
#include "lynx/backend/host/attention/target.hpp"
#include "lynx/backend/host/attention/tile_math.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/types.hpp"
#include "lynx/planes/stream_plan.hpp"

namespace lynx::detail {

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

/// The plane counts the walks are compiled for (every level of the named plans,
/// and of 8 = 2 + 6, 8 = 6 + 2, 16 = 8 + 8): loops over their planes unroll and
/// the loops around them vectorize. One walk serves every plan, so a count is
/// compiled once for all plans. Other counts run the same operations with the
/// count known at run time (P = 0 below).
inline constexpr int compiled_plane_counts[] = {2, 4, 6, 8, 12, 16};

inline bool plane_count_compiled(int planes) {
  for (const int p : compiled_plane_counts)
    if (planes == p) return true;
  return false;
}

/// with_plane_count for kernels compiled for the counts of compiled_plane_counts
/// only (the caller checked plane_count_compiled).
template <class F>
void with_compiled_plane_count(int planes, F&& f) {
  switch (planes) {
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 8:
      return f(std::integral_constant<int, 8>{});
    case 12:
      return f(std::integral_constant<int, 12>{});
    default:
      return f(std::integral_constant<int, 16>{});
  }
}

/// Calls f(std::integral_constant<int, P>) with P = planes if it is one of
/// compiled_plane_counts, else with P = 0 (any count, given at run time).
template <class F>
void with_plane_count(int planes, F&& f) {
  if (plane_count_compiled(planes))
    with_compiled_plane_count(planes, f);
  else
    f(std::integral_constant<int, 0>{});
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
inline void score_tokens_portable(const plane_kv_source& src, std::int64_t kv_head, const float* q,
                                  int heads, std::int64_t t0, std::int64_t t1,
                                  const split_scratch& w) {
  const int D = static_cast<int>(src.view.geometry.head_dim);
  score_blocks_portable(src, kv_head, q, heads, t0, t1, w, true, [&](std::int64_t b) {
    const std::uint32_t* rows[16];
    src.block_rows(true, kv_head, b, rows);
    with_plane_count(src.planes,
                     [&](auto p) { decode_key_tile_portable<p()>(rows, D, w.tile, src.planes); });
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
  const bf16* vs = src.view.value_scale() + kv_head * g.tokens * groups;
  const bf16* vz = src.view.value_zero() + kv_head * g.tokens * groups;
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
              fold_value_token(p[i - t0], static_cast<float>(vs[i * groups + grp]),
                               static_cast<float>(vz[i * groups + grp]), unit, half);
          out[i - t0] = vw.weight;
          lane[l] = value_offset_step(lane[l], p[i - t0], vw.shift);
        }
      for (; t < t1; ++t) {
        const value_token_weight vw =
            fold_value_token(p[t - t0], static_cast<float>(vs[t * groups + grp]),
                             static_cast<float>(vz[t * groups + grp]), unit, half);
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
inline void accumulate_values_portable(const plane_kv_source& src, std::int64_t kv_head, int heads,
                                       std::int64_t t0, std::int64_t t1, float* acc,
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
    with_plane_count(src.planes,
                     [&](auto p) { decode_value_block_portable<p()>(rows, D, tile, src.planes); });
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

}  // namespace lynx::detail
