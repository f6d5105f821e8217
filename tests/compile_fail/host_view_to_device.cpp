// Must NOT compile: a host view cannot be passed where a device view is expected.
#include "lynx/core/view.hpp"

void takes_device_view(lynx::kv_view<const float, lynx::device_space>) {}

int main() {
  float x[8] = {};
  const auto host = lynx::token_major<const float>(x, {1, 1, 8});
  takes_device_view(host);
}
