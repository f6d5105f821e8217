// The model families a disaggregated request runs on, behind one small
// adapter each: llama2.c checkpoints (and the built-in model) and Gemma-3 GGUF
// files. The request machinery (request.hpp, prefill_node.hpp, decode_node.hpp)
// takes the weights and finds the family from their type, so a caller writes
// run_request<Plan>(weights, ...) whatever the model.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <utility>

#include "gemma3/lynx_engine.hpp"
#include "gemma3/model.hpp"
#include "llama2c/llama2c.hpp"
#include "llama2c/lynx_engine.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/codec.hpp"

namespace lynx_examples::disagg {

/// One layer's prompt KV as the prefill node ships it: token-major fp32,
/// [shape.tokens, kv_heads, head_dim], keys after RoPE. On a Gemma-3 local
/// (sliding-window) layer only the last window - 1 prompt tokens, all a
/// decoded query can see. Float is const float for a const engine.
template <class Float>
struct shipped_kv {
  Float* keys = nullptr;
  Float* values = nullptr;
  lynx::kv_shape shape;
};

/// family<Weights>: the adapter of the model family whose weights type is Weights.
template <class Weights>
struct family;

template <>
struct family<llama2c::weights> {
  using weights = llama2c::weights;
  using prefill_engine = llama2c::engine<>;
  template <class Plan>
  using tensors = llama2c::prompt_tensors<Plan>;
  template <class Plan>
  using decode_engine = llama2c::lynx_decode_engine<Plan>;

  static int layers(const weights& w) { return w.cfg().n_layers; }
  static int vocab(const weights& w) { return w.cfg().vocab_size; }
  static int context(const weights& w) { return w.cfg().seq_len; }
  template <class Engine>  // prefill_engine, const or not
  static auto shipped(Engine& e, int layer) {
    auto& c = e.cache();
    using value = std::remove_pointer_t<decltype(c.prompt_keys(layer).data())>;
    return shipped_kv<value>{c.prompt_keys(layer).data(),
                             c.prompt_values(layer).data(),
                             {c.prompt_length(), c.n_kv_heads(), c.head_dim()}};
  }
  template <class Plan>
  static tensors<Plan> make_tensors(const weights& w, int prompt_tokens, std::uint64_t generation) {
    return llama2c::make_prompt_tensors<Plan>(w.cfg(), prompt_tokens, generation);
  }
};

template <>
struct family<gemma3::weights> {
  using weights = gemma3::weights;
  using prefill_engine = gemma3::engine<>;
  template <class Plan>
  using tensors = gemma3::prompt_tensors<Plan>;
  template <class Plan>
  using decode_engine = gemma3::lynx_decode_engine<Plan>;

  static int layers(const weights& w) { return w.cfg().n_layers; }
  static int vocab(const weights& w) { return w.cfg().vocab_size; }
  static int context(const weights& w) { return w.cfg().context; }
  // Window-aware, as gemma3::encode_prompt: a local layer ships its last window - 1 tokens.
  template <class Engine>  // prefill_engine, const or not
  static auto shipped(Engine& e, int layer) {
    auto& c = e.cache();
    using value = std::remove_pointer_t<decltype(c.prompt_keys(layer).data())>;
    const int P = c.prompt_length();
    const int n = gemma3::shipped_tokens(e.cfg(), layer, P);
    const std::ptrdiff_t first = static_cast<std::ptrdiff_t>(P - n) * c.token_stride();
    return shipped_kv<value>{c.prompt_keys(layer).data() + first,
                             c.prompt_values(layer).data() + first,
                             {n, c.n_kv_heads(), c.head_dim()}};
  }
  template <class Plan>
  static tensors<Plan> make_tensors(const weights& w, int prompt_tokens, std::uint64_t generation) {
    return gemma3::make_prompt_tensors<Plan>(w.cfg(), prompt_tokens, /*window_aware=*/true,
                                             generation);
  }
};

template <class Weights>
using prefill_engine_of = typename family<Weights>::prefill_engine;

/// The family of a prefill engine (from the weights it holds).
template <class Engine>
using family_of_engine = family<std::remove_cvref_t<decltype(std::declval<Engine&>().model())>>;

/// Layer `layer` of a prefilled engine's prompt KV, encoded (what the prefill node sends).
template <lynx::stream_plan_type Plan, class Engine>
lynx::encoded_layer<Plan> encode_layer(const Engine& e, int layer,
                                       const lynx::encode_options& options = {}) {
  const auto kv = family_of_engine<Engine>::shipped(e, layer);
  return lynx::encode<Plan, 32, float>(lynx::token_major<const float>(kv.keys, kv.shape),
                                       lynx::token_major<const float>(kv.values, kv.shape),
                                       static_cast<std::uint32_t>(layer), options);
}

/// True when `path` names a GGUF file: by its extension, else by its magic "GGUF".
inline bool is_gguf(const std::filesystem::path& path) {
  if (path.extension() == ".gguf") return true;
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, sizeof magic) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace lynx_examples::disagg
