// A batch-invariant CPU forward pass for llama2.c models, built for Lynx tests:
// the logits of a token are bitwise identical whether it is decoded alone or
// among k others, and the attention over the prompt is a pluggable policy so a
// Lynx attention over a quantized, partially-arrived prompt KV can replace it.
//
// Batch invariance comes from one rule: every output element is computed by
// the same per-token function with a reduction order fixed by the input
// dimension only (never by k). Batching is an outer loop that reuses each weight
// row across the k tokens; it never changes any token's arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "model.hpp"

namespace lynx_examples::llama2c {

// ---------------------------------------------------------------------------
// Deterministic kernels
// ---------------------------------------------------------------------------

namespace detail {

// Dot product with a fixed reduction order that depends only on n: element i
// goes to partial sum i % 16, the 16 partials are combined pairwise
// (j += j + 8, then + 4, + 2, + 1). The 16 independent lanes let the compiler
// vectorize without reassociating anything, so the result is the same with or
// without SIMD (FMA contraction, if the target has it, applies to every caller
// alike since all of them go through this function).
inline float dot(const float* a, const float* b, int n) {
  constexpr int lanes = 16;
  float acc[lanes] = {};
  int i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int j = 0; j < lanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  for (int width = lanes / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

// out[t, r] = dot(w[r, :], in[t, :]) for t < tokens: out [tokens, rows],
// in [tokens, cols], w [rows, cols]. Rows outside, tokens inside: each weight
// row is loaded once per batch; each output is the same dot() as for one token.
inline void matmul(float* out, const float* in, const float* w, int tokens, int rows, int cols) {
  for (int r = 0; r < rows; ++r) {
    const float* row = w + static_cast<std::ptrdiff_t>(r) * cols;
    for (int t = 0; t < tokens; ++t)
      out[static_cast<std::ptrdiff_t>(t) * rows + r] =
          dot(row, in + static_cast<std::ptrdiff_t>(t) * cols, cols);
  }
}

// RMSNorm of one token as llama2.c: out = weight * (x / sqrt(mean(x^2) + 1e-5)).
inline void rmsnorm(float* out, const float* x, const float* weight, int n) {
  float ss = dot(x, x, n) / static_cast<float>(n) + 1e-5f;
  ss = 1.0f / std::sqrt(ss);
  for (int i = 0; i < n; ++i) out[i] = weight[i] * (ss * x[i]);
}

// Score of one key: sequential fp32 sum over head_dim (tiny; fixed order).
inline float head_dot(const float* q, const float* k, int head_dim) {
  float s = 0.0f;
  for (int i = 0; i < head_dim; ++i) s += q[i] * k[i];
  return s;
}

}  // namespace detail

// ---------------------------------------------------------------------------
// KV cache
// ---------------------------------------------------------------------------

// Per layer, two fp32 regions, each [tokens, n_kv_heads, head_dim] row-major
// (token-major, token stride kv_dim floats), with RoPE already applied to K:
//  - prompt: written by prefill. On a decode node this is what Lynx receives
//    quantized; a Lynx attention policy reads its own tensor instead, and
//    tests may overwrite this region with dequantized values.
//  - tail: K/V of tokens decoded on this node, appended by decode and dropped
//    from the end on rollback of rejected drafts.
// Position of tail entry i is prompt_length() + i.
class kv_cache {
 public:
  kv_cache() = default;
  explicit kv_cache(const config& c)
      : n_layers_(c.n_layers),
        n_kv_heads_(c.n_kv_heads),
        head_dim_(c.head_size()),
        seq_len_(c.seq_len),
        prompt_k_(static_cast<std::size_t>(c.n_layers)),
        prompt_v_(static_cast<std::size_t>(c.n_layers)),
        tail_k_(static_cast<std::size_t>(c.n_layers)),
        tail_v_(static_cast<std::size_t>(c.n_layers)) {}

  [[nodiscard]] int n_layers() const { return n_layers_; }
  [[nodiscard]] int n_kv_heads() const { return n_kv_heads_; }
  [[nodiscard]] int head_dim() const { return head_dim_; }
  [[nodiscard]] int token_stride() const { return n_kv_heads_ * head_dim_; }  // floats
  [[nodiscard]] int capacity() const { return seq_len_; }  // prompt + tail positions
  [[nodiscard]] int prompt_length() const { return prompt_length_; }
  [[nodiscard]] int tail_length() const { return tail_length_; }
  [[nodiscard]] int length() const { return prompt_length_ + tail_length_; }

  // [prompt_length, n_kv_heads, head_dim]
  [[nodiscard]] std::span<float> prompt_keys(int l) { return region(prompt_k_, l, prompt_length_); }
  [[nodiscard]] std::span<float> prompt_values(int l) {
    return region(prompt_v_, l, prompt_length_);
  }
  [[nodiscard]] std::span<const float> prompt_keys(int l) const {
    return region(prompt_k_, l, prompt_length_);
  }
  [[nodiscard]] std::span<const float> prompt_values(int l) const {
    return region(prompt_v_, l, prompt_length_);
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

  // Starts a new sequence with a prompt of n tokens (contents to be written)
  // and an empty tail. Allocates here, not on the decode path: the tail gets
  // room for every remaining position.
  void reset(int prompt_tokens) {
    if (prompt_tokens < 0 || prompt_tokens > seq_len_)
      throw std::out_of_range("llama2c: prompt of " + std::to_string(prompt_tokens) +
                              " tokens does not fit a context of " + std::to_string(seq_len_));
    const auto stride = static_cast<std::size_t>(token_stride());
    for (int l = 0; l < n_layers_; ++l) {
      const auto li = static_cast<std::size_t>(l);
      prompt_k_[li].assign(static_cast<std::size_t>(prompt_tokens) * stride, 0.0f);
      prompt_v_[li].assign(static_cast<std::size_t>(prompt_tokens) * stride, 0.0f);
      tail_k_[li].resize(static_cast<std::size_t>(seq_len_ - prompt_tokens) * stride);
      tail_v_[li].resize(static_cast<std::size_t>(seq_len_ - prompt_tokens) * stride);
    }
    prompt_length_ = prompt_tokens;
    tail_length_ = 0;
  }

  // Makes room for n more tail tokens (contents to be written by the caller)
  // and returns the index of the first one.
  int grow_tail(int n) {
    if (n < 0 || length() + n > seq_len_)
      throw std::out_of_range("llama2c: cannot append " + std::to_string(n) +
                              " tokens to a cache holding " + std::to_string(length()) + " of " +
                              std::to_string(seq_len_) + " positions");
    const int first = tail_length_;
    tail_length_ += n;
    return first;
  }

  // Drops the last n tail entries (rejected drafts).
  void truncate_tail(int n) {
    if (n < 0 || n > tail_length_)
      throw std::out_of_range("llama2c: cannot drop " + std::to_string(n) + " tail tokens of " +
                              std::to_string(tail_length_));
    tail_length_ -= n;
  }

 private:
  template <class Regions>
  auto region(Regions& regions, int l, int tokens) const
      -> std::span<std::remove_reference_t<decltype(*regions[0].data())>> {
    if (l < 0 || l >= n_layers_)
      throw std::out_of_range("llama2c: layer " + std::to_string(l) + " out of range");
    return {regions[static_cast<std::size_t>(l)].data(),
            static_cast<std::size_t>(tokens) * static_cast<std::size_t>(token_stride())};
  }

  int n_layers_ = 0, n_kv_heads_ = 0, head_dim_ = 0, seq_len_ = 0;
  int prompt_length_ = 0, tail_length_ = 0;
  std::vector<std::vector<float>> prompt_k_, prompt_v_, tail_k_, tail_v_;  // [layer][...]
};

// ---------------------------------------------------------------------------
// Attention policy
// ---------------------------------------------------------------------------

// An attention policy computes the attention output of ONE query position:
//
//   void operator()(const kv_cache& cache, int layer,
//                   std::span<const float> q,  // [n_heads, head_dim], RoPE applied
//                   int tail_visible,          // tail tokens this query sees, in
//                                              // [0, cache.tail_length()]: the
//                                              // causal mask inside a k-token batch
//                   std::span<float> out);     // [n_heads, head_dim]
//
// out[h] = sum_t softmax_t(q[h] . k[t, h / kv_group] / sqrt(head_dim)) v[t, h / kv_group]
// over every prompt token, then tail tokens 0 .. tail_visible - 1. The policy
// must be deterministic per query (independent of which other queries are in
// the batch and of the call order) for the engine to stay batch invariant.
// The engine calls it with a non-const reference, so it may keep scratch.
template <class P>
concept attention_policy = requires(P& p, const kv_cache& cache, int layer,
                                    std::span<const float> q, int tail_visible,
                                    std::span<float> out) {
  p(cache, layer, q, tail_visible, out);
};

namespace detail {

// Exact fp32 attention of one query over a sequence of KV ranges taken in
// order: two-pass softmax per head (scores, max, exp, sum and weighted sum in
// position order, then one division). `ranges` is {keys, values, tokens}
// with keys/values [tokens, n_kv_heads, head_dim]; `scores` has room for all
// tokens. Prefill and the default policy both use this, so a token gets the
// same bits whether it was in the prompt or decoded.
// ScoreDot computes q . k over head_dim (the default: a sequential sum).
struct kv_range {
  const float* keys;
  const float* values;
  int tokens;
};

template <float (*ScoreDot)(const float*, const float*, int) = head_dot>
void exact_attend(std::span<const kv_range> ranges, const float* q, float* out, int n_heads,
                  int kv_group, int head_dim, int token_stride, float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + static_cast<std::ptrdiff_t>(h) * head_dim;
    const int kv_offset = (h / kv_group) * head_dim;
    float* oh = out + static_cast<std::ptrdiff_t>(h) * head_dim;
    int n = 0;
    float max_score = -std::numeric_limits<float>::infinity();
    for (const kv_range& r : ranges)
      for (int t = 0; t < r.tokens; ++t) {
        const float s =
            ScoreDot(qh, r.keys + static_cast<std::ptrdiff_t>(t) * token_stride + kv_offset,
                     head_dim) *
            scale;
        scores[n++] = s;
        max_score = s > max_score ? s : max_score;
      }
    for (int i = 0; i < head_dim; ++i) oh[i] = 0.0f;
    float sum = 0.0f;
    n = 0;
    for (const kv_range& r : ranges)
      for (int t = 0; t < r.tokens; ++t) {
        const float p = std::exp(scores[n++] - max_score);
        sum += p;
        const float* v = r.values + static_cast<std::ptrdiff_t>(t) * token_stride + kv_offset;
        for (int i = 0; i < head_dim; ++i) oh[i] += p * v[i];
      }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // sum == 0 only with no keys
    for (int i = 0; i < head_dim; ++i) oh[i] *= inv;
  }
}

}  // namespace detail

// The default policy: exact fp32 attention over the cache's fp32 prompt K/V
// followed by the visible tail, in position order.
class exact_attention {
 public:
  void operator()(const kv_cache& cache, int layer, std::span<const float> q, int tail_visible,
                  std::span<float> out) {
    if (tail_visible < 0 || tail_visible > cache.tail_length())
      throw std::out_of_range("llama2c: tail_visible " + std::to_string(tail_visible) +
                              " outside [0, " + std::to_string(cache.tail_length()) + "]");
    const int head_dim = cache.head_dim();
    const int n_heads = static_cast<int>(q.size()) / head_dim;
    scores_.resize(static_cast<std::size_t>(cache.prompt_length() + tail_visible));
    const detail::kv_range ranges[2] = {
        {cache.prompt_keys(layer).data(), cache.prompt_values(layer).data(), cache.prompt_length()},
        {cache.tail_keys(layer).data(), cache.tail_values(layer).data(), tail_visible}};
    detail::exact_attend(ranges, q.data(), out.data(), n_heads, n_heads / cache.n_kv_heads(),
                         head_dim, cache.token_stride(), scores_.data());
  }

 private:
  std::vector<float> scores_;  // [prompt + tail_visible] scratch, grows once
};

static_assert(attention_policy<exact_attention>);

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

// Greedy choice: the largest logit, ties to the lowest token id.
inline int argmax(std::span<const float> logits) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(logits.size()); ++i)
    if (logits[static_cast<std::size_t>(i)] > logits[static_cast<std::size_t>(best)]) best = i;
  return best;
}

// The forward pass of one sequence: prefill writes the prompt KV, decode runs
// k tokens at consecutive positions against prompt + tail and appends their KV
// to the tail, truncate_tail rolls drafts back. Holds a pointer to the weights,
// which must outlive it.
template <attention_policy Attention = exact_attention>
class engine {
 public:
  using attention_type = Attention;

  explicit engine(const weights& model, Attention attention = Attention{})
      : model_(&model), attention_(std::move(attention)), cache_(model.cfg()) {
    cache_.reset(0);  // decoding without a prompt is allowed: everything goes to the tail
    const config& c = model.cfg();
    const int half = c.head_size() / 2;
    rope_.resize(static_cast<std::size_t>(c.seq_len) * half * 2);
    // [seq_len, head_size / 2] x (cos, sin), as llama2.c computes them per call.
    for (int p = 0; p < c.seq_len; ++p)
      for (int i = 0; i < half; ++i) {
        const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) /
                                                         static_cast<float>(c.head_size()));
        const float angle = static_cast<float>(p) * freq;
        rope_[(static_cast<std::size_t>(p) * half + i) * 2] = std::cos(angle);
        rope_[(static_cast<std::size_t>(p) * half + i) * 2 + 1] = std::sin(angle);
      }
  }

  [[nodiscard]] const config& cfg() const { return model_->cfg(); }
  [[nodiscard]] const weights& model() const { return *model_; }
  [[nodiscard]] kv_cache& cache() { return cache_; }
  [[nodiscard]] const kv_cache& cache() const { return cache_; }
  [[nodiscard]] Attention& attention() { return attention_; }
  // Position of the next token to decode.
  [[nodiscard]] int position() const { return cache_.length(); }

  // Sizes the scratch for batches of up to `tokens` so decode does not allocate.
  void reserve(int tokens) { scratch_.resize(cfg(), tokens); }

  // Computes the prompt KV of every layer (positions 0 .. n-1, causal, exact
  // fp32; the attention policy is not used: the prefill node has the full
  // precision cache) and writes the logits of the last prompt token, [vocab].
  // Starts a new sequence: the tail is emptied.
  void prefill(std::span<const int> prompt, std::span<float> last_logits) {
    const config& c = cfg();
    const int n = static_cast<int>(prompt.size());
    if (n == 0) throw std::invalid_argument("llama2c: prefill needs at least one token");
    check_logits(last_logits, 1);
    cache_.reset(n);
    scores_.resize(static_cast<std::size_t>(n));
    auto attend = [&](int l, int t, const float* q, float* out) {
      const detail::kv_range ranges[2] = {
          {cache_.prompt_keys(l).data(), cache_.prompt_values(l).data(), t + 1},
          {nullptr, nullptr, 0}};
      detail::exact_attend(ranges, q, out, c.n_heads, c.kv_group(), c.head_size(),
                           cache_.token_stride(), scores_.data());
    };
    auto kv_rows = [&](int l) {
      return std::pair{cache_.prompt_keys(l).data(), cache_.prompt_values(l).data()};
    };
    forward(
        prompt, [](int t) { return t; }, kv_rows, no_kv_hook, attend, last_logits,
        /*logits_from=*/n - 1);
  }

  // Starts a sequence on a decode node: the prompt's KV arrives from elsewhere
  // (a Lynx attention policy reads it from its bit-plane tensors), so only the
  // prompt length is set; the fp32 prompt region stays zero and the tail empty.
  void begin_decode(int prompt_tokens) { cache_.reset(prompt_tokens); }

  [[nodiscard]] std::vector<float> prefill(std::span<const int> prompt) {
    std::vector<float> logits(static_cast<std::size_t>(cfg().vocab_size));
    prefill(prompt, logits);
    return logits;
  }

  // Runs k tokens at positions first_position .. first_position + k - 1, which
  // must continue the cache (first_position == position()). Token j attends to
  // the prompt (through the policy) and to the tail up to and including itself.
  // Writes logits [k, vocab]; appends the k tokens' KV to the tail.
  void decode(std::span<const int> tokens, int first_position, std::span<float> logits) {
    const int k = static_cast<int>(tokens.size());
    if (first_position != position())
      throw std::invalid_argument("llama2c: decode at position " + std::to_string(first_position) +
                                  " but the cache holds " + std::to_string(position()) +
                                  " tokens (positions must be consecutive)");
    check_logits(logits, k);
    if (k == 0) return;
    const int first_tail = cache_.grow_tail(k);
    auto attend = [&](int l, int t, const float* q, float* out) {
      const std::size_t width = static_cast<std::size_t>(cfg().dim);
      attention_(std::as_const(cache_), l, std::span<const float>(q, width), first_tail + t + 1,
                 std::span<float>(out, width));
    };
    const std::size_t offset =
        static_cast<std::size_t>(first_tail) * static_cast<std::size_t>(cache_.token_stride());
    auto kv_rows = [&](int l) {
      return std::pair{cache_.tail_keys(l).data() + offset, cache_.tail_values(l).data() + offset};
    };
    forward(
        tokens, [&](int t) { return first_position + t; }, kv_rows, no_kv_hook, attend, logits,
        /*logits_from=*/0);
  }

  /// One sequence's part of a batched forward (decode_batch).
  struct batch_item {
    engine* sequence = nullptr;
    std::span<const int> tokens;
    int first_position = 0;   // == sequence->position()
    std::span<float> logits;  // [tokens][vocab]
  };

  /// The tokens of many sequences in one forward (continuous batching): every
  /// weight row is read once for all of them, while token j of item i attends to
  /// its own sequence only. Each item's logits and tail are the bits its own
  /// decode() would give: the matmuls compute each token's row as for one token,
  /// and each attention call is the one decode makes. The sequences share the
  /// weights; the first one's scratch is used.
  static void decode_batch(std::span<const batch_item> items) {
    if (items.empty()) return;
    engine& lead = *items[0].sequence;
    const config& c = lead.cfg();
    std::vector<int> all;
    std::vector<std::pair<int, int>> where;  // per token: (item, index in the item)
    for (std::size_t i = 0; i < items.size(); ++i) {
      const batch_item& it = items[i];
      if (it.sequence->model_ != lead.model_)
        throw std::invalid_argument("llama2c: decode_batch over sequences of different weights");
      if (it.first_position != it.sequence->position())
        throw std::invalid_argument("llama2c: decode_batch item " + std::to_string(i) +
                                    " at position " + std::to_string(it.first_position) +
                                    " but its cache holds " +
                                    std::to_string(it.sequence->position()) + " tokens");
      it.sequence->check_logits(it.logits, static_cast<int>(it.tokens.size()));
      if (it.sequence->position() + static_cast<int>(it.tokens.size()) > c.seq_len)
        throw std::out_of_range("llama2c: decode_batch item " + std::to_string(i) +
                                " runs past the context of " + std::to_string(c.seq_len));
      for (std::size_t j = 0; j < it.tokens.size(); ++j) {
        all.push_back(it.tokens[j]);
        where.emplace_back(static_cast<int>(i), static_cast<int>(j));
      }
    }
    const int k = static_cast<int>(all.size());
    if (k == 0) return;
    std::vector<int> first_tail(items.size());
    for (std::size_t i = 0; i < items.size(); ++i)
      first_tail[i] = items[i].sequence->cache_.grow_tail(static_cast<int>(items[i].tokens.size()));
    const auto kv_dim = static_cast<std::size_t>(c.kv_dim());
    lead.batch_k_.resize(static_cast<std::size_t>(k) * kv_dim);
    lead.batch_v_.resize(lead.batch_k_.size());
    lead.batch_logits_.resize(static_cast<std::size_t>(k) * static_cast<std::size_t>(c.vocab_size));
    auto position = [&](int t) {
      const auto [i, j] = where[static_cast<std::size_t>(t)];
      return items[static_cast<std::size_t>(i)].first_position + j;
    };
    auto kv_rows = [&](int) { return std::pair{lead.batch_k_.data(), lead.batch_v_.data()}; };
    // Each token's K/V row (RoPE applied) into its own sequence's tail.
    auto kv_written = [&](int l, const float* k_rows, const float* v_rows) {
      for (int t = 0; t < k; ++t) {
        const auto [i, j] = where[static_cast<std::size_t>(t)];
        kv_cache& cache = items[static_cast<std::size_t>(i)].sequence->cache_;
        const std::size_t at =
            static_cast<std::size_t>(first_tail[static_cast<std::size_t>(i)] + j) * kv_dim;
        std::copy_n(k_rows + static_cast<std::size_t>(t) * kv_dim, kv_dim,
                    cache.tail_keys(l).data() + at);
        std::copy_n(v_rows + static_cast<std::size_t>(t) * kv_dim, kv_dim,
                    cache.tail_values(l).data() + at);
      }
    };
    auto attend = [&](int l, int t, const float* q, float* out) {
      const auto [i, j] = where[static_cast<std::size_t>(t)];
      engine& e = *items[static_cast<std::size_t>(i)].sequence;
      const std::size_t width = static_cast<std::size_t>(c.dim);
      e.attention_(std::as_const(e.cache_), l, std::span<const float>(q, width),
                   first_tail[static_cast<std::size_t>(i)] + j + 1, std::span<float>(out, width));
    };
    lead.forward(all, position, kv_rows, kv_written, attend, lead.batch_logits_,
                 /*logits_from=*/0);
    const auto vocab = static_cast<std::size_t>(c.vocab_size);
    std::size_t row = 0;
    for (const batch_item& it : items) {
      std::copy_n(lead.batch_logits_.data() + row * vocab, it.tokens.size() * vocab,
                  it.logits.data());
      row += it.tokens.size();
    }
  }

  [[nodiscard]] std::vector<float> decode(std::span<const int> tokens, int first_position) {
    std::vector<float> logits(tokens.size() * static_cast<std::size_t>(cfg().vocab_size));
    decode(tokens, first_position, logits);
    return logits;
  }

  // Drops the last n decoded tokens' KV (rollback of rejected drafts).
  void truncate_tail(int n) { cache_.truncate_tail(n); }

 private:
  // Activations of a batch, token-major: x [k, dim] etc.
  struct scratch {
    std::vector<float> x, xb, xb2, q, att, hb, hb2;
    int tokens = 0;
    void resize(const config& c, int k) {
      if (k <= tokens) return;
      const auto kk = static_cast<std::size_t>(k);
      x.resize(kk * c.dim);
      xb.resize(kk * c.dim);
      xb2.resize(kk * c.dim);
      q.resize(kk * c.dim);
      att.resize(kk * c.dim);
      hb.resize(kk * c.hidden_dim);
      hb2.resize(kk * c.hidden_dim);
      tokens = k;
    }
  };

  void check_logits(std::span<float> logits, int rows) const {
    const std::size_t want =
        static_cast<std::size_t>(rows) * static_cast<std::size_t>(cfg().vocab_size);
    if (logits.size() != want)
      throw std::invalid_argument("llama2c: logits span has " + std::to_string(logits.size()) +
                                  " floats, expected " + std::to_string(want));
  }

  // Rotates pairs (i, i+1) of each head of `v` ([heads, head_size]) by the
  // angle of `pos`; frequency depends on i mod head_size.
  void rope(float* v, int heads, int pos) const {
    const int hs = cfg().head_size(), half = hs / 2;
    const float* table = rope_.data() + static_cast<std::size_t>(pos) * half * 2;
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < half; ++i) {
        float* pair = v + static_cast<std::ptrdiff_t>(h) * hs + 2 * i;
        const float c = table[2 * i], s = table[2 * i + 1];
        const float a = pair[0], b = pair[1];
        pair[0] = a * c - b * s;
        pair[1] = a * s + b * c;
      }
  }

  static constexpr auto no_kv_hook = [](int, const float*, const float*) {};

  // The shared body of prefill and decode, layer-major over the k tokens.
  // kv_rows(l) -> (K rows, V rows) [k, kv_dim] where this batch's KV goes;
  // attend(l, j, q, out) computes token j's attention once its KV is written.
  // Logits are written for tokens logits_from .. k-1.
  // position(t): token t's position; kv_written(l, K rows, V rows) once a
  // layer's rows are computed and rotated (before any attention of that layer).
  template <class Position, class KvRows, class KvWritten, class Attend>
  void forward(std::span<const int> tokens, Position&& position, KvRows&& kv_rows,
               KvWritten&& kv_written, Attend&& attend, std::span<float> logits, int logits_from) {
    const config& c = cfg();
    const weights& w = *model_;
    const int k = static_cast<int>(tokens.size());
    const int dim = c.dim, hidden = c.hidden_dim, kv_dim = c.kv_dim();
    for (int t = 0; t < k; ++t)
      if (position(t) < 0 || position(t) >= c.seq_len)
        throw std::out_of_range("llama2c: position " + std::to_string(position(t)) +
                                " outside the context of " + std::to_string(c.seq_len));
    for (const int t : tokens)
      if (t < 0 || t >= c.vocab_size)
        throw std::out_of_range("llama2c: token " + std::to_string(t) + " outside vocab of " +
                                std::to_string(c.vocab_size));
    scratch_.resize(c, k);
    scratch& s = scratch_;
    auto row = [](std::vector<float>& v, int t, int width) {
      return v.data() + static_cast<std::ptrdiff_t>(t) * width;
    };

    const float* embedding = w.token_embedding().data();
    for (int t = 0; t < k; ++t)
      for (int i = 0; i < dim; ++i)
        row(s.x, t, dim)[i] =
            embedding[static_cast<std::ptrdiff_t>(tokens[static_cast<std::size_t>(t)]) * dim + i];

    for (int l = 0; l < c.n_layers; ++l) {
      // Attention block: xb = rmsnorm(x); q, k, v = W xb; RoPE; x += wo attention.
      for (int t = 0; t < k; ++t)
        detail::rmsnorm(row(s.xb, t, dim), row(s.x, t, dim), w.rms_att(l).data(), dim);
      const auto [k_rows, v_rows] = kv_rows(l);
      detail::matmul(s.q.data(), s.xb.data(), w.wq(l).data(), k, dim, dim);
      detail::matmul(k_rows, s.xb.data(), w.wk(l).data(), k, kv_dim, dim);
      detail::matmul(v_rows, s.xb.data(), w.wv(l).data(), k, kv_dim, dim);
      for (int t = 0; t < k; ++t) {
        rope(row(s.q, t, dim), c.n_heads, position(t));
        rope(k_rows + static_cast<std::ptrdiff_t>(t) * kv_dim, c.n_kv_heads, position(t));
      }
      kv_written(l, k_rows, v_rows);
      for (int t = 0; t < k; ++t) attend(l, t, row(s.q, t, dim), row(s.att, t, dim));
      detail::matmul(s.xb2.data(), s.att.data(), w.wo(l).data(), k, dim, dim);
      for (std::size_t i = 0; i < static_cast<std::size_t>(k) * dim; ++i) s.x[i] += s.xb2[i];

      // Feed-forward block: x += w2 (silu(w1 xb) * w3 xb).
      for (int t = 0; t < k; ++t)
        detail::rmsnorm(row(s.xb, t, dim), row(s.x, t, dim), w.rms_ffn(l).data(), dim);
      detail::matmul(s.hb.data(), s.xb.data(), w.w1(l).data(), k, hidden, dim);
      detail::matmul(s.hb2.data(), s.xb.data(), w.w3(l).data(), k, hidden, dim);
      for (std::size_t i = 0; i < static_cast<std::size_t>(k) * hidden; ++i) {
        const float a = s.hb[i];
        s.hb[i] = a * (1.0f / (1.0f + std::exp(-a))) * s.hb2[i];
      }
      detail::matmul(s.xb2.data(), s.hb.data(), w.w2(l).data(), k, dim, hidden);
      for (std::size_t i = 0; i < static_cast<std::size_t>(k) * dim; ++i) s.x[i] += s.xb2[i];
    }

    // Final norm and classifier, only for the tokens whose logits are wanted.
    const int out_tokens = k - logits_from;
    for (int t = 0; t < out_tokens; ++t)
      detail::rmsnorm(row(s.xb, t, dim), row(s.x, logits_from + t, dim), w.rms_final().data(), dim);
    detail::matmul(logits.data(), s.xb.data(), w.classifier().data(), out_tokens, c.vocab_size,
                   dim);
  }

  const weights* model_;
  Attention attention_;
  kv_cache cache_;
  std::vector<float> rope_;    // [seq_len, head_size / 2, 2] (cos, sin)
  std::vector<float> scores_;  // prefill attention scratch [prompt]
  scratch scratch_;
  std::vector<float> batch_k_, batch_v_, batch_logits_;  // decode_batch scratch (its first item's)
};

}  // namespace lynx_examples::llama2c
