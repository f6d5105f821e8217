// Which host codec kernels run: LYNX_CODEC_AVX512 (the AVX-512 kernels are
// compiled), the test hook that limits them (codec_kernels_limit) and the run-time
// choice (use_avx512_codec, use_avx512_bf16_codec).
#pragma once

#include <atomic>

#include "lynx/backend/host/isa.hpp"

#if LYNX_HOST_CPU_DISPATCH
#define LYNX_CODEC_AVX512 1
#else
#define LYNX_CODEC_AVX512 0
#endif

namespace lynx::detail {

/// Which kernels the host codecs (encode_into, reconstruct) may use: all that this
/// CPU runs (the default), or fewer. Tests lower it to compare every path, bit for
/// bit, in one binary; it is read once per call of a codec.
enum class codec_kernels { best, avx512_without_bf16, portable };
inline std::atomic<codec_kernels> codec_kernels_limit{codec_kernels::best};

/// True when the codecs take the AVX-512 kernels below.
inline bool use_avx512_codec() {
  return LYNX_CODEC_AVX512 && host_has_avx512_codec() &&
         codec_kernels_limit.load(std::memory_order_relaxed) != codec_kernels::portable;
}

/// True when they also convert float to bf16 with AVX512-BF16.
inline bool use_avx512_bf16_codec() {
  return use_avx512_codec() && host_has_avx512_bf16() &&
         codec_kernels_limit.load(std::memory_order_relaxed) == codec_kernels::best;
}

}  // namespace lynx::detail
