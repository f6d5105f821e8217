// Consumer of lynx::ucx (find_package mode, when the package was built with UCX):
// the adapter's header compiles to its API only when the target says UCX is
// there (LYNX_WITH_UCX), and the UCX libraries the target names link and load.
#include <cstdio>
#include <lynx/transport/ucx.hpp>

#if !defined(LYNX_WITH_UCX)
#error "lynx::ucx did not define LYNX_WITH_UCX"
#endif

int main() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  const lynx::ucx_options options{};
  std::printf("consumer_ucx: UCX %u.%u.%u, anchor-first posts %s\n", major, minor, release,
              options.anchor_first_posts ? "on" : "off");
  return major >= 1 ? 0 : 1;
}
