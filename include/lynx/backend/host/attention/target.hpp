// Target macros of the host attention kernels: LYNX_ATTENTION_AVX512 (x86-64 with
// GCC or clang: the AVX-512 and AVX2 kernels are compiled, with function-level
// target attributes) and the attributes of the portable walks compiled without
// contraction (LYNX_ATTENTION_UNFUSED) or for AVX2 + FMA.
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__)
#include <immintrin.h>
#define LYNX_ATTENTION_AVX512 1
#define LYNX_ATTENTION_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
// A portable walk compiled for AVX2 + FMA (for CPUs with host_has_fma), as
// LYNX_ATTENTION_UNFUSED below: everything it calls inlined, no contraction.
#define LYNX_ATTENTION_FMA_CLONE __attribute__((target("avx2,fma"))) LYNX_ATTENTION_UNFUSED
#else
#define LYNX_ATTENTION_AVX512 0
#endif

// A portable walk with everything it calls inlined (flatten), compiled by GCC
// without contracting a * b + c: GCC fuses it into one FMA by default in C++
// (-ffp-contract=fast) on targets with FMA, which rounds once where the walk, and
// the AVX-512 kernels lane by lane, round twice. (clang contracts only within one
// expression by default, and the walks write none that it would fuse.)
#if defined(__CUDACC__) || !defined(__GNUC__)
#define LYNX_ATTENTION_UNFUSED
#elif defined(__clang__)
#define LYNX_ATTENTION_UNFUSED __attribute__((flatten))
#else
#define LYNX_ATTENTION_UNFUSED __attribute__((flatten, optimize("fp-contract=off")))
#endif
