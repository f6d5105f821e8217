// Software prefetches spread over a kernel's work.
//
// The CPUs these kernels were measured on drop most of a burst of prefetches
// issued back to back: asking for a split's 1,536 lines at once brought them no
// sooner than not asking, while the same lines asked one every few dozen
// instructions all arrived in time. So the host kernels queue what they will
// read next in a prefetch_walk and step it from their inner loops.
// Prefetches never change a result.
#pragma once

#include <cstdint>

namespace lynx::detail {

/// Asks for every 64-byte line of [p, p + bytes) at once (Hint: 3 into L1, 2
/// into L2): for the few lines of one row or block, not for a whole split.
template <int Hint>
__attribute__((always_inline)) inline void prefetch_lines(const void* p, std::int64_t bytes) {
  for (std::int64_t o = 0; o < bytes; o += 64)
    __builtin_prefetch(static_cast<const char*>(p) + o, 0, Hint);
}

/// Byte ranges asked into the cache a few 64-byte lines per step, in order.
/// Adjacent ranges merge, so the plane rows of one stream count once.
struct prefetch_walk {
  static constexpr int max_ranges = 12;
  const char* at = nullptr;    // the next line of the current range
  const char* stop = nullptr;  // the end of the current range
  const char* queued_at[max_ranges] = {};
  const char* queued_end[max_ranges] = {};
  int queued = 0, taken = 0;

  void add(const void* base, std::int64_t bytes) {
    if (bytes <= 0) return;
    const char* p = static_cast<const char*>(base);
    if (queued > taken && queued_end[queued - 1] == p) {  // continues the last range
      queued_end[queued - 1] = p + bytes;
    } else {
      if (queued == max_ranges) return;
      queued_at[queued] =
          reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t{63});
      queued_end[queued] = p + bytes;
      ++queued;
    }
    if (at >= stop) next_range();
  }
  /// Lines still to ask for.
  [[nodiscard]] std::int64_t lines_left() const {
    std::int64_t n = at < stop ? (stop - at + 63) / 64 : 0;
    for (int r = taken; r < queued; ++r) n += (queued_end[r] - queued_at[r] + 63) / 64;
    return n;
  }
  void next_range() {
    if (taken == queued) return;
    at = queued_at[taken];
    stop = queued_end[taken];
    ++taken;
  }
  /// Asks for the next `Lines` lines.
  template <int Lines = 1>
  __attribute__((always_inline)) void step() {
    for (int k = 0; k < Lines; ++k) {
      if (at < stop) [[likely]] {
        __builtin_prefetch(at, 0, 3);
        at += 64;
      } else if (taken < queued) {
        next_range();
        --k;
      } else {
        return;
      }
    }
  }
  /// Asks for the next n lines (n small: the few lines of one step).
  void step_n(int n) {
    for (int k = 0; k < n; ++k) step();
  }
};

/// Lines per step for a walk to end within `steps` steps (0 for an empty walk).
inline int walk_step_lines(const prefetch_walk& walk, std::int64_t steps) {
  return static_cast<int>((walk.lines_left() + steps - 1) / steps);
}

}  // namespace lynx::detail
