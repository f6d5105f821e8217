// The software prefetches' cache level (lynx::detail::prefetch_into_l2): chosen
// by the L1 data cache size unless LYNX_PREFETCH=l1 or l2 says otherwise. CTest
// runs this test three more times (tests/CMakeLists.txt): with LYNX_PREFETCH=l1,
// with l2, and with a value it must refuse (reported on stderr, then ignored).
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include "lynx/backend/host/prefetch.hpp"

TEST_CASE("LYNX_PREFETCH chooses the prefetch level; otherwise the L1 size does") {
  const char* e = std::getenv("LYNX_PREFETCH");
  const std::string v = e != nullptr ? e : "";
  const bool l2 = lynx::detail::prefetch_into_l2();
  CHECK(lynx::detail::prefetch_into_l2() == l2);  // read once: the same answer every call
  if (v == "l1" || v == "L1") {
    CHECK_FALSE(l2);
  } else if (v == "l2" || v == "L2") {
    CHECK(l2);
  } else {
    CHECK(l2 == lynx::detail::small_l1_data_cache());  // unset, empty or refused: the L1 size
    MESSAGE("LYNX_PREFETCH='" << v << "': " << (l2 ? "l2" : "l1") << " (L1 size)");
  }
}
