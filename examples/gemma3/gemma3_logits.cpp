// Logits of every position of a token sequence (a causal prefill) through the
// Gemma-3 engine, for checking the forward pass against an independent
// reference (tests/examples/gemma3_reference_check.py).
//
//   gemma3_logits [--model FILE.gguf] --tokens 2,818,5279,... --out FILE [--threads N]
//
// Writes [n_tokens, vocab] little-endian float32 to FILE and prints the argmax
// of each position.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "gemma3/forward.hpp"
#include "gemma3/model.hpp"
#include "gemma3/model_path.hpp"

namespace g3 = lynx_examples::gemma3;

namespace {

std::vector<std::int32_t> parse_tokens(std::string_view s) {
  std::vector<std::int32_t> out;
  std::size_t i = 0;
  while (i < s.size()) {
    const std::size_t j = std::min(s.find(',', i), s.size());
    const std::string item(s.substr(i, j - i));
    std::size_t used = 0;
    const long v = std::stol(item, &used);
    if (used != item.size() || v < 0 || v > INT32_MAX)
      throw std::invalid_argument("--tokens: '" + item + "' is not a token id");
    out.push_back(static_cast<std::int32_t>(v));
    i = j + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string model, tokens_arg, out_path;
  int threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--model")
      model = value();
    else if (a == "--tokens")
      tokens_arg = value();
    else if (a == "--out")
      out_path = value();
    else if (a == "--threads")
      threads = std::stoi(value());
    else
      throw std::invalid_argument("unknown argument '" + std::string(a) + "'");
  }
  if (tokens_arg.empty() || out_path.empty())
    throw std::invalid_argument(
        "usage: gemma3_logits [--model FILE.gguf] --tokens 2,818,... --out FILE [--threads N]");
  if (model.empty()) model = g3::default_model_path().string();
  const auto t0 = std::chrono::steady_clock::now();
  const g3::weights w(model);
  const std::vector<std::int32_t> tokens = parse_tokens(tokens_arg);
  g3::engine<> e(w, threads);
  const std::size_t vocab = static_cast<std::size_t>(w.cfg().vocab_size);
  std::vector<float> logits(tokens.size() * vocab);
  e.prefill(tokens, logits, /*all_positions=*/true);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ofstream f(out_path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(logits.data()),
          static_cast<std::streamsize>(logits.size() * sizeof(float)));
  if (!f) throw std::runtime_error("cannot write " + out_path);
  std::printf("%zu positions, %.2f s; argmax:", tokens.size(), secs);
  for (std::size_t p = 0; p < tokens.size(); ++p)
    std::printf(" %d", lynx_examples::llama2c::argmax(
                           std::span<const float>(logits.data() + p * vocab, vocab)));
  std::printf("\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gemma3_logits: %s\n", e.what());
  return 1;
}
