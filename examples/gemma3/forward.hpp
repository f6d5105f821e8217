// A batch-invariant CPU forward pass for Gemma-3 text models (GGUF weights),
// built like the llama2.c engine: every output element is computed by the same
// per-token function with a reduction order fixed by the input dimension, so a
// token's logits are bitwise identical whether it runs alone or among k others,
// and whatever the thread count (threads split the rows of a matrix, never a
// sum). The attention over the prompt is a pluggable policy, so a Lynx
// attention over a quantized, partly arrived prompt KV can replace it.
//
// Per layer: RMSNorm -> q, k, v -> per-head RMSNorm of q and k -> RoPE (NeoX
// pairing j, j + head_dim/2; base 1e6 on global layers, 10,000 on local ones)
// -> attention (local layers: the last `window` positions) -> o -> RMSNorm ->
// residual; RMSNorm -> down(gelu_tanh(gate) * up) -> RMSNorm -> residual.
// Embedding scaled by sqrt(dim); tied classifier after a final RMSNorm.
// Weights stay quantized; each matrix row is dequantized (exactly) into a
// small buffer and dotted with every token of the batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__)
#include <immintrin.h>
#endif

#include "gemma3/model.hpp"
#include "llama2c/forward.hpp"  // detail::dot (fixed order) and detail::kv_range
#include "lynx/backend/host/isa.hpp"
#include "lynx/backend/host/parallel.hpp"

namespace lynx_examples::gemma3 {

namespace detail {

using llama2c::detail::dot;
using llama2c::detail::kv_range;

// Exact fp32 attention as llama2c's, with the fixed-order 16-lane dot for the
// scores (head_dim 256: a sequential sum would make a 32K-token prefill crawl).
inline void exact_attend(std::span<const kv_range> ranges, const float* q, float* out, int n_heads,
                         int kv_group, int head_dim, int token_stride, float* scores) {
  llama2c::detail::exact_attend<dot>(ranges, q, out, n_heads, kv_group, head_dim, token_stride,
                                     scores);
}

/// RMSNorm as the reference computes it: the sum of squares in double, in
/// order; out = (x * (1 / sqrt(mean + eps))) * w.
inline void rmsnorm(float* out, const float* x, const float* w, int n, float eps) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int i = 0; i < n; ++i) out[i] = (x[i] * scale) * w[i];
}

inline float gelu_tanh(float x) {
  constexpr float sqrt_2_over_pi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(sqrt_2_over_pi * x * (1.0f + 0.044715f * x * x)));
}

/// out[t * stride + r] = dot(rows[r], in[t]) for r < rn, t < tokens (matmul's inner
/// loops over a block of dequantized rows), as built.
inline void matmul_block(float* out, std::ptrdiff_t stride, const float* in, const float* rows,
                         int rn, int cols, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    const float* x = in + static_cast<std::ptrdiff_t>(t) * cols;
    float* o = out + static_cast<std::ptrdiff_t>(t) * stride;
    for (int r = 0; r < rn; ++r) o[r] = dot(rows + static_cast<std::size_t>(r) * cols, x, cols);
  }
}

#if LYNX_HOST_CPU_DISPATCH
/// dot() of NR rows (row r at rows + r * cols) against x, into out[0..NR), on AVX2:
/// lane j of a row's two registers is dot's partial sum j (elements i with i % 16
/// == j, a multiply then an add each, in order; no FMA, nothing contracted), then
/// dot's tail and halving tree: the same bits. The NR rows' sums are independent
/// chains, so their additions overlap (dot alone waits on one chain per lane).
template <int NR>
__attribute__((target("avx2"), optimize("fp-contract=off"))) inline void dots_avx2(
    const float* rows, int cols, const float* x, float* out) {
  __m256 lo[NR], hi[NR];
  for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= cols; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (int r = 0; r < NR; ++r) {
      const float* a = rows + static_cast<std::ptrdiff_t>(r) * cols + i;
      lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(_mm256_loadu_ps(a), x0));
      hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(_mm256_loadu_ps(a + 8), x1));
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float* a = rows + static_cast<std::ptrdiff_t>(r) * cols;
    alignas(32) float acc[16];
    _mm256_store_ps(acc, lo[r]);
    _mm256_store_ps(acc + 8, hi[r]);
    for (int j = 0; i + j < cols; ++j) acc[j] += a[i + j] * x[i + j];
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
    out[r] = acc[0];
  }
}

/// dot() of NR rows against x on AVX-512 (F): lane j of a row's register is dot's
/// partial sum j (a multiply then an add per element, in order; nothing contracted),
/// then dot's tail and halving tree: the same bits. NR independent chains.
template <int NR>
__attribute__((target("avx512f"), optimize("fp-contract=off"))) inline void dots_avx512(
    const float* rows, int cols, const float* x, float* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= cols; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_add_ps(
          acc[r],
          _mm512_mul_ps(_mm512_loadu_ps(rows + static_cast<std::ptrdiff_t>(r) * cols + i), xv));
  }
  for (int r = 0; r < NR; ++r) {
    const float* a = rows + static_cast<std::ptrdiff_t>(r) * cols;
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[r]);
    for (int j = 0; i + j < cols; ++j) lanes[j] += a[i + j] * x[i + j];
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    out[r] = lanes[0];
  }
}

/// matmul_block on AVX-512 (dots_avx512: the same bits), eight rows at a time.
__attribute__((target("avx512f"))) inline void matmul_block_avx512(float* out,
                                                                   std::ptrdiff_t stride,
                                                                   const float* in,
                                                                   const float* rows, int rn,
                                                                   int cols, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    const float* x = in + static_cast<std::ptrdiff_t>(t) * cols;
    float* o = out + static_cast<std::ptrdiff_t>(t) * stride;
    int r = 0;
    for (; r + 8 <= rn; r += 8)
      dots_avx512<8>(rows + static_cast<std::ptrdiff_t>(r) * cols, cols, x, o + r);
    for (; r < rn; ++r)
      dots_avx512<1>(rows + static_cast<std::ptrdiff_t>(r) * cols, cols, x, o + r);
  }
}

/// matmul_block on AVX2 (dots_avx2: the same bits), four rows at a time.
__attribute__((target("avx2"))) inline void matmul_block_avx2(float* out, std::ptrdiff_t stride,
                                                              const float* in, const float* rows,
                                                              int rn, int cols, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    const float* x = in + static_cast<std::ptrdiff_t>(t) * cols;
    float* o = out + static_cast<std::ptrdiff_t>(t) * stride;
    int r = 0;
    for (; r + 4 <= rn; r += 4)
      dots_avx2<4>(rows + static_cast<std::ptrdiff_t>(r) * cols, cols, x, o + r);
    for (; r < rn; ++r) dots_avx2<1>(rows + static_cast<std::ptrdiff_t>(r) * cols, cols, x, o + r);
  }
}
#endif

/// out[t, r] = dot(row r of w, in[t, :]) for t < tokens: out [tokens, w.rows],
/// in [tokens, w.cols]. Rows are dequantized a block at a time into per-thread
/// scratch and reused for every token; threads take disjoint row blocks.
inline void matmul(float* out, const float* in, const matrix& w, int tokens, int threads,
                   std::vector<float>& scratch) {
  constexpr int block_rows = 16;
  const int blocks = (w.rows + block_rows - 1) / block_rows;
  if (threads <= 0) threads = lynx::detail::hardware_threads();
  // Small products are not worth a thread (the split never changes a result).
  const std::int64_t work = static_cast<std::int64_t>(w.rows) * w.cols * tokens;
  if (work < (std::int64_t{1} << 18)) threads = 1;
  threads = std::min(threads, blocks);
  const std::size_t per_thread = static_cast<std::size_t>(block_rows) * w.cols;
#if LYNX_HOST_CPU_DISPATCH
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2");
#endif
  if (scratch.size() < per_thread * threads) scratch.resize(per_thread * threads);
  lynx::detail::parallel_for(threads, threads, [&](std::int64_t w0, std::int64_t w1) {
    for (std::int64_t worker = w0; worker < w1; ++worker) {
      float* rows = scratch.data() + per_thread * static_cast<std::size_t>(worker);
      const int b0 = static_cast<int>(blocks * worker / threads),
                b1 = static_cast<int>(blocks * (worker + 1) / threads);
      for (int b = b0; b < b1; ++b) {
        const int r0 = b * block_rows, rn = std::min(block_rows, w.rows - r0);
        for (int r = 0; r < rn; ++r)
          w.dequantize_row(r0 + r, rows + static_cast<std::size_t>(r) * w.cols);
#if LYNX_HOST_CPU_DISPATCH
        if (avx512) {
          matmul_block_avx512(out + r0, w.rows, in, rows, rn, w.cols, tokens);
          continue;
        }
        if (avx2) {
          matmul_block_avx2(out + r0, w.rows, in, rows, rn, w.cols, tokens);
          continue;
        }
#endif
        matmul_block(out + r0, w.rows, in, rows, rn, w.cols, tokens);
      }
    }
  });
}

}  // namespace detail

// ---------------------------------------------------------------------------
// KV cache
// ---------------------------------------------------------------------------

// Per layer: the prompt's K/V (written by prefill; fp32, [tokens, kv_heads,
// head_dim], K after norm and RoPE) and the tail of tokens decoded here.
// Position of tail entry i is prompt_length() + i. A decode node that receives
// its prompt KV through Lynx never fills the prompt region (begin_decode).
class kv_cache {
 public:
  kv_cache() = default;
  explicit kv_cache(const config& c)
      : n_layers_(c.n_layers),
        n_kv_heads_(c.n_kv_heads),
        head_dim_(c.head_dim),
        capacity_(c.context),
        prompt_k_(static_cast<std::size_t>(c.n_layers)),
        prompt_v_(static_cast<std::size_t>(c.n_layers)),
        tail_k_(static_cast<std::size_t>(c.n_layers)),
        tail_v_(static_cast<std::size_t>(c.n_layers)) {}

  [[nodiscard]] int n_layers() const { return n_layers_; }
  [[nodiscard]] int n_kv_heads() const { return n_kv_heads_; }
  [[nodiscard]] int head_dim() const { return head_dim_; }
  [[nodiscard]] int token_stride() const { return n_kv_heads_ * head_dim_; }  // floats
  [[nodiscard]] int capacity() const { return capacity_; }
  [[nodiscard]] int prompt_length() const { return prompt_length_; }
  [[nodiscard]] bool holds_prompt() const { return holds_prompt_; }
  [[nodiscard]] int tail_length() const { return tail_length_; }
  [[nodiscard]] int length() const { return prompt_length_ + tail_length_; }

  // [prompt_length, n_kv_heads, head_dim]; empty on a decode node
  [[nodiscard]] std::span<float> prompt_keys(int l) {
    return region(prompt_k_, l, stored_prompt());
  }
  [[nodiscard]] std::span<float> prompt_values(int l) {
    return region(prompt_v_, l, stored_prompt());
  }
  [[nodiscard]] std::span<const float> prompt_keys(int l) const {
    return region(prompt_k_, l, stored_prompt());
  }
  [[nodiscard]] std::span<const float> prompt_values(int l) const {
    return region(prompt_v_, l, stored_prompt());
  }
  // [tail_length, n_kv_heads, head_dim]
  [[nodiscard]] std::span<float> tail_keys(int l) { return region(tail_k_, l, tail_length_); }
  [[nodiscard]] std::span<float> tail_values(int l) { return region(tail_v_, l, tail_length_); }
  [[nodiscard]] std::span<const float> tail_keys(int l) const {
    return region(tail_k_, l, tail_length_);
  }
  [[nodiscard]] std::span<const float> tail_values(int l) const {
    return region(tail_v_, l, tail_length_);
  }

  /// A new sequence whose prompt of n tokens is computed here (prefill).
  void reset_for_prefill(int prompt_tokens) { reset(prompt_tokens, true); }
  /// A new sequence whose prompt KV lives elsewhere (a Lynx policy reads it).
  void reset_for_decode(int prompt_tokens) { reset(prompt_tokens, false); }

  /// Room for n more tail tokens (contents written by the caller); index of the first.
  int grow_tail(int n) {
    if (n < 0 || length() + n > capacity_)
      throw std::out_of_range("gemma3: cannot append " + std::to_string(n) +
                              " tokens to a cache holding " + std::to_string(length()) + " of " +
                              std::to_string(capacity_) + " positions");
    const int first = tail_length_;
    tail_length_ += n;
    const std::size_t need = static_cast<std::size_t>(tail_length_) * token_stride();
    for (int l = 0; l < n_layers_; ++l) {
      auto& k = tail_k_[static_cast<std::size_t>(l)];
      auto& v = tail_v_[static_cast<std::size_t>(l)];
      if (k.size() < need) {  // amortized: doubling, so a long decode allocates rarely
        const std::size_t grown = std::max(need, 2 * k.size());
        k.resize(grown);
        v.resize(grown);
      }
    }
    return first;
  }

  /// Drops the last n tail entries (rejected drafts).
  void truncate_tail(int n) {
    if (n < 0 || n > tail_length_)
      throw std::out_of_range("gemma3: cannot drop " + std::to_string(n) + " tail tokens of " +
                              std::to_string(tail_length_));
    tail_length_ -= n;
  }

  /// Grows the prompt (chunked prefill writes it a chunk at a time).
  void set_prompt_filled(int tokens) { prompt_filled_ = tokens; }
  [[nodiscard]] int prompt_filled() const { return prompt_filled_; }

 private:
  void reset(int prompt_tokens, bool holds) {
    if (prompt_tokens < 0 || prompt_tokens > capacity_)
      throw std::out_of_range("gemma3: prompt of " + std::to_string(prompt_tokens) +
                              " tokens does not fit a context of " + std::to_string(capacity_));
    const std::size_t n =
        holds ? static_cast<std::size_t>(prompt_tokens) * static_cast<std::size_t>(token_stride())
              : 0;
    for (int l = 0; l < n_layers_; ++l) {
      prompt_k_[static_cast<std::size_t>(l)].assign(n, 0.0f);
      prompt_v_[static_cast<std::size_t>(l)].assign(n, 0.0f);
    }
    prompt_length_ = prompt_tokens;
    prompt_filled_ = holds ? 0 : prompt_tokens;
    holds_prompt_ = holds;
    tail_length_ = 0;
  }
  [[nodiscard]] int stored_prompt() const { return holds_prompt_ ? prompt_length_ : 0; }

  template <class Regions>
  auto region(Regions& regions, int l, int tokens) const
      -> std::span<std::remove_reference_t<decltype(*regions[0].data())>> {
    if (l < 0 || l >= n_layers_)
      throw std::out_of_range("gemma3: layer " + std::to_string(l) + " out of range");
    return {regions[static_cast<std::size_t>(l)].data(),
            static_cast<std::size_t>(tokens) * static_cast<std::size_t>(token_stride())};
  }

  int n_layers_ = 0, n_kv_heads_ = 0, head_dim_ = 0, capacity_ = 0;
  int prompt_length_ = 0, prompt_filled_ = 0, tail_length_ = 0;
  bool holds_prompt_ = false;
  std::vector<std::vector<float>> prompt_k_, prompt_v_, tail_k_, tail_v_;  // [layer][...]
};

// ---------------------------------------------------------------------------
// Attention policy
// ---------------------------------------------------------------------------

// Computes the attention output of ONE decoded query (as llama2c's policies):
//   void operator()(const kv_cache& cache, int layer,
//                   std::span<const float> q,   // [n_heads, head_dim], normed, RoPE applied
//                   int tail_visible,           // tail tokens this query sees (causal mask)
//                   std::span<float> out);      // [n_heads, head_dim]
// The query's position is prompt_length() + tail_visible - 1; on a local layer
// it sees only the keys of the last `window` positions (itself included).
template <class P>
concept attention_policy = requires(P& p, const kv_cache& cache, int layer,
                                    std::span<const float> q, int tail_visible,
                                    std::span<float> out) {
  p(cache, layer, q, tail_visible, out);
};

/// Exact fp32 attention over the cache's own prompt K/V and the visible tail
/// (the same arithmetic as prefill, so a token's bits do not depend on whether
/// it was prefilled or decoded).
class exact_attention {
 public:
  exact_attention(int window_of_local_layers = 0, std::vector<bool> local = {})
      : window_(window_of_local_layers), local_(std::move(local)) {}

  void operator()(const kv_cache& cache, int layer, std::span<const float> q, int tail_visible,
                  std::span<float> out) {
    if (!cache.holds_prompt() && cache.prompt_length() > 0)
      throw std::logic_error(
          "gemma3: exact_attention needs the prompt KV (prefill on this engine)");
    if (tail_visible < 0 || tail_visible > cache.tail_length())
      throw std::out_of_range("gemma3: tail_visible " + std::to_string(tail_visible) +
                              " outside [0, " + std::to_string(cache.tail_length()) + "]");
    const int head_dim = cache.head_dim();
    const int n_heads = static_cast<int>(q.size()) / head_dim;
    const int qpos = cache.prompt_length() + tail_visible - 1;
    const bool local = static_cast<std::size_t>(layer) < local_.size() &&
                       local_[static_cast<std::size_t>(layer)] && window_ > 0;
    const int first = local ? std::max(0, qpos - window_ + 1) : 0;
    const int stride = cache.token_stride();
    const int p0 = std::min(first, cache.prompt_length());
    const int t0 = std::max(0, first - cache.prompt_length());
    scores_.resize(static_cast<std::size_t>(cache.prompt_length() + tail_visible));
    const detail::kv_range ranges[2] = {
        {cache.prompt_keys(layer).data() + static_cast<std::ptrdiff_t>(p0) * stride,
         cache.prompt_values(layer).data() + static_cast<std::ptrdiff_t>(p0) * stride,
         cache.prompt_length() - p0},
        {cache.tail_keys(layer).data() + static_cast<std::ptrdiff_t>(t0) * stride,
         cache.tail_values(layer).data() + static_cast<std::ptrdiff_t>(t0) * stride,
         tail_visible - t0}};
    detail::exact_attend(ranges, q.data(), out.data(), n_heads, n_heads / cache.n_kv_heads(),
                         head_dim, stride, scores_.data());
  }

 private:
  int window_;
  std::vector<bool> local_;
  std::vector<float> scores_;
};

static_assert(attention_policy<exact_attention>);

/// Which layers are local, as a vector (for the policies).
inline std::vector<bool> local_layers(const config& c) {
  std::vector<bool> local(static_cast<std::size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) local[static_cast<std::size_t>(l)] = c.is_local(l);
  return local;
}

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

template <attention_policy Attention = exact_attention>
class engine {
 public:
  using attention_type = Attention;

  /// threads: for the matrix products (0: every hardware thread); results do not depend on it.
  explicit engine(const weights& model, Attention attention, int threads = 0)
      : model_(&model), attention_(std::move(attention)), cache_(model.cfg()), threads_(threads) {
    cache_.reset_for_decode(0);
    const config& c = model.cfg();
    const int half = c.head_dim / 2;
    inv_freq_global_.resize(static_cast<std::size_t>(half));
    inv_freq_local_.resize(static_cast<std::size_t>(half));
    for (int i = 0; i < half; ++i) {
      const double e = -2.0 * i / static_cast<double>(c.head_dim);
      inv_freq_global_[static_cast<std::size_t>(i)] = std::pow(c.rope_base_global, e);
      inv_freq_local_[static_cast<std::size_t>(i)] = std::pow(c.rope_base_local, e);
    }
  }
  explicit engine(const weights& model,
                  int threads = 0) requires std::same_as<Attention, exact_attention>
      : engine(model, exact_attention(model.cfg().window, local_layers(model.cfg())), threads) {}

  [[nodiscard]] const config& cfg() const { return model_->cfg(); }
  [[nodiscard]] const weights& model() const { return *model_; }
  [[nodiscard]] kv_cache& cache() { return cache_; }
  [[nodiscard]] const kv_cache& cache() const { return cache_; }
  [[nodiscard]] Attention& attention() { return attention_; }
  [[nodiscard]] int position() const { return cache_.length(); }
  void set_threads(int threads) { threads_ = threads; }

  /// Computes the prompt KV of every layer (exact fp32 causal attention, with
  /// the window on local layers; the policy is not used) and writes logits:
  /// of the last prompt token ([vocab]) or, with all_positions, of every
  /// prompt token ([n, vocab]). Runs in chunks of `chunk` tokens (the result
  /// does not depend on it). Starts a new sequence. progress(done, n) after each chunk.
  void prefill(std::span<const std::int32_t> prompt, std::span<float> logits,
               bool all_positions = false, int chunk = 256,
               const std::function<void(int, int)>& progress = {}) {
    const config& c = cfg();
    const int n = static_cast<int>(prompt.size());
    if (n == 0) throw std::invalid_argument("gemma3: prefill needs at least one token");
    if (chunk <= 0) throw std::invalid_argument("gemma3: prefill chunk must be positive");
    check_logits(logits, all_positions ? n : 1);
    cache_.reset_for_prefill(n);
    scores_.resize(static_cast<std::size_t>(n));
    const int stride = cache_.token_stride();
    for (int c0 = 0; c0 < n; c0 += chunk) {
      const int k = std::min(chunk, n - c0);
      auto attend = [&](int l, int t, const float* q, float* out) {
        const int pos = c0 + t;
        const int first = c.is_local(l) ? std::max(0, pos - c.window + 1) : 0;
        const detail::kv_range ranges[2] = {
            {cache_.prompt_keys(l).data() + static_cast<std::ptrdiff_t>(first) * stride,
             cache_.prompt_values(l).data() + static_cast<std::ptrdiff_t>(first) * stride,
             pos + 1 - first},
            {nullptr, nullptr, 0}};
        detail::exact_attend(ranges, q, out, c.n_heads, c.kv_group(), c.head_dim, stride,
                             scores_.data());
      };
      auto kv_rows = [&](int l) {
        const std::ptrdiff_t off = static_cast<std::ptrdiff_t>(c0) * stride;
        return std::pair{cache_.prompt_keys(l).data() + off, cache_.prompt_values(l).data() + off};
      };
      const std::size_t vocab = static_cast<std::size_t>(c.vocab_size);
      if (all_positions) {
        forward(prompt.subspan(static_cast<std::size_t>(c0), static_cast<std::size_t>(k)), c0,
                kv_rows, attend, logits.subspan(static_cast<std::size_t>(c0) * vocab, k * vocab),
                0);
      } else {
        const bool last = c0 + k == n;
        forward(prompt.subspan(static_cast<std::size_t>(c0), static_cast<std::size_t>(k)), c0,
                kv_rows, attend, last ? logits : std::span<float>{}, last ? k - 1 : k);
      }
      cache_.set_prompt_filled(c0 + k);
      if (progress) progress(c0 + k, n);
    }
  }

  [[nodiscard]] std::vector<float> prefill(std::span<const std::int32_t> prompt) {
    std::vector<float> logits(static_cast<std::size_t>(cfg().vocab_size));
    prefill(prompt, logits);
    return logits;
  }

  /// A decode node: the prompt's KV arrives from elsewhere, only its length is set.
  void begin_decode(int prompt_tokens) { cache_.reset_for_decode(prompt_tokens); }

  /// Runs k tokens at first_position.. (== position()), causal among themselves;
  /// writes logits [k, vocab] and appends their KV to the tail.
  void decode(std::span<const std::int32_t> tokens, int first_position, std::span<float> logits) {
    const int k = static_cast<int>(tokens.size());
    if (first_position != position())
      throw std::invalid_argument("gemma3: decode at position " + std::to_string(first_position) +
                                  " but the cache holds " + std::to_string(position()) +
                                  " tokens (positions must be consecutive)");
    check_logits(logits, k);
    if (k == 0) return;
    const int first_tail = cache_.grow_tail(k);
    auto attend = [&](int l, int t, const float* q, float* out) {
      attention_(std::as_const(cache_), l,
                 std::span<const float>(q, static_cast<std::size_t>(cfg().q_dim())),
                 first_tail + t + 1,
                 std::span<float>(out, static_cast<std::size_t>(cfg().q_dim())));
    };
    const std::ptrdiff_t offset = static_cast<std::ptrdiff_t>(first_tail) * cache_.token_stride();
    auto kv_rows = [&](int l) {
      return std::pair{cache_.tail_keys(l).data() + offset, cache_.tail_values(l).data() + offset};
    };
    forward(tokens, first_position, kv_rows, attend, logits, 0);
  }

  void truncate_tail(int n) { cache_.truncate_tail(n); }

 private:
  struct scratch {
    std::vector<float> x, xb, xb2, q, att, hb, hb2, rope;
    int tokens = 0;
    void resize(const config& c, int k) {
      if (k <= tokens) return;
      const auto kk = static_cast<std::size_t>(k);
      x.resize(kk * c.dim);
      xb.resize(kk * c.dim);
      xb2.resize(kk * c.dim);
      q.resize(kk * c.q_dim());
      att.resize(kk * c.q_dim());
      hb.resize(kk * c.hidden_dim);
      hb2.resize(kk * c.hidden_dim);
      rope.resize(kk * c.head_dim * 2);  // [k][global, local][half][cos, sin]
      tokens = k;
    }
  };

  void check_logits(std::span<float> logits, int rows) const {
    const std::size_t want =
        static_cast<std::size_t>(rows) * static_cast<std::size_t>(cfg().vocab_size);
    if (logits.size() != want)
      throw std::invalid_argument("gemma3: logits span has " + std::to_string(logits.size()) +
                                  " floats, expected " + std::to_string(want));
  }

  // cos/sin of position pos for both bases: angles in double, then rounded.
  void rope_table(float* table, int pos) const {
    const int half = cfg().head_dim / 2;
    for (int b = 0; b < 2; ++b) {
      const std::vector<double>& f = b == 0 ? inv_freq_global_ : inv_freq_local_;
      for (int i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos) * f[static_cast<std::size_t>(i)];
        table[(b * half + i) * 2] = static_cast<float>(std::cos(angle));
        table[(b * half + i) * 2 + 1] = static_cast<float>(std::sin(angle));
      }
    }
  }

  // Per head of v ([heads, head_dim]): RMSNorm with `norm`, then rotate pairs (i, i + half).
  void norm_rope(float* v, int heads, const float* norm, const float* table, bool local) const {
    const int hd = cfg().head_dim, half = hd / 2;
    const float* t = table + (local ? half * 2 : 0);
    for (int h = 0; h < heads; ++h) {
      float* x = v + static_cast<std::ptrdiff_t>(h) * hd;
      detail::rmsnorm(x, x, norm, hd, cfg().rms_eps);
      for (int i = 0; i < half; ++i) {
        const float c = t[2 * i], s = t[2 * i + 1];
        const float a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
      }
    }
  }

  // The shared body of prefill and decode, layer-major over the k tokens.
  // kv_rows(l) -> (K rows, V rows) [k, kv_dim] where this batch's KV goes;
  // attend(l, j, q, out) computes token j's attention once its KV is written.
  // Logits are written for tokens logits_from .. k-1 (none when logits_from == k).
  template <class KvRows, class Attend>
  void forward(std::span<const std::int32_t> tokens, int first_position, KvRows&& kv_rows,
               Attend&& attend, std::span<float> logits, int logits_from) {
    const config& c = cfg();
    const weights& w = *model_;
    const int k = static_cast<int>(tokens.size());
    const int dim = c.dim, hidden = c.hidden_dim, kv_dim = c.kv_dim(), q_dim = c.q_dim();
    if (first_position < 0 || first_position + k > c.context)
      throw std::out_of_range("gemma3: positions up to " + std::to_string(first_position + k) +
                              " exceed the context of " + std::to_string(c.context));
    for (const std::int32_t t : tokens)
      if (t < 0 || t >= c.vocab_size)
        throw std::out_of_range("gemma3: token " + std::to_string(t) + " outside vocab of " +
                                std::to_string(c.vocab_size));
    scratch_.resize(c, k);
    scratch& s = scratch_;
    auto row = [](std::vector<float>& v, int t, int width) {
      return v.data() + static_cast<std::ptrdiff_t>(t) * width;
    };
    const float eps = c.rms_eps;
    const float embed_scale = std::sqrt(static_cast<float>(dim));
    for (int t = 0; t < k; ++t) {
      float* x = row(s.x, t, dim);
      w.embedding().dequantize_row(tokens[static_cast<std::size_t>(t)], x);
      for (int i = 0; i < dim; ++i) x[i] *= embed_scale;
      rope_table(row(s.rope, t, 2 * c.head_dim), first_position + t);
    }

    for (int l = 0; l < c.n_layers; ++l) {
      const layer_weights& lw = w.layer(l);
      const bool local = c.is_local(l);
      for (int t = 0; t < k; ++t)
        detail::rmsnorm(row(s.xb, t, dim), row(s.x, t, dim), lw.attn_norm.data(), dim, eps);
      const auto [k_rows, v_rows] = kv_rows(l);
      detail::matmul(s.q.data(), s.xb.data(), lw.wq, k, threads_, mm_scratch_);
      detail::matmul(k_rows, s.xb.data(), lw.wk, k, threads_, mm_scratch_);
      detail::matmul(v_rows, s.xb.data(), lw.wv, k, threads_, mm_scratch_);
      for (int t = 0; t < k; ++t) {
        const float* table = row(s.rope, t, 2 * c.head_dim);
        norm_rope(row(s.q, t, q_dim), c.n_heads, lw.q_norm.data(), table, local);
        norm_rope(k_rows + static_cast<std::ptrdiff_t>(t) * kv_dim, c.n_kv_heads, lw.k_norm.data(),
                  table, local);
      }
      for (int t = 0; t < k; ++t) attend(l, t, row(s.q, t, q_dim), row(s.att, t, q_dim));
      detail::matmul(s.xb2.data(), s.att.data(), lw.wo, k, threads_, mm_scratch_);
      for (int t = 0; t < k; ++t) {
        float* o = row(s.xb2, t, dim);
        detail::rmsnorm(o, o, lw.post_attn_norm.data(), dim, eps);
        float* x = row(s.x, t, dim);
        for (int i = 0; i < dim; ++i) x[i] += o[i];
      }

      for (int t = 0; t < k; ++t)
        detail::rmsnorm(row(s.xb, t, dim), row(s.x, t, dim), lw.ffn_norm.data(), dim, eps);
      detail::matmul(s.hb.data(), s.xb.data(), lw.gate, k, threads_, mm_scratch_);
      detail::matmul(s.hb2.data(), s.xb.data(), lw.up, k, threads_, mm_scratch_);
      for (std::size_t i = 0; i < static_cast<std::size_t>(k) * hidden; ++i)
        s.hb[i] = detail::gelu_tanh(s.hb[i]) * s.hb2[i];
      detail::matmul(s.xb2.data(), s.hb.data(), lw.down, k, threads_, mm_scratch_);
      for (int t = 0; t < k; ++t) {
        float* o = row(s.xb2, t, dim);
        detail::rmsnorm(o, o, lw.post_ffn_norm.data(), dim, eps);
        float* x = row(s.x, t, dim);
        for (int i = 0; i < dim; ++i) x[i] += o[i];
      }
    }

    const int out_tokens = k - logits_from;
    if (out_tokens <= 0) return;
    for (int t = 0; t < out_tokens; ++t)
      detail::rmsnorm(row(s.xb, t, dim), row(s.x, logits_from + t, dim), w.output_norm().data(),
                      dim, eps);
    detail::matmul(logits.data(), s.xb.data(), w.embedding(), out_tokens, threads_, mm_scratch_);
  }

  const weights* model_;
  Attention attention_;
  kv_cache cache_;
  int threads_ = 0;
  std::vector<double> inv_freq_global_, inv_freq_local_;  // [head_dim / 2]
  std::vector<float> scores_;                             // prefill attention scratch
  std::vector<float> mm_scratch_;                         // dequantized weight rows, per thread
  scratch scratch_;
};

}  // namespace lynx_examples::gemma3
