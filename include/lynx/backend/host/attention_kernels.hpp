// Host kernels of decode attention: how one split of a context is walked for
// one query and one kv head (all query heads of the group at once, so every
// K/V row is read once for the group). The math comes from
// backend/host/attention/tile_math.hpp; the files under backend/host/attention/
// only walk the data.
//
// Three paths, chosen at run time: a portable one (plain loops), an AVX-512 one
// (function-level target attributes, used when the CPU has AVX-512F/BW) and an
// AVX2 one (when it has AVX2 + FMA but not AVX-512; the portable loops where it
// has no kernel). All evaluate the same operations in the same order, lane by lane:
//  - bit-plane keys (and stored codes): lane = token; score = (0 + sum_c qs[c] * code[c] in
//    channel order) + bias;
//  - bit-plane values and dense values: lane = channel; acc = 0, acc += w[t] * v[t] in token
//    order (bit-plane values then add the offset);
//  - dense keys: 16 channel lanes summed in channel order, then a halving tree;
//  - l = fixed_order_sum(p); p = attention_exp2(s2 - m).
// so the paths give the same bits (the tests check it).
//
// This header includes them all: sources.hpp, scratch.hpp, decode_portable.hpp,
// portable.hpp, avx512_common.hpp, avx512_decode.hpp, avx512_planes.hpp,
// avx512_dense.hpp, avx2.hpp and walk.hpp (compute_split).
#pragma once

#include "lynx/backend/host/attention/walk.hpp"
