// The host attention paths the attention tests compare bit for bit on this CPU.
#pragma once

#include <string>
#include <vector>

#include "lynx/attention/decode_attention.hpp"

namespace lynx::test {

/// portable (compiled for AVX2 + FMA where the CPU has them); the portable loops as
/// built, when `portable` runs the AVX2 + FMA clone (not under AddressSanitizer: their
/// libm fma calls there outlast the test timeout; the release and -march=native builds
/// compare them); avx2 and avx512 where the CPU has them.
inline std::vector<attention_path> host_attention_paths() {
  std::vector<attention_path> p{attention_path::portable};
#if !defined(__SANITIZE_ADDRESS__)
  if (detail::host_has_fma()) p.push_back(attention_path::portable_baseline);
#endif
  if (detail::host_has_fma()) p.push_back(attention_path::avx2);
  if (detail::host_has_avx512()) p.push_back(attention_path::avx512);
  return p;
}

inline std::string attention_path_name(attention_path p) {
  switch (p) {
    case attention_path::automatic:
      return "automatic";
    case attention_path::portable:
      return "portable";
    case attention_path::avx512:
      return "avx512";
    case attention_path::portable_baseline:
      return "portable_baseline";
    case attention_path::avx2:
      return "avx2";
  }
  return "?";
}

}  // namespace lynx::test
