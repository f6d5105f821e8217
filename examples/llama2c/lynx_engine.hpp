// The llama2.c engine on a decode node that receives its prompt KV through
// Lynx: its attention over the prompt is lynx::decode_attention reading the
// bit-plane tensors at a precision level (never materialized), and over the
// tokens decoded here it reads the engine's own fp32 tail. Satisfies
// lynx::decode_engine, so a lynx::progressive_session can drive it.
// Once every stream has landed, the layers can be merged into codes and handed
// to the engine (use_codes): all at once (make_prompt_codes), or layer by layer
// as a lynx::background_merge finishes them while decoding goes on. Attention
// over a layer's codes gives the same bits as over all its planes, so the
// switch can happen at any step, one layer at a time, without touching
// exactness.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "forward.hpp"
#include "lynx/attention/background_merge.hpp"
#include "lynx/attention/code_tensor.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/speculation/engine.hpp"
#include "lynx/speculation/session.hpp"
#include "model.hpp"

namespace lynx_examples::llama2c {

template <lynx::stream_plan_type Plan, int G = 32>
using prompt_tensors = std::vector<lynx::bitplane_tensor<Plan, G, lynx::host_space>>;

/// One tensor per layer of the model's prompt KV, ready to receive segments.
template <lynx::stream_plan_type Plan, int G = 32>
prompt_tensors<Plan, G> make_prompt_tensors(const config& c, int prompt_tokens,
                                            std::uint64_t generation = 0) {
  prompt_tensors<Plan, G> t;
  t.reserve(static_cast<std::size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l)
    t.emplace_back(lynx::kv_shape{prompt_tokens, c.n_kv_heads, c.head_size()},
                   static_cast<std::uint32_t>(l), generation);
  return t;
}

template <lynx::stream_plan_type Plan, int G = 32>
using prompt_codes = std::vector<lynx::code_tensor<Plan, G>>;

/// Every layer of a complete prompt merged into codes.
template <lynx::stream_plan_type Plan, int G = 32>
prompt_codes<Plan, G> make_prompt_codes(const prompt_tensors<Plan, G>& prompt, int threads = 1) {
  prompt_codes<Plan, G> codes;
  codes.reserve(prompt.size());
  for (const auto& layer : prompt) codes.emplace_back(layer, threads);
  return codes;
}

/// The prompt KV of a prefilled engine, encoded layer by layer (the prefill node's work).
template <lynx::stream_plan_type Plan, int G = 32, class Attention>
std::vector<lynx::encoded_layer<Plan, G>> encode_prompt(const engine<Attention>& e,
                                                        const lynx::encode_options& options = {}) {
  const kv_cache& cache = e.cache();
  const lynx::kv_shape shape{cache.prompt_length(), cache.n_kv_heads(), cache.head_dim()};
  std::vector<lynx::encoded_layer<Plan, G>> layers;
  for (int l = 0; l < cache.n_layers(); ++l)
    layers.push_back(lynx::encode<Plan, G, float>(
        lynx::token_major<const float>(cache.prompt_keys(l).data(), shape),
        lynx::token_major<const float>(cache.prompt_values(l).data(), shape),
        static_cast<std::uint32_t>(l), options));
  return layers;
}

/// Attention policy: the prompt through Lynx at `level`, the tail in fp32.
template <lynx::stream_plan_type Plan, int G = 32>
class lynx_prompt_attention {
 public:
  explicit lynx_prompt_attention(const prompt_tensors<Plan, G>* prompt = nullptr)
      : prompt_(prompt) {}

  int level = 1;  // precision level the prompt is read at
  /// Codes of every layer, read instead of the planes at the full level (null: planes).
  const prompt_codes<Plan, G>* codes = nullptr;
  /// Or the layers a background merge has finished so far (the rest: planes).
  const lynx::background_merge<Plan, G>* merging = nullptr;
  /// Attention calls (one per layer and forward) at the full level, on codes and on planes.
  std::int64_t full_level_on_codes = 0, full_level_on_planes = 0;

  /// Layer `layer`'s codes, when there are any yet.
  [[nodiscard]] const lynx::code_tensor<Plan, G>* codes_of(int layer) const {
    if (codes != nullptr) return &(*codes)[static_cast<std::size_t>(layer)];
    if (merging != nullptr) return merging->layer(static_cast<std::size_t>(layer));
    return nullptr;
  }

  void operator()(const kv_cache& cache, int layer, std::span<const float> q, int tail_visible,
                  std::span<float> out) {
    if (prompt_ == nullptr)
      throw std::logic_error("lynx_prompt_attention: no prompt tensors attached");
    if (level == Plan::streams) {
      if (const auto* c = codes_of(layer)) {
        ++full_level_on_codes;
        attend(c->view(), cache, layer, q, tail_visible, out);
        return;
      }
      ++full_level_on_planes;
    }
    attend((*prompt_)[static_cast<std::size_t>(layer)].view_at(level), cache, layer, q,
           tail_visible, out);
  }

 private:
  template <class View>
  void attend(const View& view, const kv_cache& cache, int layer, std::span<const float> q,
              int tail_visible, std::span<float> out) {
    const lynx::kv_shape tail_shape{cache.tail_length(), cache.n_kv_heads(), cache.head_dim()};
    const auto tail_keys =
        lynx::token_major<const float>(cache.tail_keys(layer).data(), tail_shape);
    const auto tail_values =
        lynx::token_major<const float>(cache.tail_values(layer).data(), tail_shape);
    const lynx::attention_queries queries{
        q.data(), 1, static_cast<std::int64_t>(q.size()) / cache.head_dim(), cache.head_dim()};
    const lynx::tail_visibility visible{tail_visible - 1, 1};
    const auto problem = lynx::decode_attention<>::problem(view, tail_keys, queries, visible);
    // Grows only when the context outgrows it: amortized, not on every call.
    if (workspace_.size() < lynx::attention_workspace::bytes_needed(problem, 1))
      workspace_.reserve(problem, 1);
    attention_(view, tail_keys, tail_values, queries, visible,
               lynx::attention_output{out.data(), nullptr}, workspace_);
  }

  const prompt_tensors<Plan, G>* prompt_;
  lynx::decode_attention<> attention_{};
  lynx::attention_workspace workspace_{};
};

/// The decode node's engine, as lynx::progressive_session drives it.
template <lynx::stream_plan_type Plan, int G = 32>
class lynx_decode_engine {
 public:
  lynx_decode_engine(const weights& model, const prompt_tensors<Plan, G>& prompt, int prompt_tokens,
                     int max_batch = 16)
      : inner_(model, lynx_prompt_attention<Plan, G>(&prompt)) {
    if (static_cast<int>(prompt.size()) != model.cfg().n_layers)
      throw std::invalid_argument("lynx_decode_engine: " + std::to_string(prompt.size()) +
                                  " prompt tensors for a model of " +
                                  std::to_string(model.cfg().n_layers) + " layers");
    inner_.begin_decode(prompt_tokens);
    inner_.reserve(max_batch);
  }

  [[nodiscard]] std::int64_t vocab_size() const { return inner_.cfg().vocab_size; }
  [[nodiscard]] std::int64_t tail_size() const { return inner_.cache().tail_length(); }
  void drop_tail(std::int64_t n) { inner_.truncate_tail(static_cast<int>(n)); }
  void forward(std::span<const std::int32_t> tokens, std::int64_t first_position, int level,
               std::span<float> logits) {
    inner_.attention().level = level;
    inner_.reserve(static_cast<int>(tokens.size()));
    inner_.decode(tokens, static_cast<int>(first_position), logits);
  }
  /// Reads `codes` (every layer, from make_prompt_codes) instead of the planes at the
  /// full level from the next forward on; null: back to the planes.
  void use_codes(const prompt_codes<Plan, G>* codes) {
    if (codes != nullptr && codes->size() != static_cast<std::size_t>(inner_.cfg().n_layers))
      throw std::invalid_argument("lynx_decode_engine: codes of " + std::to_string(codes->size()) +
                                  " layers for a model of " +
                                  std::to_string(inner_.cfg().n_layers));
    inner_.attention().codes = codes;
    inner_.attention().merging = nullptr;
  }
  /// Reads each layer's codes as soon as `merge` (over this engine's prompt
  /// tensors) has made them; null: back to the planes. The merge must outlive
  /// its use here.
  void use_codes(const lynx::background_merge<Plan, G>* merge) {
    if (merge != nullptr && merge->size() != static_cast<std::size_t>(inner_.cfg().n_layers))
      throw std::invalid_argument("lynx_decode_engine: a merge of " +
                                  std::to_string(merge->size()) + " layers for a model of " +
                                  std::to_string(inner_.cfg().n_layers));
    inner_.attention().merging = merge;
    inner_.attention().codes = nullptr;
  }
  [[nodiscard]] engine<lynx_prompt_attention<Plan, G>>& inner() { return inner_; }

  /// One request's forward in a batched step: the forward its session asked
  /// for (lynx::progressive_session::prepare) and where its logits go.
  struct batch_job {
    lynx_decode_engine* engine = nullptr;
    lynx::forward_request request;
    std::span<float> logits;  // [request.tokens][vocab]
  };
  /// The forwards of many requests as one forward of the model
  /// (engine::decode_batch): each request's logits are the bits its own
  /// forward() gives, read at its own precision level.
  static void forward_batch(std::span<const batch_job> jobs) {
    using inner_type = engine<lynx_prompt_attention<Plan, G>>;
    std::vector<typename inner_type::batch_item> items;
    items.reserve(jobs.size());
    for (const batch_job& j : jobs) {
      j.engine->inner_.attention().level = j.request.level;
      items.push_back(
          {&j.engine->inner_, j.request.tokens, static_cast<int>(j.request.position), j.logits});
    }
    inner_type::decode_batch(items);
  }

 private:
  engine<lynx_prompt_attention<Plan, G>> inner_;
};

}  // namespace lynx_examples::llama2c
