// Lynx configuration: the one place where host/device qualifiers are decided.
// Everything outside backend/cuda/ compiles with a plain C++20 host compiler;
// under nvcc the same functions become __host__ __device__.
#pragma once

#if defined(__CUDACC__)
#define LYNX_HOST_DEVICE __host__ __device__ __forceinline__
#define LYNX_DEVICE __device__ __forceinline__
#define LYNX_CUDA_COMPILER 1
#else
#define LYNX_HOST_DEVICE inline
#define LYNX_DEVICE inline
#define LYNX_CUDA_COMPILER 0
#endif

#if defined(__CUDA_ARCH__)
#define LYNX_DEVICE_CODE 1
#else
#define LYNX_DEVICE_CODE 0
#endif

// LYNX_UNROLL(n): unroll the next loop n times, where the compiler takes a hint
// (host loops that must unroll fully for the loop around them to vectorize).
#define LYNX_PRAGMA(text) _Pragma(#text)
#if defined(__CUDACC__) || !(defined(__GNUC__) || defined(__clang__))
#define LYNX_UNROLL(n)
#elif defined(__clang__)
#define LYNX_UNROLL(n) LYNX_PRAGMA(unroll n)
#else
#define LYNX_UNROLL(n) LYNX_PRAGMA(GCC unroll n)
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LYNX_RESTRICT __restrict__
#define LYNX_ALWAYS_INLINE inline __attribute__((always_inline))
#define LYNX_NOINLINE __attribute__((noinline))
#else
#define LYNX_RESTRICT
#define LYNX_ALWAYS_INLINE inline
#define LYNX_NOINLINE
#endif

// -ffast-math (also implied by -Ofast) lets the compiler reassociate sums, fuse
// a * b + c across statements and assume that no value is NaN or infinite: the
// output bits of attention would then depend on the build (the golden attention
// test fails on every case), and the checks that reject non-finite K/V and
// queries could be compiled away. Lynx promises neither, so such a build stops
// here. Define LYNX_ALLOW_FAST_MATH to build anyway, without those promises.
#if defined(__FAST_MATH__) && !defined(LYNX_ALLOW_FAST_MATH)
static_assert(sizeof(int) == 0,  // always false, with a message that says why
              "Lynx: built with -ffast-math (or -Ofast), which breaks Lynx's bitwise exactness "
              "and its non-finite input checks; build the files that include Lynx without it, or "
              "define LYNX_ALLOW_FAST_MATH to accept that");
#endif

#define LYNX_VERSION_MAJOR 0
#define LYNX_VERSION_MINOR 1
#define LYNX_VERSION_PATCH 0
