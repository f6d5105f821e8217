// An owning, 64-byte aligned byte buffer on the host: segments and tensor
// storage live in these so SIMD loads and RDMA registration see aligned memory.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace lynx {

class aligned_buffer {
 public:
  static constexpr std::size_t alignment = 64;
  static constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

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
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  // Buffers of 2 MiB or more are 2 MiB aligned and advised onto transparent huge
  // pages: the codecs and the decode walk stream several sections of a segment
  // at once, and on 4 KiB pages each needs a new page translation every few blocks.
  static std::byte* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    const std::size_t align = bytes >= huge_page_bytes ? huge_page_bytes : alignment;
    void* p = std::aligned_alloc(align, (bytes + align - 1) / align * align);
    if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__)
    if (align == huge_page_bytes) ::madvise(p, bytes, MADV_HUGEPAGE);  // a hint only
#endif
    return static_cast<std::byte*>(p);
  }
  std::unique_ptr<std::byte[], deleter> data_;
  std::size_t size_ = 0;
};

}  // namespace lynx
