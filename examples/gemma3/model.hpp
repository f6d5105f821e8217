// Gemma-3 (text) models read from a GGUF file: the configuration, taken from
// the file's metadata with the reference defaults for the keys this family's
// files leave out, and the weights, left quantized in the file's mapping (a
// forward pass dequantizes one row at a time; dequantization is exact, so the
// values are those of the fp32 dequantized model).
//
// Defaults for keys absent from gemma3 GGUF files (the Gemma 3 architecture as published):
// sliding-window pattern period 6 with the last layer of each six global;
// local RoPE base 10,000; no logit soft-caps; the whole head is rotated.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gguf/dequant.hpp"
#include "gguf/reader.hpp"

namespace lynx_examples::gemma3 {

struct config {
  int dim = 0;         // residual width (embedding_length)
  int hidden_dim = 0;  // feed_forward_length
  int n_layers = 0;    // block_count
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads
  int head_dim = 0;    // key_length (== value_length)
  int vocab_size = 0;  // rows of the token embedding
  int context = 0;     // context_length
  int window = 0;  // sliding window of local layers (a key is visible when q_pos - k_pos < window)
  int window_period = 6;             // layer l is global when (l + 1) % window_period == 0
  double rope_base_global = 1e6;     // rope.freq_base
  double rope_base_local = 10000.0;  // rope.freq_base_swa when present
  float rms_eps = 1e-6f;

  [[nodiscard]] int q_dim() const { return n_heads * head_dim; }
  [[nodiscard]] int kv_dim() const { return n_kv_heads * head_dim; }
  [[nodiscard]] int kv_group() const { return n_heads / n_kv_heads; }
  /// Sliding-window layers attend the last `window` positions; global ones all.
  [[nodiscard]] bool is_local(int layer) const {
    return window > 0 && window_period > 0 && (layer + 1) % window_period != 0;
  }
  [[nodiscard]] double rope_base(int layer) const {
    return is_local(layer) ? rope_base_local : rope_base_global;
  }
};

/// A weight matrix [rows, cols] in its GGUF storage: row r is `row_bytes`
/// bytes at data + r * row_bytes, `cols` elements of `type`.
struct matrix {
  gguf::tensor_type type{};
  const std::byte* data = nullptr;
  std::size_t row_bytes = 0;
  int rows = 0, cols = 0;
  std::string name;

  void dequantize_row(int r, float* out) const {
    gguf::dequantize_row(type, data + static_cast<std::size_t>(r) * row_bytes, out, cols);
  }
};

struct layer_weights {
  std::vector<float> attn_norm, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm;
  matrix wq, wk, wv, wo;  // [q_dim, dim], [kv_dim, dim], [kv_dim, dim], [dim, q_dim]
  matrix gate, up, down;  // [hidden, dim], [hidden, dim], [dim, hidden]
};

/// The model: owns the mapped file; weights point into it.
class weights {
 public:
  explicit weights(const std::filesystem::path& path) : file_(std::make_unique<gguf::file>(path)) {
    const gguf::file& f = *file_;
    const std::string arch(f.get_string("general.architecture"));
    if (arch != "gemma3")
      throw std::runtime_error("gemma3: " + path.string() + " holds a '" + arch +
                               "' model, not gemma3");
    auto key = [&](const char* k) { return "gemma3." + std::string(k); };
    auto get_int = [&](const char* k, std::uint64_t max) {
      const std::uint64_t v = f.get_uint(key(k));
      if (v == 0 || v > max)
        throw std::runtime_error("gemma3: metadata " + key(k) + " = " + std::to_string(v) +
                                 " outside [1, " + std::to_string(max) + "]");
      return static_cast<int>(v);
    };
    cfg_.dim = get_int("embedding_length", 1 << 16);
    cfg_.hidden_dim = get_int("feed_forward_length", 1 << 18);
    cfg_.n_layers = get_int("block_count", 1024);
    cfg_.n_heads = get_int("attention.head_count", 1024);
    cfg_.n_kv_heads = get_int("attention.head_count_kv", 1024);
    cfg_.head_dim = get_int("attention.key_length", 4096);
    const int value_length = get_int("attention.value_length", 4096);
    cfg_.context = get_int("context_length", 1 << 24);
    if (f.has(key("attention.sliding_window")))
      cfg_.window = get_int("attention.sliding_window", 1 << 24);
    if (auto p = f.find_uint(key("attention.sliding_window_pattern"))) {
      if (*p == 0 || *p > 1024)
        throw std::runtime_error("gemma3: sliding_window_pattern " + std::to_string(*p));
      cfg_.window_period = static_cast<int>(*p);
    }
    if (auto b = f.find_float(key("rope.freq_base"))) cfg_.rope_base_global = *b;
    if (auto b = f.find_float(key("rope.freq_base_swa"))) cfg_.rope_base_local = *b;
    if (auto e = f.find_float(key("attention.layer_norm_rms_epsilon")))
      cfg_.rms_eps = static_cast<float>(*e);
    if (f.has(key("final_logit_softcapping")) || f.has(key("attn_logit_softcapping")))
      throw std::runtime_error("gemma3: logit soft-capping is not supported by this engine");
    if (value_length != cfg_.head_dim)
      throw std::runtime_error("gemma3: key_length " + std::to_string(cfg_.head_dim) +
                               " != value_length " + std::to_string(value_length));
    if (cfg_.n_heads % cfg_.n_kv_heads != 0)
      throw std::runtime_error("gemma3: " + std::to_string(cfg_.n_heads) + " query heads over " +
                               std::to_string(cfg_.n_kv_heads) + " kv heads");
    if (cfg_.head_dim % 2 != 0)
      throw std::runtime_error("gemma3: odd head_dim " + std::to_string(cfg_.head_dim));

    embedding_ = load_matrix("token_embd.weight", -1, cfg_.dim);
    cfg_.vocab_size = embedding_.rows;
    if (f.find_tensor("output.weight") != nullptr)
      throw std::runtime_error("gemma3: a separate output.weight is not supported (tied expected)");
    output_norm_ = load_vector("output_norm.weight", cfg_.dim);
    layers_.resize(static_cast<std::size_t>(cfg_.n_layers));
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      layer_weights& w = layers_[static_cast<std::size_t>(l)];
      w.attn_norm = load_vector(p + "attn_norm.weight", cfg_.dim);
      w.q_norm = load_vector(p + "attn_q_norm.weight", cfg_.head_dim);
      w.k_norm = load_vector(p + "attn_k_norm.weight", cfg_.head_dim);
      w.post_attn_norm = load_vector(p + "post_attention_norm.weight", cfg_.dim);
      w.ffn_norm = load_vector(p + "ffn_norm.weight", cfg_.dim);
      w.post_ffn_norm = load_vector(p + "post_ffw_norm.weight", cfg_.dim);
      w.wq = load_matrix(p + "attn_q.weight", cfg_.q_dim(), cfg_.dim);
      w.wk = load_matrix(p + "attn_k.weight", cfg_.kv_dim(), cfg_.dim);
      w.wv = load_matrix(p + "attn_v.weight", cfg_.kv_dim(), cfg_.dim);
      w.wo = load_matrix(p + "attn_output.weight", cfg_.dim, cfg_.q_dim());
      w.gate = load_matrix(p + "ffn_gate.weight", cfg_.hidden_dim, cfg_.dim);
      w.up = load_matrix(p + "ffn_up.weight", cfg_.hidden_dim, cfg_.dim);
      w.down = load_matrix(p + "ffn_down.weight", cfg_.dim, cfg_.hidden_dim);
    }
  }

  [[nodiscard]] const config& cfg() const { return cfg_; }
  [[nodiscard]] const gguf::file& file() const { return *file_; }
  [[nodiscard]] const matrix& embedding() const {
    return embedding_;
  }  // [vocab, dim], also the classifier
  [[nodiscard]] std::span<const float> output_norm() const { return output_norm_; }
  [[nodiscard]] const layer_weights& layer(int l) const {
    return layers_.at(static_cast<std::size_t>(l));
  }

 private:
  std::vector<float> load_vector(const std::string& name, int n) const {
    const gguf::tensor_info& t = file_->tensor(name);
    if (t.elements() != n)
      throw std::runtime_error("gemma3: tensor " + name + " has " + std::to_string(t.elements()) +
                               " elements, expected " + std::to_string(n));
    return gguf::dequantize(*file_, t);
  }

  // rows < 0: any number of rows.
  matrix load_matrix(const std::string& name, int rows, int cols) const {
    const gguf::tensor_info& t = file_->tensor(name);
    if (t.dims.size() != 2 || t.dims[0] != cols || (rows >= 0 && t.dims[1] != rows) ||
        t.dims[1] <= 0 || t.dims[1] > (std::int64_t{1} << 24))
      throw std::runtime_error("gemma3: tensor " + name + " has the wrong shape for [" +
                               (rows >= 0 ? std::to_string(rows) : std::string("*")) + ", " +
                               std::to_string(cols) + "]");
    matrix m;
    m.type = t.type;
    m.rows = static_cast<int>(t.dims[1]);
    m.cols = cols;
    m.row_bytes = gguf::row_bytes(t.type, cols);
    const std::span<const std::byte> bytes = file_->data(t);
    if (bytes.size() != m.row_bytes * static_cast<std::size_t>(m.rows))
      throw std::runtime_error("gemma3: tensor " + name + " holds " + std::to_string(bytes.size()) +
                               " bytes, expected " +
                               std::to_string(m.row_bytes * static_cast<std::size_t>(m.rows)));
    m.data = bytes.data();
    m.name = name;
    return m;
  }

  std::unique_ptr<gguf::file> file_;  // heap: the mapping stays put when weights move
  config cfg_;
  matrix embedding_;
  std::vector<float> output_norm_;
  std::vector<layer_weights> layers_;
};

}  // namespace lynx_examples::gemma3
