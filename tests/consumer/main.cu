// CUDA consumer smoke test: the umbrella header compiles under nvcc, lynx::cuda
// carries what a .cu needs, and core types work in device code. No kernel is
// launched, so this runs (and must exit 0) without a GPU.
#include <lynx/lynx.hpp>

__global__ void bf16_to_float(const lynx::bf16* in, float* out) { *out = static_cast<float>(*in); }

int main() {
  lynx::bf16 x(1.0f);
  return static_cast<float>(x) == 1.0f ? 0 : 1;
}
