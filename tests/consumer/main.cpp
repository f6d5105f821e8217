// Consumer smoke test: the umbrella header compiles in a user's project and a
// core type works. Exit 0 on success.
#include <lynx/lynx.hpp>

int main() {
  lynx::bf16 x(1.0f);
  return static_cast<float>(x) == 1.0f ? 0 : 1;
}
