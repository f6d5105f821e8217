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

// ---------------------------------------------------------------------------
// The plan-independent AVX-512 attention kernels (backend/host/attention/
// avx512_planes.hpp): their template parameters are head counts, chunk counts,
// prefetch steps and hints, not the plan or the group size, so every plan's walk
// calls the same instances. lynx::kernels compiles them once (src/kernels, with
// LYNX_KERNELS_SIMD); with LYNX_KERNELS they are declared `extern` in every other
// file, the library's plan files included. Together they were half of a plan
// file's object code. The lists are the parameter values the walks dispatch to
// (a missing one is an undefined symbol at link time, never a silent fallback).
// ---------------------------------------------------------------------------

/// score_block_fused_gfni<HC, Two, Lines, Hint>: HC 1..8; (Two, Lines) (true, 3),
/// (false, 1), (false, 2); Hint 2, 3.
#define LYNX_KERNELS_FUSED_ONE(EXT, HC, TWO, LINES, HINT)                         \
  EXT template void ::lynx::detail::score_block_fused_gfni<HC, TWO, LINES, HINT>( \
      const std::uint32_t* const*, int, int, const float*, const float*, float*,  \
      ::lynx::detail::prefetch_walk&);
#define LYNX_KERNELS_FUSED_HC(EXT, HC)         \
  LYNX_KERNELS_FUSED_ONE(EXT, HC, true, 3, 2)  \
  LYNX_KERNELS_FUSED_ONE(EXT, HC, true, 3, 3)  \
  LYNX_KERNELS_FUSED_ONE(EXT, HC, false, 1, 2) \
  LYNX_KERNELS_FUSED_ONE(EXT, HC, false, 1, 3) \
  LYNX_KERNELS_FUSED_ONE(EXT, HC, false, 2, 2) \
  LYNX_KERNELS_FUSED_ONE(EXT, HC, false, 2, 3)
#define LYNX_KERNELS_FUSED(EXT) \
  LYNX_KERNELS_FUSED_HC(EXT, 1) \
  LYNX_KERNELS_FUSED_HC(EXT, 2) \
  LYNX_KERNELS_FUSED_HC(EXT, 3) \
  LYNX_KERNELS_FUSED_HC(EXT, 4) \
  LYNX_KERNELS_FUSED_HC(EXT, 5) \
  LYNX_KERNELS_FUSED_HC(EXT, 6) \
  LYNX_KERNELS_FUSED_HC(EXT, 7) \
  LYNX_KERNELS_FUSED_HC(EXT, 8)

/// add_values_pairs_gfni<HC, NC, Two, One, Lines, Hint>: (HC, NC) (1, 4) (1, 1) (2, 4)
/// (2, 1) (4, 2) (4, 1); (Two, One, Lines) (true, *, 3), (false, *, 1), (false, *, 2);
/// Hint 2, 3.
#define LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, TWO, ONE, LINES, HINT)                                 \
  EXT template void ::lynx::detail::add_values_pairs_gfni<HC, NC, TWO, ONE, LINES, HINT>(          \
      const std::uint32_t* const*, const std::int64_t*, std::int64_t, int, int, int, std::int64_t, \
      const float*, std::int64_t, std::int64_t, std::int64_t, float*,                              \
      ::lynx::detail::prefetch_walk&);
#define LYNX_KERNELS_PAIRS_HINT(EXT, HC, NC, HINT)           \
  LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, true, true, 3, HINT)   \
  LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, true, false, 3, HINT)  \
  LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, false, true, 1, HINT)  \
  LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, false, false, 1, HINT) \
  LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, false, true, 2, HINT)  \
  LYNX_KERNELS_PAIRS_ONE(EXT, HC, NC, false, false, 2, HINT)
#define LYNX_KERNELS_PAIRS_HC(EXT, HC, NC) \
  LYNX_KERNELS_PAIRS_HINT(EXT, HC, NC, 2)  \
  LYNX_KERNELS_PAIRS_HINT(EXT, HC, NC, 3)  \
  LYNX_KERNELS_PAIRS_HINT(EXT, HC, 1, 2)   \
  LYNX_KERNELS_PAIRS_HINT(EXT, HC, 1, 3)
#define LYNX_KERNELS_PAIRS(EXT)    \
  LYNX_KERNELS_PAIRS_HC(EXT, 1, 4) \
  LYNX_KERNELS_PAIRS_HC(EXT, 2, 4) \
  LYNX_KERNELS_PAIRS_HC(EXT, 4, 2)

/// score_code_block_avx512<HC, Lines, Hint, Code> of stored codes: HC 1..8, Lines 1, 2,
/// 4, Hint 2, 3, Code uint8 / uint16; and of a decoded tile (score_block_avx512):
/// HC 1..4, Lines 0, Hint 3, Code float.
#define LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, LINES, HINT, CODE)                    \
  EXT template void ::lynx::detail::score_code_block_avx512<HC, LINES, HINT, CODE>( \
      const CODE*, int, const float*, const float*, float*, ::lynx::detail::prefetch_walk&);
#define LYNX_KERNELS_SCORE_CODES_HC(EXT, HC, CODE)  \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, 1, 2, CODE) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, 1, 3, CODE) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, 2, 2, CODE) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, 2, 3, CODE) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, 4, 2, CODE) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, HC, 4, 3, CODE)
#define LYNX_KERNELS_SCORE_CODES_TYPE(EXT, CODE) \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 1, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 2, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 3, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 4, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 5, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 6, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 7, CODE)      \
  LYNX_KERNELS_SCORE_CODES_HC(EXT, 8, CODE)
#define LYNX_KERNELS_SCORE_CODES(EXT)               \
  LYNX_KERNELS_SCORE_CODES_TYPE(EXT, std::uint8_t)  \
  LYNX_KERNELS_SCORE_CODES_TYPE(EXT, std::uint16_t) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, 1, 0, 3, float) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, 2, 0, 3, float) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, 3, 0, 3, float) \
  LYNX_KERNELS_SCORE_CODES_ONE(EXT, 4, 0, 3, float)

/// add_value_codes_avx512<HC, NC, Lines, Hint, Code>: HC 1, 2, 4; NC 1, 2; Lines 1, 2,
/// 4; Hint 2, 3; Code uint8 / uint16.
#define LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, LINES, HINT, CODE)                   \
  EXT template void ::lynx::detail::add_value_codes_avx512<HC, NC, LINES, HINT, CODE>( \
      const CODE*, int, std::int64_t, const float* const(*)[NC], float*,               \
      ::lynx::detail::prefetch_walk&);
#define LYNX_KERNELS_VALUE_CODES_NC(EXT, HC, NC, CODE)  \
  LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, 1, 2, CODE) \
  LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, 1, 3, CODE) \
  LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, 2, 2, CODE) \
  LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, 2, 3, CODE) \
  LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, 4, 2, CODE) \
  LYNX_KERNELS_VALUE_CODES_ONE(EXT, HC, NC, 4, 3, CODE)
#define LYNX_KERNELS_VALUE_CODES_TYPE(EXT, CODE) \
  LYNX_KERNELS_VALUE_CODES_NC(EXT, 1, 1, CODE)   \
  LYNX_KERNELS_VALUE_CODES_NC(EXT, 1, 2, CODE)   \
  LYNX_KERNELS_VALUE_CODES_NC(EXT, 2, 1, CODE)   \
  LYNX_KERNELS_VALUE_CODES_NC(EXT, 2, 2, CODE)   \
  LYNX_KERNELS_VALUE_CODES_NC(EXT, 4, 1, CODE)   \
  LYNX_KERNELS_VALUE_CODES_NC(EXT, 4, 2, CODE)
#define LYNX_KERNELS_VALUE_CODES(EXT)              \
  LYNX_KERNELS_VALUE_CODES_TYPE(EXT, std::uint8_t) \
  LYNX_KERNELS_VALUE_CODES_TYPE(EXT, std::uint16_t)

/// Every plan-independent AVX-512 attention kernel (x86-64 only).
#define LYNX_KERNELS_SIMD(EXT)  \
  LYNX_KERNELS_FUSED(EXT)       \
  LYNX_KERNELS_PAIRS(EXT)       \
  LYNX_KERNELS_SCORE_CODES(EXT) \
  LYNX_KERNELS_VALUE_CODES(EXT)

// ---------------------------------------------------------------------------
// The walks of one split (backend/host/attention/walk.hpp) of decode_attention
// <default_variant>: a bit-plane prompt's source holds its plan and group sizes
// as run-time values, so one walk serves every plan and group size (a code view's,
// one per code type: 8 or 16 bits); the dense
// sources are the tails (float, bf16, fp16) and the 16-bit prompts. lynx::kernels
// compiles them once (LYNX_KERNELS_WALKS_FILE); with LYNX_KERNELS every other file
// declares them `extern`, so a configuration outside the library's list compiles
// only its thin entry point.
// ---------------------------------------------------------------------------
#define LYNX_KERNELS_WALK(EXT, SOURCE)                                                          \
  EXT template void ::lynx::detail::compute_split<SOURCE, ::lynx::default_variant>(             \
      const SOURCE&, std::int64_t, const float*, int, std::int64_t, std::int64_t, std::int64_t, \
      const ::lynx::default_variant&, ::lynx::detail::host_walk,                                \
      const ::lynx::detail::split_scratch&, float*, float*, float*,                             \
      const ::lynx::detail::next_split&);
#define LYNX_KERNELS_WALKS(EXT)                                                                   \
  LYNX_KERNELS_WALK(EXT, ::lynx::detail::plane_kv_source)                                         \
  LYNX_KERNELS_WALK(EXT, ::lynx::detail::dense_kv_source<float>)                                  \
  LYNX_KERNELS_WALK(EXT, ::lynx::detail::dense_kv_source<::lynx::bf16>)                           \
  LYNX_KERNELS_WALK(EXT, ::lynx::detail::dense_kv_source<::lynx::fp16>)                           \
  LYNX_KERNELS_WALK(EXT, ::lynx::detail::code_kv_source<::lynx::detail::code_data<std::uint8_t>>) \
  LYNX_KERNELS_WALK(EXT, ::lynx::detail::code_kv_source<::lynx::detail::code_data<std::uint16_t>>)
/// compute_split_heads (a dense bf16 prompt, kv heads together; x86-64 only).
#define LYNX_KERNELS_WALK_HEADS(EXT)                                                              \
  EXT template void ::lynx::detail::compute_split_heads<::lynx::default_variant>(                 \
      const ::lynx::detail::dense_kv_source<::lynx::bf16>&, std::int64_t, int, const float*, int, \
      std::int64_t, std::int64_t, std::int64_t, const ::lynx::default_variant&,                   \
      const ::lynx::detail::split_scratch&, float*, std::int64_t);

// ---------------------------------------------------------------------------
// The codec's work (planes/codec.hpp) is per code width and element type, not per
// plan or group size: detail::encode_layer and detail::reconstruct_layer for B =
// 8, 12, 16 bits and float / bf16 / fp16, compiled once (LYNX_KERNELS_CODEC_FILE);
// encode_into and reconstruct of any plan are thin entry points over them.
// ---------------------------------------------------------------------------
#define LYNX_KERNELS_CODEC_LAYER(EXT, B, T)                                                       \
  EXT template void ::lynx::detail::encode_layer<B, T>(                                           \
      ::lynx::kv_view<const T, ::lynx::host_space>, ::lynx::kv_view<const T, ::lynx::host_space>, \
      std::uint32_t, std::span<const std::span<std::byte>>, const ::lynx::encode_options&,        \
      const ::lynx::layer_geometry&);                                                             \
  EXT template void ::lynx::detail::reconstruct_layer<B, T>(                                      \
      const ::lynx::detail::plane_data&, std::uint32_t, int, int,                                 \
      ::lynx::kv_view<T, ::lynx::host_space>, ::lynx::kv_view<T, ::lynx::host_space>,             \
      const ::lynx::reconstruct_options&);
#define LYNX_KERNELS_CODEC_BITS(EXT, B)          \
  LYNX_KERNELS_CODEC_LAYER(EXT, B, float)        \
  LYNX_KERNELS_CODEC_LAYER(EXT, B, ::lynx::bf16) \
  LYNX_KERNELS_CODEC_LAYER(EXT, B, ::lynx::fp16)
#define LYNX_KERNELS_CODEC_LAYERS(EXT) \
  LYNX_KERNELS_CODEC_BITS(EXT, 8)      \
  LYNX_KERNELS_CODEC_BITS(EXT, 12)     \
  LYNX_KERNELS_CODEC_BITS(EXT, 16)
