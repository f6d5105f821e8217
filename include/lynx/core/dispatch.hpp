// Turning a runtime value into a compile-time one: the single generic helper,
//   dispatch<8, 12, 16>(bits, [&]<int B>() { ... });
// Throws lynx::error(invalid_argument) when the value is not one of the list.
#pragma once

#include <string>

#include "lynx/core/error.hpp"

namespace lynx {

template <int... Values, class F>
decltype(auto) dispatch(int value, F&& f) {
  using result = decltype(f.template operator()<(Values, ...)>());
  if constexpr (std::is_void_v<result>) {
    bool found = false;
    ((value == Values ? (f.template operator()<Values>(), found = true) : false) || ...);
    if (!found)
      detail::fail(errc::invalid_argument,
                   "value " + std::to_string(value) + " is not among the compiled choices");
  } else {
    result out{};
    bool found = false;
    ((value == Values ? (out = f.template operator()<Values>(), found = true) : false) || ...);
    if (!found)
      detail::fail(errc::invalid_argument,
                   "value " + std::to_string(value) + " is not among the compiled choices");
    return out;
  }
}

}  // namespace lynx
