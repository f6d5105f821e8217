// Generation helpers on top of the engine: greedy continuation (the reference
// Lynx's exactness contract is checked against) and prompts sampled from the
// model itself (realistic inputs without a text corpus).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "forward.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace lynx_examples::llama2c {

// Prefills `prompt`, then decodes `count` tokens greedily one at a time; returns
// the generated tokens (the first is the argmax of the prompt's last logits).
template <class Attention>
std::vector<int> generate_greedy(engine<Attention>& e, std::span<const int> prompt, int count) {
  std::vector<int> out;
  if (count <= 0) return out;
  out.reserve(static_cast<std::size_t>(count));
  std::vector<float> logits = e.prefill(prompt);
  out.push_back(argmax(logits));
  while (static_cast<int>(out.size()) < count) {
    const int token = out.back();
    e.decode(std::span<const int>(&token, 1), e.position(), logits);
    out.push_back(argmax(logits));
  }
  return out;
}

// Temperature-1 sample from logits [vocab] with u uniform in [0, 1): softmax,
// then the first token whose cumulative probability exceeds u (llama2.c's
// sample_mult; falls back to the last token on rounding).
inline int sample_from_logits(std::span<const float> logits, float u) {
  float max_logit = logits[0];
  for (const float l : logits) max_logit = l > max_logit ? l : max_logit;
  std::vector<float> p(logits.size());
  float sum = 0.0f;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp(logits[i] - max_logit);
    sum += p[i];
  }
  const float target = u * sum;
  float cdf = 0.0f;
  for (std::size_t i = 0; i < p.size(); ++i) {
    cdf += p[i];
    if (target < cdf) return static_cast<int>(i);
  }
  return static_cast<int>(p.size()) - 1;
}

// A prompt of `length` tokens sampled from the model at temperature 1, starting
// with BOS: prompt[0] = BOS, prompt[i + 1] ~ softmax(logits after prompt[0..i]).
// Deterministic in (model, seed, length). Uses the exact fp32 engine.
inline std::vector<int> sample_prompt(const weights& model, std::uint64_t seed, int length) {
  if (length <= 0 || length > model.cfg().seq_len)
    throw std::out_of_range("llama2c: sample_prompt length " + std::to_string(length) +
                            " outside [1, " + std::to_string(model.cfg().seq_len) + "]");
  engine<exact_attention> e(model);
  std::vector<int> prompt{tokenizer::bos};
  std::vector<float> logits(static_cast<std::size_t>(model.cfg().vocab_size));
  for (std::uint64_t i = 0; static_cast<int>(prompt.size()) < length; ++i) {
    const int token = prompt.back();
    e.decode(std::span<const int>(&token, 1), e.position(), logits);
    // 24 random bits -> u in [0, 1), exact in float.
    const float u = static_cast<float>(splitmix64(splitmix64(seed) + i) >> 40) * (1.0f / (1 << 24));
    prompt.push_back(sample_from_logits(logits, u));
  }
  return prompt;
}

}  // namespace lynx_examples::llama2c
