// Consumer of the compiled lynx::kernels (find_package mode): encodes a layer,
// receives it and runs decode_attention over the anchor. With lynx::kernels the
// encode and attention bodies come from the library, so this file compiles in
// about as long as it takes to parse the headers (bench/consumer_compile_time.sh
// times it beside the header-only build). Exit 0 when the output is finite.
#include <cstdio>
#include <lynx/lynx.hpp>
#include <vector>

int main() {
  const lynx::kv_shape shape{100, 2, 64};
  std::vector<float> k(100 * 2 * 64), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = float(i % 17) * 0.25f - 2;
    v[i] = float(i % 13) * 0.5f - 3;
  }
  auto layer =
      lynx::encode<lynx::plan_8_4_4, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                                lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<lynx::plan_8_4_4, 32, lynx::host_space> t(shape, 0);
  for (int s = 0; s < lynx::plan_8_4_4::streams; ++s) t.accept(layer.segment(s));
  std::vector<float> q(4 * 64, 0.1f), out(4 * 64);
  const lynx::attention_queries queries{q.data(), 1, 4, 64};
  const lynx::kv_view<const float, lynx::host_space> none{};
  const lynx::tail_visibility vis{0, 0};
  lynx::decode_attention<> attn{};
  lynx::attention_workspace ws(attn.problem(t.view(), none, queries, vis), 1);
  attn(t.view(), none, none, queries, vis, lynx::attention_output{out.data(), nullptr}, ws,
       {.threads = 1});
  for (const float x : out)
    if (!(x == x) || x > 1e30f || x < -1e30f) return 1;
  std::printf("consumer_kernels: attention over the anchor, out[0] = %g\n", out[0]);
  return 0;
}
