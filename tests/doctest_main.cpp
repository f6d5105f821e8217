// The one doctest main shared by every Lynx test executable (tests/CMakeLists.txt
// compiles it once for host tests and once, with LYNX_DOCTEST_CUDA_MAIN, for CUDA
// tests).
//
// CUDA flavour: before any test case runs, check for a usable CUDA device. With
// none, run only the test suite "host logic" (launch geometry, sizes, error
// decisions: everything that needs no device), then print "SKIPPED: no CUDA
// device" and exit 77, which CTest maps to "Skipped" (SKIP_RETURN_CODE 77); a
// failing host-logic case still fails the test. LYNX_REQUIRE_CUDA_DEVICE=1 in the environment
// makes a missing device a failure instead (for GPU CI, where a skip would hide a
// broken driver).
#if !defined(LYNX_DOCTEST_CUDA_MAIN)

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#else

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int skip_return_code = 77;  // must match SKIP_RETURN_CODE in tests/CMakeLists.txt

bool device_required() {
  const char* value = std::getenv("LYNX_REQUIRE_CUDA_DEVICE");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

}  // namespace

int main(int argc, char** argv) {
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count == 0) {
    const char* why = status != cudaSuccess ? cudaGetErrorString(status) : "0 devices";
    if (device_required()) {
      std::fprintf(stderr, "FAILED: no CUDA device (%s) and LYNX_REQUIRE_CUDA_DEVICE is set\n",
                   why);
      return 1;
    }
    doctest::Context host_only;
    host_only.applyCommandLine(argc, argv);
    host_only.addFilter("test-suite", "host logic");
    const int host_status = host_only.run();
    if (host_status != 0) return host_status;
    std::printf("SKIPPED: no CUDA device (%s); only the host-logic cases ran\n", why);
    return skip_return_code;
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}

#endif
