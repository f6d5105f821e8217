// One translation unit of lynx::kernels: the explicit instantiations of one
// (plan, group size) pair, or of the dense prompts. CMake compiles this file once
// per pair (LYNX_KERNELS_PLAN, LYNX_KERNELS_G) and once with LYNX_KERNELS_DENSE,
// so the pairs build in parallel.
#include "lynx/kernels/instances.hpp"
#include "lynx/attention/decode_attention.hpp"
#include "lynx/planes/codec.hpp"

#if defined(LYNX_KERNELS_DENSE)
LYNX_KERNELS_ATTENTION_DENSE()
#else
LYNX_KERNELS_ATTENTION_PLANES(, LYNX_KERNELS_PLAN, LYNX_KERNELS_G)
LYNX_KERNELS_CODEC(, LYNX_KERNELS_PLAN, LYNX_KERNELS_G)
#endif
