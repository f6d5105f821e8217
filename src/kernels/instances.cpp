// One translation unit of lynx::kernels: the explicit instantiations of one
// (plan, group size) pair, or of the dense prompts. CMake compiles this file once
// per pair (LYNX_KERNELS_PLAN, LYNX_KERNELS_G), once with LYNX_KERNELS_DENSE and
// once with LYNX_KERNELS_SIMD_FILE (the plan-independent AVX-512 attention
// kernels every pair calls), once with LYNX_KERNELS_WALKS_FILE (the walks of a
// split, one for every plan and group size) and once with LYNX_KERNELS_CODEC_FILE
// (the codec's work per code width), so they all build in parallel.
#include "lynx/kernels/instances.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"

#if defined(LYNX_KERNELS_DENSE)
LYNX_KERNELS_ATTENTION_DENSE()
#elif defined(LYNX_KERNELS_CODEC_FILE)
LYNX_KERNELS_CODEC_LAYERS()
#elif defined(LYNX_KERNELS_WALKS_FILE)
LYNX_KERNELS_WALKS()
#if LYNX_ATTENTION_AVX512
LYNX_KERNELS_WALK_HEADS()
#endif
#elif defined(LYNX_KERNELS_SIMD_FILE)
#if LYNX_ATTENTION_AVX512
LYNX_KERNELS_SIMD()
#endif
#else
LYNX_KERNELS_ATTENTION_PLANES(, LYNX_KERNELS_PLAN, LYNX_KERNELS_G)
LYNX_KERNELS_CODEC(, LYNX_KERNELS_PLAN, LYNX_KERNELS_G)
#endif
