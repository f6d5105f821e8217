// Turning a runtime value into a compile-time one: the single generic helper,
//   dispatch<8, 12, 16>(bits, [&]<int B>() { ... });
// Throws lynx::error(invalid_argument) when the value is not one of the list.
#pragma once

#include <string>
#include <type_traits>

#include "lynx/core/error.hpp"

namespace lynx {

namespace detail {
template <int First, int...>
inline constexpr int first_of = First;
}  // namespace detail

template <int... Values, class F>
decltype(auto) dispatch(int value, F&& f) {
  using result = decltype(f.template operator()<detail::first_of<Values...>>());
  if constexpr (std::is_void_v<result>) {
    bool found = false;
    (void)((value == Values ? (f.template operator()<Values>(), found = true) : false) || ...);
    if (!found)
      detail::fail(errc::invalid_argument,
                   "value " + std::to_string(value) + " is not among the compiled choices");
  } else {
    result out{};
    bool found = false;
    (void)((value == Values ? (out = f.template operator()<Values>(), found = true) : false) ||
           ...);
    if (!found)
      detail::fail(errc::invalid_argument,
                   "value " + std::to_string(value) + " is not among the compiled choices");
    return out;
  }
}

}  // namespace lynx
