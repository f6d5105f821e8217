// AVX-512 scores and value sums of bit-plane prompts (GFNI decoded in
// registers) and of stored codes (code_kv_source), with their walks over a split.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "lynx/backend/host/attention/avx512_common.hpp"
#include "lynx/backend/host/attention/avx512_decode.hpp"
#include "lynx/backend/host/isa.hpp"
#include "lynx/backend/host/prefetch.hpp"
#include "lynx/core/dispatch.hpp"

#if LYNX_ATTENTION_AVX512
// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into target functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail {

/// Scores of HC heads against one key block, decoding 16 channels at a time in
/// registers (no tile in memory) and multiplying right away; each head's two
/// token halves accumulate in channel order, exactly as score_block_avx512.
/// Any head_dim: a last chunk of D % 16 channels reads only those channels.
/// Two: more than 8 planes. `walk` steps Lines lines every other channel, into
/// the cache level of Hint.
template <int HC, bool Two, int Lines, int Hint>
LYNX_ATTENTION_GFNI_TARGET void score_block_fused_gfni(const std::uint32_t* const* rows, int planes,
                                                       int D, const float* qs, const float* bias,
                                                       float* out, prefetch_walk& walk_io) {
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
LYNX_ATTENTION_AVX512_TARGET void score_code_block_avx512(const Code* kb, int D, const float* qs,
                                                          const float* bias, float* out,
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
  const bf16 *scale, *zero;  // the layer's key parameters
  std::int64_t first_group;  // kv_head * key_token_groups
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

LYNX_ATTENTION_AVX512_TARGET inline void score_tokens_avx512(
    const plane_kv_source& src, std::int64_t kv_head, const float* q, int heads, std::int64_t t0,
    std::int64_t t1, const split_scratch& w, const next_split& next = {}) {
  const int nb = static_cast<int>((t1 + attention_block_tokens - 1) / attention_block_tokens -
                                  t0 / attention_block_tokens);
  const layer_geometry& g = src.view.geometry;
  const int D = static_cast<int>(g.head_dim);
  const std::int64_t KG = g.key_group;
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
    const std::int64_t grp = tb / KG;  // KG % 32 == 0: one key group per block
    fold(grp);
    if (tb + attention_block_tokens < t1) fold((tb + attention_block_tokens) / KG);
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
          (kv_head * g.key_token_groups() + (b + prefetch_blocks) * attention_block_tokens / KG) *
          D;
      prefetch_lines<3>(src.view.key_scale() + pf, D * 2);
      prefetch_lines<3>(src.view.key_zero() + pf, D * 2);
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
LYNX_ATTENTION_AVX512_TARGET inline void accumulate_values_avx512(
    const plane_kv_source& src, std::int64_t kv_head, int heads, std::int64_t t0, std::int64_t t1,
    float* acc, const split_scratch& w, const next_split& next = {}) {
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
LYNX_ATTENTION_AVX512_TARGET void add_value_codes_avx512(const Code* rows, int D,
                                                         std::int64_t pairs,
                                                         const float* const (*wr)[NC], float* out,
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

}  // namespace lynx::detail

// With lynx::kernels linked, these kernels are compiled there once (not
// `inline`, so the declaration below keeps every other file from compiling them).
// LYNX_KERNELS_SIMD_LINKED: a file that links the library's archive without its
// other declarations (a test built header-only for -march=native) takes these
// from it too: intrinsics, the same instructions whatever the file's flags.
#if defined(LYNX_KERNELS) || defined(LYNX_KERNELS_SIMD_LINKED)
#include "lynx/kernels/instances.hpp"
LYNX_KERNELS_SIMD(extern)
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // LYNX_ATTENTION_AVX512
