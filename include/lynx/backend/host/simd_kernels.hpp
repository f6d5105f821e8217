// AVX-512 host kernels of the codecs (AVX-512 F/BW/DQ/VL, AVX512-VBMI and GFNI),
// bit-identical to the portable kernels in codec_kernels.hpp, which stay the
// fallback and the reference. Every function here carries a target attribute
// (LYNX_CODEC_AVX512_TARGET), so the kernels are compiled whatever the includer's
// -march (LYNX_CODEC_AVX512 == 1 on x86-64 with GCC or clang) and run only where
// detail::host_has_avx512_codec() says the CPU has those extensions; callers
// also test `encode_supported` / `reconstruct_supported`.
//
// Data flow of one 32-token block of one head, per 16-channel chunk q:
//   encode:      16-bit input -> float -> code (sub, mul, clamp, cvtps2dq: the same
//                IEEE operations and round-half-even as quantize_value) -> code
//                bytes, 4 tokens x 16 channels per vector (packssdw/packuswb)
//                -> byte network -> one qword per (channel, 8 tokens)
//                -> gf2p8affineqb (8x8 bit transpose) -> one byte per plane
//                -> byte network -> 16 plane words per plane, stored in place.
//   reconstruct: the same steps backwards, then fma(scale, level, zero) per element.
// Codes wider than 8 bits travel as two byte matrices: hi = code >> (B-8)
// (planes 0-7) and lo = code << (16-B) (planes 8..B-1 at the top of a byte).
// Group minima/maxima use the same (a < b ? a : b) selections as the portable
// code; where a reduction order could change which zero (+0 or -0) is kept,
// the group is recomputed by the portable loop.
//
// This header includes them all, under backend/host/codec/: dispatch.hpp (the
// run-time choice), avx512_base.hpp, avx512_encode_steps.hpp,
// avx512_encode_bf16.hpp, avx512_encode.hpp and avx512_reconstruct.hpp.
#pragma once

#include "lynx/backend/host/codec/avx512_reconstruct.hpp"
#include "lynx/backend/host/codec/dispatch.hpp"
