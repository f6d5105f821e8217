// Decode attention on the GPU, split-K (flash-decoding style): queries of
// consecutive positions attend to a prompt (a bit-plane tensor at its current
// precision level, reconstructed in registers; or a dense bf16/float cache, the
// 16-bit baseline) followed by a local full-precision tail. Same shapes and
// semantics as the host functor (attention/decode_attention.hpp):
//
//   queries  [n_queries][q_heads][head_dim] float (device)
//   output   [n_queries][q_heads][head_dim] float (device); lse [n_queries][q_heads] (optional)
//   query i sees every prompt token and tail tokens [0, vis(i))
//
// Two kernels:
//   chunk_kernel    CTA per (chunk of 256 context tokens, kv head, tile of 8
//                   (query, group head) pairs). All pairs of a kv head share the
//                   CTA, so K/V bytes are read once per chunk (a second tile, for
//                   more than 8 pairs, re-reads them from L2). Per 32-token block:
//                   stage   K: thread (channel, token lane) decodes its plane words
//                           4 (8-bit codes) or 2 (12/16-bit) tokens at a time
//                           (rotate + mask into byte/halfword fields), builds the
//                           level float(prefix << (B-P)) + half exactly and
//                           reconstructs it with quant/quantizer.hpp's
//                           reconstruct_from_level: the host's values, bit for bit;
//                           into a [head_dim][33] shared tile (conflict-free both ways)
//           score   warp task = (4 pairs, 1/8 of the channels), lane = token,
//                   channel order inside the eighth; eighths summed by a fixed tree
//           softmax warp = pair, lane = token: online max / exp2 / fixed-tree sum
//           values  thread = (4 pairs, channel), token order 0..31 per block
//   combine_kernel  per (query, q head): chunk states merged in context order.
//
// Batch invariance: every number a pair's result depends on is computed by the
// same operations in the same order whatever the launch: chunk boundaries are
// fixed by context position (attention_split_tokens / 4 tokens), the reduction
// trees are fixed, and a block with no token visible to a pair leaves its state
// untouched (not even a +0 added), so a query's bits do not depend on which or
// how many other queries share the launch. nvcc's default FMA contraction is
// the same for every launch shape; no atomics.
//
// API (CUB style): call with workspace == nullptr to learn the workspace size,
// then with a workspace of at least that many bytes (16-byte aligned). Shape
// errors throw lynx::error before anything is launched; CUDA failures are returned.
//
// Non-finite input: a NaN or infinity in a query or in the K/V a query sees
// makes that query's outputs NaN, never a finite wrong value. As the host's
// softmax does, a non-finite logit turns its chunk's sum into NaN (the max stays
// finite, the chunk adds no weight); NaN or infinity in a value reaches the output
// through the multiply-adds. The combine kernel records the first such output in
// the workspace; check_attention_status, after the stream, throws lynx::error
// naming it (the launch itself cannot throw once it is queued).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "lynx/attention/decode_attention.hpp"
#include "lynx/attention/variant.hpp"
#include "lynx/backend/cuda/codec.cuh"
#include "lynx/backend/cuda/error.cuh"
#include "lynx/backend/host/attention/tile_math.hpp"
#include "lynx/core/dispatch.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/quant/quantizer.hpp"

namespace lynx::cuda {

/// Context tokens of one chunk: the unit of one partial state on the device.
/// A host split (attention_split_tokens) is 4 chunks, so that a 4,096-token
/// prompt still gives 16 x kv_heads CTAs. Fixed by context position: the
/// partial states a query gets do not depend on the launch.
inline constexpr std::int64_t attention_chunk_tokens = attention_split_tokens / 4;
/// (query, group head) pairs per CTA: one warp per pair in the softmax step.
inline constexpr int attention_pairs_per_cta = 8;
inline constexpr int attention_threads = 256;
/// head_dim values the kernels are compiled for.
inline constexpr int attention_head_dims[] = {8, 64, 128, 256};

/// What a decode attention call found, at the start of its workspace (written by
/// its kernels; read with check_attention_status after the stream).
struct attention_status {
  /// The first output that is not finite: (query * q_heads + head) << 32 | the
  /// first chunk whose logits for it were not finite (0xffffffff: none, so a
  /// value it weighs was); attention_no_problem when every output is finite.
  unsigned long long non_finite_output;
  std::int32_t q_heads;        // of the call, to name the query and head
  std::int32_t prompt_chunks;  // of the call: chunk k < prompt_chunks is prompt tokens
};
inline constexpr unsigned long long attention_no_problem = ~0ull;
/// Bytes the status takes at the start of a workspace (the partial states follow).
inline constexpr std::int64_t attention_status_bytes = 256;

/// A dense prompt cache in device memory (the 16-bit baseline, or an engine that
/// reconstructed to bf16): [tokens][kv_heads][head_dim] at any strides.
template <class T>
struct dense_prompt {
  kv_view<const T, device_space> keys, values;
};

/// The shape facts of a call: as the host's attention_problem, with chunks.
struct attention_launch_shape {
  std::int64_t n_queries = 0, q_heads = 1, kv_heads = 1, head_dim = 0;
  std::int64_t prompt_tokens = 0, max_tail_visible = 0;
  [[nodiscard]] std::int64_t group_heads() const { return q_heads / kv_heads; }
  [[nodiscard]] std::int64_t prompt_chunks() const {
    return ceil_div(prompt_tokens, attention_chunk_tokens);
  }
  [[nodiscard]] std::int64_t tail_chunks() const {
    return ceil_div(max_tail_visible, attention_chunk_tokens);
  }
  [[nodiscard]] std::int64_t chunks() const { return prompt_chunks() + tail_chunks(); }
  [[nodiscard]] std::int64_t pair_tiles() const {
    return ceil_div(n_queries * group_heads(), attention_pairs_per_cta);
  }
  /// Workspace: the attention_status (attention_status_bytes), partial states
  /// (m, l) [n_queries][q_heads][chunks] as float2, then acc
  /// [n_queries][q_heads][chunks][head_dim].
  [[nodiscard]] std::size_t state_pairs() const {
    return static_cast<std::size_t>(n_queries * q_heads * chunks());
  }
  [[nodiscard]] std::size_t workspace_bytes() const {
    const std::size_t ml =
        static_cast<std::size_t>(align_up(static_cast<std::int64_t>(state_pairs() * 8), 256));
    return attention_status_bytes + ml + state_pairs() * static_cast<std::size_t>(head_dim) * 4 +
           256;
  }
  [[nodiscard]] dim3 chunk_grid() const {
    return dim3(static_cast<unsigned>(chunks()), static_cast<unsigned>(kv_heads),
                static_cast<unsigned>(pair_tiles()));
  }
};

namespace detail {

// ---------------------------------------------------------------------------
// Sources: how a 32-token block of K or V becomes a float tile in shared memory.
// ---------------------------------------------------------------------------

inline constexpr int tile_stride = tokens_per_word + 1;  // floats per channel row of a staged tile

/// Shared-memory layout of chunk_kernel for head_dim D, in floats.
template <int D>
struct attention_smem {
  static constexpr int tile = 0;  // [D][33]: K or V of one block, [channel][token]
  static constexpr int queries =
      (D * tile_stride + 3) & ~3;  // [D][8]: scaled queries, [channel][pair]
  static constexpr int parts =
      queries + D * attention_pairs_per_cta;  // [8 eighths][8 pairs][32 tokens]
  static constexpr int probs =
      parts + 8 * attention_pairs_per_cta * 32;  // [32 tokens][8 pairs]: p of the block
  static constexpr int alpha =
      probs + 32 * attention_pairs_per_cta;  // [8]: rescale of the pair's state
  static constexpr int live =
      alpha + attention_pairs_per_cta;  // [8]: tokens of the block the pair sees (int)
  static constexpr int first =
      live + attention_pairs_per_cta;  // [8]: first token of the block the pair sees (int)
  static constexpr int floats = first + attention_pairs_per_cta;
  static constexpr std::size_t bytes = static_cast<std::size_t>(floats) * 4;
};

/// A bf16 parameter through the read-only cache, as a float (exact).
__device__ __forceinline__ float param_ldg(const bf16* p) {
  return lynx::detail::bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
}

/// Bit-plane source at `planes` of Bits planes (a device view's first streams).
template <int Bits, int G>
struct plane_source {
  plane_rows<const std::uint32_t> key_rows, value_rows;  // plane j of (head, block, channel)
  // the anchor's bf16 parameters, read where it lies
  const bf16* key_scale;  // [kv_heads][key_token_groups][head_dim]
  const bf16* key_zero;
  const bf16* value_scale;  // [kv_heads][tokens][value_channel_groups]
  const bf16* value_zero;
  std::int64_t tokens, blocks, key_groups, value_groups;
  int planes;
  float level_bias;  // 2^23 - half: (2^23 + x) - level_bias == x + half exactly
};

/// Full-precision source (the tail, or a dense prompt).
template <class T>
struct dense_source {
  kv_view<const T, device_space> keys, values;
};

/// Field of token lanes: 8-bit codes use byte fields (4 tokens per thread),
/// wider codes halfword fields (2 tokens per thread).
template <int Bits>
struct code_fields {
  static constexpr int per_word = Bits <= 8 ? 4 : 2;        // tokens decoded per thread
  static constexpr int lanes = tokens_per_word / per_word;  // token lanes: 8 or 16
  static constexpr std::uint32_t replicate = Bits <= 8 ? 0x01010101u : 0x00010001u;
};

/// Byte-permute selector putting field k of a decoded word into the low bits
/// of 0x4B0000xx (or 0x4B00xxxx): the float 2^23 + field.
template <int Bits>
__device__ __forceinline__ std::uint32_t magic_field(std::uint32_t code, int k) {
  if constexpr (Bits <= 8) {
    return __byte_perm(code, 0x4B000000u, 0x7540u | static_cast<std::uint32_t>(k));
  } else {
    return __byte_perm(code, 0x4B000000u,
                       0x7400u | static_cast<std::uint32_t>((2 * k + 1) << 4 | (2 * k)));
  }
}

/// Stages block b (first context token t_base of the part, `valid` tokens
/// present) of head h into tile[c][t]; tokens past `valid` are 0.
template <bool Keys, int D, int Bits, int G>
__device__ __forceinline__ void stage_block(const plane_source<Bits, G>& s, std::int64_t h,
                                            std::int64_t b, int valid, float* tile) {
  using F = code_fields<Bits>;
  const plane_rows<const std::uint32_t>& rows = Keys ? s.key_rows : s.value_rows;
  constexpr int VG = G < D ? G : D;  // value group (channels); make_geometry's rule
  const std::int64_t t_base = b * tokens_per_word;
  for (int item = static_cast<int>(threadIdx.x); item < D * F::lanes; item += attention_threads) {
    const int c = item % D,
              r = item / D;  // consecutive threads: consecutive channels' words (coalesced)
    std::uint32_t code = 0;
    for (int j = 0; j < s.planes; ++j) {
      const std::uint32_t w =
          __ldg(rows.base[j] + (h * s.blocks + b) * rows.head_block_stride[j] + c);
      // token r + lanes*k's bit (bit r + lanes*k of w) goes to bit Bits-1-j of field k
      const int pos = Bits - 1 - j;
      const std::uint32_t rot = __funnelshift_r(w, w, static_cast<unsigned>(r - pos) & 31u);
      code |= rot & (F::replicate << pos);
    }
    float scale = 0.0f, zero = 0.0f;
    if constexpr (Keys && G % tokens_per_word == 0) {
      const std::int64_t i = (h * s.key_groups + t_base / G) * D + c;  // one key group per block
      scale = param_ldg(s.key_scale + i);
      zero = param_ldg(s.key_zero + i);
    }
#pragma unroll
    for (int k = 0; k < F::per_word; ++k) {
      const int t = r + F::lanes * k;
      float x = 0.0f;
      if (t < valid) {
        if constexpr (Keys && G % tokens_per_word != 0) {
          const std::int64_t i = (h * s.key_groups + (t_base + t) / G) * D + c;
          scale = param_ldg(s.key_scale + i);
          zero = param_ldg(s.key_zero + i);
        } else if constexpr (!Keys) {
          const std::int64_t i = (h * s.tokens + t_base + t) * s.value_groups + c / VG;
          scale = param_ldg(s.value_scale + i);
          zero = param_ldg(s.value_zero + i);
        }
        // level = float(prefix << (Bits - P)) + half, exactly as the host computes it
        const float level = __fsub_rn(__uint_as_float(magic_field<Bits>(code, k)), s.level_bias);
        x = reconstruct_from_level(level, {scale, zero});
      }
      tile[c * tile_stride + t] = x;
    }
  }
}

template <bool Keys, int D, class T>
__device__ __forceinline__ void stage_block(const dense_source<T>& s, std::int64_t h,
                                            std::int64_t b, int valid, float* tile) {
  const kv_view<const T, device_space>& x = Keys ? s.keys : s.values;
  const std::int64_t t_base = b * tokens_per_word;
  for (int item = static_cast<int>(threadIdx.x); item < D * tokens_per_word;
       item += attention_threads) {
    const int c = item % D,
              t = item / D;  // consecutive threads: consecutive channels of a row (coalesced)
    tile[c * tile_stride + t] = t < valid ? to_float(x(t_base + t, h, c)) : 0.0f;
  }
}

// ---------------------------------------------------------------------------
// The chunk kernel
// ---------------------------------------------------------------------------

struct chunk_params {
  attention_status* status;  // reset by the first CTA, then written by combine_kernel
  const float* queries;      // [n_queries][q_heads][D]
  float2* ml;                // [n_queries][q_heads][chunks]: (m, l) of each chunk (log2 domain)
  float* acc;                // [n_queries][q_heads][chunks][D]
  std::int64_t n_queries, q_heads, group_heads;
  std::int64_t prompt_tokens, max_tail_visible;
  std::int64_t tail_base, tail_per_query;  // vis(i) = base + per_query * (i + 1)
  std::int64_t window;                     // 0: unlimited
  int prompt_chunks, chunks;
  float query_scale;
  float soft_cap;  // > 0: logit -> cap * tanh(logit / cap)
};

/// Sum of the 8 channel-eighth partials of a score: ((0+1)+(2+3))+((4+5)+(6+7)).
__device__ __forceinline__ float sum_eighths(const float* p, int stride) {
  const float a = __fadd_rn(p[0], p[stride]), b = __fadd_rn(p[2 * stride], p[3 * stride]);
  const float c = __fadd_rn(p[4 * stride], p[5 * stride]),
              d = __fadd_rn(p[6 * stride], p[7 * stride]);
  return __fadd_rn(__fadd_rn(a, b), __fadd_rn(c, d));
}

template <int D, class PromptSrc, class TailSrc>
__global__ void __launch_bounds__(attention_threads)
    chunk_kernel(PromptSrc prompt, TailSrc tail, chunk_params p) {
  constexpr int PT = attention_pairs_per_cta;
  using L = attention_smem<D>;
  extern __shared__ float4 smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  float* tile = smem + L::tile;
  float* qs = smem + L::queries;
  float* parts = smem + L::parts;
  float* probs = smem + L::probs;
  float* alpha_s = smem + L::alpha;
  int* live_s = reinterpret_cast<int*>(smem + L::live);
  int* first_s = reinterpret_cast<int*>(smem + L::first);

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int chunk = static_cast<int>(blockIdx.x);
  const std::int64_t g = blockIdx.y;
  const std::int64_t pair0 = static_cast<std::int64_t>(blockIdx.z) *
                             PT;  // first pair of the tile: pair = query * group_heads + head
  const std::int64_t group_pairs = p.n_queries * p.group_heads;
  const int npairs = static_cast<int>(group_pairs - pair0 < PT ? group_pairs - pair0 : PT);
  const bool in_prompt = chunk < p.prompt_chunks;
  const std::int64_t c0 = (in_prompt ? chunk : chunk - p.prompt_chunks) *
                          attention_chunk_tokens;  // first token of the part
  const std::int64_t part_end = in_prompt ? p.prompt_tokens : p.max_tail_visible;
  const std::int64_t c1 =
      c0 + attention_chunk_tokens < part_end ? c0 + attention_chunk_tokens : part_end;
  // the status of this call: combine_kernel, which runs after every CTA here, writes it
  if (tid == 0 && chunk == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    *p.status = {attention_no_problem, static_cast<std::int32_t>(p.q_heads), p.prompt_chunks};

  // scaled queries, [channel][pair]; padding pairs 0
  for (int i = tid; i < D * PT; i += attention_threads) {
    const int c = i / PT, k = i % PT;
    float x = 0.0f;
    if (k < npairs) {
      const std::int64_t pair = pair0 + k, q = pair / p.group_heads, hh = pair % p.group_heads;
      x = p.queries[(q * p.q_heads + g * p.group_heads + hh) * D + c] * p.query_scale;
    }
    qs[c * PT + k] = x;
  }

  // this warp's pair for the softmax step: what it sees of this chunk's part,
  // as [first, end) token indices of the part
  std::int64_t see_first = 0, see_end = 0;
  if (warp < npairs) {
    const std::int64_t q = (pair0 + warp) / p.group_heads;
    const std::int64_t visible = p.tail_base + p.tail_per_query * (q + 1);
    const std::int64_t qpos = p.prompt_tokens + visible - 1;
    const std::int64_t first_pos = p.window > 0 ? qpos - p.window + 1 : 0;
    see_first = in_prompt ? first_pos : first_pos - p.prompt_tokens;
    see_end = in_prompt ? p.prompt_tokens : visible;
  }
  float m_run = attention_neg_inf, l_run = 0.0f;

  // value accumulators: item (quad, channel), 4 pairs each
  constexpr int items = (PT / 4 * D + attention_threads - 1) / attention_threads;
  float acc[items][4];
#pragma unroll
  for (int it = 0; it < items; ++it)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[it][k] = 0.0f;

  for (std::int64_t tb = c0; tb < c1; tb += tokens_per_word) {
    const std::int64_t b = tb / tokens_per_word;
    const int valid = static_cast<int>(c1 - tb < tokens_per_word ? c1 - tb : tokens_per_word);
    __syncthreads();  // previous block's value step is done with the tile
    if (in_prompt)
      stage_block<true, D>(prompt, g, b, valid, tile);
    else
      stage_block<true, D>(tail, g, b, valid, tile);
    __syncthreads();

    // scores: task (quad, eighth); lane = token; channels of the eighth in order
    for (int task = warp; task < PT / 4 * 8; task += attention_threads / 32) {
      const int quad = task / 8, e = task % 8;
      if (quad * 4 >= npairs) continue;
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
      for (int c = e * (D / 8); c < (e + 1) * (D / 8); ++c) {
        const float k = tile[c * tile_stride + lane];
        const float4 q4 = *reinterpret_cast<const float4*>(qs + c * PT + quad * 4);
        s[0] = __fmaf_rn(q4.x, k, s[0]);
        s[1] = __fmaf_rn(q4.y, k, s[1]);
        s[2] = __fmaf_rn(q4.z, k, s[2]);
        s[3] = __fmaf_rn(q4.w, k, s[3]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) parts[(e * PT + quad * 4 + k) * 32 + lane] = s[k];
    }
    __syncthreads();

    // online softmax: warp = pair, lane = token
    if (warp < npairs) {
      const std::int64_t t = tb + lane;
      const bool seen = t >= see_first && t < see_end && lane < valid;
      float logit = sum_eighths(parts + warp * 32 + lane, PT * 32);
      if (p.soft_cap > 0.0f) logit = p.soft_cap * tanhf(logit / p.soft_cap);
      const float s2 = seen ? logit * attention_log2e : attention_neg_inf;
      // a visible logit that is not finite (softmax_split's rule): fmaxf and exp2
      // would pass over it; the pair's sum becomes NaN, its max stays finite and the
      // block adds no weight, so the output is NaN and combine_kernel reports it
      const bool bad = __any_sync(0xffffffffu, seen && !isfinite(s2));
      float bmax = s2;
#pragma unroll
      for (int o = 16; o >= 1; o /= 2) bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, o));
      const bool active = !bad && bmax > attention_neg_inf;  // uniform over the warp
      float prob = 0.0f, alpha = 1.0f;
      if (bad) {
        l_run = __int_as_float(0x7fc00000);  // quiet NaN
        m_run = m_run > attention_neg_inf ? m_run : 0.0f;
      } else if (active) {
        const float m_new = m_run > bmax ? m_run : bmax;
        prob = seen ? attention_exp2(s2 - m_new) : 0.0f;
        float sum = prob;  // fixed tree: lane l += lane l + w, w = 16, 8, 4, 2, 1; lane 0's result
#pragma unroll
        for (int o = 16; o >= 1; o /= 2)
          sum = __fadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, o));
        sum = __shfl_sync(0xffffffffu, sum, 0);
        alpha = attention_exp2(m_run - m_new);  // m_run = -inf: 0
        l_run = __fmaf_rn(l_run, alpha, sum);
        m_run = m_new;
      }
      probs[lane * PT + warp] = prob;
      if (lane == 0) {
        alpha_s[warp] = alpha;
        // tokens [first, live) of the block may carry weight for this pair; none when inactive
        const std::int64_t f = see_first - tb, e = see_end - tb;
        first_s[warp] = active ? static_cast<int>(f < 0 ? 0 : f) : 0;
        live_s[warp] = active ? static_cast<int>(e < valid ? e : valid) : 0;
      }
    } else if (warp < PT) {
      probs[lane * PT + warp] = 0.0f;
      if (lane == 0) {
        alpha_s[warp] = 1.0f;
        first_s[warp] = 0;
        live_s[warp] = 0;
      }
    }

    // values of the block (the tile is free once the scores are in `parts`)
    if (in_prompt)
      stage_block<false, D>(prompt, g, b, valid, tile);
    else
      stage_block<false, D>(tail, g, b, valid, tile);
    __syncthreads();

#pragma unroll
    for (int it = 0; it < items; ++it) {
      const int item = tid + it * attention_threads;
      const int quad = item / D, c = item % D;
      if (item >= PT / 4 * D || quad * 4 >= npairs) continue;
      const float* v = tile + c * tile_stride;
      // tokens [lo, hi) carry weight for every pair of the quad; the others only for some
      int lo = 0, hi = tokens_per_word, any_lo = tokens_per_word, any_hi = 0;
      float a[4];
      bool live[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int f = first_s[quad * 4 + k], e = live_s[quad * 4 + k];
        live[k] = e > f;
        a[k] = __fmul_rn(acc[it][k], alpha_s[quad * 4 + k]);
        if (live[k]) {
          lo = f > lo ? f : lo;
          hi = e < hi ? e : hi;
          any_lo = f < any_lo ? f : any_lo;
          any_hi = e > any_hi ? e : any_hi;
        }
      }
      if (any_hi == 0) continue;  // no pair of the quad sees this block: states unchanged
      if (hi < lo) hi = lo;
      // a pair adds w * v for each token in its own [first, live), in token order;
      // a pair with nothing to add keeps its state unchanged (bitwise)
      for (int t = any_lo; t < lo; ++t) {
        const float4 w = *reinterpret_cast<const float4*>(probs + t * PT + quad * 4);
        const float x = v[t];
        if (t >= first_s[quad * 4 + 0] && t < live_s[quad * 4 + 0]) a[0] = __fmaf_rn(w.x, x, a[0]);
        if (t >= first_s[quad * 4 + 1] && t < live_s[quad * 4 + 1]) a[1] = __fmaf_rn(w.y, x, a[1]);
        if (t >= first_s[quad * 4 + 2] && t < live_s[quad * 4 + 2]) a[2] = __fmaf_rn(w.z, x, a[2]);
        if (t >= first_s[quad * 4 + 3] && t < live_s[quad * 4 + 3]) a[3] = __fmaf_rn(w.w, x, a[3]);
      }
      for (int t = lo; t < hi; ++t) {
        const float4 w = *reinterpret_cast<const float4*>(probs + t * PT + quad * 4);
        const float x = v[t];
        a[0] = __fmaf_rn(w.x, x, a[0]);
        a[1] = __fmaf_rn(w.y, x, a[1]);
        a[2] = __fmaf_rn(w.z, x, a[2]);
        a[3] = __fmaf_rn(w.w, x, a[3]);
      }
      for (int t = hi > any_lo ? hi : any_lo; t < any_hi; ++t) {
        const float4 w = *reinterpret_cast<const float4*>(probs + t * PT + quad * 4);
        const float x = v[t];
        if (t >= first_s[quad * 4 + 0] && t < live_s[quad * 4 + 0]) a[0] = __fmaf_rn(w.x, x, a[0]);
        if (t >= first_s[quad * 4 + 1] && t < live_s[quad * 4 + 1]) a[1] = __fmaf_rn(w.y, x, a[1]);
        if (t >= first_s[quad * 4 + 2] && t < live_s[quad * 4 + 2]) a[2] = __fmaf_rn(w.z, x, a[2]);
        if (t >= first_s[quad * 4 + 3] && t < live_s[quad * 4 + 3]) a[3] = __fmaf_rn(w.w, x, a[3]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (live[k]) acc[it][k] = a[k];
    }
  }

  // partial states of this chunk
  const std::int64_t chunks = p.chunks;
  auto state_index = [&](int k) {
    const std::int64_t pair = pair0 + k, q = pair / p.group_heads, hh = pair % p.group_heads;
    return (q * p.q_heads + g * p.group_heads + hh) * chunks + chunk;
  };
  if (warp < npairs && lane == 0) p.ml[state_index(warp)] = make_float2(m_run, l_run);
#pragma unroll
  for (int it = 0; it < items; ++it) {
    const int item = tid + it * attention_threads;
    const int quad = item / D, c = item % D;
    if (item >= PT / 4 * D) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (quad * 4 + k < npairs) p.acc[state_index(quad * 4 + k) * D + c] = acc[it][k];
  }
}

/// Merges the chunk states of one (query, q head) in context order (the same
/// operations as merge_partial_state), normalizes, writes the log-sum-exp.
/// Block: one thread per channel (every thread repeats the scalar m, l steps).
/// An output that is not finite is recorded in `status` (the smallest row wins).
template <int D>
__global__ void __launch_bounds__(D < 32 ? 32 : D)
    combine_kernel(const float2* ml, const float* acc, int chunks, float* out, float* lse,
                   attention_status* status) {
  const std::int64_t row = blockIdx.x;  // query * q_heads + head
  const int c = static_cast<int>(threadIdx.x);
  float m = attention_neg_inf, l = 0.0f, o = 0.0f;
  for (int s = 0; s < chunks; ++s) {
    const float2 st = ml[row * chunks + s];
    if (!(st.x > attention_neg_inf)) continue;
    const float a = c < D ? acc[(row * chunks + s) * D + c] : 0.0f;
    if (!(m > attention_neg_inf)) {
      m = st.x;
      l = st.y;
      o = a;
      continue;
    }
    const float mm = m > st.x ? m : st.x;
    const float wa = attention_exp2(m - mm), wb = attention_exp2(st.x - mm);
    l = __fmaf_rn(st.y, wb, __fmul_rn(l, wa));
    o = __fmaf_rn(a, wb, __fmul_rn(o, wa));
    m = mm;
  }
  const float r = __fmul_rn(o, __frcp_rn(l));
  if (c < D) out[row * D + c] = r;
  if (c == 0 && lse != nullptr) lse[row] = (m + log2f(l)) * attention_ln2;
  if (__syncthreads_or(c < D && !isfinite(r)) && c == 0) {
    unsigned long long chunk = 0xffffffffull;  // first chunk with a non-finite logit (sum NaN)
    for (int s = 0; s < chunks; ++s)
      if (isnan(ml[row * chunks + s].y)) {
        chunk = static_cast<unsigned long long>(s);
        break;
      }
    atomicMin(&status->non_finite_output, static_cast<unsigned long long>(row) << 32 | chunk);
  }
}

// ---------------------------------------------------------------------------
// Host side: sources, checks, launch
// ---------------------------------------------------------------------------

template <stream_plan_type Plan, int G>
plane_source<Plan::bits, G> make_plane_source(const bitplane_view<Plan, G, device_space>& v) {
  const layer_geometry& g = v.geometry;
  // The device kernels group values by min(G, head_dim) channels at compile time.
  ::lynx::detail::require(
      g.value_group == (G < g.head_dim ? G : g.head_dim), errc::shape_mismatch,
      "CUDA decode_attention: value groups of " + std::to_string(g.value_group) +
          " channels; the device kernels take min(G, head_dim) = " +
          std::to_string(G < g.head_dim ? G : g.head_dim) + " only (the host functor takes any)");
  const int P = v.planes();
  const std::byte* payload[max_streams] = {};
  for (int s = 0; s < Plan::streams; ++s) payload[s] = v.payload[static_cast<std::size_t>(s)];
  plane_source<Plan::bits, G> s{};
  s.key_rows = make_plane_rows<const std::uint32_t>(g, payload, true, P);
  s.value_rows = make_plane_rows<const std::uint32_t>(g, payload, false, P);
  s.key_scale = v.key_scale();
  s.key_zero = v.key_zero();
  s.value_scale = v.value_scale();
  s.value_zero = v.value_zero();
  s.tokens = g.tokens;
  s.blocks = g.blocks();
  s.key_groups = g.key_token_groups();
  s.value_groups = g.value_channel_groups();
  s.planes = P;
  s.level_bias = 8388608.0f - midpoint_offset<Plan::bits>(P);
  return s;
}

inline bool compiled_head_dim(std::int64_t d) {
  for (const int x : attention_head_dims)
    if (x == d) return true;
  return false;
}

/// Checks a call's shapes (throws lynx::error naming the values) and returns its launch shape.
template <class TailT>
attention_launch_shape check_call(std::int64_t prompt_tokens, std::int64_t prompt_kv_heads,
                                  std::int64_t prompt_head_dim, bool has_prompt,
                                  const kv_view<const TailT, device_space>& tk,
                                  const kv_view<const TailT, device_space>& tv,
                                  const attention_queries& q, tail_visibility vis) {
  using lynx::detail::require;
  require(!tk.paged() && !tv.paged(), errc::invalid_argument,
          "cuda attention: a paged tail is read by the host attention only (yet)");
  require(q.count >= 0 && q.q_heads >= 1 && q.head_dim >= 1, errc::shape_mismatch,
          "cuda attention: queries need q_heads >= 1 and head_dim >= 1, got count=" +
              std::to_string(q.count) + " q_heads=" + std::to_string(q.q_heads) +
              " head_dim=" + std::to_string(q.head_dim));
  require(compiled_head_dim(q.head_dim), errc::shape_mismatch,
          "cuda attention: head_dim " + std::to_string(q.head_dim) +
              " is not compiled (8, 64, 128 or 256)");
  attention_launch_shape s;
  s.n_queries = q.count;
  s.q_heads = q.q_heads;
  s.head_dim = q.head_dim;
  s.kv_heads = has_prompt ? prompt_kv_heads : tk.shape.kv_heads;
  s.prompt_tokens = has_prompt ? prompt_tokens : 0;
  s.max_tail_visible = q.count > 0 ? (vis(0) > vis(q.count - 1) ? vis(0) : vis(q.count - 1)) : 0;
  require(s.kv_heads >= 1, errc::shape_mismatch,
          "cuda attention: no kv heads (no prompt and an empty tail view)");
  if (has_prompt)
    require(prompt_head_dim == q.head_dim, errc::shape_mismatch,
            "cuda attention: queries have head_dim " + std::to_string(q.head_dim) +
                " but the prompt has head_dim " + std::to_string(prompt_head_dim));
  require(q.q_heads % s.kv_heads == 0, errc::shape_mismatch,
          "cuda attention: q_heads " + std::to_string(q.q_heads) +
              " is not a multiple of kv_heads " + std::to_string(s.kv_heads));
  const bool tail_used = s.max_tail_visible > 0 || tk.shape.tokens > 0;
  if (tail_used) {
    require(tk.shape == tv.shape, errc::shape_mismatch,
            "cuda attention: tail keys " + to_string(tk.shape) + " and tail values " +
                to_string(tv.shape) + " differ");
    require(tk.shape.tokens == 0 ||
                (tk.shape.kv_heads == s.kv_heads && tk.shape.head_dim == q.head_dim),
            errc::shape_mismatch,
            "cuda attention: tail " + to_string(tk.shape) +
                " does not match kv_heads=" + std::to_string(s.kv_heads) +
                " and the queries' head_dim=" + std::to_string(q.head_dim));
  }
  if (q.count > 0) {
    const std::int64_t lo = vis(0) < vis(q.count - 1) ? vis(0) : vis(q.count - 1);
    require(lo >= 0 && s.max_tail_visible <= tk.shape.tokens, errc::shape_mismatch,
            "cuda attention: queries see tail tokens up to " + std::to_string(s.max_tail_visible) +
                " (and at least " + std::to_string(lo) + "), the tail holds " +
                std::to_string(tk.shape.tokens));
    require(s.prompt_tokens + lo >= 1, errc::invalid_argument,
            "cuda attention: a query would see no token at all (no prompt, empty tail)");
  }
  require(s.chunks() <= 0x7fffffff && s.kv_heads <= 65535 && s.pair_tiles() <= 65535,
          errc::shape_mismatch,
          "cuda attention: " + std::to_string(s.chunks()) + " chunks x " +
              std::to_string(s.kv_heads) + " kv heads x " + std::to_string(s.pair_tiles()) +
              " pair tiles exceed a CUDA grid");
  return s;
}

/// Pointer checks of a launch (the sizing call may pass null data, as in CUB).
template <class TailT>
void check_pointers(const kv_view<const TailT, device_space>& tk,
                    const kv_view<const TailT, device_space>& tv, const attention_queries& q,
                    const attention_output& out, const attention_launch_shape& s) {
  lynx::detail::require(q.data_bf16 == nullptr && q.data_fp16 == nullptr &&
                            out.data_bf16 == nullptr && out.data_fp16 == nullptr,
                        errc::invalid_argument,
                        "cuda attention: float queries and outputs only (bf16 and fp16 queries "
                        "and outputs are host-only for now)");
  lynx::detail::require(q.count == 0 || (q.data != nullptr && out.data != nullptr),
                        errc::invalid_argument, "cuda attention: null query or output data");
  lynx::detail::require(s.max_tail_visible == 0 || (tk.data != nullptr && tv.data != nullptr),
                        errc::invalid_argument, "cuda attention: null tail data");
}

inline void check_workspace(const void* workspace, std::size_t bytes,
                            const attention_launch_shape& s) {
  lynx::detail::require(bytes >= s.workspace_bytes(), errc::invalid_argument,
                        "cuda attention: workspace of " + std::to_string(bytes) +
                            " bytes, this call needs " + std::to_string(s.workspace_bytes()));
  lynx::detail::require(reinterpret_cast<std::uintptr_t>(workspace) % 16 == 0,
                        errc::invalid_argument, "cuda attention: workspace is not 16-byte aligned");
}

template <class Variant>
float soft_cap_of(const Variant& v) {
  if constexpr (Variant::has_logit_transform) {
    static_assert(
        requires { v.cap; },
        "cuda attention: the only logit transform the kernels evaluate is a soft-cap; the variant "
        "needs a `cap` member");
    return static_cast<float>(v.cap);
  } else {
    (void)v;
    return 0.0f;
  }
}

template <int D, class PromptSrc, class TailSrc>
cudaError_t launch(const PromptSrc& prompt, const TailSrc& tail, const attention_launch_shape& s,
                   chunk_params p, void* workspace, attention_output out, cudaStream_t stream) {
  auto* status = static_cast<attention_status*>(workspace);
  if (s.n_queries == 0)  // nothing to launch; the status still says "no problem"
    return cudaMemsetAsync(&status->non_finite_output, 0xff, sizeof(unsigned long long), stream);
  auto* ml = reinterpret_cast<float2*>(static_cast<std::byte*>(workspace) + attention_status_bytes);
  auto* acc =
      reinterpret_cast<float*>(reinterpret_cast<std::byte*>(ml) +
                               align_up(static_cast<std::int64_t>(s.state_pairs() * 8), 256));
  p.status = status;
  p.ml = ml;
  p.acc = acc;
  constexpr std::size_t smem = attention_smem<D>::bytes;
  if constexpr (smem > 48 * 1024)
    LYNX_CUDA_TRY(cudaFuncSetAttribute(chunk_kernel<D, PromptSrc, TailSrc>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  chunk_kernel<D, PromptSrc, TailSrc>
      <<<s.chunk_grid(), attention_threads, smem, stream>>>(prompt, tail, p);
  LYNX_CUDA_TRY(cudaGetLastError());
  constexpr unsigned combine_threads = D < 32 ? 32u : static_cast<unsigned>(D);
  combine_kernel<D><<<static_cast<unsigned>(s.n_queries * s.q_heads), combine_threads, 0, stream>>>(
      ml, acc, p.chunks, out.data, out.lse, status);
  return cudaGetLastError();
}

}  // namespace detail

/// Throws lynx::error (errc::non_finite_input) for a status that records an
/// output that is not finite, naming its query and head and, when one of its
/// logits was not finite, the chunk of context tokens that holds it. Host-only.
inline void throw_attention_status(const attention_status& st) {
  if (st.non_finite_output == attention_no_problem) return;
  const std::int64_t row = static_cast<std::int64_t>(st.non_finite_output >> 32);
  const std::int64_t chunk = static_cast<std::int64_t>(st.non_finite_output & 0xffffffffu);
  const std::int64_t qh = st.q_heads > 0 ? st.q_heads : 1;
  std::string what = "cuda attention: the output of query " + std::to_string(row / qh) + ", head " +
                     std::to_string(row % qh) + " is not finite: ";
  if (chunk == 0xffffffff) {
    what += "its logits are finite, so a value it weighs (prompt or tail) holds NaN or infinity";
  } else {
    const bool prompt = chunk < st.prompt_chunks;
    const std::int64_t first = (prompt ? chunk : chunk - st.prompt_chunks) * attention_chunk_tokens;
    what += std::string("a logit against ") + (prompt ? "prompt" : "tail") + " tokens [" +
            std::to_string(first) + ", " + std::to_string(first + attention_chunk_tokens) +
            ") is NaN or infinite (NaN or infinity in its query or those keys, or a logit "
            "beyond the float range)";
  }
  lynx::detail::fail(errc::non_finite_input, what);
}

/// Waits for `stream`, reads the status the last decode attention call on
/// `workspace` left there and throws throw_attention_status's error if one of
/// its outputs is not finite. The call itself is asynchronous and cannot throw
/// for its data; an engine that synchronizes anyway (to sample a token) checks here.
inline void check_attention_status(const void* workspace, cudaStream_t stream = nullptr) {
  attention_status st{};
  LYNX_CUDA_CHECK(cudaMemcpyAsync(&st, workspace, sizeof st, cudaMemcpyDeviceToHost, stream));
  LYNX_CUDA_CHECK(cudaStreamSynchronize(stream));
  throw_attention_status(st);
}

/// One request of a batched call (decode_attention::batch), in device memory: its
/// prompt (a bit-plane view at the request's own precision level, or a dense
/// prompt), its tail, its queries and where its outputs go; lynx::attention_request's
/// device counterpart.
template <class Prompt, class TailT>
struct attention_request {
  Prompt prompt{};
  kv_view<const TailT, device_space> tail_keys{}, tail_values{};
  attention_queries queries{};
  tail_visibility visible{};
  attention_output out{};
};

/// The CUDA decode attention functor; Variant sets the softmax scale, soft-cap and window.
template <class Variant = default_variant>
class decode_attention {
  static_assert(
      attention_variant<Variant>,
      "cuda::decode_attention: Variant must model lynx::attention_variant: a nested `variant_tag`, "
      "query_scale(int), a static constexpr bool has_logit_transform, transform_logit(float) and "
      "window()");

 public:
  Variant variant{};

  /// Launch shape of a call (throws on bad shapes; data pointers are checked at launch):
  /// its workspace_bytes() is what the call needs.
  template <stream_plan_type Plan, int G, class TailT>
  static attention_launch_shape shape_of(const bitplane_view<Plan, G, device_space>& prompt,
                                         kv_view<const TailT, device_space> tk,
                                         kv_view<const TailT, device_space> tv,
                                         const attention_queries& q, tail_visibility vis) {
    lynx::detail::require(prompt.level >= 1, errc::invalid_argument,
                          "cuda attention: prompt layer " + std::to_string(prompt.layer) +
                              " has no anchor yet (precision level 0)");
    return detail::check_call(prompt.geometry.tokens, prompt.geometry.kv_heads,
                              prompt.geometry.head_dim, true, tk, tv, q, vis);
  }
  template <class T, class TailT>
  static attention_launch_shape shape_of(const dense_prompt<T>& prompt,
                                         kv_view<const TailT, device_space> tk,
                                         kv_view<const TailT, device_space> tv,
                                         const attention_queries& q, tail_visibility vis) {
    lynx::detail::require(!prompt.keys.paged() && !prompt.values.paged(), errc::invalid_argument,
                          "cuda attention: a paged dense prompt is read by the host attention "
                          "only (yet)");
    lynx::detail::require(prompt.keys.shape == prompt.values.shape, errc::shape_mismatch,
                          "cuda attention: prompt keys " + to_string(prompt.keys.shape) +
                              " and values " + to_string(prompt.values.shape) + " differ");
    lynx::detail::require(prompt.keys.shape.tokens == 0 ||
                              (prompt.keys.data != nullptr && prompt.values.data != nullptr),
                          errc::invalid_argument, "cuda attention: null prompt data");
    return detail::check_call(prompt.keys.shape.tokens, prompt.keys.shape.kv_heads,
                              prompt.keys.shape.head_dim, prompt.keys.shape.tokens > 0, tk, tv, q,
                              vis);
  }

  /// Bit-plane prompt at its view's precision level, plus the tail.
  /// workspace == nullptr: sets workspace_bytes, launches nothing.
  template <stream_plan_type Plan, int G, class TailT>
  [[nodiscard]] cudaError_t operator()(void* workspace, std::size_t& workspace_bytes,
                                       const bitplane_view<Plan, G, device_space>& prompt,
                                       kv_view<const TailT, device_space> tail_keys,
                                       kv_view<const TailT, device_space> tail_values,
                                       const attention_queries& q, tail_visibility vis,
                                       attention_output out, cudaStream_t stream = nullptr) const {
    static_assert(std::is_same_v<TailT, float> || std::is_same_v<TailT, bf16>,
                  "cuda::decode_attention: the tail holds float or bf16");
    return call(
        workspace, workspace_bytes, prompt, [&] { return detail::make_plane_source(prompt); },
        tail_keys, tail_values, q, vis, out, stream);
  }

  /// Where each request's part of a batch's workspace starts: offsets[r] for request
  /// r (256-byte aligned, in request order), offsets[n] the bytes of the whole batch.
  /// Throws on a request whose shapes are wrong, naming it ("request 3: ...").
  template <class Prompt, class TailT>
  static std::vector<std::size_t> batch_offsets(
      std::span<const attention_request<Prompt, TailT>> requests) {
    std::vector<std::size_t> offsets{0};
    for (std::size_t r = 0; r < requests.size(); ++r) {
      const auto& q = requests[r];
      std::size_t bytes = 0;
      try {
        bytes =
            shape_of(q.prompt, q.tail_keys, q.tail_values, q.queries, q.visible).workspace_bytes();
      } catch (const lynx::error& e) {
        lynx::detail::fail(e.code(), "cuda attention batch: request " + std::to_string(r) + ": " +
                                         lynx::detail::error_message(e));
      }
      offsets.push_back(offsets.back() + (bytes + 255) / 256 * 256);
    }
    return offsets;
  }

  /// Many requests in one call on `stream`: ragged query counts, each prompt at its
  /// own precision level, each request's outputs the bits of its solo call whatever
  /// else shares the batch (each is launched as its own call, in request order, on
  /// its own part of the workspace: batch_offsets). workspace == nullptr: sets
  /// workspace_bytes, launches nothing. Every request's shapes are checked before
  /// anything is launched; an error names the request. Asynchronous like a single
  /// call: check_batch_status reads what each request's launch left.
  template <class Prompt, class TailT>
  [[nodiscard]] cudaError_t batch(void* workspace, std::size_t& workspace_bytes,
                                  std::span<const attention_request<Prompt, TailT>> requests,
                                  cudaStream_t stream = nullptr) const {
    const std::vector<std::size_t> offsets = batch_offsets(requests);
    if (workspace == nullptr) {
      workspace_bytes = offsets.back();
      return cudaSuccess;
    }
    lynx::detail::require(workspace_bytes >= offsets.back(), errc::invalid_argument,
                          "cuda attention batch: workspace of " + std::to_string(workspace_bytes) +
                              " bytes, this batch needs " + std::to_string(offsets.back()));
    for (std::size_t r = 0; r < requests.size(); ++r) {
      const auto& q = requests[r];
      std::size_t bytes = offsets[r + 1] - offsets[r];
      cudaError_t e = cudaSuccess;
      try {
        e = (*this)(static_cast<std::byte*>(workspace) + offsets[r], bytes, q.prompt, q.tail_keys,
                    q.tail_values, q.queries, q.visible, q.out, stream);
      } catch (const lynx::error& x) {
        lynx::detail::fail(x.code(), "cuda attention batch: request " + std::to_string(r) + ": " +
                                         lynx::detail::error_message(x));
      }
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  /// check_attention_status for every request of a batch (waits for `stream`); the
  /// error names the request.
  template <class Prompt, class TailT>
  static void check_batch_status(const void* workspace,
                                 std::span<const attention_request<Prompt, TailT>> requests,
                                 cudaStream_t stream = nullptr) {
    const std::vector<std::size_t> offsets = batch_offsets(requests);
    for (std::size_t r = 0; r < requests.size(); ++r) {
      try {
        check_attention_status(static_cast<const std::byte*>(workspace) + offsets[r], stream);
      } catch (const lynx::error& e) {
        lynx::detail::fail(e.code(), "cuda attention batch: request " + std::to_string(r) + ": " +
                                         lynx::detail::error_message(e));
      }
    }
  }

  /// Dense prompt (the 16-bit baseline), same structure and order of operations.
  template <class T, class TailT>
  [[nodiscard]] cudaError_t operator()(void* workspace, std::size_t& workspace_bytes,
                                       const dense_prompt<T>& prompt,
                                       kv_view<const TailT, device_space> tail_keys,
                                       kv_view<const TailT, device_space> tail_values,
                                       const attention_queries& q, tail_visibility vis,
                                       attention_output out, cudaStream_t stream = nullptr) const {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                  "cuda::decode_attention: a dense prompt holds float or bf16");
    static_assert(std::is_same_v<TailT, float> || std::is_same_v<TailT, bf16>,
                  "cuda::decode_attention: the tail holds float or bf16");
    return call(
        workspace, workspace_bytes, prompt,
        [&] {
          return detail::dense_source<T>{prompt.keys, prompt.values};
        },
        tail_keys, tail_values, q, vis, out, stream);
  }

 private:
  /// Both prompt kinds: the shape (and, without a workspace, its size), the
  /// workspace and pointer checks, then one launch for the head_dim.
  template <class Prompt, class MakeSource, class TailT>
  cudaError_t call(void* workspace, std::size_t& workspace_bytes, const Prompt& prompt,
                   MakeSource&& make_source, kv_view<const TailT, device_space> tail_keys,
                   kv_view<const TailT, device_space> tail_values, const attention_queries& q,
                   tail_visibility vis, attention_output out, cudaStream_t stream) const {
    const attention_launch_shape s = shape_of(prompt, tail_keys, tail_values, q, vis);
    if (workspace == nullptr) {
      workspace_bytes = s.workspace_bytes();
      return cudaSuccess;
    }
    detail::check_workspace(workspace, workspace_bytes, s);
    detail::check_pointers(tail_keys, tail_values, q, out, s);
    const auto src = make_source();
    const detail::dense_source<TailT> tail{tail_keys, tail_values};
    return lynx::dispatch<8, 64, 128, 256>(static_cast<int>(s.head_dim), [&]<int D>() {
      return detail::launch<D>(src, tail, s, params(s, q, vis), workspace, out, stream);
    });
  }

  detail::chunk_params params(const attention_launch_shape& s, const attention_queries& q,
                              tail_visibility vis) const {
    detail::chunk_params p{};
    p.queries = q.data;
    p.n_queries = s.n_queries;
    p.q_heads = s.q_heads;
    p.group_heads = s.group_heads();
    p.prompt_tokens = s.prompt_tokens;
    p.max_tail_visible = s.max_tail_visible;
    p.tail_base = vis.base;
    p.tail_per_query = vis.per_query;
    p.window = variant.window();
    p.prompt_chunks = static_cast<int>(s.prompt_chunks());
    p.chunks = static_cast<int>(s.chunks());
    p.query_scale = variant.query_scale(static_cast<int>(s.head_dim));
    p.soft_cap = detail::soft_cap_of(variant);
    return p;
  }
};

}  // namespace lynx::cuda
