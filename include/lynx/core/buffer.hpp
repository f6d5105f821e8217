// An owning, 64-byte aligned byte buffer on the host: segments and tensor
// storage live in these so SIMD loads and RDMA registration see aligned memory.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <span>

namespace lynx {

class aligned_buffer {
 public:
  static constexpr std::size_t alignment = 64;

  aligned_buffer() = default;
  explicit aligned_buffer(std::size_t bytes) : data_(allocate(bytes)), size_(bytes) {}
  aligned_buffer(const aligned_buffer& other) : aligned_buffer(other.size_) {
    if (size_) std::memcpy(data_.get(), other.data_.get(), size_);
  }
  aligned_buffer& operator=(const aligned_buffer& other) {
    if (this != &other) *this = aligned_buffer(other);
    return *this;
  }
  aligned_buffer(aligned_buffer&&) noexcept = default;
  aligned_buffer& operator=(aligned_buffer&&) noexcept = default;

  [[nodiscard]] std::byte* data() noexcept { return data_.get(); }
  [[nodiscard]] const std::byte* data() const noexcept { return data_.get(); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> span() noexcept { return {data_.get(), size_}; }
  [[nodiscard]] std::span<const std::byte> span() const noexcept { return {data_.get(), size_}; }
  void zero() noexcept {
    if (size_) std::memset(data_.get(), 0, size_);
  }

 private:
  struct deleter {
    void operator()(std::byte* p) const noexcept {
      ::operator delete[](p, std::align_val_t{alignment});
    }
  };
  static std::byte* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    return static_cast<std::byte*>(::operator new[](bytes, std::align_val_t{alignment}));
  }
  std::unique_ptr<std::byte[], deleter> data_;
  std::size_t size_ = 0;
};

}  // namespace lynx
