// kernels.odr_march: two objects that call the same encode and attention
// configurations, one built for the x86-64 baseline and one with -march=native,
// linked into one program with lynx::kernels. Both must give the same bytes.
// (CMake's kernels.odr_march_symbols checks that neither object holds a body of
// those templates: the only one is the library's, built for the baseline and
// picking its kernels at run time, so no object can run instructions the CPU
// lacks whatever the linker keeps.)
#include <cstddef>
#include <cstdio>
#include <vector>

std::vector<std::byte> odr_march_baseline();
std::vector<std::byte> odr_march_native();

int main() {
  const std::vector<std::byte> a = odr_march_baseline(), b = odr_march_native();
  if (a.empty() || a != b) {
    std::fprintf(stderr, "kernels.odr_march: the two objects gave different bytes (%zu, %zu)\n",
                 a.size(), b.size());
    return 1;
  }
  std::printf("kernels.odr_march: %zu bytes (segments and attention outputs) equal\n", a.size());
  return 0;
}
