// Memory spaces as types: a host view cannot be handed to a device kernel and
// vice versa, because the space is a template parameter of every view/tensor.
#pragma once

#include <concepts>

namespace lynx {

struct host_space {
  static constexpr const char* name = "host";
};
struct device_space {
  static constexpr const char* name = "device";
};

template <class S>
concept memory_space = std::same_as<S, host_space> || std::same_as<S, device_space>;

}  // namespace lynx
