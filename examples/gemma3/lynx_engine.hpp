// The Gemma-3 engine on a decode node that receives its prompt KV through
// Lynx: attention over the prompt is lynx::decode_attention reading each
// layer's bit-plane tensor at a precision level; over the tokens decoded here
// it reads the engine's fp32 tail. Satisfies lynx::decode_engine.
//
// Window-aware transfer: a sliding-window layer's queries only ever see the
// last `window` positions, so once decoding starts (at position P, the prompt
// length) no query of that layer reads a prompt key older than P - window + 1.
// Such a layer's tensor holds only the last min(P, window - 1) prompt tokens;
// global layers hold the whole prompt. The attention positions are relative to
// the tensor's first token, so the variant's window applies unchanged.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemma3/forward.hpp"
#include "gemma3/model.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/speculation/engine.hpp"

namespace lynx_examples::gemma3 {

/// Prompt tokens layer l's tensor holds when the prompt has `prompt_tokens`:
/// the last window - 1 on a local layer (all a decoded query can see), all on
/// a global one. window_aware = false: every layer holds the whole prompt.
inline int shipped_tokens(const config& c, int layer, int prompt_tokens, bool window_aware = true) {
  if (window_aware && c.is_local(layer)) return std::min(prompt_tokens, c.window - 1);
  return prompt_tokens;
}

template <lynx::stream_plan_type Plan, int G = 32>
using prompt_tensors = std::vector<lynx::bitplane_tensor<Plan, G, lynx::host_space>>;

/// One receiver tensor per layer for a prompt of `prompt_tokens`.
template <lynx::stream_plan_type Plan, int G = 32>
prompt_tensors<Plan, G> make_prompt_tensors(const config& c, int prompt_tokens,
                                            bool window_aware = true,
                                            std::uint64_t generation = 0) {
  prompt_tensors<Plan, G> t;
  t.reserve(static_cast<std::size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l)
    t.emplace_back(
        lynx::kv_shape{shipped_tokens(c, l, prompt_tokens, window_aware), c.n_kv_heads, c.head_dim},
        static_cast<std::uint32_t>(l), generation);
  return t;
}

/// The prefill node's work: every layer's prompt KV (its shipped part) encoded.
template <lynx::stream_plan_type Plan, int G = 32, class Attention>
std::vector<lynx::encoded_layer<Plan, G>> encode_prompt(const engine<Attention>& e,
                                                        bool window_aware = true,
                                                        const lynx::encode_options& options = {}) {
  const kv_cache& cache = e.cache();
  if (!cache.holds_prompt())
    throw std::logic_error("gemma3: encode_prompt needs a prefilled engine");
  const int P = cache.prompt_length(), stride = cache.token_stride();
  std::vector<lynx::encoded_layer<Plan, G>> layers;
  layers.reserve(static_cast<std::size_t>(cache.n_layers()));
  for (int l = 0; l < cache.n_layers(); ++l) {
    const int n = shipped_tokens(e.cfg(), l, P, window_aware);
    const lynx::kv_shape shape{n, cache.n_kv_heads(), cache.head_dim()};
    const std::ptrdiff_t first = static_cast<std::ptrdiff_t>(P - n) * stride;
    layers.push_back(lynx::encode<Plan, G, float>(
        lynx::token_major<const float>(cache.prompt_keys(l).data() + first, shape),
        lynx::token_major<const float>(cache.prompt_values(l).data() + first, shape),
        static_cast<std::uint32_t>(l), options));
  }
  return layers;
}

/// Attention policy: the prompt through Lynx at `level`, the tail in fp32.
template <lynx::stream_plan_type Plan, int G = 32>
class lynx_prompt_attention {
 public:
  lynx_prompt_attention(const config& c, const prompt_tensors<Plan, G>* prompt) : prompt_(prompt) {
    local_.reserve(static_cast<std::size_t>(c.n_layers));
    global_.variant.window_ = 0;
    local_window_.variant.window_ = c.window;
    for (int l = 0; l < c.n_layers; ++l) local_.push_back(c.is_local(l));
  }

  int level = 1;  // precision level the prompt is read at
  int threads = 1;

  void operator()(const kv_cache& cache, int layer, std::span<const float> q, int tail_visible,
                  std::span<float> out) {
    const auto& tensor = (*prompt_)[static_cast<std::size_t>(layer)];
    const auto view = tensor.view_at(level);
    const lynx::kv_shape tail_shape{cache.tail_length(), cache.n_kv_heads(), cache.head_dim()};
    const auto tail_keys =
        lynx::token_major<const float>(cache.tail_keys(layer).data(), tail_shape);
    const auto tail_values =
        lynx::token_major<const float>(cache.tail_values(layer).data(), tail_shape);
    const lynx::attention_queries queries{
        q.data(), 1, static_cast<std::int64_t>(q.size()) / cache.head_dim(), cache.head_dim()};
    const lynx::tail_visibility visible{tail_visible - 1, 1};
    const auto problem = lynx::decode_attention<>::problem(view, tail_keys, queries, visible);
    if (workspace_.size() < lynx::attention_workspace::bytes_needed(problem, threads))
      workspace_.reserve(problem, threads);
    const auto& attn = local_[static_cast<std::size_t>(layer)] ? local_window_ : global_;
    attn(view, tail_keys, tail_values, queries, visible,
         lynx::attention_output{out.data(), nullptr}, workspace_, {.threads = threads});
  }

 private:
  const prompt_tensors<Plan, G>* prompt_;
  std::vector<bool> local_;
  lynx::decode_attention<> global_{}, local_window_{};
  lynx::attention_workspace workspace_{};
};

/// The decode node's engine, as lynx::progressive_session drives it.
template <lynx::stream_plan_type Plan, int G = 32>
class lynx_decode_engine {
 public:
  lynx_decode_engine(const weights& model, const prompt_tensors<Plan, G>& prompt, int prompt_tokens,
                     int threads = 0)
      : inner_(model, lynx_prompt_attention<Plan, G>(model.cfg(), &prompt), threads) {
    const config& c = model.cfg();
    if (static_cast<int>(prompt.size()) != c.n_layers)
      throw std::invalid_argument("gemma3: " + std::to_string(prompt.size()) +
                                  " prompt tensors for a model of " + std::to_string(c.n_layers) +
                                  " layers");
    for (int l = 0; l < c.n_layers; ++l) {
      const std::int64_t held = prompt[static_cast<std::size_t>(l)].geometry().tokens;
      if (held != shipped_tokens(c, l, prompt_tokens) && held != prompt_tokens)
        throw std::invalid_argument("gemma3: layer " + std::to_string(l) + "'s tensor holds " +
                                    std::to_string(held) + " tokens for a prompt of " +
                                    std::to_string(prompt_tokens));
      if (c.is_local(l) == false && held != prompt_tokens)
        throw std::invalid_argument("gemma3: global layer " + std::to_string(l) +
                                    " needs the whole prompt (" + std::to_string(prompt_tokens) +
                                    " tokens), its tensor holds " + std::to_string(held));
    }
    inner_.begin_decode(prompt_tokens);
  }

  [[nodiscard]] std::int64_t vocab_size() const { return inner_.cfg().vocab_size; }
  [[nodiscard]] std::int64_t tail_size() const { return inner_.cache().tail_length(); }
  void drop_tail(std::int64_t n) { inner_.truncate_tail(static_cast<int>(n)); }
  void forward(std::span<const std::int32_t> tokens, std::int64_t first_position, int level,
               std::span<float> logits) {
    inner_.attention().level = level;
    inner_.decode(tokens, static_cast<int>(first_position), logits);
  }
  [[nodiscard]] engine<lynx_prompt_attention<Plan, G>>& inner() { return inner_; }

 private:
  engine<lynx_prompt_attention<Plan, G>> inner_;
};

}  // namespace lynx_examples::gemma3
