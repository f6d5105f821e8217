// A dense array on transparent huge pages, as a serving engine allocates its KV
// cache, shared by the benchmarks that read an engine's token-major cache.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace lynx_bench {

// A token-major cache read one kv head at a time touches a new 4 KiB page every
// 2 tokens (rows are kv_heads * head_dim * 2 bytes = 2 KiB apart), so on small
// pages such a walk pays for page walks on top of the bytes (bf16 decode
// attention at 32K tokens, single thread: about 7.4 ms on 4 KiB pages, 5.7 ms
// on huge pages).
template <class T>
class huge_page_array {
 public:
  void resize(std::size_t n) {
    constexpr std::size_t huge = std::size_t{2} << 20;
    const std::size_t bytes = (n * sizeof(T) + huge - 1) / huge * huge;
    data_.reset(static_cast<T*>(std::aligned_alloc(huge, bytes)));
    if (!data_) throw std::bad_alloc();
#if defined(__linux__)
    madvise(data_.get(), bytes,
            MADV_HUGEPAGE);  // a hint: where THP is off this stays on small pages
#endif
    size_ = n;
  }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] T* data() { return data_.get(); }
  [[nodiscard]] const T* data() const { return data_.get(); }
  T& operator[](std::size_t i) { return data_.get()[i]; }

 private:
  struct release {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, release> data_;
  std::size_t size_ = 0;
};

}  // namespace lynx_bench
