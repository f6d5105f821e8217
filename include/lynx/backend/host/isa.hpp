// CPU probes of the host kernels that are chosen at run time (attention, codecs).
// The kernels carry function-level target attributes, so a build for the x86-64
// baseline still contains them; these probes say whether this CPU may run them.
#pragma once

// Whether this compiler can build kernels for extensions the build does not
// target, and probe the CPU for them: GCC or clang on x86-64. Not under nvcc,
// whose front end does not carry target attributes through to the host compiler.
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__)
#define LYNX_HOST_CPU_DISPATCH 1
#else
#define LYNX_HOST_CPU_DISPATCH 0
#endif

namespace lynx::detail {

// __builtin_cpu_supports reports an AVX or AVX-512 extension only when the
// operating system also saves its registers (XCR0), so the probes need no
// check of their own for that.

/// True when this CPU runs AVX-512 F, BW, DQ and VL code.
inline bool host_has_avx512() {
#if LYNX_HOST_CPU_DISPATCH
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
#else
  return false;
#endif
}

/// True when this CPU has AVX2 and FMA.
inline bool host_has_fma() {
#if LYNX_HOST_CPU_DISPATCH
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

/// True when this CPU also has GFNI and AVX512-VBMI (byte permutes and 8x8 bit
/// transposes: the bit-plane decoders and encoders).
inline bool host_has_gfni() {
#if LYNX_HOST_CPU_DISPATCH
  static const bool yes =
      host_has_avx512() && __builtin_cpu_supports("gfni") && __builtin_cpu_supports("avx512vbmi");
  return yes;
#else
  return false;
#endif
}

/// True when this CPU runs the codecs' AVX-512 kernels (simd_kernels.hpp):
/// AVX-512 F/BW/DQ/VL, AVX512-VBMI and GFNI.
inline bool host_has_avx512_codec() { return host_has_gfni(); }

/// True when this CPU also has AVX512-BF16 (float to bf16 conversion in one instruction).
inline bool host_has_avx512_bf16() {
#if LYNX_HOST_CPU_DISPATCH
  static const bool yes = host_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

}  // namespace lynx::detail
