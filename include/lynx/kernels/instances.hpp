// The configurations lynx::kernels compiles once, as explicit instantiations.
//
// The heavy host templates (decode_attention's walks over a bit-plane prompt,
// encode_into, reconstruct) cost tens of seconds of optimisation per
// configuration in every file that calls them. Linking lynx::kernels defines
// LYNX_KERNELS and puts its generated lynx/kernels/config.hpp on the include
// path; decode_attention.hpp and codec.hpp then declare the shipped
// configurations `extern template`, so a caller's file only parses the headers
// and the linker takes the library's one body. Any other configuration (another
// plan, group size or variant) is instantiated in the caller's file as before:
// header-only use never stops working.
//
// The library is built for the compiler's default target with the kernels
// picked at run time (AVX-512 / AVX2 / portable), so objects built with
// different -march flags all call the same code.
//
// Each macro takes EXT: `extern` to declare, empty to define (src/kernels).
#pragma once

/// decode_attention<default_variant> (one call, and batch) over bitplane_view<PLAN, G>
/// (float, bf16 and fp16 tails) and code_view<PLAN, G> prompts (float and bf16 tails).
#define LYNX_KERNELS_ATTENTION_CALL(EXT, TAIL, ...)                                                \
  EXT template void ::lynx::decode_attention<::lynx::default_variant>::operator()<__VA_ARGS__,     \
                                                                                  TAIL>(           \
      const __VA_ARGS__&, ::lynx::kv_view<const TAIL, ::lynx::host_space>,                         \
      ::lynx::kv_view<const TAIL, ::lynx::host_space>, const ::lynx::attention_queries&,           \
      ::lynx::tail_visibility, ::lynx::attention_output, ::lynx::attention_workspace&,             \
      const ::lynx::attention_options&) const;                                                     \
  EXT template void ::lynx::decode_attention<::lynx::default_variant>::batch<__VA_ARGS__, TAIL>(   \
      std::span<const ::lynx::attention_request<__VA_ARGS__, TAIL>>, ::lynx::attention_workspace&, \
      const ::lynx::attention_options&) const;

#define LYNX_KERNELS_ATTENTION_PLANES(EXT, PLAN, G)                                       \
  LYNX_KERNELS_ATTENTION_CALL(EXT, float,                                                 \
                              ::lynx::bitplane_view<::lynx::PLAN, G, ::lynx::host_space>) \
  LYNX_KERNELS_ATTENTION_CALL(EXT, ::lynx::bf16,                                          \
                              ::lynx::bitplane_view<::lynx::PLAN, G, ::lynx::host_space>) \
  LYNX_KERNELS_ATTENTION_CALL(EXT, ::lynx::fp16,                                          \
                              ::lynx::bitplane_view<::lynx::PLAN, G, ::lynx::host_space>) \
  LYNX_KERNELS_ATTENTION_CALL(EXT, float, ::lynx::code_view<::lynx::PLAN, G>)             \
  LYNX_KERNELS_ATTENTION_CALL(EXT, ::lynx::bf16, ::lynx::code_view<::lynx::PLAN, G>)

/// decode_attention<default_variant> over no prompt and dense float / bf16 prompts
/// (the 16-bit baselines), float and bf16 tails; over no prompt, an fp16 tail.
#define LYNX_KERNELS_ATTENTION_DENSE_TAIL(EXT, TAIL)                  \
  LYNX_KERNELS_ATTENTION_CALL(EXT, TAIL, ::lynx::no_prompt)           \
  LYNX_KERNELS_ATTENTION_CALL(EXT, TAIL, ::lynx::dense_prompt<float>) \
  LYNX_KERNELS_ATTENTION_CALL(EXT, TAIL, ::lynx::dense_prompt<::lynx::bf16>)
#define LYNX_KERNELS_ATTENTION_DENSE(EXT)              \
  LYNX_KERNELS_ATTENTION_DENSE_TAIL(EXT, float)        \
  LYNX_KERNELS_ATTENTION_DENSE_TAIL(EXT, ::lynx::bf16) \
  LYNX_KERNELS_ATTENTION_CALL(EXT, ::lynx::fp16, ::lynx::no_prompt)

/// encode_into and reconstruct (of a view) for one element type.
#define LYNX_KERNELS_CODEC_TYPE(EXT, PLAN, G, T)                                                  \
  EXT template void ::lynx::encode_into<::lynx::PLAN, G, T>(                                      \
      ::lynx::kv_view<const T, ::lynx::host_space>, ::lynx::kv_view<const T, ::lynx::host_space>, \
      std::uint32_t, std::span<const std::span<std::byte>>, const ::lynx::encode_options&);       \
  EXT template void ::lynx::reconstruct<::lynx::PLAN, G, T>(                                      \
      const ::lynx::bitplane_view<::lynx::PLAN, G, ::lynx::host_space>&,                          \
      ::lynx::kv_view<T, ::lynx::host_space>, ::lynx::kv_view<T, ::lynx::host_space>,             \
      const ::lynx::reconstruct_options&);

#define LYNX_KERNELS_CODEC(EXT, PLAN, G)              \
  LYNX_KERNELS_CODEC_TYPE(EXT, PLAN, G, float)        \
  LYNX_KERNELS_CODEC_TYPE(EXT, PLAN, G, ::lynx::bf16) \
  LYNX_KERNELS_CODEC_TYPE(EXT, PLAN, G, ::lynx::fp16)

#define LYNX_KERNELS_DECLARE_ATTENTION(PLAN, G) LYNX_KERNELS_ATTENTION_PLANES(extern, PLAN, G)
#define LYNX_KERNELS_DECLARE_CODEC(PLAN, G) LYNX_KERNELS_CODEC(extern, PLAN, G)
