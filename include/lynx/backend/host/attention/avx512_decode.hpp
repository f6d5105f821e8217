// AVX-512 decoders of one 32-token block of bit planes: keys into a float tile
// by bit rotation, and the GFNI bit-matrix transposes (16 channels at a time)
// that the bit-plane kernels and code_tensor use.
#pragma once

#include <cstdint>

#include "lynx/backend/host/attention/target.hpp"
#include "lynx/backend/host/attention/tile_math.hpp"
#include "lynx/core/config.hpp"

#if LYNX_ATTENTION_AVX512
// GCC 12's AVX-512 headers build "undefined" vectors from self-initialised
// locals, which -Wuninitialized reports once inlined into target functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lynx::detail {

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

}  // namespace lynx::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // LYNX_ATTENTION_AVX512
