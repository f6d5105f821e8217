// llama2.c checkpoints for Lynx tests and examples: the model configuration, the
// weights (loaded from a checkpoint file or generated deterministically from a
// seed), and a writer so a generated model can round-trip through the file format.
//
// File format (llama2.c checkpoints): 7 x int32 header, then float32
// tensors in checkpoint order, then seq_len * head_size floats of legacy RoPE
// tables (skipped), then the classifier [vocab, dim] only when the header's
// vocab_size is negative (classifier not shared with the embedding).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lynx_examples::llama2c {

// Model shape. All counts are positive; head_size = dim / n_heads.
struct config {
  int dim = 0;         // residual width
  int hidden_dim = 0;  // SwiGLU hidden width
  int n_layers = 0;
  int n_heads = 0;                // query heads
  int n_kv_heads = 0;             // key/value heads (GQA: n_heads % n_kv_heads == 0)
  int vocab_size = 0;             // always positive here; see shared_classifier
  int seq_len = 0;                // maximum number of positions
  bool shared_classifier = true;  // classifier == token embedding (header vocab > 0)

  [[nodiscard]] int head_size() const { return dim / n_heads; }
  [[nodiscard]] int kv_dim() const { return head_size() * n_kv_heads; }
  // Query heads per KV head: q head h reads kv head h / kv_group().
  [[nodiscard]] int kv_group() const { return n_heads / n_kv_heads; }

  friend bool operator==(const config&, const config&) = default;
};

namespace detail {

// Throws with the offending values if the shape cannot be a llama2.c model.
// The caps keep every size computed from a header inside int64 and int.
inline void validate_config(const config& c, const std::string& where) {
  auto fail = [&](const std::string& what) {
    throw std::runtime_error(
        "llama2c: " + where + ": invalid config: " + what + " (dim " + std::to_string(c.dim) +
        ", hidden " + std::to_string(c.hidden_dim) + ", layers " + std::to_string(c.n_layers) +
        ", heads " + std::to_string(c.n_heads) + ", kv heads " + std::to_string(c.n_kv_heads) +
        ", vocab " + std::to_string(c.vocab_size) + ", seq " + std::to_string(c.seq_len) + ")");
  };
  constexpr int cap = 1 << 20;
  if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.vocab_size <= 0 || c.seq_len <= 0)
    fail("every field must be positive");
  if (c.dim > cap || c.hidden_dim > cap || c.n_layers > 4096 || c.vocab_size > cap ||
      c.seq_len > cap)
    fail("a field is implausibly large");
  if (c.dim % c.n_heads != 0) fail("dim must be a multiple of n_heads");
  if (c.n_heads % c.n_kv_heads != 0) fail("n_heads must be a multiple of n_kv_heads");
  if (c.head_size() % 2 != 0) fail("head_size must be even (RoPE rotates pairs)");
}

// Bytes of an engine's fp32 KV cache over the whole context: K and V of every
// layer at every position.
inline std::int64_t kv_cache_bytes(const config& c) {
  return 2 * std::int64_t{c.n_layers} * c.seq_len * c.kv_dim() * 4;
}

// Number of floats of each tensor family, in checkpoint order.
struct tensor_sizes {
  std::int64_t embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, classifier;
};

inline tensor_sizes sizes_of(const config& c) {
  const std::int64_t d = c.dim, h = c.hidden_dim, l = c.n_layers, kv = c.kv_dim();
  return {std::int64_t{c.vocab_size} * d,
          l * d,
          l * d * d,
          l * kv * d,
          l * kv * d,
          l * d * d,
          l * d,
          l * h * d,
          l * d * h,
          l * h * d,
          d,
          c.shared_classifier ? 0 : std::int64_t{c.vocab_size} * d};
}

inline std::int64_t parameter_count(const config& c) {
  const tensor_sizes s = sizes_of(c);
  return s.embedding + s.rms_att + s.wq + s.wk + s.wv + s.wo + s.rms_ffn + s.w1 + s.w2 + s.w3 +
         s.rms_final + s.classifier;
}

// Bytes of a checkpoint file for this config: header, tensors, legacy RoPE
// tables [seq_len, head_size/2] x (cos, sin).
inline std::int64_t checkpoint_bytes(const config& c) {
  return 7 * 4 + 4 * (parameter_count(c) + std::int64_t{c.seq_len} * c.head_size());
}

}  // namespace detail

// The weights of one model, held in one float buffer in checkpoint order
// (classifier appended when it is not shared). Accessors return row-major
// matrices [out, in] as spans; `l` is a layer index.
class weights {
 public:
  // Takes the tensors in checkpoint order (without the RoPE tables); throws if
  // the config is invalid or the buffer has the wrong number of floats.
  weights(const config& c, std::vector<float> parameters)
      : config_(c), parameters_(std::move(parameters)) {
    detail::validate_config(config_, "weights");
    const std::int64_t want = detail::parameter_count(config_);
    if (static_cast<std::int64_t>(parameters_.size()) != want)
      throw std::runtime_error("llama2c: weights: expected " + std::to_string(want) +
                               " floats, got " + std::to_string(parameters_.size()));
    index_tensors();
  }

  // Loads a llama2.c checkpoint. Throws std::runtime_error naming the file and
  // what is wrong: missing, short header, invalid header, size mismatch
  // (truncated or trailing bytes), or non-finite weights.
  explicit weights(const std::filesystem::path& checkpoint) {
    const std::string name = checkpoint.string();
    std::ifstream in(checkpoint, std::ios::binary);
    if (!in) throw std::runtime_error("llama2c: cannot open checkpoint '" + name + "'");
    in.seekg(0, std::ios::end);
    const std::int64_t file_bytes = static_cast<std::int64_t>(in.tellg());
    in.seekg(0, std::ios::beg);
    if (file_bytes < 28)
      throw std::runtime_error("llama2c: checkpoint '" + name + "' is " +
                               std::to_string(file_bytes) +
                               " bytes, shorter than its 28-byte header");
    std::int32_t header[7];
    in.read(reinterpret_cast<char*>(header), sizeof header);
    // A negative vocab_size means "classifier stored separately"; INT32_MIN has
    // no positive counterpart and is rejected as vocab 0.
    const std::int64_t vocab = header[5];
    config_ = {header[0],
               header[1],
               header[2],
               header[3],
               header[4],
               vocab == std::numeric_limits<std::int32_t>::min()
                   ? 0
                   : static_cast<int>(vocab < 0 ? -vocab : vocab),
               header[6],
               vocab > 0};
    detail::validate_config(config_, "checkpoint '" + name + "'");
    const std::int64_t want = detail::checkpoint_bytes(config_);
    // The fields are bounded one by one; their product sizes the engine's KV
    // cache (K and V, every layer, every position), which must stay in
    // proportion to the weights: a 1 MB file must not ask for gigabytes.
    const std::int64_t cache_bytes = detail::kv_cache_bytes(config_);
    const std::int64_t cache_cap = std::max<std::int64_t>(std::int64_t{256} << 20, 4 * want);
    if (cache_bytes > cache_cap)
      throw std::runtime_error(
          "llama2c: checkpoint '" + name + "': its header (layers " +
          std::to_string(config_.n_layers) + ", seq " + std::to_string(config_.seq_len) +
          ", kv dim " + std::to_string(config_.kv_dim()) + ") implies a KV cache of " +
          std::to_string(cache_bytes) + " bytes, more than " + std::to_string(cache_cap) +
          " (4x the weights' " + std::to_string(want) + " bytes, or 256 MiB): not a real model");
    if (file_bytes != want)
      throw std::runtime_error(
          "llama2c: checkpoint '" + name + "' has " + std::to_string(file_bytes) +
          " bytes but its header (dim " + std::to_string(config_.dim) + ", layers " +
          std::to_string(config_.n_layers) + ", vocab " + std::to_string(config_.vocab_size) +
          ", seq " + std::to_string(config_.seq_len) + ") needs " + std::to_string(want) +
          (file_bytes < want ? ": the file is truncated" : ": unexpected trailing bytes"));
    const std::int64_t n = detail::parameter_count(config_);
    const detail::tensor_sizes s = detail::sizes_of(config_);
    parameters_.resize(static_cast<std::size_t>(n));
    // Everything up to rms_final, skip the RoPE tables, then the classifier.
    const std::int64_t before_rope = n - s.classifier;
    in.read(reinterpret_cast<char*>(parameters_.data()), before_rope * 4);
    in.seekg(std::int64_t{config_.seq_len} * config_.head_size() * 4, std::ios::cur);
    if (s.classifier > 0)
      in.read(reinterpret_cast<char*>(parameters_.data() + before_rope), s.classifier * 4);
    if (!in) throw std::runtime_error("llama2c: read error in checkpoint '" + name + "'");
    for (std::size_t i = 0; i < parameters_.size(); ++i)
      if (!std::isfinite(parameters_[i]))
        throw std::runtime_error("llama2c: checkpoint '" + name +
                                 "' has a non-finite weight at float " + std::to_string(i));
    index_tensors();
  }

  weights(const weights& other) : config_(other.config_), parameters_(other.parameters_) {
    index_tensors();
  }
  weights(weights&& other) noexcept
      : config_(other.config_),
        parameters_(std::move(other.parameters_)),
        offsets_(other.offsets_) {}
  weights& operator=(weights other) noexcept {
    config_ = other.config_;
    parameters_ = std::move(other.parameters_);
    offsets_ = other.offsets_;
    return *this;
  }

  [[nodiscard]] const config& cfg() const { return config_; }
  // All tensors in checkpoint order (classifier last when not shared).
  [[nodiscard]] std::span<const float> parameters() const { return parameters_; }

  [[nodiscard]] std::span<const float> token_embedding() const {  // [vocab, dim]
    return tensor(offsets_.embedding, std::int64_t{config_.vocab_size} * config_.dim);
  }
  [[nodiscard]] std::span<const float> rms_att(int l) const {  // [dim]
    return layer_tensor(offsets_.rms_att, l, config_.dim);
  }
  [[nodiscard]] std::span<const float> wq(int l) const {  // [dim, dim]
    return layer_tensor(offsets_.wq, l, std::int64_t{config_.dim} * config_.dim);
  }
  [[nodiscard]] std::span<const float> wk(int l) const {  // [kv_dim, dim]
    return layer_tensor(offsets_.wk, l, std::int64_t{config_.kv_dim()} * config_.dim);
  }
  [[nodiscard]] std::span<const float> wv(int l) const {  // [kv_dim, dim]
    return layer_tensor(offsets_.wv, l, std::int64_t{config_.kv_dim()} * config_.dim);
  }
  [[nodiscard]] std::span<const float> wo(int l) const {  // [dim, dim]
    return layer_tensor(offsets_.wo, l, std::int64_t{config_.dim} * config_.dim);
  }
  [[nodiscard]] std::span<const float> rms_ffn(int l) const {  // [dim]
    return layer_tensor(offsets_.rms_ffn, l, config_.dim);
  }
  [[nodiscard]] std::span<const float> w1(int l) const {  // [hidden, dim]
    return layer_tensor(offsets_.w1, l, std::int64_t{config_.hidden_dim} * config_.dim);
  }
  [[nodiscard]] std::span<const float> w2(int l) const {  // [dim, hidden]
    return layer_tensor(offsets_.w2, l, std::int64_t{config_.dim} * config_.hidden_dim);
  }
  [[nodiscard]] std::span<const float> w3(int l) const {  // [hidden, dim]
    return layer_tensor(offsets_.w3, l, std::int64_t{config_.hidden_dim} * config_.dim);
  }
  [[nodiscard]] std::span<const float> rms_final() const {  // [dim]
    return tensor(offsets_.rms_final, config_.dim);
  }
  [[nodiscard]] std::span<const float> classifier() const {  // [vocab, dim]
    return tensor(offsets_.classifier, std::int64_t{config_.vocab_size} * config_.dim);
  }

  // Writes a llama2.c checkpoint (version-0 layout, the one `weights` loads),
  // with real RoPE tables so llama2.c's own run.c can read it too.
  void save(const std::filesystem::path& path) const {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("llama2c: cannot write checkpoint '" + path.string() + "'");
    const std::int32_t header[7] = {
        config_.dim,        config_.hidden_dim,
        config_.n_layers,   config_.n_heads,
        config_.n_kv_heads, config_.shared_classifier ? config_.vocab_size : -config_.vocab_size,
        config_.seq_len};
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    const detail::tensor_sizes s = detail::sizes_of(config_);
    const std::int64_t before_rope = static_cast<std::int64_t>(parameters_.size()) - s.classifier;
    out.write(reinterpret_cast<const char*>(parameters_.data()), before_rope * 4);
    const int half = config_.head_size() / 2;
    std::vector<float> table(static_cast<std::size_t>(config_.seq_len) * half);
    for (int part = 0; part < 2; ++part) {  // freq_cis_real then freq_cis_imag
      for (int p = 0; p < config_.seq_len; ++p)
        for (int i = 0; i < half; ++i) {
          const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) /
                                                           static_cast<float>(config_.head_size()));
          const float angle = static_cast<float>(p) * freq;
          table[static_cast<std::size_t>(p) * half + i] =
              part == 0 ? std::cos(angle) : std::sin(angle);
        }
      out.write(reinterpret_cast<const char*>(table.data()),
                static_cast<std::streamsize>(table.size() * 4));
    }
    if (s.classifier > 0)
      out.write(reinterpret_cast<const char*>(parameters_.data() + before_rope), s.classifier * 4);
    if (!out) throw std::runtime_error("llama2c: write error on '" + path.string() + "'");
  }

 private:
  struct tensor_offsets {
    std::int64_t embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, classifier;
  };

  void index_tensors() {
    const detail::tensor_sizes s = detail::sizes_of(config_);
    std::int64_t at = 0;
    auto next = [&](std::int64_t size) {
      const std::int64_t here = at;
      at += size;
      return here;
    };
    offsets_.embedding = next(s.embedding);
    offsets_.rms_att = next(s.rms_att);
    offsets_.wq = next(s.wq);
    offsets_.wk = next(s.wk);
    offsets_.wv = next(s.wv);
    offsets_.wo = next(s.wo);
    offsets_.rms_ffn = next(s.rms_ffn);
    offsets_.w1 = next(s.w1);
    offsets_.w2 = next(s.w2);
    offsets_.w3 = next(s.w3);
    offsets_.rms_final = next(s.rms_final);
    offsets_.classifier = config_.shared_classifier ? offsets_.embedding : next(s.classifier);
  }

  [[nodiscard]] std::span<const float> tensor(std::int64_t offset, std::int64_t size) const {
    return {parameters_.data() + offset, static_cast<std::size_t>(size)};
  }
  [[nodiscard]] std::span<const float> layer_tensor(std::int64_t offset, int l,
                                                    std::int64_t size) const {
    if (l < 0 || l >= config_.n_layers)
      throw std::out_of_range("llama2c: layer " + std::to_string(l) + " out of range [0, " +
                              std::to_string(config_.n_layers) + ")");
    return tensor(offset + l * size, size);
  }

  config config_{};
  std::vector<float> parameters_;
  tensor_offsets offsets_{};
};

// Counter-based generator: the value at (seed, stream, index) depends on nothing
// else, so the built-in model is identical on every platform and build.
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) with 24 random bits: exact in float, no libm involved.
inline float uniform_pm1(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t bits =
      splitmix64(splitmix64(splitmix64(seed) ^ stream) + index) >> 40;  // 24 bits
  return static_cast<float>(static_cast<std::int64_t>(bits) - (1 << 23)) * (1.0f / (1 << 23));
}

// The built-in model's shape: head_size 32 (a Lynx group of 32 channels fits
// one head), GQA 2:1, an unshared classifier (a tied one makes random models
// repeat their input token).
inline config builtin_config() {
  config c;
  c.dim = 128;
  c.hidden_dim = 344;
  c.n_layers = 4;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 256;
  c.seq_len = 1024;
  c.shared_classifier = false;
  return c;
}

// A small deterministic model with random weights. The gains are chosen so the
// model is not degenerate: attention is peaked enough for context to matter,
// and logits spread wide enough that greedy decoding produces varied tokens
// while temperature-1 sampling does not stall on one token.
inline weights make_builtin_model(std::uint32_t seed) {
  const config c = builtin_config();
  const detail::tensor_sizes s = detail::sizes_of(c);
  std::vector<float> p(static_cast<std::size_t>(detail::parameter_count(c)));
  std::size_t at = 0;
  std::uint64_t stream = 0;
  // Fills `count` floats with gain * uniform(-1, 1) * sqrt(3 / fan_in) (unit
  // variance output for unit variance input when gain = 1), or 1 + gain * u for norms.
  auto fill = [&](std::int64_t count, int fan_in, float gain, bool norm) {
    const float scale = gain * std::sqrt(3.0f / static_cast<float>(fan_in));
    for (std::int64_t i = 0; i < count; ++i) {
      const float u = uniform_pm1(seed, stream, static_cast<std::uint64_t>(i));
      p[at++] = norm ? 1.0f + gain * u : scale * u;
    }
    ++stream;
  };
  fill(s.embedding, 1, 0.6f, false);
  fill(s.rms_att, 1, 0.2f, true);
  fill(s.wq, c.dim, 2.0f, false);
  fill(s.wk, c.dim, 2.0f, false);
  fill(s.wv, c.dim, 1.0f, false);
  fill(s.wo, c.dim, 0.5f, false);
  fill(s.rms_ffn, 1, 0.2f, true);
  fill(s.w1, c.dim, 1.0f, false);
  fill(s.w2, c.hidden_dim, 0.5f, false);
  fill(s.w3, c.dim, 1.0f, false);
  fill(s.rms_final, 1, 0.2f, true);
  fill(s.classifier, c.dim, 3.0f, false);
  return weights(c, std::move(p));
}

}  // namespace lynx_examples::llama2c
