// Device-side storage of Lynx: an owning device byte buffer, and the receiver
// tensor bitplane_tensor<Plan, G, device_space> of one layer. The tensor accepts
// segments (header + payload) in any order and more than once; each is validated
// on the host with the same rules as the host tensor (validate_segment, then
// generation and duplicate checks) before its payload is copied to the device,
// so nothing unvalidated ever becomes visible to a kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lynx/backend/cuda/error.cuh"
#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"

namespace lynx::cuda {

/// A non-owning range of bytes in device memory (the device twin of std::span<std::byte>).
struct device_bytes {
  std::byte* data = nullptr;
  std::size_t size = 0;
};

/// Owning device allocation (cudaMalloc / cudaFree), move-only.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // an allocation failure is not sticky: clear it from
                                 // cudaGetLastError
      lynx::detail::fail(errc::out_of_memory,
                         "cudaMalloc of " + std::to_string(bytes) + " bytes failed");
    }
    check(status, "cudaMalloc");
    data_ = static_cast<std::byte*>(p);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~device_buffer() { release(); }

  [[nodiscard]] std::byte* data() noexcept { return data_; }
  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] device_bytes bytes() noexcept { return {data_, size_}; }

 private:
  void release() noexcept {
    if (data_ != nullptr)
      (void)cudaFree(data_);  // a destructor cannot report; cudaFree only fails on a dead context
    data_ = nullptr;
    size_ = 0;
  }
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace lynx::cuda

namespace lynx {

/// Device receiver tensor of one layer: payloads in device memory, one
/// allocation per stream, filled by stream-ordered copies on `stream()`.
/// A view is valid for kernels launched on that stream (or after synchronizing it).
template <stream_plan_type Plan, int G>
class bitplane_tensor<Plan, G, device_space> : public stream_ledger<Plan, G> {
  using ledger = stream_ledger<Plan, G>;

 public:
  using plan = Plan;
  using space = device_space;
  using view_type = bitplane_view<Plan, G, device_space>;
  static constexpr int group_size = G;

  bitplane_tensor(kv_shape shape, std::uint32_t layer, std::uint64_t generation = 0,
                  cudaStream_t stream = nullptr)
      : ledger(shape, layer, generation), stream_(stream) {
    for (int s = 0; s < Plan::streams; ++s)
      storage_[static_cast<std::size_t>(s)] =
          cuda::device_buffer(static_cast<std::size_t>(this->geometry().payload_bytes(s)));
  }

  /// Validates a segment held in host memory (header + payload) and copies its
  /// payload to the device on stream(). Same rules and errors as the host
  /// tensor; on any error the tensor is unchanged. The copy is stream-ordered:
  /// from pageable memory it has left `segment` when this returns; from pinned
  /// memory the caller keeps `segment` alive and unchanged until stream() passes it.
  accept_result accept(std::span<const std::byte> segment) {
    const auto a = this->admit(segment);
    if (a.duplicate) return accept_result::duplicate;
    cuda::check(cudaMemcpyAsync(storage_[a.stream].data(), segment.data() + segment_header_bytes,
                                storage_[a.stream].size(), cudaMemcpyHostToDevice, stream_),
                "cudaMemcpyAsync (segment payload to device)");
    this->record(a);
    return accept_result::accepted;
  }

  /// Accepts a segment that sits in device memory (e.g. written there by an
  /// RDMA NIC). The checksum is computed on the host: the segment is copied to
  /// a host staging buffer, validated there, and the validated bytes are what
  /// is copied to the tensor, so a segment changing under us cannot slip through.
  /// Synchronizes stream(); not a hot path.
  accept_result accept_device(cuda::device_bytes segment) {
    std::vector<std::byte> staging(segment.size);
    if (segment.size != 0) {
      cuda::check(cudaMemcpyAsync(staging.data(), segment.data, segment.size,
                                  cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync (device segment to host for validation)");
      cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    }
    const accept_result r = accept(std::span<const std::byte>(staging.data(), staging.size()));
    // the staging buffer is pageable, so the copy in accept() has left it already; synchronizing
    // anyway keeps this function's contract simple: when it returns, the payload is on the device.
    cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return r;
  }

  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  /// View at the current precision level (or a lower one); payload pointers are device pointers.
  [[nodiscard]] view_type view() const { return view_at(this->precision_level()); }
  [[nodiscard]] view_type view_at(int level) const {
    return this->template make_view<device_space>(level, [&](int s) -> const std::byte* {
      return storage_[static_cast<std::size_t>(s)].data();
    });
  }

 private:
  cudaStream_t stream_;
  std::array<cuda::device_buffer, max_streams> storage_{};
};

template <stream_plan_type Plan, int G = 32>
using device_bitplane_tensor = bitplane_tensor<Plan, G, device_space>;

}  // namespace lynx
