// What both objects of kernels.odr_march compute: one Llama-shaped layer
// encoded with 8 = 4 + 4, received, and attended at the anchor and at full
// precision; the segment bytes and the output bits, concatenated. Internal
// linkage on purpose: each object keeps its own copy of this driver, compiled
// with its own -march, while the encode and attention they call are the single
// bodies of lynx::kernels.
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

#include "lynx/lynx.hpp"

namespace {

std::vector<std::byte> odr_march_run() {
  using plan = lynx::plan_8_4_4;
  const lynx::kv_shape shape{300, 2, 128};
  std::vector<float> k(static_cast<std::size_t>(shape.tokens * shape.kv_heads * shape.head_dim));
  std::vector<float> v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 300.0f;
    v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 250.0f;
  }
  const auto layer =
      lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                    lynx::token_major<const float>(v.data(), shape), 0);
  std::vector<std::byte> bytes;
  lynx::bitplane_tensor<plan, 32, lynx::host_space> tensor(shape, 0);
  for (int s = 0; s < plan::streams; ++s) {
    const auto seg = layer.segment(s);
    bytes.insert(bytes.end(), seg.begin(), seg.end());
  }
  const int q_heads = 8;
  std::vector<float> q(static_cast<std::size_t>(q_heads * shape.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 29) / 29.0f - 0.5f;
  const lynx::attention_queries queries{q.data(), 1, q_heads, shape.head_dim};
  const lynx::kv_view<const float, lynx::host_space> no_tail{};
  const lynx::tail_visibility visible{0, 0};
  lynx::decode_attention<> attention{};
  std::vector<float> out(q.size());
  for (int s = 0; s < plan::streams; ++s) {
    tensor.accept(layer.segment(s));
    lynx::attention_workspace ws(attention.problem(tensor.view(), no_tail, queries, visible), 1);
    attention(tensor.view(), no_tail, no_tail, queries, visible,
              lynx::attention_output{out.data(), nullptr}, ws, {.threads = 1});
    const auto* p = reinterpret_cast<const std::byte*>(out.data());
    bytes.insert(bytes.end(), p, p + out.size() * sizeof(float));
  }
  return bytes;
}

}  // namespace
