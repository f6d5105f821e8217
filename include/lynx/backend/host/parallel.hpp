// A minimal fork-join for the host backend: splits [0, n) into `threads`
// contiguous chunks, run on new threads or on an engine's executor. The partition never changes
// what is computed, only who computes it, so results are identical for any thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "lynx/core/executor.hpp"

namespace lynx::detail {

/// Number of hardware threads, at least 1.
inline int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

/// Calls f(begin, end) on disjoint chunks covering [0, n); rethrows the first
/// exception. With an executor, its workers run the chunks instead of new threads.
template <class F>
void parallel_for(int threads, std::int64_t n, F&& f, task_executor* executor = nullptr) {
  if (threads <= 0) threads = hardware_threads();
  threads = static_cast<int>(std::min<std::int64_t>(threads, n));
  if (threads <= 1) {
    if (n > 0) f(std::int64_t{0}, n);
    return;
  }
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto run = [&](int i) {
    const std::int64_t begin = n * i / threads, end = n * (i + 1) / threads;
    try {
      f(begin, end);
    } catch (...) {
      std::lock_guard lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  if (executor != nullptr) {
    executor->run(
        threads, [](void* context, int i) { (*static_cast<decltype(run)*>(context))(i); }, &run);
    if (failure) std::rethrow_exception(failure);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) pool.emplace_back(run, i);
  run(0);
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace lynx::detail
