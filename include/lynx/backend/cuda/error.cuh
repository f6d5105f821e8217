// CUDA errors at the boundary of Lynx's host API: CUDA-facing entry points
// return [[nodiscard]] cudaError_t (CUB style); host APIs turn a failure into
// lynx::error(errc::cuda_error) with the call and CUDA's own words.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "lynx/core/error.hpp"

namespace lynx::cuda {

/// Throws lynx::error(cuda_error) when `status` is not cudaSuccess; `what` names the call.
inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    lynx::detail::fail(errc::cuda_error, std::string(what) +
                                             " failed: " + cudaGetErrorName(status) + " (" +
                                             cudaGetErrorString(status) + ")");
}

}  // namespace lynx::cuda

/// Evaluates a CUDA runtime call and throws lynx::error(cuda_error) naming it on failure.
#define LYNX_CUDA_CHECK(call) ::lynx::cuda::check((call), #call)

/// Inside a function returning cudaError_t: returns the status of `call` when it failed.
#define LYNX_CUDA_TRY(call)                               \
  do {                                                    \
    const cudaError_t lynx_status_ = (call);              \
    if (lynx_status_ != cudaSuccess) return lynx_status_; \
  } while (0)
